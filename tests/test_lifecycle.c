/* test_lifecycle.c -- counter lifecycle: reuse, grace periods, expiry, caps.
 *
 * Retired space (dropped and expired counters, old cells of a reshard, old
 * index tables) must be handed out again, but only once no process can
 * still reach it through a handle. These tests churn counters in one and
 * in several processes and check what must hold: the store stops growing,
 * a stale handle never writes into a counter that reused its space (a
 * dropped counter's handle gets EDROPPED, an expired one's re-creates it),
 * a stopped process holds reuse back and a killed one does not, expiry
 * loses no acknowledged increment, caps send new names to the overflow
 * counter, tally_store_check sees damage in the free lists, and a walk
 * that outlasts grace_ms while another thread grows the index and runs
 * grace steps reads the table it began with to the end, and so does an
 * open (or an expired counter's handle coming back) that outlasts a drop
 * of its counter and the reuse of its space.
 *
 * Children are forked as in test_procs.c: they close the stores they
 * inherited (so a slot of the parent's never stands in for them) and open
 * their own; they publish what tally acknowledged in a MAP_SHARED page.
 * TALLY_GRACE_MS is set before every open, so no test waits for the
 * default second. Every loop is bounded by count and time; children run
 * under alarm(); only our own children are ever signalled, and all are
 * reaped with waitpid.
 */
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <fcntl.h>

#include "testutil.h"

#include "../src/core/internal.h" /* tally__test_hook */

#define NW    4  /* writers in the churn test; the last is killed */
#define NAMES 24 /* counters per writer */
#define NIDX  (NW * NAMES)

typedef struct page {
  /* the holder child's protocol: the parent sets op and arg, then bumps
   * seq; the child does it and sets done = seq */
  atomic_int seq, done, op, rc, ready;
  atomic_llong arg, val;
  /* the churn test */
  atomic_int stop, writers_done, phase;
  atomic_llong acked[NIDX];         /* per name: increments acknowledged */
  atomic_llong rolled_last[NIDX];   /* latest rollup value of the name */
  atomic_llong rolled_closed[NIDX]; /* final values of its ended incarnations */
  atomic_int rolled_have[NIDX];
  atomic_llong expired, held, dropped, reshards, ticks;
  atomic_llong child_errors;
} page;

static page *g_pg;
static char g_dir[1024];

/* Stores this process has open: a forked child closes them first. */
static tally_store *g_open[8];

static void track(tally_store *s) {
  for (int i = 0; i < 8; i++)
    if (!g_open[i]) {
      g_open[i] = s;
      return;
    }
}

static void untrack_close(tally_store *s) {
  for (int i = 0; i < 8; i++)
    if (g_open[i] == s) g_open[i] = NULL;
  tally_store_close(s);
}

static tally_store *open_file(const char *name, const char *grace_ms) {
  char spec[1200];
  tally_store *s = NULL;
  tu_spec(spec, sizeof spec, NULL, 0, g_dir, name);
  setenv("TALLY_GRACE_MS", grace_ms, 1);
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  track(s);
  return s;
}

static tally_store_stats stats(tally_store *s) {
  tally_store_stats st;
  memset(&st, 0, sizeof st);
  EXPECT_OK(tally_store_stats_get(s, &st));
  return st;
}

static void sleep_ms(double ms) {
  usleep((useconds_t)(ms * 1000));
}

static void expect_check(tally_store *s, const char *when) {
  int rc = tally_store_check(s);
  EXPECT_I64(0, rc);
  if (rc) fprintf(stderr, "  check %s: %s\n", when, tally_errmsg());
}

/* Create name (or open it: shards 0 and the policy are the family's or
 * the default), add delta, close the handle. */
static int make(tally_store *s, const char *name, uint32_t shards, int64_t delta) {
  tally_counter *c = NULL;
  int rc = tu_counter(s, name, shards, -1, TALLY_COUNTER_CREATE, &c);
  if (rc == 0 && delta) rc = tally_counter_incr(c, delta);
  tally_counter_close(c);
  return rc;
}

/* The value of name, or INT64_MIN if it cannot be read (ENOENT: absent). */
static int64_t value_of(tally_store *s, const char *name, int *rc_out) {
  tally_counter *c = NULL;
  int64_t v = INT64_MIN;
  int rc = tu_counter(s, name, 0, -1, 0, &c);
  if (rc == 0) rc = tally_counter_value(c, &v);
  tally_counter_close(c);
  if (rc_out) *rc_out = rc;
  return rc ? INT64_MIN : v;
}

/* ---- children ------------------------------------------------------------- */

static pid_t spawn(int (*fn)(void *), void *arg) {
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  if (pid < 0) {
    perror("fork");
    exit(1);
  }
  if (pid == 0) {
    alarm(60); /* never outlive a stuck test */
    for (int i = 0; i < 8; i++)
      if (g_open[i]) tally_store_close(g_open[i]); /* the parent's, not ours */
    _exit(fn(arg));
  }
  return pid;
}

