/* test_redis_flush.c -- exactly-once flushing (src/redis_flush.c) on real servers.
 *
 * Against the standalone server and the 3-master cluster of redis_servers.h:
 *  (a) 4 writers (file stores) x 200 counters, threads incrementing while
 *      flush rounds run; remote totals == local values; the R = 8 shards of
 *      a counter are served by several masters (CLUSTER KEYSLOT, owner);
 *  (b) CLIENT KILL of the flusher's connections in a loop while rounds are
 *      in flight, then a server SIGSTOPped and SIGCONTed mid-run: rounds
 *      report errors, later rounds catch up, totals exact;
 *  (c) a lost reply: the same (prev, new) script run twice (1 then 0), then
 *      the flusher's own retry (already applied), a conflict adopted, and a
 *      delta that would overflow refused;
 *  (d) SIGKILL of a forked flusher with unflushed deltas in its file store;
 *      a new flusher in another process (same writer id) flushes them once;
 *  (e) a cluster master (AOF turned on at runtime) stopped with SIGTERM and
 *      restarted on the same port and node config mid-run: rounds report
 *      errors, then catch up; its data kept, no conflict, totals exact;
 *  (f) idle expiry of a flushed counter: held until w:W is read back, a
 *      lost flush resent first, a late increment (new incarnation) and a
 *      drop and re-create add to the remote total, a bare w:W migrates; a
 *      value back to the last one read back after a later flush (applied,
 *      or its reply lost) is held and put right in Redis;
 *  (g) 2 writer processes, an expirer and a flusher on one file store with
 *      idle expiry: remote totals == increments acknowledged, exactly;
 *  (h) short-lived names, round after round created, flushed, then dropped
 *      or expired: the flusher keeps entries and handles for the live ones
 *      only, and a name made again after its entry went is flushed once.
 * Everything is bounded in time; servers are stopped by PID.
 */
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <sys/mman.h>

#include "../src/net/redis_cluster.h" /* the client: commands, pipelines */
#include "redis_servers.h"
#include "../src/core/internal.h" /* tally__handles_open */

#define NC       200 /* counters per store */
#define R        8   /* remote shards */
#define NWRITERS 4   /* (a) */

struct target {
  const char *label;
  bool cluster;
  char seeds[64];
  int stop_idx; /* server to SIGSTOP in (b) */
};

/* ---- helpers ---------------------------------------------------------------- */

static tally_store *open_store(const char *name) {
  char spec[1400];
  snprintf(spec, sizeof spec, "file:%s/%s", g_dir, name);
  tally_store *s;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  return s;
}

static void open_counters(tally_store *s, const char *prefix, tally_counter **cs) {
  for (int i = 0; i < NC; i++) {
    char name[64];
    snprintf(name, sizeof name, "%s%d", prefix, i);
    REQUIRE_OK(tu_counter(s, name, 4, TALLY_POLICY_THREAD, TALLY_COUNTER_CREATE, &cs[i]));
  }
}

static void close_counters(tally_counter **cs) {
  for (int i = 0; i < NC; i++) tally_counter_close(cs[i]);
}

static void add_stats(tally_flush_stats *sum, const tally_flush_stats *st) {
  sum->counters += st->counters;
  sum->unchanged += st->unchanged;
  sum->flushed += st->flushed;
  sum->already += st->already;
  sum->conflicts += st->conflicts;
  sum->errors += st->errors;
  sum->commands += st->commands;
  sum->bytes += st->bytes;
  sum->delta += st->delta;
}

static void print_stats(const char *what, int rounds, const tally_flush_stats *s) {
  printf("  %s: %d rounds, flushed %llu, already %llu, conflicts %llu, errors %llu, "
         "commands %llu, %llu bytes, delta %lld\n",
         what, rounds, (unsigned long long)s->flushed, (unsigned long long)s->already,
         (unsigned long long)s->conflicts, (unsigned long long)s->errors,
         (unsigned long long)s->commands, (unsigned long long)s->bytes,
         (long long)s->delta);
}

/* Rounds until one has nothing to do and no failure; the number of rounds,
 * or -1 if that did not happen within max_secs. */
static int flush_clean(tally_flusher *f, const char *pat, double max_secs,
                       tally_flush_stats *sum) {
  double end = tu_now() + max_secs;
  for (int n = 1; tu_now() < end; n++) {
    tally_flush_stats st;
    int code = tally_flusher_run(f, pat, strlen(pat), &st);
    if (sum) add_stats(sum, &st);
    if (code == 0 && st.flushed == 0 && st.already == 0 && st.conflicts == 0 &&
        st.errors == 0)
      return n;
    if (code) usleep(50000); /* a failing node: back off a little */
  }
  TU_FAIL("flush rounds on %s did not settle within %.0f s", pat, max_secs);
  return -1;
}

/* Remote total of prefix<i> == the sum of the local values in stores. */
static void check_exact(tally_flusher *f, const char *prefix, tally_counter **cs[],
                        int nstores) {
  int bad = 0;
  long long total = 0;
  for (int i = 0; i < NC; i++) {
    char name[64];
    snprintf(name, sizeof name, "%s%d", prefix, i);
    int64_t local = 0, remote = INT64_MIN;
    for (int s = 0; s < nstores; s++) local += tu_value(cs[s][i]);
    EXPECT_OK(tally_flusher_remote_value(f, name, strlen(name), &remote));
    if (local != remote && bad++ < 5)
      TU_FAIL("%s: local %lld, remote %lld", name, (long long)local, (long long)remote);
    total += local;
  }
  EXPECT_I64(0, bad);
  printf("  %s*: %d counters exact, total %lld\n", prefix, NC - bad, total);
}

/* ---- incrementing threads ------------------------------------------------------ */

struct incr_arg {
  tally_counter **cs;
  atomic_bool *stop;
  uint64_t seed;
  long long n;
};

static void *incr_thread(void *ud) {
  struct incr_arg *a = ud;
  double end = tu_now() + 30; /* bound, whatever happens */
  while (!atomic_load(a->stop) && tu_now() < end) {
    for (int k = 0; k < 256; k++) {
      uint64_t r = tu_rng(&a->seed);
      if (tally_counter_incr(a->cs[r % NC], (int64_t)(r >> 60) + 1) != 0) {
        TU_FAIL("local incr failed: %s", tally_errmsg());
        return NULL;
      }
      a->n++;
    }
  }
  return NULL;
}

/* ---- (a) concurrent writers ------------------------------------------------------ */

