/* tally_net.h -- the network layer of tally (libtally_net): an HTTP sender
 * for rollup sinks, a connection to Redis or Redis Cluster, and the flusher that
 * ships local counters to Redis exactly once.
 *
 * Built on libtally (tally.h) and on libcurl and hiredis, which only this
 * layer links: a program that needs only counters links libtally alone.
 * Failures are reported as in the core: 0 or a negative TALLY_E* code, with
 * tally_errmsg() naming the peer. Network failures have codes of their
 * own: TALLY_ECONNECT (no connection, or it was lost), TALLY_EREMOTE (the
 * peer answered with an error, or with something that does not parse),
 * TALLY_ETIMEDOUT (the time given ran out).
 */
#ifndef TALLY_NET_H
#define TALLY_NET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tally.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- HTTP sender ------------------------------------------------------- */

/* A background thread that delivers request bodies to one URL with
 * libcurl, so a slow or dead HTTP sink never blocks the caller. Bodies
 * wait in a bounded queue (counted in records, the unit the caller gives
 * each body) and are sent one at a time, in the order posted, over a kept-
 * alive connection. A failed request (no connection, timeout, a 5xx, 408
 * or 429 status) is retried with exponential backoff, oldest body first; a
 * success resets the backoff. A body the peer refuses (any other 4xx) is
 * dropped and counted as rejected: sent again it would fail again, and
 * hold up every body behind it. When a new body does not fit, the oldest
 * waiting bodies are dropped to make room, and counted. Requests carry the
 * caller's headers and those libcurl adds (Host, Content-Length, and a
 * Content-Type of application/x-www-form-urlencoded unless one is given);
 * the answer's body is ignored. */
typedef struct tally_sender tally_sender;

typedef struct tally_sender_options {
  const char *url;            /* http:// or https:// */
  const char *method;         /* "POST" (NULL) or "PUT" */
  const char *const *headers; /* "Name: value" strings, NULL-terminated; may be NULL */
  uint32_t timeout_ms;        /* whole request; 0 means 5000 */
  uint32_t max_queue;         /* records waiting at most, besides the body
                                  in flight; 0 means 100000 */
  uint32_t backoff_ms;        /* first retry delay; 0 means 100 */
  uint32_t max_backoff_ms;    /* retry delay cap (the delay doubles up to
                                  it); 0 means 5000 */
} tally_sender_options;

typedef struct tally_sender_stats {
  uint64_t sent;       /* records delivered (2xx answers) */
  uint64_t requests;   /* requests that succeeded */
  uint64_t failures;   /* requests that failed (each retry counts) */
  uint64_t dropped;    /* records dropped: queue full, too big, refused by
                           the peer, or closed */
  uint64_t queued;     /* records not yet delivered nor dropped (waiting or
                           in flight) */
  uint64_t rejected;   /* of dropped: refused by the peer with a 4xx status
                           other than 408 and 429, so never retried */
  int32_t last_status; /* HTTP status of the last request's answer, 0 if it
                           got none (connection failed, timed out) */
  uint32_t pad_;
  char last_error[256]; /* the last failure ("HTTP 500" or libcurl's text),
                           "" if none; a later success keeps it */
} tally_sender_stats;

/* Start a sender (its thread and its curl handles; options are copied).
 * TALLY_EINVAL for a NULL url or one not http(s)://, a method other than
 * POST and PUT, or a header that is not "Name: value" on one line;
 * TALLY_ENOMEM; TALLY_ESYS if libcurl or the thread cannot start. */
TALLY_API int tally_sender_open(const tally_sender_options *o, tally_sender **out);
/* Queue a copy of body (records: how many records it carries, >= 1).
 * Never waits for the network. A body of more than max_queue records is
 * dropped at once (counted; still 0). TALLY_EINVAL for records 0 or a NULL
 * body with len > 0; TALLY_ENOMEM. */
TALLY_API int tally_sender_post(tally_sender *s, const void *body, size_t len,
                                uint32_t records);
/* Wait until nothing is waiting or in flight: 0, or TALLY_ETIMEDOUT after
 * timeout_ms (0: just check). */
