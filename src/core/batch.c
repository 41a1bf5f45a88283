/* batch.c -- batched counters: increments that land together, and snapshots
 * that see them together, across threads and processes.
 *
 * A counter of policy TALLY_POLICY_SLOT has one shard per writer slot. A
 * thread leases a slot of the store (under the lock, once) and from then on
 * adds only to shard `slot` of such counters, so each of those cells has
 * exactly one writer. A batch is:
 *
 *   1. the journal: for each counter, its cell, the cell's value before
 *      (exact: nobody else writes it) and the delta;
 *   2. seq made odd; 3. the new values stored; 4. seq made even.
 *
 * Step 3 stores before + delta rather than adding: a cell with one writer
 * needs no locked add, and a locked add would wait for the journal's
 * stores to drain. Nobody else writes such a cell: a reset of a slot
 * counter subtracts in the resetter's own shard (tally__slot_reset), a
 * reader rolls back only a dead writer's batch. A drop that retires the
 * cells meanwhile may see its sentinel overwritten by that store; the
 * increment then counts for nothing, as any racing a drop, and the column
 * is zeroed when it is reused, after the grace period.
 *
 * A snapshot reads each slot's cells between two loads of its seq, as a
 * seqlock reader, and retries that slot if seq was odd or moved. So every
 * batch is seen wholly or not at all, and one thread's increments in their
 * order. Slots are read one after the other: the result is a consistent cut
 * (each writer's prefix), not one instant of a global clock.
 *
 * A writer that dies between 2 and 4 leaves seq odd. A reader waiting on it
 * checks every millisecond whether its thread still lives; when it does
 * not, it takes the lock and rolls the journal back: each cell is set from
 * before + delta to before (a compare-and-swap: an add the writer never
 * made is left as it is), then seq even, then the slot free. The journal
 * also names the counter's record, location word and incarnation, so a
 * cell that was dropped and reused meanwhile is never touched.
 *
 * A busy writer could starve a reader of a quiet window, so a reader that
 * failed four times on a slot sets the slot's hold_ms: the writer yields
 * (at most HOLD_MS, so a reader that dies holding it stalls nobody for
 * long) before its next batch.
 */
#include "observe.h" /* tally__journal_entry; and internal.h */

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define HOLD_MS      10 /* how long a reader's request to pause holds */
#define LIVENESS_MS  1  /* how often a waiting reader checks on the writer */
#define READ_RETRIES 4  /* optimistic reads of a slot before asking for a hold */
#define VALUES_AHEAD 8  /* a snapshot fetches this many counters' cells ahead */
#define SLOTS_BYTES  ((uint64_t)TALLY_SLOT_SHARDS * sizeof(struct tally__wslot))

_Static_assert(sizeof(struct tally__wslot) % 64 == 0, "writer slots fill whole lines");
_Static_assert(TALLY_SLOT_SHARDS <= TALLY_MAX_SHARDS, "a slot counter's shards fit");

/* ---- the slot table ------------------------------------------------------- */

static struct tally__wslot *slot_table(tally_store *s) {
  uint64_t off;
  if (tally__unseal(s, TALLY__SEAL_WSLOTS, atomic_load(&s->hdr->wslots), 0, &off) ||
      !off || !tally__in_arena(s, off, SLOTS_BYTES))
    return NULL;
  return tally__at(s, off);
}

/* The table, made on first use. Caller holds the lock. */
static int slot_table_make(tally_store *s, struct tally__wslot **out) {
  if ((*out = slot_table(s))) return 0;
  if (atomic_load(&s->hdr->wslots))
    return tally__fail(TALLY_ECORRUPT, "%s: tally store is corrupt (writer slots)",
                       tally__store_name(s));
  uint64_t off;
  int rc = tally__alloc(s, SLOTS_BYTES, &off);
  if (rc) return rc;
  memset(tally__at(s, off), 0, SLOTS_BYTES);
  atomic_store(&s->hdr->wslots, tally__seal(s, TALLY__SEAL_WSLOTS, off, 0));
  *out = tally__at(s, off);
  return 0;
}

static pid_t self_tid(void) {
  static _Thread_local pid_t tid, pid; /* a forked child's thread has a new tid */
  if (pid != tally__pid()) {
    pid = tally__pid();
    tid = (pid_t)syscall(SYS_gettid);
  }
  return tid;
}

