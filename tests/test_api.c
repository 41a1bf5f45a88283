/* test_api.c -- every function of the C API, with its error codes.
 *
 * Runs the same suite against a memory store and a file store, then the
 * file-only parts: modes, NOCREATE, reopen, 200k counters (index and file
 * growth) and a final tally_store_check.
 */
#include <fcntl.h>
#include <sys/stat.h>

#include "testutil.h"

#define P62 ((int64_t)1 << 62)

static char g_dir[1024];

/* ---- errors, policies, glob --------------------------------------------- */

static void test_errors(void) {
  static const struct {
    int code;
    const char *name, *msg;
  } tab[] = {
#define XX(n, c, m) {c, #n, m},
      TALLY_ERRNO_MAP(XX)
#undef XX
  };
  for (size_t i = 0; i < sizeof tab / sizeof tab[0]; i++) {
    EXPECT_STR(tab[i].msg, tally_strerror(tab[i].code));
    EXPECT_STR(tab[i].name, tally_err_name(tab[i].code));
  }
  EXPECT_STR("unknown error", tally_strerror(-12345));
  EXPECT_STR("unknown error", tally_strerror(77));
  EXPECT_STR("UNKNOWN", tally_err_name(-12345));
  EXPECT(tally_errmsg() != NULL);
  EXPECT_I64(-1, TALLY_EINVAL);
  EXPECT_I64(-15, TALLY_EBUSY);
}

/* A name is any bytes but NUL; the message naming it must not carry a
 * control byte (a forged log line, a terminal escape) or bytes that are
 * not UTF-8, and keeps valid UTF-8 as it is. */
static void test_error_text(void) {
  tally_store *s = NULL;
  int64_t v;
  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  static const char odd[] = "a\nb\x1b[31mc\x7f\xff\xc3(\xed\xa0\x80z\xc2\x9b"
                            "2J\xc2\xa0";
  EXPECT_RC(TALLY_ENOENT, tally_store_value(s, odd, sizeof odd - 1, &v));
  EXPECT_STR("no such counter "
             "'a\\x0ab\\x1b[31mc\\x7f\\xff\\xc3(\\xed\\xa0\\x80z\\xc2\\x9b2J\xc2\xa0'",
             tally_errmsg());
  static const char utf8[] = "caf\xc3\xa9:\xe2\x82\xac:\xf0\x9f\x91\x8d";
  EXPECT_RC(TALLY_ENOENT, tally_store_value(s, utf8, sizeof utf8 - 1, &v));
  EXPECT_STR("no such counter 'caf\xc3\xa9:\xe2\x82\xac:\xf0\x9f\x91\x8d'",
             tally_errmsg());
  /* a long name: the message is cut at a whole escape, and ends there */
  char longname[TALLY_NAME_MAX];
  memset(longname, '\n', sizeof longname);
  EXPECT_RC(TALLY_ENOENT, tally_store_value(s, longname, sizeof longname, &v));
  const char *m = tally_errmsg();
  size_t len = strlen(m);
  EXPECT(len > 400 && len < 512);
  EXPECT(strchr(m, '\n') == NULL);
  EXPECT_STR("\\x0a", m + len - 4);
  tally_store_close(s);

  /* tally_printable: the whole length, as snprintf; what fits, whole */
  char out[16];
  EXPECT_I64(12, tally_printable(out, sizeof out, "a\0b\xc3\xa9\n", 6));
  EXPECT_STR("a\\x00b\xc3\xa9\\x0a", out);
  EXPECT_I64(12, tally_printable(out, 8, "a\0b\xc3\xa9\n", 6));
  EXPECT_STR("a\\x00b", out); /* the two bytes of e-acute would end at 8 */
  EXPECT_I64(12, tally_printable(NULL, 0, "a\0b\xc3\xa9\n", 6));

  /* tally_uri_redact: a URI's userinfo and query are never shown */
  static const struct {
    const char *uri, *shown;
  } uris[] = {
      {"redis://u:S3CRET@h:1/0?password=S3CRET", "redis://***@h:1/0?***"},
      {"redis://h:1?password=S3CRET", "redis://h:1?***"},
      {"redis://:se/cr@t/S3CRET@h:1", "redis://***@h:1"},
      {"redis://:S3?CRET@h:1", "redis://***?***"}, /* '@' after the '?' */
      {"redis+cluster://h:1,h:2", "redis+cluster://h:1,h:2"},
      {"file:/data/a@b?c", "file:/data/a@b?c"}, /* no "://": not a URI */
  };
  for (size_t i = 0; i < sizeof uris / sizeof uris[0]; i++) {
    char shown[64];
    size_t n = tally_uri_redact(shown, sizeof shown, uris[i].uri, strlen(uris[i].uri));
    EXPECT_STR(uris[i].shown, shown);
    EXPECT_I64((int64_t)strlen(uris[i].shown), (int64_t)n);
  }
  EXPECT_I64(19, tally_uri_redact(out, 10, "redis://u:pw@h:1?x=y", 20));
  EXPECT_STR("redis://*", out);
  EXPECT_RC(TALLY_EINVAL,
            tally_store_open("rediss://u:S3CRET@h:1?password=S3CRET", NULL, &s));
  EXPECT_STR("unknown store 'rediss://***@h:1?***' (expected 'memory' or 'file:PATH')",
             tally_errmsg());
  /* a spec with a mistyped or missing scheme is no URI, but is no store
   * either: its secret is not quoted */
  static const struct {
    const char *spec, *shown;
  } specs[] = {
      {"redis:/:S3CRET@h:1", "***@h:1"},
      {"h:1?password=S3CRET", "h:1?***"},
      {"firestore:p?token_cmd=S3CRET", "firestore:p?***"},
      {"u:S3?CRET@h:1", "***?***"},
      {"mem", "mem"},
  };
  for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
    char want[128];
    snprintf(want, sizeof want, "unknown store '%s' (expected 'memory' or 'file:PATH')",
             specs[i].shown);
    EXPECT_RC(TALLY_EINVAL, tally_store_open(specs[i].spec, NULL, &s));
    EXPECT_STR(want, tally_errmsg());
  }
}

static void test_policies(void) {
  static const char *names[] = {"thread", "random", "round_robin", "key",
                                "custom", "slot",   "cpu"};
  for (int p = 0; p < TALLY_POLICY_COUNT_; p++) {
    EXPECT_STR(names[p], tally_policy_name(p));
    EXPECT_I64(p, tally_policy_parse(names[p], strlen(names[p])));
  }
  EXPECT(tally_policy_name(-1) == NULL);
  EXPECT(tally_policy_name(TALLY_POLICY_COUNT_) == NULL);
  EXPECT_RC(TALLY_EPOLICY, tally_policy_parse("bogus", 5));
  EXPECT_RC(TALLY_EPOLICY, tally_policy_parse("", 0));
  EXPECT_RC(TALLY_EPOLICY, tally_policy_parse("thread", 5));    /* "threa" */
  EXPECT_RC(TALLY_EPOLICY, tally_policy_parse("thread\0x", 8)); /* embedded NUL */
  EXPECT_RC(TALLY_EPOLICY, tally_policy_parse("THREAD", 6));
  /* len is honoured: "keyboard" cut to 3 bytes is "key" */
  EXPECT_I64(TALLY_POLICY_KEY, tally_policy_parse("keyboard", 3));
}

/* The definition, by recursion: the table below and random pairs are
 * checked against it. */
static int glob_ref(const char *p, size_t pl, const char *n, size_t nl) {
  if (pl == 0) return nl == 0;
  if (p[0] == '*')
    return glob_ref(p + 1, pl - 1, n, nl) || (nl > 0 && glob_ref(p, pl, n + 1, nl - 1));
  return nl > 0 && (p[0] == '?' || p[0] == n[0]) &&
         glob_ref(p + 1, pl - 1, n + 1, nl - 1);
}

