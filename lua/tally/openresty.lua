-- tally.openresty: tally inside nginx with the Lua module (OpenResty, or
-- Debian's nginx + libnginx-mod-http-lua), under LuaJIT.
--
--   init_worker_by_lua_block {
--     require("tally.openresty").init_worker {
--       store    = "file:data/tally.tly",   -- relative paths: to the nginx prefix (-p)
--       families = { { "http:*", metric = "http_requests_total", labels = { "path" },
--                      type = "counter" } },
--       rollups  = { { "http:*", every = 10, keep = { "60x10s", "48x1h" } } },
--     }
--   }
--   access_by_lua_block { require("tally.openresty").incr("http:" .. ngx.var.uri) }
--   log_by_lua_block { require("tally.openresty").observe_latency("http_request_duration_seconds") }
--   location = /metrics { content_by_lua_block { require("tally.openresty").metrics() } }
--
-- How it works. Every worker opens the file store itself in init_worker
-- (a store opened in init_by_lua would be mapped by the master and
-- inherited by every worker; it is refused here), so each worker is one
-- writer of the `thread` policy and keeps to its own shard of every
-- counter. Increments go straight into the shared file mapping: once
-- incr() returns, the count is in the file, whatever happens to the
-- worker next (a reload, a crash, SIGKILL). Every worker runs db:tick()
-- from ngx.timer.every; the store's rollup lease makes exactly one of them
-- roll up each period (the others see the period done, or the lease busy).
-- On shutdown (a reload's old workers, or a stop) the timer fires once
-- prematurely and stops; the store is left to the process exit, since
-- requests still being served keep counting into it.
--
-- Runs under LuaJIT (Lua 5.1 syntax) and Lua 5.4.

local tally = require "tally"
local core = require "tally.core"
local huge = math.huge

local type, error, pairs, ipairs, next, pcall, tostring =
      type, error, pairs, ipairs, next, pcall, tostring
local fmt, sub, find = string.format, string.sub, string.find

local ngx = ngx  -- nil outside nginx: init_worker says so

local argerror, printable = require("tally.util").argerror, require("tally.util").printable

local _M = { _VERSION = tally.version }

-- This worker's state. db is nil until init_worker succeeds; reason says
-- why when it failed.
local st = {
  db = nil,
  reason = "init_worker was not called in this worker",
  store = nil,          -- the spec as opened (relative path resolved)
  tick_every = nil,     -- seconds between ticks, or nil (no timer)
  ticks = 0,            -- timer runs that ticked
  tick_errors = 0,      -- ticks that raised
  last_tick_error = nil,
  on_tick = nil,
  flush_on_exit = 0.2,
  exited = false,       -- the timer saw the worker exiting
  flush_timer = false,  -- the timer that flushes buffered histograms runs
  thread_pool = nil,    -- where /metrics makes its text (init_worker's thread_pool)
  trust = nil,          -- open.trust, for the thread's own handle
}

-- lua_code_cache off: every request runs in a Lua VM of its own, which
-- loads this module afresh, without the store init_worker opened in the
-- worker's own VM (whose timers still tick). init_worker marks the worker
-- process in tally.core (one copy per process, shared by its VMs; workers
-- are forked by the master, which never marks), so such a VM says why it
-- has no store, and logs it once per worker (the mark's sign).
if ngx and ngx.get_phase() ~= "init" and ngx.worker and ngx.worker.pid then
  local pid, mark = ngx.worker.pid(), core._process_mark()
  if mark == pid or mark == -pid then
    st.reason = "init_worker opened the store in this worker's own Lua VM, but this code runs in"
                .. " another one: with lua_code_cache off every request has a VM of its own;"
                .. " tally.openresty needs lua_code_cache on"
    if mark == pid then
      core._process_mark(-pid)
      ngx.log(ngx.ERR, "tally.openresty: ", st.reason, "; counting is off in requests")
    end
  end
end

-- Sink -> what its stats were at the last tick, and when its failure was
-- last logged (weak keys).
local sink_seen = setmetatable({}, { __mode = "k" })
local SINK_LOG_EVERY = 60   -- seconds between two logs of one failing sink

local function log(level, ...)
  if ngx then ngx.log(level, "tally.openresty: ", ...) end
end

-- Failures that go on (a rollup or the upkeep on a full disk, a
-- flush of buffered histograms with a member dropped): what failed ->
-- { at = when last logged, n = failures since }. Each is logged when it
-- starts, then at most every SINK_LOG_EVERY seconds while it lasts (a
-- tick comes up to twice a second in every worker, a flush every second),
-- and once when it works again.
local failing = {}
local UPKEEP, HISTOGRAMS = "upkeep (expiry, space reuse)", "flushing buffered histograms"
local function time_now() return ngx and ngx.now() or 0 end
local function failed_again(key, level, msg, now)
  local f = failing[key]
  if not f then
    log(level, msg)
    failing[key] = { at = now, n = 0 }
  elseif now - f.at >= SINK_LOG_EVERY then
    log(level, msg, " (", f.n, " more failures since it was last logged)")
    f.at, f.n = now, 0
  else
    f.n = f.n + 1
  end
end
local function works_again(key)
  if failing[key] then
    failing[key] = nil
    log(ngx and ngx.NOTICE, key == "tick" and "ticks" or key, " no longer failing")
  end
end

-- A path relative to the nginx prefix (what nginx does with relative
-- paths in its own directives); absolute paths are returned as they are.
function _M.path(p)
  if type(p) ~= "string" or p == "" then
    argerror(1, "path", "non-empty string expected, got " .. type(p), 2)
  end
  if sub(p, 1, 1) == "/" or not ngx then return p end
  local prefix = ngx.config.prefix()
  if sub(prefix, -1) ~= "/" then prefix = prefix .. "/" end
  return prefix .. p
end

-- Split { "pattern", k = v, ... } into pattern, { k = v, ... }.
local function split_entry(what, i, e)
  if type(e) ~= "table" or type(e[1]) ~= "string" then
    error(fmt("bad %s entry #%d (table like { \"pattern\", ... } expected, got %s)",
              what, i, type(e) == "table" and "a table without a pattern string first" or type(e)), 4)
  end
  local opts = {}
  for k, v in pairs(e) do
    if k ~= 1 then
      if type(k) == "number" then
        error(fmt("bad %s entry #%d (only the pattern goes at position 1; options are named)", what, i), 4)
      end
      opts[k] = v
    end
  end
  return e[1], opts
end

local function check_opts(opts)
  if type(opts) ~= "table" then
    argerror(1, "init_worker", "options table expected, got " .. type(opts), 3)
  end
  local known = { store = true, open = true, families = true, rollups = true, tick = true,
                  on_tick = true, flush_on_exit = true, thread_pool = true }
  for k in pairs(opts) do
    if not known[k] then
      argerror(1, "init_worker", "unknown option '" .. printable(tostring(k))
               .. "'; expected store, open, families, rollups, tick, on_tick, flush_on_exit,"
               .. " thread_pool", 3)
    end
  end
  local pool = opts.thread_pool
  if pool ~= nil and (type(pool) ~= "string" or pool == "") then
    argerror(1, "init_worker", "thread_pool must be the name of a thread_pool (nginx.conf),"
             .. " got " .. (type(pool) == "string" and "''" or type(pool)), 3)
  end
  local spec = opts.store
  if type(spec) ~= "string" or sub(spec, 1, 5) ~= "file:" or #spec == 5 then
    argerror(1, "init_worker", "store must be \"file:PATH\", got "
             .. (type(spec) == "string" and "'" .. printable(spec) .. "'" or type(spec))
             .. "; a memory store would be private to each worker", 3)
  end
  for _, k in ipairs({ "open", "families", "rollups" }) do
    if opts[k] ~= nil and type(opts[k]) ~= "table" then
      argerror(1, "init_worker", k .. " must be a table, got " .. type(opts[k]), 3)
    end
  end
  local t = opts.tick
  if t ~= nil and t ~= false and (type(t) ~= "number" or t ~= t or t < 0.001 or t > 3600) then
    argerror(1, "init_worker", "tick must be seconds from 0.001 to 3600, or false, got "
          .. printable(tostring(t)), 3)
  end
  if opts.on_tick ~= nil and type(opts.on_tick) ~= "function" then
    argerror(1, "init_worker", "on_tick must be a function, got " .. type(opts.on_tick), 3)
  end
  local f = opts.flush_on_exit
  if f ~= nil and (type(f) ~= "number" or f ~= f or f < 0) then
    argerror(1, "init_worker", "flush_on_exit must be seconds >= 0, got " .. printable(tostring(f)), 3)
  end
end

-- What one of db:tick()'s results is about, as its failure is logged and
-- kept in `failing`: the upkeep, the buffered histograms, a flush schedule
-- (db:flush_to: Redis, Firestore; its result carries flush = the URI,
-- redacted) or a rollup. A flush and a rollup of one pattern and period
-- are two things: each fails and recovers on its own.
local function result_key(r)
  if r.upkeep then return UPKEEP end
  if r.histograms then return HISTOGRAMS end
  if r.flush ~= nil then
    return fmt("flush of '%s' every %ss to '%s'", printable(tostring(r.pattern)), tostring(r.every),
               printable(tostring(r.flush)))
  end
  return fmt("rollup '%s' every %ss", printable(tostring(r.pattern)), tostring(r.every))
end

-- Tick once now in this worker: db:tick() with the results logged
-- (ran: info, lost: warn, error: err, a rollup's, the upkeep's or a
-- flush's that goes on: once a minute; a sink that fails: err, at most
-- once a minute). Returns the results, or nil and the
-- message if the tick raised (also logged). Called by the timer.
function _M.tick()
  local db = st.db
  if not db then return nil, st.reason end
  if ngx then ngx.update_time() end  -- ngx.now() is cached per event loop turn
  local now = ngx and ngx.now() or 0
  local failed, worked = {}, {}   -- in this tick: what failed (-> message), what worked
  local ok, res = pcall(db.tick, db)
  if not ok then
    st.tick_errors = st.tick_errors + 1
    st.last_tick_error = tostring(res)
    failed["tick"] = "tick failed: " .. tostring(res)
  else
    st.ticks = st.ticks + 1
    worked["tick"] = true
    worked[UPKEEP], worked[HISTOGRAMS] = true, true   -- unless listed: they run every tick
    for _, r in ipairs(res) do
      local what = result_key(r)
      if r.status == "error" then
        failed[what], worked[what] = what .. " failed: " .. tostring(r.error), nil
      elseif r.status == "ran" or r.status == "lost" or r.status == "flushed" then
        worked[what] = true   -- (a flush's "backoff": still failing, not tried again yet)
      end
    end
  end
  for key, msg in pairs(failed) do failed_again(key, ngx and ngx.ERR, msg, now) end
  for key in pairs(worked) do works_again(key) end
  if not ok then return nil, tostring(res) end
  for _, r in ipairs(res) do
    if r.status == "lost" then
      log(ngx and ngx.WARN, "rollup '", printable(r.pattern), "' every ", r.every, "s: lost the lease in period ",
          tostring(r.period), " (this worker stalled; another finishes the period)")
    elseif r.status == "ran" then
      log(ngx and ngx.INFO, "rolled up '", printable(r.pattern), "' every ", r.every, "s, period ",
          tostring(r.period), ": ", tostring(r.counters), " counters")
    end
  end
  -- Sinks fail quietly (they keep the records, retry and count): log a
  -- failing sink when it starts failing, then at most every SINK_LOG_EVERY
  -- seconds while it goes on, and once when it delivers again.
  for _, sch in ipairs(db:schedules()) do
    for i, sk in ipairs(sch.sinks or {}) do
      local ok, ss = pcall(sk.stats, sk)
      if ok and type(ss) == "table" then
        local seen = sink_seen[sk]
        if not seen then
          seen = { failures = 0, dropped = 0, sent = 0, at = nil }
          sink_seen[sk] = seen
        end
        local f, d, sent = ss.failures or 0, ss.dropped or 0, ss.sent or 0
        local what = fmt("sink #%d of rollup '%s' every %ss", i, printable(sch.pattern), tostring(sch.every))
        if f > seen.failures or d > seen.dropped then
          if not seen.at or now - seen.at >= SINK_LOG_EVERY then
            log(ngx and ngx.ERR, what, ": ", tostring(ss.last_error), " (", f, " failures, ", d,
                " records dropped so far; ", ss.queued or 0, " queued)")
            seen.at = now
          end
        elseif seen.at and sent > seen.sent then
          log(ngx and ngx.NOTICE, what, ": delivering again (", sent, " records sent so far)")
          seen.at = nil
        end
        seen.failures, seen.dropped, seen.sent = f, d, sent
      end
    end
  end
  if st.on_tick and #res > 0 then
    local cok, err = pcall(st.on_tick, res)
    if not cok then log(ngx and ngx.ERR, "on_tick raised: ", tostring(err)) end
  end
  return res
end

-- This worker's histogram handles by name (db:histogram), and the names
-- whose opening failed (logged once; observations of them return nil, msg).
local hists, hist_failed = {}, {}

-- Add what this worker's buffered histograms hold to the store (each one
-- batch); a failure is logged, and the histogram keeps it for the next.
-- exiting: the worker stops (a reload, a stop): the requests it still
-- serves are observed without a buffer, since no timer flushes any more.
local function flush_histograms(exiting)
  for name, h in pairs(hists) do
    if h.buffer > 0 then
      local ok, msg
      if exiting then
        ok, msg = core.histogram_buffer(h.w, 0)      -- flushes first
        if ok then h.buffer = 0 end
      else
        ok, msg = h:flush()
      end
      local key = "flushing buffered histogram '" .. printable(name) .. "'"
      if ok then
        works_again(key)
      else            -- (the timer's every second, and every tick: logged once a minute)
        failed_again(key, ngx.WARN, key .. " failed: " .. tostring(msg), ngx.now())
      end
    end
  end
end

local function on_timer(premature)
  if premature or ngx.worker.exiting() then
    -- shutting down (reload or stop): the timer stops here. Give sinks a
    -- moment to deliver what this worker rolled up; the store stays open
    -- for the requests still being served.
    if not st.exited then
      st.exited = true
      flush_histograms(true)
      local db = st.db
      if db and st.flush_on_exit > 0 then
        local ok, fok, ferr = pcall(db.flush, db, st.flush_on_exit)
        if not ok or not fok then
          log(ngx.WARN, "at exit: ", tostring(ok and ferr or fok))
        end
      end
    end
    return
  end
  _M.tick()
end

-- The shortest `every` of the rollups, halved (so that no period is
-- missed between two ticks), at most 1 s.
local function default_tick(rollups)
  local t
  for _, r in ipairs(rollups) do
    local e = type(r) == "table" and r.every
    if type(e) == "number" and e > 0 and (not t or e / 2 < t) then t = e / 2 end
  end
  if not t then return nil end
  if t > 1 then t = 1 end
  if t < 0.001 then t = 0.001 end
  return t
end

-- init_worker(opts) -> db, or nil, message (also logged at error level)
-- From init_worker_by_lua*. Opens opts.store in this worker, defines
-- opts.families and opts.rollups on it, uses ngx.now as its clock and
-- starts a timer that ticks the rollups every opts.tick seconds (default:
-- half the shortest `every`, at most 1 s; false: no timer, call .tick()
-- yourself). Options:
--   store          "file:PATH"; a relative PATH is relative to the nginx prefix
--   open           options for tally.open ({ mode = 384 (0600), create = false })
--   families       { { "pattern", shards =, policy =, metric =, labels =, type =, help = }, ... }
--   rollups        { { "pattern", every =, keep =, sinks = }, ... }
--   tick           seconds between ticks, or false
--   on_tick        function(results), after each tick that did something
--   flush_on_exit  seconds a stopping worker waits for its sinks (default 0.2; 0: none):
--                  the worker's last requests wait that long at most
-- Misuse (bad options, called outside init_worker) raises; failures of the
-- environment (the store cannot be opened, ...) are logged and returned,
-- and counting stays off in this worker: incr() returns nil, message.
function _M.init_worker(opts)
  -- what counting says until this call succeeds, if it raises on the way
  if not st.db then st.reason = "init_worker raised (its error is in the error log)" end
  check_opts(opts)
  if not ngx then
    error("tally.openresty.init_worker: not inside nginx (no ngx table)", 2)
  end
  -- what tally can only log (counters /metrics leaves out) goes to the error log
  tally.logger(function(msg) ngx.log(ngx.WARN, msg) end)
  local phase = ngx.get_phase()
  if phase ~= "init_worker" then
    error("tally.openresty.init_worker must be called from init_worker_by_lua*, not "
          .. phase .. (phase == "init"
            and " (a store opened by the master would be inherited by every worker)" or ""), 2)
  end
  if st.db then
    error("tally.openresty.init_worker: already called in this worker", 2)
  end
  local pok, process = pcall(require, "ngx.process")
  if pok and process.type() == "helper" then
    return nil, "not a worker (cache helper process)"
  end
  local spec = "file:" .. _M.path(sub(opts.store, 6))
  st.store = spec
  local db, msg, code = tally.open(spec, opts.open)
  if not db then
    st.reason = fmt("cannot open %s: %s", printable(spec), tostring(msg))
    if find(tostring(msg), "ermission denied", 1, true) then
      st.reason = st.reason .. " (workers run as the user of nginx's `user` directive,"
                  .. " nobody by default when started as root: that user must be able to"
                  .. " read and write the file and create it in its directory)"
    end
    log(ngx.ERR, st.reason, "; counting is off in this worker")
    return nil, st.reason, code
  end
  db:clock(ngx.now)
  for i, e in ipairs(opts.families or {}) do
    local pattern, fopts = split_entry("families", i, e)
    local ok, fok, fmsg = pcall(db.family, db, pattern, fopts)
    if not ok then      -- misuse: say which entry
      db:close()
      error(fmt("tally.openresty.init_worker: families entry #%d ('%s'): %s", i, printable(pattern),
                tostring(fok)), 2)
    end
    if not fok then
      st.reason = fmt("family '%s' on %s: %s", printable(pattern), printable(spec), tostring(fmsg))
      log(ngx.ERR, st.reason, "; counting is off in this worker")
      db:close()
      return nil, st.reason
    end
  end
  local rollups = opts.rollups or {}
  for i, e in ipairs(rollups) do
    local pattern, ropts = split_entry("rollups", i, e)
    local ok, err = pcall(db.rollup, db, pattern, ropts)
    if not ok then
      db:close()
      error(fmt("tally.openresty.init_worker: rollups entry #%d ('%s'): %s", i, printable(pattern),
                tostring(err)), 2)
    end
  end
  st.db, st.reason = db, nil
  core._process_mark(ngx.worker.pid())
  st.on_tick = opts.on_tick
  st.thread_pool, st.trust = opts.thread_pool, opts.open and opts.open.trust and true or nil
  st.flush_on_exit = opts.flush_on_exit or 0.2
  local every = opts.tick
  if every == nil then every = default_tick(rollups) end
  if every then
    local ok, err = ngx.timer.every(every, on_timer)
    if not ok then
      log(ngx.ERR, "cannot start the rollup timer: ", tostring(err), "; rollups are off in this worker")
    else
      st.tick_every = every
    end
  end
  return db
end

-- db() -> this worker's store, or nil, message
function _M.db()
  local db = st.db
  if db then return db end
  return nil, "tally.openresty: no store in this worker (" .. st.reason .. ")"
end

-- incr(name [, n [, key]]) -> true, or nil, message [, code]
-- db:incr on this worker's store; counting a request never raises for a
-- store that could not be opened (init_worker logged why). A failure (a
-- full disk, a shard's range) is logged, at most once a minute.
function _M.incr(name, n, key)
  local db = st.db
  if db then
    -- not tail calls: a bad argument is then named as the caller passed
    -- it (#1 is the name), where a tail call made it "#2 to '?'"
    local ok, err, code
    if key == nil then
      ok, err, code = db:incr(name, n or 1)
    else
      ok, err, code = db:incr(name, n or 1, key)
    end
    if not ok then failed_again("counting", ngx and ngx.ERR, "counting failed: " .. tostring(err), time_now()) end
    return ok, err, code
  end
  return nil, "tally.openresty: no store in this worker (" .. st.reason .. ")"
end

-- counter(name [, opts]) -> this worker's handle to the counter (cache it
-- in a module-level local for the cheapest increments), or nil, message
function _M.counter(name, opts)
  local db = st.db
  if not db then return nil, "tally.openresty: no store in this worker (" .. st.reason .. ")" end
  return db:counter(name, opts)
end

-- Unless a tick timer (it flushes them: db:tick) runs at least as often,
-- buffered histograms are flushed by a timer of their own, every
-- FLUSH_EVERY seconds.
local FLUSH_EVERY = 1
local function on_flush_timer(premature)
  flush_histograms(premature or ngx.worker.exiting())
end

-- histogram(name [, opts]) -> this worker's handle to histogram name
-- (db:histogram, opened once per worker and kept), or nil, message [, code]
function _M.histogram(name, opts)
  local h = hists[name]
  if h then return h end
  local db = st.db
  if not db then return nil, "tally.openresty: no store in this worker (" .. st.reason .. ")" end
  local msg, code
  h, msg, code = db:histogram(name, opts)
  if not h then
    msg = "tally.openresty: histogram '" .. printable(tostring(name)) .. "': " .. tostring(msg)
    if not hist_failed[name] then
      hist_failed[name] = true
      log(ngx and ngx.ERR, msg)
    end
    return nil, msg, code
  end
  hists[name] = h
  -- (ticks flush them too, but may be far apart: tick up to 3600 s)
  if h.buffer > 0 and (st.tick_every or huge) > FLUSH_EVERY and not st.flush_timer then
    local ok, err = ngx.timer.every(FLUSH_EVERY, on_flush_timer)
    if ok then
      st.flush_timer = true
    else
      log(ngx.ERR, "cannot start the timer that flushes buffered histograms: ", tostring(err))
    end
  end
  return h
end

-- observe(name, v [, opts]) -> true, or nil, message [, code]: h:observe(v)
-- on this worker's histogram name (opened with opts the first time).
function _M.observe(name, v, opts)
  local h, msg, code = hists[name], nil, nil
  if not h then
    h, msg, code = _M.histogram(name, opts)
    if not h then return nil, msg, code end
  end
  local ok, err, ecode = h:observe(v)
  if not ok then failed_again("observing", ngx and ngx.ERR, "observing failed: " .. tostring(err), time_now()) end
  return ok, err, ecode
end

-- observe_latency(name [, opts]) -> true, or nil, message [, code]: in
-- log_by_lua, the request's time so far (ngx.now() - ngx.req.start_time(),
-- seconds, to nginx's cached millisecond clock) into histogram name.
function _M.observe_latency(name, opts)
  local t = ngx.now() - ngx.req.start_time()
  if t < 0 then t = 0 end
  return _M.observe(name, t, opts)
end

local PROM_TYPE = "text/plain; version=0.0.4; charset=utf-8"

local function fail(status, msg)
  log(ngx.ERR, msg)
  ngx.status = status
  ngx.header["Content-Type"] = "text/plain; charset=utf-8"
  ngx.say(msg)
  return ngx.exit(status)
end

-- Phases where ngx.sleep may yield to nginx's event loop. It sleeps 1 ms,
-- not 0: without OpenResty's delayed-events patch (Debian's nginx) a
-- sleep of 0 resumes before nginx looks at its sockets, and logs a warning.
local YIELDS = { content = true, access = true, rewrite = true, timer = true }

-- A scrape's pause: it yields once STEP seconds of work (the process's
-- CPU time: a clock that never steps back, and leaves out the time spent
-- waiting for the client in ngx.flush) have passed since it last did.
-- tally.prometheus pauses after every slice of the index and chunk of
-- lines it makes (about 0.1 ms each on the 2-core VM); a sleep at each
-- would make a scrape of a million counters last ten times its work, and
-- a step much longer than a small request's time shows in their latency
-- while the scrape runs (its p99, bench-openresty).
local STEP = 0.0003
local cpu = os.clock
local function yielder()
  local last = cpu()
  return function()
    if cpu() - last >= STEP then
      ngx.sleep(0.001)
      last = cpu()
    end
  end
end
_M._yielder = yielder -- for spec/unit/openresty_pause_spec.lua

-- A scrape's piece to the client, flushed (ngx.flush(true) yields while
-- the client has not taken what was sent): raises if the client is gone.
local function send(piece)
  local ok, err = ngx.print(piece)
  if ok then ok, err = ngx.flush(true) end
  if not ok then error("sending to the client: " .. tostring(err), 0) end
end

-- A scrape made on the thread pool st.thread_pool (tally.openresty_thread,
-- in a Lua VM of its own, with this worker's mappings) into a parcel this
-- request owns (freed here, or when collected if nginx drops the request
-- while the thread works), then sent a piece at a time, yielding as a
-- scrape made here does: the worker's event loop spends on it only the
-- copies. Returns as pcall(tally.prometheus) does. The thread's handle
-- has none of this worker's histogram writers, so what they buffer goes
-- in here first, as tally.prometheus does with db.
local function threaded(db, pattern)
  local fok, fmsg = core.histograms_flush(db)
  if not fok then log(ngx.WARN, "prometheus: buffered histograms not flushed: ", tostring(fmsg)) end
  local parcel = core.parcel()
  local tok, ok, err = ngx.run_worker_thread(st.thread_pool, "tally.openresty_thread", "scrape",
                                             st.store, st.trust, db:mappings(), pattern,
                                             parcel:id())
  if not tok or not ok then
    parcel:free()
    return true, nil, (tok and "" or "on thread pool '" .. st.thread_pool .. "': ")
                      .. tostring(tok and err or ok)
  end
  ngx.header["Content-Type"] = PROM_TYPE
  local pause = yielder()
  local sok, serr = pcall(function()
    local piece = parcel:take()
    while piece do
      send(piece)
      pause()
      piece = parcel:take()
    end
  end)
  parcel:free()
  if sok then return true, true end
  return false, serr
end

-- metrics([pattern]): content handler writing the exact values of the
-- matching counters (default: all) in Prometheus text format 0.0.4, with
-- the families' metric mappings and histograms as Prometheus histograms;
-- 503 if this worker has no store, 500 if rendering fails before anything
-- was sent (both logged). The text is sent as it is made (tally.prometheus'
-- write), and the scrape yields to nginx (ngx.sleep(0.001)) after every
-- 0.3 ms of its work and while the client reads, so that a worker
-- scraping a large store goes on serving its other requests meanwhile;
-- with init_worker's thread_pool the text is made on that pool instead.
-- A failure once the text has begun is logged and the connection closed,
-- so the scraper sees a cut response, never a short one that looks whole.
function _M.metrics(pattern)
  local db = st.db
  if not db then return fail(503, "tally.openresty: no store in this worker (" .. st.reason .. ")") end
  if not YIELDS[ngx.get_phase()] then   -- no yield here: the whole text at once
    local ok, text, err = pcall(tally.prometheus, db, pattern)
    if not ok or not text then
      return fail(500, "tally.openresty: /metrics: " .. tostring(ok and err or text))
    end
    ngx.header["Content-Type"] = PROM_TYPE
    ngx.print(text)
    return ngx.exit(200)
  end
  local ok, done, err
  if st.thread_pool and ngx.get_phase() ~= "timer" then
    ok, done, err = threaded(db, pattern)
  else
    ngx.header["Content-Type"] = PROM_TYPE
    ok, done, err = pcall(tally.prometheus, db, pattern, { pause = yielder(), write = send })
  end
  if ok and done then return ngx.exit(200) end
  local msg = "tally.openresty: /metrics: " .. tostring(ok and err or done)
  if not ngx.headers_sent then return fail(500, msg) end
  log(ngx.ERR, msg, " (the scrape was cut short)")
  return ngx.exit(ngx.ERROR)
end

-- stats() -> this worker's view: { pid =, worker =, store =, tick =,
-- ticks =, tick_errors =, last_tick_error =, counters =, file_bytes =,
-- schedules = { { pattern =, every =, runs =, counters =, busy =, lost =,
-- errors =, last_error =, last_period =, sinks = { sink:stats(), ... } },
-- ... } }; error = why there is no store.
function _M.stats()
  local out = {
    pid = ngx and ngx.worker.pid(), worker = ngx and ngx.worker.id(),
    store = st.store, tick = st.tick_every, ticks = st.ticks,
    tick_errors = st.tick_errors, last_tick_error = st.last_tick_error,
    ffi = tally.ffi, ffi_reason = require("tally.ffi").reason,  -- the hot path in use
    schedules = {},
  }
  local db = st.db
  if not db then
    out.error = st.reason
    return out
  end
  local s = db:stats()
  if s then out.counters, out.file_bytes = s.counters, s.file_bytes end
  for i, sch in ipairs(db:schedules()) do
    local x = sch:stats()
    out.schedules[i] = {
      pattern = x.pattern, every = x.every, runs = x.runs, counters = x.counters,
      busy = x.busy, lost = x.lost, errors = x.errors, last_error = x.last_error,
      last_period = x.last_period, sinks = x.sinks,
    }
  end
  return out
end

-- status(): content handler writing stats() as JSON (tally.json, as the
-- exports write names: a string that is not UTF-8, a pattern say, has its
-- other bytes as \udcXX; lua-cjson wrote them raw, which is not JSON);
-- schedules and sinks are arrays, [] when empty. 503 without a store (the
-- body says why); 500, logged, if a sink's stats hold what JSON cannot.
function _M.status()
  local json = require "tally.json"
  local s = _M.stats()
  if #s.schedules == 0 then s.schedules = json.empty_array end
  for _, x in ipairs(s.schedules) do
    if type(x.sinks) == "table" and next(x.sinks) == nil then x.sinks = json.empty_array end
  end
  local body, err = json.encode(s)
  if not body then return fail(500, "tally.openresty: status: cannot encode: " .. err) end
  ngx.status = s.error and 503 or 200
  ngx.header["Content-Type"] = "application/json"
  ngx.say(body)
  return ngx.exit(ngx.status)
end


-- dashboard(): content handler for a location ending in '/' (say
-- `location /tally/dashboard/`) that serves tally.dashboard there: the
-- page at the location itself, its script (dashboard.js), Chart.js
-- (chart.js, read from Debian's libjs-chart.js) and the JSON API
-- (api/stats, api/top, ...), read through this worker's store handle, as
-- `tally serve` answers them. An answer is kept half a second per worker,
-- so pages open at once cost one walk; each walk (db:top, db:values,
-- db:stats) runs in the worker, so over a large store `tally serve`, a
-- process of its own, is the better host. 503 without a store; 404 for
-- another path; 400 for a bad query, with its message.
local dash_cache = {}   -- key -> { at =, body = }
local chartjs            -- Chart.js, read once per worker

function _M.dashboard()
  local dashboard = require "tally.dashboard"
  local uri = ngx.var.uri
  local function send(status, ctype, body)
    ngx.status = status
    ngx.header["Content-Type"] = ctype
    ngx.print(body)
    return ngx.exit(status)
  end
  local function text(status, msg) return send(status, "text/plain; charset=utf-8", msg .. "\n") end
  if sub(uri, -1) == "/" then
    return send(200, "text/html; charset=utf-8", dashboard.html)
  elseif sub(uri, -13) == "/dashboard.js" then
    return send(200, "text/javascript; charset=utf-8", dashboard.js)
  elseif sub(uri, -9) == "/chart.js" then
    if not chartjs then
      local f = io.open(dashboard.CHARTJS, "rb")
      if not f then return text(404, dashboard.CHARTJS .. " is missing: install Debian's libjs-chart.js") end
      chartjs = f:read("*a")
      f:close()
    end
    ngx.header["Cache-Control"] = "max-age=3600"
    return send(200, "text/javascript; charset=utf-8", chartjs)
  end
  local name = uri:match("/api/(%a+)$")
  if not name then return text(404, "no such path: " .. printable(uri)) end
  local db = st.db
  if not db then return text(503, "tally.openresty: no store in this worker (" .. st.reason .. ")") end
  local args = ngx.req.get_uri_args(100)
  local key = dashboard.answer_key(name, args)
  local now = ngx.now()
  local hit = dash_cache[key]
  if hit and now - hit.at < 0.5 then
    return send(200, "application/json; charset=utf-8", hit.body)
  end
  local status, res = dashboard.api(db, name, args, { store = st.store })
  if status ~= 200 then return text(status, res) end
  local body, err = require("tally.json").encode(res)
  if not body then return text(500, "tally.openresty: dashboard: cannot encode: " .. tostring(err)) end
  if not hit then
    local n = 0
    for _ in pairs(dash_cache) do n = n + 1 end
    if n >= 64 then dash_cache = {} end
  end
  dash_cache[key] = { at = now, body = body }
  return send(200, "application/json; charset=utf-8", body)
end

return _M
