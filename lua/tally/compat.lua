-- tally.compat: what the Lua side of tally needs from both Lua 5.4 and
-- LuaJIT 2.1, so every lua/tally/*.lua file parses and behaves the same
-- under both.
--
-- Integers. Lua 5.4 has 64-bit integers; under LuaJIT every number is a
-- double, exact for integers within +-2^53 only. The C binding built for
-- LuaJIT returns a counter value within +-2^53 as a plain number and any
-- larger one as an int64_t cdata (boxed by compat.box, which
-- compat.install registers with core.set_box), so no value is ever
-- rounded. The helpers here keep that rule: under LuaJIT an integer is a
-- number when its magnitude is at most 2^53 and an int64_t cdata beyond;
-- under Lua 5.4 they are the plain operators and math functions.
--
--   mtype(x)           math.type; under LuaJIT "integer" for an integral
--                      number within +-2^53 and for an int64_t cdata
--   isnum(x)           a number, or under LuaJIT an int64_t cdata too
--   tointeger(x)       math.tointeger; under LuaJIT also exact for decimal
--                      strings beyond 2^53 (int64_t cdata) and for cdata
--   int_text(x)        "123" for an integer value (or an integral float that
--                      fits int64), else nil; LuaJIT: %.0f for numbers,
--                      tostring minus the LL suffix for cdata
--   add, sub, mul      exact integer + - * (LuaJIT: through int64_t beyond 2^53)
--   idiv, mod          floor division and its remainder (Lua 5.4's // and %)
--   tofloat(x)         x as a float (LuaJIT: tonumber of a cdata)
--   utf8len(s)         utf8.len(s) (strict), or nil for invalid UTF-8
--   utf8_escape(s, set, form)  s with each byte that the pattern class set
--                      matches and that is not part of a valid UTF-8
--                      sequence (strict, as utf8len) written as
--                      form:format(byte); valid sequences kept whole
--   pack, unpack       table.pack, table.unpack

local type, tostring, tonumber, select, load = type, tostring, tonumber, select, load
local floor = math.floor
local byte, find, fmt, match, gsub, sub = string.byte, string.find, string.format,
      string.match, string.gsub, string.sub
local concat = table.concat

local _M = {}

local jit = rawget(_G, "jit")
_M.luajit = type(jit) == "table"

_M.unpack = table.unpack or rawget(_G, "unpack")
_M.pack = table.pack or function(...) return { n = select("#", ...), ... } end

-- The one walk over UTF-8 sequences: tally.json writes the bytes outside
-- them as \udcXX, tally.util's messages as \xNN. A sequence's first byte
-- says its length; utf8len (below, per interpreter) checks the rest.
function _M.utf8_escape(s, set, form)
  local j = find(s, set)
  if not j then return s end
  local utf8len, out, n, i = _M.utf8len, {}, 0, 1
  repeat
    local c = byte(s, j)
    local len = c >= 0xF0 and 4 or c >= 0xE0 and 3 or 2
    n = n + 1
    if c >= 0xC2 and utf8len(sub(s, j, j + len - 1)) == 1 then
      out[n], i = sub(s, i, j + len - 1), j + len
    else
      out[n], i = sub(s, i, j - 1) .. fmt(form, c), j + 1
    end
    j = find(s, set, i)
  until not j
  out[n + 1] = sub(s, i)
  return concat(out)
end

if not _M.luajit then
  -- ---- Lua 5.4: the language's own operators and functions ----------------------
  local mtype, tointeger = math.type, math.tointeger
  -- The operators 5.1 cannot parse, compiled from text so that this file
  -- still parses under LuaJIT.
  local idiv = load("return function(a, b) return a // b end")()

  _M.mtype = mtype
  function _M.isnum(x) return type(x) == "number" end
  _M.tointeger = tointeger
  function _M.int_text(v)
    if mtype(v) == "integer" then return fmt("%d", v) end
    local i = mtype(v) == "float" and tointeger(v)
    if i then return fmt("%d", i) end
    return nil
  end
  function _M.add(a, b) return a + b end
  function _M.sub(a, b) return a - b end
  function _M.mul(a, b) return a * b end
  _M.idiv = idiv
  function _M.mod(a, b) return a % b end
  function _M.tofloat(x) return x + 0.0 end
  _M.utf8len = utf8.len
  function _M.install() end
  return _M
end

-- ---- LuaJIT 2.1 ----------------------------------------------------------------------

local ffi = require "ffi"
local istype = ffi.istype
local int64_t, uint64_t = ffi.typeof("int64_t"), ffi.typeof("uint64_t")

local EXACT = 2^53                     -- every integer up to here is a double
local TWO32 = 4294967296
local INT64_LIMIT = uint64_t(2^63)     -- the first uint64_t beyond int64_t

local function is_int64(x)
  return type(x) == "cdata" and (istype(int64_t, x) or istype(uint64_t, x))
end
_M.is_int64 = is_int64

-- An int64_t cdata back to a number when that is exact.
local function norm(x)
  if x <= EXACT and x >= -EXACT then return tonumber(x) end
  return x
end
_M.norm = norm

-- box(hi, lo) -> the int64_t whose bits are hi * 2^32 + lo (the C side's
-- way back for values beyond 2^53); unbox(x) -> hi, lo, or nil and why.
function _M.box(hi, lo)
  return int64_t(uint64_t(hi) * TWO32 + lo)
end

function _M.unbox(x)
  if istype(uint64_t, x) then
    if x >= INT64_LIMIT then return nil, "uint64_t value beyond the int64_t range" end
  elseif not istype(int64_t, x) then
    return nil
  end
  local u = uint64_t(x)
  return tonumber(u / TWO32), tonumber(u % TWO32)
end

-- Register box and unbox with the C module (once per Lua state is enough;
-- again does no harm).
function _M.install(core)
  if core.set_box then core.set_box(_M.box, _M.unbox) end
end

local function integral(x)
  return x == floor(x) and x - x == 0  -- not nan, not +-inf
end

function _M.mtype(x)
  if type(x) == "number" then
    return integral(x) and x <= EXACT and x >= -EXACT and "integer" or "float"
  end
  if is_int64(x) then return "integer" end
  return nil
end

function _M.isnum(x)
  return type(x) == "number" or is_int64(x)
end

-- The exact integer a decimal string stands for, or nil beyond int64_t.
local function parse_decimal(s)
  local sign, digits = match(s, "^%s*([-+]?)0*(%d+)%s*$")
  if not digits then return nil end
  if #digits <= 15 then
    local n = tonumber(digits)
    if sign == "-" then n = -n end
    return n + 0                        -- no -0
  end
  if #digits > 19 then return nil end
  local u = uint64_t(0)
  for i = 1, #digits do u = u * 10 + (byte(digits, i) - 48) end
  if sign == "-" then
    if u > INT64_LIMIT then return nil end
    return norm(-int64_t(u))
  end
  if u >= INT64_LIMIT then return nil end
  return norm(int64_t(u))
end

function _M.tointeger(x)
  local t = type(x)
  if t == "number" then
    if integral(x) and x >= -2^63 and x < 2^63 then return x end
    return nil
  end
  if t == "string" then
    local n = parse_decimal(x)
    if n ~= nil then return n end
    n = tonumber(x)
    if n == nil then return nil end
    return _M.tointeger(n)
  end
  if is_int64(x) then
    if istype(uint64_t, x) and x >= INT64_LIMIT then return nil end
    return norm(int64_t(x))
  end
  return nil
end

function _M.int_text(v)
  if type(v) == "number" then
    if not integral(v) or v < -2^63 or v >= 2^63 then return nil end
    if v == 0 then return "0" end       -- "%.0f" writes -0 as "-0"
    return fmt("%.0f", v)
  end
  if is_int64(v) then return (gsub(tostring(v), "U?LL$", "")) end
  return nil
end

-- Exact + - * of two integers (numbers or int64_t cdata): a number when
-- the result is within +-2^53, else an int64_t (wrapping like Lua 5.4's
-- integers beyond int64_t).
function _M.add(a, b)
  if type(a) == "number" and type(b) == "number" then
    local r = a + b
    if r < EXACT and r > -EXACT then return r end
  end
  return norm(int64_t(a) + b)
end

function _M.sub(a, b)
  if type(a) == "number" and type(b) == "number" then
    local r = a - b
    if r < EXACT and r > -EXACT then return r end
  end
  return norm(int64_t(a) - b)
end

function _M.mul(a, b)
  if type(a) == "number" and type(b) == "number" then
    local r = a * b
    if r < EXACT and r > -EXACT then return r end
  end
  return norm(int64_t(a) * b)
end

-- Floor division of integers, exact (Lua 5.4's a // b for integers).
local SMALL = 2^52                       -- q * b stays exact below this
function _M.idiv(a, b)
  if type(a) == "number" and type(b) == "number" and a <= SMALL and a >= -SMALL
     and b <= SMALL and b >= -SMALL then
    local q = floor(a / b)
    local r = a - q * b                  -- a / b was rounded: put q right
    if b > 0 then
      if r < 0 then q = q - 1 elseif r >= b then q = q + 1 end
    else
      if r > 0 then q = q - 1 elseif r <= b then q = q + 1 end
    end
    return q
  end
  local x, y = int64_t(a), int64_t(b)
  local q = x / y                        -- truncates toward zero
  if q * y ~= x and (x < 0) ~= (y < 0) then q = q - 1 end
  return norm(q)
end

function _M.mod(a, b)
  return _M.sub(a, _M.mul(_M.idiv(a, b), b))
end

function _M.tofloat(x) return tonumber(x) end

-- utf8.len(s) of Lua 5.4 (strict: no surrogates, nothing beyond
-- U+10FFFF, no overlong forms): the number of characters, or nil and the
-- position of the first invalid byte. The C core's check (tally_utf8_len),
-- the one tally_printable and the Prometheus text use.
_M.utf8len = require("tally.core").utf8len

return _M
