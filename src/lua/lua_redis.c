/* lua_redis.c -- the redis and flusher handles ("tally.redis",
 * "tally.flusher"): the Redis client and the exactly-once flusher of
 * include/tally_net.h.
 *
 *   core.redis(uri [, { timeout = s, password = p, user = u }])
 *       -> redis handle, or nil, msg, code
 *       uri: "redis://[[user]:password@]host[:port][/0][?query]"
 *                               (standalone or cluster: detected with
 *                               CLUSTER SLOTS)
 *            "redis+cluster://[[user]:password@]h1:p1,h2:p2,...[?query]"
 *                               (seeds; the first reachable)
 *            query: password=, user= (or username=), db=0, as redis-py
 *            and go-redis take them; all of it may be %XX-escaped.
 *       timeout: seconds each call may take (default 5)
 *       password: used when the URI has none; else $TALLY_REDIS_PASSWORD
 *       user: likewise (else $TALLY_REDIS_USER); AUTH user password (ACL)
 *       No message ever contains the userinfo or the query: URIs in
 *       messages are shown as core.uri_redact shows them (each as ***).
 *   r:command(arg, ...) -> reply, or nil, message for an error reply or a
 *       failure (then also a code name: ETIMEDOUT, ESYS, ...). Arguments
 *       are strings or numbers. Replies: integer (under LuaJIT a number
 *       within +-2^53, else a boxed int64 as elsewhere in the binding),
 *       string (bulk and status), nil, or an array table (its nil elements
 *       are false, its error elements { err = message }). The command is
 *       routed by its first key: argv[1], or argv[3] for EVAL / EVALSHA
 *       with keys; known keyless commands (PING, INFO, CLIENT, CLUSTER,
 *       CONFIG, ...) go to the node serving slot 0.
 *   r:command_wait(replicas, timeout_ms, arg, ...) -> reply, acked (or as
 *       r:command for errors): the command, then WAIT replicas timeout_ms
 *       pipelined on its connection; acked is how many replicas have every
 *       write of that connection so far (-1 if WAIT failed).
 *   r:stats() -> { cluster, moved, asked, retries, reconnects, refreshes, errors,
 *                  resent, topology }
 *   r:close()  (also __gc, __close; closes the flushers made on it)
 *
 *   core.flusher(db, r, { writer = id, shards = R, verify = s }) -> flusher
 *       writer: 1..128 bytes, required; shards: 1..MAX_SHARDS (default 8)
 *       verify: seconds between re-reads of every w:W (default 60; 0: only
 *               after topology changes and f:verify())
 *   f:run([pattern]) -> stats table, or nil, message, code, stats table
 *       stats: counters, unchanged, flushed, already, conflicts, errors,
 *              commands, bytes, delta, verified, repaired, entries
 *   f:verify()  the next run reads every w:W again (see tally_net.h)
 *   f:remote_value(name) -> integer, or nil, message, code
 *   f:shard() -> the remote shard index (0-based) this writer flushes into
 *   f:close()  (also __gc, __close)
 *   core.unship(db, writer)  the store forgets that writer ships its
 *       counters (tally_store_unship): they may expire unshipped
 *
 * Lifetimes. A flusher keeps its store and redis handles alive through its
 * user values. Closing the store first makes the flusher's next use raise
 * "attempt to use a closed store" (and frees it: its counter handles are
 * plain memory); closing the redis handle first frees its flushers, whose
 * next use raises "attempt to use a closed flusher".
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdbool.h>
#include <string.h>
#include <strings.h>

#include "lua_aux.h"
#include "../net/redis_cluster.h" /* the client itself: commands, replies */

#define TL_REDIS_MT   "tally.redis"
#define TL_FLUSHER_MT "tally.flusher"
#define TL_SEEDS_MAX  4096
#define TL_ARGV_MAX   4096

typedef struct tl_flusher tl_flusher;

typedef struct tl_redis {
  tally_rc *rc;         /* NULL once closed */
  tl_flusher *flushers; /* open flushers made on it */
} tl_redis;

struct tl_flusher {
  tally_flusher *f;        /* NULL once closed */
  tl_store *db;            /* kept alive through user value 1 */
  tl_redis *r;             /* kept alive through user value 2 */
  tl_flusher *prev, *next; /* in r->flushers while open */
};

/* ---- helpers ------------------------------------------------------------------ */

