/* test_autoshard.c -- counters with TALLY_SHARDS_AUTO (src/core/autoshard.c).
 *
 *  - one writer never grows a counter; two threads hammering one do (how
 *    soon is printed; scripts/bench holds the 100 ms target), exactly;
 *  - exact under thread, random and round-robin policies while a third
 *    thread shrinks the counter back (upkeep with a 0 ms quiet time) as
 *    fast as it can, so it grows and shrinks under load;
 *  - 100,000 cold counters incremented at random by two threads stay at one
 *    cell;
 *  - two processes on a file store: the counter grows, one is SIGKILLed
 *    mid-run, the value holds every acknowledged increment (and at most one
 *    more per killed process: its add may land before it could count it);
 *  - options: auto with a key policy is refused; EMISMATCH rules; info;
 *  - upkeep in three threads at once on two handles (TSan: the quiet time
 *    and the expiry cursor are read and written by all of them);
 *  - with the default quiet time, upkeep leaves a busy counter grown.
 */
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <sys/mman.h>
#include <sys/wait.h>

#include "testutil.h"

static char g_dir[1024];

struct hammer {
  tally_counter *c;
  atomic_bool *stop;
  long long n;
  double grew_after; /* seconds from start until shards > 1 was seen, or -1 */
  double t0;
};

static void *hammer_main(void *ud) {
  struct hammer *h = ud;
  double end = tu_now() + 10; /* a bound, whatever happens */
  h->grew_after = -1;
  while (!atomic_load(h->stop) && tu_now() < end) {
    for (int k = 0; k < 4096; k++) {
      if (tally_counter_incr(h->c, 1) != 0) {
        TU_FAIL("incr: %s", tally_errmsg());
        return NULL;
      }
      h->n++;
    }
    if (h->grew_after < 0) {
      tally_counter_info in;
      if (tally_counter_info_get(h->c, &in) == 0 && in.shards > 1)
        h->grew_after = tu_now() - h->t0;
    }
  }
  return NULL;
}

static void test_one_and_two_writers(void) {
  tally_store *s;
  tally_counter *c;
  tally_counter_options o = {TALLY_SHARDS_AUTO, TALLY_POLICY_THREAD};
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  REQUIRE_OK(tally_counter_open(s, "hot", 3, &o, TALLY_COUNTER_CREATE, &c));
  tally_counter_info in;
  EXPECT_OK(tally_counter_info_get(c, &in));
  EXPECT_I64(1, in.shards);
  EXPECT(in.auto_shards);

  atomic_bool stop = false;
  struct hammer h[2] = {{.c = c, .stop = &stop, .t0 = tu_now()},
                        {.c = c, .stop = &stop, .t0 = tu_now()}};
  pthread_t th[2];
  pthread_create(&th[0], NULL, hammer_main, &h[0]); /* one writer alone */
  usleep(200000);
  EXPECT_OK(tally_counter_info_get(c, &in));
  EXPECT_I64(1, in.shards);
  EXPECT_I64(0, in.grown);

  h[1].t0 = tu_now();
  pthread_create(&th[1], NULL, hammer_main, &h[1]); /* a second one */
  /* both must get a core at once: on a loaded machine that can take a while
   * (the 100 ms target is scripts/bench's, on an idle one) */
  for (int t = 0; t < 800; t++) {
    usleep(10000);
    EXPECT_OK(tally_counter_info_get(c, &in));
    if (in.shards >= 2 && t >= 30) break;
  }
  atomic_store(&stop, true);
  pthread_join(th[0], NULL);
  pthread_join(th[1], NULL);
  EXPECT_OK(tally_counter_info_get(c, &in));
  EXPECT(in.shards >= 2);
  EXPECT(in.grown >= 1);
  EXPECT(h[1].grew_after >= 0); /* within 100 ms on an idle machine: scripts/bench */
  EXPECT_I64(h[0].n + h[1].n, tu_value(c));
  printf("  2 writers: %u shards, grown %u times, the first within %.1f ms; "
         "%lld increments exact\n",
         in.shards, in.grown, h[1].grew_after * 1000, h[0].n + h[1].n);
  tally_counter_close(c);
  tally_store_close(s);
}

struct shrinker {
  tally_store *s;
  atomic_bool *stop;
  long long calls;
};

static void *shrinker_main(void *ud) {
  struct shrinker *k = ud;
  double end = tu_now() + 10;
  while (!atomic_load(k->stop) && tu_now() < end) {
    if (tally_store_maintain(k->s, 1, 1000, NULL) != 0)
      TU_FAIL("maintain: %s", tally_errmsg());
    k->calls++;
    usleep(500);
  }
  return NULL;
}

