/* move.c -- reshard and drop: moving a counter's value while it is written.
 *
 * Both allocate what the counter moves to (new cells, or the same cells
 * marked dropped) and hand the move to the journal (journal.c), which
 * retires the old cells one by one, spreads their total over the new ones
 * and publishes the new location; a process killed half way leaves a move
 * the next lock holder finishes. Writers and readers that meet a retired
 * cell follow the counter to its new location (counter.c).
 *
 * Retired cells are reused only after the grace period (space.c,
 * grace.c): a handle in another process may still hold their location and
 * must find them retired, not owned by some newer counter.
 */
#include "internal.h"

#include <string.h>

int tally__reshard(tally_store *s, uint64_t rec_off, uint32_t shards, bool grow_only,
                   uint64_t *out) {
  int rc = tally__lock(s);
  if (rc) return rc;
  uint64_t loc, cells;
  rc = tally__current(s, rec_off, &loc);
  uint32_t n = rc == 0 ? tally__loc_shards(loc) : 0;
  if (rc == 0 && n != shards && !(grow_only && n > shards)) {
    /* refuse before retiring anything if the value cannot fit (a raw sum:
     * under the lock no move is pending, and a reader's wait for one here
     * would wait for ourselves) */
    __int128 value = 0;
    for (uint32_t i = 0; i < tally__loc_shards(loc); i++)
      value += atomic_load_explicit(tally__cell_at(s, loc, i), memory_order_relaxed);
    if (!tally__fits_shards(value, shards))
      rc = tally__fail(TALLY_ERANGE, "counter '%s' would overflow a shard with %u shards",
                       ((struct tally__rec *)tally__at(s, rec_off))->name, shards);
    /* ready before the new cells are taken, so that a refused move (one
     * pending, a full disk) leaves none behind */
    if (rc == 0) rc = tally__journal_ready(s);
    if (rc == 0 && (rc = tally__cells_alloc(s, shards, &cells)) == 0) {
      const struct tally__rec *r = tally__at(s, rec_off);
      TALLY__TEST_HOOK("reshard", r->name, r->name_len);
      rc = tally__journal_move(s, rec_off,
                               tally__loc_make(s, rec_off, cells, shards, false));
      /* refused with nothing left recorded (undone: the value no longer
       * fits): nobody has seen the new cells, so they are free at once. A
       * move left pending keeps them: its finish spreads the value there */
      if (rc && !atomic_load_explicit(&s->hdr->pend_rec, memory_order_acquire))
        tally__free_now(s, tally__item(TALLY__ITEM_COLUMN, cells, shards));
    }
  }
  tally__unlock(s);
  if (rc == 0 && out)
    *out = atomic_load(&((struct tally__rec *)tally__at(s, rec_off))->loc);
  return rc;
}

int tally_counter_reshard(tally_counter *c, uint32_t shards) {
  if (!c) return tally__fail(TALLY_EINVAL, "tally_counter_reshard: counter is NULL");
  if (shards < 1 || shards > TALLY_MAX_SHARDS)
    return tally__fail(TALLY_ESHARDS, "shard count %u out of range (1 to %d)", shards,
                       TALLY_MAX_SHARDS);
  uint64_t loc;
  if (c->policy == TALLY_POLICY_SLOT)
    return tally__fail(TALLY_EPOLICY,
                       "counter '%s' has the slot policy: one shard per writer", c->name);
  if (c->policy == TALLY_POLICY_CPU)
    return tally__fail(TALLY_EPOLICY,
                       "counter '%s' has the cpu policy: one shard per CPU", c->name);
  int rc = tally__counter_live(c);
  if (rc == 0) rc = tally__reshard(c->s, tally__crec(c), shards, false, &loc);
  if (rc == 0) tally__handle_set_loc(c, loc);
  return rc;
}

int tally_store_drop(tally_store *s, const char *name, size_t len) {
  if (!s) return tally__fail(TALLY_EINVAL, "tally_store_drop: store is NULL");
  int rc = tally__check_name(name, len);
  if (rc) return rc;
  uint64_t hash = tally__hash(name, len, 0), rec_off, loc, cells;
  uint32_t n;
  bool dropped;
  if ((rc = tally__lock(s))) return rc;
  rc = tally__index_find(s, name, len, hash, &rec_off);
  if (rc == TALLY_ENOENT)
    rc = tally__fail(TALLY_ENOENT, "no such counter '%.*s'", (int)len, name);
  if (rc == 0) rc = tally__rec_verify(s, rec_off);
  if (rc == 0) {
    loc = atomic_load(&((struct tally__rec *)tally__at(s, rec_off))->loc);
    rc = tally__loc_decode(s, rec_off, loc, &cells, &n, &dropped);
  }
  if (rc == 0)
    rc = tally__journal_move(s, rec_off, tally__loc_make(s, rec_off, cells, n, true));
  if (rc == 0) tally__grace_step(s, false, false);
  tally__unlock(s);
  return rc;
}
