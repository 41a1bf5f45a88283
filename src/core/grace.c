/* grace.c -- grace periods across processes, and this process's handles.
 *
 * Retired space (space.c) may be reused once no process can still reach
 * it. Each process that opens a store takes a slot in the store's process
 * table: its owner (pid and start time, so a recycled pid is not taken
 * for it) and the epoch it has passed. A process passes an epoch in its
 * grace step (run by tally_store_maintain, hence db:tick, and by creates
 * and drops): it points every handle it holds to a counter retired since
 * at the counter's new cells, or at the tombstone cell if the counter is
 * gone, and then publishes the epoch. Limbo retired before the smallest
 * epoch of all live processes, grace_ms after that was first seen, is
 * reused.
 *
 * A dead process (its pid gone) never holds reuse back: its slot is freed.
 * A stopped one (SIGSTOP) holds it back until it runs again. A process
 * that holds no handle (and never incremented by name) publishes itself
 * idle and holds nothing back (an nginx master that opened the store in
 * init_by_lua). The increment's fast path does none of this: it only ever
 * follows the handle's loc.
 *
 * What the epochs cannot see is a thread stopped between loading a
 * handle's loc and its add while another thread of its process runs the
 * grace step; grace_ms (default 1 s) bounds that window, as Varnish's
 * cooling period does.
 */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define DEFAULT_GRACE_MS 1000
#define ALIVE_MS         100   /* a process found alive is not looked at again sooner */
#define FORK_HOLD_MS     10000 /* a slot reserved for a child that never took it */
#define SWEEP_SLOTS      16    /* slots upkeep looks at for a dead owner, per step */

/* ---- the process table --------------------------------------------------- */

/* Threads of process pid ("Threads:" of /proc/PID/status), or 0. */
static long threads_of(pid_t pid) {
  char path[64], buf[4096];
  snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return 0;
  buf[n] = 0;
  const char *t = strstr(buf, "\nThreads:");
  return t ? strtol(t + 9, NULL, 10) : 0;
}

/* pid << 32 | a hash of the process's start time (field 22 of
 * /proc/PID/stat), or | 1 where /proc cannot tell. *zombie (may be NULL):
 * is it killed and not yet reaped (state Z or X)? A leader thread that
 * exited (pthread_exit) shows Z while its other threads run on: the
 * process is alive then, and may still be writing through its handles. */
uint64_t tally__owner_of(pid_t pid, bool *zombie) {
  char path[64], buf[1024];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  uint32_t start = 1;
  if (zombie) *zombie = false;
  if (fd >= 0) {
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n > 0) {
      buf[n] = 0;
      char *p = strrchr(buf, ')'); /* the command may hold spaces */
      if (p && zombie && p[1] == ' ')
        *zombie = p[2] == 'X' || (p[2] == 'Z' && threads_of(pid) <= 1);
      for (int field = 2; p && *p && field < 22; p++)
        if (*p == ' ') field++;
      if (p) start = (uint32_t)tally__mix(strtoull(p, NULL, 10)) | 1;
    }
  }
  return (uint64_t)(uint32_t)pid << 32 | start;
}

/* A zombie holds nothing; a recycled pid is another process. */
bool tally__owner_alive(uint64_t owner) {
  pid_t pid = (pid_t)(owner >> 32);
  bool zombie;
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  uint64_t now = tally__owner_of(pid, &zombie);
  if (zombie) return false;
  return (now & 0xffffffffu) == 1 || (owner & 0xffffffffu) == 1 || now == owner;
}

static struct tally__proc *procs(tally_store *s) {
  uint64_t off;
  if (tally__unseal(s, TALLY__SEAL_PROCS, atomic_load(&s->hdr->procs), 0, &off) || !off ||
      !tally__in_arena(s, off, TALLY__PROCS * sizeof(struct tally__proc)))
    return NULL;
  return tally__at(s, off);
}

/* A slot a forking parent reserves for its child: the parent's pid and
 * the time, in the low word, even where an owner's is odd. The child
 * takes it over in its fork handler; one never taken (the fork failed)
 * is free again FORK_HOLD_MS later. */
static uint64_t reservation(int64_t now_ms) {
  return (uint64_t)(uint32_t)tally__pid() << 32 | (uint32_t)((uint64_t)now_ms << 1);
}

