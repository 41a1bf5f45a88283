/* cli_httpd.c -- tally.httpd: the HTTP server of `tally serve`, on GNU
 * libmicrohttpd, for the tally command only.
 *
 *   httpd.serve(opts, handler [, ready]) -> signal name ("SIGTERM", "SIGINT")
 *       or nil, message
 *     opts: host (numeric IPv4 or IPv6), port (0: any), connections,
 *       per_ip, timeout (seconds idle), memory (bytes per connection),
 *       body_timeout (seconds idle while a producer's body is made: 300),
 *       nice (the process's niceness at least this, 0 to 19: 0)
 *     handler(req) -> status, headers, body [, gzip]
 *       req: { method=, path=, query = { k = v, or k = { v1, v2, ... } for
 *              a parameter given more than once }, bad_escape = true|nil,
 *              nul_in_path = true|nil (path is then cut at the %00),
 *              authorization=, user=, password= (Basic, decoded),
 *              accept_encoding=, remote= }
 *       headers: { ["Content-Type"] = ..., ... }
 *       body: a string, or a producer: a function called for the next
 *       piece, returning a string (possibly "": nothing yet, call again),
 *       or nil at the end; gzip: compress the body (zlib's deflate, gzip
 *       framing, Content-Encoding: gzip)
 *     ready(port) is called once the socket listens.
 *     opts.after: a function called a second after the last request
 *       (what a server does when its requests are over), and again a
 *       second later for as long as it returns true.
 *
 * One thread does everything: MHD runs in external-polling mode on epoll
 * and this loop polls its epoll descriptor and a self-pipe, so every call
 * into Lua happens here, on the one Lua state, between two MHD_run calls.
 * A producer that answers "" makes the loop poll with no wait, so a long
 * scrape (tally.prometheus pausing every 500 counters) is cut into
 * steps and other connections are served between them. SIGTERM and SIGINT
 * write to the self-pipe: the loop stops, MHD closes every connection and
 * serve returns the signal's name. Bad percent-encoding in the path or
 * query is noted per connection (the unescape callback) so the handler can
 * answer 400 rather than guess.
 */
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <microhttpd.h>
#include <zlib.h>

#include "lua.h"
#include "lauxlib.h"
#include "tally.h"
#include "cli.h"

/* The server: one per serve() call, on the C stack. */
typedef struct httpd {
  lua_State *L;
  int handler;              /* registry refs */
  int busy;                 /* a producer said "not yet": poll without waiting */
  int after;                /* registry ref of opts.after, or LUA_NOREF */
  long long after_at;       /* when to call it (ms, CLOCK_MONOTONIC), 0: not due */
  lua_Integer body_timeout; /* idle seconds allowed a connection whose body is made */
} httpd;

/* Per TCP connection (MHD's socket context): what the current request's
 * URI held that its unescaped form cannot show: a bad escape seen while
 * MHD unescaped the path or query, a %00 in the path. */
typedef struct conn_state {
  int bad_escape;
  int nul_in_path;
} conn_state;

/* A streamed body: pieces from a Lua producer, gzipped or not, queued in
 * out[] until MHD asks for them. */
typedef struct stream {
  httpd *h;
  int ref; /* the producer */
  int gzip, done;
  z_stream z;
  char *out;
  size_t len, off, cap;
} stream;

static long long now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int sig_pipe[2] = {-1, -1};
static volatile sig_atomic_t sig_got;

static void on_signal(int sig) {
  int saved = errno;
  sig_got = sig;
  if (write(sig_pipe[1], "x", 1) < 0) { /* full: a byte is there already */
  }
  errno = saved;
}

/* ---- requests ------------------------------------------------------------- */

static void on_connection(void *cls, struct MHD_Connection *c, void **ctx,
                          enum MHD_ConnectionNotificationCode toe) {
  (void)cls;
  (void)c;
  if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
    *ctx = calloc(1, sizeof(conn_state)); /* NULL: escapes go unchecked */
  } else {
    free(*ctx);
    *ctx = NULL;
  }
}

