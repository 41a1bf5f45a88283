/* store.c -- opening, validating, closing and syncing a store.
 *
 * Both kinds of store are one mapping of TALLY__MAX_BYTES of address space
 * made once at open: anonymous memory for "memory", the file itself for
 * "file". A shared file mapping may be longer than the file; pages become
 * usable as the file grows, in every process, with no remap. So pointers
 * into a store never move, and growth is just fallocate + a new `size`
 * (arena.c).
 *
 * A new file is written in full under a temporary name and link()ed into
 * place, so no process ever sees a half-written header. Opening refuses
 * what another user could have planted (a symlink, a file of another uid)
 * unless the caller trusts the path.
 */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static _Atomic uint64_t next_store_id = 1;

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
  h->check = tally__header_check(h);
  atomic_store(&h->size, TALLY__ARENA_OFF);
  atomic_store(&h->used, TALLY__ARENA_OFF);
  atomic_store(&h->tombstone, TALLY__SENTINEL);
}

/* Checks of the header as read from disk, before anything is mapped. */
static int header_validate(const struct tally__header *h, uint64_t file_size,
                           const char *path) {
  if (memcmp(h->magic, TALLY__MAGIC, 8) != 0)
    return tally__fail(TALLY_ENOTSTORE, "%s: not a tally store (bad magic)", path);
  if (h->format < TALLY__FORMAT_FLOCK || h->format > TALLY__FORMAT)
    return tally__fail(TALLY_EVERSION,
                       "%s: unsupported tally store format %u (this is %u)", path,
                       h->format, TALLY__FORMAT);
  if (h->header_bytes != TALLY__HEADER_BYTES || h->cell_bytes != 8 ||
      h->row_cells != TALLY__ROW_CELLS || h->max_shards != TALLY_MAX_SHARDS ||
      h->byte_order != TALLY__BYTE_ORDER || h->max_bytes != TALLY__MAX_BYTES ||
      h->arena_off != TALLY__ARENA_OFF)
    return tally__fail(TALLY_EVERSION,
                       "%s: tally store has another layout (built for "
                       "another version or machine)",
                       path);
  if (h->check != tally__header_check(h))
    return tally__fail(TALLY_ECORRUPT, "%s: tally store is corrupt (header checksum)",
                       path);
  uint64_t size = atomic_load(&h->size), used = atomic_load(&h->used);
  if (size > file_size)
    return tally__fail(TALLY_ECORRUPT,
                       "%s: tally store is truncated (header says %llu bytes, "
                       "file has %llu)",
                       path, (unsigned long long)size, (unsigned long long)file_size);
  if (used < TALLY__ARENA_OFF || used > size || size > TALLY__MAX_BYTES || used % 8 != 0)
    return tally__fail(TALLY_ECORRUPT, "%s: tally store is corrupt (bad size fields)",
                       path);
  if (atomic_load(&h->pend_done) > TALLY_MAX_SHARDS)
    return tally__fail(TALLY_ECORRUPT, "%s: tally store is corrupt (bad pending move)",
                       path);
  return 0;
}

/* Write a fresh store to a temporary file and link it into place. If
 * another process won the race, use its file. */
static int create_file(const char *path, mode_t mode) {
  size_t n = strlen(path) + 16;
  char *tmp = malloc(n);
  if (!tmp) return tally__fail(TALLY_ENOMEM, "out of memory");
  snprintf(tmp, n, "%s.tmp.XXXXXX", path); /* unique even after a crash */
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
  if (fchmod(fd, mode & 0777) != 0 ||
      pwrite(fd, page, sizeof page, 0) != (ssize_t)sizeof page || fsync(fd) != 0)
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
      return tally__fail(TALLY_EUNTRUSTED,
                         "%s: refusing to open a symbolic "
                         "link as a store (open its target, or trust the "
                         "path: TALLY_OPEN_TRUST, Lua { trust = true })",
                         path);
  }
  if (fd < 0) return errno; /* positive: the caller decides */
  struct stat st;
  if (!trust && fstat(fd, &st) == 0 && st.st_uid != geteuid()) {
    close(fd);
    return tally__fail(TALLY_EUNTRUSTED,
                       "%s: refusing a store owned by "
                       "another user (uid %lu, this process runs as %lu; trust "
                       "the path: TALLY_OPEN_TRUST, Lua { trust = true })",
                       path, (unsigned long)st.st_uid, (unsigned long)geteuid());
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
    return tally__fail(TALLY_ENOTSTORE,
                       "%s: not a tally store (not a "
                       "regular file)",
                       path);
  if (got < 0) return tally__fail_sys("cannot read", path);
  if (st.st_size == 0)
    return tally__fail(TALLY_ENOTSTORE, "%s: not a tally store (empty file)", path);
  if (got < 8 || memcmp(h.magic, TALLY__MAGIC, 8) != 0)
    return tally__fail(TALLY_ENOTSTORE, "%s: not a tally store (bad magic)", path);
  if ((size_t)got < sizeof h)
    return tally__fail(TALLY_ECORRUPT,
                       "%s: tally store is truncated "
                       "(%lld bytes)",
                       path, (long long)st.st_size);
  if ((uint64_t)st.st_size < TALLY__ARENA_OFF)
    return tally__fail(TALLY_ECORRUPT,
                       "%s: tally store is truncated (header "
                       "says %llu bytes, file has %lld)",
                       path, (unsigned long long)atomic_load(&h.size),
                       (long long)st.st_size);
  rc = header_validate(&h, (uint64_t)st.st_size, path);
  if (rc) return rc;
  s->lock_word = h.format != TALLY__FORMAT_FLOCK;
  if (s->lock_word && (rc = tally__lock_attach(s))) return rc; /* before any lock */
  void *p = mmap(NULL, TALLY__MAX_BYTES, PROT_READ | PROT_WRITE,
                 MAP_SHARED | MAP_NORESERVE, fd, 0);
  if (p == MAP_FAILED) return tally__fail_sys("cannot map", path);
  s->base = p;
  s->reserved = TALLY__MAX_BYTES;
  return 0;
}

