/* internal.h -- what the core's files share beyond the store's bytes
 * (layout.h): the store and counter handles of this process, and each
 * file's functions, by file. A histogram's inline observation is in
 * observe.h.
 */
#ifndef TALLY_INTERNAL_H
#define TALLY_INTERNAL_H

#include "tally.h"

#include <pthread.h>
#include <sys/types.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "layout.h"

enum { TALLY__MEMORY = 0, TALLY__FILE = 1 };

struct tally__handles; /* grace.c: this process's counter handles */
#define TALLY__ALIVE_SEEN 64
#define TALLY__PASSED     16

struct tally_store {
  int kind;
  int fd;
  char *path; /* file stores; for messages */
  unsigned char *base;
  size_t reserved; /* bytes of address space mapped */
  struct tally__header *hdr;
  struct tally__class *classes; /* [0] is class 1 */
  _Atomic int64_t *journal;     /* TALLY_MAX_SHARDS saved cell values */
  pthread_mutex_t lock;
  bool lock_word;           /* format 8: the lock is hdr->lock_owner, not flock() */
  uint32_t small;           /* the unit of records and limbo nodes: 8 bytes
                               from format 9, 16 before (space.c) */
  _Atomic bool lock_stale;  /* forked: fd's open file is shared with the parent */
  uint64_t id;              /* unique in this process (thread tickets) */
  tally_store *prev, *next; /* open stores, for fork handling */
  /* grace periods (grace.c) */
  uint32_t proc;      /* this process's slot in the process table */
  pid_t pid;          /* ... taken by this pid (a forked child takes one) */
  uint64_t procs_end; /* where the process table ends (close checks the
                        file still reaches it) */
  uint64_t seen;      /* the epoch this process has passed */
  int64_t grace_ms;   /* least age of limbo before reuse */
  /* the slot a fork reserved for the child (tally__grace_fork_prepare):
   * its index (TALLY__PROCS: none), owner word and epoch word */
  uint32_t fork_slot;
  uint64_t fork_owner, fork_seen;
  uint32_t sweep_from; /* upkeep's next slots to look at for a dead owner */
  /* when this process's grace steps saw the least epoch of all processes
   * rise (space.c, under the store lock): grace_ms counts from there */
  struct tally__passed {
    uint64_t epoch;         /* the latest min_seen of the note */
    int64_t from_ms, at_ms; /* its first and latest rise */
  } passed[TALLY__PASSED + 4];
  uint32_t passed_n;
  uint64_t ripe_epoch; /* limbo retired before it may be reused */
  /* space.c: fresh allocations to make before the next coalesce of the
   * free lists (what the last one looked at, over 8: amortised) */
  uint64_t coalesce_wait;
  /* when this process last found a process table slot's owner alive (a
   * look costs four system calls, and each create's grace step looks at
   * every process behind it): by slot % TALLY__ALIVE_SEEN */
  struct tally__alive {
    _Atomic uint64_t owner;
    _Atomic int64_t at_ms;
  } alive[TALLY__ALIVE_SEEN];
  pthread_mutex_t hlock; /* guards handles */
  struct tally__handles *handles;
  _Atomic bool by_name;   /* tally_store_incr was used: never idle (grace.c) */
  _Atomic int holders;    /* walks and opens under way: no newer epoch (grace.c) */
  _Atomic pid_t hold_pid; /* the process holders counts for (a fork's differs) */
  _Atomic uint64_t expire_cursor; /* expire.c: next index slot to scan */
  _Atomic int64_t stuck_ms;       /* when a cell's wait last timed out (cells.c) */
  /* batch.c: which writer slot each thread of this process holds */
  _Atomic int wkey_state;   /* 1: wkey made */
  pthread_key_t wkey;       /* -> the thread's slot record */
  struct tally__mine *mine; /* every thread's record, under hlock: freed at close */
};

struct tally_counter {
  /* the increment's hot path reads only this first line */
  _Atomic uint64_t loc; /* cached copy of rec->loc (acquire/release:
                                   free on x86, and it orders the cells) */
  unsigned char *base;  /* s->base */
  tally_store *s;
  uint64_t store_id; /* s->id, for the thread ticket check */
  /* atomic: revive() (counter.c) rewrites both, under hlock, while other
   * threads increment through the handle or its vector slot */
  _Atomic int policy;
  _Atomic int fast; /* the increment's path: 0 thread, 1 random, 4 the slow
                       path (other policies), 8 (TALLY__FAST_CPU) the cpu
                       policy's sequence; | 2: automatic shards (autoshard.c) */
  /* Set by this process's grace step (grace.c) when the record is gone
   * for good: loc then points at the tombstone cell, and rec must not be
   * read (it may belong to another counter now). 1: dropped, 2: expired. */
  _Atomic int gone;
  _Atomic uint64_t rec_off; /* changes only when an expired counter is
                               re-created through this handle */
  tally_counter *next_same; /* grace.c: handles of the same record */
  /* vector.c: the vector whose slot vslot caches this handle's cells, or
   * NULL. Whoever changes loc makes it forget them (tally__handle_set_loc). */
  _Atomic(tally_vector *) vec;
  size_t vslot;
  uint32_t name_len;
  char name[]; /* a copy: the record may be reused once the counter is gone */
};
_Static_assert(offsetof(struct tally_counter, fast) + sizeof(int) <= 64,
               "the increment's fields fit the handle's first cache line");