static bool slot_alive(uint64_t o, int64_t now_ms) {
  if (o & 1) return tally__owner_alive(o);
  /* signed, as it wraps: one reserved after the caller read now_ms is
   * young (a few ms ahead), not 2^31 ms old; one far ahead is from
   * another boot */
  int32_t ahead = (int32_t)((uint32_t)o - (uint32_t)((uint64_t)now_ms << 1)) / 2;
  return ahead > -FORK_HOLD_MS && ahead < FORK_HOLD_MS;
}

/* Take a free slot of the table for owner, then write its word: a word
 * written first would overwrite that of whoever took the slot meanwhile.
 * Until then the slot shows the word its last owner left: 0 (closed: holds
 * all reuse back) or a dead process's. A dead owner's slot is freed on a
 * second pass. The slot's index, or -1 if the table is full. */
static int64_t take_slot(struct tally__proc *t, uint64_t owner, uint64_t seen) {
  int64_t now_ms = tally_monotonic_ms();
  for (int pass = 0; pass < 2; pass++) {
    for (uint32_t i = 0; i < TALLY__PROCS; i++) {
      uint64_t o = atomic_load(&t[i].owner);
      if (o && pass == 1 && !slot_alive(o, now_ms)) { /* a dead process's slot */
        atomic_compare_exchange_strong(&t[i].owner, &o, 0);
        o = atomic_load(&t[i].owner);
      }
      if (o) continue;
      TALLY__TEST_HOOK("claim", "", 0);
      if (atomic_compare_exchange_strong(&t[i].owner, &o, owner)) {
        atomic_store(&t[i].seen, seen);
        return i;
      }
    }
  }
  return -1;
}

static int claim(tally_store *s, uint64_t seen) {
  struct tally__proc *t = procs(s);
  if (!t)
    return tally__fail(TALLY_ECORRUPT, "%s: tally store is corrupt (process table)",
                       tally__store_name(s));
  int64_t i = take_slot(t, tally__owner_of(tally__pid(), NULL), seen);
  if (i < 0)
    return tally__fail(TALLY_EBUSY, "%s: %u processes have the store open (the most)",
                       tally__store_name(s), TALLY__PROCS);
  s->proc = (uint32_t)i;
  s->pid = tally__pid();
  s->procs_end = (uint64_t)((unsigned char *)&t[TALLY__PROCS] - s->base);
  return 0;
}

/* Free slot i, held by owner: the word first, since once the slot is
 * free the word is the next owner's. */
static void give_slot_back(struct tally__proc *t, uint32_t i, uint64_t owner) {
  atomic_store(&t[i].seen, 0);
  atomic_compare_exchange_strong(&t[i].owner, &owner, 0);
}

int tally__grace_open(tally_store *s) {
  s->grace_ms = DEFAULT_GRACE_MS;
  const char *g = getenv("TALLY_GRACE_MS");
  if (g && *g) s->grace_ms = strtoll(g, NULL, 10);
  s->seen = atomic_load(&s->hdr->epoch);
  return claim(s, s->seen << 1 | 1);
}

void tally__grace_close(tally_store *s) {
  struct stat st; /* a file truncated under us: touching the table is SIGBUS */
  if (!s->hdr || !s->pid ||
      (s->kind == TALLY__FILE &&
       (fstat(s->fd, &st) != 0 || (uint64_t)st.st_size < s->procs_end)))
    return;
  struct tally__proc *t = procs(s);
  if (!t) return;
  uint64_t me = atomic_load(&t[s->proc].owner);
  if (me >> 32 == (uint64_t)tally__pid() && (me & 1)) give_slot_back(t, s->proc, me);
}

/* A forked child holds copies of its parent's handles, valid as of the
 * parent's epoch. Were the child to take a slot only once it runs, the
 * parent could pass a grace step first and let those handles' old cells
 * be reused. So the parent reserves the child's slot before the fork, at
 * its own word, and holds hlock (its word and its handles) until the
 * fork is done. */
