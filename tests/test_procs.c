/* test_procs.c -- several processes on one file store.
 *
 * Children are forked (the parent keeps its own store and handles open, as a
 * master process would), open the store themselves, and publish what tally
 * acknowledged in a MAP_SHARED|MAP_ANONYMOUS page after every increment that
 * returned 0. The parent checks the counter against those acknowledgements:
 * exactly, or, for writers it killed with SIGKILL, up to one increment each.
 * Every loop is bounded by count and time; children run under alarm(); only
 * our own children are ever killed, and all are reaped with waitpid.
 */
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>

#include "testutil.h"

#define MAXC 16

typedef struct page {
  atomic_llong acked[MAXC];   /* sum of deltas whose incr returned 0 */
  atomic_llong created[MAXC]; /* counters created and incremented by creators */
  atomic_int ready[MAXC];
  atomic_int stop;
  atomic_llong removed; /* resets' removed amounts, summed */
  atomic_long resets, reshards;
} page;

static page *g_pg;
static char g_spec[1200];
static char g_dir[1024];
static double g_secs = 0.6;

typedef struct job {
  int kind; /* JOB_* */
  int idx;  /* slot in the page */
  const char *name;
  int policy;
  uint64_t seed;
  int count; /* creators: how many counters */
  const char *prefix;
  double secs;
} job;

enum { JOB_WRITER, JOB_MEDDLER, JOB_RESHARDER, JOB_CREATOR };

static int child_run(const job *j) {
  tally_store *s = NULL;
  tally_counter *c = NULL;
  uint64_t rng = j->seed * 0x9E3779B97F4A7C15ull + 1;
  int rc = tally_store_open(g_spec, NULL, &s);
  if (rc != 0) {
    fprintf(stderr, "child %d: open %s: %s\n", j->idx, g_spec, tally_errmsg());
    return 1;
  }
  if (j->name) {
    rc = tu_counter(s, j->name, 0, -1, 0, &c);
    if (rc != 0) {
      fprintf(stderr, "child %d: counter %s: %s\n", j->idx, j->name, tally_errmsg());
      return 1;
    }
  }
  atomic_store(&g_pg->ready[j->idx], 1);
  double t0 = tu_now();
  int errors = 0;
  switch (j->kind) {
  case JOB_WRITER:
    for (long i = 0;
         i < 50000000 && !atomic_load_explicit(&g_pg->stop, memory_order_relaxed); i++) {
      if ((i & 255) == 0 && tu_now() - t0 > j->secs) break;
      int64_t d = 1;
      if (j->policy == TALLY_POLICY_KEY) {
        uint64_t k = tu_rng(&rng) % 997;
        rc = tally_counter_incr_key(c, &k, sizeof k, d);
      } else if (j->policy == TALLY_POLICY_CUSTOM) {
        rc = tally_counter_incr_shard(c, 0, d);
      } else {
        rc = tally_counter_incr(c, d);
      }
      if (rc == 0) {
        atomic_store_explicit(
            &g_pg->acked[j->idx],
            atomic_load_explicit(&g_pg->acked[j->idx], memory_order_relaxed) + d,
            memory_order_relaxed);
      } else if (errors++ < 3) {
        fprintf(stderr, "child %d: incr -> %s (%s)\n", j->idx, tally_err_name(rc),
                tally_errmsg());
      }
    }
    break;
  case JOB_MEDDLER:   /* reset and reshard alternately */
  case JOB_RESHARDER: /* reshard only, as fast as it can */
    for (long i = 0; i < 10000000 && !atomic_load(&g_pg->stop); i++) {
      if (tu_now() - t0 > j->secs) break;
      uint32_t n = 1 + (uint32_t)(tu_rng(&rng) % TALLY_MAX_SHARDS);
      rc = tally_counter_reshard(c, n);
      if (rc != 0 && errors++ < 3)
        fprintf(stderr, "child %d: reshard(%u) -> %s (%s)\n", j->idx, n,
                tally_err_name(rc), tally_errmsg());
      atomic_fetch_add(&g_pg->reshards, 1);
      if (j->kind == JOB_MEDDLER) {
        int64_t rem = 0;
        rc = tally_counter_reset(c, &rem);
        if (rc == 0) {
          atomic_fetch_add(&g_pg->removed, rem);
          atomic_fetch_add(&g_pg->resets, 1);
        } else if (errors++ < 3) {
          fprintf(stderr, "child %d: reset -> %s (%s)\n", j->idx, tally_err_name(rc),
                  tally_errmsg());
        }
        usleep(500);
      }
    }
    break;
  case JOB_CREATOR:
    for (int i = 0; i < j->count && !atomic_load(&g_pg->stop); i++) {
      char nm[64];
      tally_counter *k = NULL;
      if (tu_now() - t0 > j->secs) break;
      snprintf(nm, sizeof nm, "%s:%d", j->prefix, i);
      rc = tu_counter(s, nm, 1 + (uint32_t)(i % 16), TALLY_POLICY_RANDOM,
                      TALLY_COUNTER_CREATE, &k);
      if (rc == 0) rc = tally_counter_incr(k, 1);
      if (rc == 0) {
        atomic_store(&g_pg->created[j->idx], i + 1);
      } else if (errors++ < 3) {
        fprintf(stderr, "child %d: create %s -> %s (%s)\n", j->idx, nm,
                tally_err_name(rc), tally_errmsg());
      }
      tally_counter_close(k);
      if (rc != 0) break;
    }
    break;
  }
  tally_counter_close(c);
  tally_store_close(s);
  return errors ? 1 : 0;
}

