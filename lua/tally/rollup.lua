-- tally.rollup: schedules from Lua (db:rollup), driving them (db:tick,
-- db:run), and reads that choose their cost (c:rolled, c:history,
-- c:value{ max_age = }).
--
-- The C core keeps the rollup records and history in the store and makes
-- each period run once across processes; this file parses schedules,
-- keeps each store handle's schedules and clock, and hands the records of
-- every run to the schedule's sinks (tally.sink).

local core = require "tally.core"
local sink = require "tally.sink"
local flushes = require "tally.flush"
local check_self = require("tally.util").self

local type, error, ipairs, pairs, tostring, pcall = type, error, ipairs, pairs, tostring, pcall
local floor = math.floor
local compat = require "tally.compat"
local tointeger, idiv = compat.tointeger, compat.idiv
local fmt = string.format

local argerror = require("tally.util").argerror
local describe, printable = require("tally.util").describe, require("tally.util").printable

local _M = {}

-- Per store handle: { schedules = { ... }, flushes = { ... } (db:flush_to,
-- tally.flush), clock = function or nil }.
local state = setmetatable({}, { __mode = "k" })

local function state_of(db)
  local st = state[db]
  if not st then
    st = { schedules = {}, flushes = {} }
    state[db] = st
  end
  return st
end

local UNITS = { s = 1, m = 60, h = 3600, d = 86400, w = 604800 }
local RING_LEN_MAX = 100000
local RING_RES_MAX = 366 * 86400

-- "60x1s" -> 60 buckets of 1 second. Raises with the reason.
function _M.parse_keep(spec, level)
  level = (level or 1) + 1
  if type(spec) ~= "string" then
    error(fmt("bad keep entry (string like '60x1m' expected, got %s)", type(spec)), level)
  end
  local n, k, unit = spec:match("^(%d+)x(%d+)(%a+)$")
  if not n then
    error(fmt("bad keep entry '%s' (expected COUNTxWIDTHUNIT, e.g. '60x1s', '24x1h')", printable(spec)), level)
  end
  local mult = UNITS[unit]
  if not mult then
    error(fmt("bad keep entry '%s': unknown unit '%s' (use s, m, h, d or w)", spec, unit), level)
  end
  n, k = tointeger(tonumber(n)), tointeger(tonumber(k))
  if not n or n < 1 or n > RING_LEN_MAX then
    error(fmt("bad keep entry '%s': count must be 1 to %d", spec, RING_LEN_MAX), level)
  end
  if not k or k < 1 or k * mult > RING_RES_MAX then
    error(fmt("bad keep entry '%s': bucket width must be 1 s to 366 days", spec), level)
  end
  return n, k * mult
end

-- A resolution given to c:history: "1m", "60s", or seconds as a number.
local function parse_res(res)
  local r
  if type(res) == "number" then
    r = tointeger(res)
  elseif type(res) == "string" then
    local k, unit = res:match("^(%d+)(%a+)$")
    if k and UNITS[unit] then r = tointeger(tonumber(k)) end
    if r then r = r * UNITS[unit] end
  end
  if r and r >= 1 and r <= RING_RES_MAX then return r end
  argerror(1, "history", fmt("resolution like '1m' or seconds expected, got %s",
            type(res) == "string" and "'" .. printable(res) .. "'" or tostring(res)), 3)
end

local function clock_of(db)
  local st = state[db]
  local fn = st and st.clock
  if fn then
    local t = fn()
    if type(t) ~= "number" or t ~= t or t < 0 then
      error("the store's clock returned " .. printable(tostring(t)) .. " (seconds since the epoch expected)", 3)
    end
    return t
  end
  return core.now()
end

-- ---- schedules -------------------------------------------------------------------

local Schedule = { __name = "tally.schedule" }
Schedule.__index = Schedule

function Schedule:stats()
  check_self(self, "tally.schedule", "stats")
  local out = {
    pattern = self.pattern, every = self.every, runs = self.runs,
    counters = self.counters, busy = self.busy, lost = self.lost,
    errors = self.errors, last_error = self.last_error,
    last_period = self.last_period, sinks = {},
  }
  for i, s in ipairs(self.sinks) do
    local ok, st = pcall(s.stats, s)
    out.sinks[i] = ok and st or { last_error = tostring(st) }
  end
  return out
end

function Schedule:__tostring()
  return fmt("tally.schedule '%s' every %gs", self.pattern, self.every)
end

local OPTIONS = { every = true, keep = true, sinks = true }

