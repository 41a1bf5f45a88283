/* lua_tally.h -- what the binding's C files share: the store and counter
 * handles (see lua_tally.c) and the helpers the other files use. */
#ifndef TALLY_LUA_TALLY_H
#define TALLY_LUA_TALLY_H

#include <stddef.h>
#include <stdint.h>

#include "lua.h"
#include "lauxlib.h"
#include "tally.h"

#define TL_STORE_MT "tally.store"
#define TL_COUNTER_MT "tally.counter"

/* Salts for the self-pointers: a counter never passes for a store. */
#define TL_STORE_SALT ((uintptr_t)0x5a17e5u)
#define TL_COUNTER_SALT ((uintptr_t)0xc0417e5u)

enum { TL_SUV_CACHE = 1, TL_SUV_FAMILIES = 2, TL_SUV_N = 2 };  /* store */
enum { TL_CUV_STORE = 1, TL_CUV_POLICY = 2, TL_CUV_N = 2 };    /* counter */

typedef struct tl_counter tl_counter;

typedef struct tl_store {
  uintptr_t key;          /* (uintptr_t)self ^ TL_STORE_SALT */
  tally_store *store;     /* NULL once closed */
  tl_counter *counters;   /* open counter handles made on this store */
  size_t speclen;
  char spec[];            /* "memory" or "file:PATH" */
} tl_store;

struct tl_counter {
  uintptr_t key;          /* (uintptr_t)self ^ TL_COUNTER_SALT */
  tally_counter *c;       /* NULL once closed (also when its store closes) */
  tl_store *db;           /* kept alive through user value TL_CUV_STORE */
  tl_counter *prev, *next;
  int32_t policy;         /* the stored policy */
  int hasfn;              /* CUSTOM with a Lua function in TL_CUV_POLICY */
  size_t namelen;
  char name[];
};

/* The open store or counter handle at idx; raise otherwise. */
tl_store *tl_checkstore(lua_State *L, int idx);
tl_counter *tl_checkcounter(lua_State *L, int idx);
/* nil, message, code name: the environment-failure convention. */
int tl_fail(lua_State *L, int rc);
/* Called by c:value(opts) with (counter, opts): see lua_rollup.c. */
int tl_counter_value_opts(lua_State *L);
/* Registers the rollup functions in the module table on top of the stack. */
void tl_rollup_register(lua_State *L);

#endif
