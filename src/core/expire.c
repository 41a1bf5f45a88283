/* expire.c -- upkeep: grace steps, reuse, and idle expiry.
 *
 * A family with idle_s drops counters whose value has not moved for that
 * long. Nothing on the increment's path records time: the scan keeps, in
 * each record, the value it last saw and when it first saw it, and a
 * counter is idle when a later scan finds the same value idle_s later. So
 * an increment and a decrement that cancel between two scans look idle;
 * increments of 0 are not increments.
 *
 * The drop is exact: it is a move (journal.c) that only happens if the
 * journalled total is the value that was found idle; an increment that
 * raced in makes it undo itself, and the writer retries on the restored
 * cells. A counter that a rollup schedule covers leaves only once its
 * latest rollup record holds that same value, so its final value has gone
 * out; one with no rollup yet waits until every running schedule has
 * rolled up a period since it went idle. One that a flusher ships leaves
 * only once the flusher has confirmed that value remotely (ship.c).
 * Handles of an expired counter create it again on their next increment
 * (counter.c).
 *
 * The scan walks the index from where this process's last call stopped,
 * `budget` entries a call, so a host's timer pays a bounded cost.
 */
#include "internal.h"

struct scan {
  int64_t now_ms;
  tally_maintain_result *r;
};

/* Drop the counter at rec_off if its value is still v. */
static int expire_one(tally_store *s, uint64_t rec_off, int64_t v) {
  struct tally__rec *r = tally__at(s, rec_off);
  int rc = tally__lock(s);
  if (rc) return rc;
  uint64_t loc = atomic_load_explicit(&r->loc, memory_order_acquire), cells;
  uint32_t n;
  bool dropped;
  rc = tally__loc_decode(s, rec_off, loc, &cells, &n, &dropped);
  if (rc == 0 && !dropped) {
    atomic_fetch_or(&r->flags, TALLY__REC_EXPIRED); /* before handles can see it gone */
    /* (killed here, the counter stays with the mark: harmless, since a drop
     * clears it and an expiry sets it) */
    TALLY__TEST_HOOK("expire", r->name, r->name_len);
    rc = tally__journal_drop_if(s, rec_off, tally__loc_make(s, rec_off, cells, n, true),
                                v);
    if (rc) atomic_fetch_and(&r->flags, ~TALLY__REC_EXPIRED);
  }
  tally__unlock(s);
  return rc;
}

/* A counter without a rollup block may still be one a schedule covers: it
 * gets its block when the schedule next rolls up. The store keeps no
 * patterns, so: has every schedule that runs rolled a period up since the
 * counter went idle (it would have covered it then)? Schedules nobody has
 * run for two periods are not waited for. */
static bool schedules_behind(tally_store *s, int64_t since_ms) {
  struct tally__rollup_table *t;
  if (tally__table_of(s, false, &t) || !t) return false;
  int64_t mono = tally_monotonic_ms();
  for (uint32_t i = 0; i < TALLY__SCHED_SLOTS; i++) {
    struct tally__sched_slot *sl = &t->slot[i];
    int64_t every = atomic_load(&sl->every_ms), done = atomic_load(&sl->done);
    if (!atomic_load(&sl->id) || every <= 0) continue;
    int64_t until = atomic_load(&sl->until);
    if (until < mono - 2 * every - 1000) continue;         /* abandoned */
    if (until > mono + tally__lease_span(every)) continue; /* another boot's */
    if (done == 0 || (done - 1) * every < since_ms) return true;
  }
  return false;
}

static int scan_one(tally_store *s, uint64_t rec_off, void *ud) {
  struct scan *sc = ud;
  struct tally__rec *r = tally__at(s, rec_off);
  const struct tally__family *f;
  int64_t v;
  sc->r->scanned++;
  tally__auto_upkeep(s, rec_off); /* fails only to stay as it is */
  if (tally__family_of(s, r->name, r->name_len, &f) || !f || !f->idle_s) return 0;
  /* a dead writer's batch may still be undone in its cells (batch.c) */
  if (r->policy == TALLY_POLICY_SLOT) return 0;
  if (tally__rec_value(s, rec_off, &v)) return 0; /* dropped meanwhile, or check() */
  /* whole seconds, so the time fits in 32 bits: first seen rounded up,
   * now rounded down, so a counter never leaves early (at most a second
   * late) */
  int64_t now_ms = sc->now_ms > 0 ? sc->now_ms : 0;
  uint32_t since = atomic_load(&r->idle_since);
  if (since == 0 || v != atomic_load(&r->idle_value)) {
    atomic_store(&r->idle_value, v);
    atomic_store(&r->idle_since, (uint32_t)((now_ms + 999) / 1000 + 1));
    return 0;
  }
  if ((int64_t)(now_ms / 1000 + 1) - (int64_t)since < (int64_t)f->idle_s) return 0;
  if (tally__ship_holds(s, r, v)) { /* its final value has not been flushed */
    sc->r->held++;
    return 0;
  }
  struct tally__block *b = NULL;
  if (tally__block_of(s, rec_off, &b)) return 0;
  if (b ? atomic_load(&b->count) == 0 || atomic_load(&b->value) != v
        : schedules_behind(s, (int64_t)(since - 1) * 1000)) {
    sc->r->held++; /* its final value has not gone out in a rollup yet */
    return 0;
  }
  int rc = expire_one(s, rec_off, v);
  if (rc == 0 && ++sc->r->expired % 1024 == 0 && (rc = tally__lock(s)) == 0) {
    /* as drops do: limbo is reclaimed along the way, not only after a scan
     * that expired a million */
    tally__grace_step(s, false, false);
    tally__unlock(s);
  }
  return rc == TALLY_EBUSY ? 0 : rc;
}

int tally_store_maintain(tally_store *s, int64_t now_ms, uint32_t budget,
                         tally_maintain_result *out) {
  tally_maintain_result r = {0};
  if (!s) return tally__fail(TALLY_EINVAL, "tally_store_maintain: store is NULL");
  if (now_ms > TALLY_MAINTAIN_MAX_MS)
    return tally__fail(TALLY_EINVAL,
                       "tally_store_maintain: now_ms %lld is beyond %lld (idle times are "
                       "kept in 32-bit seconds)",
                       (long long)now_ms, (long long)TALLY_MAINTAIN_MAX_MS);
  int rc = tally__truncated(s);
  if (rc == 0) rc = tally__lock(s);
  if (rc) return rc;
  tally__grace_step(s, true, false); /* upkeep: who is alive, looked at afresh */
  tally__slots_settle(s);            /* before the scan reads values */
  tally__unlock(s);
  struct scan sc = {now_ms, &r};
  if (budget && (tally__family_any_idle(s) || atomic_load(&s->hdr->autos))) {
    /* threads sharing the handle may scan at once: each from the cursor */
    uint64_t cursor = atomic_load_explicit(&s->expire_cursor, memory_order_relaxed);
    rc = tally__index_range(s, &cursor, budget, scan_one, &sc);
    atomic_store_explicit(&s->expire_cursor, cursor, memory_order_relaxed);
  }
  if (rc == 0 && r.expired) { /* its handles here: let them know at once */
    if ((rc = tally__lock(s)) == 0) {
      tally__grace_step(s, false, false);
      tally__unlock(s);
    }
  }
  if (out) *out = r;
  return rc;
}