static void test_concurrent(const struct target *t) {
  printf("(a) %s: %d writers x %d counters, R = %d\n", t->label, NWRITERS, NC, R);
  tally_rc *rc;
  REQUIRE_OK(tally_rc_open(t->seeds, 2000, &rc));
  tally_store *st[NWRITERS];
  tally_counter *cs0[NWRITERS][NC];
  tally_counter **cs[NWRITERS];
  tally_flusher *f[NWRITERS];
  bool used[R] = {false};
  int cand = 0;
  for (int w = 0; w < NWRITERS; w++) {
    char name[64];
    snprintf(name, sizeof name, "a-%s-%d.tly", t->label, w);
    st[w] = open_store(name);
    cs[w] = cs0[w];
    open_counters(st[w], "a:", cs[w]);
    /* writers on distinct remote shards */
    for (;;) {
      char id[64];
      snprintf(id, sizeof id, "writer-a-%s-%d", t->label, cand++);
      REQUIRE_OK(tally_flusher_new(st[w], rc, id, R, &f[w]));
      uint32_t sh = tally_flusher_shard(f[w]);
      if (!used[sh]) {
        used[sh] = true;
        break;
      }
      tally_flusher_free(f[w]);
    }
  }
  atomic_bool stop = false;
  pthread_t th[NWRITERS * 2];
  struct incr_arg args[NWRITERS * 2];
  for (int i = 0; i < NWRITERS * 2; i++) {
    args[i] =
        (struct incr_arg){cs[i / 2], &stop, 0x9e3779b97f4a7c15ull * (uint64_t)(i + 1), 0};
    pthread_create(&th[i], NULL, incr_thread, &args[i]);
  }
  tally_flush_stats sum = {0};
  int rounds = 0;
  double t0 = tu_now();
  while (tu_now() - t0 < 1.0) {
    for (int w = 0; w < NWRITERS; w++) {
      tally_flush_stats s;
      EXPECT_OK(tally_flusher_run(f[w], "a:*", 3, &s));
      add_stats(&sum, &s);
      EXPECT_I64(0, s.errors);
      EXPECT_I64(0, s.conflicts);
    }
    rounds++;
  }
  atomic_store(&stop, true);
  long long incs = 0;
  for (int i = 0; i < NWRITERS * 2; i++) {
    pthread_join(th[i], NULL);
    incs += args[i].n;
  }
  print_stats("during increments", rounds, &sum);
  printf("  %lld local increments, %.0f per second\n", incs, incs / (tu_now() - t0));
  EXPECT(sum.flushed > NC);
  for (int w = 0; w < NWRITERS; w++) EXPECT(flush_clean(f[w], "a:*", 20, NULL) > 0);
  check_exact(f[0], "a:", cs, NWRITERS);

  if (t->cluster) {
    /* slots as Redis computes them, and the masters holding the shards */
    char key[300];
    int masters_all[NMASTERS + 1] = {0}, spread = 0, held_bad = 0;
    for (int i = 0; i < NC; i++) {
      char name[64];
      snprintf(name, sizeof name, "a:%d", i);
      int seen[NMASTERS + 1] = {0}, nseen = 0;
      for (uint32_t sh = 0; sh < R; sh++) {
        int klen = tally_flusher_shard_key(name, strlen(name), sh, key, sizeof key);
        EXPECT(klen > 0);
        uint16_t slot = tally_rc_keyslot(key, (size_t)klen);
        if (i == 0) {
          redisReply *r = rawcmd(g_ports[1], "CLUSTER KEYSLOT %s", key);
          EXPECT(r->type == REDIS_REPLY_INTEGER && r->integer == slot);
          freeReplyObject(r);
        }
        if (!used[sh]) continue;
        int m = owner(slot);
        redisReply *r =
            rawcmd(g_ports[m], "HGET %s v", key); /* no MOVED: it lives there */
        if (r->type != REDIS_REPLY_STRING) held_bad++;
        freeReplyObject(r);
        if (!seen[m]++) nseen++;
        masters_all[m]++;
      }
      if (nseen >= 2) spread++;
    }
    printf("  cluster: %d of %d counters have their shards on >= 2 masters; "
           "shards per master %d %d %d\n",
           spread, NC, masters_all[1], masters_all[2], masters_all[3]);
    EXPECT_I64(0, held_bad);
    EXPECT(spread > NC / 2);
    for (int m = 1; m <= NMASTERS; m++) EXPECT(masters_all[m] > 0);
  }
  for (int w = 0; w < NWRITERS; w++) {
    tally_flusher_free(f[w]);
    close_counters(cs[w]);
    tally_store_close(st[w]);
  }
  tally_rc_close(rc);
}

/* ---- (b) faults ----------------------------------------------------------------- */

struct chaos_arg {
  const struct target *t;
  atomic_bool done;
  long long kills;
};

static void *chaos_thread(void *ud) {
  struct chaos_arg *a = ud;
  int first = a->t->cluster ? 1 : 0, last = a->t->cluster ? NMASTERS : 0;
  redisContext *c[NMASTERS + 1] = {0};
  for (int m = first; m <= last; m++) c[m] = raw(g_ports[m]);
  /* 1 s of CLIENT KILL, every few ms, rounds in flight or not */
  double t0 = tu_now();
  while (tu_now() - t0 < 1.0) {
    for (int m = first; m <= last; m++) {
      if (!c[m]) continue;
      redisReply *r = redisCommand(c[m], "CLIENT KILL TYPE normal SKIPME yes");
      if (r && r->type == REDIS_REPLY_INTEGER) a->kills += r->integer;
      if (r) freeReplyObject(r);
    }
    usleep(3000);
  }
  for (int m = first; m <= last; m++)
    if (c[m]) redisFree(c[m]);
  /* a server stopped for 0.8 s (under the cluster node timeout) */
  usleep(200000);
  kill(g_pids[a->t->stop_idx], SIGSTOP);
  usleep(800000);
  kill(g_pids[a->t->stop_idx], SIGCONT);
  usleep(300000);
  atomic_store(&a->done, true);
  return NULL;
}

static void test_faults(const struct target *t) {
  printf("(b) %s: CLIENT KILL loop, then server on %d stopped 0.8 s\n", t->label,
         g_ports[t->stop_idx]);
  tally_rc *rc;
  REQUIRE_OK(tally_rc_open(t->seeds, 300, &rc));
  char sname[64];
  snprintf(sname, sizeof sname, "b-%s.tly", t->label);
  tally_store *s = open_store(sname);
  tally_counter *cs0[NC], **cs[1] = {cs0};
  open_counters(s, "b:", cs0);
  char id[64];
  snprintf(id, sizeof id, "writer-b-%s", t->label);
  tally_flusher *f;
  REQUIRE_OK(tally_flusher_new(s, rc, id, R, &f));

  atomic_bool stop = false;
  pthread_t th[2];
  struct incr_arg args[2];
  for (int i = 0; i < 2; i++) {
    args[i] = (struct incr_arg){cs0, &stop, 0x1234567ull * (uint64_t)(i + 3), 0};
    pthread_create(&th[i], NULL, incr_thread, &args[i]);
  }
  struct chaos_arg ca = {.t = t};
  pthread_t chaos;
  pthread_create(&chaos, NULL, chaos_thread, &ca);
  tally_flush_stats sum = {0};
  int rounds = 0, failed = 0;
  double t0 = tu_now();
  while (!atomic_load(&ca.done) && tu_now() - t0 < 20) {
    tally_flush_stats st;
    if (tally_flusher_run(f, "b:*", 3, &st) != 0) failed++;
    add_stats(&sum, &st);
    rounds++;
  }
  pthread_join(chaos, NULL);
  atomic_store(&stop, true);
  for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
  print_stats("under faults", rounds, &sum);
  tally_rc_stats rs;
  tally_rc_stats_get(rc, &rs);
  printf("  %d rounds failed, %lld connections killed, client: %llu reconnects, "
         "%llu errors\n",
         failed, ca.kills, (unsigned long long)rs.reconnects,
         (unsigned long long)rs.errors);
  EXPECT(failed > 0);
  EXPECT(sum.errors > 0);
  EXPECT(ca.kills > 0);
  tally_flush_stats after = {0};
  int n = flush_clean(f, "b:*", 20, &after);
  EXPECT(n > 0);
  print_stats("catching up", n, &after);
  check_exact(f, "b:", cs, 1);
  tally_flusher_free(f);
  close_counters(cs0);
  tally_store_close(s);
  tally_rc_close(rc);
}

/* ---- (c) a lost reply, retried ---------------------------------------------------- */

/* EVAL the flush script as the flusher would; the reply (caller frees). */
/* w:W as the flusher writes it for incarnation inc */
static const char *field(char *buf, uint64_t inc, long long v) {
  snprintf(buf, 40, "%016llx:%lld", (unsigned long long)inc, v);
  return buf;
}

/* The flusher's script, as it sends it for (prev, next) of incarnation inc. */
static redisReply *eval(tally_rc *rc, const char *key, const char *w, uint64_t inc,
                        long long prev, long long next) {
  char sp[40], sn[40], sd[24];
  field(sp, inc, prev);
  field(sn, inc, next);
  snprintf(sd, sizeof sd, "%lld", next - prev);
  const char *argv[] = {"EVAL", tally_flusher_script(), "1", key, w, sp, sn, sd};
  redisReply *r = NULL;
  EXPECT_OK(tally_rc_command(rc, key, strlen(key), 8, argv, NULL, &r));
  return r;
}

