/* lua_export.c -- db:export and db:import of a local store, streamed.
 *
 * The text is lua/tally/export.lua's (the Firestore counters/shards layout,
 * one counter per line, names sorted bytewise); this file makes it fast at a
 * million counters without holding the document or a table per counter.
 *
 * core.export_write(db, pattern, quote, write) walks the store once in the
 * names' order (tally_store_rows with TALLY_ROWS_CELLS: no handle per
 * counter) and hands the text to write(chunk) in pieces of about 64 KiB.
 *
 * core.importer(db, mode, quote) checks a document that lua-cjson decoded
 * a piece at a time (imp:check), and keeps each checked counter in a spool
 * file; once all of it is checked, imp:apply(k) applies the next k, each
 * shard's add logged in an undo file that imp:undo() reads back. A piece is
 * taken only if it is byte for byte what export would write for what cjson
 * made of it, its names after the last piece's; anything else (another
 * layout, a key given twice, a bad count, a counter the store cannot take)
 * answers false, and export.lua checks the whole document its own way,
 * with its messages. So no JSON is parsed here, and no rule of the format
 * is written twice: the writer below is export's, names that are not plain
 * go through tally.json's quote.
 *
 * Names are bytes with no NUL; a Lua error never unwinds through the walk
 * (each call into Lua from it is under lua_pcall).
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "lua_aux.h"

#define TL_IMPORTER_MT "tally.importer"
#define CHUNK          65536 /* what export hands write at a time, about */
#define SAFE           INT64_C(9007199254740991) /* 2^53-1: a double holds it */
#define SHARD_MIN      (-(INT64_C(1) << 62))
#define SHARD_MAX      ((INT64_C(1) << 62) - 1)

/* ---- the text of a counter, as export writes it ------------------------ */

struct text {
  char *p;
  size_t n, cap;
};

static int room(struct text *t, size_t k) {
  if (t->cap - t->n >= k) return 0;
  size_t cap = t->cap ? t->cap : 4096;
  while (cap - t->n < k) cap *= 2;
  char *p = (char *)realloc(t->p, cap);
  if (p == NULL) return TALLY_ENOMEM;
  t->p = p;
  t->cap = cap;
  return 0;
}

static int put(struct text *t, const char *s, size_t len) {
  if (room(t, len)) return TALLY_ENOMEM;
  memcpy(t->p + t->n, s, len);
  t->n += len;
  return 0;
}

/* Bytes that tally.json's quote writes as they are (printable ASCII but
 * '"' and '\'): such a name is written here, any other goes through quote. */
static int plain(const char *s, size_t len) {
  for (size_t i = 0; i < len; i++) {
    unsigned char c = (unsigned char)s[i];
    if (c < 0x20 || c > 0x7e || c == '"' || c == '\\') return 0;
  }
  return 1;
}

/* "policy" as export writes it: c:info().policy's words. */
static const char *policy_text(int32_t policy) {
  return tl_policy_label(policy);
}

/* The line of one counter: quoted is its name as JSON (with the quotes)
 * when not plain, else NULL and the name is written as it is. */
static int put_counter(struct text *t, const char *name, size_t len, const char *quoted,
                       size_t qlen, int32_t policy, uint32_t n, const int64_t *cells) {
  const char *pt = policy_text(policy);
  if (room(t, len + qlen + strlen(pt) + 64 + (size_t)n * 48)) return TALLY_ENOMEM;
  char *o = t->p + t->n;
  if (quoted) {
    memcpy(o, quoted, qlen);
    o += qlen;
  } else {
    *o++ = '"';
    memcpy(o, name, len);
    o += len;
    *o++ = '"';
  }
  o += sprintf(o, ":{\"num_shards\":%u,\"policy\":\"%s\",\"shards\":{", (unsigned)n, pt);
  for (uint32_t i = 0; i < n; i++) {
    int64_t v = cells[i];
    const char *q = v >= -SAFE && v <= SAFE ? "" : "\""; /* beyond: a string */
    o += sprintf(o, "%s\"%u\":{\"count\":%s%lld%s}", i ? "," : "", (unsigned)i, q,
                 (long long)v, q);
  }
  *o++ = '}';
  *o++ = '}';
  t->n = (size_t)(o - t->p);
  return 0;
}

/* ---- export --------------------------------------------------------------- */

struct exporter {
  lua_State *L;
  int quote, write; /* stack indices of the Lua functions */
  struct text t;
  uint64_t n;          /* counters written */
  const tally_row *at; /* the row being written, for quote_call */
  int failed;          /* a Lua error, on top of the stack */
};

