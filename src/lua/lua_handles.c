/* lua_handles.c -- the cache of counter handles by name, and which names
 * it admits.
 *
 * db:incr(name), db:decr and db:value go through a handle: a name whose
 * handle is cached costs a table lookup and the handle's increment. The
 * cache holds at most handle_cache handles (tally.open's option) in two
 * generations; with handle_admit = "repeat" a name it misses is added by
 * name (tally_store_incr) and admitted only when it comes back soon.
 * lua_store.c calls in here; the FFI path (ffi.lua) reads the same
 * tables through core._store_cache.
 */
#include <stdint.h>
#include <string.h>

#include "lua_aux.h"

/* ---- the cache of handles by name ----------------------------------------------
 * db:incr(name), db:decr and db:value find a counter's handle by name in a
 * table, the store's user value TL_SUV_CACHE: on a hit that is one rawget.
 * With handle_cache = N > 0 (tally.open's option, default TL_HANDLE_CACHE)
 * the handles are held strongly, in two generations, a segmented LRU with
 * no write on a hit: the user value is the young table; a name missed
 * there is looked up in the old one and, if there, moved into young; a
 * handle opened by name goes into young. When young holds N/2 names (1
 * for N = 1), it becomes old, the old one is let go (its handles are
 * collected unless something else holds them; N = 1 keeps no old) and a
 * new young starts. So at most N handles are held, and a name used at
 * least once every N/2 new names keeps its handle. With N = 0 the one
 * table is weak-valued: a handle lives as long as something else holds it.
 *
 * The young table's metatable is the cache's state (TL_CS_*; __mode = "v"
 * when N = 0). Its identity never changes, so the FFI path (ffi.lua) keeps
 * it and reads the current young table from TL_CS_YOUNG on each call. */

enum {
  TL_CS_YOUNG = 1, /* the young table, also the user value */
  TL_CS_OLD,       /* the old table, or nil */
  TL_CS_NYOUNG,    /* names in young (N > 0 only) */
  TL_CS_NOLD,      /* names in old */
  TL_CS_CAP,       /* N */
  TL_CS_ROTATIONS, /* times young became old */
  TL_CS_DOOR       /* handle_admit = "repeat": its tl_door, else nil */
};

/* ---- admission: which missed names get a handle ---------------------------------
 * A handle costs about 380 bytes and a microsecond or more to open, and a
 * name seen once may never come back: over a million names taken at
 * random, a cache of 10,000 would open a handle for nearly every
 * increment and let it go soon after. With handle_admit = "repeat" (the
 * default) db:incr and db:decr of a name the cache does not hold add by
 * name without a handle (tally_store_incr: one index lookup) and set the
 * name's bit in a doorkeeper, as TinyLFU does; a name missed while its bit
 * is set is opened and cached. The bits are cleared when young rotates or
 * when 1/16 of them are set; there are at least 8 per handle the cache
 * holds, so "repeat" means within about the last handle_cache/2 misses
 * (8,192 at least) or admissions. "always" caches every name on its first
 * miss, as db:value and db:counter always do. */
#define TL_DOOR_MIN_BITS (1u << 17) /* 16 KiB: up to 16,384 handles */
#define TL_DOOR_MAX_BITS (1u << 28) /* 32 MiB: from 33,554,432 handles */

struct tl_door {
  uint32_t nbits;             /* a power of two */
  uint32_t set;               /* bits set since the last clear */
  uint64_t by_name, admitted; /* increments without a handle; admissions */
  uint64_t clears;            /* times the bits were cleared */
  uint64_t bits[];
};

static lua_Integer tl_cs_get(lua_State *L, int st, int k) {
  lua_Integer v;
  lua_rawgeti(L, st, k);
  v = (lua_Integer)lua_tonumber(L, -1);
  lua_pop(L, 1);
  return v;
}

static void tl_cs_set(lua_State *L, int st, int k, lua_Integer v) {
  lua_pushinteger(L, v);
  lua_rawseti(L, st, k);
}

/* Push the cache state of the store at arg 1; returns its index. */
static int tl_cache_state(lua_State *L) {
  tl_getuv(L, 1, TL_SUV_CACHE);
  lua_getmetatable(L, -1);
  lua_remove(L, -2);
  return lua_gettop(L);
}

