/* test_vector.c -- counters by index (src/core/vector.c).
 *
 *  - dense slots (counters created in order, in a fresh store and after
 *    others, and in a vector grown midway): how many are dense, and every
 *    slot, past the first group, adds to its own counter;
 *  - the API: put, open, get, take, grow, size, errors (out of range,
 *    empty slot, a handle in two vectors, another store's handle, key
 *    policy, range, large deltas), free, a store closed first;
 *  - tally_vector_incr_many: a loop of tally_vector_incr's adds, stopping
 *    at the first failure with the count before it; exact over a thousand
 *    dense slots, and under load while a mover reshards;
 *  - a slot never adds to space its counter left: the counter is dropped,
 *    or resharded away by another handle, its old cells are reused by new
 *    counters, and increments through the vector go where they belong;
 *  - a vector grows while another thread moves its counters and runs
 *    grace steps: exact;
 *  - exact under load: two threads increment slots of 1-shard, 16-shard
 *    and automatic counters while a third reshards them back and forth
 *    and runs grace steps; an automatic counter hammered through a vector
 *    grows;
 *  - rows: thread-policy counters of one more shard count take the fast
 *    path (the first count the vector meets, not another); each writer's
 *    adds land in its ticket's shard; exact while a mover reshards them to
 *    other counts, 1, and back;
 *  - an expired counter comes back through its slot; two threads add to
 *    counters that expire over and over and come back under other
 *    options (their handle's policy and path change under the adds);
 *  - stamps: they add to their counter's cell; none for rows; a stamp held
 *    past a move, its slot's emptying, a drop or the reuse of its old cell
 *    adds nothing anywhere; a region that ran out of generations makes
 *    no stamps and takes none; automatic counters ask for samples; exact
 *    while two threads add through stamps and a third reshards;
 *  - two processes on a file store, one SIGKILLed mid-run, while the parent
 *    reshards: every acknowledged increment is there (at most one more per
 *    killed process).
 */
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdbool.h>
#include <sys/mman.h>
#include <sys/wait.h>

#include "testutil.h"

static char g_dir[1024];

static tally_store *open_file(const char *name, const char *grace_ms) {
  char spec[1200];
  tally_store *s = NULL;
  tu_spec(spec, sizeof spec, NULL, 0, g_dir, name);
  setenv("TALLY_GRACE_MS", grace_ms, 1);
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  return s;
}

static int vopen(tally_vector *v, size_t i, const char *name, uint32_t shards,
                 int policy) {
  tally_counter_options o = {shards, policy};
  return tally_vector_open(v, i, name, strlen(name), &o, TALLY_COUNTER_CREATE);
}

static int64_t value_of(tally_store *s, const char *name) {
  tally_counter *c = NULL;
  int64_t v = INT64_MIN;
  if (tu_counter(s, name, 0, -1, 0, &c) == 0) (void)tally_counter_value(c, &v);
  tally_counter_close(c);
  return v;
}

static uint64_t reused(tally_store *s) {
  tally_store_stats st;
  memset(&st, 0, sizeof st);
  EXPECT_OK(tally_store_stats_get(s, &st));
  return st.reused_bytes;
}

/* ---- the API --------------------------------------------------------------- */

static void test_api(void) {
  tally_store *s, *other;
  tally_vector *v, *w;
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  REQUIRE_OK(tally_store_open("memory", NULL, &other));
  EXPECT_RC(TALLY_EINVAL, tally_vector_new(s, 0, &v));
  EXPECT_RC(TALLY_EINVAL, tally_vector_new(NULL, 4, &v));
  REQUIRE_OK(tally_vector_new(s, 4, &v));
  REQUIRE_OK(tally_vector_new(s, 2, &w));
  EXPECT_I64(4, tally_vector_size(v));
  EXPECT_I64(0, tally_vector_size(NULL));

  EXPECT_OK(vopen(v, 0, "one", 1, TALLY_POLICY_THREAD));
  EXPECT_OK(vopen(v, 1, "sixteen", 16, TALLY_POLICY_THREAD));
  EXPECT_OK(vopen(v, 2, "keyed", 4, TALLY_POLICY_KEY));
  EXPECT_RC(TALLY_EINVAL, vopen(v, 4, "past", 1, TALLY_POLICY_THREAD));
  EXPECT_RC(TALLY_ENOENT, tally_vector_incr(v, 3, 1)); /* empty */
  EXPECT_RC(TALLY_EINVAL, tally_vector_incr(v, 4, 1));
  EXPECT_RC(TALLY_EINVAL, tally_vector_incr(v, (size_t)-1, 1));
  EXPECT_RC(TALLY_EINVAL, tally_vector_incr(NULL, 0, 1));
  EXPECT_RC(TALLY_EPOLICY, tally_vector_incr(v, 2, 1));
  EXPECT(tally_vector_get(v, 3) == NULL);
  EXPECT(tally_vector_get(v, 9) == NULL);

  for (int i = 0; i < 1000; i++) {
    EXPECT_OK(tally_vector_incr(v, 0, 1));
    EXPECT_OK(tally_vector_incr(v, 1, 2));
  }
  EXPECT_OK(tally_vector_incr(v, 0, -500));
  EXPECT_OK(tally_vector_incr(v, 0, INT64_C(1) << 40)); /* past the fast add's range */
  EXPECT_I64(500 + (INT64_C(1) << 40), tu_value(tally_vector_get(v, 0)));
  EXPECT_I64(2000, tu_value(tally_vector_get(v, 1)));
  EXPECT_I64(500 + (INT64_C(1) << 40), value_of(s, "one"));

  /* a shard holds at most 2^62 - 1: nothing is added past it */
  EXPECT_OK(tally_vector_incr(v, 0, (INT64_C(1) << 62) - 1 - 500 - (INT64_C(1) << 40)));
  EXPECT_RC(TALLY_ERANGE, tally_vector_incr(v, 0, 1));
  EXPECT_RC(TALLY_ERANGE, tally_vector_incr(v, 0, INT64_C(1) << 33));
  EXPECT_I64((INT64_C(1) << 62) - 1, tu_value(tally_vector_get(v, 0)));
  int64_t removed;
  EXPECT_OK(tally_counter_reset(tally_vector_get(v, 0), &removed));
  EXPECT_OK(tally_vector_incr(v, 0, 3));
  EXPECT_I64(3, value_of(s, "one"));

  /* handles: one vector each, of its store */
  tally_counter *c, *o;
  REQUIRE_OK(tu_counter(s, "one", 0, -1, 0, &c));
  REQUIRE_OK(tu_counter(other, "elsewhere", 1, -1, TALLY_COUNTER_CREATE, &o));
  EXPECT_RC(TALLY_EINVAL, tally_vector_put(w, 0, o));
  EXPECT_OK(tally_vector_put(w, 0, c));
  EXPECT_RC(TALLY_EINVAL, tally_vector_put(v, 3, c));
  EXPECT_OK(tally_vector_incr(w, 0, 4));
  EXPECT_I64(7, value_of(s, "one"));
  EXPECT_OK(tally_vector_put(w, 0, NULL)); /* closes c */
  EXPECT_RC(TALLY_ENOENT, tally_vector_incr(w, 0, 1));
  tally_counter_close(o);

  /* replacing a slot's counter: the slot follows the new one */
  EXPECT_OK(vopen(v, 0, "another", 1, TALLY_POLICY_RANDOM));
  EXPECT_OK(tally_vector_incr(v, 0, 5));
  EXPECT_I64(5, value_of(s, "another"));
  EXPECT_I64(7, value_of(s, "one"));

  /* take gives a handle back, open; grow keeps every slot where it was */
  EXPECT(tally_vector_take(v, 3) == NULL); /* empty */
  EXPECT(tally_vector_take(v, 4) == NULL); /* out of range */
  EXPECT(tally_vector_take(NULL, 0) == NULL);
  EXPECT_OK(vopen(v, 3, "taken", 1, TALLY_POLICY_THREAD));
  EXPECT_OK(tally_vector_incr(v, 3, 2));
  c = tally_vector_take(v, 3);
  if (!c) abort();
  EXPECT(tally_vector_get(v, 3) == NULL);
  EXPECT_RC(TALLY_ENOENT, tally_vector_incr(v, 3, 1));
  EXPECT_OK(tally_counter_incr(c, 3));  /* still the caller's, open */
  EXPECT_OK(tally_vector_put(w, 1, c)); /* in no vector now */
  EXPECT_OK(tally_vector_incr(w, 1, 4));
  EXPECT_I64(9, value_of(s, "taken"));
  EXPECT_RC(TALLY_EINVAL, tally_vector_grow(v, 3));
  EXPECT_RC(TALLY_EINVAL, tally_vector_grow(NULL, 8));
  EXPECT_OK(tally_vector_grow(v, 4)); /* its size: nothing to do */
  EXPECT_OK(tally_vector_grow(v, 2000));
  EXPECT_I64(2000, tally_vector_size(v));
  EXPECT_OK(tally_vector_incr(v, 0, 1));
  EXPECT_OK(tally_vector_incr(v, 1, 1));
  EXPECT_I64(6, value_of(s, "another"));
  EXPECT_I64(2001, tu_value(tally_vector_get(v, 1)));
  EXPECT_OK(vopen(v, 1999, "last", 1, TALLY_POLICY_THREAD));
  EXPECT_OK(tally_vector_incr(v, 1999, 8));
  EXPECT_I64(8, value_of(s, "last"));
  EXPECT(tally_vector_get(v, 1000) == NULL);
  EXPECT_RC(TALLY_ENOENT, tally_vector_incr(v, 1000, 1));

  tally_vector_free(w);
  tally_vector_free(NULL);
  /* the store closed first: the vector only errs (and frees) */
  tally_store_close(s);
  EXPECT_RC(TALLY_EINVAL, tally_vector_incr(v, 0, 1));
  tally_vector_free(v);
  tally_store_close(other);
}

