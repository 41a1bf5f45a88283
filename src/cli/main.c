/* main.c -- the tally command: a Lua 5.4 interpreter with tally preloaded,
 * a prompt, and subcommands that inspect a store.
 *
 *   tally [options] [script [args...]]     run a script, -e chunks, or the prompt
 *   tally run [options] script [args...]   the same; script may be named like a subcommand
 *   tally SUBCOMMAND [args...]             ls get incr export import info watch serve help
 *
 * A subcommand is recognised only as the first argument, and only by its
 * exact name: `tally ls` lists a store, `tally ./ls` and `tally run ls` run
 * a script called ls. Subcommands are lua/tally/cmd/cli.lua's `main`; help texts
 * live there too. Scripts get `arg` as lua5.4 sets it (arg[0] the script,
 * negative indices for what came before it, arg[1..] the arguments, also
 * passed as `...`), after any -e chunks. With no script and no -e the
 * prompt starts (cli_repl.c), with the module as the global `tally` and a
 * store as `db`: the one --store names, or a memory store.
 *
 * package.preload holds the linked-in binding ("tally.core") and the
 * command's own C modules ("tally.term", "tally.peek", "tally.httpd"); package.path starts
 * with the Lua side next to this executable: the build tree
 * (bin/../tally/init.lua) and the install tree (bin/../share/lua/5.4/...).
 * Errors print "tally: message" on stderr (with a traceback for errors in
 * Lua code); the exit status is 1, or 2 for a usage error. A store file
 * truncated by another program while open (SIGBUS) is reported by name,
 * with exit status 1.
 */
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "lua.h"
#include "lauxlib.h"
#include "lualib.h"
#include "tally.h"
#include "cli.h"

int luaopen_tally_core(lua_State *L);

#define EXIT_USAGE 2

static const char *const subcommands[] = {"ls",     "get",     "incr",  "export",
                                          "import", "info",    "watch", "serve",
                                          "help",   "compact", NULL};

/* package.path = <exe dir>/../?.lua;...;<old>, and the preloaded C modules. */
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
  lua_pushcfunction(L, cli_open_term);
  lua_setfield(L, -2, "tally.term");
  lua_pushcfunction(L, cli_open_peek);
  lua_setfield(L, -2, "tally.peek");
  lua_pushcfunction(L, cli_open_httpd);
  lua_setfield(L, -2, "tally.httpd");
  lua_pop(L, 2);
}

/* The global `tally`: the module, or the bare core if the Lua side is missing. */
static void settally(lua_State *L) {
  int status;
  lua_getglobal(L, "tally");
  if (!lua_isnil(L, -1)) {
    lua_pop(L, 1);
    return;
  }
  lua_pop(L, 1);
  lua_getglobal(L, "require");
  lua_pushliteral(L, "tally");
  status = cli_docall(L, 1, 1);
  if (status != LUA_OK) {
    cli_report(L, status);
    lua_getglobal(L, "require");
    lua_pushliteral(L, "tally.core");
    if (cli_report(L, cli_docall(L, 1, 1)) != LUA_OK) return;
  }
  lua_setglobal(L, "tally");
}

/* Push require("tally.cmd.cli")[fname]; 0 (nothing pushed, reported) if the Lua
 * side of the command cannot be loaded. */
static int getcli(lua_State *L, const char *fname) {
  int status;
  lua_getglobal(L, "require");
  lua_pushliteral(L, "tally.cmd.cli");
  status = cli_docall(L, 1, 1);
  if (status != LUA_OK) {
    cli_report(L, status);
    return 0;
  }
  lua_getfield(L, -1, fname);
  lua_remove(L, -2);
  return 1;
}

/* Call cli[fname](args...) with the strings given; its integer result (the
 * exit status), or 1 if it raised (reported). */
static int callcli(lua_State *L, const char *fname, int nargs, char **args) {
  int i, status;
  if (!getcli(L, fname)) return EXIT_FAILURE;
  for (i = 0; i < nargs; i++) lua_pushstring(L, args[i]);
  status = cli_docall(L, nargs, 1);
  if (cli_report(L, status) != LUA_OK) return EXIT_FAILURE;
  status = (int)lua_tointeger(L, -1);
  lua_pop(L, 1);
  return status;
}

