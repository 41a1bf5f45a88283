-- tally.ffi: the LuaJIT FFI path for the hot calls.
--
-- Under LuaJIT a call into a classic C function (lua_CFunction) stops the
-- trace the JIT compiler is recording; a call through the FFI is compiled
-- into it. So, under LuaJIT, require "tally" replaces six methods with Lua
-- functions that call the C API of the very core.so the classic binding
-- lives in: c:incr(n), c:decr(n), c:value(), db:incr(name, n),
-- db:decr(name, n) and db:value(name). Everything else (and every case
-- these do not handle: bad arguments, closed handles, the key and function
-- policies, c:value(opts), a counter not yet in the store's cache, any
-- failure) falls through, by a tail call, to the classic C method with
-- the same arguments, so results, errors and messages are the classic
-- binding's.
--
-- The FFI functions read the counter handle's own tally_counter pointer
-- on every call (the handle userdata cast to its C struct; no pointer is
-- ever cached in Lua: a stamp, below, is an offset the C core checks), and
-- closing a counter, or its store, sets that pointer to NULL, which sends
-- the next call down the classic path to raise "attempt to use a closed
-- counter". db:incr(name) and db:decr first look for the name's stamp or
-- slot (name slots, below: a cached handle lent to a vector the store
-- handle owns), then in the young table of the store's own cache of
-- handles by name (the one the classic db:incr fills
-- and db:drop clears; src/lua/lua_store.c): it keeps the cache's state
-- table (core._store_cache), whose [1] is the current young table,
-- replaced when the generations rotate, so it is read on every call. A
-- name not in young (in the old generation, or not cached) goes to the
-- classic method, which moves or opens it.
--
-- TALLY_NO_FFI=1 in the environment keeps the classic methods (for tests
-- and benchmarks); tally.ffi says which path is in use. Under Lua 5.4 this
-- module does nothing.

local core = require "tally.core"
local compat = require "tally.compat"

local _M = { enabled = false }

if not compat.luajit then
  _M.reason = "not LuaJIT"
  function _M.install(tally) tally.ffi = false end
  function _M.enable() return false end
  return _M
end

local ffi = require "ffi"
local type, getmetatable, tonumber, pcall, setmetatable, select, ipairs, tostring =
      type, getmetatable, tonumber, pcall, setmetatable, select, ipairs, tostring
local cast, istype = ffi.cast, ffi.istype

-- Declared once per Lua state: busted and nginx may load this file again,
-- and ffi.cdef refuses to define a type twice.
if not pcall(ffi.typeof, "struct tally_ffi_counter") then
  ffi.cdef [[
    typedef struct tally_counter tally_counter;
    int tally_counter_incr(tally_counter *c, int64_t delta);
    int tally_counter_value(tally_counter *c, int64_t *out);
    /* the head of a counter handle (struct tl_counter in src/lua/lua_aux.h) */
    struct tally_ffi_counter {
      uintptr_t key;
      tally_counter *c;        /* NULL once closed */
      void *db, *prev, *next;
      int32_t policy;          /* < 3: thread, random, round_robin; 6: cpu */
      int hasfn;
      size_t slot1;            /* 1 + its name slot, 0: none */
    };
  ]]
end

local CPTR = ffi.typeof("struct tally_ffi_counter *")
local int64_t, uint64_t = ffi.typeof("int64_t"), ffi.typeof("uint64_t")
local EXACT = 2^53
local INT64_LIMIT = uint64_t(2^63)
local POLICY_KEY = 3
local POLICY_CPU = 6                  -- tally_counter_incr runs its sequence

-- Why the FFI path cannot be used here, or nil.
local function unusable()
  if not core._ffi_info then return "tally.core was built without FFI support" end
  local info = core._ffi_info()
  local path = info.path or package.searchpath("tally.core", package.cpath)
  if not path then return "cannot find the file tally.core was loaded from" end
  local ok, lib = pcall(ffi.load, path)
  if not ok then return "ffi.load(" .. path .. "): " .. tostring(lib) end
  -- the very copy require loaded: same code, same process-wide state
  if cast("void *", lib.tally_counter_incr) ~= cast("void *", info.incr) then
    return path .. " is not the copy of tally.core that require loaded"
  end
  if ffi.offsetof("struct tally_ffi_counter", "c") ~= info.counter_c
     or ffi.offsetof("struct tally_ffi_counter", "policy") ~= info.counter_policy then
    return "the counter handle layout does not match struct tally_ffi_counter"
  end
  local reg = debug.getregistry()
  local cmt, smt = reg["tally.counter"], reg["tally.store"]
  if type(cmt) ~= "table" or cmt.__index ~= core.counter_methods
     or type(smt) ~= "table" or smt.__index ~= core.store_methods then
    return "cannot find the counter and store metatables"
  end
  _M.lib, _M.counter_mt, _M.store_mt = lib, cmt, smt
  return nil
