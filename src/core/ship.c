/* ship.c -- counters that a flusher ships elsewhere, and their expiry.
 *
 * A flusher (tally_net.h) ships local values to a remote store; a counter
 * it ships may expire only once its final value has gone out, or the
 * remote would miss the last deltas. The store keeps, in the header, which
 * flushers ship which names (writer, pattern), so the rule holds in every
 * process that runs upkeep, and across restarts of a file store:
 *
 *   a counter that a registered flusher covers expires only while its
 *   value equals `shipped`, the value its flusher last confirmed remotely
 *   for this incarnation (tally_counter_ship).
 *
 * A new counter starts with shipped 0, so one that a flusher has not seen
 * yet is held as soon as it has counted anything. TALLY_SHIP_UNKNOWN (a
 * flush is out, its fate unknown) holds it whatever its value. A name two writers cover
 * never expires: one field cannot say both have its final value. When the
 * table is full (or a pattern too long for it) every name is covered.
 */
#include "internal.h"

#include <inttypes.h>
#include <string.h>

static uint64_t writer_hash(const char *writer, size_t wlen) {
  uint64_t h = tally__hash(writer, wlen, 0x5317);
  return h ? h : 1;
}

int tally_store_ship(tally_store *s, const char *writer, size_t wlen, const char *pattern,
                     size_t plen) {
  if (!s || !writer || !pattern)
    return tally__fail(TALLY_EINVAL, "tally_store_ship: NULL argument");
  if (wlen == 0 || plen == 0)
    return tally__fail(TALLY_EINVAL, "tally_store_ship: empty writer or pattern");
  uint64_t w = writer_hash(writer, wlen);
  uint64_t id = tally__hash(pattern, plen, w);
  id = id ? id : 1;
  struct tally__header *h = s->hdr;
  for (int i = 0; i < TALLY__SHIPPERS; i++) /* the common case: known */
    if (atomic_load(&h->shippers[i].id) == id) return 0;
  int rc = tally__lock(s);
  if (rc) return rc;
  struct tally__shipper *free_slot = NULL;
  for (int i = 0; i < TALLY__SHIPPERS; i++) {
    uint64_t x = atomic_load(&h->shippers[i].id);
    if (x == id) goto out;
    if (x == 0 && !free_slot) free_slot = &h->shippers[i];
  }
  if (!free_slot || plen > TALLY__SHIP_PATTERN_MAX) {
    atomic_store(&h->ship_all, 1); /* conservative: cover every name */
    goto out;
  }
  free_slot->writer = w;
  free_slot->pattern_len = (uint32_t)plen;
  memcpy(free_slot->pattern, pattern, plen);
  atomic_store_explicit(&free_slot->id, id, memory_order_release);
out:
  tally__unlock(s);
  return 0;
}

int tally_store_unship(tally_store *s, const char *writer, size_t wlen) {
  if (!s || !writer || wlen == 0)
    return tally__fail(TALLY_EINVAL, "tally_store_unship: NULL or empty writer");
  uint64_t w = writer_hash(writer, wlen);
  int rc = tally__lock(s);
  if (rc) return rc;
  for (int i = 0; i < TALLY__SHIPPERS; i++) {
    struct tally__shipper *sh = &s->hdr->shippers[i];
    if (atomic_load(&sh->id) && sh->writer == w) atomic_store(&sh->id, 0);
  }
  tally__unlock(s);
  return 0;
}

bool tally__ship_holds(tally_store *s, const struct tally__rec *r, int64_t v) {
  const struct tally__header *h = s->hdr;
  uint64_t first = 0; /* the first covering writer */
  bool two = false;
  for (int i = 0; i < TALLY__SHIPPERS; i++) {
    const struct tally__shipper *sh = &h->shippers[i];
    if (!atomic_load_explicit(&sh->id, memory_order_acquire)) continue;
    uint32_t pl = sh->pattern_len;
    if (pl > TALLY__SHIP_PATTERN_MAX) return true; /* damaged: keep the counter */
    if (!tally_glob_match(sh->pattern, pl, r->name, r->name_len)) continue;
    if (first && first != sh->writer) two = true;
    first = sh->writer;
  }
  if (!first && !atomic_load(&h->ship_all)) return false;
  int64_t shipped = atomic_load(&r->shipped);
  return two || shipped == TALLY_SHIP_UNKNOWN || shipped != v;
}

int tally_counter_ship(tally_counter *c, uint64_t incarnation, int64_t value) {
  if (!c) return tally__fail(TALLY_EINVAL, "tally_counter_ship: counter is NULL");
  int rc = tally__counter_live(c);
  uint64_t loc;
  if (rc == 0) rc = tally__current(c->s, tally__crec(c), &loc);
  if (rc) return rc;
  struct tally__rec *r = tally__at(c->s, tally__crec(c));
  if (r->incarnation != incarnation) return 0; /* an older one's: it is gone */
  atomic_store(&r->shipped, value);
  return 0;
}

int tally_send_delta(int64_t value, uint64_t incarnation, int64_t marker_value,
                     uint64_t marker_incarnation, int64_t *delta) {
  int64_t base =
      marker_incarnation == incarnation || !marker_incarnation ? marker_value : 0;
  if (!delta) return tally__fail(TALLY_EINVAL, "tally_send_delta: delta is NULL");
  if (__builtin_sub_overflow(value, base, delta))
    return tally__fail(TALLY_ERANGE, "delta %" PRId64 " - %" PRId64 " overflows int64",
                       value, base);
  return 0;
}

int tally_counter_send_begin(tally_counter *c, int64_t marker_value,
                             uint64_t marker_incarnation, tally_send *out) {
  if (!c || !out)
    return tally__fail(TALLY_EINVAL, "tally_counter_send_begin: NULL argument");
  int64_t v;
  uint64_t inc;
  int rc = tally_counter_read(c, &v, &inc);
  for (int i = 0; !rc && i < 2; i++) { /* made again in between: mark that one */
    uint64_t marked = inc;
    if (!inc) return tally__fail(TALLY_ENOENT, "counter expired: nothing to send");
    if ((rc = tally_counter_ship(c, inc, TALLY_SHIP_UNKNOWN))) break;
    TALLY__TEST_HOOK("send", c->name, c->name_len);
    if ((rc = tally_counter_read(c, &v, &inc))) break;
    if (inc != marked) continue;
    out->value = v;
    out->incarnation = inc;
    return tally_send_delta(v, inc, marker_value, marker_incarnation, &out->delta);
  }
  if (rc) return rc;
  return tally__fail(TALLY_EBUSY, "counter made again twice while being marked");
}