/* The command's help (or the short usage if the Lua side is missing). */
static void usage(lua_State *L) {
  char *args[1] = {(char *)"help"};
  if (getcli(L, "main")) {
    lua_pop(L, 1);
    callcli(L, "main", 1, args);
    return;
  }
  printf("usage: " CLI_PROGNAME
         " [options] [script [args]] | run script [args] | COMMAND ...\n");
}

/* ---- a store truncated under us ------------------------------------------- */

/* A file store is mapped: if another program truncates the file, the next
 * touch of a page past its new end raises SIGBUS. Nothing can be resumed
 * from there, so say which store and why, and exit 1; a SIGBUS that is not
 * in a store keeps its default action. Only async-signal-safe calls. */
static void say(const char *s) {
  size_t n = strlen(s);
  while (n > 0) {
    ssize_t w = write(STDERR_FILENO, s, n);
    if (w <= 0) return;
    s += w;
    n -= (size_t)w;
  }
}

static void on_sigbus(int sig, siginfo_t *si, void *uc) {
  const char *path = tally_store_fault_path(si->si_addr);
  (void)uc;
  if (path == NULL) {
    signal(sig, SIG_DFL);
    raise(sig);
    return;
  }
  say(CLI_PROGNAME ": ");
  say(path);
  say(": tally store is truncated (the file shrank while it was open: another "
      "program truncated it; a bus error stopped this run)\n");
  _exit(EXIT_FAILURE);
}

static void catch_sigbus(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_sigbus;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGBUS, &sa, NULL);
}

/* ---- the interpreter ------------------------------------------------------ */

static int dochunk(lua_State *L, int status) {
  if (status == LUA_OK) status = cli_docall(L, 0, 0);
  return cli_report(L, status);
}

/* Open the store --store named as the global `db` (cli.open_store does the
 * checking and the messages); 0 on failure, reported. */
static int opendb(lua_State *L, const char *uri, int create) {
  if (!getcli(L, "open_store")) return 0;
  lua_pushstring(L, uri);
  lua_createtable(L, 0, 1);
  lua_pushboolean(L, create);
  lua_setfield(L, -2, "create");
  if (cli_report(L, cli_docall(L, 2, 2)) != LUA_OK) return 0;
  if (lua_isnil(L, -2)) {
    fprintf(stderr, "%s: %s\n", CLI_PROGNAME, lua_tostring(L, -1));
    lua_pop(L, 2);
    return 0;
  }
  lua_pop(L, 1);
  lua_setglobal(L, "db");
  return 1;
}

/* db = tally.open() unless the global is set already (--store, -e). */
static void defaultdb(lua_State *L) {
  lua_getglobal(L, "db");
  if (lua_isnil(L, -1)) {
    lua_getglobal(L, "tally");
    lua_getfield(L, -1, "open");
    if (cli_report(L, cli_docall(L, 0, 1)) == LUA_OK) lua_setglobal(L, "db");
    lua_pop(L, 1);
  }
  lua_pop(L, 1);
}

/* A first argument that names neither a subcommand nor a file, and looks
 * like a word rather than a path: most likely a mistyped subcommand. */
static int mistyped(const char *a) {
  return a[0] != '-' && strchr(a, '/') == NULL && strchr(a, '.') == NULL &&
         access(a, F_OK) != 0;
}

/* The whole run inside a protected call: argv in a light userdata. */
typedef struct run_args {
  int argc;
  char **argv;
  int status;
} run_args;

