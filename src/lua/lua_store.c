/* lua_store.c -- the store handle (metatable "tally.store") and its
 * methods, and core.uri_redact (a store spec as messages show it).
 *
 * A store handle is a full userdata holding the tally_store pointer and
 * the spec it was opened with (core.open, lua_open.c); its user values
 * are the cache of counter handles by name (lua_handles.c: db:incr and
 * friends), the list of function-policy families defined through it, and
 * the name slots of the cached handles (lua_slots.c). Counter handles are
 * made by lua_counter.c (tl_counter_push); db:close() closes every one of
 * them before the store, as the C API requires.
 *
 * The hot path (db:incr) trusts the first argument after one cheap check
 * (a salted self-pointer) and falls back to tl_checkstore only to raise the
 * proper error. Misuse raises luaL_argerror-style errors; failures of the
 * environment return nil, message, code name. A closed handle sets its C
 * pointer to NULL.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lua_aux.h"

/* Counter names and family patterns: 1..255 bytes, no NUL. */
static const char *tl_checkname(lua_State *L, int arg, size_t *len, const char *what) {
  const char *s = tl_checkstring(L, arg, len);
  if (*len < 1 || *len > TALLY_NAME_MAX)
    tl_argerror(L, arg, "%s must be 1 to %d bytes, got %d", what, TALLY_NAME_MAX,
                (int)*len);
  if (memchr(s, '\0', *len) != NULL)
    tl_argerror(L, arg, "%s must not contain a NUL byte", what);
  return s;
}

/* ---- the handle ------------------------------------------------------------------ */

static tl_store *tl_tostore_slow(lua_State *L) {
  return tl_checkstore(L, 1);
}

/* The store at argument 1, open; raises otherwise. */
static tl_store *tl_tostore(lua_State *L) {
  tl_store *d = (tl_store *)lua_touserdata(L, 1);
  if (TL_UNLIKELY(d == NULL || lua_type(L, 1) != LUA_TUSERDATA ||
                  d->key != ((uintptr_t)d ^ TL_STORE_SALT) || d->store == NULL))
    return tl_tostore_slow(L);
  return d;
}

static void tl_store_release(lua_State *L, tl_store *d) {
  tl_slots_release(L, 1);
  while (d->hists != NULL) tl_hist_release(d->hists);
  while (d->counters != NULL) tl_counter_release(d->counters);
  if (d->store != NULL) tally_store_close(d->store);
  d->store = NULL;
}

/* ---- store: counters by name -------------------------------------------------- */

/* Push the cached handle for the name at arg 2 of the store at arg 1 if it
 * is open; else open it (creating it if create), cache and push it. Returns
 * 0, or a TALLY_E* code with nothing pushed. */
static int tl_cached(lua_State *L, int create) {
  size_t len;
  const char *name = lua_tolstring(L, 2, &len);
  tl_counter *h;
  int rc;
  tl_getuv(L, 1, TL_SUV_CACHE);
  lua_pushvalue(L, 2);
  lua_rawget(L, -2);
  h = (tl_counter *)lua_touserdata(L, -1);
  if (h != NULL && h->c != NULL) {
    lua_remove(L, -2);
    return 0;
  }
  lua_pop(L, 2);
  if (tl_cache_promote(L)) return 0;
  tl_checkname(L, 2, &len, "name");
  rc = tl_counter_push(L, 1, name, len, NULL, create ? TALLY_COUNTER_CREATE : 0, 0);
  if (rc < 0) return rc;
  tl_cache_put(L, lua_gettop(L));
  return 0;
}

/* db:incr of a name no counter has yet: an increment that would fail on
 * the new counter (beyond a shard's range, no key for the key policy)
 * fails before the counter is created, so a failing call leaves nothing
 * behind. Returns 0 to go on, or the count of nil, message, code pushed. */
