/* lua_sender.c -- the sender handle ("tally.sender"): core.sender{...}.
 *
 *   core.sender{ url = "http://...", method = "POST" | "PUT",
 *                headers = { ["Name"] = "value", ... } or { "Name: value", ... },
 *                timeout = 5, max_queue = 100000, backoff = 0.1,
 *                max_backoff = 5 } -> sender       (times in seconds)
 *   sender:post(body [, records]) -> true          (records defaults to 1)
 *   sender:flush([timeout_s]) -> true, or nil, "timed out", "ETIMEDOUT"
 *                                  (timeout_s defaults to the sender's timeout)
 *   sender:stats() -> { sent, requests, failures, dropped, rejected, queued,
 *                       last_status, last_error }   (last_error "" if none)
 *   sender:close([drain_s])                         (drain_s defaults to 0)
 *
 * And what an HTTP sink's spool needs that Lua lacks (tally/sink.lua):
 *   core.spool_append(path, data) -> true     appends data to path (made
 *                                  0600 if absent) and fdatasyncs it; a
 *                                  new file's directory is fsynced too
 *   core.spool_list(dir) -> { name, ... }     the names in dir, unsorted
 *   core.spool_mkdir(dir) -> true             mkdir 0700; true if it exists
 *   core.getpid() -> pid
 * Each returns nil, message, code name (errno's: "ENOENT") on failure.
 *
 * A sender handle (metatable "tally.sender") is a full userdata holding the
 * tally_sender pointer, NULL once closed; __gc and __close close it without
 * draining. Misuse (bad options, a closed sender) raises; failures of the
 * environment return nil, message, code name.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "lua_aux.h"
#include "tally_net.h"

#define TL_SENDER_MT   "tally.sender"
#define TL_SECONDS_MAX 4294967.0 /* UINT32_MAX milliseconds */

typedef struct tl_sender {
  tally_sender *s;     /* NULL once closed */
  uint32_t timeout_ms; /* the request timeout: flush()'s default wait */
} tl_sender;

/* ---- option parsing --------------------------------------------------------- */

/* Seconds at idx as milliseconds, rounded up so a tiny time is not 0.
 * Zero is allowed only if zero_ok. */
static uint32_t tl_checkms(lua_State *L, int arg, int idx, const char *name,
                           int zero_ok) {
  lua_Number sec = lua_tonumber(L, idx);
  double ms;
  uint32_t whole;
  if (lua_type(L, idx) != LUA_TNUMBER || !(zero_ok ? sec >= 0 : sec > 0))
    tl_argerror_got(L, arg,
                    lua_pushfstring(L,
                                    zero_ok ? "%s must be a non-negative number"
                                            : "%s must be a positive number",
                                    name),
                    idx, TL_BOOL_TYPE);
  if (sec > TL_SECONDS_MAX) /* NaN failed above */
    tl_argerror_got(L, arg,
                    lua_pushfstring(L, "%s must be at most 4294967 seconds", name), idx,
                    TL_BOOL_TYPE);
  ms = (double)sec * 1000.0;
  whole = (uint32_t)ms;
  return whole < ms ? whole + 1 : whole;
}

/* A whole number from 1 to 2^32 - 1 at idx. */
static uint32_t tl_checkcount(lua_State *L, int arg, int idx, const char *name) {
  lua_Number n = lua_tonumber(L, idx);
  if (lua_type(L, idx) != LUA_TNUMBER || !(n >= 1 && n <= 4294967295.0) ||
      (lua_Number)(uint32_t)n != n)
    tl_argerror_got(L, arg, lua_pushfstring(L, "%s must be a positive integer", name),
                    idx, TL_BOOL_TYPE);
  return (uint32_t)n;
}

/* The header value on top: a string without NULs. */
static void tl_checkheader(lua_State *L) {
  size_t len;
  const char *h;
  if (lua_type(L, -1) != LUA_TSTRING)
    tl_argerror_got(L, 1,
                    "headers must map names to strings or list \"Name: value\" strings",
                    lua_gettop(L), TL_BOOL_TYPE);
  h = lua_tolstring(L, -1, &len);
  if (strlen(h) != len) luaL_argerror(L, 1, "headers must not contain NUL bytes");
}

/* Copy the headers table at idx into anchor as a list of "Name: value"
 * strings: the list part in order, then the named ones. Returns the count. */
