/* lua_tally.c -- the Lua binding: module "tally.core", store and counter handles.
 *
 * A store handle (metatable "tally.store") is a full userdata holding the
 * tally_store pointer and the spec it was opened with; its user values are a
 * weak-valued cache of counter handles by name (used by db:incr and friends)
 * and the list of function-policy families defined through it. A counter
 * handle ("tally.counter") holds the tally_counter pointer, a copy of its
 * name and policy, and a link in its store's list of open handles, so that
 * db:close() can close every counter before the store as the C API requires.
 * Its user values keep the store handle alive and hold the policy function.
 *
 * Hot paths (c:incr, db:incr) trust the first argument after one cheap check
 * (a salted self-pointer, which also tells the two handle types apart) and
 * fall back to tl_checkudata only to raise the proper error. Misuse raises
 * luaL_argerror-style errors; failures of the environment return
 * nil, message, code name. A closed handle sets its C pointer to NULL.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lua_tally.h"
#include "lua_sender.h"
#include "lua_redis.h"
#if TL_LUAJIT
#include <dlfcn.h>  /* dladdr: core._ffi_info().path */
#endif

#if defined(__GNUC__)
#define TL_LIKELY(x) __builtin_expect(!!(x), 1)
#define TL_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define TL_EXPORT __attribute__((visibility("default")))
#else
#define TL_LIKELY(x) (x)
#define TL_UNLIKELY(x) (x)
#define TL_EXPORT
#endif

static const char *const tl_policy_names[] = {
  "thread", "random", "round_robin", "key", NULL
};

/* ---- small helpers --------------------------------------------------------- */

/* Push and return a short description of the value at idx for messages:
 * 'str', 12, 1.5, nil, true, table. */
static const char *tl_describe(lua_State *L, int idx) {
  switch (lua_type(L, idx)) {
  case LUA_TSTRING: return lua_pushfstring(L, "'%s'", lua_tostring(L, idx));
  case LUA_TNUMBER: lua_pushvalue(L, idx); return lua_tostring(L, -1);
  case LUA_TBOOLEAN:
    lua_pushstring(L, lua_toboolean(L, idx) ? "true" : "false");
    return lua_tostring(L, -1);
  case LUA_TNONE: lua_pushliteral(L, "no value"); return lua_tostring(L, -1);
  default: lua_pushstring(L, luaL_typename(L, idx)); return lua_tostring(L, -1);
  }
}

static int tl_typeerror(lua_State *L, int arg, const char *tname) {
  const char *got;
  if (luaL_getmetafield(L, arg, "__name") != 0 && lua_type(L, -1) == LUA_TSTRING)
    got = lua_tostring(L, -1);  /* (5.1's returns 1 when found, 5.4's the type) */
  else if (lua_type(L, arg) == LUA_TLIGHTUSERDATA)
    got = "light userdata";
  else
    got = luaL_typename(L, arg);
  return luaL_argerror(L, arg,
                       lua_pushfstring(L, "%s expected, got %s", tname, got));
}

int tl_fail(lua_State *L, int rc) {
  lua_pushnil(L);
  lua_pushstring(L, tally_errmsg());
  lua_pushstring(L, tally_err_name(rc));
  return 3;
}

static int tl_fail_msg(lua_State *L, int rc, const char *msg) {
  lua_pushnil(L);
  lua_pushstring(L, msg);
  lua_pushstring(L, tally_err_name(rc));
  return 3;
}

static const char *tl_policy_label(int32_t policy) {
  if (policy >= 0 && policy < TALLY_POLICY_CUSTOM) return tl_policy_names[policy];
  return policy == TALLY_POLICY_CUSTOM ? "function" : "?";
}

/* A strict string argument (numbers are not names). */
static const char *tl_checkstring(lua_State *L, int arg, size_t *len) {
  if (TL_UNLIKELY(lua_type(L, arg) != LUA_TSTRING)) tl_typeerror(L, arg, "string");
  return lua_tolstring(L, arg, len);
}

/* Counter names and family patterns: 1..255 bytes, no NUL. */
static const char *tl_checkname(lua_State *L, int arg, size_t *len,
                                const char *what) {
  const char *s = tl_checkstring(L, arg, len);
  if (*len < 1 || *len > TALLY_NAME_MAX)
    luaL_argerror(L, arg, lua_pushfstring(L, "%s must be 1 to %d bytes, got %d",
                                          what, TALLY_NAME_MAX, (int)*len));
  if (memchr(s, '\0', *len) != NULL)
    luaL_argerror(L, arg, lua_pushfstring(L, "%s must not contain a NUL byte", what));
  return s;
}

/* Validate the shard count at vidx; messages name argument arg. */
static uint32_t tl_checkshards(lua_State *L, int vidx, int arg) {
  lua_Integer n = 0;
  int isnum = 0;
  if (lua_type(L, vidx) == LUA_TNUMBER) n = tl_tointx(L, vidx, &isnum);
  if (!isnum || n < 1 || n > TALLY_MAX_SHARDS)
    luaL_argerror(L, arg, lua_pushfstring(L,
        "shards must be an integer from 1 to %d, got %s",
        TALLY_MAX_SHARDS, tl_describe(L, vidx)));
  return (uint32_t)n;
}

static int32_t tl_checkpolicy(lua_State *L, int vidx, int arg) {
  int t = lua_type(L, vidx);
  if (t == LUA_TFUNCTION) return TALLY_POLICY_CUSTOM;
  if (t == LUA_TSTRING) {
    const char *s = lua_tostring(L, vidx);
    int i;
    for (i = 0; tl_policy_names[i] != NULL; i++)
      if (strcmp(s, tl_policy_names[i]) == 0) return i;
  }
  luaL_argerror(L, arg, lua_pushfstring(L,
      "policy must be one of thread, random, round_robin, key or a function, got %s",
      tl_describe(L, vidx)));
  return -1;
}

/* Parse counter/family options at arg (nil or a table). Leaves the policy
 * value (a function, or nil) on top of the stack. */
/* Counter options at arg: shards, policy, and (if create is not NULL, for
 * db:counter) create = false, which opens an existing counter only. */