static void test_glob(void) {
  static const struct {
    const char *pat, *name;
    int want;
  } tab[] = {
      {"*", "", 1},
      {"*", "abc", 1},
      {"", "", 1},
      {"", "a", 0},
      {"abc", "abc", 1},
      {"abc", "abd", 0},
      {"abc", "ab", 0},
      {"ab", "abc", 0},
      {"a*c", "ac", 1},
      {"a*c", "abbbc", 1},
      {"a*c", "abbbd", 0},
      {"a?c", "abc", 1},
      {"a?c", "ac", 0},
      {"?", "", 0},
      {"??", "ab", 1},
      {"post:*:likes", "post:123:likes", 1},
      {"post:*:likes", "post::likes", 1},
      {"post:*:likes", "post:1:likesx", 0},
      {"post:*", "post:", 1},
      {"post:*", "pos", 0},
      {"**", "x", 1},
      {"*a*a*", "banana", 1},
      {"*a*a*a*a", "banana", 0},
      {"*x", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", 0},
      {"a*b*c*d*e*f*g", "aXbXcXdXeXfXg", 1},
      {"*?", "", 0},
      {"*?", "z", 1},
      {"[a]", "[a]", 1},
      {"[a]", "a", 0},
      {"\\*", "\\x", 1},
      /* a '*' or '?' in a name is a byte like any other */
      {"*", "*a", 1},
      {"*", "**", 1},
      {"post:*", "post:*1", 1},
      {"a*c", "a*c", 1},
      {"a*c", "a*xc", 1},
      {"*b", "*b", 1},
      {"**a", "*a", 1},
      {"?*", "*", 1},
      {"*?", "?", 1},
      {"a?", "a*", 1},
  };
  for (size_t i = 0; i < sizeof tab / sizeof tab[0]; i++) {
    int got = tally_glob_match(tab[i].pat, strlen(tab[i].pat), tab[i].name,
                               strlen(tab[i].name));
    atomic_fetch_add(&tu_checks, 1);
    if (got != tab[i].want)
      TU_FAIL("tally_glob_match(\"%s\", \"%s\") = %d, expected %d", tab[i].pat,
              tab[i].name, got, tab[i].want);
  }
  /* random patterns and names over a, b, * and ? against the definition */
  uint64_t x = 88172645463325252ull;
  int wrong = 0;
  for (int i = 0; i < 200000; i++) {
    char pat[8], name[8];
    size_t pl, nl;
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    pl = x % 8, nl = (x >> 3) % 8;
    for (size_t k = 0; k < 8; k++) {
      pat[k] = "ab*?"[(x >> (6 + 2 * k)) & 3];
      name[k] = "ab*?"[(x >> (22 + 2 * k)) & 3];
    }
    if (tally_glob_match(pat, pl, name, nl) != glob_ref(pat, pl, name, nl) && wrong++ < 3)
      TU_FAIL("tally_glob_match(\"%.*s\", \"%.*s\") differs from the definition", (int)pl,
              pat, (int)nl, name);
  }
  atomic_fetch_add(&tu_checks, 1);
  /* lengths are honoured, bytes are bytes */
  EXPECT_I64(1, tally_glob_match("abXYZ", 2, "abQ", 2));
  EXPECT_I64(1, tally_glob_match("a?c", 3, "a\0c", 3));
  EXPECT_I64(1, tally_glob_match("a*", 2, "a\xff\xfe", 3));
  EXPECT_I64(0, tally_glob_match("a\0", 2, "a", 1));
}

/* ---- store-independent counter behaviour -------------------------------- */

struct each_ctx {
  int n;
  int stop_at;
  char seen[64][32];
};

static int each_cb(void *ud, const char *name, size_t len) {
  struct each_ctx *e = ud;
  if (e->n < 64 && len < 32) {
    memcpy(e->seen[e->n], name, len);
    e->seen[e->n][len] = 0;
  }
  e->n++;
  if (e->stop_at && e->n == e->stop_at) return 42;
  return 0;
}

/* tally_store_values: each name seen with its value; stop_at as each_cb */
struct values_ctx {
  int n, stop_at;
  int64_t total;
  char names[64][32];
  int64_t vals[64];
};

static int values_cb(void *ud, const char *name, size_t len, int64_t v) {
  struct values_ctx *x = ud;
  if (x->n < 64 && len < 32) {
    memcpy(x->names[x->n], name, len);
    x->names[x->n][len] = 0;
    x->vals[x->n] = v;
  }
  x->total += v;
  x->n++;
  return x->stop_at && x->n == x->stop_at ? 43 : 0;
}

/* name's value as values_cb saw it; INT64_MIN if it was not seen */
static int64_t value_seen(const struct values_ctx *x, const char *name) {
  for (int i = 0; i < x->n && i < 64; i++)
    if (strcmp(x->names[i], name) == 0) return x->vals[i];
  return INT64_MIN;
}

static int seen(const struct each_ctx *e, const char *name) {
  for (int i = 0; i < e->n && i < 64; i++)
    if (strcmp(e->seen[i], name) == 0) return 1;
  return 0;
}

static void test_open_errors(tally_store *s) {
  tally_counter *c = (tally_counter *)0x1; /* must stay untouched on failure */
  tally_counter_options o = {4, TALLY_POLICY_RANDOM};
  char big[300];
  memset(big, 'n', sizeof big);

  EXPECT_RC(TALLY_EINVAL, tally_counter_open(NULL, "x", 1, &o, TALLY_COUNTER_CREATE, &c));
  EXPECT_RC(TALLY_EINVAL, tally_counter_open(s, "x", 1, &o, TALLY_COUNTER_CREATE, NULL));
  {
    int rc = tally_counter_open(s, NULL, 1, &o, TALLY_COUNTER_CREATE, &c);
    atomic_fetch_add(&tu_checks, 1);
    if (rc != TALLY_EINVAL && rc != TALLY_ENAME)
      TU_FAIL("counter_open(name NULL) -> %d %s, expected EINVAL or ENAME", rc,
              tally_err_name(rc));
  }
  EXPECT_RC(TALLY_ENAME, tally_counter_open(s, "", 0, &o, TALLY_COUNTER_CREATE, &c));
  EXPECT_RC(TALLY_ENAME, tally_counter_open(s, big, 256, &o, TALLY_COUNTER_CREATE, &c));
  EXPECT_RC(TALLY_ENAME, tally_counter_open(s, big, 300, &o, TALLY_COUNTER_CREATE, &c));
  EXPECT_RC(TALLY_ENAME, tally_counter_open(s, "a\0b", 3, &o, TALLY_COUNTER_CREATE, &c));
  EXPECT_RC(TALLY_ENAME, tally_counter_open(s, "\0", 1, &o, TALLY_COUNTER_CREATE, &c));
  o.shards = 1025;
  EXPECT_RC(TALLY_ESHARDS, tally_counter_open(s, "x", 1, &o, TALLY_COUNTER_CREATE, &c));
  o.shards = 0xFFFFFFFEu; /* 0xFFFFFFFF is TALLY_SHARDS_AUTO */
  EXPECT_RC(TALLY_ESHARDS, tally_counter_open(s, "x", 1, &o, TALLY_COUNTER_CREATE, &c));
  o.shards = 4;
  o.policy = TALLY_POLICY_COUNT_;
  EXPECT_RC(TALLY_EPOLICY, tally_counter_open(s, "x", 1, &o, TALLY_COUNTER_CREATE, &c));
  o.policy = 99;
  EXPECT_RC(TALLY_EPOLICY, tally_counter_open(s, "x", 1, &o, TALLY_COUNTER_CREATE, &c));
  o.policy = -2;
  EXPECT_RC(TALLY_EPOLICY, tally_counter_open(s, "x", 1, &o, TALLY_COUNTER_CREATE, &c));
  EXPECT_RC(TALLY_ENOENT, tally_counter_open(s, "absent", 6, NULL, 0, &c));
  EXPECT(c == (tally_counter *)0x1);
  /* none of these created anything */
  EXPECT_RC(TALLY_ENOENT, tally_counter_open(s, "x", 1, NULL, 0, &c));
  EXPECT(c == (tally_counter *)0x1);

  /* the longest name works, and round-trips through info */
  tally_counter *lc = NULL;
  EXPECT_OK(tally_counter_open(s, big, 255, NULL, TALLY_COUNTER_CREATE, &lc));
  if (lc) {
    tally_counter_info inf;
    EXPECT_OK(tally_counter_info_get(lc, &inf));
    EXPECT_I64(255, inf.name_len);
    EXPECT(memcmp(inf.name, big, 255) == 0 && inf.name[255] == 0);
    tally_counter_close(lc);
    EXPECT_OK(tally_store_drop(s, big, 255));
  }
  /* names with arbitrary bytes (not NUL) are fine */
  EXPECT_OK(tally_counter_open(s, "\xff\x01 \t:*?", 7, NULL, TALLY_COUNTER_CREATE, &lc));
  tally_counter_close(lc);
  EXPECT_OK(tally_store_drop(s, "\xff\x01 \t:*?", 7));
  tally_counter_close(NULL);
}

static void test_incr_and_range(tally_store *s) {
  tally_counter *c = NULL;
  int64_t v;

  REQUIRE_OK(tu_counter(s, "range1", 1, TALLY_POLICY_THREAD, TALLY_COUNTER_CREATE, &c));
  EXPECT_RC(TALLY_ERANGE, tally_counter_incr(c, P62));
  EXPECT_I64(0, tu_value(c));
  EXPECT_RC(TALLY_ERANGE, tally_counter_incr(c, INT64_MAX));
  EXPECT_RC(TALLY_ERANGE, tally_counter_incr(c, INT64_MIN));
  EXPECT_RC(TALLY_ERANGE, tally_counter_incr(c, -P62 - 1));
  EXPECT_I64(0, tu_value(c));
  EXPECT_OK(tally_counter_incr(c, P62 - 1));
  EXPECT_I64(P62 - 1, tu_value(c));
  EXPECT_RC(TALLY_ERANGE, tally_counter_incr(c, 1));
  EXPECT_RC(TALLY_ERANGE, tally_counter_incr_shard(c, 0, 1));
  EXPECT_RC(TALLY_ERANGE, tally_counter_incr_key(c, "k", 1, 1));
  EXPECT_I64(P62 - 1, tu_value(c));
  EXPECT_OK(tally_counter_incr(c, -(P62 - 1)));
  EXPECT_OK(tally_counter_incr(c, -P62)); /* exactly -2^62 is a value */
  EXPECT_I64(-P62, tu_value(c));
  EXPECT_RC(TALLY_ERANGE, tally_counter_incr(c, -1));
  EXPECT_I64(-P62, tu_value(c));
  EXPECT_OK(tally_counter_incr(c, P62 - 1));
  EXPECT_I64(-1, tu_value(c));
  EXPECT_OK(tally_counter_incr(c, 0));
  EXPECT_I64(-1, tu_value(c));
  EXPECT_OK(tally_counter_reset(c, &v));
  EXPECT_I64(-1, v);
  tally_counter_close(c);

  /* sums past int64: 3 cells at 2^62-1 */
  REQUIRE_OK(tu_counter(s, "range3", 3, TALLY_POLICY_CUSTOM, TALLY_COUNTER_CREATE, &c));
  EXPECT_RC(TALLY_EPOLICY, tally_counter_incr(c, 1));
  EXPECT_OK(tally_counter_incr_shard(c, 0, P62 - 1));
  EXPECT_OK(tally_counter_incr_shard(c, 1, P62 - 1));
  EXPECT_I64(2 * (P62 - 1), tu_value(c));
  EXPECT_OK(tally_counter_incr_shard(c, 2, P62 - 1));
  v = 12345;
  EXPECT_RC(TALLY_ERANGE, tally_counter_value(c, &v));
  EXPECT_I64(12345, v); /* untouched on failure */
  {
    int64_t sh[3] = {0, 0, 0};
    uint32_t n = 0;
    EXPECT_OK(tally_counter_shards(c, sh, 3, &n));
    EXPECT_I64(3, n);
    EXPECT_I64(P62 - 1, sh[0]);
    EXPECT_I64(P62 - 1, sh[2]);
  }
  /* reset of an unrepresentable total must not silently lose it */
  v = 777;
  {
    int rc = tally_counter_reset(c, &v);
    atomic_fetch_add(&tu_checks, 1);
    if (rc == 0)
      TU_FAIL("reset of a counter whose total does not fit int64 returned 0 "
              "(removed=%lld): the removed amount cannot be reported",
              (long long)v);
    else if (rc != TALLY_ERANGE)
      TU_FAIL("reset of unrepresentable total -> %d %s, expected ERANGE", rc,
              tally_err_name(rc));
  }
  {
    /* whatever reset did, the cells must still add up: bring them back to
     * {2^62-1, 0, 0} for what follows */
    int64_t sh[3] = {0, 0, 0};
    uint32_t n = 0;
    EXPECT_OK(tally_counter_shards(c, sh, 3, &n));
    atomic_fetch_add(&tu_checks, 1);
    if (sh[0] != P62 - 1 || sh[1] != P62 - 1 || sh[2] != P62 - 1)
      TU_FAIL("reset that failed with ERANGE changed the shards: now {%lld, %lld, %lld}, "
              "were 3 x 2^62-1 (lost without being reported)",
              (long long)sh[0], (long long)sh[1], (long long)sh[2]);
    EXPECT_OK(tally_counter_incr_shard(c, 0, (P62 - 1) - sh[0]));
    EXPECT_OK(tally_counter_incr_shard(c, 1, -sh[1]));
    EXPECT_OK(tally_counter_incr_shard(c, 2, -sh[2]));
  }
  EXPECT_I64(P62 - 1, tu_value(c));
  /* negative side: -2^62 * 3 < INT64_MIN */
  EXPECT_OK(tally_counter_incr_shard(c, 0, -(P62 - 1)));
  EXPECT_OK(tally_counter_incr_shard(c, 0, -P62));
  EXPECT_OK(tally_counter_incr_shard(c, 1, -P62));
  EXPECT_I64(INT64_MIN, tu_value(c)); /* -2^63 fits exactly */
  EXPECT_OK(tally_counter_incr_shard(c, 2, -1));
  EXPECT_RC(TALLY_ERANGE, tally_counter_value(c, &v));
  EXPECT_RC(TALLY_ESHARDS, tally_counter_incr_shard(c, 3, 1));
  EXPECT_RC(TALLY_ESHARDS, tally_counter_incr_shard(c, 0xFFFFFFFFu, 1));
  /* reshard to fewer shards than the total needs: would overflow a cell */
  {
    int rc = tally_counter_reshard(c, 1);
    atomic_fetch_add(&tu_checks, 1);
    if (rc != TALLY_ERANGE)
      TU_FAIL("reshard(1) of a counter at ~-2^63 -> %d %s, expected ERANGE", rc,
              tally_err_name(rc));
    uint32_t n = 0;
    EXPECT_OK(tally_counter_shards(c, NULL, 0, &n));
    EXPECT_I64(3, n);
  }
  tally_counter_close(c);
  EXPECT_OK(tally_store_drop(s, "range3", 6));
  EXPECT_OK(tally_store_drop(s, "range1", 6));
}

static void test_policies_incr(tally_store *s) {
  for (int p = 0; p < TALLY_POLICY_SLOT; p++) { /* slot: test_batch */
    char name[32];
    tally_counter *c = NULL;
    snprintf(name, sizeof name, "pol:%s", tally_policy_name(p));
    REQUIRE_OK(tu_counter(s, name, 8, p, TALLY_COUNTER_CREATE, &c));
    int64_t want = 0;
    for (int i = 0; i < 1000; i++) {
      int64_t d = (i % 7) - 2;
      if (p == TALLY_POLICY_KEY) {
        if (i == 0) EXPECT_RC(TALLY_EPOLICY, tally_counter_incr(c, 1));
      } else if (p == TALLY_POLICY_CUSTOM) {
        if (i == 0) EXPECT_RC(TALLY_EPOLICY, tally_counter_incr(c, 1));
      } else {
        EXPECT_OK(tally_counter_incr(c, d));
        want += d;
      }
      EXPECT_OK(tally_counter_incr_key(c, &i, sizeof i, d));
      EXPECT_OK(tally_counter_incr_shard(c, (uint32_t)i % 8, d));
      want += 2 * d;
    }
    EXPECT_I64(want, tu_value(c));
    /* the same key lands on the same shard */
    {
      int64_t a[8], b[8];
      uint32_t n;
      EXPECT_OK(tally_counter_shards(c, a, 8, &n));
      for (int i = 0; i < 10; i++) EXPECT_OK(tally_counter_incr_key(c, "same-key", 8, 3));
      EXPECT_OK(tally_counter_shards(c, b, 8, &n));
      int changed = 0;
      for (int i = 0; i < 8; i++)
        if (a[i] != b[i]) {
          changed++;
          EXPECT_I64(a[i] + 30, b[i]);
        }
      EXPECT_I64(1, changed);
      /* empty key is allowed and deterministic too */
      EXPECT_OK(tally_counter_incr_key(c, "", 0, 1));
      EXPECT_RC(TALLY_EINVAL, tally_counter_incr_key(c, NULL, 3, 1));
      want += 31;
    }
    /* round_robin visits every shard */
    if (p == TALLY_POLICY_ROUND_ROBIN) {
      int64_t a[8], b[8];
      uint32_t n;
      EXPECT_OK(tally_counter_shards(c, a, 8, &n));
      for (int i = 0; i < 8; i++) EXPECT_OK(tally_counter_incr(c, 1));
      EXPECT_OK(tally_counter_shards(c, b, 8, &n));
      for (int i = 0; i < 8; i++) EXPECT_I64(a[i] + 1, b[i]);
      want += 8;
    }
    /* thread policy: one thread keeps to one shard */
    if (p == TALLY_POLICY_THREAD) {
      int64_t a[8], b[8];
      uint32_t n;
      EXPECT_OK(tally_counter_shards(c, a, 8, &n));
      for (int i = 0; i < 100; i++) EXPECT_OK(tally_counter_incr(c, 1));
      EXPECT_OK(tally_counter_shards(c, b, 8, &n));
      int changed = 0;
      for (int i = 0; i < 8; i++) changed += a[i] != b[i];
      EXPECT_I64(1, changed);
      want += 100;
    }
    /* random spreads */
    if (p == TALLY_POLICY_RANDOM) {
      int64_t a[8], b[8];
      uint32_t n;
      EXPECT_OK(tally_counter_shards(c, a, 8, &n));
      for (int i = 0; i < 800; i++) EXPECT_OK(tally_counter_incr(c, 1));
      EXPECT_OK(tally_counter_shards(c, b, 8, &n));
      int changed = 0;
      for (int i = 0; i < 8; i++) changed += a[i] != b[i];
      EXPECT(changed >= 6);
      want += 800;
    }
    EXPECT_I64(want, tu_value(c));
    tally_counter_info inf;
    EXPECT_OK(tally_counter_info_get(c, &inf));
    EXPECT_STR(name, inf.name);
    EXPECT_I64(strlen(name), inf.name_len);
    EXPECT_I64(8, inf.shards);
    EXPECT_I64(p, inf.policy);
    tally_counter_close(c);
  }
}

static void test_null_handles(void) {
  int64_t v = 5;
  uint32_t n = 9;
  tally_counter_info inf;
  tally_store_stats st;
  EXPECT_RC(TALLY_EINVAL, tally_counter_incr(NULL, 1));
  EXPECT_RC(TALLY_EINVAL, tally_counter_incr_key(NULL, "k", 1, 1));
  EXPECT_RC(TALLY_EINVAL, tally_counter_incr_shard(NULL, 0, 1));
  EXPECT_RC(TALLY_EINVAL, tally_counter_value(NULL, &v));
  EXPECT_RC(TALLY_EINVAL, tally_counter_shards(NULL, &v, 1, &n));
  EXPECT_RC(TALLY_EINVAL, tally_counter_reset(NULL, &v));
  EXPECT_RC(TALLY_EINVAL, tally_counter_reshard(NULL, 4));
  EXPECT_RC(TALLY_EINVAL, tally_counter_info_get(NULL, &inf));
  EXPECT_RC(TALLY_EINVAL, tally_store_drop(NULL, "x", 1));
  EXPECT_RC(TALLY_EINVAL, tally_store_sync(NULL));
  EXPECT_RC(TALLY_EINVAL, tally_store_check(NULL));
  EXPECT_RC(TALLY_EINVAL, tally_store_stats_get(NULL, &st));
  EXPECT_RC(TALLY_EINVAL, tally_store_each(NULL, NULL, 0, each_cb, NULL));
  EXPECT_RC(TALLY_EINVAL, tally_store_sum(NULL, NULL, 0, &v, NULL));
  EXPECT_RC(TALLY_EINVAL, tally_family_set(NULL, "x*", 2, NULL));
  EXPECT_RC(TALLY_EINVAL, tally_family_resolve(NULL, "x", 1, NULL));
  EXPECT_RC(TALLY_EINVAL, tally_store_open("memory", NULL, NULL));
  EXPECT_I64(5, v);
  EXPECT_I64(9, n);
  tally_store_close(NULL);
}

static void test_counter_ops(tally_store *s) {
  tally_counter *c = NULL, *c2 = NULL;
  tally_counter_options o = {10, TALLY_POLICY_RANDOM};
  int64_t v = 0;
  uint32_t n = 0;

  REQUIRE_OK(tally_counter_open(s, "post:1:likes", 12, &o, TALLY_COUNTER_CREATE, &c));
  /* same options, none, or "defaults" (0/-1) on an existing counter: fine */
  EXPECT_OK(tally_counter_open(s, "post:1:likes", 12, &o, TALLY_COUNTER_CREATE, &c2));
  tally_counter_close(c2);
  c2 = NULL;
  EXPECT_OK(tally_counter_open(s, "post:1:likes", 12, NULL, 0, &c2));
  tally_counter_close(c2);
  c2 = NULL;
  EXPECT_OK(tally_counter_open(s, "post:1:likes", 12, NULL, TALLY_COUNTER_CREATE, &c2));
  tally_counter_close(c2);
  c2 = NULL;
  /* different options: EMISMATCH, with or without CREATE */
  tally_counter_options bad = {11, TALLY_POLICY_RANDOM};
  EXPECT_RC(TALLY_EMISMATCH,
            tally_counter_open(s, "post:1:likes", 12, &bad, TALLY_COUNTER_CREATE, &c2));
  EXPECT_RC(TALLY_EMISMATCH, tally_counter_open(s, "post:1:likes", 12, &bad, 0, &c2));
  bad.shards = 10;
  bad.policy = TALLY_POLICY_THREAD;
  EXPECT_RC(TALLY_EMISMATCH,
            tally_counter_open(s, "post:1:likes", 12, &bad, TALLY_COUNTER_CREATE, &c2));
  EXPECT(c2 == NULL);
  EXPECT(strstr(tally_errmsg(), "post:1:likes") != NULL);

  /* CREATE | EXCL: a new counter only (an import's undo drops only its
   * own); EXCL alone creates nothing; a capped family gives its overflow */
  const uint32_t excl = TALLY_COUNTER_CREATE | TALLY_COUNTER_EXCL;
  EXPECT_RC(TALLY_EEXIST, tally_counter_open(s, "post:1:likes", 12, NULL, excl, &c2));
  EXPECT(c2 == NULL);
  EXPECT(strstr(tally_errmsg(), "'post:1:likes' exists") != NULL);
  EXPECT_RC(TALLY_ENOENT,
            tally_counter_open(s, "excl:a", 6, NULL, TALLY_COUNTER_EXCL, &c2));
  REQUIRE_OK(tally_counter_open(s, "excl:a", 6, NULL, excl, &c2));
  tally_counter_close(c2);
  c2 = NULL;
  EXPECT_RC(TALLY_EEXIST, tally_counter_open(s, "excl:a", 6, NULL, excl, &c2));
  EXPECT_OK(tally_store_drop(s, "excl:a", 6)); /* dropped: new again */
  REQUIRE_OK(tally_counter_open(s, "excl:a", 6, NULL, excl, &c2));
  tally_counter_close(c2);
  c2 = NULL;
  tally_family_options capped = {1, TALLY_POLICY_THREAD, 0, 1};
  EXPECT_OK(tally_family_define(s, "excl:cap:*", 10, &capped));
  REQUIRE_OK(tally_counter_open(s, "excl:cap:1", 10, NULL, excl, &c2));
  tally_counter_close(c2);
  c2 = NULL;
  tally_counter_info ci;
  REQUIRE_OK(tally_counter_open(s, "excl:cap:2", 10, NULL, excl, &c2)); /* the overflow */
  EXPECT_OK(tally_counter_info_get(c2, &ci));
  EXPECT(ci.name_len != 10 || memcmp(ci.name, "excl:cap:2", 10) != 0);
  tally_counter_close(c2);
  c2 = NULL;
  EXPECT_OK(tally_store_drop(s, "excl:a", 6));
  /* by name, an add cannot say its counter is new: refused, nothing made */
  EXPECT_RC(TALLY_EINVAL, tally_store_incr(s, "excl:b", 6, 1, excl));
  EXPECT_RC(TALLY_ENOENT, tally_store_incr(s, "excl:b", 6, 1, 0));

  EXPECT_OK(tally_counter_incr(c, 5));
  EXPECT_OK(tally_counter_incr(c, -2));
  EXPECT_OK(tally_counter_value(c, &v));
  EXPECT_I64(3, v);

  /* shards(): per-shard values, cap, n */
  EXPECT_OK(tally_counter_reset(c, &v));
  EXPECT_I64(3, v);
  for (uint32_t i = 0; i < 10; i++)
    EXPECT_OK(tally_counter_incr_shard(c, i, (int64_t)i * 100 - 300));
  {
    int64_t sh[12];
    for (int i = 0; i < 12; i++) sh[i] = -7;
    EXPECT_OK(tally_counter_shards(c, sh, 12, &n));
    EXPECT_I64(10, n);
    for (int i = 0; i < 10; i++) EXPECT_I64((int64_t)i * 100 - 300, sh[i]);
    EXPECT_I64(-7, sh[10]);
    for (int i = 0; i < 12; i++) sh[i] = -7;
    n = 0;
    EXPECT_OK(tally_counter_shards(c, sh, 4, &n));
    EXPECT_I64(10, n);
    EXPECT_I64(0, sh[3]);
    EXPECT_I64(-7, sh[4]);
    n = 0;
    EXPECT_OK(tally_counter_shards(c, NULL, 0, &n));
    EXPECT_I64(10, n);
    EXPECT_RC(TALLY_EINVAL, tally_counter_shards(c, NULL, 4, &n));
  }
  EXPECT_I64(4500 - 3000, tu_value(c));
  EXPECT_RC(TALLY_EINVAL, tally_counter_value(c, NULL));

  /* reset returns what it removed */
  v = 0;
  EXPECT_OK(tally_counter_reset(c, &v));
  EXPECT_I64(1500, v);
  EXPECT_I64(0, tu_value(c));
  EXPECT_OK(tally_counter_reset(c, &v));
  EXPECT_I64(0, v);
  EXPECT_OK(tally_counter_incr(c, -9));
  EXPECT_OK(tally_counter_reset(c, &v));
  EXPECT_I64(-9, v);
  {
    int rc = tally_counter_reset(c, NULL); /* NULL out: allowed or EINVAL */
    atomic_fetch_add(&tu_checks, 1);
    if (rc != 0 && rc != TALLY_EINVAL) TU_FAIL("reset(NULL) -> %d", rc);
  }

  /* reshard: keeps the value; grow and shrink across 1..1024 */
  {
    static const uint32_t sizes[] = {1,    2,   3, 16, 17,   64, 1000,
                                     1024, 513, 7, 1,  1024, 2,  16};
    uint64_t rng = 42;
    int64_t want = 0;
    for (int i = 0; i < 200; i++) {
      int64_t d = (int64_t)(tu_rng(&rng) % 2000001) - 1000000;
      EXPECT_OK(tally_counter_incr_shard(c, (uint32_t)(tu_rng(&rng) % 10), d));
      want += d;
    }
    EXPECT_I64(want, tu_value(c));
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
      EXPECT_OK(tally_counter_reshard(c, sizes[k]));
      EXPECT_I64(want, tu_value(c));
      tally_counter_info inf;
      EXPECT_OK(tally_counter_info_get(c, &inf));
      EXPECT_I64(sizes[k], inf.shards);
      EXPECT_I64(TALLY_POLICY_RANDOM, inf.policy);
      int64_t *sh = calloc(1024, sizeof *sh);
      EXPECT_OK(tally_counter_shards(c, sh, 1024, &n));
      EXPECT_I64(sizes[k], n);
      int64_t sum = 0;
      for (uint32_t i = 0; i < n; i++) sum += sh[i];
      EXPECT_I64(want, sum);
      free(sh);
      /* increments land in the new layout */
      for (int i = 0; i < 50; i++) EXPECT_OK(tally_counter_incr(c, 1));
      EXPECT_OK(tally_counter_incr_shard(c, sizes[k] - 1, 2));
      EXPECT_RC(TALLY_ESHARDS, tally_counter_incr_shard(c, sizes[k], 2));
      want += 52;
      EXPECT_I64(want, tu_value(c));
      /* a second handle opened earlier sees it too */
    }
    EXPECT_RC(TALLY_ESHARDS, tally_counter_reshard(c, 0));
    EXPECT_RC(TALLY_ESHARDS, tally_counter_reshard(c, 1025));
    EXPECT_I64(want, tu_value(c));
    EXPECT_OK(tally_counter_reshard(c, 16)); /* same count again is fine */
    EXPECT_OK(tally_counter_reshard(c, 16));
    EXPECT_I64(want, tu_value(c));
    /* the other handle, opened now with the new options, agrees */
    tally_counter_options now = {16, TALLY_POLICY_RANDOM};
    EXPECT_OK(tally_counter_open(s, "post:1:likes", 12, &now, 0, &c2));
    if (c2) {
      EXPECT_I64(want, tu_value(c2));
      EXPECT_OK(tally_counter_reshard(c2, 5));
      EXPECT_I64(want, tu_value(c)); /* the first handle follows */
      EXPECT_OK(tally_counter_incr(c, 1));
      EXPECT_I64(want + 1, tu_value(c2));
      tally_counter_info inf;
      EXPECT_OK(tally_counter_info_get(c, &inf));
      EXPECT_I64(5, inf.shards);
      tally_counter_close(c2);
      c2 = NULL;
    }
    EXPECT_OK(tally_counter_reset(c, &v));
    EXPECT_I64(want + 1, v);
  }

  /* drop: second handle gets EDROPPED; name is free again */
  EXPECT_OK(tally_counter_open(s, "post:1:likes", 12, NULL, 0, &c2));
  EXPECT_OK(tally_counter_incr(c2, 4));
  EXPECT_OK(tally_store_drop(s, "post:1:likes", 12));
  EXPECT_RC(TALLY_ENOENT, tally_store_drop(s, "post:1:likes", 12));
  EXPECT_RC(TALLY_ENAME, tally_store_drop(s, "", 0));
  EXPECT_RC(TALLY_EDROPPED, tally_counter_incr(c2, 1));
  EXPECT_RC(TALLY_EDROPPED, tally_counter_incr(c, 1));
  EXPECT_RC(TALLY_EDROPPED, tally_counter_incr_shard(c, 0, 1));
  EXPECT_RC(TALLY_EDROPPED, tally_counter_incr_key(c, "k", 1, 1));
  v = 99;
  EXPECT_RC(TALLY_EDROPPED, tally_counter_value(c2, &v));
  EXPECT_RC(TALLY_EDROPPED, tally_counter_reset(c2, &v));
  EXPECT_RC(TALLY_EDROPPED, tally_counter_reshard(c2, 3));
  EXPECT_RC(TALLY_EDROPPED, tally_counter_shards(c2, &v, 1, &n));
  EXPECT_I64(99, v);
  EXPECT_RC(TALLY_ENOENT, tally_counter_open(s, "post:1:likes", 12, NULL, 0, &c));
  {
    tally_counter *c3 = NULL;
    EXPECT_OK(tally_counter_open(s, "post:1:likes", 12, NULL, TALLY_COUNTER_CREATE, &c3));
    if (c3) {
      EXPECT_I64(0, tu_value(c3));
      EXPECT_OK(tally_counter_incr(c3, 1));
      /* old handles stay dropped even though the name lives again */
      EXPECT_RC(TALLY_EDROPPED, tally_counter_incr(c2, 1));
      EXPECT_RC(TALLY_EDROPPED, tally_counter_value(c, &v));
      EXPECT_I64(1, tu_value(c3));
      tally_counter_close(c3);
    }
    EXPECT_OK(tally_store_drop(s, "post:1:likes", 12));
  }
  tally_counter_close(c2);
  tally_counter_close(c);
}