/* Reap pid within timeout s; want_kill: SIGKILL is the expected end. */
static void reap(pid_t pid, int want_kill, double timeout) {
  double t0 = tu_now();
  int st = 0;
  for (;;) {
    pid_t r = waitpid(pid, &st, WNOHANG);
    if (r == pid) break;
    if (r < 0) {
      TU_FAIL("waitpid %d: %s", (int)pid, strerror(errno));
      return;
    }
    if (tu_now() - t0 > timeout) {
      TU_FAIL("child %d hung for %.0f s; killing it", (int)pid, timeout);
      kill(pid, SIGKILL);
      waitpid(pid, NULL, 0);
      return;
    }
    usleep(2000);
  }
  int ok = want_kill ? WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL
                     : WIFEXITED(st) && WEXITSTATUS(st) == 0;
  atomic_fetch_add(&tu_checks, 1);
  if (!ok)
    TU_FAIL("child %d ended badly: %s %d", (int)pid, WIFSIGNALED(st) ? "signal" : "exit",
            WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
}

static int wait_flag(atomic_int *f, int want, double timeout) {
  double t0 = tu_now();
  while (atomic_load(f) < want) {
    if (tu_now() - t0 > timeout) return -1;
    usleep(200);
  }
  return 0;
}

/* The holder: a process with its own store and one handle, doing what the
 * parent says, one step at a time. */
enum { OP_INCR = 1, OP_VALUE, OP_MAINTAIN, OP_STOP, OP_EXIT };

struct holder_arg {
  const char *file, *name;
  int publish; /* pass a grace step right after opening the handle */
};

static int holder_main(void *p) {
  const struct holder_arg *a = p;
  char spec[1200];
  tally_store *s = NULL;
  tally_counter *c = NULL;
  tu_spec(spec, sizeof spec, NULL, 0, g_dir, a->file);
  if (tally_store_open(spec, NULL, &s) || tu_counter(s, a->name, 0, -1, 0, &c)) {
    fprintf(stderr, "holder: open %s %s: %s\n", a->file, a->name, tally_errmsg());
    return 1;
  }
  if (tally_counter_incr(c, 1) != 0) return 2;
  if (a->publish && tally_store_maintain(s, 0, 0, NULL) != 0) return 3;
  atomic_store(&g_pg->ready, 1);
  int seen = 0;
  double t0 = tu_now();
  for (;;) {
    if (wait_flag(&g_pg->seq, seen + 1, 50) != 0) return 4;
    seen = atomic_load(&g_pg->seq);
    int64_t v = 0;
    int rc = 0;
    switch (atomic_load(&g_pg->op)) {
    case OP_INCR: rc = tally_counter_incr(c, atomic_load(&g_pg->arg)); break;
    case OP_VALUE:
      rc = tally_counter_value(c, &v);
      atomic_store(&g_pg->val, v);
      break;
    case OP_MAINTAIN: rc = tally_store_maintain(s, 0, 0, NULL); break;
    case OP_STOP:
      atomic_store(&g_pg->rc, 0);
      atomic_store(&g_pg->done, seen);
      raise(SIGSTOP);
      continue;
    case OP_EXIT:
      tally_counter_close(c);
      tally_store_close(s);
      atomic_store(&g_pg->done, seen);
      return 0;
    }
    atomic_store(&g_pg->rc, rc);
    atomic_store(&g_pg->done, seen);
    if (tu_now() - t0 > 55) return 5;
  }
}

static pid_t holder_start(struct holder_arg *a) {
  atomic_store(&g_pg->seq, 0);
  atomic_store(&g_pg->done, 0);
  atomic_store(&g_pg->ready, 0);
  pid_t pid = spawn(holder_main, a);
  if (wait_flag(&g_pg->ready, 1, 20) != 0) TU_FAIL("holder %d never got ready", (int)pid);
  return pid;
}

/* Have the holder do op; its return code (INT32_MIN if it did not answer). */
static int holder_do(int op, int64_t arg) {
  atomic_store(&g_pg->op, op);
  atomic_store(&g_pg->arg, arg);
  int seq = atomic_fetch_add(&g_pg->seq, 1) + 1;
  if (wait_flag(&g_pg->done, seq, 20) != 0) {
    TU_FAIL("holder did not answer op %d", op);
    return INT32_MIN;
  }
  return atomic_load(&g_pg->rc);
}

/* ---- 1: reuse in one process -------------------------------------------- */

static void test_reuse(const char *spec, const char *label) {
  enum { N = 3000, KEEP = 16 };
  tally_store *s = NULL;
  char nm[64];
  setenv("TALLY_GRACE_MS", "0", 1);
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  track(s);
  tally_counter *keep[KEEP];
  for (int i = 0; i < KEEP; i++) {
    snprintf(nm, sizeof nm, "keep:%d", i);
    REQUIRE_OK(tu_counter(s, nm, 1 + (uint32_t)i % 5, TALLY_POLICY_RANDOM,
                          TALLY_COUNTER_CREATE, &keep[i]));
  }
  int64_t kept[KEEP] = {0};
  tally_store_stats st0 = stats(s), st1, st2, st3;
  for (int round = 1; round <= 2; round++) {
    int bad = 0;
    for (int i = 0; i < N; i++) {
      snprintf(nm, sizeof nm, "r%d:%05d", round, i);
      if (make(s, nm, 1 + (uint32_t)i % 7, i + 1 + round) != 0 && bad++ < 3)
        TU_FAIL("%s: create %s: %s", label, nm, tally_errmsg());
      if (i % 200 == 0) { /* live counters go on meanwhile */
        EXPECT_OK(tally_counter_incr(keep[i / 200 % KEEP], i + 1));
        kept[i / 200 % KEEP] += i + 1;
      }
    }
    for (int i = 0; i < N; i += 97) {
      snprintf(nm, sizeof nm, "r%d:%05d", round, i);
      EXPECT_I64(i + 1 + round, value_of(s, nm, NULL));
    }
    if (round == 1) {
      st1 = stats(s);
      for (int i = 0; i < N; i++) {
        snprintf(nm, sizeof nm, "r1:%05d", i);
        EXPECT_OK(tally_store_drop(s, nm, strlen(nm)));
      }
      EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
      st2 = stats(s);
      EXPECT_I64(KEEP, st2.counters);
      EXPECT_I64(0, st2.retired_bytes); /* grace 0, one process: all ripe */
      EXPECT(st2.reusable_bytes > 0);
      EXPECT(st2.live_bytes < st1.live_bytes);
    }
  }
  st3 = stats(s);
  uint64_t grew1 = st1.used_bytes - st0.used_bytes,
           grew2 = st3.used_bytes - st2.used_bytes;
  uint64_t reused = st3.reused_bytes - st2.reused_bytes;
  /* the second round lives in the first's space: its records and columns
   * (cells come in chunks: the first round's chunks are not all used) */
  EXPECT(grew2 * 20 <= grew1);
  EXPECT(reused * 2 >= grew1);
  EXPECT_I64(N + KEEP, st3.counters);
  int rc;
  EXPECT_I64(INT64_MIN, value_of(s, "r1:00000", &rc));
  EXPECT_I64(TALLY_ENOENT, rc);
  for (int i = 0; i < N; i++) {
    snprintf(nm, sizeof nm, "r2:%05d", i);
    int64_t v = value_of(s, nm, NULL);
    if (v != i + 3) TU_FAIL("%s: %s = %lld, want %d", label, nm, (long long)v, i + 3);
  }
  for (int i = 0; i < KEEP; i++) EXPECT_I64(kept[i], tu_value(keep[i]));
  expect_check(s, label);
  printf("  %s: %d counters: arena +%llu bytes; dropped, then %d new: +%llu bytes, "
         "%llu reused\n",
         label, N, (unsigned long long)grew1, N, (unsigned long long)grew2,
         (unsigned long long)reused);
  for (int i = 0; i < KEEP; i++) tally_counter_close(keep[i]);
  untrack_close(s);
}

/* The grace time: nothing retired is reused before it is grace_ms old. */
static void test_grace_time(void) {
  tally_store *s = open_file("grace.tly", "400");
  char nm[64];
  double t0 = tu_now();
  for (int i = 0; i < 100; i++) {
    snprintf(nm, sizeof nm, "g:%03d", i);
    EXPECT_OK(make(s, nm, 4, 1));
  }
  for (int i = 0; i < 100; i++) {
    snprintf(nm, sizeof nm, "g:%03d", i);
    EXPECT_OK(tally_store_drop(s, nm, strlen(nm)));
  }
  /* idle times are 32-bit seconds: a clock beyond is refused */
  EXPECT_RC(TALLY_EINVAL, tally_store_maintain(s, INT64_MAX, 0, NULL));
  EXPECT_RC(TALLY_EINVAL, tally_store_maintain(s, TALLY_MAINTAIN_MAX_MS + 1, 0, NULL));
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  for (int i = 0; i < 100; i++) {
    snprintf(nm, sizeof nm, "h:%03d", i);
    EXPECT_OK(make(s, nm, 4, 2));
  }
  tally_store_stats a = stats(s);
  if (tu_now() - t0 < 0.35) { /* a slow machine passed the grace time already */
    EXPECT(a.retired_bytes > 0);
    EXPECT_I64(0, a.reusable_bytes);
    EXPECT_I64(0, a.reused_bytes);
  }
  sleep_ms(450);
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  tally_store_stats b = stats(s);
  EXPECT_I64(0, b.retired_bytes);
  EXPECT(b.reusable_bytes > 0);
  for (int i = 0; i < 100; i++) {
    snprintf(nm, sizeof nm, "k:%03d", i);
    EXPECT_OK(make(s, nm, 4, 3));
  }
  tally_store_stats c = stats(s);
  EXPECT(c.reused_bytes > b.reused_bytes);
  int64_t sum;
  uint64_t count;
  EXPECT_OK(tally_store_sum(s, "h:*", 3, &sum, &count));
  EXPECT_I64(200, sum);
  EXPECT_OK(tally_store_sum(s, "k:*", 3, &sum, &count));
  EXPECT_I64(300, sum);
  expect_check(s, "after the grace time");
  untrack_close(s);
}

/* ---- 2: churn is bounded -------------------------------------------------- */

#if defined(__SANITIZE_THREAD__)
#define CHURN_ROUNDS 3 /* one thread: ThreadSanitizer only slows it down */
#else
#define CHURN_ROUNDS 10
#endif

static void test_churn_bound(void) {
  enum { N = 20000, ROUNDS = CHURN_ROUNDS };
  char nm[64];
  double t0 = tu_now();
  tally_store *base = open_file("base.tly", "0");
  for (int i = 0; i < N; i++) {
    snprintf(nm, sizeof nm, "c0:%05d", i);
    if (make(base, nm, 1 + (uint32_t)i % 4, 1) != 0) {
      TU_FAIL("baseline create %s: %s", nm, tally_errmsg());
      break;
    }
  }
  tally_store_stats bs = stats(base);
  untrack_close(base);

  tally_store *s = open_file("churn.tly", "0");
  uint64_t steady = 0; /* the arena once the churn's own free space exists */
  int r;
  for (r = 0; r < ROUNDS && tu_now() - t0 < 60; r++) {
    int bad = 0;
    for (int i = 0; i < N && !bad; i++) {
      snprintf(nm, sizeof nm, "c%d:%05d", r, i);
      if (make(s, nm, 1 + (uint32_t)i % 4, i + r) != 0) {
        TU_FAIL("round %d: create %s: %s", r, nm, tally_errmsg());
        bad = 1;
      }
    }
    int64_t sum;
    uint64_t count;
    char pat[16];
    snprintf(pat, sizeof pat, "c%d:*", r);
    EXPECT_OK(tally_store_sum(s, pat, strlen(pat), &sum, &count));
    EXPECT_I64(N, count);
    EXPECT_I64((int64_t)N * (N - 1) / 2 + (int64_t)N * r, sum);
    tally_store_stats st = stats(s);
    if (r == 1) steady = st.used_bytes;
    if (r > 1 && st.used_bytes > steady)
      TU_FAIL("round %d: the arena grew from %llu to %llu bytes: the same churn again "
              "should fit in what the last round freed",
              r, (unsigned long long)steady, (unsigned long long)st.used_bytes);
    for (int i = 0; i < N; i++) {
      snprintf(nm, sizeof nm, "c%d:%05d", r, i);
      if (tally_store_drop(s, nm, strlen(nm)) != 0 && bad++ < 3)
        TU_FAIL("round %d: drop %s: %s", r, nm, tally_errmsg());
    }
    EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  }
  EXPECT_I64(ROUNDS, r);
  tally_store_stats st = stats(s);
  EXPECT_I64(0, st.counters);
  EXPECT(st.reused_bytes > 0);
  /* the arena, and the file (which grows by whole MiB) */
  atomic_fetch_add(&tu_checks, 2);
  if ((double)st.used_bytes > 1.25 * (double)bs.used_bytes)
    TU_FAIL("after %d rounds of %d counters created and dropped the arena is %llu bytes, "
            "over 1.25 x %llu (a store holding %d)",
            r, N, (unsigned long long)st.used_bytes, (unsigned long long)bs.used_bytes,
            N);
  if ((double)st.file_bytes > 1.25 * (double)bs.file_bytes + (1 << 20))
    TU_FAIL("after %d rounds of %d counters created and dropped the file is %llu bytes, "
            "over 1.25 x %llu + 1 MiB (a store holding %d)",
            r, N, (unsigned long long)st.file_bytes, (unsigned long long)bs.file_bytes,
            N);
  expect_check(s, "after churn");
  printf("  churn: %d rounds of %d counters: arena %llu bytes, file %llu (a store of %d: "
         "%llu, %llu), %llu reused, %.2f s\n",
         r, N, (unsigned long long)st.used_bytes, (unsigned long long)st.file_bytes, N,
         (unsigned long long)bs.used_bytes, (unsigned long long)bs.file_bytes,
         (unsigned long long)st.reused_bytes, tu_now() - t0);
  untrack_close(s);
}

/* ---- 3: stale handles across reuse ---------------------------------------- */

/* Create `n` counters prefix:i of 4 shards, value base + i (they take any
 * free space there is); check them with check_fill. */
static void fill(tally_store *s, const char *prefix, int n, int64_t base) {
  char nm[64];
  for (int i = 0; i < n; i++) {
    snprintf(nm, sizeof nm, "%s:%d", prefix, i);
    EXPECT_OK(make(s, nm, 4, base + i));
  }
}

static void check_fill(tally_store *s, const char *prefix, int n, int64_t base) {
  char nm[64];
  for (int i = 0; i < n; i++) {
    snprintf(nm, sizeof nm, "%s:%d", prefix, i);
    int64_t v = value_of(s, nm, NULL);
    atomic_fetch_add(&tu_checks, 1);
    if (v != base + i)
      TU_FAIL("%s = %lld, want %lld: a stale handle wrote into reused space?", nm,
              (long long)v, (long long)(base + i));
  }
}

/* In this process: a handle to a dropped counter, then one to an expired
 * one, while their space is reused. */
static void test_stale_here(void) {
  tally_store *s = open_file("stale-here.tly", "0");
  tally_family_options fo = {4, -1, 1, 0};
  tally_counter *d = NULL, *e = NULL;
  tally_counter_info inf;
  memset(&inf, 0, sizeof inf);
  EXPECT_OK(tally_family_define(s, "sx:*", 4, &fo));
  REQUIRE_OK(tu_counter(s, "st:d", 4, TALLY_POLICY_RANDOM, TALLY_COUNTER_CREATE, &d));
  REQUIRE_OK(tu_counter(s, "sx:e", 4, TALLY_POLICY_RANDOM, TALLY_COUNTER_CREATE, &e));
  EXPECT_OK(tally_counter_incr(d, 5));
  EXPECT_OK(tally_counter_incr(e, 6));
  EXPECT_OK(tally_counter_info_get(e, &inf));
  uint64_t inc1 = inf.incarnation;
  EXPECT(inc1 != 0);

  /* dropped: its cells and record go to others; the handle only errs */
  EXPECT_OK(tally_store_drop(s, "st:d", 4));
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  uint64_t reused0 = stats(s).reused_bytes;
  fill(s, "y", 40, 1000);
  EXPECT(stats(s).reused_bytes > reused0);
  EXPECT_RC(TALLY_EDROPPED, tally_counter_incr(d, 7));
  EXPECT_RC(TALLY_EDROPPED, tally_counter_incr_shard(d, 1, 7));
  int64_t v = 0;
  EXPECT_RC(TALLY_EDROPPED, tally_counter_value(d, &v));
  EXPECT_RC(TALLY_EDROPPED, tally_counter_reshard(d, 2));
  EXPECT_FAILS(tally_counter_info_get(d, &inf));
  check_fill(s, "y", 40, 1000);

  /* expired: idle for idle_s of the caller's clock */
  tally_maintain_result mr;
  EXPECT_OK(tally_store_maintain(s, 10000, 1000, &mr));
  EXPECT_I64(0, mr.expired);
  EXPECT_OK(tally_store_maintain(s, 10500, 1000, &mr));
  EXPECT_I64(0, mr.expired); /* half a second: not yet */
  EXPECT_OK(tally_store_maintain(s, 11000, 1000, &mr));
  EXPECT_I64(1, mr.expired);
  EXPECT_I64(1, stats(s).expired);
  EXPECT_OK(tally_store_maintain(s, 11000, 0, NULL));
  reused0 = stats(s).reused_bytes;
  fill(s, "z", 40, 2000);
  EXPECT(stats(s).reused_bytes > reused0);
  EXPECT_OK(tally_counter_value(e, &v));
  EXPECT_I64(0, v); /* gone, not back yet */
  int rc;
  EXPECT_I64(INT64_MIN, value_of(s, "sx:e", &rc));
  EXPECT_I64(TALLY_ENOENT, rc);
  /* a reset removes nothing and brings nothing back */
  int64_t removed = -1;
  EXPECT_OK(tally_counter_reset(e, &removed));
  EXPECT_I64(0, removed);
  EXPECT_I64(INT64_MIN, value_of(s, "sx:e", &rc));
  EXPECT_I64(TALLY_ENOENT, rc);
  /* an add no counter at 0 could take brings nothing back */
  EXPECT_RC(TALLY_ERANGE, tally_counter_incr(e, INT64_MAX));
  EXPECT_RC(TALLY_ERANGE, tally_counter_incr(e, -(INT64_C(1) << 62) - 1));
  EXPECT_I64(INT64_MIN, value_of(s, "sx:e", &rc));
  EXPECT_I64(TALLY_ENOENT, rc);
  EXPECT_OK(tally_counter_incr(e, 9)); /* comes back with this increment only */
  EXPECT_I64(9, tu_value(e));
  EXPECT_I64(9, value_of(s, "sx:e", NULL));
  EXPECT_OK(tally_counter_info_get(e, &inf));
  EXPECT(inf.incarnation != 0 && inf.incarnation != inc1);
  EXPECT_I64(4, inf.shards);
  check_fill(s, "y", 40, 1000);
  check_fill(s, "z", 40, 2000);

  /* a handle whose cells were resharded away by another handle: a shard
   * past its old count is one of the counter's now */
  tally_counter *r1 = NULL, *r2 = NULL;
  EXPECT_OK(tu_counter(s, "st:r", 1, -1, TALLY_COUNTER_CREATE, &r1));
  EXPECT_OK(tu_counter(s, "st:r", 0, -1, 0, &r2));
  EXPECT_OK(tally_counter_incr_shard(r1, 0, 1));
  EXPECT_OK(tally_counter_reshard(r2, 8));
  EXPECT_OK(tally_counter_incr_shard(r1, 5, 10));
  EXPECT_RC(TALLY_ESHARDS, tally_counter_incr_shard(r1, 8, 10));
  EXPECT_I64(11, tu_value(r2));
  tally_counter_close(r1);
  tally_counter_close(r2);
  expect_check(s, "after stale handles here");
  tally_counter_close(d);
  tally_counter_close(e);
  untrack_close(s);
}

/* An upkeep killed between marking a counter expired and recording its
 * drop leaves it live with the mark; a user's drop of it later is still a
 * drop: a handle gets EDROPPED (an expired counter's would bring it back)
 * and it does not count as expired. */
static void die_at_expire(const char *where, const char *name, size_t len) {
  (void)name, (void)len;
  if (strcmp(where, "expire") == 0) _exit(0);
}

static void test_expiry_killed(void) {
  char spec[1200];
  tu_spec(spec, sizeof spec, NULL, 0, g_dir, "expkill.tly");
  tally_store *s = open_file("expkill.tly", "0");
  tally_family_options fo = {1, -1, 10, 0}; /* idle 10 s */
  EXPECT_OK(tally_family_define(s, "ik:*", 4, &fo));
  EXPECT_OK(tally_store_incr(s, "ik:a", 4, 5, TALLY_COUNTER_CREATE));
  EXPECT_OK(tally_store_maintain(s, 1000000, 1000, NULL)); /* seen at t = 1000 s */
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) { /* an upkeep that dies as it expires ik:a */
    tally_store *cs;
    tally__test_hook = die_at_expire;
    if (tally_store_open(spec, NULL, &cs) ||
        tally_store_maintain(cs, 1011000, 1000, NULL))
      _exit(2);
    _exit(3); /* expired nothing: the hook never ran */
  }
  int st;
  waitpid(pid, &st, 0);
  EXPECT(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  EXPECT_I64(5, value_of(s, "ik:a", NULL)); /* still there */
  tally_counter *c = NULL;
  REQUIRE_OK(tu_counter(s, "ik:a", 0, -1, 0, &c));
  EXPECT_OK(tally_store_drop(s, "ik:a", 4));
  EXPECT_RC(TALLY_EDROPPED, tally_counter_incr(c, 1));
  int rc;
  EXPECT_I64(INT64_MIN, value_of(s, "ik:a", &rc));
  EXPECT_I64(TALLY_ENOENT, rc);
  EXPECT_I64(0, stats(s).expired);
  tally_counter_close(c);
  expect_check(s, "after an expiry killed");
  untrack_close(s);
}

/* In another process: it holds a handle to X, which is dropped (expire:
 * expired) and whose space is reused. publish: the holder has passed a
 * grace step since opening its handle; else it only opened the store and
 * the counter (the documented contract covers both: a process with a
 * handle holds reuse back). */
static void test_stale_there(int expire, int publish) {
  char file[64], label[64];
  snprintf(file, sizeof file, "stale-%d%d.tly", expire, publish);
  snprintf(label, sizeof label, "%s, holder %s", expire ? "expired" : "dropped",
           publish ? "passed a grace step" : "only opened");
  const char *x = expire ? "sx:x" : "st:x";
  tally_store *s = open_file(file, "0");
  tally_family_options fo = {4, -1, 1, 0};
  EXPECT_OK(tally_family_define(s, "sx:*", 4, &fo));
  EXPECT_OK(make(s, x, 4, 5));
  EXPECT_OK(tally_store_maintain(s, 1000, 1000, NULL)); /* expiry: first look */
  struct holder_arg a = {file, x, publish};
  pid_t pid = holder_start(&a); /* it adds 1 */
  EXPECT_I64(6, value_of(s, x, NULL));

  if (expire) {
    tally_maintain_result mr;
    EXPECT_OK(tally_store_maintain(s, 1500, 1000, &mr)); /* moved: looks again */
    EXPECT_OK(tally_store_maintain(s, 3000, 1000, &mr)); /* whole seconds: 2 to 3 */
    EXPECT_I64(1, mr.expired);
  } else {
    EXPECT_OK(tally_store_drop(s, x, strlen(x)));
  }
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  tally_grace_info gi;
  EXPECT_OK(tally_store_grace(s, &gi));
  EXPECT(gi.processes >= 2);
  EXPECT(gi.behind >= 1);
  EXPECT_I64(pid, gi.oldest_pid);
  uint64_t reused0 = stats(s).reused_bytes;
  fill(s, "y", 40, 1000); /* X's space is held back: the holder has not passed */
  EXPECT_I64(reused0, stats(s).reused_bytes);

  /* the holder's increment through its old handle, before its grace step */
  int rc = holder_do(OP_INCR, 100);
  if (expire) {
    EXPECT_I64(0, rc);
    EXPECT_I64(100, value_of(s, x, NULL)); /* re-created with it */
  } else {
    EXPECT_I64(TALLY_EDROPPED, rc);
  }
  /* the holder passes a grace step; now the space is reused */
  if (expire) { /* expire the re-created X again */
    EXPECT_OK(tally_store_maintain(s, 5000, 1000, NULL));
    EXPECT_OK(tally_store_maintain(s, 6100, 1000, NULL));
    EXPECT_I64(INT64_MIN, value_of(s, x, NULL));
  }
  EXPECT_I64(0, holder_do(OP_MAINTAIN, 0));
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  EXPECT_OK(tally_store_grace(s, &gi));
  EXPECT_I64(0, gi.behind);
  fill(s, "z", 80, 2000);
  EXPECT(stats(s).reused_bytes > reused0);
  rc = holder_do(OP_INCR, 1000000);
  if (expire) {
    EXPECT_I64(0, rc);
    EXPECT_I64(1000000, value_of(s, x, NULL));
  } else {
    EXPECT_I64(TALLY_EDROPPED, rc);
  }
  check_fill(s, "y", 40, 1000);
  check_fill(s, "z", 80, 2000);
  holder_do(OP_EXIT, 0);
  reap(pid, 0, 20);
  expect_check(s, label);

  printf("  stale handle in another process (%s): ok if no failure above\n", label);
  untrack_close(s);
}

/* The grace time counts from the step that finds every process past the
 * retirement, not from the retirement: another process that was behind
 * for longer than grace_ms, and passes now, may have a thread between
 * loading the old cells and its add. */
static void test_grace_from_pass(void) {
  tally_store *s = open_file("grace-pass.tly", "300");
  EXPECT_OK(make(s, "gp:x", 4, 5));
  struct holder_arg a = {"grace-pass.tly", "gp:x", 1};
  pid_t pid = holder_start(&a);
  EXPECT_OK(tally_store_drop(s, "gp:x", 4));
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  sleep_ms(400); /* past grace_ms since the drop; the holder is behind */
  EXPECT_I64(0, holder_do(OP_MAINTAIN, 0));
  double passed = tu_now();
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  uint64_t reused0 = stats(s).reused_bytes;
  fill(s, "gq", 80, 1000);
  if (tu_now() - passed < 0.25) { /* a slow machine passed the grace time already */
    EXPECT_I64(reused0, stats(s).reused_bytes);
    EXPECT(stats(s).retired_bytes > 0);
  }
  sleep_ms(350);
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  EXPECT(stats(s).reusable_bytes > 0);
  fill(s, "gr", 80, 2000);
  EXPECT(stats(s).reused_bytes > reused0);
  EXPECT_I64(TALLY_EDROPPED, holder_do(OP_INCR, 100));
  check_fill(s, "gq", 80, 1000);
  check_fill(s, "gr", 80, 2000);
  holder_do(OP_EXIT, 0);
  reap(pid, 0, 20);
  expect_check(s, "grace from the pass");
  untrack_close(s);
}

/* ---- 4: a stopped process holds reuse back, a killed one does not ---------- */

static void test_stopped(void) {
  tally_store *s = open_file("stopped.tly", "0");
  char nm[64];
  EXPECT_OK(make(s, "sp:x", 8, 5));
  struct holder_arg a = {"stopped.tly", "sp:x", 1};
  pid_t pid = holder_start(&a);
  EXPECT_I64(0, holder_do(OP_STOP, 0));
  int st = 0;
  pid_t w = waitpid(pid, &st, WUNTRACED);
  EXPECT(w == pid && WIFSTOPPED(st));

  tally_store_stats s0 = stats(s);
  EXPECT_OK(tally_store_drop(s, "sp:x", 4));
  for (int r = 0; r < 3; r++) { /* churn while it is stopped */
    for (int i = 0; i < 300; i++) {
      snprintf(nm, sizeof nm, "sp:c%d:%d", r, i);
      EXPECT_OK(make(s, nm, 8, 1));
    }
    for (int i = 0; i < 300; i++) {
      snprintf(nm, sizeof nm, "sp:c%d:%d", r, i);
      EXPECT_OK(tally_store_drop(s, nm, strlen(nm)));
    }
    EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  }
  sleep_ms(20);
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  tally_store_stats s1 = stats(s);
  EXPECT_I64(s0.reused_bytes, s1.reused_bytes);
  EXPECT_I64(s0.reusable_bytes, s1.reusable_bytes);
  EXPECT(s1.retired_bytes > s0.retired_bytes);
  tally_grace_info gi;
  EXPECT_OK(tally_store_grace(s, &gi));
  EXPECT(gi.behind >= 1);
  EXPECT_I64(pid, gi.oldest_pid);

  kill(pid, SIGCONT);
  EXPECT_I64(TALLY_EDROPPED, holder_do(OP_INCR, 1));
  EXPECT_I64(0, holder_do(OP_MAINTAIN, 0));
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL)); /* the holder is alive, passed */
  tally_store_stats s2 = stats(s);
  EXPECT_I64(0, s2.retired_bytes);
  EXPECT(s2.reusable_bytes > s1.reusable_bytes);
  fill(s, "sp:y", 50, 7);
  EXPECT(stats(s).reused_bytes > s1.reused_bytes);
  EXPECT_I64(TALLY_EDROPPED, holder_do(OP_INCR, 1));
  check_fill(s, "sp:y", 50, 7);
  holder_do(OP_EXIT, 0);
  reap(pid, 0, 20);
  printf("  stopped holder: %llu bytes held back while it was stopped, reused after\n",
         (unsigned long long)s1.retired_bytes);

  /* killed: its slot never holds anything back again */
  EXPECT_OK(make(s, "sp:k", 8, 5));
  struct holder_arg b = {"stopped.tly", "sp:k", 1};
  pid = holder_start(&b);
  EXPECT_OK(tally_store_drop(s, "sp:k", 4));
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  EXPECT_OK(tally_store_grace(s, &gi));
  EXPECT_I64(pid, gi.oldest_pid);
  EXPECT(stats(s).retired_bytes > 0);
  kill(pid, SIGKILL);
  reap(pid, 1, 20);
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  EXPECT_OK(tally_store_grace(s, &gi));
  EXPECT_I64(0, gi.behind);
  EXPECT_I64(1, gi.processes);
  EXPECT_I64(0, stats(s).retired_bytes);
  for (int r = 0; r < 3; r++) {
    uint64_t before = stats(s).reused_bytes;
    for (int i = 0; i < 100; i++) {
      snprintf(nm, sizeof nm, "sp:k%d:%d", r, i);
      EXPECT_OK(make(s, nm, 8, 1));
      EXPECT_OK(tally_store_drop(s, nm, strlen(nm)));
    }
    EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
    EXPECT(stats(s).reused_bytes > before);
    EXPECT_I64(0, stats(s).retired_bytes);
  }
  /* killed while only creates run (no upkeep): a create takes a process
   * it found alive to be so for 100 ms without a look (grace.c), so the
   * creates stop waiting for the dead one soon after, not never */
  EXPECT_OK(make(s, "sp:q", 8, 5));
  struct holder_arg q = {"stopped.tly", "sp:q", 1};
  pid = holder_start(&q);
  EXPECT_OK(tally_store_drop(s, "sp:q", 4));
  EXPECT_OK(make(s, "sp:q0", 8, 1)); /* its grace step finds the holder alive */
  EXPECT(stats(s).retired_bytes > 0);
  kill(pid, SIGKILL);
  reap(pid, 1, 20);
  double t0 = tu_now();
  int made = 1;
  while (stats(s).retired_bytes > 0 && tu_now() - t0 < 5.0 && made < 100000) {
    snprintf(nm, sizeof nm, "sp:q%d", made++);
    EXPECT_OK(make(s, nm, 8, 1));
    usleep(1000);
  }
  EXPECT_I64(0, stats(s).retired_bytes);
  printf("  killed holder, creates only: reuse went on after %.0f ms (%d creates)\n",
         (tu_now() - t0) * 1e3, made - 1);
  check_fill(s, "sp:y", 50, 7);
  expect_check(s, "after the stopped and the killed holder");
  untrack_close(s);
}