static void tl_checkcounteropts(lua_State *L, int arg, tally_counter_options *o,
                                int *create) {
  o->shards = 0;
  o->policy = -1;
  if (lua_isnoneornil(L, arg)) {
    lua_pushnil(L);
    return;
  }
  if (!lua_istable(L, arg)) tl_typeerror(L, arg, "table");
  lua_getfield(L, arg, "shards");
  if (!lua_isnil(L, -1)) o->shards = tl_checkshards(L, lua_gettop(L), arg);
  lua_pop(L, 1);
  lua_pushnil(L);
  while (lua_next(L, arg) != 0) {
    const char *k = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : NULL;
    if (k != NULL && create != NULL && strcmp(k, "create") == 0) {
      if (lua_type(L, -1) != LUA_TBOOLEAN)
        luaL_argerror(L, arg, "create must be a boolean");
      *create = lua_toboolean(L, -1);
    } else if (k == NULL || (strcmp(k, "shards") != 0 && strcmp(k, "policy") != 0)) {
      luaL_argerror(L, arg, lua_pushfstring(L, "unknown option %s",
                                            tl_describe(L, -2)));
    }
    lua_pop(L, 1);
  }
  lua_getfield(L, arg, "policy");
  if (!lua_isnil(L, -1)) o->policy = tl_checkpolicy(L, lua_gettop(L), arg);
  if (o->policy != TALLY_POLICY_CUSTOM) {
    lua_pop(L, 1);
    lua_pushnil(L);
  }
}

/* ---- handles ----------------------------------------------------------------- */

void *tl_checkudata(lua_State *L, int idx, const char *tname) {
  void *p = luaL_testudata(L, idx, tname);
  if (p == NULL) tl_typeerror(L, idx, tname);  /* as luaL_checkudata in 5.4 */
  return p;
}

tl_store *tl_checkstore(lua_State *L, int idx) {
  tl_store *d = (tl_store *)tl_checkudata(L, idx, TL_STORE_MT);
  if (d->store == NULL) luaL_error(L, "attempt to use a closed store");
  return d;
}
static tl_store *tl_tostore_slow(lua_State *L) { return tl_checkstore(L, 1); }

/* The store at argument 1, open; raises otherwise. */
static tl_store *tl_tostore(lua_State *L) {
  tl_store *d = (tl_store *)lua_touserdata(L, 1);
  if (TL_UNLIKELY(d == NULL || lua_type(L, 1) != LUA_TUSERDATA ||
                  d->key != ((uintptr_t)d ^ TL_STORE_SALT) || d->store == NULL))
    return tl_tostore_slow(L);
  return d;
}

tl_counter *tl_checkcounter(lua_State *L, int idx) {
  tl_counter *h = (tl_counter *)tl_checkudata(L, idx, TL_COUNTER_MT);
  if (h->db->store == NULL) luaL_error(L, "attempt to use a closed store");
  if (h->c == NULL) luaL_error(L, "attempt to use a closed counter");
  return h;
}

/* The counter at argument 1, open; raises otherwise. */
static tl_counter *tl_tocounter(lua_State *L) {
  tl_counter *h = (tl_counter *)lua_touserdata(L, 1);
  if (TL_UNLIKELY(h == NULL || lua_type(L, 1) != LUA_TUSERDATA ||
                  h->key != ((uintptr_t)h ^ TL_COUNTER_SALT) || h->c == NULL))
    return tl_checkcounter(L, 1);
  return h;
}

static void tl_counter_release(tl_counter *h) {
  if (h->c == NULL) return;
  if (h->prev != NULL) h->prev->next = h->next;
  else h->db->counters = h->next;
  if (h->next != NULL) h->next->prev = h->prev;
  h->prev = h->next = NULL;
  tally_counter_close(h->c);
  h->c = NULL;
}

static void tl_store_release(tl_store *d) {
  while (d->counters != NULL) tl_counter_release(d->counters);
  if (d->store != NULL) tally_store_close(d->store);
  d->store = NULL;
}

/* Push the function of the most recently defined function family of the
 * store at dbidx that matches name, or nil. */
static void tl_family_fn(lua_State *L, int dbidx, const char *name, size_t len) {
  lua_Integer i;
  tl_getuv(L, dbidx, TL_SUV_FAMILIES);
  for (i = (lua_Integer)lua_rawlen(L, -1) - 1; i >= 1; i -= 2) {
    size_t plen;
    const char *p;
    lua_rawgeti(L, -1, i);
    p = lua_tolstring(L, -1, &plen);
    lua_pop(L, 1);
    if (p != NULL && tally_glob_match(p, plen, name, len)) {
      lua_rawgeti(L, -1, i + 1);
      lua_remove(L, -2);
      return;
    }
  }
  lua_pop(L, 1);
  lua_pushnil(L);
}

/* Open counter name on the store at dbidx and push its handle. fnidx is the
 * stack index of its policy function, or 0 (a CUSTOM counter then takes its
 * family's function, if this store defined one). On failure nothing is
 * pushed and the TALLY_E* code is returned. */
static int tl_counter_push(lua_State *L, int dbidx, const char *name, size_t len,
                           const tally_counter_options *opt, uint32_t flags,
                           int fnidx) {
  tl_store *d = (tl_store *)lua_touserdata(L, dbidx);
  tl_counter *h;
  tally_counter *c;
  tally_counter_info info;
  int rc;

  dbidx = lua_absindex(L, dbidx);
  h = (tl_counter *)tl_newud(L, sizeof(*h) + len + 1, TL_CUV_N);
  memset(h, 0, sizeof(*h));
  h->key = (uintptr_t)h ^ TL_COUNTER_SALT;
  h->db = d;
  h->namelen = len;
  memcpy(h->name, name, len);
  h->name[len] = '\0';
  luaL_setmetatable(L, TL_COUNTER_MT);
  lua_pushvalue(L, dbidx);
  tl_setuv(L, -2, TL_CUV_STORE);

  rc = tally_counter_open(d->store, name, len, opt, flags, &c);
  if (rc < 0) {
    lua_pop(L, 1);
    return rc;
  }
  h->c = c;
  h->next = d->counters;
  if (d->counters != NULL) d->counters->prev = h;
  d->counters = h;
  rc = tally_counter_info_get(c, &info);
  if (rc < 0) {
    tl_counter_release(h);
    lua_pop(L, 1);
    return rc;
  }
  h->policy = info.policy;
  if (h->policy == TALLY_POLICY_CUSTOM) {
    if (fnidx != 0) lua_pushvalue(L, fnidx);
    else tl_family_fn(L, dbidx, name, len);
    h->hasfn = !lua_isnil(L, -1);
    tl_setuv(L, -2, TL_CUV_POLICY);
  }
  return 0;
}

