/* test_histogram.c -- a histogram's writer (src/core/histogram.c).
 *
 *  - open: bounds finite and strictly increasing, a unit > 0, at most
 *    TALLY_HISTOGRAM_MAX_BOUNDS, distinct names for every member; a member
 *    that is not a slot counter is refused; nothing is returned on failure;
 *  - the shape mark: tally_histogram_stored says NEW before the +Inf
 *    bucket exists, SAME for the names its first writer opened it with
 *    (kept across a reopen and a compaction), OTHER for other names or a
 *    bucket of another policy;
 *  - observe: v goes to the first bucket whose bound is >= v (+Inf past
 *    the last), for the branch-free count (<= 16 bounds) and the binary
 *    search (more) alike, checked against a plain scan; the sum is v / unit
 *    rounded to the nearest integer, halves away from zero; a NaN or a
 *    |v / unit| over 2^53 is refused and adds nothing;
 *  - threads: four threads share one writer; totals exact, and every
 *    snapshot taken meanwhile has sum = count (each observes 1.0, unit 1);
 *  - processes: two processes observe into a file store while this one
 *    takes snapshots: sum = count in every one, totals exact;
 *  - SIGKILL: a writer stopped for good between the bucket and the sum
 *    holds a snapshot up while it lives; once killed, the snapshot goes on
 *    within 100 ms and shows neither;
 *  - buffered: nothing reaches the store until the buffer is full (at the
 *    next observation), flushed or closed, then all of it, exactly; a
 *    buffer is flushed before a 64th bucket with a count and before its
 *    sum overflows, so each flush is one batch (a snapshot's sum always
 *    equals its count, in the processes case too); a flush that fails
 *    keeps the buffer and the observation that needed it is refused;
 *  - the short way (tally__batch_try2): it writes the journal the whole way
 *    writes, and gives way to it for a sum leaving its range and for a
 *    dropped member whose space other counters took (nothing of theirs
 *    changes).
 */
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"

#include "../src/core/internal.h" /* tally__me: the writer's journal */

static char g_dir[1024];

#define MAXB 64
static const char *const NAMES4[] = {"h{le=1}",  "h{le=2}",    "h{le=5}",
                                     "h{le=10}", "h{le=+Inf}", "h{sum}"};
static const double BOUNDS4[] = {1, 2, 5, 10};

/* Member i of the histogram "h" (i = nbounds + 1: the sum), read through a
 * handle of its own. */
static int64_t member(tally_store *s, const char *name) {
  tally_counter *c;
  if (tally_counter_open(s, name, strlen(name), NULL, 0, &c)) return -1;
  int64_t v = tu_value(c);
  tally_counter_close(c);
  return v;
}

/* ---- open ------------------------------------------------------------------------ */

