/* sender.c -- the HTTP sender: a thread that delivers queued bodies with libcurl.
 *
 * tally_sender_post() copies the body onto a list under the sender's mutex
 * and returns; it never touches the network. The sender's thread takes the
 * oldest body off the list, sends it with the mutex released, and on a
 * failure puts it back at the head and sleeps out the backoff before trying
 * it again, so bodies arrive in the order they were posted. Only that
 * thread sends, through the library's HTTP client (http.c), whose handle it
 * keeps for its whole life, so the connection to the sink stays alive
 * between requests; close() cuts a request in flight short through it.
 *
 * The queue bound counts records on the list. The body in flight is off the
 * list, so a post never has to drop a body that is being sent; a failed body
 * that comes back to a full list is the oldest, and is the one dropped.
 * Every wait is a pthread_cond_timedwait on CLOCK_MONOTONIC, so changes of
 * the wall clock neither stall nor hurry retries, flushes and closes.
 */
#include "tally_net.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "http.h"

#define SENDER_TIMEOUT_MS     5000u
#define SENDER_MAX_QUEUE      100000u
#define SENDER_BACKOFF_MS     100u
#define SENDER_MAX_BACKOFF_MS 5000u

struct sender_body {
  struct sender_body *next;
  uint32_t records;
  size_t len;
  char data[];
};

struct tally_sender {
  pthread_mutex_t mu;
  pthread_cond_t wake;    /* to the thread: a body came, or close() */
  pthread_cond_t settled; /* from the thread: idle, or finished */
  pthread_t thread;
  uint32_t max_queue;
  uint32_t backoff_ms, max_backoff_ms;

  /* the thread's own (set up by open, freed by close after the join) */
  tally__http *http;
  char *url;
  const char *method; /* "POST" or "PUT" */

  /* under mu */
  struct sender_body *head, *tail;
  uint64_t waiting; /* records on the list */
  struct sender_body *in_flight;
  int64_t retry_at_ms; /* no request before this (backoff) */
  uint32_t next_backoff_ms;
  bool stopping;
  int64_t stop_at_ms; /* end of close()'s drain */
  bool finished;      /* the thread is about to return */
  uint64_t sent, requests, failures, dropped, rejected;
  int32_t last_status;
  char last_error[256];
};

enum { SEND_OK, SEND_FAILED, SEND_ABORTED };

/* Wait on c until signalled or until deadline_ms (CLOCK_MONOTONIC). */
static void wait_until(pthread_cond_t *c, pthread_mutex_t *mu, int64_t deadline_ms) {
  struct timespec ts;
  ts.tv_sec = (time_t)(deadline_ms / 1000);
  ts.tv_nsec = (long)(deadline_ms % 1000) * 1000000;
  pthread_cond_timedwait(c, mu, &ts);
}

/* ---- the queue (caller holds mu) ---------------------------------------- */

static void drop_oldest(tally_sender *s) {
  struct sender_body *b = s->head;
  s->head = b->next;
  if (!s->head) s->tail = NULL;
  s->waiting -= b->records;
  s->dropped += b->records;
  free(b);
}

static void push_back(tally_sender *s, struct sender_body *b) {
  b->next = NULL;
  if (s->tail)
    s->tail->next = b;
  else
    s->head = b;
  s->tail = b;
  s->waiting += b->records;
}

static void push_front(tally_sender *s, struct sender_body *b) {
  b->next = s->head;
  s->head = b;
  if (!s->tail) s->tail = b;
  s->waiting += b->records;
}

static struct sender_body *pop_front(tally_sender *s) {
  struct sender_body *b = s->head;
  s->head = b->next;
  if (!s->head) s->tail = NULL;
  s->waiting -= b->records;
  return b;
}

/* ---- the thread ----------------------------------------------------------- */

/* One request for b. Returns SEND_*; *status gets the HTTP status (0 when
 * no answer came) and err the failure's text. Runs without mu. */
/* *retry_ms: the answer's Retry-After in ms, or 0 without one. */
static int send_body(tally_sender *s, const struct sender_body *b, int32_t *status,
                     int64_t *retry_ms, char *err, size_t errcap) {
  tally__http_reply r;
  int rc = tally__http_request(s->http, s->method, s->url, b->data, b->len, NULL, &r);
  *status = (int32_t)r.status;
  *retry_ms = r.retry_after_ms;
  if (rc == TALLY_EBUSY) return SEND_ABORTED;
  if (rc) {
    snprintf(err, errcap, "%s", r.error);
    return SEND_FAILED;
  }
  if (r.status >= 300 && r.status <= 399) {
    snprintf(err, errcap,
             "HTTP %ld: redirected to %s (a sink does not follow: give it that url)",
             r.status, r.redirect ? r.redirect : "(no Location)");
    return SEND_FAILED;
  }
  if (r.status < 200 || r.status > 299) {
    snprintf(err, errcap, "HTTP %ld", r.status);
    return SEND_FAILED;
  }
  return SEND_OK;
}

