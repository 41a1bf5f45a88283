/* internal.h -- what the core's files share: the store layout and helpers.
 *
 * A store is one contiguous mapping (a shared file, or anonymous memory for
 * the memory store) addressed by byte offsets, so the same layout works in
 * every process that maps it:
 *
 *   [0, 4096)         header: immutable part (magic, format, layout, salt,
 *                     checksum) then mutable words on their own lines
 *   [4096, 20480)     class table: for each shard count n, the chunk being
 *                     filled and how many of its columns are handed out
 *   [20480, 28672)    move journal: old cell values of the move in progress
 *   [28672, used)     arena: counter records, index tables, family records
 *                     and cell chunks, bump-allocated under the store lock
 *
 * Cells use a per-CPU-like layout. A chunk of class n holds ROW_CELLS
 * counters of n shards as n rows; shard s of the counter in column c is
 * at chunk + s * ROW_BYTES + c * 8. Writers on different shards therefore
 * never share a cache line, yet a counter costs exactly 8 bytes a shard.
 * ROW_BYTES is 4096 + 64 so the shards of one counter fall in different
 * L1 sets when value() walks them.
 */
#ifndef TALLY_INTERNAL_H
#define TALLY_INTERNAL_H

#include "tally.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#define TALLY__MAGIC        "\x89TALLY\r\n"
#define TALLY__FORMAT       2u
#define TALLY__BYTE_ORDER   0x01020304u
#define TALLY__HEADER_BYTES 4096u
#define TALLY__CLASS_OFF    4096u
#define TALLY__JOURNAL_OFF  (TALLY__CLASS_OFF + TALLY_MAX_SHARDS * 16u)
#define TALLY__ARENA_OFF    (TALLY__JOURNAL_OFF + TALLY_MAX_SHARDS * 8u)
#define TALLY__ROW_CELLS    520u
#define TALLY__ROW_BYTES    (TALLY__ROW_CELLS * 8u)
#define TALLY__MAX_BYTES    (32ull << 30) /* offsets >> 3 fit in 32 bits */

/* A live cell holds a value in [-2^62, 2^62): bits 63 and 62 agree. A move
 * (reshard, drop) retires a cell by swapping in SENTINEL, deep inside the
 * other range, after saving its value in the move journal. An increment
 * is one fetch-add. If the old value was retired, the add is not undone:
 * a retired cell's content no longer counts (the journal has its value,
 * and an undone move writes that back), and an undo could land after the
 * cell was restored and journalled again. The writer goes to find the
 * counter's new cells. Stale writers add at most 2^32 each, so a retired
 * cell stays within 2^60 of SENTINEL. If the new value left the range,
 * the add is undone. */
#define TALLY__SENTINEL   (-(INT64_C(3) << 61))
#define TALLY__FAST_DELTA (INT64_C(1) << 32)
static inline bool tally__cell_live(int64_t v) {
  return (((uint64_t)v ^ ((uint64_t)v << 1)) >> 63) == 0;
}
/* Retired: within 2^60 of SENTINEL. A cell that is neither live nor retired
 * holds a live value that a writer's add just pushed out of range; the
 * writer is about to undo it (tally__cell_settle waits for that). */
static inline bool tally__cell_retired(int64_t v) {
  return (uint64_t)v - (uint64_t)TALLY__SENTINEL + (UINT64_C(1) << 60) <
         (UINT64_C(1) << 61);
}
/* Wait out an add in flight past the range: re-read the cell (v is what
 * was read) until it is live or retired, for about 2 s at most, and
 * return the last value read. It is neither only if the writer died
 * between its add and its undo; tally__cell_clamp then gives the value to
 * use: that add was never acknowledged, and the value before it was within
 * 2^32 of the bound. Then it also stores that value in the cell (a
 * compare-and-swap: only over the value read), so the wait is paid once. */
int64_t tally__cell_wait(_Atomic int64_t *cell, int64_t v);
static inline int64_t tally__cell_clamp(int64_t v) {
  if (tally__cell_live(v)) return v;
  return v < 0 ? -(INT64_C(1) << 62) : (INT64_C(1) << 62) - 1;
}

