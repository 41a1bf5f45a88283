/* lua_counter.c -- the counter handle (metatable "tally.counter").
 *
 * A counter handle holds the tally_counter pointer, a copy of its name and
 * policy, and a link in its store's list of open handles, so that
 * db:close() can close every counter before the store as the C API
 * requires. Its user values keep the store handle alive and hold the
 * policy function. The store (lua_store.c) opens counter handles with
 * tl_counter_push and adds through tl_counter_incr_policy; nothing here
 * calls into the store's file.
 *
 * The hot path (c:incr) trusts the first argument after one cheap check
 * (a salted self-pointer, which also tells the two handle types apart) and
 * falls back to tl_checkcounter only to raise the proper error. Under
 * LuaJIT, lua/tally/ffi.lua reads the handle's layout (core._ffi_info) and
 * replaces c:incr, c:decr and c:value with FFI calls that fall back on the
 * classic functions here.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "lua_aux.h"
#if TL_LUAJIT
#include <dlfcn.h> /* dladdr: core._ffi_info().path */
#endif

static const char *const tl_policy_names[] = {"thread", "random", "round_robin", "key",
                                              NULL};

/* ---- options ----------------------------------------------------------------- */

const char *tl_policy_label(int32_t policy) {
  if (policy >= 0 && policy < TALLY_POLICY_CUSTOM) return tl_policy_names[policy];
  if (policy == TALLY_POLICY_SLOT) return "slot";
  if (policy == TALLY_POLICY_CPU) return "cpu";
  return policy == TALLY_POLICY_CUSTOM ? "function" : "?";
}

/* Validate the shard count at vidx; messages name argument arg. */
static uint32_t tl_checkshards(lua_State *L, int vidx, int arg, int allow_auto) {
  lua_Integer n = 0;
  int isnum = 0;
  if (lua_type(L, vidx) == LUA_TNUMBER) n = tl_tointx(L, vidx, &isnum);
  if (!isnum || n < 1 || n > TALLY_MAX_SHARDS)
    tl_argerror(L, arg, "shards must be an integer from 1 to %d%s, got %s",
                TALLY_MAX_SHARDS, allow_auto ? " or \"auto\"" : "",
                tl_describe(L, vidx, TL_BOOL_VALUE));
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
    if (strcmp(s, "slot") == 0) return TALLY_POLICY_SLOT;
    if (strcmp(s, "cpu") == 0) return TALLY_POLICY_CPU;
  }
  tl_argerror(
      L, arg,
      "policy must be one of thread, random, round_robin, key, slot, cpu or a function, "
      "got %s",
      tl_describe(L, vidx, TL_BOOL_VALUE));
  return -1;
}

/* Counter and family options (see lua_aux.h): used by db:counter and
 * db:family. */
void tl_checkcounteropts(lua_State *L, int arg, tally_counter_options *o, int *create) {
  o->shards = 0;
  o->policy = -1;
  if (lua_isnoneornil(L, arg)) {
    lua_pushnil(L);
    return;
  }
  if (!lua_istable(L, arg)) tl_typeerror(L, arg, "table");
  lua_getfield(L, arg, "shards");
  if (lua_type(L, -1) == LUA_TSTRING && strcmp(lua_tostring(L, -1), "auto") == 0)
    o->shards = TALLY_SHARDS_AUTO;
  else if (!lua_isnil(L, -1))
    o->shards = tl_checkshards(L, lua_gettop(L), arg, 1);
  lua_pop(L, 1);
  lua_pushnil(L);
  while (lua_next(L, arg) != 0) {
    const char *k = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : NULL;
    if (k != NULL && create != NULL && strcmp(k, "create") == 0) {
      if (lua_type(L, -1) == LUA_TSTRING && strcmp(lua_tostring(L, -1), "new") == 0)
        *create = 2; /* a new counter only */
      else if (lua_type(L, -1) != LUA_TBOOLEAN)
        luaL_argerror(L, arg, "create must be a boolean or \"new\"");
      else
        *create = lua_toboolean(L, -1);
    } else if (k == NULL || (strcmp(k, "shards") != 0 && strcmp(k, "policy") != 0)) {
      tl_argerror(L, arg, "unknown option %s", tl_describe(L, -2, TL_BOOL_VALUE));
    }
    lua_pop(L, 1);
  }
  lua_getfield(L, arg, "policy");
  if (!lua_isnil(L, -1)) o->policy = tl_checkpolicy(L, lua_gettop(L), arg);
  if (o->shards == TALLY_SHARDS_AUTO && o->policy >= TALLY_POLICY_KEY &&
      o->policy != TALLY_POLICY_SLOT && o->policy != TALLY_POLICY_CPU)
    luaL_argerror(L, arg,
                  "shards = \"auto\" needs a policy that picks the shard itself "
                  "(thread, random or round_robin)");
  if (o->policy != TALLY_POLICY_CUSTOM) {
    lua_pop(L, 1);
    lua_pushnil(L);
  }
}

