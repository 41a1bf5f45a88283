/* autoshard.c -- counters that size their own shards (TALLY_SHARDS_AUTO).
 *
 * An auto counter starts with one cell: a cold counter costs what an array
 * slot does. It doubles its shards online (the exact reshard of move.c)
 * when writers collide on one cell, and upkeep takes it back to one cell
 * once it has been quiet.
 *
 * The signal has to stay off the increment's path, so it is sampled: a
 * thread looks at the record on every TALLY__AUTO_SAMPLE-th increment it
 * makes on auto counters (a countdown in its thread-local writer state;
 * the increment itself is unchanged). The record's contention word holds
 * the ticket of the last sampling writer, a hit count and the time. A
 * sample that finds another writer's ticket, one that lands on the same
 * shard as this one, within TALLY_AUTO_WINDOW_MS of the previous sample, is
 * a hit; a gap longer than the window starts over. 8 hits double the
 * shards, up to the writers seen (thread tickets drawn from the store) and
 * the CPUs. Why this signal: it costs a byte test on the increment of
 * fixed counters and one thread-local decrement on auto ones, and it only
 * fires at rates where sharing a cache line costs something: a cold
 * counter that several threads touch now and then is almost never sampled
 * twice within 2 ms, and a hot one with one writer only ever finds its own
 * ticket. Two writers already on separate shards are not a hit (no
 * growth), but they keep the counter from shrinking.
 */
#include "internal.h"

#include <stdlib.h>
#include <unistd.h>

#define HITS_TO_GROW 8

static uint64_t pack(uint64_t ticket16, uint64_t hits, int64_t ms) {
  return (uint64_t)ms << 24 | (hits & 0xff) << 16 | (ticket16 & 0xffff);
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

/* Count an automatic reshard in flags (12 bits, saturating). */
static void bump(struct tally__rec *r, int shift) {
  uint32_t f = atomic_load(&r->flags);
  while (((f >> shift) & 0xfff) != 0xfff &&
         !atomic_compare_exchange_weak(&r->flags, &f, f + (1u << shift))) {}
}

int tally__auto_sample(tally_counter *c, uint64_t loc) {
  struct tally__writer *me = &tally__me;
  me->sample = TALLY__AUTO_SAMPLE;
  if (atomic_load_explicit(&c->gone, memory_order_relaxed)) return 0;
  tally_store *s = c->s;
  if (me->store_id != c->store_id) tally__draw_ticket(s); /* random: no ticket yet */
  uint64_t rec_off = tally__crec(c);
  struct tally__rec *r = tally__at(s, rec_off);
  int64_t now = tally_monotonic_ms();
  uint64_t w = atomic_load_explicit(&r->contention, memory_order_relaxed);
  uint64_t mine = (me->ticket & 0xffff) + 1, last = w & 0xffff, hits = (w >> 16) & 0xff;
  int64_t then = (int64_t)(w >> 24);
  uint32_t n = tally__loc_shards(loc);
  if (!last || now - then > TALLY_AUTO_WINDOW_MS) {
    hits = 0;
  } else if (last != mine) {
    bool same = c->policy != TALLY_POLICY_THREAD ||
                tally__reduce(last - 1, n) == tally__reduce(mine - 1, n);
    if (same) hits++;
    atomic_store_explicit(&r->contended_ms, now, memory_order_relaxed); /* busy */
  }
  if (hits < HITS_TO_GROW) {
    atomic_store_explicit(&r->contention, pack(mine, hits, now), memory_order_relaxed);
    return 0;
  }
  atomic_store_explicit(&r->contention, pack(mine, 0, now), memory_order_relaxed);
  uint32_t cap = cap_of(s);
  if (n >= cap) return 0;
  uint32_t to = n * 2 < cap ? n * 2 : cap;
  if (tally__reshard(s, rec_off, to, &loc) == 0) { /* else: stays as it is */
    atomic_store_explicit(&c->loc, loc, memory_order_release);
    bump(r, TALLY__REC_GROWN_SHIFT);
  }
  return 0;
}

static int64_t quiet_ms(void) {
  static int64_t q;
  if (!q) {
    const char *e = getenv("TALLY_AUTO_QUIET_MS");
    long long v = e ? atoll(e) : 0;
    q = v > 0 ? v : TALLY_AUTO_QUIET_MS;
  }
  return q;
}

int tally__auto_upkeep(tally_store *s, uint64_t rec_off) {
  struct tally__rec *r = tally__at(s, rec_off);
  if (!(atomic_load(&r->flags) & TALLY__REC_AUTO)) return 0;
  if (tally__loc_shards(atomic_load(&r->loc)) <= 1) return 0;
  int64_t busy = atomic_load(&r->contended_ms);
  if (busy && tally_monotonic_ms() - busy < quiet_ms()) return 0;
  int rc = tally__reshard(s, rec_off, 1, NULL);
  if (rc == 0) bump(r, TALLY__REC_SHRUNK_SHIFT);
  return rc;
}