/* ---- increments -------------------------------------------------------------- */

#if TL_LUAJIT
/* ---- LuaJIT: 64-bit integers as cdata ------------------------------------------
 * Two Lua functions, registered by the Lua side with core.set_box(box,
 * unbox) (lua/tally/compat.lua), cross between int64_t and cdata:
 * box(hi, lo) -> int64_t cdata of the bits hi * 2^32 + lo (both numbers
 * in [0, 2^32)); unbox(x) -> hi, lo for an int64_t or uint64_t cdata, or
 * nil and the reason. */
#define TL_BOX_KEY "tally.box"
#define TL_UNBOX_KEY "tally.unbox"

static int tl_exact(int64_t v) {
  return v >= -(int64_t)TL_EXACT && v <= (int64_t)TL_EXACT;
}

int tl_canpush(lua_State *L, int64_t v) {
  int ok;
  if (tl_exact(v)) return 1;
  lua_getfield(L, LUA_REGISTRYINDEX, TL_BOX_KEY);
  ok = lua_isfunction(L, -1);
  lua_pop(L, 1);
  return ok;
}

void tl_pushint64(lua_State *L, int64_t v) {
  uint64_t u = (uint64_t)v;
  if (tl_exact(v)) {
    lua_pushnumber(L, (lua_Number)v);
    return;
  }
  lua_getfield(L, LUA_REGISTRYINDEX, TL_BOX_KEY);
  if (!lua_isfunction(L, -1))
    luaL_error(L, "a value beyond +-2^53 cannot be returned exactly as a LuaJIT "
               "number: require \"tally\" (it registers the int64_t box)");
  lua_pushnumber(L, (lua_Number)(u >> 32));
  lua_pushnumber(L, (lua_Number)(u & 0xffffffffu));
  lua_call(L, 2, 1);
}

/* The int64_t of the cdata at arg, or raise naming argument arg. */
static int64_t tl_unbox(lua_State *L, int arg) {
  lua_Number hi, lo;
  lua_getfield(L, LUA_REGISTRYINDEX, TL_UNBOX_KEY);
  if (!lua_isfunction(L, -1)) {
    tl_typeerror(L, arg, "number");
    return 0;
  }
  lua_pushvalue(L, arg);
  lua_call(L, 1, 2);
  if (lua_type(L, -2) != LUA_TNUMBER) {
    if (lua_type(L, -1) == LUA_TSTRING) luaL_argerror(L, arg, lua_tostring(L, -1));
    tl_typeerror(L, arg, "number");
  }
  hi = lua_tonumber(L, -2);
  lo = lua_tonumber(L, -1);
  lua_pop(L, 2);
  return (int64_t)(((uint64_t)hi << 32) | (uint64_t)lo);
}

/* An integer argument: exact numbers within +-2^53 (and numeric strings,
 * as Lua 5.4 takes them), int64_t and uint64_t cdata. */
static int64_t tl_checkint64(lua_State *L, int arg) {
  int isnum;
  lua_Number d;
  lua_Integer n = tl_tointx(L, arg, &isnum);
  if (isnum) return n;
  if (lua_type(L, arg) == TL_TCDATA) return tl_unbox(L, arg);
  if (!lua_isnumber(L, arg)) tl_typeerror(L, arg, "number");
  d = lua_tonumber(L, arg);
  if ((d > TL_EXACT || d < -TL_EXACT) && d - d == 0)  /* finite: an integer */
    luaL_argerror(L, arg, "integer beyond +-2^53 is not exact as a LuaJIT number "
                  "(pass an int64_t cdata)");
  luaL_argerror(L, arg, "number has no integer representation");
  return 0;
}

lua_Integer tl_checkinteger(lua_State *L, int arg) {
  return (lua_Integer)tl_checkint64(L, arg);
}

static int tl_set_box(lua_State *L) {
  luaL_checktype(L, 1, LUA_TFUNCTION);
  luaL_checktype(L, 2, LUA_TFUNCTION);
  lua_pushvalue(L, 1);
  lua_setfield(L, LUA_REGISTRYINDEX, TL_BOX_KEY);
  lua_pushvalue(L, 2);
  lua_setfield(L, LUA_REGISTRYINDEX, TL_UNBOX_KEY);
  return 0;
}
#else
#define tl_checkint64(L, arg) luaL_checkinteger((L), (arg))
#endif

int64_t tl_checkdelta(lua_State *L, int arg) {
  if (lua_isnoneornil(L, arg)) return 1;
  return tl_checkint64(L, arg);  /* raises with the standard message */
}

/* Key and function policies: the counter handle is at hidx, the key at kidx. */
static int tl_incr_policy(lua_State *L, tl_counter *h, int hidx, int kidx,
                          lua_Integer n) {
  if (lua_gettop(L) < kidx) lua_settop(L, kidx);  /* pushes below stay above it */
  if (h->policy == TALLY_POLICY_KEY) {
    size_t klen;
    const char *k;
    int t = lua_type(L, kidx);
    if (t == LUA_TNIL)
      luaL_argerror(L, kidx, "key expected for a counter with the key policy");
    if (t != LUA_TSTRING && t != LUA_TNUMBER) tl_typeerror(L, kidx, "string or number");
    lua_pushvalue(L, kidx);
    k = lua_tolstring(L, -1, &klen);  /* left on the stack: it stays alive */
    return tally_counter_incr_key(h->c, k, klen, (int64_t)n);
  }
  if (h->policy == TALLY_POLICY_CUSTOM) {
    tally_counter_info info;
    lua_Integer s;
    int isnum, rc;
    if (!h->hasfn)
      luaL_error(L, "counter '%s' has a function policy: "
                 "pass it as policy = function to db:counter", h->name);
    rc = tally_counter_info_get(h->c, &info);
    if (rc < 0) return rc;
    tl_getuv(L, hidx, TL_CUV_POLICY);
    lua_pushinteger(L, (lua_Integer)info.shards);
    lua_pushvalue(L, kidx);
    lua_call(L, 2, 1);
    if (h->db->store == NULL) luaL_error(L, "attempt to use a closed store");
    if (h->c == NULL) luaL_error(L, "attempt to use a closed counter");
    s = tl_tointx(L, -1, &isnum);
    if (!isnum || lua_type(L, -1) != LUA_TNUMBER || s < 1 || s > (lua_Integer)info.shards)
      luaL_error(L, "policy function for '%s' returned %s "
                 "(expected an integer from 1 to %d)",
                 h->name, tl_describe(L, -1), (int)info.shards);
    lua_pop(L, 1);
    return tally_counter_incr_shard(h->c, (uint32_t)(s - 1), (int64_t)n);
  }
  return tally_counter_incr(h->c, (int64_t)n);
}