static void *sender_main(void *arg) {
  tally_sender *s = arg;
  char err[sizeof s->last_error];

  pthread_mutex_lock(&s->mu);
  for (;;) {
    int64_t now = tally_monotonic_ms();
    struct sender_body *b;
    int32_t status;
    int64_t retry_ms;
    int result;

    if (s->stopping && (!s->head || now >= s->stop_at_ms)) break;
    if (!s->head) {
      pthread_cond_wait(&s->wake, &s->mu);
      continue;
    }
    if (now < s->retry_at_ms) {
      int64_t until = s->retry_at_ms;
      if (s->stopping && s->stop_at_ms < until) until = s->stop_at_ms;
      wait_until(&s->wake, &s->mu, until);
      continue;
    }

    b = pop_front(s);
    s->in_flight = b;
    pthread_mutex_unlock(&s->mu);
    err[0] = '\0';
    result = send_body(s, b, &status, &retry_ms, err, sizeof err);
    pthread_mutex_lock(&s->mu);
    s->in_flight = NULL;

    if (result == SEND_OK) {
      s->sent += b->records;
      s->requests++;
      s->last_status = status;
      s->next_backoff_ms = s->backoff_ms;
      s->retry_at_ms = 0;
      free(b);
    } else if (result == SEND_ABORTED) {
      s->dropped += b->records;
      free(b);
    } else if (status >= 300 && status < 500 && status != 408 && status != 429) {
      /* the peer refuses this body (bad request, not found, too large), or
       * sends it elsewhere (a sink posts to its url only): sending it again
       * would fail again and hold up everything behind it */
      s->failures++;
      s->rejected += b->records;
      s->dropped += b->records;
      s->last_status = status;
      memcpy(s->last_error, err, sizeof s->last_error);
      free(b);
    } else {
      s->failures++;
      s->last_status = status;
      memcpy(s->last_error, err, sizeof s->last_error);
      push_front(s, b);
      while (s->waiting > s->max_queue) drop_oldest(s); /* posted meanwhile */
      /* a Retry-After (429, 503) is waited, up to the longest backoff */
      int64_t wait = s->next_backoff_ms;
      if (retry_ms > wait)
        wait = retry_ms < s->max_backoff_ms ? retry_ms : s->max_backoff_ms;
      s->retry_at_ms = tally_monotonic_ms() + wait;
      s->next_backoff_ms = s->next_backoff_ms > s->max_backoff_ms / 2
                               ? s->max_backoff_ms
                               : s->next_backoff_ms * 2;
    }
    if (!s->head) pthread_cond_broadcast(&s->settled);
  }
  while (s->head) drop_oldest(s);
  s->finished = true;
  pthread_cond_broadcast(&s->settled);
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

/* ---- the API -------------------------------------------------------------- */

/* "Name: value": a non-empty name, a colon, and no CR or LF that would let
 * a value start another header. */
static bool header_ok(const char *h) {
  const char *colon = strchr(h, ':');
  return colon && colon != h && strpbrk(h, "\r\n") == NULL;
}

static void sender_free(tally_sender *s) {
  struct sender_body *b = s->head;
  while (b) {
    struct sender_body *next = b->next;
    free(b);
    b = next;
  }
  tally__http_close(s->http);
  free(s->url);
  pthread_cond_destroy(&s->settled);
  pthread_cond_destroy(&s->wake);
  pthread_mutex_destroy(&s->mu);
  free(s);
}

int tally_sender_open(const tally_sender_options *o, tally_sender **out) {
  tally_sender *s;
  pthread_condattr_t ca;
  sigset_t all, old;
  bool put;
  int rc;

  if (!o || !out)
    return tally_error_set(TALLY_EINVAL, "sender: options and out must not be NULL");
  if (!o->url) return tally_error_set(TALLY_EINVAL, "sender: url is required");
  if (strncasecmp(o->url, "http://", 7) != 0 && strncasecmp(o->url, "https://", 8) != 0)
    return tally_error_set(
        TALLY_EINVAL, "sender: url must start with http:// or https://, got '%.200s'",
        o->url);
  if (!o->method || strcmp(o->method, "POST") == 0)
    put = false;
  else if (strcmp(o->method, "PUT") == 0)
    put = true;
  else
    return tally_error_set(TALLY_EINVAL,
                           "sender: method must be POST or PUT, got '%.32s'", o->method);
  if (o->headers) {
    for (const char *const *h = o->headers; *h; h++)
      if (!header_ok(*h))
        return tally_error_set(
            TALLY_EINVAL, "sender: header '%.100s' is not \"Name: value\" on one line",
            *h);
  }

  s = calloc(1, sizeof *s);
  if (!s) return tally_error_set(TALLY_ENOMEM, "sender: out of memory");
  pthread_mutex_init(&s->mu, NULL);
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&s->wake, &ca);
  pthread_cond_init(&s->settled, &ca);
  pthread_condattr_destroy(&ca);
  s->max_queue = o->max_queue ? o->max_queue : SENDER_MAX_QUEUE;
  s->max_backoff_ms = o->max_backoff_ms ? o->max_backoff_ms : SENDER_MAX_BACKOFF_MS;
  s->backoff_ms = o->backoff_ms ? o->backoff_ms : SENDER_BACKOFF_MS;
  if (s->backoff_ms > s->max_backoff_ms) s->backoff_ms = s->max_backoff_ms;
  s->next_backoff_ms = s->backoff_ms;
  s->method = put ? "PUT" : "POST";

  s->url = strdup(o->url);
  if (!s->url) {
    sender_free(s);
    return tally_error_set(TALLY_ENOMEM, "sender: out of memory");
  }
  rc = tally__http_open(o->timeout_ms ? o->timeout_ms : SENDER_TIMEOUT_MS, o->headers, 0,
                        &s->http);
  if (rc < 0) {
    sender_free(s);
    return rc;
  }

  /* The thread blocks every signal, so the host's handlers run in its own
   * threads only. */
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  rc = pthread_create(&s->thread, NULL, sender_main, s);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (rc != 0) {
    sender_free(s);
    return tally_error_set(TALLY_ESYS, "sender: pthread_create: %s", strerror(rc));
  }
  *out = s;
  return 0;
}

