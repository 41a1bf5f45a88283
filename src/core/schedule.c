/* schedule.c -- rollup schedules: which process rolls each period up, once.
 *
 * A schedule (pattern, every, rings) rolls up every counter its pattern
 * matches once a period, into the counters' rollup blocks (rollup.c). Its
 * slot in the store's rollup table keeps, per schedule identity (pattern,
 * every), the last period done, the period in progress, how far it got,
 * and a lease. The lease makes one process at a time run a schedule, and
 * the period record makes each period run once. A lease is taken under the
 * store lock, once per tick; the holder renews it as it goes and stops as
 * soon as it was taken over. A holder whose pid is gone loses it at once; a
 * live one after one period without renewal.
 *
 * A period whose run was interrupted (its holder died) is finished by the
 * next holder: members are rolled in a fixed order (by cell offset) and
 * the slot records the sort key of the last one done, so the next holder
 * starts after it and no counter is rolled twice for one period. */
#include "internal.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define RENEW_EVERY 1024u /* counters rolled between lease checks */

/* A counter the schedule covers, with its block as last seen: the sealed
 * word tells when another process gave it a new one. */
struct member {
  uint64_t rec_off;
  uint64_t key;  /* cell offset when listed: the roll order */
  uint64_t word; /* rec->rollup when `b` was resolved */
  struct tally__block *b;
};

struct tally_schedule {
  tally_store *s;
  char *pattern;
  size_t plen;
  int64_t every_ms;
  uint64_t id;
  tally_ring rings[TALLY_RINGS_MAX];
  uint32_t nrings;
  struct member *members; /* in cell order */
  size_t nmembers;
  uint64_t generation; /* of the store when members was built */
  bool built;
};

/* ---- schedules --------------------------------------------------------------- */

