/* rollup.c -- rollup blocks: each counter's last rollup and its history rings.
 *
 * A counter a schedule covers gets a rollup block in the arena, linked from
 * its record by a sealed word:
 *
 *   64 bytes   seq (a seqlock: odd while written), check, ring count, the
 *              record (value, at, delta, prev_at, count)
 *   16 * r     ring headers: resolution, length, newest bucket + 1
 *   8 * sum    the ring slots, ring after ring; INT64_MIN marks an empty one
 *
 * The store holds one rollup table (allocated on first use), with a slot
 * per schedule identity (pattern, every); this file keeps its format and
 * its check, and schedule.c what goes in the slots. A block is grown (a new
 * one, the old one's record and history carried over) when a schedule
 * wants rings it lacks, under the store lock.
 *
 * Schedules that cover the same counter may run at once (in two processes,
 * under two leases), so a writer claims a block by turning its seq odd
 * with a compare-and-swap; readers need no lock and retry on the seqlock. */
#include "internal.h"

#include <sched.h>

#define ROLLUPS_MAGIC 0x5350554c4c4f5254ull /* "TROLLUPS" */
#define EMPTY_SLOT    INT64_MIN

/* ---- small helpers -------------------------------------------------------- */

static uint64_t table_check(const tally_store *s) {
  return tally__mix(s->hdr->salt ^ ROLLUPS_MAGIC);
}

static uint64_t slots_of(const struct tally__block *b) {
  uint64_t n = 0;
  for (uint32_t i = 0; i < b->nrings; i++) n += b->ring[i].len;
  return n;
}

static uint64_t block_bytes(uint32_t nrings, uint64_t nslots) {
  return sizeof(struct tally__block) + nrings * sizeof(struct tally__ring_hdr) +
         nslots * 8;
}

uint64_t tally__block_bytes(const struct tally__block *b) {
  return tally__round(block_bytes(b->nrings, slots_of(b)), 64);
}

static uint32_t block_check(const tally_store *s, uint64_t rec_off,
                            const struct tally__block *b) {
  uint64_t h = tally__mix(s->hdr->salt ^ rec_off ^ (uint64_t)b->nrings << 48);
  for (uint32_t i = 0; i < b->nrings; i++)
    h = tally__mix(h ^ ((uint64_t)b->ring[i].res_s << 32 | b->ring[i].len));
  return (uint32_t)(h >> 32);
}

/* A head is 0 (empty ring) or the number + 1 of a bucket that a time at or
 * after the epoch falls in; anything else was damaged, and used as it is it
 * would index slots out of the ring or overflow bucket times. res_s is
 * checked (tally__ring_ok) first. */
static bool head_ok(uint32_t res_s, int64_t head) {
  int64_t ms; /* (head - 1) * res_s * 1000 fits: head - 1 <= INT64_MAX / (res_s * 1000) */
  return head >= 0 && !__builtin_mul_overflow(head - 1, (int64_t)res_s * 1000, &ms);
}

/* Every word of the block at off that a write or read follows: ring count,
 * resolutions and lengths (covered by the check), and heads. */
bool tally__block_sound(tally_store *s, uint64_t off, uint64_t rec_off,
                        const struct tally__block *b) {
  if (off % 64 || !tally__in_arena(s, off, sizeof *b) || b->nrings > TALLY_RINGS_MAX ||
      !tally__in_arena(s, off, block_bytes(b->nrings, 0)))
    return false;
  for (uint32_t i = 0; i < b->nrings; i++) {
    tally_ring spec = {b->ring[i].res_s, b->ring[i].len};
    if (!tally__ring_ok(&spec) ||
        !head_ok(spec.res_s,
                 atomic_load_explicit(&b->ring[i].head, memory_order_relaxed)))
      return false;
  }
  return tally__in_arena(s, off, block_bytes(b->nrings, slots_of(b))) &&
         b->check == block_check(s, rec_off, b);
}

static int corrupt_block(tally_store *s, const struct tally__rec *r) {
  return tally__fail(TALLY_ECORRUPT,
                     "%s: tally store is corrupt (rollup of "
                     "counter '%s')",
                     tally__store_name(s), r->name);
}