static bool is_int(const redisReply *r, long long v) {
  return r && r->type == REDIS_REPLY_INTEGER && r->integer == v;
}

/* Does w:W of key read `want`? */
static bool hget_is(tally_rc *rc, const char *key, const char *w, const char *want) {
  char wf[200];
  snprintf(wf, sizeof wf, "w:%s", w);
  const char *argv[] = {"HGET", key, wf};
  redisReply *r = NULL;
  EXPECT_OK(tally_rc_command(rc, key, strlen(key), 3, argv, NULL, &r));
  bool ok = r && r->type == REDIS_REPLY_STRING && strcmp(r->str, want) == 0;
  if (!ok)
    TU_FAIL("HGET %s %s: %s, expected %s", key, wf,
            r && r->type == REDIS_REPLY_STRING ? r->str : "not a string", want);
  freeReplyObject(r);
  return ok;
}

static int64_t remote(tally_flusher *f, const char *name) {
  int64_t v = INT64_MIN;
  EXPECT_OK(tally_flusher_remote_value(f, name, strlen(name), &v));
  return v;
}

static void test_lost_reply(const struct target *t) {
  printf("(c) %s: lost replies, conflicts, overflow\n", t->label);
  tally_rc *rc;
  REQUIRE_OK(tally_rc_open(t->seeds, 2000, &rc));
  char sname[64], id[64], key[300];
  snprintf(sname, sizeof sname, "c-%s.tly", t->label);
  snprintf(id, sizeof id, "writer-c-%s", t->label);
  tally_store *s = open_store(sname);
  tally_counter *c;
  REQUIRE_OK(tu_counter(s, "c:x", 2, TALLY_POLICY_THREAD, TALLY_COUNTER_CREATE, &c));
  tally_flusher *f;
  REQUIRE_OK(tally_flusher_new(s, rc, id, R, &f));
  EXPECT(tally_flusher_shard_key("c:x", 3, tally_flusher_shard(f), key, sizeof key) > 0);
  tally_flush_stats st;

  EXPECT_OK(tally_counter_incr(c, 10));
  EXPECT_OK(tally_flusher_run(f, "c:*", 3, &st));
  EXPECT_I64(1, st.flushed);
  EXPECT_I64(2, st.commands); /* HGET, then EVAL */
  EXPECT_I64(10, remote(f, "c:x"));
  uint64_t inc = 0;
  int64_t v = 0;
  EXPECT_OK(tally_counter_read(c, &v, &inc));
  char want[40];
  EXPECT(hget_is(rc, key, id, field(want, inc, 10))); /* w:W names the incarnation */

  /* the flusher's next send (10 -> 25) reached Redis but its reply was lost:
   * run it here, twice, as a retry would */
  EXPECT_OK(tally_counter_incr(c, 15));
  redisReply *r = eval(rc, key, id, inc, 10, 25);
  EXPECT(is_int(r, 1));
  freeReplyObject(r);
  r = eval(rc, key, id, inc, 10, 25);
  EXPECT(is_int(r, 0)); /* already applied */
  freeReplyObject(r);
  EXPECT_I64(25, remote(f, "c:x"));
  /* the flusher still believes prev = 10: its round is that retry */
  EXPECT_OK(tally_flusher_run(f, "c:*", 3, &st));
  EXPECT_I64(0, st.flushed);
  EXPECT_I64(1, st.already);
  EXPECT_I64(25, remote(f, "c:x"));
  EXPECT_OK(tally_flusher_run(f, "c:*", 3, &st)); /* quiet: w:W read back once */
  EXPECT_I64(1, st.unchanged);
  EXPECT_I64(1, st.commands);
  EXPECT_OK(tally_flusher_run(f, "c:*", 3, &st));
  EXPECT_I64(1, st.unchanged);
  EXPECT_I64(0, st.commands);

  /* a stale prev: the script answers the current w:W and changes nothing */
  r = eval(rc, key, id, inc, 3, 30);
  EXPECT(r && r->type == REDIS_REPLY_STRING && strcmp(r->str, field(want, inc, 25)) == 0);
  freeReplyObject(r);
  EXPECT_I64(25, remote(f, "c:x"));

  /* lost reply, then more increments before the next round: a conflict,
   * prev adopted, applied in the round after */
  EXPECT_OK(tally_counter_incr(c, 7)); /* 32 */
  r = eval(rc, key, id, inc, 25, 32);
  EXPECT(is_int(r, 1));
  freeReplyObject(r);
  EXPECT_OK(tally_counter_incr(c, 3)); /* 35 */
  EXPECT_OK(tally_flusher_run(f, "c:*", 3, &st));
  EXPECT_I64(1, st.conflicts);
  EXPECT_I64(32, remote(f, "c:x"));
  EXPECT_OK(tally_flusher_run(f, "c:*", 3, &st));
  EXPECT_I64(1, st.flushed);
  EXPECT_I64(3, st.delta);
  EXPECT_I64(35, remote(f, "c:x"));
  EXPECT_I64(35, tu_value(c));

  /* a restarted flusher (empty cache) reads w:W and sends nothing */
  tally_flusher_free(f);
  REQUIRE_OK(tally_flusher_new(s, rc, id, R, &f));
  EXPECT_OK(tally_flusher_run(f, "c:*", 3, &st));
  EXPECT_I64(1, st.unchanged);
  EXPECT_I64(1, st.commands);

  /* a delta that does not fit in int64 is refused, nothing sent */
  tally_counter *big;
  REQUIRE_OK(tu_counter(s, "c:big", 1, TALLY_POLICY_THREAD, TALLY_COUNTER_CREATE, &big));
  EXPECT_OK(tally_counter_incr(big, 4000000000000000000LL));
  char bkey[300];
  EXPECT(tally_flusher_shard_key("c:big", 5, tally_flusher_shard(f), bkey, sizeof bkey) >
         0);
  const char *hset[] = {"HSET", bkey, "", "-9000000000000000000"};
  char wf[100];
  snprintf(wf, sizeof wf, "w:%s", id);
  hset[2] = wf;
  EXPECT_OK(tally_rc_command(rc, bkey, strlen(bkey), 4, hset, NULL, &r));
  freeReplyObject(r);
  EXPECT_RC(TALLY_ERANGE, tally_flusher_run(f, "c:*", 3, &st));
  EXPECT_I64(1, st.errors);
  EXPECT_I64(0, st.flushed);
  EXPECT(strstr(tally_errmsg(), "overflows") != NULL);
  EXPECT_I64(0, remote(f, "c:big"));
  tally_counter_close(big);
  EXPECT_OK(tally_store_drop(s, "c:big", 5));
  EXPECT_OK(tally_flusher_run(f, "c:*", 3, &st));
  EXPECT_I64(0, st.errors);
  EXPECT_I64(1, st.counters);

  /* bad arguments */
  tally_flusher *g = (tally_flusher *)1;
  EXPECT_RC(TALLY_EINVAL, tally_flusher_new(s, rc, "", R, &g));
  EXPECT(g == NULL);
  EXPECT_RC(TALLY_ESHARDS, tally_flusher_new(s, rc, "w", 0, &g));
  EXPECT_RC(TALLY_EINVAL, tally_flusher_remote_value(f, "", 0, &(int64_t){0}));

  tally_flusher_free(f);
  tally_counter_close(c);
  tally_store_close(s);
  tally_rc_close(rc);
}

/* ---- (d) SIGKILL with unflushed deltas ------------------------------------------ */

/* Increments and flushes until killed; after 10 rounds it increments once
 * more and says "ready"; with hold it then waits unflushed. */