static int hexdigit(char c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

/* MHD's own unescaping, after noting a '%' not followed by two hex digits. */
static size_t unescape(void *cls, struct MHD_Connection *c, char *s) {
  const union MHD_ConnectionInfo *ci =
      MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
  const char *p;
  (void)cls;
  for (p = strchr(s, '%'); p != NULL; p = strchr(p + 1, '%')) {
    if (!hexdigit(p[1]) || !hexdigit(p[2])) {
      if (ci != NULL && ci->socket_context != NULL)
        ((conn_state *)ci->socket_context)->bad_escape = 1;
      break;
    }
  }
  return MHD_http_unescape(s);
}

/* One query parameter into the table on top, with all its bytes (a %00
 * kept, not cut there); one given more than once becomes the list of its
 * values, which the handler refuses rather than pick one. */
static enum MHD_Result add_arg(void *cls, enum MHD_ValueKind kind, const char *key,
                               size_t key_size, const char *value, size_t value_size) {
  lua_State *L = (lua_State *)cls;
  (void)kind;
  lua_pushlstring(L, key, key_size);
  lua_pushvalue(L, -1);
  switch (lua_rawget(L, -3)) {
  case LUA_TNIL:
    lua_pop(L, 1);
    lua_pushlstring(L, value != NULL ? value : "", value != NULL ? value_size : 0);
    break;
  case LUA_TSTRING: /* the second: the list of both */
    lua_createtable(L, 2, 0);
    lua_insert(L, -2);
    lua_rawseti(L, -2, 1);
    /* fall through */
  default:
    lua_pushlstring(L, value != NULL ? value : "", value != NULL ? value_size : 0);
    lua_rawseti(L, -2, (lua_Integer)lua_rawlen(L, -2) + 1);
  }
  lua_rawset(L, -3);
  return MHD_YES;
}

static void setheader(lua_State *L, struct MHD_Connection *c, const char *h,
                      const char *field) {
  const char *v = MHD_lookup_connection_value(c, MHD_HEADER_KIND, h);
  if (v != NULL) {
    lua_pushstring(L, v);
    lua_setfield(L, -2, field);
  }
}

/* Whether MHD's decoded Basic user and password (C strings) are all the
 * credentials hold: the length the header's base64 decodes to must be
 * theirs and the ':', or a NUL cut them short ("user:pass<NUL>x"). */
static int basic_whole(struct MHD_Connection *c, const char *user, const char *pass) {
  static const char basic[] = "Basic ";
  const char *v;
  size_t len, n;
  if (MHD_lookup_connection_value_n(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION,
                                    strlen(MHD_HTTP_HEADER_AUTHORIZATION), &v,
                                    &len) != MHD_YES ||
      v == NULL || len < sizeof basic - 1 || memcmp(v, basic, sizeof basic - 1) != 0)
    return 0;
  v += sizeof basic - 1, n = len - (sizeof basic - 1);
  size_t pad = n > 0 && v[n - 1] == '=' ? 1 + (n > 1 && v[n - 2] == '=') : 0;
  return n % 4 == 0 &&
         n / 4 * 3 - pad == strlen(user) + (pass != NULL ? 1 + strlen(pass) : 0);
}

/* The raw URI, before MHD unescapes anything (MHD_OPTION_URI_LOG_CALLBACK,
 * called first for each request): the handler gets the path as a C
 * string, which a %00 would end, so /metrics%00junk would be served as
 * /metrics. A query keeps its %00 (add_arg has each value's length). */
static void *raw_uri(void *cls, const char *uri, struct MHD_Connection *c) {
  const union MHD_ConnectionInfo *ci =
      MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
  conn_state *cs = ci != NULL ? (conn_state *)ci->socket_context : NULL;
  (void)cls;
  if (cs != NULL) {
    size_t n = strcspn(uri, "?");
    *cs = (conn_state){0}; /* a request begins: nothing seen yet */
    for (const char *p = uri; p + 3 <= uri + n; p++)
      if (p[0] == '%' && p[1] == '0' && p[2] == '0') cs->nul_in_path = 1;
  }
  return NULL; /* on_request's *req: the request's first call */
}

/* The request as the handler's table, on top of the stack. */
static void push_request(lua_State *L, struct MHD_Connection *c, const char *url,
                         const char *method) {
  const union MHD_ConnectionInfo *ci =
      MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
  const union MHD_ConnectionInfo *ai =
      MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
  conn_state *cs = ci != NULL ? (conn_state *)ci->socket_context : NULL;
  lua_createtable(L, 0, 8);
  lua_pushstring(L, method);
  lua_setfield(L, -2, "method");
  lua_pushstring(L, url);
  lua_setfield(L, -2, "path");
  lua_newtable(L);
  MHD_get_connection_values_n(c, MHD_GET_ARGUMENT_KIND, add_arg, L);
  lua_setfield(L, -2, "query");
  if (cs != NULL && cs->bad_escape) {
    lua_pushboolean(L, 1);
    lua_setfield(L, -2, "bad_escape");
  }
  if (cs != NULL && cs->nul_in_path) {
    lua_pushboolean(L, 1);
    lua_setfield(L, -2, "nul_in_path");
  }
  setheader(L, c, MHD_HTTP_HEADER_AUTHORIZATION, "authorization");
  { /* Basic credentials, decoded by MHD */
    char *pass = NULL, *user = MHD_basic_auth_get_username_password(c, &pass);
    if (user != NULL && basic_whole(c, user, pass)) {
      lua_pushstring(L, user);
      lua_setfield(L, -2, "user");
      lua_pushstring(L, pass != NULL ? pass : "");
      lua_setfield(L, -2, "password");
    }
    MHD_free(user);
    MHD_free(pass);
  }
  setheader(L, c, MHD_HTTP_HEADER_ACCEPT_ENCODING, "accept_encoding");
  if (ai != NULL && ai->client_addr != NULL) {
    char host[NI_MAXHOST];
    const struct sockaddr *sa = ai->client_addr;
    socklen_t len = sa->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6)
                                              : sizeof(struct sockaddr_in);
    if (getnameinfo(sa, len, host, sizeof host, NULL, 0, NI_NUMERICHOST) == 0) {
      lua_pushstring(L, host);
      lua_setfield(L, -2, "remote");
    }
  }
}