/* Parse a "host[:port]" list (comma separated) from s (len bytes) into
 * seeds as "host:port,host:port". Returns 0, or raises with the reason. */
static void tl_seeds(lua_State *L, const char *uri, const char *s, size_t len,
                     int allow_many, char *out, size_t cap) {
  size_t o = 0, i = 0;
  int n = 0;
  if (len == 0) tl_argerror(L, 1, "bad Redis URI '%s': no host", uri);
  while (i <= len) {
    size_t j = i, colon = (size_t)-1;
    char port[8];
    while (j < len && s[j] != ',') {
      if (s[j] == ':') colon = j;
      j++;
    }
    size_t hend = colon == (size_t)-1 ? j : colon;
    if (hend == i) tl_argerror(L, 1, "bad Redis URI '%s': empty host", uri);
    for (size_t k = i; k < hend; k++)
      if (!(s[k] == '.' || s[k] == '-' || s[k] == '_' || (s[k] >= '0' && s[k] <= '9') ||
            (s[k] >= 'a' && s[k] <= 'z') || (s[k] >= 'A' && s[k] <= 'Z')))
        tl_argerror(L, 1, "bad Redis URI '%s': bad character in host", uri);
    if (colon == (size_t)-1) {
      strcpy(port, "6379");
    } else {
      long p = 0;
      size_t plen = j - colon - 1;
      if (plen == 0 || plen > 5) tl_argerror(L, 1, "bad Redis URI '%s': bad port", uri);
      for (size_t k = colon + 1; k < j; k++) {
        if (s[k] < '0' || s[k] > '9')
          tl_argerror(L, 1, "bad Redis URI '%s': bad port", uri);
        p = p * 10 + (s[k] - '0');
      }
      if (p < 1 || p > 65535)
        tl_argerror(L, 1, "bad Redis URI '%s': port must be 1 to 65535", uri);
      snprintf(port, sizeof port, "%ld", p);
    }
    if (++n > 1 && !allow_many)
      tl_argerror(L, 1, "bad Redis URI '%s': several hosts need redis+cluster://", uri);
    if (o + (hend - i) + strlen(port) + 3 > cap)
      tl_argerror(L, 1, "bad Redis URI '%s': too long", uri);
    if (o > 0) out[o++] = ',';
    memcpy(out + o, s + i, hend - i);
    o += hend - i;
    out[o++] = ':';
    memcpy(out + o, port, strlen(port));
    o += strlen(port);
    i = j + 1;
  }
  out[o] = '\0';
}

/* %XX-decode s (len bytes) into a new string on the stack, '+' as a space
 * too in a query (form encoding, as redis-py and go-redis read it); raises
 * (without quoting it) on a bad escape or a NUL. */
static const char *tl_unescape(lua_State *L, const char *red, const char *what,
                               const char *s, size_t len, int plus) {
  luaL_Buffer b;
  luaL_buffinit(L, &b);
  for (size_t i = 0; i < len; i++) {
    int c = (unsigned char)s[i];
    if (c == '%') {
      int v = 0;
      for (int k = 1; k <= 2; k++) {
        int d = i + (size_t)k < len ? (unsigned char)s[i + (size_t)k] : -1;
        int x = d >= '0' && d <= '9'   ? d - '0'
                : d >= 'a' && d <= 'f' ? d - 'a' + 10
                : d >= 'A' && d <= 'F' ? d - 'A' + 10
                                       : -1;
        if (x < 0)
          tl_argerror(L, 1, "bad Redis URI '%s': bad %%-escape in the %s", red, what);
        v = v * 16 + x;
      }
      c = v;
      i += 2;
    } else if (c == '+' && plus) {
      c = ' ';
    }
    if (c == 0) tl_argerror(L, 1, "bad Redis URI '%s': NUL in the %s", red, what);
    luaL_addchar(&b, (char)c);
  }
  luaL_pushresult(&b);
  return lua_tostring(L, -1);
}

/* Set *slot to v (the query's or the userinfo's), raising if it is set. */
static void tl_once(lua_State *L, const char *red, const char *what, const char **slot,
                    const char *v) {
  if (*slot) tl_argerror(L, 1, "bad Redis URI '%s': %s given twice", red, what);
  *slot = v;
}

