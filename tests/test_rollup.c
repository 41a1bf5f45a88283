/* test_rollup.c -- schedules, rollup records, history rings and the lease.
 *
 *   - bad schedules are refused (EINVAL) and nothing is stored;
 *   - records, deltas and rates; history rings, gaps, epoch alignment and
 *     coarse-from-fine; the union of rings when schedules overlap, and
 *     blocks of several ring shapes rolled in one tick;
 *   - readers on other threads never see a torn record or history while a
 *     ticker writes (run under TSan too);
 *   - the lease: a stalled holder (SIGSTOP) makes others BUSY until its
 *     lease runs out, then one takes over and finishes the period; the
 *     stalled one, resumed, finds it LOST; one stalled past the end of its
 *     period has it finished by the next holder before the current one;
 *   - two schedules of a counter with clocks a little apart both roll it;
 *   - a damaged rollup block is ECORRUPT for check() and for readers.
 */
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>

#include "testutil.h"

#define T0 INT64_C(1763769600000) /* ms; a whole day */

static char g_dir[1024];

static tally_schedule *schedule(tally_store *s, const char *pattern, int64_t every_ms,
                                const tally_ring *rings, uint32_t n) {
  tally_schedule *sch = NULL;
  REQUIRE_OK(tally_schedule_new(s, pattern, strlen(pattern), every_ms, rings, n, &sch));
  return sch;
}

static tally_tick_result tick(tally_schedule *sch, int64_t now_ms) {
  tally_tick_result r;
  memset(&r, 0xff, sizeof r);
  EXPECT_OK(tally_schedule_tick(sch, now_ms, NULL, NULL, &r));
  return r;
}

static void test_bad_schedules(void) {
  tally_store *s;
  tally_schedule *sch = NULL;
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  tally_ring ok[] = {{1, 60}};
  tally_ring bad[][2] = {{{0, 60}},
                         {{1, 0}},
                         {{1, TALLY_RING_LEN_MAX + 1}},
                         {{TALLY_RING_RES_MAX + 1, 1}},
                         {{60, 5}, {60, 10}}};
  EXPECT_RC(TALLY_EINVAL, tally_schedule_new(s, "x", 1, 0, ok, 1, &sch));
  EXPECT_RC(TALLY_EINVAL, tally_schedule_new(s, "x", 1, -5, ok, 1, &sch));
  EXPECT_RC(TALLY_EINVAL, tally_schedule_new(s, "", 0, 1000, ok, 1, &sch));
  EXPECT_RC(TALLY_EINVAL, tally_schedule_new(s, "x", 1, 1000, NULL, 1, &sch));
  EXPECT_RC(TALLY_EINVAL,
            tally_schedule_new(s, "x", 1, 1000, ok, TALLY_RINGS_MAX + 1, &sch));
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    EXPECT_RC(TALLY_EINVAL,
              tally_schedule_new(s, "x", 1, 1000, bad[i], i == 4 ? 2 : 1, &sch));
  EXPECT(sch == NULL);
  REQUIRE_OK(tally_schedule_new(s, "x", 1, 1000, ok, 1, &sch));
  tally_tick_result r;
  EXPECT_RC(TALLY_EINVAL, tally_schedule_tick(sch, -1, NULL, NULL, &r));
  tally_schedule_free(sch);
  tally_schedule_free(NULL);
  tally_store_close(s);
}

struct seen {
  int n;
  char name[64];
  tally_rollup last;
};
static void remember(void *ud, const char *name, size_t len, const tally_rollup *r) {
  struct seen *s = ud;
  s->n++;
  snprintf(s->name, sizeof s->name, "%.*s", (int)len, name);
  s->last = *r;
}

