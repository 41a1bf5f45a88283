-- tally.openresty in a real nginx (Debian's nginx-light with the Lua
-- module, LuaJIT), 2 workers, running examples/openresty/nginx.conf with
-- its port and rollup period substituted: exact counts under concurrent
-- requests, a reload and a worker killed mid-burst, /metrics, and rollups
-- made once per period while both workers tick. The store file is read
-- back here, by the Lua 5.4 build of tally.
local helper = require "spec.support.helper"
local peers = require "spec.support.peers"
local nginx = require "spec.support.nginx"
local tally = require "tally"
local cjson = require "cjson"
local json = require "tally.json"

local function store_of(srv)
  return assert(tally.open("file:" .. srv.dir .. "/data/tally.tly", { create = false }))
end

-- Wait (bounded) until curl has written some results: the burst is under way.
local function under_way(b)
  return nginx.eventually(function()
    local f = io.open(b.out, "rb")
    local size = f and f:seek("end") or 0
    if f then f:close() end
    return size > 0 or b.done()
  end, 10)
end

-- { [labels text] = value } of one metric in exposition text.
local function series(text, metric)
  local out = {}
  for labels, v in text:gmatch("\n" .. metric .. "(%b{}) (%-?%d+)") do out[labels] = tonumber(v) end
  return out
end

-- GET path on new connections until n different workers answered (bounded).
local function from_workers(srv, path, n)
  local got, count = {}, 0
  for _ = 1, 200 do
    local status, body = nginx.get(srv.url .. path, { close = true })
    assert.equal(200, status, body)
    local s = cjson.decode(body)
    if not got[s.pid] then
      got[s.pid] = s
      count = count + 1
      if count == n then break end
    end
  end
  return got, count
end

