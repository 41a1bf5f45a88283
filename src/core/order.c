/* order.c -- counters in their names' order, bytewise.
 *
 * A radix sort on 8 bytes at a time: a name's next 8 bytes read as one
 * big-endian number (zeros past its end: no name holds a NUL), least
 * significant byte first, a byte every key shares skipped; the runs that
 * tie and go on are sorted again by their next 8. So memcmp's order, a
 * shorter name before a longer one it begins. A key holds a name's first
 * 16 bytes, taken while the walk has its record in cache: only names that
 * tie on those come back to their records (a comparison sort would fetch
 * two names from all over the arena for each of its 20 compares a name).
 */
#include "internal.h"
#include "namekey.h"

#include <stdlib.h>
#include <string.h>

#define SMALL_RUN 48 /* shorter runs: insertion sort */

static uint64_t bytes_at(const struct tally__rec *r, size_t depth) {
  return tally__name_bytes(r->name, r->name_len, depth);
}

void tally__name_key(tally_store *s, uint64_t rec_off, struct tally__name_key *out) {
  const struct tally__rec *r = tally__at(s, rec_off);
  out->rec = rec_off | (uint64_t)r->name_len << 56;
  out->key = bytes_at(r, 0);
  out->next = bytes_at(r, 8);
}

static size_t len_of(const struct tally__name_key *p) {
  return (size_t)(p->rec >> 56);
}

/* Sort p[0..n) by key (the bytes at depth), then each tied run by the
 * next 8. tmp has room for n keys. Stable. The depth is at most a name's
 * length (255), so the recursion is at most 32 deep. */
static void keys_sort(tally_store *s, struct tally__name_key *p, size_t n, size_t depth,
                      struct tally__name_key *tmp) {
  size_t i, j;
  if (n < SMALL_RUN) {
    for (i = 1; i < n; i++) {
      struct tally__name_key t = p[i];
      for (j = i; j > 0 && p[j - 1].key > t.key; j--) p[j] = p[j - 1];
      p[j] = t;
    }
  } else {
    struct tally__name_key *from = p, *to = tmp, *t;
    for (int shift = 0; shift < 64; shift += 8) {
      size_t at[256] = {0}, sum = 0;
      for (i = 0; i < n; i++) at[(from[i].key >> shift) & 255]++;
      if (at[(from[0].key >> shift) & 255] == n) continue;
      for (j = 0; j < 256; j++) {
        size_t c = at[j];
        at[j] = sum;
        sum += c;
      }
      for (i = 0; i < n; i++) to[at[(from[i].key >> shift) & 255]++] = from[i];
      t = from;
      from = to;
      to = t;
    }
    if (from != p) memcpy(p, from, n * sizeof *p);
  }
  for (i = 0; i < n; i = j) {
    bool more = len_of(&p[i]) > depth + 8;
    for (j = i + 1; j < n && p[j].key == p[i].key; j++) more |= len_of(&p[j]) > depth + 8;
    if (j - i > 1 && more) {
      for (size_t q = i; q < j; q++) { /* the next 8 bytes; the 8 after from the record */
        p[q].key = p[q].next;
        p[q].next =
            bytes_at(tally__at(s, p[q].rec & ((UINT64_C(1) << 56) - 1)), depth + 16);
      }
      keys_sort(s, p + i, j - i, depth + 8, tmp);
    }
  }
}

int tally__sort_by_name(tally_store *s, struct tally__name_key *keys, size_t n) {
  if (n > 1) {
    struct tally__name_key *tmp = malloc(n * sizeof *tmp);
    if (!tmp) return tally__fail(TALLY_ENOMEM, "out of memory");
    keys_sort(s, keys, n, 0, tmp);
    free(tmp);
  }
  for (size_t i = 0; i < n; i++) keys[i].rec &= (UINT64_C(1) << 56) - 1;
  return 0;
}
