/* hash.c -- the one hash function: names, keys and checksums.
 *
 * Eight bytes at a time through a multiply-xorshift round, then a 64-bit
 * finalizer (the avalanche mix from MurmurHash3's fmix64). Fast on short
 * names, every input bit reaches every output bit, which the index (slot =
 * high bits) and the checksums rely on. Not for adversarial inputs.
 */
#include "internal.h"

#include <string.h>

uint64_t tally__hash(const void *data, size_t len, uint64_t seed) {
  const unsigned char *p = data;
  uint64_t h = seed ^ (len * 0x9e3779b97f4a7c15ull);
  while (len >= 8) {
    uint64_t w;
    memcpy(&w, p, 8);
    h = (h ^ tally__mix(w)) * 0x9e3779b97f4a7c15ull;
    h ^= h >> 29;
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
    h = (h ^ tally__mix(w ^ 0xa0761d6478bd642full)) * 0x9e3779b97f4a7c15ull;
  }
  return tally__mix(h);
}