int tally_sender_post(tally_sender *s, const void *body, size_t len, uint32_t records) {
  struct sender_body *b;

  if (!s) return tally_error_set(TALLY_EINVAL, "sender: NULL sender");
  if (!body && len > 0)
    return tally_error_set(TALLY_EINVAL, "sender: NULL body of %zu bytes", len);
  if (records == 0)
    return tally_error_set(TALLY_EINVAL, "sender: records must be at least 1");
  if (records > s->max_queue) { /* could never fit: dropped at once */
    pthread_mutex_lock(&s->mu);
    s->dropped += records;
    pthread_mutex_unlock(&s->mu);
    return 0;
  }
  if (len > SIZE_MAX - sizeof *b)
    return tally_error_set(TALLY_ENOMEM, "sender: body of %zu bytes", len);
  b = malloc(sizeof *b + len);
  if (!b)
    return tally_error_set(TALLY_ENOMEM, "sender: no memory for a body of %zu bytes",
                           len);
  b->records = records;
  b->len = len;
  if (len) memcpy(b->data, body, len);

  pthread_mutex_lock(&s->mu);
  while (s->waiting + records > s->max_queue) drop_oldest(s);
  push_back(s, b);
  pthread_cond_signal(&s->wake);
  pthread_mutex_unlock(&s->mu);
  return 0;
}

int tally_sender_flush(tally_sender *s, uint32_t timeout_ms) {
  int64_t deadline;

  if (!s) return tally_error_set(TALLY_EINVAL, "sender: NULL sender");
  deadline = tally_monotonic_ms() + timeout_ms;
  pthread_mutex_lock(&s->mu);
  while (s->head || s->in_flight) {
    if (tally_monotonic_ms() >= deadline) {
      uint64_t left = s->waiting + (s->in_flight ? s->in_flight->records : 0);
      pthread_mutex_unlock(&s->mu);
      return tally_error_set(TALLY_ETIMEDOUT,
                             "sender: %llu records still queued after %u ms",
                             (unsigned long long)left, timeout_ms);
    }
    wait_until(&s->settled, &s->mu, deadline);
  }
  pthread_mutex_unlock(&s->mu);
  return 0;
}

void tally_sender_stats_get(tally_sender *s, tally_sender_stats *out) {
  if (!out) return;
  memset(out, 0, sizeof *out);
  if (!s) return;
  pthread_mutex_lock(&s->mu);
  out->sent = s->sent;
  out->requests = s->requests;
  out->failures = s->failures;
  out->dropped = s->dropped;
  out->rejected = s->rejected;
  out->queued = s->waiting + (s->in_flight ? s->in_flight->records : 0);
  out->last_status = s->last_status;
  memcpy(out->last_error, s->last_error, sizeof out->last_error);
  pthread_mutex_unlock(&s->mu);
}

void tally_sender_close(tally_sender *s, uint32_t drain_ms) {
  if (!s) return;
  pthread_mutex_lock(&s->mu);
  s->stopping = true;
  s->stop_at_ms = tally_monotonic_ms() + drain_ms;
  pthread_cond_signal(&s->wake);
  while (!s->finished) {
    if (tally_monotonic_ms() < s->stop_at_ms) {
      wait_until(&s->settled, &s->mu, s->stop_at_ms);
      continue;
    }
    /* Drain time is over: cut the request in flight short. */
    tally__http_abort(s->http);
    pthread_cond_wait(&s->settled, &s->mu);
  }
  pthread_mutex_unlock(&s->mu);
  pthread_join(s->thread, NULL);
  sender_free(s);
}
