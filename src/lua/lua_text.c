/* lua_text.c -- the core's rules for bytes as text, for the Lua side.
 *
 * A name or a message may hold any bytes, and a terminal obeys some of
 * them (ESC, CSI as U+009B). tally_printable (error.c) is the one rule
 * that makes such bytes visible: C0 controls, DEL, bytes outside valid
 * UTF-8 and UTF-8's C1 controls written \xNN, valid UTF-8 kept. The C
 * side's messages go through it; core.printable gives it to tally.util,
 * the command's listings and the prompt, so the Lua side writes no second
 * copy of it. Its UTF-8 check, tally_utf8_len, is core.utf8len.
 */
#include "lua_aux.h"

/* core.printable(s) -> s as tally_printable writes it (s itself when it
 * has nothing to escape: a listing calls this for every name) */
static int tl_printable(lua_State *L) {
  size_t len;
  const char *s = luaL_checklstring(L, 1, &len);
  if (tally_printable(NULL, 0, s, len) == len) { /* every byte kept as it is */
    lua_settop(L, 1);
    return 1;
  }
  tl_pushprintable(L, s, len);
  return 1;
}

/* core.utf8len(s) -> the number of characters of s, or nil and the
 * position of the first invalid byte: Lua 5.4's utf8.len(s), by the rule
 * of tally_printable (compat.utf8len under LuaJIT, which has no utf8) */
static int tl_utf8len(lua_State *L) {
  size_t len, bad = 0;
  const char *s = luaL_checklstring(L, 1, &len);
  int64_t n = tally_utf8_len(s, len, &bad);
  if (n < 0) {
    lua_pushnil(L);
    lua_pushinteger(L, (lua_Integer)bad + 1);
    return 2;
  }
  lua_pushinteger(L, (lua_Integer)n);
  return 1;
}

int tl_open_text(lua_State *L) {
  lua_pushcfunction(L, tl_printable);
  lua_setfield(L, -2, "printable");
  lua_pushcfunction(L, tl_utf8len);
  lua_setfield(L, -2, "utf8len");
  return 0;
}