static void test_records_and_history(const char *spec) {
  tally_store *s;
  tally_counter *c, *other;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  REQUIRE_OK(tu_counter(s, "hits", 4, TALLY_POLICY_RANDOM, TALLY_COUNTER_CREATE, &c));
  REQUIRE_OK(
      tu_counter(s, "other", 4, TALLY_POLICY_RANDOM, TALLY_COUNTER_CREATE, &other));
  tally_rollup r;
  tally_bucket b[200];
  uint32_t n;
  EXPECT_RC(TALLY_ENOROLLUP, tally_counter_rolled(c, &r));
  EXPECT_RC(TALLY_ENOROLLUP, tally_counter_history(c, 1, b, 200, &n));
  tally_ring rings[] = {{1, 60}, {60, 5}};
  tally_schedule *sch = schedule(s, "hits", 1000, rings, 2);
  struct seen seen = {0};
  tally_tick_result t;
  REQUIRE_OK(tally_counter_incr(c, 7));
  EXPECT_OK(tally_schedule_tick(sch, T0, remember, &seen, &t));
  EXPECT_I64(TALLY_TICK_RAN, t.status);
  EXPECT_I64(T0 / 1000, t.period);
  EXPECT_I64(1, t.counters);
  EXPECT_I64(1, seen.n);
  EXPECT_STR("hits", seen.name);
  EXPECT_I64(7, seen.last.value);
  EXPECT_I64(0, seen.last.delta);
  EXPECT(tally_rollup_rate(&seen.last) == 0.0);
  EXPECT_I64(TALLY_TICK_NOT_DUE, tick(sch, T0 + 999).status);
  EXPECT_RC(TALLY_ENOROLLUP, tally_counter_rolled(other, &r)); /* not covered */
  /* three minutes of one rollup a second; value(i) = 7 + i */
  for (int i = 1; i < 180; i++) {
    REQUIRE_OK(tally_counter_incr(c, 1));
    EXPECT_I64(TALLY_TICK_RAN, tick(sch, T0 + i * 1000 + 250).status);
  }
  EXPECT_OK(tally_counter_rolled(c, &r));
  EXPECT_I64(186, r.value);
  EXPECT_I64(1, r.delta);
  EXPECT_I64(T0 + 179250, r.at_ms);
  EXPECT_I64(T0 + 178250, r.prev_at_ms);
  EXPECT_I64(180, (int64_t)r.count);
  EXPECT(tally_rollup_rate(&r) == 1.0);
  EXPECT_OK(tally_counter_history(c, 1, b, 200, &n));
  EXPECT_I64(60, n);
  EXPECT_I64(T0 / 1000 + 120, b[0].t);
  EXPECT_I64(127, b[0].value);
  EXPECT_I64(T0 / 1000 + 179, b[59].t);
  EXPECT_I64(186, b[59].value);
  tally_bucket m[8];
  EXPECT_OK(tally_counter_history(c, 60, m, 8, &n));
  EXPECT_I64(3, n);
  for (int k = 0; k < 3; k++) {
    EXPECT_I64(T0 / 1000 + 60 * k, m[k].t);
    EXPECT_I64(7 + 60 * k + 59, m[k].value); /* the last fine bucket inside */
  }
  EXPECT_I64(m[2].value, b[59].value);
  /* cap smaller than the ring: n still says how many there are */
  EXPECT_OK(tally_counter_history(c, 1, b, 2, &n));
  EXPECT_I64(60, n);
  EXPECT_RC(TALLY_ENOROLLUP, tally_counter_history(c, 3600, b, 200, &n));
  /* a gap empties the buckets in between */
  EXPECT_I64(TALLY_TICK_RAN, tick(sch, T0 + 190000).status);
  EXPECT_OK(tally_counter_history(c, 1, b, 200, &n));
  EXPECT_I64(50, n); /* 131..179, then 190: 180..189 empty */
  EXPECT_I64(T0 / 1000 + 179, b[48].t);
  EXPECT_I64(T0 / 1000 + 190, b[49].t);
  /* a second schedule with another ring and a longer one: the union */
  tally_ring more[] = {{60, 30}, {3600, 24}};
  tally_schedule *slow = schedule(s, "h*", 60000, more, 2);
  EXPECT_I64(TALLY_TICK_RAN, tick(slow, T0 + 191000).status);
  tally_ring have[TALLY_RINGS_MAX];
  EXPECT_OK(tally_counter_rings(c, have, TALLY_RINGS_MAX, &n));
  EXPECT_I64(3, n);
  EXPECT_I64(1, have[0].res_s);
  EXPECT_I64(60, have[0].len);
  EXPECT_I64(60, have[1].res_s);
  EXPECT_I64(30, have[1].len);
  EXPECT_I64(3600, have[2].res_s);
  EXPECT_OK(tally_counter_history(c, 60, m, 8, &n)); /* carried over */
  EXPECT_I64(4, n);
  EXPECT_I64(186, m[3].value);
  EXPECT_OK(tally_counter_history(c, 1, b, 200, &n));
  EXPECT_I64(50, n); /* 132..179, 190, 191 */
  EXPECT_I64(T0 / 1000 + 191, b[49].t);
  EXPECT_OK(tally_store_check(s));
  tally_schedule_free(slow);
  tally_schedule_free(sch);
  tally_counter_close(other);
  tally_counter_close(c);
  tally_store_close(s);
}