end

_M.reason = unusable()

local classic = core._classic
local METHODS = {                      -- method table, name, classic C function
  { core.counter_methods, "incr", classic and classic.counter_incr },
  { core.counter_methods, "decr", classic and classic.counter_decr },
  { core.counter_methods, "value", classic and classic.counter_value },
  { core.store_methods, "incr", classic and classic.store_incr },
  { core.store_methods, "decr", classic and classic.store_decr },
  { core.store_methods, "value", classic and classic.store_value },
}

local tally_module                    -- the table require "tally" returns

-- enable(on) -> whether the FFI methods are now in use. For tests and
-- benchmarks; require "tally" calls it once.
function _M.enable(on)
  if on and _M.reason then on = false end
  local fns = on and _M.methods or nil
  for i, m in ipairs(METHODS) do
    m[1][m[2]] = fns and fns[i] or m[3] or m[1][m[2]]
  end
  _M.enabled = on and true or false
  if tally_module then tally_module.ffi = _M.enabled end
  return _M.enabled
end

function _M.install(tally)
  tally_module = tally
  local no = os.getenv("TALLY_NO_FFI")
  if no ~= nil and no ~= "" and no ~= "0" and not _M.reason then
    _M.reason = "TALLY_NO_FFI=" .. no
  end
  _M.enable(true)
end

if _M.reason then return _M end

-- ---- the FFI methods -------------------------------------------------------------

local C = _M.lib
local COUNTER_MT, STORE_MT = _M.counter_mt, _M.store_mt
local incr_c, value_c = C.tally_counter_incr, C.tally_counter_value
local c_incr, c_decr, c_value = classic.counter_incr, classic.counter_decr, classic.counter_value
local s_incr, s_decr, s_value = classic.store_incr, classic.store_decr, classic.store_value
local store_cache = core._store_cache
local vbuf = ffi.new("int64_t[1]")   -- no call below yields while it is in use

-- The increment n as the FFI takes it (nil: 1), or nil to leave it to the
-- classic method (which raises, or converts a numeric string).
local function delta(n)
  if type(n) == "number" then
    if n % 1 == 0 and n <= EXACT and n >= -EXACT then return n end  -- not nan, inf
  elseif n == nil then
    return 1
  elseif type(n) == "cdata" then
    if istype(int64_t, n) then return n end
    if istype(uint64_t, n) and n < INT64_LIMIT then return int64_t(n) end
  end
  return nil
end

-- The open counter's tally_counter pointer, for the plain policies, or nil.
local function plain(c)
  local h = cast(CPTR, c)
  local p = h.c
  if p ~= nil and (h.policy < POLICY_KEY or h.policy == POLICY_CPU) then return p end
  return nil
end

local function result(v)              -- int64_t -> number within 2^53
  if v <= EXACT and v >= -EXACT then return tonumber(v) end
  return v
end

-- Each method takes its arguments as `...` and passes them on unchanged,
-- so the classic method sees exactly what the caller gave ("got no value"
-- stays "got no value"); LuaJIT compiles that as well as named parameters.

local function incr(c, ...)
  if type(c) == "userdata" and getmetatable(c) == COUNTER_MT then
    local d, p = delta((...)), plain(c)
    if d and p and incr_c(p, d) == 0 then return true end
  end
  return c_incr(c, ...)               -- a tail call: its errors name 'incr'
end

local function decr(c, ...)
  if type(c) == "userdata" and getmetatable(c) == COUNTER_MT then
    local d, p = delta((...)), plain(c)
    if d and p and incr_c(p, -d) == 0 then return true end
  end
  return c_decr(c, ...)
end

local function value(c, ...)
  if select("#", ...) == 0 and type(c) == "userdata" and getmetatable(c) == COUNTER_MT then
    local p = cast(CPTR, c).c
    if p ~= nil and value_c(p, vbuf) == 0 then return result(vbuf[0]) end
  end
  return c_value(c, ...)
end

-- Store handle -> the state of its cache of handles by name (st[1]: the
-- young table). Weak values too: the state reaches the store through the
-- handles it holds, and LuaJIT's weak keys are not ephemerons; the store's
-- user value keeps the state alive as long as the store.
local caches = setmetatable({}, { __mode = "kv" })