/* ---- error.c ---- */
int tally__fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int tally__fail_sys(const char *what, const char *path);
/* A store spec that no kind of store takes, as messages show it: a URI
 * as tally_uri_redact shows it, other text as if all of it were a URI's
 * authority (a mistyped scheme, "redis:/:PW@h" or "h:1?password=PW",
 * still hides its secret). Returns the whole length, as snprintf. */
size_t tally__spec_redact(char *out, size_t cap, const char *spec, size_t len);

/* ---- hash.c ---- */
uint64_t tally__hash(const void *data, size_t len, uint64_t seed);
/* out[0], out[1]: tally__hash(data, len, seed0), and with seed1. */
void tally__hash2(const void *data, size_t len, uint64_t seed0, uint64_t seed1,
                  uint64_t out[2]);
/* The 64-bit finalizer (MurmurHash3's fmix64): every input bit reaches
 * every output bit. Inline: a hash calls it for every 8 bytes. */
static inline uint64_t tally__mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

/* ---- batch.c ---- */
/* One entry of a writer slot's journal: enough to undo the add exactly
 * (the cell is the slot's own, so nobody else changes it) and to know the
 * cell still belongs to that counter (loc and incarnation unchanged). */
struct tally__wentry {
  _Atomic uint64_t rec_off, loc, incarnation, cell_off;
  _Atomic int64_t before, delta;
};
/* A writer slot: leased by one thread; seq is odd while its journal's
 * entries are being added. */
struct tally__wslot {
  _Atomic uint64_t owner;  /* grace.c's owner word of the process; 0: free */
  _Atomic uint64_t tid;    /* the thread (gettid) */
  _Atomic uint64_t seq;    /* odd: a batch is being applied */
  _Atomic uint64_t n;      /* entries in the journal */
  _Atomic int64_t hold_ms; /* a reader asks the writer to wait (monotonic ms) */
  uint64_t pad_[3];
  struct tally__wentry e[TALLY_BATCH_MAX];
};
/* The batch of m distinct live-checked slot counters c of s, with their
 * deltas d (what tally_batch_incr does once it has checked its arguments). */
int tally__batch_apply(tally_store *s, tally_counter *const *c, const int64_t *d,
                       size_t m);
/* The same for two (a histogram's observation), its loops unrolled. */
int tally__batch_apply2(tally_store *s, tally_counter *a, int64_t da, tally_counter *b,
                        int64_t db);
int tally__slot_incr(tally_counter *c, int64_t delta);     /* a batch of one */
int tally__slot_reset(tally_counter *c, int64_t *removed); /* in its own shard */
void tally__slots_release(tally_store *s);                 /* this process's, at close */
int tally__slots_recover(tally_store *s); /* roll back dead writers' batches; locked */
/* Only the half batches of dead writers, rolled back (64 loads when no
 * batch is open), so that upkeep and rollup ticks undo them, not only the
 * next snapshot. Locked. */
void tally__slots_settle(tally_store *s);
int tally__slots_copy(tally_store *from, tally_store *to); /* compaction */
uint64_t tally__owner_of(pid_t pid, bool *zombie);         /* grace.c */
bool tally__owner_alive(uint64_t owner);                   /* grace.c */

/* ---- policy.c ---- */
/* Per-thread writer state, inline here because picking a shard is on the
 * increment's hot path. */
struct tally__writer {
  uint64_t store_id; /* store the ticket was drawn from, 0: none */
  uint64_t ticket;
  uint64_t rr;  /* round-robin position */
  uint64_t rng; /* xorshift64* state, 0: unseeded */
  /* batch.c: the writer slot this thread last batched through, so a batch
   * needs no thread-specific key lookup (zeroed in a forked child too) */
  uint64_t wstore_id;       /* its store, 0: none (ids are never reused) */
  struct tally__wslot *wsl; /* the slot; the table never moves while open */
  uint32_t wslot;           /* its index: the shard this thread adds to */
  int32_t wstall;           /* tests: TALLY_TEST_BATCH_STALL, -1: none */
};
/* Read it by name (tally__me.ticket), never through a pointer to it: GCC
 * 12's UBSan null check of such a pointer at -O2 tests stale flags and
 * fires (CI's sanitizer build is RelWithDebInfo); by name, the code is the
 * same in a Release build. */
extern _Thread_local struct tally__writer tally__me
    __attribute__((tls_model("initial-exec")));
