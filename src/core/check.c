/* check.c -- verifying a whole store: every structure, record and cell.
 *
 * Open checks only what is O(1) (the header, the index table's header, the
 * size classes, the family and rollup tables' words). check() holds the
 * store lock and walks everything: each index entry leads to a valid
 * record that the index finds again by its name, with a valid location,
 * cells in the live range and sound rollup rings, and the free lists and
 * limbo hold nothing twice and nothing live. It is the one place that
 * knows every concept's own check, so none of them has to call another.
 */
#include "internal.h"

static int check_one(tally_store *s, uint64_t off, void *ud) {
  (void)ud;
  const struct tally__rec *r = tally__at(s, off);
  uint64_t hash = tally__hash(r->name, r->name_len, 0), found;
  if (tally__index_find(s, r->name, r->name_len, hash, &found) != 0 || found != off)
    return tally__fail(TALLY_ECORRUPT,
                       "%s: tally store is corrupt (counter "
                       "'%s' is not where the index says)",
                       tally__store_name(s), r->name);
  uint64_t cells;
  uint32_t n;
  bool dropped;
  int rc = tally__loc_decode(s, off, atomic_load(&r->loc), &cells, &n, &dropped);
  if (rc) return rc;
  if (dropped)
    return tally__fail(TALLY_ECORRUPT,
                       "%s: tally store is corrupt (dropped "
                       "counter '%s' is still indexed)",
                       tally__store_name(s), r->name);
  if ((rc = tally__cells_check(s, off, atomic_load(&r->loc)))) return rc;
  if ((rc = tally__rollups_check(s, off))) return rc;
  return 0;
}

int tally_store_check(tally_store *s) {
  if (!s) return tally__fail(TALLY_EINVAL, "tally_store_check: store is NULL");
  int trc = tally__truncated(s);
  if (trc) return trc;
  if (s->hdr->check != tally__header_check(s->hdr))
    return tally__fail(TALLY_ECORRUPT,
                       "%s: tally store is corrupt (header "
                       "checksum)",
                       tally__store_name(s));
  int rc = tally__lock(s); /* a consistent view: no create or drop meanwhile */
  if (rc) return rc;
  rc = tally__classes_check(s);
  if (rc == 0) rc = tally__index_check(s);
  if (rc == 0) rc = tally__index_each(s, check_one, NULL);
  if (rc == 0) rc = tally__family_check(s);
  if (rc == 0) rc = tally__rollup_table_check(s);
  if (rc == 0) rc = tally__schedules_check(s);
  if (rc == 0) rc = tally__space_check(s);
  tally__unlock(s);
  return rc;
}
