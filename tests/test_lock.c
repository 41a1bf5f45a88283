/* test_lock.c -- the file store's lock across processes (lock.c).
 *
 * Format 8 takes the lock with a compare-and-swap on a header word, so
 * these cases must hold for real processes:
 *   - a live holder excludes every other process until it unlocks;
 *   - a holder SIGKILLed while it holds the lock blocks nobody for long;
 *   - a word left in a copy of the file (made while another process held
 *     the lock, that process still alive) or from before a reboot (a word
 *     naming a live process that does not have the file open) is taken over;
 *   - a format 7 file still uses flock(), so an outside flock() excludes
 *     its creations, where it does not touch a format 8 or 9 file's, and
 *     compaction turns it into a format 9 file;
 *   - a format 9 file cuts records in 8-byte units, a format 8 one still
 *     in 16 (older versions free its records by that unit);
 *   - processes creating the same names at once each get them once;
 *   - a holder killed between a counter's creation or burial and its
 *     family's live count leaves the family's cap exact (the taker-over
 *     recounts), in a format 7 file as in a format 9 one.
 * The holder is a forked child that takes the lock through the library's
 * own tally__lock and reports on a pipe.
 */
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/wait.h>

#include "testutil.h"

#include "../src/core/internal.h"

#define NO_PID ((1 << 22) - 1) /* Linux's last pid: no process here */

static char g_dir[1024];

static void spec_of(char *spec, size_t cap, char *path, size_t pcap, const char *name) {
  tu_spec(spec, cap, path, pcap, g_dir, name);
}

/* A child that opens spec, takes its lock, says so on the pipe and then
 * holds it: for hold_ms (then unlocks and exits 0), or until killed (-1). */
static pid_t spawn_holder(const char *spec, int hold_ms) {
  int fds[2];
  REQUIRE_OK(pipe(fds) != 0 ? TALLY_ESYS : 0);
  pid_t pid = fork();
  REQUIRE_OK(pid < 0 ? TALLY_ESYS : 0);
  if (pid == 0) {
    close(fds[0]);
    prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlives a test that failed */
    tally_store *s = NULL;
    if (tally_store_open(spec, NULL, &s) != 0 || tally__lock(s) != 0) _exit(2);
    if (write(fds[1], "L", 1) != 1) _exit(3);
    if (hold_ms < 0)
      for (;;) pause();
    usleep((useconds_t)hold_ms * 1000);
    tally__unlock(s);
    tally_store_close(s);
    _exit(0);
  }
  close(fds[1]);
  char c = 0;
  ssize_t n = read(fds[0], &c, 1);
  close(fds[0]);
  if (n != 1 || c != 'L') TU_FAIL("the holder (pid %d) never took the lock", (int)pid);
  return pid;
}

static void reap(pid_t pid, bool killed) {
  int st = 0;
  if (killed) kill(pid, SIGKILL);
  waitpid(pid, &st, 0);
  atomic_fetch_add(&tu_checks, 1);
  if (killed ? !(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL)
             : !(WIFEXITED(st) && WEXITSTATUS(st) == 0))
    TU_FAIL("holder %d ended with status 0x%x", (int)pid, st);
}

/* A creation in a thread of this process, watched from outside. */
struct creation {
  tally_store *s;
  const char *name;
  _Atomic int done; /* 1 once the create returned */
  int rc;
  double at; /* when it returned (tu_now) */
};

static void *create_main(void *ud) {
  struct creation *c = ud;
  tally_counter *h = NULL;
  c->rc = tu_counter(c->s, c->name, 1, TALLY_POLICY_THREAD, TALLY_COUNTER_CREATE, &h);
  if (h) {
    c->rc = c->rc ? c->rc : tally_counter_incr(h, 1);
    tally_counter_close(h);
  }
  c->at = tu_now();
  atomic_store(&c->done, 1);
  return NULL;
}

/* Is the creation still waiting after ms? (It must be, while a live
 * process holds the lock.) */
