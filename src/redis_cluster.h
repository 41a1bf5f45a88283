/* redis_cluster.h -- a small synchronous Redis client that routes by slot.
 *
 * Debian's hiredis (0.14) speaks to one server; this unit adds what a
 * Redis Cluster needs on top of it, and works unchanged on a standalone
 * server (every slot then maps to that one server):
 *
 *   - the slot map from CLUSTER SLOTS, one lazily opened connection per
 *     node, the key slot computed as Redis does (CRC16, {hash tags});
 *   - MOVED (the slot is re-pointed, the command resent, and the whole map
 *     refreshed after the call), ASK (ASKING then the command, to the named
 *     node, for that one command), TRYAGAIN and CLUSTERDOWN (resent after a
 *     short backoff);
 *   - a pipeline that sends commands grouped per node and hands the replies
 *     back in the order the commands were added; redirections are handled
 *     per command.
 *
 * Every call is bounded: at most TALLY_RC_MAX_ATTEMPTS sends per command
 * and about timeout_ms of wall time per call (each socket wait gets what
 * is left of it).
 *
 * A command is never resent after it may have reached a server: if the
 * connection fails or times out while its reply is awaited, the call
 * fails and that reply stays NULL, because an INCRBY cannot be told apart
 * from its retry (exactly-once belongs to the layer above). A connection
 * the server closed while it was idle (CLIENT KILL, server timeout, restart)
 * is noticed before sending and reopened, so it costs no failed call.
 * A command that surely never reached a server (the connect failed, e.g.
 * refused by a master that died in a failover, or the first write failed
 * with nothing written) is resent: the slot map is reloaded and the
 * command retried after a short backoff, at most TALLY_RC_CONNECT_TRIES
 * sends (as redis-py and go-redis do), so the first command after a
 * failover reaches the promoted replica once the cluster knows it.
 *
 * Authentication: with a password, every connection sends AUTH password
 * (AUTH user password with a user: Redis 6 ACL) before anything else.
 * A refused AUTH fails the call with Redis' reply (which never contains the
 * password); neither the password nor the user is ever put in a message.
 *
 * Replies are hiredis redisReply trees. tally_rc_command gives one the
 * caller frees with freeReplyObject; a pipeline owns its replies until it
 * is reset or freed. Error replies other than redirections (WRONGTYPE,
 * ERR ...) are replies, not failures: the call returns 0.
 *
 * Failures return a negative TALLY_E* code with tally_errmsg() naming the
 * node: TALLY_ETIMEDOUT when the time ran out (a stopped node), TALLY_ESYS
 * for other network failures, for too many redirections and for a reply
 * that does not parse, TALLY_ENOMEM, TALLY_EINVAL for bad arguments.
 * A handle is not thread-safe: use one per thread.
 */
#ifndef TALLY_REDIS_CLUSTER_H
#define TALLY_REDIS_CLUSTER_H

#include <hiredis/hiredis.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define TALLY_RC_SLOTS 16384u
#define TALLY_RC_MAX_ATTEMPTS 16u  /* sends of one command, redirections included */
#define TALLY_RC_CONNECT_TRIES 5u  /* sends of one command whose connects failed */

typedef struct tally_rc tally_rc;
typedef struct tally_rc_pipe tally_rc_pipe;

/* Counters since open; they only grow. */
typedef struct tally_rc_stats {
  uint64_t moved;       /* MOVED redirections followed */
  uint64_t asked;       /* ASK redirections followed */
  uint64_t retries;     /* TRYAGAIN / CLUSTERDOWN resends */
  uint64_t reconnects;  /* connections reopened to a node seen before */
  uint64_t refreshes;   /* slot maps loaded (open included) */
  uint64_t errors;      /* failed connects, sends and reads */
  uint64_t resent;      /* commands resent after a connect that failed */
  uint64_t topology;    /* topology changes seen: MOVED, a reconnect, a
                           slot map that differs from the previous one */
} tally_rc_stats;