/* tally_vector_incr_many: the adds of a loop of tally_vector_incr, in
 * order, stopping at the first that fails, whose result it returns with
 * the count of those before it; deltas NULL adds 1 each. Over a thousand
 * dense slots of one and of 16 shards (the adds ahead are asked for), in
 * batches longer than the distance it looks ahead and shorter. */
static void test_many_api(void) {
  tally_store *s;
  tally_vector *v;
  size_t done = 99;
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  REQUIRE_OK(tally_vector_new(s, 8, &v));
  EXPECT_OK(vopen(v, 0, "one", 1, TALLY_POLICY_THREAD));
  EXPECT_OK(vopen(v, 1, "sixteen", 16, TALLY_POLICY_THREAD));
  EXPECT_OK(vopen(v, 2, "keyed", 4, TALLY_POLICY_KEY));
  EXPECT_OK(vopen(v, 4, "random", 16, TALLY_POLICY_RANDOM)); /* the handle's path */

  EXPECT_OK(tally_vector_incr_many(v, (size_t[]){0, 1, 0, 1, 1, 4}, NULL, 6, &done));
  EXPECT_I64(6, done);
  EXPECT_I64(2, value_of(s, "one"));
  EXPECT_I64(3, value_of(s, "sixteen"));
  EXPECT_I64(1, value_of(s, "random"));
  int64_t big = INT64_C(1) << 40; /* past the fast add's range: the handle's */
  EXPECT_OK(
      tally_vector_incr_many(v, (size_t[]){0, 1, 4}, (int64_t[]){-7, big, 5}, 3, &done));
  EXPECT_I64(3, done);
  EXPECT_I64(-5, value_of(s, "one"));
  EXPECT_I64(3 + big, value_of(s, "sixteen"));
  EXPECT_I64(6, value_of(s, "random"));

  /* the first that fails ends it: those before it added, it and those
   * after it not */
  EXPECT_RC(TALLY_ENOENT, tally_vector_incr_many(v, (size_t[]){0, 1, 3, 0}, NULL, 4,
                                                 &done)); /* empty */
  EXPECT_I64(2, done);
  EXPECT_I64(-4, value_of(s, "one"));
  EXPECT_I64(4 + big, value_of(s, "sixteen"));
  EXPECT_RC(TALLY_EINVAL, tally_vector_incr_many(v, (size_t[]){0, 8, 0}, NULL, 3, &done));
  EXPECT_I64(1, done);
  EXPECT_RC(TALLY_EPOLICY, tally_vector_incr_many(v, (size_t[]){2, 0}, NULL, 2, &done));
  EXPECT_I64(0, done);
  EXPECT_I64(-3, value_of(s, "one"));
  int64_t top = (INT64_C(1) << 62) - 1; /* a shard's largest value */
  EXPECT_OK(tally_vector_incr(v, 0, top + 3));
  EXPECT_RC(TALLY_ERANGE, tally_vector_incr_many(v, (size_t[]){1, 0, 1},
                                                 (int64_t[]){1, 1, 1}, 3, &done));
  EXPECT_I64(1, done);
  EXPECT_I64(top, value_of(s, "one")); /* nothing added past the range */
  EXPECT_I64(5 + big, value_of(s, "sixteen"));
  int64_t removed;
  EXPECT_OK(tally_counter_reset(tally_vector_get(v, 0), &removed));

  /* a slot out of range or empty where the call looks ahead: refused
   * there, the adds before it made */
  size_t far[12] = {0, 1, 0, 1, 0, 1, 0, 1, 0, (size_t)-1, 0, 0};
  EXPECT_RC(TALLY_EINVAL, tally_vector_incr_many(v, far, NULL, 12, &done));
  EXPECT_I64(9, done);
  far[9] = 3; /* empty */
  EXPECT_RC(TALLY_ENOENT, tally_vector_incr_many(v, far, NULL, 12, &done));
  EXPECT_I64(9, done);
  EXPECT_I64(10, value_of(s, "one"));
  EXPECT_I64(13 + big, value_of(s, "sixteen"));
  EXPECT_OK(tally_counter_reset(tally_vector_get(v, 0), &removed));

  EXPECT_RC(TALLY_EINVAL, tally_vector_incr_many(NULL, (size_t[]){0}, NULL, 1, &done));
  EXPECT_I64(0, done);
  EXPECT_RC(TALLY_EINVAL, tally_vector_incr_many(v, NULL, NULL, 1, &done));
  EXPECT_OK(tally_vector_incr_many(v, NULL, NULL, 0, &done));
  EXPECT_I64(0, done);
  EXPECT_OK(tally_vector_incr_many(v, (size_t[]){0}, NULL, 1, NULL)); /* done NULL */
  EXPECT_I64(1, value_of(s, "one"));
  tally_vector_free(v);

  /* a thousand dense slots each of one and 16 shards, at random */
  enum { N = 1000, ROUNDS = 200, MAX = 100 };
  static int64_t want[2 * N];
  REQUIRE_OK(tally_vector_new(s, 2 * N, &v));
  for (size_t i = 0; i < 2 * N; i++) {
    char nm[32];
    snprintf(nm, sizeof nm, "many:%zu", i);
    REQUIRE_OK(vopen(v, i, nm, i < N ? 1 : 16, TALLY_POLICY_THREAD));
    want[i] = 0;
  }
  EXPECT_I64(2, tally_vector_fast(v, 10));   /* the first group lines up with 1 shard's */
  EXPECT(tally_vector_fast(v, N + 10) >= 1); /* rows: the one-miss path, by slot word */
  uint64_t seed = 5;
  size_t slots[MAX];
  int64_t deltas[MAX];
  for (int r = 0; r < ROUNDS; r++) {
    size_t n =
        (size_t)(tu_rng(&seed) % MAX) + 1; /* 1..100: shorter and longer than AHEAD */
    for (size_t k = 0; k < n; k++) {
      slots[k] = (size_t)(tu_rng(&seed) % (2 * N));
      deltas[k] = (int64_t)(tu_rng(&seed) % 11) - 3;
      want[slots[k]] += deltas[k];
    }
    EXPECT_OK(tally_vector_incr_many(v, slots, deltas, n, &done));
    EXPECT_I64(n, done);
  }
  for (size_t i = 0; i < 2 * N; i += 37) {
    char nm[32];
    snprintf(nm, sizeof nm, "many:%zu", i);
    EXPECT_I64(want[i], value_of(s, nm));
  }
  int64_t sum = 0, total = 0;
  for (size_t i = 0; i < 2 * N; i++) sum += want[i];
  EXPECT_OK(tally_store_sum(s, "many:*", 6, &total, NULL));
  EXPECT_I64(sum, total);
  tally_vector_free(v);
  tally_store_close(s);
}