/* Under protect: 1 the exporter, 2 quote, 3 write (its own frame's). */
static int write_call(lua_State *L) {
  struct exporter *e = (struct exporter *)lua_touserdata(L, 1);
  lua_pushvalue(L, 3);
  lua_pushlstring(L, e->t.p, e->t.n);
  lua_call(L, 1, 0);
  return 0;
}

static int quote_call(lua_State *L) {
  struct exporter *e = (struct exporter *)lua_touserdata(L, 1);
  const tally_row *r = e->at;
  size_t qlen;
  lua_pushvalue(L, 2);
  lua_pushlstring(L, r->name, r->name_len);
  lua_call(L, 1, 1);
  const char *q = lua_tolstring(L, -1, &qlen);
  if (q == NULL) return luaL_error(L, "export: quote gave no string");
  if (put_counter(&e->t, NULL, 0, q, qlen, r->policy, r->shards, r->cells))
    return luaL_error(L, "not enough memory");
  return 0;
}

/* Run f(e) under lua_pcall: 0, or 1 with the error on top of the stack. */
static int protect(struct exporter *e, lua_CFunction f) {
  lua_pushcfunction(e->L, f);
  lua_pushlightuserdata(e->L, e);
  lua_pushvalue(e->L, e->quote); /* indices of export_write's frame */
  lua_pushvalue(e->L, e->write);
  if (lua_pcall(e->L, 3, 0, 0) == LUA_OK) return 0;
  e->failed = 1;
  return 1;
}

static int flush(struct exporter *e) {
  if (e->t.n == 0) return 0;
  if (protect(e, write_call)) return 1;
  e->t.n = 0;
  return 0;
}

static int export_row(void *ud, const tally_row *r) {
  struct exporter *e = (struct exporter *)ud;
  const char *sep = e->n ? ",\n" : "{\"counters\":{\n";
  if (put(&e->t, sep, strlen(sep))) return TALLY_ENOMEM;
  e->n++;
  if (plain(r->name, r->name_len)) {
    if (put_counter(&e->t, r->name, r->name_len, NULL, 0, r->policy, r->shards, r->cells))
      return TALLY_ENOMEM;
  } else {
    e->at = r;
    if (protect(e, quote_call)) return 1;
  }
  return e->t.n >= CHUNK ? flush(e) : 0;
}

/* core.export_write(db, pattern|nil, quote, write) -> true, after write
 * got the whole text; nil, msg, code if reading the store fails (write
 * may have had part of it). Raises what quote or write raise. */
static int tl_export_write(lua_State *L) {
  tl_store *d = tl_checkstore(L, 1);
  size_t plen = 0;
  const char *pattern = lua_isnoneornil(L, 2) ? NULL : luaL_checklstring(L, 2, &plen);
  luaL_checktype(L, 3, LUA_TFUNCTION);
  luaL_checktype(L, 4, LUA_TFUNCTION);
  lua_settop(L, 4);
  luaL_checkstack(L, 8, NULL);
  struct exporter e = {L, 3, 4, {NULL, 0, 0}, 0, NULL, 0};
  d->walking++; /* quote and write run inside the walk: db:close must wait */
  int rc = tally_store_rows(d->store, pattern, plen,
                            TALLY_ROWS_BY_NAME | TALLY_ROWS_CELLS, export_row, &e);
  d->walking--;
  if (rc == 0) {
    const char *end = e.n ? "\n}}\n" : "{\"counters\":{}}\n";
    rc = put(&e.t, end, strlen(end));
    if (rc == 0) rc = flush(&e);
  }
  free(e.t.p);
  if (e.failed) return lua_error(L); /* quote's or write's error, on top */
  if (rc == TALLY_ENOMEM) return luaL_error(L, "not enough memory");
  if (rc < 0) return tl_fail(L, rc);
  lua_pushboolean(L, 1);
  return 1;
}

/* ---- import ---------------------------------------------------------------- */

/* A spooled counter: what the check found, read back by apply. */
struct spooled {
  uint8_t len;     /* the name's */
  uint8_t existed; /* when checked: not made by the import */
  int8_t policy;
  uint8_t pad;
  uint32_t shards;
  uint64_t incarnation; /* the existing counter's, when checked */
};

/* An entry of the undo log: n added to shard (0-based; SLOT: by one incr,
 * to a slot or cpu counter) of the counter of that incarnation, or (shard
 * CREATED) a counter the import made. The name follows. */
