/* lua_slots.c -- name slots: db:incr(name) as one table lookup and a
 * vector add.
 *
 * Over many names, db:incr(name) on a cached name costs four dependent
 * misses: the cache table's node, the handle userdata, its tally_counter,
 * the cell. So every handle a store handle caches, of the thread or random
 * policy, is lent a slot of a tally_vector the store handle owns, and a
 * table (user value TL_SUV_SLOTS) maps name -> slot. db:incr (the FFI
 * path's in ffi.lua, and the classic one's, tl_slot_incr) reads that
 * table's node and calls tally_vector_incr, which reads the slot's word
 * (or its dense bit and base, which stay in cache) and adds to the cell:
 * two or three misses (see docs/lua-api.md, "name slots").
 *
 * A slot only caches. The handle stays the cache's: the vector gives it
 * back, open, when the handle closes (c:close, its __gc, db:close). An
 * increment the slot cannot make (a dropped counter, a closed store)
 * returns non-zero and db:incr takes the cache's path, which reopens the
 * name if need be and lends the new handle a slot in place of the old.
 *
 * The invariant db:incr relies on: a name's entry names a slot that holds
 * a handle of that name, or an empty one (its increment is ENOENT); a slot
 * is reused only after the entry naming it is gone.
 *
 * An increment through a slot does not touch the cache's tables, so the
 * cache would let a name used only that way go two rotations after it was
 * put in young. An entry is therefore -1 - slot when the handle enters
 * young or its generation rotates, and db:incr writes the slot itself on
 * a hit (to the table node it just read): at a rotation, the names of
 * the outgoing old generation whose entry was hit since the last one are
 * carried into the new young, as a hit in old would move them; the others
 * give their slots back then, not when they are collected, so there are
 * about as many slots as handles the cache holds.
 *
 * Stamps. The FFI path's db:incr replaces a hit entry by its counter's
 * stamp (tally_vector_stamp, at least TL_STAMP_MIN: the cell itself), so
 * its next increment reads no slot word at all; a stamp made stale by a
 * move adds nothing, and that db:incr stamps the name again through its
 * handle. A stamped entry counts as hit and names no slot: where this file
 * needs the slot, it takes the one of the cache's handle for the name
 * (h->slot1), and a stamped entry it cannot tie to a lent handle is
 * removed. A handle lent a slot while an older one of its name holds a
 * stamped entry leaves the older one's slot lent until that is collected.
 */
#include <stdlib.h>
#include <string.h>

#include "lua_aux.h"

#define TL_SLOTS_FIRST 256 /* the vector's first size; it doubles */

int tl_slot_incr(lua_State *L, tl_store *d, int name, lua_Integer n) {
  lua_Integer v;
  tl_getuv(L, 1, TL_SUV_SLOTS);
  lua_pushvalue(L, name);
  lua_rawget(L, -2);
  v = lua_tointegerx(L, -1, NULL); /* 0 for nil: a slot 0 entry is -1 or 0 */
  if (v >= TL_STAMP_MIN) return 0; /* a stamp: the FFI path's; the cache's path */
  if (v < 0) {                     /* its first hit since it was lent or rotated */
    v = -1 - v;
    lua_pushvalue(L, name);
    lua_pushinteger(L, v);
    lua_rawset(L, -4);
  } else if (v == 0 && lua_type(L, -1) != LUA_TNUMBER) {
    return 0;
  }
  return tally_vector_incr(d->vec, (size_t)v, (int64_t)n) == 0;
}

/* A free slot (grown if need be), or -1. */
static ptrdiff_t tl_slot_alloc(tl_store *d) {
  if (d->nspare > 0) return (ptrdiff_t)d->spare[--d->nspare];
  if (d->used == d->cap) {
    size_t cap = d->cap ? d->cap * 2 : TL_SLOTS_FIRST;
    tl_counter **lent = realloc(d->lent, cap * sizeof *lent);
    size_t *spare;
    if (lent == NULL) return -1;
    d->lent = lent;
    memset(lent + d->cap, 0, (cap - d->cap) * sizeof *lent);
    if ((spare = realloc(d->spare, cap * sizeof *spare)) == NULL) return -1;
    d->spare = spare;
    if (d->vec == NULL ? tally_vector_new(d->store, cap, &d->vec) != 0
                       : tally_vector_grow(d->vec, cap) != 0)
      return -1;
    d->cap = cap;
  }
  return (ptrdiff_t)d->used++;
}

/* Slot i's handle, if any, taken back from the vector (left open). */
static void tl_slot_empty(tl_store *d, size_t i) {
  tl_counter *h = d->lent[i];
  if (h == NULL) return;
  (void)tally_vector_take(d->vec, i);
  h->slot1 = 0;
  d->lent[i] = NULL;
}

/* Slot i emptied and kept for reuse: no entry may name it any more. One
 * already spare (a stale entry named it) is not kept twice. */
static void tl_slot_free(tl_store *d, size_t i) {
  if (i >= d->used || d->lent[i] == NULL) return;
  tl_slot_empty(d, i);
  d->spare[d->nspare++] = i;
}

