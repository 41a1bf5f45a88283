/* test_corrupt.c -- damaged store files: a clear error, never a crash or a misread.
 *
 * Zero-length, foreign and truncated files must be refused (ENOTSTORE or
 * ECORRUPT), a changed format number gives EVERSION, and a refused file must
 * be left exactly as it was. Then bit flips: every bit of the 4 KiB header,
 * and random bits (fixed seed) in the rest of the metadata. After a flip the
 * store must either be refused with a clear error, or open and then:
 *   - for header flips (strict): every read exact and tally_store_check
 *     passing; damage found only after open counts as a failure, since the
 *     header is what open validates;
 *   - for other metadata: every counter either reads its exact value or
 *     gives ECORRUPT (a clear error after open is allowed there);
 *   - ENOENT for a counter that exists, or a wrong value, is a misread;
 *   - if tally_store_check passes, nothing may have reported ECORRUPT, and
 *     creating and incrementing a new counter must not disturb the others.
 * Cell words are never flipped: a cell holds a bare int64, so a flipped cell
 * bit is a changed value that no format can detect. Cell words are found by
 * diffing two copies of the store that differ only in the value of every
 * used cell (3 vs 7, written through incr_shard). Unused cells of partly
 * filled chunks look like zero metadata; a flip there is harmless to existing counters,
 * so those trials are run and must pass too.
 * Flips run in forked children, one batch per child; a child that dies by
 * a signal (or a sanitizer) is reported with the bit it was on.
 */
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>

#include "testutil.h"

static char g_dir[1024];

/* ---- files ---------------------------------------------------------------- */

static unsigned char *read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char *buf = malloc((size_t)n + 1);
  if (fread(buf, 1, (size_t)n, f) != (size_t)n) {
    free(buf);
    fclose(f);
    return NULL;
  }
  fclose(f);
  *len = (size_t)n;
  return buf;
}

static void write_file(const char *path, const void *buf, size_t len) {
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (fd < 0 || (len && write(fd, buf, len) != (ssize_t)len)) {
    perror(path);
    exit(1);
  }
  close(fd);
}

static int same_file(const char *path, const void *buf, size_t len) {
  size_t n;
  unsigned char *b = read_file(path, &n);
  int same = b && n == len && memcmp(b, buf, len) == 0;
  free(b);
  return same;
}

/* Open path expecting a refusal with one of the allowed codes; the message
 * names the file and the file is left untouched. */
static void expect_refused(const char *what, const char *path, int a, int b) {
  char spec[1300];
  size_t len0;
  unsigned char *before = read_file(path, &len0);
  tally_store *s = (tally_store *)0x1;
  snprintf(spec, sizeof spec, "file:%s", path);
  for (int nocreate = 0; nocreate < 2; nocreate++) {
    tally_open_options oo = {0, nocreate ? TALLY_OPEN_NOCREATE : 0};
    int rc = tally_store_open(spec, &oo, &s);
    atomic_fetch_add(&tu_checks, 1);
    if (rc == 0) {
      TU_FAIL("%s: opened (expected %s%s%s)", what, tally_err_name(a), b ? " or " : "",
              b ? tally_err_name(b) : "");
      tally_store_close(s);
      s = (tally_store *)0x1;
    } else if (rc != a && rc != b) {
      TU_FAIL("%s: got %s (expected %s%s%s): %s", what, tally_err_name(rc),
              tally_err_name(a), b ? " or " : "", b ? tally_err_name(b) : "",
              tally_errmsg());
    }
    if (rc != 0 && !strstr(tally_errmsg(), path))
      TU_FAIL("%s: message does not name the file: \"%s\"", what, tally_errmsg());
    if (rc != 0 && s != (tally_store *)0x1) TU_FAIL("%s: *out written on failure", what);
  }
  if (!same_file(path, before, len0)) TU_FAIL("%s: a refused file was modified", what);
  printf("  %-34s -> %s: %s\n", what, tally_err_name(tally_store_open(spec, NULL, &s)),
         tally_errmsg());
  free(before);
}

