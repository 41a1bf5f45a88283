-- tally.format: text encoders for rollup records and counter values.
--
-- JSON (one object, or an array), InfluxDB line protocol and the Prometheus
-- text exposition format 0.0.4. Every integer is written exactly (with
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

local type, error, ipairs, pairs =
      type, error, ipairs, pairs
local fmt, byte, find, sub, gsub = string.format, string.byte, string.find,
      string.sub, string.gsub
local concat, sort, tinsert = table.concat, table.sort, table.insert
local floor, huge = math.floor, math.huge
local compat = require "tally.compat"
local mtype, isnum, int_text, utf8len = compat.mtype, compat.isnum, compat.int_text,
      compat.utf8len
local idiv, mod, mul = compat.idiv, compat.mod, compat.mul

-- A JSON string literal (tally.json: bytes that are not UTF-8 as \udcXX).
local quote = require("tally.json").quote


local core = require "tally.core"
local _M = { _VERSION = core.version }

-- ---- helpers -----------------------------------------------------------------

local util = require "tally.util"
local describe, argerror, printable = util.describe, util.argerror, util.printable

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

-- ---- Prometheus text exposition (0.0.4) -----------------------------------------

-- Metric names: [a-zA-Z_:][a-zA-Z0-9_:]*; label names: [a-zA-Z_][a-zA-Z0-9_]*.
-- Every other byte becomes '_', and a leading digit gets a '_' in front.
function _M.metric_name(s)
  s = gsub(s, "[^a-zA-Z0-9_:]", "_")
  if s == "" or find(s, "^[0-9]") then s = "_" .. s end
  return s
end

function _M.label_name(s)
  s = gsub(s, "[^a-zA-Z0-9_]", "_")
  if s == "" or find(s, "^[0-9]") then s = "_" .. s end
  return s
end

local LABEL_ESC = { ["\\"] = "\\\\", ['"'] = '\\"', ["\n"] = "\\n" }
local HELP_ESC = { ["\\"] = "\\\\", ["\n"] = "\\n" }

local function label_value(s)
  if not find(s, '[\\"\n]') then return s end  -- the usual case: no copy
  return (gsub(s, '[\\"\n]', LABEL_ESC))
end
local function help_text(s) return (gsub(s, "[\\\n]", HELP_ESC)) end

-- s for a HELP text made from a name or a pattern: as it is when it is
-- UTF-8 (the exposition is), else with each byte over 127 as \xNN.
function _M.utf8_text(s)
  if utf8len(s) then return s end
  return (gsub(s, "[\128-\255]", function(c) return fmt("\\x%02x", byte(c)) end))
end

-- The metric of counters no mapping claims. A counter name can hold any
-- bytes, so it goes into a label value, which carries them all exactly:
-- no two names collide, and there is one metric family however many
-- counters there are (a metric name per counter would defeat Prometheus's
-- per-metric indexing, and sanitising names into metric names merges
-- "a:b" with "a_b"). A gauge, because a tally counter can go down (decr,
-- reset), and a Prometheus counter that goes down reads as a restart to
-- rate(). Label values must be UTF-8: a name that is not is written as the
-- hex of its bytes in a label of another name, so it cannot collide either.
_M.DEFAULT_METRIC = "tally_value"
_M.DEFAULT_LABEL = "counter"
_M.DEFAULT_HEX_LABEL = "counter_hex"
_M.DEFAULT_HELP = "Exact value of a tally counter (the sum of its shards), by counter name."

local TYPES = { counter = true, gauge = true, untyped = true }
_M.TYPES = TYPES

-- A name pattern ('*' any run of bytes, '?' one byte, as db:family) split
-- into the literal pieces between its stars. Each piece is fixed length
-- ('?' matches one byte), so placing every middle piece at its leftmost
-- occurrence is a correct match, and gives each '*' its shortest run.
local function glob_compile(pattern)
  local pieces, nwild = {}, 0
  local start = 1
  repeat
    local star = find(pattern, "*", start, true) or #pattern + 1
    local lit = sub(pattern, start, star - 1)
    local qs = {}                              -- offsets of '?' in the piece
    local p = 0
    while true do
      p = find(lit, "?", p + 1, true)
      if not p then break end
      qs[#qs + 1] = p - 1
    end
    local lua = gsub(lit, "[^%w]", function(c) return c == "?" and "." or "%" .. c end)
    pieces[#pieces + 1] = { len = #lit, pat = "^" .. lua, free = #qs == 0 and lit or nil,
                            unanchored = lua, qs = qs }
    nwild = nwild + #qs
    start = star + 1
  until star > #pattern
  return { pieces = pieces, nwild = nwild + #pieces - 1 }
end
_M._glob_compile = glob_compile

-- The parts of name that the wildcards of compiled glob g matched, in the
-- order of the wildcards, or nil if name does not match.
local function glob_captures(g, name)
  local pieces, n = g.pieces, #name
  local first, k = pieces[1], #pieces
  local flen = first.len
  if k == 1 then                               -- no star: the whole name
    if n ~= flen or not find(name, first.pat) then return nil end
  elseif flen > n or (flen > 0 and not find(name, first.pat)) then
    return nil
  end
  local caps, nc = {}, 0
  local qs = first.qs
  for j = 1, #qs do
    nc = nc + 1
    caps[nc] = sub(name, qs[j] + 1, qs[j] + 1)
  end
  if k == 1 then return caps end
  local pos = flen + 1
  local last = pieces[k]
  local last_at = n - last.len + 1
  if last_at < pos then return nil end
  for i = 2, k - 1 do
    local piece = pieces[i]
    local a = pos
    if piece.len > 0 then
      if piece.free then a = find(name, piece.free, pos, true)
      else a = find(name, piece.unanchored, pos) end
      if not a or a + piece.len > last_at then return nil end
    end
    nc = nc + 1
    caps[nc] = sub(name, pos, a - 1)
    qs = piece.qs
    for j = 1, #qs do
      nc = nc + 1
      caps[nc] = sub(name, a + qs[j], a + qs[j])
    end
    pos = a + piece.len
  end
  if last.len > 0 and not find(name, last.pat, last_at) then return nil end
  nc = nc + 1
  caps[nc] = sub(name, pos, last_at - 1)
  qs = last.qs
  for j = 1, #qs do
    nc = nc + 1
    caps[nc] = sub(name, last_at + qs[j], last_at + qs[j])
  end
  return caps
end
_M._glob_captures = glob_captures

-- Place each middle piece of compiled glob g in name at its leftmost
-- occurrence after the one before, as glob_captures does (left[i]: where
-- piece i starts); false if one does not fit before the last piece.
local function place_left(g, name, left)
  local pieces = g.pieces
  local k = #pieces
  local pos, last_at = pieces[1].len + 1, #name - pieces[k].len + 1
  for i = 2, k - 1 do
    local piece = pieces[i]
    local a = pos
    if piece.len > 0 then
      if piece.free then a = find(name, piece.free, pos, true)
      else a = find(name, piece.unanchored, pos) end
      if not a or a + piece.len > last_at then return false end
    end
    left[i], pos = a, a + piece.len
  end
  return true
end

-- Given the leftmost places (place_left): whether placing the middle
-- pieces rightmost instead, from the end, moves any of them.
local function moves_right(g, name, left)
  local pieces = g.pieces
  local k = #pieces
  local limit = #name - pieces[k].len + 1
  for i = k - 1, 2, -1 do
    local piece = pieces[i]
    local a = limit - piece.len
    if piece.len > 0 then
      while a > left[i] and not find(name, piece.pat, a) do a = a - 1 end
    end
    if a ~= left[i] then return true end
    limit = a
  end
  return false
end

-- Whether name, which matches compiled glob g, matches it in more than one
-- way (so its wildcards could take more than one set of values: 'resp:*:*'
-- and 'resp:a:b:200'). glob_captures places each middle piece leftmost;
-- placing them rightmost, from the end, gives the other extreme of every
-- match, and the two agree exactly when the match is unique.
local left = {}                              -- place_left's, scratch
local function glob_ambiguous(g, name)
  if #g.pieces < 3 then return false end     -- at most one '*': one way
  place_left(g, name, left)
  return moves_right(g, name, left)
end
_M._glob_ambiguous = glob_ambiguous

-- Compile a mapping (an array of { pattern=, metric=, labels=, type=,
-- help= [, histogram = { buckets =, unit = }] }, oldest first, as
-- db:mappings() returns) into { entries (newest first), hists (the
-- histogram families, newest first), families = { [metric] = { type=,
-- help= } } }, or nil and what is wrong. Metric and label names are
-- sanitised here; db:family() refuses invalid ones instead. Histogram
-- families map histograms (tally.histogram), never plain counters; one
-- without a metric only gives buckets.
local COMPILED = {}                 -- marks compiled mappings
local SPLIT_MAX = 64                -- pieces core._prom_split_lines takes
-- Names a scrape's line writer takes at once, and between two calls of
-- its pause (_render_prometheus); a knob for tests.
_M._chunk = 10000

local function compile_mapping(mapping)
  if mapping == nil then mapping = {} end
  if type(mapping) == "table" and mapping[COMPILED] then return mapping end
  if type(mapping) ~= "table" then return nil, "table expected, got " .. describe(mapping) end
  local entries, hists, families = {}, {}, {}
  families[_M.DEFAULT_METRIC] = { type = "gauge", help = _M.DEFAULT_HELP, by = "the default" }
  local n = #mapping
  for i = 1, n do
    local m = mapping[i]
    local what = "mapping[" .. i .. "]"
    if type(m) ~= "table" then return nil, what .. " must be a table, got " .. describe(m) end
    if type(m.pattern) ~= "string" or m.pattern == "" then
      return nil, what .. ".pattern must be a non-empty string, got " .. describe(m.pattern)
    end
    local hist = m.type == "histogram"
    if (m.metric ~= nil or not hist) and (type(m.metric) ~= "string" or m.metric == "") then
      return nil, what .. ".metric must be a non-empty string, got " .. describe(m.metric)
    end
    local mtype_ = m.type == nil and "gauge" or m.type
    if not TYPES[mtype_] and not hist then
      return nil, what .. ".type must be 'counter', 'gauge', 'untyped' or 'histogram', got "
                  .. describe(m.type)
    end
    local unit = hist and type(m.histogram) == "table" and m.histogram.unit or nil
    if hist and not (type(unit) == "number" and unit > 0 and unit < huge) then
      return nil, what .. ".histogram must be { buckets =, unit = } with a positive unit"
    end
    if m.help ~= nil and (type(m.help) ~= "string" or not utf8len(m.help)) then
      return nil, what .. ".help must be a UTF-8 string, got " .. describe(m.help)
    end
    local g = glob_compile(m.pattern)
    local labels, seen = {}, {}
    if m.labels ~= nil and type(m.labels) ~= "table" then
      return nil, what .. ".labels must be a table, got " .. describe(m.labels)
    end
    for j, l in ipairs(m.labels or {}) do
      if type(l) ~= "string" then
        return nil, what .. ".labels[" .. j .. "] must be a string, got " .. describe(l)
      end
      l = _M.label_name(l)
      if seen[l] then return nil, what .. ".labels has '" .. l .. "' twice" end
      if hist and l == "le" then
        return nil, what .. ".labels has 'le', the label of a histogram's bucket bounds"
      end
      seen[l] = true
      labels[j] = l
    end
    if (m.metric ~= nil or not hist) and #labels ~= g.nwild then
      return nil, fmt("%s.labels has %d name%s but '%s' has %d wildcard%s", what, #labels,
                      #labels == 1 and "" or "s", printable(m.pattern), g.nwild, g.nwild == 1 and "" or "s")
    end
    local metric = m.metric and _M.metric_name(m.metric)
    local fam = metric and families[metric]
    if fam and fam.type ~= mtype_ then
      return nil, fmt("metric '%s' is a %s in %s and a %s in %s",
                      metric, fam.type, fam.by, mtype_, what)
    end
    if not fam and metric then
      fam = { type = mtype_, by = what }
      families[metric] = fam
    end
    if m.help ~= nil and fam then fam.help = m.help end   -- the newest help wins
    if hist and metric and not fam.help then
      fam.default_help = fmt("tally histograms '%s' (sums kept in units of %s)",
                             _M.utf8_text(m.pattern), float_text(unit))
    end
    local prefixes = {}
    local ordered = true                -- labels already in the order of series keys
    for j, l in ipairs(labels) do
      prefixes[j] = (j == 1 and "{" or ",") .. l .. '="'
      if j > 1 and labels[j - 1] .. '="' > l .. '="' then ordered = false end
    end
    local e = { glob = g, metric = metric, labels = labels, prefixes = prefixes,
                ordered = ordered, bare = metric and metric .. "{}", pattern = m.pattern }
    if hist then tinsert(hists, 1, e) else tinsert(entries, 1, e) end  -- newest first
  end
  -- An entry with one '*' and nothing else wild, the only one of its
  -- metric, maps every name it claims to a series of its own (the part
  -- the '*' matched, which differs between names): its lines are written
  -- in C (_render_prometheus; simple). Its literal ends are UTF-8, so that
  -- part is UTF-8 whenever the name is. So with two '*' or more (split:
  -- its literal pieces and label prefixes): a name that matches in one
  -- way has parts of its own, UTF-8 when the name is, and C splits it.
  local uses = {}
  for _, e in ipairs(entries) do uses[e.metric] = (uses[e.metric] or 0) + 1 end
  for _, e in ipairs(entries) do
    local pieces = e.glob.pieces
    if _M._lua_lines_only or uses[e.metric] ~= 1 then       -- luacheck: ignore 542
      -- the general way (_lua_lines_only: tests compare it with C's)
    elseif #pieces > 2 and #pieces <= SPLIT_MAX and e.glob.nwild == #pieces - 1 then
      local lits, utf8 = {}, true
      for j = 1, #pieces do
        lits[j] = pieces[j].free
        utf8 = utf8 and utf8len(lits[j]) ~= nil
      end
      if utf8 then e.split = { pieces = lits, prefixes = e.prefixes } end
    elseif #pieces == 2 and e.glob.nwild == 1 then
      local first, last = pieces[1], pieces[2]
      local lit1 = sub(e.pattern, 1, first.len)
      local lit2 = sub(e.pattern, #e.pattern - last.len + 1)
      if utf8len(lit1) and utf8len(lit2) then
        e.simple = { head = first.len, tail = last.len, first = first.pat, last = last.pat,
                     prefix = e.metric .. e.prefixes[1] }
      end
    end
  end
  return { [COMPILED] = true, entries = entries, hists = hists, families = families }
end

-- format.compile_mapping(mapping) -> the mapping compiled, to pass to
-- format.prometheus() in its place when it serves many calls.
function _M.compile_mapping(mapping)
  local c, msg = compile_mapping(mapping)
  if not c then argerror(1, "compile_mapping", msg, 2) end
  return c
end

-- The default metric's series up to the name (core._prom_lines writes
-- the rest: the name escaped, or its bytes in hex where it is not UTF-8).
local DEFAULT_PREFIX = _M.DEFAULT_METRIC .. "{" .. _M.DEFAULT_LABEL .. '="'
local DEFAULT_HEX_PREFIX = _M.DEFAULT_METRIC .. "{" .. _M.DEFAULT_HEX_LABEL .. '="'
_M._DEFAULT_PREFIX, _M._DEFAULT_HEX_PREFIX = DEFAULT_PREFIX, DEFAULT_HEX_PREFIX

-- For a split entry's glob g (compile_mapping): 1 if name matches g in
-- one way, 2 in more than one, nil if not at all, as glob_captures and
-- glob_ambiguous tell, without making the parts.
local function split_match(g, name)
  local pieces, n = g.pieces, #name
  local first, last = pieces[1], pieces[#pieces]
  if first.len > n or (first.len > 0 and not find(name, first.pat)) then return nil end
  local last_at = n - last.len + 1
  if last_at < first.len + 1 or not place_left(g, name, left) then return nil end
  if last.len > 0 and not find(name, last.pat, last_at) then return nil end
  return moves_right(g, name, left) and 2 or 1
end

-- The entry of name: the first (newest) of entries that matches it, and
-- what its wildcards matched (nil for a simple or split entry), and true
-- for a split entry that name matches in one way; nil if none does.
local function first_entry(entries, name)
  for i = 1, #entries do
    local e = entries[i]
    local q = e.simple
    if q then
      local n = #name
      if n >= q.head + q.tail and find(name, q.first) and find(name, q.last, n - q.tail + 1) then
        return e
      end
    elseif e.split then
      local m = split_match(e.glob, name)
      if m then return e, nil, m == 1 end       -- 2: entry_series finds it ambiguous
    else
      local caps = glob_captures(e.glob, name)
      if caps then return e, caps end
    end
  end
  return nil
end

-- The series of counter name under e, its entry (first_entry; caps: what
-- the wildcards matched, nil to find out): its metric, the series text
-- ('likes_total{post="1"}') and a key that is equal for two series exactly
-- when Prometheus sees one series (labels sorted, empty values dropped, as
-- Prometheus treats them); nil, "ambiguous", message; or false for the
-- default metric (a part that is not UTF-8).
local function entry_series(e, name, caps)
  caps = caps or glob_captures(e.glob, name)
  if glob_ambiguous(e.glob, name) then     -- no labels rather than wrong ones
    return nil, "ambiguous", fmt("counter '%s' matches '%s' in more than one way, so "
                                 .. "its label values are ambiguous", printable(name), printable(e.pattern))
  end
  local nc, plain = #caps, e.ordered
  for j = 1, nc do
    local cap = caps[j]
    if not utf8len(cap) then return false end
    if cap == "" then plain = false end
  end
  if nc == 0 then return e.metric, e.metric, e.bare end
  local p, series = e.prefixes, nil
  if nc == 1 then
    series = e.metric .. p[1] .. label_value(caps[1]) .. '"}'
  else
    local parts = { e.metric }
    for j = 1, nc do parts[j + 1] = p[j] .. label_value(caps[j]) .. '"' end
    parts[nc + 2] = "}"
    series = concat(parts)
  end
  if plain then return e.metric, series, series end
  local keys = {}
  for j = 1, nc do
    if caps[j] ~= "" then keys[#keys + 1] = sub(p[j], 2) .. label_value(caps[j]) .. '"' end
  end
  sort(keys)
  return e.metric, series, e.metric .. "{" .. concat(keys, ",") .. "}"
end

-- The label names of counter name's series under compiled mapping c, as
-- _render_prometheus writes it (the entry's labels, or the default
-- metric's counter or counter_hex). The Pushgateway sink checks them
-- against its group's labels.
function _M._series_labels(c, name)
  local e, caps = first_entry(c.entries, name)
  if e then
    caps = caps or glob_captures(e.glob, name)
    local utf8 = true
    for j = 1, #caps do utf8 = utf8 and utf8len(caps[j]) ~= nil end
    if utf8 then return e.labels end
  end
  return { utf8len(name) and _M.DEFAULT_LABEL or _M.DEFAULT_HEX_LABEL }
end

-- The series of histogram name (tally.histogram) under compiled mapping c:
-- its metric, its labels as written inside the braces ('route="/api"', ""
-- for none; the le label comes after them), a key equal for two
-- histograms exactly when Prometheus sees one series, and the family's
-- compiled entry (nil for none). The newest histogram family with a metric
-- whose pattern matches name decides; without one (or with label values
-- that are not UTF-8) the metric is name made a metric name, with no
-- labels. nil, "ambiguous", message: name matches that family's pattern
-- in more than one way.
function _M._histogram_series(c, name)
  local hists = c.hists or {}
  for i = 1, #hists do
    local e = hists[i]
    local caps = e.metric and glob_captures(e.glob, name)
    if caps then
      if glob_ambiguous(e.glob, name) then
        return nil, "ambiguous", fmt("histogram '%s' matches '%s' in more than one way, so "
                                     .. "its label values are ambiguous", printable(name),
                                     printable(e.pattern))
      end
      local parts, keys = {}, {}
      for j = 1, #caps do
        if not utf8len(caps[j]) then parts = nil; break end
        local l = e.labels[j] .. '="' .. label_value(caps[j]) .. '"'
        parts[j] = l
        if caps[j] ~= "" then keys[#keys + 1] = l end
      end
      if parts then
        sort(keys)
        return e.metric, concat(parts, ","), e.metric .. "{" .. concat(keys, ",") .. "}", e
      end
      break
    end
  end
  local m = _M.metric_name(name)
  return m, "", m .. "{}", nil
end

local function value_text(v)
  if mtype(v) == "integer" then return int_text(v) end
  if v ~= v then return "NaN" end
  if v == huge then return "+Inf" end
  if v == -huge then return "-Inf" end
  return float_text(v)
end
_M._value_text = value_text

-- The self-metric of a lenient rendering: what it left out, by reason.
_M.SKIPPED_METRIC = "tally_prometheus_skipped"
local SKIPPED_HELP = "Counters left out of this exposition, by reason: ambiguous (a name that "
  .. "matches its family pattern in more than one way), duplicate (two or more counters map "
  .. "to one series), unreadable (its value could not be read)."

-- The exposition text of samples (an array of { name=, value= }, or a
-- table { [name] = value } with names, the sorted array of its names)
-- under mapping; or nil, what is wrong, and 1 or 2 (the argument at
-- fault) or 0 (a counter that cannot be exposed: two counters map to one
-- series, or an ambiguous name). lenient: such counters are left out
-- instead, counted in the tally_prometheus_skipped gauge appended to the
-- text (only when some were, plus the count of extra, a table { reason
-- = n } of skips found by the caller), and the text is followed by the
-- list of { name =, reason =, msg = } skipped. tail: text (more families)
-- to place after the families and before that gauge.
function _M._render_prometheus(samples, mapping, names, lenient, extra, tail, pause)
  if type(samples) ~= "table" then return nil, "table expected, got " .. describe(samples), 1 end
  local c, msg = compile_mapping(mapping)
  if not c then return nil, msg, 2 end
  if not names then
    local values = {}
    names = {}
    if samples[1] ~= nil then          -- records: the last one of a name wins
      for i, s in ipairs(samples) do
        if type(s) ~= "table" then
          return nil, "samples[" .. i .. "] must be a table, got " .. describe(s), 1
        end
        local name, v = s.name, s.value
        if type(name) ~= "string" then
          return nil, "samples[" .. i .. "].name must be a string, got " .. describe(name), 1
        end
        if not isnum(v) then
          return nil, "samples[" .. i .. "].value must be a number, got " .. describe(v), 1
        end
        if values[name] == nil then names[#names + 1] = name end
        values[name] = v
      end
    else
      for name, v in pairs(samples) do
        if type(name) ~= "string" then
          return nil, "samples must be an array of { name =, value = } or a table of "
                      .. "values by name", 1
        end
        if not isnum(v) then
          return nil, "samples[" .. describe(name) .. "] must be a number, got " .. describe(v), 1
        end
        names[#names + 1] = name
        values[name] = v
      end
    end
    sort(names)
    samples = values
  end
  local lines, owner = {}, {}            -- metric -> lines; series key -> name
  local skipped, counts, bad = {}, {}, {}
  local function skip(name, reason, msg)
    skipped[#skipped + 1] = { name = name, reason = reason, msg = msg }
    counts[reason] = (counts[reason] or 0) + 1
  end
  -- Lines written in C, from a list of names and values each (a million
  -- counters took 8 s in Lua, three new strings a line): the default
  -- metric's (the names themselves, escaped or in hex) and each simple or
  -- split entry's (compile_mapping); no two of their names share a series. Other
  -- mapped names may, so they wait for every name to be seen, in parallel
  -- arrays (not a table per row).
  local default, inc, entries = _M.DEFAULT_METRIC, {}, c.entries
  local rmetric, rseries, rkey, rvalue, nrows = {}, {}, {}, {}, 0
  local mapped, CHUNK = #entries > 0, _M._chunk
  -- A list's lines are written CHUNK names at a time, and pause (if any)
  -- is called after each CHUNK names: a host that yields there
  -- (tally.openresty sleeps 1 ms) serves other requests during a long
  -- scrape. The lines come out the same.
  local function flush(list, l)
    if l.n == 0 then return end
    local text
    if list == default then
      text = core._prom_lines(DEFAULT_PREFIX, DEFAULT_HEX_PREFIX, l.names, l.values, l.n)
    elseif list.simple then
      local q = list.simple
      text = core._prom_lines(q.prefix, DEFAULT_HEX_PREFIX, l.names, l.values, l.n, q.head,
                              q.tail)
    else
      local q = list.split
      text = core._prom_split_lines(list.metric, q.prefixes, q.pieces, l.names, l.values, l.n)
    end
    local metric = list == default and default or list.metric
    local out = lines[metric]
    if not out then out = {}; lines[metric] = out end
    out[#out + 1] = text
    l.names, l.values, l.n = {}, {}, 0
  end
  for i = 1, #names do
    if pause and i % CHUNK == 0 then pause() end
    local name = names[i]
    local v = samples[name]
    if v ~= nil then
      local e, caps, split = nil, nil, nil
      if mapped then e, caps, split = first_entry(entries, name) end
      local list, metric, series, key = nil, nil, nil, nil
      if not e then
        list = default
      elseif (e.simple or split) and utf8len(name) then
        list = e
      else
        metric, series, key = entry_series(e, name, caps)
        if metric == false then list = default end
      end
      if list then
        local l = inc[list]
        if not l then l = { names = {}, values = {}, n = 0 }; inc[list] = l end
        local n = l.n + 1
        l.n, l.names[n] = n, name
        if type(v) == "number" and mtype(v) == "integer" then l.values[n] = v
        else l.values[n] = value_text(v) end   -- a float, a 64-bit cdata: as Lua writes it
        if n == CHUNK then flush(list, l) end
      elseif not metric then
        if not lenient then return nil, key, 0 end
        skip(name, series, key)
      else
        local other = owner[key]
        if other then
          local msg = fmt("counters '%s' and '%s' both map to the series %s", printable(other),
                          printable(name), printable(series))
          if not lenient then return nil, msg, 0 end
          if not bad[key] then bad[key] = true; skip(other, "duplicate", msg) end
          skip(name, "duplicate", msg)
        else
          owner[key] = name
        end
        nrows = nrows + 1
        rmetric[nrows], rseries[nrows], rkey[nrows], rvalue[nrows] = metric, series, key, v
      end
    end
  end
  for list, l in pairs(inc) do flush(list, l) end
  for i = 1, nrows do
    if not bad[rkey[i]] then
      local metric = rmetric[i]
      local l = lines[metric]
      if not l then l = {}; lines[metric] = l end
      local n = #l
      l[n + 1], l[n + 2], l[n + 3], l[n + 4] = rseries[i], " ", value_text(rvalue[i]), "\n"
    end
  end
  local metrics = {}
  for metric in pairs(lines) do metrics[#metrics + 1] = metric end
  sort(metrics)
  local out = {}
  for _, metric in ipairs(metrics) do
    out[#out + 1] = _M._family_head(metric, c.families[metric])
    out[#out + 1] = concat(lines[metric])
  end
  out[#out + 1] = tail
  if lenient then
    for reason, n in pairs(extra or {}) do counts[reason] = (counts[reason] or 0) + n end
    out[#out + 1] = _M._skipped_text(counts)
    return concat(out), skipped
  end
  return concat(out)
end

-- A family's # HELP (when it has one) and # TYPE lines.
function _M._family_head(metric, fam)
  return (fam.help and "# HELP " .. metric .. " " .. help_text(fam.help) .. "\n" or "")
         .. "# TYPE " .. metric .. " " .. fam.type .. "\n"
end

-- The tally_prometheus_skipped gauge of counts ({ [reason] = n }), or ""
-- when nothing was left out.
function _M._skipped_text(counts)
  local reasons = {}
  for reason in pairs(counts) do reasons[#reasons + 1] = reason end
  if #reasons == 0 then return "" end
  sort(reasons)
  local m = _M.SKIPPED_METRIC
  local out = { "# HELP " .. m .. " " .. SKIPPED_HELP .. "\n# TYPE " .. m .. " gauge\n" }
  for _, reason in ipairs(reasons) do
    out[#out + 1] = m .. '{reason="' .. reason .. '"} ' .. int_text(counts[reason]) .. "\n"
  end
  return concat(out)
end

-- format.prometheus(samples [, mapping]) -> exposition text (format 0.0.4).
-- samples: an array of { name = counter name, value = number } (rollup
-- records qualify) or a table { [name] = value }. mapping: an array of
-- { pattern=, metric=, labels=, type=, help= } as db:mappings() returns,
-- or the result of format.compile_mapping();
-- for each name the newest (last) matching entry wins, and names no entry
-- claims go to tally_value{counter="<name>"}. Families are sorted by
-- metric name, series in counter-name order (bytewise); # HELP (when there
-- is one) and # TYPE come once per family. Raises if two names map to one
-- series, if a name matches its entry's pattern in more than one way (its
-- label values would be a guess), or if two entries give one metric
-- different types. (tally.prometheus and the sinks leave such counters out
-- instead.) A counter
-- named more than once (records of several rollups) is written once, with
-- its last value.
function _M.prometheus(samples, mapping)
  local text, msg, arg = _M._render_prometheus(samples, mapping)
  if text then return text end
  if arg == 0 then error("prometheus: " .. msg, 2) end
  argerror(arg, "prometheus", msg, 2)
end

return _M
