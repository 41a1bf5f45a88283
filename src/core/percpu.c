/* percpu.c -- the cpu policy: per-CPU cells written by restartable sequences.
 *
 * The increment is inline (percpu.h). A per-CPU cell has exactly one
 * kind of writer, a sequence on its CPU, which stores without a locked
 * instruction; so nothing else may write it while a sequence could be
 * between its load and its store:
 *
 *  - reset leaves the per-CPU cells alone. Under the store lock it takes
 *    the thread policy's cells with a compare-and-swap each, as every
 *    reset does, and moves the per-CPU cells' sum since the last reset
 *    into shard 0, which holds minus their sum at the last reset (one
 *    store: only resets, under the lock, write it);
 *  - a move (drop, expiry) raises the store's cpu fence, which every
 *    sequence reads, then runs on each CPU in turn (sched_setaffinity):
 *    a sequence that read the fence down and was still running when the
 *    mover took its CPU was preempted, so the kernel aborts it. Then the
 *    journal retires the cells as it retires any, and no sequence writes
 *    a retired cell (each checks the value it loaded is live).
 *
 * Why that is exact: docs/design.md, "The cpu policy".
 */
#include "percpu.h"

#include <dirent.h>
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/sysinfo.h>

int tally__rseq_on;
#ifdef TALLY_TEST_SEAMS
unsigned tally__test_rseq_spin;
#endif

void tally__cpu_init(void) {
#if TALLY__RSEQ
  tally__rseq_on = __rseq_size > 0;
#endif
}

uint32_t tally_cpu_shards(void) {
  int p = get_nprocs_conf();
  if (p < 1) p = 1;
  if (p > (TALLY_MAX_SHARDS - 1) / 2) p = (TALLY_MAX_SHARDS - 1) / 2;
  return 2 * (uint32_t)p + 1;
}

/* This thread's CPU as its rseq area says, or a value >= 2^32 - 2 where
 * it has none (-1: not registered, -2: registration failed). */
static uint32_t rseq_cpu(void) {
#if TALLY__RSEQ
  uint32_t cpu;
  if (!tally__rseq_on) return UINT32_MAX;
  __asm__ volatile("movl %%fs:4(%1), %0" : "=r"(cpu) : "r"(__rseq_offset));
  return cpu;
#else
  return UINT32_MAX;
#endif
}

bool tally__cpu_rseq_here(void) {
  return rseq_cpu() < UINT32_MAX - 1;
}

void tally__cpu_seen(tally_counter *c) {
  uint32_t cpu = rseq_cpu();
  uint64_t loc = atomic_load_explicit(&c->loc, memory_order_acquire);
  if (cpu >= (tally__loc_shards(loc) - 1) / 2) return; /* no shard, or no rseq */
  _Atomic uint64_t *w = &c->s->hdr->cpu_seen[cpu / 64];
  uint64_t bit = UINT64_C(1) << (cpu % 64);
  /* seq_cst, a full barrier: a mover that raised the fence before this
   * and read the bits without it, is seen up by the next sequence here */
  if (!(atomic_load_explicit(w, memory_order_relaxed) & bit)) atomic_fetch_or(w, bit);
}

/* ---- the fence ---------------------------------------------------------- */

/* Is cpu online? /sys/devices/system/cpu/online lists ranges ("0-3,6").
 * Unreadable: say yes, so the caller refuses rather than skips it. */
static bool online(uint32_t cpu) {
  char buf[4096];
  FILE *f = fopen("/sys/devices/system/cpu/online", "re");
  if (!f) return true;
  size_t len = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[len] = '\0';
  for (char *at = buf, *end; *at >= '0' && *at <= '9'; at = end + 1) {
    unsigned long a = strtoul(at, &end, 10), b = a;
    if (*end == '-') b = strtoul(end + 1, &end, 10);
    if (cpu >= a && cpu <= b) return true;
    if (*end != ',') break;
  }
  return false;
}