struct tally__header {
  char magic[8];
  uint32_t format;
  uint32_t header_bytes;
  uint32_t cell_bytes;
  uint32_t row_cells;
  uint32_t max_shards;
  uint32_t byte_order;
  uint64_t max_bytes;
  uint64_t arena_off;
  uint64_t salt;  /* random per store: seeds location checks */
  uint64_t check; /* hash of every byte above */
  char pad0_[64];
  /* mutable, written under the store lock (readers load them atomically) */
  _Atomic uint64_t size;       /* bytes backed by the file */
  _Atomic uint64_t used;       /* arena bump pointer */
  _Atomic uint64_t index;      /* sealed offset of the current index table */
  _Atomic uint64_t families;   /* sealed offset of the newest family, or 0 */
  _Atomic uint64_t retired;    /* bytes of cells left behind */
  _Atomic uint64_t pend_rec;   /* sealed record offset (extra: pend_loc), or 0 */
  _Atomic uint64_t pend_loc;   /* where it is moving (a loc word) */
  _Atomic uint64_t pend_done;  /* old cells retired into the journal */
  _Atomic uint64_t rollups;    /* sealed offset of the rollup table, or 0 */
  _Atomic uint64_t generation; /* bumped by every create and drop */
  /* thread tickets: the only word writers touch outside the lock */
  _Alignas(64) _Atomic uint64_t writers;
};

/* One word, so a chunk and its count of used columns change together and
 * a damaged entry is caught: chunk >> 6 in bits 35..63, used columns in
 * 25..34, a check in 0..24; 0 means no chunk yet. See cells.c. */
struct tally__class {
  _Atomic uint64_t word;
  uint64_t reserved_;
};

/* A counter record. loc packs where the cells are, so a reshard publishes
 * cells and shard count with one atomic store:
 *   bits 0..9 shards-1, bit 10 dropped, bits 11..31 check, 32..63 off>>3. */
struct tally__rec {
  _Atomic uint64_t loc;
  _Atomic uint64_t rollup; /* sealed offset of its rollup block, or 0 */
  uint32_t check;          /* hash of policy, kind, name_len, name */
  uint8_t policy;
  uint8_t kind; /* TALLY__KIND_COUNTER */
  uint16_t name_len;
  char name[]; /* name_len bytes and a NUL */
};
#define TALLY__KIND_COUNTER 0xC7
#define TALLY__KIND_FAMILY  0xF4

struct tally__family {
  uint64_t next; /* older family, or 0 */
  uint32_t check;
  uint8_t policy; /* 0xFF: unset */
  uint8_t kind;   /* TALLY__KIND_FAMILY */
  uint16_t pattern_len;
  uint32_t shards; /* 0: unset */
  uint32_t pad_;
  char pattern[];
};

/* Open-addressed name index; see index.c for the entry format. */
#define TALLY__INDEX_MAGIC 0x5844494f594c4154ull /* "TALYOIDX" */
struct tally__index {
  uint64_t magic;
  uint64_t cap;
  uint64_t live;
  uint64_t deleted;
  _Atomic uint64_t entries[];
};

enum { TALLY__MEMORY = 0, TALLY__FILE = 1 };

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
  bool lock_stale;          /* forked: fd's flock is shared with the parent */
  uint64_t id;              /* unique in this process (thread tickets) */
  tally_store *prev, *next; /* open stores, for fork handling */
};

struct tally_counter {
  /* the increment's hot path reads only this first line */
  _Atomic uint64_t loc; /* cached copy of rec->loc (acquire/release:
                                   free on x86, and it orders the cells) */
  unsigned char *base;  /* s->base */
  tally_store *s;
  uint64_t store_id; /* s->id, for the thread ticket check */
  int policy;
  struct tally__rec *rec;
  uint64_t rec_off;
};

/* ---- error.c ---- */
int tally__fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int tally__fail_sys(const char *what, const char *path);

/* ---- hash.c ---- */
uint64_t tally__hash(const void *data, size_t len, uint64_t seed);
uint64_t tally__mix(uint64_t x);

/* ---- policy.c ---- */
/* Per-thread writer state, inline here because picking a shard is on the
 * increment's hot path. */