static void test_families(tally_store *s) {
  tally_counter_options o, fam;
  tally_counter *c = NULL;
  tally_counter_info inf;

  /* defaults */
  EXPECT_OK(tally_family_resolve(s, "nofam", 5, &o));
  EXPECT_I64(TALLY_SHARDS_AUTO, o.shards);
  EXPECT_I64(TALLY_POLICY_THREAD, o.policy);
  EXPECT_RC(TALLY_ENAME, tally_family_resolve(s, "", 0, &o));
  EXPECT_RC(TALLY_EINVAL, tally_family_resolve(s, "x", 1, NULL));

  fam = (tally_counter_options){8, TALLY_POLICY_RANDOM};
  EXPECT_OK(tally_family_set(s, "fam:*:likes", 11, &fam));
  fam = (tally_counter_options){1025, TALLY_POLICY_RANDOM};
  EXPECT_RC(TALLY_ESHARDS, tally_family_set(s, "bad:*", 5, &fam));
  fam = (tally_counter_options){4, 17};
  EXPECT_RC(TALLY_EPOLICY, tally_family_set(s, "bad:*", 5, &fam));
  EXPECT_FAILS(tally_family_set(s, "", 0, &fam));
  EXPECT_OK(tally_family_resolve(s, "bad:1", 5, &o));
  EXPECT_I64(TALLY_SHARDS_AUTO, o.shards);

  EXPECT_OK(tally_family_resolve(s, "fam:1:likes", 11, &o));
  EXPECT_I64(8, o.shards);
  EXPECT_I64(TALLY_POLICY_RANDOM, o.policy);
  EXPECT_OK(tally_family_resolve(s, "fam:1:views", 11, &o));
  EXPECT_I64(TALLY_SHARDS_AUTO, o.shards);

  /* two patterns of one 32-bit hash would share a cap's count: the
   * second is refused, the first stays as it was */
  fam = (tally_counter_options){3, TALLY_POLICY_RANDOM};
  EXPECT_OK(tally_family_set(s, "f22572:*", 8, &fam));
  EXPECT_RC(TALLY_EINVAL, tally_family_set(s, "f49913:*", 8, &fam));
  EXPECT(strstr(tally_errmsg(), "has the hash of family 'f22572:*'") != NULL);
  EXPECT_OK(tally_family_resolve(s, "f49913:1", 8, &o));
  EXPECT_I64(TALLY_SHARDS_AUTO, o.shards);
  fam = (tally_counter_options){5, TALLY_POLICY_RANDOM};
  EXPECT_OK(tally_family_set(s, "f22572:*", 8, &fam)); /* its own pattern, again */
  EXPECT_OK(tally_family_resolve(s, "f22572:1", 8, &o));
  EXPECT_I64(5, o.shards);

  /* a later, broader family wins where both match */
  fam = (tally_counter_options){4, TALLY_POLICY_ROUND_ROBIN};
  EXPECT_OK(tally_family_set(s, "fam:*", 5, &fam));
  EXPECT_OK(tally_family_resolve(s, "fam:1:likes", 11, &o));
  EXPECT_I64(4, o.shards);
  EXPECT_I64(TALLY_POLICY_ROUND_ROBIN, o.policy);
  EXPECT_OK(tally_family_resolve(s, "fam:1:views", 11, &o));
  EXPECT_I64(4, o.shards);

  /* a later, narrower one wins for what it matches */
  fam = (tally_counter_options){2, TALLY_POLICY_KEY};
  EXPECT_OK(tally_family_set(s, "fam:9*", 6, &fam));
  EXPECT_OK(tally_family_resolve(s, "fam:99:likes", 12, &o));
  EXPECT_I64(2, o.shards);
  EXPECT_I64(TALLY_POLICY_KEY, o.policy);
  EXPECT_OK(tally_family_resolve(s, "fam:1:likes", 11, &o));
  EXPECT_I64(4, o.shards);

  /* defining a family again with the options it has adds no record,
   * unless a newer overlapping family would lose its precedence */
  {
    tally_store_stats st0, st1;
    fam = (tally_counter_options){3, TALLY_POLICY_RANDOM};
    EXPECT_OK(tally_family_set(s, "solo:*", 6, &fam));
    EXPECT_OK(tally_store_stats_get(s, &st0));
    for (int i = 0; i < 100; i++) EXPECT_OK(tally_family_set(s, "solo:*", 6, &fam));
    fam = (tally_counter_options){2, TALLY_POLICY_KEY};
    EXPECT_OK(tally_family_set(s, "fam:9*", 6, &fam)); /* newer, no overlap */
    fam = (tally_counter_options){3, TALLY_POLICY_RANDOM};
    EXPECT_OK(tally_family_set(s, "solo:*", 6, &fam));
    EXPECT_OK(tally_store_stats_get(s, &st1));
    EXPECT_I64(st0.used_bytes, st1.used_bytes);
    fam = (tally_counter_options){5, TALLY_POLICY_RANDOM};
    EXPECT_OK(tally_family_set(s, "solo:a*", 7, &fam)); /* newer, overlapping */
    fam = (tally_counter_options){3, TALLY_POLICY_RANDOM};
    EXPECT_OK(tally_family_set(s, "solo:*", 6, &fam)); /* takes precedence back */
    EXPECT_OK(tally_family_resolve(s, "solo:ab", 7, &o));
    EXPECT_I64(3, o.shards);
    EXPECT_OK(tally_store_stats_get(s, &st0));
    EXPECT(st0.used_bytes > st1.used_bytes);
    /* the same options under another policy are not the same */
    fam = (tally_counter_options){3, TALLY_POLICY_THREAD};
    EXPECT_OK(tally_family_set(s, "solo:*", 6, &fam));
    EXPECT_OK(tally_family_resolve(s, "solo:x", 6, &o));
    EXPECT_I64(TALLY_POLICY_THREAD, o.policy);
  }

  /* counters created under a family take its options */
  EXPECT_OK(tally_counter_open(s, "fam:99:x", 8, NULL, TALLY_COUNTER_CREATE, &c));
  if (c) {
    EXPECT_OK(tally_counter_info_get(c, &inf));
    EXPECT_I64(2, inf.shards);
    EXPECT_I64(TALLY_POLICY_KEY, inf.policy);
    tally_counter_close(c);
    c = NULL;
  }
  o = (tally_counter_options){0, -1};
  EXPECT_OK(tally_counter_open(s, "fam:5:x", 7, &o, TALLY_COUNTER_CREATE, &c));
  if (c) {
    EXPECT_OK(tally_counter_info_get(c, &inf));
    EXPECT_I64(4, inf.shards);
    EXPECT_I64(TALLY_POLICY_ROUND_ROBIN, inf.policy);
    tally_counter_close(c);
    c = NULL;
  }
  /* explicit options beat the family */
  o = (tally_counter_options){3, TALLY_POLICY_RANDOM};
  EXPECT_OK(tally_counter_open(s, "fam:6:x", 7, &o, TALLY_COUNTER_CREATE, &c));
  if (c) {
    EXPECT_OK(tally_counter_info_get(c, &inf));
    EXPECT_I64(3, inf.shards);
    EXPECT_I64(TALLY_POLICY_RANDOM, inf.policy);
    tally_counter_close(c);
    c = NULL;
  }

  /* redefining replaces; fields left 0/-1 fall back to the defaults */
  fam = (tally_counter_options){3, TALLY_POLICY_KEY};
  EXPECT_OK(tally_family_set(s, "solo:*", 6, &fam));
  EXPECT_OK(tally_family_resolve(s, "solo:a", 6, &o));
  EXPECT_I64(3, o.shards);
  EXPECT_I64(TALLY_POLICY_KEY, o.policy);
  fam = (tally_counter_options){5, -1};
  EXPECT_OK(tally_family_set(s, "solo:*", 6, &fam));
  EXPECT_OK(tally_family_resolve(s, "solo:a", 6, &o));
  EXPECT_I64(5, o.shards);
  EXPECT_I64(TALLY_POLICY_THREAD, o.policy);
  fam = (tally_counter_options){0, TALLY_POLICY_RANDOM};
  EXPECT_OK(tally_family_set(s, "solo:*", 6, &fam));
  EXPECT_OK(tally_family_resolve(s, "solo:a", 6, &o));
  EXPECT_I64(TALLY_SHARDS_AUTO, o.shards);
  EXPECT_I64(TALLY_POLICY_RANDOM, o.policy);
  {
    /* NULL options: refused, or taken as all defaults */
    int rc = tally_family_set(s, "solo:*", 6, NULL);
    atomic_fetch_add(&tu_checks, 1);
    if (rc != 0 && rc != TALLY_EINVAL)
      TU_FAIL("family_set(NULL opt) -> %s", tally_err_name(rc));
    EXPECT_OK(tally_family_resolve(s, "solo:a", 6, &o));
    EXPECT_I64(TALLY_SHARDS_AUTO, o.shards);
    EXPECT_I64(rc == 0 ? TALLY_POLICY_THREAD : TALLY_POLICY_RANDOM, o.policy);
  }

  /* many families (more than a small fixed table) */
  for (int i = 0; i < 300; i++) {
    char pat[32];
    int len = snprintf(pat, sizeof pat, "many:%d:*", i);
    fam = (tally_counter_options){(uint32_t)(i % 1024) + 1, i % 4};
    EXPECT_OK(tally_family_set(s, pat, (size_t)len, &fam));
  }
  for (int i = 0; i < 300; i += 37) {
    char nm[32];
    int len = snprintf(nm, sizeof nm, "many:%d:q", i);
    EXPECT_OK(tally_family_resolve(s, nm, (size_t)len, &o));
    EXPECT_I64(i % 1024 + 1, o.shards);
    EXPECT_I64(i % 4, o.policy);
  }
  for (int i = 0; i < 3; i++) {
    EXPECT_OK(tally_store_drop(s,
                               i == 0   ? "fam:99:x"
                               : i == 1 ? "fam:5:x"
                                        : "fam:6:x",
                               i == 0 ? 8 : 7));
  }
}

