/* index.c -- finding a counter record by name.
 *
 * An open-addressed hash table of 64-bit entries lives in the arena:
 *   bits 0..31 record offset >> 3, bits 32..55 a check keyed by the store's
 *   salt, bits 56..63 a tag (hash >> 56)
 * 0 is an empty slot, DELETED a dropped one; a name's probe starts at slot
 * (hash >> 32) & (cap - 1) and goes on linearly. Every entry is checked
 * when it is read, so a damaged one is ECORRUPT, not a counter that seems
 * absent. Readers never lock: they load the sealed table offset from the
 * header and the entries with acquire loads; an entry is stored only after
 * its record is complete. Writers hold the store lock. When live + deleted
 * entries pass half the capacity, a new table is built beside the old one
 * (rehashing the names) and published with one store to the header; a
 * reader still probing the old table can at worst miss a counter created
 * at that instant, and creation re-checks under the lock, so no name is
 * ever created twice. Old tables are retired (space.c) and reused after
 * the grace period.
 */
#include "internal.h"

#include <string.h>

#define MIN_CAP 1024u
#define EMPTY   0ull
#define DELETED 0xffffffff00000000ull /* no single bit flip makes it valid */

static uint64_t entry_make(const tally_store *s, uint64_t hash, uint64_t off) {
  uint64_t tag = hash >> 56, o = off >> 3;
  uint64_t check = tally__mix(s->hdr->salt ^ tag << 32 ^ o) & 0xffffff;
  return tag << 56 | check << 32 | o;
}

static inline uint64_t entry_off(uint64_t e) {
  return (e & 0xffffffffu) << 3;
}

static bool entry_ok(const tally_store *s, uint64_t e) {
  uint64_t o = e & 0xffffffffu;
  return o >= TALLY__ARENA_OFF / 8 &&
         ((e >> 32) & 0xffffff) ==
             (tally__mix(s->hdr->salt ^ (e >> 56) << 32 ^ o) & 0xffffff);
}

static int bad_entry(const tally_store *s, uint64_t slot) {
  return tally__fail(TALLY_ECORRUPT,
                     "%s: tally store is corrupt (name index "
                     "entry %llu)",
                     tally__store_name(s), (unsigned long long)slot);
}

/* The checksum's seed: the record's fixed fields. */
static uint64_t check_seed(const struct tally__rec *r) {
  uint32_t kind = atomic_load(&r->flags) >> TALLY__REC_KIND_SHIFT;
  return ((uint64_t)r->policy << 24 | (uint64_t)kind << 16 | r->name_len) ^
         r->incarnation ^ (uint64_t)r->family << 32;
}

static uint16_t fold16(uint64_t h) {
  h ^= h >> 32;
  return (uint16_t)(h ^ (h >> 16));
}

uint16_t tally__rec_checksum(const struct tally__rec *r) {
  return fold16(tally__hash(r->name, r->name_len, check_seed(r)));
}

/* tally__rec_verify; with name_h, also the name's index hash (name_hash),
 * from the same pass over the name: a walk needs both of every record. */
static int rec_check(tally_store *s, uint64_t rec_off, uint64_t *name_h) {
  const struct tally__rec *r = tally__at(s, rec_off);
  int ok = rec_off % 8 == 0 && tally__in_arena(s, rec_off, sizeof *r) &&
           atomic_load(&r->flags) >> TALLY__REC_KIND_SHIFT == TALLY__KIND_COUNTER &&
           r->name_len != 0 && /* a byte: never over TALLY_NAME_MAX (255) */
           tally__in_arena(s, rec_off, sizeof *r + r->name_len + 1u) &&
           r->name[r->name_len] == '\0' && r->policy < TALLY_POLICY_COUNT_;
  if (ok && name_h) {
    uint64_t h[2];
    tally__hash2(r->name, r->name_len, check_seed(r), 0, h);
    ok = r->check == fold16(h[0]);
    *name_h = h[1];
  } else if (ok) {
    ok = r->check == tally__rec_checksum(r);
  }
  if (!ok)
    return tally__fail(TALLY_ECORRUPT,
                       "%s: tally store is corrupt (counter "
                       "record at offset %llu)",
                       tally__store_name(s), (unsigned long long)rec_off);
  return 0;
}

