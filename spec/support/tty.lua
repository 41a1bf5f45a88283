-- spec/support/tty.lua: a pseudo-terminal for specs of the tally command (the
-- prompt, watch, progress bars), through a private tmux server.
--
--   local tty = require "spec.support.tty"
--   local t = tty.open("tally", { env = { HOME = dir } })   -- a shell command line
--   t:type("1+1"); t:keys("Enter")      -- literal text; tmux key names
--   local screen = t:wait("\n2\n>$")     -- poll the screen until a Lua pattern
--   t:close()                            -- kill this test's tmux server
--
-- Each terminal is its own tmux server on its own socket under
-- TALLY_TEST_TMP (`tmux -S SOCKET -f /dev/null`), 120x40, started with
-- LANG=C.UTF-8, TERM for the pane set by tmux. close() runs `kill-server`
-- on that socket only; terminals still open when Lua closes are closed too.
-- Every wait is bounded (TIMEOUT seconds, more under sanitizers) and fails
-- with the last screen. Sanitizer runtimes preloaded into lua5.4
-- (LD_PRELOAD) are not passed on to tmux or what runs in it.

-- a table: Lua 5.1's require marks a module being loaded with a sentinel
if type(package.loaded["spec.support.tty"]) == "table" then return package.loaded["spec.support.tty"] end

local helper = require "spec.support.helper"
local tally = require "tally"
local q = helper.q

local M = {}

M.TIMEOUT = os.getenv("LD_PRELOAD") and 20 or 8   -- seconds per wait
local POLL = 0.03

local open_ones = {}

-- The tally binary as an absolute path (panes start in this directory, but
-- their commands may cd).
function M.bin()
  local bin = helper.bin
  if bin:sub(1, 1) ~= "/" then
    local pwd = assert(io.popen("pwd")):read("l")
    bin = pwd .. "/" .. bin
  end
  return bin
end

function M.available()
  return os.execute("command -v tmux >/dev/null 2>&1") == true
end

local T = {}
T.__index = T

local function tmux(self, args)
  return helper.sh("env -u LD_PRELOAD tmux -S " .. q(self.sock) .. " " .. args)
end

-- open(command [, { env = { NAME = value }, width =, height = }]) -> terminal
function M.open(command, opts)
  opts = opts or {}
  assert(M.available(), "tmux not found: install the Debian package tmux (scripts/setup does)")
  local self = setmetatable({ sock = helper.tmpfile("tmux.sock") }, T)
  local env = { "LANG=C.UTF-8", "LC_ALL=", "TMUX=" }
  for k, v in pairs(opts.env or {}) do
    env[#env + 1] = v == false and ("-u " .. k) or (k .. "=" .. q(v))
  end
  local sets, unsets = {}, {}
  for _, e in ipairs(env) do
    if e:sub(1, 3) == "-u " then unsets[#unsets + 1] = e else sets[#sets + 1] = e end
  end
  local out, code = helper.sh("env -u LD_PRELOAD " .. table.concat(unsets, " ") .. " "
    .. table.concat(sets, " ") .. " tmux -S " .. q(self.sock) .. " -f /dev/null new-session -d"
    .. " -x " .. (opts.width or 120) .. " -y " .. (opts.height or 40) .. " -s t "
    .. q(command .. "; echo '[exit '$?']'; sleep 600"))
  assert(code == 0, "tmux new-session failed: " .. out)
  open_ones[self] = true
  return self
end

-- The screen as text: lines joined by "\n", without trailing blanks (so a
-- prompt "> " at the end of the screen reads ">"), blank lines at the end
-- dropped.
function T:screen()
  local out = tmux(self, "capture-pane -p -t t")
  out = out:gsub("[ \t]+\n", "\n"):gsub("%s+$", "")
  return out
end

-- Send tmux key names: t:keys("Enter"), t:keys("C-c"), t:keys("Tab").
function T:keys(...)
  local args = {}
  for i = 1, select("#", ...) do args[i] = q((select(i, ...))) end
  local out, code = tmux(self, "send-keys -t t " .. table.concat(args, " "))
  assert(code == 0, "tmux send-keys failed: " .. out)
end

-- Type text literally (no key names).
function T:type(text)
  local out, code = tmux(self, "send-keys -t t -l " .. q(text))
  assert(code == 0, "tmux send-keys failed: " .. out)
end

-- Type a line and press Enter.
function T:line(text)
  self:type(text)
  self:keys("Enter")
end

-- Poll the screen until it matches the Lua pattern (or fn(screen) is true);
-- returns the screen, or raises with the last one after TIMEOUT seconds.
function T:wait(pattern, timeout)
  local deadline = tally.now() + (timeout or M.TIMEOUT)
  local screen
  repeat
    screen = self:screen()
    if type(pattern) == "function" then
      if pattern(screen) then return screen end
    elseif screen:find(pattern) then
      return screen
    end
    tally.sleep(POLL)
  until tally.now() > deadline
  error(("screen never showed %s within %gs; it shows:\n%s")
        :format(type(pattern) == "string" and ("'" .. pattern .. "'") or "what was waited for",
                timeout or M.TIMEOUT, screen), 2)
end

-- Record everything the pane writes (escape sequences and all) in a file;
-- returns its path.
function T:record()
  local path = helper.tmpfile("pane.out")
  local out, code = tmux(self, "pipe-pane -t t -o " .. q("cat >> " .. q(path)))
  assert(code == 0, "tmux pipe-pane failed: " .. out)
  return path
end

-- What record() has written so far, once it matches the Lua pattern
-- (polled like wait).
function T:recorded(path, pattern, timeout)
  local deadline = tally.now() + (timeout or M.TIMEOUT)
  local text
  repeat
    local f = io.open(path, "rb")
    text = f and f:read("a") or ""
    if f then f:close() end
    if text:find(pattern) then return text end
    tally.sleep(POLL)
  until tally.now() > deadline
  error(("the recording never showed '%s' within %gs; it has:\n%s")
        :format(pattern, timeout or M.TIMEOUT, text), 2)
end

function T:close()
  if open_ones[self] then
    tmux(self, "kill-server")
    os.remove(self.sock)
    open_ones[self] = nil
  end
end

M._reaper = setmetatable({}, { __gc = function()
  for t in pairs(open_ones) do t:close() end
end })

package.loaded["spec.support.tty"] = M
return M
