/* histogram.c -- a histogram's writer: one observation, one batch.
 *
 * A histogram is a set of slot counters, one per bucket (not cumulative)
 * and one for the sum in integer units; lua/tally/histogram.lua names
 * them, this file only adds to them. An observation is the batch of two
 * increments its bucket +1, the sum + v / unit, so a snapshot sees both
 * or neither (batch.c).
 *
 * Observing is the hot call of a histogram (a request's latency in
 * nginx's log phase), and through tally_batch_incr it paid for what a
 * histogram never needs: checking that the counters are slot counters of
 * the store and distinct, summing duplicates. Here those hold by
 * construction, the bucket search and the rounding run in C beside the
 * batch, and under LuaJIT one FFI call does all of it. The batch takes
 * the short way (tally__batch_try2) from the locs the members' handles
 * hold, and the whole way (tally__batch_apply2) when anything is unusual.
 *
 * A buffered writer (tally_histogram_buffer) trades durability for speed:
 * it counts observations in memory of its own, no store write, and adds
 * them to the store as one batch (each bucket's count and the sum) at
 * every flush. A batch holds TALLY_BATCH_MAX counters, so the buffer is
 * flushed before a bucket would be its 64th with a count (the sum is the
 * other), and before the sum would overflow: a flush is always one
 * batch, and a snapshot sees a flushed buffer whole or not at all.
 */
#include "observe.h" /* and internal.h */

#include <math.h> /* fabs, isfinite, isnan */
#include <stdlib.h>
#include <string.h>

#define EXACT         9007199254740992.0 /* 2^53: sums beyond are not exact */
#define LINEAR_SEARCH 16                 /* bounds counted without branches */

/* What a buffered writer holds until its next flush. */
struct buffer {
  uint32_t limit;    /* observations held at most */
  uint32_t n;        /* observations held */
  uint32_t distinct; /* buckets with a count */
  int64_t sum;       /* in units */
  int64_t count[];   /* per bucket: nbounds + 1 */
};

struct tally_histogram {
  tally_store *s;
  struct buffer *buf; /* NULL: every observation is a batch of its own */
  double unit;
  size_t nbounds;
  tally_counter **member;       /* nbounds + 2: the buckets (the last +Inf), the sum */
  _Alignas(16) double bounds[]; /* at least LINEAR_SEARCH, +Inf after the last; 16-byte
                                   aligned: its pairs are loaded whole, never split */
};

void tally_histogram_close(tally_histogram *h) {
  if (!h) return;
  if (h->buf) (void)tally_histogram_flush(h); /* a failure loses it: said in tally.h */
  free(h->buf);
  for (size_t i = 0; h->member && i < h->nbounds + 2; i++)
    tally_counter_close(h->member[i]);
  free(h->member);
  free(h);
}

int tally_histogram_flush(tally_histogram *h) {
  if (!h) return tally__fail(TALLY_EINVAL, "tally_histogram_flush: histogram is NULL");
  struct buffer *b = h->buf;
  if (!b || b->n == 0) return 0;
  tally_counter *cs[TALLY_BATCH_MAX];
  int64_t ds[TALLY_BATCH_MAX];
  size_t k = 0;
  for (size_t i = 0; i <= h->nbounds; i++)
    if (b->count[i]) {
      cs[k] = h->member[i];
      ds[k++] = b->count[i];
    }
  if (b->sum) {
    cs[k] = h->member[h->nbounds + 1];
    ds[k++] = b->sum;
  }
  int rc = tally_batch_incr(h->s, cs, ds, k); /* k <= 64: see observe_buffered */
  if (rc) return rc;                          /* nothing added: kept for the next */
  memset(b->count, 0, (h->nbounds + 1) * sizeof b->count[0]);
  b->n = b->distinct = 0;
  b->sum = 0;
  return 0;
}

