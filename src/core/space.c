/* space.c -- retired space: limbo, free lists, reuse.
 *
 * What a drop, a reshard, an index rebuild or a grown rollup block leaves
 * behind is retired, not freed: a process may still hold a handle to it or
 * be reading it. Retirement queues it in limbo (a list of nodes, oldest
 * first, each holding what was retired in one epoch; grace.c bumps the
 * epoch when it steps).
 * grace.c decides when every process has passed an epoch; then the ripe
 * nodes' pieces go to free lists, and allocation takes from those first.
 *
 * Three kinds of space: small pieces (records, limbo nodes; in units of
 * s->small: 8 bytes, 16 in stores before format 9),
 * aligned pieces (index tables, rollup blocks; 64-aligned) and columns of
 * cells (a counter's shards inside a chunk). Each has lists by exact size,
 * so reuse mostly neither splits nor searches: churn creates the sizes it
 * frees. When it does not (names of another length, counters of another
 * shard count), reuse still does not depend on what was freed:
 *  - a small allocation that finds no piece of its size splits the
 *    smallest larger one; the rest goes back to its list (8 bytes become a
 *    free one-shard column: any 8 bytes hold a one-shard counter's cell);
 *  - a large piece becomes the carve region: allocations of any size are
 *    cut from its front (what is left of an old region is filed again);
 *  - before the arena grows, while much is free, a coalesce sorts the free
 *    pieces and columns by offset and files adjacent ones again as one
 *    (a chunk whose columns are all free counts as one piece), large runs
 *    as aligned pieces the carve region takes. It looks at every free
 *    piece, so it runs again only after fresh allocations numbering an
 *    eighth of what it looked at: amortised, a few steps per allocation.
 *
 * Everything here runs under the store lock. Each step is one store of a
 * head or tail word, ordered so that a process killed between two steps
 * leaves at worst a leaked piece, never one handed out twice: a node
 * counts the items that reached the free lists, and the next lock holder
 * counts one more if the crash came between a push and that count. A
 * split takes its piece off its list before it files the rest; a coalesce
 * unlinks one run's pieces before it files the run (a crash between leaks
 * that run).
 */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

#define ALIGNED      64u
#define BIG_WALK     64u          /* entries looked at in a bucket of large pieces */
#define CARVE_MIN    4096u        /* the smallest piece worth carving */
#define BIG_MIN      4096u        /* a run filed as an aligned piece, at least */
#define COALESCE_MIN (16u * 1024) /* free bytes worth a coalesce */
#define COALESCE_MAX (UINT64_C(1) << 20) /* pieces one coalesce looks at */
#define COALESCE_PAY 4u                  /* fresh bytes that pay for a piece looked at */

/* A list's identity keys the seals of its words: a piece linked into
 * another list is caught. */
enum { LIST_SMALL = 0x100, LIST_ALIGNED = 0x200, LIST_BIG = 0x300 };

static int corrupt(tally_store *s, const char *what, uint64_t off) {
  return tally__fail(TALLY_ECORRUPT, "%s: tally store is corrupt (%s at offset %llu)",
                     tally__store_name(s), what, (unsigned long long)off);
}

static _Atomic uint64_t *words(tally_store *s, uint64_t off) {
  return tally__at(s, off);
}

/* ---- free lists of pieces ----------------------------------------------- */

static _Atomic uint64_t *list_of(tally_store *s, int kind, uint64_t units, uint64_t *id) {
  struct tally__header *h = s->hdr;
  if (kind == TALLY__ITEM_SMALL) {
    *id = LIST_SMALL | units;
    return &h->free_small[units];
  }
  if (units < TALLY__PIECE_CLASSES) {
    *id = LIST_ALIGNED | units;
    return &h->free_aligned[units];
  }
  uint64_t b = tally__mix(units) % TALLY__PIECE_CLASSES;
  *id = LIST_BIG | b;
  return &h->free_big[b];
}

/* A piece's words: [0] the next piece of its list (sealed as a head),
 * [1] its size in bytes. */
static void push(tally_store *s, _Atomic uint64_t *head, uint64_t id, uint64_t off,
                 uint64_t bytes) {
  _Atomic uint64_t *p = words(s, off);
  atomic_store_explicit(&p[0], atomic_load_explicit(head, memory_order_relaxed),
                        memory_order_relaxed);
  atomic_store_explicit(&p[1], bytes, memory_order_relaxed);
  atomic_store_explicit(head, tally__seal(s, TALLY__SEAL_FREE, off, id),
                        memory_order_release);
  atomic_fetch_add(&s->hdr->free_bytes, bytes);
}

/* The piece a list word names, checked: in the arena, its size as the
 * list says (want, or any multiple of 64 from 4 KiB for big lists). */
static int piece_at(tally_store *s, uint64_t word, uint64_t id, uint64_t want,
                    uint64_t *off, uint64_t *bytes) {
  int rc = tally__unseal(s, TALLY__SEAL_FREE, word, id, off);
  if (rc) return rc;
  if (!*off) return 0;
  uint64_t align = (id & 0xf00) == LIST_SMALL ? s->small : ALIGNED;
  if (*off % align || !tally__in_arena(s, *off, 16))
    return corrupt(s, "free piece", *off);
  *bytes = atomic_load_explicit(&words(s, *off)[1], memory_order_relaxed);
  if ((want ? *bytes != want : *bytes % ALIGNED != 0) || *bytes < 16 ||
      !tally__in_arena(s, *off, *bytes))
    return corrupt(s, "free piece size", *off);
  return 0;
}

