/* test_mutate.c -- pages of a store swapped, duplicated, zeroed and
 * overwritten at random: every read path ends in time, never crashes, and
 * never gives a counter a wrong value it cannot know is wrong.
 *
 * A small file store holds counters of several shard counts (1 to 16, a
 * custom policy so every shard holds part of the value), a family's
 * counters, slot counters written by batches, counters dropped into limbo,
 * resharded ones, and a rollup schedule with history. Each mutant is a copy
 * of it with one or two 4 KiB pages swapped with another, copied over
 * another, zeroed, or filled with a pattern (INT64_MIN, INT64_MAX, the
 * retired sentinel, -1, 0x80 bytes, random words; never words a writer
 * killed mid-add leaves, whose 2 s wait test_damage covers). A forked child
 * opens it and reads everything (value by name and by handle, shards,
 * rolled, history, names, sum, values, snapshot, stats, check), ticks the
 * schedule, runs upkeep, writes (an increment, a create, a reshard, a
 * drop), checks again, closes and compacts it, under alarm(LIMIT_S).
 * A counter whose record and cells lie on pages the mutant left alone must
 * read its true value or fail (ECORRUPT, or ENOENT where its index entry
 * was lost); a wrong value, a hang or a signal (a sanitizer's abort too)
 * fails the test with the seed and the mutation, to run it again:
 * TALLY_MUTATE_SEED=N (default a fixed seed) and TALLY_MUTANTS=N.
 */
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>

#include "testutil.h"

#include "../src/core/internal.h" /* tally__crec, tally__cell_at: where things are */

#define PAGE     4096
#define LIMIT_S  5 /* per mutant: one dead writer's wait (2 s) fits */
#define T0       INT64_C(1700000000000)
#define MAX_CTRS 64

static char g_dir[1024];

struct truth {
  char name[32];
  int64_t value;
  uint64_t pages[2 * TALLY_MAX_SHARDS + 2]; /* record and cell pages */
  uint32_t npages;
};
static struct truth g_t[MAX_CTRS];
static int g_nt;

/* ---- the store -------------------------------------------------------------- */

static void add_custom(tally_store *s, const char *name, uint32_t shards, int64_t v) {
  tally_counter *c;
  REQUIRE_OK(tu_counter(s, name, shards, TALLY_POLICY_CUSTOM, TALLY_COUNTER_CREATE, &c));
  for (uint32_t i = 0; i < shards; i++)
    EXPECT_OK(tally_counter_incr_shard(c, i, v / shards + (i == 0 ? v % shards : 0)));
  tally_counter_close(c);
}

static void add_page(struct truth *t, uint64_t off) {
  for (uint32_t i = 0; i < t->npages; i++)
    if (t->pages[i] == off / PAGE) return;
  t->pages[t->npages++] = off / PAGE;
}

/* The true value and pages of every live counter of the healthy store. */
static int record_truth(void *ud, const char *name, size_t len, int64_t value) {
  tally_store *s = ud;
  struct truth *t = &g_t[g_nt++];
  tally_counter *c;
  snprintf(t->name, sizeof t->name, "%.*s", (int)len, name);
  t->value = value;
  REQUIRE_OK(tally_counter_open(s, name, len, NULL, 0, &c));
  uint64_t rec = tally__crec(c), loc = atomic_load(&c->loc);
  const struct tally__rec *r = tally__at(s, rec);
  add_page(t, rec);
  add_page(t, rec + sizeof *r + r->name_len);
  for (uint32_t i = 0; i < tally__loc_shards(loc); i++)
    add_page(t, (uint64_t)((unsigned char *)tally__cell_at(s, loc, i) - s->base));
  tally_counter_close(c);
  return g_nt == MAX_CTRS;
}