/* Does the slot's thread still run? A pid reused by another process fails
 * the owner word's start-time check; a thread gone fails tgkill. */
static bool holder_alive(tally_store *s, const struct tally__wslot *sl) {
  uint64_t owner = atomic_load(&sl->owner);
  pid_t tid = (pid_t)atomic_load(&sl->tid);
  if (!owner) return false;
  /* a process that exec'd keeps its pid, its start time and, through the
   * thread that exec'd, the leader's tid, but not the file */
  if (!tally__attached(s, (pid_t)(owner >> 32)) || !tally__owner_alive(owner))
    return false;
  return syscall(SYS_tgkill, (pid_t)(owner >> 32), tid, 0) == 0 || errno == EPERM;
}

/* The dead writer's half-applied batch, undone. Caller holds the lock. */
static void roll_back(tally_store *s, struct tally__wslot *sl) {
  uint64_t seq = atomic_load_explicit(&sl->seq, memory_order_acquire);
  if (seq & 1) {
    uint64_t n = atomic_load(&sl->n);
    for (uint64_t k = 0; k < n && k < TALLY_BATCH_MAX; k++) {
      struct tally__wentry *e = &sl->e[k];
      uint64_t rec_off = atomic_load(&e->rec_off), cell_off = atomic_load(&e->cell_off);
      if (!tally__in_arena(s, rec_off, sizeof(struct tally__rec)) ||
          !tally__in_arena(s, cell_off, 8))
        continue; /* damaged: check() reports the store */
      const struct tally__rec *r = tally__at(s, rec_off);
      if (atomic_load(&r->loc) != atomic_load(&e->loc) ||
          r->incarnation != atomic_load(&e->incarnation))
        continue; /* dropped since: the cell is not this counter's any more */
      int64_t before = atomic_load(&e->before), after;
      if (__builtin_add_overflow(before, atomic_load(&e->delta), &after)) continue;
      atomic_compare_exchange_strong((_Atomic int64_t *)tally__at(s, cell_off), &after,
                                     before);
    }
    atomic_store_explicit(&sl->seq, seq + 1, memory_order_release);
  }
  atomic_store(&sl->tid, 0);
  atomic_store_explicit(&sl->owner, 0, memory_order_release);
}

void tally__slots_settle(tally_store *s) {
  struct tally__wslot *t = slot_table(s);
  if (!t) return;
  for (uint32_t w = 0; w < TALLY_SLOT_SHARDS; w++)
    if ((atomic_load_explicit(&t[w].seq, memory_order_acquire) & 1) &&
        !holder_alive(s, &t[w]))
      roll_back(s, &t[w]);
}

int tally__slots_recover(tally_store *s) {
  struct tally__wslot *t = slot_table(s);
  if (!t) return 0;
  for (uint32_t w = 0; w < TALLY_SLOT_SHARDS; w++)
    if (atomic_load(&t[w].owner) && !holder_alive(s, &t[w])) roll_back(s, &t[w]);
  return 0;
}

/* ---- this thread's slot --------------------------------------------------- */

/* A thread's record of its slot, the value of s->wkey. Each is also in
 * the list s->mine, so that the store's close gives back the slots of its
 * own threads (pthread_key_delete runs no destructor). */
struct tally__mine {
  tally_store *s;          /* NULL: its store closed (an orphan) */
  struct tally__wslot *sl; /* the slot: the table never moves while open */
  uint32_t slot;
  pid_t pid, tid;
  uint64_t owner;
  struct tally__mine *prev, *next; /* s->mine, or orphans */
};

/* Every store's records are under one lock: a thread's exit
 * (thread_exit, which glibc may be running already when the store closes
 * and deletes the key) races with the close. A record of a thread still
 * running at the close is kept as an orphan: that thread's exit runs no
 * destructor once the key is gone. */
static pthread_mutex_t mine_lock = PTHREAD_MUTEX_INITIALIZER;
static struct tally__mine *orphans;

static struct tally__mine **list_of_mine(struct tally__mine *m) {
  return m->s ? &m->s->mine : &orphans;
}

static void push_mine(struct tally__mine *m) { /* under mine_lock */
  struct tally__mine **head = list_of_mine(m);
  m->prev = NULL;
  m->next = *head;
  if (*head) (*head)->prev = m;
  *head = m;
}

