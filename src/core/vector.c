/* vector.c -- counters addressed by index: the fast path for many of them.
 *
 * A random increment through a handle on a cold counter costs two
 * dependent misses: the handle, then its cell. A vector keeps, per slot,
 * the cell offset of the counter in one dense array of 32-bit words, so an
 * increment reads four bytes of that array and then adds to the cell: the
 * pattern of a plain array of atomics, with a word per counter instead of
 * a cell. The handles stay beside it for everything else (the slow path,
 * reads, moves).
 *
 * A slot word is 0 (take the handle's path), or the offset in words of
 * the counter's first cell, below 2^30 (8 GiB), and two flags:
 *  - ROWS: a thread-policy counter of `rows` shards. The increment adds
 *    to the row of the caller's ticket, as the handle's would. Writers on
 *    different rows touch different lines, so with a shard per writer the
 *    cells never bounce between cores, where an array's do. A vector
 *    learns `rows` from the first such counter it caches.
 *  - AUTO: automatic shards. One add in 256 samples for contention
 *    through the handle; other counters never read it on this path.
 * Counters of other shard counts or policies (one-shard random ones
 * aside), and cells past 8 GiB, keep slot 0: their increments are the
 * handle's.
 *
 * Dense slots. Counters created in slot order take consecutive columns of
 * their chunks, so slot i's cells are at a base per group of ROW_CELLS
 * slots (a chunk's columns) plus 8 * ((i + phase) % ROW_CELLS), where
 * phase lines the groups up with the chunks: the first slot cached reads
 * its column from its class's chunk being filled (0 if its cells are
 * elsewhere, as in a store reopened).
 * Such a slot also sets its bit in a bitmap, and an increment there reads
 * the bit and its group's base instead of the slot word: 140 KiB for a
 * million slots, which stay in cache, where the slot words take 4 MiB.
 * One miss, on the cell, as the array of atomics. A group's base and
 * flags are those of the first slot cached in it; a slot whose cells or
 * flags differ keeps its bit clear and takes the slot word.
 *
 * Whoever changes a handle's loc makes the vector forget it
 * (tally__handle_set_loc): bit and slot word are cleared, and cache()
 * stores them and then checks loc again, clearing them if loc moved
 * meanwhile. The grace step points handles away from retired cells, so
 * their vectors forget them before it publishes its epoch: a slot never
 * outlives the cells it names. A cell retired by a move is met
 * on the fast path as the handle's path meets it (its add does not count)
 * and the increment goes through the handle.
 *
 * Stamps. Even the dense path reads two words before the cell, and where
 * the caller found the slot through a table of names (LuaJIT's db:incr)
 * those reads wait on that table's miss: 100 ns and more in nginx. A
 * stamp is the cell itself, for the caller to keep in place of the slot:
 * its word offset, the AUTO flag, and the generation of its region (512
 * KiB of the store) + 1. Every slot word cleared or replaced bumps the
 * generation of the region it named, before the grace step can publish
 * its epoch, so a stamp held past its counter's move or its slot's
 * emptying no longer matches by the time the cell can be reused; until
 * then the old cell is retired, and an add there does not count, as on
 * the slot's path. An increment through a stamp reads the region's
 * generation (a few lines for a whole store: in cache) and adds.
 */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

struct tally_vector {
  /* what an increment reads: the first line */
  unsigned char *base;     /* the store's mapping (fixed for its life) */
  _Atomic uint64_t *dense; /* per slot: a bit, set if the slot is dense */
  _Atomic uint64_t *gbase; /* per group: base | 4 | kind, 0: none yet */
  _Atomic uint32_t *cell;  /* per slot: see above */
  size_t n;
  _Atomic uint32_t rows;  /* shard count of the rows slots name, 0: none yet */
  _Atomic uint32_t phase; /* added to a slot for its group, PHASE_UNSET */
  uint64_t store_id;      /* s->id, for the ticket check */
  _Atomic uint64_t *rgen; /* per region of the store: its generation */
  /* the rest, past the first line */
  tally_counter **c; /* per slot: the handle, or NULL */
  tally_store *s;
};

