/* tally.h -- the whole public contract of libtally, a sharded-counter engine.
 *
 * A store holds counters. A counter is a name, a shard count (1..1024), a
 * shard policy and one signed 64-bit cell per shard; its value is the sum of
 * its cells. Increments pick one shard by policy and add to it atomically, so
 * any number of threads (and, for file stores, processes) may increment the
 * same counter at once.
 *
 * Conventions:
 *  - Functions that can fail return 0 or a negative TALLY_E* code; results
 *    come back through output pointers, which are untouched on failure.
 *  - tally_strerror(code) names a code; tally_errmsg() gives the calling
 *    thread's detailed message for its most recent failure (file names,
 *    errno text, counter names).
 *  - The library never prints, exits or aborts.
 *  - Plain fixed-width types only, so a LuaJIT FFI cdef can bind it as is.
 *  - Handles: a tally_counter is owned by the caller and must be closed
 *    before its store. Both may be shared by threads once opened.
 */
#ifndef TALLY_H
#define TALLY_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define TALLY_API __attribute__((visibility("default")))
#else
#define TALLY_API
#endif

#define TALLY_VERSION        "0.1.0"
#define TALLY_MAX_SHARDS     1024
#define TALLY_NAME_MAX       255 /* bytes; names are 1..255 bytes, no NUL */
/* New counters get automatic shards (TALLY_SHARDS_AUTO) and the thread
 * policy unless a family or the caller says otherwise; a key or shard
 * policy, which cannot have automatic shards, gets this many. */
#define TALLY_DEFAULT_SHARDS 16

/* Error codes: XX(NAME, code, static message). */
/* clang-format off */
#define TALLY_ERRNO_MAP(XX)                                                   \
  XX(EINVAL,    -1, "invalid argument")                                      \
  XX(ENOMEM,    -2, "out of memory")                                         \
  XX(ESYS,      -3, "system call failed")                                    \
  XX(ENOTSTORE, -4, "not a tally store")                                     \
  XX(EVERSION,  -5, "unsupported tally store version or layout")             \
  XX(ECORRUPT,  -6, "tally store is corrupt")                                \
  XX(ENOENT,    -7, "no such counter")                                       \
  XX(EMISMATCH, -8, "counter exists with different options")                 \
  XX(EDROPPED,  -9, "counter was dropped")                                   \
  XX(ERANGE,   -10, "counter value out of range")                            \
  XX(ESHARDS,  -11, "shard count out of range")                              \
  XX(ENAME,    -12, "invalid counter name")                                  \
  XX(EPOLICY,  -13, "invalid shard policy")                                  \
  XX(EFULL,    -14, "store is full")                                         \
  XX(EBUSY,    -15, "store is in use")                                     \
  XX(ETIMEDOUT, -16, "timed out")                                            \
  XX(ENOROLLUP, -17, "no rollup for this counter")                          \
  XX(EUNTRUSTED, -18, "store file is a symlink or another user's")         \
  XX(ECONNECT, -19, "cannot reach the server, or the connection was lost") \
  XX(EREMOTE,  -20, "the server answered with an error")                    \
  XX(EREPLICAS, -21, "fewer replicas acknowledged than asked for")         \
  XX(EEXIST,   -22, "counter exists")

enum {
#define TALLY_XX_(name, code, msg) TALLY_##name = code,
  TALLY_ERRNO_MAP(TALLY_XX_)
#undef TALLY_XX_
  TALLY_OK = 0
};
/* clang-format on */

/* For libraries built on this one (libtally_net, bindings): record code
 * and a printf-style message as this thread's last error, as the library's
 * own failures do, and return code. */