static void unlink_mine(struct tally__mine *m) { /* under mine_lock */
  struct tally__mine **head = list_of_mine(m);
  if (m->prev)
    m->prev->next = m->next;
  else if (*head == m)
    *head = m->next;
  if (m->next) m->next->prev = m->prev;
}

static void link_mine(struct tally__mine *m) {
  pthread_mutex_lock(&mine_lock);
  push_mine(m);
  pthread_mutex_unlock(&mine_lock);
}

/* Unlink m and free it. */
static void free_mine(struct tally__mine *m) {
  if (!m) return;
  pthread_mutex_lock(&mine_lock);
  unlink_mine(m);
  pthread_mutex_unlock(&mine_lock);
  free(m);
}

static void give_back(struct tally__mine *m) {
  struct tally__wslot *t = slot_table(m->s);
  if (!t || m->pid != tally__pid()) return; /* a forked child's copy */
  struct tally__wslot *sl = &t[m->slot];
  uint64_t owner = m->owner;
  if ((pid_t)atomic_load(&sl->tid) != m->tid || (atomic_load(&sl->seq) & 1)) return;
  atomic_store(&sl->tid, 0);
  atomic_compare_exchange_strong(&sl->owner, &owner, 0);
}

static void thread_exit(void *p) {
  struct tally__mine *m = p;
  pthread_mutex_lock(&mine_lock);
  if (m->s) give_back(m); /* else its store closed: nothing of it is left */
  unlink_mine(m);
  pthread_mutex_unlock(&mine_lock);
  free(m);
}

static int key_ready(tally_store *s) {
  if (atomic_load_explicit(&s->wkey_state, memory_order_acquire) == 1) return 0;
  pthread_mutex_lock(&s->hlock);
  int rc = 0;
  if (atomic_load(&s->wkey_state) == 0) {
    if (pthread_key_create(&s->wkey, thread_exit) == 0)
      atomic_store_explicit(&s->wkey_state, 1, memory_order_release);
    else
      rc = tally__fail(TALLY_ENOMEM, "no thread-specific key left for writer slots");
  }
  pthread_mutex_unlock(&s->hlock);
  return rc;
}

static int stall_after(void);

/* Remember m as the calling thread's slot in tally__me (see internal.h). */
static void cache_slot(tally_store *s, const struct tally__mine *m) {
  tally__me.wsl = m->sl;
  tally__me.wslot = m->slot;
  tally__me.wstall = stall_after();
  tally__me.wstore_id = s->id;
}

/* The calling thread's slot, leased on first use; the batch's fast path
 * has already missed tally__me's copy. */
static int lease_slot(tally_store *s) {
  int rc = key_ready(s);
  if (rc) return rc;
  struct tally__mine *m = pthread_getspecific(s->wkey);
  if (m && m->pid == tally__pid()) {
    cache_slot(s, m);
    return 0;
  }
  struct tally__wslot *t = NULL;
  free_mine(m); /* NULL, or the parent's before a fork */
  pthread_setspecific(s->wkey, NULL);
  if (!(m = malloc(sizeof *m))) return tally__fail(TALLY_ENOMEM, "out of memory");
  *m = (struct tally__mine){
      .s = s, .slot = TALLY_SLOT_SHARDS, .pid = tally__pid(), .tid = self_tid()};
  m->owner = tally__owner_of(m->pid, NULL);
  if ((rc = tally__lock(s)) == 0) {
    if ((rc = slot_table_make(s, &t)) == 0) {
      uint32_t w = 0;
      for (int pass = 0; pass < 2; pass++) {
        for (w = 0; w < TALLY_SLOT_SHARDS && atomic_load(&t[w].owner); w++) {}
        if (w < TALLY_SLOT_SHARDS || pass) break;
        tally__slots_recover(s); /* dead threads' slots come back */
      }
      if (w == TALLY_SLOT_SHARDS) {
        rc = tally__fail(TALLY_EBUSY, "%s: %d threads hold writer slots (the most)",
                         tally__store_name(s), TALLY_SLOT_SHARDS);
      } else {
        atomic_store(&t[w].tid, (uint64_t)m->tid);
        atomic_store(&t[w].hold_ms, 0);
        atomic_store_explicit(&t[w].owner, m->owner, memory_order_release);
        m->slot = w;
        m->sl = &t[w];
      }
    }
    tally__unlock(s);
  }
  if (rc == 0 && pthread_setspecific(s->wkey, m) != 0)
    rc = tally__fail(TALLY_ENOMEM, "out of memory");
  if (rc) {
    if (t && m->slot < TALLY_SLOT_SHARDS && atomic_load(&t[m->slot].owner) == m->owner &&
        (pid_t)atomic_load(&t[m->slot].tid) == m->tid)
      give_back(m);
    free(m);
    return rc;
  }
  link_mine(m);
  cache_slot(s, m);
  return 0;
}