/* The slot an entry (at idx, a number, not a stamp) names, hit or not. */
static size_t tl_slot_at(lua_State *L, int idx) {
  lua_Integer v = lua_tointeger(L, idx);
  return (size_t)(v < 0 ? -1 - v : v);
}

static int tl_slot_stamped(lua_State *L, int idx) {
  return lua_type(L, idx) == LUA_TNUMBER && lua_tointeger(L, idx) >= TL_STAMP_MIN;
}

/* Is slot i lent to a handle of h's name? */
static int tl_slot_named(tl_store *d, size_t i, const tl_counter *h) {
  const tl_counter *o = i < d->used ? d->lent[i] : NULL;
  return o != NULL && o->namelen == h->namelen &&
         memcmp(o->name, h->name, h->namelen) == 0;
}

/* Is h a handle that holds a slot of d? */
static int tl_slot_holder(tl_store *d, const tl_counter *h) {
  return h != NULL && h->slot1 != 0 && h->slot1 <= d->used && d->lent[h->slot1 - 1] == h;
}

void tl_slot_lend(lua_State *L, int db, int name, int h) {
  tl_store *d = (tl_store *)lua_touserdata(L, db);
  tl_counter *hd = (tl_counter *)lua_touserdata(L, h);
  ptrdiff_t i;
  if (d->store == NULL || hd == NULL || hd->c == NULL || hd->slot1 != 0 ||
      (hd->policy != TALLY_POLICY_THREAD && hd->policy != TALLY_POLICY_RANDOM))
    return;
  name = lua_absindex(L, name);
  tl_getuv(L, db, TL_SUV_SLOTS);
  lua_pushvalue(L, name);
  lua_rawget(L, -2);
  if (lua_type(L, -1) == LUA_TNUMBER) { /* an older handle's: its entry is replaced */
    size_t old = tl_slot_at(L, -1);
    if (!tl_slot_stamped(L, -1) && tl_slot_named(d, old, hd))
      tl_slot_free(d, old); /* only if that handle's: else the entry was stale */
    lua_pushvalue(L, name);
    lua_pushnil(L);
    lua_rawset(L, -4);
  }
  lua_pop(L, 1);
  if ((i = tl_slot_alloc(d)) >= 0) {
    if (tally_vector_put(d->vec, (size_t)i, hd->c) == 0) {
      d->lent[i] = hd;
      hd->slot1 = (size_t)i + 1;
      lua_pushvalue(L, name);
      lua_pushinteger(L, -1 - (lua_Integer)i); /* not hit yet */
      lua_rawset(L, -3);
    } else {
      d->spare[d->nspare++] = (size_t)i; /* never lent */
    }
  }
  lua_pop(L, 1);
}

void tl_slot_unstamp(lua_State *L, int db, int name, tl_counter *h) {
  tl_store *d = (tl_store *)lua_touserdata(L, db);
  if (d == NULL || !tl_slot_holder(d, h)) return;
  name = lua_absindex(L, name);
  tl_getuv(L, db, TL_SUV_SLOTS);
  lua_pushvalue(L, name);
  lua_rawget(L, -2);
  if (tl_slot_stamped(L, -1)) {
    lua_pushvalue(L, name);
    lua_pushinteger(L, (lua_Integer)(h->slot1 - 1));
    lua_rawset(L, -4);
  }
  lua_pop(L, 2);
}

void tl_slot_return(lua_State *L, int h) {
  tl_counter *hd = (tl_counter *)lua_touserdata(L, h);
  size_t i;
  if (hd == NULL || hd->slot1 == 0) return;
  i = hd->slot1 - 1;
  h = lua_absindex(L, h);
  tl_getuv(L, h, TL_CUV_STORE);
  tl_getuv(L, -1, TL_SUV_SLOTS);
  lua_pushlstring(L, hd->name, hd->namelen);
  lua_rawget(L, -2);
  if (lua_type(L, -1) == LUA_TNUMBER &&
      (tl_slot_stamped(L, -1) || tl_slot_at(L, -1) == i)) {
    lua_pushlstring(L, hd->name, hd->namelen);
    lua_pushnil(L);
    lua_rawset(L, -4);
  }
  lua_pop(L, 3);
  tl_slot_free(hd->db, i);
}

/* Mark the entries of the names in the table at t (name -> handle) not
 * hit (the table of slots on top of the stack); a stamped one names the
 * slot of t's handle, or goes if that holds none. */