static int tl_collect_headers(lua_State *L, int idx, int anchor) {
  int n = 0;
  size_t listed;
  if (lua_type(L, idx) != LUA_TTABLE)
    tl_argerror_got(L, 1, "headers must be a table", idx, TL_BOOL_TYPE);
  listed = lua_rawlen(L, idx);
  for (size_t i = 1; i <= listed; i++) {
    lua_rawgeti(L, idx, (int)i);
    tl_checkheader(L);
    lua_rawseti(L, anchor, ++n);
  }
  lua_pushnil(L);
  while (lua_next(L, idx)) {
    if (lua_type(L, -2) == LUA_TNUMBER) {
      lua_Number k = lua_tonumber(L, -2);
      if (k >= 1 && k <= (lua_Number)listed && (lua_Number)(size_t)k == k) {
        lua_pop(L, 1); /* copied above */
        continue;
      }
    }
    if (lua_type(L, -2) != LUA_TSTRING)
      tl_argerror_got(L, 1,
                      "headers must map names to strings or list \"Name: value\" strings",
                      lua_gettop(L) - 1, TL_BOOL_TYPE);
    tl_checkheader(L);
    lua_pushfstring(L, "%s: %s", lua_tostring(L, -2), lua_tostring(L, -1));
    lua_rawseti(L, anchor, ++n);
    lua_pop(L, 1);
  }
  return n;
}

/* ---- the handle --------------------------------------------------------------- */

static tl_sender *tl_checksender(lua_State *L) {
  tl_sender *h = (tl_sender *)tl_checkudata(L, 1, TL_SENDER_MT);
  if (h->s == NULL) luaL_error(L, "attempt to use a closed sender");
  return h;
}

static int tl_sender_new(lua_State *L) {
  tally_sender_options o;
  const char **headers = NULL;
  tl_sender *h;
  int nheaders = 0, rc;

  memset(&o, 0, sizeof o);
  luaL_checktype(L, 1, LUA_TTABLE);
  lua_settop(L, 1);
  lua_newtable(L); /* 2: keeps the header strings alive */
  lua_pushnil(L);
  while (lua_next(L, 1)) { /* key at 3, value at 4 */
    const char *k = lua_type(L, 3) == LUA_TSTRING ? lua_tostring(L, 3) : "";
    if (strcmp(k, "url") == 0) {
      if (lua_type(L, 4) != LUA_TSTRING)
        tl_argerror_got(L, 1, "url must be a string", 4, TL_BOOL_TYPE);
      o.url = lua_tostring(L, 4); /* the options table keeps it */
    } else if (strcmp(k, "method") == 0) {
      const char *m = lua_type(L, 4) == LUA_TSTRING ? lua_tostring(L, 4) : "";
      if (strcmp(m, "POST") != 0 && strcmp(m, "PUT") != 0)
        tl_argerror_got(L, 1, "method must be 'POST' or 'PUT'", 4, TL_BOOL_TYPE);
      o.method = m;
    } else if (strcmp(k, "headers") == 0) {
      nheaders = tl_collect_headers(L, 4, 2);
    } else if (strcmp(k, "timeout") == 0) {
      o.timeout_ms = tl_checkms(L, 1, 4, "timeout", 0);
    } else if (strcmp(k, "max_queue") == 0) {
      o.max_queue = tl_checkcount(L, 1, 4, "max_queue");
    } else if (strcmp(k, "backoff") == 0) {
      o.backoff_ms = tl_checkms(L, 1, 4, "backoff", 0);
    } else if (strcmp(k, "max_backoff") == 0) {
      o.max_backoff_ms = tl_checkms(L, 1, 4, "max_backoff", 0);
    } else {
      tl_argerror(L, 1, "unknown option %s", tl_describe(L, 3, TL_BOOL_TYPE));
    }
    lua_settop(L, 3);
  }
  if (o.url == NULL) luaL_argerror(L, 1, "url is required");
  if (nheaders > 0) {
    headers =
        (const char **)lua_newuserdata(L, sizeof(*headers) * (size_t)(nheaders + 1));
    for (int i = 0; i < nheaders; i++) {
      lua_rawgeti(L, 2, i + 1);
      headers[i] = lua_tostring(L, -1); /* table 2 keeps it */
      lua_pop(L, 1);
    }
    headers[nheaders] = NULL;
    o.headers = headers;
  }

  h = (tl_sender *)lua_newuserdata(L, sizeof *h);
  h->s = NULL;
  h->timeout_ms = o.timeout_ms ? o.timeout_ms : 5000;
  luaL_getmetatable(L, TL_SENDER_MT);
  lua_setmetatable(L, -2);
  rc = tally_sender_open(&o, &h->s);
  if (rc == TALLY_EINVAL) return luaL_argerror(L, 1, tally_errmsg());
  if (rc < 0) return tl_fail(L, rc);
  return 1;
}