void tally__draw_ticket(tally_store *s);
void tally__seed_random(void);
uint32_t tally__key_shard(const void *key, size_t len, uint32_t nshards);
void tally__policy_init(void);

static inline uint32_t tally__reduce(uint64_t x, uint32_t n) {
  return (n & (n - 1)) == 0 ? (uint32_t)(x & (n - 1)) : (uint32_t)(x % n);
}

static inline uint32_t tally__pick_shard(tally_store *s, uint64_t store_id, int policy,
                                         uint32_t n) {
  if (policy == TALLY_POLICY_RANDOM) {
    if (__builtin_expect(tally__me.rng == 0, 0)) tally__seed_random();
    tally__me.rng ^= tally__me.rng >> 12;
    tally__me.rng ^= tally__me.rng << 25;
    tally__me.rng ^= tally__me.rng >> 27;
    return (uint32_t)((((tally__me.rng * 0x2545f4914f6cdd1dull) >> 32) * n) >> 32);
  }
  if (__builtin_expect(tally__me.store_id != store_id, 0)) tally__draw_ticket(s);
  if (policy == TALLY_POLICY_ROUND_ROBIN) return tally__reduce(tally__me.rr++, n);
  return tally__reduce(tally__me.ticket, n); /* thread */
}

/* ---- percpu.c (the increment itself is inline in percpu.h) ---- */
/* The thread policy's shard of a cpu counter of n shards (1..P), where
 * its per-CPU sequence gave up; 0 for a loc of fewer than 3 (the
 * tombstone). */
static inline uint32_t tally__cpu_fallback_shard(tally_store *s, uint64_t store_id,
                                                 uint32_t n) {
  if (n < 3) return 0;
  return 1 + tally__pick_shard(s, store_id, TALLY_POLICY_THREAD, (n - 1) / 2);
}
/* Raise the store's cpu fence and wait until no per-CPU sequence that
 * began before it can still commit (each CPU a sequence ran on passed);
 * caller holds the lock. A CPU this thread may not run on (a cpuset) is
 * passed over when it is offline, or when no thread of a process that has
 * the store open may run there; else TALLY_EBUSY, the fence down again. */
int tally__cpu_fence(tally_store *s, uint32_t nshards);
void tally__cpu_unfence(tally_store *s);
/* The slow path's note that this thread's CPU runs sequences of c's store
 * (its bit in cpu_seen), so that the next increment on it may take one. */
void tally__cpu_seen(tally_counter *c);
int tally__cpu_reset(tally_counter *c, int64_t *removed); /* under the lock */
bool tally__cpu_rseq_here(void); /* this thread's sequences can run */
void tally__cpu_init(void);      /* once per process (policy.c) */

/* ---- arena.c ---- */
/* A sealed word: an arena offset with a 32-bit check keyed by the store's
 * salt, the field it lives in and `extra`, so a damaged pointer is caught
 * even when it lands on another valid record. 0 stays 0 ("none"). */
enum {
  TALLY__SEAL_INDEX = 1,
  TALLY__SEAL_FAMILIES = 2,
  TALLY__SEAL_MOVE = 3,
  TALLY__SEAL_ROLLUPS = 4,
  TALLY__SEAL_ROLLUP = 5,
  TALLY__SEAL_FREE = 6,
  TALLY__SEAL_COLUMN = 7,
  TALLY__SEAL_LIMBO = 8,
  TALLY__SEAL_PROCS = 9,
  TALLY__SEAL_WSLOTS = 10
};
uint64_t tally__seal(const tally_store *s, int field, uint64_t off, uint64_t extra);
int tally__unseal(const tally_store *s, int field, uint64_t word, uint64_t extra,
                  uint64_t *off);
uint64_t tally__header_check(const struct tally__header *h);
const char *tally__store_name(const tally_store *s); /* for messages */
int tally__truncated(tally_store *s);                /* ECORRUPT if the file shrank */
/* `bytes` zeroed bytes, 64-aligned and rounded up to 64 (alloc), or
 * aligned and rounded up to s->small (alloc_small: records, limbo nodes): a
 * free piece of the kind if one fits (space.c), else fresh arena. Caller
 * holds the lock. */
int tally__alloc(tally_store *s, uint64_t bytes, uint64_t *off);
int tally__alloc_small(tally_store *s, uint64_t bytes, uint64_t *off);
int tally__alloc_fresh(tally_store *s, uint64_t bytes, uint64_t align, uint64_t *off);
static inline uint64_t tally__round(uint64_t bytes, uint64_t to) {
  return (bytes + to - 1) & ~(to - 1);
}
static inline void *tally__at(const tally_store *s, uint64_t off) {
  return s->base + off;
}
/* Is [off, off + len) inside the allocated arena? Inline: a walk asks it
 * several times a counter. */
