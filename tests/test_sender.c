/* test_sender.c -- the HTTP sender against a tiny HTTP server in this process.
 *
 * The server listens on 127.0.0.1 (a port the kernel picks), runs one
 * thread per connection (connections are kept alive) and logs every
 * request it reads: method, path, two headers and the body, with the
 * answer it gave. What it answers is set at any time: 200, 500, or nothing
 * at all (it holds the request until the client goes away, so a client's
 * timeout always fires first). A dead sink is a port that is bound but not
 * listening, so connections to it are refused. Every wait in the server
 * and in the checks is bounded; the whole test takes a few seconds.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <strings.h>
#include <sys/socket.h>

#include "tally_net.h"
#include "testutil.h"

enum {
  ANSWER_NONE = 0,
  ANSWER_OK = 200,
  ANSWER_MOVED = 301, /* with a Location */
  ANSWER_REFUSED = 400,
  ANSWER_BUSY = 429, /* with Retry-After: 1 */
  ANSWER_ERROR = 500
};

#define SRV_MAX_REQS   1024
#define SRV_MAX_CONNS  64
#define SRV_LIFETIME_S 30.0
#define SRV_BUF_BYTES  (1u << 20)

typedef struct srv_req {
  char method[8];
  char path[64];
  char content_type[64];
  char test_header[64];
  char *body;
  size_t len;
  int answer; /* ANSWER_*: what this request got */
} srv_req;

typedef struct server server;

typedef struct srv_conn {
  server *srv;
  int fd;
  pthread_t thread;
} srv_conn;

struct server {
  int listen_fd;
  int port;
  char url[64];
  atomic_int answer; /* ANSWER_* for requests from now on */
  atomic_int stop;
  double started;
  pthread_t acceptor;
  pthread_mutex_t mu; /* guards what follows */
  srv_req reqs[SRV_MAX_REQS];
  int nreqs;
  int nconns;
  srv_conn conns[SRV_MAX_CONNS];
};

static int srv_running(server *srv) {
  return !atomic_load(&srv->stop) && tu_now() - srv->started < SRV_LIFETIME_S;
}

/* recv once fd is readable: bytes read, 0 at EOF, -1 on error or stop. */
static ssize_t srv_recv(server *srv, int fd, char *buf, size_t cap) {
  while (srv_running(srv)) {
    struct pollfd p = {fd, POLLIN, 0};
    int n = poll(&p, 1, 50);
    if (n < 0 && errno != EINTR) return -1;
    if (n > 0) return recv(fd, buf, cap, 0);
  }
  return -1;
}

static int srv_send(int fd, const char *s) {
  size_t len = strlen(s);
  return send(fd, s, len, MSG_NOSIGNAL) == (ssize_t)len ? 0 : -1;
}

/* Header `name` of the head (a NUL-terminated request head) into out. */
static void srv_header(const char *head, const char *name, char *out, size_t cap) {
  size_t nlen = strlen(name);
  const char *line = strstr(head, "\r\n");
  out[0] = '\0';
  while (line && line[2] != '\r' && line[2] != '\0') {
    const char *start = line + 2, *end = strstr(start, "\r\n");
    if (!end) return;
    if ((size_t)(end - start) > nlen && start[nlen] == ':' &&
        strncasecmp(start, name, nlen) == 0) {
      const char *v = start + nlen + 1;
      while (*v == ' ') v++;
      snprintf(out, cap, "%.*s", (int)(end - v), v);
      return;
    }
    line = end;
  }
}