/* ---- bodies ---------------------------------------------------------------- */

/* Room for n more bytes in s->out (what was sent is dropped first). */
static int reserve(stream *s, size_t n) {
  if (s->off > 0) {
    memmove(s->out, s->out + s->off, s->len - s->off);
    s->len -= s->off;
    s->off = 0;
  }
  if (s->len + n > s->cap) {
    size_t cap = s->cap ? s->cap : 16384;
    char *p;
    while (cap < s->len + n) cap *= 2;
    p = (char *)realloc(s->out, cap);
    if (p == NULL) return -1;
    s->out = p;
    s->cap = cap;
  }
  return 0;
}

/* Queue piece (or, with gzip, its deflated form; finish: the trailer). */
static int queue(stream *s, const char *piece, size_t n, int finish) {
  if (!s->gzip) {
    if (reserve(s, n) < 0) return -1;
    memcpy(s->out + s->len, piece, n);
    s->len += n;
    return 0;
  }
  s->z.next_in = (Bytef *)piece;
  s->z.avail_in = (uInt)n;
  for (;;) {
    size_t room;
    int rc;
    if (reserve(s, 16384) < 0) return -1;
    room = s->cap - s->len;
    s->z.next_out = (Bytef *)(s->out + s->len);
    s->z.avail_out = (uInt)room;
    rc = deflate(&s->z, finish ? Z_FINISH : Z_NO_FLUSH);
    if (rc == Z_STREAM_ERROR) return -1;
    s->len += room - s->z.avail_out;
    if (finish ? rc == Z_STREAM_END : s->z.avail_in == 0 && s->z.avail_out > 0) return 0;
  }
}

