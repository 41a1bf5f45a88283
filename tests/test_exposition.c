/* test_exposition.c -- tally_prometheus and tally_exposition_*: the
 * Prometheus text of a store's counters, written as the walk reads them.
 *
 * A few names that need escapes, hex or a float must come out exactly as
 * the exposition format writes them. Over 100,000 counters the text,
 * made in small steps while another thread creates, drops and increments
 * counters outside the pattern and a name inside it is dropped and made
 * again between two slices, must be the one tally_prometheus writes at
 * once, in name order, each name once, with the values tally_store_values
 * reads; a writer that stops ends it with its value; a realloc that fails
 * fails that call and every later one; rows a host maps itself are
 * listed, left out and handed over as samples.
 */
#include "testutil.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define N 100000

/* The library's realloc (linked with --wrap=realloc): the fail_in-th call
 * from now fails (0: none). */
void *__real_realloc(void *p, size_t n);
static atomic_int fail_in;
void *__wrap_realloc(void *p, size_t n) {
  if (atomic_load(&fail_in) > 0 && atomic_fetch_sub(&fail_in, 1) == 1) return NULL;
  return __real_realloc(p, n);
}

struct text {
  char *p;
  size_t n, cap;
  int calls, stop_at; /* the write that returns 7 (1-based), 0: never */
};

static int text_write(void *ud, const char *s, size_t len) {
  struct text *t = (struct text *)ud;
  t->calls++;
  if (t->n + len + 1 > t->cap) {
    t->cap = (t->n + len + 1) * 2;
    t->p = realloc(t->p, t->cap);
    if (!t->p) abort();
  }
  memcpy(t->p + t->n, s, len);
  t->n += len;
  t->p[t->n] = 0;
  return t->stop_at && t->calls == t->stop_at ? 7 : 0;
}

#define HEAD                                                                             \
  "# HELP tally_value " TALLY_PROM_HELP "\n"                                             \
  "# TYPE tally_value gauge\n"

static void test_lines(tally_store *s) {
  static const char *names[] = {"b",           "a",         "a:b",  "q\"uote",
                                "back\\slash", "new\nline", "x\xff"};
  for (int i = 0; i < 7; i++)
    EXPECT_OK(
        tally_store_incr(s, names[i], strlen(names[i]), i + 1, TALLY_COUNTER_CREATE));
  tally_counter *c;
  REQUIRE_OK(tu_counter(s, "huge", 3, TALLY_POLICY_THREAD, TALLY_COUNTER_CREATE, &c));
  for (uint32_t i = 0; i < 3; i++)
    EXPECT_OK(tally_counter_incr_shard(c, i, ((int64_t)1 << 62) - 1));
  tally_counter_close(c);
  REQUIRE_OK(tu_counter(s, "low", 2, TALLY_POLICY_THREAD, TALLY_COUNTER_CREATE, &c));
  EXPECT_OK(tally_counter_incr_shard(c, 0, -((int64_t)1 << 62)));
  EXPECT_OK(tally_counter_incr_shard(c, 1, -((int64_t)1 << 62)));
  tally_counter_close(c);

  struct text t = {0};
  EXPECT_OK(tally_prometheus(s, NULL, 0, text_write, &t));
  EXPECT_STR(HEAD "tally_value{counter=\"a\"} 2\n"
                  "tally_value{counter=\"a:b\"} 3\n"
                  "tally_value{counter=\"b\"} 1\n"
                  "tally_value{counter=\"back\\\\slash\"} 5\n"
                  "tally_value{counter=\"huge\"} 1.3835058055282164e+19\n"
                  "tally_value{counter=\"low\"} -9223372036854775808\n"
                  "tally_value{counter=\"new\\nline\"} 6\n"
                  "tally_value{counter=\"q\\\"uote\"} 4\n"
                  "tally_value{counter_hex=\"78ff\"} 7\n",
             t.p);
  EXPECT(t.calls == 1);

  t.n = 0, t.calls = 0;
  EXPECT_OK(tally_prometheus(s, "a*", 2, text_write, &t));
  EXPECT_STR(HEAD "tally_value{counter=\"a\"} 2\ntally_value{counter=\"a:b\"} 3\n", t.p);
  t.n = 0, t.calls = 0;
  EXPECT_OK(tally_prometheus(s, "nothing*", 8, text_write, &t));
  EXPECT(t.n == 0 && t.calls == 0);

  EXPECT_RC(TALLY_EINVAL, tally_prometheus(NULL, NULL, 0, text_write, &t));
  EXPECT_RC(TALLY_EINVAL, tally_prometheus(s, NULL, 0, NULL, &t));
  tally_exposition *x;
  EXPECT_RC(TALLY_EINVAL, tally_exposition_open(s, NULL, 0, NULL));
  REQUIRE_OK(tally_exposition_open(s, NULL, 0, &x));
  EXPECT_RC(TALLY_EINVAL, tally_exposition_read(x, 0));
  EXPECT_RC(1, tally_exposition_read(x, UINT64_MAX));
  EXPECT_RC(TALLY_EINVAL, tally_exposition_leave_out(x, 9));
  EXPECT_RC(TALLY_EINVAL, tally_exposition_write(x, 1, NULL, NULL));
  tally_exposition_close(x);
  tally_exposition_close(NULL);
  for (int i = 0; i < 7; i++) EXPECT_OK(tally_store_drop(s, names[i], strlen(names[i])));
  EXPECT_OK(tally_store_drop(s, "huge", 4));
  EXPECT_OK(tally_store_drop(s, "low", 3));
  free(t.p);
}

