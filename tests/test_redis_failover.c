/* test_redis_failover.c -- the Redis client and flusher across a real
 * automatic failover: a 3-master, 3-replica Redis Cluster (redis-cli
 * --cluster create --cluster-replicas 1, node timeout 1500 ms,
 * cluster-replica-validity-factor 0 so a replica that lagged may still be
 * promoted), on free 127.0.0.1 ports, stopped by PID at exit.
 *
 * How a replica is made to miss a write for real: SIGSTOP alone is not
 * enough on loopback (the master's stream waits in the stopped replica's
 * socket buffer and is read on SIGCONT), so the replica is stopped, then
 * the master drops its replication link (CLIENT KILL TYPE replica) and the
 * write goes to the master only. The master is then SIGKILLed and the
 * replica continued: the other two masters mark it failed after the node
 * timeout and vote, and the replica promotes itself (automatic failover,
 * no CLUSTER FAILOVER). Each scenario checks that the promoted replica
 * really lacks the write before checking what tally does about it.
 *
 * (a) item 11: an acknowledged flush lost in the failover is sent again
 *     while the local counter stays idle (the flusher re-reads its w:W
 *     totals), exactly once: the remote total comes back to the local one.
 * (b) item 12: the first command sent on a handle opened before the
 *     failover, once the cluster is ok again, succeeds (its connect to the
 *     dead master is refused, nothing was sent: the map is reloaded and the
 *     command resent), and so does every flush round after it.
 * (c) item 13: increments sent with WAIT 1 (tally_rc_command_wait) and
 *     acknowledged by a replica survive the master's SIGKILL and the
 *     failover; those sent while the replica was cut off report acked 0
 *     (the caller is told) and are the ones lost.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/net/redis_cluster.h" /* the client: commands, pipelines */
#include "redis_servers.h"

#define NNODES       6
#define NODE_TIMEOUT "1500"

static pid_t f_pids[NNODES];
static int f_ports[NNODES];

static void f_stop_all(void) {
  for (int i = 0; i < NNODES; i++)
    if (f_pids[i] > 0) {
      kill(f_pids[i], SIGCONT);
      kill(f_pids[i], SIGTERM);
    }
  for (int i = 0; i < NNODES; i++) {
    if (f_pids[i] <= 0) continue;
    double end = tu_now() + 3;
    while (waitpid(f_pids[i], NULL, WNOHANG) == 0) {
      if (tu_now() > end) {
        kill(f_pids[i], SIGKILL);
        waitpid(f_pids[i], NULL, 0);
        break;
      }
      usleep(10000);
    }
    f_pids[i] = 0;
  }
  if (g_dir) tu_rmrf(g_dir);
}

static pid_t f_start(int port) {
  char dir[1200], conf[1300], log[1300], ps[16];
  snprintf(dir, sizeof dir, "%s/%d", g_dir, port);
  snprintf(conf, sizeof conf, "%s/nodes-%d.conf", g_dir, port);
  snprintf(log, sizeof log, "%s/%d.log", g_dir, port);
  snprintf(ps, sizeof ps, "%d", port);
  mkdir(dir, 0700);
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (!freopen(log, "a", stdout) || !freopen(log, "a", stderr)) _exit(126);
    execlp("redis-server", "redis-server", "--cluster-enabled", "yes",
           "--cluster-config-file", conf, "--cluster-node-timeout", NODE_TIMEOUT,
           "--cluster-replica-validity-factor", "0", "--save", "", "--appendonly", "no",
           "--bind", "127.0.0.1", "--port", ps, "--dir", dir, "--daemonize", "no",
           (char *)NULL);
    _exit(127);
  }
  return pid;
}

static int idx_of_port(int port) {
  for (int i = 0; i < NNODES; i++)
    if (f_ports[i] == port) return i;
  return -1;
}

/* Signal the server on port; never anything else (a pid of 0 or -1 would
 * signal this test's process group). */
static bool f_kill(int port, int sig) {
  int i = idx_of_port(port);
  if (i < 0 || f_pids[i] <= 0) {
    TU_FAIL("no server of ours on port %d", port);
    return false;
  }
  return kill(f_pids[i], sig) == 0;
}