static void test_open(void) {
  tally_store *s;
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  tally_histogram *h = (tally_histogram *)0x1;
  EXPECT_RC(TALLY_EINVAL, tally_histogram_open(NULL, BOUNDS4, 4, NAMES4, 1, &h));
  EXPECT_RC(TALLY_EINVAL, tally_histogram_open(s, NULL, 4, NAMES4, 1, &h));
  EXPECT_RC(TALLY_EINVAL, tally_histogram_open(s, BOUNDS4, 4, NULL, 1, &h));
  EXPECT_RC(TALLY_EINVAL, tally_histogram_open(s, BOUNDS4, 4, NAMES4, 1, NULL));
  double down[] = {1, 5, 2, 10}, same[] = {1, 2, 2, 10}, nan_[] = {1, NAN, 5, 10},
         inf[] = {1, 2, 5, INFINITY};
  EXPECT_RC(TALLY_EINVAL, tally_histogram_open(s, down, 4, NAMES4, 1, &h));
  EXPECT_RC(TALLY_EINVAL, tally_histogram_open(s, same, 4, NAMES4, 1, &h));
  EXPECT_RC(TALLY_EINVAL, tally_histogram_open(s, nan_, 4, NAMES4, 1, &h));
  EXPECT_RC(TALLY_EINVAL, tally_histogram_open(s, inf, 4, NAMES4, 1, &h));
  EXPECT_RC(TALLY_EINVAL, tally_histogram_open(s, BOUNDS4, 4, NAMES4, 0, &h));
  EXPECT_RC(TALLY_EINVAL, tally_histogram_open(s, BOUNDS4, 4, NAMES4, -1, &h));
  EXPECT_RC(TALLY_EINVAL, tally_histogram_open(s, BOUNDS4, 4, NAMES4, NAN, &h));
  EXPECT_RC(TALLY_EINVAL, tally_histogram_open(s, BOUNDS4, 4, NAMES4, INFINITY, &h));
  EXPECT_RC(TALLY_EINVAL, tally_histogram_open(s, BOUNDS4, TALLY_HISTOGRAM_MAX_BOUNDS + 1,
                                               NAMES4, 1, &h));
  const char *holes[] = {"h{le=1}", NULL, "h{le=5}", "h{le=10}", "h{le=+Inf}", "h{sum}"};
  EXPECT_RC(TALLY_EINVAL, tally_histogram_open(s, BOUNDS4, 4, holes, 1, &h));
  const char *twice[] = {"t{le=1}",  "t{le=2}",    "t{le=5}",
                         "t{le=10}", "t{le=+Inf}", "t{le=2}"};
  EXPECT_RC(TALLY_EINVAL, tally_histogram_open(s, BOUNDS4, 4, twice, 1, &h));
  EXPECT(strstr(tally_errmsg(), "named twice") != NULL);
  /* a member that exists as another kind of counter */
  tally_counter *plain;
  REQUIRE_OK(
      tu_counter(s, "g{le=2}", 4, TALLY_POLICY_THREAD, TALLY_COUNTER_CREATE, &plain));
  const char *g[] = {"g{le=1}", "g{le=2}", "g{le=5}", "g{le=10}", "g{le=+Inf}", "g{sum}"};
  EXPECT_RC(TALLY_EPOLICY, tally_histogram_open(s, BOUNDS4, 4, g, 1, &h));
  EXPECT(strstr(tally_errmsg(), "g{le=2}") != NULL);
  EXPECT(h == (tally_histogram *)0x1); /* untouched on failure */
  tally_counter_close(plain);
  /* no bounds at all: one +Inf bucket and the sum */
  const char *one[] = {"o{le=+Inf}", "o{sum}"};
  REQUIRE_OK(tally_histogram_open(s, NULL, 0, one, 1, &h));
  EXPECT_OK(tally_histogram_observe(h, 3));
  EXPECT_I64(1, member(s, "o{le=+Inf}"));
  EXPECT_I64(3, member(s, "o{sum}"));
  tally_histogram_close(h);
  tally_histogram_close(NULL);
  tally_store_close(s);
}

/* ---- the shape mark (tally_histogram_stored) --------------------------------------- */