#define GROUP        TALLY__ROW_CELLS /* slots per dense group: a chunk's columns */
#define ROWS_BIT     (UINT32_C(1) << 31)
#define AUTO_BIT     (UINT32_C(1) << 30)
#define OFF_MASK     (AUTO_BIT - 1)
/* an increment's kind, from a slot word's flags (w >> 30) or a group base */
#define KIND_ROWS    2u
#define KIND_AUTO    1u
#define PHASE_UNSET  UINT32_MAX
#define BIT(i)       (UINT64_C(1) << ((i) % 64))
/* stamps: a region is 2^16 words (512 KiB) of the first 8 GiB: few enough
 * that their generations stay in cache, small enough that a move makes few
 * stamps stale */
#define REGION_SHIFT 16
#define REGIONS      (((size_t)OFF_MASK + 1) >> REGION_SHIFT)
#define GEN_SHIFT    31                        /* a stamp's generation + 1 */
#define GEN_LIMIT    ((UINT64_C(1) << 22) - 1) /* from here on, no stamps */
#define GEN_FROZEN   ((UINT64_C(1) << 33) - 1) /* matches no 64-bit stamp */

/* The per-slot arrays of a vector of n slots. */
struct arrays {
  _Atomic uint64_t *dense, *gbase;
  _Atomic uint32_t *cell;
  tally_counter **c;
};

static void arrays_free(struct arrays a) {
  free(a.dense);
  free(a.gbase);
  free(a.cell);
  free(a.c);
}

/* Zeroed arrays for n slots, or ENOMEM (none kept). */
static int arrays_new(size_t n, struct arrays *a) {
  a->dense = calloc(n / 64 + 1, sizeof *a->dense);
  a->gbase = calloc(n / GROUP + 2, sizeof *a->gbase); /* i + phase < n + GROUP */
  a->cell = calloc(n, sizeof *a->cell);
  a->c = calloc(n, sizeof *a->c);
  if (a->dense && a->gbase && a->cell && a->c) return 0;
  arrays_free(*a);
  return tally__fail(TALLY_ENOMEM, "out of memory (a vector of %zu slots)", n);
}

int tally_vector_new(tally_store *s, size_t n, tally_vector **out) {
  if (!s || !out) return tally__fail(TALLY_EINVAL, "tally_vector_new: NULL argument");
  if (n == 0 || n > SIZE_MAX / sizeof(tally_counter *))
    return tally__fail(TALLY_EINVAL, "tally_vector_new: %zu slots (1 or more)", n);
  struct arrays a;
  int rc = arrays_new(n, &a);
  if (rc) return rc;
  tally_vector *v = aligned_alloc(64, (sizeof *v + 63) & ~(size_t)63);
  _Atomic uint64_t *rgen = malloc(REGIONS * sizeof *rgen); /* 128 KiB */
  if (!v || !rgen) {
    free(v);
    free(rgen);
    arrays_free(a);
    return tally__fail(TALLY_ENOMEM, "out of memory");
  }
  /* each region's generations start at a random point below 2^21: a
   * stamp of another vector, or a small value that is no stamp, does not
   * match (but 1 in 2^21 by chance), and a region has 2^21 bumps at least */
  uint64_t x =
      tally__mix(s->id ^ (uint64_t)tally_monotonic_ns() ^ (uint64_t)(uintptr_t)v);
  for (size_t r = 0; r < REGIONS; r++) {
    x = tally__mix(x + r);
    atomic_init(&rgen[r], 1 + x % ((UINT64_C(1) << 21) - 1));
  }
  v->rgen = rgen;
  v->base = s->base;
  v->n = n;
  atomic_init(&v->rows, 0);
  atomic_init(&v->phase, PHASE_UNSET);
  v->store_id = s->id;
  v->s = s;
  v->dense = a.dense;
  v->gbase = a.gbase;
  v->cell = a.cell;
  v->c = a.c;
  *out = v;
  return 0;
}

/* The slot word for a handle at loc, or 0: one shard under the thread or
 * random policy, or `rows` shards under the thread policy. */
static uint32_t slot_word(tally_vector *v, const tally_counter *c, uint64_t loc) {
  uint64_t off = loc >> 32;
  uint32_t n = tally__loc_shards(loc), rows = 0;
  uint32_t w = (uint32_t)off | (c->fast & 2 ? AUTO_BIT : 0);
  if (c->fast >= 4 || atomic_load(&c->gone) || (loc & TALLY__LOC_DROPPED) ||
      off > OFF_MASK)
    return 0;
  if (n == 1) return w;
  if (c->fast & 1) return 0; /* random over several shards: the handle's */
  if (!atomic_compare_exchange_strong(&v->rows, &rows, n) && rows != n) return 0;
  return w | ROWS_BIT;
}