static void build(const char *spec) {
  tally_store *s;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  static const uint32_t shards[] = {1, 2, 4, 16, 3, 7};
  char name[32];
  for (int k = 0; k < 18; k++) {
    snprintf(name, sizeof name, "a:%d", k);
    add_custom(s, name, shards[k % 6], 1000 + 37 * k);
  }
  tally_counter_options fam = {8, TALLY_POLICY_RANDOM};
  REQUIRE_OK(tally_family_set(s, "f:*", 3, &fam));
  for (int k = 0; k < 8; k++) {
    snprintf(name, sizeof name, "f:%d", k);
    for (int i = 0; i < 5; i++)
      EXPECT_OK(tally_store_incr(s, name, strlen(name), 100 + k, TALLY_COUNTER_CREATE));
  }
  tally_counter *sl[2];
  REQUIRE_OK(tu_counter(s, "s:1", TALLY_SLOT_SHARDS, TALLY_POLICY_SLOT,
                        TALLY_COUNTER_CREATE, &sl[0]));
  REQUIRE_OK(tu_counter(s, "s:2", TALLY_SLOT_SHARDS, TALLY_POLICY_SLOT,
                        TALLY_COUNTER_CREATE, &sl[1]));
  const int64_t d[2] = {3, 11};
  for (int i = 0; i < 7; i++) EXPECT_OK(tally_batch_incr(s, sl, d, 2));
  for (int k = 0; k < 10; k++) { /* dropped: in limbo */
    snprintf(name, sizeof name, "gone:%d", k);
    add_custom(s, name, shards[k % 6], 5000 + k);
    EXPECT_OK(tally_store_drop(s, name, strlen(name)));
  }
  tally_counter *c;
  REQUIRE_OK(tu_counter(s, "a:3", 0, -1, 0, &c)); /* its old column in limbo */
  EXPECT_OK(tally_counter_reshard(c, 5));
  tally_counter_close(c);
  tally_ring rings[2] = {{10, 30}, {60, 10}};
  tally_schedule *sch;
  tally_tick_result res;
  REQUIRE_OK(tally_schedule_new(s, "*", 1, 10000, rings, 2, &sch));
  for (int i = 0; i < 6; i++) {
    EXPECT_OK(tally_store_incr(s, "f:1", 3, 1 + i, 0));
    EXPECT_OK(tally_schedule_tick(sch, T0 + i * 10000, NULL, NULL, &res));
  }
  tally_schedule_free(sch);
  tally_counter_close(sl[0]);
  tally_counter_close(sl[1]);
  EXPECT_OK(tally_store_check(s));
  EXPECT_OK(tally_store_snapshot(s, "*", 1, record_truth, s));
  tally_store_close(s);
}

/* ---- mutants ---------------------------------------------------------------- */

enum { OP_SWAP, OP_DUP, OP_ZERO, OP_FILL, OP_KINDS };
static const char *op_names[] = {"swap", "copy", "zero", "fill"};
static const int64_t patterns[] = {
    INT64_MIN, INT64_MAX, -(INT64_C(3) << 61), -1, (int64_t)UINT64_C(0x8080808080808080),
    0};
#define NPAT (sizeof patterns / sizeof *patterns) /* the last: random words */

struct op {
  int kind;
  uint64_t a, b; /* pages: b is the one changed (both for a swap) */
  uint32_t pat;
};

struct mutant {
  struct op ops[2];
  int nops;
  uint64_t seed; /* of the random words */
};

static void describe(const struct mutant *m, char *buf, size_t cap) {
  size_t n = 0;
  for (int i = 0; i < m->nops; i++) {
    const struct op *o = &m->ops[i];
    if (o->kind == OP_FILL)
      n += (size_t)snprintf(buf + n, cap - n, "%sfill page %llu with pattern %u",
                            i ? ", " : "", (unsigned long long)o->b, o->pat);
    else if (o->kind == OP_ZERO)
      n += (size_t)snprintf(buf + n, cap - n, "%szero page %llu", i ? ", " : "",
                            (unsigned long long)o->b);
    else
      n += (size_t)snprintf(buf + n, cap - n, "%s%s page %llu and %llu", i ? ", " : "",
                            op_names[o->kind], (unsigned long long)o->a,
                            (unsigned long long)o->b);
  }
}

static void apply(const struct mutant *m, unsigned char *d) {
  uint64_t rng = m->seed | 1;
  static unsigned char tmp[PAGE];
  for (int i = 0; i < m->nops; i++) {
    const struct op *o = &m->ops[i];
    unsigned char *a = d + o->a * PAGE, *b = d + o->b * PAGE;
    switch (o->kind) {
    case OP_SWAP:
      memcpy(tmp, a, PAGE);
      memcpy(a, b, PAGE);
      memcpy(b, tmp, PAGE);
      break;
    case OP_DUP: memcpy(b, a, PAGE); break;
    case OP_ZERO: memset(b, 0, PAGE); break;
    default:
      for (int w = 0; w < PAGE / 8; w++) {
        int64_t v = patterns[o->pat];
        if (o->pat == NPAT - 1) do
            v = (int64_t)tu_rng(&rng);
          while (tally__cell_inflight(v));
        memcpy(b + w * 8, &v, 8);
      }
    }
  }
}

