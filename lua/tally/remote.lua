-- tally.remote: what the stores whose counters live in a remote service
-- (tally/redis/store.lua, tally/firestore/store.lua) and the flushers that
-- ship local counters to one (tally/redis/flush.lua,
-- tally/firestore/flush.lua) share.
--
--   remote.glob_pattern(g)          a Lua pattern matching what glob g does
--                                   (* any run of bytes, ? one byte)
--   remote.check_name(name, fname, narg)  raises, blaming the caller of the
--                                   method that calls it, unless name is a
--                                   counter name (1 to NAME_MAX bytes)
--   remote.by_name(Store)           adds db:incr(name, n, key), db:decr and
--                                   db:value(name) to a store class with
--                                   db:counter(name [, opts]) and a
--                                   self.cache table of handles by name
--   remote.POLICIES                 the shard policies a remote store takes
--   remote.check_counter_opts(kind, opts, fname, narg)  shards, policy,
--                                   create of db:counter's or db:family's
--                                   options (kind: "redis", "firestore"),
--                                   raising as the method's caller's error
--   remote.ticket()                 this process's ticket, for the thread
--                                   and round_robin policies
--   remote.pick_shard(c, key)       the 1-based shard of counter c ({ n,
--                                   policy, rr, nm }) an increment goes to
--   remote.key_shard(key, n)        the 1-based shard of key among n, as
--                                   the C core's key policy picks it
--   remote.delta(n, sign, fname)    an increment's amount (nil: 1) as an
--                                   integer, negated when sign < 0; raises
--                                   as method fname's caller's error
--   remote.index_with(methods, native, kind)  a store class's __index:
--                                   its methods, and for each other method
--                                   of the file store's (native) one that
--                                   raises "NAME is not supported by the
--                                   KIND store"
--   remote.backend(uri, role)       the module that serves uri as a store
--                                   (role "store": nil for the C open) or
--                                   a flush backend ("flush"): the scheme
--                                   registry
--   remote.default_writer(db)       the writer id a flusher uses when none
--                                   is given: a file:PATH store keeps a
--                                   random one in PATH.writer (made on first
--                                   use, atomically), a memory store one per
--                                   handle for the life of the process
--   remote.add_fits(a, b)           a + b for int64 values, or nil when the
--                                   sum leaves int64
--   remote.shards_sum(name, vals)   the sum of counter name's shard values,
--                                   or nil, msg, "ERANGE" (exact or ERANGE,
--                                   never wrapped, as the file store)
--   remote.reset_range(name)        c:reset()'s nil, msg, "ERANGE" when the
--                                   amount to remove leaves int64
--   remote.check_pattern(pattern, fname)  raises, blaming the caller of
--                                   the method that calls it, unless
--                                   pattern is nil or a string
--   remote.check_family(pattern)    the same for db:family's pattern (a
--                                   non-empty string)
--   remote.check_same(name, shards, policy, s, p)  raises, blaming the
--                                   caller of db:counter, when the options
--                                   asked for (shards, policy; nil: any)
--                                   differ from the counter's (s, p)
--   remote.open_options(kind, opts, takes, extra)  the options table of
--                                   tally.open(uri, opts): timeout (a
--                                   positive number) and the keys of extra
--                                   (extra[k](v, k) -> value or nil, why);
--                                   raises as tally.open's caller's error
--   remote.classes(field, Store, Counter, StoreMT, CounterMT, apply)
--                                   adds what both stores' classes do
--                                   alike (db:close, db:sum, c:incr,
--                                   c:decr, c:value, c:info, c:name,
--                                   c:store, c:close, __close, __tostring),
--                                   the client being db[field]; c:incr
--                                   ends in apply(c, db, i, k, fname),
--                                   adding k to 1-based shard i; returns
--                                   live(db) and cdb(c), the client and
--                                   the store of a counter, raising on a
--                                   closed store

local core = require "tally.core"
local argerror, printable = require("tally.util").argerror, require("tally.util").printable
local compat = require "tally.compat"
local tointeger, sub, add = compat.tointeger, compat.sub, compat.add

local type, error, tostring, setmetatable, pairs, ipairs =
      type, error, tostring, setmetatable, pairs, ipairs
