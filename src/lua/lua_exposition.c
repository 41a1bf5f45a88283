/* lua_exposition.c -- exposition lines written in C, many at once.
 *
 * tally.prometheus exposes every counter that no family maps as one series
 * of tally_value, labelled with its name, and those of a family with one
 * '*' as a series labelled with what the '*' matched: a store of a million
 * cold counters is a million such lines. Written in Lua, each line was
 * three new strings (the series, the value, the line) and the whole
 * exposition took 7 to 9 s; here the lines go into one buffer. A family
 * with several '*' (a label each) took 24 s: in Lua each name was also
 * split into a table of parts, and its series made a key against
 * duplicates, which such a family cannot have. The mapping, the checks
 * and the order stay in Lua (lua/tally/prometheus.lua), which hands over the
 * names and values of these lines only.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/namekey.h"
#include "lua_aux.h"

/* A label value: \ " and newline escaped, as the exposition format asks,
 * into room for twice its length. Returns the bytes written. */
static size_t put_label_value(char *out, const char *s, size_t len) {
  char *o = out;
  for (size_t i = 0; i < len; i++) {
    char c = s[i];
    if (c == '\\' || c == '"' || c == '\n') {
      *o++ = '\\';
      c = c == '\n' ? 'n' : c;
    }
    *o++ = c;
  }
  return (size_t)(o - out);
}

static size_t put_hex(char *out, const unsigned char *s, size_t len) {
  static const char digit[] = "0123456789abcdef";
  for (size_t i = 0; i < len; i++) {
    out[2 * i] = digit[s[i] >> 4];
    out[2 * i + 1] = digit[s[i] & 15];
  }
  return 2 * len;
}

/* The text grows in a full userdata at stack slot `at`, so a memory error
 * on the way frees it as any Lua value. Not a luaL_Buffer: LuaJIT's (Lua
 * 5.1's) keeps a long text as pieces on the stack that it concatenates
 * again and again, and a million lines took 64 s there. A scrape's rows
 * keep theirs in memory of their own instead (struct keep: freed with
 * them, used again for each chunk): LuaJIT took 0.36 s to write the text
 * of a million counters into a new userdata, 0.20 s into malloc's memory
 * (Lua 5.4: 0.20 s either way). */
struct keep {
  char *p;
  size_t cap;
};

struct out {
  lua_State *L;
  int at;
  char *p;
  size_t n, cap;
  struct keep *keep; /* where the text grows, if not in a userdata */
};

/* Room for k more bytes; returns where they go. */
static char *room(struct out *o, size_t k) {
  if (o->cap - o->n < k) {
    size_t cap = o->cap * 2 > o->n + k ? o->cap * 2 : o->n + k;
    if (o->keep) {
      char *p = realloc(o->keep->p, cap);
      if (!p) luaL_error(o->L, "not enough memory");
      o->keep->p = o->p = p;
      o->keep->cap = o->cap = cap;
      return o->p + o->n;
    }
    char *p = (char *)lua_newuserdata(o->L, cap);
    memcpy(p, o->p, o->n);
    lua_replace(o->L, o->at); /* the old one is garbage now */
    o->p = p;
    o->cap = cap;
  }
  return o->p + o->n;
}

static void put(struct out *o, const char *s, size_t len) {
  memcpy(room(o, len), s, len);
  o->n += len;
}

/* The value as tally.format's int_text writes an integer (a string is a
 * value the Lua side wrote itself: a float, a 64-bit cdata), then the
 * line's end. */
