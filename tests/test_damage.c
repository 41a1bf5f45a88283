/* test_damage.c -- a healthy store read right, and damage that must give a
 * clear error (never a stray store, a division by zero or a stall that
 * comes back): issue 10, items 1 to 5.
 *
 *  - names: a lookup of a name longer than the newest record (which ends
 *    exactly at the arena's end) is ENOENT, not ECORRUPT; many names of
 *    random lengths, in memory and file stores;
 *  - rings: a rollup ring's head set negative, huge or past any time makes
 *    history, rolled and check ECORRUPT and a tick skip the counter without
 *    writing anywhere (the store checks clean once the head is put back);
 *    long rings at real and far-future clocks read back right;
 *  - cells: a cell just past the live range (what a writer killed between
 *    its add and its undo leaves) is reported by check, clamped by the
 *    first read after the 2 s wait and repaired in the file, so the next
 *    read is fast; a writer waiting on it meanwhile is not lost; many such
 *    cells cost one wait, not one each;
 *  - damaged cells (issue 35, item 2): a cell farther out (INT64_MIN where
 *    a value was) is ECORRUPT at once on every path that reads or moves
 *    it, naming the counter and shard, and is never written; other
 *    counters read right and a tick rolls them;
 *  - truncation: open and check report a file shorter than its header says;
 *  - limbo: a retired record's item with a size past the free lists is
 *    reported as damage, never used as a list's index;
 *  - a schedule slot's periods done, damaged huge: no last period, no wrap;
 *  - ownership: a symlink and a file of another user are refused unless
 *    TALLY_OPEN_TRUST; mode bits above 0777 are dropped.
 */
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>

#include "testutil.h"

#include "../src/core/internal.h" /* tally__item, tally__crec: a limbo item */

static const char *g_dir;

static void spec_of(char *spec, size_t cap, char *path, size_t pcap, const char *name) {
  tu_spec(spec, cap, path, pcap, g_dir, name);
  unlink(path);
}

/* The offset of the only 8-byte word equal to v in the file, or -1. */
static long find_word(const char *path, int64_t v, int *count) {
  int fd = open(path, O_RDONLY);
  struct stat st;
  long at = -1;
  *count = 0;
  if (fd < 0 || fstat(fd, &st) != 0) return -1;
  int64_t *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return -1;
  for (size_t i = 0; i < (size_t)st.st_size / 8; i++)
    if (p[i] == v) {
      at = (long)(i * 8);
      ++*count;
    }
  munmap(p, (size_t)st.st_size);
  return at;
}

static void put_word(const char *path, long at, int64_t v) {
  int fd = open(path, O_WRONLY);
  if (fd < 0 || pwrite(fd, &v, 8, at) != 8) {
    perror(path);
    exit(1);
  }
  close(fd);
}

/* ---- item 1: the name index ---------------------------------------------- */

static void names_in(const char *spec) {
  tally_store *s;
  tally_counter *c;
  int64_t v;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  /* the repro: "big:163384" meets the entry of "q" */
  REQUIRE_OK(tu_counter(s, "q", 0, -1, TALLY_COUNTER_CREATE, &c));
  tally_counter_close(c);
  EXPECT_RC(TALLY_ENOENT, tu_counter(s, "big:163384", 0, -1, 0, &c));
  /* each new counter is the newest record: look up longer absent names */
  uint64_t rng = 42;
  char name[300], probe[340]; /* probe: name and a suffix */
  int bad = 0, made = 0;
  for (int i = 0; i < 600; i++) {
    int len = 1 + (int)(tu_rng(&rng) % 40);
    for (int k = 0; k < len; k++) name[k] = (char)('a' + tu_rng(&rng) % 26);
    snprintf(name + len, sizeof name - (size_t)len, ":%d", i);
    if (tu_counter(s, name, 1 + (uint32_t)(i % 3), -1, TALLY_COUNTER_CREATE, &c) != 0) {
      TU_FAIL("create %s: %s", name, tally_errmsg());
      continue;
    }
    made++;
    EXPECT_OK(tally_counter_incr(c, i));
    tally_counter_close(c);
    for (int j = 0; j < 300; j++) {
      snprintf(probe, sizeof probe, "%s:absent:%d:%llu", name, j,
               (unsigned long long)(tu_rng(&rng) % 1000000));
      int rc = tu_counter(s, probe, 0, -1, 0, &c);
      if (rc != TALLY_ENOENT && bad++ < 5)
        TU_FAIL("lookup of absent '%s' after creating '%s': %d %s (%s)", probe, name, rc,
                tally_err_name(rc), tally_errmsg());
      if (rc == 0) tally_counter_close(c);
    }
  }
  EXPECT(bad == 0);
  EXPECT_I64(601, made + 1);
  EXPECT_OK(tally_store_sum(s, "*", 1, &v, &(uint64_t){0}));
  EXPECT_I64(600 * 599 / 2, v);
  EXPECT_OK(tally_store_check(s));
  tally_store_close(s);
}