/* Options of tally_rc_open_opts. user and password are copied (NULL: none;
 * a user without a password is ignored). */
typedef struct tally_rc_opts {
  uint32_t timeout_ms;   /* > 0 */
  const char *user;
  const char *password;
} tally_rc_opts;

/* Connect to the first reachable of seeds ("host:port[,host:port...]"),
 * ask it CLUSTER SLOTS, and use cluster mode if it answers with a map or
 * standalone mode if cluster support is disabled there. timeout_ms (> 0)
 * bounds each later call. On error *out is NULL and the code says why
 * (TALLY_EINVAL for malformed seeds; the last seed's failure otherwise). */
int tally_rc_open(const char *seeds, uint32_t timeout_ms, tally_rc **out);

/* The same, with a user and password to authenticate every connection.
 * A server that refuses them (or asks for a password none was given for)
 * fails the open with TALLY_ESYS and Redis' own reason (NOAUTH, WRONGPASS). */
int tally_rc_open_opts(const char *seeds, const tally_rc_opts *opts, tally_rc **out);

/* Close every connection and free rc. NULL is ignored. */
void tally_rc_close(tally_rc *rc);

bool tally_rc_is_cluster(const tally_rc *rc);
void tally_rc_stats_get(const tally_rc *rc, tally_rc_stats *out);

/* The slot of a key, as CLUSTER KEYSLOT computes it: CRC16 (XMODEM) mod
 * 16384 of the whole key, or of the part between the first '{' and the
 * first '}' after it when that part is not empty. */
uint16_t tally_rc_keyslot(const void *key, size_t len);

/* Reload the slot map from any reachable node (no-op when standalone). */
int tally_rc_refresh(tally_rc *rc);

/* Run one command: argv[0..argc) with lengths argvlen (NULL: strlen of
 * each), routed by key (key_len bytes; NULL routes to slot 0, for keyless
 * commands). On success *reply is the reply, to free with freeReplyObject;
 * on error it is NULL. */
int tally_rc_command(tally_rc *rc, const void *key, size_t key_len, int argc,
                     const char **argv, const size_t *argvlen,
                     redisReply **reply);

/* tally_rc_command followed, pipelined on the same connection, by
 * WAIT replicas timeout_ms: *acked gets how many replicas acknowledged
 * every write of that connection so far (the command's included), -1 if
 * WAIT itself failed. Should the command be redirected, WAIT is sent again
 * to the node that ran it. A command that succeeded returns 0 whatever
 * *acked is: comparing it with replicas is the caller's business. */
int tally_rc_command_wait(tally_rc *rc, const void *key, size_t key_len, int argc,
                          const char **argv, const size_t *argvlen,
                          uint32_t replicas, uint32_t timeout_ms,
                          redisReply **reply, long long *acked);

/* A pipeline. Commands are copied when added, so the caller's buffers may
 * be reused at once. */
int tally_rc_pipe_new(tally_rc *rc, tally_rc_pipe **out);
void tally_rc_pipe_free(tally_rc_pipe *p);         /* NULL is ignored */
void tally_rc_pipe_reset(tally_rc_pipe *p);        /* drop commands, replies */
int tally_rc_pipe_add(tally_rc_pipe *p, const void *key, size_t key_len,
                      int argc, const char **argv, const size_t *argvlen);
uint32_t tally_rc_pipe_count(const tally_rc_pipe *p);

/* Send every command not yet answered and collect the replies. 0 when
 * every command has its reply; otherwise the first failure's code, and
 * the commands without a reply (tally_rc_pipe_reply gives NULL) may or
 * may not have run. Calling it again resends only those. */
int tally_rc_pipe_exec(tally_rc_pipe *p);

/* Reply to command i (in add order), owned by the pipeline; NULL if i is
 * out of range or the command has no reply. */
const redisReply *tally_rc_pipe_reply(const tally_rc_pipe *p, uint32_t i);

#endif /* TALLY_REDIS_CLUSTER_H */
