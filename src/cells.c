/* cells.c -- where a counter's cells are: location words and columns.
 *
 * A location word packs the cells' offset, the shard count, a dropped bit
 * and a 21-bit check keyed by the record and the store's salt, so a
 * reshard publishes cells and shard count with one atomic store, and a
 * damaged or misplaced word is caught before it is followed.
 *
 * Cells come in chunks of one shard count (a class): ROW_CELLS columns of
 * n rows (see internal.h for why). A counter takes one column; columns are
 * handed out once and never reused.
 */
#include "internal.h"

static uint64_t loc_check(tally_store *s, uint64_t rec_off, uint64_t cells,
                          uint32_t n, bool dropped) {
  uint64_t h = tally__mix(s->hdr->salt ^ rec_off ^ (cells << 21) ^
                          ((uint64_t)n << 1) ^ dropped);
  return h & TALLY__LOC_CHECK_MASK;
}

uint64_t tally__loc_make(tally_store *s, uint64_t rec_off, uint64_t cells,
                         uint32_t n, bool dropped) {
  return (cells >> 3) << 32 |
         loc_check(s, rec_off, cells, n, dropped) << TALLY__LOC_CHECK_SHIFT |
         (dropped ? TALLY__LOC_DROPPED : 0) | (uint64_t)(n - 1);
}

int tally__loc_decode(tally_store *s, uint64_t rec_off, uint64_t loc,
                      uint64_t *cells, uint32_t *n, bool *dropped) {
  uint64_t c = (loc >> 32) << 3;
  uint32_t k = (uint32_t)(loc & TALLY__LOC_SHARDS_MASK) + 1;
  bool d = (loc & TALLY__LOC_DROPPED) != 0;
  if (((loc >> TALLY__LOC_CHECK_SHIFT) & TALLY__LOC_CHECK_MASK) != loc_check(s, rec_off, c, k, d) ||
      !tally__in_arena(s, c, (uint64_t)(k - 1) * TALLY__ROW_BYTES + 8))
    return tally__fail(TALLY_ECORRUPT, "%s: tally store is corrupt (cell "
                       "location of the counter at offset %llu)", tally__store_name(s),
                       (unsigned long long)rec_off);
  *cells = c;
  *n = k;
  *dropped = d;
  return 0;
}

/* A fresh column of cells for a counter of n shards. Caller holds the lock. */
int tally__cells_alloc(tally_store *s, uint32_t n, uint64_t *out) {
  struct tally__class *k = &s->classes[n - 1];
  uint64_t chunk = atomic_load(&k->chunk);
  uint32_t cols = atomic_load(&k->used_cols);
  uint64_t chunk_bytes = (uint64_t)n * TALLY__ROW_BYTES;
  if (chunk && (!tally__in_arena(s, chunk, chunk_bytes) ||
                cols > TALLY__ROW_CELLS))
    return tally__fail(TALLY_ECORRUPT, "%s: tally store is corrupt (class "
                       "table entry %u)", tally__store_name(s), n);
  if (!chunk || cols == TALLY__ROW_CELLS) {
    int rc = tally__alloc(s, chunk_bytes, &chunk);
    if (rc) return rc;
    /* chunk first: a crash between the two stores wastes a chunk rather
     * than handing out columns of the old one twice */
    atomic_store(&k->chunk, chunk);
    atomic_store(&k->used_cols, 0);
    cols = 0;
  }
  uint64_t off = chunk + (uint64_t)cols * 8;
  for (uint32_t i = 0; i < n; i++)
    if (atomic_load((_Atomic int64_t *)(s->base + off + (uint64_t)i * TALLY__ROW_BYTES)))
      return tally__fail(TALLY_ECORRUPT, "%s: tally store is corrupt (class "
                         "table entry %u hands out used cells)", tally__store_name(s), n);
  atomic_store(&k->used_cols, cols + 1);
  *out = off;
  return 0;
}