/* ---- readers against a writer ------------------------------------------------ */

static struct {
  tally_counter *c;
  atomic_int stop;
  atomic_long reads;
} RW;

/* The ticker rolls at t = 1000 * value, so a consistent record has
 * at_ms == 1000 * value and delta == value - previous value. */
static void *reader_main(void *arg) {
  (void)arg;
  tally_rollup r;
  tally_bucket b[64];
  uint32_t n;
  while (!atomic_load(&RW.stop)) {
    int rc = tally_counter_rolled(RW.c, &r);
    if (rc == TALLY_ENOROLLUP) continue;
    if (rc) {
      TU_FAIL("rolled -> %s", tally_err_name(rc));
      break;
    }
    if (r.at_ms != T0 + r.value * 1000 || (r.count > 1 && r.delta != 1))
      TU_FAIL("torn record: value %lld at %lld delta %lld", (long long)r.value,
              (long long)r.at_ms, (long long)r.delta);
    rc = tally_counter_history(RW.c, 1, b, 64, &n);
    if (rc) {
      TU_FAIL("history -> %s", tally_err_name(rc));
      break;
    }
    for (uint32_t i = 0; i < n && i < 64; i++)
      if (b[i].t != T0 / 1000 + b[i].value)
        TU_FAIL("torn bucket: t %lld value %lld", (long long)b[i].t,
                (long long)b[i].value);
    for (uint32_t i = 1; i < n && i < 64; i++)
      if (b[i].t != b[i - 1].t + 1) TU_FAIL("history out of order");
    atomic_fetch_add(&RW.reads, 1);
  }
  return NULL;
}

static void test_readers(void) {
  tally_store *s;
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  REQUIRE_OK(tu_counter(s, "rw", 2, TALLY_POLICY_RANDOM, TALLY_COUNTER_CREATE, &RW.c));
  tally_ring rings[] = {{1, 32}};
  tally_schedule *sch = schedule(s, "rw", 1000, rings, 1);
  pthread_t th[2];
  atomic_store(&RW.stop, 0);
  for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, reader_main, NULL);
  /* 20000 rollups at least, and on until the readers have read a few
   * hundred times (a loaded machine may not run them at first), 20 s at most */
  double until = tu_now() + 20;
  for (int64_t v = 0; v < 20000 || (atomic_load(&RW.reads) < 500 && tu_now() < until);
       v++) {
    if (v) REQUIRE_OK(tally_counter_incr(RW.c, 1));
    tally_tick_result t = tick(sch, T0 + v * 1000);
    if (t.status != TALLY_TICK_RAN)
      TU_FAIL("tick %lld: status %d", (long long)v, t.status);
  }
  atomic_store(&RW.stop, 1);
  for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
  EXPECT(atomic_load(&RW.reads) > 0);
  tally_schedule_free(sch);
  tally_counter_close(RW.c);
  tally_store_close(s);
}

/* ---- the lease ------------------------------------------------------------------ */

#if defined(__SANITIZE_THREAD__) /* a tick runs several times slower */
#define LEASE_N 50000
#else
#define LEASE_N 200000
#endif

/* A file store of LEASE_N one-shard counters "<prefix>:<i>", big enough
 * that a tick is still running when the test stops or kills it. The first
 * `keep` counters stay open in cs[]. spec gets the store's spec (1200 bytes). */
