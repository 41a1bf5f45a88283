/* cli_peek.c -- tally.peek: read-only looks at a store, for the tally command.
 *
 *   peek.counter(db, name [, cells]) -> { name=, value=, shards=, policy=,
 *       auto=, grown=, shrunk= (counters with automatic shards only),
 *       rolled = { value=, at=, delta=, rate=, count= } or nil,
 *       cells = { ... } if asked } or nil, message, code
 *   peek.history(db, name, last) -> res_s, { { t=, v= }, ... } or nil
 *       the newest `last` buckets of the counter's finest history ring
 *   peek.schedules(db) -> { { every=, last_period=, holder= }, ... } or
 *       nil, message, code: the rollup schedule identities the store keeps
 *   peek.fs(path) -> { avail=, size= } of the file system holding path
 *   peek.rows(db, pattern, fn) -> true or nil, message, code: fn(list)
 *       for each batch of up to 1,000 matching counters, in their names'
 *       order, each as peek.counter gives it (value nil beyond int64)
 *   peek.watcher(), peek.watch(...): what watch reads (cli_watch.c)
 *
 * `tally ls`, `get`, `info` and `watch` read through these. Counters are
 * opened without TALLY_COUNTER_CREATE, so a counter dropped while a listing
 * runs is skipped, never made again (db:counter() would create it), and
 * nothing here takes the store lock: a lookup and a read of cells and
 * rollup records are lock-free. A value whose shards sum beyond int64 comes
 * back as its exact decimal string. Everything goes through the library's
 * API: the command never reads the file format itself.
 */
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "lua_aux.h"
#include "cli.h"

/* The exact sum of the shards, as a decimal string (beyond int64). */
static void pushbigsum(lua_State *L, const int64_t *v, uint32_t n) {
  __int128 s = 0;
  unsigned __int128 u;
  char buf[48], *p = buf + sizeof buf - 1;
  uint32_t i;
  for (i = 0; i < n; i++) s += v[i];
  u = s < 0 ? (unsigned __int128)(-s) : (unsigned __int128)s;
  *p = '\0';
  do {
    *--p = (char)('0' + (int)(u % 10));
    u /= 10;
  } while (u != 0);
  if (s < 0) *--p = '-';
  lua_pushstring(L, p);
}

/* Set field rolled of the table on top to the record, as c:rolled(). */
static void push_rolled(lua_State *L, const tally_rollup *r) {
  tl_pushrollup(L, r);
  lua_setfield(L, -2, "rolled");
}

/* The fields of a counter's table that peek.counter and peek.rows share. */
static void push_info(lua_State *L, uint32_t shards, int auto_shards, uint32_t grown,
                      uint32_t shrunk, int32_t policy) {
  tl_setint(L, "shards", shards);
  if (auto_shards) { /* the engine sizes it: how often it did */
    lua_pushboolean(L, 1);
    lua_setfield(L, -2, "auto");
    tl_setint(L, "grown", grown);
    tl_setint(L, "shrunk", shrunk);
  }
  lua_pushstring(L,
                 policy == TALLY_POLICY_CUSTOM ? "function" : tally_policy_name(policy));
  lua_setfield(L, -2, "policy");
}

static int p_counter(lua_State *L) {
  tl_store *d = tl_checkstore(L, 1);
  size_t len;
  const char *name = luaL_checklstring(L, 2, &len);
  int cells = lua_toboolean(L, 3);
  int64_t vals[TALLY_MAX_SHARDS], v;
  uint32_t n, i;
  tally_counter *c;
  tally_counter_info info;
  tally_rollup r;
  int rc = tally_counter_open(d->store, name, len, NULL, 0, &c);
  if (rc < 0) return tl_fail(L, rc);
  if ((rc = tally_counter_info_get(c, &info)) < 0 ||
      (rc = tally_counter_shards(c, vals, TALLY_MAX_SHARDS, &n)) < 0) {
    tally_counter_close(c);
    return tl_fail(L, rc);
  }
  lua_createtable(L, 0, 6);
  lua_pushlstring(L, name, len);
  lua_setfield(L, -2, "name");
  rc = tally_counter_value(c, &v); /* the sum now, not of the shards above */
  if (rc == 0)
    lua_pushinteger(L, (lua_Integer)v);
  else if (rc == TALLY_ERANGE)
    pushbigsum(L, vals, n);
  else
    lua_pushnil(L);
  lua_setfield(L, -2, "value");
  push_info(L, n, info.auto_shards, info.grown, info.shrunk, info.policy);
  if (tally_counter_rolled(c, &r) == 0) push_rolled(L, &r);
  if (cells) {
    lua_createtable(L, (int)n, 0);
    for (i = 0; i < n; i++) {
      lua_pushinteger(L, (lua_Integer)vals[i]);
      lua_rawseti(L, -2, (lua_Integer)i + 1);
    }
    lua_setfield(L, -2, "cells");
  }
  tally_counter_close(c);
  return 1;
}