/* A new, empty young table (room for size names) for the state at st of
 * the store at db: the store's user value and the state's TL_CS_YOUNG. */
static void tl_cache_newyoung(lua_State *L, int db, int st, lua_Integer size) {
  lua_createtable(L, 0, (int)size);
  lua_pushvalue(L, st);
  lua_setmetatable(L, -2);
  lua_pushvalue(L, -1);
  lua_rawseti(L, st, TL_CS_YOUNG);
  tl_setuv(L, db, TL_SUV_CACHE); /* pops it */
}

/* A new cache of at most cap handles (0: weak) for the store at db;
 * repeat: handle_admit = "repeat". */
void tl_cache_init(lua_State *L, int db, lua_Integer cap, int repeat) {
  int st;
  db = lua_absindex(L, db);
  lua_createtable(L, TL_CS_DOOR, cap == 0 ? 1 : 0);
  st = lua_gettop(L);
  if (cap == 0) {
    lua_pushliteral(L, "v");
    lua_setfield(L, st, "__mode");
  }
  tl_cs_set(L, st, TL_CS_NYOUNG, 0);
  tl_cs_set(L, st, TL_CS_NOLD, 0);
  tl_cs_set(L, st, TL_CS_CAP, cap);
  tl_cs_set(L, st, TL_CS_ROTATIONS, 0);
  if (repeat) {
    uint32_t nbits = TL_DOOR_MIN_BITS;
    tl_door *door;
    while (nbits < TL_DOOR_MAX_BITS && (lua_Integer)nbits < cap * 8) nbits *= 2;
    door = (tl_door *)lua_newuserdata(L, sizeof(tl_door) + nbits / 8);
    memset(door, 0, sizeof(tl_door) + nbits / 8);
    door->nbits = nbits;
    lua_rawseti(L, st, TL_CS_DOOR);
  }
  tl_cache_newyoung(L, db, st, 0);
  lua_pop(L, 1);
}

static void tl_door_clear(tl_door *door) {
  memset(door->bits, 0, door->nbits / 8);
  door->set = 0;
  door->clears++;
}

/* The doorkeeper of the state at st, or NULL ("always"). */
static tl_door *tl_door_of(lua_State *L, int st) {
  tl_door *door;
  lua_rawgeti(L, st, TL_CS_DOOR);
  door = (tl_door *)lua_touserdata(L, -1);
  lua_pop(L, 1);
  return door;
}

/* Let every cached handle go (db:close): an empty young, no old. */
void tl_cache_clear(lua_State *L) {
  int st = tl_cache_state(L);
  lua_pushnil(L);
  lua_rawseti(L, st, TL_CS_OLD);
  tl_cs_set(L, st, TL_CS_NYOUNG, 0);
  tl_cs_set(L, st, TL_CS_NOLD, 0);
  tl_cache_newyoung(L, 1, st, 0);
  lua_pop(L, 1);
}

/* Take the name at arg 2 out of generation gen (TL_CS_YOUNG or TL_CS_OLD)
 * of the state at st. */
static void tl_cache_forget(lua_State *L, int st, int gen) {
  lua_rawgeti(L, st, gen);
  if (lua_istable(L, -1)) {
    lua_pushvalue(L, 2);
    lua_rawget(L, -2);
    if (!lua_isnil(L, -1)) {
      /* a stamp in its name's entry names its slot again: the FFI path
       * cannot find the handle any more to take it back */
      tl_slot_unstamp(L, 1, 2, (tl_counter *)lua_touserdata(L, -1));
      lua_pushvalue(L, 2);
      lua_pushnil(L);
      lua_rawset(L, -4);
      if (tl_cs_get(L, st, TL_CS_CAP) > 0)
        tl_cs_set(L, st, gen + 2, tl_cs_get(L, st, gen + 2) - 1); /* its count */
    }
    lua_pop(L, 1);
  }
  lua_pop(L, 1);
}

/* Cache the handle at h under the name at arg 2 of the store at arg 1:
 * into young (replacing what young had for it), out of old. A new name
 * in a full young rotates the generations first. */