describe("tally.openresty outside nginx", function()
  local openresty = require "tally.openresty"

  it("checks its options before anything else", function()
    local iw = openresty.init_worker
    assert.equal("bad argument #1 to 'init_worker' (options table expected, got nil)", helper.err(iw))
    assert.equal("bad argument #1 to 'init_worker' (store must be \"file:PATH\", got 'memory';"
                 .. " a memory store would be private to each worker)", helper.err(iw, { store = "memory" }))
    assert.equal("bad argument #1 to 'init_worker' (unknown option 'ticks'; expected store, open,"
                 .. " families, rollups, tick, on_tick, flush_on_exit, thread_pool)",
                 helper.err(iw, { store = "file:x.tly", ticks = 1 }))
    assert.equal("bad argument #1 to 'init_worker' (thread_pool must be the name of a thread_pool"
                 .. " (nginx.conf), got '')", helper.err(iw, { store = "file:x.tly", thread_pool = "" }))
    assert.equal("bad argument #1 to 'init_worker' (thread_pool must be the name of a thread_pool"
                 .. " (nginx.conf), got number)", helper.err(iw, { store = "file:x.tly", thread_pool = 1 }))
    assert.equal("bad argument #1 to 'init_worker' (tick must be seconds from 0.001 to 3600, or false, got 0)",
                 helper.err(iw, { store = "file:x.tly", tick = 0 }))
    assert.equal("bad argument #1 to 'init_worker' (families must be a table, got string)",
                 helper.err(iw, { store = "file:x.tly", families = "http:*" }))
    assert.equal("tally.openresty.init_worker: not inside nginx (no ngx table)",
                 helper.err(iw, { store = "file:x.tly" }))
    -- counting then says init_worker raised, not that it was never called
    assert.same({ nil, "tally.openresty: no store in this worker (init_worker raised (its error is "
                       .. "in the error log))" }, { openresty.incr("a") })
  end)

  it("counts nothing, and says why, until init_worker has opened the store", function()
    local ok, msg = openresty.incr("a")   -- (after the spec above: it raised)
    assert.is_nil(ok)
    assert.matches("^tally.openresty: no store in this worker %(init_worker ", msg)
    assert.is_nil((openresty.db()))
    assert.equal("/abs/path", openresty.path("/abs/path"))
  end)

  -- A flush schedule's result (db:flush_to, tally.redis.flush and
  -- tally.firestore.flush: { flush = URI, pattern =, every =, status = }) is
  -- logged as that flush, not as a rollup; "flushed" is its recovery; and
  -- a rollup of the same pattern and period neither clears nor shares its
  -- failure. A fresh copy of the module under a stub ngx, with db:tick()
  -- answering what each step sets.
  it("logs a flush that fails as that flush, apart from a rollup of its pattern", function()
    local core = require "tally.core"
    local clock, logged = 1000, {}
    local levels = { [4] = "err", [5] = "warn", [6] = "notice", [7] = "info" }
    local stub = {
      ERR = 4, WARN = 5, NOTICE = 6, INFO = 7,
      get_phase = function() return "init_worker" end,
      now = function() return clock end, update_time = function() end,
      worker = { pid = function() return 424242 end, exiting = function() return false end },
      log = function(level, ...) logged[#logged + 1] = levels[level] .. " " .. table.concat({ ... }) end,
    }
    local methods = core.store_methods
    local old_mod, old_ngx, old_tick = package.loaded["tally.openresty"], rawget(_G, "ngx"), methods.tick
    local old_logger, old_mark = tally.logger(), core._process_mark()
    local answer, db
    finally(function()
      methods.tick = old_tick
      if db then db:close() end
      core._process_mark(old_mark)
      tally.logger(old_logger)
      _G.ngx, package.loaded["tally.openresty"] = old_ngx, old_mod
    end)
    _G.ngx, package.loaded["tally.openresty"] = stub, nil
    local fresh = require "tally.openresty"
    db = assert(fresh.init_worker({ store = "file:" .. helper.tmpfile(), tick = false }))
    methods.tick = function() return answer end
    local function flush(status, err)
      return { flush = "redis://127.0.0.1:6390/0", pattern = "http:*", every = 10, status = status,
               period = 100, error = err, flushed = status == "flushed" and 3 or nil }
    end
    local rollup = { pattern = "http:*", every = 10, status = "ran", period = 100, counters = 2 }
    local function step(results, dt)
      clock, answer = clock + (dt or 1), results
      for i = #logged, 1, -1 do logged[i] = nil end
      assert(fresh.tick())
      local out = {}
      for i, l in ipairs(logged) do out[i] = l end
      return out
    end
    local what = "flush of 'http:*' every 10s to 'redis://127.0.0.1:6390/0'"
    local failed = "err tally.openresty: " .. what .. " failed: connection refused"
    assert.same({ failed }, step({ flush("error", "connection refused") }))
    -- the rollup of the same pattern and period runs: the flush still fails
    assert.same({ "info tally.openresty: rolled up 'http:*' every 10s, period 100: 2 counters" },
                step({ rollup }))
    assert.same({}, step({ flush("error", "connection refused") }))
    assert.same({}, step({ flush("backoff", "connection refused") }))     -- (Firestore's, waiting: not counted)
    assert.same({ failed .. " (1 more failures since it was last logged)" },
                step({ flush("error", "connection refused") }, 60))
    assert.same({ "notice tally.openresty: " .. what .. " no longer failing" }, step({ flush("flushed") }))
    assert.same({}, step({ flush("flushed") }))
    assert.same({ failed }, step({ flush("error", "connection refused") }))   -- a new failure
  end)
end)

describe("tally.openresty in nginx, 2 workers", function()
  local srv

  after_each(function()
    if srv then
      srv.stop()
      srv = nil
    end
  end)

  it("counts every request of a concurrent burst exactly, in counters that size themselves", function()
    srv = nginx.start { conf = nginx.example { every = 1 } }
    -- a burst that one worker happened to take whole (a loaded machine:
    -- it failed so once under ASan in CI) is followed by another, at most 3
    local bursts, seen = 0, {}
    repeat
      local r = nginx.burst(srv.url .. "/page/[1-100]?r=[1-100]", { parallel = 32 }).wait()
      assert.equal(10000, r.n, r.err)
      assert.same({ [200] = 10000 }, r.codes)
      for pid in pairs(r.workers) do seen[pid] = true end
      bursts = bursts + 1
    until #nginx.keys(seen) >= 2 or bursts == 3
    assert.equal(2, #nginx.keys(seen))                -- both workers answered

    local db = store_of(srv)
    local sum, count = db:sum("http:*")
    assert.equal(10000 * bursts, sum)
    assert.equal(100, count)
    for _, name in ipairs(db:names("http:*")) do
      assert.equal(100 * bursts, db:value(name))
      -- automatic shards: 100 requests from 2 workers are no contention, so
      -- each counter stays one cell (spec/integration/procs_spec.lua and
      -- tests/test_autoshard.c make them grow)
      local info = db:counter(name):info()
      assert.is_true(info.auto)
      assert.equal(1, info.shards)
    end

    -- /metrics: Prometheus text with the mapped labels, the same totals
    local status, text, headers = nginx.get(srv.url .. "/metrics")
    assert.equal(200, status, text)
    assert.equal("text/plain; version=0.0.4; charset=utf-8", headers["content-type"])
    local ok, code, out = peers.check_metrics(text)
    assert(ok, ("promtool check metrics failed (%s):\n%s\n%s"):format(code, out, text))
    assert.matches("# TYPE http_requests_total counter", text, 1, true)
    local reqs, total = series(text, "http_requests_total"), 0
    for _, v in pairs(reqs) do total = total + v end
    assert.equal(10000 * bursts, total)
    assert.equal(100 * bursts, reqs['{path="/page/7"}'])
    assert.equal(100, #nginx.keys(reqs))
    -- responses by status are counted in the log phase, just after each response
    assert.is_truthy(nginx.eventually(function()
      return (db:value("status:200") or 0) >= 10000 * bursts
    end, 5))
    db:close()
    assert.same({}, srv.errors())
  end)

  it("observes every request's latency into one histogram, consistent in every worker's /metrics", function()
    srv = nginx.start { conf = nginx.example { every = 1 } }
    local m = "http_request_duration_seconds"
    local b = nginx.burst(srv.url .. "/page/[1-50]?r=[1-100]", { parallel = 32 })
    -- scrapes while the burst runs, from both workers: each one is a cut in
    -- which the +Inf bucket is the count and the buckets never go down
    local scrapes = 0
    while not b.done() and scrapes < 200 do
      local status, text = nginx.get(srv.url .. "/metrics", { close = true })
      assert.equal(200, status, text)
      local buckets, prev = {}, -1
      for le, v in text:gmatch("\n" .. m .. '_bucket{le="([^"]+)"} (%d+)') do
        v = tonumber(v)
        assert.is_true(v >= prev, text)
        prev = v
        buckets[le] = v
      end
      local count = tonumber(text:match("\n" .. m .. "_count (%d+)"))
      assert.equal(buckets["+Inf"], count, text)
      assert.matches("\n" .. m .. "_sum [%d.e+-]+\n", text)
      scrapes = scrapes + 1
    end
    local r = b.wait()
    assert.same({ [200] = 5000 }, r.codes)
    -- every request (pages, scrapes) was observed once, in the log phase
    -- right after its status was counted
    local db = store_of(srv)
    local h = assert(db:histogram(m))
    assert.is_truthy(nginx.eventually(function()
      return h:snapshot().count == db:sum("status:*")
    end, 5), "histogram count " .. h:snapshot().count .. ", responses " .. db:sum("status:*"))
    assert.is_true(h:snapshot().count >= 5000 + scrapes)
    local status, text = nginx.get(srv.url .. "/metrics")
    assert.equal(200, status)
    local ok, code, out = peers.check_metrics(text)
    assert(ok, ("promtool check metrics failed (%s):\n%s\n%s"):format(code, out, text))
    assert.matches("# TYPE " .. m .. " histogram", text, 1, true)
    db:close()
    assert.same({}, srv.errors())
  end)

  it("observes latency by route into a histogram family: its buckets, one metric, labels", function()
    local conf, n1, n2 = nginx.example { every = 1 }, 0, 0
    conf, n1 = conf:gsub('help = "Responses by status code" },', '%0\n'
      .. '{ "lat:*", histogram = { buckets = { 0.005, 0.05, 0.5 } },'
      .. ' metric = "http_request_duration_seconds", labels = { "route" },'
      .. ' help = "Request latency by route" },', 1)
    conf, n2 = conf:gsub('observe_latency%("http_request_duration_seconds"%)',
      'observe_latency("lat:" .. (ngx.var.uri:find("^/page/") and "/page"'
      .. ' or ngx.var.uri == "/metrics" and "/metrics" or "other"))', 1)
    local n3
    conf, n3 = conf:gsub("\n        location = /metrics {", [[

        location = /bad {
            content_by_lua_block {
                local incr = require("tally.openresty").incr
                for _, args in ipairs({ { 42 }, { "" }, { "ok:name", "x" } }) do
                    ngx.say(select(2, pcall(incr, unpack(args))))
                end
            }
        }
%0]], 1)
    assert.same({ 1, 1, 1 }, { n1, n2, n3 })
    srv = nginx.start { conf = conf }
    -- openresty.incr names a bad argument as its caller passed it
    local status, body = nginx.get(srv.url .. "/bad")
    assert.equal(200, status, body)
    local want = { "bad argument #1 to 'incr' (string expected, got number)",
                   "bad argument #1 to 'incr' (name must be 1 to 255 bytes, got 0)",
                   "bad argument #2 to 'incr' (number expected, got string)" }
    local i = 0
    for line in body:gmatch("[^\n]+") do
      i = i + 1
      assert.equal(want[i], line:match(": (bad argument .*)$"), body)
    end
    assert.equal(#want, i, body)
    local m = "http_request_duration_seconds"
    local r = nginx.burst(srv.url .. "/page/[1-10]?r=[1-50]", { parallel = 16 }).wait()
    assert.same({ [200] = 500 }, r.codes)
    local db = store_of(srv)
    local h = assert(db:histogram("lat:/page"))
    assert.same({ 0.005, 0.05, 0.5 }, h.buckets)         -- the family's, not the defaults
    assert.is_truthy(nginx.eventually(function() return h:snapshot().count == 500 end, 5),
                     "count " .. h:snapshot().count)
    db:close()
    for _ = 1, 10 do                       -- on new connections: from either worker
      local status, text = nginx.get(srv.url .. "/metrics", { close = true })
      assert.equal(200, status, text)
      local ok, code, out = peers.check_metrics(text)
      assert(ok, ("promtool check metrics failed (%s):\n%s\n%s"):format(code, out, text))
      local _, ntype = text:gsub("# TYPE " .. m .. " histogram\n", "")
      assert.equal(1, ntype, text)
      local les = {}
      for le, v in text:gmatch("\n" .. m .. '_bucket{route="/page",le="([^"]+)"} (%d+)') do
        les[#les + 1] = le
        if le == "+Inf" then assert.equal("500", v) end
      end
      assert.same({ "0.005", "0.05", "0.5", "+Inf" }, les)
      assert.matches("\n" .. m .. '_count{route="/page"} 500\n', text, 1, true)
      assert.matches("\n" .. m .. '_sum{route="/page"} [%d.e+-]+\n', text)
    end
    assert.same({}, srv.errors())
  end)

  it("flushes buffered histograms every second when no rollup ticks that often", function()
    for _, variant in ipairs({ "no rollups", "tick = 20" }) do
      local conf, n1, n2 = nginx.example(), 0, 0
      if variant == "no rollups" then   -- no tick timer at all
        conf, n1 = conf:gsub("rollups = {.-},\n            },\n", "", 1)
      else                              -- one that ticks every 20 s
        conf, n1 = conf:gsub('store = "file:data/tally.tly",', '%0 tick = 20,', 1)
      end
      conf, n2 = conf:gsub('observe_latency%("http_request_duration_seconds"%)',
        'observe_latency("lat_buffered", { buffer = 1000 })', 1)
      assert.same({ 1, 1 }, { n1, n2 })
      srv = nginx.start { conf = conf }
      local r = nginx.burst(srv.url .. "/page/[1-10]?r=[1-30]", { parallel = 8 }).wait()
      assert.same({ [200] = 300 }, r.codes)
      -- every request (the 300 and the start's probes) is observed once, in
      -- 2 workers, fewer than a buffer each: in the store only once a
      -- worker's timer (1 s) flushes its own
      local db = store_of(srv)
      local h = assert(db:histogram("lat_buffered"))
      assert.is_truthy(nginx.eventually(function()
        return h:snapshot().count == db:sum("status:*") and h:snapshot().count >= 300
      end, 5), variant .. ": count " .. h:snapshot().count .. ", responses " .. db:sum("status:*"))
      db:close()
      assert.same({}, srv.errors())
      srv.stop()
    end
  end)

  it("loses nothing when reloaded (HUP) in the middle of a burst", function()
    -- latency into a buffered histogram: an old worker flushes what it
    -- holds when it stops, and observes what it still serves at once
    local conf, n = nginx.example { every = 1 }, 0
    conf, n = conf:gsub('observe_latency%("http_request_duration_seconds"%)',
      'observe_latency("lat_buffered", { buffer = 1000 })', 1)
    assert.equal(1, n)
    srv = nginx.start { conf = conf }
    local b = nginx.burst(srv.url .. "/page/[1-300]?r=[1-100]", { parallel = 32 })
    under_way(b)
    local old = srv.reload()
    local r = b.wait()
    assert.equal(30000, r.n, r.err)
    assert.same({ [200] = 30000 }, r.codes)
    local new = srv.wait_workers(2, old)
    assert.equal(2, #new)
    local by_old, by_new = 0, 0
    for _, pid in ipairs(old) do by_old = by_old + (r.workers[pid] or 0) end
    for _, pid in ipairs(new) do by_new = by_new + (r.workers[pid] or 0) end
    assert.is_true(by_old > 0, "the old workers answered nothing")
    assert.is_true(by_new > 0, "the HUP came too late: the new workers answered nothing")
    assert.equal(30000, by_old + by_new)
    local db = store_of(srv)
    assert.equal(30000, (db:sum("http:*")))
    local h = assert(db:histogram("lat_buffered"))
    assert.is_truthy(nginx.eventually(function()
      return h:snapshot().count == db:sum("status:*") and h:snapshot().count >= 30000
    end, 5), "count " .. h:snapshot().count .. ", responses " .. db:sum("status:*"))
    db:close()
    -- the new workers count too
    local r2 = nginx.burst(srv.url .. "/page/[1-10]?r=[1-100]").wait()
    assert.same({ [200] = 1000 }, r2.codes)
    db = store_of(srv)
    assert.equal(31000, (db:sum("http:*")))
    db:close()
    assert.same({}, srv.errors())
  end)

  it("keeps every acknowledged increment when a worker is killed (SIGKILL) mid-burst", function()
    srv = nginx.start { conf = nginx.example { every = 1 } }
    local before = srv.workers()
    -- one connection per request: curl never resends a request whose
    -- connection died, so nothing can be counted twice
    local b = nginx.burst(srv.url .. "/page/[1-60]?r=[1-100]", { parallel = 16, close = true })
    under_way(b)
    local victim = before[1]
    assert(os.execute("kill -KILL " .. victim))
    local r = b.wait()
    assert.equal(6000, r.n, r.err)
    local after = srv.wait_workers(2)
    local respawned
    for _, pid in ipairs(after) do
      if pid ~= before[1] and pid ~= before[2] then respawned = pid end
    end
    assert.is_truthy(respawned, "the master did not start a new worker")
    local db = store_of(srv)
    local total = db:sum("http:*")
    assert.is_true(total >= r.ok, ("%d requests got 200 but only %d were counted"):format(r.ok, total))
    assert.is_true(total <= r.n, ("%d counted for %d requests"):format(total, r.n))
    assert.is_true((r.workers[victim] or 0) > 0, "the killed worker answered nothing")
    -- the respawned worker counts into the same store
    local r2 = nginx.burst(srv.url .. "/page/[1-10]?r=[1-100]").wait()
    assert.same({ [200] = 1000 }, r2.codes)
    assert.equal(total + 1000, (db:sum("http:*")))
    assert.is_true(db:check())
    db:close()
    assert.same({}, srv.errors { "worker process " .. victim .. " exited on signal 9" })
  end)

  it("rolls up each period exactly once while both workers tick", function()
    local t_start = math.floor(tally.now())
    srv = nginx.start { conf = nginx.example { every = 1 } }
    local r = nginx.burst(srv.url .. "/page/[1-20]?r=[1-50]").wait()
    assert.same({ [200] = 1000 }, r.codes)
    nginx.sleep(3.5)   -- a few periods of 1 s
    local workers, n = from_workers(srv, "/tally/status", 2)
    local t_end = math.floor(tally.now())
    assert.equal(2, n, "could not reach both workers")
    local runs = 0
    for _, s in pairs(workers) do
      assert.is_true(s.ffi, "the FFI path is not in use: " .. tostring(s.ffi_reason))
      assert.is_true(s.ticks >= 3, "a worker ticked " .. s.ticks .. " times")
      assert.equal(0, s.tick_errors)
      assert.equal(1, #s.schedules)
      assert.equal(0, s.schedules[1].errors)
      runs = runs + s.schedules[1].runs
    end
    -- each worker ticks twice a period; a period is run by one of them only
    assert.is_true(runs <= t_end - t_start + 1,
      ("%d runs in %d periods"):format(runs, t_end - t_start + 1))
    assert.is_true(runs >= 3, runs .. " runs")

    srv.stop(true)   -- stops ticking; the prefix stays to be read
    local recs = {}
    for line in io.lines(srv.dir .. "/data/rollups.jsonl") do
      local rec = cjson.decode(line)
      local list = recs[rec.name] or {}
      recs[rec.name] = list
      list[#list + 1] = rec
    end
    assert.equal(20, #nginx.keys(recs))
    local db = store_of(srv)
    for name, list in pairs(recs) do
      local seen = {}
      for _, rec in ipairs(list) do
        local period = math.floor(rec.at + 0.0005)
        assert.is_nil(seen[period], name .. " rolled up twice in period " .. period)
        seen[period] = true
      end
      local c = db:counter(name)
      local rolled = assert(c:rolled())
      assert.equal(#list, rolled.count)               -- every rollup reached the sink once
      assert.equal(50, rolled.value)
      assert.equal(50, list[#list].value)
    end
    db:close()
    assert.same({}, srv.errors())
  end)

-- The example with /metrics made on a thread pool of its own (init_worker's
-- thread_pool) and, at /metrics_http, the http:* counters only.
local function pooled(pool)
  local conf, n = nginx.example { every = 1 }
  conf, n = conf:gsub("\nevents {", "\nthread_pool tally threads=1;\n%0", 1)
  assert.equal(1, n)
  conf, n = conf:gsub('store = "file:data/tally.tly",', '%0 thread_pool = "' .. pool .. '",', 1)
  assert.equal(1, n)
  conf, n = conf:gsub("\n        location = /metrics {", [[

        location = /metrics_http {
            content_by_lua_block { require("tally.openresty").metrics("http:*") }
        }
%0]], 1)
  assert.equal(1, n)
  return conf
end

for _, mode in ipairs({ "the worker", "a thread pool" }) do
  it("serves other requests while a large /metrics is made in " .. mode, function()
    local conf = mode == "the worker" and nginx.example { every = 1 } or pooled("tally")
    srv = nginx.start { conf = conf, workers = 1 }
    -- fewer for the pool: the worker is free, and answers during a shorter scrape
    local db, n = store_of(srv), mode == "the worker" and 300000 or 200000
    for i = 1, n do db:incr("bulk:" .. i, i) end
    -- the scrape in the background; meanwhile new requests, one after the
    -- other (at most 300), on the one worker; each line: its start and end
    local dir = srv.dir
    local script = helper.tmpfile("during.sh")
    helper.write(script, ([[
      url=%s; dir=%s
      ( s=$(date +%%s.%%N); curl -s -m 120 -o "$dir/metrics.txt" "$url/metrics"
        echo "$s $(date +%%s.%%N)" > "$dir/metrics.time" ) &
      m=$!
      i=0
      while kill -0 $m 2>/dev/null && [ $i -lt 300 ]; do
        t=$(date +%%s.%%N); curl -s -m 10 -o /dev/null "$url/page/1"
        echo "$t $(date +%%s.%%N)" >> "$dir/pages.time"; i=$((i + 1))
      done
      wait $m
    ]]):format(helper.q(srv.url), helper.q(dir)))
    -- curl without an ASan build's LD_PRELOAD (under it, curl hangs)
    local out, code = helper.sh("env -u LD_PRELOAD sh " .. helper.q(script))
    assert.equal(0, code, out)
    local ms, me = nginx.slurp(dir .. "/metrics.time"):match("(%S+) (%S+)")
    ms, me = tonumber(ms), tonumber(me)
    local within, total = 0, 0
    for a, b in (nginx.slurp(dir .. "/pages.time") or ""):gmatch("(%S+) (%S+)") do
      total = total + 1
      if tonumber(a) > ms and tonumber(b) < me then within = within + 1 end
    end
    -- without the scrape's yields (or its thread) the worker answers none
    -- of them until it has the whole text (at most one or two end before
    -- its transfer does)
    assert.is_true(within >= 5, ("%d of %d requests answered during a scrape of %.2f s")
                                :format(within, total, me - ms))
    local text = nginx.slurp(dir .. "/metrics.txt")
    local lines, sum = 0, 0
    for v in text:gmatch('\ntally_value{counter="bulk:%d+"} (%d+)') do
      lines, sum = lines + 1, sum + tonumber(v)
    end
    assert.equal(n, lines)
    assert.equal(n * (n + 1) / 2, sum)
    db:close()
    assert.same({}, srv.errors())
  end)
end

  it("makes /metrics on a thread pool exactly as in the worker, with its mappings", function()
    srv = nginx.start { conf = pooled("tally") }
    local b = nginx.burst(srv.url .. "/page/[1-40]", { parallel = 8 })
    assert.equal(40, b.wait().ok)
    local db = store_of(srv)
    -- the example's family of http:*, as the workers have it
    assert(db:family("http:*", { metric = "http_requests_total", labels = { "path" },
                                 type = "counter", help = "Requests by path" }))
    db:incr("http:/odd \"name\"\n", 7)     -- a label value to escape
    local want = assert(tally.prometheus(db, "http:*"))
    for _ = 1, 4 do                           -- either worker; the thread's handle kept
      local status, text, headers = nginx.get(srv.url .. "/metrics_http", { close = true })
      assert.equal(200, status, text)
      assert.equal(want, text)
      assert.matches("text/plain; version=0.0.4", headers["content-type"], 1, true)
    end
    -- the whole store: every family, the latency histogram among them
    local status, text = nginx.get(srv.url .. "/metrics")
    assert.equal(200, status, text)
    local paths = 0
    for _ in pairs(series(text, "http_requests_total")) do paths = paths + 1 end
    assert.equal(41, paths)
    assert.matches("\nhttp_request_duration_seconds_count ", text, 1, true)
    db:close()
    assert.same({}, srv.errors())
  end)

  it("has this worker's buffered histograms in a scrape made on the pool", function()
    -- observed, held in the worker's buffer, and scraped in one request:
    -- no timer can flush them in between, so only the scrape can
    local conf, n = pooled("tally"):gsub("\n        location = /metrics {", [[

        location = /observe_then_metrics {
            content_by_lua_block {
                local openresty = require "tally.openresty"
                for _ = 1, 3 do
                    assert(openresty.observe("held:h", 0.5, { buffer = 1024 }))
                end
                openresty.metrics("held:*")
            }
        }
%0]], 1)
    assert.equal(1, n)
    srv = nginx.start { conf = conf, workers = 1 }
    local status, text = nginx.get(srv.url .. "/observe_then_metrics")
    assert.equal(200, status, text)
    assert.matches("\nheld:h_count 3\n", text, 1, true)
    assert.matches('\nheld:h_bucket{le="0.5"} 3\n', text, 1, true)
    assert.same({}, srv.errors())
  end)

  it("makes each scrape at niceness 10, on whichever of the pool's threads", function()
    local conf, n = pooled("tally"):gsub("threads=1", "threads=2", 1)
    assert.equal(1, n)
    srv = nginx.start { conf = conf, workers = 1 }
    local db = store_of(srv)
    for i = 1, 20000 do db:incr("bulk:" .. i, i) end
    db:close()
    for _ = 1, 20 do          -- one VM, taken by either thread in turn
      local status, body = nginx.get(srv.url .. "/metrics", { close = true })
      assert.equal(200, status, body)
    end
    -- the worker's threads but its first: the pool's; each that worked
    -- (CPU ticks: utime + stime) must be at niceness 10
    local pid, worked = srv.workers()[1], 0
    for stat in helper.sh("cat /proc/" .. pid .. "/task/*/stat"):gmatch("[^\n]+") do
      local tid, rest = stat:match("^(%d+) %b() (.*)$")
      local f = {}
      for x in rest:gmatch("%S+") do f[#f + 1] = x end
      -- fields 14, 15 (utime, stime) and 19 (nice); f[1] is field 3
      local ticks, nice = tonumber(f[12]) + tonumber(f[13]), tonumber(f[17])
      if tonumber(tid) ~= pid and ticks > 0 then
        worked = worked + 1
        assert.equal(10, nice, "thread " .. tid .. " worked " .. ticks .. " ticks at niceness " .. nice)
      end
    end
    assert.is_true(worked >= 1)
    assert.same({}, srv.errors())
  end)

  it("says which thread pool it cannot use, and sends nothing else", function()
    srv = nginx.start { conf = pooled("no_such_pool") }
    local status, body = nginx.get(srv.url .. "/metrics")
    assert.equal(500, status)
    assert.matches("thread pool 'no_such_pool'", body, 1, true)
    assert.is_true(#srv.errors() > 0)
  end)

  it("serves /tally/status as JSON when a pattern is not UTF-8 (its bytes as \\udcXX)", function()
    local conf, n = nginx.example():gsub("\n            rollups = {\n", '%0'
      .. '                { "bytes:\\255*", every = 10, keep = { "6x10s" } },\n', 1)
    assert.equal(1, n)
    srv = nginx.start { conf = conf }
    local status, body = nginx.get(srv.url .. "/tally/status")
    assert.equal(200, status, body)
    assert.is_truthy(utf8.len(body), "not UTF-8: " .. body)
    assert.matches('"pattern":"bytes:\\udcff*"', body, 1, true)
    local s = assert(json.decode(body))
    local patterns = {}
    for _, sch in ipairs(s.schedules) do patterns[#patterns + 1] = sch.pattern end
    table.sort(patterns)
    assert.same({ "bytes:\255*", "http:*" }, patterns)
    assert.same({}, srv.errors())
  end)

  it("logs why a worker cannot open its store, and still serves", function()
    local conf, n = nginx.example():gsub('"file:data/tally%.tly"', '"file:missing/tally.tly"')
    assert.equal(1, n)
    srv = nginx.start { conf = conf, ready = "/page/1" }
    local text = srv.text()
    local msg = "tally.openresty: cannot open file:" .. srv.dir .. "/missing/tally.tly: "
    local _, count = text:gsub(msg:gsub("%p", "%%%0"), "")
    assert.equal(2, count, text)                      -- once per worker
    assert.matches("counting is off in this worker", text, 1, true)
    local status, body = nginx.get(srv.url .. "/metrics")
    assert.equal(503, status)
    assert.matches("no store in this worker (cannot open file:", body, 1, true)
    status, body = nginx.get(srv.url .. "/tally/status")
    assert.equal(503, status)
    assert.matches('"schedules":[]', body, 1, true)            -- an array, even empty
    assert.same({ [200] = 20 }, nginx.burst(srv.url .. "/page/[1-20]").wait().codes)
  end)

  it("logs a sink that fails", function()
    local conf, n = nginx.example({ every = 1 })
      :gsub('openresty%.path%("data/rollups%.jsonl"%)', 'openresty.path("missing/rollups.jsonl")')
    assert.equal(1, n)
    srv = nginx.start { conf = conf }
    assert.same({ [200] = 10 }, nginx.burst(srv.url .. "/page/[1-10]").wait().codes)
    local pattern = "%[error%].-tally%.openresty: sink #1 of rollup 'http:%*' every 1s: .-missing/rollups%.jsonl"
    assert.is_truthy(nginx.eventually(function() return srv.text():find(pattern) end, 10), srv.text())
  end)

  it("logs a failure that goes on once, readably, not at every tick or flush", function()
    -- a member of a buffered histogram dropped from outside: every flush
    -- of it fails, at every tick (twice a second in each worker), or, with
    -- no rollups, at every run of the timer that flushes histograms (1 s)
    for _, variant in ipairs({ "ticks", "no rollups" }) do
      local conf, n1, n2 = nginx.example { every = 1 }, 1, 0
      if variant == "no rollups" then
        conf, n1 = conf:gsub("rollups = {.-},\n            },\n", "", 1)
      end
      conf, n2 = conf:gsub('observe_latency%("http_request_duration_seconds"%)',
        'observe_latency("lat_buffered", { buffer = 1000 })', 1)
      assert.same({ 1, 1 }, { n1, n2 })
      srv = nginx.start { conf = conf }
      assert.same({ [200] = 100 }, nginx.burst(srv.url .. "/page/[1-100]", { close = true }).wait().codes)
      local db = store_of(srv)
      assert.is_truthy(nginx.eventually(function()
        return (db:value("lat_buffered{le=0.005}") or 0) > 0
      end, 5))
      assert.is_true(db:drop("lat_buffered{le=0.005}"))
      db:close()
      assert.same({ [200] = 100 }, nginx.burst(srv.url .. "/page/[1-100]", { close = true }).wait().codes)
      nginx.sleep(3.5)                    -- about 6 ticks, or 3 flushes, in each worker
      local text = srv.text()
      local what = variant == "ticks" and "flushing buffered histograms failed"
                   or "flushing buffered histogram 'lat_buffered' failed"
      local _, lines = text:gsub("tally%.openresty: " .. what:gsub("%p", "%%%0")
                                 .. ": counter 'lat_buffered{le=0%.005}' was dropped", "")
      assert.is_true(lines >= 1 and lines <= 2, variant .. ": " .. lines .. " lines:\n" .. text)
      assert.same({}, srv.errors { "flushing buffered histograms failed" })
      srv.stop()
    end
  end)

  it("logs an increment that goes on failing once, not at every request", function()
    -- a counter at the top of a shard's range: every request's incr fails
    -- (ERANGE), as every new name's does on a full disk; the example's
    -- handlers ignore what incr returns
    srv = nginx.start { conf = nginx.example() }
    local db = store_of(srv)
    assert.is_true(db:incr("http:/page/1", math.maxinteger >> 1))   -- 2^62 - 1, one shard
    db:close()
    assert.same({ [200] = 50 }, nginx.burst(srv.url .. "/page/1?r=[1-50]", { close = true }).wait().codes)
    local _, lines = srv.text():gsub("tally%.openresty: counting failed: counter 'http:/page/1': adding 1"
                                     .. " would overflow a shard", "")
    assert.is_true(lines >= 1 and lines <= 2, lines .. " lines:\n" .. srv.text())   -- once per worker
    assert.same({}, srv.errors { "counting failed: counter 'http:/page/1'" })
  end)

  it("says, once per worker, that it needs lua_code_cache on", function()
    -- with lua_code_cache off every request runs in a Lua VM of its own,
    -- without the store init_worker opened (in the worker's VM)
    local conf, n = nginx.example():gsub('\n    lua_package_cpath ([^\n]*)\n', '%0    lua_code_cache off;\n', 1)
    assert.equal(1, n)
    srv = nginx.start { conf = conf, ready = "/page/1" }
    assert.same({ [200] = 20 }, nginx.burst(srv.url .. "/page/[1-20]", { close = true }).wait().codes)
    local status, body = nginx.get(srv.url .. "/tally/status")
    assert.equal(503, status, body)
    assert.matches("with lua_code_cache off every request has a VM of its own;"
                   .. " tally.openresty needs lua_code_cache on", body, 1, true)
    local _, lines = srv.text():gsub("tally%.openresty: init_worker opened the store in this worker's own"
                                     .. " Lua VM[^\n]*counting is off in requests", "")
    assert.is_true(lines >= 1 and lines <= 2, lines .. " lines:\n" .. srv.text())   -- once per worker
    assert.same({}, srv.errors { "needs lua_code_cache on", "lua_code_cache is off; this will hurt performance" })
  end)

  it("refuses to open the store in init_by_lua (the master)", function()
    local conf = nginx.example():gsub("\n    init_worker_by_lua_block {", [[

    init_by_lua_block {
        require("tally.openresty").init_worker { store = "file:data/tally.tly" }
    }
    init_worker_by_lua_block {]], 1)
    assert.matches("init_by_lua_block", conf, 1, true)
    local ok, err = pcall(nginx.start, { conf = conf, discard = true })
    assert.is_false(ok)
    assert.matches("must be called from init_worker_by_lua*, not init", err, 1, true)
    assert.matches("would be inherited by every worker", err, 1, true)
  end)
end)