static void take(tally_store *s, uint64_t off, uint64_t bytes) {
  memset(tally__at(s, off), 0, bytes);
  atomic_fetch_sub(&s->hdr->free_bytes, bytes);
  atomic_fetch_add(&s->hdr->reused, bytes);
}

/* ---- filing free space, splitting, coalescing --------------------------- */

static void column_push(tally_store *s, uint64_t off, uint32_t n);
static int column_at(tally_store *s, uint64_t word, uint32_t n, uint64_t *off);

/* A piece or free column a coalesce gathered: where it is, the word that
 * names it (a list head, or the piece before it), what free_bytes counts
 * for it, and its shard count if it is a column (0: a piece). */
struct member {
  uint64_t off, end;
  _Atomic uint64_t *link;
  uint64_t bytes;
  uint32_t shards;
};

struct gather {
  struct member *m;
  size_t n, cap;
};

static int by_member(const void *a, const void *b) {
  const struct member *x = a, *y = b;
  return x->off < y->off ? -1 : x->off > y->off;
}

static struct member *member_at(struct gather *g, uint64_t off) {
  struct member key = {.off = off};
  return g && g->n ? bsearch(&key, g->m, g->n, sizeof key, by_member) : NULL;
}

/* A piece is about to be pushed at head: the gathered member now on top
 * will be named by the new piece's word, not by head. */
static void relink(tally_store *s, struct gather *g, _Atomic uint64_t *head,
                   uint64_t off) {
  uint64_t w = atomic_load_explicit(head, memory_order_relaxed);
  struct member *m = w ? member_at(g, (w >> 32) << 3) : NULL;
  if (m && m->link == head) m->link = &words(s, off)[0];
}

/* File [a, b) (free, on no list, 8-aligned) as small pieces of up to
 * PIECE_CLASSES - 1 units; 8 bytes that make no piece (a piece holds two
 * words) become a free one-shard column, which any 8 bytes can be. */
static void file_small(tally_store *s, struct gather *g, uint64_t a, uint64_t b) {
  uint64_t max = (TALLY__PIECE_CLASSES - 1) * (uint64_t)s->small, id;
  while (a < b) {
    uint64_t n = (b - a) / s->small * s->small;
    if (a % s->small || n < 16) {
      relink(s, g, &s->classes[0].free, a);
      column_push(s, a, 1);
      a += 8;
      continue;
    }
    if (n > max) n = max;
    _Atomic uint64_t *head = list_of(s, TALLY__ITEM_SMALL, n / s->small, &id);
    relink(s, g, head, a);
    push(s, head, id, a, n);
    a += n;
  }
}

/* File [a, b) (free, on no list, 8-aligned): its 64-aligned middle as one
 * aligned piece if that is BIG_MIN or more (the carve region takes it for
 * any size), the rest as small pieces. */
static void file_run(tally_store *s, struct gather *g, uint64_t a, uint64_t b) {
  uint64_t lo = tally__round(a, ALIGNED), hi = b & ~(uint64_t)(ALIGNED - 1), id;
  if (hi <= lo || hi - lo < BIG_MIN) {
    file_small(s, g, a, b);
    return;
  }
  file_small(s, g, a, lo);
  _Atomic uint64_t *head = list_of(s, TALLY__ITEM_ALIGNED, (hi - lo) / ALIGNED, &id);
  relink(s, g, head, lo);
  push(s, head, id, lo, hi - lo);
  file_small(s, g, hi, b);
}

/* Pop a piece of exactly `bytes` from the list at head; *off 0 if none. */
static int pop(tally_store *s, _Atomic uint64_t *head, uint64_t id, uint64_t bytes,
               bool exact_class, uint64_t *off) {
  uint64_t got = 0, size = 0;
  *off = 0;
  if (exact_class) {
    int rc = piece_at(s, atomic_load_explicit(head, memory_order_acquire), id, bytes,
                      &got, &size);
    if (rc || !got) return rc;
    uint64_t next = atomic_load_explicit(&words(s, got)[0], memory_order_relaxed), n;
    if ((rc = piece_at(s, next, id, bytes, &n, &size))) return rc;
    atomic_store_explicit(head, next, memory_order_release);
    take(s, got, bytes);
    *off = got;
    return 0;
  }
  /* a bucket of large pieces: the first of exactly this size */
  _Atomic uint64_t *link = head;
  for (uint32_t i = 0; i < BIG_WALK; i++) {
    int rc =
        piece_at(s, atomic_load_explicit(link, memory_order_acquire), id, 0, &got, &size);
    if (rc || !got) return rc;
    if (size == bytes) {
      atomic_store_explicit(link, atomic_load(&words(s, got)[0]), memory_order_release);
      take(s, got, bytes);
      *off = got;
      return 0;
    }
    link = &words(s, got)[0];
  }
  return 0;
}

/* Take the smallest piece of at least `min` bytes from the large pieces'
 * buckets (it stays counted in free_bytes: it becomes the carve region),
 * so the large runs a coalesce made are kept for what needs them (an
 * index table). Not one of the index table's size: a rebuild after drops
 * wants that again (churn swaps two). */
