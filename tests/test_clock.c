/* test_clock.c -- what the library does with time, on a clock this test
 * controls. It is linked with -Wl,--wrap=tally_monotonic_ms
 * (tests/CMakeLists.txt), so every read the library's other objects make
 * of the monotonic clock in ms comes to fake_ms below, frozen where the
 * test sets it.
 *
 *  - automatic shards' quiet time: upkeep shrinks a counter no sooner than
 *    TALLY_AUTO_QUIET_MS after its last contention, and within 4.1 s more
 *    (it shrank up to 2 s early, and one busy counter every other second);
 *  - two writers whose thread tickets are 65535 and 65536 are two writers
 *    on one cell, and grow it (a 16-bit field made the first "nobody");
 *  - a process-table slot reserved for a child after a grace step read the
 *    clock is young, not 2^31 ms old, and is not freed under the child;
 *  - after a reboot (the monotonic clock starts again from 0), a schedule's
 *    lease from the boot before neither holds the schedule nor holds idle
 *    counters back for that boot's uptime;
 *  - a rollup at time 0 is a previous rollup: the next one has a rate.
 */
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>

#include "testutil.h"

#include "../src/core/internal.h" /* the store's header and grace.c's fork halves */

static _Atomic int64_t fake_ms = -1; /* -1: the real clock */

int64_t __real_tally_monotonic_ms(void);
int64_t __wrap_tally_monotonic_ms(void);
int64_t __wrap_tally_monotonic_ms(void) {
  int64_t v = atomic_load(&fake_ms);
  return v < 0 ? __real_tally_monotonic_ms() : v;
}

static char g_dir[1024];

/* ---- two writers on one counter, with the clock frozen ------------------- */

struct hammer {
  tally_counter *c;
  atomic_bool *stop;
  long long n;
};

static void *hammer_main(void *ud) {
  struct hammer *h = ud;
  double end = tu_now() + 5;
  while (!atomic_load(h->stop) && tu_now() < end)
    for (int k = 0; k < 4096; k++)
      if (tally_counter_incr(h->c, 1) == 0) h->n++;
  return NULL;
}

/* Hammer c from two threads until it has grown (5 s at most); its shards. */
static uint32_t contend(tally_counter *c, long long *added) {
  atomic_bool stop = false;
  struct hammer h[2] = {{c, &stop, 0}, {c, &stop, 0}};
  pthread_t th[2];
  for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, hammer_main, &h[i]);
  tally_counter_info in = {0};
  for (double end = tu_now() + 5; tu_now() < end && in.shards < 2;) {
    usleep(1000);
    EXPECT_OK(tally_counter_info_get(c, &in));
  }
  atomic_store(&stop, true);
  for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
  *added += h[0].n + h[1].n;
  return in.shards;
}

/* TALLY_AUTO_QUIET_MS is 5000 (main): from the last contention at t0, upkeep
 * every 16 ms of the clock must leave the counter grown for 5000 ms, and
 * shrink it by 5000 + 4096. t0 at three places within a 2048 ms unit. */
static void test_quiet_time(void) {
  static const int64_t offsets[] = {0, 1023, 2047};
  for (int k = 0; k < 3; k++) {
    tally_store *s;
    tally_counter *c;
    REQUIRE_OK(tally_store_open("memory", NULL, &s));
    REQUIRE_OK(tu_counter(s, "q", TALLY_SHARDS_AUTO, TALLY_POLICY_THREAD,
                          TALLY_COUNTER_CREATE, &c));
    int64_t t0 = INT64_C(1) << 30 | offsets[k];
    long long added = 0;
    atomic_store(&fake_ms, t0);
    uint32_t grown = contend(c, &added);
    EXPECT_I64(2, grown);
    int64_t shrunk_at = -1;
    for (int64_t t = t0; t <= t0 + 10000 && shrunk_at < 0; t += 16) {
      atomic_store(&fake_ms, t);
      EXPECT_OK(tally_store_maintain(s, 1000, 1000, NULL));
      tally_counter_info in;
      EXPECT_OK(tally_counter_info_get(c, &in));
      if (in.shards == 1) shrunk_at = t - t0;
    }
    printf("  quiet time 5000 ms, last contention at unit offset %lld: shrunk %lld ms "
           "after\n",
           (long long)offsets[k], (long long)shrunk_at);
    EXPECT(shrunk_at >= 5000);
    EXPECT(shrunk_at <= 5000 + 4096 + 16);
    EXPECT_I64(added, tu_value(c));
    tally_counter_close(c);
    tally_store_close(s);
  }
  atomic_store(&fake_ms, -1);
}