static void test_stored(void) {
  char spec[1200], path[1100];
  tu_spec(spec, sizeof spec, path, sizeof path, g_dir, "stored.tly");
  tally_store *s;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  EXPECT_RC(TALLY_EINVAL, tally_histogram_stored(NULL, NAMES4, 4));
  EXPECT_RC(TALLY_EINVAL, tally_histogram_stored(s, NULL, 4));
  const char *holes[] = {"h{le=1}", NULL, "h{le=5}", "h{le=10}", "h{le=+Inf}", "h{sum}"};
  EXPECT_RC(TALLY_EINVAL, tally_histogram_stored(s, holes, 4));
  EXPECT_RC(TALLY_HISTOGRAM_NEW, tally_histogram_stored(s, NAMES4, 4));
  tally_histogram *h;
  REQUIRE_OK(tally_histogram_open(s, BOUNDS4, 4, NAMES4, 1, &h));
  EXPECT_OK(tally_histogram_observe(h, 3));
  EXPECT_RC(TALLY_HISTOGRAM_SAME, tally_histogram_stored(s, NAMES4, 4));
  /* the same +Inf bucket asked for with other bounds, or another sum */
  const char *fewer[] = {"h{le=1}", "h{le=2}", "h{le=+Inf}", "h{sum}"};
  const char *unit[] = {"h{le=1}",  "h{le=2}",    "h{le=5}",
                        "h{le=10}", "h{le=+Inf}", "h{sum,unit=2}"};
  EXPECT_RC(TALLY_HISTOGRAM_OTHER, tally_histogram_stored(s, fewer, 2));
  EXPECT_RC(TALLY_HISTOGRAM_OTHER, tally_histogram_stored(s, unit, 4));
  /* the first writer's mark stays: another writer's names do not replace it */
  tally_histogram *h2;
  REQUIRE_OK(tally_histogram_open(s, BOUNDS4, 2, fewer, 1, &h2));
  tally_histogram_close(h2);
  EXPECT_RC(TALLY_HISTOGRAM_SAME, tally_histogram_stored(s, NAMES4, 4));
  EXPECT_RC(TALLY_HISTOGRAM_OTHER, tally_histogram_stored(s, fewer, 2));
  /* a +Inf bucket that is no histogram's: a counter of another policy */
  tally_counter *plain;
  REQUIRE_OK(
      tu_counter(s, "p{le=+Inf}", 4, TALLY_POLICY_THREAD, TALLY_COUNTER_CREATE, &plain));
  const char *p[] = {"p{le=+Inf}", "p{sum}"};
  EXPECT_RC(TALLY_HISTOGRAM_OTHER, tally_histogram_stored(s, p, 0));
  tally_counter_close(plain);
  tally_histogram_close(h);
  tally_store_close(s);
  /* kept in the file: across a reopen and a compaction */
  EXPECT_OK(tally_store_compact(path, 0, NULL, NULL));
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  EXPECT_RC(TALLY_HISTOGRAM_SAME, tally_histogram_stored(s, NAMES4, 4));
  EXPECT_I64(1, member(s, "h{le=5}"));
  /* dropped: gone with its record; made again, marked by its new writer */
  REQUIRE_OK(tally_store_drop(s, "h{le=+Inf}", 10));
  EXPECT_RC(TALLY_HISTOGRAM_NEW, tally_histogram_stored(s, NAMES4, 4));
  REQUIRE_OK(tally_histogram_open(s, BOUNDS4, 2, fewer, 1, &h));
  EXPECT_RC(TALLY_HISTOGRAM_SAME, tally_histogram_stored(s, fewer, 2));
  EXPECT_RC(TALLY_HISTOGRAM_OTHER, tally_histogram_stored(s, NAMES4, 4));
  tally_histogram_close(h);
  tally_store_close(s);
}

/* ---- observe ----------------------------------------------------------------------- */

/* The first bound >= v, by a plain scan. */
static size_t scan(const double *b, size_t n, double v) {
  size_t i = 0;
  while (i < n && !(v <= b[i])) i++;
  return i;
}

/* Observe values on and around every bound of a histogram of n bounds and
 * compare each bucket with a scan. */
static void check_buckets(size_t n) {
  tally_store *s;
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  double b[MAXB];
  char names[MAXB + 2][32];
  const char *np[MAXB + 2];
  for (size_t i = 0; i < n; i++) b[i] = -3.0 + 0.75 * (double)i;
  for (size_t i = 0; i <= n + 1; i++) {
    snprintf(names[i], sizeof names[i], i == n + 1 ? "n%zu{sum}" : "n%zu{le=%zu}", n, i);
    np[i] = names[i];
  }
  tally_histogram *h;
  REQUIRE_OK(tally_histogram_open(s, b, n, np, 1, &h));
  int64_t want[MAXB + 1] = {0};
  double probes[4 * MAXB + 4];
  size_t np_ = 0;
  for (size_t i = 0; i < n; i++) {
    probes[np_++] = b[i];
    probes[np_++] = nextafter(b[i], -INFINITY);
    probes[np_++] = nextafter(b[i], INFINITY);
  }
  probes[np_++] = -1e9;
  probes[np_++] = 1e9;
  probes[np_++] = -0.0;
  for (size_t k = 0; k < np_; k++) {
    EXPECT_OK(tally_histogram_observe(h, probes[k]));
    want[scan(b, n, probes[k])]++;
  }
  int bad = 0;
  for (size_t i = 0; i <= n; i++)
    if (member(s, names[i]) != want[i]) bad++;
  if (bad) TU_FAIL("%zu bounds: %d buckets differ from a scan", n, bad);
  tally_histogram_close(h);
  tally_store_close(s);
}

