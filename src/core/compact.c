/* compact.c -- offline compaction: a file store rewritten without its
 * retired and free space.
 *
 * Space a store retires (space.c) is reused by later allocations of the
 * same size, but never given back to the file system. Compaction writes
 * the store again, next to it (PATH.compact.XXXXXX): an index sized for
 * the live counters, the process table, the families, the flushers that
 * ship from it, the rollup table's schedule slots, then each live counter
 * in index order: its record (same name, policy, incarnation, family, idle
 * and shipped marks), its cells (every shard's value, not just the sum)
 * and its rollup block (record and rings, slot for slot). The new file is checked, synced and renamed over the old one
 * with the old one's mode and owner. A compaction killed midway leaves
 * its PATH.compact.XXXXXX behind; the next one removes such files, once
 * it holds the lock and no other process has the store open (every
 * compaction keeps the store open while its file exists).
 *
 * It is offline: it refuses (TALLY_EBUSY) while another live process has
 * the store open, and holds the store lock from that check to the rename,
 * so a process that opens the store meanwhile waits, finds the path
 * renamed under it, and opens the new file (store.c). The lock also means
 * nothing moves while the counters are copied.
 *
 * Two things cannot carry over exactly: the header's generation restarts
 * (it only tells processes that the name index changed), and a rollup
 * period that a dead process left half done is closed as it stands (its
 * resume point is a cell offset, which compaction changes): counters it
 * had not reached miss that one period, and none is rolled twice.
 */
#include "internal.h"

#include <ctype.h>
#include <dirent.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

struct job {
  tally_store *from, *to;
  uint64_t *recs; /* live records of `from`, in index order */
  size_t n, cap;
  uint32_t *fam;      /* pattern hashes of the families of `to`, sorted */
  uint64_t *fam_live; /* ... and their live counters */
  size_t nfam;
};

/* ---- the new file's layout ------------------------------------------------- */

/* `to` is a store just created: its arena holds a minimal index and the
 * process table. Lay it out again with an index that holds every name
 * without growing (growth would retire the smaller tables). Caller holds
 * to's lock; no other process knows the file. */
static int lay_out(tally_store *to, uint64_t names) {
  struct tally__header *h = to->hdr;
  if (atomic_load(&h->families) || atomic_load(&h->rollups) ||
      atomic_load(&h->limbo_head) || atomic_load(&h->generation))
    return tally__fail(TALLY_EBUSY, "%s: the temporary store is in use",
                       tally__store_name(to));
  uint64_t used = atomic_load(&h->used);
  memset(to->base + TALLY__ARENA_OFF, 0, used - TALLY__ARENA_OFF);
  atomic_store(&h->used, TALLY__ARENA_OFF);
  atomic_store(&h->index, 0);
  atomic_store(&h->procs, 0);
  atomic_store(&h->wslots, 0);
  int rc = tally__index_create(to, names);
  return rc ? rc : tally__grace_table_create(to);
}

/* ---- families -------------------------------------------------------------- */

struct fam_ref {
  uint32_t hash, age; /* age: 0 for the newest record */
  const struct tally__family *f;
};

static int by_hash_age(const void *pa, const void *pb) {
  const struct fam_ref *a = pa, *b = pb;
  if (a->hash != b->hash) return a->hash < b->hash ? -1 : 1;
  return a->age < b->age ? -1 : a->age > b->age;
}

static int by_age(const void *pa, const void *pb) {
  const struct fam_ref *a = pa, *b = pb;
  return a->age < b->age ? 1 : a->age > b->age ? -1 : 0; /* oldest first */
}

static int by_u32(const void *pa, const void *pb) {
  uint32_t a = *(const uint32_t *)pa, b = *(const uint32_t *)pb;
  return a < b ? -1 : a > b;
}

/* Define from's families on `to`, oldest first, so that the newest still
 * wins; a record shadowed by a newer one of the same pattern is left out
 * (it never matched first). Then j->fam lists their pattern hashes, for
 * the live counts. `to` must not be locked (tally_family_define locks). */
