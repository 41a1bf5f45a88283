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
 * and the order stay in Lua (lua/tally/format.lua), which hands over the
 * names and values of these lines only.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "lua_aux.h"

/* Is s UTF-8 as utf8.len reads it (strict): no overlong form, no
 * surrogate, nothing past U+10FFFF? */
static int utf8_valid(const unsigned char *s, size_t len) {
  size_t i = 0;
  while (i < len) {
    unsigned c = s[i], n;
    uint32_t cp, least;
    if (c < 0x80) {
      i++;
      continue;
    }
    if (c >= 0xC2 && c < 0xE0) {
      n = 1, cp = c & 0x1F, least = 0x80;
    } else if (c >= 0xE0 && c < 0xF0) {
      n = 2, cp = c & 0x0F, least = 0x800;
    } else if (c >= 0xF0 && c < 0xF5) {
      n = 3, cp = c & 0x07, least = 0x10000;
    } else {
      return 0;
    }
    if (len - i <= n) return 0;
    for (unsigned k = 1; k <= n; k++) {
      if ((s[i + k] & 0xC0) != 0x80) return 0;
      cp = cp << 6 | (s[i + k] & 0x3F);
    }
    if (cp < least || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
    i += n + 1;
  }
  return 1;
}

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
static void out_open(lua_State *L, struct out *o, int at) {
  *o = (struct out){L, at, NULL, 0, 4096};
  o->p = (char *)lua_newuserdata(L, o->cap);
}

/* names[i] pushed, and its bytes; NULL if it is not a string. */
static const char *name_at(lua_State *L, int names, lua_Integer i, size_t *len) {
  lua_rawgeti(L, names, i);
  return lua_type(L, -1) == LUA_TSTRING ? lua_tolstring(L, -1, len) : NULL;
}

/* core._prom_lines(prefix, hex_prefix, names, values, n [, head, tail])
 * -> text: for i = 1..n, prefix .. the label value .. '"} ' .. values[i]
 * .. "\n", the label value being names[i] without its first head and last
 * tail bytes (a family's one wildcard), escaped; or hex_prefix and those
 * bytes in hex where they are not UTF-8. */
static int tl_prom_lines(lua_State *L) {
  size_t plen, hlen;
  const char *prefix = luaL_checklstring(L, 1, &plen);
  const char *hex_prefix = luaL_checklstring(L, 2, &hlen);
  luaL_checktype(L, 3, LUA_TTABLE);
  luaL_checktype(L, 4, LUA_TTABLE);
  lua_Integer n = luaL_checkinteger(L, 5);
  size_t head = (size_t)luaL_optinteger(L, 6, 0), tail = (size_t)luaL_optinteger(L, 7, 0);
  lua_settop(L, 7);
  struct out o;
  out_open(L, &o, 8);
  for (lua_Integer i = 1; i <= n; i++) {
    size_t len;
    const char *name = name_at(L, 3, i, &len);
    if (!name || len < head + tail)
      return luaL_error(L, "_prom_lines: names[%d] is not a string of %d bytes or more",
                        (int)i, (int)(head + tail));
    name += head;
    len -= head + tail;
    int utf8 = utf8_valid((const unsigned char *)name, len);
    size_t k = utf8 ? plen : hlen;
    char *w = room(&o, k + 2 * len + 3); /* the name escaped is at most twice as long */
    memcpy(w, utf8 ? prefix : hex_prefix, k);
    k += utf8 ? put_label_value(w + k, name, len)
              : put_hex(w + k, (const unsigned char *)name, len);
    memcpy(w + k, "\"} ", 3);
    o.n += k + 3;
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
 * lua/tally/format.lua's glob_captures gives it (the middle ones
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
  out_open(L, &o, 7);
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

int tl_open_exposition(lua_State *L) {
  lua_pushcfunction(L, tl_prom_lines);
  lua_setfield(L, -2, "_prom_lines");
  lua_pushcfunction(L, tl_prom_split_lines);
  lua_setfield(L, -2, "_prom_split_lines");
  return 0;
}