/* ---- dense slots ----------------------------------------------------------- */

/* n counters prefix:0.. of `shards` shards (thread policy), created. */
static void create_n(tally_store *s, const char *prefix, int n, uint32_t shards) {
  tally_counter_options o = {shards, TALLY_POLICY_THREAD};
  for (int i = 0; i < n; i++) {
    char nm[32];
    tally_counter *c;
    snprintf(nm, sizeof nm, "%s%d", prefix, i);
    REQUIRE_OK(tally_counter_open(s, nm, strlen(nm), &o, TALLY_COUNTER_CREATE, &c));
    tally_counter_close(c);
  }
}

/* Counters created in slot order are dense, across several groups, for
 * one shard and for rows, and each add lands in its own counter: in a
 * fresh store, and after 100 others of the same shape shifted the chunks'
 * columns (the vector lines its groups up with the chunk it sees being
 * filled). A vector over counters created long before cannot see where
 * their chunks start: each group of 520 then straddles two, and only the
 * slots before the first one's end are dense. */
static void test_dense(void) {
  enum { N = 3 * 520 + 7 };
  for (int k = 0; k < 5; k++) {
    uint32_t shards = k % 2 ? 2 : 1;
    int before = k < 2 ? 0 : 100;
    tally_store *s;
    tally_vector *v;
    REQUIRE_OK(tally_store_open("memory", NULL, &s));
    create_n(s, "first:", before, shards);
    if (k == 4) { /* the vector's counters, then others: its chunks are past */
      create_n(s, "d:", N, shards);
      create_n(s, "later:", 600, shards);
    }
    /* k == 1: the vector grows after its first group, which stays dense */
    REQUIRE_OK(tally_vector_new(s, k == 1 ? 600 : N, &v));
    int dense = 0;
    for (int i = 0; i < N; i++) {
      char nm[32];
      snprintf(nm, sizeof nm, "d:%d", i);
      if (k == 1 && i == 600) REQUIRE_OK(tally_vector_grow(v, N));
      REQUIRE_OK(vopen(v, (size_t)i, nm, shards, TALLY_POLICY_THREAD));
      dense += tally_vector_fast(v, (size_t)i) == 2;
    }
    /* k == 4: 420 of each group's 520 slots, and the last 7 */
    EXPECT_I64(k == 4 ? 3 * 420 + 7 : N, dense);
    for (int r = 0; r < 3; r++)
      for (int i = 0; i < N; i++) EXPECT_OK(tally_vector_incr(v, (size_t)i, i + 1));
    for (int i = 0; i < N; i++) {
      char nm[32];
      snprintf(nm, sizeof nm, "d:%d", i);
      EXPECT_I64(3 * (i + 1), value_of(s, nm));
    }
    tally_vector_free(v);
    tally_store_close(s);
  }
}

/* ---- slots never reach reused space ---------------------------------------- */

/* n one-shard counters prefix:i, value base + i; then check them. */
static void fill(tally_store *s, const char *prefix, int n, int64_t base) {
  for (int i = 0; i < n; i++) {
    char nm[64];
    tally_counter *c;
    snprintf(nm, sizeof nm, "%s:%d", prefix, i);
    REQUIRE_OK(tu_counter(s, nm, 1, TALLY_POLICY_THREAD, TALLY_COUNTER_CREATE, &c));
    EXPECT_OK(tally_counter_incr(c, base + i));
    tally_counter_close(c);
  }
}

static void check_fill(tally_store *s, const char *prefix, int n, int64_t base) {
  for (int i = 0; i < n; i++) {
    char nm[64];
    snprintf(nm, sizeof nm, "%s:%d", prefix, i);
    int64_t got = value_of(s, nm);
    atomic_fetch_add(&tu_checks, 1);
    if (got != base + i)
      TU_FAIL("%s = %lld, want %lld: a vector slot wrote into reused space", nm,
              (long long)got, (long long)(base + i));
  }
}

