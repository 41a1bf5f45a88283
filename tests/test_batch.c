/* test_batch.c -- batches and snapshots (src/core/batch.c).
 *
 *  - slot counters: 64 shards, refused where a writer would pick a shard,
 *    never resharded; a batch adds exactly, sums a counter named twice, and
 *    adds nothing at all when any part of it is refused;
 *  - threads: four writers batch {a+1, b+2, c+3} and increment x then y
 *    while a reader takes snapshots: b = 2a, c = 3a and x >= y in every one;
 *  - 64 writer slots: a 65th live thread gets EBUSY; slots of threads that
 *    exited are taken again; the records of threads still running when the
 *    store closes are freed with it (LeakSanitizer checks under ASan);
 *  - processes on a file store: the same invariants with two writer
 *    processes; exact totals at the end;
 *  - SIGKILL: a writer stopped for good in the middle of a batch (two of
 *    three adds made) holds a snapshot up while it lives; once killed, the
 *    waiting snapshot finishes within 100 ms and shows nothing of the batch,
 *    which is rolled back in the cells too; writers killed at random times
 *    never leave a half batch; with no snapshot, upkeep rolls it back, and
 *    a rollup tick before it records;
 *  - idle expiry skips slot counters; compaction keeps their values;
 *  - reset and drop race batches: a batch stores its cells' new values
 *    rather than adding, so a reset subtracts in its own shard: two threads
 *    batch while a third resets, and what the resets removed plus what is
 *    left is every increment; a counter dropped under a batching process
 *    and its space reused leaves the store whole and the new counters
 *    exact.
 */
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"

#include "../src/core/internal.h" /* tally__me: a thread's writer slot */

static char g_dir[1024];

static tally_counter *slot_counter(tally_store *s, const char *name) {
  tally_counter *c = NULL;
  tally_counter_options o = {0, TALLY_POLICY_SLOT};
  REQUIRE_OK(tally_counter_open(s, name, strlen(name), &o, TALLY_COUNTER_CREATE, &c));
  return c;
}

/* ---- snapshots into a small table ------------------------------------------- */

#define SNAP_MAX 8
struct snapv {
  int n;
  char name[SNAP_MAX][16];
  int64_t v[SNAP_MAX];
};

static int snap_one(void *ud, const char *name, size_t len, int64_t value) {
  struct snapv *sv = ud;
  if (sv->n == SNAP_MAX || len >= sizeof sv->name[0]) return 1;
  memcpy(sv->name[sv->n], name, len);
  sv->name[sv->n][len] = 0;
  sv->v[sv->n++] = value;
  return 0;
}

static int snap_count(void *ud, const char *name, size_t len, int64_t value) {
  (void)name, (void)len, (void)value;
  ++*(long *)ud;
  return 0;
}

static int64_t snap_get(const struct snapv *sv, const char *name) {
  for (int i = 0; i < sv->n; i++)
    if (strcmp(sv->name[i], name) == 0) return sv->v[i];
  return 0; /* not yet created */
}

/* b = 2a, c = 3a, x >= y: 0 if they hold. */
static int snap_check(tally_store *s, long *taken) {
  struct snapv sv = {0};
  int rc = tally_store_snapshot(s, "*", 1, snap_one, &sv);
  if (rc) {
    TU_FAIL("snapshot: %s", tally_errmsg());
    return 1;
  }
  int64_t a = snap_get(&sv, "a"), b = snap_get(&sv, "b"), c = snap_get(&sv, "c"),
          x = snap_get(&sv, "x"), y = snap_get(&sv, "y");
  (*taken)++;
  if (b != 2 * a || c != 3 * a || x < y) {
    TU_FAIL("snapshot %ld: a %lld b %lld c %lld x %lld y %lld", *taken, (long long)a,
            (long long)b, (long long)c, (long long)x, (long long)y);
    return 1;
  }
  return 0;
}

/* ---- the rules ------------------------------------------------------------------ */

