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
 * so reuse rarely splits or searches: churn creates the sizes it frees.
 * The exception is a large piece nothing asks for again, such as the
 * index tables a growing store outgrew: when an allocation finds no piece
 * of its size, one of at least CARVE_MIN bytes becomes the carve region,
 * and allocations of any size are cut from its front before the arena
 * grows (a million counters would otherwise leave 16 MiB of old tables
 * behind for good).
 *
 * Everything here runs under the store lock. Each step is one store of a
 * head or tail word, ordered so that a process killed between two steps
 * leaves at worst a leaked piece, never one handed out twice: a node
 * counts the items that reached the free lists, and the next lock holder
 * counts one more if the crash came between a push and that count.
 */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

#define ALIGNED   64u
#define BIG_WALK  64u          /* entries looked at in a bucket of large pieces */
#define CARVE_MIN (64u * 1024) /* the smallest piece worth carving */

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

/* Take the first piece of at least `min` bytes from the large pieces'
 * buckets (it stays counted in free_bytes: it becomes the carve region).
 * Only pieces smaller than the index table now: outgrown ones. A table of
 * its size is what a rebuild after drops wants again (churn swaps two). */
static int pop_large(tally_store *s, uint64_t min, uint64_t *off, uint64_t *bytes) {
  struct tally__header *h = s->hdr;
  uint64_t below = tally__index_bytes(s);
  *off = 0;
  if (atomic_load(&h->free_bytes) < min || below <= min) return 0;
  for (uint64_t b = 0; b < TALLY__PIECE_CLASSES; b++) {
    _Atomic uint64_t *link = &h->free_big[b];
    for (uint32_t i = 0; i < BIG_WALK; i++) {
      uint64_t got = 0, size = 0;
      int rc = piece_at(s, atomic_load_explicit(link, memory_order_acquire), LIST_BIG | b,
                        0, &got, &size);
      if (rc) return rc;
      if (!got) break;
      if (size >= min && size < below) {
        atomic_store_explicit(link, atomic_load(&words(s, got)[0]), memory_order_release);
        *off = got;
        *bytes = size;
        return 0;
      }
      link = &words(s, got)[0];
    }
  }
  return 0;
}

/* Cut `bytes` (aligned to align) from the carve region, taking a new one
 * when it runs short; *off 0 if there is none. Each step is one store, so
 * a crash leaks at worst the region's rest, never hands it out twice. */
static int carve(tally_store *s, uint64_t bytes, uint64_t align, uint64_t *off) {
  struct tally__header *h = s->hdr;
  *off = 0;
  for (int round = 0; round < 2; round++) {
    uint64_t cur = atomic_load(&h->carve_cur), end = atomic_load(&h->carve_end);
    uint64_t start = tally__round(cur, align);
    if (cur && start + bytes <= end) {
      atomic_store(&h->carve_cur, start + bytes < end ? start + bytes : 0);
      memset(tally__at(s, start), 0, bytes);
      uint64_t gone = start + bytes < end ? start + bytes - cur : end - cur;
      atomic_fetch_sub(&h->free_bytes, gone); /* the alignment gap is lost */
      atomic_fetch_add(&h->reused, bytes);
      *off = start;
      return 0;
    }
    if (round) break;
    uint64_t got = 0, size = 0;
    int rc = pop_large(s, CARVE_MIN > bytes ? CARVE_MIN : bytes + align, &got, &size);
    if (rc || !got) return rc;
    if (cur) atomic_fetch_sub(&h->free_bytes, end - cur); /* the rest is lost */
    atomic_store(&h->carve_cur, 0);
    atomic_store(&h->carve_end, got + size);
    atomic_store(&h->carve_cur, got);
  }
  return 0;
}

int tally__alloc_small(tally_store *s, uint64_t bytes, uint64_t *off) {
  bytes = tally__round(bytes ? bytes : 1, s->small);
  uint64_t units = bytes / s->small, id;
  if (units < TALLY__PIECE_CLASSES) {
    _Atomic uint64_t *head = list_of(s, TALLY__ITEM_SMALL, units, &id);
    int rc = pop(s, head, id, bytes, true, off);
    if (rc || *off) return rc;
  }
  int rc = carve(s, bytes, s->small, off);
  if (rc || *off) return rc;
  return tally__alloc_fresh(s, bytes, s->small, off);
}

int tally__alloc(tally_store *s, uint64_t bytes, uint64_t *off) {
  bytes = tally__round(bytes ? bytes : 1, ALIGNED);
  uint64_t units = bytes / ALIGNED, id;
  _Atomic uint64_t *head = list_of(s, TALLY__ITEM_ALIGNED, units, &id);
  int rc = pop(s, head, id, bytes, units < TALLY__PIECE_CLASSES, off);
  if (rc || *off) return rc;
  if ((rc = carve(s, bytes, ALIGNED, off)) || *off) return rc;
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
      if (item_kind(it) == TALLY__ITEM_COLUMN)
        rc = add_col(&sp, item_off(it));
      else if (item_kind(it) != TALLY__ITEM_REF)
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
