/* lua_exposition.c -- exposition lines written in C, many at once.
 *
 * tally.prometheus exposes every counter that no family maps as one series
 * of tally_value, labelled with its name, and those of a family with one
 * '*' as a series labelled with what the '*' matched: a store of a million
 * cold counters is a million such lines. Written in Lua, each line was
 * three new strings (the series, the value, the line) and the whole
 * exposition took 7 to 9 s; here the lines go into one buffer. The
 * mapping, the checks and the order stay in Lua (lua/tally/format.lua),
 * which hands over the names and values of these lines only.
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

/* The value as tally.format's int_text writes an integer; a string is a
 * value the Lua side wrote itself (a float, a 64-bit cdata). */
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
  struct out o = {L, 8, NULL, 0, 4096};
  o.p = (char *)lua_newuserdata(L, o.cap);
  for (lua_Integer i = 1; i <= n; i++) {
    size_t len;
    lua_rawgeti(L, 3, i);
    const char *name = lua_type(L, -1) == LUA_TSTRING ? lua_tolstring(L, -1, &len) : NULL;
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
    put(&o, "\n", 1);
  }
  lua_pushlstring(L, o.p, o.n);
  return 1;
}

int tl_open_exposition(lua_State *L) {
  lua_pushcfunction(L, tl_prom_lines);
  lua_setfield(L, -2, "_prom_lines");
  return 0;
}
