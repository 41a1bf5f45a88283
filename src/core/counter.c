/* counter.c -- counters: open, increment, read, reset.
 *
 * Increment: pick a shard and fetch-add on its cell. If the cell was
 * retired by a move (move.c), the add is left there (it no longer counts)
 * and the slow path follows the counter; if the new value left the range,
 * the add is undone. Deltas of 2^32 or more always take a compare-and-swap
 * loop instead, so they never need an undo and never push a retired cell
 * far from SENTINEL. The handle caches the cell location, so the hot path
 * touches one cell.
 *
 * Anyone who meets a retired cell reloads the counter's location; if it has
 * not moved yet, the store lock waits for the mover, or finishes the move
 * if its process died (settle()).
 */
#include "internal.h"
#include "percpu.h"

#include <stdlib.h>
#include <string.h>

/* ---- creation ------------------------------------------------------------- */

static uint64_t new_incarnation(tally_store *s) {
  static _Atomic uint64_t seq;
  uint64_t x = tally__mix(s->hdr->salt ^ (uint64_t)tally_monotonic_ns() ^
                          atomic_fetch_add(&seq, 1) << 40 ^ (uint64_t)(uintptr_t)&seq);
  return x ? x : 1;
}

/* Caller holds the lock. family: the pattern hash it counts under, or 0. */
static int create(tally_store *s, const char *name, size_t len, uint64_t hash,
                  const tally_counter_options *o, uint32_t family, uint64_t *rec_off) {
  uint64_t cells, off;
  /* auto from a family, with a key or shard policy from elsewhere: fixed */
  bool is_auto = o->shards == TALLY_SHARDS_AUTO && o->policy < TALLY_POLICY_KEY;
  uint32_t shards = o->policy == TALLY_POLICY_SLOT   ? TALLY_SLOT_SHARDS
                    : o->policy == TALLY_POLICY_CPU  ? tally_cpu_shards()
                    : is_auto                        ? 1
                    : o->shards == TALLY_SHARDS_AUTO ? TALLY_DEFAULT_SHARDS
                                                     : o->shards;
  int rc = tally__cells_alloc(s, shards, &cells);
  if (rc) return rc;
  if ((rc = tally__alloc_small(s, tally__rec_bytes(len), &off))) {
    /* (a full disk): give the cells back, or each refusal keeps a column */
    tally__free_now(s, tally__item(TALLY__ITEM_COLUMN, cells, shards));
    return rc;
  }
  struct tally__rec *r = tally__at(s, off);
  r->policy = (uint8_t)o->policy;
  r->name_len = (uint8_t)len;
  r->incarnation = new_incarnation(s);
  r->family = family;
  atomic_store(&r->flags, (uint32_t)TALLY__KIND_COUNTER << TALLY__REC_KIND_SHIFT |
                              (is_auto ? TALLY__REC_AUTO : 0));
  memcpy(r->name, name, len);
  r->check = tally__rec_checksum(r);
  atomic_store_explicit(&r->loc, tally__loc_make(s, off, cells, shards, false),
                        memory_order_release);
  if (is_auto) atomic_store(&s->hdr->autos, 1); /* upkeep looks for them */
  rc = tally__index_insert(s, hash, off);
  if (rc == 0) {
    *rec_off = off;
  } else { /* not in the index (it could not grow): nobody can reach either */
    tally__free_now(s, tally__item(TALLY__ITEM_COLUMN, cells, shards));
    tally__free_now(s, tally__item(TALLY__ITEM_SMALL, off, tally__rec_units(s, len)));
  }
  return rc;
}

/* Create name under the lock, with its family's options and cap: a family
 * at its cap gets the name of its overflow counter instead (in *name,
 * *len: over, a buffer of TALLY_NAME_MAX + 1). */
static int create_locked(tally_store *s, const char **name, size_t *len, uint64_t *hash,
                         const tally_counter_options *opt, char *over,
                         uint64_t *rec_off) {
  const struct tally__family *f;
  int rc = tally__family_of(s, *name, *len, &f);
  if (rc) return rc;
  uint32_t fam = f ? tally__pattern_hash(f->pattern, f->pattern_len) : 0;
  if (f && f->max_counters &&
      atomic_load(&((struct tally__family *)f)->live) >= f->max_counters) {
    int n = tally_family_overflow(f->pattern, f->pattern_len, over, TALLY_NAME_MAX + 1);
    if (n < 0) return n;
    fam = 0; /* the overflow counter is not one of the capped names */
    atomic_fetch_add(&s->hdr->capped, 1);
    if ((size_t)n != *len || memcmp(over, *name, *len) != 0) {
      *name = over;
      *len = (size_t)n;
      *hash = tally__hash(over, (size_t)n, 0);
      rc = tally__index_find(s, over, (size_t)n, *hash, rec_off);
      if (rc != TALLY_ENOENT) return rc; /* it exists (or the index is damaged) */
    }
  }
  tally_counter_options o;
  rc = tally_family_resolve(s, *name, *len, &o);
  if (rc == 0 && opt && opt->shards) o.shards = opt->shards;
  if (rc == 0 && opt && opt->policy >= 0) o.policy = opt->policy;
  if (rc == 0) rc = create(s, *name, *len, *hash, &o, fam, rec_off);
  if (rc == 0 && fam) TALLY__TEST_HOOK("indexed", *name, *len);
  /* a holder killed before this leaves the count one short: a takeover
   * recounts (lock.c) */
  if (rc == 0 && fam) atomic_fetch_add(&((struct tally__family *)f)->live, 1);
  if (rc == 0 && atomic_load_explicit(&s->hdr->limbo_head, memory_order_relaxed))
    tally__grace_step(s, false, true); /* churn: reuse what was retired */
  return rc;
}

