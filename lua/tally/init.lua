-- tally: sharded counters for Lua, on the C core in tally.core.
--
-- `require "tally"` gives this table. Stores and counters are C handles;
-- their methods live in core.store_methods / core.counter_methods (the
-- __index tables of their metatables), so the hot ones (c:incr, db:incr)
-- are called with no Lua layer in between. The few methods written in Lua
-- are added to those tables here.

local core = require "tally.core"

local type, error, ipairs = type, error, ipairs
local sort = table.sort
local tointeger = math.tointeger

local _M = { _VERSION = core.version }

_M.version = core.version
_M.open = core.open                 -- the C function itself: errors name 'open'
_M.policies = { "thread", "random", "round_robin", "key" }
_M.MAX_SHARDS = core.MAX_SHARDS
_M.NAME_MAX = core.NAME_MAX
_M.DEFAULT_SHARDS = core.DEFAULT_SHARDS

-- The method tables, for hosts and libraries that add methods of their own.
_M.store_methods = core.store_methods
_M.counter_methods = core.counter_methods

local store = core.store_methods

-- db:top(n [, pattern]) -> { { name = , value = }, ... }
-- The n matching counters with the largest values, largest first (ties by
-- name). Exact: every matching counter is summed now.
function store:top(n, pattern)
  local k = tointeger(n)
  if not k or k < 0 then
    error("bad argument #1 to 'top' (non-negative integer expected, got "
          .. (type(n) == "number" and n or type(n)) .. ")", 2)
  end
  if pattern ~= nil and type(pattern) ~= "string" then
    error("bad argument #2 to 'top' (string expected, got " .. type(pattern) .. ")", 2)
  end
  local rows = {}
  for _, name in ipairs(self:names(pattern)) do
    local v = self:value(name)
    if v then rows[#rows + 1] = { name = name, value = v } end -- skip races with drop
  end
  sort(rows, function(a, b)
    if a.value ~= b.value then return a.value > b.value end
    return a.name < b.name
  end)
  for i = #rows, k + 1, -1 do rows[i] = nil end
  return rows
end

-- db:values([pattern]) -> { [name] = value, ... } for the matching counters.
function store:values(pattern)
  local out = {}
  for _, name in ipairs(self:names(pattern)) do
    out[name] = self:value(name)
  end
  return out
end

return _M
