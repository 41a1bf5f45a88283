/* lua_aux.c -- the binding's one toolkit (see lua_aux.h).
 *
 * Argument checks raise luaL_argerror-style messages, the way Lua 5.4's
 * lauxlib words them, under LuaJIT too; failures of the environment are
 * returned as nil, message, code name. Under LuaJIT, 64-bit integers
 * beyond +-2^53 cross as int64_t cdata through two Lua functions the Lua
 * side registers with core.set_box. Every class is registered by
 * tl_newclass, so each metatable has __name and the same shape.
 */
#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lua_aux.h"

/* ---- arguments and messages ------------------------------------------------ */

const char *tl_pushprintable(lua_State *L, const char *s, size_t len) {
  size_t need = tally_printable(NULL, 0, s, len);
  char *b = lua_newuserdata(L, need + 1);
  tally_printable(b, need + 1, s, len);
  lua_pushlstring(L, b, need);
  lua_remove(L, -2);
  return lua_tostring(L, -1);
}

const char *tl_pushredacted(lua_State *L, const char *s, size_t len) {
  size_t need = tally_uri_redact(NULL, 0, s, len);
  char *b = lua_newuserdata(L, need + 1);
  tally_uri_redact(b, need + 1, s, len);
  lua_pushlstring(L, b, need);
  lua_remove(L, -2);
  return lua_tostring(L, -1);
}

/* The message on top, escaped in its place. */
static const char *printable_top(lua_State *L) {
  size_t len;
  const char *m = lua_tolstring(L, -1, &len);
  m = tl_pushprintable(L, m, len);
  lua_remove(L, -2);
  return m;
}

int tl_error(lua_State *L, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  lua_pushvfstring(L, fmt, ap);
  va_end(ap);
  printable_top(L);
  luaL_where(L, 1);
  lua_insert(L, -2);
  lua_concat(L, 2);
  return lua_error(L);
}

const char *tl_describe(lua_State *L, int idx, int bools) {
  switch (lua_type(L, idx)) {
  case LUA_TSTRING: {
    size_t len;
    const char *str = lua_tolstring(L, idx, &len);
    tl_pushprintable(L, str, len);
    lua_pushfstring(L, "'%s'", lua_tostring(L, -1));
    lua_remove(L, -2);
    return lua_tostring(L, -1);
  }
  case LUA_TNUMBER: lua_pushvalue(L, idx); return lua_tostring(L, -1);
  case LUA_TBOOLEAN:
    if (bools == TL_BOOL_VALUE) {
      lua_pushstring(L, lua_toboolean(L, idx) ? "true" : "false");
      return lua_tostring(L, -1);
    }
    break;
  case LUA_TNONE: lua_pushliteral(L, "no value"); return lua_tostring(L, -1);
  default: break;
  }
  lua_pushstring(L, luaL_typename(L, idx));
  return lua_tostring(L, -1);
}

int tl_argerror(lua_State *L, int arg, const char *fmt, ...) {
  const char *msg;
  va_list ap;
  va_start(ap, fmt);
  lua_pushvfstring(L, fmt, ap);
  va_end(ap);
  msg = printable_top(L);
  return luaL_argerror(L, arg, msg);
}

int tl_argerror_got(lua_State *L, int arg, const char *what, int idx, int bools) {
  const char *got = tl_describe(L, idx, bools);
  return tl_argerror(L, arg, "%s, got %s", what, got);
}

/* "TNAME expected, got TYPE" for the value at idx (its __name if any),
 * pushed. */
static const char *tl_expected(lua_State *L, int idx, const char *tname) {
  const char *got;
  if (luaL_getmetafield(L, idx, "__name") != 0 && lua_type(L, -1) == LUA_TSTRING)
    got = lua_tostring(L, -1); /* (5.1's returns 1 when found, 5.4's the type) */
  else if (lua_type(L, idx) == LUA_TLIGHTUSERDATA)
    got = "light userdata";
  else
    got = luaL_typename(L, idx);
  return lua_pushfstring(L, "%s expected, got %s", tname, got);
}

int tl_typeerror(lua_State *L, int arg, const char *tname) {
  return luaL_argerror(L, arg, tl_expected(L, arg, tname));
}

void *tl_checkudata(lua_State *L, int idx, const char *tname) {
  void *p = luaL_testudata(L, idx, tname);
  if (p == NULL) tl_typeerror(L, idx, tname); /* as luaL_checkudata in 5.4 */
  return p;
}

const char *tl_checkstring(lua_State *L, int arg, size_t *len) {
  if (TL_UNLIKELY(lua_type(L, arg) != LUA_TSTRING)) tl_typeerror(L, arg, "string");
  return lua_tolstring(L, arg, len);
}

tl_store *tl_checkstore(lua_State *L, int idx) {
  tl_store *d = (tl_store *)tl_checkudata(L, idx, TL_STORE_MT);
  if (d->store == NULL) luaL_error(L, "attempt to use a closed store");
  return d;
}

tl_counter *tl_checkcounter(lua_State *L, int idx) {
  tl_counter *h = (tl_counter *)tl_checkudata(L, idx, TL_COUNTER_MT);
  if (h->db->store == NULL) luaL_error(L, "attempt to use a closed store");
  if (h->c == NULL) luaL_error(L, "attempt to use a closed counter");
  return h;
}

/* ---- results -------------------------------------------------------------- */

int tl_fail(lua_State *L, int rc) {
  return tl_fail_msg(L, rc, tally_errmsg());
}

int tl_fail_msg(lua_State *L, int rc, const char *msg) {
  lua_pushnil(L);
  tl_pushprintable(L, msg, strlen(msg));
  lua_pushstring(L, tally_err_name(rc));
  return 3;
}