/* ---- 4b: the process table: a late opener, a fork ------------------------ */

/* An opener paused in claim() between finding a slot free and taking it
 * (first time only), while another process takes that slot, opens a
 * handle and publishes a grace step. When the opener goes on, the slot
 * and its word stay the other process's: it still holds reuse back. */
static void claim_pause(const char *where, const char *name, size_t len) {
  (void)name;
  (void)len;
  if (strcmp(where, "claim") != 0 || atomic_load(&g_pg->phase) != 0) return;
  atomic_store(&g_pg->phase, 1);
  (void)wait_flag(&g_pg->phase, 2, 30);
}

static int late_opener_main(void *p) {
  char spec[1200];
  tally_store *s = NULL;
  tu_spec(spec, sizeof spec, NULL, 0, g_dir, p);
  tally__test_hook = claim_pause;
  if (tally_store_open(spec, NULL, &s)) return 1;
  tally_store_close(s);
  return 0;
}

static void test_late_opener(void) {
  tally_store *s = open_file("claim.tly", "0");
  EXPECT_OK(make(s, "cl:x", 4, 5));
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  atomic_store(&g_pg->phase, 0);
  pid_t opener = spawn(late_opener_main, "claim.tly");
  if (wait_flag(&g_pg->phase, 1, 20) != 0) TU_FAIL("the opener never reached claim()");
  struct holder_arg a = {"claim.tly", "cl:x", 1};
  pid_t holder = holder_start(&a); /* the slot the opener found free */
  atomic_store(&g_pg->phase, 2);
  reap(opener, 0, 20);
  EXPECT_I64(6, value_of(s, "cl:x", NULL));
  EXPECT_OK(tally_store_drop(s, "cl:x", 4));
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  tally_grace_info gi;
  EXPECT_OK(tally_store_grace(s, &gi));
  EXPECT_I64(1, gi.behind);
  EXPECT_I64(holder, gi.oldest_pid);
  uint64_t reused0 = stats(s).reused_bytes;
  fill(s, "cy", 80, 1000); /* would take cl:x's space */
  EXPECT_I64(reused0, stats(s).reused_bytes);
  EXPECT_I64(TALLY_EDROPPED, holder_do(OP_INCR, 100));
  check_fill(s, "cy", 80, 1000);
  holder_do(OP_EXIT, 0);
  reap(holder, 0, 20);
  expect_check(s, "late opener");
  printf("  a late opener leaves another process's slot alone: ok if no failure above\n");
  untrack_close(s);
}

/* A forked child's copies of its parent's handles are held back from
 * reuse from the fork on, not from when the child first runs: here the
 * child's fork handler is paused (pause_forked_child, registered before
 * tally's) while the parent drops the counter, passes grace steps and
 * makes counters that would reuse its space. */
static volatile int g_pause_forks;

