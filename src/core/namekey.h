/* namekey.h -- a name's sort key: the rule order.c's radix sort and the
 * Lua binding's merge of sorted runs (lua_exposition.c) both compare by,
 * so the two orders cannot drift apart. Depends on nothing else.
 */
#ifndef TALLY_NAMEKEY_H
#define TALLY_NAMEKEY_H

#include <stddef.h>
#include <stdint.h>

/* The 8 bytes of name (len bytes) from depth on, big-endian, zeros past
 * its end: compared as numbers, memcmp's order, a shorter name before a
 * longer one it begins (no name holds a NUL). */
static inline uint64_t tally__name_bytes(const char *name, size_t len, size_t depth) {
  const unsigned char *b = (const unsigned char *)name + depth;
  size_t take = len > depth ? len - depth : 0;
  uint64_t key = 0;
  if (take > 8) take = 8;
  for (size_t j = 0; j < take; j++) key |= (uint64_t)b[j] << (56 - 8 * j);
  return key;
}

#endif
