-- spec/luajit/helper.lua: module paths, temporary files, child processes and
-- the two paths (FFI and classic) for the LuaJIT specs.
--
-- These specs are Lua 5.1 (LuaJIT 2.1) code, named *_ljspec.lua so the Lua
-- 5.4 busted run (pattern _spec) leaves them alone; ctest's busted_luajit
-- runs them under luajit. TALLY_LUAJIT_BUILD (default build/luajit) is put
-- first on package.path/cpath; TALLY_TEST_TMP holds the store files;
-- TALLY_LUAJIT_BIN and TALLY_LUA54 are the interpreters for child
-- processes; TALLY_BUILD_DIR is the Lua 5.4 tree (for the wrong-module
-- checks).

if package.loaded["spec.luajit.helper"] then return package.loaded["spec.luajit.helper"] end

local M = {}

M.build = os.getenv("TALLY_LUAJIT_BUILD") or "build/luajit"
M.build54 = os.getenv("TALLY_BUILD_DIR") or "build"
M.luajit = os.getenv("TALLY_LUAJIT_BIN") or "luajit"
M.lua54 = os.getenv("TALLY_LUA54") or "lua5.4"
M.tmpdir = os.getenv("TALLY_TEST_TMP") or "/tmp/tally-spec"

-- The LuaJIT tree first, whatever busted added from .busted (whose paths
-- name build/, the Lua 5.4 module, which LuaJIT must never load).
local b = M.build
local function first(paths, entries)
  for _, e in ipairs(entries) do
    local s, n = paths:find(e .. ";", 1, true)
    while s do
      paths = paths:sub(1, s - 1) .. paths:sub(n + 1)
      s, n = paths:find(e .. ";", 1, true)
    end
  end
  return table.concat(entries, ";") .. ";" .. paths
end
package.path = first(package.path, { b .. "/?.lua", b .. "/?/init.lua" })
package.cpath = first(package.cpath, { b .. "/?.so" })

-- A single-quoted shell word.
function M.q(s)
  return "'" .. tostring(s):gsub("'", "'\\''") .. "'"
end

os.execute("mkdir -p " .. M.q(M.tmpdir))

local tag
do
  local t = os.tmpname()
  os.remove(t)
  tag = "lj" .. t:match("([^/]+)$"):gsub("[^%w]", "")
end
local seq = 0

-- A fresh path under the temporary directory (nothing exists there yet).
function M.tmpfile(what)
  seq = seq + 1
  local p = string.format("%s/%s-%d-%s", M.tmpdir, tag, seq, what or "store.tly")
  os.remove(p)
  return p
end

-- Run a shell command; returns its stdout+stderr and whether it exited 0
-- (LuaJIT's popen close gives no exit status, so the command echoes it).
function M.sh(cmd)
  local f = assert(io.popen("(" .. cmd .. ") 2>&1; echo \"exit=$?\"", "r"))
  local out = f:read("*a")
  f:close()
  local body, code = out:match("^(.-)exit=(%d+)\n?$")
  return body, tonumber(code)
end

-- The Lua prologue of a child luajit: the same module paths as this process.
function M.prologue()
  return ("package.path = %q .. package.path; package.cpath = %q .. package.cpath; "):format(
    b .. "/?.lua;" .. b .. "/?/init.lua;", b .. "/?.so;")
end

-- Start `luajit -e code` in the background (env: "VAR=value ..." or nil);
-- returns a handle whose :wait() gives the output and the exit code.
function M.spawn(code, env)
  local cmd = (env and env .. " " or "") .. M.q(M.luajit) .. " -e " .. M.q(M.prologue() .. code)
  local f = assert(io.popen("(" .. cmd .. ") 2>&1; echo \"exit=$?\"", "r"))
  return {
    wait = function()
      local out = f:read("*a")
      f:close()
      local body, rc = out:match("^(.-)exit=(%d+)\n?$")
      return body, tonumber(rc)
    end,
  }
end

-- The message of the error fn(...) raises, without the "file:line: "
-- position (nil if it does not raise).
function M.err(fn, ...)
  local ok, msg = pcall(fn, ...)
  if ok then return nil end
  if type(msg) ~= "string" then return msg end
  return (msg:gsub("^[^\n]-:%d+: ", "", 1))
end

-- Every result of fn(...) as a list (errors as { error = message }), for
-- comparing the two paths.
function M.outcome(fn, ...)
  local r = { pcall(fn, ...) }
  if not r[1] then
    return { error = type(r[2]) == "string" and r[2]:gsub("^[^\n]-:%d+: ", "", 1) or r[2] }
  end
  table.remove(r, 1)
  return r
end

-- The two ways the hot methods run under LuaJIT: paths() lists them,
-- use(path) switches (the FFI one is what require "tally" picks).
M.paths = { "ffi", "classic" }
function M.use(path)
  local on = require("tally.ffi").enable(path == "ffi")
  assert(on == (path == "ffi"), "cannot switch to the " .. path .. " path: "
         .. tostring(require("tally.ffi").reason))
end

package.loaded["spec.luajit.helper"] = M
return M