static void pause_forked_child(void) {
  if (!g_pause_forks) return;
  atomic_store(&g_pg->phase, 1);
  (void)wait_flag(&g_pg->phase, 2, 30);
}

/* The store's process table (grace.c). */
static struct tally__proc *proc_table(tally_store *s) {
  uint64_t off = 0;
  if (tally__unseal(s, TALLY__SEAL_PROCS, atomic_load(&s->hdr->procs), 0, &off) || !off)
    return NULL;
  return tally__at(s, off);
}

/* Fill every free slot of the table with owner and word w; how many. */
static int fill_table(tally_store *s, uint64_t owner, uint64_t w) {
  struct tally__proc *t = proc_table(s);
  int n = 0;
  for (uint32_t i = 0; t && i < TALLY__PROCS; i++) {
    uint64_t free_ = 0;
    if (atomic_compare_exchange_strong(&t[i].owner, &free_, owner)) {
      atomic_store(&t[i].seen, w);
      n++;
    }
  }
  return n;
}

/* Slots whose owner is `owner`. */
static int count_owner(tally_store *s, uint64_t owner) {
  struct tally__proc *t = proc_table(s);
  int n = 0;
  for (uint32_t i = 0; t && i < TALLY__PROCS; i++) n += atomic_load(&t[i].owner) == owner;
  return n;
}

/* An owner word of a process that is gone: a child, reaped. */
static uint64_t dead_owner(void) {
  pid_t pid = fork();
  if (pid == 0) _exit(0);
  waitpid(pid, NULL, 0);
  return (uint64_t)(uint32_t)pid << 32 | 1; /* start unknown: alive iff the pid is */
}

/* fill_with: an owner word to fill the process table's free slots with (idle)
 * just before the fork, or 0. */
static void fork_holds(tally_store *s, const char *label, uint64_t fill_with) {
  tally_counter *c = NULL;
  REQUIRE_OK(tu_counter(s, "fk:x", 4, -1, TALLY_COUNTER_CREATE, &c));
  EXPECT_OK(tally_counter_incr(c, 5));
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  if (fill_with) EXPECT(fill_table(s, fill_with, UINT64_C(1)) >= (int)TALLY__PROCS - 3);
  atomic_store(&g_pg->phase, 0);
  g_pause_forks = 1;
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  if (pid == 0) { /* its copy of c, before any grace step of its own */
    alarm(60);
    _exit(tally_counter_incr(c, 1000) == TALLY_EDROPPED ? 0 : 1);
  }
  g_pause_forks = 0;
  if (pid < 0 || wait_flag(&g_pg->phase, 1, 20) != 0) TU_FAIL("the child never paused");
  EXPECT_OK(tally_store_drop(s, "fk:x", 4));
  for (int k = 0; k < 3; k++) EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  tally_grace_info gi;
  EXPECT_OK(tally_store_grace(s, &gi));
  EXPECT_I64(1, gi.behind); /* the child's slot, at the parent's old epoch */
  uint64_t reused0 = stats(s).reused_bytes;
  fill(s, "fy", 80, 1000);
  EXPECT_I64(reused0, stats(s).reused_bytes);
  atomic_store(&g_pg->phase, 2);
  if (pid > 0) reap(pid, 0, 20); /* exit 1: its add was taken */
  check_fill(s, "fy", 80, 1000);
  EXPECT_I64(TALLY_EDROPPED, tally_counter_incr(c, 1));
  tally_counter_close(c);
  expect_check(s, label);
  printf("  %s: a forked child's handles hold reuse back from the fork on: ok if no "
         "failure above\n",
         label);
}

static void test_fork_holds(void) {
  tally_store *s = open_file("fork.tly", "0");
  fork_holds(s, "fork", 0);
  untrack_close(s);
}

/* Processes that exited without closing, idle (never behind, so no step
 * looked at them), fill the table: a fork still reserves its child's slot
 * (freeing a dead one), and upkeep frees them all, 16 a step. */
static void test_table_of_dead(void) {
  tally_store *s = open_file("dead.tly", "0");
  uint64_t dead = dead_owner();
  fork_holds(s, "a table full of dead processes", dead);
  int left = count_owner(s, dead);
  EXPECT(left > 0);
  for (uint32_t k = 0; k < TALLY__PROCS / 16 + 1; k++)
    EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  printf("  dead owners' slots: %d left after the fork; after upkeep: %d\n", left,
         count_owner(s, dead));
  EXPECT_I64(0, count_owner(s, dead));
  untrack_close(s);
}

/* Forks that fail (EAGAIN: a process limit) leave no reserved slot behind:
 * each held reuse back, and a slot of the table, for 10 s. As an
 * unprivileged user with RLIMIT_NPROC 1, in a child (77: this process
 * cannot take that user, and the test is skipped). */
static int failed_forks_main(void *spec) {
  tally_store *s;
  if (tally_store_open(spec, NULL, &s)) return 2;
  struct tally__proc *t = proc_table(s);
  struct rlimit one = {1, 1};
  if (setgid(65534) != 0 || setuid(65534) != 0) return 77;
  if (setrlimit(RLIMIT_NPROC, &one) != 0) return 3;
  int failed = 0, reserved = 0;
  for (int i = 0; i < 50; i++) {
    pid_t pid = fork();
    if (pid == 0) _exit(0);
    if (pid > 0) waitpid(pid, NULL, 0);
    failed += pid < 0;
  }
  for (uint32_t i = 0; t && i < TALLY__PROCS; i++) {
    uint64_t o = atomic_load(&t[i].owner);
    reserved += o && !(o & 1); /* a reservation's low word is even */
  }
  printf("  50 forks, %d failed: %d slots left reserved\n", failed, reserved);
  fflush(stdout);
  return failed == 50 && reserved == 0 ? 0 : 1;
}

static void test_failed_forks(void) {
  char spec[1200];
  tu_spec(spec, sizeof spec, NULL, 0, g_dir, "failfork.tly");
  tally_store *s = open_file("failfork.tly", "0");
  pid_t pid = spawn(failed_forks_main, spec);
  int st = 0;
  waitpid(pid, &st, 0);
  if (WIFEXITED(st) && WEXITSTATUS(st) == 77) {
    printf("  failed forks: skipped (cannot become an unprivileged user)\n");
  } else {
    atomic_fetch_add(&tu_checks, 1);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
      TU_FAIL("failed forks: the child ended with %d",
              WIFEXITED(st) ? WEXITSTATUS(st) : -1);
  }
  untrack_close(s);
}

/* A table full of live processes: a forked child gets no slot, and then
 * must not write its parent's (it did, making the parent look as if it had
 * passed epochs its handles never saw). */
static void test_table_full(void) {
  tally_store *s = open_file("full.tly", "0");
  tally_counter *c = NULL;
  REQUIRE_OK(tu_counter(s, "tf:x", 4, -1, TALLY_COUNTER_CREATE, &c));
  EXPECT_OK(tally_counter_incr(c, 1));
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  struct tally__proc *t = proc_table(s);
  uint64_t me = tally__owner_of(getpid(), NULL);
  int n = fill_table(s, me, UINT64_C(1)); /* alive, idle */
  EXPECT(n >= (int)TALLY__PROCS - 2);
  uint64_t mine = atomic_load(&t[s->proc].seen);
  EXPECT_I64(0, (int64_t)(mine & 1)); /* it holds a handle */
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) { /* no slot for it: its steps (a drop's, upkeep's) publish nothing */
    alarm(60);
    _exit(make(s, "tf:y", 4, 1) == 0 && tally_store_drop(s, "tf:y", 4) == 0 &&
                  tally_store_maintain(s, 0, 0, NULL) == 0
              ? 0
              : 1);
  }
  reap(pid, 0, 20);
  EXPECT_I64((int64_t)mine, (int64_t)atomic_load(&t[s->proc].seen));
  for (uint32_t i = 0; i < TALLY__PROCS; i++) /* give the slots back */
    if (i != s->proc && atomic_load(&t[i].owner) == me) atomic_store(&t[i].owner, 0);
  tally_counter_close(c);
  expect_check(s, "table full");
  untrack_close(s);
}

/* ---- 5: exact under churn: writers, expiry, drops, reshards, a kill -------- */

/* Every acknowledged increment of a name ends in one of its incarnations:
 * the live one, or one that expired at the value its last rollup recorded
 * (a counter a schedule covers expires only once a rollup has its final
 * value). The maintainer is the only process that ticks, so it sees every
 * rollup: a rollup with count 1 is an incarnation's first, which closes
 * the previous one at that one's last rolled value. */

#define CHURN_FILE "churn5.tly"
#define STEP_MS    250 /* the synthetic clock's step: the schedule's period */

static int name_index(const char *name, size_t len) {
  int w, k;
  char buf[64];
  if (len >= sizeof buf) return -1;
  memcpy(buf, name, len);
  buf[len] = 0;
  if (sscanf(buf, "ex:w%d:%d", &w, &k) != 2 || w < 0 || w >= NW || k < 0 || k >= NAMES)
    return -1;
  return w * NAMES + k;
}

static void on_rollup(void *ud, const char *name, size_t len, const tally_rollup *r) {
  (void)ud;
  int i = name_index(name, len);
  if (i < 0) {
    atomic_fetch_add(&g_pg->child_errors, 1);
    return;
  }
  if (r->count == 1 && atomic_load(&g_pg->rolled_have[i]))
    atomic_fetch_add(&g_pg->rolled_closed[i], atomic_load(&g_pg->rolled_last[i]));
  atomic_store(&g_pg->rolled_last[i], r->value);
  atomic_store(&g_pg->rolled_have[i], 1);
}

static tally_store *child_store(void) {
  char spec[1200];
  tally_store *s = NULL;
  tu_spec(spec, sizeof spec, NULL, 0, g_dir, CHURN_FILE);
  if (tally_store_open(spec, NULL, &s) != 0) {
    fprintf(stderr, "child: open: %s\n", tally_errmsg());
    return NULL;
  }
  return s;
}

static void child_error(const char *who, const char *what, int rc) {
  if (atomic_fetch_add(&g_pg->child_errors, 1) < 10)
    fprintf(stderr, "  %s: %s -> %s (%s)\n", who, what, tally_err_name(rc),
            tally_errmsg());
}

static int writer_main(void *p) {
  int w = (int)(intptr_t)p;
  tally_store *s = child_store();
  if (!s) return 1;
  tally_counter *c[NAMES] = {0}, *d[4] = {0};
  uint64_t rng = 12345 + (uint64_t)w * 777;
  double t0 = tu_now();
  char nm[64];
  for (int pass = 0; pass < 100000 && !atomic_load(&g_pg->stop) && tu_now() - t0 < 1.5;
       pass++) {
    int k = (int)(tu_rng(&rng) % NAMES), i = w * NAMES + k;
    if (!c[k]) {
      snprintf(nm, sizeof nm, "ex:w%d:%02d", w, k);
      int rc = tu_counter(s, nm, 0, -1, TALLY_COUNTER_CREATE, &c[k]);
      if (rc) {
        child_error("writer", "open", rc);
        c[k] = NULL;
        continue;
      }
    }
    /* an active window on this name; then it idles and may expire */
    int m = 20 + (int)(tu_rng(&rng) % 200);
    for (int j = 0; j < m; j++) {
      int64_t delta = 1 + (int64_t)(tu_rng(&rng) % 3);
      int rc = tally_counter_incr(c[k], delta);
      if (rc == 0)
        atomic_store(&g_pg->acked[i], atomic_load(&g_pg->acked[i]) + delta);
      else
        child_error("writer", "incr", rc);
    }
    /* a counter the dropper drops: its handle errs, and is opened again */
    int di = (int)(tu_rng(&rng) % 4);
    for (int tries = 0; tries < 2; tries++) {
      if (!d[di]) {
        snprintf(nm, sizeof nm, "dr:%d", di);
        if (tu_counter(s, nm, 2, TALLY_POLICY_RANDOM, TALLY_COUNTER_CREATE, &d[di])) {
          d[di] = NULL;
          break;
        }
      }
      int rc = tally_counter_incr(d[di], 1);
      if (rc == 0) break;
      if (rc != TALLY_EDROPPED) child_error("writer", "incr dr", rc);
      tally_counter_close(d[di]);
      d[di] = NULL;
    }
    int rc = tally_store_maintain(s, 0, 0, NULL); /* a grace step, no scan */
    if (rc) child_error("writer", "maintain", rc);
    usleep(300);
  }
  for (int k = 0; k < NAMES; k++) tally_counter_close(c[k]);
  for (int k = 0; k < 4; k++) tally_counter_close(d[k]);
  tally_store_close(s);
  return 0;
}