/* Find name in the index or, with TALLY_COUNTER_CREATE, create it under
 * the lock; a capped family may give its overflow counter instead (*name,
 * *len and *hash then name it; over holds it). *made (made may be NULL):
 * the name asked for was absent under the lock (created, or its family's
 * overflow given). */
static int find_or_create(tally_store *s, const char **name, size_t *len, uint64_t *hash,
                          const tally_counter_options *opt, uint32_t flags, char *over,
                          uint64_t *rec_off, bool *made) {
  int rc = tally__index_find(s, *name, *len, *hash, rec_off);
  if (made) *made = false;
  if (rc == TALLY_ENOENT && (flags & TALLY_COUNTER_CREATE)) {
    if ((rc = tally__lock(s))) return rc;
    rc = tally__index_find(s, *name, *len, *hash, rec_off);
    if (rc == TALLY_ENOENT) {
      rc = create_locked(s, name, len, hash, opt, over, rec_off);
      if (made) *made = rc == 0;
    }
    tally__unlock(s);
  }
  if (rc == TALLY_ENOENT)
    return tally__fail(TALLY_ENOENT, "no such counter '%.*s'", (int)*len, *name);
  return rc;
}

int tally__check_name(const char *name, size_t len) {
  if (!name || len == 0 || len > TALLY_NAME_MAX || memchr(name, 0, len))
    return tally__fail(TALLY_ENAME,
                       "invalid counter name (1 to %d bytes, "
                       "no NUL)",
                       TALLY_NAME_MAX);
  return 0;
}

static int check_options(const tally_counter_options *o) {
  if (!o) return 0;
  if (o->shards == TALLY_SHARDS_AUTO && o->policy >= TALLY_POLICY_KEY &&
      o->policy != TALLY_POLICY_SLOT && o->policy != TALLY_POLICY_CPU)
    return tally__fail(TALLY_EPOLICY,
                       "automatic shards need a policy that picks "
                       "the shard itself (not %s)",
                       tally_policy_name(o->policy));
  if (o->shards > TALLY_MAX_SHARDS && o->shards != TALLY_SHARDS_AUTO)
    return tally__fail(TALLY_ESHARDS, "shard count %u out of range (1 to %d)", o->shards,
                       TALLY_MAX_SHARDS);
  if (o->policy < -1 || o->policy >= TALLY_POLICY_COUNT_)
    return tally__fail(TALLY_EPOLICY, "invalid shard policy %d", o->policy);
  if (o->policy == TALLY_POLICY_SLOT && o->shards && o->shards != TALLY_SHARDS_AUTO &&
      o->shards != TALLY_SLOT_SHARDS)
    return tally__fail(TALLY_ESHARDS,
                       "the slot policy has one shard per writer slot: %d shards, not %u",
                       TALLY_SLOT_SHARDS, o->shards);
  if (o->policy == TALLY_POLICY_CPU && o->shards && o->shards != TALLY_SHARDS_AUTO &&
      o->shards != tally_cpu_shards())
    return tally__fail(TALLY_ESHARDS, "the cpu policy has %u shards here, not %u",
                       tally_cpu_shards(), o->shards);
  return 0;
}

/* The increment's path for a policy (struct tally_counter.fast). */
static int fast_path(int policy, bool is_auto) {
  if (policy == TALLY_POLICY_CPU) return TALLY__FAST_CPU;
  int path = policy == TALLY_POLICY_THREAD ? 0 : policy == TALLY_POLICY_RANDOM ? 1 : 4;
  return path | (is_auto ? 2 : 0);
}

#ifdef TALLY_TEST_SEAMS
void (*tally__test_hook)(const char *where, const char *name, size_t len);
#endif

/* tally_counter_open once its arguments are checked, under the epoch's
 * hold: from the lookup to the handle's insertion, nothing it found may
 * be reused (grace.c). */