static int pop_large(tally_store *s, uint64_t min, uint64_t *off, uint64_t *bytes) {
  struct tally__header *h = s->hdr;
  uint64_t table = tally__index_bytes(s);
  _Atomic uint64_t *best = NULL;
  *off = 0;
  *bytes = 0;
  if (atomic_load(&h->free_bytes) < min) return 0;
  for (uint64_t b = 0; b < TALLY__PIECE_CLASSES; b++) {
    _Atomic uint64_t *link = &h->free_big[b];
    for (uint32_t i = 0; i < BIG_WALK; i++) {
      uint64_t got = 0, size = 0;
      int rc = piece_at(s, atomic_load_explicit(link, memory_order_acquire), LIST_BIG | b,
                        0, &got, &size);
      if (rc) return rc;
      if (!got) break;
      if (size >= min && size != table && (!best || size < *bytes)) {
        best = link;
        *off = got;
        *bytes = size;
      }
      link = &words(s, got)[0];
    }
  }
  if (best)
    atomic_store_explicit(best, atomic_load(&words(s, *off)[0]), memory_order_release);
  return 0;
}

/* Cut `bytes` (aligned to align) from the carve region, taking a new one
 * when it runs short; *off 0 if there is none. Each step is one store, so
 * a crash leaks at worst the region's rest, never hands it out twice; the
 * alignment gap and an old region's rest are filed again after it. */
static int carve(tally_store *s, uint64_t bytes, uint64_t align, uint64_t *off) {
  struct tally__header *h = s->hdr;
  *off = 0;
  for (int round = 0; round < 2; round++) {
    uint64_t cur = atomic_load(&h->carve_cur), end = atomic_load(&h->carve_end);
    uint64_t start = tally__round(cur, align);
    if (cur && start + bytes <= end) {
      uint64_t next = start + bytes < end ? start + bytes : 0;
      atomic_store(&h->carve_cur, next);
      memset(tally__at(s, start), 0, bytes);
      atomic_fetch_sub(&h->free_bytes, (next ? next : end) - cur);
      atomic_fetch_add(&h->reused, bytes);
      file_small(s, NULL, cur, start);
      *off = start;
      return 0;
    }
    if (round) break;
    uint64_t got = 0, size = 0;
    int rc = pop_large(s, CARVE_MIN > bytes ? CARVE_MIN : bytes + align, &got, &size);
    if (rc || !got) return rc;
    if (cur) {
      atomic_store(&h->carve_cur, 0);
      atomic_fetch_sub(&h->free_bytes, end - cur);
      file_run(s, NULL, cur, end);
    }
    atomic_store(&h->carve_end, got + size);
    atomic_store(&h->carve_cur, got);
  }
  return 0;
}

/* `bytes` cut from the smallest larger small piece; the rest is filed
 * again (after the piece left its list: a crash leaks the rest). */
static int split_small(tally_store *s, uint64_t bytes, uint64_t *off) {
  uint64_t id;
  *off = 0;
  for (uint64_t u = bytes / s->small + 1; u < TALLY__PIECE_CLASSES; u++) {
    _Atomic uint64_t *head = list_of(s, TALLY__ITEM_SMALL, u, &id);
    if (!atomic_load_explicit(head, memory_order_relaxed)) continue;
    int rc = pop(s, head, id, u * s->small, true, off);
    if (rc || !*off) return rc;
    atomic_fetch_sub(&s->hdr->reused, u * s->small - bytes);
    file_small(s, NULL, *off + bytes, *off + u * s->small);
    return 0;
  }
  return 0;
}

/* Gather the list at head (pieces of `want` bytes, any if 0; shards > 0:
 * free columns of that many shards). */
static int gather_list(tally_store *s, struct gather *g, _Atomic uint64_t *head,
                       uint64_t id, uint64_t want, uint32_t shards) {
  _Atomic uint64_t *link = head;
  for (uint64_t k = 0; g->n < COALESCE_MAX; k++) {
    uint64_t off = 0, bytes = 8;
    int rc = k > TALLY__MAX_BYTES / 16 ? corrupt(s, "free list loop", 0) : 0;
    if (rc == 0)
      rc = shards ? column_at(s, atomic_load(link), shards, &off)
                  : piece_at(s, atomic_load(link), id, want, &off, &bytes);
    if (rc || !off) return rc;
    if (g->n == g->cap) {
      size_t cap = g->cap ? g->cap * 2 : 1024;
      struct member *m = realloc(g->m, cap * sizeof *m);
      if (!m) return tally__fail(TALLY_ENOMEM, "out of memory");
      g->m = m;
      g->cap = cap;
    }
    g->m[g->n++] = (struct member){off, off + bytes, link,
                                   shards ? (uint64_t)shards * 8 : bytes, shards};
    link = &words(s, off)[0];
  }
  return 0;
}

/* Take a gathered member off its list: one store; the next one is named
 * by the word that named it. */
static void unlink_member(tally_store *s, struct gather *g, struct member *m) {
  uint64_t w = atomic_load_explicit(&words(s, m->off)[0], memory_order_relaxed);
  atomic_store_explicit(m->link, w, memory_order_release);
  struct member *next = w ? member_at(g, (w >> 32) << 3) : NULL;
  if (next) next->link = m->link;
  atomic_fetch_sub(&s->hdr->free_bytes, m->bytes);
}

/* A run of space a coalesce may file as one: members [first, first + n)
 * of the gather; keep: a column of a chunk not all free (stays listed). */
struct run {
  uint64_t off, end;
  size_t first, n;
  bool keep;
};

/* Sort every free piece and column by offset and file each run of
 * adjacent ones again as one (file_run). A chunk of n > 1 shards whose
 * ROW_CELLS columns are all free is one run of n rows. Reads and checks
 * everything before it changes anything: a damaged list gives ECORRUPT
 * with the lists as they were. *looked: the members gathered. */