TALLY_API int tally_sender_flush(tally_sender *s, uint32_t timeout_ms);
/* A consistent snapshot; all zero for a NULL sender. */
TALLY_API void tally_sender_stats_get(tally_sender *s, tally_sender_stats *out);
/* Deliver what is queued for up to drain_ms (a request still in flight
 * then is cut short), then stop the thread and free the sender; what was
 * not delivered is dropped. No other call on s may run during or after
 * it. NULL is allowed. */
TALLY_API void tally_sender_close(tally_sender *s, uint32_t drain_ms);

/* ---- Redis and Redis Cluster connection --------------------------------
 *
 * The connection a flusher ships through: to a standalone Redis or a Redis
 * Cluster (the slot map from CLUSTER SLOTS, one connection per node,
 * MOVED, ASK, TRYAGAIN and CLUSTERDOWN followed, a failover's promoted
 * replica found by reloading the map). Every call on it is bounded by the
 * timeout given at open. A command is never resent after it may have
 * reached a server: exactly-once is the flusher's. With a password, every
 * connection authenticates first (AUTH user password with a user: Redis 6
 * ACL); neither is ever put in a message. The client itself (commands,
 * pipelines, replies) is the library's own, not part of this interface.
 * A handle is not thread-safe: use one per thread.
 */

typedef struct tally_rc tally_rc;

/* Counters since open; they only grow. */
typedef struct tally_rc_stats {
  uint64_t moved;      /* MOVED redirections followed */
  uint64_t asked;      /* ASK redirections followed */
  uint64_t retries;    /* TRYAGAIN / CLUSTERDOWN resends */
  uint64_t reconnects; /* connections reopened to a node seen before */
  uint64_t refreshes;  /* slot maps loaded (open included) */
  uint64_t errors;     /* failed connects, sends and reads */
  uint64_t resent;     /* commands resent after a connect that failed */
  uint64_t topology;   /* topology changes seen: MOVED, a reconnect, a
                           slot map that differs from the previous one */
} tally_rc_stats;

/* Options of tally_rc_open_opts. user and password are copied (NULL: none;
 * a user without a password is ignored). */
typedef struct tally_rc_opts {
  uint32_t timeout_ms; /* > 0 */
  const char *user;
  const char *password;
} tally_rc_opts;

/* Connect to the first reachable of seeds ("host:port[,host:port...]"),
 * ask it CLUSTER SLOTS, and use cluster mode if it answers with a map or
 * standalone mode if cluster support is disabled there. timeout_ms (> 0)
 * bounds each later call. On error *out is NULL and the code says why
 * (TALLY_EINVAL for malformed seeds; the last seed's failure otherwise). */
TALLY_API int tally_rc_open(const char *seeds, uint32_t timeout_ms, tally_rc **out);

/* The same, with a user and password to authenticate every connection.
 * A server that refuses them (or asks for a password none was given for)
 * fails the open with TALLY_EREMOTE and Redis' own reason (NOAUTH, WRONGPASS). */
TALLY_API int tally_rc_open_opts(const char *seeds, const tally_rc_opts *opts,
                                 tally_rc **out);

/* Close every connection and free rc. NULL is ignored. */
TALLY_API void tally_rc_close(tally_rc *rc);

/* Whether rc is in cluster mode (the seed answered CLUSTER SLOTS). */
TALLY_API bool tally_rc_is_cluster(const tally_rc *rc);
TALLY_API void tally_rc_stats_get(const tally_rc *rc, tally_rc_stats *out);

