/* bench_tally.c -- the C side of scripts/bench.
 *
 * Each subcommand measures one thing and prints "RESULT key value" lines
 * (medians of `reps` runs) for scripts/bench to put in one table:
 *
 *   bench_tally incr SECS REPS [T]    increments/s, 1 and T threads (default
 *                                     2): tally thread and random policies
 *                                     (16 shards, one shared handle) against
 *                                     one shared atomic, a mutex-protected
 *                                     counter and ideal per-thread cells on
 *                                     own lines
 *   bench_tally many PATH K SECS REPS T  random increments over K counters
 *                                     (memory store; 16 shards, then 1, then
 *                                     both again as tally_vectors, then by
 *                                     name), 1, 2 and T threads, against a
 *                                     shared atomic array of K words, an
 *                                     array per thread (ideal cells) and one
 *                                     shared atomic; every repetition's
 *                                     figure; and
 *                                     bytes per counter of a file store of K
 *                                     counters at PATH, file size and live
 *                                     arena bytes ("memory": skipped)
 *   bench_tally moves PATH N T        the time of a drop (a move) of a 2-shard
 *                                     thread counter and of a cpu counter, with
 *                                     the CPUs idle and with T writers busy
 *   bench_tally value REPS            value() cost for 1/16/256/1024 shards
 *   bench_tally expose PATH REPS      the Prometheus text of the file store
 *                                     at PATH (tally_prometheus to a writer
 *                                     that only counts), against the walk
 *                                     in name order alone (tally_store_rows)
 *   bench_tally create PATH N         N counters x 16 shards into a new file
 *   bench_tally open PATH             open it (run in a fresh process), then
 *                                     read every value; time and memory
 *   bench_tally procs PATH SECS REPS  1 and 2 processes incrementing one
 *                                     file store counter (thread policy)
 *   bench_tally rollup PATH N SECS REPS  one rollup tick over N counters x 16
 *                                     shards in a file store (first tick and
 *                                     later ones), history bytes per counter,
 *                                     against summing the same cells; and a
 *                                     writer's increments/s with and without
 *                                     a concurrent ticker
 *   bench_tally batch PATH SECS REPS NSNAP  batches and snapshots: ns per
 *                                     3-counter tally_batch_incr against 3
 *                                     single increments (slot and thread
 *                                     counters); a histogram's observation
 *                                     (tally_histogram_observe) against the
 *                                     same batch through tally_batch_incr,
 *                                     and through a writer buffering 1,024;
 *                                     a snapshot of 10,000
 *                                     counters (16-shard thread ones, then
 *                                     slot ones) against a tally_counter_value
 *                                     loop over the same; NSNAP snapshots of
 *                                     a file store while 2 processes batch
 *                                     {a+1, b+2, c+3} (invariant violations,
 *                                     bounded by 120 s); and the longest
 *                                     snapshot right after SIGKILLing a
 *                                     batching writer (20 kills)
 *
 * Timing is CLOCK_MONOTONIC; nothing is pinned. Threads run until the main
 * thread raises a stop flag, checking it every 256 operations.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <math.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tally.h"

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void die(const char *what, int rc) {
  fprintf(stderr, "bench_tally: %s: %s (%s)\n", what, tally_err_name(rc), tally_errmsg());
  exit(1);
}

/* A progress bar on stderr while many counters are made, only when stderr
 * is a terminal (scripts/bench sends results to a file, notes to stderr);
 * redrawn every 16384 counters, cleared at i == n. */
static void progress(const char *what, long i, long n) {
  static int tty = -1;
  static const char bar[] = "########################################";
  static const char gap[] = "----------------------------------------";
  int w = 40, fill;
  if (tty < 0) tty = isatty(STDERR_FILENO);
  if (!tty || n <= 0 || (i < n && (i & 0x3FFF) != 0)) return;
  fill = (int)((double)i / (double)n * w);
  fprintf(stderr, "\rbench_tally: %s [%.*s%.*s] %3d%%  %ld / %ld counters\033[K", what,
          fill, bar, w - fill, gap, (int)((double)i * 100 / (double)n), i, n);
  if (i >= n) fputs("\r\033[K", stderr);
  fflush(stderr);
}

static void oom(void) {
  fputs("bench_tally: out of memory\n", stderr);
  exit(1);
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_d);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* ---- incr ---------------------------------------------------------------- */

#define MAX_THREADS 64

enum {
  IMPL_THREAD,
  IMPL_RANDOM,
  IMPL_ATOMIC,
  IMPL_MUTEX,
  IMPL_IDEAL,
  IMPL_IDEAL_CALL,
  IMPL_CPU,        /* tally incr, `cpu` policy */
  IMPL_PLAIN_CALL, /* a plain (not atomic) add to a private cell, behind a call */
  IMPL_N
};
static const char *impl_names[] = {"thread", "random",     "atomic", "mutex",
                                   "ideal",  "ideal_call", "cpu",    "plain_call"};

typedef struct {
  _Alignas(64) _Atomic int64_t v;
  char pad[56];
} padded;

static struct {
  tally_counter *c;
  _Alignas(64) _Atomic int64_t shared;
  _Alignas(64) pthread_mutex_t mu;
  int64_t mu_val;
  padded cells[MAX_THREADS];
  struct {
    _Alignas(64) int64_t v;
  } plain[MAX_THREADS];
  _Alignas(64) atomic_int go;
  _Alignas(64) atomic_int stop;
} B;

typedef struct {
  int impl, id;
  uint64_t ops;
  uint64_t rng; /* many: this thread's xorshift state */
} worker;

/* Ideal cells behind the same call shape as tally_counter_incr: a function
 * the compiler cannot inline, given a handle, finding the calling thread's
 * cell through thread-local state. The floor for any library API. */
static _Thread_local int ideal_slot;
__attribute__((noinline)) static int ideal_incr(padded *cells, int64_t delta) {
  atomic_fetch_add_explicit(&cells[ideal_slot].v, delta, memory_order_relaxed);
  return 0;
}

/* The floor for the cpu policy: a plain add to the thread's own cell,
 * behind the same call shape (a function the compiler cannot inline,
 * which cannot keep the cell in a register across calls). */
__attribute__((noinline)) static int plain_incr(int64_t delta) {
  B.plain[ideal_slot].v += delta;
  __asm__ volatile("" ::: "memory");
  return 0;
}

#define LOOP(body)                                                                       \
  while (!atomic_load_explicit(&B.stop, memory_order_relaxed)) {                         \
    for (int k_ = 0; k_ < 256; k_++) {                                                   \
      body;                                                                              \
    }                                                                                    \
    ops += 256;                                                                          \
  }

static void *worker_main(void *arg) {
  worker *w = arg;
  uint64_t ops = 0;
  while (!atomic_load_explicit(&B.go, memory_order_acquire)) {}
  switch (w->impl) {
  case IMPL_THREAD:
  case IMPL_CPU:
  case IMPL_RANDOM: LOOP(if (tally_counter_incr(B.c, 1) != 0) abort()); break;
  case IMPL_PLAIN_CALL:
    ideal_slot = w->id;
    LOOP(if (plain_incr(1) != 0) abort());
    break;
  case IMPL_ATOMIC:
    LOOP(atomic_fetch_add_explicit(&B.shared, 1, memory_order_relaxed));
    break;
  case IMPL_MUTEX:
    LOOP(pthread_mutex_lock(&B.mu); B.mu_val++; pthread_mutex_unlock(&B.mu));
    break;
  case IMPL_IDEAL_CALL:
    ideal_slot = w->id;
    LOOP(if (ideal_incr(B.cells, 1) != 0) abort());
    break;
  case IMPL_IDEAL: {
    _Atomic int64_t *cell = &B.cells[w->id].v;
    LOOP(atomic_fetch_add_explicit(cell, 1, memory_order_relaxed));
    break;
  }
  }
  w->ops = ops;
  return NULL;
}

/* nthreads threads running fn(worker), waiting for B.go. Thread i's RNG
 * starts from the same seed in every run, so two loops see the same
 * indexes. */
static void writers_start(void *(*fn)(void *), int impl, int nthreads, pthread_t *th,
                          worker *w) {
  atomic_store(&B.go, 0);
  atomic_store(&B.stop, 0);
  for (int i = 0; i < nthreads; i++) {
    w[i] = (worker){impl, i, 0, 0x9E3779B97F4A7C15ull * (uint64_t)(i + 1) | 1};
    if (pthread_create(&th[i], NULL, fn, &w[i])) {
      fprintf(stderr, "bench_tally: cannot start thread %d\n", i);
      exit(1);
    }
  }
}

