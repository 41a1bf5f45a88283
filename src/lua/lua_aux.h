/* lua_aux.h -- the binding's one toolkit: what every file of src/lua shares.
 *
 * The binding is one file per handle type (lua_store.c, lua_counter.c,
 * lua_rollup.c, lua_sender.c, lua_redis.c) and lua_module.c, which lists
 * them as Lua's linit.c lists its libraries. Each file uses this toolkit
 * (lua_aux.c) and nothing of another file, with one exception in one
 * direction: a store makes counter handles, so lua_store.c calls the
 * counter-handle functions of lua_counter.c declared at the end. The
 * toolkit holds: the Lua 5.4 / LuaJIT compatibility block; the store and
 * counter handles, which other handles (schedules, flushers) and the tally
 * command hold on to; the argument checks and the hand-built "bad argument
 * #N to 'f' (...)" messages; the nil, message, code failure convention;
 * and the one way to register a class.
 */
#ifndef TALLY_LUA_AUX_H
#define TALLY_LUA_AUX_H

#include <limits.h>
#include <stddef.h>
#include <stdint.h>

#include "lua.h"
#include "lauxlib.h"
#include "tally.h"

/* ---- Lua version compatibility ---------------------------------------------
 * The binding is built twice from the same sources: against Lua 5.4 (the
 * primary target) and against LuaJIT 2.1 (OpenResty). Everything outside
 * this block is what both C APIs share. Under LuaJIT every number is a
 * double: counter values within +-2^53 cross as plain numbers, larger ones
 * as int64_t cdata built by the Lua function registered with
 * core.set_box (see tl_pushint64), and integer arguments must be exact. */
#if LUA_VERSION_NUM >= 504
#define TL_LUAJIT                0
#define tl_newud(L, sz, nuv)     lua_newuserdatauv((L), (sz), (nuv))
#define tl_getuv(L, idx, n)      ((void)lua_getiuservalue((L), (idx), (n)))
#define tl_setuv(L, idx, n)      ((void)lua_setiuservalue((L), (idx), (n)))
#define tl_checkversion(L)       luaL_checkversion(L)
#define tl_tointx(L, idx, isnum) lua_tointegerx((L), (idx), (isnum))
#define tl_checkinteger(L, arg)  luaL_checkinteger((L), (arg))
#define tl_pushint64(L, v)       lua_pushinteger((L), (lua_Integer)(v))
#define tl_canpush(L, v)         ((void)(L), (void)(v), 1)
#elif LUA_VERSION_NUM == 501
#include "luajit.h" /* LuaJIT 2.1; plain Lua 5.1 is not supported */
#define TL_LUAJIT          1
#define TL_TCDATA          10 /* what lua_type() says for a cdata (not in lua.h) */
#define TL_EXACT           9007199254740992.0 /* 2^53: larger doubles skip integers */
#define lua_rawlen(L, idx) lua_objlen((L), (idx))
#define lua_absindex(L, idx)                                                             \
  ((idx) > 0 || (idx) <= LUA_REGISTRYINDEX ? (idx) : lua_gettop(L) + (idx) + 1)
/* The module takes the address of luaJIT_setmode, which only LuaJIT
 * exports, so loading it into any other Lua fails at require time
 * (dlopen: undefined symbol); the Lua 5.4 build needs luaL_checkversion_
 * and lua_newuserdatauv, which LuaJIT lacks, so it cannot load here. */
static inline void tl_checkversion(lua_State *L) {
  int (*volatile needs_luajit)(lua_State *, int, int) = luaJIT_setmode;
  (void)L;
  (void)needs_luajit;
}
/* One table as the user value (the fenv) holds the n slots. */
static inline void *tl_newud(lua_State *L, size_t sz, int nuv) {
  void *p = lua_newuserdata(L, sz);
  lua_createtable(L, nuv, 0);
  lua_setfenv(L, -2);
  return p;
}
static inline void tl_getuv(lua_State *L, int idx, int n) {
  lua_getfenv(L, idx);
  lua_rawgeti(L, -1, n);
  lua_remove(L, -2);
}
static inline void tl_setuv(lua_State *L, int idx, int n) { /* pops the value */
  idx = lua_absindex(L, idx);
  lua_getfenv(L, idx);
  lua_insert(L, -2);
  lua_rawseti(L, -2, n);
  lua_pop(L, 1);
}
/* A string of a decimal integer in the int64_t range (spaces around, a
 * sign): 1 and *out, exactly, as Lua 5.4 converts it; else 0. */