/* The store closes: the slots its threads leased go back (only its own:
 * another handle of this process on the same store keeps its threads'). */
void tally__slots_release(tally_store *s) {
  if (atomic_load(&s->wkey_state) != 1) return;
  struct tally__mine *self = pthread_getspecific(s->wkey), *m;
  if (tally__me.wstore_id == s->id) tally__me.wstore_id = 0;
  pthread_key_delete(s->wkey);
  atomic_store(&s->wkey_state, 0);
  pthread_mutex_lock(&mine_lock);
  while ((m = s->mine)) {
    s->mine = m->next;
    give_back(m);
    if (m == self) {
      free(m);
    } else { /* its thread may be exiting now, or later without a destructor */
      m->s = NULL;
      push_mine(m);
    }
  }
  /* orphans whose thread is gone (or of the process before a fork) can
   * run no destructor any more */
  struct tally__mine *next;
  for (m = orphans; m; m = next) {
    next = m->next;
    if (m->pid != tally__pid() ||
        (syscall(SYS_tgkill, m->pid, m->tid, 0) != 0 && errno == ESRCH)) {
      unlink_mine(m);
      free(m);
    }
  }
  pthread_mutex_unlock(&mine_lock);
}

/* Compaction copies every cell as it is: the new store's slots start as
 * written (seq 2, even), so snapshots read all their cells. Caller holds
 * both locks. */
int tally__slots_copy(tally_store *from, tally_store *to) {
  struct tally__wslot *t;
  if (!slot_table(from)) return 0;
  int rc = slot_table_make(to, &t);
  for (uint32_t w = 0; rc == 0 && w < TALLY_SLOT_SHARDS; w++) atomic_store(&t[w].seq, 2);
  return rc;
}

/* ---- writing ----------------------------------------------------------------- */

/* A test seam: TALLY_TEST_BATCH_STALL=K stops a writer for good after K
 * adds of its next batch, so a test can SIGKILL it in the middle of one.
 * Read only where the tests are built (TALLY_TEST_SEAMS). */
static int stall_after(void) {
#ifndef TALLY_TEST_SEAMS
  return -1;
#else
  static _Atomic int after;
  static _Atomic pid_t read_by; /* a forked child reads its own environment */
  if (atomic_load_explicit(&read_by, memory_order_relaxed) != tally__pid()) {
    const char *e = getenv("TALLY_TEST_BATCH_STALL");
    atomic_store_explicit(&after, e && *e ? atoi(e) : -1, memory_order_relaxed);
    atomic_store_explicit(&read_by, tally__pid(), memory_order_relaxed);
  }
  return atomic_load_explicit(&after, memory_order_relaxed);
#endif
}

static void sleep_us(long us) {
  struct timespec ts = {0, us * 1000};
  nanosleep(&ts, NULL);
}

/* A reader asked for a quiet moment: give it one, for HOLD_MS at most. It
 * clears the request as soon as it has read this slot, so yield rather
 * than sleep: a sleep would hold the writer far longer than the read. */
static void honour_hold(struct tally__wslot *sl) {
  for (;;) {
    int64_t h = atomic_load_explicit(&sl->hold_ms, memory_order_relaxed);
    if (!h || tally_monotonic_ms() - h >= HOLD_MS) return;
    sched_yield();
  }
}