/* Set slot i's dense bit if its group's base (claimed here if it has none)
 * and kind give its cells, else clear it. Offsets are multiples of 8, so
 * the base's low bits hold 4 (set) and the kind; the arithmetic wraps as
 * the increment's does. */
static void dense_mark(tally_vector *v, size_t i, uint32_t w, uint32_t nshards) {
  uint64_t off = (uint64_t)(w & OFF_MASK) << 3;
  uint32_t p = atomic_load(&v->phase);
  if (p == PHASE_UNSET) { /* the first slot cached: line the groups up */
    int64_t col = tally__cells_column(v->s, nshards, off);
    uint32_t want_p =
        col < 0 ? 0 : (uint32_t)((col + GROUP - (int64_t)(i % GROUP)) % GROUP);
    if (atomic_compare_exchange_strong(&v->phase, &p, want_p)) p = want_p;
  }
  size_t j = i + p, g = j / GROUP;
  uint64_t want = (off - (uint64_t)(j - g * GROUP) * 8) | 4 | (w >> 30);
  uint64_t b = 0;
  if (atomic_compare_exchange_strong(&v->gbase[g], &b, want) || b == want)
    atomic_fetch_or(&v->dense[i / 64], BIT(i));
  else
    atomic_fetch_and(&v->dense[i / 64], ~BIT(i));
}

/* Slot word w (0: none) is no longer a slot's: stamps of its region are
 * stale from now on. */
static void region_bump(tally_vector *v, uint32_t w) {
  if (!w) return;
  _Atomic uint64_t *gen = &v->rgen[(w & OFF_MASK) >> REGION_SHIFT];
  uint64_t was = atomic_load(gen);
  /* at GEN_LIMIT a region makes no more stamps, and freezes where no
   * value's bits 31..63 can match */
  while (!atomic_compare_exchange_weak(gen, &was,
                                       was + 1 < GEN_LIMIT ? was + 1 : GEN_FROZEN)) {}
}

void tally__vector_forget(tally_vector *v, size_t i) {
  atomic_fetch_and(&v->dense[i / 64], ~BIT(i));
  region_bump(v, atomic_exchange(&v->cell[i], 0));
}

/* Slot i caches c's cell(s) if an increment there is a plain add. */
static void cache(tally_vector *v, size_t i) {
  tally_counter *c = v->c[i];
  uint64_t loc = atomic_load(&c->loc);
  uint32_t w = slot_word(v, c, loc);
  if (!w) { /* a counter the slot cannot name comes here on every increment */
    if (atomic_load_explicit(&v->cell[i], memory_order_relaxed))
      tally__vector_forget(v, i);
    return;
  }
  uint32_t was = atomic_exchange(&v->cell[i], w);
  if (was != w) region_bump(v, was);
  dense_mark(v, i, w, tally__loc_shards(loc));
  if (atomic_load(&c->loc) != loc) {              /* moved meanwhile: its mover may */
    atomic_fetch_and(&v->dense[i / 64], ~BIT(i)); /* have cleared */
    if (atomic_compare_exchange_strong(&v->cell[i], &w, 0)) region_bump(v, w); /* first */
  }
}

/* Detach slot i's handle from the vector (the grace step reads vec under
 * hlock) and return it. */
static tally_counter *detach(tally_vector *v, size_t i) {
  tally_counter *c = v->c[i];
  if (!c) return NULL;
  if (c->s) pthread_mutex_lock(&c->s->hlock);
  atomic_store(&c->vec, NULL);
  if (c->s) pthread_mutex_unlock(&c->s->hlock);
  tally__vector_forget(v, i);
  v->c[i] = NULL;
  return c;
}