int tally_histogram_buffer(tally_histogram *h, uint32_t n) {
  if (!h) return tally__fail(TALLY_EINVAL, "tally_histogram_buffer: histogram is NULL");
  if (n > TALLY_HISTOGRAM_MAX_BUFFER)
    return tally__fail(TALLY_EINVAL,
                       "a histogram buffers at most %d observations, not %u",
                       TALLY_HISTOGRAM_MAX_BUFFER, n);
  int rc = tally_histogram_flush(h);
  if (rc) return rc;
  if (n == 0) {
    free(h->buf);
    h->buf = NULL;
    return 0;
  }
  if (!h->buf) {
    h->buf = calloc(1, sizeof *h->buf + (h->nbounds + 1) * sizeof h->buf->count[0]);
    if (!h->buf) return tally__fail(TALLY_ENOMEM, "out of memory");
  }
  h->buf->limit = n;
  return 0;
}

static int open_member(tally_store *s, const char *name, tally_counter **out) {
  if (!name)
    return tally__fail(TALLY_EINVAL, "tally_histogram_open: a member name is NULL");
  tally_counter_options o = {0, TALLY_POLICY_SLOT};
  size_t len = strlen(name);
  int rc = tally_counter_open(s, name, len, &o, TALLY_COUNTER_CREATE, out);
  if (rc == TALLY_EMISMATCH)
    return tally__fail(TALLY_EPOLICY,
                       "counter '%s' exists with another policy or shard count: a "
                       "histogram's members are slot counters",
                       name);
  /* a family at its cap hands out its overflow counter instead: a bucket
   * counted there would be no bucket of this histogram */
  if (rc == 0 && ((*out)->name_len != len || memcmp((*out)->name, name, len) != 0)) {
    tally_counter_close(*out);
    *out = NULL;
    return tally__fail(TALLY_EFULL,
                       "histogram member '%s': its family is at its cap of counters "
                       "(max_counters), and a histogram's members never go to the "
                       "overflow counter",
                       name);
  }
  return rc;
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return (x > y) - (x < y);
}

/* Distinct members: a counter named twice would be one cell written twice
 * in a batch, the second store losing the first add. */
static int check_distinct(tally_histogram *h) {
  size_t n = h->nbounds + 2;
  uint64_t *recs = malloc(n * sizeof *recs);
  if (!recs) return tally__fail(TALLY_ENOMEM, "out of memory");
  for (size_t i = 0; i < n; i++) recs[i] = tally__crec(h->member[i]);
  qsort(recs, n, sizeof *recs, cmp_u64);
  int rc = 0;
  for (size_t i = 1; i < n && rc == 0; i++)
    if (recs[i] == recs[i - 1])
      rc = tally__fail(TALLY_EINVAL, "tally_histogram_open: a counter is named twice");
  free(recs);
  return rc;
}

/* The shape mark: a hash of every member's name in order (so of the
 * bounds and the unit), never 0. It is kept in the +Inf bucket's record,
 * in the contention word that only automatic counters use otherwise (a
 * slot counter never is one), so a histogram reopened with the same
 * names needs no walk of the store to find its members
 * (tally_histogram_stored). */
static uint64_t shape_of(const char *const *names, size_t n) {
  uint64_t h = 0x5ea7ab1e; /* any seed: the chain starts somewhere */
  for (size_t i = 0; i < n; i++) h = tally__hash(names[i], strlen(names[i]), h);
  return h | 1;
}

/* Mark the +Inf bucket's record with the shape, unless it has one: the
 * first writer's names stay. Held, so that a record dropped meanwhile is
 * not reused under the store (grace.c); a gone handle's is not read. */
static void mark_shape(tally_histogram *h, uint64_t shape) {
  tally_counter *inf = h->member[h->nbounds];
  tally__hold_begin(h->s);
  if (!atomic_load(&inf->gone)) {
    struct tally__rec *r = tally__at(h->s, tally__crec(inf));
    uint64_t none = 0;
    if (r->policy == TALLY_POLICY_SLOT)
      atomic_compare_exchange_strong(&r->contention, &none, shape);
  }
  tally__hold_end(h->s);
}