/* The next piece from the producer: 1 queued (maybe nothing: "not yet"),
 * 0 at its end, -1 on an error (logged). */
static int pull(stream *s) {
  lua_State *L = s->h->L;
  size_t n;
  const char *piece;
  int rc = 1;
  lua_rawgeti(L, LUA_REGISTRYINDEX, s->ref);
  if (lua_pcall(L, 0, 1, 0) != LUA_OK) {
    fprintf(stderr, "%s serve: a response failed: %s\n", CLI_PROGNAME,
            lua_tostring(L, -1) ? lua_tostring(L, -1) : "(no message)");
    lua_pop(L, 1);
    return -1;
  }
  if (lua_isnil(L, -1)) {
    rc = queue(s, "", 0, 1) < 0 ? -1 : 0;
  } else if ((piece = lua_tolstring(L, -1, &n)) != NULL) {
    if (n == 0)
      s->h->busy = 1;
    else if (queue(s, piece, n, 0) < 0)
      rc = -1;
  } else {
    fprintf(stderr, "%s serve: a response's producer gave a %s\n", CLI_PROGNAME,
            luaL_typename(L, -1));
    rc = -1;
  }
  lua_pop(L, 1);
  return rc;
}

static ssize_t read_body(void *cls, uint64_t pos, char *buf, size_t max) {
  stream *s = (stream *)cls;
  (void)pos;
  while (s->off == s->len) {
    int rc;
    if (s->done) return MHD_CONTENT_READER_END_OF_STREAM;
    rc = pull(s);
    if (rc < 0) return MHD_CONTENT_READER_END_WITH_ERROR;
    if (rc == 0) s->done = 1;
    if (rc == 1 && s->off == s->len) return 0; /* not yet: the loop calls again */
  }
  if (max > s->len - s->off) max = s->len - s->off;
  memcpy(buf, s->out + s->off, max);
  s->off += max;
  return (ssize_t)max;
}

static void free_body(void *cls) {
  stream *s = (stream *)cls;
  luaL_unref(s->h->L, LUA_REGISTRYINDEX, s->ref);
  if (s->gzip) deflateEnd(&s->z);
  free(s->out);
  free(s);
}

/* A stream for the value at idx (a producer, or a string made one), with
 * gzip framing (windowBits 15 + 16) when asked. NULL if out of memory. */
static stream *new_stream(httpd *h, int idx, int gzip) {
  lua_State *L = h->L;
  stream *s = (stream *)calloc(1, sizeof *s);
  if (s == NULL) return NULL;
  s->h = h;
  s->gzip = gzip;
  if (gzip &&
      deflateInit2(&s->z, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) != Z_OK) {
    free(s);
    return NULL;
  }
  if (lua_type(L, idx) == LUA_TSTRING) { /* a string to gzip: all queued now */
    size_t n;
    const char *body = lua_tolstring(L, idx, &n);
    s->ref = LUA_NOREF;
    s->done = 1;
    if (queue(s, body, n, 1) < 0) {
      free_body(s);
      return NULL;
    }
    return s;
  }
  lua_pushvalue(L, idx);
  s->ref = luaL_ref(L, LUA_REGISTRYINDEX);
  return s;
}

static enum MHD_Result fail_500(struct MHD_Connection *c) {
  static const char msg[] = "internal error: see the server's log\n";
  struct MHD_Response *r = MHD_create_response_from_buffer(sizeof msg - 1, (void *)msg,
                                                           MHD_RESPMEM_PERSISTENT);
  enum MHD_Result ret;
  if (r == NULL) return MHD_NO;
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/plain; charset=utf-8");
  ret = MHD_queue_response(c, 500, r);
  MHD_destroy_response(r);
  return ret;
}

