-- tally: sharded counters for Lua, on the C core in tally.core.
--
-- `require "tally"` gives this table. Stores and counters are C handles;
-- their methods live in core.store_methods / core.counter_methods (the
-- __index tables of their metatables), so the hot ones (c:incr, db:incr)
-- are called with no Lua layer in between. The few methods written in Lua
-- are added to those tables here.

local core = require "tally.core"
local compat = require "tally.compat"
local check_self = require("tally.util").self

local type, ipairs, tonumber = type, ipairs, tonumber
local tointeger, add, sub, tofloat = compat.tointeger, compat.add, compat.sub, compat.tofloat

-- Under LuaJIT: counter values beyond +-2^53 come back as int64_t cdata
-- (tally.compat), and c:incr, c:value, db:incr, db:value go through the FFI
-- unless TALLY_NO_FFI=1 (tally.ffi, installed at the end).
compat.install(core)

local argerror = require("tally.util").argerror
local typename = require("tally.util").typename
local printable = require("tally.util").printable

local _M = { _VERSION = core.version }

_M.version = core.version
-- tally.open: a URI of a remote (redis://, redis+cluster://, firestore://:
-- tally.remote's scheme registry) opens that remote's store class;
-- everything else goes to the C open.
-- (Not a tail call, and through a local named open: the C function's
-- argument errors keep naming 'open'.)
do
  local open, backend = core.open, require("tally.remote").backend
  function _M.open(spec, ...)
    local via = backend(spec, "store")
    if via then
      local db, msg, code = require(via).open(spec, ...)  -- not a tail call: its
      return db, msg, code                               -- messages blame our caller
    end
    local db, msg, code = open(spec, ...)
    return db, msg, code
  end
end
_M.policies = { "thread", "random", "round_robin", "key", "slot" }
_M.MAX_SHARDS = core.MAX_SHARDS
_M.NAME_MAX = core.NAME_MAX
_M.DEFAULT_SHARDS = core.DEFAULT_SHARDS
_M.compact = core.compact  -- (path, progress_fn) -> true | nil, msg, code

-- The method tables, for hosts and libraries that add methods of their own.
_M.store_methods = core.store_methods
_M.counter_methods = core.counter_methods

local store = core.store_methods

-- db:top([pattern,] n [, by]) -> { { name = , value = , rate = }, ... }
-- The n matching counters with the largest values (by = "value", exact:
-- every matching counter is summed now) or the largest rates of their last
-- rollup (by = "rate"; counters never rolled up come last), largest first,
-- ties by name; rate is nil for a counter never rolled up. One walk and a
-- heap of n in C: O(count log n). db:top(n, pattern) is accepted too.
function store:top(pattern, n, by)
  check_self(self, "tally.store", "top")
  local narg = 2
  if type(pattern) == "number" then pattern, n, narg = n, pattern, 1 end
  local k = tointeger(n)
  if type(k) == "cdata" then k = tonumber(k) end   -- LuaJIT: beyond 2^53
  if not k or k < 0 then
    argerror(narg, "top", "non-negative integer expected, got "
          .. (type(n) == "number" and n or type(n)), 2)
  end
  if pattern ~= nil and type(pattern) ~= "string" then
    argerror((3 - narg), "top", "string expected, got " .. type(pattern), 2)
  end
  by = by or "value"
  if by ~= "value" and by ~= "rate" then
    argerror(3, "top", "\"value\" or \"rate\" expected, got " .. printable(tostring(by)), 2)
  end
  if k > 2^53 then k = 2^53 end  -- more rows than any store holds
  return self:_top(pattern, k, by)   -- one walk in C (tally_store_top)
end

-- db:values([pattern]) -> { [name] = value, ... } for the matching counters,
-- read one after the other in one pass over the store's index (C:
-- tally_store_values); a counter dropped meanwhile, or whose value is beyond
-- int64, is left out. nil, msg, code on a damaged store.
function store:values(pattern)
  check_self(self, "tally.store", "values")
  if pattern ~= nil and type(pattern) ~= "string" then
    argerror(1, "values", "string expected, got " .. typename(pattern), 2)
  end
  return self:_values(pattern)
end

-- ---- batches and snapshots (src/lua/lua_batch.c, docs/lua-api.md) ----------
-- Increments of counters of policy "slot" that db:snapshot sees together or
-- not at all, across threads and processes.

local SLOT = { policy = "slot" }
local delta_problem = core.delta_problem
local describe = require("tally.util").describe

-- The handle for a batch entry: a counter of this store, or a name (a slot
-- counter is created if it is absent; a counter of the name with other
-- options raises, as db:counter does); or nil, msg, code (the store
-- could not make it: damaged, say).
local function batch_counter(db, c, fname, arg)
  if type(c) == "string" then return db:counter(c, SLOT) end
  if type(c) == "userdata" then return c end -- core.batch checks it is a counter
  argerror(arg, fname, "counter or name expected, got " .. describe(c), 3)