/* May a thread of a process that has the store open (this one too) run
 * on cpu? Each thread's affinity (/proc/PID/task, sched_getaffinity; a
 * cpuset bounds it), read after the fence went up: a thread that had a
 * sequence under way on cpu had cpu in its mask, and one that gets cpu
 * into its mask later starts its sequences after the fence. Yes when
 * something cannot be read (a forked child without its slot yet, a
 * hidden /proc): the caller then refuses. Processes share one pid
 * namespace, as the process table assumes (grace.c). */
static bool reachable(tally_store *s, uint32_t cpu, size_t size, cpu_set_t *mask,
                      int64_t *who) {
  int64_t pids[64];
  int n = tally__grace_pids(s, pids, 64);
  if (n < 0 || n > 64) return true;
  for (int i = 0; i < n; i++) {
    char dir[64];
    snprintf(dir, sizeof dir, "/proc/%lld/task", (long long)pids[i]);
    DIR *d = opendir(dir);
    if (!d) {
      if (errno == ENOENT) continue; /* gone since */
      *who = pids[i];
      return true;
    }
    bool yes = false;
    for (struct dirent *e; !yes && (e = readdir(d)) != NULL;) {
      if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
      pid_t tid = (pid_t)strtol(e->d_name, NULL, 10);
      if (sched_getaffinity(tid, size, mask) != 0)
        yes = errno != ESRCH; /* a thread gone since: nothing to fear */
      else
        yes = CPU_ISSET_S(cpu, size, mask);
    }
    closedir(d);
    if (yes) {
      *who = pids[i];
      return true;
    }
  }
  return false;
}

/* Run once on each of CPUs 0..p-1 that sequences ran on (cpu_seen, read
 * after the fence went up). A CPU this thread may not run on is passed
 * over if it is offline (no sequence runs there; one that did was
 * migrated, hence aborted) or unreachable to every process that has the
 * store open (its bit is cleared: a sequence there would set it again
 * first), else TALLY_EBUSY. The affinity is restored. */
static int pass(tally_store *s, uint32_t p) {
  int n = get_nprocs_conf();
  size_t cpus = (size_t)(n > (int)p ? n : (int)p) + 1024; /* room for any mask */
  size_t size = CPU_ALLOC_SIZE(cpus);
  cpu_set_t *old = CPU_ALLOC(cpus), *one = CPU_ALLOC(cpus);
  int rc = 0;
  if (!old || !one) {
    rc = tally__fail(TALLY_ENOMEM, "out of memory");
    goto out;
  }
  if (sched_getaffinity(0, size, old) != 0) {
    rc = tally__fail_sys("sched_getaffinity", NULL);
    goto out;
  }
  for (uint32_t cpu = 0; cpu < p && rc == 0; cpu++) {
    _Atomic uint64_t *w = &s->hdr->cpu_seen[cpu / 64];
    uint64_t bit = UINT64_C(1) << (cpu % 64);
    int64_t who = 0;
    if (!(atomic_load(w) & bit)) continue; /* no sequence ran there */
    CPU_ZERO_S(size, one);
    CPU_SET_S(cpu, size, one);
    if (sched_setaffinity(0, size, one) != 0) {
      if (errno == EINVAL && !online(cpu)) continue;
      if (errno == EINVAL && !reachable(s, cpu, size, one, &who)) {
        atomic_fetch_and(w, ~bit);
        continue;
      }
      rc = tally__fail(TALLY_EBUSY,
                       "cannot run on CPU %u to fence the cpu policy's cells, where "
                       "process %lld may run (another cpuset?): the move is refused",
                       cpu, (long long)who);
      break;
    }
    /* the kernel migrates the caller before sched_setaffinity returns;
     * make sure, since the argument rests on it */
    for (int i = 0; sched_getcpu() != (int)cpu; i++) {
      if (i == 1000) {
        rc = tally__fail(TALLY_EBUSY, "could not move to CPU %u to fence cpu cells", cpu);
        break;
      }
      sched_yield();
    }
  }
  (void)sched_setaffinity(0, size, old);
out:
  CPU_FREE(old);
  CPU_FREE(one);
  return rc;
}

