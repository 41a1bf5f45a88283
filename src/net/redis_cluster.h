/* redis_cluster.h -- the Redis and Redis Cluster client under the
 * flusher and the Lua binding (library-private: tally_net.h publishes
 * only the connection's open, close and stats, so hiredis's types are not
 * part of tally's interface).
 *
 * A small synchronous Redis client that routes by slot.
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
 * node: TALLY_ETIMEDOUT when the time ran out (a stopped node),
 * TALLY_ECONNECT when a connection could not be made or was lost,
 * TALLY_EREMOTE for too many redirections, a cluster with no node for a
 * slot and a reply that does not parse, TALLY_ENOMEM, TALLY_EINVAL for bad
 * arguments (a bad address among them).
 * A handle is not thread-safe: use one per thread.
 */

#ifndef TALLY_REDIS_CLUSTER_H
#define TALLY_REDIS_CLUSTER_H

#include <hiredis/hiredis.h>

#include "tally_net.h"

#define TALLY_RC_SLOTS         16384u
#define TALLY_RC_MAX_ATTEMPTS  16u /* sends of one command, redirections included */
#define TALLY_RC_CONNECT_TRIES 5u  /* sends of one command whose connects failed */

typedef struct tally_rc_pipe tally_rc_pipe;

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
                     const char **argv, const size_t *argvlen, redisReply **reply);

/* tally_rc_command followed, pipelined on the same connection, by
 * WAIT replicas timeout_ms: *acked gets how many replicas acknowledged
 * every write of that connection so far (the command's included), -1 if
 * WAIT itself failed. Should the command be redirected, WAIT is sent again
 * to the node that ran it. A command that succeeded returns 0 whatever
 * *acked is: comparing it with replicas is the caller's business. */
int tally_rc_command_wait(tally_rc *rc, const void *key, size_t key_len, int argc,
                          const char **argv, const size_t *argvlen, uint32_t replicas,
                          uint32_t timeout_ms, redisReply **reply, long long *acked);

/* A pipeline. Commands are copied when added, so the caller's buffers may
 * be reused at once. */
int tally_rc_pipe_new(tally_rc *rc, tally_rc_pipe **out);
void tally_rc_pipe_free(tally_rc_pipe *p);  /* NULL is ignored */
void tally_rc_pipe_reset(tally_rc_pipe *p); /* drop commands, replies */
int tally_rc_pipe_add(tally_rc_pipe *p, const void *key, size_t key_len, int argc,
                      const char **argv, const size_t *argvlen);
uint32_t tally_rc_pipe_count(const tally_rc_pipe *p);

/* Send every command not yet answered and collect the replies. 0 when
 * every command has its reply; otherwise the first failure's code, and
 * the commands without a reply (tally_rc_pipe_reply gives NULL) may or
 * may not have run. Calling it again resends only those. */
int tally_rc_pipe_exec(tally_rc_pipe *p);

/* Reply to command i (in add order), owned by the pipeline; NULL if i is
 * out of range or the command has no reply. */
const redisReply *tally_rc_pipe_reply(const tally_rc_pipe *p, uint32_t i);

#endif