end

-- db:incr_many({ {counter_or_name [, n]}, ... }) -> true | nil, msg, code
function store:incr_many(list)
  check_self(self, "tally.store", "incr_many")
  if type(list) ~= "table" then
    argerror(2, "incr_many", "table expected, got " .. describe(list))
  end
  local cs, ds = {}, {}
  for i, e in ipairs(list) do  -- every entry checked before a name is opened
    if type(e) ~= "table" then
      argerror(2, "incr_many", "entry " .. i .. " must be { counter_or_name [, n] }, got "
               .. describe(e))
    end
    local why = e[2] ~= nil and delta_problem(e[2])
    if why then argerror(2, "incr_many", "entry " .. i .. ": " .. why) end
  end
  for i, e in ipairs(list) do
    local c, msg, code = batch_counter(self, e[1], "incr_many", 2)
    if not c then return nil, msg, code end
    cs[i], ds[i] = c, e[2] == nil and 1 or e[2]
  end
  return core.batch(self, cs, ds)
end

-- db:batch(fn) -> true | nil, msg, code: fn(b) calls b:incr(counter_or_name
-- [, n]) and b:decr(...); when it returns, all of them are applied as one
-- batch. If fn raises, nothing is applied and the error goes on.
local batch_mt = {}
batch_mt.__index = batch_mt
-- An entry: n as given, its sign apart (core.batch negates it after the
-- checks an increment's n gets, so "5" or a uint64_t cdata fare as in
-- c:decr); a counter that cannot be had fails the batch when fn returns.
local function batch_add(b, c, n, fname, negate)
  local why = n ~= nil and delta_problem(n)
  if why then argerror(2, fname, why) end -- (b:incr calls this as a tail call)
  local h, msg, code = batch_counter(b.db, c, fname, 1)
  if not h then
    b.failed = b.failed or { msg, code }
    return b
  end
  local k = #b.cs + 1
  b.cs[k], b.ds[k], b.neg[k] = h, n == nil and 1 or n, negate
  return b
end
function batch_mt:incr(c, n) return batch_add(self, c, n, "incr", false) end
function batch_mt:decr(c, n) return batch_add(self, c, n, "decr", true) end

function store:batch(fn)
  check_self(self, "tally.store", "batch")
  if type(fn) ~= "function" then
    argerror(2, "batch", "function expected, got " .. describe(fn))
  end
  local b = setmetatable({ db = self, cs = {}, ds = {}, neg = {} }, batch_mt)
  fn(b)
  if b.failed then return nil, b.failed[1], b.failed[2] end
  if #b.cs == 0 then return true end
  return core.batch(self, b.cs, b.ds, b.neg)
end

-- db:snapshot([pattern]) -> { [name] = value, ... } | nil, msg, code: the
-- matching counters' values as one consistent cut (every batch of slot
-- counters whole or not at all; each writer's increments in their order).
function store:snapshot(pattern)
  check_self(self, "tally.store", "snapshot")
  return core.snapshot(self, pattern)
end

local counter = core.counter_methods

-- c:skew() -> { shards =, min =, max =, mean =, spread =, ratio =, hot = }
-- How evenly the counter's increments spread over its shards: spread is
-- max - min, ratio is max / mean (1 is perfectly even; near `shards` means
-- one shard takes everything, so more shards buy nothing), hot the 1-based
-- index of the fullest shard. ratio is nil while the counter is empty.
function counter:skew()
  check_self(self, "tally.counter", "skew")
  local vals, err, code = self:shards()
  if not vals then return nil, err, code end
  local min, max, sum, hot = vals[1], vals[1], 0, 1
  for i, v in ipairs(vals) do
    if v < min then min = v end
    if v > max then max, hot = v, i end
    sum = add(sum, v)
  end
  local mean = tofloat(sum) / #vals
  return { shards = #vals, min = min, max = max, mean = mean, spread = sub(max, min),
           ratio = mean > 0 and tofloat(max) / mean or nil, hot = hot }
end

-- rollups, sinks, reads that choose their cost (tally/rollup.lua)
require("tally.rollup").install(_M)

-- prometheus, export, import (tally/prometheus.lua,
-- tally/export.lua): wraps db:family (metric mappings), adds db:mappings,
-- db:export, db:import
_M.format = require "tally.format"
_M.prometheus = require("tally.prometheus").prometheus
_M.logger = require("tally.prometheus").logger
require "tally.export"

require("tally.histogram").install(_M)  -- db:histogram, db:histograms (tally/histogram.lua)

-- LuaJIT: the FFI path for the hot calls (sets _M.ffi); false under Lua 5.4
_M.ffi = false
if compat.luajit then require("tally.ffi").install(_M) end

return _M