/* The record's block, validated; *out NULL if it has none. */
int tally__block_of(tally_store *s, uint64_t rec_off, struct tally__block **out) {
  struct tally__rec *r = tally__at(s, rec_off);
  uint64_t off;
  int rc = tally__unseal(s, TALLY__SEAL_ROLLUP,
                         atomic_load_explicit(&r->rollup, memory_order_acquire), rec_off,
                         &off);
  if (rc) return rc;
  if (!off) {
    *out = NULL;
    return 0;
  }
  struct tally__block *b = tally__at(s, off);
  if (!tally__block_sound(s, off, rec_off, b)) return corrupt_block(s, r);
  *out = b;
  return 0;
}

int tally__rollups_check(tally_store *s, uint64_t rec_off) {
  struct tally__block *b;
  return tally__block_of(s, rec_off, &b);
}

int tally__rollup_table_check(tally_store *s) {
  struct tally__rollup_table *t;
  return tally__table_of(s, false, &t);
}

/* The store's rollup table, created if `create` (caller holds the lock);
 * *out NULL if there is none yet. */
int tally__table_of(tally_store *s, bool create, struct tally__rollup_table **out) {
  uint64_t off;
  int rc = tally__unseal(s, TALLY__SEAL_ROLLUPS,
                         atomic_load_explicit(&s->hdr->rollups, memory_order_acquire), 0,
                         &off);
  if (rc) return rc;
  if (!off) {
    *out = NULL;
    if (!create) return 0;
    if ((rc = tally__alloc(s, sizeof(struct tally__rollup_table), &off))) return rc;
    struct tally__rollup_table *t = tally__at(s, off);
    t->magic = ROLLUPS_MAGIC;
    t->check = table_check(s);
    atomic_store_explicit(&s->hdr->rollups, tally__seal(s, TALLY__SEAL_ROLLUPS, off, 0),
                          memory_order_release);
  }
  struct tally__rollup_table *t = tally__at(s, off);
  if (off % 64 || !tally__in_arena(s, off, sizeof *t) || t->magic != ROLLUPS_MAGIC ||
      t->check != table_check(s))
    return tally__fail(TALLY_ECORRUPT,
                       "%s: tally store is corrupt (rollup "
                       "table)",
                       tally__store_name(s));
  *out = t;
  return 0;
}

/* ---- blocks ---------------------------------------------------------------------- */

static void ring_clear(_Atomic int64_t *slot, uint32_t len) {
  for (uint32_t i = 0; i < len; i++)
    atomic_store_explicit(&slot[i], EMPTY_SLOT, memory_order_release);
}

/* Record value v at at_ms in one ring. Buckets are epoch-aligned; a bucket
 * keeps the last value rolled inside it; the buckets skipped since the
 * newest are emptied. A time before the newest bucket changes nothing. */
static void ring_put(struct tally__ring_hdr *r, _Atomic int64_t *slot,
                     struct tally__when *w, int64_t v) {
  uint32_t len = r->len, res_s = r->res_s, at;
  int64_t head = atomic_load_explicit(&r->head, memory_order_relaxed);
  /* the caller checked the block (tally__block_sound); this only keeps a word
   * damaged since then from indexing outside the ring */
  if (len == 0 || len > TALLY_RING_LEN_MAX || res_s == 0 || !head_ok(res_s, head)) return;
  int64_t b = tally__when_bucket(w, res_s, len, &at);
  if (head == 0) {
    ring_clear(slot, len);
  } else if (b + 1 > head) {
    int64_t gap = b - head; /* buckets strictly between newest and b */
    if (gap >= len)
      ring_clear(slot, len);
    else
      for (int64_t k = head; k < b; k++)
        atomic_store_explicit(&slot[k % len], EMPTY_SLOT, memory_order_release);
  } else if (b + 1 < head) {
    return;
  }
  atomic_store_explicit(&slot[at], v, memory_order_release);
  atomic_store_explicit(&r->head, b + 1, memory_order_release);
}

int64_t tally__when_bucket(struct tally__when *w, uint32_t res_s, uint32_t len,
                           uint32_t *index) {
  for (uint32_t i = 0; i < w->n; i++)
    if (w->ring[i].res_s == res_s && w->ring[i].len == len) {
      *index = w->ring[i].index;
      return w->ring[i].bucket;
    }
  int64_t b = w->now_ms / ((int64_t)res_s * 1000);
  *index = (uint32_t)(b % len);
  if (w->n < TALLY_RINGS_MAX) {
    w->ring[w->n].res_s = res_s;
    w->ring[w->n].len = len;
    w->ring[w->n].bucket = b;
    w->ring[w->n++].index = *index;
  }
  return b;
}