static int p_history(lua_State *L) {
  tl_store *d = tl_checkstore(L, 1);
  size_t len;
  const char *name = luaL_checklstring(L, 2, &len);
  lua_Integer last = luaL_checkinteger(L, 3);
  tally_ring rings[TALLY_RINGS_MAX];
  tally_bucket *b;
  uint32_t nr, nb, i, fine = 0, first;
  tally_counter *c = NULL;
  int rc = tally_counter_open(d->store, name, len, NULL, 0, &c);
  if (rc < 0 || tally_counter_rings(c, rings, TALLY_RINGS_MAX, &nr) < 0 || nr == 0) {
    tally_counter_close(c);
    return 0;
  }
  for (i = 1; i < nr && i < TALLY_RINGS_MAX; i++)
    if (rings[i].res_s < rings[fine].res_s) fine = i;
  b = (tally_bucket *)malloc((size_t)rings[fine].len * sizeof *b);
  if (b == NULL) {
    tally_counter_close(c);
    return luaL_error(L, "out of memory");
  }
  rc = tally_counter_history(c, rings[fine].res_s, b, rings[fine].len, &nb);
  tally_counter_close(c);
  if (rc < 0) {
    free(b);
    return 0;
  }
  if (nb > rings[fine].len) nb = rings[fine].len;
  first = last > 0 && (lua_Integer)nb > last ? nb - (uint32_t)last : 0;
  lua_pushinteger(L, (lua_Integer)rings[fine].res_s);
  lua_createtable(L, (int)(nb - first), 0);
  for (i = first; i < nb; i++) {
    lua_createtable(L, 0, 2);
    tl_setint(L, "t", b[i].t);
    tl_setint(L, "v", b[i].value);
    lua_rawseti(L, -2, (lua_Integer)(i - first) + 1);
  }
  free(b);
  return 2;
}

/* The schedule identities the store keeps (db:stats() counts them), read
 * through the library's API, never the file format. */
static int p_schedules(lua_State *L) {
  tl_store *d = tl_checkstore(L, 1);
  tally_schedule_info *sch;
  uint32_t n, got, i;
  int rc = tally_store_schedules(d->store, NULL, 0, &n); /* how many */
  if (rc < 0) return tl_fail(L, rc);
  sch = lua_newuserdata(L, (n ? n : 1) * sizeof *sch); /* freed by the GC */
  rc = tally_store_schedules(d->store, sch, n, &got);
  if (rc < 0) return tl_fail(L, rc);
  if (got < n) n = got; /* identities are never freed, but stay safe */
  lua_createtable(L, (int)n, 0);
  for (i = 0; i < n; i++) {
    lua_createtable(L, 0, 3);
    if (sch[i].every_ms > 0) {
      lua_pushnumber(L, (lua_Number)sch[i].every_ms / 1000);
      lua_setfield(L, -2, "every");
    }
    if (sch[i].last_period_ms >= 0) {
      lua_pushnumber(L, (lua_Number)sch[i].last_period_ms / 1000);
      lua_setfield(L, -2, "last_period");
    }
    if (sch[i].holder_pid > 0) tl_setint(L, "holder", sch[i].holder_pid);
    lua_rawseti(L, -2, (lua_Integer)i + 1);
  }
  return 1;
}

