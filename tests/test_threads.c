/* test_threads.c -- many threads on one counter: nothing lost, nothing doubled.
 *
 * Each phase runs writer threads for a bounded time and count, every writer
 * summing the deltas of the increments that returned 0; the counter must
 * then hold exactly that total (plus what resets removed). Runs on a memory
 * store and on a file store. Meant for the TSan build too.
 */
#include <pthread.h>
#include <unistd.h>

#include "testutil.h"

#define NWRITERS  4
#define MAX_ITERS 4000000
static double g_phase_secs = 0.8;

typedef struct shared {
  tally_store *s;
  tally_counter *c; /* shared handle (even writers use it) */
  const char *name;
  int policy;
  uint32_t shards;
  atomic_int stop;
  atomic_llong started; /* sum of deltas about to be added */
  atomic_llong done;    /* sum of deltas whose incr returned */
  pthread_barrier_t bar;
} shared;

typedef struct writer {
  shared *sh;
  int id;
  long long total;
  long long iters;
  int errors;
  int signed_deltas;
  int track; /* maintain started/done (reader bounds) */
} writer;

static void *writer_main(void *arg) {
  writer *w = arg;
  shared *sh = w->sh;
  tally_counter *c = sh->c, *own = NULL;
  uint64_t rng = 0x9E3779B97F4A7C15ull * (uint64_t)(w->id + 1);
  if (w->id % 2) { /* odd writers use their own handle */
    if (tu_counter(sh->s, sh->name, 0, -1, 0, &own) != 0) {
      TU_FAIL("writer %d: open %s: %s", w->id, sh->name, tally_errmsg());
      w->errors++;
      pthread_barrier_wait(&sh->bar);
      return NULL;
    }
    c = own;
  }
  pthread_barrier_wait(&sh->bar);
  double t0 = tu_now();
  for (long long i = 0;
       i < MAX_ITERS && !atomic_load_explicit(&sh->stop, memory_order_relaxed); i++) {
    if ((i & 1023) == 0 && tu_now() - t0 > g_phase_secs) break;
    int64_t d = 1 + (int64_t)(tu_rng(&rng) % 5);
    if (w->signed_deltas && (i & 3) == 3) d = -d;
    if (w->track) atomic_fetch_add(&sh->started, d);
    int rc;
    switch (sh->policy) {
    case TALLY_POLICY_KEY: {
      uint64_t k = tu_rng(&rng) % 1000;
      rc = tally_counter_incr_key(c, &k, sizeof k, d);
      break;
    }
    case TALLY_POLICY_CUSTOM:
      rc = tally_counter_incr_shard(c, (uint32_t)(tu_rng(&rng) % sh->shards), d);
      break;
    default: rc = tally_counter_incr(c, d);
    }
    if (rc == 0) {
      w->total += d;
      if (w->track) atomic_fetch_add(&sh->done, d);
    } else {
      if (w->errors++ < 3)
        TU_FAIL("writer %d: incr -> %d %s (%s)", w->id, rc, tally_err_name(rc),
                tally_errmsg());
      if (w->track) atomic_fetch_sub(&sh->started, d);
    }
    w->iters++;
  }
  tally_counter_close(own);
  return NULL;
}

/* Start NWRITERS writers (plus `extra` threads running fn), join them. */
static long long run_writers(shared *sh, int signed_deltas, int track, int extra,
                             void *(*fn)(void *), void *fnarg, long long *iters) {
  pthread_t th[NWRITERS], ex[4];
  writer w[NWRITERS];
  memset(w, 0, sizeof w);
  atomic_store(&sh->stop, 0);
  pthread_barrier_init(&sh->bar, NULL, NWRITERS + extra);
  for (int i = 0; i < NWRITERS; i++) {
    w[i] = (writer){sh, i, 0, 0, 0, signed_deltas, track};
    pthread_create(&th[i], NULL, writer_main, &w[i]);
  }
  for (int i = 0; i < extra; i++) pthread_create(&ex[i], NULL, fn, fnarg);
  long long total = 0;
  *iters = 0;
  for (int i = 0; i < NWRITERS; i++) {
    pthread_join(th[i], NULL);
    total += w[i].total;
    *iters += w[i].iters;
  }
  atomic_store(&sh->stop, 1);
  for (int i = 0; i < extra; i++) pthread_join(ex[i], NULL);
  pthread_barrier_destroy(&sh->bar);
  return total;
}

