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
--   remote.backend(uri, role)       the module that serves uri as a store
--                                   (role "store": nil for the C open) or
--                                   a flush backend ("flush"): the scheme
--                                   registry
--   remote.default_writer(db)       the writer id a flusher uses when none
--                                   is given: a file:PATH store keeps a
--                                   random one in PATH.writer (made on first
--                                   use, atomically), a memory store one per
--                                   handle for the life of the process

local core = require "tally.core"
local argerror, printable = require("tally.util").argerror, require("tally.util").printable
local compat = require "tally.compat"
local tointeger, sub = compat.tointeger, compat.sub

local type, error, tostring, setmetatable, pairs, ipairs =
      type, error, tostring, setmetatable, pairs, ipairs
local fmt, find = string.format, string.find

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
