/* glob.c -- name patterns: '*' matches any run of bytes, '?' any one byte.
 *
 * The classic greedy matcher with one backtrack point: on a mismatch after
 * a '*', retry with the star swallowing one more byte. Linear in practice,
 * O(pattern * name) at worst, no recursion and no allocation.
 */
#include "internal.h"

int tally_glob_match(const char *pattern, size_t plen, const char *name, size_t nlen) {
  if (!pattern || !name) return 0;
  size_t p = 0, n = 0, star = (size_t)-1, resume = 0;
  while (n < nlen) {
    if (p < plen && pattern[p] == '*') { /* first: a '*' in the name is a byte */
      star = p++;
      resume = n;
      if (p == plen) return 1; /* a '*' that ends the pattern takes the rest */
    } else if (p < plen && (pattern[p] == '?' || pattern[p] == name[n])) {
      p++;
      n++;
    } else if (star != (size_t)-1) {
      p = star + 1;
      n = ++resume;
    } else {
      return 0;
    }
  }
  while (p < plen && pattern[p] == '*') p++;
  return p == plen;
}