struct tally__writer {
  uint64_t store_id; /* store the ticket was drawn from, 0: none */
  uint64_t ticket;
  uint64_t rr;  /* round-robin position */
  uint64_t rng; /* xorshift64* state, 0: unseeded */
};
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
  struct tally__writer *me = &tally__me;
  if (policy == TALLY_POLICY_RANDOM) {
    if (__builtin_expect(me->rng == 0, 0)) tally__seed_random();
    me->rng ^= me->rng >> 12;
    me->rng ^= me->rng << 25;
    me->rng ^= me->rng >> 27;
    return (uint32_t)((((me->rng * 0x2545f4914f6cdd1dull) >> 32) * n) >> 32);
  }
  if (__builtin_expect(me->store_id != store_id, 0)) tally__draw_ticket(s);
  if (policy == TALLY_POLICY_ROUND_ROBIN) return tally__reduce(me->rr++, n);
  return tally__reduce(me->ticket, n); /* thread */
}

/* ---- arena.c ---- */
/* A sealed word: an arena offset with a 32-bit check keyed by the store's
 * salt, the field it lives in and `extra`, so a damaged pointer is caught
 * even when it lands on another valid record. 0 stays 0 ("none"). */
enum {
  TALLY__SEAL_INDEX = 1,
  TALLY__SEAL_FAMILIES = 2,
  TALLY__SEAL_MOVE = 3,
  TALLY__SEAL_ROLLUPS = 4,
  TALLY__SEAL_ROLLUP = 5
};
uint64_t tally__seal(const tally_store *s, int field, uint64_t off, uint64_t extra);
int tally__unseal(const tally_store *s, int field, uint64_t word, uint64_t extra,
                  uint64_t *off);
uint64_t tally__header_check(const struct tally__header *h);
const char *tally__store_name(const tally_store *s); /* for messages */
int tally__truncated(tally_store *s);                /* ECORRUPT if the file shrank */
int tally__alloc(tally_store *s, uint64_t bytes, uint64_t *off);
static inline void *tally__at(const tally_store *s, uint64_t off) {
  return s->base + off;
}
/* Is [off, off + len) inside the allocated arena? */
bool tally__in_arena(const tally_store *s, uint64_t off, uint64_t len);

/* ---- lock.c ---- */
int tally__lock(tally_store *s); /* also finishes a pending move */
void tally__unlock(tally_store *s);
void tally__registry_add(tally_store *s); /* open stores, for fork() */
void tally__registry_remove(tally_store *s);

/* ---- journal.c ---- */
/* Record and make the move of rec_off's counter to location `to` (new
 * cells, or its cells marked dropped). Caller holds the lock. */
int tally__journal_move(tally_store *s, uint64_t rec_off, uint64_t to);
int tally__journal_finish(tally_store *s); /* a pending move; caller holds the lock */
bool tally__fits_shards(__int128 total, uint32_t n); /* over n cells' range */

/* ---- index.c ---- */
int tally__index_create(tally_store *s);
int tally__index_find(tally_store *s, const char *name, size_t len, uint64_t hash,
                      uint64_t *rec_off);
int tally__index_insert(tally_store *s, uint64_t hash, uint64_t rec_off);
void tally__index_remove(tally_store *s, uint64_t rec_off);
int tally__index_check(tally_store *s); /* the table header */
int tally__rec_verify(tally_store *s, uint64_t rec_off);
typedef int (*tally__rec_fn)(tally_store *s, uint64_t rec_off, void *ud);
int tally__index_each(tally_store *s, tally__rec_fn fn, void *ud);
uint32_t tally__rec_checksum(const struct tally__rec *r);

/* ---- family.c ---- */
int tally__family_check(tally_store *s);

/* ---- cells.c ---- */
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
int tally__current(tally_store *s, uint64_t rec_off, uint64_t *loc);
int tally__check_name(const char *name, size_t len);
int tally__rec_value(tally_store *s, uint64_t rec_off, int64_t *out);

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
/* Is the block at off, of record rec_off, whole (ring count, rings, heads,
 * check, all inside the arena)? */
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
/* Roll claimed b up to value v at now_ms; *r gets the new record. */
void tally__block_roll(struct tally__block *b, int64_t v, int64_t now_ms,
                       tally_rollup *r);
int tally__rollups_check(tally_store *s, uint64_t rec_off); /* one record's block */
int tally__rollup_table_check(tally_store *s);
int tally__rollup_schedules(tally_store *s,
                            uint32_t *n); /* identities kept (schedule.c) */

#endif
