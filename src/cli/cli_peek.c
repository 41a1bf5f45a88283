/* cli_peek.c -- tally.peek: read-only looks at a store, for the tally command.
 *
 *   peek.counter(db, name [, cells]) -> { name=, value=, shards=, policy=,
 *       auto=, grown=, shrunk= (counters with automatic shards only),
 *       rolled = { value=, at=, delta=, rate=, count= } or nil,
 *       cells = { ... } if asked } or nil, message, code
 *   peek.history(db, name, last) -> res_s, { { t=, v= }, ... } or nil
 *       the newest `last` buckets of the counter's finest history ring
 *   peek.schedules(db) -> { { every=, last_period=, holder= }, ... } or
 *       nil, message, code: the rollup schedule identities the store keeps
 *   peek.fs(path) -> { avail=, size= } of the file system holding path
 *   peek.rows(db, pattern, fn) -> true or nil, message, code: fn(list)
 *       for each batch of up to 1,000 matching counters, in their names'
 *       order, each as peek.counter gives it (value nil beyond int64)
 *   peek.ls(db, pattern) -> n or nil, message, code: tally ls's table of
 *       the matching counters, in their names' order, written to stdout
 *       (n: how many; none written when 0)
 *   peek.rate_text(r) -> a rate as the listings show it (common.rate_text)
 *   peek.watcher(), peek.watch(...): what watch reads (cli_watch.c)
 *
 * `tally ls`, `get`, `info` and `watch` read through these. Counters are
 * opened without TALLY_COUNTER_CREATE, so a counter dropped while a listing
 * runs is skipped, never made again (db:counter() would create it), and
 * nothing here takes the store lock: a lookup and a read of cells and
 * rollup records are lock-free. A value whose shards sum beyond int64 comes
 * back as its exact decimal string. Everything goes through the library's
 * API: the command never reads the file format itself.
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "lua_aux.h"
#include "cli.h"

/* The exact sum of the shards as a decimal (beyond int64), in buf (48
 * bytes); returns where it begins. */
static const char *bigsum_text(char *buf, const int64_t *v, uint32_t n) {
  __int128 s = 0;
  unsigned __int128 u;
  char *p = buf + 47;
  for (uint32_t i = 0; i < n; i++) s += v[i];
  u = s < 0 ? (unsigned __int128)(-s) : (unsigned __int128)s;
  *p = '\0';
  do {
    *--p = (char)('0' + (int)(u % 10));
    u /= 10;
  } while (u != 0);
  if (s < 0) *--p = '-';
  return p;
}

static void pushbigsum(lua_State *L, const int64_t *v, uint32_t n) {
  char buf[48];
  lua_pushstring(L, bigsum_text(buf, v, n));
}

/* A policy as the listings name it: a function policy is "function". */
static const char *policy_text(int32_t policy) {
  return policy == TALLY_POLICY_CUSTOM ? "function" : tally_policy_name(policy);
}

/* Set field rolled of the table on top to the record, as c:rolled(). */
static void push_rolled(lua_State *L, const tally_rollup *r) {
  tl_pushrollup(L, r);
  lua_setfield(L, -2, "rolled");
}

/* The fields of a counter's table that peek.counter and peek.rows share. */
static void push_info(lua_State *L, uint32_t shards, int auto_shards, uint32_t grown,
                      uint32_t shrunk, int32_t policy) {
  tl_setint(L, "shards", shards);
  if (auto_shards) { /* the engine sizes it: how often it did */
    lua_pushboolean(L, 1);
    lua_setfield(L, -2, "auto");
    tl_setint(L, "grown", grown);
    tl_setint(L, "shrunk", shrunk);
  }
  lua_pushstring(L, policy_text(policy));
  lua_setfield(L, -2, "policy");
}

