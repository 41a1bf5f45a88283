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

static int tl_counter_read(lua_State *L) {
  tl_counter *h = tl_checkcounter(L, 1);
  int64_t v = 0;
  uint64_t inc = 0;
  char hex[17];
  int rc = tally_counter_read(h->c, &v, &inc);
  if (rc < 0) return tl_fail(L, rc);
  snprintf(hex, sizeof hex, "%016llx", (unsigned long long)inc);
  tl_pushint64(L, v);
  lua_pushstring(L, hex);
  return 2;
}

static int tl_counter_ship(lua_State *L) {
  tl_counter *h = tl_checkcounter(L, 1);
  size_t len;
  const char *hex = tl_checkstring(L, 2, &len);
  char *end = NULL;
  uint64_t inc;
  int64_t v;
  int rc;
  if (len != 16 || strspn(hex, "0123456789abcdef") != 16)
    return tl_argerror_got(L, 2, "incarnation of 16 hex digits expected", 2,
                           TL_BOOL_TYPE);
  inc = (uint64_t)strtoull(hex, &end, 16);
  /* nil: a value is going out and may land unseen */
  v = lua_isnoneornil(L, 3) ? TALLY_SHIP_UNKNOWN : tl_checkdelta(L, 3);
  rc = tally_counter_ship(h->c, inc, v);
  if (rc < 0) return tl_fail(L, rc);
  lua_pushboolean(L, 1);
  return 1;
}

int tl_open_ship(lua_State *L) {
  lua_pushcfunction(L, tl_ship);
  lua_setfield(L, -2, "ship");
  lua_pushcfunction(L, tl_counter_read);
  lua_setfield(L, -2, "counter_read");
  lua_pushcfunction(L, tl_counter_ship);
  lua_setfield(L, -2, "counter_ship");
  return 0;
}