int tl_decimal_int64(const char *s, size_t len, int64_t *out);
/* Like Lua 5.4's: a number or numeric string with an exact integer value
 * (here also within +-2^53, but for a decimal integer string, which is
 * exact as in 5.4); LuaJIT's own truncates 1.5 to 1, and takes
 * "9007199254740993" as the double next to it. */
static inline lua_Integer tl_tointx(lua_State *L, int idx, int *isnum) {
  lua_Number d;
  int64_t v;
  *isnum = 0;
  if (lua_type(L, idx) == LUA_TSTRING) {
    size_t len;
    const char *s = lua_tolstring(L, idx, &len);
    if (tl_decimal_int64(s, len, &v)) {
      *isnum = 1;
      return (lua_Integer)v;
    }
  }
  if (!lua_isnumber(L, idx)) return 0;
  d = lua_tonumber(L, idx);
  if (!(d >= -TL_EXACT && d <= TL_EXACT) || (lua_Number)(int64_t)d != d) return 0;
  *isnum = 1;
  return (lua_Integer)d;
}
lua_Integer tl_checkinteger(lua_State *L, int arg);
/* Push v: a number within +-2^53, else an int64_t cdata (raises if no box
 * is registered). tl_canpush(L, v) tells whether that push can succeed. */
void tl_pushint64(lua_State *L, int64_t v);
int tl_canpush(lua_State *L, int64_t v);
#else
#error "tally's Lua binding builds against Lua 5.4 or LuaJIT 2.1 headers"
#endif

/* Opens by name that find the counter dropped by another process between
 * two steps and open (create) it again, at most this many times more: a
 * name dropped and made again in a tight loop elsewhere still gets one. */
#define TL_DROP_RETRIES 16

#if defined(__GNUC__)
#define TL_LIKELY(x)   __builtin_expect(!!(x), 1)
#define TL_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define TL_EXPORT      __attribute__((visibility("default")))
#else
#define TL_LIKELY(x)   (x)
#define TL_UNLIKELY(x) (x)
#define TL_EXPORT
#endif

/* ---- the store and counter handles -----------------------------------------
 * A store handle (metatable "tally.store", made in lua_store.c) holds the
 * tally_store pointer and its spec; a counter handle ("tally.counter",
 * lua_counter.c) holds the tally_counter pointer and a link in its store's
 * list of open handles. Closing sets the C pointer to NULL. */
#define TL_STORE_MT   "tally.store"
#define TL_COUNTER_MT "tally.counter"

/* Salts for the self-pointers: a counter never passes for a store. */
#define TL_STORE_SALT   ((uintptr_t)0x5a17e5u)
#define TL_COUNTER_SALT ((uintptr_t)0xc0417e5u)
#define TL_HIST_SALT    ((uintptr_t)0x4157e5u)

/* user values of a store handle, then of a counter handle */
enum { TL_SUV_CACHE = 1, TL_SUV_FAMILIES = 2, TL_SUV_SLOTS = 3, TL_SUV_N = 3 };
enum { TL_CUV_STORE = 1, TL_CUV_POLICY = 2, TL_CUV_N = 2 };

typedef struct tl_counter tl_counter;
typedef struct tl_hist tl_hist;

/* Under LuaJIT, lua/tally/ffi.lua reads key and store straight from the
 * userdata (struct tally_ffi_store there; h:observe's batches); it checks
 * their offsets and the size against core._ffi_info() (lua_counter.c) and
 * keeps batches classic if they differ. */