/* The text of "n:*" as tally_store_values reads it, sorted by name. */
struct want {
  char (*name)[16];
  int64_t *value;
  size_t n;
};

static int want_add(void *ud, const char *name, size_t len, int64_t value) {
  struct want *w = (struct want *)ud;
  if (len >= 16 || w->n == N) abort();
  memcpy(w->name[w->n], name, len);
  w->name[w->n][len] = 0;
  w->value[w->n++] = value;
  return 0;
}

static struct want *sorting;
static int by_name(const void *a, const void *b) {
  size_t i = *(const size_t *)a, j = *(const size_t *)b;
  return strcmp(sorting->name[i], sorting->name[j]);
}

struct churn {
  tally_store *s;
  atomic_int stop;
  atomic_int rounds;
};

/* Creates, increments and drops counters outside "n:*". */
static void *churn_main(void *ud) {
  struct churn *ch = (struct churn *)ud;
  char name[32];
  for (uint64_t i = 0; !atomic_load(&ch->stop); i++) {
    int len = snprintf(name, sizeof name, "z:%llu", (unsigned long long)(i % 5000));
    tally_store_incr(ch->s, name, (size_t)len, 1, TALLY_COUNTER_CREATE);
    if (i % 3 == 0) tally_store_drop(ch->s, name, (size_t)len);
    tally_store_incr(ch->s, "m:hot", 5, 1, TALLY_COUNTER_CREATE);
    atomic_fetch_add(&ch->rounds, 1);
  }
  return NULL;
}

static int sample_add(void *ud, const char *name, size_t len, int64_t value,
                      const char *text, size_t text_len);

