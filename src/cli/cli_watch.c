/* cli_watch.c -- what `tally watch` reads on each refresh: the rows it shows.
 *
 *   peek.watcher() -> w: what watch remembers between refreshes (each
 *       counter's value at the last refresh and the rate found then)
 *   peek.watch(w, db, pattern, by, first, k [, now [, reverse]]) -> {
 *       count =, total =, rows = { row, ... } (those that rank first..k;
 *       reverse: in the reverse order, last first), members = { row, ...
 *       } } or nil, msg, code
 *       row: { name =, value = (nil beyond int64), rate = (or nil),
 *       diff = true (the rate is a change between refreshes: this one's,
 *       or without now the last one's) }
 *
 * One walk of the store (tally_store_rows, in the index's order, no handle
 * per counter) keeps only the k rows that rank first by `by` ("rate",
 * "value" or "name", as watch sorts) in a heap, so a refresh of a million
 * counters costs a walk, not a million Lua tables. Names that may be
 * members of a histogram (NAME{le=B}, NAME{sum,unit=U}: tally.histogram's
 * forms) are handed over apart, all of them, with neither count nor total
 * including them: watch groups them, and puts back those that are not.
 *
 * With `now` (a refresh), each counter's rate is the change of its value
 * since the last refresh divided by the time between them; a counter the
 * last refresh did not see takes the rate of its latest rollup, if any.
 * Without `now` (the sort or the scroll changed between refreshes), the
 * rates stay those of the last refresh, and nothing is remembered.
 *
 * The values of the last refresh are kept in the walk's order (32 bytes a
 * counter, found by position while no counter comes or goes) under the
 * counter's incarnation, not its name: random per creation, read with
 * the row, nothing to hash, and a counter dropped and made again between
 * two refreshes is a new one, not a fall of its value. Two live counters
 * of a million share one with odds of about 1 in 30 million, and the cost
 * is one wrong rate for one refresh. A refresh of a million counters
 * holds ~64 MB.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../core/namekey.h"
#include "lua_aux.h"
#include "cli.h"

#define WATCHER_MT "tally.watcher"

/* A counter as a refresh saw it, in the walk's order. */
struct seen {
  uint64_t h; /* its incarnation (tally_row) */
  int64_t v;
  double rate;
  uint8_t has_v, has_rate, diff; /* diff: the rate was a change between refreshes */
};

struct watcher {
  struct seen *prev, *cur; /* the last refresh's, this one's */
  size_t nprev, capprev, ncur, capcur;
  uint32_t *idx; /* prev's positions + 1 by incarnation, made once the order differs */
  size_t capidx;
  int have_idx;
  size_t at;    /* where in prev the walk should be now */
  uint32_t gen; /* refreshes so far */
  double t;     /* the last one's time */
};

/* A row kept for the screen; name malloc'd. */
struct wrow {
  char *name;
  size_t len;
  uint64_t key; /* the name's first 8 bytes (namekey.h): most ties end there */
  int64_t v;
  double rate;
  uint8_t has_v, has_rate, diff, member;
  size_t cur; /* its place in w->cur, SIZE_MAX if none */
};

struct walk {
  tally_store *store;
  struct watcher *w;
  int by;           /* 0 rate, 1 value, 2 name */
  int rev;          /* keep the last k instead, last first */
  int refresh;      /* a `now` was given */
  double dt;        /* now - the last refresh's time; 0: no last refresh */
  size_t k, n, cap; /* heap: k rows at most, n now, room for cap */
  struct wrow *heap;
  struct wrow *mem; /* possible histogram members */
  size_t nmem, capmem;
  struct wrow *new; /* counters the last refresh did not see: their rollup after */
  size_t nnew, capnew;
  uint64_t count;
  int64_t total;
  int total_ok;
  int failed; /* out of memory */
};

/* The last refresh's entry for incarnation h, or NULL. The walk goes in the
 * index's order, the same from one refresh to the next while no counter
 * comes or goes: so the next entry is tried first, and a hash table over
 * the entries is made only once the orders part. */
