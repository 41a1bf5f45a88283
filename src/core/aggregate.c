/* aggregate.c -- questions about many counters: names, values, sums,
 * counts, the top k.
 *
 * All of them walk the name index once and read each record in place, with
 * no handle per counter. A counter created during the walk may or may not
 * be seen; one dropped during it is skipped once its drop is published.
 */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

struct walk {
  const char *pattern;
  size_t plen;
  tally_name_fn fn;
  tally_value_fn value_fn;
  void *ud;
  __int128 sum;
  uint64_t count;
};

/* 1: a live counter matching the pattern; 0: not; < 0: a damaged record. */
static int live_match(tally_store *s, uint64_t rec_off, struct walk *w) {
  const struct tally__rec *r = tally__at(s, rec_off);
  uint64_t cells;
  uint32_t n;
  bool dropped;
  int rc =
      tally__loc_decode(s, rec_off, atomic_load_explicit(&r->loc, memory_order_acquire),
                        &cells, &n, &dropped);
  if (rc) return rc;
  return !dropped && tally_glob_match(w->pattern, w->plen, r->name, r->name_len);
}

static int name_one(tally_store *s, uint64_t rec_off, void *ud) {
  struct walk *w = ud;
  int m = live_match(s, rec_off, w);
  if (m <= 0) return m;
  const struct tally__rec *r = tally__at(s, rec_off);
  return w->fn(w->ud, r->name, r->name_len);
}

/* 1 and *v: a live counter matching the pattern, and its value; 0: not
 * one (or dropped meanwhile); < 0: an error (TALLY_ERANGE: beyond int64). */
static int value_of(tally_store *s, uint64_t rec_off, struct walk *w, int64_t *v) {
  int m = live_match(s, rec_off, w);
  if (m <= 0) return m;
  int rc = tally__rec_value(s, rec_off, v);
  return rc == TALLY_EDROPPED ? 0 : rc ? rc : 1;
}

static int sum_one(tally_store *s, uint64_t rec_off, void *ud) {
  struct walk *w = ud;
  int64_t v;
  int m = value_of(s, rec_off, w, &v);
  if (m <= 0) return m;
  w->sum += v;
  w->count++;
  return 0;
}

static int value_one(tally_store *s, uint64_t rec_off, void *ud) {
  struct walk *w = ud;
  int64_t v;
  int m = value_of(s, rec_off, w, &v);
  if (m == TALLY_ERANGE) return 0; /* left out: see tally.h */
  if (m <= 0) return m;
  const struct tally__rec *r = tally__at(s, rec_off);
  return w->value_fn(w->ud, r->name, r->name_len, v);
}

static void pattern_or_all(struct walk *w, const char *pattern, size_t plen) {
  w->pattern = pattern && plen ? pattern : "*";
  w->plen = pattern && plen ? plen : 1;
}

int tally_store_each(tally_store *s, const char *pattern, size_t plen, tally_name_fn fn,
                     void *ud) {
  if (!s || !fn) return tally__fail(TALLY_EINVAL, "tally_store_each: NULL argument");
  struct walk w = {.fn = fn, .ud = ud};
  pattern_or_all(&w, pattern, plen);
  return tally__index_each(s, name_one, &w);
}

int tally_store_values(tally_store *s, const char *pattern, size_t plen,
                       tally_value_fn fn, void *ud) {
  if (!s || !fn) return tally__fail(TALLY_EINVAL, "tally_store_values: NULL argument");
  struct walk w = {.value_fn = fn, .ud = ud};
  pattern_or_all(&w, pattern, plen);
  return tally__index_each_value(s, value_one, &w);
}

int tally_store_sum(tally_store *s, const char *pattern, size_t plen, int64_t *sum,
                    uint64_t *count) {
  if (!s || !sum) return tally__fail(TALLY_EINVAL, "tally_store_sum: NULL argument");
  struct walk w = {0};
  pattern_or_all(&w, pattern, plen);
  int rc = tally__index_each_value(s, sum_one, &w);
  if (rc) return rc;
  if (w.sum > INT64_MAX || w.sum < INT64_MIN)
    return tally__fail(TALLY_ERANGE, "sum over '%.*s' does not fit in 64 bits",
                       (int)w.plen, w.pattern);
  *sum = (int64_t)w.sum;
  if (count) *count = w.count;
  return 0;
}

