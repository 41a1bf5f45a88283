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
 */
#include "testutil.h"

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

int main(void) {
  const char *dir = tu_tmpdir("footprint");
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    footprint(dir, cases[i].shards, cases[i].names, cases[i].golden);
  tu_rmrf(dir);
  return tu_finish("test_footprint");
}
