/* http.h -- tally's one HTTP client (library-private): a connection to a
 * server on libcurl, kept alive between requests, that sends one request
 * at a time and waits for its answer. The sender's thread (sender.c, the
 * rollup sinks) and the Lua http handle (lua_http.c, the Firestore REST
 * API) both send through it, so timeouts, headers, the failure codes and
 * cutting a request short are one set of rules.
 *
 * A handle is used by one thread at a time; tally__http_abort alone may
 * be called from another (the sender's close). */
#ifndef TALLY_NET_HTTP_H
#define TALLY_NET_HTTP_H

#include <stddef.h>
#include <stdint.h>

typedef struct tally__http tally__http;

/* What a request got. Pointers are the handle's own, valid until its next
 * request or its close. */
typedef struct tally__http_reply {
  long status;            /* the HTTP status; 0 when no answer came */
  int64_t retry_after_ms; /* the answer's Retry-After, 0 without one */
  const char *redirect;   /* a 3xx answer's Location, or NULL */
  const char *body;       /* the answer's body (NUL-terminated; "" when not kept) */
  size_t len;
  const char *error; /* a failure's text ("" when an answer came) */
} tally__http_reply;

/* A handle whose requests each get timeout_ms (> 0) to connect and to be
 * answered, send the "Name: value" lines of headers (NULL-terminated, or
 * NULL) and keep replies of up to keep_max bytes (0: replies are read and
 * dropped; a longer one fails its request). 0 or TALLY_ENOMEM. */
int tally__http_open(uint32_t timeout_ms, const char *const *headers, size_t keep_max,
                     tally__http **out);
void tally__http_close(tally__http *h); /* NULL is ignored */

/* Send method (GET, POST, PUT, ...) to url with body (len bytes; NULL: no
 * body, and an empty one for a method other than GET) and the handle's
 * headers, then extra's (NULL-terminated, or NULL), and wait for the
 * answer. 0 when an answer came, whatever its status; otherwise
 * TALLY_ETIMEDOUT (none in time), TALLY_ECONNECT (no connection: refused,
 * unreachable, a name that does not resolve), TALLY_EBUSY (cut short by
 * tally__http_abort), TALLY_ENOMEM, or TALLY_EREMOTE (anything else
 * libcurl reports, a reply past keep_max among them), with r->error
 * saying what. */
int tally__http_request(tally__http *h, const char *method, const char *url,
                        const void *body, size_t len, const char *const *extra,
                        tally__http_reply *r);

/* Cut the request in flight short, from any thread: it returns
 * TALLY_EBUSY at once, and so does every later one. */
void tally__http_abort(tally__http *h);

#endif
