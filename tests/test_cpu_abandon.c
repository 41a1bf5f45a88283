/* test_cpu_abandon.c -- cpu counters in a cpuset, simulated: with
 * `restricted` set, this process is in a cpuset without CPU 1:
 * sched_setaffinity to CPU 1 alone fails with EINVAL, as the kernel
 * answers for a CPU outside the cpuset, and its threads' affinity lacks
 * CPU 1 (sched_getaffinity); other processes keep theirs.
 *
 *  - a store whose sequences ran on CPU 0 only moves its counters (the
 *    mover passes the CPUs sequences ran on, not every CPU);
 *  - one whose sequences ran on CPU 1 too: refused while another process
 *    that may run on CPU 1 has the store open, done once it may not (or
 *    is gone), and done with the store open twice in this process;
 *  - a mover of a cpu counter killed between retiring its cell 0 and
 *    recording that it did (pend_done still 0), while holding the store
 *    lock, where the next lock holder cannot run on CPU 1 and another
 *    process has the store open, so it cannot finish the move: the
 *    counter must read its value, exactly, and drop once the restriction
 *    is gone: the taken-over move gives cell 0 back.
 */
#include <errno.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../src/core/internal.h" /* the pending move, the journal */
#include "testutil.h"

static int restricted;
int __real_sched_setaffinity(pid_t p, size_t n, const cpu_set_t *m);
int __wrap_sched_setaffinity(pid_t p, size_t n, const cpu_set_t *m) {
  if (restricted && CPU_ISSET_S(1, n, m) && CPU_COUNT_S(n, m) == 1) {
    errno = EINVAL;
    return -1;
  }
  return __real_sched_setaffinity(p, n, m);
}

/* a thread of this process: its affinity is bounded by the cpuset */
static int mine(pid_t tid) {
  char path[64];
  snprintf(path, sizeof path, "/proc/self/task/%d", (int)tid);
  return tid == 0 || access(path, F_OK) == 0;
}

int __real_sched_getaffinity(pid_t p, size_t n, cpu_set_t *m);
int __wrap_sched_getaffinity(pid_t p, size_t n, cpu_set_t *m) {
  int rc = __real_sched_getaffinity(p, n, m);
  if (rc == 0 && restricted && mine(p)) CPU_CLR_S(1, n, m);
  return rc;
}

/* Run this thread on cpu alone (not under the restriction). */
static int try_pin(int cpu) {
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  return __real_sched_setaffinity(0, sizeof one, &one);
}

static void pin(int cpu) {
  if (try_pin(cpu) != 0) TU_FAIL("pin to CPU %d", cpu);
}

static void unpin(void) {
  cpu_set_t all;
  CPU_ZERO(&all);
  for (int i = 0; i < 2; i++) CPU_SET(i, &all);
  (void)__real_sched_setaffinity(0, sizeof all, &all);
}

/* A process with the store open until `done` is written to (on CPU 0
 * alone when cpu0 is set); its pid. */
static pid_t holder(const char *spec, int *done, int cpu0) {
  int fds[2], ready[2];
  char c;
  if (pipe(fds) != 0 || pipe(ready) != 0) TU_FAIL("pipe");
  pid_t pid = fork();
  if (pid == 0) {
    tally_store *s = NULL;
    close(fds[1]);
    close(ready[0]);
    if (cpu0) pin(0);
    if (tally_store_open(spec, NULL, &s)) _exit(2);
    if (write(ready[1], "r", 1) != 1) _exit(2); /* open, its slot taken */
    ssize_t n = read(fds[0], &c, 1);            /* until the parent says */
    (void)n;
    tally_store_close(s);
    _exit(0);
  }
  close(fds[0]);
  close(ready[1]);
  if (read(ready[0], &c, 1) != 1) TU_FAIL("the holder did not open the store");
  close(ready[0]);
  *done = fds[1];
  return pid;
}