static void test_rules(void) {
  tally_store *s;
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  tally_counter *a = slot_counter(s, "a"), *b = slot_counter(s, "b"), *p, *q;
  tally_counter_info in;
  EXPECT_OK(tally_counter_info_get(a, &in));
  EXPECT_I64(TALLY_SLOT_SHARDS, in.shards);
  EXPECT_STR("slot", tally_policy_name(in.policy));
  /* the same counter opened again: any shard option but another count */
  EXPECT_OK(tu_counter(s, "a", 0, -1, 0, &p));
  tally_counter_close(p);
  EXPECT_OK(tu_counter(s, "a", TALLY_SHARDS_AUTO, TALLY_POLICY_SLOT, 0, &p));
  tally_counter_close(p);
  EXPECT_RC(TALLY_EMISMATCH, tu_counter(s, "a", 16, -1, 0, &p));
  EXPECT_RC(TALLY_ESHARDS,
            tu_counter(s, "z", 16, TALLY_POLICY_SLOT, TALLY_COUNTER_CREATE, &p));
  EXPECT_RC(TALLY_EPOLICY, tally_counter_reshard(a, 4));
  EXPECT_RC(TALLY_EPOLICY, tally_counter_incr_shard(a, 0, 1));
  EXPECT_RC(TALLY_EPOLICY, tally_counter_incr_key(a, "k", 1, 1));

  /* plain increments are batches of one */
  EXPECT_OK(tally_counter_incr(a, 5));
  EXPECT_OK(tally_counter_incr(a, -2));
  EXPECT_I64(3, tu_value(a));

  tally_counter *ab[3] = {a, b, a};
  int64_t d[3] = {10, 20, 30};
  EXPECT_OK(tally_batch_incr(s, ab, d, 3)); /* a twice: 40 */
  EXPECT_I64(43, tu_value(a));
  EXPECT_I64(20, tu_value(b));
  /* a twice through two handles: one cell, so still the sum */
  tally_counter *a2;
  REQUIRE_OK(tally_counter_open(s, "a", 1, NULL, 0, &a2));
  tally_counter *aa2[2] = {a, a2};
  int64_t d2[2] = {1, 100};
  EXPECT_OK(tally_batch_incr(s, aa2, d2, 2));
  EXPECT_I64(144, tu_value(a));
  tally_counter_close(a2);

  /* refused batches add nothing */
  REQUIRE_OK(tu_counter(s, "plain", 4, TALLY_POLICY_THREAD, TALLY_COUNTER_CREATE, &q));
  tally_counter *mixed[2] = {a, q};
  EXPECT_RC(TALLY_EPOLICY, tally_batch_incr(s, mixed, d, 2));
  EXPECT_RC(TALLY_EINVAL, tally_batch_incr(s, ab, d, 0));
  EXPECT_RC(TALLY_EINVAL, tally_batch_incr(s, NULL, d, 1));
  int64_t big[2] = {1, INT64_C(1) << 62};
  tally_counter *ba[2] = {a, b};
  EXPECT_RC(TALLY_ERANGE, tally_batch_incr(s, ba, big, 2));
  int64_t wrap[3] = {INT64_MAX, 1, 0};
  tally_counter *aa[3] = {a, a, b};
  EXPECT_RC(TALLY_ERANGE, tally_batch_incr(s, aa, wrap, 3));
  tally_counter *many[TALLY_BATCH_MAX + 1];
  int64_t ones[TALLY_BATCH_MAX + 1];
  for (int i = 0; i <= TALLY_BATCH_MAX; i++) {
    char name[16];
    snprintf(name, sizeof name, "m%d", i);
    many[i] = slot_counter(s, name);
    ones[i] = 1;
  }
  EXPECT_RC(TALLY_EINVAL, tally_batch_incr(s, many, ones, TALLY_BATCH_MAX + 1));
  EXPECT_OK(tally_batch_incr(s, many, ones, TALLY_BATCH_MAX));
  EXPECT_I64(144, tu_value(a));
  EXPECT_I64(20, tu_value(b));
  EXPECT_I64(0, tu_value(q));
  EXPECT_I64(1, tu_value(many[TALLY_BATCH_MAX - 1]));
  EXPECT_I64(0, tu_value(many[TALLY_BATCH_MAX]));

  /* a snapshot holds slot and plain counters, filtered by the pattern */
  EXPECT_OK(tally_counter_incr(q, 7));
  long all = 0;
  EXPECT_OK(tally_store_snapshot(s, "ignored", 0, snap_count, &all)); /* plen 0: all */
  EXPECT_I64(3 + TALLY_BATCH_MAX + 1, all);
  struct snapv sv = {0};
  EXPECT_OK(tally_store_snapshot(s, "?", 1, snap_one, &sv));
  EXPECT_I64(2, sv.n);
  EXPECT_I64(144, snap_get(&sv, "a"));
  EXPECT_I64(20, snap_get(&sv, "b"));
  sv.n = 0;
  EXPECT_OK(tally_store_snapshot(s, "pla*", 4, snap_one, &sv));
  EXPECT_I64(1, sv.n);
  EXPECT_I64(7, snap_get(&sv, "plain"));
  /* a dropped counter leaves snapshots; its handle says so */
  EXPECT_OK(tally_store_drop(s, "b", 1));
  sv.n = 0;
  EXPECT_OK(tally_store_snapshot(s, "?", 1, snap_one, &sv));
  EXPECT_I64(1, sv.n);
  EXPECT_RC(TALLY_EDROPPED, tally_batch_incr(s, ba, d, 2));
  EXPECT_I64(144, tu_value(a));

  for (int i = 0; i <= TALLY_BATCH_MAX; i++) tally_counter_close(many[i]);
  tally_counter_close(q);
  tally_counter_close(a);
  tally_counter_close(b);
  tally_store_close(s);
}

/* ---- threads -------------------------------------------------------------------- */

struct writer {
  tally_store *s;
  tally_counter *abc[3], *x, *y;
  atomic_bool *stop;
  long long rounds;
};

static void *writer_main(void *ud) {
  struct writer *w = ud;
  static const int64_t d[3] = {1, 2, 3};
  double end = tu_now() + 10;
  while (!atomic_load(w->stop) && tu_now() < end) {
    if (tally_batch_incr(w->s, w->abc, d, 3) || tally_counter_incr(w->x, 1) ||
        tally_counter_incr(w->y, 1)) {
      TU_FAIL("writer: %s", tally_errmsg());
      break;
    }
    w->rounds++;
  }
  return NULL;
}