static int tl_incr_new_fails(lua_State *L, tl_store *d, lua_Integer n) {
  size_t len;
  const char *name = lua_tolstring(L, 2, &len);
  tally_counter_options o;
  char msg[TALLY_NAME_MAX + 128];
  int rc = tally_family_resolve(d->store, name, len, &o);
  if (rc < 0) return tl_fail(L, rc);
  if (o.policy == TALLY_POLICY_KEY) tl_checkkey(L, 4); /* as the handle's increment */
  /* a new counter's shards are 0: n itself must fit [-2^62, 2^62) */
  if (n < -((lua_Integer)1 << 62) || n > ((lua_Integer)1 << 62) - 1) {
    snprintf(msg, sizeof msg,
             "counter '%.*s': adding %lld would overflow a shard "
             "(shards hold -2^62 to 2^62-1)",
             (int)len, name, (long long)n);
    return tl_fail_msg(L, TALLY_ERANGE, msg);
  }
  return 0;
}

/* db:incr(name, n) (no key) of a name the cache does not hold. Returns -1
 * to open, cache and use its handle (admitted; or what only a handle
 * does: a Lua policy function, an invalid name's argument error), 0 when
 * it was added by name, or the count of nil, message, code pushed. */
static int tl_incr_uncached(lua_State *L, tl_store *d, lua_Integer n) {
  size_t len;
  const char *name = lua_tolstring(L, 2, &len);
  uint32_t bit;
  tl_door *door = tl_door_pass(L, name, len, &bit);
  int rc;
  if (door == NULL) return -1;
  rc = tally_store_incr(d->store, name, len, (int64_t)n, 0);
  /* create it, unless the add would fail; dropped by another process
   * between the find and the add: the same */
  if (rc == TALLY_ENOENT || rc == TALLY_EDROPPED) {
    if ((rc = tl_incr_new_fails(L, d, n)) != 0) return rc;
    for (int tries = 0; tries <= TL_DROP_RETRIES; tries++) {
      rc = tally_store_incr(d->store, name, len, (int64_t)n, TALLY_COUNTER_CREATE);
      if (rc != TALLY_EDROPPED) break;
    }
  }
  if (rc == TALLY_EPOLICY || rc == TALLY_ENAME) return -1;
  if (rc < 0) return tl_fail(L, rc);
  tl_door_mark(door, bit);
  return 0;
}

static int tl_store_incr_(lua_State *L, int sign) {
  tl_store *d = tl_tostore(L);
  tl_counter *h;
  lua_Integer n;
  int isnum, rc, tries;
  if (TL_UNLIKELY(lua_type(L, 2) != LUA_TSTRING)) tl_typeerror(L, 2, "string");
  lua_settop(L, 4); /* db name n key */
  n = tl_tointx(L, 3, &isnum);
  if (TL_UNLIKELY(!isnum)) n = tl_checkdelta(L, 3);
  if (sign < 0) {
    if (TL_UNLIKELY(n == (lua_Integer)INT64_MIN))
      return tl_fail_negate(L, lua_tostring(L, 2));
    n = tl_negate(n);
  }
  if (d->vec != NULL) { /* a slot's counter ignores the key, as its handle does */
    if (tl_slot_incr(L, d, 2, n)) {
      lua_pushboolean(L, 1);
      return 1;
    }
    lua_settop(L, 4);
  }
  for (tries = 0;; tries++) {
    tl_getuv(L, 1, TL_SUV_CACHE); /* 5: cache */
    lua_pushvalue(L, 2);
    lua_rawget(L, 5); /* 6: handle or nil */
    h = (tl_counter *)lua_touserdata(L, 6);
    if (TL_UNLIKELY(h == NULL || h->c == NULL)) {
      lua_settop(L, 4);
      if (tries == 0 && lua_isnil(L, 4) && !tl_cache_promote(L)) {
        rc = tl_incr_uncached(L, d, n); /* not in old either */
        if (rc == 0) break;
        if (rc > 0) return rc;
      }
      if (lua_gettop(L) == 4) { /* not promoted from old */
        /* an existing counter (one dropped meanwhile is none); else create
         * it, unless the add would fail */
        rc = tl_cached(L, 0);
        if (rc == TALLY_ENOENT || rc == TALLY_EDROPPED) {
          if ((rc = tl_incr_new_fails(L, d, n)) != 0) return rc;
          rc = tl_cached(L, 1);
        }
        if (rc < 0) return tl_fail(L, rc);
      }
      h = (tl_counter *)lua_touserdata(L, -1);
      lua_pushnil(L); /* keep the handle at 6 */
      lua_insert(L, 5);
    }
    if (TL_LIKELY(tl_policy_plain(h->policy)))
      rc = tally_counter_incr(h->c, (int64_t)n);
    else
      rc = tl_counter_incr_policy(L, h, 6, 4, n);
    if (TL_LIKELY(rc == 0)) break;
    if (rc != TALLY_EDROPPED || tries >= TL_DROP_RETRIES)
      return tl_counter_fail(L, h, rc);
    tl_uncache(L); /* dropped: reopen (and recreate) */
    lua_settop(L, 4);
  }
  lua_pushboolean(L, 1);
  return 1;
}

