/* cli_repl.c -- the tally prompt: lines in, values out.
 *
 * Lines are compiled much as lua.c does it. The first line of a statement
 * is tried as "return <line>" (so `1+1` and `db` print their values; a
 * leading `=` means `return`, as in Lua 5.1's prompt), then as a statement.
 * A chunk the parser finds cut short (its message ends in "<eof>", lua.c's
 * test) reads another line under the continuation prompt ">> "; so does an
 * unfinished expression (`{1,`). Results go through tally.cmd.repl's show()
 * (lua/tally/cmd/repl.lua), which pretty-prints tables, counters and stores;
 * errors print "tally: message" and a traceback, and the prompt goes on.
 *
 * On a terminal, lines come from GNU readline through its callback
 * ("alternate") interface, and the loop waits for keys itself in pselect().
 * Why: with blocking readline(), cancelling the line on Ctrl-C means either
 * longjmp'ing out of readline from a signal handler (readline, malloc or
 * stdio may be half-way through an update: undefined behaviour) or teaching
 * readline's own handler to abort the call. Here SIGINT, SIGWINCH, SIGTERM,
 * SIGHUP, SIGTSTP and SIGCONT are blocked except inside pselect(), so their
 * handler runs only while the loop sleeps and just sets a flag; the loop
 * then cancels the line (and any pending multi-line input), resizes, leaves,
 * or suspends, calling readline only from ordinary code. readline's own
 * handlers are off (rl_catch_signals = rl_catch_sigwinch = 0), so job
 * control is the loop's too: on Ctrl-Z it puts the terminal back, stops
 * the process with SIGTSTP's default action, and once continued (the
 * shell's fg, which leaves the terminal in the shell's mode) sets the
 * terminal up again and redraws the prompt and the line; a SIGCONT after a
 * SIGSTOP does the same. While a chunk runs, the terminal is back in its
 * normal mode and SIGINT is cli_docall's: the first Ctrl-C stops the chunk
 * with "interrupted!" (a Lua hook, as lua.c), a second one kills the
 * process.
 *
 * History: one entry per statement (a multi-line statement is one entry),
 * kept in $TALLY_HISTORY, else ~/.tally_history (none if HOME is unset, or
 * TALLY_HISTORY is empty, or the file cannot be written: silently). Each
 * entry is appended as it is entered, with its newlines stored as \001 (as
 * psql does) so it stays one line of the file; the file is cut to the last
 * 1000 entries on exit.
 *
 * Tab completion asks tally.cmd.repl's complete(): Lua keywords and globals,
 * fields and methods after `x.` and `x:` (through __index tables), counter
 * names inside the string argument of a store method (`db:counter("po<TAB>`).
 *
 * Off a terminal there are no prompts and no readline: lines are read with
 * getline() and handled the same way, so `echo 'print(1)' | tally` works.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/select.h>
#include <unistd.h>

#include <readline/history.h>
#include <readline/readline.h>

#include "lua.h"
#include "lauxlib.h"
#include "tally.h"
#include "cli.h"

#define PROMPT        "> "
#define PROMPT2       ">> "
#define HISTORY_MAX   1000
#define NL_IN_HISTORY '\001'

typedef struct repl {
  lua_State *L;
  int show, complete; /* registry refs to tally.cmd.repl's functions, or LUA_NOREF */
  char *buf;          /* the pending chunk: lines so far, '\n'-separated */
  size_t len, cap;
  char *hist; /* history file, or NULL */
  int tty;    /* lines come from readline */
  int quit;   /* the signal that ends the prompt, or 0 */
} repl;

/* ---- compiling and running a chunk ----------------------------------------- */

enum { CHUNK_READY, CHUNK_MORE, CHUNK_ERROR };

/* Is the error message on top of the stack one of a chunk cut short? */
static int cut_short(lua_State *L) {
  size_t n;
  const char *msg = lua_tolstring(L, -1, &n);
  return msg != NULL && n >= 5 && strcmp(msg + n - 5, "<eof>") == 0;
}

/* Compile the pending chunk: CHUNK_READY with the function pushed,
 * CHUNK_MORE (nothing pushed) or CHUNK_ERROR with the message pushed.
 * At the end of the input (eof) there is no more: a chunk cut short is an
 * error, with the message of the form that got furthest (the statement's,
 * unless only the expression was cut short: `x = { 1,` is one). */
