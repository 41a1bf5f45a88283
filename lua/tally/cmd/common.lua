-- tally.cmd.common: what the tally command's Lua parts share (tally.cmd.cli
-- and tally.cmd.watch), so neither has to require the other.
--
--   common.fail(msg [, status])  raises a user error: the command prints
--                                "tally CMD: msg" (no traceback) and exits
--                                with status (default 1)
--   common.Fail                  the metatable of those errors
--   common.rate_text(r)          a rate as the listings show it: "-" for
--                                none, integers exact, else 1-2 decimals
--   common.hist_sum_text(r)      a histogram's sum (tally.histogram.read's
--                                record) as the listings show it
--   common.printable(s [, lines]) s for a terminal: control characters
--                                and bytes that are not UTF-8 as \xNN

local error, setmetatable, tonumber = error, setmetatable, tonumber
local fmt = string.format
local gsub = string.gsub
local printable = require("tally.util").printable

local _M = {}

local Fail = {}
_M.Fail = Fail

function _M.fail(msg, status)
  error(setmetatable({ msg = msg, status = status or 1 }, Fail), 0)
end

-- the rule is C's (tally ls writes its table in C: cli_peek.c)
_M.rate_text = require("tally.peek").rate_text

-- Decimal places of a unit that is a power of ten (1e-6: 6), else nil.
local function unit_places(unit)
  for k = 0, 18 do
    if tonumber("1e-" .. k) == unit then return k end
  end
  return nil
end

-- A histogram's sum as text: exact from the stored integer when the unit
-- is a power of ten (1e-6: "12.0345"), else 6 significant digits.
function _M.hist_sum_text(r)
  local k, u = unit_places(r.unit), r.sum_units
  if not k or math.type(u) ~= "integer" or u == math.mininteger then return fmt("%.6g", r.sum) end
  if k == 0 then return fmt("%d", u) end
  local p = math.tointeger(10 ^ k)
  local a = u < 0 and -u or u
  local frac = fmt("%0" .. k .. "d", a % p):gsub("0+$", "")
  return (u < 0 and "-" or "") .. fmt("%d", a // p) .. (frac ~= "" and "." .. frac or "")
end

-- s as the command writes it to a terminal: tally.util.printable's
-- \xNN for control characters (C0, DEL, C1) and bytes that are not UTF-8,
-- so that a counter name (any bytes, often from a request) cannot move
-- the cursor, clear the screen, retitle the window or make a line of its
-- own. lines: newlines stay (a message of several lines).
function _M.printable(s, lines)
  if not lines then return printable(s) end
  return (gsub(s, "[^\n]+", printable))
end

return _M