static void child_flusher(const struct target *t, const char *sname, const char *id,
                          int wfd, bool hold) {
  memset(g_pids, 0, sizeof g_pids); /* an exit() here must not stop the servers */
  tally_store *s = open_store(sname);
  g_dir = NULL;
  tally_counter *cs[NC];
  open_counters(s, "d:", cs);
  tally_rc *rc;
  tally_flusher *f;
  if (tally_rc_open(t->seeds, 2000, &rc) || tally_flusher_new(s, rc, id, R, &f)) _exit(2);
  double end = tu_now() + 15;
  for (int k = 0; tu_now() < end; k++) {
    for (int i = 0; i < NC; i++)
      if (tally_counter_incr(cs[i], k % 3 + 1)) _exit(3);
    if (k == 10) {
      if (write(wfd, "r", 1) != 1) _exit(4);
      while (hold && tu_now() < end) usleep(10000);
    }
    tally_flusher_run(f, "d:*", 3, NULL);
  }
  _exit(5); /* never reached in time: the parent kills it */
}

static void test_sigkill(const struct target *t) {
  printf("(d) %s: SIGKILL of a flushing process\n", t->label);
  char sname[64], id[64];
  snprintf(sname, sizeof sname, "d-%s.tly", t->label);
  snprintf(id, sizeof id, "writer-d-%s", t->label);
  static const int delays_us[] = {0, 700, 3000, 20000};
  for (int it = 0; it < 4; it++) {
    int pfd[2];
    REQUIRE_OK(pipe(pfd) == 0 ? 0 : TALLY_ESYS);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
      close(pfd[0]);
      child_flusher(t, sname, id, pfd[1], it == 0);
    }
    close(pfd[1]);
    struct pollfd p = {.fd = pfd[0], .events = POLLIN};
    char b;
    bool ready = poll(&p, 1, 10000) == 1 && read(pfd[0], &b, 1) == 1;
    EXPECT(ready);
    if (delays_us[it]) usleep((useconds_t)delays_us[it]);
    kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
    close(pfd[0]);
    EXPECT(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);

    /* a new flusher, in this process, same writer id */
    tally_store *s = open_store(sname);
    tally_counter *cs0[NC], **cs[1] = {cs0};
    open_counters(s, "d:", cs0);
    tally_rc *rc;
    REQUIRE_OK(tally_rc_open(t->seeds, 2000, &rc));
    tally_flusher *f;
    REQUIRE_OK(tally_flusher_new(s, rc, id, R, &f));
    long long local = 0, rem = 0;
    int behind = 0;
    for (int i = 0; i < NC; i++) {
      char name[32];
      snprintf(name, sizeof name, "d:%d", i);
      int64_t v = tu_value(cs0[i]), r = remote(f, name);
      local += v;
      rem += r;
      behind += v != r;
    }
    tally_flush_stats sum = {0};
    int n = flush_clean(f, "d:*", 20, &sum);
    printf("  kill after %d us: %d counters behind, %lld unflushed; recovered in %d "
           "rounds (flushed %llu, already %llu)\n",
           delays_us[it], behind, local - rem, n, (unsigned long long)sum.flushed,
           (unsigned long long)sum.already);
    EXPECT(n > 0);
    EXPECT(it == 0 ? local > rem : local >= rem); /* 0: killed while holding deltas */
    EXPECT_I64(local - rem, sum.delta);
    check_exact(f, "d:", cs, 1);
    tally_flusher_free(f);
    tally_rc_close(rc);
    close_counters(cs0);
    tally_store_close(s);
  }
}

/* The slot of a counter's remote shard moves between masters while flush
 * rounds run: the rounds follow ASK and MOVED, and the remote total stays
 * the local one, exactly. */
static void test_migration(const struct target *t) {
  tally_store *s = open_store("migrate.tly");
  tally_counter *c;
  REQUIRE_OK(tu_counter(s, "mig:x", 4, TALLY_POLICY_THREAD, TALLY_COUNTER_CREATE, &c));
  tally_rc *rc;
  REQUIRE_OK(tally_rc_open(t->seeds, 2000, &rc));
  tally_flusher *f;
  REQUIRE_OK(tally_flusher_new(s, rc, "w-migrate", 1, &f));
  char key[128];
  int klen = tally_flusher_shard_key("mig:x", 5, 0, key, sizeof key);
  EXPECT(klen > 0);
  uint16_t slot = tally_rc_keyslot(key, (size_t)klen);
  int from = owner(slot), to = from % NMASTERS + 1;
  int64_t v;
  tally_flush_stats st;

  REQUIRE_OK(tally_counter_incr(c, 100));
  EXPECT(flush_clean(f, "mig:*", 10, NULL) > 0);
  redisReply *r =
      rawcmd(g_ports[to], "CLUSTER SETSLOT %u IMPORTING %s", slot, g_ids[from]);
  freeReplyObject(r);
  r = rawcmd(g_ports[from], "CLUSTER SETSLOT %u MIGRATING %s", slot, g_ids[to]);
  freeReplyObject(r);
  REQUIRE_OK(tally_counter_incr(c, 50));
  EXPECT_OK(tally_flusher_run(f, "mig:*", 5, &st)); /* still on `from` */
  r = rawcmd(g_ports[from], "MIGRATE 127.0.0.1 %d %s 0 5000", g_ports[to], key);
  EXPECT(r->type == REDIS_REPLY_STATUS);
  freeReplyObject(r);
  REQUIRE_OK(tally_counter_incr(c, 25));
  EXPECT_OK(tally_flusher_run(f, "mig:*", 5, &st)); /* moved away: ASK */
  for (int m = 1; m <= NMASTERS; m++) {
    r = rawcmd(g_ports[m], "CLUSTER SETSLOT %u NODE %s", slot, g_ids[to]);
    freeReplyObject(r);
  }
  REQUIRE_OK(tally_counter_incr(c, 10));
  EXPECT(flush_clean(f, "mig:*", 10, NULL) > 0); /* `from` says MOVED */
  tally_rc_stats rs;
  tally_rc_stats_get(rc, &rs);
  EXPECT(rs.asked > 0);
  EXPECT(rs.moved > 0);
  EXPECT_OK(tally_flusher_remote_value(f, "mig:x", 5, &v));
  EXPECT_I64(185, v);
  r = rawcmd(g_ports[to], "HGET %s v", key); /* it lives on `to` now */
  EXPECT(r->type == REDIS_REPLY_STRING && atoll(r->str) == 185);
  freeReplyObject(r);
  EXPECT_I64(to, owner(slot));
  printf("  migration during flushes: %llu ASK, %llu MOVED followed; exact\n",
         (unsigned long long)rs.asked, (unsigned long long)rs.moved);
  tally_flusher_free(f);
  tally_rc_close(rc);
  tally_counter_close(c);
  tally_store_close(s);
}

/* ---- (e) a master stopped and restarted mid-run ------------------------------------ */

#define NRS 8 /* counters, R = 1 */

/* INFO persistence on port shows the AOF on and no rewrite pending. */
static bool wait_aof_on(int port, double secs) {
  double end = tu_now() + secs;
  while (tu_now() < end) {
    redisReply *r = rawcmd(port, "INFO persistence");
    bool ok = r->type == REDIS_REPLY_STRING && strstr(r->str, "aof_enabled:1") &&
              strstr(r->str, "aof_rewrite_in_progress:0") &&
              strstr(r->str, "aof_rewrite_scheduled:0");
    freeReplyObject(r);
    if (ok) return true;
    usleep(20000);
  }
  return false;
}

static bool status_ok(redisReply *r) {
  bool ok = r->type == REDIS_REPLY_STATUS && strcmp(r->str, "OK") == 0;
  freeReplyObject(r);
  return ok;
}

/* One increment of every counter, then a round; the round's code. */
static int incr_and_run(tally_flusher *f, tally_counter **cs, int k,
                        tally_flush_stats *sum) {
  for (int i = 0; i < NRS; i++)
    if (tally_counter_incr(cs[i], k % 3 + 1) != 0)
      TU_FAIL("local incr: %s", tally_errmsg());
  tally_flush_stats st;
  int code = tally_flusher_run(f, "rs:*", 4, &st);
  add_stats(sum, &st);
  return code;
}