typedef struct tl_store {
  uintptr_t key;            /* (uintptr_t)self ^ TL_STORE_SALT */
  tally_store *store;       /* NULL once closed */
  tally_vector *vec;        /* name slots (lua_slots.c), NULL: none yet or closed */
  tl_counter **lent;        /* per slot: the handle lent to it, or NULL */
  size_t *spare;            /* slots free to reuse */
  size_t nspare, used, cap; /* slots handed out so far; lent's room */
  tl_counter *counters;     /* open counter handles made on this store */
  tl_hist *hists;           /* open histogram writers (lua_histogram.c) */
  unsigned walking;         /* C walks running Lua code (an export's write) */
  size_t speclen;
  char spec[]; /* "memory" or "file:PATH" */
} tl_store;

/* Under LuaJIT, lua/tally/ffi.lua reads c, db, policy and slot1 straight
 * from the userdata (struct tally_ffi_counter there); it checks offsets
 * against core._ffi_info() (lua_counter.c) and stays classic if they
 * differ. */
struct tl_counter {
  uintptr_t key;    /* (uintptr_t)self ^ TL_COUNTER_SALT */
  tally_counter *c; /* NULL once closed (also when its store closes) */
  tl_store *db;     /* kept alive through user value TL_CUV_STORE */
  tl_counter *prev, *next;
  int32_t policy; /* the stored policy */
  int hasfn;      /* CUSTOM with a Lua function in TL_CUV_POLICY */
  size_t slot1;   /* 1 + its name slot in db->vec, 0: none */
  size_t namelen;
  char name[];
};

/* A histogram's writer (lua_histogram.c). Under LuaJIT, lua/tally/ffi.lua
 * reads h straight from the userdata (struct tally_ffi_hist there), its
 * offset checked against core._ffi_info().hist_h. */
struct tl_hist {
  uintptr_t key;      /* (uintptr_t)self ^ TL_HIST_SALT */
  tally_histogram *h; /* NULL once closed (also when its store closes) */
  tl_store *db;       /* kept alive through its user value */
  tl_hist *prev, *next;
};

/* ---- arguments and messages ------------------------------------------------ */

/* How tl_describe shows a boolean: as true / false, or as its type name
 * "boolean" (what the sender's and Redis messages have always said). */
enum { TL_BOOL_VALUE = 0, TL_BOOL_TYPE = 1 };

/* Push and return s (len bytes) as messages write names and other given
 * strings (tally_printable: control characters and bytes that are not
 * UTF-8 as \xNN). Every message below goes through it. */
const char *tl_pushprintable(lua_State *L, const char *s, size_t len);
/* Push s (len bytes) as messages show a URI (tally_uri_redact: its
 * userinfo and query as ***) and return it. */
const char *tl_pushredacted(lua_State *L, const char *s, size_t len);
/* luaL_error, its message through tl_pushprintable; never returns. */
int tl_error(lua_State *L, const char *fmt, ...);
/* Push and return a short description of the value at idx for messages:
 * 'str' (quoted), a number as Lua writes it, a boolean (see above), else
 * its type name (nil, table, no value). */
const char *tl_describe(lua_State *L, int idx, int bools);
/* Raise "bad argument #arg to 'f' (<fmt formatted>)"; never returns. */
int tl_argerror(lua_State *L, int arg, const char *fmt, ...);
/* Raise "bad argument #arg to 'f' (what, got <tl_describe of idx>)". */
int tl_argerror_got(lua_State *L, int arg, const char *what, int idx, int bools);
/* Raise "bad argument #arg to 'f' (tname expected, got T)", T being the
 * value's __name, or its type name: luaL_typeerror of Lua 5.4, also
 * under LuaJIT. */
int tl_typeerror(lua_State *L, int arg, const char *tname);
/* The full userdata of metatable tname at idx; raises as above otherwise. */
void *tl_checkudata(lua_State *L, int idx, const char *tname);
/* A strict string argument (numbers are not names); raises otherwise. */
const char *tl_checkstring(lua_State *L, int arg, size_t *len);
/* A counter increment at arg (nil or none: 1): an integer; under LuaJIT
 * also an int64_t or uint64_t cdata (see core.set_box). Raises otherwise. */