/* The one parser of Redis URIs:
 *   redis://[[USER]:PASSWORD@]HOST[:PORT][/0][?QUERY]
 *   redis+cluster://[[USER]:PASSWORD@]HOST[:PORT],...[/][?QUERY]
 * QUERY: NAME=VALUE pairs joined by '&', as redis-py and go-redis take
 * them: password, user (or username), db (0 only). The userinfo ends at
 * the last '@' before the query, so a password may hold '/' and '@'.
 * Writes the seeds ("host:port,...") into seeds (cap bytes) and sets
 * *user and *password (NULL: none; their strings stay on the stack).
 * Raises with the reason, the URI shown as red (tally_uri_redact): never
 * a value of the userinfo or the query. */
static void tl_parse_uri(lua_State *L, const char *uri, size_t len, const char *red,
                         char *seeds, size_t cap, const char **user,
                         const char **password) {
  const char *end = uri + len, *rest, *q, *hend, *hosts, *at = NULL;
  int cluster;
  *user = *password = NULL;
  if (len >= 8 && memcmp(uri, "redis://", 8) == 0) {
    rest = uri + 8, cluster = 0;
  } else if (len >= 16 && memcmp(uri, "redis+cluster://", 16) == 0) {
    rest = uri + 16, cluster = 1;
  } else {
    tl_argerror(L, 1,
                "bad Redis URI '%s' (expected redis://host:port or "
                "redis+cluster://host:port,host:port,...)",
                red);
    return;
  }
  luaL_checkstack(L, 8, "Redis URI");
  q = memchr(rest, '?', (size_t)(end - rest));
  hend = q ? q : end;
  for (const char *p = rest; p < hend; p++)
    if (*p == '@') at = p;
  if (at) { /* USER:PASSWORD@ or :PASSWORD@ or USER@ */
    const char *colon = memchr(rest, ':', (size_t)(at - rest));
    const char *uend = colon ? colon : at;
    if (uend > rest) *user = tl_unescape(L, red, "user", rest, (size_t)(uend - rest), 0);
    if (colon)
      *password = tl_unescape(L, red, "password", colon + 1, (size_t)(at - colon - 1), 0);
  }
  hosts = at ? at + 1 : rest;
  if (!cluster) {
    const char *slash = memchr(hosts, '/', (size_t)(hend - hosts));
    if (slash && !(hend - slash == 1 || (hend - slash == 2 && slash[1] == '0')))
      tl_argerror(L, 1, "bad Redis URI '%s': only database 0 is supported", red);
    if (slash) hend = slash;
  } else if (hend > hosts && hend[-1] == '/') {
    hend--;
  }
  tl_seeds(L, red, hosts, (size_t)(hend - hosts), cluster, seeds, cap);
  for (const char *p = q ? q + 1 : end; p < end;) {
    const char *amp = memchr(p, '&', (size_t)(end - p)), *pend = amp ? amp : end;
    const char *eq = memchr(p, '=', (size_t)(pend - p));
    const char *next = amp ? amp + 1 : end;
    if (pend == p) { /* an empty pair: "?&password=..." */
      p = next;
      continue;
    }
    if (!eq)
      tl_argerror(
          L, 1, "bad Redis URI '%s': a query parameter without '=' (expected NAME=VALUE)",
          red);
    const char *k = tl_unescape(L, red, "query", p, (size_t)(eq - p), 1);
    const char *v = tl_unescape(L, red, "query", eq + 1, (size_t)(pend - eq - 1), 1);
    int keep = 1; /* v: a credential, kept on the stack */
    bool known = strcmp(k, "password") == 0 || strcmp(k, "user") == 0 ||
                 strcmp(k, "username") == 0 || strcmp(k, "db") == 0;
    if (!known) /* never named: an unescaped '&' in a password makes its rest one */
      tl_argerror(L, 1,
                  "bad Redis URI '%s': an unknown query parameter (expected password, "
                  "user, username, db; write '&' and '=' in a value as %%26 and %%3D)",
                  red);
    if (!*v) tl_argerror(L, 1, "bad Redis URI '%s': empty %s in the query", red, k);
    if (strcmp(k, "password") == 0) {
      tl_once(L, red, "password", password, v);
    } else if (strcmp(k, "user") == 0 || strcmp(k, "username") == 0) {
      tl_once(L, red, "user", user, v);
    } else { /* db */
      if (strcmp(v, "0") != 0)
        tl_argerror(L, 1, "bad Redis URI '%s': only database 0 is supported", red);
      keep = 0;
    }
    lua_remove(L, -2); /* the name */
    if (!keep) lua_pop(L, 1);
    p = next;
  }
}

