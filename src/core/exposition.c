/* exposition.c -- the Prometheus text of a store's counters, written as
 * the walk reads them, a piece at a time.
 *
 * A store of a million cold counters is a million lines, one gauge's
 * series each. Nothing here is per counter but its row (24 bytes and its
 * name): no handle, no string, no allocation. The walk hands each slice of
 * the index sorted by name (TALLY_ROWS_BY_NAME), so the rows read are
 * sorted runs, and the lines come from merging them: each slice is read
 * in the index's order while its records are in cache, where reading
 * every value in the names' order went all over the store. A host that
 * yields (the Lua side's tally.prometheus under nginx) does so between
 * slices and between pieces of lines; a host that maps some counters
 * itself (the Lua side's families and histograms) leaves those rows out
 * or takes them as samples instead of lines.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "namekey.h"
#include "text.h"

enum { ROW_OUT = 1, ROW_RANGE = 2 };

struct row {
  uint32_t off;  /* its name in names */
  uint8_t len;   /* names are 1 to 255 bytes */
  uint8_t flags; /* ROW_* */
  int64_t value; /* ROW_RANGE: its text's number in range_text */
  uint64_t key;  /* the merge: the name's 8 bytes after what all share */
};

/* Row numbers listed as they are read. */
struct listed {
  size_t *at;
  size_t n, cap;
};

struct number {
  char text[TALLY__NUMBER_ROOM];
  size_t len;
};

struct tally_exposition {
  tally_store *store;
  tally_walk *walk; /* while reading */
  struct row *row;
  size_t n, cap;
  char *names;
  size_t used, room;
  int failed;  /* out of memory during a walk */
  size_t *run; /* where each run begins, then n */
  size_t nrun, runcap;
  size_t *heap, nheap; /* the merge: the runs' next rows, least first */
  size_t *at;          /* per run: its next row */
  int merging;
  int headed;                /* the HELP and TYPE lines are written */
  size_t shared;             /* the bytes every name begins with: compared by key */
  size_t keyed;              /* rows from here on have their key at shared */
  struct listed braced;      /* rows whose name ends in '}' */
  struct listed range;       /* rows whose sum is beyond int64 */
  struct number *range_text; /* their texts, made as reading ends */
  size_t left_out;           /* rows marked ROW_OUT */
  int error;                 /* what failed it: returned from then on */
  char *text;                /* what write hands over */
  size_t tlen, tcap;
};

/* Room for cap rows and room bytes of names, at least; 0, or -1 (what
 * was there stays). */
static int rows_reserve(tally_exposition *x, size_t cap, size_t room) {
  struct row *row = cap > x->cap ? realloc(x->row, cap * sizeof *row) : x->row;
  if (row && cap > x->cap) x->row = row, x->cap = cap;
  char *names = room > x->room ? realloc(x->names, room) : x->names;
  if (names && room > x->room) x->names = names, x->room = room;
  return row && names ? 0 : -1;
}

static int list_add(struct listed *l, size_t row) {
  if (l->n == l->cap) {
    size_t cap = l->cap ? l->cap * 2 : 64;
    size_t *at = realloc(l->at, cap * sizeof *at);
    if (!at) return -1;
    l->at = at, l->cap = cap;
  }
  l->at[l->n++] = row;
  return 0;
}

/* A row whose name ends in '}', or whose sum is beyond int64, is listed
 * as it is read, and the merge's key made then: no pass over every row
 * stands between the last slice and the first lines, a step that a host
 * that yields could not cut. */
static int row_add(void *ud, const tally_row *r) {
  tally_exposition *x = (tally_exposition *)ud;
  if (x->n == x->cap || x->used + r->name_len > x->room) {
    size_t cap = x->n == x->cap ? (x->cap ? x->cap * 2 : 4096) : x->cap;
    size_t room =
        x->used + r->name_len > x->room ? (x->room ? x->room * 2 : 65536) : x->room;
    if (rows_reserve(x, cap, room)) return x->failed = 1; /* stops the walk */
  }
  if (x->used > UINT32_MAX - TALLY_NAME_MAX) return x->failed = 1;
  if (r->name[r->name_len - 1] == '}' && list_add(&x->braced, x->n)) return x->failed = 1;
  if (r->value_rc && list_add(&x->range, x->n)) return x->failed = 1;
  /* the prefix all names share: the first name's, as far as each agrees */
  size_t k = 0;
  if (x->n == 0)
    x->shared = k = r->name_len;
  else
    while (k < x->shared && k < r->name_len && x->names[k] == r->name[k]) k++;
  if (k < x->shared) x->shared = k, x->keyed = x->n; /* the keys before: too deep */
  memcpy(x->names + x->used, r->name, r->name_len);
  x->row[x->n++] = (struct row){(uint32_t)x->used, (uint8_t)r->name_len,
                                (uint8_t)(r->value_rc ? ROW_RANGE : 0),
                                r->value_rc ? (int64_t)x->range.n - 1 : r->value,
                                tally__name_bytes(r->name, r->name_len, x->shared)};
  x->used += r->name_len;
  return 0;
}

