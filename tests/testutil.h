/* testutil.h -- tiny helpers shared by the C tests (not part of libtally).
 *
 * Every check prints file:line, the expression, the code it got (with its
 * symbolic name) and tally_errmsg(), counts a failure and goes on, so one run
 * shows every broken thing. A test's main returns tu_finish(name).
 */
#ifndef TALLY_TESTUTIL_H
#define TALLY_TESTUTIL_H

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tally.h"

static atomic_int tu_failures;
static atomic_int tu_checks;

#define TU_FAIL(...)                                                                     \
  do {                                                                                   \
    atomic_fetch_add(&tu_failures, 1);                                                   \
    fprintf(stderr, "%s:%d: FAIL: ", __FILE__, __LINE__);                                \
    fprintf(stderr, __VA_ARGS__);                                                        \
    fputc('\n', stderr);                                                                 \
  } while (0)

/* Expect a tally call to return `want` (0 or a TALLY_E* code). */
#define EXPECT_RC(want, call)                                                            \
  do {                                                                                   \
    int tu_rc_ = (call);                                                                 \
    atomic_fetch_add(&tu_checks, 1);                                                     \
    if (tu_rc_ != (want))                                                                \
      TU_FAIL("%s -> %d %s, expected %d %s (errmsg: %s)", #call, tu_rc_,                 \
              tally_err_name(tu_rc_), (int)(want), tally_err_name(want),                 \
              tally_errmsg());                                                           \
  } while (0)

#define EXPECT_OK(call) EXPECT_RC(0, call)