static void test_observe(void) {
  for (size_t n = 1; n <= MAXB; n += (n < 20 ? 1 : 7)) check_buckets(n);
  tally_store *s;
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  tally_histogram *h;
  REQUIRE_OK(tally_histogram_open(s, BOUNDS4, 4, NAMES4, 0.5, &h));
  /* sums in units of 0.5: 0.25 -> 0.5 -> 1, -0.25 -> -1, 0.2 -> 0.4 -> 0 */
  double vs[] = {0.25, -0.25, 0.2, 0.75, 1.0, 2.5, 11};
  for (size_t i = 0; i < sizeof vs / sizeof vs[0]; i++)
    EXPECT_OK(tally_histogram_observe(h, vs[i]));
  EXPECT_I64(5, member(s, "h{le=1}")); /* 0.25 -0.25 0.2 0.75 1.0 */
  EXPECT_I64(0, member(s, "h{le=2}"));
  EXPECT_I64(1, member(s, "h{le=5}"));
  EXPECT_I64(0, member(s, "h{le=10}"));
  EXPECT_I64(1, member(s, "h{le=+Inf}"));
  EXPECT_I64(1 - 1 + 0 + 2 + 2 + 5 + 22, member(s, "h{sum}")); /* 0.75 -> 1.5 -> 2 */
  /* refused: nothing added */
  EXPECT_RC(TALLY_EINVAL, tally_histogram_observe(h, NAN));
  EXPECT_RC(TALLY_ERANGE, tally_histogram_observe(h, INFINITY));
  EXPECT_RC(TALLY_ERANGE, tally_histogram_observe(h, -INFINITY));
  EXPECT_RC(TALLY_ERANGE, tally_histogram_observe(h, 0x1p53)); /* 2^54 halves */
  EXPECT_RC(TALLY_EINVAL, tally_histogram_observe(NULL, 1));
  EXPECT_I64(1, member(s, "h{le=+Inf}"));
  EXPECT_I64(31, member(s, "h{sum}"));
  EXPECT_OK(tally_histogram_observe(h, 0x1p52)); /* 2^53 halves: the most */
  EXPECT_I64(31 + (INT64_C(1) << 53), member(s, "h{sum}"));
  tally_histogram_close(h);
  tally_store_close(s);
}

/* ---- buffered -------------------------------------------------------------------- */