int tally_vector_put(tally_vector *v, size_t i, tally_counter *c) {
  if (!v) return tally__fail(TALLY_EINVAL, "tally_vector_put: vector is NULL");
  if (i >= v->n)
    return tally__fail(TALLY_EINVAL,
                       "tally_vector_put: slot %zu out of range (%zu slots)", i, v->n);
  if (c && c->s != v->s)
    return tally__fail(TALLY_EINVAL,
                       "tally_vector_put: counter '%s' is not of the vector's store",
                       c->name);
  if (c && atomic_load(&c->vec))
    return tally__fail(TALLY_EINVAL,
                       "tally_vector_put: counter '%s' is in a vector already", c->name);
  tally_counter_close(detach(v, i));
  if (!c) return 0;
  pthread_mutex_lock(&c->s->hlock);
  c->vslot = i;
  atomic_store(&c->vec, v);
  pthread_mutex_unlock(&c->s->hlock);
  v->c[i] = c;
  cache(v, i);
  return 0;
}

int tally_vector_open(tally_vector *v, size_t i, const char *name, size_t len,
                      const tally_counter_options *opt, uint32_t flags) {
  if (!v) return tally__fail(TALLY_EINVAL, "tally_vector_open: vector is NULL");
  if (i >= v->n)
    return tally__fail(TALLY_EINVAL,
                       "tally_vector_open: slot %zu out of range (%zu slots)", i, v->n);
  tally_counter *c;
  int rc = tally_counter_open(v->s, name, len, opt, flags, &c);
  if (rc == 0) rc = tally_vector_put(v, i, c);
  return rc;
}

tally_counter *tally_vector_take(tally_vector *v, size_t i) {
  return v && i < v->n ? detach(v, i) : NULL;
}

/* New arrays, filled from the old ones under hlock: the grace step clears
 * bits and words under it (tally__vector_forget), and must neither write
 * freed arrays nor be lost in the copy. */
int tally_vector_grow(tally_vector *v, size_t n) {
  if (!v) return tally__fail(TALLY_EINVAL, "tally_vector_grow: vector is NULL");
  if (n < v->n || n > SIZE_MAX / sizeof(tally_counter *))
    return tally__fail(TALLY_EINVAL, "tally_vector_grow: %zu slots (at least %zu)", n,
                       v->n);
  if (n == v->n) return 0;
  struct arrays a;
  int rc = arrays_new(n, &a);
  if (rc) return rc;
  pthread_mutex_lock(&v->s->hlock);
  for (size_t i = 0; i < v->n / 64 + 1; i++)
    atomic_init(&a.dense[i], atomic_load_explicit(&v->dense[i], memory_order_relaxed));
  for (size_t g = 0; g < v->n / GROUP + 2; g++)
    atomic_init(&a.gbase[g], atomic_load_explicit(&v->gbase[g], memory_order_relaxed));
  for (size_t i = 0; i < v->n; i++)
    atomic_init(&a.cell[i], atomic_load_explicit(&v->cell[i], memory_order_relaxed));
  memcpy(a.c, v->c, v->n * sizeof *a.c);
  struct arrays old = {v->dense, v->gbase, v->cell, v->c};
  v->dense = a.dense;
  v->gbase = a.gbase;
  v->cell = a.cell;
  v->c = a.c;
  v->n = n;
  pthread_mutex_unlock(&v->s->hlock);
  arrays_free(old);
  return 0;
}

tally_counter *tally_vector_get(const tally_vector *v, size_t i) {
  return v && i < v->n ? v->c[i] : NULL;
}

int tally_vector_fast(const tally_vector *v, size_t i) {
  if (!v || i >= v->n || !atomic_load_explicit(&v->cell[i], memory_order_relaxed))
    return 0;
  return atomic_load_explicit(&v->dense[i / 64], memory_order_relaxed) & BIT(i) ? 2 : 1;
}

size_t tally_vector_size(const tally_vector *v) {
  return v ? v->n : 0;
}

void tally_vector_free(tally_vector *v) {
  if (!v) return;
  for (size_t i = 0; i < v->n; i++) tally_counter_close(detach(v, i));
  arrays_free((struct arrays){v->dense, v->gbase, v->cell, v->c});
  free(v->rgen);
  free(v);
}