static int maintainer_main(void *p) {
  (void)p;
  tally_store *s = child_store();
  if (!s) return 1;
  tally_schedule *sch = NULL;
  int rc = tally_schedule_new(s, "ex:*", 4, STEP_MS, NULL, 0, &sch);
  if (rc) {
    child_error("maintainer", "schedule", rc);
    return 1;
  }
  int64_t now = 1000000;
  int after = 0;
  uint64_t rng = 99;
  double t0 = tu_now();
  for (long it = 0; it < 100000 && tu_now() - t0 < 20; it++) {
    now += STEP_MS;
    tally_tick_result tr;
    if ((rc = tally_schedule_tick(sch, now, on_rollup, NULL, &tr)))
      child_error("maintainer", "tick", rc);
    else if (tr.status != TALLY_TICK_RAN && tr.status != TALLY_TICK_NOT_DUE)
      child_error("maintainer", "tick status", tr.status);
    else if (tr.status == TALLY_TICK_RAN)
      atomic_fetch_add(&g_pg->ticks, 1);
    tally_maintain_result mr;
    if ((rc = tally_store_maintain(s, now, 4096, &mr)))
      child_error("maintainer", "maintain", rc);
    else {
      atomic_fetch_add(&g_pg->expired, (long long)mr.expired);
      atomic_fetch_add(&g_pg->held, (long long)mr.held);
    }
    if (it % 3 == 0) {
      char nm[16];
      snprintf(nm, sizeof nm, "dr:%d", (int)(tu_rng(&rng) % 4));
      rc = tally_store_drop(s, nm, strlen(nm));
      if (rc == 0)
        atomic_fetch_add(&g_pg->dropped, 1);
      else if (rc != TALLY_ENOENT)
        child_error("maintainer", "drop", rc);
    }
    if (atomic_load(&g_pg->writers_done)) {
      if (++after > 40) break; /* everything idle has expired by now */
    } else {
      usleep(1000);
    }
  }
  tally_schedule_free(sch);
  tally_store_close(s);
  return 0;
}

static int resharder_main(void *p) {
  (void)p;
  tally_store *s = child_store();
  if (!s) return 1;
  uint64_t rng = 4242;
  double t0 = tu_now();
  for (long it = 0; it < 100000 && !atomic_load(&g_pg->stop) && tu_now() - t0 < 20;
       it++) {
    char nm[64];
    int i = (int)(tu_rng(&rng) % NIDX);
    tally_counter *c = NULL;
    snprintf(nm, sizeof nm, "ex:w%d:%02d", i / NAMES, i % NAMES);
    int rc = tu_counter(s, nm, 0, -1, 0, &c);
    if (rc == 0) {
      rc = tally_counter_reshard(c, 1 + (uint32_t)(tu_rng(&rng) % 12));
      if (rc == 0) atomic_fetch_add(&g_pg->reshards, 1);
    }
    if (rc && rc != TALLY_ENOENT && rc != TALLY_EDROPPED)
      child_error("resharder", nm, rc);
    tally_counter_close(c);
    if (it % 8 == 7 && (rc = tally_store_maintain(s, 0, 0, NULL)))
      child_error("resharder", "maintain", rc);
    usleep(300);
  }
  tally_store_close(s);
  return 0;
}

static void test_exact_churn(void) {
  tally_store *s = open_file(CHURN_FILE, "0");
  tally_family_options fo = {4, TALLY_POLICY_RANDOM, 1, 0};
  EXPECT_OK(tally_family_define(s, "ex:*", 4, &fo));
  memset(g_pg, 0, sizeof *g_pg);
  pid_t wp[NW], mp, rp;
  uint64_t rng = 777;
  double t0 = tu_now();
  mp = spawn(maintainer_main, NULL);
  rp = spawn(resharder_main, NULL);
  for (int w = 0; w < NW; w++) wp[w] = spawn(writer_main, (void *)(intptr_t)w);
  sleep_ms(300 + (double)(tu_rng(&rng) % 400));
  kill(wp[NW - 1], SIGKILL); /* the last writer dies mid-run */
  for (int w = 0; w < NW; w++) reap(wp[w], w == NW - 1, 30);
  atomic_store(&g_pg->writers_done, 1);
  reap(mp, 0, 40);
  atomic_store(&g_pg->stop, 1);
  reap(rp, 0, 30);

  long long acked_all = 0, found_all = 0;
  long long killed_acked = 0, killed_found = 0;
  int live = 0;
  for (int i = 0; i < NIDX; i++) {
    char nm[64];
    int rc;
    snprintf(nm, sizeof nm, "ex:w%d:%02d", i / NAMES, i % NAMES);
    int64_t v = value_of(s, nm, &rc);
    long long acked = atomic_load(&g_pg->acked[i]);
    long long found = atomic_load(&g_pg->rolled_closed[i]);
    if (rc == 0) {
      found += v;
      live++;
    } else if (rc == TALLY_ENOENT) {
      found += atomic_load(&g_pg->rolled_last[i]); /* the last incarnation's end */
    } else {
      TU_FAIL("%s: %s", nm, tally_errmsg());
    }
    acked_all += acked;
    found_all += found;
    if (i / NAMES == NW - 1) {
      killed_acked += acked;
      killed_found += found;
    } else if (found != acked) {
      TU_FAIL("%s: %lld increments acknowledged, %lld in its incarnations", nm, acked,
              found);
    } else {
      atomic_fetch_add(&tu_checks, 1);
    }
  }
  atomic_fetch_add(&tu_checks, 1);
  if (killed_found < killed_acked || killed_found > killed_acked + 3)
    TU_FAIL(
        "killed writer: acknowledged %lld, found %lld (one increment in flight at most)",
        killed_acked, killed_found);
  EXPECT_I64(0, atomic_load(&g_pg->child_errors));
  EXPECT_I64(0, live); /* all idle at the end: all expired */
  tally_store_stats st = stats(s);
  EXPECT_I64(atomic_load(&g_pg->expired), st.expired);
  EXPECT(st.expired > (uint64_t)NIDX / 2);
  EXPECT(st.reused_bytes > 0);
  expect_check(s, "after churn with expiry");
  printf("  churn: %d writers (one killed), %lld acknowledged, %lld found; %lld expiries "
         "(%lld waits for a rollup), %lld drops, %lld reshards, %lld rollups, %llu bytes "
         "reused, %.2f s\n",
         NW, acked_all, found_all, (long long)atomic_load(&g_pg->expired),
         (long long)atomic_load(&g_pg->held), (long long)atomic_load(&g_pg->dropped),
         (long long)atomic_load(&g_pg->reshards), (long long)atomic_load(&g_pg->ticks),
         (unsigned long long)st.reused_bytes, tu_now() - t0);
  untrack_close(s);
}

/* A counter a schedule covers expires only once a rollup has its final
 * value: the rollup's consumers (flushers) never miss an increment. The
 * schedule here runs less often than idle_s, so expiry has to wait. */
static void test_hold(void) {
  tally_store *s = open_file("hold.tly", "0");
  tally_family_options fo = {2, -1, 1, 0};
  tally_schedule *sch = NULL;
  tally_tick_result tr;
  tally_maintain_result mr;
  EXPECT_OK(tally_family_define(s, "ho:*", 4, &fo));
  REQUIRE_OK(tally_schedule_new(s, "ho:*", 4, 10000, NULL, 0, &sch));
  EXPECT_OK(make(s, "ho:a", 0, 5));
  EXPECT_OK(tally_schedule_tick(sch, 100000, NULL, NULL, &tr));
  EXPECT_I64(TALLY_TICK_RAN, tr.status);
  EXPECT_I64(1, tr.counters);
  EXPECT_OK(make(s, "ho:a", 0, 2)); /* 7: not rolled up yet */
  EXPECT_OK(tally_store_maintain(s, 101000, 1000, &mr));
  EXPECT_OK(tally_store_maintain(s, 102500, 1000, &mr));
  EXPECT_I64(0, mr.expired);
  EXPECT_I64(1, mr.held);
  EXPECT_I64(7, value_of(s, "ho:a", NULL));
  EXPECT_OK(tally_schedule_tick(sch, 110000, NULL, NULL, &tr)); /* rolls 7 */
  EXPECT_OK(tally_store_maintain(s, 110000, 1000, &mr));
  EXPECT_I64(1, mr.expired);
  int rc;
  EXPECT_I64(INT64_MIN, value_of(s, "ho:a", &rc));
  EXPECT_I64(TALLY_ENOENT, rc);

  /* created after the schedule's last tick: covered all the same (the
   * pattern matches), so it must wait for the next tick too */
  EXPECT_OK(make(s, "ho:b", 0, 3));
  EXPECT_OK(tally_store_maintain(s, 111000, 1000, &mr));
  EXPECT_OK(tally_store_maintain(s, 112500, 1000, &mr));
  EXPECT_I64(0, mr.expired);
  EXPECT_I64(3, value_of(s, "ho:b", NULL));
  EXPECT_OK(tally_schedule_tick(sch, 120000, NULL, NULL, &tr));
  EXPECT_OK(tally_store_maintain(s, 120000, 1000, &mr));
  EXPECT_I64(INT64_MIN, value_of(s, "ho:b", NULL));
  tally_schedule_free(sch);
  expect_check(s, "after held expiries");
  untrack_close(s);
}

/* ---- 6: caps ---------------------------------------------------------------- */

static void test_caps(void) {
  tally_store *s = open_file("caps.tly", "0");
  tally_family_options fo = {2, -1, 0, 5};
  char buf[64];
  EXPECT_I64(13, tally_family_overflow("cap:*", 5, buf, sizeof buf));
  EXPECT_STR("cap:_overflow", buf);
  EXPECT_I64(12, tally_family_overflow("a?b*", 4, buf, sizeof buf));
  EXPECT_STR("a_b_overflow", buf);
  EXPECT_RC(TALLY_ENAME, tally_family_overflow("cap:*", 5, buf, 5));
  EXPECT_OK(tally_family_define(s, "cap:*", 5, &fo));
  static const char *names[] = {"cap:a", "cap:b", "cap:c", "cap:d",
                                "cap:e", "cap:f", "cap:g", "cap:h"};
  for (int i = 0; i < 8; i++) {
    tally_counter *c = NULL;
    tally_counter_info inf;
    EXPECT_OK(tu_counter(s, names[i], 0, -1, TALLY_COUNTER_CREATE, &c));
    if (!c) continue;
    EXPECT_OK(tally_counter_incr(c, i + 1));
    EXPECT_OK(tally_counter_info_get(c, &inf));
    EXPECT_STR(i < 5 ? names[i] : "cap:_overflow", inf.name);
    tally_counter_close(c);
  }
  tally_store_stats st = stats(s);
  EXPECT_I64(3, st.capped);
  EXPECT_I64(6, st.counters);
  int64_t sum;
  uint64_t count;
  EXPECT_OK(tally_store_sum(s, "cap:*", 5, &sum, &count));
  EXPECT_I64(36, sum);
  EXPECT_I64(6, count);
  EXPECT_I64(6 + 7 + 8, value_of(s, "cap:_overflow", NULL));
  int rc;
  EXPECT_I64(INT64_MIN, value_of(s, "cap:f", &rc)); /* no counter of its own */
  EXPECT_I64(TALLY_ENOENT, rc);
  EXPECT_I64(1, value_of(s, "cap:a", NULL));

  /* room again after a drop */
  EXPECT_OK(tally_store_drop(s, "cap:a", 5));
  tally_counter *c = NULL;
  tally_counter_info inf;
  EXPECT_OK(tu_counter(s, "cap:i", 0, -1, TALLY_COUNTER_CREATE, &c));
  EXPECT_OK(tally_counter_incr(c, 100));
  EXPECT_OK(tally_counter_info_get(c, &inf));
  EXPECT_STR("cap:i", inf.name);
  tally_counter_close(c);
  EXPECT_I64(100, value_of(s, "cap:i", NULL));
  EXPECT_I64(3, stats(s).capped);
  EXPECT_OK(make(s, "cap:j", 0, 1000)); /* full again */
  EXPECT_I64(4, stats(s).capped);
  EXPECT_I64(1021, value_of(s, "cap:_overflow", NULL));
  EXPECT_OK(tally_store_sum(s, "cap:*", 5, &sum, &count));
  EXPECT_I64(36 - 1 + 100 + 1000, sum);
  EXPECT_I64(6, count);

  /* room again after an expiry */
  tally_family_options fe = {1, -1, 1, 3};
  EXPECT_OK(tally_family_define(s, "ce:*", 4, &fe));
  EXPECT_OK(make(s, "ce:1", 0, 1));
  EXPECT_OK(make(s, "ce:2", 0, 1));
  EXPECT_OK(make(s, "ce:3", 0, 1));
  EXPECT_OK(make(s, "ce:4", 0, 1));
  EXPECT_I64(1, value_of(s, "ce:_overflow", NULL));
  EXPECT_I64(5, stats(s).capped);
  tally_maintain_result mr;
  EXPECT_OK(tally_store_maintain(s, 50000, 100000, &mr));
  EXPECT_OK(tally_store_maintain(s, 52000, 100000, &mr));
  EXPECT_I64(4, mr.expired); /* the overflow counter too: it idles */
  EXPECT_OK(make(s, "ce:5", 0, 1));
  EXPECT_OK(make(s, "ce:6", 0, 1));
  EXPECT_OK(make(s, "ce:7", 0, 1));
  EXPECT_I64(5, stats(s).capped);
  EXPECT_I64(1, value_of(s, "ce:7", NULL));
  expect_check(s, "after caps");
  untrack_close(s);
}

/* ---- 7: check() finds damaged free lists ------------------------------------ */

static long find_bytes(const char *path, const char *needle) {
  FILE *f = fopen(path, "rb");
  if (!f) return -1;
  size_t nl = strlen(needle), cap = 1 << 20, have = 0;
  long base = 0, found = -1;
  char *buf = malloc(cap + nl);
  for (;;) {
    size_t n = fread(buf + have, 1, cap, f);
    if (n == 0) break;
    have += n;
    char *p = memmem(buf, have, needle, nl);
    if (p) {
      found = base + (p - buf);
      break;
    }
    size_t keep = have < nl ? have : nl - 1;
    memmove(buf, buf + have - keep, keep);
    base += (long)(have - keep);
    have = keep;
  }
  free(buf);
  fclose(f);
  return found;
}