static void put_value(lua_State *L, struct out *o, int values, lua_Integer i) {
  char num[32];
  int n = -1;
  size_t len = 0;
  const char *s = NULL;
  lua_rawgeti(L, values, i);
#if LUA_VERSION_NUM >= 503
  if (lua_isinteger(L, -1))
    n = snprintf(num, sizeof num, "%" PRId64, (int64_t)lua_tointeger(L, -1));
#else
  if (lua_type(L, -1) == LUA_TNUMBER) { /* an integral double within 2^53 */
    lua_Number v = lua_tonumber(L, -1);
    n = snprintf(num, sizeof num, "%.0f", v == 0 ? 0.0 : (double)v);
  }
#endif
  if (n < 0 && lua_type(L, -1) == LUA_TSTRING) s = lua_tolstring(L, -1, &len);
  if (n < 0 && !s)
    luaL_error(L, "_prom_lines: values[%d] is not an integer or a string", (int)i);
  if (n >= 0)
    put(o, num, (size_t)n);
  else
    put(o, s, len); /* may grow, which pushes nothing: s is still on the stack */
  lua_pop(L, 1);
  put(o, "\n", 1);
}

/* The text, in a userdata at stack slot `at` (the top + 1). */
static void out_open(lua_State *L, struct out *o, int at, size_t cap) {
  *o = (struct out){L, at, NULL, 0, cap > 4096 ? cap : 4096, NULL};
  o->p = (char *)lua_newuserdata(L, o->cap);
}

/* The text, in k's memory. */
static void out_kept(lua_State *L, struct out *o, struct keep *k, size_t cap) {
  *o = (struct out){L, 0, k->p, 0, k->cap, k};
  room(o, cap > 4096 ? cap : 4096);
}

/* names[i] pushed, and its bytes; NULL if it is not a string. */
static const char *name_at(lua_State *L, int names, lua_Integer i, size_t *len) {
  lua_rawgeti(L, names, i);
  return lua_type(L, -1) == LUA_TSTRING ? lua_tolstring(L, -1, len) : NULL;
}

/* A line's series: prefix .. the label value (the name, escaped) ..
 * '"} ', or hex_prefix and the name's bytes in hex where it is not UTF-8. */
struct prefixes {
  const char *text, *hex;
  size_t len, hlen;
};

static void put_series(struct out *o, const struct prefixes *p, const char *name,
                       size_t len) {
  int utf8 = tally_utf8_len(name, len, NULL) >= 0;
  size_t k = utf8 ? p->len : p->hlen;
  char *w = room(o, k + 2 * len + 3); /* the name escaped is at most twice as long */
  memcpy(w, utf8 ? p->text : p->hex, k);
  k += utf8 ? put_label_value(w + k, name, len)
            : put_hex(w + k, (const unsigned char *)name, len);
  memcpy(w + k, "\"} ", 3);
  o->n += k + 3;
}

/* core._prom_lines(prefix, hex_prefix, names, values, n [, head, tail])
 * -> text: for i = 1..n, prefix .. the label value .. '"} ' .. values[i]
 * .. "\n", the label value being names[i] without its first head and last
 * tail bytes (a family's one wildcard), escaped; or hex_prefix and those
 * bytes in hex where they are not UTF-8. */
static int tl_prom_lines(lua_State *L) {
  struct prefixes p;
  p.text = luaL_checklstring(L, 1, &p.len);
  p.hex = luaL_checklstring(L, 2, &p.hlen);
  luaL_checktype(L, 3, LUA_TTABLE);
  luaL_checktype(L, 4, LUA_TTABLE);
  lua_Integer n = luaL_checkinteger(L, 5);
  size_t head = (size_t)luaL_optinteger(L, 6, 0), tail = (size_t)luaL_optinteger(L, 7, 0);
  lua_settop(L, 7);
  struct out o;
  out_open(L, &o, 8, 0);
  for (lua_Integer i = 1; i <= n; i++) {
    size_t len;
    const char *name = name_at(L, 3, i, &len);
    if (!name || len < head + tail)
      return luaL_error(L, "_prom_lines: names[%d] is not a string of %d bytes or more",
                        (int)i, (int)(head + tail));
    put_series(&o, &p, name + head, len - head - tail);
    lua_pop(L, 1);
    put_value(L, &o, 4, i);
  }
  lua_pushlstring(L, o.p, o.n);
  return 1;
}

/* A string a table on the stack holds: a pattern's piece, a label prefix. */
struct piece {
  const char *s;
  size_t len;
};

