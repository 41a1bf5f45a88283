/* lua_http.c -- the http handle ("tally.http"): a minimal blocking HTTP
 * client on libcurl, for the stores and flushers written in Lua (the
 * Firestore REST API, lua/tally/firestore/).
 *
 *   core.http(base_url [, { timeout = s, headers = { "Name: value", ... } }])
 *       -> http handle            (base_url: "http://host:port/v1/" ...)
 *   h:request(method, path [, body [, headers]]) -> status, body
 *       or nil, message, code on a transport failure: ETIMEDOUT (no reply
 *       in time), ECONNECT (refused, unreachable), ELOST (an injected lost
 *       reply, below), EHTTP (anything else libcurl reports).
 *       The URL is base_url .. path; body (a string) is sent with
 *       Content-Type: application/json; headers adds "Name: value" lines
 *       to this request only. Connections are kept alive between requests.
 *   h:lose_replies(n) -> the previous count. Fault injection for tests: the
 *       next n requests go to the server whole and are answered (the server
 *       applies them), then the reply is thrown away and the request
 *       returns nil, "reply lost (injected)", "ELOST". In a build with
 *       the test seams (TALLY_TEST_SEAMS: where the tests are built), the
 *       environment variable TALLY_HTTP_LOSE_EVERY=K does the same for
 *       every K-th request of every handle made afterwards (for child
 *       processes).
 *   h:stats() -> { requests, failures, lost, bytes_in, bytes_out }
 *   h:close()  (also __gc, __close); a closed handle raises on use.
 *
 * Each handle owns one connection of the library's HTTP client
 * (src/net/http.c, which the rollup sinks' sender uses too) and its reply
 * buffer; nothing is shared between handles, so handles on different Lua
 * states are safe in different threads. Misuse (bad arguments, a closed
 * handle) raises; failures of the network return nil, message, code.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../net/http.h" /* the client itself */
#include "lua_aux.h"

#define TL_HTTP_MT       "tally.http"
#define TL_HTTP_MAXREPLY (64u << 20) /* a reply larger than 64 MiB is an error */
#define TL_HTTP_MAXHDRS  64

typedef struct tl_http {
  tally__http *http;   /* NULL once closed */
  char *base;          /* base URL, malloc'd */
  uint64_t lose;       /* replies still to lose (h:lose_replies) */
  uint64_t lose_every; /* TALLY_HTTP_LOSE_EVERY, 0: never */
  uint64_t requests, failures, lost, bytes_in, bytes_out;
} tl_http;

static void tl_http_free(tl_http *h) {
  tally__http_close(h->http);
  free(h->base);
  h->http = NULL;
  h->base = NULL;
}

static tl_http *tl_checkhttp(lua_State *L) {
  tl_http *h = (tl_http *)tl_checkudata(L, 1, TL_HTTP_MT);
  if (h->http == NULL) luaL_error(L, "attempt to use a closed http handle");
  return h;
}

/* The "Name: value" strings of the list at idx into lines[at..] (at most
 * TL_HTTP_MAXHDRS, then NULL; the list keeps them alive); raises on
 * anything else. */
static void tl_http_headers(lua_State *L, int arg, int idx, const char **lines,
                            size_t at) {
  size_t n;
  if (lua_type(L, idx) != LUA_TTABLE)
    tl_argerror_got(L, arg, "headers must be a list of \"Name: value\" strings", idx,
                    TL_BOOL_TYPE);
  n = lua_rawlen(L, idx);
  if (n > TL_HTTP_MAXHDRS) tl_argerror(L, arg, "at most %d headers", TL_HTTP_MAXHDRS);
  for (size_t i = 1; i <= n; i++) {
    size_t len;
    const char *s;
    lua_rawgeti(L, idx, (int)i);
    if (lua_type(L, -1) != LUA_TSTRING)
      tl_argerror_got(L, arg, "headers must be a list of \"Name: value\" strings",
                      lua_gettop(L), TL_BOOL_TYPE);
    s = lua_tolstring(L, -1, &len);
    if (strlen(s) != len || strchr(s, '\n') != NULL || strchr(s, '\r') != NULL ||
        strchr(s, ':') == NULL)
      tl_argerror(L, arg, "header %d must be one \"Name: value\" line", (int)i);
    lines[at++] = s;
    lua_pop(L, 1);
  }
  lines[at] = NULL;
}