static int p_counter(lua_State *L) {
  tl_store *d = tl_checkstore(L, 1);
  size_t len;
  const char *name = luaL_checklstring(L, 2, &len);
  int cells = lua_toboolean(L, 3);
  int64_t vals[TALLY_MAX_SHARDS], v;
  uint32_t n, i;
  tally_counter *c;
  tally_counter_info info;
  tally_rollup r;
  int rc = tally_counter_open(d->store, name, len, NULL, 0, &c);
  if (rc < 0) return tl_fail(L, rc);
  if ((rc = tally_counter_info_get(c, &info)) < 0 ||
      (rc = tally_counter_shards(c, vals, TALLY_MAX_SHARDS, &n)) < 0) {
    tally_counter_close(c);
    return tl_fail(L, rc);
  }
  lua_createtable(L, 0, 6);
  lua_pushlstring(L, name, len);
  lua_setfield(L, -2, "name");
  rc = tally_counter_value(c, &v); /* the sum now, not of the shards above */
  if (rc == 0)
    lua_pushinteger(L, (lua_Integer)v);
  else if (rc == TALLY_ERANGE)
    pushbigsum(L, vals, n);
  else
    lua_pushnil(L);
  lua_setfield(L, -2, "value");
  push_info(L, n, info.auto_shards, info.grown, info.shrunk, info.policy);
  if (tally_counter_rolled(c, &r) == 0) push_rolled(L, &r);
  if (cells) {
    lua_createtable(L, (int)n, 0);
    for (i = 0; i < n; i++) {
      lua_pushinteger(L, (lua_Integer)vals[i]);
      lua_rawseti(L, -2, (lua_Integer)i + 1);
    }
    lua_setfield(L, -2, "cells");
  }
  tally_counter_close(c);
  return 1;
}

static int p_history(lua_State *L) {
  tl_store *d = tl_checkstore(L, 1);
  size_t len;
  const char *name = luaL_checklstring(L, 2, &len);
  lua_Integer last = luaL_checkinteger(L, 3);
  tally_ring rings[TALLY_RINGS_MAX];
  tally_bucket *b;
  uint32_t nr, nb, i, fine = 0, first;
  tally_counter *c = NULL;
  int rc = tally_counter_open(d->store, name, len, NULL, 0, &c);
  if (rc < 0 || tally_counter_rings(c, rings, TALLY_RINGS_MAX, &nr) < 0 || nr == 0) {
    tally_counter_close(c);
    return 0;
  }
  for (i = 1; i < nr && i < TALLY_RINGS_MAX; i++)
    if (rings[i].res_s < rings[fine].res_s) fine = i;
  b = (tally_bucket *)malloc((size_t)rings[fine].len * sizeof *b);
  if (b == NULL) {
    tally_counter_close(c);
    return luaL_error(L, "out of memory");
  }
  rc = tally_counter_history(c, rings[fine].res_s, b, rings[fine].len, &nb);
  tally_counter_close(c);
  if (rc < 0) {
    free(b);
    return 0;
  }
  if (nb > rings[fine].len) nb = rings[fine].len;
  first = last > 0 && (lua_Integer)nb > last ? nb - (uint32_t)last : 0;
  lua_pushinteger(L, (lua_Integer)rings[fine].res_s);
  lua_createtable(L, (int)(nb - first), 0);
  for (i = first; i < nb; i++) {
    lua_createtable(L, 0, 2);
    tl_setint(L, "t", b[i].t);
    tl_setint(L, "v", b[i].value);
    lua_rawseti(L, -2, (lua_Integer)(i - first) + 1);
  }
  free(b);
  return 2;
}

/* The schedule identities the store keeps (db:stats() counts them), read
 * through the library's API, never the file format. */
static int p_schedules(lua_State *L) {
  tl_store *d = tl_checkstore(L, 1);
  tally_schedule_info *sch;
  uint32_t n, got, i;
  int rc = tally_store_schedules(d->store, NULL, 0, &n); /* how many */
  if (rc < 0) return tl_fail(L, rc);
  sch = lua_newuserdata(L, (n ? n : 1) * sizeof *sch); /* freed by the GC */
  rc = tally_store_schedules(d->store, sch, n, &got);
  if (rc < 0) return tl_fail(L, rc);
  if (got < n) n = got; /* identities are never freed, but stay safe */
  lua_createtable(L, (int)n, 0);
  for (i = 0; i < n; i++) {
    lua_createtable(L, 0, 3);
    if (sch[i].every_ms > 0) {
      lua_pushnumber(L, (lua_Number)sch[i].every_ms / 1000);
      lua_setfield(L, -2, "every");
    }
    if (sch[i].last_period_ms >= 0) {
      lua_pushnumber(L, (lua_Number)sch[i].last_period_ms / 1000);
      lua_setfield(L, -2, "last_period");
    }
    if (sch[i].holder_pid > 0) tl_setint(L, "holder", sch[i].holder_pid);
    lua_rawseti(L, -2, (lua_Integer)i + 1);
  }
  return 1;
}