void tally__grace_fork_prepare(tally_store *s) {
  pthread_mutex_lock(&s->hlock);
  struct tally__proc *t = procs(s);
  s->fork_slot = TALLY__PROCS;
  if (!t) return;
  /* its own word; forked itself with no slot yet, the epoch its handles
   * are valid at */
  s->fork_seen = s->pid == tally__pid() ? atomic_load(&t[s->proc].seen) : s->seen << 1;
  s->fork_owner = reservation(tally_monotonic_ms());
  /* the window in which the slot shows a stale word is covered by our own */
  int64_t i = take_slot(t, s->fork_owner, s->fork_seen);
  if (i >= 0) s->fork_slot = (uint32_t)i;
}

void tally__grace_fork_parent(tally_store *s, bool failed) {
  struct tally__proc *t = procs(s);
  if (failed && t && s->fork_slot < TALLY__PROCS &&
      atomic_load(&t[s->fork_slot].owner) == s->fork_owner)
    give_slot_back(t, s->fork_slot, s->fork_owner);
  pthread_mutex_unlock(&s->hlock);
}

void tally__grace_fork_child(tally_store *s) {
  struct tally__proc *t = procs(s);
  uint64_t r = s->fork_owner;
  if (t && s->fork_slot < TALLY__PROCS &&
      atomic_compare_exchange_strong(&t[s->fork_slot].owner, &r,
                                     tally__owner_of(tally__pid(), NULL))) {
    s->proc = s->fork_slot;
    s->pid = tally__pid();
  } else if (t) { /* none reserved (a full table), or held past FORK_HOLD_MS */
    (void)claim(s, s->fork_seen);
  }
  pthread_mutex_unlock(&s->hlock);
}

/* ---- this process's handles, by record ----------------------------------- */

struct tally__handles {
  size_t cap, n; /* buckets (a power of two), handles */
  tally_counter **bucket;
};

static size_t bucket_of(const struct tally__handles *h, uint64_t rec_off) {
  return (size_t)(tally__mix(rec_off) & (h->cap - 1));
}

static void insert(struct tally__handles *h, tally_counter *c) {
  size_t b = bucket_of(h, c->rec_off);
  c->next_same = h->bucket[b];
  h->bucket[b] = c;
}

void tally__handle_add_locked(tally_store *s, tally_counter *c) {
  struct tally__handles *h = s->handles;
  if (!h && (h = s->handles = calloc(1, sizeof *h))) {
    h->cap = 64;
    if (!(h->bucket = calloc(h->cap, sizeof *h->bucket))) {
      free(h);
      h = s->handles = NULL;
    }
  }
  if (h && h->n >= h->cap) { /* grow: rehash every chain */
    tally_counter **nb = calloc(h->cap * 2, sizeof *nb);
    if (nb) {
      tally_counter **old = h->bucket;
      size_t oc = h->cap;
      h->bucket = nb;
      h->cap *= 2;
      for (size_t i = 0; i < oc; i++)
        for (tally_counter *x = old[i], *next; x; x = next) {
          next = x->next_same;
          insert(h, x);
        }
      free(old);
    }
  }
  if (h) {
    insert(h, c);
    h->n++;
  }
}

void tally__handle_add(tally_store *s, tally_counter *c) {
  pthread_mutex_lock(&s->hlock);
  tally__handle_add_locked(s, c);
  pthread_mutex_unlock(&s->hlock);
}

/* Are holds of this process under way (tally__hold_begin), beyond the
 * caller's own `mine`? */
static bool held(tally_store *s, int mine) {
  return atomic_load(&s->holders) > mine && atomic_load(&s->hold_pid) == tally__pid();
}

/* What reads records or the index table by offset for as long as it runs
 * holds the epoch: a walk (a snapshot of a million counters takes about
 * 1 s, past grace_ms), and an open between its lookup and its handle's
 * insertion (a grace step there would refresh every handle but the one
 * not yet inserted, which would keep a retired location for good). A
 * grace step run by another thread meanwhile publishes no newer epoch
 * (the refreshes still run), and a process published idle publishes the
 * current one first. */
