-- spec/support/cache.lua: a look into a store's cache of counter handles
-- by name, for the Lua 5.4 and the LuaJIT specs alike (require it after
-- the spec's helper has set the module paths).
local core = require "tally.core"

local M = {}

-- Two passes: a handle freed by the first may hold the last reference to
-- what the second frees.
function M.gc()
  collectgarbage("collect")
  collectgarbage("collect")
end

-- The handle the cache holds for name (young, then old), or nil.
function M.cached(db, name)
  local st = core._store_cache(db)
  return st[1][name] or (st[2] and st[2][name])
end

function M.stats(db)
  return core._store_cache_stats(db)
end

return M