static void expect_waiting(struct creation *c, int ms, const char *why) {
  usleep((useconds_t)ms * 1000);
  atomic_fetch_add(&tu_checks, 1);
  if (atomic_load(&c->done)) TU_FAIL("%s: a creation went ahead (rc %d)", why, c->rc);
}

static void expect_value(tally_store *s, const char *name, int64_t want) {
  int64_t v = -1;
  EXPECT_OK(tally_store_value(s, name, strlen(name), &v));
  EXPECT_I64(want, v);
}

/* A live holder excludes; when it unlocks, the waiter goes on at once. */
static void test_live_holder(void) {
  char spec[1300];
  spec_of(spec, sizeof spec, NULL, 0, "live.tly");
  tally_store *s = NULL;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  pid_t holder = spawn_holder(spec, 400);
  struct creation c = {.s = s, .name = "live:a"};
  pthread_t th;
  double t0 = tu_now();
  pthread_create(&th, NULL, create_main, &c);
  expect_waiting(&c, 200, "a live holder");
  pthread_join(th, NULL);
  reap(holder, false);
  EXPECT_OK(c.rc);
  /* it waited for the unlock (the holder held 400 ms from before t0) */
  atomic_fetch_add(&tu_checks, 1);
  if (c.at - t0 < 0.2) TU_FAIL("the creation took %.3f s: it did not wait", c.at - t0);
  expect_value(s, "live:a", 1);
  EXPECT_OK(tally_store_check(s));
  tally_store_close(s);
}

/* A holder SIGKILLed with the lock: the waiter takes over within a few
 * of its 2 ms checks (a bound of a second here: a loaded machine). */
static void test_killed_holder(void) {
  char spec[1300];
  spec_of(spec, sizeof spec, NULL, 0, "killed.tly");
  tally_store *s = NULL;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  for (int round = 0; round < 3; round++) {
    pid_t holder = spawn_holder(spec, -1);
    char name[32];
    snprintf(name, sizeof name, "killed:%d", round);
    struct creation c = {.s = s, .name = name};
    pthread_t th;
    pthread_create(&th, NULL, create_main, &c);
    expect_waiting(&c, 50, "a holder not yet killed");
    double t_kill = tu_now();
    reap(holder, true);
    pthread_join(th, NULL);
    EXPECT_OK(c.rc);
    atomic_fetch_add(&tu_checks, 1);
    if (c.at - t_kill > 1.0)
      TU_FAIL("a dead holder blocked a creation %.3f s", c.at - t_kill);
    printf("  killed holder, round %d: the waiter went on %.1f ms after the kill\n",
           round, (c.at - t_kill) * 1e3);
    expect_value(s, name, 1);
  }
  EXPECT_OK(tally_store_check(s));
  tally_store_close(s);
}

/* An open that takes the lock over from a dead holder recounts the
 * families (a walk) before it has its slot in the process table: the walk
 * took a slot of its own, and the open another, so the process showed as
 * two, one of them never given back ("in use by this process" to its
 * compaction, reuse held back for its life). */
static void test_takeover_in_open(void) {
  char spec[1300];
  spec_of(spec, sizeof spec, NULL, 0, "takeover.tly");
  tally_store *s = NULL;
  tally_family_options o = {.shards = 1, .policy = TALLY_POLICY_THREAD};
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  EXPECT_OK(tally_family_define(s, "t:*", 3, &o));
  tally_store_close(s);
  reap(spawn_holder(spec, -1), true);
  REQUIRE_OK(tally_store_open(spec, NULL, &s)); /* takes the dead holder's lock */
  tally_grace_info g;
  EXPECT_OK(tally_store_grace(s, &g));
  EXPECT_I64(1, g.processes);
  tally_store_close(s);
}