struct undone {
  uint8_t len;
  uint8_t pad[3];
  uint32_t shard;
  uint64_t incarnation;
  int64_t n;
};
#define SLOT     UINT32_MAX
#define CREATED  (UINT32_MAX - 1)
#define ULOG_BUF (1 << 20)

struct entry {
  const char *name;
  size_t len;
};

typedef struct importer {
  tl_store *db; /* kept alive through the user value */
  int add;      /* mode "add", else "replace" */
  FILE *spool;
  int undo;         /* the undo log's file: uflen bytes written, */
  uint64_t uflen;   /* then un bytes in ubuf, the last entry ulast */
  char *ubuf;       /* of them (an entry goes in before its add is */
  size_t un, ulast; /* made, and ubuf is written out before it fills) */
  uint64_t checked, applied;
  int applying, done;
  int checking; /* inside check, which calls quote: close must wait */
  char last[TALLY_NAME_MAX];
  size_t last_len;
  int has_last;
  struct entry *e;
  size_t ne, ecap;
  struct text t;
  int64_t counts[TALLY_MAX_SHARDS], now[TALLY_MAX_SHARDS];
} importer;

/* An anonymous file in $TMPDIR (or /tmp): it goes when closed. */
static FILE *temp_file(void) {
  const char *dir = getenv("TMPDIR");
  char path[4096];
  if (dir == NULL || *dir == '\0') dir = "/tmp";
  if (snprintf(path, sizeof path, "%s/tally-import.XXXXXX", dir) >= (int)sizeof path)
    return NULL;
  int fd = mkstemp(path);
  if (fd < 0) return NULL;
  unlink(path);
  FILE *f = fdopen(fd, "w+b");
  if (f == NULL)
    close(fd);
  else
    setvbuf(f, NULL, _IOFBF, 1 << 20); /* 4 KiB writes would be 10,000 calls */
  return f;
}

static void importer_free(importer *m) {
  if (m->spool) fclose(m->spool);
  if (m->undo >= 0) close(m->undo);
  m->spool = NULL;
  m->undo = -1;
  free(m->ubuf);
  m->ubuf = NULL;
  free(m->e);
  free(m->t.p);
  m->e = NULL;
  m->t.p = NULL;
  m->t.n = m->t.cap = m->ne = m->ecap = 0;
}

static int importer_gc(lua_State *L) {
  importer_free((importer *)luaL_checkudata(L, 1, TL_IMPORTER_MT));
  return 0;
}

static importer *check_importer(lua_State *L) {
  importer *m = (importer *)luaL_checkudata(L, 1, TL_IMPORTER_MT);
  if (m->spool == NULL) luaL_error(L, "attempt to use a finished importer");
  tl_getuv(L, 1, 1);
  tl_checkstore(L, -1); /* raises if the store was closed meanwhile */
  lua_pop(L, 1);
  return m;
}

/* core.importer(db, mode) -> an importer, or nil, msg, code if its files
 * cannot be made. */
static int tl_importer(lua_State *L) {
  tl_store *d = tl_checkstore(L, 1);
  const char *mode = luaL_checkstring(L, 2);
  importer *m = (importer *)tl_newud(L, sizeof(importer), 1);
  memset(m, 0, sizeof *m);
  luaL_getmetatable(L, TL_IMPORTER_MT);
  lua_setmetatable(L, -2);
  lua_pushvalue(L, 1);
  tl_setuv(L, -2, 1);
  m->db = d;
  m->add = strcmp(mode, "add") == 0;
  m->undo = -1;
  m->spool = temp_file();
  FILE *u = m->spool ? temp_file() : NULL;
  if (u) { /* the log writes with pwrite: only its descriptor is kept */
    m->undo = dup(fileno(u));
    fclose(u);
  }
  m->ubuf = m->undo >= 0 ? (char *)malloc(ULOG_BUF) : NULL;
  if (m->ubuf == NULL) {
    int err = errno;
    importer_free(m);
    lua_pushnil(L);
    lua_pushfstring(L, "cannot make a temporary file in %s: %s",
                    getenv("TMPDIR") && *getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp",
                    strerror(err));
    lua_pushstring(L, "ESYS");
    return 3;
  }
  return 1;
}

static int by_name(const void *a, const void *b) {
  const struct entry *x = (const struct entry *)a, *y = (const struct entry *)b;
  size_t m = x->len < y->len ? x->len : y->len;
  int c = memcmp(x->name, y->name, m);
  return c ? c : (x->len > y->len) - (x->len < y->len);
}

