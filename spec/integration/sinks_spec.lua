-- Rollup sinks: function, JSON-lines file, and HTTP (webhook, Pushgateway,
-- InfluxDB) against real servers on 127.0.0.1; and what a dead, failing or
-- slow sink does (nothing to increments, nothing to other sinks, counted).
local helper = require "spec.support.helper"
local peers = require "spec.support.peers"
local tally = require "tally"
local cjson = require "cjson"

local T0 = 1763769600

-- Run a process (its script at `script`) that spools one record for url
-- into spool while nothing listens there, and exits: the file it leaves
-- is a dead process's, for the next sink of url to take.
local function leave_spool_file(script, url, spool)
  helper.write(script, ([[
    local tally = require "tally"
    local s = tally.sink.http { url = %q, spool = %q, timeout = 1 }
    s:push({ { name = "a", value = 1, at = %d, delta = 0, rate = 0 } }, nil, { every = 10 })
  ]]):format(url, spool, T0))
  local out, code = helper.sh("timeout 30 " .. helper.q(helper.bin) .. " " .. helper.q(script))
  assert.equal(0, code, out)
end

-- A fresh directory on a tmpfs of `size` (a disk that fills), or nil once
-- the test is marked pending (not root, or no mount here). The caller
-- unmounts it in its one finally (busted keeps only the last).
local function small_tmpfs(name, size)
  if not helper.is_root() then
    pending("needs root to mount a small tmpfs")
    return nil
  end
  local dir = helper.tmpfile(name)
  os.execute("mkdir -p " .. helper.q(dir))
  local _, code = helper.sh("mount -t tmpfs -o size=" .. size .. " tmpfs " .. helper.q(dir))
  if code ~= 0 then
    pending("cannot mount a tmpfs here")
    return nil
  end
  return dir
end

-- Poll until cond() is true, for at most `secs`; returns cond()'s last value.
local function eventually(cond, secs)
  local deadline = tally.now() + (secs or 10)
  local v = cond()
  while not v and tally.now() < deadline do
    tally.sleep(0.02)
    v = cond()
  end
  return v
end

