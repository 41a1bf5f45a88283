/* tally-http-sink -- a tiny HTTP/1.1 receiver for the webhook specs.
 *
 *   tally-http-sink --port-file FILE --out FILE [--status N] [--delay-ms N]
 *                   [--control] [--port N]
 *
 * Listens on 127.0.0.1 on port N (--port), else on a port the kernel
 * picks, and writes that port (a
 * decimal number and a newline) to --port-file once it listens: written to
 * FILE.tmp.PID and renamed, so a reader never sees half of it. Each
 * connection has its own thread and is kept alive (HTTP/1.1) until the client
 * closes it or asks for "Connection: close"; its requests are handled one at
 * a time. Bodies come with Content-Length or chunked; "Expect: 100-continue"
 * is answered with 100 before the body is read.
 *
 * Every request appends one line of JSON to --out, flushed before it is
 * answered:
 *   {"method":"POST","path":"/hook?x=1","content_type":"application/json",
 *    "headers":{"host":"127.0.0.1:4711",...},"body":"..."}
 * "path" is the request target as sent (query included); "content_type" is
 * null when there is none; header names are lowercased and repeated headers
 * joined with ", ". The body is a JSON string: '"', '\' and control bytes
 * are escaped, bytes >= 0x80 are copied as they are (lua-cjson reads them
 * back unchanged).
 *
 * The answer (status --status, default 200, body "ok\n") is sent --delay-ms
 * milliseconds after the line is written. With --control, a request for
 * /control?status=N&delay_ms=M sets the status and delay of later requests
 * (either may be left out); it is answered 200 at once and not logged.
 * SIGTERM or SIGINT: the log is flushed and closed, exit status 0.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_HEAD    (64 * 1024) /* request line + headers */
#define MAX_BODY    (64L * 1024 * 1024)
#define MAX_HEADERS 128

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER; /* all below */
static FILE *out;
static int cur_status = 200;
static long cur_delay_ms;
static int control;

/* A growing string. */
struct sb {
  char *p;
  size_t n, cap;
};

static void sb_put(struct sb *s, const char *d, size_t n) {
  if (s->n + n + 1 > s->cap) {
    size_t cap = s->cap ? s->cap : 256;
    while (cap < s->n + n + 1) cap *= 2;
    char *p = realloc(s->p, cap);
    if (!p) {
      perror("tally-http-sink: realloc");
      exit(1);
    }
    s->p = p;
    s->cap = cap;
  }
  memcpy(s->p + s->n, d, n);
  s->n += n;
  s->p[s->n] = 0;
}

static void sb_str(struct sb *s, const char *str) {
  sb_put(s, str, strlen(str));
}

/* d[0..n) as a JSON string, quotes included. */
static void sb_json(struct sb *s, const char *d, size_t n) {
  sb_put(s, "\"", 1);
  for (size_t i = 0; i < n; i++) {
    unsigned char c = (unsigned char)d[i];
    char esc[8];
    if (c == '"' || c == '\\') {
      esc[0] = '\\';
      esc[1] = (char)c;
      sb_put(s, esc, 2);
    } else if (c == '\n') {
      sb_put(s, "\\n", 2);
    } else if (c == '\r') {
      sb_put(s, "\\r", 2);
    } else if (c == '\t') {
      sb_put(s, "\\t", 2);
    } else if (c < 0x20) {
      snprintf(esc, sizeof esc, "\\u%04x", c);
      sb_put(s, esc, 6);
    } else {
      sb_put(s, (const char *)&c, 1);
    }
  }
  sb_put(s, "\"", 1);
}

/* One connection: received bytes buf[0..len); a request starts at 0. */
struct conn {
  int fd;
  char *buf;
  size_t len, cap;
};