#define HUGE_FROM (UINT64_C(2) << 20)

static int map_memory(tally_store *s) {
  void *p = mmap(NULL, TALLY__MAX_BYTES, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return tally__fail_sys("cannot reserve memory", NULL);
  /* Past its first 2 MiB (a small store stays small), the arena asks for
   * transparent huge pages: a million cold counters' cells lie on ~2,000
   * 4 KiB pages among their records, and random increments pay for page
   * walks that a plain array of the same cells does not (scripts/bench:
   * 15.4 ns a random increment by index, 14.3 on huge pages, where the
   * array gains nothing). A kernel with THP off ignores it. */
  (void)madvise((char *)p + HUGE_FROM, TALLY__MAX_BYTES - HUGE_FROM, MADV_HUGEPAGE);
  s->base = p;
  s->reserved = TALLY__MAX_BYTES;
  header_init((struct tally__header *)p);
  atomic_store(&((struct tally__header *)p)->size, TALLY__MAX_BYTES);
  return 0;
}

/* 1 if path names another file than the one open now: a compaction
 * (compact.c) renamed a new store over it. Checked under the lock after
 * this process took its slot, since a compaction holds the lock from its
 * look at the slots to its rename: either it sees this process, or this
 * process sees the rename. */
static int replaced(tally_store *s) {
  struct stat now, mine;
  int rc = tally__lock(s);
  if (rc) return rc;
  bool moved = stat(s->path, &now) == 0 && fstat(s->fd, &mine) == 0 &&
               (now.st_ino != mine.st_ino || now.st_dev != mine.st_dev);
  tally__unlock(s);
  return moved;
}

static int open_once(const char *spec, const tally_open_options *opt, tally_store **out) {
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
    char shown[256]; /* never echo credentials: a URI's userinfo and query */
    tally__spec_redact(shown, sizeof shown, spec, strlen(spec));
    return tally__fail(TALLY_EINVAL,
                       "unknown store '%s' (expected 'memory' or 'file:PATH')", shown);
  }
  tally__policy_init();
  tally_store *s = calloc(1, sizeof *s);
  if (!s) return tally__fail(TALLY_ENOMEM, "out of memory");
  s->kind = kind;
  s->fd = -1;
  s->id = atomic_fetch_add(&next_store_id, 1);
  pthread_mutex_init(&s->lock, NULL);
  pthread_mutex_init(&s->hlock, NULL);
  int rc;
  if (kind == TALLY__FILE) {
    s->path = strdup(path);
    rc = s->path ? map_file(s, path, opt) : tally__fail(TALLY_ENOMEM, "out of memory");
  } else {
    rc = map_memory(s);
  }
  if (rc == 0) {
    s->hdr = (struct tally__header *)s->base;
    s->small = s->hdr->format > TALLY__FORMAT_SMALL16 ? 8 : 16;
    s->classes = (struct tally__class *)(s->base + TALLY__CLASS_OFF);
    s->journal = (_Atomic int64_t *)(s->base + TALLY__JOURNAL_OFF);
    if ((rc = tally__lock(s)) == 0) {
      if (atomic_load(&s->hdr->index) == 0) /* new store: its index, process table */
        rc = tally__index_create(s, 0);
      else /* the lock finished a move a dead process left; a damaged one fails */
        rc = tally__journal_finish(s);
      if (rc == 0 && atomic_load(&s->hdr->procs) == 0) rc = tally__grace_table_create(s);
      /* under the lock: a holder changing a free list mid-check is no damage */
      if (rc == 0) rc = tally__space_open_check(s);
      tally__unlock(s);
    }
    if (rc == 0) rc = tally__index_check(s); /* header only: O(1) */
    if (rc == 0) rc = tally__classes_check(s);
    if (rc == 0) rc = tally__family_check(s);
    if (rc == 0) rc = tally__rollup_table_check(s);
    if (rc == 0) rc = tally__grace_open(s); /* after: it trusts the table word */
    if (rc == 0 && kind == TALLY__FILE) rc = replaced(s); /* 1: open it again */
  }
  if (rc) {
    tally_store_close(s);
    return rc;
  }
  tally__registry_add(s);
  *out = s;
  return 0;
}

int tally_store_open(const char *spec, const tally_open_options *opt, tally_store **out) {
  for (int tries = 0;; tries++) {
    int rc = open_once(spec, opt, out);
    if (rc != 1) return rc;
    if (tries == 8)
      return tally__fail(TALLY_EBUSY,
                         "%s: the store was replaced again and again while "
                         "it was opened",
                         spec + 5);
  }
}

void tally_store_close(tally_store *s) {
  if (!s) return;
  tally__registry_remove(s);
  if (s->hdr) tally__slots_release(s);
  if (s->hdr) tally__grace_close(s);
  tally__handles_free(s);
  if (s->base) munmap(s->base, s->reserved);
  if (s->fd >= 0) close(s->fd);
  pthread_mutex_destroy(&s->lock);
  pthread_mutex_destroy(&s->hlock);
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
