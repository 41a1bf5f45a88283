/* test_redis_cluster.c -- the Redis client (src/redis_cluster.c) on real servers.
 *
 * Starts, in $TALLY_TEST_TMP/redis-<pid>, one standalone redis-server and
 * a 3-master cluster on free 127.0.0.1 ports (cluster bus ports, port +
 * 10000, free too), and stops them by PID at exit, failures included (the
 * servers also die with the test: PR_SET_PDEATHSIG). Checks key slots
 * against CLUSTER KEYSLOT, routing over all masters, pipelines, a slot
 * migrated mid-run (ASK, MOVED), CLIENT KILL (reconnect) and a stopped
 * master (bounded error, then recovery).
 */
#include <limits.h>

#include "../src/net/redis_cluster.h" /* the client: commands, pipelines */
#include "redis_servers.h"

/* ---- helpers on the client ----------------------------------------------- */

static int incrby(tally_rc *rc, const char *key, long long by, long long *out) {
  char num[32];
  snprintf(num, sizeof num, "%lld", by);
  const char *argv[] = {"INCRBY", key, num};
  redisReply *r;
  int code = tally_rc_command(rc, key, strlen(key), 3, argv, NULL, &r);
  if (code) return code;
  if (r->type != REDIS_REPLY_INTEGER) {
    TU_FAIL("INCRBY %s: reply type %d (%s)", key, r->type,
            r->type == REDIS_REPLY_ERROR ? r->str : "");
    code = TALLY_ESYS;
  } else if (out) {
    *out = r->integer;
  }
  freeReplyObject(r);
  return code;
}

static long long get_int(tally_rc *rc, const char *key) {
  const char *argv[] = {"GET", key};
  redisReply *r;
  int code = tally_rc_command(rc, key, strlen(key), 2, argv, NULL, &r);
  if (code) {
    TU_FAIL("GET %s -> %s (%s)", key, tally_err_name(code), tally_errmsg());
    return LLONG_MIN;
  }
  long long v = r->type == REDIS_REPLY_STRING ? atoll(r->str)
                : r->type == REDIS_REPLY_NIL  ? 0
                                              : LLONG_MIN;
  freeReplyObject(r);
  return v;
}

/* Pipeline: INCRBY keys[i % nkeys] by (i % 7) + 1, n times; adds to want. */
static int pipe_incr(tally_rc *rc, char keys[][32], int nkeys, int n, long long *want) {
  tally_rc_pipe *p;
  REQUIRE_OK(tally_rc_pipe_new(rc, &p));
  for (int i = 0; i < n; i++) {
    char num[8];
    snprintf(num, sizeof num, "%d", i % 7 + 1);
    const char *k = keys[i % nkeys];
    const char *argv[] = {"INCRBY", k, num};
    REQUIRE_OK(tally_rc_pipe_add(p, k, strlen(k), 3, argv, NULL));
  }
  EXPECT_I64(n, tally_rc_pipe_count(p));
  int code = tally_rc_pipe_exec(p);
  for (int i = 0; i < n; i++) {
    const redisReply *r = tally_rc_pipe_reply(p, (uint32_t)i);
    if (r && r->type == REDIS_REPLY_INTEGER)
      want[i % nkeys] += i % 7 + 1;
    else if (code == 0)
      TU_FAIL("pipeline reply %d: %s", i, r ? r->str : "NULL");
  }
  EXPECT(tally_rc_pipe_reply(p, (uint32_t)n) == NULL);
  tally_rc_pipe_free(p);
  return code;
}

/* ---- tests --------------------------------------------------------------- */

