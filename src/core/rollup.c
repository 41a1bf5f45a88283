/* rollup.c -- rollup records, history rings, and the schedules that fill them.
 *
 * A counter a schedule covers gets a rollup block in the arena, linked from
 * its record by a sealed word:
 *
 *   64 bytes   seq (a seqlock: odd while written), check, ring count, the
 *              record (value, at, delta, prev_at, count)
 *   16 * r     ring headers: resolution, length, newest bucket + 1
 *   8 * sum    the ring slots, ring after ring; INT64_MIN marks an empty one
 *
 * The store holds one rollup table (allocated on first use): per schedule
 * identity (pattern, every), the last period done, the period in progress,
 * how far it got, and a lease. The lease makes one process at a time run a
 * schedule, and the period record makes each period run once. A lease is
 * taken under the store lock, once per tick; the holder renews it as it
 * goes and stops as soon as it was taken over. A holder whose pid is gone
 * loses it at once; a live one after one period without renewal.
 *
 * Schedules that cover the same counter may run at once (in two processes,
 * under two leases), so a writer claims a block by turning its seq odd
 * with a compare-and-swap; readers need no lock and retry on the seqlock.
 *
 * A period whose run was interrupted (its holder died) is finished by the
 * next holder: members are rolled in a fixed order (by cell offset) and
 * the slot records the sort key of the last one done, so the next holder
 * starts after it and no counter is rolled twice for one period. */
#include "internal.h"

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define ROLLUPS_MAGIC 0x5350554c4c4f5254ull /* "TROLLUPS" */
#define SCHED_SLOTS 256
#define EMPTY_SLOT INT64_MIN
#define RENEW_EVERY 1024u   /* counters rolled between lease checks */

struct sched_slot {              /* one cache line */
  _Atomic uint64_t id;            /* hash of (pattern, every_ms); 0: free */
  _Atomic int64_t done;           /* last period rolled up, + 1; 0: none */
  _Atomic int64_t running;        /* period being rolled up, + 1; 0: none */
  _Atomic uint64_t cursor;        /* of `running`: sort key of the last
                                     member rolled, + 1; 0: none yet */
  _Atomic uint64_t owner;         /* lease: pid << 32 | token; 0: free */
  _Atomic int64_t until;          /* lease expiry, CLOCK_MONOTONIC ms */
  _Atomic int64_t every_ms;       /* the schedule's period, for tally info
                                     (0 in stores from before it was kept) */
  uint64_t reserved_;
};

struct rollup_table {
  uint64_t magic;
  uint64_t check;                 /* keyed by the store's salt */
  uint64_t reserved_[6];
  struct sched_slot slot[SCHED_SLOTS];
};

struct ring_hdr {
  uint32_t res_s;
  uint32_t len;
  _Atomic int64_t head;           /* newest bucket number + 1; 0: empty */
};

struct block {
  _Atomic uint64_t seq;
  uint32_t check;                 /* salt, record, rings: see block_check */
  uint32_t nrings;
  _Atomic int64_t value, at_ms, delta, prev_at_ms;
  _Atomic uint64_t count;
  uint64_t reserved_;
  struct ring_hdr ring[];
};

/* A counter the schedule covers, with its block as last seen: the sealed
 * word tells when another process gave it a new one. */
struct member {
  uint64_t rec_off;
  uint64_t key;                   /* cell offset when listed: the roll order */
  uint64_t word;                  /* rec->rollup when `b` was resolved */
  struct block *b;
};

struct tally_schedule {
  tally_store *s;
  char *pattern;
  size_t plen;
  int64_t every_ms;
  uint64_t id;
  tally_ring rings[TALLY_RINGS_MAX];
  uint32_t nrings;
  struct member *members;         /* in cell order */
  size_t nmembers;
  uint64_t generation;            /* of the store when members was built */
  bool built;
};

/* ---- small helpers -------------------------------------------------------- */

static uint64_t table_check(const tally_store *s) {
  return tally__mix(s->hdr->salt ^ ROLLUPS_MAGIC);
}

static uint64_t slots_of(const struct block *b) {
  uint64_t n = 0;
  for (uint32_t i = 0; i < b->nrings; i++) n += b->ring[i].len;
  return n;
}

static _Atomic int64_t *slots_at(struct block *b) {
  return (_Atomic int64_t *)(void *)&b->ring[b->nrings];
}

static uint64_t block_bytes(uint32_t nrings, uint64_t nslots) {
  return sizeof(struct block) + nrings * sizeof(struct ring_hdr) + nslots * 8;
}

static uint32_t block_check(const tally_store *s, uint64_t rec_off,
                            const struct block *b) {
  uint64_t h = tally__mix(s->hdr->salt ^ rec_off ^ (uint64_t)b->nrings << 48);
  for (uint32_t i = 0; i < b->nrings; i++)
    h = tally__mix(h ^ ((uint64_t)b->ring[i].res_s << 32 | b->ring[i].len));
  return (uint32_t)(h >> 32);
}

static int ring_ok(const tally_ring *r) {
  return r->res_s >= 1 && r->res_s <= TALLY_RING_RES_MAX && r->len >= 1 &&
         r->len <= TALLY_RING_LEN_MAX;
}