/* Raise B.stop and join them; the operations they made. */
static uint64_t writers_stop(int nthreads, pthread_t *th, const worker *w) {
  atomic_store(&B.stop, 1);
  uint64_t total = 0;
  for (int i = 0; i < nthreads; i++) {
    pthread_join(th[i], NULL);
    total += w[i].ops;
  }
  return total;
}

/* Operations per second of nthreads threads running fn(worker) for secs:
 * they start together on B.go and stop on B.stop. */
static double timed_run(void *(*fn)(void *), int impl, int nthreads, double secs) {
  pthread_t th[MAX_THREADS];
  worker w[MAX_THREADS];
  writers_start(fn, impl, nthreads, th, w);
  usleep(20000);
  double t0 = now();
  atomic_store_explicit(&B.go, 1, memory_order_release);
  usleep((useconds_t)(secs * 1e6));
  uint64_t total = writers_stop(nthreads, th, w);
  double t1 = now();
  return (double)total / (t1 - t0);
}

static double run_incr(tally_store *s, int impl, int nthreads, double secs) {
  int rc;
  B.c = NULL;
  if (impl == IMPL_THREAD || impl == IMPL_RANDOM || impl == IMPL_CPU) {
    tally_counter_options o = {impl == IMPL_CPU ? 0 : 16,
                               impl == IMPL_THREAD   ? TALLY_POLICY_THREAD
                               : impl == IMPL_RANDOM ? TALLY_POLICY_RANDOM
                                                     : TALLY_POLICY_CPU};
    const char *name = impl_names[impl];
    if ((rc = tally_counter_open(s, name, strlen(name), &o, TALLY_COUNTER_CREATE, &B.c)))
      die("counter", rc);
  }
  double r = timed_run(worker_main, impl, nthreads, secs);
  if (B.c) tally_counter_close(B.c);
  return r;
}

static int bad_threads(int nthreads) {
  if (nthreads >= 1 && nthreads <= MAX_THREADS) return 0;
  fprintf(stderr, "bench_tally: threads must be 1..%d\n", MAX_THREADS);
  return 1;
}

static int cmd_incr(double secs, int reps, int nthreads) {
  tally_store *s = NULL;
  if (bad_threads(nthreads)) return 2;
  if (reps > 32) reps = 32;
  int rc = tally_store_open("memory", NULL, &s);
  if (rc) die("open", rc);
  pthread_mutex_init(&B.mu, NULL);
  for (int impl = 0; impl < IMPL_N; impl++)
    for (int t = 1; t <= nthreads; t = t < nthreads ? nthreads : t + 1) { /* 1, n */
      double v[32];
      for (int r = 0; r < reps; r++) v[r] = run_incr(s, impl, t, secs);
      printf("RESULT incr.%s.%dt %.0f\n", impl_names[impl], t, median(v, reps));
      fflush(stdout);
    }
  tally_counter *c = NULL; /* did the cpu rows run their sequence? */
  tally_counter_info info = {0};
  tally_counter_options o = {0, TALLY_POLICY_CPU};
  if (tally_counter_open(s, "cpu", 3, &o, TALLY_COUNTER_CREATE, &c) == 0 &&
      tally_counter_info_get(c, &info) == 0)
    printf("RESULT incr.cpu.rseq %d\n", info.rseq);
  tally_counter_close(c);
  tally_store_close(s);
  return 0;
}

/* ---- one hot counter with automatic shards -------------------------------- */

/* nthreads writers on one counter: a fixed 16-shard one, then a fresh auto
 * one for its first 100 ms (it starts with one cell and grows) and after. */
static int cmd_autohot(double secs, int reps, int nthreads) {
  tally_store *s = NULL;
  if (bad_threads(nthreads)) return 2;
  int rc = tally_store_open("memory", NULL, &s);
  if (rc) die("open", rc);
  for (int r = 0; r < reps; r++) {
    char name[32];
    tally_counter_options fixed = {16, TALLY_POLICY_THREAD},
                          autos = {TALLY_SHARDS_AUTO, TALLY_POLICY_THREAD};
    snprintf(name, sizeof name, "fixed%d", r);
    if ((rc = tally_counter_open(s, name, strlen(name), &fixed, TALLY_COUNTER_CREATE,
                                 &B.c)))
      die("counter", rc);
    double f = timed_run(worker_main, IMPL_THREAD, nthreads, secs);
    tally_counter_close(B.c);
    snprintf(name, sizeof name, "auto%d", r);
    if ((rc = tally_counter_open(s, name, strlen(name), &autos, TALLY_COUNTER_CREATE,
                                 &B.c)))
      die("counter", rc);
    double first = timed_run(worker_main, IMPL_THREAD, nthreads, 0.1);
    tally_counter_info in;
    if ((rc = tally_counter_info_get(B.c, &in))) die("info", rc);
    double after = timed_run(worker_main, IMPL_THREAD, nthreads, secs);
    tally_counter_info in2;
    if ((rc = tally_counter_info_get(B.c, &in2))) die("info", rc);
    tally_counter_close(B.c);
    printf("RESULT autohot.fixed16 %.0f\nRESULT autohot.first %.0f\n"
           "RESULT autohot.after %.0f\nRESULT autohot.shards100ms %u\n"
           "RESULT autohot.shards %u\n",
           f, first, after, in.shards, in2.shards);
    fflush(stdout);
  }
  tally_store_close(s);
  return 0;
}

/* ---- what a move costs, by policy ----------------------------------------- */

/* A move (a drop, an expiry, an automatic counter's grow or shrink)
 * retires a counter's cells; before it retires a cpu counter's, the mover
 * passes every CPU that sequences ran on (docs/design.md). n counters of
 * 2 thread shards (what an automatic counter grows to on 2 CPUs), then n
 * cpu counters, dropped one by one in a file store: with the CPUs idle,
 * then with nthreads writers adding to another cpu counter. Prints each
 * drop's median and 99th percentile in microseconds. */
static int cmd_moves(const char *path, long n, int nthreads) {
  if (bad_threads(nthreads)) return 2;
  if (n < 100) {
    fprintf(stderr, "bench_tally: moves wants N >= 100 (a 99th percentile)\n");
    return 2;
  }
  char spec[4096];
  snprintf(spec, sizeof spec, "file:%s", path);
  unlink(path);
  tally_store *s = NULL;
  int rc = tally_store_open(spec, NULL, &s);
  if (rc) die("open", rc);
  tally_counter_options busy = {0, TALLY_POLICY_CPU};
  if ((rc = tally_counter_open(s, "busy", 4, &busy, TALLY_COUNTER_CREATE, &B.c)))
    die("counter", rc);
  int cpus = (int)(tally_cpu_shards() - 1) / 2; /* a sequence on every CPU: each passed */
  timed_run(worker_main, IMPL_CPU, cpus < MAX_THREADS ? cpus : MAX_THREADS, 0.1);
  double *t = malloc((size_t)n * sizeof *t);
  if (!t) die("malloc", TALLY_ENOMEM);
  for (int loaded = 0; loaded < 2; loaded++)
    for (int cpu = 0; cpu < 2; cpu++) {
      tally_counter_options o = {cpu ? 0 : 2,
                                 cpu ? TALLY_POLICY_CPU : TALLY_POLICY_THREAD};
      char name[32];
      for (long i = 0; i < n; i++) {
        tally_counter *c;
        snprintf(name, sizeof name, "m:%ld", i);
        if ((rc = tally_counter_open(s, name, strlen(name), &o, TALLY_COUNTER_CREATE,
                                     &c)) ||
            (rc = tally_counter_incr(c, 1)))
          die("counter", rc);
        tally_counter_close(c);
      }
      pthread_t th[MAX_THREADS];
      worker w[MAX_THREADS];
      int writers = loaded ? nthreads : 0;
      writers_start(worker_main, IMPL_CPU, writers, th, w);
      atomic_store_explicit(&B.go, 1, memory_order_release);
      usleep(20000);
      for (long i = 0; i < n; i++) {
        snprintf(name, sizeof name, "m:%ld", i);
        double t0 = now();
        if ((rc = tally_store_drop(s, name, strlen(name)))) die("drop", rc);
        t[i] = (now() - t0) * 1e6;
      }
      writers_stop(writers, th, w);
      qsort(t, (size_t)n, sizeof *t, cmp_d);
      const char *kind = cpu ? "cpu" : "thread2", *load = loaded ? "busy" : "idle";
      printf("RESULT moves.%s.%s.median_us %.2f\n", load, kind, t[n / 2]);
      printf("RESULT moves.%s.%s.p99_us %.2f\n", load, kind, t[n - n / 100]);
      fflush(stdout);
    }
  free(t);
  tally_counter_close(B.c);
  tally_store_close(s);
  unlink(path);
  return 0;
}