void tally__hold_begin(tally_store *s) {
  pthread_mutex_lock(&s->hlock);
  if (atomic_load(&s->hold_pid) != tally__pid()) { /* a fork copied its parent's */
    atomic_store(&s->holders, 0);
    atomic_store(&s->hold_pid, tally__pid());
  }
  atomic_fetch_add(&s->holders, 1);
  struct tally__proc *t = procs(s);
  uint64_t e = atomic_load_explicit(&s->hdr->epoch, memory_order_seq_cst);
  if (t && s->pid && s->pid != tally__pid()) {
    /* forked, with no slot of its own yet (its parent's is not): one at the
     * epoch its handles are valid at; the next step refreshes them. Not
     * in an open before its slot (pid 0): a walk there runs under the
     * lock (a takeover's recount), and the open takes the slot after */
    (void)claim(s, s->seen << 1);
  } else if (t && (atomic_load(&t[s->proc].seen) & 1)) {
    s->seen = e;
    atomic_store_explicit(&t[s->proc].seen, e << 1, memory_order_seq_cst);
  }
  pthread_mutex_unlock(&s->hlock);
}

/* The last hold's end: a process that holds no handle is idle again, as
 * its grace step would publish it (one that only walked, `tally ls`, or a
 * family's definition in an nginx master, may never run another; an open
 * that failed). */
void tally__hold_end(tally_store *s) {
  if (atomic_load(&s->hold_pid) != tally__pid() || atomic_fetch_sub(&s->holders, 1) != 1)
    return;
  pthread_mutex_lock(&s->hlock);
  struct tally__proc *t = procs(s);
  if (t && s->pid == tally__pid() && !held(s, 0) && (!s->handles || !s->handles->n) &&
      !atomic_load(&s->by_name)) {
    uint64_t e = atomic_load_explicit(&s->hdr->epoch, memory_order_acquire);
    s->seen = e;
    atomic_store_explicit(&t[s->proc].seen, e << 1 | 1, memory_order_release);
  }
  pthread_mutex_unlock(&s->hlock);
}

/* Increments by name (tally_store_incr) reach cells without a handle: from
 * the first one on, this process never publishes itself idle, so what it
 * may be about to touch is held back as a handle's cells are. */
void tally__grace_by_name(tally_store *s) {
  pthread_mutex_lock(&s->hlock);
  atomic_store(&s->by_name, true);
  pthread_mutex_unlock(&s->hlock);
  tally__hold_begin(s); /* idle no more, from here on */
  tally__hold_end(s);
}

void tally__handle_remove_locked(tally_store *s, tally_counter *c) {
  struct tally__handles *h = s->handles;
  if (h)
    for (tally_counter **p = &h->bucket[bucket_of(h, c->rec_off)]; *p;
         p = &(*p)->next_same)
      if (*p == c) {
        *p = c->next_same;
        h->n--;
        break;
      }
}

void tally__handle_remove(tally_store *s, tally_counter *c) {
  pthread_mutex_lock(&s->hlock);
  tally__handle_remove_locked(s, c);
  pthread_mutex_unlock(&s->hlock);
}

/* How many counter handles this process has open on s (tests). */
size_t tally__handles_open(tally_store *s) {
  pthread_mutex_lock(&s->hlock);
  size_t n = s->handles ? s->handles->n : 0;
  pthread_mutex_unlock(&s->hlock);
  return n;
}

/* The store closes: handles still open (a host's garbage collector may
 * close them later) forget it, so closing them touches nothing freed. */
void tally__handles_free(tally_store *s) {
  struct tally__handles *h = s->handles;
  for (size_t i = 0; h && i < h->cap; i++)
    for (tally_counter *c = h->bucket[i]; c; c = c->next_same) {
      tally_vector *v = atomic_load(&c->vec);
      if (v) tally__vector_forget(v, c->vslot); /* no adds to unmapped cells */
      c->s = NULL;
    }
  if (s->handles) free(s->handles->bucket);
  free(s->handles);
  s->handles = NULL;
}

uint64_t tally__tombstone_loc(void) {
  return (uint64_t)(offsetof(struct tally__header, tombstone) >> 3) << 32;
}

/* Point this process's handles of the counter at rec_off where they must
 * go: its current cells, or the tombstone if it is gone. */