/* The integer that the JSON count at the top of the stack stands for, as
 * export writes it: a number within +-(2^53-1) or a decimal string; 0 if
 * not one (the text comparison then tells the rest). */
static int count_at(lua_State *L, int64_t *out) {
  if (lua_type(L, -1) == LUA_TNUMBER) {
    lua_Number d = lua_tonumber(L, -1);
    if (!(d >= -(lua_Number)SAFE && d <= (lua_Number)SAFE)) return 0;
    *out = (int64_t)d;
    return (lua_Number)*out == d;
  }
  if (lua_type(L, -1) != LUA_TSTRING) return 0;
  const char *s = lua_tostring(L, -1), *p = s + (*s == '-');
  if (*p < '0' || *p > '9') return 0;
  errno = 0;
  char *end;
  long long v = strtoll(s, &end, 10);
  if (errno || *end != '\0') return 0;
  *out = (int64_t)v;
  return 1;
}

static const char *const policies[] = {"thread", "random", "round_robin", "key",
                                       "slot",   "cpu",    "function"};
static const int32_t policy_ids[] = {
    TALLY_POLICY_THREAD, TALLY_POLICY_RANDOM, TALLY_POLICY_ROUND_ROBIN, TALLY_POLICY_KEY,
    TALLY_POLICY_SLOT,   TALLY_POLICY_CPU,    TALLY_POLICY_CUSTOM};

/* A slot or cpu counter's shards are its writers' or its CPUs' (those of
 * the machine that made it, for cpu): an import takes them whole, adding
 * the difference of their sums through one increment, as export.lua's
 * whole-document path does. */
static int taken_whole(int32_t policy) {
  return policy == TALLY_POLICY_SLOT || policy == TALLY_POLICY_CPU;
}

/* The counter table at the top of the stack, as export writes one: its
 * shard count, policy and counts into m->counts; 0 if it is not one. */
static int counter_at(lua_State *L, importer *m, uint32_t *n, int32_t *policy) {
  int t = lua_gettop(L), ok = 0;
  if (!lua_istable(L, t)) return 0;
  lua_getfield(L, t, "num_shards");
  lua_getfield(L, t, "policy");
  lua_getfield(L, t, "shards");
  lua_Number d = lua_type(L, t + 1) == LUA_TNUMBER ? lua_tonumber(L, t + 1) : 0;
  const char *p = lua_type(L, t + 2) == LUA_TSTRING ? lua_tostring(L, t + 2) : "";
  *policy = -1;
  for (size_t i = 0; i < sizeof policies / sizeof *policies; i++)
    if (strcmp(p, policies[i]) == 0) *policy = policy_ids[i];
  if (d >= 1 && d <= TALLY_MAX_SHARDS && d == (lua_Number)(uint32_t)d && *policy >= 0 &&
      lua_istable(L, t + 3)) {
    *n = (uint32_t)d;
    ok = 1;
    __int128 sum = 0;
    for (uint32_t i = 0; ok && i < *n; i++) {
      char id[16];
      snprintf(id, sizeof id, "%u", (unsigned)i);
      lua_getfield(L, t + 3, id);
      ok = lua_istable(L, -1);
      if (ok) {
        lua_getfield(L, -1, "count");
        ok = count_at(L, &m->counts[i]) && m->counts[i] >= SHARD_MIN &&
             m->counts[i] <= SHARD_MAX;
        sum += m->counts[i];
        lua_pop(L, 1);
      }
      lua_pop(L, 1);
    }
    if (ok && taken_whole(*policy)) /* as export.lua's check_counter */
      ok = (*n == TALLY_SLOT_SHARDS || *policy == TALLY_POLICY_CPU) && sum >= SHARD_MIN &&
           sum <= SHARD_MAX;
  }
  lua_settop(L, t);
  return ok;
}

/* Can counter info take the document's n shards of policy? The same
 * policy, and the same shard count unless a cpu counter's (a shard per
 * CPU of the machine that made it: taken whole). export.lua's check. */
static int fits_document(const tally_counter_info *info, int32_t policy, uint32_t n) {
  return info->policy == policy && (info->shards == n || policy == TALLY_POLICY_CPU);
}

/* What the store says to the counter: 1 and whether it exists (and its
 * incarnation), if the import can take it as export.lua's check would; 0
 * if not (or the store fails: the whole document's check says how). */