/* Call the handler and queue what it answers. */
static enum MHD_Result respond(httpd *h, struct MHD_Connection *c, const char *url,
                               const char *method) {
  lua_State *L = h->L;
  int top = lua_gettop(L), status, gzip;
  struct MHD_Response *r = NULL;
  enum MHD_Result ret;
  if (h->after != LUA_NOREF) h->after_at = now_ms() + 1000;
  lua_rawgeti(L, LUA_REGISTRYINDEX, h->handler);
  push_request(L, c, url, method);
  if (lua_pcall(L, 1, 4, 0) != LUA_OK) {
    /* the path and the message may hold the request's bytes: escaped, so
     * that a client cannot forge a log line or drive a terminal */
    char shown_url[512], shown_msg[1024];
    const char *msg = lua_tostring(L, -1) ? lua_tostring(L, -1) : "(no message)";
    tally_printable(shown_url, sizeof shown_url, url, strlen(url));
    tally_printable(shown_msg, sizeof shown_msg, msg, strlen(msg));
    fprintf(stderr, "%s serve: %s %s: %s\n", CLI_PROGNAME, method, shown_url, shown_msg);
    lua_settop(L, top);
    return fail_500(c);
  }
  status = (int)lua_tointeger(L, top + 1);
  gzip = lua_toboolean(L, top + 4);
  if (lua_type(L, top + 3) == LUA_TSTRING && !gzip) {
    size_t n;
    const char *body = lua_tolstring(L, top + 3, &n);
    r = MHD_create_response_from_buffer(n, (void *)body, MHD_RESPMEM_MUST_COPY);
  } else if (lua_type(L, top + 3) == LUA_TSTRING || lua_isfunction(L, top + 3)) {
    stream *s = new_stream(h, top + 3, gzip);
    /* a body still being made (a producer that says "not yet") sends
     * nothing for a while: the idle timeout must not cut it */
    if (lua_isfunction(L, top + 3))
      MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT,
                                (unsigned)h->body_timeout);
    if (s != NULL) {
      r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, read_body, s,
                                            free_body);
      if (r == NULL) free_body(s);
    }
  } else {
    r = MHD_create_response_from_buffer(0, (void *)"", MHD_RESPMEM_PERSISTENT);
  }
  if (r == NULL) {
    lua_settop(L, top);
    return MHD_NO;
  }
  if (lua_istable(L, top + 2)) {
    lua_pushnil(L);
    while (lua_next(L, top + 2) != 0) {
      if (lua_type(L, -2) == LUA_TSTRING && lua_type(L, -1) == LUA_TSTRING)
        MHD_add_response_header(r, lua_tostring(L, -2), lua_tostring(L, -1));
      lua_pop(L, 1);
    }
  }
  if (gzip) MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_ENCODING, "gzip");
  ret = MHD_queue_response(c, (unsigned)status, r);
  MHD_destroy_response(r);
  lua_settop(L, top);
  return ret;
}

/* Whether the request says a body follows its headers. */
static int has_body(struct MHD_Connection *c) {
  const char *len =
      MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
  return (len != NULL && strspn(len, "0") != strlen(len)) ||
         MHD_lookup_connection_value(c, MHD_HEADER_KIND,
                                     MHD_HTTP_HEADER_TRANSFER_ENCODING) != NULL;
}

/* MHD calls this once the headers are in, then once the body is (empty:
 * at once). A request without a body is answered at the second call, so
 * that the connection can stay open for the next (HTTP keep-alive: MHD
 * closes one whose answer came before the request's end). One with a
 * body, which nothing here reads, is answered at the first and the
 * connection closed after it. */