static bool touched(const struct mutant *m, const struct truth *t) {
  for (int i = 0; i < m->nops; i++)
    for (uint32_t k = 0; k < t->npages; k++)
      if (t->pages[k] == m->ops[i].b ||
          (m->ops[i].kind == OP_SWAP && t->pages[k] == m->ops[i].a))
        return true;
  return false;
}

/* ---- the child's reads -------------------------------------------------------- */

static const struct mutant *g_m;
static int g_wrong;

static const struct truth *truth_of(const char *name, size_t len) {
  for (int i = 0; i < g_nt; i++)
    if (strlen(g_t[i].name) == len && memcmp(g_t[i].name, name, len) == 0) return &g_t[i];
  return NULL;
}

static void judge(const char *how, const char *name, size_t len, int64_t v) {
  const struct truth *t = truth_of(name, len);
  if (t && v != t->value && !touched(g_m, t)) {
    printf("  %s: '%.*s' read %lld, not %lld, its pages untouched\n", how, (int)len, name,
           (long long)v, (long long)t->value);
    g_wrong++;
  }
}

static int judge_fn(void *ud, const char *name, size_t len, int64_t v) {
  judge(ud, name, len, v);
  return 0;
}

static int name_fn(void *ud, const char *name, size_t len) {
  (void)name, (void)len;
  ++*(int *)ud;
  return 0;
}

static void read_all(tally_store *s) {
  int64_t v, vals[TALLY_MAX_SHARDS];
  uint32_t n;
  char name[32];
  for (int i = 0; i < g_nt; i++) {
    const char *nm = g_t[i].name;
    if (tally_store_value(s, nm, strlen(nm), &v) == 0) judge("value", nm, strlen(nm), v);
    tally_counter *c;
    if (tally_counter_open(s, nm, strlen(nm), NULL, 0, &c) != 0) continue;
    if (tally_counter_value(c, &v) == 0) judge("handle", nm, strlen(nm), v);
    if (tally_counter_shards(c, vals, TALLY_MAX_SHARDS, &n) == 0 &&
        n <= TALLY_MAX_SHARDS) {
      int64_t sum = 0;
      for (uint32_t k = 0; k < n; k++) sum += vals[k];
      judge("shards", nm, strlen(nm), sum);
    }
    tally_rollup r;
    tally_bucket b[64];
    (void)tally_counter_rolled(c, &r);
    (void)tally_counter_history(c, 10, b, 64, &n);
    (void)tally_counter_history(c, 60, b, 64, &n);
    tally_counter_close(c);
  }
  for (int k = 0; k < 10; k++) {
    snprintf(name, sizeof name, "gone:%d", k);
    (void)tally_store_value(s, name, strlen(name), &v);
  }
  int names = 0;
  uint64_t count;
  tally_store_stats stats;
  (void)tally_store_each(s, "*", 1, name_fn, &names);
  (void)tally_store_sum(s, "*", 1, &v, &count);
  (void)tally_store_values(s, "*", 1, judge_fn, "values");
  (void)tally_store_snapshot(s, "*", 1, judge_fn, "snapshot");
  (void)tally_store_stats_get(s, &stats);
  (void)tally_store_check(s);
}

static void upkeep_and_writes(tally_store *s) {
  tally_ring rings[2] = {{10, 30}, {60, 10}};
  tally_schedule *sch;
  tally_tick_result res;
  if (tally_schedule_new(s, "*", 1, 10000, rings, 2, &sch) == 0) {
    (void)tally_schedule_tick(sch, T0 + 100000, NULL, NULL, &res);
    tally_schedule_free(sch);
  }
  (void)tally_store_maintain(s, T0 + 200000, 1000, NULL);
  (void)tally_store_incr(s, "f:1", 3, 1, 0);
  (void)tally_store_incr(s, "new:1", 5, 1, TALLY_COUNTER_CREATE);
  tally_counter *c;
  if (tally_counter_open(s, "a:4", 3, NULL, 0, &c) == 0) {
    (void)tally_counter_reshard(c, 6);
    tally_counter_close(c);
  }
  (void)tally_store_drop(s, "a:5", 3);
  (void)tally_store_check(s);
}

static int child(const char *spec, const char *path, const struct mutant *m) {
  g_m = m;
  alarm(LIMIT_S);
  tally_store *s;
  if (tally_store_open(spec, NULL, &s) != 0) return 2; /* refused */
  read_all(s);
  upkeep_and_writes(s);
  tally_store_close(s);
  if (tally_store_compact(path, 0, NULL, NULL) == 0 &&
      tally_store_open(spec, NULL, &s) == 0) {
    (void)tally_store_check(s);
    tally_store_close(s);
  }
  return g_wrong ? 1 : 0;
}