/* A head is 0 (empty ring) or the number + 1 of a bucket that a time at or
 * after the epoch falls in; anything else was damaged, and used as it is it
 * would index slots out of the ring or overflow bucket times. res_s is
 * checked (ring_ok) first. */
static bool head_ok(uint32_t res_s, int64_t head) {
  return head >= 0 && head - 1 <= INT64_MAX / ((int64_t)res_s * 1000);
}

/* Every word of the block at off that a write or read follows: ring count,
 * resolutions and lengths (covered by the check), and heads. */
static bool block_sound(tally_store *s, uint64_t off, uint64_t rec_off,
                        const struct block *b) {
  if (off % 64 || !tally__in_arena(s, off, sizeof *b) ||
      b->nrings > TALLY_RINGS_MAX ||
      !tally__in_arena(s, off, block_bytes(b->nrings, 0)))
    return false;
  for (uint32_t i = 0; i < b->nrings; i++) {
    tally_ring spec = {b->ring[i].res_s, b->ring[i].len};
    if (!ring_ok(&spec) ||
        !head_ok(spec.res_s, atomic_load_explicit(&b->ring[i].head, memory_order_relaxed)))
      return false;
  }
  return tally__in_arena(s, off, block_bytes(b->nrings, slots_of(b))) &&
         b->check == block_check(s, rec_off, b);
}

static int corrupt_block(tally_store *s, const struct tally__rec *r) {
  return tally__fail(TALLY_ECORRUPT, "%s: tally store is corrupt (rollup of "
                     "counter '%s')", tally__store_name(s), r->name);
}

/* The record's block, validated; *out NULL if it has none. */
static int block_of(tally_store *s, uint64_t rec_off, struct block **out) {
  struct tally__rec *r = tally__at(s, rec_off);
  uint64_t off;
  int rc = tally__unseal(s, TALLY__SEAL_ROLLUP,
                         atomic_load_explicit(&r->rollup, memory_order_acquire),
                         rec_off, &off);
  if (rc) return rc;
  if (!off) {
    *out = NULL;
    return 0;
  }
  struct block *b = tally__at(s, off);
  if (!block_sound(s, off, rec_off, b)) return corrupt_block(s, r);
  *out = b;
  return 0;
}

int tally__rollups_check(tally_store *s, uint64_t rec_off) {
  struct block *b;
  return block_of(s, rec_off, &b);
}

static int table_of(tally_store *s, bool create, struct rollup_table **out);

int tally__rollup_table_check(tally_store *s) {
  struct rollup_table *t;
  return table_of(s, false, &t);
}

/* The store's rollup table, created if `create` (caller holds the lock);
 * *out NULL if there is none yet. */
static int table_of(tally_store *s, bool create, struct rollup_table **out) {
  uint64_t off;
  int rc = tally__unseal(s, TALLY__SEAL_ROLLUPS,
                         atomic_load_explicit(&s->hdr->rollups, memory_order_acquire),
                         0, &off);
  if (rc) return rc;
  if (!off) {
    *out = NULL;
    if (!create) return 0;
    if ((rc = tally__alloc(s, sizeof(struct rollup_table), &off))) return rc;
    struct rollup_table *t = tally__at(s, off);
    t->magic = ROLLUPS_MAGIC;
    t->check = table_check(s);
    atomic_store_explicit(&s->hdr->rollups, tally__seal(s, TALLY__SEAL_ROLLUPS, off, 0),
                          memory_order_release);
  }
  struct rollup_table *t = tally__at(s, off);
  if (off % 64 || !tally__in_arena(s, off, sizeof *t) ||
      t->magic != ROLLUPS_MAGIC || t->check != table_check(s))
    return tally__fail(TALLY_ECORRUPT, "%s: tally store is corrupt (rollup "
                       "table)", tally__store_name(s));
  *out = t;
  return 0;
}

/* ---- schedules --------------------------------------------------------------- */

int tally_schedule_new(tally_store *s, const char *pattern, size_t plen,
                       int64_t every_ms, const tally_ring *rings,
                       uint32_t nrings, tally_schedule **out) {
  if (!s || !pattern || !out || (nrings && !rings))
    return tally__fail(TALLY_EINVAL, "tally_schedule_new: NULL argument");
  if (plen == 0 || plen > TALLY_NAME_MAX || memchr(pattern, 0, plen))
    return tally__fail(TALLY_EINVAL, "rollup pattern must be 1 to %d bytes, "
                       "no NUL", TALLY_NAME_MAX);
  if (every_ms < 1 || every_ms > (int64_t)TALLY_RING_RES_MAX * 1000)
    return tally__fail(TALLY_EINVAL, "rollup period must be from 1 ms to 366 "
                       "days, got %lld ms", (long long)every_ms);
  if (nrings > TALLY_RINGS_MAX)
    return tally__fail(TALLY_EINVAL, "at most %d history resolutions, got %u",
                       TALLY_RINGS_MAX, nrings);
  for (uint32_t i = 0; i < nrings; i++) {
    if (!ring_ok(&rings[i]))
      return tally__fail(TALLY_EINVAL, "history of %u buckets of %u s is out "
                         "of range (1 to %d buckets of 1 s to 366 days)",
                         rings[i].len, rings[i].res_s, TALLY_RING_LEN_MAX);
    for (uint32_t j = 0; j < i; j++)
      if (rings[j].res_s == rings[i].res_s)
        return tally__fail(TALLY_EINVAL, "history resolution %u s given twice",
                           rings[i].res_s);
  }
  tally_schedule *sch = calloc(1, sizeof *sch);
  if (sch) sch->pattern = malloc(plen + 1);
  if (!sch || !sch->pattern) {
    free(sch);
    return tally__fail(TALLY_ENOMEM, "out of memory");
  }
  memcpy(sch->pattern, pattern, plen);
  sch->pattern[plen] = '\0';
  sch->plen = plen;
  sch->s = s;
  sch->every_ms = every_ms;
  sch->id = tally__hash(pattern, plen, (uint64_t)every_ms) | 1; /* never 0 */
  if (nrings) memcpy(sch->rings, rings, nrings * sizeof *rings);
  sch->nrings = nrings;
  *out = sch;
  return 0;
}