static int tl_store_incr(lua_State *L) {
  return tl_store_incr_(L, 1);
}
static int tl_store_decr(lua_State *L) {
  return tl_store_incr_(L, -1);
}

static int tl_no_such(lua_State *L, int rc) {
  if (rc == TALLY_ENOENT || rc == TALLY_EDROPPED)
    return tl_fail_msg(L, TALLY_ENOENT,
                       lua_pushfstring(L, "no such counter '%s'", lua_tostring(L, 2)));
  return tl_fail(L, rc);
}

/* db:value(name) of a name the cache does not hold (see admission,
 * above). Returns -1 to open, cache and read its handle, 0 with *v read by
 * name, or the count of nil, message, code pushed. */
static int tl_value_uncached(lua_State *L, tl_store *d, int64_t *v) {
  size_t len;
  const char *name = lua_tolstring(L, 2, &len);
  uint32_t bit;
  tl_door *door = tl_door_pass(L, name, len, &bit);
  int rc;
  if (door == NULL) return -1;
  rc = tally_store_value(d->store, name, len, v);
  if (rc == TALLY_ENAME) return -1; /* the handle path raises as before */
  if (rc < 0) return tl_no_such(L, rc);
  tl_door_mark(door, bit);
  return 0;
}

static int tl_store_value(lua_State *L) {
  int64_t v;
  int rc, tries;
  tl_store *d = tl_tostore(L);
  tl_counter *held;
  tl_checkstring(L, 2, NULL);
  lua_settop(L, 2);
  tl_getuv(L, 1, TL_SUV_CACHE);
  lua_pushvalue(L, 2);
  lua_rawget(L, 3);
  held = (tl_counter *)lua_touserdata(L, 4);
  lua_settop(L, 2);
  if ((held == NULL || held->c == NULL) && !tl_cache_promote(L)) {
    rc = tl_value_uncached(L, d, &v); /* in neither generation */
    if (rc == 0) {
      tl_pushint64(L, v);
      return 1;
    }
    if (rc > 0) return rc;
  }
  lua_settop(L, 2);
  for (tries = 0;; tries++) {
    tl_counter *h;
    rc = tl_cached(L, 0);
    if (rc < 0) return tl_no_such(L, rc);
    h = (tl_counter *)lua_touserdata(L, -1);
    rc = tally_counter_value(h->c, &v);
    if (rc == 0 && v == 0 && tries == 0) { /* a cached handle reads 0 once its */
      tally_counter_info info;             /* counter expired: info re-attaches */
      int irc = tally_counter_info_get(h->c, &info); /* it, or says it is gone */
      if (irc == TALLY_ENOENT) {
        tl_uncache(L);
        return tl_no_such(L, irc);
      }
      if (irc == 0) rc = tally_counter_value(h->c, &v); /* back: read it again */
    }
    if (rc == 0) break;
    if (rc != TALLY_EDROPPED || tries > 0) return tl_counter_fail(L, h, rc);
    tl_uncache(L);
    lua_settop(L, 2);
  }
  tl_pushint64(L, (int64_t)v);
  return 1;
}

