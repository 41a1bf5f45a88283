/* test_reuse.c -- a churned store stays within 1.25x of a fresh one.
 *
 * Rounds of counters come and go in one file store: long names with 16
 * shards, dropped; short names with automatic shards, resharded, dropped;
 * a family's counters left to expire; 7-shard names of another length,
 * dropped. Each round's live set is about the size of the final one, and
 * each ends past the grace time (0 here: one thread). Then the final set,
 * N counters "k:I" with the default options, goes in. The file must be at
 * most 1.25x the file of a store that only ever held the final set: what
 * was freed is reused whatever its size and shard count (space.c: split,
 * coalesce, whole chunks given back). Before that, records of one size
 * and columns of one shard count only went to their own kind, and the
 * file ended at 2.3x. tally_store_check (the free lists and chunks) must
 * pass after every round.
 */
#include "testutil.h"

#include "../src/core/internal.h" /* free lists, tally__free_now */

#define N 100000

static tally_store *open_store(const char *dir, const char *file, char *path,
                               size_t cap) {
  char spec[1200];
  tally_store *s = NULL;
  tu_spec(spec, sizeof spec, path, cap, dir, file);
  unlink(path);
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  return s;
}

/* n counters fmt % i (shards 0: the family's or the default), each
 * incremented once */
static void make(tally_store *s, const char *fmt, int n, uint32_t shards) {
  for (int i = 0; i < n; i++) {
    char name[80];
    tally_counter *c = NULL;
    int len = snprintf(name, sizeof name, fmt, i);
    tally_counter_options o = {shards, -1};
    REQUIRE_OK(tally_counter_open(s, name, (size_t)len, &o, TALLY_COUNTER_CREATE, &c));
    EXPECT_OK(tally_counter_incr(c, 1));
    tally_counter_close(c);
  }
}

static void drop(tally_store *s, const char *fmt, int n) {
  for (int i = 0; i < n; i++) {
    char name[80];
    int len = snprintf(name, sizeof name, fmt, i);
    EXPECT_OK(tally_store_drop(s, name, (size_t)len));
  }
}

static void reshard(tally_store *s, const char *fmt, int n, uint32_t shards) {
  for (int i = 0; i < n; i++) {
    char name[80];
    tally_counter *c = NULL;
    int len = snprintf(name, sizeof name, fmt, i);
    REQUIRE_OK(tally_counter_open(s, name, (size_t)len, NULL, 0, &c));
    EXPECT_OK(tally_counter_reshard(c, shards));
    tally_counter_close(c);
  }
}

static uint64_t file_bytes(const char *path) {
  struct stat sb;
  REQUIRE_OK(stat(path, &sb) == 0 ? 0 : TALLY_ESYS);
  return (uint64_t)sb.st_size;
}

static uint64_t peak_live;

/* Past the grace time, everything dropped is reusable; the store checks. */
static void settle(tally_store *s, const char *path, const char *what) {
  tally_store_stats st;
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  EXPECT_OK(tally_store_stats_get(s, &st));
  EXPECT_I64(0, st.retired_bytes);
  EXPECT_OK(tally_store_check(s));
  printf("test_reuse: %-34s file %5.2f MiB, used %5.2f, live %5.2f, reusable %5.2f\n",
         what, file_bytes(path) / 1048576.0, st.used_bytes / 1048576.0,
         st.live_bytes / 1048576.0, st.reusable_bytes / 1048576.0);
}

static void live_now(tally_store *s) {
  tally_store_stats st;
  EXPECT_OK(tally_store_stats_get(s, &st));
  if (st.live_bytes > peak_live) peak_live = st.live_bytes;
}

/* A free one-shard column may be any 8 bytes: check must catch one that
 * lies inside a free piece (space handed out twice), as it catches two
 * pieces that overlap. */
static void test_column_in_piece(const char *dir) {
  char path[1100];
  tally_store *s = open_store(dir, "overlap.tly", path, sizeof path);
  make(s, "a-name-long-enough-for-a-record-of-some-size:%d", 1, 1);
  drop(s, "a-name-long-enough-for-a-record-of-some-size:%d", 1);
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  EXPECT_OK(tally_store_check(s));
  uint64_t piece = 0;
  for (unsigned u = 4; !piece && u < TALLY__PIECE_CLASSES; u++) /* 32 bytes on */
    piece = (atomic_load(&s->hdr->free_small[u]) >> 32) << 3;
  REQUIRE_OK(piece ? 0 : TALLY_ENOENT); /* the dropped record's piece */
  REQUIRE_OK(tally__lock(s));
  tally__free_now(s, tally__item(TALLY__ITEM_COLUMN, piece + 16, 1));
  tally__unlock(s);
  EXPECT_I64(TALLY_ECORRUPT, tally_store_check(s));
  tally_store_close(s);
}

int main(void) {
  const char *dir = tu_tmpdir("reuse");
  char path[1100], fresh_path[1100];
  setenv("TALLY_GRACE_MS", "0", 1); /* one thread: no window to cover */
  test_column_in_piece(dir);
  tally_store *s = open_store(dir, "churned.tly", path, sizeof path);

  make(s, "round-one/with/a/longer/name:%d", N / 4, 16);
  live_now(s);
  drop(s, "round-one/with/a/longer/name:%d", N / 4);
  settle(s, path, "16 shards, long names, dropped");

  make(s, "r2:%d", N * 3 / 4, 0);
  reshard(s, "r2:%d", N * 3 / 4, 2);
  live_now(s);
  drop(s, "r2:%d", N * 3 / 4);
  settle(s, path, "automatic, resharded, dropped");

  tally_family_options fo = {4, -1, 1, 0}; /* 4 shards, idle 1 s */
  EXPECT_OK(tally_family_define(s, "idle:*", 6, &fo));
  make(s, "idle:%d", N * 2 / 3, 0);
  live_now(s);
  tally_maintain_result mr;
  uint64_t expired = 0;
  for (int64_t t = 1000000; t <= 1004000; t += 1000) { /* seen, then idle 3 s */
    EXPECT_OK(tally_store_maintain(s, t, 1000000, &mr));
    expired += mr.expired;
  }
  EXPECT_I64(N * 2 / 3, expired);
  settle(s, path, "4 shards, expired");

  make(s, "seven-shards:%06d", N / 3, 7);
  live_now(s);
  drop(s, "seven-shards:%06d", N / 3);
  settle(s, path, "7 shards, dropped");

  make(s, "k:%d", N, 0);
  settle(s, path, "final set");
  tally_store_stats st, fst;
  EXPECT_OK(tally_store_stats_get(s, &st));
  tally_store_close(s);

  tally_store *f = open_store(dir, "fresh.tly", fresh_path, sizeof fresh_path);
  make(f, "k:%d", N, 0);
  settle(f, fresh_path, "a fresh store, the final set only");
  EXPECT_OK(tally_store_stats_get(f, &fst));
  tally_store_close(f);

  double ratio = (double)file_bytes(path) / (double)file_bytes(fresh_path);
  printf("test_reuse: churned file %.3fx the fresh one's (used %.3fx; the churn's "
         "largest live set %.3fx the final one's)\n",
         ratio, (double)st.used_bytes / (double)fst.used_bytes,
         (double)peak_live / (double)st.live_bytes);
  EXPECT(peak_live <= st.live_bytes * 11 / 10); /* the test's own premise */
  if (ratio > 1.25) TU_FAIL("churned file %.3fx the fresh one's, over 1.25x", ratio);
  atomic_fetch_add(&tu_checks, 1);
  tu_rmrf(dir);
  return tu_finish("test_reuse");
}