/* "tally: <message> (see 'tally --help')", exit status 2. */
static int fail_usage(run_args *ra, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static int fail_usage(run_args *ra, const char *fmt, ...) {
  va_list ap;
  fprintf(stderr, "%s: ", CLI_PROGNAME);
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fprintf(stderr, " (see '%s --help')\n", CLI_PROGNAME);
  ra->status = EXIT_USAGE;
  return 0;
}

static int pmain(lua_State *L) {
  run_args *ra = (run_args *)lua_touserdata(L, 1);
  int argc = ra->argc, i, first = 1, script = 0, interactive = 0, ran_e = 0;
  int create = 0;
  const char *store = NULL;
  char **argv = ra->argv;

  luaL_openlibs(L);
  setpaths(L);

  if (argc > 1) { /* a subcommand? */
    const char *a = argv[1];
    for (i = 0; subcommands[i] != NULL; i++) {
      if (strcmp(a, subcommands[i]) == 0) {
        ra->status = callcli(L, "main", argc - 1, argv + 1);
        return 0;
      }
    }
    if (strcmp(a, "run") == 0) first = 2;
  }

  for (i = first; i < argc; i++) { /* options up to the script */
    const char *a = argv[i];
    if (a[0] != '-' || strcmp(a, "-") == 0) {
      script = i;
      break;
    }
    if (strcmp(a, "--") == 0) {
      if (i + 1 < argc) script = i + 1;
      break;
    } else if (strcmp(a, "-e") == 0) {
      if (++i >= argc) return fail_usage(ra, "%s needs an argument", "-e");
    } else if (strcmp(a, "-i") == 0) {
      interactive = 1;
    } else if (strcmp(a, "--store") == 0) {
      if (++i >= argc) return fail_usage(ra, "%s needs a store (file:PATH or a path)", a);
      store = argv[i];
    } else if (strncmp(a, "--store=", 8) == 0) {
      if (a[8] == '\0')
        return fail_usage(ra, "%s needs a store (file:PATH or a path)", a);
      store = a + 8;
    } else if (strcmp(a, "--create") == 0) {
      create = 1;
    } else if (strcmp(a, "-v") == 0 || strcmp(a, "--version") == 0) {
      printf("tally %s (%s)\n", TALLY_VERSION, LUA_RELEASE);
      if (i + 1 == argc) return 0;
    } else if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
      if (first == 2) {
        char *args[2] = {(char *)"help", (char *)"run"};
        ra->status = callcli(L, "main", 2, args);
      } else {
        usage(L);
      }
      return 0;
    } else {
      return fail_usage(ra, "unrecognized option '%s'", a);
    }
  }
  if (first == 2 && !script) {
    fprintf(stderr,
            "%s run: a script is needed\nusage: %s run [options] script [args...]"
            "   ('%s help run' for more)\n",
            CLI_PROGNAME, CLI_PROGNAME, CLI_PROGNAME);
    ra->status = EXIT_USAGE;
    return 0;
  }
  if (first == 1 && script == 1 && mistyped(argv[1])) { /* tally lss */
    ra->status = callcli(L, "unknown", 1, argv + 1);
    return 0;
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

  if (store != NULL) {
    settally(L);
    if (!opendb(L, store, create)) {
      ra->status = EXIT_FAILURE;
      return 0;
    }
  }

  for (i = first; i < (script ? script : argc); i++) { /* -e chunks, in order */
    if (strcmp(argv[i], "-e") == 0) {
      const char *chunk = argv[++i];
      if (!ran_e) settally(L);
      ran_e = 1;
      if (dochunk(L, luaL_loadbuffer(L, chunk, strlen(chunk), "=(command line)")) !=
          LUA_OK) {
        ra->status = EXIT_FAILURE;
        return 0;
      }
    } else if (strcmp(argv[i], "--store") == 0) {
      i++;
    } else if (strcmp(argv[i], "--") == 0) {
      break;
    }
  }

  if (script) {
    const char *fname = strcmp(argv[script], "-") == 0 ? NULL : argv[script];
    int status = luaL_loadfile(L, fname), nargs = 0;
    if (status == LUA_OK) {
      for (i = script + 1; i < argc; i++, nargs++) lua_pushstring(L, argv[i]);
      status = cli_docall(L, nargs, 0);
    }
    if (cli_report(L, status) != LUA_OK) {
      ra->status = EXIT_FAILURE;
      return 0;
    }
  }

  if (interactive || (!script && !ran_e)) {
    settally(L);
    defaultdb(L);
    cli_repl(L);
  }
  return 0;
}

int main(int argc, char **argv) {
  run_args ra = {argc, argv, 0};
  lua_State *L = luaL_newstate();
  int status;
  if (L == NULL) {
    fprintf(stderr, "%s: cannot create state: not enough memory\n", CLI_PROGNAME);
    return EXIT_FAILURE;
  }
  catch_sigbus();
  lua_pushcfunction(L, pmain);
  lua_pushlightuserdata(L, &ra);
  status = lua_pcall(L, 1, 0, 0);
  cli_report(L, status);
  lua_close(L);
  /* output lost (a full disk, a closed descriptor) must not exit 0: an
   * export that did not reach its file would look done */
  errno = 0;
  if (fflush(stdout) != 0 || ferror(stdout)) {
    fprintf(stderr, "%s: cannot write to standard output%s%s\n", CLI_PROGNAME,
            errno ? ": " : "", errno ? strerror(errno) : "");
    return EXIT_FAILURE;
  }
  if (status != LUA_OK) return EXIT_FAILURE;
  return ra.status;
}
