/* redis_cluster.c -- slot routing, redirections and per-node pipelining on hiredis.
 *
 * The handle keeps a list of nodes (host, port, a hiredis context or NULL)
 * that only grows, so a node's index stays valid, and a table giving the
 * node index of each of the 16384 slots. A standalone server is node 0 of a
 * table where every slot points at it.
 *
 * Everything runs through one engine, exec(): a single command is a
 * pipeline of one. Each round picks the node of every pending command (its
 * ASK target, else its slot's owner), appends the commands to each node's
 * output buffer (ASKING first for an ASK), writes every buffer out, then
 * reads the replies node by node in the order they were sent. A MOVED reply
 * re-points the slot and leaves the command pending; ASK leaves it pending
 * with a one-shot target; TRYAGAIN and CLUSTERDOWN leave it pending and
 * make the next round wait a little. Rounds stop when nothing is pending,
 * or fail the leftovers when a command has been sent
 * TALLY_RC_MAX_ATTEMPTS times or the deadline has passed.
 */

#include "redis_cluster.h"

#include <errno.h>
#include <hiredis/sds.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define NO_NODE        UINT16_MAX
#define MAX_NODES      1024u /* far above any real cluster; bounds a bad map */
#define BACKOFF_MIN_MS 10u
#define BACKOFF_MAX_MS 200u

struct node {
  char *host;
  int port;
  redisContext *c; /* NULL: not connected */
  bool ever;       /* was connected once: the next connect is a reconnect */
};

struct tally_rc {
  uint32_t timeout_ms;
  bool cluster;
  bool stale;       /* a MOVED was seen: reload the map after the call */
  bool refresh_now; /* a connect failed: reload the map before the resend */
  char *user;       /* NULL: AUTH password, or no AUTH without password */
  char *password;   /* NULL: no AUTH */
  uint32_t nnodes, cap;
  struct node *nodes;
  tally_rc_stats stats;
  uint16_t slots[TALLY_RC_SLOTS]; /* node index, or NO_NODE */
};

enum { CMD_PENDING, CMD_DONE, CMD_FAILED };

struct cmd {
  int argc;
  const char **argv; /* into the same allocation as the cmd */
  size_t *argvlen;
  uint16_t slot;
  uint16_t ask;  /* one-shot target from ASK, or NO_NODE */
  uint16_t node; /* target in the current round */
  uint8_t state;
  uint32_t attempts;
  redisReply *reply;
};

struct tally_rc_pipe {
  tally_rc *rc;
  uint32_t n, cap;
  struct cmd **cmds;
};

/* ---- time and errors ----------------------------------------------------- */

static struct timeval tv_ms(uint64_t ms) {
  if (ms == 0) ms = 1; /* 0 would mean "no timeout" to the kernel */
  struct timeval tv = {(time_t)(ms / 1000u), (suseconds_t)(ms % 1000u * 1000u)};
  return tv;
}

static void sleep_ms(uint64_t ms) {
  struct timespec ts = {(time_t)(ms / 1000u), (long)(ms % 1000u * 1000000L)};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
}

/* A failed context: record why (naming the node), drop the connection,
 * since a late reply would otherwise be taken for the next command's, and
 * return the code. saved_errno is errno right after the failing call:
 * hiredis reports a socket timeout as an I/O error with EAGAIN. */
static int node_fail(tally_rc *rc, struct node *n, const char *what, int saved_errno) {
  int code = TALLY_ECONNECT;
  const char *why = n->c ? n->c->errstr : "out of memory";
  if (n->c && n->c->err == REDIS_ERR_IO &&
      (saved_errno == EAGAIN || saved_errno == EWOULDBLOCK || saved_errno == ETIMEDOUT ||
       saved_errno == EINPROGRESS))
    code = TALLY_ETIMEDOUT;
  if (n->c && n->c->err == REDIS_ERR_EOF) why = "connection closed by server";
  tally_error_set(code, "redis %s:%d: %s: %s", n->host, n->port, what,
                  code == TALLY_ETIMEDOUT ? "timed out" : why);
  rc->stats.errors++;
  if (n->c) redisFree(n->c);
  n->c = NULL;
  return code;
}

/* ---- key slots ----------------------------------------------------------- */

/* CRC16-CCITT (XMODEM): polynomial 0x1021, initial value 0, no reflection,
 * bit by bit: keys are short and the network dominates. */
static uint16_t crc16(const unsigned char *p, size_t len) {
  uint16_t crc = 0;
  for (size_t i = 0; i < len; i++) {
    crc ^= (uint16_t)(p[i] << 8);
    for (int b = 0; b < 8; b++)
      crc = (uint16_t)(crc & 0x8000 ? (crc << 1) ^ 0x1021 : crc << 1);
  }
  return crc;
}

