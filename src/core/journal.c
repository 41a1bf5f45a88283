/* journal.c -- moves that survive a crash: the pending-move record and the
 * journal of old cell values.
 *
 * A move (reshard or drop, move.c) takes a counter from one set of cells
 * to another while writers keep adding. The header records it (pend_rec,
 * pend_loc, pend_done) before any cell changes; each old cell's value goes
 * to the journal before the cell is retired; the journal's total is spread
 * over the new cells, which nobody else touches yet; then the record's
 * location is published and the move cleared. Every step can be redone, so
 * a process killed anywhere leaves a move that the next holder of the
 * store lock finishes (lock.c) with nothing lost or counted twice.
 */
#include "internal.h"

/* Save cell i's value in the journal and retire the cell. A cell that is
 * already retired was retired by an earlier, interrupted attempt at this
 * same move, after its value reached the journal; one that is just out of
 * range has a writer's add in flight, which is waited out. */
static int retire(tally_store *s, uint64_t rec_off, _Atomic int64_t *cell, uint32_t i) {
  for (;;) {
    int64_t raw = atomic_load_explicit(cell, memory_order_acquire);
    int rc = tally__cell_wait(s, cell, rec_off, i, &raw);
    if (rc || tally__cell_retired(raw)) return rc;
    atomic_store_explicit(&s->journal[i], raw, memory_order_release);
    if (atomic_compare_exchange_strong_explicit(
            cell, &raw, TALLY__SENTINEL, memory_order_acq_rel, memory_order_acquire))
      return 0;
  }
}

/* Undo retire(): give cell i its journalled value back. Idempotent, so an
 * undo killed half way is simply redone: a live cell was restored already.
 * What writers added to the retired cell is dropped: none of them counted
 * it, they retry once they see the counter settled. */
static void restore(tally_store *s, _Atomic int64_t *cell, uint32_t i) {
  int64_t v = atomic_load_explicit(cell, memory_order_acquire);
  int64_t saved = atomic_load_explicit(&s->journal[i], memory_order_acquire);
  while (tally__cell_retired(v) &&
         !atomic_compare_exchange_weak_explicit(cell, &v, saved, memory_order_acq_rel,
                                                memory_order_acquire)) {}
}

/* Can total be spread over n cells of [-2^62, 2^62)? */
bool tally__fits_shards(__int128 total, uint32_t n) {
  __int128 q = total / n, r = total % n;
  return q + (r > 0) < ((__int128)1 << 62) && q - (r < 0) >= -((__int128)1 << 62);
}

/* Spread total over the cells at loc; false if a cell would leave its range. */
static bool spread(tally_store *s, uint64_t loc, __int128 total) {
  uint32_t n = tally__loc_shards(loc);
  __int128 q = total / n, r = total % n;
  if (!tally__fits_shards(total, n)) return false;
  __int128 extra = r > 0 ? 1 : -1, left = r > 0 ? r : -r;
  for (uint32_t i = 0; i < n; i++)
    atomic_store_explicit(tally__cell_at(s, loc, i),
                          (int64_t)(q + ((__int128)i < left ? extra : 0)),
                          memory_order_relaxed);
  return true;
}

/* A dropped counter's record, cells and rollup block go to limbo, once:
 * the record's LIMBO flag says it was done (a crash between the two is
 * caught by tally__retire's ident). Its family's count goes down. */