static void test_keyslot(void) {
  static const char *fixed[] = {
      "",         "a", "foo", "{user}:1", "{user}:2", "a{}b",   "{}{x}", "{x}{y}",
      "a{b}c{d}", "{", "}",   "{}",       "x{y",      "x}y{z}", "{{a}}", "123456789"};
  int nfixed = (int)(sizeof fixed / sizeof fixed[0]);
  redisContext *c = raw(g_ports[1]);
  REQUIRE_OK(c ? 0 : TALLY_ESYS);
  char keys[2000][40];
  int n = 0;
  for (; n < nfixed; n++) snprintf(keys[n], sizeof keys[n], "%s", fixed[n]);
  uint64_t seed = 42;
  for (; n < 2000; n++) {
    int len = (int)(tu_rng(&seed) % 30);
    for (int j = 0; j < len; j++) keys[n][j] = "ab{}:xyz019"[tu_rng(&seed) % 11];
    keys[n][len] = '\0';
  }
  for (int i = 0; i < n; i++)
    redisAppendCommand(c, "CLUSTER KEYSLOT %b", keys[i], strlen(keys[i]));
  int bad = 0;
  for (int i = 0; i < n; i++) {
    void *v;
    REQUIRE_OK(redisGetReply(c, &v) == REDIS_OK ? 0 : TALLY_ESYS);
    redisReply *r = v;
    uint16_t mine = tally_rc_keyslot(keys[i], strlen(keys[i]));
    if (r->type != REDIS_REPLY_INTEGER || r->integer != mine) {
      if (bad++ < 5)
        TU_FAIL("keyslot(\"%s\") = %u, Redis says %lld", keys[i], mine, r->integer);
    }
    freeReplyObject(r);
  }
  redisFree(c);
  EXPECT_I64(0, bad);
  EXPECT_I64(12739, tally_rc_keyslot("123456789", 9)); /* CRC16 check value 0x31C3 */
  EXPECT_I64(tally_rc_keyslot("user", 4), tally_rc_keyslot("{user}:1", 8));
  EXPECT(tally_rc_keyslot("x", 1) !=
         tally_rc_keyslot("{}{x}", 5)); /* "{}" first: whole key */
}

static void test_open_errors(void) {
  tally_rc *rc = (tally_rc *)1;
  EXPECT_RC(TALLY_EINVAL, tally_rc_open("", 500, &rc));
  EXPECT(rc == NULL);
  EXPECT_RC(TALLY_EINVAL, tally_rc_open("localhost", 500, &rc));
  EXPECT_RC(TALLY_EINVAL, tally_rc_open("127.0.0.1:70000", 500, &rc));
  EXPECT_RC(TALLY_EINVAL, tally_rc_open("127.0.0.1:1,", 500, &rc));
  EXPECT_RC(TALLY_EINVAL, tally_rc_open("127.0.0.1:1", 0, &rc));
  /* nothing listens on port 1 */
  EXPECT_RC(TALLY_ECONNECT, tally_rc_open("127.0.0.1:1", 500, &rc));
  EXPECT(strstr(tally_errmsg(), "127.0.0.1:1") != NULL);
  EXPECT(rc == NULL);
}