static void release(pid_t pid, int done) {
  int st = 0;
  close(done);
  waitpid(pid, &st, 0);
  EXPECT(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

/* n increments of x on cpu, then its value */
static int64_t count_on(tally_counter *c, int cpu, int n) {
  int64_t v = 0;
  pin(cpu);
  for (int i = 0; i < n; i++) EXPECT_OK(tally_counter_incr(c, 1));
  unpin();
  EXPECT_OK(tally_counter_value(c, &v));
  return v;
}

static void test_cpuset(const char *spec) {
  tally_store *s = NULL;
  tally_counter *c = NULL;
  tally_counter_options o = {0, TALLY_POLICY_CPU};
  int done;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  /* within the cpuset: no sequence ran on CPU 1, the drop passes CPU 0 */
  REQUIRE_OK(tally_counter_open(s, "in", 2, &o, TALLY_COUNTER_CREATE, &c));
  EXPECT(count_on(c, 0, 10) == 10);
  EXPECT(atomic_load(&s->hdr->cpu_seen[0]) == 1); /* CPU 0's bit only */
  pid_t pid = holder(spec, &done, 0);
  restricted = 1;
  int rc = tally_store_drop(s, "in", 2);
  if (rc) TU_FAIL("a drop within the cpuset: %s", tally_errmsg());
  restricted = 0;
  release(pid, done);
  tally_counter_close(c);
  /* CPU 1 ran sequences: refused while another process may run there */
  REQUIRE_OK(tally_counter_open(s, "out", 3, &o, TALLY_COUNTER_CREATE, &c));
  EXPECT(count_on(c, 0, 5) + count_on(c, 1, 5) == 15); /* 5, then 10 */
  EXPECT(atomic_load(&s->hdr->cpu_seen[0]) == 3);
  pid = holder(spec, &done, 0);
  restricted = 1;
  EXPECT_RC(TALLY_EBUSY, tally_store_drop(s, "out", 3));
  int64_t v = 0;
  EXPECT_OK(tally_counter_value(c, &v)); /* nothing lost to the refusal */
  EXPECT(v == 10);
  restricted = 0;
  release(pid, done);
  /* beside a process that may not run there either, it is done, and CPU 1
   * no longer counts as run on */
  pid = holder(spec, &done, 1);
  restricted = 1;
  rc = tally_store_drop(s, "out", 3);
  if (rc) TU_FAIL("a drop in a narrower cpuset: %s", tally_errmsg());
  restricted = 0;
  release(pid, done);
  EXPECT(atomic_load(&s->hdr->cpu_seen[0]) == 1);
  tally_counter_close(c);
  /* the store open twice in this process: no other process */
  tally_store *s2 = NULL;
  REQUIRE_OK(tally_store_open(spec, NULL, &s2));
  REQUIRE_OK(tally_counter_open(s, "two", 3, &o, TALLY_COUNTER_CREATE, &c));
  EXPECT(count_on(c, 1, 5) == 5);
  restricted = 1;
  rc = tally_store_drop(s, "two", 3);
  if (rc) TU_FAIL("a drop with the store open twice here: %s", tally_errmsg());
  restricted = 0;
  tally_counter_close(c);
  tally_store_close(s2);
  EXPECT_OK(tally_store_check(s));
  tally_store_close(s);
}

static void test_abandon(const char *spec) {
  tally_store *s = NULL;
  tally_counter *c = NULL;
  int64_t v = 0, removed = 0;
  int done;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  tally_counter_options o = {0, TALLY_POLICY_CPU};
  REQUIRE_OK(tally_counter_open(s, "x", 1, &o, TALLY_COUNTER_CREATE, &c));
  EXPECT(count_on(c, 1, 10) == 10);            /* sequences ran on CPU 1 */
  EXPECT_OK(tally_counter_reset(c, &removed)); /* shard 0 gets what it moves */
  for (int i = 0; i < 3; i++) EXPECT_OK(tally_counter_incr(c, 1));
  EXPECT_OK(tally_counter_value(c, &v));
  EXPECT(v == 3);
  uint64_t loc = atomic_load(&c->loc);
  /* a process that may run on CPU 1 has the store open (idle: it takes
   * nothing over), so the move must wait */
  pid_t other = holder(spec, &done, 0);
  pid_t pid = fork();
  if (pid == 0) { /* tally_store_drop up to retire(cell 0), then gone */
    tally__lock(s);
    uint64_t rec_off = tally__crec(c), cells;
    uint32_t n;
    bool dropped;
    tally__loc_decode(s, rec_off, loc, &cells, &n, &dropped);
    uint64_t to = tally__loc_make(s, rec_off, cells, n, true);
    tally__journal_ready(s);
    atomic_store(&s->hdr->pend_cond, 0);
    atomic_store(&s->hdr->pend_done, 0);
    atomic_store(&s->hdr->pend_loc, to);
    atomic_store(&s->hdr->pend_rec, tally__seal(s, TALLY__SEAL_MOVE, rec_off, to));
    if (tally__cpu_fence(s, n)) _exit(2); /* unrestricted: it passes */
    _Atomic int64_t *cell0 = tally__cell_at(s, loc, 0);
    int64_t raw = atomic_load(cell0);
    atomic_store(&s->journal[0], raw);
    atomic_compare_exchange_strong(cell0, &raw, TALLY__SENTINEL);
    _exit(0); /* as if SIGKILLed: pend_done still 0, the lock held */
  }
  int st = 0;
  waitpid(pid, &st, 0);
  EXPECT(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  restricted = 1;
  int rc = tally_counter_value(c, &v);
  if (rc) TU_FAIL("the value after the takeover: %s", tally_errmsg());
  EXPECT(v == 3);
  restricted = 0;
  release(other, done);
  EXPECT_OK(tally_counter_value(c, &v));
  EXPECT(v == 3);
  EXPECT_OK(tally_store_check(s));
  tally_counter_close(c);
  EXPECT_OK(tally_store_drop(s, "x", 1));
  tally_store_close(s);
}

int main(void) {
  char spec[1200], spec2[1200];
  if (sysconf(_SC_NPROCESSORS_ONLN) < 2) {
    printf("  one CPU: no CPU to be kept from; skipped\n");
    return tu_finish("test_cpu_abandon");
  }
  if (try_pin(0) != 0 || try_pin(1) != 0) {
    printf("  CPU 0 or 1 is not ours to run on: skipped\n");
    return tu_finish("test_cpu_abandon");
  }
  unpin();
  tally__policy_init();
  if (!tally__cpu_rseq_here()) {
    printf("  no rseq here: the cpu policy takes the thread path; skipped\n");
    return tu_finish("test_cpu_abandon");
  }
  tu_spec(spec, sizeof spec, NULL, 0, tu_tmpdir("cpu-abandon"), "cpuset.tly");
  test_cpuset(spec);
  tu_spec(spec2, sizeof spec2, NULL, 0, tu_tmpdir("cpu-abandon"), "abandon.tly");
  test_abandon(spec2);
  return tu_finish("test_cpu_abandon");
}