/* Everything but a plain add: through the handle, then cache again. */
__attribute__((noinline)) static int incr_slow(tally_vector *v, size_t i, int64_t delta) {
  if (!v) return tally__fail(TALLY_EINVAL, "tally_vector_incr: vector is NULL");
  if (i >= v->n)
    return tally__fail(TALLY_EINVAL,
                       "tally_vector_incr: slot %zu out of range (%zu slots)", i, v->n);
  tally_counter *c = v->c[i];
  if (!c) return tally__fail(TALLY_ENOENT, "tally_vector_incr: slot %zu is empty", i);
  if (!c->s) return tally__fail(TALLY_EINVAL, "tally_vector_incr: its store is closed");
  int rc = tally_counter_incr(c, delta);
  cache(v, i);
  return rc;
}

/* One in 256 adds (tally__sample_due): an automatic counter
 * samples for contention as its handle's increment would. */
__attribute__((noinline)) static int sampled(tally_vector *v, size_t i) {
  tally_counter *c = v->c[i];
  if (!(c->fast & 2)) return 0; /* the flag came from another counter */
  int rc = tally__auto_sample(c, atomic_load_explicit(&c->loc, memory_order_acquire));
  cache(v, i);
  return rc;
}

/* The cell slot i's increment adds to (for a thread-policy counter of
 * several shards, the row of the caller's ticket), and its kind (KIND_*);
 * NULL: the handle's path. i < v->n. */
static inline _Atomic int64_t *fast_cell(tally_vector *v, size_t i, uint32_t *kind) {
  uint64_t off;
  uint32_t k;
  /* acquire, as the handle's loc: it orders the cell after its move */
  if (__builtin_expect(
          (atomic_load_explicit(&v->dense[i / 64], memory_order_acquire) & BIT(i)) != 0,
          1)) {
    /* phase and base were set before the bit, and are fixed since */
    size_t j = i + atomic_load_explicit(&v->phase, memory_order_relaxed), g = j / GROUP;
    uint64_t b = atomic_load_explicit(&v->gbase[g], memory_order_relaxed);
    off = (b & ~UINT64_C(7)) + (uint64_t)(j - g * GROUP) * 8;
    k = (uint32_t)b & 3;
  } else {
    uint32_t w = atomic_load_explicit(&v->cell[i], memory_order_acquire);
    if (__builtin_expect(w == 0, 0)) return NULL;
    off = (uint64_t)(w & OFF_MASK) << 3;
    k = w >> 30;
  }
  if (k & KIND_ROWS) { /* the caller's row, as the handle's path picks it */
    if (__builtin_expect(tally__me.store_id != v->store_id, 0)) return NULL;
    off += (uint64_t)tally__reduce(tally__me.ticket,
                                   atomic_load_explicit(&v->rows, memory_order_relaxed)) *
           TALLY__ROW_BYTES;
  }
  *kind = k;
  return (_Atomic int64_t *)(v->base + off);
}

/* tally_vector_incr, inlined into tally_vector_incr_many's loop too. */
static inline __attribute__((always_inline)) int incr_one(tally_vector *v, size_t i,
                                                          int64_t delta) {
  if (__builtin_expect(
          v && i < v->n && delta > -TALLY__FAST_DELTA && delta < TALLY__FAST_DELTA, 1)) {
    uint32_t kind;
    _Atomic int64_t *cell = fast_cell(v, i, &kind);
    if (__builtin_expect(cell == NULL, 0)) return incr_slow(v, i, delta);
    int64_t old = atomic_fetch_add_explicit(cell, delta, memory_order_relaxed);
    if (__builtin_expect(tally__cell_live(old) && tally__cell_live(old + delta), 1)) {
      if (__builtin_expect((kind & KIND_AUTO) && tally__sample_due(old, cell), 0))
        return sampled(v, i);
      return 0;
    }
    if (!tally__cell_retired(old)) /* out of range: undo; retired: see internal.h */
      atomic_fetch_sub_explicit(cell, delta, memory_order_relaxed);
  }
  return incr_slow(v, i, delta);
}

int tally_vector_incr(tally_vector *v, size_t i, int64_t delta) {
  return incr_one(v, i, delta);
}

/* A locked add waits for its line, and the next add cannot start before
 * it ends: with the adds of a batch known, the lines of the adds AHEAD
 * further on are asked for now, for writing (x86's prefetchw; elsewhere
 * the compiler's prefetch), so that their misses overlap. 8 measured best
 * of 8 and 16 on the 2-core VM (docs/benchmarks.md). */