/* ---- the redis handle --------------------------------------------------------- */

static void tl_flusher_release(tl_flusher *h) {
  if (h->f == NULL) return;
  tally_flusher_free(h->f);
  h->f = NULL;
  if (h->prev != NULL)
    h->prev->next = h->next;
  else
    h->r->flushers = h->next;
  if (h->next != NULL) h->next->prev = h->prev;
  h->prev = h->next = NULL;
}

static void tl_redis_release(tl_redis *r) {
  while (r->flushers != NULL) tl_flusher_release(r->flushers);
  tally_rc_close(r->rc);
  r->rc = NULL;
}

static tl_redis *tl_checkredis(lua_State *L, int idx) {
  tl_redis *r = (tl_redis *)tl_checkudata(L, idx, TL_REDIS_MT);
  if (r->rc == NULL) luaL_error(L, "attempt to use a closed redis handle");
  return r;
}

static const char NOAUTH_HINT[] =
    " (the server needs a password: put it in the URI as redis://:PASSWORD@host:port,"
    " redis://USER:PASSWORD@host:port or redis://host:port?password=PASSWORD, pass"
    " { password = ... }, or set TALLY_REDIS_PASSWORD)";

static int tl_redis_new(lua_State *L) {
  size_t len;
  const char *uri = luaL_checklstring(L, 1, &len);
  char seeds[TL_SEEDS_MAX];
  tally_rc_opts ro = {5000, NULL, NULL};
  const char *red, *user, *password;
  tl_redis *r;
  int rc;

  lua_settop(L, 2);
  if (strlen(uri) != len) luaL_argerror(L, 1, "URI must not contain NUL bytes");
  red = tl_pushredacted(L, uri, len); /* index 3: what messages show */
  tl_parse_uri(L, uri, len, red, seeds, sizeof seeds, &user, &password);
  if (!lua_isnoneornil(L, 2)) {
    if (lua_type(L, 2) != LUA_TTABLE)
      tl_argerror(L, 2, "options table expected, got %s", luaL_typename(L, 2));
    lua_pushnil(L);
    while (lua_next(L, 2)) {
      const char *k = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : "";
      if (strcmp(k, "timeout") == 0) {
        lua_Number s = lua_tonumber(L, -1);
        if (lua_type(L, -1) != LUA_TNUMBER || !(s > 0 && s <= 4294967.0))
          tl_argerror(L, 2, "timeout must be a positive number of seconds, got %s",
                      tl_describe(L, -1, TL_BOOL_TYPE));
        double ms = (double)s * 1000.0;
        ro.timeout_ms = (uint32_t)ms;
        if (ro.timeout_ms < ms) ro.timeout_ms++;
      } else if (strcmp(k, "password") == 0 || strcmp(k, "user") == 0) {
        size_t vl;
        if (lua_type(L, -1) != LUA_TSTRING) /* never quote the value */
          tl_argerror(L, 2, "%s must be a string, got %s", k, luaL_typename(L, -1));
        const char *v = lua_tolstring(L, -1, &vl); /* the options table keeps it */
        if (vl == 0 || strlen(v) != vl)
          tl_argerror(L, 2, "%s must be 1 or more bytes without NULs", k);
        if (k[0] == 'p' && !password) password = v;
        if (k[0] == 'u' && !user) user = v;
      } else {
        tl_argerror(L, 2,
                    "unknown option %s (expected timeout, "
                    "password, user)",
                    tl_describe(L, -2, TL_BOOL_TYPE));
      }
      lua_pop(L, 1);
    }
  }
  if (!password) {
    password = getenv("TALLY_REDIS_PASSWORD");
    if (password && !*password) password = NULL;
  }
  if (!user) {
    user = getenv("TALLY_REDIS_USER");
    if (user && !*user) user = NULL;
  }
  ro.user = user;
  ro.password = password;
  r = (tl_redis *)lua_newuserdata(L, sizeof *r);
  r->rc = NULL;
  r->flushers = NULL;
  luaL_getmetatable(L, TL_REDIS_MT);
  lua_setmetatable(L, -2);
  rc = tally_rc_open_opts(seeds, &ro, &r->rc);
  if (rc == TALLY_EINVAL) return luaL_argerror(L, 1, tally_errmsg());
  if (rc < 0) {
    const char *m = tally_errmsg();
    if (strstr(m, "NOAUTH") && !password)
      return tl_fail_msg(L, rc, lua_pushfstring(L, "%s%s", m, NOAUTH_HINT));
    return tl_fail_msg(L, rc, m);
  }
  return 1;
}