static int coalesce(tally_store *s, uint64_t *looked) {
  struct tally__header *h = s->hdr;
  struct gather g = {0};
  struct run *r = NULL;
  size_t nr = 0;
  uint64_t id, table = tally__index_bytes(s);
  int rc = 0;
  *looked = 0;
  uint64_t cur = atomic_load(&h->carve_cur), end = atomic_load(&h->carve_end);
  if (cur && cur < end && tally__in_arena(s, cur, end - cur)) { /* file it too */
    atomic_store(&h->carve_cur, 0);
    atomic_fetch_sub(&h->free_bytes, end - cur);
    file_run(s, NULL, cur, end);
  }
  for (uint64_t u = 1; rc == 0 && u < TALLY__PIECE_CLASSES; u++) {
    _Atomic uint64_t *head = list_of(s, TALLY__ITEM_SMALL, u, &id);
    rc = gather_list(s, &g, head, id, u * s->small, 0);
    head = list_of(s, TALLY__ITEM_ALIGNED, u, &id);
    if (rc == 0) rc = gather_list(s, &g, head, id, u * ALIGNED, 0);
  }
  for (uint64_t b = 0; rc == 0 && b < TALLY__PIECE_CLASSES; b++)
    rc = gather_list(s, &g, &h->free_big[b], LIST_BIG | b, 0, 0);
  for (uint32_t n = 1; rc == 0 && n <= TALLY_MAX_SHARDS; n++)
    rc = gather_list(s, &g, &s->classes[n - 1].free, 0, 0, n);
  *looked = g.n;
  if (rc == 0 && g.n > 1) qsort(g.m, g.n, sizeof *g.m, by_member);
  if (rc == 0 && g.n && !(r = malloc(g.n * sizeof *r)))
    rc = tally__fail(TALLY_ENOMEM, "out of memory");
  for (size_t i = 0; rc == 0 && i < g.n;) {
    struct member *m = &g.m[i];
    size_t n = 1;
    if (m->shards > 1) { /* a whole chunk, or a column that stays */
      while (n < TALLY__ROW_CELLS && i + n < g.n && g.m[i + n].shards == m->shards &&
             g.m[i + n].off == m->off + n * 8)
        n++;
      if (n < TALLY__ROW_CELLS) n = 1;
    }
    uint64_t rend = n > 1 ? m->off + (uint64_t)m->shards * TALLY__ROW_BYTES : m->end;
    bool keep = m->shards > 1 ? n == 1 : !m->shards && m->end - m->off == table;
    r[nr++] = (struct run){m->off, rend, i, n, keep};
    if (nr > 1 && r[nr - 1].off < r[nr - 2].end)
      rc = corrupt(s, "piece free twice", m->off);
    i += n;
  }
  /* each stretch of adjacent runs, one at a time: unlinked, then filed */
  for (size_t i = 0; rc == 0 && i < nr;) {
    size_t j = i + 1;
    if (!r[i].keep)
      while (j < nr && !r[j].keep && r[j].off == r[j - 1].end) j++;
    if (!r[i].keep && (j - i > 1 || r[i].n > 1)) {
      for (size_t k = i; k < j; k++)
        for (size_t x = 0; x < r[k].n; x++) unlink_member(s, &g, &g.m[r[k].first + x]);
      file_run(s, &g, r[i].off, r[j - 1].end);
    }
    i = j;
  }
  free(r);
  free(g.m);
  return rc;
}

/* The arena is about to grow by `bytes`: coalesce first if much is free
 * and what the last coalesce looked at has been paid for by fresh
 * allocations since. *ran: look at the lists again. */
static int coalesce_due(tally_store *s, uint64_t bytes, bool *ran) {
  uint64_t free_bytes = atomic_load(&s->hdr->free_bytes), looked;
  *ran = false;
  if (s->coalesce_wait > bytes) {
    s->coalesce_wait -= bytes;
    return 0;
  }
  if (free_bytes < COALESCE_MIN || free_bytes < bytes) return 0;
  int rc = coalesce(s, &looked);
  s->coalesce_wait = looked * COALESCE_PAY;
  *ran = rc == 0;
  return rc;
}

int tally__alloc_small(tally_store *s, uint64_t bytes, uint64_t *off) {
  bytes = tally__round(bytes ? bytes : 1, s->small);
  uint64_t units = bytes / s->small, id;
  for (int round = 0;; round++) {
    int rc = 0;
    bool ran = false;
    if (units < TALLY__PIECE_CLASSES) {
      _Atomic uint64_t *head = list_of(s, TALLY__ITEM_SMALL, units, &id);
      if ((rc = pop(s, head, id, bytes, true, off)) || *off) return rc;
      if ((rc = split_small(s, bytes, off)) || *off) return rc;
    }
    if ((rc = carve(s, bytes, s->small, off)) || *off) return rc;
    if (round || (rc = coalesce_due(s, bytes, &ran)) || !ran) {
      if (rc) return rc;
      break;
    }
  }
  return tally__alloc_fresh(s, bytes, s->small, off);
}

int tally__alloc(tally_store *s, uint64_t bytes, uint64_t *off) {
  bytes = tally__round(bytes ? bytes : 1, ALIGNED);
  uint64_t units = bytes / ALIGNED, id;
  _Atomic uint64_t *head = list_of(s, TALLY__ITEM_ALIGNED, units, &id);
  for (int round = 0;; round++) {
    int rc;
    bool ran = false;
    if ((rc = pop(s, head, id, bytes, units < TALLY__PIECE_CLASSES, off)) || *off)
      return rc;
    if ((rc = carve(s, bytes, ALIGNED, off)) || *off) return rc;
    if (round || (rc = coalesce_due(s, bytes, &ran)) || !ran) {
      if (rc) return rc;
      break;
    }
  }
  return tally__alloc_fresh(s, bytes, ALIGNED, off);
}