static void test_each_sum(tally_store *s) {
  tally_counter *c;
  int64_t sum = -1;
  uint64_t count = 99;
  for (int i = 1; i <= 5; i++) {
    char nm[32];
    snprintf(nm, sizeof nm, "es:%d:likes", i);
    REQUIRE_OK(
        tu_counter(s, nm, (uint32_t)i, TALLY_POLICY_RANDOM, TALLY_COUNTER_CREATE, &c));
    EXPECT_OK(tally_counter_incr(c, i * 10));
    tally_counter_close(c);
    snprintf(nm, sizeof nm, "es:%d:views", i);
    REQUIRE_OK(tu_counter(s, nm, 2, TALLY_POLICY_RANDOM, TALLY_COUNTER_CREATE, &c));
    EXPECT_OK(tally_counter_incr(c, -i));
    tally_counter_close(c);
  }
  EXPECT_OK(tally_store_sum(s, "es:*:likes", 10, &sum, &count));
  EXPECT_I64(150, sum);
  EXPECT_I64(5, count);
  EXPECT_OK(tally_store_sum(s, "es:*", 4, &sum, &count));
  EXPECT_I64(150 - 15, sum);
  EXPECT_I64(10, count);
  EXPECT_OK(tally_store_sum(s, "es:?:views", 10, &sum, NULL));
  EXPECT_I64(-15, sum);
  EXPECT_OK(tally_store_sum(s, "nomatch*", 8, &sum, &count));
  EXPECT_I64(0, sum);
  EXPECT_I64(0, count);
  EXPECT_RC(TALLY_EINVAL, tally_store_sum(s, "es:*", 4, NULL, &count));

  struct each_ctx e;
  memset(&e, 0, sizeof e);
  EXPECT_OK(tally_store_each(s, "es:*:likes", 10, each_cb, &e));
  EXPECT_I64(5, e.n);
  EXPECT(seen(&e, "es:1:likes") && seen(&e, "es:5:likes") && !seen(&e, "es:1:views"));
  memset(&e, 0, sizeof e);
  e.stop_at = 3;
  EXPECT_RC(42, tally_store_each(s, "es:*", 4, each_cb, &e));
  EXPECT_I64(3, e.n);
  memset(&e, 0, sizeof e);
  EXPECT_OK(tally_store_each(s, "es:3:*", 6, each_cb, &e));
  EXPECT_I64(2, e.n);
  EXPECT_RC(TALLY_EINVAL, tally_store_each(s, "*", 1, NULL, &e));

  /* values: the same walk, each counter with its value */
  struct values_ctx x;
  memset(&x, 0, sizeof x);
  EXPECT_OK(tally_store_values(s, "es:*", 4, values_cb, &x));
  EXPECT_I64(10, x.n);
  EXPECT_I64(150 - 15, x.total);
  EXPECT_I64(30, value_seen(&x, "es:3:likes"));
  EXPECT_I64(-4, value_seen(&x, "es:4:views"));
  memset(&x, 0, sizeof x);
  x.stop_at = 4;
  EXPECT_RC(43, tally_store_values(s, "es:*", 4, values_cb, &x));
  EXPECT_I64(4, x.n);
  EXPECT_RC(TALLY_EINVAL, tally_store_values(s, "*", 1, NULL, &x));
  EXPECT_RC(TALLY_EINVAL, tally_store_values(NULL, "*", 1, values_cb, &x));
  /* a value beyond int64 (three shards of 2^62 - 1 sum past INT64_MAX) is
   * left out, the others are not */
  REQUIRE_OK(tu_counter(s, "es:big", 3, TALLY_POLICY_RANDOM, TALLY_COUNTER_CREATE, &c));
  for (uint32_t k = 0; k < 3; k++)
    EXPECT_OK(tally_counter_incr_shard(c, k, (INT64_C(1) << 62) - 1));
  int64_t big;
  EXPECT_RC(TALLY_ERANGE, tally_counter_value(c, &big));
  memset(&x, 0, sizeof x);
  EXPECT_OK(tally_store_values(s, "es:*", 4, values_cb, &x));
  EXPECT_I64(10, x.n);
  EXPECT_I64(INT64_MIN, value_seen(&x, "es:big"));
  tally_counter_close(c);
  EXPECT_OK(tally_store_drop(s, "es:big", 6));

  /* NULL and "*" list everything; equal to stats.counters */
  tally_store_stats st;
  EXPECT_OK(tally_store_stats_get(s, &st));
  memset(&e, 0, sizeof e);
  EXPECT_OK(tally_store_each(s, NULL, 0, each_cb, &e));
  EXPECT_I64(st.counters, e.n);
  memset(&e, 0, sizeof e);
  EXPECT_OK(tally_store_each(s, "*", 1, each_cb, &e));
  EXPECT_I64(st.counters, e.n);

  /* dropped counters disappear from each/sum/values */
  EXPECT_OK(tally_store_drop(s, "es:5:likes", 10));
  EXPECT_OK(tally_store_sum(s, "es:*:likes", 10, &sum, &count));
  EXPECT_I64(100, sum);
  EXPECT_I64(4, count);
  memset(&x, 0, sizeof x);
  EXPECT_OK(tally_store_values(s, "es:*:likes", 10, values_cb, &x));
  EXPECT_I64(4, x.n);
  EXPECT_I64(INT64_MIN, value_seen(&x, "es:5:likes"));
  for (int i = 1; i <= 5; i++) {
    char nm[32];
    int len = snprintf(nm, sizeof nm, "es:%d:views", i);
    EXPECT_OK(tally_store_drop(s, nm, (size_t)len));
    len = snprintf(nm, sizeof nm, "es:%d:likes", i);
    if (i < 5) EXPECT_OK(tally_store_drop(s, nm, (size_t)len));
  }
  EXPECT_OK(tally_store_sum(s, "es:*", 4, &sum, &count));
  EXPECT_I64(0, count);
}