static int strings_of(lua_State *L, int t, struct piece *out, int n, const char *what) {
  for (int i = 0; i < n; i++) {
    lua_rawgeti(L, t, i + 1);
    if (lua_type(L, -1) != LUA_TSTRING)
      return luaL_error(L, "_prom_split_lines: %s[%d] is not a string", what, i + 1);
    out[i].s = lua_tolstring(L, -1, &out[i].len);
    lua_pop(L, 1); /* still referenced by the table, which stays on the stack */
  }
  return 0;
}

/* Where the piece first lies whole in s[from, to), or NULL. */
static const char *find_in(const char *s, size_t from, size_t to, struct piece p) {
  if (p.len == 0) return s + from;
  if (to - from < p.len) return NULL;
  const char *end = s + to - p.len;
  for (const char *at = s + from; at <= end; at++) {
    at = (const char *)memchr(at, p.s[0], (size_t)(end - at) + 1);
    if (!at) return NULL;
    if (memcmp(at, p.s, p.len) == 0) return at;
  }
  return NULL;
}

#define SPLIT_MAX 64 /* pieces of a pattern: a name is at most 255 bytes */

/* core._prom_split_lines(metric, prefixes, pieces, names, values, n)
 * -> text: for i = 1..n, metric, then for each '*' its prefix
 * ('{route="', ',status="') .. what it matched, escaped .. '"', then '} '
 * .. values[i] .. "\n". pieces are the pattern's literal pieces around
 * its stars (at least 3: two stars or more), each in the place
 * lua/tally/prometheus.lua's glob_captures gives it (the middle ones
 * leftmost); the caller has checked that every name matches in exactly
 * one way and is UTF-8, and that the pieces are. */
static int tl_prom_split_lines(lua_State *L) {
  size_t mlen;
  const char *metric = luaL_checklstring(L, 1, &mlen);
  luaL_checktype(L, 2, LUA_TTABLE);
  luaL_checktype(L, 3, LUA_TTABLE);
  luaL_checktype(L, 4, LUA_TTABLE);
  luaL_checktype(L, 5, LUA_TTABLE);
  lua_Integer n = luaL_checkinteger(L, 6);
  int k = (int)lua_rawlen(L, 3);
  if (k < 3 || k > SPLIT_MAX || (int)lua_rawlen(L, 2) != k - 1)
    return luaL_error(L, "_prom_split_lines: %d pieces and %d prefixes", k,
                      (int)lua_rawlen(L, 2));
  struct piece piece[SPLIT_MAX], prefix[SPLIT_MAX];
  strings_of(L, 3, piece, k, "pieces");
  strings_of(L, 2, prefix, k - 1, "prefixes");
  size_t fixed = 0, labels = 0;
  for (int j = 0; j < k; j++) fixed += piece[j].len;
  for (int j = 0; j < k - 1; j++) labels += prefix[j].len + 1;
  lua_settop(L, 6);
  struct out o;
  out_open(L, &o, 7, 0);
  for (lua_Integer i = 1; i <= n; i++) {
    size_t len;
    const char *name = name_at(L, 4, i, &len);
    if (!name || len < fixed || memcmp(name, piece[0].s, piece[0].len) != 0 ||
        memcmp(name + len - piece[k - 1].len, piece[k - 1].s, piece[k - 1].len) != 0)
      return luaL_error(L, "_prom_split_lines: names[%d] does not match", (int)i);
    size_t last_at = len - piece[k - 1].len;
    char *w = room(&o, mlen + labels + 2 * len + 2);
    memcpy(w, metric, mlen);
    size_t at = mlen, pos = piece[0].len;
    for (int j = 1; j < k; j++) {
      const char *a = j < k - 1 ? find_in(name, pos, last_at, piece[j]) : name + last_at;
      if (!a) return luaL_error(L, "_prom_split_lines: names[%d] does not match", (int)i);
      memcpy(w + at, prefix[j - 1].s, prefix[j - 1].len);
      at += prefix[j - 1].len;
      at += put_label_value(w + at, name + pos, (size_t)(a - name) - pos);
      w[at++] = '"';
      pos = (size_t)(a - name) + piece[j].len;
    }
    memcpy(w + at, "} ", 2);
    o.n += at + 2;
    lua_pop(L, 1);
    put_value(L, &o, 5, i);
  }
  lua_pushlstring(L, o.p, o.n);
  return 1;
}