void tally_schedule_free(tally_schedule *sch) {
  if (!sch) return;
  free(sch->members);
  free(sch->pattern);
  free(sch);
}

/* The slot of sch's identity, claimed if absent. Caller holds the lock. */
static int slot_of(tally_schedule *sch, struct rollup_table *t,
                   struct sched_slot **out) {
  struct sched_slot *free_slot = NULL;
  for (int i = 0; i < SCHED_SLOTS; i++) {
    uint64_t id = atomic_load_explicit(&t->slot[i].id, memory_order_relaxed);
    if (id == sch->id) {
      *out = &t->slot[i];
      if (!atomic_load_explicit(&t->slot[i].every_ms, memory_order_relaxed))
        atomic_store_explicit(&t->slot[i].every_ms, sch->every_ms, memory_order_relaxed);
      return 0;
    }
    if (id == 0 && !free_slot) free_slot = &t->slot[i];
  }
  if (!free_slot)
    return tally__fail(TALLY_EFULL, "%s: too many rollup schedules (%d)",
                       tally__store_name(sch->s), SCHED_SLOTS);
  atomic_store_explicit(&free_slot->every_ms, sch->every_ms, memory_order_relaxed);
  atomic_store_explicit(&free_slot->id, sch->id, memory_order_release);
  *out = free_slot;
  return 0;
}

/* ---- the lease ----------------------------------------------------------------- */

/* Is the process that holds a lease gone? A zombie counts as gone: it will
 * never renew, even before its parent reaps it. */
static bool pid_gone(pid_t pid) {
  if (pid == getpid()) return false;
  if (kill(pid, 0) != 0) return errno == ESRCH;
  char path[64], buf[256];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "re");
  if (!f) return false;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  const char *p = strrchr(buf, ')');   /* the state follows "(comm)" */
  return p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X');
}

static uint64_t lease_me(void) {
  static _Atomic uint32_t tokens;
  uint32_t token = atomic_fetch_add(&tokens, 1) + 1;
  return (uint64_t)(uint32_t)getpid() << 32 | token;
}

/* How long a lease lasts without renewal: one period, but not so short
 * that a holder busy with a large store loses it between renewals. */
static int64_t lease_span(const tally_schedule *sch) {
  return sch->every_ms > 500 ? sch->every_ms : 500;
}

/* Caller holds the store lock. */
static bool lease_take(struct sched_slot *slot, uint64_t me, int64_t span) {
  uint64_t owner = atomic_load_explicit(&slot->owner, memory_order_acquire);
  int64_t now = tally_monotonic_ms();
  if (owner && now < atomic_load(&slot->until) &&
      !pid_gone((pid_t)(owner >> 32)))
    return false;
  atomic_store(&slot->until, now + span);
  atomic_store_explicit(&slot->owner, me, memory_order_release);
  return true;
}

static bool lease_renew(struct sched_slot *slot, uint64_t me, int64_t span) {
  if (atomic_load_explicit(&slot->owner, memory_order_acquire) != me) return false;
  atomic_store(&slot->until, tally_monotonic_ms() + span);
  return true;
}

/* ---- blocks ---------------------------------------------------------------------- */

static void ring_clear(_Atomic int64_t *slot, uint32_t len) {
  for (uint32_t i = 0; i < len; i++)
    atomic_store_explicit(&slot[i], EMPTY_SLOT, memory_order_release);
}

/* Record value v at at_ms in one ring. Buckets are epoch-aligned; a bucket
 * keeps the last value rolled inside it; the buckets skipped since the
 * newest are emptied. A time before the newest bucket changes nothing. */
static void ring_put(struct ring_hdr *r, _Atomic int64_t *slot, int64_t at_ms,
                     int64_t v) {
  uint32_t len = r->len, res_s = r->res_s;
  int64_t head = atomic_load_explicit(&r->head, memory_order_relaxed);
  /* the caller checked the block (block_sound); this only keeps a word
   * damaged since then from indexing outside the ring */
  if (len == 0 || len > TALLY_RING_LEN_MAX || res_s == 0 || !head_ok(res_s, head))
    return;
  int64_t b = at_ms / ((int64_t)res_s * 1000);
  if (head == 0) {
    ring_clear(slot, len);
  } else if (b + 1 > head) {
    int64_t gap = b - head;  /* buckets strictly between newest and b */
    if (gap >= len) ring_clear(slot, len);
    else
      for (int64_t k = head; k < b; k++)
        atomic_store_explicit(&slot[k % len], EMPTY_SLOT, memory_order_release);
  } else if (b + 1 < head) {
    return;
  }
  atomic_store_explicit(&slot[b % len], v, memory_order_release);
  atomic_store_explicit(&r->head, b + 1, memory_order_release);
}

