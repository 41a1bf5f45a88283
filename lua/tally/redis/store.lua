-- tally.redis.store: a store whose counters live in Redis or Redis Cluster,
-- over core.redis (src/lua/lua_redis.c). tally.open("redis://host:port") and
-- tally.open("redis+cluster://h1:p1,h2:p2") return one.
--
-- Key layout (the same as the flusher's, include/tally_net.h, so a counter
-- flushed by db:flush_to reads the same total here when opened with the
-- flusher's number of shards):
--
--   tally:{NAME#i}      hash, shard i (0-based) of counter NAME, field `v`
--                       (int64 decimal); its own hash tag per shard, so the
--                       shards of one counter spread over the cluster
--   tally:meta:{NAME}   hash: `shards`, `policy` (the counter's options)
--   tally:names         set of counter names (one key, on one node)
--   tally:families      hash: pattern -> "seq shards policy"; `#seq` the
--                       sequence that orders them (newest matching wins)
--
-- Reads are scatter-gather: c:value() sums the shards one HGET after the
-- other; it includes every increment acknowledged before the call started
-- and none that began after it ended, but it is not a snapshot across
-- shards (increments racing with the read may be partly included, each one
-- wholly in its shard or not).
--
-- c:incr is one HINCRBY, never retried automatically: when its reply is
-- lost (timeout, dropped connection) it returns nil, msg, code and the
-- increment may or may not have been applied. Use local shards and
-- db:flush_to for exactly-once. With opts.replicas = N each HINCRBY is
-- followed (pipelined) by WAIT N replica_timeout: fewer acknowledgements
-- give nil, msg, "EREPLICAS" (applied on the master, may be lost if it
-- fails before a replica has it).

local core = require "tally.core"
local compat = require "tally.compat"

local type, error, tostring, tonumber, setmetatable, pcall, ipairs, pairs =
      type, error, tostring, tonumber, setmetatable, pcall, ipairs, pairs
local fmt, sort = string.format, table.sort
local tointeger, unpack = compat.tointeger, compat.unpack

local argerror, printable = require("tally.util").argerror, require("tally.util").printable
local remote = require "tally.remote"
local check_name, glob_pattern = remote.check_name, remote.glob_pattern
local check_pattern, add_fits = remote.check_pattern, remote.add_fits

local _M = {}

local NAMES_KEY, FAMILIES_KEY = "tally:names", "tally:families"
local DEFAULT_POLICY = "thread"

local shard_key = core.redis_shard_key   -- the flusher's rule (redis_flush.c)
local function meta_key(name) return "tally:meta:{" .. name .. "}" end

-- Atomically: read v of a shard and set it to 0 (the amount removed, as a
-- decimal string: Redis' Lua numbers are doubles).
local RESET_SCRIPT = [[
local v = redis.call('HGET', KEYS[1], 'v') or '0'
if v ~= '0' then redis.call('HSET', KEYS[1], 'v', '0') end
return v]]

-- Create the meta hash unless it exists: {shards, policy} of the counter.
local CREATE_SCRIPT = [[
local s = redis.call('HGET', KEYS[1], 'shards')
if s then return { s, redis.call('HGET', KEYS[1], 'policy') or 'thread', '0' } end
redis.call('HSET', KEYS[1], 'shards', ARGV[1], 'policy', ARGV[2])
return { ARGV[1], ARGV[2], '1' }]]

-- Record a family with the next sequence number.
local FAMILY_SCRIPT = [[
local seq = redis.call('HINCRBY', KEYS[1], '#seq', 1)
redis.call('HSET', KEYS[1], ARGV[1], seq .. ' ' .. ARGV[2] .. ' ' .. ARGV[3])
return seq]]

_M.key_shard = remote.key_shard -- kept here too: it lived here first

-- ---- helpers -------------------------------------------------------------------

local get_ticket = remote.ticket -- for the thread and round_robin policies

-- glob (`*` any run of bytes, `?` one byte) -> anchored Lua pattern
-- A Redis failure as nil, msg, code: overflow is ERANGE, other error
-- replies EREDIS, transport failures keep the binding's code.
local function rfail(msg, code)
  msg = tostring(msg)
  if not code then code = msg:find("overflow", 1, true) and "ERANGE" or "EREDIS" end
  return nil, msg, code
end

-- ---- the store ------------------------------------------------------------------

local Store, Counter = {}, {}

local StoreMT = { __name = "tally.redis_store" }
local CounterMT = { __name = "tally.redis_counter" }

-- c:incr's k on shard i (remote.classes): one HINCRBY, then WAIT with
-- opts.replicas
local function apply(self, db, i, k, fname)
  local sk = shard_key(self.nm, i - 1)
  local nrep = db.replicas
  if nrep then  -- HINCRBY then WAIT, pipelined on the shard's master
    local v, acked, code = db.r:command_wait(nrep, db.replica_timeout, "HINCRBY", sk, "v",
                                             compat.int_text(k))
    if v == nil then return rfail(acked, code) end
    if acked < nrep then
      return nil, fmt("%s on %s: applied on the master but acknowledged by %d of %d replicas"
                      .. " within %d ms (a failover may lose it)", fname, printable(sk),
                      acked < 0 and 0 or acked, nrep, db.replica_timeout), "EREPLICAS"
    end
    return true
  end
  local v, err, code = db.r:command("HINCRBY", sk, "v", compat.int_text(k))
  if v == nil then return rfail(err, code) end
  return true
end

-- db:close, db:sum, c:incr, c:decr, c:value, c:info, c:name, c:store,
-- c:close, and tostring; the client is db.r
local live, cdb = remote.classes("r", Store, Counter, StoreMT, CounterMT, apply)

local function cmd(self, ...)
  return live(self):command(...)
end

-- Options of a new counter from the newest matching family, else defaults.
local function family_options(self, name)
  local all, err, code = cmd(self, "HGETALL", FAMILIES_KEY)
  if not all then return rfail(err, code) end
  local best, bseq
  for i = 1, #all, 2 do
    local pat, val = all[i], all[i + 1]
    if pat ~= "#seq" then
      local seq, shards, policy = val:match("^(%d+) (%d+) (%S+)$")
      seq = tonumber(seq)
      if seq and name:match(glob_pattern(pat)) and (not bseq or seq > bseq) then
        best, bseq = { shards = tonumber(shards), policy = policy }, seq
      end
    end
  end
  return best or {}
end


local function new_counter(self, name, shards, policy)
  return setmetatable({ db = self, nm = name, n = shards, policy = policy,
                        rr = get_ticket() % shards }, CounterMT)
end

-- The counter's shards and policy, and whether this call created it; or
-- nil, msg, code (ENOENT: no meta and not create).
local function find(self, name, shards, policy, create)
  local mk = meta_key(name)
  local meta, err, code = cmd(self, "HMGET", mk, "shards", "policy")
  if not meta then return rfail(err, code) end
  local s, p = tonumber(meta[1]), meta[2] or DEFAULT_POLICY
  if s then return s, p, false end
  if not create then return nil, fmt("no such counter '%s'", printable(name)), "ENOENT" end
  local fam, ferr, fcode = family_options(self, name)
  if not fam then return nil, ferr, fcode end
  local want_s = shards or fam.shards or core.DEFAULT_SHARDS
  local want_p = policy or fam.policy or DEFAULT_POLICY
  local res
  res, err, code = cmd(self, "EVAL", CREATE_SCRIPT, 1, mk, want_s, want_p)
  if not res then return rfail(err, code) end
  return tonumber(res[1]), res[2], res[3] == "1" -- "0": another process made it
end

-- db:counter(name [, opts]) -> counter, or nil, msg, code. The meta hash,
-- then the name, on a get as on a create (SADD, one round trip more than
-- the HMGET): a create that failed in between, or a drop that failed
-- before deleting the meta, left a counter missing from the names, and
-- the next db:counter(name) (or db:incr) puts it back. The name after the
-- meta also lets a drop of a name without meta take it out (Store:drop).
function Store:counter(name, opts)
  check_name(name, "counter", 1)
  local shards, policy, create = remote.check_counter_opts("redis", opts, "counter", 2)
  local s, p, created = find(self, name, shards, policy, create)
  if not s then return nil, p, created end
  if not created then remote.check_same(name, shards, policy, s, p) end
  local ok, err, code = cmd(self, "SADD", NAMES_KEY, name)
  if not ok then return rfail(err, code) end
  return new_counter(self, name, s, p)
end

remote.by_name(Store) -- db:incr(name), db:decr (db:value: its own, below)

-- db:value(name): reads the options each time, never creates, and leaves
-- the names alone (sum and values read each listed name through it).
function Store:value(name)
  check_name(name, "value", 1)
  local s, p, code = find(self, name, nil, nil, false)
  if not s then return nil, p, code end
  return new_counter(self, name, s, p):value()
end

-- The names in tally:names matching pattern (nil: all), sorted, with or
-- without a meta hash (a drop racing a db:counter of the name can leave a
-- name without one): what values (and so sum and top) read, skipping
-- ENOENT.
local function listed(self, pattern)
  local all, err, code = cmd(self, "SMEMBERS", NAMES_KEY)
  if not all then return rfail(err, code) end
  local out = {}
  local lp = pattern and pattern ~= "*" and glob_pattern(pattern)
  for _, nm in ipairs(all) do
    if not lp or nm:match(lp) then out[#out + 1] = nm end
  end
  sort(out)
  return out
end

-- Which of KEYS exist: a table of 0/1, one per key (all in one slot on a
-- cluster; a standalone server holds every key).
local EXISTS_SCRIPT = [[
local out = {}
for i, k in ipairs(KEYS) do out[i] = redis.call('EXISTS', k) end
return out]]
local EXISTS_BATCH = 1000

-- db:names([pattern]): the listed names whose meta hash exists. One script
-- per 1000 names on a standalone server; one EXISTS per name on a cluster
-- (their meta hashes live in as many slots).
function Store:names(pattern)
  check_pattern(pattern, "names")
  local names, err, code = listed(self, pattern)
  if not names then return nil, err, code end
  local out = {}
  if live(self):stats().cluster then
    for _, nm in ipairs(names) do
      local n
      n, err, code = cmd(self, "EXISTS", meta_key(nm))
      if not n then return rfail(err, code) end
      if n == 1 then out[#out + 1] = nm end
    end
    return out
  end
  for first = 1, #names, EXISTS_BATCH do
    local last = first + EXISTS_BATCH - 1
    if last > #names then last = #names end
    local args = { "EVAL", EXISTS_SCRIPT, last - first + 1 }
    for i = first, last do args[#args + 1] = meta_key(names[i]) end
    local flags
    flags, err, code = cmd(self, unpack(args))
    if not flags then return rfail(err, code) end
    for i = first, last do
      if flags[i - first + 1] == 1 then out[#out + 1] = names[i] end
    end
  end
  return out
end

-- db:values([pattern]): scatter-gather over every matching counter (one
-- dropped meanwhile is skipped); db:sum (remote.classes) adds them.
function Store:values(pattern)
  check_pattern(pattern, "values")
  local names, err, code = listed(self, pattern)
  if not names then return nil, err, code end
  local out = {}
  for _, nm in ipairs(names) do
    local v
    v, err, code = self:value(nm)
    if v then out[nm] = v elseif code ~= "ENOENT" then return nil, err, code end
  end
  return out
end

-- db:top([pattern,] n [, by]): by value only (the redis store keeps no rollups).
function Store:top(pattern, n, by)
  local narg = 2
  if type(pattern) == "number" then pattern, n, narg = n, pattern, 1 end
  local k = tointeger(n)
  if type(k) ~= "number" or k < 0 then
    argerror(narg, "top", "non-negative integer expected, got "
          .. printable(tostring(n)), 2)
  end
  if by ~= nil and by ~= "value" then
    if by == "rate" then error("top by rate is not supported by the redis store", 2) end
    argerror(3, "top", "\"value\" expected, got " .. printable(tostring(by)), 2)
  end
  local vals, err, code = self:values(pattern)
  if not vals then return nil, err, code end
  local rows = {}
  for nm, v in pairs(vals) do rows[#rows + 1] = { name = nm, value = v } end
  sort(rows, function(a, b)
    if a.value ~= b.value then return a.value > b.value end
    return a.name < b.name
  end)
  for i = #rows, k + 1, -1 do rows[i] = nil end
  return rows
end

-- db:drop(name): every shard key, the name, then the meta hash, which says
-- how many shard keys there are: a drop that fails midway can be run again.
-- A name without meta (a db:counter racing a drop put it back) is taken
-- out of the names, its shard keys left alone (a flusher writes shard keys
-- without meta until the name is registered), and the drop says ENOENT. A
-- create racing it adds the name after its meta: read the meta again, and
-- put the name back if it appeared meanwhile.
function Store:drop(name)
  check_name(name, "drop", 1)
  local mk = meta_key(name)
  local s, err, code = cmd(self, "HGET", mk, "shards")
  if err then return rfail(err, code) end
  s = tonumber(s)
  local ok
  if not s then
    ok, err, code = cmd(self, "SREM", NAMES_KEY, name)
    if not ok then return rfail(err, code) end
    if ok == 1 then
      s, err, code = cmd(self, "EXISTS", mk)
      if not s then return rfail(err, code) end
      if s == 1 then
        ok, err, code = cmd(self, "SADD", NAMES_KEY, name)
        if not ok then return rfail(err, code) end
      end
    end
    return nil, fmt("no such counter '%s'", printable(name)), "ENOENT"
  end
  for i = 0, s - 1 do
    ok, err, code = cmd(self, "DEL", shard_key(name, i))
    if not ok then return rfail(err, code) end
  end
  ok, err, code = cmd(self, "SREM", NAMES_KEY, name)
  if not ok then return rfail(err, code) end
  ok, err, code = cmd(self, "DEL", mk)
  if not ok then return rfail(err, code) end
  self.cache[name] = nil
  return true
end

function Store:family(pattern, opts)
  remote.check_family(pattern)
  if pattern == "#seq" then argerror(1, "family", "reserved pattern '#seq'", 2) end
  local shards, policy = remote.check_counter_opts("redis", opts, "family", 2)
  local ok, err, code = cmd(self, "EVAL", FAMILY_SCRIPT, 1, FAMILIES_KEY, pattern,
                            shards or core.DEFAULT_SHARDS, policy or DEFAULT_POLICY)
  if not ok then return rfail(err, code) end
  return true
end

-- db:stats(): counters is what db:names() lists (names with meta), read
-- the same way.
function Store:stats()
  local names, err, code = self:names()
  if not names then return nil, err, code end
  local rs = self.r:stats()
  return { kind = "redis", uri = self.uri, counters = #names, cluster = rs.cluster, redis = rs,
           replicas = self.replicas, replica_timeout = self.replica_timeout }
end

-- ---- counters --------------------------------------------------------------------

-- c:shards() -> { v1, ..., vn } (1-based; shard i is the key tally:{NAME#i-1})
function Counter:shards()
  local db = cdb(self)
  local out = {}
  for i = 0, self.n - 1 do
    local v, err, code = db.r:command("HGET", shard_key(self.nm, i), "v")
    if err then return rfail(err, code) end
    out[i + 1] = v and tointeger(v) or 0
  end
  return out
end

-- c:reset() -> the amount removed: per shard, one script that reads v and
-- sets it to 0 atomically, so no concurrent increment is lost.
function Counter:reset()
  local db = cdb(self)
  local removed, taken = 0, {}
  for i = 0, self.n - 1 do
    local v, err, code = db.r:command("EVAL", RESET_SCRIPT, 1, shard_key(self.nm, i))
    if not v then return rfail(err, code) end
    taken[i] = tointeger(v)
    local sum = add_fits(removed, taken[i])
    if sum == nil then      -- as the file store: give back what was taken
      for j = 0, i do
        local ok, gerr, gcode = db.r:command("HINCRBY", shard_key(self.nm, j), "v",
                                             compat.int_text(taken[j]))
        if not ok then return rfail(gerr, gcode) end
      end
      return remote.reset_range(self.nm)
    end
    removed = sum
  end
  return removed
end

Counter.skew = core.counter_methods.skew

-- ---- metatables: anything else the file store offers raises --------------------

StoreMT.__index = remote.index_with(Store, core.store_methods, "redis")
CounterMT.__index = remote.index_with(Counter, core.counter_methods, "redis")
StoreMT.__gc = StoreMT.__close
-- Lua 5.1 / LuaJIT: no __gc on tables; the redis handle has its own.

_M.Store, _M.Counter = Store, Counter

-- tally.open(uri [, { timeout = s, password = p, user = u }]) -> store, or
-- nil, msg, code. A bad URI or a server that is down gives nil, msg, code
-- (EINVAL for the URI). The password comes from the URI
-- (redis://user:pass@host:port or ?password=), else opts.password, else
-- $TALLY_REDIS_PASSWORD; messages and tostring show the URI redacted.
-- an integer option from 1 to hi (what: its name and unit)
local function int_option(what, hi)
  return function(v)
    local n = tointeger(v)
    if type(n) ~= "number" or n < 1 or n > hi then
      return nil, fmt("%s from 1 to %d, got %s", what, hi, printable(tostring(v)))
    end
    return n
  end
end

local function secret(v, k)
  if type(v) ~= "string" or v == "" then  -- never quote the value
    return nil, k .. " must be a non-empty string, got " .. type(v)
  end
  return v
end

local OPEN_OPTIONS = {
  replicas = int_option("replicas must be an integer", 1000000),
  replica_timeout = int_option("replica_timeout must be an integer number of milliseconds", 3600000),
  password = secret, user = secret,
}

function _M.open(uri, opts)
  local o = remote.open_options("redis", opts, "timeout, password, user, replicas, replica_timeout",
                                OPEN_OPTIONS)
  local sopts = { replicas = o.replicas, replica_timeout = o.replica_timeout }
  local ropts = { timeout = o.timeout or 5, password = o.password, user = o.user }
  local ok, r, err, code = pcall(core.redis, uri, ropts)
  if not ok then
    return nil, (tostring(r):gsub("^bad argument #1 to '[^']*' %((.*)%)$", "%1")), "EINVAL"
  end
  if not r then return nil, err, code end
  if sopts.replica_timeout and not sopts.replicas then
    r:close()
    argerror(2, "open", "replica_timeout needs replicas", 3)
  end
  return setmetatable({ uri = core.uri_redact(uri), r = r, cache = {},
                        replicas = sopts.replicas,
                        replica_timeout = sopts.replicas and (sopts.replica_timeout or 1000) },
                      StoreMT)
end

return _M