/* ---- the reference store -------------------------------------------------- */

#define MAXK 2000
typedef struct ref {
  int n;
  char names[MAXK][24];
  int64_t values[MAXK];
  uint32_t shards[MAXK];
  int nfam;
  char fam_pat[4][16];
  tally_counter_options fam_opt[4];
  int64_t total;
} ref;

/* Build a store with `n` counters of shard counts cycling through `classes`
 * and every shard holding cellval; values recorded in r. */
static void build(const char *path, int n, const uint32_t *classes, int nclasses,
                  int64_t cellval, ref *r) {
  char spec[1300];
  tally_store *s = NULL;
  unlink(path);
  snprintf(spec, sizeof spec, "file:%s", path);
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  memset(r, 0, sizeof *r);
  static const char *pats[] = {"fam:*", "fam:a*", "x?y*"};
  for (int i = 0; i < 3; i++) {
    tally_counter_options o = {(uint32_t)(3 + i * 5), i};
    snprintf(r->fam_pat[i], sizeof r->fam_pat[i], "%s", pats[i]);
    r->fam_opt[i] = o;
    REQUIRE_OK(tally_family_set(s, pats[i], strlen(pats[i]), &o));
  }
  r->nfam = 3;
  for (int i = 0; i < n; i++) {
    tally_counter *c = NULL;
    uint32_t sh = classes[i % nclasses];
    snprintf(r->names[i], sizeof r->names[i], "c:%d:%u", i, sh);
    REQUIRE_OK(tu_counter(s, r->names[i], sh, i % 4, TALLY_COUNTER_CREATE, &c));
    for (uint32_t k = 0; k < sh; k++) REQUIRE_OK(tally_counter_incr_shard(c, k, cellval));
    r->shards[i] = sh;
    r->values[i] = cellval * (int64_t)sh;
    r->total += r->values[i];
    tally_counter_close(c);
  }
  /* one dropped and one resharded counter, so retired cells exist too */
  if (n > 0) {
    tally_counter *c = NULL;
    REQUIRE_OK(tu_counter(s, r->names[0], 0, -1, 0, &c));
    REQUIRE_OK(tally_counter_reshard(c, 6));
    r->shards[0] = 6;
    tally_counter_close(c);
  }
  {
    tally_counter *c = NULL;
    REQUIRE_OK(tu_counter(s, "gone", 4, 0, TALLY_COUNTER_CREATE, &c));
    tally_counter_close(c);
    REQUIRE_OK(tally_store_drop(s, "gone", 4));
  }
  r->n = n;
  REQUIRE_OK(tally_store_check(s));
  tally_store_close(s);
}

/* Make every used cell of the store at path go from cellval to the
 * complementary pattern (same counters, via incr_shard). */
static void flip_cells(const char *path, const ref *r, int64_t delta) {
  char spec[1300];
  tally_store *s = NULL;
  snprintf(spec, sizeof spec, "file:%s", path);
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  for (int i = 0; i < r->n; i++) {
    tally_counter *c = NULL;
    REQUIRE_OK(tu_counter(s, r->names[i], 0, -1, 0, &c));
    for (uint32_t k = 0; k < r->shards[i]; k++)
      REQUIRE_OK(tally_counter_incr_shard(c, k, delta));
    tally_counter_close(c);
  }
  tally_store_close(s);
}

/* ---- one trial ------------------------------------------------------------ */

enum { R_REFUSED, R_DETECTED, R_CLEAN, R_FAIL, R_NCAT };
static const char *cat_names[] = {"refused at open", "detected (ECORRUPT) after open",
                                  "opened, all exact", "FAILED"};

typedef struct flip_page {
  atomic_long cur; /* trial the child is on */
  atomic_long cats[R_NCAT];
  atomic_long codes[16]; /* refusals by -code */
  atomic_int fails_printed;
} flip_page;

static flip_page *g_fp;

