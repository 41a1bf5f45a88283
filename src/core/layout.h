/* layout.h -- a store's bytes: the layout every process that maps the
 * store shares (the header, class table, records, families, name index,
 * and what a cell's value means). A change here is a new format.
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
 *   [28672, used)     arena: counter records, index tables, family records,
 *                     cell chunks and the process table, allocated under the
 *                     store lock; what is retired goes through limbo (a
 *                     grace period) to free lists and is handed out again
 *                     (space.c, grace.c)
 *
 * Cells use a per-CPU-like layout. A chunk of class n holds ROW_CELLS
 * counters of n shards as n rows; shard s of the counter in column c is
 * at chunk + s * ROW_BYTES + c * 8. Writers on different shards therefore
 * never share a cache line, yet a counter costs exactly 8 bytes a shard.
 * ROW_BYTES is 4096 + 64 so the shards of one counter fall in different
 * L1 sets when value() walks them.
 */
#ifndef TALLY_LAYOUT_H
#define TALLY_LAYOUT_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "tally.h"

#define TALLY__MAGIC          "\x89TALLY\r\n"
#define TALLY__FORMAT         9u /* 7 and 8 still open: see the next two */
#define TALLY__FORMAT_FLOCK   7u /* its store lock is flock() */
#define TALLY__FORMAT_SMALL16 8u /* up to it, records come in 16-byte units */
#define TALLY__BYTE_ORDER     0x01020304u
#define TALLY__HEADER_BYTES   4096u
#define TALLY__CPU_WORDS      ((TALLY_MAX_SHARDS / 2 + 63) / 64) /* cpu_seen */
#define TALLY__CLASS_OFF      4096u
#define TALLY__JOURNAL_OFF    (TALLY__CLASS_OFF + TALLY_MAX_SHARDS * 16u)
#define TALLY__ARENA_OFF      (TALLY__JOURNAL_OFF + TALLY_MAX_SHARDS * 8u)
#define TALLY__ROW_CELLS      520u
#define TALLY__ROW_BYTES      (TALLY__ROW_CELLS * 8u)
#define TALLY__MAX_BYTES      (32ull << 30) /* offsets >> 3 fit in 32 bits */
#define TALLY__PIECE_CLASSES  64u           /* sizes with a free list each */
#define TALLY__PROCS          1024u         /* processes with a store open */

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
#define TALLY__FAST_CPU   8 /* struct tally_counter.fast of a cpu counter */
static inline bool tally__cell_live(int64_t v) {
  return (((uint64_t)v ^ ((uint64_t)v << 1)) >> 63) == 0;
}
/* Retired: within 2^60 of SENTINEL. */
static inline bool tally__cell_retired(int64_t v) {
  return (uint64_t)v - (uint64_t)TALLY__SENTINEL + (UINT64_C(1) << 60) <
         (UINT64_C(1) << 61);
}
/* In flight: past the live range by less than TALLY__INFLIGHT. Each add
 * that can leave the range is a fast one, under 2^32 (larger deltas go
 * through a compare-and-swap that never leaves it), and each thread has
 * one add at a time in flight between its fetch-add and its undo. Linux
 * runs at most 2^22 threads at once (PID_MAX_LIMIT), so live values plus
 * every add in flight stay within 2^22 * 2^32 = 2^54 of the range: only
 * such a cell can be a writer's add that is about to be undone (or that a
 * killed writer left). Anything else that is neither live nor retired was
 * never written by tally: the file is damaged. */
#define TALLY__INFLIGHT (INT64_C(1) << 54)
static inline bool tally__cell_inflight(int64_t v) {
  return !tally__cell_live(v) && (v < 0 ? v >= -(INT64_C(1) << 62) - TALLY__INFLIGHT
                                        : v < (INT64_C(1) << 62) + TALLY__INFLIGHT);
}
static inline bool tally__cell_damaged(int64_t v) {
  return !tally__cell_live(v) && !tally__cell_retired(v) && !tally__cell_inflight(v);
}
static inline int64_t tally__cell_clamp(int64_t v) {
  if (tally__cell_live(v)) return v;
  return v < 0 ? -(INT64_C(1) << 62) : (INT64_C(1) << 62) - 1;
}

