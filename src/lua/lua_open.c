/* lua_open.c -- core.open: a store handle from a spec and its options.
 *
 * tally.open (init.lua) calls it for memory and file: stores; the remote
 * schemes go to their own modules. It checks the options, makes the
 * handle (lua_store.c's class) with its cache of counter handles
 * (lua_handles.c) and opens the store.
 */
#include <string.h>

#include "lua_aux.h"

/* core.open([spec [, { mode =, create =, trust =, handle_cache =,
 * handle_admit = }]]) ->
 * store handle, or nil, message, code. */
static int tl_open(lua_State *L) {
  size_t len = 6;
  const char *spec = "memory";
  tally_open_options o = {0600, 0};
  lua_Integer cache = TL_HANDLE_CACHE;
  int repeat = 1; /* handle_admit */
  tally_store *s;
  tl_store *d;
  int rc;

  if (!lua_isnoneornil(L, 1)) spec = tl_checkstring(L, 1, &len);
  if (!((len == 6 && memcmp(spec, "memory", 6) == 0) ||
        (len > 5 && memcmp(spec, "file:", 5) == 0 && strlen(spec) == len))) {
    tally_store *none;
    /* Any other non-empty spec without a NUL is one the core refuses, with
     * its message (a URI's credentials masked): raise that as misuse. */
    if (len > 0 && strlen(spec) == len) {
      if (tally_store_open(spec, NULL, &none) < 0)
        tl_argerror(L, 1, "%s", tally_errmsg());
      tally_store_close(none); /* not reached: the core opens no spec refused above */
    }
    if (len > 0 && strlen(spec) != len)
      tl_argerror(L, 1, "a store spec holds no NUL byte");
    tl_argerror(L, 1, "unknown store '%s' (expected 'memory' or 'file:PATH')", spec);
  }
  if (!lua_isnoneornil(L, 2)) {
    if (!lua_istable(L, 2)) tl_typeerror(L, 2, "table");
    lua_pushnil(L);
    while (lua_next(L, 2) != 0) {
      const char *k = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : "";
      if (strcmp(k, "mode") == 0) {
        lua_Integer m = 0;
        int isnum = 0;
        if (lua_type(L, -1) == LUA_TNUMBER) m = tl_tointx(L, -1, &isnum);
        if (!isnum || m < 0 || m > 07777)
          tl_argerror(L, 2,
                      "mode must be an integer from 0 to 4095 (permission bits), got %s",
                      tl_describe(L, -1, TL_BOOL_VALUE));
        o.mode = (uint32_t)m;
      } else if (strcmp(k, "create") == 0) {
        if (!lua_isboolean(L, -1))
          tl_argerror(L, 2, "create must be a boolean, got %s",
                      tl_describe(L, -1, TL_BOOL_VALUE));
        if (!lua_toboolean(L, -1)) o.flags |= TALLY_OPEN_NOCREATE;
      } else if (strcmp(k, "trust") == 0) { /* a symlink, another user's file */
        if (!lua_isboolean(L, -1))
          tl_argerror(L, 2, "trust must be a boolean, got %s",
                      tl_describe(L, -1, TL_BOOL_VALUE));
        if (lua_toboolean(L, -1)) o.flags |= TALLY_OPEN_TRUST;
      } else if (strcmp(k, "handle_cache") == 0) { /* 0: weak only */
        int isnum = 0;
        if (lua_type(L, -1) == LUA_TNUMBER) cache = tl_tointx(L, -1, &isnum);
        if (!isnum || cache < 0 || cache > TL_HANDLE_CACHE_MAX)
          tl_argerror(L, 2,
                      "handle_cache must be an integer from 0 to %d (handles), got %s",
                      TL_HANDLE_CACHE_MAX, tl_describe(L, -1, TL_BOOL_VALUE));
      } else if (strcmp(k, "handle_admit") == 0) {
        const char *a = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : "";
        if (strcmp(a, "repeat") != 0 && strcmp(a, "always") != 0)
          tl_argerror(L, 2, "handle_admit must be 'repeat' or 'always', got %s",
                      tl_describe(L, -1, TL_BOOL_VALUE));
        repeat = a[0] == 'r';
      } else {
        tl_argerror(L, 2, "unknown option %s", tl_describe(L, -2, TL_BOOL_VALUE));
      }
      lua_pop(L, 1);
    }
    if (o.mode == 0) o.mode = 0600;
  }

  d = (tl_store *)tl_newud(L, sizeof(*d) + len + 1, TL_SUV_N);
  memset(d, 0, sizeof(*d));
  d->key = (uintptr_t)d ^ TL_STORE_SALT;
  d->speclen = len;
  memcpy(d->spec, spec, len);
  d->spec[len] = '\0';
  luaL_setmetatable(L, TL_STORE_MT);
  tl_cache_init(L, -1, cache, repeat);
  lua_newtable(L); /* function families */
  tl_setuv(L, -2, TL_SUV_FAMILIES);
  lua_newtable(L); /* name slots (lua_slots.c) */
  tl_setuv(L, -2, TL_SUV_SLOTS);

  rc = tally_store_open(d->spec, &o, &s);
  if (rc < 0) return tl_fail(L, rc);
  d->store = s;
  return 1;
}

int tl_open_open(lua_State *L) {
  lua_pushcfunction(L, tl_open);
  lua_setfield(L, -2, "open");
  return 0;
}