static tally_store *lease_store(const char *file, const char *prefix, char *spec,
                                tally_counter **cs, int keep) {
  char path[1200], name[32];
  tally_store *s;
  tu_spec(spec, 1200, path, sizeof path, g_dir, file);
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  for (int i = 0; i < LEASE_N; i++) {
    tally_counter *c;
    snprintf(name, sizeof name, "%s:%d", prefix, i);
    REQUIRE_OK(tu_counter(s, name, 1, TALLY_POLICY_RANDOM, TALLY_COUNTER_CREATE, &c));
    if (i < keep)
      cs[i] = c;
    else
      tally_counter_close(c);
  }
  return s;
}

/* A child that opens spec and ticks a schedule of pattern every every_ms
 * (rings[1]) at T0, writing the tick's status to *status (-1 until it
 * ends); returned once first has a rollup, so the child is rolling (or
 * done, on a fast run). */
static pid_t start_ticker(const char *spec, const char *pattern, int64_t every_ms,
                          const tally_ring *rings, int *status, tally_counter *first) {
  *status = -1;
  pid_t pid = fork();
  if (pid == 0) {
    tally_store *cs;
    tally_schedule *sch;
    tally_tick_result t;
    if (tally_store_open(spec, NULL, &cs) ||
        tally_schedule_new(cs, pattern, strlen(pattern), every_ms, rings, 1, &sch) ||
        tally_schedule_tick(sch, T0, NULL, NULL, &t))
      _exit(1);
    *status = t.status;
    _exit(0);
  }
  tally_rollup r;
  double deadline = tu_now() + 20;
  while (tally_counter_rolled(first, &r) != 0 && tu_now() < deadline) {}
  return pid;
}

static void test_stalled_holder(void) {
  char spec[1200], name[32];
  tally_counter *first;
  tally_store *s = lease_store("lease.tly", "l", spec, &first, 1);
  tally_ring rings[] = {{1, 4}};
  /* the period is 600 ms: the lease lasts that long without renewal */
  int *status =
      mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  pid_t pid = start_ticker(spec, "l:*", 600, rings, status, first);
  tally_rollup r;
  kill(pid, SIGSTOP);
  double stopped = tu_now();
  tally_schedule *sch = schedule(s, "l:*", 600, rings, 1);
  tally_tick_result t = tick(sch, T0 + 1);
  if (t.status == TALLY_TICK_NOT_DUE) {
    /* the child finished before it was stopped: nothing to take over */
    printf("  stalled holder: the child finished first; lease takeover not exercised\n");
  } else {
    if (tu_now() - stopped < 0.5) EXPECT_I64(TALLY_TICK_BUSY, t.status);
    /* another schedule over the same counters is not held up (its own
     * lease), even if the stopped child holds one of their blocks */
    tally_ring other_rings[] = {{60, 4}};
    tally_schedule *other = schedule(s, "l:*", 1000, other_rings, 1);
    EXPECT_I64(TALLY_TICK_RAN, tick(other, T0 + 1).status); /* not BUSY */
    tally_schedule_free(other);
    usleep(700 * 1000); /* past one period without renewal */
    t = tick(sch, T0 + 2);
    EXPECT_I64(TALLY_TICK_RAN, t.status);
    EXPECT(t.counters > 0 && t.counters < LEASE_N); /* from the child's cursor */
    EXPECT_I64(TALLY_TICK_NOT_DUE, tick(sch, T0 + 3).status);
  }
  kill(pid, SIGCONT);
  int wst;
  waitpid(pid, &wst, 0);
  EXPECT(WIFEXITED(wst) && WEXITSTATUS(wst) == 0);
  if (t.status == TALLY_TICK_RAN) EXPECT_I64(TALLY_TICK_LOST, *status);
  /* every counter was rolled for the period */
  for (int i = 0; i < LEASE_N; i += 4999) {
    tally_counter *c;
    snprintf(name, sizeof name, "l:%d", i);
    REQUIRE_OK(tu_counter(s, name, 0, -1, 0, &c));
    EXPECT_OK(tally_counter_rolled(c, &r));
    tally_counter_close(c);
  }
  EXPECT_OK(tally_store_check(s));
  munmap(status, 4096);
  tally_schedule_free(sch);
  tally_counter_close(first);
  tally_store_close(s);
}