static void test_reuse(void) {
  tally_store *s = open_file("reuse.tly", "0");
  tally_vector *v;
  REQUIRE_OK(tally_vector_new(s, 2, &v));
  EXPECT_OK(vopen(v, 0, "gone", 1, TALLY_POLICY_THREAD));
  EXPECT_OK(vopen(v, 1, "moved", 1, TALLY_POLICY_THREAD));
  /* created in order: consecutive cells, so both slots are dense */
  EXPECT_I64(2, tally_vector_fast(v, 0));
  EXPECT_I64(2, tally_vector_fast(v, 1));
  EXPECT_OK(tally_vector_incr(v, 0, 10));
  EXPECT_OK(tally_vector_incr(v, 1, 20));

  /* dropped, and moved by another handle: the old cells are retired, then
   * reused once this process has passed a grace step */
  tally_counter *m;
  REQUIRE_OK(tu_counter(s, "moved", 0, -1, 0, &m));
  EXPECT_OK(tally_store_drop(s, "gone", 4));
  EXPECT_OK(tally_counter_reshard(m, 4));
  EXPECT_OK(tally_counter_reshard(m, 1));
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  uint64_t r0 = reused(s);
  fill(s, "y", 200, 1000);
  EXPECT(reused(s) > r0);

  EXPECT_RC(TALLY_EDROPPED, tally_vector_incr(v, 0, 1));
  for (int i = 0; i < 100; i++) EXPECT_OK(tally_vector_incr(v, 1, 1));
  EXPECT_I64(120, tu_value(m));
  check_fill(s, "y", 200, 1000);

  /* once more, the slot freshly cached from the moved handle */
  EXPECT_OK(tally_counter_reshard(m, 2));
  EXPECT_OK(tally_counter_reshard(m, 1));
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  r0 = reused(s);
  fill(s, "z", 200, 5000);
  EXPECT(reused(s) > r0);
  for (int i = 0; i < 100; i++) EXPECT_OK(tally_vector_incr(v, 1, 1));
  EXPECT_I64(220, tu_value(m));
  check_fill(s, "y", 200, 1000);
  check_fill(s, "z", 200, 5000);
  EXPECT_I64(0, tally_store_check(s));
  tally_counter_close(m);
  tally_vector_free(v);
  tally_store_close(s);
}

/* ---- stamps ---------------------------------------------------------------- */

#define STAMP_MIN (INT64_C(1) << 31)
#define STAMP_END (INT64_C(1) << 53)

static bool is_stamp(int64_t st) {
  return st >= STAMP_MIN && st < STAMP_END;
}

/* A stamp adds to its counter's cell; it is 0 where the add is not a plain
 * one; a stamp held past a move, past its slot's emptying, or past the
 * reuse of its old cell adds nothing anywhere (-1), and a fresh one adds. */
static void test_stamps(void) {
  tally_store *s = open_file("stamps.tly", "0");
  tally_vector *v;
  REQUIRE_OK(tally_vector_new(s, 4, &v));
  EXPECT_OK(vopen(v, 0, "a", 1, TALLY_POLICY_THREAD));
  EXPECT_OK(vopen(v, 1, "b", 1, TALLY_POLICY_RANDOM));
  EXPECT_OK(vopen(v, 2, "rows", 16, TALLY_POLICY_THREAD));
  EXPECT_OK(vopen(v, 3, "auto", TALLY_SHARDS_AUTO, TALLY_POLICY_THREAD));
  tally_counter *a = tally_vector_get(v, 0), *b = tally_vector_get(v, 1);
  int64_t sa = tally_vector_stamp(v, a), sb = tally_vector_stamp(v, b);
  EXPECT(is_stamp(sa));
  EXPECT(is_stamp(sb));
  EXPECT(sa != sb);
  EXPECT_I64(0,
             tally_vector_stamp(v, tally_vector_get(v, 2))); /* the row is the caller's */
  EXPECT_I64(0, tally_vector_stamp(NULL, a));
  EXPECT_I64(0, tally_vector_stamp(v, NULL));
  tally_counter *outside;
  REQUIRE_OK(tu_counter(s, "a", 0, -1, 0, &outside));
  EXPECT_I64(0, tally_vector_stamp(v, outside)); /* not in v */
  EXPECT_I64(0, tally_vector_stamp_incr(v, sa, 10));
  EXPECT_I64(0, tally_vector_stamp_incr(v, sb, -3));
  EXPECT_I64(10, tu_value(a));
  EXPECT_I64(-3, tu_value(b));
  /* not stamps, or deltas the fast path does not take: nothing added (no
   * generation starts at 0: values below 2^32 name none; past 2^53, no
   * generation can match) */
  int64_t bogus[] = {0,
                     -1,
                     1,
                     STAMP_MIN - 1,
                     STAMP_MIN,
                     STAMP_MIN | INT64_C(1) << 29,
                     (INT64_C(1) << 32) - 1,
                     STAMP_END,
                     sa + STAMP_END,
                     INT64_MIN};
  for (size_t k = 0; k < sizeof bogus / sizeof *bogus; k++)
    EXPECT_I64(-1, tally_vector_stamp_incr(v, bogus[k], 1));
  EXPECT_I64(-1, tally_vector_stamp_incr(NULL, sa, 1));
  tally_vector *w; /* another vector of the store: its generations are its own */
  REQUIRE_OK(tally_vector_new(s, 1, &w));
  EXPECT_I64(-1, tally_vector_stamp_incr(w, sa, 1));
  EXPECT_I64(-1, tally_vector_stamp_incr(w, sb, 1));
  tally_vector_free(w);
  EXPECT_I64(-1, tally_vector_stamp_incr(v, sa, INT64_C(1) << 40));
  EXPECT_I64(10, tu_value(a));
  EXPECT_I64(-3, tu_value(b));

  /* moved by another handle: its old cell is retired, and the stamp adds
   * nothing there; then past the grace step the old cell is reused by new
   * counters, and the stamp still adds nothing, anywhere */
  EXPECT_OK(tally_counter_reshard(outside, 4));
  EXPECT_I64(-1, tally_vector_stamp_incr(v, sa, 1));
  EXPECT_OK(tally_counter_reshard(outside, 1));
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  uint64_t r0 = reused(s);
  fill(s, "y", 200, 1000);
  EXPECT(reused(s) > r0);
  for (int k = 0; k < 50; k++) EXPECT_I64(-1, tally_vector_stamp_incr(v, sa, 1));
  check_fill(s, "y", 200, 1000);
  EXPECT_I64(10, tu_value(outside));
  int64_t sa2 = tally_vector_stamp(v, a); /* caches the slot afresh */
  EXPECT(is_stamp(sa2) && sa2 != sa);
  EXPECT_I64(0, tally_vector_stamp_incr(v, sa2, 5));
  EXPECT_I64(15, tu_value(outside));

  /* its slot emptied: the stamp adds nothing from then on, though the
   * counter has not moved */
  tally_counter *took = tally_vector_take(v, 1);
  EXPECT(took == b);
  EXPECT_I64(-1, tally_vector_stamp_incr(v, sb, 1));
  EXPECT_I64(0, tally_vector_stamp(v, took));
  EXPECT_OK(tally_vector_put(v, 1, took));
  EXPECT_I64(-1, tally_vector_stamp_incr(v, sb, 1)); /* back: still stale */
  int64_t sb2 = tally_vector_stamp(v, took);
  EXPECT(is_stamp(sb2));
  EXPECT_I64(0, tally_vector_stamp_incr(v, sb2, 1));
  EXPECT_I64(-2, tu_value(took));

  /* dropped: nothing added; the slot's path says why */
  EXPECT_OK(tally_store_drop(s, "b", 1));
  EXPECT_I64(-1, tally_vector_stamp_incr(v, sb2, 1));
  EXPECT_RC(TALLY_EDROPPED, tally_vector_incr(v, 1, 1));
  EXPECT_I64(0, tally_vector_stamp(v, took));

  /* automatic shards: about one add in 256 asks for a sample */
  tally_counter *au = tally_vector_get(v, 3);
  int64_t sau = tally_vector_stamp(v, au);
  EXPECT(is_stamp(sau));
  int due = 0;
  for (int k = 0; k < 25600; k++) {
    int rc = tally_vector_stamp_incr(v, sau, 1);
    EXPECT(rc == 0 || rc == 1);
    due += rc == 1;
  }
  EXPECT(due > 50 && due < 200);
  EXPECT_OK(tally_counter_sample(au));
  EXPECT_OK(tally_counter_sample(a)); /* not automatic: nothing */
  EXPECT_RC(TALLY_EINVAL, tally_counter_sample(NULL));
  EXPECT_I64(25600, tu_value(au));
  printf("stamps: %d of 25600 adds due to sample\n", due);
  EXPECT_I64(0, tally_store_check(s));
  tally_counter_close(outside);
  tally_vector_free(v);
  tally_store_close(s);
}