/* ---- value --------------------------------------------------------------- */

static int cmd_value(int reps) {
  static const uint32_t sizes[] = {1, 16, 256, 1024};
  tally_store *s = NULL;
  int rc = tally_store_open("memory", NULL, &s);
  if (rc) die("open", rc);
  for (int k = 0; k < 4; k++) {
    tally_counter *c = NULL;
    char name[32];
    tally_counter_options o = {sizes[k], TALLY_POLICY_CUSTOM};
    snprintf(name, sizeof name, "v%u", sizes[k]);
    if ((rc = tally_counter_open(s, name, strlen(name), &o, TALLY_COUNTER_CREATE, &c)))
      die("counter", rc);
    for (uint32_t i = 0; i < sizes[k]; i++)
      tally_counter_incr_shard(c, i, (int64_t)i + 1);
    double v[32];
    int64_t sink = 0;
    for (int r = 0; r < reps; r++) {
      long n = 0;
      double t0 = now(), t1;
      do {
        for (int i = 0; i < 1000; i++) {
          int64_t x;
          if (tally_counter_value(c, &x) != 0) abort();
          sink += x;
        }
        n += 1000;
        t1 = now();
      } while (t1 - t0 < 0.1);
      v[r] = (t1 - t0) * 1e9 / (double)n;
    }
    if (sink == 42) printf("#\n");
    printf("RESULT value.%u %.2f\n", sizes[k], median(v, reps));
    tally_counter_close(c);
  }
  tally_store_close(s);
  return 0;
}

/* ---- a million counters --------------------------------------------------- */

static long status_kb(const char *field) {
  FILE *f = fopen("/proc/self/status", "r");
  char line[256];
  long kb = -1;
  size_t n = strlen(field);
  if (!f) return -1;
  while (fgets(line, sizeof line, f))
    if (strncmp(line, field, n) == 0 && line[n] == ':') kb = atol(line + n + 1);
  fclose(f);
  return kb;
}

/* n counters x 16 shards, or with the default options (automatic shards:
 * one cell each) when dflt; results under "create." or "create_default." */
static int cmd_create(const char *path, long n, int dflt) {
  char spec[4200];
  tally_store *s = NULL;
  snprintf(spec, sizeof spec, "file:%s", path);
  unlink(path);
  double t0 = now();
  int rc = tally_store_open(spec, NULL, &s);
  if (rc) die("open", rc);
  tally_counter_options o16 = {16, TALLY_POLICY_THREAD}, *o = dflt ? NULL : &o16;
  const char *key = dflt ? "create_default" : "create";
  for (long i = 0; i < n; i++) {
    char name[48];
    tally_counter *c;
    int len = snprintf(name, sizeof name, "post:%ld:likes", i);
    progress("create", i, n);
    if ((rc = tally_counter_open(s, name, (size_t)len, o, TALLY_COUNTER_CREATE, &c)))
      die("create", rc);
    tally_counter_close(c);
  }
  progress("create", n, n);
  tally_store_close(s);
  double t1 = now();
  struct stat st;
  stat(path, &st);
  printf("RESULT %s.secs %.3f\n", key, t1 - t0);
  printf("RESULT %s.file_bytes %lld\n", key, (long long)st.st_size);
  printf("RESULT %s.disk_bytes %lld\n", key, (long long)st.st_blocks * 512);
  return 0;
}

static int count_name(void *ud, const char *name, size_t len) {
  (void)name, (void)len;
  ++*(uint64_t *)ud;
  return 0;
}

static int add_value(void *ud, const char *name, size_t len, int64_t v) {
  (void)name, (void)len;
  *(int64_t *)ud += v;
  return 0;
}

static int cmd_open(const char *path) {
  char spec[4200];
  tally_store *s = NULL;
  long rss0 = status_kb("VmRSS");
  snprintf(spec, sizeof spec, "file:%s", path);
  double t0 = now();
  int rc = tally_store_open(spec, NULL, &s);
  double t1 = now();
  if (rc) die("open", rc);
  tally_counter *c = NULL;
  /* first lookup, too: what a user waits for before the first read */
  if ((rc = tally_counter_open(s, "post:0:likes", 12, NULL, 0, &c))) die("lookup", rc);
  tally_counter_close(c);
  double t2 = now();
  long rss_open = status_kb("VmRSS");
  tally_store_stats st;
  tally_store_stats_get(s, &st);
  int64_t total = 0;
  double t3 = now();
  for (uint64_t i = 0; i < st.counters; i++) {
    char name[48];
    int64_t v;
    int len = snprintf(name, sizeof name, "post:%llu:likes", (unsigned long long)i);
    if ((rc = tally_counter_open(s, name, (size_t)len, NULL, 0, &c))) die("lookup", rc);
    if ((rc = tally_counter_value(c, &v))) die("value", rc);
    total += v;
    tally_counter_close(c);
  }
  double t4 = now();
  long rss_all = status_kb("VmRSS"), anon_all = status_kb("RssAnon");
  /* the walks over every counter: what db:sum, tally ls, /metrics pay */
  int64_t sum = 0, snap_sum = 0;
  uint64_t count = 0, named = 0;
  if ((rc = tally_store_sum(s, "*", 1, &sum, &count))) die("sum", rc);
  double t5 = now();
  if ((rc = tally_store_each(s, "*", 1, count_name, &named))) die("each", rc);
  double t6 = now();
  if ((rc = tally_store_snapshot(s, "*", 1, add_value, &snap_sum))) die("snapshot", rc);
  double t7 = now();
  if (count != st.counters || named != st.counters || sum != total || snap_sum != total)
    die("walk", TALLY_ECORRUPT); /* every walk sees every counter and value */
  printf("RESULT open.ms %.3f\n", (t1 - t0) * 1e3);
  printf("RESULT open.first_ms %.3f\n", (t2 - t0) * 1e3);
  printf("RESULT open.rss_before_kb %ld\n", rss0);
  printf("RESULT open.rss_kb %ld\n", rss_open);
  printf("RESULT open.readall_secs %.3f\n", t4 - t3);
  printf("RESULT open.rss_all_kb %ld\n", rss_all);
  printf("RESULT open.anon_all_kb %ld\n", anon_all);
  printf("RESULT open.counters %llu\n", (unsigned long long)st.counters);
  printf("RESULT open.sum_ms %.3f\n", (t5 - t4) * 1e3);
  printf("RESULT open.each_ms %.3f\n", (t6 - t5) * 1e3);
  printf("RESULT open.snapshot_ms %.3f\n", (t7 - t6) * 1e3);
  tally_store_close(s);
  return 0;
}

/* ---- many cold counters (issue 13) ---------------------------------------- */

/* Random increments over K counters: each thread draws an index with its
 * own xorshift and adds 1 there, through tally handles (16 shards, then 1;
 * thread policy; a memory store), through tally_vectors of the same
 * counters (by index, as the array; a 16-shard counter's thread adds to
 * its ticket's shard), by name without a handle (tally_store_incr), into a
 * plain array of K atomic words shared by all threads (malloc'd, as a
 * user would; and again on transparent huge pages, as a memory store's
 * arena asks for), or into an array of
 * K words of the thread's own (ideal cells: what sharding can reach). The
 * two "group" kinds are those arrays again, each index found through a
 * table of bases, one per 520 indexes: the least a vector's dense path
 * pays (it reads its group's base, and the add waits for that load), as a
 * floor for the vector rows; the "x" kinds use the add's result as tally's
 * exact add must (its range; a retired cell), the floor of an exact
 * vector ("rowsx": the per-thread arrays indexed directly, no table, as
 * a layout with each writer's cells of a vector in one array would be).
 * The "batch" kinds are the vectors again, MANY_BATCH random
 * slots a tally_vector_incr_many call. The RNG and the loop are the same
 * for every kind; one shared atomic draws the indexes too and ignores them. */
