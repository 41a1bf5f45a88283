/* error.c -- error codes, their names and texts, and the per-thread detail.
 *
 * Every failure path calls tally__fail(), which formats a detailed message
 * into a thread-local buffer and returns the code, so callers can write
 * `return tally__fail(TALLY_ECORRUPT, "%s: ...", path)`. tally_errmsg()
 * reads the buffer back; like dlerror(), it belongs to the calling thread.
 *
 * Messages name counters, and a name is any bytes but NUL: one with a
 * newline or an escape sequence would forge a line in a log, or drive the
 * terminal that prints it. So messages go through tally_printable.
 */
#include "internal.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static _Thread_local char last_message[512];

const char *tally_strerror(int code) {
  switch (code) {
#define XX(name, num, msg)                                                               \
  case num: return msg;
    TALLY_ERRNO_MAP(XX)
#undef XX
  case 0: return "success";
  default: return "unknown error";
  }
}

const char *tally_err_name(int code) {
  switch (code) {
#define XX(name, num, msg)                                                               \
  case num: return #name;
    TALLY_ERRNO_MAP(XX)
#undef XX
  case 0: return "OK";
  default: return "UNKNOWN";
  }
}

const char *tally_errmsg(void) {
  return last_message[0] ? last_message : "no error";
}

/* Length of the valid UTF-8 sequence at s (n bytes left), or 0. */
static size_t utf8_seq(const unsigned char *s, size_t n) {
  size_t len = s[0] >= 0xF0 ? 4 : s[0] >= 0xE0 ? 3 : 2;
  if (s[0] < 0xC2 || s[0] > 0xF4 || len > n) return 0;
  for (size_t i = 1; i < len; i++)
    if ((s[i] & 0xC0) != 0x80) return 0;
  /* no overlong 3- and 4-byte forms, no surrogates, nothing past U+10FFFF */
  if ((s[0] == 0xE0 && s[1] < 0xA0) || (s[0] == 0xED && s[1] > 0x9F) ||
      (s[0] == 0xF0 && s[1] < 0x90) || (s[0] == 0xF4 && s[1] > 0x8F))
    return 0;
  return len;
}

int64_t tally_utf8_len(const char *text, size_t len, size_t *bad) {
  const unsigned char *s = (const unsigned char *)text;
  int64_t chars = 0;
  for (size_t i = 0; i < len; chars++) {
    size_t n = s[i] < 0x80 ? 1 : utf8_seq(s + i, len - i);
    if (n == 0) {
      if (bad) *bad = i;
      return -1;
    }
    i += n;
  }
  return chars;
}

size_t tally_printable(char *out, size_t cap, const char *text, size_t len) {
  const unsigned char *s = (const unsigned char *)text;
  size_t o = 0, need = 0;
  for (size_t i = 0; i < len;) {
    size_t n = s[i] < 0x80 ? 1 : utf8_seq(s + i, len - i);
    /* C1 controls (U+0080 to U+009F) drive terminals as C0 ones do */
    bool plain = (n > 1 && !(s[i] == 0xC2 && s[i + 1] < 0xA0)) ||
                 (n == 1 && s[i] >= 0x20 && s[i] != 0x7f);
    size_t w = plain ? n : 4;
    if (cap && o == need && o + w < cap) { /* all so far fitted, and this does */
      if (plain)
        memcpy(out + o, s + i, n);
      else
        snprintf(out + o, 5, "\\x%02x", s[i]);
      o += w;
    }
    need += w;
    i += plain ? n : 1;
  }
  if (cap) out[o] = 0;
  return need;
}

/* Append n bytes of s to out (cap bytes) at *o, as far as they fit. */
static void put(char *out, size_t cap, size_t *o, const char *s, size_t n) {
  if (cap && *o < cap - 1) memcpy(out + *o, s, *o + n < cap - 1 ? n : cap - 1 - *o);
  *o += n;
}

/* text with its authority from rest on (rest NULL: none, text as it is):
 * the userinfo as ***@, the query as ?***, all of it as *** with an '@'
 * after the '?'. */
static size_t redact_from(char *out, size_t cap, const char *uri, size_t len,
                          const char *rest) {
  const char *end = uri + len, *q, *at = NULL, *late = NULL;
  size_t o = 0;
  if (!rest) {
    put(out, cap, &o, uri, len);
  } else {
    q = memchr(rest, '?', (size_t)(end - rest));
    for (const char *p = rest; p < end; p++)
      if (*p == '@') *(q && p > q ? &late : &at) = p;
    put(out, cap, &o, uri, (size_t)(rest - uri));
    if (late) { /* a password with a '?' or a query value with an '@' */
      put(out, cap, &o, "***", 3);
    } else {
      if (at) put(out, cap, &o, "***@", 4);
      const char *h = at ? at + 1 : rest;
      put(out, cap, &o, h, (size_t)((q ? q : end) - h));
    }
    if (q) put(out, cap, &o, "?***", 4);
  }
  if (cap) out[o < cap ? o : cap - 1] = 0;
  return o;
}

/* Where the authority of a URI starts (after its "://"), or NULL. */
static const char *authority(const char *uri, size_t len) {
  for (const char *p = uri; p + 3 <= uri + len; p++)
    if (memcmp(p, "://", 3) == 0) return p + 3;
  return NULL;
}

size_t tally_uri_redact(char *out, size_t cap, const char *uri, size_t len) {
  return redact_from(out, cap, uri, len, authority(uri, len));
}

size_t tally__spec_redact(char *out, size_t cap, const char *spec, size_t len) {
  const char *rest = authority(spec, len);
  return redact_from(out, cap, spec, len, rest ? rest : spec);
}

static int set_message(int code, const char *fmt, va_list ap) {
  char raw[sizeof last_message];
  vsnprintf(raw, sizeof raw, fmt, ap);
  (void)tally_printable(last_message, sizeof last_message, raw, strlen(raw));
  return code;
}

int tally__fail(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  set_message(code, fmt, ap);
  va_end(ap);
  return code;
}

int tally_error_set(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  set_message(code, fmt, ap);
  va_end(ap);
  return code;
}

/* For a failed system call: "<path>: <what>: <strerror(errno)>". */
int tally__fail_sys(const char *what, const char *path) {
  int saved = errno;
  char buf[128];
  const char *text = strerror_r(saved, buf, sizeof buf); /* GNU variant */
  if (path)
    tally__fail(TALLY_ESYS, "%s: %s: %s", path, what, text);
  else
    tally__fail(TALLY_ESYS, "%s: %s", what, text);
  errno = saved;
  return TALLY_ESYS;
}
