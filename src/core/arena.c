/* arena.c -- the store's space: header checksum, sealed words, allocation.
 *
 * A store is one mapping: the header, the size classes, the move journal,
 * then the arena, where records, index tables, family and rollup tables and
 * cells are handed out. Fresh space comes from a bump pointer; what was
 * retired comes back through limbo and the free lists (space.c).
 * Pointers between them are sealed words (an offset plus a check keyed by
 * the store's salt and the field), so a damaged pointer is caught before it
 * is followed. A file store grows with fallocate; the mapping was made at
 * its final size at open, so nothing ever moves.
 */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#define GROW_MIN (1u << 20)
/* At most this much at a time: 12.5% of a large store is a lot of real
 * blocks reserved ahead (a million default counters: 15 MiB, on 115 MiB in
 * use), and a growth is one posix_fallocate under the lock, cheap enough
 * to make often. */
#define GROW_MAX (UINT64_C(4) << 20)

const char *tally__store_name(const tally_store *s) {
  return s->path ? s->path : "memory";
}

uint64_t tally__header_check(const struct tally__header *h) {
  return tally__hash(h, offsetof(struct tally__header, check), 0x68647221);
}

uint64_t tally__seal(const tally_store *s, int field, uint64_t off, uint64_t extra) {
  if (!off) return 0;
  uint64_t check =
      tally__mix(s->hdr->salt ^ (uint64_t)field << 56 ^ off ^ tally__mix(extra)) >> 32;
  return (off >> 3) << 32 | check;
}

int tally__unseal(const tally_store *s, int field, uint64_t word, uint64_t extra,
                  uint64_t *off) {
  uint64_t o = (word >> 32) << 3;
  if (word && tally__seal(s, field, o, extra) != word)
    return tally__fail(TALLY_ECORRUPT, "%s: tally store is corrupt (%s pointer)",
                       tally__store_name(s),
                       field == TALLY__SEAL_INDEX      ? "index"
                       : field == TALLY__SEAL_FAMILIES ? "family"
                       : field == TALLY__SEAL_MOVE     ? "move"
                       : field == TALLY__SEAL_ROLLUPS  ? "rollup table"
                       : field == TALLY__SEAL_ROLLUP   ? "rollup"
                       : field == TALLY__SEAL_FREE     ? "free list"
                       : field == TALLY__SEAL_COLUMN   ? "free column"
                       : field == TALLY__SEAL_LIMBO    ? "limbo"
                                                       : "process table");
  *off = word ? o : 0;
  return 0;
}

static int grow(tally_store *s, uint64_t need) {
  struct tally__header *h = s->hdr;
  uint64_t size = atomic_load_explicit(&h->size, memory_order_relaxed);
  uint64_t step = size / 8; /* 12.5%, at most GROW_MAX: file size stays close to use */
  uint64_t want = size + (step < GROW_MAX ? step : GROW_MAX);
  if (want < need) want = need;
  want = (want + GROW_MIN - 1) & ~(uint64_t)(GROW_MIN - 1);
  if (want > TALLY__MAX_BYTES) want = TALLY__MAX_BYTES;
  if (want < need)
    return tally__fail(TALLY_EFULL, "%s: store is full (%llu bytes)",
                       tally__store_name(s), (unsigned long long)TALLY__MAX_BYTES);
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

/* Hand out `bytes` zeroed bytes of fresh arena, aligned to `align` (a
 * power of two). Caller holds the lock. The space past `used` was never
 * handed out, so it must be zero; if it is not, `used` is damaged and
 * handing it out would overwrite live data. */
int tally__alloc_fresh(tally_store *s, uint64_t bytes, uint64_t align, uint64_t *off) {
  struct tally__header *h = s->hdr;
  uint64_t used = atomic_load_explicit(&h->used, memory_order_relaxed);
  uint64_t start = tally__round(used, align);
  bytes = tally__round(bytes, 8);
  if (bytes > TALLY__MAX_BYTES || start + bytes > TALLY__MAX_BYTES)
    return tally__fail(TALLY_EFULL, "%s: store is full", tally__store_name(s));
  if (start + bytes > atomic_load_explicit(&h->size, memory_order_relaxed)) {
    int rc = grow(s, start + bytes);
    if (rc) return rc;
  }
  const uint64_t *p = tally__at(s, start);
  for (uint64_t i = 0; i < bytes / 8; i++)
    if (p[i] != 0)
      return tally__fail(TALLY_ECORRUPT,
                         "%s: tally store is corrupt (free space at offset "
                         "%llu is not empty)",
                         tally__store_name(s), (unsigned long long)(start + i * 8));
  atomic_store_explicit(&h->used, start + bytes, memory_order_release);
  *off = start;
  return 0;
}

/* A file store whose file is now shorter than its header says (another
 * program truncated it): ECORRUPT, found with fstat() before any page of
 * the mapping is touched (touching one past the end raises SIGBUS). */
int tally__truncated(tally_store *s) {
  struct stat st;
  if (s->kind != TALLY__FILE) return 0;
  if (fstat(s->fd, &st) != 0) return tally__fail_sys("cannot stat", s->path);
  if ((uint64_t)st.st_size < TALLY__HEADER_BYTES) /* the header's page is gone */
    return tally__fail(TALLY_ECORRUPT,
                       "%s: tally store is truncated (file has "
                       "%lld bytes, less than its header)",
                       s->path, (long long)st.st_size);
  /* a growth publishes the size after the file grew: a size read after a
   * stale fstat() is looked at again against a fresh one */
  uint64_t size = atomic_load(&s->hdr->size);
  if (size > (uint64_t)st.st_size && fstat(s->fd, &st) != 0)
    return tally__fail_sys("cannot stat", s->path);
  if (size > (uint64_t)st.st_size)
    return tally__fail(TALLY_ECORRUPT,
                       "%s: tally store is truncated (header "
                       "says %llu bytes, file has %llu)",
                       s->path, (unsigned long long)size, (unsigned long long)st.st_size);
  return 0;
}