static void copy_file(const char *from, const char *to) {
  int in = open(from, O_RDONLY), out = open(to, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  REQUIRE_OK(in < 0 || out < 0 ? TALLY_ESYS : 0);
  char buf[65536];
  ssize_t n;
  while ((n = read(in, buf, sizeof buf)) > 0)
    REQUIRE_OK(write(out, buf, (size_t)n) != n ? TALLY_ESYS : 0);
  close(in);
  close(out);
}

/* A copy made while a live process holds the original's lock: that
 * process does not have the copy open, so the copy's word is stale. */
static void test_copy_while_held(void) {
  char spec[1300], path[1300], copy_spec[1300], copy_path[1300];
  spec_of(spec, sizeof spec, path, sizeof path, "orig.tly");
  spec_of(copy_spec, sizeof copy_spec, copy_path, sizeof copy_path, "copy.tly");
  tally_store *s = NULL;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  EXPECT_OK(tally_store_incr(s, "copy:a", 6, 5, TALLY_COUNTER_CREATE));
  tally_store_close(s);
  pid_t holder = spawn_holder(spec, -1);
  copy_file(path, copy_path);
  tally_store *c = NULL;
  double t0 = tu_now();
  REQUIRE_OK(tally_store_open(copy_spec, NULL, &c)); /* open takes the lock too */
  EXPECT_OK(tally_store_incr(c, "copy:b", 6, 1, TALLY_COUNTER_CREATE));
  atomic_fetch_add(&tu_checks, 1);
  if (tu_now() - t0 > 1.0)
    TU_FAIL("the copy's stale lock held for %.3f s", tu_now() - t0);
  expect_value(c, "copy:a", 5);
  expect_value(c, "copy:b", 1);
  EXPECT_OK(tally_store_check(c));
  tally_store_close(c);
  reap(holder, true);
}

/* The header's lock word (format 8), read or written in a closed file. */
static void poke_owner(const char *path, uint64_t owner) {
  int fd = open(path, O_RDWR);
  REQUIRE_OK(fd < 0 ? TALLY_ESYS : 0);
  off_t at = (off_t)offsetof(struct tally__header, lock_owner);
  REQUIRE_OK(pwrite(fd, &owner, 8, at) != 8 ? TALLY_ESYS : 0);
  close(fd);
}

/* Words no process holds: a live process that does not have the file open
 * (init, as after a reboot whose pids came back), a pid that does not
 * exist, a damaged word. Each is taken over. */
static void test_stale_words(void) {
  char spec[1300], path[1300];
  spec_of(spec, sizeof spec, path, sizeof path, "stale.tly");
  tally_store *s = NULL;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  tally_store_close(s);
  const uint64_t words[] = {tally__owner_of(1, NULL), (uint64_t)NO_PID << 32 | 1,
                            UINT64_C(0xdeadbeefdeadbeef)};
  for (size_t i = 0; i < sizeof words / sizeof *words; i++) {
    poke_owner(path, words[i]);
    double t0 = tu_now();
    REQUIRE_OK(tally_store_open(spec, NULL, &s));
    char name[32];
    snprintf(name, sizeof name, "stale:%zu", i);
    EXPECT_OK(tally_store_incr(s, name, strlen(name), 1, TALLY_COUNTER_CREATE));
    atomic_fetch_add(&tu_checks, 1);
    if (tu_now() - t0 > 1.0)
      TU_FAIL("stale word %zu held the lock for %.3f s", i, tu_now() - t0);
    EXPECT_I64(0, (int64_t)atomic_load(&s->hdr->lock_owner)); /* unlocked after */
    tally_store_close(s);
  }
}

/* Process state of pid: the letter after the command in /proc/PID/stat. */
static char state_of(pid_t pid) {
  char path[64], buf[512];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "r");
  if (!f) return '?';
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  char *p = strrchr(buf, ')');
  return p && p[1] == ' ' ? p[2] : '?';
}

static int g_release[2];
static void *linger(void *ud) {
  (void)ud;
  char c;
  while (read(g_release[0], &c, 1) < 0 && errno == EINTR) {}
  _exit(0);
}

