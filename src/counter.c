/* counter.c -- counters: create, increment, read, reset, reshard, drop.
 *
 * Increment: pick a shard, then a compare-and-swap loop on its cell that
 * refuses a frozen cell and a result outside [-2^62, 2^62). The handle
 * caches the cell location, so the hot path touches only the cell.
 *
 * Reshard and drop are "moves", always made under the store lock:
 *   1. new cells are allocated (reshard) and the header records the move
 *      (pend_loc, then pend_rec);
 *   2. every old cell is frozen: its value stays, bit 62 flips;
 *   3. the frozen total is written into the new cells, which no one else
 *      touches before step 4, so redoing 2-3 gives the same result;
 *   4. rec->loc is published, then the header's record of the move cleared.
 * A writer that meets a frozen cell reloads rec->loc; if it has not moved
 * yet, it takes the store lock, and the lock finishes any move whose
 * process died (tally__lock). So a move killed at any point is completed
 * by the next process, with nothing lost or counted twice. While a move is
 * pending, every completed increment is still in the old cells, which is
 * why readers may sum frozen and live old cells alike.
 *
 * Retired cells (after reshard or drop) are never reused: a handle in
 * another process may still hold their location and must find them
 * frozen, not owned by some newer counter.
 */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

#define LOC_SHARDS_MASK 0x3ffull
#define LOC_DROPPED (1ull << 10)
#define LOC_CHECK_SHIFT 11
#define LOC_CHECK_MASK 0x1fffffull

static const char *store_name(const tally_store *s) {
  return s->path ? s->path : "memory";
}

static uint64_t loc_check(tally_store *s, uint64_t rec_off, uint64_t cells,
                          uint32_t n, bool dropped) {
  uint64_t h = tally__mix(s->hdr->salt ^ rec_off ^ (cells << 21) ^
                          ((uint64_t)n << 1) ^ dropped);
  return h & LOC_CHECK_MASK;
}

uint64_t tally__loc_make(tally_store *s, uint64_t rec_off, uint64_t cells,
                         uint32_t n, bool dropped) {
  return (cells >> 3) << 32 |
         loc_check(s, rec_off, cells, n, dropped) << LOC_CHECK_SHIFT |
         (dropped ? LOC_DROPPED : 0) | (uint64_t)(n - 1);
}

int tally__loc_decode(tally_store *s, uint64_t rec_off, uint64_t loc,
                      uint64_t *cells, uint32_t *n, bool *dropped) {
  uint64_t c = (loc >> 32) << 3;
  uint32_t k = (uint32_t)(loc & LOC_SHARDS_MASK) + 1;
  bool d = (loc & LOC_DROPPED) != 0;
  if (((loc >> LOC_CHECK_SHIFT) & LOC_CHECK_MASK) != loc_check(s, rec_off, c, k, d) ||
      !tally__in_arena(s, c, (uint64_t)(k - 1) * TALLY__ROW_BYTES + 8))
    return tally__fail(TALLY_ECORRUPT, "%s: tally store is corrupt (cell "
                       "location of the counter at offset %llu)", store_name(s),
                       (unsigned long long)rec_off);
  *cells = c;
  *n = k;
  *dropped = d;
  return 0;
}

static inline _Atomic int64_t *cell_at(tally_store *s, uint64_t loc,
                                       uint32_t shard) {
  return (_Atomic int64_t *)(s->base + ((loc >> 32) << 3) +
                             (uint64_t)shard * TALLY__ROW_BYTES);
}

static inline uint32_t loc_shards(uint64_t loc) {
  return (uint32_t)(loc & LOC_SHARDS_MASK) + 1;
}

/* ---- moves (reshard, drop) ---------------------------------------------- */

static int64_t freeze(_Atomic int64_t *cell) {
  int64_t v = atomic_load_explicit(cell, memory_order_acquire);
  while (!tally__cell_frozen(v) &&
         !atomic_compare_exchange_weak_explicit(
             cell, &v, (int64_t)((uint64_t)v ^ TALLY__FROZEN_BIT),
             memory_order_acq_rel, memory_order_acquire)) {}
  return tally__cell_thaw(v);
}

