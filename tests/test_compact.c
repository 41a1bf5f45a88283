/* test_compact.c -- offline compaction (tally_store_compact).
 *
 * A file store is churned (counters created and dropped by the thousand,
 * resharded, expired, capped; families defined and redefined; two rollup
 * schedules ticked with history), then compacted. Everything a reader can
 * see must be the same afterwards: every counter's shards one by one, its
 * policy and incarnation, rollup record, rings and history, the families'
 * resolutions, the schedules' periods, the header's tallies, the file's
 * mode; and the file is smaller, with no retired or reusable space, and
 * passes tally_store_check. Then the store is used again.
 *
 * Processes: a forked child holding the store open makes compaction
 * refuse (EBUSY, naming its pid) until it exits; one killed with SIGKILL
 * (a zombie, not yet reaped) does not hold it back; and a child that opens
 * the store again and again while the parent compacts it again and again
 * loses no increment (opens that raced with a rename land on the new
 * file; one that a compaction after compaction keeps sending back is
 * refused with EBUSY, and tries again). A thread that compacts while another
 * forks does not deadlock. Children are our own, bounded by alarm(), and
 * always reaped.
 */
#include <pthread.h>
#include <dirent.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>

#include "testutil.h"

#define NTMP    1200 /* churn: created, then dropped */
#define NKEEP   700  /* kept: more than the first index table holds */
#define HISTMAX 64

static char g_dir[1024], g_spec[1200], g_path[1200];

/* ---- what a reader sees --------------------------------------------------------- */

typedef struct snap {
  char name[TALLY_NAME_MAX + 1];
  tally_counter_info info;
  int64_t value;
  uint32_t nshards;
  int64_t shard[TALLY_MAX_SHARDS];
  int rolled_rc;
  tally_rollup rolled;
  int rings_rc;
  uint32_t nrings;
  tally_ring rings[TALLY_RINGS_MAX];
  uint32_t nhist[TALLY_RINGS_MAX];
  tally_bucket hist[TALLY_RINGS_MAX][HISTMAX];
} snap;

typedef struct names {
  char **v;
  size_t n, cap;
} names;

static int add_name(void *ud, const char *name, size_t len) {
  names *ns = ud;
  if (ns->n == ns->cap) {
    ns->cap = ns->cap ? ns->cap * 2 : 256;
    ns->v = realloc(ns->v, ns->cap * sizeof *ns->v);
    if (!ns->v) exit(1);
  }
  ns->v[ns->n] = strndup(name, len);
  ns->n++;
  return 0;
}