/* A process whose main thread exited (pthread_exit) while another runs on
 * shows Z: it is alive (its handles may still write) until that thread
 * ends too; then, not yet reaped, it holds nothing. */
static void test_leader_exited(void) {
  REQUIRE_OK(pipe(g_release) != 0 ? TALLY_ESYS : 0);
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    pthread_t t;
    close(g_release[1]); /* the parent's close is then the end of the file */
    if (pthread_create(&t, NULL, linger, NULL) != 0) _exit(1);
    pthread_exit(NULL);
  }
  close(g_release[0]);
  uint64_t owner = tally__owner_of(pid, NULL);
  double end = tu_now() + 5;
  while (state_of(pid) != 'Z' && tu_now() < end) usleep(1000);
  EXPECT(state_of(pid) == 'Z');
  EXPECT(tally__owner_alive(owner)); /* its thread lives */
  close(g_release[1]);               /* the thread ends: the process with it */
  end = tu_now() + 5;
  while (tally__owner_alive(owner) && tu_now() < end) usleep(1000);
  EXPECT(!tally__owner_alive(owner)); /* dead, not yet reaped */
  int st;
  waitpid(pid, &st, 0);
  EXPECT(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

/* The older formats: format 7's flock(), as before (an outside flock()
 * excludes its creations; from format 8 it does not), and format 8's
 * 16-byte record unit. The file is made, then marked older while it
 * holds no record, as a file an older version made would be. */
uint64_t tally__header_check(const struct tally__header *h); /* arena.c */

static void make_format(const char *path, uint32_t format) {
  int fd = open(path, O_RDWR);
  REQUIRE_OK(fd < 0 ? TALLY_ESYS : 0);
  struct tally__header h;
  REQUIRE_OK(pread(fd, &h, sizeof h, 0) != (ssize_t)sizeof h ? TALLY_ESYS : 0);
  h.format = format;
  h.check = tally__header_check(&h);
  REQUIRE_OK(pwrite(fd, &h, offsetof(struct tally__header, pad0_), 0) !=
                     (ssize_t)offsetof(struct tally__header, pad0_)
                 ? TALLY_ESYS
                 : 0);
  close(fd);
}

/* A new file of the format (named prefix and the format), made by this
 * version, marked older if asked, and open. */
static tally_store *new_store(const char *prefix, uint32_t format, char *spec,
                              size_t spec_len, char *path, size_t path_len) {
  char file[64];
  snprintf(file, sizeof file, "%s%u.tly", prefix, format);
  spec_of(spec, spec_len, path, path_len, file);
  tally_store *s = NULL;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  tally_store_close(s);
  if (format != TALLY__FORMAT) make_format(path, format);
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  return s;
}

static void test_formats(void) {
  for (uint32_t format = 7; format <= TALLY__FORMAT; format++) {
    char spec[1300], path[1300];
    tally_store *s = new_store("f", format, spec, sizeof spec, path, sizeof path);
    EXPECT_OK(tally_store_incr(s, "f:a", 3, 2, TALLY_COUNTER_CREATE));
    tally_store_stats st;
    EXPECT_OK(tally_store_stats_get(s, &st));
    EXPECT_I64(format, st.format);
    int fd = open(path, O_RDWR);
    REQUIRE_OK(fd < 0 || flock(fd, LOCK_EX) != 0 ? TALLY_ESYS : 0);
    struct creation c = {.s = s, .name = "f:b"};
    pthread_t th;
    pthread_create(&th, NULL, create_main, &c);
    if (format == 7) {
      expect_waiting(&c, 200, "format 7 under an outside flock()");
      close(fd); /* releases the flock */
      pthread_join(th, NULL);
    } else {
      pthread_join(th, NULL); /* goes ahead under the flock */
      close(fd);
    }
    EXPECT_OK(c.rc);
    expect_value(s, "f:a", 2);
    expect_value(s, "f:b", 1);
    EXPECT_OK(tally_store_check(s));
    tally_store_close(s);
    /* compaction writes the current format, with the counters */
    EXPECT_OK(tally_store_compact(path, 0, NULL, NULL));
    REQUIRE_OK(tally_store_open(spec, NULL, &s));
    EXPECT_OK(tally_store_stats_get(s, &st));
    EXPECT_I64(TALLY__FORMAT, st.format);
    expect_value(s, "f:a", 2);
    expect_value(s, "f:b", 1);
    tally_store_close(s);
  }
}

static uint64_t rec_of(tally_store *s, const char *name) {
  tally_counter *c = NULL;
  REQUIRE_OK(tally_counter_open(s, name, strlen(name), NULL, 0, &c));
  uint64_t off = tally__crec(c);
  tally_counter_close(c);
  return off;
}

/* Two records of 17-byte names made one after the other lie 88 bytes
 * apart in a format 9 file (64 + 17 + 1, rounded up to 8), 96 in a format
 * 8 one; a dropped record's place goes to the next record of its size. */
static void test_record_units(void) {
  static const char *const names[] = {"units:00000000001", "units:00000000002",
                                      "units:00000000003"};
  setenv("TALLY_GRACE_MS", "0", 1); /* one process: the drop is ripe at once */
  for (uint32_t format = 8; format <= TALLY__FORMAT; format++) {
    char spec[1300], path[1300];
    tally_store *s = new_store("u", format, spec, sizeof spec, path, sizeof path);
    /* the first counter takes the cells' chunk, so the next two are neighbours */
    EXPECT_OK(tally_store_incr(s, "units:first", 11, 1, TALLY_COUNTER_CREATE));
    for (int i = 0; i < 2; i++)
      EXPECT_OK(tally_store_incr(s, names[i], 17, i + 1, TALLY_COUNTER_CREATE));
    uint64_t a = rec_of(s, names[0]), b = rec_of(s, names[1]);
    EXPECT_I64(format >= 9 ? 88 : 96, (int64_t)(b - a));
    EXPECT_OK(tally_store_drop(s, names[0], 17));
    EXPECT_OK(tally_store_maintain(s, 0, 0, NULL));
    EXPECT_OK(tally_store_incr(s, names[2], 17, 3, TALLY_COUNTER_CREATE));
    EXPECT_I64((int64_t)a, (int64_t)rec_of(s, names[2]));
    expect_value(s, names[1], 2);
    expect_value(s, names[2], 3);
    expect_value(s, "units:first", 1);
    EXPECT_OK(tally_store_check(s));
    tally_store_close(s);
  }
  unsetenv("TALLY_GRACE_MS");
}

/* A file growing under another process is not a truncated one: the
 * check without the lock (tally__truncated: before stats, walks, upkeep,
 * ticks) read the file's size, then the header's, so a growth in between
 * looked like truncation. A child grows the file for 1.5 s while this
 * process checks in a loop. */
static void test_growing_not_truncated(void) {
  char spec[1300], path[1300];
  spec_of(spec, sizeof spec, path, sizeof path, "grow.tly");
  tally_store *s = NULL;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    tally_store *w;
    if (tally_store_open(spec, NULL, &w)) _exit(2);
    tally_counter_options o = {64, -1}; /* 512 bytes of cells a counter */
    char name[32];
    for (long i = 0, end = (long)tu_now() + 10; tu_now() < end; i++) { /* or killed */
      tally_counter *c;
      int n = snprintf(name, sizeof name, "grow:%ld", i);
      if (tally_counter_open(w, name, (size_t)n, &o, TALLY_COUNTER_CREATE, &c)) _exit(3);
      tally_counter_close(c);
    }
    _exit(0);
  }
  long calls = 0, bad = 0;
  for (double end = tu_now() + 1.5; tu_now() < end; calls++)
    if (tally__truncated(s) != 0 && bad++ == 0) printf("  %s\n", tally_errmsg());
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  tally_store_stats st;
  EXPECT_OK(tally_store_stats_get(s, &st));
  printf("  a growing file: %ld checks, %ld said truncated; %llu counters made\n", calls,
         bad, (unsigned long long)st.counters);
  EXPECT_I64(0, bad);
  EXPECT(st.counters > 1000);
  tally_store_close(s);
}

