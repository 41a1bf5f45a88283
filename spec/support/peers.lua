-- spec/support/peers.lua: real HTTP peers for the sink specs -- a Prometheus
-- Pushgateway, an InfluxDB 1.x and tally-http-sink (tests/http_sink.c) --
-- plus curl-based HTTP for reading back what they got.
--
--   local peers = require "spec.support.peers"
--   local pg = peers.start_pushgateway()        -- pg.url, pg.pid, pg.dir
--   ...
--   pg.stop()                                   -- also pg:stop()
--
-- Every server listens on 127.0.0.1 only, on ports chosen here to be free,
-- runs in the background from its own directory under TALLY_TEST_TMP (its
-- log is DIR/log), and is waited for with a loop bounded in count and time.
-- stop() kills it by PID, waits until it is gone (or a zombie: the shell
-- that started it is gone, so it waits for init to reap it) and removes its
-- directory. Servers still running when Lua closes are stopped too.
--
-- Sanitizer runtimes preloaded into lua5.4 (LD_PRELOAD, ASan builds) are not
-- passed on to curl, promtool or the Go servers.

-- a table: Lua 5.1's require marks a module being loaded with a sentinel
if type(package.loaded["spec.support.peers"]) == "table" then return package.loaded["spec.support.peers"] end

local helper = require "spec.support.helper"
local q = helper.q

local M = {}

local NOPRELOAD = "env -u LD_PRELOAD "
local START_TIMEOUT = 30   -- seconds a server may take to answer
local STOP_TIMEOUT = 10    -- seconds it may take to go after SIGTERM
local POLL = 0.05          -- seconds between polls

-- Seconds since boot, to 10 ms (no process to start).
local function now()
  local f = assert(io.open("/proc/uptime", "r"))
  local t = f:read("n")
  f:close()
  return t
end

local function sleep(s)
  os.execute("sleep " .. s)
end