static void thaw_all(tally_store *s, uint64_t loc) {
  for (uint32_t i = 0; i < loc_shards(loc); i++) {
    _Atomic int64_t *cell = cell_at(s, loc, i);
    atomic_store_explicit(cell, tally__cell_thaw(atomic_load(cell)),
                          memory_order_release);
  }
}

/* Spread total over n cells; false if some cell would leave its range. */
static bool spread(tally_store *s, uint64_t loc, __int128 total) {
  uint32_t n = loc_shards(loc);
  __int128 q = total / n, r = total % n;
  __int128 top = q + (r > 0), bottom = q - (r < 0);
  if (top >= ((__int128)1 << 62) || bottom < -((__int128)1 << 62)) return false;
  for (uint32_t i = 0; i < n; i++) {
    __int128 v = q + (i < (r > 0 ? r : -r) ? (r > 0 ? 1 : -1) : 0);
    atomic_store_explicit(cell_at(s, loc, i), (int64_t)v, memory_order_relaxed);
  }
  return true;
}

/* Complete the move recorded in the header. Caller holds the lock.
 * Returns TALLY_ERANGE (move undone) if the moved value does not fit. */
static int finish(tally_store *s) {
  struct tally__header *h = s->hdr;
  uint64_t rec_off = atomic_load_explicit(&h->pend_rec, memory_order_acquire);
  uint64_t to = atomic_load_explicit(&h->pend_loc, memory_order_acquire);
  if (!rec_off) return 0;
  int rc = tally__rec_verify(s, rec_off);
  if (rc) return rc; /* leave the record of the move for a repair tool */
  struct tally__rec *r = tally__at(s, rec_off);
  uint64_t from = atomic_load_explicit(&r->loc, memory_order_acquire);
  uint64_t to_cells, from_cells;
  uint32_t to_n, from_n;
  bool to_dropped, from_dropped;
  if (from != to) {
    rc = tally__loc_decode(s, rec_off, from, &from_cells, &from_n, &from_dropped);
    if (rc == 0)
      rc = tally__loc_decode(s, rec_off, to, &to_cells, &to_n, &to_dropped);
    if (rc) return rc;
    __int128 total = 0;
    for (uint32_t i = 0; i < from_n; i++) total += freeze(cell_at(s, from, i));
    if (!to_dropped && !spread(s, to, total)) {
      thaw_all(s, from);
      atomic_store_explicit(&h->pend_rec, 0, memory_order_release);
      return tally__fail(TALLY_ERANGE, "counter '%s' would overflow a shard "
                         "with %u shards", r->name, to_n);
    }
    atomic_store_explicit(&r->loc, to, memory_order_release);
    atomic_fetch_add(&h->retired, (uint64_t)from_n * 8);
  }
  if (to & LOC_DROPPED) tally__index_remove(s, rec_off); /* idempotent */
  atomic_store_explicit(&h->pend_rec, 0, memory_order_release);
  return 0;
}

void tally__finish_move(tally_store *s) { (void)finish(s); }

static int move(tally_store *s, uint64_t rec_off, uint64_t to) {
  atomic_store_explicit(&s->hdr->pend_loc, to, memory_order_release);
  atomic_store_explicit(&s->hdr->pend_rec, rec_off, memory_order_release);
  return finish(s);
}

/* ---- creation ------------------------------------------------------------- */

/* A fresh column of cells for a counter of n shards. Caller holds the lock. */
static int alloc_cells(tally_store *s, uint32_t n, uint64_t *out) {
  struct tally__class *k = &s->classes[n - 1];
  uint64_t chunk = atomic_load(&k->chunk);
  uint32_t cols = atomic_load(&k->used_cols);
  uint64_t chunk_bytes = (uint64_t)n * TALLY__ROW_BYTES;
  if (chunk && (!tally__in_arena(s, chunk, chunk_bytes) ||
                cols > TALLY__ROW_CELLS))
    return tally__fail(TALLY_ECORRUPT, "%s: tally store is corrupt (class "
                       "table entry %u)", store_name(s), n);
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
                         "table entry %u hands out used cells)", store_name(s), n);
  atomic_store(&k->used_cols, cols + 1);
  *out = off;
  return 0;
}

