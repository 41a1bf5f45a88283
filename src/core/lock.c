/* lock.c -- the store lock, and the list of open stores it needs.
 *
 * Structural changes (create, drop, reshard, family, growth, rollup leases)
 * run under the store lock: a process mutex, then, for a file store, the
 * file's own lock. Whatever a holder killed mid-change left half done is
 * a pending move that the next holder finishes as it takes the lock
 * (journal.c), so a dead holder only has to be noticed, never undone.
 * Only the families' live counts (family.c) are kept beside a change, not
 * in it: a holder that takes over counts them all again, once.
 *
 * Format 8: the file's lock is a word in the header, taken with one
 * compare-and-swap (no system call while nobody waits: flock() cost two,
 * half of a counter's creation on a VM). It holds the holder's owner word
 * (pid and start time, grace.c). A waiter spins briefly, then sleeps on a
 * futex for at most WAIT_MS at a time; each time it wakes to the same
 * holder, it checks that holder is still there:
 *   - every process that opens the file holds an OFD read lock on byte
 *     ATTACH_AT + its pid, which the kernel drops when the process dies
 *     (or closes the store); no such lock: the word is stale, whether its
 *     holder died, the machine rebooted, or the file is a copy made while
 *     another process held it;
 *   - a lock there but the pid recycled (the start time differs): stale.
 * A stale word is taken over with a compare-and-swap. All processes on one
 * file must agree on the protocol, hence the format number: format 7
 * files keep flock().
 */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define SPINS     64                 /* looks at a held word before sleeping */
#define WAIT_MS   2                  /* a sleeping waiter checks the holder this often */
#define ATTACH_AT (INT64_C(1) << 40) /* byte ATTACH_AT + pid: "pid has it open" */
#define PID_LIMIT (1 << 22)          /* Linux's PID_MAX_LIMIT */

/* flock() and the attach lock belong to the open file, which a forked
 * child shares with its parent: both would "hold" a flock() at once. So
 * fork() is bracketed: no store lock is held across it, and a child gives
 * each store's descriptor an open file of its own before it next locks. */
static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static tally_store *registry;

static void fork_prepare(void) {
  pthread_mutex_lock(&registry_lock);
  /* oldest first, as the one code that holds two stores' locks takes them
   * (a compaction: the old store, then the new one) */
  tally_store *oldest = registry;
  while (oldest && oldest->next) oldest = oldest->next;
  for (tally_store *s = oldest; s; s = s->prev) {
    pthread_mutex_lock(&s->lock);
    if (s->kind == TALLY__FILE) tally__grace_fork_prepare(s); /* the child's slot */
  }
  errno = 0; /* glibc's fork() sets it before the parent's handlers if it failed */
}

static void fork_parent(void) {
  int failed = errno == EAGAIN || errno == ENOMEM; /* no child: its slot is free */
  for (tally_store *s = registry; s; s = s->next) {
    if (s->kind == TALLY__FILE) tally__grace_fork_parent(s, failed);
    pthread_mutex_unlock(&s->lock);
  }
  pthread_mutex_unlock(&registry_lock);
}

/* This process's pid, cached: getpid() is a system call, and lookups and
 * every lock check it (a fork is noticed through the slot it changes). A
 * child learns its own pid in the fork handler below. */
static _Atomic pid_t self_pid;

static void fork_child(void) {
  atomic_store_explicit(&self_pid, getpid(), memory_order_relaxed);
  for (tally_store *s = registry; s; s = s->next) {
    s->lock_stale = s->kind == TALLY__FILE;
    if (s->kind == TALLY__FILE) tally__grace_fork_child(s); /* the slot reserved */
    pthread_mutex_unlock(&s->lock);
  }
  pthread_mutex_unlock(&registry_lock);
}

static pthread_once_t fork_once = PTHREAD_ONCE_INIT;
static void fork_init(void) {
  pthread_atfork(fork_prepare, fork_parent, fork_child);
}

pid_t tally__pid(void) {
  pid_t pid = atomic_load_explicit(&self_pid, memory_order_relaxed);
  if (__builtin_expect(pid == 0, 0)) {
    pthread_once(&fork_once, fork_init); /* from now on a child corrects it */
    pid = getpid();
    atomic_store_explicit(&self_pid, pid, memory_order_relaxed);
  }
  return pid;
}