static inline bool tally__in_arena(const tally_store *s, uint64_t off, uint64_t len) {
  uint64_t used = atomic_load_explicit(&s->hdr->used, memory_order_acquire);
  return off >= TALLY__ARENA_OFF && len <= used && off <= used - len;
}

/* ---- lock.c ---- */
int tally__lock(tally_store *s); /* also finishes a pending move */
/* A format-8 file store's open file marks this process as having it open
 * (lock.c: what tells a waiter that a holder is gone). */
int tally__lock_attach(tally_store *s);
/* Does pid hold its attach lock on the file, that is, have it open? True
 * where there are no attach locks (format 7, memory stores), where the
 * probe cannot tell (this process; a forked child not reopened yet) and
 * when the kernel does not answer. A program that pid exec'd and that
 * opened the file again holds one too (the same byte). */
bool tally__attached(tally_store *s, pid_t pid);
void tally__unlock(tally_store *s);
void tally__registry_add(tally_store *s); /* open stores, for fork() */
pid_t tally__pid(void);                   /* getpid(), cached; a fork handler renews it */
void tally__registry_remove(tally_store *s);

/* ---- space.c: limbo and free lists ---- */
/* A limbo node: what retirements at one epoch freed, reusable once every
 * process has passed that epoch, grace_ms after that was first seen.
 * Items: off >> 3 in bits 0..31, kind in 32..33, size in 34..63 (SMALL: a
 * counter record of bytes / s->small, from alloc_small; ALIGNED: bytes / 64,
 * from alloc; COLUMN: cells of `size` shards; REF: no space, a counter
 * whose handles must look again, size 0). */
enum {
  TALLY__ITEM_REF = 0,
  TALLY__ITEM_SMALL = 1,
  TALLY__ITEM_ALIGNED = 2,
  TALLY__ITEM_COLUMN = 3
};
#define TALLY__LIMBO_ITEMS 26
struct tally__limbo {
  uint64_t next;       /* sealed: newer node, or 0 */
  uint64_t epoch;      /* the epoch its items were retired in */
  int64_t at_ms;       /* CLOCK_MONOTONIC ms of the newest item (no longer
                          read: the grace time counts from tally_store.passed) */
  uint64_t last_ident; /* what retired the newest items (a move's sealed
                          word): an interrupted retirement is not queued
                          twice */
  uint32_t n;          /* items */
  uint32_t done;       /* items already moved to the free lists */
  uint64_t item[TALLY__LIMBO_ITEMS];
};
static inline uint64_t tally__item(int kind, uint64_t off, uint64_t size) {
  return (off >> 3) | (uint64_t)kind << 32 | size << 34;
}
/* Queue items retired together (caller holds the lock): into the newest
 * node if it is of the current epoch and has room, else a new one. A
 * retirement with the newest items' ident is not queued again. The grace
 * step bumps the epoch. */
int tally__retire(tally_store *s, uint64_t ident, const uint64_t *items, uint32_t n);
/* Make room for a retirement of up to n items that allocates nothing (a
 * move's, once its cells are retired: journal.c), or fail with nothing
 * retired. Caller holds the lock and retires before the next grace step. */
int tally__retire_room(tally_store *s, uint32_t n);
/* Move ripe limbo to the free lists (caller holds the lock): retired
 * before min_seen, the least epoch of all processes, and before an epoch
 * this process saw them all pass grace_ms ago. */
void tally__reclaim(tally_store *s, uint64_t min_seen, int64_t now_ms);
void tally__limbo_repair(tally_store *s); /* after a holder died; lock held */
int tally__column_pop(tally_store *s, uint32_t n, uint64_t *off); /* 0 none */
/* Free an item (tally__item) at once, without a grace period: only what
 * no handle, index entry or move record has named yet, such as the new
 * cells of a move that was refused or undone (move.c) or a creation's
 * cells and record when its index entry could not be made (counter.c).
 * Caller holds the lock. */
void tally__free_now(tally_store *s, uint64_t item);
int tally__space_check(tally_store *s);
int tally__space_open_check(tally_store *s); /* O(1), at open */
/* Walk limbo nodes newer than epoch `from` (caller holds the lock). */
typedef void (*tally__limbo_fn)(tally_store *s, const struct tally__limbo *node,
                                void *ud);
int tally__limbo_each(tally_store *s, uint64_t from, tally__limbo_fn fn, void *ud);

/* ---- grace.c: processes, epochs, handles ---- */
struct tally__proc {
  _Atomic uint64_t owner; /* pid << 32 | start-time hash (odd); 0: free;
                             pid << 32 | time << 1: reserved for a child */
  _Atomic uint64_t seen;  /* epoch passed << 1 | idle (holds nothing) */
};
int tally__grace_open(tally_store *s);   /* take a slot */
void tally__grace_close(tally_store *s); /* give it back */
/* fork(): the parent reserves a slot for the child at its own epoch
 * and holds hlock across the fork; the parent lets go of hlock (and of
 * the slot if the fork failed), the child takes the slot and lets go of
 * hlock. */