/* Read more; 1 if something came, 0 on end of file, error or overflow. */
static int fill(struct conn *c) {
  if (c->len == c->cap) {
    if (c->cap >= (size_t)(MAX_HEAD + MAX_BODY + 64 * 1024)) return 0;
    size_t cap = c->cap ? c->cap * 2 : 16384;
    char *p = realloc(c->buf, cap);
    if (!p) return 0;
    c->buf = p;
    c->cap = cap;
  }
  for (;;) {
    ssize_t r = recv(c->fd, c->buf + c->len, c->cap - c->len, 0);
    if (r > 0) {
      c->len += (size_t)r;
      return 1;
    }
    if (r < 0 && errno == EINTR) continue;
    return 0;
  }
}

static int send_all(int fd, const char *d, size_t n) {
  while (n > 0) {
    ssize_t w = send(fd, d, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    d += w;
    n -= (size_t)w;
  }
  return 0;
}

/* Where "\r\n" is at or after `from`, or -1 (never looks past len). */
static long find_crlf(const struct conn *c, size_t from) {
  for (size_t i = from; i + 1 < c->len; i++)
    if (c->buf[i] == '\r' && c->buf[i + 1] == '\n') return (long)i;
  return -1;
}

static const char *reason(int status) {
  switch (status) {
  case 200: return "OK";
  case 201: return "Created";
  case 202: return "Accepted";
  case 204: return "No Content";
  case 400: return "Bad Request";
  case 401: return "Unauthorized";
  case 403: return "Forbidden";
  case 404: return "Not Found";
  case 408: return "Request Timeout";
  case 413: return "Content Too Large";
  case 429: return "Too Many Requests";
  case 500: return "Internal Server Error";
  case 502: return "Bad Gateway";
  case 503: return "Service Unavailable";
  case 504: return "Gateway Timeout";
  default: return "Status";
  }
}

static int respond(int fd, int status, const char *body, int close_after, int head) {
  char h[256];
  int n;
  int nobody = status < 200 || status == 204 || status == 304;
  if (nobody)
    n = snprintf(h, sizeof h, "HTTP/1.1 %d %s\r\n%s\r\n", status, reason(status),
                 close_after ? "Connection: close\r\n" : "");
  else
    n = snprintf(
        h, sizeof h,
        "HTTP/1.1 %d %s\r\nContent-Type: text/plain\r\nContent-Length: %zu\r\n%s\r\n",
        status, reason(status), strlen(body), close_after ? "Connection: close\r\n" : "");
  if (send_all(fd, h, (size_t)n) < 0) return -1;
  if (nobody || head) return 0;
  return send_all(fd, body, strlen(body));
}

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) < 0 && errno == EINTR) {}
}

/* Parse "status=N&delay_ms=M" and apply it. */
static void apply_control(const char *q, size_t n) {
  char tmp[256];
  if (n >= sizeof tmp) n = sizeof tmp - 1;
  memcpy(tmp, q, n);
  tmp[n] = 0;
  char *save = NULL;
  for (char *kv = strtok_r(tmp, "&", &save); kv; kv = strtok_r(NULL, "&", &save)) {
    char *eq = strchr(kv, '=');
    if (!eq) continue;
    *eq = 0;
    long v = strtol(eq + 1, NULL, 10);
    pthread_mutex_lock(&lock);
    if (strcmp(kv, "status") == 0 && v >= 100 && v <= 599)
      cur_status = (int)v;
    else if (strcmp(kv, "delay_ms") == 0 && v >= 0)
      cur_delay_ms = v;
    pthread_mutex_unlock(&lock);
  }
}

struct hdr {
  char *name, *val;
  size_t nlen, vlen;
};

/* Handle the request at the front of c->buf; 1 to go on with the
 * connection, 0 to close it. */