static int open_held(tally_store *s, const char *name, size_t len,
                     const tally_counter_options *opt, uint32_t flags,
                     tally_counter **out) {
  uint64_t hash = tally__hash(name, len, 0), rec_off = 0, loc = 0;
  char over[TALLY_NAME_MAX + 1];
  bool made;
  int rc;
  for (int attempt = 0;; attempt++) {
    rc = find_or_create(s, &name, &len, &hash, opt, flags, over, &rec_off, &made);
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
      return tally__fail(TALLY_EDROPPED, "counter '%.*s' was dropped", (int)len, name);
    if ((rc = tally__lock(s))) return rc; /* a drop is finishing: wait for it */
    tally__unlock(s);
  }
  if ((flags & (TALLY_COUNTER_CREATE | TALLY_COUNTER_EXCL)) ==
          (TALLY_COUNTER_CREATE | TALLY_COUNTER_EXCL) &&
      !made)
    return tally__fail(TALLY_EEXIST, "counter '%.*s' exists", (int)len, name);
  TALLY__TEST_HOOK("open", name, len);
  struct tally__rec *r = tally__at(s, rec_off);
  uint32_t n = tally__loc_shards(loc);
  bool is_auto = (atomic_load(&r->flags) & TALLY__REC_AUTO) != 0;
  if (opt && ((r->policy == TALLY_POLICY_SLOT || r->policy == TALLY_POLICY_CPU
                   ? opt->shards && opt->shards != TALLY_SHARDS_AUTO && opt->shards != n
               : opt->shards == TALLY_SHARDS_AUTO ? !is_auto
                                                  : opt->shards && opt->shards != n) ||
              (opt->policy >= 0 && opt->policy != r->policy)))
    return tally__fail(TALLY_EMISMATCH,
                       "counter '%.*s' exists with %u%s shards "
                       "and policy %s",
                       (int)len, name, n, is_auto ? " (auto)" : "",
                       tally_policy_name(r->policy));
  /* Line-aligned: malloc's 16-byte alignment would split the hot first
   * line (loc, base, store_id, fast) across two cache lines for half the
   * handles, two misses per increment on a cold counter instead of one. */
  size_t bytes = tally__round(sizeof(tally_counter) + len + 1, 64);
  tally_counter *c = aligned_alloc(64, bytes);
  if (!c) return tally__fail(TALLY_ENOMEM, "out of memory");
  memset(c, 0, bytes);
  c->s = s;
  c->base = s->base;
  c->store_id = s->id;
  atomic_init(&c->rec_off, rec_off);
  c->policy = r->policy;
  c->fast = fast_path(c->policy, is_auto);
  c->name_len = (uint32_t)len;
  memcpy(c->name, name, len);
  atomic_init(&c->loc, loc);
  tally__handle_add(s, c);
  *out = c;
  return 0;
}

int tally_counter_open(tally_store *s, const char *name, size_t len,
                       const tally_counter_options *opt, uint32_t flags,
                       tally_counter **out) {
  if (!s || !out) return tally__fail(TALLY_EINVAL, "tally_counter_open: NULL argument");
  int rc = tally__check_name(name, len);
  if (rc == 0) rc = check_options(opt);
  if (rc) return rc;
  tally__hold_begin(s);
  rc = open_held(s, name, len, opt, flags, out);
  tally__hold_end(s);
  return rc;
}

void tally_counter_close(tally_counter *c) {
  if (!c) return;
  if (c->s) tally__handle_remove(c->s, c); /* NULL: its store was closed first */
  free(c);
}

/* ---- a handle whose counter expired: it comes back ----------------------- */

/* Point c at its counter of the same name, created again if `create`. */
static int revive(tally_counter *c, bool create) {
  tally_store *s = c->s;
  tally_counter *fresh;
  /* held until c is back among the handles: a grace step in between would
   * refresh fresh but not c, as an open's (tally_counter_open) */
  tally__hold_begin(s);
  int rc = tally_counter_open(s, c->name, c->name_len, NULL,
                              create ? TALLY_COUNTER_CREATE : 0, &fresh);
  if (rc) {
    tally__hold_end(s);
    return rc;
  }
  TALLY__TEST_HOOK("revive", c->name, c->name_len);
  /* it moves to its new record's chain, in one section: two threads
   * reviving c at once would otherwise both add it */
  pthread_mutex_lock(&s->hlock);
  tally__handle_remove_locked(s, c);
  atomic_store(&c->rec_off, tally__crec(fresh));
  c->policy = fresh->policy;
  c->fast = fresh->fast;
  tally__handle_set_loc(c, atomic_load(&fresh->loc));
  atomic_store(&c->gone, 0);
  tally__handle_add_locked(s, c);
  pthread_mutex_unlock(&s->hlock);
  tally__hold_end(s);
  tally_counter_close(fresh);
  return 0;
}

/* Did c's counter expire (rather than being dropped)? Its record is still
 * its own unless this process's grace step has marked the handle. */
static bool expired(tally_counter *c) {
  int g = atomic_load(&c->gone);
  if (g) return g == 2;
  struct tally__rec *r = tally__at(c->s, tally__crec(c));
  return (atomic_load(&r->flags) & TALLY__REC_EXPIRED) != 0;
}

static int dropped_error(tally_counter *c) {
  return tally__fail(TALLY_EDROPPED, "counter '%s' was dropped", c->name);
}

int tally__counter_live(tally_counter *c) {
  int g = atomic_load(&c->gone);
  if (!g) return 0;
  return g == 2 ? revive(c, false) : dropped_error(c);
}

/* ---- finding the cells again after a move -------------------------------- */

static bool none_retired(tally_store *s, uint64_t loc) {
  for (uint32_t i = 0, n = tally__loc_shards(loc); i < n; i++)
    if (tally__cell_retired(
            atomic_load_explicit(tally__cell_at(s, loc, i), memory_order_acquire)))
      return false;
  return true;
}

/* The cells at `seen` were found retired: wait for the move (or finish it,
 * if its process died; the lock does that) and give the counter's current
 * location, which is `seen` again if the move was undone (ERANGE).
 * TALLY_EDROPPED if the move was a drop. */