static int store_takes(importer *m, const char *name, size_t len, uint32_t n,
                       int32_t policy, int *existed, uint64_t *incarnation) {
  tally_store *s = m->db->store;
  int64_t v;
  int rc = tally_store_value(s, name, len, &v);
  if (rc == TALLY_ENOENT) {
    *existed = 0;
    return policy != TALLY_POLICY_CUSTOM; /* cannot be made by an import */
  }
  if (rc != 0 && rc != TALLY_ERANGE) return 0;
  *existed = 1;
  tally_counter *c;
  tally_counter_info info;
  uint32_t have;
  if (tally_counter_open(s, name, len, NULL, 0, &c)) return 0;
  int ok = tally_counter_info_get(c, &info) == 0 && info.name_len == len &&
           memcmp(info.name, name, len) == 0 && /* not a capped family's overflow */
           fits_document(&info, policy, n);
  if (ok) *incarnation = info.incarnation;
  if (ok && m->add && policy != TALLY_POLICY_CPU) {
    ok = tally_counter_shards(c, m->now, TALLY_MAX_SHARDS, &have) == 0 && have == n;
    for (uint32_t i = 0; ok && i < n; i++) {
      int64_t sum = m->now[i] + m->counts[i]; /* both within +-2^62 */
      ok = sum >= SHARD_MIN && sum <= SHARD_MAX;
    }
  }
  tally_counter_close(c);
  return ok;
}

static int spool(importer *m, const char *name, size_t len, uint32_t n, int32_t policy,
                 int existed, uint64_t incarnation) {
  struct spooled h = {(uint8_t)len, (uint8_t)existed, (int8_t)policy, 0, n, incarnation};
  return fwrite(&h, sizeof h, 1, m->spool) == 1 &&
         fwrite(name, 1, len, m->spool) == len &&
         fwrite(m->counts, sizeof *m->counts, n, m->spool) == n;
}

/* imp:check(text, counters, quote) -> how many: counters (what cjson made of
 * "{" .. text .. "}") is checked and spooled, text being exactly the lines
 * export writes for it, joined by ",\n", its names after every name
 * checked before. false if not; nil, msg, code if the spool cannot be
 * written. Nothing is spooled from a piece that is not taken whole. */
static int tl_importer_check(lua_State *L) {
  importer *m = check_importer(L);
  size_t tlen;
  const char *text = luaL_checklstring(L, 2, &tlen);
  luaL_checktype(L, 3, LUA_TTABLE);
  luaL_checktype(L, 4, LUA_TFUNCTION);
  lua_settop(L, 4);
  if (m->applying) return luaL_error(L, "importer: check after apply");
  m->ne = 0;
  lua_pushnil(L);
  while (lua_next(L, 3) != 0) {
    lua_pop(L, 1);
    if (lua_type(L, -1) != LUA_TSTRING) {
      lua_pushboolean(L, 0);
      return 1;
    }
    if (m->ne == m->ecap) {
      size_t cap = m->ecap ? m->ecap * 2 : 1024;
      struct entry *e = (struct entry *)realloc(m->e, cap * sizeof *e);
      if (e == NULL) return luaL_error(L, "not enough memory");
      m->e = e;
      m->ecap = cap;
    }
    struct entry *e = &m->e[m->ne++];
    e->name = lua_tolstring(L, -1, &e->len); /* the table holds the string */
  }
  qsort(m->e, m->ne, sizeof *m->e, by_name);
  m->t.n = 0;
  long at = ftell(m->spool);
  int ok = m->ne > 0;
  for (size_t i = 0; ok && i < m->ne; i++) { /* the text export would write */
    const struct entry *e = &m->e[i];
    uint32_t n;
    int32_t policy;
    ok = e->len >= 1 && e->len <= TALLY_NAME_MAX && memchr(e->name, 0, e->len) == NULL;
    if (ok && i == 0 && m->has_last) {
      struct entry last = {m->last, m->last_len};
      ok = by_name(&last, e) < 0;
    } else if (ok && i > 0) {
      ok = by_name(&m->e[i - 1], e) < 0;
    }
    if (!ok) break;
    lua_pushlstring(L, e->name, e->len);
    lua_rawget(L, 3);
    ok = counter_at(L, m, &n, &policy);
    lua_pop(L, 1);
    if (!ok) break;
    size_t from = m->t.n; /* the text so far is the piece's */
    if (i && put(&m->t, ",\n", 2)) return luaL_error(L, "not enough memory");
    const char *q = NULL;
    size_t qlen = 0;
    if (!plain(e->name, e->len)) {
      lua_pushvalue(L, 4);
      lua_pushlstring(L, e->name, e->len);
      m->checking = 1; /* quote may not close m: its entries are in use */
      int qrc = lua_pcall(L, 1, 1, 0);
      m->checking = 0;
      if (qrc != LUA_OK) return lua_error(L);
      q = lua_tolstring(L, -1, &qlen);
      if (q == NULL) return luaL_error(L, "import: quote gave no string");
    }
    if (put_counter(&m->t, e->name, e->len, q, qlen, policy, n, m->counts))
      return luaL_error(L, "not enough memory");
    if (q) lua_pop(L, 1);
    /* a piece is checked against the store only once its text is export's */
    if (m->t.n > tlen || memcmp(m->t.p + from, text + from, m->t.n - from) != 0) {
      ok = 0;
      break;
    }
    int existed;
    uint64_t incarnation = 0;
    ok = store_takes(m, e->name, e->len, n, policy, &existed, &incarnation);
    if (ok && !spool(m, e->name, e->len, n, policy, existed, incarnation)) {
      int err = errno;
      lua_pushnil(L);
      lua_pushfstring(L, "cannot write the import's temporary file: %s", strerror(err));
      lua_pushstring(L, "ESYS");
      return 3;
    }
  }
  ok = ok && m->t.n == tlen;
  if (!ok) {
    if (at >= 0) fseek(m->spool, at, SEEK_SET); /* (a refused piece ends it anyway) */
    lua_pushboolean(L, 0);
    return 1;
  }
  const struct entry *e = &m->e[m->ne - 1];
  memcpy(m->last, e->name, e->len);
  m->last_len = e->len;
  m->has_last = 1;
  m->checked += m->ne;
  lua_pushinteger(L, (lua_Integer)m->ne);
  return 1;
}