/* The message for TALLY_EMISMATCH: what the counter is, what was asked. */
static int tl_mismatch(lua_State *L, tl_store *d, const char *name, size_t len,
                       const tally_counter_options *o) {
  tally_counter *c;
  tally_counter_info info;
  char asked[96];
  int rc = tally_counter_open(d->store, name, len, NULL, 0, &c);
  if (rc == TALLY_ENOENT) /* a capped family's overflow counter stood in for it */
    return tl_error(L,
                    "counter '%s' falls under a family at its cap (max_counters), "
                    "whose overflow counter exists with other options",
                    name);
  if (rc < 0) return tl_fail(L, rc);
  rc = tally_counter_info_get(c, &info);
  tally_counter_close(c);
  if (rc < 0) return tl_fail(L, rc);
  asked[0] = '\0';
  if (o->shards == TALLY_SHARDS_AUTO && !info.auto_shards)
    snprintf(asked, sizeof(asked), "automatic shards");
  else if (o->shards != 0 && o->shards != TALLY_SHARDS_AUTO && o->shards != info.shards)
    snprintf(asked, sizeof(asked), "%u shards", (unsigned)o->shards);
  if (o->policy >= 0 && o->policy != info.policy) {
    size_t used = strlen(asked);
    snprintf(asked + used, sizeof(asked) - used, "%spolicy %s", used ? " and " : "",
             tl_policy_label(o->policy));
  }
  return tl_error(L, "counter '%s' exists with %d%s shards and policy %s (asked for %s)",
                  name, (int)info.shards, info.auto_shards ? " (auto)" : "",
                  tl_policy_label(info.policy), asked[0] ? asked : "different options");
}

static int tl_store_counter(lua_State *L) {
  tl_store *d = tl_tostore(L);
  tally_counter_options o;
  size_t len;
  const char *name = tl_checkname(L, 2, &len, "name");
  int rc, fnidx, create = 1;
  tl_counter *h, *old;
  lua_settop(L, 3);
  tl_checkcounteropts(L, 3, &o, &create); /* 4: policy function or nil */
  fnidx = lua_isnil(L, 4) ? 0 : 4;
  rc = tl_counter_push(L, 1, name, len, &o,
                       create == 2 ? TALLY_COUNTER_CREATE | TALLY_COUNTER_EXCL
                       : create    ? TALLY_COUNTER_CREATE
                                   : 0,
                       fnidx);
  if (rc == TALLY_EEXIST) return tl_fail(L, rc);
  if (rc == TALLY_EMISMATCH) return tl_mismatch(L, d, name, len, &o);
  if (rc == TALLY_ENOENT) return tl_no_such(L, rc);
  if (rc < 0) return tl_fail(L, rc);
  h = (tl_counter *)lua_touserdata(L, -1);
  /* db:incr(name) uses this handle too, unless a better one is cached */
  old = tl_cache_peek(L);
  if (old == NULL || old->c == NULL || (h->hasfn && !old->hasfn))
    tl_cache_put(L, lua_gettop(L));
  return 1;
}

static int tl_store_drop(lua_State *L) {
  tl_store *d = tl_tostore(L);
  size_t len;
  const char *name = tl_checkname(L, 2, &len, "name");
  int rc = tally_store_drop(d->store, name, len);
  if (rc < 0) return tl_no_such(L, rc);
  tl_uncache(L);
  lua_pushboolean(L, 1);
  return 1;
}

/* The option key of the table at arg as an integer from 0 to max (0 if
 * absent); raises "bad argument #arg (key must be ..., got ...)". */
static lua_Integer tl_optcount(lua_State *L, int arg, const char *key, lua_Integer max,
                               const char *what) {
  lua_Integer n = 0;
  int isnum = 1;
  lua_getfield(L, arg, key);
  if (!lua_isnil(L, -1)) {
    isnum = 0;
    if (lua_type(L, -1) == LUA_TNUMBER) n = tl_tointx(L, -1, &isnum);
  }
  if (!isnum || n < 0 || n > max)
    tl_argerror(L, arg, "%s must be %s, got %s", key, what,
                tl_describe(L, -1, TL_BOOL_VALUE));
  lua_pop(L, 1);
  return n;
}

/* db:family's own options at arg (idle, max_counters) into fo; the table
 * at arg is then replaced by a copy without them, for
 * tl_checkcounteropts, which takes the options counters share. */
