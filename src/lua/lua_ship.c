/* lua_ship.c -- what a flusher written in Lua needs from the store: read a
 * counter's value with its incarnation, and hold shipped counters back
 * from expiry until their final value has gone out (include/tally.h,
 * tally_counter_read, tally_store_ship, tally_counter_ship; the C Redis
 * flusher uses the same calls).
 *
 *   core.ship(db, writer, pattern) -> true     tally_store_ship: from now
 *       on a counter matching pattern expires only once its value has been
 *       marked shipped (core.counter_ship) for its incarnation
 *   core.counter_read(c) -> value, incarnation  read together; the
 *       incarnation as 16 hex digits ("0000000000000000": expired, not
 *       created again; the value is then 0)
 *   core.counter_ship(c, incarnation, value) -> true   mark value shipped
 *       for that incarnation (a mark for another incarnation is ignored);
 *       value nil marks TALLY_SHIP_UNKNOWN: a value is going out whose
 *       fate may stay unknown, so upkeep holds the counter whatever its
 *       value until a value read back from the remote is marked
 *   core.counter_send_begin(c, marker_value, marker_incarnation)
 *       -> delta, value, incarnation   tally_counter_send_begin: the step
 *       before a value goes out (mark it unknown, read what to send, the
 *       delta from the remote's marker); nil, msg, code: EBUSY (made
 *       again twice meanwhile), ENOENT (expired), EDROPPED: not sent
 *   core.send_delta(value, incarnation, marker_value, marker_incarnation)
 *       -> delta   tally_send_delta: what to send over the remote's marker
 *
 * Each returns nil, message, code on failure (EDROPPED for a dropped
 * counter); misuse raises. core.unship (lua_redis.c) undoes core.ship.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lua_aux.h"

static int tl_ship(lua_State *L) {
  tl_store *db = tl_checkstore(L, 1);
  size_t wl, pl;
  const char *writer = tl_checkstring(L, 2, &wl);
  const char *pattern = tl_checkstring(L, 3, &pl);
  int rc = tally_store_ship(db->store, writer, wl, pattern, pl);
  if (rc < 0) return tl_fail(L, rc);
  lua_pushboolean(L, 1);
  return 1;
}

static void push_incarnation(lua_State *L, uint64_t inc) {
  char hex[17];
  snprintf(hex, sizeof hex, "%016llx", (unsigned long long)inc);
  lua_pushstring(L, hex);
}

static uint64_t check_incarnation(lua_State *L, int arg) {
  size_t len;
  const char *hex = tl_checkstring(L, arg, &len);
  if (len != 16 || strspn(hex, "0123456789abcdef") != 16)
    tl_argerror_got(L, arg, "incarnation of 16 hex digits expected", arg, TL_BOOL_TYPE);
  return (uint64_t)strtoull(hex, NULL, 16);
}

static int tl_counter_read(lua_State *L) {
  tl_counter *h = tl_checkcounter(L, 1);
  int64_t v = 0;
  uint64_t inc = 0;
  int rc = tally_counter_read(h->c, &v, &inc);
  if (rc < 0) return tl_fail(L, rc);
  tl_pushint64(L, v);
  push_incarnation(L, inc);
  return 2;
}

static int tl_counter_ship(lua_State *L) {
  tl_counter *h = tl_checkcounter(L, 1);
  uint64_t inc = check_incarnation(L, 2);
  /* nil: a value is going out and may land unseen */
  int64_t v = lua_isnoneornil(L, 3) ? TALLY_SHIP_UNKNOWN : tl_checkdelta(L, 3);
  int rc = tally_counter_ship(h->c, inc, v);
  if (rc < 0) return tl_fail(L, rc);
  lua_pushboolean(L, 1);
  return 1;
}

static int tl_counter_send_begin(lua_State *L) {
  tl_counter *h = tl_checkcounter(L, 1);
  int64_t marker = tl_checkdelta(L, 2);
  uint64_t minc = check_incarnation(L, 3);
  tally_send send;
  int rc = tally_counter_send_begin(h->c, marker, minc, &send);
  if (rc < 0) return tl_fail(L, rc);
  tl_pushint64(L, send.delta);
  tl_pushint64(L, send.value);
  push_incarnation(L, send.incarnation);
  return 3;
}

static int tl_send_delta(lua_State *L) {
  int64_t v = tl_checkdelta(L, 1);
  uint64_t inc = check_incarnation(L, 2);
  int64_t marker = tl_checkdelta(L, 3);
  uint64_t minc = check_incarnation(L, 4);
  int64_t d;
  int rc = tally_send_delta(v, inc, marker, minc, &d);
  if (rc < 0) return tl_fail(L, rc);
  tl_pushint64(L, d);
  return 1;
}

#ifdef TALLY_TEST_SEAMS /* compiled in only where the tests are built */
#include "../core/internal.h"

/* core._test_hook(fn): fn(where, name) runs where the C core calls its
 * test hook (internal.h), on the Lua state's main thread; nil takes it
 * out. Specs make a counter move at such a point. Some points hold the
 * store lock, so an error in fn cannot unwind through the core: it ends
 * the process with its message. */
static lua_State *hook_L;
static int hook_ref = LUA_NOREF;

static void run_hook(const char *where, const char *name, size_t len) {
  lua_State *L = hook_L;
  lua_rawgeti(L, LUA_REGISTRYINDEX, hook_ref);
  lua_pushstring(L, where);
  lua_pushlstring(L, name, len);
  if (lua_pcall(L, 2, 0, 0) != LUA_OK) {
    fprintf(stderr, "core._test_hook at %s: %s\n", where, lua_tostring(L, -1));
    abort();
  }
}

static int tl_test_hook(lua_State *L) {
  luaL_unref(L, LUA_REGISTRYINDEX, hook_ref);
  hook_ref = LUA_NOREF;
  tally__test_hook = NULL;
  if (lua_isnoneornil(L, 1)) return 0;
  luaL_checktype(L, 1, LUA_TFUNCTION);
  lua_settop(L, 1);
  hook_ref = luaL_ref(L, LUA_REGISTRYINDEX);
#ifdef LUA_RIDX_MAINTHREAD
  lua_rawgeti(L, LUA_REGISTRYINDEX, LUA_RIDX_MAINTHREAD);
  hook_L = lua_tothread(L, -1); /* the registry keeps it */
  lua_pop(L, 1);
#else /* Lua 5.1, LuaJIT: the caller's thread */
  hook_L = L;
#endif
  tally__test_hook = run_hook;
  return 0;
}
#endif

int tl_open_ship(lua_State *L) {
  lua_pushcfunction(L, tl_ship);
  lua_setfield(L, -2, "ship");
  lua_pushcfunction(L, tl_counter_read);
  lua_setfield(L, -2, "counter_read");
  lua_pushcfunction(L, tl_counter_ship);
  lua_setfield(L, -2, "counter_ship");
  lua_pushcfunction(L, tl_counter_send_begin);
  lua_setfield(L, -2, "counter_send_begin");
  lua_pushcfunction(L, tl_send_delta);
  lua_setfield(L, -2, "send_delta");
#ifdef TALLY_TEST_SEAMS
  lua_pushcfunction(L, tl_test_hook);
  lua_setfield(L, -2, "_test_hook");
#endif
  return 0;
}
