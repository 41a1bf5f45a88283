-- tally.redis.flush: db:flush_to(uri, opts), a schedule that ships the local
-- counters of a store handle to Redis or Redis Cluster exactly once
-- (include/tally_net.h), driven by db:tick() and db:run() like the rollups.
--
--   local rf = db:flush_to("redis+cluster://10.0.0.1:7000,10.0.0.2:7000",
--                          { every = 1, pattern = "*", shards = 8,
--                            writer = "web-7", timeout = 5 })
--   db:run(60)                  -- one flush round per due period
--   rf:remote_value("hits")     -- completed flushes only, from every writer
--   rf:stats()
--
-- The writer id. Each (local store, writer) pair is one writer in Redis:
-- its local counter values ARE what it has contributed, so the id must
-- stay the same for as long as the local values do. Without `writer`:
--   * file:PATH stores keep a random id in PATH.writer (made on first
--     use, read back after a restart, so unflushed deltas still reach
--     Redis once);
--   * memory stores get a random id per store handle (their counters
--     start from zero with the handle, so a new id is right).
-- Only one process at a time may flush a given file store (its writer id
-- is shared by every handle on that file).
--
-- Failures (Redis down, a connection dropped) are counted in :stats() and
-- never raised by db:tick(); the next period retries. Bad URIs and options
-- raise at once.

local core = require "tally.core"

local type, error, tostring, pcall, setmetatable = type, error, tostring, pcall, setmetatable
local fmt = string.format

local argerror, printable = require("tally.util").argerror, require("tally.util").printable
local remote = require "tally.remote"

local _M = {}

local Remote = {}
Remote.__index = Remote

local OPTIONS = { every = true, pattern = true, shards = true, writer = true, timeout = true,
                  password = true, user = true, verify = true }

-- The URI and credentials to connect with, kept out of the schedule's
-- table (stats, tostring and tick results show the redacted URI only).
local secrets = setmetatable({}, { __mode = "k" })

-- Open the redis handle and the flusher if not open yet: true, or nil, msg.
local function connect(self)
  if self.flusher then return true end
  local sec = secrets[self]
  local rh, err = core.redis(sec.uri, { timeout = self.timeout, password = sec.password,
                                        user = sec.user })
  if not rh then return nil, err end
  local ok, fl = pcall(core.flusher, self.db, rh, { writer = self.writer, shards = self.shards,
                                                  verify = self.verify_every })
  if not ok or not fl then
    rh:close()
    return nil, tostring(fl)
  end
  self.redis, self.flusher = rh, fl
  return true
end

-- One flush round, never raising: a result entry for db:tick().
function Remote:_run(period)
  self.runs = self.runs + 1
  self.last_period = period
  local ok, err = connect(self)
  local st
  if ok then
    local pok
    pok, st, err = pcall(self.flusher.run, self.flusher, self.pattern)
    if not pok then st, err = nil, st end
    if not st then ok = false end
  end
  if ok then
    self.flushed = self.flushed + st.flushed
    self.commands = self.commands + st.commands
    self.last_run = st
    return { flush = self.uri, pattern = self.pattern, every = self.every, status = "flushed",
             period = period, flushed = st.flushed }
  end
  self.errors = self.errors + 1
  self.last_error = tostring(err)
  return { flush = self.uri, pattern = self.pattern, every = self.every, status = "error",
           period = period, error = self.last_error }
end

-- rf:flush_now() -> stats of one round, or nil, message (outside the schedule).
function Remote:flush_now()
  local ok, err = connect(self)
  if not ok then return nil, err end
  local st, msg = self.flusher:run(self.pattern)
  if not st then return nil, msg end
  self.flushed = self.flushed + st.flushed
  self.commands = self.commands + st.commands
  return st
end