/* Claim b for writing: turn its seq odd. Another writer (a schedule
 * covering the same counter, in another process) holds it for a moment
 * at most; a seq that stays odd for CLAIM_WAIT_MS was left by a writer
 * that died mid-write, and is taken over as it is: this write makes the
 * block whole again. Returns the odd seq to release with. */
#define CLAIM_WAIT_MS 100
static uint64_t block_claim(struct block *b) {
  uint64_t s = atomic_load_explicit(&b->seq, memory_order_acquire);
  int64_t give_up = 0;
  for (unsigned spins = 0;; spins++) {
    if (!(s & 1)) {
      if (atomic_compare_exchange_weak_explicit(&b->seq, &s, s | 1, memory_order_acquire,
                                                memory_order_acquire))
        return s | 1;
      continue;
    }
    if ((spins & 255) == 255) {
      int64_t now = tally_monotonic_ms();
      if (!give_up) give_up = now + CLAIM_WAIT_MS;
      else if (now >= give_up) return s;
      sched_yield();
    }
    s = atomic_load_explicit(&b->seq, memory_order_acquire);
  }
}

static void block_release(struct block *b, uint64_t odd) {
  atomic_store_explicit(&b->seq, odd + 1, memory_order_release);
}

/* Copy ring `from` (with its slots) into the empty ring `to`, bucket by
 * bucket: slot positions depend on the length. */
static void ring_copy(struct ring_hdr *to, _Atomic int64_t *to_slot,
                      const struct ring_hdr *from, _Atomic int64_t *from_slot) {
  ring_clear(to_slot, to->len);
  int64_t head = atomic_load(&from->head);
  if (!head_ok(from->res_s, head)) head = 0;  /* damaged: start it empty */
  atomic_store(&to->head, head);
  if (head == 0) return;
  uint32_t keep = from->len < to->len ? from->len : to->len;
  for (int64_t b = head - 1; b >= 0 && b > head - 1 - keep; b--)
    atomic_store(&to_slot[b % to->len], atomic_load(&from_slot[b % from->len]));
}

/* Does block b have every ring of sch, at least as long? */
static bool block_covers(const struct block *b, const tally_schedule *sch) {
  for (uint32_t i = 0; i < sch->nrings; i++) {
    uint32_t j = 0;
    while (j < b->nrings && b->ring[j].res_s != sch->rings[i].res_s) j++;
    if (j == b->nrings || b->ring[j].len < sch->rings[i].len) return false;
  }
  return true;
}

/* Give record rec_off a block with the union of its current rings and
 * sch's, carrying its record and history over. Caller holds the store lock
 * (no one else grows blocks); the old block is claimed while it is copied. */
static int block_grow(tally_schedule *sch, uint64_t rec_off, struct block *old) {
  tally_store *s = sch->s;
  tally_ring want[2 * TALLY_RINGS_MAX];
  uint32_t n = 0;
  for (uint32_t i = 0; old && i < old->nrings; i++)
    want[n++] = (tally_ring){old->ring[i].res_s, old->ring[i].len};
  for (uint32_t i = 0; i < sch->nrings; i++) {
    uint32_t j = 0;
    while (j < n && want[j].res_s != sch->rings[i].res_s) j++;
    if (j == n) want[n++] = sch->rings[i];
    else if (want[j].len < sch->rings[i].len) want[j].len = sch->rings[i].len;
  }
  if (n > TALLY_RINGS_MAX)
    return tally__fail(TALLY_EINVAL, "counter '%s' would keep %u history "
                       "resolutions (at most %d)",
                       ((struct tally__rec *)tally__at(s, rec_off))->name, n,
                       TALLY_RINGS_MAX);
  for (uint32_t i = 1; i < n; i++)  /* finest first: insertion sort */
    for (uint32_t j = i; j > 0 && want[j - 1].res_s > want[j].res_s; j--) {
      tally_ring t = want[j];
      want[j] = want[j - 1];
      want[j - 1] = t;
    }
  uint64_t nslots = 0, off;
  for (uint32_t i = 0; i < n; i++) nslots += want[i].len;
  int rc = tally__alloc(s, block_bytes(n, nslots), &off);
  if (rc) return rc;
  struct block *b = tally__at(s, off);
  b->nrings = n;
  for (uint32_t i = 0; i < n; i++) {
    b->ring[i].res_s = want[i].res_s;
    b->ring[i].len = want[i].len;
  }
  b->check = block_check(s, rec_off, b);
  uint64_t old_seq = old ? block_claim(old) : 0;  /* no write while copying */
  _Atomic int64_t *slot = slots_at(b);
  for (uint32_t i = 0; i < n; i++) {
    const struct ring_hdr *from = NULL;
    _Atomic int64_t *from_slot = old ? slots_at(old) : NULL;
    for (uint32_t j = 0; old && j < old->nrings; j++) {
      if (old->ring[j].res_s == want[i].res_s) {
        from = &old->ring[j];
        break;
      }
      from_slot += old->ring[j].len;
    }
    if (from) ring_copy(&b->ring[i], slot, from, from_slot);
    slot += want[i].len;
  }
  if (old) {
    atomic_store(&b->value, atomic_load(&old->value));
    atomic_store(&b->at_ms, atomic_load(&old->at_ms));
    atomic_store(&b->delta, atomic_load(&old->delta));
    atomic_store(&b->prev_at_ms, atomic_load(&old->prev_at_ms));
    atomic_store(&b->count, atomic_load(&old->count));
    atomic_fetch_add(&s->hdr->retired,
                     block_bytes(old->nrings, slots_of(old)));
  }
  struct tally__rec *r = tally__at(s, rec_off);
  atomic_store_explicit(&r->rollup, tally__seal(s, TALLY__SEAL_ROLLUP, off, rec_off),
                        memory_order_release);
  if (old) block_release(old, old_seq);  /* writers waiting on it look again */
  return 0;
}