#define TFAIL(...)                                                                       \
  do {                                                                                   \
    if (atomic_fetch_add(&g_fp->fails_printed, 1) < 30) {                                \
      fprintf(stderr, "  FLIP FAIL %s: ", what);                                         \
      fprintf(stderr, __VA_ARGS__);                                                      \
      fputc('\n', stderr);                                                               \
    }                                                                                    \
    failed = 1;                                                                          \
  } while (0)

/* Read every counter of r; returns 0 all exact, 1 some ECORRUPT, -1 misread. */
static int read_all(tally_store *s, const ref *r, const char *what, int *failedp) {
  int failed = 0, detected = 0;
  for (int i = 0; i < r->n; i++) {
    tally_counter *c = NULL;
    int rc = tu_counter(s, r->names[i], 0, -1, 0, &c);
    if (rc == TALLY_ECORRUPT) {
      detected = 1;
      continue;
    }
    if (rc != 0) {
      TFAIL("counter %s: open -> %s (%s)", r->names[i], tally_err_name(rc),
            tally_errmsg());
      continue;
    }
    int64_t v = 0;
    rc = tally_counter_value(c, &v);
    if (rc == TALLY_ECORRUPT)
      detected = 1;
    else if (rc != 0)
      TFAIL("counter %s: value -> %s (%s)", r->names[i], tally_err_name(rc),
            tally_errmsg());
    else if (v != r->values[i])
      TFAIL("counter %s reads %lld, was %lld", r->names[i], (long long)v,
            (long long)r->values[i]);
    tally_counter_close(c);
  }
  int64_t sum = 0;
  uint64_t count = 0;
  int rc = tally_store_sum(s, "c:*", 3, &sum, &count);
  if (rc == TALLY_ECORRUPT)
    detected = 1;
  else if (rc != 0)
    TFAIL("sum -> %s", tally_err_name(rc));
  else if (sum != r->total || count != (uint64_t)r->n)
    TFAIL("sum(c:*) = %lld over %llu counters, was %lld over %d", (long long)sum,
          (unsigned long long)count, (long long)r->total, r->n);
  for (int i = 0; i < r->nfam; i++) {
    tally_counter_options o;
    char nm[32];
    /* a name that only this family (the most recent matching) decides */
    snprintf(nm, sizeof nm, "%s", i == 0 ? "fam:z" : i == 1 ? "fam:a1" : "xqy1");
    rc = tally_family_resolve(s, nm, strlen(nm), &o);
    if (rc == TALLY_ECORRUPT)
      detected = 1;
    else if (rc != 0)
      TFAIL("family_resolve(%s) -> %s", nm, tally_err_name(rc));
    else if (o.shards != r->fam_opt[i].shards || o.policy != r->fam_opt[i].policy)
      TFAIL("family_resolve(%s) = {%u, %d}, was {%u, %d}", nm, o.shards, o.policy,
            r->fam_opt[i].shards, r->fam_opt[i].policy);
  }
  *failedp |= failed;
  return failed ? -1 : detected;
}

static int count_fds(void) {
  int n = 0;
  DIR *d = opendir("/proc/self/fd");
  if (!d) return -1;
  while (readdir(d)) n++;
  closedir(d);
  return n;
}