static void tl_familyopts(lua_State *L, int arg, tally_family_options *fo) {
  fo->idle_s = 0;
  fo->max_counters = 0;
  if (!lua_istable(L, arg)) return;
  fo->idle_s = (uint32_t)tl_optcount(L, arg, "idle", (lua_Integer)UINT32_MAX,
                                     "an integer number of seconds from 0 to 4294967295");
#if TL_LUAJIT
  fo->max_counters = (uint64_t)tl_optcount(L, arg, "max_counters", (lua_Integer)TL_EXACT,
                                           "an integer >= 0");
#else
  fo->max_counters =
      (uint64_t)tl_optcount(L, arg, "max_counters", LUA_MAXINTEGER, "an integer >= 0");
#endif
  lua_newtable(L);
  lua_pushnil(L);
  while (lua_next(L, arg) != 0) { /* copy: t k v */
    const char *k = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : "";
    if (strcmp(k, "idle") == 0 || strcmp(k, "max_counters") == 0) {
      lua_pop(L, 1);
      continue;
    }
    lua_pushvalue(L, -2);
    lua_insert(L, -2);
    lua_rawset(L, -4);
  }
  lua_replace(L, arg);
}

static int tl_store_family(lua_State *L) {
  tl_store *d = tl_tostore(L);
  tally_counter_options o;
  tally_family_options fo;
  size_t plen;
  const char *pattern = tl_checkname(L, 2, &plen, "pattern");
  lua_Integer i, j, n;
  int rc;
  lua_settop(L, 3);
  tl_familyopts(L, 3, &fo);
  tl_checkcounteropts(L, 3, &o, NULL); /* 4: policy function or nil */
  fo.shards = o.shards;
  fo.policy = o.policy;
  rc = tally_family_define(d->store, pattern, plen, &fo);
  if (rc < 0) return tl_fail(L, rc);
  /* the store's function families: { pattern1, fn1, pattern2, fn2, ... } */
  tl_getuv(L, 1, TL_SUV_FAMILIES); /* 5 */
  n = (lua_Integer)lua_rawlen(L, 5);
  for (i = 1, j = 1; i < n; i += 2) {
    lua_rawgeti(L, 5, i);
    if (lua_rawequal(L, -1, 2)) {
      lua_pop(L, 1);
      continue;
    }
    lua_rawseti(L, 5, j);
    lua_rawgeti(L, 5, i + 1);
    lua_rawseti(L, 5, j + 1);
    j += 2;
  }
  for (i = n; i >= j; i--) {
    lua_pushnil(L);
    lua_rawseti(L, 5, i);
  }
  if (o.policy == TALLY_POLICY_CUSTOM) {
    lua_pushvalue(L, 2);
    lua_rawseti(L, 5, j);
    lua_pushvalue(L, 4);
    lua_rawseti(L, 5, j + 1);
  }
  lua_pushboolean(L, 1);
  return 1;
}

static const char *tl_optpattern(lua_State *L, int arg, size_t *len) {
  if (lua_isnoneornil(L, arg)) {
    *len = 0;
    return NULL;
  }
  return tl_checkstring(L, arg, len);
}

static int tl_store_sum(lua_State *L) {
  tl_store *d = tl_tostore(L);
  size_t plen;
  const char *pattern = tl_optpattern(L, 2, &plen);
  int64_t sum;
  uint64_t count;
  int rc = tally_store_sum(d->store, pattern, plen, &sum, &count);
  if (rc < 0) return tl_fail(L, rc);
  tl_pushint64(L, (int64_t)sum);
  tl_pushint64(L, (int64_t)count);
  return 2;
}

/* db:names([pattern]) -> the matching names, sorted bytewise. */
static int tl_store_names(lua_State *L) {
  tl_store *d = tl_tostore(L);
  size_t plen;
  const char *pattern = tl_optpattern(L, 2, &plen);
  tl_values a = {NULL, 0, 0, NULL, 0, 0, NULL};
  return tl_names_push(L, &a,
                       tally_store_rows(d->store, pattern, plen,
                                        TALLY_ROWS_BY_NAME | TALLY_ROWS_NAMES,
                                        tl_name_row, &a));
}

/* db:_values([pattern]) -> { [name] = value } in one pass over the index
 * (tally_store_values), what db:values reads. */
