/* test_byname.c -- increments by name without a handle (tally_store_incr).
 *
 *  - tally_store_value: the value by name, ENOENT for a dropped or expired
 *    name;
 *  - what open + incr + close would do: create or ENOENT, the family's
 *    options and cap, the policies (key and custom refused, slot batched),
 *    range errors that create nothing, large deltas, a dropped name,
 *    expiry and re-creation;
 *  - exact while another thread reshards the counters and runs grace
 *    steps, and two threads on an automatic counter grow it;
 *  - two processes that hold no handle increment by name while the parent
 *    reshards and reuses space (grace 0): every acknowledged increment is
 *    there, at most one more per SIGKILLed process, and the store checks.
 */
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdbool.h>
#include <sys/mman.h>
#include <sys/wait.h>

#include "testutil.h"

static char g_dir[1024];

static int incr(tally_store *s, const char *name, int64_t delta, uint32_t flags) {
  return tally_store_incr(s, name, strlen(name), delta, flags);
}

static int64_t value_of(tally_store *s, const char *name) {
  tally_counter *c = NULL;
  int64_t v = INT64_MIN;
  if (tu_counter(s, name, 0, -1, 0, &c) == 0) (void)tally_counter_value(c, &v);
  tally_counter_close(c);
  return v;
}

static tally_counter_info info_of(tally_store *s, const char *name) {
  tally_counter *c = NULL;
  tally_counter_info in;
  memset(&in, 0, sizeof in);
  if (tu_counter(s, name, 0, -1, 0, &c) == 0) EXPECT_OK(tally_counter_info_get(c, &in));
  tally_counter_close(c);
  return in;
}

