/* autoshard.c -- counters that size their own shards (TALLY_SHARDS_AUTO).
 *
 * An auto counter starts with one cell: a cold counter costs what an array
 * slot does. It doubles its shards online (the exact reshard of move.c)
 * when writers collide on one cell, and upkeep takes it back to one cell
 * once it has been quiet.
 *
 * The signal has to stay off the increment's path, so it is sampled:
 * about one increment in 256 of an auto counter looks at the record, chosen
 * by the value its atomic add returned (a multiplicative hash, counter.c),
 * so the increment touches no memory but its cell. The record's contention
 * word holds the ticket of the last sampling writer, a hit count and the
 * time. A sample that finds another writer's ticket, one that lands on the
 * same shard as this one, within TALLY_AUTO_WINDOW_MS of the previous
 * sample, is a hit; a gap longer than the window starts over. 8 hits double
 * the shards, up to the writers seen (thread tickets drawn from the store)
 * and the CPUs. The record is written only when something changed, so two
 * writers already on separate cells do not bounce its line.
 *
 * Why this signal: it costs fixed counters a register test after the add,
 * and auto ones a multiply, and it only fires at rates where sharing a
 * cache line costs something: a cold counter that several threads touch
 * now and then is almost never sampled twice within 2 ms, and a hot one
 * with one writer only ever finds its own ticket. Two writers already on
 * separate shards are not a hit (no growth), but they keep the counter from
 * shrinking.
 */
#include "internal.h"

#include <stdlib.h>
#include <unistd.h>

#define HITS_TO_GROW 8

/* The contention word: the last sampling writer (bits 0..19: its ticket's
 * low 19 bits, and WHO_SET; 0: none), hits (20..23), that sample's time in
 * monotonic ms (24..43, wrapping) and when two writers were last seen, in
 * odd units of 1024 ms (44..63, wrapping; 0: never). Two tickets 2^19
 * apart look like one writer: they are on one shard (n <= 1024 divides
 * 2^19) and would need half a million threads drawn between them. */
#define MS_MASK   0xfffffu
#define WHO_MASK  0xfffffu
#define WHO_SET   0x80000u
#define BUSY_UNIT 10 /* log2 ms */
static uint64_t pack(uint64_t who, uint64_t hits, int64_t ms, uint64_t busy) {
  return (busy & MS_MASK) << 44 | ((uint64_t)ms & MS_MASK) << 24 | (hits & 0xf) << 20 |
         (who & WHO_MASK);
}

/* now - then for 20-bit wrapping times */
static uint64_t since20(uint64_t now, uint64_t then) {
  return (now - then) & MS_MASK;
}

/* The most shards growth goes to: the writers seen, at most the CPUs,
 * rounded up to a power of two (so thread tickets map one to a shard). */
static uint32_t cap_of(tally_store *s) {
  static uint32_t ncpu;
  if (!ncpu) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    ncpu = n < 1 ? 1 : n > TALLY_MAX_SHARDS ? TALLY_MAX_SHARDS : (uint32_t)n;
  }
  uint64_t w = atomic_load_explicit(&s->hdr->writers, memory_order_relaxed);
  uint32_t want = w < ncpu ? (uint32_t)w : ncpu, cap = 1;
  while (cap < want && cap < TALLY_MAX_SHARDS) cap <<= 1;
  return cap;
}

/* Count an automatic reshard in flags (10 bits, saturating). */
static void bump(struct tally__rec *r, int shift) {
  uint32_t f = atomic_load(&r->flags);
  while (((f >> shift) & 0x3ff) != 0x3ff &&
         !atomic_compare_exchange_weak(&r->flags, &f, f + (1u << shift))) {}
}