/* core.http(base_url [, opts]) -> handle */
static int tl_http_new(lua_State *L) {
  size_t blen;
  const char *base = luaL_checklstring(L, 1, &blen);
#ifdef TALLY_TEST_SEAMS /* read only where the tests are built */
  const char *every = getenv("TALLY_HTTP_LOSE_EVERY");
#else
  const char *every = NULL;
#endif
  const char *headers[TL_HTTP_MAXHDRS + 1] = {NULL}; /* opts keeps them alive */
  tl_http *h;
  double timeout = 10.0;
  if (strlen(base) != blen ||
      (strncmp(base, "http://", 7) != 0 && strncmp(base, "https://", 8) != 0))
    return luaL_argerror(L, 1, "http:// or https:// URL expected");
  if (!lua_isnoneornil(L, 2)) luaL_checktype(L, 2, LUA_TTABLE);
  lua_settop(L, 2);
  h = (tl_http *)lua_newuserdata(L, sizeof *h); /* 3 */
  memset(h, 0, sizeof *h);
  luaL_getmetatable(L, TL_HTTP_MT);
  lua_setmetatable(L, -2);
  if (lua_istable(L, 2)) {
    lua_pushnil(L);
    while (lua_next(L, 2)) { /* key at 4, value at 5 */
      const char *k = lua_type(L, 4) == LUA_TSTRING ? lua_tostring(L, 4) : "";
      if (strcmp(k, "timeout") == 0) {
        if (lua_type(L, 5) != LUA_TNUMBER || !(lua_tonumber(L, 5) > 0) ||
            lua_tonumber(L, 5) > 86400.0)
          tl_argerror_got(L, 2, "timeout must be a number of seconds from 0 to 86400", 5,
                          TL_BOOL_TYPE);
        timeout = (double)lua_tonumber(L, 5);
      } else if (strcmp(k, "headers") == 0) {
        tl_http_headers(L, 2, 5, headers, 0);
      } else {
        tl_argerror(L, 2, "unknown option %s", tl_describe(L, 4, TL_BOOL_TYPE));
      }
      lua_settop(L, 4);
    }
  }
  double ms = timeout * 1000.0;
  if (every != NULL) h->lose_every = strtoull(every, NULL, 10);
  h->base = (char *)malloc(blen + 1);
  if (h->base == NULL)
    return luaL_error(L, "cannot create an HTTP handle (out of memory)");
  memcpy(h->base, base, blen + 1);
  if (tally__http_open(ms < 1 ? 1 : (uint32_t)ms, headers, TL_HTTP_MAXREPLY, &h->http) <
      0) {
    tl_http_free(h);
    return luaL_error(L, "cannot create an HTTP handle (%s)", tally_errmsg());
  }
  return 1;
}

/* The code name of a failed request. */
static const char *tl_http_code(int rc) {
  switch (rc) {
  case TALLY_ETIMEDOUT: return "ETIMEDOUT";
  case TALLY_ECONNECT: return "ECONNECT";
  default: return "EHTTP";
  }
}