static int settle(tally_store *s, uint64_t rec_off, uint64_t seen, uint64_t *loc) {
  struct tally__rec *r = tally__at(s, rec_off);
  for (int round = 0; round < 4; round++) {
    uint64_t l = atomic_load_explicit(&r->loc, memory_order_acquire), cells;
    uint32_t n;
    bool dropped;
    int rc = tally__loc_decode(s, rec_off, l, &cells, &n, &dropped);
    if (rc) return rc;
    if (dropped) return tally__fail(TALLY_EDROPPED, "counter '%s' was dropped", r->name);
    if (l != seen || (round > 0 && none_retired(s, l))) {
      *loc = l;
      return 0;
    }
    if ((rc = tally__lock(s))) return rc;
    tally__unlock(s);
  }
  return tally__fail(TALLY_ECORRUPT,
                     "%s: tally store is corrupt (counter '%s' "
                     "has retired cells and no move)",
                     tally__store_name(s), r->name);
}

static int range_error(tally_counter *c, int64_t delta) {
  return tally__fail(TALLY_ERANGE,
                     "counter '%s': adding %lld would overflow "
                     "a shard (shards hold -2^62 to 2^62-1)",
                     c->name, (long long)delta);
}

/* An expired counter comes back at 0 for an add of delta, unless delta
 * could not be added to 0 (then nothing is created). */
static int comeback(tally_counter *c, int64_t delta) {
  return tally__cell_live(delta) ? revive(c, true) : range_error(c, delta);
}

static int refresh(tally_counter *c, uint64_t seen, int64_t delta) {
  uint64_t loc, rec = tally__crec(c);
  int gone = atomic_load(&c->gone); /* once: a revive may clear it meanwhile */
  if (gone) return gone == 2 ? comeback(c, delta) : dropped_error(c);
  int rc = settle(c->s, rec, seen, &loc);
  TALLY__TEST_HOOK("refresh", c->name, c->name_len);
  /* another thread revived c meanwhile: what was found is of its old
   * record, and expired() would look at the new one; go again */
  if (tally__crec(c) != rec) return 0;
  if (rc == TALLY_EDROPPED && expired(c)) return comeback(c, delta);
  if (rc == 0) tally__handle_set_loc(c, loc);
  return rc;
}

/* ---- increments ----------------------------------------------------------- */

/* 0: added; 1: the cell is retired; 2: another writer's add is in flight
 * past the range, try again; TALLY_ERANGE: this add would leave the range. */
static inline int cell_add(_Atomic int64_t *cell, int64_t delta) {
  if (__builtin_expect(delta > -TALLY__FAST_DELTA && delta < TALLY__FAST_DELTA, 1)) {
    int64_t old = atomic_fetch_add_explicit(cell, delta, memory_order_relaxed);
    if (__builtin_expect(tally__cell_live(old) && tally__cell_live(old + delta), 1))
      return 0;
    if (tally__cell_retired(old)) return 1; /* no undo: see internal.h */
    atomic_fetch_sub_explicit(cell, delta, memory_order_relaxed); /* undo */
    return tally__cell_live(old) ? TALLY_ERANGE : 2;
  }
  int64_t v = atomic_load_explicit(cell, memory_order_relaxed), nv;
  for (;;) {
    if (tally__cell_retired(v)) return 1;
    if (!tally__cell_live(v)) return 2;
    if (__builtin_add_overflow(v, delta, &nv) || !tally__cell_live(nv))
      return TALLY_ERANGE;
    if (atomic_compare_exchange_weak_explicit(cell, &v, nv, memory_order_relaxed,
                                              memory_order_relaxed))
      return 0;
  }
}

enum pick { PICK_POLICY, PICK_KEY, PICK_SHARD };

static int add(tally_counter *c, enum pick how, const void *key, size_t klen,
               uint32_t shard, int64_t delta) {
  for (;;) {
    uint64_t loc = atomic_load_explicit(&c->loc, memory_order_acquire);
    uint32_t n = tally__loc_shards(loc), i;
    if (how == PICK_POLICY && c->policy == TALLY_POLICY_CPU)
      i = tally__cpu_fallback_shard(c->s, c->store_id, n);
    else if (how == PICK_POLICY)
      i = tally__pick_shard(c->s, c->store_id, c->policy, n);
    else if (how == PICK_KEY)
      i = tally__key_shard(key, klen, n);
    else if (shard < n)
      i = shard;
    else { /* out of range of the cached cells: they may be stale */
      uint64_t cur = loc;
      int rc = atomic_load(&c->gone) ? TALLY_EDROPPED
                                     : tally__current(c->s, tally__crec(c), &cur);
      if (rc == 0 && cur == loc)
        return tally__fail(TALLY_ESHARDS,
                           "shard %u out of range (counter "
                           "'%s' has %u shards)",
                           shard, c->name, n);
      if (rc == 0) /* resharded since */
        tally__handle_set_loc(c, cur);
      else if ((rc = refresh(c, loc, delta))) /* dropped; an expired one comes back */
        return rc;
      continue;
    }
    _Atomic int64_t *cell = tally__cell_in(c->base, loc, i);
    int rc = cell_add(cell, delta);
    if (__builtin_expect(rc == 0, 1)) {
      if ((c->fast & 2) && how == PICK_POLICY &&
          tally__sample_due(atomic_load_explicit(cell, memory_order_relaxed), cell))
        return tally__auto_sample(c, loc);
      return 0;
    }
    if (rc < 0) return range_error(c, delta);
    if (rc == 1 && cell == &c->s->hdr->tombstone) /* stale adds never count */
      atomic_store_explicit(cell, TALLY__SENTINEL, memory_order_relaxed);
    if (rc == 2) { /* wait for the other add to be undone (or repaired) */
      int64_t v = atomic_load(cell);
      if ((rc = tally__cell_wait(c->s, cell, tally__crec(c), i, &v))) return rc;
      continue;
    }
    rc = refresh(c, loc, delta);
    if (rc) return rc;
  }
}