/* Processes that create at once, through the word: every counter is
 * there once, with its value, and the store checks. */
static void test_creators(void) {
  char spec[1300];
  spec_of(spec, sizeof spec, NULL, 0, "creators.tly");
  const int NP = 4, PER = 2000;
  pid_t pids[4];
  for (int p = 0; p < NP; p++) {
    pids[p] = fork();
    REQUIRE_OK(pids[p] < 0 ? TALLY_ESYS : 0);
    if (pids[p] == 0) {
      tally_store *s = NULL;
      if (tally_store_open(spec, NULL, &s)) _exit(2);
      for (int i = 0; i < PER; i++) {
        char name[32];
        int len =
            snprintf(name, sizeof name, "c:%d", i); /* the same names in every process */
        if (tally_store_incr(s, name, (size_t)len, 1, TALLY_COUNTER_CREATE)) _exit(3);
      }
      tally_store_close(s);
      _exit(0);
    }
  }
  for (int p = 0; p < NP; p++) reap(pids[p], false);
  tally_store *s = NULL;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  int64_t sum = 0;
  uint64_t count = 0;
  EXPECT_OK(tally_store_sum(s, "c:*", 3, &sum, &count));
  EXPECT_I64(PER, (int64_t)count);
  EXPECT_I64((int64_t)NP * PER, sum);
  EXPECT_OK(tally_store_check(s));
  tally_store_close(s);
}

