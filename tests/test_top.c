/* test_top.c -- tally_store_top: the k first by value or by rate.
 *
 * Over 100,000 counters with many equal values and names that begin
 * others, the top k for several k must be exactly the first k of a full
 * sort of every matching counter (tally_store_values, then qsort) by the
 * documented order; by rate, against each counter's own rollup. Then
 * writers, drops and creates run beside repeated tops: each answer must
 * be in order, without a name twice, within the pattern and at most k.
 */
#include "testutil.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define N 100000

struct row {
  char name[64];
  size_t len;
  int64_t value;
  double rate;
  int rated;
};

struct rows {
  struct row *v;
  size_t n, cap;
  int stop_at; /* fn returns 7 at this row (1-based), 0: never */
};

static int add_row(struct rows *r, const char *name, size_t len, int64_t value,
                   const tally_rollup *roll) {
  if (r->n == r->cap) {
    r->cap = r->cap ? r->cap * 2 : 1024;
    r->v = realloc(r->v, r->cap * sizeof *r->v);
    if (!r->v) abort();
  }
  struct row *w = &r->v[r->n++];
  if (len >= sizeof w->name) abort();
  memcpy(w->name, name, len);
  w->name[len] = 0;
  w->len = len;
  w->value = value;
  w->rated = roll != NULL;
  w->rate = roll ? tally_rollup_rate(roll) : 0;
  return r->stop_at && (int)r->n == r->stop_at ? 7 : 0;
}

static int top_cb(void *ud, const char *name, size_t len, int64_t value,
                  const tally_rollup *roll) {
  return add_row(ud, name, len, value, roll);
}

static int values_cb(void *ud, const char *name, size_t len, int64_t value) {
  return add_row(ud, name, len, value, NULL);
}

static int by_name(const struct row *a, const struct row *b) {
  size_t m = a->len < b->len ? a->len : b->len;
  int c = memcmp(a->name, b->name, m);
  return c ? c : (a->len > b->len) - (a->len < b->len);
}
static int by_value(const void *x, const void *y) {
  const struct row *a = x, *b = y;
  if (a->value != b->value) return a->value > b->value ? -1 : 1;
  return by_name(a, b);
}
static int by_rate(const void *x, const void *y) {
  const struct row *a = x, *b = y;
  if (a->rated != b->rated) return a->rated ? -1 : 1;
  if (a->rated && a->rate != b->rate) return a->rate > b->rate ? -1 : 1;
  return by_name(a, b);
}

static void name_of(char *buf, size_t cap, uint64_t i) {
  /* t:17 and t:17x: a name that begins another ties on value often */
  snprintf(buf, cap, i % 2 ? "t:%llux" : "t:%llu", (unsigned long long)(i / 2));
}

static void expect_same(const struct rows *got, const struct rows *want, size_t k,
                        const char *what) {
  size_t n = k < want->n ? k : want->n;
  EXPECT_I64((int64_t)n, (int64_t)got->n);
  for (size_t i = 0; i < n && i < got->n; i++)
    if (strcmp(got->v[i].name, want->v[i].name) || got->v[i].value != want->v[i].value ||
        got->v[i].rated != want->v[i].rated ||
        (got->v[i].rated && got->v[i].rate != want->v[i].rate)) {
      TU_FAIL("%s k=%zu row %zu: got %s=%lld, want %s=%lld", what, k, i, got->v[i].name,
              (long long)got->v[i].value, want->v[i].name, (long long)want->v[i].value);
      return;
    }
}