static void flip_byte(const char *path, long off) {
  int fd = open(path, O_RDWR);
  unsigned char b;
  if (fd < 0 || pread(fd, &b, 1, off) != 1) {
    TU_FAIL("cannot read %s at %ld", path, off);
    if (fd >= 0) close(fd);
    return;
  }
  b ^= 0x5a;
  if (pwrite(fd, &b, 1, off) != 1) TU_FAIL("cannot write %s", path);
  close(fd);
}

/* The free piece a freed record's name at `at` lies in: 16-aligned, a
 * little before the name, its second word its size in bytes (the record's
 * fixed fields, the name and a NUL, rounded up to 16). -1 if none. */
static long freed_piece(const char *path, long at, size_t len) {
  int fd = open(path, O_RDONLY);
  long found = -1;
  if (fd < 0) return -1;
  for (long off = (at - 16) & ~15L; off >= at - 256 && found < 0; off -= 16) {
    uint64_t size;
    if (pread(fd, &size, 8, off + 8) != 8) break;
    if (size == (((uint64_t)(at - off) + len + 1 + 15) & ~(uint64_t)15)) found = off;
  }
  close(fd);
  return found;
}

static void test_check_damage(void) {
  /* a record's name follows its fixed fields; a freed record keeps its
   * name, and its first two words become the free list's link and size */
  static const char *pad = "0123456789abcdefghijklmnopqrstuvwxyz0123";
  for (int word = 0; word < 2; word++) {
    char file[64], path[1200], spec[1200], first[96], second[96];
    snprintf(file, sizeof file, "damage-%d.tly", word);
    tu_spec(spec, sizeof spec, path, sizeof path, g_dir, file);
    tally_store *s = open_file(file, "0");
    snprintf(first, sizeof first, "FREE-A-%s", pad);
    snprintf(second, sizeof second, "FREE-B-%s", pad);
    EXPECT_OK(make(s, first, 2, 1));
    EXPECT_OK(make(s, second, 2, 1));
    fill(s, "d", 50, 1);
    EXPECT_OK(tally_store_drop(s, first, strlen(first)));
    EXPECT_OK(tally_store_drop(s, second, strlen(second)));
    EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
    EXPECT(stats(s).reusable_bytes > 0);
    expect_check(s, "before the damage");
    untrack_close(s);
    /* the first freed record lies under the second on its list: only a
     * full check walks to it */
    long at = find_bytes(path, first);
    if (at < 0) {
      TU_FAIL("cannot find the freed record %s in %s", first, path);
      continue;
    }
    long rec = freed_piece(path, at, strlen(first));
    if (rec < 0) {
      TU_FAIL("cannot find the free piece holding %s in %s", first, path);
      continue;
    }
    flip_byte(path, rec + word * 8 + (word ? 1 : 4));
    setenv("TALLY_GRACE_MS", "0", 1);
    s = NULL;
    int rc = tally_store_open(spec, NULL, &s);
    if (rc == 0) {
      rc = tally_store_check(s);
      EXPECT_I64(TALLY_ECORRUPT, rc);
      printf("  damaged free %s: check -> %s (%s)\n", word ? "size" : "link",
             tally_err_name(rc), tally_errmsg());
      tally_store_close(s);
    } else {
      EXPECT_I64(TALLY_ECORRUPT, rc);
      printf("  damaged free %s: open -> %s (%s)\n", word ? "size" : "link",
             tally_err_name(rc), tally_errmsg());
    }
  }
}

/* A handle closed after its store (a garbage collector's order): closing
 * it must not touch the freed store (ASan sees it if it does). */
static void test_close_order(void) {
  tally_store *s = NULL;
  tally_counter *a = NULL, *b = NULL;
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  REQUIRE_OK(tally_counter_open(s, "a", 1, NULL, TALLY_COUNTER_CREATE, &a));
  REQUIRE_OK(tally_counter_open(s, "a", 1, NULL, 0, &b));
  tally_store_close(s);
  tally_counter_close(b);
  tally_counter_close(a);
}

/* Counters a flusher ships (tally_store_ship) expire only once their
 * value is marked shipped for their incarnation; others are not held. */
static void test_shipped(void) {
  tally_store *s = NULL;
  tally_counter *a = NULL, *b = NULL, *o = NULL, *z = NULL;
  tally_maintain_result mr;
  tally_family_options fo = {0, -1, 1, 0};
  uint64_t inc = 0;
  int64_t v = -1;
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  REQUIRE_OK(tally_family_define(s, "p:*", 3, &fo));
  REQUIRE_OK(tally_store_ship(s, "w1", 2, "p:a*", 4));
  REQUIRE_OK(tally_store_ship(s, "w1", 2, "p:a*", 4)); /* once is enough */
  REQUIRE_OK(tally_counter_open(s, "p:a", 3, NULL, TALLY_COUNTER_CREATE, &a));
  REQUIRE_OK(tally_counter_open(s, "p:b", 3, NULL, TALLY_COUNTER_CREATE, &b));
  REQUIRE_OK(tally_counter_open(s, "p:ab", 4, NULL, TALLY_COUNTER_CREATE, &o));
  REQUIRE_OK(tally_counter_open(s, "p:az", 4, NULL, TALLY_COUNTER_CREATE, &z));
  EXPECT_OK(tally_counter_incr(a, 7));
  EXPECT_OK(tally_counter_incr(b, 7));
  EXPECT_OK(tally_counter_incr(o, 7));
  EXPECT_OK(tally_counter_read(a, &v, &inc));
  EXPECT_I64(7, v);
  EXPECT(inc != 0);
  EXPECT_OK(tally_counter_ship(a, inc ^ 1, 7)); /* another incarnation's: ignored */
  EXPECT_OK(tally_counter_ship(o, 0, 7));
  EXPECT_OK(tally_store_maintain(s, 10000, 1000, &mr));
  EXPECT_OK(tally_store_maintain(s, 12000, 1000, &mr));
  EXPECT_I64(2, (int64_t)mr.expired); /* p:b (not covered), p:az (never moved) */
  EXPECT_I64(2, (int64_t)mr.held);    /* p:a, p:ab: 7 not shipped */
  EXPECT_I64(7, tu_value(a));
  EXPECT_OK(tally_counter_ship(a, inc, 6)); /* not its final value */
  EXPECT_OK(tally_store_maintain(s, 14000, 1000, &mr));
  EXPECT_I64(0, (int64_t)mr.expired);
  EXPECT_OK(tally_counter_ship(a, inc, 7));
  /* a second writer covering p:ab keeps it for good */
  REQUIRE_OK(tally_store_ship(s, "w2", 2, "p:ab", 4));
  EXPECT_OK(tally_counter_read(o, &v, &inc));
  EXPECT_OK(tally_counter_ship(o, inc, 7));
  EXPECT_OK(tally_store_maintain(s, 16000, 1000, &mr));
  EXPECT_I64(1, (int64_t)mr.expired); /* p:a */
  EXPECT_I64(1, (int64_t)mr.held);    /* p:ab */
  /* an expired counter reads 0, incarnation 0, until created again */
  EXPECT_OK(tally_counter_read(a, &v, &inc));
  EXPECT_I64(0, v);
  EXPECT_I64(0, (int64_t)inc);
  EXPECT_OK(tally_counter_incr(a, 2)); /* a late increment: a new incarnation */
  uint64_t inc2 = 0;
  EXPECT_OK(tally_counter_read(a, &v, &inc2));
  EXPECT_I64(2, v);
  EXPECT(inc2 != 0);
  /* the writers forgotten: nothing is held */
  EXPECT_OK(tally_store_unship(s, "w1", 2));
  EXPECT_OK(tally_store_unship(s, "w2", 2));
  EXPECT_OK(tally_store_maintain(s, 18000, 1000, &mr));
  EXPECT_I64(1, (int64_t)mr.expired); /* p:ab */
  EXPECT_OK(tally_store_maintain(s, 20000, 1000, &mr));
  EXPECT_I64(1, (int64_t)mr.expired); /* p:a again */
  EXPECT_I64(0, (int64_t)mr.held);
  /* a full table covers every name */
  char w[8];
  for (int i = 0; i < 9; i++) {
    snprintf(w, sizeof w, "x%d", i);
    REQUIRE_OK(tally_store_ship(s, w, strlen(w), "q:*", 3));
  }
  EXPECT_OK(tally_counter_incr(b, 1)); /* p:b again, no writer's pattern */
  EXPECT_OK(tally_store_maintain(s, 22000, 1000, &mr));
  EXPECT_OK(tally_store_maintain(s, 24000, 1000, &mr));
  EXPECT_I64(0, (int64_t)mr.expired);
  EXPECT_I64(1, (int64_t)mr.held);
  EXPECT_I64(1, tu_value(b));
  tally_counter_close(a);
  tally_counter_close(b);
  tally_counter_close(o);
  tally_counter_close(z);
  tally_store_close(s);
}

/* tally_counter_send_begin, the step before a value goes out: it marks
 * the value unknown (held whatever it is), sends what was read after the
 * mark, and takes the delta over the remote's marker by its incarnation. */
static tally_counter *g_send_moves;
static int64_t g_send_by;
static void move_at_send(const char *where, const char *name, size_t len) {
  (void)name, (void)len;
  if (strcmp(where, "send") == 0) EXPECT_OK(tally_counter_incr(g_send_moves, g_send_by));
}

static void test_send_begin(void) {
  tally_store *s = NULL;
  tally_counter *a = NULL;
  tally_maintain_result mr;
  tally_family_options fo = {0, -1, 1, 0};
  tally_send out;
  int64_t v, d;
  uint64_t inc;
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  REQUIRE_OK(tally_family_define(s, "p:*", 3, &fo));
  REQUIRE_OK(tally_store_ship(s, "w1", 2, "p:*", 3));
  REQUIRE_OK(tally_counter_open(s, "p:a", 3, NULL, TALLY_COUNTER_CREATE, &a));
  EXPECT_OK(tally_counter_incr(a, 7));
  EXPECT_OK(tally_counter_read(a, &v, &inc));
  EXPECT_OK(tally_counter_ship(a, inc, 7)); /* the remote holds 7 */
  /* the marker's rule: this incarnation's, another's, one written before
   * incarnations, and a delta beyond int64 */
  EXPECT_OK(tally_send_delta(9, inc, 7, inc, &d));
  EXPECT_I64(2, d);
  EXPECT_OK(tally_send_delta(9, inc, 7, inc ^ 1, &d));
  EXPECT_I64(9, d);
  EXPECT_OK(tally_send_delta(9, inc, 7, 0, &d));
  EXPECT_I64(2, d);
  EXPECT_RC(TALLY_ERANGE, tally_send_delta(INT64_MAX, inc, -1, inc, &d));
  /* 5 more arrive between the mark and the read: the value after is sent */
  g_send_moves = a;
  g_send_by = 5;
  tally__test_hook = move_at_send;
  EXPECT_OK(tally_counter_send_begin(a, 7, inc, &out));
  tally__test_hook = NULL;
  EXPECT_I64(12, out.value);
  EXPECT_I64(5, out.delta);
  EXPECT(out.incarnation == inc);
  /* marked unknown: held although its value is what was last marked
   * shipped before (7 + 5 - 5) */
  EXPECT_OK(tally_counter_incr(a, -5));
  EXPECT_OK(tally_store_maintain(s, 10000, 1000, &mr));
  EXPECT_OK(tally_store_maintain(s, 12000, 1000, &mr));
  EXPECT_I64(0, (int64_t)mr.expired);
  EXPECT_I64(1, (int64_t)mr.held);
  /* back at the marker: delta 0, nothing to send */
  EXPECT_OK(tally_counter_send_begin(a, 7, inc, &out));
  EXPECT_I64(0, out.delta);
  EXPECT_OK(tally_counter_ship(a, inc, 7)); /* read back: it may go */
  EXPECT_OK(tally_store_maintain(s, 14000, 1000, &mr));
  EXPECT_I64(1, (int64_t)mr.expired);
  /* expired, not made again: nothing to send */
  EXPECT_RC(TALLY_ENOENT, tally_counter_send_begin(a, 7, inc, &out));
  EXPECT_OK(tally_counter_incr(a, 3)); /* made again: counted from 0 */
  EXPECT_OK(tally_counter_send_begin(a, 7, inc, &out));
  EXPECT(out.incarnation != inc && out.incarnation != 0);
  EXPECT_I64(3, out.delta);
  EXPECT_OK(tally_store_drop(s, "p:a", 3));
  EXPECT_RC(TALLY_EDROPPED, tally_counter_send_begin(a, 3, out.incarnation, &out));
  tally_counter_close(a);
  tally_store_close(s);
}

/* The index tables a growing store outgrows are large pieces nothing asks
 * for again: once reusable, allocations of other sizes are carved from
 * them before the arena grows. */