uint16_t tally_rc_keyslot(const void *key, size_t len) {
  const unsigned char *k = key;
  const unsigned char *open = len ? memchr(k, '{', len) : NULL;
  if (open) {
    size_t start = (size_t)(open - k) + 1;
    const unsigned char *close = memchr(k + start, '}', len - start);
    /* "{}" or no '}': the whole key is hashed, as Redis does */
    if (close && close > k + start)
      return crc16(k + start, (size_t)(close - k - start)) & (TALLY_RC_SLOTS - 1);
  }
  return crc16(k, len) & (TALLY_RC_SLOTS - 1);
}

/* ---- nodes --------------------------------------------------------------- */

/* Index of host:port, added if new; NO_NODE (errmsg set) when full or out
 * of memory. */
static uint16_t node_find(tally_rc *rc, const char *host, size_t hlen, int port) {
  for (uint32_t i = 0; i < rc->nnodes; i++)
    if (rc->nodes[i].port == port && strlen(rc->nodes[i].host) == hlen &&
        memcmp(rc->nodes[i].host, host, hlen) == 0)
      return (uint16_t)i;
  if (rc->nnodes == MAX_NODES) {
    tally_error_set(TALLY_ENOMEM, "redis: more than %u nodes",
                    MAX_NODES); /* a resource limit */
    return NO_NODE;
  }
  if (rc->nnodes == rc->cap) {
    uint32_t cap = rc->cap ? rc->cap * 2 : 8;
    struct node *nn = realloc(rc->nodes, cap * sizeof *nn);
    if (!nn) {
      tally_error_set(TALLY_ENOMEM, "redis: out of memory");
      return NO_NODE;
    }
    rc->nodes = nn;
    rc->cap = cap;
  }
  char *h = strndup(host, hlen);
  if (!h) {
    tally_error_set(TALLY_ENOMEM, "redis: out of memory");
    return NO_NODE;
  }
  rc->nodes[rc->nnodes] = (struct node){h, port, NULL, false};
  return (uint16_t)rc->nnodes++;
}

/* The server closed an idle connection (CLIENT KILL, its timeout, a
 * restart) if the socket is readable: Redis never speaks unasked in RESP2,
 * so anything readable is EOF, an error, or a stream we cannot trust. */
static bool conn_dead(redisContext *c) {
  struct pollfd p = {.fd = c->fd, .events = POLLIN};
  return poll(&p, 1, 0) != 0;
}

/* AUTH on a fresh connection, when a password is set. */
static int node_auth(tally_rc *rc, struct node *n) {
  if (!rc->password) return 0;
  const char *argv[3];
  int argc = 0;
  argv[argc++] = "AUTH";
  if (rc->user) argv[argc++] = rc->user;
  argv[argc++] = rc->password;
  redisReply *r = redisCommandArgv(n->c, argc, argv, NULL);
  if (!r) return node_fail(rc, n, "AUTH", errno);
  int code = 0;
  if (r->type == REDIS_REPLY_ERROR) {
    /* Redis' reasons (WRONGPASS ..., ERR ... no password is set) never
     * quote the password */
    code = tally_error_set(TALLY_EREMOTE, "redis %s:%d: AUTH%s refused: %s", n->host,
                           n->port, rc->user ? " (user and password)" : " (password)",
                           r->str);
    rc->stats.errors++;
    redisFree(n->c);
    n->c = NULL;
  }
  freeReplyObject(r);
  return code;
}

/* Make node i ready to send, with socket waits bounded by the deadline.
 * *unsent (may be NULL) is set when the failure was a connect that did not
 * succeed: nothing reached the node, so a resend is safe. */
static int node_ready_x(tally_rc *rc, uint16_t i, uint64_t deadline, bool *unsent) {
  struct node *n = &rc->nodes[i];
  uint64_t now = (uint64_t)tally_monotonic_ms();
  if (unsent) *unsent = false;
  if (now >= deadline)
    return tally_error_set(TALLY_ETIMEDOUT, "redis %s:%d: timed out", n->host, n->port);
  if (n->c && conn_dead(n->c)) {
    redisFree(n->c);
    n->c = NULL;
  }
  if (!n->c) {
    n->c = redisConnectWithTimeout(n->host, n->port, tv_ms(deadline - now));
    int e = errno;
    if (!n->c || n->c->err) {
      int code = node_fail(rc, n, "connect", e);
      if (unsent && code != TALLY_ETIMEDOUT) *unsent = true;
      return code;
    }
    if (n->ever) {
      rc->stats.reconnects++;
      rc->stats.topology++;
    }
    n->ever = true;
    if (redisSetTimeout(n->c, tv_ms(deadline - now)) != REDIS_OK)
      return node_fail(rc, n, "set timeout", errno);
    int code = node_auth(rc, n);
    if (code) return code;
  }
  if (redisSetTimeout(n->c, tv_ms(deadline - now)) != REDIS_OK)
    return node_fail(rc, n, "set timeout", errno);
  return 0;
}