static int compile(repl *r, int eof) {
  lua_State *L = r->L;
  const char *code = r->buf;
  int more, status;
  if (code[0] == '=') { /* =expr: Lua 5.1's prompt */
    lua_pushfstring(L, "return %s", code + 1);
    status = luaL_loadbuffer(L, lua_tostring(L, -1), lua_rawlen(L, -1), "=stdin");
    lua_remove(L, -2);
    if (status == LUA_OK) return CHUNK_READY;
    if (!eof && cut_short(L)) {
      lua_pop(L, 1);
      return CHUNK_MORE;
    }
    return CHUNK_ERROR;
  }
  lua_pushfstring(L, "return %s", code); /* an expression? */
  status = luaL_loadbuffer(L, lua_tostring(L, -1), lua_rawlen(L, -1), "=stdin");
  lua_remove(L, -2);
  if (status == LUA_OK) return CHUNK_READY;
  more = cut_short(L); /* its message stays, under the statement's */
  status = luaL_loadbuffer(L, code, r->len, "=stdin"); /* a statement? */
  if (status == LUA_OK) {
    lua_remove(L, -2);
    return CHUNK_READY;
  }
  if (!eof && (more || cut_short(L))) {
    lua_pop(L, 2);
    return CHUNK_MORE;
  }
  if (more && !cut_short(L))
    lua_pop(L, 1); /* the expression's message */
  else
    lua_remove(L, -2); /* the statement's */
  return CHUNK_ERROR;
}

/* Print the n values on top of the stack (popped) with show(). */
static void show(repl *r, int n) {
  lua_State *L = r->L;
  int base = lua_gettop(L) - n, i;
  if (r->show != LUA_NOREF) {
    lua_rawgeti(L, LUA_REGISTRYINDEX, r->show);
    lua_insert(L, base + 1);
    if (cli_docall(L, n, 1) == LUA_OK && lua_type(L, -1) == LUA_TSTRING) {
      size_t len;
      const char *s = lua_tolstring(L, -1, &len);
      fwrite(s, 1, len, stdout);
      if (len > 0 && s[len - 1] != '\n') fputc('\n', stdout);
      fflush(stdout);
      lua_settop(L, base);
      return;
    }
    cli_report(L, LUA_ERRRUN); /* show() failed: say so, and print plainly */
    lua_settop(L, base);
    return;
  }
  for (i = base + 1; i <= base + n; i++) {
    fputs(luaL_tolstring(L, i, NULL), stdout);
    fputs(i < base + n ? "\t" : "\n", stdout);
    lua_pop(L, 1);
  }
  fflush(stdout);
  lua_settop(L, base);
}

static int append(repl *r, const char *line, size_t n) {
  size_t need = r->len + n + 2;
  if (need > r->cap) {
    size_t cap = need * 2;
    char *b = (char *)realloc(r->buf, cap);
    if (b == NULL) return 0;
    r->buf = b;
    r->cap = cap;
  }
  if (r->len > 0) r->buf[r->len++] = '\n';
  memcpy(r->buf + r->len, line, n);
  r->len += n;
  r->buf[r->len] = '\0';
  return 1;
}

static void remember(repl *r);

/* Run the pending chunk if it is complete, and print its values or its
 * error; returns 1 if it needs more lines (never at eof, the end of the
 * input: then a chunk cut short is reported as the error it is). */
static int run_pending(repl *r, int eof) {
  lua_State *L = r->L;
  int top = lua_gettop(L), status;
  switch (compile(r, eof)) {
  case CHUNK_MORE: return 1;
  case CHUNK_ERROR:
    remember(r);
    r->len = 0;
    cli_report(L, LUA_ERRSYNTAX);
    return 0;
  default: break;
  }
  remember(r);
  r->len = 0;
  status = cli_docall(L, 0, LUA_MULTRET);
  if (status == LUA_OK) {
    if (lua_gettop(L) > top) show(r, lua_gettop(L) - top);
  } else {
    cli_report(L, status);
  }
  lua_settop(L, top);
  return 0;
}

/* Take one line; returns 1 if the chunk needs more lines. Runs the chunk
 * once it is complete, and prints its values or its error. */
static int feed(repl *r, const char *line) {
  size_t n = strlen(line);
  if (n > 0 && line[n - 1] == '\n') n--;
  if (!append(r, line, n)) {
    fprintf(stderr, "%s: out of memory\n", CLI_PROGNAME);
    r->len = 0;
    return 0;
  }
  return run_pending(r, 0);
}

/* ---- history ------------------------------------------------------------------ */