void tally__grace_fork_prepare(tally_store *s);
void tally__grace_fork_parent(tally_store *s, bool failed);
void tally__grace_fork_child(tally_store *s);
/* Pass the current epoch: refresh this process's handles for what was
 * retired since, then publish it; then reclaim what every process has
 * passed. look: find out afresh which processes behind it are alive
 * (upkeep); else one found alive in the last ALIVE_MS (grace.c) is taken
 * to be still (creates, drops). While a walk or an open of this process
 * holds the epoch (tally__hold_begin) it publishes none newer; in_open:
 * the caller's own open, which made its record under this lock, is not
 * counted. Caller holds the lock. */
void tally__grace_step(tally_store *s, bool look, bool in_open);
void tally__handle_add(tally_store *s, tally_counter *c);
/* The same, the caller holding hlock: a handle moved to another record
 * (revive) leaves and rejoins in one section, as two threads may move it
 * at once, and one added twice would make its chain a loop. */
void tally__handle_add_locked(tally_store *s, tally_counter *c);
void tally__handle_remove_locked(tally_store *s, tally_counter *c);
/* Around what reads records or the index table by offset for as long as
 * it runs (index.c's walk, a snapshot, an open until its handle is in):
 * nothing retired meanwhile is reused before the end, however long it
 * takes. Nest. */
void tally__hold_begin(tally_store *s);
void tally__hold_end(tally_store *s);
/* Tests only: called, when set, where a test pauses a thread or kills a
 * process (test_lifecycle, test_lock): "open", between an open's lookup and its
 * handle's insertion; "revive", between an expired counter's new open and
 * its old handle's return; "indexed", between a new counter's index entry
 * and its family's live count; "limbo", between a dropped counter's LIMBO
 * flag and its family's count; "expire", under the lock between an
 * expiry's mark and its move; "reshard", under the lock between a
 * reshard's check that the value fits and its move; "refresh", in an
 * increment that found its cells retired, after it looked the record up;
 * "send", in tally_counter_send_begin between the mark and the read. */
#ifdef TALLY_TEST_SEAMS /* compiled in only where the tests are built */
extern void (*tally__test_hook)(const char *where, const char *name, size_t len);
#define TALLY__TEST_HOOK(where, name, len)                                               \
  do {                                                                                   \
    if (__builtin_expect(tally__test_hook != NULL, 0))                                   \
      tally__test_hook(where, name, len);                                                \
  } while (0)
#else /* nothing: the compiler drops the call and its arguments */
static inline void tally__no_test_hook(const char *where, const char *name, size_t len) {
  (void)where, (void)name, (void)len;
}
#define TALLY__TEST_HOOK(where, name, len) tally__no_test_hook(where, name, len)
#endif
void tally__grace_by_name(tally_store *s); /* before the first tally_store_incr */
void tally__handle_remove(tally_store *s, tally_counter *c);
void tally__handles_free(tally_store *s);
size_t tally__handles_open(tally_store *s); /* tests: handles open here */
int tally__grace_table_create(tally_store *s);
uint64_t tally__tombstone_loc(void); /* a one-shard loc at hdr->tombstone */
/* 1 and its pid in *pid if a live process other than this handle's slot
 * (another handle of this process too) has the store open, else 0; the
 * slots of dead (and zombie) processes are freed on the way. */
int tally__grace_others(tally_store *s, int64_t *pid);
/* The pids of the live processes in the table (this one too), each once,
 * up to cap: their count; cap + 1 when there are more, or a forked child
 * has not taken its slot yet (its pid unknown); or a negative code. */
int tally__grace_pids(tally_store *s, int64_t *pids, int cap);

/* ---- journal.c ---- */
/* Record and make the move of rec_off's counter to location `to` (new
 * cells, or its cells marked dropped). Caller holds the lock. */
int tally__journal_move(tally_store *s, uint64_t rec_off, uint64_t to);
/* A drop that happens only if the counter's value is `expect` (an
 * expiry): TALLY_EBUSY, with every cell restored, if it moved meanwhile. */
int tally__journal_drop_if(tally_store *s, uint64_t rec_off, uint64_t to, int64_t expect);
int tally__journal_finish(tally_store *s); /* a pending move; caller holds the lock */
/* What a move needs before it changes or takes anything: no move pending,
 * room in limbo. tally__journal_move checks it again; a caller that
 * allocates for the move calls it first, so a refusal leaves nothing taken. */
int tally__journal_ready(tally_store *s);
bool tally__fits_shards(__int128 total, uint32_t n); /* over n cells' range */

/* ---- index.c ---- */
int tally__index_create(tally_store *s, uint64_t names); /* a table sized for them */
uint64_t tally__index_bytes(tally_store *s);             /* the current table's size */
int tally__index_find(tally_store *s, const char *name, size_t len, uint64_t hash,
                      uint64_t *rec_off);
