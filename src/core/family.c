/* family.c -- counter families: options for every counter under a pattern.
 *
 * Families are records in the store, linked newest first from the header,
 * so every process sees every family and the newest matching one wins. A
 * family is never changed in place: defining a pattern again prepends a
 * new record that shadows the old one, and a reader walking the list never
 * sees a half-written family. Defining it again with the options it has
 * already adds nothing (unless a newer overlapping family would lose its
 * precedence), so the list does not grow with every process start.
 */
#include "internal.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#define POLICY_UNSET 0xFFu
#define MAX_FAMILIES 100000u /* bounds every walk, even over a damaged list */

static uint32_t family_checksum(const struct tally__family *f) {
  uint64_t h =
      tally__hash(f->pattern, f->pattern_len,
                  f->next ^ ((uint64_t)f->shards << 32) ^ ((uint64_t)f->policy << 16) ^
                      f->kind ^ ((uint64_t)f->pattern_len << 40) ^
                      tally__mix((uint64_t)f->idle_s << 32 ^ f->max_counters));
  return (uint32_t)(h ^ (h >> 32));
}

static int family_at(tally_store *s, uint64_t off, const struct tally__family **out) {
  const struct tally__family *f = tally__at(s, off);
  if (off % 8 || !tally__in_arena(s, off, sizeof *f) || f->kind != TALLY__KIND_FAMILY ||
      !tally__in_arena(s, off, sizeof *f + f->pattern_len + 1u) ||
      f->check != family_checksum(f))
    return tally__fail(TALLY_ECORRUPT,
                       "%s: tally store is corrupt (family "
                       "record at offset %llu)",
                       tally__store_name(s), (unsigned long long)off);
  *out = f;
  return 0;
}

static int head(tally_store *s, uint64_t *off) {
  return tally__unseal(s, TALLY__SEAL_FAMILIES,
                       atomic_load_explicit(&s->hdr->families, memory_order_acquire), 0,
                       off);
}

int tally__family_check(tally_store *s) {
  uint64_t off;
  int rc = head(s, &off);
  if (rc) return rc;
  for (uint32_t n = 0; off; n++) {
    const struct tally__family *f = NULL;
    if (n == MAX_FAMILIES)
      return tally__fail(TALLY_ECORRUPT,
                         "%s: tally store is corrupt (family "
                         "list loops)",
                         tally__store_name(s));
    rc = family_at(s, off, &f);
    if (rc) return rc;
    /* next may lie above off: a newer record can take space reused
     * below an older one. The count above ends a loop. */
    off = f->next;
  }
  return 0;
}

/* Can globs a and b match one same name? A walk over both at once: a '*'
 * either ends or takes the other pattern's next item; '?' meets any byte.
 * m[i][j]: can a[i..] and b[j..] match one name, filled from the ends. If
 * there is no memory for the table, say yes (the safe answer). */
static bool globs_overlap(const char *a, size_t na, const char *b, size_t nb) {
  size_t w = nb + 1;
  bool *m = malloc((na + 1) * w);
  if (!m) return true;
  for (size_t i = na + 1; i-- > 0;)
    for (size_t j = nb + 1; j-- > 0;) {
      bool r;
      if (i == na && j == nb)
        r = true;
      else if (i < na && a[i] == '*')
        r = m[(i + 1) * w + j] || (j < nb && m[i * w + j + 1]);
      else if (j < nb && b[j] == '*')
        r = m[i * w + j + 1] || (i < na && m[(i + 1) * w + j]);
      else if (i == na || j == nb)
        r = false;
      else
        r = (a[i] == '?' || b[j] == '?' || a[i] == b[j]) && m[(i + 1) * w + j + 1];
      m[i * w + j] = r;
    }
  bool r = m[0];
  free(m);
  return r;
}

/* Would defining pattern with these options change nothing? True when the
 * newest record of the same pattern has the same options and no newer
 * record could shadow it for some name. Processes that define their
 * families at every start (nginx workers at every reload) then add no
 * records. Caller holds the lock. */