static struct seen *seen_find(struct watcher *w, uint64_t h) {
  if (w->at < w->nprev && w->prev[w->at].h == h) return &w->prev[w->at++];
  if (w->nprev == 0) return NULL;
  if (!w->have_idx) {
    size_t cap = 1024;
    while (cap < 2 * w->nprev) cap *= 2;
    if (cap > w->capidx) {
      uint32_t *idx = (uint32_t *)realloc(w->idx, cap * sizeof *idx);
      if (idx == NULL) return NULL; /* no rate for it this time */
      w->idx = idx;
      w->capidx = cap;
    }
    memset(w->idx, 0, cap * sizeof *w->idx);
    for (size_t i = 0; i < w->nprev; i++) {
      size_t j = w->prev[i].h & (cap - 1);
      while (w->idx[j]) j = (j + 1) & (cap - 1);
      w->idx[j] = (uint32_t)(i + 1);
    }
    w->capidx = cap;
    w->have_idx = 1;
  }
  for (size_t j = h & (w->capidx - 1); w->idx[j]; j = (j + 1) & (w->capidx - 1)) {
    size_t i = w->idx[j] - 1;
    if (w->prev[i].h == h) {
      w->at = i + 1;
      return &w->prev[i];
    }
  }
  return NULL;
}

/* The entry of this refresh for the row. */
static struct seen *seen_add(struct watcher *w) {
  if (w->ncur == w->capcur) {
    size_t cap = w->capcur ? 2 * w->capcur : 1024;
    struct seen *c = (struct seen *)realloc(w->cur, cap * sizeof *c);
    if (c == NULL) return NULL;
    w->cur = c;
    w->capcur = cap;
  }
  return &w->cur[w->ncur++];
}

/* Does row a rank before row b, as watch sorts: the larger rate (a row
 * with none after), the larger value, then the name, bytewise (Lua's
 * string order in the C locale). */
static int ranks_before(int by, const struct wrow *a, const struct wrow *b) {
  if (by == 0 && a->has_rate != b->has_rate) return a->has_rate;
  if (by == 0 && a->has_rate && a->rate != b->rate) return a->rate > b->rate;
  if (by == 1 && a->has_v && b->has_v && a->v != b->v) return a->v > b->v;
  if (a->key != b->key) return a->key < b->key; /* the names' order, without a call */
  size_t n = a->len < b->len ? a->len : b->len;
  int c = memcmp(a->name, b->name, n);
  return c != 0 ? c < 0 : a->len < b->len;
}

/* a before b in the order the walk keeps: watch's, or its reverse (the
 * last rows of a long list are the first k of the reverse). */
static int better(const struct walk *x, const struct wrow *a, const struct wrow *b) {
  return x->rev ? ranks_before(x->by, b, a) : ranks_before(x->by, a, b);
}

/* The heap keeps the k best with the worst at the root. */
static void sift_down(struct walk *x, size_t i) {
  for (;;) {
    size_t l = 2 * i + 1, r = l + 1, m = i;
    if (l < x->n && better(x, &x->heap[m], &x->heap[l])) m = l;
    if (r < x->n && better(x, &x->heap[m], &x->heap[r])) m = r;
    if (m == i) return;
    struct wrow t = x->heap[i];
    x->heap[i] = x->heap[m];
    x->heap[m] = t;
    i = m;
  }
}

static void sift_up(struct walk *x, size_t i) {
  while (i > 0) {
    size_t p = (i - 1) / 2;
    if (!better(x, &x->heap[p], &x->heap[i])) return;
    struct wrow t = x->heap[i];
    x->heap[i] = x->heap[p];
    x->heap[p] = t;
    i = p;
  }
}

static int keep_name(struct wrow *r, const char *name, size_t len) {
  char *p = (char *)malloc(len ? len : 1);
  if (p == NULL) return -1;
  memcpy(p, name, len);
  free(r->name);
  r->name = p;
  r->len = len;
  return 0;
}

/* A member of a histogram has one of its forms (tally.histogram's parse
 * says for sure): NAME{le=B} or NAME{sum,unit=U}. */
static int maybe_member(const char *s, size_t len) {
  if (len < 2 || s[len - 1] != '}') return 0;
  const char *b = memchr(s, '{', len);
  if (b == NULL) return 0;
  size_t rest = len - (size_t)(b - s);
  return (rest > 4 && memcmp(b, "{le=", 4) == 0) ||
         (rest > 10 && memcmp(b, "{sum,unit=", 10) == 0);
}

/* Append r (its name copied) to a list of rows. */
static int list_add(struct wrow **list, size_t *n, size_t *cap, const struct wrow *r) {
  if (*n == *cap) {
    size_t c = *cap ? 2 * *cap : 16;
    struct wrow *l = (struct wrow *)realloc(*list, c * sizeof *l);
    if (l == NULL) return -1;
    *list = l;
    *cap = c;
  }
  struct wrow *e = &(*list)[*n];
  *e = *r;
  e->name = NULL;
  if (keep_name(e, r->name, r->len) < 0) return -1;
  (*n)++;
  return 0;
}