/* Writers with tickets 65535 and 65536 (the store's ticket counter set
 * before they draw) on one cell of a new counter. */
static void test_ticket_65535(void) {
  tally_store *s;
  tally_counter *c;
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  REQUIRE_OK(tu_counter(s, "t", TALLY_SHARDS_AUTO, TALLY_POLICY_THREAD,
                        TALLY_COUNTER_CREATE, &c));
  atomic_store(&s->hdr->writers, 65535);
  atomic_store(&fake_ms, INT64_C(1) << 30); /* frozen: every sample is near */
  long long added = 0;
  uint32_t shards = contend(c, &added);
  atomic_store(&fake_ms, -1);
  printf("  tickets 65535 and 65536 on one cell: %u shards\n", shards);
  EXPECT_I64(2, shards);
  EXPECT_I64(65537, atomic_load(&s->hdr->writers));
  EXPECT_I64(added, tu_value(c));
  tally_counter_close(c);
  tally_store_close(s);
}

/* ---- a child's slot, reserved after a grace step read the clock ----------- */

static int processes(tally_store *s) {
  tally_grace_info gi;
  EXPECT_OK(tally_store_grace(s, &gi));
  return (int)gi.processes;
}

/* Reserve a slot for a child as fork() does, with the clock at `at`. */
static void reserve_at(tally_store *s, int64_t at) {
  atomic_store(&fake_ms, at);
  tally__grace_fork_prepare(s);
  tally__grace_fork_parent(s, false);
}

static void test_reserved_ahead(void) {
  char spec[1200];
  tally_store *s;
  tu_spec(spec, sizeof spec, NULL, 0, g_dir, "reserve.tly");
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  int64_t t = INT64_C(1) << 31; /* past 2^31 ms: the stamps wrap */
  atomic_store(&fake_ms, t);
  EXPECT_I64(1, processes(s));
  /* a step that read the clock 5 ms before the reservation was made */
  reserve_at(s, t + 5);
  atomic_store(&fake_ms, t);
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  EXPECT_I64(2, processes(s)); /* the child's: kept */
  /* never taken: free 10 s on */
  atomic_store(&fake_ms, t + 5 + 10001);
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  EXPECT_I64(1, processes(s));
  /* one stamped far ahead (another boot's clock) is not held for long */
  reserve_at(s, t + 3600000);
  atomic_store(&fake_ms, t + 20000);
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  EXPECT_I64(1, processes(s));
  atomic_store(&fake_ms, -1);
  tally_store_close(s);
}

/* ---- schedules across a reboot -------------------------------------------- */

#define WALL0  INT64_C(1764000000000) /* the caller's clock, ms */
#define BOOT1  INT64_C(2592000000)    /* 30 days up: boot 1's monotonic ms */
#define BOOT2  INT64_C(3600000)       /* 1 hour up: boot 2's */
#define DAY_MS INT64_C(86400000)

/* Boot 1's holder: it stops inside its tick, lease held (its pid stays
 * alive, as a pid that another process took after the reboot would). */
static void stop_in_tick(void *ud, const char *name, size_t len, const tally_rollup *r) {
  (void)ud, (void)name, (void)len, (void)r;
  raise(SIGSTOP);
}

static int boot1_holder(const char *spec) {
  tally_store *s;
  tally_schedule *sch;
  tally_tick_result res;
  alarm(60);
  atomic_store(&fake_ms, BOOT1);
  if (tally_store_open(spec, NULL, &s) ||
      tally_schedule_new(s, "req:*", 5, 1000, NULL, 0, &sch) ||
      tally_schedule_tick(sch, WALL0, stop_in_tick, NULL, &res))
    return 1;
  return 0;
}