static void test_standalone(void) {
  char seeds[64];
  snprintf(seeds, sizeof seeds, "127.0.0.1:1, 127.0.0.1:%d", g_ports[0]);
  tally_rc *rc;
  REQUIRE_OK(tally_rc_open(seeds, 1000, &rc)); /* first seed down: next one */
  EXPECT(!tally_rc_is_cluster(rc));
  long long v = 0;
  EXPECT_OK(incrby(rc, "s:a", 5, &v));
  EXPECT_I64(5, v);
  EXPECT_OK(incrby(rc, "{other}s:b", -3, &v));
  EXPECT_I64(-3, v);
  /* a non-redirect error is a reply, not a failure */
  const char *set[] = {"SET", "s:str", "x"};
  redisReply *r;
  EXPECT_OK(tally_rc_command(rc, "s:str", 5, 3, set, NULL, &r));
  freeReplyObject(r);
  const char *bad[] = {"INCRBY", "s:str", "1"};
  EXPECT_OK(tally_rc_command(rc, "s:str", 5, 3, bad, NULL, &r));
  EXPECT(r && r->type == REDIS_REPLY_ERROR && strstr(r->str, "not an integer"));
  if (r) freeReplyObject(r);
  /* binary-safe arguments (argvlen) and keyless commands */
  const char *bset[] = {"SET", "s:bin", "a\0b"};
  size_t blen[] = {3, 5, 3};
  EXPECT_OK(tally_rc_command(rc, "s:bin", 5, 3, bset, blen, &r));
  freeReplyObject(r);
  const char *sl[] = {"STRLEN", "s:bin"};
  EXPECT_OK(tally_rc_command(rc, "s:bin", 5, 2, sl, NULL, &r));
  EXPECT(r && r->integer == 3);
  freeReplyObject(r);
  const char *ping[] = {"PING"};
  EXPECT_OK(tally_rc_command(rc, NULL, 0, 1, ping, NULL, &r));
  EXPECT(r && r->type == REDIS_REPLY_STATUS && strcmp(r->str, "PONG") == 0);
  freeReplyObject(r);
  EXPECT_RC(TALLY_EINVAL, tally_rc_command(rc, "k", 1, 0, ping, NULL, &r));
  EXPECT(r == NULL);
  /* pipeline */
  char keys[10][32];
  long long want[10] = {0};
  for (int i = 0; i < 10; i++) snprintf(keys[i], sizeof keys[i], "sp:%d", i);
  EXPECT_OK(pipe_incr(rc, keys, 10, 500, want));
  for (int i = 0; i < 10; i++) EXPECT_I64(want[i], get_int(rc, keys[i]));
  /* CLIENT KILL: the idle connection is noticed and reopened */
  redisReply *k = rawcmd(g_ports[0], "CLIENT KILL TYPE normal SKIPME yes");
  EXPECT(k->type == REDIS_REPLY_INTEGER && k->integer >= 1);
  freeReplyObject(k);
  EXPECT_OK(incrby(rc, "s:a", 1, &v));
  EXPECT_I64(6, v);
  tally_rc_stats st;
  tally_rc_stats_get(rc, &st);
  EXPECT_I64(1, st.reconnects);
  EXPECT_I64(0, st.moved + st.asked);
  tally_rc_close(rc);
}

/* Keys with one tag each, chosen so every master owns some. */
static void spread_keys(char keys[][32], int n, const char *prefix) {
  for (int i = 0; i < n; i++) snprintf(keys[i], sizeof keys[i], "{%s%d}:c", prefix, i);
}

static void test_cluster_spread(tally_rc *rc) {
  EXPECT(tally_rc_is_cluster(rc));
  char keys[30][32];
  spread_keys(keys, 30, "t");
  int served[NMASTERS + 1] = {0};
  for (int i = 0; i < 30; i++) {
    long long v;
    EXPECT_OK(incrby(rc, keys[i], 1000 + i, &v));
    EXPECT_I64(1000 + i, v);
    uint16_t slot = tally_rc_keyslot(keys[i], strlen(keys[i]));
    int m = owner(slot);
    /* that master really holds the value (others would answer MOVED) */
    redisReply *r = rawcmd(g_ports[m], "GET %s", keys[i]);
    EXPECT(r->type == REDIS_REPLY_STRING && atoll(r->str) == 1000 + i);
    freeReplyObject(r);
    served[m]++;
  }
  for (int m = 1; m <= NMASTERS; m++) EXPECT(served[m] > 0);
  for (int i = 0; i < 30; i++) EXPECT_I64(1000 + i, get_int(rc, keys[i]));
}

static void test_cluster_pipeline(tally_rc *rc) {
  char keys[100][32];
  long long want[100] = {0};
  spread_keys(keys, 100, "p");
  double t0 = tu_now();
  EXPECT_OK(pipe_incr(rc, keys, 100, 1000, want));
  printf("pipeline of 1000 INCRBY over 100 slots: %.1f ms\n", (tu_now() - t0) * 1e3);
  for (int i = 0; i < 100; i++) EXPECT_I64(want[i], get_int(rc, keys[i]));
}

