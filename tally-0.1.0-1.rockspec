-- luarocks make (from a clone) builds the C core, the network layer and the
-- Lua 5.4 binding with CMake and installs the module (tally, tally.core)
-- into the rocks tree; the C libraries, the tally command and the LuaJIT
-- module come from cmake --install (README.md, Install). Needs cmake, a C compiler and
-- the -dev packages scripts/setup installs (liblua5.4-dev, libcurl, hiredis,
-- readline).
rockspec_format = "3.0"
package = "tally"
version = "0.1.0-1"
source = { url = "git+file://." }
description = {
  summary = "Sharded counters in C for Lua: memory, a file shared by processes, Redis",
  detailed = [[
A counter engine in C driven from Lua: counters split into shards that
writers hit without contention, summed when read, with rollups, sinks,
Prometheus text, an OpenResty glue and an exactly-once flush to Redis.]],
}
dependencies = { "lua >= 5.4, < 5.5", "lua-cjson" }
build = {
  type = "cmake",
  variables = {
    CMAKE_BUILD_TYPE = "Release",
    CMAKE_INSTALL_PREFIX = "$(PREFIX)",
    TALLY_LUA_LIBDIR = "$(LIBDIR)",
    TALLY_LUA_DATADIR = "$(LUADIR)",
    TALLY_LUAJIT = "OFF",
    TALLY_INSTALL_LUA_ONLY = "ON",
    BUILD_TESTING = "OFF",
  },
}