void tally__registry_add(tally_store *s) {
  pthread_once(&fork_once, fork_init);
  pthread_mutex_lock(&registry_lock);
  s->next = registry;
  if (registry) registry->prev = s;
  registry = s;
  pthread_mutex_unlock(&registry_lock);
}

void tally__registry_remove(tally_store *s) {
  pthread_mutex_lock(&registry_lock);
  if (s->prev)
    s->prev->next = s->next;
  else if (registry == s)
    registry = s->next;
  if (s->next) s->next->prev = s->prev;
  pthread_mutex_unlock(&registry_lock);
}

int tally__lock_attach(tally_store *s) {
  struct flock fl = {.l_type = F_RDLCK,
                     .l_whence = SEEK_SET,
                     .l_start = ATTACH_AT + tally__pid(),
                     .l_len = 1};
  if (fcntl(s->fd, F_OFD_SETLK, &fl) != 0)
    return tally__fail_sys("cannot take an open-file lock (format 8 needs OFD locks)",
                           s->path);
  return 0;
}

/* In a forked child: the same file, through a new open file (same fd), so
 * that its flock() or its attach lock are its own. */
static int own_open_file(tally_store *s) {
  char proc[64];
  snprintf(proc, sizeof proc, "/proc/self/fd/%d", s->fd);
  int fd = open(proc, O_RDWR | O_CLOEXEC);
  if (fd < 0) return tally__fail_sys("cannot reopen after fork", s->path);
  int rc = dup3(fd, s->fd, O_CLOEXEC) < 0 ? tally__fail_sys("dup3", s->path) : 0;
  close(fd);
  if (rc == 0 && s->lock_word) rc = tally__lock_attach(s); /* before any lock */
  if (rc == 0) s->lock_stale = false;
  return rc;
}

static inline void spin_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

/* This process's owner word (grace.c), read from /proc once per pid. */
static uint64_t self_owner(void) {
  static _Atomic uint64_t word;
  uint64_t w = atomic_load_explicit(&word, memory_order_relaxed);
  pid_t pid = tally__pid();
  if ((pid_t)(w >> 32) != pid) {
    w = tally__owner_of(pid, NULL);
    atomic_store_explicit(&word, w, memory_order_relaxed);
  }
  return w;
}

/* A lock on byte ATTACH_AT + pid of the file, seen through our open file
 * (which never sees its own), or no answer from the kernel. */
static bool attach_held(tally_store *s, pid_t pid) {
  struct flock fl = {
      .l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = ATTACH_AT + pid, .l_len = 1};
  return !(fcntl(s->fd, F_OFD_GETLK, &fl) == 0 && fl.l_type == F_UNLCK);
}

bool tally__attached(tally_store *s, pid_t pid) {
  if (s->kind != TALLY__FILE || !s->lock_word) return true; /* no attach locks */
  if (pid <= 0 || pid >= PID_LIMIT) return false; /* no process: a damaged word */
  /* ours, or, not reopened since fork(), our parent's: never seen */
  if (pid == tally__pid() || atomic_load_explicit(&s->lock_stale, memory_order_relaxed))
    return true;
  return attach_held(s, pid);
}

/* Does the process of owner word o (the lock's holder) still have this
 * file open? See the top of this file. Our own pid is looked at too: a
 * word this pid left before an exec is stale, and the lock's process
 * mutex keeps our other threads from waiting here. */
static bool holder_present(tally_store *s, uint64_t o) {
  pid_t pid = (pid_t)(o >> 32);
  if (pid <= 0 || pid >= PID_LIMIT) return false; /* no process: a damaged word */
  if (!attach_held(s, pid)) return false;
  return tally__owner_alive(o); /* locked (or no answer): the pid alone decides */
}

