/* lua_export.c -- db:export of a local store, streamed.
 *
 * The text is lua/tally/export.lua's (the Firestore counters/shards layout,
 * one counter per line, names sorted bytewise); this file makes it fast at a
 * million counters without holding the document or a table per counter.
 *
 * core.export_write(db, pattern, quote, write) walks the store once in the
 * names' order (tally_store_rows with TALLY_ROWS_CELLS: no handle per
 * counter) and hands the text to write(chunk) in pieces of about 64 KiB.
 *
 * Names that are not plain go through tally.json's quote, the format's
 * one rule for them.
 *
 * Names are bytes with no NUL; a Lua error never unwinds through the walk
 * (each call into Lua from it is under lua_pcall).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "lua_aux.h"

#define TL_IMPORTER_MT "tally.importer"
#define CHUNK          65536 /* what export hands write at a time, about */
#define SAFE           INT64_C(9007199254740991) /* 2^53-1: a double holds it */
#define SHARD_MIN      (-(INT64_C(1) << 62))
#define SHARD_MAX      ((INT64_C(1) << 62) - 1)

/* ---- the text of a counter, as export writes it ------------------------ */

struct text {
  char *p;
  size_t n, cap;
};

static int room(struct text *t, size_t k) {
  if (t->cap - t->n >= k) return 0;
  size_t cap = t->cap ? t->cap : 4096;
  while (cap - t->n < k) cap *= 2;
  char *p = (char *)realloc(t->p, cap);
  if (p == NULL) return TALLY_ENOMEM;
  t->p = p;
  t->cap = cap;
  return 0;
}

static int put(struct text *t, const char *s, size_t len) {
  if (room(t, len)) return TALLY_ENOMEM;
  memcpy(t->p + t->n, s, len);
  t->n += len;
  return 0;
}

/* Bytes that tally.json's quote writes as they are (printable ASCII but
 * '"' and '\'): such a name is written here, any other goes through quote. */
static int plain(const char *s, size_t len) {
  for (size_t i = 0; i < len; i++) {
    unsigned char c = (unsigned char)s[i];
    if (c < 0x20 || c > 0x7e || c == '"' || c == '\\') return 0;
  }
  return 1;
}

/* "policy" as export writes it: c:info().policy's words. */
static const char *policy_text(int32_t policy) {
  return tl_policy_label(policy);
}

/* The line of one counter: quoted is its name as JSON (with the quotes)
 * when not plain, else NULL and the name is written as it is. */
static int put_counter(struct text *t, const char *name, size_t len, const char *quoted,
                       size_t qlen, int32_t policy, uint32_t n, const int64_t *cells) {
  const char *pt = policy_text(policy);
  if (room(t, len + qlen + strlen(pt) + 64 + (size_t)n * 48)) return TALLY_ENOMEM;
  char *o = t->p + t->n;
  if (quoted) {
    memcpy(o, quoted, qlen);
    o += qlen;
  } else {
    *o++ = '"';
    memcpy(o, name, len);
    o += len;
    *o++ = '"';
  }
  o += sprintf(o, ":{\"num_shards\":%u,\"policy\":\"%s\",\"shards\":{", (unsigned)n, pt);
  for (uint32_t i = 0; i < n; i++) {
    int64_t v = cells[i];
    const char *q = v >= -SAFE && v <= SAFE ? "" : "\""; /* beyond: a string */
    o += sprintf(o, "%s\"%u\":{\"count\":%s%lld%s}", i ? "," : "", (unsigned)i, q,
                 (long long)v, q);
  }
  *o++ = '}';
  *o++ = '}';
  t->n = (size_t)(o - t->p);
  return 0;
}

/* ---- export --------------------------------------------------------------- */

struct exporter {
  lua_State *L;
  int quote, write; /* stack indices of the Lua functions */
  struct text t;
  uint64_t n;          /* counters written */
  const tally_row *at; /* the row being written, for quote_call */
  int failed;          /* a Lua error, on top of the stack */
};