static void tl_slots_unhit(lua_State *L, tl_store *d, int t) {
  lua_pushnil(L);
  while (lua_next(L, t) != 0) { /* slots name h */
    tl_counter *h = (tl_counter *)lua_touserdata(L, -1);
    lua_pushvalue(L, -2);
    lua_rawget(L, -4); /* slots name h entry */
    if (tl_slot_stamped(L, -1)) {
      lua_pushvalue(L, -3);
      if (tl_slot_holder(d, h))
        lua_pushinteger(L, -1 - (lua_Integer)(h->slot1 - 1));
      else
        lua_pushnil(L);
      lua_rawset(L, -6);
    } else if (lua_type(L, -1) == LUA_TNUMBER && lua_tointeger(L, -1) >= 0) {
      lua_Integer v = lua_tointeger(L, -1);
      lua_pushvalue(L, -3);
      lua_pushinteger(L, -1 - v);
      lua_rawset(L, -6);
    }
    lua_pop(L, 2);
  }
}

lua_Integer tl_slots_rotate(lua_State *L, int db, int gone, int old, int young,
                            lua_Integer room) {
  tl_store *d = (tl_store *)lua_touserdata(L, db);
  lua_Integer carried = 0;
  if (d->used == 0) return 0;
  db = lua_absindex(L, db);
  gone = lua_absindex(L, gone);
  old = lua_absindex(L, old);
  young = lua_absindex(L, young);
  tl_getuv(L, db, TL_SUV_SLOTS);
  if (lua_istable(L, gone)) { /* hit since the last rotation: carried */
    lua_pushnil(L);
    while (lua_next(L, gone) != 0) { /* slots name h */
      tl_counter *h = (tl_counter *)lua_touserdata(L, -1);
      lua_pushvalue(L, -2);
      lua_rawget(L, -4); /* slots name h entry */
      if (h != NULL && lua_type(L, -1) == LUA_TNUMBER &&
          (tl_slot_stamped(L, -1) ? tl_slot_holder(d, h)
                                  : h->slot1 == tl_slot_at(L, -1) + 1)) {
        if (carried < room && lua_tointeger(L, -1) >= 0) {
          lua_pushvalue(L, -3);
          lua_pushvalue(L, -3);
          lua_rawset(L, young);
          carried++;
        } else { /* let go: its slot comes back now, not when it is collected */
          size_t i = h->slot1 - 1;
          lua_pushvalue(L, -3);
          lua_pushnil(L);
          lua_rawset(L, -6);
          tl_slot_free(d, i);
        }
      }
      lua_pop(L, 2);
    }
  }
  /* young first: a name in both has its newer handle there */
  tl_slots_unhit(L, d, young); /* what was carried */
  tl_slots_unhit(L, d, old);   /* and what is old now */
  lua_pop(L, 1);
  return carried;
}

void tl_slot_unlend(tl_counter *h) {
  if (h->slot1 != 0) tl_slot_empty(h->db, h->slot1 - 1); /* stays out of spare */
}

void tl_slots_release(lua_State *L, int db) {
  tl_store *d = (tl_store *)lua_touserdata(L, db);
  db = lua_absindex(L, db);
  for (size_t i = 0; i < d->used; i++) tl_slot_empty(d, i);
  tally_vector_free(d->vec); /* empty: closes nothing */
  free(d->lent);
  free(d->spare);
  d->vec = NULL;
  d->lent = NULL;
  d->spare = NULL;
  d->nspare = d->used = d->cap = 0;
  tl_getuv(L, db, TL_SUV_SLOTS); /* emptied in place: the FFI keeps it */
  lua_pushnil(L);
  while (lua_next(L, -2) != 0) {
    lua_pop(L, 1);
    lua_pushvalue(L, -1);
    lua_pushnil(L);
    lua_rawset(L, -4);
  }
  lua_pop(L, 1);
}

/* core._store_slots(db) -> the store's table of name slots (name ->
 * slot, -1 - slot until hit): what the FFI path's db:incr looks in. */
static int tl_store_slots(lua_State *L) {
  tl_checkudata(L, 1, TL_STORE_MT);
  tl_getuv(L, 1, TL_SUV_SLOTS);
  return 1;
}

/* core._store_slots_stats(db) -> { lent =, dense =, used =, spare =, size = }:
 * slots holding a handle, those of them the vector reaches without their
 * slot word (tally_vector_fast 2), slots handed out so far, kept for
 * reuse, and the vector's size (for tests and benchmarks). */
static int tl_store_slots_stats(lua_State *L) {
  tl_store *d = (tl_store *)tl_checkudata(L, 1, TL_STORE_MT);
  int64_t lent = 0, dense = 0;
  for (size_t i = 0; i < d->used; i++) {
    lent += d->lent[i] != NULL;
    dense += tally_vector_fast(d->vec, i) == 2;
  }
  lua_createtable(L, 0, 5);
  tl_setint(L, "lent", lent);
  tl_setint(L, "dense", dense);
  tl_setint(L, "used", (int64_t)d->used);
  tl_setint(L, "spare", (int64_t)d->nspare);
  tl_setint(L, "size", (int64_t)tally_vector_size(d->vec));
  return 1;
}

void tl_open_slots(lua_State *L) {
  lua_pushcfunction(L, tl_store_slots);
  lua_setfield(L, -2, "_store_slots");
  lua_pushcfunction(L, tl_store_slots_stats);
  lua_setfield(L, -2, "_store_slots_stats");
}