static int tl_incr_fail(lua_State *L, tl_counter *h, int rc) {
  if (rc == TALLY_EDROPPED)
    return tl_fail_msg(L, rc, lua_pushfstring(L, "counter '%s' was dropped", h->name));
  return tl_fail(L, rc);
}

static lua_Integer tl_negate(lua_Integer n) {
  return (lua_Integer)(0u - (uint64_t)n);  /* no UB on the minimum */
}

static int tl_counter_incr_(lua_State *L, int sign) {
  tl_counter *h = tl_tocounter(L);
  int isnum, rc;
  lua_Integer n = tl_tointx(L, 2, &isnum);
  if (TL_UNLIKELY(!isnum)) n = tl_checkdelta(L, 2);
  if (sign < 0) n = tl_negate(n);
  if (TL_LIKELY(h->policy < TALLY_POLICY_KEY))
    rc = tally_counter_incr(h->c, (int64_t)n);
  else
    rc = tl_incr_policy(L, h, 1, 3, n);
  if (TL_UNLIKELY(rc < 0)) return tl_incr_fail(L, h, rc);
  lua_pushboolean(L, 1);
  return 1;
}

static int tl_counter_incr(lua_State *L) { return tl_counter_incr_(L, 1); }
static int tl_counter_decr(lua_State *L) { return tl_counter_incr_(L, -1); }
static int tl_counter_nop(lua_State *L) { (void)L; return 0; }

/* ---- counter methods --------------------------------------------------------- */

static int tl_counter_value(lua_State *L) {
  tl_counter *h = tl_tocounter(L);
  int64_t v;
  int rc;
  if (TL_UNLIKELY(lua_gettop(L) >= 2 && !lua_isnil(L, 2))) return tl_counter_value_opts(L);
  rc = tally_counter_value(h->c, &v);
  if (rc < 0) return tl_incr_fail(L, h, rc);
  tl_pushint64(L, (int64_t)v);
  return 1;
}

static int tl_counter_shards(lua_State *L) {
  tl_counter *h = tl_tocounter(L);
  int64_t vals[TALLY_MAX_SHARDS];
  uint32_t n = 0, i;
  int rc = tally_counter_shards(h->c, vals, TALLY_MAX_SHARDS, &n);
  if (rc < 0) return tl_incr_fail(L, h, rc);
  if (n > TALLY_MAX_SHARDS) n = TALLY_MAX_SHARDS;
  lua_createtable(L, (int)n, 0);
  for (i = 0; i < n; i++) {
    tl_pushint64(L, (int64_t)vals[i]);
    lua_rawseti(L, -2, (lua_Integer)i + 1);
  }
  return 1;
}

static int tl_counter_reset(lua_State *L) {
  tl_counter *h = tl_tocounter(L);
  int64_t removed;
  int rc = tally_counter_reset(h->c, &removed);
  if (rc < 0) return tl_incr_fail(L, h, rc);
  tl_pushint64(L, (int64_t)removed);
  return 1;
}

/* c:add_shard(i, n): add n to shard i (1-based) whatever the policy; for
 * restoring exact per-shard values (db:import) and for callers that place
 * increments themselves. */
static int tl_counter_add_shard(lua_State *L) {
  tl_counter *h = tl_tocounter(L);
  tally_counter_info info;
  int isnum, rc;
  lua_Integer i = tl_tointx(L, 2, &isnum);
  lua_Integer n = tl_checkdelta(L, 3);
  rc = tally_counter_info_get(h->c, &info);
  if (rc < 0) return tl_incr_fail(L, h, rc);
  if (!isnum || i < 1 || i > (lua_Integer)info.shards)
    return luaL_argerror(L, 2, lua_pushfstring(L,
        "shard must be an integer from 1 to %d, got %s", (int)info.shards,
        tl_describe(L, 2)));
  rc = tally_counter_incr_shard(h->c, (uint32_t)(i - 1), (int64_t)n);
  if (rc < 0) return tl_incr_fail(L, h, rc);
  lua_pushboolean(L, 1);
  return 1;
}

static int tl_counter_reshard(lua_State *L) {
  tl_counter *h = tl_tocounter(L);
  uint32_t n = tl_checkshards(L, 2, 2);
  int rc = tally_counter_reshard(h->c, n);
  if (rc < 0) return tl_incr_fail(L, h, rc);
  lua_pushboolean(L, 1);
  return 1;
}

static int tl_counter_info(lua_State *L) {
  tl_counter *h = tl_tocounter(L);
  tally_counter_info info;
  int rc = tally_counter_info_get(h->c, &info);
  if (rc < 0) return tl_incr_fail(L, h, rc);
  lua_createtable(L, 0, 3);
  lua_pushlstring(L, h->name, h->namelen);
  lua_setfield(L, -2, "name");
  lua_pushinteger(L, (lua_Integer)info.shards);
  lua_setfield(L, -2, "shards");
  lua_pushstring(L, tl_policy_label(info.policy));
  lua_setfield(L, -2, "policy");
  return 1;
}

static int tl_counter_name(lua_State *L) {
  tl_counter *h = tl_tocounter(L);
  lua_pushlstring(L, h->name, h->namelen);
  return 1;
}

/* c:store(): the store handle the counter was opened on. */
static int tl_counter_store(lua_State *L) {
  tl_tocounter(L);
  tl_getuv(L, 1, TL_CUV_STORE);
  return 1;
}

static int tl_counter_close(lua_State *L) {
  tl_counter *h = (tl_counter *)tl_checkudata(L, 1, TL_COUNTER_MT);
  tl_counter_release(h);
  return 0;
}

static int tl_counter_tostring(lua_State *L) {
  tl_counter *h = (tl_counter *)tl_checkudata(L, 1, TL_COUNTER_MT);
  tally_counter_info info;
  if (h->c == NULL || h->db->store == NULL ||
      tally_counter_info_get(h->c, &info) < 0) {
    lua_pushliteral(L, "tally.counter (closed)");
    return 1;
  }
  lua_pushfstring(L, "tally.counter '%s' (%d shards, %s)", h->name,
                  (int)info.shards, tl_policy_label(info.policy));
  return 1;
}

