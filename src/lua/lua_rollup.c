/* lua_rollup.c -- the schedule handle ("tally.schedule"), rolled
 * records, history, and the clock and sleep that lua/tally/rollup.lua
 * builds db:rollup, db:tick and db:run on.
 *
 *   core.schedule(db, pattern, every_s, rings) -> schedule handle
 *       rings: { { res_s, len }, ... }
 *   sched:tick(now_s, collect) -> status, period, counters, records|nil, skipped
 *   c:rolled() -> { value, at, delta, rate, count } or nil
 *   c:_history(res_s) -> { { t =, v = }, ... } or nil, message, code
 *   c:_rings() -> { { res_s, len }, ... } or nil
 *   core.now() -> seconds since the epoch (a float, microseconds)
 *   core.sleep(s)
 *
 * Times cross into C as integer milliseconds, rounded to the nearest. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "lua_aux.h"

#define TL_SCHEDULE_MT "tally.schedule"

typedef struct tl_schedule {
  tally_schedule *sch; /* NULL once freed */
  tl_store *db;        /* kept alive by the user value */
} tl_schedule;

/* Seconds (a Lua number) to milliseconds; raises unless finite and >= 0. */
static int64_t tl_checkms(lua_State *L, int arg, const char *what) {
  double s = luaL_checknumber(L, arg);
  if (!(s >= 0 && s < 9.2e15)) /* also refuses NaN */
    tl_argerror(L, arg,
                "%s must be a time in seconds "
                "since the epoch",
                what);
  return (int64_t)llround(s * 1000.0);
}

void tl_pushrollup(lua_State *L, const tally_rollup *r) {
  lua_createtable(L, 0, 5);
  tl_setint(L, "value", r->value);
  lua_pushnumber(L, (lua_Number)r->at_ms / 1000.0);
  lua_setfield(L, -2, "at");
  tl_setint(L, "delta", r->delta);
  lua_pushnumber(L, (lua_Number)tally_rollup_rate(r));
  lua_setfield(L, -2, "rate");
  tl_setint(L, "count", (int64_t)r->count);
}

/* ---- schedules -------------------------------------------------------------------- */

static tl_schedule *tl_checkschedule(lua_State *L) {
  tl_schedule *u = (tl_schedule *)tl_checkudata(L, 1, TL_SCHEDULE_MT);
  if (u->sch == NULL) luaL_error(L, "attempt to use a freed schedule");
  if (u->db->store == NULL) luaL_error(L, "attempt to use a closed store");
  return u;
}

/* An integer for a uint32_t field; out-of-range values become 0, which the
 * core refuses with its own message. */
static uint32_t tl_checku32(lua_State *L, int idx) {
  lua_Integer v = tl_checkinteger(L, idx);
  return v < 1 || v > (lua_Integer)UINT32_MAX ? 0u : (uint32_t)v;
}

/* core.schedule(db, pattern, every_s, rings) */
static int tl_schedule_new(lua_State *L) {
  tl_store *d = tl_checkstore(L, 1);
  size_t plen;
  const char *pattern = luaL_checklstring(L, 2, &plen);
  double every = luaL_checknumber(L, 3);
  tally_ring rings[TALLY_RINGS_MAX];
  uint32_t n = 0;
  lua_Integer i, count;
  tl_schedule *u;
  int64_t every_ms;
  int rc;
  luaL_checktype(L, 4, LUA_TTABLE);
  count = (lua_Integer)lua_rawlen(L, 4);
  if (count > TALLY_RINGS_MAX)
    return luaL_error(L, "at most %d history resolutions, got %d", TALLY_RINGS_MAX,
                      (int)count);
  for (i = 1; i <= count; i++, n++) {
    lua_rawgeti(L, 4, i);
    luaL_checktype(L, -1, LUA_TTABLE);
    lua_rawgeti(L, -1, 1);
    lua_rawgeti(L, -2, 2);
    rings[n].res_s = tl_checku32(L, -2);
    rings[n].len = tl_checku32(L, -1);
    lua_pop(L, 3);
  }
  if (!(every > 0 && every <= 366.0 * 86400))
    return luaL_error(L, "every must be a number of seconds, more than 0 and "
                         "at most 366 days");
  u = (tl_schedule *)tl_newud(L, sizeof *u, 1);
  u->sch = NULL;
  u->db = d;
  luaL_setmetatable(L, TL_SCHEDULE_MT);
  lua_pushvalue(L, 1);
  tl_setuv(L, -2, 1); /* the store handle outlives its schedules */
  every_ms = (int64_t)llround(every * 1000.0);
  rc = tally_schedule_new(d->store, pattern, plen, every_ms > 0 ? every_ms : 1, rings, n,
                          &u->sch);
  if (rc < 0) return luaL_error(L, "%s", tally_errmsg());
  return 1;
}

