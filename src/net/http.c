/* http.c -- tally's one HTTP client: a libcurl easy handle kept for its
 * connection, run inside a multi handle only so that another thread can
 * cut a request short at once (curl_multi_wakeup() interrupts
 * curl_multi_poll(); a progress callback would notice about once a
 * second). */
#include "http.h"

#include <curl/curl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally.h"

struct tally__http {
  CURL *easy;
  CURLM *multi;
  struct curl_slist *headers; /* the handle's own, every request */
  size_t keep_max;
  char *buf; /* the reply being kept */
  size_t len, cap;
  bool overflow, nomem;
  atomic_bool aborted;
  char error[CURL_ERROR_SIZE];
};

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static CURLcode curl_init_result;

/* curl_global_init is not thread-safe in every libcurl, and must run once. */
static void curl_init_once(void) {
  curl_init_result = curl_global_init(CURL_GLOBAL_DEFAULT);
}

static size_t on_data(char *data, size_t size, size_t n, void *ud) {
  tally__http *h = ud;
  size_t add = size * n;
  if (h->keep_max == 0) return add; /* read and dropped */
  if (add > h->keep_max - h->len) {
    h->overflow = true;
    return 0; /* libcurl stops: CURLE_WRITE_ERROR */
  }
  if (h->len + add + 1 > h->cap) {
    size_t cap = h->cap ? h->cap : 4096;
    while (cap < h->len + add + 1) cap *= 2;
    char *p = realloc(h->buf, cap);
    if (p == NULL) {
      h->nomem = true;
      return 0;
    }
    h->buf = p;
    h->cap = cap;
  }
  memcpy(h->buf + h->len, data, add);
  h->len += add;
  h->buf[h->len] = '\0';
  return add;
}

/* list with each line of lines (NULL-terminated) appended; NULL when out
 * of memory (list freed). */
static struct curl_slist *append_lines(struct curl_slist *list,
                                       const char *const *lines) {
  for (const char *const *l = lines; l && *l; l++) {
    struct curl_slist *more = curl_slist_append(list, *l);
    if (more == NULL) {
      curl_slist_free_all(list);
      return NULL;
    }
    list = more;
  }
  return list;
}

void tally__http_close(tally__http *h) {
  if (h == NULL) return;
  if (h->multi) curl_multi_cleanup(h->multi);
  if (h->easy) curl_easy_cleanup(h->easy);
  curl_slist_free_all(h->headers);
  free(h->buf);
  free(h);
}

int tally__http_open(uint32_t timeout_ms, const char *const *headers, size_t keep_max,
                     tally__http **out) {
  *out = NULL;
  pthread_once(&curl_once, curl_init_once);
  if (curl_init_result != CURLE_OK)
    return tally_error_set(TALLY_ESYS, "http: curl_global_init: %s",
                           curl_easy_strerror(curl_init_result));
  tally__http *h = calloc(1, sizeof *h);
  if (h == NULL) return tally_error_set(TALLY_ENOMEM, "http: out of memory");
  atomic_init(&h->aborted, false);
  h->keep_max = keep_max;
  if (headers && headers[0] && (h->headers = append_lines(NULL, headers)) == NULL) {
    tally__http_close(h);
    return tally_error_set(TALLY_ENOMEM, "http: out of memory");
  }
  h->easy = curl_easy_init();
  h->multi = curl_multi_init();
  if (!h->easy || !h->multi) {
    tally__http_close(h);
    return tally_error_set(TALLY_ENOMEM, "http: cannot create curl handles");
  }
  long t = timeout_ms == 0 ? 1 : timeout_ms > INT32_MAX ? INT32_MAX : (long)timeout_ms;
  CURLcode cc = curl_easy_setopt(h->easy, CURLOPT_NOSIGNAL, 1L);
  if (!cc) cc = curl_easy_setopt(h->easy, CURLOPT_WRITEFUNCTION, on_data);
  if (!cc) cc = curl_easy_setopt(h->easy, CURLOPT_WRITEDATA, h);
  if (!cc) cc = curl_easy_setopt(h->easy, CURLOPT_ERRORBUFFER, h->error);
  if (!cc) cc = curl_easy_setopt(h->easy, CURLOPT_TIMEOUT_MS, t);
  if (!cc) cc = curl_easy_setopt(h->easy, CURLOPT_CONNECTTIMEOUT_MS, t);
  if (!cc) cc = curl_easy_setopt(h->easy, CURLOPT_TCP_NODELAY, 1L);
  if (!cc) cc = curl_easy_setopt(h->easy, CURLOPT_TCP_KEEPALIVE, 1L);
  if (cc != CURLE_OK) {
    tally__http_close(h);
    return tally_error_set(cc == CURLE_OUT_OF_MEMORY ? TALLY_ENOMEM : TALLY_ESYS,
                           "http: curl: %s", curl_easy_strerror(cc));
  }
  *out = h;
  return 0;
}

void tally__http_abort(tally__http *h) {
  atomic_store(&h->aborted, true);
  curl_multi_wakeup(h->multi);
}