#define AHEAD 8
static inline void prefetch_for_write(const void *p) {
#if defined(__x86_64__) /* every x86-64 CPU takes it (a NOP where unknown) */
  __asm__ volatile("prefetchw %0" : : "m"(*(const char *)p));
#else
  __builtin_prefetch(p, 1, 3);
#endif
}

/* Ask for the cell an add to slot i would take, if it takes the fast path. */
static inline void prefetch_slot(tally_vector *v, size_t i) {
  uint32_t kind;
  const void *cell = i < v->n ? fast_cell(v, i, &kind) : NULL;
  if (cell) prefetch_for_write(cell);
}

int tally_vector_incr_many(tally_vector *v, const size_t *slots, const int64_t *deltas,
                           size_t n, size_t *done) {
  size_t k = 0;
  int rc = 0;
  if (!v || (n && !slots)) {
    rc = tally__fail(TALLY_EINVAL, "tally_vector_incr_many: NULL argument");
  } else {
    for (size_t a = 0; a < AHEAD && a < n; a++)
      prefetch_slot(v, slots[a]); /* the first ones, before any add */
    for (; k < n; k++) {
      if (k + AHEAD < n) prefetch_slot(v, slots[k + AHEAD]);
      rc = incr_one(v, slots[k], deltas ? deltas[k] : 1);
      if (__builtin_expect(rc != 0, 0)) break;
    }
  }
  if (done) *done = k;
  return rc;
}

/* ---- stamps ---------------------------------------------------------------- */

int64_t tally_vector_stamp(tally_vector *v, const tally_counter *c) {
  if (!v || !c || atomic_load(&c->vec) != v) return 0;
  size_t i = c->vslot;
  if (i >= v->n || v->c[i] != c) return 0;
  uint32_t w = atomic_load(&v->cell[i]);
  if (!w) { /* forgotten since: cache it again, as its next increment would */
    cache(v, i);
    w = atomic_load(&v->cell[i]);
  }
  if (!w || (w & ROWS_BIT)) return 0; /* several shards: the row is the caller's */
  uint64_t off = w & OFF_MASK, g = atomic_load(&v->rgen[off >> REGION_SHIFT]);
  /* the generation read before the word is read again: a word cleared
   * after that read bumps it after, so the stamp is stale by then */
  if (g >= GEN_LIMIT || atomic_load(&v->cell[i]) != w) return 0;
  return (int64_t)((g + 1) << GEN_SHIFT | (w & AUTO_BIT) | off);
}

int tally_vector_stamp_incr(tally_vector *v, int64_t stamp, int64_t delta) {
  uint64_t e = (uint64_t)stamp, off = e & OFF_MASK;
  /* few tests before the add: each one it waits on costs (measured: 30
   * ns a call in a LuaJIT loop over a million names) */
  if (__builtin_expect(!v || (uint64_t)delta + (uint64_t)TALLY__FAST_DELTA >=
                                 2 * (uint64_t)TALLY__FAST_DELTA,
                       0))
    return -1;
  /* acquire: the add after it, as the slot word's load orders it. A
   * match means e < 2^53 (a generation is below GEN_LIMIT, or frozen) */
  uint64_t gen =
      atomic_load_explicit(&v->rgen[off >> REGION_SHIFT], memory_order_acquire);
  if (__builtin_expect(e >> GEN_SHIFT != gen + 1, 0)) return -1; /* stale */
  _Atomic int64_t *cell = (_Atomic int64_t *)(v->base + (off << 3));
  int64_t old = atomic_fetch_add_explicit(cell, delta, memory_order_relaxed);
  if (__builtin_expect(tally__cell_live(old) && tally__cell_live(old + delta), 1))
    return (e & AUTO_BIT) && tally__sample_due(old, cell) ? 1 : 0;
  if (!tally__cell_retired(old)) /* out of range: undo; retired: see internal.h */
    atomic_fetch_sub_explicit(cell, delta, memory_order_relaxed);
  return -1;
}

int tally_counter_sample(tally_counter *c) {
  if (!c || !c->s) return tally__fail(TALLY_EINVAL, "tally_counter_sample: no counter");
  if (!(c->fast & 2)) return 0;
  return tally__auto_sample(c, atomic_load_explicit(&c->loc, memory_order_acquire));
}