enum {
  MANY_TALLY16,
  MANY_TALLY1,
  MANY_VECTOR1,
  MANY_VECTOR16,
  MANY_BYNAME1,
  MANY_ARRAY,
  MANY_ARRAYHP,
  MANY_ROWS,
  MANY_ARRAYGROUP,
  MANY_ROWSGROUP,
  MANY_ATOMIC,
  MANY_BATCH1,
  MANY_BATCH16,
  MANY_ARRAYGROUPX,
  MANY_ROWSGROUPX,
  MANY_ROWSX,
  MANY_N
};
static const char *many_names[] = {
    "tally16",       "tally1",      "vector1",    "vector16",  "byname1", "array",
    "arrayhp",       "rows",        "arraygroup", "rowsgroup", "atomic",  "vectorbatch1",
    "vectorbatch16", "arraygroupx", "rowsgroupx", "rowsx"};
#define MANY_GROUP 520 /* TALLY__ROW_CELLS: a chunk's columns, a vector's group */
#define MANY_BATCH 64  /* increments a tally_vector_incr_many call */

/* What tally's add checks of the value it returns (tally__cell_live):
 * within [-2^62, 2^62). An exact cell must use its add's result, to
 * refuse a value out of range and to see a retired cell. */
static inline bool in_range(int64_t v) {
  return (((uint64_t)v ^ ((uint64_t)v << 1)) >> 63) == 0;
}

/* Add 1 to cell as an exact cell's add must: its result checked. */
static inline void checked_add(_Atomic int64_t *cell) {
  int64_t old = atomic_fetch_add_explicit(cell, 1, memory_order_relaxed);
  if (__builtin_expect(!in_range(old) || !in_range(old + 1), 0)) abort();
}

static struct {
  tally_counter **cs[2]; /* handles: [0] 16 shards, [1] 1 shard */
  tally_vector *vec[2];  /* the 16-shard, then the 1-shard counters again,
                           as vectors */
  tally_store *s1;       /* their store, for increments by name */
  char (*names)[16];     /* "m:I", built once */
  _Atomic int64_t *arr, *arrhp;
  size_t arrhp_bytes;
  _Atomic int64_t *rows[MAX_THREADS]; /* ideal cells: an array per thread */
  uint64_t *gbase;                    /* per group of MANY_GROUP: its byte offset */
  uint64_t k;
  _Alignas(64) _Atomic int64_t one;
} M;

/* xorshift64, then a multiply-shift onto [0, k): no division. */
static inline uint64_t pick(uint64_t *x, uint64_t k) {
  uint64_t v = *x;
  v ^= v << 13;
  v ^= v >> 7;
  v ^= v << 17;
  *x = v;
  return ((v >> 32) * k) >> 32;
}

static void *many_main(void *arg) {
  worker *w = arg;
  uint64_t ops = 0, x = w->rng, k = M.k;
  while (!atomic_load_explicit(&B.go, memory_order_acquire)) {}
  switch (w->impl) {
  case MANY_TALLY16:
  case MANY_TALLY1: {
    tally_counter **cs = M.cs[w->impl == MANY_TALLY1];
    LOOP(if (tally_counter_incr(cs[pick(&x, k)], 1) != 0) abort());
    break;
  }
  case MANY_VECTOR1:
  case MANY_VECTOR16: {
    tally_vector *v = M.vec[w->impl == MANY_VECTOR1];
    LOOP(if (tally_vector_incr(v, pick(&x, k), 1) != 0) abort());
    break;
  }
  case MANY_BYNAME1: {
    tally_store *s = M.s1;
    char(*names)[16] = M.names;
    LOOP(uint64_t i = pick(&x, k);
         if (tally_store_incr(s, names[i], strlen(names[i]), 1, 0) != 0) abort());
    break;
  }
  case MANY_ARRAY:
  case MANY_ARRAYHP: {
    _Atomic int64_t *a = w->impl == MANY_ARRAY ? M.arr : M.arrhp;
    LOOP(atomic_fetch_add_explicit(&a[pick(&x, k)], 1, memory_order_relaxed));
    break;
  }
  case MANY_ROWS: {
    _Atomic int64_t *a = M.rows[w->id];
    LOOP(atomic_fetch_add_explicit(&a[pick(&x, k)], 1, memory_order_relaxed));
    break;
  }
  case MANY_ARRAYGROUP:
  case MANY_ROWSGROUP: {
    char *a = (char *)(w->impl == MANY_ARRAYGROUP ? M.arr : M.rows[w->id]);
    const uint64_t *gb = M.gbase;
    LOOP(uint64_t i = pick(&x, k); atomic_fetch_add_explicit(
             (_Atomic int64_t *)(a + gb[i / MANY_GROUP] + i % MANY_GROUP * 8), 1,
             memory_order_relaxed));
    break;
  }
  case MANY_BATCH1:
  case MANY_BATCH16: { /* the same adds, MANY_BATCH a call */
    tally_vector *v = M.vec[w->impl == MANY_BATCH1];
    size_t slots[MANY_BATCH];
    while (!atomic_load_explicit(&B.stop, memory_order_relaxed)) {
      for (int q = 0; q < MANY_BATCH; q++) slots[q] = pick(&x, k);
      if (tally_vector_incr_many(v, slots, NULL, MANY_BATCH, NULL) != 0) abort();
      ops += MANY_BATCH;
    }
    break;
  }
  case MANY_ARRAYGROUPX:
  case MANY_ROWSGROUPX: { /* the group kinds, the add's result checked */
    char *a = (char *)(w->impl == MANY_ARRAYGROUPX ? M.arr : M.rows[w->id]);
    const uint64_t *gb = M.gbase;
    LOOP(uint64_t i = pick(&x, k);
         checked_add((_Atomic int64_t *)(a + gb[i / MANY_GROUP] + i % MANY_GROUP * 8)));
    break;
  }
  case MANY_ROWSX: { /* ideal cells, indexed directly, the add's result checked */
    _Atomic int64_t *a = M.rows[w->id];
    LOOP(checked_add(&a[pick(&x, k)]));
    break;
  }
  case MANY_ATOMIC:
    LOOP((void)pick(&x, k); atomic_fetch_add_explicit(&M.one, 1, memory_order_relaxed));
    break;
  }
  w->ops = ops;
  w->rng = x; /* keeps the RNG live in the one-atomic loop */
  return NULL;
}

/* K counters "m:I" with `shards` shards (thread policy) in s; handles into
 * *out when out is not NULL (else each is closed at once). */
static void many_create(tally_store *s, uint64_t k, uint32_t shards, const char *what,
                        tally_counter ***out) {
  tally_counter_options o = {shards, TALLY_POLICY_THREAD};
  tally_counter **cs = out ? malloc(k * sizeof *cs) : NULL;
  int rc;
  if (out && !cs) oom();
  for (uint64_t i = 0; i < k; i++) {
    char name[32];
    tally_counter *c;
    int len = snprintf(name, sizeof name, "m:%llu", (unsigned long long)i);
    progress(what, (long)i, (long)k);
    if ((rc = tally_counter_open(s, name, (size_t)len, &o, TALLY_COUNTER_CREATE, &c)))
      die("create", rc);
    if (cs) {
      cs[i] = c;
      if ((rc = tally_counter_incr(c, 1))) die("incr", rc); /* cells resident */
    } else {
      tally_counter_close(c);
    }
  }
  progress(what, (long)k, (long)k);
  if (out) *out = cs;
}

/* Bytes of a fresh file store at path holding k counters of `shards`
 * shards, per counter: the file's size (stat) over k, and the arena's live
 * bytes (tally_store_stats_get) over k: the file grows in steps. */
static void many_bytes(const char *path, uint64_t k, uint32_t shards) {
  char spec[4200], what[64];
  tally_store *s = NULL;
  struct stat st;
  tally_store_stats ss;
  int rc;
  snprintf(spec, sizeof spec, "file:%s", path);
  snprintf(what, sizeof what, "file store, %u shard%s", shards, shards > 1 ? "s" : "");
  unlink(path);
  if ((rc = tally_store_open(spec, NULL, &s))) die("open", rc);
  many_create(s, k, shards, what, NULL);
  if ((rc = tally_store_stats_get(s, &ss))) die("stats", rc);
  tally_store_close(s);
  if (stat(path, &st) != 0) {
    perror(path);
    exit(1);
  }
  unlink(path);
  printf("RESULT many.bytes.tally%u %.2f\n", shards, (double)st.st_size / (double)k);
  printf("RESULT many.live.tally%u %.2f\n", shards, (double)ss.live_bytes / (double)k);
  fflush(stdout);
}