/* An expired counter comes back through its slot, from zero. */
static void test_expired(void) {
  tally_store *s = open_file("expire.tly", "0");
  tally_family_options fo = {1, TALLY_POLICY_THREAD, 1, 0}; /* idle 1 s */
  tally_vector *v;
  EXPECT_OK(tally_family_define(s, "ex:*", 4, &fo));
  REQUIRE_OK(tally_vector_new(s, 1, &v));
  EXPECT_OK(tally_vector_open(v, 0, "ex:a", 4, NULL, TALLY_COUNTER_CREATE));
  EXPECT_OK(tally_vector_incr(v, 0, 6));
  tally_maintain_result mr;
  EXPECT_OK(tally_store_maintain(s, 10000, 1000, &mr));
  EXPECT_OK(tally_store_maintain(s, 11000, 1000, &mr));
  EXPECT_I64(1, mr.expired);
  EXPECT_OK(tally_store_maintain(s, 11000, 0, NULL));
  fill(s, "e", 100, 100);
  EXPECT_OK(tally_vector_incr(v, 0, 9));
  EXPECT_I64(9, value_of(s, "ex:a"));
  EXPECT_OK(tally_vector_incr(v, 0, 1));
  EXPECT_I64(10, tu_value(tally_vector_get(v, 0)));
  check_fill(s, "e", 100, 100);
  tally_vector_free(v);
  tally_store_close(s);
}

struct reviver {
  tally_vector *v;
  atomic_bool *stop;
  atomic_int *half; /* the slots added to: i % 2 == half */
  uint64_t seed;
  int64_t stamp[8];
};

/* Adds through stamps and slots until stopped; expired counters come back
 * through the slot's handle (revive, counter.c). */
static void *reviver_main(void *ud) {
  struct reviver *r = ud;
  while (!atomic_load(r->stop)) {
    size_t i = (size_t)(tu_rng(&r->seed) % 4 * 2) + (size_t)atomic_load(r->half);
    int rc = r->stamp[i] ? tally_vector_stamp_incr(r->v, r->stamp[i], 1) : -1;
    if (rc == 1) rc = tally_counter_sample(tally_vector_get(r->v, i));
    if (rc < 0) {
      if (tally_vector_incr(r->v, i, 1) != 0) {
        TU_FAIL("vector incr %zu: %s", i, tally_errmsg());
        return NULL;
      }
      r->stamp[i] = tally_vector_stamp(r->v, tally_vector_get(r->v, i));
    }
  }
  return NULL;
}

/* Two threads add to counters opened with options of their own (auto,
 * random) that expire over and over and come back under their family's
 * (one shard, thread): the handle's policy and path change while the
 * other thread reads them (TSan: a data race before they were atomic). */
static void test_revive_threads(void) {
  tally_store *s = open_file("revive.tly", "100");
  tally_family_options fo = {1, TALLY_POLICY_THREAD, 1, 0}; /* idle 1 s */
  tally_vector *v;
  EXPECT_OK(tally_family_define(s, "rv:*", 4, &fo));
  REQUIRE_OK(tally_vector_new(s, 8, &v));
  for (int i = 0; i < 8; i++) {
    char nm[32];
    snprintf(nm, sizeof nm, "rv:%d", i);
    REQUIRE_OK(vopen(v, (size_t)i, nm, i % 2 ? TALLY_SHARDS_AUTO : 1,
                     i % 4 < 2 ? TALLY_POLICY_RANDOM : TALLY_POLICY_THREAD));
  }
  atomic_bool stop = false;
  atomic_int half = 0;
  struct reviver r[2] = {{.v = v, .stop = &stop, .half = &half, .seed = 11},
                         {.v = v, .stop = &stop, .half = &half, .seed = 12}};
  pthread_t th[2];
  for (int t = 0; t < 2; t++) pthread_create(&th[t], NULL, reviver_main, &r[t]);
  uint64_t expired = 0;
  int64_t now = 10000;
  for (int k = 0; k < 400 && !tu_failures; k++) {
    tally_maintain_result mr;
    now += 2000; /* the half not added to expires */
    EXPECT_OK(tally_store_maintain(s, now, 1000, &mr));
    expired += mr.expired;
    if (k % 4 == 3) atomic_store(&half, 1 - atomic_load(&half));
    usleep(500);
  }
  atomic_store(&stop, true);
  for (int t = 0; t < 2; t++) pthread_join(th[t], NULL);
  printf("revive threads: %llu expiries\n", (unsigned long long)expired);
  EXPECT(expired > 0);
  EXPECT_I64(0, tally_store_check(s));
  tally_vector_free(v);
  tally_store_close(s);
}

/* ---- exact under load ------------------------------------------------------ */

enum { SLOTS = 64, PER_THREAD = 400000 };

struct writer {
  tally_vector *v;
  uint64_t seed;
  struct tu_mover *m;
  int64_t added[SLOTS];
};

/* n adds of 1 to random slots first..first+count-1, tallied in added[];
 * then on until mover m has done 3 rounds (at most 10 s more), so the adds
 * overlap its moves on a loaded machine too. */
static void random_adds(tally_vector *v, uint64_t *seed, size_t first, size_t count,
                        int n, struct tu_mover *m, int64_t *added) {
  double end = tu_now() + 10;
  for (int k = 0; k < n || (atomic_load(&m->rounds) < 3 && tu_now() < end); k++) {
    size_t i = first + (size_t)(tu_rng(seed) % count);
    if (tally_vector_incr(v, i, 1) != 0) {
      TU_FAIL("vector incr %zu: %s", i, tally_errmsg());
      return;
    }
    added[i]++;
  }
}

static void *writer_main(void *ud) {
  struct writer *w = ud;
  random_adds(w->v, &w->seed, 0, SLOTS, PER_THREAD, w->m, w->added);
  return NULL;
}

/* Two writers (fn, seeds a and b) add to the SLOTS slots of v, counters
 * prefix0.. prefix63, while a mover reshards them and runs grace steps;
 * then every counter holds what the writers added. Returns their total;
 * *moves: the mover's reshards. */
