/* test_rows.c -- tally_store_rows: each counter as a listing shows it.
 *
 * Over 100,000 counters of several shard counts and policies, names that
 * begin others and names past 16 bytes that tie on their first 16, the
 * rows in the names' order must be every counter once, in memcmp's order,
 * each with the value, shards, policy, automatic reshards and rollup its
 * own handle reads; a counter whose shards sum beyond int64 says so. With
 * TALLY_ROWS_CELLS each row has each shard's value, as tally_counter_shards
 * reads it, adding up to the row's value (an export's one read). A
 * tally_walk in slices of 1,000 index slots gives the same rows. Then
 * writers, drops and creates run beside repeated listings: each in order,
 * without a name twice.
 */
#include "testutil.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define N 100000

struct got {
  char (*name)[80];
  size_t *len;
  tally_row *row;
  tally_rollup *roll;
  size_t n, cap;
  int stop_at;
};

static int collect(void *ud, const tally_row *r) {
  struct got *g = ud;
  if (g->n == g->cap) {
    g->cap = g->cap ? g->cap * 2 : 1024;
    g->name = realloc(g->name, g->cap * sizeof *g->name);
    g->len = realloc(g->len, g->cap * sizeof *g->len);
    g->row = realloc(g->row, g->cap * sizeof *g->row);
    g->roll = realloc(g->roll, g->cap * sizeof *g->roll);
    if (!g->name || !g->len || !g->row || !g->roll) abort();
  }
  if (r->name_len >= sizeof g->name[0]) abort();
  memcpy(g->name[g->n], r->name, r->name_len);
  g->name[g->n][r->name_len] = 0;
  g->len[g->n] = r->name_len;
  g->row[g->n] = *r;
  if (r->rolled) g->roll[g->n] = *r->rolled;
  g->n++;
  return g->stop_at && (int)g->n == g->stop_at ? 9 : 0;
}

/* TALLY_ROWS_CELLS: the cells one after the other, and where each row's start */
struct cells {
  int64_t *v;
  size_t *at;
  size_t n, len, cap, vcap;
  bool wrong; /* a row without cells, or whose cells do not add up */
};

static int collect_cells(void *ud, const tally_row *r) {
  struct cells *c = ud;
  if (c->n == c->cap) {
    c->cap = c->cap ? c->cap * 2 : 1024;
    if (!(c->at = realloc(c->at, c->cap * sizeof *c->at))) abort();
  }
  if (c->len + r->shards > c->vcap) {
    c->vcap = (c->len + r->shards) * 2;
    if (!(c->v = realloc(c->v, c->vcap * sizeof *c->v))) abort();
  }
  if (!r->cells || r->shards < 1) {
    c->wrong = true;
    return 0;
  }
  __int128 sum = 0;
  for (uint32_t i = 0; i < r->shards; i++) sum += r->cells[i];
  if (r->value_rc == 0 ? sum != r->value : sum <= INT64_MAX) c->wrong = true;
  c->at[c->n++] = c->len;
  memcpy(c->v + c->len, r->cells, r->shards * sizeof *c->v);
  c->len += r->shards;
  return 0;
}

static void got_free(struct got *g) {
  free(g->name);
  free(g->len);
  free(g->row);
  free(g->roll);
  memset(g, 0, sizeof *g);
}

static bool before(const struct got *g, size_t i, size_t j) {
  size_t m = g->len[i] < g->len[j] ? g->len[i] : g->len[j];
  int c = memcmp(g->name[i], g->name[j], m);
  return c ? c < 0 : g->len[i] < g->len[j];
}

static void name_of(char *buf, size_t cap, uint64_t i) {
  static const char *tails[] = {"", "x", ":likes", ":likes:total:per:day", "\xff"};
  snprintf(buf, cap, "post:%06llu%s", (unsigned long long)(i / 5), tails[i % 5]);
}