/* Push a reply; nested nils are false and nested errors { err = msg }. */
static void tl_pushreply(lua_State *L, const redisReply *rp, int nested) {
  switch (rp->type) {
  case REDIS_REPLY_INTEGER: tl_pushint64(L, (int64_t)rp->integer); break;
  case REDIS_REPLY_STRING:
  case REDIS_REPLY_STATUS: lua_pushlstring(L, rp->str, rp->len); break;
  case REDIS_REPLY_ERROR:
    lua_createtable(L, 0, 1);
    lua_pushlstring(L, rp->str, rp->len);
    lua_setfield(L, -2, "err");
    break;
  case REDIS_REPLY_ARRAY:
    luaL_checkstack(L, 4, "Redis reply too deep");
    lua_createtable(L, rp->elements > 0x7fffffff ? 0 : (int)rp->elements, 0);
    for (size_t i = 0; i < rp->elements; i++) {
      tl_pushreply(L, rp->element[i], 1);
      lua_rawseti(L, -2, (int)(i + 1));
    }
    break;
  default: /* NIL */
    if (nested)
      lua_pushboolean(L, 0);
    else
      lua_pushnil(L);
    break;
  }
}

/* Whether every integer in the reply can be pushed (LuaJIT: see tl_canpush). */
static int tl_replyok(lua_State *L, const redisReply *rp) {
  if (rp->type == REDIS_REPLY_INTEGER) return tl_canpush(L, (int64_t)rp->integer);
  if (rp->type == REDIS_REPLY_ARRAY)
    for (size_t i = 0; i < rp->elements; i++)
      if (!tl_replyok(L, rp->element[i])) return 0;
  return 1;
}

static int tl_keyless(const char *cmd) {
  static const char *const names[] = {
      "PING",     "INFO",     "CLIENT",    "CLUSTER", "CONFIG",    "DBSIZE",
      "FLUSHALL", "FLUSHDB",  "TIME",      "DEBUG",   "SCRIPT",    "COMMAND",
      "ECHO",     "ROLE",     "SCAN",      "KEYS",    "RANDOMKEY", "LASTSAVE",
      "SAVE",     "BGSAVE",   "SLOWLOG",   "MEMORY",  "LATENCY",   "MONITOR",
      "SHUTDOWN", "READONLY", "READWRITE", "ASKING",  NULL};
  for (int i = 0; names[i]; i++)
    if (strcasecmp(cmd, names[i]) == 0) return 1;
  return 0;
}

/* r:command(...) and r:command_wait(replicas, timeout_ms, ...): the command
 * is at stack index first onwards. */
static int tl_redis_run(lua_State *L, int first, int wait, uint32_t replicas,
                        uint32_t timeout_ms) {
  tl_redis *r = tl_checkredis(L, 1);
  int argc = lua_gettop(L) - first + 1;
  const char **argv;
  size_t *argvlen;
  const void *key = NULL;
  size_t keylen = 0;
  redisReply *reply = NULL;
  long long acked = -1;
  int rc;

  if (argc < 1)
    return luaL_error(L, "bad argument #%d to '%s' (command name expected)", first - 1,
                      wait ? "command_wait" : "command");
  if (argc > TL_ARGV_MAX) return luaL_error(L, "too many arguments to 'command'");
  argv = (const char **)lua_newuserdata(L, sizeof(*argv) * (size_t)argc);
  argvlen = (size_t *)lua_newuserdata(L, sizeof(*argvlen) * (size_t)argc);
  for (int i = 0; i < argc; i++) {
    int t = lua_type(L, i + first);
    if (t != LUA_TSTRING && t != LUA_TNUMBER)
      tl_argerror(L, i + first - 1, "string or number expected, got %s",
                  luaL_typename(L, i + first));
    argv[i] = lua_tolstring(L, i + first, &argvlen[i]); /* converts numbers in place */
  }
  if (strcasecmp(argv[0], "EVAL") == 0 || strcasecmp(argv[0], "EVALSHA") == 0) {
    if (argc >= 4 && strcmp(argv[2], "0") != 0) key = argv[3], keylen = argvlen[3];
  } else if (argc >= 2 && !tl_keyless(argv[0])) {
    key = argv[1];
    keylen = argvlen[1];
  }
  if (wait)
    rc = tally_rc_command_wait(r->rc, key, keylen, argc, argv, argvlen, replicas,
                               timeout_ms, &reply, &acked);
  else
    rc = tally_rc_command(r->rc, key, keylen, argc, argv, argvlen, &reply);
  if (rc < 0) return tl_fail(L, rc);
  if (reply->type == REDIS_REPLY_ERROR) {
    lua_pushnil(L);
    lua_pushlstring(L, reply->str, reply->len);
    freeReplyObject(reply);
    return 2;
  }
  if (!tl_replyok(L, reply)) { /* the push would raise and leak the reply */
    freeReplyObject(reply);
    return luaL_error(
        L, "integer in the reply beyond 2^53 and no box registered (core.set_box)");
  }
  tl_pushreply(L, reply, 0);
  freeReplyObject(reply);
  if (!wait) return 1;
  lua_pushinteger(L, (lua_Integer)acked);
  return 2;
}

