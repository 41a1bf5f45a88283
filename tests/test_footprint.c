/* test_footprint.c -- bytes per counter, held to a golden figure (issue 13).
 *
 * The Envoy-style golden test: 100,000 counters "fp:I" go into a fresh file
 * store, with the default options, 1 shard, and (each in another store) 16
 * shards; then with the default options and 17-byte names "post:NNNNNN:likes"
 * (the shape of scripts/bench's million, whose records are cut in 8-byte
 * units from format 9: 88 bytes, not 96). The store's
 * live bytes (tally_store_stats_get: headers, index, records, names and
 * cells) over the counter count must stay at or under the golden figure.
 * A change that shrinks counters lowers the golden figure with it, so the
 * gain is kept; a change that grows them fails here and must justify
 * raising it. Each golden is the figure measured when it was last set,
 * rounded up to the next multiple of 8 bytes. The file's size is printed
 * too (it grows in steps, so it is not what is held).
 *
 * And a memory store's pages: its first 2 MiB are plain pages (a small
 * store stays small), the rest of its arena is marked for transparent huge
 * pages (a million cold counters' cells are scattered over ~2,000 pages).
 */
#include "testutil.h"

#include "../src/core/internal.h"

#define N_COUNTERS 100000

static const struct {
  uint32_t shards;
  const char *names; /* a printf format of the counter number */
  double golden;     /* bytes per counter, live */
} cases[] = {
    {0, "fp:%d", 112}, /* the default: automatic shards, one cell to start */
    {1, "fp:%d", 112},
    {16, "fp:%d", 232},
    {0, "post:%06d:likes", 120}, /* 128 with 16-byte units */
};

static void footprint(const char *dir, uint32_t shards, const char *names,
                      double golden) {
  char spec[1200], path[1100], file[32];
  tally_store *s = NULL;
  tally_store_stats st;
  struct stat sb;
  snprintf(file, sizeof file, "fp%u-%zu.tly", shards, strlen(names));
  tu_spec(spec, sizeof spec, path, sizeof path, dir, file);
  unlink(path);
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  for (int i = 0; i < N_COUNTERS; i++) {
    char name[32];
    tally_counter *c = NULL;
    int len = snprintf(name, sizeof name, names, i);
    tally_counter_options o = {shards, TALLY_POLICY_THREAD};
    REQUIRE_OK(tally_counter_open(s, name, (size_t)len, &o, TALLY_COUNTER_CREATE, &c));
    tally_counter_close(c);
  }
  EXPECT_OK(tally_store_stats_get(s, &st));
  EXPECT_I64(N_COUNTERS, st.counters);
  tally_store_close(s);
  EXPECT(stat(path, &sb) == 0);
  double per = (double)st.live_bytes / N_COUNTERS;
  uint64_t next = ((st.live_bytes + N_COUNTERS - 1) / N_COUNTERS + 7) / 8 * 8;
  char what[80];
  if (shards)
    snprintf(what, sizeof what, "%u shard%s, names %s", shards, shards > 1 ? "s" : "",
             names);
  else
    snprintf(what, sizeof what, "default (automatic) shards, names %s", names);
  printf("test_footprint: %d counters, %s: %.2f live bytes per counter "
         "(golden %.0f; measured, rounded up: %llu), file %.2f bytes per counter\n",
         N_COUNTERS, what, per, golden, (unsigned long long)next,
         (double)sb.st_size / N_COUNTERS);
  if (per > golden)
    TU_FAIL("%s: %.2f bytes per counter, over the golden %.0f: shrink it back, "
            "or justify raising the golden in tests/test_footprint.c",
            what, per, golden);
  else if ((double)next < golden)
    printf("test_footprint: %s: smaller than the golden: lower it to %llu\n", what,
           (unsigned long long)next);
  atomic_fetch_add(&tu_checks, 1);
  unlink(path);
}

/* The VmFlags and Rss (kB) of the mapping that starts at `at`, from
 * /proc/self/smaps; false if none starts there. */
static bool mapping_at(uintptr_t at, char *flags, size_t cap, long *rss_kb) {
  FILE *f = fopen("/proc/self/smaps", "r");
  if (!f) return false;
  char line[512];
  bool in = false, found = false;
  while (fgets(line, sizeof line, f)) {
    unsigned long lo, hi;
    if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 &&
        strchr(line, '-') < strchr(line, ' ')) {
      if (found) break;
      in = lo == at;
      found = found || in;
    } else if (in && strncmp(line, "Rss:", 4) == 0) {
      *rss_kb = atol(line + 4);
    } else if (in && strncmp(line, "VmFlags:", 8) == 0) {
      snprintf(flags, cap, "%s", line + 8);
    }
  }
  fclose(f);
  return found;
}

static void test_memory_pages(void) {
  if (access("/sys/kernel/mm/transparent_hugepage/enabled", F_OK) != 0) {
    printf(
        "test_footprint: no transparent huge pages in this kernel: page check skipped\n");
    return;
  }
  tally_store *s = NULL;
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  for (int i = 0; i < 100; i++) {
    char name[32];
    int len = snprintf(name, sizeof name, "pages:%d", i);
    EXPECT_OK(tally_store_incr(s, name, (size_t)len, 1, TALLY_COUNTER_CREATE));
  }
  char flags[512] = "", more[512] = "";
  long rss = -1, rss_more = -1;
  uintptr_t base = (uintptr_t)s->base;
  EXPECT(mapping_at(base, flags, sizeof flags, &rss));
  EXPECT(mapping_at(base + (UINT64_C(2) << 20), more, sizeof more, &rss_more));
  EXPECT(strstr(flags, " hg") == NULL); /* the first 2 MiB: plain pages */
  EXPECT(strstr(more, " hg") != NULL);  /* the rest: MADV_HUGEPAGE */
  EXPECT(rss >= 0 && rss < 1024);       /* 100 counters: well under 2 MiB */
  printf("test_footprint: a memory store of 100 counters: %ld kB resident\n", rss);
  tally_store_close(s);
}

int main(void) {
  test_memory_pages();
  const char *dir = tu_tmpdir("footprint");
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    footprint(dir, cases[i].shards, cases[i].names, cases[i].golden);
  tu_rmrf(dir);
  return tu_finish("test_footprint");
}