/* Two threads hammering c and a third running upkeep on s as fast as it
 * can, until load_stop. */
struct load {
  atomic_bool stop;
  struct hammer h[2];
  struct shrinker k;
  pthread_t th[3];
};

static void load_start(struct load *l, tally_store *s, tally_counter *c) {
  atomic_init(&l->stop, false);
  for (int i = 0; i < 2; i++) {
    l->h[i] = (struct hammer){.c = c, .stop = &l->stop, .t0 = tu_now()};
    pthread_create(&l->th[i], NULL, hammer_main, &l->h[i]);
  }
  l->k = (struct shrinker){s, &l->stop, 0};
  pthread_create(&l->th[2], NULL, shrinker_main, &l->k);
}

static void load_stop(struct load *l) {
  atomic_store(&l->stop, true);
  for (int i = 0; i < 3; i++) pthread_join(l->th[i], NULL);
}

static void test_grow_shrink_exact(void) {
  static const int policies[] = {TALLY_POLICY_THREAD, TALLY_POLICY_RANDOM,
                                 TALLY_POLICY_ROUND_ROBIN};
  for (int p = 0; p < 3; p++) {
    tally_store *s;
    tally_counter *c;
    tally_counter_options o = {TALLY_SHARDS_AUTO, policies[p]};
    REQUIRE_OK(tally_store_open("memory", NULL, &s));
    REQUIRE_OK(tally_counter_open(s, "x", 1, &o, TALLY_COUNTER_CREATE, &c));
    struct load l;
    load_start(&l, s, c);
    /* 400 ms at least, on until it has grown and shrunk (a loaded
     * machine, a sanitizer: 5 s at most) */
    tally_counter_info in;
    double t0 = tu_now();
    do {
      usleep(50000);
      EXPECT_OK(tally_counter_info_get(c, &in));
    } while (tu_now() - t0 < 0.4 ||
             ((in.grown < 1 || in.shrunk < 1) && tu_now() - t0 < 5));
    load_stop(&l);
    EXPECT_OK(tally_counter_info_get(c, &in));
    EXPECT_I64(l.h[0].n + l.h[1].n, tu_value(c));
    EXPECT(in.grown >= 1);
    EXPECT(in.shrunk >= 1);
    printf("  %s: grown %u, shrunk %u times under load (%lld upkeep calls); "
           "%lld increments exact\n",
           tally_policy_name(policies[p]), in.grown, in.shrunk, l.k.calls,
           l.h[0].n + l.h[1].n);
    tally_counter_close(c);
    tally_store_close(s);
  }
}

/* With the default quiet time, a counter two writers keep busy is not
 * shrunk by upkeep: for 2.2 s, so that the clock crosses units of 1024 ms
 * of either parity (upkeep once read the time in units one off from the
 * sample's, every other second, and shrank busy counters). In a child:
 * the quiet time is read once per process, and this process uses 0. */
static int busy_stays_main(void) {
  setenv("TALLY_AUTO_QUIET_MS", "60000", 1);
  tally_store *s;
  tally_counter *c;
  tally_counter_options o = {TALLY_SHARDS_AUTO, TALLY_POLICY_THREAD};
  if (tally_store_open("memory", NULL, &s) ||
      tally_counter_open(s, "x", 1, &o, TALLY_COUNTER_CREATE, &c))
    return 2;
  struct load l;
  load_start(&l, s, c);
  usleep(2200000);
  load_stop(&l);
  tally_counter_info in;
  if (tally_counter_info_get(c, &in)) return 3;
  printf("  busy for 2.2 s, default quiet time: grown %u, shrunk %u times (%lld upkeep "
         "calls)\n",
         in.grown, in.shrunk, l.k.calls);
  fflush(stdout);
  return in.grown >= 1 && in.shrunk == 0 && tu_value(c) == l.h[0].n + l.h[1].n ? 0 : 1;
}

static void test_busy_stays(void) {
  tu_in_child("a busy counter under upkeep", busy_stays_main);
}

#define NCOLD 100000

struct cold {
  tally_counter **cs;
  atomic_bool *stop;
  uint64_t seed;
  long long n;
};

static void *cold_main(void *ud) {
  struct cold *w = ud;
  double end = tu_now() + 10;
  while (!atomic_load(w->stop) && tu_now() < end)
    for (int k = 0; k < 4096; k++) {
      if (tally_counter_incr(w->cs[tu_rng(&w->seed) % NCOLD], 1)) TU_FAIL("incr");
      w->n++;
    }
  return NULL;
}

