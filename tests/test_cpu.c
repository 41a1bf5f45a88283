/* test_cpu.c -- the cpu policy: per-CPU cells written by restartable sequences.
 *
 * Exact totals with threads and processes (some pinned to one CPU with
 * sched_setaffinity) incrementing while others reset, writers SIGKILLed
 * at random moments, 64 threads on 2 CPUs; drops racing with writers on
 * every CPU (after a drop returns, no increment through an old handle may
 * succeed: a sequence that stored over a retired cell would make it look
 * live again, and the increments after it would count for nothing). ctest
 * runs it as is, with GLIBC_TUNABLES=glibc.pthread.rseq=0 (the thread
 * policy's path) and under taskset -c 0; the test asks glibc whether rseq
 * is registered, and checks that c:info says the same.
 */
#include <dlfcn.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#if defined(__has_include)
#if __has_include(<sys/rseq.h>)
#include <sys/rseq.h>
#define HAVE_SYS_RSEQ 1
#endif
#endif

#include "testutil.h"

#define MAXW 80

/* the library's seam: pauses inside the sequence, before its commit */
extern unsigned tally__test_rseq_spin;

typedef struct page {
  atomic_llong acked[MAXW]; /* sum of deltas whose increment returned 0 */
  atomic_llong removed;     /* resets' amounts */
  atomic_llong late[MAXW];  /* increments that succeeded after a drop returned */
  atomic_int ready[MAXW];
  atomic_int stop, dropped;
} page;

static page *g_pg;
static char g_spec[1200];
static double g_secs = 0.5;
static int g_ncpu;

/* Is rseq registered here, as the library should find it? */
static int want_rseq(void) {
#if defined(HAVE_SYS_RSEQ) && defined(__x86_64__) && !defined(__SANITIZE_THREAD__)
  return __rseq_size > 0;
#else
  return 0;
#endif
}

static void pin(int cpu) {
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpu % g_ncpu, &one);
  if (sched_setaffinity(0, sizeof one, &one) != 0) perror("sched_setaffinity");
}

static int64_t delta_of(uint64_t *rng) {
  return (int64_t)(tu_rng(rng) % 11) - 3; /* -3..7, negatives too */
}

/* ---- 1: shape, info, what is refused ------------------------------------ */

