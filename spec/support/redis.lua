-- spec/support/redis.lua: real Redis servers for the Redis specs: one standalone
-- redis-server and one 3-master Redis Cluster (redis-cli --cluster create),
-- on free 127.0.0.1 ports (cluster bus ports, port + 10000, free too).
--
--   local redis = require "spec.support.redis"
--   local s = redis.start()     -- s.standalone (port), s.masters {p1,p2,p3},
--                               -- s.uri, s.cluster_uri, s.dir
--   redis.cli(port, "CLUSTER", "INFO") -> output of redis-cli
--   s.stop()                    -- by PID: SIGTERM, SIGKILL after 10 s
--
-- Servers still running when Lua closes are stopped too. Model: spec/support/peers.lua.

-- a table: Lua 5.1's require marks a module being loaded with a sentinel
if type(package.loaded["spec.support.redis"]) == "table" then return package.loaded["spec.support.redis"] end

local helper = require "spec.support.helper"
local peers = require "spec.support.peers"
local q = helper.q

local M = {}
local running = {}

local function sleep(s) os.execute("sleep " .. s) end

local function need(bin)
  if not os.execute("command -v " .. q(bin) .. " >/dev/null 2>&1") then
    error(bin .. " not found: install the Debian package redis-server (scripts/setup installs it)", 3)
  end
end

-- redis-cli -p port args... -> its output (without the final newline)
function M.cli(port, ...)
  local args = {}
  for i = 1, select("#", ...) do args[i] = q((select(i, ...))) end
  local out = helper.sh(("env -u LD_PRELOAD redis-cli -h 127.0.0.1 -p %d %s"):format(port, table.concat(args, " ")))
  return (out:gsub("\n$", ""))
end

-- A port p with p and p + 10000 free.
local function cluster_port()
  for _ = 1, 100 do
    local p = peers.free_port()
    if p + 10000 < 65536 then
      local busy = helper.sh(("ss -Htan 'sport = :%d' 2>/dev/null"):format(p + 10000))
      if busy == "" then return p end
    end
  end
  error("no free port pair (p, p + 10000) found")
end

local function spawn(dir, port, cluster, extra)
  local sub = dir .. "/" .. port
  os.execute("mkdir -p " .. q(sub))
  local cmd = ("env -u LD_PRELOAD redis-server --save '' --appendonly no --bind 127.0.0.1 --port %d --dir %s"
               .. " --daemonize no"):format(port, q(sub))
  for _, a in ipairs(extra or {}) do cmd = cmd .. " " .. q(a) end
  if cluster then
    cmd = cmd .. (" --cluster-enabled yes --cluster-config-file %s --cluster-node-timeout 2000")
      :format(q(sub .. "/nodes.conf"))
  end
  local f = assert(io.popen(("exec %s >%s 2>&1 </dev/null & echo $!"):format(cmd, q(sub .. ".log")), "r"))
  local pid = tonumber(f:read("*l"))
  f:close()
  assert(pid, "could not start redis-server")
  running[pid] = true
  return pid
end

local function kill(pid)
  if not running[pid] then return end
  running[pid] = nil
  os.execute("kill -CONT " .. pid .. " 2>/dev/null; kill " .. pid .. " 2>/dev/null")
  for _ = 1, 500 do
    if not peers.alive(pid) then return end
    sleep(0.02)
  end
  os.execute("kill -KILL " .. pid .. " 2>/dev/null")
  for _ = 1, 250 do
    if not peers.alive(pid) then return end
    sleep(0.02)
  end
end
M.kill = kill

local function wait_for(port, want, secs, ...)
  local n = secs / 0.05
  for _ = 1, n do
    if M.cli(port, ...):find(want, 1, true) then return true end
    sleep(0.05)
  end
  return false
end

function M.start()
  need("redis-server")
  need("redis-cli")
  local out = helper.sh(("mktemp -d \"$(cd %s && pwd)\"/redis.XXXXXX"):format(q(helper.tmpdir)))
  local dir = out:gsub("%s+$", "")
  local s = { dir = dir, pids = {}, masters = {} }
  s.standalone = peers.free_port()
  s.pids[1] = spawn(dir, s.standalone, false)
  for i = 1, 3 do
    s.masters[i] = cluster_port()
    s.pids[i + 1] = spawn(dir, s.masters[i], true)
  end
  s.stop = function()
    for _, pid in ipairs(s.pids) do kill(pid) end
    os.execute("rm -rf " .. q(dir))
  end
  local ports = { s.standalone, s.masters[1], s.masters[2], s.masters[3] }
  for i, p in ipairs(ports) do
    if not wait_for(p, "PONG", 10, "PING") then
      s.stop()
      error(("redis-server on port %d (pid %d) did not answer"):format(p, s.pids[i]), 2)
    end
  end
  local create, code = helper.sh(("env -u LD_PRELOAD redis-cli --cluster create 127.0.0.1:%d 127.0.0.1:%d 127.0.0.1:%d"
    .. " --cluster-replicas 0 --cluster-yes"):format(s.masters[1], s.masters[2], s.masters[3]))
  if code ~= 0 then
    s.stop()
    error("redis-cli --cluster create failed:\n" .. create, 2)
  end
  for _, p in ipairs(s.masters) do
    if not wait_for(p, "cluster_state:ok", 20, "CLUSTER", "INFO") then
      s.stop()
      error("cluster node " .. p .. " not ok", 2)
    end
  end
  s.uri = "redis://127.0.0.1:" .. s.standalone
  s.cluster_uri = ("redis+cluster://127.0.0.1:%d,127.0.0.1:%d,127.0.0.1:%d")
    :format(s.masters[1], s.masters[2], s.masters[3])
  return s
end

-- One standalone server started with extra arguments (e.g. --requirepass
-- PW, or --user NAME on >PW ~* &* +@all): { port, uri, pid, dir, stop }.
function M.start_standalone(extra)
  need("redis-server")
  local out = helper.sh(("mktemp -d \"$(cd %s && pwd)\"/redis.XXXXXX"):format(q(helper.tmpdir)))
  local dir = out:gsub("%s+$", "")
  local s = { dir = dir, port = peers.free_port() }
  s.pid = spawn(dir, s.port, false, extra)
  s.stop = function()
    kill(s.pid)
    os.execute("rm -rf " .. q(dir))
  end
  local up = false
  for _ = 1, 200 do
    local o = M.cli(s.port, "PING")
    if o:find("PONG", 1, true) or o:find("NOAUTH", 1, true) then up = true break end
    sleep(0.05)
  end
  if not up then
    s.stop()
    error(("redis-server on port %d (pid %d) did not answer"):format(s.port, s.pid), 2)
  end
  s.uri = "redis://127.0.0.1:" .. s.port
  return s
end

-- A key or counter name no other spec (or earlier run against the same
-- servers) has used: the specs share one set of servers.
local seq = 0
function M.fresh(what)
  seq = seq + 1
  return ("%s-%d-%d-%d"):format(what, os.time(), math.random(1, 1e9), seq)
end

M._reaper = setmetatable({}, { __gc = function()
  for pid in pairs(running) do pcall(kill, pid) end
end })

package.loaded["spec.support.redis"] = M
return M