static void refresh_rec(tally_store *s, uint64_t rec_off) {
  struct tally__handles *h = s->handles;
  struct tally__rec *r = tally__at(s, rec_off);
  uint64_t loc = atomic_load_explicit(&r->loc, memory_order_acquire);
  int gone = 0;
  if (loc & TALLY__LOC_DROPPED)
    gone = (atomic_load(&r->flags) & TALLY__REC_EXPIRED) ? 2 : 1;
  for (tally_counter *c = h->bucket[bucket_of(h, rec_off)]; c; c = c->next_same) {
    if (tally__crec(c) != rec_off || atomic_load(&c->gone)) continue;
    if (gone) atomic_store(&c->gone, gone);
    tally__handle_set_loc(c, gone ? tally__tombstone_loc() : loc);
  }
}

/* A record retired (SMALL) or moved (REF) in the node: its handles. */
static void refresh_node(tally_store *s, const struct tally__limbo *l, void *ud) {
  (void)ud;
  if (!s->handles || !s->handles->n) return;
  for (uint32_t i = 0; i < l->n; i++) {
    int kind = (int)((l->item[i] >> 32) & 3);
    if (kind == TALLY__ITEM_SMALL || kind == TALLY__ITEM_REF)
      refresh_rec(s, (l->item[i] & 0xffffffffu) << 3);
  }
}

/* Is the owner of table slot i alive? Unless asked to look, a process
 * found alive is taken to be so for ALIVE_MS more: that can only delay
 * reuse, never free a live process's slot (a dead one is acted on at
 * once). In nginx the other workers are behind while one creates names,
 * and a look at each of them per create made a create cost 13.8 us, not
 * 2.0 (scripts/bench-openresty's first pass). */
static bool alive_seen(tally_store *s, uint32_t i, uint64_t o, int64_t now_ms,
                       bool look) {
  struct tally__alive *a = &s->alive[i % TALLY__ALIVE_SEEN];
  if (!(o & 1)) return slot_alive(o, now_ms); /* reserved: no look needed */
  if (!look && atomic_load_explicit(&a->owner, memory_order_relaxed) == o &&
      now_ms - atomic_load_explicit(&a->at_ms, memory_order_relaxed) < ALIVE_MS)
    return true;
  if (!tally__owner_alive(o)) return false;
  atomic_store_explicit(&a->at_ms, now_ms, memory_order_relaxed);
  atomic_store_explicit(&a->owner, o, memory_order_relaxed);
  return true;
}

void tally__grace_step(tally_store *s, bool look, bool in_open) {
  struct tally__header *h = s->hdr;
  struct tally__proc *t = procs(s);
  if (!t) return;
  uint64_t epoch = atomic_load_explicit(&h->epoch, memory_order_acquire), tail_off;
  /* close the current epoch if something was retired in it: what is
   * retired from now on is stamped with the next one */
  if (tally__unseal(s, TALLY__SEAL_LIMBO, atomic_load(&h->limbo_tail), 0, &tail_off) ==
          0 &&
      tail_off && ((struct tally__limbo *)tally__at(s, tail_off))->epoch >= epoch) {
    epoch = ((struct tally__limbo *)tally__at(s, tail_off))->epoch + 1;
    atomic_store_explicit(&h->epoch, epoch, memory_order_release);
  }
  pthread_mutex_lock(&s->hlock);
  if (s->seen < epoch) (void)tally__limbo_each(s, s->seen, refresh_node, NULL);
  /* while a walk or an open holds the epoch (tally__hold_begin), it stays;
   * the caller's own open made its record under the lock this step runs
   * under, so no drop has retired that yet */
  if (!held(s, in_open)) {
    bool idle = (!s->handles || s->handles->n == 0) && !atomic_load(&s->by_name);
    /* forked with no slot of its own: take one (the parent's is not; with
     * the table full, this process publishes nothing) */
    if (s->pid == tally__pid() || claim(s, epoch << 1 | idle) == 0) {
      s->seen = epoch; /* this process's words change under hlock only */
      atomic_store_explicit(&t[s->proc].seen, epoch << 1 | idle, memory_order_release);
    }
  }
  pthread_mutex_unlock(&s->hlock);
  uint64_t min_seen = epoch;
  int64_t now_ms = tally_monotonic_ms();
  for (uint32_t i = 0; i < TALLY__PROCS; i++) {
    uint64_t o = atomic_load(&t[i].owner);
    if (!o) continue;
    uint64_t w = atomic_load(&t[i].seen);
    if ((w & 1) || (w >> 1) >= min_seen) { /* holds nothing back now */
      /* upkeep frees dead owners' slots, SWEEP_SLOTS a step (one that
       * exited idle is never behind): a table full of them left forks no
       * reserved slot */
      if (look && i != s->proc && (i - s->sweep_from) % TALLY__PROCS < SWEEP_SLOTS &&
          !slot_alive(o, now_ms))
        atomic_compare_exchange_strong(&t[i].owner, &o, 0);
      continue;
    }
    if (!alive_seen(s, i, o, now_ms, look)) { /* dead: never holds reuse back */
      atomic_compare_exchange_strong(&t[i].owner, &o, 0);
      continue;
    }
    min_seen = w >> 1;
  }
  if (look) s->sweep_from = (s->sweep_from + SWEEP_SLOTS) % TALLY__PROCS;
  tally__reclaim(s, min_seen, now_ms);
}

