/* cli.h -- what the tally command's C files share (main.c, cli_run.c,
 * cli_repl.c, cli_term.c, cli_peek.c, cli_httpd.c). They are compiled into the `tally` executable
 * only, never into libtally or the Lua module. */
#ifndef TALLY_CLI_H
#define TALLY_CLI_H

#include "lua.h"

#define CLI_PROGNAME "tally"

/* cli_run.c: lua_pcall with a traceback message handler; while the chunk runs, Ctrl-C
 * (SIGINT) stops it with the error "interrupted!" as lua.c does, and a
 * second Ctrl-C kills the process. Returns the pcall status. */
int cli_docall(lua_State *L, int narg, int nres);

/* If status is an error, print "tally: message" (the message on top of the
 * stack, popped) on stderr. Returns status. */
int cli_report(lua_State *L, int status);

/* The prompt: GNU readline on a terminal, plain lines otherwise. Returns
 * when input ends (Ctrl-D) or on SIGTERM/SIGHUP. */
void cli_repl(lua_State *L);

/* Modules preloaded by the command only. */
int cli_open_term(lua_State *L);   /* tally.term: raw mode, keys, window size */
int cli_open_peek(lua_State *L);   /* tally.peek: read-only looks at a store */
void cli_peek_watch(lua_State *L); /* adds watch's reads to the table on top */
int cli_open_httpd(lua_State *L);  /* tally.httpd: tally serve's HTTP server */

#endif