static void *srv_conn_main(void *arg) {
  srv_conn *c = arg;
  server *srv = c->srv;
  char *buf = malloc(SRV_BUF_BYTES + 1);
  size_t have = 0;

  while (buf) {
    char *end, clen[32], expect[32];
    size_t head_len, body_len;
    ssize_t n;
    int answer;

    buf[have] = '\0';
    while ((end = memmem(buf, have, "\r\n\r\n", 4)) == NULL) {
      if (have == SRV_BUF_BYTES) goto out;
      n = srv_recv(srv, c->fd, buf + have, SRV_BUF_BYTES - have);
      if (n <= 0) goto out;
      have += (size_t)n;
    }
    head_len = (size_t)(end - buf) + 4;
    end[2] = '\0'; /* the head, as a string ending in its last CRLF */
    srv_header(buf, "Content-Length", clen, sizeof clen);
    srv_header(buf, "Expect", expect, sizeof expect);
    body_len = (size_t)strtoul(clen, NULL, 10);
    if (head_len + body_len > SRV_BUF_BYTES) goto out;
    if (strcasecmp(expect, "100-continue") == 0 && have < head_len + body_len &&
        srv_send(c->fd, "HTTP/1.1 100 Continue\r\n\r\n") != 0)
      goto out;
    while (have < head_len + body_len) {
      n = srv_recv(srv, c->fd, buf + have, SRV_BUF_BYTES - have);
      if (n <= 0) goto out;
      have += (size_t)n;
    }

    answer = atomic_load(&srv->answer);
    pthread_mutex_lock(&srv->mu);
    if (srv->nreqs < SRV_MAX_REQS) {
      srv_req *r = &srv->reqs[srv->nreqs++];
      sscanf(buf, "%7s %63s", r->method, r->path);
      srv_header(buf, "Content-Type", r->content_type, sizeof r->content_type);
      srv_header(buf, "X-Tally-Test", r->test_header, sizeof r->test_header);
      r->body = malloc(body_len + 1);
      if (r->body) {
        memcpy(r->body, buf + head_len, body_len);
        r->body[body_len] = '\0';
      }
      r->len = body_len;
      r->answer = answer;
    }
    pthread_mutex_unlock(&srv->mu);

    if (answer == ANSWER_NONE) { /* hold it until the client gives up */
      char sink[256];
      while (srv_recv(srv, c->fd, sink, sizeof sink) > 0) {}
      goto out;
    }
    if (srv_send(c->fd, answer == ANSWER_OK
                            ? "HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n"
                        : answer == ANSWER_REFUSED
                            ? "HTTP/1.1 400 Bad Request\r\nContent-Length: 4\r\n\r\nbad\n"
                        : answer == ANSWER_MOVED
                            ? "HTTP/1.1 301 Moved Permanently\r\nLocation: "
                              "http://127.0.0.1:9/elsewhere\r\nContent-Length: 0\r\n\r\n"
                        : answer == ANSWER_BUSY
                            ? "HTTP/1.1 429 Too Many Requests\r\nRetry-After: 1\r\n"
                              "Content-Length: 5\r\n\r\nbusy\n"
                            : "HTTP/1.1 500 Internal Server Error\r\n"
                              "Content-Length: 5\r\n\r\nfail\n") != 0)
      goto out;
    memmove(buf, buf + head_len + body_len, have - head_len - body_len);
    have -= head_len + body_len;
  }
out:
  free(buf);
  close(c->fd);
  return NULL;
}

static void *srv_accept_main(void *arg) {
  server *srv = arg;
  while (srv_running(srv)) {
    struct pollfd p = {srv->listen_fd, POLLIN, 0};
    int fd;
    if (poll(&p, 1, 50) <= 0) continue;
    fd = accept(srv->listen_fd, NULL, NULL);
    if (fd < 0) continue;
    pthread_mutex_lock(&srv->mu);
    if (srv->nconns < SRV_MAX_CONNS) {
      srv_conn *c = &srv->conns[srv->nconns];
      c->srv = srv;
      c->fd = fd;
      if (pthread_create(&c->thread, NULL, srv_conn_main, c) == 0) {
        srv->nconns++;
        fd = -1;
      }
    }
    pthread_mutex_unlock(&srv->mu);
    if (fd >= 0) close(fd);
  }
  return NULL;
}

/* A socket bound to an ephemeral port of 127.0.0.1; its port into *port. */
static int bound_socket(int *port) {
  struct sockaddr_in a;
  socklen_t alen = sizeof a;
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 ||
      getsockname(fd, (struct sockaddr *)&a, &alen) != 0) {
    perror("test_sender: socket");
    exit(1);
  }
  *port = ntohs(a.sin_port);
  return fd;
}

static server *server_start(int answer) {
  server *srv = calloc(1, sizeof *srv);
  if (!srv) exit(1);
  srv->listen_fd = bound_socket(&srv->port);
  if (listen(srv->listen_fd, 64) != 0) {
    perror("test_sender: listen");
    exit(1);
  }
  snprintf(srv->url, sizeof srv->url, "http://127.0.0.1:%d/ingest", srv->port);
  atomic_init(&srv->answer, answer);
  atomic_init(&srv->stop, 0);
  srv->started = tu_now();
  pthread_mutex_init(&srv->mu, NULL);
  if (pthread_create(&srv->acceptor, NULL, srv_accept_main, srv) != 0) exit(1);
  return srv;
}