static int node_ready(tally_rc *rc, uint16_t i, uint64_t deadline) {
  return node_ready_x(rc, i, deadline, NULL);
}

/* "host:port" (host may be empty: then `dflt`, the node that answered) into
 * a node index. */
static uint16_t node_parse(tally_rc *rc, const char *s, size_t len, uint16_t dflt) {
  const char *colon = NULL;
  for (size_t i = len; i > 0; i--)
    if (s[i - 1] == ':') {
      colon = s + i - 1;
      break;
    }
  if (!colon) {
    tally_error_set(TALLY_EINVAL, "redis: bad address '%.*s'", (int)len, s);
    return NO_NODE;
  }
  char *end;
  long port = strtol(colon + 1, &end, 10);
  if (end == colon + 1 || port <= 0 || port > 65535) {
    tally_error_set(TALLY_EINVAL, "redis: bad address '%.*s'", (int)len, s);
    return NO_NODE;
  }
  if (colon == s && dflt != NO_NODE) {
    const char *h = rc->nodes[dflt].host;
    return node_find(rc, h, strlen(h), (int)port);
  }
  return node_find(rc, s, (size_t)(colon - s), (int)port);
}

/* ---- slot map ------------------------------------------------------------ */

/* Fill the slot table from a CLUSTER SLOTS reply got from node `from`:
 * [[start, end, [host, port, id...], replicas...], ...]. */
static int map_load(tally_rc *rc, const redisReply *r, uint16_t from) {
  /* built aside, so a bad reply leaves the old map whole; on the heap, as a
   * 32 KB thread-local would not fit a dlopen()ed module's static TLS */
  uint16_t *tmp = malloc(TALLY_RC_SLOTS * sizeof *tmp);
  if (!tmp) return tally_error_set(TALLY_ENOMEM, "redis: out of memory");
  int code = 0;
  for (uint32_t s = 0; s < TALLY_RC_SLOTS; s++) tmp[s] = NO_NODE;
  for (size_t i = 0; i < r->elements; i++) {
    const redisReply *e = r->element[i];
    if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 ||
        e->element[0]->type != REDIS_REPLY_INTEGER ||
        e->element[1]->type != REDIS_REPLY_INTEGER ||
        e->element[2]->type != REDIS_REPLY_ARRAY || e->element[2]->elements < 2 ||
        e->element[2]->element[0]->type != REDIS_REPLY_STRING ||
        e->element[2]->element[1]->type != REDIS_REPLY_INTEGER) {
      code = tally_error_set(TALLY_EREMOTE, "redis %s:%d: malformed CLUSTER SLOTS reply",
                             rc->nodes[from].host, rc->nodes[from].port);
      break;
    }
    long long lo = e->element[0]->integer, hi = e->element[1]->integer;
    const redisReply *host = e->element[2]->element[0];
    long long port = e->element[2]->element[1]->integer;
    if (lo < 0 || hi < lo || hi >= TALLY_RC_SLOTS || port <= 0 || port > 65535) {
      code = tally_error_set(TALLY_EREMOTE, "redis %s:%d: bad range in CLUSTER SLOTS",
                             rc->nodes[from].host, rc->nodes[from].port);
      break;
    }
    uint16_t idx;
    if (host->len == 0 || (host->len == 1 && host->str[0] == '?')) {
      /* no announced address: the node is reached where we reached it */
      const char *h = rc->nodes[from].host;
      idx = node_find(rc, h, strlen(h), (int)port);
    } else {
      idx = node_find(rc, host->str, host->len, (int)port);
    }
    if (idx == NO_NODE) { /* out of memory or of node slots; errmsg says which */
      code = TALLY_ENOMEM;
      break;
    }
    for (long long s = lo; s <= hi; s++) tmp[s] = idx;
  }
  if (code == 0) {
    if (rc->stats.refreshes > 0 &&
        memcmp(rc->slots, tmp, TALLY_RC_SLOTS * sizeof *tmp) != 0)
      rc->stats.topology++;
    memcpy(rc->slots, tmp, TALLY_RC_SLOTS * sizeof *tmp);
    rc->stats.refreshes++;
  }
  free(tmp);
  return code;
}