static int one_request(struct conn *c) {
  long head_end = -1;
  for (;;) { /* the head: up to the empty line */
    if (c->len >= 4)
      for (size_t i = 0; i + 3 < c->len; i++)
        if (memcmp(c->buf + i, "\r\n\r\n", 4) == 0) {
          head_end = (long)i + 4;
          break;
        }
    if (head_end >= 0) break;
    if (c->len > MAX_HEAD) {
      respond(c->fd, 400, "request head too large\n", 1, 0);
      return 0;
    }
    if (!fill(c)) return 0;
  }

  /* Request line: METHOD SP TARGET SP VERSION. */
  char *line = c->buf, *eol = strstr(line, "\r\n"); /* head holds no NUL... */
  if (!eol || memchr(c->buf, 0, (size_t)head_end)) {
    respond(c->fd, 400, "bad request\n", 1, 0);
    return 0;
  }
  char *sp1 = memchr(line, ' ', (size_t)(eol - line));
  char *sp2 = sp1 ? memchr(sp1 + 1, ' ', (size_t)(eol - sp1 - 1)) : NULL;
  if (!sp1 || !sp2 || sp1 == line || sp2 == sp1 + 1) {
    respond(c->fd, 400, "bad request line\n", 1, 0);
    return 0;
  }
  char *method = line, *target = sp1 + 1, *version = sp2 + 1;
  size_t mlen = (size_t)(sp1 - line), tlen = (size_t)(sp2 - target);
  size_t vlen = (size_t)(eol - version);
  int http10 = vlen == 8 && memcmp(version, "HTTP/1.0", 8) == 0;
  int head = mlen == 4 && memcmp(method, "HEAD", 4) == 0;

  /* Headers: name ":" OWS value OWS; names lowercased in place. */
  struct hdr h[MAX_HEADERS];
  int nh = 0;
  char *p = eol + 2, *end = c->buf + head_end - 2;
  while (p < end) {
    char *e = strstr(p, "\r\n");
    char *colon = memchr(p, ':', (size_t)(e - p));
    if (!colon || colon == p || nh == MAX_HEADERS) {
      respond(c->fd, 400, "bad header\n", 1, 0);
      return 0;
    }
    for (char *q = p; q < colon; q++)
      if (*q >= 'A' && *q <= 'Z') *q = (char)(*q - 'A' + 'a');
    char *v = colon + 1, *ve = e;
    while (v < ve && (*v == ' ' || *v == '\t')) v++;
    while (ve > v && (ve[-1] == ' ' || ve[-1] == '\t')) ve--;
    h[nh++] = (struct hdr){p, v, (size_t)(colon - p), (size_t)(ve - v)};
    p = e + 2;
  }

  /* What the request says about its body and the connection. */
  long clen = 0;
  int chunked = 0, close_after = http10, expect = 0;
  struct hdr *ctype = NULL;
#define IS(i, s) (h[i].nlen == sizeof(s) - 1 && memcmp(h[i].name, s, sizeof(s) - 1) == 0)
  for (int i = 0; i < nh; i++) {
    char v[128];
    size_t n = h[i].vlen < sizeof v - 1 ? h[i].vlen : sizeof v - 1;
    memcpy(v, h[i].val, n);
    v[n] = 0;
    if (IS(i, "content-length")) {
      char *ep;
      errno = 0;
      clen = strtol(v, &ep, 10);
      if (errno || ep == v || *ep || clen < 0) {
        respond(c->fd, 400, "bad content-length\n", 1, 0);
        return 0;
      }
    } else if (IS(i, "transfer-encoding")) {
      chunked = strcasestr(v, "chunked") != NULL;
    } else if (IS(i, "connection")) {
      if (strcasestr(v, "close"))
        close_after = 1;
      else if (strcasestr(v, "keep-alive"))
        close_after = 0;
    } else if (IS(i, "expect")) {
      expect = strcasecmp(v, "100-continue") == 0;
    } else if (IS(i, "content-type") && !ctype) {
      ctype = &h[i];
    }
  }
  if (clen > MAX_BODY) {
    respond(c->fd, 413, "body too large\n", 1, 0);
    return 0;
  }

  /* A control request: change the answers, log nothing. Its body (if any)
   * is skipped below like any other. */
  int is_control = control && tlen >= 8 && memcmp(target, "/control", 8) == 0 &&
                   (tlen == 8 || target[8] == '?');

  /* The line, up to the body, before any fill() moves the buffer. */
  struct sb rec = {0};
  sb_str(&rec, "{\"method\":");
  sb_json(&rec, method, mlen);
  sb_str(&rec, ",\"path\":");
  sb_json(&rec, target, tlen);
  sb_str(&rec, ",\"content_type\":");
  if (ctype)
    sb_json(&rec, ctype->val, ctype->vlen);
  else
    sb_str(&rec, "null");
  sb_str(&rec, ",\"headers\":{");
  for (int i = 0, first = 1; i < nh; i++) {
    int seen = 0;
    for (int j = 0; j < i && !seen; j++)
      seen = h[j].nlen == h[i].nlen && memcmp(h[j].name, h[i].name, h[i].nlen) == 0;
    if (seen) continue;
    struct sb v = {0};
    sb_put(&v, "", 0);
    for (int j = i; j < nh; j++) {
      if (h[j].nlen != h[i].nlen || memcmp(h[j].name, h[i].name, h[i].nlen) != 0)
        continue;
      if (j != i) sb_put(&v, ", ", 2);
      sb_put(&v, h[j].val, h[j].vlen);
    }
    if (!first) sb_str(&rec, ",");
    first = 0;
    sb_json(&rec, h[i].name, h[i].nlen);
    sb_str(&rec, ":");
    sb_json(&rec, v.p, v.n);
    free(v.p);
  }
  sb_str(&rec, "},\"body\":");
  if (is_control) apply_control(target + 8 + (tlen > 8), tlen > 8 ? tlen - 9 : 0);

  if (expect && !http10 && (clen > 0 || chunked) &&
      send_all(c->fd, "HTTP/1.1 100 Continue\r\n\r\n", 25) < 0) {
    free(rec.p);
    return 0;
  }

  /* The body: from head_end on, c->buf may move from here. */
  struct sb body = {0};
  sb_put(&body, "", 0);
  size_t consumed;
  if (chunked) {
    size_t pos = (size_t)head_end;
    for (;;) {
      long le;
      while ((le = find_crlf(c, pos)) < 0)
        if (!fill(c)) goto broken;
      char *ep;
      unsigned long size = strtoul(c->buf + pos, &ep, 16);
      if (ep == c->buf + pos || body.n + size > (unsigned long)MAX_BODY) goto broken;
      pos = (size_t)le + 2;
      if (size == 0) { /* trailers, up to an empty line */
        for (;;) {
          while ((le = find_crlf(c, pos)) < 0)
            if (!fill(c)) goto broken;
          int empty = (size_t)le == pos;
          pos = (size_t)le + 2;
          if (empty) break;
        }
        break;
      }
      while (c->len < pos + size + 2)
        if (!fill(c)) goto broken;
      sb_put(&body, c->buf + pos, size);
      pos += size + 2;
    }
    consumed = pos;
  } else {
    while (c->len < (size_t)head_end + (size_t)clen)
      if (!fill(c)) goto broken;
    sb_put(&body, c->buf + head_end, (size_t)clen);
    consumed = (size_t)head_end + (size_t)clen;
  }
  memmove(c->buf, c->buf + consumed, c->len - consumed);
  c->len -= consumed;

  int status;
  long delay;
  if (is_control) {
    pthread_mutex_lock(&lock);
    char msg[64];
    snprintf(msg, sizeof msg, "status=%d delay_ms=%ld\n", cur_status, cur_delay_ms);
    pthread_mutex_unlock(&lock);
    free(rec.p);
    free(body.p);
    return respond(c->fd, 200, msg, close_after, head) == 0 && !close_after;
  }
  sb_json(&rec, body.p, body.n);
  sb_str(&rec, "}\n");
  free(body.p);
  pthread_mutex_lock(&lock);
  status = cur_status;
  delay = cur_delay_ms;
  if (out) {
    fputs(rec.p, out);
    fflush(out);
  }
  pthread_mutex_unlock(&lock);
  free(rec.p);
  if (delay > 0) sleep_ms(delay);
  char msg[64];
  snprintf(msg, sizeof msg, "%s\n",
           status >= 200 && status < 300 ? "ok" : reason(status));
  return respond(c->fd, status, msg, close_after, head) == 0 && !close_after;

broken: /* the client went away or sent a malformed body */
  free(rec.p);
  free(body.p);
  return 0;
}