/* ---- Redis flusher --------------------------------------------------------
 *
 * exactly-once flushing of local counters to Redis (internal).
 *
 * A local store (memory or file) absorbs increments; a flusher ships them
 * to Redis or Redis Cluster through a tally_rc handle.
 *
 * Remote layout. A counter NAME has R remote shards (R is fixed per
 * deployment: every writer and reader must use the same R). Shard i
 * (0 <= i < R) is the hash
 *
 *     tally:{NAME#i}      (its own hash tag, so the shards of one counter
 *                          spread over the cluster's nodes)
 *
 * with the field `v`, the shard's total, and, per writer W, the field
 * `w:W`, "INC:VALUE": the local counter's incarnation (16 lowercase hex
 * digits, tally_counter_read) and the total that incarnation has
 * contributed through that shard. Values are int64 decimal strings; a
 * bare VALUE (written by versions before incarnations) is taken as the
 * current incarnation's, and rewritten with it on the next flush. A writer always flushes into shard FNV-1a-32(W) % R.
 * (A NAME containing '}' shortens the hash tag; the keys stay distinct, only
 * the spread over nodes suffers.)
 *
 * Writer. A writer is one local store and a caller-chosen id W (1..128
 * bytes, e.g. a random hex id the caller persists next to a file store).
 * Exactly one flusher at a time may flush a given (W, local store); two
 * processes flushing the same W concurrently are not supported.
 *
 * Exactly once, without a journal. The local counter's value IS the total
 * its incarnation has contributed to NAME. A flush of NAME runs one Lua
 * script (EVAL, never EVALSHA, so no NOSCRIPT) with KEYS[1] = the shard
 * key and ARGV = W, prev, new, delta, where prev is w:W as the flusher
 * believes it and new is "INC:value" for the local incarnation INC:
 *
 *     cur = HGET w:W (nil = "0")
 *     cur == prev : HINCRBY v delta; HSET w:W new; return 1  (applied)
 *     cur == new  : return 0               (already applied: a lost reply)
 *     otherwise   : return cur as a string (conflict)
 *
 * delta is value - prev's value when prev is of the same incarnation, and
 * value itself when prev is of an earlier one: that incarnation is over
 * (it expired, only once w:W held its final value, or it was dropped) and
 * the new one counts from 0. A delayed retry of an earlier incarnation's
 * script can never match, since prev names its incarnation.
 *
 * The delta travels as its own argument because Redis' Lua has only
 * doubles; the script trusts it. The flusher keeps prev per counter in
 * memory; on first use (or after a conflict-free restart) it reads w:W with
 * HGET, pipelined. On a conflict it adopts cur as prev and the counter is
 * flushed in the next round. So a crashed flusher loses nothing (the deltas
 * are still in the local store) and a retried flush is never counted twice
 * (compare-and-set on w:W). A delta new - prev that does not fit in int64
 * is refused (counted as an error, nothing sent); an HINCRBY that would
 * overflow `v` fails inside the script before anything is written.
 *
 * Re-verification. prev is a belief: a Redis master that acknowledged a
 * flush and died before its replica got it leaves a promoted replica with
 * an older w:W (and v), and nothing would be sent again while the local
 * counter stays idle. So the flusher forgets every prev (and reads w:W
 * again, pipelined, before its next scripts) after a topology change seen
 * by its tally_rc (a MOVED to another node, a reconnect, a slot map that
 * changed: tally_rc_stats.topology), at a slow regular interval
 * (tally_flusher_set_verify, default TALLY_FLUSH_VERIFY_MS; an idle
 * flusher sends nothing else, so the interval is what finds a failover
 * nobody wrote through), and on tally_flusher_verify. A w:W found lower
 * than believed is sent again through the same compare-and-set script:
 * exactly the missing amount, exactly once.
 *
 * Expiry. A round first registers (W, pattern) in the local store
 * (tally_store_ship), so upkeep keeps every counter the flusher covers
 * until its value is marked shipped. The flusher marks it
 * (tally_counter_ship) only when it has read w:W back from Redis with
 * that incarnation and value: after a script applied, the next round in
 * which the counter is quiet re-reads w:W (one HGET), so a flush that a
 * failover lost is sent again before the counter may expire. Before it
 * sends a script it marks the value unknown (TALLY_SHIP_UNKNOWN), so a
 * value that goes back to the last one read back (a decrement, a reset)
 * while Redis may hold the later one is held too, and read back again
 * (also after a script whose reply was lost).
 *
 * Consequences of "local value = contribution": resetting a local counter
 * flushes a negative delta (the remote total then no longer includes what
 * that writer had contributed); dropping it and creating it again does
 * not (a new incarnation: what the old one flushed stays).
 *
 * Reads. tally_flusher_remote_value sums `v` over the R shards
 * (scatter-gather, pipelined): it includes every flush that completed
 * before the call and none of the unflushed local deltas. The shards are
 * not read atomically together: flushes racing with the read may be
 * partly included, each one either wholly in a shard or not.
 *
 * Errors as elsewhere: 0 or a negative TALLY_E* code, tally_errmsg() for
 * details. A flusher is not thread-safe (one thread at a time); the local
 * store may be incremented by any thread or process meanwhile. Free the
 * flusher before closing its store or its tally_rc handle.
 */