static void test_cold_stay_small(void) {
  tally_store *s;
  tally_counter_options o = {TALLY_SHARDS_AUTO, TALLY_POLICY_THREAD};
  tally_counter **cs = calloc(NCOLD, sizeof *cs);
  REQUIRE_OK(cs ? 0 : TALLY_ENOMEM);
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  for (int i = 0; i < NCOLD; i++) {
    char name[32];
    snprintf(name, sizeof name, "cold:%d", i);
    REQUIRE_OK(
        tally_counter_open(s, name, strlen(name), &o, TALLY_COUNTER_CREATE, &cs[i]));
  }
  atomic_bool stop = false;
  struct cold w[2] = {{cs, &stop, 0x1234, 0}, {cs, &stop, 0x9876, 0}};
  pthread_t th[2];
  for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, cold_main, &w[i]);
  usleep(300000);
  atomic_store(&stop, true);
  for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
  int grown = 0;
  long long total = 0;
  for (int i = 0; i < NCOLD; i++) {
    tally_counter_info in;
    EXPECT_OK(tally_counter_info_get(cs[i], &in));
    grown += in.shards > 1;
    total += tu_value(cs[i]);
    tally_counter_close(cs[i]);
  }
  EXPECT_I64(w[0].n + w[1].n, total);
  EXPECT(grown <= NCOLD / 1000);
  printf("  %d cold counters, 2 threads, %lld increments: %d grew\n", NCOLD,
         w[0].n + w[1].n, grown);
  free(cs);
  tally_store_close(s);
}

struct page {
  atomic_llong acked[2];
  atomic_int ready, stop;
};