/* ---- rows: what a listing shows of each counter ------------------------- */

struct rows {
  struct walk w;
  unsigned flags;
  tally_row_fn fn;
  void *ud;
  struct tally__name_key *recs; /* BY_NAME: the matching records, then sorted */
  size_t n, cap;
};

/* Hand rec_off over as a row; 0 also when it was dropped meanwhile. */
static int row_one(tally_store *s, uint64_t rec_off, struct rows *w) {
  const struct tally__rec *r = tally__at(s, rec_off);
  tally_row row = {.name = r->name,
                   .name_len = r->name_len,
                   .policy = r->policy,
                   .incarnation = r->incarnation};
  if (w->flags & TALLY_ROWS_NAMES) return w->fn(w->ud, &row);
  tally_rollup roll;
  int64_t cells[TALLY_MAX_SHARDS];
  uint64_t loc;
  int rc = tally__current(s, rec_off, &loc);
  if (rc == 0 && (w->flags & TALLY_ROWS_CELLS)) { /* the cells and their sum, */
    rc = tally__rec_cells(s, rec_off, cells, TALLY_MAX_SHARDS, &row.shards,
                          &row.value); /* read together (after a move too) */
    row.cells = cells;
  } else if (rc == 0) {
    rc = tally__rec_value(s, rec_off, &row.value);
    row.shards = tally__loc_shards(loc);
  }
  if (rc == TALLY_EDROPPED) return 0;
  if (rc == TALLY_ERANGE)
    row.value_rc = rc;
  else if (rc)
    return rc;
  uint32_t fl = atomic_load_explicit(&r->flags, memory_order_relaxed);
  row.auto_shards = (fl & TALLY__REC_AUTO) != 0;
  row.grown = fl >> TALLY__REC_GROWN_SHIFT & 0x3ff;
  row.shrunk = fl >> TALLY__REC_SHRUNK_SHIFT & 0x3ff;
  if (w->flags & TALLY_ROWS_ROLLED) {
    rc = tally__rec_rolled(s, rec_off, &roll);
    if (rc == TALLY_ECORRUPT) return rc;
    if (rc == 0) row.rolled = &roll;
  }
  return w->fn(w->ud, &row);
}

static int row_visit(tally_store *s, uint64_t rec_off, void *ud) {
  struct rows *w = ud;
  int m = live_match(s, rec_off, &w->w);
  return m <= 0 ? m : row_one(s, rec_off, w);
}

static int row_collect(tally_store *s, uint64_t rec_off, void *ud) {
  struct rows *w = ud;
  int m = live_match(s, rec_off, &w->w);
  if (m <= 0) return m;
  if (w->n == w->cap) {
    size_t cap = w->cap ? w->cap * 2 : 1024;
    struct tally__name_key *v = realloc(w->recs, cap * sizeof *v);
    if (!v) return tally__fail(TALLY_ENOMEM, "out of memory");
    w->recs = v;
    w->cap = cap;
  }
  tally__name_key(s, rec_off, &w->recs[w->n++]);
  return 0;
}

/* The rows collected in w, sorted by name, handed over one by one, each
 * read as it goes (one dropped since it was collected is left out). With
 * shrink, the memory the sort needed and the reading does not is given
 * back first: the reading maps the store's pages in. */
static int rows_sorted(tally_store *s, struct rows *w, int shrink) {
  int rc = tally__sort_by_name(s, w->recs, w->n);
  if (rc) return rc;
  /* from here only the offsets: packed in place (off[i] lies at or
   * before recs[i], which has been read), a third of the keys' size */
  uint64_t *off = (uint64_t *)w->recs;
  for (size_t i = 0; i < w->n; i++) off[i] = w->recs[i].rec;
  if (shrink && w->n) {
    uint64_t *less = realloc(off, w->n * sizeof *off);
    if (less) off = less, w->recs = (struct tally__name_key *)less;
  }
  for (size_t i = 0; rc == 0 && i < w->n; i++) {
    if (i + 8 < w->n) { /* a record (names only too), the cells of one nearer */
      __builtin_prefetch(tally__at(s, off[i + 8]));
      if (!(w->flags & TALLY_ROWS_NAMES)) {
        const struct tally__rec *ahead = tally__at(s, off[i + 4]);
        tally__fetch_cells(s, atomic_load_explicit(&ahead->loc, memory_order_relaxed));
      }
    }
    rc = row_visit(s, off[i], w);
  }
  return rc;
}

