/* test_lua_oom.c -- db:snapshot, db:values and db:names when Lua runs out
 * of memory.
 *
 * Each walks the core with a callback (tally_store_snapshot, _values, _each),
 * and the core owns memory while it calls back. The binding builds its
 * table after the walk, under lua_pcall (src/lua/lua_values.c), so a Lua
 * memory error while pushing frees what was collected and leaves the core
 * alone. This test embeds Lua 5.4 with an allocator that refuses past a
 * limit, loads the module built beside it, and raises the limit step by
 * step: some calls fail with "not enough memory", the last succeed whole,
 * and no C memory is lost on the way (mallinfo2, or LeakSanitizer at
 * exit under ASan, where mallinfo2 does not see the heap).
 */
#include <lauxlib.h>
#include <lua.h>
#include <lualib.h>
#include <malloc.h>

#include "testutil.h"

#define NAMES   3000 /* counters: a leaked walk is about 200 KiB of C memory */
#define STR_(x) #x
#define STR(x)  STR_(x)

struct budget {
  size_t used, limit; /* limit 0: none */
};

static void *limited(void *ud, void *p, size_t osize, size_t nsize) {
  struct budget *b = ud;
  size_t old = p ? osize : 0;
  if (nsize == 0) {
    free(p);
    b->used -= old;
    return NULL;
  }
  if (b->limit && nsize > old && b->used + (nsize - old) > b->limit) return NULL;
  void *q = realloc(p, nsize);
  if (q) b->used = b->used - old + nsize;
  return q;
}

static void run(lua_State *L, const char *code) {
  if (luaL_dostring(L, code) != LUA_OK) {
    TU_FAIL("%s: %s", code, lua_tostring(L, -1));
    lua_pop(L, 1);
  }
}

/* Call db:METHOD() (global db) with Lua allowed `room` bytes beyond what
 * it holds now: 1 if it returned a table of NAMES entries, 0 if it raised
 * "not enough memory", -1 otherwise (reported). */
static int call_with_room(lua_State *L, struct budget *b, const char *method,
                          size_t room) {
  lua_getglobal(L, "count_of");
  lua_getglobal(L, "db");
  lua_getfield(L, -1, method);
  lua_insert(L, -2); /* count_of, method, db */
  lua_gc(L, LUA_GCCOLLECT, 0);
  lua_gc(L, LUA_GCSTOP, 0); /* what the limit counts is the call's own */
  b->limit = b->used + room;
  int st = lua_pcall(L, 1, 1, 0);
  b->limit = 0;
  lua_gc(L, LUA_GCRESTART, 0);
  int got = -1;
  if (st == LUA_OK) {
    lua_insert(L, -2); /* result, count_of */
    lua_pushvalue(L, -2);
    lua_remove(L, -3);
    if (lua_pcall(L, 1, 1, 0) == LUA_OK && lua_tointeger(L, -1) == NAMES)
      got = 1;
    else
      TU_FAIL("db:%s() returned something else than %d values", method, NAMES);
  } else {
    const char *msg = lua_tostring(L, -1);
    if (msg && strstr(msg, "not enough memory"))
      got = 0;
    else
      TU_FAIL("db:%s() raised '%s'", method, msg ? msg : "?");
    lua_remove(L, -2); /* count_of */
  }
  lua_pop(L, 1);
  return got;
}

static size_t c_heap(void) {
  struct mallinfo2 mi = mallinfo2();
  return mi.uordblks;
}

static void test_method(lua_State *L, struct budget *b, const char *method) {
  int failed = 0, succeeded = 0;
  size_t before = c_heap();
  for (size_t room = 0; room < 4u << 20 && succeeded < 3; room += 8192) {
    int r = call_with_room(L, b, method, room);
    if (r < 0) return;
    failed += r == 0;
    succeeded += r == 1;
  }
  lua_gc(L, LUA_GCCOLLECT, 0);
  size_t after = c_heap();
  EXPECT(failed > 10);    /* the limit did bite, many times */
  EXPECT(succeeded == 3); /* and enough room makes the whole table */
#if !defined(__SANITIZE_ADDRESS__)
  /* each failure after the walk would leak its collection (> 50 KiB) */
  if (after > before + (256u << 10))
    TU_FAIL("db:%s(): the C heap grew by %zu bytes over %d failures", method,
            after - before, failed);
#else
  (void)before, (void)after; /* LeakSanitizer checks at exit */
#endif
  printf("db:%s(): %d calls out of memory, then %d whole tables\n", method, failed,
         succeeded);
}

int main(void) {
  struct budget b = {0, 0};
  lua_State *L = lua_newstate(limited, &b);
  if (!L) {
    fprintf(stderr, "test_lua_oom: lua_newstate failed\n");
    return 1;
  }
  luaL_openlibs(L);
  run(L, "package.path = '" TALLY_LUA_DIR "/?.lua;" TALLY_LUA_DIR
         "/?/init.lua;' .. package.path\n"
         "package.cpath = '" TALLY_LUA_DIR "/?.so;' .. package.cpath");
  run(L, "tally = require 'tally'; db = assert(tally.open('memory'))");
  run(L, "for i = 1, " STR(NAMES) " do assert(db:incr('oom:' .. i, i)) end");
  run(L,
      "function count_of(t) local n = 0 for _ in pairs(t) do n = n + 1 end return n end");
  test_method(L, &b, "snapshot");
  test_method(L, &b, "values");
  test_method(L, &b, "names");
  run(L, "db:close()");
  lua_close(L);
  return tu_finish("test_lua_oom");
}
