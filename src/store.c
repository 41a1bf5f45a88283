/* store.c -- opening, validating, growing, locking and syncing a store.
 *
 * Both kinds of store are one mapping of TALLY__MAX_BYTES of address space
 * made once at open: anonymous memory for "memory", the file itself for
 * "file". A shared file mapping may be longer than the file; pages become
 * usable as the file grows, in every process, with no remap. So pointers
 * into a store never move, and growth is just fallocate + a new `size`.
 *
 * Structural changes (create, drop, reshard, family, growth) run under the
 * store lock: a process mutex plus flock() on the file. flock dies with its
 * process, and every structural change is written so that a process killed
 * in the middle leaves either the old state, the new state, or a pending
 * move that the next lock holder finishes (see counter.c).
 *
 * A new file is written in full under a temporary name and link()ed into
 * place, so no process ever sees a half-written header.
 */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define GROW_MIN (1u << 20)

static _Atomic uint64_t next_store_id = 1;

const char *tally__store_name(const tally_store *s) {
  return s->path ? s->path : "memory";
}

static uint64_t header_check(const struct tally__header *h) {
  return tally__hash(h, offsetof(struct tally__header, check), 0x68647221);
}

uint64_t tally__seal(const tally_store *s, int field, uint64_t off,
                     uint64_t extra) {
  if (!off) return 0;
  uint64_t check = tally__mix(s->hdr->salt ^ (uint64_t)field << 56 ^ off ^
                              tally__mix(extra)) >> 32;
  return (off >> 3) << 32 | check;
}

int tally__unseal(const tally_store *s, int field, uint64_t word,
                  uint64_t extra, uint64_t *off) {
  uint64_t o = (word >> 32) << 3;
  if (word && tally__seal(s, field, o, extra) != word)
    return tally__fail(TALLY_ECORRUPT, "%s: tally store is corrupt (%s pointer)",
                       tally__store_name(s), field == TALLY__SEAL_INDEX ? "index"
                       : field == TALLY__SEAL_FAMILIES ? "family"
                       : field == TALLY__SEAL_MOVE ? "move"
                       : field == TALLY__SEAL_ROLLUPS ? "rollup table" : "rollup");
  *off = word ? o : 0;
  return 0;
}

bool tally__in_arena(const tally_store *s, uint64_t off, uint64_t len) {
  uint64_t used = atomic_load_explicit(&s->hdr->used, memory_order_acquire);
  return off >= TALLY__ARENA_OFF && len <= used && off <= used - len;
}

/* ---- locking ------------------------------------------------------------ */

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

static void fork_child(void) {
  for (tally_store *s = registry; s; s = s->next) {
    s->lock_stale = s->kind == TALLY__FILE;
    pthread_mutex_unlock(&s->lock);
  }
  pthread_mutex_unlock(&registry_lock);
}

static pthread_once_t fork_once = PTHREAD_ONCE_INIT;
static void fork_init(void) { pthread_atfork(fork_prepare, fork_parent, fork_child); }

static void registry_add(tally_store *s) {
  pthread_once(&fork_once, fork_init);
  pthread_mutex_lock(&registry_lock);
  s->next = registry;
  if (registry) registry->prev = s;
  registry = s;
  pthread_mutex_unlock(&registry_lock);
}

static void registry_remove(tally_store *s) {
  pthread_mutex_lock(&registry_lock);
  if (s->prev) s->prev->next = s->next;
  else if (registry == s) registry = s->next;
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
    (void)tally__finish_move(s); /* a holder died mid-move: finish its work
                                    (a damaged move record is reported at open) */
  return 0;
}

void tally__unlock(tally_store *s) {
  if (s->kind == TALLY__FILE) flock(s->fd, LOCK_UN);
  pthread_mutex_unlock(&s->lock);
}

/* ---- allocation ----------------------------------------------------------- */