/* Flip (byte off, bit) of the work file, run the trial, restore the file. */
static void trial(int fd, const char *path, const unsigned char *orig, size_t len,
                  size_t off, int bit, const ref *r, int write_probe, int strict) {
  char spec[1300], what[96];
  int failed = 0, cat;
  snprintf(spec, sizeof spec, "file:%s", path);
  snprintf(what, sizeof what, "byte %zu bit %d", off, bit);
  unsigned char b = orig[off] ^ (unsigned char)(1u << bit);
  if (pwrite(fd, &b, 1, (off_t)off) != 1) {
    perror("pwrite");
    _exit(3);
  }
  tally_store *s = NULL;
  tally_open_options oo = {0, TALLY_OPEN_NOCREATE};
  alarm(20);
  int rc = tally_store_open(spec, &oo, &s);
  if (rc != 0) {
    cat = R_REFUSED;
    if (-rc > 0 && -rc < 16) atomic_fetch_add(&g_fp->codes[-rc], 1);
    const char *m = tally_errmsg();
    if (!m || !*m || !strstr(m, path))
      TFAIL("refused (%s) without naming the file: \"%s\"", tally_err_name(rc), m);
    /* a refused file must be left as it was (only our flipped byte differs) */
    struct stat st;
    if (fstat(fd, &st) != 0 || (size_t)st.st_size != len)
      TFAIL("refused file changed size");
    else {
      unsigned char *now = malloc(len);
      if (pread(fd, now, len, 0) != (ssize_t)len) TFAIL("pread");
      now[off] ^= (unsigned char)(1u << bit);
      if (memcmp(now, orig, len) != 0)
        TFAIL("refused (%s) but the file was modified", tally_err_name(rc));
      free(now);
    }
  } else {
    int got = read_all(s, r, what, &failed);
    int crc = tally_store_check(s);
    if (crc != 0 && crc != TALLY_ECORRUPT) TFAIL("check -> %s", tally_err_name(crc));
    if (crc == 0 && got == 1) TFAIL("check passes but a read reported ECORRUPT");
    if (crc != 0 && (!*tally_errmsg() || !strstr(tally_errmsg(), path)))
      TFAIL("check failed without naming the file: \"%s\"", tally_errmsg());
    if (crc == 0 && got == 0 && write_probe) {
      /* the store claims to be sound: use it, then everything must still be */
      tally_counter *c = NULL;
      int64_t v = 0;
      int prc =
          tu_counter(s, "probe:new", 16, TALLY_POLICY_RANDOM, TALLY_COUNTER_CREATE, &c);
      if (prc == 0) prc = tally_counter_incr(c, 5);
      if (prc == 0) prc = tally_counter_value(c, &v);
      if (prc == 0 && v != 5) TFAIL("a new counter reads %lld after +5", (long long)v);
      if (prc != 0 && prc != TALLY_ECORRUPT)
        TFAIL("probe counter -> %s (%s)", tally_err_name(prc), tally_errmsg());
      tally_counter_close(c);
      if (prc == 0) {
        if (read_all(s, r, what, &failed) != 0)
          TFAIL("existing counters changed after creating one");
        if (tally_store_check(s) != 0)
          TFAIL("check fails after creating a counter: %s", tally_errmsg());
      }
    }
    tally_store_close(s);
    cat = failed ? R_FAIL : (crc != 0 || got == 1) ? R_DETECTED : R_CLEAN;
    if (failed && atomic_load(&g_fp->fails_printed) <= 30)
      fprintf(stderr, "    (and tally_store_check %s)\n",
              crc == 0 ? "PASSED: undetected" : "reported ECORRUPT");
    if (cat == R_DETECTED && strict) {
      /* the header is validated at open: damage found only later means
       * open let a bad header through */
      TFAIL("opened, and only %s found the damage afterwards: %s",
            crc != 0 ? "tally_store_check" : "a read", tally_errmsg());
      cat = R_FAIL;
    }
    /* restore everything: opening may legitimately have repaired or grown it */
    if (ftruncate(fd, (off_t)len) != 0 || pwrite(fd, orig, len, 0) != (ssize_t)len) {
      perror("restore");
      _exit(3);
    }
  }
  alarm(0);
  if (failed) cat = R_FAIL;
  atomic_fetch_add(&g_fp->cats[cat], 1);
  if (pwrite(fd, &orig[off], 1, (off_t)off) != 1) _exit(3);
}

/* Run trials [from, to) of the list (offs, bits) in forked children; a
 * child that dies is reported with its trial and the next child goes on. */