int tally__index_insert(tally_store *s, uint64_t hash, uint64_t rec_off);
void tally__index_remove(tally_store *s, uint64_t rec_off);
int tally__index_check(tally_store *s); /* the table header */
int tally__rec_verify(tally_store *s, uint64_t rec_off);
typedef int (*tally__rec_fn)(tally_store *s, uint64_t rec_off, void *ud);
int tally__index_each(tally_store *s, tally__rec_fn fn, void *ud);
/* The same, for a walk that reads every value: it fetches cells ahead too. */
int tally__index_each_value(tally_store *s, tally__rec_fn fn, void *ud);
/* Ask for the cells loc names before reading them (a walk's hint): loc is
 * not trusted, only bounded by the arena. */
void tally__fetch_cells(tally_store *s, uint64_t loc);
uint64_t tally__index_live(tally_store *s); /* names in the index now (a hint) */
/* ---- order.c ---- */
/* A record to sort by name: its offset (the name's length in the top 8
 * bits until sorted) and its name's first 16 bytes. */
struct tally__name_key {
  uint64_t rec, key, next;
};
/* Make rec_off's key: while a walk holds the record, and has it in cache. */
void tally__name_key(tally_store *s, uint64_t rec_off, struct tally__name_key *out);
/* Sort keys by their records' names, bytewise, a name before any longer
 * one it begins; then each rec is the record's offset. TALLY_ENOMEM. */
int tally__sort_by_name(tally_store *s, struct tally__name_key *keys, size_t n);
/* fn for the live entries among `count` slots from *cursor on (wrapping);
 * *cursor is left where the walk stopped. */
int tally__index_range(tally_store *s, uint64_t *cursor, uint64_t count, tally__rec_fn fn,
                       void *ud);
/* A walk in slices, under a hold from its start to its end (tally_walk):
 * the table it began with (its offset and slots), which stays as it is
 * while held (a rebuild retires it); then fn for the live entries of its
 * slots [from, from + count), cells fetched ahead as every walk does. */
int tally__index_table(tally_store *s, uint64_t *off, uint64_t *cap);
int tally__index_slots(tally_store *s, uint64_t off, uint64_t from, uint64_t count,
                       tally__rec_fn fn, void *ud);
uint16_t tally__rec_checksum(const struct tally__rec *r);

/* ---- family.c ---- */
int tally__family_check(tally_store *s);
/* The family a new counter `name` falls under, or *out NULL. */
int tally__family_of(tally_store *s, const char *name, size_t len,
                     const struct tally__family **out);
/* The newest family record with pattern hash h (0: none). */
struct tally__family *tally__family_by_hash(tally_store *s, uint32_t h);
uint32_t tally__pattern_hash(const char *p, size_t n); /* never 0 */
bool tally__family_any_idle(tally_store *s);           /* does any family expire? */
/* Every family's live count, recounted from the index: after a holder of
 * the lock was taken over (lock.c). One walk of the index; caller holds
 * the lock. On error (a damaged list or index) some counts are left. */
int tally__family_recount(tally_store *s);

/* ---- cells.c ---- */
/* A cell read as v that is not live: *v becomes what to use. A retired
 * cell is left as it is. An add in flight is waited out: the cell is read
 * again until it is live or retired, for about 2 s at most (10 ms once
 * a wait of this store handle timed out in the last 10 s, so a walk over
 * many such cells ends in time proportional to their number). It is still
 * in flight only if its writer died between its add and its undo; that add
 * was never acknowledged, and the value before it was within 2^32 of the
 * bound: the cell is clamped to the bound (tally__cell_clamp), with a
 * compare-and-swap over the value read, so the wait is paid once. A
 * damaged cell (tally__cell_damaged) is ECORRUPT at once, naming the
 * counter at rec_off and its shard, and never written. */
int tally__cell_wait(tally_store *s, _Atomic int64_t *cell, uint64_t rec_off,
                     uint32_t shard, int64_t *v);
int tally__cell_damage(tally_store *s, uint64_t rec_off, uint32_t shard, int64_t v);
#define TALLY__LOC_SHARDS_MASK 0x3ffull
#define TALLY__LOC_DROPPED     (1ull << 10)
#define TALLY__LOC_CHECK_SHIFT 11
#define TALLY__LOC_CHECK_MASK  0x1fffffull
uint64_t tally__loc_make(tally_store *s, uint64_t rec_off, uint64_t cells,
                         uint32_t nshards, bool dropped);
int tally__loc_decode(tally_store *s, uint64_t rec_off, uint64_t loc, uint64_t *cells,
                      uint32_t *nshards, bool *dropped);
int tally__cells_alloc(tally_store *s, uint32_t nshards, uint64_t *cells);
int tally__classes_check(tally_store *s);
/* The column of the cells at off if they lie in the chunk class nshards
 * is filling now, else -1: a hint, read without the lock (vector.c). */
