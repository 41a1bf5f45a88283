-- tally.flush: db:flush_to(uri, opts), the schedule that ships the local
-- counters of a store handle (file or memory) to a remote exactly once per
-- writer, driven by db:tick() and db:run() like the rollups. One frame for
-- every remote; a backend says how to reach one (tally.redis.flush,
-- tally.firestore.flush; the scheme registry is tally.remote.backend).
--
--   local rf = db:flush_to(uri, { every = 1, pattern = "*", writer = "web-7" })
--   db:run(60)                 -- one round per due period
--   rf:sync(10)                -- rounds until nothing is left to send
--   rf:remote_value("hits")    -- every writer's completed flushes
--   rf:stats()
--
-- The protocol every backend keeps (docs/design.md). Each (counter,
-- writer) has a marker in the remote: the value of one incarnation of the
-- counter that the remote holds from this writer. A flush sends "add value
-- - marker; marker = value" as one step the remote applies only while the
-- marker is what the flusher last knew, so a step sent again (a lost reply,
-- a restart) applies at most once; after any failure the marker is read
-- again and the delta taken from it, never from what was sent. Before a
-- value goes out the counter is marked unknown and its value read again
-- (tally_counter_send_begin, core.counter_send_begin), so upkeep holds it
-- until a value the remote holds is marked (core.counter_ship): a counter
-- expires only once its final value is in the remote.
--
-- The frame: the options both take, the schedule's methods (what rollup.lua
-- and tally.openresty drive), the result entries of db:tick() and the
-- stats. A backend is a class made by flush.backend(B, spec) with
--   B.new(self, uri, opts)     check the URI (raising as flush_to's error),
--                              take its own options, make no round yet
--   self:_start()              (optional) what needs the writer, once known
--   self:_round()              one round: a stats table (flushed; waiting:
--                              seconds of backoff left), or nil, msg, code
--   self:_settled(st)          true when the round st left nothing to send
--   self:_remote_value(name)   the remote total, or nil, msg, code
--   self:_verify()             the next round reads every marker again
--   self:_stats(t)             its own fields added to the stats table t
--   self:_close()              let go of the connection

local core = require "tally.core"
local compat = require "tally.compat"
local util = require "tally.util"
local remote = require "tally.remote"

local type, error, tostring, pcall, setmetatable, pairs, ipairs =
      type, error, tostring, pcall, setmetatable, pairs, ipairs
local fmt, concat = string.format, table.concat
local argerror, printable = util.argerror, util.printable

local _M = {}

local Schedule = {}

-- ---- options -------------------------------------------------------------------

-- opts[k] as a number from lo to hi (an integer when int), or default
local function number(opts, k, default, lo, hi, int)
  local v = opts[k]
  if v == nil then return default end
  local n = v
  if int then n = compat.tointeger(v) end
  if type(n) ~= "number" or n ~= n or n < lo or n > hi then
    argerror(2, "flush_to", fmt("%s must be %s from %s to %s, got %s", k,
              int and "an integer" or "a number", tostring(lo), tostring(hi),
              printable(tostring(v))), 5)
  end
  return n
end
_M.number = number

-- The options of every backend, checked once; spec.options lists the
-- backend's own (checked by B.new), spec.shards and spec.timeout its
-- defaults. The writer is settled once the URI is known good (writer()).
local function common(db, opts, spec)
  opts = opts or {}
  if type(opts) ~= "table" then
    argerror(2, "flush_to", "options table expected, got " .. type(opts), 4)
  end
  local names = { "every", "pattern", "shards", "writer", "timeout" }
  for _, k in ipairs(spec.options) do names[#names + 1] = k end
  local known = {}
  for _, k in ipairs(names) do known[k] = true end
  for k in pairs(opts) do
    if not known[k] then
      argerror(2, "flush_to", "unknown option '" .. printable(tostring(k)) .. "'; expected "
               .. concat(names, ", "), 4)
    end
  end
  local every = opts.every == nil and 1 or opts.every
  if type(every) ~= "number" or every ~= every or every < 0.001 or every > 366 * 86400 then
    argerror(2, "flush_to", "every must be from 0.001 s to 366 days, got "
             .. printable(tostring(every)), 4)
  end
  local pattern = opts.pattern == nil and "*" or opts.pattern
  if type(pattern) ~= "string" or pattern == "" then
    argerror(2, "flush_to", "pattern must be a non-empty string, got "
             .. printable(tostring(pattern)), 4)
  end
  local writer = opts.writer
  if writer ~= nil and (type(writer) ~= "string" or #writer < 1 or #writer > 128
                        or writer:find("\0", 1, true)) then
    argerror(2, "flush_to", "writer must be a string of 1 to 128 bytes, got "
             .. printable(tostring(writer)), 4)
  end
  return {
    db = db, every = every, pattern = pattern, writer = writer,
    shards = number(opts, "shards", spec.shards, 1, core.MAX_SHARDS, true),
    timeout = number(opts, "timeout", spec.timeout, 0.001, 86400),
    runs = 0, errors = 0, flushed = 0,
  }
end

-- The writer, once the backend took the URI: the default one (a file
-- store's is made on first use), and none that this handle already
-- flushes the same pattern as.
local function writer(self, list)
  self.writer = self.writer or remote.default_writer(self.db)
  for _, other in ipairs(list) do
    if other.writer == self.writer and other.pattern == self.pattern then
      self:_close()
      argerror(2, "flush_to", fmt("this store handle already flushes '%s' as writer '%s'",
                                  printable(self.pattern), printable(self.writer)), 4)
    end
  end
end

-- ---- the schedule ----------------------------------------------------------------

-- a round that failed: counted, kept as the last error
local function failed(self, msg, code)
  self.errors = self.errors + 1
  self.last_error, self.last_code = tostring(msg), code
  return nil, msg, code
end

local function round(self)
  local st, msg, code = self:_round()
  if not st then return failed(self, msg, code) end
  if not st.waiting then self.last_run = st end  -- a backoff ran nothing
  return st
end

local function live(self)
  if self.closed then error("attempt to use a closed flush schedule", 3) end
end

-- One round from db:tick(), never raising: its result entry.
function Schedule:_run(period)
  self.runs = self.runs + 1
  self.last_period = period
  local r = { flush = self.uri, pattern = self.pattern, every = self.every, period = period }
  local pok, st, msg = pcall(round, self)
  if not pok then failed(self, st) end
  if pok and st and st.waiting then    -- backing off after a failure: say so, and which
    r.status, r.waiting, r.error = "backoff", st.waiting, self.last_error
  elseif pok and st then
    r.status, r.flushed = "flushed", st.flushed
  else
    r.status, r.error = "error", tostring(pok and msg or self.last_error)
  end
  return r
end

-- s:flush_now() -> stats of one round, or nil, msg, code (outside the schedule)
function Schedule:flush_now()
  live(self)
  return round(self)
end

-- s:sync([timeout]) -> true once a round leaves nothing to send, or nil,
-- msg, code after timeout seconds (default 60)
function Schedule:sync(timeout)
  live(self)
  local deadline = core.now() + (timeout or 60)
  while true do
    local st, msg, code = round(self)
    if st and not st.waiting and self:_settled(st) then return true end
    if core.now() >= deadline then   -- the last failure says more than "pending"
      if not msg and self.last_error and (st == nil or st.waiting) then
        msg, code = self.last_error, self.last_code
      end
      return nil, msg or fmt("not settled after %g s: %s counters still pending", timeout or 60,
                             tostring(st and st.pending or "some")), code or "ETIMEDOUT"
    end
    core.sleep(0.02)
  end
end

-- s:remote_value(name) -> the remote total of name (completed flushes of
-- every writer; never this process's unflushed deltas), or nil, msg, code
function Schedule:remote_value(name)
  if type(name) ~= "string" then
    argerror(1, "remote_value", "counter name expected, got " .. type(name), 2)
  end
  live(self)
  return self:_remote_value(name)
end

-- s:verify(): the next round reads every marker again and resends what the
-- remote lost
function Schedule:verify()
  if not self.closed then self:_verify() end
end

function Schedule:stats()
  local t = {
    uri = self.uri, every = self.every, pattern = self.pattern, writer = self.writer,
    shards = self.shards, runs = self.runs, errors = self.errors, flushed = self.flushed,
    last_error = self.last_error, last_code = self.last_code, last_period = self.last_period,
    last_run = self.last_run,
  }
  self:_stats(t)
  return t
end

-- s:unship(): the store forgets that this writer ships its counters, so
-- idle expiry no longer waits for their final values to reach the remote.
-- For a store this writer will not flush again; the next round ships again.
function Schedule:unship()
  return core.unship(self.db, self.writer)
end

-- s:close(): stop flushing (the schedule is removed from its store handle)
function Schedule:close()
  if self.closed then return end
  self.closed = true
  self:_close()
  self.unlink(self)
end

local function tostring_of(self)
  return fmt("tally.flush_to '%s' every %gs", self.uri, self.every)
end

-- B, a backend's class, made a schedule class; spec = { options = { the
-- backend's own option names }, shards = default or nil, timeout = default }
function _M.backend(B, spec)
  B.__index = B
  B.__tostring = tostring_of
  B.spec = spec
  return setmetatable(B, { __index = Schedule })
end

-- db:flush_to(uri, opts): the schedule, added to list; unlink(s) takes it
-- out again (rollup.lua keeps the list per store handle)
function _M.flush_to(db, uri, opts, list, unlink)
  local B = require(remote.backend(uri, "flush"))
  local self = setmetatable(common(db, opts, B.spec), B)
  self.unlink = unlink
  B.new(self, uri, opts or {})
  writer(self, list)
  if self._start then self:_start() end
  list[#list + 1] = self
  return self
end

return _M
