-- Histogram families: db:family(pattern, { histogram = { buckets =, unit = },
-- metric =, labels =, help = }) gives the histograms under pattern their
-- buckets and unit (db:histogram) and their Prometheus metric and labels
-- (tally.prometheus); bad mappings raise and record nothing, and a
-- histogram that disagrees with its family is refused without losing counts.
local helper = require "spec.support.helper"
local tally = require "tally"

local err = helper.err
local M = "http_request_duration_seconds"
local LAT = { histogram = { buckets = { 0.1, 0.5 } }, metric = M, labels = { "route" },
              help = "Request latency by route" }

local function memory()
  return assert(tally.open("memory"))
end

-- promtool check metrics on text, when promtool is installed.
local function promtool_clean(text)
  if helper.sh("command -v promtool || true") == "" then return end
  local ok, code, out = require("spec.support.peers").check_metrics(text)
  assert(ok, ("promtool check metrics failed (%s):\n%s\n%s"):format(code, out, text))
end

-- The lines of text about metric m (HELP, TYPE and samples), in order.
local function lines_of(text, m)
  local out = {}
  for line in text:gmatch("[^\n]+") do
    local name = line:match("^# %u+ (%S+)") or line:match("^([%w_:]+)")
    if name == m or name == m .. "_bucket" or name == m .. "_sum" or name == m .. "_count" then
      out[#out + 1] = line
    end
  end
  return out
end

describe("db:family with a histogram", function()
  local db
  before_each(function() db = memory() end)
  after_each(function() db:close() end)

  it("gives db:histogram the family's buckets and unit, and records the mapping", function()
    assert.is_true(db:family("lat:*", { histogram = { buckets = { 0.1, 0.5 }, unit = 1e-3 },
                                        metric = M, labels = { "route" } }))
    local h = assert(db:histogram("lat:/api"))
    assert.same({ 0.1, 0.5 }, h.buckets)
    assert.equal(1e-3, h.unit)
    assert.same({ "lat:/api{le=0.1}", "lat:/api{le=0.5}", "lat:/api{le=+Inf}",
                  "lat:/api{sum,unit=0.001}" }, h:names())
    -- the same buckets given again are fine; +Inf is implied
    assert(db:histogram("lat:/api", { buckets = { 0.1, 0.5, math.huge }, unit = 0.001 }))
    assert.same({ { pattern = "lat:*", metric = M, labels = { "route" }, type = "histogram",
                    histogram = { buckets = { 0.1, 0.5 }, unit = 1e-3 } } }, db:mappings())
    -- type = "histogram" alone: the default buckets and unit
    db:family("size:*", { type = "histogram", metric = "response_size_bytes",
                          labels = { "route" } })
    local s = assert(db:histogram("size:/x"))
    assert.same(tally.histogram.DEFAULT_BUCKETS, s.buckets)
    assert.equal(1e-6, s.unit)
    -- outside every family: as before
    assert.same(tally.histogram.DEFAULT_BUCKETS, assert(db:histogram("other")).buckets)
  end)

  it("is exposed as one Prometheus histogram with the wildcards as labels, promtool-clean", function()
    db:family("lat:*", LAT)
    db:family("rpc:*:*", { histogram = { buckets = { 1 }, unit = 1 }, metric = "rpc_seconds",
                           labels = { "service", "method" } })
    db:family("req:*", { metric = "requests_total", labels = { "route" }, type = "counter",
                         help = "Requests" })
    local api, home = assert(db:histogram("lat:/api")), assert(db:histogram("lat:/"))
    for _, v in ipairs({ 0.05, 0.2, 0.2, 0.7 }) do assert(api:observe(v)) end
    assert(home:observe(0.3))
    assert(assert(db:histogram("rpc:users:Get")):observe(2))
    db:incr("req:/api", 4)
    local text = tally.prometheus(db)
    assert.equal(table.concat({
      "# HELP requests_total Requests",
      "# TYPE requests_total counter",
      'requests_total{route="/api"} 4',
      "# HELP " .. M .. " Request latency by route",
      "# TYPE " .. M .. " histogram",
      M .. '_bucket{route="/",le="0.1"} 0',
      M .. '_bucket{route="/",le="0.5"} 1',
      M .. '_bucket{route="/",le="+Inf"} 1',
      M .. '_sum{route="/"} 0.3',
      M .. '_count{route="/"} 1',
      M .. '_bucket{route="/api",le="0.1"} 1',
      M .. '_bucket{route="/api",le="0.5"} 3',
      M .. '_bucket{route="/api",le="+Inf"} 4',
      M .. '_sum{route="/api"} 1.15',
      M .. '_count{route="/api"} 4',
      "# HELP rpc_seconds tally histograms 'rpc:*:*' (sums kept in units of 1)",
      "# TYPE rpc_seconds histogram",
      'rpc_seconds_bucket{service="users",method="Get",le="1"} 0',
      'rpc_seconds_bucket{service="users",method="Get",le="+Inf"} 1',
      'rpc_seconds_sum{service="users",method="Get"} 2',
      'rpc_seconds_count{service="users",method="Get"} 1', "" }, "\n"), text)
    promtool_clean(text)
  end)

  it("escapes label values, and the newest matching family decides", function()
    db:family("lat:*", LAT)
    db:family("lat:/admin*", { histogram = { buckets = { 1 } }, metric = "admin_seconds",
                               labels = { "page" } })
    assert(assert(db:histogram('lat:/q"x\\y')):observe(0.1))
    local adm = assert(db:histogram("lat:/admin/users"))
    assert.same({ 1 }, adm.buckets)
    assert(adm:observe(3))
    local text = tally.prometheus(db)
    assert.same({ "# HELP admin_seconds tally histograms 'lat:/admin*' (sums kept in units of 1e-06)",
                  "# TYPE admin_seconds histogram",
                  'admin_seconds_bucket{page="/users",le="1"} 0',
                  'admin_seconds_bucket{page="/users",le="+Inf"} 1',
                  'admin_seconds_sum{page="/users"} 3', 'admin_seconds_count{page="/users"} 1' },
                lines_of(text, "admin_seconds"))
    assert.matches(M .. '_bucket{route="/q\\"x\\\\y",le="0.1"} 1\n', text, 1, true)
    promtool_clean(text)
  end)

  it("without a metric gives only buckets: exposed by name, as histograms always were", function()
    db:family("lat:*", { histogram = { buckets = { 2 } } })
    local h = assert(db:histogram("lat:/x"))
    assert.same({ 2 }, h.buckets)
    h:observe(1)
    assert.same({ "# HELP lat:_x tally histogram 'lat:/x' (sum kept in units of 1e-06)",
                  "# TYPE lat:_x histogram", 'lat:_x_bucket{le="2"} 1', 'lat:_x_bucket{le="+Inf"} 1',
                  "lat:_x_sum 1", "lat:_x_count 1" }, lines_of(tally.prometheus(db), "lat:_x"))
    assert.same({ { pattern = "lat:*", labels = {}, type = "histogram",
                    histogram = { buckets = { 2 }, unit = 1e-6 } } }, db:mappings())
  end)

  it("leaves plain counters under its pattern to the counter mappings", function()
    db:family("lat:*", LAT)
    db:incr("lat:stray", 2)                   -- a counter, not a histogram
    assert.equal("# HELP tally_value Exact value of a tally counter (the sum of its shards), "
                 .. 'by counter name.\n# TYPE tally_value gauge\ntally_value{counter="lat:stray"} 2\n',
                 tally.prometheus(db))
  end)

  it("raises on bad histogram mappings, and records nothing", function()
    db:family("req:*", { metric = "requests_total", labels = { "route" }, type = "counter" })
    db:family("q:*", { metric = "queue_count", labels = { "q" } })
    local before = db:mappings()
    local function bad(pattern, opts) return err(db.family, db, pattern, opts) end
    local function with(changes)
      local o = { histogram = { buckets = { 1 } }, metric = "m", labels = { "route" } }
      for k, v in pairs(changes) do o[k] = v end
      return o
    end
    assert.equal("bad argument #2 to 'family' (labels must name the 1 wildcard of 'lat:*' in order,"
                 .. " got 0 names)", bad("lat:*", with { labels = {} }))
    assert.equal("bad argument #2 to 'family' (labels must name the 2 wildcards of 'lat:*:*' in"
                 .. " order, got 1 name)", bad("lat:*:*", with {}))
    assert.equal("bad argument #2 to 'family' (labels[1] 'le' is the label of a histogram's bucket"
                 .. " bounds)", bad("lat:*", with { labels = { "le" } }))
    assert.equal("bad argument #2 to 'family' (metric 'requests_total' is a counter (family"
                 .. " 'req:*'), not a histogram)", bad("lat:*", with { metric = "requests_total" }))
    assert.equal("bad argument #2 to 'family' (metric 'queue_count' (family 'q:*') would collide"
                 .. " with the series of histogram metric 'queue' (queue_bucket, queue_sum,"
                 .. " queue_count))", bad("lat:*", with { metric = "queue" }))
    assert.equal("bad argument #2 to 'family' (metric 'tally_value' is reserved for counters"
                 .. " without a mapping)", bad("lat:*", with { metric = "tally_value" }))
    assert.equal("bad argument #2 to 'family' (a histogram family takes no 'shards' (its member"
                 .. " counters are slot counters, one shard per writer))",
                 bad("lat:*", with { shards = 4 }))
    assert.equal("bad argument #2 to 'family' (type of a histogram family must be 'histogram' (or"
                 .. " left out), got 'counter')", bad("lat:*", with { type = "counter" }))
    assert.equal("bad argument #2 to 'family' (histogram.buckets must increase:"
                 .. " histogram.buckets[2] = 1 after 2)",
                 bad("lat:*", with { histogram = { buckets = { 2, 1 } } }))
    assert.equal("bad argument #2 to 'family' (unknown option 'histogram.bucket'; expected"
                 .. " histogram.buckets, histogram.unit)",
                 bad("lat:*", with { histogram = { bucket = { 1 } } }))
    assert.equal("bad argument #2 to 'family' (histogram.unit must be a positive finite number,"
                 .. " got -1)", bad("lat:*", with { histogram = { unit = -1 } }))
    assert.equal("bad argument #2 to 'family' (histogram must be true or a table { buckets =,"
                 .. " unit = }, got 5)", bad("lat:*", with { histogram = 5 }))
    assert.equal("bad argument #2 to 'family' (a histogram family's pattern holds no { or } (its"
                 .. " histograms' names cannot), got 'lat{*}')",
                 bad("lat{*}", with {}))
    assert.equal("bad argument #2 to 'family' (labels and help need a metric)",
                 bad("lat:*", { histogram = true, labels = { "route" } }))
    assert.same(before, db:mappings())
    -- and a counter mapping cannot take a histogram's metric, or one of its series
    db:family("lat:*", LAT)
    assert.equal("bad argument #2 to 'family' (metric '" .. M .. "' is a histogram (family"
                 .. " 'lat:*'), not a counter)",
                 bad("x:*", { metric = M, labels = { "x" }, type = "counter" }))
    assert.equal("bad argument #2 to 'family' (metric '" .. M .. "_count' (family 'x:*') would"
                 .. " collide with the series of histogram metric '" .. M .. "' (" .. M .. "_bucket, "
                 .. M .. "_sum, " .. M .. "_count))",
                 bad("x:*", { metric = M .. "_count", labels = { "x" } }))
    assert.equal(3, #db:mappings())
    -- a histogram mapping of another pattern shares a metric: one family, two patterns
    assert.is_true(db:family("lat2:*", LAT))
  end)

  it("refuses a histogram whose buckets or unit differ from its family's, losing no counts", function()
    local h = assert(db:histogram("lat:/api", { buckets = { 1, 2 } }))   -- before the family
    for _, v in ipairs({ 0.5, 1.5, 3 }) do h:observe(v) end
    db:family("lat:*", LAT)
    assert.same({ nil, "histogram 'lat:/api' exists with buckets 1, 2, +Inf, not 0.1, 0.5, +Inf"
                       .. " (family 'lat:*')", "EEXIST" }, { db:histogram("lat:/api") })
    assert.equal("bad argument #2 to 'histogram' (buckets 1, 2, +Inf differ from those of family"
                 .. " 'lat:*' (0.1, 0.5, +Inf))",
                 err(db.histogram, db, "lat:/new", { buckets = { 1, 2 } }))
    assert.equal("bad argument #2 to 'histogram' (unit 0.001 differs from that of family 'lat:*'"
                 .. " (1e-06))", err(db.histogram, db, "lat:/new", { unit = 0.001 }))
    assert.same({ "lat:/api{le=+Inf}", "lat:/api{le=1}", "lat:/api{le=2}",
                  "lat:/api{sum,unit=1e-06}" }, db:names())      -- nothing made for lat:/new
    -- the old handle still counts, and every count is there
    assert.is_true(h:observe(0.5))
    assert.same({ ["lat:/api{le=1}"] = 2, ["lat:/api{le=2}"] = 1, ["lat:/api{le=+Inf}"] = 1,
                  ["lat:/api{sum,unit=1e-06}"] = 5500000 }, db:snapshot())
    assert.equal(4, h:snapshot().count)
  end)

  it("opens new histograms and scrapes many without a walk of the store for each", function()
    -- a walk (db:names, db:snapshot) reads every counter: one per
    -- histogram made opening and scraping many of them quadratic
    local methods = getmetatable(db).__index
    local walks, names, snapshot = 0, methods.names, methods.snapshot
    methods.names = function(...) walks = walks + 1; return names(...) end
    methods.snapshot = function(...) walks = walks + 1; return snapshot(...) end
    local ok, e = pcall(function()
      db:family("lat:*", LAT)
      for i = 1, 50 do assert(db:histogram("lat:/" .. i)):observe(i / 100) end
      assert.equal(0, walks)                        -- new: no complete histogram to find
      local text = tally.prometheus(db)
      assert.equal(1, walks)                        -- one snapshot of all (the names: C's walk)
      for i = 1, 50 do
        local want = i / 100 <= 0.1 and 1 or 0
        assert.matches(M .. '_bucket{route="/' .. i .. '",le="0.1"} ' .. want .. "\n", text, 1, true)
        assert.matches(M .. '_count{route="/' .. i .. '"} 1\n', text, 1, true)
      end
      -- an existing one: its +Inf bucket carries the mark of these names
      walks = 0
      for i = 1, 50 do assert(db:histogram("lat:/" .. i)):observe(1) end
      assert.equal(0, walks)
      assert.equal(2, db:histogram("lat:/7"):snapshot().count)
    end)
    methods.names, methods.snapshot = names, snapshot
    assert(ok, e)
  end)

  it("walks the store to reopen a histogram only when its mark is not that of the names asked for", function()
    local methods = getmetatable(db).__index
    local walks, names = 0, methods.names
    methods.names = function(...) walks = walks + 1; return names(...) end
    local ok, e = pcall(function()
      -- members made as a version before the mark made them: unmarked
      for _, n in ipairs({ "old{le=1}", "old{le=2}", "old{le=+Inf}", "old{sum,unit=1e-06}" }) do
        assert(db:counter(n, { policy = "slot" })):incr(1)
      end
      local h = assert(db:histogram("old"))          -- the stored buckets decide, found by a walk
      assert.equal(1, walks)
      assert.same({ 1, 2 }, h.buckets)
      assert(db:histogram("old", { buckets = { 1, 2 } }))   -- marked by the open above
      assert.equal(1, walks)
      -- other buckets or unit than the mark's: a walk finds the stored set
      local h2, msg, code = db:histogram("old", { buckets = { 1, 2, 3 } })
      assert.is_nil(h2)
      assert.equal("EEXIST", code)
      assert.matches("exists with buckets 1, 2, +Inf, not 1, 2, 3, +Inf", msg, 1, true)
      assert.equal(2, walks)
      h2, msg, code = db:histogram("old", { unit = 1e-3 })
      assert.is_nil(h2)
      assert.equal("EEXIST", code)
      assert.equal(3, walks)
      -- the first writer's mark stays: a histogram made with the default
      -- buckets, reopened with none given, is found without a walk
      assert(db:histogram("new")):observe(0.3)
      assert.equal(3, walks)
      assert.same(tally.histogram.DEFAULT_BUCKETS, assert(db:histogram("new")).buckets)
      assert.equal(3, walks)
      -- a member dropped under a marked histogram is made again
      assert(db:drop("new{le=0.5}"))
      assert(db:histogram("new")):observe(0.3)
      assert.equal(3, walks)
      assert.equal(1, db:value("new{le=0.5}"))
      assert.equal(1, db:histogram("new"):snapshot().count)   -- the dropped count is gone
    end)
    methods.names = names
    assert(ok, e)
  end)

  describe("in a scrape", function()
    local logged, capture, restore = helper.logger_capture()
    before_each(capture)
    after_each(restore)

    it("leaves out, counts and logs histograms it cannot label, never failing", function()
      db:family("rpc:*:*", { histogram = { buckets = { 1 } }, metric = "rpc_seconds",
                             labels = { "service", "method" }, help = "RPC latency" })
      db:family("a:*", { histogram = { buckets = { 1 } }, metric = "ab_seconds", labels = { "x" },
                         help = "A and B" })
      db:family("b:*", { histogram = { buckets = { 1 } }, metric = "ab_seconds", labels = { "x" } })
      db:family("c:*", { metric = "ok_seconds_sum", labels = { "x" } })
      assert(db:histogram("rpc:users:Get")):observe(0.5)
      assert(db:histogram("rpc:a:b:c")):observe(0.5)      -- service "a:b" or "a"?
      assert(db:histogram("a:1")):observe(0.5)            -- a:1 and b:1: one series
      assert(db:histogram("b:1")):observe(0.5)
      assert(db:histogram("a:2")):observe(0.5)
      assert(db:histogram("ok_seconds")):observe(0.5)     -- its _sum is a counter metric
      local text = tally.prometheus(db)
      assert.same({ "# HELP ab_seconds A and B", "# TYPE ab_seconds histogram",
                    'ab_seconds_bucket{x="2",le="1"} 1', 'ab_seconds_bucket{x="2",le="+Inf"} 1',
                    'ab_seconds_sum{x="2"} 0.5', 'ab_seconds_count{x="2"} 1' },
                  lines_of(text, "ab_seconds"))
      assert.same({ "# HELP rpc_seconds RPC latency", "# TYPE rpc_seconds histogram",
                    'rpc_seconds_bucket{service="users",method="Get",le="1"} 1',
                    'rpc_seconds_bucket{service="users",method="Get",le="+Inf"} 1',
                    'rpc_seconds_sum{service="users",method="Get"} 0.5',
                    'rpc_seconds_count{service="users",method="Get"} 1' },
                  lines_of(text, "rpc_seconds"))
      assert.same({}, lines_of(text, "ok_seconds"))
      assert.matches('\ntally_prometheus_skipped{reason="ambiguous"} 1\n'
                     .. 'tally_prometheus_skipped{reason="duplicate"} 3\n$', text)
      table.sort(logged)                  -- ambiguous, then duplicate; once each
      assert.equal(3, #logged)
      assert.matches("histogram 'rpc:a:b:c' matches 'rpc:*:*' in more than one way", logged[1], 1, true)
      assert.matches("histogram 'ok_seconds' maps to the metric ok_seconds, which another family has",
                     logged[2], 1, true)
      assert.matches("histograms 'a:1' and 'b:1' both map to the series ab_seconds{x=\"1\"}",
                     logged[3], 1, true)
      promtool_clean(text)
    end)
  end)

  it("passes through tally.format.prometheus: histogram mappings claim no counter", function()
    db:family("lat:*", LAT)
    db:family("req:*", { metric = "requests_total", labels = { "route" }, type = "counter" })
    local text = tally.format.prometheus({ { name = "req:/a", value = 1 },
                                           { name = "lat:/a{le=0.1}", value = 2 } }, db:mappings())
    assert.equal('# TYPE requests_total counter\nrequests_total{route="/a"} 1\n'
                 .. "# HELP tally_value Exact value of a tally counter (the sum of its shards), by"
                 .. ' counter name.\n# TYPE tally_value gauge\ntally_value{counter="lat:/a{le=0.1}"}'
                 .. " 2\n", text)
    local mapping = db:mappings()
    mapping[#mapping + 1] = { pattern = "x:*", metric = M, labels = { "x" }, type = "counter" }
    assert.equal("bad argument #2 to 'prometheus' (metric '" .. M .. "' is a histogram in mapping[1]"
                 .. " and a counter in mapping[3])", err(tally.format.prometheus, {}, mapping))
  end)

  it("rolls up with history like any histogram: its members are counters", function()
    db:family("lat:*", LAT)
    local h = assert(db:histogram("lat:/api"))
    db:rollup("lat:*", { every = 1, keep = { "60x1s" } })
    local T0 = 1700000000
    for i = 0, 4 do
      h:observe(0.05); h:observe(0.3)
      db:tick(T0 + i)
    end
    assert.same({ t = T0 + 4, v = 5 }, db:counter("lat:/api{le=0.1}"):history("1s")[5])
    assert.same({ t = T0 + 4, v = 5 }, db:counter("lat:/api{le=0.5}"):history("1s")[5])
    assert.same({ t = T0 + 4, v = 350000 * 5 }, db:counter("lat:/api{sum,unit=1e-06}"):history("1s")[5])
    assert.equal(0, db:counter("lat:/api{le=+Inf}"):rolled().value)
  end)
end)