int64_t tally__cells_column(tally_store *s, uint32_t nshards, uint64_t off);
int tally__cells_check(tally_store *s, uint64_t rec_off, uint64_t loc);

static inline uint32_t tally__loc_shards(uint64_t loc) {
  return (uint32_t)(loc & TALLY__LOC_SHARDS_MASK) + 1;
}
static inline _Atomic int64_t *tally__cell_in(unsigned char *base, uint64_t loc,
                                              uint32_t shard) {
  return (_Atomic int64_t *)(base + ((loc >> 32) << 3) +
                             (uint64_t)shard * TALLY__ROW_BYTES);
}
static inline _Atomic int64_t *tally__cell_at(tally_store *s, uint64_t loc,
                                              uint32_t shard) {
  return tally__cell_in(s->base, loc, shard);
}
/* ---- counter.c ---- */
static inline uint64_t tally__crec(tally_counter *c) {
  return atomic_load_explicit(&c->rec_off, memory_order_acquire);
}

/* vector.c: slot i of v no longer names its handle's cells */
void tally__vector_forget(tally_vector *v, size_t i);
/* Point a handle at loc. A vector slot caching the old cells forgets
 * them, so its next increment takes the handle's path and caches them
 * again; the grace step's forgetting is what lets the old cells be reused
 * (vector.c pairs its stores of the slot with a load of loc, hence
 * seq_cst). */
static inline void tally__handle_set_loc(tally_counter *c, uint64_t loc) {
  uint64_t was = atomic_exchange(&c->loc, loc);
  tally_vector *v = atomic_load_explicit(&c->vec, memory_order_acquire);
  if (v && was != loc) tally__vector_forget(v, c->vslot);
}
/* 0 if the handle's counter is there (re-creating an expired one through
 * it); TALLY_EDROPPED if it was dropped. */
int tally__counter_live(tally_counter *c);
/* ---- autoshard.c ---- */
/* About one increment in 256 of an auto counter (tally__sample_due). */
int tally__auto_sample(tally_counter *c, uint64_t loc); /* returns 0 */
/* Should an automatic counter's increment that saw `old` in `cell` sample
 * for contention? About one in 256, decided by the value (Fibonacci
 * hashing: consecutive values spread evenly), so the fast path touches no
 * memory but the cell: only registers after its atomic add. The cell's
 * address shifts each counter's phase: counters incremented evenly would
 * otherwise all come due at once, and every increment would sample then. */
static inline bool tally__sample_due(int64_t old, const void *cell) {
  return (((uint64_t)old + ((uintptr_t)cell >> 3)) * 0x9E3779B97F4A7C15ull) >> 56 == 0;
}
/* upkeep: shrink an auto counter back to one cell once quiet */
int tally__auto_upkeep(tally_store *s, uint64_t rec_off);
/* Reshard the counter at rec_off to `shards` under the lock (grow_only:
 * unless it already has more); *loc gets its location (move.c). */
int tally__reshard(tally_store *s, uint64_t rec_off, uint32_t shards, bool grow_only,
                   uint64_t *loc);
/* ---- ship.c ---- */
/* Must upkeep keep r (value v) for a flusher that has not shipped v? */
bool tally__ship_holds(tally_store *s, const struct tally__rec *r, int64_t v);
int tally__current(tally_store *s, uint64_t rec_off, uint64_t *loc);
int tally__check_name(const char *name, size_t len);
int tally__rec_value(tally_store *s, uint64_t rec_off, int64_t *out);
/* Each shard's value into vals[0..cap) and the shard count in *n, read
 * as tally__rec_value reads them; *value as it gives it (or ERANGE). */
int tally__rec_cells(tally_store *s, uint64_t rec_off, int64_t *vals, uint32_t cap,
                     uint32_t *n, int64_t *value);
/* Bytes a record of name length len takes. */
_Static_assert(sizeof(struct tally__rec) == 64,
               "a counter record's fixed part is 64 bytes");
static inline uint64_t tally__rec_bytes(size_t len) {
  return sizeof(struct tally__rec) + len + 1;
}
/* ... as alloc_small hands it out, in units of s->small */
static inline uint64_t tally__rec_units(const tally_store *s, size_t len) {
  return tally__round(tally__rec_bytes(len), s->small) / s->small;
}

/* ---- rollup.c, schedule.c ---- */
/* The rollup block and table formats (rollup.c); schedule.c runs the
 * schedules over them and calls rollup.c, never the reverse. */
#define TALLY__SCHED_SLOTS 256