static int create(tally_store *s, const char *name, size_t len, uint64_t hash,
                  const tally_counter_options *o, uint64_t *rec_off) {
  uint64_t cells, off;
  int rc = alloc_cells(s, o->shards, &cells);
  if (rc == 0) rc = tally__alloc(s, sizeof(struct tally__rec) + len + 1, &off);
  if (rc) return rc;
  struct tally__rec *r = tally__at(s, off);
  r->policy = (uint8_t)o->policy;
  r->kind = TALLY__KIND_COUNTER;
  r->name_len = (uint16_t)len;
  memcpy(r->name, name, len);
  r->check = tally__rec_checksum(r);
  atomic_store_explicit(&r->loc, tally__loc_make(s, off, cells, o->shards, false),
                        memory_order_release);
  rc = tally__index_insert(s, hash, off);
  if (rc == 0) *rec_off = off;
  return rc;
}

static int check_name(const char *name, size_t len) {
  if (!name || len == 0 || len > TALLY_NAME_MAX || memchr(name, 0, len))
    return tally__fail(TALLY_ENAME, "invalid counter name (1 to %d bytes, "
                       "no NUL)", TALLY_NAME_MAX);
  return 0;
}

static int check_options(const tally_counter_options *o) {
  if (!o) return 0;
  if (o->shards > TALLY_MAX_SHARDS)
    return tally__fail(TALLY_ESHARDS, "shard count %u out of range (1 to %d)",
                       o->shards, TALLY_MAX_SHARDS);
  if (o->policy < -1 || o->policy >= TALLY_POLICY_COUNT_)
    return tally__fail(TALLY_EPOLICY, "invalid shard policy %d", o->policy);
  return 0;
}

int tally_counter_open(tally_store *s, const char *name, size_t len,
                       const tally_counter_options *opt, uint32_t flags,
                       tally_counter **out) {
  if (!s || !out) return tally__fail(TALLY_EINVAL, "tally_counter_open: NULL argument");
  int rc = check_name(name, len);
  if (rc == 0) rc = check_options(opt);
  if (rc) return rc;
  uint64_t hash = tally__hash(name, len, 0), rec_off = 0, loc = 0;
  for (int attempt = 0;; attempt++) {
    rc = tally__index_find(s, name, len, hash, &rec_off);
    if (rc == TALLY_ENOENT && (flags & TALLY_COUNTER_CREATE)) {
      tally__lock(s);
      rc = tally__index_find(s, name, len, hash, &rec_off);
      if (rc == TALLY_ENOENT) {
        tally_counter_options o;
        rc = tally_family_resolve(s, name, len, &o);
        if (rc == 0 && opt && opt->shards) o.shards = opt->shards;
        if (rc == 0 && opt && opt->policy >= 0) o.policy = opt->policy;
        if (rc == 0) rc = create(s, name, len, hash, &o, &rec_off);
      }
      tally__unlock(s);
    }
    if (rc == TALLY_ENOENT)
      return tally__fail(TALLY_ENOENT, "no such counter '%.*s'", (int)len, name);
    if (rc == 0) rc = tally__rec_verify(s, rec_off);
    if (rc) return rc;
    struct tally__rec *r = tally__at(s, rec_off);
    loc = atomic_load_explicit(&r->loc, memory_order_acquire);
    uint64_t cells;
    uint32_t n;
    bool dropped;
    rc = tally__loc_decode(s, rec_off, loc, &cells, &n, &dropped);
    if (rc) return rc;
    if (!dropped) break;
    if (attempt == 8) /* dropped again and again under us */
      return tally__fail(TALLY_EDROPPED, "counter '%.*s' was dropped",
                         (int)len, name);
  }
  struct tally__rec *r = tally__at(s, rec_off);
  uint32_t n = loc_shards(loc);
  if (opt && ((opt->shards && opt->shards != n) ||
              (opt->policy >= 0 && opt->policy != r->policy)))
    return tally__fail(TALLY_EMISMATCH, "counter '%.*s' exists with %u shards "
                       "and policy %s", (int)len, name, n,
                       tally_policy_name(r->policy));
  tally_counter *c = calloc(1, sizeof *c);
  if (!c) return tally__fail(TALLY_ENOMEM, "out of memory");
  c->s = s;
  c->rec = r;
  c->rec_off = rec_off;
  c->policy = r->policy;
  atomic_init(&c->loc, loc);
  *out = c;
  return 0;
}

