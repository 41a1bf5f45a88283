-- tally.check: the check of `self` that every method written in Lua makes,
-- so that a wrong self raises what the C methods raise (luaL_argerror's
-- two forms) instead of an internal error somewhere inside the method.
--
--   check.self(v, tname, fname)  v if its metatable's __name is tname, else
--                                raises "bad argument #1 to 'fname' (tname
--                                expected, got T)", or "calling 'fname' on
--                                bad self (...)" when called as v:fname()
--   check.typename(v)            T: a metatable's __name (tally.store,
--                                tally.counter, tally.sink, ...) or type(v)

local type, getmetatable, error = type, getmetatable, error
local getinfo = debug.getinfo

local _M = {}

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