static void f_start_all(void) {
  double t0 = tu_now();
  g_dir = tu_tmpdir("redis-failover");
  atexit(f_stop_all);
  /* 45000..49999 (bus ports 55000..59999): apart from redis_servers.h's
   * 20000..29999 and their bus ports, so the two tests can run at once */
  int p = 45000 + (int)(getpid() % 2500) * 2;
  for (int i = 0; i < NNODES; p++) {
    if (p > 49999) p = 45000;
    if (port_free(p) && port_free(p + 10000)) f_ports[i++] = p;
  }
  for (int i = 0; i < NNODES; i++) f_pids[i] = f_start(f_ports[i]);
  for (int i = 0; i < NNODES; i++)
    if (!wait_for(f_ports[i], "PING", "PONG", 10)) {
      fprintf(stderr, "FATAL: redis-server on %d did not start (see %s)\n", f_ports[i],
              g_dir);
      exit(1);
    }
  char cmd[2048];
  int n = snprintf(cmd, sizeof cmd, "redis-cli --cluster create");
  for (int i = 0; i < NNODES; i++)
    n += snprintf(cmd + n, sizeof cmd - (size_t)n, " 127.0.0.1:%d", f_ports[i]);
  snprintf(cmd + n, sizeof cmd - (size_t)n,
           " --cluster-replicas 1 --cluster-yes > '%s/create.log' 2>&1", g_dir);
  if (system(cmd) != 0) {
    fprintf(stderr, "FATAL: redis-cli --cluster create failed (%s/create.log)\n", g_dir);
    exit(1);
  }
  for (int i = 0; i < NNODES; i++)
    if (!wait_for(f_ports[i], "CLUSTER INFO", "cluster_state:ok", 20)) {
      fprintf(stderr, "FATAL: cluster node %d not ok\n", f_ports[i]);
      exit(1);
    }
  printf("6 nodes up in %.2f s (ports %d..)\n", tu_now() - t0, f_ports[0]);
}

/* Master and first replica ports of slot, asked of node `ask` (a replica
 * is listed once it has joined). */
static void roles_now(int ask, uint16_t slot, int *master, int *replica) {
  redisReply *r = rawcmd(ask, "CLUSTER SLOTS");
  *master = *replica = 0;
  for (size_t i = 0; i < r->elements; i++) {
    redisReply *e = r->element[i];
    if (slot < e->element[0]->integer || slot > e->element[1]->integer) continue;
    *master = (int)e->element[2]->element[1]->integer;
    if (e->elements > 3) *replica = (int)e->element[3]->element[1]->integer;
  }
  freeReplyObject(r);
}

static void roles(int ask, uint16_t slot, int *master, int *replica) {
  double end = tu_now() + 10;
  do {
    roles_now(ask, slot, master, replica);
    if (*replica) return;
    usleep(50000);
  } while (tu_now() < end);
}

/* Wait (secs) until replica's link to its master is up. */
static bool link_up(int replica, double secs) {
  return wait_for(replica, "INFO replication", "master_link_status:up", secs);
}

/* Cut `replica` off from `master` for real (see the header): SIGSTOP, then
 * the master drops the link. */
static void cut_off(int master, int replica) {
  f_kill(replica, SIGSTOP);
  freeReplyObject(rawcmd(master, "CLIENT KILL TYPE replica"));
}

/* SIGKILL master, SIGCONT replica, and wait (secs) until a surviving
 * master reports `replica` serving slot and every live node is ok. */
static bool fail_over(int master, int replica, uint16_t slot, int survivor, double secs) {
  int mi = idx_of_port(master);
  if (!f_kill(master, SIGKILL)) return false;
  waitpid(f_pids[mi], NULL, 0);
  f_pids[mi] = 0;
  f_kill(replica, SIGCONT);
  double t0 = tu_now(), end = t0 + secs;
  while (tu_now() < end) {
    int m, r;
    roles_now(survivor, slot, &m, &r);
    if (m == replica) {
      bool ok = true;
      for (int i = 0; i < NNODES; i++)
        if (f_pids[i] > 0 &&
            !wait_for(f_ports[i], "CLUSTER INFO", "cluster_state:ok", end - tu_now()))
          ok = false;
      if (ok) {
        printf("  failover of %d to %d in %.2f s\n", master, replica, tu_now() - t0);
        return true;
      }
    }
    usleep(100000);
  }
  return false;
}

static int64_t hget_v(int port, const char *key) {
  redisReply *r = rawcmd(port, "HGET %s v", key);
  int64_t v = r->type == REDIS_REPLY_STRING ? strtoll(r->str, NULL, 10) : -1;
  freeReplyObject(r);
  return v;
}