void tally_counter_close(tally_counter *c) { free(c); }

/* ---- increments ----------------------------------------------------------- */

/* The cells at `seen` were frozen: learn where the counter went. Waits for
 * (or finishes, if its process died) a move still in progress. */
static int refresh(tally_counter *c, uint64_t seen) {
  for (int round = 0;; round++) {
    uint64_t loc = atomic_load_explicit(&c->rec->loc, memory_order_acquire);
    if (loc != seen) {
      uint64_t cells;
      uint32_t n;
      bool dropped;
      int rc = tally__loc_decode(c->s, c->rec_off, loc, &cells, &n, &dropped);
      if (rc) return rc;
      if (dropped)
        return tally__fail(TALLY_EDROPPED, "counter '%s' was dropped", c->rec->name);
      atomic_store_explicit(&c->loc, loc, memory_order_relaxed);
      return 0;
    }
    if (round == 2)
      return tally__fail(TALLY_ECORRUPT, "%s: tally store is corrupt (counter "
                         "'%s' has frozen cells and no move)", store_name(c->s),
                         c->rec->name);
    tally__lock(c->s);
    tally__unlock(c->s);
  }
}

/* 0: added; 1: the cell is frozen; TALLY_ERANGE: would leave the range. */
static inline int cell_add(_Atomic int64_t *cell, int64_t delta) {
  int64_t v = atomic_load_explicit(cell, memory_order_relaxed);
  for (;;) {
    int64_t nv;
    if (__builtin_expect(tally__cell_frozen(v), 0)) return 1;
    if (__builtin_add_overflow(v, delta, &nv) || tally__cell_frozen(nv))
      return TALLY_ERANGE;
    if (atomic_compare_exchange_weak_explicit(cell, &v, nv, memory_order_relaxed,
                                              memory_order_relaxed))
      return 0;
  }
}

static int range_error(tally_counter *c, int64_t delta) {
  return tally__fail(TALLY_ERANGE, "counter '%s': adding %lld would overflow "
                     "a shard (shards hold -2^62 to 2^62-1)", c->rec->name,
                     (long long)delta);
}

enum pick { PICK_POLICY, PICK_KEY, PICK_SHARD };

static int add(tally_counter *c, enum pick how, const void *key, size_t klen,
               uint32_t shard, int64_t delta) {
  for (;;) {
    uint64_t loc = atomic_load_explicit(&c->loc, memory_order_relaxed);
    uint32_t n = loc_shards(loc), i;
    if (how == PICK_POLICY) i = tally__pick_shard(c->s, c->policy, n);
    else if (how == PICK_KEY) i = tally__key_shard(key, klen, n);
    else if (shard < n) i = shard;
    else return tally__fail(TALLY_ESHARDS, "shard %u out of range (counter "
                            "'%s' has %u shards)", shard, c->rec->name, n);
    int rc = cell_add(cell_at(c->s, loc, i), delta);
    if (__builtin_expect(rc == 0, 1)) return 0;
    if (rc < 0) return range_error(c, delta);
    rc = refresh(c, loc);
    if (rc) return rc;
  }
}

int tally_counter_incr(tally_counter *c, int64_t delta) {
  if (!c) return tally__fail(TALLY_EINVAL, "tally_counter_incr: counter is NULL");
  if (__builtin_expect(c->policy >= TALLY_POLICY_KEY, 0))
    return tally__fail(TALLY_EPOLICY, "counter '%s' has the %s policy: use %s",
                       c->rec->name, tally_policy_name(c->policy),
                       c->policy == TALLY_POLICY_KEY ? "tally_counter_incr_key"
                                                     : "tally_counter_incr_shard");
  return add(c, PICK_POLICY, NULL, 0, 0, delta);
}

int tally_counter_incr_key(tally_counter *c, const void *key, size_t len,
                           int64_t delta) {
  if (!c || (!key && len))
    return tally__fail(TALLY_EINVAL, "tally_counter_incr_key: NULL argument");
  return add(c, PICK_KEY, key, len, 0, delta);
}

