/* hash.c -- the one hash function: names, keys and checksums.
 *
 * Eight bytes at a time through a multiply-xorshift round, then a 64-bit
 * finalizer (the avalanche mix from MurmurHash3's fmix64). Fast on short
 * names, every input bit reaches every output bit, which the index (slot =
 * high bits) and the checksums rely on. Not for adversarial inputs.
 */
#include "internal.h"

#include <string.h>

#define GOLDEN 0x9e3779b97f4a7c15ull

/* data's hash under each of n seeds (1 or 2: a constant once inlined).
 * A word's mix does not depend on the seed, so two hashes of one name
 * cost little more than one: a walk checks each record's checksum and
 * its name's index hash. */
static inline void hash_seeds(const void *data, size_t len, const uint64_t *seed,
                              uint64_t *out, int n) {
  const unsigned char *p = data;
  uint64_t h[2];
  for (int i = 0; i < n; i++) h[i] = seed[i] ^ (len * GOLDEN);
  while (len >= 8) {
    uint64_t w;
    memcpy(&w, p, 8);
    uint64_t m = tally__mix(w);
    for (int i = 0; i < n; i++) {
      h[i] = (h[i] ^ m) * GOLDEN;
      h[i] ^= h[i] >> 29;
    }
    p += 8;
    len -= 8;
  }
  if (len) { /* the last 1 to 7 bytes, zero-extended: what a memcpy into a
                zeroed word gives (little-endian), without a call per name */
    uint64_t w;
    if (len >= 4) { /* two loads that overlap: the same bytes land twice */
      uint32_t lo, hi;
      memcpy(&lo, p, 4);
      memcpy(&hi, p + len - 4, 4);
      w = lo | (uint64_t)hi << (8 * (len - 4));
    } else {
      w = p[0] | (uint64_t)p[len / 2] << (8 * (len / 2)) |
          (uint64_t)p[len - 1] << (8 * (len - 1));
    }
    uint64_t m = tally__mix(w ^ 0xa0761d6478bd642full);
    for (int i = 0; i < n; i++) h[i] = (h[i] ^ m) * GOLDEN;
  }
  for (int i = 0; i < n; i++) out[i] = tally__mix(h[i]);
}

uint64_t tally__hash(const void *data, size_t len, uint64_t seed) {
  uint64_t h;
  hash_seeds(data, len, &seed, &h, 1);
  return h;
}

void tally__hash2(const void *data, size_t len, uint64_t seed0, uint64_t seed1,
                  uint64_t out[2]) {
  const uint64_t seed[2] = {seed0, seed1};
  hash_seeds(data, len, seed, out, 2);
}
