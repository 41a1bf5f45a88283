-- tally serve: the exporter, JSON API and dashboard of a store over HTTP.
-- Each test starts `tally serve` on a free loopback port and stops it by
-- PID; Prometheus and headless Chromium are started the same way, and the
-- tests that need them are left out with a message where they are missing.

local helper = require "spec.support.helper"
local peers = require "spec.support.peers"
local tally = require "tally"
local json = require "tally.json"

local q = helper.q
local NOPRELOAD = "env -u LD_PRELOAD "

local function now()
  local f = assert(io.open("/proc/uptime", "r"))
  local t = f:read("n")
  f:close()
  return t
end

local function sleep(s) os.execute("sleep " .. s) end

local function mkdir(what)
  local out, code = helper.sh(("mktemp -d \"$(cd %s && pwd)\"/%s.XXXXXX"):format(q(helper.tmpdir), what))
  assert(code == 0, out)
  return (out:gsub("%s+$", ""))
end

-- Run cmd in the background through a shell that records its PID in
-- DIR/pid and, when it ends, its exit status in DIR/rc; returns the PID.
local function background(dir, cmd)
  os.execute(("sh -c %s >/dev/null 2>&1 </dev/null &"):format(q(
    cmd .. " & echo $! > " .. q(dir .. "/pid") .. "; wait $!; echo $? > " .. q(dir .. "/rc.tmp")
    .. "; mv " .. q(dir .. "/rc.tmp") .. " " .. q(dir .. "/rc"))))
  local t0 = now()
  for _ = 1, 500 do
    local pid = tonumber(helper.slurp(dir .. "/pid") or "")
    if pid then return pid end
    if now() - t0 > 10 then break end
    sleep(0.02)
  end
  error("could not start: " .. cmd)
end

local servers = {}