/* Bytes ever left behind: retired bytes become reusable once a grace step
 * passes, and reused when handed out again, so only this sum never
 * shrinks between two reads. */
static uint64_t left_behind(const tally_store_stats *st) {
  return st->retired_bytes + st->reusable_bytes + st->reused_bytes;
}

static void test_stats(tally_store *s, int is_file) {
  tally_store_stats a, b;
  tally_counter *c;
  EXPECT_RC(TALLY_EINVAL, tally_store_stats_get(s, NULL));
  EXPECT_OK(tally_store_stats_get(s, &a));
  /* shard counts no other test uses, so new chunks are needed */
  REQUIRE_OK(tu_counter(s, "stats:a", 77, TALLY_POLICY_THREAD, TALLY_COUNTER_CREATE, &c));
  EXPECT_OK(tally_store_stats_get(s, &b));
  EXPECT_I64(a.counters + 1, b.counters);
  if (is_file) {
    EXPECT(b.used_bytes >= a.used_bytes + 77 * 8);
    EXPECT(b.file_bytes >= b.used_bytes);
    EXPECT(b.file_bytes > 0);
  }
  EXPECT_OK(tally_counter_reshard(c, 99));
  EXPECT_OK(tally_store_stats_get(s, &a));
  EXPECT_I64(b.counters, a.counters);
  if (is_file) EXPECT(left_behind(&a) >= left_behind(&b) + 77 * 8);
  tally_counter_close(c);
  EXPECT_OK(tally_store_drop(s, "stats:a", 7));
  EXPECT_OK(tally_store_stats_get(s, &b));
  EXPECT_I64(a.counters - 1, b.counters);
  if (is_file) EXPECT(left_behind(&b) >= left_behind(&a) + 99 * 8);
}

