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
--   remote.default_writer(db)       the writer id a flusher uses when none
--                                   is given: a file:PATH store keeps a
--                                   random one in PATH.writer (made on first
--                                   use, atomically), a memory store one per
--                                   handle for the life of the process

local core = require "tally.core"
local argerror = require("tally.util").argerror

local type, error, tostring, setmetatable = type, error, tostring, setmetatable
local fmt = string.format

local _M = {}

function _M.glob_pattern(g)
  return "^" .. g:gsub("[%^%$%(%)%%%.%[%]%+%-]", "%%%0"):gsub("%*", ".*"):gsub("%?", ".") .. "$"
end

local function check_name(name, fname, narg)
  if type(name) ~= "string" then
    argerror(narg, fname, fmt("string expected, got %s", type(name)), 3)
  end
  if #name == 0 or #name > core.NAME_MAX then
    argerror(narg, fname, fmt("name must be 1 to %d bytes", core.NAME_MAX), 3)
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
    error(fmt("bad writer id file %s (delete it only if this store never flushed)", idfile), 3)
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

return _M