int tally__auto_sample(tally_counter *c, uint64_t loc) {
  if (atomic_load_explicit(&c->gone, memory_order_relaxed)) return 0;
  tally_store *s = c->s;
  if (tally__me.store_id != c->store_id)
    tally__draw_ticket(s); /* random: no ticket yet */
  uint64_t rec_off = tally__crec(c);
  struct tally__rec *r = tally__at(s, rec_off);
  int64_t now = tally_monotonic_ms();
  uint64_t w = atomic_load_explicit(&r->contention, memory_order_relaxed);
  uint64_t mine = (tally__me.ticket & (WHO_SET - 1)) | WHO_SET, last = w & WHO_MASK,
           hits = (w >> 20) & 0xf;
  uint64_t then = (w >> 24) & MS_MASK, busy = w >> 44;
  uint64_t now20 = (uint64_t)now & MS_MASK, unit = ((uint64_t)now >> BUSY_UNIT) | 1;
  uint32_t n = tally__loc_shards(loc);
  bool near = last && since20(now20, then) <= TALLY_AUTO_WINDOW_MS;
  if (near && last != mine) {
    bool same =
        c->policy != TALLY_POLICY_THREAD ||
        tally__reduce(last & (WHO_SET - 1), n) == tally__reduce(mine & (WHO_SET - 1), n);
    if (!same) { /* writers on separate cells: no growth; busy once a unit */
      if ((busy & MS_MASK) != (unit & MS_MASK))
        atomic_store_explicit(&r->contention, pack(last, hits, (int64_t)then, unit),
                              memory_order_relaxed);
      return 0;
    }
    hits++;
    busy = unit;
  } else if (near && now20 == then) {
    return 0; /* still its own, and fresh: nothing to write */
  } else if (!near) {
    hits = 0;
  }
  if (hits < HITS_TO_GROW) { /* the record's line is written only here */
    atomic_store_explicit(&r->contention, pack(mine, hits, now, busy),
                          memory_order_relaxed);
    return 0;
  }
  atomic_store_explicit(&r->contention, pack(mine, 0, now, busy), memory_order_relaxed);
  uint32_t cap = cap_of(s);
  if (n >= cap) return 0;
  uint32_t to = n * 2 < cap ? n * 2 : cap;
  /* grow only: another writer may have grown it past what this handle saw */
  if (tally__reshard(s, rec_off, to, true, &loc) == 0) { /* else: stays as it is */
    tally__handle_set_loc(c, loc);
    if (tally__loc_shards(loc) > n) bump(r, TALLY__REC_GROWN_SHIFT);
  }
  return 0;
}

/* TALLY_AUTO_QUIET_MS from the environment (0: shrink at the next
 * upkeep), else the default; read once (-1: not yet). */
static int64_t quiet_ms(void) {
  static _Atomic int64_t q = -1; /* upkeep may run in several threads at once */
  int64_t v = atomic_load_explicit(&q, memory_order_relaxed);
  if (v < 0) {
    const char *e = getenv("TALLY_AUTO_QUIET_MS");
    char *end = NULL;
    long long n = e && *e ? strtoll(e, &end, 10) : -1;
    v = n >= 0 && end && !*end ? n : TALLY_AUTO_QUIET_MS;
    atomic_store_explicit(&q, v, memory_order_relaxed);
  }
  return v;
}

int tally__auto_upkeep(tally_store *s, uint64_t rec_off) {
  struct tally__rec *r = tally__at(s, rec_off);
  if (!(atomic_load(&r->flags) & TALLY__REC_AUTO)) return 0;
  if (tally__loc_shards(atomic_load(&r->loc)) <= 1) return 0;
  uint64_t busy = atomic_load(&r->contention) >> 44;
  uint64_t unit = ((uint64_t)tally_monotonic_ms() >> BUSY_UNIT) | 1; /* as sampled */
  /* units are odd, so a gap of d units is more than (d - 2) * 1024 ms
   * since the last contention (busy is refreshed whenever the unit has
   * changed): q ms have passed once d >= ceil(q / 1024) + 2, and d is
   * kept in 20 bits (12 days) */
  uint64_t q = (uint64_t)quiet_ms(), need = q ? (q + 1023) / 1024 + 2 : 0;
  if (need > MS_MASK - 1) need = MS_MASK - 1;
  if (busy && since20(unit, busy) < need) return 0;
  int rc = tally__reshard(s, rec_off, 1, false, NULL);
  if (rc == 0) bump(r, TALLY__REC_SHRUNK_SHIFT);
  return rc;
}