static int64_t sub_sat(int64_t a, int64_t b) {
  int64_t d;
  if (!__builtin_sub_overflow(a, b, &d)) return d;
  return b < 0 ? INT64_MAX : INT64_MIN;
}

/* Roll one claimed counter up at now_ms: its record, then every ring. The
 * stores are release stores, so none is seen before the odd seq (a fence
 * would do, but ThreadSanitizer does not model fences; on x86 both are
 * plain moves). */
static void block_roll(struct block *b, int64_t v, int64_t now_ms, tally_rollup *r) {
  uint64_t count = atomic_load_explicit(&b->count, memory_order_relaxed);
  r->value = v;
  r->at_ms = now_ms;
  r->delta = count ? sub_sat(v, atomic_load_explicit(&b->value, memory_order_relaxed)) : 0;
  r->prev_at_ms = count ? atomic_load_explicit(&b->at_ms, memory_order_relaxed) : 0;
  r->count = count + 1;
  atomic_store_explicit(&b->value, r->value, memory_order_release);
  atomic_store_explicit(&b->at_ms, r->at_ms, memory_order_release);
  atomic_store_explicit(&b->delta, r->delta, memory_order_release);
  atomic_store_explicit(&b->prev_at_ms, r->prev_at_ms, memory_order_release);
  atomic_store_explicit(&b->count, r->count, memory_order_release);
  _Atomic int64_t *slot = slots_at(b);
  for (uint32_t i = 0; i < b->nrings; i++) {
    ring_put(&b->ring[i], slot, now_ms, v);
    slot += b->ring[i].len;
  }
}

/* ---- members ------------------------------------------------------------------- */

struct gather {
  tally_schedule *sch;
  uint64_t *v;
  size_t n, cap;
};

static int gather_one(tally_store *s, uint64_t rec_off, void *ud) {
  struct gather *g = ud;
  const struct tally__rec *r = tally__at(s, rec_off);
  if (!tally_glob_match(g->sch->pattern, g->sch->plen, r->name, r->name_len))
    return 0;
  if (atomic_load(&r->loc) & TALLY__LOC_DROPPED) return 0;
  if (g->n == g->cap) {
    size_t cap = g->cap ? g->cap * 2 : 64;
    uint64_t *v = realloc(g->v, cap * sizeof *v);
    if (!v) return tally__fail(TALLY_ENOMEM, "out of memory");
    g->v = v;
    g->cap = cap;
  }
  g->v[g->n++] = rec_off;
  return 0;
}

static tally_store *sort_store;  /* qsort has no context argument */
static int by_cells(const void *pa, const void *pb) {
  uint64_t a = *(const uint64_t *)pa, b = *(const uint64_t *)pb;
  uint64_t la = atomic_load(&((struct tally__rec *)tally__at(sort_store, a))->loc) >> 32;
  uint64_t lb = atomic_load(&((struct tally__rec *)tally__at(sort_store, b))->loc) >> 32;
  return la < lb ? -1 : la > lb;
}
static pthread_mutex_t sort_lock = PTHREAD_MUTEX_INITIALIZER;

/* Rebuild the member list if counters were created or dropped since, and
 * give every member a block covering the schedule's rings. Called with the
 * lease held; 1 if it was lost meanwhile. Members are kept in cell order, so a tick reads the cells
 * row by row instead of at random. */
struct run;
static bool run_renew(struct run *u);