-- Start `tally serve path args...` on a free port: srv = { pid, url, port,
-- dir, log }; raises with its log if it does not answer within 10 s.
local function serve(path, ...)
  local dir = mkdir("serve")
  local port = peers.free_port()
  local args = { q(helper.bin), "serve", q(path), "--listen", "127.0.0.1:" .. port }
  for i = 1, select("#", ...) do args[#args + 1] = q((select(i, ...))) end
  local srv = { dir = dir, port = port, url = "http://127.0.0.1:" .. port, log = dir .. "/log" }
  srv.pid = background(dir, table.concat(args, " ") .. " 2>" .. q(srv.log))
  servers[#servers + 1] = srv
  local t0 = now()
  for _ = 1, 500 do
    if (helper.slurp(srv.log) or ""):find("on http://", 1, true) then return srv end
    if helper.slurp(dir .. "/rc") or now() - t0 > 10 then break end
    sleep(0.02)
  end
  error("tally serve did not start: " .. (helper.slurp(srv.log) or ""))
end

-- Send sig to the server and wait (10 s at most) for its exit status.
local function stop(srv, sig)
  if srv.rc then return srv.rc end
  os.execute("kill -" .. (sig or "TERM") .. " " .. srv.pid .. " 2>/dev/null")
  local t0 = now()
  for _ = 1, 500 do
    local rc = helper.slurp(srv.dir .. "/rc")
    if rc then
      srv.rc = tonumber(rc)
      return srv.rc
    end
    if now() - t0 > 10 then break end
    sleep(0.02)
  end
  os.execute("kill -KILL " .. srv.pid .. " 2>/dev/null")
  error("tally serve (pid " .. srv.pid .. ") did not stop on SIG" .. (sig or "TERM"))
end

teardown(function()
  for _, srv in ipairs(servers) do pcall(stop, srv) end
end)

-- GET url: status, body, headers (lower-cased names). opts: headers,
-- compressed (let curl decode gzip), interface (source address).
local function get(url, opts)
  opts = opts or {}
  local body, hdrs = helper.tmpfile("body"), helper.tmpfile("headers")
  local args = { "curl", "-q", "-sS", "--noproxy", "*", "-g", "--max-time", "10", "-o", body,
                 "-D", hdrs, "-w", "%{http_code}" }
  if opts.compressed then args[#args + 1] = "--compressed" end
  if opts.interface then args[#args + 1] = "--interface"; args[#args + 1] = opts.interface end
  if opts.head then args[#args + 1] = "--head" end
  for k, v in pairs(opts.headers or {}) do args[#args + 1] = "-H"; args[#args + 1] = k .. ": " .. v end
  args[#args + 1] = url
  for i, a in ipairs(args) do args[i] = q(a) end
  local out = helper.sh(NOPRELOAD .. table.concat(args, " "))
  local h = {}
  for k, v in (helper.slurp(hdrs) or ""):gmatch("([%w%-]+):%s*([^\r\n]*)") do h[k:lower()] = v end
  local b = helper.slurp(body) or ""
  os.remove(body)
  os.remove(hdrs)
  return tonumber(out:match("(%d%d%d)%s*$")), b, h
end

local function decode(text)
  local v = json.decode(text)
  return v
end

-- A store of a few counters, one rolled up with history, one histogram.
local function store_for_api()
  local path = helper.tmpfile("serve.tly")
  local db = assert(tally.open("file:" .. path))
  for i = 1, 20 do db:incr("post:" .. i .. ":likes", i * 3) end
  db:incr("signups", 7)
  db:rollup("post:*", { every = 1, keep = { "60x1s", "10x1m" } })
  local t = 1700000000
  for k = 0, 4 do
    db:incr("post:3:likes", 10 * k)
    db:tick(t + k)
  end
  local h = db:histogram("lat")
  for i = 1, 50 do h:observe(i / 50) end
  return path, db
end

describe("tally serve", function()
  it("answers the JSON API exactly as db:values, db:top and c:history", function()
    local path, db = store_for_api()
    local srv = serve(path)
    local status, body, h = get(srv.url .. "/api/values")
    assert.equals(200, status, body)
    assert.equals("application/json; charset=utf-8", h["content-type"])
    assert.same(db:values(), decode(body).values)
    status, body = get(srv.url .. "/api/values?pattern=post:1*")
    assert.equals(200, status, body)
    assert.same(db:values("post:1*"), decode(body).values)
    for _, by in ipairs({ "value", "rate" }) do
      status, body = get(srv.url .. "/api/top?n=5&pattern=post:*&by=" .. by)
      assert.equals(200, status, body)
      assert.same(db:top("post:*", 5, by), decode(body).top)
    end
    status, body = get(srv.url .. "/api/counter?name=post:3:likes")
    assert.equals(200, status, body)
    local got = decode(body)
    local c = db:counter("post:3:likes", { create = false })
    assert.equals(c:value(), got.value)
    assert.same(c:shards(), got.shards)
    assert.same(c:history("1s"), got.history["1s"])
    assert.same(c:history("1m"), got.history["1m"])
    assert.same(c:rolled(), got.rolled)
    status, body = get(srv.url .. "/api/sum?pattern=post:*")
    local sum, count = db:sum("post:*")
    assert.same({ pattern = "post:*", sum = sum, count = count }, decode(body))
    status, body = get(srv.url .. "/api/histograms")
    assert.equals(200, status, body)
    local hs = decode(body).histograms
    local snap = db:histogram("lat"):snapshot()
    assert.equals(1, #hs)
    assert.equals("lat", hs[1].name)
    assert.equals(snap.count, hs[1].count)
    for i, b in ipairs(snap.buckets) do assert.equals(b.count, hs[1].buckets[i].count) end
    status, body = get(srv.url .. "/api/stats")
    assert.equals(200, status, body)
    local st = decode(body)
    assert.equals(db:stats().counters, st.stats.counters)
    assert.equals("file:" .. path, st.store)
    -- nothing was written: no counter made by asking for one
    status, body = get(srv.url .. "/api/counter?name=nope")
    assert.equals(404, status)
    assert.equals("no such counter 'nope'\n", body)
    assert.is_nil(db:value("nope"))
    assert.equals(0, stop(srv))
    assert.matches("stopped %(SIGTERM%)", helper.slurp(srv.log))
    db:close()
  end)

  it("does not hold the store's reuse back once its requests are over", function()
    local path = helper.tmpfile("reuse.tly")
    local db = assert(tally.open("file:" .. path))
    for i = 1, 100 do db:incr("c:" .. i, 1) end
    db:close()
    local srv = serve(path)
    for _ = 1, 3 do   -- a name read twice is cached, as a handle
      assert.equals(200, (get(srv.url .. "/metrics")))
      assert.equals(200, (get(srv.url .. "/api/counter?name=c:5")))
    end
    sleep(1.5)        -- the server settles a second after its last request
    local out, code = helper.tally("-e", ([[
      local db = assert(tally.open("file:%s"))
      assert(db:drop("c:1"))
      db:tick()]]):format(path))
    assert.equals(0, code, out)
    local behind
    for _ = 1, 30 do  -- its grace step comes within a second
      sleep(0.1)
      local text = helper.tally_split(nil, "info", path, "--json")
      behind = decode(text).behind
      if behind == 0 then break end
    end
    assert.equals(0, behind)
    assert.equals(0, stop(srv))
  end)

  it("serves /metrics as tally.prometheus gives it, gzipped when asked, and promtool accepts it", function()
    local path, db = store_for_api()
    local srv = serve(path)
    local status, body, h = get(srv.url .. "/metrics")
    assert.equals(200, status)
    assert.equals("text/plain; version=0.0.4; charset=utf-8", h["content-type"])
    assert.equals(tally.prometheus(db), body)
    local ok, code, out = peers.check_metrics(body)
    assert.is_true(ok, tostring(code) .. ": " .. out)
    local status2, body2, h2 = get(srv.url .. "/metrics", { compressed = true })
    assert.equals(200, status2)
    assert.equals("gzip", h2["content-encoding"])
    assert.equals(body, body2)
    status, body = get(srv.url .. "/metrics?pattern=signups")
    assert.equals(tally.prometheus(db, "signups"), body)
    assert.equals(0, stop(srv))
    db:close()
  end)

  it("names and labels /metrics by a --families file, as the writers' own run of it does", function()
    local path, db = store_for_api()
    local fam = helper.tmpfile("families.lua")
    helper.write(fam, [[
local db = ...
db:family("post:*:likes", { shards = 4, metric = "post_likes", labels = { "post" },
                            help = "Likes per post." })
]])
    -- another handle on the store, as a reader: the file's shards = 4 must
    -- not become the store's family (serve writes nothing)
    local reader = assert(tally.open("file:" .. path))
    local srv = serve(path, "--families", fam)
    local status, body = get(srv.url .. "/metrics")
    assert.equals(200, status)
    assert(loadfile(fam))(reader)   -- what the writers see: mapping and store options
    assert.equals(tally.prometheus(reader), body)
    assert.matches('post_likes{post="3"} ', body, 1, true)
    assert.matches("# HELP post_likes Likes per post.", body, 1, true)
    local ok, code, out = peers.check_metrics(body)
    assert.is_true(ok, tostring(code) .. ": " .. out)
    assert.equals(0, stop(srv))
    reader:close()
    -- before the writers' run of the file (above), a new counter under the
    -- pattern had the default shards: check in a store serve alone read
    local path2, db2 = store_for_api()
    srv = serve(path2, "--families", fam)
    status, body = get(srv.url .. "/metrics")
    assert.equals(200, status)
    assert.matches('post_likes{post="3"} ', body, 1, true)
    assert.equals(0, stop(srv))
    assert.equals(db2:counter("signups"):info().shards, db2:counter("post:100:likes"):info().shards)
    assert.not_equals(4, db2:counter("post:100:likes"):info().shards)
    db2:close()
    db:close()
  end)

  it("runs below the writers' priority: nice 12, or --nice N, never less than it had", function()
    local path, db = store_for_api()
    local function nice_of(pid)
      local stat = assert(helper.slurp("/proc/" .. pid .. "/stat"))
      return tonumber(stat:match("%) %S+" .. (" %S+"):rep(15) .. " (%-?%d+)"))
    end
    local own = nice_of("self")
    local srv = serve(path)
    assert.equals(math.max(own, 12), nice_of(srv.pid))
    assert.equals(0, stop(srv))
    srv = serve(path, "--nice", "17")
    assert.equals(math.max(own, 17), nice_of(srv.pid))
    assert.equals(200, (get(srv.url .. "/api/sum")))
    assert.equals(0, stop(srv))
    srv = serve(path, "--nice", "0")
    assert.equals(own, nice_of(srv.pid))
    assert.equals(0, stop(srv))
    local _, err, code = helper.tally_within(10, nil, "serve", path, "--nice", "20")
    assert.equals(2, code)
    assert.matches("--nice must be an integer from 0 to 19, got '20'", err, 1, true)
    db:close()
  end)

  it("refuses a --families file that does not load or asks for more than db:family", function()
    local path, db = store_for_api()
    db:close()
    local bad = helper.tmpfile("bad.lua")
    helper.write(bad, "local db = ...\ndb:family('post:*', { metric = 'x'\n")
    local _, err, code = helper.tally_within(10, nil, "serve", path, "--families", bad)
    assert.equals(1, code)
    assert.matches("^tally serve: %-%-families: .*bad%.lua:3: '}' expected", err)
    local other = helper.tmpfile("other.lua")
    helper.write(other, "local db = ...\ndb:rollup('post:*', { every = 1 })\n")
    _, err, code = helper.tally_within(10, nil, "serve", path, "--families", other)
    assert.equals(1, code)
    assert.matches("db:rollup is not run by tally serve (a --families file gives db:family only)",
                   err, 1, true)
    local wrong = helper.tmpfile("wrong.lua")
    helper.write(wrong, "local db = ...\ndb:family('post:*', { labels = { 'x' } })\n")
    _, err, code = helper.tally_within(10, nil, "serve", path, "--families", wrong)
    assert.equals(1, code)
    assert.matches("labels, type and help need a metric", err, 1, true)
  end)

  it("answers a bad query 400, a bad path 404, another method 405, each with a message", function()
    local path, db = store_for_api()
    db:close()
    local srv = serve(path)
    local cases = {
      { "/api/top?n=0", 400, "n must be an integer from 1 to 1000, got '0'\n" },
      { "/api/top?by=size", 400, "by must be value or rate, got 'size'\n" },
      { "/api/values?colour=red", 400, "unknown query parameter 'colour' (/api/values takes pattern)\n" },
      { "/api/top?pattern=%zz", 400, "bad percent-encoding in the path or query: '%' must be followed by two hex digits\n" },
      -- the path a NUL would end is not served as its first part
      { "/metrics%00junk", 400, "a path cannot hold a NUL byte (%00)\n" },
      { "/api/stats%00?x=1", 400, "a path cannot hold a NUL byte (%00)\n" },
      { "/api/counter", 400, "name is needed: api/counter?name=NAME\n" },
      { "/api/counter?name=" .. ("x"):rep(256), 400, "name must be 1 to 255 bytes, got 256\n" },
      -- a %00 is a byte of the name, not its end (signups exists)
      { "/api/counter?name=signups%00x", 400, "name must not contain a NUL byte\n" },
      { "/api/top?n=5&n=1", 400, "query parameter 'n' must be given once\n" },
      -- what the client sent, escaped as tally's messages write names
      { "/api/counter?name=%1b%5b2J%ff", 404, "no such counter '\\x1b[2J\\xff'\n" },
      { "/api/values?%0d%0a=1", 400, "unknown query parameter '\\x0d\\x0a' (/api/values takes pattern)\n" },
      { "/api/top?by=%1b", 400, "by must be value or rate, got '\\x1b'\n" },
      -- the answer kept for a pattern with "&zzz=1" in it is not this query's
      { "/api/values?pattern=x%26zzz%3D1", 200, '{"values":{}}' },
      { "/api/values?pattern=x&zzz=1", 400, "unknown query parameter 'zzz' (/api/values takes pattern)\n" },
      { "/metrics?pattern=a&pattern=b", 400, "query parameter 'pattern' must be given once\n" },
      { "/nope", 404, nil },
      { "/api/nope", 404, nil },
    }
    for _, c in ipairs(cases) do
      local status, body = get(srv.url .. c[1])
      assert.equals(c[2], status, c[1] .. ": " .. body)
      if c[3] then assert.equals(c[3], body, c[1]) end
    end
    local out = helper.sh(NOPRELOAD .. "curl -s -o /dev/null -w '%{http_code}' -X POST -d x=1 " .. srv.url .. "/metrics")
    assert.equals("405", out)
    -- one connection kept for the next request (HTTP keep-alive), which
    -- starts clean: a bad request's notes are not the next one's
    out = helper.sh(NOPRELOAD .. "curl -sv -o /dev/null -o /dev/null -o /dev/null -w '%{http_code} ' "
                    .. srv.url .. "/api/top?pattern=%zz " .. srv.url .. "/metrics%00x "
                    .. srv.url .. "/api/stats 2>&1")
    assert.matches("400 400 200 $", out)
    local _, reused = out:gsub("Re%-using existing connection", "")
    assert.equals(2, reused, out)
    -- still serving
    assert.equals(200, (get(srv.url .. "/api/stats")))
    assert.equals(0, stop(srv))
  end)

  it("gives 503 with the store's message for a damaged store, and stops on SIGTERM with 0", function()
    local path = helper.tmpfile("damaged.tly")
    local db = assert(tally.open("file:" .. path))
    for i = 1, 50 do db:incr("c:" .. i, i) end
    db:close()
    local data = helper.slurp(path)
    local at = assert(data:find("c:30\0", 1, true)) - 24     -- the record's first word
    helper.write(path, data:sub(1, at + 1) .. string.char(data:byte(at + 2) ~ 0x80) .. data:sub(at + 3))
    db = assert(tally.open("file:" .. path))
    local _, want = db:names()
    db:close()
    assert.matches("tally store is corrupt", want)
    local srv = serve(path)
    for _, p in ipairs({ "/metrics", "/api/values", "/api/top", "/api/histograms" }) do
      local status, body = get(srv.url .. p)
      assert.equals(503, status, p .. ": " .. body)
      assert.equals(want .. "\n", body, p)
    end
    -- a file that is not a store: 503 too, and served once it reads
    local other = helper.tmpfile("notyet.tly")
    helper.write(other, ("x"):rep(10000))
    local srv2 = serve(other)
    local status, body = get(srv2.url .. "/api/values")
    assert.equals(503, status, body)
    assert.matches("not a tally store", body)
    assert.equals(0, stop(srv))
    assert.equals(0, stop(srv2))
  end)

  it("refuses a missing store, and beyond loopback without --auth", function()
    local missing = helper.tmpfile("missing.tly")
    local _, err, code = helper.tally_within(10, nil, "serve", missing)
    assert.equals(1, code)
    assert.equals("tally serve: no store at " .. missing .. " (no such file)\n", err)
    assert.is_nil(io.open(missing, "rb"))
    local path, db = store_for_api()
    db:close()
    _, err, code = helper.tally_within(10, nil, "serve", path, "--listen", "0.0.0.0:1")
    assert.equals(2, code)
    assert.matches("beyond loopback: give %-%-auth TOKEN or %-%-auth USER:PASS", err)
    _, err, code = helper.tally_within(10, nil, "serve", path, "--listen", "nowhere")
    assert.equals(2, code)
    assert.matches("--listen takes ADDR:PORT", err, 1, true)
  end)

  it("asks for --auth's token or user and password", function()
    local path, db = store_for_api()
    db:close()
    local srv = serve(path, "--auth", "s3cret")
    local status, _, h = get(srv.url .. "/api/stats")
    assert.equals(401, status)
    assert.equals('Bearer realm="tally"', h["www-authenticate"])
    assert.equals(401, (get(srv.url .. "/metrics", { headers = { Authorization = "Bearer wrong" } })))
    -- compared byte by byte: the same length, or a prefix, is not enough
    assert.equals(401, (get(srv.url .. "/metrics", { headers = { Authorization = "Bearer s3creT" } })))
    assert.equals(401, (get(srv.url .. "/metrics", { headers = { Authorization = "Bearer s3cre" } })))
    assert.equals(401, (get(srv.url .. "/metrics", { headers = { Authorization = "Bearer s3cret2" } })))
    assert.equals(200, (get(srv.url .. "/metrics", { headers = { Authorization = "Bearer s3cret" } })))
    assert.equals(200, (get(srv.url .. "/metrics", { headers = { Authorization = "BEARER s3cret" } })))
    assert.equals(401, (get(srv.url .. "/metrics", { headers = { Authorization = "Basic s3cret" } })))
    -- a NUL in Basic credentials does not end them there (bash's printf
    -- writes the NUL; curl cannot): the status line's code. (A raw NUL
    -- in the header itself ends it in MHD 0.9.75, before tally sees it.)
    local port = srv.url:match(":(%d+)$")
    local function raw(authorization)
      local script = ("exec 3<>/dev/tcp/127.0.0.1/%s && printf 'GET /api/stats HTTP/1.1\\r\\n"
                      .. "Host: x\\r\\nAuthorization: %s\\r\\n\\r\\n' >&3 && timeout 5 head -c 12 <&3"
                      .. " | cut -c10-12"):format(port, authorization)
      return (helper.sh("bash -c " .. helper.q(script))):match("%d+")
    end
    assert.equals("200", raw("Bearer s3cret"))
    assert.equals(0, stop(srv))
    srv = serve(path, "--auth", "ops:pa:ss")
    assert.equals(401, (get(srv.url .. "/api/stats")))
    assert.equals(200, (get(srv.url:gsub("//", "//ops:pa:ss@") .. "/api/stats")))
    assert.equals(401, (get(srv.url:gsub("//", "//ops:nope@") .. "/api/stats")))
    assert.equals(401, (get(srv.url:gsub("//", "//opz:pa:ss@") .. "/api/stats")))
    assert.equals(401, (get(srv.url:gsub("//", "//ops:pa:sS@") .. "/api/stats")))
    port = srv.url:match(":(%d+)$")
    assert.equals("200", raw("Basic " .. helper.sh("printf 'ops:pa:ss' | base64"):gsub("%s", "")))
    assert.equals("401", raw("Basic " .. helper.sh("printf 'ops:pa:ss\\0x' | base64"):gsub("%s", "")))
    assert.equals(0, stop(srv))
  end)

  it("keeps answering through a slowloris, a 1 MB header and 1,000 connections at once", function()
    local path, db = store_for_api()
    db:close()
    local srv = serve(path, "--timeout", "5")
    -- the hostile clients come from 127.0.0.2 (loopback too), the probes
    -- from 127.0.0.1: the per-address limit keeps one address from
    -- taking every connection
    local script = helper.tmpfile("hostile.pl")
    helper.write(script, [[
use strict; use IO::Socket::INET; $| = 1;
$SIG{PIPE} = 'IGNORE';  # the server may close on the big header before it is all sent
my ($port, $ready, $secs) = @ARGV;
sub conn { IO::Socket::INET->new(PeerAddr => "127.0.0.1", PeerPort => $port,
  LocalAddr => "127.0.0.2", Proto => "tcp", Timeout => 2) }
my @held;
# a 1 MB header: refused, the connection closed
my $big = conn() or die "connect: $!";
print $big "GET /api/stats HTTP/1.1\r\nHost: x\r\nX-Big: " . ("a" x 1048576) . "\r\n\r\n";
my $line = <$big> // "";
print "big: $line\n";
# 1,000 connections at once, held open
for (1 .. 1000) { my $c = conn(); push @held, $c if $c }
print "held: " . scalar(@held) . "\n";
# a slowloris: 20 requests that never finish their headers
my @slow;
for (1 .. 20) { my $c = conn() or next; print $c "GET / HTTP/1.1\r\nHost: x\r\n"; push @slow, $c }
open my $f, ">", $ready; close $f;
my $end = time + $secs;
while (time < $end) { for my $c (@slow) { print $c "X-a: b\r\n" } sleep 1 }
]])
    local ready = helper.tmpfile("hostile.ready")
    local out = helper.tmpfile("hostile.out")
    os.execute(("timeout 60 perl %s %d %s 12 >%s 2>&1 &"):format(q(script), srv.port, q(ready), q(out)))
    local t0 = now()
    while not helper.slurp(ready) and now() - t0 < 30 do sleep(0.1) end
    assert.truthy(helper.slurp(ready), helper.slurp(out))
    -- refused with 431, or (when it closed while the header was still
    -- coming) reset before the client read the answer
    local big = helper.slurp(out):match("big: ([^\n]*)")
    assert.truthy(big, helper.slurp(out))
    if big ~= "" then assert.matches("^HTTP/1.1 431", big) end
    -- while they hold on, a probe is answered at once, several times
    for _ = 1, 5 do
      local t1 = now()
      local status, body = get(srv.url .. "/api/top?n=3", { interface = "127.0.0.1" })
      assert.equals(200, status, body)
      assert.is_true(now() - t1 < 2)
      sleep(0.5)
    end
    local status, body = get(srv.url .. "/api/top?pattern=%zz%", { interface = "127.0.0.1" })
    assert.equals(400, status, body)
    assert.equals(200, (get(srv.url .. "/metrics")))
    assert.equals(0, stop(srv))
  end)

  -- Prometheus scrapes it every second while a writer adds about 1,000 a
  -- second; rate() must answer the rate the writer's log says it made.
  it("is scraped by a real Prometheus, whose rate() answers the writer's rate", function()
    if not helper.on_path("prometheus") then
      pending("prometheus not found: install Debian's prometheus (scripts/setup installs it)")
      return
    end
    local path = helper.tmpfile("rate.tly")
    local db = assert(tally.open("file:" .. path))
    db:incr("rate:c", 1)
    db:close()
    local srv = serve(path)
    local pdir = mkdir("prometheus")
    local pport = peers.free_port()
    helper.write(pdir .. "/prometheus.yml", ([[
global: { scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s }
scrape_configs:
  - job_name: tally
    static_configs: [ { targets: [ "127.0.0.1:%d" ] } ]
]]):format(srv.port))
    local ppid = background(pdir, NOPRELOAD .. "prometheus --config.file=" .. q(pdir .. "/prometheus.yml")
      .. " --storage.tsdb.path=" .. q(pdir .. "/data") .. " --web.listen-address=127.0.0.1:" .. pport
      .. " 2>" .. q(pdir .. "/log"))
    local purl = "http://127.0.0.1:" .. pport
    local wdir = mkdir("writer")
    local writer = helper.tmpfile("writer.lua")
    helper.write(writer, ([[
local tally = require "tally"
local db = assert(tally.open("file:%s"))
local log = assert(io.open("%s", "w"))
local t0, done = tally.now(), 0
while tally.now() - t0 < 30 do
  local want = math.floor((tally.now() - t0) * 1000)
  if want > done then db:incr("rate:c", want - done); done = want end
  log:write(("%%.3f %%d\n"):format(tally.now(), done)); log:flush()
  os.execute("sleep 0.01")
end
]]):format(path, wdir .. "/log"))
    local wpid = background(wdir, ("env LUA_PATH=%s LUA_CPATH=%s lua5.4 %s"):format(
      q(helper.build .. "/?.lua;" .. helper.build .. "/?/init.lua;;"), q(helper.build .. "/?.so;;"), q(writer)))
    local ok, err = pcall(function()
      local t0, rate = now(), nil
      local function query(expr)
        local status, body = get(purl .. "/api/v1/query?query=" .. peers.urlencode(expr))
        local r = status == 200 and decode(body).data.result
        return r and r[1] and tonumber(r[1].value[2]), r and r[1] and tonumber(r[1].value[1])
      end
      -- once the series is older than the 10 s window with a scrape to
      -- spare: a series that begins inside the window is extrapolated
      -- to its start by half a scrape interval only, so rate() reads low
      -- (870 for 1,000 when it began 1.7 s in); all made while the
      -- writer ran
      local at
      while now() - t0 < 27 do
        sleep(1)
        local n = query('count_over_time(tally_value{counter="rate:c"}[13s])')
        if n and n >= 12 then
          rate, at = query('rate(tally_value{counter="rate:c"}[10s])')
          break
        end
      end
      assert.is_not_nil(rate, "no rate from Prometheus: " .. (helper.slurp(pdir .. "/log") or ""):sub(-2000))
      -- the rate the writer made over the same window, from its own log
      -- (it aims at 1,000 a second, but a loaded VM can stall it)
      local function written(t)
        local last = 0
        for lt, n in (helper.slurp(wdir .. "/log") or ""):gmatch("([%d.]+) (%d+)\n") do
          if tonumber(lt) > t then break end
          last = tonumber(n)
        end
        return last
      end
      local made = (written(at) - written(at - 10)) / 10
      assert.is_true(made > 0, "the writer made nothing in the window")
      assert.is_true(math.abs(rate / made - 1) < 0.1,
        ("Prometheus's rate %s, the writer's %s"):format(tostring(rate), tostring(made)))
    end)
    os.execute("kill " .. wpid .. " " .. ppid .. " 2>/dev/null")
    for _ = 1, 250 do
      if helper.slurp(pdir .. "/rc") and helper.slurp(wdir .. "/rc") then break end
      sleep(0.04)
    end
    os.execute("rm -rf " .. q(pdir) .. " " .. q(wdir))
    assert(ok, err)
    assert.equals(0, stop(srv))
  end)

  it("shows its dashboard in headless Chromium: the top counter, live, charts drawn, no console errors", function()
    if not helper.on_path("chromium") then
      pending("chromium not found: install Debian's chromium (scripts/setup installs it)")
      return
    end
    local path = helper.tmpfile("dash.tly")
    local db = assert(tally.open("file:" .. path))
    db:incr("hot:a", 5000)
    db:incr("hot:b", 10)
    local h = db:histogram("lat")
    for i = 1, 40 do h:observe(i / 40) end
    local srv = serve(path)
    local function load()
      local cdir = mkdir("chromium")
      helper.sh(("{ cd %s && HOME=%s timeout -s KILL 60 %schromium --headless --no-sandbox "
        .. "--disable-gpu --user-data-dir=%s --enable-logging=stderr --v=0 --virtual-time-budget=4000 "
        .. "--dump-dom %s >%s 2>%s; }"):format(q(cdir), q(cdir), NOPRELOAD, q(cdir .. "/profile"),
        q(srv.url .. "/?probe"), q(cdir .. "/dom"), q(cdir .. "/stderr")))
      local out = helper.slurp(cdir .. "/dom") or ""
      local log = helper.slurp(cdir .. "/stderr") or ""
      os.execute("rm -rf " .. q(cdir))
      return out, log
    end
    local dom, log = load()
    local value = dom:match('<tr data%-name="hot:a"><td class="name">hot:a</td><td class="value">(%d+)</td>')
    assert.equals("5000", value, dom:sub(1, 3000))
    assert.is_nil(log:find(":CONSOLE", 1, true), log)
    assert.is_nil(dom:find('id="status" class="err"', 1, true), dom:sub(1, 3000))
    local canvases = 0
    for ink in dom:gmatch('<canvas[^>]-data%-ink="(%d+)"') do
      canvases = canvases + 1
      assert.is_true(tonumber(ink) > 500, "a blank chart: " .. ink .. " pixels")
    end
    assert.equals(3, canvases)   -- the rates, and the histogram's buckets and quantiles
    db:incr("hot:a", 37)
    dom, log = load()
    value = dom:match('<tr data%-name="hot:a"><td class="name">hot:a</td><td class="value">(%d+)</td>')
    assert.equals("5037", value)
    assert.is_nil(log:find(":CONSOLE", 1, true), log)
    db:close()
    assert.equals(0, stop(srv))
  end)
end)
