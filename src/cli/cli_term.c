/* cli_term.c -- tally.term: the terminal, for `tally watch` and progress bars.
 *
 *   term.isatty(fd)          -> boolean (0 stdin, 1 stdout, 2 stderr)
 *   term.size()              -> columns, rows (of stdout, else stderr, else
 *                               stdin; $COLUMNS/$LINES or 80x24 off a terminal)
 *   term.raw()               -> true, or nil, message: stdin in raw mode (no
 *                               echo, no line editing, Ctrl-C arrives as the
 *                               key "\3"), and SIGINT, SIGTERM, SIGHUP and
 *                               SIGWINCH caught as events for readkey
 *   term.restore()           the terminal and signals as they were before
 *                               raw(); safe to call twice; also run at exit
 *   term.readkey(timeout)    -> "key", bytes | "resize" | "signal", name |
 *                               "eof" | nil (timeout, seconds)
 *   term.catch_interrupt(on) SIGINT only sets a flag (on = true) or is as it
 *                               was (false); for work that must not stop half-done
 *   term.interrupted()       -> whether SIGINT came since the last call
 *
 * One terminal per process, so its saved state and the signal flags are
 * statics (a signal handler has nothing else to write to). While raw, the
 * caught signals are blocked except inside readkey's pselect(), so a signal
 * is never lost between looking at the flags and going to sleep.
 */
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/select.h>
#include <termios.h>
#include <unistd.h>

#include "lua.h"
#include "lauxlib.h"
#include "cli.h"

static const int caught[] = {SIGINT, SIGTERM, SIGHUP, SIGWINCH};
#define NCAUGHT ((int)(sizeof caught / sizeof caught[0]))

static struct termios saved;
static struct sigaction saved_sa[NCAUGHT], saved_int;
static sigset_t saved_mask;
static int is_raw, raw_tty, at_exit, catching;
static volatile sig_atomic_t got_sig, got_winch, got_int;

static void on_signal(int sig) {
  if (sig == SIGWINCH)
    got_winch = 1;
  else if (sig == SIGINT)
    got_int = 1;
  if (sig != SIGWINCH && got_sig == 0) got_sig = sig;
}

static void restore(void) {
  int i;
  if (!is_raw) return;
  if (raw_tty) tcsetattr(STDIN_FILENO, TCSAFLUSH, &saved);
  /* the old actions first: a signal that comes (or came) while they are
   * blocked goes to them once unblocked, not to on_signal's flags, which
   * nobody reads any more */
  for (i = 0; i < NCAUGHT; i++) sigaction(caught[i], &saved_sa[i], NULL);
  sigprocmask(SIG_SETMASK, &saved_mask, NULL);
  is_raw = 0;
}

static int t_isatty(lua_State *L) {
  lua_pushboolean(L, isatty((int)luaL_checkinteger(L, 1)));
  return 1;
}