static void run_trials(const char *path, const unsigned char *orig, size_t len,
                       const size_t *offs, const unsigned char *bits, long ntrials,
                       const ref *r, int write_probe, int strict, double budget) {
  long next = 0;
  double t0 = tu_now();
  while (next < ntrials) {
    atomic_store(&g_fp->cur, next);
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
      int fd = open(path, O_RDWR);
      if (fd < 0) _exit(3);
      int fds0 = count_fds();
      for (long i = next; i < ntrials; i++) {
        atomic_store(&g_fp->cur, i);
        if (tu_now() - t0 > budget) break;
        trial(fd, path, orig, len, offs[i], bits[i], r, write_probe, strict);
      }
      int fds1 = count_fds();
      if (fds1 != fds0) {
        fprintf(stderr, "  FLIP FAIL: %d file descriptors leaked over the batch\n",
                fds1 - fds0);
        atomic_fetch_add(&g_fp->cats[R_FAIL], 1);
      }
      atomic_store(&g_fp->cur, ntrials);
      close(fd);
      _exit(0);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    long cur = atomic_load(&g_fp->cur);
    if (cur >= ntrials && WIFEXITED(st) && WEXITSTATUS(st) == 0) break;
    if (tu_now() - t0 > budget && cur >= ntrials) break;
    /* the child died on trial `cur`: report, repair the file, go on */
    atomic_fetch_add(&g_fp->cats[R_FAIL], 1);
    if (atomic_fetch_add(&g_fp->fails_printed, 1) < 30)
      fprintf(stderr, "  FLIP FAIL byte %zu bit %d: the process died (%s %d)\n",
              offs[cur], bits[cur], WIFSIGNALED(st) ? "signal" : "exit status",
              WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
    write_file(path, orig, len);
    next = cur + 1;
    if (tu_now() - t0 > budget) break;
  }
}

static void report(const char *what, long ntrials, double secs) {
  printf("  %s: %ld trials in %.1f s:", what, ntrials, secs);
  for (int c = 0; c < R_NCAT; c++)
    printf(" %s %ld;", cat_names[c], atomic_load(&g_fp->cats[c]));
  printf("\n    refusals by code:");
  for (int i = 1; i < 16; i++)
    if (atomic_load(&g_fp->codes[i]))
      printf(" %s %ld", tally_err_name(-i), atomic_load(&g_fp->codes[i]));
  printf("\n");
  long f = atomic_load(&g_fp->cats[R_FAIL]);
  atomic_fetch_add(&tu_checks, 1);
  if (f) TU_FAIL("%s: %ld trials failed (see FLIP FAIL lines)", what, f);
  long done = 0;
  for (int c = 0; c < R_NCAT; c++) done += atomic_load(&g_fp->cats[c]);
  if (done < ntrials)
    printf("    (time budget reached after %ld of %ld trials)\n", done, ntrials);
}

/* ---- the tests ------------------------------------------------------------ */

static void test_foreign_and_truncated(const char *store_path) {
  char path[1200];
  size_t len;
  unsigned char *orig = read_file(store_path, &len);
  if (!orig) {
    TU_FAIL("cannot read %s", store_path);
    return;
  }
  snprintf(path, sizeof path, "%s/damaged.tly", g_dir);

  write_file(path, "", 0);
  expect_refused("zero-length file", path, TALLY_ENOTSTORE, 0);
  write_file(path, "hello, world\nthis is text\n", 26);
  expect_refused("text file", path, TALLY_ENOTSTORE, 0);
  {
    unsigned char *rnd = malloc(1 << 20);
    uint64_t rng = 1;
    for (int i = 0; i < (1 << 20); i++) rnd[i] = (unsigned char)tu_rng(&rng);
    size_t sizes[] = {1, 8, 100, 4096, 20480, 1 << 20};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
      char what[64];
      snprintf(what, sizeof what, "random bytes (%zu)", sizes[i]);
      write_file(path, rnd, sizes[i]);
      expect_refused(what, path, TALLY_ENOTSTORE, 0);
    }
    /* a zero-filled file of store size */
    memset(rnd, 0, 1 << 20);
    write_file(path, rnd, 1 << 20);
    expect_refused("zero-filled 1 MiB", path, TALLY_ENOTSTORE, 0);
    free(rnd);
  }
  {
    size_t elen;
    unsigned char *elf = read_file("/bin/true", &elen);
    if (elf) {
      write_file(path, elf, elen);
      expect_refused("ELF (/bin/true)", path, TALLY_ENOTSTORE, 0);
      free(elf);
    }
  }
  /* the magic alone, or the magic and garbage */
  write_file(path, orig, 8);
  expect_refused("magic only (8 bytes)", path, TALLY_ENOTSTORE, TALLY_ECORRUPT);

  size_t cuts[] = {1,    7,     9,     100,     4095,       4096,
                   4097, 20479, 20480, len / 2, len - 4096, len - 1};
  for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
    char what[64];
    if (cuts[i] == 0 || cuts[i] >= len) continue;
    snprintf(what, sizeof what, "truncated to %zu of %zu", cuts[i], len);
    write_file(path, orig, cuts[i]);
    expect_refused(what, path, TALLY_ENOTSTORE, TALLY_ECORRUPT);
  }

  /* another format number: EVERSION */
  uint32_t versions[] = {0, 2, 0xFFFFFFFFu};
  uint32_t vorig;
  memcpy(&vorig, orig + 8, 4);
  for (size_t i = 0; i < 3; i++) {
    char what[64];
    unsigned char *copy = malloc(len);
    memcpy(copy, orig, len);
    uint32_t v = versions[i] == 2 ? vorig + 1 : versions[i];
    memcpy(copy + 8, &v, 4);
    snprintf(what, sizeof what, "format %u (was %u)", v, vorig);
    write_file(path, copy, len);
    expect_refused(what, path, TALLY_EVERSION, 0);
    free(copy);
  }
  /* and the untouched copy still opens */
  write_file(path, orig, len);
  {
    char spec[1300];
    tally_store *s = NULL;
    snprintf(spec, sizeof spec, "file:%s", path);
    EXPECT_OK(tally_store_open(spec, NULL, &s));
    if (s) {
      EXPECT_OK(tally_store_check(s));
      tally_store_close(s);
    }
  }
  unlink(path);
  free(orig);
}