local fmt, find, concat, sort = string.format, string.find, table.concat, table.sort

local _M = {}

function _M.glob_pattern(g)
  return "^" .. g:gsub("[%^%$%(%)%%%.%[%]%+%-]", "%%%0"):gsub("%*", ".*"):gsub("%?", ".") .. "$"
end

local function check_name(name, fname, narg)
  if type(name) ~= "string" then
    argerror(narg, fname, fmt("string expected, got %s", type(name)), 3)
  end
  if #name == 0 or #name > core.NAME_MAX or find(name, "\0", 1, true) then
    argerror(narg, fname, fmt("name must be 1 to %d bytes without NUL, as in a file store",
                              core.NAME_MAX), 3)
  end
end
_M.check_name = check_name

-- The handle for name, created if absent, kept in self.cache.
local function cached(self, name)
  local c = self.cache[name]
  if c then return c end
  local err, code
  c, err, code = self:counter(name)
  if not c then return nil, err, code end
  self.cache[name] = c
  return c
end

function _M.by_name(Store)
  function Store:incr(name, n, key)
    check_name(name, "incr", 1)
    local c, err, code = cached(self, name)
    if not c then return nil, err, code end
    return c:incr(n, key)
  end

  function Store:decr(name, n, key)
    check_name(name, "decr", 1)
    local c, err, code = cached(self, name)
    if not c then return nil, err, code end
    return c:decr(n, key)
  end

  -- reads the counter's options each time (never creates)
  function Store:value(name)
    check_name(name, "value", 1)
    local c, err, code = self:counter(name, { create = false })
    if not c then return nil, err, code end
    return c:value()
  end
end

_M.POLICIES = { thread = true, random = true, round_robin = true, key = true }
local POLICIES = _M.POLICIES

function _M.check_counter_opts(kind, opts, fname, narg)
  local shards, policy, create = nil, nil, true
  if opts == nil then return shards, policy, create end
  if type(opts) ~= "table" then
    argerror(narg, fname, fmt("table expected, got %s", type(opts)), 3)
  end
  for k, v in pairs(opts) do
    if k == "shards" then
      local s = tointeger(v)
      if type(s) ~= "number" or s < 1 or s > core.MAX_SHARDS then
        argerror(narg, fname, fmt("shards must be an integer from 1 to %d, got %s", core.MAX_SHARDS,
                                  printable(tostring(v))), 3)
      end
      shards = s
    elseif k == "policy" then
      if type(v) == "function" then
        argerror(narg, fname, "function policies are not supported by the " .. kind .. " store", 3)
      end
      if not POLICIES[v] then
        argerror(narg, fname, fmt("policy must be thread, random, round_robin or key, got %s",
                                  printable(tostring(v))), 3)
      end
      policy = v
    elseif k == "create" and fname == "counter" then
      create = v ~= false
    else
      argerror(narg, fname, fmt("unknown option '%s'%s", printable(tostring(k)),
                fname == "family" and "; the " .. kind .. " store takes shards and policy" or ""), 3)
    end
  end
  return shards, policy, create
end

local ticket
local function get_ticket()
  if not ticket then
    local f = io.open("/dev/urandom", "rb")
    local b = f and f:read(4)
    if f then f:close() end
    if b and #b == 4 then
      local a, c, d, e = b:byte(1, 4)
      ticket = ((a * 256 + c) * 256 + d) * 256 + e
    else
      ticket = math.random(0, 2147483646)
    end
  end
  return ticket
end
_M.ticket = get_ticket

-- The key policy's shard (1-based) among n: the C core's own
-- (tally_key_shard), so a remote store and a file store put a key alike.
_M.key_shard = core.key_shard

-- c:incr(n) and c:decr(n)'s amount. Level 4 is the frame of the Counter
-- method that tail-calls the store's incr (which calls this): a tail
-- call leaves no line there, so the message has no position, as the C
-- methods' argument errors have none.
function _M.delta(n, sign, fname)
  local k
  if n == nil then k = 1 else k = tointeger(n) end
  if k == nil then
    argerror(1, fname, fmt("integer expected, got %s",
              type(n) == "number" and tostring(n) or type(n)), 4)
  end
  if sign < 0 then k = sub(0, k) end
  return k
end