static int p_fs(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  struct statvfs st;
  if (statvfs(path, &st) != 0) {
    lua_pushnil(L);
    lua_pushfstring(L, "%s: %s", path, strerror(errno));
    return 2;
  }
  lua_createtable(L, 0, 2);
  tl_setint(L, "avail", (int64_t)((uint64_t)st.f_bavail * st.f_frsize));
  tl_setint(L, "size", (int64_t)((uint64_t)st.f_blocks * st.f_frsize));
  return 1;
}

/* ---- peek.rows: a listing that streams ------------------------------------- */

/* The walk hands rows over while it holds the store's records; a Lua
 * error must not unwind through it. So each row is copied into a batch,
 * and a full batch is made into tables and given to fn under lua_pcall;
 * an error stops the walk and is raised once it has ended. */
#define ROWS_BATCH 1000

struct rows_batch {
  lua_State *L;
  int fn;     /* stack index of fn */
  int failed; /* fn raised: its message is on top of the stack */
  size_t n;
  tally_row row[ROWS_BATCH];
  tally_rollup roll[ROWS_BATCH];
  char name[ROWS_BATCH][TALLY_NAME_MAX + 1];
};

static int rows_call(lua_State *L) {
  struct rows_batch *b = (struct rows_batch *)lua_touserdata(L, 1);
  lua_pushvalue(L, 2); /* fn */
  lua_createtable(L, (int)b->n, 0);
  for (size_t i = 0; i < b->n; i++) {
    const tally_row *r = &b->row[i];
    lua_createtable(L, 0, 8);
    lua_pushlstring(L, b->name[i], r->name_len);
    lua_setfield(L, -2, "name");
    if (r->value_rc == 0) {
      lua_pushinteger(L, (lua_Integer)r->value);
      lua_setfield(L, -2, "value");
    }
    push_info(L, r->shards, r->auto_shards, r->grown, r->shrunk, r->policy);
    if (r->rolled) push_rolled(L, &b->roll[i]);
    lua_rawseti(L, -2, (lua_Integer)i + 1);
  }
  lua_call(L, 1, 0);
  return 0;
}

static int rows_flush(struct rows_batch *b) {
  lua_State *L = b->L;
  if (b->n == 0) return 0;
  lua_pushcfunction(L, rows_call);
  lua_pushlightuserdata(L, b);
  lua_pushvalue(L, b->fn); /* an index of peek.rows' frame, where the walk runs */
  if (lua_pcall(L, 2, 0, 0) != LUA_OK) {
    b->failed = 1;
    return 1; /* stops the walk */
  }
  b->n = 0;
  return 0;
}

static int rows_add(void *ud, const tally_row *r) {
  struct rows_batch *b = (struct rows_batch *)ud;
  size_t i = b->n++;
  b->row[i] = *r;
  memcpy(b->name[i], r->name, r->name_len);
  if (r->rolled) b->roll[i] = *r->rolled;
  return b->n == ROWS_BATCH ? rows_flush(b) : 0;
}

static int p_rows(lua_State *L) {
  tl_store *d = tl_checkstore(L, 1);
  size_t plen = 0;
  const char *pattern = luaL_optlstring(L, 2, NULL, &plen);
  luaL_checktype(L, 3, LUA_TFUNCTION);
  struct rows_batch *b = (struct rows_batch *)malloc(sizeof *b);
  if (b == NULL) return luaL_error(L, "not enough memory");
  b->L = L;
  b->fn = 3;
  b->failed = 0;
  b->n = 0;
  int rc = tally_store_rows(d->store, pattern, plen,
                            TALLY_ROWS_BY_NAME | TALLY_ROWS_ROLLED, rows_add, b);
  if (rc == 0) rc = rows_flush(b);
  int failed = b->failed;
  free(b);
  if (failed) return lua_error(L); /* fn's error, on top */
  if (rc < 0) return tl_fail(L, rc);
  lua_pushboolean(L, 1);
  return 1;
}

/* ---- peek.ls: tally ls's table ------------------------------------------------ */

/* A rate as the listings show it: "-" for none (NaN, infinite), an
 * integral one exactly, else 2 decimals under 10 and 1 above. */