static void test_header_flips(const char *store_path, const ref *r) {
  char path[1200];
  size_t len;
  unsigned char *orig = read_file(store_path, &len);
  snprintf(path, sizeof path, "%s/flip-header.tly", g_dir);
  write_file(path, orig, len);
  /* Every bit; under a sanitizer, whose run is for memory errors on these
   * paths and takes ten times as long, every seventh (1 or 2 bits of each
   * byte, each bit position in turn: 7 and 8 share no factor). */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  const long step = 7;
#else
  const long step = 1;
#endif
  long n = 0;
  size_t *offs = malloc((size_t)4096 * 8 * sizeof *offs);
  unsigned char *bits = malloc((size_t)4096 * 8);
  for (long i = 0; i < 4096 * 8; i += step) {
    offs[n] = (size_t)(i / 8);
    bits[n++] = (unsigned char)(i % 8);
  }
  memset(g_fp, 0, sizeof *g_fp);
  double t0 = tu_now();
  run_trials(path, orig, len, offs, bits, n, r, 1, 1, 240);
  report(step == 1 ? "header bit flips (every bit of bytes 0..4095)"
                   : "header bit flips (every third bit of bytes 0..4095)",
         n, tu_now() - t0);
  free(offs);
  free(bits);
  free(orig);
  unlink(path);
}

