/* aggregate.c -- questions about many counters: names, values, sums, counts.
 *
 * All of them walk the name index once and read each record in place, with
 * no handle per counter. A counter created during the walk may or may not
 * be seen; one dropped during it is skipped once its drop is published.
 */
#include "internal.h"

#include <string.h>

struct walk {
  const char *pattern;
  size_t plen;
  tally_name_fn fn;
  tally_value_fn value_fn;
  void *ud;
  __int128 sum;
  uint64_t count;
};

/* 1: a live counter matching the pattern; 0: not; < 0: a damaged record. */
static int live_match(tally_store *s, uint64_t rec_off, struct walk *w) {
  const struct tally__rec *r = tally__at(s, rec_off);
  uint64_t cells;
  uint32_t n;
  bool dropped;
  int rc =
      tally__loc_decode(s, rec_off, atomic_load_explicit(&r->loc, memory_order_acquire),
                        &cells, &n, &dropped);
  if (rc) return rc;
  return !dropped && tally_glob_match(w->pattern, w->plen, r->name, r->name_len);
}

static int name_one(tally_store *s, uint64_t rec_off, void *ud) {
  struct walk *w = ud;
  int m = live_match(s, rec_off, w);
  if (m <= 0) return m;
  const struct tally__rec *r = tally__at(s, rec_off);
  return w->fn(w->ud, r->name, r->name_len);
}

/* 1 and *v: a live counter matching the pattern, and its value; 0: not
 * one (or dropped meanwhile); < 0: an error (TALLY_ERANGE: beyond int64). */
static int value_of(tally_store *s, uint64_t rec_off, struct walk *w, int64_t *v) {
  int m = live_match(s, rec_off, w);
  if (m <= 0) return m;
  int rc = tally__rec_value(s, rec_off, v);
  return rc == TALLY_EDROPPED ? 0 : rc ? rc : 1;
}

static int sum_one(tally_store *s, uint64_t rec_off, void *ud) {
  struct walk *w = ud;
  int64_t v;
  int m = value_of(s, rec_off, w, &v);
  if (m <= 0) return m;
  w->sum += v;
  w->count++;
  return 0;
}

static int value_one(tally_store *s, uint64_t rec_off, void *ud) {
  struct walk *w = ud;
  int64_t v;
  int m = value_of(s, rec_off, w, &v);
  if (m == TALLY_ERANGE) return 0; /* left out: see tally.h */
  if (m <= 0) return m;
  const struct tally__rec *r = tally__at(s, rec_off);
  return w->value_fn(w->ud, r->name, r->name_len, v);
}

static void pattern_or_all(struct walk *w, const char *pattern, size_t plen) {
  w->pattern = pattern && plen ? pattern : "*";
  w->plen = pattern && plen ? plen : 1;
}

int tally_store_each(tally_store *s, const char *pattern, size_t plen, tally_name_fn fn,
                     void *ud) {
  if (!s || !fn) return tally__fail(TALLY_EINVAL, "tally_store_each: NULL argument");
  struct walk w = {.fn = fn, .ud = ud};
  pattern_or_all(&w, pattern, plen);
  return tally__index_each(s, name_one, &w);
}

int tally_store_values(tally_store *s, const char *pattern, size_t plen,
                       tally_value_fn fn, void *ud) {
  if (!s || !fn) return tally__fail(TALLY_EINVAL, "tally_store_values: NULL argument");
  struct walk w = {.value_fn = fn, .ud = ud};
  pattern_or_all(&w, pattern, plen);
  return tally__index_each_value(s, value_one, &w);
}

int tally_store_sum(tally_store *s, const char *pattern, size_t plen, int64_t *sum,
                    uint64_t *count) {
  if (!s || !sum) return tally__fail(TALLY_EINVAL, "tally_store_sum: NULL argument");
  struct walk w = {0};
  pattern_or_all(&w, pattern, plen);
  int rc = tally__index_each_value(s, sum_one, &w);
  if (rc) return rc;
  if (w.sum > INT64_MAX || w.sum < INT64_MIN)
    return tally__fail(TALLY_ERANGE, "sum over '%.*s' does not fit in 64 bits",
                       (int)w.plen, w.pattern);
  *sum = (int64_t)w.sum;
  if (count) *count = w.count;
  return 0;
}

static int count_one(tally_store *s, uint64_t rec_off, void *ud) {
  struct walk *w = ud;
  int m = live_match(s, rec_off, w);
  if (m > 0) w->count++;
  return m < 0 ? m : 0;
}

int tally_store_stats_get(tally_store *s, tally_store_stats *out) {
  if (!s || !out)
    return tally__fail(TALLY_EINVAL, "tally_store_stats_get: NULL argument");
  struct walk w = {.pattern = "*", .plen = 1};
  int rc = tally__truncated(s); /* before the walk touches a missing page */
  if (rc == 0) rc = tally__index_each(s, count_one, &w);
  if (rc) return rc;
  out->counters = w.count;
  out->used_bytes = atomic_load(&s->hdr->used);
  out->retired_bytes = atomic_load(&s->hdr->retired);
  out->reusable_bytes = atomic_load(&s->hdr->free_bytes);
  out->reused_bytes = atomic_load(&s->hdr->reused);
  out->expired = atomic_load(&s->hdr->expired);
  out->capped = atomic_load(&s->hdr->capped);
  uint64_t idle = out->retired_bytes + out->reusable_bytes;
  out->live_bytes = out->used_bytes > idle + TALLY__ARENA_OFF
                        ? out->used_bytes - idle - TALLY__ARENA_OFF
                        : 0;
  out->file_bytes = atomic_load(&s->hdr->size);
  if (s->kind != TALLY__FILE) out->file_bytes = out->used_bytes;
  out->max_bytes = s->hdr->max_bytes;
  out->writers = atomic_load(&s->hdr->writers);
  out->format = s->hdr->format;
  out->schedules = 0;
  return tally__rollup_schedules(s, &out->schedules);
}