int tally_batch_incr(tally_store *s, tally_counter *const *cs, const int64_t *deltas,
                     size_t n) {
  if (!s || !cs || !deltas)
    return tally__fail(TALLY_EINVAL, "tally_batch_incr: NULL argument");
  if (n == 0) return tally__fail(TALLY_EINVAL, "tally_batch_incr: an empty batch");
  tally_counter *c[TALLY_BATCH_MAX];
  int64_t d[TALLY_BATCH_MAX];
  size_t m = 0;
  /* distinct counters, deltas summed: by record, not handle (two handles
   * of one counter name one cell, and of two stores of the same value in
   * it the second would lose the first's add) */
  for (size_t i = 0; i < n; i++) {
    if (!cs[i])
      return tally__fail(TALLY_EINVAL, "tally_batch_incr: counter %zu is NULL", i);
    if (cs[i]->s != s)
      return tally__fail(TALLY_EINVAL,
                         "tally_batch_incr: counter '%s' is of another store",
                         cs[i]->name);
    if (cs[i]->policy != TALLY_POLICY_SLOT)
      return tally__fail(TALLY_EPOLICY,
                         "counter '%s' has the %s policy: only slot counters can be "
                         "batched",
                         cs[i]->name, tally_policy_name(cs[i]->policy));
    size_t j = 0;
    uint64_t rec_off = tally__crec(cs[i]);
    while (j < m && tally__crec(c[j]) != rec_off) j++;
    if (j == m) {
      if (m == TALLY_BATCH_MAX)
        return tally__fail(TALLY_EINVAL, "a batch holds at most %d counters",
                           TALLY_BATCH_MAX);
      c[m] = cs[i];
      d[m++] = 0;
    }
    if (__builtin_add_overflow(d[j], deltas[i], &d[j]))
      return tally__fail(TALLY_ERANGE, "counter '%s': the batch's deltas overflow",
                         cs[i]->name);
  }
  return tally__batch_apply(s, c, d, m);
}

/* Inline, so that tally__batch_apply2 gets its own copy for m = 2 with the
 * loops unrolled (a histogram's observation). */
static inline __attribute__((always_inline)) int
apply(tally_store *s, tally_counter *const *c, const int64_t *d, size_t m) {
  int rc;
  int64_t after[TALLY_BATCH_MAX];
#pragma GCC unroll 2
  for (size_t j = 0; j < m; j++)
    if (__builtin_expect(atomic_load_explicit(&c[j]->gone, memory_order_relaxed) != 0,
                         0) &&
        (rc = tally__counter_live(c[j])))
      return rc;
  /* tally__me by name, not through a pointer: GCC 12's UBSan null check of
   * a pointer to a thread-local (at -O2) tests stale flags and fires */
  if (__builtin_expect(tally__me.wstore_id != s->id, 0) && (rc = lease_slot(s)))
    return rc;
  struct tally__wslot *sl = tally__me.wsl;
  uint32_t w = tally__me.wslot;
  if (__builtin_expect(atomic_load_explicit(&sl->hold_ms, memory_order_relaxed) != 0,
                       0)) {
    honour_hold(sl);
  }
  /* 1. the journal; everything is checked before anything is added */
#pragma GCC unroll 2
  for (size_t j = 0; j < m; j++) {
    uint64_t rec_off = tally__crec(c[j]);
    const struct tally__rec *r = tally__at(s, rec_off);
    uint64_t loc = atomic_load_explicit(&r->loc, memory_order_acquire), cells;
    uint32_t shards = tally__loc_shards(loc);
    bool dropped = (loc & TALLY__LOC_DROPPED) != 0;
    /* the handle's copy was checked when it was made: check only a change */
    if (loc != atomic_load_explicit(&c[j]->loc, memory_order_relaxed) &&
        (rc = tally__loc_decode(s, rec_off, loc, &cells, &shards, &dropped)))
      return rc;
    if (dropped || shards != TALLY_SLOT_SHARDS)
      return tally__fail(TALLY_EDROPPED, "counter '%s' was dropped", c[j]->name);
    _Atomic int64_t *cell = tally__cell_at(s, loc, w);
    int64_t before = atomic_load_explicit(cell, memory_order_relaxed);
    if (!tally__cell_live(before)) /* only this writer adds: never in flight */
      return tally__cell_retired(before)
                 ? tally__fail(TALLY_EDROPPED, "counter '%s' was dropped", c[j]->name)
                 : tally__cell_damage(s, rec_off, w, before);
    if (__builtin_add_overflow(before, d[j], &after[j]) || !tally__cell_live(after[j]))
      return tally__fail(TALLY_ERANGE,
                         "counter '%s': adding %lld would overflow its writer's shard",
                         c[j]->name, (long long)d[j]);
    tally__journal_entry(&sl->e[j], rec_off, loc, r->incarnation,
                         (uint64_t)((unsigned char *)cell - s->base), before, d[j]);
  }
  atomic_store_explicit(&sl->n, m, memory_order_relaxed);
  /* 2. odd: a release store, so the journal is seen before it; each add
   * below is a release too, so seq odd is seen before any add */
  uint64_t seq = atomic_load_explicit(&sl->seq, memory_order_relaxed);
  atomic_store_explicit(&sl->seq, seq + 1, memory_order_release);
  /* 3. the new values: this slot's cells have no other writer, so each
   * holds exactly `before` (see the top of this file for a racing drop) */
  int stall = tally__me.wstall;
#pragma GCC unroll 2
  for (size_t j = 0; j < m; j++) {
    if (__builtin_expect(stall >= 0, 0) && (size_t)stall == j)
      for (;;) pause();
    atomic_store_explicit(
        (_Atomic int64_t *)tally__at(
            s, atomic_load_explicit(&sl->e[j].cell_off, memory_order_relaxed)),
        after[j], memory_order_release); /* a reader that sees it sees seq odd */
  }
  /* 4. even: a reader that sees it sees every add */
  atomic_store_explicit(&sl->seq, seq + 2, memory_order_release);
  return 0;
}