static int cmd_many(const char *path, uint64_t k, double secs, int reps, int nthreads) {
  static const uint32_t shards[2] = {16, 1};
  tally_store *s[2] = {NULL, NULL};
  int rc;
  if (bad_threads(nthreads)) return 2;
  if (k < 1 || k > UINT32_MAX) {
    fprintf(stderr, "bench_tally: K must be 1..%u\n", UINT32_MAX);
    return 2;
  }
  if (strcmp(path, "memory") != 0) {
    many_bytes(path, k, 16);
    many_bytes(path, k, 1);
  }
  printf("RESULT many.bytes.array %zu\n", sizeof(int64_t));
  for (int j = 0; j < 2; j++) {
    char what[64];
    snprintf(what, sizeof what, "memory store, %u shard%s", shards[j],
             shards[j] > 1 ? "s" : "");
    if ((rc = tally_store_open("memory", NULL, &s[j]))) die("open", rc);
    many_create(s[j], k, shards[j], what, &M.cs[j]);
  }
  /* the same counters (and cells) by index: a vector increment reads a
   * bit and a base (dense slots: these were created in slot order) or a
   * 4-byte slot word, not the handle; a 16-shard counter's then adds to
   * the row of the thread's ticket */
  for (int j = 0; j < 2; j++) {
    const char *what =
        j ? "a vector of the 1-shard counters" : "a vector of the 16-shard counters";
    if ((rc = tally_vector_new(s[j], k, &M.vec[j]))) die("vector", rc);
    for (uint64_t i = 0; i < k; i++) {
      char name[32];
      int len = snprintf(name, sizeof name, "m:%llu", (unsigned long long)i);
      progress(what, (long)i, (long)k);
      if ((rc = tally_vector_open(M.vec[j], i, name, (size_t)len, NULL, 0)))
        die("vector", rc);
    }
    progress(what, (long)k, (long)k);
  }
  M.s1 = s[1];
  if (!(M.names = malloc(k * sizeof *M.names))) oom();
  for (uint64_t i = 0; i < k; i++)
    snprintf(M.names[i], sizeof M.names[i], "m:%llu", (unsigned long long)i);
  M.k = k;
  M.arr = malloc(k * sizeof *M.arr);
  if (!M.arr) oom();
  for (uint64_t i = 0; i < k; i++) atomic_init(&M.arr[i], 1); /* resident, as tally's */
  M.arrhp_bytes = k * sizeof *M.arrhp;
  void *hp = mmap(NULL, M.arrhp_bytes, PROT_READ | PROT_WRITE,
                  MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (hp == MAP_FAILED) oom();
  (void)madvise(hp, M.arrhp_bytes, MADV_HUGEPAGE);
  M.arrhp = hp;
  for (uint64_t i = 0; i < k; i++) atomic_init(&M.arrhp[i], 1);
  if (!(M.gbase = malloc((k / MANY_GROUP + 1) * sizeof *M.gbase))) oom();
  for (uint64_t g = 0; g <= k / MANY_GROUP; g++) M.gbase[g] = g * MANY_GROUP * 8;
  for (int t = 0; t < nthreads; t++) {
    if (!(M.rows[t] = malloc(k * sizeof *M.rows[t]))) oom();
    for (uint64_t i = 0; i < k; i++) atomic_init(&M.rows[t][i], 1);
  }
  /* repetitions outermost: drift on a noisy machine hits every kind alike */
  for (int r = 0; r < reps; r++)
    for (int t = 1; t <= nthreads; t = t < 2 ? 2 : t < nthreads ? nthreads : t + 1)
      for (int kind = 0; kind < MANY_N; kind++) {
        double v = timed_run(many_main, kind, t, secs);
        printf("RESULT many.%s.%dt %.0f\n", many_names[kind], t, v);
        fflush(stdout);
      }
  for (int t = 0; t < nthreads; t++) free(M.rows[t]);
  free(M.gbase);
  munmap(M.arrhp, M.arrhp_bytes);
  tally_vector_free(M.vec[0]);
  tally_vector_free(M.vec[1]);
  free(M.names);
  for (int j = 0; j < 2; j++) {
    for (uint64_t i = 0; i < k; i++) tally_counter_close(M.cs[j][i]);
    free(M.cs[j]);
    tally_store_close(s[j]);
  }
  free(M.arr);
  return 0;
}

/* ---- processes ------------------------------------------------------------ */

typedef struct {
  atomic_int go, stop;
  _Alignas(64) uint64_t ops[8];
} proc_page;

static int cmd_procs(const char *path, double secs, int reps) {
  char spec[4200];
  tally_store *s = NULL;
  tally_counter *c = NULL;
  snprintf(spec, sizeof spec, "file:%s", path);
  unlink(path);
  int rc = tally_store_open(spec, NULL, &s);
  if (rc) die("open", rc);
  tally_counter_options o = {16, TALLY_POLICY_THREAD};
  if ((rc = tally_counter_open(s, "hot", 3, &o, TALLY_COUNTER_CREATE, &c)))
    die("counter", rc);
  tally_counter_close(c);
  tally_store_close(s);
  proc_page *pg =
      mmap(NULL, sizeof *pg, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  for (int np = 1; np <= 2; np++) {
    double v[32];
    for (int r = 0; r < reps; r++) {
      pid_t pids[8];
      memset(pg, 0, sizeof *pg);
      for (int i = 0; i < np; i++) {
        fflush(stdout);
        pids[i] = fork();
        if (pids[i] == 0) {
          tally_store *cs = NULL;
          tally_counter *cc = NULL;
          alarm(60);
          if (tally_store_open(spec, NULL, &cs) ||
              tally_counter_open(cs, "hot", 3, NULL, 0, &cc))
            _exit(2);
          uint64_t ops = 0;
          while (!atomic_load(&pg->go)) {}
          while (!atomic_load_explicit(&pg->stop, memory_order_relaxed)) {
            for (int k = 0; k < 256; k++)
              if (tally_counter_incr(cc, 1)) _exit(3);
            ops += 256;
          }
          pg->ops[i] = ops;
          tally_counter_close(cc);
          tally_store_close(cs);
          _exit(0);
        }
      }
      usleep(50000);
      double t0 = now();
      atomic_store(&pg->go, 1);
      usleep((useconds_t)(secs * 1e6));
      atomic_store(&pg->stop, 1);
      uint64_t total = 0;
      for (int i = 0; i < np; i++) {
        int stt;
        waitpid(pids[i], &stt, 0);
        if (!WIFEXITED(stt) || WEXITSTATUS(stt)) {
          fprintf(stderr, "bench_tally: child failed\n");
          return 1;
        }
        total += pg->ops[i];
      }
      v[r] = (double)total / (now() - t0);
    }
    printf("RESULT procs.%d %.0f\n", np, median(v, reps));
    fflush(stdout);
  }
  /* the value is exact */
  if ((rc = tally_store_open(spec, NULL, &s))) die("open", rc);
  tally_store_close(s);
  munmap(pg, sizeof *pg);
  unlink(path);
  return 0;
}

/* ---- rollup ---------------------------------------------------------------- */

static struct {
  tally_schedule *sch;
  tally_counter *hot;
  _Atomic int64_t period;
  atomic_int stop;
  _Atomic uint64_t ticks;
} R;

static void *ticker_main(void *arg) {
  (void)arg;
  tally_tick_result res;
  while (!atomic_load(&R.stop)) {
    int64_t p = atomic_fetch_add(&R.period, 1);
    int rc = tally_schedule_tick(R.sch, p * 1000, NULL, NULL, &res);
    if (rc) die("tick", rc);
    atomic_fetch_add(&R.ticks, 1);
  }
  return NULL;
}

/* Baseline neighbour: streams through a large array, as a tick does, but
 * touches nothing of tally's. */
static int64_t *stream_arr;
static size_t stream_len;
static void *streamer_main(void *arg) {
  (void)arg;
  volatile int64_t sink;
  while (!atomic_load(&R.stop)) {
    int64_t sum = 0;
    for (size_t i = 0; i < stream_len; i++) sum += stream_arr[i];
    for (size_t i = 0; i < stream_len; i += 8) stream_arr[i] = sum; /* dirty lines too */
    sink = sum;
    atomic_fetch_add(&R.ticks, 1);
  }
  (void)sink;
  return NULL;
}

static void *hot_writer(void *arg) {
  uint64_t *ops = arg, n = 0;
  while (!atomic_load_explicit(&R.stop, memory_order_relaxed)) {
    for (int i = 0; i < 256; i++) tally_counter_incr(R.hot, 1);
    n += 256;
  }
  *ops = n;
  return NULL;
}

/* Increments/s of one writer thread for secs, with a neighbour thread:
 * none (0), a ticker rolling the whole store over and over (1), or a
 * streamer touching as much memory outside tally (2). */
static double writer_rate(double secs, int ticking, double *ticks_per_s) {
  pthread_t w, t;
  uint64_t ops = 0;
  atomic_store(&R.stop, 0);
  atomic_store(&R.ticks, 0);
  double t0 = now();
  pthread_create(&w, NULL, hot_writer, &ops);
  if (ticking) pthread_create(&t, NULL, ticking == 1 ? ticker_main : streamer_main, NULL);
  usleep((useconds_t)(secs * 1e6));
  atomic_store(&R.stop, 1);
  pthread_join(w, NULL);
  if (ticking) pthread_join(t, NULL);
  double dt = now() - t0;
  if (ticks_per_s) *ticks_per_s = (double)atomic_load(&R.ticks) / dt;
  return (double)ops / dt;
}

static int cmd_rollup(const char *path, long n, double secs, int reps) {
  char spec[4096];
  bool memory = strcmp(path, "-") == 0; /* "-": a memory store */
  snprintf(spec, sizeof spec, memory ? "memory" : "file:%s", path);
  if (!memory) unlink(path);
  tally_store *s;
  int rc = tally_store_open(spec, NULL, &s);
  if (rc) die("open", rc);
  tally_counter_options o = {16, TALLY_POLICY_RANDOM};
  char name[32];
  for (long i = 0; i < n; i++) {
    tally_counter *c;
    int len = snprintf(name, sizeof name, "c:%ld", i);
    progress("create", i, n);
    if ((rc = tally_counter_open(s, name, (size_t)len, &o, TALLY_COUNTER_CREATE, &c)))
      die("create", rc);
    tally_counter_incr(c, i);
    tally_counter_close(c);
  }
  progress("create", n, n);
  double v[64];
  if (reps > 64) reps = 64;
  /* baseline: the exact sum of every counter, walking the index */
  for (int r = 0; r < reps; r++) {
    int64_t sum;
    uint64_t cnt;
    double t0 = now();
    if ((rc = tally_store_sum(s, "*", 1, &sum, &cnt))) die("sum", rc);
    v[r] = (now() - t0) * 1e3;
  }
  printf("RESULT rollup.sum_ms %.2f\n", median(v, reps));
  /* baseline: summing as many int64 as there are cells, in one array */
  size_t cells = (size_t)n * 16;
  int64_t *arr = malloc(cells * sizeof *arr);
  if (!arr) return 1;
  for (size_t i = 0; i < cells; i++) arr[i] = (int64_t)i;
  for (int r = 0; r < reps; r++) {
    volatile int64_t sink;
    int64_t sum = 0;
    double t0 = now();
    for (size_t i = 0; i < cells; i++) sum += arr[i];
    sink = sum;
    (void)sink;
    v[r] = (now() - t0) * 1e3;
  }
  free(arr);
  printf("RESULT rollup.array_ms %.2f\n", median(v, reps));

  static const tally_ring keep[] = {{1, 60}, {60, 60}, {3600, 24}};
  if ((rc = tally_schedule_new(s, "*", 1, 1000, keep, 3, &R.sch))) die("schedule", rc);
  tally_store_stats st0, st1;
  tally_store_stats_get(s, &st0);
  tally_tick_result res;
  int64_t t = 1763769600; /* a whole day: ticks start on a bucket edge */
  double t0 = now();
  if ((rc = tally_schedule_tick(R.sch, t++ * 1000, NULL, NULL, &res))) die("tick", rc);
  printf("RESULT rollup.first_ms %.2f\n", (now() - t0) * 1e3);
  tally_store_stats_get(s, &st1);
  printf("RESULT rollup.bytes_per_counter %.1f\n",
         (double)(st1.used_bytes - st0.used_bytes) / (double)n);
  if (res.counters != (uint64_t)n) {
    fprintf(stderr, "bench_tally: tick rolled %llu of %ld counters\n",
            (unsigned long long)res.counters, n);
    return 1;
  }
  for (int r = 0; r < reps; r++) {
    t0 = now();
    if ((rc = tally_schedule_tick(R.sch, t++ * 1000, NULL, NULL, &res))) die("tick", rc);
    v[r] = (now() - t0) * 1e3;
  }
  printf("RESULT rollup.tick_ms %.2f\n", median(v, reps));

  /* a writer on one hot counter (thread policy), with and without ticks */
  tally_counter_options ho = {16, TALLY_POLICY_THREAD};
  if ((rc = tally_counter_open(s, "hot", 3, &ho, TALLY_COUNTER_CREATE, &R.hot)))
    die("hot", rc);
  atomic_store(&R.period, t);
  stream_len = (size_t)n * 16; /* as many words as the store has cells */
  stream_arr = calloc(stream_len, sizeof *stream_arr);
  if (!stream_arr) return 1;
  double with[64], without[64], streaming[64], tps[64], sps[64];
  for (int r = 0; r < reps; r++) {
    without[r] = writer_rate(secs, 0, NULL);
    with[r] = writer_rate(secs, 1, &tps[r]);
    streaming[r] = writer_rate(secs, 2, &sps[r]);
  }
  free(stream_arr);
  printf("RESULT rollup.incr_alone %.0f\n", median(without, reps));
  printf("RESULT rollup.incr_ticking %.0f\n", median(with, reps));
  printf("RESULT rollup.incr_streaming %.0f\n", median(streaming, reps));
  printf("RESULT rollup.ticks_per_s %.2f\n", median(tps, reps));
  printf("RESULT rollup.streams_per_s %.2f\n", median(sps, reps));
  tally_counter_close(R.hot);
  tally_schedule_free(R.sch);
  tally_store_close(s);
  if (!memory) unlink(path);
  return 0;
}

/* Churn (issue 12): `rounds` rounds of n counters created, incremented and
 * then dropped (mode "drop") or left idle until expiry ("expire", a family
 * with idle_s = 1 and a synthetic clock), with at most n live, against a
 * store that simply holds n counters. Reuse needs no wait: the grace time
 * is 0 (TALLY_GRACE_MS) and this is the only process. */
static long file_bytes(const char *path) {
  struct stat st;
  return stat(path, &st) == 0 ? (long)st.st_size : -1;
}

static void churn_round(tally_store *s, long n, int round, int expire,
                        int64_t *clock_ms) {
  char name[64];
  int rc;
  for (long i = 0; i < n; i++) {
    tally_counter *c;
    int len = snprintf(name, sizeof name, "c.%d.%ld", round, i);
    if ((rc = tally_counter_open(s, name, (size_t)len, NULL, TALLY_COUNTER_CREATE, &c)))
      die("create", rc);
    if ((rc = tally_counter_incr(c, 1))) die("incr", rc);
    tally_counter_close(c);
  }
  if (!expire) {
    for (long i = 0; i < n; i++) {
      int len = snprintf(name, sizeof name, "c.%d.%ld", round, i);
      if ((rc = tally_store_drop(s, name, (size_t)len))) die("drop", rc);
    }
  } else { /* one pass sees the values, the next (2 s later) expires them */
    tally_maintain_result r;
    for (int pass = 0; pass < 2; pass++) {
      *clock_ms += 2000;
      if ((rc = tally_store_maintain(s, *clock_ms, UINT32_MAX, &r))) die("maintain", rc);
    }
  }
  if ((rc = tally_store_maintain(s, *clock_ms, 0, NULL))) die("maintain", rc);
}

static int cmd_churn(const char *path, long n, int rounds, const char *mode) {
  char spec[4200];
  tally_store *s = NULL;
  int expire = strcmp(mode, "expire") == 0, rc;
  int64_t clock_ms = 1700000000000;
  setenv("TALLY_GRACE_MS", "0", 1);
  snprintf(spec, sizeof spec, "file:%s", path);
  unlink(path); /* the baseline: a store that simply holds n counters */
  if ((rc = tally_store_open(spec, NULL, &s))) die("open", rc);
  char name[64];
  for (long i = 0; i < n; i++) {
    tally_counter *c;
    int len = snprintf(name, sizeof name, "c.0.%ld", i);
    if ((rc = tally_counter_open(s, name, (size_t)len, NULL, TALLY_COUNTER_CREATE, &c)))
      die("create", rc);
    tally_counter_close(c);
  }
  tally_store_close(s);
  long base = file_bytes(path);
  unlink(path);
  if ((rc = tally_store_open(spec, NULL, &s))) die("open", rc);
  if (expire) {
    tally_family_options fo = {0, -1, 1, 0};
    if ((rc = tally_family_define(s, "c.*", 3, &fo))) die("family", rc);
  }
  double t0 = now();
  for (int r = 1; r <= rounds; r++) {
    progress("churn", r - 1, rounds);
    churn_round(s, n, r, expire, &clock_ms);
  }
  progress("churn", rounds, rounds);
  double t1 = now();
  tally_store_stats st;
  if ((rc = tally_store_stats_get(s, &st))) die("stats", rc);
  if ((rc = tally_store_check(s))) die("check", rc);
  tally_store_close(s);
  long churned = file_bytes(path);
  unlink(path);
  printf("RESULT churn.%s.base_bytes %ld\n", mode, base);
  printf("RESULT churn.%s.file_bytes %ld\n", mode, churned);
  printf("RESULT churn.%s.round_secs %.3f\n", mode, (t1 - t0) / rounds);
  printf("RESULT churn.%s.reused_bytes %llu\n", mode,
         (unsigned long long)st.reused_bytes);
  printf("RESULT churn.%s.live %llu\n", mode, (unsigned long long)st.counters);
  return 0;
}

/* ---- batch ------------------------------------------------------------------ */

#define SNAP_K 10000

static tally_counter *open_ctr(tally_store *s, const char *name, uint32_t shards,
                               int32_t policy) {
  tally_counter *c = NULL;
  tally_counter_options o = {shards, policy};
  int rc = tally_counter_open(s, name, strlen(name), &o, TALLY_COUNTER_CREATE, &c);
  if (rc) die(name, rc);
  return c;
}

/* ns per iteration of fn (0: three single increments of cs, 1: one batch). */
static double time_incr3(tally_store *s, tally_counter **cs, int batch, double secs) {
  static const int64_t d[3] = {1, 2, 3};
  long n = 0;
  double t0 = now(), t1;
  do {
    for (int i = 0; i < 1000; i++) {
      if (batch) {
        if (tally_batch_incr(s, cs, d, 3)) abort();
      } else if (tally_counter_incr(cs[0], 1) || tally_counter_incr(cs[1], 2) ||
                 tally_counter_incr(cs[2], 3)) {
        abort();
      }
    }
    n += 1000;
    t1 = now();
  } while (t1 - t0 < secs);
  return (t1 - t0) * 1e9 / (double)n;
}

/* ns per observation: 0: tally_histogram_observe of the next of 1,024
 * log-spaced values (11 bounds); 1: the same through tally_batch_incr, the
 * bucket found by a scan (what the writer replaces). */
static double time_observe(tally_store *s, tally_histogram *h, tally_counter **cs,
                           const double *bounds, int via_batch, double secs) {
  static double vals[1024];
  if (vals[0] == 0)
    for (int i = 0; i < 1024; i++) vals[i] = 0.0005 * pow(40000.0, i / 1023.0);
  long n = 0;
  double t0 = now(), t1;
  do {
    for (int i = 0; i < 1024; i++) {
      double v = vals[i];
      if (!via_batch) {
        if (tally_histogram_observe(h, v)) abort();
        continue;
      }
      int b = 0;
      while (b < 11 && v > bounds[b]) b++;
      tally_counter *pair[2] = {cs[b], cs[12]};
      int64_t d[2] = {1, (int64_t)(v / 1e-6 + 0.5)};
      if (tally_batch_incr(s, pair, d, 2)) abort();
    }
    n += 1024;
    t1 = now();
  } while (t1 - t0 < secs);
  return (t1 - t0) * 1e9 / (double)n;
}

static int snap_count(void *ud, const char *name, size_t len, int64_t value) {
  (void)name, (void)len;
  *(int64_t *)ud += value;
  return 0;
}

struct abc {
  int64_t a, b, c;
};
static int snap_abc(void *ud, const char *name, size_t len, int64_t value) {
  struct abc *x = ud;
  if (len == 1 && name[0] == 'a') x->a = value;
  if (len == 1 && name[0] == 'b') x->b = value;
  if (len == 1 && name[0] == 'c') x->c = value;
  return 0;
}

/* A child batching {a+1, b+2, c+3} into spec until *stop (or killed). */
static pid_t start_batcher(const char *spec, _Atomic int *stop) {
  fflush(stdout);
  pid_t pid = fork();
  if (pid != 0) return pid;
  tally_store *s = NULL;
  tally_counter *cs[3];
  static const int64_t d[3] = {1, 2, 3};
  alarm(300);
  if (tally_store_open(spec, NULL, &s)) _exit(2);
  cs[0] = open_ctr(s, "a", TALLY_SLOT_SHARDS, TALLY_POLICY_SLOT);
  cs[1] = open_ctr(s, "b", TALLY_SLOT_SHARDS, TALLY_POLICY_SLOT);
  cs[2] = open_ctr(s, "c", TALLY_SLOT_SHARDS, TALLY_POLICY_SLOT);
  while (!atomic_load_explicit(stop, memory_order_relaxed))
    for (int k = 0; k < 64; k++)
      if (tally_batch_incr(s, cs, d, 3)) _exit(3);
  _exit(0);
}

static int cmd_batch(const char *path, double secs, int reps, long nsnap) {
  tally_store *s = NULL;
  int rc = tally_store_open("memory", NULL, &s);
  if (rc) die("open", rc);
  /* 1. a 3-counter batch against 3 single increments */
  tally_counter *slot[3], *thr[3];
  const char *sn[3] = {"s1", "s2", "s3"}, *tn[3] = {"t1", "t2", "t3"};
  for (int i = 0; i < 3; i++) {
    slot[i] = open_ctr(s, sn[i], TALLY_SLOT_SHARDS, TALLY_POLICY_SLOT);
    thr[i] = open_ctr(s, tn[i], 16, TALLY_POLICY_THREAD);
  }
  double vb[32], vs[32], vt[32];
  for (int r = 0; r < reps; r++) { /* interleaved: drift hits all three alike */
    vb[r] = time_incr3(s, slot, 1, secs);
    vs[r] = time_incr3(s, slot, 0, secs);
    vt[r] = time_incr3(s, thr, 0, secs);
  }
  printf("RESULT batch.batch3 %.2f\n", median(vb, reps));
  printf("RESULT batch.single3.slot %.2f\n", median(vs, reps));
  printf("RESULT batch.single3.thread %.2f\n", median(vt, reps));
  fflush(stdout);

  /* 1b. a histogram's observation: the writer against the same batch made
   * by hand */
  static const double bounds[11] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                    0.5,   1,    2.5,   5,    10};
  char hn[13][24];
  const char *hp[13];
  tally_counter *hc[13];
  for (int i = 0; i < 13; i++) {
    snprintf(hn[i], sizeof hn[i], i == 12 ? "obs{sum}" : "obs{le=%d}", i);
    hp[i] = hn[i];
    hc[i] = open_ctr(s, hn[i], TALLY_SLOT_SHARDS, TALLY_POLICY_SLOT);
  }
  tally_histogram *h = NULL, *hb = NULL;
  if ((rc = tally_histogram_open(s, bounds, 11, hp, 1e-6, &h))) die("histogram", rc);
  /* the buffered writer has a histogram of its own ("buf{...}") */
  char bn[13][24];
  const char *bp[13];
  for (int i = 0; i < 13; i++) {
    snprintf(bn[i], sizeof bn[i], i == 12 ? "buf{sum}" : "buf{le=%d}", i);
    bp[i] = bn[i];
  }
  if ((rc = tally_histogram_open(s, bounds, 11, bp, 1e-6, &hb)) ||
      (rc = tally_histogram_buffer(hb, 1024)))
    die("histogram", rc);
  double vo[32], vh[32], vf[32];
  for (int r = 0; r < reps; r++) {
    vo[r] = time_observe(s, h, hc, bounds, 0, secs);
    vh[r] = time_observe(s, h, hc, bounds, 1, secs);
    vf[r] = time_observe(s, hb, hc, bounds, 0, secs);
  }
  printf("RESULT batch.observe %.2f\n", median(vo, reps));
  printf("RESULT batch.observe_by_batch %.2f\n", median(vh, reps));
  printf("RESULT batch.observe_buffered %.2f\n", median(vf, reps));
  fflush(stdout);
  tally_histogram_close(hb);
  tally_histogram_close(h);
  for (int i = 0; i < 13; i++) tally_counter_close(hc[i]);
  tally_store_close(s);

  /* 2. a snapshot of 10,000 counters against a value loop over the same */
  for (int kind = 0; kind < 2; kind++) {
    static tally_counter *cs[SNAP_K];
    char name[32];
    if ((rc = tally_store_open("memory", NULL, &s))) die("open", rc);
    for (int i = 0; i < SNAP_K; i++) {
      snprintf(name, sizeof name, "k%05d", i);
      cs[i] = kind ? open_ctr(s, name, TALLY_SLOT_SHARDS, TALLY_POLICY_SLOT)
                   : open_ctr(s, name, 16, TALLY_POLICY_THREAD);
      if (tally_counter_incr(cs[i], i + 1)) abort();
    }
    double sv[32], lv[32];
    int64_t sink = 0;
    for (int r = 0; r < reps; r++) {
      int n = 0;
      double t0 = now(), t1;
      do {
        if ((rc = tally_store_snapshot(s, "*", 1, snap_count, &sink)))
          die("snapshot", rc);
        n++;
        t1 = now();
      } while (t1 - t0 < secs);
      sv[r] = (t1 - t0) * 1e6 / n;
      n = 0;
      t0 = now();
      do {
        for (int i = 0; i < SNAP_K; i++) {
          int64_t x;
          if (tally_counter_value(cs[i], &x)) abort();
          sink += x;
        }
        n++;
        t1 = now();
      } while (t1 - t0 < secs);
      lv[r] = (t1 - t0) * 1e6 / n;
    }
    if (sink == 42) printf("#\n");
    printf("RESULT snap.%s.snapshot_us %.1f\n", kind ? "slot" : "thread16",
           median(sv, reps));
    printf("RESULT snap.%s.values_us %.1f\n", kind ? "slot" : "thread16",
           median(lv, reps));
    fflush(stdout);
    for (int i = 0; i < SNAP_K; i++) tally_counter_close(cs[i]);
    tally_store_close(s);
  }

  /* 3. snapshots while 2 processes batch; 4. SIGKILLed writers */
  char spec[4200];
  snprintf(spec, sizeof spec, "file:%s", path);
  unlink(path);
  if ((rc = tally_store_open(spec, NULL, &s))) die("open", rc);
  tally_counter_close(open_ctr(s, "a", TALLY_SLOT_SHARDS, TALLY_POLICY_SLOT));
  tally_counter_close(open_ctr(s, "b", TALLY_SLOT_SHARDS, TALLY_POLICY_SLOT));
  tally_counter_close(open_ctr(s, "c", TALLY_SLOT_SHARDS, TALLY_POLICY_SLOT));
  _Atomic int *stop =
      mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  atomic_store(stop, 0);
  pid_t w[2] = {start_batcher(spec, stop), start_batcher(spec, stop)};
  usleep(100000);
  long taken = 0, bad = 0, moved = 0;
  int64_t last = -1;
  double t0 = now(), t1 = t0;
  while (taken < nsnap && (t1 = now()) - t0 < 120) {
    struct abc x = {0, 0, 0};
    if ((rc = tally_store_snapshot(s, "?", 1, snap_abc, &x))) die("snapshot", rc);
    if (x.b != 2 * x.a || x.c != 3 * x.a) bad++;
    if (x.a != last) moved++;
    last = x.a;
    taken++;
  }
  atomic_store(stop, 1);
  for (int i = 0; i < 2; i++) {
    int st;
    waitpid(w[i], &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st)) {
      fprintf(stderr, "bench_tally: batcher failed\n");
      return 1;
    }
  }
  printf("RESULT inv.snapshots %ld\n", taken);
  printf("RESULT inv.violations %ld\n", bad);
  printf("RESULT inv.moved %ld\n", moved);
  printf("RESULT inv.snapshots_per_s %.0f\n", (double)taken / (t1 - t0));
  printf("RESULT inv.batches %lld\n", (long long)last);
  fflush(stdout);

  double worst = 0, stalls[20];
  long kbad = 0;
  for (int k = 0; k < 20; k++) {
    atomic_store(stop, 0);
    pid_t pid = start_batcher(spec, stop);
    usleep(20000 + (useconds_t)(k * 1373 % 30000));
    kill(pid, SIGKILL);
    double ta = now();
    struct abc x = {0, 0, 0};
    if ((rc = tally_store_snapshot(s, "?", 1, snap_abc, &x))) die("snapshot", rc);
    stalls[k] = (now() - ta) * 1e3;
    if (x.b != 2 * x.a || x.c != 3 * x.a) kbad++;
    if (stalls[k] > worst) worst = stalls[k];
    waitpid(pid, NULL, 0);
  }
  printf("RESULT kill.max_ms %.3f\n", worst);
  printf("RESULT kill.median_ms %.3f\n", median(stalls, 20));
  printf("RESULT kill.violations %ld\n", kbad);
  munmap((void *)stop, 4096);
  tally_store_close(s);
  unlink(path);
  return 0;
}

