/* lua_parcel.c -- text handed from one Lua state of the process to
 * another: a scrape made on one of nginx's thread pools (its own Lua VM,
 * tally.openresty_thread) and sent by the worker (tally.openresty).
 *
 * ngx.run_worker_thread copies what its function returns into the
 * worker's VM in one step, and a step of 40 MB is what the thread pool is
 * there to avoid. So the worker owns a parcel (a userdata: the process's
 * copy of the text, freed with it: by its owner, or by the garbage
 * collector when a request is dropped), passes its number to the thread,
 * which appends its pieces to it by number, and takes the text back a
 * piece at a time, yielding between pieces. The parcels are the
 * process's: one list under a mutex, shared by every Lua state that loads
 * this module. A number is never used twice, so a thread still appending
 * to a parcel its request has freed gets an error, not another request's
 * parcel; once the owner begins to take it, the parcel is sealed (an
 * append is an error), so the text it reads from outside the lock never
 * moves.
 */
#include "lua_aux.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TL_PARCEL_MT "tally.parcel"

/* The text is kept in blocks of 1 MiB (a longer append: a block its
 * size), each freed once taken: one buffer grown by realloc moved tens of
 * MB with mremap, which holds the process's memory map against the
 * worker's page faults, and its munmap at the end kept the event loop
 * 11 ms (strace, a scrape of 1M series). */
#define BLOCK (1u << 20)
struct block {
  struct block *next;
  size_t n, cap;
  char text[];
};

struct parcel {
  struct parcel *next;
  lua_Integer id;
  struct block *head, *tail;
  size_t n, taken; /* bytes appended; bytes of head taken */
  int sealed;      /* being taken: no more appends, so the blocks stay */
};

static pthread_mutex_t parcels_lock = PTHREAD_MUTEX_INITIALIZER;
static struct parcel *parcels;
static lua_Integer parcels_made;

typedef struct {
  lua_Integer id; /* 0 once freed */
} tl_parcel;

/* the parcel numbered id, or NULL; caller holds parcels_lock */
static struct parcel **find(lua_Integer id) {
  struct parcel **at = &parcels;
  while (*at && (*at)->id != id) at = &(*at)->next;
  return *at ? at : NULL;
}

static void parcel_free(tl_parcel *u) {
  if (!u->id) return;
  pthread_mutex_lock(&parcels_lock);
  struct parcel **at = find(u->id), *x = at ? *at : NULL;
  if (x) *at = x->next;
  pthread_mutex_unlock(&parcels_lock);
  for (struct block *b = x ? x->head : NULL, *next; b; b = next) {
    next = b->next;
    free(b);
  }
  free(x);
  u->id = 0;
}

/* core.parcel() -> a new, empty parcel */
static int tl_parcel_new(lua_State *L) {
  tl_parcel *u = (tl_parcel *)tl_newud(L, sizeof *u, 0);
  u->id = 0;
  luaL_setmetatable(L, TL_PARCEL_MT);
  struct parcel *x = calloc(1, sizeof *x);
  if (!x) return luaL_error(L, "not enough memory");
  pthread_mutex_lock(&parcels_lock);
  x->id = u->id = ++parcels_made;
  x->next = parcels;
  parcels = x;
  pthread_mutex_unlock(&parcels_lock);
  return 1;
}

static tl_parcel *check(lua_State *L) {
  return (tl_parcel *)luaL_checkudata(L, 1, TL_PARCEL_MT);
}

/* parcel:id() -> its number, for core.parcel_add in another Lua state */
static int parcel_id(lua_State *L) {
  tl_parcel *u = check(L);
  if (!u->id) return luaL_error(L, "the parcel was freed");
  lua_pushinteger(L, u->id);
  return 1;
}

/* core.parcel_add(id, text) -> true: text appended to parcel id; raises
 * if it is gone (its owner freed it) or memory runs out */