/* Claim b for writing: turn its seq odd. Another writer (a schedule
 * covering the same counter, in another process) holds it for a moment
 * at most; a seq that stays odd for CLAIM_WAIT_MS was left by a writer
 * that died mid-write, and is taken over as it is: this write makes the
 * block whole again. Returns the odd seq to release with. */
#define CLAIM_WAIT_MS 100
uint64_t tally__block_claim(struct tally__block *b) {
  uint64_t s = atomic_load_explicit(&b->seq, memory_order_acquire);
  int64_t give_up = 0;
  for (unsigned spins = 0;; spins++) {
    if (!(s & 1)) {
      if (atomic_compare_exchange_weak_explicit(&b->seq, &s, s | 1, memory_order_acquire,
                                                memory_order_acquire))
        return s | 1;
      continue;
    }
    if ((spins & 255) == 255) {
      int64_t now = tally_monotonic_ms();
      if (!give_up)
        give_up = now + CLAIM_WAIT_MS;
      else if (now >= give_up)
        return s;
      sched_yield();
    }
    s = atomic_load_explicit(&b->seq, memory_order_acquire);
  }
}

/* Copy ring `from` (with its slots) into the empty ring `to`, bucket by
 * bucket: slot positions depend on the length. */
static void ring_copy(struct tally__ring_hdr *to, _Atomic int64_t *to_slot,
                      const struct tally__ring_hdr *from, _Atomic int64_t *from_slot) {
  ring_clear(to_slot, to->len);
  int64_t head = atomic_load(&from->head);
  if (!head_ok(from->res_s, head)) head = 0; /* damaged: start it empty */
  atomic_store(&to->head, head);
  if (head == 0) return;
  uint32_t keep = from->len < to->len ? from->len : to->len;
  for (int64_t b = head - 1; b >= 0 && b > head - 1 - keep; b--)
    atomic_store(&to_slot[b % to->len], atomic_load(&from_slot[b % from->len]));
}

/* Give record rec_off a block with the union of its current rings and
 * `rings` (a schedule's), carrying its record and history over. Caller
 * holds the store lock (no one else grows blocks); the old block is claimed
 * while it is copied. */
int tally__block_grow(tally_store *s, uint64_t rec_off, struct tally__block *old,
                      const tally_ring *rings, uint32_t nrings) {
  tally_ring want[2 * TALLY_RINGS_MAX];
  uint32_t n = 0;
  for (uint32_t i = 0; old && i < old->nrings; i++)
    want[n++] = (tally_ring){old->ring[i].res_s, old->ring[i].len};
  for (uint32_t i = 0; i < nrings; i++) {
    uint32_t j = 0;
    while (j < n && want[j].res_s != rings[i].res_s) j++;
    if (j == n)
      want[n++] = rings[i];
    else if (want[j].len < rings[i].len)
      want[j].len = rings[i].len;
  }
  if (n > TALLY_RINGS_MAX)
    return tally__fail(TALLY_EINVAL,
                       "counter '%s' would keep %u history "
                       "resolutions (at most %d)",
                       ((struct tally__rec *)tally__at(s, rec_off))->name, n,
                       TALLY_RINGS_MAX);
  for (uint32_t i = 1; i < n; i++) /* finest first: insertion sort */
    for (uint32_t j = i; j > 0 && want[j - 1].res_s > want[j].res_s; j--) {
      tally_ring t = want[j];
      want[j] = want[j - 1];
      want[j - 1] = t;
    }
  uint64_t nslots = 0, off;
  for (uint32_t i = 0; i < n; i++) nslots += want[i].len;
  int rc = tally__alloc(s, block_bytes(n, nslots), &off);
  if (rc) return rc;
  struct tally__block *b = tally__at(s, off);
  b->nrings = n;
  for (uint32_t i = 0; i < n; i++) {
    b->ring[i].res_s = want[i].res_s;
    b->ring[i].len = want[i].len;
  }
  b->check = block_check(s, rec_off, b);
  uint64_t old_seq = old ? tally__block_claim(old) : 0; /* no write while copying */
  _Atomic int64_t *slot = tally__slots_at(b);
  for (uint32_t i = 0; i < n; i++) {
    const struct tally__ring_hdr *from = NULL;
    _Atomic int64_t *from_slot = old ? tally__slots_at(old) : NULL;
    for (uint32_t j = 0; old && j < old->nrings; j++) {
      if (old->ring[j].res_s == want[i].res_s) {
        from = &old->ring[j];
        break;
      }
      from_slot += old->ring[j].len;
    }
    if (from) ring_copy(&b->ring[i], slot, from, from_slot);
    slot += want[i].len;
  }
  if (old) {
    atomic_store(&b->value, atomic_load(&old->value));
    atomic_store(&b->at_ms, atomic_load(&old->at_ms));
    atomic_store(&b->delta, atomic_load(&old->delta));
    atomic_store(&b->prev_at_ms, atomic_load(&old->prev_at_ms));
    atomic_store(&b->count, atomic_load(&old->count));
  }
  struct tally__rec *r = tally__at(s, rec_off);
  atomic_store_explicit(&r->rollup, tally__seal(s, TALLY__SEAL_ROLLUP, off, rec_off),
                        memory_order_release);
  if (old) {
    tally__block_release(old, old_seq); /* writers waiting on it look again */
    /* after the new one is published: a crash in between leaks it, never
     * reuses it while it is reachable */
    uint64_t item =
        tally__item(TALLY__ITEM_ALIGNED, (uint64_t)((unsigned char *)old - s->base),
                    tally__block_bytes(old) / 64);
    rc = tally__retire(s, 0, &item, 1);
  }
  return rc;
}