static void test_threads(void) {
  enum { W = 4 };
  tally_store *s;
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  struct writer w[W];
  atomic_bool stop = false;
  pthread_t th[W];
  tally_counter *abc[3] = {slot_counter(s, "a"), slot_counter(s, "b"),
                           slot_counter(s, "c")};
  tally_counter *x = slot_counter(s, "x"), *y = slot_counter(s, "y");
  for (int i = 0; i < W; i++) {
    w[i] = (struct writer){s, {abc[0], abc[1], abc[2]}, x, y, &stop, 0};
    pthread_create(&th[i], NULL, writer_main, &w[i]);
  }
  long taken = 0;
  double end = tu_now() + 1.0;
  while (tu_now() < end && snap_check(s, &taken) == 0) {}
  atomic_store(&stop, true);
  long long rounds = 0;
  for (int i = 0; i < W; i++) {
    pthread_join(th[i], NULL);
    rounds += w[i].rounds;
  }
  EXPECT(taken > 100);
  EXPECT(rounds > 1000);
  EXPECT_I64(rounds, tu_value(abc[0]));
  EXPECT_I64(2 * rounds, tu_value(abc[1]));
  EXPECT_I64(3 * rounds, tu_value(abc[2]));
  EXPECT_I64(rounds, tu_value(y));
  printf("  %d threads: %lld rounds, %ld snapshots, every one consistent\n", W, rounds,
         taken);
  for (int i = 0; i < 3; i++) tally_counter_close(abc[i]);
  tally_counter_close(x);
  tally_counter_close(y);
  tally_store_close(s);
}

/* ---- 64 slots --------------------------------------------------------------------- */

struct holder {
  tally_counter *c;
  pthread_barrier_t *all_tried;
  int rc;
};

static void *holder_main(void *ud) {
  struct holder *h = ud;
  h->rc = tally_counter_incr(h->c, 1);
  pthread_barrier_wait(h->all_tried); /* every thread holds its slot till now */
  return NULL;
}

static void test_slots_run_out(void) {
  enum { T = TALLY_SLOT_SHARDS + 1 };
  tally_store *s;
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  tally_counter *c = slot_counter(s, "c");
  pthread_barrier_t bar;
  pthread_barrier_init(&bar, NULL, T);
  static struct holder h[T];
  pthread_t th[T];
  for (int i = 0; i < T; i++) {
    h[i] = (struct holder){c, &bar, -1};
    pthread_create(&th[i], NULL, holder_main, &h[i]);
  }
  int ok = 0, busy = 0;
  for (int i = 0; i < T; i++) {
    pthread_join(th[i], NULL);
    ok += h[i].rc == 0;
    busy += h[i].rc == TALLY_EBUSY;
  }
  EXPECT_I64(TALLY_SLOT_SHARDS, ok);
  EXPECT_I64(1, busy);
  EXPECT_I64(TALLY_SLOT_SHARDS, tu_value(c));
  /* the threads exited: their slots are free again */
  pthread_barrier_destroy(&bar);
  pthread_barrier_init(&bar, NULL, 1);
  h[0] = (struct holder){c, &bar, -1};
  pthread_create(&th[0], NULL, holder_main, &h[0]);
  pthread_join(th[0], NULL);
  EXPECT_OK(h[0].rc);
  pthread_barrier_destroy(&bar);
  tally_counter_close(c);
  tally_store_close(s);
}

/* n threads batch once on a new store, then it closes.
 *  - linger: they still run at the close. Their slot records are kept,
 *    reachable, as orphans (their threads' exit runs no destructor for a
 *    deleted key), and freed at a later close once their threads are gone
 *    (under ASan, LeakSanitizer fails the test if they leak).
 *  - else they exit as it closes (their destructor and the close at once):
 *    a record was freed by both, or used after the close freed it (glibc
 *    may run a destructor already fetched when the key is deleted); under
 *    ASan any use after free fails. */
struct lingerer {
  tally_counter *c;
  pthread_barrier_t *batched, *closed; /* closed: NULL, exit at once */
  int rc;
};

static void *lingerer_main(void *ud) {
  struct lingerer *l = ud;
  l->rc = tally_counter_incr(l->c, 1);
  pthread_barrier_wait(l->batched);
  if (l->closed) pthread_barrier_wait(l->closed); /* exits after the store closed */
  return NULL;
}

static void close_with_writers(int n, bool linger) {
  tally_store *s;
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  tally_counter *c = slot_counter(s, "c");
  pthread_barrier_t batched, closed;
  pthread_barrier_init(&batched, NULL, (unsigned)n + 1);
  pthread_barrier_init(&closed, NULL, (unsigned)n + 1);
  struct lingerer l[8];
  pthread_t th[8];
  for (int i = 0; i < n; i++) {
    l[i] = (struct lingerer){c, &batched, linger ? &closed : NULL, -1};
    pthread_create(&th[i], NULL, lingerer_main, &l[i]);
  }
  pthread_barrier_wait(&batched);
  if (linger) EXPECT_I64(n, tu_value(c));
  tally_counter_close(c);
  tally_store_close(s);
  if (linger) pthread_barrier_wait(&closed);
  for (int i = 0; i < n; i++) {
    pthread_join(th[i], NULL);
    EXPECT_OK(l[i].rc);
  }
  pthread_barrier_destroy(&batched);
  pthread_barrier_destroy(&closed);
}

static void test_close_with_live_writers(void) {
  close_with_writers(3, true);
}

static void test_close_as_writers_exit(void) {
  long rounds = 0;
  for (double end = tu_now() + 1.5; tu_now() < end; rounds++)
    close_with_writers(8, false);
  printf("  %ld closes as 8 writer threads exit\n", rounds);
}

/* One process, two handles on one store: closing one gave back the writer
 * slots of every thread of the process, so a thread of the other handle
 * and a new one shared a slot (torn snapshots, lost increments). */
