-- tally.json: JSON text whose strings are bytes (counter names), both ways.
--
-- Names are bytes; JSON text is Unicode. The bridge is Python's
-- "surrogateescape" (PEP 383): quote(s) writes valid UTF-8 as it is and
-- each byte that is not part of a valid UTF-8 sequence as the escape
-- \udcXX (XX the byte, 80 to ff), so the text stays JSON and a UTF-8 name
-- is written as it always was. Python reads such a string as str and gets
-- the bytes back with s.encode("utf-8", "surrogateescape").
--
-- encode(v) writes any value made of tables, strings, numbers and
-- booleans (a status page's) the same way: strings through quote, numbers
-- through tally.format (integers exact), keys sorted.
--
-- decode(text) is lua-cjson's decode (no NaN, Infinity or hex numbers, at
-- most 64 levels) with \udcXX read back as the byte (lua-cjson refuses a
-- lone surrogate). lua-cjson keeps the last of a key given twice without a
-- word: decode also says how many keys the text has, and twice(text) names
-- the first key given twice, keys compared as the bytes they stand for
-- ("a" and "\u0061" are one key). lua-cjson is loaded on first use
-- (require "tally" does not load it).

local type, pairs, ipairs, tonumber, tostring, pcall =
      type, pairs, ipairs, tonumber, tostring, pcall
local byte, char, find, fmt, gsub, sub = string.byte, string.char, string.find,
      string.format, string.gsub, string.sub
local concat, sort = table.concat, table.sort
local setmetatable, error = setmetatable, error
local compat = require "tally.compat"
local utf8len, utf8_escape, int_text = compat.utf8len, compat.utf8_escape, compat.int_text
local printable = require("tally.util").printable
local core = require "tally.core"
local json_twice, c_numeric = core.json_twice, core.c_numeric

local _M = {}

-- ---- writing ---------------------------------------------------------------------

local JESC = { ['"'] = '\\"', ["\\"] = "\\\\", ["\n"] = "\\n", ["\r"] = "\\r", ["\t"] = "\\t" }
local function jesc(c) return JESC[c] or fmt("\\u%04x", byte(c)) end

-- `"`, `\` and control bytes escaped; every other byte as it is
local function escaped(s)
  return (gsub(s, '[%c"\\]', jesc))
end

-- json.quote(s) -> '"..."': `"`, `\` and control bytes escaped, bytes that
-- are not UTF-8 as \udcXX, every other byte as it is.
function _M.quote(s)
  s = escaped(s)
  if find(s, "[\128-\255]") and not utf8len(s) then
    s = utf8_escape(s, "[\128-\255]", "\\udc%02x")
  end
  return '"' .. s .. '"'
end

-- json.quote_bytes(s): as versions before 2026-11-25 quoted, every byte
-- over 127 as it is (not JSON when s is not UTF-8): to recognise what
-- they wrote, such as a spool's lines.
function _M.quote_bytes(s)
  return '"' .. escaped(s) .. '"'
end

-- json.empty_array: encode writes it as [] (an empty table is {}).
local EMPTY_ARRAY = setmetatable({}, { __newindex = function()
  error("tally.json.empty_array is read-only", 2)
end })
_M.empty_array = EMPTY_ARRAY

local MAX_DEPTH = 64
local format                             -- tally.format, loaded on first use (it requires this module)