/* Everything but the common case, kept out of line: a locked add waits for
 * the store buffer to drain, so the fast path must not spill registers. */
__attribute__((noinline)) static int incr_slow(tally_counter *c, int64_t delta) {
  if (!c) return tally__fail(TALLY_EINVAL, "tally_counter_incr: counter is NULL");
  if (c->policy == TALLY_POLICY_SLOT) return tally__slot_incr(c, delta);
  if (c->policy == TALLY_POLICY_CPU) return add(c, PICK_POLICY, NULL, 0, 0, delta);
  if (c->policy >= TALLY_POLICY_KEY)
    return tally__fail(TALLY_EPOLICY, "counter '%s' has the %s policy: use %s", c->name,
                       tally_policy_name(c->policy),
                       c->policy == TALLY_POLICY_KEY ? "tally_counter_incr_key"
                                                     : "tally_counter_incr_shard");
  return add(c, PICK_POLICY, NULL, 0, 0, delta);
}

/* The cpu policy: its sequence (percpu.h), else the thread policy's path,
 * where a CPU new to the store is noted first (out of line: no call on
 * the sequence's path, which would save registers before it). */
__attribute__((noinline)) static int cpu_slow(tally_counter *c, int64_t delta) {
  tally__cpu_seen(c);
  return incr_slow(c, delta);
}

__attribute__((noinline)) static int cpu_incr(tally_counter *c, int64_t delta) {
  if (__builtin_expect(tally__cpu_try(c, delta) == 0, 1)) return 0;
  return cpu_slow(c, delta);
}

int tally_counter_incr(tally_counter *c, int64_t delta) {
  if (__builtin_expect(c && c->fast < 4 && delta > -TALLY__FAST_DELTA &&
                           delta < TALLY__FAST_DELTA,
                       1)) {
    int fast = c->fast;
    uint64_t loc = atomic_load_explicit(&c->loc, memory_order_acquire);
    uint32_t n = tally__loc_shards(loc), i;
    /* no calls on this path: a call would make the function save registers,
     * and a locked add waits for those stores to drain */
    if ((fast & 1) == 0 && __builtin_expect(tally__me.store_id == c->store_id, 1))
      i = tally__reduce(tally__me.ticket, n);
    else if ((fast & 1) && __builtin_expect(tally__me.rng != 0, 1))
      i = tally__pick_shard(c->s, c->store_id, TALLY_POLICY_RANDOM, n);
    else
      return incr_slow(c, delta);
    _Atomic int64_t *cell = tally__cell_in(c->base, loc, i);
    int64_t old = atomic_fetch_add_explicit(cell, delta, memory_order_relaxed);
    if (__builtin_expect(tally__cell_live(old) && tally__cell_live(old + delta), 1)) {
      if (__builtin_expect((fast & 2) && tally__sample_due(old, cell), 0))
        return tally__auto_sample(c, loc); /* a tail call: no registers saved */
      return 0;
    }
    if (!tally__cell_retired(old)) /* out of range: undo; retired: see internal.h */
      atomic_fetch_sub_explicit(cell, delta, memory_order_relaxed);
  } else if (c && c->fast == TALLY__FAST_CPU) {
    return cpu_incr(c, delta); /* a tail call: the path above saves no registers */
  }
  return incr_slow(c, delta);
}

/* A slot counter's shard is its writer's: nobody else may pick it. */
static int slot_refused(const tally_counter *c) {
  if (c->policy == TALLY_POLICY_CPU) /* nor a CPU's, nor shard 0 (resets') */
    return tally__fail(TALLY_EPOLICY,
                       "counter '%s' has the cpu policy: each CPU adds to its own "
                       "shard (tally_counter_incr)",
                       c->name);
  return tally__fail(TALLY_EPOLICY,
                     "counter '%s' has the slot policy: each writer adds to its "
                     "own shard (tally_counter_incr, tally_batch_incr)",
                     c->name);
}

int tally_counter_incr_key(tally_counter *c, const void *key, size_t len, int64_t delta) {
  if (!c || (!key && len))
    return tally__fail(TALLY_EINVAL, "tally_counter_incr_key: NULL argument");
  if (c->policy == TALLY_POLICY_SLOT || c->policy == TALLY_POLICY_CPU)
    return slot_refused(c);
  return add(c, PICK_KEY, key, len, 0, delta);
}