static char *history_path(void) {
  const char *p = getenv("TALLY_HISTORY"), *home;
  char *path;
  int fd;
  if (p != NULL) {
    if (*p == '\0') return NULL;
    path = strdup(p);
  } else {
    home = getenv("HOME");
    if (home == NULL || *home == '\0') return NULL;
    path = (char *)malloc(strlen(home) + 32);
    if (path != NULL) sprintf(path, "%s/.tally_history", home);
  }
  if (path == NULL) return NULL;
  fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) { /* unwritable: no history file, and no complaint */
    free(path);
    return NULL;
  }
  close(fd);
  return path;
}

static void history_load(repl *r) {
  int i;
  using_history();
  stifle_history(HISTORY_MAX);
  if (r->hist == NULL || read_history(r->hist) != 0) return;
  for (i = 0; i < history_length; i++) { /* \001 back to newlines, in place */
    HIST_ENTRY *e = history_get(history_base + i);
    char *c;
    if (e == NULL) continue;
    for (c = e->line; *c; c++)
      if (*c == NL_IN_HISTORY) *c = '\n';
  }
}

/* Add the pending chunk to the history (unless blank or a repeat), and
 * append it to the file. */
static void remember(repl *r) {
  HIST_ENTRY *last;
  const char *c;
  int fd;
  if (!r->tty || r->buf == NULL) return;
  for (c = r->buf; *c == ' ' || *c == '\t' || *c == '\n'; c++) {}
  if (*c == '\0') return;
  last = history_length > 0 ? history_get(history_base + history_length - 1) : NULL;
  if (last != NULL && strcmp(last->line, r->buf) == 0) return;
  add_history(r->buf);
  if (r->hist == NULL) return;
  fd = open(r->hist, O_WRONLY | O_APPEND | O_CLOEXEC);
  if (fd >= 0) {
    char *line = (char *)malloc(r->len + 1);
    size_t i;
    if (line != NULL) {
      for (i = 0; i < r->len; i++)
        line[i] = r->buf[i] == '\n' ? NL_IN_HISTORY : r->buf[i];
      line[r->len] = '\n';
      if (write(fd, line, r->len + 1) < 0) {} /* a full disk loses history only */
      free(line);
    }
    close(fd);
  }
}

/* ---- completion ------------------------------------------------------------- */

/* readline's completion callbacks take no user data: the prompt running now. */
static repl *current;
static char **cands;
static size_t ncands, nextcand;

static char *next_candidate(const char *text, int state) {
  (void)text;
  if (state == 0) nextcand = 0;
  return nextcand < ncands ? strdup(cands[nextcand++]) : NULL;
}

/* complete(line, start, text, quote) from tally.cmd.repl: a list of words to
 * put in place of text, and "files" to let readline complete file names. */
static char **complete(const char *text, int start, int end) {
  lua_State *L;
  char **m = NULL;
  size_t i, n;
  int top;
  rl_attempted_completion_over = 1; /* no file names unless asked */
  rl_completion_append_character = '\0';
  if (current == NULL || current->complete == LUA_NOREF) return NULL;
  L = current->L;
  top = lua_gettop(L);
  lua_rawgeti(L, LUA_REGISTRYINDEX, current->complete);
  lua_pushlstring(L, rl_line_buffer, (size_t)end);
  lua_pushinteger(L, start);
  lua_pushstring(L, text);
  if (rl_completion_quote_character) {
    char q = (char)rl_completion_quote_character;
    lua_pushlstring(L, &q, 1);
  } else {
    lua_pushnil(L);
  }
  if (lua_pcall(L, 4, 2, 0) != LUA_OK || !lua_istable(L, -2)) {
    lua_settop(L, top);
    return NULL;
  }
  if (lua_type(L, -1) == LUA_TSTRING && strcmp(lua_tostring(L, -1), "files") == 0)
    rl_attempted_completion_over = 0;
  n = (size_t)lua_rawlen(L, -2);
  cands = n ? (char **)calloc(n, sizeof *cands) : NULL;
  for (i = 0, ncands = 0; cands != NULL && i < n; i++) {
    lua_rawgeti(L, -2, (lua_Integer)i + 1);
    if (lua_type(L, -1) == LUA_TSTRING) cands[ncands++] = strdup(lua_tostring(L, -1));
    lua_pop(L, 1);
  }
  lua_settop(L, top);
  if (ncands > 0) m = rl_completion_matches(text, next_candidate);
  for (i = 0; i < ncands; i++) free(cands[i]);
  free(cands);
  cands = NULL;
  ncands = 0;
  return m;
}