/* A holder stalled past the end of its period (a lease lasts a period
 * beyond its last renewal, so it is taken over in a later one): the new
 * holder first finishes that period from the stalled one's cursor, as of
 * its last moment, then rolls the current one. Every counter has a
 * record of both. */
static void test_stalled_past_period(void) {
  char spec[1200], name[32];
  tally_counter *first;
  tally_store *s = lease_store("late.tly", "p", spec, &first, 1);
  tally_ring rings[] = {{1, 4}};
  int *status =
      mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  pid_t pid = start_ticker(spec, "p:*", 600, rings, status, first);
  tally_rollup r;
  kill(pid, SIGSTOP);
  usleep(700 * 1000); /* past its lease */
  tally_schedule *sch = schedule(s, "p:*", 600, rings, 1);
  tally_tick_result t = tick(sch, T0 + 600); /* the next period */
  kill(pid, SIGCONT);
  int wst;
  waitpid(pid, &wst, 0);
  EXPECT(WIFEXITED(wst) && WEXITSTATUS(wst) == 0);
  EXPECT_I64(TALLY_TICK_RAN, t.status);
  if (*status == TALLY_TICK_RAN) {
    printf("  stalled past its period: the child finished first; not exercised\n");
  } else {
    EXPECT_I64(TALLY_TICK_LOST, *status);
    /* the rest of the old period, then all of the new one */
    EXPECT(t.counters > LEASE_N && t.counters < 2 * LEASE_N);
    printf("  stalled past its period: %llu counters rolled by the next holder\n",
           (unsigned long long)t.counters);
  }
  int bad = 0;
  for (int i = 0; i < LEASE_N; i += 997) {
    tally_counter *c;
    snprintf(name, sizeof name, "p:%d", i);
    REQUIRE_OK(tu_counter(s, name, 0, -1, 0, &c));
    EXPECT_OK(tally_counter_rolled(c, &r));
    /* once for each period, the old one as of its last moment at the latest */
    if (r.count != 2 || r.at_ms != T0 + 600 || r.prev_at_ms > T0 + 599) bad++;
    tally_counter_close(c);
  }
  EXPECT_I64(0, bad);
  EXPECT_I64(TALLY_TICK_NOT_DUE, tick(sch, T0 + 601).status);
  EXPECT_OK(tally_store_check(s));
  munmap(status, 4096);
  tally_schedule_free(sch);
  tally_counter_close(first);
  tally_store_close(s);
}

/* Two schedules of one counter whose clocks read a little apart: the one
 * that comes second but reads the earlier moment rolls it as of the later
 * one, not skips it; a roll more than a period ahead is still never gone
 * back on. */
static void test_clocks_apart(void) {
  tally_store *s;
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  tally_counter *c;
  REQUIRE_OK(tu_counter(s, "x", 1, -1, TALLY_COUNTER_CREATE, &c));
  tally_ring r1[] = {{1, 4}}, r10[] = {{10, 4}};
  tally_schedule *a = schedule(s, "x", 1000, r1, 1), *b = schedule(s, "x", 10000, r10, 1);
  EXPECT_OK(tally_counter_incr(c, 5));
  tally_tick_result t = tick(a, T0 + 1);
  EXPECT_I64(1, (int64_t)t.counters);
  t = tick(b, T0);
  EXPECT_I64(1, (int64_t)t.counters);
  EXPECT_I64(0, t.skipped);
  tally_rollup r;
  EXPECT_OK(tally_counter_rolled(c, &r));
  EXPECT_I64(T0 + 1, r.at_ms);
  EXPECT_I64(2, (int64_t)r.count);
  /* a period of b further ahead: skipped, as a clock gone back */
  EXPECT_I64(1, (int64_t)tick(a, T0 + 20001).counters);
  t = tick(b, T0 + 10000);
  EXPECT_I64(0, (int64_t)t.counters);
  EXPECT_I64(1, t.skipped);
  tally_schedule_free(a);
  tally_schedule_free(b);
  tally_counter_close(c);
  tally_store_close(s);
}