void tl_cache_put(lua_State *L, int h) {
  int st = tl_cache_state(L);
  lua_Integer cap = tl_cs_get(L, st, TL_CS_CAP);
  if (cap > 0) {
    int present;
    lua_rawgeti(L, st, TL_CS_YOUNG);
    lua_pushvalue(L, 2);
    lua_rawget(L, -2);
    present = !lua_isnil(L, -1);
    lua_pop(L, 2);
    if (!present) {
      lua_Integer ny = tl_cs_get(L, st, TL_CS_NYOUNG);
      tl_cache_forget(L, st, TL_CS_OLD);
      if (ny >= (cap >= 2 ? cap / 2 : 1)) { /* young is full: it becomes old */
        lua_rawgeti(L, st, TL_CS_OLD);      /* the old one, let go: below */
        if (cap >= 2) {
          lua_rawgeti(L, st, TL_CS_YOUNG);
          lua_rawseti(L, st, TL_CS_OLD);
          tl_cs_set(L, st, TL_CS_NOLD, ny);
        } else {
          lua_pushnil(L);
          lua_rawseti(L, st, TL_CS_OLD);
          tl_cs_set(L, st, TL_CS_NOLD, 0);
        }
        tl_cs_set(L, st, TL_CS_ROTATIONS, tl_cs_get(L, st, TL_CS_ROTATIONS) + 1);
        if (tl_door_of(L, st)) tl_door_clear(tl_door_of(L, st));
        tl_cache_newyoung(L, 1, st, ny); /* it will fill as the last one did */
        ny = 0;
        if (cap >= 2) { /* names hit through their slots stay (lua_slots.c) */
          lua_rawgeti(L, st, TL_CS_OLD);
          lua_rawgeti(L, st, TL_CS_YOUNG);
          ny = tl_slots_rotate(L, 1, -3, -2, -1, cap / 2 - 1);
          lua_pop(L, 2);
        }
        lua_pop(L, 1);
      }
      tl_cs_set(L, st, TL_CS_NYOUNG, ny + 1);
    }
  }
  lua_rawgeti(L, st, TL_CS_YOUNG);
  lua_pushvalue(L, 2);
  lua_pushvalue(L, h);
  lua_rawset(L, -3);
  lua_pop(L, 2);
  tl_slot_lend(L, 1, 2, h);
}

/* The open handle the old generation has for the name at arg 2, moved
 * into young and pushed: returns 1; else 0 with nothing pushed. */
int tl_cache_promote(lua_State *L) {
  int st = tl_cache_state(L);
  tl_counter *h;
  lua_rawgeti(L, st, TL_CS_OLD);
  if (!lua_istable(L, -1)) {
    lua_pop(L, 2);
    return 0;
  }
  lua_pushvalue(L, 2);
  lua_rawget(L, -2); /* st old h */
  h = (tl_counter *)lua_touserdata(L, -1);
  if (h == NULL || h->c == NULL) {
    lua_pop(L, 3);
    return 0;
  }
  lua_replace(L, st);
  lua_pop(L, 1);
  tl_cache_put(L, st);
  return 1;
}

/* The handle cached for the name at arg 2 (young, then old; not moved),
 * or NULL. Nothing is pushed: the cache keeps it alive. */
tl_counter *tl_cache_peek(lua_State *L) {
  int st = tl_cache_state(L), gen;
  tl_counter *h = NULL;
  for (gen = TL_CS_YOUNG; gen <= TL_CS_OLD && h == NULL; gen++) {
    lua_rawgeti(L, st, gen);
    if (lua_istable(L, -1)) {
      lua_pushvalue(L, 2);
      lua_rawget(L, -2);
      h = (tl_counter *)lua_touserdata(L, -1);
      lua_pop(L, 1);
    }
    lua_pop(L, 1);
  }
  lua_pop(L, 1);
  return h;
}

/* Forget the cached handle for the name at arg 2 (it stays usable). */
void tl_uncache(lua_State *L) {
  int st = tl_cache_state(L);
  tl_cache_forget(L, st, TL_CS_YOUNG);
  tl_cache_forget(L, st, TL_CS_OLD);
  lua_pop(L, 1);
}