int tally_store_rows(tally_store *s, const char *pattern, size_t plen, unsigned flags,
                     tally_row_fn fn, void *ud) {
  if (!s || !fn) return tally__fail(TALLY_EINVAL, "tally_store_rows: NULL argument");
  struct rows w = {.flags = flags, .fn = fn, .ud = ud};
  pattern_or_all(&w.w, pattern, plen);
  if (!(flags & TALLY_ROWS_BY_NAME))
    return (flags & TALLY_ROWS_NAMES ? tally__index_each
                                     : tally__index_each_value)(s, row_visit, &w);
  tally__hold_begin(s); /* the records stay ours until fn has seen them */
  int rc = tally__index_each(s, row_collect, &w);
  if (rc == 0) rc = rows_sorted(s, &w, 1);
  tally__hold_end(s);
  free(w.recs);
  return rc;
}

/* ---- the same walk in slices ---------------------------------------------- */

struct tally_walk {
  tally_store *s;
  uint64_t table, slots, next; /* the index table it began with; where it is */
  unsigned flags;
  struct tally__name_key *recs; /* BY_NAME: a slice's records, kept for the next */
  size_t cap;
  size_t plen;
  char pattern[]; /* a copy */
};

int tally_walk_open(tally_store *s, const char *pattern, size_t plen, unsigned flags,
                    tally_walk **out) {
  if (!s || !out) return tally__fail(TALLY_EINVAL, "tally_walk_open: NULL argument");
  if (!pattern || !plen) pattern = "*", plen = 1;
  tally_walk *w = malloc(sizeof *w + plen);
  if (!w) return tally__fail(TALLY_ENOMEM, "out of memory");
  *w = (tally_walk){.s = s, .flags = flags, .plen = plen};
  memcpy(w->pattern, pattern, plen);
  tally__hold_begin(s); /* the table and the records stay ours to the close */
  int rc = tally__index_table(s, &w->table, &w->slots);
  if (rc) {
    tally__hold_end(s);
    free(w);
    return rc;
  }
  *out = w;
  return 0;
}

int tally_walk_next(tally_walk *w, uint64_t slots, tally_row_fn fn, void *ud) {
  if (!w || !fn) return tally__fail(TALLY_EINVAL, "tally_walk_next: NULL argument");
  if (w->next >= w->slots) return 1;
  struct rows r = {.flags = w->flags, .fn = fn, .ud = ud, .recs = w->recs, .cap = w->cap};
  pattern_or_all(&r.w, w->pattern, w->plen);
  uint64_t count = slots < w->slots - w->next ? slots : w->slots - w->next;
  int by_name = (w->flags & TALLY_ROWS_BY_NAME) != 0;
  int rc = tally__index_slots(w->s, w->table, w->next, count ? count : 1,
                              by_name ? row_collect : row_visit, &r);
  if (rc == 0 && by_name) rc = rows_sorted(w->s, &r, 0);
  w->recs = r.recs, w->cap = r.cap;
  if (rc) return rc; /* it stays where it was: fn's stop, or damage */
  w->next += count ? count : 1;
  return w->next >= w->slots;
}

void tally_walk_progress(const tally_walk *w, uint64_t *passed, uint64_t *slots) {
  if (passed) *passed = w ? w->next : 0;
  if (slots) *slots = w ? w->slots : 0;
}

void tally_walk_close(tally_walk *w) {
  if (!w) return;
  tally__hold_end(w->s);
  free(w->recs);
  free(w);
}

/* ---- the top k: a heap whose root is the entry that ranks last --------- */