static void test_buffered(void) {
  tally_store *s;
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  tally_histogram *h;
  REQUIRE_OK(tally_histogram_open(s, BOUNDS4, 4, NAMES4, 0.5, &h));
  EXPECT_RC(TALLY_EINVAL, tally_histogram_buffer(h, TALLY_HISTOGRAM_MAX_BUFFER + 1));
  EXPECT_RC(TALLY_EINVAL, tally_histogram_buffer(NULL, 1));
  EXPECT_RC(TALLY_EINVAL, tally_histogram_flush(NULL));
  EXPECT_OK(tally_histogram_flush(h)); /* not buffered: nothing to do */
  EXPECT_OK(tally_histogram_buffer(h, 3));
  EXPECT_OK(tally_histogram_observe(h, 0.25)); /* le=1, sum 1 */
  EXPECT_OK(tally_histogram_observe(h, 3));    /* le=5, sum 6 */
  EXPECT_OK(tally_histogram_observe(h, 11));   /* +Inf, sum 22 */
  EXPECT_I64(0, member(s, "h{le=1}"));         /* held */
  EXPECT_I64(0, member(s, "h{sum}"));
  EXPECT_RC(TALLY_EINVAL, tally_histogram_observe(h, NAN)); /* refused as before */
  EXPECT_OK(tally_histogram_observe(h, 1.0));               /* full: the three go first */
  EXPECT_I64(1, member(s, "h{le=1}"));
  EXPECT_I64(1, member(s, "h{le=5}"));
  EXPECT_I64(1, member(s, "h{le=+Inf}"));
  EXPECT_I64(29, member(s, "h{sum}"));
  EXPECT_OK(tally_histogram_flush(h));
  EXPECT_I64(2, member(s, "h{le=1}"));
  EXPECT_I64(31, member(s, "h{sum}"));
  EXPECT_OK(tally_histogram_flush(h)); /* empty: nothing */
  EXPECT_I64(31, member(s, "h{sum}"));
  /* the buffer's sum is flushed before it leaves a shard's range (2^62;
   * it was flushed only before int64 overflow, and such a flush could never
   * be stored): 511 observations of 2^53 units go out as the 512th comes.
   * The next 511 do not fit beside them in the sum's shard, so the flush
   * fails, the observation that needed it is refused and nothing is added;
   * the buffer is kept */
  EXPECT_OK(tally_histogram_buffer(h, TALLY_HISTOGRAM_MAX_BUFFER));
  for (int i = 0; i < 1022; i++) EXPECT_OK(tally_histogram_observe(h, 0x1p52));
  EXPECT_I64(512, member(s, "h{le=+Inf}"));
  EXPECT_I64(31 + 511 * (INT64_C(1) << 53), member(s, "h{sum}"));
  EXPECT_RC(TALLY_ERANGE, tally_histogram_observe(h, 0x1p52));
  EXPECT_RC(TALLY_ERANGE, tally_histogram_flush(h));
  EXPECT_RC(TALLY_ERANGE, tally_histogram_buffer(h, 0)); /* flushes first */
  EXPECT_I64(512, member(s, "h{le=+Inf}"));
  tally_histogram_close(h); /* its flush fails too: the 511 held are lost */
  EXPECT_I64(31 + 511 * (INT64_C(1) << 53), member(s, "h{sum}"));

  /* 100 bounds: 63 buckets with a count and the sum fill a batch, so the
   * 64th bucket flushes the 63 first */
  enum { NB = 100 };
  double bounds[NB];
  char names[NB + 2][32];
  const char *np[NB + 2];
  for (int i = 0; i < NB; i++) bounds[i] = i;
  for (int i = 0; i <= NB + 1; i++) {
    snprintf(names[i], sizeof names[i], i == NB + 1 ? "w{sum}" : "w{le=%d}", i);
    np[i] = names[i];
  }
  REQUIRE_OK(tally_histogram_open(s, bounds, NB, np, 1, &h));
  REQUIRE_OK(tally_histogram_buffer(h, 1000));
  for (int i = 0; i < 63; i++) EXPECT_OK(tally_histogram_observe(h, i));
  EXPECT_OK(tally_histogram_observe(h, 62)); /* a bucket with a count: held */
  EXPECT_I64(0, member(s, "w{le=0}"));
  EXPECT_OK(tally_histogram_observe(h, 63));
  EXPECT_I64(1, member(s, "w{le=0}"));
  EXPECT_I64(2, member(s, "w{le=62}"));
  EXPECT_I64(0, member(s, "w{le=63}"));
  EXPECT_I64(62 * 63 / 2 + 62, member(s, "w{sum}"));
  EXPECT_OK(tally_histogram_flush(h));
  EXPECT_I64(1, member(s, "w{le=63}"));
  /* a flush that fails (a member dropped) keeps the buffer and adds
   * nothing; once buffered no more, observations are batches again */
  EXPECT_OK(tally_histogram_observe(h, 5));
  EXPECT_OK(tally_histogram_observe(h, 200));
  REQUIRE_OK(tally_store_drop(s, "w{le=5}", 7));
  EXPECT(tally_histogram_flush(h) != 0);
  EXPECT_I64(0, member(s, "w{le=100}")); /* +Inf: 200 */
  EXPECT_I64(62 * 63 / 2 + 62 + 63, member(s, "w{sum}"));
  tally_histogram_close(h);
  tally_store_close(s);
}

/* ---- threads ------------------------------------------------------------------------ */

/* sum = count: 0 if it holds. */
static int snap_sum(void *ud, const char *name, size_t len, int64_t value) {
  int64_t *t = ud; /* [0] buckets, [1] sum */
  t[len >= 5 && memcmp(name + len - 5, "{sum}", 5) == 0] += value;
  return 0;
}

static int sum_is_count(tally_store *s, long *taken) {
  int64_t t[2] = {0, 0};
  if (tally_store_snapshot(s, "h{*}", 4, snap_sum, t)) {
    TU_FAIL("snapshot: %s", tally_errmsg());
    return 1;
  }
  (*taken)++;
  if (t[0] != t[1]) {
    TU_FAIL("snapshot %ld: count %lld, sum %lld", *taken, (long long)t[0],
            (long long)t[1]);
    return 1;
  }
  return 0;
}

struct shared {
  tally_histogram *h;
  atomic_int stop;
  atomic_llong done;
};