/* ---- a scrape's counters: one walk, in name order, no handle -------------- */

/* core._prom_rows(db [, pattern]) reads the matching counters (24 bytes
 * each, value and merge key among them, and the name; no Lua value per
 * counter). tally.prometheus hands the Lua side only what it decides
 * (names ending in '}', which may be histogram members; values beyond
 * int64) and takes the default metric's lines in chunks written here,
 * so a scrape of a million counters makes no million strings and can be
 * sent as it is made. They come from a tally_walk by name,
 * rows:collect(slots) at a time (a host that yields, as tally.openresty
 * does, yields between slices), each slice a sorted run of its own; the
 * runs are merged as the lines are written. One walk of the whole store
 * sorted at once took longer: its values were read in the names' order,
 * all over the store, where a slice reads them in the index's, and sorts
 * what it read while it is in cache. A name twice (dropped and made
 * again between two slices) is written once, as read last. */
#define TL_PROMROWS_MT "tally.promrows"

enum { ROW_OUT = 1, ROW_TEXT = 2, ROW_RANGE = 4 };

struct prow {
  uint32_t off;  /* its name in names */
  uint8_t len;   /* names are 1 to 255 bytes */
  uint8_t flags; /* ROW_* */
  int64_t value; /* when neither ROW_TEXT nor ROW_RANGE */
  uint64_t key;  /* the merge: the name's 8 bytes after what all share */
};

typedef struct tl_promrows {
  struct prow *row;
  size_t n, cap;
  char *names;
  size_t used, room;
  int failed;       /* out of memory during a walk */
  tally_walk *walk; /* while collecting */
  size_t *run;      /* where each run begins, then n */
  size_t nrun, runcap;
  size_t *heap, nheap; /* the merge: the runs' next rows, least first */
  size_t *at;          /* per run: its next row */
  size_t shared;       /* the bytes every name begins with: compared by key */
  size_t keyed;        /* rows from here on have their key at shared */
  size_t *special;     /* rows whose name ends in '}' or whose value is beyond int64 */
  size_t nspecial, specialcap;
  size_t excluded; /* rows marked ROW_OUT */
  int merging;
  int closed; /* rows:close() ran */
  struct keep keep;
} tl_promrows;

/* Room for cap rows and room bytes of names, at least; 0, or -1 (what
 * was there stays). */
static int rows_reserve(tl_promrows *t, size_t cap, size_t room) {
  struct prow *row = cap > t->cap ? realloc(t->row, cap * sizeof *row) : t->row;
  if (row && cap > t->cap) t->row = row, t->cap = cap;
  char *names = room > t->room ? realloc(t->names, room) : t->names;
  if (names && room > t->room) t->names = names, t->room = room;
  return row && names ? 0 : -1;
}

/* What the Lua side decides for a row (a histogram's member, maybe; a
 * value beyond int64) is listed as the row is read, and the merge's key
 * made then: no pass over every row stands between the last slice and
 * the first lines, a step that a host that yields could not cut. */