static void test_carve(void) {
  tally_store *s = open_file("carve.tly", "0");
  char name[32];
  for (int i = 0; i < 9000; i++) { /* the index grows past 64 KiB tables */
    snprintf(name, sizeof name, "cv:%d", i);
    EXPECT_OK(make(s, name, 0, i));
  }
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL)); /* grace step: reusable */
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  tally_store_stats a = stats(s);
  EXPECT(a.reusable_bytes >= 48 * 1024); /* more than the next 500 take */
  for (int i = 9000; i < 9500; i++) {    /* about 45 KiB of records and cells */
    snprintf(name, sizeof name, "cv:%d", i);
    EXPECT_OK(make(s, name, 0, i));
  }
  tally_store_stats b = stats(s);
  EXPECT_I64((int64_t)a.used_bytes, (int64_t)b.used_bytes); /* the arena did not grow */
  EXPECT(b.reused_bytes >= a.reused_bytes + 500 * 80);
  EXPECT(b.reusable_bytes < a.reusable_bytes);
  expect_check(s, "after carving");
  int bad = 0;
  for (int i = 0; i < 9500; i += 7) {
    snprintf(name, sizeof name, "cv:%d", i);
    bad += value_of(s, name, NULL) != i;
  }
  EXPECT_I64(0, bad);
  printf("  carve: %llu bytes reusable after the index grew; 500 counters made "
         "without growing the arena (%llu bytes handed out again)\n",
         (unsigned long long)a.reusable_bytes,
         (unsigned long long)(b.reused_bytes - a.reused_bytes));
  untrack_close(s);
}

/* ---- a walk longer than grace_ms ------------------------------------------ */

enum { WALK_NAMES = 1000, WALK_CHURN = 40000 };

struct walker {
  tally_store *s;
  atomic_int stage; /* 1: the walk is paused on its first name; 2: go on */
  int rc;
  long other;           /* names that are none of w:, x:, y: */
  int seen[WALK_NAMES]; /* times each w:I was handed out */
};

static int walk_one(void *ud, const char *name, size_t len) {
  struct walker *w = ud;
  if (atomic_load(&w->stage) == 0) {
    atomic_store(&w->stage, 1);
    double end = tu_now() + 60;
    while (atomic_load(&w->stage) != 2 && tu_now() < end) usleep(1000);
  }
  char buf[64];
  if (len >= sizeof buf) len = sizeof buf - 1;
  memcpy(buf, name, len);
  buf[len] = 0;
  int i;
  if (sscanf(buf, "w:%d", &i) == 1 && i >= 0 && i < WALK_NAMES)
    w->seen[i]++;
  else if (strncmp(buf, "x:", 2) != 0 && strncmp(buf, "y:", 2) != 0)
    w->other++;
  return 0;
}

static void *walker_main(void *ud) {
  struct walker *w = ud;
  w->rc = tally_store_each(w->s, "*", 1, walk_one, w);
  return NULL;
}

/* One thread walks the index and stops on its first name; meanwhile
 * another grows the index well past the table the walk holds (it is
 * retired), runs grace steps with grace_ms 0 and allocates again, which
 * would hand that table's space out while the walk still reads it. The
 * walk must go on through its own table: every name it began with once,
 * no stranger, no ECORRUPT. Afterwards the held space is reused. */
static void test_walk_holds(void) {
  tally_store *s = open_file("walk.tly", "0");
  struct walker *w = calloc(1, sizeof *w);
  if (!w) return;
  w->s = s;
  fill(s, "w", WALK_NAMES, 0);
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  pthread_t th;
  pthread_create(&th, NULL, walker_main, w);
  double end = tu_now() + 30;
  while (atomic_load(&w->stage) != 1 && tu_now() < end) usleep(1000);
  EXPECT_I64(1, atomic_load(&w->stage));
  uint64_t r0 = stats(s).reused_bytes;
  fill(s, "x", WALK_CHURN, 0); /* the index is rebuilt, several times */
  for (int k = 0; k < 3; k++) EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  fill(s, "y", WALK_CHURN, 0);
  uint64_t r1 = stats(s).reused_bytes;
  atomic_store(&w->stage, 2);
  pthread_join(th, NULL);
  EXPECT_OK(w->rc);
  EXPECT_I64(0, w->other);
  int once = 0;
  for (int i = 0; i < WALK_NAMES; i++) once += w->seen[i] == 1;
  EXPECT_I64(WALK_NAMES, once);
  /* what the walk held back is reused once it ended */
  for (int k = 0; k < 3; k++) EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  fill(s, "z", WALK_CHURN, 0);
  uint64_t r2 = stats(s).reused_bytes;
  EXPECT(r2 > r1);
  printf("walk: reused %llu bytes while it ran, %llu after\n",
         (unsigned long long)(r1 - r0), (unsigned long long)(r2 - r1));
  EXPECT_I64(0, tally_store_check(s));
  free(w);
  untrack_close(s);
}

/* ---- an open paused between its lookup and its handle ------------------- */

static atomic_int g_open_stage; /* 1: the thread is paused; 2: go on */
static const char *g_pause_where, *g_pause_name;

static void open_pause(const char *where, const char *name, size_t len) {
  if (strcmp(where, g_pause_where) != 0 || len != strlen(g_pause_name) ||
      memcmp(name, g_pause_name, len) != 0 || atomic_load(&g_open_stage) != 0)
    return;
  atomic_store(&g_open_stage, 1);
  double end = tu_now() + 60;
  while (atomic_load(&g_open_stage) != 2 && tu_now() < end) usleep(1000);
}

/* Run fn(ud) in a thread that tally__test_hook pauses at `where` on name.
 * Meanwhile drop name, run grace steps (grace_ms 0) and create the 2,000
 * counters p:*, which would reuse its record and cells; then let the
 * thread go on, and create 2,000 more, q:* (check_reuse checks both). */
static void paused_drop(tally_store *s, const char *where, const char *name,
                        void *(*fn)(void *), void *ud) {
  atomic_store(&g_open_stage, 0);
  g_pause_where = where;
  g_pause_name = name;
  tally__test_hook = open_pause;
  pthread_t th;
  pthread_create(&th, NULL, fn, ud);
  double end = tu_now() + 30;
  while (atomic_load(&g_open_stage) != 1 && tu_now() < end) usleep(1000);
  EXPECT_I64(1, atomic_load(&g_open_stage));
  EXPECT_OK(tally_store_drop(s, name, strlen(name)));
  for (int k = 0; k < 3; k++) EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  fill(s, "p", 2000, 1000);
  atomic_store(&g_open_stage, 2);
  pthread_join(th, NULL);
  tally__test_hook = NULL;
  for (int k = 0; k < 3; k++) EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  fill(s, "q", 2000, 5000);
}

/* No counter made by paused_drop took the paused thread's increment. */
static void check_reuse(tally_store *s) {
  check_fill(s, "p", 2000, 1000);
  check_fill(s, "q", 2000, 5000);
}

struct opener {
  tally_store *s;
  tally_counter *c;
  int rc;
};

static void *opener_main(void *ud) {
  struct opener *o = ud;
  o->rc = tally_counter_open(o->s, "o:gone", 6, NULL, 0, &o->c);
  return NULL;
}

/* One thread opens o:gone and stops after finding its record, before its
 * handle exists. Meanwhile another drops the counter, runs grace steps
 * (grace_ms 0) and creates counters that would reuse its record and cells.
 * No grace step may pass the epoch of the drop while the open is under
 * way: its handle is not there yet to be refreshed, and would keep the
 * old location for good. So the open's handle gets EDROPPED, and no other
 * counter takes its increment. */
static void test_open_holds(void) {
  tally_store *s = open_file("open.tly", "0");
  EXPECT_OK(make(s, "o:gone", 4, 7));
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  struct opener o = {.s = s};
  paused_drop(s, "open", "o:gone", opener_main, &o);
  EXPECT_OK(o.rc);
  if (o.c) EXPECT_I64(TALLY_EDROPPED, tally_counter_incr(o.c, 1000000));
  check_reuse(s);
  int rc = 0;
  EXPECT_I64(INT64_MIN, value_of(s, "o:gone", &rc));
  EXPECT_I64(TALLY_ENOENT, rc);
  EXPECT_I64(0, tally_store_check(s));
  tally_counter_close(o.c);
  untrack_close(s);
}

struct reviver {
  tally_counter *c;
  int rc;
};

static void *reviver_main(void *ud) {
  struct reviver *r = ud;
  r->rc = tally_counter_incr(r->c, 1000000);
  return NULL;
}

/* The same for a handle of an expired counter: its next increment opens
 * the counter anew and points the handle at it. Stopped after that open,
 * before the handle is back among this process's handles, while another
 * thread drops the new counter and reuses its space: the increment must
 * not land in another counter. */
static void test_revive_holds(void) {
  tally_store *s = open_file("revive.tly", "0");
  tally_family_options fo = {4, -1, 1, 0}; /* idle 1 s */
  EXPECT_OK(tally_family_define(s, "r:*", 3, &fo));
  struct reviver r = {NULL, 0};
  REQUIRE_OK(tu_counter(s, "r:gone", 4, TALLY_POLICY_RANDOM, TALLY_COUNTER_CREATE, &r.c));
  EXPECT_OK(tally_counter_incr(r.c, 5));
  tally_maintain_result mr;
  uint64_t expired = 0;
  for (int64_t now = 10000; now <= 20000 && !expired; now += 500) {
    EXPECT_OK(tally_store_maintain(s, now, 1000, &mr));
    expired += mr.expired;
  }
  EXPECT_I64(1, (int64_t)expired);
  paused_drop(s, "revive", "r:gone", reviver_main, &r);
  /* counted in a new r:gone, or refused: never in a p: or q: counter */
  int rc = 0;
  int64_t v = value_of(s, "r:gone", &rc);
  if (r.rc == 0)
    EXPECT_I64(1000000, v);
  else
    EXPECT_I64(TALLY_EDROPPED, r.rc);
  check_reuse(s);
  printf("revive: the paused increment gave %d, r:gone reads %lld (%d)\n", r.rc,
         (long long)v, rc);
  EXPECT_I64(0, tally_store_check(s));
  tally_counter_close(r.c);
  untrack_close(s);
}

/* Two threads add through one handle of an expired counter that this
 * process's grace step has not marked yet: both find its cells retired and
 * its record dropped. The second revives the handle (a new counter of the
 * name) while the first is paused between that lookup and its check that
 * the drop was an expiry. The first must add to the new counter, not see
 * the new record (not expired) and call its counter dropped. */
static void test_revive_race(void) {
  tally_store *s = open_file("race.tly", "0");
  tally_family_options fo = {1, TALLY_POLICY_THREAD, 1, 0}; /* idle 1 s */
  EXPECT_OK(tally_family_define(s, "rr:*", 4, &fo));
  struct reviver r = {NULL, 0};
  REQUIRE_OK(tu_counter(s, "rr:x", 1, TALLY_POLICY_THREAD, TALLY_COUNTER_CREATE, &r.c));
  EXPECT_OK(tally_counter_incr(r.c, 5));
  /* expired through another handle of the store: this one's grace step,
   * which would mark the handle, does not run */
  tally_store *other = open_file("race.tly", "0");
  tally_maintain_result mr;
  uint64_t expired = 0;
  for (int64_t now = 10000; now <= 20000 && !expired; now += 500) {
    EXPECT_OK(tally_store_maintain(other, now, 1000, &mr));
    expired += mr.expired;
  }
  EXPECT_I64(1, (int64_t)expired);
  EXPECT_I64(0, atomic_load(&r.c->gone)); /* not marked: the window */
  atomic_store(&g_open_stage, 0);
  g_pause_where = "refresh";
  g_pause_name = "rr:x";
  tally__test_hook = open_pause;
  pthread_t th;
  pthread_create(&th, NULL, reviver_main, &r); /* adds 1000000, paused */
  double end = tu_now() + 30;
  while (atomic_load(&g_open_stage) != 1 && tu_now() < end) usleep(1000);
  EXPECT_I64(1, atomic_load(&g_open_stage));
  EXPECT_OK(tally_counter_incr(r.c, 10)); /* revives the handle */
  atomic_store(&g_open_stage, 2);
  pthread_join(th, NULL);
  tally__test_hook = NULL;
  EXPECT_OK(r.rc);
  int rc = 0;
  EXPECT_I64(1000010, value_of(s, "rr:x", &rc));
  EXPECT_I64(0, tally_store_check(s));
  tally_counter_close(r.c);
  untrack_close(other);
  untrack_close(s);
}

/* ---- a full disk in the middle of a move ----------------------------------- */

/* Create counters whose records fill the file to its end (their name
 * lengths chosen for it), so that the next piece of fresh space, such as a
 * limbo node for what a move retires, needs the file to grow. */
static void fill_to_end(tally_store *s) {
  char name[TALLY_NAME_MAX + 1];
  for (int k = 0;; k++) {
    uint64_t gap = atomic_load(&s->hdr->size) - atomic_load(&s->hdr->used);
    if (gap < sizeof(struct tally__limbo)) return;
    uint64_t r = gap <= 320 ? gap : gap - 320 >= 72 ? 320 : gap - 72; /* record bytes */
    size_t len = (size_t)(r - 65); /* 64 + len + NUL, a multiple of 8: r */
    memset(name, 'x', len);
    name[snprintf(name, len, "fill:%d", k)] = 'x';
    tally_counter *c;
    tally_counter_options o = {1, -1};
    REQUIRE_OK(tally_counter_open(s, name, len, &o, TALLY_COUNTER_CREATE, &c));
    tally_counter_close(c);
  }
}

/* Columns class n has handed out of the chunk it fills (internal.h:
 * struct tally__class): a column taken and never given back stays counted
 * here for good. */