int tally_counter_incr_shard(tally_counter *c, uint32_t shard, int64_t delta) {
  if (!c) return tally__fail(TALLY_EINVAL, "tally_counter_incr_shard: counter is NULL");
  return add(c, PICK_SHARD, NULL, 0, shard, delta);
}

/* ---- reading -------------------------------------------------------------- */

/* Sum the cells at loc; *frozen tells whether any was frozen. */
static __int128 sum_cells(tally_store *s, uint64_t loc, bool *frozen) {
  __int128 total = 0;
  bool any = false;
  for (uint32_t i = 0, n = loc_shards(loc); i < n; i++) {
    int64_t v = atomic_load_explicit(cell_at(s, loc, i), memory_order_relaxed);
    any |= tally__cell_frozen(v);
    total += tally__cell_thaw(v);
  }
  *frozen = any;
  return total;
}

/* Current location of a record, validated, for readers. */
static int current(tally_store *s, uint64_t rec_off, const char *name,
                   uint64_t *loc) {
  struct tally__rec *r = tally__at(s, rec_off);
  uint64_t l = atomic_load_explicit(&r->loc, memory_order_acquire), cells;
  uint32_t n;
  bool dropped;
  int rc = tally__loc_decode(s, rec_off, l, &cells, &n, &dropped);
  if (rc) return rc;
  if (dropped) return tally__fail(TALLY_EDROPPED, "counter '%s' was dropped", name);
  *loc = l;
  return 0;
}

static int to_int64(__int128 total, const char *name, int64_t *out) {
  if (total > INT64_MAX || total < INT64_MIN)
    return tally__fail(TALLY_ERANGE, "counter '%s': value does not fit in "
                       "64 bits", name);
  *out = (int64_t)total;
  return 0;
}

/* A reader meeting frozen cells re-reads rec->loc: if it moved, it reads
 * the new cells; if not, the move is pending and the old cells (frozen or
 * not) still hold every completed increment. */
int tally__rec_value(tally_store *s, uint64_t rec_off, int64_t *out) {
  struct tally__rec *r = tally__at(s, rec_off);
  uint64_t loc;
  for (;;) {
    int rc = current(s, rec_off, r->name, &loc);
    if (rc) return rc;
    bool frozen;
    __int128 total = sum_cells(s, loc, &frozen);
    if (!frozen || atomic_load_explicit(&r->loc, memory_order_acquire) == loc)
      return to_int64(total, r->name, out);
  }
}

int tally_counter_value(tally_counter *c, int64_t *out) {
  if (!c || !out) return tally__fail(TALLY_EINVAL, "tally_counter_value: NULL argument");
  uint64_t loc = atomic_load_explicit(&c->loc, memory_order_relaxed);
  bool frozen;
  __int128 total = sum_cells(c->s, loc, &frozen);
  if (__builtin_expect(!frozen, 1)) return to_int64(total, c->rec->name, out);
  int64_t v;
  int rc = tally__rec_value(c->s, c->rec_off, &v);
  if (rc) return rc;
  atomic_store_explicit(&c->loc, atomic_load(&c->rec->loc), memory_order_relaxed);
  *out = v;
  return 0;
}

int tally_counter_shards(tally_counter *c, int64_t *vals, uint32_t cap,
                         uint32_t *n) {
  if (!c || !n || (!vals && cap))
    return tally__fail(TALLY_EINVAL, "tally_counter_shards: NULL argument");
  for (;;) {
    uint64_t loc;
    int rc = current(c->s, c->rec_off, c->rec->name, &loc);
    if (rc) return rc;
    uint32_t k = loc_shards(loc);
    bool frozen = false;
    for (uint32_t i = 0; i < k && i < cap; i++) {
      int64_t v = atomic_load_explicit(cell_at(c->s, loc, i), memory_order_relaxed);
      frozen |= tally__cell_frozen(v);
      vals[i] = tally__cell_thaw(v);
    }
    if (!frozen || atomic_load(&c->rec->loc) == loc) {
      atomic_store_explicit(&c->loc, loc, memory_order_relaxed);
      *n = k;
      return 0;
    }
  }
}