static void suite(tally_store *s, int is_file) {
  test_open_errors(s);
  test_incr_and_range(s);
  test_policies_incr(s);
  test_counter_ops(s);
  test_families(s);
  test_each_sum(s);
  test_stats(s, is_file);
  EXPECT_OK(tally_store_sync(s));
  EXPECT_OK(tally_store_check(s));
}

/* ---- store open ---------------------------------------------------------- */

static void test_store_kinds(void) {
  tally_store *s = NULL;
  const char *specs[] = {NULL, "", "memory"};
  for (int i = 0; i < 3; i++) {
    s = NULL;
    EXPECT_OK(tally_store_open(specs[i], NULL, &s));
    if (s) {
      EXPECT_STR("memory", tally_store_kind(s));
      EXPECT_OK(tally_store_sync(s));
      EXPECT_OK(tally_store_check(s));
      tally_store_close(s);
    }
  }
  s = (tally_store *)0x1;
  EXPECT_RC(TALLY_EINVAL, tally_store_open("bogus:xyz", NULL, &s));
  EXPECT(strstr(tally_errmsg(), "bogus") != NULL);
  EXPECT_RC(TALLY_EINVAL, tally_store_open("file:", NULL, &s));
  EXPECT_RC(TALLY_EINVAL, tally_store_open("memoryx", NULL, &s));
  EXPECT(s == (tally_store *)0x1);
  /* missing directory: ESYS with the file name */
  char spec[1200];
  snprintf(spec, sizeof spec, "file:%s/no/such/dir/x.tly", g_dir);
  EXPECT_RC(TALLY_ESYS, tally_store_open(spec, NULL, &s));
  EXPECT(strstr(tally_errmsg(), "no/such/dir/x.tly") != NULL);
  EXPECT(s == (tally_store *)0x1);
  /* a directory is not a store */
  snprintf(spec, sizeof spec, "file:%s", g_dir);
  {
    int rc = tally_store_open(spec, NULL, &s);
    atomic_fetch_add(&tu_checks, 1);
    if (rc == 0) {
      TU_FAIL("opening a directory as a store succeeded");
      tally_store_close(s);
    }
  }
}