/* ---- the handle ------------------------------------------------------------------ */

/* The counter at argument 1, open; raises otherwise. */
static tl_counter *tl_tocounter(lua_State *L) {
  tl_counter *h = (tl_counter *)lua_touserdata(L, 1);
  if (TL_UNLIKELY(h == NULL || lua_type(L, 1) != LUA_TUSERDATA ||
                  h->key != ((uintptr_t)h ^ TL_COUNTER_SALT) || h->c == NULL))
    return tl_checkcounter(L, 1);
  return h;
}

void tl_counter_release(tl_counter *h) {
  if (h->c == NULL) return;
  if (h->prev != NULL)
    h->prev->next = h->next;
  else
    h->db->counters = h->next;
  if (h->next != NULL) h->next->prev = h->prev;
  h->prev = h->next = NULL;
  tl_slot_unlend(h);
  tally_counter_close(h->c);
  h->c = NULL;
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

/* Open counter name on the store at dbidx and push its handle (see
 * lua_aux.h). */
int tl_counter_push(lua_State *L, int dbidx, const char *name, size_t len,
                    const tally_counter_options *opt, uint32_t flags, int fnidx) {
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

  /* a counter dropped by another process between the open and its info
   * (EDROPPED), or expired (ENOENT: its handle's info does not bring it
   * back): opened (so created) again when the open may create */
  for (int tries = 0;; tries++) {
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
    if (rc == 0) break;
    tl_counter_release(h);
    if ((rc != TALLY_EDROPPED && rc != TALLY_ENOENT) || !(flags & TALLY_COUNTER_CREATE) ||
        tries >= TL_DROP_RETRIES) {
      lua_pop(L, 1);
      return rc;
    }
  }
  h->policy = info.policy;
  if (h->policy == TALLY_POLICY_CUSTOM) {
    if (fnidx != 0)
      lua_pushvalue(L, fnidx);
    else
      tl_family_fn(L, dbidx, name, len);
    h->hasfn = !lua_isnil(L, -1);
    tl_setuv(L, -2, TL_CUV_POLICY);
  }
  return 0;
}

/* ---- increments -------------------------------------------------------------- */

void tl_checkkey(lua_State *L, int kidx) {
  int t = lua_type(L, kidx);
  if (t == LUA_TNIL)
    luaL_argerror(L, kidx, "key expected for a counter with the key policy");
  if (t != LUA_TSTRING && t != LUA_TNUMBER) tl_typeerror(L, kidx, "string or number");
}

/* Key and function policies: the counter handle is at hidx, the key at kidx. */
int tl_counter_incr_policy(lua_State *L, tl_counter *h, int hidx, int kidx,
                           lua_Integer n) {
  if (lua_gettop(L) < kidx) lua_settop(L, kidx); /* pushes below stay above it */
  if (h->policy == TALLY_POLICY_KEY) {
    size_t klen;
    const char *k;
    tl_checkkey(L, kidx);
    lua_pushvalue(L, kidx);
    k = lua_tolstring(L, -1, &klen); /* left on the stack: it stays alive */
    return tally_counter_incr_key(h->c, k, klen, (int64_t)n);
  }
  if (h->policy == TALLY_POLICY_CUSTOM) {
    tally_counter_info info;
    lua_Integer s;
    int isnum, rc;
    if (!h->hasfn)
      tl_error(L,
               "counter '%s' has a function policy: "
               "pass it as policy = function to db:counter",
               h->name);
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
      tl_error(L,
               "policy function for '%s' returned %s "
               "(expected an integer from 1 to %d)",
               h->name, tl_describe(L, -1, TL_BOOL_VALUE), (int)info.shards);
    lua_pop(L, 1);
    return tally_counter_incr_shard(h->c, (uint32_t)(s - 1), (int64_t)n);
  }
  return tally_counter_incr(h->c, (int64_t)n);
}

int tl_counter_fail(lua_State *L, tl_counter *h, int rc) {
  if (rc == TALLY_EDROPPED)
    return tl_fail_msg(L, rc, lua_pushfstring(L, "counter '%s' was dropped", h->name));
  return tl_fail(L, rc);
}

static int tl_counter_incr_(lua_State *L, int sign) {
  tl_counter *h = tl_tocounter(L);
  int isnum, rc;
  lua_Integer n = tl_tointx(L, 2, &isnum);
  if (TL_UNLIKELY(!isnum)) n = tl_checkdelta(L, 2);
  if (sign < 0) {
    if (TL_UNLIKELY(n == (lua_Integer)INT64_MIN)) return tl_fail_negate(L, h->name);
    n = tl_negate(n);
  }
  if (TL_LIKELY(tl_policy_plain(h->policy)))
    rc = tally_counter_incr(h->c, (int64_t)n);
  else
    rc = tl_counter_incr_policy(L, h, 1, 3, n);
  if (TL_UNLIKELY(rc < 0)) return tl_counter_fail(L, h, rc);
  lua_pushboolean(L, 1);
  return 1;
}

static int tl_counter_incr(lua_State *L) {
  return tl_counter_incr_(L, 1);
}
static int tl_counter_decr(lua_State *L) {
  return tl_counter_incr_(L, -1);
}
static int tl_counter_nop(lua_State *L) {
  (void)L;
  return 0;
}

/* ---- counter methods --------------------------------------------------------- */

static int tl_counter_value_opts(lua_State *L);

static int tl_counter_value(lua_State *L) {
  tl_counter *h = tl_tocounter(L);
  int64_t v;
  int rc;
  if (TL_UNLIKELY(lua_gettop(L) >= 2 && !lua_isnil(L, 2)))
    return tl_counter_value_opts(L);
  rc = tally_counter_value(h->c, &v);
  if (rc < 0) return tl_counter_fail(L, h, rc);
  tl_pushint64(L, (int64_t)v);
  return 1;
}

static int tl_counter_shards(lua_State *L) {
  tl_counter *h = tl_tocounter(L);
  int64_t vals[TALLY_MAX_SHARDS];
  uint32_t n = 0, i;
  int rc = tally_counter_shards(h->c, vals, TALLY_MAX_SHARDS, &n);
  if (rc < 0) return tl_counter_fail(L, h, rc);
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
  if (rc < 0) return tl_counter_fail(L, h, rc);
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
  if (rc < 0) return tl_counter_fail(L, h, rc);
  if (!isnum || i < 1 || i > (lua_Integer)info.shards)
    return tl_argerror(L, 2, "shard must be an integer from 1 to %d, got %s",
                       (int)info.shards, tl_describe(L, 2, TL_BOOL_VALUE));
  rc = tally_counter_incr_shard(h->c, (uint32_t)(i - 1), (int64_t)n);
  if (rc < 0) return tl_counter_fail(L, h, rc);
  lua_pushboolean(L, 1);
  return 1;
}

static int tl_counter_reshard(lua_State *L) {
  tl_counter *h = tl_tocounter(L);
  uint32_t n = tl_checkshards(L, 2, 2, 0);
  int rc = tally_counter_reshard(h->c, n);
  if (rc < 0) return tl_counter_fail(L, h, rc);
  lua_pushboolean(L, 1);
  return 1;
}

static int tl_counter_info(lua_State *L) {
  tl_counter *h = tl_tocounter(L);
  tally_counter_info info;
  char inc[17];
  int rc;
  memset(&info, 0, sizeof info); /* a core that leaves a field unset says 0 */
  rc = tally_counter_info_get(h->c, &info);
  if (rc < 0) return tl_counter_fail(L, h, rc);
  lua_createtable(L, 0, 4);
  lua_pushlstring(L, h->name, h->namelen);
  lua_setfield(L, -2, "name");
  lua_pushinteger(L, (lua_Integer)info.shards);
  lua_setfield(L, -2, "shards");
  lua_pushstring(L, tl_policy_label(info.policy));
  lua_setfield(L, -2, "policy");
  if (info.policy == TALLY_POLICY_CPU) { /* which path this thread's adds take */
    lua_pushboolean(L, info.rseq);
    lua_setfield(L, -2, "rseq");
  }
  /* all 64 bits, which no Lua number holds under LuaJIT: as hex text */
  snprintf(inc, sizeof inc, "%016llx", (unsigned long long)info.incarnation);
  lua_pushstring(L, inc);
  lua_setfield(L, -2, "incarnation");
  if (info.name &&
      (info.name_len != h->namelen || memcmp(info.name, h->name, h->namelen) != 0)) {
    lua_pushlstring(L, info.name, info.name_len); /* a capped family's overflow counter */
    lua_setfield(L, -2, "overflow");
  }
  if (info.auto_shards) { /* only then: and the engine's reshards so far */
    lua_pushboolean(L, 1);
    lua_setfield(L, -2, "auto");
    lua_pushinteger(L, (lua_Integer)info.grown);
    lua_setfield(L, -2, "grown");
    lua_pushinteger(L, (lua_Integer)info.shrunk);
    lua_setfield(L, -2, "shrunk");
  }
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
  tl_slot_return(L, 1);
  tl_counter_release(h);
  return 0;
}

static int tl_counter_tostring(lua_State *L) {
  tl_counter *h = (tl_counter *)tl_checkudata(L, 1, TL_COUNTER_MT);
  tally_counter_info info;
  if (h->c == NULL || h->db->store == NULL || tally_counter_info_get(h->c, &info) < 0) {
    lua_pushliteral(L, "tally.counter (closed)");
    return 1;
  }
  lua_pushfstring(L, "tally.counter '%s' (%d%s shards, %s)", h->name, (int)info.shards,
                  info.auto_shards ? " auto" : "", tl_policy_label(info.policy));
  return 1;
}

/* c:value(opts): the Lua function registered as core.set_value_opts does
 * the work (it knows the store's clock); C keeps c:value() itself fast. */
static int tl_counter_value_opts(lua_State *L) {
  lua_settop(L, 2);
  lua_getfield(L, LUA_REGISTRYINDEX, "tally.value_opts");
  if (lua_type(L, -1) != LUA_TFUNCTION)
    return luaL_argerror(L, 2, "no options expected (require \"tally\" for max_age)");
  lua_insert(L, 1);
  lua_call(L, 2, LUA_MULTRET);
  return lua_gettop(L);
}

static int tl_set_value_opts(lua_State *L) {
  luaL_checktype(L, 1, LUA_TFUNCTION);
  lua_pushvalue(L, 1);
  lua_setfield(L, LUA_REGISTRYINDEX, "tally.value_opts");
  return 0;
}

#if TL_LUAJIT
/* core._ffi_info() -> { path = the file this module was loaded from,
 * incr = tally_counter_incr as a light userdata (to check that ffi.load
 * found this very copy), counter_c / counter_db / counter_policy /
 * counter_slot1 / counter_size (the layout of a counter handle) and store_key /
 * store_store / store_size (of a store handle), which the FFI path reads;
 * offsets and sizes in bytes }. */
static int tl_ffi_info(lua_State *L) {
  Dl_info info;
  lua_createtable(L, 0, 10);
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
  lua_pushinteger(L, (lua_Integer)offsetof(tl_counter, slot1));
  lua_setfield(L, -2, "counter_slot1");
  lua_pushinteger(L, (lua_Integer)sizeof(tl_counter));
  lua_setfield(L, -2, "counter_size");
  lua_pushinteger(L, (lua_Integer)offsetof(tl_counter, db));
  lua_setfield(L, -2, "counter_db");
  lua_pushinteger(L, (lua_Integer)offsetof(tl_store, key));
  lua_setfield(L, -2, "store_key");
  lua_pushinteger(L, (lua_Integer)offsetof(tl_store, store));
  lua_setfield(L, -2, "store_store");
  lua_pushinteger(L, (lua_Integer)offsetof(tl_store, vec));
  lua_setfield(L, -2, "store_vec");
  lua_pushinteger(L, (lua_Integer)offsetof(tl_hist, h));
  lua_setfield(L, -2, "hist_h");
  /* without spec[]: the least a store handle holds */
  lua_pushinteger(L, (lua_Integer)sizeof(tl_store));
  lua_setfield(L, -2, "store_size");
  return 1;
}
#endif

/* ---- the class ------------------------------------------------------------------ */

static const luaL_Reg tl_counter_methods[] = {{"incr", tl_counter_incr},
                                              {"decr", tl_counter_decr},
                                              {"value", tl_counter_value},
                                              {"shards", tl_counter_shards},
                                              {"reset", tl_counter_reset},
                                              {"reshard", tl_counter_reshard},
                                              {"add_shard", tl_counter_add_shard},
                                              {"info", tl_counter_info},
                                              {"name", tl_counter_name},
                                              {"store", tl_counter_store},
                                              {"close", tl_counter_close},
                                              {"_nop", tl_counter_nop},
                                              {NULL, NULL}};

static const luaL_Reg tl_counter_meta[] = {{"__gc", tl_counter_close},
                                           {"__close", tl_counter_close},
                                           {"__tostring", tl_counter_tostring},
                                           {NULL, NULL}};

/* core.key_shard(key, n) -> the 1-based shard of key among n, as the key
 * policy picks it (tally_key_shard): the remote stores' key policy */
static int tl_key_shard(lua_State *L) {
  size_t len;
  const char *key = luaL_checklstring(L, 1, &len);
  lua_Integer n = luaL_checkinteger(L, 2);
  luaL_argcheck(L, n >= 1 && n <= TALLY_MAX_SHARDS, 2, "shard count out of range");
  lua_pushinteger(L, (lua_Integer)tally_key_shard(key, len, (uint32_t)n) + 1);
  return 1;
}

int tl_open_counter(lua_State *L) {
  tl_newclass(L, TL_COUNTER_MT, tl_counter_meta, tl_counter_methods);
  lua_setfield(L, -2, "counter_methods");
  lua_pushcfunction(L, tl_key_shard);
  lua_setfield(L, -2, "key_shard");
  lua_pushcfunction(L, tl_set_value_opts);
  lua_setfield(L, -2, "set_value_opts");
#if TL_LUAJIT
  tl_set_classic(L, "counter_incr", tl_counter_incr); /* what ffi.lua replaces */
  tl_set_classic(L, "counter_decr", tl_counter_decr);
  tl_set_classic(L, "counter_value", tl_counter_value);
  lua_pushcfunction(L, tl_ffi_info);
  lua_setfield(L, -2, "_ffi_info");
#endif
  return 0;
}