int tally__batch_apply(tally_store *s, tally_counter *const *c, const int64_t *d,
                       size_t m) {
  return apply(s, c, d, m);
}

int tally__batch_apply2(tally_store *s, tally_counter *a, int64_t da, tally_counter *b,
                        int64_t db) {
  tally_counter *const c[2] = {a, b};
  const int64_t d[2] = {da, db};
  return apply(s, c, d, 2);
}

int tally__slot_incr(tally_counter *c, int64_t delta) {
  return tally_batch_incr(c->s, &c, &delta, 1);
}

/* ---- reading ----------------------------------------------------------------- */

struct snap_entry {
  uint64_t rec_off, loc; /* loc 0: dropped meanwhile, left out */
  __int128 total;
  size_t name_at;
  uint32_t name_len;
  bool slot; /* read slot by slot; else as tally_counter_value does */
};

struct snap {
  const char *pattern;
  size_t plen;
  struct snap_entry *e; /* every matching counter */
  size_t n, cap;
  char *names; /* copies: a record may be reused once its counter is dropped */
  size_t names_len, names_cap;
  bool locked; /* the caller holds the store lock (a reset) */
};

static int grow(void **p, size_t *cap, size_t need, size_t size) {
  if (need <= *cap) return 0;
  size_t c = *cap ? *cap : 64;
  while (c < need) c *= 2;
  void *q = realloc(*p, c * size);
  if (!q) return tally__fail(TALLY_ENOMEM, "out of memory");
  *p = q;
  *cap = c;
  return 0;
}

static int gather(tally_store *s, uint64_t rec_off, void *ud) {
  struct snap *g = ud;
  const struct tally__rec *r = tally__at(s, rec_off);
  uint64_t loc = atomic_load_explicit(&r->loc, memory_order_acquire), cells;
  uint32_t shards;
  bool dropped;
  int rc = tally__loc_decode(s, rec_off, loc, &cells, &shards, &dropped);
  if (rc) return rc;
  if (dropped || !tally_glob_match(g->pattern, g->plen, r->name, r->name_len)) return 0;
  if ((rc = grow((void **)&g->e, &g->cap, g->n + 1, sizeof *g->e)) ||
      (rc = grow((void **)&g->names, &g->names_cap, g->names_len + r->name_len, 1)))
    return rc;
  memcpy(g->names + g->names_len, r->name, r->name_len);
  g->e[g->n] = (struct snap_entry){.rec_off = rec_off,
                                   .loc = loc,
                                   .name_at = g->names_len,
                                   .name_len = r->name_len,
                                   .slot = r->policy == TALLY_POLICY_SLOT &&
                                           shards == TALLY_SLOT_SHARDS};
  g->names_len += r->name_len;
  g->n++;
  return 0;
}

/* Wait out a live writer's batch; roll back a dead one's (under the
 * store lock: taken here unless the caller holds it). */
