-- tally.util: what every module of the Lua side uses to report misuse the
-- way the C methods do (luaL_argerror's messages), so there is one way to
-- build them.
--
--   util.argerror(n, fname, msg [, level])  raises "bad argument #n to
--                                'fname' (msg)", blaming the caller of the
--                                function that calls it (level 2 there, as
--                                error() counts; default 2)
--   util.self(v, tname, fname)   v if its metatable's __name is tname, else
--                                raises "bad argument #1 to 'fname' (tname
--                                expected, got T)", or "calling 'fname' on
--                                bad self (...)" when called as v:fname()
--   util.typename(v)             T: a metatable's __name (tally.store,
--                                tally.counter, tally.sink, ...) or type(v)
--   util.describe(v)             a value for messages: 'str', 12, nil, table
--   util.printable(s)            s for a message: control characters (C0,
--                                DEL, C1) and bytes outside a valid UTF-8
--                                sequence as \xNN, valid UTF-8 as it is:
--                                the C side's rule itself (tally_printable
--                                in src/core/error.c, as core.printable).
--                                A name is any bytes but NUL, and one with
--                                a newline or ESC in a message would forge
--                                a log line or drive the terminal

local type, getmetatable, error, tostring = type, getmetatable, error, tostring
local getinfo = debug.getinfo
local compat = require "tally.compat"
local int_text = compat.int_text

local _M = {}

function _M.argerror(n, fname, msg, level)
  error("bad argument #" .. n .. " to '" .. fname .. "' (" .. msg .. ")", (level or 2) + 1)
end

local printable = require("tally.core").printable
_M.printable = printable

-- A short description of a value for messages, like the C side's: 'str', 12.
function _M.describe(v)
  if type(v) == "string" then return "'" .. printable(v) .. "'" end
  if type(v) == "cdata" and int_text(v) then return int_text(v) end  -- LuaJIT int64
  if type(v) == "number" or type(v) == "boolean" then return tostring(v) end
  if v == nil then return "nil" end
  return type(v)
end

local function typename(v)
  local mt = getmetatable(v)
  if type(mt) == "table" and type(mt.__name) == "string" then return mt.__name end
  return type(v)
end
_M.typename = typename

function _M.self(v, tname, fname)
  local mt = getmetatable(v)
  if type(mt) == "table" and mt.__name == tname then return v end
  local what = "(" .. tname .. " expected, got " .. typename(v) .. ")"
  local info = getinfo(2, "n")           -- the method: how its caller called it
  if info and info.namewhat == "method" then
    error("calling '" .. fname .. "' on bad self " .. what, 3)
  end
  error("bad argument #1 to '" .. fname .. "' " .. what, 3)
end

return _M