static void test_many(tally_store *s) {
  char name[32];
  for (int i = 0; i < N; i++) {
    int len = snprintf(name, sizeof name, "n:%d", i);
    EXPECT_OK(tally_store_incr(s, name, (size_t)len, i, TALLY_COUNTER_CREATE));
  }
  struct want w = {malloc(N * sizeof *w.name), malloc(N * sizeof *w.value), 0};
  size_t *order = malloc(N * sizeof *order);
  if (!w.name || !w.value || !order) abort();
  EXPECT_OK(tally_store_values(s, "n:*", 3, want_add, &w));
  EXPECT(w.n == N);
  for (size_t i = 0; i < w.n; i++) order[i] = i;
  sorting = &w;
  qsort(order, w.n, sizeof *order, by_name);
  struct text want = {0};
  text_write(&want, HEAD, sizeof HEAD - 1);
  for (size_t k = 0; k < w.n; k++) {
    size_t i = order[k];
    char line[64];
    int len = snprintf(line, sizeof line, "tally_value{counter=\"%s\"} %lld\n", w.name[i],
                       (long long)w.value[i]);
    text_write(&want, line, (size_t)len);
  }

  struct text whole = {0};
  EXPECT_OK(tally_prometheus(s, "n:*", 3, text_write, &whole));
  EXPECT(whole.calls > 50); /* in pieces of about a thousand lines */
  EXPECT(whole.n == want.n && memcmp(whole.p, want.p, want.n) == 0);

  struct churn ch = {s, 0, 0};
  pthread_t th;
  pthread_create(&th, NULL, churn_main, &ch);
  for (int round = 0; round < 3; round++) {
    tally_exposition *x;
    REQUIRE_OK(tally_exposition_open(s, "n:*", 3, &x));
    int rc, slices = 0;
    while ((rc = tally_exposition_read(x, 97 + (uint64_t)round * 1000)) == 0) {
      /* n:5 dropped and made again with its value: not lost */
      if (++slices == 5) {
        EXPECT_OK(tally_store_drop(s, "n:5", 3));
        EXPECT_OK(tally_store_incr(s, "n:5", 3, 5, TALLY_COUNTER_CREATE));
      }
    }
    EXPECT_RC(1, rc);
    EXPECT(slices > 10);
    uint64_t read, kept;
    tally_exposition_count(x, &read, &kept);
    EXPECT(read >= N && kept == read);
    struct text steps = {0};
    while ((rc = tally_exposition_write(x, 33, text_write, &steps)) == 0) continue;
    EXPECT_RC(1, rc);
    EXPECT_RC(1, tally_exposition_write(x, 33, text_write, &steps)); /* nothing more */
    tally_exposition_close(x);
    EXPECT(steps.n == want.n && memcmp(steps.p, want.p, want.n) == 0);
    free(steps.p);
  }
  atomic_store(&ch.stop, 1);
  pthread_join(th, NULL);
  EXPECT(atomic_load(&ch.rounds) > 0);

  /* a writer that stops ends it with its value, whole or in steps */
  struct text stopped = {0};
  stopped.stop_at = 2;
  EXPECT_RC(7, tally_prometheus(s, "n:*", 3, text_write, &stopped));
  EXPECT(stopped.calls == 2);
  tally_exposition *x;
  REQUIRE_OK(tally_exposition_open(s, "n:*", 3, &x));
  EXPECT_RC(1, tally_exposition_read(x, UINT64_MAX));
  stopped.calls = 0, stopped.stop_at = 1;
  EXPECT_RC(7, tally_exposition_write(x, 10, text_write, &stopped));
  tally_exposition_close(x);

  /* out of memory: that call fails, and every later one but close */
  for (int at = 0; at < 2; at++) {
    REQUIRE_OK(tally_exposition_open(s, "n:*", 3, &x));
    int rc = 0;
    if (at == 0) {
      atomic_store(&fail_in, 3); /* in the reading, which grows its rows */
      while ((rc = tally_exposition_read(x, 5000)) == 0) continue;
    } else {
      EXPECT_RC(1, tally_exposition_read(x, UINT64_MAX));
      atomic_store(&fail_in, 1); /* the text's memory */
      rc = tally_exposition_write(x, N, text_write, &stopped);
    }
    atomic_store(&fail_in, 0);
    EXPECT_RC(TALLY_ENOMEM, rc);
    EXPECT_RC(TALLY_ENOMEM, tally_exposition_read(x, 5000));
    EXPECT(strstr(tally_errmsg(), "failed before") != NULL);
    EXPECT_RC(TALLY_ENOMEM, tally_exposition_write(x, 10, text_write, &stopped));
    EXPECT_RC(TALLY_ENOMEM, tally_exposition_rows(x, 10, sample_add, &stopped));
    tally_exposition_close(x);
  }

  free(stopped.p);
  free(want.p);
  free(whole.p);
  free(order);
  free(w.name);
  free(w.value);
}

struct braced {
  uint64_t row[8];
  char name[8][32];
  int n;
};

static int braced_add(void *ud, uint64_t row, const char *name, size_t len) {
  struct braced *b = (struct braced *)ud;
  if (b->n == 8 || len >= 32) return 9;
  b->row[b->n] = row;
  memcpy(b->name[b->n], name, len);
  b->name[b->n++][len] = 0;
  return 0;
}