static int rows_add(void *ud, const tally_row *r) {
  tl_promrows *t = (tl_promrows *)ud;
  if (t->n == t->cap || t->used + r->name_len > t->room) {
    size_t cap = t->n == t->cap ? (t->cap ? t->cap * 2 : 4096) : t->cap;
    size_t room =
        t->used + r->name_len > t->room ? (t->room ? t->room * 2 : 65536) : t->room;
    if (rows_reserve(t, cap, room)) {
      t->failed = 1;
      return 1; /* stops the walk */
    }
  }
  if (t->used > UINT32_MAX - TALLY_NAME_MAX) {
    t->failed = 1;
    return 1;
  }
  if (r->value_rc || r->name[r->name_len - 1] == '}') {
    if (t->nspecial == t->specialcap) {
      size_t cap = t->specialcap ? t->specialcap * 2 : 64;
      size_t *sp = realloc(t->special, cap * sizeof *sp);
      if (!sp) {
        t->failed = 1;
        return 1;
      }
      t->special = sp, t->specialcap = cap;
    }
    t->special[t->nspecial++] = t->n;
  }
  /* the prefix all names share: the first name's, as far as each agrees */
  size_t k = 0;
  if (t->n == 0)
    t->shared = k = r->name_len;
  else
    while (k < t->shared && k < r->name_len && t->names[k] == r->name[k]) k++;
  if (k < t->shared) t->shared = k, t->keyed = t->n; /* the keys before: too deep */
  memcpy(t->names + t->used, r->name, r->name_len);
  t->row[t->n++] = (struct prow){
      (uint32_t)t->used, (uint8_t)r->name_len, (uint8_t)(r->value_rc ? ROW_RANGE : 0),
      r->value_rc ? 0 : r->value, tally__name_bytes(r->name, r->name_len, t->shared)};
  t->used += r->name_len;
  return 0;
}

/* Name order, bytewise, a name before any longer one it begins (names
 * hold no NUL: the keys, zeros past a name's end, keep that order); rows
 * of one name by the order they were read. The merge compares the keys
 * (the 8 bytes after the prefix every name shares) and only names that tie
 * on them: each comparison of names was a cache miss in a run elsewhere. */
static int name_cmp(const tl_promrows *t, const struct prow *x, const struct prow *y) {
  if (x->key != y->key) return x->key < y->key ? -1 : 1;
  size_t from = t->shared + 8;
  if (x->len <= from || y->len <= from) return (x->len > y->len) - (x->len < y->len);
  size_t xl = x->len - from, yl = y->len - from;
  int c = memcmp(t->names + x->off + from, t->names + y->off + from, xl < yl ? xl : yl);
  return c ? c : (xl > yl) - (xl < yl);
}

static int row_cmp(const tl_promrows *t, size_t a, size_t b) {
  int c = name_cmp(t, &t->row[a], &t->row[b]);
  return c ? c : (a > b) - (a < b);
}

/* The rows from run's start on are a run (sorted by the walk): recorded. */
static int run_end(tl_promrows *t, size_t start) {
  if (t->nrun + 2 > t->runcap) {
    size_t cap = t->runcap ? t->runcap * 2 : 64;
    size_t *run = realloc(t->run, cap * sizeof *run);
    if (!run) return t->failed = 1;
    t->run = run, t->runcap = cap;
  }
  if (t->n == start) return 0;
  t->run[t->nrun++] = start;
  t->run[t->nrun] = t->n;
  return 0;
}

static tl_promrows *rows_check(lua_State *L) {
  tl_promrows *t = (tl_promrows *)luaL_checkudata(L, 1, TL_PROMROWS_MT);
  if (t->closed) luaL_error(L, "the scrape's rows are closed");
  return t;
}

/* A row index argument, 1-based, as a 0-based index. */
static size_t row_arg(lua_State *L, const tl_promrows *t, int arg) {
  lua_Integer i = luaL_checkinteger(L, arg);
  luaL_argcheck(L, i >= 1 && (size_t)i <= t->n, arg, "no such row");
  return (size_t)i - 1;
}

/* core._prom_rows(db [, pattern]) -> rows, or nil, message, code;
 * rows:collect reads them. */
static int tl_prom_rows(lua_State *L) {
  tl_store *d = tl_checkstore(L, 1);
  size_t plen = 0;
  const char *pattern = lua_isnoneornil(L, 2) ? NULL : luaL_checklstring(L, 2, &plen);
  tl_promrows *t = (tl_promrows *)tl_newud(L, sizeof *t, 1);
  memset(t, 0, sizeof *t);
  luaL_setmetatable(L, TL_PROMROWS_MT);
  lua_newtable(L); /* the values the Lua side wrote: by row */
  tl_setuv(L, -2, 1);
  int rc = tally_walk_open(d->store, pattern, plen, TALLY_ROWS_BY_NAME, &t->walk);
  if (rc < 0) return tl_fail(L, rc);
  return 1;
}