/* The master serving some counters' (only) remote shard is stopped with
 * SIGTERM and restarted on the same port and node config, its data kept in
 * an AOF turned on at runtime; rounds meanwhile report errors, then catch
 * up, exactly, with no conflict (a master back empty would show one). */
static void test_restart(const struct target *t) {
  double t0 = tu_now();
  tally_store *s = open_store("restart.tly");
  tally_counter *cs[NRS];
  char keys[NRS][128];
  int on[NRS], nvictim = 0;
  for (int i = 0; i < NRS; i++) {
    char name[32];
    snprintf(name, sizeof name, "rs:%d", i);
    REQUIRE_OK(tu_counter(s, name, 2, TALLY_POLICY_THREAD, TALLY_COUNTER_CREATE, &cs[i]));
    int klen = tally_flusher_shard_key(name, strlen(name), 0, keys[i], sizeof keys[i]);
    EXPECT(klen > 0);
    on[i] = owner(tally_rc_keyslot(keys[i], (size_t)klen));
  }
  int m = on[0], port = g_ports[m];
  for (int i = 0; i < NRS; i++) nvictim += on[i] == m;
  printf("(e) %s: master on %d stopped and restarted mid-run (%d of %d counters "
         "there)\n",
         t->label, port, nvictim, NRS);
  EXPECT(nvictim > 0 && nvictim < NRS);

  /* persistence on that master only, from now on */
  EXPECT(status_ok(rawcmd(port, "CONFIG SET appendonly yes")));
  EXPECT(status_ok(rawcmd(port, "CONFIG SET appendfsync always")));
  double t1 = tu_now();
  EXPECT(wait_aof_on(port, 20));
  double t_aof = tu_now() - t1;

  tally_rc *rc;
  REQUIRE_OK(tally_rc_open(t->seeds, 300, &rc));
  tally_flusher *f;
  REQUIRE_OK(tally_flusher_new(s, rc, "w-restart", 1, &f));
  tally_flush_stats before_st = {0}, down_st = {0}, after_st = {0};
  int k = 0, rounds_up = 0;
  for (t1 = tu_now(); tu_now() - t1 < 0.3; k++, rounds_up++)
    EXPECT_OK(incr_and_run(f, cs, k, &before_st));

  /* what the master holds when it is stopped (no round in flight) */
  long long held[NRS] = {0};
  for (int i = 0; i < NRS; i++) {
    if (on[i] != m) continue;
    redisReply *r = rawcmd(port, "HGET %s v", keys[i]);
    EXPECT(r->type == REDIS_REPLY_STRING);
    if (r->type == REDIS_REPLY_STRING) held[i] = atoll(r->str);
    freeReplyObject(r);
  }
  t1 = tu_now();
  EXPECT(stop_server(m, 10));
  double t_stop = tu_now() - t1;

  /* ~1 s down: rounds fail for its counters, the others still flush */
  int rounds_down = 0, failed = 0;
  for (t1 = tu_now(); tu_now() - t1 < 1.0; k++, rounds_down++) {
    if (incr_and_run(f, cs, k, &down_st) != 0) failed++;
    usleep(10000);
  }
  EXPECT(failed > 0);
  EXPECT(down_st.errors > 0);
  EXPECT(down_st.flushed > 0); /* the other masters' counters */

  t1 = tu_now();
  if (!restart_server(m, 15)) {
    fprintf(stderr, "FATAL: redis-server on %d did not restart (see %s)\n", port, g_dir);
    exit(1);
  }
  double t_ping = tu_now() - t1;
  for (int n = 1; n <= NMASTERS; n++)
    EXPECT(wait_for(g_ports[n], "CLUSTER INFO", "cluster_state:ok", 30));
  double t_ok = tu_now() - t1;
  redisReply *r = rawcmd(port, "CLUSTER MYID");
  EXPECT(r->type == REDIS_REPLY_STRING && strcmp(r->str, g_ids[m]) == 0); /* same node */
  freeReplyObject(r);
  EXPECT_I64(m, owner(tally_rc_keyslot(keys[0], strlen(keys[0]))));
  for (int i = 0; i < NRS; i++) {
    if (on[i] != m) continue;
    r = rawcmd(port, "HGET %s v", keys[i]);
    EXPECT(r->type == REDIS_REPLY_STRING && atoll(r->str) == held[i]); /* kept */
    freeReplyObject(r);
  }

  int n = flush_clean(f, "rs:*", 20, &after_st);
  EXPECT(n > 0);
  EXPECT_I64(0, before_st.conflicts + down_st.conflicts + after_st.conflicts);
  EXPECT_I64(0, before_st.already + down_st.already + after_st.already);
  EXPECT(after_st.flushed >= (uint64_t)nvictim);
  int bad = 0;
  long long total = 0;
  for (int i = 0; i < NRS; i++) {
    char name[32];
    snprintf(name, sizeof name, "rs:%d", i);
    int64_t local = tu_value(cs[i]), rem = INT64_MIN;
    EXPECT_OK(tally_flusher_remote_value(f, name, strlen(name), &rem));
    if (local != rem) {
      bad++;
      TU_FAIL("%s: local %lld, remote %lld", name, (long long)local, (long long)rem);
    }
    total += local;
  }
  print_stats("up", rounds_up, &before_st);
  print_stats("down", rounds_down, &down_st);
  print_stats("catching up", n, &after_st);
  printf("  AOF on in %.2f s; stopped in %.2f s; %d of %d rounds failed while down; "
         "restarted (PING) in %.2f s, cluster_state:ok in %.2f s; %d counters exact, "
         "total %lld (%.2f s)\n",
         t_aof, t_stop, failed, rounds_down, t_ping, t_ok, NRS - bad, total,
         tu_now() - t0);
  tally_flusher_free(f);
  tally_rc_close(rc);
  for (int i = 0; i < NRS; i++) tally_counter_close(cs[i]);
  tally_store_close(s);
}

/* ---- (f) idle expiry of the counters a flusher ships -------------------------- */

static void hset_back(tally_rc *rc, const char *key, const char *w) {
  char wf[200];
  snprintf(wf, sizeof wf, "w:%s", w);
  const char *hdel[] = {"HDEL", key, wf}, *hset[] = {"HSET", key, "v", "0"};
  redisReply *r = NULL;
  EXPECT_OK(tally_rc_command(rc, key, strlen(key), 3, hdel, NULL, &r));
  freeReplyObject(r);
  EXPECT_OK(tally_rc_command(rc, key, strlen(key), 4, hset, NULL, &r));
  freeReplyObject(r);
}

/* One counter step by step: held until its final value has been read back
 * from Redis, then expired; a flush a failover lost is resent first; a late
 * increment is a new incarnation whose flush adds to the remote total, and
 * so is a counter dropped and created again. */