static void test_semantics(void) {
  tally_store *s;
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  EXPECT_RC(TALLY_EINVAL, tally_store_incr(NULL, "a", 1, 1, 0));
  EXPECT_RC(TALLY_ENAME, tally_store_incr(s, "", 0, 1, TALLY_COUNTER_CREATE));
  EXPECT_RC(TALLY_ENAME, tally_store_incr(s, "a\0b", 3, 1, TALLY_COUNTER_CREATE));
  EXPECT_RC(TALLY_ENOENT, incr(s, "a", 1, 0));
  EXPECT_OK(incr(s, "a", 5, TALLY_COUNTER_CREATE));
  EXPECT_OK(incr(s, "a", -2, 0));
  EXPECT_OK(incr(s, "a", INT64_C(1) << 40, 0)); /* past the fast add's range */
  EXPECT_I64(3 + (INT64_C(1) << 40), value_of(s, "a"));
  int64_t v = 0;
  EXPECT_OK(tally_store_value(s, "a", 1, &v));
  EXPECT_I64(3 + (INT64_C(1) << 40), v);
  EXPECT_RC(TALLY_ENOENT, tally_store_value(s, "nope", 4, &v));
  EXPECT_RC(TALLY_ENAME, tally_store_value(s, "", 0, &v));
  EXPECT_RC(TALLY_EINVAL, tally_store_value(s, "a", 1, NULL));
  /* the defaults: automatic shards, one cell to start with */
  tally_counter_info in = info_of(s, "a");
  EXPECT(in.auto_shards);
  EXPECT_I64(1, in.shards);

  /* a shard's range: nothing added, and nothing created by a failing add */
  EXPECT_RC(TALLY_ERANGE, incr(s, "big", INT64_C(1) << 62, TALLY_COUNTER_CREATE));
  EXPECT_RC(TALLY_ERANGE, incr(s, "big", INT64_MIN, TALLY_COUNTER_CREATE));
  EXPECT_I64(INT64_MIN, value_of(s, "big"));
  EXPECT_OK(incr(s, "big", (INT64_C(1) << 62) - 1, TALLY_COUNTER_CREATE));
  EXPECT_RC(TALLY_ERANGE, incr(s, "big", 1, 0));
  EXPECT_I64((INT64_C(1) << 62) - 1, value_of(s, "big"));

  /* families: options, policies, the cap */
  tally_family_options f4 = {4, TALLY_POLICY_RANDOM, 0, 0};
  tally_family_options fk = {4, TALLY_POLICY_KEY, 0, 0};
  tally_family_options fs = {0, TALLY_POLICY_SLOT, 0, 0};
  tally_family_options fc = {1, TALLY_POLICY_THREAD, 0, 2};
  EXPECT_OK(tally_family_define(s, "r:*", 3, &f4));
  EXPECT_OK(tally_family_define(s, "k:*", 3, &fk));
  EXPECT_OK(tally_family_define(s, "s:*", 3, &fs));
  EXPECT_OK(tally_family_define(s, "c:*", 3, &fc));
  for (int i = 0; i < 1000; i++) EXPECT_OK(incr(s, "r:x", 1, TALLY_COUNTER_CREATE));
  in = info_of(s, "r:x");
  EXPECT_I64(4, in.shards);
  EXPECT_I64(TALLY_POLICY_RANDOM, in.policy);
  EXPECT_I64(1000, value_of(s, "r:x"));
  int64_t sh[4];
  uint32_t n = 0;
  tally_counter *c;
  REQUIRE_OK(tu_counter(s, "r:x", 0, -1, 0, &c));
  EXPECT_OK(tally_counter_shards(c, sh, 4, &n));
  EXPECT(sh[0] > 0 && sh[1] > 0 && sh[2] > 0 && sh[3] > 0); /* random: all of them */
  tally_counter_close(c);
  EXPECT_RC(TALLY_EPOLICY, incr(s, "k:x", 1, TALLY_COUNTER_CREATE));
  EXPECT_OK(incr(s, "s:x", 7, TALLY_COUNTER_CREATE)); /* a batch of one */
  EXPECT_I64(7, value_of(s, "s:x"));
  EXPECT_I64(TALLY_POLICY_SLOT, info_of(s, "s:x").policy);
  EXPECT_OK(incr(s, "c:1", 1, TALLY_COUNTER_CREATE));
  EXPECT_OK(incr(s, "c:2", 1, TALLY_COUNTER_CREATE));
  EXPECT_OK(incr(s, "c:3", 1, TALLY_COUNTER_CREATE)); /* capped: the overflow */
  EXPECT_I64(1, value_of(s, "c:_overflow"));
  EXPECT_I64(INT64_MIN, value_of(s, "c:3"));

  /* dropped: gone by name, and created anew with CREATE */
  EXPECT_OK(tally_store_drop(s, "a", 1));
  EXPECT_RC(TALLY_ENOENT, incr(s, "a", 1, 0));
  EXPECT_RC(TALLY_ENOENT, tally_store_value(s, "a", 1, &v));
  EXPECT_OK(incr(s, "a", 2, TALLY_COUNTER_CREATE));
  EXPECT_I64(2, value_of(s, "a"));
  tally_store_close(s);
}

/* Expired: by name, it is created again from zero. */
static void test_expired(void) {
  char spec[1200];
  tally_store *s;
  tu_spec(spec, sizeof spec, NULL, 0, g_dir, "expire.tly");
  setenv("TALLY_GRACE_MS", "0", 1);
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  tally_family_options fo = {1, TALLY_POLICY_THREAD, 1, 0}; /* idle 1 s */
  EXPECT_OK(tally_family_define(s, "ex:*", 4, &fo));
  EXPECT_OK(incr(s, "ex:a", 6, TALLY_COUNTER_CREATE));
  tally_maintain_result mr;
  EXPECT_OK(tally_store_maintain(s, 10000, 1000, &mr));
  EXPECT_OK(tally_store_maintain(s, 11000, 1000, &mr));
  EXPECT_I64(1, mr.expired);
  int64_t v;
  EXPECT_RC(TALLY_ENOENT, tally_store_value(s, "ex:a", 4, &v)); /* expired: none */
  EXPECT_RC(TALLY_ENOENT, incr(s, "ex:a", 1, 0));
  EXPECT_OK(incr(s, "ex:a", 9, TALLY_COUNTER_CREATE));
  EXPECT_I64(9, value_of(s, "ex:a"));
  EXPECT_I64(0, tally_store_check(s));
  tally_store_close(s);
}