static int t_size(lua_State *L) {
  static const int fds[] = {STDOUT_FILENO, STDERR_FILENO, STDIN_FILENO};
  struct winsize ws;
  int i, cols = 0, rows = 0;
  for (i = 0; i < 3; i++) {
    if (ioctl(fds[i], TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0 && ws.ws_row > 0) {
      cols = ws.ws_col;
      rows = ws.ws_row;
      break;
    }
  }
  if (cols == 0) {
    const char *c = getenv("COLUMNS"), *r = getenv("LINES");
    cols = c ? atoi(c) : 0;
    rows = r ? atoi(r) : 0;
    if (cols <= 0) cols = 80;
    if (rows <= 0) rows = 24;
  }
  lua_pushinteger(L, cols);
  lua_pushinteger(L, rows);
  return 2;
}

static int t_raw(lua_State *L) {
  struct sigaction sa;
  sigset_t block;
  int i;
  if (is_raw) {
    lua_pushboolean(L, 1);
    return 1;
  }
  raw_tty = isatty(STDIN_FILENO);
  if (raw_tty) {
    struct termios t;
    if (tcgetattr(STDIN_FILENO, &saved) != 0) {
      lua_pushnil(L);
      lua_pushfstring(L, "cannot read the terminal's mode: %s", strerror(errno));
      return 2;
    }
    t = saved;
    t.c_lflag &= ~(tcflag_t)(ICANON | ECHO | ISIG | IEXTEN);
    t.c_iflag &= ~(tcflag_t)(IXON | ICRNL);
    t.c_cc[VMIN] = 0;
    t.c_cc[VTIME] = 0;
    if (tcsetattr(STDIN_FILENO, TCSAFLUSH, &t) != 0) {
      lua_pushnil(L);
      lua_pushfstring(L, "cannot set the terminal's mode: %s", strerror(errno));
      return 2;
    }
  }
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigemptyset(&block);
  for (i = 0; i < NCAUGHT; i++) {
    sigaddset(&block, caught[i]);
    sigaction(caught[i], &sa, &saved_sa[i]);
  }
  sigprocmask(SIG_BLOCK, &block, &saved_mask);
  got_sig = got_winch = 0;
  is_raw = 1;
  if (!at_exit) at_exit = atexit(restore) == 0;
  lua_pushboolean(L, 1);
  return 1;
}

static int t_restore(lua_State *L) {
  (void)L;
  restore();
  return 0;
}

static const char *signame(int sig) {
  switch (sig) {
  case SIGINT: return "INT";
  case SIGTERM: return "TERM";
  case SIGHUP: return "HUP";
  default: return "?";
  }
}

static int t_readkey(lua_State *L) {
  double timeout = luaL_optnumber(L, 1, -1);
  struct timespec ts, *tsp = NULL;
  sigset_t *mask = is_raw ? &saved_mask : NULL; /* caught signals come in only here */
  fd_set in;
  int n, nfds = 0;
  if (timeout >= 0) {
    ts.tv_sec = (time_t)timeout;
    ts.tv_nsec = (long)((timeout - (double)ts.tv_sec) * 1e9);
    tsp = &ts;
  }
  for (;;) {
    if (got_sig) {
      int sig = got_sig;
      got_sig = 0;
      got_int = 0;
      lua_pushliteral(L, "signal");
      lua_pushstring(L, signame(sig));
      return 2;
    }
    if (got_winch) {
      got_winch = 0;
      lua_pushliteral(L, "resize");
      return 1;
    }
    FD_ZERO(&in);
    if (raw_tty || !is_raw) {
      FD_SET(STDIN_FILENO, &in);
      nfds = STDIN_FILENO + 1;
    }
    n = pselect(nfds, &in, NULL, NULL, tsp, mask);
    if (n < 0) {
      if (errno == EINTR) continue; /* the flags say why */
      return luaL_error(L, "readkey: %s", strerror(errno));
    }
    if (n == 0) return 0; /* timeout */
    {
      char buf[64];
      ssize_t got = read(STDIN_FILENO, buf, sizeof buf);
      if (got < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (got <= 0) {
        lua_pushliteral(L, "eof");
        return 1;
      }
      lua_pushliteral(L, "key");
      lua_pushlstring(L, buf, (size_t)got);
      return 2;
    }
  }
}

static int t_catch_interrupt(lua_State *L) {
  int on = lua_toboolean(L, 1);
  if (on && !catching) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    got_int = 0;
    sigaction(SIGINT, &sa, &saved_int);
    catching = 1;
  } else if (!on && catching) {
    sigaction(SIGINT, &saved_int, NULL);
    catching = 0;
  }
  return 0;
}

static int t_interrupted(lua_State *L) {
  lua_pushboolean(L, got_int);
  got_int = 0;
  if (!is_raw) got_sig = 0;
  return 1;
}

int cli_open_term(lua_State *L) {
  static const luaL_Reg fns[] = {{"isatty", t_isatty},
                                 {"size", t_size},
                                 {"raw", t_raw},
                                 {"restore", t_restore},
                                 {"readkey", t_readkey},
                                 {"catch_interrupt", t_catch_interrupt},
                                 {"interrupted", t_interrupted},
                                 {NULL, NULL}};
  luaL_newlib(L, fns);
  return 1;
}