/* The doorkeeper's bit for a name. */
static uint32_t tl_door_bit(const tl_door *door, const char *name, size_t len) {
  uint64_t h = tl_name_hash(name, len);
  return (uint32_t)(h ^ h >> 32) & (door->nbits - 1);
}

/* The doorkeeper's word on the name at arg 2 (len bytes) of the store at
 * arg 1: NULL to open and cache its handle (handle_admit = "always", or
 * the name is marked: admitted), else the doorkeeper and in *bit the
 * name's bit, for tl_door_mark once the name was used without a handle. */
tl_door *tl_door_pass(lua_State *L, const char *name, size_t len, uint32_t *bit) {
  tl_door *door = tl_door_of(L, tl_cache_state(L));
  lua_pop(L, 1);
  if (door == NULL) return NULL;
  *bit = tl_door_bit(door, name, len);
  if (door->bits[*bit / 64] & (1ull << (*bit % 64))) {
    door->admitted++;
    return NULL;
  }
  return door;
}

void tl_door_mark(tl_door *door, uint32_t bit) {
  door->by_name++;
  door->bits[bit / 64] |= 1ull << (bit % 64);
  if (++door->set >= door->nbits / 16) tl_door_clear(door);
}

/* core._store_cache(db) -> the state of the store's cache of counter
 * handles by name (TL_CS_*: [1] is the young table db:incr(name) looks
 * in), so the FFI path shares it. */
static int tl_store_cache(lua_State *L) {
  tl_checkudata(L, 1, TL_STORE_MT);
  lua_settop(L, 1);
  tl_cache_state(L);
  return 1;
}

static lua_Integer tl_count(lua_State *L, int t) {
  lua_Integer n = 0;
  if (!lua_istable(L, t)) return 0;
  lua_pushnil(L);
  while (lua_next(L, t) != 0) {
    lua_pop(L, 1);
    n++;
  }
  return n;
}

/* core._store_cache_stats(db) -> { young =, old =, held =, cap =,
 * rotations = }: the handles each generation holds, counted (for tests
 * and benchmarks). */
static int tl_store_cache_stats(lua_State *L) {
  int st;
  lua_Integer ny, no;
  tl_checkudata(L, 1, TL_STORE_MT);
  lua_settop(L, 1);
  st = tl_cache_state(L);
  lua_rawgeti(L, st, TL_CS_YOUNG);
  ny = tl_count(L, st + 1);
  lua_rawgeti(L, st, TL_CS_OLD);
  no = tl_count(L, st + 2);
  lua_createtable(L, 0, 5);
  tl_setint(L, "young", (int64_t)ny);
  tl_setint(L, "old", (int64_t)no);
  tl_setint(L, "held", (int64_t)(ny + no));
  tl_setint(L, "cap", (int64_t)tl_cs_get(L, st, TL_CS_CAP));
  tl_setint(L, "rotations", (int64_t)tl_cs_get(L, st, TL_CS_ROTATIONS));
  return 1;
}

/* core._store_cache_door(db) -> { by_name =, admitted =, clears =, set =,
 * bits = }
 * (handle_admit = "repeat"), or nil ("always"). */
static int tl_store_cache_door(lua_State *L) {
  tl_door *door;
  tl_checkudata(L, 1, TL_STORE_MT);
  lua_settop(L, 1);
  door = tl_door_of(L, tl_cache_state(L));
  if (door == NULL) return 0;
  lua_createtable(L, 0, 4);
  tl_setint(L, "by_name", (int64_t)door->by_name);
  tl_setint(L, "admitted", (int64_t)door->admitted);
  tl_setint(L, "clears", (int64_t)door->clears);
  tl_setint(L, "set", (int64_t)door->set);
  tl_setint(L, "bits", (int64_t)door->nbits);
  return 1;
}

int tl_open_handles(lua_State *L) {
  lua_pushcfunction(L, tl_store_cache);
  lua_setfield(L, -2, "_store_cache");
  lua_pushcfunction(L, tl_store_cache_stats);
  lua_setfield(L, -2, "_store_cache_stats");
  lua_pushcfunction(L, tl_store_cache_door);
  lua_setfield(L, -2, "_store_cache_door");
  lua_pushinteger(L, TL_HANDLE_CACHE);
  lua_setfield(L, -2, "HANDLE_CACHE");
  return 0;
}