struct top_item {
  uint64_t rec_off;
  int64_t value;
  double rate;
  bool rated; /* roll holds its latest rollup (by rate only) */
  tally_rollup roll;
};

#define RATE_AHEAD 8

struct top {
  struct walk w;
  int by;
  uint64_t k;
  struct top_item *heap;
  size_t n, cap;
  struct top_item pend[RATE_AHEAD]; /* by rate: read, not yet ranked */
  size_t npend, pend_at;            /* how many; the oldest, once full */
};

/* a ranks before b: the larger value (or rate; rolled before never
 * rolled), then the name, bytewise. */
static bool ahead(tally_store *s, int by, const struct top_item *a,
                  const struct top_item *b) {
  if (by == TALLY_TOP_RATE) {
    if (a->rated != b->rated) return a->rated;
    if (a->rated && a->rate != b->rate) return a->rate > b->rate;
  } else if (a->value != b->value) {
    return a->value > b->value;
  }
  const struct tally__rec *x = tally__at(s, a->rec_off), *y = tally__at(s, b->rec_off);
  size_t m = x->name_len < y->name_len ? x->name_len : y->name_len;
  int c = memcmp(x->name, y->name, m);
  return c ? c < 0 : x->name_len < y->name_len;
}

static void sift_down(tally_store *s, struct top *t, size_t i, size_t n) {
  for (;;) {
    size_t l = 2 * i + 1, r = l + 1, last = i;
    if (l < n && ahead(s, t->by, &t->heap[last], &t->heap[l])) last = l;
    if (r < n && ahead(s, t->by, &t->heap[last], &t->heap[r])) last = r;
    if (last == i) return;
    struct top_item x = t->heap[i];
    t->heap[i] = t->heap[last];
    t->heap[last] = x;
    i = last;
  }
}

/* Rank it among the heap's entries, its rollup read first (by rate). */
static int top_rank(tally_store *s, struct top *t, struct top_item it) {
  if (t->by == TALLY_TOP_RATE) {
    int rc = tally__rec_rolled(s, it.rec_off, &it.roll);
    if (rc == TALLY_ECORRUPT) return rc;
    if ((it.rated = rc == 0)) it.rate = tally_rollup_rate(&it.roll);
  }
  if (t->n == t->k) { /* full: replace the last if this one ranks before it */
    if (!ahead(s, t->by, &it, &t->heap[0])) return 0;
    t->heap[0] = it;
    sift_down(s, t, 0, t->n);
    return 0;
  }
  if (t->n == t->cap) {
    size_t cap = t->cap ? t->cap * 2 : 64;
    if (cap > t->k) cap = (size_t)t->k;
    struct top_item *h = realloc(t->heap, cap * sizeof *h);
    if (!h) return tally__fail(TALLY_ENOMEM, "out of memory");
    t->heap = h;
    t->cap = cap;
  }
  size_t i = t->n++; /* sift up: the parent must rank after its children */
  while (i && ahead(s, t->by, &t->heap[(i - 1) / 2], &it)) {
    t->heap[i] = t->heap[(i - 1) / 2];
    i = (i - 1) / 2;
  }
  t->heap[i] = it;
  return 0;
}

/* By rate, each counter's rollup block is one more miss: ask for it as
 * the counter's value is read, and rank the counter RATE_AHEAD later. */
static int top_one(tally_store *s, uint64_t rec_off, void *ud) {
  struct top *t = ud;
  struct top_item it = {.rec_off = rec_off};
  int m = value_of(s, rec_off, &t->w, &it.value);
  if (m == TALLY_ERANGE) return 0; /* left out, as by tally_store_values */
  if (m <= 0) return m;
  if (t->by != TALLY_TOP_RATE) return top_rank(s, t, it);
  const struct tally__rec *r = tally__at(s, rec_off);
  uint64_t off;
  if (tally__unseal(s, TALLY__SEAL_ROLLUP, atomic_load(&r->rollup), rec_off, &off) == 0 &&
      off && tally__in_arena(s, off, 64))
    __builtin_prefetch(tally__at(s, off));
  if (t->npend < RATE_AHEAD) {
    t->pend[t->npend++] = it;
    return 0;
  }
  struct top_item due = t->pend[t->pend_at];
  t->pend[t->pend_at] = it;
  t->pend_at = (t->pend_at + 1) % RATE_AHEAD;
  return top_rank(s, t, due);
}