static int redundant(tally_store *s, const char *pattern, size_t plen, uint32_t shards,
                     uint8_t policy, const tally_family_options *o, bool *out) {
  uint64_t off;
  int rc = head(s, &off);
  *out = false;
  for (uint32_t n = 0; rc == 0 && off && n < MAX_FAMILIES; n++) {
    const struct tally__family *f = NULL;
    if ((rc = family_at(s, off, &f))) break;
    if (f->pattern_len == plen && memcmp(f->pattern, pattern, plen) == 0) {
      *out = f->shards == shards && f->policy == policy && f->idle_s == o->idle_s &&
             f->max_counters == o->max_counters;
      break;
    }
    if (globs_overlap(f->pattern, f->pattern_len, pattern, plen)) break;
    off = f->next;
  }
  return rc;
}

uint32_t tally__pattern_hash(const char *p, size_t n) {
  uint32_t h = (uint32_t)(tally__hash(p, n, 0x66616d) >> 32);
  return h ? h : 1;
}

/* Live counters by family: an index walk with count_one adds each counter
 * not dropped to its family's n (v sorted by hash, one entry a hash). */
struct fam_count {
  uint32_t hash, age; /* age: place in the list, 0 the newest */
  uint64_t n;
  struct tally__family *f;
};
struct count_under {
  struct fam_count *v;
  size_t nv;
};
static int count_one(tally_store *s, uint64_t rec_off, void *ud) {
  struct count_under *c = ud;
  const struct tally__rec *r = tally__at(s, rec_off);
  if (!r->family || (atomic_load(&r->loc) & TALLY__LOC_DROPPED)) return 0;
  for (size_t lo = 0, hi = c->nv; lo < hi;) {
    size_t mid = lo + (hi - lo) / 2;
    if (c->v[mid].hash == r->family) {
      c->v[mid].n++;
      break;
    }
    if (c->v[mid].hash < r->family)
      lo = mid + 1;
    else
      hi = mid;
  }
  return 0;
}

static int by_hash_age(const void *pa, const void *pb) {
  const struct fam_count *a = pa, *b = pb;
  if (a->hash != b->hash) return a->hash < b->hash ? -1 : 1;
  return a->age < b->age ? -1 : a->age > b->age;
}

/* No memory for the table: one walk per family, as exact and slower. */
static int recount_each(tally_store *s, uint64_t off, size_t n) {
  int rc = 0;
  for (size_t i = 0; rc == 0 && i < n; i++) {
    struct tally__family *f = tally__at(s, off); /* checked by the caller */
    struct fam_count one = {tally__pattern_hash(f->pattern, f->pattern_len), 0, 0, f};
    struct count_under cu = {&one, 1};
    if (tally__family_by_hash(s, one.hash) == f && /* the record that counts */
        (rc = tally__index_each(s, count_one, &cu)) == 0)
      atomic_store(&f->live, one.n);
    off = f->next;
  }
  return rc;
}

int tally__family_recount(tally_store *s) {
  uint64_t first, off;
  int rc = head(s, &first);
  size_t n = 0;
  for (off = first; rc == 0 && off && n < MAX_FAMILIES; n++) {
    const struct tally__family *f = NULL;
    if ((rc = family_at(s, off, &f)) == 0) off = f->next;
  }
  if (rc || n == 0) return rc;
  struct fam_count *v = malloc(n * sizeof *v);
  if (!v) return recount_each(s, first, n);
  off = first;
  for (size_t i = 0; i < n; i++) {
    struct tally__family *f = tally__at(s, off);
    v[i] = (struct fam_count){tally__pattern_hash(f->pattern, f->pattern_len),
                              (uint32_t)i, 0, f};
    off = f->next;
  }
  /* the newest record of each hash keeps the count (tally__family_by_hash) */
  qsort(v, n, sizeof *v, by_hash_age);
  size_t d = 0;
  for (size_t i = 0; i < n; i++)
    if (d == 0 || v[d - 1].hash != v[i].hash) v[d++] = v[i];
  struct count_under cu = {v, d};
  rc = tally__index_each(s, count_one, &cu);
  for (size_t i = 0; rc == 0 && i < d; i++) atomic_store(&v[i].f->live, v[i].n);
  free(v);
  return rc;
}