static int by_str(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

static snap *take(tally_store *s, size_t *count) {
  names ns = {0};
  REQUIRE_OK(tally_store_each(s, NULL, 0, add_name, &ns));
  qsort(ns.v, ns.n, sizeof *ns.v, by_str);
  snap *v = calloc(ns.n ? ns.n : 1, sizeof *v);
  if (!v) exit(1);
  for (size_t i = 0; i < ns.n; i++) {
    snap *p = &v[i];
    tally_counter *c = NULL;
    snprintf(p->name, sizeof p->name, "%s", ns.v[i]);
    REQUIRE_OK(tally_counter_open(s, p->name, strlen(p->name), NULL, 0, &c));
    EXPECT_OK(tally_counter_info_get(c, &p->info));
    p->info.name = NULL; /* the handle's; compared by p->name */
    EXPECT_OK(tally_counter_value(c, &p->value));
    EXPECT_OK(tally_counter_shards(c, p->shard, TALLY_MAX_SHARDS, &p->nshards));
    p->rolled_rc = tally_counter_rolled(c, &p->rolled);
    p->rings_rc = tally_counter_rings(c, p->rings, TALLY_RINGS_MAX, &p->nrings);
    for (uint32_t r = 0; p->rings_rc == 0 && r < p->nrings; r++)
      EXPECT_OK(
          tally_counter_history(c, p->rings[r].res_s, p->hist[r], HISTMAX, &p->nhist[r]));
    tally_counter_close(c);
    free(ns.v[i]);
  }
  free(ns.v);
  *count = ns.n;
  return v;
}

static void same(const snap *a, size_t na, const snap *b, size_t nb) {
  EXPECT_I64(na, nb);
  for (size_t i = 0; i < na && i < nb; i++) {
    const snap *x = &a[i], *y = &b[i];
    EXPECT_STR(x->name, y->name);
    EXPECT_I64(x->value, y->value);
    EXPECT_I64(x->nshards, y->nshards);
    EXPECT_I64(x->info.shards, y->info.shards);
    EXPECT_I64(x->info.policy, y->info.policy);
    EXPECT(x->info.incarnation == y->info.incarnation);
    if (memcmp(x->shard, y->shard, x->nshards * sizeof *x->shard) != 0)
      TU_FAIL("counter '%s': shards differ after compaction", x->name);
    EXPECT_I64(x->rolled_rc, y->rolled_rc);
    if (x->rolled_rc == 0 && memcmp(&x->rolled, &y->rolled, sizeof x->rolled) != 0)
      TU_FAIL("counter '%s': rollup record differs after compaction", x->name);
    EXPECT_I64(x->rings_rc, y->rings_rc);
    EXPECT_I64(x->nrings, y->nrings);
    if (x->rings_rc == 0 && x->nrings == y->nrings) {
      if (memcmp(x->rings, y->rings, x->nrings * sizeof *x->rings) != 0)
        TU_FAIL("counter '%s': rings differ after compaction", x->name);
      for (uint32_t r = 0; r < x->nrings; r++) {
        EXPECT_I64(x->nhist[r], y->nhist[r]);
        uint32_t k = x->nhist[r] < HISTMAX ? x->nhist[r] : HISTMAX;
        if (x->nhist[r] == y->nhist[r] &&
            memcmp(x->hist[r], y->hist[r], k * sizeof **x->hist))
          TU_FAIL("counter '%s': history at %u s differs after compaction", x->name,
                  x->rings[r].res_s);
      }
    }
  }
}

static const char *const probes[] = {"fam.x",  "fam.a1",  "fam.b", "cap.9",
                                     "idle.3", "keep.17", "zzz",   "cap._overflow"};
#define NPROBES (sizeof probes / sizeof *probes)

static void resolve_all(tally_store *s, tally_counter_options *out) {
  for (size_t i = 0; i < NPROBES; i++)
    EXPECT_OK(tally_family_resolve(s, probes[i], strlen(probes[i]), &out[i]));
}

/* ---- the churn -------------------------------------------------------------------- */

static const tally_ring fine[] = {{1, 8}, {60, 4}};
static const tally_ring coarse[] = {{2, 5}};

static void define(tally_store *s, const char *p, uint32_t shards, int32_t policy,
                   uint32_t idle_s, uint64_t max) {
  tally_family_options o = {shards, policy, idle_s, max};
  REQUIRE_OK(tally_family_define(s, p, strlen(p), &o));
}

static void bump(tally_store *s, const char *name, int64_t base) {
  tally_counter *c;
  uint32_t n;
  int64_t vals[TALLY_MAX_SHARDS];
  REQUIRE_OK(tally_counter_open(s, name, strlen(name), NULL, 0, &c));
  REQUIRE_OK(tally_counter_shards(c, vals, TALLY_MAX_SHARDS, &n));
  for (uint32_t k = 0; k < n; k++) EXPECT_OK(tally_counter_incr_shard(c, k, base + k));
  tally_counter_close(c);
}

static void tick(tally_schedule *sch, int64_t now_ms) {
  tally_tick_result r;
  EXPECT_OK(tally_schedule_tick(sch, now_ms, NULL, NULL, &r));
  EXPECT_I64(TALLY_TICK_RAN, r.status);
}

static void churn(tally_store *s) {
  char name[64];
  tally_counter *c;
  define(s, "fam.*", 4, TALLY_POLICY_RANDOM, 0, 0);
  define(s, "fam.a*", 2, -1, 0, 0);
  define(s, "cap.*", 0, -1, 0, 3);
  define(s, "fam.*", 8, TALLY_POLICY_ROUND_ROBIN, 0, 100); /* shadows both above */
  define(s, "idle.*", 1, -1, 1, 0);
  /* thousands of counters in shard classes the kept ones never use */
  for (int i = 0; i < NTMP; i++) {
    snprintf(name, sizeof name, "tmp.%d", i);
    REQUIRE_OK(
        tu_counter(s, name, 20 + i % 17, TALLY_POLICY_THREAD, TALLY_COUNTER_CREATE, &c));
    EXPECT_OK(tally_counter_incr(c, i));
    tally_counter_close(c);
  }
  static const int pol[] = {TALLY_POLICY_THREAD, TALLY_POLICY_RANDOM,
                            TALLY_POLICY_ROUND_ROBIN, TALLY_POLICY_KEY,
                            TALLY_POLICY_CUSTOM};
  for (int i = 0; i < NKEEP; i++) {
    snprintf(name, sizeof name, "keep.%d", i);
    REQUIRE_OK(tu_counter(s, name, i % 5 == 0 ? 16 : 1 + i % 9, pol[i % 5],
                          TALLY_COUNTER_CREATE, &c));
    if (pol[i % 5] <= TALLY_POLICY_ROUND_ROBIN)
      for (int k = 0; k < 7; k++) EXPECT_OK(tally_counter_incr(c, i - 3));
    tally_counter_close(c);
    bump(s, name, (int64_t)i * 1000 - 50);
  }
  for (int i = 0; i < NTMP; i++) {
    snprintf(name, sizeof name, "tmp.%d", i);
    EXPECT_OK(tally_store_drop(s, name, strlen(name)));
  }
  for (int i = 0; i < NKEEP; i += 10) { /* resharded: new columns, old ones retired */
    snprintf(name, sizeof name, "keep.%d", i);
    REQUIRE_OK(tally_counter_open(s, name, strlen(name), NULL, 0, &c));
    EXPECT_OK(tally_counter_reshard(c, (uint32_t)(i % 13) + 1));
    tally_counter_close(c);
  }
  for (int i = 0; i < 20; i++) { /* the families' options */
    snprintf(name, sizeof name, i % 2 ? "fam.x%d" : "fam.a%d", i);
    REQUIRE_OK(tu_counter(s, name, 0, -1, TALLY_COUNTER_CREATE, &c));
    EXPECT_OK(tally_counter_incr(c, 5 + i));
    tally_counter_close(c);
  }
  for (int i = 0; i < 6; i++) { /* three names, then the overflow counter */
    snprintf(name, sizeof name, "cap.%d", i);
    REQUIRE_OK(tu_counter(s, name, 0, -1, TALLY_COUNTER_CREATE, &c));
    EXPECT_OK(tally_counter_incr(c, 100 + i));
    tally_counter_close(c);
  }
  for (int i = 0; i < 5; i++) { /* expired for idleness below */
    snprintf(name, sizeof name, "idle.%d", i);
    REQUIRE_OK(tu_counter(s, name, 0, -1, TALLY_COUNTER_CREATE, &c));
    EXPECT_OK(tally_counter_incr(c, 1));
    tally_counter_close(c);
  }
  tally_maintain_result mr;
  EXPECT_OK(tally_store_maintain(s, 1000, 100000, &mr));
  EXPECT_OK(tally_store_maintain(s, 5000, 100000, &mr));
  EXPECT_I64(5, mr.expired);

  /* rollups: keep.1* gets the union of both schedules' rings */
  tally_schedule *a, *b;
  REQUIRE_OK(tally_schedule_new(s, "keep.*", 6, 1000, fine, 2, &a));
  REQUIRE_OK(tally_schedule_new(s, "keep.1*", 7, 2000, coarse, 1, &b));
  for (int64_t t = 1000; t <= 9000; t += 1000) {
    for (int i = 0; i < NKEEP; i += 7) {
      snprintf(name, sizeof name, "keep.%d", i);
      bump(s, name, t / 100 + i);
    }
    tick(a, t);
    if (t % 2000 == 0) tick(b, t);
  }
  tally_schedule_free(a);
  tally_schedule_free(b);
  for (int i = 3; i < NKEEP; i += 50) { /* blocks and all to limbo */
    snprintf(name, sizeof name, "keep.%d", i);
    EXPECT_OK(tally_store_drop(s, name, strlen(name)));
  }
  EXPECT_OK(tally_store_maintain(s, 10000, 0, NULL)); /* reuse what is ripe */
}

/* ---- children ------------------------------------------------------------------------ */

/* A child that opens the store, says so on `ready`, and keeps it open
 * until `go` is written or closed. */
static pid_t holder(int *go_fd) {
  int ready[2], go[2];
  if (pipe(ready) != 0 || pipe(go) != 0) exit(1);
  pid_t pid = fork();
  if (pid < 0) exit(1);
  if (pid == 0) {
    tally_store *s;
    char b = 0;
    alarm(60);
    close(ready[0]);
    close(go[1]);
    if (tally_store_open(g_spec, NULL, &s) != 0) _exit(2);
    if (write(ready[1], &b, 1) != 1) _exit(3);
    (void)!read(go[0], &b, 1);
    tally_store_close(s);
    _exit(0);
  }
  char b;
  close(ready[1]);
  close(go[0]);
  if (read(ready[0], &b, 1) != 1) TU_FAIL("holder child did not open the store");
  close(ready[0]);
  *go_fd = go[1];
  return pid;
}

static void reap(pid_t pid) {
  int st = 0;
  EXPECT(waitpid(pid, &st, 0) == pid);
}

typedef struct progress {
  uint64_t calls, last_done, last_total;
  int backwards;
} progress;

static void on_progress(void *ud, uint64_t done, uint64_t total) {
  progress *p = ud;
  if (p->calls && done < p->last_done) p->backwards = 1;
  p->calls++;
  p->last_done = done;
  p->last_total = total;
}

/* ---- tests ---------------------------------------------------------------------------- */

static void test_compact_keeps_everything(void) {
  tally_store *s;
  tally_store_stats before, after;
  tally_counter_options fam_before[NPROBES], fam_after[NPROBES];
  tally_schedule_info sch_before[8], sch_after[8];
  uint32_t nsch_before = 0, nsch_after = 0;
  size_t na, nb;

  REQUIRE_OK(tally_store_open(g_spec, NULL, &s));
  churn(s);
  EXPECT_OK(tally_store_check(s));
  REQUIRE_OK(tally_store_stats_get(s, &before));
  EXPECT(before.retired_bytes + before.reusable_bytes > 0);
  EXPECT(before.expired == 5);
  EXPECT(before.capped > 0);
  resolve_all(s, fam_before);
  EXPECT_OK(tally_store_schedules(s, sch_before, 8, &nsch_before));
  snap *a = take(s, &na);
  tally_store_close(s);
  EXPECT(chmod(g_path, 0640) == 0);

  progress pg = {0};
  EXPECT_OK(tally_store_compact(g_path, 0, on_progress, &pg));
  EXPECT(pg.calls >= 2 && pg.calls <= 102);
  EXPECT(!pg.backwards);
  EXPECT_I64(before.counters, pg.last_total);
  EXPECT_I64(pg.last_total, pg.last_done);

  struct stat st;
  EXPECT(stat(g_path, &st) == 0 && (st.st_mode & 0777) == 0640);
  REQUIRE_OK(tally_store_open(g_spec, NULL, &s));
  EXPECT_OK(tally_store_check(s));
  REQUIRE_OK(tally_store_stats_get(s, &after));
  EXPECT_I64(0, after.retired_bytes);
  EXPECT_I64(0, after.reusable_bytes);
  EXPECT_I64(before.counters, after.counters);
  EXPECT_I64(before.writers, after.writers);
  EXPECT_I64(before.expired, after.expired);
  EXPECT_I64(before.capped, after.capped);
  EXPECT_I64(before.schedules, after.schedules);
  EXPECT(after.file_bytes < before.file_bytes);
  EXPECT(after.used_bytes < before.used_bytes);
  EXPECT((uint64_t)st.st_size < before.file_bytes);
  resolve_all(s, fam_after);
  EXPECT(memcmp(fam_before, fam_after, sizeof fam_before) == 0);
  EXPECT_OK(tally_store_schedules(s, sch_after, 8, &nsch_after));
  EXPECT_I64(nsch_before, nsch_after);
  for (uint32_t i = 0; i < nsch_before && i < nsch_after && i < 8; i++) {
    EXPECT_I64(sch_before[i].every_ms, sch_after[i].every_ms);
    EXPECT_I64(sch_before[i].last_period_ms, sch_after[i].last_period_ms);
  }
  snap *b = take(s, &nb);
  same(a, na, b, nb);
  free(b);

  /* and it goes on: the same schedules see their periods done, the caps
   * still hold, new counters come and go */
  tally_schedule *sch;
  tally_tick_result r;
  tally_counter *c;
  REQUIRE_OK(tally_schedule_new(s, "keep.*", 6, 1000, fine, 2, &sch));
  EXPECT_OK(tally_schedule_tick(sch, 9500, NULL, NULL, &r));
  EXPECT_I64(TALLY_TICK_NOT_DUE, r.status);
  EXPECT_OK(tally_schedule_tick(sch, 10000, NULL, NULL, &r));
  EXPECT_I64(TALLY_TICK_RAN, r.status);
  EXPECT(r.counters > 0);
  tally_schedule_free(sch);
  REQUIRE_OK(tu_counter(s, "cap.new", 0, -1, TALLY_COUNTER_CREATE, &c));
  tally_counter_info info;
  EXPECT_OK(tally_counter_info_get(c, &info));
  EXPECT_STR("cap._overflow", info.name);
  tally_counter_close(c);
  REQUIRE_OK(tu_counter(s, "after.1", 3, -1, TALLY_COUNTER_CREATE, &c));
  EXPECT_OK(tally_counter_incr_shard(c, 2, 42));
  EXPECT_I64(42, tu_value(c));
  tally_counter_close(c);
  EXPECT_OK(tally_store_drop(s, "keep.1", 6));
  EXPECT_OK(tally_store_check(s));
  tally_store_close(s);

  /* compacting a compacted store changes nothing a reader sees */
  EXPECT_OK(tally_store_compact(g_path, 0, NULL, NULL));
  REQUIRE_OK(tally_store_open(g_spec, NULL, &s));
  EXPECT_OK(tally_store_check(s));
  REQUIRE_OK(tally_store_stats_get(s, &after));
  EXPECT_I64(0, after.retired_bytes + after.reusable_bytes);
  EXPECT_I64(before.counters, after.counters); /* after.1 in, keep.1 out */
  tally_store_close(s);
  free(a);
}

static void test_busy_while_open(void) {
  int go;
  char pid_text[32];
  pid_t pid = holder(&go);
  snprintf(pid_text, sizeof pid_text, "%ld", (long)pid);
  EXPECT_RC(TALLY_EBUSY, tally_store_compact(g_path, 0, NULL, NULL));
  EXPECT(strstr(tally_errmsg(), pid_text) != NULL);
  EXPECT_RC(TALLY_EBUSY, tally_store_compact(g_path, 0, NULL, NULL)); /* still */
  close(go); /* the child closes its store and exits */
  reap(pid);
  EXPECT_OK(tally_store_compact(g_path, 0, NULL, NULL));

  /* this process, through a handle of its own */
  tally_store *s;
  REQUIRE_OK(tally_store_open(g_spec, NULL, &s));
  EXPECT_RC(TALLY_EBUSY, tally_store_compact(g_path, 0, NULL, NULL));
  EXPECT(strstr(tally_errmsg(), "this process") != NULL);
  tally_store_close(s);
}

static void test_killed_holder(void) {
  int go;
  pid_t pid = holder(&go);
  EXPECT(kill(pid, SIGKILL) == 0);
  siginfo_t info;
  memset(&info, 0, sizeof info); /* dead, but not reaped: a zombie */
  EXPECT(waitid(P_PID, (id_t)pid, &info, WEXITED | WNOWAIT) == 0);
  EXPECT_OK(tally_store_compact(g_path, 0, NULL, NULL));
  close(go);
  reap(pid);
  EXPECT_OK(tally_store_compact(g_path, 0, NULL, NULL));
}

/* A child opens the store, adds 1 to "race" and closes it, again and
 * again; the parent compacts meanwhile. An open that raced with a rename
 * and stayed on the old file would lose its increment. */
static void test_open_races_compaction(void) {
  typedef struct shared {
    atomic_llong acked, refused;
    atomic_int done;
    char why[512]; /* a child's failure */
  } shared;
  shared *sh =
      mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (sh == MAP_FAILED) exit(1);
  pid_t pid = fork();
  if (pid < 0) exit(1);
  if (pid == 0) {
    alarm(60);
    double t0 = tu_now();
    while (tu_now() - t0 < 1.0) {
      tally_store *s;
      tally_counter *c;
      int rc = tally_store_open(g_spec, NULL, &s);
      if (rc == TALLY_EBUSY) { /* replaced under it again and again */
        atomic_fetch_add(&sh->refused, 1);
        continue;
      }
      if (rc == 0 && (rc = tu_counter(s, "race", 0, -1, TALLY_COUNTER_CREATE, &c)) != 0)
        tally_store_close(s);
      if (rc != 0) {
        snprintf(sh->why, sizeof sh->why, "%s: %s", tally_err_name(rc), tally_errmsg());
        break;
      }
      if (tally_counter_incr(c, 1) == 0) atomic_fetch_add(&sh->acked, 1);
      tally_counter_close(c);
      tally_store_close(s);
      struct timespec ts = {0, 300000};
      nanosleep(&ts, NULL);
    }
    atomic_store(&sh->done, 1); /* also after a failure: the parent stops */
    _exit(0);
  }
  int ok = 0, busy = 0, other = 0, st = 0;
  double t0 = tu_now();
  while (!atomic_load(&sh->done) && tu_now() - t0 < 30) {
    int rc = tally_store_compact(g_path, 0, NULL, NULL);
    if (rc == 0)
      ok++;
    else if (rc == TALLY_EBUSY)
      busy++;
    else if (other++ == 0)
      TU_FAIL("compaction during opens: %s (%s)", tally_err_name(rc), tally_errmsg());
    /* back to back, compactions starve the opens (each open that finds
     * the path renamed under it starts again): let one through */
    long long seen = atomic_load(&sh->acked) + atomic_load(&sh->refused);
    for (double t1 = tu_now();
         tu_now() - t1 < 0.5 && !atomic_load(&sh->done) &&
         atomic_load(&sh->acked) + atomic_load(&sh->refused) == seen;) {
      struct timespec ts = {0, 200000};
      nanosleep(&ts, NULL);
    }
  }
  EXPECT(waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0);
  if (sh->why[0]) TU_FAIL("child: %s", sh->why);
  EXPECT(ok > 0);
  EXPECT(atomic_load(&sh->acked) > 0);
  printf("races: %d compactions, %d refused; %lld opens, %lld refused\n", ok, busy,
         (long long)atomic_load(&sh->acked), (long long)atomic_load(&sh->refused));
  tally_store *s;
  tally_counter *c;
  REQUIRE_OK(tally_store_open(g_spec, NULL, &s));
  REQUIRE_OK(tu_counter(s, "race", 0, -1, TALLY_COUNTER_CREATE, &c));
  EXPECT_I64(atomic_load(&sh->acked), tu_value(c));
  tally_counter_close(c);
  EXPECT_OK(tally_store_check(s));
  tally_store_close(s);
  munmap(sh, sizeof *sh);
}

static void test_paths(void) {
  char missing[1300], link[1300];
  snprintf(missing, sizeof missing, "%s/missing.tly", g_dir);
  snprintf(link, sizeof link, "%s/link.tly", g_dir);
  EXPECT_RC(TALLY_EINVAL, tally_store_compact(NULL, 0, NULL, NULL));
  EXPECT_RC(TALLY_EINVAL, tally_store_compact("", 0, NULL, NULL));
  EXPECT_RC(TALLY_EINVAL, tally_store_compact(g_path, 0x100, NULL, NULL));
  EXPECT_FAILS(tally_store_compact(missing, 0, NULL, NULL));
  EXPECT(access(missing, F_OK) != 0); /* not created */

  /* a symlink is compacted only when trusted, and stays a symlink: the
   * file it names is replaced */
  struct stat st;
  EXPECT(symlink("c.tly", link) == 0);
  EXPECT_RC(TALLY_EUNTRUSTED, tally_store_compact(link, 0, NULL, NULL));
  EXPECT_OK(tally_store_compact(link, TALLY_OPEN_TRUST, NULL, NULL));
  EXPECT(lstat(link, &st) == 0 && S_ISLNK(st.st_mode));
  EXPECT(lstat(g_path, &st) == 0 && S_ISREG(st.st_mode));
  tally_store *s;
  REQUIRE_OK(tally_store_open(g_spec, NULL, &s));
  EXPECT_OK(tally_store_check(s));
  tally_store_close(s);

  /* nothing is left beside the store */
  char cmd[1400];
  snprintf(cmd, sizeof cmd, "ls '%s' | grep -q compact", g_dir);
  EXPECT(system(cmd) != 0);
}

/* A compaction SIGKILLed midway leaves its file beside the store; the
 * next compaction removes it, and nothing else there. */
static void die_midway(void *ud, uint64_t done, uint64_t total) {
  (void)ud, (void)done, (void)total;
  raise(SIGKILL);
}

/* The name of the one file named as a compaction names its own ("" if
 * none), into out; how many there are. */
static int leftovers(char *out, size_t size) {
  DIR *d = opendir(g_dir);
  int n = 0;
  out[0] = 0;
  for (struct dirent *e; d && (e = readdir(d));)
    if (strncmp(e->d_name, "c.tly.compact.", 14) == 0 && strlen(e->d_name) == 20) {
      snprintf(out, size, "%s", e->d_name);
      n++;
    }
  if (d) closedir(d);
  return n;
}

static void test_killed_compaction(void) {
  char other[1300], was[64] = "", now[64];
  snprintf(other, sizeof other, "%s/c.tly.compact.notes", g_dir);
  FILE *f = fopen(other, "w");
  EXPECT(f != NULL);
  if (f) fclose(f);
  for (int k = 0; k < 2; k++) { /* the second removes the first's */
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) _exit(tally_store_compact(g_path, 0, die_midway, NULL) ? 2 : 3);
    int st = 0;
    EXPECT(waitpid(pid, &st, 0) == pid && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
    EXPECT_I64(1, leftovers(now, sizeof now));
    EXPECT(strcmp(now, was) != 0);
    snprintf(was, sizeof was, "%s", now);
  }
  EXPECT_OK(tally_store_compact(g_path, 0, NULL, NULL));
  EXPECT_I64(0, leftovers(now, sizeof now));
  EXPECT(access(other, F_OK) == 0); /* another name: kept */
  unlink(other);
  tally_store *s;
  REQUIRE_OK(tally_store_open(g_spec, NULL, &s));
  EXPECT_OK(tally_store_check(s));
  tally_store_close(s);
}

/* A thread compacting again and again while another forks again and
 * again: a compaction opened (and closed) its new store holding the old
 * one's lock, and fork() takes the registry's lock, then every store's,
 * so the two deadlocked within seconds. In a child, under alarm(). */
static atomic_int g_stop;

static void *compactor_main(void *ud) {
  long *n = ud;
  while (!atomic_load(&g_stop)) {
    int rc = tally_store_compact(g_path, 0, NULL, NULL);
    if (rc && rc != TALLY_EBUSY) return (void *)1;
    (*n)++;
  }
  return NULL;
}

static void *forker_main(void *ud) {
  long *n = ud;
  while (!atomic_load(&g_stop)) {
    pid_t pid = fork();
    if (pid == 0) _exit(0);
    if (pid > 0) waitpid(pid, NULL, 0);
    (*n)++;
  }
  return NULL;
}

static int compact_fork_main(void) {
  alarm(20); /* a deadlock ends here, by SIGALRM */
  char other[1200];
  tally_store *o;
  tu_spec(other, sizeof other, NULL, 0, g_dir, "other.tly");
  if (tally_store_open(other, NULL, &o)) return 2; /* the registry holds one more */
  long compacts = 0, forks = 0;
  void *crc = NULL;
  pthread_t a, b;
  pthread_create(&a, NULL, compactor_main, &compacts);
  pthread_create(&b, NULL, forker_main, &forks);
  usleep(3000000);
  atomic_store(&g_stop, 1);
  pthread_join(a, &crc);
  pthread_join(b, NULL);
  tally_store_close(o);
  printf("  3 s of compactions (%ld) beside forks (%ld): no deadlock\n", compacts, forks);
  fflush(stdout);
  return crc ? 3 : compacts > 0 && forks > 0 ? 0 : 4;
}

static void test_compact_beside_fork(void) {
  tu_in_child("compactions beside forks (SIGALRM: a deadlock)", compact_fork_main);
}

int main(void) {
  setenv("TALLY_GRACE_MS", "0", 1); /* reuse at once: the churn leaves free space */
  snprintf(g_dir, sizeof g_dir, "%s", tu_tmpdir("compact"));
  tu_spec(g_spec, sizeof g_spec, g_path, sizeof g_path, g_dir, "c.tly");
  test_compact_keeps_everything();
  test_busy_while_open();
  test_killed_holder();
  test_open_races_compaction();
  test_paths();
  test_killed_compaction();
  test_compact_beside_fork();
  int rc = tu_finish("test_compact");
  if (rc == 0) tu_rmrf(g_dir);
  return rc;
}
