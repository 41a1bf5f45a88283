/* lua_histogram.c -- a histogram's writer (include/tally.h,
 * tally_histogram_open): what h:observe (lua/tally/histogram.lua) stands
 * on.
 *
 *   core.histogram_writer(db, bounds, names, unit) -> writer
 *       bounds: the finite bounds, increasing; names: #bounds + 2 member
 *       names (each bucket's, +Inf's, the sum's); unit: the sum's unit
 *   core.histogram_stored(db, names) -> "new" | "same" | "other"
 *       what the store holds of the histogram of those member names
 *       (tally_histogram_stored), without a walk
 *   core.histogram_observe(writer, v) -> true
 *       one observation: its bucket +1 and the sum + v / unit, one batch
 *   core.histogram_method(H, method) -> H.observe for Lua 5.4: the same
 *       in one C call, method (the Lua one) for everything else
 *   core.histogram_buffer(writer, n) -> true
 *       hold up to n observations in the writer (0: none), flushed as one
 *       batch (tally_histogram_buffer)
 *   core.histogram_flush(writer) -> true
 *       add what the writer holds to the store (tally_histogram_flush)
 *   core.histograms_flush(db) -> true
 *       the same for every open writer of db; the first failure is
 *       returned after all were tried
 *
 * Each returns nil, message, code on failure; misuse (a closed writer or
 * store, arguments of the wrong type) raises. A writer holds its own
 * counter handles and is closed with its store (db:close) or when
 * collected. Under LuaJIT, lua/tally/ffi.lua calls tally_histogram_observe
 * itself with the pointer it reads from the userdata (struct
 * tally_ffi_hist there, checked against core._ffi_info().hist_h).
 */
#include <string.h>

#include "lua_aux.h"

#define TL_HIST_MT "tally.histogram_writer"

void tl_hist_release(tl_hist *w) {
  if (w->h == NULL) return;
  if (w->prev != NULL)
    w->prev->next = w->next;
  else
    w->db->hists = w->next;
  if (w->next != NULL) w->next->prev = w->prev;
  w->prev = w->next = NULL;
  tally_histogram_close(w->h);
  w->h = NULL;
}

static int tl_hist_gc(lua_State *L) {
  tl_hist_release((tl_hist *)tl_checkudata(L, 1, TL_HIST_MT));
  return 0;
}

/* The number of the list at idx as a double, or a raised error. */
static double tl_checkbound(lua_State *L, int idx, lua_Integer i) {
  double b;
  lua_rawgeti(L, idx, i);
  if (lua_type(L, -1) != LUA_TNUMBER)
    tl_argerror(L, 2, "bound %d is not a number", (int)i);
  b = (double)lua_tonumber(L, -1);
  lua_pop(L, 1);
  return b;
}

/* names[i] for i < n: the strings of the list at idx (which holds them). */
static void tl_member_names(lua_State *L, int idx, const char **names, size_t n) {
  size_t i;
  for (i = 0; i < n; i++) {
    lua_rawgeti(L, idx, (lua_Integer)i + 1);
    if (lua_type(L, -1) != LUA_TSTRING)
      tl_argerror(L, idx, "name %d is not a string", (int)i + 1);
    names[i] = lua_tostring(L, -1);
    lua_pop(L, 1);
  }
}

