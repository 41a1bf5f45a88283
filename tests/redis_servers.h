/* redis_servers.h -- real Redis servers for the C tests (not part of libtally).
 *
 * start_all() starts, in $TALLY_TEST_TMP/redis-<pid>, one standalone
 * redis-server and a 3-master cluster (redis-cli --cluster create) on free
 * 127.0.0.1 ports (cluster bus ports, port + 10000, free too), and
 * registers stop_all() with atexit: servers are stopped by PID (SIGCONT,
 * SIGTERM, SIGKILL after 3 s) and the directory removed, failures
 * included; they also die with the test (PR_SET_PDEATHSIG). A forked test
 * child must leave with _exit, or its atexit would stop the servers.
 *
 * g_ports[0] is the standalone server, g_ports[1..3] the masters, g_pids
 * and g_ids (cluster node ids) alike. raw()/rawcmd() are plain hiredis
 * connections for checks and admin commands; owner(slot) asks the cluster
 * which master serves a slot. stop_server(i) / restart_server(i) stop a
 * server cleanly and start it again on the same port, dir and cluster
 * config file (with --appendonly yes), keeping g_pids current.
 */
#ifndef TALLY_TEST_REDIS_SERVERS_H
#define TALLY_TEST_REDIS_SERVERS_H

#include <arpa/inet.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include "testutil.h"

#define NMASTERS 3

static const char *g_dir;
static pid_t g_pids[NMASTERS + 1];
static int g_ports[NMASTERS + 1]; /* [0] standalone, [1..3] cluster */
static char g_ids[NMASTERS + 1][48];

/* ---- servers ------------------------------------------------------------- */

__attribute__((unused)) static bool port_free(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bool ok = fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0;
  if (fd >= 0) close(fd);
  return ok;
}

__attribute__((unused)) static void pick_ports(void) {
  int p = 20000 + (int)(getpid() % 5000) * 2;
  for (int i = 0; i <= NMASTERS; p++) {
    if (p > 29999) p = 20000;
    if (port_free(p) && port_free(p + 10000)) g_ports[i++] = p;
  }
}

__attribute__((unused)) static void stop_all(void) {
  for (int i = 0; i <= NMASTERS; i++)
    if (g_pids[i] > 0) {
      kill(g_pids[i], SIGCONT);
      kill(g_pids[i], SIGTERM);
    }
  for (int i = 0; i <= NMASTERS; i++) {
    if (g_pids[i] <= 0) continue;
    double end = tu_now() + 3;
    while (waitpid(g_pids[i], NULL, WNOHANG) == 0) {
      if (tu_now() > end) {
        kill(g_pids[i], SIGKILL);
        waitpid(g_pids[i], NULL, 0);
        break;
      }
      usleep(10000);
    }
    g_pids[i] = 0;
  }
  if (g_dir) tu_rmrf(g_dir);
}

/* Start redis-server on port (its dir, log and cluster config file all named
 * by port, so a restart finds the same ones); appendonly: load and keep an
 * AOF (a restart after CONFIG SET appendonly yes then keeps its data). */
__attribute__((unused)) static pid_t start_server_aof(int port, bool cluster,
                                                      bool appendonly) {
  char dir[1200], conf[1300], log[1300], ps[16];
  const char *aof = appendonly ? "yes" : "no";
  snprintf(dir, sizeof dir, "%s/%d", g_dir, port);
  snprintf(conf, sizeof conf, "%s/nodes-%d.conf", g_dir, port);
  snprintf(log, sizeof log, "%s/%d.log", g_dir, port);
  snprintf(ps, sizeof ps, "%d", port);
  mkdir(dir, 0700);
  fflush(NULL); /* the child's freopen would write our buffered output again */
  pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive a crashed test */
    if (!freopen(log, "a", stdout) || !freopen(log, "a", stderr)) _exit(126);
    if (cluster)
      execlp("redis-server", "redis-server", "--cluster-enabled", "yes",
             "--cluster-config-file", conf, "--cluster-node-timeout", "2000", "--save",
             "", "--appendonly", aof, "--bind", "127.0.0.1", "--port", ps, "--dir", dir,
             "--daemonize", "no", (char *)NULL);
    else
      execlp("redis-server", "redis-server", "--save", "", "--appendonly", aof, "--bind",
             "127.0.0.1", "--port", ps, "--dir", dir, "--daemonize", "no", (char *)NULL);
    _exit(127);
  }
  return pid;
}

__attribute__((unused)) static pid_t start_server(int port, bool cluster) {
  return start_server_aof(port, cluster, false);
}

/* A plain hiredis connection for checks and admin commands. */
__attribute__((unused)) static redisContext *raw(int port) {
  struct timeval tv = {2, 0};
  redisContext *c = redisConnectWithTimeout("127.0.0.1", port, tv);
  if (!c || c->err) {
    if (c) redisFree(c);
    return NULL;
  }
  redisSetTimeout(c, tv);
  return c;
}