static void open_counter(shared *sh, tally_store *s, const char *name, uint32_t shards,
                         int policy) {
  memset(sh, 0, sizeof *sh);
  sh->s = s;
  sh->name = name;
  sh->shards = shards;
  sh->policy = policy;
  REQUIRE_OK(tu_counter(s, name, shards, policy, TALLY_COUNTER_CREATE, &sh->c));
}

static void test_policies(tally_store *s) {
  for (int p = 0; p < TALLY_POLICY_SLOT; p++) { /* slot: test_batch */
    shared sh;
    char name[64];
    long long iters;
    snprintf(name, sizeof name, "thr:%s", tally_policy_name(p));
    open_counter(&sh, s, name, 16, p);
    long long total = run_writers(&sh, 1, 0, 0, NULL, NULL, &iters);
    EXPECT_I64(total, tu_value(sh.c));
    if (p == TALLY_POLICY_THREAD) {
      /* every writer kept to its own shard: at most NWRITERS shards used */
      int64_t v[16];
      uint32_t n;
      EXPECT_OK(tally_counter_shards(sh.c, v, 16, &n));
      int used = 0;
      for (int i = 0; i < 16; i++) used += v[i] != 0;
      EXPECT(used <= NWRITERS);
    }
    printf("  %-6s %-12s %lld increments, value %lld\n", tally_store_kind(s),
           tally_policy_name(p), iters, total);
    tally_counter_close(sh.c);
  }
}

/* ---- reset and reshard under load ---------------------------------------- */

typedef struct meddler {
  shared *sh;
  int do_reset, do_reshard, do_read;
  long long removed;
  long resets, reshards, reads;
  uint64_t seed;
} meddler;

static void *meddler_main(void *arg) {
  meddler *m = arg;
  shared *sh = m->sh;
  tally_counter *c = NULL;
  if (tu_counter(sh->s, sh->name, 0, -1, 0, &c) != 0) {
    TU_FAIL("meddler: open %s: %s", sh->name, tally_errmsg());
    pthread_barrier_wait(&sh->bar);
    return NULL;
  }
  pthread_barrier_wait(&sh->bar);
  double t0 = tu_now();
  for (int i = 0;
       i < 1000000 && !atomic_load(&sh->stop) && tu_now() - t0 < g_phase_secs + 5; i++) {
    uint64_t r = tu_rng(&m->seed);
    if (m->do_reshard && (r & 1)) {
      uint32_t n = 1 + (uint32_t)(tu_rng(&m->seed) % TALLY_MAX_SHARDS);
      int rc = tally_counter_reshard(c, n);
      if (rc != 0)
        TU_FAIL("reshard(%u) -> %s (%s)", n, tally_err_name(rc), tally_errmsg());
      m->reshards++;
    }
    if (m->do_reset && (r & 2)) {
      int64_t rem = 0;
      int rc = tally_counter_reset(c, &rem);
      if (rc != 0)
        TU_FAIL("reset -> %s (%s)", tally_err_name(rc), tally_errmsg());
      else
        m->removed += rem;
      m->resets++;
    }
    if (m->do_read) {
      /* value must be the sum of some set of completed increments:
       * at least what had completed before, at most what had started after */
      long long lo = atomic_load(&sh->done);
      int64_t v = 0;
      int rc = tally_counter_value(c, &v);
      long long hi = atomic_load(&sh->started);
      if (rc != 0)
        TU_FAIL("value -> %s", tally_err_name(rc));
      else if (v < lo || v > hi) {
        TU_FAIL("value() read %lld outside [%lld, %lld] during reshard", (long long)v, lo,
                hi);
        break;
      }
      int64_t sh_v[1024];
      uint32_t n = 0;
      lo = atomic_load(&sh->done);
      rc = tally_counter_shards(c, sh_v, 1024, &n);
      hi = atomic_load(&sh->started);
      if (rc != 0 || n < 1 || n > 1024)
        TU_FAIL("shards -> %s n=%u", tally_err_name(rc), n);
      m->reads++;
    }
    if (!m->do_read) usleep(200);
  }
  tally_counter_close(c);
  return NULL;
}