static int tl_store_values(lua_State *L) {
  tl_store *d = tl_tostore(L);
  size_t plen;
  const char *pattern = tl_optpattern(L, 2, &plen);
  tl_values a = {NULL, 0, 0, NULL, 0, 0, NULL};
  return tl_values_push(L, &a,
                        tally_store_values(d->store, pattern, plen, tl_values_add, &a));
}

/* db:_top(pattern|nil, k, by) -> the rows of db:top, which checks the
 * arguments (tally_store_top: one walk, a heap of k). */
static int tl_store_top(lua_State *L) {
  tl_store *d = tl_tostore(L);
  size_t plen;
  const char *pattern = tl_optpattern(L, 2, &plen);
  lua_Integer k = tl_checkinteger(L, 3);
  int by = strcmp(luaL_checkstring(L, 4), "rate") == 0 ? TALLY_TOP_RATE : TALLY_TOP_VALUE;
  tl_values a = {NULL, 0, 0, NULL, 0, 0, NULL};
  return tl_top_push(L, &a,
                     tally_store_top(d->store, pattern, plen, k < 0 ? 0 : (uint64_t)k, by,
                                     tl_top_add, &a));
}

static int tl_store_sync(lua_State *L) {
  tl_store *d = tl_tostore(L);
  int rc = tally_store_sync(d->store);
  if (rc < 0) return tl_fail(L, rc);
  lua_pushboolean(L, 1);
  return 1;
}

static int tl_store_check(lua_State *L) {
  tl_store *d = tl_tostore(L);
  int rc = tally_store_check(d->store);
  if (rc < 0) return tl_fail(L, rc);
  lua_pushboolean(L, 1);
  return 1;
}

static int tl_store_stats(lua_State *L) {
  tl_store *d = tl_tostore(L);
  tally_store_stats st;
  int rc = tally_store_stats_get(d->store, &st);
  if (rc < 0) return tl_fail(L, rc);
  lua_createtable(L, 0, 14);
  lua_pushstring(L, tally_store_kind(d->store));
  lua_setfield(L, -2, "kind");
  lua_pushinteger(L, (lua_Integer)st.format);
  lua_setfield(L, -2, "format");
  tl_setint(L, "max_bytes", (int64_t)st.max_bytes);
  tl_setint(L, "writers", (int64_t)st.writers);
  lua_pushinteger(L, (lua_Integer)st.schedules);
  lua_setfield(L, -2, "schedules");
  tl_setint(L, "counters", (int64_t)st.counters);
  tl_setint(L, "file_bytes", (int64_t)st.file_bytes);
  tl_setint(L, "used_bytes", (int64_t)st.used_bytes);
  tl_setint(L, "live_bytes", (int64_t)st.live_bytes);
  tl_setint(L, "retired_bytes", (int64_t)st.retired_bytes);
  tl_setint(L, "reusable_bytes", (int64_t)st.reusable_bytes);
  tl_setint(L, "reused_bytes", (int64_t)st.reused_bytes);
  tl_setint(L, "expired", (int64_t)st.expired);
  tl_setint(L, "capped", (int64_t)st.capped);
  return 1;
}

/* db:maintain(now_ms [, budget]) -> { scanned =, expired =, held = }: one
 * bounded step of upkeep (reuse, idle expiry); db:tick calls it. */
static int tl_store_maintain(lua_State *L) {
  tl_store *d = tl_tostore(L);
  tally_maintain_result r;
  lua_Integer now = 0, budget = 4096;
  int isnum = 0, rc;
  if (lua_type(L, 2) == LUA_TNUMBER) now = tl_tointx(L, 2, &isnum);
  if (!isnum || now < 0 || now > (lua_Integer)TALLY_MAINTAIN_MAX_MS)
    return tl_argerror_got(L, 2,
                           "time in milliseconds (an integer from 0 to 4294967293000) "
                           "expected",
                           2, TL_BOOL_VALUE);
  if (!lua_isnoneornil(L, 3)) {
    isnum = 0;
    if (lua_type(L, 3) == LUA_TNUMBER) budget = tl_tointx(L, 3, &isnum);
    if (!isnum || budget < 0 || budget > (lua_Integer)UINT32_MAX)
      return tl_argerror_got(L, 3, "budget must be an integer from 0 to 4294967295", 3,
                             TL_BOOL_VALUE);
  }
  rc = tally_store_maintain(d->store, (int64_t)now, (uint32_t)budget, &r);
  if (rc < 0) return tl_fail(L, rc);
  lua_createtable(L, 0, 3);
  tl_setint(L, "scanned", (int64_t)r.scanned);
  tl_setint(L, "expired", (int64_t)r.expired);
  tl_setint(L, "held", (int64_t)r.held);
  return 1;
}