static void test_file_open_options(void) {
  char spec[1200], path[1200];
  tally_store *s = NULL;
  struct stat st;
  tally_open_options oo = {0, 0};
  mode_t old = umask(022);

  tu_spec(spec, sizeof spec, path, sizeof path, g_dir, "mode-default.tly");
  EXPECT_OK(tally_store_open(spec, NULL, &s));
  tally_store_close(s);
  EXPECT(stat(path, &st) == 0 && (st.st_mode & 0777) == 0600);

  tu_spec(spec, sizeof spec, path, sizeof path, g_dir, "mode-zero.tly");
  s = NULL;
  EXPECT_OK(tally_store_open(spec, &oo, &s));
  tally_store_close(s);
  EXPECT(stat(path, &st) == 0 && (st.st_mode & 0777) == 0600);

  tu_spec(spec, sizeof spec, path, sizeof path, g_dir, "mode-0640.tly");
  oo.mode = 0640;
  s = NULL;
  EXPECT_OK(tally_store_open(spec, &oo, &s));
  tally_store_close(s);
  EXPECT(stat(path, &st) == 0 && (st.st_mode & 0777) == 0640);
  /* mode does not change an existing file */
  oo.mode = 0600;
  s = NULL;
  EXPECT_OK(tally_store_open(spec, &oo, &s));
  tally_store_close(s);
  EXPECT(stat(path, &st) == 0 && (st.st_mode & 0777) == 0640);

  /* NOCREATE */
  tu_spec(spec, sizeof spec, path, sizeof path, g_dir, "nocreate.tly");
  oo = (tally_open_options){0, TALLY_OPEN_NOCREATE};
  s = (tally_store *)0x1;
  {
    int rc = tally_store_open(spec, &oo, &s);
    atomic_fetch_add(&tu_checks, 1);
    if (rc >= 0) TU_FAIL("NOCREATE on a missing file -> %d", rc);
  }
  EXPECT(strstr(tally_errmsg(), "nocreate.tly") != NULL);
  { /* a success leaves the message of the most recent failure as it was */
    char spec2[1200];
    tally_store *s2 = NULL;
    tu_spec(spec2, sizeof spec2, NULL, 0, g_dir, "fresh.tly");
    EXPECT_OK(tally_store_open(spec2, NULL, &s2));
    tally_store_close(s2);
    EXPECT(strstr(tally_errmsg(), "nocreate.tly") != NULL);
  }
  EXPECT(s == (tally_store *)0x1);
  EXPECT(stat(path, &st) != 0 && errno == ENOENT);
  /* unknown flags are refused, not ignored, and create nothing */
  oo = (tally_open_options){0, 0x80};
  EXPECT_RC(TALLY_EINVAL, tally_store_open(spec, &oo, &s));
  EXPECT(s == (tally_store *)0x1);
  EXPECT(stat(path, &st) != 0 && errno == ENOENT);
  oo = (tally_open_options){0, TALLY_OPEN_NOCREATE};
  tu_spec(spec, sizeof spec, path, sizeof path, g_dir, "mode-default.tly");
  s = NULL;
  EXPECT_OK(tally_store_open(spec, &oo, &s));
  if (s) EXPECT_STR("file", tally_store_kind(s));
  tally_store_close(s);
  umask(old);

  /* permission denied gives ESYS with the file name (skipped as root) */
  if (geteuid() != 0) {
    tu_spec(spec, sizeof spec, path, sizeof path, g_dir, "mode-0640.tly");
    chmod(path, 0);
    EXPECT_RC(TALLY_ESYS, tally_store_open(spec, NULL, &s));
    EXPECT(strstr(tally_errmsg(), "mode-0640.tly") != NULL);
  }
}

struct big_ctx {
  uint64_t n;
};
static int count_cb(void *ud, const char *name, size_t len) {
  (void)name;
  (void)len;
  ((struct big_ctx *)ud)->n++;
  return 0;
}