int tally__rec_verify(tally_store *s, uint64_t rec_off) {
  return rec_check(s, rec_off, NULL);
}

/* The current table, validated; NULL (with the error set) if damaged. */
static struct tally__index *table(tally_store *s) {
  uint64_t off;
  if (tally__unseal(s, TALLY__SEAL_INDEX,
                    atomic_load_explicit(&s->hdr->index, memory_order_acquire), 0, &off))
    return NULL;
  struct tally__index *t = tally__at(s, off);
  if (off % 64 || !tally__in_arena(s, off, sizeof *t) || t->magic != TALLY__INDEX_MAGIC ||
      t->cap < MIN_CAP || (t->cap & (t->cap - 1)) || t->cap > (TALLY__MAX_BYTES / 8) ||
      !tally__in_arena(s, off, sizeof *t + t->cap * 8)) {
    tally__fail(TALLY_ECORRUPT, "%s: tally store is corrupt (name index)",
                tally__store_name(s));
    return NULL;
  }
  return t;
}

static int new_table(tally_store *s, uint64_t cap, struct tally__index **out,
                     uint64_t *off) {
  int rc = tally__alloc(s, sizeof(struct tally__index) + cap * 8, off);
  if (rc) return rc;
  struct tally__index *t = tally__at(s, *off);
  t->magic = TALLY__INDEX_MAGIC;
  t->cap = cap;
  *out = t;
  return 0;
}

/* A table for `names` names, at most 44% full: inserts rebuild past half
 * full, so a table runs between about a quarter and a half full (8 bytes a
 * slot: at a million names 16 MiB, where twice the room cost 32 MiB) */
static uint64_t cap_for(uint64_t names) {
  uint64_t cap = MIN_CAP;
  while (cap < (names + 1) * 2 + names / 4) cap *= 2;
  return cap;
}

uint64_t tally__index_bytes(tally_store *s) {
  /* none yet (the store is being made): 0, and no failure's message */
  if (!atomic_load_explicit(&s->hdr->index, memory_order_acquire)) return 0;
  struct tally__index *t = table(s);
  return t ? tally__round(sizeof *t + t->cap * 8, 64) : 0;
}

int tally__index_create(tally_store *s, uint64_t names) {
  struct tally__index *t;
  uint64_t off;
  int rc = new_table(s, cap_for(names), &t, &off);
  if (rc == 0)
    atomic_store_explicit(&s->hdr->index, tally__seal(s, TALLY__SEAL_INDEX, off, 0),
                          memory_order_release);
  return rc;
}

static uint64_t name_hash(const struct tally__rec *r) {
  return tally__hash(r->name, r->name_len, 0);
}

int tally__index_find(tally_store *s, const char *name, size_t len, uint64_t hash,
                      uint64_t *rec_off) {
  struct tally__index *t = table(s);
  if (!t) return TALLY_ECORRUPT;
  uint64_t mask = t->cap - 1, tag = hash >> 56;
  for (uint64_t i = (hash >> 32) & mask, n = 0; n < t->cap; i = (i + 1) & mask, n++) {
    uint64_t e = atomic_load_explicit(&t->entries[i], memory_order_acquire);
    if (e == EMPTY) break;
    if (e == DELETED) continue;
    if (!entry_ok(s, e)) return bad_entry(s, i);
    if ((e >> 56) != tag) continue;
    uint64_t off = entry_off(e);
    const struct tally__rec *r = tally__at(s, off);
    /* the record's own length bounds it: the newest record ends exactly at
     * the arena's end, so a longer name looked up must not be used here */
    if (!tally__in_arena(s, off, sizeof *r) ||
        !tally__in_arena(s, off, sizeof *r + r->name_len + 1u))
      return bad_entry(s, i);
    if (r->name_len == len && memcmp(r->name, name, len) == 0) {
      *rec_off = off;
      return 0;
    }
    /* same 8-bit tag, other name: 1 probe in 256, or a damaged record or
     * entry, which must not pass for "no such counter" */
    uint64_t h;
    int rc = rec_check(s, off, &h);
    if (rc) return rc;
    if ((h >> 56) != tag) return bad_entry(s, i);
  }
  return TALLY_ENOENT;
}