int tally__grace_table_create(tally_store *s) {
  uint64_t off;
  int rc = tally__alloc(s, TALLY__PROCS * sizeof(struct tally__proc), &off);
  if (rc == 0) atomic_store(&s->hdr->procs, tally__seal(s, TALLY__SEAL_PROCS, off, 0));
  return rc;
}

int tally__grace_others(tally_store *s, int64_t *pid) {
  struct tally__proc *t = procs(s);
  if (!t)
    return tally__fail(TALLY_ECORRUPT, "%s: tally store is corrupt (process table)",
                       tally__store_name(s));
  int64_t now_ms = tally_monotonic_ms();
  for (uint32_t i = 0; i < TALLY__PROCS; i++) {
    uint64_t o = atomic_load(&t[i].owner);
    if (!o || i == s->proc) continue;
    /* dead (or a zombie), or reserved for a child long ago: free now */
    if (!slot_alive(o, now_ms)) {
      atomic_compare_exchange_strong(&t[i].owner, &o, 0);
      continue;
    }
    *pid = (int64_t)(o >> 32);
    return 1;
  }
  return 0;
}

int tally__grace_pids(tally_store *s, int64_t *pids, int cap) {
  struct tally__proc *t = procs(s);
  if (!t)
    return tally__fail(TALLY_ECORRUPT, "%s: tally store is corrupt (process table)",
                       tally__store_name(s));
  int64_t now_ms = tally_monotonic_ms();
  int n = 0;
  for (uint32_t i = 0; i < TALLY__PROCS; i++) {
    uint64_t o = atomic_load(&t[i].owner);
    if (!o || !slot_alive(o, now_ms)) continue;
    if (!(o & 1)) return cap + 1; /* a child about to take its slot: unknown */
    int64_t pid = (int64_t)(o >> 32);
    int seen = 0;
    for (int j = 0; j < n && !seen; j++) seen = pids[j] == pid;
    if (seen) continue;
    if (n == cap) return cap + 1;
    pids[n++] = pid;
  }
  return n;
}

/* Processes holding reuse back, for tally info. */
int tally_store_grace(tally_store *s, tally_grace_info *out) {
  if (!s || !out) return tally__fail(TALLY_EINVAL, "tally_store_grace: NULL argument");
  memset(out, 0, sizeof *out);
  struct tally__proc *t = procs(s);
  if (!t)
    return tally__fail(TALLY_ECORRUPT, "%s: tally store is corrupt (process table)",
                       tally__store_name(s));
  uint64_t epoch = atomic_load(&s->hdr->epoch);
  out->epoch = epoch;
  int64_t now_ms = tally_monotonic_ms();
  for (uint32_t i = 0; i < TALLY__PROCS; i++) {
    uint64_t o = atomic_load(&t[i].owner), w = atomic_load(&t[i].seen);
    if (!o || !slot_alive(o, now_ms)) continue;
    out->processes++;
    if (!(w & 1) && (w >> 1) < epoch) {
      if (!out->oldest_pid || (w >> 1) < out->oldest_seen) {
        out->oldest_pid = (int64_t)(o >> 32);
        out->oldest_seen = w >> 1;
      }
      out->behind++;
    }
  }
  return 0;
}