int tally_counter_info_get(tally_counter *c, tally_counter_info *out) {
  if (!c || !out) return tally__fail(TALLY_EINVAL, "tally_counter_info_get: NULL argument");
  uint64_t loc;
  int rc = current(c->s, c->rec_off, c->rec->name, &loc);
  if (rc) return rc;
  out->name = c->rec->name;
  out->name_len = c->rec->name_len;
  out->shards = loc_shards(loc);
  out->policy = c->policy;
  return 0;
}

/* ---- reset, reshard, drop ------------------------------------------------- */

int tally_counter_reset(tally_counter *c, int64_t *removed) {
  if (!c || !removed) return tally__fail(TALLY_EINVAL, "tally_counter_reset: NULL argument");
  int64_t total = 0;
  bool overflow = false;
  uint64_t loc = atomic_load_explicit(&c->loc, memory_order_relaxed);
  for (uint32_t i = 0; i < loc_shards(loc); i++) {
    _Atomic int64_t *cell = cell_at(c->s, loc, i);
    int64_t v = atomic_load_explicit(cell, memory_order_relaxed), sum;
    for (;;) {
      if (tally__cell_frozen(v)) break;
      if (__builtin_add_overflow(total, v, &sum)) {
        overflow = true; /* leave this shard as it is */
        break;
      }
      if (atomic_compare_exchange_weak_explicit(cell, &v, 0, memory_order_relaxed,
                                                memory_order_relaxed)) {
        total = sum;
        break;
      }
    }
    if (tally__cell_frozen(v)) {
      /* moved: what we took is ours; what is left moved with the counter */
      int rc = refresh(c, loc);
      if (rc) return rc;
      loc = atomic_load_explicit(&c->loc, memory_order_relaxed);
      i = (uint32_t)-1; /* start over on the new cells */
    }
  }
  *removed = total;
  if (overflow)
    return tally__fail(TALLY_ERANGE, "counter '%s': the amount to remove does "
                       "not fit in 64 bits; %lld removed, the rest kept",
                       c->rec->name, (long long)total);
  return 0;
}

int tally_counter_reshard(tally_counter *c, uint32_t shards) {
  if (!c) return tally__fail(TALLY_EINVAL, "tally_counter_reshard: counter is NULL");
  if (shards < 1 || shards > TALLY_MAX_SHARDS)
    return tally__fail(TALLY_ESHARDS, "shard count %u out of range (1 to %d)",
                       shards, TALLY_MAX_SHARDS);
  tally_store *s = c->s;
  tally__lock(s);
  uint64_t loc, cells;
  int rc = current(s, c->rec_off, c->rec->name, &loc);
  if (rc == 0 && loc_shards(loc) != shards) {
    rc = alloc_cells(s, shards, &cells);
    if (rc == 0) rc = move(s, c->rec_off, tally__loc_make(s, c->rec_off, cells,
                                                          shards, false));
  }
  tally__unlock(s);
  atomic_store_explicit(&c->loc, atomic_load(&c->rec->loc), memory_order_relaxed);
  return rc;
}

int tally_store_drop(tally_store *s, const char *name, size_t len) {
  if (!s) return tally__fail(TALLY_EINVAL, "tally_store_drop: store is NULL");
  int rc = check_name(name, len);
  if (rc) return rc;
  uint64_t hash = tally__hash(name, len, 0), rec_off, loc, cells;
  uint32_t n;
  bool dropped;
  tally__lock(s);
  rc = tally__index_find(s, name, len, hash, &rec_off);
  if (rc == TALLY_ENOENT)
    rc = tally__fail(TALLY_ENOENT, "no such counter '%.*s'", (int)len, name);
  if (rc == 0) rc = tally__rec_verify(s, rec_off);
  if (rc == 0) {
    loc = atomic_load(&((struct tally__rec *)tally__at(s, rec_off))->loc);
    rc = tally__loc_decode(s, rec_off, loc, &cells, &n, &dropped);
  }
  if (rc == 0) rc = move(s, rec_off, tally__loc_make(s, rec_off, cells, n, true));
  tally__unlock(s);
  return rc;
}