static int copy_families(struct job *j) {
  tally_store *from = j->from;
  uint64_t off;
  int rc = tally__unseal(from, TALLY__SEAL_FAMILIES, atomic_load(&from->hdr->families), 0,
                         &off);
  struct fam_ref *v = NULL;
  size_t n = 0, cap = 0;
  for (; rc == 0 && off; n++) { /* tally_store_check saw the list is sound */
    const struct tally__family *f = tally__at(from, off);
    if (n == cap) {
      cap = cap ? cap * 2 : 16;
      struct fam_ref *nv = realloc(v, cap * sizeof *nv);
      if (!nv) {
        rc = tally__fail(TALLY_ENOMEM, "out of memory");
        break;
      }
      v = nv;
    }
    v[n] =
        (struct fam_ref){tally__pattern_hash(f->pattern, f->pattern_len), (uint32_t)n, f};
    off = f->next;
  }
  size_t keep = 0;
  if (rc == 0 && n) { /* drop the records a newer one of the same pattern shadows */
    qsort(v, n, sizeof *v, by_hash_age);
    for (size_t i = 0; i < n; i++) {
      bool shadowed = false;
      for (size_t k = keep; k-- > 0 && v[k].hash == v[i].hash;)
        if (v[k].f->pattern_len == v[i].f->pattern_len &&
            memcmp(v[k].f->pattern, v[i].f->pattern, v[i].f->pattern_len) == 0)
          shadowed = true;
      if (!shadowed) v[keep++] = v[i];
    }
    qsort(v, keep, sizeof *v, by_age);
  }
  if (rc == 0 && keep) {
    j->fam = malloc(keep * sizeof *j->fam);
    j->fam_live = calloc(keep, sizeof *j->fam_live);
    if (!j->fam || !j->fam_live) rc = tally__fail(TALLY_ENOMEM, "out of memory");
  }
  for (size_t i = 0; rc == 0 && i < keep; i++) {
    const struct tally__family *f = v[i].f;
    tally_family_options o = {f->shards, f->policy == 0xFF ? -1 : (int32_t)f->policy,
                              f->idle_s, f->max_counters};
    rc = tally_family_define(j->to, f->pattern, f->pattern_len, &o);
    j->fam[i] = v[i].hash;
  }
  if (rc == 0 && keep) { /* distinct hashes, for a binary search per counter */
    qsort(j->fam, keep, sizeof *j->fam, by_u32);
    size_t d = 0;
    for (size_t i = 0; i < keep; i++)
      if (d == 0 || j->fam[d - 1] != j->fam[i]) j->fam[d++] = j->fam[i];
    j->nfam = d;
  }
  free(v);
  return rc;
}

/* Count a counter created under family hash h (0: none). */
static void count_family(struct job *j, uint32_t h) {
  size_t lo = 0, hi = j->nfam;
  while (h && lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (j->fam[mid] == h) {
      j->fam_live[mid]++;
      return;
    }
    if (j->fam[mid] < h)
      lo = mid + 1;
    else
      hi = mid;
  }
}

/* Each family's live count, as tally_family_define would recount it: on
 * the newest record of its pattern hash. Caller holds to's lock. */
static void set_family_live(struct job *j) {
  for (size_t i = 0; i < j->nfam; i++) {
    struct tally__family *f = tally__family_by_hash(j->to, j->fam[i]);
    if (f) atomic_store(&f->live, j->fam_live[i]);
  }
}

/* ---- schedules and rollup blocks --------------------------------------------- */

/* The rollup table's slots: identities, periods done. No process has the
 * store open, so no lease is held; a period left running by a dead holder
 * is closed (see the top of the file). */
static int copy_schedules(tally_store *from, tally_store *to) {
  struct tally__rollup_table *ot, *nt;
  int rc = tally__table_of(from, false, &ot);
  if (rc || !ot) return rc;
  if ((rc = tally__table_of(to, true, &nt))) return rc;
  for (int i = 0; i < TALLY__SCHED_SLOTS; i++) {
    const struct tally__sched_slot *o = &ot->slot[i];
    struct tally__sched_slot *w = &nt->slot[i];
    int64_t done = atomic_load(&o->done), running = atomic_load(&o->running);
    atomic_store(&w->every_ms, atomic_load(&o->every_ms));
    atomic_store(&w->done, running > done ? running : done);
    atomic_store(&w->id, atomic_load(&o->id));
  }
  return 0;
}

/* Give the counter at `off` of `to` a block like from's block of rec_off:
 * same rings, record and every slot. */