/* h:request(method, path [, body [, headers]]) */
static int tl_http_request(lua_State *L) {
  tl_http *h = tl_checkhttp(L);
  size_t mlen, plen, blen = 0;
  const char *method = luaL_checklstring(L, 2, &mlen);
  const char *path = luaL_checklstring(L, 3, &plen);
  const char *body = NULL;
  const char *extra[TL_HTTP_MAXHDRS + 2] = {NULL}; /* the content type, then these */
  tally__http_reply r;
  int lose = 0;
  luaL_Buffer url;
  if (mlen == 0 || mlen > 16 || strspn(method, "ABCDEFGHIJKLMNOPQRSTUVWXYZ") != mlen ||
      strcmp(method, "HEAD") == 0)
    return tl_argerror_got(L, 2, "method must be GET, POST, PATCH, DELETE or PUT", 2,
                           TL_BOOL_TYPE);
  if (strlen(path) != plen) return luaL_argerror(L, 3, "path must not contain NUL bytes");
  if (!lua_isnoneornil(L, 4)) body = luaL_checklstring(L, 4, &blen);
  size_t at = 0;
  if (body != NULL) extra[at++] = "Content-Type: application/json";
  if (!lua_isnoneornil(L, 5)) tl_http_headers(L, 5, 5, extra, at);

  luaL_buffinit(L, &url);
  luaL_addstring(&url, h->base);
  luaL_addlstring(&url, path, plen);
  luaL_pushresult(&url); /* the URL string stays on the stack while in use */

  int rc =
      tally__http_request(h->http, method, lua_tostring(L, -1), body, blen, extra, &r);
  h->requests++;
  h->bytes_out += blen;
  if (rc < 0) {
    h->failures++;
    lua_pushnil(L);
    lua_pushstring(L, r.error);
    lua_pushstring(L, tl_http_code(rc));
    return 3;
  }
  h->bytes_in += r.len;
  if (h->lose > 0) {
    h->lose--;
    lose = 1;
  } else if (h->lose_every > 0 && h->requests % h->lose_every == 0) {
    lose = 1;
  }
  if (lose) { /* the server has answered: the reply is what gets lost */
    h->lost++;
    lua_pushnil(L);
    lua_pushliteral(L, "reply lost (injected)");
    lua_pushliteral(L, "ELOST");
    return 3;
  }
  lua_pushinteger(L, (lua_Integer)r.status);
  lua_pushlstring(L, r.body, r.len);
  return 2;
}

/* h:lose_replies(n) -> the previous count */
static int tl_http_lose_replies(lua_State *L) {
  tl_http *h = tl_checkhttp(L);
  lua_Number n = luaL_checknumber(L, 2);
  if (!(n >= 0 && n <= 1e15) || (lua_Number)(int64_t)n != n)
    return tl_argerror_got(L, 2, "non-negative integer expected", 2, TL_BOOL_TYPE);
  lua_pushnumber(L, (lua_Number)h->lose);
  h->lose = (uint64_t)n;
  return 1;
}

static int tl_http_stats(lua_State *L) {
  tl_http *h = tl_checkhttp(L);
  lua_createtable(L, 0, 5);
  tl_setint(L, "requests", (int64_t)h->requests);
  tl_setint(L, "failures", (int64_t)h->failures);
  tl_setint(L, "lost", (int64_t)h->lost);
  tl_setint(L, "bytes_in", (int64_t)h->bytes_in);
  tl_setint(L, "bytes_out", (int64_t)h->bytes_out);
  return 1;
}

/* h:close(), __gc, __close: closing twice does nothing. */
static int tl_http_close(lua_State *L) {
  tl_http *h = (tl_http *)tl_checkudata(L, 1, TL_HTTP_MT);
  tl_http_free(h);
  return 0;
}

static int tl_http_tostring(lua_State *L) {
  tl_http *h = (tl_http *)tl_checkudata(L, 1, TL_HTTP_MT);
  if (h->http == NULL)
    lua_pushliteral(L, "tally.http (closed)");
  else
    lua_pushfstring(L, "tally.http (%s)", h->base);
  return 1;
}

static const luaL_Reg tl_http_methods[] = {{"request", tl_http_request},
                                           {"lose_replies", tl_http_lose_replies},
                                           {"stats", tl_http_stats},
                                           {"close", tl_http_close},
                                           {NULL, NULL}};
static const luaL_Reg tl_http_meta[] = {{"__gc", tl_http_close},
                                        {"__close", tl_http_close},
                                        {"__tostring", tl_http_tostring},
                                        {NULL, NULL}};

int tl_open_http(lua_State *L) {
  tl_newclass(L, TL_HTTP_MT, tl_http_meta, tl_http_methods);
  lua_pop(L, 1);
  lua_pushcfunction(L, tl_http_new);
  lua_setfield(L, -2, "http");
  return 0;
}