static int p_fs(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  struct statvfs st;
  if (statvfs(path, &st) != 0) {
    lua_pushnil(L);
    lua_pushfstring(L, "%s: %s", path, strerror(errno));
    return 2;
  }
  lua_createtable(L, 0, 2);
  tl_setint(L, "avail", (int64_t)((uint64_t)st.f_bavail * st.f_frsize));
  tl_setint(L, "size", (int64_t)((uint64_t)st.f_blocks * st.f_frsize));
  return 1;
}

/* ---- peek.rows: a listing that streams ------------------------------------- */

/* The walk hands rows over while it holds the store's records; a Lua
 * error must not unwind through it. So each row is copied into a batch,
 * and a full batch is made into tables and given to fn under lua_pcall;
 * an error stops the walk and is raised once it has ended. */
#define ROWS_BATCH 1000

struct rows_batch {
  lua_State *L;
  int fn;     /* stack index of fn */
  int failed; /* fn raised: its message is on top of the stack */
  size_t n;
  tally_row row[ROWS_BATCH];
  tally_rollup roll[ROWS_BATCH];
  char name[ROWS_BATCH][TALLY_NAME_MAX + 1];
};

static int rows_call(lua_State *L) {
  struct rows_batch *b = (struct rows_batch *)lua_touserdata(L, 1);
  lua_pushvalue(L, 2); /* fn */
  lua_createtable(L, (int)b->n, 0);
  for (size_t i = 0; i < b->n; i++) {
    const tally_row *r = &b->row[i];
    lua_createtable(L, 0, 8);
    lua_pushlstring(L, b->name[i], r->name_len);
    lua_setfield(L, -2, "name");
    if (r->value_rc == 0) {
      lua_pushinteger(L, (lua_Integer)r->value);
      lua_setfield(L, -2, "value");
    }
    push_info(L, r->shards, r->auto_shards, r->grown, r->shrunk, r->policy);
    if (r->rolled) push_rolled(L, &b->roll[i]);
    lua_rawseti(L, -2, (lua_Integer)i + 1);
  }
  lua_call(L, 1, 0);
  return 0;
}

static int rows_flush(struct rows_batch *b) {
  lua_State *L = b->L;
  if (b->n == 0) return 0;
  lua_pushcfunction(L, rows_call);
  lua_pushlightuserdata(L, b);
  lua_pushvalue(L, b->fn); /* an index of peek.rows' frame, where the walk runs */
  if (lua_pcall(L, 2, 0, 0) != LUA_OK) {
    b->failed = 1;
    return 1; /* stops the walk */
  }
  b->n = 0;
  return 0;
}

static int rows_add(void *ud, const tally_row *r) {
  struct rows_batch *b = (struct rows_batch *)ud;
  size_t i = b->n++;
  b->row[i] = *r;
  memcpy(b->name[i], r->name, r->name_len);
  if (r->rolled) b->roll[i] = *r->rolled;
  return b->n == ROWS_BATCH ? rows_flush(b) : 0;
}

static int p_rows(lua_State *L) {
  tl_store *d = tl_checkstore(L, 1);
  size_t plen = 0;
  const char *pattern = luaL_optlstring(L, 2, NULL, &plen);
  luaL_checktype(L, 3, LUA_TFUNCTION);
  struct rows_batch *b = (struct rows_batch *)malloc(sizeof *b);
  if (b == NULL) return luaL_error(L, "not enough memory");
  b->L = L;
  b->fn = 3;
  b->failed = 0;
  b->n = 0;
  int rc = tally_store_rows(d->store, pattern, plen,
                            TALLY_ROWS_BY_NAME | TALLY_ROWS_ROLLED, rows_add, b);
  if (rc == 0) rc = rows_flush(b);
  int failed = b->failed;
  free(b);
  if (failed) return lua_error(L); /* fn's error, on top */
  if (rc < 0) return tl_fail(L, rc);
  lua_pushboolean(L, 1);
  return 1;
}

int cli_open_peek(lua_State *L) {
  static const luaL_Reg fns[] = {{"counter", p_counter},     {"history", p_history},
                                 {"schedules", p_schedules}, {"fs", p_fs},
                                 {"rows", p_rows},           {NULL, NULL}};
  luaL_newlib(L, fns);
  cli_peek_watch(L); /* peek.watcher, peek.watch (cli_watch.c) */
  return 1;
}