static void test_shape(void) {
  tally_store *s = NULL;
  tally_counter *c = NULL;
  tally_counter_info info;
  uint32_t n = tally_cpu_shards(), p = (n - 1) / 2, got;
  int64_t v[TALLY_MAX_SHARDS], removed;
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  EXPECT((int)p >= 1 && n == 2 * p + 1);
  REQUIRE_OK(tu_counter(s, "cpu:a", 0, TALLY_POLICY_CPU, TALLY_COUNTER_CREATE, &c));
  EXPECT_OK(tally_counter_info_get(c, &info));
  EXPECT_I64(n, info.shards);
  EXPECT_I64(TALLY_POLICY_CPU, info.policy);
  EXPECT_I64(want_rseq(), info.rseq);
  EXPECT_I64(0, info.auto_shards);
  EXPECT_STR("cpu", tally_policy_name(TALLY_POLICY_CPU));
  for (int i = 0; i < 1000; i++) EXPECT_OK(tally_counter_incr(c, 1));
  EXPECT_OK(tally_counter_shards(c, v, TALLY_MAX_SHARDS, &got));
  int64_t fallback = 0, percpu = 0;
  for (uint32_t i = 1; i <= p; i++) fallback += v[i];
  for (uint32_t i = p + 1; i < n; i++) percpu += v[i];
  EXPECT_I64(0, v[0]);
  /* where they went says which path ran (but the first add on each CPU,
   * which notes the CPU in the store's cpu_seen on the thread path) */
  EXPECT_I64(1000, percpu + fallback);
  if (want_rseq())
    EXPECT(fallback >= 1 && fallback <= (int64_t)p);
  else
    EXPECT_I64(0, percpu);
  EXPECT_RC(TALLY_EPOLICY, tally_counter_incr_key(c, "k", 1, 1));
  EXPECT_RC(TALLY_EPOLICY, tally_counter_incr_shard(c, 0, 1));
  EXPECT_RC(TALLY_EPOLICY, tally_counter_reshard(c, 4));
  /* large deltas take the thread policy's path */
  EXPECT_OK(tally_counter_incr(c, INT64_C(1) << 40));
  EXPECT_OK(tally_counter_incr(c, -(INT64_C(1) << 40)));
  EXPECT_I64(1000, tu_value(c));
  EXPECT_OK(tally_counter_reset(c, &removed));
  EXPECT_I64(1000, removed);
  EXPECT_I64(0, tu_value(c));
  EXPECT_OK(tally_counter_shards(c, v, TALLY_MAX_SHARDS, &got));
  EXPECT_I64(-percpu, v[0]); /* minus the per-CPU cells' sum at the reset */
  EXPECT_OK(tally_counter_incr(c, -7));
  EXPECT_OK(tally_counter_reset(c, &removed));
  EXPECT_I64(-7, removed);
  EXPECT_I64(0, tu_value(c));
  /* the shard count is the policy's */
  tally_counter *d = NULL;
  EXPECT_RC(TALLY_ESHARDS,
            tu_counter(s, "cpu:b", 16, TALLY_POLICY_CPU, TALLY_COUNTER_CREATE, &d));
  EXPECT_RC(TALLY_EMISMATCH, tu_counter(s, "cpu:a", 16, -1, 0, &d));
  EXPECT_OK(tu_counter(s, "cpu:a", n, TALLY_POLICY_CPU, 0, &d));
  tally_counter_close(d);
  d = NULL;
  EXPECT_OK(tu_counter(s, "cpu:c", TALLY_SHARDS_AUTO, TALLY_POLICY_CPU,
                       TALLY_COUNTER_CREATE, &d));
  EXPECT_OK(tally_counter_info_get(d, &info));
  EXPECT_I64(n, info.shards);
  EXPECT_I64(0, info.auto_shards);
  tally_counter_close(d);
  /* a family of cpu counters, and by name */
  tally_family_options fo = {0, TALLY_POLICY_CPU, 0, 0};
  EXPECT_OK(tally_family_define(s, "fam:*", 5, &fo));
  EXPECT_OK(tally_store_incr(s, "fam:x", 5, 3, TALLY_COUNTER_CREATE));
  EXPECT_OK(tu_counter(s, "fam:x", 0, -1, 0, &d));
  EXPECT_OK(tally_counter_info_get(d, &info));
  EXPECT_I64(TALLY_POLICY_CPU, info.policy);
  EXPECT_I64(3, tu_value(d));
  tally_counter_close(d);
  /* a drop, then the old handle */
  EXPECT_OK(tally_store_drop(s, "cpu:a", 5));
  EXPECT_RC(TALLY_EDROPPED, tally_counter_incr(c, 1));
  tally_counter_close(c);
  EXPECT_OK(tally_store_check(s));
  tally_store_close(s);
}

/* ---- 2: threads, with a resetter ----------------------------------------- */

struct tjob {
  tally_counter *c;
  int idx;
  double secs;
};

static void *writer_thread(void *p) {
  struct tjob *j = p;
  uint64_t rng = 99 + (uint64_t)j->idx;
  long long acked = 0;
  double t0 = tu_now();
  for (long i = 0;
       i < 100000000 && !atomic_load_explicit(&g_pg->stop, memory_order_relaxed); i++) {
    if ((i & 1023) == 0 && tu_now() - t0 > j->secs) break;
    int64_t d = delta_of(&rng);
    if (tally_counter_incr(j->c, d) == 0) acked += d;
  }
  atomic_fetch_add(&g_pg->acked[j->idx], acked);
  return NULL;
}

static void *resetter_thread(void *p) {
  struct tjob *j = p;
  double t0 = tu_now();
  for (int i = 0; i < 100000 && tu_now() - t0 < j->secs; i++) {
    int64_t rem;
    if (tally_counter_reset(j->c, &rem) == 0) atomic_fetch_add(&g_pg->removed, rem);
    usleep(200);
  }
  return NULL;
}

static void test_threads(tally_store *s, int nt) {
  pthread_t th[MAXW + 1];
  struct tjob jobs[MAXW + 1];
  char name[32];
  tally_counter *c = NULL;
  snprintf(name, sizeof name, "thr:%d", nt);
  REQUIRE_OK(tu_counter(s, name, 0, TALLY_POLICY_CPU, TALLY_COUNTER_CREATE, &c));
  memset(g_pg, 0, sizeof *g_pg);
  double t0 = tu_now();
  for (int i = 0; i <= nt; i++) {
    jobs[i] = (struct tjob){c, i, g_secs};
    pthread_create(&th[i], NULL, i < nt ? writer_thread : resetter_thread, &jobs[i]);
  }
  for (int i = 0; i <= nt; i++) pthread_join(th[i], NULL);
  long long acked = 0;
  for (int i = 0; i < nt; i++) acked += atomic_load(&g_pg->acked[i]);
  int64_t v = tu_value(c);
  EXPECT_I64(acked, v + atomic_load(&g_pg->removed));
  printf("  %d threads and a resetter: %lld acknowledged = value %lld + removed %lld "
         "(%.2f s)\n",
         nt, acked, (long long)v, (long long)atomic_load(&g_pg->removed), tu_now() - t0);
  tally_counter_close(c);
}