static int tl_redis_command(lua_State *L) {
  return tl_redis_run(L, 2, 0, 0, 0);
}

static int tl_redis_command_wait(lua_State *L) {
  int isnum = 0;
  lua_Integer n = lua_type(L, 2) == LUA_TNUMBER ? tl_tointx(L, 2, &isnum) : 0;
  if (!isnum || n < 0 || n > 1000000)
    luaL_argerror(L, 1, "replicas must be an integer from 0 to 1000000");
  lua_Integer t = lua_type(L, 3) == LUA_TNUMBER ? tl_tointx(L, 3, &isnum) : 0;
  if (!isnum || t < 1 || t > 3600000)
    luaL_argerror(L, 2,
                  "timeout must be an integer number of milliseconds from 1 to 3600000");
  return tl_redis_run(L, 4, 1, (uint32_t)n, (uint32_t)t);
}

static int tl_redis_stats(lua_State *L) {
  tl_redis *r = tl_checkredis(L, 1);
  tally_rc_stats st;
  tally_rc_stats_get(r->rc, &st);
  lua_createtable(L, 0, 7);
  lua_pushboolean(L, tally_rc_is_cluster(r->rc));
  lua_setfield(L, -2, "cluster");
  tl_setint(L, "moved", st.moved);
  tl_setint(L, "asked", st.asked);
  tl_setint(L, "retries", st.retries);
  tl_setint(L, "reconnects", st.reconnects);
  tl_setint(L, "refreshes", st.refreshes);
  tl_setint(L, "errors", st.errors);
  tl_setint(L, "resent", st.resent);
  tl_setint(L, "topology", st.topology);
  return 1;
}

static int tl_redis_close(lua_State *L) {
  tl_redis *r = (tl_redis *)tl_checkudata(L, 1, TL_REDIS_MT);
  tl_redis_release(r);
  return 0;
}

static int tl_redis_tostring(lua_State *L) {
  tl_redis *r = (tl_redis *)tl_checkudata(L, 1, TL_REDIS_MT);
  if (r->rc == NULL)
    lua_pushliteral(L, "tally.redis (closed)");
  else
    lua_pushfstring(L, "tally.redis (%s, %p)",
                    tally_rc_is_cluster(r->rc) ? "cluster" : "standalone", (void *)r->rc);
  return 1;
}

/* ---- the flusher ---------------------------------------------------------------- */

static tl_flusher *tl_checkflusher(lua_State *L, int idx) {
  tl_flusher *h = (tl_flusher *)tl_checkudata(L, idx, TL_FLUSHER_MT);
  if (h->db != NULL && h->db->store == NULL) {
    tl_flusher_release(h);
    luaL_error(L, "attempt to use a closed store");
  }
  if (h->f == NULL) luaL_error(L, "attempt to use a closed flusher");
  return h;
}