/* Ask node i for CLUSTER SLOTS. *r gets the reply (caller frees). */
static int ask_slots(tally_rc *rc, uint16_t i, redisReply **r) {
  *r = NULL;
  int code = node_ready(rc, i, (uint64_t)tally_monotonic_ms() + rc->timeout_ms);
  if (code) return code;
  *r = redisCommand(rc->nodes[i].c, "CLUSTER SLOTS");
  if (!*r) return node_fail(rc, &rc->nodes[i], "CLUSTER SLOTS", errno);
  return 0;
}

int tally_rc_refresh(tally_rc *rc) {
  if (!rc) return tally_error_set(TALLY_EINVAL, "redis: NULL handle");
  if (!rc->cluster) return 0;
  int code = TALLY_ECONNECT;
  /* nodes with a live connection first: no connect cost */
  for (int pass = 0; pass < 2; pass++) {
    for (uint32_t i = 0; i < rc->nnodes; i++) {
      if ((rc->nodes[i].c != NULL) != (pass == 0)) continue;
      redisReply *r;
      code = ask_slots(rc, (uint16_t)i, &r);
      if (code) continue;
      if (r->type == REDIS_REPLY_ARRAY && r->elements > 0) {
        code = map_load(rc, r, (uint16_t)i);
        freeReplyObject(r);
        if (code == 0) {
          rc->stale = false;
          return 0;
        }
      } else {
        code = tally_error_set(TALLY_EREMOTE, "redis %s:%d: CLUSTER SLOTS: %s",
                               rc->nodes[i].host, rc->nodes[i].port,
                               r->type == REDIS_REPLY_ERROR ? r->str : "no slots");
        freeReplyObject(r);
      }
    }
  }
  return code;
}

/* ---- open / close -------------------------------------------------------- */

int tally_rc_open(const char *seeds, uint32_t timeout_ms, tally_rc **out) {
  tally_rc_opts o = {timeout_ms, NULL, NULL};
  return tally_rc_open_opts(seeds, &o, out);
}

int tally_rc_open_opts(const char *seeds, const tally_rc_opts *opts, tally_rc **out) {
  if (!out) return tally_error_set(TALLY_EINVAL, "redis: NULL out");
  *out = NULL;
  if (!seeds || !*seeds || !opts || opts->timeout_ms == 0)
    return tally_error_set(TALLY_EINVAL, "redis: seeds and a timeout are required");
  tally_rc *rc = calloc(1, sizeof *rc);
  if (!rc) return tally_error_set(TALLY_ENOMEM, "redis: out of memory");
  rc->timeout_ms = opts->timeout_ms;
  if (opts->password) {
    rc->password = strdup(opts->password);
    rc->user = opts->user ? strdup(opts->user) : NULL;
    if (!rc->password || (opts->user && !rc->user)) {
      tally_rc_close(rc);
      return tally_error_set(TALLY_ENOMEM, "redis: out of memory");
    }
  }
  for (const char *p = seeds; *p;) {
    size_t len = strcspn(p, ",");
    while (len && p[0] == ' ') {
      p++;
      len--;
    }
    while (len && p[len - 1] == ' ') len--;
    if (len == 0 || node_parse(rc, p, len, NO_NODE) == NO_NODE) {
      tally_rc_close(rc);
      return tally_error_set(TALLY_EINVAL, "redis: bad seed list '%s'", seeds);
    }
    p += strcspn(p, ",");
    if (*p == ',' && *++p == '\0') { /* a trailing comma: an empty seed */
      tally_rc_close(rc);
      return tally_error_set(TALLY_EINVAL, "redis: bad seed list '%s'", seeds);
    }
  }
  int code = TALLY_ECONNECT;
  uint32_t nseeds = rc->nnodes; /* map_load may add nodes past the seeds */
  for (uint32_t i = 0; i < nseeds; i++) {
    redisReply *r;
    code = ask_slots(rc, (uint16_t)i, &r);
    if (code) continue;
    if (r->type == REDIS_REPLY_ARRAY && r->elements > 0) {
      rc->cluster = true;
      code = map_load(rc, r, (uint16_t)i);
    } else if (r->type == REDIS_REPLY_ERROR &&
               strstr(r->str, "cluster support disabled")) {
      for (uint32_t s = 0; s < TALLY_RC_SLOTS; s++) rc->slots[s] = (uint16_t)i;
      code = 0;
    } else {
      code = tally_error_set(TALLY_EREMOTE, "redis %s:%d: CLUSTER SLOTS: %s",
                             rc->nodes[i].host, rc->nodes[i].port,
                             r->type == REDIS_REPLY_ERROR ? r->str : "no slots assigned");
    }
    freeReplyObject(r);
    if (code == 0) {
      *out = rc;
      return 0;
    }
  }
  tally_rc_close(rc);
  return code;
}