/* Run a command on port and return its reply (caller frees), or exit. */
__attribute__((unused)) static redisReply *rawcmd(int port, const char *fmt, ...) {
  redisContext *c = raw(port);
  if (!c) {
    fprintf(stderr, "FATAL: cannot connect to %d\n", port);
    exit(1);
  }
  va_list ap;
  va_start(ap, fmt);
  redisReply *r = redisvCommand(c, fmt, ap);
  va_end(ap);
  redisFree(c);
  if (!r) {
    fprintf(stderr, "FATAL: no reply from %d to %s\n", port, fmt);
    exit(1);
  }
  return r;
}

__attribute__((unused)) static bool wait_for(int port, const char *cmd, const char *want,
                                             double secs) {
  double end = tu_now() + secs;
  while (tu_now() < end) {
    redisContext *c = raw(port);
    if (c) {
      redisReply *r = redisCommand(c, cmd);
      bool ok = r && (r->type == REDIS_REPLY_STATUS || r->type == REDIS_REPLY_STRING) &&
                strstr(r->str, want);
      if (r) freeReplyObject(r);
      redisFree(c);
      if (ok) return true;
    }
    usleep(50000);
  }
  return false;
}

__attribute__((unused)) static void start_all(void) {
  double t0 = tu_now();
  g_dir = tu_tmpdir("redis");
  atexit(stop_all);
  pick_ports();
  for (int i = 0; i <= NMASTERS; i++) g_pids[i] = start_server(g_ports[i], i > 0);
  for (int i = 0; i <= NMASTERS; i++)
    if (!wait_for(g_ports[i], "PING", "PONG", 10)) {
      fprintf(stderr, "FATAL: redis-server on %d did not start (see %s)\n", g_ports[i],
              g_dir);
      exit(1);
    }
  char cmd[2048];
  snprintf(cmd, sizeof cmd,
           "redis-cli --cluster create 127.0.0.1:%d 127.0.0.1:%d 127.0.0.1:%d "
           "--cluster-replicas 0 --cluster-yes > '%s/create.log' 2>&1",
           g_ports[1], g_ports[2], g_ports[3], g_dir);
  if (system(cmd) != 0) {
    fprintf(stderr, "FATAL: redis-cli --cluster create failed (%s/create.log)\n", g_dir);
    exit(1);
  }
  for (int i = 1; i <= NMASTERS; i++) {
    if (!wait_for(g_ports[i], "CLUSTER INFO", "cluster_state:ok", 15)) {
      fprintf(stderr, "FATAL: cluster node %d not ok\n", g_ports[i]);
      exit(1);
    }
    redisReply *r = rawcmd(g_ports[i], "CLUSTER MYID");
    snprintf(g_ids[i], sizeof g_ids[i], "%s", r->str);
    freeReplyObject(r);
  }
  printf("servers up in %.2f s (standalone %d, cluster %d %d %d)\n", tu_now() - t0,
         g_ports[0], g_ports[1], g_ports[2], g_ports[3]);
}

/* Stop server i (SIGTERM: a clean shutdown, the AOF written) and reap it
 * within secs; SIGKILL and false if it did not exit in time. */
__attribute__((unused)) static bool stop_server(int i, double secs) {
  if (g_pids[i] <= 0) return false;
  kill(g_pids[i], SIGCONT);
  kill(g_pids[i], SIGTERM);
  double end = tu_now() + secs;
  while (waitpid(g_pids[i], NULL, WNOHANG) == 0) {
    if (tu_now() > end) {
      kill(g_pids[i], SIGKILL);
      waitpid(g_pids[i], NULL, 0);
      g_pids[i] = 0;
      return false;
    }
    usleep(5000);
  }
  g_pids[i] = 0;
  return true;
}

/* Start server i again on its port, dir and cluster config file, with
 * --appendonly yes (it loads the AOF a stopped server left), record its PID
 * for stop_all, and wait (secs) until it answers PING. */
__attribute__((unused)) static bool restart_server(int i, double secs) {
  g_pids[i] = start_server_aof(g_ports[i], i > 0, true);
  return g_pids[i] > 0 && wait_for(g_ports[i], "PING", "PONG", secs);
}

/* Which master (1..3) owns slot, asked of the cluster itself. */
__attribute__((unused)) static int owner(uint16_t slot) {
  redisReply *r = rawcmd(g_ports[1], "CLUSTER SLOTS");
  int who = 0;
  for (size_t i = 0; i < r->elements; i++) {
    redisReply *e = r->element[i];
    if (slot >= e->element[0]->integer && slot <= e->element[1]->integer)
      for (int m = 1; m <= NMASTERS; m++)
        if (e->element[2]->element[1]->integer == g_ports[m]) who = m;
  }
  freeReplyObject(r);
  return who;
}

#endif /* TALLY_TEST_REDIS_SERVERS_H */