static void server_stop(server *srv) {
  atomic_store(&srv->stop, 1);
  pthread_join(srv->acceptor, NULL);
  for (int i = 0; i < srv->nconns; i++) pthread_join(srv->conns[i].thread, NULL);
  close(srv->listen_fd);
  for (int i = 0; i < srv->nreqs; i++) free(srv->reqs[i].body);
  pthread_mutex_destroy(&srv->mu);
  free(srv);
}

static int server_count(server *srv, int answer) {
  int n = 0;
  pthread_mutex_lock(&srv->mu);
  for (int i = 0; i < srv->nreqs; i++) n += srv->reqs[i].answer == answer;
  pthread_mutex_unlock(&srv->mu);
  return n;
}

static int server_conns(server *srv) {
  pthread_mutex_lock(&srv->mu);
  int n = srv->nconns;
  pthread_mutex_unlock(&srv->mu);
  return n;
}

/* The bodies answered 200 must be exactly want[0..n), in that order. */
static void expect_delivered(server *srv, const char *const *want, int n,
                             const char *label) {
  int got = 0;
  pthread_mutex_lock(&srv->mu);
  for (int i = 0; i < srv->nreqs; i++) {
    srv_req *r = &srv->reqs[i];
    if (r->answer != ANSWER_OK) continue;
    atomic_fetch_add(&tu_checks, 1);
    if (got >= n)
      TU_FAIL("%s: extra body delivered: '%.*s'", label, (int)r->len, r->body);
    else if (r->len != strlen(want[got]) || memcmp(r->body, want[got], r->len) != 0)
      TU_FAIL("%s: body %d is '%.*s', expected '%s'", label, got, (int)r->len, r->body,
              want[got]);
    got++;
  }
  pthread_mutex_unlock(&srv->mu);
  if (got != n) TU_FAIL("%s: %d bodies delivered, expected %d", label, got, n);
}

/* ---- helpers on the sender side ---------------------------------------- */

static tally_sender_stats stats_of(tally_sender *s) {
  tally_sender_stats st;
  tally_sender_stats_get(s, &st);
  return st;
}

/* Wait up to timeout_s for failures >= n; the stats seen last. */
static tally_sender_stats wait_failures(tally_sender *s, uint64_t n, double timeout_s) {
  double t0 = tu_now();
  tally_sender_stats st = stats_of(s);
  while (st.failures < n && tu_now() - t0 < timeout_s) {
    usleep(2000);
    st = stats_of(s);
  }
  if (st.failures < n)
    TU_FAIL("waited %.1f s for %llu failures, saw %llu", timeout_s, (unsigned long long)n,
            (unsigned long long)st.failures);
  return st;
}

static void wait_requests(server *srv, int answer, int n, double timeout_s) {
  double t0 = tu_now();
  while (server_count(srv, answer) < n && tu_now() - t0 < timeout_s) usleep(2000);
  if (server_count(srv, answer) < n)
    TU_FAIL("waited %.1f s for %d requests answered %d", timeout_s, n, answer);
}

static tally_sender *open_sender(const char *url, const char *method,
                                 const char *const *headers, uint32_t timeout_ms,
                                 uint32_t max_queue, uint32_t backoff_ms,
                                 uint32_t max_backoff_ms) {
  tally_sender_options o = {url,       method,     headers,       timeout_ms,
                            max_queue, backoff_ms, max_backoff_ms};
  tally_sender *s = NULL;
  REQUIRE_OK(tally_sender_open(&o, &s));
  return s;
}

static int post_str(tally_sender *s, const char *body, uint32_t records) {
  return tally_sender_post(s, body, strlen(body), records);
}

/* ---- the cases -------------------------------------------------------------- */