static int tl_histogram_writer(lua_State *L) {
  tl_store *db = tl_checkstore(L, 1);
  size_t nb, i;
  double *bounds, unit;
  const char **names;
  tl_hist *w;
  int rc;
  if (!lua_istable(L, 2)) tl_typeerror(L, 2, "table");
  if (!lua_istable(L, 3)) tl_typeerror(L, 3, "table");
  unit = (double)luaL_checknumber(L, 4);
  nb = (size_t)lua_rawlen(L, 2);
  if (nb > TALLY_HISTOGRAM_MAX_BOUNDS)
    return tl_argerror(L, 2, "at most %d bounds, got %d", TALLY_HISTOGRAM_MAX_BOUNDS,
                       tl_int(nb));
  if ((size_t)lua_rawlen(L, 3) != nb + 2)
    return tl_argerror(L, 3, "%d names for %d bounds (expected %d)",
                       tl_int(lua_rawlen(L, 3)), tl_int(nb), tl_int(nb + 2));
  /* scratch as userdata: collected even if a check below raises */
  bounds =
      (double *)tl_newud(L, (nb + 1) * sizeof(double) + (nb + 2) * sizeof(char *), 0);
  names = (const char **)(void *)(bounds + nb + 1);
  for (i = 0; i < nb; i++) bounds[i] = tl_checkbound(L, 2, (lua_Integer)i + 1);
  tl_member_names(L, 3, names, nb + 2);
  w = (tl_hist *)tl_newud(L, sizeof(*w), 1);
  memset(w, 0, sizeof(*w));
  w->key = (uintptr_t)w ^ TL_HIST_SALT;
  luaL_setmetatable(L, TL_HIST_MT);
  lua_pushvalue(L, 1);
  tl_setuv(L, -2, 1); /* the store lives as long as its writer */
  rc = tally_histogram_open(db->store, bounds, nb, names, unit, &w->h);
  if (rc < 0) return tl_fail(L, rc);
  w->db = db;
  w->next = db->hists;
  if (db->hists != NULL) db->hists->prev = w;
  db->hists = w;
  return 1;
}

/* core.histogram_stored(db, names) -> "new" | "same" | "other" */
static int tl_histogram_stored(lua_State *L) {
  static const char *const what[] = {"new", "same", "other"};
  tl_store *db = tl_checkstore(L, 1);
  const char **names;
  size_t n;
  int rc;
  if (!lua_istable(L, 2)) tl_typeerror(L, 2, "table");
  n = (size_t)lua_rawlen(L, 2);
  if (n < 2 || n > TALLY_HISTOGRAM_MAX_BOUNDS + 2)
    return tl_argerror(L, 2, "2 to %d names expected, got %d",
                       TALLY_HISTOGRAM_MAX_BOUNDS + 2, tl_int(n));
  names = (const char **)tl_newud(L, n * sizeof(char *), 0);
  tl_member_names(L, 2, names, n);
  rc = tally_histogram_stored(db->store, names, n - 2);
  if (rc < 0) return tl_fail(L, rc);
  lua_pushstring(L, what[rc]);
  return 1;
}

static int tl_histogram_observe(lua_State *L) {
  /* the key spares the metatable's lookup by name (as the counter's) */
  tl_hist *w = (tl_hist *)lua_touserdata(L, 1);
  int rc;
  if (TL_UNLIKELY(w == NULL || lua_type(L, 1) != LUA_TUSERDATA ||
                  w->key != ((uintptr_t)w ^ TL_HIST_SALT)))
    w = (tl_hist *)tl_checkudata(L, 1, TL_HIST_MT);
  if (TL_UNLIKELY(lua_type(L, 2) != LUA_TNUMBER)) tl_typeerror(L, 2, "number");
  if (w->h == NULL) luaL_error(L, "attempt to use a closed store");
  rc = tally_histogram_observe(w->h, (double)lua_tonumber(L, 2));
  if (rc < 0) return tl_fail(L, rc);
  lua_pushboolean(L, 1);
  return 1;
}

static tl_hist *tl_checkwriter(lua_State *L, int idx) {
  tl_hist *w = (tl_hist *)tl_checkudata(L, idx, TL_HIST_MT);
  if (w->h == NULL) luaL_error(L, "attempt to use a closed store");
  return w;
}

static int tl_histogram_buffer(lua_State *L) {
  tl_hist *w = tl_checkwriter(L, 1);
  lua_Integer n = tl_checkinteger(L, 2);
  int rc;
  if (n < 0 || n > TALLY_HISTOGRAM_MAX_BUFFER)
    return tl_argerror(L, 2, "0 to %d observations expected", TALLY_HISTOGRAM_MAX_BUFFER);
  rc = tally_histogram_buffer(w->h, (uint32_t)n);
  if (rc < 0) return tl_fail(L, rc);
  lua_pushboolean(L, 1);
  return 1;
}