/* db:grace() -> { epoch =, processes =, behind =, oldest_pid =,
 * oldest_seen = }: the processes with the store open (this one too) and
 * those holding reuse back. */
static int tl_store_grace(lua_State *L) {
  tl_store *d = tl_tostore(L);
  tally_grace_info g;
  int rc = tally_store_grace(d->store, &g);
  if (rc < 0) return tl_fail(L, rc);
  lua_createtable(L, 0, 5);
  tl_setint(L, "epoch", (int64_t)g.epoch);
  tl_setint(L, "processes", (int64_t)g.processes);
  tl_setint(L, "behind", (int64_t)g.behind);
  tl_setint(L, "oldest_pid", g.oldest_pid);
  tl_setint(L, "oldest_seen", (int64_t)g.oldest_seen);
  return 1;
}

static int tl_store_close(lua_State *L) {
  tl_store *d = (tl_store *)tl_checkudata(L, 1, TL_STORE_MT);
  /* a walk still reads the store after the Lua code it runs returns */
  if (d->walking)
    return luaL_error(L, "tally.store: cannot close the store while a walk of it "
                         "runs (close it after db:export returns)");
  if (d->store != NULL) {
    tl_store_release(L, d);
    tl_cache_clear(L); /* the closed handles need not stay */
  }
  return 0;
}

static int tl_store_tostring(lua_State *L) {
  tl_store *d = (tl_store *)tl_checkudata(L, 1, TL_STORE_MT);
  if (d->store == NULL)
    lua_pushliteral(L, "tally.store (closed)");
  else
    lua_pushfstring(L, "tally.store (%s)", d->spec);
  return 1;
}

static const luaL_Reg tl_store_methods[] = {{"counter", tl_store_counter},
                                            {"incr", tl_store_incr},
                                            {"decr", tl_store_decr},
                                            {"value", tl_store_value},
                                            {"drop", tl_store_drop},
                                            {"family", tl_store_family},
                                            {"sum", tl_store_sum},
                                            {"names", tl_store_names},
                                            {"_values", tl_store_values},
                                            {"_top", tl_store_top},
                                            {"sync", tl_store_sync},
                                            {"check", tl_store_check},
                                            {"stats", tl_store_stats},
                                            {"maintain", tl_store_maintain},
                                            {"grace", tl_store_grace},
                                            {"close", tl_store_close},
                                            {NULL, NULL}};

static const luaL_Reg tl_store_meta[] = {{"__gc", tl_store_close},
                                         {"__close", tl_store_close},
                                         {"__tostring", tl_store_tostring},
                                         {NULL, NULL}};

/* core.uri_redact(spec): a store spec or URI as messages show it, its
 * userinfo and query as *** (tally_uri_redact). */
static int tl_uri_redact(lua_State *L) {
  size_t len;
  const char *s = luaL_checklstring(L, 1, &len);
  tl_pushredacted(L, s, len);
  return 1;
}

int tl_open_store(lua_State *L) {
  tl_newclass(L, TL_STORE_MT, tl_store_meta, tl_store_methods);
  lua_setfield(L, -2, "store_methods");
  lua_pushcfunction(L, tl_uri_redact);
  lua_setfield(L, -2, "uri_redact");
#if TL_LUAJIT
  tl_set_classic(L, "store_incr", tl_store_incr); /* what ffi.lua replaces */
  tl_set_classic(L, "store_decr", tl_store_decr);
  tl_set_classic(L, "store_value", tl_store_value);
#endif
  tl_open_slots(L);
  return 0;
}