int64_t tl_checkdelta(lua_State *L, int arg);
/* NULL and the integer at idx in *out if it is one tl_checkdelta takes,
 * else why not (the words of its error, perhaps pushed). Never raises. */
const char *tl_int64_at(lua_State *L, int idx, int64_t *out);
/* A count for a message: lua_pushfstring knows %d (an int), not %zu. */
static inline int tl_int(size_t n) {
  return n > (size_t)INT_MAX ? INT_MAX : (int)n;
}
/* -n for an increment n, without undefined behaviour on the minimum. */
static inline lua_Integer tl_negate(lua_Integer n) {
  return (lua_Integer)(0u - (uint64_t)n);
}
/* The open store or counter handle at idx; raise "attempt to use a closed
 * store" (or counter) otherwise. */
tl_store *tl_checkstore(lua_State *L, int idx);
tl_counter *tl_checkcounter(lua_State *L, int idx);

/* ---- results -------------------------------------------------------------- */

/* Push nil, message, code name (the environment-failure convention) and
 * return 3: the message is tally_errmsg(), or msg. */
int tl_fail(lua_State *L, int rc);
int tl_fail_msg(lua_State *L, int rc, const char *msg);
/* nil, "counter 'NAME': subtracting -2^63 would overflow", "ERANGE": a
 * decrement by the minimum, which tl_negate cannot make an increment. */
int tl_fail_negate(lua_State *L, const char *name);
/* t[k] = v for the table on top of the stack (under LuaJIT as tl_pushint64). */
void tl_setint(lua_State *L, const char *k, int64_t v);

/* ---- tables from a walk (lua_values.c) ---------------------------------------- */

/* Pairs a walk of the core hands over (tally_store_values,
 * tally_store_snapshot), collected in C memory: no Lua error may unwind
 * through the core. */
typedef struct tl_values {
  char *names; /* every name, one after the other */
  size_t names_len, names_cap;
  struct tl_value {
    size_t at, len;
    int64_t v;
  } * e;
  size_t n, cap;
  double *rate; /* tl_top_add only: each entry's rate, NAN if never rolled */
} tl_values;
/* A tally_value_fn: adds the pair to the tl_values ud; TALLY_ENOMEM. */
int tl_values_add(void *ud, const char *name, size_t len, int64_t v);
/* Given the walk's rc: push { [name] = value } and return 1, or the
 * failure (nil, message, code; a value beyond LuaJIT's numbers is
 * ERANGE), or raise for memory. Frees a's memory whatever happens. */
int tl_values_push(lua_State *L, tl_values *a, int rc);
/* A tally_row_fn: adds the row's name to the tl_values ud. */
int tl_name_row(void *ud, const tally_row *row);
/* Given the walk's rc: push the names, in their order, as a list and
 * return 1, or the failure, or raise for memory. Frees a's memory
 * whatever happens. */
int tl_names_push(lua_State *L, tl_values *a, int rc);
/* Push a rollup record as { value=, at= (seconds), delta=, rate=, count= }
 * (lua_rollup.c): what c:rolled() gives. */
void tl_pushrollup(lua_State *L, const tally_rollup *r);
/* A tally_top_fn: adds the row (its rollup's rate) to the tl_values ud. */
int tl_top_add(void *ud, const char *name, size_t len, int64_t v, const tally_rollup *r);
/* Given the walk's rc: push the rows in their order as a list of
 * { name =, value =, rate = } (rate nil if never rolled up) and return 1,
 * or the failure, or raise for memory. Frees a's memory whatever happens. */
int tl_top_push(lua_State *L, tl_values *a, int rc);

/* ---- classes ---------------------------------------------------------------- */

/* Create metatable tname (once per state): the metamethods of meta
 * (__gc, __close, __tostring: those the handle has), __name (which 5.4's
 * luaL_newmetatable sets and LuaJIT's does not) and __index, a table of
 * methods. Leaves the methods table on the stack (also when the metatable
 * existed already). */
void tl_newclass(lua_State *L, const char *tname, const luaL_Reg *meta,
                 const luaL_Reg *methods);