/* ---- threads ----------------------------------------------------------------- */

enum { NAMES = 32, PER_THREAD = 200000 };

struct writer {
  tally_store *s;
  uint64_t seed;
  int only; /* -1: random names; else this one */
  atomic_bool *stop;
  int limit; /* increments at most; 0: PER_THREAD */
  int64_t added[NAMES];
};

static void *writer_main(void *ud) {
  struct writer *w = ud;
  double end = tu_now() + 20;
  int limit = w->limit ? w->limit : PER_THREAD;
  for (int n = 0; n < limit && tu_now() < end; n++) {
    if (w->stop && atomic_load(w->stop)) break;
    int i = w->only >= 0 ? w->only : (int)(tu_rng(&w->seed) % NAMES);
    char nm[32];
    snprintf(nm, sizeof nm, "t:%d", i);
    int rc = incr(w->s, nm, 1, 0);
    if (rc) {
      TU_FAIL("incr %s: %s", nm, tally_errmsg());
      return NULL;
    }
    w->added[i]++;
  }
  return NULL;
}

static void test_threads(void) {
  char spec[1200];
  tally_store *s;
  tu_spec(spec, sizeof spec, NULL, 0, g_dir, "threads.tly");
  setenv("TALLY_GRACE_MS", "100", 1); /* see test_vector.c's test_threads */
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  for (int i = 0; i < NAMES; i++) {
    char nm[32];
    snprintf(nm, sizeof nm, "t:%d", i);
    EXPECT_OK(incr(s, nm, 0, TALLY_COUNTER_CREATE));
  }
  atomic_bool stop = false;
  struct writer w[2] = {{.s = s, .seed = 3, .only = -1}, {.s = s, .seed = 5, .only = -1}};
  struct tu_mover m = {.s = s, .prefix = "t:", .n = NAMES, .stop = &stop};
  tu_write_while_moving(&m, writer_main, &w[0], &w[1]);
  EXPECT(m.moves > 0);
  for (int i = 0; i < NAMES; i++) {
    char nm[32];
    snprintf(nm, sizeof nm, "t:%d", i);
    EXPECT_I64(w[0].added[i] + w[1].added[i], value_of(s, nm));
    int64_t v = -1;
    EXPECT_OK(tally_store_value(s, nm, strlen(nm), &v));
    EXPECT_I64(w[0].added[i] + w[1].added[i], v);
  }
  printf("threads: %d increments by name, %ld reshards, exact\n", 2 * PER_THREAD,
         m.moves);

  /* two threads on one automatic counter: it grows, as through handles.
   * They add until it has grown (or 8 s): a fixed count could end before
   * a busy machine ran them at the same time, and on one CPU they take
   * turns and never collide. */
  cpu_set_t cpus;
  if (sched_getaffinity(0, sizeof cpus, &cpus) == 0 && CPU_COUNT(&cpus) < 2) {
    printf("auto: SKIPPED: one CPU to run on, so two writers never collide\n");
    EXPECT_I64(0, tally_store_check(s));
    tally_store_close(s);
    return;
  }
  atomic_bool done = false;
  struct writer h[2] = {{.s = s, .only = 0, .stop = &done, .limit = INT_MAX},
                        {.s = s, .only = 0, .stop = &done, .limit = INT_MAX}};
  EXPECT_OK(tally_store_drop(s, "t:0", 3));
  EXPECT_OK(incr(s, "t:0", 0, TALLY_COUNTER_CREATE));
  pthread_t th[2];
  for (int t = 0; t < 2; t++) pthread_create(&th[t], NULL, writer_main, &h[t]);
  tally_counter_info in;
  memset(&in, 0, sizeof in);
  for (int t = 0; t < 800 && in.grown == 0; t++) {
    usleep(10000);
    in = info_of(s, "t:0");
  }
  atomic_store(&done, true);
  for (int t = 0; t < 2; t++) pthread_join(th[t], NULL);
  EXPECT(in.grown > 0);
  EXPECT_I64(h[0].added[0] + h[1].added[0], value_of(s, "t:0"));
  printf("auto: grew to %u shards by name\n", in.shards);
  EXPECT_I64(0, tally_store_check(s));
  tally_store_close(s);
}

