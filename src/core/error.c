/* error.c -- error codes, their names and texts, and the per-thread detail.
 *
 * Every failure path calls tally__fail(), which formats a detailed message
 * into a thread-local buffer and returns the code, so callers can write
 * `return tally__fail(TALLY_ECORRUPT, "%s: ...", path)`. tally_errmsg()
 * reads the buffer back; like dlerror(), it belongs to the calling thread.
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

static int set_message(int code, const char *fmt, va_list ap) {
  vsnprintf(last_message, sizeof last_message, fmt, ap);
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