/* ---- free columns of cells ---------------------------------------------- */

/* A free column keeps the next one's sealed word in its shard 0 cell; its
 * other cells are 0. */
static void column_push(tally_store *s, uint64_t off, uint32_t n) {
  _Atomic uint64_t *head = &s->classes[n - 1].free;
  for (uint32_t i = 1; i < n; i++)
    atomic_store_explicit(words(s, off + (uint64_t)i * TALLY__ROW_BYTES), 0,
                          memory_order_relaxed);
  atomic_store_explicit(words(s, off), atomic_load_explicit(head, memory_order_relaxed),
                        memory_order_relaxed);
  atomic_store_explicit(head, tally__seal(s, TALLY__SEAL_COLUMN, off, n),
                        memory_order_release);
  atomic_fetch_add(&s->hdr->free_bytes, (uint64_t)n * 8);
}

static int column_at(tally_store *s, uint64_t word, uint32_t n, uint64_t *off) {
  int rc = tally__unseal(s, TALLY__SEAL_COLUMN, word, n, off);
  if (rc == 0 && *off &&
      (*off % 8 || !tally__in_arena(s, *off, (uint64_t)(n - 1) * TALLY__ROW_BYTES + 8)))
    rc = corrupt(s, "free column", *off);
  return rc;
}

int tally__column_pop(tally_store *s, uint32_t n, uint64_t *off) {
  _Atomic uint64_t *head = &s->classes[n - 1].free;
  uint64_t next_off;
  int rc = column_at(s, atomic_load_explicit(head, memory_order_acquire), n, off);
  if (rc || !*off) return rc;
  uint64_t next = atomic_load_explicit(words(s, *off), memory_order_relaxed);
  if ((rc = column_at(s, next, n, &next_off))) return rc;
  atomic_store_explicit(head, next, memory_order_release);
  atomic_store_explicit(words(s, *off), 0, memory_order_relaxed);
  atomic_fetch_sub(&s->hdr->free_bytes, (uint64_t)n * 8);
  atomic_fetch_add(&s->hdr->reused, (uint64_t)n * 8);
  return 0;
}

/* ---- limbo -------------------------------------------------------------- */

static uint64_t item_off(uint64_t it) {
  return (it & 0xffffffffu) << 3;
}
static int item_kind(uint64_t it) {
  return (int)((it >> 32) & 3);
}
static uint64_t item_size(uint64_t it) {
  return it >> 34;
}
static uint64_t item_bytes(const tally_store *s, uint64_t it) {
  uint64_t z = item_size(it);
  switch (item_kind(it)) {
  case TALLY__ITEM_SMALL: return z * s->small;
  case TALLY__ITEM_ALIGNED: return z * ALIGNED;
  case TALLY__ITEM_COLUMN: return z * 8;
  default: return 0;
  }
}

static bool item_ok(tally_store *s, uint64_t it) {
  uint64_t off = item_off(it), z = item_size(it);
  switch (item_kind(it)) {
  case TALLY__ITEM_SMALL: /* records and limbo nodes: a list per size */
    return off % s->small == 0 && z >= 1 && z < TALLY__PIECE_CLASSES &&
           tally__in_arena(s, off, z * s->small);
  case TALLY__ITEM_ALIGNED:
    return off % ALIGNED == 0 && z >= 1 && tally__in_arena(s, off, z * ALIGNED);
  case TALLY__ITEM_COLUMN:
    return z >= 1 && z <= TALLY_MAX_SHARDS &&
           tally__in_arena(s, off, (z - 1) * TALLY__ROW_BYTES + 8);
  default: return z == 0 && off % 8 == 0 && tally__in_arena(s, off, 8);
  }
}

/* The node a limbo word names, checked; NULL (error set) if damaged. */
static struct tally__limbo *node_at(tally_store *s, uint64_t word, int *rc) {
  uint64_t off;
  *rc = tally__unseal(s, TALLY__SEAL_LIMBO, word, 0, &off);
  if (*rc || !off) return NULL;
  struct tally__limbo *l = tally__at(s, off);
  if (off % s->small || !tally__in_arena(s, off, sizeof *l) ||
      l->n > TALLY__LIMBO_ITEMS || l->done > l->n) {
    *rc = corrupt(s, "limbo node", off);
    return NULL;
  }
  for (uint32_t i = 0; i < l->n; i++)
    if (!item_ok(s, l->item[i])) {
      *rc = corrupt(s, "limbo item", off);
      return NULL;
    }
  return l;
}

static bool on_top(tally_store *s, uint64_t it) {
  uint64_t off = item_off(it), top = 0, id;
  if (item_kind(it) == TALLY__ITEM_REF) return true; /* nothing to push */
  if (item_kind(it) == TALLY__ITEM_COLUMN) {
    uint32_t n = (uint32_t)item_size(it);
    return column_at(s, atomic_load(&s->classes[n - 1].free), n, &top) == 0 && top == off;
  }
  _Atomic uint64_t *head = list_of(s, item_kind(it), item_size(it), &id);
  return tally__unseal(s, TALLY__SEAL_FREE, atomic_load(head), id, &top) == 0 &&
         top == off;
}

static void free_item(tally_store *s, uint64_t it) {
  if (item_kind(it) == TALLY__ITEM_REF) return;
  if (item_kind(it) == TALLY__ITEM_COLUMN) {
    column_push(s, item_off(it), (uint32_t)item_size(it));
    return;
  }
  uint64_t id;
  _Atomic uint64_t *head = list_of(s, item_kind(it), item_size(it), &id);
  push(s, head, id, item_off(it), item_bytes(s, it));
}