-- db:rollup(pattern, { every = s, keep = { "60x1s", ... }, sinks = { ... } })
local function rollup(db, pattern, opts)
  check_self(db, "tally.store", "rollup")
  if type(pattern) ~= "string" or #pattern == 0 then
    argerror(1, "rollup", "pattern string expected, got "
          .. (type(pattern) == "string" and "an empty string" or type(pattern)), 2)
  end
  if type(opts) ~= "table" then
    argerror(2, "rollup", "options table expected, got " .. type(opts), 2)
  end
  for k in pairs(opts) do
    if not OPTIONS[k] then
      argerror(2, "rollup", "unknown option '" .. printable(tostring(k)) .. "'; expected every, keep, sinks", 2)
    end
  end
  local every = opts.every
  if type(every) ~= "number" or every ~= every or every <= 0 then
    argerror(2, "rollup", "every must be a positive number of seconds, got "
          .. printable(tostring(every)), 2)
  end
  if every < 0.001 or every > RING_RES_MAX then
    argerror(2, "rollup", "every must be from 0.001 s to 366 days, got "
          .. tostring(every), 2)
  end
  local keep, rings = opts.keep or {}, {}
  if type(keep) ~= "table" then
    argerror(2, "rollup", "keep must be a list like { '60x1s' }, got "
          .. type(keep), 2)
  end
  for k in pairs(keep) do      -- { a = "1x1s" } would keep nothing, silently
    if type(k) ~= "number" or k < 1 or k > #keep or k ~= math.floor(k) then
      argerror(2, "rollup", "keep must be a list like { '60x1s' }, got a key "
            .. describe(k), 2)
    end
  end
  for i, spec in ipairs(keep) do
    local n, res = _M.parse_keep(spec, 2)
    for _, r in ipairs(rings) do
      if r[1] == res then
        error(fmt("bad keep entry '%s': a resolution of %d s is already kept", spec, res), 2)
      end
    end
    rings[i] = { res, n }
  end
  if opts.sinks ~= nil and type(opts.sinks) ~= "table" then
    argerror(2, "rollup", "sinks must be a list, got " .. type(opts.sinks), 2)
  end
  local sinks = {}
  for i, s in ipairs(opts.sinks or {}) do
    sinks[i] = sink.wrap(s, i)
  end
  -- (pattern, every in whole ms) is the schedule's identity in the store:
  -- a second one here would share its periods and never run
  local ms = math.floor(every * 1000 + 0.5)
  for _, other in ipairs(state_of(db).schedules) do
    if other.pattern == pattern and math.floor(other.every * 1000 + 0.5) == ms then
      argerror(2, "rollup", fmt("a schedule for '%s' every %g s already "
                .. "exists on this store handle; give it all the keep and sinks", printable(pattern), every), 2)
    end
  end
  local ok, handle = pcall(core.schedule, db, pattern, every, rings)
  if not ok then error(handle, 2) end
  local sch = setmetatable({
    pattern = pattern, every = every, keep = keep, sinks = sinks, handle = handle,
    runs = 0, counters = 0, busy = 0, lost = 0, errors = 0,
  }, Schedule)
  local list = state_of(db).schedules
  list[#list + 1] = sch
  for _, s in ipairs(sinks) do  -- a sink that wants the store (an HTTP spool) gets it now
    if type(s) == "table" and type(rawget(getmetatable(s) or {}, "_attach")) == "function" then
      local aok, aerr = pcall(s._attach, s, db)
      if not aok then sink.failed(s, aerr, 0) end
    end
  end
  return sch
end

-- The store's upkeep (db:maintain): reuse of retired space and idle
-- expiry, one bounded step per tick, on the tick's clock in milliseconds.
-- Returns a result entry for db:tick() when it failed, else nil.
local maintain = core.store_methods.maintain
local function upkeep(db, now)
  local ms = tointeger(floor(now * 1000))
  if not ms or ms > core.MAINTAIN_MAX_MS then return nil end  -- past 2106: none due
  local r, msg = maintain(db, ms)
  if r then return nil end
  return { upkeep = true, status = "error", error = msg }
end

-- db:tick([now]) -> { { pattern =, every =, status =, period =, counters = }, ... }
-- Runs every schedule of this store handle that is due at `now` (default:
-- the store's clock) and hands the records to its sinks; first, one step
-- of the store's upkeep (db:maintain), schedules or not, and a flush of
-- this handle's buffered histograms (h:flush). Lists what
-- happened, leaving out schedules that were not due. Failures of the store
-- are reported in the list (status "error"; upkeep = true for the
-- upkeep's), never raised.
local function tick(db, now)
  check_self(db, "tally.store", "tick")
  local given = now ~= nil
  if not given then now = clock_of(db) end
  if type(now) ~= "number" or now ~= now or now < 0 or now >= 9.2e15 then
    local got = "time in seconds (0 to 9.2e15) expected, got " .. printable(tostring(now))
    if given then argerror(1, "tick", got, 2) end
    error("db:tick: the store's clock (db:clock) gave no " .. got:gsub(" expected, got", ":"), 2)
  end
  local st, done = state[db], {}
  done[1] = upkeep(db, now)
  -- this handle's buffered histograms, each flushed as one batch
  local fok, fmsg = core.histograms_flush(db)
  if not fok then done[#done + 1] = { status = "error", error = fmsg, histograms = true } end
  if not st then return done end
  for _, sch in ipairs(st.schedules) do
    local status, period, n, recs, skipped = sch.handle:tick(now, #sch.sinks > 0)
    if status == nil then
      sch.errors = sch.errors + 1
      sch.last_error = period
      done[#done + 1] = { pattern = sch.pattern, every = sch.every, status = "error", error = period }
    else
      if status == "ran" or status == "lost" then
        sch.runs = sch.runs + 1
        sch.counters = sch.counters + n
        sch.last_period = period
        if status == "lost" then sch.lost = sch.lost + 1 end
      elseif status == "busy" then
        sch.busy = sch.busy + 1
      end
      if status ~= "not_due" then
        done[#done + 1] = { pattern = sch.pattern, every = sch.every, status = status,
                            period = period, counters = n, skipped = skipped }
      end
      for _, s in ipairs(sch.sinks) do
        -- a sink's failure is its own (counted in its stats): never the tick's
        local ok, err
        if recs and #recs > 0 then ok, err = pcall(s.push, s, recs, db, sch)
        else ok, err = pcall(s.pump, s) end
        if not ok then sink.failed(s, err, recs and #recs or 0) end
      end
    end
  end
  -- flush schedules (tally.flush): one round per due period; their
  -- failures are counted in their stats and listed here, never raised
  for _, rf in ipairs(st.flushes) do
    local period = floor(now / rf.every)
    if rf.last_period == nil or period > rf.last_period then
      done[#done + 1] = rf:_run(period)
    end
  end
  return done
end

-- Seconds from now until the next period of any schedule begins, or
-- until the next step of upkeep is due.
local BUSY_RETRY = 0.05  -- seconds: another process holds a lease
local UPKEEP_EVERY = 1   -- seconds between two steps of upkeep in db:run

local function next_due(st, now, done)
  local wait = UPKEEP_EVERY
  for _, sch in ipairs(st.schedules) do
    local w = (floor(now / sch.every) + 1) * sch.every - now
    if w < wait then wait = w end
  end
  for _, rf in ipairs(st.flushes) do
    local w = (floor(now / rf.every) + 1) * rf.every - now
    if w < wait then wait = w end
  end
  for _, d in ipairs(done) do  -- not rolled up yet: its period is still open
    if d.status == "busy" and BUSY_RETRY < wait then wait = BUSY_RETRY end
  end
  return wait
end

-- db:run(seconds [, on_tick]) -> rollups made
-- Ticks until `seconds` have passed, sleeping until the next period is
-- due; on_tick(results) is called after every tick that did something.
-- Periods follow the store's clock, sleeping follows the real one.
local function run(db, seconds, on_tick)
  check_self(db, "tally.store", "run")
  if type(seconds) ~= "number" or seconds ~= seconds or seconds < 0 then
    argerror(1, "run", "seconds expected, got " .. printable(tostring(seconds)), 2)
  end
  if on_tick ~= nil and type(on_tick) ~= "function" then
    argerror(2, "run", "function expected, got " .. type(on_tick), 2)
  end
  local deadline, total = core.now() + seconds, 0
  while true do
    local done = tick(db)
    for _, d in ipairs(done) do total = total + (d.counters or 0) end
    if on_tick and #done > 0 then on_tick(done) end
    local left = deadline - core.now()
    if left <= 0 then break end
    local st = state[db]
    local wait = st and next_due(st, clock_of(db), done) or UPKEEP_EVERY
    -- a little past the boundary, so the clock has crossed it
    core.sleep(math.min(wait + 0.001, left))
  end
  return total
end

-- db:flush([timeout]) -> true, or nil, message: wait until every sink of
-- this store handle has delivered what it holds (default 5 s).
local function flush(db, timeout)
  check_self(db, "tally.store", "flush")
  timeout = timeout or 5
  if type(timeout) ~= "number" or not (timeout >= 0) then     -- NaN too
    argerror(1, "flush", "seconds expected, got "
             .. (timeout ~= timeout and "nan" or printable(tostring(timeout))), 2)
  end
  local st = state[db]
  if not st then return true end
  local deadline, waiting = core.now() + timeout, 0
  for _, sch in ipairs(st.schedules) do
    for _, s in ipairs(sch.sinks) do
      pcall(s.pump, s)
      -- (a sink waits at most 4294967 s, about 50 days: longer is that)
      local fok, ok = pcall(s.flush, s, math.min(4294967, math.max(0, deadline - core.now())))
      if not (fok and ok) then
        local sok, stats = pcall(s.stats, s)
        waiting = waiting + (sok and stats.queued or 0)
      end
    end
  end
  if waiting > 0 then
    return nil, fmt("%d records still queued in sinks", waiting)
  end
  return true
end

-- db:flush_to(uri, opts) -> a flush schedule (see tally.flush)
local function flush_to(db, uri, opts)
  check_self(db, "tally.store", "flush_to")
  core.store_methods.stats(db)  -- raises on a closed store
  local st = state_of(db)
  local rf = flushes.flush_to(db, uri, opts, st.flushes, function(s)
    for i, other in ipairs(st.flushes) do
      if other == s then table.remove(st.flushes, i) return end
    end
  end)
  return rf  -- not a tail call: flush_to's messages blame this one's caller
end

-- db:schedules() -> the schedules defined through this handle.
local function schedules(db)
  check_self(db, "tally.store", "schedules")
  local st, out = state[db], {}
  for i, sch in ipairs(st and st.schedules or {}) do out[i] = sch end
  return out
end

-- db:clock([fn]) -> the store's time now; with fn, makes fn the clock that
-- db:tick(), db:run() and c:value{ max_age } use from now on (false: back
-- to the real clock). For tests and for hosts with a clock of their own.
local function clock(db, fn)
  check_self(db, "tally.store", "clock")
  if fn ~= nil then
    if fn ~= false and type(fn) ~= "function" then
      argerror(1, "clock", "function or false expected, got " .. type(fn), 2)
    end
    state_of(db).clock = fn or nil
  end
  return clock_of(db)
end

-- ---- counter reads -----------------------------------------------------------------

-- c:value{ max_age = s [, now = t] } -> value, "rolled" | "exact"
-- The rolled value if the counter's last rollup is at most max_age
-- seconds old, else the exact one.
local exact_value = core.counter_methods.value
local function value_opts(c, opts)
  if type(opts) ~= "table" then
    argerror(1, "value", "options table like { max_age = 5 } expected, got "
          .. type(opts), 2)
  end
  local max_age, now = opts.max_age, opts.now
  if type(max_age) ~= "number" or max_age ~= max_age or max_age < 0 then
    argerror(1, "value", "max_age must be a number of seconds >= 0, got "
          .. printable(tostring(max_age)), 2)
  end
  if now ~= nil and (type(now) ~= "number" or now ~= now) then
    argerror(1, "value", "now must be a time in seconds, got " .. printable(tostring(now)), 2)
  end
  local r = c:rolled()
  if r then
    now = now or clock_of(c:store())
    if now - r.at <= max_age then return r.value, "rolled" end
  end
  local v, err, code = exact_value(c)
  if v == nil then return nil, err, code end
  return v, "exact"
end

-- c:history(resolution) -> { { t = start, v = value }, ... } oldest first
local function history(c, res)
  check_self(c, "tally.counter", "history")
  return c:_history(parse_res(res))
end

-- c:keeps() -> { "60x1s", ... } the history this counter keeps, or nil
local UNIT_ORDER = { { "w", 604800 }, { "d", 86400 }, { "h", 3600 }, { "m", 60 }, { "s", 1 } }
local function keeps(c)
  check_self(c, "tally.counter", "keeps")
  local rings = c:_rings()
  if not rings then return nil end
  local out = {}
  for i, r in ipairs(rings) do
    for _, u in ipairs(UNIT_ORDER) do
      if r[1] % u[2] == 0 then
        out[i] = fmt("%dx%d%s", r[2], idiv(r[1], u[2]), u[1])
        break
      end
    end
  end
  return out
end

function _M.install(tally)
  local store, counter = core.store_methods, core.counter_methods
  store.rollup, store.tick, store.run, store.flush = rollup, tick, run, flush
  store.schedules, store.clock = schedules, clock
  store.flush_to = flush_to
  counter.history, counter.keeps = history, keeps
  core.set_value_opts(value_opts)
  tally.sink = sink
  tally.now = core.now
  tally.sleep = core.sleep
  tally.parse_keep = function(spec) return _M.parse_keep(spec, 2) end
end

return _M