/* The code of a failed transfer. */
static int failure_code(CURLcode cc) {
  switch (cc) {
  case CURLE_OPERATION_TIMEDOUT: return TALLY_ETIMEDOUT;
  case CURLE_COULDNT_CONNECT:
  case CURLE_COULDNT_RESOLVE_HOST:
  case CURLE_COULDNT_RESOLVE_PROXY: return TALLY_ECONNECT;
  case CURLE_OUT_OF_MEMORY: return TALLY_ENOMEM;
  default: return TALLY_EREMOTE;
  }
}

int tally__http_request(tally__http *h, const char *method, const char *url,
                        const void *body, size_t len, const char *const *extra,
                        tally__http_reply *r) {
  struct curl_slist *list = NULL;
  memset(r, 0, sizeof *r);
  r->body = "";
  r->error = h->error;
  h->error[0] = '\0';
  h->len = 0;
  h->overflow = h->nomem = false;
  if (atomic_load(&h->aborted)) {
    snprintf(h->error, sizeof h->error, "request cut short: the client is closing");
    return TALLY_EBUSY;
  }
  if (extra && extra[0]) { /* the handle's headers, then these */
    bool ok = true;
    for (struct curl_slist *p = h->headers; p && ok; p = p->next) {
      struct curl_slist *more = curl_slist_append(list, p->data);
      if (more)
        list = more;
      else
        ok = false;
    }
    if (!ok) curl_slist_free_all(list);
    if (!ok || (list = append_lines(list, extra)) == NULL) {
      snprintf(h->error, sizeof h->error, "out of memory");
      return TALLY_ENOMEM;
    }
  }
  curl_easy_setopt(h->easy, CURLOPT_URL, url);
  curl_easy_setopt(h->easy, CURLOPT_HTTPHEADER, list ? list : h->headers);
  if (strcmp(method, "GET") == 0) {
    curl_easy_setopt(h->easy, CURLOPT_CUSTOMREQUEST, NULL);
    curl_easy_setopt(h->easy, CURLOPT_HTTPGET, 1L);
  } else {
    curl_easy_setopt(h->easy, CURLOPT_CUSTOMREQUEST, method);
    curl_easy_setopt(h->easy, CURLOPT_POSTFIELDS, body ? (const char *)body : "");
    curl_easy_setopt(h->easy, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)(body ? len : 0));
  }

  CURLMcode mc = curl_multi_add_handle(h->multi, h->easy);
  CURLcode cc = CURLE_OK;
  bool done = false;
  while (mc == CURLM_OK && !done && !atomic_load(&h->aborted)) {
    int running = 0, left = 0;
    CURLMsg *msg;
    mc = curl_multi_perform(h->multi, &running);
    if (mc != CURLM_OK) break;
    while ((msg = curl_multi_info_read(h->multi, &left)) != NULL) {
      if (msg->msg == CURLMSG_DONE) {
        done = true;
        cc = msg->data.result;
      }
    }
    if (done || running == 0) break;
    mc = curl_multi_poll(h->multi, NULL, 0, 1000, NULL);
  }
  curl_multi_remove_handle(h->multi, h->easy); /* keeps the connection */
  curl_easy_setopt(h->easy, CURLOPT_HTTPHEADER, NULL);
  curl_slist_free_all(list);

  if (!done && atomic_load(&h->aborted)) {
    snprintf(h->error, sizeof h->error, "request cut short: the client is closing");
    return TALLY_EBUSY;
  }
  if (!done) {
    snprintf(h->error, sizeof h->error, "%s",
             mc != CURLM_OK ? curl_multi_strerror(mc) : "transfer did not finish");
    return TALLY_EREMOTE;
  }
  if (cc != CURLE_OK) {
    if (h->overflow)
      snprintf(h->error, sizeof h->error, "reply larger than %zu MiB", h->keep_max >> 20);
    else if (h->nomem)
      snprintf(h->error, sizeof h->error, "out of memory for the reply");
    else if (h->error[0] == '\0')
      snprintf(h->error, sizeof h->error, "%s", curl_easy_strerror(cc));
    return h->overflow ? TALLY_EREMOTE : h->nomem ? TALLY_ENOMEM : failure_code(cc);
  }
  curl_easy_getinfo(h->easy, CURLINFO_RESPONSE_CODE, &r->status);
  if (r->status >= 300 && r->status <= 399) {
    char *to = NULL;
    curl_easy_getinfo(h->easy, CURLINFO_REDIRECT_URL, &to);
    r->redirect = to;
  }
  if (r->status < 200 || r->status > 299) {
    curl_off_t after = 0; /* seconds; a date is read as 0 by curl's older versions */
    if (curl_easy_getinfo(h->easy, CURLINFO_RETRY_AFTER, &after) == CURLE_OK && after > 0)
      r->retry_after_ms = after > INT64_MAX / 1000 ? INT64_MAX : (int64_t)after * 1000;
  }
  if (h->buf) r->body = h->buf;
  if (h->buf && h->len == 0) h->buf[0] = '\0';
  r->len = h->len;
  return 0;
}