static pid_t spawn(const job *j) {
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  if (pid < 0) {
    perror("fork");
    exit(1);
  }
  if (pid == 0) {
    alarm(120); /* never outlive a stuck test */
    _exit(child_run(j));
  }
  return pid;
}

/* Reap pids[0..n); a child still alive after `timeout` s is killed and
 * counted as a failure. killed[i] set: SIGKILL is the expected status.
 * Returns the number of bad exits. */
static int reap(pid_t *pids, int n, const int *killed, double timeout) {
  double t0 = tu_now();
  int left = n, bad = 0;
  int done[MAXC] = {0};
  while (left > 0) {
    for (int i = 0; i < n; i++) {
      if (done[i]) continue;
      int st;
      pid_t r = waitpid(pids[i], &st, WNOHANG);
      if (r == pids[i]) {
        done[i] = 1;
        left--;
        int want_kill = killed && killed[i];
        if (want_kill ? !(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL) &&
                            !(WIFEXITED(st) && WEXITSTATUS(st) == 0)
                      : !(WIFEXITED(st) && WEXITSTATUS(st) == 0)) {
          TU_FAIL("child %d (pid %d) ended badly: %s %d", i, (int)pids[i],
                  WIFSIGNALED(st) ? "signal" : "exit",
                  WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
          bad++;
        }
      }
    }
    if (left == 0) break;
    if (tu_now() - t0 > timeout) {
      for (int i = 0; i < n; i++)
        if (!done[i]) {
          TU_FAIL("child %d (pid %d) hung for %.0f s; killing it", i, (int)pids[i],
                  timeout);
          kill(pids[i], SIGKILL);
          waitpid(pids[i], NULL, 0);
          done[i] = 1;
          bad++;
        }
      break;
    }
    usleep(2000);
  }
  return bad;
}

static void reset_page(void) {
  memset(g_pg, 0, sizeof *g_pg);
}

static long long acked_sum(int from, int to) {
  long long t = 0;
  for (int i = from; i < to; i++) t += atomic_load(&g_pg->acked[i]);
  return t;
}

static void wait_ready(int from, int to) {
  double t0 = tu_now();
  for (;;) {
    int all = 1;
    for (int i = from; i < to; i++) all &= atomic_load(&g_pg->ready[i]);
    if (all || tu_now() - t0 > 10) return;
    usleep(500);
  }
}

/* ---- 1: every policy, 4 processes --------------------------------------- */

static void test_policies(tally_store *s) {
  const int NP = 4;
  for (int p = 0; p < TALLY_POLICY_SLOT; p++) { /* slot: test_batch */
    char name[64];
    tally_counter *c = NULL;
    pid_t pids[MAXC];
    snprintf(name, sizeof name, "procs:%s", tally_policy_name(p));
    REQUIRE_OK(tu_counter(s, name, 16, p, TALLY_COUNTER_CREATE, &c));
    reset_page();
    for (int i = 0; i < NP; i++) {
      job j = {JOB_WRITER, i, name, p, (uint64_t)(p * 100 + i), 0, NULL, g_secs};
      pids[i] = spawn(&j);
    }
    reap(pids, NP, NULL, 60);
    long long total = acked_sum(0, NP);
    EXPECT_I64(total, tu_value(c));
    int64_t v[16];
    uint32_t n;
    EXPECT_OK(tally_counter_shards(c, v, 16, &n));
    int used = 0;
    for (int i = 0; i < 16; i++) used += v[i] != 0;
    if (p == TALLY_POLICY_THREAD) {
      atomic_fetch_add(&tu_checks, 1);
      if (used != NP)
        TU_FAIL("thread policy: %d processes used %d shards (want one each, distinct)",
                NP, used);
    }
    printf("  %d processes, %-11s: %lld increments acknowledged, value %lld, %d shards "
           "used\n",
           NP, tally_policy_name(p), total, (long long)tu_value(c), used);
    tally_counter_close(c);
  }
}

/* ---- 2: reset and reshard from one process while 3 increment ------------- */

static void test_meddling(tally_store *s) {
  const int NW = 3;
  static const int pols[] = {TALLY_POLICY_THREAD, TALLY_POLICY_RANDOM,
                             TALLY_POLICY_ROUND_ROBIN, TALLY_POLICY_KEY};
  for (int k = 0; k < 4; k++) {
    char name[64];
    tally_counter *c = NULL;
    pid_t pids[MAXC];
    snprintf(name, sizeof name, "meddle:%d", k);
    REQUIRE_OK(tu_counter(s, name, 8, pols[k], TALLY_COUNTER_CREATE, &c));
    reset_page();
    for (int i = 0; i < NW; i++) {
      job j = {JOB_WRITER, i, name, pols[k], (uint64_t)(k * 10 + i), 0, NULL, g_secs * 2};
      pids[i] = spawn(&j);
    }
    job m = {JOB_MEDDLER, NW, name, pols[k], 777 + (uint64_t)k, 0, NULL, g_secs * 4};
    pids[NW] = spawn(&m);
    reap(pids, NW, NULL, 60);
    atomic_store(&g_pg->stop, 1);
    reap(pids + NW, 1, NULL, 60);
    long long total = acked_sum(0, NW), removed = atomic_load(&g_pg->removed);
    int64_t v = tu_value(c);
    EXPECT_I64(total, removed + v);
    EXPECT_OK(tally_store_check(s));
    printf("  3 writers (%s) + 1 process doing %ld resets, %ld reshards: removed %lld + "
           "value %lld = %lld, acked %lld\n",
           tally_policy_name(pols[k]), atomic_load(&g_pg->resets),
           atomic_load(&g_pg->reshards), removed, (long long)v, removed + (long long)v,
           total);
    tally_counter_close(c);
  }
}

/* ---- 3: creating counters while others increment (file grows online) ----- */

static void test_grow(tally_store *s) {
  const int NW = 2, NC = 3, COUNT = 20000;
  tally_counter *c = NULL;
  pid_t pids[MAXC];
  tally_store_stats st0, st1;
  REQUIRE_OK(
      tu_counter(s, "grow:hot", 16, TALLY_POLICY_THREAD, TALLY_COUNTER_CREATE, &c));
  EXPECT_OK(tally_store_stats_get(s, &st0));
  reset_page();
  for (int i = 0; i < NW; i++) {
    job j = {JOB_WRITER, i, "grow:hot", TALLY_POLICY_THREAD, (uint64_t)i, 0, NULL, 60};
    pids[i] = spawn(&j);
  }
  static char prefixes[MAXC][32];
  for (int i = 0; i < NC; i++) {
    /* two creators share a prefix: same names from two processes */
    snprintf(prefixes[i], sizeof prefixes[i], "grow:%d", i < 2 ? 0 : i);
    job j = {JOB_CREATOR, NW + i, NULL, 0, (uint64_t)i, COUNT, prefixes[i], 60};
    pids[NW + i] = spawn(&j);
  }
  /* the parent creates too, and reads the hot counter meanwhile */
  int pc = 0;
  double t0 = tu_now();
  for (int i = 0; i < COUNT && tu_now() - t0 < 60; i++) {
    char nm[32];
    tally_counter *k = NULL;
    snprintf(nm, sizeof nm, "grow:p:%d", i);
    int rc = tu_counter(s, nm, 4, TALLY_POLICY_RANDOM, TALLY_COUNTER_CREATE, &k);
    if (rc == 0) rc = tally_counter_incr(k, 2);
    tally_counter_close(k);
    if (rc != 0) {
      TU_FAIL("parent create %s -> %s (%s)", nm, tally_err_name(rc), tally_errmsg());
      break;
    }
    pc++;
    if ((i & 1023) == 0) (void)tu_value(c);
  }
  reap(pids + NW, NC, NULL, 120);
  atomic_store(&g_pg->stop, 1);
  reap(pids, NW, NULL, 60);
  double t1 = tu_now();
  EXPECT_I64(acked_sum(0, NW), tu_value(c));
  EXPECT_OK(tally_store_stats_get(s, &st1));
  EXPECT(st1.file_bytes > st0.file_bytes);
  int64_t sum;
  uint64_t count;
  long long made[MAXC];
  for (int i = 0; i < NC; i++) made[i] = atomic_load(&g_pg->created[NW + i]);
  EXPECT_I64(COUNT, made[0]);
  EXPECT_I64(COUNT, made[1]);
  EXPECT_I64(COUNT, made[2]);
  EXPECT_OK(tally_store_sum(s, "grow:0:*", 8, &sum, &count));
  EXPECT_I64(COUNT, count);
  EXPECT_I64(2 * COUNT, sum); /* both creators incremented each once */
  EXPECT_OK(tally_store_sum(s, "grow:2:*", 8, &sum, &count));
  EXPECT_I64(COUNT, count);
  EXPECT_I64(COUNT, sum);
  EXPECT_OK(tally_store_sum(s, "grow:p:*", 8, &sum, &count));
  EXPECT_I64(pc, count);
  EXPECT_I64(2 * pc, sum);
  EXPECT_OK(tally_store_check(s));
  printf(
      "  2 writers + 3 creator processes + parent: %lld increments, %d counters created, "
      "file %llu -> %llu bytes in %.2f s\n",
      acked_sum(0, NW), 2 * COUNT + pc, (unsigned long long)st0.file_bytes,
      (unsigned long long)st1.file_bytes, t1 - t0);
  tally_counter_close(c);
}

/* ---- 4: SIGKILL at random moments --------------------------------------- */

static void sleep_ms(double ms) {
  usleep((useconds_t)(ms * 1000));
}

static void test_kill(tally_store *s) {
  const int NW = 4, ROUNDS = 8;
  static const int pols[] = {TALLY_POLICY_THREAD, TALLY_POLICY_RANDOM,
                             TALLY_POLICY_ROUND_ROBIN, TALLY_POLICY_KEY};
  tally_counter *c = NULL;
  uint64_t rng = 2024;
  long long acked_total = 0, killed_total = 0;
  REQUIRE_OK(tu_counter(s, "kill:c", 16, TALLY_POLICY_THREAD, TALLY_COUNTER_CREATE, &c));
  for (int r = 0; r < ROUNDS; r++) {
    pid_t pids[MAXC];
    int killed[MAXC] = {0};
    char prefix[32];
    reset_page();
    for (int i = 0; i < NW; i++) {
      job j = {JOB_WRITER, i,    "kill:c", pols[(i + r) % 4], (uint64_t)(r * 10 + i),
               0,          NULL, 30};
      pids[i] = spawn(&j);
    }
    snprintf(prefix, sizeof prefix, "kill:r%d", r);
    job cj = {JOB_CREATOR, NW, NULL, 0, (uint64_t)r, 1000000, prefix, 30};
    pids[NW] = spawn(&cj);
    wait_ready(0, NW + 1);
    sleep_ms(5 + (double)(tu_rng(&rng) % 60));
    for (int i = 0; i <= NW; i++) {
      int victim = (int)(tu_rng(&rng) % (uint64_t)(NW + 1));
      while (killed[victim]) victim = (victim + 1) % (NW + 1);
      kill(pids[victim], SIGKILL);
      killed[victim] = 1;
      sleep_ms((double)(tu_rng(&rng) % 8));
    }
    reap(pids, NW + 1, killed, 30);
    long long acked = acked_sum(0, NW);
    acked_total += acked;
    killed_total += NW;
    /* a fresh process view: new handle; the old handle must agree */
    tally_counter *c2 = NULL;
    EXPECT_OK(tu_counter(s, "kill:c", 0, -1, 0, &c2));
    int64_t v = c2 ? tu_value(c2) : -1;
    int64_t vo = tu_value(c);
    EXPECT_I64(v, vo);
    atomic_fetch_add(&tu_checks, 1);
    if (v < acked_total || v > acked_total + killed_total)
      TU_FAIL("round %d: value %lld outside [acked %lld, acked + %lld in flight]", r,
              (long long)v, acked_total, killed_total);
    /* the creator's acknowledged counters all exist with value 1 */
    long long made = atomic_load(&g_pg->created[NW]);
    char pat[40];
    int plen = snprintf(pat, sizeof pat, "%s:*", prefix);
    int64_t sum;
    uint64_t count;
    EXPECT_OK(tally_store_sum(s, pat, (size_t)plen, &sum, &count));
    atomic_fetch_add(&tu_checks, 1);
    if ((long long)count < made || (long long)count > made + 1 || sum < made ||
        sum > made + 1)
      TU_FAIL("round %d: creator acked %lld counters, store has %llu with sum %lld", r,
              made, (unsigned long long)count, (long long)sum);
    int rc = tally_store_check(s);
    EXPECT_I64(0, rc);
    if (rc) fprintf(stderr, "  check after kill round %d: %s\n", r, tally_errmsg());
    printf("  kill round %d: value %lld, acked %lld (+%lld in flight max), creator acked "
           "%lld, store has %llu\n",
           r, (long long)v, acked_total, killed_total, made, (unsigned long long)count);
    /* keep the bound tight for the next round */
    acked_total = v;
    killed_total = 0;
    tally_counter_close(c2);
  }
  tally_counter_close(c);
}

/* ---- 5: kill a process in the middle of resharding ----------------------- */

static void test_kill_resharder(tally_store *s) {
  const int NW = 3, ROUNDS = 6;
  tally_counter *c = NULL;
  uint64_t rng = 777;
  REQUIRE_OK(tu_counter(s, "kill:rs", 16, TALLY_POLICY_RANDOM, TALLY_COUNTER_CREATE, &c));
  long long base = 0;
  for (int r = 0; r < ROUNDS; r++) {
    pid_t pids[MAXC];
    int killed[MAXC] = {0};
    int kill_writers = r == ROUNDS - 1;
    reset_page();
    for (int i = 0; i < NW; i++) {
      int pol = i == 0   ? TALLY_POLICY_RANDOM
                : i == 1 ? TALLY_POLICY_THREAD
                         : TALLY_POLICY_KEY;
      job j = {JOB_WRITER, i, "kill:rs", pol, (uint64_t)(r * 7 + i), 0, NULL, 30};
      pids[i] = spawn(&j);
    }
    job rj = {JOB_RESHARDER, NW, "kill:rs", 0, (uint64_t)(r + 1000), 0, NULL, 30};
    pids[NW] = spawn(&rj);
    wait_ready(0, NW + 1);
    sleep_ms(5 + (double)(tu_rng(&rng) % 80));
    kill(pids[NW], SIGKILL);
    killed[NW] = 1;
    long reshards = atomic_load(&g_pg->reshards);
    sleep_ms(50); /* writers go on against a possibly half-done reshard */
    if (kill_writers) {
      for (int i = 0; i < NW; i++) {
        kill(pids[i], SIGKILL);
        killed[i] = 1;
        sleep_ms((double)(tu_rng(&rng) % 5));
      }
    } else {
      atomic_store(&g_pg->stop, 1);
    }
    reap(pids, NW + 1, killed, 30);
    long long acked = acked_sum(0, NW);
    /* another process opens and increments: recovers any pending reshard */
    if (kill_writers) {
      pid_t p;
      reset_page();
      job j = {JOB_WRITER, 0, "kill:rs", TALLY_POLICY_RANDOM, 5, 0, NULL, 0.05};
      p = spawn(&j);
      reap(&p, 1, NULL, 30);
      acked += atomic_load(&g_pg->acked[0]);
    }
    int64_t v = tu_value(c);
    atomic_fetch_add(&tu_checks, 1);
    if (kill_writers ? (v < base + acked || v > base + acked + NW) : v != base + acked)
      TU_FAIL("resharder round %d: value %lld, want %s%lld (acked this round %lld)", r,
              (long long)v, kill_writers ? ">= " : "", base + acked, acked);
    tally_counter_info inf;
    EXPECT_OK(tally_counter_info_get(c, &inf));
    int rc = tally_store_check(s);
    EXPECT_I64(0, rc);
    if (rc) fprintf(stderr, "  check after resharder round %d: %s\n", r, tally_errmsg());
    printf("  resharder killed after %ld reshards (now %u shards)%s: value %lld, "
           "expected %lld%s\n",
           reshards, inf.shards, kill_writers ? ", writers killed too" : "", (long long)v,
           base + acked, kill_writers ? " (+3 max)" : "");
    base = v;
  }
  tally_counter_close(c);
}

/* A store opened before fork(): parent and child share its open file, so
 * the store lock must still keep their creates apart. Both create 20000
 * counters of one shard count at once (half the names shared) and add i+1
 * to counter i; a column handed out twice shows as a wrong value. */
static void test_forked_store(void) {
  char spec[1200];
  tally_store *s = NULL;
  tu_spec(spec, sizeof spec, NULL, 0, g_dir, "forked.tly");
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  enum { N = 20000 };
  pid_t pid = fork();
  if (pid < 0) {
    TU_FAIL("fork: %s", strerror(errno));
    return;
  }
  int me = pid == 0 ? 1 : 0, bad = 0;
  if (pid == 0) alarm(60);
  for (int i = 0; i < N; i++) {
    char name[32];
    /* even i: a name both create; odd i: a name of one's own */
    snprintf(name, sizeof name, i % 2 ? "p%d:%d" : "shared:%d", i % 2 ? me : i, i);
    tally_counter *c = NULL;
    if (tu_counter(s, name, 0, -1, TALLY_COUNTER_CREATE, &c) != 0 ||
        tally_counter_incr(c, i + 1) != 0)
      bad++;
    tally_counter_close(c);
  }
  if (pid == 0) _exit(bad ? 1 : 0);
  int st = 0;
  waitpid(pid, &st, 0);
  EXPECT(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  EXPECT_I64(0, bad);
  for (int i = 0; i < N; i++) {
    char name[32];
    for (int who = 0; who < 2; who++) {
      if (i % 2 == 0 && who) continue;
      snprintf(name, sizeof name, i % 2 ? "p%d:%d" : "shared:%d", i % 2 ? who : i, i);
      tally_counter *c = NULL;
      if (tu_counter(s, name, 0, -1, 0, &c) != 0) {
        TU_FAIL("forked store: %s missing (%s)", name, tally_errmsg());
        continue;
      }
      int64_t v = tu_value(c);
      if (v != (int64_t)(i + 1) * (i % 2 ? 1 : 2))
        TU_FAIL("forked store: %s = %lld", name, (long long)v);
      tally_counter_close(c);
    }
  }
  EXPECT_OK(tally_store_check(s));
  tally_store_close(s);
}

int main(void) {
  tally_store *s = NULL;
  if (getenv("TALLY_TEST_SECS")) g_secs = atof(getenv("TALLY_TEST_SECS"));
  snprintf(g_dir, sizeof g_dir, "%s", tu_tmpdir("procs"));
  tu_spec(g_spec, sizeof g_spec, NULL, 0, g_dir, "procs.tly");
  g_pg =
      mmap(NULL, sizeof(page), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (g_pg == MAP_FAILED) {
    perror("mmap");
    return 1;
  }
  REQUIRE_OK(tally_store_open(g_spec, NULL, &s));
  test_policies(s);
  test_meddling(s);
  {
    /* a store of its own, so growth is not hidden by space earlier tests
     * already reserved */
    tally_store *g = NULL;
    char keep[1200];
    snprintf(keep, sizeof keep, "%s", g_spec);
    tu_spec(g_spec, sizeof g_spec, NULL, 0, g_dir, "grow.tly");
    REQUIRE_OK(tally_store_open(g_spec, NULL, &g));
    test_grow(g);
    tally_store_close(g);
    snprintf(g_spec, sizeof g_spec, "%s", keep);
  }
  test_forked_store();
  test_kill(s);
  test_kill_resharder(s);
  EXPECT_OK(tally_store_check(s));
  tally_store_close(s);

  /* a brand-new process view of the file agrees */
  REQUIRE_OK(tally_store_open(g_spec, NULL, &s));
  EXPECT_OK(tally_store_check(s));
  tally_store_close(s);
  tu_rmrf(g_dir);
  return tu_finish("test_procs");
}