/* True if the lock was taken over from a holder that is gone. */
static bool word_lock(tally_store *s) {
  _Atomic uint64_t *w = &s->hdr->lock_owner;
  _Atomic uint32_t *sleepers = &s->hdr->lock_sleepers;
  uint64_t me = self_owner();
  for (unsigned spin = 0;; spin++) {
    uint64_t o = 0;
    if (atomic_compare_exchange_weak_explicit(w, &o, me, memory_order_acquire,
                                              memory_order_relaxed))
      return false;
    if (o == 0) continue; /* a weak compare-and-swap's spurious failure */
    if (spin < SPINS) {
      spin_pause();
      continue;
    }
    /* sleepers first, then the word again: an unlock after that look sees
     * sleepers set and wakes us (or the futex finds sleepers 0 at once) */
    atomic_store(sleepers, 1);
    if (atomic_load(w) != o) continue;
    struct timespec ts = {0, WAIT_MS * 1000000L};
    long r = syscall(SYS_futex, (uint32_t *)sleepers, FUTEX_WAIT, 1, &ts, NULL, 0);
    if (r != 0 && errno == ETIMEDOUT && atomic_load(w) == o && !holder_present(s, o) &&
        atomic_compare_exchange_strong(w, &o, me))
      return true; /* a stale holder taken over: tally__lock finishes its work */
  }
}

static void word_unlock(tally_store *s) {
  uint64_t me = self_owner();
  /* only our own: a holder wrongly taken over must not free the new one */
  atomic_compare_exchange_strong(&s->hdr->lock_owner, &me, 0);
  if (atomic_load(&s->hdr->lock_sleepers) && atomic_exchange(&s->hdr->lock_sleepers, 0))
    syscall(SYS_futex, (uint32_t *)&s->hdr->lock_sleepers, FUTEX_WAKE, INT_MAX, NULL,
            NULL, 0);
}

/* Format 7: the holder of the flock() writes its owner word in lock_owner
 * too (unused there by the lock itself) and clears it before unlocking,
 * so a word found there once the flock() is ours is a dead holder's (or a
 * copy's, made while held): a takeover, as word_lock's. Older versions
 * never write it, so their deaths go unnoticed. */
static bool flock_taken_over(tally_store *s) {
  return atomic_exchange(&s->hdr->lock_owner, self_owner()) != 0;
}

int tally__lock(tally_store *s) {
  pthread_mutex_lock(&s->lock);
  bool taken_over = false;
  if (s->kind == TALLY__FILE) {
    int rc = s->lock_stale ? own_open_file(s) : 0;
    if (rc == 0 && s->lock_word) taken_over = word_lock(s);
    while (rc == 0 && !s->lock_word && flock(s->fd, LOCK_EX) != 0)
      if (errno != EINTR) rc = tally__fail_sys("cannot lock", s->path);
    if (rc) {
      pthread_mutex_unlock(&s->lock);
      return rc;
    }
    if (!s->lock_word) taken_over = flock_taken_over(s);
  }
  /* a holder died in the middle of limbo's updates: set them right before
   * anything allocates (a finishing move does), or a piece a reclaim
   * pushed but did not count could be taken, then pushed again */
  tally__limbo_repair(s);
  if (atomic_load_explicit(&s->hdr->pend_rec, memory_order_acquire))
    (void)tally__journal_finish(s); /* ... or mid-move: finish its work
                                    (a damaged move record is reported at open) */
  /* ... or between a counter's creation or burial and its family's live
   * count, which nothing in the store tells: count them all again (a
   * damaged index is reported at open) */
  if (taken_over) (void)tally__family_recount(s);
  return 0;
}

void tally__unlock(tally_store *s) {
  if (s->kind == TALLY__FILE && s->lock_word) {
    word_unlock(s);
  } else if (s->kind == TALLY__FILE) {
    atomic_store(&s->hdr->lock_owner, 0); /* before the flock() goes: see above */
    flock(s->fd, LOCK_UN);
  }
  pthread_mutex_unlock(&s->lock);
}

const char *tally_store_fault_path(const void *addr) {
  const unsigned char *a = addr;
  for (tally_store *s = registry; s; s = s->next) /* no lock: see tally.h */
    if (s->kind == TALLY__FILE && s->base && a >= s->base && a < s->base + s->reserved)
      return s->path;
  return NULL;
}