void tally__free_now(tally_store *s, uint64_t item) {
  free_item(s, item);
}

/* A holder that died in the middle of the list's two-word updates leaves
 * a head without tail or a tail with a successor; a reclaim that died
 * between pushing an item and counting it leaves that item on top of its
 * list. Set both right. */
void tally__limbo_repair(tally_store *s) {
  struct tally__header *h = s->hdr;
  int rc;
  uint64_t head = atomic_load(&h->limbo_head), tail = atomic_load(&h->limbo_tail);
  if (!head && tail) atomic_store(&h->limbo_tail, 0);
  if (head) {
    uint64_t from = tail ? tail : head, last = from;
    struct tally__limbo *l = node_at(s, from, &rc);
    for (uint64_t n = 0; l && l->next && n < TALLY__MAX_BYTES / 64; n++) {
      last = l->next;
      l = node_at(s, last, &rc);
    }
    if (l && last != tail) atomic_store(&h->limbo_tail, last);
    struct tally__limbo *first = node_at(s, head, &rc);
    if (first && first->done < first->n && on_top(s, first->item[first->done]))
      first->done++;
  }
}

/* The newest limbo node if it is of the current epoch and has room for n
 * more items, else a new empty one linked after it. An empty newest node
 * (its move was refused: a reshard that would overflow, an expiry that
 * lost its race) is taken at the current epoch, so refusals never pile up
 * nodes. */
static int room(tally_store *s, uint32_t n, struct tally__limbo **out) {
  struct tally__header *h = s->hdr;
  int rc = 0;
  uint64_t tail = atomic_load(&h->limbo_tail), epoch = atomic_load(&h->epoch);
  struct tally__limbo *t = tail ? node_at(s, tail, &rc) : NULL;
  if (rc) return rc;
  if (t && t->n == 0) t->epoch = epoch; /* made for a move that was refused */
  if (t && t->epoch == epoch && t->n + n <= TALLY__LIMBO_ITEMS) {
    *out = t;
    return 0;
  }
  uint64_t off;
  if ((rc = tally__alloc_small(s, sizeof(struct tally__limbo), &off))) return rc;
  struct tally__limbo *l = tally__at(s, off);
  l->epoch = epoch;
  l->at_ms = tally_monotonic_ms();
  uint64_t word = tally__seal(s, TALLY__SEAL_LIMBO, off, 0);
  if (t)
    t->next = word;
  else
    atomic_store(&h->limbo_head, word);
  atomic_store(&h->limbo_tail, word);
  *out = l;
  return 0;
}

int tally__retire_room(tally_store *s, uint32_t n) {
  struct tally__limbo *t;
  return room(s, n, &t);
}

int tally__retire(tally_store *s, uint64_t ident, const uint64_t *items, uint32_t n) {
  struct tally__header *h = s->hdr;
  int rc = 0;
  uint64_t tail = atomic_load(&h->limbo_tail), bytes = 0;
  struct tally__limbo *t = tail ? node_at(s, tail, &rc) : NULL;
  if (rc) return rc;
  if (ident && t && t->last_ident == ident) return 0; /* queued before a crash */
  if ((rc = room(s, n, &t))) return rc;
  for (uint32_t i = 0; i < n; i++) bytes += item_bytes(s, items[i]);
  /* the items first, then the count that makes them part of the node */
  for (uint32_t i = 0; i < n; i++) t->item[t->n + i] = items[i];
  t->last_ident = ident;
  t->at_ms = tally_monotonic_ms();
  t->n += n;
  atomic_fetch_add(&h->retired, bytes);
  return 0;
}

/* The epoch limbo retired before may be reused. grace_ms counts from the
 * step that first found every process past an epoch, not from the
 * retirement: a thread of a process that passed it only now may be
 * between loading an old location and its add. Each process notes when
 * its steps saw min_seen rise, one note per grace_ms / TALLY__PASSED
 * taken as of its latest rise (so reuse comes at most that much late). */
static uint64_t ripe_epoch(tally_store *s, uint64_t min_seen, int64_t now_ms) {
  if (s->grace_ms <= 0) return min_seen;
  struct tally__passed *q = s->passed;
  uint32_t n = s->passed_n, k = 0;
  while (k < n && now_ms - q[k].at_ms >= s->grace_ms) s->ripe_epoch = q[k++].epoch;
  memmove(q, q + k, (n - k) * sizeof *q);
  n -= k;
  if (min_seen > (n ? q[n - 1].epoch : s->ripe_epoch)) {
    if (!n || (now_ms - q[n - 1].from_ms >= s->grace_ms / TALLY__PASSED &&
               n < TALLY__PASSED + 4))
      q[n++].from_ms = now_ms;
    q[n - 1].epoch = min_seen;
    q[n - 1].at_ms = now_ms;
  }
  s->passed_n = n;
  return s->ripe_epoch < min_seen ? s->ripe_epoch : min_seen;
}