/* A holder that dies is replaced at once, not after its lease. */
static void test_dead_holder(void) {
  char spec[1200], name[32];
  tally_counter *first;
  tally_store *s = lease_store("dead.tly", "d", spec, &first, 1);
  tally_ring rings[] = {{1, 4}};
  pid_t pid = fork();
  if (pid == 0) {
    tally_store *cs;
    tally_schedule *sch;
    tally_tick_result t;
    if (tally_store_open(spec, NULL, &cs) ||
        tally_schedule_new(cs, "d:*", 3, 3600000, rings, 1, &sch))
      _exit(1);
    tally_schedule_tick(sch, T0, NULL, NULL, &t);
    _exit(0);
  }
  tally_rollup r;
  double deadline = tu_now() + 20;
  while (tally_counter_rolled(first, &r) != 0 && tu_now() < deadline) {}
  kill(pid, SIGKILL);
  int wst;
  waitpid(pid, &wst, 0);
  /* the lease would last an hour: only the dead pid lets us in now */
  tally_schedule *sch = schedule(s, "d:*", 3600000, rings, 1);
  tally_tick_result t = tick(sch, T0 + 1);
  if (t.status == TALLY_TICK_NOT_DUE) {
    printf("  dead holder: the child finished first; takeover not exercised\n");
  } else {
    EXPECT_I64(TALLY_TICK_RAN, t.status); /* not BUSY for the hour of its lease */
    /* it resumes after the dead holder's last published cursor; a kill
     * before its first one (a slow sanitizer run) leaves all to redo */
    EXPECT(t.counters <= LEASE_N);
    printf("  dead holder: taken over at once, %llu of %d counters left to roll\n",
           (unsigned long long)t.counters, LEASE_N);
  }
  for (int i = 0; i < LEASE_N; i += 4999) {
    tally_counter *c;
    snprintf(name, sizeof name, "d:%d", i);
    REQUIRE_OK(tu_counter(s, name, 0, -1, 0, &c));
    EXPECT_OK(tally_counter_rolled(c, &r));
    EXPECT_I64(1, (int64_t)r.count); /* once for the period, by one of them */
    tally_counter_close(c);
  }
  tally_schedule_free(sch);
  tally_counter_close(first);
  tally_store_close(s);
}

/* A holder dies mid-period; another schedule then rolls the same counters;
 * the next holder of the first schedule still rolls exactly those the dead
 * one had not reached (progress is the schedule's, not the record's). */
static int g_resumed;
static void count_one(void *ud, const char *name, size_t len, const tally_rollup *r) {
  (void)ud, (void)name, (void)len, (void)r;
  g_resumed++;
}

static void test_resume_after_other_schedule(void) {
  char spec[1200];
  tally_counter **cs = calloc(LEASE_N, sizeof *cs);
  tally_store *s = lease_store("resume.tly", "m", spec, cs, LEASE_N);
  tally_ring rings[] = {{1, 4}};
  pid_t pid = fork();
  if (pid == 0) {
    tally_store *cst;
    tally_schedule *sch;
    tally_tick_result t;
    if (tally_store_open(spec, NULL, &cst) ||
        tally_schedule_new(cst, "m:*", 3, 3600000, rings, 1, &sch))
      _exit(1);
    tally_schedule_tick(sch, T0, NULL, NULL, &t);
    _exit(0);
  }
  tally_rollup r;
  double deadline = tu_now() + 20;
  while (tally_counter_rolled(cs[0], &r) != 0 && tu_now() < deadline) {}
  kill(pid, SIGKILL);
  int wst;
  waitpid(pid, &wst, 0);
  int done_by_child = 0;
  for (int i = 0; i < LEASE_N; i++)
    if (tally_counter_rolled(cs[i], &r) == 0) done_by_child++;
  if (done_by_child == LEASE_N) {
    printf("  resume: the child finished first; not exercised\n");
  } else {
    tally_schedule *fast = schedule(s, "m:*", 1000, rings, 1);
    EXPECT_I64(LEASE_N, tick(fast, T0 + 1).counters); /* every record is newer now */
    tally_schedule *slow = schedule(s, "m:*", 3600000, rings, 1);
    tally_tick_result t;
    g_resumed = 0;
    EXPECT_OK(tally_schedule_tick(slow, T0 + 2, count_one, NULL, &t));
    EXPECT_I64(TALLY_TICK_RAN, t.status);
    /* the member the child was writing when killed may be done again */
    EXPECT(g_resumed >= LEASE_N - done_by_child - 1 &&
           g_resumed <= LEASE_N - done_by_child + 1);
    EXPECT_I64(g_resumed, t.counters);
    tally_schedule_free(fast);
    tally_schedule_free(slow);
  }
  for (int i = 0; i < LEASE_N; i++) tally_counter_close(cs[i]);
  free(cs);
  tally_store_close(s);
}