/* Name order, bytewise, a name before any longer one it begins (names
 * hold no NUL: the keys, zeros past a name's end, keep that order); rows
 * of one name by the order they were read. The merge compares the keys
 * (the 8 bytes after the prefix every name shares) and only names that tie
 * on them: each comparison of names was a cache miss in a run elsewhere. */
static int name_cmp(const tally_exposition *x, const struct row *a, const struct row *b) {
  if (a->key != b->key) return a->key < b->key ? -1 : 1;
  size_t from = x->shared + 8;
  if (a->len <= from || b->len <= from) return (a->len > b->len) - (a->len < b->len);
  size_t al = a->len - from, bl = b->len - from;
  int c = memcmp(x->names + a->off + from, x->names + b->off + from, al < bl ? al : bl);
  return c ? c : (al > bl) - (al < bl);
}

static int row_cmp(const tally_exposition *x, size_t a, size_t b) {
  int c = name_cmp(x, &x->row[a], &x->row[b]);
  return c ? c : (a > b) - (a < b);
}

/* The rows from start on are a run (sorted by the walk): recorded. */
static int run_end(tally_exposition *x, size_t start) {
  if (x->nrun + 2 > x->runcap) {
    size_t cap = x->runcap ? x->runcap * 2 : 64;
    size_t *run = realloc(x->run, cap * sizeof *run);
    if (!run) return x->failed = 1;
    x->run = run, x->runcap = cap;
  }
  if (x->n == start) return 0;
  x->run[x->nrun++] = start;
  x->run[x->nrun] = x->n;
  return 0;
}

int tally_exposition_open(tally_store *s, const char *pattern, size_t plen,
                          tally_exposition **out) {
  if (!s || !out)
    return tally__fail(TALLY_EINVAL, "tally_exposition_open: NULL argument");
  *out = NULL;
  tally_exposition *x = calloc(1, sizeof *x);
  if (!x) return tally__fail(TALLY_ENOMEM, "not enough memory for an exposition");
  x->store = s;
  int rc = tally_walk_open(s, pattern, plen, TALLY_ROWS_BY_NAME, &x->walk);
  if (rc < 0) {
    free(x);
    return rc;
  }
  *out = x;
  return 0;
}

/* x failed with rc (< 0): so it stays. */
static int failed(tally_exposition *x, int rc) {
  if (rc < 0 && !x->error) x->error = rc;
  return rc;
}

static int failed_before(const tally_exposition *x) {
  return tally__fail(x->error, "this exposition failed before (%s)",
                     tally_err_name(x->error));
}

/* A sum beyond int64 as text: the float sum of its shards (0 if it was
 * dropped since it was read). */
static void beyond_text(tally_exposition *x, const struct row *r, struct number *out) {
  double v = 0.0;
  tally_counter *c = NULL;
  int64_t *vals = malloc(TALLY_MAX_SHARDS * sizeof *vals);
  uint32_t n = 0;
  if (vals && tally_counter_open(x->store, x->names + r->off, r->len, NULL, 0, &c) == 0 &&
      tally_counter_shards(c, vals, TALLY_MAX_SHARDS, &n) == 0)
    for (uint32_t i = 0; i < n && i < TALLY_MAX_SHARDS; i++) v += (double)vals[i];
  tally_counter_close(c);
  free(vals);
  out->len = tally__number_text(v, out->text, sizeof out->text);
}

/* Reading ends: the walk closed (reuse may go on), and the sums beyond
 * int64 read then, as the values were, not while lines are written. */
static int read_end(tally_exposition *x) {
  if (x->walk) {
    tally_walk_close(x->walk);
    x->walk = NULL;
  }
  if (x->range_text || !x->range.n) return 0;
  x->range_text = malloc(x->range.n * sizeof *x->range_text);
  if (!x->range_text)
    return failed(x, tally__fail(TALLY_ENOMEM, "not enough memory for a scrape's rows"));
  for (size_t k = 0; k < x->range.n; k++)
    beyond_text(x, &x->row[x->range.at[k]], &x->range_text[k]);
  return 0;
}

