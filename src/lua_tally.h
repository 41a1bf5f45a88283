/* lua_tally.h -- what the binding's C files share: the store and counter
 * handles (see lua_tally.c) and the helpers the other files use. */
#ifndef TALLY_LUA_TALLY_H
#define TALLY_LUA_TALLY_H

#include <stddef.h>
#include <stdint.h>

#include "lua.h"
#include "lauxlib.h"
#include "tally.h"

/* ---- Lua version compatibility ---------------------------------------------
 * The binding is built twice from the same sources: against Lua 5.4 (the
 * primary target) and against LuaJIT 2.1 (OpenResty). Everything outside
 * this block is what both C APIs share. Under LuaJIT every number is a
 * double: counter values within +-2^53 cross as plain numbers, larger ones
 * as int64_t cdata built by the Lua function registered with
 * core.set_box (see tl_pushint64), and integer arguments must be exact. */
#if LUA_VERSION_NUM >= 504
#define TL_LUAJIT 0
#define tl_newud(L, sz, nuv) lua_newuserdatauv((L), (sz), (nuv))
#define tl_getuv(L, idx, n) ((void)lua_getiuservalue((L), (idx), (n)))
#define tl_setuv(L, idx, n) ((void)lua_setiuservalue((L), (idx), (n)))
#define tl_checkversion(L) luaL_checkversion(L)
#define tl_tointx(L, idx, isnum) lua_tointegerx((L), (idx), (isnum))
#define tl_checkinteger(L, arg) luaL_checkinteger((L), (arg))
#define tl_pushint64(L, v) lua_pushinteger((L), (lua_Integer)(v))
#define tl_canpush(L, v) ((void)(L), (void)(v), 1)
#elif LUA_VERSION_NUM == 501
#include "luajit.h"   /* LuaJIT 2.1; plain Lua 5.1 is not supported */
#define TL_LUAJIT 1
#define TL_TCDATA 10  /* what lua_type() says for a cdata (not in lua.h) */
#define TL_EXACT 9007199254740992.0   /* 2^53: larger doubles skip integers */
#define lua_rawlen(L, idx) lua_objlen((L), (idx))
#define lua_absindex(L, idx) \
  ((idx) > 0 || (idx) <= LUA_REGISTRYINDEX ? (idx) : lua_gettop(L) + (idx) + 1)
/* The module takes the address of luaJIT_setmode, which only LuaJIT
 * exports, so loading it into any other Lua fails at require time
 * (dlopen: undefined symbol); the Lua 5.4 build needs luaL_checkversion_
 * and lua_newuserdatauv, which LuaJIT lacks, so it cannot load here. */
static inline void tl_checkversion(lua_State *L) {
  int (*volatile needs_luajit)(lua_State *, int, int) = luaJIT_setmode;
  (void)L;
  (void)needs_luajit;
}
/* One table as the user value (the fenv) holds the n slots. */
static inline void *tl_newud(lua_State *L, size_t sz, int nuv) {
  void *p = lua_newuserdata(L, sz);
  lua_createtable(L, nuv, 0);
  lua_setfenv(L, -2);
  return p;
}
static inline void tl_getuv(lua_State *L, int idx, int n) {
  lua_getfenv(L, idx);
  lua_rawgeti(L, -1, n);
  lua_remove(L, -2);
}
static inline void tl_setuv(lua_State *L, int idx, int n) {  /* pops the value */
  idx = lua_absindex(L, idx);
  lua_getfenv(L, idx);
  lua_insert(L, -2);
  lua_rawseti(L, -2, n);
  lua_pop(L, 1);
}
/* Like Lua 5.4's: a number or numeric string with an exact integer value
 * (here also within +-2^53); LuaJIT's own truncates 1.5 to 1. */
static inline lua_Integer tl_tointx(lua_State *L, int idx, int *isnum) {
  lua_Number d;
  *isnum = 0;
  if (!lua_isnumber(L, idx)) return 0;
  d = lua_tonumber(L, idx);
  if (!(d >= -TL_EXACT && d <= TL_EXACT) || (lua_Number)(int64_t)d != d) return 0;
  *isnum = 1;
  return (lua_Integer)d;
}
lua_Integer tl_checkinteger(lua_State *L, int arg);
/* Push v: a number within +-2^53, else an int64_t cdata (raises if no box
 * is registered). tl_canpush(L, v) tells whether that push can succeed. */
void tl_pushint64(lua_State *L, int64_t v);
int tl_canpush(lua_State *L, int64_t v);
#else
#error "tally's Lua binding builds against Lua 5.4 or LuaJIT 2.1 headers"
#endif

#define TL_STORE_MT "tally.store"
#define TL_COUNTER_MT "tally.counter"

/* Salts for the self-pointers: a counter never passes for a store. */
#define TL_STORE_SALT ((uintptr_t)0x5a17e5u)
#define TL_COUNTER_SALT ((uintptr_t)0xc0417e5u)

enum { TL_SUV_CACHE = 1, TL_SUV_FAMILIES = 2, TL_SUV_N = 2 };  /* store */
enum { TL_CUV_STORE = 1, TL_CUV_POLICY = 2, TL_CUV_N = 2 };    /* counter */

typedef struct tl_counter tl_counter;

typedef struct tl_store {
  uintptr_t key;          /* (uintptr_t)self ^ TL_STORE_SALT */
  tally_store *store;     /* NULL once closed */
  tl_counter *counters;   /* open counter handles made on this store */
  size_t speclen;
  char spec[];            /* "memory" or "file:PATH" */
} tl_store;

/* Under LuaJIT, lua/tally/ffi.lua reads c and policy straight from the
 * userdata (struct tally_ffi_counter there); it checks their offsets
 * against core._ffi_info() and stays classic if they differ. */
struct tl_counter {
  uintptr_t key;          /* (uintptr_t)self ^ TL_COUNTER_SALT */
  tally_counter *c;       /* NULL once closed (also when its store closes) */
  tl_store *db;           /* kept alive through user value TL_CUV_STORE */
  tl_counter *prev, *next;
  int32_t policy;         /* the stored policy */
  int hasfn;              /* CUSTOM with a Lua function in TL_CUV_POLICY */
  size_t namelen;
  char name[];
};

/* The full userdata of metatable tname at idx; raises "tname expected,
 * got ..." (naming handles by their metatable's __name) otherwise. */
void *tl_checkudata(lua_State *L, int idx, const char *tname);
/* A counter increment at arg (nil or none: 1): an integer; under LuaJIT
 * also an int64_t or uint64_t cdata (see core.set_box). Raises otherwise. */
int64_t tl_checkdelta(lua_State *L, int arg);
/* The open store or counter handle at idx; raise otherwise. */
tl_store *tl_checkstore(lua_State *L, int idx);
tl_counter *tl_checkcounter(lua_State *L, int idx);
/* nil, message, code name: the environment-failure convention. */
int tl_fail(lua_State *L, int rc);
/* Called by c:value(opts) with (counter, opts): see lua_rollup.c. */
int tl_counter_value_opts(lua_State *L);
/* Registers the rollup functions in the module table on top of the stack. */
void tl_rollup_register(lua_State *L);

#endif