static void test_names(void) {
  char spec[1200], path[1200];
  names_in("memory");
  spec_of(spec, sizeof spec, path, sizeof path, "names.tly");
  names_in(spec);
}

/* ---- item 2: ring heads --------------------------------------------------- */

#define T0 INT64_C(1700000000000) /* ms; bucket 1700000000 of a 1 s ring */

static void roll(tally_store *s, const tally_ring *rings, uint32_t n, int64_t at,
                 tally_tick_result *res) {
  tally_schedule *sch;
  REQUIRE_OK(tally_schedule_new(s, "r*", 2, 10000, rings, n,
                                &sch)); /* its period number is no head */
  EXPECT_OK(tally_schedule_tick(sch, at, NULL, NULL, res));
  tally_schedule_free(sch);
}

static void test_ring_heads(void) {
  char spec[1200], path[1200];
  spec_of(spec, sizeof spec, path, sizeof path, "rings.tly");
  tally_ring rings[1] = {{1, 10}};
  tally_store *s;
  tally_counter *c, *other;
  tally_tick_result res;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  REQUIRE_OK(tu_counter(s, "r1", 4, -1, TALLY_COUNTER_CREATE, &c));
  REQUIRE_OK(tu_counter(s, "other", 4, -1, TALLY_COUNTER_CREATE, &other));
  EXPECT_OK(tally_counter_incr(c, 5));
  EXPECT_OK(tally_counter_incr(other, 77));
  roll(s, rings, 1, T0, &res);
  EXPECT_I64(1, res.counters);
  tally_counter_close(c);
  tally_counter_close(other);
  tally_store_close(s);

  int count;
  long at = find_word(path, T0 / 1000 + 1, &count); /* the head word */
  EXPECT_I64(1, count);
  if (at < 0 || count != 1) return;
  const int64_t heads[] = {
      -1, -7, -1000003, INT64_MIN, INT64_MAX, INT64_C(1) << 62, INT64_MAX / 1000 + 2};
  for (size_t h = 0; h < sizeof heads / sizeof *heads; h++) {
    put_word(path, at, heads[h]);
    tally_bucket b[16];
    uint32_t n;
    tally_rollup r;
    REQUIRE_OK(tally_store_open(spec, NULL, &s));
    REQUIRE_OK(tu_counter(s, "r1", 0, -1, 0, &c));
    EXPECT_RC(TALLY_ECORRUPT, tally_store_check(s));
    EXPECT_RC(TALLY_ECORRUPT, tally_counter_history(c, 1, b, 16, &n));
    EXPECT_RC(TALLY_ECORRUPT, tally_counter_rolled(c, &r));
    for (int k = 1; k <= 3; k++) { /* no store through the head, no division by 0 */
      roll(s, rings, 1, T0 + (int64_t)(h * 3 + (size_t)k) * 10000, &res);
      EXPECT_I64(TALLY_TICK_RAN, res.status);
      EXPECT_I64(0, res.counters);
      EXPECT_I64(1, res.skipped);
    }
    tally_counter_close(c);
    tally_store_close(s);
    put_word(path, at, T0 / 1000 + 1); /* put it back: nothing else was touched */
    REQUIRE_OK(tally_store_open(spec, NULL, &s));
    EXPECT_OK(tally_store_check(s));
    REQUIRE_OK(tu_counter(s, "r1", 0, -1, 0, &c));
    REQUIRE_OK(tu_counter(s, "other", 0, -1, 0, &other));
    EXPECT_I64(5, tu_value(c));
    EXPECT_I64(77, tu_value(other));
    EXPECT_OK(tally_counter_history(c, 1, b, 16, &n));
    EXPECT_I64(1, n);
    EXPECT_OK(tally_counter_rolled(c, &r));
    EXPECT_I64(T0, r.at_ms);
    tally_counter_close(c);
    tally_counter_close(other);
    tally_store_close(s);
  }

  /* long rings: the real clock, and a time far ahead (large heads) */
  tally_ring longr[2] = {{1, 100000}, {86400, 100000}};
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  REQUIRE_OK(tu_counter(s, "r2", 2, -1, TALLY_COUNTER_CREATE, &c));
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  int64_t now = (int64_t)ts.tv_sec * 1000;
  const int64_t times[] = {now, now + 10000, now + 86400000, INT64_MAX / 2,
                           INT64_MAX - 5000};
  for (size_t i = 0; i < sizeof times / sizeof *times; i++) {
    EXPECT_OK(tally_counter_incr(c, 1));
    roll(s, longr, 2, times[i], &res);
    EXPECT_I64(1, res.counters);
  }
  static tally_bucket b[100000];
  uint32_t n;
  EXPECT_OK(tally_counter_history(c, 1, b, 100000, &n));
  EXPECT_I64(1, n); /* the far jumps emptied the 1 s ring */
  EXPECT_I64(5, b[0].value);
  EXPECT_I64((INT64_MAX - 5000) / 1000, b[0].t);
  EXPECT_OK(tally_counter_history(c, 86400, b, 100000, &n));
  EXPECT_I64(1, n);
  EXPECT_OK(tally_store_check(s));
  tally_counter_close(c);
  tally_store_close(s);
}