static int wait_slot(tally_store *s, struct tally__wslot *sl, uint64_t seq, bool locked) {
  int64_t t0 = tally_monotonic_ms();
  while (atomic_load_explicit(&sl->seq, memory_order_acquire) == seq) {
    if (tally_monotonic_ms() - t0 < LIVENESS_MS) {
      sched_yield();
      continue;
    }
    if (!holder_alive(s, sl)) {
      int rc = locked ? 0 : tally__lock(s);
      if (rc) return rc;
      if (atomic_load(&sl->seq) == seq && !holder_alive(s, sl)) roll_back(s, sl);
      if (!locked) tally__unlock(s);
      return 0;
    }
    sleep_us(100);
    t0 = tally_monotonic_ms();
  }
  return 0;
}

/* Add slot w's shard of every slot counter to the totals, as one reading. */
static int read_slot(tally_store *s, struct tally__wslot *sl, uint32_t w, struct snap *g,
                     int64_t *vals) {
  int64_t asked = 0;
  int rc = 0;
  for (int attempt = 0;; attempt++) {
    uint64_t s1 = atomic_load_explicit(&sl->seq, memory_order_acquire);
    if (s1 == 0) break; /* never written: all its cells are 0 */
    if (s1 & 1) {
      if ((rc = wait_slot(s, sl, s1, g->locked))) break;
      continue;
    }
    /* acquire loads: seq is read again after them, and an add seen makes
     * its seq odd (or later) seen */
    for (size_t i = 0; i < g->n; i++)
      if (g->e[i].slot)
        vals[i] =
            atomic_load_explicit(tally__cell_at(s, g->e[i].loc, w), memory_order_acquire);
    if (atomic_load_explicit(&sl->seq, memory_order_relaxed) == s1) {
      for (size_t i = 0; rc == 0 && i < g->n; i++) {
        struct snap_entry *e = &g->e[i];
        if (!e->slot) continue;
        if (tally__cell_live(vals[i]))
          e->total += vals[i];
        else if (tally__cell_retired(vals[i]))
          e->slot = false, e->loc = 0; /* dropped meanwhile: left out */
        else                           /* its one writer stores only live values */
          rc = tally__cell_damage(s, e->rec_off, w, vals[i]);
      }
      break;
    }
    if (attempt >= READ_RETRIES) {      /* a busy writer: ask it for a moment */
      asked = tally_monotonic_ms() | 1; /* never 0: 0 is "no request" */
      atomic_store_explicit(&sl->hold_ms, asked, memory_order_relaxed);
    }
  }
  if (asked) {
    int64_t h = asked;
    atomic_compare_exchange_strong(&sl->hold_ms, &h, 0);
  }
  return rc;
}

/* tally_counter_reset of a slot counter. Its cells take stores from their
 * one writer (tally_batch_incr), so nobody else may change them: the value
 * is read slot by slot as a snapshot reads it (a dead writer's batch rolled
 * back first), and subtracted in the caller's own shard, as a batch of
 * one. An increment that lands after its slot was read stays counted.
 * Resets take turns under the store lock: two at once both read the
 * whole value, and both took it. */
int tally__slot_reset(tally_counter *c, int64_t *removed) {
  tally_store *s = c->s;
  int rc = tally__me.wstore_id == s->id ? 0 : lease_slot(s); /* not under the lock */
  if (rc || (rc = tally__lock(s))) return rc;
  if (atomic_load(&c->gone)) { /* marked since: coming back takes the lock */
    tally__unlock(s);
    return tally_counter_reset(c, removed);
  }
  uint64_t rec_off = tally__crec(c), cells;
  const struct tally__rec *r = tally__at(s, rec_off);
  uint64_t loc = atomic_load_explicit(&r->loc, memory_order_acquire);
  uint32_t shards;
  bool dropped;
  rc = tally__loc_decode(s, rec_off, loc, &cells, &shards, &dropped);
  struct snap_entry e = {.rec_off = rec_off, .loc = loc, .slot = true};
  struct snap g = {.e = &e, .n = 1, .locked = true};
  struct tally__wslot *t = slot_table(s);
  int64_t val;
  for (uint32_t w = 0; rc == 0 && !dropped && t && w < TALLY_SLOT_SHARDS; w++)
    rc = read_slot(s, &t[w], w, &g, &val);
  if (rc == 0 && (dropped || shards != TALLY_SLOT_SHARDS || !e.slot))
    rc = tally__fail(TALLY_EDROPPED, "counter '%s' was dropped", c->name);
  if (rc == 0 && (e.total > INT64_MAX || e.total <= INT64_MIN))
    rc = tally__fail(TALLY_ERANGE,
                     "counter '%s': the amount to remove does not fit in 64 bits; "
                     "nothing was removed",
                     c->name);
  int64_t minus = rc == 0 ? -(int64_t)e.total : 0;
  if (minus) rc = tally_batch_incr(s, &c, &minus, 1); /* the slot leased above */
  tally__unlock(s);
  if (rc == 0) *removed = (int64_t)e.total;
  return rc;
}