static void test_in_order(tally_store *s) {
  char nm[80];
  for (uint64_t i = 0; i < N; i++) {
    name_of(nm, sizeof nm, i);
    tally_counter_options o = {i % 7 == 0 ? 4 : TALLY_SHARDS_AUTO,
                               i % 11 == 0 ? TALLY_POLICY_RANDOM : TALLY_POLICY_THREAD};
    tally_counter *c;
    REQUIRE_OK(tally_counter_open(s, nm, strlen(nm), &o, TALLY_COUNTER_CREATE, &c));
    REQUIRE_OK(tally_counter_incr(c, (int64_t)(i * 31 % 1000) - 300));
    tally_counter_close(c);
  }
  tally_counter *big; /* its shards sum past int64 */
  tally_counter_options o4 = {4, TALLY_POLICY_ROUND_ROBIN};
  REQUIRE_OK(tally_counter_open(s, "post:big", 8, &o4, TALLY_COUNTER_CREATE, &big));
  for (int i = 0; i < 4; i++) REQUIRE_OK(tally_counter_incr(big, INT64_C(1) << 61));
  tally_counter_close(big);
  REQUIRE_OK(tally_store_incr(s, "other", 5, 1, TALLY_COUNTER_CREATE));
  tally_schedule *sch;
  REQUIRE_OK(tally_schedule_new(s, "post:0001*", 10, 1000, NULL, 0, &sch));
  tally_tick_result res;
  REQUIRE_OK(tally_schedule_tick(sch, 5000, NULL, NULL, &res));
  EXPECT(res.counters > 0);

  struct got g = {0};
  EXPECT_OK(tally_store_rows(s, "post:*", 6, TALLY_ROWS_BY_NAME | TALLY_ROWS_ROLLED,
                             collect, &g));
  EXPECT_I64(N + 1, (int64_t)g.n);
  size_t rolled = 0;
  for (size_t i = 0; i < g.n; i++) {
    if (i && !before(&g, i - 1, i)) {
      TU_FAIL("row %zu (%s) is not after row %zu (%s)", i, g.name[i], i - 1,
              g.name[i - 1]);
      break;
    }
    if (strcmp(g.name[i], "post:big") == 0) {
      EXPECT_I64(TALLY_ERANGE, g.row[i].value_rc);
      continue;
    }
    /* each as its own handle reads it */
    tally_counter *c;
    tally_counter_info info;
    tally_rollup r;
    REQUIRE_OK(tally_counter_open(s, g.name[i], g.len[i], NULL, 0, &c));
    REQUIRE_OK(tally_counter_info_get(c, &info));
    EXPECT_I64(0, g.row[i].value_rc);
    if (g.row[i].value != tu_value(c) || g.row[i].shards != info.shards ||
        g.row[i].policy != info.policy || g.row[i].auto_shards != info.auto_shards ||
        g.row[i].grown != info.grown || g.row[i].shrunk != info.shrunk)
      TU_FAIL("row %zu (%s) is not what its handle reads", i, g.name[i]);
    int rc = tally_counter_rolled(c, &r);
    EXPECT((rc == 0) == (g.row[i].rolled != NULL));
    if (rc == 0) {
      rolled++;
      EXPECT(memcmp(&r, &g.roll[i], sizeof r) == 0);
    }
    tally_counter_close(c);
  }
  EXPECT(rolled == res.counters);

  /* without ROLLED: no rollups; NAMES: the names only; the index's order */
  struct got h = {0};
  EXPECT_OK(tally_store_rows(s, "post:*", 6, TALLY_ROWS_BY_NAME, collect, &h));
  EXPECT_I64((int64_t)g.n, (int64_t)h.n);
  for (size_t i = 0; i < h.n; i++)
    if (h.row[i].rolled || strcmp(h.name[i], g.name[i])) {
      TU_FAIL("row %zu differs without ROLLED", i);
      break;
    }
  got_free(&h);
  EXPECT_OK(tally_store_rows(s, "post:*", 6, TALLY_ROWS_BY_NAME | TALLY_ROWS_NAMES,
                             collect, &h));
  EXPECT_I64((int64_t)g.n, (int64_t)h.n);
  for (size_t i = 0; i < h.n; i++)
    if (strcmp(h.name[i], g.name[i]) || h.row[i].value || h.row[i].shards) {
      TU_FAIL("row %zu differs with NAMES", i);
      break;
    }
  got_free(&h);
  /* CELLS: each shard's value, as the handle reads them */
  struct cells cl = {0};
  EXPECT_OK(tally_store_rows(s, "post:*", 6, TALLY_ROWS_BY_NAME | TALLY_ROWS_CELLS,
                             collect_cells, &cl));
  EXPECT(!cl.wrong);
  EXPECT_I64((int64_t)g.n, (int64_t)cl.n);
  for (size_t i = 0; i < g.n && i < cl.n; i++) {
    int64_t vals[TALLY_MAX_SHARDS];
    uint32_t n;
    tally_counter *c;
    REQUIRE_OK(tally_counter_open(s, g.name[i], g.len[i], NULL, 0, &c));
    REQUIRE_OK(tally_counter_shards(c, vals, TALLY_MAX_SHARDS, &n));
    tally_counter_close(c);
    size_t have = (i + 1 < cl.n ? cl.at[i + 1] : cl.len) - cl.at[i];
    if (have != n || memcmp(vals, cl.v + cl.at[i], n * sizeof *vals)) {
      TU_FAIL("row %zu (%s): cells differ from the handle's shards", i, g.name[i]);
      break;
    }
  }
  free(cl.v);
  free(cl.at);
  EXPECT_OK(tally_store_rows(s, "post:*", 6, TALLY_ROWS_BY_NAME, collect, &h));
  for (size_t i = 0; i < h.n; i++)
    if (h.row[i].cells) {
      TU_FAIL("row %zu has cells without CELLS", i);
      break;
    }
  got_free(&h);
  EXPECT_OK(tally_store_rows(s, "post:*", 6, 0, collect, &h));
  EXPECT_I64((int64_t)g.n, (int64_t)h.n);
  got_free(&h);
  h.stop_at = 5;
  EXPECT_RC(9, tally_store_rows(s, "*", 1, TALLY_ROWS_BY_NAME, collect, &h));
  EXPECT_I64(5, (int64_t)h.n);
  got_free(&h);
  EXPECT_OK(tally_store_rows(s, "none*", 5, TALLY_ROWS_BY_NAME, collect, &h));
  EXPECT_I64(0, (int64_t)h.n);
  EXPECT_OK(tally_store_rows(s, "other", 5, TALLY_ROWS_BY_NAME, collect, &h));
  EXPECT_I64(1, (int64_t)h.n); /* one: the sort's smallest case */
  got_free(&h);
  EXPECT_RC(TALLY_EINVAL, tally_store_rows(s, "*", 1, 0, NULL, NULL));
  EXPECT_RC(TALLY_EINVAL, tally_store_rows(NULL, "*", 1, 0, collect, &h));
  tally_schedule_free(sch);
  got_free(&g);
}