local seeded = false
-- Errors blame the caller of c:incr (level 3).
function _M.pick_shard(c, key)
  local p, n = c.policy, c.n
  if n == 1 then return 1 end
  if p == "thread" then return get_ticket() % n + 1 end
  if p == "round_robin" then
    local i = c.rr
    c.rr = (i + 1) % n
    return i + 1
  end
  if p == "key" then
    if key == nil then
      error(fmt("counter '%s' has the key policy: pass a key to incr", printable(c.nm)), 3)
    end
    if type(key) ~= "string" and type(key) ~= "number" then
      argerror(2, "incr", "string expected, got " .. type(key), 3)
    end
    return _M.key_shard(tostring(key), n)
  end
  if not seeded then
    math.randomseed(get_ticket(), os.time())
    seeded = true
  end
  return math.random(1, n)
end

local function random_id()
  local f = io.open("/dev/urandom", "rb")
  local bytes = f and f:read(8)
  if f then f:close() end
  if not bytes or #bytes ~= 8 then
    bytes = tostring(os.time()) .. tostring({}) .. tostring(os.clock())
  end
  return (bytes:gsub(".", function(c) return fmt("%02x", c:byte()) end)):sub(1, 16)
end

local memory_ids = setmetatable({}, { __mode = "k" })

-- Errors blame the caller of the function that calls it (level 3), as
-- before: db:flush_to's caller.
function _M.default_writer(db)
  local path = tostring(db):match("^tally%.store %(file:(.*)%)$")
  if not path then
    local id = memory_ids[db]
    if not id then
      id = "mem-" .. random_id()
      memory_ids[db] = id
    end
    return id
  end
  local idfile = path .. ".writer"
  local f = io.open(idfile, "rb")
  if f then
    local id = f:read("*l")
    f:close()
    if id and id:match("^[%w%-_.:]+$") and #id <= 128 then return id end
    error(fmt("bad writer id file %s (delete it only if this store never flushed)", printable(idfile)), 3)
  end
  local id = "file-" .. random_id()
  local tmp = idfile .. ".tmp" .. random_id()
  local w, err = io.open(tmp, "wb")
  if not w then error("cannot create the writer id file: " .. tostring(err), 3) end
  w:write(id, "\n")
  w:close()
  local ok, rerr = os.rename(tmp, idfile)
  if not ok then
    os.remove(tmp)
    error("cannot create the writer id file: " .. tostring(rerr), 3)
  end
  return id
end