static int64_t run_exact(tally_store *s, tally_vector *v, const char *prefix,
                         void *(*fn)(void *), uint64_t a, uint64_t b, long *moves) {
  atomic_bool stop = false;
  struct tu_mover m = {.s = s, .prefix = prefix, .n = SLOTS, .stop = &stop};
  struct writer w[2] = {{.v = v, .seed = a, .m = &m}, {.v = v, .seed = b, .m = &m}};
  tu_write_while_moving(&m, fn, &w[0], &w[1]);
  EXPECT(atomic_load(&m.rounds) >= 3);
  int64_t total = 0;
  for (int i = 0; i < SLOTS; i++) {
    char nm[32];
    snprintf(nm, sizeof nm, "%s%d", prefix, i);
    EXPECT_I64(w[0].added[i] + w[1].added[i], value_of(s, nm));
    total += w[0].added[i] + w[1].added[i];
  }
  *moves = m.moves;
  return total;
}

/* Slots of 1-shard, 16-shard (thread or random policy) and automatic
 * counters prefix0.. in a file store, two writers fn (seeds a, b) while a
 * mover reshards them: exact. */
static void run_mixed(const char *file, const char *prefix, void *(*fn)(void *),
                      uint64_t a, uint64_t b, const char *what) {
  /* not 0: a writer thread between its load of a slot and its add is seen
   * by no epoch when another thread of its process runs the grace step;
   * grace_ms bounds that window (grace.c), for slots as for handles */
  tally_store *s = open_file(file, "100");
  tally_vector *v;
  REQUIRE_OK(tally_vector_new(s, SLOTS, &v));
  for (int i = 0; i < SLOTS; i++) {
    char nm[32];
    snprintf(nm, sizeof nm, "%s%d", prefix, i);
    /* a third each: one shard, 16 shards (thread or random), automatic */
    uint32_t shards = i % 3 == 0 ? 1 : i % 3 == 1 ? 16 : TALLY_SHARDS_AUTO;
    int policy = i % 2 ? TALLY_POLICY_RANDOM : TALLY_POLICY_THREAD;
    REQUIRE_OK(vopen(v, (size_t)i, nm, shards, policy));
  }
  long moves;
  int64_t total = run_exact(s, v, prefix, fn, a, b, &moves);
  EXPECT(total >= 2 * PER_THREAD);
  printf("%s: %lld increments, %ld reshards, exact\n", what, (long long)total, moves);
  EXPECT_I64(0, tally_store_check(s));
  tally_vector_free(v);
  tally_store_close(s);
}

static void test_threads(void) {
  run_mixed("threads.tly", "v:", writer_main, 7, 11, "threads");
}

/* As writer_main, through tally_vector_incr_many: batches of 1 to 32
 * random slots, whose cells are asked for ahead while the mover moves
 * them: a cell asked for that moved meanwhile is only a wasted fetch. */
static void *writer_many_main(void *ud) {
  struct writer *w = ud;
  struct tu_mover *m = w->m;
  double end = tu_now() + 10;
  size_t slots[32];
  for (int k = 0; k < PER_THREAD || (atomic_load(&m->rounds) < 3 && tu_now() < end);) {
    size_t n = (size_t)(tu_rng(&w->seed) % 32) + 1, done = 0;
    for (size_t j = 0; j < n; j++) slots[j] = (size_t)(tu_rng(&w->seed) % SLOTS);
    if (tally_vector_incr_many(w->v, slots, NULL, n, &done) != 0 || done != n) {
      TU_FAIL("vector incr_many: %zu of %zu: %s", done, n, tally_errmsg());
      return NULL;
    }
    for (size_t j = 0; j < n; j++) w->added[slots[j]]++;
    k += (int)n;
  }
  return NULL;
}

static void test_many_threads(void) {
  run_mixed("many_threads.tly", "b:", writer_many_main, 13, 17,
            "many_threads, in batches");
}

/* A region whose generation reaches its limit (2^22 - 1; it starts at
 * random below 2^21) makes no more stamps, and no value adds through it:
 * not the last stamp made, nor one with any generation bits above 2^53. */
static void test_stamp_limit(void) {
  tally_store *s;
  tally_vector *v;
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  REQUIRE_OK(tally_vector_new(s, 1, &v));
  EXPECT_OK(vopen(v, 0, "lim", 1, TALLY_POLICY_THREAD));
  tally_counter *c = tally_vector_get(v, 0);
  int64_t st = tally_vector_stamp(v, c), last = st;
  EXPECT(is_stamp(st));
  const int64_t limit = (INT64_C(1) << 22) - 1;
  int64_t made = 1;
  while (is_stamp(st)) { /* each take and put: one generation */
    last = st;
    tally_counter *t = tally_vector_take(v, 0);
    EXPECT_OK(tally_vector_put(v, 0, t));
    st = tally_vector_stamp(v, c);
    if (++made > limit + 2) break;
  }
  EXPECT_I64(0, st);
  /* generations start at random below 2^21 */
  EXPECT(made - 1 >= (INT64_C(1) << 21) - 1 && made - 1 <= limit);
  EXPECT_I64(-1, tally_vector_stamp_incr(v, last, 1));
  uint64_t off = (uint64_t)last & ((UINT64_C(1) << 31) - 1);
  uint64_t gens[] = {1,
                     (uint64_t)limit,
                     (uint64_t)limit + 1,
                     (uint64_t)limit + 2,
                     UINT64_C(1) << 32,
                     (UINT64_C(1) << 33) - 1};
  for (size_t k = 0; k < sizeof gens / sizeof *gens; k++)
    EXPECT_I64(-1, tally_vector_stamp_incr(v, (int64_t)(gens[k] << 31 | off), 1));
  EXPECT_I64(-1, tally_vector_stamp_incr(v, 0, 0));
  EXPECT_I64(0, tu_value(c));
  EXPECT_OK(tally_vector_incr(v, 0, 2)); /* its slot still adds */
  EXPECT_I64(2, tu_value(c));
  printf("stamp limit: %lld stamps, then none\n", (long long)made - 1);
  tally_vector_free(v);
  tally_store_close(s);
}

/* As random_adds, through stamps where the slot gives one: a stale stamp
 * (-1) takes the slot's path, then a new stamp. */
static void *stamp_writer_main(void *ud) {
  struct writer *w = ud;
  int64_t st[SLOTS] = {0};
  double end = tu_now() + 10;
  for (int k = 0; k < PER_THREAD || (atomic_load(&w->m->rounds) < 3 && tu_now() < end);
       k++) {
    size_t i = (size_t)(tu_rng(&w->seed) % SLOTS);
    int rc = st[i] ? tally_vector_stamp_incr(w->v, st[i], 1) : -1;
    if (rc == 1) rc = tally_counter_sample(tally_vector_get(w->v, i));
    if (rc < 0) {
      if (tally_vector_incr(w->v, i, 1) != 0) {
        TU_FAIL("vector incr %zu: %s", i, tally_errmsg());
        return NULL;
      }
      st[i] = tally_vector_stamp(w->v, tally_vector_get(w->v, i));
    }
    w->added[i]++;
  }
  return NULL;
}

/* Two writers add through stamps (1-shard and automatic counters; the
 * others, stampless, through their slots) while a third thread reshards
 * the counters back and forth and runs grace steps: exact. */