static void test_processes_sigkill(void) {
  char spec[1200], path[1100];
  snprintf(path, sizeof path, "%s/procs.tly", g_dir);
  snprintf(spec, sizeof spec, "file:%s", path);
  tally_store *s;
  tally_counter *c;
  tally_counter_options o = {TALLY_SHARDS_AUTO, TALLY_POLICY_THREAD};
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  REQUIRE_OK(tally_counter_open(s, "p", 1, &o, TALLY_COUNTER_CREATE, &c));
  struct page *pg = tu_shared(sizeof *pg);
  pid_t pids[2];
  fflush(NULL);
  for (int i = 0; i < 2; i++) {
    if ((pids[i] = fork()) == 0) {
      tally_store *cs;
      tally_counter *cc;
      if (tally_store_open(spec, NULL, &cs) ||
          tally_counter_open(cs, "p", 1, NULL, 0, &cc))
        _exit(2);
      atomic_fetch_add(&pg->ready, 1);
      double end = tu_now() + 45;
      while (!atomic_load_explicit(&pg->stop, memory_order_relaxed) && tu_now() < end) {
        if (tally_counter_incr(cc, 1)) _exit(3);
        atomic_fetch_add_explicit(&pg->acked[i], 1, memory_order_relaxed);
      }
      tally_counter_close(cc);
      tally_store_close(cs);
      _exit(0);
    }
  }
  while (atomic_load(&pg->ready) < 2) usleep(1000);
  /* until the counter has grown (both writers must get a core at once: on a
   * loaded machine that can take a while), then a little more */
  tally_counter_info in;
  for (int t = 0; t < 3000; t++) {
    EXPECT_OK(tally_counter_info_get(c, &in));
    if (in.grown >= 1) break;
    usleep(10000);
  }
  usleep(50000);
  kill(pids[0], SIGKILL); /* mid-increment, mid-reshard perhaps */
  atomic_store(&pg->stop, 1);
  int st;
  waitpid(pids[0], &st, 0);
  EXPECT(WIFSIGNALED(st));
  waitpid(pids[1], &st, 0);
  EXPECT(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  long long acked = atomic_load(&pg->acked[0]) + atomic_load(&pg->acked[1]);
  int64_t v = tu_value(c);
  EXPECT(v >= acked && v <= acked + 1);
  EXPECT_OK(tally_counter_info_get(c, &in));
  EXPECT(in.grown >= 1);
  EXPECT_OK(tally_store_check(s));
  printf("  2 processes, one SIGKILLed: %u shards (grown %u), value %lld, "
         "acknowledged %lld\n",
         in.shards, in.grown, (long long)v, acked);
  munmap(pg, sizeof *pg);
  tally_counter_close(c);
  tally_store_close(s);
}

static void test_options(void) {
  tally_store *s;
  tally_counter *c = NULL, *d = NULL;
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  tally_counter_options key = {TALLY_SHARDS_AUTO, TALLY_POLICY_KEY};
  EXPECT_RC(TALLY_EPOLICY, tally_counter_open(s, "k", 1, &key, TALLY_COUNTER_CREATE, &c));
  tally_family_options fk = {TALLY_SHARDS_AUTO, TALLY_POLICY_KEY, 0, 0};
  EXPECT_RC(TALLY_EPOLICY, tally_family_define(s, "k:*", 3, &fk));
  tally_family_options fa = {TALLY_SHARDS_AUTO, -1, 0, 0};
  EXPECT_OK(tally_family_define(s, "a:*", 3, &fa));
  REQUIRE_OK(tally_counter_open(s, "a:1", 3, NULL, TALLY_COUNTER_CREATE, &c));
  tally_counter_info in;
  EXPECT_OK(tally_counter_info_get(c, &in));
  EXPECT(in.auto_shards);
  EXPECT_I64(1, in.shards);
  tally_counter_options o16 = {16, -1}, oa = {TALLY_SHARDS_AUTO, -1}, o1 = {1, -1};
  EXPECT_RC(TALLY_EMISMATCH, tally_counter_open(s, "a:1", 3, &o16, 0, &d));
  EXPECT_OK(tally_counter_open(s, "a:1", 3, &oa, 0, &d));
  tally_counter_close(d);
  EXPECT_OK(tally_counter_open(s, "a:1", 3, &o1, 0, &d)); /* it has 1 now */
  tally_counter_close(d);
  REQUIRE_OK(tally_counter_open(s, "f", 1, &o16, TALLY_COUNTER_CREATE, &d));
  EXPECT_RC(TALLY_EMISMATCH, tally_counter_open(s, "f", 1, &oa, 0, &d));
  tally_counter_close(d);
  tally_counter_close(c);
  tally_store_close(s);
}

static void *maintain_main(void *ud) {
  for (int k = 0; k < 200; k++)
    if (tally_store_maintain(ud, 0, 100, NULL) != 0) {
      TU_FAIL("maintain: %s", tally_errmsg());
      break;
    }
  return NULL;
}

/* Upkeep in several threads at once, on two handles of one file and two
 * threads on one handle, while an automatic counter has grown: its first
 * look at the quiet time and the expiry scan's cursor race under TSan if
 * unsynchronized. Runs first, so that look is the first. */
static void test_maintain_threads(void) {
  char spec[1200];
  tally_store *s1, *s2;
  tally_counter *c;
  tally_counter_options o = {TALLY_SHARDS_AUTO, TALLY_POLICY_THREAD};
  tu_spec(spec, sizeof spec, NULL, 0, g_dir, "maintain.tly");
  REQUIRE_OK(tally_store_open(spec, NULL, &s1));
  REQUIRE_OK(tally_store_open(spec, NULL, &s2));
  REQUIRE_OK(tally_counter_open(s1, "hot", 3, &o, TALLY_COUNTER_CREATE, &c));
  for (int i = 0; i < 100; i++) {
    char nm[32];
    snprintf(nm, sizeof nm, "cold:%d", i);
    EXPECT_OK(tally_store_incr(s1, nm, strlen(nm), 1, TALLY_COUNTER_CREATE));
  }
  atomic_bool stop = false;
  struct hammer h[2] = {{.c = c, .stop = &stop, .t0 = tu_now()},
                        {.c = c, .stop = &stop, .t0 = tu_now()}};
  pthread_t th[3];
  for (int t = 0; t < 2; t++) pthread_create(&th[t], NULL, hammer_main, &h[t]);
  tally_counter_info in;
  memset(&in, 0, sizeof in);
  for (int k = 0; k < 500 && in.shards < 2; k++) {
    usleep(10000);
    EXPECT_OK(tally_counter_info_get(c, &in));
  }
  atomic_store(&stop, true);
  for (int t = 0; t < 2; t++) pthread_join(th[t], NULL);
  pthread_create(&th[0], NULL, maintain_main, s1);
  pthread_create(&th[1], NULL, maintain_main, s2);
  pthread_create(&th[2], NULL, maintain_main, s1);
  for (int t = 0; t < 3; t++) pthread_join(th[t], NULL);
  EXPECT_I64(h[0].n + h[1].n, tu_value(c));
  printf("maintain threads: grew to %u shards, upkeep in 3 threads, exact\n", in.shards);
  tally_counter_close(c);
  tally_store_close(s2);
  tally_store_close(s1);
}

int main(void) {
  setenv("TALLY_AUTO_QUIET_MS", "0", 1); /* upkeep shrinks at once (0 is not unset) */
  snprintf(g_dir, sizeof g_dir, "%s", tu_tmpdir("autoshard"));
  double t0 = tu_now();
  test_busy_stays(); /* before this process reads its quiet time */
  test_maintain_threads();
  test_one_and_two_writers();
  test_grow_shrink_exact();
  test_cold_stay_small();
  test_processes_sigkill();
  test_options();
  printf("total %.2f s\n", tu_now() - t0);
  return tu_finish("test_autoshard");
}