#define TALLY_FLUSH_WRITER_MAX 128u   /* bytes in a writer id */
#define TALLY_FLUSH_VERIFY_MS  60000u /* default re-read interval of w:W */

typedef struct tally_flusher tally_flusher;

/* What one round did. */
typedef struct tally_flush_stats {
  uint64_t counters;  /* local counters matched and read */
  uint64_t unchanged; /* of those, nothing to send (local == known prev) */
  uint64_t flushed;   /* scripts that applied a delta (returned 1) */
  uint64_t already;   /* scripts that found the delta already applied (0) */
  uint64_t conflicts; /* scripts that found another w:W (prev adopted) */
  uint64_t errors;    /* counters that failed: no reply, error reply,
                          overflow, local read failure */
  uint64_t commands;  /* Redis commands sent (HGET + EVAL) */
  uint64_t bytes;     /* argument bytes of those commands */
  int64_t delta;      /* sum of the deltas applied (saturating) */
  uint64_t verified;  /* known w:W values read again (re-verification) */
  uint64_t repaired;  /* of those, found different from what was believed
                          (a flush lost in a failover): sent again */
  uint64_t entries;   /* counters the flusher keeps after the round, each
                          with what it knows of w:W and an open handle: the
                          live ones its rounds' patterns cover */
} tally_flush_stats;

/* A flusher for writer `writer` (NUL-terminated, 1..TALLY_FLUSH_WRITER_MAX
 * bytes) from `local` to `rc`, with remote_shards (1..TALLY_MAX_SHARDS)
 * remote shards per counter. Neither local nor rc is owned. */
TALLY_API int tally_flusher_new(tally_store *local, tally_rc *rc, const char *writer,
                                uint32_t remote_shards, tally_flusher **out);

/* One round over the local counters matching pattern (glob, plen bytes;
 * NULL or "*" for all): first the HGETs for counters whose prev is not
 * known yet, then one EVAL per counter whose local value differs from
 * prev, each batch pipelined per node. Counters that fail are left for the
 * next round. *st (may be NULL) is filled in every case. Returns 0 when no
 * counter failed, else the first failure's code (tally_errmsg() gives its
 * message). Nothing is ever resent inside a round. The round ends by
 * forgetting the counters the pattern covers that it did not find live
 * (dropped, expired): their entries go, their handles closed; a name made
 * again is read from Redis (HGET) before its first flush. */
TALLY_API int tally_flusher_run(tally_flusher *f, const char *pattern, size_t plen,
                                tally_flush_stats *st);

/* Re-read every w:W at most every ms milliseconds (0: only after topology
 * changes and tally_flusher_verify). */
TALLY_API void tally_flusher_set_verify(tally_flusher *f, uint32_t ms);

/* Forget what is believed of every w:W: the next round reads them again. */
TALLY_API void tally_flusher_verify(tally_flusher *f);

/* The remote total of counter name: the sum of `v` over its R shards.
 * TALLY_ERANGE if it does not fit in int64. */
TALLY_API int tally_flusher_remote_value(tally_flusher *f, const char *name, size_t len,
                                         int64_t *out);

/* Shard index this flusher's writer uses (FNV-1a-32(writer) % R), and the
 * key of shard i of name into buf (cap bytes, NUL-terminated); the key's
 * length, or TALLY_EINVAL if it does not fit. */
TALLY_API uint32_t tally_flusher_shard(const tally_flusher *f);
TALLY_API int tally_flusher_shard_key(const char *name, size_t len, uint32_t i, char *buf,
                                      size_t cap);

/* The Lua text of the flush script (for tests and tools). */
TALLY_API const char *tally_flusher_script(void);

/* Close the counter handles it holds and free f. NULL is ignored. */
TALLY_API void tally_flusher_free(tally_flusher *f);

#ifdef __cplusplus
}
#endif
#endif /* TALLY_NET_H */