int tally_counter_incr_shard(tally_counter *c, uint32_t shard, int64_t delta) {
  if (!c) return tally__fail(TALLY_EINVAL, "tally_counter_incr_shard: counter is NULL");
  if (c->policy == TALLY_POLICY_SLOT || c->policy == TALLY_POLICY_CPU)
    return slot_refused(c);
  return add(c, PICK_SHARD, NULL, 0, shard, delta);
}

/* ---- increments by name, without a handle --------------------------------- */

/* What tally_store_incr does not do in place goes through a handle. */
static int incr_by_handle(tally_store *s, const char *name, size_t len, uint32_t flags,
                          int64_t delta) {
  tally_counter *c = NULL;
  int rc = tally_counter_open(s, name, len, NULL, flags, &c);
  if (rc == 0) rc = tally_counter_incr(c, delta);
  tally_counter_close(c);
  return rc;
}

/* One increment in 256 of an automatic counter samples for contention,
 * which needs a handle (it may reshard the counter). */
static void sample_by_handle(tally_store *s, const char *name, size_t len, uint64_t loc) {
  tally_counter *c;
  if (tally_counter_open(s, name, len, NULL, 0, &c) == 0) {
    (void)tally__auto_sample(c, loc);
    tally_counter_close(c);
  }
}

static int name_range_error(const char *name, size_t len, int64_t delta) {
  return tally__fail(TALLY_ERANGE,
                     "counter '%.*s': adding %lld would overflow "
                     "a shard (shards hold -2^62 to 2^62-1)",
                     (int)len, name, (long long)delta);
}

/* Before a use of name without a handle: the name checked, and this
 * process held back from publishing itself idle (grace.c). */
static int by_name_begin(tally_store *s, const char *name, size_t len) {
  int rc = tally__check_name(name, len);
  if (rc == 0 && !atomic_load_explicit(&s->by_name, memory_order_relaxed))
    tally__grace_by_name(s);
  return rc;
}

int tally_store_incr(tally_store *s, const char *name, size_t len, int64_t delta,
                     uint32_t flags) {
  if (!s) return tally__fail(TALLY_EINVAL, "tally_store_incr: store is NULL");
  if (flags & TALLY_COUNTER_EXCL) /* an add by name cannot tell its counter new */
    return tally__fail(TALLY_EINVAL, "tally_store_incr: TALLY_COUNTER_EXCL is for "
                                     "tally_counter_open");
  int rc = by_name_begin(s, name, len);
  if (rc) return rc;
  char over[TALLY_NAME_MAX + 1];
  uint64_t hash = tally__hash(name, len, 0), rec_off = 0, loc;
  for (int drops = 0;;) {
    /* no counter is left behind by an add that cannot succeed on it */
    bool fits = delta >= -(INT64_C(1) << 62) && delta < INT64_C(1) << 62;
    rc = find_or_create(s, &name, &len, &hash, NULL, fits ? flags : 0, over, &rec_off,
                        NULL);
    if (rc == TALLY_ENOENT && !fits && (flags & TALLY_COUNTER_CREATE))
      return name_range_error(name, len, delta);
    if (rc) return rc;
    struct tally__rec *r = tally__at(s, rec_off);
    uint64_t cells;
    uint32_t n;
    bool dropped;
    loc = atomic_load_explicit(&r->loc, memory_order_acquire);
    if ((rc = tally__loc_decode(s, rec_off, loc, &cells, &n, &dropped))) return rc;
    if (dropped) { /* a drop or expiry finishing: wait for it, look again */
      if (++drops == 8)
        return tally__fail(TALLY_EDROPPED, "counter '%.*s' was dropped", (int)len, name);
      if ((rc = tally__lock(s))) return rc;
      tally__unlock(s);
      continue;
    }
    if (r->policy >= TALLY_POLICY_KEY) /* refused, or a slot counter's batch */
      return incr_by_handle(s, name, len, flags, delta);
    uint32_t shard = tally__pick_shard(s, s->id, r->policy, n);
    _Atomic int64_t *cell = tally__cell_at(s, loc, shard);
    int added = cell_add(cell, delta);
    if (__builtin_expect(added == 0, 1)) {
      if ((atomic_load_explicit(&r->flags, memory_order_relaxed) & TALLY__REC_AUTO) &&
          tally__sample_due(atomic_load_explicit(cell, memory_order_relaxed), cell))
        sample_by_handle(s, name, len, loc);
      return 0;
    }
    if (added < 0) return name_range_error(name, len, delta);
    if (added == 2) { /* as add(): wait for the other add to be undone */
      int64_t v = atomic_load(cell);
      if ((rc = tally__cell_wait(s, cell, rec_off, shard, &v))) return rc;
      continue;
    }
    /* retired: the counter moved (or is being dropped); its add does not
     * count. Wait for the move, then look the name up again. */
    if ((rc = settle(s, rec_off, loc, &loc)) && rc != TALLY_EDROPPED) return rc;
  }
}

int tally_store_value(tally_store *s, const char *name, size_t len, int64_t *out) {
  if (!s || !out) return tally__fail(TALLY_EINVAL, "tally_store_value: NULL argument");
  int rc = by_name_begin(s, name, len);
  if (rc) return rc;
  char over[TALLY_NAME_MAX + 1];
  uint64_t hash = tally__hash(name, len, 0), rec_off = 0;
  for (int drops = 0;; drops++) {
    rc = find_or_create(s, &name, &len, &hash, NULL, 0, over, &rec_off, NULL);
    if (rc == 0) rc = tally__rec_value(s, rec_off, out);
    if (rc != TALLY_EDROPPED) return rc;
    if (drops == 8) /* dropped (or expired) under us: gone, unless made again */
      return tally__fail(TALLY_ENOENT, "no such counter '%.*s'", (int)len, name);
  }
}