struct two {
  tally_store *s;
  tally_counter *c;
  pthread_barrier_t *leased, *closed;
  uint32_t slot;
  int rc;
};

static void *two_main(void *ud) {
  struct two *t = ud;
  t->rc = tally_counter_incr(t->c, 1); /* leases this thread's slot */
  t->slot = tally__me.wslot;
  if (t->leased) pthread_barrier_wait(t->leased);
  if (t->closed) pthread_barrier_wait(t->closed);
  return NULL;
}

static void test_two_handles(void) {
  char spec[1200];
  tu_spec(spec, sizeof spec, NULL, 0, g_dir, "two.tly");
  tally_store *s1, *s2;
  REQUIRE_OK(tally_store_open(spec, NULL, &s1));
  REQUIRE_OK(tally_store_open(spec, NULL, &s2));
  tally_counter *c1 = slot_counter(s1, "one"), *c2 = slot_counter(s2, "two");
  pthread_barrier_t leased, closed;
  pthread_barrier_init(&leased, NULL, 2);
  pthread_barrier_init(&closed, NULL, 2);
  struct two a = {s2, c2, &leased, &closed, 0, -1}, b = {s2, c2, NULL, NULL, 0, -1};
  pthread_t ta, tb;
  pthread_create(&ta, NULL, two_main, &a);
  pthread_barrier_wait(&leased);
  EXPECT_OK(tally_counter_incr(c1, 1)); /* this thread leases a slot through s1 */
  tally_counter_close(c1);
  tally_store_close(s1);
  pthread_create(&tb, NULL, two_main, &b); /* a's slot is still a's */
  pthread_join(tb, NULL);
  pthread_barrier_wait(&closed);
  pthread_join(ta, NULL);
  EXPECT_OK(a.rc);
  EXPECT_OK(b.rc);
  printf("  two handles, one closed: the other's thread kept slot %u, a new one got %u\n",
         a.slot, b.slot);
  EXPECT(a.slot != b.slot);
  EXPECT_I64(2, tu_value(c2));
  pthread_barrier_destroy(&leased);
  pthread_barrier_destroy(&closed);
  tally_counter_close(c2);
  tally_store_close(s2);
}

/* Two resets of one slot counter at once both read the whole value and
 * both took it: the amounts reported added up to twice what it held. */
struct resetter {
  tally_counter *c;
  pthread_barrier_t *go;
  int64_t removed;
  int rc;
};

static void *resetter_main(void *ud) {
  struct resetter *r = ud;
  pthread_barrier_wait(r->go);
  r->rc = tally_counter_reset(r->c, &r->removed);
  return NULL;
}

static void test_resets_at_once(void) {
  tally_store *s;
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  tally_counter *c = slot_counter(s, "r");
  int doubled = 0, rounds = 0;
  for (double end = tu_now() + 1; tu_now() < end && rounds < 5000; rounds++) {
    EXPECT_OK(tally_counter_incr(c, 1000));
    pthread_barrier_t go;
    pthread_barrier_init(&go, NULL, 2);
    struct resetter r[2] = {{c, &go, 0, -1}, {c, &go, 0, -1}};
    pthread_t th[2];
    for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, resetter_main, &r[i]);
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    pthread_barrier_destroy(&go);
    EXPECT_OK(r[0].rc);
    EXPECT_OK(r[1].rc);
    if (r[0].removed + r[1].removed != 1000 || tu_value(c) != 0) doubled++;
  }
  printf("  %d rounds of two resets at once: %d took the amount twice\n", rounds,
         doubled);
  EXPECT_I64(0, doubled);
  tally_counter_close(c);
  tally_store_close(s);
}

/* ---- processes -------------------------------------------------------------------- */

struct page {
  atomic_llong rounds[4];
  atomic_int ready, stop;
};

/* A child: open the store, then rounds until stopped (or killed). */
static pid_t spawn_writer(const char *spec, struct page *pg, int i, const char *stall) {
  fflush(NULL);
  pid_t pid = fork();
  if (pid != 0) return pid;
  if (stall) setenv("TALLY_TEST_BATCH_STALL", stall, 1);
  static const int64_t d[3] = {1, 2, 3};
  tally_store *s;
  tally_counter *abc[3], *x, *y;
  tally_counter_options o = {0, TALLY_POLICY_SLOT};
  if (tally_store_open(spec, NULL, &s) ||
      tally_counter_open(s, "a", 1, &o, TALLY_COUNTER_CREATE, &abc[0]) ||
      tally_counter_open(s, "b", 1, &o, TALLY_COUNTER_CREATE, &abc[1]) ||
      tally_counter_open(s, "c", 1, &o, TALLY_COUNTER_CREATE, &abc[2]) ||
      tally_counter_open(s, "x", 1, &o, TALLY_COUNTER_CREATE, &x) ||
      tally_counter_open(s, "y", 1, &o, TALLY_COUNTER_CREATE, &y))
    _exit(2);
  atomic_fetch_add(&pg->ready, 1);
  double end = tu_now() + 20;
  while (!atomic_load_explicit(&pg->stop, memory_order_relaxed) && tu_now() < end) {
    if (tally_batch_incr(s, abc, d, 3) || tally_counter_incr(x, 1) ||
        tally_counter_incr(y, 1))
      _exit(3);
    atomic_fetch_add_explicit(&pg->rounds[i], 1, memory_order_relaxed);
  }
  tally_store_close(s);
  _exit(0);
}