static void test_migration(tally_rc *rc) {
  /* ten keys in one slot, some existing before the migration starts */
  char keys[10][32];
  long long want[10] = {0};
  for (int i = 0; i < 10; i++) snprintf(keys[i], sizeof keys[i], "{mig}:%d", i);
  uint16_t slot = tally_rc_keyslot("mig", 3);
  int from = owner(slot), to = from % NMASTERS + 1;
  EXPECT_OK(pipe_incr(rc, keys, 5, 50, want)); /* keys 0..4 exist on `from` */
  tally_rc_stats st0;
  tally_rc_stats_get(rc, &st0);

  redisReply *r;
  r = rawcmd(g_ports[to], "CLUSTER SETSLOT %u IMPORTING %s", slot, g_ids[from]);
  EXPECT(r->type == REDIS_REPLY_STATUS);
  freeReplyObject(r);
  r = rawcmd(g_ports[from], "CLUSTER SETSLOT %u MIGRATING %s", slot, g_ids[to]);
  EXPECT(r->type == REDIS_REPLY_STATUS);
  freeReplyObject(r);
  /* keys 5..9 do not exist on `from`: ASK sends them to `to` */
  EXPECT_OK(pipe_incr(rc, keys, 10, 200, want));
  tally_rc_stats st1;
  tally_rc_stats_get(rc, &st1);
  EXPECT(st1.asked > st0.asked);

  /* move what `from` still has, then serve the slot from `to` */
  r = rawcmd(g_ports[from], "CLUSTER GETKEYSINSLOT %u 100", slot);
  EXPECT(r->type == REDIS_REPLY_ARRAY && r->elements == 5);
  for (size_t i = 0; i < r->elements; i++) {
    redisReply *m = rawcmd(g_ports[from], "MIGRATE 127.0.0.1 %d %s 0 5000", g_ports[to],
                           r->element[i]->str);
    EXPECT(m->type == REDIS_REPLY_STATUS);
    freeReplyObject(m);
    if (i == 1) EXPECT_OK(pipe_incr(rc, keys, 10, 100, want)); /* half moved */
  }
  freeReplyObject(r);
  EXPECT_OK(pipe_incr(rc, keys, 10, 100, want)); /* all moved: every key is ASKed */
  for (int m = 1; m <= NMASTERS; m++) {
    r = rawcmd(g_ports[m], "CLUSTER SETSLOT %u NODE %s", slot, g_ids[to]);
    EXPECT(r->type == REDIS_REPLY_STATUS);
    freeReplyObject(r);
  }
  /* the client still maps the slot to `from`, which now says MOVED */
  tally_rc_stats st2;
  tally_rc_stats_get(rc, &st2);
  EXPECT_OK(pipe_incr(rc, keys, 10, 100, want));
  tally_rc_stats st3;
  tally_rc_stats_get(rc, &st3);
  /* the whole pipeline was in flight to `from` before its first MOVED came
   * back, so each command was redirected once */
  EXPECT_I64(st2.moved + 100, st3.moved);
  EXPECT_OK(pipe_incr(rc, keys, 10, 100, want)); /* map fixed: no more MOVED */
  tally_rc_stats st4;
  tally_rc_stats_get(rc, &st4);
  EXPECT_I64(st3.moved, st4.moved);
  EXPECT(st4.refreshes > st2.refreshes); /* the map was reloaded after MOVED */
  for (int i = 0; i < 10; i++) {
    EXPECT_I64(want[i], get_int(rc, keys[i]));
    redisReply *g = rawcmd(g_ports[to], "GET %s", keys[i]);
    EXPECT(g->type == REDIS_REPLY_STRING && atoll(g->str) == want[i]);
    freeReplyObject(g);
  }
  EXPECT_I64(to, owner(slot));
  printf("migration: %llu ASK, %llu MOVED followed\n",
         (unsigned long long)(st3.asked - st0.asked),
         (unsigned long long)(st3.moved - st0.moved));
}