static void test_reboot(void) {
  char spec[1200];
  tally_store *s;
  tally_schedule *sch;
  tally_tick_result res;
  tu_spec(spec, sizeof spec, NULL, 0, g_dir, "reboot.tly");
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  EXPECT_OK(tally_store_incr(s, "req:a", 5, 1, TALLY_COUNTER_CREATE));

  /* the lease: taken over in boot 2, not held for boot 1's uptime */
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) _exit(boot1_holder(spec));
  int st = 0;
  EXPECT(pid > 0 && waitpid(pid, &st, WUNTRACED) == pid && WIFSTOPPED(st));
  atomic_store(&fake_ms, BOOT2);
  REQUIRE_OK(tally_schedule_new(s, "req:*", 5, 1000, NULL, 0, &sch));
  int busy = 0;
  for (int i = 0; i < 5; i++) {
    atomic_store(&fake_ms, BOOT2 + i * 1000);
    EXPECT_OK(tally_schedule_tick(sch, WALL0 + DAY_MS + i * 1000, NULL, NULL, &res));
    if (res.status != TALLY_TICK_BUSY) break;
    busy++;
  }
  printf("  boot 2: boot 1's stalled holder kept the lease for %d ticks of 1 s\n", busy);
  EXPECT(busy <= 1);
  EXPECT_I64(TALLY_TICK_RAN, res.status);
  tally_schedule_free(sch);
  if (pid > 0) {
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
  }

  /* idle expiry in boot 2: a schedule boot 1 ran and boot 2 does not (its
   * last lease ends at boot 1's uptime) holds no idle counter back */
  atomic_store(&fake_ms, BOOT1);
  REQUIRE_OK(tally_schedule_new(s, "old:*", 5, 1000, NULL, 0, &sch));
  EXPECT_OK(tally_schedule_tick(sch, WALL0, NULL, NULL, &res));
  EXPECT_I64(TALLY_TICK_RAN, res.status);
  tally_schedule_free(sch);
  tally_family_options fo = {1, -1, 10, 0}; /* idle 10 s */
  EXPECT_OK(tally_family_define(s, "client:*", 8, &fo));
  EXPECT_OK(tally_store_incr(s, "client:1", 8, 1, TALLY_COUNTER_CREATE));
  int64_t expired_after = -1;
  for (int i = 0; i <= 60 && expired_after < 0; i++) {
    atomic_store(&fake_ms, BOOT2 + i * 1000);
    tally_maintain_result mr;
    EXPECT_OK(tally_store_maintain(s, WALL0 + DAY_MS + i * 1000, 4096, &mr));
    if (mr.expired) expired_after = i;
  }
  printf("  boot 2: a counter idle 10 s expired after %lld s of upkeep\n",
         (long long)expired_after);
  EXPECT(expired_after >= 10 && expired_after <= 12);
  atomic_store(&fake_ms, -1);
  tally_store_close(s);
}

/* ---- a rollup at time 0 ------------------------------------------------------ */

static double g_rate = -1;
static uint64_t g_count;

static void keep_rate(void *ud, const char *name, size_t len, const tally_rollup *r) {
  (void)ud, (void)name, (void)len;
  g_rate = tally_rollup_rate(r);
  g_count = r->count;
}

static void test_rate_after_zero(void) {
  tally_store *s;
  tally_schedule *sch;
  tally_tick_result res;
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  REQUIRE_OK(tally_schedule_new(s, "r:*", 3, 1000, NULL, 0, &sch));
  EXPECT_OK(tally_store_incr(s, "r:a", 3, 1, TALLY_COUNTER_CREATE));
  EXPECT_OK(tally_schedule_tick(sch, 0, keep_rate, NULL, &res));
  EXPECT_I64(1, g_count);
  EXPECT(g_rate == 0.0); /* the first */
  EXPECT_OK(tally_store_incr(s, "r:a", 3, 5, 0));
  EXPECT_OK(tally_schedule_tick(sch, 1000, keep_rate, NULL, &res));
  EXPECT_I64(2, g_count);
  printf("  rollups at 0 and 1000 ms, 5 between: rate %.1f/s\n", g_rate);
  EXPECT(g_rate == 5.0);
  tally_schedule_free(sch);
  tally_store_close(s);
}

int main(void) {
  /* read once per process, at the first upkeep that looks */
  setenv("TALLY_AUTO_QUIET_MS", "5000", 1);
  setenv("TALLY_GRACE_MS", "0", 1);
  snprintf(g_dir, sizeof g_dir, "%s", tu_tmpdir("clock"));
  double t0 = tu_now();
  test_quiet_time();
  test_ticket_65535();
  test_reserved_ahead();
  test_reboot();
  test_rate_after_zero();
  printf("total %.2f s\n", tu_now() - t0);
  tu_rmrf(g_dir);
  return tu_finish("test_clock");
}