static void test_bad_options(void) {
  static const char *const no_colon[] = {"X-Tally-Test", NULL};
  static const char *const no_name[] = {": value", NULL};
  static const char *const two_lines[] = {"X-A: 1\r\nX-B: 2", NULL};
  tally_sender *s = (tally_sender *)&s; /* must stay untouched on failure */
  tally_sender_options o;
  int port, fd = bound_socket(&port);
  char url[64];
  snprintf(url, sizeof url, "http://127.0.0.1:%d/x", port);

  memset(&o, 0, sizeof o);
  EXPECT_RC(TALLY_EINVAL, tally_sender_open(NULL, &s));
  EXPECT_RC(TALLY_EINVAL, tally_sender_open(&o, &s));
  EXPECT(strstr(tally_errmsg(), "url") != NULL);
  o.url = "ftp://127.0.0.1/x";
  EXPECT_RC(TALLY_EINVAL, tally_sender_open(&o, &s));
  EXPECT(strstr(tally_errmsg(), "http://") != NULL);
  o.url = "127.0.0.1:80/x";
  EXPECT_RC(TALLY_EINVAL, tally_sender_open(&o, &s));
  o.url = url;
  EXPECT_RC(TALLY_EINVAL, tally_sender_open(&o, NULL));
  o.method = "GET";
  EXPECT_RC(TALLY_EINVAL, tally_sender_open(&o, &s));
  EXPECT(strstr(tally_errmsg(), "method") != NULL);
  o.method = "post"; /* methods are case-sensitive in HTTP */
  EXPECT_RC(TALLY_EINVAL, tally_sender_open(&o, &s));
  o.method = NULL;
  o.headers = no_colon;
  EXPECT_RC(TALLY_EINVAL, tally_sender_open(&o, &s));
  EXPECT(strstr(tally_errmsg(), "header") != NULL);
  o.headers = no_name;
  EXPECT_RC(TALLY_EINVAL, tally_sender_open(&o, &s));
  o.headers = two_lines;
  EXPECT_RC(TALLY_EINVAL, tally_sender_open(&o, &s));
  EXPECT(s == (tally_sender *)&s);

  /* a good sender refuses bad posts */
  o.headers = NULL;
  o.method = "PUT";
  REQUIRE_OK(tally_sender_open(&o, &s));
  EXPECT_RC(TALLY_EINVAL, tally_sender_post(s, "x", 1, 0));
  EXPECT(strstr(tally_errmsg(), "records") != NULL);
  EXPECT_RC(TALLY_EINVAL, tally_sender_post(s, NULL, 5, 1));
  EXPECT_RC(TALLY_EINVAL, tally_sender_post(NULL, "x", 1, 1));
  EXPECT_RC(TALLY_EINVAL, tally_sender_flush(NULL, 10));
  EXPECT_OK(tally_sender_flush(s, 0)); /* nothing queued */
  tally_sender_stats st = stats_of(s);
  EXPECT_I64(0, st.sent + st.failures + st.dropped + st.queued);
  EXPECT_STR("", st.last_error);
  tally_sender_stats_get(NULL, &st);
  EXPECT_I64(0, st.queued);
  tally_sender_stats_get(s, NULL);
  tally_sender_close(s, 0);
  tally_sender_close(NULL, 100);

  o.url = "HTTPS://127.0.0.1:1/x"; /* any case; nothing connects at open */
  o.method = NULL;
  REQUIRE_OK(tally_sender_open(&o, &s));
  tally_sender_close(s, 0);
  close(fd);
}

/* Bodies arrive intact, in order, once, with the method and headers given,
 * over one kept-alive connection. */