/* tally_walk: the same rows a slice of the index at a time. */
static int by_name(const void *a, const void *b) {
  const tally_row *x = a, *y = b;
  size_t m = x->name_len < y->name_len ? x->name_len : y->name_len;
  int c = memcmp(x->name, y->name, m);
  return c ? c : (x->name_len > y->name_len) - (x->name_len < y->name_len);
}

/* The rows got hold every row of all (read whole, by name) once: sorted,
 * each name and value the same. */
static void expect_same_rows(struct got *all, struct got *got, const char *how) {
  EXPECT_I64((int64_t)all->n, (int64_t)got->n);
  for (size_t i = 0; i < got->n; i++) got->row[i].name = got->name[i];
  for (size_t i = 0; i < all->n; i++) all->row[i].name = all->name[i];
  qsort(got->row, got->n, sizeof *got->row, by_name);
  for (size_t i = 0; i < all->n && i < got->n; i++) {
    const tally_row *g = &got->row[i], *a = &all->row[i];
    if (g->name_len != a->name_len || memcmp(g->name, a->name, a->name_len) != 0 ||
        g->value != a->value || g->value_rc != a->value_rc) {
      TU_FAIL("row %zu: %s = %lld %s, %s = %lld whole", i, g->name, (long long)g->value,
              how, a->name, (long long)a->value);
      break;
    }
  }
}