local function cache_of(db)
  local st = caches[db]
  if st == nil and type(db) == "userdata" and getmetatable(db) == STORE_MT then
    st = store_cache(db)
    caches[db] = st
  end
  return st
end

-- Name slots (src/lua/lua_slots.c): store handle -> its table name -> slot
-- of the vector the store handle owns (struct tally_ffi_store's vec, NULL
-- once closed). A cached handle of the thread or random policy is lent a
-- slot, so db:incr(name) there is one table lookup and tally_vector_incr.
-- Anything it cannot do returns non-zero, and the cache's path (then the
-- classic method) does it. Once a name's slot (or its handle) has added,
-- its entry becomes its counter's stamp where it has one (a number of at
-- least STAMP_MIN, tally_vector_stamp: the cell itself), and db:incr is
-- then one table lookup and tally_vector_stamp_incr, which reads nothing
-- before the cell but a generation that stays in cache: a stale stamp (a
-- move) adds nothing and the handle's path adds and stamps again. Set up
-- below, once the store layout is checked.
local slots = setmetatable({}, { __mode = "k" })
local slots_of = function() return nil end
local slot_incr = function() return false end
local stamp_add = function() return false end
local stamp = function() end
local unstamp = function() end
local STAMP_MIN = 2^31

-- An entry is -1 - slot until hit: a hit writes the slot itself, which
-- keeps the name in the cache when its generation rotates (lua_slots.c).
-- Only over the entry read (e): a handle collected since (a finalizer runs
-- at an allocation or a trace exit) took its entry away, and its slot is
-- spare, or another name's by the next lend.
local function slot_hit(sl, name, e)
  local i = e
  if e < 0 then
    i = -1 - e
    if sl[name] == e then sl[name] = i end
  end
  return i
end

-- db:incr and db:decr: through the name's stamp, else its slot, else its
-- cached handle, each stamping the name when it added (sign: 1 or -1).
local function by_name(db, name, n, sign)
  local sl = slots[db] or slots_of(db)
  local i = sl and sl[name]
  local d = delta(n)
  if i and d then
    if i >= STAMP_MIN then
      if stamp_add(db, name, i, sign * d) then return true end
    elseif slot_incr(db, slot_hit(sl, name, i), sign * d) then
      if i < 0 then stamp(db, sl, name) end   -- its first hit since lent or rotated
      return true
    end
  end
  local st = caches[db] or cache_of(db)
  local c = st and st[1][name]
  if c and d then
    local p = plain(c)
    if p and incr_c(p, sign * d) == 0 then
      if i and i >= STAMP_MIN then stamp(db, sl, name) end   -- stale: again
      return true
    end
  end
  -- the classic method reopens the name, and needs the slot to free
  if i and i >= STAMP_MIN then unstamp(db, sl, name) end
  return false
end

local function db_incr(db, ...)
  local name, n = ...
  if by_name(db, name, n, 1) then return true end
  return s_incr(db, ...)
end

local function db_decr(db, ...)
  local name, n = ...
  if by_name(db, name, n, -1) then return true end
  return s_decr(db, ...)
end

local function db_value(db, ...)
  local st = caches[db] or cache_of(db)
  local c = st and st[1][(...)]
  if c then
    local p = cast(CPTR, c).c
    -- 0 may be a cached handle of an expired counter: the classic method
    -- says whether the name still exists
    if p ~= nil and value_c(p, vbuf) == 0 and vbuf[0] ~= 0 then return result(vbuf[0]) end
  end
  return s_value(db, ...)
end

_M.methods = { incr, decr, value, db_incr, db_decr, db_value }

-- ---- the store handle's head (name slots) and histogram writers -------------
-- The store handle's tally_store pointer and name-slot vector are read
-- from its userdata (struct tl_store in src/lua/lua_aux.h: key, the
-- pointer, NULL once closed, then the vector); a histogram writer's
-- tally_histogram pointer from its own (struct tl_hist: after its key,
-- NULL once closed). Their offsets are checked once against core._ffi_info
-- (store_key, store_store, store_vec, store_size; hist_h): if they differ,
-- store_reason or observe_reason says so and that part stays classic.