/* ---- expose ---------------------------------------------------------------- */

static int count_bytes(void *ud, const char *text, size_t len) {
  (void)text;
  *(uint64_t *)ud += len;
  return 0;
}

static int count_row(void *ud, const tally_row *r) {
  (void)r;
  ++*(uint64_t *)ud;
  return 0;
}

static int cmd_expose(const char *path, int reps) {
  char spec[4200];
  tally_store *s = NULL;
  snprintf(spec, sizeof spec, "file:%s", path);
  int rc = tally_store_open(spec, NULL, &s);
  if (rc) die("open", rc);
  double text[64], walk[64];
  uint64_t bytes = 0, rows = 0;
  if (reps > 64) reps = 64;
  for (int r = 0; r < reps; r++) { /* interleaved: the machine's noise on both */
    bytes = rows = 0;
    double t0 = now();
    if ((rc = tally_prometheus(s, NULL, 0, count_bytes, &bytes))) die("prometheus", rc);
    double t1 = now();
    if ((rc = tally_store_rows(s, NULL, 0, TALLY_ROWS_BY_NAME, count_row, &rows)))
      die("rows", rc);
    text[r] = t1 - t0, walk[r] = now() - t1;
  }
  printf("RESULT expose.s %.4f\n", median(text, reps));
  printf("RESULT expose.walk_s %.4f\n", median(walk, reps));
  printf("RESULT expose.bytes %llu\n", (unsigned long long)bytes);
  printf("RESULT expose.rows %llu\n", (unsigned long long)rows);
  tally_store_close(s);
  return 0;
}