void tally__reclaim(tally_store *s, uint64_t min_seen, int64_t now_ms) {
  struct tally__header *h = s->hdr;
  int rc;
  uint64_t ripe = ripe_epoch(s, min_seen, now_ms);
  for (;;) {
    uint64_t head = atomic_load(&h->limbo_head), node_off;
    struct tally__limbo *l = head ? node_at(s, head, &rc) : NULL;
    if (!l) return; /* empty, or damaged: check() reports it */
    if (l->epoch >= ripe) return;
    uint64_t bytes = 0;
    for (uint32_t i = 0; i < l->n; i++) bytes += item_bytes(s, l->item[i]);
    while (l->done < l->n) {
      free_item(s, l->item[l->done]);
      l->done++;
    }
    if (!l->next) {
      atomic_store(&h->limbo_tail, 0);
      atomic_store(&h->limbo_head, 0);
    } else {
      atomic_store(&h->limbo_head, l->next);
    }
    uint64_t r = atomic_load(&h->retired);
    atomic_store(&h->retired, r >= bytes ? r - bytes : 0);
    (void)tally__unseal(s, TALLY__SEAL_LIMBO, head, 0, &node_off);
    uint64_t id;
    uint64_t nb = tally__round(sizeof *l, s->small);
    _Atomic uint64_t *list = list_of(s, TALLY__ITEM_SMALL, nb / s->small, &id);
    push(s, list, id, node_off, nb);
  }
}

int tally__limbo_each(tally_store *s, uint64_t from, tally__limbo_fn fn, void *ud) {
  int rc = 0;
  uint64_t w = atomic_load(&s->hdr->limbo_head);
  for (uint64_t n = 0; w && n < TALLY__MAX_BYTES / 64; n++) {
    struct tally__limbo *l = node_at(s, w, &rc);
    if (!l) return rc;
    if (l->epoch >= from) fn(s, l, ud);
    w = l->next;
  }
  return rc;
}

/* At open, O(1): every list head and limbo's ends name sound places. */
int tally__space_open_check(tally_store *s) {
  struct tally__header *h = s->hdr;
  uint64_t off, bytes, id;
  int rc = 0;
  for (uint64_t u = 1; rc == 0 && u < TALLY__PIECE_CLASSES; u++) {
    _Atomic uint64_t *list = list_of(s, TALLY__ITEM_SMALL, u, &id);
    rc = piece_at(s, atomic_load(list), id, u * s->small, &off, &bytes);
    list = list_of(s, TALLY__ITEM_ALIGNED, u, &id);
    if (rc == 0) rc = piece_at(s, atomic_load(list), id, u * ALIGNED, &off, &bytes);
    if (rc == 0)
      rc = piece_at(s, atomic_load(&h->free_big[u]), LIST_BIG | u, 0, &off, &bytes);
  }
  if (rc == 0) rc = piece_at(s, atomic_load(&h->free_big[0]), LIST_BIG, 0, &off, &bytes);
  for (uint32_t n = 1; rc == 0 && n <= TALLY_MAX_SHARDS; n++)
    rc = column_at(s, atomic_load(&s->classes[n - 1].free), n, &off);
  if (rc == 0 && atomic_load(&h->limbo_head))
    node_at(s, atomic_load(&h->limbo_head), &rc);
  if (rc == 0 && atomic_load(&h->limbo_tail))
    node_at(s, atomic_load(&h->limbo_tail), &rc);
  if (rc == 0 && atomic_load(&h->epoch) > (UINT64_C(1) << 62))
    rc = corrupt(s, "epoch", 0);
  uint64_t cur = atomic_load(&h->carve_cur), end = atomic_load(&h->carve_end);
  if (rc == 0 && cur &&
      (cur % s->small || cur >= end || !tally__in_arena(s, cur, end - cur)))
    rc = corrupt(s, "carve region", cur);
  return rc;
}

/* ---- check: every list well formed, nothing free or in limbo twice, and
 * nothing free or in limbo that a live counter uses ----------------------- */

struct span {
  uint64_t off, end;
};

struct spans {
  struct span *v;
  size_t n, cap;
  uint64_t *cols; /* shard-0 cell offsets of free and retired columns */
  size_t ncols, capcols;
};

static int add_span(struct spans *sp, uint64_t off, uint64_t bytes) {
  if (sp->n == sp->cap) {
    size_t cap = sp->cap ? sp->cap * 2 : 256;
    struct span *v = realloc(sp->v, cap * sizeof *v);
    if (!v) return tally__fail(TALLY_ENOMEM, "out of memory");
    sp->v = v;
    sp->cap = cap;
  }
  sp->v[sp->n++] = (struct span){off, off + bytes};
  return 0;
}

static int add_col(struct spans *sp, uint64_t off) {
  if (sp->ncols == sp->capcols) {
    size_t cap = sp->capcols ? sp->capcols * 2 : 256;
    uint64_t *v = realloc(sp->cols, cap * sizeof *v);
    if (!v) return tally__fail(TALLY_ENOMEM, "out of memory");
    sp->cols = v;
    sp->capcols = cap;
  }
  sp->cols[sp->ncols++] = off;
  return 0;
}

static int walk_list(tally_store *s, _Atomic uint64_t *head, uint64_t id, uint64_t want,
                     struct spans *sp, uint64_t *sum) {
  uint64_t w = atomic_load(head), off = 0, bytes = 0;
  for (uint64_t n = 0; w; n++) {
    if (n > TALLY__MAX_BYTES / 16) return corrupt(s, "free list loop", 0);
    int rc = piece_at(s, w, id, want, &off, &bytes);
    if (rc) return rc;
    if ((rc = add_span(sp, off, bytes))) return rc;
    *sum += bytes;
    w = atomic_load(&words(s, off)[0]);
  }
  return 0;
}

static int by_off(const void *a, const void *b) {
  const struct span *x = a, *y = b;
  return x->off < y->off ? -1 : x->off > y->off;
}
static int by_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