/* ---- 3: processes, pinned and not, SIGKILLed at random ------------------- */

static int proc_writer(int idx, const char *name, int cpu, double secs) {
  tally_store *s = NULL;
  tally_counter *c = NULL;
  uint64_t rng = 7 + (uint64_t)idx * 1000;
  if (cpu >= 0) pin(cpu);
  if (tally_store_open(g_spec, NULL, &s) || tu_counter(s, name, 0, -1, 0, &c)) {
    fprintf(stderr, "writer %d: %s\n", idx, tally_errmsg());
    return 1;
  }
  atomic_store(&g_pg->ready[idx], 1);
  double t0 = tu_now();
  for (long i = 0;
       i < 100000000 && !atomic_load_explicit(&g_pg->stop, memory_order_relaxed); i++) {
    if ((i & 1023) == 0 && tu_now() - t0 > secs) break;
    int64_t d = delta_of(&rng);
    if (tally_counter_incr(c, d) == 0)
      atomic_store_explicit(
          &g_pg->acked[idx],
          atomic_load_explicit(&g_pg->acked[idx], memory_order_relaxed) + d,
          memory_order_relaxed);
  }
  tally_counter_close(c);
  tally_store_close(s);
  return 0;
}

static int proc_resetter(int idx, const char *name, double secs) {
  tally_store *s = NULL;
  tally_counter *c = NULL;
  pin(1); /* a mover pinned to one CPU still fences every CPU */
  if (tally_store_open(g_spec, NULL, &s) || tu_counter(s, name, 0, -1, 0, &c)) return 1;
  atomic_store(&g_pg->ready[idx], 1);
  double t0 = tu_now();
  for (int i = 0; i < 100000 && !atomic_load(&g_pg->stop) && tu_now() - t0 < secs; i++) {
    int64_t rem;
    if (tally_counter_reset(c, &rem) == 0) atomic_fetch_add(&g_pg->removed, rem);
    usleep(300);
  }
  tally_counter_close(c);
  tally_store_close(s);
  return 0;
}

static pid_t spawn_writer(int idx, const char *name, int cpu, double secs) {
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    alarm(60);
    _exit(proc_writer(idx, name, cpu, secs));
  }
  return pid;
}

static void wait_ready(int from, int to) {
  double t0 = tu_now();
  for (int i = from; i < to; i++)
    while (!atomic_load(&g_pg->ready[i]) && tu_now() - t0 < 20) usleep(1000);
}