static int grow(tally_store *s, uint64_t need) {
  struct tally__header *h = s->hdr;
  uint64_t size = atomic_load_explicit(&h->size, memory_order_relaxed);
  uint64_t want = size + size / 8; /* 12.5%: file size stays close to use */
  if (want < need) want = need;
  want = (want + GROW_MIN - 1) & ~(uint64_t)(GROW_MIN - 1);
  if (want > TALLY__MAX_BYTES) want = TALLY__MAX_BYTES;
  if (want < need)
    return tally__fail(TALLY_EFULL, "%s: store is full (%llu bytes)",
                       tally__store_name(s),
                       (unsigned long long)TALLY__MAX_BYTES);
  if (s->kind == TALLY__FILE) {
    /* Reserve real blocks: a sparse file would turn a full disk into
     * SIGBUS on some later increment instead of an error here. */
    int rc = posix_fallocate(s->fd, (off_t)size, (off_t)(want - size));
    if (rc == EOPNOTSUPP || rc == EINVAL) {
      if (ftruncate(s->fd, (off_t)want) != 0)
        return tally__fail_sys("ftruncate", s->path);
    } else if (rc != 0) {
      errno = rc;
      return tally__fail_sys("cannot grow store", s->path);
    }
  }
  atomic_store_explicit(&h->size, want, memory_order_release);
  return 0;
}

/* Hand out `bytes` zeroed bytes, 64-aligned. Caller holds the lock.
 * The space past `used` was never handed out, so it must be zero; if it is
 * not, `used` is damaged and handing it out would overwrite live data. */
int tally__alloc(tally_store *s, uint64_t bytes, uint64_t *off) {
  struct tally__header *h = s->hdr;
  uint64_t used = atomic_load_explicit(&h->used, memory_order_relaxed);
  uint64_t start = (used + 63) & ~(uint64_t)63;
  bytes = (bytes + 7) & ~(uint64_t)7;
  if (bytes > TALLY__MAX_BYTES || start + bytes > TALLY__MAX_BYTES)
    return tally__fail(TALLY_EFULL, "%s: store is full",
                       tally__store_name(s));
  if (start + bytes > atomic_load_explicit(&h->size, memory_order_relaxed)) {
    int rc = grow(s, start + bytes);
    if (rc) return rc;
  }
  const uint64_t *p = tally__at(s, start);
  for (uint64_t i = 0; i < bytes / 8; i++)
    if (p[i] != 0)
      return tally__fail(TALLY_ECORRUPT,
                         "%s: tally store is corrupt (free space at offset "
                         "%llu is not empty)", tally__store_name(s),
                         (unsigned long long)(start + i * 8));
  atomic_store_explicit(&h->used, start + bytes, memory_order_release);
  *off = start;
  return 0;
}

/* ---- creating and validating --------------------------------------------- */