struct tally__sched_slot {  /* one cache line */
  _Atomic uint64_t id;      /* hash of (pattern, every_ms); 0: free */
  _Atomic int64_t done;     /* last period rolled up, + 1; 0: none */
  _Atomic int64_t running;  /* period being rolled up, + 1; 0: none */
  _Atomic uint64_t cursor;  /* of `running`: sort key of the last
                                     member rolled, + 1; 0: none yet */
  _Atomic uint64_t owner;   /* lease: pid << 32 | token; 0: free */
  _Atomic int64_t until;    /* lease expiry, CLOCK_MONOTONIC ms */
  _Atomic int64_t every_ms; /* the schedule's period, for tally info
                                     (0 in stores from before it was kept) */
  uint64_t reserved_;
};

/* How long a schedule's lease lasts without renewal: one period, but not
 * so short that a holder busy with a large store loses it between
 * renewals. A lease ending later than that from now was taken under
 * another boot's monotonic clock. */
static inline int64_t tally__lease_span(int64_t every_ms) {
  return every_ms > 500 ? every_ms : 500;
}

struct tally__rollup_table {
  uint64_t magic;
  uint64_t check; /* keyed by the store's salt */
  uint64_t reserved_[6];
  struct tally__sched_slot slot[TALLY__SCHED_SLOTS];
};

struct tally__ring_hdr {
  uint32_t res_s;
  uint32_t len;
  _Atomic int64_t head; /* newest bucket number + 1; 0: empty */
};

struct tally__block {
  _Atomic uint64_t seq;
  uint32_t check; /* salt, record, rings: see block_check */
  uint32_t nrings;
  _Atomic int64_t value, at_ms, delta, prev_at_ms;
  _Atomic uint64_t count;
  uint64_t reserved_;
  struct tally__ring_hdr ring[];
};

static inline int tally__ring_ok(const tally_ring *r) {
  return r->res_s >= 1 && r->res_s <= TALLY_RING_RES_MAX && r->len >= 1 &&
         r->len <= TALLY_RING_LEN_MAX;
}
static inline _Atomic int64_t *tally__slots_at(struct tally__block *b) {
  return (_Atomic int64_t *)(void *)&b->ring[b->nrings];
}
/* The record's block, validated (ECORRUPT if not); *out NULL if it has none. */
int tally__block_of(tally_store *s, uint64_t rec_off, struct tally__block **out);
/* The record's latest rollup without waiting on a write in progress:
 * TALLY_ENOROLLUP (none yet) and TALLY_EBUSY (being written) set no error
 * text; TALLY_ECORRUPT for a damaged block. */
int tally__rec_rolled(tally_store *s, uint64_t rec_off, tally_rollup *out);
/* Is the block at off, of record rec_off, whole (ring count, rings, heads,
 * check, all inside the arena)? */
uint64_t tally__block_bytes(const struct tally__block *b);
bool tally__block_sound(tally_store *s, uint64_t off, uint64_t rec_off,
                        const struct tally__block *b);
/* The store's rollup table, created if `create` (caller holds the lock);
 * *out NULL if there is none yet. */
int tally__table_of(tally_store *s, bool create, struct tally__rollup_table **out);
/* Claim b for writing (its seq odd); returns the odd seq to release with. */
uint64_t tally__block_claim(struct tally__block *b);
static inline void tally__block_release(struct tally__block *b, uint64_t odd) {
  atomic_store_explicit(&b->seq, odd + 1, memory_order_release);
}
/* Give rec_off a block with the union of its rings and `rings`, record and
 * history carried over; EINVAL (nothing done) past TALLY_RINGS_MAX rings.
 * Caller holds the lock. */
int tally__block_grow(tally_store *s, uint64_t rec_off, struct tally__block *old,
                      const tally_ring *rings, uint32_t nrings);
/* A moment and the bucket it falls in for each ring shape met so far. A
 * 64-bit division costs tens of cycles, and a tick would make several per
 * ring of every counter for the same answer: it makes one per shape. */
struct tally__when {
  int64_t now_ms;
  uint32_t n;
  struct {
    uint32_t res_s, len;
    int64_t bucket; /* now_ms / (res_s * 1000) */
    uint32_t index; /* bucket % len */
  } ring[TALLY_RINGS_MAX];
};
static inline void tally__when_init(struct tally__when *w, int64_t now_ms) {
  w->now_ms = now_ms;
  w->n = 0;
}
/* The bucket of w->now_ms in a ring of res_s and len (both > 0). */
int64_t tally__when_bucket(struct tally__when *w, uint32_t res_s, uint32_t len,
                           uint32_t *index);
/* Roll claimed b up to value v at w->now_ms; *r gets the new record. */
void tally__block_roll(struct tally__block *b, int64_t v, struct tally__when *w,
                       tally_rollup *r);
int tally__rollups_check(tally_store *s, uint64_t rec_off); /* one record's block */
int tally__rollup_table_check(tally_store *s);
int tally__schedules_check(tally_store *s); /* schedule.c: every slot's words */
int tally__rollup_schedules(tally_store *s,
                            uint32_t *n); /* identities kept (schedule.c) */

#endif