int tally_family_set(tally_store *s, const char *pattern, size_t plen,
                     const tally_counter_options *opt) {
  tally_family_options o = {0, -1, 0, 0};
  if (opt) {
    o.shards = opt->shards;
    o.policy = opt->policy;
  }
  return tally_family_define(s, pattern, plen, &o);
}

int tally_family_define(tally_store *s, const char *pattern, size_t plen,
                        const tally_family_options *opt) {
  static const tally_family_options defaults = {0, -1, 0, 0};
  if (!s || !pattern) return tally__fail(TALLY_EINVAL, "tally_family_set: NULL argument");
  if (!opt) opt = &defaults;
  if (plen == 0 || plen > TALLY_NAME_MAX || memchr(pattern, 0, plen))
    return tally__fail(TALLY_ENAME,
                       "invalid family pattern (1 to %d bytes, "
                       "no NUL)",
                       TALLY_NAME_MAX);
  if (opt->shards > TALLY_MAX_SHARDS && opt->shards != TALLY_SHARDS_AUTO)
    return tally__fail(TALLY_ESHARDS, "shard count %u out of range (1 to %d)",
                       opt->shards, TALLY_MAX_SHARDS);
  if (opt->policy < -1 || opt->policy >= TALLY_POLICY_COUNT_)
    return tally__fail(TALLY_EPOLICY, "invalid shard policy %d", opt->policy);
  /* as a counter's options (counter.c): a slot counter has its own shards */
  if (opt->shards == TALLY_SHARDS_AUTO && opt->policy >= TALLY_POLICY_KEY &&
      opt->policy != TALLY_POLICY_SLOT && opt->policy != TALLY_POLICY_CPU)
    return tally__fail(TALLY_EPOLICY,
                       "automatic shards need a policy that picks the shard "
                       "itself (not %s)",
                       tally_policy_name(opt->policy));
  if (opt->policy == TALLY_POLICY_SLOT && opt->shards &&
      opt->shards != TALLY_SHARDS_AUTO && opt->shards != TALLY_SLOT_SHARDS)
    return tally__fail(TALLY_ESHARDS,
                       "the slot policy has one shard per writer slot: %d shards, not %u",
                       TALLY_SLOT_SHARDS, opt->shards);
  if (opt->policy == TALLY_POLICY_CPU && opt->shards &&
      opt->shards != TALLY_SHARDS_AUTO && opt->shards != tally_cpu_shards())
    return tally__fail(TALLY_ESHARDS, "the cpu policy has %u shards here, not %u",
                       tally_cpu_shards(), opt->shards);
  char over[TALLY_NAME_MAX + 1];
  if (opt->max_counters && tally_family_overflow(pattern, plen, over, sizeof over) < 0)
    return tally__fail(TALLY_ENAME,
                       "family '%.*s': its overflow counter's name would "
                       "pass %d bytes",
                       (int)plen, pattern, TALLY_NAME_MAX);
  int rc = tally__lock(s);
  if (rc) return rc;
  uint8_t policy = opt->policy < 0 ? POLICY_UNSET : (uint8_t)opt->policy;
  bool same;
  rc = redundant(s, pattern, plen, opt->shards, policy, opt, &same);
  if (rc || same) {
    tally__unlock(s);
    return rc;
  }
  /* a counter knows its family by the pattern's 32-bit hash (caps, and
   * the live count a drop takes down): two patterns of one hash would
   * share a count */
  const struct tally__family *twin =
      tally__family_by_hash(s, tally__pattern_hash(pattern, plen));
  if (twin && (twin->pattern_len != plen || memcmp(twin->pattern, pattern, plen) != 0)) {
    tally__unlock(s);
    return tally__fail(TALLY_EINVAL,
                       "family '%.*s': its pattern has the hash of family '%.*s', "
                       "and counters know their family by it: choose another pattern",
                       (int)plen, pattern, (int)twin->pattern_len, twin->pattern);
  }
  /* the live count moves to the new record: count the counters created
   * under this pattern (rare: only when the options change) */
  struct fam_count one = {tally__pattern_hash(pattern, plen), 0, 0, NULL};
  struct count_under cu = {&one, 1};
  rc = tally__index_each(s, count_one, &cu);
  uint64_t off;
  if (rc == 0) rc = tally__alloc(s, sizeof(struct tally__family) + plen + 1, &off);
  if (rc == 0) {
    struct tally__family *f = tally__at(s, off);
    rc = head(s, &f->next);
    f->shards = opt->shards;
    f->policy = policy;
    f->idle_s = opt->idle_s;
    f->max_counters = opt->max_counters;
    atomic_store(&f->live, one.n);
    f->kind = TALLY__KIND_FAMILY;
    f->pattern_len = (uint16_t)plen;
    memcpy(f->pattern, pattern, plen);
    f->check = family_checksum(f);
    if (rc == 0)
      atomic_store_explicit(&s->hdr->families,
                            tally__seal(s, TALLY__SEAL_FAMILIES, off, 0),
                            memory_order_release);
  }
  tally__unlock(s);
  return rc;
}

