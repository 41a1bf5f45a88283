-- spec/support/firestore.lua: Google's Cloud Firestore emulator for the
-- Firestore specs (Debian package google-cloud-cli-firestore-emulator),
-- started on a free 127.0.0.1 port and stopped by PID.
--
--   local fs = require "spec.support.firestore"
--   local why = fs.missing()    -- nil, or why the specs must be skipped
--   local e = fs.start()        -- e.port, e.host ("127.0.0.1:P"), e.project,
--                               -- e.uri ("firestore://demo-tally?emulator=...")
--   e.wipe()                    -- DELETE every document (between tests)
--   e.rest(method, path, body)  -- status, decoded JSON, raw text; path after
--                               -- /v1/projects/P/databases/(default)/documents
--   e.pause(), e.resume()       -- SIGSTOP, SIGCONT the java child (by PID): a
--                               -- request sent meanwhile is applied on resume
--   e.stop()                    -- the java child, then the launcher, by PID
--
-- The launcher (a shell script) forks java; both are found by PID (the
-- launcher's children from /proc/PID/task/*/children), never by name.
-- Servers still running when Lua closes are stopped too.

-- a table: Lua 5.1's require marks a module being loaded with a sentinel
if type(package.loaded["spec.support.firestore"]) == "table" then return package.loaded["spec.support.firestore"] end

local helper = require "spec.support.helper"
local peers = require "spec.support.peers"
local q = helper.q

local M = {}
local running = {}
local DEFAULT = "/usr/lib/google-cloud-sdk/platform/cloud-firestore-emulator/cloud_firestore_emulator"
M.PACKAGE = "google-cloud-cli-firestore-emulator"
M.SKIP = "Firestore emulator not installed (Debian package " .. M.PACKAGE .. ")"

local function sleep(s) os.execute("sleep " .. s) end

local function exists(path)
  local f = io.open(path, "rb")
  if f then f:close() end
  return f ~= nil
end

-- The emulator's launcher, or nil.
function M.binary()
  local env = os.getenv("TALLY_FIRESTORE_EMULATOR")
  if env and env ~= "" then return exists(env) and env or nil end
  if exists(DEFAULT) then return DEFAULT end
  local out = helper.sh("dpkg -L " .. M.PACKAGE .. " 2>/dev/null | grep '/cloud_firestore_emulator$' | head -1")
  out = out:gsub("%s+$", "")
  if out ~= "" and exists(out) then return out end
  return nil
end

-- nil when the emulator and java are here; else the reason to skip.
function M.missing()
  if not M.binary() then return M.SKIP end
  if not helper.on_path("java") then
    return "java not found (the Firestore emulator needs a JRE, e.g. openjdk-17-jre-headless)"
  end
  return nil
end

-- Every descendant of pid (children first found through /proc).
local function descendants(pid, out)
  out = out or {}
  local f = io.popen("cat /proc/" .. pid .. "/task/*/children 2>/dev/null")
  local s = f and f:read("a") or ""
  if f then f:close() end
  for c in s:gmatch("%d+") do
    c = tonumber(c)
    descendants(c, out)
    out[#out + 1] = c
  end
  return out
end

local function kill_wait(pid, sig)
  os.execute(("kill -%s %d 2>/dev/null"):format(sig, pid))
  for _ = 1, 250 do
    if not peers.alive(pid) then return true end
    sleep(0.02)
  end
  return not peers.alive(pid)
end

local function stop_pid(pid)
  if not running[pid] then return end
  running[pid] = nil
  local kids = descendants(pid)
  for _, c in ipairs(kids) do          -- java first (deepest first), then the launcher
    if not kill_wait(c, "TERM") then kill_wait(c, "KILL") end
  end
  if not kill_wait(pid, "TERM") then kill_wait(pid, "KILL") end
end

function M.start()
  local why = M.missing()
  if why then error(why, 2) end
  local bin = M.binary()
  local dir = helper.sh(("mktemp -d \"$(cd %s && pwd)\"/firestore.XXXXXX"):format(q(helper.tmpdir)))
  dir = dir:gsub("%s+$", "")
  local e = { dir = dir, project = "demo-tally" }
  local http = require("tally.core").http
  for attempt = 1, 3 do
    e.port = peers.free_port()
    e.host = "127.0.0.1:" .. e.port
    local cmd = ("exec env -u LD_PRELOAD %s start --host=127.0.0.1 --port=%d"):format(q(bin), e.port)
    local f = assert(io.popen(("%s >%s 2>&1 </dev/null & echo $!"):format(cmd, q(dir .. "/emulator.log")), "r"))
    e.pid = tonumber(f:read("*l"))
    f:close()
    running[e.pid] = true
    local h = http("http://" .. e.host, { timeout = 2 })
    local up = false
    for _ = 1, 600 do                  -- about 5 s usually; 30 s at most
      local st = h:request("GET", "/")
      if st then up = true break end
      if not peers.alive(e.pid) then break end
      sleep(0.05)
    end
    h:close()
    if up then break end
    stop_pid(e.pid)
    if attempt == 3 then
      local log = helper.slurp(dir .. "/emulator.log") or ""
      error("the Firestore emulator did not start on port " .. e.port .. ":\n" .. log, 2)
    end
  end
  e.uri = ("firestore://%s?emulator=%s"):format(e.project, e.host)
  e.docs = ("/v1/projects/%s/databases/(default)/documents"):format(e.project)
  local rh = http("http://" .. e.host, { timeout = 30 })
  local cjson = require "cjson"
  function e.rest(method, path, body)
    if type(body) == "table" then body = cjson.encode(body) end
    local st, text, code = rh:request(method, e.docs .. path, body)
    assert(st, tostring(text) .. " " .. tostring(code))
    local ok, doc = pcall(cjson.decode, text)
    return st, ok and doc or nil, text
  end
  function e.wipe()
    local st = rh:request("DELETE", ("/emulator/v1/projects/%s/databases/(default)/documents"):format(e.project))
    assert(st == 200, "wipe failed: " .. tostring(st))
  end
  -- the emulator's own processes (java under the launcher), by PID
  local function signal_all(sig)
    for _, c in ipairs(descendants(e.pid)) do os.execute(("kill -%s %d 2>/dev/null"):format(sig, c)) end
  end
  function e.pause() signal_all("STOP") end
  function e.resume() signal_all("CONT") end
  function e.stop()
    e.resume()                         -- a stopped java would not take SIGTERM
    rh:close()
    stop_pid(e.pid)
    os.execute("rm -rf " .. q(dir))
  end
  return e
end

M._reaper = setmetatable({}, { __gc = function()
  for pid in pairs(running) do pcall(stop_pid, pid) end
end })

package.loaded["spec.support.firestore"] = M
return M