static int tl_sender_post(lua_State *L) {
  tl_sender *h = tl_checksender(L);
  size_t len;
  const char *body = luaL_checklstring(L, 2, &len);
  uint32_t records = lua_isnoneornil(L, 3) ? 1 : tl_checkcount(L, 3, 3, "records");
  int rc = tally_sender_post(h->s, body, len, records);
  if (rc < 0) return tl_fail(L, rc);
  lua_pushboolean(L, 1);
  return 1;
}

static int tl_sender_flush(lua_State *L) {
  tl_sender *h = tl_checksender(L);
  uint32_t ms = lua_isnoneornil(L, 2) ? h->timeout_ms : tl_checkms(L, 2, 2, "timeout", 1);
  int rc = tally_sender_flush(h->s, ms);
  if (rc == TALLY_ETIMEDOUT) return tl_fail_msg(L, rc, tally_strerror(rc));
  if (rc < 0) return tl_fail(L, rc);
  lua_pushboolean(L, 1);
  return 1;
}

static int tl_sender_stats(lua_State *L) {
  tl_sender *h = tl_checksender(L);
  tally_sender_stats st;
  tally_sender_stats_get(h->s, &st);
  lua_createtable(L, 0, 7);
  tl_setint(L, "sent", st.sent);
  tl_setint(L, "requests", st.requests);
  tl_setint(L, "failures", st.failures);
  tl_setint(L, "dropped", st.dropped);
  tl_setint(L, "rejected", st.rejected);
  tl_setint(L, "queued", st.queued);
  lua_pushinteger(L, (lua_Integer)st.last_status);
  lua_setfield(L, -2, "last_status");
  lua_pushstring(L, st.last_error);
  lua_setfield(L, -2, "last_error");
  return 1;
}

/* sender:close([drain_s]); closing twice does nothing. */
static int tl_sender_close(lua_State *L) {
  tl_sender *h = (tl_sender *)tl_checkudata(L, 1, TL_SENDER_MT);
  uint32_t drain = lua_isnoneornil(L, 2) ? 0 : tl_checkms(L, 2, 2, "drain", 1);
  tally_sender *s = h->s;
  h->s = NULL;
  tally_sender_close(s, drain);
  return 0;
}

/* __gc and __close (which passes the error as argument 2): no drain. */
static int tl_sender_gc(lua_State *L) {
  tl_sender *h = (tl_sender *)tl_checkudata(L, 1, TL_SENDER_MT);
  tally_sender *s = h->s;
  h->s = NULL;
  tally_sender_close(s, 0);
  return 0;
}

static int tl_sender_tostring(lua_State *L) {
  tl_sender *h = (tl_sender *)tl_checkudata(L, 1, TL_SENDER_MT);
  if (h->s == NULL)
    lua_pushliteral(L, "tally.sender (closed)");
  else
    lua_pushfstring(L, "tally.sender (%p)", (void *)h->s);
  return 1;
}

static const luaL_Reg tl_sender_methods[] = {{"post", tl_sender_post},
                                             {"flush", tl_sender_flush},
                                             {"stats", tl_sender_stats},
                                             {"close", tl_sender_close},
                                             {NULL, NULL}};

static const luaL_Reg tl_sender_meta[] = {{"__gc", tl_sender_gc},
                                          {"__close", tl_sender_gc},
                                          {"__tostring", tl_sender_tostring},
                                          {NULL, NULL}};

/* ---- the spool's file helpers ---------------------------------------------- */