static int sample_add(void *ud, const char *name, size_t len, int64_t value,
                      const char *text, size_t text_len) {
  char line[128];
  int n =
      text
          ? snprintf(line, sizeof line, "%.*s=%.*s;", (int)len, name, (int)text_len, text)
          : snprintf(line, sizeof line, "%.*s=%lld;", (int)len, name, (long long)value);
  return text_write(ud, line, (size_t)n);
}

/* What a host that maps some rows itself gets: the rows whose name ends
 * in '}' to decide on, the rest as lines, or every row as samples. */
static void test_host_rows(tally_store *s) {
  const char *names[] = {"lat{le=\"1\"}", "lat{le=\"+Inf\"}", "lat_sum", "odd}"};
  for (int i = 0; i < 4; i++)
    EXPECT_OK(
        tally_store_incr(s, names[i], strlen(names[i]), 10 + i, TALLY_COUNTER_CREATE));
  tally_counter *c;
  REQUIRE_OK(tu_counter(s, "lat_big", 2, TALLY_POLICY_THREAD, TALLY_COUNTER_CREATE, &c));
  EXPECT_OK(tally_counter_incr_shard(c, 0, ((int64_t)1 << 62) - 1));
  EXPECT_OK(tally_counter_incr_shard(c, 1, ((int64_t)1 << 62) - 1));
  tally_counter_close(c);

  tally_exposition *x;
  REQUIRE_OK(tally_exposition_open(s, "lat*", 4, &x));
  EXPECT_RC(1, tally_exposition_read(x, UINT64_MAX));
  struct braced b = {0};
  EXPECT_OK(tally_exposition_braced(x, braced_add, &b));
  EXPECT(b.n == 2);
  for (int i = 0; i < b.n; i++) {
    EXPECT(strncmp(b.name[i], "lat{le=", 7) == 0);
    EXPECT_OK(tally_exposition_leave_out(x, b.row[i]));
    EXPECT_OK(tally_exposition_leave_out(x, b.row[i])); /* twice: once */
  }
  uint64_t read, kept;
  tally_exposition_count(x, &read, &kept);
  EXPECT(read == 4 && kept == 2);
  struct text t = {0};
  EXPECT_RC(1, tally_exposition_write(x, 100, text_write, &t));
  EXPECT_STR(HEAD "tally_value{counter=\"lat_big\"} 9223372036854775806\n"
                  "tally_value{counter=\"lat_sum\"} 12\n",
             t.p);
  tally_exposition_close(x);

  /* samples instead of lines, a value beyond int64 as its text */
  REQUIRE_OK(tu_counter(s, "m_huge", 3, TALLY_POLICY_THREAD, TALLY_COUNTER_CREATE, &c));
  for (uint32_t i = 0; i < 3; i++)
    EXPECT_OK(tally_counter_incr_shard(c, i, ((int64_t)1 << 62) - 1));
  tally_counter_close(c);
  REQUIRE_OK(tally_exposition_open(s, NULL, 0, &x));
  int rc;
  while ((rc = tally_exposition_read(x, 3)) == 0) continue;
  EXPECT_RC(1, rc);
  struct text st = {0};
  EXPECT_RC(0, tally_exposition_rows(x, 2, sample_add, &st));
  EXPECT_RC(1, tally_exposition_rows(x, 10, sample_add, &st));
  EXPECT_STR(
      "lat_big=9223372036854775806;lat_sum=12;lat{le=\"+Inf\"}=11;lat{le=\"1\"}=10;"
      "m_huge=1.3835058055282164e+19;odd}=13;",
      st.p);
  tally_exposition_close(x);
  free(t.p);
  free(st.p);
}

int main(void) {
  char spec[1200], path[1200];
  const char *dir = tu_tmpdir("exposition");
  tu_spec(spec, sizeof spec, path, sizeof path, dir, "expo.tly");
  setenv("TALLY_GRACE_MS", "60000", 0); /* as test_top: reuse is not this test's */
  tally_store *s;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  test_lines(s);
  test_host_rows(s);
  test_many(s);
  tally_store_close(s);
  tu_rmrf(dir);
  return tu_finish("test_exposition");
}