int tl_fail_negate(lua_State *L, const char *name) {
  return tl_fail_msg(
      L, TALLY_ERANGE,
      lua_pushfstring(L, "counter '%s': subtracting -2^63 would overflow", name));
}

void tl_setint(lua_State *L, const char *k, int64_t v) {
  tl_pushint64(L, v);
  lua_setfield(L, -2, k);
}

/* ---- classes ---------------------------------------------------------------- */

void tl_newclass(lua_State *L, const char *tname, const luaL_Reg *meta,
                 const luaL_Reg *methods) {
  if (luaL_newmetatable(L, tname)) {
    luaL_setfuncs(L, meta, 0);
    lua_pushstring(L, tname); /* 5.4's luaL_newmetatable does it */
    lua_setfield(L, -2, "__name");
    lua_newtable(L);
    luaL_setfuncs(L, methods, 0);
    lua_setfield(L, -2, "__index");
  }
  lua_getfield(L, -1, "__index");
  lua_remove(L, -2);
}

/* ---- integers ------------------------------------------------------------------- */

#if TL_LUAJIT
/* Two Lua functions, registered by the Lua side with core.set_box(box,
 * unbox) (lua/tally/compat.lua), cross between int64_t and cdata:
 * box(hi, lo) -> int64_t cdata of the bits hi * 2^32 + lo (both numbers
 * in [0, 2^32)); unbox(x) -> hi, lo for an int64_t or uint64_t cdata, or
 * nil and the reason. */
#define TL_BOX_KEY   "tally.box"
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

/* The int64_t of the cdata at idx in *out and NULL, or why not (pushed). */
static const char *tl_unbox(lua_State *L, int idx, int64_t *out) {
  lua_Number hi, lo;
  lua_getfield(L, LUA_REGISTRYINDEX, TL_UNBOX_KEY);
  if (!lua_isfunction(L, -1)) return tl_expected(L, idx, "number");
  lua_pushvalue(L, idx);
  lua_call(L, 1, 2);
  if (lua_type(L, -2) != LUA_TNUMBER)
    return lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1)
                                          : tl_expected(L, idx, "number");
  hi = lua_tonumber(L, -2);
  lo = lua_tonumber(L, -1);
  lua_pop(L, 2);
  *out = (int64_t)(((uint64_t)hi << 32) | (uint64_t)lo);
  return NULL;
}

#if TL_LUAJIT
int tl_decimal_int64(const char *s, size_t len, int64_t *out) {
  char *end;
  errno = 0;
  long long v = strtoll(s, &end, 10); /* spaces and a sign first, as Lua */
  if (end == s || errno == ERANGE) return 0;
  while (isspace((unsigned char)*end)) end++;
  if (end != s + len) return 0; /* hex, a fraction, an exponent: LuaJIT's */
  *out = v;
  return 1;
}
#endif

const char *tl_int64_at(lua_State *L, int idx, int64_t *out) {
  int isnum;
  lua_Number d;
  lua_Integer n = tl_tointx(L, idx, &isnum);
  if (isnum) {
    *out = n;
    return NULL;
  }
  if (lua_type(L, idx) == TL_TCDATA) return tl_unbox(L, idx, out);
  if (!lua_isnumber(L, idx)) return tl_expected(L, idx, "number");
  d = lua_tonumber(L, idx);
  if ((d > TL_EXACT || d < -TL_EXACT) && d - d == 0) /* finite: an integer */
    return "integer beyond +-2^53 is not exact as a LuaJIT number "
           "(pass an int64_t cdata)";
  return "number has no integer representation";
}

/* An integer argument (tl_int64_at), or raise naming argument arg. */
static int64_t tl_checkint64(lua_State *L, int arg) {
  int64_t v = 0;
  const char *why = tl_int64_at(L, arg, &v);
  if (why) luaL_argerror(L, arg, why);
  return v;
}

lua_Integer tl_checkinteger(lua_State *L, int arg) {
  return (lua_Integer)tl_checkint64(L, arg);
}

int tl_set_box(lua_State *L) {
  luaL_checktype(L, 1, LUA_TFUNCTION);
  luaL_checktype(L, 2, LUA_TFUNCTION);
  lua_pushvalue(L, 1);
  lua_setfield(L, LUA_REGISTRYINDEX, TL_BOX_KEY);
  lua_pushvalue(L, 2);
  lua_setfield(L, LUA_REGISTRYINDEX, TL_UNBOX_KEY);
  return 0;
}

void tl_set_classic(lua_State *L, const char *name, lua_CFunction fn) {
  lua_getfield(L, -1, "_classic");
  if (!lua_istable(L, -1)) {
    lua_pop(L, 1);
    lua_newtable(L);
    lua_pushvalue(L, -1);
    lua_setfield(L, -3, "_classic");
  }
  lua_pushcfunction(L, fn);
  lua_setfield(L, -2, name);
  lua_pop(L, 1);
}
#else
const char *tl_int64_at(lua_State *L, int idx, int64_t *out) {
  int isnum;
  lua_Integer n = lua_tointegerx(L, idx, &isnum);
  if (isnum) {
    *out = n;
    return NULL;
  }
  if (!lua_isnumber(L, idx)) return tl_expected(L, idx, "number");
  return "number has no integer representation"; /* as luaL_checkinteger says */
}
#define tl_checkint64(L, arg) luaL_checkinteger((L), (arg))
#endif

int64_t tl_checkdelta(lua_State *L, int arg) {
  if (lua_isnoneornil(L, arg)) return 1;
  return tl_checkint64(L, arg); /* raises with the standard message */
}