static int tl_parcel_add(lua_State *L) {
  lua_Integer id = luaL_checkinteger(L, 1);
  size_t len;
  const char *s = luaL_checklstring(L, 2, &len);
  const char *fail = NULL;
  pthread_mutex_lock(&parcels_lock);
  struct parcel **at = find(id), *x = at ? *at : NULL;
  if (!x) {
    fail = "is gone (its owner freed it)";
  } else if (x->sealed) {
    fail = "is sealed (its owner is taking it)";
  } else {
    struct block *b = x->tail;
    if (!b || len > b->cap - b->n) {
      size_t cap = len > BLOCK ? len : BLOCK;
      b = malloc(sizeof *b + cap);
      if (b) {
        b->next = NULL, b->n = 0, b->cap = cap;
        if (x->tail)
          x->tail->next = b;
        else
          x->head = b;
        x->tail = b;
      }
    }
    if (b) {
      memcpy(b->text + b->n, s, len);
      b->n += len, x->n += len;
    } else {
      fail = "is out of memory";
    }
  }
  pthread_mutex_unlock(&parcels_lock);
  if (fail) {
    char msg[96]; /* lua_pushfstring has no 64-bit integer under LuaJIT */
    snprintf(msg, sizeof msg, "parcel %lld %s", (long long)id, fail);
    return luaL_error(L, "%s", msg);
  }
  lua_pushboolean(L, 1);
  return 1;
}

/* parcel:take([max]) -> its next piece of at most max bytes (default
 * 65536; never two blocks' bytes), or nil once all is taken; seals it */
static int parcel_take(lua_State *L) {
  tl_parcel *u = check(L);
  lua_Integer max = luaL_optinteger(L, 2, 65536);
  luaL_argcheck(L, max > 0, 2, "a piece of at least 1 byte expected");
  if (!u->id) return luaL_error(L, "the parcel was freed");
  pthread_mutex_lock(&parcels_lock);
  struct parcel *x = *find(u->id); /* there until u frees it */
  x->sealed = 1;
  pthread_mutex_unlock(&parcels_lock);
  struct block *b = x->head;
  while (b && x->taken == b->n) { /* taken: its memory back now */
    x->head = b->next;
    free(b);
    b = x->head, x->taken = 0;
  }
  if (!b) {
    x->tail = NULL;
    lua_pushnil(L);
    return 1;
  }
  size_t take = b->n - x->taken;
  if ((lua_Integer)take > max) take = (size_t)max;
  lua_pushlstring(L, b->text + x->taken, take);
  x->taken += take;
  return 1;
}

/* parcel:size() -> the bytes appended so far */
static int parcel_size(lua_State *L) {
  tl_parcel *u = check(L);
  lua_Integer n = 0;
  pthread_mutex_lock(&parcels_lock);
  struct parcel **at = u->id ? find(u->id) : NULL;
  if (at) n = (lua_Integer)(*at)->n;
  pthread_mutex_unlock(&parcels_lock);
  lua_pushinteger(L, n);
  return 1;
}

/* parcel:free(): its memory back now (also when collected, or closed) */
static int parcel_close(lua_State *L) {
  parcel_free(check(L));
  return 0;
}

static const luaL_Reg parcel_methods[] = {{"id", parcel_id},
                                          {"take", parcel_take},
                                          {"size", parcel_size},
                                          {"free", parcel_close},
                                          {NULL, NULL}};
static const luaL_Reg parcel_meta[] = {
    {"__gc", parcel_close}, {"__close", parcel_close}, {NULL, NULL}};

int tl_open_parcel(lua_State *L) {
  tl_newclass(L, TL_PARCEL_MT, parcel_meta, parcel_methods);
  lua_pop(L, 1);
  lua_pushcfunction(L, tl_parcel_new);
  lua_setfield(L, -2, "parcel");
  lua_pushcfunction(L, tl_parcel_add);
  lua_setfield(L, -2, "parcel_add");
  return 0;
}