/* Under protect: 1 the exporter, 2 quote, 3 write (its own frame's). */
static int write_call(lua_State *L) {
  struct exporter *e = (struct exporter *)lua_touserdata(L, 1);
  lua_pushvalue(L, 3);
  lua_pushlstring(L, e->t.p, e->t.n);
  lua_call(L, 1, 0);
  return 0;
}

static int quote_call(lua_State *L) {
  struct exporter *e = (struct exporter *)lua_touserdata(L, 1);
  const tally_row *r = e->at;
  size_t qlen;
  lua_pushvalue(L, 2);
  lua_pushlstring(L, r->name, r->name_len);
  lua_call(L, 1, 1);
  const char *q = lua_tolstring(L, -1, &qlen);
  if (q == NULL) return luaL_error(L, "export: quote gave no string");
  if (put_counter(&e->t, NULL, 0, q, qlen, r->policy, r->shards, r->cells))
    return luaL_error(L, "not enough memory");
  return 0;
}

/* Run f(e) under lua_pcall: 0, or 1 with the error on top of the stack. */
static int protect(struct exporter *e, lua_CFunction f) {
  lua_pushcfunction(e->L, f);
  lua_pushlightuserdata(e->L, e);
  lua_pushvalue(e->L, e->quote); /* indices of export_write's frame */
  lua_pushvalue(e->L, e->write);
  if (lua_pcall(e->L, 3, 0, 0) == LUA_OK) return 0;
  e->failed = 1;
  return 1;
}

static int flush(struct exporter *e) {
  if (e->t.n == 0) return 0;
  if (protect(e, write_call)) return 1;
  e->t.n = 0;
  return 0;
}

static int export_row(void *ud, const tally_row *r) {
  struct exporter *e = (struct exporter *)ud;
  const char *sep = e->n ? ",\n" : "{\"counters\":{\n";
  if (put(&e->t, sep, strlen(sep))) return TALLY_ENOMEM;
  e->n++;
  if (plain(r->name, r->name_len)) {
    if (put_counter(&e->t, r->name, r->name_len, NULL, 0, r->policy, r->shards, r->cells))
      return TALLY_ENOMEM;
  } else {
    e->at = r;
    if (protect(e, quote_call)) return 1;
  }
  return e->t.n >= CHUNK ? flush(e) : 0;
}

/* core.export_write(db, pattern|nil, quote, write) -> true, after write
 * got the whole text; nil, msg, code if reading the store fails (write
 * may have had part of it). Raises what quote or write raise. */
static int tl_export_write(lua_State *L) {
  tl_store *d = tl_checkstore(L, 1);
  size_t plen = 0;
  const char *pattern = lua_isnoneornil(L, 2) ? NULL : luaL_checklstring(L, 2, &plen);
  luaL_checktype(L, 3, LUA_TFUNCTION);
  luaL_checktype(L, 4, LUA_TFUNCTION);
  lua_settop(L, 4);
  luaL_checkstack(L, 8, NULL);
  struct exporter e = {L, 3, 4, {NULL, 0, 0}, 0, NULL, 0};
  d->walking++; /* quote and write run inside the walk: db:close must wait */
  int rc = tally_store_rows(d->store, pattern, plen,
                            TALLY_ROWS_BY_NAME | TALLY_ROWS_CELLS, export_row, &e);
  d->walking--;
  if (rc == 0) {
    const char *end = e.n ? "\n}}\n" : "{\"counters\":{}}\n";
    rc = put(&e.t, end, strlen(end));
    if (rc == 0) rc = flush(&e);
  }
  free(e.t.p);
  if (e.failed) return lua_error(L); /* quote's or write's error, on top */
  if (rc == TALLY_ENOMEM) return luaL_error(L, "not enough memory");
  if (rc < 0) return tl_fail(L, rc);
  lua_pushboolean(L, 1);
  return 1;
}

int tl_open_export(lua_State *L) {
  lua_pushcfunction(L, tl_export_write);
  lua_setfield(L, -2, "export_write");
  return 0;
}