int tally__cpu_fence(tally_store *s, uint32_t nshards) {
  /* seq_cst: the store is visible before this thread leaves its CPU */
  atomic_store(&s->hdr->cpu_fence, 1);
  int rc = pass(s, (nshards - 1) / 2);
  if (rc) tally__cpu_unfence(s);
  return rc;
}

void tally__cpu_unfence(tally_store *s) {
  if (atomic_load_explicit(&s->hdr->cpu_fence, memory_order_relaxed))
    atomic_store(&s->hdr->cpu_fence, 0);
}

/* ---- reset -------------------------------------------------------------- */

static void give_back(tally_store *s, uint64_t loc, const int64_t *taken, uint32_t upto) {
  for (uint32_t i = 1; i < upto; i++)
    if (taken[i]) atomic_fetch_add(tally__cell_at(s, loc, i), taken[i]);
}

static int reset_locked(tally_store *s, uint64_t rec_off, uint64_t loc, const char *name,
                        int64_t *removed) {
  uint32_t n = tally__loc_shards(loc), p = (n - 1) / 2;
  int64_t taken[TALLY_MAX_SHARDS];
  __int128 total = 0, sum = 0;
  _Atomic int64_t *base = tally__cell_at(s, loc, 0);
  int64_t b = atomic_load_explicit(base, memory_order_relaxed);
  int rc = 0;
  if (n < 3 || !tally__cell_live(b)) return tally__cell_damage(s, rec_off, 0, b);
  /* the thread policy's cells: a compare-and-swap each, as any reset */
  for (uint32_t i = 1; i <= p && rc == 0; i++) {
    _Atomic int64_t *cell = tally__cell_at(s, loc, i);
    int64_t v = atomic_load_explicit(cell, memory_order_relaxed);
    taken[i] = 0;
    for (;;) {
      if ((rc = tally__cell_wait(s, cell, rec_off, i, &v))) break;
      if (!tally__cell_live(v)) { /* retired, with no move pending: damage */
        rc = tally__cell_damage(s, rec_off, i, v);
        break;
      }
      if (atomic_compare_exchange_weak_explicit(cell, &v, 0, memory_order_relaxed,
                                                memory_order_relaxed)) {
        taken[i] = v;
        total += v;
        break;
      }
    }
    if (rc) give_back(s, loc, taken, i);
  }
  if (rc) return rc;
  /* the per-CPU cells: read, never written here */
  for (uint32_t i = p + 1; i < n; i++) {
    int64_t v = atomic_load_explicit(tally__cell_at(s, loc, i), memory_order_acquire);
    if (!tally__cell_live(v)) {
      give_back(s, loc, taken, p + 1);
      return tally__cell_damage(s, rec_off, i, v);
    }
    sum += v;
  }
  total += sum + b; /* shard 0 holds minus the sum at the last reset */
  if (total > INT64_MAX || total < INT64_MIN || sum >= (__int128)1 << 62 ||
      sum < -((__int128)1 << 62) + 1) {
    give_back(s, loc, taken, p + 1);
    return tally__fail(TALLY_ERANGE,
                       "counter '%s': the amount to remove does not fit in 64 "
                       "bits; nothing was removed",
                       name);
  }
  /* release: a reader that sees it reads the per-CPU cells after it, so
   * at least what was summed here */
  atomic_store_explicit(base, (int64_t)-sum, memory_order_release);
  *removed = (int64_t)total;
  return 0;
}

int tally__cpu_reset(tally_counter *c, int64_t *removed) {
  tally_store *s = c->s;
  uint64_t loc = 0;
  int rc = tally__lock(s);
  if (rc) return rc;
  rc = tally__current(s, tally__crec(c), &loc);
  if (rc == 0) rc = reset_locked(s, tally__crec(c), loc, c->name, removed);
  tally__unlock(s);
  if (rc == 0) tally__handle_set_loc(c, loc);
  return rc;
}