/* Store entry in its first free slot; false if there is none (the
 * counts that keep the table half empty were damaged). */
static bool place(struct tally__index *t, uint64_t hash, uint64_t entry) {
  uint64_t mask = t->cap - 1;
  uint64_t i = (hash >> 32) & mask, n = 0;
  for (;; i = (i + 1) & mask) {
    uint64_t e = atomic_load_explicit(&t->entries[i], memory_order_relaxed);
    if (e == EMPTY || e == DELETED) break;
    if (++n == t->cap) return false;
  }
  if (atomic_load_explicit(&t->entries[i], memory_order_relaxed) == DELETED) t->deleted--;
  atomic_store_explicit(&t->entries[i], entry, memory_order_release);
  t->live++;
  return true;
}

/* Rebuild into a table sized for twice the live entries (dropping deleted
 * ones) and publish it. The slot needs the name's hash: read the records. */
static int rebuild(tally_store *s, struct tally__index *old, struct tally__index **out) {
  uint64_t live = 0, cap;
  for (uint64_t i = 0; i < old->cap; i++) { /* recount: the counts are hints */
    uint64_t e = atomic_load_explicit(&old->entries[i], memory_order_relaxed);
    live += e != EMPTY && e != DELETED;
  }
  cap = cap_for(live);
  /* a rebuild forced by dropped entries keeps the size it has, if that
   * still leaves the table half empty, and unless the live entries would
   * fill less than a sixteenth of it: churn then swaps two tables of one
   * size, and the retired one is reused (a table shrunk while names come
   * back would grow again, leaving two sizes behind) */
  if ((live + 1) * 2 <= old->cap && (cap > old->cap || live * 16 >= old->cap))
    cap = old->cap;
  struct tally__index *t;
  uint64_t off;
  int rc = new_table(s, cap, &t, &off);
  if (rc) return rc;
  for (uint64_t i = 0; i < old->cap; i++) {
    uint64_t e = atomic_load_explicit(&old->entries[i], memory_order_relaxed);
    if (e == EMPTY || e == DELETED) continue;
    if (!entry_ok(s, e)) return bad_entry(s, i);
    uint64_t hash;
    if ((rc = rec_check(s, entry_off(e), &hash))) return rc;
    place(t, hash, e); /* 2x room: never full */
  }
  atomic_store_explicit(&s->hdr->index, tally__seal(s, TALLY__SEAL_INDEX, off, 0),
                        memory_order_release);
  *out = t;
  /* readers may still probe the old table: it waits out the grace period */
  uint64_t item =
      tally__item(TALLY__ITEM_ALIGNED, (uint64_t)((unsigned char *)old - s->base),
                  tally__round(sizeof *old + old->cap * 8, 64) / 64);
  return tally__retire(s, 0, &item, 1);
}

int tally__index_insert(tally_store *s, uint64_t hash, uint64_t rec_off) {
  struct tally__index *t = table(s);
  if (!t) return TALLY_ECORRUPT;
  if ((t->live + t->deleted + 1) * 2 > t->cap) {
    int rc = rebuild(s, t, &t);
    if (rc) return rc;
  }
  if (!place(t, hash, entry_make(s, hash, rec_off)))
    return tally__fail(TALLY_ECORRUPT,
                       "%s: tally store is corrupt (name index "
                       "full)",
                       tally__store_name(s));
  atomic_fetch_add_explicit(&s->hdr->generation, 1, memory_order_release);
  return 0;
}