static void header_init(struct tally__header *h) {
  memset(h, 0, sizeof *h);
  memcpy(h->magic, TALLY__MAGIC, 8);
  h->format = TALLY__FORMAT;
  h->header_bytes = TALLY__HEADER_BYTES;
  h->cell_bytes = 8;
  h->row_cells = TALLY__ROW_CELLS;
  h->max_shards = TALLY_MAX_SHARDS;
  h->byte_order = TALLY__BYTE_ORDER;
  h->max_bytes = TALLY__MAX_BYTES;
  h->arena_off = TALLY__ARENA_OFF;
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  h->salt = tally__mix((uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^
                       ((uint64_t)getpid() << 16) ^ (uint64_t)(uintptr_t)h);
  h->check = header_check(h);
  atomic_store(&h->size, TALLY__ARENA_OFF);
  atomic_store(&h->used, TALLY__ARENA_OFF);
}

/* Checks of the header as read from disk, before anything is mapped. */
static int header_validate(const struct tally__header *h, uint64_t file_size,
                           const char *path) {
  if (memcmp(h->magic, TALLY__MAGIC, 8) != 0)
    return tally__fail(TALLY_ENOTSTORE, "%s: not a tally store (bad magic)",
                       path);
  if (h->format != TALLY__FORMAT)
    return tally__fail(TALLY_EVERSION,
                       "%s: unsupported tally store format %u (this is %u)",
                       path, h->format, TALLY__FORMAT);
  if (h->header_bytes != TALLY__HEADER_BYTES || h->cell_bytes != 8 ||
      h->row_cells != TALLY__ROW_CELLS || h->max_shards != TALLY_MAX_SHARDS ||
      h->byte_order != TALLY__BYTE_ORDER || h->max_bytes != TALLY__MAX_BYTES ||
      h->arena_off != TALLY__ARENA_OFF)
    return tally__fail(TALLY_EVERSION,
                       "%s: tally store has another layout (built for "
                       "another version or machine)", path);
  if (h->check != header_check(h))
    return tally__fail(TALLY_ECORRUPT,
                       "%s: tally store is corrupt (header checksum)", path);
  uint64_t size = atomic_load(&h->size), used = atomic_load(&h->used);
  if (size > file_size)
    return tally__fail(TALLY_ECORRUPT,
                       "%s: tally store is truncated (header says %llu bytes, "
                       "file has %llu)", path, (unsigned long long)size,
                       (unsigned long long)file_size);
  if (used < TALLY__ARENA_OFF || used > size || size > TALLY__MAX_BYTES ||
      used % 8 != 0)
    return tally__fail(TALLY_ECORRUPT,
                       "%s: tally store is corrupt (bad size fields)", path);
  if (atomic_load(&h->pend_done) > TALLY_MAX_SHARDS)
    return tally__fail(TALLY_ECORRUPT,
                       "%s: tally store is corrupt (bad pending move)", path);
  return 0;
}

/* Write a fresh store to a temporary file and link it into place. If
 * another process won the race, use its file. */
static int create_file(const char *path, mode_t mode) {
  size_t n = strlen(path) + 16;
  char *tmp = malloc(n);
  if (!tmp) return tally__fail(TALLY_ENOMEM, "out of memory");
  snprintf(tmp, n, "%s.tmp.XXXXXX", path);  /* unique even after a crash */
  int fd = mkostemp(tmp, O_CLOEXEC);
  if (fd < 0) {
    int rc = tally__fail_sys("cannot create", path);
    free(tmp);
    return rc;
  }
  int rc = 0;
  struct tally__header h;
  header_init(&h);
  unsigned char page[TALLY__ARENA_OFF];
  memset(page, 0, sizeof page);
  memcpy(page, &h, sizeof h);
  if (fchmod(fd, mode & 0777) != 0 || pwrite(fd, page, sizeof page, 0) !=
      (ssize_t)sizeof page || fsync(fd) != 0)
    rc = tally__fail_sys("cannot write", path);
  else if (link(tmp, path) != 0 && errno != EEXIST)
    rc = tally__fail_sys("cannot create", path);
  unlink(tmp);
  close(fd);
  free(tmp);
  return rc;
}

/* Refuse what another user could have planted for this process to write
 * into: a symlink (O_NOFOLLOW) and a file owned by another uid, unless the
 * caller trusts the path (TALLY_OPEN_TRUST). */
static int open_own(const char *path, uint32_t flags, int *out) {
  bool trust = (flags & TALLY_OPEN_TRUST) != 0;
  int fd = open(path, O_RDWR | O_CLOEXEC | (trust ? 0 : O_NOFOLLOW));
  if (fd < 0 && errno == ELOOP && !trust) {
    struct stat lst;
    if (lstat(path, &lst) == 0 && S_ISLNK(lst.st_mode))
      return tally__fail(TALLY_EUNTRUSTED, "%s: refusing to open a symbolic "
                         "link as a store (open its target, or trust the "
                         "path: TALLY_OPEN_TRUST, Lua { trust = true })", path);
  }
  if (fd < 0) return errno; /* positive: the caller decides */
  struct stat st;
  if (!trust && fstat(fd, &st) == 0 && st.st_uid != geteuid()) {
    close(fd);
    return tally__fail(TALLY_EUNTRUSTED, "%s: refusing a store owned by "
                       "another user (uid %lu, this process runs as %lu; trust "
                       "the path: TALLY_OPEN_TRUST, Lua { trust = true })", path,
                       (unsigned long)st.st_uid, (unsigned long)geteuid());
  }
  *out = fd;
  return 0;
}

static int map_file(tally_store *s, const char *path, const tally_open_options *o) {
  uint32_t flags = o ? o->flags : 0;
  mode_t mode = o && o->mode ? (mode_t)(o->mode & 0777) : 0600; /* never setuid,
                                                                  setgid, sticky */
  int fd = -1;
  int rc = open_own(path, flags, &fd);
  if (rc == ENOENT && !(flags & TALLY_OPEN_NOCREATE)) {
    if ((rc = create_file(path, mode))) return rc;
    rc = open_own(path, flags, &fd);
  }
  if (rc < 0) return rc;
  if (rc > 0) {
    errno = rc;
    return tally__fail_sys("cannot open", path);
  }
  s->fd = fd;
  /* the header first, then the length: a store only grows, so a length
   * read after the header is never smaller than the header says */
  struct tally__header h;
  memset(&h, 0, sizeof h);
  ssize_t got = pread(fd, &h, sizeof h, 0);
  struct stat st;
  if (fstat(fd, &st) != 0) return tally__fail_sys("cannot stat", path);
  if (!S_ISREG(st.st_mode))
    return tally__fail(TALLY_ENOTSTORE, "%s: not a tally store (not a "
                       "regular file)", path);
  if (got < 0) return tally__fail_sys("cannot read", path);
  if (st.st_size == 0)
    return tally__fail(TALLY_ENOTSTORE, "%s: not a tally store (empty file)",
                       path);
  if (got < 8 || memcmp(h.magic, TALLY__MAGIC, 8) != 0)
    return tally__fail(TALLY_ENOTSTORE, "%s: not a tally store (bad magic)",
                       path);
  if ((size_t)got < sizeof h)
    return tally__fail(TALLY_ECORRUPT, "%s: tally store is truncated "
                       "(%lld bytes)", path, (long long)st.st_size);
  if ((uint64_t)st.st_size < TALLY__ARENA_OFF)
    return tally__fail(TALLY_ECORRUPT, "%s: tally store is truncated (header "
                       "says %llu bytes, file has %lld)", path,
                       (unsigned long long)atomic_load(&h.size), (long long)st.st_size);
  rc = header_validate(&h, (uint64_t)st.st_size, path);
  if (rc) return rc;
  void *p = mmap(NULL, TALLY__MAX_BYTES, PROT_READ | PROT_WRITE,
                 MAP_SHARED | MAP_NORESERVE, fd, 0);
  if (p == MAP_FAILED) return tally__fail_sys("cannot map", path);
  s->base = p;
  s->reserved = TALLY__MAX_BYTES;
  return 0;
}

static int map_memory(tally_store *s) {
  void *p = mmap(NULL, TALLY__MAX_BYTES, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return tally__fail_sys("cannot reserve memory", NULL);
  s->base = p;
  s->reserved = TALLY__MAX_BYTES;
  header_init((struct tally__header *)p);
  atomic_store(&((struct tally__header *)p)->size, TALLY__MAX_BYTES);
  return 0;
}


int tally_store_open(const char *spec, const tally_open_options *opt,
                     tally_store **out) {
  if (!out) return tally__fail(TALLY_EINVAL, "tally_store_open: out is NULL");
  const uint32_t known = TALLY_OPEN_NOCREATE | TALLY_OPEN_TRUST;
  if (opt && (opt->flags & ~known))
    return tally__fail(TALLY_EINVAL, "tally_store_open: unknown flags 0x%x",
                       opt->flags & ~known);
  int kind;
  const char *path = NULL;
  if (!spec || !*spec || strcmp(spec, "memory") == 0) {
    kind = TALLY__MEMORY;
  } else if (strncmp(spec, "file:", 5) == 0 && spec[5]) {
    kind = TALLY__FILE;
    path = spec + 5;
  } else {
    return tally__fail(TALLY_EINVAL, "unknown store '%s' (expected 'memory' "
                       "or 'file:PATH')", spec);
  }
  tally__policy_init();
  tally_store *s = calloc(1, sizeof *s);
  if (!s) return tally__fail(TALLY_ENOMEM, "out of memory");
  s->kind = kind;
  s->fd = -1;
  s->id = atomic_fetch_add(&next_store_id, 1);
  pthread_mutex_init(&s->lock, NULL);
  int rc;
  if (kind == TALLY__FILE) {
    s->path = strdup(path);
    rc = s->path ? map_file(s, path, opt) : tally__fail(TALLY_ENOMEM, "out of memory");
  } else {
    rc = map_memory(s);
  }
  if (rc == 0) {
    s->hdr = (struct tally__header *)s->base;
    s->classes = (struct tally__class *)(s->base + TALLY__CLASS_OFF);
    s->journal = (_Atomic int64_t *)(s->base + TALLY__JOURNAL_OFF);
    if ((rc = tally__lock(s)) == 0) {
      if (atomic_load(&s->hdr->index) == 0) /* new store: make its index */
        rc = tally__index_create(s);
      else /* the lock finished a move a dead process left; a damaged one fails */
        rc = tally__finish_move(s);
      tally__unlock(s);
    }
    if (rc == 0) rc = tally__index_check(s, NULL); /* header only: O(1) */
    if (rc == 0) rc = tally__classes_check(s);
    if (rc == 0) rc = tally__family_check(s);
    if (rc == 0) rc = tally__rollup_table_check(s);
  }
  if (rc) {
    tally_store_close(s);
    return rc;
  }
  registry_add(s);
  *out = s;
  return 0;
}

void tally_store_close(tally_store *s) {
  if (!s) return;
  registry_remove(s);
  if (s->base) munmap(s->base, s->reserved);
  if (s->fd >= 0) close(s->fd);
  pthread_mutex_destroy(&s->lock);
  free(s->path);
  free(s);
}

int tally_store_sync(tally_store *s) {
  if (!s) return tally__fail(TALLY_EINVAL, "tally_store_sync: store is NULL");
  if (s->kind != TALLY__FILE) return 0;
  uint64_t used = atomic_load(&s->hdr->used);
  if (msync(s->base, used, MS_SYNC) != 0) return tally__fail_sys("msync", s->path);
  if (fsync(s->fd) != 0) return tally__fail_sys("fsync", s->path);
  return 0;
}

const char *tally_store_kind(const tally_store *s) {
  return s && s->kind == TALLY__FILE ? "file" : "memory";
}

/* A file store whose file is now shorter than its header says (another
 * program truncated it): ECORRUPT, found with fstat() before any page of
 * the mapping is touched (touching one past the end raises SIGBUS). */
int tally__truncated(tally_store *s) {
  struct stat st;
  if (s->kind != TALLY__FILE) return 0;
  if (fstat(s->fd, &st) != 0) return tally__fail_sys("cannot stat", s->path);
  if ((uint64_t)st.st_size < TALLY__HEADER_BYTES) /* the header's page is gone */
    return tally__fail(TALLY_ECORRUPT, "%s: tally store is truncated (file has "
                       "%lld bytes, less than its header)", s->path,
                       (long long)st.st_size);
  uint64_t size = atomic_load(&s->hdr->size);
  if (size > (uint64_t)st.st_size)
    return tally__fail(TALLY_ECORRUPT, "%s: tally store is truncated (header "
                       "says %llu bytes, file has %llu)", s->path,
                       (unsigned long long)size, (unsigned long long)st.st_size);
  return 0;
}

int tally_store_check(tally_store *s) {
  if (!s) return tally__fail(TALLY_EINVAL, "tally_store_check: store is NULL");
  int trc = tally__truncated(s);
  if (trc) return trc;
  if (s->hdr->check != header_check(s->hdr))
    return tally__fail(TALLY_ECORRUPT, "%s: tally store is corrupt (header "
                       "checksum)", tally__store_name(s));
  int rc = tally__lock(s); /* a consistent view: no create or drop meanwhile */
  if (rc) return rc;
  uint64_t live = 0;
  rc = tally__classes_check(s);
  if (rc == 0) rc = tally__index_check(s, &live);
  if (rc == 0) rc = tally__family_check(s);
  if (rc == 0) rc = tally__rollup_table_check(s);
  tally__unlock(s);
  return rc;
}

const char *tally_store_fault_path(const void *addr) {
  const unsigned char *a = addr;
  for (tally_store *s = registry; s; s = s->next) /* no lock: see tally.h */
    if (s->kind == TALLY__FILE && s->base && a >= s->base &&
        a < s->base + s->reserved)
      return s->path;
  return NULL;
}