/* ---- store: counters by name -------------------------------------------------- */

/* Push the cached handle for the name at arg 2 of the store at arg 1 if it
 * is open; else open it (creating it if create), cache and push it. Returns
 * 0, or a TALLY_E* code with nothing pushed. */
static int tl_cached(lua_State *L, int create) {
  size_t len;
  const char *name = lua_tolstring(L, 2, &len);
  tl_counter *h;
  int rc;
  tl_getuv(L, 1, TL_SUV_CACHE);
  lua_pushvalue(L, 2);
  lua_rawget(L, -2);
  h = (tl_counter *)lua_touserdata(L, -1);
  if (h != NULL && h->c != NULL) {
    lua_remove(L, -2);
    return 0;
  }
  lua_pop(L, 1);
  tl_checkname(L, 2, &len, "name");
  rc = tl_counter_push(L, 1, name, len, NULL, create ? TALLY_COUNTER_CREATE : 0, 0);
  if (rc < 0) {
    lua_pop(L, 1);
    return rc;
  }
  lua_pushvalue(L, 2);
  lua_pushvalue(L, -2);
  lua_rawset(L, -4);
  lua_remove(L, -2);
  return 0;
}

/* Forget the cached handle for the name at arg 2 (it stays usable). */
static void tl_uncache(lua_State *L) {
  tl_getuv(L, 1, TL_SUV_CACHE);
  lua_pushvalue(L, 2);
  lua_pushnil(L);
  lua_rawset(L, -3);
  lua_pop(L, 1);
}

/* db:incr of a name no counter has yet: an increment that would fail on
 * the new counter (beyond a shard's range, no key for the key policy)
 * fails before the counter is created, so a failing call leaves nothing
 * behind. Returns 0 to go on, or the count of nil, message, code pushed. */
static int tl_incr_new_fails(lua_State *L, tl_store *d, lua_Integer n) {
  size_t len;
  const char *name = lua_tolstring(L, 2, &len);
  tally_counter_options o;
  char msg[TALLY_NAME_MAX + 128];
  int rc = tally_family_resolve(d->store, name, len, &o);
  if (rc < 0) return tl_fail(L, rc);
  if (o.policy == TALLY_POLICY_KEY && lua_isnil(L, 4))
    luaL_argerror(L, 4, "key expected for a counter with the key policy");
  /* a new counter's shards are 0: n itself must fit [-2^62, 2^62) */
  if (n < -((lua_Integer)1 << 62) || n > ((lua_Integer)1 << 62) - 1) {
    snprintf(msg, sizeof msg, "counter '%.*s': adding %lld would overflow a shard "
             "(shards hold -2^62 to 2^62-1)", (int)len, name, (long long)n);
    return tl_fail_msg(L, TALLY_ERANGE, msg);
  }
  return 0;
}

static int tl_store_incr_(lua_State *L, int sign) {
  tl_store *d = tl_tostore(L);
  tl_counter *h;
  lua_Integer n;
  int isnum, rc, tries;
  if (TL_UNLIKELY(lua_type(L, 2) != LUA_TSTRING)) tl_typeerror(L, 2, "string");
  lua_settop(L, 4);               /* db name n key */
  n = tl_tointx(L, 3, &isnum);
  if (TL_UNLIKELY(!isnum)) n = tl_checkdelta(L, 3);
  if (sign < 0) n = tl_negate(n);
  for (tries = 0;; tries++) {
    tl_getuv(L, 1, TL_SUV_CACHE);  /* 5: cache */
    lua_pushvalue(L, 2);
    lua_rawget(L, 5);              /* 6: handle or nil */
    h = (tl_counter *)lua_touserdata(L, 6);
    if (TL_UNLIKELY(h == NULL || h->c == NULL)) {
      lua_settop(L, 4);
      rc = tl_cached(L, 0);          /* an existing counter */
      if (rc == TALLY_ENOENT) {      /* else create it, unless the add would fail */
        if ((rc = tl_incr_new_fails(L, d, n)) != 0) return rc;
        rc = tl_cached(L, 1);
      }
      if (rc < 0) return tl_fail(L, rc);
      h = (tl_counter *)lua_touserdata(L, -1);
      lua_pushnil(L);              /* keep the handle at 6 */
      lua_insert(L, 5);
    }
    if (TL_LIKELY(h->policy < TALLY_POLICY_KEY))
      rc = tally_counter_incr(h->c, (int64_t)n);
    else
      rc = tl_incr_policy(L, h, 6, 4, n);
    if (TL_LIKELY(rc == 0)) break;
    if (rc != TALLY_EDROPPED || tries > 0) return tl_incr_fail(L, h, rc);
    tl_uncache(L);                 /* dropped: reopen (and recreate) once */
    lua_settop(L, 4);
  }
  lua_pushboolean(L, 1);
  return 1;
}

static int tl_store_incr(lua_State *L) { return tl_store_incr_(L, 1); }
static int tl_store_decr(lua_State *L) { return tl_store_incr_(L, -1); }

static int tl_no_such(lua_State *L, int rc) {
  if (rc == TALLY_ENOENT || rc == TALLY_EDROPPED)
    return tl_fail_msg(L, TALLY_ENOENT,
                       lua_pushfstring(L, "no such counter '%s'", lua_tostring(L, 2)));
  return tl_fail(L, rc);
}

static int tl_store_value(lua_State *L) {
  int64_t v;
  int rc, tries;
  tl_tostore(L);
  tl_checkstring(L, 2, NULL);
  lua_settop(L, 2);
  for (tries = 0;; tries++) {
    tl_counter *h;
    rc = tl_cached(L, 0);
    if (rc < 0) return tl_no_such(L, rc);
    h = (tl_counter *)lua_touserdata(L, -1);
    rc = tally_counter_value(h->c, &v);
    if (rc == 0) break;
    if (rc != TALLY_EDROPPED || tries > 0) return tl_incr_fail(L, h, rc);
    tl_uncache(L);
    lua_settop(L, 2);
  }
  tl_pushint64(L, (int64_t)v);
  return 1;
}

