/* lock.c -- the store lock, and the list of open stores it needs.
 *
 * Structural changes (create, drop, reshard, family, growth, rollup leases)
 * run under the store lock: a process mutex plus flock() on the file.
 * flock dies with its process, so a holder killed mid-change never blocks
 * the others; whatever it left half done is a pending move that the next
 * holder finishes as it takes the lock (journal.c).
 */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/file.h>
#include <unistd.h>

/* flock() belongs to the open file, which a forked child shares with its
 * parent: both would "hold" the lock at once. So fork() is bracketed: no
 * store lock is held across it, and a child gives each store's descriptor
 * an open file of its own before it next locks. */
static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static tally_store *registry;

static void fork_prepare(void) {
  pthread_mutex_lock(&registry_lock);
  for (tally_store *s = registry; s; s = s->next) pthread_mutex_lock(&s->lock);
}

static void fork_parent(void) {
  for (tally_store *s = registry; s; s = s->next) pthread_mutex_unlock(&s->lock);
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
    if (s->kind == TALLY__FILE) tally__grace_fork_child(s); /* a slot of its own */
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

/* In a forked child: the same file, through a new open file (same fd). */
static int own_open_file(tally_store *s) {
  char proc[64];
  snprintf(proc, sizeof proc, "/proc/self/fd/%d", s->fd);
  int fd = open(proc, O_RDWR | O_CLOEXEC);
  if (fd < 0) return tally__fail_sys("cannot reopen after fork", s->path);
  int rc = dup3(fd, s->fd, O_CLOEXEC) < 0 ? tally__fail_sys("dup3", s->path) : 0;
  close(fd);
  if (rc == 0) s->lock_stale = false;
  return rc;
}

int tally__lock(tally_store *s) {
  pthread_mutex_lock(&s->lock);
  if (s->kind == TALLY__FILE) {
    int rc = s->lock_stale ? own_open_file(s) : 0;
    while (rc == 0 && flock(s->fd, LOCK_EX) != 0)
      if (errno != EINTR) rc = tally__fail_sys("cannot lock", s->path);
    if (rc) {
      pthread_mutex_unlock(&s->lock);
      return rc;
    }
  }
  if (atomic_load_explicit(&s->hdr->pend_rec, memory_order_acquire))
    (void)tally__journal_finish(s); /* a holder died mid-move: finish its work
                                    (a damaged move record is reported at open) */
  tally__limbo_repair(s);           /* ... or in the middle of limbo's updates */
  return 0;
}

void tally__unlock(tally_store *s) {
  if (s->kind == TALLY__FILE) flock(s->fd, LOCK_UN);
  pthread_mutex_unlock(&s->lock);
}

const char *tally_store_fault_path(const void *addr) {
  const unsigned char *a = addr;
  for (tally_store *s = registry; s; s = s->next) /* no lock: see tally.h */
    if (s->kind == TALLY__FILE && s->base && a >= s->base && a < s->base + s->reserved)
      return s->path;
  return NULL;
}