static int rate_text(char *out, size_t cap, double r) {
  if (isnan(r) || isinf(r)) return snprintf(out, cap, "-");
  if (r == floor(r) && r > -1e15 && r < 1e15)
    return snprintf(out, cap, "%lld", (long long)r);
  return snprintf(out, cap, fabs(r) < 10 ? "%.2f" : "%.1f", r);
}

#define RATE_TEXT 320 /* "%.1f" of the largest double, and its sign */

static int p_rate_text(lua_State *L) {
  char buf[RATE_TEXT];
  if (lua_isnoneornil(L, 1)) {
    lua_pushliteral(L, "-");
    return 1;
  }
  rate_text(buf, sizeof buf, (double)luaL_checknumber(L, 1));
  lua_pushstring(L, buf);
  return 1;
}

/* The table: a header and a line per counter, columns as wide as the
 * first LS_HELD rows need (a later, wider cell widens only its own line),
 * written as the walk reads: a million counters stream. In C since each
 * line made in Lua cost more than the walk (two tables and a dozen
 * strings a counter: 61% of `tally ls` over a million). */
#define LS_HELD 5000
#define LS_NAME (4 * TALLY_NAME_MAX + 1) /* printable: at most \xNN a byte */

struct ls_cell {
  const char *s;
  size_t len;
};

struct ls {
  size_t w[6];
  char *held; /* the first LS_HELD rows' cells, each a length byte pair and its bytes */
  size_t nheld, capheld;
  size_t rows;
  int failed;       /* out of memory */
  int64_t last_sec; /* the last rollup time written, and its text */
  char last_text[32];
  size_t nout; /* lines not yet written: stdout is line-buffered on a terminal */
  char out[1 << 16];
};

#define LS_LINE (6 * (LS_NAME + RATE_TEXT) + 16) /* a line's most: cells, pads, spaces */

static void ls_flush(struct ls *t) {
  fwrite(t->out, 1, t->nout, stdout);
  t->nout = 0;
}

/* One line into t->out: name, value, shards, policy, time, rate, two
 * spaces apart, padded to the widths (left-aligned: name, policy, time).
 * Written a buffer at a time, not a line. */
static void ls_line(struct ls *t, const struct ls_cell *c) {
  static const int left[6] = {1, 0, 0, 1, 1, 0};
  if (sizeof t->out - t->nout < LS_LINE) ls_flush(t);
  char *o = t->out + t->nout;
  for (int k = 0; k < 6; k++) {
    size_t pad = t->w[k] > c[k].len ? t->w[k] - c[k].len : 0;
    if (k) *o++ = ' ', *o++ = ' ';
    if (left[k]) memcpy(o, c[k].s, c[k].len), o += c[k].len;
    memset(o, ' ', pad), o += pad;
    if (!left[k]) memcpy(o, c[k].s, c[k].len), o += c[k].len;
  }
  *o++ = '\n';
  t->nout = (size_t)(o - t->out);
}

static int ls_hold(struct ls *t, const struct ls_cell *c) {
  size_t need = 12;
  for (int k = 0; k < 6; k++) need += c[k].len;
  if (t->nheld + need > t->capheld) {
    size_t cap = t->capheld ? 2 * t->capheld : 1 << 20;
    while (cap < t->nheld + need) cap *= 2;
    char *p = (char *)realloc(t->held, cap);
    if (p == NULL) return -1;
    t->held = p;
    t->capheld = cap;
  }
  for (int k = 0; k < 6; k++) {
    t->held[t->nheld++] = (char)(c[k].len & 0xff);
    t->held[t->nheld++] = (char)(c[k].len >> 8);
    memcpy(t->held + t->nheld, c[k].s, c[k].len);
    t->nheld += c[k].len;
  }
  return 0;
}

static const struct ls_cell ls_head[6] = {{"NAME", 4},   {"VALUE", 5},     {"SHARDS", 6},
                                          {"POLICY", 6}, {"ROLLED AT", 9}, {"RATE/S", 6}};

/* The header and the rows held, now that the widths are known. */
static void ls_release(struct ls *t) {
  ls_line(t, ls_head);
  for (size_t at = 0; at < t->nheld;) {
    struct ls_cell c[6];
    for (int k = 0; k < 6; k++) {
      c[k].len = (size_t)(unsigned char)t->held[at] |
                 (size_t)(unsigned char)t->held[at + 1] << 8;
      c[k].s = t->held + at + 2;
      at += 2 + c[k].len;
    }
    ls_line(t, c);
  }
  t->nheld = 0;
}

