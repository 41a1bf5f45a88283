/* lua_number.c -- a float as text that machines read, whatever the locale.
 *
 * core.number_text writes by the rule of src/core/text.h (the shortest of
 * %.15g, %.16g, %.17g that reads back as the same double, '.' as its
 * decimal point whatever LC_NUMERIC says), where Lua 5.4's string.format
 * and tostring are printf: under de_DE.UTF-8 they write 0,1. lua-cjson
 * reads numbers with the decimal point of the locale it was made in, and
 * cjson.new() aborts the process where that point is not one byte
 * (ps_AF's U+066B): core.c_numeric runs tally.json's lua-cjson in the C
 * locale, set for the calling thread only (uselocale), whatever the
 * host's.
 */
#include <locale.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "../core/text.h"
#include "lua_aux.h"

/* core.number_text(x) -> x's text as above, or nil for NaN and the
 * infinities, which none of tally's formats writes as a number. */
static int tl_number_text(lua_State *L) {
  double x = (double)luaL_checknumber(L, 1);
  char buf[TALLY__NUMBER_ROOM];
  if (!isfinite(x)) {
    lua_pushnil(L);
    return 1;
  }
  size_t n = tally__number_text(x, buf, sizeof buf);
  lua_pushlstring(L, buf, n);
  return 1;
}

/* core.c_numeric(fn, ...) -> what fn(...) returns, called with the C
 * locale's LC_NUMERIC for this thread (other threads keep theirs); an
 * error in fn is raised again once the locale is back. */
static int tl_c_numeric(lua_State *L) {
  luaL_checktype(L, 1, LUA_TFUNCTION);
  locale_t c = newlocale(LC_NUMERIC_MASK, "C", (locale_t)0);
  if (c == (locale_t)0) return luaL_error(L, "cannot make the C locale");
  locale_t was = uselocale(c);
  int status = lua_pcall(L, lua_gettop(L) - 1, LUA_MULTRET, 0);
  uselocale(was);
  freelocale(c);
  if (status != LUA_OK) return lua_error(L);
  return lua_gettop(L);
}

int tl_open_number(lua_State *L) {
  lua_pushcfunction(L, tl_number_text);
  lua_setfield(L, -2, "number_text");
  lua_pushcfunction(L, tl_c_numeric);
  lua_setfield(L, -2, "c_numeric");
  return 0;
}
