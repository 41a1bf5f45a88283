-- tally.histogram: histograms made of batched counters, read as one.
--
-- A histogram NAME is a set of counters of policy "slot" (include/tally.h,
-- "batches and snapshots") whose names say what they are, so that any
-- process can find it in the store and read it back:
--
--   NAME{le=B}            observations v with previous bound < v <= B,
--                         one counter per bound B (NOT cumulative)
--   NAME{le=+Inf}         observations above the last bound
--   NAME{sum,unit=U}      the sum of the observations, as an integer
--                         count of U (U = 1e-06: microseconds when the
--                         observations are seconds)
--
-- B and U are written as the shortest of %.15g, %.16g, %.17g that reads
-- back as the same double, so the bounds round-trip exactly. h:observe(v)
-- is one batch of two increments (its bucket by 1, the sum by v / U
-- rounded to the nearest integer, halves away from zero): a snapshot
-- (db:snapshot) sees both or neither. The count is not stored: it is the
-- sum of the buckets, so count and buckets can never disagree, and the
-- cumulative count of bucket B is the sum of the buckets up to B.
-- h:snapshot() reads all of them in one db:snapshot, one consistent cut.
--
-- A histogram name is 1 to NAME_MAX bytes with room for its longest
-- member name, and holds none of * ? { } (the members are found with the
-- glob NAME{*}). Observations go through a writer in C
-- (core.histogram_writer: include/tally.h, tally_histogram_open) that
-- holds its own handles of the members; under LuaJIT h:observe calls it
-- through the FFI (tally.ffi.observe) when it can.
--
-- Runs under LuaJIT (Lua 5.1 syntax) and Lua 5.4.

local core = require "tally.core"
local util = require "tally.util"
local compat = require "tally.compat"

local type, ipairs, pairs, tostring, tonumber, setmetatable, getmetatable =
      type, ipairs, pairs, tostring, tonumber, setmetatable, getmetatable
local fmt, find, match, byte = string.format, string.find, string.match, string.byte
local floor, huge, abs = math.floor, math.huge, math.abs
local tofloat = compat.tofloat
local sort, concat = table.sort, table.concat
local describe, argerror, check_self, printable = util.describe, util.argerror, util.self, util.printable
local core_observe = core.histogram_observe

local _M = {}

_M.DEFAULT_BUCKETS = { 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10 }
_M.DEFAULT_UNIT = 1e-6
_M.MAX_BUCKETS = 1000        -- bounds, not counting +Inf
local EXACT = 2 ^ 53

-- ---- names ---------------------------------------------------------------------

-- The text of a bound or unit: the shortest %.Ng (N = 15, 16, 17) that
-- reads back as x, with '.' whatever the locale (a member's name must not
-- depend on it); "+Inf" for infinity.
local number_text = core.number_text
local function num_text(x)
  if x == huge then return "+Inf" end
  return number_text(x) or fmt("%.17g", x)   -- (NaN, -inf: refused before)
end
_M.num_text = num_text

local function le_name(name, text) return name .. "{le=" .. text .. "}" end
local function sum_name(name, unit_text) return name .. "{sum,unit=" .. unit_text .. "}" end
_M.le_name, _M.sum_name = le_name, sum_name

-- A member counter's name -> histogram name, "le" or "sum", the bound or
-- unit (a number), its text; nil if name is not a member's.
local function parse(name)
  local base, text = match(name, "^([^{}*?]+){le=([^{}]+)}$")
  if base then
    local b = text == "+Inf" and huge or tonumber(text)
    if b and b == b and num_text(b) == text then return base, "le", b, text end
    return nil
  end
  base, text = match(name, "^([^{}*?]+){sum,unit=([^{}]+)}$")
  if base then
    local u = tonumber(text)
    if u and u > 0 and u < huge and num_text(u) == text then return base, "sum", u, text end
  end
  return nil
end
_M.parse = parse