static void test_expiry(const struct target *t) {
  printf("(f) %s: idle expiry of flushed counters\n", t->label);
  tally_rc *rc;
  REQUIRE_OK(tally_rc_open(t->seeds, 2000, &rc));
  char sname[64], id[64], key[300], want[40];
  snprintf(sname, sizeof sname, "f-%s.tly", t->label);
  snprintf(id, sizeof id, "writer-f-%s", t->label);
  tally_store *s = open_store(sname);
  tally_family_options fo = {0, -1, 1, 0}; /* idle 1 s */
  REQUIRE_OK(tally_family_define(s, "e:*", 3, &fo));
  tally_counter *c, *c2;
  REQUIRE_OK(tu_counter(s, "e:x", 2, TALLY_POLICY_THREAD, TALLY_COUNTER_CREATE, &c));
  tally_flusher *f;
  REQUIRE_OK(tally_flusher_new(s, rc, id, R, &f));
  EXPECT(tally_flusher_shard_key("e:x", 3, tally_flusher_shard(f), key, sizeof key) > 0);
  tally_flush_stats st;
  tally_maintain_result mr;
  int64_t now = 1000, v;
  uint64_t inc, inc2;

  EXPECT_OK(tally_counter_incr(c, 5));
  EXPECT_OK(tally_flusher_run(f, "e:*", 3, &st));
  EXPECT_I64(1, st.flushed);
  EXPECT_OK(tally_store_maintain(s, now, 1000, &mr)); /* e:x seen at 5 */
  EXPECT_OK(tally_store_maintain(s, now += 2000, 1000, &mr));
  EXPECT_I64(0, mr.expired); /* 5 was written, never read back */
  EXPECT_I64(1, mr.held);

  /* a failover lost that flush: the read-back finds it and sends it again */
  hset_back(rc, key, id);
  EXPECT_OK(tally_flusher_run(f, "e:*", 3, &st));
  EXPECT_I64(1, st.flushed);
  EXPECT_I64(2, st.commands); /* HGET, EVAL */
  EXPECT_I64(5, remote(f, "e:x"));
  EXPECT_OK(tally_store_maintain(s, now += 2000, 1000, &mr));
  EXPECT_I64(1, mr.held);
  EXPECT_OK(tally_flusher_run(f, "e:*", 3, &st)); /* read back: shipped */
  EXPECT_I64(1, st.commands);
  EXPECT_I64(1, st.unchanged);
  EXPECT_OK(tally_counter_read(c, &v, &inc));
  EXPECT(hget_is(rc, key, id, field(want, inc, 5)));
  EXPECT_OK(tally_store_maintain(s, now += 2000, 1000, &mr));
  EXPECT_I64(1, mr.expired);
  EXPECT_OK(tally_counter_read(c, &v, &inc2));
  EXPECT_I64(0, (int64_t)inc2); /* gone */
  EXPECT_OK(tally_flusher_run(f, "e:*", 3, &st));
  EXPECT_I64(0, st.commands);
  EXPECT_I64(5, remote(f, "e:x"));

  /* a late increment: a new incarnation, on top of what went out */
  EXPECT_OK(tally_counter_incr(c, 3));
  EXPECT_OK(tally_counter_read(c, &v, &inc2));
  EXPECT(inc2 != 0 && inc2 != inc);
  EXPECT_I64(3, v);
  EXPECT_OK(tally_flusher_run(f, "e:*", 3, &st));
  EXPECT_I64(1, st.flushed);
  EXPECT_I64(3, st.delta);
  EXPECT_I64(8, remote(f, "e:x"));
  EXPECT(hget_is(rc, key, id, field(want, inc2, 3)));
  /* the old incarnation's script, retried late, can no longer apply */
  redisReply *r = eval(rc, key, id, inc, 0, 5);
  EXPECT(r && r->type == REDIS_REPLY_STRING && strcmp(r->str, want) == 0);
  freeReplyObject(r);
  EXPECT_I64(8, remote(f, "e:x"));

  /* dropped and created again: what the dropped one flushed stays */
  EXPECT_OK(tally_store_drop(s, "e:x", 3));
  REQUIRE_OK(tu_counter(s, "e:x", 2, TALLY_POLICY_THREAD, TALLY_COUNTER_CREATE, &c2));
  EXPECT_OK(tally_counter_incr(c2, 4));
  EXPECT_OK(tally_flusher_run(f, "e:*", 3, &st)); /* its handle reopens by name */
  EXPECT_I64(1, st.flushed);
  EXPECT_I64(4, st.delta);
  EXPECT_I64(12, remote(f, "e:x"));

  /* a w:W from before incarnations (a bare value) is this incarnation's */
  char wf[200];
  snprintf(wf, sizeof wf, "w:%s", id);
  const char *hset[] = {"HSET", key, wf, "1"};
  EXPECT_OK(tally_rc_command(rc, key, strlen(key), 4, hset, NULL, &r));
  freeReplyObject(r);
  tally_flusher_free(f); /* a restarted flusher */
  REQUIRE_OK(tally_flusher_new(s, rc, id, R, &f));
  EXPECT_OK(tally_flusher_run(f, "e:*", 3, &st));
  EXPECT_I64(1, st.flushed);
  EXPECT_I64(3, st.delta); /* 4 - 1 */
  EXPECT_OK(tally_counter_read(c2, &v, &inc));
  EXPECT(hget_is(rc, key, id, field(want, inc, 4)));
  tally_flusher_free(f);
  tally_counter_close(c);
  tally_counter_close(c2);
  tally_store_close(s);
  tally_rc_close(rc);
}

/* The server (index into g_ports) that holds key. */
static int server_of(const struct target *t, const char *key) {
  return t->cluster ? owner(tally_rc_keyslot(key, strlen(key))) : 0;
}

/* v of key, read on server m; -1 if absent. */
static long long raw_v(int m, const char *key) {
  redisReply *r = rawcmd(g_ports[m], "HGET %s v", key);
  long long v = r->type == REDIS_REPLY_STRING ? atoll(r->str) : -1;
  freeReplyObject(r);
  return v;
}

/* (f, continued) A local value that goes back to the last value read back
 * from Redis after a later flush went out: Redis may hold that later one,
 * so the counter is held, and w:W is read again and put right. First with
 * no fault (a flush applied, then a decrement to the read-back value), then
 * with the flush's reply lost (its server stopped past the timeout, the
 * script run once it resumes). */
static void test_expiry_back(const struct target *t) {
  printf("(f) %s: a value back to the last one read back\n", t->label);
  tally_rc *rc;
  REQUIRE_OK(tally_rc_open(t->seeds, 300, &rc));
  char sname[64], id[64], key[300];
  snprintf(sname, sizeof sname, "h-%s.tly", t->label);
  snprintf(id, sizeof id, "writer-h-%s", t->label);
  tally_store *s = open_store(sname);
  tally_family_options fo = {0, -1, 1, 0}; /* idle 1 s */
  REQUIRE_OK(tally_family_define(s, "h:*", 3, &fo));
  tally_counter *c, *d;
  REQUIRE_OK(tu_counter(s, "h:x", 2, TALLY_POLICY_THREAD, TALLY_COUNTER_CREATE, &c));
  tally_flusher *f;
  REQUIRE_OK(tally_flusher_new(s, rc, id, R, &f));
  tally_flush_stats st;
  tally_maintain_result mr;
  int64_t now = 1000;

  /* +5 flushed (not read back yet), then -5: back to the initial mark 0 */
  EXPECT_OK(tally_counter_incr(c, 5));
  EXPECT_OK(tally_flusher_run(f, "h:x", 3, &st));
  EXPECT_I64(1, st.flushed);
  EXPECT_OK(tally_counter_incr(c, -5));
  EXPECT_OK(tally_store_maintain(s, now, 1000, &mr));
  EXPECT_OK(tally_store_maintain(s, now += 2000, 1000, &mr));
  EXPECT_I64(0, mr.expired); /* Redis holds 5 */
  EXPECT(flush_clean(f, "h:x", 10, NULL) > 0);
  EXPECT_I64(0, remote(f, "h:x"));
  EXPECT_OK(tally_store_maintain(s, now += 2000, 1000, &mr));
  EXPECT_I64(1, mr.expired); /* 0 read back: now it may go */
  EXPECT_I64(0, remote(f, "h:x"));

  /* 10 flushed and read back; +5 sent while its server is stopped, run
   * there after the round gave up; then -5, back to 10 */
  REQUIRE_OK(tu_counter(s, "h:y", 2, TALLY_POLICY_THREAD, TALLY_COUNTER_CREATE, &d));
  EXPECT(tally_flusher_shard_key("h:y", 3, tally_flusher_shard(f), key, sizeof key) > 0);
  int m = server_of(t, key);
  EXPECT_OK(tally_counter_incr(d, 10));
  EXPECT(flush_clean(f, "h:y", 10, NULL) > 0);
  EXPECT_OK(tally_counter_incr(d, 5));
  kill(g_pids[m], SIGSTOP);
  EXPECT(tally_flusher_run(f, "h:y", 3, &st) != 0); /* timed out */
  kill(g_pids[m], SIGCONT);
  double end = tu_now() + 5;
  while (raw_v(m, key) != 15 && tu_now() < end) usleep(10000);
  EXPECT_I64(15, raw_v(m, key)); /* the script ran: its reply was lost */
  EXPECT_OK(tally_counter_incr(d, -5));
  EXPECT(flush_clean(f, "h:y", 10, NULL) > 0);
  EXPECT_I64(10, raw_v(m, key));
  EXPECT_OK(tally_store_maintain(s, now += 2000, 1000, &mr));
  EXPECT_OK(tally_store_maintain(s, now += 2000, 1000, &mr));
  EXPECT_I64(1, mr.expired);
  EXPECT_I64(10, remote(f, "h:y"));
  tally_flusher_free(f);
  tally_counter_close(c);
  tally_counter_close(d);
  tally_store_close(s);
  tally_rc_close(rc);
}