static int64_t sub_sat(int64_t a, int64_t b) {
  int64_t d;
  if (!__builtin_sub_overflow(a, b, &d)) return d;
  return b < 0 ? INT64_MAX : INT64_MIN;
}

/* Roll one claimed counter up at now_ms: its record, then every ring. The
 * stores are release stores, so none is seen before the odd seq (a fence
 * would do, but ThreadSanitizer does not model fences; on x86 both are
 * plain moves). */
void tally__block_roll(struct tally__block *b, int64_t v, struct tally__when *w,
                       tally_rollup *r) {
  uint64_t count = atomic_load_explicit(&b->count, memory_order_relaxed);
  r->value = v;
  r->at_ms = w->now_ms;
  r->delta =
      count ? sub_sat(v, atomic_load_explicit(&b->value, memory_order_relaxed)) : 0;
  r->prev_at_ms = count ? atomic_load_explicit(&b->at_ms, memory_order_relaxed) : 0;
  r->count = count + 1;
  atomic_store_explicit(&b->value, r->value, memory_order_release);
  atomic_store_explicit(&b->at_ms, r->at_ms, memory_order_release);
  atomic_store_explicit(&b->delta, r->delta, memory_order_release);
  atomic_store_explicit(&b->prev_at_ms, r->prev_at_ms, memory_order_release);
  atomic_store_explicit(&b->count, r->count, memory_order_release);
  _Atomic int64_t *slot = tally__slots_at(b);
  for (uint32_t i = 0; i < b->nrings; i++) {
    ring_put(&b->ring[i], slot, w, v);
    slot += b->ring[i].len;
  }
}

/* ---- reading --------------------------------------------------------------------- */

double tally_rollup_rate(const tally_rollup *r) {
  /* by count, not prev_at_ms: a rollup at now_ms 0 is a previous one */
  if (!r || r->count < 2 || r->at_ms <= r->prev_at_ms) return 0.0;
  return (double)r->delta * 1000.0 / (double)(r->at_ms - r->prev_at_ms);
}

/* Seqlock reads: acquire loads (so the second seq load cannot move above
 * them), retried until no write came in between. A writer that died
 * mid-write leaves seq odd until the next rollup. */
/* Give up after about a second of seeing a write in progress; yield now
 * and then, in case the writer shares this CPU. */
static bool seq_wait(int tries, double *deadline) {
  if (tries % 64 != 63) return true;
  sched_yield();
  double t = (double)tally_monotonic_ns() * 1e-9;
  if (*deadline == 0) *deadline = t + 1.0;
  return t < *deadline;
}
static int block_for_read(tally_counter *c, struct tally__block **b) {
  if (!c) return tally__fail(TALLY_EINVAL, "NULL counter");
  int rc = tally__counter_live(c);
  if (rc == 0) rc = tally__current(c->s, tally__crec(c), &(uint64_t){0});
  if (rc == 0) rc = tally__block_of(c->s, tally__crec(c), b);
  if (rc) return rc;
  if (!*b)
    return tally__fail(TALLY_ENOROLLUP,
                       "counter '%s' has no rollup (no "
                       "schedule has rolled it up)",
                       c->name);
  return 0;
}

static int busy(tally_counter *c) {
  return tally__fail(TALLY_EBUSY,
                     "counter '%s': rollup record is being "
                     "written (or its writer died; the next rollup repairs it)",
                     c->name);
}