static int tl_histogram_flush(lua_State *L) {
  tl_hist *w = tl_checkwriter(L, 1);
  int rc = tally_histogram_flush(w->h);
  if (rc < 0) return tl_fail(L, rc);
  lua_pushboolean(L, 1);
  return 1;
}

static int tl_histograms_flush(lua_State *L) {
  tl_store *db = tl_checkstore(L, 1);
  int first = 0;
  char msg[512] = "";
  for (tl_hist *w = db->hists; w != NULL; w = w->next) {
    int rc = tally_histogram_flush(w->h);
    if (rc < 0 && first == 0) {
      first = rc;
      snprintf(msg, sizeof msg, "%s", tally_errmsg());
    }
  }
  if (first < 0) return tl_fail_msg(L, first, msg);
  lua_pushboolean(L, 1);
  return 1;
}

/* H.observe under Lua 5.4 (upvalues: the class H, the Lua method): h's
 * writer is h[1]. One C call where the Lua method makes three (it checks
 * the metatable and v's type); anything but a plain success (a bad self
 * or v, a closed store, a failure) goes to the Lua method, which raises
 * or returns as it always has. */
static int tl_histogram_method(lua_State *L) {
  if (lua_type(L, 1) == LUA_TTABLE && lua_type(L, 2) == LUA_TNUMBER &&
      lua_gettop(L) == 2 && lua_getmetatable(L, 1)) {
    int same = lua_rawequal(L, -1, lua_upvalueindex(1));
    tl_hist *w;
    lua_rawgeti(L, 1, 1);
    w = (tl_hist *)lua_touserdata(L, -1);
    lua_pop(L, 2);
    if (same && w != NULL && w->key == ((uintptr_t)w ^ TL_HIST_SALT) && w->h != NULL &&
        tally_histogram_observe(w->h, (double)lua_tonumber(L, 2)) == 0) {
      lua_pushboolean(L, 1);
      return 1;
    }
  }
  lua_pushvalue(L, lua_upvalueindex(2));
  lua_insert(L, 1);
  lua_call(L, lua_gettop(L) - 1, LUA_MULTRET);
  return lua_gettop(L);
}

/* core.histogram_method(H, method) -> the C function above */
static int tl_histogram_method_new(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  luaL_checktype(L, 2, LUA_TFUNCTION);
  lua_settop(L, 2);
  lua_pushcclosure(L, tl_histogram_method, 2);
  return 1;
}

int tl_open_histogram(lua_State *L) {
  static const luaL_Reg meta[] = {{"__gc", tl_hist_gc}, {NULL, NULL}};
  static const luaL_Reg none[] = {{NULL, NULL}};
  tl_newclass(L, TL_HIST_MT, meta, none);
  lua_pop(L, 1);
  lua_pushcfunction(L, tl_histogram_writer);
  lua_setfield(L, -2, "histogram_writer");
  lua_pushcfunction(L, tl_histogram_stored);
  lua_setfield(L, -2, "histogram_stored");
  lua_pushcfunction(L, tl_histogram_observe);
  lua_setfield(L, -2, "histogram_observe");
  lua_pushcfunction(L, tl_histogram_method_new);
  lua_setfield(L, -2, "histogram_method");
  lua_pushcfunction(L, tl_histogram_buffer);
  lua_setfield(L, -2, "histogram_buffer");
  lua_pushcfunction(L, tl_histogram_flush);
  lua_setfield(L, -2, "histogram_flush");
  lua_pushcfunction(L, tl_histograms_flush);
  lua_setfield(L, -2, "histograms_flush");
  lua_pushinteger(L, TALLY_HISTOGRAM_MAX_BUFFER);
  lua_setfield(L, -2, "HISTOGRAM_MAX_BUFFER");
  return 0;
}
