-- tally.histogram: db:histogram, h:observe, h:snapshot, the member names,
-- the Prometheus exposition and rollups of the members.
local helper = require "spec.support.helper"
local tally = require "tally"
local histogram = require "tally.histogram"

local function memory()
  return assert(tally.open("memory"))
end

-- { le, cumulative count } pairs of a snapshot
local function cum(s)
  local out = {}
  for i, b in ipairs(s.buckets) do out[i] = { b.le, b.count } end
  return out
end

-- Parse Prometheus text: { [metric] = type }, { [series] = value } (series
-- as written, labels included), in the order written.
local function parse(text)
  local types, values, order = {}, {}, {}
  for line in text:gmatch("[^\n]+") do
    local m, t = line:match("^# TYPE (%S+) (%S+)$")
    if m then
      assert.is_nil(types[m], "family " .. m .. " twice")
      types[m] = t
    elseif not line:find("^# HELP ") then
      local s, v = line:match("^(%S+) (%S+)$")
      assert(s, "not a sample line: " .. line)
      values[s] = tonumber(v) or v
      order[#order + 1] = s
    end
  end
  return types, values, order
end

describe("db:histogram", function()
  local db
  before_each(function() db = memory() end)
  after_each(function() db:close() end)

  it("counts each observation in the first bucket whose bound it does not exceed", function()
    local h = assert(db:histogram("lat", { buckets = { 0.01, 0.1, 1 } }))
    for _, v in ipairs({ 0.005, 0.01, 0.0100001, 0.1, 0.5, 1, 1.5, 100, -3 }) do
      assert.is_true(h:observe(v))
    end
    local s = h:snapshot()
    assert.same({ { 0.01, 3 }, { 0.1, 5 }, { 1, 7 }, { math.huge, 9 } }, cum(s))
    assert.equal(9, s.count)
    assert.equal(1e-6, s.unit)
    -- the sum in microseconds, each observation rounded to the nearest one
    assert.equal(5000 + 10000 + 10000 + 100000 + 500000 + 1000000 + 1500000 + 100000000 - 3000000,
                 s.sum_units)
    assert.near(s.sum_units * 1e-6, s.sum, 1e-9)
  end)

  it("stores one counter per bucket, not cumulative, plus +Inf and the sum, all slot counters", function()
    local h = assert(db:histogram("lat", { buckets = { 0.5, 2 } }))
    assert.same({ "lat{le=0.5}", "lat{le=2}", "lat{le=+Inf}", "lat{sum,unit=1e-06}" }, h:names())
    h:observe(0.1); h:observe(0.1); h:observe(1); h:observe(3)
    assert.same({ ["lat{le=0.5}"] = 2, ["lat{le=2}"] = 1, ["lat{le=+Inf}"] = 1,
                  ["lat{sum,unit=1e-06}"] = 4200000 }, db:snapshot())
    for _, n in ipairs(h:names()) do assert.equal("slot", db:counter(n):info().policy) end
  end)

  it("refuses a member name taken by a counter of another policy, and changes nothing", function()
    db:counter("busy{le=+Inf}", { policy = "thread", shards = 4 }):incr(7)
    local h, msg, code = db:histogram("busy", { buckets = { 1 } })
    assert.is_nil(h)
    assert.equal("EPOLICY", code)
    assert.matches("busy{le=+Inf}", msg, 1, true)
    assert.equal(7, db:value("busy{le=+Inf}"))
    assert.equal("thread", db:counter("busy{le=+Inf}"):info().policy)
  end)

  it("refuses members its family's cap would send to the overflow counter", function()
    assert(db:family("capped:*", { max_counters = 3 }))
    local h, msg, code = db:histogram("capped:h", { buckets = { 1, 2 } })   -- 4 members
    assert.is_nil(h)
    assert.equal("EFULL", code)
    assert.matches("histogram member 'capped:h{sum,unit=1e-06}': its family is at its cap", msg, 1, true)
    assert.equal(0, db:sum("capped:*"))
    -- within the cap, it opens and counts in its own members
    assert(db:family("roomy:*", { max_counters = 4 }))
    h = assert(db:histogram("roomy:h", { buckets = { 1, 2 } }))
    assert.is_true(h:observe(1.5))
    assert.equal(1, db:value("roomy:h{le=2}"))
    assert.is_nil(db:value("roomy:_overflow"))
  end)

  it("rounds the sum to the nearest unit, halves away from zero", function()
    local h = assert(db:histogram("n", { buckets = { 10 }, unit = 1 }))
    for _, v in ipairs({ 0.4, 0.5, 1.5, -0.5, -0.4, 2 }) do h:observe(v) end
    assert.equal(0 + 1 + 2 - 1 + 0 + 2, h:snapshot().sum_units)
    assert.equal(4, h:snapshot().sum)
    local g = assert(db:histogram("bytes", { buckets = { 1024 }, unit = 1 }))
    assert.same({ "bytes{le=1024}", "bytes{le=+Inf}", "bytes{sum,unit=1}" }, g:names())
  end)

  it("reads the sum as the double nearest units times unit", function()
    local h = assert(db:histogram("d", { buckets = { 1 } }))       -- unit 1e-6
    assert.is_true(h:observe(0.1))
    assert.equal(0.1, h:snapshot().sum)                 -- not 100000 * 1e-6, 0.09999999999999999
    assert.matches("\nd_sum 0.1\n", tally.prometheus(db, "d{*}"), 1, true)
    local k = assert(db:histogram("k", { buckets = { 1 }, unit = 0.25 }))
    assert.is_true(k:observe(0.75))
    assert.equal(0.75, k:snapshot().sum)
    local t = assert(db:histogram("t", { buckets = { 1 }, unit = 3 }))
    assert.is_true(t:observe(7))                        -- 2 units of 3
    assert.equal(6, t:snapshot().sum)
  end)

  it("writes bounds so that they read back exactly", function()
    local b = { 2.5e-7, 0.1, 1 / 3, 123456789.123, 1e21 }
    local h = assert(db:histogram("x", { buckets = b }))
    local names = h:names()
    for i, x in ipairs(b) do
      local base, kind, v = histogram.parse(names[i])
      assert.same({ "x", "le", x }, { base, kind, v })
    end
    assert.same({ "x{le=2.5e-07}", "x{le=0.1}", "x{le=0.3333333333333333}",
                  "x{le=123456789.123}", "x{le=1e+21}" }, { table.unpack(names, 1, 5) })
  end)

  it("opens an existing histogram as stored, and refuses other buckets or another unit", function()
    local h = assert(db:histogram("lat", { buckets = { 1, 2 }, unit = 0.001 }))
    h:observe(1.5)
    local again = assert(db:histogram("lat"))
    assert.same({ 1, 2 }, again.buckets)
    assert.equal(0.001, again.unit)
    again:observe(0.5)
    assert.same({ { 1, 1 }, { 2, 2 }, { math.huge, 2 } }, cum(h:snapshot()))
    assert(db:histogram("lat", { buckets = { 1, 2, math.huge } }))   -- +Inf is implied
    assert.same({ nil, "histogram 'lat' exists with buckets 1, 2, +Inf, not 1, 3, +Inf", "EEXIST" },
                { db:histogram("lat", { buckets = { 1, 3 } }) })
    assert.same({ nil, "histogram 'lat' exists with unit 0.001, not 1e-06", "EEXIST" },
                { db:histogram("lat", { unit = 1e-6 }) })
    -- the default buckets for a new one
    assert.same(histogram.DEFAULT_BUCKETS, assert(db:histogram("other")).buckets)
  end)

  it("is found from the store's names by db:histograms", function()
    db:histogram("b", { buckets = { 1 } })
    db:histogram("a", { buckets = { 0.5, 5 }, unit = 0.01 })
    db:incr("a{le=7}")                       -- a lone counter that looks like a member
    db:incr("c{le=1}")                       -- no +Inf, no sum: not a histogram
    assert.same({ { name = "a", buckets = { 0.5, 5, 7 }, unit = 0.01 },
                  { name = "b", buckets = { 1 }, unit = 1e-6 } }, db:histograms())
    assert.same({ { name = "b", buckets = { 1 }, unit = 1e-6 } }, db:histograms("b*"))
    assert.same({}, db:histograms("z*"))
  end)

  it("has helpers that check their arguments", function()
    local hm, e = tally.histogram, helper.err
    assert.equal("bad argument #1 to 'quantile' (a histogram as read() gives it expected, got nil)",
                 e(hm.quantile, nil, 0.5))
    assert.matches("bad argument #1 to 'quantile'", e(hm.quantile, {}, 0.5), 1, true)
    local r = hm.read({ ["x{le=1}"] = 2, ["x{le=+Inf}"] = 1, ["x{sum,unit=1}"] = 3 },
                      hm.group({ "x{le=1}", "x{le=+Inf}", "x{sum,unit=1}" }).x)
    assert.equal(3, r.count)
    assert.equal(1, hm.quantile(r, 0.5))
    assert.equal("bad argument #2 to 'quantile' (q must be a number from 0 to 1, got 2)",
                 e(hm.quantile, r, 2))
    assert.matches("bad argument #1 to 'read' (snapshot table expected", e(hm.read, nil, {}), 1, true)
    assert.matches("bad argument #2 to 'read' (a histogram as group() gives it expected",
                   e(hm.read, {}, {}), 1, true)
    assert.equal("bad argument #1 to 'group' (table of names expected, got true)", e(hm.group, true))
  end)

  it("raises for bad names, buckets, units and observations, and adds nothing", function()
    local e = helper.err
    assert.equal("bad argument #1 to 'histogram' (string expected, got nil)", e(db.histogram, db))
    assert.equal("bad argument #1 to 'histogram' (a histogram name is not empty and holds none of"
                 .. " * ? { } or NUL, got 'a*b')", e(db.histogram, db, "a*b"))
    assert.equal("bad argument #1 to 'histogram' (a histogram name is not empty and holds none of"
                 .. " * ? { } or NUL, got 'a{')", e(db.histogram, db, "a{"))
    assert.equal("bad argument #2 to 'histogram' (buckets must increase: buckets[2] = 1 after 2)",
                 e(db.histogram, db, "h", { buckets = { 2, 1 } }))
    assert.equal("bad argument #2 to 'histogram' (buckets must increase: buckets[2] = 1 after 1)",
                 e(db.histogram, db, "h", { buckets = { 1, 1 } }))
    assert.equal("bad argument #2 to 'histogram' (buckets[2] must be a number, got nan)",
                 e(db.histogram, db, "h", { buckets = { 1, 0 / 0 } }))
    assert.equal("bad argument #2 to 'histogram' (buckets[1] must be a number, got '1')",
                 e(db.histogram, db, "h", { buckets = { "1" } }))
    assert.equal("bad argument #2 to 'histogram' (buckets must be a non-empty array of numbers,"
                 .. " got table)", e(db.histogram, db, "h", { buckets = {} }))
    assert.equal("bad argument #2 to 'histogram' (unit must be a positive finite number, got 0)",
                 e(db.histogram, db, "h", { unit = 0 }))
    assert.equal("bad argument #2 to 'histogram' (unknown option 'bucket'; expected buckets, unit, buffer)",
                 e(db.histogram, db, "h", { bucket = { 1 } }))
    assert.matches("^bad argument #1 to 'histogram' %(name too long: its member '.*' would be 2%d%d"
                   .. " bytes %(at most 255%)%)$", e(db.histogram, db, ("n"):rep(240)))
    assert.same({}, db:names())              -- nothing was created
    local h = assert(db:histogram("h", { buckets = { 1 } }))
    assert.equal("bad argument #1 to 'observe' (number expected, got nan)", e(h.observe, h, 0 / 0))
    assert.equal("bad argument #1 to 'observe' (number expected, got '1')", e(h.observe, h, "1"))
    assert.equal("bad argument #1 to 'observe' (number expected, got nil)", e(h.observe, h))
    assert.equal("bad argument #1 to 'observe' (inf is out of range (|v / unit| must be at most"
                 .. " 2^53, unit 1e-06))", e(h.observe, h, math.huge))
    assert.matches("out of range", e(h.observe, h, 1e10))   -- 1e16 microseconds
    assert.equal("bad argument #1 to 'observe' (tally.histogram expected, got table)",
                 e(h.observe, {}, 1))
    assert.same({ count = 0, sum_units = 0 }, { count = h:snapshot().count,
                                                 sum_units = h:snapshot().sum_units })
    db:close()
    assert.matches("closed store", e(h.observe, h, 1))
    db = memory()
  end)

  it("observes in one C call under Lua 5.4, with the Lua method's errors", function()
    local h = assert(db:histogram("c", { buckets = { 1 } }))
    assert.equal("C", debug.getinfo(h.observe, "S").what)
    assert.equal(h.w, h[1])
    assert.is_true(h:observe(0.5))
    assert.is_true(h:observe(1.5))
    assert.equal("bad argument #1 to 'observe' (number expected, got nil)",
                 helper.err(h.observe, h))
    assert.equal("bad argument #1 to 'observe' (tally.histogram expected, got table)",
                 helper.err(h.observe, { h.w }, 1))   -- the writer alone is not enough
    local s = h:snapshot()
    assert.equal(2, s.count)
    assert.equal(2, s.sum)
  end)

  it("returns a failed observation as nil, message, code and adds nothing", function()
    local h = assert(db:histogram("d", { buckets = { 1 } }))
    assert(h:observe(0.5))
    assert(h:observe(2))
    assert.is_true(db:drop("d{le=1}"))
    local ok, msg, code = h:observe(0.5)      -- its bucket is gone
    assert.is_nil(ok)
    assert.equal("counter 'd{le=1}' was dropped", msg)
    assert.equal("EDROPPED", code)
    assert.equal(2, db:value("d{sum,unit=1e-06}") // 1e6)   -- the sum took nothing of it
    assert(h:observe(3))                      -- the other buckets go on
    assert.equal(2, db:value("d{le=+Inf}"))
  end)

  it("keeps count, buckets and sum exact through a tight loop of observations and snapshots", function()
    local h = assert(db:histogram("t", { buckets = { 1, 2, 3 }, unit = 1 }))
    local n = { 0, 0, 0, 0 }
    for i = 1, 20000 do
      local v = i % 4 + 1               -- 1, 2, 3 in their buckets, 4 in +Inf
      h:observe(v)
      n[v] = n[v] + 1
      if i % 97 == 0 then
        local s = h:snapshot()
        assert.equal(i, s.count)
        assert.equal(s.count, s.buckets[4].count)
        assert.equal(n[1] + 2 * n[2] + 3 * n[3] + 4 * n[4], s.sum_units)
      end
    end
  end)
end)

describe("a buffered histogram (db:histogram(name, { buffer = N }))", function()
  -- the members' values as the store holds them, without flushing
  local function stored(db, h)
    local out = {}
    for _, n in ipairs(h:names()) do out[#out + 1] = db:value(n) end
    return out
  end

  it("holds up to N observations and adds them as one batch when full or flushed", function()
    local db = memory()
    local h = assert(db:histogram("lat", { buckets = { 1, 2 }, unit = 1, buffer = 3 }))
    assert.equal(3, h.buffer)
    assert.is_true(h:observe(0.5))
    assert.is_true(h:observe(1.5))
    assert.is_true(h:observe(7))
    assert.same({ 0, 0, 0, 0 }, stored(db, h))        -- held
    assert.is_true(h:observe(1))                      -- full: the three go first
    assert.same({ 1, 1, 1, 10 }, stored(db, h))       -- 0.5 rounds to 1 (halves away)
    assert.is_true(h:flush())
    assert.same({ 2, 1, 1, 11 }, stored(db, h))
    assert.is_true(h:flush())                         -- nothing held: nothing to do
    -- h:snapshot flushes this handle first; db:snapshot does not
    h:observe(2)
    assert.equal(1, db:snapshot("lat{*}")["lat{le=2}"])
    assert.equal(5, h:snapshot().count)
    -- db:tick and tally.prometheus flush every buffered histogram of db
    h:observe(2)
    db:tick()
    assert.same({ 2, 3, 1, 15 }, stored(db, h))
    h:observe(2)
    assert.matches('lat_count 7\n', tally.prometheus(db), 1, true)
    -- a handle without a buffer adds each observation at once
    local plain = assert(db:histogram("lat"))
    assert.equal(0, plain.buffer)
    plain:observe(2)
    assert.same({ 2, 5, 1, 19 }, stored(db, h))
    db:close()
  end)

  it("is flushed when closed or collected, so a file store keeps every observation", function()
    local path = helper.tmpfile("buffered.tly")
    os.remove(path)
    local db = assert(tally.open("file:" .. path))
    local h = assert(db:histogram("lat", { buffer = 1000 }))
    for i = 1, 2500 do h:observe(i / 1000) end
    h = nil -- luacheck: ignore
    collectgarbage(); collectgarbage()
    local g = assert(db:histogram("gone", { buffer = 100 }))
    for _ = 1, 10 do g:observe(0.01) end
    db:close()                                        -- flushes g (and h, if still open)
    db = assert(tally.open("file:" .. path))
    local s = assert(assert(db:histogram("lat")):snapshot())
    assert.equal(2500, s.count)
    assert.equal(2500 * 2501 / 2 * 1000, s.sum_units)
    assert.equal(10, assert(db:histogram("gone")):snapshot().count)
    db:close()
    os.remove(path)
  end)

  it("checks buffer, and h:flush its handle", function()
    local db = memory()
    for _, bad in ipairs({ -1, 1.5, "10", true, 1000001 }) do
      assert.matches("bad argument #2 to 'histogram' %(buffer must be a count of observations "
                     .. "from 0 to 1000000, got ", helper.err(db.histogram, db, "x", { buffer = bad }))
    end
    assert.matches("unknown option 'size'; expected buckets, unit, buffer",
                   helper.err(db.histogram, db, "x", { size = 1 }), 1, true)
    -- buffer is a handle's, not the store's: a family's histogram option refuses it
    assert.matches("unknown option 'histogram.buffer'",
                   helper.err(db.family, db, "f:*", { histogram = { buffer = 3 } }), 1, true)
    local x = assert(db:histogram("x", { buffer = 0 }))
    assert.equal(0, x.buffer)
    assert.is_true(x:flush())
    assert.matches("flush", helper.err(x.flush, 42), 1, true)
    db:close()
  end)
end)

describe("tally.prometheus with histograms", function()
  it("exposes a histogram: cumulative buckets, +Inf, _sum, _count, promtool-clean", function()
    local db = memory()
    db:incr("hits", 3)
    local h = assert(db:histogram("http_request_duration_seconds", { buckets = { 0.01, 0.1, 1 } }))
    for _, v in ipairs({ 0.005, 0.01, 0.05, 0.5, 2, 0.0015 }) do h:observe(v) end
    local text = tally.prometheus(db)
    local types, values, order = parse(text)
    assert.same({ tally_value = "gauge", http_request_duration_seconds = "histogram" }, types)
    local m = "http_request_duration_seconds"
    assert.same({ 'tally_value{counter="hits"}', m .. '_bucket{le="0.01"}', m .. '_bucket{le="0.1"}',
                  m .. '_bucket{le="1"}', m .. '_bucket{le="+Inf"}', m .. "_sum", m .. "_count" },
                order)
    assert.equal(3, values[m .. '_bucket{le="0.01"}'])
    assert.equal(4, values[m .. '_bucket{le="0.1"}'])
    assert.equal(5, values[m .. '_bucket{le="1"}'])
    assert.equal(6, values[m .. '_bucket{le="+Inf"}'])
    assert.equal(6, values[m .. "_count"])
    assert.equal(2.5665, values[m .. "_sum"])
    assert.matches("# HELP " .. m .. " tally histogram '" .. m .. "' (sum kept in units of 1e-06)\n",
                   text, 1, true)
    if helper.sh("command -v promtool || true") ~= "" then
      local ok, code, out = require("spec.support.peers").check_metrics(text)
      assert(ok, ("promtool check metrics failed (%s):\n%s\n%s"):format(code, out, text))
    end
    db:close()
  end)

  it("leaves out two histograms when one's metric is a series of the other's", function()
    local db = memory()
    local logged = {}
    local old = tally.logger(function(m) logged[#logged + 1] = m end)
    assert(assert(db:histogram("lat", { buckets = { 1 } })):observe(0.5))
    assert(assert(db:histogram("lat_sum", { buckets = { 1 } })):observe(0.5))
    assert(assert(db:histogram("ok", { buckets = { 1 } })):observe(0.5))
    local text = tally.prometheus(db)
    tally.logger(old)
    assert.not_matches("lat", (text:gsub("tally_prometheus_skipped[^\n]*", "")))
    assert.matches('\nok_count 1\n', text, 1, true)
    assert.matches('tally_prometheus_skipped{reason="duplicate"} 2\n', text, 1, true)
    assert.equal(1, #logged)
    assert.matches("histogram 'lat_sum' maps to the metric lat_sum, one of the series of "
                   .. "histogram 'lat' (metric lat)", logged[1], 1, true)
    if helper.sh("command -v promtool || true") ~= "" then
      local ok, code, out = require("spec.support.peers").check_metrics(text)
      assert(ok, ("promtool check metrics failed (%s):\n%s\n%s"):format(code, out, text))
    end
    -- families: refused whichever comes first
    for _, order in ipairs({ { "h", "h_count" }, { "h_count", "h" } }) do
      local d = memory()
      assert.is_true(d:family("a:*", { histogram = true, metric = order[1], labels = { "x" } }))
      assert.matches("would collide with the series of histogram metric 'h'",
                     helper.err(d.family, d, "b:*", { histogram = true, metric = order[2],
                                                      labels = { "x" } }), 1, true)
      d:close()
    end
    db:close()
  end)

  it("writes HELP texts in UTF-8 for names and patterns that are not", function()
    local db = memory()
    assert(assert(db:histogram("lat\xff", { buckets = { 1 } })):observe(0.5))
    db:family("rt:\xfe*", { histogram = true, metric = "rt_seconds", labels = { "route" } })
    assert(assert(db:histogram("rt:\xfe/a")):observe(0.5))
    local text = tally.prometheus(db)
    local helps = {}
    for line in text:gmatch("# HELP [^\n]+") do
      helps[#helps + 1] = line
      assert.truthy(require("tally.compat").utf8len(line), line)
    end
    assert.equal(2, #helps)
    assert.matches("tally histogram 'lat\\\\xff'", text, 1, true)      -- \xff, its \ escaped
    assert.matches("tally histograms 'rt:\\\\xfe*'", text, 1, true)
    db:close()
  end)

  it("exposes histograms when another counter with braces sums beyond int64", function()
    local db = memory()
    local logged = {}
    local old = tally.logger(function(m) logged[#logged + 1] = m end)
    assert(assert(db:histogram("lat", { buckets = { 0.1, 1 } })):observe(0.05))
    local c = assert(db:counter("cfg{region=eu}", { shards = 3 }))
    for i = 1, 3 do assert(c:add_shard(i, 4611686018427387903)) end
    local text = tally.prometheus(db)
    tally.logger(old)
    assert.matches('\nlat_count 1\n', text, 1, true)
    assert.matches('lat_bucket{le="0.1"} 1\n', text, 1, true)
    assert.not_matches("unreadable", text)
    assert.same({}, logged)
    db:close()
  end)

  it("leaves ordinary counters' exposition as it was", function()
    local db, plain = memory(), memory()
    for _, d in ipairs({ db, plain }) do
      d:family("req:*", { metric = "requests_total", labels = { "path" }, type = "counter" })
      d:incr("req:/a", 2); d:incr("other", 5); d:incr("x{le=1}", 1)  -- not a histogram
    end
    assert(db:histogram("lat", { buckets = { 1 } })):observe(0.5)
    local with, without = tally.prometheus(db), tally.prometheus(plain)
    assert.equal(without, with:sub(1, #without))
    assert.matches("^# HELP lat ", with:sub(#without + 1))
    db:close(); plain:close()
  end)

  it("sanitises the metric name and leaves out a histogram whose metric another family has", function()
    local db = memory()
    assert(db:histogram("api.latency", { buckets = { 1 } })):observe(1)
    assert(db:histogram("tally_value", { buckets = { 1 } })):observe(1)
    db:incr("c")
    local old = tally.logger()
    local logged = {}
    tally.logger(function(msg) logged[#logged + 1] = msg end)
    local types, values = parse(tally.prometheus(db))
    tally.logger(old)
    -- left out, and counted as a duplicate
    assert.same({ tally_value = "gauge", api_latency = "histogram", tally_prometheus_skipped = "gauge" },
                types)
    assert.equal(1, values['tally_prometheus_skipped{reason="duplicate"}'])
    assert.equal(1, #logged)
    assert.matches("histogram 'tally_value' maps to the metric tally_value", logged[1], 1, true)
    db:close()
  end)
end)

describe("histogram rollups", function()
  it("rolls up the member counters with history like any counter", function()
    local db = memory()
    local h = assert(db:histogram("lat", { buckets = { 0.1, 1 } }))
    db:rollup("lat{*}", { every = 1, keep = { "60x1s" } })
    local T0 = 1700000000
    for i = 0, 9 do
      h:observe(0.05); h:observe(0.5)
      db:tick(T0 + i)
    end
    for _, n in ipairs(h:names()) do
      local hist = assert(db:counter(n):history("1s"))
      assert.equal(10, #hist, n)
    end
    assert.same({ t = T0 + 9, v = 10 }, db:counter("lat{le=0.1}"):history("1s")[10])
    assert.same({ t = T0 + 9, v = 550000 * 10 }, db:counter("lat{sum,unit=1e-06}"):history("1s")[10])
    assert.equal(0, db:counter("lat{le=+Inf}"):rolled().value)
    db:close()
  end)
end)