/* A row whose rate is known: to the members, or among the k best. */
static int place(struct walk *x, const struct wrow *r) {
  if (r->member) return list_add(&x->mem, &x->nmem, &x->capmem, r);
  if (x->k == 0) return 0;
  if (x->n < x->k) {
    if (list_add(&x->heap, &x->n, &x->cap, r) < 0) return -1;
    sift_up(x, x->n - 1);
  } else if (better(x, r, &x->heap[0])) {
    char *old = x->heap[0].name;
    x->heap[0] = *r;
    x->heap[0].name = old;
    if (keep_name(&x->heap[0], r->name, r->len) < 0) return -1;
    sift_down(x, 0);
  }
  return 0;
}

static int watch_row(void *ud, const tally_row *row) {
  struct walk *x = (struct walk *)ud;
  struct watcher *w = x->w;
  struct wrow r = {(char *)row->name,
                   row->name_len,
                   tally__name_bytes(row->name, row->name_len, 0),
                   row->value,
                   0,
                   row->value_rc == 0,
                   0,
                   0,
                   (uint8_t)maybe_member(row->name, row->name_len),
                   SIZE_MAX};
  uint64_t h = row->incarnation;
  struct seen *s = seen_find(w, h);
  int later = 0;
  if (s != NULL) {
    if (x->refresh && r.has_v && s->has_v && x->dt > 0) {
      r.rate = (double)(r.v - s->v) / x->dt;
      r.has_rate = r.diff = 1;
    } else if (s->has_rate) { /* the last refresh's (or a value beyond int64 now) */
      r.rate = s->rate;
      r.has_rate = 1;
      r.diff = !x->refresh && s->diff;
    }
  } else if (row->rolled) {
    r.rate = tally_rollup_rate(row->rolled);
    r.has_rate = 1;
  } else if (w->gen != 0) {
    later = 1; /* its latest rollup's rate, read once the walk is over */
  }
  if (x->refresh) {
    struct seen *e = seen_add(w);
    if (e == NULL) goto nomem;
    *e = (struct seen){h, r.v, r.rate, r.has_v, r.has_rate, r.diff};
    r.cur = w->ncur - 1;
  }
  if (!r.member) {
    x->count++;
    if (!r.has_v || __builtin_add_overflow(x->total, r.v, &x->total)) x->total_ok = 0;
  }
  if (later ? list_add(&x->new, &x->nnew, &x->capnew, &r) : place(x, &r)) goto nomem;
  return 0;
nomem:
  x->failed = 1;
  return 1;
}

/* The counters new since the last refresh, with their latest rollup's
 * rate: a handle each, as there are few once watch runs (the first refresh
 * reads every rollup in its walk). A counter dropped meanwhile keeps none. */
static int place_new(struct walk *x) {
  for (size_t i = 0; i < x->nnew; i++) {
    struct wrow *r = &x->new[i];
    tally_counter *c;
    tally_rollup roll;
    if (tally_counter_open(x->store, r->name, r->len, NULL, 0, &c) == 0) {
      if (tally_counter_rolled(c, &roll) == 0) {
        r->rate = tally_rollup_rate(&roll);
        r->has_rate = 1;
        if (r->cur != SIZE_MAX) {
          x->w->cur[r->cur].rate = r->rate;
          x->w->cur[r->cur].has_rate = 1;
        }
      }
      tally_counter_close(c);
    }
    if (place(x, r) < 0) return -1;
  }
  return 0;
}

/* Best first: the worst, at the root, goes to the end, and so on. */
static void heap_sort(struct walk *x) {
  size_t n = x->n;
  while (x->n > 1) {
    struct wrow t = x->heap[0];
    x->heap[0] = x->heap[--x->n];
    x->heap[x->n] = t;
    sift_down(x, 0);
  }
  x->n = n;
}

static void push_row(lua_State *L, const struct wrow *r) {
  lua_createtable(L, 0, 4);
  lua_pushlstring(L, r->name, r->len);
  lua_setfield(L, -2, "name");
  if (r->has_v) tl_setint(L, "value", r->v);
  if (r->has_rate) {
    lua_pushnumber(L, (lua_Number)r->rate);
    lua_setfield(L, -2, "rate");
  }
  if (r->diff) {
    lua_pushboolean(L, 1);
    lua_setfield(L, -2, "diff");
  }
}

/* The walk's memory lives in a userdata on the stack, so that a Lua error
 * while the result is made frees it (its __gc). */