/* ubuf written to the log's file; 0 if it cannot be (ubuf is kept, and a
 * part that was written is not counted in uflen). */
static int ulog_flush(importer *m) {
  size_t off = 0;
  while (off < m->un) {
    ssize_t w = pwrite(m->undo, m->ubuf + off, m->un - off, (off_t)(m->uflen + off));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return 0;
    off += (size_t)w;
  }
  m->uflen += m->un;
  m->un = m->ulast = 0;
  return 1;
}

/* Log an add before it is made (ulog_pop takes it back if it fails); 0
 * if it cannot be logged: then it must not be made. */
static int log_undo(importer *m, const char *name, size_t len, uint32_t shard,
                    uint64_t incarnation, int64_t n) {
  struct undone u = {(uint8_t)len, {0}, shard, incarnation, n};
  size_t k = sizeof u + len;
  if (m->un + k > ULOG_BUF && !ulog_flush(m)) return 0;
  memcpy(m->ubuf + m->un, &u, sizeof u);
  memcpy(m->ubuf + m->un + sizeof u, name, len);
  m->un += k;
  m->ulast = k;
  return 1;
}

static void ulog_pop(importer *m) {
  m->un -= m->ulast;
  m->ulast = 0;
}

/* Close c (if any) and fail with code and "counter 'NAME'" followed by
 * what fmt makes (lua_pushfstring's formats), NAME made printable. */
static int refuse(lua_State *L, tally_counter *c, int code, const char *name, size_t len,
                  const char *fmt, ...) {
  va_list ap;
  if (c) tally_counter_close(c);
  lua_pushliteral(L, "counter '");
  tl_pushprintable(L, name, len);
  lua_pushliteral(L, "'");
  va_start(ap, fmt);
  lua_pushvfstring(L, fmt, ap);
  va_end(ap);
  lua_concat(L, 4);
  return tl_fail_msg(L, code, lua_tostring(L, -1));
}

/* nil, msg, code for rc on counter name, as its handle's methods say it
 * (a counter dropped under the import: "counter 'x' was dropped"). */
static int fail_on(lua_State *L, int rc, const char *name, size_t len) {
  if (rc != TALLY_EDROPPED) return tl_fail(L, rc);
  return refuse(L, NULL, rc, name, len, " was dropped");
}

