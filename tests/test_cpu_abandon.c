/* test_cpu_abandon.c -- a mover of a cpu counter killed between retiring
 * its cell 0 and recording that it did (pend_done still 0), while holding
 * the store lock; the next lock holder cannot run on CPU 1 (a cpuset,
 * simulated: sched_setaffinity to CPU 1 alone fails with EINVAL, as the
 * kernel answers for a CPU outside the cpuset), so it cannot finish the
 * move. The counter must read its value, exactly, and drop once the
 * restriction is gone: the taken-over move gives cell 0 back.
 */
#include <errno.h>
#include <sched.h>
#include <sys/wait.h>

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

int main(void) {
  char spec[1200];
  tally_store *s = NULL;
  tally_counter *c = NULL;
  int64_t v = 0, removed = 0;
  tu_spec(spec, sizeof spec, NULL, 0, tu_tmpdir("cpu-abandon"), "abandon.tly");
  if (sysconf(_SC_NPROCESSORS_ONLN) < 2) {
    printf("  one CPU: no CPU to be kept from; skipped\n");
    return tu_finish("test_cpu_abandon");
  }
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  tally_counter_options o = {0, TALLY_POLICY_CPU};
  REQUIRE_OK(tally_counter_open(s, "x", 1, &o, TALLY_COUNTER_CREATE, &c));
  for (int i = 0; i < 10; i++) EXPECT_OK(tally_counter_incr(c, 1));
  EXPECT_OK(tally_counter_reset(c, &removed)); /* shard 0 gets what it moves */
  for (int i = 0; i < 3; i++) EXPECT_OK(tally_counter_incr(c, 1));
  EXPECT_OK(tally_counter_value(c, &v));
  EXPECT(v == 3);
  uint64_t loc = atomic_load(&c->loc);
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
  EXPECT_OK(tally_counter_value(c, &v));
  EXPECT(v == 3);
  EXPECT_OK(tally_store_check(s));
  tally_counter_close(c);
  EXPECT_OK(tally_store_drop(s, "x", 1));
  tally_store_close(s);
  return tu_finish("test_cpu_abandon");
}