/* rows:collect(slots) -> true once every counter is read; false while
 * some remain (the next `slots` slots of the index read), or nil,
 * message, code */
static int rows_collect(lua_State *L) {
  tl_promrows *t = rows_check(L);
  lua_Integer slots = luaL_checkinteger(L, 2);
  luaL_argcheck(L, slots >= 1, 2, "positive count expected");
  if (!t->walk) {
    lua_pushboolean(L, 1);
    return 1;
  }
  size_t start = t->n;
  int rc = tally_walk_next(t->walk, (uint64_t)slots, rows_add, t);
  if (!t->failed && rc >= 0) run_end(t, start);
  if (!t->failed && rc == 0 && start == 0 && t->n) {
    /* room for what the first slice says the whole holds, and an eighth:
     * grown by doubling, the rows were copied again and again, into new
     * pages each time (a fifth of a scrape of a million on the VM) */
    uint64_t passed, all;
    tally_walk_progress(t->walk, &passed, &all);
    double whole = (double)all / (double)passed * 1.125;
    if (whole * (double)t->n < (double)(SIZE_MAX / 2 / sizeof *t->row) &&
        whole * (double)t->used < (double)UINT32_MAX)
      rows_reserve(t, (size_t)(whole * (double)t->n),
                   (size_t)(whole * (double)t->used)); /* or grow as they come */
  }
  if (t->failed || rc < 0 || rc == 1) {
    tally_walk_close(t->walk);
    t->walk = NULL;
  }
  if (t->failed)
    return tl_fail_msg(L, TALLY_ENOMEM, "not enough memory for a scrape's rows");
  if (rc < 0) return tl_fail(L, rc);
  lua_pushboolean(L, rc == 1);
  return 1;
}

/* rows:count() -> how many, and how many not left out */
static int rows_count(lua_State *L) {
  tl_promrows *t = rows_check(L);
  lua_pushinteger(L, (lua_Integer)t->n);
  lua_pushinteger(L, (lua_Integer)(t->n - t->excluded));
  return 2;
}

/* rows:special() -> { i... }, { name... }, { beyond... }: the rows whose
 * name ends in '}' (a histogram's member, maybe) or whose value is beyond
 * int64 (beyond[k] true) */
static int rows_special(lua_State *L) {
  tl_promrows *t = rows_check(L);
  lua_settop(L, 1);
  lua_newtable(L);
  lua_newtable(L);
  lua_newtable(L);
  lua_Integer k = 0;
  for (size_t j = 0; j < t->nspecial; j++) {
    size_t i = t->special[j];
    const struct prow *r = &t->row[i];
    k++;
    lua_pushinteger(L, (lua_Integer)i + 1);
    lua_rawseti(L, 2, k);
    lua_pushlstring(L, t->names + r->off, r->len);
    lua_rawseti(L, 3, k);
    lua_pushboolean(L, (r->flags & ROW_RANGE) != 0);
    lua_rawseti(L, 4, k);
  }
  return 3;
}

/* rows:exclude(i): row i is not a counter line (a histogram's member) */
static int rows_exclude(lua_State *L) {
  tl_promrows *t = rows_check(L);
  struct prow *r = &t->row[row_arg(L, t, 2)];
  t->excluded += !(r->flags & ROW_OUT);
  r->flags |= ROW_OUT;
  return 0;
}

/* rows:set_text(i, text): row i's value, as the Lua side writes it (a
 * sum beyond int64 as a float) */