static int tl_schedule_free(lua_State *L) {
  tl_schedule *u = (tl_schedule *)tl_checkudata(L, 1, TL_SCHEDULE_MT);
  tally_schedule_free(u->sch);
  u->sch = NULL;
  return 0;
}

/* Records gathered during a tick, turned into Lua tables after it: no Lua
 * call may raise while the lease is held. */
struct tl_gather {
  struct tl_item {
    const char *name;
    size_t len;
    tally_rollup r;
  } * v;
  size_t n, cap;
  int nomem;
};

static void tl_gather_one(void *ud, const char *name, size_t len, const tally_rollup *r) {
  struct tl_gather *g = ud;
  if (g->nomem) return;
  if (g->n == g->cap) {
    size_t cap = g->cap ? g->cap * 2 : 256;
    struct tl_item *v = realloc(g->v, cap * sizeof *v);
    if (!v) {
      g->nomem = 1;
      return;
    }
    g->v = v;
    g->cap = cap;
  }
  g->v[g->n].name = name;
  g->v[g->n].len = len;
  g->v[g->n].r = *r;
  g->n++;
}

static const char *const tl_tick_status[] = {"ran", "not_due", "busy", "lost"};

/* sched:tick(now_s, collect) -> status, period, counters, records or nil, skipped */
static int tl_schedule_tick(lua_State *L) {
  tl_schedule *u = tl_checkschedule(L);
  int64_t now = tl_checkms(L, 2, "now");
  int collect = lua_toboolean(L, 3);
  struct tl_gather g = {NULL, 0, 0, 0};
  tally_tick_result res;
  size_t i;
  int rc = tally_schedule_tick(u->sch, now, collect ? tl_gather_one : NULL, &g, &res);
  if (rc < 0) {
    free(g.v);
    return tl_fail(L, rc);
  }
  lua_pushstring(L, tl_tick_status[res.status]);
  lua_pushinteger(L, (lua_Integer)res.period);
  lua_pushinteger(L, (lua_Integer)res.counters);
  if (!collect) {
    lua_pushnil(L);
    lua_pushinteger(L, (lua_Integer)res.skipped);
    return 5;
  }
  if (g.nomem) {
    free(g.v);
    return luaL_error(L, "out of memory gathering rollup records");
  }
  for (i = 0; i < g.n; i++) { /* under LuaJIT: no raise while g.v is held */
    if (!tl_canpush(L, g.v[i].r.value) || !tl_canpush(L, g.v[i].r.delta)) {
      free(g.v);
      g.v = NULL;
      tl_pushint64(L, INT64_MAX); /* raises: no int64_t box registered */
    }
  }
  lua_createtable(L, (int)g.n, 0);
  for (i = 0; i < g.n; i++) {
    tl_pushrollup(L, &g.v[i].r);
    lua_pushlstring(L, g.v[i].name, g.v[i].len);
    lua_setfield(L, -2, "name");
    lua_rawseti(L, -2, (lua_Integer)i + 1);
  }
  free(g.v);
  lua_pushinteger(L, (lua_Integer)res.skipped);
  return 5;
}

/* ---- counter methods ------------------------------------------------------------- */

static int tl_counter_rolled(lua_State *L) {
  tl_counter *h = tl_checkcounter(L, 1);
  tally_rollup r;
  int rc = tally_counter_rolled(h->c, &r);
  if (rc == TALLY_ENOROLLUP) {
    lua_pushnil(L);
    return 1;
  }
  if (rc < 0) return tl_fail(L, rc);
  tl_pushrollup(L, &r);
  return 1;
}