local function slurp(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  return s
end

-- The state letter of a process (R, S, D, Z, ...), nil once it is gone.
-- This is what `ps -o stat= -p PID` shows first, read without running ps.
local function pstate(pid)
  local s = slurp("/proc/" .. pid .. "/stat")
  return s and s:match(".*%) (%a)")
end

local function alive(pid)
  local st = pstate(pid)
  return st ~= nil and st ~= "Z" and st ~= "X"
end

-- The last n lines of a file, for error messages.
local function tail(path, n)
  local s = slurp(path)
  if not s or s == "" then return "(" .. path .. " is empty)" end
  local lines = {}
  for l in s:gmatch("[^\n]*") do lines[#lines + 1] = l end
  while #lines > 0 and lines[#lines] == "" do lines[#lines] = nil end
  local from = math.max(1, #lines - (n or 20) + 1)
  return table.concat(lines, "\n", from)
end

-- Raise (at the given level) unless bin is on PATH.
local function need(bin, package, level)
  if not helper.on_path(bin) then
    error(("%s not found: install the Debian package %s (scripts/setup installs it)")
      :format(bin, package), level + 1)
  end
end

-- A fresh private directory under TALLY_TEST_TMP (absolute path).
local function mkdir(what)
  local out, code = helper.sh(("mktemp -d \"$(cd %s && pwd)\"/%s.XXXXXX")
    :format(q(helper.tmpdir), what))
  assert(code == 0, out)
  return (out:gsub("%s+$", ""))
end

-- Start a shell command in the background, output to log; returns its PID.
-- A simple command run with & is exec'd by the forked shell, so $! is the
-- server itself.
local function spawn(cmd, log)
  local f = assert(io.popen(("%s >%s 2>&1 </dev/null & echo $!"):format(cmd, q(log)), "r"))
  local pid = tonumber(f:read("l"))
  f:close()
  assert(pid, "could not start: " .. cmd)
  return pid
end

--------------------------------------------------------------------------
-- Ports

local function self_pid()
  local s = slurp("/proc/self/stat")
  return tonumber(s and s:match("^(%d+)")) or 0
end

-- Local ports of every TCP socket (any state), IPv4 and IPv6.
local function ports_in_use()
  local used = {}
  for _, f in ipairs({ "/proc/net/tcp", "/proc/net/tcp6" }) do
    local s = slurp(f) or ""
    for hex in s:gmatch("\n%s*%d+: %x+:(%x+) ") do used[tonumber(hex, 16)] = true end
  end
  return used
end

-- Whether process pid holds the socket listening on TCP port `port` (a
-- readiness probe alone could be answered by whatever else got the port).
local function owns_port(pid, port)
  local inodes = {}
  for _, f in ipairs({ "/proc/net/tcp", "/proc/net/tcp6" }) do
    for line in (slurp(f) or ""):gmatch("[^\n]+") do
      -- sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
      local lport, st, inode = line:match("^%s*%d+: %x+:(%x+) %x+:%x+ (%x%x)%s+%S+%s+%S+%s+%S+%s+%d+%s+%d+%s+(%d+)")
      if lport and tonumber(lport, 16) == port and st == "0A" then inodes[#inodes + 1] = inode end
    end
  end
  if #inodes == 0 then return false end
  local fds = helper.sh("ls -l /proc/" .. pid .. "/fd")
  for _, inode in ipairs(inodes) do
    if fds:find("socket:[" .. inode .. "]", 1, true) then return true end
  end
  return false
end
M.owns_port = owns_port

local handed = {}   -- ports this process already gave out
local salt = self_pid() * 7919

-- A TCP port nothing on this machine uses now. It is drawn at random below
-- the kernel's ephemeral range (net.ipv4.ip_local_port_range), so that no
-- outgoing connection (curl's own, say) takes it before the server binds.
function M.free_port()
  local lo = 10000
  local range = slurp("/proc/sys/net/ipv4/ip_local_port_range") or ""
  local elo, ehi = range:match("(%d+)%s+(%d+)")
  elo, ehi = tonumber(elo) or 32768, tonumber(ehi) or 60999
  local hi = elo - 1
  if hi - lo < 1000 then lo, hi = elo, ehi end   -- odd range: use it instead
  local used = ports_in_use()
  for _ = 1, 1000 do
    local p = lo + (math.random(0, hi - lo) + salt) % (hi - lo + 1)
    if not used[p] and not handed[p] then
      handed[p] = true
      return p
    end
  end
  error("no free TCP port found between " .. lo .. " and " .. hi)
end

--------------------------------------------------------------------------
-- HTTP through curl(1)

local function write(path, data)
  local f = assert(io.open(path, "wb"))
  f:write(data)
  f:close()
end

-- http(method, url [, body [, opts]]) -> status (number), response body;
-- or nil, message when no HTTP answer came (refused, timed out).
-- opts.headers = { ["Content-Type"] = "..." } (curl sends
-- application/x-www-form-urlencoded with a body unless told otherwise),
-- opts.timeout = seconds for the whole exchange (default 10).
function M.http(method, url, body, opts)
  opts = opts or {}
  local resp = helper.tmpfile("http-response")
  -- -q: no ~/.curlrc; --noproxy: never through an http_proxy from the env.
  local args = { "curl", "-q", "-sS", "--noproxy", "*", "-o", resp,
    "-w", "%{http_code}", "--max-time", tostring(opts.timeout or 10) }
  if method == "HEAD" then
    args[#args + 1] = "--head"
  else
    args[#args + 1] = "-X"
    args[#args + 1] = method
  end
  local req
  if body ~= nil then
    req = helper.tmpfile("http-request")
    write(req, body)
    args[#args + 1] = "--data-binary"
    args[#args + 1] = "@" .. req
  end
  for k, v in pairs(opts.headers or {}) do
    args[#args + 1] = "-H"
    args[#args + 1] = k .. ": " .. v
  end
  args[#args + 1] = url
  for i, a in ipairs(args) do args[i] = q(a) end
  local out, code = helper.sh(NOPRELOAD .. table.concat(args, " "))
  local rbody = slurp(resp) or ""
  os.remove(resp)
  if req then os.remove(req) end
  local status = tonumber(out:match("(%d%d%d)%s*$"))
  if code ~= 0 or not status or status == 0 then
    return nil, ("%s %s: %s"):format(method, url, (out:gsub("%d%d%d%s*$", ""):gsub("%s+$", "")))
  end
  return status, rbody
end

local function urlencode(s)
  return (tostring(s):gsub("[^%w%-%._~]", function(c) return ("%%%02X"):format(c:byte()) end))
end
M.urlencode = urlencode

-- promtool check metrics on the given exposition text.
-- Returns ok (exit 0), promtool's exit code, its output (stdout+stderr).
function M.check_metrics(text)
  need("promtool", "prometheus", 2)
  local f = helper.tmpfile("metrics.prom")
  write(f, text)
  local out, code = helper.sh(NOPRELOAD .. "promtool check metrics < " .. q(f))
  os.remove(f)
  return code == 0, code, out
end

--------------------------------------------------------------------------
-- Servers

local running = {}   -- pid -> server table, until stopped

local function stop(srv)
  if srv.stopped then return true end
  srv.stopped = true
  running[srv.pid] = nil
  local t0 = now()
  os.execute("kill " .. srv.pid .. " 2>/dev/null")
  local n = 0
  while alive(srv.pid) and now() - t0 < STOP_TIMEOUT and n < STOP_TIMEOUT / 0.02 do
    n = n + 1
    sleep(0.02)
  end
  if alive(srv.pid) then
    os.execute("kill -KILL " .. srv.pid .. " 2>/dev/null")
    n = 0
    while alive(srv.pid) and n < 250 do
      n = n + 1
      sleep(0.02)
    end
  end
  srv.stopped_in = now() - t0
  if alive(srv.pid) then
    error(("%s (pid %d) is still running after SIGTERM and SIGKILL"):format(srv.name, srv.pid), 2)
  end
  if not srv.keep_dir then os.execute("rm -rf " .. q(srv.dir)) end
  return true
end

-- Start a server and wait until it answers; errors are raised at the level
-- of whoever called start_*() (which must not tail-call this).
--   name, bin, package: what it is and where it comes from
--   prepare(dir) -> command (a simple shell command, no redirections)
--   ready(srv) -> true once it answers; srv.url may be set by it
--   ports: how many free ports prepare(dir, p1, p2...) gets
local function start(def)
  need(def.bin, def.package, 3)
  local last_err
  for attempt = 1, 3 do
    local dir = mkdir(def.name)
    local ports = {}
    for i = 1, def.ports or 0 do ports[i] = M.free_port() end
    local cmd = def.prepare(dir, table.unpack(ports))
    local log = dir .. "/log"
    local srv = { name = def.name, dir = dir, log = log, ports = ports }
    if ports[1] then srv.port = ports[1]; srv.url = "http://127.0.0.1:" .. ports[1] end
    srv.stop = function() return stop(srv) end
    local t0 = now()
    srv.pid = spawn(cmd, log)
    running[srv.pid] = srv
    local n, limit = 0, def.timeout or START_TIMEOUT
    local ok, gone = false, false
    while n < limit / (def.poll or POLL) and now() - t0 < limit do
      n = n + 1
      if not alive(srv.pid) then gone = true; break end
      if def.ready(srv) then
        ok = true
        for _, p in ipairs(srv.ports) do ok = ok and owns_port(srv.pid, p) end
        if ok then break end
      end
      sleep(def.poll or POLL)
    end
    if ok then
      srv.startup = now() - t0
      return srv
    end
    local why = gone and "exited at start" or ("did not answer within " .. limit .. " s")
    last_err = ("%s (pid %d) %s; the end of %s:\n%s"):format(def.name, srv.pid, why, log, tail(log))
    local busy = gone and (slurp(log) or ""):lower():find("address already in use", 1, true)
    srv.keep_dir = not busy or attempt == 3   -- the log stays for a look
    pcall(stop, srv)
    if not busy then break end   -- a port was taken meanwhile: try others
  end
  error(last_err, 3)
end

-- A Prometheus Pushgateway (Debian's prometheus-pushgateway) on 127.0.0.1.
-- opts.persistence = true keeps pushed metrics in DIR/pushgateway.data
-- (Debian's default is /var/lib/prometheus/pushgateway.data, the system
-- service's file: never use that); opts.args = extra flags. The admin API
-- is on (PUT /api/v1/admin/wipe empties it).
function M.start_pushgateway(opts)
  opts = opts or {}
  local srv = start {
    name = "pushgateway", bin = "prometheus-pushgateway", package = "prometheus-pushgateway",
    ports = 1, timeout = opts.timeout,
    prepare = function(dir, port)
      local args = {
        "prometheus-pushgateway",
        "--web.listen-address=127.0.0.1:" .. port,
        "--persistence.file=" .. (opts.persistence and dir .. "/pushgateway.data" or ""),
        "--web.enable-admin-api",
      }
      for _, a in ipairs(opts.args or {}) do args[#args + 1] = a end
      for i, a in ipairs(args) do args[i] = q(a) end
      return NOPRELOAD .. table.concat(args, " ")
    end,
    ready = function(s)
      return M.http("GET", s.url .. "/-/ready", nil, { timeout = 2 }) == 200
    end,
  }
  return srv
end

-- An InfluxDB 1.x (Debian's influxdb, influxd) on 127.0.0.1: HTTP on
-- srv.port, its RPC (backup/restore) bind-address on srv.ports[2], data in
-- DIR. opts.db: a database to create once it answers (srv.db names it).
function M.start_influxdb(opts)
  opts = opts or {}
  local srv = start {
    name = "influxdb", bin = "influxd", package = "influxdb",
    ports = 2, timeout = opts.timeout,
    prepare = function(dir, http_port, rpc_port)
      -- Debian's influxd spells the switch reporting-enabled (upstream:
      -- reporting-disabled); unset keys keep the defaults compiled in, not
      -- /etc/influxdb/influxdb.conf's.
      write(dir .. "/influxdb.conf", table.concat({
        'reporting-enabled = false',
        'reporting-disabled = true',
        ('bind-address = "127.0.0.1:%d"'):format(rpc_port),
        '[meta]',
        ('  dir = "%s/meta"'):format(dir),
        '[data]',
        ('  dir = "%s/data"'):format(dir),
        ('  wal-dir = "%s/wal"'):format(dir),
        '  query-log-enabled = false',
        '[monitor]',
        '  store-enabled = false',
        '[http]',
        ('  bind-address = "127.0.0.1:%d"'):format(http_port),
        '  log-enabled = false',
        '  pprof-enabled = false',
        '[continuous_queries]',
        '  enabled = false',
        '[subscriber]',
        '  enabled = false',
        '',
      }, "\n"))
      return NOPRELOAD .. "influxd run -config " .. q(dir .. "/influxdb.conf")
    end,
    ready = function(s)
      return M.http("GET", s.url .. "/ping", nil, { timeout = 2 }) == 204
    end,
  }
  if opts.db then
    local status, body = M.http("POST", srv.url .. "/query",
      "q=" .. urlencode('CREATE DATABASE "' .. opts.db .. '"'))
    if status ~= 200 then
      srv.stop()
      error(("influxdb: CREATE DATABASE %s: %s %s"):format(opts.db, tostring(status), body), 2)
    end
    srv.db = opts.db
  end
  return srv
end

-- tally-http-sink (tests/http_sink.c; TALLY_HTTP_SINK, else
-- BUILD/bin/tally-http-sink). opts.status (default 200), opts.delay_ms,
-- opts.control = true for /control, opts.port to listen on that port.
-- Besides url, pid, dir, stop:
--   srv.out          the file it appends one JSON line per request to
--   srv.requests()   those lines decoded (cjson; a missing content_type is
--                    cjson.null)
--   srv.control(status, delay_ms)  GET /control?...; returns http()'s results
function M.start_http_sink(opts)
  opts = opts or {}
  local bin = os.getenv("TALLY_HTTP_SINK") or (helper.build .. "/bin/tally-http-sink")
  if not io.open(bin, "rb") then
    error(bin .. " not found: build the tally_http_sink target (scripts/build build)", 2)
  end
  local srv = start {
    name = "http-sink", bin = bin, package = "(none: it is tests/http_sink.c)",
    ports = 0, timeout = opts.timeout or 10, poll = 0.01,
    prepare = function(dir)
      local args = { bin, "--port-file", dir .. "/port", "--out", dir .. "/requests.jsonl" }
      if opts.status then args[#args + 1] = "--status"; args[#args + 1] = tostring(opts.status) end
      if opts.delay_ms then args[#args + 1] = "--delay-ms"; args[#args + 1] = tostring(opts.delay_ms) end
      if opts.control then args[#args + 1] = "--control" end
      if opts.port then args[#args + 1] = "--port"; args[#args + 1] = tostring(opts.port) end
      for i, a in ipairs(args) do args[i] = q(a) end
      return table.concat(args, " ")  -- keeps LD_PRELOAD: it may be an ASan build
    end,
    ready = function(s)
      local port = tonumber(slurp(s.dir .. "/port") or "")
      if not port then return false end
      s.port, s.ports[1], s.url = port, port, "http://127.0.0.1:" .. port
      return true
    end,
  }
  srv.out = srv.dir .. "/requests.jsonl"
  srv.requests = function()
    local cjson = require "cjson"
    local list = {}
    for line in (slurp(srv.out) or ""):gmatch("[^\n]+") do list[#list + 1] = cjson.decode(line) end
    return list
  end
  srv.control = function(status, delay_ms)
    local qs = {}
    if status then qs[#qs + 1] = "status=" .. status end
    if delay_ms then qs[#qs + 1] = "delay_ms=" .. delay_ms end
    return M.http("GET", srv.url .. "/control?" .. table.concat(qs, "&"))
  end
  return srv
end

-- Stop every server still running.
function M.stop_all()
  local list = {}
  for _, srv in pairs(running) do list[#list + 1] = srv end
  for _, srv in ipairs(list) do pcall(stop, srv) end
end

-- The PIDs of the servers still running (started here, not stopped).
function M.running()
  local pids = {}
  for pid in pairs(running) do pids[#pids + 1] = pid end
  table.sort(pids)
  return pids
end

M.alive = alive
M.pstate = pstate

-- When Lua closes (the end of the busted run), stop what is left.
M._reaper = setmetatable({}, { __gc = function() M.stop_all() end })

package.loaded["spec.support.peers"] = M
return M