int tally_exposition_read(tally_exposition *x, uint64_t slots) {
  if (!x || !slots)
    return tally__fail(TALLY_EINVAL, "tally_exposition_read: no x or slots");
  if (x->error) return failed_before(x);
  if (!x->walk) return read_end(x) ? x->error : 1; /* done already, or now */
  size_t start = x->n;
  int rc = tally_walk_next(x->walk, slots, row_add, x);
  if (!x->failed && rc >= 0) run_end(x, start);
  if (!x->failed && rc == 0 && start == 0 && x->n) {
    /* room for what the first slice says the whole holds, and an eighth:
     * grown by doubling, the rows were copied again and again, into new
     * pages each time (a fifth of a scrape of a million on the VM) */
    uint64_t passed, all;
    tally_walk_progress(x->walk, &passed, &all);
    double whole = (double)all / (double)passed * 1.125;
    if (whole * (double)x->n < (double)(SIZE_MAX / 2 / sizeof *x->row) &&
        whole * (double)x->used < (double)UINT32_MAX)
      rows_reserve(x, (size_t)(whole * (double)x->n),
                   (size_t)(whole * (double)x->used)); /* or grow as they come */
  }
  if (x->failed || rc < 0) {
    tally_walk_close(x->walk);
    x->walk = NULL;
    if (x->failed)
      rc = tally__fail(TALLY_ENOMEM, "not enough memory for a scrape's rows");
    return failed(x, rc);
  }
  if (rc == 1 && read_end(x)) return x->error;
  return rc == 1;
}

int tally_exposition_braced(tally_exposition *x, tally_exposed_fn fn, void *ud) {
  if (!x || !fn)
    return tally__fail(TALLY_EINVAL, "tally_exposition_braced: NULL argument");
  for (size_t j = 0; j < x->braced.n; j++) {
    const struct row *r = &x->row[x->braced.at[j]];
    int rc = fn(ud, x->braced.at[j], x->names + r->off, r->len);
    if (rc) return rc;
  }
  return 0;
}

int tally_exposition_leave_out(tally_exposition *x, uint64_t row) {
  if (!x || row >= x->n)
    return tally__fail(TALLY_EINVAL, "tally_exposition_leave_out: no such row");
  x->left_out += !(x->row[row].flags & ROW_OUT);
  x->row[row].flags |= ROW_OUT;
  return 0;
}

void tally_exposition_count(const tally_exposition *x, uint64_t *read, uint64_t *kept) {
  if (read) *read = x ? x->n : 0;
  if (kept) *kept = x ? x->n - x->left_out : 0;
}

/* ---- the merge of the runs: rows in name order, each name once ---------- */

static void sift(tally_exposition *x, size_t i) {
  for (;;) {
    size_t l = 2 * i + 1, r = l + 1, m = i;
    if (l < x->nheap && row_cmp(x, x->at[x->heap[l]], x->at[x->heap[m]]) < 0) m = l;
    if (r < x->nheap && row_cmp(x, x->at[x->heap[r]], x->at[x->heap[m]]) < 0) m = r;
    if (m == i) return;
    size_t t = x->heap[i];
    x->heap[i] = x->heap[m];
    x->heap[m] = t;
    i = m;
  }
}

/* The keys made before the shared prefix last shrank, made again (the
 * first few rows, unless a name far from the others came late). */
static void keys_fill(tally_exposition *x) {
  for (size_t i = 0; i < x->keyed; i++)
    x->row[i].key = tally__name_bytes(x->names + x->row[i].off, x->row[i].len, x->shared);
  x->keyed = 0;
}

/* The merge begins at the first write (or rows) call; reading ends then. */
static int merge_start(tally_exposition *x) {
  if (x->error) return failed_before(x);
  if (x->merging) return 0;
  if (read_end(x)) return x->error;
  x->heap = malloc((x->nrun + 1) * sizeof *x->heap);
  x->at = malloc((x->nrun + 1) * sizeof *x->at);
  if (!x->heap || !x->at) {
    free(x->heap), free(x->at);
    x->heap = NULL, x->at = NULL;
    return failed(x, tally__fail(TALLY_ENOMEM, "not enough memory for a scrape's merge"));
  }
  keys_fill(x);
  x->nheap = 0;
  for (size_t k = 0; k < x->nrun; k++) {
    x->at[k] = x->run[k];
    x->heap[x->nheap++] = k;
  }
  for (size_t i = x->nheap; i-- > 0;) sift(x, i);
  x->merging = 1;
  return 0;
}

/* The next row in name order, not left out, the last read of its name;
 * SIZE_MAX when none is left. */
static size_t merge_next(tally_exposition *x) {
  while (x->nheap) {
    size_t k = x->heap[0], i = x->at[k]++;
    if (x->at[k] == x->run[k + 1]) x->heap[0] = x->heap[--x->nheap];
    sift(x, 0);
    /* the next row has the same name: this one was read earlier */
    if (x->nheap && name_cmp(x, &x->row[i], &x->row[x->at[x->heap[0]]]) == 0) continue;
    if (x->row[i].flags & ROW_OUT) continue;
    return i;
  }
  return SIZE_MAX;
}