#if TL_LUAJIT
/* core.set_box(box, unbox): the Lua functions that cross between int64_t
 * and cdata (see tl_pushint64). */
int tl_set_box(lua_State *L);
/* module._classic[name] = fn, for the module table on top of the stack:
 * the classic methods lua/tally/ffi.lua falls back on. */
void tl_set_classic(lua_State *L, const char *name, lua_CFunction fn);
#endif

/* ---- the parts (lua_module.c lists them) -------------------------------------
 * Each adds its functions to the module table on top of the stack and
 * creates its metatables; returns 0. */
int tl_open_store(lua_State *L);      /* lua_store.c: core.open, store_methods */
int tl_open_counter(lua_State *L);    /* lua_counter.c: counter_methods */
int tl_open_rollup(lua_State *L);     /* lua_rollup.c: schedules, c:rolled() */
int tl_open_sender(lua_State *L);     /* lua_sender.c: core.sender, the spool */
int tl_open_redis(lua_State *L);      /* lua_redis.c: core.redis, core.flusher */
int tl_open_compact(lua_State *L);    /* lua_compact.c: core.compact */
int tl_open_batch(lua_State *L);      /* lua_batch.c: core.batch, core.snapshot */
int tl_open_http(lua_State *L);       /* lua_http.c: core.http */
int tl_open_ship(lua_State *L);       /* lua_ship.c: core.ship, core.counter_read */
int tl_open_histogram(lua_State *L);  /* lua_histogram.c: core.histogram_writer */
int tl_open_exposition(lua_State *L); /* lua_exposition.c: core._prom_lines */
int tl_open_number(lua_State *L);     /* lua_number.c: core.number_text, .c_numeric */
int tl_open_handles(lua_State *L);    /* lua_handles.c: core._store_cache, ... */
int tl_open_open(lua_State *L);       /* lua_open.c: core.open */
int tl_open_text(lua_State *L);       /* lua_text.c: core.printable, .utf8len */
int tl_open_json(lua_State *L);       /* lua_json.c: core.json_twice */
int tl_open_export(lua_State *L);     /* lua_export.c: core.export_write, .importer */
int tl_open_parcel(lua_State *L);     /* lua_parcel.c: core.parcel, core.parcel_add */

/* Close histogram writer w and unlink it from its store; safe twice. */
void tl_hist_release(tl_hist *w);

/* ---- the counter handle, for lua_store.c (made in lua_counter.c) -------------- */

/* Counter options at arg (nil or a table): shards, policy, and (if create
 * is not NULL, for db:counter) create = false, which opens an existing
 * counter only. Leaves the policy function (or nil) on top of the stack. */
void tl_checkcounteropts(lua_State *L, int arg, tally_counter_options *o, int *create);
/* "thread", ..., "function" for a stored policy; "?" if unknown. */
const char *tl_policy_label(int32_t policy);
/* Open counter name on the store at dbidx and push its handle. fnidx is
 * the stack index of its policy function, or 0 (a CUSTOM counter then
 * takes its family's function, if this store defined one). On failure
 * nothing is pushed and the TALLY_E* code is returned. */
int tl_counter_push(lua_State *L, int dbidx, const char *name, size_t len,
                    const tally_counter_options *opt, uint32_t flags, int fnidx);
/* Close the counter of handle h and unlink it from its store; safe twice. */
void tl_counter_release(tl_counter *h);

/* ---- the cache of counter handles by name (lua_handles.c) ---------------------- */

#define TL_HANDLE_CACHE     10000     /* handle_cache's default: about 5 MB of handles */
#define TL_HANDLE_CACHE_MAX INT32_MAX /* what handle_cache accepts */

typedef struct tl_door tl_door; /* handle_admit = "repeat": the names seen once */

/* FNV-1a of len bytes: a process-local hash of a name for the binding's
 * and the command's own tables (the doorkeeper, tally watch's last
 * values), which see the library's API and not its index hash. */
static inline uint64_t tl_name_hash(const char *s, size_t len) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < len; i++) h = (h ^ (unsigned char)s[i]) * 0x100000001b3ull;
  return h;
}