static void test_reset_reshard(tally_store *s) {
  struct {
    const char *what;
    int reset, reshard, readers;
    int policy;
  } modes[] = {
      {"reset", 1, 0, 0, TALLY_POLICY_THREAD},
      {"reset", 1, 0, 0, TALLY_POLICY_RANDOM},
      {"reshard", 0, 1, 1, TALLY_POLICY_THREAD},
      {"reshard", 0, 1, 1, TALLY_POLICY_ROUND_ROBIN},
      {"reshard", 0, 1, 1, TALLY_POLICY_KEY},
      {"reshard", 0, 1, 1, TALLY_POLICY_CUSTOM},
      {"reset+reshard", 1, 1, 0, TALLY_POLICY_RANDOM},
  };
  for (size_t k = 0; k < sizeof modes / sizeof modes[0]; k++) {
    shared sh;
    char name[64];
    long long iters;
    snprintf(name, sizeof name, "med:%zu", k);
    open_counter(&sh, s, name, 16, modes[k].policy);
    /* CUSTOM/KEY writers draw shards from 16 whatever the current count:
     * give incr_shard a count that is always valid */
    if (modes[k].policy == TALLY_POLICY_CUSTOM) sh.shards = 1;
    meddler m[2];
    memset(m, 0, sizeof m);
    m[0] = (meddler){&sh, modes[k].reset, modes[k].reshard, 0, 0, 0, 0, 0, 1234 + k};
    m[1] = (meddler){&sh, 0, 0, 1, 0, 0, 0, 0, 99};
    int extra = modes[k].readers ? 2 : 1;
    /* run_writers starts `extra` copies of one fn with one arg; use a small
     * trampoline array instead */
    pthread_t th[2];
    pthread_barrier_t *bar = &sh.bar;
    (void)bar;
    long long total;
    {
      pthread_t wt[NWRITERS];
      writer w[NWRITERS];
      memset(w, 0, sizeof w);
      pthread_barrier_init(&sh.bar, NULL, NWRITERS + extra);
      for (int i = 0; i < NWRITERS; i++) {
        w[i] = (writer){&sh, i, 0, 0, 0, !modes[k].readers, modes[k].readers};
        pthread_create(&wt[i], NULL, writer_main, &w[i]);
      }
      for (int i = 0; i < extra; i++) pthread_create(&th[i], NULL, meddler_main, &m[i]);
      total = 0;
      iters = 0;
      for (int i = 0; i < NWRITERS; i++) {
        pthread_join(wt[i], NULL);
        total += w[i].total;
        iters += w[i].iters;
      }
      atomic_store(&sh.stop, 1);
      for (int i = 0; i < extra; i++) pthread_join(th[i], NULL);
      pthread_barrier_destroy(&sh.bar);
    }
    int64_t v = tu_value(sh.c);
    EXPECT_I64(total, m[0].removed + v);
    EXPECT_OK(tally_store_check(s));
    printf("  %-6s %-13s %-11s %lld increments, %ld resets, %ld reshards, %ld reads: "
           "removed %lld + value %lld = %lld (added %lld)\n",
           tally_store_kind(s), modes[k].what, tally_policy_name(modes[k].policy), iters,
           m[0].resets, m[0].reshards, m[1].reads, m[0].removed, (long long)v,
           m[0].removed + (long long)v, total);
    tally_counter_close(sh.c);
  }
  (void)run_writers;
}

/* ---- creating counters from several threads ------------------------------ */

typedef struct creator {
  tally_store *s;
  int id;
  int same, own;
  pthread_barrier_t *bar;
  int errors;
} creator;