describe("a function sink", function()
  it("gets every record; when it raises, the record waits for the next tick", function()
    local db = assert(tally.open())
    local got, fail = {}, true
    local flaky = tally.sink.fn(function(r)
      if fail and r.name == "f:2" then error("sink is down") end
      got[#got + 1] = r.name .. "=" .. r.value
    end)
    local seen = {}
    db:rollup("f:*", { every = 1, sinks = { flaky, function(r) seen[#seen + 1] = r.name end } })
    db:incr("f:1", 1)
    db:incr("f:2", 2)
    db:tick(T0)
    local st = flaky:stats()
    assert.equal(1, st.failures)
    assert.matches("sink is down", st.last_error)
    assert.equal(1, st.queued)                       -- f:2 waits
    assert.equal(2, #seen)                           -- the other sink had both
    fail = false
    db:tick(T0 + 1)
    table.sort(got)
    assert.same({ "f:1=1", "f:1=1", "f:2=2", "f:2=2" }, got)
    assert.same({ kind = "function", sent = 4, failures = 1, dropped = 0, queued = 0,
                  last_error = st.last_error }, flaky:stats())
    db:close()
  end)

  it("gets its own copy of each record, and a sink that raises never stops a tick", function()
    local db = assert(tally.open())
    local path = helper.tmpfile("copies.jsonl")
    local broken = { push = function() error("broken sink") end, pump = function() end,
                     flush = function() return true end,
                     stats = function(self) return tally.sink.with_lost(self, { sent = 0 }) end }
    db:rollup("c:*", { every = 1, sinks = {
      function(r) r.value = -1 end, broken, tally.sink.file(path) } })
    db:incr("c:1", 7)
    assert.equal("ran", db:tick(T0)[1].status)
    assert.equal(7, cjson.decode(io.lines(path)()).value)
    local st = db:schedules()[1]:stats().sinks[2]
    assert.equal(1, st.dropped)
    assert.matches("broken sink", st.last_error)
    db:close()
  end)

  it("drops the oldest records past max_queue, and counts them", function()
    local db = assert(tally.open())
    local s = tally.sink.fn(function() error("down") end, { max_queue = 3 })
    db:rollup("q:*", { every = 1, sinks = { s } })
    for i = 1, 5 do db:counter("q:" .. i) end
    db:tick(T0)
    db:tick(T0 + 1)
    local st = s:stats()
    assert.equal(3, st.queued)
    assert.equal(7, st.dropped)
    assert.equal(0, st.sent)
    assert.matches("max_queue must be a positive integer", helper.err(tally.sink.fn, print, { max_queue = 0 }))
    assert.matches("function expected", helper.err(tally.sink.fn, 5))
    db:close()
  end)
end)

describe("a file sink", function()
  it("appends one JSON object per record and line, exact", function()
    local path = helper.tmpfile("rollups.jsonl")
    local db = assert(tally.open())
    db:rollup("j:*", { every = 1, sinks = { tally.sink.file(path) } })
    local c = db:counter("j:big")
    assert(c:incr((1 << 62) - 11))
    db:tick(T0)
    c:incr(10)
    db:tick(T0 + 1.5)
    local lines = {}
    for line in io.lines(path) do lines[#lines + 1] = line end
    assert.equal(2, #lines)
    local r = cjson.decode(lines[2])
    assert.equal("j:big", r.name)
    assert.equal(T0 + 1.5, r.at)
    assert.equal(10, r.delta)
    -- JSON numbers are doubles for most readers; the text itself is exact
    assert.truthy(lines[2]:find('"value":4611686018427387903', 1, true), lines[2])
    db:close()
  end)

  it("keeps records while the file cannot be written, and writes them later", function()
    local dir = helper.tmpfile("later")
    local path = dir .. "/rollups.jsonl"
    local db = assert(tally.open())
    local s = tally.sink.file { path = path }
    db:rollup("l", { every = 1, sinks = { s } })
    db:counter("l"):incr(3)
    db:tick(T0)
    assert.equal(1, s:stats().failures)
    assert.equal(1, s:stats().queued)
    assert.matches("No such file or directory", s:stats().last_error)
    os.execute("mkdir -p " .. helper.q(dir))
    db:tick(T0 + 1)
    local n = 0
    for _ in io.lines(path) do n = n + 1 end
    assert.equal(2, n)
    assert.equal(0, s:stats().queued)
    assert.matches("path must be a non%-empty string", helper.err(tally.sink.file, { path = "" }))
    assert.matches("unknown option 'file'", helper.err(tally.sink.file, { file = "x" }))
    db:close()
  end)

  it("stops when closed, as an HTTP sink does: later records are counted as dropped", function()
    local db = assert(tally.open())
    local got = {}
    local s = tally.sink.fn(function(r) got[#got + 1] = r.value end)
    db:rollup("z", { every = 1, sinks = { s } })
    db:counter("z"):incr(1)
    db:tick(T0)
    s:close()
    db:counter("z"):incr(1)
    db:tick(T0 + 1)
    assert.same({ 1 }, got)
    local st = s:stats()
    assert.equal(1, st.sent)
    assert.equal(1, st.dropped)
    assert.equal("sink is closed", st.last_error)
    db:close()
  end)
end)

describe("waiting", function()
  it("refuses a NaN of seconds: db:flush and tally.sleep", function()
    local db = assert(tally.open())
    assert.matches("bad argument #1 to 'flush' (seconds expected, got nan)", helper.err(db.flush, db, 0 / 0),
                   1, true)
    assert.matches("bad argument #1 to 'flush' (seconds expected, got -1)", helper.err(db.flush, db, -1),
                   1, true)
    assert.is_true(db:flush(0))
    assert.matches("seconds expected, got nan", helper.err(tally.sleep, 0 / 0), 1, true)
    tally.sleep(0)
    db:close()
  end)
end)

describe("an HTTP sink's close", function()
  it("checks drain before it stops anything", function()
    local s = tally.sink.http { url = "http://127.0.0.1:1/x", timeout = 0.2 }
    for _, bad in ipairs({ true, "1", -1, 0 / 0 }) do
      local ok, e = pcall(s.close, s, bad)
      assert.is_false(ok)
      assert.matches("bad argument #1 to 'close' (drain must be a number of seconds >= 0", e, 1, true)
    end
    assert.is_false(s.closed or false)
    s:close(0)
    assert.is_true(s.closed)
  end)
end)

describe("HTTP sinks", function()
  local hook, pg, ix
  setup(function()
    hook = peers.start_http_sink { control = true }
    pg = peers.start_pushgateway()
    ix = peers.start_influxdb { db = "tally_spec" }
  end)
  teardown(function()
    for _, srv in ipairs({ hook, pg, ix }) do if srv then srv.stop() end end
  end)

  it("post a JSON webhook with the configured headers", function()
    local db = assert(tally.open())
    local s = tally.sink.http { url = hook.url .. "/hook", format = "json",
                                headers = { ["X-Token"] = "s3cret" }, timeout = 2 }
    db:rollup("w:*", { every = 1, sinks = { s } })
    db:incr("w:1", 5)
    db:incr("w:2", 7)
    db:tick(T0)
    db:incr("w:1", 1)
    db:tick(T0 + 1)
    assert.is_true(db:flush(5))
    local reqs = hook.requests()
    assert.equal(2, #reqs)
    assert.equal("POST", reqs[1].method)
    assert.equal("/hook", reqs[1].path)
    assert.equal("application/json", reqs[1].content_type)
    assert.equal("s3cret", reqs[1].headers["x-token"])
    local second = cjson.decode(reqs[2].body)
    table.sort(second, function(a, b) return a.name < b.name end)
    assert.same({ name = "w:1", value = 6, at = T0 + 1, delta = 1, rate = 1 }, second[1])
    assert.same({ name = "w:2", value = 7, at = T0 + 1, delta = 0, rate = 0 }, second[2])
    assert.same({ sent = 4, requests = 2, failures = 0, dropped = 0, queued = 0 },
                { sent = s:stats().sent, requests = s:stats().requests, failures = s:stats().failures,
                  dropped = s:stats().dropped, queued = s:stats().queued })
    db:close()
  end)

  it("push Prometheus text to a Pushgateway, with family labels", function()
    local db = assert(tally.open())
    db:family("post:*:likes", { metric = "likes_total", labels = { "post" } })
    db:rollup("post:*", { every = 10, sinks = {
      tally.sink.http { url = pg.url .. "/metrics/job/tally/instance/spec", format = "prometheus" } } })
    db:incr("post:123:likes", 5)
    db:incr('post:a"b:likes', 2)
    db:tick(T0)
    assert.is_true(db:flush(5))
    local status, body = peers.http("GET", pg.url .. "/metrics")
    assert.equal(200, status)
    assert.truthy(body:find('likes_total{instance="spec",job="tally",post="123"} 5\n', 1, true), body)
    assert.truthy(body:find('likes_total{instance="spec",job="tally",post="a\\"b"} 2\n', 1, true), body)
    db:close()
  end)

  it("leave out a counter whose series has a label of the Pushgateway group's key, and push the rest", function()
    -- the Pushgateway sets job and instance on every series: two counters
    -- labelled job= became one series and it refused the whole body (400)
    local db = assert(tally.open())
    db:family("w:*", { metric = "workers", labels = { "job" } })
    local s = tally.sink.http { url = pg.url .. "/metrics/job/grouped/instance/spec",
                                format = "prometheus" }
    db:rollup("*", { every = 10, sinks = { s } })
    db:incr("w:a", 1)
    db:incr("w:b", 2)
    db:incr("other", 3)
    db:tick(T0)
    assert.is_true(db:flush(5))
    local st = s:stats()
    assert.same({ 2, 0 }, { st.dropped, st.rejected })
    assert.equal("counter 'w:a' has the label 'job', which the Pushgateway group url sets on every "
                 .. "series: give the family another label name", st.last_error)
    local _, body = peers.http("GET", pg.url .. "/metrics")
    assert.truthy(body:find('tally_value{counter="other",instance="spec",job="grouped"} 3\n', 1, true), body)
    assert.falsy(body:find("\nworkers{", 1, true), body)
    db:close()
  end)

  it("send nothing when every counter of a Pushgateway push is left out (a PUT would empty the group)", function()
    -- a PUT replaces the whole group: an empty body pushed for records all
    -- left out wiped what other pushes had put there
    local db = assert(tally.open())
    local url = pg.url .. "/metrics/job/wiped/instance/spec"
    local keep = tally.sink.http { url = url, format = "prometheus" }
    db:rollup("kept", { every = 10, sinks = { keep } })
    db:incr("kept", 7)
    db:tick(T0)
    assert.is_true(db:flush(5))
    db:family("w:*", { metric = "workers", labels = { "job" } })
    local s = tally.sink.http { url = url, format = "prometheus", method = "PUT" }
    db:rollup("w:*", { every = 10, sinks = { s } })
    db:incr("w:a", 1)
    db:tick(T0 + 10)
    assert.is_true(db:flush(5))
    local st = s:stats()
    assert.same({ 1, 0, 0 }, { st.dropped, st.sent, st.rejected })
    local _, body = peers.http("GET", pg.url .. "/metrics")
    assert.truthy(body:find('tally_value{counter="kept",instance="spec",job="wiped"} 7\n', 1, true), body)
    db:close()
  end)

  it("write line protocol to InfluxDB, read back through its query API", function()
    local db = assert(tally.open())
    local s = tally.sink.http { url = ix.url .. "/write?db=tally_spec&precision=ms",
                                format = "influx", measurement = "counts" }
    db:rollup("i:*", { every = 1, sinks = { s } })
    local c = db:counter("i:one, two")   -- a tag value that needs escaping
    c:incr(40)
    db:tick(T0)
    c:incr(2)
    db:tick(T0 + 2)
    assert.is_true(db:flush(5))
    assert.equal(0, s:stats().failures, s:stats().last_error)
    local q = peers.urlencode([[SELECT "value","delta","rate" FROM "counts" WHERE "name" = 'i:one, two']])
    local status, body = peers.http("GET", ix.url .. "/query?db=tally_spec&epoch=ms&q=" .. q)
    assert.equal(200, status)
    local series = cjson.decode(body).results[1].series[1]
    assert.same({ "time", "value", "delta", "rate" }, series.columns)
    assert.same({ { T0 * 1000, 40, 0, 0 }, { (T0 + 2) * 1000, 42, 2, 1 } }, series.values)
    db:close()
  end)

  -- A failing sink beside a healthy function sink: ticks stay quick,
  -- increments go on, the other sink gets everything, failures are counted.
  local function with_failing(url, opts, check)
    local db = assert(tally.open())
    local s = tally.sink.http { url = url, format = "json", timeout = opts.timeout or 0.2,
                                max_queue = opts.max_queue }
    local seen = 0
    db:rollup("x:*", { every = 1, sinks = { s, function() seen = seen + 1 end } })
    local c = db:counter("x:1")
    for i = 0, 9 do
      c:incr(1)
      local t = tally.now()
      db:tick(T0 + i)
      assert.is_true(tally.now() - t < 0.1, "a tick waited on the sink")
    end
    assert.equal(10, c:value())
    assert.equal(10, seen)
    assert.is_truthy(eventually(function() return s:stats().failures > 0 end))
    check(s, db)
    db:close()
  end

  it("that is not listening: failures counted, nothing blocks", function()
    with_failing("http://127.0.0.1:" .. peers.free_port() .. "/hook", {}, function(s, db)
      local st = s:stats()
      assert.equal(0, st.sent)
      assert.matches("onnect", st.last_error)
      local ok, msg = db:flush(0.2)
      assert.is_nil(ok)
      assert.matches("records still queued", msg)
    end)
  end)

  it("that answers 500: retried until it recovers, then delivered once", function()
    hook.control(500, 0)
    local before = #hook.requests()
    with_failing(hook.url .. "/flaky", {}, function(s, db)
      assert.equal(500, s:stats().last_status)
      assert.matches("500", s:stats().last_error)
      hook.control(200, 0)
      -- beyond what a sink waits at most (4294967 s): waits all the same
      -- (math.huge returned at once, its records still queued)
      assert.is_true(db:flush(math.huge))
      local delivered = 0
      for i, r in ipairs(hook.requests()) do
        if i > before and r.path == "/flaky" then
          delivered = delivered + #cjson.decode(r.body)  -- 500s are logged too
        end
      end
      local st = s:stats()
      assert.equal(10, st.sent)
      assert.equal(0, st.dropped)
      assert.is_true(delivered >= 10)
    end)
  end)

  it("slower than its timeout: timeouts counted; a full queue drops the oldest, counted", function()
    hook.control(200, 1500)
    with_failing(hook.url .. "/slow", { timeout = 0.2, max_queue = 4 }, function(s)
      local st = s:stats()
      assert.matches("timed out", st.last_error)
      assert.is_true(st.queued <= 4)
      assert.equal(10, st.dropped + st.queued + st.sent)
      assert.is_true(st.dropped >= 5, tostring(st.dropped))
    end)
    hook.control(200, 0)
  end)

  it("push every counter to a Pushgateway in one body per tick, however many", function()
    local db = assert(tally.open())
    local s = tally.sink.http { url = pg.url .. "/metrics/job/many", format = "prometheus", batch = 10 }
    db:rollup("n:*", { every = 1, sinks = { s } })
    for i = 1, 25 do db:incr("n:" .. i, i) end
    db:tick(T0)
    assert.is_true(db:flush(5))
    assert.equal(1, s:stats().requests)
    local _, body = peers.http("GET", pg.url .. "/metrics")
    local n = 0
    for _ in body:gmatch('tally_value{counter="n:%d+",instance="",job="many"}') do n = n + 1 end
    assert.equal(25, n)
    db:close()
  end)

  it("drop and count a record line protocol cannot carry, and send the rest", function()
    local db = assert(tally.open())
    local s = tally.sink.http { url = ix.url .. "/write?db=tally_spec&precision=s", format = "influx",
                                measurement = "esc" }
    db:rollup("e:*", { every = 1, sinks = { s } })
    db:incr("e:ok\\x", 3)     -- a backslash inside a tag is kept as it is
    db:incr("e:bad\\", 4)     -- at the end it would escape the separator
    assert.equal("ran", db:tick(T0)[1].status)
    assert.is_true(db:flush(5))
    local st = s:stats()
    assert.same({ 1, 1, 0 }, { st.sent, st.dropped, st.failures - 1 })
    assert.matches("ends in a backslash", st.last_error)
    local q = peers.urlencode([[SELECT "value" FROM "esc"]])
    local _, body = peers.http("GET", ix.url .. "/query?db=tally_spec&q=" .. q)
    assert.truthy(body:find('"value"]],"values":[["', 1, true) or body:find("3", 1, true), body)
    q = peers.urlencode([[SHOW TAG VALUES FROM "esc" WITH KEY = "name"]])
    _, body = peers.http("GET", ix.url .. "/query?db=tally_spec&q=" .. q)
    assert.same({ { "name", "e:ok\\x" } }, cjson.decode(body).results[1].series[1].values)
    db:close()
  end)

  it("that refuses a body (4xx): dropped and counted as rejected, never retried", function()
    hook.control(400, 0)
    local db = assert(tally.open())
    local s = tally.sink.http { url = hook.url .. "/refused", format = "json" }
    db:rollup("z:*", { every = 1, sinks = { s } })
    db:incr("z:1")
    db:tick(T0)
    assert.is_true(db:flush(5))
    hook.control(200, 0)
    db:tick(T0 + 1)
    assert.is_true(db:flush(5))
    local st = s:stats()
    assert.same({ 1, 1, 1, 0 }, { st.sent, st.rejected, st.dropped, st.queued })
    db:close()
  end)

  it("closed, count what they are given as dropped, and the tick goes on", function()
    local db = assert(tally.open())
    local s = tally.sink.http { url = hook.url .. "/closed", format = "json" }
    db:rollup("k:*", { every = 1, sinks = { s } })
    db:incr("k:1")
    s:close()
    assert.equal("ran", db:tick(T0)[1].status)
    assert.is_true(db:flush(1))
    assert.equal(1, s:stats().dropped)
    db:close()
  end)

  it("examples/rollup_to_pushgateway.lua pushes its posts as likes_total", function()
    local out, code = helper.tally("examples/rollup_to_pushgateway.lua", pg.url, "1.5")
    assert.equal(0, code, out)
    assert.matches("0 failures, 0 dropped, 0 queued", out)
    local _, body = peers.http("GET", pg.url .. "/metrics")
    for post, per in pairs({ ["101"] = 1, ["102"] = 2, ["103"] = 3 }) do
      local v = tonumber(body:match('likes_total{instance="",job="tally_example",post="' .. post .. '"} (%d+)'))
      assert.is_number(v, body)
      assert.equal(0, v % per)
      assert.truthy(out:find(('likes_total{post="%s"} %d'):format(post, v), 1, true), out)
    end
  end)

  it("refuses bad options", function()
    local http = tally.sink.http
    assert.matches("url must be an http", helper.err(http, { url = "ftp://x" }))
    assert.matches("format must be json, prometheus or influx", helper.err(http, { url = "http://x", format = "xml" }))
    assert.matches("timeout", helper.err(http, { url = "http://x", timeout = -1 }))
    assert.matches("unknown option 'uri'", helper.err(http, { uri = "http://x" }))
    assert.matches("precision", helper.err(http, { url = "http://x/write?db=a", format = "influx", precision = "s" }))
  end)

  it("to InfluxDB refuse, when made, a precision or measurement that would lose every record", function()
    local http = tally.sink.http
    local url = ix.url .. "/write?db=tally_spec&precision=ms"
    -- seconds read as milliseconds would have stored 1970-01-21
    assert.equal("bad argument #1 to 'http' (precision 's' but the url has precision=ms: "
                 .. "InfluxDB would read the timestamps in the url's)",
                 helper.err(http, { url = url, format = "influx", precision = "s" }))
    assert.equal("bad argument #1 to 'http' (measurement '#m' cannot be carried by line protocol "
                 .. "(it starts with #, ends in a backslash, or has one before , space or =))",
                 helper.err(http, { url = url, format = "influx", measurement = "#m" }))
    -- 1.x's precision=n: nanoseconds, where every record was dropped
    local db = assert(tally.open())
    local s = http { url = ix.url .. "/write?db=tally_spec&precision=n", format = "influx",
                     measurement = "nano" }
    assert.is_truthy(http { url = url, format = "influx", precision = "ms" })
    db:rollup("p:*", { every = 1, sinks = { s } })
    db:incr("p:1", 3)
    db:tick(T0)
    assert.is_true(db:flush(5))
    assert.same({ 1, 0 }, { s:stats().sent, s:stats().dropped })
    local q = peers.urlencode([[SELECT "value" FROM "nano"]])
    local _, body = peers.http("GET", ix.url .. "/query?db=tally_spec&epoch=ms&q=" .. q)
    assert.same({ { T0 * 1000, 3 } }, cjson.decode(body).results[1].series[1].values)
    db:close()
  end)
end)

describe("examples/pageviews.lua", function()
  it("prints a live total and rate each second, and an exact total", function()
    local out, code = helper.tally("examples/pageviews.lua", "2.2")
    assert.equal(0, code, out)
    local lines = 0
    for total, rate in out:gmatch("total +(%d+) +rate +(%d+) views/s") do lines = lines + 1 end
    assert.is_true(lines >= 2, out)
    local views, exact = out:match("(%d+) views counted, exact total (%d+)")
    assert.equal(views, exact)
  end)
end)

describe("an HTTP sink with a spool", function()
  local function readdir(dir)
    local names = {}
    local p = io.popen("ls -A " .. helper.q(dir) .. " 2>/dev/null")
    for n in p:lines() do names[#names + 1] = n end
    p:close()
    table.sort(names)
    return names
  end

  -- A script that rolls c:* up twice (store clock T0, T0 + 10) into a JSON
  -- webhook at url with spool = true, then exits without closing anything.
  -- Its counters are c:1 and c:2 (or name).
  local function cron_script(path, url, name)
    local script = helper.tmpfile("cron.lua")
    helper.write(script, ([[
      local tally = require "tally"
      local db = assert(tally.open("file:" .. %q))
      local t = %d
      db:clock(function() return t end)
      db:rollup("c:*", { every = 10, sinks = { tally.sink.http { url = %q, spool = true, timeout = 1 } } })
      db:incr("c:1", 5)
      db:incr(%q, 9007199254740993)
      db:tick()
      t = t + 10
      db:incr("c:1", 1)
      db:tick()
      os.exit(0)
    ]]):format(path, T0, url, name or "c:2"))
    return script
  end

  -- A later run: defines the schedule (which delivers what is spooled) and
  -- waits for its sinks.
  local function later_script(path, url)
    local script = helper.tmpfile("later.lua")
    helper.write(script, ([[
      local tally = require "tally"
      local db = assert(tally.open("file:" .. %q))
      db:rollup("c:*", { every = 10, sinks = { tally.sink.http { url = %q, spool = true, timeout = 2 } } })
      assert(db:flush(10))
      db:close()
      print("done")
    ]]):format(path, url))
    return script
  end

  local function bodies(srv)
    local out = {}
    for _, r in ipairs(srv.requests()) do out[#out + 1] = r.body end
    return out
  end

  it("keeps what a dead webhook did not get when the process exits; a later run delivers it", function()
    local path = helper.tmpfile()
    local port = peers.free_port()
    local url = "http://127.0.0.1:" .. port .. "/hook"
    local out, code = helper.sh("timeout 30 " .. helper.q(helper.bin) .. " " .. helper.q(cron_script(path, url)))
    assert.equal(0, code, out)
    local files = readdir(path .. ".spool")
    assert.equal(1, #files, table.concat(files, " "))
    assert.matches("^http%-%x+%.%d+%-%x+%.spool$", files[1])
    local spooled = {}
    for line in io.lines(path .. ".spool/" .. files[1]) do spooled[#spooled + 1] = line end
    assert.same({
      '{"name":"c:1","value":5,"at":' .. T0 .. '.000,"delta":0,"rate":0,"id":"c:1|10|' .. T0 .. '000"}',
      '{"name":"c:2","value":9007199254740993,"at":' .. T0 .. '.000,"delta":0,"rate":0,"id":"c:2|10|'
        .. T0 .. '000"}',
      '{"name":"c:1","value":6,"at":' .. (T0 + 10) .. '.000,"delta":1,"rate":0.1,"id":"c:1|10|'
        .. (T0 + 10) .. '000"}',
      '{"name":"c:2","value":9007199254740993,"at":' .. (T0 + 10) .. '.000,"delta":0,"rate":0,'
        .. '"id":"c:2|10|' .. (T0 + 10) .. '000"}',
    }, spooled)

    local srv = peers.start_http_sink { port = port }
    finally(function() srv.stop() end)
    out, code = helper.sh("timeout 30 " .. helper.q(helper.bin) .. " " .. helper.q(later_script(path, url)))
    assert.equal(0, code, out)
    assert.equal("done\n", out)
    -- exactly as spooled, in one JSON array, and the spool is empty
    assert.same({ "[" .. table.concat(spooled, ",") .. "]" }, bodies(srv))
    assert.same({}, readdir(path .. ".spool"))
    -- delivered: nothing more comes
    out, code = helper.sh("timeout 30 " .. helper.q(helper.bin) .. " " .. helper.q(later_script(path, url)))
    assert.equal(0, code, out)
    assert.equal(1, #bodies(srv))
  end)

  -- Rolls c:\255 up into a spool and checks its second line: as written,
  -- or (raw) with the name's bytes raw, as an older version wrote it, the
  -- file rewritten so. Then delivers the spool: the sink gets every line as
  -- this version writes them, and the spool empties.
  local function spool_not_utf8(raw, want_line2)
    local path = helper.tmpfile()
    local port = peers.free_port()
    local url = "http://127.0.0.1:" .. port .. "/hook"
    local out, code = helper.sh("timeout 30 " .. helper.q(helper.bin) .. " "
                                .. helper.q(cron_script(path, url, "c:\255")))
    assert.equal(0, code, out)
    local files = readdir(path .. ".spool")
    local file = path .. ".spool/" .. files[1]
    local spooled, on_disk = {}, {}
    for line in io.lines(file) do
      spooled[#spooled + 1], on_disk[#on_disk + 1] = line, raw and (line:gsub("\\udcff", "\255")) or line
    end
    assert.equal(4, #spooled)
    assert.equal(want_line2, on_disk[2])
    if raw then helper.write(file, table.concat(on_disk, "\n") .. "\n") end
    local srv = peers.start_http_sink { port = port }
    finally(function() srv.stop() end)
    out, code = helper.sh("timeout 30 " .. helper.q(helper.bin) .. " " .. helper.q(later_script(path, url)))
    assert.equal(0, code, out)
    assert.same({ "[" .. table.concat(spooled, ",") .. "]" }, bodies(srv))
    assert.same({}, readdir(path .. ".spool"))
  end

  it("delivers a spool line an older version wrote, a name's bytes raw, as JSON", function()
    spool_not_utf8(true, '{"name":"c:\255","value":9007199254740993,"at":' .. T0 .. '.000,"delta":0,"rate":0,'
                         .. '"id":"c:\255|10|' .. T0 .. '000"}')
  end)

  it("spools a name that is not UTF-8 as \\udcXX, and delivers it as spooled", function()
    spool_not_utf8(false, '{"name":"c:\\udcff","value":9007199254740993,"at":' .. T0 .. '.000,"delta":0,"rate":0,'
                          .. '"id":"c:\\udcff|10|' .. T0 .. '000"}')
  end)

  it("writes each record's id with its period in the fewest digits and its time", function()
    local dir = helper.tmpfile("ids.spool")
    local s = tally.sink.http { url = "http://127.0.0.1:" .. peers.free_port() .. "/x",
                                spool = dir, timeout = 1 }
    s:push({ { name = "a", value = 1, at = 1000.5, delta = 0, rate = 0 } }, nil, { every = 0.2 })
    s:push({ { name = "b", value = 2, at = 7, delta = 0, rate = 0 } }, nil, { every = 10 })
    local files = readdir(dir)
    assert.equal(1, #files)
    local ids = {}
    for line in io.lines(dir .. "/" .. files[1]) do ids[#ids + 1] = cjson.decode(line).id end
    assert.same({ "a|0.2|1000500", "b|10|7000" }, ids)
    s:close()
  end)

  it("is delivered to its own url only, never to one whose name hashes alike", function()
    local path = helper.tmpfile()
    local port = peers.free_port()
    local base = "http://127.0.0.1:" .. port
    -- "/hook/ab" and "/hook/bA": one djb2 hash, the files' whole name once
    local out, code = helper.sh("timeout 30 " .. helper.q(helper.bin) .. " "
                                .. helper.q(cron_script(path, base .. "/hook/ab")))
    assert.equal(0, code, out)
    local dir = path .. ".spool/"
    local files = readdir(dir)
    assert.equal(1, #files)
    assert.matches("^http%-%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%x%.%d+%-%x+%.spool$", files[1])
    local srv = peers.start_http_sink { port = port }
    finally(function() srv.stop() end)
    out, code = helper.sh("timeout 30 " .. helper.q(helper.bin) .. " "
                          .. helper.q(later_script(path, base .. "/hook/bA")))
    assert.equal(0, code, out)
    assert.same({}, srv.requests())                  -- not bA's
    assert.same(files, readdir(dir))
    -- a file named as the old version named it (djb2 alone) is still taken
    local legacy = files[1]:gsub("^(http%-%x%x%x%x%x%x%x%x)%x%x%x%x%x%x%x%x", "%1")
    assert(os.rename(dir .. files[1], dir .. legacy))
    out, code = helper.sh("timeout 30 " .. helper.q(helper.bin) .. " "
                          .. helper.q(later_script(path, base .. "/hook/ab")))
    assert.equal(0, code, out)
    local reqs = srv.requests()
    assert.equal(1, #reqs)
    assert.equal("/hook/ab", reqs[1].path)
    assert.equal(4, #cjson.decode(reqs[1].body))
    assert.same({}, readdir(dir))
  end)

  it("is delivered by one of several processes that start at once, never twice", function()
    local path = helper.tmpfile()
    local port = peers.free_port()
    local url = "http://127.0.0.1:" .. port .. "/hook"
    local out, code = helper.sh("timeout 30 " .. helper.q(helper.bin) .. " "
                                .. helper.q(cron_script(path, url)))
    assert.equal(0, code, out)
    -- (a second run would take the first one's file into its own: one file.)
    -- Two more left behind, by processes long gone (pids beyond pid_max)
    local dir = path .. ".spool/"
    local first = readdir(dir)[1]
    local f = assert(io.open(dir .. first, "rb"))
    local data = f:read("a")
    f:close()
    for i, pid in ipairs({ 999999991, 999999992 }) do
      helper.write(dir .. first:gsub("%.%d+%-%x+%.spool$", "." .. pid .. "-" .. i .. ".spool"), data)
    end
    assert.equal(3, #readdir(dir))
    local srv = peers.start_http_sink { port = port }
    finally(function() srv.stop() end)
    local script = later_script(path, url)
    local procs = {}
    for i = 1, 4 do procs[i] = helper.spawn(script) end
    for i = 1, 4 do
      local out = procs[i]:read("a")
      procs[i]:close()
      assert.equal("done\n", out)
    end
    local ids, n = {}, 0
    for _, body in ipairs(bodies(srv)) do
      for _, r in ipairs(cjson.decode(body)) do
        n = n + 1
        ids[r.id] = (ids[r.id] or 0) + 1
      end
    end
    assert.equal(12, n)       -- 3 files of 4 records, each file delivered once
    for id, k in pairs(ids) do assert.equal(3, k, id) end   -- the same 4 ids in each file
    assert.same({}, readdir(path .. ".spool"))
  end)

  it("drops a record its format cannot carry, and still empties the file", function()
    -- it once kept the file for good: every later run posted its records again
    local path = helper.tmpfile()
    local srv = peers.start_http_sink {}
    finally(function() srv.stop() end)
    local script = helper.tmpfile("influx.lua")
    helper.write(script, ([[
      local tally = require "tally"
      local db = assert(tally.open("file:" .. %q))
      local t = tonumber(arg[1])
      db:clock(function() return t end)
      local s = tally.sink.http { url = %q, format = "influx", spool = true, timeout = 2 }
      db:rollup("c:*", { every = 10, sinks = { s } })
      db:incr("c:good", 1)
      db:incr("c:bad\\", 1)               -- line protocol cannot end a tag in a backslash
      db:tick()
      assert(db:flush(10))
      print(s:stats().sent, s:stats().dropped)
    ]]):format(path, srv.url .. "/write?db=x"))
    for i = 0, 2 do
      local out, code = helper.sh("timeout 30 " .. helper.q(helper.bin) .. " " .. helper.q(script)
                                  .. " " .. (T0 + 10 * i))
      assert.equal(0, code, out)
      assert.equal("1\t1\n", out)
      assert.same({}, readdir(path .. ".spool"))
    end
    assert.same({
      "tally,name=c:good value=1i,delta=0i,rate=0 " .. T0 .. "000000000\n",
      "tally,name=c:good value=2i,delta=1i,rate=0.1 " .. (T0 + 10) .. "000000000\n",
      "tally,name=c:good value=3i,delta=1i,rate=0.1 " .. (T0 + 20) .. "000000000\n",
    }, bodies(srv))
  end)

  it("keeps a dead process's file it cannot copy into its own (a full disk) (as root)", function()
    local dir = small_tmpfs("fullspool", "64k")
    if not dir then return end
    local srv
    finally(function()                -- one finally per test: busted keeps the last
      if srv then srv.stop() end
      helper.sh("umount " .. helper.q(dir))
    end)
    local spool = dir .. "/spool"
    local port = peers.free_port()
    local url = "http://127.0.0.1:" .. port .. "/hook"
    local line = '{"name":"a","value":1,"at":' .. T0 .. '.000,"delta":0,"rate":0,"id":"a|10|' .. T0 .. '000"}'
    local script = helper.tmpfile("take.lua")
    helper.write(script, ([[
      local tally = require "tally"
      local s = tally.sink.http { url = %q, spool = %q, timeout = 1 }
      local db = assert(tally.open())
      db:rollup("c:*", { every = 10, sinks = { s } })
      if arg[1] == "wait" then assert(db:flush(10)) end
      print(s:stats().spool_errors)
    ]]):format(url, spool))
    -- a file left by a process that exited while the webhook was down
    leave_spool_file(helper.tmpfile("first.lua"), url, spool)
    local out, code
    assert.equal(1, #readdir(spool))
    helper.sh("head -c 100000 /dev/zero > " .. helper.q(dir .. "/filler") .. " 2>/dev/null")
    -- the webhook is down and the disk full: the taker cannot copy the
    -- records into its own file, and exits before they are delivered
    out, code = helper.sh("timeout 30 " .. helper.q(helper.bin) .. " " .. helper.q(script))
    assert.equal(0, code, out)
    assert.equal("1\n", out)
    local text = ""
    for _, n in ipairs(readdir(spool)) do text = text .. helper.slurp(spool .. "/" .. n) end
    assert.equal(line .. "\n", text)          -- still on disk, for a later run
    -- a later run, the disk still full, the webhook up: delivers it, then
    -- removes the file it took
    srv = peers.start_http_sink { port = port }
    out, code = helper.sh("timeout 30 " .. helper.q(helper.bin) .. " " .. helper.q(script) .. " wait")
    assert.equal(0, code, out)
    assert.equal("1\n", out)
    assert.same({ "[" .. line .. "]" }, bodies(srv))
    assert.same({}, readdir(spool))
  end)

  it("leaves a file it cannot read where it was, and says so (as root)", function()
    -- it once renamed it, read nothing, and removed it: records lost
    if not helper.is_root() or not helper.on_path("setpriv") then
      pending("needs root and setpriv to run a taker as nobody")
      return
    end
    local dir = helper.tmpfile("perm")
    local spool = dir .. "/spool"
    os.execute("mkdir -p " .. helper.q(spool) .. " && chmod 755 " .. helper.q(dir)
               .. " && chown nobody " .. helper.q(spool) .. " && chmod 700 " .. helper.q(spool))
    local url = "http://127.0.0.1:" .. peers.free_port() .. "/hook"
    leave_spool_file(dir .. "/first.lua", url, spool) -- root's run: a 0600 file
    local out, code
    local files = readdir(spool)
    assert.equal(1, #files)
    local data = helper.slurp(spool .. "/" .. files[1])
    local take = dir .. "/take.lua"             -- a worker running as nobody
    helper.write(take, ([[
      local tally = require "tally"
      local s = tally.sink.http { url = %q, spool = %q, timeout = 1 }
      local db = assert(tally.open())
      db:rollup("c:*", { every = 10, sinks = { s } })
      print(s:stats().spool_errors, s:stats().spool_last_error)
    ]]):format(url, spool))
    os.execute("chmod 644 " .. helper.q(take))
    out, code = helper.sh("timeout 30 setpriv --reuid=nobody --regid=nogroup --clear-groups "
                          .. helper.q(helper.bin) .. " " .. helper.q(take))
    assert.equal(0, code, out)
    assert.matches("^1\t.*%.take: Permission denied\n$", out)
    assert.same(files, readdir(spool))
    assert.equal(data, helper.slurp(spool .. "/" .. files[1]))
  end)

  it("hands a closed sink's file to the next sink for its url in the same process", function()
    -- it once stayed this process's until it exited
    local dir = helper.tmpfile("closed.spool")
    local port = peers.free_port()
    local url = "http://127.0.0.1:" .. port .. "/hook"
    local a = tally.sink.http { url = url, spool = dir, timeout = 1 }
    a:push({ { name = "a", value = 1, at = T0, delta = 0, rate = 0 } }, nil, { every = 10 })
    a:close()                                   -- the webhook was down
    assert.equal(1, #readdir(dir))
    local srv = peers.start_http_sink { port = port }
    finally(function() srv.stop() end)
    local db = assert(tally.open())
    local b = tally.sink.http { url = url, spool = dir, timeout = 2 }
    db:rollup("c:*", { every = 10, sinks = { b } })
    assert.is_true(db:flush(10))
    assert.same({ '[{"name":"a","value":1,"at":' .. T0 .. '.000,"delta":0,"rate":0,"id":"a|10|' .. T0
                  .. '000"}]' }, bodies(srv))
    assert.same({}, readdir(dir))
    db:close()
  end)

  it("leaves a live process's file alone, and refuses a bad spool option", function()
    local path = helper.tmpfile()
    local port = peers.free_port()
    local url = "http://127.0.0.1:" .. port .. "/hook"
    local db = assert(tally.open("file:" .. path))
    local t = T0
    db:clock(function() return t end)
    local s = tally.sink.http { url = url, spool = true, timeout = 1 }
    db:rollup("c:*", { every = 10, sinks = { s } })
    db:incr("c:1", 1)
    db:tick()
    assert.equal(1, s:stats().spooled)
    -- another process sees this one alive: it takes nothing
    local srv = peers.start_http_sink { port = port }
    finally(function() srv.stop() end)
    local out, code = helper.sh("timeout 30 " .. helper.q(helper.bin) .. " " .. helper.q(later_script(path, url)))
    assert.equal(0, code, out)
    -- this one delivers it itself (its sender retries) now that the webhook is up, and
    -- empties its file; had the other taken the file too, the record would come twice
    assert.is_true(db:flush(10))
    assert.equal(1, #bodies(srv))
    assert.equal(0, s:stats().spooled)
    assert.same({}, readdir(path .. ".spool"))
    db:close()
    assert.matches("spool must be a directory path or true, got 5",
                   helper.err(tally.sink.http, { url = url, spool = 5 }))
    local mem = assert(tally.open())
    local ms = tally.sink.http { url = url, spool = true }
    mem:rollup("m:*", { every = 1, sinks = { ms } })
    assert.equal("spool = true needs a file store (or give spool a directory)", ms:stats().spool_last_error)
    ms:close()
    mem:close()
  end)
end)

describe("core.spool_append", function()
  local core = require "tally.core"

  it("starts a line of its own after a line left half written", function()
    local path = helper.tmpfile("spool.jsonl")
    helper.write(path, '{"name":"cut off')            -- a writer killed mid-line
    assert(core.spool_append(path, '{"name":"next"}\n'))
    assert.equal('{"name":"cut off\n{"name":"next"}\n', helper.slurp(path))
  end)

  it("undoes a write the disk had no room for, so the next line is whole (as root)", function()
    local dir = small_tmpfs("full", "16k")
    if not dir then return end
    finally(function() helper.sh("umount " .. helper.q(dir)) end)
    helper.sh("head -c 8192 /dev/zero > " .. helper.q(dir .. "/filler"))
    local path = dir .. "/spool.jsonl"
    local big = '{"name":"' .. string.rep("a", 6000) .. '"}\n'
    local failed = 0
    for _ = 1, 4 do
      if not core.spool_append(path, big) then failed = failed + 1 end
    end
    assert.is_true(failed > 0)                          -- the disk filled
    os.remove(dir .. "/filler")
    assert(core.spool_append(path, '{"name":"victim"}\n'))
    local text = helper.slurp(path)
    assert.equal('{"name":"victim"}\n', text:sub(-18))
    for line in text:gmatch("[^\n]+") do               -- every line whole
      assert.truthy(line == '{"name":"victim"}' or line == big:sub(1, -2), line:sub(1, 40))
    end
  end)
end)