static void test_delivery(void) {
  static const char *const json_headers[] = {"Content-Type: application/json",
                                             "X-Tally-Test: delivery", NULL};
  static const char *const bin_headers[] = {"Content-Type: application/octet-stream",
                                            NULL};
  enum { N = 40 };
  char bodies[N][32];
  const char *want[N];
  uint64_t records = 0;
  server *srv = server_start(ANSWER_OK);
  tally_sender *s = open_sender(srv->url, NULL, json_headers, 2000, 0, 0, 0);

  for (int i = 0; i < N; i++) {
    snprintf(bodies[i], sizeof bodies[i], "{\"n\":%d}", i);
    want[i] = bodies[i];
    EXPECT_OK(post_str(s, bodies[i], (uint32_t)(i % 3 + 1)));
    records += (uint64_t)(i % 3 + 1);
  }
  EXPECT_OK(tally_sender_flush(s, 5000));
  tally_sender_stats st = stats_of(s);
  EXPECT_I64(records, st.sent);
  EXPECT_I64(N, st.requests);
  EXPECT_I64(0, st.failures);
  EXPECT_I64(0, st.dropped);
  EXPECT_I64(0, st.queued);
  EXPECT_I64(200, st.last_status);
  EXPECT_STR("", st.last_error);
  expect_delivered(srv, want, N, "delivery");
  pthread_mutex_lock(&srv->mu);
  for (int i = 0; i < srv->nreqs; i++) {
    EXPECT_STR("POST", srv->reqs[i].method);
    EXPECT_STR("/ingest", srv->reqs[i].path);
    EXPECT_STR("application/json", srv->reqs[i].content_type);
    EXPECT_STR("delivery", srv->reqs[i].test_header);
  }
  pthread_mutex_unlock(&srv->mu);
  EXPECT_I64(1, server_conns(srv)); /* keep-alive */
  tally_sender_close(s, 0);
  server_stop(srv);

  /* PUT, binary bodies with NULs, and one of 200 KiB */
  srv = server_start(ANSWER_OK);
  s = open_sender(srv->url, "PUT", bin_headers, 2000, 0, 0, 0);
  unsigned char bin[256];
  size_t big_len = 200 * 1024;
  unsigned char *big = malloc(big_len);
  for (int i = 0; i < 256; i++) bin[i] = (unsigned char)i;
  for (size_t i = 0; i < big_len; i++) big[i] = (unsigned char)(i * 7 + i / 251);
  EXPECT_OK(tally_sender_post(s, bin, sizeof bin, 1));
  EXPECT_OK(tally_sender_post(s, big, big_len, 2));
  EXPECT_OK(tally_sender_post(s, "", 0, 1));
  EXPECT_OK(tally_sender_flush(s, 5000));
  st = stats_of(s);
  EXPECT_I64(4, st.sent);
  EXPECT_I64(3, st.requests);
  pthread_mutex_lock(&srv->mu);
  EXPECT_I64(3, srv->nreqs);
  if (srv->nreqs == 3) {
    for (int i = 0; i < 3; i++) {
      EXPECT_STR("PUT", srv->reqs[i].method);
      EXPECT_STR("application/octet-stream", srv->reqs[i].content_type);
      EXPECT_STR("", srv->reqs[i].test_header);
    }
    EXPECT(srv->reqs[0].len == sizeof bin &&
           memcmp(srv->reqs[0].body, bin, sizeof bin) == 0);
    EXPECT(srv->reqs[1].len == big_len && memcmp(srv->reqs[1].body, big, big_len) == 0);
    EXPECT_I64(0, srv->reqs[2].len);
  }
  pthread_mutex_unlock(&srv->mu);
  tally_sender_close(s, 0);
  server_stop(srv);
  free(big);
}

/* Threads posting at once: every body delivered once, each thread's in order. */
enum { POSTERS = 4, PER_POSTER = 100 };

static void *poster_main(void *arg) {
  tally_sender *s = arg;
  static atomic_int next_id;
  int id = atomic_fetch_add(&next_id, 1);
  for (int i = 0; i < PER_POSTER; i++) {
    char body[32];
    snprintf(body, sizeof body, "%d:%d", id, i);
    EXPECT_OK(post_str(s, body, 1));
  }
  return NULL;
}

static void test_concurrent_posts(void) {
  server *srv = server_start(ANSWER_OK);
  tally_sender *s = open_sender(srv->url, NULL, NULL, 2000, 0, 0, 0);
  pthread_t t[POSTERS];
  int next[POSTERS] = {0};

  for (int i = 0; i < POSTERS; i++) pthread_create(&t[i], NULL, poster_main, s);
  for (int i = 0; i < POSTERS; i++) pthread_join(t[i], NULL);
  EXPECT_OK(tally_sender_flush(s, 8000));
  tally_sender_stats st = stats_of(s);
  EXPECT_I64(POSTERS * PER_POSTER, st.sent);
  EXPECT_I64(0, st.dropped);
  pthread_mutex_lock(&srv->mu);
  EXPECT_I64(POSTERS * PER_POSTER, srv->nreqs);
  for (int i = 0; i < srv->nreqs; i++) {
    int id = -1, seq = -1;
    if (sscanf(srv->reqs[i].body ? srv->reqs[i].body : "", "%d:%d", &id, &seq) != 2 ||
        id < 0 || id >= POSTERS || seq != next[id]) {
      TU_FAIL("concurrent: request %d out of order (%d:%d)", i, id, seq);
      break;
    }
    next[id]++;
  }
  pthread_mutex_unlock(&srv->mu);
  tally_sender_close(s, 0);
  server_stop(srv);
}

/* 500 answers: retried with a doubling backoff, oldest body first, until the
 * server recovers; then everything arrives exactly once. */