static void test_meta_flips(const char *store_path, const char *other_path,
                            const ref *r) {
  char path[1200], spec[1300];
  size_t len, len2;
  unsigned char *orig = read_file(store_path, &len);
  unsigned char *other = read_file(other_path, &len2);
  tally_store *s = NULL;
  tally_store_stats st;
  snprintf(spec, sizeof spec, "file:%s", store_path);
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  REQUIRE_OK(tally_store_stats_get(s, &st));
  tally_store_close(s);
  size_t used = st.used_bytes < len ? (size_t)st.used_bytes : len;
  if (used <= 4096 || len2 != len) {
    TU_FAIL("cannot find the metadata: used %zu, lengths %zu %zu", used, len, len2);
    return;
  }
  /* cell words: 8-byte words that differ between the two versions */
  unsigned char *is_cell = calloc(len / 8 + 1, 1);
  size_t ncell = 0, nmeta = 0, nhdrdiff = 0;
  for (size_t w = 0; w < len / 8; w++) {
    if (memcmp(orig + w * 8, other + w * 8, 8) != 0) {
      if (w * 8 < 4096) {
        nhdrdiff++;
        continue;
      }
      is_cell[w] = 1;
      ncell++;
    }
  }
  size_t *cands = malloc((used / 8) * sizeof *cands);
  for (size_t w = 4096 / 8; w < used / 8; w++)
    if (!is_cell[w]) cands[nmeta++] = w;
  printf("  metadata flips: store of %zu bytes, %zu used; %zu cell words skipped, %zu "
         "other words "
         "(%zu header words changed by the second writer, not flipped here)\n",
         len, used, ncell, nmeta, nhdrdiff);
  {
    /* expected number of cell words: every shard of every counter */
    size_t want = 0;
    for (int i = 0; i < r->n; i++) want += r->shards[i];
    EXPECT_I64(want, ncell);
  }
  /* words that are non-zero are certainly metadata (records, index,
   * families, class table); favour them: 3 of 4 trials */
  size_t *nz = malloc(nmeta * sizeof *nz), nnz = 0;
  for (size_t i = 0; i < nmeta; i++) {
    uint64_t x;
    memcpy(&x, orig + cands[i] * 8, 8);
    if (x) nz[nnz++] = cands[i];
  }
  long n = 12000;
  size_t *offs = malloc((size_t)n * sizeof *offs);
  unsigned char *bits = malloc((size_t)n);
  uint64_t rng = 0xC0FFEE;
  for (long i = 0; i < n; i++) {
    size_t w = (i % 4 && nnz) ? nz[tu_rng(&rng) % nnz] : cands[tu_rng(&rng) % nmeta];
    unsigned bitno = (unsigned)(tu_rng(&rng) % 64);
    offs[i] = w * 8 + bitno / 8;
    bits[i] = (unsigned char)(bitno % 8);
  }
  snprintf(path, sizeof path, "%s/flip-meta.tly", g_dir);
  write_file(path, orig, len);
  memset(g_fp, 0, sizeof *g_fp);
  double t0 = tu_now();
  run_trials(path, orig, len, offs, bits, n, r, 1, 0, 90);
  char what[128];
  snprintf(what, sizeof what,
           "metadata bit flips (seed 0xC0FFEE, %zu non-zero words favoured)", nnz);
  report(what, n, tu_now() - t0);
  free(offs);
  free(bits);
  free(nz);
  free(cands);
  free(is_cell);
  free(orig);
  free(other);
  unlink(path);
}

/* Every bit of every class table entry in use: a damaged entry must be
 * refused (at open, or when a counter of that shard count is created),
 * never hand out cells an existing counter owns. Each of the 10 counters
 * per class holds its own value, so a shared column shows. */