/* Open name (created if need be): true if it got a counter of its own,
 * false if its family's overflow counter. */
static bool got_own(tally_store *s, const char *name) {
  tally_counter *c = NULL;
  tally_counter_info inf = {0};
  EXPECT_OK(tu_counter(s, name, 0, -1, TALLY_COUNTER_CREATE, &c));
  if (c) EXPECT_OK(tally_counter_info_get(c, &inf));
  bool own = inf.name && strcmp(inf.name, name) == 0;
  tally_counter_close(c);
  return own;
}

static const char *g_die_at; /* the test hook's point where a child dies */
static void die_at(const char *where, const char *name, size_t len) {
  (void)name, (void)len;
  if (g_die_at && strcmp(where, g_die_at) == 0) kill(getpid(), SIGKILL);
}

/* A child that creates name ("indexed") or drops it ("limbo") and is
 * SIGKILLed there, holding the lock. */
static void die_in(const char *spec, const char *where, const char *name) {
  fflush(NULL);
  pid_t pid = fork();
  REQUIRE_OK(pid < 0 ? TALLY_ESYS : 0);
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    tally_store *s = NULL;
    if (tally_store_open(spec, NULL, &s) != 0) _exit(2);
    tally_counter *c = NULL;
    g_die_at = where;
    tally__test_hook = die_at;
    if (strcmp(where, "indexed") == 0)
      (void)tu_counter(s, name, 0, -1, TALLY_COUNTER_CREATE, &c);
    else
      (void)tally_store_drop(s, name, strlen(name));
    _exit(3); /* not killed: the hook never ran */
  }
  int st = 0;
  waitpid(pid, &st, 0);
  atomic_fetch_add(&tu_checks, 1);
  if (!(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL))
    TU_FAIL("the child to die at '%s' ended with status 0x%x", where, st);
}

/* A family capped at 4 whose second creation dies before its live count
 * goes up: exactly two more names get their own counters (a count one
 * short admitted a fifth). Capped at 3, a drop that dies before the count
 * goes down: exactly one name more (a count one over refused it). */