int tally_schedule_new(tally_store *s, const char *pattern, size_t plen, int64_t every_ms,
                       const tally_ring *rings, uint32_t nrings, tally_schedule **out) {
  if (!s || !pattern || !out || (nrings && !rings))
    return tally__fail(TALLY_EINVAL, "tally_schedule_new: NULL argument");
  if (plen == 0 || plen > TALLY_NAME_MAX || memchr(pattern, 0, plen))
    return tally__fail(TALLY_EINVAL,
                       "rollup pattern must be 1 to %d bytes, "
                       "no NUL",
                       TALLY_NAME_MAX);
  if (every_ms < 1 || every_ms > (int64_t)TALLY_RING_RES_MAX * 1000)
    return tally__fail(TALLY_EINVAL,
                       "rollup period must be from 1 ms to 366 "
                       "days, got %lld ms",
                       (long long)every_ms);
  if (nrings > TALLY_RINGS_MAX)
    return tally__fail(TALLY_EINVAL, "at most %d history resolutions, got %u",
                       TALLY_RINGS_MAX, nrings);
  for (uint32_t i = 0; i < nrings; i++) {
    if (!tally__ring_ok(&rings[i]))
      return tally__fail(TALLY_EINVAL,
                         "history of %u buckets of %u s is out "
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
static int slot_of(tally_schedule *sch, struct tally__rollup_table *t,
                   struct tally__sched_slot **out) {
  struct tally__sched_slot *free_slot = NULL;
  for (int i = 0; i < TALLY__SCHED_SLOTS; i++) {
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
                       tally__store_name(sch->s), TALLY__SCHED_SLOTS);
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
  const char *p = strrchr(buf, ')'); /* the state follows "(comm)" */
  return p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X');
}

static uint64_t lease_me(void) {
  static _Atomic uint32_t tokens;
  uint32_t token = atomic_fetch_add(&tokens, 1) + 1;
  return (uint64_t)(uint32_t)getpid() << 32 | token;
}

/* Caller holds the store lock. */
static bool lease_take(struct tally__sched_slot *slot, uint64_t me, int64_t span) {
  uint64_t owner = atomic_load_explicit(&slot->owner, memory_order_acquire);
  int64_t now = tally_monotonic_ms(), until = atomic_load(&slot->until);
  /* a lease ends at most one span from now: one ending later was taken
   * under another boot's monotonic clock (the file outlived a reboot) */
  if (owner && now < until && until <= now + span && !pid_gone((pid_t)(owner >> 32)))
    return false;
  atomic_store(&slot->until, now + span);
  atomic_store_explicit(&slot->owner, me, memory_order_release);
  return true;
}

static bool lease_renew(struct tally__sched_slot *slot, uint64_t me, int64_t span) {
  if (atomic_load_explicit(&slot->owner, memory_order_acquire) != me) return false;
  atomic_store(&slot->until, tally_monotonic_ms() + span);
  return true;
}

/* ---- members ------------------------------------------------------------------- */

/* Does block b have every ring of sch, at least as long? */
static bool block_covers(const struct tally__block *b, const tally_schedule *sch) {
  for (uint32_t i = 0; i < sch->nrings; i++) {
    uint32_t j = 0;
    while (j < b->nrings && b->ring[j].res_s != sch->rings[i].res_s) j++;
    if (j == b->nrings || b->ring[j].len < sch->rings[i].len) return false;
  }
  return true;
}

struct gather {
  tally_schedule *sch;
  uint64_t *v;
  size_t n, cap;
};

static int gather_one(tally_store *s, uint64_t rec_off, void *ud) {
  struct gather *g = ud;
  const struct tally__rec *r = tally__at(s, rec_off);
  if (!tally_glob_match(g->sch->pattern, g->sch->plen, r->name, r->name_len)) return 0;
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

static tally_store *sort_store; /* qsort has no context argument */
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
    struct tally__block *b;
    if (i % RENEW_EVERY == 0) {
      if (locked) tally__unlock(s); /* let creators in now and then */
      locked = false;
      if (!run_renew(u)) {
        rc = 1; /* lost the lease */
        break;
      }
    }
    if (tally__block_of(s, g.v[i], &b)) continue; /* damaged: check() reports it */
    if (b && block_covers(b, sch)) continue;
    if (!locked && (rc = tally__lock(s))) break;
    locked = true;
    /* again under the lock: another schedule may have grown it meanwhile */
    if (tally__block_of(s, g.v[i], &b) || (b && block_covers(b, sch))) continue;
    rc = tally__block_grow(s, g.v[i], b, sch->rings, sch->nrings);
    if (rc == TALLY_EINVAL) rc = 0; /* too many rings: rolled with those it has */
  }
  if (locked) tally__unlock(s);
  struct member *m = rc ? NULL : malloc((g.n ? g.n : 1) * sizeof *m);
  if (!m && rc == 0) rc = tally__fail(TALLY_ENOMEM, "out of memory");
  for (size_t i = 0; i < g.n && rc == 0; i++) {
    struct tally__rec *r = tally__at(s, g.v[i]);
    m[i].rec_off = g.v[i];
    m[i].key = atomic_load_explicit(&r->loc, memory_order_acquire) >> 32;
    m[i].word = atomic_load_explicit(&r->rollup, memory_order_acquire);
    if (tally__block_of(s, g.v[i], &m[i].b)) m[i].b = NULL; /* skipped, see above */
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
  struct tally__sched_slot *slot;
  uint64_t me;
  struct tally__when when; /* the tick's moment, its bucket in each ring shape */
  uint64_t resume_after;   /* members with key + 1 <= this are done */
  tally_rollup_fn fn;
  void *ud;
  uint64_t rolled, skipped;
};

/* Where the current bucket of each ring of b lives: prefetched ahead,
 * since a tick is bound by cache misses, not by arithmetic. */
static void prefetch_slots(struct tally__block *b, struct tally__when *w) {
  _Atomic int64_t *slot = tally__slots_at(b);
  for (uint32_t i = 0; i < b->nrings && i < TALLY_RINGS_MAX; i++) {
    uint32_t res_s = b->ring[i].res_s, len = b->ring[i].len;
    if (!res_s || !len) return; /* damaged: tally__block_sound skips it */
    uint32_t at;
    tally__when_bucket(w, res_s, len, &at);
    __builtin_prefetch(&slot[at], 1);
    slot += len;
  }
}

#define AHEAD 16 /* members prefetched ahead: record and block, then slots */

static bool run_renew(struct run *u) {
  return lease_renew(u->slot, u->me, tally__lease_span(u->sch->every_ms));
}

/* Claim member i's current block: *b NULL if it has none (damaged). */
static uint64_t member_claim(tally_store *s, struct member *m, struct tally__block **b) {
  struct tally__rec *rec = tally__at(s, m->rec_off);
  for (;;) {
    uint64_t word = atomic_load_explicit(&rec->rollup, memory_order_acquire);
    if (word != m->word || !m->b) { /* another process gave it a new block */
      if (tally__block_of(s, m->rec_off, &m->b)) m->b = NULL;
      m->word = word;
    }
    if (!(*b = m->b)) return 0;
    uint64_t odd = tally__block_claim(m->b);
    if (atomic_load_explicit(&rec->rollup, memory_order_acquire) == m->word) return odd;
    tally__block_release(m->b, odd); /* replaced while we waited: look again */
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
      prefetch_slots(m[i + AHEAD / 2].b, &u->when);
    if (m[i].key + 1 <= u->resume_after) continue; /* the dead holder did it */
    struct tally__block *b;
    int64_t v;
    uint64_t odd = member_claim(s, &m[i], &b);
    if (b && !tally__block_sound(s, (uint64_t)((unsigned char *)b - s->base),
                                 m[i].rec_off, b)) {
      tally__block_release(b, odd); /* damaged since it was resolved */
      m[i].b = NULL;
      b = NULL;
    }
    if (!b) {
      u->skipped++; /* damaged: check() reports it */
      continue;
    }
    int rc = tally__rec_value(s, m[i].rec_off, &v);
    int64_t at = atomic_load_explicit(&b->at_ms, memory_order_relaxed);
    /* rolled later already, by another schedule of the counter: within a
     * period of this one's moment (clocks read a little apart), as of
     * that later moment; further ahead, never back in time */
    if (rc || at - u->when.now_ms > sch->every_ms) {
      tally__block_release(b, odd);
      if (rc == TALLY_EDROPPED)
        sch->built = false; /* list it anew */
      else
        u->skipped++; /* out of range, or never back in time */
      continue;
    }
    struct tally__when later, *w = &u->when;
    if (at > u->when.now_ms) tally__when_init(w = &later, at);
    tally_rollup r;
    tally__block_roll(b, v, w, &r);
    tally__block_release(b, odd);
    atomic_store_explicit(&u->slot->cursor, m[i].key + 1, memory_order_relaxed);
    u->rolled++;
    if (u->fn) {
      const struct tally__rec *rec = tally__at(s, m[i].rec_off);
      u->fn(u->ud, rec->name, rec->name_len, &r);
    }
  }
  return 0;
}

int tally_schedule_tick(tally_schedule *sch, int64_t now_ms, tally_rollup_fn fn, void *ud,
                        tally_tick_result *out) {
  if (!sch || !out)
    return tally__fail(TALLY_EINVAL, "tally_schedule_tick: NULL argument");
  if (now_ms < 0)
    return tally__fail(TALLY_EINVAL, "rollup time must not be before the epoch");
  tally_store *s = sch->s;
  int64_t period = now_ms / sch->every_ms;
  *out = (tally_tick_result){.period = period, .status = TALLY_TICK_NOT_DUE};

  struct tally__rollup_table *t;
  struct run u = {.sch = sch, .me = lease_me(), .fn = fn, .ud = ud};
  tally__when_init(&u.when, now_ms);
  int rc = tally__lock(s);
  if (rc) return rc;
  rc = tally__table_of(s, true, &t);
  if (rc == 0) rc = slot_of(sch, t, &u.slot);
  if (rc) {
    tally__unlock(s);
    return rc;
  }
  if (atomic_load(&u.slot->done) > period) {
    tally__unlock(s);
    return 0;
  }
  if (!lease_take(u.slot, u.me, tally__lease_span(sch->every_ms))) {
    tally__unlock(s);
    out->status = TALLY_TICK_BUSY;
    return 0;
  }
  tally__slots_settle(s); /* a dead writer's half batch is not history */
  /* an earlier period whose holder stalled or died past its end (its
   * lease lasts a period beyond its last renewal): finished first */
  int64_t running = atomic_load(&u.slot->running), unfinished = -1;
  if (running == period + 1) {
    u.resume_after = atomic_load(&u.slot->cursor); /* a holder died in it */
  } else if (running > atomic_load(&u.slot->done) && running - 1 < period) {
    unfinished = running - 1;
    u.resume_after = atomic_load(&u.slot->cursor);
  } else {
    atomic_store(&u.slot->cursor, 0);
    atomic_store(&u.slot->running, period + 1);
  }
  tally__unlock(s);

  rc = members_refresh(sch, &u);
  int lost = rc == 1;
  if (rc == 0 && unfinished >= 0) {
    /* from where its holder stopped, as of its last moment (the values
     * are read now), then the current period from the start */
    tally__when_init(&u.when, (unfinished + 1) * sch->every_ms - 1);
    lost = roll_members(&u);
    if (!lost && (rc = tally__lock(s)) == 0) {
      if (atomic_load(&u.slot->owner) == u.me) {
        atomic_store(&u.slot->done, unfinished + 1);
        atomic_store(&u.slot->cursor, 0);
        atomic_store(&u.slot->running, period + 1);
      } else {
        lost = 1;
      }
      tally__unlock(s);
    }
    tally__when_init(&u.when, now_ms);
    u.resume_after = 0;
  }
  if (rc == 0 && !lost) lost = roll_members(&u);
  if (rc == 1) rc = 0;
  out->counters = u.rolled;
  out->skipped = (uint32_t)(u.skipped > UINT32_MAX ? UINT32_MAX : u.skipped);

  int lrc = tally__lock(s);
  if (lrc) { /* the lease runs out by itself */
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

/* ---- what the store keeps of its schedules --------------------------------- */

int tally__schedules_check(tally_store *s) {
  struct tally__rollup_table *t;
  int rc = tally__table_of(s, false, &t);
  if (rc || !t) return rc;
  for (int i = 0; i < TALLY__SCHED_SLOTS; i++) {
    const struct tally__sched_slot *sl = &t->slot[i];
    if (!atomic_load(&sl->id)) continue;
    int64_t every = atomic_load(&sl->every_ms), done = atomic_load(&sl->done), last;
    int64_t running = atomic_load(&sl->running);
    /* every 0: kept by a version that did not keep it */
    const char *why =
        every < 0 || every > (int64_t)TALLY_RING_RES_MAX * 1000
            ? "its period is out of range"
        : done < 0 || running < 0 ? "a period count is negative"
        : every > 0 && done > 0 && __builtin_mul_overflow(done - 1, every, &last)
            ? "its last period is beyond any time"
            : NULL;
    if (why)
      return tally__fail(TALLY_ECORRUPT,
                         "%s: tally store is corrupt (rollup schedule slot %d: %s)",
                         tally__store_name(s), i, why);
  }
  return 0;
}

int tally__rollup_schedules(tally_store *s, uint32_t *n) {
  struct tally__rollup_table *t;
  int rc = tally__table_of(s, false, &t);
  *n = 0;
  if (rc || !t) return rc;
  for (int i = 0; i < TALLY__SCHED_SLOTS; i++)
    if (atomic_load_explicit(&t->slot[i].id, memory_order_acquire)) (*n)++;
  return 0;
}

int tally_store_schedules(tally_store *s, tally_schedule_info *out, uint32_t cap,
                          uint32_t *n) {
  if (!s || !n || (cap && !out))
    return tally__fail(TALLY_EINVAL, "tally_store_schedules: NULL argument");
  struct tally__rollup_table *t;
  int rc = tally__truncated(s);
  if (rc == 0) rc = tally__table_of(s, false, &t);
  *n = 0;
  if (rc || !t) return rc;
  for (int i = 0; i < TALLY__SCHED_SLOTS; i++) {
    const struct tally__sched_slot *slot = &t->slot[i];
    if (!atomic_load_explicit(&slot->id, memory_order_acquire)) continue;
    if (*n < cap) {
      int64_t every = atomic_load_explicit(&slot->every_ms, memory_order_relaxed);
      int64_t done = atomic_load_explicit(&slot->done, memory_order_relaxed), last = -1;
      uint64_t owner = atomic_load_explicit(&slot->owner, memory_order_relaxed);
      /* a damaged slot's product may not fit: none, rather than a wrap */
      if (done > 0 && every > 0 && __builtin_mul_overflow(done - 1, every, &last))
        last = -1;
      out[*n] = (tally_schedule_info){
          .every_ms = every,
          .last_period_ms = last,
          .holder_pid = (int64_t)(owner >> 32),
      };
    }
    (*n)++;
  }
  return 0;
}