/* ---- item 3: a cell outside the live range -------------------------------- */

struct writer_arg {
  tally_counter *c;
  int rc;
};

static void *stuck_writer(void *p) {
  struct writer_arg *w = p;
  w->rc = tally_counter_incr_shard(w->c, 2, 1);
  return NULL;
}

static void test_stuck_cell(void) {
  char spec[1200], path[1200];
  spec_of(spec, sizeof spec, path, sizeof path, "cells.tly");
  const int64_t mark = INT64_C(0x123456789ab);
  tally_store *s;
  tally_counter *c;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  REQUIRE_OK(tu_counter(s, "stuck", 4, TALLY_POLICY_CUSTOM, TALLY_COUNTER_CREATE, &c));
  EXPECT_OK(tally_counter_incr_shard(c, 0, 10));
  EXPECT_OK(tally_counter_incr_shard(c, 2, mark));
  tally_counter_close(c);
  tally_store_close(s);
  int count;
  long at = find_word(path, mark, &count);
  EXPECT_I64(1, count);
  if (at < 0 || count != 1) return;
  put_word(path, at, -(INT64_C(1) << 62) - 5); /* a dead writer's add of -5 */

  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  REQUIRE_OK(tu_counter(s, "stuck", 0, -1, 0, &c));
  EXPECT_RC(TALLY_ECORRUPT, tally_store_check(s));
  EXPECT(strstr(tally_errmsg(), "'stuck' shard 2") != NULL);
  EXPECT(strstr(tally_errmsg(), "the next read clamps and repairs it") != NULL);
  struct writer_arg w = {c, -99};
  pthread_t th;
  pthread_create(&th, NULL, stuck_writer, &w);
  double t = tu_now();
  int64_t v;
  EXPECT_OK(tally_counter_value(c, &v));
  double first = tu_now() - t;
  pthread_join(th, NULL);
  EXPECT_OK(w.rc);      /* it waited, then added to the repaired cell */
  EXPECT(first >= 0.9); /* the wait is 1 to 2 s (whole seconds of the clock) */
  EXPECT(v == 10 - (INT64_C(1) << 62) || v == 11 - (INT64_C(1) << 62));
  t = tu_now();
  EXPECT_OK(tally_counter_value(c, &v));
  double second = tu_now() - t;
  if (second > 0.5) TU_FAIL("second read took %.2f s", second);
  EXPECT_I64(11 - (INT64_C(1) << 62), v);
  EXPECT_OK(tally_store_check(s));
  tally_counter_close(c);
  tally_store_close(s);
  /* repaired in the file: another process's first read is fast too */
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  REQUIRE_OK(tu_counter(s, "stuck", 0, -1, 0, &c));
  t = tu_now();
  EXPECT_I64(11 - (INT64_C(1) << 62), tu_value(c));
  EXPECT(tu_now() - t < 0.5);
  tally_counter_close(c);
  tally_store_close(s);
}