static void *serve(void *arg) {
  struct conn c = {(int)(intptr_t)arg, NULL, 0, 0};
  while (one_request(&c)) {}
  close(c.fd);
  free(c.buf);
  return NULL;
}

static void *acceptor(void *arg) {
  int ls = (int)(intptr_t)arg;
  for (;;) {
    int fd = accept4(ls, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOMEM) sleep_ms(10);
      continue;
    }
    pthread_t t;
    if (pthread_create(&t, NULL, serve, (void *)(intptr_t)fd) != 0) {
      close(fd);
      continue;
    }
    pthread_detach(t);
  }
  return NULL;
}

static void usage(void) {
  fprintf(stderr, "usage: tally-http-sink --port-file FILE --out FILE [--status N] "
                  "[--delay-ms N] [--control] [--port N]\n");
  exit(2);
}

static long num_arg(const char *s, long lo, long hi) {
  char *e;
  errno = 0;
  long v = strtol(s, &e, 10);
  if (errno || e == s || *e || v < lo || v > hi) usage();
  return v;
}

int main(int argc, char **argv) {
  const char *port_file = NULL, *out_file = NULL;
  long port = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (strcmp(a, "--control") == 0)
      control = 1;
    else if (i + 1 >= argc)
      usage();
    else if (strcmp(a, "--port-file") == 0)
      port_file = argv[++i];
    else if (strcmp(a, "--out") == 0)
      out_file = argv[++i];
    else if (strcmp(a, "--status") == 0)
      cur_status = (int)num_arg(argv[++i], 100, 599);
    else if (strcmp(a, "--delay-ms") == 0)
      cur_delay_ms = num_arg(argv[++i], 0, 3600000);
    else if (strcmp(a, "--port") == 0)
      port = num_arg(argv[++i], 1, 65535);
    else
      usage();
  }
  if (!port_file || !out_file) usage();

  out = fopen(out_file, "a");
  if (!out) {
    fprintf(stderr, "tally-http-sink: %s: %s\n", out_file, strerror(errno));
    return 1;
  }

  /* SIGTERM/SIGINT are taken by sigwait() in main; every thread blocks them. */
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, NULL);
  signal(SIGPIPE, SIG_IGN);

  int ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t sl = sizeof sa;
  int one = 1;
  if (ls >= 0) setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (ls < 0 || bind(ls, (struct sockaddr *)&sa, sizeof sa) < 0 || listen(ls, 128) < 0 ||
      getsockname(ls, (struct sockaddr *)&sa, &sl) < 0) {
    perror("tally-http-sink: listen on 127.0.0.1");
    return 1;
  }

  pthread_t t;
  if (pthread_create(&t, NULL, acceptor, (void *)(intptr_t)ls) != 0) {
    fprintf(stderr, "tally-http-sink: cannot start a thread\n");
    return 1;
  }
  pthread_detach(t);

  char tmp[PATH_MAX];
  snprintf(tmp, sizeof tmp, "%s.tmp.%ld", port_file, (long)getpid());
  FILE *pf = fopen(tmp, "w");
  if (!pf || fprintf(pf, "%d\n", ntohs(sa.sin_port)) < 0 || fclose(pf) != 0 ||
      rename(tmp, port_file) != 0) {
    fprintf(stderr, "tally-http-sink: %s: %s\n", port_file, strerror(errno));
    unlink(tmp);
    return 1;
  }
  fprintf(stderr, "tally-http-sink: listening on 127.0.0.1:%d\n", ntohs(sa.sin_port));

  int sig;
  while (sigwait(&set, &sig) != 0) {}
  pthread_mutex_lock(&lock);
  fclose(out);
  out = NULL;
  pthread_mutex_unlock(&lock);
  fprintf(stderr, "tally-http-sink: signal %d, exiting\n", sig);
  /* Connection threads may still be blocked in recv(): leave without
   * running exit handlers under them. */
  _exit(0);
}