#define NG 32 /* names in (g) */

struct churn_page {
  atomic_llong acked[NG];
  atomic_llong expired, held, rounds, incrs;
  atomic_bool stop;
};

/* (g) writers, an expirer and a flusher, each its own process */
static void churn_child(const struct target *t, const char *sname, const char *id,
                        struct churn_page *pg, int role, uint64_t seed) {
  memset(g_pids, 0, sizeof g_pids); /* an exit() here must not stop the servers */
  tally_store *s = open_store(sname);
  g_dir = NULL;
  double t0 = tu_now(), end = t0 + 20; /* a bound, whatever happens */
  if (role == 0) {                     /* writer: names in phases, so they go idle */
    tally_counter *cs[NG];
    for (int i = 0; i < NG; i++) {
      char name[16];
      snprintf(name, sizeof name, "g:%d", i);
      if (tally_counter_open(s, name, strlen(name), NULL, TALLY_COUNTER_CREATE, &cs[i]))
        _exit(2);
    }
    while (tu_now() < t0 + 2.5) {
      int phase = (int)((tu_now() - t0) / 0.25) % 4;
      for (int k = 0; k < 100; k++) {
        uint64_t x = tu_rng(&seed);
        int i = (int)(x % (NG / 4)) * 4 + phase;
        if (tally_counter_incr(cs[i], 1) != 0) _exit(3);
        atomic_fetch_add(&pg->acked[i], 1);
        atomic_fetch_add(&pg->incrs, 1);
      }
      usleep(2000);
    }
    _exit(0);
  }
  if (role == 1) { /* expirer: a fast clock, 400 ms a call */
    int64_t clock = 0;
    while (!atomic_load(&pg->stop) && tu_now() < end) {
      tally_maintain_result mr;
      if (tally_store_maintain(s, clock += 400, 4096, &mr)) _exit(4);
      atomic_fetch_add(&pg->expired, (long long)mr.expired);
      atomic_fetch_add(&pg->held, (long long)mr.held);
      usleep(20000);
    }
    _exit(0);
  }
  tally_rc *rc; /* flusher */
  tally_flusher *f;
  if (tally_rc_open(t->seeds, 2000, &rc) || tally_flusher_new(s, rc, id, R, &f)) _exit(5);
  while (!atomic_load(&pg->stop) && tu_now() < end) {
    tally_flusher_run(f, "g:*", 3, NULL); /* failures: the next round retries */
    atomic_fetch_add(&pg->rounds, 1);
    usleep(100000); /* 2 s of the expirer's clock: idle names wait for it */
  }
  _exit(0);
}

/* Exactness under expiry: every increment acknowledged reaches Redis
 * exactly once, through however many incarnations each name went. */