static int at_bound(void *ud, const char *name, size_t len, int64_t v) {
  (void)name, (void)len;
  EXPECT_I64((INT64_C(1) << 62) - 1, v); /* clamped */
  ++*(int *)ud;
  return 0;
}

/* Many cells left just past the range (a page of them): the first walk
 * waits 2 s for the first, then briefly for each other one, and repairs
 * them all; one wait of 2 s each took minutes. */
static void test_stuck_page(void) {
  char spec[1200], path[1200];
  spec_of(spec, sizeof spec, path, sizeof path, "stuckpage.tly");
  const int64_t mark = INT64_C(0x123456789ab);
  enum { N = 40 };
  tally_store *s;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  char name[16];
  for (int i = 0; i < N; i++) {
    snprintf(name, sizeof name, "p%d", i);
    EXPECT_OK(tally_store_incr(s, name, strlen(name), mark, TALLY_COUNTER_CREATE));
  }
  tally_store_close(s);
  int count;
  long at;
  while ((at = find_word(path, mark, &count)) >= 0)
    put_word(path, at, (INT64_C(1) << 62) + 3); /* each one a dead add past 2^62 */
  alarm(30);                                    /* 80 s before */
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  double t = tu_now();
  int n = 0;
  EXPECT_OK(tally_store_values(s, "p*", 2, at_bound, &n));
  double first = tu_now() - t;
  EXPECT_I64(N, n);
  if (first > 2.0 + N * 0.05) TU_FAIL("the first sum took %.2f s", first);
  EXPECT_OK(tally_store_check(s));
  tally_store_close(s);
  alarm(0);
}

/* ---- issue 35, item 2: cells damaged far outside the range ---------------- */

static int count_value(void *ud, const char *name, size_t len, int64_t v) {
  (void)name, (void)len, (void)v;
  ++*(int *)ud;
  return 0;
}

static void rolled_one(void *ud, const char *name, size_t len, const tally_rollup *r) {
  (void)r;
  EXPECT(len == 2 && memcmp(name, "ok", 2) == 0);
  ++*(int *)ud;
}

/* c1..c10 hold INT64_MIN where their value was (as a bad copy leaves):
 * before, the first read of each waited 2 s and stored -2^62 in it. */