static void test_retry_500(void) {
  static const char *const want[] = {"b0", "b1", "b2", "b3", "b4"};
  server *srv = server_start(ANSWER_ERROR);
  tally_sender *s = open_sender(srv->url, NULL, NULL, 2000, 0, 40, 1000);
  tally_sender_stats st;

  for (int i = 0; i < 5; i++) EXPECT_OK(post_str(s, want[i], (uint32_t)i + 1));
  st = wait_failures(s, 3, 3.0);
  EXPECT_I64(0, st.sent);
  EXPECT_I64(0, st.requests);
  EXPECT_I64(500, st.last_status);
  EXPECT_STR("HTTP 500", st.last_error);
  EXPECT_I64(15, st.queued);
  EXPECT_RC(TALLY_ETIMEDOUT, tally_sender_flush(s, 100));
  EXPECT(strstr(tally_errmsg(), "15 records") != NULL);
  /* delays 40, 80, 160, 320 ms: about 5 attempts in 0.7 s, not dozens */
  usleep(400 * 1000);
  st = stats_of(s);
  EXPECT(st.failures >= 4 && st.failures <= 7);
  pthread_mutex_lock(&srv->mu);
  for (int i = 0; i < srv->nreqs; i++)
    EXPECT(srv->reqs[i].len == 2 && memcmp(srv->reqs[i].body, "b0", 2) == 0);
  pthread_mutex_unlock(&srv->mu);

  atomic_store(&srv->answer, ANSWER_OK);
  EXPECT_OK(tally_sender_flush(s, 3000));
  st = stats_of(s);
  EXPECT_I64(15, st.sent);
  EXPECT_I64(5, st.requests);
  EXPECT_I64(0, st.dropped);
  EXPECT_I64(0, st.queued);
  EXPECT_I64(200, st.last_status);
  EXPECT_STR("HTTP 500", st.last_error); /* the last failure stays */
  expect_delivered(srv, want, 5, "retry_500");

  /* a success resets the backoff: the next failure is retried after 40 ms,
   * not 640 */
  uint64_t failures = st.failures;
  atomic_store(&srv->answer, ANSWER_ERROR);
  double t0 = tu_now();
  EXPECT_OK(post_str(s, "b5", 1));
  wait_failures(s, failures + 2, 2.0);
  EXPECT(tu_now() - t0 < 0.4);
  atomic_store(&srv->answer, ANSWER_OK);
  EXPECT_OK(tally_sender_flush(s, 3000));
  tally_sender_close(s, 0);
  server_stop(srv);
}

/* A 400 is the peer refusing the body: dropped at once and counted as
 * rejected, never retried, so the bodies behind it still go through. */
static void test_refused(void) {
  static const char *const want[] = {"r1", "r2"};
  server *srv = server_start(ANSWER_REFUSED);
  tally_sender *s = open_sender(srv->url, NULL, NULL, 2000, 0, 40, 1000);
  EXPECT_OK(post_str(s, "r0", 3));
  wait_requests(srv, ANSWER_REFUSED, 1, 3.0);
  EXPECT_OK(tally_sender_flush(s, 3000)); /* nothing waits: it was dropped */
  tally_sender_stats st = stats_of(s);
  EXPECT_I64(3, st.rejected);
  EXPECT_I64(3, st.dropped);
  EXPECT_I64(1, st.failures);
  EXPECT_I64(400, st.last_status);
  EXPECT_STR("HTTP 400", st.last_error);
  EXPECT_I64(1, server_count(srv, ANSWER_REFUSED)); /* not retried */
  atomic_store(&srv->answer, ANSWER_OK);
  EXPECT_OK(post_str(s, "r1", 1));
  EXPECT_OK(post_str(s, "r2", 1));
  EXPECT_OK(tally_sender_flush(s, 3000));
  expect_delivered(srv, want, 2, "refused");
  tally_sender_close(s, 0);
  server_stop(srv);
}

/* A redirect is refused as a 400 is (a sink posts to its own url), saying
 * where to; a 429's Retry-After (1 s) is waited before the next try, where
 * the backoff alone would retry after 40 ms. */