static int bury(tally_store *s, uint64_t rec_off, uint64_t ident) {
  struct tally__rec *r = tally__at(s, rec_off);
  if (atomic_load(&r->flags) & TALLY__REC_LIMBO) return 0;
  uint64_t loc = atomic_load(&r->loc), items[3];
  uint32_t n = 0;
  items[n++] = tally__item(TALLY__ITEM_SMALL, rec_off, tally__rec_units(s, r->name_len));
  items[n++] = tally__item(TALLY__ITEM_COLUMN, (loc >> 32) << 3, tally__loc_shards(loc));
  struct tally__block *b = NULL;
  if (tally__block_of(s, rec_off, &b) == 0 && b)
    items[n++] =
        tally__item(TALLY__ITEM_ALIGNED, (uint64_t)((unsigned char *)b - s->base),
                    tally__block_bytes(b) / 64);
  int rc = tally__retire(s, ident, items, n);
  if (rc) return rc;
  atomic_fetch_or(&r->flags, TALLY__REC_LIMBO);
  TALLY__TEST_HOOK("limbo", r->name, r->name_len);
  /* a holder killed before this leaves the count one over, and the flag
   * keeps a finish from coming back here: a takeover recounts (lock.c) */
  struct tally__family *f = r->family ? tally__family_by_hash(s, r->family) : NULL;
  if (f && atomic_load(&f->live) > 0) atomic_fetch_sub(&f->live, 1);
  if (atomic_load(&r->flags) & TALLY__REC_EXPIRED) atomic_fetch_add(&s->hdr->expired, 1);
  return 0;
}

/* Complete the move recorded in the header. Caller holds the lock.
 * TALLY_ERANGE (and the move undone) if the value does not fit the new
 * shards; a damaged record leaves the move recorded for a repair. */
static int finish(tally_store *s) {
  struct tally__header *h = s->hdr;
  uint64_t word = atomic_load_explicit(&h->pend_rec, memory_order_acquire);
  uint64_t to = atomic_load_explicit(&h->pend_loc, memory_order_acquire);
  uint64_t rec_off;
  if (!word) { /* a fence a dead mover left up after its cells were retired */
    tally__cpu_unfence(s);
    return 0;
  }
  int rc = tally__unseal(s, TALLY__SEAL_MOVE, word, to, &rec_off);
  if (rc == 0) rc = tally__rec_verify(s, rec_off);
  if (rc) return rc;
  struct tally__rec *r = tally__at(s, rec_off);
  uint64_t from = atomic_load_explicit(&r->loc, memory_order_acquire);
  if (from != to) {
    uint64_t to_cells, from_cells;
    uint32_t to_n, from_n;
    bool to_dropped, from_dropped;
    rc = tally__loc_decode(s, rec_off, from, &from_cells, &from_n, &from_dropped);
    if (rc == 0) rc = tally__loc_decode(s, rec_off, to, &to_cells, &to_n, &to_dropped);
    if (rc) return rc;
    /* per-CPU cells take plain stores: no sequence may be under way when
     * they are retired (percpu.c). A holder before us that retired some
     * fenced every CPU, and the fence stayed up since. */
    if (r->policy == TALLY_POLICY_CPU) {
      if (atomic_load(&h->pend_done) == 0 && (rc = tally__cpu_fence(s, from_n))) {
        /* a mover that died here may have retired cell 0 before it
         * recorded pend_done = 1: give it back (shard 0 takes only what
         * resets move, under the lock, so no sequence writes it) */
        restore(s, tally__cell_at(s, from, 0), 0);
        atomic_store_explicit(&h->pend_rec, 0, memory_order_release);
        return rc;
      }
      atomic_store(&h->cpu_fence, 1);
    }
    for (uint32_t i = (uint32_t)atomic_load(&h->pend_done); i < from_n; i++) {
      if ((rc = retire(s, rec_off, tally__cell_at(s, from, i), i))) {
        /* a damaged cell: the move is given up, its cells as they were */
        for (uint32_t j = 0; j < i; j++) restore(s, tally__cell_at(s, from, j), j);
        tally__cpu_unfence(s);
        atomic_store_explicit(&h->pend_rec, 0, memory_order_release);
        return rc;
      }
      atomic_store_explicit(&h->pend_done, i + 1, memory_order_release);
    }
    /* every old cell is retired: a sequence that loads one gives up */
    tally__cpu_unfence(s);
    __int128 total = 0;
    for (uint32_t i = 0; i < from_n; i++) total += atomic_load(&s->journal[i]);
    if (to_dropped && atomic_load(&h->pend_cond) &&
        total != atomic_load(&h->pend_expect)) { /* an expiry that lost a race */
      for (uint32_t i = 0; i < from_n; i++) restore(s, tally__cell_at(s, from, i), i);
      atomic_fetch_and(&r->flags, ~TALLY__REC_EXPIRED); /* (its expirer may be dead) */
      atomic_store_explicit(&h->pend_rec, 0, memory_order_release);
      return tally__fail(TALLY_EBUSY, "counter '%s' moved while it expired", r->name);
    }
    if (!to_dropped && !spread(s, to, total)) {
      for (uint32_t i = 0; i < from_n; i++) restore(s, tally__cell_at(s, from, i), i);
      atomic_store_explicit(&h->pend_rec, 0, memory_order_release);
      return tally__fail(TALLY_ERANGE,
                         "counter '%s' would overflow a shard "
                         "with %u shards",
                         r->name, to_n);
    }
    if (!to_dropped) { /* the old column waits out the grace period */
      uint64_t items[2] = {tally__item(TALLY__ITEM_COLUMN, from_cells, from_n),
                           tally__item(TALLY__ITEM_REF, rec_off, 0)};
      if ((rc = tally__retire(s, word, items, 2))) return rc;
    }
    atomic_store_explicit(&r->loc, to, memory_order_release);
  }
  if (to & TALLY__LOC_DROPPED) {
    tally__index_remove(s, rec_off); /* idempotent */
    if ((rc = bury(s, rec_off, word))) return rc;
  }
  atomic_store_explicit(&h->pend_rec, 0, memory_order_release);
  return 0;
}