static int members_refresh(tally_schedule *sch, struct run *u) {
  tally_store *s = sch->s;
  uint64_t gen = atomic_load_explicit(&s->hdr->generation, memory_order_acquire);
  if (sch->built && gen == sch->generation) return 0;
  struct gather g = {.sch = sch};
  int rc = tally__index_each(s, gather_one, &g);
  if (rc) {
    free(g.v);
    return rc;
  }
  pthread_mutex_lock(&sort_lock);
  sort_store = s;
  if (g.n > 1) qsort(g.v, g.n, sizeof *g.v, by_cells);
  pthread_mutex_unlock(&sort_lock);
  bool locked = false;
  for (size_t i = 0; i < g.n && rc == 0; i++) {
    struct block *b;
    if (i % RENEW_EVERY == 0) {
      if (locked) tally__unlock(s);  /* let creators in now and then */
      locked = false;
      if (!run_renew(u)) {
        rc = 1;  /* lost the lease */
        break;
      }
    }
    if (block_of(s, g.v[i], &b)) continue;  /* damaged: check() reports it */
    if (b && block_covers(b, sch)) continue;
    if (!locked && (rc = tally__lock(s))) break;
    locked = true;
    /* again under the lock: another schedule may have grown it meanwhile */
    if (block_of(s, g.v[i], &b) || (b && block_covers(b, sch))) continue;
    rc = block_grow(sch, g.v[i], b);
    if (rc == TALLY_EINVAL) rc = 0;  /* too many rings: rolled with those it has */
  }
  if (locked) tally__unlock(s);
  struct member *m = rc ? NULL : malloc((g.n ? g.n : 1) * sizeof *m);
  if (!m && rc == 0) rc = tally__fail(TALLY_ENOMEM, "out of memory");
  for (size_t i = 0; i < g.n && rc == 0; i++) {
    struct tally__rec *r = tally__at(s, g.v[i]);
    m[i].rec_off = g.v[i];
    m[i].key = atomic_load_explicit(&r->loc, memory_order_acquire) >> 32;
    m[i].word = atomic_load_explicit(&r->rollup, memory_order_acquire);
    if (block_of(s, g.v[i], &m[i].b)) m[i].b = NULL;  /* skipped, see above */
  }
  free(g.v);
  if (rc) {
    free(m);
    return rc;
  }
  free(sch->members);
  sch->members = m;
  sch->nmembers = g.n;
  sch->generation = gen;
  sch->built = true;
  return 0;
}

/* ---- ticking ------------------------------------------------------------------- */

struct run {
  tally_schedule *sch;
  struct sched_slot *slot;
  uint64_t me;
  int64_t now_ms;
  uint64_t resume_after;          /* members with key + 1 <= this are done */
  tally_rollup_fn fn;
  void *ud;
  uint64_t rolled, skipped;
};

/* Where the current bucket of each ring of b lives: prefetched ahead,
 * since a tick is bound by cache misses, not by arithmetic. */
static void prefetch_slots(struct block *b, int64_t now_ms) {
  _Atomic int64_t *slot = slots_at(b);
  for (uint32_t i = 0; i < b->nrings && i < TALLY_RINGS_MAX; i++) {
    uint32_t res_s = b->ring[i].res_s, len = b->ring[i].len;
    if (!res_s || !len) return;  /* damaged: block_sound skips it */
    int64_t k = now_ms / ((int64_t)res_s * 1000);
    __builtin_prefetch(&slot[k % len], 1);
    slot += len;
  }
}

#define AHEAD 16  /* members prefetched ahead: record and block, then slots */

static bool run_renew(struct run *u) {
  return lease_renew(u->slot, u->me, lease_span(u->sch));
}

/* Claim member i's current block: *b NULL if it has none (damaged). */
static uint64_t member_claim(tally_store *s, struct member *m, struct block **b) {
  struct tally__rec *rec = tally__at(s, m->rec_off);
  for (;;) {
    uint64_t word = atomic_load_explicit(&rec->rollup, memory_order_acquire);
    if (word != m->word || !m->b) {  /* another process gave it a new block */
      if (block_of(s, m->rec_off, &m->b)) m->b = NULL;
      m->word = word;
    }
    if (!(*b = m->b)) return 0;
    uint64_t odd = block_claim(m->b);
    if (atomic_load_explicit(&rec->rollup, memory_order_acquire) == m->word) return odd;
    block_release(m->b, odd);  /* replaced while we waited: look again */
  }
}

/* Roll every member; 1 if the lease was lost on the way. */
static int roll_members(struct run *u) {
  tally_schedule *sch = u->sch;
  tally_store *s = sch->s;
  struct member *m = sch->members;
  size_t n = sch->nmembers;
  for (size_t i = 0; i < n; i++) {
    /* a holder taken over stops at once: the new one goes on from the cursor */
    if (atomic_load_explicit(&u->slot->owner, memory_order_acquire) != u->me) return 1;
    if (i % RENEW_EVERY == 0 && !run_renew(u)) return 1;
    if (i + AHEAD < n) {
      __builtin_prefetch(tally__at(s, m[i + AHEAD].rec_off));
      if (m[i + AHEAD].b) {
        __builtin_prefetch(m[i + AHEAD].b, 1);
        __builtin_prefetch((char *)m[i + AHEAD].b + 64);
      }
    }
    if (i + AHEAD / 2 < n && m[i + AHEAD / 2].b)
      prefetch_slots(m[i + AHEAD / 2].b, u->now_ms);
    if (m[i].key + 1 <= u->resume_after) continue;  /* the dead holder did it */
    struct block *b;
    int64_t v;
    uint64_t odd = member_claim(s, &m[i], &b);
    if (b && !block_sound(s, (uint64_t)((unsigned char *)b - s->base), m[i].rec_off, b)) {
      block_release(b, odd);  /* damaged since it was resolved */
      m[i].b = NULL;
      b = NULL;
    }
    if (!b) {
      u->skipped++;  /* damaged: check() reports it */
      continue;
    }
    int rc = tally__rec_value(s, m[i].rec_off, &v);
    if (rc || atomic_load_explicit(&b->at_ms, memory_order_relaxed) > u->now_ms) {
      block_release(b, odd);
      if (rc == TALLY_EDROPPED) sch->built = false;  /* list it anew */
      else u->skipped++;  /* out of range, or never back in time */
      continue;
    }
    tally_rollup r;
    block_roll(b, v, u->now_ms, &r);
    block_release(b, odd);
    atomic_store_explicit(&u->slot->cursor, m[i].key + 1, memory_order_relaxed);
    u->rolled++;
    if (u->fn) {
      const struct tally__rec *rec = tally__at(s, m[i].rec_off);
      u->fn(u->ud, rec->name, rec->name_len, &r);
    }
  }
  return 0;
}