static bool in_spans(const struct spans *sp, uint64_t off, uint64_t bytes) {
  size_t lo = 0, hi = sp->n; /* first span ending after off */
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (sp->v[mid].end <= off)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo < sp->n && sp->v[lo].off < off + bytes;
}

static bool in_cols(const struct spans *sp, uint64_t off) {
  return sp->ncols &&
         bsearch(&off, sp->cols, sp->ncols, sizeof *sp->cols, by_u64) != NULL;
}

static int live_one(tally_store *s, uint64_t rec_off, void *ud) {
  const struct spans *sp = ud;
  const struct tally__rec *r = tally__at(s, rec_off);
  uint64_t loc = atomic_load(&r->loc);
  uint64_t cells = (loc >> 32) << 3;
  struct tally__block *b = NULL;
  if (in_spans(sp, rec_off, tally__rec_bytes(r->name_len)) || in_cols(sp, cells) ||
      in_spans(sp, cells, 8))
    return tally__fail(TALLY_ECORRUPT,
                       "%s: tally store is corrupt (counter '%s' uses "
                       "space that is free or retired)",
                       tally__store_name(s), r->name);
  if (tally__block_of(s, rec_off, &b) == 0 && b &&
      in_spans(sp, (uint64_t)((unsigned char *)b - s->base), sizeof *b))
    return tally__fail(TALLY_ECORRUPT,
                       "%s: tally store is corrupt (the rollup "
                       "block of counter '%s' is free or retired)",
                       tally__store_name(s), r->name);
  return 0;
}

int tally__space_check(tally_store *s) {
  struct tally__header *h = s->hdr;
  struct spans sp = {0};
  uint64_t sum = 0, id;
  int rc = 0;
  for (uint64_t u = 1; rc == 0 && u < TALLY__PIECE_CLASSES; u++) {
    _Atomic uint64_t *list = list_of(s, TALLY__ITEM_SMALL, u, &id);
    rc = walk_list(s, list, id, u * s->small, &sp, &sum);
    list = list_of(s, TALLY__ITEM_ALIGNED, u, &id);
    if (rc == 0) rc = walk_list(s, list, id, u * ALIGNED, &sp, &sum);
  }
  for (uint64_t b = 0; rc == 0 && b < TALLY__PIECE_CLASSES; b++)
    rc = walk_list(s, &h->free_big[b], LIST_BIG | b, 0, &sp, &sum);
  for (uint32_t n = 1; rc == 0 && n <= TALLY_MAX_SHARDS; n++) {
    uint64_t w = atomic_load(&s->classes[n - 1].free), off;
    for (uint64_t k = 0; rc == 0 && w; k++) {
      if (k > TALLY__MAX_BYTES / 8) rc = corrupt(s, "free column loop", 0);
      if (rc == 0) rc = column_at(s, w, n, &off);
      for (uint32_t i = 1; rc == 0 && i < n; i++)
        if (atomic_load(words(s, off + (uint64_t)i * TALLY__ROW_BYTES)))
          rc = corrupt(s, "free column not empty", off);
      if (rc == 0) rc = add_col(&sp, off);
      /* its first cell is space too: a one-shard column may be any 8
       * bytes, so one inside a free piece is space free twice */
      if (rc == 0) rc = add_span(&sp, off, 8);
      sum += (uint64_t)n * 8;
      w = rc ? 0 : atomic_load(words(s, off));
    }
  }
  uint64_t w = atomic_load(&h->limbo_head);
  for (uint64_t k = 0; rc == 0 && w; k++) {
    struct tally__limbo *l = node_at(s, w, &rc);
    if (!l) break;
    if (k > TALLY__MAX_BYTES / 64) rc = corrupt(s, "limbo loop", 0);
    for (uint32_t i = l->done; rc == 0 && i < l->n; i++) {
      uint64_t it = l->item[i];
      if (item_kind(it) == TALLY__ITEM_COLUMN) {
        rc = add_col(&sp, item_off(it));
        if (rc == 0) rc = add_span(&sp, item_off(it), 8);
      } else if (item_kind(it) != TALLY__ITEM_REF)
        rc = add_span(&sp, item_off(it), item_bytes(s, it));
    }
    w = l->next;
  }
  uint64_t cur = atomic_load(&h->carve_cur), end = atomic_load(&h->carve_end);
  if (rc == 0 && cur) { /* the carve region is free space too */
    if (cur % s->small || cur >= end || !tally__in_arena(s, cur, end - cur))
      rc = corrupt(s, "carve region", cur);
    if (rc == 0) rc = add_span(&sp, cur, end - cur);
    sum += end - cur;
  }
  /* the byte count is a statistic: a holder killed between a list's
   * update and the count's leaves it off; set it right */
  if (rc == 0) atomic_store(&h->free_bytes, sum);
  if (rc == 0) {
    if (sp.n > 1) qsort(sp.v, sp.n, sizeof *sp.v, by_off); /* NULL when empty */
    if (sp.ncols > 1) qsort(sp.cols, sp.ncols, sizeof *sp.cols, by_u64);
    for (size_t i = 1; rc == 0 && i < sp.n; i++)
      if (sp.v[i].off < sp.v[i - 1].end) rc = corrupt(s, "piece free twice", sp.v[i].off);
    for (size_t i = 1; rc == 0 && i < sp.ncols; i++)
      if (sp.cols[i] == sp.cols[i - 1]) rc = corrupt(s, "column free twice", sp.cols[i]);
  }
  if (rc == 0) rc = tally__index_each(s, live_one, &sp);
  free(sp.v);
  free(sp.cols);
  return rc;
}