/* A writer killed mid-write leaves a block's seq odd: readers report
 * EBUSY (after about a second), and the next rollup repairs it. */
static void test_torn_block(void) {
  char spec[1200], path[1200];
  tu_spec(spec, sizeof spec, path, sizeof path, g_dir, "torn.tly");
  tally_store *s;
  tally_counter *c;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  REQUIRE_OK(tu_counter(s, "torn", 2, TALLY_POLICY_RANDOM, TALLY_COUNTER_CREATE, &c));
  tally_ring rings[] = {{7, 77}};
  tally_schedule *sch = schedule(s, "torn", 1000, rings, 1);
  EXPECT_I64(TALLY_TICK_RAN, tick(sch, T0).status);
  int fd = open(path, O_RDWR);
  struct stat st;
  fstat(fd, &st);
  unsigned char *m =
      mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const uint32_t want[2] = {7, 77};
  size_t at = 0;
  for (size_t i = 4096; i + 8 <= (size_t)st.st_size; i += 8)
    if (memcmp(m + i, want, 8) == 0) {
      at = i;
      break;
    }
  EXPECT(at != 0);
  if (at) atomic_fetch_add((_Atomic uint64_t *)(void *)(m + at - 64), 1); /* seq: odd */
  tally_rollup r;
  double t0 = tu_now();
  EXPECT_RC(TALLY_EBUSY, tally_counter_rolled(c, &r));
  EXPECT(tu_now() - t0 >= 0.9 && tu_now() - t0 < 5);
  REQUIRE_OK(tally_counter_incr(c, 5));
  EXPECT_I64(TALLY_TICK_RAN, tick(sch, T0 + 1000).status);
  EXPECT_OK(tally_counter_rolled(c, &r));
  EXPECT_I64(5, r.value);
  EXPECT_I64(2, (int64_t)r.count);
  munmap(m, (size_t)st.st_size);
  close(fd);
  tally_schedule_free(sch);
  tally_counter_close(c);
  tally_store_close(s);
}

/* ---- damage -------------------------------------------------------------------- */

static void test_damaged_block(void) {
  char spec[1200], path[1200];
  tu_spec(spec, sizeof spec, path, sizeof path, g_dir, "damaged.tly");
  tally_store *s;
  tally_counter *c;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  REQUIRE_OK(tu_counter(s, "x", 2, TALLY_POLICY_RANDOM, TALLY_COUNTER_CREATE, &c));
  tally_ring rings[] = {{7, 77}}; /* a ring header easy to find in the file */
  tally_schedule *sch = schedule(s, "x", 1000, rings, 1);
  EXPECT_I64(TALLY_TICK_RAN, tick(sch, T0).status);
  tally_schedule_free(sch);
  tally_counter_close(c);
  tally_store_close(s);

  int fd = open(path, O_RDWR);
  struct stat st;
  fstat(fd, &st);
  unsigned char *m =
      mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const uint32_t want[2] = {7, 77};
  size_t at = 0;
  for (size_t i = 4096; i + 8 <= (size_t)st.st_size; i += 8)
    if (memcmp(m + i, want, 8) == 0) {
      at = i;
      break;
    }
  EXPECT(at != 0);
  if (at) m[at + 4] ^= 0x10; /* the ring's length */
  munmap(m, (size_t)st.st_size);
  close(fd);

  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  REQUIRE_OK(tu_counter(s, "x", 0, -1, 0, &c));
  tally_rollup r;
  EXPECT_RC(TALLY_ECORRUPT, tally_counter_rolled(c, &r));
  EXPECT_RC(TALLY_ECORRUPT, tally_store_check(s));
  EXPECT_I64(0 + 1, tu_value(c) + 1); /* the counter itself still reads */
  tally_counter_close(c);
  tally_store_close(s);
}