/* Remove the entry of rec_off if present; idempotent (a move finished
 * twice after a crash calls it twice). */
void tally__index_remove(tally_store *s, uint64_t rec_off) {
  struct tally__index *t = table(s);
  if (!t) return;
  const struct tally__rec *r = tally__at(s, rec_off);
  uint64_t hash = name_hash(r);
  uint64_t mask = t->cap - 1;
  for (uint64_t i = (hash >> 32) & mask, n = 0; n < t->cap; i = (i + 1) & mask, n++) {
    uint64_t e = atomic_load_explicit(&t->entries[i], memory_order_relaxed);
    if (e == EMPTY) return;
    if (e != DELETED && entry_ok(s, e) && entry_off(e) == rec_off) {
      atomic_store_explicit(&t->entries[i], DELETED, memory_order_release);
      t->live--;
      t->deleted++;
      /* A slot followed by an empty one ends every probe that reaches
       * it: it may be empty too, and so may the deleted ones before it.
       * Names dropped by the round then leave no deleted entries, and
       * churn no rebuild (which needs a second table). */
      for (uint64_t k = 0;
           k < t->cap &&
           atomic_load_explicit(&t->entries[(i + 1) & mask], memory_order_relaxed) ==
               EMPTY &&
           atomic_load_explicit(&t->entries[i], memory_order_relaxed) == DELETED;
           k++, i = (i - 1) & mask) {
        atomic_store_explicit(&t->entries[i], EMPTY, memory_order_release);
        t->deleted--;
      }
      atomic_fetch_add_explicit(&s->hdr->generation, 1, memory_order_release);
      return;
    }
  }
}

/* A walk visits records in hash order, so each is a cache miss, and a
 * value read another 1 to 16 (a shard's cells live in its own row). The
 * walk asks for them ahead of time: the record RECORDS_AHEAD slots on,
 * and, CELLS_AHEAD slots on, the cells its (by then arrived) record names.
 * Only hints: nothing read here is trusted, every offset is bounded by the
 * arena, and the visit itself validates as before. */
#define RECORDS_AHEAD 16
#define CELLS_AHEAD   8

static void fetch_record(tally_store *s, uint64_t e) {
  uint64_t off = entry_off(e);
  if (e == EMPTY || e == DELETED || !tally__in_arena(s, off, 128)) return;
  const unsigned char *r = tally__at(s, off);
  __builtin_prefetch(r);
  __builtin_prefetch(r + 64); /* the name runs on past the first line */
}

/* noipa: GCC 12 takes a function of prefetches alone for one without
 * effects and drops its calls, inlined or not (measured: the cells were
 * never asked for, and a sum walk took 1.8x as long) */
#if defined(__GNUC__) && !defined(__clang__)
#define KEEP_CALLS __attribute__((noipa))
#else
#define KEEP_CALLS
#endif

KEEP_CALLS void tally__fetch_cells(tally_store *s, uint64_t loc) {
  uint32_t n = tally__loc_shards(loc);
  uint64_t cells = (loc >> 32) << 3;
  if (!tally__in_arena(s, cells, (uint64_t)(n - 1) * TALLY__ROW_BYTES + 8)) return;
  const unsigned char *first = tally__at(s, cells);
  for (uint32_t k = 0; k < n; k++)
    __builtin_prefetch(first + (uint64_t)k * TALLY__ROW_BYTES);
}

static void fetch_cells(tally_store *s, uint64_t e) {
  uint64_t off = entry_off(e);
  if (e == EMPTY || e == DELETED || !tally__in_arena(s, off, sizeof(struct tally__rec)))
    return;
  const struct tally__rec *r = tally__at(s, off);
  tally__fetch_cells(s, atomic_load_explicit(&r->loc, memory_order_relaxed));
}