/* ---- the terminal loop ------------------------------------------------------ */

static volatile sig_atomic_t got_int, got_winch, got_quit, got_tstp, got_cont;

static void on_signal(int sig) {
  if (sig == SIGINT)
    got_int = 1;
  else if (sig == SIGWINCH)
    got_winch = 1;
  else if (sig == SIGTSTP)
    got_tstp = 1;
  else if (sig == SIGCONT)
    got_cont = 1;
  else
    got_quit = sig;
}

static char *line_in;
static int line_done, line_eof;

static void on_line(char *line) {
  line_in = line;
  line_eof = line == NULL;
  line_done = 1;
  rl_callback_handler_remove(); /* no prompt until the chunk has run */
}

static const int caught[] = {SIGINT, SIGWINCH, SIGTERM, SIGHUP, SIGTSTP, SIGCONT};
#define NCAUGHT ((int)(sizeof caught / sizeof caught[0]))

/* Ctrl-Z: put the terminal back as it was, stop (SIGTSTP's default action,
 * as if it had not been caught), and once continued (fg, bg) set it up
 * again and draw the prompt and the line anew: the shell has changed the
 * terminal's mode meanwhile. blocked is the mask of the loop (the caught
 * signals blocked). */
static void suspend(const sigset_t *blocked) {
  struct sigaction dfl, ours;
  sigset_t open = *blocked;
  rl_echo_signal_char(SIGTSTP); /* "^Z", as readline's own handler shows it */
  rl_callback_sigcleanup();     /* a half-typed key sequence, a search: dropped */
  rl_cleanup_after_signal();    /* rl_deprep_terminal(), among others */
  memset(&dfl, 0, sizeof dfl);
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(SIGTSTP, &dfl, &ours);
  raise(SIGTSTP); /* pending: SIGTSTP is blocked */
  sigdelset(&open, SIGTSTP);
  sigdelset(&open, SIGCONT);             /* its handler runs as we go on: got_cont */
  sigprocmask(SIG_SETMASK, &open, NULL); /* stops here, until SIGCONT */
  sigprocmask(SIG_SETMASK, blocked, NULL);
  sigaction(SIGTSTP, &ours, NULL);
  got_cont = 0;
  rl_reset_after_signal(); /* rl_prep_terminal() with readline's meta flag */
  rl_forced_update_display();
}

/* Read one line with readline; NULL at the end (Ctrl-D, SIGTERM, SIGHUP). */
static char *tty_line(repl *r) {
  struct sigaction sa, old[NCAUGHT];
  sigset_t block, orig, blocked;
  int i;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigemptyset(&block);
  for (i = 0; i < NCAUGHT; i++) {
    sigaddset(&block, caught[i]);
    sigaction(caught[i], &sa, &old[i]);
    if (caught[i] == SIGTSTP && old[i].sa_handler == SIG_IGN)
      sigaction(SIGTSTP, &old[i], NULL); /* no job control here: Ctrl-Z stays ignored */
  }
  sigprocmask(SIG_BLOCK, &block, &orig);
  sigprocmask(SIG_BLOCK, NULL, &blocked);
  got_int = got_tstp = got_cont = 0;
  line_done = line_eof = 0;
  line_in = NULL;
  if (rl_instream != NULL) rl_reset_screen_size(); /* resized while a chunk ran? */
  rl_callback_handler_install(r->len ? PROMPT2 : PROMPT, on_line);
  while (!line_done && !got_quit) {
    fd_set in;
    int n;
    if (got_int) { /* Ctrl-C: drop the line and the pending chunk */
      got_int = 0;
      rl_point = rl_end;
      rl_redisplay();
      fputs("^C", rl_outstream);
      fflush(rl_outstream);
      rl_free_line_state();
      rl_callback_sigcleanup();
      rl_callback_handler_remove(); /* may write "\r" (bracketed paste off) */
      fputc('\n', rl_outstream);
      fflush(rl_outstream);
      r->len = 0;
      rl_callback_handler_install(PROMPT, on_line);
      continue;
    }
    if (got_tstp) { /* Ctrl-Z */
      got_tstp = 0;
      suspend(&blocked);
      continue;
    }
    if (got_cont) { /* continued after a SIGSTOP: the shell has reset the terminal */
      got_cont = 0;
      rl_cleanup_after_signal();
      rl_reset_after_signal();
      rl_forced_update_display();
    }
    if (got_winch) {
      got_winch = 0;
      rl_resize_terminal();
    }
    FD_ZERO(&in);
    FD_SET(STDIN_FILENO, &in);
    n = pselect(STDIN_FILENO + 1, &in, NULL, NULL, NULL, &orig);
    if (n < 0 && errno != EINTR) break;
    if (n > 0) rl_callback_read_char();
  }
  if (!line_done) {
    rl_callback_handler_remove();
    fputc('\n', stdout);
  }
  sigprocmask(SIG_SETMASK, &orig, NULL);
  for (i = 0; i < NCAUGHT; i++) sigaction(caught[i], &old[i], NULL);
  if (got_quit) r->quit = got_quit;
  if (!line_done || line_eof) return NULL;
  return line_in;
}