static void test_cap_killed(uint32_t format) {
  char spec[1300], path[1300];
  tally_store *s = new_store("cap", format, spec, sizeof spec, path, sizeof path);
  tally_family_options four = {1, -1, 0, 4}, three = {1, -1, 0, 3};
  EXPECT_OK(tally_family_define(s, "ck:*", 4, &four));
  EXPECT(got_own(s, "ck:a"));
  die_in(spec, "indexed", "ck:b");
  expect_value(s, "ck:b", 0); /* its creation is complete but for the count */
  EXPECT(got_own(s, "ck:c"));
  EXPECT(got_own(s, "ck:d"));
  EXPECT(!got_own(s, "ck:e"));
  EXPECT(!got_own(s, "ck:f"));

  EXPECT_OK(tally_family_define(s, "cd:*", 4, &three));
  EXPECT(got_own(s, "cd:a"));
  EXPECT(got_own(s, "cd:b"));
  EXPECT(got_own(s, "cd:c"));
  die_in(spec, "limbo", "cd:a");
  int64_t v;
  EXPECT_RC(TALLY_ENOENT, tally_store_value(s, "cd:a", 4, &v)); /* dropped */
  EXPECT(got_own(s, "cd:d"));
  EXPECT(!got_own(s, "cd:e"));

  tally_store_stats st;
  EXPECT_OK(tally_store_stats_get(s, &st));
  EXPECT_I64(3, st.capped);               /* ck:e, ck:f, cd:e */
  EXPECT_I64(4 + 1 + 3 + 1, st.counters); /* with the two overflow counters */
  EXPECT_OK(tally_store_check(s));
  tally_store_close(s);
}

/* A thread holds the lock when another thread of its process execs: the
 * word keeps the pid and start time the program it became has too. That
 * program's open must take the word over (no attach lock of this pid but
 * through its own new open file), not wait for itself for good. The
 * test execs itself: `test_lock again SPEC` is the program after. */
static void *hold_forever(void *arg) {
  if (tally__lock(arg)) _exit(2);
  for (;;) pause();
}

static int after_exec(const char *spec) {
  alarm(10);
  tally_store *s = NULL;
  int rc = tally_store_open(spec, NULL, &s);
  if (rc == 0) rc = tally_store_incr(s, "after", 5, 1, TALLY_COUNTER_CREATE);
  return rc == 0 ? 0 : 1;
}

static void test_exec_while_held(void) {
  char spec[1300], path[1300];
  spec_of(spec, sizeof spec, path, sizeof path, "execheld.tly");
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    tally_store *s = NULL;
    if (tally_store_open(spec, NULL, &s)) _exit(3);
    pthread_t th;
    pthread_create(&th, NULL, hold_forever, s);
    while (atomic_load(&s->hdr->lock_owner) == 0) usleep(1000);
    execl("/proc/self/exe", "test_lock", "again", spec, (char *)NULL);
    _exit(4);
  }
  int st = 0;
  waitpid(pid, &st, 0);
  atomic_fetch_add(&tu_checks, 1);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
    TU_FAIL("the program after exec could not open the store its pid held: status 0x%x",
            st);
  tally_store *s = NULL;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  expect_value(s, "after", 1);
  tally_store_close(s);
}

int main(int argc, char **argv) {
  if (argc == 3 && strcmp(argv[1], "again") == 0) return after_exec(argv[2]);
  alarm(120); /* a lock never taken over hangs: fail instead */
  snprintf(g_dir, sizeof g_dir, "%s", tu_tmpdir("lock"));
  test_exec_while_held();
  test_live_holder();
  test_killed_holder();
  test_takeover_in_open();
  test_copy_while_held();
  test_stale_words();
  test_leader_exited();
  test_formats();
  test_record_units();
  test_creators();
  test_growing_not_truncated();
  test_cap_killed(TALLY__FORMAT_FLOCK);
  test_cap_killed(TALLY__FORMAT);
  int rc = tu_finish("test_lock");
  if (rc == 0) tu_rmrf(g_dir);
  return rc;
}
