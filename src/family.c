/* family.c -- counter families: options for every counter under a pattern.
 *
 * Families are records in the store, linked newest first from the header,
 * so every process sees every family and the newest matching one wins. A
 * family is never changed in place: defining a pattern again prepends a
 * new record that shadows the old one, and a reader walking the list never
 * sees a half-written family.
 */
#include "internal.h"

#include <string.h>

#define POLICY_UNSET 0xFFu
#define MAX_FAMILIES 100000u /* bounds every walk, even over a damaged list */

static uint32_t family_checksum(const struct tally__family *f) {
  uint64_t h = tally__hash(f->pattern, f->pattern_len,
                           f->next ^ ((uint64_t)f->shards << 32) ^
                               ((uint64_t)f->policy << 16) ^ f->kind ^
                               ((uint64_t)f->pattern_len << 40));
  return (uint32_t)(h ^ (h >> 32));
}

static int family_at(tally_store *s, uint64_t off,
                     const struct tally__family **out) {
  const struct tally__family *f = tally__at(s, off);
  if (off % 8 || !tally__in_arena(s, off, sizeof *f) ||
      f->kind != TALLY__KIND_FAMILY ||
      !tally__in_arena(s, off, sizeof *f + f->pattern_len + 1u) ||
      f->check != family_checksum(f))
    return tally__fail(TALLY_ECORRUPT, "%s: tally store is corrupt (family "
                       "record at offset %llu)", tally__store_name(s),
                       (unsigned long long)off);
  *out = f;
  return 0;
}

static int head(tally_store *s, uint64_t *off) {
  return tally__unseal(s, TALLY__SEAL_FAMILIES,
                       atomic_load_explicit(&s->hdr->families, memory_order_acquire),
                       0, off);
}

int tally__family_check(tally_store *s) {
  uint64_t off;
  int rc = head(s, &off);
  if (rc) return rc;
  for (uint32_t n = 0; off; n++) {
    const struct tally__family *f;
    if (n == MAX_FAMILIES)
      return tally__fail(TALLY_ECORRUPT, "%s: tally store is corrupt (family "
                         "list loops)", tally__store_name(s));
    rc = family_at(s, off, &f);
    if (rc) return rc;
    if (f->next >= off)  /* always points back to an older record */
      return tally__fail(TALLY_ECORRUPT, "%s: tally store is corrupt (family "
                         "list order)", tally__store_name(s));
    off = f->next;
  }
  return 0;
}

int tally_family_set(tally_store *s, const char *pattern, size_t plen,
                     const tally_counter_options *opt) {
  static const tally_counter_options defaults = {0, -1};
  if (!s || !pattern)
    return tally__fail(TALLY_EINVAL, "tally_family_set: NULL argument");
  if (!opt) opt = &defaults;
  if (plen == 0 || plen > TALLY_NAME_MAX || memchr(pattern, 0, plen))
    return tally__fail(TALLY_ENAME, "invalid family pattern (1 to %d bytes, "
                       "no NUL)", TALLY_NAME_MAX);
  if (opt->shards > TALLY_MAX_SHARDS)
    return tally__fail(TALLY_ESHARDS, "shard count %u out of range (1 to %d)",
                       opt->shards, TALLY_MAX_SHARDS);
  if (opt->policy < -1 || opt->policy >= TALLY_POLICY_COUNT_)
    return tally__fail(TALLY_EPOLICY, "invalid shard policy %d", opt->policy);
  int rc = tally__lock(s);
  if (rc) return rc;
  uint64_t off;
  rc = tally__alloc(s, sizeof(struct tally__family) + plen + 1, &off);
  if (rc == 0) {
    struct tally__family *f = tally__at(s, off);
    rc = head(s, &f->next);
    f->shards = opt->shards;
    f->policy = opt->policy < 0 ? POLICY_UNSET : (uint8_t)opt->policy;
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

int tally_family_resolve(tally_store *s, const char *name, size_t len,
                         tally_counter_options *out) {
  if (!s || !name || !out)
    return tally__fail(TALLY_EINVAL, "tally_family_resolve: NULL argument");
  if (len == 0 || len > TALLY_NAME_MAX || memchr(name, 0, len))
    return tally__fail(TALLY_ENAME, "invalid counter name (1 to %d bytes, "
                       "no NUL)", TALLY_NAME_MAX);
  tally_counter_options o = {TALLY_DEFAULT_SHARDS, TALLY_POLICY_THREAD};
  uint64_t off;
  int rc = head(s, &off);
  if (rc) return rc;
  for (uint32_t n = 0; off && n < MAX_FAMILIES; n++) {
    const struct tally__family *f;
    rc = family_at(s, off, &f);
    if (rc) return rc;
    if (tally_glob_match(f->pattern, f->pattern_len, name, len)) {
      if (f->shards) o.shards = f->shards;
      if (f->policy != POLICY_UNSET) o.policy = f->policy;
      break;
    }
    off = f->next;
  }
  *out = o;
  return 0;
}