static int copy_block(tally_store *from, uint64_t rec_off, tally_store *to,
                      uint64_t off) {
  struct tally__block *ob, *nb;
  int rc = tally__block_of(from, rec_off, &ob);
  if (rc || !ob) return rc;
  tally_ring rings[TALLY_RINGS_MAX];
  for (uint32_t i = 0; i < ob->nrings; i++)
    rings[i] = (tally_ring){ob->ring[i].res_s, ob->ring[i].len};
  rc = tally__block_grow(to, off, NULL, rings, ob->nrings);
  if (rc == 0) rc = tally__block_of(to, off, &nb);
  if (rc) return rc;
  atomic_store(&nb->value, atomic_load(&ob->value));
  atomic_store(&nb->at_ms, atomic_load(&ob->at_ms));
  atomic_store(&nb->delta, atomic_load(&ob->delta));
  atomic_store(&nb->prev_at_ms, atomic_load(&ob->prev_at_ms));
  atomic_store(&nb->count, atomic_load(&ob->count));
  _Atomic int64_t *from_slot = tally__slots_at(ob);
  for (uint32_t i = 0; i < ob->nrings; i++) { /* rings may be in another order */
    _Atomic int64_t *to_slot = tally__slots_at(nb);
    uint32_t k = 0;
    while (k < nb->nrings && nb->ring[k].res_s != ob->ring[i].res_s)
      to_slot += nb->ring[k++].len;
    if (k == nb->nrings || nb->ring[k].len != ob->ring[i].len)
      return tally__fail(TALLY_ECORRUPT, "%s: rollup rings of counter '%s' differ",
                         tally__store_name(to),
                         ((struct tally__rec *)tally__at(from, rec_off))->name);
    atomic_store(&nb->ring[k].head, atomic_load(&ob->ring[i].head));
    for (uint32_t b = 0; b < ob->ring[i].len; b++)
      atomic_store_explicit(&to_slot[b],
                            atomic_load_explicit(&from_slot[b], memory_order_relaxed),
                            memory_order_relaxed);
    from_slot += ob->ring[i].len;
  }
  return 0;
}

/* ---- counters ------------------------------------------------------------------ */

static int collect(tally_store *s, uint64_t rec_off, void *ud) {
  struct job *j = ud;
  const struct tally__rec *r = tally__at(s, rec_off);
  if (atomic_load(&r->loc) & TALLY__LOC_DROPPED) return 0;
  if (j->n == j->cap) {
    size_t cap = j->cap ? j->cap * 2 : 1024;
    uint64_t *v = realloc(j->recs, cap * sizeof *v);
    if (!v) return tally__fail(TALLY_ENOMEM, "out of memory");
    j->recs = v;
    j->cap = cap;
  }
  j->recs[j->n++] = rec_off;
  return 0;
}

/* Copy from's counter at rec_off into `to`. Both locks are held, and no
 * other process has `from` open: no cell moves meanwhile. */
static int copy_counter(struct job *j, uint64_t rec_off) {
  tally_store *from = j->from, *to = j->to;
  const struct tally__rec *r = tally__at(from, rec_off);
  uint64_t loc = atomic_load_explicit(&r->loc, memory_order_acquire), cells, off;
  uint32_t n;
  bool dropped;
  int rc = tally__loc_decode(from, rec_off, loc, &cells, &n, &dropped);
  if (rc || dropped) return rc;
  int64_t v[TALLY_MAX_SHARDS];
  for (uint32_t i = 0; i < n; i++) {
    _Atomic int64_t *cell = tally__cell_at(from, loc, i);
    int64_t x = atomic_load_explicit(cell, memory_order_acquire);
    if ((rc = tally__cell_wait(from, cell, rec_off, i, &x))) return rc; /* damaged */
    if (tally__cell_retired(x)) /* under the lock no move is pending */
      return tally__fail(TALLY_ECORRUPT,
                         "%s: tally store is corrupt (counter '%s' has retired "
                         "cells and no move)",
                         tally__store_name(from), r->name);
    v[i] = x;
  }
  if ((rc = tally__cells_alloc(to, n, &cells))) return rc;
  if ((rc = tally__alloc_small(to, tally__rec_bytes(r->name_len), &off))) return rc;
  struct tally__rec *w = tally__at(to, off);
  w->policy = r->policy;
  w->name_len = r->name_len;
  w->incarnation = r->incarnation;
  w->family = r->family;
  memcpy(w->name, r->name, r->name_len); /* the NUL: fresh space is zero */
  atomic_store(&w->idle_value, atomic_load(&r->idle_value));
  atomic_store(&w->idle_since, atomic_load(&r->idle_since));
  atomic_store(&w->shipped, atomic_load(&r->shipped));
  atomic_store(&w->flags,
               atomic_load(&r->flags) & ~(TALLY__REC_EXPIRED | TALLY__REC_LIMBO));
  atomic_store(&w->contention, atomic_load(&r->contention));
  w->check = tally__rec_checksum(w);
  uint64_t wloc = tally__loc_make(to, off, cells, n, false);
  for (uint32_t i = 0; i < n; i++)
    atomic_store_explicit(tally__cell_at(to, wloc, i), v[i], memory_order_relaxed);
  atomic_store_explicit(&w->loc, wloc, memory_order_release);
  rc = tally__index_insert(to, tally__hash(r->name, r->name_len, 0), off);
  if (rc == 0) rc = copy_block(from, rec_off, to, off);
  if (rc == 0) count_family(j, r->family);
  return rc;
}

