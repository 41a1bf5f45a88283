/* redis_flush.h -- exactly-once flushing of local counters to Redis (internal).
 *
 * A local store (memory or file) absorbs increments; a flusher ships them
 * to Redis or Redis Cluster through a tally_rc handle (redis_cluster.h).
 *
 * Remote layout. A counter NAME has R remote shards (R is fixed per
 * deployment: every writer and reader must use the same R). Shard i
 * (0 <= i < R) is the hash
 *
 *     tally:{NAME#i}      (its own hash tag, so the shards of one counter
 *                          spread over the cluster's nodes)
 *
 * with the field `v`, the shard's total, and, per writer W, the field
 * `w:W`, the total W has contributed through that shard. Values are int64
 * decimal strings. A writer always flushes into shard FNV-1a-32(W) % R.
 * (A NAME containing '}' shortens the hash tag; the keys stay distinct, only
 * the spread over nodes suffers.)
 *
 * Writer. A writer is one local store and a caller-chosen id W (1..128
 * bytes, e.g. a random hex id the caller persists next to a file store).
 * Exactly one flusher at a time may flush a given (W, local store); two
 * processes flushing the same W concurrently are not supported.
 *
 * Exactly once, without a journal. The local counter's value IS the total
 * W has contributed to NAME. A flush of NAME runs one Lua script (EVAL,
 * never EVALSHA, so no NOSCRIPT) with KEYS[1] = the shard key and
 * ARGV = W, prev, new, new - prev:
 *
 *     cur = HGET w:W (nil = "0")
 *     cur == prev : HINCRBY v (new - prev); HSET w:W new; return 1  (applied)
 *     cur == new  : return 0               (already applied: a lost reply)
 *     otherwise   : return cur as a string (conflict)
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
 * Consequences of "local value = contribution": resetting or dropping and
 * re-creating a local counter flushes a negative delta (the remote total
 * then no longer includes what that writer had contributed).
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
#ifndef TALLY_REDIS_FLUSH_H
#define TALLY_REDIS_FLUSH_H

#include <stddef.h>
#include <stdint.h>

#include "tally.h"
#include "redis_cluster.h"

#define TALLY_FLUSH_WRITER_MAX 128u  /* bytes in a writer id */
#define TALLY_FLUSH_VERIFY_MS 60000u /* default re-read interval of w:W */

typedef struct tally_flusher tally_flusher;

/* What one round did. */
typedef struct tally_flush_stats {
  uint64_t counters;   /* local counters matched and read */
  uint64_t unchanged;  /* of those, nothing to send (local == known prev) */
  uint64_t flushed;    /* scripts that applied a delta (returned 1) */
  uint64_t already;    /* scripts that found the delta already applied (0) */
  uint64_t conflicts;  /* scripts that found another w:W (prev adopted) */
  uint64_t errors;     /* counters that failed: no reply, error reply,
                          overflow, local read failure */
  uint64_t commands;   /* Redis commands sent (HGET + EVAL) */
  uint64_t bytes;      /* argument bytes of those commands */
  int64_t delta;       /* sum of the deltas applied (saturating) */
  uint64_t verified;   /* known w:W values read again (re-verification) */
  uint64_t repaired;   /* of those, found different from what was believed
                          (a flush lost in a failover): sent again */
} tally_flush_stats;

/* A flusher for writer `writer` (NUL-terminated, 1..TALLY_FLUSH_WRITER_MAX
 * bytes) from `local` to `rc`, with remote_shards (1..TALLY_MAX_SHARDS)
 * remote shards per counter. Neither local nor rc is owned. */
int tally_flusher_new(tally_store *local, tally_rc *rc, const char *writer,
                      uint32_t remote_shards, tally_flusher **out);

/* One round over the local counters matching pattern (glob, plen bytes;
 * NULL or "*" for all): first the HGETs for counters whose prev is not
 * known yet, then one EVAL per counter whose local value differs from
 * prev, each batch pipelined per node. Counters that fail are left for the
 * next round. *st (may be NULL) is filled in every case. Returns 0 when no
 * counter failed, else the first failure's code (tally_errmsg() gives its
 * message). Nothing is ever resent inside a round. */
int tally_flusher_run(tally_flusher *f, const char *pattern, size_t plen,
                      tally_flush_stats *st);

/* Re-read every w:W at most every ms milliseconds (0: only after topology
 * changes and tally_flusher_verify). */
void tally_flusher_set_verify(tally_flusher *f, uint32_t ms);

/* Forget what is believed of every w:W: the next round reads them again. */
void tally_flusher_verify(tally_flusher *f);

/* The remote total of counter name: the sum of `v` over its R shards.
 * TALLY_ERANGE if it does not fit in int64. */
int tally_flusher_remote_value(tally_flusher *f, const char *name, size_t len,
                               int64_t *out);

/* Shard index this flusher's writer uses (FNV-1a-32(writer) % R), and the
 * key of shard i of name into buf (cap bytes, NUL-terminated); the key's
 * length, or TALLY_EINVAL if it does not fit. */
uint32_t tally_flusher_shard(const tally_flusher *f);
int tally_flusher_shard_key(const char *name, size_t len, uint32_t i, char *buf,
                            size_t cap);

/* The Lua text of the flush script (for tests and tools). */
const char *tally_flusher_script(void);

/* Close the counter handles it holds and free f. NULL is ignored. */
void tally_flusher_free(tally_flusher *f);

#endif /* TALLY_REDIS_FLUSH_H */