void tally_rc_close(tally_rc *rc) {
  if (!rc) return;
  for (uint32_t i = 0; i < rc->nnodes; i++) {
    if (rc->nodes[i].c) redisFree(rc->nodes[i].c);
    free(rc->nodes[i].host);
  }
  free(rc->nodes);
  if (rc->password) {
    memset(rc->password, 0, strlen(rc->password)); /* best effort */
    free(rc->password);
  }
  free(rc->user);
  free(rc);
}

bool tally_rc_is_cluster(const tally_rc *rc) {
  return rc && rc->cluster;
}

void tally_rc_stats_get(const tally_rc *rc, tally_rc_stats *out) {
  if (out) *out = rc ? rc->stats : (tally_rc_stats){0};
}

/* ---- pipeline ------------------------------------------------------------ */

int tally_rc_pipe_new(tally_rc *rc, tally_rc_pipe **out) {
  if (!out) return tally_error_set(TALLY_EINVAL, "redis: NULL out");
  *out = NULL;
  if (!rc) return tally_error_set(TALLY_EINVAL, "redis: NULL handle");
  tally_rc_pipe *p = calloc(1, sizeof *p);
  if (!p) return tally_error_set(TALLY_ENOMEM, "redis: out of memory");
  p->rc = rc;
  *out = p;
  return 0;
}

void tally_rc_pipe_reset(tally_rc_pipe *p) {
  if (!p) return;
  for (uint32_t i = 0; i < p->n; i++) {
    if (p->cmds[i]->reply) freeReplyObject(p->cmds[i]->reply);
    free(p->cmds[i]);
  }
  p->n = 0;
}

void tally_rc_pipe_free(tally_rc_pipe *p) {
  if (!p) return;
  tally_rc_pipe_reset(p);
  free(p->cmds);
  free(p);
}

uint32_t tally_rc_pipe_count(const tally_rc_pipe *p) {
  return p ? p->n : 0;
}

const redisReply *tally_rc_pipe_reply(const tally_rc_pipe *p, uint32_t i) {
  return p && i < p->n ? p->cmds[i]->reply : NULL;
}

/* One allocation: the cmd, argv pointers, lengths, then the bytes. */
static struct cmd *cmd_new(const void *key, size_t key_len, int argc, const char **argv,
                           const size_t *argvlen) {
  size_t bytes = 0;
  for (int i = 0; i < argc; i++) bytes += (argvlen ? argvlen[i] : strlen(argv[i])) + 1;
  size_t head = sizeof(struct cmd) + (size_t)argc * (sizeof(char *) + sizeof(size_t));
  struct cmd *c = malloc(head + bytes);
  if (!c) return NULL;
  c->argc = argc;
  c->argv = (const char **)(c + 1);
  c->argvlen = (size_t *)(c->argv + argc);
  char *d = (char *)(c->argvlen + argc);
  for (int i = 0; i < argc; i++) {
    size_t l = argvlen ? argvlen[i] : strlen(argv[i]);
    memcpy(d, argv[i], l);
    d[l] = '\0';
    c->argv[i] = d;
    c->argvlen[i] = l;
    d += l + 1;
  }
  c->slot = key ? tally_rc_keyslot(key, key_len) : 0;
  c->ask = NO_NODE;
  c->node = NO_NODE;
  c->state = CMD_PENDING;
  c->attempts = 0;
  c->reply = NULL;
  return c;
}

static int check_args(const void *key, size_t key_len, int argc, const char **argv) {
  if (argc <= 0 || !argv || (!key && key_len))
    return tally_error_set(TALLY_EINVAL, "redis: bad command arguments");
  for (int i = 0; i < argc; i++)
    if (!argv[i]) return tally_error_set(TALLY_EINVAL, "redis: NULL argument %d", i);
  return 0;
}