static void test_stamp_threads(void) {
  tally_store *s = open_file("stamp_threads.tly", "100"); /* see test_threads */
  tally_vector *v;
  REQUIRE_OK(tally_vector_new(s, SLOTS, &v));
  for (int i = 0; i < SLOTS; i++) {
    char nm[32];
    snprintf(nm, sizeof nm, "st:%d", i);
    uint32_t shards = i % 3 == 0 ? 1 : i % 3 == 1 ? TALLY_SHARDS_AUTO : 16;
    REQUIRE_OK(vopen(v, (size_t)i, nm, shards,
                     i % 2 ? TALLY_POLICY_RANDOM : TALLY_POLICY_THREAD));
  }
  long moves;
  int64_t total = run_exact(s, v, "st:", stamp_writer_main, 5, 9, &moves);
  printf("stamp threads: %lld increments, %ld reshards, exact\n", (long long)total,
         moves);
  EXPECT_I64(0, tally_store_check(s));
  tally_vector_free(v);
  tally_store_close(s);
}

struct hammer {
  tally_vector *v;
  atomic_bool *stop;
  long long n;
};

/* A vector grows while another thread moves its counters and runs grace
 * steps, which clear slots (tally__vector_forget) under hlock: no clear
 * is lost in the copy or lands in freed arrays (TSan, ASan), and every
 * add counts. */
static void test_grow(void) {
  tally_store *s = open_file("grow.tly", "100");
  tally_vector *v;
  int64_t added[SLOTS] = {0};
  uint64_t seed = 7;
  REQUIRE_OK(tally_vector_new(s, SLOTS, &v));
  for (int i = 0; i < SLOTS; i++) {
    char nm[32];
    snprintf(nm, sizeof nm, "g:%d", i);
    REQUIRE_OK(
        vopen(v, (size_t)i, nm, i % 2 ? 1 : TALLY_SHARDS_AUTO, TALLY_POLICY_THREAD));
  }
  atomic_bool stop = false;
  struct tu_mover m = {.s = s, .prefix = "g:", .n = SLOTS, .stop = &stop};
  pthread_t mover;
  pthread_create(&mover, NULL, tu_mover_main, &m);
  for (size_t n = SLOTS + 1; n <= SLOTS + 300; n++) {
    random_adds(v, &seed, 0, SLOTS, 2000, &m, added);
    REQUIRE_OK(tally_vector_grow(v, n));
  }
  atomic_store(&stop, true);
  pthread_join(mover, NULL);
  EXPECT(m.moves > 0);
  EXPECT_I64(SLOTS + 300, tally_vector_size(v));
  for (int i = 0; i < SLOTS; i++) {
    char nm[32];
    snprintf(nm, sizeof nm, "g:%d", i);
    EXPECT_I64(added[i], value_of(s, nm));
  }
  tally_vector_free(v);
  tally_store_close(s);
}

static void *hammer_main(void *ud) {
  struct hammer *h = ud;
  double end = tu_now() + 10;
  while (!atomic_load(h->stop) && tu_now() < end)
    for (int k = 0; k < 4096; k++) {
      if (tally_vector_incr(h->v, 0, 1) != 0) {
        TU_FAIL("incr: %s", tally_errmsg());
        return NULL;
      }
      h->n++;
    }
  return NULL;
}

/* Automatic shards sample through the vector too: two writers grow it.
 * They must run at once to collide: on one CPU they take turns. */
static void test_auto_grows(void) {
  tally_store *s;
  tally_vector *v;
  cpu_set_t cpus;
  if (sched_getaffinity(0, sizeof cpus, &cpus) == 0 && CPU_COUNT(&cpus) < 2) {
    printf("auto: SKIPPED: one CPU to run on, so two writers never collide\n");
    return;
  }
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  REQUIRE_OK(tally_vector_new(s, 1, &v));
  REQUIRE_OK(vopen(v, 0, "hot", TALLY_SHARDS_AUTO, TALLY_POLICY_THREAD));
  atomic_bool stop = false;
  struct hammer h[2] = {{.v = v, .stop = &stop}, {.v = v, .stop = &stop}};
  pthread_t th[2];
  for (int t = 0; t < 2; t++) pthread_create(&th[t], NULL, hammer_main, &h[t]);
  tally_counter_info in;
  memset(&in, 0, sizeof in);
  for (int t = 0; t < 800 && in.grown == 0; t++) {
    usleep(10000);
    EXPECT_OK(tally_counter_info_get(tally_vector_get(v, 0), &in));
  }
  atomic_store(&stop, true);
  for (int t = 0; t < 2; t++) pthread_join(th[t], NULL);
  EXPECT(in.grown > 0);
  EXPECT_I64(h[0].n + h[1].n, tu_value(tally_vector_get(v, 0)));
  printf("auto: grew to %u shards\n", in.shards);
  tally_vector_free(v);
  tally_store_close(s);
}

/* ---- rows: multi-shard counters ------------------------------------------- */

enum { RSLOTS = 40, RWRITERS = 4, RSOLO = 1000, RPER = 100000 };

struct rwriter {
  tally_vector *v;
  uint64_t seed;
  atomic_bool *go;
  struct tu_mover *m;
  int64_t added[RSLOTS];
};

/* RSOLO adds to slot 0, then random ones over the others once go is set. */
static void *rows_main(void *ud) {
  struct rwriter *w = ud;
  for (int n = 0; n < RSOLO; n++)
    if (tally_vector_incr(w->v, 0, 1) != 0) TU_FAIL("incr 0: %s", tally_errmsg());
  while (!atomic_load(w->go)) sched_yield();
  random_adds(w->v, &w->seed, 1, RSLOTS - 1, RPER, w->m, w->added);
  return NULL;
}

