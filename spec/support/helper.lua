-- spec/support/helper.lua: module paths, temporary files and child processes for specs.
--
-- busted loads it first (--helper, or .busted); specs get the same table with
-- `local helper = require "spec.support.helper"`. TALLY_BUILD_DIR (default ./build)
-- is put first on package.path/cpath, TALLY_TEST_TMP holds the store files,
-- TALLY_BIN is the tally executable used for child processes.

-- a table: Lua 5.1's require marks a module being loaded with a sentinel
if type(package.loaded["spec.support.helper"]) == "table" then return package.loaded["spec.support.helper"] end

local M = {}

M.build = os.getenv("TALLY_BUILD_DIR") or "build"
M.bin = os.getenv("TALLY_BIN") or (M.build .. "/bin/tally")
M.tmpdir = os.getenv("TALLY_TEST_TMP") or "/tmp/tally-spec"

-- First, always: .busted puts ./build's paths in front of ctest's, and a
-- sanitizer build's specs must load that build's module, not ./build's.
local b = M.build
local function first(path, entries)
  for _, e in ipairs(entries) do
    local at = path:find(e .. ";", 1, true)
    while at do
      path = path:sub(1, at - 1) .. path:sub(at + #e + 1)
      at = path:find(e .. ";", 1, true)
    end
  end
  return table.concat(entries, ";") .. ";" .. path
end
package.path = first(package.path, { b .. "/?.lua", b .. "/?/init.lua" })
package.cpath = first(package.cpath, { b .. "/?.so" })

-- A single-quoted shell word.
function M.q(s)
  return "'" .. tostring(s):gsub("'", "'\\''") .. "'"
end

os.execute("mkdir -p " .. M.q(M.tmpdir))

-- A tag unique to this run (os.tmpname makes a unique file; keep its name).
local tag
do
  local t = os.tmpname()
  os.remove(t)
  tag = t:match("([^/]+)$"):gsub("[^%w]", "")
end
local seq = 0

-- A fresh path under the temporary directory (nothing exists there yet).
function M.tmpfile(what)
  seq = seq + 1
  local p = string.format("%s/%s-%d-%s", M.tmpdir, tag, seq, what or "store.tly")
  os.remove(p)
  return p
end

function M.write(path, data)
  local f = assert(io.open(path, "wb"))
  f:write(data)
  f:close()
end

-- Run a shell command; returns its stdout+stderr and its exit code.
-- (LuaJIT's close() gives no code: the shell prints it last.)
function M.sh(cmd)
  if _VERSION == "Lua 5.1" then
    local f = assert(io.popen("{ " .. cmd .. "\n} 2>&1; echo \"exit=$?\"", "r"))
    local body, code = f:read("*a"):match("^(.-)exit=(%d+)\n?$")
    f:close()
    return body, tonumber(code)
  end
  local f = assert(io.popen(cmd .. " 2>&1", "r"))
  local out = f:read("a")
  local _, _, code = f:close()
  return out, code
end

-- Is bin on PATH? (os.execute returns true under Lua 5.4, the status under
-- LuaJIT.)
function M.on_path(bin)
  local found = os.execute("command -v " .. M.q(bin) .. " >/dev/null 2>&1")
  return found == true or found == 0
end

-- Does this process run as root (files can be given away, tmpfs mounted)?
function M.is_root()
  return (M.sh("id -u")):match("^0%s") ~= nil
end

-- The contents of a file, or nil if it cannot be read.
function M.slurp(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  return s
end

-- Run the tally executable with stdout and stderr apart: out, err, exit
-- code. stdin: text for its standard input, or nil (/dev/null).
local function split(prefix, stdin, ...)
  local args = {}
  for i = 1, select("#", ...) do args[i] = M.q((select(i, ...))) end
  local errfile = M.tmpfile("stderr")
  local cmd = prefix .. M.q(M.bin) .. " " .. table.concat(args, " ") .. " 2>" .. M.q(errfile)
  if stdin then
    local infile = M.tmpfile("stdin")
    M.write(infile, stdin)
    cmd = cmd .. " <" .. M.q(infile)
  else
    cmd = cmd .. " </dev/null"
  end
  local f = assert(io.popen(cmd))
  local out = f:read("a")
  local _, _, code = f:close()
  local err = M.slurp(errfile) or ""
  os.remove(errfile)
  return out, err, code
end

function M.tally_split(stdin, ...)
  return split("", stdin, ...)
end

-- tally_split, killed after secs seconds (exit code 137: it ran out).
function M.tally_within(secs, stdin, ...)
  return split("timeout -s KILL " .. secs .. " ", stdin, ...)
end

-- Run a Lua 5.4 script in a child that loads the module from the build
-- tree, killed after secs seconds: its stdout+stderr and exit code.
function M.lua_within(secs, script)
  local file = M.tmpfile("script.lua")
  M.write(file, script)
  local out, code = M.sh(("timeout -s KILL %d env LUA_PATH=%s LUA_CPATH=%s lua5.4 %s")
    :format(secs, M.q(M.build .. "/?.lua;" .. M.build .. "/?/init.lua;;"),
      M.q(M.build .. "/?.so;;"), M.q(file)))
  os.remove(file)
  return out, code
end

-- Run the tally executable with the given arguments (quoted for the shell).
function M.tally(...)
  local args = {}
  for i = 1, select("#", ...) do args[i] = M.q((select(i, ...))) end
  return M.sh(M.q(M.bin) .. " " .. table.concat(args, " "))
end

-- Start the tally executable in the background; returns the popen file.
function M.spawn(...)
  local args = {}
  for i = 1, select("#", ...) do args[i] = M.q((select(i, ...))) end
  return assert(io.popen(M.q(M.bin) .. " " .. table.concat(args, " ") .. " 2>&1", "r"))
end

-- The message of the error fn(...) raises, without the "file:line: "
-- position Lua puts in front (nil if it does not raise).
function M.err(fn, ...)
  local ok, msg = pcall(fn, ...)
  if ok then return nil end
  if type(msg) ~= "string" then return msg end
  return (msg:gsub("^[^\n]-:%d+: ", "", 1))
end

-- Capturing tally.logger's messages: capture() sends them to `logged`
-- (emptied first), restore() puts the old logger back. For a describe
-- block: before_each(capture); after_each(restore).
function M.logger_capture()
  local tally = require "tally"
  local logged, old = {}, nil
  local function capture()
    for i = #logged, 1, -1 do logged[i] = nil end
    old = tally.logger(function(msg) logged[#logged + 1] = msg end)
  end
  local function restore() tally.logger(old) end
  return logged, capture, restore
end

function M.sum(t)
  local s = 0
  for _, v in ipairs(t) do s = s + v end
  return s
end

function M.nonzero(t)
  local n = 0
  for _, v in ipairs(t) do if v ~= 0 then n = n + 1 end end
  return n
end

-- The randomized specs' draws, from seed (Park-Miller: exact in doubles,
-- so Lua 5.4 and LuaJIT draw the same): r(n) -> 1..n, and word(max) ->
-- up to max of pieces (an array of strings) joined.
function M.random_words(seed, pieces)
  local function r(n)
    seed = (seed * 16807) % 2147483647
    return seed % n + 1
  end
  local function word(max)
    local t = {}
    for i = 1, r(max + 1) - 1 do t[i] = pieces[r(#pieces)] end
    return table.concat(t)
  end
  return r, word
end

package.loaded["spec.support.helper"] = M
return M