int tally_rc_pipe_add(tally_rc_pipe *p, const void *key, size_t key_len, int argc,
                      const char **argv, const size_t *argvlen) {
  if (!p) return tally_error_set(TALLY_EINVAL, "redis: NULL pipeline");
  int code = check_args(key, key_len, argc, argv);
  if (code) return code;
  if (p->n == p->cap) {
    uint32_t cap = p->cap ? p->cap * 2 : 16;
    struct cmd **nc = realloc(p->cmds, cap * sizeof *nc);
    if (!nc) return tally_error_set(TALLY_ENOMEM, "redis: out of memory");
    p->cmds = nc;
    p->cap = cap;
  }
  struct cmd *c = cmd_new(key, key_len, argc, argv, argvlen);
  if (!c) return tally_error_set(TALLY_ENOMEM, "redis: out of memory");
  p->cmds[p->n++] = c;
  return 0;
}

static bool has_prefix(const redisReply *r, const char *pfx) {
  size_t l = strlen(pfx);
  return r->len >= l && memcmp(r->str, pfx, l) == 0;
}

/* Look at a reply from node `from` to command c: keep it, or turn it into
 * a redirection / retry. Returns true if the next round should back off. */
static bool take_reply(tally_rc *rc, struct cmd *c, redisReply *r, uint16_t from) {
  if (r->type == REDIS_REPLY_ERROR &&
      (has_prefix(r, "MOVED ") || has_prefix(r, "ASK "))) {
    /* "MOVED <slot> <host>:<port>" */
    bool moved = r->str[0] == 'M';
    const char *sp = strchr(r->str + (moved ? 6 : 4), ' ');
    uint16_t to =
        sp ? node_parse(rc, sp + 1, r->len - (size_t)(sp + 1 - r->str), from) : NO_NODE;
    if (to != NO_NODE) {
      if (moved) {
        if (rc->slots[c->slot] != to) rc->stats.topology++;
        rc->slots[c->slot] = to;
        rc->stale = true;
        rc->stats.moved++;
      } else {
        c->ask = to;
        rc->stats.asked++;
      }
      freeReplyObject(r);
      return false;
    } /* unparsable: hand it over as it is */
  } else if (r->type == REDIS_REPLY_ERROR &&
             (has_prefix(r, "TRYAGAIN") || has_prefix(r, "CLUSTERDOWN"))) {
    /* TRYAGAIN: a multi-key command mid-migration; CLUSTERDOWN: the
     * cluster is re-forming. Both pass by themselves. On the last attempt
     * the error reply is handed over rather than lost. */
    if (c->attempts < TALLY_RC_MAX_ATTEMPTS) {
      rc->stats.retries++;
      freeReplyObject(r);
      return true;
    }
  }
  c->reply = r;
  c->state = CMD_DONE;
  return false;
}

/* The first failure is the one reported. */
static void first_fail(int *code, char *msg, size_t cap, int now) {
  if (*code == 0 && now != 0) {
    *code = now;
    snprintf(msg, cap, "%s", tally_errmsg());
  }
}

/* Phase one for node ni: connect, append its pending commands (ASKING
 * before an ASK target's), write them all out. A command that could not be
 * appended was never sent and fails; if the write fails, some were sent,
 * so they all fail with unknown fate. When nothing reached the node (the
 * connect failed, or the first write failed with the buffer untouched) the
 * commands stay pending for a resend, up to TALLY_RC_CONNECT_TRIES sends,
 * and the map is reloaded first; returns true to ask for a backoff then. */
static bool node_send(tally_rc *rc, struct cmd **cmds, uint32_t n, uint16_t ni,
                      uint64_t deadline, int *code, char *msg, size_t cap) {
  struct node *nd = &rc->nodes[ni];
  bool unsent = false;
  int why = node_ready_x(rc, ni, deadline, &unsent);
  for (uint32_t i = 0; i < n; i++) {
    struct cmd *c = cmds[i];
    if (c->state != CMD_PENDING || c->node != ni) continue;
    if (!why && c->ask != NO_NODE && redisAppendCommand(nd->c, "ASKING") != REDIS_OK)
      why = node_fail(rc, nd, "append", errno);
    if (!why && redisAppendCommandArgv(nd->c, c->argc, c->argv, c->argvlen) != REDIS_OK)
      why = node_fail(rc, nd, "append", errno);
  }
  size_t queued = nd->c ? sdslen((sds)nd->c->obuf) : 0;
  int done = why != 0;
  while (!done)
    if (redisBufferWrite(nd->c, &done) != REDIS_OK) {
      /* hiredis drops written bytes from obuf: all there means none sent */
      unsent = sdslen((sds)nd->c->obuf) == queued;
      why = node_fail(rc, nd, "send", errno);
      break;
    }
  if (!why) return false;
  if (rc->cluster) rc->stale = true; /* the node may be gone: reload the map */
  bool retry = false, failed = false;
  for (uint32_t i = 0; i < n; i++) {
    struct cmd *c = cmds[i];
    if (c->state != CMD_PENDING || c->node != ni) continue;
    if (unsent && ++c->attempts < TALLY_RC_CONNECT_TRIES &&
        (uint64_t)tally_monotonic_ms() < deadline) {
      rc->stats.resent++;
      retry = true;
      continue; /* stays pending; its ASK, if any, still holds */
    }
    c->state = CMD_FAILED;
    failed = true;
  }
  if (retry) rc->refresh_now = true;
  if (failed) first_fail(code, msg, cap, why); /* a resend that works reports nothing */
  return retry;
}