/* The message for TALLY_EMISMATCH: what the counter is, what was asked. */
static int tl_mismatch(lua_State *L, tl_store *d, const char *name, size_t len,
                       const tally_counter_options *o) {
  tally_counter *c;
  tally_counter_info info;
  char asked[96];
  int rc = tally_counter_open(d->store, name, len, NULL, 0, &c);
  if (rc < 0) return tl_fail(L, rc);
  rc = tally_counter_info_get(c, &info);
  tally_counter_close(c);
  if (rc < 0) return tl_fail(L, rc);
  asked[0] = '\0';
  if (o->shards != 0 && o->shards != info.shards)
    snprintf(asked, sizeof(asked), "%u shards", (unsigned)o->shards);
  if (o->policy >= 0 && o->policy != info.policy) {
    size_t used = strlen(asked);
    snprintf(asked + used, sizeof(asked) - used, "%spolicy %s",
             used ? " and " : "", tl_policy_label(o->policy));
  }
  return luaL_error(L, "counter '%s' exists with %d shards and policy %s (asked for %s)",
                    name, (int)info.shards, tl_policy_label(info.policy),
                    asked[0] ? asked : "different options");
}

static int tl_store_counter(lua_State *L) {
  tl_store *d = tl_tostore(L);
  tally_counter_options o;
  size_t len;
  const char *name = tl_checkname(L, 2, &len, "name");
  int rc, fnidx, create = 1;
  tl_counter *h, *old;
  lua_settop(L, 3);
  tl_checkcounteropts(L, 3, &o, &create);   /* 4: policy function or nil */
  fnidx = lua_isnil(L, 4) ? 0 : 4;
  rc = tl_counter_push(L, 1, name, len, &o, create ? TALLY_COUNTER_CREATE : 0, fnidx);
  if (rc == TALLY_EMISMATCH) return tl_mismatch(L, d, name, len, &o);
  if (rc == TALLY_ENOENT) return tl_no_such(L, rc);
  if (rc < 0) return tl_fail(L, rc);
  h = (tl_counter *)lua_touserdata(L, -1);
  /* db:incr(name) uses this handle too, unless a better one is cached */
  tl_getuv(L, 1, TL_SUV_CACHE);
  lua_pushvalue(L, 2);
  lua_rawget(L, -2);
  old = (tl_counter *)lua_touserdata(L, -1);
  lua_pop(L, 1);
  if (old == NULL || old->c == NULL || (h->hasfn && !old->hasfn)) {
    lua_pushvalue(L, 2);
    lua_pushvalue(L, -3);
    lua_rawset(L, -3);
  }
  lua_pop(L, 1);
  return 1;
}

static int tl_store_drop(lua_State *L) {
  tl_store *d = tl_tostore(L);
  size_t len;
  const char *name = tl_checkname(L, 2, &len, "name");
  int rc = tally_store_drop(d->store, name, len);
  if (rc < 0) return tl_no_such(L, rc);
  tl_uncache(L);
  lua_pushboolean(L, 1);
  return 1;
}

static int tl_store_family(lua_State *L) {
  tl_store *d = tl_tostore(L);
  tally_counter_options o;
  size_t plen;
  const char *pattern = tl_checkname(L, 2, &plen, "pattern");
  lua_Integer i, j, n;
  int rc;
  lua_settop(L, 3);
  tl_checkcounteropts(L, 3, &o, NULL);   /* 4: policy function or nil */
  rc = tally_family_set(d->store, pattern, plen, &o);
  if (rc < 0) return tl_fail(L, rc);
  /* the store's function families: { pattern1, fn1, pattern2, fn2, ... } */
  tl_getuv(L, 1, TL_SUV_FAMILIES); /* 5 */
  n = (lua_Integer)lua_rawlen(L, 5);
  for (i = 1, j = 1; i < n; i += 2) {
    lua_rawgeti(L, 5, i);
    if (lua_rawequal(L, -1, 2)) {
      lua_pop(L, 1);
      continue;
    }
    lua_rawseti(L, 5, j);
    lua_rawgeti(L, 5, i + 1);
    lua_rawseti(L, 5, j + 1);
    j += 2;
  }
  for (i = n; i >= j; i--) {
    lua_pushnil(L);
    lua_rawseti(L, 5, i);
  }
  if (o.policy == TALLY_POLICY_CUSTOM) {
    lua_pushvalue(L, 2);
    lua_rawseti(L, 5, j);
    lua_pushvalue(L, 4);
    lua_rawseti(L, 5, j + 1);
  }
  lua_pushboolean(L, 1);
  return 1;
}

static const char *tl_optpattern(lua_State *L, int arg, size_t *len) {
  if (lua_isnoneornil(L, arg)) {
    *len = 0;
    return NULL;
  }
  return tl_checkstring(L, arg, len);
}

static int tl_store_sum(lua_State *L) {
  tl_store *d = tl_tostore(L);
  size_t plen;
  const char *pattern = tl_optpattern(L, 2, &plen);
  int64_t sum;
  uint64_t count;
  int rc = tally_store_sum(d->store, pattern, plen, &sum, &count);
  if (rc < 0) return tl_fail(L, rc);
  tl_pushint64(L, (int64_t)sum);
  tl_pushint64(L, (int64_t)count);
  return 2;
}

typedef struct tl_names {
  char **v;
  size_t *lens;
  size_t n, cap;
} tl_names;

/* Collect into C memory: no Lua error may unwind through the core. */
static int tl_names_add(void *ud, const char *name, size_t len) {
  tl_names *a = (tl_names *)ud;
  char *s;
  if (a->n == a->cap) {
    size_t cap = a->cap ? a->cap * 2 : 64;
    char **v = (char **)realloc(a->v, cap * sizeof(*v));
    size_t *lens;
    if (v == NULL) return TALLY_ENOMEM;
    a->v = v;
    lens = (size_t *)realloc(a->lens, cap * sizeof(*lens));
    if (lens == NULL) return TALLY_ENOMEM;
    a->lens = lens;
    a->cap = cap;
  }
  s = (char *)malloc(len + sizeof(size_t) + 1);
  if (s == NULL) return TALLY_ENOMEM;
  memcpy(s, &len, sizeof(size_t));
  memcpy(s + sizeof(size_t), name, len);
  s[sizeof(size_t) + len] = '\0';
  a->v[a->n++] = s;
  return 0;
}