static int walk_gc(lua_State *L) {
  struct walk *x = (struct walk *)lua_touserdata(L, 1);
  size_t i;
  for (i = 0; i < x->n; i++) free(x->heap[i].name);
  for (i = 0; i < x->nmem; i++) free(x->mem[i].name);
  for (i = 0; i < x->nnew; i++) free(x->new[i].name);
  free(x->heap);
  free(x->mem);
  free(x->new);
  memset(x, 0, sizeof *x);
  return 0;
}

static struct watcher *check_watcher(lua_State *L, int idx) {
  return (struct watcher *)luaL_checkudata(L, idx, WATCHER_MT);
}

static int p_watch(lua_State *L) {
  struct watcher *w = check_watcher(L, 1);
  tl_store *d = tl_checkstore(L, 2);
  size_t plen = 0, i;
  const char *pattern = luaL_optlstring(L, 3, NULL, &plen);
  static const char *const bys[] = {"rate", "value", "name", NULL};
  int by = luaL_checkoption(L, 4, NULL, bys);
  lua_Integer first = luaL_checkinteger(L, 5);
  lua_Integer k = luaL_checkinteger(L, 6);
  int refresh = !lua_isnoneornil(L, 7);
  double now = refresh ? (double)luaL_checknumber(L, 7) : 0;
  int rev = lua_toboolean(L, 8);
  struct walk *x = (struct walk *)lua_newuserdatauv(L, sizeof *x, 0);
  memset(x, 0, sizeof *x);
  lua_createtable(L, 0, 1);
  lua_pushcfunction(L, walk_gc);
  lua_setfield(L, -2, "__gc");
  lua_setmetatable(L, -2);
  x->store = d->store;
  x->w = w;
  x->by = by;
  x->rev = rev;
  x->refresh = refresh;
  x->dt = w->gen != 0 && now > w->t ? now - w->t : 0;
  x->k = k < 0 ? 0 : (size_t)k;
  x->total_ok = 1;
  w->at = 0;
  w->ncur = 0;
  /* the first refresh reads every counter's rollup in the walk (each one
   * is new to it); later ones read only the new counters' */
  int rc = tally_store_rows(d->store, pattern, plen, w->gen == 0 ? TALLY_ROWS_ROLLED : 0,
                            watch_row, x);
  if (rc == 0 && !x->failed && place_new(x) < 0) x->failed = 1;
  if (x->failed) return luaL_error(L, "not enough memory");
  if (rc < 0) return tl_fail(L, rc);
  if (refresh) { /* this refresh's values are the last ones now */
    struct seen *t = w->prev;
    size_t cap = w->capprev;
    w->prev = w->cur;
    w->capprev = w->capcur;
    w->nprev = w->ncur;
    w->cur = t;
    w->capcur = cap;
    w->have_idx = 0;
    w->gen++;
    w->t = now;
  }
  heap_sort(x);
  lua_createtable(L, 0, 4);
  tl_setint(L, "count", (int64_t)x->count);
  if (x->total_ok) {
    tl_setint(L, "total", x->total);
  } else { /* beyond int64, or a value already is */
    lua_pushboolean(L, 0);
    lua_setfield(L, -2, "total");
  }
  i = first < 1 ? 0 : (size_t)first - 1;
  lua_createtable(L, i < x->n ? (int)(x->n - i) : 0, 0);
  for (size_t j = 1; i < x->n; i++, j++) {
    push_row(L, &x->heap[i]);
    lua_rawseti(L, -2, (lua_Integer)j);
  }
  lua_setfield(L, -2, "rows");
  lua_createtable(L, (int)x->nmem, 0);
  for (i = 0; i < x->nmem; i++) {
    push_row(L, &x->mem[i]);
    lua_rawseti(L, -2, (lua_Integer)i + 1);
  }
  lua_setfield(L, -2, "members");
  return 1;
}

static int watcher_gc(lua_State *L) {
  struct watcher *w = check_watcher(L, 1);
  free(w->prev);
  free(w->cur);
  free(w->idx);
  memset(w, 0, sizeof *w);
  return 0;
}

static int p_watcher(lua_State *L) {
  struct watcher *w = (struct watcher *)lua_newuserdatauv(L, sizeof *w, 0);
  memset(w, 0, sizeof *w);
  if (luaL_newmetatable(L, WATCHER_MT)) {
    lua_pushcfunction(L, watcher_gc);
    lua_setfield(L, -2, "__gc");
  }
  lua_setmetatable(L, -2);
  return 1;
}

void cli_peek_watch(lua_State *L) {
  lua_pushcfunction(L, p_watcher);
  lua_setfield(L, -2, "watcher");
  lua_pushcfunction(L, p_watch);
  lua_setfield(L, -2, "watch");
}