static void test_file_reopen_and_many(void) {
  char spec[1200], path[1200];
  tally_store *s = NULL, *s2 = NULL;
  tally_counter *c = NULL, *c2 = NULL;
  tu_spec(spec, sizeof spec, path, sizeof path, g_dir, "reopen.tly");

  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  tally_counter_options fam = {7, TALLY_POLICY_ROUND_ROBIN};
  EXPECT_OK(tally_family_set(s, "r:*", 3, &fam));
  REQUIRE_OK(tu_counter(s, "keep", 32, TALLY_POLICY_RANDOM, TALLY_COUNTER_CREATE, &c));
  EXPECT_OK(tally_counter_incr(c, 123456789));
  EXPECT_OK(tally_counter_reshard(c, 3));
  EXPECT_OK(tally_counter_incr(c, -9));

  /* a second open in the same process sees the same counters live */
  EXPECT_OK(tally_store_open(spec, NULL, &s2));
  if (s2) {
    EXPECT_OK(tu_counter(s2, "keep", 0, -1, 0, &c2));
    if (c2) {
      EXPECT_I64(123456780, tu_value(c2));
      EXPECT_OK(tally_counter_incr(c2, 20));
      EXPECT_I64(123456800, tu_value(c));
      tally_counter_close(c2);
    }
    EXPECT_OK(tally_store_drop(s2, "keep", 4));
    tally_store_close(s2);
  }
  /* we just dropped it through s2: the handle on s sees EDROPPED */
  EXPECT_RC(TALLY_EDROPPED, tally_counter_incr(c, 1));
  tally_counter_close(c);
  REQUIRE_OK(tu_counter(s, "keep", 32, TALLY_POLICY_RANDOM, TALLY_COUNTER_CREATE, &c));
  EXPECT_OK(tally_counter_incr(c, 123456800));
  tally_counter_close(c);

  /* many counters: index growth and file growth */
  const int N = 200000;
  tally_store_stats st0, st1;
  EXPECT_OK(tally_store_stats_get(s, &st0));
  double t0 = tu_now();
  int created = 0;
  for (int i = 0; i < N && tu_now() - t0 < 120; i++) {
    char nm[32];
    int len = snprintf(nm, sizeof nm, "m:%d", i);
    tally_counter_options o = {(uint32_t)(i % 4 == 0 ? 16 : 1 + i % 3),
                               TALLY_POLICY_RANDOM};
    int rc = tally_counter_open(s, nm, (size_t)len, &o, TALLY_COUNTER_CREATE, &c);
    if (rc != 0) {
      TU_FAIL("creating counter %d of %d -> %d %s (%s)", i, N, rc, tally_err_name(rc),
              tally_errmsg());
      break;
    }
    rc = tally_counter_incr(c, i);
    if (rc != 0) TU_FAIL("incr m:%d -> %s", i, tally_err_name(rc));
    tally_counter_close(c);
    created++;
  }
  double t1 = tu_now();
  EXPECT_I64(N, created);
  EXPECT_OK(tally_store_stats_get(s, &st1));
  EXPECT_I64(st0.counters + (uint64_t)created, st1.counters);
  EXPECT(st1.file_bytes > st0.file_bytes);
  printf(
      "  file store: created %d counters in %.2f s; file %llu -> %llu bytes, used %llu\n",
      created, t1 - t0, (unsigned long long)st0.file_bytes,
      (unsigned long long)st1.file_bytes, (unsigned long long)st1.used_bytes);
  /* lookups of every one */
  int bad = 0;
  for (int i = 0; i < created; i++) {
    char nm[32];
    int len = snprintf(nm, sizeof nm, "m:%d", i);
    int64_t v = -1;
    if (tally_counter_open(s, nm, (size_t)len, NULL, 0, &c) != 0 ||
        tally_counter_value(c, &v) != 0 || v != i) {
      if (bad++ < 5) TU_FAIL("m:%d reads %lld (%s)", i, (long long)v, tally_errmsg());
    } else {
      tally_counter_close(c);
    }
  }
  EXPECT_I64(0, bad);
  EXPECT_OK(tally_store_sync(s));
  EXPECT_OK(tally_store_check(s));
  tally_store_close(s);
  {
    struct stat fst;
    EXPECT(stat(path, &fst) == 0 && (uint64_t)fst.st_size == st1.file_bytes);
  }

  /* reopen: the data, the families, the index are all there */
  s = NULL;
  t0 = tu_now();
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  printf("  reopen of %d counters took %.3f ms\n", created, (tu_now() - t0) * 1e3);
  EXPECT_STR("file", tally_store_kind(s));
  EXPECT_OK(tally_store_check(s));
  REQUIRE_OK(tu_counter(s, "keep", 0, -1, 0, &c));
  EXPECT_I64(123456800, tu_value(c));
  tally_counter_info inf;
  EXPECT_OK(tally_counter_info_get(c, &inf));
  EXPECT_I64(32, inf.shards);
  EXPECT_I64(TALLY_POLICY_RANDOM, inf.policy);
  tally_counter_close(c);
  tally_counter_options o;
  EXPECT_OK(tally_family_resolve(s, "r:x", 3, &o));
  EXPECT_I64(7, o.shards);
  EXPECT_I64(TALLY_POLICY_ROUND_ROBIN, o.policy);
  bad = 0;
  for (int i = 0; i < created; i += 7) {
    char nm[32];
    int len = snprintf(nm, sizeof nm, "m:%d", i);
    int64_t v = -1;
    if (tally_counter_open(s, nm, (size_t)len, NULL, 0, &c) != 0 ||
        tally_counter_value(c, &v) != 0 || v != i) {
      if (bad++ < 5)
        TU_FAIL("after reopen m:%d reads %lld (%s)", i, (long long)v, tally_errmsg());
    } else {
      tally_counter_close(c);
    }
  }
  EXPECT_I64(0, bad);
  int64_t sum = 0;
  uint64_t count = 0;
  EXPECT_OK(tally_store_sum(s, "m:*", 3, &sum, &count));
  EXPECT_I64((int64_t)created * (created - 1) / 2, sum);
  EXPECT_I64(created, count);
  struct big_ctx bc = {0};
  EXPECT_OK(tally_store_each(s, "m:1*", 4, count_cb, &bc));
  {
    uint64_t want = 0;
    for (int i = 0; i < created; i++) {
      char nm[32];
      snprintf(nm, sizeof nm, "%d", i);
      want += nm[0] == '1';
    }
    EXPECT_I64(want, bc.n);
  }
  /* drop half, check, reopen again */
  for (int i = 0; i < created; i += 2) {
    char nm[32];
    int len = snprintf(nm, sizeof nm, "m:%d", i);
    int rc = tally_store_drop(s, nm, (size_t)len);
    if (rc != 0) {
      TU_FAIL("drop m:%d -> %s", i, tally_err_name(rc));
      break;
    }
  }
  EXPECT_OK(tally_store_check(s));
  tally_store_close(s);
  s = NULL;
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  EXPECT_OK(tally_store_sum(s, "m:*", 3, &sum, &count));
  EXPECT_I64(created / 2, count);
  EXPECT_OK(tally_store_check(s));
  tally_store_close(s);
}

/* The name hash places every counter in a file's index and seals its
 * record: it is part of the file format. These are its values at format 7;
 * a change of the hash must fail here, not in a user's old store. */
uint64_t tally__hash(const void *data, size_t len, uint64_t seed); /* hash.c */
void tally__hash2(const void *data, size_t len, uint64_t seed0, uint64_t seed1,
                  uint64_t out[2]);

static void test_hash_is_format(void) {
  static const struct {
    const char *in;
    uint64_t want;
  } golden[] = {
      {"", UINT64_C(0x9ea9b34bd3d23fb8)},
      {"a", UINT64_C(0xf173d1b64bd51110)},
      {"ab", UINT64_C(0x16b923a1ef7538ed)},
      {"abc", UINT64_C(0xe7c627a2e8bb4557)},
      {"abcd", UINT64_C(0x0e6f70732150e143)},
      {"abcde", UINT64_C(0x2193a9aa8dd2470d)},
      {"abcdef", UINT64_C(0x9e3f496b3a629925)},
      {"abcdefg", UINT64_C(0xff017172dce22096)},
      {"abcdefgh", UINT64_C(0xd5136c6a34751f02)},
      {"post:123:likes", UINT64_C(0xb93552009c5f11a2)},
      {"http_request_duration_seconds{le=+Inf}", UINT64_C(0xfcc62dc215716c83)},
  };
  for (size_t i = 0; i < sizeof golden / sizeof golden[0]; i++) {
    char buf[64];
    size_t len = strlen(golden[i].in);
    EXPECT(tally__hash(golden[i].in, len, 0x5eed) == golden[i].want);
    memcpy(buf + 3, golden[i].in, len); /* unaligned: the same */
    EXPECT(tally__hash(buf + 3, len, 0x5eed) == golden[i].want);
    uint64_t two[2]; /* two seeds in one pass: each as tally__hash */
    tally__hash2(golden[i].in, len, 0x5eed, 0, two);
    EXPECT(two[0] == golden[i].want);
    EXPECT(two[1] == tally__hash(golden[i].in, len, 0));
  }
  unsigned char bytes[300];
  for (size_t i = 0; i < sizeof bytes; i++) bytes[i] = (unsigned char)(i * 131 + 7);
  for (size_t len = 0; len <= 256; len++) {
    uint64_t two[2];
    tally__hash2(bytes + len % 5, len, len * 77, ~len, two);
    EXPECT(two[0] == tally__hash(bytes + len % 5, len, len * 77));
    EXPECT(two[1] == tally__hash(bytes + len % 5, len, ~len));
  }
}

int main(void) {
  tally_store *s = NULL;
  char spec[1200];
  snprintf(g_dir, sizeof g_dir, "%s", tu_tmpdir("api"));

  test_errors();
  test_error_text();
  test_hash_is_format();
  test_policies();
  test_glob();
  test_null_handles();
  test_store_kinds();

  REQUIRE_OK(tally_store_open("memory", NULL, &s));
  suite(s, 0);
  tally_store_close(s);
  printf("  memory store suite done (%d failures so far)\n", atomic_load(&tu_failures));

  tu_spec(spec, sizeof spec, NULL, 0, g_dir, "suite.tly");
  REQUIRE_OK(tally_store_open(spec, NULL, &s));
  EXPECT_STR("file", tally_store_kind(s));
  suite(s, 1);
  tally_store_close(s);
  printf("  file store suite done (%d failures so far)\n", atomic_load(&tu_failures));

  test_file_open_options();
  test_file_reopen_and_many();
  tu_rmrf(g_dir);
  return tu_finish("test_api");
}