int tally_family_overflow(const char *pattern, size_t plen, char *buf, size_t cap) {
  static const char word[] = "_overflow";
  size_t n = 0;
  for (size_t i = 0; i < plen; i++) {
    const char *add = pattern[i] == '*' ? word : pattern[i] == '?' ? "_" : NULL;
    size_t k = add ? strlen(add) : 1;
    if (n + k >= cap || n + k > TALLY_NAME_MAX)
      return tally__fail(TALLY_ENAME, "overflow name too long");
    memcpy(buf + n, add ? add : &pattern[i], k);
    n += k;
  }
  buf[n] = 0;
  return (int)n;
}

int tally__family_of(tally_store *s, const char *name, size_t len,
                     const struct tally__family **out) {
  uint64_t off;
  int rc = head(s, &off);
  *out = NULL;
  for (uint32_t n = 0; rc == 0 && off && n < MAX_FAMILIES; n++) {
    const struct tally__family *f = NULL;
    if ((rc = family_at(s, off, &f))) break;
    if (tally_glob_match(f->pattern, f->pattern_len, name, len)) {
      *out = f;
      break;
    }
    off = f->next;
  }
  return rc;
}

bool tally__family_any_idle(tally_store *s) {
  uint64_t off;
  if (head(s, &off)) return false;
  for (uint32_t n = 0; off && n < MAX_FAMILIES; n++) {
    const struct tally__family *f = NULL;
    if (family_at(s, off, &f)) return false;
    if (f->idle_s) return true;
    off = f->next;
  }
  return false;
}

struct tally__family *tally__family_by_hash(tally_store *s, uint32_t h) {
  uint64_t off;
  if (head(s, &off)) return NULL;
  for (uint32_t n = 0; off && n < MAX_FAMILIES; n++) {
    const struct tally__family *f = NULL;
    if (family_at(s, off, &f)) return NULL;
    if (tally__pattern_hash(f->pattern, f->pattern_len) == h)
      return (struct tally__family *)f;
    off = f->next;
  }
  return NULL;
}

int tally_family_resolve(tally_store *s, const char *name, size_t len,
                         tally_counter_options *out) {
  if (!s || !name || !out)
    return tally__fail(TALLY_EINVAL, "tally_family_resolve: NULL argument");
  if (len == 0 || len > TALLY_NAME_MAX || memchr(name, 0, len))
    return tally__fail(TALLY_ENAME,
                       "invalid counter name (1 to %d bytes, "
                       "no NUL)",
                       TALLY_NAME_MAX);
  tally_counter_options o = {TALLY_SHARDS_AUTO, TALLY_POLICY_THREAD};
  const struct tally__family *f;
  int rc = tally__family_of(s, name, len, &f);
  if (rc) return rc;
  if (f && f->shards) o.shards = f->shards;
  if (f && f->policy != POLICY_UNSET) o.policy = f->policy;
  *out = o;
  return 0;
}