/* ---- processes ----------------------------------------------------------------- */

enum { PNAMES = 200 };

static void child_main(const char *spec, _Atomic int64_t *acked, uint64_t seed) {
  tally_store *s;
  if (tally_store_open(spec, NULL, &s)) _exit(2);
  double end = tu_now() + 30;
  for (long n = 0; n < 400000 && tu_now() < end; n++) {
    char nm[32];
    snprintf(nm, sizeof nm, "p:%d", (int)(tu_rng(&seed) % PNAMES));
    if (incr(s, nm, 1, 0)) _exit(4);
    atomic_fetch_add(acked, 1);
  }
  tally_store_close(s);
  _exit(0);
}

static void test_processes(void) {
  char spec[1200];
  tally_store *s;
  tu_spec(spec, sizeof spec, NULL, 0, g_dir, "procs.tly");
  setenv("TALLY_GRACE_MS", "0", 1);
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  tally_counter *c[PNAMES];
  for (int i = 0; i < PNAMES; i++) {
    char nm[32];
    snprintf(nm, sizeof nm, "p:%d", i);
    REQUIRE_OK(tu_counter(s, nm, 1, TALLY_POLICY_THREAD, TALLY_COUNTER_CREATE, &c[i]));
  }
  _Atomic int64_t *acked = tu_shared(4096);
  pid_t pid[2];
  fflush(stdout); /* the children must not print it again */
  for (int k = 0; k < 2; k++)
    if ((pid[k] = fork()) == 0) child_main(spec, &acked[k * 8], 99 + (uint64_t)k);
  /* move the counters under them, and fill the space they leave */
  double end = tu_now() + 20;
  bool killed = false;
  int round = 0, st;
  for (; tu_now() < end; round++) {
    for (int i = round % 3; i < PNAMES; i += 3)
      EXPECT_OK(tally_counter_reshard(c[i], round % 2 ? 1 : 4));
    EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
    char nm[32];
    snprintf(nm, sizeof nm, "fill:%d", round);
    EXPECT_OK(incr(s, nm, round, TALLY_COUNTER_CREATE));
    if (!killed && atomic_load(&acked[0]) > 50000) {
      kill(pid[0], SIGKILL);
      killed = true;
    }
    if (killed && waitpid(pid[1], &st, WNOHANG) == pid[1]) {
      EXPECT(WIFEXITED(st) && WEXITSTATUS(st) == 0);
      pid[1] = -1;
      break;
    }
  }
  if (!killed) kill(pid[0], SIGKILL);
  waitpid(pid[0], &st, 0);
  EXPECT(WIFSIGNALED(st));
  if (pid[1] > 0) {
    waitpid(pid[1], &st, 0);
    EXPECT(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  }
  int64_t total = 0, want = atomic_load(&acked[0]) + atomic_load(&acked[8]);
  for (int i = 0; i < PNAMES; i++) {
    total += tu_value(c[i]);
    tally_counter_close(c[i]);
  }
  tu_expect_acked(total, want);
  for (int r = 0; r < round; r++) {
    char nm[32];
    snprintf(nm, sizeof nm, "fill:%d", r);
    EXPECT_I64(r, value_of(s, nm));
  }
  printf("processes: %lld acknowledged, %lld counted, %d rounds\n", (long long)want,
         (long long)total, round);
  EXPECT_I64(0, tally_store_check(s));
  munmap(acked, 4096);
  tally_store_close(s);
}

int main(void) {
  snprintf(g_dir, sizeof g_dir, "%s", tu_tmpdir("byname"));
  test_semantics();
  test_expired();
  test_threads();
  test_processes();
  tu_rmrf(g_dir);
  return tu_finish("test_byname");
}
