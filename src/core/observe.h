/* observe.h -- a histogram's observation in straight lines: the two-cell
 * batch of batch.c's apply, inline, for histogram.c's hot path (and the
 * journal entry both write). */
#ifndef TALLY_OBSERVE_H
#define TALLY_OBSERVE_H

#include "internal.h"

#define TALLY__UNUSUAL(x) __builtin_expect(!!(x), 0)
/* One journal entry of a batch (batch.c's apply and the function below). */
static inline void tally__journal_entry(struct tally__wentry *e, uint64_t rec_off,
                                        uint64_t loc, uint64_t incarnation,
                                        uint64_t cell_off, int64_t before,
                                        int64_t delta) {
  atomic_store_explicit(&e->rec_off, rec_off, memory_order_relaxed);
  atomic_store_explicit(&e->loc, loc, memory_order_relaxed);
  atomic_store_explicit(&e->incarnation, incarnation, memory_order_relaxed);
  atomic_store_explicit(&e->cell_off, cell_off, memory_order_relaxed);
  atomic_store_explicit(&e->before, before, memory_order_relaxed);
  atomic_store_explicit(&e->delta, delta, memory_order_relaxed);
}
/* tally__batch_apply2 in its usual case: a and b whose records hold la and
 * lb (their handles' locs: a loc the record still holds was checked when
 * it was first decoded), this thread's slot leased and nobody asking it
 * to wait, both new values in range. The same journal and the same steps
 * as batch.c's apply, in straight lines: the cells' addresses come from la
 * and lb, so their loads need not wait for the records, which are only
 * checked. Inline, because at about 10 ns an observation is mostly
 * instructions, and a call's saved registers are a tenth of them. 0:
 * added; 1: not the usual case, nothing added (tally__batch_apply2 goes
 * the whole way and says what is wrong). */
static inline int tally__batch_try2(tally_store *s, tally_counter *a, uint64_t la,
                                    int64_t da, tally_counter *b, uint64_t lb,
                                    int64_t db) {
  const uint64_t shape_mask = TALLY__LOC_SHARDS_MASK | TALLY__LOC_DROPPED;
  const uint64_t shape = TALLY_SLOT_SHARDS - 1; /* 64 shards, not dropped */
  if (TALLY__UNUSUAL(tally__me.wstore_id != s->id) ||
      TALLY__UNUSUAL(tally__me.wstall >= 0) ||
      TALLY__UNUSUAL((la & shape_mask) != shape) ||
      TALLY__UNUSUAL((lb & shape_mask) != shape))
    return 1;
  struct tally__wslot *sl = tally__me.wsl;
  _Atomic int64_t *ca = tally__cell_at(s, la, tally__me.wslot);
  _Atomic int64_t *cb = tally__cell_at(s, lb, tally__me.wslot);
  int64_t ba = atomic_load_explicit(ca, memory_order_relaxed);
  int64_t bb = atomic_load_explicit(cb, memory_order_relaxed);
  int64_t xa, xb;
  if (TALLY__UNUSUAL(__builtin_add_overflow(ba, da, &xa)) ||
      TALLY__UNUSUAL(__builtin_add_overflow(bb, db, &xb)) ||
      TALLY__UNUSUAL(!tally__cell_live(ba)) || TALLY__UNUSUAL(!tally__cell_live(bb)) ||
      TALLY__UNUSUAL(!tally__cell_live(xa)) || TALLY__UNUSUAL(!tally__cell_live(xb)))
    return 1;
  uint64_t oa = tally__crec(a), ob = tally__crec(b);
  const struct tally__rec *ra = tally__at(s, oa), *rb = tally__at(s, ob);
  if (TALLY__UNUSUAL(atomic_load_explicit(&a->gone, memory_order_relaxed)) ||
      TALLY__UNUSUAL(atomic_load_explicit(&b->gone, memory_order_relaxed)) ||
      TALLY__UNUSUAL(atomic_load_explicit(&ra->loc, memory_order_acquire) != la) ||
      TALLY__UNUSUAL(atomic_load_explicit(&rb->loc, memory_order_acquire) != lb) ||
      TALLY__UNUSUAL(atomic_load_explicit(&sl->hold_ms, memory_order_relaxed)))
    return 1;
  tally__journal_entry(&sl->e[0], oa, la, ra->incarnation,
                       (uint64_t)((unsigned char *)ca - s->base), ba, da);
  tally__journal_entry(&sl->e[1], ob, lb, rb->incarnation,
                       (uint64_t)((unsigned char *)cb - s->base), bb, db);
  atomic_store_explicit(&sl->n, 2, memory_order_relaxed);
  /* seq odd, the new values, seq even: release stores, as in apply */
  uint64_t seq = atomic_load_explicit(&sl->seq, memory_order_relaxed);
  atomic_store_explicit(&sl->seq, seq + 1, memory_order_release);
  atomic_store_explicit(ca, xa, memory_order_release);
  atomic_store_explicit(cb, xb, memory_order_release);
  atomic_store_explicit(&sl->seq, seq + 2, memory_order_release);
  return 0;
}
#undef TALLY__UNUSUAL

#endif