/* One tick rolls blocks of different ring shapes: a ring of the same
 * resolution but another length (the union of two schedules' rings) has
 * its own slot for the same moment. A tick works out each shape's bucket
 * once (struct tally__when); keyed by resolution alone, the longer ring
 * would be written at the shorter one's index. */
static void test_ring_shapes_in_one_tick(void) {
  tally_store *s;
  tally_counter *a, *b;
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  REQUIRE_OK(tu_counter(s, "a", 4, TALLY_POLICY_RANDOM, TALLY_COUNTER_CREATE, &a));
  REQUIRE_OK(tu_counter(s, "b", 4, TALLY_POLICY_RANDOM, TALLY_COUNTER_CREATE, &b));
  tally_ring wide[] = {{1, 25}, {7, 4}}, narrow[] = {{1, 10}};
  tally_schedule *lb = schedule(s, "b", 60000, wide, 2);
  tally_schedule *all = schedule(s, "*", 1000, narrow, 1);
  EXPECT_I64(TALLY_TICK_RAN, tick(lb, T0 - 60000).status); /* b: 1 s x 25, 7 s x 4 */
  for (int i = 0; i < 40; i++) {
    REQUIRE_OK(tally_counter_incr(a, 1));
    REQUIRE_OK(tally_counter_incr(b, 2));
    tally_tick_result t = tick(all, T0 + i * 1000 + 500);
    EXPECT_I64(2, t.counters);
  }
  tally_bucket h[32];
  uint32_t n;
  EXPECT_OK(tally_counter_history(a, 1, h, 32, &n));
  EXPECT_I64(10, n);
  for (uint32_t k = 0; k < n && k < 10; k++) {
    EXPECT_I64(T0 / 1000 + 30 + k, h[k].t);
    EXPECT_I64(31 + k, h[k].value);
  }
  EXPECT_OK(tally_counter_history(b, 1, h, 32, &n));
  EXPECT_I64(25, n);
  for (uint32_t k = 0; k < n && k < 25; k++) {
    EXPECT_I64(T0 / 1000 + 15 + k, h[k].t);
    EXPECT_I64(2 * (16 + k), h[k].value);
  }
  EXPECT_OK(tally_counter_history(b, 7, h, 32, &n)); /* 7 s buckets: the last inside */
  EXPECT_I64(4, n);
  for (uint32_t k = 0; k < n && k < 4; k++) {
    int64_t start = (T0 / 1000 + 39) / 7 * 7 - 7 * (3 - (int64_t)k);
    int64_t last = start + 6 < T0 / 1000 + 39 ? start + 6 : T0 / 1000 + 39;
    EXPECT_I64(start, h[k].t);
    EXPECT_I64(2 * (last - T0 / 1000 + 1), h[k].value);
  }
  tally_schedule_free(all);
  tally_schedule_free(lb);
  tally_counter_close(a);
  tally_counter_close(b);
  tally_store_close(s);
}

int main(void) {
  snprintf(g_dir, sizeof g_dir, "%s", tu_tmpdir("rollup"));
  char spec[1200];
  test_bad_schedules();
  test_records_and_history("memory");
  tu_spec(spec, sizeof spec, NULL, 0, g_dir, "records.tly");
  test_records_and_history(spec);
  test_ring_shapes_in_one_tick();
  test_readers();
  test_stalled_holder();
  test_dead_holder();
  test_resume_after_other_schedule();
  test_stalled_past_period();
  test_clocks_apart();
  test_torn_block();
  test_damaged_block();
  tu_rmrf(g_dir);
  return tu_finish("test_rollup");
}