#define SNAP_TRIES 4 /* cuts taken while counters come and go, the last locked */

/* One cut: gather the counters, read the others' values, then the slot
 * counters slot by slot (*vals: their buffer, left NULL if none). */
static int read_cut(tally_store *s, struct snap *g, int64_t **vals) {
  int rc = tally__index_each(s, gather, g);
  bool any_slot = false;
  for (size_t i = 0; rc == 0 && i < g->n; i++) {
    struct snap_entry *e = &g->e[i];
    if (i + VALUES_AHEAD < g->n && !e[VALUES_AHEAD].slot) {      /* see index.c's walk */
      __builtin_prefetch(tally__at(s, e[VALUES_AHEAD].rec_off)); /* gather bounded it */
      tally__fetch_cells(s, e[VALUES_AHEAD].loc);
    }
    if (e->slot) {
      any_slot = true;
      continue;
    }
    int64_t v; /* not batched: read as tally_counter_value does */
    int vrc = tally__rec_value(s, e->rec_off, &v);
    if (vrc == TALLY_EDROPPED)
      e->loc = 0;
    else if (vrc)
      rc = vrc;
    else
      e->total = v;
  }
  struct tally__wslot *t = any_slot ? slot_table(s) : NULL;
  if (rc == 0 && t && !(*vals = malloc(g->n * sizeof **vals)))
    rc = tally__fail(TALLY_ENOMEM, "out of memory");
  for (uint32_t w = 0; rc == 0 && t && w < TALLY_SLOT_SHARDS; w++)
    rc = read_slot(s, &t[w], w, g, *vals);
  return rc;
}

int tally_store_snapshot(tally_store *s, const char *pattern, size_t plen,
                         tally_value_fn fn, void *ud) {
  if (!s || !fn) return tally__fail(TALLY_EINVAL, "tally_store_snapshot: NULL argument");
  struct snap g = {.pattern = pattern && plen ? pattern : "*",
                   .plen = pattern && plen ? plen : 1};
  int64_t *vals = NULL;
  int rc = tally__truncated(s);
  size_t hint = (size_t)tally__index_live(s) + 16; /* one allocation, mostly */
  tally__hold_begin(s); /* the records gathered are read again below */
  if (rc == 0) rc = grow((void **)&g.e, &g.cap, hint, sizeof *g.e);
  if (rc == 0) rc = grow((void **)&g.names, &g.names_cap, hint * 16, 1);
  /* A batch over counters created while the walk ran may land in the
   * ones it found and not in those it passed before they were there: the
   * cut is taken again if any counter was created or dropped meanwhile,
   * and the last time under the store lock, which creates take. */
  for (int attempt = 1; rc == 0; attempt++) {
    if (attempt == SNAP_TRIES && (rc = tally__lock(s)) == 0) g.locked = true;
    uint64_t gen = atomic_load_explicit(&s->hdr->generation, memory_order_acquire);
    g.n = g.names_len = 0;
    free(vals);
    vals = NULL;
    if (rc == 0) rc = read_cut(s, &g, &vals);
    if (rc || !vals || g.locked ||
        atomic_load_explicit(&s->hdr->generation, memory_order_acquire) == gen)
      break;
  }
  if (g.locked) tally__unlock(s);
  for (size_t i = 0; rc == 0 && i < g.n; i++) {
    struct snap_entry *e = &g.e[i];
    if (!e->loc) continue; /* dropped */
    if (e->total > INT64_MAX || e->total < INT64_MIN) {
      rc = tally__fail(TALLY_ERANGE, "counter '%.*s': value does not fit in 64 bits",
                       (int)e->name_len, g.names + e->name_at);
      break;
    }
    rc = fn(ud, g.names + e->name_at, e->name_len, (int64_t)e->total);
  }
  tally__hold_end(s);
  free(vals);
  free(g.e);
  free(g.names);
  return rc;
}