-- v's JSON text appended to out (n entries so far): the new count, or nil
-- and what cannot be written.
local function put(v, out, n, depth)
  local t = type(v)
  if v == nil then
    out[n + 1] = "null"
  elseif t == "string" then
    out[n + 1] = _M.quote(v)
  elseif t == "number" then
    out[n + 1] = format.json_number(v)   -- null for NaN and the infinities
  elseif t == "boolean" then
    out[n + 1] = tostring(v)
  elseif t == "cdata" and int_text(v) then   -- an int64_t under LuaJIT
    out[n + 1] = int_text(v)
  elseif t ~= "table" then
    return nil, "cannot write a " .. t .. " as JSON"
  elseif depth > MAX_DEPTH then
    return nil, "tables nested deeper than " .. MAX_DEPTH .. " levels (a cycle?)"
  elseif v == EMPTY_ARRAY then
    out[n + 1] = "[]"
  else
    local count = 0                      -- keys exactly 1..count: an array
    for _ in pairs(v) do count = count + 1 end
    local array = count > 0
    for i = 1, count do
      if v[i] == nil then array = false; break end
    end
    local keys, by = {}, {}              -- the keys as text; text -> key
    if array then
      for i = 1, count do keys[i] = i end
    else
      for k in pairs(v) do
        local text = type(k) == "string" and k or type(k) == "number" and format.json_number(k)
        if not text then return nil, "cannot write a " .. type(k) .. " key as JSON" end
        if by[text] ~= nil then return nil, "key '" .. printable(text) .. "' is given twice" end
        keys[#keys + 1], by[text] = text, k
      end
      sort(keys)
    end
    for i, k in ipairs(keys) do
      n = n + 1
      out[n] = (i == 1 and (array and "[" or "{") or ",") .. (array and "" or _M.quote(k) .. ":")
      local err
      n, err = put(v[array and k or by[k]], out, n, depth + 1)
      if not n then return nil, err end
    end
    out[n + 1] = #keys == 0 and "{}" or array and "]" or "}"
  end
  return n + 1
end

-- json.encode(v) -> JSON text of v: strings as quote writes them (any
-- bytes), numbers as tally.format.json_number (integers exact, NaN and
-- the infinities as null), a table whose keys are exactly 1 to n as an
-- array, json.empty_array as [], any other table as an object with its
-- keys sorted (a number key as its text). nil, msg for what JSON cannot
-- hold: a function, userdata or thread, a key of another type, a number
-- key and a string key with one text, tables nested beyond 64 levels.
function _M.encode(v)
  format = format or require "tally.format"
  local out = {}
  local n, err = put(v, out, 0, 1)
  if not n then return nil, err end
  return concat(out)
end

-- ---- reading ---------------------------------------------------------------------

-- lua-cjson reads numbers with the decimal point of the locale it was
-- made in (its strtod follows LC_NUMERIC), and cjson.new() aborts the
-- process where that point is more than one byte (ps_AF's U+066B): it is
-- made and reads in the C locale (core.c_numeric, for this thread only),
-- so 0.5 reads as 0.5 whatever the host's locale.
local json
local function new_cjson()
  local j = require("cjson").new()
  j.decode_invalid_numbers(false)   -- no NaN, Infinity or hex numbers
  j.decode_max_depth(64)
  return j
end
local function cjson_decode(text)
  json = json or c_numeric(new_cjson)
  return c_numeric(json.decode, text)
end

-- text with each \udcXX (XX 80 to ff) made \u0000XX, which lua-cjson reads
-- as NUL then "XX", and each \u0000 made \u000000, so that every NUL it
-- reads is a mark: unmark() takes a NUL and its two hex digits back to the
-- byte. A surrogate pair stays (one character). Returns nil when there is
-- no \udcXX, else the text and where each mark starts in it.
local function mark(text)
  if not find(text, "\\u", 1, true) then return nil end   -- (a plain find is 300x faster)
  if not find(text, "\\u[dD][cC][89a-fA-F]%x") then return nil end
  local out, n, last, p, at = {}, 0, 1, 1, {}
  while true do
    p = find(text, "\\", p, true)
    if not p then break end
    local cp = byte(text, p + 1) == 117 and find(text, "^%x%x%x%x", p + 2)   -- \u
               and tonumber(sub(text, p + 2, p + 5), 16)
    if cp and (cp == 0 or (cp >= 0xDC80 and cp <= 0xDCFF)) then
      out[n + 1], out[n + 2] = sub(text, last, p - 1), "\\u0000" .. sub(text, p + 4, p + 5)
      n, last = n + 2, p + 6
      at[#at + 1] = p + 2 * #at
      p = p + 6
    elseif cp and cp >= 0xD800 and cp <= 0xDBFF and find(text, "^\\u[dD][c-fC-F]%x%x", p + 6) then
      p = p + 12
    else
      p = p + (cp and 6 or 2)
    end
  end
  out[n + 1] = sub(text, last)
  return concat(out), at
end

local function unbyte(xx) return char(tonumber(xx, 16)) end

-- v (decoded from marked text) with its marks taken back to bytes, in
-- place; nil if that makes two keys of one object the same bytes.
local function unmark(v)
  if type(v) == "string" then
    return find(v, "\0", 1, true) and (gsub(v, "%z(%x%x)", unbyte)) or v
  end
  if type(v) ~= "table" then return v end
  local renamed
  for k, x in pairs(v) do
    if type(x) == "string" or type(x) == "table" then
      x = unmark(x)
      if x == nil then return nil end
      v[k] = x
    end
    if type(k) == "string" and find(k, "\0", 1, true) then
      renamed = renamed or {}
      renamed[#renamed + 1] = k
    end
  end
  if renamed then                        -- all out, then all in: a key's unmarked
    local moved = {}                     -- bytes may be another's marked ones
    for i, k in ipairs(renamed) do moved[i], v[k] = v[k], nil end
    for i, k in ipairs(renamed) do
      local b = unmark(k)
      if v[b] ~= nil then return nil end
      v[b] = moved[i]
    end
  end
  return v
end

-- "k" or ["k"] after the first, by whether k is a name; [] for an array.
-- For messages: the keys through tally.util.printable.
local function path_text(path)
  local out = { path[1] or "[]" }
  for i = 2, #path do
    local k = path[i]
    out[i] = not k and "[]" or find(k, "^[%a_][%w_]*$") and "." .. k or fmt('["%s"]', k)
  end
  return printable(concat(out))
end
_M.path_text = path_text

-- The number of keys in text (valid JSON): its colons outside strings.
local function keys(text)
  if find(text, "\\", 1, true) then text = gsub(text, "\\.", "") end   -- escapes, \" among them
  local _, n = gsub(gsub(text, '"[^"]*"', ""), ":", "")
  return n
end

-- json.twice(text) -> the first key that an object of text has twice: the
-- keys from the top down to it (false for an array on the way), or nil.
-- For text that json.decode read. One pass in C (tally.core.json_twice)
-- and a sort of the keys: less time than decode's.
function _M.twice(text)
  if find(text, "\0", 1, true) then return nil end   -- decode refuses it
  return json_twice(text)
end

-- json.value(text) -> what json.decode reads, without counting the keys
-- (a caller that tells a key given twice another way: tally.export's
-- streamed import); nil, msg for text decode refuses, or whose \udcXX make
-- two keys of one object the same bytes.
function _M.value(text)
  if find(text, "\0", 1, true) then return nil, "a NUL byte" end
  local marked = mark(text)
  local ok, v = pcall(cjson_decode, marked or text)
  if not ok then return nil, tostring(v) end
  if marked then
    v = unmark(v)
    if v == nil then return nil, "a key is given twice" end
  end
  return v
end

-- json.decode(text) -> value, n: n is how many keys text has, so a caller
-- that knows how many the value has (tally.export's import does, once the
-- document is checked) can tell whether one was given twice before it
-- asks json.twice which. nil, msg for malformed text (lua-cjson's
-- message), or nil, msg, path for two keys that only tell apart as
-- written ("\u00e9" and "\udcc3\udca9" are both the bytes of é).
function _M.decode(text)
  local nul = find(text, "\0", 1, true)  -- lua-cjson would stop reading there
  if nul then return nil, "Expected value but found a NUL byte at character " .. nul end
  local marked, at = mark(text)
  local ok, v = pcall(cjson_decode, marked or text)
  if not ok then
    v = tostring(v)
    if at then                           -- a position in text, not in marked
      v = gsub(v, "at character (%d+)", function(c)
        local n = 0
        for _, m in ipairs(at) do
          if m < tonumber(c) then n = n + 1 end
        end
        return "at character " .. (tonumber(c) - 2 * n)
      end)
    end
    return nil, v
  end
  if marked then
    local u = unmark(v)
    if u == nil then
      local path = json_twice(text)
      if not path then return nil, "a key is given twice" end   -- not expected: twice saw them
      return nil, fmt("key '%s' is given twice", path_text(path)), path
    end
    v = u
  end
  return v, keys(marked or text)
end

return _M
