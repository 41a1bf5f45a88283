/* cli_run.c -- running a chunk for the tally command: a traceback on
 * error, and Ctrl-C stopping it.
 *
 * Both the script runner (main.c) and the prompt (cli_repl.c) run Lua
 * through cli_docall, as lua.c does: a message handler adds the traceback,
 * and while the chunk runs SIGINT sets a hook that raises "interrupted!"
 * at the next Lua instruction; a second Ctrl-C kills the process (a chunk
 * stuck in a C call). cli_report prints what failed.
 */
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "lua.h"
#include "lauxlib.h"
#include "cli.h"

/* Message handler: the message plus a traceback. */
static int msghandler(lua_State *L) {
  const char *msg = lua_tostring(L, 1);
  if (msg == NULL) {
    if (luaL_callmeta(L, 1, "__tostring") && lua_type(L, -1) == LUA_TSTRING) return 1;
    msg = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
  }
  luaL_traceback(L, L, msg, 1);
  return 1;
}

/* The state a Ctrl-C stops. A signal handler takes no argument, so this
 * one pointer is a static; lua_sethook is safe to call from a handler
 * (lua.c relies on it the same way). */
static lua_State *volatile sig_L;

static void lstop(lua_State *L, lua_Debug *ar) {
  (void)ar;
  lua_sethook(L, NULL, 0, 0);
  luaL_error(L, "interrupted!");
}

static void laction(int sig) {
  int flag = LUA_MASKCALL | LUA_MASKRET | LUA_MASKLINE | LUA_MASKCOUNT;
  signal(sig, SIG_DFL); /* a second Ctrl-C kills us (say, stuck in a C call) */
  lua_sethook(sig_L, lstop, flag, 1);
}

int cli_docall(lua_State *L, int narg, int nres) {
  struct sigaction sa, old;
  int status, base = lua_gettop(L) - narg;
  lua_State *prev = sig_L;
  lua_pushcfunction(L, msghandler);
  lua_insert(L, base);
  sig_L = L;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = laction;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, &old);
  status = lua_pcall(L, narg, nres, base);
  sigaction(SIGINT, &old, NULL);
  lua_sethook(L, NULL, 0, 0); /* a Ctrl-C that came too late to stop anything */
  sig_L = prev;
  lua_remove(L, base);
  return status;
}

int cli_report(lua_State *L, int status) {
  if (status != LUA_OK) {
    const char *msg = lua_tostring(L, -1);
    fflush(stdout);
    fprintf(stderr, "%s: %s\n", CLI_PROGNAME,
            msg ? msg : "(error object is not a string)");
    fflush(stderr);
    lua_pop(L, 1);
  }
  return status;
}