static void test_walk_slices(tally_store *s) {
  struct got all = {0}, sl = {0};
  EXPECT_OK(tally_store_rows(s, "post:*", 6, TALLY_ROWS_BY_NAME, collect, &all));
  tally_walk *w;
  REQUIRE_OK(tally_walk_open(s, "post:*", 6, 0, &w));
  uint64_t passed, slots, calls = 0;
  tally_walk_progress(w, &passed, &slots);
  EXPECT_I64(0, (int64_t)passed);
  EXPECT(slots >= N);
  int rc;
  while ((rc = tally_walk_next(w, 1000, collect, &sl)) == 0) calls++;
  EXPECT_I64(1, rc);
  EXPECT_I64((int64_t)((slots + 999) / 1000 - 1), (int64_t)calls);
  tally_walk_progress(w, &passed, NULL);
  EXPECT_I64((int64_t)slots, (int64_t)passed);
  EXPECT_I64(1, tally_walk_next(w, 1000, collect, &sl)); /* done stays done */
  /* fn's stop comes back, and its slice is handed again */
  tally_walk_close(w);
  REQUIRE_OK(tally_walk_open(s, "post:*", 6, 0, &w));
  struct got part = {.stop_at = 3};
  uint64_t before_n;
  do rc = tally_walk_next(w, 1u << 30, collect, &part);
  while (rc == 0);
  EXPECT_I64(9, rc);
  before_n = part.n;
  part.stop_at = 0;
  EXPECT_I64(1, tally_walk_next(w, 1u << 30, collect, &part));
  EXPECT_I64((int64_t)(before_n + all.n), (int64_t)part.n);
  tally_walk_close(w);
  got_free(&part);
  /* every row once, as tally_store_rows reads it */
  expect_same_rows(&all, &sl, "in slices");
  /* by name: each slice a sorted run, the runs every row once */
  struct got run = {0};
  REQUIRE_OK(tally_walk_open(s, "post:*", 6, TALLY_ROWS_BY_NAME, &w));
  size_t runs = 0;
  do {
    size_t from = run.n;
    rc = tally_walk_next(w, 1000, collect, &run);
    runs += run.n > from + 1;
    for (size_t i = from + 1; i < run.n; i++) {
      tally_row a = run.row[i - 1], b = run.row[i];
      a.name = run.name[i - 1], b.name = run.name[i];
      if (by_name(&a, &b) >= 0) {
        TU_FAIL("slice from row %zu: %s before %s", from, a.name, b.name);
        break;
      }
    }
  } while (rc == 0);
  EXPECT_I64(1, rc);
  EXPECT(runs > 1);
  tally_walk_close(w);
  expect_same_rows(&all, &run, "in sorted slices");
  got_free(&run);
  EXPECT_I64(TALLY_EINVAL, tally_walk_open(NULL, NULL, 0, 0, &w));
  EXPECT_I64(TALLY_EINVAL, tally_walk_next(NULL, 1, collect, &sl));
  tally_walk_close(NULL);
  got_free(&all);
  got_free(&sl);
}

static void test_beside_churn(tally_store *s) {
  struct tu_churn c = {
      .s = s, .name_of = name_of, .names = N + N / 2, .seed = 77, .drop_one_in = 4};
  tu_churn_start(&c);
  double until = tu_now() + 2.0;
  int rounds = 0;
  while ((tu_now() < until || rounds < 3) && rounds < 100) {
    struct got g = {0};
    EXPECT_OK(tally_store_rows(s, "post:*", 6, TALLY_ROWS_BY_NAME | TALLY_ROWS_ROLLED,
                               collect, &g));
    EXPECT(g.n > N / 2);
    for (size_t i = 1; i < g.n; i++)
      if (!before(&g, i - 1, i)) {
        TU_FAIL("round %d: row %zu (%s) not after %s", rounds, i, g.name[i],
                g.name[i - 1]);
        break;
      }
    got_free(&g);
    rounds++;
  }
  tu_churn_stop(&c);
  EXPECT(rounds > 2);
  EXPECT_OK(tally_store_check(s));
}

int main(void) {
  char spec[1200], path[1200];
  const char *dir = tu_tmpdir("rows");
  tu_spec(spec, sizeof spec, path, sizeof path, dir, "rows.tly");
  tally_store *s;
  /* Reuse waits for grace_ms past every process's step; a churning
   * thread starved past the default 1 s (ASan on a loaded 2-core VM) is
   * the window grace_ms bounds, not what this test is about. */
  setenv("TALLY_GRACE_MS", "60000", 0);
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  test_in_order(s);
  test_walk_slices(s);
  test_beside_churn(s);
  tally_store_close(s);
  tu_rmrf(dir);
  return tu_finish("test_rows");
}