/* Which flushers ship what: without it, counters not yet flushed expire. */
static void copy_shippers(tally_store *from, tally_store *to) {
  const struct tally__header *f = from->hdr;
  struct tally__header *t = to->hdr;
  for (int i = 0; i < TALLY__SHIPPERS; i++) {
    t->shippers[i].writer = f->shippers[i].writer;
    t->shippers[i].pattern_len = f->shippers[i].pattern_len;
    memcpy(t->shippers[i].pattern, f->shippers[i].pattern, TALLY__SHIP_PATTERN_MAX);
    atomic_store(&t->shippers[i].id, atomic_load(&f->shippers[i].id));
  }
  atomic_store(&t->ship_all, atomic_load(&f->ship_all));
  atomic_store(&t->autos, atomic_load(&f->autos));
}

static int copy_counters(struct job *j, tally_progress_fn progress, void *ud) {
  uint64_t total = j->n, pct = 0;
  int rc = copy_schedules(j->from, j->to);
  if (rc == 0) rc = tally__slots_copy(j->from, j->to);
  copy_shippers(j->from, j->to);
  if (progress) progress(ud, 0, total);
  for (size_t i = 0; rc == 0 && i < j->n; i++) {
    rc = copy_counter(j, j->recs[i]);
    if (rc == 0 && progress && (i + 1) * 100 / total != pct) { /* each 1% */
      pct = (i + 1) * 100 / total;
      progress(ud, i + 1, total);
    }
  }
  if (rc) return rc;
  set_family_live(j);
  struct tally__header *o = j->from->hdr, *h = j->to->hdr;
  atomic_store(&h->writers, atomic_load(&o->writers)); /* thread tickets go on */
  atomic_store(&h->expired, atomic_load(&o->expired));
  atomic_store(&h->capped, atomic_load(&o->capped));
  return 0;
}

/* ---- files ------------------------------------------------------------------------ */

/* Which file to replace: path, or what it links to (only with
 * TALLY_OPEN_TRUST does a symlink open at all). *out is malloc'd. */
static int target_of(const char *path, char **out) {
  struct stat st;
  if (lstat(path, &st) == 0 && S_ISLNK(st.st_mode)) {
    char *real = realpath(path, NULL);
    if (!real) return tally__fail_sys("cannot resolve", path);
    *out = real;
    return 0;
  }
  if (!(*out = strdup(path))) return tally__fail(TALLY_ENOMEM, "out of memory");
  return 0;
}

/* "file:" + a free name beside target, into a malloc'd string. */
static int temp_spec(const char *target, char **out) {
  size_t n = strlen(target) + 32;
  char *spec = malloc(n);
  if (!spec) return tally__fail(TALLY_ENOMEM, "out of memory");
  snprintf(spec, n, "file:%s.compact.XXXXXX", target);
  int fd = mkostemp(spec + 5, O_CLOEXEC); /* reserves a unique name */
  if (fd < 0) {
    int rc = tally__fail_sys("cannot create a file beside", target);
    free(spec);
    return rc;
  }
  close(fd);
  unlink(spec + 5); /* tally_store_open creates it whole, or not at all */
  *out = spec;
  return 0;
}

/* Remove what compactions killed midway left beside target: regular files
 * named as temp_spec names them, but ours (tmp). Best effort. */