static int tl_flusher_new(lua_State *L) {
  tl_store *db = tl_checkstore(L, 1);
  tl_redis *r = tl_checkredis(L, 2);
  const char *writer = NULL;
  uint32_t shards = 8;
  uint32_t verify_ms = TALLY_FLUSH_VERIFY_MS;
  tl_flusher *h;
  int rc;

  luaL_checktype(L, 3, LUA_TTABLE);
  lua_settop(L, 3);
  lua_pushnil(L);
  while (lua_next(L, 3)) {
    const char *k = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : "";
    if (strcmp(k, "writer") == 0) {
      size_t wl;
      if (lua_type(L, -1) != LUA_TSTRING)
        tl_argerror(L, 3, "writer must be a string, got %s",
                    tl_describe(L, -1, TL_BOOL_TYPE));
      writer = lua_tolstring(L, -1, &wl); /* the options table keeps it */
      if (wl < 1 || wl > TALLY_FLUSH_WRITER_MAX || strlen(writer) != wl)
        luaL_argerror(L, 3, "writer must be 1 to 128 bytes without NULs");
    } else if (strcmp(k, "shards") == 0) {
      int isnum = 0;
      lua_Integer n = lua_type(L, -1) == LUA_TNUMBER ? tl_tointx(L, -1, &isnum) : 0;
      if (!isnum || n < 1 || n > TALLY_MAX_SHARDS)
        tl_argerror(L, 3, "shards must be an integer from 1 to %d, got %s",
                    TALLY_MAX_SHARDS, tl_describe(L, -1, TL_BOOL_TYPE));
      shards = (uint32_t)n;
    } else if (strcmp(k, "verify") == 0) {
      lua_Number v = lua_tonumber(L, -1);
      if (lua_type(L, -1) != LUA_TNUMBER || !(v >= 0 && v <= 4294967.0))
        tl_argerror(L, 3, "verify must be a number of seconds from 0 to 4294967, got %s",
                    tl_describe(L, -1, TL_BOOL_TYPE));
      verify_ms = (uint32_t)(v * 1000.0);
    } else {
      tl_argerror(L, 3, "unknown option %s (expected writer, shards, verify)",
                  tl_describe(L, -2, TL_BOOL_TYPE));
    }
    lua_pop(L, 1);
  }
  if (writer == NULL) luaL_argerror(L, 3, "writer is required");

  h = (tl_flusher *)tl_newud(L, sizeof *h, 2);
  memset(h, 0, sizeof *h);
  luaL_getmetatable(L, TL_FLUSHER_MT);
  lua_setmetatable(L, -2);
  lua_pushvalue(L, 1);
  tl_setuv(L, -2, 1);
  lua_pushvalue(L, 2);
  tl_setuv(L, -2, 2);
  rc = tally_flusher_new(db->store, r->rc, writer, shards, &h->f);
  if (rc == TALLY_EINVAL) return luaL_argerror(L, 3, tally_errmsg());
  if (rc < 0) return tl_fail(L, rc);
  tally_flusher_set_verify(h->f, verify_ms);
  h->db = db;
  h->r = r;
  h->next = r->flushers;
  if (r->flushers != NULL) r->flushers->prev = h;
  r->flushers = h;
  return 1;
}

static void tl_pushflushstats(lua_State *L, const tally_flush_stats *st) {
  lua_createtable(L, 0, 12);
  tl_setint(L, "verified", st->verified);
  tl_setint(L, "repaired", st->repaired);
  tl_setint(L, "counters", st->counters);
  tl_setint(L, "unchanged", st->unchanged);
  tl_setint(L, "flushed", st->flushed);
  tl_setint(L, "already", st->already);
  tl_setint(L, "conflicts", st->conflicts);
  tl_setint(L, "errors", st->errors);
  tl_setint(L, "commands", st->commands);
  tl_setint(L, "bytes", st->bytes);
  tl_setint(L, "entries", st->entries);
  tl_pushint64(L, st->delta);
  lua_setfield(L, -2, "delta");
}

static int tl_flusher_run(lua_State *L) {
  tl_flusher *h = tl_checkflusher(L, 1);
  size_t plen = 1;
  const char *pat = "*";
  tally_flush_stats st;
  int rc;
  if (!lua_isnoneornil(L, 2)) pat = luaL_checklstring(L, 2, &plen);
  memset(&st, 0, sizeof st);
  rc = tally_flusher_run(h->f, pat, plen, &st);
  if (rc < 0) {
    tl_fail(L, rc);
    tl_pushflushstats(L, &st);
    return 4;
  }
  tl_pushflushstats(L, &st);
  return 1;
}

static int tl_flusher_remote_value(lua_State *L) {
  tl_flusher *h = tl_checkflusher(L, 1);
  size_t len;
  const char *name = luaL_checklstring(L, 2, &len);
  int64_t v = 0;
  int rc = tally_flusher_remote_value(h->f, name, len, &v);
  if (rc == TALLY_EINVAL) return luaL_argerror(L, 2, tally_errmsg());
  if (rc < 0) return tl_fail(L, rc);
  tl_pushint64(L, v);
  return 1;
}