static int tl_names_cmp(const void *pa, const void *pb) {
  const char *a = *(const char *const *)pa, *b = *(const char *const *)pb;
  size_t la, lb;
  int r;
  memcpy(&la, a, sizeof(size_t));
  memcpy(&lb, b, sizeof(size_t));
  r = memcmp(a + sizeof(size_t), b + sizeof(size_t), la < lb ? la : lb);
  return r != 0 ? r : (la > lb) - (la < lb);
}

static int tl_store_names(lua_State *L) {
  tl_store *d = tl_tostore(L);
  size_t plen, i;
  const char *pattern = tl_optpattern(L, 2, &plen);
  tl_names a = { NULL, NULL, 0, 0 };
  int rc = tally_store_each(d->store, pattern, plen, tl_names_add, &a);
  if (rc == 0) {
    if (a.n > 1) qsort(a.v, a.n, sizeof(*a.v), tl_names_cmp);  /* a.v is NULL when empty */
    if (!lua_checkstack(L, 4)) rc = TALLY_ENOMEM;
  }
  if (rc == 0) {
    /* pushing can only fail on memory; the strings are freed after */
    lua_createtable(L, a.n > INT32_MAX ? INT32_MAX : (int)a.n, 0);
    for (i = 0; i < a.n; i++) {
      size_t len;
      memcpy(&len, a.v[i], sizeof(size_t));
      lua_pushlstring(L, a.v[i] + sizeof(size_t), len);
      lua_rawseti(L, -2, (lua_Integer)i + 1);
    }
  }
  for (i = 0; i < a.n; i++) free(a.v[i]);
  free(a.v);
  free(a.lens);
  if (rc == TALLY_ENOMEM) return luaL_error(L, "not enough memory");
  if (rc < 0) return tl_fail(L, rc);
  return 1;
}

static int tl_store_sync(lua_State *L) {
  tl_store *d = tl_tostore(L);
  int rc = tally_store_sync(d->store);
  if (rc < 0) return tl_fail(L, rc);
  lua_pushboolean(L, 1);
  return 1;
}

static int tl_store_check(lua_State *L) {
  tl_store *d = tl_tostore(L);
  int rc = tally_store_check(d->store);
  if (rc < 0) return tl_fail(L, rc);
  lua_pushboolean(L, 1);
  return 1;
}

static int tl_store_stats(lua_State *L) {
  tl_store *d = tl_tostore(L);
  tally_store_stats st;
  int rc = tally_store_stats_get(d->store, &st);
  if (rc < 0) return tl_fail(L, rc);
  lua_createtable(L, 0, 5);
  lua_pushstring(L, tally_store_kind(d->store));
  lua_setfield(L, -2, "kind");
  tl_pushint64(L, (int64_t)st.counters);
  lua_setfield(L, -2, "counters");
  tl_pushint64(L, (int64_t)st.file_bytes);
  lua_setfield(L, -2, "file_bytes");
  tl_pushint64(L, (int64_t)st.used_bytes);
  lua_setfield(L, -2, "used_bytes");
  tl_pushint64(L, (int64_t)st.retired_bytes);
  lua_setfield(L, -2, "retired_bytes");
  return 1;
}

static int tl_store_close(lua_State *L) {
  tl_store *d = (tl_store *)tl_checkudata(L, 1, TL_STORE_MT);
  tl_store_release(d);
  return 0;
}

static int tl_store_tostring(lua_State *L) {
  tl_store *d = (tl_store *)tl_checkudata(L, 1, TL_STORE_MT);
  if (d->store == NULL) lua_pushliteral(L, "tally.store (closed)");
  else lua_pushfstring(L, "tally.store (%s)", d->spec);
  return 1;
}

/* ---- module --------------------------------------------------------------------- */

static int tl_open(lua_State *L) {
  size_t len = 6;
  const char *spec = "memory";
  tally_open_options o = { 0600, 0 };
  tally_store *s;
  tl_store *d;
  int rc;

  if (!lua_isnoneornil(L, 1)) spec = tl_checkstring(L, 1, &len);
  if (!((len == 6 && memcmp(spec, "memory", 6) == 0) ||
        (len > 5 && memcmp(spec, "file:", 5) == 0 && strlen(spec) == len)))
    luaL_argerror(L, 1, lua_pushfstring(L,
        "unknown store '%s' (expected 'memory' or 'file:PATH')", spec));
  if (!lua_isnoneornil(L, 2)) {
    if (!lua_istable(L, 2)) tl_typeerror(L, 2, "table");
    lua_pushnil(L);
    while (lua_next(L, 2) != 0) {
      const char *k = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : "";
      if (strcmp(k, "mode") == 0) {
        lua_Integer m = 0;
        int isnum = 0;
        if (lua_type(L, -1) == LUA_TNUMBER) m = tl_tointx(L, -1, &isnum);
        if (!isnum || m < 0 || m > 07777)
          luaL_argerror(L, 2, lua_pushfstring(L,
              "mode must be an integer from 0 to 4095 (permission bits), got %s",
              tl_describe(L, -1)));
        o.mode = (uint32_t)m;
      } else if (strcmp(k, "create") == 0) {
        if (!lua_isboolean(L, -1))
          luaL_argerror(L, 2, lua_pushfstring(L, "create must be a boolean, got %s",
                                              tl_describe(L, -1)));
        if (!lua_toboolean(L, -1)) o.flags |= TALLY_OPEN_NOCREATE;
      } else if (strcmp(k, "trust") == 0) {  /* a symlink, another user's file */
        if (!lua_isboolean(L, -1))
          luaL_argerror(L, 2, lua_pushfstring(L, "trust must be a boolean, got %s",
                                              tl_describe(L, -1)));
        if (lua_toboolean(L, -1)) o.flags |= TALLY_OPEN_TRUST;
      } else {
        luaL_argerror(L, 2, lua_pushfstring(L, "unknown option %s", tl_describe(L, -2)));
      }
      lua_pop(L, 1);
    }
    if (o.mode == 0) o.mode = 0600;
  }

  d = (tl_store *)tl_newud(L, sizeof(*d) + len + 1, TL_SUV_N);
  memset(d, 0, sizeof(*d));
  d->key = (uintptr_t)d ^ TL_STORE_SALT;
  d->speclen = len;
  memcpy(d->spec, spec, len);
  d->spec[len] = '\0';
  luaL_setmetatable(L, TL_STORE_MT);
  lua_newtable(L);                        /* the weak cache of counters by name */
  lua_createtable(L, 0, 1);
  lua_pushliteral(L, "v");
  lua_setfield(L, -2, "__mode");
  lua_setmetatable(L, -2);
  tl_setuv(L, -2, TL_SUV_CACHE);
  lua_newtable(L);                        /* function families */
  tl_setuv(L, -2, TL_SUV_FAMILIES);

  rc = tally_store_open(d->spec, &o, &s);
  if (rc < 0) return tl_fail(L, rc);
  d->store = s;
  return 1;
}