int tally__journal_finish(tally_store *s) {
  return finish(s);
}

/* A move still recorded when another begins: its finish in tally__lock
 * failed (the file could not grow for its limbo node, say), and tally__lock
 * does not say. Recording the new move over it would lose its counter's
 * value, which only the journal holds once its cells are retired. So it is
 * finished now, or the new move refused; refused too if it finishes now,
 * since the caller read the store before that (a drop's cells). */
static int pending(tally_store *s) {
  if (!atomic_load_explicit(&s->hdr->pend_rec, memory_order_acquire)) return 0;
  int rc = finish(s);
  if (atomic_load_explicit(&s->hdr->pend_rec, memory_order_acquire)) return rc;
  return tally__fail(TALLY_EBUSY,
                     "%s: a move left unfinished was finished first: try again",
                     tally__store_name(s));
}

/* Before a move changes anything: no move pending, and room in limbo for
 * what it will retire (a drop's record, column and rollup block; a
 * reshard's column), so that a file that cannot grow fails it here, not
 * with its cells retired and their value only in the journal. */
int tally__journal_ready(tally_store *s) {
  int rc = pending(s);
  return rc ? rc : tally__retire_room(s, 3);
}

int tally__journal_move(tally_store *s, uint64_t rec_off, uint64_t to) {
  int rc = tally__journal_ready(s);
  if (rc) return rc;
  /* a drop is no expiry, whatever an expirer killed before its drop left */
  if (to & TALLY__LOC_DROPPED)
    atomic_fetch_and(&((struct tally__rec *)tally__at(s, rec_off))->flags,
                     ~TALLY__REC_EXPIRED);
  atomic_store_explicit(&s->hdr->pend_cond, 0, memory_order_release);
  atomic_store_explicit(&s->hdr->pend_done, 0, memory_order_release);
  atomic_store_explicit(&s->hdr->pend_loc, to, memory_order_release);
  atomic_store_explicit(&s->hdr->pend_rec, tally__seal(s, TALLY__SEAL_MOVE, rec_off, to),
                        memory_order_release);
  return finish(s);
}

int tally__journal_drop_if(tally_store *s, uint64_t rec_off, uint64_t to,
                           int64_t expect) {
  int rc = tally__journal_ready(s);
  if (rc) return rc;
  atomic_store_explicit(&s->hdr->pend_expect, expect, memory_order_release);
  atomic_store_explicit(&s->hdr->pend_cond, 1, memory_order_release);
  atomic_store_explicit(&s->hdr->pend_done, 0, memory_order_release);
  atomic_store_explicit(&s->hdr->pend_loc, to, memory_order_release);
  atomic_store_explicit(&s->hdr->pend_rec, tally__seal(s, TALLY__SEAL_MOVE, rec_off, to),
                        memory_order_release);
  return finish(s);
}
