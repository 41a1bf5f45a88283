/* text.h -- the text rules that the core (exposition.c) and the Lua
 * binding (lua_number.c, lua_exposition.c) both write by, so the
 * exposition that C writes and the one the Lua side writes cannot drift
 * apart. Depends on nothing else.
 *
 * Every float that tally writes for a machine (JSON, line protocol, the
 * Prometheus text, histogram member names) is the shortest of %.15g,
 * %.16g, %.17g that reads back as the same double, with '.' as its
 * decimal point. printf and strtod follow LC_NUMERIC, which a host may
 * have set (setlocale(LC_NUMERIC, "") in nginx modules and readline
 * hosts; Lua's os.setlocale): here the digits come from snprintf and are
 * read back by strtod in one locale, whichever it is, and the locale's
 * decimal point (any bytes that are not a digit, a sign or the exponent's
 * 'e') is then written as '.'.
 */
#ifndef TALLY_TEXT_H
#define TALLY_TEXT_H

#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally.h"

#define TALLY__NUMBER_ROOM 40 /* what tally__number_text needs */

/* x (finite) as text into buf (cap >= TALLY__NUMBER_ROOM bytes); returns
 * its length. */
static inline size_t tally__number_text(double x, char *buf, size_t cap) {
  int n = 0;
  for (int digits = 15; digits <= 17; digits++) {
    n = snprintf(buf, cap, "%.*g", digits, x);
    if (digits == 17 || strtod(buf, NULL) == x) break;
  }
  size_t w = 0, len = n > 0 && (size_t)n < cap ? (size_t)n : 0;
  for (size_t r = 0; r < len;) {
    char c = buf[r];
    if ((c >= '0' && c <= '9') || c == '-' || c == '+' || c == 'e') {
      buf[w++] = buf[r++];
      continue;
    }
    buf[w++] = '.'; /* the decimal point, one or more bytes */
    while (r < len && !((buf[r] >= '0' && buf[r] <= '9') || buf[r] == 'e')) r++;
  }
  return w;
}

/* A Prometheus label value: \ " and newline escaped, as the exposition
 * format asks, into room for twice its length. Returns the bytes written. */
static inline size_t tally__label_value(char *out, const char *s, size_t len) {
  char *o = out;
  for (size_t i = 0; i < len; i++) {
    char c = s[i];
    if (c == '\\' || c == '"' || c == '\n') {
      *o++ = '\\';
      c = c == '\n' ? 'n' : c;
    }
    *o++ = c;
  }
  return (size_t)(o - out);
}

/* s's bytes in lowercase hex, into room for twice its length. */
static inline size_t tally__hex(char *out, const unsigned char *s, size_t len) {
  static const char digit[] = "0123456789abcdef";
  for (size_t i = 0; i < len; i++) {
    out[2 * i] = digit[s[i] >> 4];
    out[2 * i + 1] = digit[s[i] & 15];
  }
  return 2 * len;
}

/* A line's series into out: prefix .. the label value (name escaped) ..
 * '"} ', or hex_prefix .. name's bytes in hex where it is not UTF-8; room
 * for the longer prefix and 2 * len + 3 bytes. Returns the bytes written. */
static inline size_t tally__series(char *out, const char *prefix, size_t plen,
                                   const char *hex_prefix, size_t hlen, const char *name,
                                   size_t len) {
  int utf8 = tally_utf8_len(name, len, NULL) >= 0;
  size_t k = utf8 ? plen : hlen;
  memcpy(out, utf8 ? prefix : hex_prefix, k);
  k += utf8 ? tally__label_value(out + k, name, len)
            : tally__hex(out + k, (const unsigned char *)name, len);
  memcpy(out + k, "\"} ", 3);
  return k + 3;
}

/* The default metric's series up to the name (tally.h's TALLY_PROM_*). */
#define TALLY__PROM_PREFIX     TALLY_PROM_METRIC "{" TALLY_PROM_LABEL "=\""
#define TALLY__PROM_HEX_PREFIX TALLY_PROM_METRIC "{" TALLY_PROM_HEX_LABEL "=\""
/* A line's room past its series: the value (text of at most
 * TALLY__NUMBER_ROOM bytes, or an int64) and the newline. */
#define TALLY__VALUE_ROOM      (TALLY__NUMBER_ROOM + 1)

/* The room the default metric's line of a name of len bytes needs. */
#define TALLY__DEFAULT_LINE_ROOM(len)                                                    \
  (sizeof(TALLY__PROM_HEX_PREFIX) + 2 * (size_t)(len) + 3 + TALLY__VALUE_ROOM)

/* A line's end into out: text (a value the caller wrote: a float) or
 * else value, and the newline. Returns the bytes written. */
static inline size_t tally__line_end(char *out, int64_t value, const char *text,
                                     size_t text_len) {
  size_t k;
  if (text) {
    memcpy(out, text, text_len);
    k = text_len;
  } else {
    k = (size_t)snprintf(out, 21, "%" PRId64, value);
  }
  out[k] = '\n';
  return k + 1;
}

/* The default metric's line of name into out (TALLY__DEFAULT_LINE_ROOM):
 * its series and its end. Returns the bytes written. */
static inline size_t tally__default_line(char *out, const char *name, size_t len,
                                         int64_t value, const char *text,
                                         size_t text_len) {
  static const char prefix[] = TALLY__PROM_PREFIX, hex[] = TALLY__PROM_HEX_PREFIX;
  size_t k =
      tally__series(out, prefix, sizeof prefix - 1, hex, sizeof hex - 1, name, len);
  return k + tally__line_end(out + k, value, text, text_len);
}

#endif