static int rows_set_text(lua_State *L) {
  tl_promrows *t = rows_check(L);
  size_t i = row_arg(L, t, 2);
  luaL_checktype(L, 3, LUA_TSTRING);
  tl_getuv(L, 1, 1);
  lua_pushvalue(L, 3);
  lua_rawseti(L, -2, (lua_Integer)i + 1);
  t->row[i].flags = (uint8_t)((t->row[i].flags & ~ROW_RANGE) | ROW_TEXT);
  return 0;
}

/* ---- the merge of the runs: rows in name order, each name once ---------- */

static void sift(tl_promrows *t, size_t i) {
  for (;;) {
    size_t l = 2 * i + 1, r = l + 1, m = i;
    if (l < t->nheap && row_cmp(t, t->at[t->heap[l]], t->at[t->heap[m]]) < 0) m = l;
    if (r < t->nheap && row_cmp(t, t->at[t->heap[r]], t->at[t->heap[m]]) < 0) m = r;
    if (m == i) return;
    size_t x = t->heap[i];
    t->heap[i] = t->heap[m];
    t->heap[m] = x;
    i = m;
  }
}

/* The keys made before the shared prefix last shrank, made again (the
 * first few rows, unless a name far from the others came late). */
static void keys_fill(tl_promrows *t) {
  for (size_t i = 0; i < t->keyed; i++)
    t->row[i].key = tally__name_bytes(t->names + t->row[i].off, t->row[i].len, t->shared);
  t->keyed = 0;
}

static int merge_start(tl_promrows *t) {
  if (t->merging) return 0;
  t->heap = malloc((t->nrun + 1) * sizeof *t->heap);
  t->at = malloc((t->nrun + 1) * sizeof *t->at);
  if (!t->heap || !t->at) {
    free(t->heap), free(t->at);
    t->heap = NULL, t->at = NULL;
    return -1;
  }
  keys_fill(t);
  t->nheap = 0;
  for (size_t k = 0; k < t->nrun; k++) {
    t->at[k] = t->run[k];
    t->heap[t->nheap++] = k;
  }
  for (size_t i = t->nheap; i-- > 0;) sift(t, i);
  t->merging = 1;
  return 0;
}

/* The next row in name order, not left out, the last read of its name;
 * SIZE_MAX when none is left. */
static size_t merge_next(tl_promrows *t) {
  while (t->nheap) {
    size_t k = t->heap[0], i = t->at[k]++;
    if (t->at[k] == t->run[k + 1]) t->heap[0] = t->heap[--t->nheap];
    sift(t, 0);
    /* the next row has the same name: this one was read earlier */
    if (t->nheap && name_cmp(t, &t->row[i], &t->row[t->at[t->heap[0]]]) == 0) continue;
    if (t->row[i].flags & ROW_OUT) continue;
    return i;
  }
  return SIZE_MAX;
}

/* Push row i's value: an integer, or the text set for it (the table of
 * texts at `texts`). */
static void push_row_value(lua_State *L, const tl_promrows *t, size_t i, int texts) {
  const struct prow *r = &t->row[i];
  if (r->flags & ROW_RANGE)
    luaL_error(L, "row %d: a value beyond int64 without its text", (int)i + 1);
  if (r->flags & ROW_TEXT)
    lua_rawgeti(L, texts, (lua_Integer)i + 1);
  else
    tl_pushint64(L, r->value);
}

static lua_Integer count_arg(lua_State *L, int arg) {
  lua_Integer n = luaL_checkinteger(L, arg);
  luaL_argcheck(L, n >= 1, arg, "positive count expected");
  return n;
}

/* rows:names(n) -> names, values, k, more: the next k (<= n) rows in
 * name order, as tally.format's renderer takes them; more: some left */