/* A new cache of at most cap handles (0: weak) for the store at db;
 * repeat: handle_admit = "repeat". */
void tl_cache_init(lua_State *L, int db, lua_Integer cap, int repeat);
/* Let every cached handle go (db:close): an empty young, no old. */
void tl_cache_clear(lua_State *L);
/* Cache the handle at h under the name at arg 2 of the store at arg 1. */
void tl_cache_put(lua_State *L, int h);
/* The open handle the old generation has for the name at arg 2, moved
 * into young and pushed: returns 1; else 0 with nothing pushed. */
int tl_cache_promote(lua_State *L);
/* The handle cached for the name at arg 2 (not moved), or NULL. */
tl_counter *tl_cache_peek(lua_State *L);
/* Forget the cached handle for the name at arg 2 (it stays usable). */
void tl_uncache(lua_State *L);
/* The doorkeeper's word on the name (len bytes) at arg 2 of the store at
 * arg 1: NULL to open and cache its handle, else the doorkeeper and in
 * *bit the name's bit, for tl_door_mark once it was used without one. */
tl_door *tl_door_pass(lua_State *L, const char *name, size_t len, uint32_t *bit);
void tl_door_mark(tl_door *door, uint32_t bit);

/* ---- name slots (lua_slots.c) ------------------------------------------------- */

/* The least stamp (tally_vector_stamp): entries below it are slots. */
#define TL_STAMP_MIN ((lua_Integer)1 << 31)

/* Lend the handle at h, cached under the name at `name` by the store at
 * db, a name slot (if its policy is thread or random), in place of any
 * other handle's slot for that name. */
void tl_slot_lend(lua_State *L, int db, int name, int h);
/* The cache rotated: young is the new young table, old the one that was
 * young, gone the old one let go (or nil). Names of gone hit through their
 * slot since the last rotation are put in young (at most room), the other
 * handles of gone give their slots back, and every entry of old and young
 * is marked not hit. Returns how many were put in young. */
lua_Integer tl_slots_rotate(lua_State *L, int db, int gone, int old, int young,
                            lua_Integer room);
/* db:incr's first try (the store d at 1, the name at `name`): n added
 * through the name's slot? 0: nothing added, take the cache's path. Leaves
 * two values on the stack either way. */
int tl_slot_incr(lua_State *L, tl_store *d, int name, lua_Integer n);
/* Handle h (may be NULL) leaves the cache of the store at db: a stamp in
 * the entry of the name at `name` names h's slot again (hit), if h holds
 * one. */
void tl_slot_unstamp(lua_State *L, int db, int name, tl_counter *h);
/* The handle at h closes: its slot is emptied and its name's entry gone. */
void tl_slot_return(lua_State *L, int h);
/* The same without a Lua state: the slot is emptied, its entry stays
 * (tl_counter_release's safety net; the next lend of the name reuses it). */
void tl_slot_unlend(tl_counter *h);
/* The store at db closes: every slot emptied, the vector freed, the table
 * of slots emptied. Before its handles are released. */
void tl_slots_release(lua_State *L, int db);
void tl_open_slots(lua_State *L); /* core._store_slots, _store_slots_stats */
/* The key at kidx for the key policy, a string or number, or raise. */
void tl_checkkey(lua_State *L, int kidx);
/* Whether an increment of a counter of this policy needs no key and no
 * function: tally_counter_incr picks the cell (cpu and slot too). */
static inline int tl_policy_plain(int policy) {
  return policy != TALLY_POLICY_KEY && policy != TALLY_POLICY_CUSTOM;
}
/* Add n to the counter of handle h (at hidx) with the key or function
 * policy (callers add for the others with tally_counter_incr, inline);
 * the key is at kidx. Returns 0 or a TALLY_E* code; raises on misuse. */
int tl_counter_incr_policy(lua_State *L, tl_counter *h, int hidx, int kidx,
                           lua_Integer n);
/* nil, message, code for a failed counter operation (names a dropped one). */
int tl_counter_fail(lua_State *L, tl_counter *h, int rc);

#endif