/* Phase two for node ni: read its replies in send order. Returns true if a
 * TRYAGAIN / CLUSTERDOWN asks for a backoff. After a failed read the
 * connection is gone, and this and the later commands fail: they may or
 * may not have run. */
static bool node_recv(tally_rc *rc, struct cmd **cmds, uint32_t n, uint16_t ni, int *code,
                      char *msg, size_t cap) {
  struct node *nd = &rc->nodes[ni];
  bool backoff = false;
  for (uint32_t i = 0; i < n; i++) {
    struct cmd *c = cmds[i];
    if (c->state != CMD_PENDING || c->node != ni) continue;
    void *r = NULL;
    if (nd->c && c->ask != NO_NODE) {
      if (redisGetReply(nd->c, &r) == REDIS_OK)
        freeReplyObject(r); /* +OK; were it an error, the command's reply says why */
      else
        first_fail(code, msg, cap, node_fail(rc, nd, "read", errno));
    }
    c->ask = NO_NODE; /* ASKING covers this one send only */
    if (nd->c && redisGetReply(nd->c, &r) != REDIS_OK)
      first_fail(code, msg, cap, node_fail(rc, nd, "read", errno));
    if (!nd->c) {
      if (rc->cluster) rc->stale = true;
      c->state = CMD_FAILED;
      continue;
    }
    c->attempts++;
    backoff |= take_reply(rc, c, r, ni);
  }
  return backoff;
}

static int pipe_run(tally_rc *rc, struct cmd **cmds, uint32_t n) {
  uint64_t deadline = (uint64_t)tally_monotonic_ms() + rc->timeout_ms;
  uint32_t backoff = 0;
  int code = 0;
  char msg[512] = "";
  /* MOVED fixed its slot at once; the rest of the map is reloaded here, off
   * the redirection's path */
  if (rc->stale) tally_rc_refresh(rc);
  for (;;) {
    uint32_t pending = 0;
    for (uint32_t i = 0; i < n; i++) pending += cmds[i]->state == CMD_PENDING;
    if (!pending) break;
    if (backoff) {
      uint64_t now = (uint64_t)tally_monotonic_ms();
      sleep_ms(now + backoff < deadline ? backoff
                                        : (now < deadline ? deadline - now : 0));
    }
    if (rc->refresh_now) { /* a node refused: a failover may have moved its slots */
      rc->refresh_now = false;
      tally_rc_refresh(rc);
    }
    /* targets; fail what has none, no attempts or no time left */
    for (uint32_t i = 0; i < n; i++) {
      struct cmd *c = cmds[i];
      if (c->state != CMD_PENDING) continue;
      c->node = c->ask != NO_NODE ? c->ask : rc->slots[c->slot];
      int why = 0;
      if (c->node == NO_NODE)
        why = tally_error_set(TALLY_EREMOTE, "redis: no node serves slot %u", c->slot);
      else if (c->attempts >= TALLY_RC_MAX_ATTEMPTS)
        why = tally_error_set(TALLY_EREMOTE,
                              "redis: %s: gave up after %u redirections or retries",
                              c->argv[0], c->attempts);
      else if ((uint64_t)tally_monotonic_ms() >= deadline)
        why = tally_error_set(TALLY_ETIMEDOUT,
                              "redis: %s: no reply within %u ms "
                              "(redirections or retries)",
                              c->argv[0], rc->timeout_ms);
      if (why) {
        if (c->node == NO_NODE) rc->stale = true;
        c->state = CMD_FAILED;
        first_fail(&code, msg, sizeof msg, why);
      }
    }
    /* all nodes' commands go out before any reply is awaited, so the nodes
     * work in parallel */
    bool *used = calloc(rc->nnodes ? rc->nnodes : 1, sizeof *used);
    if (!used) {
      first_fail(&code, msg, sizeof msg,
                 tally_error_set(TALLY_ENOMEM, "redis: out of memory"));
      for (uint32_t i = 0; i < n; i++)
        if (cmds[i]->state == CMD_PENDING) cmds[i]->state = CMD_FAILED;
      break;
    }
    uint32_t nn = rc->nnodes; /* replies may add nodes: they wait for the next round */
    for (uint32_t i = 0; i < n; i++)
      if (cmds[i]->state == CMD_PENDING) used[cmds[i]->node] = true;
    bool again = false;
    for (uint32_t ni = 0; ni < nn; ni++)
      if (used[ni] &&
          node_send(rc, cmds, n, (uint16_t)ni, deadline, &code, msg, sizeof msg))
        again = true, used[ni] = false; /* nothing sent there: no replies to read */
    for (uint32_t ni = 0; ni < nn; ni++)
      if (used[ni]) again |= node_recv(rc, cmds, n, (uint16_t)ni, &code, msg, sizeof msg);
    free(used);
    /* exponential: a migration or an election takes a while */
    backoff = !again                         ? 0
              : !backoff                     ? BACKOFF_MIN_MS
              : backoff * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS
                                             : backoff * 2;
  }
  if (code) return tally_error_set(code, "%s", msg);
  return 0;
}