/* Expect a tally call to fail (any negative code). */
#define EXPECT_FAILS(call)                                                               \
  do {                                                                                   \
    int tu_rc_ = (call);                                                                 \
    atomic_fetch_add(&tu_checks, 1);                                                     \
    if (tu_rc_ >= 0) TU_FAIL("%s -> %d, expected an error", #call, tu_rc_);              \
  } while (0)

#define EXPECT(cond)                                                                     \
  do {                                                                                   \
    atomic_fetch_add(&tu_checks, 1);                                                     \
    if (!(cond)) TU_FAIL("expected %s", #cond);                                          \
  } while (0)

#define EXPECT_I64(want, got)                                                            \
  do {                                                                                   \
    long long tu_w_ = (long long)(want), tu_g_ = (long long)(got);                       \
    atomic_fetch_add(&tu_checks, 1);                                                     \
    if (tu_w_ != tu_g_)                                                                  \
      TU_FAIL("%s == %s: expected %lld, got %lld", #got, #want, tu_w_, tu_g_);           \
  } while (0)

#define EXPECT_STR(want, got)                                                            \
  do {                                                                                   \
    const char *tu_w_ = (want), *tu_g_ = (got);                                          \
    atomic_fetch_add(&tu_checks, 1);                                                     \
    if (!tu_g_ || strcmp(tu_w_, tu_g_) != 0)                                             \
      TU_FAIL("%s: expected \"%s\", got \"%s\"", #got, tu_w_, tu_g_ ? tu_g_ : "(null)"); \
  } while (0)

/* Abort the test program when going on makes no sense (setup failed). */
#define REQUIRE_OK(call)                                                                 \
  do {                                                                                   \
    int tu_rc_ = (call);                                                                 \
    if (tu_rc_ != 0) {                                                                   \
      fprintf(stderr, "%s:%d: FATAL: %s -> %d %s (%s)\n", __FILE__, __LINE__, #call,     \
              tu_rc_, tally_err_name(tu_rc_), tally_errmsg());                           \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)

static inline double tu_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Scratch directory: $TALLY_TEST_TMP/<sub>-<pid>, created (mkdir -p). */
static inline const char *tu_tmpdir(const char *sub) {
  static char dir[1024];
  const char *base = getenv("TALLY_TEST_TMP");
  char cmd[1200];
  if (!base || !*base) base = "/tmp/tally-test-tmp";
  snprintf(dir, sizeof dir, "%s/%s-%ld", base, sub, (long)getpid());
  snprintf(cmd, sizeof cmd, "mkdir -p '%s'", dir);
  if (system(cmd) != 0) {
    fprintf(stderr, "cannot create %s\n", dir);
    exit(1);
  }
  return dir;
}

/* "file:<dir>/<name>" into buf, and the plain path into path (if not NULL). */
static inline void tu_spec(char *buf, size_t cap, char *path, size_t pcap,
                           const char *dir, const char *name) {
  snprintf(buf, cap, "file:%s/%s", dir, name);
  if (path) snprintf(path, pcap, "%s/%s", dir, name);
}

static inline void tu_rmrf(const char *dir) {
  char cmd[1200];
  if (getenv("TALLY_TEST_KEEP")) return;
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) fprintf(stderr, "warning: cannot remove %s\n", dir);
}

/* n zeroed bytes that forked children share with this process (a test's
 * flags and acknowledgements); exits if they cannot be mapped. */
static inline void *tu_shared(size_t n) {
  void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  REQUIRE_OK(p == MAP_FAILED ? TALLY_ESYS : 0);
  return p;
}

/* Open counter by C string name. */
static inline int tu_counter(tally_store *s, const char *name, uint32_t shards,
                             int policy, uint32_t flags, tally_counter **out) {
  tally_counter_options o = {shards, policy};
  return tally_counter_open(s, name, strlen(name), &o, flags, out);
}

static inline int64_t tu_value(tally_counter *c) {
  int64_t v = INT64_MIN;
  int rc = tally_counter_value(c, &v);
  if (rc != 0) {
    TU_FAIL("tally_counter_value -> %d %s (%s)", rc, tally_err_name(rc), tally_errmsg());
  }
  return v;
}

static inline uint64_t tu_rng(uint64_t *s) { /* xorshift64* */
  uint64_t x = *s;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  *s = x;
  return x * 2685821657736338717ull;
}

/* A thread that moves counters PREFIX0..PREFIX(n-1) under their writers:
 * every third one resharded back and forth (1 shard, then 2 to 8), a
 * grace step after each round, until *stop (at most 20 s). rounds counts
 * the rounds done, for writers that must overlap some. */
struct tu_mover {
  tally_store *s;
  const char *prefix;
  int n;
  atomic_bool *stop;
  long moves;
  atomic_long rounds;
};

static inline void *tu_mover_main(void *ud) {
  struct tu_mover *m = ud;
  tally_counter **c = calloc((size_t)m->n, sizeof *c);
  if (!c) return NULL;
  for (int i = 0; i < m->n; i++) {
    char nm[64];
    snprintf(nm, sizeof nm, "%s%d", m->prefix, i);
    REQUIRE_OK(tu_counter(m->s, nm, 0, -1, 0, &c[i]));
  }
  double end = tu_now() + 20;
  for (int round = 0; !atomic_load(m->stop) && tu_now() < end; round++) {
    for (int i = 0; i < m->n; i += 3) {
      if (tally_counter_reshard(c[i], round % 2 ? 1 : 2 + (uint32_t)(i % 7)))
        TU_FAIL("reshard: %s", tally_errmsg());
      m->moves++;
    }
    EXPECT_OK(tally_store_maintain(m->s, 0, 0, NULL));
    atomic_fetch_add(&m->rounds, 1);
  }
  for (int i = 0; i < m->n; i++) tally_counter_close(c[i]);
  free(c);
  return NULL;
}

/* Two writer threads, fn(w0) and fn(w1), while m's mover reshards; once
 * both writers are done, the mover is stopped. */
static inline void tu_write_while_moving(struct tu_mover *m, void *(*fn)(void *),
                                         void *w0, void *w1) {
  pthread_t mover, th[2];
  pthread_create(&mover, NULL, tu_mover_main, m);
  pthread_create(&th[0], NULL, fn, w0);
  pthread_create(&th[1], NULL, fn, w1);
  for (int t = 0; t < 2; t++) pthread_join(th[t], NULL);
  atomic_store(m->stop, true);
  pthread_join(mover, NULL);
}

/* Two threads that churn by name beside a reader, until tu_churn_stop:
 * each picks a name name_of(i) for a random i below names, drops it one
 * time in drop_one_in, else adds 1 (or, with random_delta, 0..99) to it,
 * creating it if absent. */
struct tu_churn {
  tally_store *s;
  void (*name_of)(char *buf, size_t cap, uint64_t i);
  uint64_t names, seed;
  unsigned drop_one_in;
  bool random_delta;
  atomic_bool stop;
  atomic_uint started; /* the threads' seeds: seed, seed + 1 */
  pthread_t th[2];
};

static inline void *tu_churn_main(void *ud) {
  struct tu_churn *c = ud;
  uint64_t seed = c->seed + atomic_fetch_add(&c->started, 1);
  char nm[300];
  while (!atomic_load(&c->stop)) {
    c->name_of(nm, sizeof nm, tu_rng(&seed) % c->names);
    int rc;
    if (tu_rng(&seed) % c->drop_one_in == 0) {
      rc = tally_store_drop(c->s, nm, strlen(nm));
      if (rc == TALLY_ENOENT) rc = 0;
    } else {
      int64_t d = c->random_delta ? (int64_t)(tu_rng(&seed) % 100) : 1;
      rc = tally_store_incr(c->s, nm, strlen(nm), d, TALLY_COUNTER_CREATE);
    }
    if (rc) TU_FAIL("churn '%s' -> %s (%s)", nm, tally_err_name(rc), tally_errmsg());
  }
  return NULL;
}

static inline void tu_churn_start(struct tu_churn *c) {
  atomic_store(&c->stop, false);
  for (int t = 0; t < 2; t++) pthread_create(&c->th[t], NULL, tu_churn_main, c);
}

static inline void tu_churn_stop(struct tu_churn *c) {
  atomic_store(&c->stop, true);
  for (int t = 0; t < 2; t++) pthread_join(c->th[t], NULL);
}

/* Every acknowledged increment counted, and at most one more: a process
 * killed between its add and its acknowledgement. */
static inline void tu_expect_acked(int64_t total, int64_t acked) {
  atomic_fetch_add(&tu_checks, 1);
  if (total < acked || total > acked + 1)
    TU_FAIL("total %lld, acknowledged %lld (at most one more may land)", (long long)total,
            (long long)acked);
}

/* Run fn in a forked child (a process of its own: its environment, its
 * clock, its deadlock) and expect it to exit 0; fn bounds itself (alarm). */
static inline void tu_in_child(const char *what, int (*fn)(void)) {
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) _exit(fn());
  int st = 0;
  atomic_fetch_add(&tu_checks, 1);
  if (pid < 0 || waitpid(pid, &st, 0) != pid)
    TU_FAIL("%s: no child to wait for: %s", what, strerror(errno));
  else if (WIFSIGNALED(st))
    TU_FAIL("%s: the child died of signal %d", what, WTERMSIG(st));
  else if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
    TU_FAIL("%s: the child exited %d", what, WEXITSTATUS(st));
}

static inline int tu_finish(const char *name) {
  int f = atomic_load(&tu_failures);
  printf("%s: %d checks, %d failures: %s\n", name, atomic_load(&tu_checks), f,
         f ? "FAIL" : "ok");
  fflush(stdout);
  return f ? 1 : 0;
}

#endif /* TALLY_TESTUTIL_H */
