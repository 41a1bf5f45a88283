/* cells.c -- where a counter's cells are: location words and columns.
 *
 * A location word packs the cells' offset, the shard count, a dropped bit
 * and a 21-bit check keyed by the record and the store's salt, so a
 * reshard publishes cells and shard count with one atomic store, and a
 * damaged or misplaced word is caught before it is followed.
 *
 * Cells come in chunks of one shard count (a class): ROW_CELLS columns of
 * n rows (see internal.h for why). A counter takes one column; a column
 * retired by a move comes back through limbo (space.c) and is handed out
 * again before a chunk's fresh columns.
 */
#include "internal.h"

#include <sched.h>
#include <time.h>

static uint64_t loc_check(tally_store *s, uint64_t rec_off, uint64_t cells, uint32_t n,
                          bool dropped) {
  uint64_t h =
      tally__mix(s->hdr->salt ^ rec_off ^ (cells << 21) ^ ((uint64_t)n << 1) ^ dropped);
  return h & TALLY__LOC_CHECK_MASK;
}

uint64_t tally__loc_make(tally_store *s, uint64_t rec_off, uint64_t cells, uint32_t n,
                         bool dropped) {
  return (cells >> 3) << 32 |
         loc_check(s, rec_off, cells, n, dropped) << TALLY__LOC_CHECK_SHIFT |
         (dropped ? TALLY__LOC_DROPPED : 0) | (uint64_t)(n - 1);
}

int tally__loc_decode(tally_store *s, uint64_t rec_off, uint64_t loc, uint64_t *cells,
                      uint32_t *n, bool *dropped) {
  uint64_t c = (loc >> 32) << 3;
  uint32_t k = (uint32_t)(loc & TALLY__LOC_SHARDS_MASK) + 1;
  bool d = (loc & TALLY__LOC_DROPPED) != 0;
  if (((loc >> TALLY__LOC_CHECK_SHIFT) & TALLY__LOC_CHECK_MASK) !=
          loc_check(s, rec_off, c, k, d) ||
      !tally__in_arena(s, c, (uint64_t)(k - 1) * TALLY__ROW_BYTES + 8))
    return tally__fail(TALLY_ECORRUPT,
                       "%s: tally store is corrupt (cell "
                       "location of the counter at offset %llu)",
                       tally__store_name(s), (unsigned long long)rec_off);
  *cells = c;
  *n = k;
  *dropped = d;
  return 0;
}

/* A fresh column of cells for a counter of n shards. Caller holds the lock. */
static uint64_t class_word(const tally_store *s, uint32_t n, uint64_t chunk,
                           uint32_t cols) {
  uint64_t check =
      tally__mix(s->hdr->salt ^ (uint64_t)n << 48 ^ chunk ^ (uint64_t)cols << 36) &
      0x1ffffff;
  return (chunk >> 6) << 35 | (uint64_t)cols << 25 | check;
}

/* Class n's chunk being filled (0: none) and its used columns, checked. */
static int class_get(tally_store *s, uint32_t n, uint64_t *chunk, uint32_t *cols) {
  uint64_t w = atomic_load_explicit(&s->classes[n - 1].word, memory_order_acquire);
  uint64_t c = (w >> 35) << 6;
  uint32_t k = (uint32_t)(w >> 25) & 0x3ff;
  if (w && (class_word(s, n, c, k) != w || k > TALLY__ROW_CELLS ||
            !tally__in_arena(s, c, (uint64_t)n * TALLY__ROW_BYTES)))
    return tally__fail(TALLY_ECORRUPT,
                       "%s: tally store is corrupt (class "
                       "table entry %u)",
                       tally__store_name(s), n);
  *chunk = w ? c : 0;
  *cols = w ? k : 0;
  return 0;
}

int tally__classes_check(tally_store *s) {
  uint64_t chunk;
  uint32_t cols;
  for (uint32_t n = 1; n <= TALLY_MAX_SHARDS; n++) {
    int rc = class_get(s, n, &chunk, &cols);
    if (rc) return rc;
  }
  return 0;
}

int64_t tally__cells_column(tally_store *s, uint32_t n, uint64_t off) {
  if (n < 1 || n > TALLY_MAX_SHARDS) return -1;
  uint64_t w = atomic_load_explicit(&s->classes[n - 1].word, memory_order_acquire);
  uint64_t chunk = (w >> 35) << 6;
  if (!w || off < chunk || off >= chunk + (uint64_t)TALLY__ROW_CELLS * 8) return -1;
  return (int64_t)((off - chunk) / 8);
}