static uint32_t class_cols(tally_store *s, uint32_t n) {
  return (uint32_t)(atomic_load(&s->classes[n - 1].word) >> 25) & 0x3ff;
}

/* The file may not grow (RLIMIT_FSIZE, as a full disk) when a reshard
 * has retired the old cells into the journal and needs a limbo node for
 * them: the move stays pending. A drop of another counter then recorded
 * its own move over it, and the first counter's value, kept only in the
 * journal, was gone (its cells retired: ECORRUPT), and once the disk had
 * room a reshard gave it the dropped counter's value instead. A refused
 * reshard or create also kept the cells it had taken, for good. In a
 * child: the limit is the process's. */
static int full_main(void) {
  int failed = atomic_load(&tu_failures); /* the parent's, before the fork */
  alarm(60);
  signal(SIGXFSZ, SIG_IGN); /* EFBIG from the growth instead */
  char path[1200];
  snprintf(path, sizeof path, "%s/full.tly", g_dir);
  unlink(path);
  tally_store *s = open_file("full.tly", "3600000"); /* nothing reclaimed */
  tally_counter *a;
  REQUIRE_OK(make(s, "full:a", 1, 5));
  REQUIRE_OK(make(s, "full:two", 2, 0)); /* 2-shard columns: the reshard's new cells */
  REQUIRE_OK(make(s, "full:c", 1, 7));
  REQUIRE_OK(tu_counter(s, "full:a", 0, -1, 0, &a));
  fill_to_end(s);
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL)); /* a new epoch: a new limbo node */
  struct stat st;
  REQUIRE_OK(stat(path, &st) ? TALLY_ESYS : 0);
  struct rlimit off, rl; /* the soft limit only: it is lifted again */
  REQUIRE_OK(getrlimit(RLIMIT_FSIZE, &off) ? TALLY_ESYS : 0);
  rl = (struct rlimit){(rlim_t)st.st_size, off.rlim_max};
  REQUIRE_OK(setrlimit(RLIMIT_FSIZE, &rl) ? TALLY_ESYS : 0);
  uint32_t cols = class_cols(s, 2);
  int rc = tally_counter_reshard(a, 2);
  printf("  full: reshard %s (%s)\n", tally_err_name(rc), tally_errmsg());
  EXPECT_I64(TALLY_ESYS, rc); /* the file could not grow: nothing moved */
  for (int i = 0; i < 3; i++) EXPECT_RC(TALLY_ESYS, tally_counter_reshard(a, 2));
  EXPECT_I64(cols, class_cols(s, 2)); /* no new cells taken (they were, for good) */
  EXPECT_I64(5, tu_value(a));         /* and the counter is still there to use */
  EXPECT_OK(tally_counter_incr(a, 1));
  EXPECT_I64(6, tu_value(a));
  rc = tally_store_drop(s, "full:c", 6); /* another move meanwhile */
  printf("  full: drop %s (%s)\n", tally_err_name(rc), tally_errmsg());
  EXPECT_I64(TALLY_ESYS, rc); /* refused, not done half */
  EXPECT_I64(7, value_of(s, "full:c", NULL));
  uint32_t cols1 = class_cols(s, 1); /* and creates: cells taken, no record */
  for (int i = 0; i < 3; i++) EXPECT_RC(TALLY_ESYS, make(s, "full:new", 1, 0));
  REQUIRE_OK(setrlimit(RLIMIT_FSIZE, &off) ? TALLY_ESYS : 0); /* space again */
  EXPECT_OK(make(s, "full:new", 1, 1));
  EXPECT_I64(cols1 + 1, class_cols(s, 1)); /* the refused creates' column again */
  EXPECT_I64(1, value_of(s, "full:new", NULL));
  EXPECT_I64(6, tu_value(a));
  EXPECT_OK(tally_counter_reshard(a, 2));
  EXPECT_I64(cols + 1, class_cols(s, 2)); /* the next column, not one past the refused */
  EXPECT_I64(6, tu_value(a));
  tally_counter_info in;
  EXPECT_OK(tally_counter_info_get(a, &in));
  EXPECT_I64(2, in.shards);
  EXPECT_OK(tally_store_drop(s, "full:c", 6));
  expect_check(s, "after the disk filled");
  tally_counter_close(a);
  untrack_close(s);
  fflush(stdout);
  return atomic_load(&tu_failures) > failed ? 1 : 0;
}

static void test_full(void) {
  tu_in_child("a move on a full disk", full_main);
}

/* A move left pending (its finish retired the cells, then could not queue
 * them in limbo) when another move finds room in limbo: the disk had room
 * again only after the lock was taken. The new move must not record itself
 * over the pending one, whose counter's value only the journal holds. Here
 * an expiry's hook lifts the limit between its tally__lock (whose finish
 * fails) and its move: the pending reshard finishes, the expiry is refused
 * (EBUSY) and comes again at the next scan. Recorded over it, the expiry
 * dropped its counter and left pend:a's cell retired with no move
 * (ECORRUPT). In a child: the limit is the process's. */
static struct rlimit g_fsize;
static void lift_at_expire(const char *where, const char *name, size_t len) {
  (void)name, (void)len;
  if (strcmp(where, "expire") == 0) setrlimit(RLIMIT_FSIZE, &g_fsize);
}

static int pending_main(void) {
  int failed = atomic_load(&tu_failures); /* the parent's, before the fork */
  alarm(60);
  signal(SIGXFSZ, SIG_IGN);
  char path[1200];
  snprintf(path, sizeof path, "%s/pending.tly", g_dir);
  unlink(path);
  tally_store *s = open_file("pending.tly", "3600000");
  tally_family_options fo = {1, -1, 10, 0}; /* idle 10 s */
  REQUIRE_OK(tally_family_define(s, "px:*", 4, &fo));
  tally_counter *a;
  REQUIRE_OK(make(s, "pend:a", 1, 5));
  REQUIRE_OK(make(s, "pend:two", 2, 0)); /* a 2-shard chunk: the reshard's cells */
  REQUIRE_OK(make(s, "px:c", 0, 7));
  REQUIRE_OK(tu_counter(s, "pend:a", 0, -1, 0, &a));
  EXPECT_OK(tally_store_maintain(s, 1000000, 1000, NULL)); /* px:c seen at 1000 s */
  fill_to_end(s);
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL)); /* a new epoch: a new limbo node */
  struct stat st;
  REQUIRE_OK(stat(path, &st) ? TALLY_ESYS : 0);
  struct rlimit rl;
  REQUIRE_OK(getrlimit(RLIMIT_FSIZE, &g_fsize) ? TALLY_ESYS : 0);
  rl = (struct rlimit){(rlim_t)st.st_size, g_fsize.rlim_max};
  REQUIRE_OK(setrlimit(RLIMIT_FSIZE, &rl) ? TALLY_ESYS : 0);
  /* a reshard of pend:a recorded as tally__journal_move records it (no
   * room made first, as before 73959e7); its finish fails */
  REQUIRE_OK(tally__lock(s));
  uint64_t rec = tally__crec(a), cells = 0;
  int rc = tally__cells_alloc(s, 2, &cells);
  EXPECT_OK(rc);
  if (rc == 0) {
    uint64_t to = tally__loc_make(s, rec, cells, 2, false);
    atomic_store(&s->hdr->pend_cond, 0);
    atomic_store(&s->hdr->pend_done, 0);
    atomic_store(&s->hdr->pend_loc, to);
    atomic_store(&s->hdr->pend_rec, tally__seal(s, TALLY__SEAL_MOVE, rec, to));
    EXPECT_RC(TALLY_ESYS, tally__journal_finish(s));
  }
  tally__unlock(s);
  EXPECT(atomic_load(&s->hdr->pend_rec) != 0); /* pending, pend:a's cell retired */
  EXPECT_I64(1, atomic_load(&s->hdr->pend_done));
  tally__test_hook = lift_at_expire;
  tally_maintain_result r = {0};
  rc = tally_store_maintain(s, 1011000, UINT32_MAX, &r); /* the whole index */
  tally__test_hook = NULL;
  setrlimit(RLIMIT_FSIZE, &g_fsize); /* had the expiry not run */
  printf("  pending: maintain %s, expired %llu\n", tally_err_name(rc),
         (unsigned long long)r.expired);
  EXPECT_OK(rc);
  EXPECT_I64(0, r.expired); /* refused: the pending reshard was finished instead */
  EXPECT_I64(0, atomic_load(&s->hdr->pend_rec));
  EXPECT_I64(5, tu_value(a));
  tally_counter_info in;
  EXPECT_OK(tally_counter_info_get(a, &in));
  EXPECT_I64(2, in.shards);
  EXPECT_I64(7, value_of(s, "px:c", NULL));
  EXPECT_OK(tally_store_maintain(s, 1011000, UINT32_MAX, &r)); /* the expiry again */
  EXPECT_I64(1, r.expired);
  EXPECT_I64(INT64_MIN, value_of(s, "px:c", &rc)); /* expired now */
  EXPECT_I64(TALLY_ENOENT, rc);
  EXPECT_I64(5, tu_value(a));
  expect_check(s, "after a pending move met another");
  tally_counter_close(a);
  untrack_close(s);
  fflush(stdout);
  return atomic_load(&tu_failures) > failed ? 1 : 0;
}

static void test_pending(void) {
  tu_in_child("a move over a pending one", pending_main);
}

/* A reshard whose value stops fitting between its check and its move (an
 * add lands meanwhile: here from the "reshard" hook) is undone by the
 * finish (ERANGE). Its new cells were taken and never given back: every
 * such refusal leaked a column of the store for good. */
static tally_counter *g_undo_w;
static void add_at_reshard(const char *where, const char *name, size_t len) {
  (void)name, (void)len;
  if (strcmp(where, "reshard") == 0) EXPECT_OK(tally_counter_incr(g_undo_w, 20));
}

static void test_reshard_undone(void) {
  tally_store *s = open_file("undone.tly", "3600000"); /* nothing reclaimed */
  const int64_t top = (INT64_C(1) << 62) - 10; /* fits one shard, 20 more do not */
  tally_counter *b;
  REQUIRE_OK(make(s, "undo:one", 1, 0)); /* a 1-shard chunk */
  REQUIRE_OK(make(s, "undo:b", 1, top));
  REQUIRE_OK(tu_counter(s, "undo:b", 0, -1, 0, &b));
  EXPECT_OK(tally_counter_reshard(b, 2));
  REQUIRE_OK(tu_counter(s, "undo:b", 0, -1, 0, &g_undo_w));
  uint32_t cols = class_cols(s, 1);
  tally__test_hook = add_at_reshard;
  EXPECT_RC(TALLY_ERANGE, tally_counter_reshard(b, 1));
  tally__test_hook = NULL;
  EXPECT_I64(top + 20, tu_value(b)); /* undone, the add kept */
  EXPECT_OK(tally_counter_incr(b, -20));
  EXPECT_OK(tally_counter_reshard(b, 1));
  EXPECT_I64(top, tu_value(b));
  /* the refused reshard's column was handed out again: one taken in all */
  EXPECT_I64(cols + 1, class_cols(s, 1));
  expect_check(s, "after a reshard undone");
  tally_counter_close(g_undo_w);
  tally_counter_close(b);
  untrack_close(s);
}

int main(int argc, char **argv) {
  const char *only = argc > 1 ? argv[1] : NULL; /* run one test by name */
  /* before tally's own handlers (registered at its first open): a child
   * runs its fork handlers in the order they were registered */
  pthread_atfork(NULL, NULL, pause_forked_child);
  snprintf(g_dir, sizeof g_dir, "%s", tu_tmpdir("lifecycle"));
  g_pg =
      mmap(NULL, sizeof(page), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (g_pg == MAP_FAILED) {
    perror("mmap");
    return 1;
  }
  double t0 = tu_now();
#define RUN(name, call)                                                                  \
  do {                                                                                   \
    if (!only || strcmp(only, name) == 0) {                                              \
      double t_ = tu_now();                                                              \
      call;                                                                              \
      printf("%s: %.2f s\n", name, tu_now() - t_);                                       \
      fflush(stdout);                                                                    \
    }                                                                                    \
  } while (0)
  char spec[1200];
  tu_spec(spec, sizeof spec, NULL, 0, g_dir, "reuse.tly");
  RUN("reuse", (test_reuse("memory", "memory store"), test_reuse(spec, "file store"),
                test_grace_time()));
  RUN("churn", test_churn_bound());
  RUN("stale", (test_stale_here(), test_stale_there(0, 1), test_stale_there(1, 1),
                test_stale_there(0, 0), test_stale_there(1, 0), test_grace_from_pass()));
  RUN("stopped", test_stopped());
  RUN("procs", (test_late_opener(), test_fork_holds(), test_table_of_dead(),
                test_table_full(), test_failed_forks()));
  RUN("exact", (test_hold(), test_exact_churn()));
  RUN("caps", test_caps());
  RUN("check", test_check_damage());
  RUN("close", test_close_order());
  RUN("shipped", (test_shipped(), test_send_begin()));
  RUN("carve", test_carve());
  RUN("walk", test_walk_holds());
  RUN("open", (test_open_holds(), test_revive_holds(), test_revive_race()));
  RUN("expiry killed", test_expiry_killed());
  RUN("full", (test_full(), test_pending(), test_reshard_undone()));
  printf("total %.2f s\n", tu_now() - t0);
  tu_rmrf(g_dir);
  return tu_finish("test_lifecycle");
}
