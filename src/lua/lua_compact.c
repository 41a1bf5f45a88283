/* lua_compact.c -- core.compact: a file store rewritten without its retired
 * and free space (tally_store_compact).
 *
 *   core.compact(path [, progress [, { trust = true }]]) -> true, or nil,
 *       message, code
 *       path: "PATH" or "file:PATH"; progress(done, total) is called about
 *       every 1% of the counters copied (done = 0 first, total last);
 *       trust: open a symlink or another user's store, as tally.open's.
 *
 * The store must be closed everywhere else (EBUSY names a process that has
 * it open). progress runs while the store is locked: it must not use the
 * store. An error in it stops the calls and is raised once the compaction
 * has ended (which it does not stop).
 */
#include <string.h>

#include "lua_aux.h"

typedef struct tl_progress {
  lua_State *L;
  int fn;     /* stack index of the function, 0: none */
  int failed; /* its error is on top of the stack */
} tl_progress;

static void tl_compact_progress(void *ud, uint64_t done, uint64_t total) {
  tl_progress *p = (tl_progress *)ud;
  lua_State *L = p->L;
  if (p->failed) return;
  if (!lua_checkstack(L, 3)) {
    lua_pushliteral(L, "compact: no stack space for the progress function");
    p->failed = 1;
    return;
  }
  lua_pushvalue(L, p->fn);
  tl_pushint64(L, (int64_t)done); /* counts: exact numbers under LuaJIT too */
  tl_pushint64(L, (int64_t)total);
  if (lua_pcall(L, 2, 0, 0) != 0) p->failed = 1;
}

static int tl_compact(lua_State *L) {
  size_t len;
  const char *path = tl_checkstring(L, 1, &len);
  tl_progress p = {L, 0, 0};
  uint32_t flags = 0;
  int rc;
  if (len >= 5 && memcmp(path, "file:", 5) == 0) {
    path += 5;
    len -= 5;
  }
  if (len == 0 || strlen(path) != len || strcmp(path, "memory") == 0)
    tl_argerror(L, 1, "path of a file store expected, got %s",
                tl_describe(L, 1, TL_BOOL_VALUE));
  if (!lua_isnoneornil(L, 2)) {
    if (lua_type(L, 2) != LUA_TFUNCTION) tl_typeerror(L, 2, "function");
    p.fn = 2;
  }
  if (!lua_isnoneornil(L, 3)) { /* { trust = true }: as tally.open's */
    if (!lua_istable(L, 3)) tl_typeerror(L, 3, "table");
    lua_pushnil(L);
    while (lua_next(L, 3) != 0) {
      if (lua_type(L, -2) != LUA_TSTRING || strcmp(lua_tostring(L, -2), "trust") != 0)
        tl_argerror(L, 3, "unknown option %s (expected trust)",
                    tl_describe(L, -2, TL_BOOL_VALUE));
      if (!lua_isboolean(L, -1)) tl_argerror(L, 3, "trust must be a boolean");
      if (lua_toboolean(L, -1)) flags |= TALLY_OPEN_TRUST;
      lua_pop(L, 1);
    }
  }
  lua_settop(L, 2);
  rc = tally_store_compact(path, flags, p.fn ? tl_compact_progress : NULL, &p);
  if (p.failed) return lua_error(L);
  if (rc < 0) return tl_fail(L, rc);
  lua_pushboolean(L, 1);
  return 1;
}

int tl_open_compact(lua_State *L) {
  lua_pushcfunction(L, tl_compact);
  lua_setfield(L, -2, "compact");
  return 0;
}