static void *creator_main(void *arg) {
  creator *cr = arg;
  pthread_barrier_wait(cr->bar);
  for (int i = 0; i < cr->same; i++) {
    char nm[32];
    tally_counter *c = NULL;
    snprintf(nm, sizeof nm, "same:%d", i);
    int rc = tu_counter(cr->s, nm, 1 + (uint32_t)(i % 8), TALLY_POLICY_RANDOM,
                        TALLY_COUNTER_CREATE, &c);
    if (rc == 0) rc = tally_counter_incr(c, 1);
    if (rc != 0 && cr->errors++ < 3)
      TU_FAIL("creator %d %s -> %s (%s)", cr->id, nm, tally_err_name(rc), tally_errmsg());
    tally_counter_close(c);
  }
  for (int i = 0; i < cr->own; i++) {
    char nm[32];
    tally_counter *c = NULL;
    snprintf(nm, sizeof nm, "own:%d:%d", cr->id, i);
    int rc = tu_counter(cr->s, nm, 0, -1, TALLY_COUNTER_CREATE, &c);
    if (rc == 0) rc = tally_counter_incr(c, i);
    if (rc != 0 && cr->errors++ < 3)
      TU_FAIL("creator %d %s -> %s (%s)", cr->id, nm, tally_err_name(rc), tally_errmsg());
    tally_counter_close(c);
  }
  return NULL;
}

/* tally_store_check() while creators run: it must see a consistent store. */
typedef struct {
  tally_store *s;
  atomic_int *stop;
  int runs, bad;
} checker;

static void *checker_main(void *arg) {
  checker *k = arg;
  while (!atomic_load(k->stop)) {
    int rc = tally_store_check(k->s);
    k->runs++;
    if (rc != 0 && k->bad++ == 0)
      TU_FAIL("check during creates -> %s (%s)", tally_err_name(rc), tally_errmsg());
    usleep(2000); /* check holds the store lock: leave the creators room */
  }
  return NULL;
}

/* A counter at the edge of the shard range: its total is 2^62-1, or 2^62
 * while a writer's +1 stands, so a reshard to 1 shard fits, or is refused,
 * or is found not to fit only after its cells were retired and must put
 * them back. Writers and readers racing with all that must never get
 * anything but success or ERANGE, and no increment may be lost. */
typedef struct {
  tally_counter *c;
  atomic_int *stop;
  int64_t net;
  int bad;
} edge;

static void *edge_writer(void *arg) {
  edge *e = arg;
  while (!atomic_load(e->stop)) {
    int64_t d = e->net == 0 ? 1 : -1;
    int rc = tally_counter_incr_shard(e->c, 0, d);
    if (rc == 0)
      e->net += d;
    else if (rc != TALLY_ERANGE && e->bad++ == 0)
      TU_FAIL("edge writer -> %s (%s)", tally_err_name(rc), tally_errmsg());
  }
  return NULL;
}

static void *edge_reader(void *arg) {
  edge *e = arg;
  int64_t v;
  while (!atomic_load(e->stop)) {
    int rc = tally_counter_value(e->c, &v);
    if (rc != 0 && e->bad++ == 0)
      TU_FAIL("edge reader -> %s (%s)", tally_err_name(rc), tally_errmsg());
  }
  return NULL;
}