TALLY_API int tally_error_set(int code, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* CLOCK_MONOTONIC in nanoseconds and milliseconds: the clock the library
 * measures leases, waits and timeouts with. Never fails. */
TALLY_API int64_t tally_monotonic_ns(void);
TALLY_API int64_t tally_monotonic_ms(void);

/* Static text for a code ("unknown error" for codes not listed). */
TALLY_API const char *tally_strerror(int code);
/* Symbolic name of a code ("ECORRUPT"), or "UNKNOWN". */
TALLY_API const char *tally_err_name(int code);
/* The calling thread's message for its most recent failure, with details,
 * e.g. "data/x.tly: not a tally store (bad magic)". Never NULL. */
TALLY_API const char *tally_errmsg(void);
/* text (len bytes) as tally's messages write names, which are any bytes
 * but NUL: valid UTF-8 as it is, control characters (C0 with NUL, DEL,
 * C1) and bytes outside a valid UTF-8 sequence as \xNN, so a name cannot
 * forge a log line or drive a terminal. Writes what fits of it in whole
 * characters and escapes into out (cap bytes, NUL added; none if cap is
 * 0) and returns the length of the whole, as snprintf does. */
TALLY_API size_t tally_printable(char *out, size_t cap, const char *text, size_t len);
/* The number of characters of text (len bytes) if it is valid UTF-8,
 * strictly (no overlong form, no surrogate, nothing past U+10FFFF; as Lua
 * 5.4's utf8.len), else -1 and *bad (when not NULL) the offset of the
 * first byte of the first invalid sequence. tally_printable's rule, and
 * the one for Prometheus label values and JSON strings. */
TALLY_API int64_t tally_utf8_len(const char *text, size_t len, size_t *bad);
/* A URI (len bytes) as messages show it, credentials and options hidden:
 * its userinfo (after "://", up to the last '@' before the first '?') and
 * its query (from the first '?') are each shown as "***", host, port and
 * path as they are. With an '@' after the '?' (a password with a '?' in
 * it, or a query value with an '@') no part of the authority is safe to
 * show: all of it is "***" too. Text without "://" is itself. Writes what
 * fits into out (cap bytes, NUL added; none if cap is 0) and returns the
 * length of the whole, as snprintf does. */
TALLY_API size_t tally_uri_redact(char *out, size_t cap, const char *uri, size_t len);

/* Shard policies. CUSTOM means the caller picks the shard itself (through
 * tally_counter_incr_shard); the Lua binding uses it for Lua functions. */
typedef enum tally_policy {
  TALLY_POLICY_THREAD = 0,      /* each thread/process keeps to its own shard */
  TALLY_POLICY_RANDOM = 1,      /* uniform random shard per increment */
  TALLY_POLICY_ROUND_ROBIN = 2, /* each thread cycles through the shards */
  TALLY_POLICY_KEY = 3,         /* hash of a caller-supplied key */
  TALLY_POLICY_CUSTOM = 4,      /* caller supplies the shard index */
  TALLY_POLICY_SLOT = 5,        /* batched: each writer thread owns one shard
                                   (TALLY_SLOT_SHARDS); see tally_batch_incr */
  TALLY_POLICY_CPU = 6,         /* one shard per CPU, added to without a locked
                                   instruction (restartable sequences) */
  TALLY_POLICY_COUNT_ = 7
} tally_policy;

/* "thread", "random", "round_robin", "key", "custom", "slot", "cpu"; NULL
 * if out of range. */
TALLY_API const char *tally_policy_name(int policy);
/* Policy for a name, or TALLY_EPOLICY. */
TALLY_API int tally_policy_parse(const char *name, size_t len);
/* The shard, 0 to n - 1 (n >= 1), that the key policy adds key (len
 * bytes) to among n: what tally_counter_incr_key picks, and the remote
 * stores too. Fixed by the file format: the same in every process and
 * every version that opens the store. */
TALLY_API uint32_t tally_key_shard(const void *key, size_t len, uint32_t n);
/* Shards of a TALLY_POLICY_CPU counter created here: 2P + 1 for the P
 * possible CPUs (P at most 511): shard 0 takes what resets remove from
 * the per-CPU shards, shards 1..P are the thread policy's (where a
 * thread has no restartable sequence), shards P+1..2P one per CPU. */
TALLY_API uint32_t tally_cpu_shards(void);

/* ---- stores ------------------------------------------------------------ */

typedef struct tally_store tally_store;

typedef struct tally_open_options {
  uint32_t mode;  /* permission bits (& 0777) for a new file store; 0: 0600 */
  uint32_t flags; /* TALLY_OPEN_* */
} tally_open_options;

#define TALLY_OPEN_NOCREATE 0x1u /* file store must already exist */
/* accept a symlink, or a file owned by another user (refused otherwise) */
#define TALLY_OPEN_TRUST    0x2u

/* Open a store. spec is NULL, "" or "memory" for a private in-process
 * store, or "file:PATH" for a memory-mapped file shared by every process
 * that opens it (created if missing unless TALLY_OPEN_NOCREATE). A file
 * that is not a tally store, of another version or layout, truncated or
 * corrupt, is refused (ENOTSTORE, EVERSION, ECORRUPT). A path that is a
 * symbolic link, or a file owned by a uid other than the process's
 * effective uid, is refused (EUNTRUSTED) unless TALLY_OPEN_TRUST: another
 * user could have planted it. opt may be NULL.
 *
 * The file is mapped: if another program truncates it, touching a page
 * past its new end raises SIGBUS in this process, which the library cannot
 * turn into an error. tally_store_check and tally_store_stats_get report
 * a truncated file (ECORRUPT) without touching such a page, and
 * tally_store_fault_path tells a SIGBUS handler which store it was. */
TALLY_API int tally_store_open(const char *spec, const tally_open_options *opt,
                               tally_store **out);
/* Close a store; NULL is allowed. Counters opened on it must be closed
 * first (their handles become invalid). Never fails. */
TALLY_API void tally_store_close(tally_store *s);
/* Flush a file store to disk (msync + fsync); no-op for memory stores. */
TALLY_API int tally_store_sync(tally_store *s);
/* "memory" or "file". */
TALLY_API const char *tally_store_kind(const tally_store *s);
/* Full consistency check of every structure in the store (file length,
 * headers, index, records, cell locations and values out of the live
 * range, rollup rings, families); 0 or TALLY_ECORRUPT. */
TALLY_API int tally_store_check(tally_store *s);
/* The path of the open file store whose mapping holds addr (a SIGBUS
 * handler's si_addr), or NULL. Reads the list of open stores without a
 * lock, so that a signal handler may call it: best effort while another
 * thread opens or closes a store. */
TALLY_API const char *tally_store_fault_path(const void *addr);

typedef struct tally_store_stats {
  uint64_t counters;       /* live counters */
  uint64_t file_bytes;     /* bytes the store occupies (file length) */
  uint64_t used_bytes;     /* bytes of the arena handed out so far */
  uint64_t live_bytes;     /* used_bytes less retired and reusable */
  uint64_t retired_bytes;  /* left behind by drop, expiry, reshard and index
                             growth, waiting out the grace period */
  uint64_t reusable_bytes; /* past it: on the free lists, handed out first */
  uint64_t reused_bytes;   /* handed out again, in all */
  uint64_t expired;        /* counters expired for idleness, in all */
  uint64_t capped;         /* new names sent to an overflow counter, in all */
  uint64_t max_bytes;      /* the most the store can grow to */
  uint64_t writers;        /* thread tickets drawn: each thread, in any
                              process, that incremented a thread-policy
                              counter of the store */
  uint32_t format;         /* file format version */
  uint32_t schedules;      /* rollup schedule identities the store keeps */
} tally_store_stats;

TALLY_API int tally_store_stats_get(tally_store *s, tally_store_stats *out);

/* ---- lifecycle: reuse, expiry ------------------------------------------ */

/* What a drop, an expiry, a reshard or the index's growth leaves behind is
 * reused once every live process that has the store open has passed a
 * grace step since (and the grace time has gone by since this process saw
 * that: 1 s, or TALLY_GRACE_MS milliseconds from the environment at
 * open). A process passes one in tally_store_maintain, and when it creates
 * or drops a counter; one that holds no counter handle never holds reuse
 * back, a dead one never does, a stopped one does until it runs again. */
typedef struct tally_maintain_result {
  uint64_t scanned; /* counters looked at for expiry */
  uint64_t expired; /* counters expired by this call */
  uint64_t held;    /* idle counters kept until a rollup records their
                       final value */
} tally_maintain_result;

/* One bounded step of upkeep, for a host's timer (db:tick calls it): pass
 * a grace step, reuse what every process has passed, and look at up to
 * `budget` counters for idle expiry (families with idle_s) at now_ms (the
 * caller's clock, milliseconds; the same clock in every process; at most
 * TALLY_MAINTAIN_MAX_MS, the year 2106 of the Unix clock: TALLY_EINVAL
 * beyond). out may be NULL. */
#define TALLY_MAINTAIN_MAX_MS ((int64_t)(UINT32_MAX - 2) * 1000)
TALLY_API int tally_store_maintain(tally_store *s, int64_t now_ms, uint32_t budget,
                                   tally_maintain_result *out);

typedef struct tally_grace_info {
  uint64_t epoch;       /* the store's epoch */
  uint32_t processes;   /* live processes with the store open */
  uint32_t behind;      /* of those, how many hold reuse back */
  int64_t oldest_pid;   /* the one furthest behind, 0 if none */
  uint64_t oldest_seen; /* the epoch it has passed */
} tally_grace_info;

/* Who holds reuse back (for tally info). */
TALLY_API int tally_store_grace(tally_store *s, tally_grace_info *out);

/* Rewrite the file store at path with no retired or reusable space: the
 * counters (values, shards, policies), families, rollup records and
 * history are kept. TALLY_EBUSY if another live process has it open.
 * progress (may be NULL) is called with counters done and their total,
 * with the store locked: it must not fork() or use the store. */
typedef void (*tally_progress_fn)(void *ud, uint64_t done, uint64_t total);
TALLY_API int tally_store_compact(const char *path, uint32_t flags,
                                  tally_progress_fn progress, void *ud);

/* ---- counters ---------------------------------------------------------- */

typedef struct tally_counter tally_counter;

/* shards = TALLY_SHARDS_AUTO: the counter starts with one cell and the
 * engine reshards it online: it doubles (up to the writers seen, at most
 * the CPUs) when sampled increments find several writers on it within
 * TALLY_AUTO_WINDOW_MS, and upkeep (tally_store_maintain) takes it back to
 * one cell after TALLY_AUTO_QUIET_MS without such contention (kept in units
 * of 1024 ms: between that and 4.1 s more; at most 12 days). */
#define TALLY_SHARDS_AUTO    0xFFFFFFFFu
#define TALLY_AUTO_WINDOW_MS 2
#define TALLY_AUTO_QUIET_MS  60000 /* env TALLY_AUTO_QUIET_MS overrides it (0: at once) */

typedef struct tally_counter_options {
  uint32_t shards; /* 1..TALLY_MAX_SHARDS, TALLY_SHARDS_AUTO, or 0 for the
                      family/default */
  int32_t policy;  /* a tally_policy, or -1 for the family/default */
} tally_counter_options;

#define TALLY_COUNTER_CREATE 0x1u /* create the counter if it is absent */
#define TALLY_COUNTER_EXCL   0x2u /* with CREATE: a new one only (tally_counter_open) */

/* Open counter `name` (len bytes). With TALLY_COUNTER_CREATE it is created
 * if absent, with the options given, else its family's (most recently
 * defined matching family), else 16 shards and the thread policy. Options
 * that differ from an existing counter's give TALLY_EMISMATCH. Without
 * CREATE an absent counter gives TALLY_ENOENT. With CREATE and
 * TALLY_COUNTER_EXCL, a counter of that name that exists (made by anyone,
 * a moment before) gives TALLY_EEXIST: so a caller knows the counter it
 * opens is its own to drop again (an import undone). A family at its cap
 * still gives its overflow counter, as CREATE does. opt may be NULL. */
TALLY_API int tally_counter_open(tally_store *s, const char *name, size_t len,
                                 const tally_counter_options *opt, uint32_t flags,
                                 tally_counter **out);
/* Release a handle (not the counter); NULL is allowed. It may outlive its
 * store (closing it is then all it is good for). */
TALLY_API void tally_counter_close(tally_counter *c);

/* Add delta (any int64, negative allowed) to the shard the policy picks.
 * KEY policy counters need incr_key; CUSTOM ones need incr_shard (both
 * give TALLY_EPOLICY here). TALLY_ERANGE if the shard would leave
 * [-2^62, 2^62) (nothing is added); TALLY_EDROPPED if the counter was
 * dropped. */
TALLY_API int tally_counter_incr(tally_counter *c, int64_t delta);
/* Add delta to the shard chosen by hashing key (same key, same shard while
 * the shard count stays). Works under any policy. */
TALLY_API int tally_counter_incr_key(tally_counter *c, const void *key, size_t len,
                                     int64_t delta);
/* Add delta to shard `shard` (0-based); TALLY_ESHARDS if out of range. */
TALLY_API int tally_counter_incr_shard(tally_counter *c, uint32_t shard, int64_t delta);

/* Increment counter `name` without a handle: what opening it (opt NULL:
 * its family's options or the defaults, created if absent with
 * TALLY_COUNTER_CREATE), tally_counter_incr and closing it would do, with
 * their results, at the cost of one lookup in the store's index (no
 * allocation). For many names used at random, where holding a handle per
 * name costs more memory than it saves time. TALLY_EINVAL with
 * TALLY_COUNTER_EXCL. */
TALLY_API int tally_store_incr(tally_store *s, const char *name, size_t len,
                               int64_t delta, uint32_t flags);
/* The exact value of counter `name` without a handle (one index lookup,
 * then the cells); TALLY_ENOENT if there is none (an expired counter is
 * none). */
TALLY_API int tally_store_value(tally_store *s, const char *name, size_t len,
                                int64_t *out);

/* Exact value: the sum of all shards now. TALLY_ERANGE if the sum does not
 * fit in int64. */
TALLY_API int tally_counter_value(tally_counter *c, int64_t *out);
/* Per-shard values into vals[0..cap); *n receives the shard count (if
 * cap < count, only cap values are written). */
TALLY_API int tally_counter_shards(tally_counter *c, int64_t *vals, uint32_t cap,
                                   uint32_t *n);
/* Set every shard to zero and return the amount removed. Increments that
 * race with it either land before (and are in *removed) or after (and
 * stay in the counter): none is lost or counted twice. TALLY_ERANGE if the
 * amount does not fit in int64; then nothing is removed. A slot counter's
 * shards have one writer each, so its reset reads them as a snapshot does
 * and subtracts the amount in the caller's own shard (a batch of one: the
 * value is the same, the shards do not all read 0). */
TALLY_API int tally_counter_reset(tally_counter *c, int64_t *removed);
/* Change the shard count online; the value is unchanged and concurrent
 * increments (from any thread or process) are neither lost nor doubled. */
TALLY_API int tally_counter_reshard(tally_counter *c, uint32_t shards);

typedef struct tally_counter_info {
  const char *name; /* NUL-terminated, valid while the handle is open */
  uint32_t name_len;
  uint32_t shards;
  int32_t policy;
  uint64_t incarnation;   /* random per creation: a counter dropped or
                           expired and created again has another */
  int auto_shards;        /* created with TALLY_SHARDS_AUTO */
  uint32_t grown, shrunk; /* automatic reshards so far (saturate at 1023) */
  int rseq;               /* cpu policy: 1 if the calling thread's increments
                             run as restartable sequences, 0 if they take the
                             thread policy's path (see docs/design.md) */
} tally_counter_info;

TALLY_API int tally_counter_info_get(tally_counter *c, tally_counter_info *out);

/* The value and the incarnation it belongs to, read together: a flusher
 * must not credit one incarnation's value to another. An expired counter
 * that was not created again reads 0 with incarnation 0. */
TALLY_API int tally_counter_read(tally_counter *c, int64_t *value, uint64_t *incarnation);

/* Flushers (tally_net.h). tally_store_ship records, in the store, that
 * `writer` ships the counters matching `pattern` (glob) elsewhere; from
 * then on such a counter expires only while its value equals the last
 * value marked shipped for its incarnation with tally_counter_ship (a
 * mark for another incarnation is ignored). A name two writers cover
 * never expires. The store keeps 8 registrations of patterns up to 112
 * bytes; past that every counter counts as covered. Registrations last
 * (across restarts, for file stores) until tally_store_unship(writer).
 * A flusher marks TALLY_SHIP_UNKNOWN before it sends a value out (the
 * remote may then hold either one): the counter is held, whatever its
 * value, until a value read back from the remote is marked. */
#define TALLY_SHIP_UNKNOWN INT64_MIN
TALLY_API int tally_store_ship(tally_store *s, const char *writer, size_t wlen,
                               const char *pattern, size_t plen);
TALLY_API int tally_store_unship(tally_store *s, const char *writer, size_t wlen);
TALLY_API int tally_counter_ship(tally_counter *c, uint64_t incarnation, int64_t value);

/* The step every flusher takes before it sends counter c out, given the
 * remote's marker of this writer for it (the value and incarnation the
 * remote holds from it; 0, 0 for none): mark TALLY_SHIP_UNKNOWN for the
 * counter's incarnation (upkeep holds it whatever its value: the send may
 * land with its reply lost, and only a value read back may be marked
 * again), then read the value to send, with its incarnation, and the
 * delta from the marker (tally_send_delta). Delta 0: nothing to send.
 * Returns 0;
 * TALLY_EBUSY when the counter was made again twice meanwhile (the value
 * read was never marked: not sent this round); TALLY_ENOENT when it
 * expired, TALLY_EDROPPED when dropped (nothing to send); TALLY_ERANGE
 * when the delta overflows. */
/* What a flusher sends for a local value of incarnation inc, given the
 * remote's marker: value - marker when the marker is this incarnation's;
 * a marker of another incarnation holds the final value of one that
 * expired or was dropped, so this one counts from 0; a marker of
 * incarnation 0 (written before incarnations) counts as this one's.
 * TALLY_ERANGE when the delta overflows int64. */
TALLY_API int tally_send_delta(int64_t value, uint64_t incarnation, int64_t marker_value,
                               uint64_t marker_incarnation, int64_t *delta);
typedef struct tally_send {
  int64_t value;
  uint64_t incarnation;
  int64_t delta;
} tally_send;
TALLY_API int tally_counter_send_begin(tally_counter *c, int64_t marker_value,
                                       uint64_t marker_incarnation, tally_send *out);

/* Drop counter `name`: it disappears from the store; handles to it in any
 * process get TALLY_EDROPPED (an expired counter's handles re-create it
 * instead). TALLY_ENOENT if absent. Its space is reused after the grace
 * period. */
TALLY_API int tally_store_drop(tally_store *s, const char *name, size_t len);

/* ---- names, patterns, families ----------------------------------------- */

/* Glob match: '*' matches any run of bytes (even empty), '?' any one byte,
 * everything else itself. Returns 1 on match, 0 otherwise. */
TALLY_API int tally_glob_match(const char *pattern, size_t plen, const char *name,
                               size_t nlen);

/* Call fn for each live counter whose name matches pattern (NULL or "*":
 * all), in no particular order. fn returns 0 to go on, non-zero to stop
 * (that value is then returned). */
typedef int (*tally_name_fn)(void *ud, const char *name, size_t len);
TALLY_API int tally_store_each(tally_store *s, const char *pattern, size_t plen,
                               tally_name_fn fn, void *ud);

/* Exact sum over matching counters; *count receives how many matched. */
TALLY_API int tally_store_sum(tally_store *s, const char *pattern, size_t plen,
                              int64_t *sum, uint64_t *count);

/* ---- vectors: counters by index (vector.c) ------------------------------ */

/* A vector holds n counter handles in slots 0..n-1 and increments them by
 * index. For counters of one shard (automatic ones while they have one)
 * under the thread or random policy, an increment reads a 4-byte word per
 * slot (for counters created in slot order, a bit and a base that stay in
 * cache) and adds to the cell: about one cache miss on a cold counter,
 * where a handle costs two (the handle, then the cell). The same holds for
 * thread-policy counters of one more shard count, the first the vector
 * meets: an increment adds to the shard of the caller's ticket, so with a
 * shard per writer no two writers share a cell's line. Other counters, and
 * cells past the store's first 8 GiB, go through their handle. Increments
 * may run in any number of threads at once; put, open, take, grow and
 * free must not run concurrently with other calls on the same vector.
 * Free the vector before closing its store. */
typedef struct tally_vector tally_vector;

TALLY_API int tally_vector_new(tally_store *s, size_t n, tally_vector **out);
/* Put handle c (of the vector's store) in slot i: the vector owns it from
 * then on and closes it when it is replaced or freed. c NULL empties the
 * slot. A handle can be in one vector only (TALLY_EINVAL). */
TALLY_API int tally_vector_put(tally_vector *v, size_t i, tally_counter *c);
/* tally_counter_open, then put: the same arguments and errors. */
TALLY_API int tally_vector_open(tally_vector *v, size_t i, const char *name, size_t len,
                                const tally_counter_options *opt, uint32_t flags);
/* Empty slot i and give its handle back to the caller (who closes it
 * when done), or NULL if the slot is empty or out of range. */
TALLY_API tally_counter *tally_vector_take(tally_vector *v, size_t i);
/* Make the vector n slots long (n >= its size; the new slots are empty).
 * Not concurrently with other calls on the same vector. */
TALLY_API int tally_vector_grow(tally_vector *v, size_t n);
/* The handle in slot i (owned by the vector: read it, do not close it),
 * or NULL if the slot is empty or out of range. */
TALLY_API tally_counter *tally_vector_get(const tally_vector *v, size_t i);
TALLY_API size_t tally_vector_size(const tally_vector *v);
/* tally_counter_incr on slot i's counter, with the same results;
 * TALLY_EINVAL if i is out of range, TALLY_ENOENT if the slot is empty. */
TALLY_API int tally_vector_incr(tally_vector *v, size_t i, int64_t delta);
/* tally_vector_incr(v, slots[k], deltas[k]) for k = 0 .. n-1, in order
 * (deltas NULL: 1 each), stopping at the first that does not return 0:
 * *done (if not NULL) is how many returned 0 before it, and that one's
 * result is returned, as tally_vector_incr's would be (0 when all did).
 * Each add is exact on its own, as a single increment is; the batch is no
 * unit: a reader may see part of it (see tally_batch_incr for batches
 * seen whole). One call for many adds asks for the cells of adds further
 * on ahead of time, so that their misses overlap: for random adds over
 * many cold counters. TALLY_EINVAL if v is NULL, or slots NULL with n > 0. */
TALLY_API int tally_vector_incr_many(tally_vector *v, const size_t *slots,
                                     const int64_t *deltas, size_t n, size_t *done);
/* 2 if slot i's next increment takes the one-miss path and the slot is
 * dense (its counter's cells follow its group's pattern, as counters
 * created in slot order do: the increment then reads
 * only a bit and a base that stay in cache, then the cell), 1 if it takes
 * that path through its 4-byte slot word, 0 if it goes through the handle
 * (an empty slot, another policy or shard count, a counter moved since
 * its last increment; out of range: 0). */
TALLY_API int tally_vector_fast(const tally_vector *v, size_t i);
/* Stamps: for a caller that finds its slots through a table of names (as
 * LuaJIT's db:incr does) and can keep a number there in place of the
 * slot. tally_vector_stamp gives the stamp of handle c's counter while c
 * is in v: a value in [2^31, 2^53), so a double holds it exactly, naming
 * the counter's cell; 0 if c is not in v or its increments are not one
 * plain add (several shards, another policy, a cell past 8 GiB, a region
 * whose stamps ran out). tally_vector_stamp_incr adds delta through a
 * stamp, reading nothing but a word that stays in cache before the add:
 * 0 when added; 1 when added and the counter (automatic shards) is due to
 * sample its writers: call tally_counter_sample on a handle of it; -1
 * when nothing was added: the stamp is stale (the counter moved, or c left
 * v, since it was made), or 0, or the add would leave the range: take the
 * handle's path (tally_counter_incr), which says why if it fails, and ask
 * for a new stamp. A stale stamp never adds to another counter's cell.
 * Pass only 0 or what tally_vector_stamp returned for v, as a pointer
 * must be one: any other value is undefined (a stamp of another vector
 * and a value below 2^32 are refused, but for 1 chance in 2^21; a stamp
 * changed by arithmetic may add to another counter). Same threading as
 * tally_vector_incr. */
TALLY_API int64_t tally_vector_stamp(tally_vector *v, const tally_counter *c);
TALLY_API int tally_vector_stamp_incr(tally_vector *v, int64_t stamp, int64_t delta);
/* Counter c (automatic shards) samples its writers for contention, as one
 * of its increments in 256 does on the handle's path; nothing for other
 * counters. 0, or TALLY_EINVAL for a NULL or closed handle. */
TALLY_API int tally_counter_sample(tally_counter *c);
/* Close every handle in v and free it; NULL is allowed. */
TALLY_API void tally_vector_free(tally_vector *v);

/* ---- batches and snapshots (batch.c) ------------------------------------ */

/* Counters of policy TALLY_POLICY_SLOT have TALLY_SLOT_SHARDS shards, one per
 * writer slot: each writing thread (in any process) leases a slot of the
 * store on its first such increment and adds only to its own shard, under
 * its slot's sequence number. That makes two things exact across threads
 * and processes:
 *   - a batch (tally_batch_incr) is seen by tally_store_snapshot wholly or
 *     not at all, and a writer killed in the middle of one leaves nothing of
 *     it: the next reader or writer that meets the dead slot rolls it back;
 *   - one thread's increments of slot counters are seen in its order.
 * Such counters are never resharded, never automatic and never expire for
 * idleness (a family's idle rule skips them). A thread's slot goes back to
 * the store when the thread exits or the store is closed; a process that
 * dies gives its slots back to the next one that needs a slot. */
#define TALLY_SLOT_SHARDS 64 /* writer slots per store, shards per slot counter */
#define TALLY_BATCH_MAX   64 /* distinct counters in one batch */

/* Add deltas[i] to cs[i] for i < n, atomically for snapshots: every counter
 * must be a TALLY_POLICY_SLOT counter of s (TALLY_EPOLICY otherwise); a
 * counter named twice (by one handle or two) gets the sum of its deltas.
 * n is 1 to TALLY_BATCH_MAX distinct counters (TALLY_EINVAL). On any error
 * nothing is added.
 * TALLY_EBUSY: all TALLY_SLOT_SHARDS slots are held by live threads. */
TALLY_API int tally_batch_incr(tally_store *s, tally_counter *const *cs,
                               const int64_t *deltas, size_t n);

/* A histogram's writer (histogram.c): its bounds, finite and strictly
 * increasing, name nbounds + 1 buckets (the last is +Inf) and names[] the
 * bucket counters in that order, then the sum's, all distinct
 * (TALLY_EINVAL). Each is opened as a slot counter (created if absent;
 * TALLY_EPOLICY if it exists with another policy).
 * tally_histogram_observe(h, v) adds 1 to the bucket of v (the
 * first bound >= v) and v / unit, rounded to the nearest integer (halves
 * away from zero), to the sum, as one batch: TALLY_EINVAL for a NaN,
 * TALLY_ERANGE if |v / unit| > 2^53, else tally_batch_incr's errors; on
 * any error nothing is added. The count is the sum of the buckets. Naming
 * the members is the caller's (lua/tally/histogram.lua: NAME{le=B},
 * NAME{sum,unit=U}). Like a counter handle, a writer may be shared by
 * threads once opened, and is closed before its store (closing flushes a
 * buffered writer; if that flush fails, what it held is lost).
 *
 * tally_histogram_buffer(h, n): from now on h holds up to n observations
 * (1 to TALLY_HISTOGRAM_MAX_BUFFER; 0: none, as opened) in memory of its
 * own, and adds them to the store as one batch when it is full (at the
 * next observation), before a bucket would be its 64th with a count or
 * the sum would overflow, and at tally_histogram_flush(h). An observation
 * then costs a few ns and writes nothing to the store: readers see it
 * only once flushed, and a process that dies loses what it had not
 * flushed. A buffered writer is one thread's (calls must not overlap).
 * Each flushes first. A flush that fails adds nothing and keeps the
 * buffer (tally_batch_incr's errors); an observation whose flush fails
 * returns that error and is not counted. */
#define TALLY_HISTOGRAM_MAX_BOUNDS 1000
typedef struct tally_histogram tally_histogram;
TALLY_API int tally_histogram_open(tally_store *s, const double *bounds, size_t nbounds,
                                   const char *const *names, double unit,
                                   tally_histogram **out);
TALLY_API int tally_histogram_observe(tally_histogram *h, double v);
#define TALLY_HISTOGRAM_MAX_BUFFER 1000000
TALLY_API int tally_histogram_buffer(tally_histogram *h, uint32_t n);
TALLY_API int tally_histogram_flush(tally_histogram *h);
/* Close the writer and its counter handles; NULL is allowed. */
TALLY_API void tally_histogram_close(tally_histogram *h);
/* What s holds of the histogram whose members are names[] (nbounds + 2,
 * as tally_histogram_open takes them), found without a walk of the store:
 * TALLY_HISTOGRAM_NEW if no counter is named names[nbounds] (the +Inf
 * bucket: there is no such histogram); TALLY_HISTOGRAM_SAME if a writer
 * of exactly these names (the same bounds and unit) opened it first;
 * TALLY_HISTOGRAM_OTHER if it exists otherwise (first opened with other
 * names, by a version that kept no mark, or not a histogram's bucket):
 * find its members by name (NAME{*}). Or an error (< 0). */
enum { TALLY_HISTOGRAM_NEW = 0, TALLY_HISTOGRAM_SAME = 1, TALLY_HISTOGRAM_OTHER = 2 };
TALLY_API int tally_histogram_stored(tally_store *s, const char *const *names,
                                     size_t nbounds);

/* A consistent snapshot of the counters matching pattern: fn is called once
 * per counter with its value, after every value was read. The values of
 * slot counters form a consistent cut: every batch wholly or not at all,
 * and for each writer thread a prefix of its increments in its order (a
 * histogram's count always equals the sum of its buckets). Other counters
 * are read one after the other, as tally_counter_value would. A writer
 * stopped in the middle of a batch is waited for while it lives; a dead
 * one's batch is rolled back at once. fn returns 0 to go on, non-zero to
 * stop (that value is then returned). */
typedef int (*tally_value_fn)(void *ud, const char *name, size_t len, int64_t value);
TALLY_API int tally_store_snapshot(tally_store *s, const char *pattern, size_t plen,
                                   tally_value_fn fn, void *ud);

/* fn for each live counter matching pattern, with its value read as
 * tally_counter_value reads it: one counter after the other (not a
 * consistent cut: tally_store_snapshot makes one), in no particular order,
 * in one pass over the index and with no handle per counter.
 * A counter dropped during the walk, or whose value does not fit in 64
 * bits (tally_counter_value's TALLY_ERANGE), is left out. fn returns 0 to
 * go on, non-zero to stop (that value is then returned). */
TALLY_API int tally_store_values(tally_store *s, const char *pattern, size_t plen,
                                 tally_value_fn fn, void *ud);

/* Define a family: counters created later under pattern take opt (fields
 * left 0 / -1, or opt NULL, fall back to the defaults). The most recently defined
 * matching family wins; defining a pattern again replaces its options.
 * Families live in the store, so they apply in every process. */
TALLY_API int tally_family_set(tally_store *s, const char *pattern, size_t plen,
                               const tally_counter_options *opt);

typedef struct tally_family_options {
  uint32_t shards; /* as in tally_counter_options */
  int32_t policy;
  /* Expire a counter of the family once its value has not moved for
   * idle_s seconds (0: never), in tally_store_maintain. A counter that a
   * rollup schedule covers waits until a rollup has recorded its final
   * value. The drop is exact: an increment that races with it makes it
   * give up (and the counter stays). A late increment through a handle
   * re-creates the counter. */
  uint32_t idle_s;
  /* Cap on the family's live counters (0: none). Once it holds that many,
   * opening a new name with TALLY_COUNTER_CREATE opens the family's
   * overflow counter instead: the pattern with each '*' replaced by
   * "_overflow" and each '?' by '_' (tally_family_overflow). Totals stay
   * exact; per-name detail is capped. */
  uint64_t max_counters;
} tally_family_options;

TALLY_API int tally_family_define(tally_store *s, const char *pattern, size_t plen,
                                  const tally_family_options *opt);
/* The overflow counter's name for pattern into buf (cap bytes, NUL
 * added); returns its length, or TALLY_ENAME if it does not fit. */
TALLY_API int tally_family_overflow(const char *pattern, size_t plen, char *buf,
                                    size_t cap);
/* Options a new counter named name would get (family or defaults:
 * TALLY_SHARDS_AUTO, TALLY_POLICY_THREAD). */
TALLY_API int tally_family_resolve(tally_store *s, const char *name, size_t len,
                                   tally_counter_options *out);

/* ---- rollups ----------------------------------------------------------- */

/* A schedule rolls up every counter matching a pattern once per period:
 * it sums the counter's shards into a rollup record (value, time, delta
 * and rate since the previous rollup) kept in the store beside the
 * counter, and appends the value to the counter's history rings. Periods
 * are aligned to the epoch (period = floor(now / every)), so every process
 * that defines the same schedule agrees on them; in a file store each
 * period is rolled up by exactly one process (a lease in the store).
 *
 * A ring keeps the last `len` buckets of `res_s` seconds; a bucket holds
 * the counter's value at the last rollup inside it. Buckets are aligned to
 * the epoch too, so a coarse bucket equals the last fine bucket inside it
 * and resolutions never drift apart. A counter's rings are the union of
 * the rings of the schedules that cover it (the longest length for each
 * resolution); every rollup of the counter, by any schedule, updates all
 * of them. Counters no schedule covers have no rollup storage at all. */

#define TALLY_RINGS_MAX    8               /* resolutions per counter */
#define TALLY_RING_LEN_MAX 100000          /* buckets per ring */
#define TALLY_RING_RES_MAX (366u * 86400u) /* seconds per bucket */

typedef struct tally_ring {
  uint32_t res_s; /* bucket width in seconds, 1..TALLY_RING_RES_MAX */
  uint32_t len;   /* buckets kept, 1..TALLY_RING_LEN_MAX */
} tally_ring;

typedef struct tally_rollup {
  int64_t value;      /* the counter's exact value when rolled */
  int64_t at_ms;      /* when, in milliseconds of the caller's clock */
  int64_t delta;      /* value minus the previous rollup's value (0 first) */
  int64_t prev_at_ms; /* the previous rollup's time (count > 1), else 0 */
  uint64_t count;     /* rollups of this counter so far */
} tally_rollup;

/* delta per second between the two rollups, or 0 for the first. */
TALLY_API double tally_rollup_rate(const tally_rollup *r);

typedef struct tally_schedule tally_schedule;

/* A schedule over counters matching pattern (glob, see tally_glob_match),
 * every every_ms milliseconds (>= 1), keeping nrings rings (0 is allowed:
 * records only). Rings must have distinct resolutions. The schedule is
 * this process's object, for one thread at a time; its identity in the
 * store is (pattern, every_ms), so processes defining the same schedule
 * share its periods and its lease (two schedules of one identity in one
 * process share them too: only one of them runs each period). A counter
 * keeps at most TALLY_RINGS_MAX rings: a schedule whose rings would take
 * it past that still rolls it up, with the rings it has. Up to 256
 * identities per store; they are never removed. */
TALLY_API int tally_schedule_new(tally_store *s, const char *pattern, size_t plen,
                                 int64_t every_ms, const tally_ring *rings,
                                 uint32_t nrings, tally_schedule **out);
/* Free a schedule; NULL is allowed. Before its store is closed. */
TALLY_API void tally_schedule_free(tally_schedule *sch);

enum {
  TALLY_TICK_RAN = 0,     /* this call rolled up the period */
  TALLY_TICK_NOT_DUE = 1, /* the period was already rolled up (by anyone) */
  TALLY_TICK_BUSY = 2,    /* another process holds this schedule's lease */
  TALLY_TICK_LOST = 3     /* the lease was taken over during the run
                              (this process stalled past it); the new
                              holder finishes the period */
};

typedef struct tally_tick_result {
  int64_t period;    /* floor(now_ms / every_ms) */
  int32_t status;    /* TALLY_TICK_* */
  uint32_t skipped;  /* covered counters not rolled up: a damaged rollup
                          block (tally_store_check reports it), a value out
                          of int64, or a record newer than now_ms */
  uint64_t counters; /* counters rolled up by this call */
} tally_tick_result;

/* Called once per counter rolled up, after its record is stored. name is
 * valid while the store is open. Must not call back into this store's
 * rollup functions. */
typedef void (*tally_rollup_fn)(void *ud, const char *name, size_t len,
                                const tally_rollup *r);

/* Roll up the current period if it is due at now_ms (the caller's clock,
 * milliseconds since the epoch; >= 0). fn may be NULL. Each schedule
 * identity has its own lease, so a slow schedule never holds up another;
 * schedules that cover the same counter take turns on its block. A
 * process that dies holding a lease is replaced at once (its pid is gone:
 * processes sharing a file must share a pid namespace); one that stalls
 * loses the lease after one period (at least 0.5 s) without renewal. The
 * next holder finishes an interrupted period from where it stopped. */
TALLY_API int tally_schedule_tick(tally_schedule *sch, int64_t now_ms, tally_rollup_fn fn,
                                  void *ud, tally_tick_result *out);

/* A schedule identity as the store keeps it (for tools like tally info:
 * the pattern lives in the processes that define the schedule). */
typedef struct tally_schedule_info {
  int64_t every_ms;       /* its period; 0 if the store predates this field */
  int64_t last_period_ms; /* start of the last period rolled up, or -1 */
  int64_t holder_pid;     /* pid of the lease's holder (it may have
                              ended), 0 if none */
} tally_schedule_info;

/* The schedule identities the store keeps, up to cap of them in out; *n
 * gets how many there are. Reads without the lock. */
TALLY_API int tally_store_schedules(tally_store *s, tally_schedule_info *out,
                                    uint32_t cap, uint32_t *n);

/* The counter's latest rollup record; TALLY_ENOROLLUP if it has none. */
TALLY_API int tally_counter_rolled(tally_counter *c, tally_rollup *out);

/* One counter as tally_store_rows hands it over. */
typedef struct tally_row {
  const char *name; /* valid during the call only */
  size_t name_len;
  int64_t value;   /* as tally_counter_value reads it, when value_rc is 0 */
  int value_rc;    /* 0, or TALLY_ERANGE: the shards' sum does not fit */
  uint32_t shards; /* now */
  int32_t policy;
  int auto_shards; /* created with TALLY_SHARDS_AUTO; then its reshards: */
  uint32_t grown, shrunk;
  const tally_rollup *rolled; /* TALLY_ROWS_ROLLED: the latest rollup, or
                                 NULL (never rolled up, or being written) */
  const int64_t *cells;       /* TALLY_ROWS_CELLS: each shard's value
                                 (shards of them, read with value); valid
                                 during the call only */
  uint64_t incarnation;       /* as tally_counter_info's: random per
                                 creation, so a row of a counter dropped
                                 and made again is told from the old */
} tally_row;
typedef int (*tally_row_fn)(void *ud, const tally_row *row);
enum {
  TALLY_ROWS_BY_NAME = 1, /* in the names' order, bytewise (a name before
                              any longer one it begins); else the index's */
  TALLY_ROWS_ROLLED = 2,  /* read each one's latest rollup too */
  TALLY_ROWS_NAMES = 4,   /* the names only: nothing else is read (0) */
  TALLY_ROWS_CELLS = 8    /* each shard's value too (an exact export) */
};
/* fn for each live counter matching pattern, read one after the other in
 * one walk with no handle per counter (what tally ls shows of each). In
 * the names' order, the walk first collects the matching counters (24
 * bytes each, twice that while they are sorted) and sorts them, then
 * reads each as it hands it over (8 bytes each kept meanwhile). A counter dropped during the walk is
 * left out. The walk holds reuse back until it ends (as every walk does):
 * fn should only read. fn returns 0 to go on, non-zero to stop (that value
 * is then returned). TALLY_EINVAL for a NULL s or fn, TALLY_ENOMEM if the
 * collection does not fit (fn not called), TALLY_ECORRUPT for a damaged
 * store. */
TALLY_API int tally_store_rows(tally_store *s, const char *pattern, size_t plen,
                               unsigned flags, tally_row_fn fn, void *ud);

/* The same walk a slice at a time, for a host that must not stop for a
 * whole store (a scrape in an nginx worker yields between slices). Open
 * it, then tally_walk_next hands fn the matching counters of the next
 * `slots` slots of the name index (rows as tally_store_rows gives them
 * with flags, values read then; in the index's order, or each slice in
 * the names' order with TALLY_ROWS_BY_NAME: sorted runs for a host to
 * merge), until it returns 1: every slot passed. It returns 0 while
 * slots remain, fn's non-zero value (the next call hands that slice
 * again from its start; so stop fn with a value other than 1, which would
 * read as the end, or tell them apart by tally_walk_progress), or a
 * negative TALLY_E* (ECORRUPT: a damaged store). The walk holds reuse
 * back from open to close, as every walk does, so close it soon; a
 * counter created or dropped meanwhile may or may not be handed over, and
 * a name dropped and made again between slices may come twice (the old
 * counter and the new). One thread at a time per walk. TALLY_EINVAL, TALLY_ENOMEM,
 * TALLY_ECORRUPT from open. */
typedef struct tally_walk tally_walk;
TALLY_API int tally_walk_open(tally_store *s, const char *pattern, size_t plen,
                              unsigned flags, tally_walk **out);
TALLY_API int tally_walk_next(tally_walk *w, uint64_t slots, tally_row_fn fn, void *ud);
/* The slots the walk has passed and its index's slots (for progress). */
TALLY_API void tally_walk_progress(const tally_walk *w, uint64_t *passed,
                                   uint64_t *slots);
TALLY_API void tally_walk_close(tally_walk *w);

/* The k live counters matching pattern that rank first, best first: by
 * TALLY_TOP_VALUE, the largest values (read as tally_store_values reads
 * them); by TALLY_TOP_RATE, the largest rates of their latest rollup
 * (tally_rollup_rate), counters never rolled up (or whose record is being
 * written at that moment) after every rolled one. Ties go by name, bytewise
 * (a name before any longer name it begins). One walk of the index and a
 * heap of k entries: O(n log k) time, O(k) memory, no handle per counter.
 * Then fn for each of them in that order, with its latest rollup or NULL
 * (never rolled up); name is valid during the call only. fn returns 0 to
 * go on, non-zero to stop (that value is then returned). Left out as by
 * tally_store_values: dropped during the walk, or beyond int64.
 * TALLY_EINVAL for a NULL s or fn or another by, TALLY_ENOMEM if the heap
 * does not fit (fn not called), TALLY_ECORRUPT for a damaged store. */
enum { TALLY_TOP_VALUE = 0, TALLY_TOP_RATE = 1 };
typedef int (*tally_top_fn)(void *ud, const char *name, size_t len, int64_t value,
                            const tally_rollup *rolled);
TALLY_API int tally_store_top(tally_store *s, const char *pattern, size_t plen,
                              uint64_t k, int by, tally_top_fn fn, void *ud);

/* ---- the Prometheus text exposition ------------------------------------- */

/* Every counter as a series of one gauge (text exposition format 0.0.4),
 * labelled with its name: a label value carries any bytes exactly, so no
 * two names collide (a name that is not UTF-8 goes, as the hex of its
 * bytes, into the label TALLY_PROM_HEX_LABEL). The Lua side's
 * tally.prometheus writes its unmapped counters' lines through this, and
 * maps families and histograms itself (docs/lua-api.md#prometheus). */
#define TALLY_PROM_METRIC    "tally_value"
#define TALLY_PROM_LABEL     "counter"
#define TALLY_PROM_HEX_LABEL "counter_hex"
#define TALLY_PROM_HELP                                                                  \
  "Exact value of a tally counter (the sum of its shards), by counter name."

/* A host's writer: len bytes of text (no NUL after them). Returns 0 to go
 * on, a positive value to stop (returned then, told from a TALLY_E*). */
typedef int (*tally_write_fn)(void *ud, const char *text, size_t len);

/* The exposition of the live counters matching pattern (NULL: all): the
 * # HELP and # TYPE lines of TALLY_PROM_METRIC, then a line per counter
 * in name order, bytewise, TALLY_PROM_METRIC{counter="NAME"} VALUE, the
 * value exact (a sum beyond int64: the float sum of its shards); nothing
 * when no counter matches. Read in one walk with no handle per counter
 * and handed to write about a thousand lines at a time as they are made,
 * the pieces' concatenation being the text. 0, write's non-zero value,
 * or TALLY_EINVAL, TALLY_ENOMEM, TALLY_ECORRUPT (a damaged store). */
TALLY_API int tally_prometheus(tally_store *s, const char *pattern, size_t plen,
                               tally_write_fn write, void *ud);

/* The same in steps, for a host that must not stop for a whole store (a
 * scrape in an nginx worker yields between them). tally_exposition_read
 * reads the matching counters of the next `slots` slots of the name
 * index: 1 once every slot is read, 0 while some remain, or < 0.
 * tally_exposition_write then hands the next `lines` lines (the # HELP
 * and # TYPE lines before the first) to one call of write, the text
 * being x's and valid until the next call on x: 1 once no line is left,
 * 0 while some remain, < 0, or write's non-zero value (stop write with a
 * positive value other than 1, which would read as the end). Reading
 * ends when read returns 1, or at the first write; sums beyond int64 are
 * read then. A name dropped and made again between two reads is written
 * once, as read last. x holds reuse back (as every walk does) until its
 * reading ends: read it soon after open. One thread at a time per x.
 * TALLY_EINVAL, TALLY_ENOMEM, TALLY_ECORRUPT from open and read,
 * TALLY_ENOMEM from write; after such an error every call but close
 * returns it again. */
typedef struct tally_exposition tally_exposition;
TALLY_API int tally_exposition_open(tally_store *s, const char *pattern, size_t plen,
                                    tally_exposition **out);
TALLY_API int tally_exposition_read(tally_exposition *x, uint64_t slots);
TALLY_API int tally_exposition_write(tally_exposition *x, uint64_t lines,
                                     tally_write_fn write, void *ud);
TALLY_API void tally_exposition_close(tally_exposition *x);

/* For a host that maps some counters itself (the Lua side's families and
 * histograms), between the last read and the first write.
 * tally_exposition_braced: fn for each row read whose name ends in '}'
 * (tally.histogram names its members so), with the row's number, until
 * fn returns non-zero (then returned). tally_exposition_leave_out: that
 * row gets no line. tally_exposition_count: the rows read, and those not
 * left out (a name read twice counts twice). tally_exposition_rows:
 * instead of lines, fn for each of the next n rows (name order, each name
 * once): its value, or its text (a sum beyond int64 as a float; NULL
 * otherwise); returns as tally_exposition_write does. */
typedef int (*tally_exposed_fn)(void *ud, uint64_t row, const char *name, size_t len);
typedef int (*tally_sample_fn)(void *ud, const char *name, size_t len, int64_t value,
                               const char *text, size_t text_len);
TALLY_API int tally_exposition_braced(tally_exposition *x, tally_exposed_fn fn, void *ud);
TALLY_API int tally_exposition_leave_out(tally_exposition *x, uint64_t row);
TALLY_API void tally_exposition_count(const tally_exposition *x, uint64_t *read,
                                      uint64_t *kept);
TALLY_API int tally_exposition_rows(tally_exposition *x, uint64_t n, tally_sample_fn fn,
                                    void *ud);

typedef struct tally_bucket {
  int64_t t;     /* bucket start, seconds since the epoch */
  int64_t value; /* value at the last rollup inside the bucket */
} tally_bucket;

/* The ring of resolution res_s, oldest bucket first, buckets with no
 * rollup left out: up to cap buckets into out, *n receives how many the
 * ring holds. TALLY_ENOROLLUP if the counter keeps no such ring. */
TALLY_API int tally_counter_history(tally_counter *c, uint32_t res_s, tally_bucket *out,
                                    uint32_t cap, uint32_t *n);
/* The counter's rings (resolution and length), up to cap; *n the count. */
TALLY_API int tally_counter_rings(tally_counter *c, tally_ring *out, uint32_t cap,
                                  uint32_t *n);

#ifdef __cplusplus
}
#endif
#endif /* TALLY_H */