static void test_client_kill(tally_rc *rc) {
  char keys[30][32];
  spread_keys(keys, 30, "k");
  long long want[30] = {0};
  EXPECT_OK(pipe_incr(rc, keys, 30, 300, want)); /* connections to all masters */
  tally_rc_stats st0, st1;
  tally_rc_stats_get(rc, &st0);
  for (int m = 1; m <= NMASTERS; m++) {
    redisReply *r = rawcmd(g_ports[m], "CLIENT KILL TYPE normal SKIPME yes");
    EXPECT(r->type == REDIS_REPLY_INTEGER && r->integer >= 1);
    freeReplyObject(r);
  }
  EXPECT_OK(pipe_incr(rc, keys, 30, 300, want));
  tally_rc_stats_get(rc, &st1);
  EXPECT_I64(st0.reconnects + NMASTERS, st1.reconnects);
  EXPECT_I64(st0.errors, st1.errors); /* noticed before sending: no failure */
  for (int i = 0; i < 30; i++) EXPECT_I64(want[i], get_int(rc, keys[i]));
}

static void test_stopped_master(tally_rc *rc) {
  /* a key on master 2 and one elsewhere */
  char on2[32] = "", other[32] = "";
  for (int i = 0; !on2[0] || !other[0]; i++) {
    char k[32];
    snprintf(k, sizeof k, "{stop%d}", i);
    int m = owner(tally_rc_keyslot(k, strlen(k)));
    if (m == 2 && !on2[0]) snprintf(on2, sizeof on2, "%s", k);
    if (m != 2 && !other[0]) snprintf(other, sizeof other, "%s", k);
  }
  long long v;
  EXPECT_OK(incrby(rc, on2, 7, &v));
  /* stopped for less than the node timeout (2 s), so the cluster stays ok */
  kill(g_pids[2], SIGSTOP);
  double t0 = tu_now();
  const char *argv[] = {"GET", on2};
  redisReply *r = (redisReply *)1;
  EXPECT_RC(TALLY_ETIMEDOUT, tally_rc_command(rc, on2, strlen(on2), 2, argv, NULL, &r));
  double took = tu_now() - t0;
  EXPECT(r == NULL);
  EXPECT(strstr(tally_errmsg(), "timed out") != NULL);
  char port[16];
  snprintf(port, sizeof port, ":%d", g_ports[2]);
  EXPECT(strstr(tally_errmsg(), port) != NULL);
  printf("stopped master: %s after %.0f ms (%s)\n", tally_err_name(TALLY_ETIMEDOUT),
         took * 1e3, tally_errmsg());
  EXPECT(took < 0.6);                  /* the handle's timeout is 300 ms */
  EXPECT_OK(incrby(rc, other, 1, &v)); /* the other masters still answer */
  kill(g_pids[2], SIGCONT);
  EXPECT_I64(7, get_int(rc, on2));
  EXPECT_OK(incrby(rc, on2, 1, &v));
  EXPECT_I64(8, v);
  tally_rc_stats st;
  tally_rc_stats_get(rc, &st);
  EXPECT(st.errors >= 1);
}

int main(void) {
  double t0 = tu_now();
  start_all();
  test_keyslot();
  test_open_errors();
  test_standalone();

  char seeds[64];
  snprintf(seeds, sizeof seeds, "127.0.0.1:%d", g_ports[3]); /* one seed is enough */
  tally_rc *rc;
  REQUIRE_OK(tally_rc_open(seeds, 2000, &rc));
  test_cluster_spread(rc);
  test_cluster_pipeline(rc);
  test_migration(rc);
  test_client_kill(rc);
  tally_rc_close(rc);

  REQUIRE_OK(tally_rc_open(seeds, 300, &rc));
  test_stopped_master(rc);
  tally_rc_close(rc);

  stop_all();
  printf("total %.2f s\n", tu_now() - t0);
  return tu_finish("test_redis_cluster");
}