static void *observer_main(void *ud) {
  struct shared *sh = ud;
  long long n = 0;
  while (!atomic_load_explicit(&sh->stop, memory_order_relaxed) && n < 2000000) {
    if (tally_histogram_observe(sh->h, 1.0)) break;
    n++;
  }
  atomic_fetch_add(&sh->done, n);
  return NULL;
}

static void test_threads(void) {
  tally_store *s;
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  struct shared sh = {0};
  REQUIRE_OK(tally_histogram_open(s, BOUNDS4, 4, NAMES4, 1, &sh.h));
  pthread_t th[4];
  for (int i = 0; i < 4; i++) pthread_create(&th[i], NULL, observer_main, &sh);
  long taken = 0;
  double end = tu_now() + 1.0;
  while (tu_now() < end && sum_is_count(s, &taken) == 0) {}
  atomic_store(&sh.stop, 1);
  for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
  long long done = atomic_load(&sh.done);
  EXPECT_I64(done, member(s, "h{le=1}"));
  EXPECT_I64(done, member(s, "h{sum}"));
  EXPECT(taken > 10);
  printf("  4 threads, one writer: %lld observations, %ld snapshots with sum = count\n",
         done, taken);
  tally_histogram_close(sh.h);
  tally_store_close(s);
}

/* ---- processes ------------------------------------------------------------------------ */

struct page {
  atomic_llong done[2];
  atomic_int ready, stop;
};

/* A child: observe 1.0 until stopped (or killed), counting what returned. */
static pid_t spawn_observer(const char *spec, struct page *pg, int i, const char *stall) {
  fflush(NULL);
  pid_t pid = fork();
  if (pid != 0) return pid;
  if (stall) setenv("TALLY_TEST_BATCH_STALL", stall, 1);
  tally_store *s;
  tally_histogram *h;
  if (tally_store_open(spec, NULL, &s) ||
      tally_histogram_open(s, BOUNDS4, 4, NAMES4, 1, &h))
    _exit(2);
  if (i == 1 && !stall && tally_histogram_buffer(h, 37)) _exit(2); /* one buffers */
  atomic_fetch_add(&pg->ready, 1);
  double end = tu_now() + 20;
  while (!atomic_load_explicit(&pg->stop, memory_order_relaxed) && tu_now() < end) {
    if (tally_histogram_observe(h, 1.0)) _exit(3);
    atomic_fetch_add_explicit(&pg->done[i], 1, memory_order_relaxed);
  }
  tally_histogram_close(h);
  tally_store_close(s);
  _exit(0);
}

