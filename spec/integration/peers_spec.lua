-- The real peers of spec/support/peers.lua start, answer, keep what they are sent,
-- and are gone after stop().
local helper = require "spec.support.helper"
local peers = require "spec.support.peers"
local cjson = require "cjson"

local started = {}   -- every server this file starts
local function track(srv)
  started[#started + 1] = srv
  return srv
end

-- stop() it, then check that its process and directory are gone.
local function assert_stopped(srv)
  srv.stop()
  assert.is_false(peers.alive(srv.pid), srv.name .. " still running")
  local st = peers.pstate(srv.pid)
  assert.is_true(st == nil or st == "Z", "state " .. tostring(st))
  assert.is_nil(io.open(srv.dir .. "/log", "r"), srv.dir .. " still there")
  assert.is_nil((peers.http("GET", srv.url .. "/", nil, { timeout = 2 })))
end

describe("a Pushgateway", function()
  local pg
  setup(function() pg = track(peers.start_pushgateway()) end)
  teardown(function() if pg then pg.stop() end end)

  it("listens on 127.0.0.1 and takes pushed text back out", function()
    assert.matches("^http://127%.0%.0%.1:%d+$", pg.url)
    local text = "# HELP tally_hits_total Hits.\n# TYPE tally_hits_total counter\n" ..
                 'tally_hits_total{shard="1"} 42\n'
    local status = peers.http("POST", pg.url .. "/metrics/job/x", text,
      { headers = { ["Content-Type"] = "text/plain; version=0.0.4" } })
    assert.equal(200, status)

    local s, body = peers.http("GET", pg.url .. "/metrics")
    assert.equal(200, s)
    assert.truthy(body:find('tally_hits_total{instance="",job="x",shard="1"} 42\n', 1, true), body)

    local s2, json = peers.http("GET", pg.url .. "/api/v1/metrics")
    assert.equal(200, s2)
    local group = cjson.decode(json).data[1]
    assert.equal("x", group.labels.job)
    assert.equal("42", group.tally_hits_total.metrics[1].value)
    assert.equal("1", group.tally_hits_total.metrics[1].labels.shard)
  end)

  it("refuses text it cannot parse, with 400", function()
    local status, body = peers.http("POST", pg.url .. "/metrics/job/x", "tally hits 1\n")
    assert.equal(400, status)
    assert.matches("parsing error", body)
  end)

  it("is gone after stop()", function() assert_stopped(pg) end)
end)

describe("an InfluxDB", function()
  local ix
  setup(function() ix = track(peers.start_influxdb()) end)
  teardown(function() if ix then ix.stop() end end)

  it("takes a line-protocol point and answers a query with it", function()
    assert.equal(2, #ix.ports)
    assert.are_not.equal(ix.ports[1], ix.ports[2])
    local s = peers.http("POST", ix.url .. "/query", "q=" .. peers.urlencode("CREATE DATABASE tally"))
    assert.equal(200, s)

    s = peers.http("POST", ix.url .. "/write?db=tally&precision=s",
      "tally_hits,counter=hits,shard=1 value=42i 1700000000\n")
    assert.equal(204, s)

    local body
    s, body = peers.http("GET", ix.url .. "/query?db=tally&epoch=s&q=" ..
      peers.urlencode("SELECT value FROM tally_hits WHERE counter = 'hits'"))
    assert.equal(200, s)
    local series = cjson.decode(body).results[1].series[1]
    assert.equal("tally_hits", series.name)
    assert.same({ "time", "value" }, series.columns)
    assert.same({ { 1700000000, 42 } }, series.values)
  end)

  it("refuses a malformed line with 400", function()
    local s, body = peers.http("POST", ix.url .. "/write?db=tally&precision=s", "tally_hits value=\n")
    assert.equal(400, s)
    assert.matches("unable to parse", body)
  end)

  it("is gone after stop()", function() assert_stopped(ix) end)
end)

describe("tally-http-sink", function()
  local sink
  setup(function() sink = track(peers.start_http_sink { control = true }) end)
  teardown(function() if sink then sink.stop() end end)

  it("logs each request as one JSON line", function()
    local body = '{"counter":"hits","value":42,"note":"tab\\t \\"q\\" \\u00e9"}'
    local s, answer = peers.http("POST", sink.url .. "/hook?x=1", body,
      { headers = { ["Content-Type"] = "application/json", ["X-Tally"] = "1" } })
    assert.equal(200, s)
    assert.equal("ok\n", answer)
    local reqs = sink.requests()
    assert.equal(1, #reqs)
    local r = reqs[1]
    assert.equal("POST", r.method)
    assert.equal("/hook?x=1", r.path)
    assert.equal("application/json", r.content_type)
    assert.equal("1", r.headers["x-tally"])
    assert.equal(tostring(#body), r.headers["content-length"])
    assert.equal(body, r.body)
    assert.same({ counter = "hits", value = 42, note = 'tab\t "q" é' }, cjson.decode(r.body))
  end)

  it("serves several requests on one kept-alive connection", function()
    local out = helper.sh(("env -u LD_PRELOAD curl -q -s --noproxy '*' -w '%%{http_code} %%{num_connects}\\n' " ..
      "-o /dev/null %s/a -o /dev/null %s/b"):format(sink.url, sink.url))
    assert.equal("200 1\n200 0\n", out)  -- the second request made no new connection
    local reqs = sink.requests()
    assert.equal("/a", reqs[#reqs - 1].path)
    assert.equal("/b", reqs[#reqs].path)
    assert.equal(cjson.null, reqs[#reqs].content_type)
  end)

  it("fails on request through /control, then recovers", function()
    local before = #sink.requests()
    local s, msg = sink.control(500)
    assert.equal(200, s)
    assert.equal("status=500 delay_ms=0\n", msg)
    assert.equal(500, (peers.http("POST", sink.url .. "/hook", "one")))
    assert.equal(500, (peers.http("POST", sink.url .. "/hook", "two")))
    assert.equal(200, (peers.http("GET", sink.url .. "/control?status=200")))
    assert.equal(200, (peers.http("POST", sink.url .. "/hook", "three")))
    local reqs = sink.requests()
    assert.equal(before + 3, #reqs)  -- /control is not logged
    assert.same({ "one", "two", "three" },
      { reqs[before + 1].body, reqs[before + 2].body, reqs[before + 3].body })
  end)

  it("answers after the delay it is given", function()
    assert.equal(200, (sink.control(nil, 300)))
    local f = assert(io.open("/proc/uptime"))
    local t0 = f:read("n")
    f:close()
    assert.is_nil((peers.http("POST", sink.url .. "/slow", "x", { timeout = 0.1 })))
    assert.equal(200, (peers.http("POST", sink.url .. "/slow", "y", { timeout = 5 })))
    f = assert(io.open("/proc/uptime"))
    assert.is_true(f:read("n") - t0 >= 0.3)
    f:close()
    assert.equal(200, (sink.control(nil, 0)))
  end)

  it("starts answering with the status it is given", function()
    local other = track(peers.start_http_sink { status = 503 })
    finally(other.stop)
    assert.equal(503, (peers.http("POST", other.url .. "/hook", "x")))
    -- without --control, /control is an ordinary (logged) request
    assert.equal(503, (peers.http("GET", other.url .. "/control?status=200")))
    assert.equal(2, #other.requests())
    assert_stopped(other)
  end)

  it("is gone after stop()", function() assert_stopped(sink) end)
end)

describe("the peer helpers", function()
  it("report the end of the log when a server does not start", function()
    local msg = helper.err(peers.start_pushgateway, { args = { "--no-such-flag" } })
    assert.matches("pushgateway %(pid %d+%) exited at start", msg)
    assert.matches("unknown long flag '%-%-no%-such%-flag'", msg)
    -- the failed server's directory stays for a look; this one is expected
    local dir = assert(msg:match("the end of (/%S+)/log:"))
    assert.truthy(io.open(dir .. "/log", "r"))
    os.execute("rm -rf " .. helper.q(dir))
  end)

  it("hand out distinct free ports", function()
    local seen = {}
    for _ = 1, 50 do
      local p = peers.free_port()
      assert.is_nil(seen[p])
      seen[p] = true
    end
  end)

  it("leave none of this file's servers running", function()
    assert.equal(4, #started)
    local still = {}
    for _, srv in ipairs(started) do
      if peers.alive(srv.pid) then still[#still + 1] = srv.name .. " " .. srv.pid end
      for _, pid in ipairs(peers.running()) do
        if pid == srv.pid then still[#still + 1] = srv.name .. " " .. srv.pid .. " (not stopped)" end
      end
    end
    assert.same({}, still)
  end)
end)

-- promtool check metrics (Debian's prometheus 2.42) reads exposition text
-- on stdin. What it does, found by trying:
--   exit 0  valid, and also EMPTY input;
--   exit 3  it parses but lint fails: no HELP line, or a counter whose name
--           lacks "_total" (messages on stderr);
--   exit 1  it does not parse: bad sample line, bad label quoting, a second
--           TYPE line for a name or a TYPE after its samples, and input whose
--           last line has no "\n".
-- It does NOT catch the same series twice, a series of a family appearing
-- again after another family, or a negative counter: all exit 0. A sink
-- spec must check those itself.
describe("promtool check metrics", function()
  local good = "# HELP tally_hits_total Hits.\n# TYPE tally_hits_total counter\n" ..
               'tally_hits_total{shard="1"} 42\ntally_hits_total{shard="2"} 7\n'

  it("accepts valid exposition text", function()
    local ok, code, out = peers.check_metrics(good)
    assert.is_true(ok, out)
    assert.equal(0, code)
  end)

  it("rejects text it cannot parse with 1", function()
    for _, bad in ipairs({
      "tally hits 1\n",                                          -- space in a name
      'tally_hits_total{shard="1} 42\n',                          -- open quote
      good:sub(1, -2),                                            -- no final newline
      good .. "# TYPE tally_hits_total counter\n",                -- TYPE after samples
    }) do
      local ok, code, out = peers.check_metrics(bad)
      assert.is_false(ok, bad)
      assert.equal(1, code, out)
      assert.matches("parsing error", out)
    end
  end)

  it("flags lint problems with 3", function()
    local ok, code, out = peers.check_metrics("# TYPE tally_hits counter\ntally_hits 1\n")
    assert.is_false(ok)
    assert.equal(3, code)
    assert.matches('should have "_total" suffix', out)
    assert.matches("no help text", out)
  end)
end)