static void test_edge_reshard(tally_store *s) {
  const int64_t half = INT64_C(1) << 61;
  tally_counter *c = NULL;
  REQUIRE_OK(tu_counter(s, "edge", 2, TALLY_POLICY_CUSTOM, TALLY_COUNTER_CREATE, &c));
  EXPECT_OK(tally_counter_incr_shard(c, 0, half));
  EXPECT_OK(tally_counter_incr_shard(c, 1, half - 1));
  atomic_int stop = 0;
  edge w = {c, &stop, 0, 0}, r = {c, &stop, 0, 0};
  pthread_t tw, tr;
  pthread_create(&tw, NULL, edge_writer, &w);
  pthread_create(&tr, NULL, edge_reader, &r);
  int done = 0, refused = 0, other = 0;
  double end = tu_now() + g_phase_secs;
  for (int i = 0; tu_now() < end && i < 200000; i++) {
    int rc = tally_counter_reshard(c, i % 2 ? 2 : 1);
    if (rc == 0)
      done++;
    else if (rc == TALLY_ERANGE)
      refused++;
    else if (other++ == 0)
      TU_FAIL("edge reshard -> %s (%s)", tally_err_name(rc), tally_errmsg());
  }
  atomic_store(&stop, 1);
  pthread_join(tw, NULL);
  pthread_join(tr, NULL);
  EXPECT_I64(2 * half - 1 + w.net, tu_value(c));
  EXPECT(refused > 0 && done > 0);
  printf("  %-6s edge reshards: %d done, %d refused with ERANGE, writers and "
         "readers never failed otherwise\n",
         tally_store_kind(s), done, refused);
  tally_counter_close(c);
  EXPECT_OK(tally_store_drop(s, "edge", 4));
}

static void test_create(tally_store *s) {
  enum { NT = 4, SAME = 300, OWN = 3000 };
  pthread_t th[NT];
  creator cr[NT];
  pthread_barrier_t bar;
  tally_store_stats st0, st1;
  EXPECT_OK(tally_store_stats_get(s, &st0));
  pthread_barrier_init(&bar, NULL, NT);
  atomic_int stop = 0;
  checker k = {s, &stop, 0, 0};
  pthread_t tk;
  pthread_create(&tk, NULL, checker_main, &k);
  for (int i = 0; i < NT; i++) {
    cr[i] = (creator){s, i, SAME, OWN, &bar, 0};
    pthread_create(&th[i], NULL, creator_main, &cr[i]);
  }
  for (int i = 0; i < NT; i++) pthread_join(th[i], NULL);
  atomic_store(&stop, 1);
  pthread_join(tk, NULL);
  EXPECT(k.runs > 0);
  pthread_barrier_destroy(&bar);
  EXPECT_OK(tally_store_stats_get(s, &st1));
  EXPECT_I64(st0.counters + SAME + NT * OWN, st1.counters);
  int64_t sum;
  uint64_t count;
  EXPECT_OK(tally_store_sum(s, "same:*", 6, &sum, &count));
  EXPECT_I64(SAME * NT, sum);
  EXPECT_I64(SAME, count);
  EXPECT_OK(tally_store_sum(s, "own:*", 5, &sum, &count));
  EXPECT_I64((long long)NT * OWN * (OWN - 1) / 2, sum);
  EXPECT_I64(NT * OWN, count);
  for (int i = 0; i < SAME; i++) {
    char nm[32];
    tally_counter *c = NULL;
    snprintf(nm, sizeof nm, "same:%d", i);
    if (tu_counter(s, nm, 0, -1, 0, &c) == 0) {
      EXPECT_I64(NT, tu_value(c));
      tally_counter_info inf;
      EXPECT_OK(tally_counter_info_get(c, &inf));
      EXPECT_I64(1 + i % 8, inf.shards);
      tally_counter_close(c);
    } else {
      TU_FAIL("%s missing", nm);
    }
  }
  EXPECT_OK(tally_store_check(s));
  printf("  %-6s created %d shared + %d own counters from %d threads\n",
         tally_store_kind(s), SAME, NT * OWN, NT);
}

int main(void) {
  const char *dir = tu_tmpdir("threads");
  char spec[1200];
  tally_store *s = NULL;
  if (getenv("TALLY_TEST_SECS")) g_phase_secs = atof(getenv("TALLY_TEST_SECS"));

  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  test_policies(s);
  test_reset_reshard(s);
  test_edge_reshard(s);
  test_create(s);
  tally_store_close(s);

  tu_spec(spec, sizeof spec, NULL, 0, dir, "threads.tly");
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  test_policies(s);
  test_reset_reshard(s);
  test_edge_reshard(s);
  test_create(s);
  EXPECT_OK(tally_store_check(s));
  tally_store_close(s);
  tu_rmrf(dir);
  return tu_finish("test_threads");
}