static void sweep_leftovers(const char *target, const char *tmp) {
  char *dir_copy = strdup(target), *base_copy = strdup(target);
  DIR *d = dir_copy && base_copy ? opendir(dirname(dir_copy)) : NULL;
  if (d) {
    const char *base = basename(base_copy), *ours = strrchr(tmp, '/');
    size_t blen = strlen(base), plen = strlen(".compact.");
    ours = ours ? ours + 1 : tmp;
    struct dirent *e;
    while ((e = readdir(d))) {
      const char *n = e->d_name;
      struct stat st;
      bool named = strlen(n) == blen + plen + 6 && strncmp(n, base, blen) == 0 &&
                   strncmp(n + blen, ".compact.", plen) == 0 && strcmp(n, ours) != 0;
      for (size_t i = blen + plen; named && n[i]; i++)
        named = isalnum((unsigned char)n[i]);
      if (named && fstatat(dirfd(d), n, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
          S_ISREG(st.st_mode))
        (void)unlinkat(dirfd(d), n, 0);
    }
    closedir(d);
  }
  free(dir_copy);
  free(base_copy);
}

/* The new file gets the old one's owner (where this process may give it)
 * and mode. */
static int same_owner(tally_store *from, tally_store *to) {
  struct stat o, n;
  if (fstat(from->fd, &o) != 0 || fstat(to->fd, &n) != 0)
    return tally__fail_sys("cannot stat", to->path);
  if ((o.st_uid != n.st_uid || o.st_gid != n.st_gid) &&
      fchown(to->fd, o.st_uid, o.st_gid) != 0)
    return tally__fail_sys("cannot give the compacted store the owner of", from->path);
  if (fchmod(to->fd, o.st_mode & 0777) != 0)
    return tally__fail_sys("cannot chmod", to->path);
  return 0;
}

static void sync_dir(const char *target) {
  char *copy = strdup(target);
  if (!copy) return;
  int fd = open(dirname(copy), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    (void)fsync(fd); /* the rename, durable; best effort */
    close(fd);
  }
  free(copy);
}

/* Build the new store j->to (open) from j->from (locked). */
static int rewrite(struct job *j, tally_progress_fn progress, void *ud) {
  int rc = same_owner(j->from, j->to);
  if (rc == 0 && (rc = tally__lock(j->to)) == 0) {
    rc = lay_out(j->to, j->n);
    tally__unlock(j->to);
  }
  if (rc == 0) rc = copy_families(j);
  if (rc == 0 && (rc = tally__lock(j->to)) == 0) {
    rc = copy_counters(j, progress, ud);
    tally__unlock(j->to);
  }
  if (rc == 0) rc = tally_store_check(j->to);
  if (rc == 0) rc = tally_store_sync(j->to);
  return rc;
}

int tally_store_compact(const char *path, uint32_t flags, tally_progress_fn progress,
                        void *ud) {
  const uint32_t known = TALLY_OPEN_NOCREATE | TALLY_OPEN_TRUST;
  if (!path || !*path) return tally__fail(TALLY_EINVAL, "tally_store_compact: no path");
  if (flags & ~known)
    return tally__fail(TALLY_EINVAL, "tally_store_compact: unknown flags 0x%x",
                       flags & ~known);
  size_t n = strlen(path) + 6;
  char *spec = malloc(n), *target = NULL, *tmp = NULL;
  if (!spec) return tally__fail(TALLY_ENOMEM, "out of memory");
  snprintf(spec, n, "file:%s", path);
  struct job j = {0};
  tally_open_options o = {0, flags | TALLY_OPEN_NOCREATE};
  int rc = tally_store_open(spec, &o, &j.from);
  if (rc == 0) rc = tally_store_check(j.from); /* never rewrite what is damaged */
  if (rc == 0) rc = target_of(path, &target);
  if (rc == 0) rc = temp_spec(target, &tmp);
  /* the new store is opened and closed outside the old one's lock: an open
   * and a close take the registry's lock, which fork() takes before every
   * store's (lock.c) */
  tally_open_options to = {0600, 0};
  if (rc == 0) rc = tally_store_open(tmp, &to, &j.to);
  if (rc == 0 && (rc = tally__lock(j.from)) == 0) { /* until the rename */
    int64_t pid = 0;
    rc = tally__grace_others(j.from, &pid);
    if (rc == 1 && pid == (int64_t)getpid())
      rc = tally__fail(TALLY_EBUSY,
                       "%s: store is in use by this process (pid %lld), through "
                       "another handle (compaction needs it closed everywhere)",
                       path, (long long)pid);
    else if (rc == 1)
      rc = tally__fail(TALLY_EBUSY,
                       "%s: store is in use by process %lld (compaction needs it "
                       "closed everywhere)",
                       path, (long long)pid);
    /* nobody else has it open: a batch left half done was a dead writer's,
     * and another compaction's file a dead compaction's */
    if (rc == 0) sweep_leftovers(target, tmp + 5);
    if (rc == 0) rc = tally__slots_recover(j.from);
    if (rc == 0) rc = tally__index_each(j.from, collect, &j);
    if (rc == 0) rc = rewrite(&j, progress, ud);
    if (rc == 0 && rename(tmp + 5, target) != 0)
      rc = tally__fail_sys("cannot rename over", target);
    if (rc == 0) sync_dir(target);
    tally__unlock(j.from);
  }
  tally_store_close(j.to);
  if (rc && tmp) unlink(tmp + 5);
  tally_store_close(j.from);
  free(j.recs);
  free(j.fam);
  free(j.fam_live);
  free(spec);
  free(target);
  free(tmp);
  return rc;
}
