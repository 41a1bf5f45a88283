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
 * duplicates, which such a family cannot have. Lists of samples
 * (tally.format.prometheus, the sinks) are mapped in Lua
 * (lua/tally/prometheus.lua), which hands over the names and values of
 * these lines only. A store's scrape is the core's walk (exposition.c),
 * whose rows are mapped here as they are merged (rows:map): the lines of
 * such families and of the default metric are written here, and only the
 * rows of other families come to Lua.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/text.h"
#include "lua_aux.h"

/* The text grows in a full userdata at stack slot `at`, so a memory error
 * on the way frees it as any Lua value. Not a luaL_Buffer: LuaJIT's (Lua
 * 5.1's) keeps a long text as pieces on the stack that it concatenates
 * again and again, and a million lines took 64 s there. */
struct out {
  lua_State *L;
  int at;
  char *p;
  size_t n, cap;
};

/* Room for k more bytes; returns where they go. */
static char *room(struct out *o, size_t k) {
  if (o->cap - o->n < k) {
    size_t cap = o->cap * 2 > o->n + k ? o->cap * 2 : o->n + k;
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
  *o = (struct out){L, at, NULL, 0, cap > 4096 ? cap : 4096};
  o->p = (char *)lua_newuserdata(L, o->cap);
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
  size_t k = p->len > p->hlen ? p->len : p->hlen;
  char *w = room(o, k + 2 * len + 3); /* the name escaped is at most twice as long */
  o->n += tally__series(w, p->text, p->len, p->hex, p->hlen, name, len);
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

static int strings_of(lua_State *L, int t, struct piece *out, int n, const char *who,
                      const char *what) {
  for (int i = 0; i < n; i++) {
    lua_rawgeti(L, t, i + 1);
    if (lua_type(L, -1) != LUA_TSTRING)
      return luaL_error(L, "%s: %s[%d] is not a string", who, what, i + 1);
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

/* A family of '*'s only (no '?'), its literal pieces around them: where
 * each piece lies in name (at[j], from its start), the first at the
 * start, the last at the end, the middle ones leftmost (where
 * lua/tally/prometheus.lua's glob_captures places them); 0 if name does
 * not match. */
static int split_place(const struct piece *piece, int k, const char *name, size_t len,
                       size_t *at) {
  size_t first = piece[0].len, last = piece[k - 1].len;
  if (len < first + last || memcmp(name, piece[0].s, first) != 0 ||
      memcmp(name + len - last, piece[k - 1].s, last) != 0)
    return 0;
  size_t last_at = len - last, pos = first;
  at[0] = 0;
  for (int j = 1; j < k - 1; j++) {
    const char *a = find_in(name, pos, last_at, piece[j]);
    if (!a) return 0;
    at[j] = (size_t)(a - name);
    pos = at[j] + piece[j].len;
  }
  at[k - 1] = last_at;
  return 1;
}

/* Whether name, placed by split_place, matches in more than one way:
 * the middle pieces placed rightmost, from the end, move (prometheus.lua's
 * moves_right). */
static int split_ambiguous(const struct piece *piece, int k, const char *name,
                           const size_t *at) {
  size_t limit = at[k - 1];
  for (int j = k - 2; j >= 1; j--) {
    size_t a = limit - piece[j].len;
    if (piece[j].len > 0)
      while (a > at[j] && memcmp(name + a, piece[j].s, piece[j].len) != 0) a--;
    if (a != at[j]) return 1;
    limit = a;
  }
  return 0;
}

/* The series of name, placed by split_place, into w: metric, then for
 * each '*' its prefix ('{route="', ',status="') .. what it matched,
 * escaped .. '"', then '} '. Room: split_room's. */
static size_t split_series(char *w, struct piece metric, const struct piece *prefix,
                           const struct piece *piece, int k, const char *name,
                           const size_t *at) {
  memcpy(w, metric.s, metric.len);
  size_t n = metric.len, pos = piece[0].len;
  for (int j = 1; j < k; j++) {
    memcpy(w + n, prefix[j - 1].s, prefix[j - 1].len);
    n += prefix[j - 1].len;
    n += tally__label_value(w + n, name + pos, at[j] - pos);
    w[n++] = '"';
    pos = at[j] + piece[j].len;
  }
  memcpy(w + n, "} ", 2);
  return n + 2;
}

static size_t split_room(struct piece metric, const struct piece *prefix, int k,
                         size_t len) {
  size_t room = metric.len + 2 * len + 2;
  for (int j = 0; j < k - 1; j++) room += prefix[j].len + 1;
  return room;
}

/* core._prom_split_lines(metric, prefixes, pieces, names, values, n)
 * -> text: for i = 1..n, names[i]'s series (split_series) .. values[i]
 * .. "\n". pieces are the pattern's literal pieces around its stars (at
 * least 3: two stars or more); the caller has checked that every name
 * matches in exactly one way and is UTF-8, and that the pieces are. */
static int tl_prom_split_lines(lua_State *L) {
  struct piece metric;
  metric.s = luaL_checklstring(L, 1, &metric.len);
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
  strings_of(L, 3, piece, k, "_prom_split_lines", "pieces");
  strings_of(L, 2, prefix, k - 1, "_prom_split_lines", "prefixes");
  lua_settop(L, 6);
  struct out o;
  out_open(L, &o, 7, 0);
  for (lua_Integer i = 1; i <= n; i++) {
    size_t len, at[SPLIT_MAX];
    const char *name = name_at(L, 4, i, &len);
    if (!name || !split_place(piece, k, name, len, at))
      return luaL_error(L, "_prom_split_lines: names[%d] does not match", (int)i);
    char *w = room(&o, split_room(metric, prefix, k, len));
    o.n += split_series(w, metric, prefix, piece, k, name, at);
    lua_pop(L, 1);
    put_value(L, &o, 5, i);
  }
  lua_pushlstring(L, o.p, o.n);
  return 1;
}

/* ---- a scrape's counters: one walk, in name order, no handle -------------- */

/* core._prom_rows(db [, pattern]) -> rows: a tally_exposition (the core's
 * exposition.c: the walk, the merge, the default metric's lines).
 * tally.prometheus hands the Lua side only what it decides (names ending
 * in '}', which may be histogram members) and takes the lines in chunks,
 * so a scrape of a million counters makes no million strings and can be
 * sent as it is made; rows:collect(slots) reads a slice at a time (a host
 * that yields, as tally.openresty does, yields between slices). */
#define TL_PROMROWS_MT "tally.promrows"

/* A family the rows are mapped by in C (rows:mapping): its pieces point
 * into the mapping's Lua strings, which the rows' user value keeps. */
enum { MAP_SIMPLE, MAP_SPLIT, MAP_GENERAL };

struct buf {
  char *p;
  size_t n, cap;
};

struct map_entry {
  int kind;
  int k;                /* pieces: SIMPLE 2 (its ends), SPLIT 3 or more */
  struct piece *piece;  /* GENERAL: its pattern */
  struct piece *prefix; /* SIMPLE: 1 (metric{label="), SPLIT: k - 1 */
  struct piece metric;
  struct buf text; /* its lines (SIMPLE, SPLIT: the only entry of its metric) */
};

typedef struct tl_promrows {
  tally_exposition *x;
  int closed; /* rows:close() ran */
  struct map_entry *map;
  int nmap;        /* entries map holds (freed at close) */
  int ready;       /* rows:mapping made them all */
  struct buf text; /* the default metric's lines, mapping */
} tl_promrows;

static tl_promrows *rows_check(lua_State *L) {
  tl_promrows *t = (tl_promrows *)luaL_checkudata(L, 1, TL_PROMROWS_MT);
  if (t->closed) luaL_error(L, "the scrape's rows are closed");
  return t;
}

static int tl_prom_rows(lua_State *L) {
  tl_store *d = tl_checkstore(L, 1);
  size_t plen = 0;
  const char *pattern = lua_isnoneornil(L, 2) ? NULL : luaL_checklstring(L, 2, &plen);
  tl_promrows *t = (tl_promrows *)tl_newud(L, sizeof *t, 1);
  memset(t, 0, sizeof *t);
  luaL_setmetatable(L, TL_PROMROWS_MT);
  int rc = tally_exposition_open(d->store, pattern, plen, &t->x);
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
  int rc = tally_exposition_read(t->x, (uint64_t)slots);
  if (rc < 0) return tl_fail(L, rc);
  lua_pushboolean(L, rc == 1);
  return 1;
}

/* rows:count() -> how many, and how many not left out */
static int rows_count(lua_State *L) {
  tl_promrows *t = rows_check(L);
  uint64_t read, kept;
  tally_exposition_count(t->x, &read, &kept);
  lua_pushinteger(L, (lua_Integer)read);
  lua_pushinteger(L, (lua_Integer)kept);
  return 2;
}

static int push_braced(void *ud, uint64_t row, const char *name, size_t len) {
  lua_State *L = (lua_State *)ud;
  lua_Integer k = (lua_Integer)lua_rawlen(L, 2) + 1;
  lua_pushinteger(L, (lua_Integer)row + 1);
  lua_rawseti(L, 2, k);
  lua_pushlstring(L, name, len);
  lua_rawseti(L, 3, k);
  return 0;
}

/* rows:braced() -> { i... }, { name... }: the rows whose name ends in
 * '}' (a histogram's member, maybe) */
static int rows_braced(lua_State *L) {
  tl_promrows *t = rows_check(L);
  lua_settop(L, 1);
  lua_newtable(L);
  lua_newtable(L);
  tally_exposition_braced(t->x, push_braced, L);
  return 2;
}

/* rows:exclude(i): row i gets no line (a histogram's member) */
static int rows_exclude(lua_State *L) {
  tl_promrows *t = rows_check(L);
  lua_Integer i = luaL_checkinteger(L, 2);
  luaL_argcheck(L, i >= 1 && tally_exposition_leave_out(t->x, (uint64_t)i - 1) == 0, 2,
                "no such row");
  return 0;
}

static lua_Integer count_arg(lua_State *L, int arg) {
  lua_Integer n = luaL_checkinteger(L, arg);
  luaL_argcheck(L, n >= 1, arg, "positive count expected");
  return n;
}

static int push_sample(void *ud, const char *name, size_t len, int64_t value,
                       const char *text, size_t text_len) {
  lua_State *L = (lua_State *)ud;
  lua_Integer k = (lua_Integer)lua_rawlen(L, 3) + 1;
  lua_pushlstring(L, name, len);
  lua_rawseti(L, 3, k);
  if (text)
    lua_pushlstring(L, text, text_len);
  else
    tl_pushint64(L, value);
  lua_rawseti(L, 4, k);
  return 0;
}

/* rows:names(n) -> names, values, k, more: the next k (<= n) rows in
 * name order, as tally.format's renderer takes them (a value beyond
 * int64 as its text); more: some left */
static int rows_names(lua_State *L) {
  tl_promrows *t = rows_check(L);
  lua_Integer n = count_arg(L, 2);
  lua_settop(L, 2);
  lua_newtable(L); /* 3 */
  lua_newtable(L); /* 4 */
  int rc = tally_exposition_rows(t->x, (uint64_t)n, push_sample, L);
  if (rc < 0) return luaL_error(L, "%s", tally_errmsg()); /* not a partial scrape */
  lua_pushinteger(L, (lua_Integer)lua_rawlen(L, 3));
  lua_pushboolean(L, rc == 0);
  return 4;
}

struct piece_at {
  const char *text;
  size_t len;
};

static int piece_take(void *ud, const char *text, size_t len) {
  struct piece_at *p = (struct piece_at *)ud;
  p->text = text, p->len = len; /* x's, until the next call on it */
  return 0;
}

/* rows:lines(n) -> text, more: the default metric's lines of the next n
 * rows in name order (its # HELP and # TYPE before the first); more: some
 * left. All of them at once: a whole scrape's text made in one buffer. */
static int rows_lines(lua_State *L) {
  tl_promrows *t = rows_check(L);
  lua_Integer n = count_arg(L, 2);
  struct piece_at p = {"", 0};
  int rc = tally_exposition_write(t->x, (uint64_t)n, piece_take, &p);
  if (rc < 0) return luaL_error(L, "%s", tally_errmsg()); /* not a partial scrape */
  lua_pushlstring(L, p.text, p.len);
  lua_pushboolean(L, rc == 0);
  return 2;
}

/* ---- families mapped in C ---------------------------------------------- */

static void map_free(tl_promrows *t) {
  for (int i = 0; i < t->nmap; i++) {
    free(t->map[i].piece);
    free(t->map[i].prefix);
    free(t->map[i].text.p);
  }
  free(t->map);
  free(t->text.p);
  t->map = NULL, t->nmap = 0, t->ready = 0;
  t->text = (struct buf){NULL, 0, 0};
}

/* A field of the entry at stack slot t that is a string. The string
 * stays where it is: the entry (a plain table) is the mapping's, which
 * the rows keep. */
static struct piece field_string(lua_State *L, int t, const char *key) {
  struct piece p;
  lua_getfield(L, t, key);
  if (lua_type(L, -1) != LUA_TSTRING)
    luaL_error(L, "rows:mapping: %s is not a string", key);
  p.s = lua_tolstring(L, -1, &p.len);
  lua_pop(L, 1);
  return p;
}

/* n pieces for an entry, zeroed: the entry owns them from now on. */
static struct piece *pieces_new(lua_State *L, struct piece **owner, int n) {
  *owner = calloc((size_t)(n > 0 ? n : 1), sizeof **owner);
  if (!*owner) luaL_error(L, "not enough memory");
  return *owner;
}

/* A field holding an array of n strings, into the entry's pieces *owner. */
static void field_strings(lua_State *L, int t, const char *key, int n,
                          struct piece **owner) {
  lua_getfield(L, t, key);
  if (lua_type(L, -1) != LUA_TTABLE || (int)lua_rawlen(L, -1) != n)
    luaL_error(L, "rows:mapping: %s is not an array of %d strings", key, n);
  strings_of(L, lua_gettop(L), pieces_new(L, owner, n), n, "rows:mapping", key);
  lua_pop(L, 1);
}

/* rows:mapping(entries): the families to map rows by in C, newest
 * first, as prometheus.lua compiles them: { kind = "simple", head =,
 * tail = (the literal ends of a pattern with one '*'), prefix =
 * ('likes{post="') , metric = }, { kind = "split", pieces =, prefixes =,
 * metric = }, { kind = "general", pattern = } (one the Lua side maps).
 * rows:map refuses the rows until a call has succeeded. */
static int rows_mapping(lua_State *L) {
  tl_promrows *t = rows_check(L);
  luaL_checktype(L, 2, LUA_TTABLE);
  lua_settop(L, 2);
  lua_pushvalue(L, 2);
  tl_setuv(L, 1, 1); /* keeps the strings the entries point into */
  map_free(t);
  int n = (int)lua_rawlen(L, 2);
  t->map = calloc((size_t)(n > 0 ? n : 1), sizeof *t->map);
  if (!t->map) return luaL_error(L, "not enough memory");
  for (int i = 0; i < n; i++) {
    struct map_entry *e = &t->map[i];
    t->nmap = i + 1; /* what map_free frees, should this one fail */
    lua_rawgeti(L, 2, i + 1);
    int at = lua_gettop(L);
    luaL_argcheck(L, lua_type(L, at) == LUA_TTABLE, 2, "entries must be tables");
    struct piece kind = field_string(L, at, "kind");
    if (kind.len == 6 && memcmp(kind.s, "simple", 6) == 0) {
      e->kind = MAP_SIMPLE, e->k = 2;
      struct piece *piece = pieces_new(L, &e->piece, 2);
      piece[0] = field_string(L, at, "head");
      piece[1] = field_string(L, at, "tail");
      pieces_new(L, &e->prefix, 1)[0] = field_string(L, at, "prefix");
      e->metric = field_string(L, at, "metric");
    } else if (kind.len == 5 && memcmp(kind.s, "split", 5) == 0) {
      e->kind = MAP_SPLIT;
      lua_getfield(L, at, "pieces");
      e->k = lua_type(L, -1) == LUA_TTABLE ? (int)lua_rawlen(L, -1) : 0;
      lua_pop(L, 1);
      if (e->k < 3 || e->k > SPLIT_MAX)
        return luaL_error(L, "rows:mapping: %d pieces in a split entry", e->k);
      field_strings(L, at, "pieces", e->k, &e->piece);
      field_strings(L, at, "prefixes", e->k - 1, &e->prefix);
      e->metric = field_string(L, at, "metric");
    } else if (kind.len == 7 && memcmp(kind.s, "general", 7) == 0) {
      e->kind = MAP_GENERAL, e->k = 1;
      pieces_new(L, &e->piece, 1)[0] = field_string(L, at, "pattern");
    } else {
      return luaL_error(L, "rows:mapping: unknown kind '%s'", kind.s);
    }
    lua_pop(L, 1);
  }
  t->ready = 1;
  return 0;
}

static char *buf_room(lua_State *L, struct buf *b, size_t k) {
  if (b->cap - b->n < k) {
    size_t cap = b->cap * 2 > b->n + k ? b->cap * 2 : b->n + k;
    if (cap < 4096) cap = 4096;
    char *p = realloc(b->p, cap);
    if (!p) luaL_error(L, "not enough memory");
    b->p = p, b->cap = cap;
  }
  return b->p + b->n;
}

struct map_walk {
  lua_State *L;
  tl_promrows *t;
};

static const char prom_hex_prefix[] = TALLY__PROM_HEX_PREFIX;

/* A row: the line of the first (newest) entry that matches it, written
 * here, or the default metric's (no entry matches, or its name is not
 * UTF-8, which its parts then are not either); a general entry's row, or
 * one a split entry matches in more than one way, goes to decide (the
 * function at stack slot 3), whose true means the default metric's. */
static int map_row(void *ud, const char *name, size_t len, int64_t value,
                   const char *text, size_t text_len) {
  struct map_walk *mw = (struct map_walk *)ud;
  lua_State *L = mw->L;
  tl_promrows *t = mw->t;
  struct buf *out = &t->text;
  size_t at[SPLIT_MAX];
  for (int i = 0; i < t->nmap; i++) {
    struct map_entry *e = &t->map[i];
    int defer = 0;
    if (e->kind == MAP_SIMPLE) {
      size_t head = e->piece[0].len, tail = e->piece[1].len;
      if (len < head + tail || memcmp(name, e->piece[0].s, head) != 0 ||
          memcmp(name + len - tail, e->piece[1].s, tail) != 0)
        continue;
    } else if (e->kind == MAP_SPLIT) {
      if (!split_place(e->piece, e->k, name, len, at)) continue;
      defer = split_ambiguous(e->piece, e->k, name, at);
    } else {
      if (!tally_glob_match(e->piece[0].s, e->piece[0].len, name, len)) continue;
      defer = 1;
    }
    if (defer) {
      lua_pushvalue(L, 3);
      lua_pushlstring(L, name, len);
      if (text)
        lua_pushlstring(L, text, text_len);
      else
        tl_pushint64(L, value);
      lua_call(L, 2, 1);
      int as_default = lua_toboolean(L, -1);
      lua_pop(L, 1);
      if (!as_default) return 0;
    } else if (tally_utf8_len(name, len, NULL) >= 0) {
      out = &e->text;
      if (e->kind == MAP_SIMPLE) {
        size_t head = e->piece[0].len, tail = e->piece[1].len;
        size_t room = e->prefix[0].len + sizeof prom_hex_prefix + 2 * len + 3;
        char *w = buf_room(L, out, room + TALLY__VALUE_ROOM);
        size_t k =
            tally__series(w, e->prefix[0].s, e->prefix[0].len, prom_hex_prefix,
                          sizeof prom_hex_prefix - 1, name + head, len - head - tail);
        out->n += k + tally__line_end(w + k, value, text, text_len);
      } else {
        char *w = buf_room(
            L, out, split_room(e->metric, e->prefix, e->k, len) + TALLY__VALUE_ROOM);
        size_t k = split_series(w, e->metric, e->prefix, e->piece, e->k, name, at);
        out->n += k + tally__line_end(w + k, value, text, text_len);
      }
      return 0;
    }
    break; /* the default metric's line */
  }
  char *w = buf_room(L, out, TALLY__DEFAULT_LINE_ROOM(len));
  out->n += tally__default_line(w, name, len, value, text, text_len);
  return 0;
}

/* rows:map(n, decide) -> more: the next n rows in name order mapped by
 * rows:mapping's entries (map_row); more: some left */
static int rows_map(lua_State *L) {
  tl_promrows *t = rows_check(L);
  lua_Integer n = count_arg(L, 2);
  luaL_checktype(L, 3, LUA_TFUNCTION);
  if (!t->ready) return luaL_error(L, "rows:map before a rows:mapping that succeeded");
  lua_settop(L, 3);
  struct map_walk mw = {L, t};
  int rc = tally_exposition_rows(t->x, (uint64_t)n, map_row, &mw);
  if (rc < 0) return luaL_error(L, "%s", tally_errmsg()); /* not a partial scrape */
  lua_pushboolean(L, rc == 0);
  return 1;
}

/* rows:mapped() -> { [metric] = its lines }: what rows:map wrote, the
 * default metric's under its name (which no family's metric is:
 * db:family refuses it); metrics without lines left out */
static int rows_mapped(lua_State *L) {
  tl_promrows *t = rows_check(L);
  lua_newtable(L);
  if (t->text.n) {
    lua_pushlstring(L, t->text.p, t->text.n);
    lua_setfield(L, -2, TALLY_PROM_METRIC);
  }
  for (int i = 0; i < t->nmap; i++) {
    struct map_entry *e = &t->map[i];
    if (!e->text.n) continue;
    lua_pushlstring(L, e->metric.s, e->metric.len);
    lua_pushlstring(L, e->text.p, e->text.n);
    lua_rawset(L, -3);
  }
  return 1;
}

static int rows_close(lua_State *L) {
  tl_promrows *t = (tl_promrows *)luaL_checkudata(L, 1, TL_PROMROWS_MT);
  tally_exposition_close(t->x);
  map_free(t);
  t->x = NULL;
  t->closed = 1;
  return 0;
}

static const luaL_Reg rows_methods[] = {
    {"collect", rows_collect}, {"count", rows_count}, {"braced", rows_braced},
    {"exclude", rows_exclude}, {"names", rows_names}, {"lines", rows_lines},
    {"mapping", rows_mapping}, {"map", rows_map},     {"mapped", rows_mapped},
    {"close", rows_close},     {NULL, NULL}};
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
  /* the default metric, as the core writes it (tally.h) */
  lua_pushliteral(L, TALLY_PROM_METRIC);
  lua_setfield(L, -2, "PROM_METRIC");
  lua_pushliteral(L, TALLY_PROM_LABEL);
  lua_setfield(L, -2, "PROM_LABEL");
  lua_pushliteral(L, TALLY_PROM_HEX_LABEL);
  lua_setfield(L, -2, "PROM_HEX_LABEL");
  lua_pushliteral(L, TALLY_PROM_HELP);
  lua_setfield(L, -2, "PROM_HELP");
  return 0;
}
