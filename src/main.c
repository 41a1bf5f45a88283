/* main.c -- the tally command: a Lua 5.4 interpreter with tally preloaded.
 *
 *   tally [options] [script [args...]]
 *
 * Runs script with `arg` set as lua5.4 sets it (arg[0] the script, arg[-1]
 * this program, arg[1..] the arguments, also passed as `...`), after any
 * -e chunks. With no script and no -e it starts a prompt: each line is tried
 * as "return <line>" first, then as a statement; an incomplete statement
 * reads more lines. package.preload["tally.core"] is the linked-in binding,
 * and package.path starts with the Lua side next to this executable: the
 * build tree (bin/../tally/init.lua) and the install tree
 * (bin/../share/lua/5.4/tally/init.lua). Errors print "tally: message" and a
 * traceback on stderr; the exit status is then 1.
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "lua.h"
#include "lauxlib.h"
#include "lualib.h"
#include "tally.h"

int luaopen_tally_core(lua_State *L);

#define PROGNAME "tally"

static void usage(FILE *f) {
  fprintf(f,
          "usage: " PROGNAME " [options] [script [args]]\n"
          "  -e code   run code (the tally module is the global 'tally')\n"
          "  -i        enter the prompt after running script\n"
          "  -v        show version\n"
          "  -h        show this help\n"
          "  --        stop handling options\n"
          "  -         run stdin as the script\n"
          "With no script and no -e, start a prompt.\n");
}

/* Message handler: the message plus a traceback. */
static int msghandler(lua_State *L) {
  const char *msg = lua_tostring(L, 1);
  if (msg == NULL) {
    if (luaL_callmeta(L, 1, "__tostring") && lua_type(L, -1) == LUA_TSTRING)
      return 1;
    msg = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
  }
  luaL_traceback(L, L, msg, 1);
  return 1;
}

static int docall(lua_State *L, int narg, int nres) {
  int status, base = lua_gettop(L) - narg;
  lua_pushcfunction(L, msghandler);
  lua_insert(L, base);
  status = lua_pcall(L, narg, nres, base);
  lua_remove(L, base);
  return status;
}

static int report(lua_State *L, int status) {
  if (status != LUA_OK) {
    const char *msg = lua_tostring(L, -1);
    fprintf(stderr, "%s: %s\n", PROGNAME, msg ? msg : "(error object is not a string)");
    fflush(stderr);
    lua_pop(L, 1);
  }
  return status;
}