static void test_processes(void) {
  char spec[1200], path[1100];
  tu_spec(spec, sizeof spec, path, sizeof path, g_dir, "procs.tly");
  tally_store *s;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  struct page *pg = tu_shared(sizeof *pg);
  pid_t pids[2];
  for (int i = 0; i < 2; i++) pids[i] = spawn_writer(spec, pg, i, NULL);
  while (atomic_load(&pg->ready) < 2) usleep(1000);
  long taken = 0;
  double end = tu_now() + 1.5;
  while (tu_now() < end && snap_check(s, &taken) == 0) {}
  atomic_store(&pg->stop, 1);
  for (int i = 0; i < 2; i++) {
    int st;
    waitpid(pids[i], &st, 0);
    EXPECT(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  }
  long long rounds = atomic_load(&pg->rounds[0]) + atomic_load(&pg->rounds[1]);
  struct snapv sv = {0};
  EXPECT_OK(tally_store_snapshot(s, "*", 1, snap_one, &sv));
  EXPECT_I64(rounds, snap_get(&sv, "a"));
  EXPECT_I64(3 * rounds, snap_get(&sv, "c"));
  EXPECT_I64(rounds, snap_get(&sv, "y"));
  EXPECT(taken > 50);
  printf("  2 processes: %lld rounds, %ld snapshots, every one consistent\n", rounds,
         taken);
  EXPECT_OK(tally_store_check(s));
  munmap(pg, sizeof *pg);
  tally_store_close(s);
}

/* ---- SIGKILL ---------------------------------------------------------------------- */

struct waiter {
  tally_store *s;
  struct snapv sv;
  atomic_int done;
  double done_at;
  int rc;
};

static void *waiter_main(void *ud) {
  struct waiter *w = ud;
  w->rc = tally_store_snapshot(w->s, "*", 1, snap_one, &w->sv);
  w->done_at = tu_now();
  atomic_store(&w->done, 1);
  return NULL;
}

static void test_killed_mid_batch(void) {
  char spec[1200], path[1100];
  tu_spec(spec, sizeof spec, path, sizeof path, g_dir, "kill.tly");
  tally_store *s;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  tally_counter *a = slot_counter(s, "a"), *b = slot_counter(s, "b"),
                *c = slot_counter(s, "c");
  struct page *pg = tu_shared(sizeof *pg);
  /* stops for good after two of its first batch's three adds */
  pid_t pid = spawn_writer(spec, pg, 0, "2");
  double until = tu_now() + 10;
  while (tu_value(b) != 2 && tu_now() < until) usleep(1000);
  EXPECT_I64(1, tu_value(a)); /* plain reads see the half batch... */
  EXPECT_I64(2, tu_value(b));
  EXPECT_I64(0, tu_value(c));
  struct waiter w = {.s = s};
  pthread_t th;
  pthread_create(&th, NULL, waiter_main, &w);
  usleep(200000);
  EXPECT(!atomic_load(&w.done)); /* ...a snapshot waits for the live writer */
  double killed = tu_now();
  kill(pid, SIGKILL);
  pthread_join(th, NULL);
  int st;
  waitpid(pid, &st, 0);
  EXPECT(WIFSIGNALED(st));
  EXPECT_OK(w.rc);
  double stalled = w.done_at - killed;
  EXPECT(stalled < 0.1);
  EXPECT_I64(0, snap_get(&w.sv, "a")); /* rolled back, wholly */
  EXPECT_I64(0, snap_get(&w.sv, "b"));
  EXPECT_I64(0, snap_get(&w.sv, "c"));
  EXPECT_I64(0, tu_value(a));
  EXPECT_I64(0, tu_value(b));
  printf("  a writer killed mid-batch: the waiting snapshot went on %.1f ms after the "
         "kill, the batch rolled back\n",
         stalled * 1e3);

  /* writers killed at random moments: never half a batch */
  uint64_t rng = 0x5eed;
  long taken = 0;
  double worst = 0;
  for (int round = 0; round < 12; round++) {
    atomic_store(&pg->ready, 0);
    pid = spawn_writer(spec, pg, 1, NULL);
    while (!atomic_load(&pg->ready)) usleep(500);
    usleep((useconds_t)(2000 + tu_rng(&rng) % 30000));
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
    double t0 = tu_now();
    if (snap_check(s, &taken)) break;
    if (tu_now() - t0 > worst) worst = tu_now() - t0;
  }
  EXPECT(worst < 0.1);
  long long acked = atomic_load(&pg->rounds[1]);
  int64_t va = tu_value(a);
  EXPECT(va >= acked && va <= acked + 12); /* a killed writer's last batch may land */
  EXPECT_I64(2 * va, tu_value(b));
  EXPECT_I64(3 * va, tu_value(c));
  printf(
      "  12 writers killed at random: %lld batches acknowledged, %lld counted, slowest "
      "snapshot after a kill %.1f ms\n",
      acked, (long long)va, worst * 1e3);
  EXPECT_OK(tally_store_check(s));
  munmap(pg, sizeof *pg);
  tally_counter_close(a);
  tally_counter_close(b);
  tally_counter_close(c);
  tally_store_close(s);
}

/* A dead writer's half batch with no snapshot to come: upkeep
 * (tally_store_maintain) rolls it back, and so does a rollup tick before
 * it records the values: history never holds it. */
static int64_t g_rolled_a = -1;
static void rolled(void *ud, const char *name, size_t len, const tally_rollup *r) {
  (void)ud;
  if (len == 1 && name[0] == 'a') g_rolled_a = r->value;
}

static void test_killed_no_snapshot(void) {
  for (int by_tick = 0; by_tick < 2; by_tick++) {
    char spec[1200], path[1100], file[32];
    snprintf(file, sizeof file, "settle%d.tly", by_tick);
    tu_spec(spec, sizeof spec, path, sizeof path, g_dir, file);
    tally_store *s;
    REQUIRE_OK(tally_store_open(spec, NULL, &s));
    tally_counter *a = slot_counter(s, "a"), *b = slot_counter(s, "b");
    struct page *pg = tu_shared(sizeof *pg);
    pid_t pid = spawn_writer(spec, pg, 0, "2"); /* stops after a+1, b+2 */
    double until = tu_now() + 10;
    while (tu_value(b) != 2 && tu_now() < until) usleep(1000);
    kill(pid, SIGKILL);
    int st;
    waitpid(pid, &st, 0);
    EXPECT(WIFSIGNALED(st));
    EXPECT_I64(1, tu_value(a)); /* dead, not yet rolled back */
    EXPECT_I64(2, tu_value(b));
    if (by_tick) {
      tally_schedule *sch = NULL;
      tally_tick_result r;
      REQUIRE_OK(tally_schedule_new(s, "*", 1, 1000, NULL, 0, &sch));
      EXPECT_OK(tally_schedule_tick(sch, 5000, rolled, NULL, &r));
      EXPECT_I64(TALLY_TICK_RAN, r.status);
      EXPECT_I64(0, g_rolled_a);
      tally_schedule_free(sch);
    } else {
      EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
    }
    EXPECT_I64(0, tu_value(a));
    EXPECT_I64(0, tu_value(b));
    EXPECT_OK(tally_store_check(s));
    munmap(pg, sizeof *pg);
    tally_counter_close(a);
    tally_counter_close(b);
    tally_store_close(s);
  }
}

/* A writer whose process execs while it is stopped mid-batch: the thread
 * that exec'd takes the leader's tid, and the pid and start time stay, so
 * only the file let go (close-on-exec) says the writer is gone. Upkeep
 * rolls its half batch back. */
static void *exec_soon(void *arg) {
  (void)arg;
  usleep(100000); /* the main thread is in its batch by then */
  execl("/bin/sleep", "sleep", "20", (char *)NULL);
  _exit(127);
}

/* Is process pid asleep in sleep(1)'s nanosleep, its exec done? An exec
 * names the process before it closes its close-on-exec files, and the
 * store's attach lock goes with the last reference to its file, which the
 * kernel drops only as the exec returns to user space. */
static bool asleep_in_sleep(pid_t pid) {
  char p[64], line[64] = "";
  snprintf(p, sizeof p, "/proc/%d/syscall", (int)pid);
  FILE *f = fopen(p, "r");
  if (!f) return true; /* no ptrace access to it here: the comm check only */
  if (!fgets(line, sizeof line, f)) line[0] = 0;
  fclose(f);
  long nr = strtol(line, NULL, 10);
#ifdef SYS_nanosleep
  if (nr == SYS_nanosleep) return true;
#endif
  return nr == SYS_clock_nanosleep;
}

static void test_writer_execs(void) {
  char spec[1200], path[1100];
  tu_spec(spec, sizeof spec, path, sizeof path, g_dir, "exec.tly");
  tally_store *s;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  tally_counter *a = slot_counter(s, "a"), *b = slot_counter(s, "b");
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    tally_store *cs;
    if (tally_store_open(spec, NULL, &cs)) _exit(2);
    tally_counter *ab[2] = {slot_counter(cs, "a"), slot_counter(cs, "b")};
    static const int64_t d[2] = {5, 5};
    pthread_t th;
    pthread_create(&th, NULL, exec_soon, NULL);
    setenv("TALLY_TEST_BATCH_STALL", "1", 1); /* stops after a+5 */
    tally_batch_incr(cs, ab, d, 2);
    _exit(3);
  }
  char proc[64], comm[32] = "";
  snprintf(proc, sizeof proc, "/proc/%d/comm", (int)pid);
  for (double end = tu_now() + 10; strncmp(comm, "sleep", 5) != 0 && tu_now() < end;) {
    usleep(2000);
    FILE *f = fopen(proc, "r");
    if (f) {
      if (!fgets(comm, sizeof comm, f)) comm[0] = 0;
      fclose(f);
    }
  }
  EXPECT(strncmp(comm, "sleep", 5) == 0);
  for (double end = tu_now() + 10; !asleep_in_sleep(pid) && tu_now() < end;) usleep(2000);
  EXPECT(asleep_in_sleep(pid));
  EXPECT_I64(5, tu_value(a)); /* the half batch, its writer gone with the exec */
  EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
  EXPECT_I64(0, tu_value(a));
  EXPECT_I64(0, tu_value(b));
  struct snapv sv = {0};
  if (tu_value(a) == 0) /* else it would wait for the writer for good */
    EXPECT_OK(tally_store_snapshot(s, "*", 1, snap_one, &sv));
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  EXPECT_OK(tally_store_check(s));
  tally_counter_close(a);
  tally_counter_close(b);
  tally_store_close(s);
}