static void test_damaged_cells(void) {
  char spec[1200], path[1200];
  spec_of(spec, sizeof spec, path, sizeof path, "damaged.tly");
  const int64_t mark = INT64_C(0x123456789ab);
  tally_store *s;
  tally_counter *c;
  char name[16];
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  EXPECT_OK(tally_store_incr(s, "ok", 2, 5, TALLY_COUNTER_CREATE));
  for (int i = 1; i <= 10; i++) {
    snprintf(name, sizeof name, "c%d", i);
    EXPECT_OK(tally_store_incr(s, name, strlen(name), mark, TALLY_COUNTER_CREATE));
  }
  tally_store_close(s);
  int count, damaged = 0;
  long at, spots[16];
  while ((at = find_word(path, mark, &count)) >= 0 && damaged < 16) {
    put_word(path, at, INT64_MIN);
    spots[damaged++] = at;
  }
  EXPECT_I64(10, damaged);

  alarm(20); /* 20 s of waits before, and then wrong values */
  double t = tu_now();
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  EXPECT_RC(TALLY_ECORRUPT, tally_store_check(s));
  EXPECT(strstr(tally_errmsg(), "farther outside the live range") != NULL);
  char want[1400];
  int64_t v = 0, removed = -1;
  for (int i = 1; i <= 10; i++) {
    snprintf(name, sizeof name, "c%d", i);
    snprintf(want, sizeof want,
             "%s: tally store is corrupt (counter '%s' shard 0 holds "
             "-9223372036854775808, farther outside the live range than an "
             "interrupted add leaves: the file was damaged)",
             path, name);
    EXPECT_RC(TALLY_ECORRUPT, tally_store_value(s, name, strlen(name), &v));
    EXPECT_STR(want, tally_errmsg());
    EXPECT_RC(TALLY_ECORRUPT, tally_store_incr(s, name, strlen(name), 1, 0));
    EXPECT_STR(want, tally_errmsg());
    REQUIRE_OK(tu_counter(s, name, 0, -1, 0, &c));
    EXPECT_RC(TALLY_ECORRUPT, tally_counter_value(c, &v));
    EXPECT_RC(TALLY_ECORRUPT, tally_counter_incr(c, 1));
    EXPECT_RC(TALLY_ECORRUPT, tally_counter_incr(c, INT64_C(1) << 40)); /* by CAS */
    EXPECT_RC(TALLY_ECORRUPT, tally_counter_reset(c, &removed));
    EXPECT_I64(-1, removed);
    EXPECT_RC(TALLY_ECORRUPT, tally_counter_reshard(c, 4));
    EXPECT_STR(want, tally_errmsg());
    tally_counter_close(c);
    EXPECT_RC(TALLY_ECORRUPT, tally_store_drop(s, name, strlen(name)));
  }
  int64_t sum;
  uint64_t n;
  int seen = 0;
  EXPECT_RC(TALLY_ECORRUPT, tally_store_sum(s, "*", 1, &sum, &n));
  EXPECT_RC(TALLY_ECORRUPT, tally_store_snapshot(s, "*", 1, count_value, &seen));
  EXPECT_OK(tally_store_sum(s, "ok", 2, &sum, &n)); /* the others read right */
  EXPECT_I64(5, sum);
  EXPECT_OK(tally_store_incr(s, "ok", 2, 1, 0));
  tally_ring ring = {1, 10};
  tally_schedule *sch;
  tally_tick_result res;
  int rolled = 0;
  REQUIRE_OK(tally_schedule_new(s, "*", 1, 10000, &ring, 1, &sch));
  EXPECT_OK(tally_schedule_tick(sch, T0, rolled_one, &rolled, &res));
  EXPECT_I64(TALLY_TICK_RAN, res.status);
  EXPECT_I64(1, res.counters); /* ok: the damaged ones skipped, reported */
  EXPECT_I64(10, res.skipped);
  EXPECT_I64(1, rolled);
  tally_schedule_free(sch);
  EXPECT_RC(TALLY_ECORRUPT, tally_store_check(s));
  tally_store_close(s);
  EXPECT_RC(TALLY_ECORRUPT, tally_store_compact(path, 0, NULL, NULL));
  if (tu_now() - t > 5) TU_FAIL("the damaged store took %.1f s", tu_now() - t);
  alarm(0);
  /* nothing was written over the damage, and nothing left behind */
  int fd = open(path, O_RDONLY);
  for (int i = 0; i < damaged; i++) {
    EXPECT(pread(fd, &v, 8, spots[i]) == 8);
    EXPECT_I64(INT64_MIN, v);
  }
  close(fd);
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  EXPECT_OK(tally_store_value(s, "ok", 2, &v));
  EXPECT_I64(6, v);
  EXPECT_RC(TALLY_ECORRUPT, tally_store_value(s, "c3", 2, &v));
  tally_store_close(s);
}

/* ---- item 4: truncated by another program ---------------------------------- */