int tally__cells_alloc(tally_store *s, uint32_t n, uint64_t *out) {
  uint64_t chunk = 0;
  uint32_t cols = 0; /* class_get sets both; GCC 12 cannot always tell */
  int rc = tally__column_pop(s, n, out);
  if (rc || *out) return rc;
  rc = class_get(s, n, &chunk, &cols);
  if (rc) return rc;
  if (!chunk || cols == TALLY__ROW_CELLS) {
    if ((rc = tally__alloc(s, (uint64_t)n * TALLY__ROW_BYTES, &chunk))) return rc;
    cols = 0;
  }
  uint64_t off = chunk + (uint64_t)cols * 8;
  for (uint32_t i = 0; i < n; i++)
    if (atomic_load((_Atomic int64_t *)(s->base + off + (uint64_t)i * TALLY__ROW_BYTES)))
      return tally__fail(TALLY_ECORRUPT,
                         "%s: tally store is corrupt (class "
                         "table entry %u hands out used cells)",
                         tally__store_name(s), n);
  /* one store: a crash before it leaks at most this chunk or column */
  atomic_store_explicit(&s->classes[n - 1].word, class_word(s, n, chunk, cols + 1),
                        memory_order_release);
  *out = off;
  return 0;
}

int tally__cell_damage(tally_store *s, uint64_t rec_off, uint32_t shard, int64_t v) {
  const struct tally__rec *r = tally__at(s, rec_off);
  return tally__fail(TALLY_ECORRUPT,
                     "%s: tally store is corrupt (counter '%.*s' shard %u holds "
                     "%lld, farther outside the live range than an interrupted "
                     "add leaves: the file was damaged)",
                     tally__store_name(s), (int)r->name_len, r->name, shard,
                     (long long)v);
}

int tally__cell_wait(tally_store *s, _Atomic int64_t *cell, uint64_t rec_off,
                     uint32_t shard, int64_t *v) {
  int64_t x = *v, t0 = 0;
  while (!tally__cell_live(x) && !tally__cell_retired(x)) {
    if (tally__cell_damaged(x)) return tally__cell_damage(s, rec_off, shard, x);
    int64_t now = tally_monotonic_ms(), stuck = atomic_load(&s->stuck_ms);
    if (!t0) t0 = now;
    /* a preempted writer needs the CPU to finish its undo: 2 s, or 10 ms
     * while dead writers' cells are being met (each costs it once) */
    int64_t limit = stuck && now - stuck < 10000 ? 10 : 2000;
    if (now - t0 < limit) {
      sched_yield();
      x = atomic_load_explicit(cell, memory_order_acquire);
      continue;
    }
    atomic_store(&s->stuck_ms, now);
    /* it died between add and undo. Repair the cell, so no later reader
     * or writer waits again: swap in the clamped value, only if the cell
     * still holds what was read (a live or retired value, or another add,
     * is left alone). An add in flight at that instant is undone from the
     * clamped value: the clamp is already inexact by up to 2^32. */
    int64_t want = tally__cell_clamp(x);
    if (atomic_compare_exchange_strong_explicit(cell, &x, want, memory_order_acq_rel,
                                                memory_order_acquire))
      x = want;
  }
  *v = x;
  return 0;
}

/* Every cell of the counter at rec_off is live or retired, or ECORRUPT
 * naming the first that is not. A cell caught in a writer's out-of-range
 * window (nanoseconds) is given a moment to come back first. */
int tally__cells_check(tally_store *s, uint64_t rec_off, uint64_t loc) {
  const struct tally__rec *r = tally__at(s, rec_off);
  for (uint32_t i = 0, n = tally__loc_shards(loc); i < n; i++) {
    _Atomic int64_t *cell = tally__cell_at(s, loc, i);
    int64_t v = atomic_load_explicit(cell, memory_order_acquire);
    for (int tries = 0; tries < 100 && tally__cell_inflight(v); tries++) {
      struct timespec ms = {0, 100000};
      nanosleep(&ms, NULL);
      v = atomic_load_explicit(cell, memory_order_acquire);
    }
    if (tally__cell_damaged(v)) return tally__cell_damage(s, rec_off, i, v);
    if (tally__cell_inflight(v))
      return tally__fail(
          TALLY_ECORRUPT,
          "%s: tally store is corrupt (counter "
          "'%.*s' shard %u holds %lld, just outside the live range: a "
          "writer died mid-increment; the next read clamps and repairs it)",
          tally__store_name(s), (int)r->name_len, r->name, i, (long long)v);
  }
  return 0;
}