int tally_histogram_open(tally_store *s, const double *bounds, size_t nbounds,
                         const char *const *names, double unit, tally_histogram **out) {
  if (!s || !names || (nbounds && !bounds) || !out)
    return tally__fail(TALLY_EINVAL, "tally_histogram_open: NULL argument");
  if (nbounds > TALLY_HISTOGRAM_MAX_BOUNDS)
    return tally__fail(TALLY_EINVAL, "a histogram has at most %d bounds, got %zu",
                       TALLY_HISTOGRAM_MAX_BOUNDS, nbounds);
  if (!(unit > 0) || isinf(unit))
    return tally__fail(TALLY_EINVAL, "a histogram's unit is a finite number > 0");
  for (size_t i = 0; i < nbounds; i++)
    if (!isfinite(bounds[i]) || (i && !(bounds[i - 1] < bounds[i])))
      return tally__fail(TALLY_EINVAL,
                         "a histogram's bounds are finite and strictly increasing "
                         "(bound %zu)",
                         i + 1);
  size_t room = nbounds < LINEAR_SEARCH ? LINEAR_SEARCH : nbounds;
  tally_histogram *h = calloc(1, sizeof *h + room * sizeof(double));
  if (!h || !(h->member = calloc(nbounds + 2, sizeof *h->member))) {
    free(h);
    return tally__fail(TALLY_ENOMEM, "out of memory");
  }
  h->s = s;
  h->unit = unit;
  h->nbounds = nbounds;
  if (nbounds) memcpy(h->bounds, bounds, nbounds * sizeof(double));
  for (size_t i = nbounds; i < room; i++) h->bounds[i] = INFINITY;
  int rc = 0;
  for (size_t i = 0; rc == 0 && i < nbounds + 2; i++)
    rc = open_member(s, names[i], &h->member[i]);
  if (rc == 0) rc = check_distinct(h);
  if (rc) {
    tally_histogram_close(h);
    return rc;
  }
  mark_shape(h, shape_of(names, nbounds + 2));
  *out = h;
  return 0;
}

int tally_histogram_stored(tally_store *s, const char *const *names, size_t nbounds) {
  if (!s || !names)
    return tally__fail(TALLY_EINVAL, "tally_histogram_stored: NULL argument");
  if (nbounds > TALLY_HISTOGRAM_MAX_BOUNDS)
    return tally__fail(TALLY_EINVAL, "a histogram has at most %d bounds, got %zu",
                       TALLY_HISTOGRAM_MAX_BOUNDS, nbounds);
  for (size_t i = 0; i < nbounds + 2; i++)
    if (!names[i])
      return tally__fail(TALLY_EINVAL, "tally_histogram_stored: a member name is NULL");
  const char *inf = names[nbounds];
  size_t len = strlen(inf);
  int rc = tally__check_name(inf, len);
  if (rc) return rc;
  uint64_t shape = shape_of(names, nbounds + 2), rec_off;
  tally__hold_begin(s); /* the record found is not reused meanwhile */
  rc = tally__index_find(s, inf, len, tally__hash(inf, len, 0), &rec_off);
  if (rc == 0) {
    const struct tally__rec *r = tally__at(s, rec_off);
    rc = r->policy == TALLY_POLICY_SLOT && atomic_load(&r->contention) == shape
             ? TALLY_HISTOGRAM_SAME
             : TALLY_HISTOGRAM_OTHER;
  } else if (rc == TALLY_ENOENT) {
    rc = TALLY_HISTOGRAM_NEW;
  }
  tally__hold_end(s);
  return rc;
}