/* ---- expiry and compaction -------------------------------------------------------- */

static void test_expiry_and_compaction(void) {
  char spec[1200], path[1100];
  tu_spec(spec, sizeof spec, path, sizeof path, g_dir, "keep.tly");
  tally_store *s;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  tally_family_options fo = {0};
  fo.idle_s = 1;
  fo.policy = -1;
  EXPECT_OK(tally_family_define(s, "h:*", 3, &fo));
  tally_counter *a = slot_counter(s, "h:a");
  tally_counter *p;
  REQUIRE_OK(tu_counter(s, "h:p", 2, TALLY_POLICY_THREAD, TALLY_COUNTER_CREATE, &p));
  EXPECT_OK(tally_counter_incr(a, 9));
  EXPECT_OK(tally_counter_incr(p, 9));
  tally_maintain_result mr;
  for (int64_t t = 0; t < 10; t++)
    EXPECT_OK(tally_store_maintain(s, t * 1000, 1u << 20, &mr));
  struct snapv sv = {0};
  EXPECT_OK(tally_store_snapshot(s, "h:*", 3, snap_one, &sv));
  EXPECT_I64(1, sv.n); /* the plain counter expired, the slot counter stayed */
  EXPECT_I64(9, snap_get(&sv, "h:a"));
  tally_counter_close(a);
  tally_counter_close(p);
  tally_store_close(s);

  EXPECT_OK(tally_store_compact(path, 0, NULL, NULL));
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  sv.n = 0;
  EXPECT_OK(tally_store_snapshot(s, "h:*", 3, snap_one, &sv));
  EXPECT_I64(9, snap_get(&sv, "h:a"));
  a = slot_counter(s, "h:a");
  EXPECT_OK(tally_counter_incr(a, 1));
  EXPECT_I64(10, tu_value(a));
  sv.n = 0;
  EXPECT_OK(tally_store_snapshot(s, "h:*", 3, snap_one, &sv));
  EXPECT_I64(10, snap_get(&sv, "h:a"));
  tally_counter_close(a);
  tally_store_close(s);
}