static void test_truncated(void) {
  char spec[1200], path[1200];
  spec_of(spec, sizeof spec, path, sizeof path, "trunc.tly");
  const off_t sizes[] = {512 * 1024, 28672, 8192, 100};
  for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
    tally_store *s, *again;
    tally_counter *c;
    tally_store_stats st;
    unlink(path);
    REQUIRE_OK(tally_store_open(spec, NULL, &s));
    for (int k = 0; k < 50; k++) {
      char name[32];
      snprintf(name, sizeof name, "t%d", k);
      REQUIRE_OK(tu_counter(s, name, 8, -1, TALLY_COUNTER_CREATE, &c));
      EXPECT_OK(tally_counter_incr(c, k));
      tally_counter_close(c);
    }
    EXPECT_OK(tally_store_check(s));
    if (truncate(path, sizes[i]) != 0) perror("truncate");
    /* reported from the file's length, before a missing page is touched */
    EXPECT_RC(TALLY_ECORRUPT, tally_store_check(s));
    EXPECT(strstr(tally_errmsg(), "tally store is truncated") != NULL);
    if (sizes[i] >= 4096) EXPECT(strstr(tally_errmsg(), "header says") != NULL);
    EXPECT_RC(TALLY_ECORRUPT, tally_store_stats_get(s, &st));
    EXPECT(strstr(tally_errmsg(), "truncated") != NULL);
    EXPECT_RC(TALLY_ECORRUPT, tally_store_open(spec, NULL, &again));
    EXPECT(strstr(tally_errmsg(), "truncated") != NULL);
    tally_store_close(s);
  }
}

/* ---- a limbo item's size ------------------------------------------------------ */

/* A retired record's item in the limbo queue, its size (in s->small units)
 * damaged past the free lists: open, check, upkeep and new counters report
 * the damage and never index a list past the header's (found by fuzzing
 * the command: UBSan, and an out-of-bounds push in a release build). */
static void test_limbo_item(void) {
  char spec[1200], path[1200];
  spec_of(spec, sizeof spec, path, sizeof path, "limbo.tly");
  tally_store *s;
  tally_counter *c;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  REQUIRE_OK(tu_counter(s, "victim", 2, -1, TALLY_COUNTER_CREATE, &c));
  uint64_t rec_off = tally__crec(c), units = tally__rec_units(s, 6);
  tally_counter_close(c);
  for (int i = 0; i < 100;
       i++) { /* records after it: its damaged size stays in the arena */
    char name[16];
    snprintf(name, sizeof name, "pad:%d", i);
    REQUIRE_OK(tu_counter(s, name, 2, -1, TALLY_COUNTER_CREATE, &c));
    tally_counter_close(c);
  }
  REQUIRE_OK(tally_store_drop(s, "victim", 6));
  tally_store_close(s);
  int count;
  long at =
      find_word(path, (int64_t)tally__item(TALLY__ITEM_SMALL, rec_off, units), &count);
  EXPECT(count == 1);
  if (at < 0) return;
  /* 64 units: just past the lists, and well inside the arena */
  put_word(path, at, (int64_t)tally__item(TALLY__ITEM_SMALL, rec_off, 64));
  setenv("TALLY_GRACE_MS", "0", 1); /* reclaim at the first grace step */
  int rc = tally_store_open(spec, NULL, &s);
  unsetenv("TALLY_GRACE_MS");
  if (rc == 0) {
    EXPECT_RC(TALLY_ECORRUPT, tally_store_check(s));
    EXPECT(strstr(tally_errmsg(), "limbo item") != NULL);
    for (int i = 0; i < 3; i++) { /* grace steps: reclaim */
      rc = tally_store_maintain(s, 0, 0, NULL);
      EXPECT(rc == 0 || rc == TALLY_ECORRUPT);
    }
    rc = tu_counter(s, "after", 2, -1, TALLY_COUNTER_CREATE, &c);
    if (rc == 0) tally_counter_close(c);
    EXPECT(rc == 0 || rc == TALLY_ECORRUPT);
    tally_store_close(s);
  } else {
    EXPECT_RC(TALLY_ECORRUPT, rc);
  }
}

/* A schedule slot whose count of periods done is damaged past what its
 * period times it can hold: tally info's last period is none, not a wrap
 * (signed overflow, UBSan; found by fuzzing the command). */