/* ---- reading -------------------------------------------------------------- */

/* Read the cells of a counter, following it through moves: *loc is where
 * to start and receives where the values were read. vals may be NULL. */
static int read_cells(tally_store *s, uint64_t rec_off, uint64_t *loc, int64_t *vals,
                      uint32_t cap, __int128 *total) {
  for (;;) {
    __int128 sum = 0;
    bool live = true;
    for (uint32_t i = 0, n = tally__loc_shards(*loc); i < n; i++) {
      _Atomic int64_t *cell = tally__cell_at(s, *loc, i);
      /* acquire: a cpu counter's shard 0, set by a reset, before its
       * per-CPU cells (percpu.c) */
      int64_t v = atomic_load_explicit(cell, memory_order_acquire);
      if (__builtin_expect(!tally__cell_live(v), 0)) {
        int rc = tally__cell_wait(s, cell, rec_off, i, &v);
        if (rc) return rc;
        if (tally__cell_retired(v)) live = false;
      }
      sum += v;
      if (i < cap) vals[i] = v;
    }
    if (__builtin_expect(live, 1)) {
      *total = sum;
      return 0;
    }
    int rc = settle(s, rec_off, *loc, loc);
    if (rc) return rc;
  }
}

/* Current location of a record, validated. */
int tally__current(tally_store *s, uint64_t rec_off, uint64_t *loc) {
  struct tally__rec *r = tally__at(s, rec_off);
  uint64_t l = atomic_load_explicit(&r->loc, memory_order_acquire), cells;
  uint32_t n;
  bool dropped;
  int rc = tally__loc_decode(s, rec_off, l, &cells, &n, &dropped);
  if (rc) return rc;
  if (dropped) return tally__fail(TALLY_EDROPPED, "counter '%s' was dropped", r->name);
  *loc = l;
  return 0;
}

static int to_int64(__int128 total, const char *name, int64_t *out) {
  if (total > INT64_MAX || total < INT64_MIN)
    return tally__fail(TALLY_ERANGE,
                       "counter '%s': value does not fit in "
                       "64 bits",
                       name);
  *out = (int64_t)total;
  return 0;
}

int tally__rec_value(tally_store *s, uint64_t rec_off, int64_t *out) {
  uint64_t loc;
  __int128 total;
  int rc = tally__current(s, rec_off, &loc);
  if (rc == 0) rc = read_cells(s, rec_off, &loc, NULL, 0, &total);
  if (rc) return rc;
  return to_int64(total, ((struct tally__rec *)tally__at(s, rec_off))->name, out);
}

int tally__rec_cells(tally_store *s, uint64_t rec_off, int64_t *vals, uint32_t cap,
                     uint32_t *n, int64_t *value) {
  uint64_t loc;
  __int128 total;
  int rc = tally__current(s, rec_off, &loc);
  if (rc == 0) rc = read_cells(s, rec_off, &loc, vals, cap, &total);
  if (rc) return rc;
  *n = tally__loc_shards(loc);
  return to_int64(total, ((struct tally__rec *)tally__at(s, rec_off))->name, value);
}

int tally_counter_value(tally_counter *c, int64_t *out) {
  if (!c || !out) return tally__fail(TALLY_EINVAL, "tally_counter_value: NULL argument");
  if (atomic_load(&c->gone)) {
    int rc = tally__counter_live(c);
    if (rc == TALLY_ENOENT && atomic_load(&c->gone) == 2) { /* expired, not back */
      *out = 0;
      return 0;
    }
    if (rc) return rc;
  }
  uint64_t loc = atomic_load_explicit(&c->loc, memory_order_acquire);
  __int128 total;
  int rc = read_cells(c->s, tally__crec(c), &loc, NULL, 0, &total);
  if (rc) return rc;
  tally__handle_set_loc(c, loc);
  return to_int64(total, c->name, out);
}

int tally_counter_shards(tally_counter *c, int64_t *vals, uint32_t cap, uint32_t *n) {
  if (!c || !n || (!vals && cap))
    return tally__fail(TALLY_EINVAL, "tally_counter_shards: NULL argument");
  uint64_t loc;
  __int128 total;
  int rc = tally__counter_live(c);
  if (rc == 0) rc = tally__current(c->s, tally__crec(c), &loc);
  if (rc == 0) rc = read_cells(c->s, tally__crec(c), &loc, vals, cap, &total);
  if (rc) return rc;
  tally__handle_set_loc(c, loc);
  *n = tally__loc_shards(loc);
  return 0;
}