static int ls_row(void *ud, const tally_row *r) {
  struct ls *t = (struct ls *)ud;
  char name[LS_NAME], value[48], shards[48], rate[RATE_TEXT];
  struct ls_cell c[6];
  c[0].s = name;
  c[0].len = tally_printable(name, LS_NAME, r->name, r->name_len);
  if (r->value_rc == 0) {
    c[1].len = (size_t)snprintf(value, sizeof value, "%lld", (long long)r->value);
    c[1].s = value;
  } else { /* beyond int64: the cells' exact sum */
    c[1].s = bigsum_text(value, r->cells, r->shards);
    c[1].len = strlen(c[1].s);
  }
  if (!r->auto_shards)
    c[2].len = (size_t)snprintf(shards, sizeof shards, "%u", r->shards);
  else if (r->grown + r->shrunk > 0) /* the engine's reshards: grown and shrunk so far */
    c[2].len = (size_t)snprintf(shards, sizeof shards, "%u auto +%u -%u", r->shards,
                                r->grown, r->shrunk);
  else
    c[2].len = (size_t)snprintf(shards, sizeof shards, "%u auto", r->shards);
  c[2].s = shards;
  c[3].s = policy_text(r->policy);
  c[3].len = strlen(c[3].s);
  c[4].s = "-", c[4].len = 1;
  c[5].s = "-", c[5].len = 1;
  if (r->rolled) {
    int64_t sec = (int64_t)floor((double)r->rolled->at_ms / 1000.0);
    if (sec != t->last_sec || !t->last_text[0]) { /* a listing's rows share a few times */
      time_t tt = (time_t)sec;
      struct tm tm;
      if (localtime_r(&tt, &tm) == NULL ||
          strftime(t->last_text, sizeof t->last_text, "%Y-%m-%d %H:%M:%S", &tm) == 0)
        snprintf(t->last_text, sizeof t->last_text, "%lld", (long long)sec);
      t->last_sec = sec;
    }
    c[4].s = t->last_text, c[4].len = strlen(t->last_text);
    c[5].len = (size_t)rate_text(rate, sizeof rate, tally_rollup_rate(r->rolled));
    c[5].s = rate;
  }
  t->rows++;
  if (t->rows > LS_HELD) {
    ls_line(t, c);
    return 0;
  }
  for (int k = 0; k < 6; k++)
    if (c[k].len > t->w[k]) t->w[k] = c[k].len;
  if (ls_hold(t, c)) {
    t->failed = 1;
    return 1;
  }
  if (t->rows == LS_HELD) ls_release(t);
  return 0;
}

static int p_ls(lua_State *L) {
  tl_store *d = tl_checkstore(L, 1);
  size_t plen = 0;
  const char *pattern = luaL_optlstring(L, 2, NULL, &plen);
  struct ls *t = (struct ls *)calloc(1, sizeof *t);
  if (t == NULL) return luaL_error(L, "not enough memory");
  for (int k = 0; k < 6; k++) t->w[k] = ls_head[k].len;
  t->w[4] = 19; /* a time's width */
  int rc = tally_store_rows(d->store, pattern, plen,
                            TALLY_ROWS_BY_NAME | TALLY_ROWS_ROLLED | TALLY_ROWS_CELLS,
                            ls_row, t);
  if (rc == 0 && !t->failed && t->rows > 0 && t->rows < LS_HELD) ls_release(t);
  ls_flush(t);
  fflush(stdout);
  size_t rows = t->rows;
  int failed = t->failed;
  free(t->held);
  free(t);
  if (failed) return luaL_error(L, "not enough memory");
  if (rc < 0) return tl_fail(L, rc);
  lua_pushinteger(L, (lua_Integer)rows);
  return 1;
}

int cli_open_peek(lua_State *L) {
  static const luaL_Reg fns[] = {{"counter", p_counter},     {"history", p_history},
                                 {"schedules", p_schedules}, {"fs", p_fs},
                                 {"rows", p_rows},           {"ls", p_ls},
                                 {"rate_text", p_rate_text}, {NULL, NULL}};
  luaL_newlib(L, fns);
  cli_peek_watch(L); /* peek.watcher, peek.watch (cli_watch.c) */
  return 1;
}