static const luaL_Reg tl_counter_methods[] = {
  { "incr", tl_counter_incr },
  { "decr", tl_counter_decr },
  { "value", tl_counter_value },
  { "shards", tl_counter_shards },
  { "reset", tl_counter_reset },
  { "reshard", tl_counter_reshard },
  { "add_shard", tl_counter_add_shard },
  { "info", tl_counter_info },
  { "name", tl_counter_name },
  { "store", tl_counter_store },
  { "close", tl_counter_close },
  { "_nop", tl_counter_nop },
  { NULL, NULL }
};

static const luaL_Reg tl_counter_meta[] = {
  { "__gc", tl_counter_close },
  { "__close", tl_counter_close },
  { "__tostring", tl_counter_tostring },
  { NULL, NULL }
};

static const luaL_Reg tl_store_methods[] = {
  { "counter", tl_store_counter },
  { "incr", tl_store_incr },
  { "decr", tl_store_decr },
  { "value", tl_store_value },
  { "drop", tl_store_drop },
  { "family", tl_store_family },
  { "sum", tl_store_sum },
  { "names", tl_store_names },
  { "sync", tl_store_sync },
  { "check", tl_store_check },
  { "stats", tl_store_stats },
  { "close", tl_store_close },
  { NULL, NULL }
};

static const luaL_Reg tl_store_meta[] = {
  { "__gc", tl_store_close },
  { "__close", tl_store_close },
  { "__tostring", tl_store_tostring },
  { NULL, NULL }
};

/* Create (or reuse) metatable tname and its __index table of methods;
 * leaves the methods table on the stack. */
static void tl_newclass(lua_State *L, const char *tname, const luaL_Reg *meta,
                        const luaL_Reg *methods) {
  if (luaL_newmetatable(L, tname)) {
    luaL_setfuncs(L, meta, 0);
#if TL_LUAJIT
    lua_pushstring(L, tname);             /* 5.4's luaL_newmetatable does it */
    lua_setfield(L, -2, "__name");
#endif
    lua_newtable(L);
    luaL_setfuncs(L, methods, 0);
    lua_setfield(L, -2, "__index");
  }
  lua_getfield(L, -1, "__index");
  lua_remove(L, -2);
}

#if TL_LUAJIT
/* ---- LuaJIT: what lua/tally/ffi.lua needs ------------------------------------- */

/* core._store_cache(db) -> the store's weak cache of counter handles by
 * name (the one db:incr(name) uses), so the FFI path shares it. */
static int tl_store_cache(lua_State *L) {
  tl_checkudata(L, 1, TL_STORE_MT);
  tl_getuv(L, 1, TL_SUV_CACHE);
  return 1;
}

/* core._ffi_info() -> { path = the file this module was loaded from,
 * incr = tally_counter_incr as a light userdata (to check that ffi.load
 * found this very copy), counter_c / counter_policy / counter_size (the
 * layout of a counter handle, which the FFI path reads) }. */
static int tl_ffi_info(lua_State *L) {
  Dl_info info;
  lua_createtable(L, 0, 5);
  if (dladdr((void *)tl_ffi_info, &info) != 0 && info.dli_fname != NULL) {
    lua_pushstring(L, info.dli_fname);
    lua_setfield(L, -2, "path");
  }
  lua_pushlightuserdata(L, (void *)tally_counter_incr);
  lua_setfield(L, -2, "incr");
  lua_pushinteger(L, (lua_Integer)offsetof(tl_counter, c));
  lua_setfield(L, -2, "counter_c");
  lua_pushinteger(L, (lua_Integer)offsetof(tl_counter, policy));
  lua_setfield(L, -2, "counter_policy");
  lua_pushinteger(L, (lua_Integer)sizeof(tl_counter));
  lua_setfield(L, -2, "counter_size");
  return 1;
}

/* The classic methods that the FFI path replaces, for it to fall back on
 * (the method tables outlive a reload of the module; this table does not). */
static void tl_classic_register(lua_State *L) {
  static const luaL_Reg classic[] = {
    { "counter_incr", tl_counter_incr },
    { "counter_decr", tl_counter_decr },
    { "counter_value", tl_counter_value },
    { "store_incr", tl_store_incr },
    { "store_decr", tl_store_decr },
    { "store_value", tl_store_value },
    { NULL, NULL }
  };
  lua_newtable(L);
  luaL_setfuncs(L, classic, 0);
  lua_setfield(L, -2, "_classic");
  lua_pushcfunction(L, tl_set_box);
  lua_setfield(L, -2, "set_box");
  lua_pushcfunction(L, tl_store_cache);
  lua_setfield(L, -2, "_store_cache");
  lua_pushcfunction(L, tl_ffi_info);
  lua_setfield(L, -2, "_ffi_info");
}
#endif

TL_EXPORT int luaopen_tally_core(lua_State *L) {
  tl_checkversion(L);
  lua_newtable(L);
  tl_newclass(L, TL_STORE_MT, tl_store_meta, tl_store_methods);
  lua_setfield(L, -2, "store_methods");
  tl_newclass(L, TL_COUNTER_MT, tl_counter_meta, tl_counter_methods);
  lua_setfield(L, -2, "counter_methods");
  lua_pushcfunction(L, tl_open);
  lua_setfield(L, -2, "open");
  lua_pushliteral(L, TALLY_VERSION);
  lua_setfield(L, -2, "version");
  lua_pushinteger(L, TALLY_MAX_SHARDS);
  lua_setfield(L, -2, "MAX_SHARDS");
  lua_pushinteger(L, TALLY_NAME_MAX);
  lua_setfield(L, -2, "NAME_MAX");
  lua_pushinteger(L, TALLY_DEFAULT_SHARDS);
  lua_setfield(L, -2, "DEFAULT_SHARDS");
  tl_rollup_register(L);
  tl_sender_register(L);
  tl_redis_register(L);
#if TL_LUAJIT
  tl_classic_register(L);
#endif
  return 1;
}