/* package.path = <exe dir>/../?.lua;...;<old>, and the preloaded core. */
static void setpaths(lua_State *L) {
  char exe[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  lua_getglobal(L, "package");
  if (n > 0) {
    char *slash;
    exe[n] = '\0';
    slash = strrchr(exe, '/');
    if (slash != NULL) *slash = '\0';
    lua_getfield(L, -1, "path");
    lua_pushfstring(L,
                    "%s/../?.lua;%s/../?/init.lua;"
                    "%s/../share/lua/5.4/?.lua;%s/../share/lua/5.4/?/init.lua;%s",
                    exe, exe, exe, exe, lua_tostring(L, -1));
    lua_setfield(L, -3, "path");
    lua_pop(L, 1);
  }
  lua_getfield(L, -1, "preload");
  lua_pushcfunction(L, luaopen_tally_core);
  lua_setfield(L, -2, "tally.core");
  lua_pop(L, 2);
}

/* The global `tally`: the module, or the bare core if the Lua side is missing. */
static void settally(lua_State *L) {
  int status;
  lua_getglobal(L, "require");
  lua_pushliteral(L, "tally");
  status = docall(L, 1, 1);
  if (status != LUA_OK) {
    report(L, status);
    lua_getglobal(L, "require");
    lua_pushliteral(L, "tally.core");
    if (report(L, docall(L, 1, 1)) != LUA_OK) return;
  }
  lua_setglobal(L, "tally");
}

static int dochunk(lua_State *L, int status) {
  if (status == LUA_OK) status = docall(L, 0, 0);
  return report(L, status);
}

static void print_results(lua_State *L) {
  int i, n = lua_gettop(L);
  for (i = 1; i <= n; i++) {
    const char *s = luaL_tolstring(L, i, NULL);
    fputs(s, stdout);
    fputs(i < n ? "\t" : "\n", stdout);
    lua_pop(L, 1);
  }
  fflush(stdout);
  lua_settop(L, 0);
}

/* Read one line (any length) into *buf; 0 on EOF. */
static int readline_(char **buf, size_t *cap, size_t *len) {
  *len = 0;
  for (;;) {
    if (*cap - *len < 256) {
      size_t ncap = *cap ? *cap * 2 : 1024;
      char *nb = (char *)realloc(*buf, ncap);
      if (nb == NULL) return 0;
      *buf = nb;
      *cap = ncap;
    }
    if (fgets(*buf + *len, (int)(*cap - *len), stdin) == NULL) return *len > 0;
    *len += strlen(*buf + *len);
    if (*len > 0 && (*buf)[*len - 1] == '\n') return 1;
  }
}

static int incomplete(lua_State *L, int status) {
  if (status == LUA_ERRSYNTAX) {
    size_t lmsg;
    const char *msg = lua_tolstring(L, -1, &lmsg);
    if (lmsg >= 5 && strcmp(msg + lmsg - 5, "<eof>") == 0) {
      lua_pop(L, 1);
      return 1;
    }
  }
  return 0;
}

static void repl(lua_State *L) {
  int tty = isatty(0);
  char *line = NULL, *code = NULL;
  size_t cap = 0, len, clen = 0, ccap = 0;
  if (tty)
    printf("tally %s (%s) -- the module is 'tally'; Ctrl-D exits\n",
           TALLY_VERSION, LUA_RELEASE);
  for (;;) {
    int status;
    if (tty) {
      fputs(clen ? ">> " : "> ", stdout);
      fflush(stdout);
    }
    if (!readline_(&line, &cap, &len)) break;
    if (clen + len + 16 > ccap) {
      size_t ncap = (clen + len + 16) * 2;
      char *nc = (char *)realloc(code, ncap);
      if (nc == NULL) break;
      code = nc;
      ccap = ncap;
    }
    memcpy(code + clen, line, len);
    clen += len;
    lua_settop(L, 0);
    status = LUA_ERRSYNTAX;
    if (clen == len) {  /* a first line: an expression? */
      const char *ret = lua_pushfstring(L, "return %s", line);
      status = luaL_loadbuffer(L, ret, strlen(ret), "=stdin");
      lua_remove(L, -2);
      if (status != LUA_OK) lua_pop(L, 1);
    }
    if (status != LUA_OK) {
      status = luaL_loadbuffer(L, code, clen, "=stdin");
      if (incomplete(L, status)) continue;
    }
    clen = 0;
    if (status == LUA_OK) status = docall(L, 0, LUA_MULTRET);
    if (status == LUA_OK) print_results(L);
    else report(L, status);
  }
  if (tty) fputs("\n", stdout);
  free(line);
  free(code);
  lua_settop(L, 0);
}

/* The whole run inside a protected call: argv in a light userdata. */
typedef struct run_args {
  int argc;
  char **argv;
  int status;
} run_args;

static int pmain(lua_State *L) {
  run_args *ra = (run_args *)lua_touserdata(L, 1);
  int argc = ra->argc, i, script = 0, interactive = 0, ran_e = 0;
  char **argv = ra->argv;

  luaL_openlibs(L);
  setpaths(L);

  for (i = 1; i < argc; i++) {  /* options up to the script */
    const char *a = argv[i];
    if (a[0] != '-' || strcmp(a, "-") == 0) {
      script = i;
      break;
    }
    if (strcmp(a, "--") == 0) {
      if (i + 1 < argc) script = i + 1;
      break;
    } else if (strcmp(a, "-e") == 0) {
      if (++i >= argc) {
        usage(stderr);
        ra->status = 1;
        return 0;
      }
    } else if (strcmp(a, "-i") == 0) {
      interactive = 1;
    } else if (strcmp(a, "-v") == 0) {
      printf("tally %s (%s)\n", TALLY_VERSION, LUA_RELEASE);
      if (i + 1 == argc) return 0;
    } else if (strcmp(a, "-h") == 0) {
      usage(stdout);
      return 0;
    } else {
      fprintf(stderr, "%s: unrecognized option '%s'\n", PROGNAME, a);
      usage(stderr);
      ra->status = 1;
      return 0;
    }
  }

  /* arg: arg[0] the script, negative indices before it, as lua5.4 does */
  {
    int base = script ? script : 0;
    lua_createtable(L, argc - base, base + 1);
    for (i = 0; i < argc; i++) {
      lua_pushstring(L, argv[i]);
      lua_rawseti(L, -2, i - base);
    }
    lua_setglobal(L, "arg");
  }

  for (i = 1; i < (script ? script : argc); i++) {  /* -e chunks, in order */
    if (strcmp(argv[i], "-e") == 0) {
      const char *chunk = argv[++i];
      if (!ran_e) settally(L);
      ran_e = 1;
      if (dochunk(L, luaL_loadbuffer(L, chunk, strlen(chunk), "=(command line)")) != LUA_OK) {
        ra->status = 1;
        return 0;
      }
    } else if (strcmp(argv[i], "--") == 0) {
      break;
    }
  }

  if (script) {
    const char *fname = strcmp(argv[script], "-") == 0 ? NULL : argv[script];
    int status = luaL_loadfile(L, fname), nargs = 0;
    if (status == LUA_OK) {
      for (i = script + 1; i < argc; i++, nargs++) lua_pushstring(L, argv[i]);
      status = docall(L, nargs, 0);
    }
    if (report(L, status) != LUA_OK) {
      ra->status = 1;
      return 0;
    }
  }

  if (interactive || (!script && !ran_e)) {
    if (!ran_e) settally(L);
    repl(L);
  }
  return 0;
}

int main(int argc, char **argv) {
  run_args ra = { argc, argv, 0 };
  lua_State *L = luaL_newstate();
  int status;
  if (L == NULL) {
    fprintf(stderr, "%s: cannot create state: not enough memory\n", PROGNAME);
    return EXIT_FAILURE;
  }
  lua_pushcfunction(L, pmain);
  lua_pushlightuserdata(L, &ra);
  status = lua_pcall(L, 1, 0, 0);
  report(L, status);
  lua_close(L);
  return (status == LUA_OK && ra.status == 0) ? EXIT_SUCCESS : EXIT_FAILURE;
}