-- rf:remote_value(name) -> the remote total of name (completed flushes of
-- every writer; never this process's unflushed deltas), or nil, message.
function Remote:remote_value(name)
  if type(name) ~= "string" then
    argerror(1, "remote_value", "counter name expected, got " .. type(name), 2)
  end
  local ok, err = connect(self)
  if not ok then return nil, err end
  return self.flusher:remote_value(name)
end

-- rf:verify(): the next round reads every w:WRITER again and resends what
-- Redis lost (it also happens after topology changes and every `verify` s).
function Remote:verify()
  if self.flusher then self.flusher:verify() end
end

function Remote:stats()
  local rs
  if self.redis then
    local ok, s = pcall(self.redis.stats, self.redis)
    rs = ok and s or nil
  end
  return {
    uri = self.uri, every = self.every, pattern = self.pattern, writer = self.writer,
    shards = self.shards, runs = self.runs, errors = self.errors, flushed = self.flushed,
    commands = self.commands, last_error = self.last_error, last_period = self.last_period,
    last_run = self.last_run, redis = rs,
  }
end

-- rf:unship(): the store forgets that this writer ships its counters, so
-- idle expiry no longer waits for their final values to reach Redis. For
-- a store this writer will not flush again; the next round ships again.
function Remote:unship()
  return core.unship(self.db, self.writer)
end

-- rf:close(): stop flushing (the schedule is removed from its store handle).
function Remote:close()
  if self.closed then return end
  self.closed = true
  if self.flusher then self.flusher:close() end
  if self.redis then self.redis:close() end
  self.flusher, self.redis = nil, nil
  self.unlink(self)
end

function Remote:__tostring()
  return fmt("tally.flush_to '%s' every %gs", self.uri, self.every)
end

-- db:flush_to(uri, opts) -> the flush schedule
function _M.flush_to(db, uri, opts, list, unlink)
  if type(uri) ~= "string" then
    argerror(1, "flush_to", "Redis URI expected, got " .. type(uri), 3)
  end
  opts = opts or {}
  if type(opts) ~= "table" then
    argerror(2, "flush_to", "options table expected, got " .. type(opts), 3)
  end
  for k in pairs(opts) do
    if not OPTIONS[k] then
      argerror(2, "flush_to", "unknown option '" .. printable(tostring(k))
               .. "'; expected every, pattern, shards, writer, timeout, password, user, verify", 3)
    end
  end
  local every = opts.every == nil and 1 or opts.every
  if type(every) ~= "number" or every ~= every or every < 0.001 or every > 366 * 86400 then
    argerror(2, "flush_to", "every must be from 0.001 s to 366 days, got "
          .. printable(tostring(every)), 3)
  end
  local pattern = opts.pattern == nil and "*" or opts.pattern
  if type(pattern) ~= "string" or pattern == "" then
    argerror(2, "flush_to", "pattern must be a non-empty string, got "
          .. tostring(pattern), 3)
  end
  local shards = opts.shards == nil and 8 or opts.shards
  if math.type and math.type(shards) == "float" and shards == math.floor(shards) then
    shards = math.tointeger(shards)
  end
  if type(shards) ~= "number" or shards ~= math.floor(shards) or shards < 1
     or shards > core.MAX_SHARDS then
    argerror(2, "flush_to", fmt("shards must be an integer from 1 to %d, got %s",
              core.MAX_SHARDS, printable(tostring(shards))), 3)
  end
  local timeout = opts.timeout == nil and 5 or opts.timeout
  if type(timeout) ~= "number" or not (timeout > 0) then
    argerror(2, "flush_to", "timeout must be a positive number of seconds, got "
          .. printable(tostring(timeout)), 3)
  end
  for _, k in ipairs({ "password", "user" }) do
    if opts[k] ~= nil and (type(opts[k]) ~= "string" or opts[k] == "") then
      argerror(2, "flush_to", "" .. k .. " must be a non-empty string, got "
            .. type(opts[k]), 3)  -- never quote the value
    end
  end
  local verify = opts.verify == nil and 60 or opts.verify
  if type(verify) ~= "number" or not (verify >= 0 and verify <= 4294967) then
    argerror(2, "flush_to", "verify must be a number of seconds from 0 to 4294967, got "
          .. printable(tostring(verify)), 3)
  end
  local sec = { uri = uri, password = opts.password, user = opts.user }
  -- Connect now so a bad URI raises here; a server that is down is only
  -- counted (the schedule connects on its next period).
  local ok, rh, err = pcall(core.redis, uri, { timeout = timeout, password = sec.password,
                                               user = sec.user })
  if not ok then
    error((tostring(rh):gsub("^bad argument #1 to '[^']*'", "bad argument #1 to 'flush_to'")), 3)
  end
  local writer = opts.writer
  if writer == nil then
    writer = remote.default_writer(db)
  elseif type(writer) ~= "string" or #writer < 1 or #writer > 128 or writer:find("\0", 1, true) then
    argerror(2, "flush_to", "writer must be a string of 1 to 128 bytes, got "
          .. printable(tostring(writer)), 3)
  end
  local self = setmetatable({
    db = db, uri = core.uri_redact(uri), every = every, pattern = pattern, shards = shards,
    timeout = timeout, verify_every = verify, writer = writer, runs = 0, errors = 0, flushed = 0, commands = 0,
    unlink = unlink,
  }, Remote)
  secrets[self] = sec
  for _, other in ipairs(list) do
    if other.writer == writer and other.pattern == pattern then
      if rh then rh:close() end
      argerror(2, "flush_to", fmt("this store handle already flushes '%s' as writer '%s'",
                printable(pattern), printable(writer)), 3)
    end
  end
  if rh then
    local fok, fl = pcall(core.flusher, db, rh, { writer = writer, shards = shards,
                                                  verify = verify })
    if not fok then
      rh:close()
      error(fl, 3)
    end
    self.redis, self.flusher = rh, fl
  else
    self.last_error = err
  end
  list[#list + 1] = self
  return self
end

return _M