static void test_processes(void) {
  char spec[1200], path[1100];
  tu_spec(spec, sizeof spec, path, sizeof path, g_dir, "procs.tly");
  tally_store *s;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  struct page *pg = tu_shared(sizeof *pg);
  pid_t pids[2];
  for (int i = 0; i < 2; i++) pids[i] = spawn_observer(spec, pg, i, NULL);
  while (atomic_load(&pg->ready) < 2) usleep(1000);
  long taken = 0;
  double end = tu_now() + 1.5;
  while (tu_now() < end && sum_is_count(s, &taken) == 0) {}
  atomic_store(&pg->stop, 1);
  for (int i = 0; i < 2; i++) {
    int st;
    waitpid(pids[i], &st, 0);
    EXPECT(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  }
  long long done = atomic_load(&pg->done[0]) + atomic_load(&pg->done[1]);
  EXPECT_I64(done, member(s, "h{le=1}"));
  EXPECT_I64(done, member(s, "h{sum}"));
  EXPECT(taken > 50);
  printf(
      "  2 processes (one buffered): %lld observations, %ld snapshots with sum = count\n",
      done, taken);
  EXPECT_OK(tally_store_check(s));
  munmap(pg, sizeof *pg);
  tally_store_close(s);
}

/* ---- SIGKILL ------------------------------------------------------------------------ */

struct waiter {
  tally_store *s;
  int64_t t[2];
  atomic_int done;
  double done_at;
  int rc;
};

static void *waiter_main(void *ud) {
  struct waiter *w = ud;
  w->rc = tally_store_snapshot(w->s, "h{*}", 4, snap_sum, w->t);
  w->done_at = tu_now();
  atomic_store(&w->done, 1);
  return NULL;
}

static void test_killed_mid_observation(void) {
  char spec[1200], path[1100];
  tu_spec(spec, sizeof spec, path, sizeof path, g_dir, "kill.tly");
  tally_store *s;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  struct page *pg = tu_shared(sizeof *pg);
  /* stops for good after its first observation's bucket, before its sum */
  pid_t pid = spawn_observer(spec, pg, 0, "1");
  double until = tu_now() + 10;
  while (member(s, "h{le=1}") != 1 && tu_now() < until) usleep(1000);
  EXPECT_I64(1, member(s, "h{le=1}")); /* a plain read sees the bucket alone */
  EXPECT_I64(0, member(s, "h{sum}"));
  struct waiter w = {.s = s};
  pthread_t th;
  pthread_create(&th, NULL, waiter_main, &w);
  usleep(200000);
  EXPECT(!atomic_load(&w.done)); /* a snapshot waits for the live writer */
  double killed = tu_now();
  kill(pid, SIGKILL);
  pthread_join(th, NULL);
  int st;
  waitpid(pid, &st, 0);
  EXPECT(WIFSIGNALED(st));
  EXPECT_OK(w.rc);
  double stalled = w.done_at - killed;
  EXPECT(stalled < 0.1);
  EXPECT_I64(0, w.t[0]); /* rolled back: neither */
  EXPECT_I64(0, w.t[1]);
  EXPECT_I64(0, member(s, "h{le=1}"));
  printf(
      "  an observer killed between bucket and sum: the snapshot went on %.1f ms after "
      "the kill, the observation rolled back\n",
      stalled * 1e3);
  munmap(pg, sizeof *pg);
  tally_store_close(s);
}

/* ---- the short way ---------------------------------------------------------------- */

/* A member's value read through a fresh handle, 0 when it is gone. */
static int64_t value_or_0(tally_store *s, const char *name) {
  tally_counter *c;
  if (tally_counter_open(s, name, strlen(name), NULL, 0, &c)) return 0;
  int64_t v = tu_value(c);
  tally_counter_close(c);
  return v;
}

/* The journal of this thread's slot after one observation of v: the short
 * way when the slot is leased (an observation before leased it), the whole
 * way when `whole` makes the short way give way (a stall that never
 * comes: a histogram's batch has 2 entries). */
static void observe_journal(tally_histogram *h, double v, bool whole,
                            struct tally__wentry *e, uint64_t *seq) {
  if (whole) tally__me.wstall = 7;
  EXPECT_OK(tally_histogram_observe(h, v));
  tally__me.wstall = -1;
  struct tally__wslot *sl = tally__me.wsl;
  if (!sl) {
    TU_FAIL("no writer slot after an observation");
    exit(1);
  }
  EXPECT_I64(2, (int64_t)atomic_load(&sl->n));
  *seq = atomic_load(&sl->seq);
  memcpy(e, (const void *)sl->e, 2 * sizeof *e);
}

static void test_short_way(void) {
  char spec[1200];
  tu_spec(spec, sizeof spec, NULL, 0, g_dir, "short.tly");
  setenv("TALLY_GRACE_MS", "0", 1);
  tally_store *s;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  tally_histogram *h;
  REQUIRE_OK(tally_histogram_open(s, BOUNDS4, 4, NAMES4, 0.5, &h));

  /* 1. the same journal both ways, each field; the whole way's before is
   * the short way's after */
  EXPECT_OK(tally_histogram_observe(h, 1.5)); /* leases this thread's slot */
  struct tally__wentry shortw[2], whole[2];
  uint64_t seq1, seq2;
  observe_journal(h, 1.5, false, shortw, &seq1);
  observe_journal(h, 1.5, true, whole, &seq2);
  EXPECT(seq1 % 2 == 0);
  EXPECT_I64((int64_t)seq1 + 2, (int64_t)seq2);
  for (int j = 0; j < 2; j++) {
    EXPECT_I64(atomic_load(&whole[j].rec_off), atomic_load(&shortw[j].rec_off));
    EXPECT_I64(atomic_load(&whole[j].loc), atomic_load(&shortw[j].loc));
    EXPECT_I64(atomic_load(&whole[j].incarnation), atomic_load(&shortw[j].incarnation));
    EXPECT_I64(atomic_load(&whole[j].cell_off), atomic_load(&shortw[j].cell_off));
    EXPECT_I64(atomic_load(&whole[j].delta), atomic_load(&shortw[j].delta));
    EXPECT_I64(atomic_load(&whole[j].before),
               atomic_load(&shortw[j].before) + atomic_load(&shortw[j].delta));
  }
  EXPECT_I64(1, atomic_load(&shortw[0].delta)); /* the bucket */
  EXPECT_I64(3, atomic_load(&shortw[1].delta)); /* 1.5 / 0.5 */
  EXPECT_I64(3, member(s, "h{le=2}"));
  EXPECT_I64(9, member(s, "h{sum}"));

  /* 2. a sum that would leave its shard's range: refused, nothing added */
  tally_counter *sum;
  REQUIRE_OK(tally_counter_open(s, "h{sum}", 6, NULL, 0, &sum));
  int64_t top = (INT64_C(1) << 62) - 1;            /* the most a shard holds */
  EXPECT_OK(tally_counter_incr(sum, top - 9 - 2)); /* this thread's shard: top - 2 */
  EXPECT_OK(tally_histogram_observe(h, 1.0));      /* + 2: top */
  EXPECT_RC(TALLY_ERANGE, tally_histogram_observe(h, 0.5));
  EXPECT_I64(4, member(s, "h{le=1}") + member(s, "h{le=2}")); /* 3 + the 1.0 */
  EXPECT_I64(top, member(s, "h{sum}"));
  EXPECT_OK(tally_counter_incr(sum, -top)); /* back to 0 */
  tally_counter_close(sum);
  EXPECT_OK(tally_histogram_observe(h, 0.5));
  EXPECT_I64(2, member(s, "h{le=1}"));

  /* 3. a dropped member whose record and cells other counters took: the
   * observation into it is refused and writes into none of theirs */
  EXPECT_OK(tally_store_drop(s, "h{le=2}", 7));
  EXPECT_RC(TALLY_EDROPPED, tally_histogram_observe(h, 1.5)); /* before the upkeep */
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  tally_store_stats st;
  memset(&st, 0, sizeof st);
  EXPECT_OK(tally_store_stats_get(s, &st));
  uint64_t reused0 = st.reused_bytes;
  enum { N = 200 };
  char nm[32];
  for (int i = 0; i < N; i++) {
    tally_counter *c;
    snprintf(nm, sizeof nm, "r:%d", i);
    REQUIRE_OK(tu_counter(s, nm, TALLY_SLOT_SHARDS, TALLY_POLICY_SLOT,
                          TALLY_COUNTER_CREATE, &c));
    EXPECT_OK(tally_counter_incr(c, 1000 + i));
    tally_counter_close(c);
  }
  EXPECT_OK(tally_store_stats_get(s, &st));
  EXPECT(st.reused_bytes > reused0); /* the dropped member's space went to them */
  for (int k = 0; k < 3; k++) EXPECT_RC(TALLY_EDROPPED, tally_histogram_observe(h, 1.5));
  EXPECT_OK(tally_histogram_observe(h, 7)); /* the other buckets still count */
  EXPECT_I64(1, member(s, "h{le=10}"));
  EXPECT_I64(1 + 14, member(s, "h{sum}"));
  EXPECT_I64(0, value_or_0(s, "h{le=2}"));
  int bad = 0;
  for (int i = 0; i < N; i++) {
    snprintf(nm, sizeof nm, "r:%d", i);
    if (member(s, nm) != 1000 + i && bad++ < 3)
      TU_FAIL("%s = %lld after observations into a dropped member, want %d", nm,
              (long long)member(s, nm), 1000 + i);
  }
  atomic_fetch_add(&tu_checks, N);
  EXPECT_OK(tally_store_check(s));
  tally_histogram_close(h);
  tally_store_close(s);
  unsetenv("TALLY_GRACE_MS");
}

int main(void) {
  snprintf(g_dir, sizeof g_dir, "%s", tu_tmpdir("histogram"));
  double t0 = tu_now();
  test_open();
  test_stored();
  test_observe();
  test_buffered();
  test_threads();
  test_processes();
  test_killed_mid_observation();
  test_short_way();
  printf("total %.2f s\n", tu_now() - t0);
  tu_rmrf(g_dir);
  return tu_finish("test_histogram");
}
