/* lua_values.c -- tables from a walk of the core: name -> value, the
 * list of names (in the order the walk gave them), or the rows of a top k.
 *
 * tally_store_values, tally_store_snapshot and tally_store_each hand over
 * each counter through a callback, while they own memory (the snapshot's
 * arrays). A Lua error raised there (a push that runs out of memory) would
 * unwind through the core and lose that memory, so the pairs are collected
 * in C first (tl_values_add, tl_name_row), and the table is built
 * afterwards, under lua_pcall, so that the collection is freed whatever
 * happens. The names go into one buffer, not one allocation each.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "lua_aux.h"

int tl_values_add(void *ud, const char *name, size_t len, int64_t v) {
  tl_values *a = (tl_values *)ud;
  if (a->n == a->cap) {
    size_t cap = a->cap ? a->cap * 2 : 256;
    struct tl_value *e = (struct tl_value *)realloc(a->e, cap * sizeof(*e));
    if (e == NULL) return TALLY_ENOMEM;
    a->e = e;
    a->cap = cap;
  }
  if (a->names_len + len > a->names_cap) {
    size_t cap = a->names_cap ? a->names_cap : 4096;
    char *names;
    while (cap < a->names_len + len) cap *= 2;
    if ((names = (char *)realloc(a->names, cap)) == NULL) return TALLY_ENOMEM;
    a->names = names;
    a->names_cap = cap;
  }
  memcpy(a->names + a->names_len, name, len);
  a->e[a->n].at = a->names_len;
  a->e[a->n].len = len;
  a->e[a->n].v = v;
  a->names_len += len;
  a->n++;
  return 0;
}

/* The table of the collection at argument 1 (a light userdata); called
 * under lua_pcall: pushing may raise. */
static int tl_values_table(lua_State *L) {
  const tl_values *a = (const tl_values *)lua_touserdata(L, 1);
  size_t i;
  lua_createtable(L, 0, a->n > INT32_MAX ? INT32_MAX : (int)a->n);
  for (i = 0; i < a->n; i++) {
    lua_pushlstring(L, a->names + a->e[i].at, a->e[i].len);
    tl_pushint64(L, a->e[i].v);
    lua_rawset(L, -3);
  }
  return 1;
}

int tl_name_row(void *ud, const tally_row *row) {
  return tl_values_add(ud, row->name, row->name_len, 0);
}

/* The list of the collection at argument 1 (a light userdata), under
 * lua_pcall as tl_values_table. */
static int tl_names_list(lua_State *L) {
  const tl_values *a = (const tl_values *)lua_touserdata(L, 1);
  size_t i;
  lua_createtable(L, a->n > INT32_MAX ? INT32_MAX : (int)a->n, 0);
  for (i = 0; i < a->n; i++) {
    lua_pushlstring(L, a->names + a->e[i].at, a->e[i].len);
    lua_rawseti(L, -2, (lua_Integer)i + 1);
  }
  return 1;
}

/* Given the walk's rc: build the table with `make` under lua_pcall
 * (`room`: the stack slots it takes), free the collection, then return
 * the table, or the failure, or raise. */
static int tl_push(lua_State *L, tl_values *a, int rc, lua_CFunction make, int room) {
  int status = LUA_OK;
  if (rc == 0 && !lua_checkstack(L, room)) rc = TALLY_ENOMEM;
  if (rc == 0) {
    lua_pushcfunction(L, make);
    lua_pushlightuserdata(L, a);
    status = lua_pcall(L, 1, 1, 0);
  }
  free(a->names);
  free(a->e);
  free(a->rate);
  memset(a, 0, sizeof *a);
  if (status != LUA_OK) return lua_error(L); /* the message is on top */
  if (rc == TALLY_ENOMEM) return luaL_error(L, "not enough memory");
  if (rc == 1)
    return tl_fail_msg(L, TALLY_ERANGE, "a value beyond 2^53 (require \"tally\")");
  if (rc < 0) return tl_fail(L, rc);
  return 1;
}

int tl_names_push(lua_State *L, tl_values *a, int rc) {
  return tl_push(L, a, rc, tl_names_list, 4); /* the call, list, name */
}

int tl_values_push(lua_State *L, tl_values *a, int rc) {
  for (size_t i = 0; rc == 0 && i < a->n; i++)
    if (!tl_canpush(L, a->e[i].v)) rc = 1;      /* checked before the table is made */
  return tl_push(L, a, rc, tl_values_table, 8); /* the call, table, key, box */
}

/* ---- the top k ------------------------------------------------------------ */

int tl_top_add(void *ud, const char *name, size_t len, int64_t v, const tally_rollup *r) {
  tl_values *a = (tl_values *)ud;
  size_t cap = a->cap;
  int rc = tl_values_add(ud, name, len, v);
  if (rc) return rc;
  if (a->cap != cap || a->rate == NULL) { /* the rates grow with the entries */
    double *rate = (double *)realloc(a->rate, a->cap * sizeof(*rate));
    if (rate == NULL) return TALLY_ENOMEM;
    a->rate = rate;
  }
  a->rate[a->n - 1] = r ? tally_rollup_rate(r) : NAN;
  return 0;
}

static int tl_top_list(lua_State *L) {
  const tl_values *a = (const tl_values *)lua_touserdata(L, 1);
  size_t i;
  lua_createtable(L, a->n > INT32_MAX ? INT32_MAX : (int)a->n, 0);
  for (i = 0; i < a->n; i++) {
    lua_createtable(L, 0, 3);
    lua_pushlstring(L, a->names + a->e[i].at, a->e[i].len);
    lua_setfield(L, -2, "name");
    tl_pushint64(L, a->e[i].v);
    lua_setfield(L, -2, "value");
    if (!isnan(a->rate[i])) {
      lua_pushnumber(L, (lua_Number)a->rate[i]);
      lua_setfield(L, -2, "rate");
    }
    lua_rawseti(L, -2, (lua_Integer)i + 1);
  }
  return 1;
}

int tl_top_push(lua_State *L, tl_values *a, int rc) {
  for (size_t i = 0; rc == 0 && i < a->n; i++)
    if (!tl_canpush(L, a->e[i].v)) rc = 1;
  return tl_push(L, a, rc, tl_top_list, 8); /* the call, list, row, name, box */
}