/* The bucket of v: the index of the first bound >= v, nbounds for +Inf.
 * Up to LINEAR_SEARCH bounds (padded with +Inf, which no finite v
 * exceeds) are counted in a fixed number of steps without a branch, so a
 * latency costs the same whichever bucket it falls in, where a search
 * mispredicts as the values move between buckets. They are compared two
 * at a time (vector lanes: SSE2 on x86-64) and the counts summed as a
 * tree: one by one, in a chain of adds, the count was a third of an
 * observation. */
static size_t bucket_of(const double *b, size_t n, double v) {
  _Static_assert(LINEAR_SEARCH == 16, "the count below reads 8 pairs");
  if (n <= LINEAR_SEARCH) {
    typedef double v2d __attribute__((vector_size(16), may_alias, aligned(8)));
    typedef int64_t v2i __attribute__((vector_size(16)));
    v2d x = {v, v};
    const v2d *p = (const v2d *)b;
    v2i c0 = (p[0] < x) + (p[1] < x), c1 = (p[2] < x) + (p[3] < x);
    v2i c2 = (p[4] < x) + (p[5] < x), c3 = (p[6] < x) + (p[7] < x);
    v2i t = (c0 + c1) + (c2 + c3);
    return (size_t)(-(t[0] + t[1]));
  }
  size_t lo = 0, len = n;
  while (len > 0) {
    size_t half = len / 2;
    if (b[lo + half] < v) {
      lo += half + 1;
      len -= half + 1;
    } else {
      len = half;
    }
  }
  return lo;
}

/* Bucket i and y units into the buffer, which is flushed first if it is
 * full, if i would be a 64th bucket with a count, or if the sum would
 * leave a cell's range (a flush of it could never be stored); a flush
 * that fails fails the observation (nothing added).
 * Apart from the batch's path, which saves registers this one needs not. */
__attribute__((noinline)) static int observe_buffered(tally_histogram *h, size_t i,
                                                      int64_t y) {
  struct buffer *b = h->buf;
  int64_t sum;
  if (__builtin_expect(
          b->n >= b->limit || (b->count[i] == 0 && b->distinct >= TALLY_BATCH_MAX - 1) ||
              __builtin_add_overflow(b->sum, y, &sum) || !tally__cell_live(sum),
          0)) {
    int rc = tally_histogram_flush(h);
    if (rc) return rc;
    sum = y;
  }
  if (__builtin_expect(b->count[i]++ == 0, 0)) b->distinct++;
  b->sum = sum;
  b->n++;
  return 0;
}

int tally_histogram_observe(tally_histogram *h, double v) {
  if (__builtin_expect(!h, 0))
    return tally__fail(TALLY_EINVAL, "tally_histogram_observe: histogram is NULL");
  /* the nearest integer count of units, halves away from zero: y is
   * truncated, so this is floor(x + 0.5) for x >= 0 and -floor(-x + 0.5)
   * below, in the same double operations as lua/tally/histogram.lua */
  double x = v / h->unit;
  double y = x >= 0 ? x + 0.5 : x - 0.5;
  if (__builtin_expect(!(fabs(y) <= EXACT), 0)) { /* a NaN fails it too */
    if (isnan(v)) return tally__fail(TALLY_EINVAL, "tally_histogram_observe: v is NaN");
    return tally__fail(TALLY_ERANGE,
                       "tally_histogram_observe: %g is out of range (|v / unit| must be "
                       "at most 2^53, unit %g)",
                       v, h->unit);
  }
  size_t i = bucket_of(h->bounds, h->nbounds, v);
  if (__builtin_expect(h->buf != NULL, 0)) return observe_buffered(h, i, (int64_t)y);
  tally_counter *a = h->member[i];
  tally_counter *b = h->member[h->nbounds + 1];
  if (__builtin_expect(
          tally__batch_try2(h->s, a, atomic_load_explicit(&a->loc, memory_order_relaxed),
                            1, b, atomic_load_explicit(&b->loc, memory_order_relaxed),
                            (int64_t)y) == 0,
          1))
    return 0;
  return tally__batch_apply2(h->s, a, 1, b, (int64_t)y);
}