/* A registration: writer W ships the counters matching pattern from this
 * store, so they expire only once their value has been shipped. Written
 * under the store lock; id is stored last (0: free). */
#define TALLY__SHIPPERS         8
#define TALLY__SHIP_PATTERN_MAX 112
struct tally__shipper {
  _Atomic uint64_t id; /* hash of (writer, pattern), never 0; 0: free */
  uint64_t writer;     /* hash of the writer id */
  uint32_t pattern_len;
  uint32_t reserved_;
  char pattern[TALLY__SHIP_PATTERN_MAX];
};

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
  _Atomic uint64_t retired;    /* bytes in limbo: retired, not yet reusable */
  _Atomic uint64_t pend_rec;   /* sealed record offset (extra: pend_loc), or 0 */
  _Atomic uint64_t pend_loc;   /* where it is moving (a loc word) */
  _Atomic uint64_t pend_done;  /* old cells retired into the journal */
  _Atomic uint64_t rollups;    /* sealed offset of the rollup table, or 0 */
  _Atomic uint64_t generation; /* bumped by every create and drop */
  /* lifecycle (space.c, grace.c, expire.c) */
  _Atomic uint64_t epoch;      /* grace periods: a step bumps it past what was retired */
  _Atomic uint64_t limbo_head; /* sealed: oldest limbo node, or 0 */
  _Atomic uint64_t limbo_tail; /* sealed: newest limbo node, or 0 */
  _Atomic uint64_t procs;      /* sealed offset of the process table */
  _Atomic uint64_t free_bytes; /* bytes on the free lists: reusable now */
  _Atomic uint64_t reused;     /* bytes handed out again, in all */
  _Atomic uint64_t expired;    /* counters expired for idleness, in all */
  _Atomic uint64_t capped;     /* new names sent to an overflow counter */
  _Atomic uint64_t pend_cond;  /* 1: the pending move is a drop that only
                                   happens if the value is pend_expect */
  _Atomic int64_t pend_expect;
  _Atomic int64_t tombstone; /* a cell that stays retired: handles of
                                   counters gone for good point here */
  /* free lists (space.c), heads sealed: small pieces by 16-byte units,
   * aligned ones by 64-byte units ([0] unused), larger aligned ones in
   * buckets by size */
  _Atomic uint64_t free_small[TALLY__PIECE_CLASSES];
  _Atomic uint64_t free_aligned[TALLY__PIECE_CLASSES];
  _Atomic uint64_t free_big[TALLY__PIECE_CLASSES];
  /* a large free piece being carved into pieces of other sizes (space.c):
   * [carve_cur, carve_end) is free; carve_cur 0: none */
  _Atomic uint64_t carve_cur, carve_end;
  /* flushers that ship counters of this store (ship.c) */
  struct tally__shipper shippers[TALLY__SHIPPERS];
  _Atomic uint64_t ship_all; /* 1: the table overflowed: every counter
                                 counts as covered by a flusher */
  _Atomic uint64_t autos;    /* 1: some counter has automatic shards */
  _Atomic uint64_t wslots;   /* sealed offset of the writer slots (batch.c), or 0 */
  /* thread tickets: the only word writers touch outside the lock */
  _Alignas(64) _Atomic uint64_t writers;
  /* format 8: the store lock (lock.c), on a line of its own; format 7
   * writes lock_owner beside its flock(), to see a holder that died */
  _Alignas(64) _Atomic uint64_t lock_owner; /* the holder's owner word, 0: free */
  _Atomic uint32_t lock_sleepers;           /* futex word: 1 if a waiter may sleep */
  /* cpu policy (percpu.c): non-zero while a move of a cpu counter retires
   * cells; every per-CPU sequence reads it, so it has a line of its own,
   * shared with cpu_seen (set once per CPU), that moves write (0 in files
   * made before the policy) */
  _Alignas(64) _Atomic uint64_t cpu_fence;
  /* ... and the CPUs sequences have run on, a bit each (set by the first
   * increment on a CPU, which gives up; never by a sequence): a move
   * fences these CPUs only, so a store used within a cpuset moves its
   * counters (0 in files made before: a move then sets nothing to pass) */
  _Atomic uint64_t cpu_seen[TALLY__CPU_WORDS];
};
_Static_assert(sizeof(struct tally__header) <= TALLY__HEADER_BYTES, "the header fits");

