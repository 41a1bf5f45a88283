-- tally.format: text encoders for rollup records and counter values.
--
-- JSON (one object, or an array) and InfluxDB line protocol; the
-- Prometheus text exposition (0.0.4) is tally.prometheus's, and
-- format.prometheus calls it. Every integer is written exactly (with
-- string.format("%d"); under LuaJIT see tally.compat.int_text), so any
-- int64 survives (lua-cjson 2.1.0 writes numbers with 14 significant
-- digits, and is used by tally only to read JSON). Floats are written with
-- the fewest digits that read back as the same double, and never as nan or
-- inf, which none of these formats has.
--
-- A record is { name = string, value = integer, at = seconds since the
-- epoch (ms precision), delta = integer, rate = number }; name and value
-- are required, the others are written when present. Misuse raises
-- "bad argument #1 to 'json' (record.value must be an integer, got 1.5)".

local type, ipairs, pairs = type, ipairs, pairs
local fmt, find, gsub = string.format, string.find, string.gsub
local concat = table.concat
local floor, huge = math.floor, math.huge
local compat = require "tally.compat"
local mtype, int_text = compat.mtype, compat.int_text
local idiv, mod, mul = compat.idiv, compat.mod, compat.mul

-- A JSON string literal (tally.json: bytes that are not UTF-8 as \udcXX).
local quote = require("tally.json").quote


local core = require "tally.core"
local _M = { _VERSION = core.version }

-- ---- helpers -----------------------------------------------------------------

local util = require "tally.util"
local describe, argerror = util.describe, util.argerror

-- int_text(v): the decimal text of an integer (or of a float with an
-- exact integer value), or nil (tally.compat).

local function finite(x)
  return type(x) == "number" and x == x and x ~= huge and x ~= -huge
end

-- The shortest of %.15g, %.16g, %.17g that reads back as x (x finite),
-- with '.' whatever the locale (string.format follows LC_NUMERIC).
local number_text = core.number_text
local function float_text(x)
  if mtype(x) == "integer" then return int_text(x) end
  return number_text(x)
end
_M._float_text = float_text   -- (tally.prometheus writes numbers by it too)

-- The one JSON writer of the Lua side: records (below), exports and the
-- tally command's listings all write strings and numbers through these.
-- format.json_string(s) -> '"..."'; format.json_number(x) -> integers
-- exact (int64 cdata under LuaJIT too), floats in the fewest digits that
-- read back the same, "null" for nil, NaN and infinities.
_M.json_string = quote
function _M.json_number(x)
  if x == nil then return "null" end
  if type(x) == "number" and not finite(x) then return "null" end
  return int_text(x) or float_text(x)
end

-- at (seconds) rounded to an integer count of units per second (1000 for
-- milliseconds), or nil if it is not a finite number that fits.
local function scaled(at, per)
  if not finite(at) then return nil end
  local x = at * per + 0.5
  if x >= 2^63 or x < -2^63 then return nil end
  return floor(x)
end

-- format.at_text(at) -> at as seconds with exactly three decimals,
-- "1700000000.123", whatever the locale; nil if it is not finite.
local function at_text(at)
  local ms = scaled(at, 1000)
  if not ms then return nil end
  local sign = ""
  if ms < 0 then sign, ms = "-", -ms end
  return fmt("%s%s.%03d", sign, int_text(idiv(ms, 1000)), mod(ms, 1000))
end
_M.at_text = at_text

-- ---- JSON --------------------------------------------------------------------

