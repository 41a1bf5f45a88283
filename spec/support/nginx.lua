-- spec/support/nginx.lua: a real nginx with the Lua module (Debian's nginx-light
-- and libnginx-mod-http-lua, LuaJIT) for the OpenResty specs, plus curl
-- request bursts against it.
--
--   local nginx = require "spec.support.nginx"
--   local srv = nginx.start { conf = nginx.example { every = 1 } }
--   srv.url, srv.port, srv.pid (the master), srv.dir (the prefix), srv.log
--   srv.workers()                 live worker pids (not the ones shutting down)
--   srv.reload()                  HUP; returns at once (see srv.wait_workers)
--   srv.wait_workers(n, old)      waits for n live workers none of which is in old
--   srv.errors(allowed)           error-log lines at [error] or worse
--   srv.stop([keep])              QUIT, then KILL (master and workers, by PID);
--                                 keep: leave the prefix until stop() again
--   local b = nginx.burst(srv.url .. "/page/[1-100]?r=[1-100]", { parallel = 32 })
--   local r = b.wait()            { n =, ok =, codes = { [200] = k }, workers = { [pid] = k } }
--
-- nginx runs from a fresh prefix under TALLY_TEST_TMP with `daemon off;`,
-- its master started in the background (its PID kept), on 127.0.0.1 on a
-- free port, with the LuaJIT build of tally linked at PREFIX/lua (what the
-- example's lua_package_path expects). The build is TALLY_LUAJIT_BUILD
-- (tests/CMakeLists.txt sets it), else BUILD/luajit when it holds
-- tally/core.so. LD_PRELOAD is passed on to nginx (an ASan build's module
-- needs its runtime), not to curl. Waits are bounded in time and count. stop() sends QUIT to
-- the master, waits for it and every worker it had, then KILLs what is
-- left, each by PID, and removes the prefix; servers still running when Lua
-- closes are stopped too.

-- a table: Lua 5.1's require marks a module being loaded with a sentinel
if type(package.loaded["spec.support.nginx"]) == "table" then return package.loaded["spec.support.nginx"] end

local helper = require "spec.support.helper"
local peers = require "spec.support.peers"
local q = helper.q

local M = {}

local START_TIMEOUT = 20   -- seconds nginx may take to answer
local STOP_TIMEOUT = 10    -- seconds it may take to go after QUIT
local POLL = 0.02          -- seconds between polls
local NGINX = "/usr/sbin/nginx"
local MODULES = "/usr/lib/nginx/modules"

-- Seconds since boot, to 10 ms.
local function now()
  local f = assert(io.open("/proc/uptime", "r"))
  local t = f:read("n")
  f:close()
  return t
end
M.now = now

local function sleep(s)
  os.execute("sleep " .. s)
end
M.sleep = sleep

local function slurp(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  return s
end
M.slurp = slurp

local alive = peers.alive

-- Poll until cond() is true, for at most secs; returns cond()'s last value.
function M.eventually(cond, secs)
  local t0, n = now(), 0
  local v = cond()
  while not v and now() - t0 < (secs or 10) and n < (secs or 10) / POLL do
    n = n + 1
    sleep(POLL)
    v = cond()
  end
  return v
end

-- The process title (nginx rewrites argv: "nginx: worker process").
local function title(pid)
  local s = slurp("/proc/" .. pid .. "/cmdline")
  return s and (s:gsub("%z+$", ""):gsub("%z", " "))
end

local function children(ppid)
  local out = {}
  local s = slurp(("/proc/%d/task/%d/children"):format(ppid, ppid))
  if s then
    for pid in s:gmatch("%d+") do out[#out + 1] = tonumber(pid) end
    return out
  end
  local f = assert(io.popen("ls /proc"))
  for name in f:lines() do
    local pid = tonumber(name)
    local st = pid and slurp("/proc/" .. pid .. "/stat")
    if st and tonumber(st:match("%) %a (%d+)")) == ppid then out[#out + 1] = pid end
  end
  f:close()
  return out
end

--------------------------------------------------------------------------
-- The LuaJIT build and the configuration

-- The directory holding the LuaJIT build's tally/core.so and tally/*.lua.
function M.luajit_build()
  local dir = os.getenv("TALLY_LUAJIT_BUILD")
  if not dir or dir == "" then
    local guess = helper.build .. "/luajit"
    if io.open(guess .. "/tally/core.so", "rb") then
      dir = guess
    else
      error("TALLY_LUAJIT_BUILD is not set and " .. guess .. "/tally/core.so does not exist:"
            .. " build the tally_luajit target (scripts/build build) and run the specs through"
            .. " ctest, which sets TALLY_LUAJIT_BUILD=<build>/luajit", 2)
    end
  end
  if not dir:match("^/") then
    dir = (helper.sh("pwd"):gsub("%s+$", "")) .. "/" .. dir
  end
  for _, f in ipairs({ "/tally/core.so", "/tally/init.lua", "/tally/openresty.lua" }) do
    if not io.open(dir .. f, "rb") then
      error("the LuaJIT build in " .. dir .. " has no " .. f:sub(2)
            .. ": build the tally_luajit target (scripts/build build)", 2)
    end
  end
  return dir
end

M.example_path = "examples/openresty/nginx.conf"

-- The example configuration, ready for a private instance: the port and
-- the rollup period substituted (opts.port defaults to PORT, which start()
-- fills in; opts.every, seconds), `user root;` when running as root (the
-- workers must read the build tree and write the store). Raises if a line
-- to substitute is not there, so the example cannot drift from the spec.
function M.example(opts)
  opts = opts or {}
  local text = assert(slurp(M.example_path), "cannot read " .. M.example_path)
  local n
  text, n = text:gsub("listen 127%.0%.0%.1:8080;", "listen 127.0.0.1:" .. (opts.port or "PORT") .. ";")
  assert(n == 1, M.example_path .. ": no 'listen 127.0.0.1:8080;' line")
  if opts.every then
    text, n = text:gsub("every = 10,", "every = " .. opts.every .. ",")
    assert(n == 1, M.example_path .. ": no 'every = 10,' in the rollups")
  end
  return text
end

--------------------------------------------------------------------------
-- Servers

local running = {}   -- master pid -> server, until stopped

-- When a process started (clock ticks since boot): with the pid, what
-- tells it from a later process that got the same pid.
local function started(pid)
  local st = slurp("/proc/" .. pid .. "/stat")
  return st and st:match("^.*%) %a" .. (" %S+"):rep(18) .. " (%d+)")
end

-- Every process of srv (master and workers it had) still alive: never a
-- later process that reuses one of their pids.
local function pids_of(srv)
  local list = {}
  for pid, t in pairs(srv.seen) do
    if alive(pid) and started(pid) == t then list[#list + 1] = pid end
  end
  return list
end

-- stop(srv [, keep]): keep = true leaves the prefix for a look at its
-- files; a later stop() removes it.
local function stop(srv, keep)
  if srv.stopped then
    if not keep and not srv.keep_dir then os.execute("rm -rf " .. q(srv.dir)) end
    return true
  end
  srv.stopped = true
  running[srv.pid] = nil
  srv.workers()   -- remember the workers it has now
  local t0 = now()
  os.execute("kill -QUIT " .. srv.pid .. " 2>/dev/null")
  local n = 0
  while #pids_of(srv) > 0 and now() - t0 < STOP_TIMEOUT and n < STOP_TIMEOUT / POLL do
    n = n + 1
    sleep(POLL)
  end
  for _, pid in ipairs(pids_of(srv)) do os.execute("kill -KILL " .. pid .. " 2>/dev/null") end
  n = 0
  while #pids_of(srv) > 0 and n < 250 do
    n = n + 1
    sleep(POLL)
  end
  srv.stopped_in = now() - t0
  local left = pids_of(srv)
  if #left > 0 then
    error(("nginx (pids %s) still running after QUIT and KILL"):format(table.concat(left, " ")), 2)
  end
  if not keep and not srv.keep_dir then os.execute("rm -rf " .. q(srv.dir)) end
  return true
end

-- Fresh prefix, config written, nginx started; returns srv once it answers
-- with opts.workers (default 2) workers. opts.conf: the configuration text
-- (PORT is replaced by the port); opts.env: { NAME = value } for nginx;
-- opts.ready: a path to GET until it answers 200 (default "/tally/status");
-- opts.discard: remove the prefix even if nginx fails to start (a spec
-- that expects it to fail).
function M.start(opts)
  if not io.open(NGINX, "rb") then
    error(NGINX .. " not found: install the Debian packages nginx-light and"
          .. " libnginx-mod-http-lua (scripts/setup installs them)", 2)
  end
  if not io.open(MODULES .. "/ngx_http_lua_module.so", "rb") then
    error(MODULES .. "/ngx_http_lua_module.so not found: install the Debian package"
          .. " libnginx-mod-http-lua (scripts/setup installs it)", 2)
  end
  local lua = M.luajit_build()
  local nworkers = opts.workers or 2
  local last_err
  for _ = 1, 3 do
    local out, code = helper.sh(("mktemp -d \"$(cd %s && pwd)\"/nginx.XXXXXX"):format(q(helper.tmpdir)))
    assert(code == 0, out)
    local dir = out:gsub("%s+$", "")
    assert(os.execute(("mkdir -p %s/logs %s/data %s/conf && ln -s %s %s/lua")
      :format(q(dir), q(dir), q(dir), q(lua), q(dir))))
    -- lets the workers (nobody, unless `user root;`) into the prefix
    os.execute("chmod 755 " .. q(dir))
    local port = peers.free_port()
    local conf = opts.conf:gsub("PORT", tostring(port))
    if helper.is_root() and not conf:find("\nuser ", 1, true) then
      conf = conf:gsub("\nworker_processes", "\nuser root;\nworker_processes", 1)
    end
    if opts.workers then
      conf = conf:gsub("\nworker_processes %d+;", "\nworker_processes " .. nworkers .. ";", 1)
    end
    helper.write(dir .. "/conf/nginx.conf", conf)
    -- LD_PRELOAD stays: in an ASan build the module needs the sanitizer
    -- runtime that the busted test preloads (ASAN_OPTIONS comes along too).
    local env = { "env" }
    for k, v in pairs(opts.env or {}) do env[#env + 1] = k .. "=" .. v end
    for i, a in ipairs(env) do env[i] = q(a) end
    local cmd = ("%s %s -p %s -c conf/nginx.conf -e logs/error.log"):format(
      table.concat(env, " "), NGINX, q(dir .. "/"))
    local srv = { name = "nginx", dir = dir, log = dir .. "/logs/error.log", out = dir .. "/logs/out",
                  port = port, url = "http://127.0.0.1:" .. port, seen = {}, nworkers = nworkers }
    local f = assert(io.popen(("%s >%s 2>&1 </dev/null & echo $!"):format(cmd, q(srv.out)), "r"))
    srv.pid = assert(tonumber(f:read("l")), "could not start nginx")
    f:close()
    srv.seen[srv.pid] = started(srv.pid)
    running[srv.pid] = srv

    -- live workers: children whose title is not "... is shutting down"
    srv.workers = function()
      local list = {}
      for _, pid in ipairs(children(srv.pid)) do
        srv.seen[pid] = srv.seen[pid] or started(pid)
        local t = title(pid)
        if t and t:find("worker process", 1, true) and not t:find("shutting down", 1, true)
           and alive(pid) then
          list[#list + 1] = pid
        end
      end
      table.sort(list)
      return list
    end
    -- Wait (bounded) for n live workers, none of them in `old` (a list).
    srv.wait_workers = function(n, old, secs)
      local skip = {}
      for _, pid in ipairs(old or {}) do skip[pid] = true end
      local got
      M.eventually(function()
        got = {}
        for _, pid in ipairs(srv.workers()) do
          if not skip[pid] then got[#got + 1] = pid end
        end
        return #got == n
      end, secs or START_TIMEOUT)
      return got
    end
    srv.reload = function()
      local old = srv.workers()
      assert(os.execute("kill -HUP " .. srv.pid))
      return old
    end
    srv.stop = function(keep) return stop(srv, keep) end
    srv.text = function() return slurp(srv.log) or "" end
    -- Lines at [error], [crit], [alert] or [emerg] that match none of the
    -- Lua patterns in `allowed`.
    srv.errors = function(allowed)
      local bad = {}
      for line in srv.text():gmatch("[^\n]+") do
        if line:find("%[error%]") or line:find("%[crit%]") or line:find("%[alert%]")
           or line:find("%[emerg%]") then
          local ok = false
          for _, p in ipairs(allowed or {}) do ok = ok or line:find(p) ~= nil end
          if not ok then bad[#bad + 1] = line end
        end
      end
      return bad
    end

    local t0, n, ok, gone = now(), 0, false, false
    local ready = opts.ready or "/tally/status"
    while n < START_TIMEOUT / POLL and now() - t0 < START_TIMEOUT do
      n = n + 1
      if not alive(srv.pid) then gone = true; break end
      if srv.text():find("worker process %d+ exited") then break end   -- respawning: give up
      if #srv.workers() == nworkers and peers.owns_port(srv.pid, port)
         and peers.http("GET", srv.url .. ready, nil, { timeout = 2 }) == 200 then
        ok = true
        break
      end
      sleep(POLL)
    end
    if ok then
      srv.startup = now() - t0
      return srv
    end
    local log = (slurp(srv.out) or "") .. (slurp(srv.log) or "")
    last_err = ("nginx (pid %d) %s; its output and %s:\n%s"):format(srv.pid,
      gone and "exited at start" or srv.text():find("worker process %d+ exited") and "lost workers at start"
        or ("did not answer within " .. START_TIMEOUT .. " s"),
      srv.log, log)
    local busy = log:lower():find("address already in use", 1, true)
    srv.keep_dir = not busy and not opts.discard   -- the logs stay for a look
    pcall(stop, srv)
    if not busy then break end  -- the port was taken meanwhile: try another
  end
  error(last_err, 2)
end

-- Stop every server still running.
function M.stop_all()
  local list = {}
  for _, srv in pairs(running) do list[#list + 1] = srv end
  for _, srv in ipairs(list) do pcall(stop, srv) end
end

--------------------------------------------------------------------------
-- Request bursts through curl --parallel

-- Start curl in the background on a URL glob (curl's [1-100] ranges), each
-- response's status and X-Tally-Worker header written one line per
-- transfer. opts.parallel (default 32), opts.close = true: one connection
-- per request (no keep-alive, so curl never retries a request on a reused
-- connection that died), opts.timeout: seconds per transfer (default 10),
-- opts.limit: seconds the whole burst may take (default 60).
-- Returns b: b.pid, b.done() (true once curl has exited), b.wait() -> {
-- n = lines, ok = 200s, codes = { [status] = k }, workers = { [pid] = k of
-- the 200s }, failed = transfers with no HTTP answer, err = curl's stderr };
-- b.out: the file curl writes to (it grows as transfers finish).
function M.burst(url, opts)
  opts = opts or {}
  local out = helper.tmpfile("burst.out")
  local err = helper.tmpfile("burst.err")
  local args = { "curl", "-q", "-sS", "--no-progress-meter", "--noproxy", "*",
    "--parallel", "--parallel-immediate", "--parallel-max", tostring(opts.parallel or 32),
    "--max-time", tostring(opts.timeout or 10),
    "-o", "/dev/null", "-w", "%{http_code} %header{x-tally-worker}\\n" }
  if opts.close then
    args[#args + 1] = "-H"
    args[#args + 1] = "Connection: close"
  end
  args[#args + 1] = url
  for i, a in ipairs(args) do args[i] = q(a) end
  local f = assert(io.popen(("env -u LD_PRELOAD %s >%s 2>%s </dev/null & echo $!")
    :format(table.concat(args, " "), q(out), q(err)), "r"))
  local b = { pid = assert(tonumber(f:read("l")), "could not start curl"), t0 = now(), out = out }
  f:close()
  b.done = function() return not alive(b.pid) end
  b.wait = function()
    local limit, n = opts.limit or 60, 0
    while alive(b.pid) and now() - b.t0 < limit and n < limit / POLL do
      n = n + 1
      sleep(POLL)
    end
    if alive(b.pid) then
      os.execute("kill -KILL " .. b.pid .. " 2>/dev/null")
      error(("curl burst still running after %d s: %s"):format(limit, url), 2)
    end
    local r = { n = 0, ok = 0, failed = 0, codes = {}, workers = {}, err = slurp(err) or "" }
    for line in (slurp(out) or ""):gmatch("[^\n]+") do
      local code, pid = line:match("^(%d+) ?(%d*)")
      code = tonumber(code)
      if code then
        r.n = r.n + 1
        r.codes[code] = (r.codes[code] or 0) + 1
        if code == 200 then
          r.ok = r.ok + 1
          pid = tonumber(pid)
          if pid then r.workers[pid] = (r.workers[pid] or 0) + 1 end
        elseif code == 0 then
          r.failed = r.failed + 1
        end
      end
    end
    r.secs = now() - b.t0
    os.remove(out)
    os.remove(err)
    return r
  end
  return b
end

-- GET url -> status, body, headers ({ ["content-type"] = ... }, lower-case
-- names), or nil, message when no HTTP answer came. opts.close: send
-- Connection: close (a new connection, so possibly another worker).
function M.get(url, opts)
  opts = opts or {}
  local body, head = helper.tmpfile("get.body"), helper.tmpfile("get.head")
  local args = { "curl", "-q", "-sS", "--noproxy", "*", "--max-time", tostring(opts.timeout or 10),
    "-o", body, "-D", head, "-w", "%{http_code}" }
  if opts.close then args[#args + 1] = "-H"; args[#args + 1] = "Connection: close" end
  args[#args + 1] = url
  for i, a in ipairs(args) do args[i] = q(a) end
  local out, code = helper.sh("env -u LD_PRELOAD " .. table.concat(args, " "))
  local b, h = slurp(body) or "", slurp(head) or ""
  os.remove(body)
  os.remove(head)
  local status = tonumber(out:match("(%d%d%d)%s*$"))
  if code ~= 0 or not status or status == 0 then return nil, "GET " .. url .. ": " .. out end
  local headers = {}
  for k, v in h:gmatch("([%w%-]+):%s*([^\r\n]*)") do headers[k:lower()] = v end
  return status, b, headers
end

-- The keys of a table, sorted.
function M.keys(t)
  local list = {}
  for k in pairs(t) do list[#list + 1] = k end
  table.sort(list)
  return list
end

-- When Lua closes (the end of the busted run), stop what is left.
M._reaper = setmetatable({}, { __gc = function() M.stop_all() end })

package.loaded["spec.support.nginx"] = M
return M