static void test_schedule_slot(void) {
  char spec[1200], path[1200];
  spec_of(spec, sizeof spec, path, sizeof path, "sched.tly");
  tally_store *s;
  tally_schedule *sch;
  tally_schedule_info info;
  uint32_t n = 0;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  REQUIRE_OK(tally_schedule_new(s, "x*", 2, 1000, NULL, 0, &sch));
  int64_t now = INT64_C(1234567891) * 1000; /* done becomes 1234567892 */
  tally_tick_result tr;
  EXPECT_OK(tally_schedule_tick(sch, now, NULL, NULL, &tr));
  EXPECT_OK(tally_store_schedules(s, &info, 1, &n));
  EXPECT_I64(now, info.last_period_ms);
  tally_schedule_free(sch);
  tally_store_close(s);
  int count;
  long at = find_word(path, INT64_C(1234567892), &count);
  EXPECT(count == 1);
  if (at < 0) return;
  put_word(path, at, INT64_C(1) << 60);
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  EXPECT_OK(tally_store_schedules(s, &info, 1, &n));
  EXPECT_I64(1, n);
  EXPECT_I64(-1, info.last_period_ms);
  /* and the check says so (tally info --check) */
  EXPECT_RC(TALLY_ECORRUPT, tally_store_check(s));
  EXPECT(strstr(tally_errmsg(), "rollup schedule slot") != NULL);
  tally_store_close(s);
  put_word(path, at, -5); /* a negative count */
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  EXPECT_RC(TALLY_ECORRUPT, tally_store_check(s));
  EXPECT(strstr(tally_errmsg(), "a period count is negative") != NULL);
  tally_store_close(s);
  put_word(path, at, INT64_C(1234567892)); /* as it was: sound */
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  EXPECT_OK(tally_store_check(s));
  tally_store_close(s);
}

/* ---- item 5: symlinks, other users' files, mode bits --------------------------- */

static void test_ownership(void) {
  char spec[1200], path[1200], lspec[1200], lpath[1200], dspec[1200], dpath[1200];
  tally_store *s;
  tally_open_options trust = {0, TALLY_OPEN_TRUST};
  spec_of(spec, sizeof spec, path, sizeof path, "own.tly");
  spec_of(lspec, sizeof lspec, lpath, sizeof lpath, "link.tly");
  spec_of(dspec, sizeof dspec, dpath, sizeof dpath, "dangling.tly");
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  tally_store_close(s);
  if (symlink(path, lpath) != 0) perror("symlink");
  EXPECT_RC(TALLY_EUNTRUSTED, tally_store_open(lspec, NULL, &s));
  EXPECT(strstr(tally_errmsg(), "symbolic link") != NULL);
  EXPECT(strstr(tally_errmsg(), lpath) != NULL);
  EXPECT_OK(tally_store_open(lspec, &trust, &s));
  if (s) tally_store_close(s);
  /* a dangling link: refused, and nothing made where it points */
  char target[1300];
  snprintf(target, sizeof target, "%s/planted-target.tly", g_dir);
  unlink(target);
  if (symlink(target, dpath) != 0) perror("symlink");
  EXPECT_RC(TALLY_EUNTRUSTED, tally_store_open(dspec, NULL, &s));
  EXPECT(access(target, F_OK) != 0);

  /* mode: setuid, setgid and sticky dropped */
  char mspec[1200], mpath[1200];
  struct stat st;
  spec_of(mspec, sizeof mspec, mpath, sizeof mpath, "mode.tly");
  tally_open_options m = {04777 | 02000 | 01000, 0};
  REQUIRE_OK(tally_store_open(mspec, &m, &s));
  tally_store_close(s);
  EXPECT(stat(mpath, &st) == 0);
  EXPECT_I64(0777, st.st_mode & 07777);

  /* another user's file (as root: chown it away) */
  if (geteuid() == 0) {
    if (chown(path, 65534, 65534) != 0) perror("chown");
    EXPECT_RC(TALLY_EUNTRUSTED, tally_store_open(spec, NULL, &s));
    EXPECT(strstr(tally_errmsg(), "owned by another user (uid 65534") != NULL);
    EXPECT_OK(tally_store_open(spec, &trust, &s));
    if (s) {
      EXPECT_OK(tally_store_check(s));
      tally_store_close(s);
    }
  } else {
    printf("test_damage: not root: the other-user case is not run\n");
  }
  tally_open_options bad = {0, 0x80};
  EXPECT_RC(TALLY_EINVAL, tally_store_open(spec, &bad, &s));
}

int main(void) {
  g_dir = tu_tmpdir("damage");
  test_names();
  test_ring_heads();
  test_stuck_cell();
  test_stuck_page();
  test_damaged_cells();
  test_truncated();
  test_limbo_item();
  test_schedule_slot();
  test_ownership();
  tu_rmrf(g_dir);
  return tu_finish("test_damage");
}