static int tl_counter_history(lua_State *L) {
  tl_counter *h = tl_checkcounter(L, 1);
  lua_Integer res = tl_checkinteger(L, 2);
  tally_bucket stackbuf[256], *buf = stackbuf;
  uint32_t n = 0, cap = 256, i;
  int rc;
  if (res < 1 || res > (lua_Integer)TALLY_RING_RES_MAX)
    return luaL_argerror(L, 2, "resolution out of range");
  for (;;) {
    rc = tally_counter_history(h->c, (uint32_t)res, buf, cap, &n);
    if (rc < 0 || n <= cap) break;
    if (buf != stackbuf) free(buf);
    cap = n + 64; /* rings only grow by a rollup; a little slack */
    buf = malloc(cap * sizeof *buf);
    if (!buf) return luaL_error(L, "out of memory");
  }
  if (rc < 0) {
    if (buf != stackbuf) free(buf);
    return tl_fail(L, rc);
  }
  for (i = 0; i < n; i++) { /* under LuaJIT: no raise while buf is held */
    if (!tl_canpush(L, buf[i].value)) {
      int64_t v = buf[i].value;
      if (buf != stackbuf) free(buf);
      tl_pushint64(L, v); /* raises: no int64_t box registered */
    }
  }
  lua_createtable(L, (int)n, 0);
  for (i = 0; i < n; i++) {
    lua_createtable(L, 0, 2);
    tl_setint(L, "t", buf[i].t);
    tl_setint(L, "v", buf[i].value);
    lua_rawseti(L, -2, (lua_Integer)i + 1);
  }
  if (buf != stackbuf) free(buf);
  return 1;
}

static int tl_counter_rings(lua_State *L) {
  tl_counter *h = tl_checkcounter(L, 1);
  tally_ring rings[TALLY_RINGS_MAX];
  uint32_t n, i;
  int rc = tally_counter_rings(h->c, rings, TALLY_RINGS_MAX, &n);
  if (rc == TALLY_ENOROLLUP) {
    lua_pushnil(L);
    return 1;
  }
  if (rc < 0) return tl_fail(L, rc);
  lua_createtable(L, (int)n, 0);
  for (i = 0; i < n && i < TALLY_RINGS_MAX; i++) {
    lua_createtable(L, 2, 0);
    lua_pushinteger(L, (lua_Integer)rings[i].res_s);
    lua_rawseti(L, -2, 1);
    lua_pushinteger(L, (lua_Integer)rings[i].len);
    lua_rawseti(L, -2, 2);
    lua_rawseti(L, -2, (lua_Integer)i + 1);
  }
  return 1;
}

/* ---- clock -------------------------------------------------------------------------- */

static int tl_now(lua_State *L) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  lua_pushnumber(L, (lua_Number)ts.tv_sec + (lua_Number)(ts.tv_nsec / 1000) / 1e6);
  return 1;
}

static int tl_sleep(lua_State *L) {
  double s = luaL_checknumber(L, 1);
  struct timespec ts;
  if (s != s) return tl_argerror(L, 1, "seconds expected, got nan");
  if (!(s > 0)) return 0;
  if (s > 86400) s = 86400;
  ts.tv_sec = (time_t)s;
  ts.tv_nsec = (long)((s - (double)ts.tv_sec) * 1e9);
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
  return 0;
}

static const luaL_Reg tl_schedule_meta[] = {{"__gc", tl_schedule_free}, {NULL, NULL}};

static const luaL_Reg tl_schedule_methods[] = {
    {"tick", tl_schedule_tick}, {"free", tl_schedule_free}, {NULL, NULL}};

/* Needs the counter class (tl_open_counter): adds methods to it. */
int tl_open_rollup(lua_State *L) {
  static const luaL_Reg counter_extra[] = {{"rolled", tl_counter_rolled},
                                           {"_history", tl_counter_history},
                                           {"_rings", tl_counter_rings},
                                           {NULL, NULL}};
  tl_newclass(L, TL_SCHEDULE_MT, tl_schedule_meta, tl_schedule_methods);
  lua_pop(L, 1);
  lua_getfield(L, -1, "counter_methods");
  luaL_setfuncs(L, counter_extra, 0);
  lua_pop(L, 1);
  lua_pushcfunction(L, tl_schedule_new);
  lua_setfield(L, -2, "schedule");
  lua_pushcfunction(L, tl_now);
  lua_setfield(L, -2, "now");
  lua_pushcfunction(L, tl_sleep);
  lua_setfield(L, -2, "sleep");
  return 0;
}