int tally_schedule_tick(tally_schedule *sch, int64_t now_ms, tally_rollup_fn fn,
                        void *ud, tally_tick_result *out) {
  if (!sch || !out) return tally__fail(TALLY_EINVAL, "tally_schedule_tick: NULL argument");
  if (now_ms < 0)
    return tally__fail(TALLY_EINVAL, "rollup time must not be before the epoch");
  tally_store *s = sch->s;
  int64_t period = now_ms / sch->every_ms;
  *out = (tally_tick_result){.period = period, .status = TALLY_TICK_NOT_DUE};

  struct rollup_table *t;
  struct run u = {.sch = sch, .me = lease_me(), .now_ms = now_ms, .fn = fn, .ud = ud};
  int rc = tally__lock(s);
  if (rc) return rc;
  rc = table_of(s, true, &t);
  if (rc == 0) rc = slot_of(sch, t, &u.slot);
  if (rc) {
    tally__unlock(s);
    return rc;
  }
  if (atomic_load(&u.slot->done) > period) {
    tally__unlock(s);
    return 0;
  }
  if (!lease_take(u.slot, u.me, lease_span(sch))) {
    tally__unlock(s);
    out->status = TALLY_TICK_BUSY;
    return 0;
  }
  if (atomic_load(&u.slot->running) == period + 1) {
    u.resume_after = atomic_load(&u.slot->cursor);  /* a holder died in it */
  } else {
    atomic_store(&u.slot->cursor, 0);
    atomic_store(&u.slot->running, period + 1);
  }
  tally__unlock(s);

  rc = members_refresh(sch, &u);
  int lost = rc == 1 ? 1 : rc ? 0 : roll_members(&u);
  if (rc == 1) rc = 0;
  out->counters = u.rolled;
  out->skipped = (uint32_t)(u.skipped > UINT32_MAX ? UINT32_MAX : u.skipped);

  int lrc = tally__lock(s);
  if (lrc) {  /* the lease runs out by itself */
    return rc ? rc : lrc;
  }
  if (atomic_load(&u.slot->owner) == u.me) {
    if (rc == 0 && !lost) {
      atomic_store(&u.slot->done, period + 1);
      atomic_store(&u.slot->running, 0);
    }
    atomic_store_explicit(&u.slot->owner, 0, memory_order_release);
  } else {
    lost = 1;
  }
  tally__unlock(s);
  if (rc) return rc;
  out->status = lost ? TALLY_TICK_LOST : TALLY_TICK_RAN;
  return 0;
}

/* ---- reading --------------------------------------------------------------------- */

double tally_rollup_rate(const tally_rollup *r) {
  if (!r || !r->prev_at_ms || r->at_ms <= r->prev_at_ms) return 0.0;
  return (double)r->delta * 1000.0 / (double)(r->at_ms - r->prev_at_ms);
}

/* Seqlock reads: acquire loads (so the second seq load cannot move above
 * them), retried until no write came in between. A writer that died
 * mid-write leaves seq odd until the next rollup. */
/* Give up after about a second of seeing a write in progress; yield now
 * and then, in case the writer shares this CPU. */
static bool seq_wait(int tries, double *deadline) {
  if (tries % 64 != 63) return true;
  sched_yield();
  double t = (double)tally_monotonic_ns() * 1e-9;
  if (*deadline == 0) *deadline = t + 1.0;
  return t < *deadline;
}
static int block_for_read(tally_counter *c, struct block **b) {
  if (!c) return tally__fail(TALLY_EINVAL, "NULL counter");
  int rc = tally__current(c->s, c->rec_off, &(uint64_t){0});
  if (rc == 0) rc = block_of(c->s, c->rec_off, b);
  if (rc) return rc;
  if (!*b)
    return tally__fail(TALLY_ENOROLLUP, "counter '%s' has no rollup (no "
                       "schedule has rolled it up)", c->rec->name);
  return 0;
}

static int busy(tally_counter *c) {
  return tally__fail(TALLY_EBUSY, "counter '%s': rollup record is being "
                     "written (or its writer died; the next rollup repairs it)",
                     c->rec->name);
}

