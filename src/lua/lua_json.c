/* lua_json.c -- the first key that a JSON object has twice.
 *
 * lua-cjson keeps the last of a key given twice without a word, so
 * tally.json finds such a key itself. Keys are compared as the bytes they
 * stand for: "a" and "\u0061" are one key, and so are "\u00e9", the raw
 * bytes of é and "\udcc3\udca9" (tally.json's \udcXX stands for the byte
 * XX, 80 to ff, as Python's surrogateescape writes it). One pass reads
 * every key into one buffer with the object it belongs to, then a sort
 * by (object, bytes) puts a key given twice next to its first: no Lua
 * string per key. Made in Lua, each key was a new string (three with
 * escapes), and under LuaJIT, whose string hash reads only a few bytes of
 * a long string, 200,000 names alike in those bytes took minutes.
 */
#include <stdlib.h>
#include <string.h>

#include "lua_aux.h"

/* An array that grows in a full userdata at stack slot `at`, so a memory
 * error on the way frees it as any Lua value. */
struct grow {
  lua_State *L;
  int at;
  char *p;
  size_t n, cap; /* bytes */
};

static void grow_open(lua_State *L, struct grow *g, int at, size_t cap) {
  *g = (struct grow){L, at, NULL, 0, cap};
  g->p = (char *)lua_newuserdata(L, cap);
  lua_replace(L, at);
}

/* Room for k more bytes; returns where they go. */
static void *room(struct grow *g, size_t k) {
  if (g->cap - g->n < k) {
    size_t cap = g->cap * 2 > g->n + k ? g->cap * 2 : g->n + k;
    char *p = (char *)lua_newuserdata(g->L, cap);
    memcpy(p, g->p, g->n);
    lua_replace(g->L, g->at); /* the old one is garbage now */
    g->p = p;
    g->cap = cap;
  }
  return g->p + g->n;
}

struct object {
  size_t parent; /* the object or array it is in; NONE at the top */
  size_t key;    /* the key in parent whose value it is; NONE in an array */
  size_t last;   /* its last key so far (NONE: none yet) */
};
struct key {
  size_t object, at, len; /* at: offset of its bytes in the bytes buffer */
  const unsigned char *p; /* set once every key is read */
};
#define NONE ((size_t)-1)

static int hex4(const unsigned char *s, unsigned *out) {
  unsigned v = 0;
  for (int i = 0; i < 4; i++) {
    unsigned c = s[i], d;
    if (c >= '0' && c <= '9')
      d = c - '0';
    else if ((c | 0x20) >= 'a' && (c | 0x20) <= 'f')
      d = (c | 0x20) - 'a' + 10;
    else
      return 0;
    v = v << 4 | d;
  }
  *out = v;
  return 1;
}

/* The bytes that the string s[0..n) (between its quotes) stands for,
 * appended to b; 0 for an escape lua-cjson refuses. */