/* The block's latest record, read between two equal even seqs. patient:
 * wait out a write in progress for about a second (TALLY_EBUSY after);
 * else give up after 64 looks, for walks that must not stall on one
 * counter. TALLY_ENOROLLUP (no error text) if nothing was rolled yet. */
static int block_read(struct tally__block *b, bool patient, tally_rollup *out) {
  double deadline = 0;
  for (int i = 0; patient ? seq_wait(i, &deadline) : i < 64; i++) {
    uint64_t s1 = atomic_load_explicit(&b->seq, memory_order_acquire);
    if (s1 & 1) continue;
    tally_rollup r = {.value = atomic_load_explicit(&b->value, memory_order_acquire),
                      .at_ms = atomic_load_explicit(&b->at_ms, memory_order_acquire),
                      .delta = atomic_load_explicit(&b->delta, memory_order_acquire),
                      .prev_at_ms =
                          atomic_load_explicit(&b->prev_at_ms, memory_order_acquire),
                      .count = atomic_load_explicit(&b->count, memory_order_acquire)};
    if (atomic_load_explicit(&b->seq, memory_order_relaxed) != s1) continue;
    if (r.count == 0) return TALLY_ENOROLLUP;
    *out = r;
    return 0;
  }
  return TALLY_EBUSY;
}

int tally__rec_rolled(tally_store *s, uint64_t rec_off, tally_rollup *out) {
  struct tally__block *b = NULL;
  int rc = tally__block_of(s, rec_off, &b);
  if (rc) return rc;
  return b ? block_read(b, false, out) : TALLY_ENOROLLUP;
}

int tally_counter_rolled(tally_counter *c, tally_rollup *out) {
  struct tally__block *b;
  if (!out) return tally__fail(TALLY_EINVAL, "tally_counter_rolled: NULL argument");
  int rc = block_for_read(c, &b);
  if (rc) return rc;
  rc = block_read(b, true, out);
  if (rc == TALLY_ENOROLLUP)
    return tally__fail(TALLY_ENOROLLUP,
                       "counter '%s' has not been rolled "
                       "up yet",
                       c->name);
  return rc == TALLY_EBUSY ? busy(c) : rc;
}

int tally_counter_rings(tally_counter *c, tally_ring *out, uint32_t cap, uint32_t *n) {
  struct tally__block *b;
  if (!n || (!out && cap))
    return tally__fail(TALLY_EINVAL, "tally_counter_rings: NULL argument");
  int rc = block_for_read(c, &b);
  if (rc) return rc;
  for (uint32_t i = 0; i < b->nrings && i < cap; i++)
    out[i] = (tally_ring){b->ring[i].res_s, b->ring[i].len};
  *n = b->nrings;
  return 0;
}

int tally_counter_history(tally_counter *c, uint32_t res_s, tally_bucket *out,
                          uint32_t cap, uint32_t *n) {
  struct tally__block *b;
  if (!n || (!out && cap))
    return tally__fail(TALLY_EINVAL, "tally_counter_history: NULL argument");
  int rc = block_for_read(c, &b);
  if (rc) return rc;
  _Atomic int64_t *slot = tally__slots_at(b);
  uint32_t i = 0;
  while (i < b->nrings && b->ring[i].res_s != res_s) slot += b->ring[i++].len;
  if (i == b->nrings)
    return tally__fail(TALLY_ENOROLLUP,
                       "counter '%s' keeps no history at "
                       "%u s resolution",
                       c->name, res_s);
  struct tally__ring_hdr *r = &b->ring[i];
  double deadline = 0;
  for (int tries = 0; seq_wait(tries, &deadline); tries++) {
    uint64_t s1 = atomic_load_explicit(&b->seq, memory_order_acquire);
    if (s1 & 1) continue;
    int64_t head = atomic_load_explicit(&r->head, memory_order_acquire);
    if (!head_ok(r->res_s, head))
      return corrupt_block(c->s, tally__at(c->s, tally__crec(c)));
    uint32_t k = 0;
    for (int64_t bk = head - (int64_t)r->len; head && bk < head; bk++) {
      if (bk < 0) continue;
      int64_t v = atomic_load_explicit(&slot[bk % r->len], memory_order_acquire);
      if (v == EMPTY_SLOT) continue;
      if (k < cap) out[k] = (tally_bucket){bk * (int64_t)r->res_s, v};
      k++;
    }
    if (atomic_load_explicit(&b->seq, memory_order_relaxed) != s1) continue;
    *n = k;
    return 0;
  }
  return busy(c);
}