-- The JSON text of record r, or nil and what is wrong (naming it as `what`).
local function record_json(r, what)
  if type(r) ~= "table" then return nil, what .. " must be a table, got " .. describe(r) end
  if type(r.name) ~= "string" then
    return nil, what .. ".name must be a string, got " .. describe(r.name)
  end
  local value = int_text(r.value)
  if not value then return nil, what .. ".value must be an integer, got " .. describe(r.value) end
  local out = { '{"name":', quote(r.name), ',"value":', value }
  if r.at ~= nil then
    local at = at_text(r.at)
    if not at then return nil, what .. ".at must be a finite number, got " .. describe(r.at) end
    out[#out + 1] = ',"at":' .. at
  end
  if r.delta ~= nil then
    local delta = int_text(r.delta)
    if not delta then return nil, what .. ".delta must be an integer, got " .. describe(r.delta) end
    out[#out + 1] = ',"delta":' .. delta
  end
  if r.rate ~= nil then
    if type(r.rate) ~= "number" then
      return nil, what .. ".rate must be a number, got " .. describe(r.rate)
    end
    out[#out + 1] = ',"rate":' .. (finite(r.rate) and float_text(r.rate) or "null")
  end
  if r.id ~= nil then                  -- the identity a spooled record carries
    if type(r.id) ~= "string" then return nil, what .. ".id must be a string, got " .. describe(r.id) end
    out[#out + 1] = ',"id":' .. quote(r.id)
  end
  out[#out + 1] = "}"
  return concat(out)
end

-- format.json(record) -> '{"name":"x","value":6,"at":1700000000.123,"delta":1,"rate":0.1}'
-- Keys in that order; value and delta exact; at with three decimals; a
-- rate that is nan or infinite is written as null.
function _M.json(record)
  local s, msg = record_json(record, "record")
  if not s then argerror(1, "json", msg, 2) end
  return s
end

-- format.json_array(records) -> "[{...},{...}]" ("[]" when empty).
function _M.json_array(records)
  if type(records) ~= "table" then
    argerror(1, "json_array", "table expected, got " .. describe(records), 2)
  end
  local out = {}
  for i, r in ipairs(records) do
    local s, msg = record_json(r, "records[" .. i .. "]")
    if not s then argerror(1, "json_array", msg, 2) end
    out[i] = s
  end
  return "[" .. concat(out, ",") .. "]"
end

-- ---- InfluxDB line protocol ---------------------------------------------------

-- Measurements escape comma and space; tag keys and values also '='.
-- InfluxDB 1.x keeps other backslashes as they are (it does not read "\\"
-- as one), so they are written as they are; a name ending in one would
-- escape the separator after it, and is refused.
local function influx_escape(s, eq)
  return (gsub(s, eq and "[, =]" or "[, ]", "\\%0"))
end

-- the precisions InfluxDB takes (1.x: n or ns, u, ms, s, m, h; 2.x: us for u)
local PRECISION = { h = true, m = true, s = true, ms = true, u = true, us = true, ns = true,
                    n = true }   -- (1.x's /write takes n for ns)
local MS_PER = { h = 3600000, m = 60000, s = 1000 }
local NS_LIMIT = compat.tointeger("9223372036854775")  -- microseconds that fit as ns

-- format.influx(records [, opts]) -> one line per record, each ending in "\n":
--   tally,name=post:1:likes value=6i,delta=1i,rate=0.1 1700000000123
-- opts.measurement (default "tally"), opts.precision "s", "ms" (default),
-- "u" (or "us") or "ns" (also "m" and "h"; whole units, rounded down). delta and rate are left out when absent (rate
-- also when nan or infinite), the timestamp when `at` is absent. Line
-- protocol cannot carry a newline in a tag: such a name raises.
function _M.influx(records, opts)
  if type(records) ~= "table" then
    argerror(1, "influx", "table expected, got " .. describe(records), 2)
  end
  local measurement, precision = "tally", "ms"
  if opts ~= nil then
    if type(opts) ~= "table" then
      argerror(2, "influx", "table expected, got " .. describe(opts), 2)
    end
    for k, v in pairs(opts) do
      if k == "measurement" then
        if type(v) ~= "string" or v == "" or find(v, "[\n\r]") then
          argerror(2, "influx", "measurement must be a non-empty string "
                .. "without newlines, got " .. describe(v), 2)
        end
        -- a line starting with # is a comment; InfluxDB reads \, \space
        -- and \= in a measurement as the second byte, and a backslash
        -- at the end escapes the comma after it
        if find(v, "^#") or find(v, "\\$") or find(v, "\\[, =]") then
          argerror(2, "influx", "measurement " .. describe(v) .. " cannot be carried by line "
                .. "protocol (it starts with #, ends in a backslash, or has one before , space "
                .. "or =)", 2)
        end
        measurement = v
      elseif k == "precision" then
        if not PRECISION[v] then
          argerror(2, "influx", "precision must be 's', 'ms', 'u', 'ns', 'm' or 'h', got "
                .. describe(v), 2)
        end
        precision = v == "n" and "ns" or v
      else
        argerror(2, "influx", "unknown option " .. describe(k), 2)
      end
    end
  end
  local head = influx_escape(measurement, false) .. ",name="
  local out = {}
  for i, r in ipairs(records) do
    local what = "records[" .. i .. "]"
    local function bad(msg) argerror(1, "influx", what .. msg, 3) end
    if type(r) ~= "table" then bad(" must be a table, got " .. describe(r)) end
    local name = r.name
    if type(name) ~= "string" then bad(".name must be a string, got " .. describe(name)) end
    if find(name, "[\n\r]") then
      bad(".name " .. describe(name) .. " has a newline, which line protocol cannot carry in a tag")
    end
    if find(name, "\\$") then
      bad(".name " .. describe(name) .. " ends in a backslash, which line protocol cannot carry in a tag")
    end
    local value = int_text(r.value)
    if not value then bad(".value must be an integer, got " .. describe(r.value)) end
    local line = { head, influx_escape(name, true), " value=", value, "i" }
    if r.delta ~= nil then
      local delta = int_text(r.delta)
      if not delta then bad(".delta must be an integer, got " .. describe(r.delta)) end
      line[#line + 1] = ",delta=" .. delta .. "i"
    end
    if r.rate ~= nil then
      if type(r.rate) ~= "number" then bad(".rate must be a number, got " .. describe(r.rate)) end
      if finite(r.rate) then line[#line + 1] = ",rate=" .. float_text(r.rate) end
    end
    if r.at ~= nil then
      local t
      if precision == "ms" then t = scaled(r.at, 1000)
      elseif MS_PER[precision] then t = scaled(r.at, 1000); t = t and idiv(t, MS_PER[precision])
      else
        t = scaled(r.at, 1000000)    -- microseconds: exact for ms-precision times
        if t and precision == "ns" then
          t = (t < NS_LIMIT and t > -NS_LIMIT) and mul(t, 1000) or nil
        end
      end
      if not t then bad(".at must be a finite number of seconds that fits, got " .. describe(r.at)) end
      line[#line + 1] = " " .. int_text(t)
    end
    line[#line + 1] = "\n"
    out[i] = concat(line)
  end
  return concat(out)
end

-- ---- Prometheus -------------------------------------------------------------------

-- format.prometheus(samples [, mapping]): the exposition of samples
-- (tally.prometheus holds every Prometheus rule; this is its encoder for
-- the sinks' records, kept here beside the others).
function _M.prometheus(samples, mapping)
  return require("tally.prometheus").samples_text(samples, mapping)
end

return _M