static void test_rows(void) {
  tally_store *s = open_file("rows.tly", "100"); /* see test_threads */
  tally_vector *v, *other;

  /* a vector takes the first multi-shard count it meets, and only that */
  REQUIRE_OK(tally_vector_new(s, 4, &other));
  EXPECT_OK(vopen(other, 0, "o:eight", 8, TALLY_POLICY_THREAD));
  EXPECT_OK(vopen(other, 1, "o:four", 4, TALLY_POLICY_THREAD));
  EXPECT_OK(vopen(other, 2, "o:random", 8, TALLY_POLICY_RANDOM));
  EXPECT_OK(vopen(other, 3, "o:one", 1, TALLY_POLICY_THREAD));
  EXPECT_I64(2, tally_vector_fast(other, 0)); /* dense: its group's first */
  EXPECT(!tally_vector_fast(other, 1));
  EXPECT(!tally_vector_fast(other, 2));
  EXPECT_I64(1, tally_vector_fast(other, 3)); /* not the group's kind: its word */
  EXPECT(!tally_vector_fast(other, 4));
  EXPECT(!tally_vector_fast(NULL, 0));
  for (size_t i = 0; i < 4; i++)
    for (int n = 0; n < 100; n++) EXPECT_OK(tally_vector_incr(other, i, 2));
  EXPECT_I64(200, value_of(s, "o:eight"));
  EXPECT_I64(200, value_of(s, "o:four"));
  EXPECT_I64(200, value_of(s, "o:random"));
  EXPECT_I64(200, value_of(s, "o:one"));
  tally_vector_free(other);

  REQUIRE_OK(tally_vector_new(s, RSLOTS, &v));
  for (int i = 0; i < RSLOTS; i++) {
    char nm[32];
    snprintf(nm, sizeof nm, "r:%d", i);
    REQUIRE_OK(vopen(v, (size_t)i, nm, RWRITERS, TALLY_POLICY_THREAD));
  }
  for (int i = 0; i < RSLOTS; i++)
    EXPECT_I64(2, tally_vector_fast(v, (size_t)i)); /* dense */

  /* one writer per shard: each writer's adds are all in its own shard */
  atomic_bool go = false, stop = false;
  struct tu_mover m = {.s = s, .prefix = "r:", .n = RSLOTS, .stop = &stop};
  struct rwriter w[RWRITERS];
  pthread_t th[RWRITERS + 1];
  for (int t = 0; t < RWRITERS; t++) {
    memset(&w[t], 0, sizeof w[t]);
    w[t].v = v;
    w[t].seed = 17 + (uint64_t)t;
    w[t].go = &go;
    w[t].m = &m;
    pthread_create(&th[t], NULL, rows_main, &w[t]);
  }
  for (int t = 0; t < 100 && value_of(s, "r:0") < RWRITERS * RSOLO; t++) usleep(10000);
  int64_t sh[RWRITERS];
  uint32_t nsh = 0;
  EXPECT_OK(tally_counter_shards(tally_vector_get(v, 0), sh, RWRITERS, &nsh));
  EXPECT_I64(RWRITERS, nsh);
  for (int k = 0; k < RWRITERS; k++) EXPECT_I64(RSOLO, sh[k]);
  EXPECT(tally_vector_fast(v, 0));

  /* then random adds while a mover reshards every third counter to 1 or to
   * 2..8 shards and back: a slot must never name rows its counter lacks */
  pthread_create(&th[RWRITERS], NULL, tu_mover_main, &m);
  atomic_store(&go, true);
  for (int t = 0; t < RWRITERS; t++) pthread_join(th[t], NULL);
  atomic_store(&stop, true);
  pthread_join(th[RWRITERS], NULL);
  EXPECT(atomic_load(&m.rounds) >= 3);
  for (int i = 1; i < RSLOTS; i++) {
    char nm[32];
    int64_t want = 0;
    for (int t = 0; t < RWRITERS; t++) want += w[t].added[i];
    snprintf(nm, sizeof nm, "r:%d", i);
    EXPECT_I64(want, value_of(s, nm));
  }

  /* a counter resharded to another count leaves the fast path; back to
   * RWRITERS shards, or to one, it takes it again */
  tally_counter *c;
  REQUIRE_OK(tu_counter(s, "r:5", 0, -1, 0, &c));
  static const uint32_t shapes[] = {2, RWRITERS, 3, 1, 16, RWRITERS};
  int64_t before = value_of(s, "r:5");
  for (size_t k = 0; k < sizeof shapes / sizeof *shapes; k++) {
    EXPECT_OK(tally_counter_reshard(c, shapes[k]));
    EXPECT_OK(tally_vector_incr(v, 5, 1));
    EXPECT_I64(shapes[k] == 1 || shapes[k] == RWRITERS, tally_vector_fast(v, 5) != 0);
  }
  EXPECT_I64(before + 6, value_of(s, "r:5"));
  tally_counter_close(c);
  printf("rows: %d writers, %ld reshards, exact\n", RWRITERS, m.moves);
  EXPECT_I64(0, tally_store_check(s));
  tally_vector_free(v);
  tally_store_close(s);
}

/* ---- processes ------------------------------------------------------------- */

enum { PSLOTS = 1000 };

/* A child: its own store handle and vector; acks[] counts what returned 0. */
static void child_main(const char *spec, _Atomic int64_t *acked, uint64_t seed) {
  tally_store *s;
  tally_vector *v;
  if (tally_store_open(spec, NULL, &s) || tally_vector_new(s, PSLOTS, &v)) _exit(2);
  for (int i = 0; i < PSLOTS; i++) {
    char nm[32];
    snprintf(nm, sizeof nm, "p:%d", i);
    if (tally_vector_open(v, (size_t)i, nm, strlen(nm), NULL, 0)) _exit(3);
  }
  double end = tu_now() + 30;
  for (long n = 0; n < 2000000 && tu_now() < end; n++) {
    if (tally_vector_incr(v, (size_t)(tu_rng(&seed) % PSLOTS), 1)) _exit(4);
    atomic_fetch_add(acked, 1);
  }
  tally_vector_free(v);
  tally_store_close(s);
  _exit(0);
}

static void test_processes(void) {
  char spec[1200];
  tally_store *s = open_file("procs.tly", "0");
  tu_spec(spec, sizeof spec, NULL, 0, g_dir, "procs.tly");
  tally_counter *c[PSLOTS];
  for (int i = 0; i < PSLOTS; i++) {
    char nm[32];
    snprintf(nm, sizeof nm, "p:%d", i);
    REQUIRE_OK(tu_counter(s, nm, 1, TALLY_POLICY_THREAD, TALLY_COUNTER_CREATE, &c[i]));
  }
  _Atomic int64_t *acked =
      mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (acked == MAP_FAILED) REQUIRE_OK(TALLY_ENOMEM);
  pid_t pid[2];
  fflush(stdout); /* the children must not print it again */
  for (int k = 0; k < 2; k++)
    if ((pid[k] = fork()) == 0) child_main(spec, &acked[k * 8], 1234567 + (uint64_t)k);
  /* move the counters under them; kill the first child mid-run */
  double end = tu_now() + 20;
  bool killed = false;
  int round = 0;
  for (; tu_now() < end; round++) {
    for (int i = round % 5; i < PSLOTS; i += 5)
      EXPECT_OK(tally_counter_reshard(c[i], round % 2 ? 1 : 4));
    EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
    if (!killed && atomic_load(&acked[0]) > 300000) {
      kill(pid[0], SIGKILL);
      killed = true;
    }
    int st;
    if (killed && waitpid(pid[1], &st, WNOHANG) == pid[1]) {
      EXPECT(WIFEXITED(st) && WEXITSTATUS(st) == 0);
      pid[1] = -1;
      break;
    }
  }
  int st;
  if (!killed) kill(pid[0], SIGKILL);
  waitpid(pid[0], &st, 0);
  EXPECT(WIFSIGNALED(st));
  if (pid[1] > 0) {
    waitpid(pid[1], &st, 0);
    EXPECT(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  }
  int64_t total = 0, want = atomic_load(&acked[0]) + atomic_load(&acked[8]);
  for (int i = 0; i < PSLOTS; i++) {
    total += tu_value(c[i]);
    tally_counter_close(c[i]);
  }
  tu_expect_acked(total, want);
  printf("processes: %lld acknowledged, %lld counted, %d rounds of reshards\n",
         (long long)want, (long long)total, round);
  EXPECT_I64(0, tally_store_check(s));
  munmap(acked, 4096);
  tally_store_close(s);
}

int main(void) {
  snprintf(g_dir, sizeof g_dir, "%s", tu_tmpdir("vector"));
  test_api();
  test_many_api();
  test_dense();
  test_reuse();
  test_expired();
  test_revive_threads();
  test_stamps();
  test_stamp_limit();
  test_threads();
  test_many_threads();
  test_stamp_threads();
  test_grow();
  test_auto_grows();
  test_rows();
  test_processes();
  tu_rmrf(g_dir);
  return tu_finish("test_vector");
}