int tally_counter_rolled(tally_counter *c, tally_rollup *out) {
  struct block *b;
  if (!out) return tally__fail(TALLY_EINVAL, "tally_counter_rolled: NULL argument");
  int rc = block_for_read(c, &b);
  if (rc) return rc;
  double deadline = 0;
  for (int i = 0; seq_wait(i, &deadline); i++) {
    uint64_t s1 = atomic_load_explicit(&b->seq, memory_order_acquire);
    if (s1 & 1) continue;
    tally_rollup r = {
      .value = atomic_load_explicit(&b->value, memory_order_acquire),
      .at_ms = atomic_load_explicit(&b->at_ms, memory_order_acquire),
      .delta = atomic_load_explicit(&b->delta, memory_order_acquire),
      .prev_at_ms = atomic_load_explicit(&b->prev_at_ms, memory_order_acquire),
      .count = atomic_load_explicit(&b->count, memory_order_acquire)};
    if (atomic_load_explicit(&b->seq, memory_order_relaxed) != s1) continue;
    if (r.count == 0)
      return tally__fail(TALLY_ENOROLLUP, "counter '%s' has not been rolled "
                         "up yet", c->rec->name);
    *out = r;
    return 0;
  }
  return busy(c);
}

int tally_counter_rings(tally_counter *c, tally_ring *out, uint32_t cap,
                        uint32_t *n) {
  struct block *b;
  if (!n || (!out && cap)) return tally__fail(TALLY_EINVAL, "tally_counter_rings: NULL argument");
  int rc = block_for_read(c, &b);
  if (rc) return rc;
  for (uint32_t i = 0; i < b->nrings && i < cap; i++)
    out[i] = (tally_ring){b->ring[i].res_s, b->ring[i].len};
  *n = b->nrings;
  return 0;
}

int tally_counter_history(tally_counter *c, uint32_t res_s, tally_bucket *out,
                          uint32_t cap, uint32_t *n) {
  struct block *b;
  if (!n || (!out && cap))
    return tally__fail(TALLY_EINVAL, "tally_counter_history: NULL argument");
  int rc = block_for_read(c, &b);
  if (rc) return rc;
  _Atomic int64_t *slot = slots_at(b);
  uint32_t i = 0;
  while (i < b->nrings && b->ring[i].res_s != res_s) slot += b->ring[i++].len;
  if (i == b->nrings)
    return tally__fail(TALLY_ENOROLLUP, "counter '%s' keeps no history at "
                       "%u s resolution", c->rec->name, res_s);
  struct ring_hdr *r = &b->ring[i];
  double deadline = 0;
  for (int tries = 0; seq_wait(tries, &deadline); tries++) {
    uint64_t s1 = atomic_load_explicit(&b->seq, memory_order_acquire);
    if (s1 & 1) continue;
    int64_t head = atomic_load_explicit(&r->head, memory_order_acquire);
    if (!head_ok(r->res_s, head)) return corrupt_block(c->s, c->rec);
    uint32_t k = 0;
    for (int64_t bk = head - (int64_t)r->len; head && bk < head; bk++) {
      if (bk < 0) continue;
      int64_t v = atomic_load_explicit(&slot[bk % r->len], memory_order_acquire);
      if (v == EMPTY_SLOT) continue;
      if (k < cap) out[k] = (tally_bucket){bk * (int64_t)r->res_s, v};
      k++;
    }
    if (atomic_load_explicit(&b->seq, memory_order_relaxed) != s1) continue;
    *n = k;
    return 0;
  }
  return busy(c);
}

/* ---- what the store keeps of its schedules --------------------------------- */

int tally__rollup_schedules(tally_store *s, uint32_t *n) {
  struct rollup_table *t;
  int rc = table_of(s, false, &t);
  *n = 0;
  if (rc || !t) return rc;
  for (int i = 0; i < SCHED_SLOTS; i++)
    if (atomic_load_explicit(&t->slot[i].id, memory_order_acquire)) (*n)++;
  return 0;
}

int tally_store_schedules(tally_store *s, tally_schedule_info *out, uint32_t cap,
                          uint32_t *n) {
  if (!s || !n || (cap && !out))
    return tally__fail(TALLY_EINVAL, "tally_store_schedules: NULL argument");
  struct rollup_table *t;
  int rc = tally__truncated(s);
  if (rc == 0) rc = table_of(s, false, &t);
  *n = 0;
  if (rc || !t) return rc;
  for (int i = 0; i < SCHED_SLOTS; i++) {
    const struct sched_slot *slot = &t->slot[i];
    if (!atomic_load_explicit(&slot->id, memory_order_acquire)) continue;
    if (*n < cap) {
      int64_t every = atomic_load_explicit(&slot->every_ms, memory_order_relaxed);
      int64_t done = atomic_load_explicit(&slot->done, memory_order_relaxed);
      uint64_t owner = atomic_load_explicit(&slot->owner, memory_order_relaxed);
      out[*n] = (tally_schedule_info){
          .every_ms = every,
          .last_period_ms = done > 0 && every > 0 ? (done - 1) * every : -1,
          .holder_pid = (int64_t)(owner >> 32),
      };
    }
    (*n)++;
  }
  return 0;
}
