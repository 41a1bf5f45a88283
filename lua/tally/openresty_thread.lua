-- tally.openresty_thread: the part of tally.openresty's /metrics that runs
-- on one of nginx's thread pools (ngx.run_worker_thread), in a Lua VM of
-- the thread's own, so that the worker's event loop only sends the text.
--
-- Only a few ngx functions exist in such a VM (no ngx.log, ngx.sleep or
-- shared dicts), and nothing of the worker's VM: the store is opened
-- here, once per VM and store, and the worker's metric mappings
-- (db:mappings(), plain tables) come with each call and are set on that
-- handle when they differ from the last ones. The text goes into the
-- worker's parcel (tally.core.parcel), appended by its number.

local tally = require "tally"
local core = require "tally.core"
local prometheus = require "tally.prometheus"

local type, pairs, ipairs, pcall, tostring, concat, sort, fmt =
      type, pairs, ipairs, pcall, tostring, table.concat, table.sort, string.format

local _M = {}

-- The pool's thread stays out of the event loop's way: it runs at
-- niceness 10 (as tally serve does; this thread only: Linux keeps a
-- niceness per thread), and it enters the kernel at each of the scrape's
-- pauses (sched_yield, after every slice and chunk: about 0.1 ms): a
-- kernel with lazy preemption makes a woken worker wait for the next tick
-- (4 ms) while this thread computes in user space, whatever its priority
-- (on the 2-core VM, small requests' p99 during scrapes: 2.0 ms niced,
-- 3.7 ms at SCHED_IDLE, 1.2 ms with the yields). This VM runs on any of
-- the pool's threads (threads=N), so the niceness is set at each scrape,
-- on the thread that makes it.
local pause = nil
local nice = function() end
local ready = false
local function below_worker()
  ready = true
  local ok, ffi = pcall(require, "ffi")
  if not ok then return end
  pcall(ffi.cdef, "int setpriority(int which, unsigned who, int prio); int gettid(void);"
                  .. " int sched_yield(void);")
  local C = ffi.C
  if pcall(function() return C.setpriority, C.gettid end) then
    nice = function() pcall(C.setpriority, 0, C.gettid(), 10) end
  end
  if pcall(function() return C.sched_yield end) then pause = function() C.sched_yield() end end
end

-- One text for a list of mappings: equal lists, equal texts, and unequal
-- ones unequal (each value with its type and length; numbers to 17
-- digits, which tell every double apart).
local function key_of(mappings)
  local parts = {}
  local function put(v)
    if type(v) ~= "table" then
      local t = type(v) == "number" and fmt("%.17g", v) or tostring(v)
      parts[#parts + 1] = type(v) .. #t .. ":" .. t
      return
    end
    local keys = {}
    for k in pairs(v) do keys[#keys + 1] = k end
    sort(keys, function(a, b) return type(a) .. tostring(a) < type(b) .. tostring(b) end)
    parts[#parts + 1] = "{"
    for _, k in ipairs(keys) do
      put(k)
      put(v[k])
    end
    parts[#parts + 1] = "}"
  end
  put(mappings)
  return concat(parts)
end

_M._key_of = key_of   -- for spec/unit/openresty_thread_spec.lua

local open = {}   -- store spec -> { db =, key = its mappings' key }

local function store_of(spec, trust, mappings)
  local key = key_of(mappings)
  local e = open[spec]
  if e and e.key == key then return e.db end
  if e then e.db:close(); open[spec] = nil end
  local db, msg = tally.open(spec, { create = false, trust = trust or nil })
  if not db then return nil, msg end
  for _, m in ipairs(mappings) do
    -- a histogram family without a metric comes with labels = {}, which
    -- db:family refuses without a metric
    local opts = m
    if m.metric == nil then
      opts = { type = m.type, histogram = m.histogram }
    end
    local ok, err = pcall(prometheus.map_only, db, m.pattern, opts)
    if not ok then
      db:close()
      return nil, "the mapping of '" .. tostring(m.pattern) .. "': " .. tostring(err)
    end
  end
  open[spec] = { db = db, key = key }
  return db
end

-- scrape(spec, trust, mappings, pattern, parcel) -> true, or nil, message:
-- the Prometheus text of the counters of store spec matching pattern (nil:
-- all), as tally.prometheus makes it with those mappings, into the parcel
-- numbered parcel.
function _M.scrape(spec, trust, mappings, pattern, parcel)
  if not ready then below_worker() end
  nice()
  local db, msg = store_of(spec, trust, mappings)
  if not db then return nil, msg end
  local add = core.parcel_add
  local ok, done, err = pcall(tally.prometheus, db, pattern,
                              { write = function(piece) add(parcel, piece) end, pause = pause })
  if not ok then return nil, tostring(done) end
  if not done then return nil, tostring(err) end
  return true
end

return _M