int tally_rc_pipe_exec(tally_rc_pipe *p) {
  if (!p) return tally_error_set(TALLY_EINVAL, "redis: NULL pipeline");
  for (uint32_t i = 0; i < p->n; i++) {
    struct cmd *c = p->cmds[i];
    if (c->state != CMD_FAILED) continue;
    c->state = CMD_PENDING; /* the caller chose to resend */
    c->attempts = 0;
    c->ask = NO_NODE;
  }
  return pipe_run(p->rc, p->cmds, p->n);
}

int tally_rc_command(tally_rc *rc, const void *key, size_t key_len, int argc,
                     const char **argv, const size_t *argvlen, redisReply **reply) {
  if (!reply) return tally_error_set(TALLY_EINVAL, "redis: NULL reply");
  *reply = NULL;
  if (!rc) return tally_error_set(TALLY_EINVAL, "redis: NULL handle");
  int code = check_args(key, key_len, argc, argv);
  if (code) return code;
  struct cmd *c = cmd_new(key, key_len, argc, argv, argvlen);
  if (!c) return tally_error_set(TALLY_ENOMEM, "redis: out of memory");
  code = pipe_run(rc, &c, 1);
  *reply = c->reply;
  free(c);
  return code;
}

int tally_rc_command_wait(tally_rc *rc, const void *key, size_t key_len, int argc,
                          const char **argv, const size_t *argvlen, uint32_t replicas,
                          uint32_t timeout_ms, redisReply **reply, long long *acked) {
  if (!reply || !acked) return tally_error_set(TALLY_EINVAL, "redis: NULL reply");
  *reply = NULL;
  *acked = -1;
  if (!rc) return tally_error_set(TALLY_EINVAL, "redis: NULL handle");
  int code = check_args(key, key_len, argc, argv);
  if (code) return code;
  char sn[16], st[16];
  snprintf(sn, sizeof sn, "%u", replicas);
  snprintf(st, sizeof st, "%u", timeout_ms);
  const char *wargv[] = {"WAIT", sn, st};
  struct cmd *c[2];
  c[0] = cmd_new(key, key_len, argc, argv, argvlen);
  c[1] = cmd_new(key, key_len, 3, wargv, NULL);
  if (!c[0] || !c[1]) {
    free(c[0]);
    free(c[1]);
    return tally_error_set(TALLY_ENOMEM, "redis: out of memory");
  }
  /* the call's own timeout must leave room for WAIT's */
  uint32_t saved = rc->timeout_ms;
  if (rc->timeout_ms < UINT32_MAX - timeout_ms) rc->timeout_ms += timeout_ms;
  code = pipe_run(rc, c, 2);
  if (c[0]->state == CMD_DONE && (c[1]->state != CMD_DONE || c[1]->node != c[0]->node)) {
    /* redirected (or WAIT lost): ask the node that ran the command */
    if (c[1]->reply) freeReplyObject(c[1]->reply);
    free(c[1]);
    c[1] = cmd_new(key, key_len, 3, wargv, NULL);
    if (c[1]) code = pipe_run(rc, &c[1], 1);
  }
  rc->timeout_ms = saved;
  if (c[1] && c[1]->reply && c[1]->reply->type == REDIS_REPLY_INTEGER)
    *acked = c[1]->reply->integer;
  *reply = c[0]->reply;
  if (c[0]->state == CMD_DONE) code = 0; /* the command ran: WAIT's fate is *acked */
  if (c[1] && c[1]->reply) freeReplyObject(c[1]->reply);
  free(c[0]);
  free(c[1]);
  return code;
}