static int reap(pid_t pid, int killed) {
  int st = 0;
  if (waitpid(pid, &st, 0) != pid) return 0;
  return killed ? WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL
                : WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

static void test_procs_kill(tally_store *s) {
  const int NW = 4, ROUNDS = 6;
  tally_counter *c = NULL;
  uint64_t rng = 4242;
  REQUIRE_OK(tu_counter(s, "pk:c", 0, TALLY_POLICY_CPU, TALLY_COUNTER_CREATE, &c));
  long long base = 0; /* value + removed before the round */
  for (int r = 0; r < ROUNDS; r++) {
    pid_t pids[MAXW];
    memset(g_pg, 0, sizeof *g_pg);
    /* two writers pinned, one to each CPU; the others free */
    for (int i = 0; i < NW; i++) pids[i] = spawn_writer(i, "pk:c", i < 2 ? i : -1, 30);
    fflush(stdout);
    pids[NW] = fork();
    if (pids[NW] == 0) {
      alarm(60);
      _exit(proc_resetter(NW, "pk:c", 30));
    }
    wait_ready(0, NW + 1);
    usleep((useconds_t)(20000 + tu_rng(&rng) % 80000));
    int killed = (int)(tu_rng(&rng) % (uint64_t)NW) + 1; /* writers 0..killed-1 */
    for (int i = 0; i < killed; i++) {
      kill(pids[(i + r) % NW], SIGKILL);
      usleep((useconds_t)(tu_rng(&rng) % 5000));
    }
    atomic_store(&g_pg->stop, 1);
    int ok = 1;
    for (int i = 0; i < NW; i++) {
      int was_killed = 0;
      for (int k = 0; k < killed; k++) was_killed |= (k + r) % NW == i;
      ok &= reap(pids[i], was_killed);
    }
    ok &= reap(pids[NW], 0);
    EXPECT(ok);
    long long acked = 0;
    for (int i = 0; i < NW; i++) acked += atomic_load(&g_pg->acked[i]);
    long long got = (long long)tu_value(c) + atomic_load(&g_pg->removed) - base;
    /* a killed writer may have added its last delta without acknowledging
     * it: at most one delta (-3..7) each */
    atomic_fetch_add(&tu_checks, 1);
    if (got < acked - 3LL * killed || got > acked + 7LL * killed)
      TU_FAIL("round %d: value + removed moved by %lld, writers acknowledged %lld (%d "
              "killed)",
              r, got, acked, killed);
    printf("  round %d: %d writers (%d killed), acknowledged %lld, counted %lld, "
           "removed %lld\n",
           r, NW, killed, acked, got, (long long)atomic_load(&g_pg->removed));
    base = (long long)tu_value(c);
    EXPECT_OK(tally_store_check(s));
  }
  tally_counter_close(c);
}

/* Without a kill the totals are exact. */
static void test_procs_exact(tally_store *s) {
  const int NW = 5;
  tally_counter *c = NULL;
  REQUIRE_OK(tu_counter(s, "pe:c", 0, TALLY_POLICY_CPU, TALLY_COUNTER_CREATE, &c));
  memset(g_pg, 0, sizeof *g_pg);
  pid_t pids[MAXW];
  for (int i = 0; i < NW; i++) pids[i] = spawn_writer(i, "pe:c", i < 2 ? i : -1, g_secs);
  fflush(stdout);
  pids[NW] = fork();
  if (pids[NW] == 0) {
    alarm(60);
    _exit(proc_resetter(NW, "pe:c", g_secs));
  }
  int ok = 1;
  for (int i = 0; i <= NW; i++) ok &= reap(pids[i], 0);
  EXPECT(ok);
  long long acked = 0;
  for (int i = 0; i < NW; i++) acked += atomic_load(&g_pg->acked[i]);
  EXPECT_I64(acked, tu_value(c) + atomic_load(&g_pg->removed));
  printf("  %d processes and a resetter: %lld acknowledged, value %lld, removed %lld\n",
         NW, acked, (long long)tu_value(c), (long long)atomic_load(&g_pg->removed));
  tally_counter_close(c);
}

/* ---- 4: drops racing with writers on every CPU --------------------------- */

/* Increment until the counter is dropped; once the dropper has said its
 * drop returned, every increment must fail. */
static long long until_dropped(tally_counter *c, int idx) {
  long long late = 0;
  int after = 0;
  for (long i = 0; i < 200000000 && after < 1000; i++) {
    int seen = atomic_load(&g_pg->dropped);
    int rc = tally_counter_incr(c, 1);
    after += seen;
    if (rc == 0 && seen) {
      late++;
    } else if (rc != 0 && rc != TALLY_EDROPPED) {
      fprintf(stderr, "writer %d: %s\n", idx, tally_errmsg());
      break;
    }
  }
  return late;
}

static void *drop_writer(void *p) {
  struct tjob *j = p;
  pin(j->idx);
  atomic_store(&g_pg->ready[j->idx], 1);
  atomic_fetch_add(&g_pg->late[j->idx], until_dropped(j->c, j->idx));
  return NULL;
}

static void test_drop_race(tally_store *s, int rounds) {
  long long late = 0;
  uint64_t rng = 5;
  tally__test_rseq_spin = 200; /* sequences in flight most of the time */
  for (int r = 0; r < rounds; r++) {
    char name[32];
    tally_counter *c = NULL;
    snprintf(name, sizeof name, "dr:%d", r);
    REQUIRE_OK(tu_counter(s, name, 0, TALLY_POLICY_CPU, TALLY_COUNTER_CREATE, &c));
    memset(g_pg, 0, sizeof *g_pg);
    /* a writer thread here on CPU 0, a writer process on CPU 1 */
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
      tally_store *cs = NULL;
      tally_counter *cc = NULL;
      alarm(60);
      pin(1);
      if (tally_store_open(g_spec, NULL, &cs) || tu_counter(cs, name, 0, -1, 0, &cc))
        _exit(1);
      atomic_store(&g_pg->ready[1], 1);
      atomic_store(&g_pg->late[1], until_dropped(cc, 1));
      tally_counter_close(cc);
      tally_store_close(cs);
      _exit(0);
    }
    pthread_t th;
    struct tjob j = {c, 0, 0};
    pthread_create(&th, NULL, drop_writer, &j);
    wait_ready(0, 2);
    usleep((useconds_t)(tu_rng(&rng) % 3000));
    EXPECT_OK(tally_store_drop(s, name, strlen(name)));
    atomic_store(&g_pg->dropped, 1);
    pthread_join(th, NULL);
    EXPECT(reap(pid, 0));
    late += atomic_load(&g_pg->late[0]) + atomic_load(&g_pg->late[1]);
    tally_counter_close(c);
  }
  tally__test_rseq_spin = 0;
  EXPECT_I64(0, late);
  printf("  %d drops under writers on every CPU: %lld increments succeeded after a "
         "drop returned\n",
         rounds, late);
  EXPECT_OK(tally_store_check(s));
}