static int unescape(const unsigned char *s, size_t n, struct grow *b) {
  unsigned char *o = room(b, n); /* the bytes are never longer than the text */
  size_t w = 0;
  for (size_t i = 0; i < n;) {
    unsigned cp, lo;
    if (s[i] != '\\') {
      o[w++] = s[i++];
      continue;
    }
    if (i + 1 >= n) return 0;
    if (s[i + 1] != 'u') { /* pairs: the letter after '\\', the byte */
      static const char simple[] = "\"\"\\\\//b\bf\fn\nr\rt\t";
      const char *e = NULL;
      for (size_t k = 0; k + 1 < sizeof simple; k += 2)
        if (simple[k] == (char)s[i + 1]) e = &simple[k + 1];
      if (!e) return 0;
      o[w++] = (unsigned char)*e;
      i += 2;
      continue;
    }
    if (i + 6 > n || !hex4(s + i + 2, &cp)) return 0;
    i += 6;
    if (cp >= 0xDC80 && cp <= 0xDCFF) { /* a byte that is not UTF-8 */
      o[w++] = (unsigned char)(cp & 0xFF);
      continue;
    }
    if (cp >= 0xDC00 && cp <= 0xDFFF) return 0; /* a lone low surrogate */
    if (cp >= 0xD800 && cp <= 0xDBFF) {         /* a pair, or refused */
      if (i + 6 > n || s[i] != '\\' || s[i + 1] != 'u' || !hex4(s + i + 2, &lo) ||
          lo < 0xDC00 || lo > 0xDFFF)
        return 0;
      cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
      i += 6;
    }
    if (cp < 0x80) {
      o[w++] = (unsigned char)cp;
    } else if (cp < 0x800) {
      o[w++] = (unsigned char)(0xC0 | cp >> 6);
      o[w++] = (unsigned char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      o[w++] = (unsigned char)(0xE0 | cp >> 12);
      o[w++] = (unsigned char)(0x80 | (cp >> 6 & 0x3F));
      o[w++] = (unsigned char)(0x80 | (cp & 0x3F));
    } else {
      o[w++] = (unsigned char)(0xF0 | cp >> 18);
      o[w++] = (unsigned char)(0x80 | (cp >> 12 & 0x3F));
      o[w++] = (unsigned char)(0x80 | (cp >> 6 & 0x3F));
      o[w++] = (unsigned char)(0x80 | (cp & 0x3F));
    }
  }
  b->n += w;
  return 1;
}

/* By object, then bytes, then place in the text (the bytes buffer holds
 * the keys in the text's order). */
static int by_key(const void *a, const void *b) {
  const struct key *x = a, *y = b;
  if (x->object != y->object) return x->object < y->object ? -1 : 1;
  size_t m = x->len < y->len ? x->len : y->len;
  int c = m ? memcmp(x->p, y->p, m) : 0;
  if (c) return c;
  if (x->len != y->len) return x->len < y->len ? -1 : 1;
  return x->at < y->at ? -1 : x->at > y->at;
}

static void push_key(lua_State *L, struct grow *bytes, const struct key *k) {
  lua_pushlstring(L, bytes->p + k->at, k->len);
}

/* core.json_twice(text) -> the first key (in the text's order) that an
 * object of text has twice: a table of the keys from the top down to it
 * (false for an array on the way), or nil when there is none. For text
 * that lua-cjson read: nil too for a bad escape or an unterminated
 * string, which it refuses. */
static int nothing(lua_State *L) {
  lua_pushnil(L);
  return 1;
}

static int tl_json_twice(lua_State *L) {
  size_t n;
  const unsigned char *s = (const unsigned char *)luaL_checklstring(L, 1, &n);
  struct grow bytes, keys, objects;
  lua_settop(L, 4);
  grow_open(L, &bytes, 2, 4096);
  grow_open(L, &keys, 3, 64 * sizeof(struct key));
  grow_open(L, &objects, 4, 16 * sizeof(struct object));
  size_t cur = NONE; /* the object or array open */
  for (size_t i = 0; i < n; i++) {
    unsigned char c = s[i];
    if (c == '"') {
      size_t e = i + 1;
      while (e < n && s[e] != '"') e += s[e] == '\\' ? 2 : 1;
      if (e >= n) return nothing(L); /* unterminated */
      size_t j = e + 1;
      while (j < n && (s[j] == ' ' || s[j] == '\t' || s[j] == '\n' || s[j] == '\r')) j++;
      if (j < n && s[j] == ':' && cur != NONE) { /* a key of object cur */
        struct key k = {cur, bytes.n, 0, NULL};
        if (!unescape(s + i + 1, e - i - 1, &bytes)) return nothing(L);
        k.len = bytes.n - k.at;
        struct object *o = (struct object *)objects.p + cur;
        o->last = keys.n / sizeof k;
        memcpy(room(&keys, sizeof k), &k, sizeof k);
        keys.n += sizeof k;
      }
      i = e;
    } else if (c == '{' || c == '[') {
      struct object o = {cur, NONE, NONE}; /* an array's last stays NONE */
      if (cur != NONE) o.key = ((struct object *)objects.p)[cur].last;
      memcpy(room(&objects, sizeof o), &o, sizeof o);
      objects.n += sizeof o;
      cur = objects.n / sizeof o - 1;
    } else if (c == '}' || c == ']') {
      if (cur == NONE) return nothing(L);
      cur = ((struct object *)objects.p)[cur].parent;
    }
  }
  size_t nk = keys.n / sizeof(struct key);
  room(&keys, keys.n); /* a copy to sort after them: they keep the text's order */
  struct key *k = (struct key *)keys.p, *sorted = k + nk;
  struct object *obj = (struct object *)objects.p;
  memcpy(sorted, k, nk * sizeof *k);
  for (size_t i = 0; i < nk; i++)
    sorted[i].p = (const unsigned char *)bytes.p + sorted[i].at;
  qsort(sorted, nk, sizeof *sorted, by_key);
  size_t best = NONE; /* of the keys equal to the one before, the first read */
  for (size_t i = 1; i < nk; i++) {
    const struct key *a = &sorted[i - 1], *b = &sorted[i];
    if (a->object == b->object && a->len == b->len && memcmp(a->p, b->p, b->len) == 0 &&
        (best == NONE || b->at < sorted[best].at))
      best = i;
  }
  if (best == NONE) return nothing(L);
  const struct key *r = &sorted[best];
  int depth = 1;
  for (size_t o = r->object; obj[o].parent != NONE; o = obj[o].parent) depth++;
  lua_createtable(L, depth, 0);
  push_key(L, &bytes, r);
  lua_rawseti(L, -2, depth);
  for (size_t o = r->object; obj[o].parent != NONE; o = obj[o].parent) {
    if (obj[o].key == NONE)
      lua_pushboolean(L, 0);
    else
      push_key(L, &bytes, &k[obj[o].key]);
    lua_rawseti(L, -2, --depth);
  }
  return 1;
}

int tl_open_json(lua_State *L) {
  lua_pushcfunction(L, tl_json_twice);
  lua_setfield(L, -2, "json_twice");
  return 0;
}