static void test_against_sort(tally_store *s) {
  uint64_t seed = 42;
  char nm[64];
  for (uint64_t i = 0; i < N; i++) {
    name_of(nm, sizeof nm, i);
    int64_t v = (int64_t)(tu_rng(&seed) % 2000) - 500; /* ties, some negative */
    REQUIRE_OK(tally_store_incr(s, nm, strlen(nm), v, TALLY_COUNTER_CREATE));
  }
  REQUIRE_OK(tally_store_incr(s, "other", 5, 1 << 30,
                              TALLY_COUNTER_CREATE)); /* outside the pattern */

  struct rows all = {0};
  REQUIRE_OK(tally_store_values(s, "t:*", 3, values_cb, &all));
  EXPECT_I64(N, (int64_t)all.n);
  qsort(all.v, all.n, sizeof *all.v, by_value);
  size_t ks[] = {1, 2, 10, 1000, N - 1, N, N + 7};
  for (size_t i = 0; i < sizeof ks / sizeof ks[0]; i++) {
    struct rows got = {0};
    EXPECT_OK(tally_store_top(s, "t:*", 3, ks[i], TALLY_TOP_VALUE, top_cb, &got));
    expect_same(&got, &all, ks[i], "by value");
    for (size_t j = 0; j < got.n; j++) EXPECT(!got.v[j].rated);
    free(got.v);
  }
  struct rows none = {0};
  EXPECT_OK(tally_store_top(s, "t:*", 3, 0, TALLY_TOP_VALUE, top_cb, &none));
  EXPECT_I64(0, (int64_t)none.n);
  EXPECT_OK(tally_store_top(s, "nothing*", 8, 10, TALLY_TOP_VALUE, top_cb, &none));
  EXPECT_I64(0, (int64_t)none.n);
  none.stop_at = 3; /* fn stops the walk with its own value */
  EXPECT_RC(7, tally_store_top(s, "t:*", 3, 10, TALLY_TOP_VALUE, top_cb, &none));
  EXPECT_I64(3, (int64_t)none.n);
  free(none.v);
  EXPECT_RC(TALLY_EINVAL, tally_store_top(s, "t:*", 3, 10, 2, top_cb, &none));
  EXPECT_RC(TALLY_EINVAL, tally_store_top(s, "t:*", 3, 10, TALLY_TOP_VALUE, NULL, NULL));
  EXPECT_RC(TALLY_EINVAL,
            tally_store_top(NULL, "t:*", 3, 10, TALLY_TOP_VALUE, top_cb, &none));

  /* by rate: counters t:1* are rolled up twice, 1 s apart, with deltas
   * that tie; the others never: they come after every rolled one */
  tally_schedule *sch;
  tally_ring ring = {1, 4};
  REQUIRE_OK(tally_schedule_new(s, "t:1*", 4, 1000, &ring, 1, &sch));
  tally_tick_result res;
  REQUIRE_OK(tally_schedule_tick(sch, 1000000, NULL, NULL, &res));
  for (uint64_t i = 0; i < N; i += 7) {
    name_of(nm, sizeof nm, i);
    REQUIRE_OK(
        tally_store_incr(s, nm, strlen(nm), (int64_t)(i % 5) * 3, TALLY_COUNTER_CREATE));
  }
  REQUIRE_OK(tally_schedule_tick(sch, 1001000, NULL, NULL, &res));
  for (size_t i = 0; i < all.n; i++) { /* each one's own rollup, by handle */
    tally_counter *c;
    tally_rollup r;
    REQUIRE_OK(tally_counter_open(s, all.v[i].name, all.v[i].len, NULL, 0, &c));
    all.v[i].value = tu_value(c);
    int rc = tally_counter_rolled(c, &r);
    EXPECT(rc == 0 || rc == TALLY_ENOROLLUP);
    all.v[i].rated = rc == 0;
    all.v[i].rate = rc == 0 ? tally_rollup_rate(&r) : 0;
    tally_counter_close(c);
  }
  qsort(all.v, all.n, sizeof *all.v, by_rate);
  EXPECT(all.v[0].rated && all.v[0].rate == 12.0 && !all.v[all.n - 1].rated);
  size_t kr[] = {1, 50, 5000, N};
  for (size_t i = 0; i < sizeof kr / sizeof kr[0]; i++) {
    struct rows got = {0};
    EXPECT_OK(tally_store_top(s, "t:*", 3, kr[i], TALLY_TOP_RATE, top_cb, &got));
    expect_same(&got, &all, kr[i], "by rate");
    free(got.v);
  }
  /* by value, the rows carry their rollup too */
  qsort(all.v, all.n, sizeof *all.v, by_value);
  struct rows got = {0};
  EXPECT_OK(tally_store_top(s, "t:*", 3, 3000, TALLY_TOP_VALUE, top_cb, &got));
  expect_same(&got, &all, 3000, "by value, rolled");
  free(got.v);
  tally_schedule_free(sch);
  free(all.v);
}

/* ---- beside writers, drops and creates ------------------------------------ */

static void test_beside_churn(tally_store *s) {
  struct tu_churn c = {.s = s,
                       .name_of = name_of,
                       .names = N,
                       .seed = 1234,
                       .drop_one_in = 8,
                       .random_delta = true};
  tu_churn_start(&c);
  double until = tu_now() + 2.0;
  int rounds = 0;
  while ((tu_now() < until || rounds < 3) && rounds < 200) {
    struct rows got = {0};
    int by = rounds % 2 ? TALLY_TOP_RATE : TALLY_TOP_VALUE;
    size_t k = rounds % 3 ? 100 : 5000;
    EXPECT_OK(tally_store_top(s, "t:*", 3, k, by, top_cb, &got));
    EXPECT(got.n <= k && got.n > 0);
    for (size_t i = 0; i + 1 < got.n; i++)
      if ((by == TALLY_TOP_RATE ? by_rate : by_value)(&got.v[i], &got.v[i + 1]) >= 0) {
        TU_FAIL("round %d: row %zu (%s) not before row %zu (%s)", rounds, i,
                got.v[i].name, i + 1, got.v[i + 1].name);
        break;
      }
    for (size_t i = 0; i < got.n; i++) EXPECT(strncmp(got.v[i].name, "t:", 2) == 0);
    free(got.v);
    rounds++;
  }
  tu_churn_stop(&c);
  EXPECT(rounds > 2);
  EXPECT_OK(tally_store_check(s));
}

int main(void) {
  char spec[1200], path[1200];
  const char *dir = tu_tmpdir("top");
  tu_spec(spec, sizeof spec, path, sizeof path, dir, "top.tly");
  tally_store *s;
  /* Reuse waits for grace_ms past every process's step; a churning
   * thread starved past the default 1 s (ASan on a loaded 2-core VM) is
   * the window grace_ms bounds, not what this test is about. */
  setenv("TALLY_GRACE_MS", "60000", 0);
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  test_against_sort(s);
  test_beside_churn(s);
  tally_store_close(s);
  tu_rmrf(dir);
  return tu_finish("test_top");
}