static void test_expiry_churn(const struct target *t) {
  printf("(g) %s: 2 writers, an expirer and a flusher, each a process\n", t->label);
  char sname[64], id[64];
  snprintf(sname, sizeof sname, "g-%s.tly", t->label);
  snprintf(id, sizeof id, "writer-g-%s", t->label);
  tally_store *s = open_store(sname);
  tally_family_options fo = {0, -1, 1, 0};
  REQUIRE_OK(tally_family_define(s, "g:*", 3, &fo));
  struct churn_page *pg =
      mmap(NULL, sizeof *pg, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  REQUIRE_OK(pg == MAP_FAILED ? TALLY_ESYS : 0);
  memset(pg, 0, sizeof *pg);
  pid_t pids[4];
  int roles[4] = {0, 0, 1, 2};
  fflush(NULL);
  for (int i = 0; i < 4; i++)
    if ((pids[i] = fork()) == 0) churn_child(t, sname, id, pg, roles[i], 0x9e37 + i);
  int status;
  for (int i = 0; i < 2; i++) {
    waitpid(pids[i], &status, 0);
    EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  usleep(300000); /* the last names go idle and expire */
  atomic_store(&pg->stop, true);
  for (int i = 2; i < 4; i++) {
    waitpid(pids[i], &status, 0);
    EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  tally_rc *rc;
  REQUIRE_OK(tally_rc_open(t->seeds, 2000, &rc));
  tally_flusher *f;
  REQUIRE_OK(tally_flusher_new(s, rc, id, R, &f)); /* same writer, after it */
  EXPECT(flush_clean(f, "g:*", 10, NULL) > 0);
  int bad = 0;
  long long total = 0;
  for (int i = 0; i < NG; i++) {
    char name[16];
    snprintf(name, sizeof name, "g:%d", i);
    int64_t rem = INT64_MIN;
    EXPECT_OK(tally_flusher_remote_value(f, name, strlen(name), &rem));
    long long acked = atomic_load(&pg->acked[i]);
    if (rem != acked && bad++ < 5)
      TU_FAIL("%s: acknowledged %lld, remote %lld", name, acked, (long long)rem);
    total += acked;
  }
  EXPECT_I64(0, bad);
  EXPECT(atomic_load(&pg->expired) > 0);
  EXPECT(atomic_load(&pg->held) > 0);
  EXPECT_OK(tally_store_check(s));
  printf("  %lld increments, %lld flush rounds, %lld expiries (%lld held back "
         "until shipped); remote totals exact (%lld)\n",
         (long long)atomic_load(&pg->incrs), (long long)atomic_load(&pg->rounds),
         (long long)atomic_load(&pg->expired), (long long)atomic_load(&pg->held), total);
  tally_flusher_free(f);
  tally_rc_close(rc);
  tally_store_close(s);
  munmap(pg, sizeof *pg);
}

/* ---- (h) a flusher over short-lived names ------------------------------------ */

/* A counter name made, incremented by v and let go (the handle closed). */
static void make(tally_store *s, const char *name, int64_t v) {
  tally_counter *c;
  REQUIRE_OK(tu_counter(s, name, 2, TALLY_POLICY_THREAD, TALLY_COUNTER_CREATE, &c));
  EXPECT_OK(tally_counter_incr(c, v));
  tally_counter_close(c);
}

/* Rounds of names created, flushed and read back, then half dropped (with
 * an increment not flushed) and half expired: the flusher's entries and
 * the store's open handles stay those of the live names (they grew by
 * every name ever flushed before). A name made again after its entry went
 * is a first guess: read (HGET), then flushed on top of what Redis has,
 * once.
 * Entries of names outside a round's pattern stay, and what they know. */
static void test_forget(const struct target *t) {
  printf("(h) %s: short-lived names are forgotten\n", t->label);
  enum { NH = 20, ROUNDS = 5 };
  tally_rc *rc;
  REQUIRE_OK(tally_rc_open(t->seeds, 2000, &rc));
  char sname[64], id[64], name[64], key[300], want[40];
  snprintf(sname, sizeof sname, "k-%s.tly", t->label);
  snprintf(id, sizeof id, "writer-k-%s", t->label);
  tally_store *s = open_store(sname);
  tally_family_options fo = {0, -1, 1, 0}; /* idle 1 s */
  REQUIRE_OK(tally_family_define(s, "k:*", 3, &fo));
  tally_flusher *f;
  REQUIRE_OK(tally_flusher_new(s, rc, id, R, &f));
  tally_flush_stats st;
  tally_maintain_result mr;
  int64_t now = 1000;

  make(s, "m:a", 3); /* another pattern's, flushed and read back */
  EXPECT(flush_clean(f, "m:*", 10, NULL) > 0);
  EXPECT_I64(1, tally__handles_open(s));

  for (int r = 0; r < ROUNDS; r++) {
    for (int i = 0; i < NH; i++) {
      snprintf(name, sizeof name, "k:%d:%d", r, i);
      make(s, name, i + 1);
    }
    EXPECT(flush_clean(f, "k:*", 10, NULL) > 0); /* flushed, then read back */
    EXPECT_OK(tally_store_maintain(s, now += 2000, 4096, &mr)); /* seen */
    for (int i = 0; i < NH; i += 2) {
      snprintf(name, sizeof name, "k:%d:%d", r, i);
      make(s, name, 100); /* given up by the drop */
      EXPECT_OK(tally_store_drop(s, name, strlen(name)));
    }
    EXPECT_OK(tally_store_maintain(s, now += 2000, 4096, &mr));
    EXPECT_I64(NH / 2, mr.expired);
    EXPECT_OK(tally_flusher_run(f, "k:*", 3, &st));
    EXPECT_I64(0, st.counters);
    EXPECT_I64(0, st.commands);
    if (st.entries != 1 || tally__handles_open(s) != 1)
      TU_FAIL("round %d: %llu entries, %zu handles open; 1 live name", r,
              (unsigned long long)st.entries, tally__handles_open(s));
  }
  EXPECT_I64(1, remote(f, "k:0:0"));
  EXPECT_I64(2, remote(f, "k:0:1"));

  /* the other pattern's entry kept what it knew: nothing to read again */
  EXPECT_OK(tally_flusher_run(f, "m:*", 3, &st));
  EXPECT_I64(1, st.unchanged);
  EXPECT_I64(0, st.commands);

  /* made again (one dropped, one expired): read, then flushed once */
  make(s, "k:0:0", 5);
  make(s, "k:0:1", 7);
  EXPECT_OK(tally_flusher_run(f, "k:*", 3, &st));
  EXPECT_I64(2, st.flushed);
  EXPECT_I64(12, st.delta);
  EXPECT_I64(4, st.commands); /* HGET, EVAL each */
  EXPECT_I64(0, st.conflicts);
  EXPECT(flush_clean(f, "k:*", 10, NULL) > 0);
  EXPECT_I64(6, remote(f, "k:0:0"));
  EXPECT_I64(9, remote(f, "k:0:1"));
  tally_counter *c;
  uint64_t inc;
  int64_t v;
  REQUIRE_OK(tu_counter(s, "k:0:0", 2, TALLY_POLICY_THREAD, 0, &c));
  EXPECT_OK(tally_counter_read(c, &v, &inc));
  tally_counter_close(c);
  EXPECT(tally_flusher_shard_key("k:0:0", 5, tally_flusher_shard(f), key, sizeof key) >
         0);
  EXPECT(hget_is(rc, key, id, field(want, inc, 5)));

  /* one gone among many: its handle goes at once */
  for (int i = 0; i < 8; i++) {
    snprintf(name, sizeof name, "k:keep:%d", i);
    make(s, name, 1);
  }
  EXPECT(flush_clean(f, "k:*", 10, NULL) > 0);
  EXPECT_I64(11, tally__handles_open(s));
  EXPECT_OK(tally_store_drop(s, "k:keep:0", 8));
  EXPECT_OK(tally_flusher_run(f, "k:*", 3, &st));
  EXPECT_I64(9, st.counters);
  EXPECT_I64(10, tally__handles_open(s));
  EXPECT_I64(10, st.entries);

  /* a re-verification reads the live names only */
  tally_flusher_verify(f);
  EXPECT_OK(tally_flusher_run(f, "*", 1, &st));
  EXPECT_I64(10, st.verified);
  EXPECT_I64(0, st.repaired);
  EXPECT_I64(10, st.commands);
  EXPECT_I64(10, st.entries);

  /* and all of them gone */
  for (int i = 1; i < 8; i++) {
    snprintf(name, sizeof name, "k:keep:%d", i);
    EXPECT_OK(tally_store_drop(s, name, strlen(name)));
  }
  EXPECT_OK(tally_store_drop(s, "k:0:0", 5));
  EXPECT_OK(tally_store_drop(s, "k:0:1", 5));
  EXPECT_OK(tally_store_drop(s, "m:a", 3));
  EXPECT_OK(tally_flusher_run(f, NULL, 0, &st));
  EXPECT_I64(0, st.entries);
  EXPECT_I64(0, tally__handles_open(s));
  EXPECT_I64(3, remote(f, "m:a"));

  /* churn at random: entries come and go through the table, whose probe
   * runs must still lead to each live name (a name not found would be a
   * new entry, read again with an HGET in a quiet round) */
  enum { NZ = 300 };
  static int64_t total[NZ];
  static bool live[NZ];
  memset(total, 0, sizeof total);
  memset(live, 0, sizeof live);
  uint64_t seed = 0x5eed;
  for (int r = 0; r < 12; r++) {
    int nlive = 0;
    for (int i = 0; i < NZ; i++) {
      uint64_t x = tu_rng(&seed) % 8;
      snprintf(name, sizeof name, "z:%d", i);
      if (live[i] && x < 3) { /* dropped: flushed all it had */
        EXPECT_OK(tally_store_drop(s, name, strlen(name)));
        live[i] = false;
      } else if (x < 6) {
        make(s, name, (int64_t)x + 1);
        total[i] += (int64_t)x + 1;
        live[i] = true;
      }
      nlive += live[i];
    }
    EXPECT(flush_clean(f, "z:*", 10, NULL) > 0);
    EXPECT_OK(tally_flusher_run(f, "z:*", 3, &st));
    EXPECT_I64(nlive, st.entries);
    EXPECT_I64(nlive, st.counters);
    EXPECT_I64(0, st.commands);
    EXPECT_I64(nlive, tally__handles_open(s));
  }
  int bad = 0;
  for (int i = 0; i < NZ; i++) {
    snprintf(name, sizeof name, "z:%d", i);
    if (remote(f, name) != total[i] && bad++ < 5)
      TU_FAIL("%s: remote %lld, flushed %lld", name, (long long)remote(f, name),
              (long long)total[i]);
  }
  EXPECT_I64(0, bad);
  tally_flusher_free(f);
  tally_store_close(s);
  tally_rc_close(rc);
}

int main(void) {
  double t0 = tu_now();
  start_all();
  struct target ts[2] = {{.label = "standalone", .cluster = false, .stop_idx = 0},
                         {.label = "cluster", .cluster = true, .stop_idx = 2}};
  snprintf(ts[0].seeds, sizeof ts[0].seeds, "127.0.0.1:%d", g_ports[0]);
  snprintf(ts[1].seeds, sizeof ts[1].seeds, "127.0.0.1:%d", g_ports[1]);
  for (int i = 0; i < 2; i++) {
    double t1 = tu_now();
    test_concurrent(&ts[i]);
    printf("  (%.2f s)\n", tu_now() - t1);
    t1 = tu_now();
    test_faults(&ts[i]);
    printf("  (%.2f s)\n", tu_now() - t1);
    t1 = tu_now();
    test_lost_reply(&ts[i]);
    test_sigkill(&ts[i]);
    printf("  (c)+(d) %.2f s\n", tu_now() - t1);
    t1 = tu_now();
    test_expiry(&ts[i]);
    test_expiry_back(&ts[i]);
    test_expiry_churn(&ts[i]);
    test_forget(&ts[i]);
    printf("  (f)+(g)+(h) %.2f s\n", tu_now() - t1);
  }
  test_migration(&ts[1]);
  test_restart(&ts[1]);
  stop_all();
  printf("total %.2f s\n", tu_now() - t0);
  return tu_finish("test_redis_flush");
}