int tally_store_top(tally_store *s, const char *pattern, size_t plen, uint64_t k, int by,
                    tally_top_fn fn, void *ud) {
  if (!s || !fn) return tally__fail(TALLY_EINVAL, "tally_store_top: NULL argument");
  if (by != TALLY_TOP_VALUE && by != TALLY_TOP_RATE)
    return tally__fail(TALLY_EINVAL, "tally_store_top: by must be TALLY_TOP_VALUE or "
                                     "TALLY_TOP_RATE");
  struct top t = {.by = by,
                  .k = k > SIZE_MAX / sizeof(struct top_item)
                           ? SIZE_MAX / sizeof(struct top_item)
                           : k};
  pattern_or_all(&t.w, pattern, plen);
  if (!t.k) return 0;
  tally__hold_begin(s); /* the records stay ours until fn has seen them */
  int rc = tally__index_each_value(s, top_one, &t);
  for (size_t i = 0; rc == 0 && i < t.npend; i++) /* the last ones read */
    rc = top_rank(s, &t, t.pend[(t.pend_at + i) % t.npend]);
  /* heapsort: the last-ranked goes to the end, the first ends at 0 */
  for (size_t n = t.n; rc == 0 && n > 1; n--) {
    struct top_item x = t.heap[0];
    t.heap[0] = t.heap[n - 1];
    t.heap[n - 1] = x;
    sift_down(s, &t, 0, n - 1);
  }
  for (size_t i = 0; rc == 0 && i < t.n; i++) {
    struct top_item *it = &t.heap[i];
    const struct tally__rec *r = tally__at(s, it->rec_off);
    if (by == TALLY_TOP_VALUE) { /* only the k rows need their rollup */
      int got = tally__rec_rolled(s, it->rec_off, &it->roll);
      if (got == TALLY_ECORRUPT) {
        rc = got;
        break;
      }
      it->rated = got == 0;
    }
    rc = fn(ud, r->name, r->name_len, it->value, it->rated ? &it->roll : NULL);
  }
  tally__hold_end(s);
  free(t.heap);
  return rc;
}

static int count_one(tally_store *s, uint64_t rec_off, void *ud) {
  struct walk *w = ud;
  int m = live_match(s, rec_off, w);
  if (m > 0) w->count++;
  return m < 0 ? m : 0;
}

int tally_store_stats_get(tally_store *s, tally_store_stats *out) {
  if (!s || !out)
    return tally__fail(TALLY_EINVAL, "tally_store_stats_get: NULL argument");
  struct walk w = {.pattern = "*", .plen = 1};
  int rc = tally__truncated(s); /* before the walk touches a missing page */
  if (rc == 0) rc = tally__index_each(s, count_one, &w);
  if (rc) return rc;
  out->counters = w.count;
  out->used_bytes = atomic_load(&s->hdr->used);
  out->retired_bytes = atomic_load(&s->hdr->retired);
  out->reusable_bytes = atomic_load(&s->hdr->free_bytes);
  out->reused_bytes = atomic_load(&s->hdr->reused);
  out->expired = atomic_load(&s->hdr->expired);
  out->capped = atomic_load(&s->hdr->capped);
  uint64_t idle = out->retired_bytes + out->reusable_bytes;
  out->live_bytes = out->used_bytes > idle + TALLY__ARENA_OFF
                        ? out->used_bytes - idle - TALLY__ARENA_OFF
                        : 0;
  out->file_bytes = atomic_load(&s->hdr->size);
  if (s->kind != TALLY__FILE) out->file_bytes = out->used_bytes;
  out->max_bytes = s->hdr->max_bytes;
  out->writers = atomic_load(&s->hdr->writers);
  out->format = s->hdr->format;
  out->schedules = 0;
  return tally__rollup_schedules(s, &out->schedules);
}