static void test_moved_and_busy(void) {
  server *srv = server_start(ANSWER_MOVED);
  tally_sender *s = open_sender(srv->url, NULL, NULL, 2000, 0, 40, 5000);
  EXPECT_OK(post_str(s, "m0", 2));
  wait_requests(srv, ANSWER_MOVED, 1, 3.0);
  EXPECT_OK(tally_sender_flush(s, 3000));
  tally_sender_stats st = stats_of(s);
  EXPECT_I64(2, st.rejected);
  EXPECT_I64(301, st.last_status);
  EXPECT_STR("HTTP 301: redirected to http://127.0.0.1:9/elsewhere (a sink does not "
             "follow: give it that url)",
             st.last_error);
  EXPECT_I64(1, server_count(srv, ANSWER_MOVED)); /* not retried */
  atomic_store(&srv->answer, ANSWER_BUSY);
  EXPECT_OK(post_str(s, "b0", 1));
  wait_requests(srv, ANSWER_BUSY, 1, 3.0);
  double t0 = tu_now();
  usleep(600 * 1000);
  EXPECT_I64(1, server_count(srv, ANSWER_BUSY)); /* still waiting out the 1 s */
  atomic_store(&srv->answer, ANSWER_OK);
  EXPECT_OK(tally_sender_flush(s, 3000));
  EXPECT(tu_now() - t0 > 0.2); /* the retry came after the Retry-After */
  st = stats_of(s);
  EXPECT_I64(1, st.sent);
  tally_sender_close(s, 0);
  server_stop(srv);
}

/* A server slower than the timeout: failures with a timeout message, and
 * post() never waits for the network. */
static void test_slow_server(void) {
  enum { N = 30 };
  char bodies[N][16];
  const char *want[N];
  double slowest = 0;
  server *srv = server_start(ANSWER_NONE);
  tally_sender *s = open_sender(srv->url, NULL, NULL, 200, 0, 50, 100);
  tally_sender_stats st;

  for (int i = 0; i < N; i++) {
    snprintf(bodies[i], sizeof bodies[i], "slow %d", i);
    want[i] = bodies[i];
  }
  EXPECT_OK(post_str(s, bodies[0], 1));
  wait_requests(srv, ANSWER_NONE, 1, 2.0); /* a request is in flight now */
  for (int i = 1; i < N; i++) {
    double t0 = tu_now();
    EXPECT_OK(post_str(s, bodies[i], 1));
    double took = tu_now() - t0;
    if (took > slowest) slowest = took;
  }
  EXPECT(slowest < 0.02); /* the timeout is 0.2 s */
  st = wait_failures(s, 1, 2.0);
  EXPECT(strstr(st.last_error, "timed out") != NULL);
  EXPECT_I64(0, st.last_status);
  EXPECT_I64(0, st.sent);
  EXPECT_I64(N, st.queued);

  atomic_store(&srv->answer, ANSWER_OK);
  EXPECT_OK(tally_sender_flush(s, 5000));
  st = stats_of(s);
  EXPECT_I64(N, st.sent);
  EXPECT_I64(0, st.dropped);
  expect_delivered(srv, want, N, "slow");
  tally_sender_close(s, 0);
  server_stop(srv);
}

/* Nothing listening: every attempt fails, nothing is lost before close. */
static void test_dead_port(void) {
  int port, fd = bound_socket(&port); /* bound, never listening */
  char url[64];
  snprintf(url, sizeof url, "http://127.0.0.1:%d/ingest", port);
  tally_sender *s = open_sender(url, NULL, NULL, 1000, 0, 20, 40);
  tally_sender_stats st;

  for (int i = 0; i < 3; i++) EXPECT_OK(post_str(s, "dead", 1));
  st = wait_failures(s, 3, 2.0);
  EXPECT_I64(0, st.last_status);
  EXPECT(strcasestr(st.last_error, "connect") != NULL);
  EXPECT_I64(0, st.sent);
  EXPECT_I64(0, st.dropped);
  EXPECT_I64(3, st.queued);
  double t0 = tu_now();
  EXPECT_RC(TALLY_ETIMEDOUT, tally_sender_flush(s, 100));
  double took = tu_now() - t0;
  EXPECT(took >= 0.09 && took < 0.5);
  t0 = tu_now();
  EXPECT_RC(TALLY_ETIMEDOUT, tally_sender_flush(s, 0));
  EXPECT(tu_now() - t0 < 0.05);

  /* close drains for as long as it is told, then gives up */
  t0 = tu_now();
  tally_sender_close(s, 300);
  took = tu_now() - t0;
  EXPECT(took >= 0.29 && took < 1.0);
  close(fd);
}