/* Apply one spooled counter; 0, or a failure pushed (nil, msg, code: 3). */
static int apply_one(lua_State *L, importer *m, const char *name, size_t len,
                     const struct spooled *h) {
  tally_store *s = m->db->store;
  /* a cpu counter is made with this machine's shard count */
  tally_counter_options o = {h->policy == TALLY_POLICY_CPU ? 0 : h->shards, h->policy};
  tally_counter *c;
  tally_counter_info info;
  uint32_t n = h->shards, have;
  int rc;
  /* a counter that was there when checked must still be (one dropped
   * since fails, as it would through the handle the check held) */
  if (!h->existed && !log_undo(m, name, len, CREATED, 0, 0))
    return tl_fail_msg(L, TALLY_ESYS, "cannot write the import's temporary file");
  /* a new one only: a counter another process made since the check is
   * that process's, never to be dropped by an undo; the import goes into
   * it as into one that was there, its adds logged one by one */
  int made_since = 0;
  rc = h->existed ? tally_counter_open(s, name, len, NULL, 0, &c)
                  : tally_counter_open(s, name, len, &o,
                                       TALLY_COUNTER_CREATE | TALLY_COUNTER_EXCL, &c);
  if (rc == TALLY_EEXIST) {
    ulog_pop(m); /* not made here */
    made_since = 1;
    rc = tally_counter_open(s, name, len, NULL, 0, &c);
    if (rc == TALLY_ENOENT) rc = TALLY_EDROPPED;
  } else if (rc && !h->existed) {
    ulog_pop(m); /* not made */
  }
  if (rc == TALLY_ENOENT && h->existed) rc = TALLY_EDROPPED;
  if (rc) return fail_on(L, rc, name, len);
  int logged = h->existed || made_since; /* its adds are undone one by one */
  rc = tally_counter_info_get(c, &info);
  if (rc == 0 && (info.name_len != len || memcmp(info.name, name, len) != 0)) {
    if (!logged) ulog_pop(m); /* nothing made: the cap's overflow answered */
    return refuse(L, c, TALLY_EFULL, name, len,
                  " falls under a family at its cap (max_counters): it would be "
                  "counted in the family's overflow counter");
  }
  /* dropped and made again since the check (maybe with another policy
   * or shard count): refused as the handle the check held would be */
  if (rc == 0 && h->existed && info.incarnation != h->incarnation) rc = TALLY_EDROPPED;
  /* made by another writer since the check, unlike the document: refused,
   * as the check refuses one that was there (export.lua's made_unlike) */
  if (rc == 0 && made_since && !fits_document(&info, h->policy, n)) {
    return refuse(L, c, TALLY_EMISMATCH, name, len,
                  " was made during the import with %d shards and policy %s",
                  (int)info.shards, tl_policy_label(info.policy));
  }
  if (rc == 0) rc = tally_counter_shards(c, m->now, TALLY_MAX_SHARDS, &have);
  if (rc) {
    tally_counter_close(c);
    return fail_on(L, rc, name, len);
  }
  int whole = taken_whole(h->policy) || taken_whole(info.policy);
  if (have != n && !whole) {
    return refuse(L, c, TALLY_EMISMATCH, name, len,
                  " was resharded to %d shards during the import", (int)have);
  }
  if (whole) { /* the difference, through one increment */
    __int128 sum = 0;
    for (uint32_t i = 0; i < n; i++) sum += m->counts[i];
    for (uint32_t i = 0; !m->add && i < have; i++) sum -= m->now[i];
    if (sum < SHARD_MIN || sum > SHARD_MAX) {
      return refuse(L, c, TALLY_ERANGE, name, len,
                    ": what the import adds to it is beyond a shard's range "
                    "(-2^62 to 2^62-1)");
    }
    if (sum != 0) {
      if (logged && !log_undo(m, name, len, SLOT, info.incarnation, (int64_t)sum))
        rc = TALLY_ESYS;
      else if ((rc = tally_counter_incr(c, (int64_t)sum)) != 0 && logged)
        ulog_pop(m);
    }
  } else {
    for (uint32_t i = 0; rc == 0 && i < n; i++) {
      int64_t d = m->counts[i] - (m->add ? 0 : m->now[i]); /* within +-2^63 */
      if (d == 0) continue;
      /* a counter the import made is dropped on undo: no need to log it */
      if (logged && !log_undo(m, name, len, i, info.incarnation, d)) {
        rc = TALLY_ESYS;
        break;
      }
      rc = tally_counter_incr_shard(c, i, d);
      if (rc && logged) ulog_pop(m);
      if (rc == TALLY_ESHARDS) {
        return refuse(L, c, TALLY_EMISMATCH, name, len,
                      " was resharded during the import");
      }
    }
  }
  tally_counter_close(c);
  if (rc == TALLY_ESYS)
    return tl_fail_msg(L, rc, "cannot write the import's temporary file");
  return rc ? fail_on(L, rc, name, len) : 0;
}

/* imp:apply(k) -> how many counters it applied (0: all are), or nil, msg,
 * code when one fails: what it applied before is then for imp:undo(). */