/* One word, so a chunk and its count of used columns change together and
 * a damaged entry is caught: chunk >> 6 in bits 35..63, used columns in
 * 25..34, a check in 0..24; 0 means no chunk yet. See cells.c. */
struct tally__class {
  _Atomic uint64_t word;
  _Atomic uint64_t free; /* sealed: a free column of this class, or 0 */
};

/* A counter record. loc packs where the cells are, so a reshard publishes
 * cells and shard count with one atomic store:
 *   bits 0..9 shards-1, bit 10 dropped, bits 11..31 check, 32..63 off>>3. */
struct tally__rec { /* 64 bytes and the name: keep it so (test_footprint) */
  _Atomic uint64_t loc;
  _Atomic uint64_t rollup;     /* sealed offset of its rollup block, or 0 */
  _Atomic int64_t idle_value;  /* expiry: the value when last seen moving */
  _Atomic int64_t shipped;     /* the value a flusher has confirmed shipped
                                   (ship.c); 0 until one does */
  _Atomic uint64_t contention; /* auto shards (autoshard.c): last sample's
                                   writer, hits, its time, and when two
                                   writers were last seen on it */
  uint64_t incarnation;        /* random at creation: a re-created counter
                                   of the same name has another */
  _Atomic uint32_t flags;      /* TALLY__REC_*, and the kind (top byte) */
  uint32_t family;             /* hash of the pattern of the family it was
                                   created under (caps), 0: none */
  _Atomic uint32_t idle_since; /* ... since when: whole seconds of the
                                   caller's clock, rounded up, + 1; 0: not
                                   yet (expire.c) */
  uint16_t check;              /* hash of the fixed fields and name */
  uint8_t policy;
  uint8_t name_len; /* TALLY_NAME_MAX is 255 */
  char name[];      /* name_len bytes and a NUL */
};
#define TALLY__KIND_COUNTER     0xC7
#define TALLY__KIND_FAMILY      0xF4
#define TALLY__REC_EXPIRED      0x1u /* its drop was an expiry: handles re-create it */
#define TALLY__REC_LIMBO        0x2u /* its drop put it in limbo (exactly once) */
#define TALLY__REC_AUTO         0x8u /* TALLY_SHARDS_AUTO (autoshard.c) */
/* flags bits 4..13: automatic grows, 14..23: shrinks (saturating at
 * 1023); 24..31: the kind, TALLY__KIND_COUNTER, set at creation */
#define TALLY__REC_GROWN_SHIFT  4
#define TALLY__REC_SHRUNK_SHIFT 14
#define TALLY__REC_KIND_SHIFT   24

struct tally__family {
  uint64_t next; /* older family, or 0 */
  uint32_t check;
  uint8_t policy; /* 0xFF: unset */
  uint8_t kind;   /* TALLY__KIND_FAMILY */
  uint16_t pattern_len;
  uint32_t shards;       /* 0: unset */
  uint32_t idle_s;       /* expire counters idle this long; 0: never */
  uint64_t max_counters; /* cap on live counters; 0: none */
  _Atomic uint64_t live; /* live counters created under this pattern
                            (kept by the newest record of the pattern;
                            not in check: it changes) */
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

#endif