static int tl_flusher_verify(lua_State *L) {
  tl_flusher *h = tl_checkflusher(L, 1);
  tally_flusher_verify(h->f);
  return 0;
}

static int tl_flusher_shard(lua_State *L) {
  tl_flusher *h = tl_checkflusher(L, 1);
  lua_pushinteger(L, (lua_Integer)tally_flusher_shard(h->f));
  return 1;
}

static int tl_unship(lua_State *L) {
  tl_store *db = tl_checkstore(L, 1);
  size_t wl;
  const char *writer = luaL_checklstring(L, 2, &wl);
  if (wl < 1 || wl > TALLY_FLUSH_WRITER_MAX)
    luaL_argerror(L, 2, "writer must be 1 to 128 bytes");
  int rc = tally_store_unship(db->store, writer, wl);
  if (rc < 0) return tl_fail(L, rc);
  lua_pushboolean(L, 1);
  return 1;
}

static int tl_flusher_close(lua_State *L) {
  tl_flusher *h = (tl_flusher *)tl_checkudata(L, 1, TL_FLUSHER_MT);
  tl_flusher_release(h);
  return 0;
}

static int tl_flusher_tostring(lua_State *L) {
  tl_flusher *h = (tl_flusher *)tl_checkudata(L, 1, TL_FLUSHER_MT);
  if (h->f == NULL)
    lua_pushliteral(L, "tally.flusher (closed)");
  else
    lua_pushfstring(L, "tally.flusher (%p)", (void *)h->f);
  return 1;
}

/* ---- registration ---------------------------------------------------------------- */

static const luaL_Reg tl_redis_methods[] = {{"command", tl_redis_command},
                                            {"command_wait", tl_redis_command_wait},
                                            {"stats", tl_redis_stats},
                                            {"close", tl_redis_close},
                                            {NULL, NULL}};
static const luaL_Reg tl_redis_meta[] = {{"__gc", tl_redis_close},
                                         {"__close", tl_redis_close},
                                         {"__tostring", tl_redis_tostring},
                                         {NULL, NULL}};
static const luaL_Reg tl_flusher_methods[] = {
    {"run", tl_flusher_run},     {"remote_value", tl_flusher_remote_value},
    {"shard", tl_flusher_shard}, {"verify", tl_flusher_verify},
    {"close", tl_flusher_close}, {NULL, NULL}};
static const luaL_Reg tl_flusher_meta[] = {{"__gc", tl_flusher_close},
                                           {"__close", tl_flusher_close},
                                           {"__tostring", tl_flusher_tostring},
                                           {NULL, NULL}};

/* core.redis_shard_key(name, i) -> "tally:{NAME#i}", the Redis key of
 * shard i (0-based) of counter name: the flusher's own rule
 * (tally_flusher_shard_key), which the Redis store shares. */
static int tl_redis_shard_key(lua_State *L) {
  size_t len;
  const char *name = luaL_checklstring(L, 1, &len);
  lua_Integer i = luaL_checkinteger(L, 2);
  char key[TALLY_NAME_MAX + 32];
  luaL_argcheck(L, i >= 0 && i <= UINT32_MAX, 2, "shard index out of range");
  int klen = tally_flusher_shard_key(name, len, (uint32_t)i, key, sizeof key);
  if (klen < 0) return luaL_argerror(L, 1, "a counter name is 1 to 255 bytes");
  lua_pushlstring(L, key, (size_t)klen);
  return 1;
}

int tl_open_redis(lua_State *L) {
  tl_newclass(L, TL_REDIS_MT, tl_redis_meta, tl_redis_methods);
  tl_newclass(L, TL_FLUSHER_MT, tl_flusher_meta, tl_flusher_methods);
  lua_pop(L, 2);
  lua_pushcfunction(L, tl_redis_new);
  lua_setfield(L, -2, "redis");
  lua_pushcfunction(L, tl_flusher_new);
  lua_setfield(L, -2, "flusher");
  lua_pushcfunction(L, tl_unship);
  lua_setfield(L, -2, "unship");
  lua_pushcfunction(L, tl_redis_shard_key);
  lua_setfield(L, -2, "redis_shard_key");
  return 0;
}