static void test_class_flips(void) {
  char path[1200], spec[1300];
  static const uint32_t classes[] = {1, 5, 16};
  snprintf(path, sizeof path, "%s/classes.tly", g_dir);
  snprintf(spec, sizeof spec, "file:%s", path);
  unlink(path);
  tally_store *s = NULL;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  for (int k = 0; k < 3; k++)
    for (int i = 0; i < 10; i++) {
      char nm[32];
      tally_counter *c = NULL;
      snprintf(nm, sizeof nm, "k%u:%d", classes[k], i);
      REQUIRE_OK(tu_counter(s, nm, classes[k], 0, TALLY_COUNTER_CREATE, &c));
      EXPECT_OK(tally_counter_incr_shard(c, 0, i + 1));
      tally_counter_close(c);
    }
  tally_store_close(s);
  int fd = open(path, O_RDWR);
  int refused = 0, harmless = 0;
  for (int k = 0; k < 3; k++)
    for (int bit = 0; bit < 128; bit++) {
      off_t off = 4096 + (off_t)(classes[k] - 1) * 16 + bit / 8;
      unsigned char b, f;
      if (pread(fd, &b, 1, off) != 1) TU_FAIL("pread");
      f = b ^ (unsigned char)(1u << (bit % 8));
      if (pwrite(fd, &f, 1, off) != 1) TU_FAIL("pwrite");
      int rc = tally_store_open(spec, NULL, &s), created = 0;
      if (rc == 0) {
        tally_counter *c = NULL;
        rc = tu_counter(s, "newcomer", classes[k], 0, TALLY_COUNTER_CREATE, &c);
        if (rc == 0) {
          created = 1;
          EXPECT_OK(tally_counter_incr_shard(c, 0, 1000));
          tally_counter_close(c);
          for (int i = 0; i < 10; i++) { /* the others are untouched */
            char nm[32];
            snprintf(nm, sizeof nm, "k%u:%d", classes[k], i);
            if (tu_counter(s, nm, 0, -1, 0, &c) == 0) {
              int64_t v = tu_value(c);
              if (v != i + 1)
                TU_FAIL("class %u bit %d: %s reads %lld after a flip", classes[k], bit,
                        nm, (long long)v);
              tally_counter_close(c);
            }
          }
          EXPECT_OK(tally_store_drop(s, "newcomer", 8));
        }
        tally_store_close(s);
      }
      if (rc != 0 && rc != TALLY_ECORRUPT)
        TU_FAIL("class %u bit %d: %s, expected ECORRUPT", classes[k], bit,
                tally_err_name(rc));
      if (rc != 0)
        refused++;
      else if (created)
        harmless++;
      if (pwrite(fd, &b, 1, off) != 1) TU_FAIL("pwrite");
    }
  close(fd);
  /* the first 8 bytes of an entry are the checked word: all of them refused */
  EXPECT(refused >= 3 * 64);
  printf("  class table flips: %d refused, %d harmless (unused bytes)\n", refused,
         harmless);
}

/* Two parts, each about half the time, so that ctest runs them side by
 * side (under AddressSanitizer the whole took 166 s of a 300 s limit):
 * "header" (the small store) and "meta" (the dense one); no argument runs
 * both. */
int main(int argc, char **argv) {
  char small[1200], big[1200], big2[1200];
  static ref rs, rb;
  const char *part = argc > 1 ? argv[1] : "all";
  int header = !strcmp(part, "all") || !strcmp(part, "header");
  int meta = !strcmp(part, "all") || !strcmp(part, "meta");
  if (!header && !meta) {
    fprintf(stderr, "usage: test_corrupt [header|meta]\n");
    return 2;
  }
  snprintf(g_dir, sizeof g_dir, "%s", tu_tmpdir("corrupt"));
  g_fp = mmap(NULL, sizeof(flip_page), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
              -1, 0);
  if (g_fp == MAP_FAILED) return 1;
  signal(SIGALRM, SIG_DFL);

  /* small store for the header flips and the damaged-file cases */
  if (header) {
    snprintf(small, sizeof small, "%s/small.tly", g_dir);
    static const uint32_t cls_small[] = {1, 2, 16, 5};
    build(small, 12, cls_small, 4, 12345, &rs);
    test_foreign_and_truncated(small);
    test_header_flips(small, &rs);
    test_class_flips();
  }
  if (!meta) {
    tu_rmrf(g_dir);
    return tu_finish("test_corrupt header");
  }

  /* a store dense in metadata for the rest: full chunks of small classes */
  snprintf(big, sizeof big, "%s/meta-a.tly", g_dir);
  snprintf(big2, sizeof big2, "%s/meta-b.tly", g_dir);
  static const uint32_t cls_big[] = {1, 2, 3};
  build(big, 1560, cls_big, 3, 3, &rb);
  {
    /* the same bytes with every used cell complemented in value bits */
    size_t len;
    unsigned char *b = read_file(big, &len);
    write_file(big2, b, len);
    free(b);
    flip_cells(big2, &rb, 4);
  }
  test_meta_flips(big, big2, &rb);
  tu_rmrf(g_dir);
  return tu_finish(header ? "test_corrupt" : "test_corrupt meta");
}
