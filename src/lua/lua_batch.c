/* lua_batch.c -- batches and snapshots (include/tally.h, tally_batch_incr,
 * tally_store_snapshot): what db:batch, db:incr_many and db:snapshot
 * (lua/tally/init.lua) stand on.
 *
 *   core.batch(db, counters, deltas [, negate]) -> true
 *       counters: a list of counter handles of db (policy "slot"); deltas:
 *       a list as long, of increments (integers; under LuaJIT also int64
 *       cdata), each subtracted where negate[i] is true (b:decr). All of
 *       them land together for snapshots, or none does.
 *   core.delta_problem(n) -> nil if n is an increment c:incr(n) takes,
 *       else why not (the words its error gives): db:batch and
 *       db:incr_many check each n where it is given, naming that call
 *   core.snapshot(db [, pattern]) -> { [name] = value, ... }
 *       the values of the matching counters as one consistent cut (slot
 *       counters; others read one after the other)
 *
 * Each returns nil, message, code on failure (EPOLICY for a counter that
 * is not a slot counter, EBUSY when every writer slot is held, ERANGE,
 * EDROPPED); misuse (not lists, lengths that differ, a closed handle)
 * raises.
 */
#include <stdint.h>

#include "lua_aux.h"

#define TL_BATCH_ENTRIES 1024 /* list entries; distinct counters: TALLY_BATCH_MAX */

static int tl_batch(lua_State *L) {
  tl_store *db = tl_checkstore(L, 1);
  tally_counter *cs[TL_BATCH_ENTRIES];
  int64_t deltas[TL_BATCH_ENTRIES];
  size_t n, i;
  int rc, negate;
  if (!lua_istable(L, 2)) tl_typeerror(L, 2, "table");
  if (!lua_istable(L, 3)) tl_typeerror(L, 3, "table");
  negate = lua_istable(L, 4);
  n = (size_t)lua_rawlen(L, 2);
  if (n != (size_t)lua_rawlen(L, 3))
    return tl_argerror(L, 3, "%d deltas for %d counters", tl_int(lua_rawlen(L, 3)),
                       tl_int(n));
  if (n == 0) return tl_argerror(L, 2, "an empty batch");
  if (n > TL_BATCH_ENTRIES)
    return tl_argerror(L, 2, "at most %d entries in a batch, got %d", TL_BATCH_ENTRIES,
                       tl_int(n));
  for (i = 0; i < n; i++) {
    tl_counter *h;
    lua_rawgeti(L, 2, (lua_Integer)i + 1);
    h = tl_checkcounter(L, lua_gettop(L));
    if (h->db != db)
      return tl_argerror(L, 2, "counter '%s' belongs to another store", h->name);
    cs[i] = h->c;
    lua_rawgeti(L, 3, (lua_Integer)i + 1);
    const char *why = tl_int64_at(L, lua_gettop(L), &deltas[i]);
    if (why) return tl_argerror(L, 3, "entry %d: %s", tl_int(i + 1), why);
    lua_pop(L, 2);
    if (negate) {
      lua_rawgeti(L, 4, (lua_Integer)i + 1);
      if (lua_toboolean(L, -1)) {
        if (deltas[i] == INT64_MIN) return tl_fail_negate(L, h->name);
        deltas[i] = -deltas[i];
      }
      lua_pop(L, 1);
    }
  }
  rc = tally_batch_incr(db->store, cs, deltas, n);
  if (rc < 0) return tl_fail(L, rc);
  lua_pushboolean(L, 1);
  return 1;
}

static int tl_delta_problem(lua_State *L) {
  int64_t v;
  const char *why;
  luaL_checkany(L, 1);
  why = tl_int64_at(L, 1, &v);
  if (why == NULL) return 0;
  lua_pushstring(L, why);
  return 1;
}

static int tl_snapshot(lua_State *L) {
  tl_store *db = tl_checkstore(L, 1);
  size_t plen = 1;
  const char *pattern = lua_isnoneornil(L, 2) ? "*" : tl_checkstring(L, 2, &plen);
  tl_values a = {NULL, 0, 0, NULL, 0, 0, NULL};
  lua_settop(L, 2);
  return tl_values_push(
      L, &a, tally_store_snapshot(db->store, pattern, plen, tl_values_add, &a));
}

int tl_open_batch(lua_State *L) {
  lua_pushcfunction(L, tl_batch);
  lua_setfield(L, -2, "batch");
  lua_pushcfunction(L, tl_delta_problem);
  lua_setfield(L, -2, "delta_problem");
  lua_pushcfunction(L, tl_snapshot);
  lua_setfield(L, -2, "snapshot");
  lua_pushinteger(L, TALLY_BATCH_MAX);
  lua_setfield(L, -2, "BATCH_MAX");
  lua_pushinteger(L, TALLY_SLOT_SHARDS);
  lua_setfield(L, -2, "SLOT_SHARDS");
  return 0;
}