static int tl_errno_fail(lua_State *L, const char *what, const char *path, int err) {
  lua_pushnil(L);
  lua_pushfstring(L, "%s %s: %s", what, path, strerror(err));
  switch (err) { /* the common ones by name; others as a number */
  case ENOENT: lua_pushliteral(L, "ENOENT"); break;
  case EACCES: lua_pushliteral(L, "EACCES"); break;
  case ENOSPC: lua_pushliteral(L, "ENOSPC"); break;
  case ENOTDIR: lua_pushliteral(L, "ENOTDIR"); break;
  case EEXIST: lua_pushliteral(L, "EEXIST"); break;
  default: lua_pushfstring(L, "errno %d", err); break;
  }
  return 3;
}

/* fsync the directory holding path, so a new name in it lasts a crash. */
static int tl_sync_parent(const char *path) {
  char dir[4096];
  const char *slash = strrchr(path, '/');
  size_t n = slash ? (size_t)(slash - path) : 0;
  int fd, rc;
  if (n >= sizeof dir) return -1;
  if (n == 0) {
    dir[0] = slash ? '/' : '.';
    n = 1;
  } else
    memcpy(dir, path, n);
  dir[n] = 0;
  fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return -1;
  rc = fsync(fd);
  close(fd);
  return rc;
}

static int tl_spool_append(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  size_t len, off = 0;
  const char *data = luaL_checklstring(L, 2, &len);
  struct stat st;
  int fresh = stat(path, &st) != 0, fd, err;
  fd = open(path, O_RDWR | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return tl_errno_fail(L, "cannot open", path, errno);
  /* A line left half written (a full disk, a process killed mid-write)
   * must not swallow this one: start on a line of its own, and undo a
   * write that fails part way. */
  off_t before = lseek(fd, 0, SEEK_END);
  char last = '\n';
  if (before > 0 && pread(fd, &last, 1, before - 1) == 1 && last != '\n') {
    if (write(fd, "\n", 1) != 1) {
      err = errno;
      close(fd);
      return tl_errno_fail(L, "cannot write", path, err);
    }
    before++;
  }
  while (off < len) {
    ssize_t w = write(fd, data + off, len - off);
    if (w < 0) {
      if (errno == EINTR) continue;
      err = errno;
      if (before >= 0) (void)!ftruncate(fd, before); /* best effort: report the write */
      close(fd);
      return tl_errno_fail(L, "cannot write", path, err);
    }
    off += (size_t)w;
  }
  if (fdatasync(fd) != 0) {
    err = errno;
    close(fd);
    return tl_errno_fail(L, "cannot sync", path, err);
  }
  close(fd);
  if (fresh && tl_sync_parent(path) != 0)
    return tl_errno_fail(L, "cannot sync the directory of", path, errno);
  lua_pushboolean(L, 1);
  return 1;
}

static int tl_spool_list(lua_State *L) {
  const char *dir = luaL_checkstring(L, 1);
  DIR *d = opendir(dir);
  struct dirent *e;
  int n = 0;
  if (d == NULL) return tl_errno_fail(L, "cannot list", dir, errno);
  lua_newtable(L);
  while ((e = readdir(d)) != NULL) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
    lua_pushstring(L, e->d_name);
    lua_rawseti(L, -2, ++n);
  }
  closedir(d);
  return 1;
}

static int tl_spool_mkdir(lua_State *L) {
  const char *dir = luaL_checkstring(L, 1);
  struct stat st;
  if (mkdir(dir, 0700) != 0) {
    int err = errno;
    if (err != EEXIST) return tl_errno_fail(L, "cannot make the directory", dir, err);
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
      return tl_errno_fail(L, "cannot use as a directory", dir, ENOTDIR);
  } else {
    tl_sync_parent(dir);
  }
  lua_pushboolean(L, 1);
  return 1;
}

static int tl_getpid(lua_State *L) {
  lua_pushinteger(L, (lua_Integer)getpid());
  return 1;
}

int tl_open_sender(lua_State *L) {
  tl_newclass(L, TL_SENDER_MT, tl_sender_meta, tl_sender_methods);
  lua_pop(L, 1);
  lua_pushcfunction(L, tl_sender_new);
  lua_setfield(L, -2, "sender");
  lua_pushcfunction(L, tl_spool_append);
  lua_setfield(L, -2, "spool_append");
  lua_pushcfunction(L, tl_spool_list);
  lua_setfield(L, -2, "spool_list");
  lua_pushcfunction(L, tl_spool_mkdir);
  lua_setfield(L, -2, "spool_mkdir");
  lua_pushcfunction(L, tl_getpid);
  lua_setfield(L, -2, "getpid");
  return 0;
}