/* A live master that is neither a nor b. */
static int other_master(int a, int b, uint16_t slot_hint) {
  (void)slot_hint;
  for (int i = 0; i < NNODES; i++) {
    if (f_pids[i] <= 0 || f_ports[i] == a || f_ports[i] == b) continue;
    redisReply *r = rawcmd(f_ports[i], "ROLE");
    bool master = r->type == REDIS_REPLY_ARRAY && r->elements > 0 &&
                  strcmp(r->element[0]->str, "master") == 0;
    freeReplyObject(r);
    if (master) return f_ports[i];
  }
  return 0;
}

/* Nonzero unless both ports are servers of ours. */
static int survivor_check(int master, int replica) {
  return idx_of_port(master) < 0 || idx_of_port(replica) < 0;
}

/* (a) + (b): a flush lost in a failover, resent while idle; the first
 * command after the failover goes through. */
static void test_lost_flush(void) {
  printf("(a)(b) lost flush resent after a failover, first command after it\n");
  char seeds[32], key[128];
  snprintf(seeds, sizeof seeds, "127.0.0.1:%d", f_ports[0]);
  tally_store *local;
  REQUIRE_OK(tally_store_open("memory", NULL, &local));
  tally_counter *c;
  REQUIRE_OK(tu_counter(local, "fo-a", 4, TALLY_POLICY_THREAD, TALLY_COUNTER_CREATE, &c));
  tally_rc *rc, *rc2 = NULL;
  REQUIRE_OK(tally_rc_open(seeds, 3000, &rc));
  tally_flusher *f;
  REQUIRE_OK(tally_flusher_new(local, rc, "w-failover", 1, &f));
  tally_flusher_set_verify(f, 1000); /* the idle path: re-read every second */
  int klen = tally_flusher_shard_key("fo-a", 4, 0, key, sizeof key);
  uint16_t slot = tally_rc_keyslot(key, (size_t)klen);
  int master, replica;
  roles(f_ports[0], slot, &master, &replica);
  if (master <= 0 || replica <= 0 || survivor_check(master, replica)) {
    TU_FAIL("slot %u: no master and replica (%d, %d)", slot, master, replica);
    goto out;
  }
  EXPECT(link_up(replica, 10));

  tally_flush_stats st;
  EXPECT_OK(tally_counter_incr(c, 100));
  EXPECT_OK(tally_flusher_run(f, NULL, 0, &st));
  EXPECT_I64(1, st.flushed);
  freeReplyObject(rawcmd(master, "WAIT 1 2000")); /* the replica has 100 */

  /* a second handle, connected to the master before the failover (b) */
  REQUIRE_OK(tally_rc_open(seeds, 3000, &rc2));
  char k2[160];
  snprintf(k2, sizeof k2, "b:{fo-a#0}");
  const char *argv[] = {"INCRBY", k2, "1"};
  redisReply *rp = NULL;
  EXPECT_OK(tally_rc_command(rc2, k2, strlen(k2), 3, argv, NULL, &rp));
  if (rp) freeReplyObject(rp);

  cut_off(master, replica);
  EXPECT_OK(tally_counter_incr(c, 50));
  EXPECT_OK(tally_flusher_run(f, NULL, 0, &st));
  EXPECT_I64(1, st.flushed); /* acknowledged by the master */
  EXPECT_I64(150, hget_v(master, key));
  int survivor = other_master(master, replica, slot);
  if (!fail_over(master, replica, slot, survivor, 30)) {
    TU_FAIL("no automatic failover of %d to %d within 30 s", master, replica);
    goto out;
  }
  /* the scenario is real: the promoted replica lacks the flush */
  EXPECT_I64(100, hget_v(replica, key));

  /* (b) the first command on the old handle: connect to the dead master
   * refused, nothing sent, map reloaded, resent to the new master */
  tally_rc_stats rs;
  rp = NULL;
  EXPECT_OK(tally_rc_command(rc2, k2, strlen(k2), 3, argv, NULL, &rp));
  EXPECT(rp && rp->type == REDIS_REPLY_INTEGER);
  if (rp) freeReplyObject(rp);
  tally_rc_stats_get(rc2, &rs);
  EXPECT(rs.resent >= 1);

  /* (a) the local counter stays idle; rounds until the remote total is the
   * local one again, each round succeeding (b) */
  uint64_t repaired = 0, flushed = 0;
  int64_t remote = -1;
  double end = tu_now() + 15;
  while (tu_now() < end) {
    EXPECT_OK(tally_flusher_run(f, NULL, 0, &st));
    repaired += st.repaired;
    flushed += st.flushed;
    EXPECT_OK(tally_flusher_remote_value(f, "fo-a", 4, &remote));
    if (remote == 150) break;
    usleep(100000);
  }
  EXPECT_I64(150, remote);
  EXPECT_I64(1, repaired);
  EXPECT_I64(1, flushed);
  /* exactly once: more verified rounds send nothing */
  for (int i = 0; i < 3; i++) {
    tally_flusher_verify(f);
    EXPECT_OK(tally_flusher_run(f, NULL, 0, &st));
    EXPECT_I64(1, st.verified);
    EXPECT_I64(0, st.repaired);
    EXPECT_I64(0, st.flushed);
  }
  EXPECT_OK(tally_flusher_remote_value(f, "fo-a", 4, &remote));
  EXPECT_I64(150, remote);
  EXPECT_I64(150, hget_v(replica, key));
out:
  tally_flusher_free(f);
  tally_rc_close(rc);
  tally_rc_close(rc2);
  tally_counter_close(c);
  tally_store_close(local);
}