-- a + b for int64 values, or nil when the sum leaves int64 (the file
-- store's sums and values are exact or ERANGE, never wrapped).
local function add_fits(a, b)
  local r = add(a, b)
  if (a < 0) == (b < 0) and (r < 0) ~= (a < 0) then return nil end
  return r
end
_M.add_fits = add_fits

local function shards_sum(name, vals)
  local s = 0
  for _, v in ipairs(vals) do
    s = add_fits(s, v)
    if s == nil then
      return nil, "counter '" .. printable(name) .. "': value does not fit in 64 bits", "ERANGE"
    end
  end
  return s
end
_M.shards_sum = shards_sum

function _M.reset_range(name)
  return nil, "counter '" .. printable(name) .. "': the amount to remove does not fit in 64 bits; "
              .. "nothing was removed", "ERANGE"
end

local function check_pattern(pattern, fname)
  if pattern ~= nil and type(pattern) ~= "string" then
    argerror(1, fname, "string expected, got " .. type(pattern), 3)
  end
end
_M.check_pattern = check_pattern

function _M.check_family(pattern)
  if type(pattern) ~= "string" or pattern == "" then
    argerror(1, "family", "non-empty string expected, got " .. tostring(pattern), 3)
  end
end

function _M.check_same(name, shards, policy, s, p)
  if (shards and shards ~= s) or (policy and policy ~= p) then
    local asked = {}
    if shards and shards ~= s then asked[#asked + 1] = shards .. " shards" end
    if policy and policy ~= p then asked[#asked + 1] = "policy " .. policy end
    error(fmt("counter '%s' exists with %d shards and policy %s (asked for %s)",
              printable(name), s, printable(p), concat(asked, " and ")), 3)
  end
end

local function check_timeout(v)
  if type(v) ~= "number" or not (v > 0) then
    return nil, "timeout must be a positive number of seconds, got " .. printable(tostring(v))
  end
  return v
end

-- Level 4: the caller of the store module's open, which calls this.
function _M.open_options(kind, opts, takes, extra)
  if opts ~= nil and type(opts) ~= "table" then
    argerror(2, "open", "table expected, got " .. type(opts), 4)
  end
  local out = {}
  for k, v in pairs(opts or {}) do
    local check = k == "timeout" and check_timeout or extra and extra[k]
    if not check then
      argerror(2, "open", "unknown option '" .. printable(tostring(k)) .. "'; the " .. kind
               .. " store takes " .. takes, 4)
    end
    local val, why = check(v, k)
    if val == nil then argerror(2, "open", why, 4) end
    out[k] = val
  end
  return out
end

function _M.classes(field, Store, Counter, StoreMT, CounterMT, apply)
  -- errors blame the caller of the method that calls live, or cdb
  local function live(db)
    local cl = db[field]
    if not cl then error("attempt to use a closed store", 3) end
    return cl
  end
  local function cdb(c)
    live(c.db)
    return c.db
  end

  function Store:close()
    local cl = self[field]
    if cl then cl:close() end
    self[field] = nil
    self.cache = {}
  end

  -- db:sum([pattern]) -> sum, count of db:values(pattern), in name order
  -- (an overflow is found alike whatever the listing's order)
  function Store:sum(pattern)
    check_pattern(pattern, "sum")
    local vals, err, code = self:values(pattern)
    if not vals then return nil, err, code end
    local names = {}
    for nm in pairs(vals) do names[#names + 1] = nm end
    sort(names)
    local total = 0
    for _, nm in ipairs(names) do
      total = add_fits(total, vals[nm])
      if total == nil then
        return nil, "sum over '" .. printable(pattern or "*") .. "' does not fit in 64 bits", "ERANGE"
      end
    end
    return total, #names
  end

  local function incr(self, n, key, sign, fname)
    local db = cdb(self)
    local k = _M.delta(n, sign, fname)
    local i = _M.pick_shard(self, key)
    return apply(self, db, i, k, fname)
  end
  function Counter:incr(n, key) return incr(self, n, key, 1, "incr") end
  function Counter:decr(n, key) return incr(self, n, key, -1, "decr") end

  -- c:value(): the sum of c:shards()
  function Counter:value()
    local vals, err, code = self:shards()
    if not vals then return nil, err, code end
    return shards_sum(self.nm, vals)
  end

  function Counter:info()
    cdb(self)
    return { name = self.nm, shards = self.n, policy = self.policy }
  end
  function Counter:name() return self.nm end
  function Counter:store() return self.db end
  function Counter:close() end

  StoreMT.__close = function(self) self:close() end
  StoreMT.__tostring = function(self)
    return fmt("tally.store (%s%s)", self.uri, self[field] and "" or ", closed")
  end
  CounterMT.__tostring = function(self)
    return fmt("tally.counter '%s' (%s)", self.nm, self.db.uri)
  end
  return live, cdb
end

function _M.index_with(methods, native, kind)
  return function(_, k)
    local m = methods[k]
    if m then return m end
    if type(k) == "string" and native[k] ~= nil and k:sub(1, 1) ~= "_" then
      return function() error(k .. " is not supported by the " .. kind .. " store", 2) end
    end
    return nil
  end
end

-- The scheme registry: each remote's store and flush backend, by URI.
local SCHEMES = {
  { "^redis://", store = "tally.redis.store", flush = "tally.redis.flush" },
  { "^redis%+cluster://", store = "tally.redis.store", flush = "tally.redis.flush" },
  { "^firestore://", store = "tally.firestore.store", flush = "tally.firestore.flush" },
}

-- A URI no scheme claims is the C open's to take as a store, and the
-- Redis backend's to refuse as a flush target (its message says what a
-- Redis URI is: the default target since flush_to began with Redis).
function _M.backend(uri, role)
  if type(uri) == "string" then
    for _, s in ipairs(SCHEMES) do
      if find(uri, s[1]) then return s[role] end
    end
  end
  return role == "flush" and "tally.redis.flush" or nil
end

return _M