static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version,
                                  const char *upload, size_t *upload_size, void **req) {
  (void)version;
  (void)upload;
  static char headers_in, answered; /* what *req points at */
  int first = *req == NULL;
  if ((first && has_body(c)) || (*req == &headers_in && *upload_size == 0)) {
    *req = &answered;
    *upload_size = 0;
    return respond((httpd *)cls, c, url, method);
  }
  if (first) { /* the headers are in: answered at the request's end */
    *req = &headers_in;
    return MHD_YES;
  }
  *upload_size = 0; /* a body after the answer: dropped */
  return MHD_YES;
}

static void on_log(void *cls, const char *fm, va_list ap) {
  (void)cls;
  fprintf(stderr, "%s serve: ", CLI_PROGNAME);
  vfprintf(stderr, fm, ap);
}

/* ---- the loop ------------------------------------------------------------ */

static lua_Integer optint(lua_State *L, const char *k, lua_Integer def) {
  lua_Integer v;
  lua_getfield(L, 1, k);
  v = luaL_optinteger(L, -1, def);
  lua_pop(L, 1);
  return v;
}

static int h_serve(lua_State *L) {
  httpd h;
  struct addrinfo hints, *ai = NULL;
  struct MHD_Daemon *d;
  const union MHD_DaemonInfo *info;
  struct sigaction sa, old_term, old_int;
  char portbuf[16];
  const char *host;
  unsigned flags = MHD_USE_EPOLL | MHD_USE_ERROR_LOG;
  int epfd, rc, stopped = 0;
  lua_Integer port = optint(L, "port", 9145);
  lua_Integer niceness = optint(L, "nice", 0);
  luaL_checktype(L, 1, LUA_TTABLE);
  luaL_checktype(L, 2, LUA_TFUNCTION);
  lua_getfield(L, 1, "host");
  host = luaL_optstring(L, -1, "127.0.0.1");
  if (port < 0 || port > 65535) return luaL_error(L, "port must be 0 to 65535");
  snprintf(portbuf, sizeof portbuf, "%d", (int)port);
  memset(&hints, 0, sizeof hints);
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV | AI_PASSIVE;
  hints.ai_socktype = SOCK_STREAM;
  if ((rc = getaddrinfo(host, portbuf, &hints, &ai)) != 0) {
    lua_pushnil(L);
    lua_pushfstring(L, "bad listen address '%s': %s", host, gai_strerror(rc));
    return 2;
  }
  if (ai->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
  /* Below the writers: where they keep every CPU busy, the scheduler
   * gives them what a scrape would take (a process may always lower its
   * own priority; one already lower is left so) */
  if (niceness > 0) {
    errno = 0;
    int cur = getpriority(PRIO_PROCESS, 0);
    if (errno == 0 && cur < niceness) setpriority(PRIO_PROCESS, 0, (int)niceness);
  }

  if (sig_pipe[0] < 0 && pipe2(sig_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    freeaddrinfo(ai);
    return luaL_error(L, "pipe: %s", strerror(errno));
  }
  h.L = L;
  h.busy = 0;
  h.body_timeout = optint(L, "body_timeout", 300);
  h.after = LUA_NOREF;
  h.after_at = 0;
  lua_getfield(L, 1, "after");
  if (lua_isfunction(L, -1))
    h.after = luaL_ref(L, LUA_REGISTRYINDEX);
  else
    lua_pop(L, 1);
  lua_pushvalue(L, 2);
  h.handler = luaL_ref(L, LUA_REGISTRYINDEX);

  d = MHD_start_daemon(
      flags, (uint16_t)port, NULL, NULL, on_request, &h, MHD_OPTION_EXTERNAL_LOGGER,
      on_log, NULL, MHD_OPTION_SOCK_ADDR, ai->ai_addr, MHD_OPTION_CONNECTION_LIMIT,
      (unsigned)optint(L, "connections", 256), MHD_OPTION_PER_IP_CONNECTION_LIMIT,
      (unsigned)optint(L, "per_ip", 32), MHD_OPTION_CONNECTION_TIMEOUT,
      (unsigned)optint(L, "timeout", 10), MHD_OPTION_CONNECTION_MEMORY_LIMIT,
      (size_t)optint(L, "memory", 32768), MHD_OPTION_LISTEN_BACKLOG_SIZE, 128u,
      MHD_OPTION_NOTIFY_CONNECTION, on_connection, NULL, MHD_OPTION_UNESCAPE_CALLBACK,
      unescape, NULL, MHD_OPTION_URI_LOG_CALLBACK, raw_uri, NULL, MHD_OPTION_END);
  freeaddrinfo(ai);
  if (d == NULL) {
    int e = errno;
    luaL_unref(L, LUA_REGISTRYINDEX, h.handler);
    lua_pushnil(L);
    lua_pushfstring(L, "cannot listen on %s port %d: %s", host, (int)port,
                    e ? strerror(e) : "libmicrohttpd refused to start");
    return 2;
  }
  info = MHD_get_daemon_info(d, MHD_DAEMON_INFO_EPOLL_FD);
  epfd = info != NULL ? info->epoll_fd : -1;

  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sig_got = 0;
  sigaction(SIGTERM, &sa, &old_term);
  sigaction(SIGINT, &sa, &old_int);
  signal(SIGPIPE, SIG_IGN);

  if (lua_isfunction(L, 3)) {
    info = MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT);
    lua_pushvalue(L, 3);
    lua_pushinteger(L, info != NULL ? info->port : port);
    if (lua_pcall(L, 1, 0, 0) != LUA_OK) {
      fprintf(stderr, "%s serve: %s\n", CLI_PROGNAME, lua_tostring(L, -1));
      lua_pop(L, 1);
    }
  }

  while (!stopped) {
    struct pollfd p[2];
    MHD_UNSIGNED_LONG_LONG to;
    int ms = -1;
    if (MHD_get_timeout(d, &to) == MHD_YES) ms = to > 60000 ? 60000 : (int)to;
    if (h.after_at != 0) {
      long long wait = h.after_at - now_ms();
      if (wait < 0) wait = 0;
      if (ms < 0 || wait < ms) ms = (int)wait;
    }
    if (h.busy) ms = 0;
    h.busy = 0;
    p[0].fd = epfd;
    p[0].events = POLLIN;
    p[1].fd = sig_pipe[0];
    p[1].events = POLLIN;
    if (poll(p, 2, ms) < 0 && errno != EINTR) break;
    if (p[1].revents & POLLIN) {
      char buf[16];
      while (read(sig_pipe[0], buf, sizeof buf) > 0) {}
      if (sig_got != 0) stopped = sig_got;
    }
    if (!stopped) MHD_run(d);
    if (!stopped && h.after_at != 0 && now_ms() >= h.after_at) {
      h.after_at = 0;
      lua_rawgeti(L, LUA_REGISTRYINDEX, h.after);
      if (lua_pcall(L, 0, 1, 0) != LUA_OK)
        fprintf(stderr, "%s serve: %s\n", CLI_PROGNAME, lua_tostring(L, -1));
      else if (lua_toboolean(L, -1))
        h.after_at = now_ms() + 1000;
      lua_pop(L, 1);
    }
  }
  sigaction(SIGTERM, &old_term, NULL);
  sigaction(SIGINT, &old_int, NULL);
  MHD_stop_daemon(d); /* closes connections; their bodies are freed here */
  luaL_unref(L, LUA_REGISTRYINDEX, h.handler);
  luaL_unref(L, LUA_REGISTRYINDEX, h.after);
  lua_pushstring(L, stopped == SIGINT    ? "SIGINT"
                    : stopped == SIGTERM ? "SIGTERM"
                                         : "error");
  return 1;
}

int cli_open_httpd(lua_State *L) {
  static const luaL_Reg fns[] = {{"serve", h_serve}, {NULL, NULL}};
  luaL_newlib(L, fns);
  return 1;
}