static int rows_names(lua_State *L) {
  tl_promrows *t = rows_check(L);
  lua_Integer n = count_arg(L, 2);
  if (merge_start(t)) return luaL_error(L, "not enough memory");
  lua_settop(L, 2);
  tl_getuv(L, 1, 1); /* 3 */
  lua_newtable(L);   /* 4 */
  lua_newtable(L);   /* 5 */
  lua_Integer k = 0;
  size_t i = 0;
  while (k < n && (i = merge_next(t)) != SIZE_MAX) {
    k++;
    lua_pushlstring(L, t->names + t->row[i].off, t->row[i].len);
    lua_rawseti(L, 4, k);
    push_row_value(L, t, i, 3);
    lua_rawseti(L, 5, k);
  }
  lua_pushinteger(L, k);
  lua_pushboolean(L, t->nheap > 0);
  return 4;
}

/* rows:lines(n, prefix, hex_prefix [, head, tail]) -> text, more: the
 * default metric's lines (_prom_lines') of the next n rows in name order,
 * after head and before tail; more: some left. All of them with head and
 * tail: a whole scrape's text made in one buffer, copied once. */
static int rows_lines(lua_State *L) {
  tl_promrows *t = rows_check(L);
  lua_Integer n = count_arg(L, 2);
  size_t hlen = 0, tlen = 0;
  struct prefixes p;
  p.text = luaL_checklstring(L, 3, &p.len);
  p.hex = luaL_checklstring(L, 4, &p.hlen);
  const char *head = luaL_optlstring(L, 5, "", &hlen);
  const char *tail = luaL_optlstring(L, 6, "", &tlen);
  if (merge_start(t)) return luaL_error(L, "not enough memory");
  lua_settop(L, 6);
  tl_getuv(L, 1, 1); /* 7 */
  size_t guess = hlen + tlen, rows = t->n < (size_t)n ? t->n : (size_t)n;
  guess += rows * (p.len + 40); /* most lines */
  struct out o;
  out_kept(L, &o, &t->keep, guess);
  put(&o, head, hlen);
  size_t i = 0;
  for (lua_Integer k = 0; k < n && (i = merge_next(t)) != SIZE_MAX; k++) {
    const struct prow *r = &t->row[i];
    put_series(&o, &p, t->names + r->off, r->len);
    if (r->flags & (ROW_TEXT | ROW_RANGE)) {
      size_t len;
      push_row_value(L, t, i, 7);
      const char *s = lua_tolstring(L, -1, &len);
      put(&o, s, len); /* may grow, which pushes nothing: s is still on the stack */
      lua_pop(L, 1);
      put(&o, "\n", 1);
    } else {
      char num[32];
      int len = snprintf(num, sizeof num, "%" PRId64 "\n", r->value);
      put(&o, num, (size_t)len);
    }
  }
  put(&o, tail, tlen);
  lua_pushlstring(L, o.p, o.n);
  lua_pushboolean(L, t->nheap > 0);
  return 2;
}

static int rows_close(lua_State *L) {
  tl_promrows *t = (tl_promrows *)luaL_checkudata(L, 1, TL_PROMROWS_MT);
  if (t->walk) tally_walk_close(t->walk);
  free(t->row);
  free(t->names);
  free(t->run);
  free(t->heap);
  free(t->at);
  free(t->special);
  free(t->keep.p);
  memset(t, 0, sizeof *t);
  t->closed = 1;
  return 0;
}

static const luaL_Reg rows_methods[] = {
    {"collect", rows_collect}, {"count", rows_count},       {"special", rows_special},
    {"exclude", rows_exclude}, {"set_text", rows_set_text}, {"names", rows_names},
    {"lines", rows_lines},     {"close", rows_close},       {NULL, NULL}};
static const luaL_Reg rows_meta[] = {
    {"__gc", rows_close}, {"__close", rows_close}, {NULL, NULL}};

int tl_open_exposition(lua_State *L) {
  lua_pushcfunction(L, tl_prom_lines);
  lua_setfield(L, -2, "_prom_lines");
  lua_pushcfunction(L, tl_prom_split_lines);
  lua_setfield(L, -2, "_prom_split_lines");
  tl_newclass(L, TL_PROMROWS_MT, rows_meta, rows_methods);
  lua_pop(L, 1);
  lua_pushcfunction(L, tl_prom_rows);
  lua_setfield(L, -2, "_prom_rows");
  return 0;
}