struct batcher {
  tally_store *s;
  tally_counter *c[2];
  atomic_bool *stop;
  long long added; /* batches acknowledged: c[0] + 1, c[1] + 2 each */
};

static void *batcher_main(void *ud) {
  struct batcher *b = ud;
  const int64_t d[2] = {1, 2};
  double end = tu_now() + 10;
  while (!atomic_load(b->stop) && tu_now() < end) {
    int rc = tally_batch_incr(b->s, b->c, d, 2);
    if (rc) {
      TU_FAIL("batch: %s", tally_errmsg());
      return NULL;
    }
    b->added++;
  }
  return NULL;
}

static void test_reset_and_drop_race(void) {
  tally_store *s;
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  atomic_bool stop = false;
  struct batcher w[2];
  pthread_t th[2];
  for (int t = 0; t < 2; t++) {
    w[t] = (struct batcher){.s = s, .stop = &stop};
    w[t].c[0] = slot_counter(s, "r:a");
    w[t].c[1] = slot_counter(s, "r:b");
    pthread_create(&th[t], NULL, batcher_main, &w[t]);
  }
  tally_counter *a = slot_counter(s, "r:a"), *b = slot_counter(s, "r:b");
  int64_t gone_a = 0, gone_b = 0, got;
  int resets = 0;
  for (double end = tu_now() + 1.0; tu_now() < end; resets++) {
    EXPECT_OK(tally_counter_reset(a, &got));
    gone_a += got;
    EXPECT_OK(tally_counter_reset(b, &got));
    gone_b += got;
  }
  atomic_store(&stop, true);
  for (int t = 0; t < 2; t++) pthread_join(th[t], NULL);
  long long n = w[0].added + w[1].added;
  EXPECT(n > 0);
  EXPECT_I64(n, gone_a + tu_value(a));
  EXPECT_I64(2 * n, gone_b + tu_value(b));
  printf("reset race: %d resets of each while %lld batches landed; exact\n", resets, n);

  for (int t = 0; t < 2; t++) {
    tally_counter_close(w[t].c[0]);
    tally_counter_close(w[t].c[1]);
  }
  tally_counter_close(a);
  tally_counter_close(b);
  tally_store_close(s);

  /* dropped under a batching process (which passes grace steps itself, so
   * its space is reused while it runs), then that space reused */
  char spec[1200];
  tu_spec(spec, sizeof spec, NULL, 0, g_dir, "drop.tly");
  setenv("TALLY_GRACE_MS", "0", 1);
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  tally_counter_close(slot_counter(s, "d:a"));
  tally_counter_close(slot_counter(s, "d:b"));
  _Atomic long long *shared = tu_shared(4096);
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) { /* [0] stop, [1] batches, [2] EDROPPED seen */
    tally_store *cs;
    tally_store_close(s); /* the parent's, copied: it would hold reuse back */
    if (tally_store_open(spec, NULL, &cs)) _exit(2);
    tally_counter *cc[2] = {slot_counter(cs, "d:a"), slot_counter(cs, "d:b")};
    const int64_t d[2] = {1, 2};
    for (long k = 0; !atomic_load(&shared[0]) && k < 50000000; k++) {
      int rc = tally_batch_incr(cs, cc, d, 2);
      if (rc == TALLY_EDROPPED)
        atomic_fetch_add(&shared[2], 1);
      else if (rc)
        _exit(3);
      else
        atomic_fetch_add(&shared[1], 1);
      if (k % 1024 == 0) (void)tally_store_maintain(cs, 0, 0, NULL);
    }
    _exit(0);
  }
  while (atomic_load(&shared[1]) < 10000) usleep(1000);
  EXPECT_OK(tally_store_drop(s, "d:a", 3));
  uint64_t reused0;
  tally_store_stats st;
  EXPECT_OK(tally_store_stats_get(s, &st));
  reused0 = st.reused_bytes;
  for (int i = 0; i < 200; i++) { /* reuse what the drop left */
    char nm[32];
    tally_counter *f;
    usleep(500);
    EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
    snprintf(nm, sizeof nm, "fill:%d", i);
    f = slot_counter(s, nm);
    EXPECT_OK(tally_counter_incr(f, i));
    tally_counter_close(f);
  }
  atomic_store(&shared[0], 1);
  int wst;
  waitpid(pid, &wst, 0);
  EXPECT(WIFEXITED(wst) && WEXITSTATUS(wst) == 0);
  EXPECT(atomic_load(&shared[2]) > 0);
  EXPECT_OK(tally_store_stats_get(s, &st));
  EXPECT(st.reused_bytes > reused0);
  EXPECT_I64(0, tally_store_check(s));
  for (int i = 0; i < 200; i++) {
    char nm[32];
    tally_counter *f;
    snprintf(nm, sizeof nm, "fill:%d", i);
    f = slot_counter(s, nm);
    EXPECT_I64(i, tu_value(f));
    tally_counter_close(f);
  }
  printf("drop race: %lld batches, %lld refused as dropped, the space reused; whole\n",
         (long long)atomic_load(&shared[1]), (long long)atomic_load(&shared[2]));
  munmap((void *)shared, 4096);
  tally_store_close(s);
}