/* (c) WAIT 1: acknowledged increments survive the failover. */
static void test_wait(void) {
  printf("(c) increments acknowledged by a replica (WAIT) survive a failover\n");
  char seeds[32];
  snprintf(seeds, sizeof seeds, "127.0.0.1:%d", f_ports[0]);
  tally_rc *rc;
  REQUIRE_OK(tally_rc_open(seeds, 3000, &rc));
  /* a key on a master that still has a replica */
  char key[64];
  int master = 0, replica = 0;
  uint16_t slot = 0;
  int ask = other_master(0, 0, 0);
  for (int i = 0; i < 1000 && !replica; i++) {
    snprintf(key, sizeof key, "wait:{k%d}", i);
    slot = tally_rc_keyslot(key, strlen(key));
    roles(ask, slot, &master, &replica);
  }
  if (replica <= 0 || survivor_check(master, replica)) {
    TU_FAIL("no master with a replica left");
    tally_rc_close(rc);
    return;
  }
  EXPECT(link_up(replica, 10));
  const char *argv[] = {"INCRBY", key, "1"};
  long long acked;
  redisReply *rp;
  int64_t confirmed = 0;
  for (int i = 0; i < 200; i++) {
    rp = NULL;
    EXPECT_OK(
        tally_rc_command_wait(rc, key, strlen(key), 3, argv, NULL, 1, 1000, &rp, &acked));
    if (rp) freeReplyObject(rp);
    if (acked >= 1) confirmed++;
  }
  EXPECT_I64(200, confirmed);
  cut_off(master, replica);
  int lost = 0;
  for (int i = 0; i < 5; i++) {
    rp = NULL;
    EXPECT_OK(
        tally_rc_command_wait(rc, key, strlen(key), 3, argv, NULL, 1, 100, &rp, &acked));
    if (rp) freeReplyObject(rp);
    EXPECT_I64(0, acked); /* applied on the master only: the caller is told */
    lost += acked < 1;
  }
  EXPECT_I64(5, lost);
  int survivor = other_master(master, replica, slot);
  if (!fail_over(master, replica, slot, survivor, 30)) {
    TU_FAIL("no automatic failover of %d to %d within 30 s", master, replica);
  } else {
    redisReply *r = rawcmd(replica, "GET %s", key);
    EXPECT(r->type == REDIS_REPLY_STRING);
    EXPECT_I64(confirmed, r->type == REDIS_REPLY_STRING ? strtoll(r->str, NULL, 10) : -1);
    freeReplyObject(r);
    /* after the failover the promoted replica has no replica: WAIT says so */
    rp = NULL;
    EXPECT_OK(
        tally_rc_command_wait(rc, key, strlen(key), 3, argv, NULL, 1, 50, &rp, &acked));
    EXPECT(rp && rp->type == REDIS_REPLY_INTEGER && rp->integer == confirmed + 1);
    if (rp) freeReplyObject(rp);
    EXPECT_I64(0, acked);
  }
  tally_rc_close(rc);
}

int main(void) {
  double t0 = tu_now();
  f_start_all();
  test_lost_flush();
  printf("  (%.2f s)\n", tu_now() - t0);
  test_wait();
  f_stop_all();
  g_dir = NULL;
  printf("total %.2f s\n", tu_now() - t0);
  return tu_finish("test_redis_failover");
}
