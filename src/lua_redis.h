/* lua_redis.h -- the binding of the Redis client and flusher (see lua_redis.c). */
#ifndef TALLY_LUA_REDIS_H
#define TALLY_LUA_REDIS_H

#include "lua.h"

/* Sets fields "redis" and "flusher" (the constructors) in the module table
 * on top of the stack, and creates the "tally.redis" and "tally.flusher"
 * metatables. */
void tl_redis_register(lua_State *L);

#endif