static int tl_importer_apply(lua_State *L) {
  importer *m = check_importer(L);
  lua_Integer k = luaL_checkinteger(L, 2);
  char name[TALLY_NAME_MAX];
  if (!m->applying) {
    if (fflush(m->spool) != 0 || fseek(m->spool, 0, SEEK_SET) != 0)
      return tl_fail_msg(L, TALLY_ESYS, "cannot read the import's temporary file");
    m->applying = 1;
  }
  lua_Integer i = 0;
  for (; i < k && m->applied < m->checked; i++) {
    struct spooled h;
    if (fread(&h, sizeof h, 1, m->spool) != 1 ||
        fread(name, 1, h.len, m->spool) != h.len || h.shards < 1 ||
        h.shards > TALLY_MAX_SHARDS ||
        fread(m->counts, sizeof *m->counts, h.shards, m->spool) != h.shards)
      return tl_fail_msg(L, TALLY_ESYS, "cannot read the import's temporary file");
    int r = apply_one(L, m, name, h.len, &h);
    if (r) return r;
    m->applied++;
  }
  lua_pushinteger(L, i);
  return 1;
}

/* Undo one logged entry: pass 0 the adds, pass 1 the drops. */
static void undo_one(lua_State *L, importer *m, int pass, const struct undone *u,
                     const char *name) {
  tally_counter *c;
  tally_counter_info info;
  if (pass == 1 && u->shard == CREATED) {
    lua_pushvalue(L, 3); /* db.drop */
    lua_pushvalue(L, 2);
    lua_pushlstring(L, name, u->len);
    if (lua_pcall(L, 2, 0, 0) != LUA_OK) lua_pop(L, 1);
  } else if (pass == 0 && u->shard != CREATED &&
             tally_counter_open(m->db->store, name, u->len, NULL, 0, &c) == 0) {
    int64_t back = (int64_t)tl_negate(u->n); /* u->n is within +-2^63: exact */
    if (tally_counter_info_get(c, &info) == 0 && info.incarnation == u->incarnation) {
      if (u->shard == SLOT)
        tally_counter_incr(c, back);
      else
        tally_counter_incr_shard(c, u->shard, back);
    }
    tally_counter_close(c);
  }
}

/* imp:undo(): subtract every add apply logged (from the same incarnation
 * only), then drop the counters it made, through db:drop. Failures are
 * passed over, as the whole-document path's pcall passes them. */
static int tl_importer_undo(lua_State *L) {
  importer *m = check_importer(L);
  char name[TALLY_NAME_MAX];
  struct undone u;
  lua_settop(L, 1);
  tl_getuv(L, 1, 1); /* 2: the store */
  lua_getfield(L, 2, "drop");
  for (int pass = 0; pass < 2; pass++) { /* the file's entries, then ubuf's */
    for (uint64_t at = 0; at + sizeof u <= m->uflen;) {
      if (pread(m->undo, &u, sizeof u, (off_t)at) != (ssize_t)sizeof u ||
          pread(m->undo, name, u.len, (off_t)(at + sizeof u)) != (ssize_t)u.len)
        break;
      undo_one(L, m, pass, &u, name);
      at += sizeof u + u.len;
    }
    for (size_t at = 0; at + sizeof u <= m->un;) {
      memcpy(&u, m->ubuf + at, sizeof u);
      undo_one(L, m, pass, &u, m->ubuf + at + sizeof u);
      at += sizeof u + u.len;
    }
  }
  return 0;
}

/* imp:close(): its files go now. */
static int tl_importer_close(lua_State *L) {
  importer *m = (importer *)luaL_checkudata(L, 1, TL_IMPORTER_MT);
  if (m->checking) return luaL_error(L, "importer: close during its check");
  importer_free(m);
  return 0;
}

int tl_open_export(lua_State *L) {
  static const luaL_Reg meta[] = {{"__gc", importer_gc}, {NULL, NULL}};
  static const luaL_Reg methods[] = {{"check", tl_importer_check},
                                     {"apply", tl_importer_apply},
                                     {"undo", tl_importer_undo},
                                     {"close", tl_importer_close},
                                     {NULL, NULL}};
  tl_newclass(L, TL_IMPORTER_MT, meta, methods);
  lua_pop(L, 1);
  lua_pushcfunction(L, tl_export_write);
  lua_setfield(L, -2, "export_write");
  lua_pushcfunction(L, tl_importer);
  lua_setfield(L, -2, "importer");
  return 0;
}