/* ---- 6: the library unloaded after a sequence ran ------------------------ */

/* A child dlopens the shared library, increments a cpu counter through
 * it, closes everything and dlcloses it, then sleeps so that it is
 * preempted: its rseq area still names the sequence's descriptor, which
 * the kernel reads then. The library is NODELETE, so that is no SIGSEGV. */
static void test_unload(void) {
#ifdef TALLY_SHARED_LIB
  pid_t pid = fork();
  if (pid == 0) {
    void *h = dlopen(TALLY_SHARED_LIB, RTLD_NOW | RTLD_LOCAL);
    if (!h) _exit(10);
    int (*so)(const char *, const tally_open_options *, tally_store **) =
        (int (*)(const char *, const tally_open_options *, tally_store **))dlsym(
            h, "tally_store_open");
    int (*co)(tally_store *, const char *, size_t, const tally_counter_options *,
              uint32_t, tally_counter **) =
        (int (*)(tally_store *, const char *, size_t, const tally_counter_options *,
                 uint32_t, tally_counter **))dlsym(h, "tally_counter_open");
    int (*inc)(tally_counter *, int64_t) =
        (int (*)(tally_counter *, int64_t))dlsym(h, "tally_counter_incr");
    void (*cc)(tally_counter *) =
        (void (*)(tally_counter *))dlsym(h, "tally_counter_close");
    void (*sc)(tally_store *) = (void (*)(tally_store *))dlsym(h, "tally_store_close");
    if (!so || !co || !inc || !cc || !sc) _exit(11);
    tally_store *us = NULL;
    tally_counter *c = NULL;
    tally_counter_options o = {0, TALLY_POLICY_CPU};
    if (so(g_spec, NULL, &us) || co(us, "unload", 6, &o, TALLY_COUNTER_CREATE, &c))
      _exit(12);
    for (int i = 0; i < 1000; i++)
      if (inc(c, 1)) _exit(13);
    cc(c);
    sc(us);
    dlclose(h);
    for (int i = 0; i < 200; i++) usleep(1000); /* switched out, many times */
    _exit(0);
  }
  int st = 0;
  waitpid(pid, &st, 0);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
    TU_FAIL("a process that dlclosed the library after a cpu increment: %s %d",
            WIFSIGNALED(st) ? "signal" : "exit",
            WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
#endif
}

int main(void) {
  tally_store *s = NULL;
  char dir[1024];
  if (getenv("TALLY_TEST_SECS")) g_secs = atof(getenv("TALLY_TEST_SECS"));
  g_ncpu = (int)sysconf(_SC_NPROCESSORS_ONLN);
  if (g_ncpu < 1) g_ncpu = 1;
  snprintf(dir, sizeof dir, "%s", tu_tmpdir("cpu"));
  tu_spec(g_spec, sizeof g_spec, NULL, 0, dir, "cpu.tly");
  g_pg =
      mmap(NULL, sizeof(page), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (g_pg == MAP_FAILED) return 1;
  printf("  rseq %s, %u shards per cpu counter\n",
         want_rseq() ? "registered" : "not registered", tally_cpu_shards());
  test_shape();
  REQUIRE_OK(tally_store_open(g_spec, NULL, &s));
  if (getenv("TALLY_TEST_DROPS")) {
    test_drop_race(s, atoi(getenv("TALLY_TEST_DROPS")));
    tally_store_close(s);
    return tu_finish("test_cpu");
  }
  test_threads(s, 2);
  test_threads(s, 64);
  test_procs_exact(s);
  test_procs_kill(s);
  test_drop_race(s, 100);
  test_unload();
  EXPECT_OK(tally_store_check(s));
  tally_store_close(s);
  tu_rmrf(dir);
  return tu_finish("test_cpu");
}