/* ---- the parent ---------------------------------------------------------------- */

static unsigned char *slurp(const char *path, size_t *len) {
  int fd = open(path, O_RDONLY);
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0) return NULL;
  unsigned char *d = malloc((size_t)st.st_size);
  if (d && read(fd, d, (size_t)st.st_size) != st.st_size) d = (free(d), NULL);
  close(fd);
  *len = (size_t)st.st_size;
  return d;
}

static void put(const char *path, const unsigned char *d, size_t len) {
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (fd < 0 || write(fd, d, len) != (ssize_t)len) {
    perror(path);
    exit(1);
  }
  close(fd);
}

int main(void) {
  const char *e = getenv("TALLY_MUTATE_SEED");
  uint64_t seed = e ? strtoull(e, NULL, 0) : UINT64_C(0x5eed35);
  e = getenv("TALLY_MUTANTS");
  int mutants = e ? atoi(e) : 300;
  /* in memory where there is one: compaction's fsync on a disk costs
   * more than all the rest of a mutant */
  snprintf(g_dir, sizeof g_dir, "/dev/shm/tally-mutate-XXXXXX");
  if (!mkdtemp(g_dir)) snprintf(g_dir, sizeof g_dir, "%s", tu_tmpdir("mutate"));
  char spec[1200], path[1100], base[1100];
  tu_spec(spec, sizeof spec, base, sizeof base, g_dir, "base.tly");
  build(spec);
  tu_spec(spec, sizeof spec, path, sizeof path, g_dir, "mutant.tly");
  size_t len;
  unsigned char *orig = slurp(base, &len), *d = malloc(len);
  REQUIRE_OK(orig && d && g_nt == 28 ? 0 : TALLY_ENOMEM);
  uint64_t pages = 0; /* up to the last page with anything on it */
  for (size_t p = 0; p < len / PAGE; p++)
    for (size_t i = 0; i < PAGE; i++)
      if (orig[p * PAGE + i]) {
        pages = p + 1;
        break;
      }
  printf("test_mutate: seed 0x%llx, %d mutants of a store of %d counters on %llu pages\n",
         (unsigned long long)seed, mutants, g_nt, (unsigned long long)pages);
  uint64_t rng = seed;
  int refused = 0, failed = 0, slow = 0;
  double t0 = tu_now(), slowest = 0;
  for (int k = 0; k < mutants; k++) {
    struct mutant m = {.nops = 1 + (int)(tu_rng(&rng) % 4 == 0), .seed = tu_rng(&rng)};
    for (int i = 0; i < m.nops; i++) {
      struct op *o = &m.ops[i];
      o->kind = (int)(tu_rng(&rng) % OP_KINDS);
      o->a = tu_rng(&rng) % pages;
      o->b = tu_rng(&rng) % pages;
      o->pat = (uint32_t)(tu_rng(&rng) % NPAT);
    }
    memcpy(d, orig, len);
    apply(&m, d);
    put(path, d, len);
    fflush(NULL);
    double t = tu_now();
    pid_t pid = fork();
    if (pid == 0) _exit(child(spec, path, &m));
    int st;
    waitpid(pid, &st, 0);
    double took = tu_now() - t;
    slowest = took > slowest ? took : slowest;
    slow += took > 1;
    char what[256];
    describe(&m, what, sizeof what);
    if (WIFEXITED(st) && WEXITSTATUS(st) != 1) {
      refused += WEXITSTATUS(st) == 2;
      continue;
    }
    failed++;
    if (WIFSIGNALED(st))
      TU_FAIL("mutant %d (%s): %s after %.1f s", k, what,
              WTERMSIG(st) == SIGALRM ? "hung" : strsignal(WTERMSIG(st)), took);
    else
      TU_FAIL("mutant %d (%s): a wrong value (above)", k, what);
  }
  printf("test_mutate: %d mutants in %.1f s: %d refused at open, %d failed, %d over 1 s "
         "(slowest %.2f s); again: TALLY_MUTATE_SEED=0x%llx\n",
         mutants, tu_now() - t0, refused, failed, slow, slowest,
         (unsigned long long)seed);
  free(orig);
  free(d);
  tu_rmrf(g_dir);
  return tu_finish("test_mutate");
}