int tally_counter_info_get(tally_counter *c, tally_counter_info *out) {
  if (!c || !out)
    return tally__fail(TALLY_EINVAL, "tally_counter_info_get: NULL argument");
  uint64_t loc = 0;
  int rc = tally__counter_live(c); /* gone: its record may be another's now */
  if (rc == 0) rc = tally__current(c->s, tally__crec(c), &loc);
  if (rc == TALLY_EDROPPED && expired(c) && (rc = revive(c, false)) == 0)
    rc = tally__current(c->s, tally__crec(c), &loc);
  if (rc) return rc;
  out->name = c->name;
  out->name_len = c->name_len;
  out->shards = tally__loc_shards(loc);
  out->policy = c->policy;
  struct tally__rec *r = tally__at(c->s, tally__crec(c));
  uint32_t fl = atomic_load(&r->flags);
  out->incarnation = r->incarnation;
  out->auto_shards = (fl & TALLY__REC_AUTO) != 0;
  out->grown = fl >> TALLY__REC_GROWN_SHIFT & 0x3ff;
  out->shrunk = fl >> TALLY__REC_SHRUNK_SHIFT & 0x3ff;
  out->rseq = c->policy == TALLY_POLICY_CPU && TALLY__RSEQ && out->shards >= 3 &&
              tally__cpu_rseq_here();
  return 0;
}

int tally_counter_read(tally_counter *c, int64_t *value, uint64_t *incarnation) {
  if (!c || !value || !incarnation)
    return tally__fail(TALLY_EINVAL, "tally_counter_read: NULL argument");
  for (int round = 0;; round++) {
    int rc = tally__counter_live(c);
    if (rc == TALLY_ENOENT && atomic_load(&c->gone) == 2) break; /* expired */
    if (rc) return rc;
    uint64_t rec = tally__crec(c);
    uint64_t inc = ((struct tally__rec *)tally__at(c->s, rec))->incarnation;
    uint64_t loc = atomic_load_explicit(&c->loc, memory_order_acquire);
    __int128 total;
    rc = read_cells(c->s, rec, &loc, NULL, 0, &total);
    if (rc == TALLY_EDROPPED && round < 4 && expired(c)) { /* not marked gone yet */
      if ((rc = revive(c, false)) == TALLY_ENOENT) break;
      if (rc) return rc;
      continue;
    }
    if (rc) return rc;
    if (rec == tally__crec(c)) tally__handle_set_loc(c, loc);
    *incarnation = inc;
    return to_int64(total, c->name, value);
  }
  *value = 0; /* expired and not created again */
  *incarnation = 0;
  return 0;
}

/* ---- reset, reshard, drop ------------------------------------------------- */

/* Take every shard's value, one CAS each. If the total stops fitting in
 * int64, everything taken is added back (as if it were concurrent
 * increments) and nothing is removed. */
static void give_back(tally_store *s, uint64_t loc, const int64_t *taken, uint32_t upto) {
  for (uint32_t i = 0; i < upto; i++)
    if (taken[i]) atomic_fetch_add(tally__cell_at(s, loc, i), taken[i]);
}

int tally_counter_reset(tally_counter *c, int64_t *removed) {
  if (!c || !removed)
    return tally__fail(TALLY_EINVAL, "tally_counter_reset: NULL argument");
  int64_t total = 0, taken[TALLY_MAX_SHARDS];
  uint64_t loc = 0;
  int rc = tally__counter_live(c);
  if (rc == 0 && c->policy == TALLY_POLICY_SLOT) return tally__slot_reset(c, removed);
  if (rc == 0) rc = tally__current(c->s, tally__crec(c), &loc);
  if (rc == TALLY_EDROPPED && expired(c) && (rc = revive(c, false)) == 0)
    return tally_counter_reset(c, removed); /* made again meanwhile: that one */
  if (rc == TALLY_ENOENT && expired(c)) {   /* expired: reads as 0, stays gone */
    *removed = 0;
    return 0;
  }
  if (rc) return rc;
  if (c->policy == TALLY_POLICY_CPU) return tally__cpu_reset(c, removed);
  for (uint32_t i = 0; i < tally__loc_shards(loc); i++) {
    _Atomic int64_t *cell = tally__cell_at(c->s, loc, i);
    int64_t raw = atomic_load_explicit(cell, memory_order_relaxed);
    taken[i] = 0;
    rc = tally__cell_wait(c->s, cell, tally__crec(c), i, &raw);
    while (rc == 0 && !tally__cell_retired(raw)) {
      int64_t v = raw, sum;
      if (__builtin_add_overflow(total, v, &sum)) {
        give_back(c->s, loc, taken, i);
        return tally__fail(TALLY_ERANGE,
                           "counter '%s': the amount to remove "
                           "does not fit in 64 bits; nothing was removed",
                           c->name);
      }
      if (atomic_compare_exchange_weak_explicit(cell, &raw, 0, memory_order_relaxed,
                                                memory_order_relaxed)) {
        taken[i] = v;
        total = sum;
        break;
      }
      rc = tally__cell_wait(c->s, cell, tally__crec(c), i, &raw);
    }
    if (rc) { /* damaged: nothing is removed */
      give_back(c->s, loc, taken, i);
      return rc;
    }
    if (tally__cell_retired(raw)) {
      /* moved: what was taken is in total and did not move; the rest did */
      rc = settle(c->s, tally__crec(c), loc, &loc);
      if (rc) return rc;
      i = (uint32_t)-1; /* start over on the new cells */
    }
  }
  tally__handle_set_loc(c, loc);
  *removed = total;
  return 0;
}
