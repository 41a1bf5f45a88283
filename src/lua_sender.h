/* lua_sender.h -- the binding of the HTTP sender (see lua_sender.c). */
#ifndef TALLY_LUA_SENDER_H
#define TALLY_LUA_SENDER_H

#include "lua.h"

/* Sets field "sender" (the constructor) in the module table on top of the
 * stack, and creates the "tally.sender" metatable. */
void tl_sender_register(lua_State *L);

#endif