static void tty_loop(repl *r) {
  char *line;
  rl_readline_name = "tally"; /* for $if tally in ~/.inputrc */
  rl_catch_signals = 0;
  rl_catch_sigwinch = 0;
  rl_change_environment = 0; /* leave LINES and COLUMNS alone */
  rl_attempted_completion_function = complete;
  rl_basic_word_break_characters = " \t\n\"'`><=;|&{(,)}[]+-*/%^#~.:";
  rl_completer_word_break_characters = rl_basic_word_break_characters;
  rl_completer_quote_characters = "\"'";
  history_load(r);
  current = r;
  while ((line = tty_line(r)) != NULL) {
    feed(r, line);
    free(line);
  }
  if (r->quit == 0) fputc('\n', stdout); /* after the Ctrl-D */
  fflush(stdout);
  current = NULL;
  if (r->hist != NULL) history_truncate_file(r->hist, HISTORY_MAX);
}

/* Errors in piped input are reported and the lines after them still run,
 * as at the prompt; the exit status stays 0 (a script, `tally -`, is the
 * way to stop at the first error with status 1). A statement the input
 * leaves unfinished is reported the same way at the end: its syntax error
 * ("'end' expected ... near <eof>"), as lua5.4 gives it. */
static void plain_loop(repl *r) {
  char *line = NULL;
  size_t cap = 0;
  while (getline(&line, &cap, stdin) >= 0) feed(r, line);
  free(line);
  if (r->len > 0) run_pending(r, 1);
}

/* ---- the prompt ------------------------------------------------------------- */

/* Ref to require("tally.cmd.repl")[name], or LUA_NOREF. */
static int replfn(lua_State *L, const char *name) {
  int ref = LUA_NOREF;
  lua_getglobal(L, "require");
  lua_pushliteral(L, "tally.cmd.repl");
  if (lua_pcall(L, 1, 1, 0) == LUA_OK) {
    lua_getfield(L, -1, name);
    if (lua_isfunction(L, -1))
      ref = luaL_ref(L, LUA_REGISTRYINDEX);
    else
      lua_pop(L, 1);
  } else if (strcmp(name, "show") == 0) {
    cli_report(L, LUA_ERRRUN);
    return LUA_NOREF;
  }
  lua_pop(L, 1);
  return ref;
}

void cli_repl(lua_State *L) {
  repl r;
  int tty = isatty(STDIN_FILENO);
  memset(&r, 0, sizeof r);
  r.L = L;
  r.tty = tty;
  r.show = replfn(L, "show");
  r.complete = replfn(L, "complete");
  if (tty) {
    int banner = replfn(L, "banner");
    if (banner != LUA_NOREF) {
      lua_rawgeti(L, LUA_REGISTRYINDEX, banner);
      if (cli_docall(L, 0, 1) == LUA_OK) fputs(luaL_optstring(L, -1, ""), stdout);
      lua_pop(L, 1);
      luaL_unref(L, LUA_REGISTRYINDEX, banner);
    } else {
      printf("tally %s (%s)\n", TALLY_VERSION, LUA_RELEASE);
    }
    fflush(stdout);
    r.hist = history_path();
    tty_loop(&r);
  } else {
    plain_loop(&r);
  }
  free(r.buf);
  free(r.hist);
  luaL_unref(L, LUA_REGISTRYINDEX, r.show);
  luaL_unref(L, LUA_REGISTRYINDEX, r.complete);
  if (r.quit) { /* SIGTERM or SIGHUP: the terminal is restored; die of it */
    fflush(NULL);
    signal(r.quit, SIG_DFL);
    raise(r.quit);
  }
}