/* The walk of table t's slots [from, to). */
static int walk_slots(tally_store *s, struct tally__index *t, uint64_t from, uint64_t to,
                      tally__rec_fn fn, void *ud, bool cells) {
  for (uint64_t i = from; i < to; i++) {
    if (i + RECORDS_AHEAD < to)
      fetch_record(
          s, atomic_load_explicit(&t->entries[i + RECORDS_AHEAD], memory_order_relaxed));
    if (cells && i + CELLS_AHEAD < to) /* acquire: it reads the record's loc */
      fetch_cells(
          s, atomic_load_explicit(&t->entries[i + CELLS_AHEAD], memory_order_acquire));
    uint64_t e = atomic_load_explicit(&t->entries[i], memory_order_acquire);
    if (e == EMPTY || e == DELETED) continue;
    if (!entry_ok(s, e)) return bad_entry(s, i);
    uint64_t off = entry_off(e);
    uint64_t hash;
    int rc = rec_check(s, off, &hash);
    if (rc == 0 && (hash >> 56) != (e >> 56))
      rc = bad_entry(s, i); /* points at some other counter's record */
    if (rc == 0) rc = fn(s, off, ud);
    if (rc) return rc;
  }
  return 0;
}

static int walk(tally_store *s, tally__rec_fn fn, void *ud, bool cells) {
  struct tally__index *t = table(s);
  return t ? walk_slots(s, t, 0, t->cap, fn, ud, cells) : TALLY_ECORRUPT;
}

int tally__index_table(tally_store *s, uint64_t *off, uint64_t *cap) {
  struct tally__index *t = table(s);
  if (!t) return TALLY_ECORRUPT;
  *off = (uint64_t)((unsigned char *)t - s->base);
  *cap = t->cap;
  return 0;
}

int tally__index_slots(tally_store *s, uint64_t off, uint64_t from, uint64_t count,
                       tally__rec_fn fn, void *ud) {
  struct tally__index *t = tally__at(s, off);
  uint64_t to = count < t->cap - from ? from + count : t->cap;
  return walk_slots(s, t, from, to, fn, ud, true);
}

/* The table a walk began with stays its own to the end (a rebuild
 * retires it), and so do the records it hands out. */
static int each(tally_store *s, tally__rec_fn fn, void *ud, bool cells) {
  tally__hold_begin(s);
  int rc = walk(s, fn, ud, cells);
  tally__hold_end(s);
  return rc;
}

int tally__index_each(tally_store *s, tally__rec_fn fn, void *ud) {
  return each(s, fn, ud, false);
}

int tally__index_each_value(tally_store *s, tally__rec_fn fn, void *ud) {
  return each(s, fn, ud, true);
}

uint64_t tally__index_live(tally_store *s) {
  struct tally__index *t = table(s);
  return t ? t->live : 0;
}

int tally__index_range(tally_store *s, uint64_t *cursor, uint64_t count, tally__rec_fn fn,
                       void *ud) {
  struct tally__index *t = table(s);
  if (!t) return TALLY_ECORRUPT;
  if (count > t->cap) count = t->cap;
  uint64_t i = *cursor & (t->cap - 1);
  for (uint64_t k = 0; k < count; k++, i = (i + 1) & (t->cap - 1)) {
    uint64_t e = atomic_load_explicit(&t->entries[i], memory_order_acquire);
    if (e == EMPTY || e == DELETED) continue;
    if (!entry_ok(s, e)) return bad_entry(s, i);
    int rc = tally__rec_verify(s, entry_off(e));
    if (rc == 0) rc = fn(s, entry_off(e), ud);
    if (rc) {
      *cursor = i;
      return rc;
    }
  }
  *cursor = i;
  return 0;
}

/* The table header only: cheap, done at open (check.c walks the entries). */
int tally__index_check(tally_store *s) {
  return table(s) ? 0 : TALLY_ECORRUPT;
}