-- Group member names: { [histogram name] = { les = { {b, text, member}, ...
-- sorted }, sum = member, unit =, unit_text = } } for the complete ones
-- (an +Inf bucket and a sum), and the list of names that are not members
-- of a complete histogram.
function _M.group(names)
  if type(names) ~= "table" then
    argerror(1, "group", "table of names expected, got " .. describe(names), 2)
  end
  local hs, any = {}, false
  for _, n in ipairs(names) do
    local base, kind, x, text
    if byte(n, -1) == 125 then base, kind, x, text = parse(n) end   -- "}": a member?
    if base then
      local h = hs[base]
      if not h then h = { les = {}, names = {} }; hs[base] = h end
      h.names[#h.names + 1] = n
      if kind == "le" then
        h.les[#h.les + 1] = { x, text, n }
        if x == huge then h.inf = n end
      elseif h.sum then
        h.extra_sum = true             -- two units: not one histogram
      else
        h.sum, h.unit, h.unit_text = n, x, text
      end
    end
  end
  local others, member = {}, {}
  for base, h in pairs(hs) do
    if h.inf and h.sum and not h.extra_sum then
      sort(h.les, function(a, b) return a[1] < b[1] end)
      for _, n in ipairs(h.names) do member[n] = true end
      any = true
    else
      hs[base] = nil
    end
  end
  if not any then return hs, names end   -- a million counters and no histogram: no copy
  for _, n in ipairs(names) do
    if not member[n] then others[#others + 1] = n end
  end
  return hs, others
end

-- The members of histogram name in db, as _M.group gives them (false:
-- none complete), or nil, msg, code: a walk of every counter, for a
-- histogram whose +Inf bucket does not carry the mark of the names asked
-- for (core.histogram_stored). Once per histogram, it made opening many
-- of them quadratic.
local function lookup(db, name)
  local names, msg, code = db:names(name .. "{*}")
  if not names then return nil, msg, code end
  local hs = _M.group(names)
  return hs[name] or false
end

-- db:histograms([pattern]) -> { { name =, buckets = { b1, ... }, unit = }, ... }
-- the complete histograms in the store whose names match pattern, by name
-- (the buckets without +Inf); or nil, msg, code.
local function histograms(db, pattern)
  check_self(db, "tally.store", "histograms")
  if pattern ~= nil and type(pattern) ~= "string" then
    argerror(2, "histograms", "string expected, got " .. describe(pattern), 2)
  end
  local names, msg, code = db:names((pattern or "*") .. "{*}")
  if not names then return nil, msg, code end
  local hs = _M.group(names)
  local out = {}
  for base, h in pairs(hs) do
    local b = {}
    for _, e in ipairs(h.les) do
      if e[1] ~= huge then b[#b + 1] = e[1] end
    end
    out[#out + 1] = { name = base, buckets = b, unit = h.unit }
  end
  sort(out, function(x, y) return x.name < y.name end)
  return out
end

-- ---- reading ---------------------------------------------------------------------

-- n units of `unit` as a float. A unit that is 1 / an integer (1e-6: a
-- microsecond) divides by that integer, so that 100000 units of 1e-6 read
-- 0.1, the double nearest the true value, where n * 1e-6 reads
-- 0.09999999999999999.
local function units_value(n, unit)
  local x, per = tofloat(n), 1 / unit
  local r = floor(per + 0.5)
  if r >= 1 and r < 2^53 and abs(per - r) <= r * 1e-12 then return x / r end
  return x * unit
end

-- From a snapshot (name -> value) and a group entry h: { buckets = { { le =,
-- count = cumulative }, ... ending with le = math.huge }, count =, sum =
-- (float, in the observations' units), sum_units = (the integer stored),
-- unit = }.
function _M.read(snap, h)
  if type(snap) ~= "table" then
    argerror(1, "read", "snapshot table expected, got " .. describe(snap), 2)
  end
  if type(h) ~= "table" or type(h.les) ~= "table" or h.sum == nil then
    argerror(2, "read", "a histogram as group() gives it expected, got " .. describe(h), 2)
  end
  local buckets, total = {}, 0
  for i, e in ipairs(h.les) do
    total = total + (snap[e[3]] or 0)
    buckets[i] = { le = e[1], count = total }
  end
  local s = snap[h.sum] or 0
  return { buckets = buckets, count = total, sum = units_value(s, h.unit), sum_units = s,
           unit = h.unit }
end

-- q-quantile estimate of a read histogram r: the upper bound of the bucket
-- it falls in (math.huge in the +Inf bucket), or nil when empty.
function _M.quantile(r, q)
  if type(r) ~= "table" or type(r.count) ~= "number" or type(r.buckets) ~= "table" then
    argerror(1, "quantile", "a histogram as read() gives it expected, got " .. describe(r), 2)
  end
  if type(q) ~= "number" or not (q >= 0 and q <= 1) then
    argerror(2, "quantile", "q must be a number from 0 to 1, got " .. describe(q), 2)
  end
  if r.count == 0 then return nil end
  local rank = q * r.count
  for _, b in ipairs(r.buckets) do
    if b.count >= rank then return b.le end
  end
  return huge
end

-- ---- the histogram object --------------------------------------------------------

local H = {}
H.__index = H
H.__name = "tally.histogram"
function H.__tostring(h) return "tally.histogram: " .. h.name end

-- tally.ffi when it can observe (LuaJIT, FFI on); else nil. Looked up when
-- a histogram is opened: require "tally" installs tally.ffi after this
-- module.
local ffi_mod

-- h:observe(v) -> true | nil, msg, code: one observation, as one batch of
-- its bucket (+1) and the sum (+ v / unit, rounded to the nearest integer,
-- halves away from zero), made by the histogram's writer in C (the bucket
-- search too; core.histogram_writer). Raises for a v that is not a finite
-- number, or whose v / unit is beyond +-2^53; returns nil, msg, code when
-- the batch fails (EBUSY: 64 writer threads hold the store's slots),
-- adding nothing. Under LuaJIT the writer is called through the FFI.
function H:observe(v)
  if getmetatable(self) ~= H then check_self(self, "tally.histogram", "observe") end
  local ok, msg, code
  if type(v) == "number" then
    local f = ffi_mod
    if f and f.enabled and f.observe(self.w, v) then return true end
    ok, msg, code = core_observe(self.w, v)
    if ok then return true end
  end
  -- refused: say why as the argument's error, or report the batch's failure
  if type(v) ~= "number" or v ~= v then
    argerror(1, "observe", "number expected, got " .. (v ~= v and "nan" or describe(v)), 2)
  end
  local s = v / self.unit
  local d = s >= 0 and floor(s + 0.5) or -floor(-s + 0.5)
  if not (d <= EXACT and d >= -EXACT) then
    argerror(1, "observe", fmt("%s is out of range (|v / unit| must be at most 2^53, unit %s)",
                               tostring(v), self.unit_text), 2)
  end
  return ok, msg, code
end

-- Under Lua 5.4 the same method is one C call (core.histogram_method),
-- which hands everything but a plain success to the Lua one above. Under
-- LuaJIT the Lua one stays: its FFI call is compiled into the caller's trace.
if core.histogram_method and not compat.luajit then
  H.observe = core.histogram_method(H, H.observe)
end

-- h:snapshot() -> { buckets = { { le =, count = }, ... }, count =, sum =,
-- sum_units =, unit = } | nil, msg, code: one consistent cut of the
-- histogram (buckets cumulative, the last le = math.huge; count equals its
-- count). Buckets that another process declared are included.
function H:snapshot()
  check_self(self, "tally.histogram", "snapshot")
  if self.buffer > 0 then         -- what this writer holds first
    local ok, msg, code = core.histogram_flush(self.w)
    if not ok then return nil, msg, code end
  end
  local snap, msg, code = self.db:snapshot(self.name .. "{*}")
  if not snap then return nil, msg, code end
  local names = {}
  for n in pairs(snap) do names[#names + 1] = n end
  local h = _M.group(names)[self.name]
  if not h then return nil, "histogram '" .. printable(self.name) .. "' was dropped", "ENOENT" end
  return _M.read(snap, h)
end

-- h:flush() -> true | nil, msg, code: add what a buffered histogram holds
-- to the store as one batch (nothing to do for one that does not buffer).
-- On failure nothing is added and it holds on to all of it.
function H:flush()
  check_self(self, "tally.histogram", "flush")
  return core.histogram_flush(self.w)
end

-- h:names() -> the member counters' names: the buckets in order, +Inf, the sum.
function H:names()
  local out = {}
  for i, n in ipairs(self.members) do out[i] = n end
  return out
end

-- ---- db:histogram ------------------------------------------------------------------

local function check_name(name)
  if type(name) ~= "string" then
    argerror(1, "histogram", "string expected, got " .. describe(name), 3)
  end
  if name == "" or find(name, "[%z{}*?]") then
    argerror(1, "histogram", "a histogram name is not empty and holds none of * ? { } or NUL, "
             .. "got " .. describe(name), 3)
  end
end

-- The bounds (nil when not given; +Inf dropped) and unit of spec, a table
-- { buckets =, unit = } or nil (the defaults); or nil, nil and what is
-- wrong. p names the table in messages: "" for db:histogram's options,
-- "histogram." for a family's histogram option.
local function check_spec(spec, p)
  if spec == nil then return nil, _M.DEFAULT_UNIT end
  if type(spec) ~= "table" then
    if p == "" then return nil, nil, "options table expected, got " .. describe(spec) end
    return nil, nil, "histogram must be true or a table { buckets =, unit = }, got " .. describe(spec)
  end
  for k in pairs(spec) do
    if k ~= "buckets" and k ~= "unit" and not (k == "buffer" and p == "") then
      return nil, nil, "unknown option " .. describe(p == "" and k or p .. tostring(k))
                       .. "; expected " .. p .. "buckets, " .. p .. "unit"
                       .. (p == "" and ", buffer" or "")
    end
  end
  local b, unit = spec.buckets, spec.unit
  if unit == nil then unit = _M.DEFAULT_UNIT end
  if type(unit) ~= "number" or not (unit > 0 and unit < huge) then
    return nil, nil, p .. "unit must be a positive finite number, got " .. describe(unit)
  end
  if b == nil then return nil, unit end
  if type(b) ~= "table" or #b == 0 then
    return nil, nil, p .. "buckets must be a non-empty array of numbers, got " .. describe(b)
  end
  if #b > _M.MAX_BUCKETS then
    return nil, nil, "at most " .. _M.MAX_BUCKETS .. " " .. p .. "buckets, got " .. #b
  end
  local out = {}
  for i, x in ipairs(b) do
    if type(x) ~= "number" or x ~= x or x == -huge then
      return nil, nil, p .. "buckets[" .. i .. "] must be a number, got "
                       .. (x ~= x and "nan" or describe(x))
    end
    if i > 1 and not (x > b[i - 1]) then
      return nil, nil, fmt("%sbuckets must increase: %sbuckets[%d] = %s after %s", p, p,
                           i, num_text(x), num_text(b[i - 1]))
    end
    if x ~= huge then out[#out + 1] = x end   -- +Inf is always there
  end
  if #b ~= #out + (b[#b] == huge and 1 or 0) then
    return nil, nil, p .. "buckets must be a non-empty array of numbers"
  end
  return out, unit
end
_M.check_spec = check_spec

-- The bounds, unit and buffer (0: none) of db:histogram's options.
local function check_opts(opts)
  local bounds, unit, msg = check_spec(opts, "")
  if not unit then argerror(2, "histogram", msg, 3) end
  local n = opts and opts.buffer
  if n == nil or n == false then return bounds, unit, 0 end
  if type(n) ~= "number" or n ~= floor(n) or n < 0 or n > core.HISTOGRAM_MAX_BUFFER then
    argerror(2, "histogram", "buffer must be a count of observations from 0 to "
             .. core.HISTOGRAM_MAX_BUFFER .. ", got " .. describe(n), 3)
  end
  return bounds, unit, n
end

-- "0.1, 0.5, +Inf": the bounds (without +Inf) as member names write them.
local function bounds_text(bounds)
  local t = {}
  for i, x in ipairs(bounds) do t[i] = num_text(x) end
  t[#t + 1] = "+Inf"
  return concat(t, ", ")
end
_M.bounds_text = bounds_text

-- The histogram family (db:family(pattern, { histogram = ... }), kept by
-- tally.prometheus with the metric mappings) that name falls under, or nil:
-- { pattern =, histogram = { buckets =, unit = }, ... }.
local function family_of(db, name)
  local prom = package.loaded["tally.prometheus"]
  return prom and prom.histogram_family(db, name) or nil
end

-- The member counters' names: each bucket's (les), then the sum's.
local function members_of(name, les, unit_text)
  local out = {}
  for i, e in ipairs(les) do out[i] = e[3] end
  out[#les + 1] = sum_name(name, unit_text)
  return out
end

-- Are the member names of les and the sum at most NAME_MAX bytes?
local function fits(name, les, unit_text)
  if #sum_name(name, unit_text) > core.NAME_MAX then return false end
  for _, e in ipairs(les) do
    if #e[3] > core.NAME_MAX then return false end
  end
  return true
end

local function list_text(les)
  local t = {}
  for i, e in ipairs(les) do t[i] = e[2] end
  return concat(t, ", ")
end

-- db:histogram(name [, { buckets = { b1 < b2 < ... }, unit = 1e-6 }]) -> h
-- | nil, msg, code. Opens histogram name, creating its member counters if
-- the store has none yet (buckets: opts.buckets, default DEFAULT_BUCKETS;
-- +Inf is always added). An existing histogram is opened as it is when
-- opts.buckets is nil; given buckets or unit that differ from the
-- stored ones fail with EEXIST. Under a histogram family of db (the newest
-- whose pattern name matches) the family's buckets and unit are the ones
-- asked for, opts or not: a stored histogram with others fails with
-- EEXIST, and opts that differ from them raise. Raises for a bad name or
-- bad options. opts.buffer = N (this handle's, never stored): h:observe
-- holds up to N observations in memory and adds them as one batch when
-- full, at h:flush(), h:snapshot(), db:tick(), tally.prometheus(db) and
-- when closed (db:close, collected); a process that dies loses them.
local function histogram(db, name, opts)
  check_self(db, "tally.store", "histogram")
  check_name(name)
  local bounds, unit, buffer = check_opts(opts)
  local unit_given = opts ~= nil and opts.unit ~= nil
  local fam, whose = family_of(db, name), ""
  if fam then                            -- the family's buckets and unit, always
    local fb, fu = fam.histogram.buckets, fam.histogram.unit
    if bounds and bounds_text(bounds) ~= bounds_text(fb) then
      argerror(2, "histogram", fmt("buckets %s differ from those of family '%s' (%s)",
                                   bounds_text(bounds), printable(fam.pattern), bounds_text(fb)), 2)
    end
    if unit_given and num_text(unit) ~= num_text(fu) then
      argerror(2, "histogram", fmt("unit %s differs from that of family '%s' (%s)",
                                   num_text(unit), printable(fam.pattern), num_text(fu)), 2)
    end
    bounds, unit, unit_given = fb, fu, true
    whose = " (family '" .. printable(fam.pattern) .. "')"
  end
  -- the members asked for (the defaults when not given): a store that
  -- holds none of them, or this very set (the mark its first writer left
  -- on the +Inf bucket), is answered without a walk
  local les, unit_text = {}, num_text(unit)
  for i, x in ipairs(bounds or _M.DEFAULT_BUCKETS) do
    local t = num_text(x)
    les[i] = { x, t, le_name(name, t) }
  end
  les[#les + 1] = { huge, "+Inf", le_name(name, "+Inf") }
  local stored, have, msg, code, asked = "other", nil, nil, nil, nil
  if fits(name, les, unit_text) then
    asked = members_of(name, les, unit_text)
    stored, msg, code = core.histogram_stored(db, asked)
    if not stored then return nil, msg, code end
  end
  if stored == "other" then
    have, msg, code = lookup(db, name)
    if have == nil then return nil, msg, code end
  end
  if have then                           -- the stored set decides
    if bounds then
      local got = list_text(have.les)
      if bounds_text(bounds) ~= got then
        return nil, fmt("histogram '%s' exists with buckets %s, not %s%s", printable(name), got,
                        bounds_text(bounds), whose), "EEXIST"
      end
    end
    if unit_given and num_text(unit) ~= have.unit_text then
      return nil, fmt("histogram '%s' exists with unit %s, not %s%s", printable(name), have.unit_text,
                      num_text(unit), whose), "EEXIST"
    end
    les, unit, unit_text = have.les, have.unit, have.unit_text
  end
  if not fits(name, les, unit_text) then
    local longest = #sum_name(name, unit_text)
    for _, e in ipairs(les) do
      if #e[3] > longest then longest = #e[3] end
    end
    argerror(1, "histogram", fmt("name too long: its member '%s' would be %d bytes (at most %d)",
                                 printable(#les[1][3] >= longest and les[1][3] or sum_name(name, unit_text)),
                                 longest, core.NAME_MAX), 2)
  end
  -- the names asked about are the members unless the stored set decided
  local h = setmetatable({ db = db, name = name, unit = unit, unit_text = unit_text,
                           bounds = {}, buckets = {},
                           members = not have and asked or members_of(name, les, unit_text) }, H)
  for i, e in ipairs(les) do
    if e[1] ~= huge then h.bounds[i], h.buckets[i] = e[1], e[1] end
  end
  h.les_text = list_text(les)
  -- the writer makes the members (slot counters; EPOLICY for a name taken
  -- by a counter of another policy) and holds the only handles of them
  local w, m, k = core.histogram_writer(db, h.bounds, h.members, unit)
  if not w then return nil, m, k end
  h.w, h[1] = w, w                -- [1]: where core.histogram_method reads it
  if buffer > 0 then
    local ok
    ok, m, k = core.histogram_buffer(w, buffer)
    if not ok then return nil, m, k end
  end
  h.buffer = buffer
  local f = package.loaded["tally.ffi"]
  if f and f.observe and not ffi_mod then ffi_mod = f end
  return h
end

-- install(tally): db:histogram, db:histograms; tally.histogram is this module.
function _M.install(tally)
  local store = core.store_methods
  store.histogram = histogram
  store.histograms = histograms
  tally.histogram = _M
end

return _M