/* Snapshots while another process creates counters k:I:a, k:I:b, k:I:c
 * and batches {+1, +2, +3} over them once, I = 0, 1, ...: a snapshot's walk
 * finds some new counters and passes others by before they are there, so
 * it listed c with the batch and not a (1485 halves in 247 snapshots, in
 * a helper's run). Each triple must be absent or whole. */
#define NTRI 3000
static int64_t g_tri[NTRI][3];

static int tri_one(void *ud, const char *name, size_t len, int64_t value) {
  (void)ud;
  char buf[64];
  int i;
  char m;
  if (len >= sizeof buf) return 0;
  memcpy(buf, name, len);
  buf[len] = 0;
  if (sscanf(buf, "k:%d:%c", &i, &m) == 2 && i >= 0 && i < NTRI && m >= 'a' && m <= 'c')
    g_tri[i][m - 'a'] = value;
  return 0;
}

static void test_snapshot_while_creating(void) {
  char spec[1200];
  tu_spec(spec, sizeof spec, NULL, 0, g_dir, "creating.tly");
  tally_store *s;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  for (int i = 0; i < 20000; i++) { /* a larger index: a longer walk */
    char nm[32];
    snprintf(nm, sizeof nm, "fill:%d", i);
    tally_counter_close(slot_counter(s, nm));
  }
  atomic_int *go = tu_shared(sizeof *go);
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    alarm(60);
    tally_store *w;
    static const int64_t d[3] = {1, 2, 3};
    if (tally_store_open(spec, NULL, &w)) _exit(2);
    while (!atomic_load(go)) usleep(100);
    for (int i = 0; i < NTRI; i++) {
      tally_counter *c[3];
      for (int k = 0; k < 3; k++) {
        char nm[32];
        snprintf(nm, sizeof nm, "k:%d:%c", i, 'a' + k);
        if (!(c[k] = slot_counter(w, nm))) _exit(3);
      }
      if (tally_batch_incr(w, c, d, 3)) _exit(4);
      for (int k = 0; k < 3; k++) tally_counter_close(c[k]);
      usleep(50);
    }
    tally_store_close(w);
    _exit(0);
  }
  atomic_store(go, 1);
  long taken = 0, halves = 0;
  int st = 0;
  bool reaped = false;
  for (double end = tu_now() + 20; tu_now() < end && !reaped; taken++) {
    memset(g_tri, 0, sizeof g_tri);
    EXPECT_OK(tally_store_snapshot(s, "k:*", 3, tri_one, NULL));
    for (int i = 0; i < NTRI; i++) {
      const int64_t *v = g_tri[i];
      if (!(v[0] == 0 && v[1] == 0 && v[2] == 0) &&
          !(v[0] == 1 && v[1] == 2 && v[2] == 3) && halves++ < 3)
        printf("  snapshot %ld: k:%d: a %lld b %lld c %lld\n", taken, i, (long long)v[0],
               (long long)v[1], (long long)v[2]);
    }
    reaped = waitpid(pid, &st, WNOHANG) == pid;
  }
  if (!reaped) {
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
  }
  printf("  %ld snapshots while counters were created and batched: %ld half batches\n",
         taken, halves);
  EXPECT(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  EXPECT_I64(0, halves);
  tally_store_close(s);
}

int main(void) {
  snprintf(g_dir, sizeof g_dir, "%s", tu_tmpdir("batch"));
  double t0 = tu_now();
  test_rules();
  test_threads();
  test_slots_run_out();
  test_close_with_live_writers();
  test_close_as_writers_exit();
  test_two_handles();
  test_resets_at_once();
  test_snapshot_while_creating();
  test_processes();
  test_killed_mid_batch();
  test_killed_no_snapshot();
  test_writer_execs();
  test_expiry_and_compaction();
  test_reset_and_drop_race();
  printf("total %.2f s\n", tu_now() - t0);
  tu_rmrf(g_dir);
  return tu_finish("test_batch");
}