/* Room for k more bytes of text; where they go, or NULL. */
static char *text_room(tally_exposition *x, size_t k) {
  if (x->tcap - x->tlen < k) {
    size_t cap = x->tcap * 2 > x->tlen + k ? x->tcap * 2 : x->tlen + k;
    char *p = realloc(x->text, cap);
    if (!p) return NULL;
    x->text = p, x->tcap = cap;
  }
  return x->text + x->tlen;
}

static int text_put(tally_exposition *x, const char *s, size_t len) {
  char *w = text_room(x, len);
  if (!w) return -1;
  memcpy(w, s, len);
  x->tlen += len;
  return 0;
}

static const char head[] = "# HELP " TALLY_PROM_METRIC " " TALLY_PROM_HELP "\n"
                           "# TYPE " TALLY_PROM_METRIC " gauge\n";
/* Row r's line. */
static int line_put(tally_exposition *x, const struct row *r) {
  char *w = text_room(x, TALLY__DEFAULT_LINE_ROOM(r->len));
  if (!w) return -1;
  const struct number *t = r->flags & ROW_RANGE ? &x->range_text[r->value] : NULL;
  x->tlen += tally__default_line(w, x->names + r->off, r->len, r->value,
                                 t ? t->text : NULL, t ? t->len : 0);
  return 0;
}

int tally_exposition_write(tally_exposition *x, uint64_t lines, tally_write_fn write,
                           void *ud) {
  if (!x || !write)
    return tally__fail(TALLY_EINVAL, "tally_exposition_write: NULL argument");
  int rc = merge_start(x);
  if (rc < 0) return rc;
  x->tlen = 0;
  size_t i;
  for (uint64_t k = 0; k < lines && (i = merge_next(x)) != SIZE_MAX; k++) {
    if ((!x->headed && text_put(x, head, sizeof head - 1)) || line_put(x, &x->row[i]))
      return failed(x,
                    tally__fail(TALLY_ENOMEM, "not enough memory for a scrape's text"));
    x->headed = 1;
  }
  if (x->tlen && (rc = write(ud, x->text, x->tlen)) != 0) return rc;
  return x->nheap == 0;
}

int tally_exposition_rows(tally_exposition *x, uint64_t n, tally_sample_fn fn, void *ud) {
  if (!x || !fn) return tally__fail(TALLY_EINVAL, "tally_exposition_rows: NULL argument");
  int rc = merge_start(x);
  if (rc < 0) return rc;
  size_t i;
  for (uint64_t k = 0; k < n && (i = merge_next(x)) != SIZE_MAX; k++) {
    const struct row *r = &x->row[i];
    const struct number *t = r->flags & ROW_RANGE ? &x->range_text[r->value] : NULL;
    if ((rc = fn(ud, x->names + r->off, r->len, r->value, t ? t->text : NULL,
                 t ? t->len : 0)))
      return rc;
  }
  return x->nheap == 0;
}

void tally_exposition_close(tally_exposition *x) {
  if (!x) return;
  if (x->walk) tally_walk_close(x->walk);
  free(x->row);
  free(x->names);
  free(x->run);
  free(x->heap);
  free(x->at);
  free(x->braced.at);
  free(x->range.at);
  free(x->range_text);
  free(x->text);
  free(x);
}

/* Lines per piece: about 50 KiB of a million post:N:likes. Slots per
 * read: a slice's rows are sorted while they are in cache (a whole store
 * at once sorted slower), and few runs merge fast. */
#define PIECE_LINES 1024
#define READ_SLOTS  32768

struct host {
  tally_write_fn write;
  void *ud;
  int stopped; /* write's non-zero value */
};

static int host_write(void *ud, const char *text, size_t len) {
  struct host *h = (struct host *)ud;
  h->stopped = h->write(h->ud, text, len);
  return h->stopped ? -1 : 0;
}

int tally_prometheus(tally_store *s, const char *pattern, size_t plen,
                     tally_write_fn write, void *ud) {
  if (!write) return tally__fail(TALLY_EINVAL, "tally_prometheus: NULL argument");
  tally_exposition *x;
  int rc = tally_exposition_open(s, pattern, plen, &x);
  if (rc < 0) return rc;
  struct host h = {write, ud, 0};
  while ((rc = tally_exposition_read(x, READ_SLOTS)) == 0) continue;
  if (rc == 1)
    while ((rc = tally_exposition_write(x, PIECE_LINES, host_write, &h)) == 0) continue;
  tally_exposition_close(x);
  return h.stopped ? h.stopped : rc == 1 ? 0 : rc;
}