/* A full queue drops its oldest bodies and counts their records exactly. */
static void test_overflow(void) {
  static const char *const want[] = {"D", "E", "G"};
  server *srv = server_start(ANSWER_ERROR);
  tally_sender *s = open_sender(srv->url, NULL, NULL, 2000, 10, 1000, 1000);
  tally_sender_stats st;

  EXPECT_OK(post_str(s, "A", 4));
  st = wait_failures(s, 1, 2.0); /* A is back in the queue for 1 s */
  EXPECT_I64(4, st.queued);
  EXPECT_OK(post_str(s, "B", 3));
  EXPECT_OK(post_str(s, "C", 3));
  st = stats_of(s);
  EXPECT_I64(10, st.queued);
  EXPECT_I64(0, st.dropped);
  EXPECT_OK(post_str(s, "D", 2)); /* drops A */
  st = stats_of(s);
  EXPECT_I64(8, st.queued);
  EXPECT_I64(4, st.dropped);
  EXPECT_OK(post_str(s, "E", 5)); /* drops B */
  st = stats_of(s);
  EXPECT_I64(10, st.queued);
  EXPECT_I64(7, st.dropped);
  EXPECT_OK(post_str(s, "F", 11)); /* can never fit: dropped itself */
  st = stats_of(s);
  EXPECT_I64(10, st.queued);
  EXPECT_I64(18, st.dropped);
  EXPECT_OK(post_str(s, "G", 1)); /* drops C */
  st = stats_of(s);
  EXPECT_I64(8, st.queued);
  EXPECT_I64(21, st.dropped);

  atomic_store(&srv->answer, ANSWER_OK);
  EXPECT_OK(tally_sender_flush(s, 4000));
  st = stats_of(s);
  EXPECT_I64(8, st.sent);
  EXPECT_I64(3, st.requests);
  EXPECT_I64(21, st.dropped);
  EXPECT_I64(0, st.queued);
  expect_delivered(srv, want, 3, "overflow");
  tally_sender_close(s, 0);
  server_stop(srv);
}

/* close(): drains what it can, and is prompt during a backoff and during a
 * request that hangs. */
static void test_close(void) {
  enum { N = 20 };
  char bodies[N][16];
  const char *want[N];
  server *srv = server_start(ANSWER_OK);
  tally_sender *s = open_sender(srv->url, NULL, NULL, 2000, 0, 0, 0);
  double t0, took;

  for (int i = 0; i < N; i++) {
    snprintf(bodies[i], sizeof bodies[i], "drain %d", i);
    want[i] = bodies[i];
    EXPECT_OK(post_str(s, bodies[i], 1));
  }
  tally_sender_close(s, 3000); /* delivers everything, then returns */
  expect_delivered(srv, want, N, "close drain");

  /* a request that hangs is cut short by close(0) ... */
  atomic_store(&srv->answer, ANSWER_NONE);
  s = open_sender(srv->url, NULL, NULL, 5000, 0, 0, 0);
  EXPECT_OK(post_str(s, "hang", 1));
  EXPECT_OK(post_str(s, "pending", 1));
  wait_requests(srv, ANSWER_NONE, 1, 2.0);
  t0 = tu_now();
  tally_sender_close(s, 0);
  took = tu_now() - t0;
  EXPECT(took < 0.3);

  /* ... and at the end of a drain */
  s = open_sender(srv->url, NULL, NULL, 5000, 0, 0, 0);
  EXPECT_OK(post_str(s, "hang", 1));
  wait_requests(srv, ANSWER_NONE, 2, 2.0);
  t0 = tu_now();
  tally_sender_close(s, 200);
  took = tu_now() - t0;
  EXPECT(took >= 0.19 && took < 0.6);
  server_stop(srv);

  /* a backoff does not hold close() up */
  int port, fd = bound_socket(&port);
  char url[64];
  snprintf(url, sizeof url, "http://127.0.0.1:%d/ingest", port);
  s = open_sender(url, NULL, NULL, 1000, 0, 5000, 5000);
  EXPECT_OK(post_str(s, "later", 1));
  wait_failures(s, 1, 2.0);
  t0 = tu_now();
  tally_sender_close(s, 0);
  took = tu_now() - t0;
  EXPECT(took < 0.1);
  close(fd);
}

int main(void) {
  double t0 = tu_now();
  alarm(120); /* a hang fails the test instead of stalling the suite */

  test_bad_options();
  test_delivery();
  test_concurrent_posts();
  test_retry_500();
  test_refused();
  test_moved_and_busy();
  test_slow_server();
  test_dead_port();
  test_overflow();
  test_close();
  printf("  took %.1f s\n", tu_now() - t0);
  return tu_finish("test_sender");
}
