-- tally.cmd.common: what the tally command's Lua parts share (tally.cmd.cli
-- and tally.cmd.watch), so neither has to require the other.
--
--   common.fail(msg [, status])  raises a user error: the command prints
--                                "tally CMD: msg" (no traceback) and exits
--                                with status (default 1)
--   common.Fail                  the metatable of those errors
--   common.rate_text(r)          a rate as the listings show it: "-" for
--                                none, integers exact, else 1-2 decimals

local error, setmetatable = error, setmetatable
local fmt, floor, huge = string.format, math.floor, math.huge

local _M = {}

local Fail = {}
_M.Fail = Fail

function _M.fail(msg, status)
  error(setmetatable({ msg = msg, status = status or 1 }, Fail), 0)
end

function _M.rate_text(r)
  if r == nil or r ~= r or r == huge or r == -huge then return "-" end
  if r == floor(r) and r > -1e15 and r < 1e15 then return fmt("%d", r) end
  local a = r < 0 and -r or r
  return fmt(a < 10 and "%.2f" or "%.1f", r)
end

return _M