int main(int argc, char **argv) {
  if (argc >= 6 && strcmp(argv[1], "churn") == 0)
    return cmd_churn(argv[2], atol(argv[3]), atoi(argv[4]), argv[5]);
  if (argc >= 4 && strcmp(argv[1], "incr") == 0)
    return cmd_incr(atof(argv[2]), atoi(argv[3]), argc >= 5 ? atoi(argv[4]) : 2);
  if (argc >= 7 && strcmp(argv[1], "many") == 0)
    return cmd_many(argv[2], strtoull(argv[3], NULL, 10), atof(argv[4]), atoi(argv[5]),
                    atoi(argv[6]));
  if (argc >= 3 && strcmp(argv[1], "value") == 0) return cmd_value(atoi(argv[2]));
  if (argc >= 4 && strcmp(argv[1], "expose") == 0)
    return cmd_expose(argv[2], atoi(argv[3]));
  if (argc >= 5 && strcmp(argv[1], "autohot") == 0)
    return cmd_autohot(atof(argv[2]), atoi(argv[3]), atoi(argv[4]));
  if (argc >= 4 && strcmp(argv[1], "create") == 0)
    return cmd_create(argv[2], atol(argv[3]),
                      argc >= 5 && strcmp(argv[4], "default") == 0);
  if (argc >= 3 && strcmp(argv[1], "open") == 0) return cmd_open(argv[2]);
  if (argc >= 6 && strcmp(argv[1], "batch") == 0)
    return cmd_batch(argv[2], atof(argv[3]), atoi(argv[4]), atol(argv[5]));
  if (argc >= 5 && strcmp(argv[1], "procs") == 0)
    return cmd_procs(argv[2], atof(argv[3]), atoi(argv[4]));
  if (argc >= 5 && strcmp(argv[1], "moves") == 0)
    return cmd_moves(argv[2], atol(argv[3]), atoi(argv[4]));
  if (argc >= 6 && strcmp(argv[1], "rollup") == 0)
    return cmd_rollup(argv[2], atol(argv[3]), atof(argv[4]), atoi(argv[5]));
  fprintf(stderr, "usage: bench_tally incr SECS REPS [THREADS] | value REPS | "
                  "create PATH N [default] | open PATH | expose PATH REPS | "
                  "procs PATH SECS REPS | "
                  "rollup PATH N SECS REPS | churn PATH N ROUNDS drop|expire | "
                  "many PATH|memory K SECS REPS THREADS | autohot SECS REPS THREADS | "
                  "moves PATH N THREADS\n");
  return 2;
}
