/* lua_module.c -- luaopen_tally_core: the list of the binding's parts.
 *
 * As Lua's linit.c lists the standard libraries, this lists the parts of
 * module "tally.core", one file each, in the order they are opened: each
 * adds its functions to the module table and creates its metatables. The
 * rollup part adds methods to the counter class, so it comes after it.
 * Only luaopen_tally_core is exported; everything else is hidden.
 */
#include "lua_aux.h"

#include <stdatomic.h>

static const luaL_Reg tl_parts[] = {
    {"store", tl_open_store},           /* the store handle */
    {"open", tl_open_open},             /* core.open (lua_open.c) */
    {"handles", tl_open_handles},       /* its cache of counter handles (lua_handles.c) */
    {"counter", tl_open_counter},       /* the counter handle */
    {"rollup", tl_open_rollup},         /* schedules, c:rolled(), the clock */
    {"sender", tl_open_sender},         /* core.sender, the spool's helpers */
    {"redis", tl_open_redis},           /* core.redis, core.flusher */
    {"compact", tl_open_compact},       /* core.compact */
    {"batch", tl_open_batch},           /* core.batch, core.snapshot (lua_batch.c) */
    {"http", tl_open_http},             /* core.http (lua_http.c) */
    {"ship", tl_open_ship},             /* core.ship, core.counter_read (lua_ship.c) */
    {"histogram", tl_open_histogram},   /* core.histogram_writer (lua_histogram.c) */
    {"exposition", tl_open_exposition}, /* core._prom_lines (lua_exposition.c) */
    {"number", tl_open_number},         /* core.number_text, c_numeric (lua_number.c) */
    {"text", tl_open_text},             /* core.printable, utf8len (lua_text.c) */
    {"json", tl_open_json},             /* core.json_twice (lua_json.c) */
    {"export", tl_open_export},         /* core.export_write, core.importer */
    {"parcel", tl_open_parcel},         /* core.parcel (lua_parcel.c) */
    {NULL, NULL}};

/* core._process_mark([n]) -> the mark before (0: none); n sets it. One
 * per process, shared by every Lua state that loads this module (each gets
 * this same copy of it), never by another process: tally.openresty marks a
 * worker whose init_worker opened the store, so that a request's Lua state
 * of its own (lua_code_cache off) can say why it has none. */
static _Atomic lua_Integer process_mark;
static int tl_process_mark(lua_State *L) {
  lua_Integer before = atomic_load(&process_mark);
  if (!lua_isnoneornil(L, 1)) atomic_store(&process_mark, luaL_checkinteger(L, 1));
  lua_pushinteger(L, before);
  return 1;
}

TL_EXPORT int luaopen_tally_core(lua_State *L) {
  const luaL_Reg *part;
  tl_checkversion(L);
  lua_newtable(L);
  for (part = tl_parts; part->func != NULL; part++) part->func(L);
  lua_pushliteral(L, TALLY_VERSION);
  lua_setfield(L, -2, "version");
  lua_pushinteger(L, TALLY_MAX_SHARDS);
  lua_setfield(L, -2, "MAX_SHARDS");
  lua_pushinteger(L, TALLY_NAME_MAX);
  lua_setfield(L, -2, "NAME_MAX");
  lua_pushnumber(L, (lua_Number)TALLY_MAINTAIN_MAX_MS); /* exact: below 2^53 */
  lua_setfield(L, -2, "MAINTAIN_MAX_MS");
  lua_pushinteger(L, TALLY_DEFAULT_SHARDS);
  lua_setfield(L, -2, "DEFAULT_SHARDS");
  lua_pushcfunction(L, tl_process_mark);
  lua_setfield(L, -2, "_process_mark");
#if TL_LUAJIT
  lua_pushcfunction(L, tl_set_box); /* 64-bit integers as cdata */
  lua_setfield(L, -2, "set_box");
#endif
  return 1;
}