if not pcall(ffi.typeof, "struct tally_ffi_store") then
  ffi.cdef [[
    struct tally_ffi_store {
      uintptr_t key;           /* (uintptr_t)self ^ TL_STORE_SALT */
      void *store;             /* NULL once closed */
      struct tally_vector *vec; /* name slots, NULL: none or closed */
    };
    int tally_vector_incr(struct tally_vector *v, size_t i, int64_t delta);
    int64_t tally_vector_stamp(struct tally_vector *v, const tally_counter *c);
    int tally_vector_stamp_incr(struct tally_vector *v, int64_t stamp, int64_t delta);
    int tally_counter_sample(tally_counter *c);
    typedef struct tally_histogram tally_histogram;
    struct tally_ffi_hist {
      uintptr_t key;           /* (uintptr_t)self ^ TL_HIST_SALT */
      tally_histogram *h;      /* NULL once closed (with its store) */
    };
    int tally_histogram_observe(tally_histogram *h, double v);
  ]]
end

local SPTR = ffi.typeof("struct tally_ffi_store *")
local HPTR = ffi.typeof("struct tally_ffi_hist *")

-- Why the store handle's head cannot be read (its layout differs), or nil.
local function store_unusable(info)
  local off = ffi.offsetof
  if info.store_key ~= off("struct tally_ffi_store", "key")
     or info.store_store ~= off("struct tally_ffi_store", "store")
     or info.store_vec ~= off("struct tally_ffi_store", "vec")
     or type(info.store_size) ~= "number" or info.store_size < ffi.sizeof("struct tally_ffi_store") then
    return "the store handle layout does not match struct tally_ffi_store"
  end
  return nil
end
local info = core._ffi_info()
_M.store_reason = store_unusable(info)
if info.hist_h ~= ffi.offsetof("struct tally_ffi_hist", "h") then
  _M.observe_reason = "the histogram writer layout does not match struct tally_ffi_hist"
end

if not _M.store_reason and core._store_slots then
  local vec_incr = C.tally_vector_incr
  slots_of = function(db)
    local sl = slots[db]
    if sl == nil and type(db) == "userdata" and getmetatable(db) == STORE_MT then
      sl = core._store_slots(db)
      slots[db] = sl
    end
    return sl
  end
  -- slot_incr(db, i, d) -> true if slot i of db's vector added d
  slot_incr = function(db, i, d)
    local v = cast(SPTR, db).vec
    return v ~= nil and vec_incr(v, i, d) == 0
  end
  local stamp_c, stamp_incr_c, sample_c =
    C.tally_vector_stamp, C.tally_vector_stamp_incr, C.tally_counter_sample
  -- the handle cached for name (young, then old: [2]), and its
  -- tally_counter pointer (nil if closed or of another policy)
  local function handle_of(db, name)
    local st = caches[db] or cache_of(db)
    local c = st and (st[1][name] or st[2] and st[2][name])
    return c, c and plain(c)
  end
  -- stamp_add(db, name, e, d) -> true if stamp e (name's entry) added d;
  -- false: nothing added (stale), take the slot's or handle's path
  stamp_add = function(db, name, e, d)
    local v = cast(SPTR, db).vec
    if v == nil then return false end
    local rc = stamp_incr_c(v, e, d)
    if rc == 0 then return true end
    if rc < 0 then return false end
    local _, p = handle_of(db, name)   -- due to sample (automatic shards)
    if p then sample_c(p) end
    return true
  end
  -- stamps need the handle's slot (slot1), checked against the layout
  if ffi.offsetof("struct tally_ffi_counter", "slot1") == info.counter_slot1 then
    -- unstamp(db, sl, name): a stamp in name's entry names the slot of
    -- its cached handle again (hit), or goes if that holds none
    unstamp = function(db, sl, name)
      if (sl[name] or 0) < STAMP_MIN then return end
      local c = handle_of(db, name)
      local s1 = c and tonumber(cast(CPTR, c).slot1) or 0
      sl[name] = s1 > 0 and s1 - 1 or nil
    end
    -- stamp(db, sl, name): name's entry becomes the stamp of its cached
    -- handle's counter; if it has none (several shards now), a stamp
    -- there is taken back (unstamp)
    stamp = function(db, sl, name)
      local v, _, p = cast(SPTR, db).vec, handle_of(db, name)
      local e = v ~= nil and p ~= nil and stamp_c(v, p) or 0
      if e ~= 0 then sl[name] = tonumber(e) else unstamp(db, sl, name) end
    end
  end
end

if not _M.observe_reason then
  local observe_c = C.tally_histogram_observe
  -- observe(w, v) -> true when v was observed through histogram writer w
  -- (core.histogram_writer); false when nothing was added and the caller
  -- must take the classic path (a closed writer, a NaN, a v out of range,
  -- a failure: the classic path raises or reports). v: a number.
  function _M.observe(w, v)
    local p = cast(HPTR, w).h
    return p ~= nil and observe_c(p, v) == 0
  end
end

return _M
