-- tally.prometheus: metric mappings for families, and the Prometheus
-- exposition of a store's counters.
--
-- db:family(pattern, opts) is wrapped here: the C method takes the store's
-- options (shards, policy, idle, max_counters), and this layer takes
-- metric, labels, type and help off the options, validates them and
-- records the mapping for the store handle (process-local, like a
-- function policy: other processes and other handles to the same file do
-- not see it). A family with a histogram option (histogram = { buckets =,
-- unit = }, or type = "histogram") is a histogram family: it goes to the
-- same list, and gives the histograms under its pattern their buckets and
-- unit (db:histogram looks it up with histogram_family) and their metric
-- and labels. tally.prometheus(db [, pattern]) reads the matching
-- counters' exact values in one pass over db:names() and renders them with
-- tally.format.prometheus, the newest matching mapping deciding each
-- counter's series, then the histograms among them.

local core = require "tally.core"
local format = require "tally.format"

local type, error, pairs, ipairs, pcall, getmetatable, rawget =
      type, error, pairs, ipairs, pcall, getmetatable, rawget
local byte, find, gsub, fmt, sub = string.byte, string.find, string.gsub, string.format,
      string.sub
local compat = require "tally.compat"
local mtype, pack, unpack, utf8len, tofloat = compat.mtype, compat.pack, compat.unpack,
      compat.utf8len, compat.tofloat
local describe, printable = require("tally.util").describe, require("tally.util").printable
local check_self = require("tally.util").self

local argerror = require("tally.util").argerror

local histogram = require "tally.histogram"
local next, sort, concat = next, table.sort, table.concat
local int_text = compat.int_text
local HELP_ESC = { ["\\"] = "\\\\", ["\n"] = "\\n" }
local histograms_text               -- below

local _M = {}

local store = core.store_methods
-- The C method. Kept in the methods table so that loading this module
-- again (busted re-runs it for every spec file) does not wrap the wrapper.
local c_family = rawget(store, "_family_c") or store.family
store._family_c = c_family
local c_stats = store.stats

-- Store handle -> its mappings, oldest first. An array is never changed
-- once published (a new family makes a new one), so its compiled form can
-- be kept beside it.
local registry = setmetatable({}, { __mode = "k" })
local compiled = setmetatable({}, { __mode = "k" })
local NONE = {}

local function is_store(db)
  local mt = type(db) == "userdata" and getmetatable(db)
  return mt and mt.__name == "tally.store" or false
end
_M.is_store = is_store

local typename = require("tally.util").typename
_M.typename = typename

-- Call a C store method f as method fname, raising its errors as the
-- method call db:fname(...) would: the C side, called through pcall,
-- counts the store as argument #1 and does not know its own name.
local function call_c(fname, f, ...)
  local r = pack(pcall(f, ...))
  if r[1] then return unpack(r, 2, r.n) end
  local msg = r[2]
  if type(msg) == "string" then
    msg = gsub(msg, "^bad argument #(%d+) to '[^']*'", function(n)
      n = n - 1
      if n == 0 then return "calling '" .. fname .. "' on bad self" end
      return "bad argument #" .. n .. " to '" .. fname .. "'"
    end)
  end
  error(msg, 0)
end
_M.call_c = call_c

local METRIC_KEYS = { metric = true, labels = true, type = true, help = true, histogram = true }

local function valid_pattern(p)
  return type(p) == "string" and #p >= 1 and #p <= core.NAME_MAX and not find(p, "\0", 1, true)
end

-- The series names of a histogram metric m other than m itself.
local function hist_series(m)
  return m .. "_bucket", m .. "_sum", m .. "_count"
end

-- What is wrong with metric (of type kind, for pattern) beside the mappings
-- db has: another type for it, or, with histograms, a metric that is one
-- of a histogram metric's _bucket, _sum or _count series; nil if nothing.
local function collision(db, pattern, metric, kind)
  for _, e in ipairs(registry[db] or {}) do
    if e.pattern ~= pattern and e.metric then
      if e.metric == metric and e.type ~= kind then
        return fmt("metric '%s' is a %s (family '%s'), not a %s", metric, e.type, printable(e.pattern), kind)
      end
      -- each way round: both may be histograms
      local checks = {}
      if kind == "histogram" then checks[#checks + 1] = { metric, e.metric } end
      if e.type == "histogram" then checks[#checks + 1] = { e.metric, metric } end
      for _, hp in ipairs(checks) do
        local hist, other = hp[1], hp[2]
        local b, s, c = hist_series(hist)
        if other == b or other == s or other == c then
          return fmt("metric '%s' (family '%s') would collide with the series of histogram "
                     .. "metric '%s' (%s, %s, %s)", other,
                     printable(other == metric and pattern or e.pattern), hist, b, s, c)
        end
      end
    end
  end
  return nil
end

-- The histogram part of a family's options: { buckets =, unit = } with
-- the defaults filled in, or nil and what is wrong.
local function check_histogram(pattern, opts)
  local spec = opts.histogram
  if spec == true or spec == nil then spec = {} end
  local bounds, unit, msg = histogram.check_spec(spec, "histogram.")
  if not unit then return nil, msg end
  if find(pattern, "[{}]") then
    return nil, "a histogram family's pattern holds no { or } (its histograms' names cannot), "
                .. "got '" .. printable(pattern) .. "'"
  end
  local copy = {}
  for i, x in ipairs(bounds or histogram.DEFAULT_BUCKETS) do copy[i] = x end
  return { buckets = copy, unit = unit }
end

-- The mapping entry for pattern from opts (which has a metric key, or a
-- histogram option), or nil and what is wrong.
local function check_mapping(db, pattern, opts)
  local metric, labels, kind, help = opts.metric, opts.labels, opts.type, opts.help
  local hist
  if opts.histogram ~= nil or kind == "histogram" then
    if kind ~= nil and kind ~= "histogram" then
      return nil, "type of a histogram family must be 'histogram' (or left out), got "
                  .. describe(kind)
    end
    if opts.histogram == false then return nil, "histogram must be true or a table "
                                               .. "{ buckets =, unit = }, got false" end
    local msg
    hist, msg = check_histogram(pattern, opts)
    if not hist then return nil, msg end
    kind = "histogram"
    if metric == nil then              -- buckets and unit only: exposed by name, as before
      return { pattern = pattern, labels = {}, type = kind, histogram = hist }
    end
  end
  if type(metric) ~= "string" or not find(metric, "^[a-zA-Z_:][a-zA-Z0-9_:]*$") then
    return nil, "metric must be a Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*), got "
                .. describe(metric)
  end
  if metric == format.SKIPPED_METRIC then
    return nil, "metric '" .. metric .. "' is reserved for the counters a scrape leaves out"
  end
  if metric == format.DEFAULT_METRIC then
    return nil, "metric '" .. metric .. "' is reserved for counters without a mapping"
  end
  local nwild = format._glob_compile(pattern).nwild
  if labels == nil then labels = {} end
  if type(labels) ~= "table" then
    return nil, "labels must be a table of label names, got " .. describe(labels)
  end
  local copy, seen = {}, {}
  for k in pairs(labels) do
    if mtype(k) ~= "integer" or k < 1 or k > #labels then
      return nil, "labels must be an array of label names"
    end
  end
  for i, l in ipairs(labels) do
    if type(l) ~= "string" or not find(l, "^[a-zA-Z_][a-zA-Z0-9_]*$") or find(l, "^__") then
      return nil, "labels[" .. i .. "] must be a Prometheus label name "
                  .. "([a-zA-Z_][a-zA-Z0-9_]*, not starting with __), got " .. describe(l)
    end
    if l == "le" and hist then
      return nil, "labels[" .. i .. "] 'le' is the label of a histogram's bucket bounds"
    end
    if seen[l] then return nil, "labels has '" .. l .. "' twice" end
    seen[l] = true
    copy[i] = l
  end
  if #copy ~= nwild then
    return nil, fmt("labels must name the %d wildcard%s of '%s' in order, got %d name%s",
                    nwild, nwild == 1 and "" or "s", printable(pattern), #copy, #copy == 1 and "" or "s")
  end
  if kind == nil then kind = "gauge" end
  if not hist and not format.TYPES[kind] then
    return nil, "type must be 'counter', 'gauge', 'untyped' or 'histogram', got " .. describe(kind)
  end
  if help ~= nil and (type(help) ~= "string" or not utf8len(help)) then
    return nil, "help must be a UTF-8 string, got " .. describe(help)
  end
  local msg = collision(db, pattern, metric, kind)
  if msg then return nil, msg end
  return { pattern = pattern, metric = metric, labels = copy, type = kind, help = help,
           histogram = hist }
end

-- db:family(pattern, opts): the C method, plus opts.metric, opts.labels,
-- opts.type and opts.help, which record how counters under pattern are
-- exposed to Prometheus. Only the other options (shards, policy, idle,
-- max_counters) reach the C side; a call with metric options only leaves
-- the family's store options alone.
function store:family(pattern, opts)
  if type(opts) ~= "table" then return call_c("family", c_family, self, pattern, opts) end
  local has_metric, copts = false, nil
  for k, v in pairs(opts) do
    if METRIC_KEYS[k] then
      has_metric = true
    else
      copts = copts or {}
      copts[k] = v                      -- unknown keys too: the C side names them
    end
  end
  if not has_metric then return call_c("family", c_family, self, pattern, opts) end
  if not valid_pattern(pattern) or not is_store(self) then
    call_c("family", c_family, self, pattern, {})   -- raises, and changes nothing
  end
  local is_hist = opts.histogram ~= nil or opts.type == "histogram"
  if opts.metric == nil and not is_hist then
    argerror(2, "family", "labels, type and help need a metric", 2)
  end
  if opts.metric == nil and (opts.labels ~= nil or opts.help ~= nil) then
    argerror(2, "family", "labels and help need a metric", 2)
  end
  if is_hist and copts then              -- (next(): any one of them, named)
    argerror(2, "family", "a histogram family takes no " .. describe(next(copts))
             .. " (its member counters are slot counters, one shard per writer)", 2)
  end
  local entry, msg = check_mapping(self, pattern, opts)
  if not entry then argerror(2, "family", msg, 2) end
  entry.glob = format._glob_compile(pattern)
  if copts then
    local ok, emsg, code = call_c("family", c_family, self, pattern, copts)
    if not ok then return ok, emsg, code end
  else
    call_c("family", c_stats, self)     -- raises if the store is closed
  end
  local list = {}
  for _, e in ipairs(registry[self] or {}) do
    if e.pattern ~= pattern then list[#list + 1] = e end
  end
  list[#list + 1] = entry
  registry[self] = list
  return true
end

-- map_only(db, pattern, opts): db:family(pattern, opts) with only the
-- metric options of opts (metric, labels, type, help, histogram): the
-- mapping is recorded on this handle and the store is left alone (a
-- reader such as tally serve takes a mapping file written for writers,
-- whose store options are theirs to set). Raises as db:family does.
function _M.map_only(db, pattern, opts)
  if type(opts) ~= "table" then return true end
  local mopts
  for k, v in pairs(opts) do
    if METRIC_KEYS[k] then
      mopts = mopts or {}
      mopts[k] = v
    end
  end
  if not mopts then return true end
  return db:family(pattern, mopts)
end

-- db:mappings() -> { { pattern=, metric=, labels={...}, type=, help= }, ... }
-- the metric mappings defined through this store handle, oldest first
-- (copies), in the shape tally.format.prometheus() takes.
function store:mappings()
  check_self(self, "tally.store", "mappings")
  local out = {}
  for i, e in ipairs(registry[self] or {}) do
    local labels = {}
    for j, l in ipairs(e.labels) do labels[j] = l end
    out[i] = { pattern = e.pattern, metric = e.metric, labels = labels, type = e.type,
               help = e.help }
    if e.histogram then
      local b = {}
      for j, x in ipairs(e.histogram.buckets) do b[j] = x end
      out[i].histogram = { buckets = b, unit = e.histogram.unit }
    end
  end
  return out
end

-- histogram_family(db, name) -> the newest histogram family of store handle
-- db whose pattern matches histogram name (the registry's own entry: {
-- pattern =, histogram = { buckets =, unit = }, ... }; not to be changed),
-- or nil. db:histogram takes its buckets and unit from it.
function _M.histogram_family(db, name)
  local list = registry[db]
  if not list then return nil end
  for i = #list, 1, -1 do
    local e = list[i]
    if e.histogram and format._glob_captures(e.glob, name) then return e end
  end
  return nil
end

-- The compiled mapping of store handle db (compiled once per change).
function _M.mapping_of(db)
  local list = registry[db] or NONE
  local c = compiled[list]
  if not c then
    c = format.compile_mapping(list)
    compiled[list] = c
  end
  return c
end

-- ---- logging what a scrape leaves out ---------------------------------------

-- The logger: fn(message) for what tally can only log (a counter a scrape
-- leaves out). Default: a line on stderr; tally.openresty makes it ngx.log.
local function stderr_log(msg) io.stderr:write("tally: ", msg, "\n") end
local logger = stderr_log

-- tally.logger([fn]) -> the logger before; fn false: log nothing, nil:
-- leave it (just return it).
function _M.logger(fn)
  local old = logger
  if fn ~= nil then
    if fn ~= false and type(fn) ~= "function" then
      argerror(1, "logger", "function or false expected, got " .. typename(fn), 2)
    end
    logger = fn or function() end
  end
  return old
end

-- Each counter is logged once per process and reason (at most LOG_MAX
-- distinct ones, then one line saying so): a scrape every few seconds
-- must not flood the log with the same line.
local LOG_MAX = 1000
local logged, nlogged = {}, 0
local function log_once(_, reason, msg)
  local key = reason .. "\0" .. msg      -- (both counters of a duplicate: one line)
  if logged[key] then return end
  if nlogged > LOG_MAX then return end
  nlogged = nlogged + 1
  logged[key] = true
  if nlogged > LOG_MAX then
    msg = "prometheus: more than " .. LOG_MAX .. " counters left out; no more are logged"
  else
    msg = "prometheus: left out of the exposition (counted in " .. format.SKIPPED_METRIC
          .. '{reason="' .. reason .. '"}): ' .. msg
  end
  pcall(logger, msg)                  -- a failing logger must not fail the scrape
end

-- The value of a counter whose sum does not fit int64: the float sum of
-- its shards (0.0 if it was dropped meanwhile).
local function beyond(db, name)
  local v = 0.0
  local c = db:counter(name, { create = false })
  for _, s in ipairs(c and c:shards() or {}) do v = v + tofloat(s) end
  return v
end

-- ---- histograms -------------------------------------------------------------------

-- The exposition of the histograms hs (histogram.group) of db under
-- compiled mapping c: each histogram family's metric (format.
-- _histogram_series: the newest histogram family with a metric whose
-- pattern matches, its wildcards as labels; else the histogram's name made
-- a metric name) once, with HELP and TYPE, then each histogram's series in
-- name order, all read from one snapshot of their members (so _count always
-- equals the +Inf bucket and the buckets add up). Left out, logged and
-- counted by reason in the table returned second: a histogram whose metric
-- or one of its _bucket, _sum, _count series is a metric of the counters
-- (duplicate), two that map to one series (duplicate, both), a name its
-- family pattern matches in more than one way (ambiguous), members that
-- cannot be read (unreadable).
histograms_text = function(db, hs, c)
  local counts, bases, rows, owner, bad = {}, {}, {}, {}, {}
  local function skip(base, reason, msg)
    counts[reason] = (counts[reason] or 0) + 1
    log_once(base, reason, msg)
  end
  local taken = { [format.SKIPPED_METRIC] = true }
  for m, fam in pairs(c.families) do
    if fam.type ~= "histogram" then taken[m] = true end
  end
  for base in pairs(hs) do bases[#bases + 1] = base end
  sort(bases)
  -- one snapshot of every member, not one per histogram: each is a walk
  -- of the whole store (20,000 histograms took 6 minutes), and one cut of
  -- all of them is consistent for each
  local all, all_msg, all_code
  if #bases > 0 then all, all_msg, all_code = db:snapshot("*{*}") end
  local one = {}     -- each histogram's own cut, when the one of all failed
  if all_code == "ERANGE" then
    -- a counter with braces in its name sums beyond int64, and fails the
    -- cut of them all: a cut per histogram leaves out only its own
    all = {}
    for _, base in ipairs(bases) do one[base] = { db:snapshot(base .. "{*}") } end
  end
  for _, base in ipairs(bases) do
    local m, labels, key = format._histogram_series(c, base)
    if not m then
      skip(base, labels, key)
    elseif taken[m] or taken[m .. "_bucket"] or taken[m .. "_sum"] or taken[m .. "_count"] then
      skip(base, "duplicate", fmt("histogram '%s' maps to the metric %s, which another family "
                                  .. "has (or one of its series)", printable(base), m))
    else
      local snap, msg = all, all_msg
      if one[base] then snap, msg = one[base][1], one[base][2] end
      if not snap then
        skip(base, "unreadable", "histogram '" .. printable(base) .. "': " .. tostring(msg))
      else
        local other = owner[key]
        if other then
          local why = fmt("histograms '%s' and '%s' both map to the series %s", printable(other),
                          printable(base), printable(key))
          if not bad[key] then bad[key] = true; skip(other, "duplicate", why) end
          skip(base, "duplicate", why)
        end
        owner[key] = owner[key] or base
        rows[#rows + 1] = { m = m, labels = labels, key = key, base = base, h = hs[base],
                            v = histogram.read(snap, hs[base]) }
      end
    end
  end
  -- a histogram metric that is another's _bucket, _sum or _count series
  -- (histograms lat and lat_sum, or names that sanitise so): both left out
  local hmetric = {}
  for _, r in ipairs(rows) do hmetric[r.m] = hmetric[r.m] or r.base end
  local clash = {}
  for m, base in pairs(hmetric) do
    for _, series in ipairs({ hist_series(m) }) do
      if hmetric[series] then
        local why = fmt("histogram '%s' maps to the metric %s, one of the series of "
                        .. "histogram '%s' (metric %s)", printable(hmetric[series]), series, printable(base), m)
        clash[m], clash[series] = why, why
      end
    end
  end
  for _, r in ipairs(rows) do
    if clash[r.m] and not bad[r.key] then
      bad[r.key] = true
      skip(r.base, "duplicate", clash[r.m])
    end
  end
  local by_metric, metrics = {}, {}
  for _, r in ipairs(rows) do
    if not bad[r.key] then
      local list = by_metric[r.m]
      if not list then list = {}; by_metric[r.m] = list; metrics[#metrics + 1] = r.m end
      list[#list + 1] = r
    end
  end
  sort(metrics)
  local out = {}
  for _, m in ipairs(metrics) do
    local list, fam = by_metric[m], c.families[m]
    local first = list[1]
    local help = fam and (fam.help or fam.default_help)
                 or "tally histogram '" .. format.utf8_text(first.base) .. "' (sum kept in units of "
                    .. first.h.unit_text .. ")"
    out[#out + 1] = "# HELP " .. m .. " " .. gsub(help, "[\\\n]", HELP_ESC) .. "\n# TYPE " .. m
                    .. " histogram\n"
    for _, r in ipairs(list) do
      local l, v, les = r.labels, r.v, r.h.les
      local open = l == "" and '{le="' or "{" .. l .. ',le="'
      local tail = l == "" and " " or "{" .. l .. "} "
      for i, b in ipairs(v.buckets) do
        out[#out + 1] = m .. "_bucket" .. open .. les[i][2] .. '"} ' .. int_text(b.count) .. "\n"
      end
      out[#out + 1] = m .. "_sum" .. tail .. histogram.num_text(v.sum) .. "\n" .. m .. "_count"
                      .. tail .. int_text(v.count) .. "\n"
    end
  end
  return concat(out), counts
end

-- The text of values ({ [name] = value }) of names under compiled mapping
-- c, what a scrape leaves out counted in skips and logged once; htext (the
-- histograms' text) before the tally_prometheus_skipped gauge.
local function render(values, c, names, skips, htext, pause)
  local text, skipped = format._render_prometheus(values, c, names, true, skips, htext, pause)
  if not text then error(skipped, 2) end   -- not reached: the values are all numbers
  for _, sk in ipairs(skipped) do log_once(sk.name, sk.reason, sk.msg) end
  return text
end

-- The counters' values one by one, through db:names and db:value: the
-- way when the store has a damaged counter, which the walk of every
-- value (core._prom_rows) reports for the whole store, where here it is
-- left out alone (unreadable). Returns the text (and the skips logged).
local function by_name(db, pattern, c, pause)
  local values, names, nmsg, ncode = {}, db:names(pattern)
  if not names then return nil, nmsg, ncode end   -- a damaged store
  local hs, htext, skips
  hs, names = histogram.group(names)              -- histograms apart (tally/histogram.lua)
  if next(hs) then htext, skips = histograms_text(db, hs, c) end
  skips = skips or {}
  local chunk = format._chunk
  for i, name in ipairs(names) do
    if pause and i % chunk == 0 then pause() end
    local v, msg, code = db:value(name)
    if code == "ERANGE" then           -- the sum does not fit int64: as a float
      v = beyond(db, name)
    elseif v == nil and code ~= "ENOENT" then   -- ENOENT: dropped meanwhile
      skips.unreadable = (skips.unreadable or 0) + 1
      log_once(name, "unreadable", "counter '" .. printable(name) .. "': " .. tostring(msg))
    end
    values[name] = v
  end
  return render(values, c, names, skips, htext, pause)
end

-- The text in pieces of at most PIECE bytes, to write: a host sends each
-- and may yield between them. A host that pauses reads the name index
-- _slice slots at a time (a few ms on the 2-core VM: about 16,000
-- counters, read and sorted).
local PIECE = 65536
_M._slice = 32768                   -- a knob for tests
local function write_pieces(write, text)
  for i = 1, #text, PIECE do write(sub(text, i, i + PIECE - 1)) end
end

-- The exposition from one walk of the matching counters (core._prom_rows:
-- names and values in name order, no handle per counter). Only the names
-- that may be histogram members (ending in '}') and the values beyond
-- int64 come to Lua here. Without counter families (the common case) the
-- default metric's lines are written by C from the rows, CHUNK counters
-- at a time, each chunk handed to emit as it is made (whole: all of them
-- at once, with what comes before and after, in one buffer); with
-- families, the rows' names and values go to the renderer as before.
local function from_rows(db, rows, c, pause, emit, whole)
  -- a host that yields (pause) reads the counters a slice of the index at
  -- a time, pausing between slices; nothing is emitted before they are read
  while true do
    local done, msg, code = rows:collect(_M._slice)
    if done then break end
    if done == nil then return nil, msg, code end
    pause()
  end
  local idx, names, range = rows:special()
  local brace, at = {}, {}
  for k, name in ipairs(names) do
    if range[k] then rows:set_text(idx[k], format._value_text(beyond(db, name))) end
    if byte(name, -1) == 125 then brace[#brace + 1] = name; at[name] = idx[k] end
  end
  local hs, htext, skips = histogram.group(brace), nil, nil
  if next(hs) then
    for _, h in pairs(hs) do
      for _, n in ipairs(h.names) do rows:exclude(at[n]) end
    end
    htext, skips = histograms_text(db, hs, c)
  end
  skips = skips or {}
  local n, included = rows:count()
  local CHUNK = format._chunk
  if #c.entries == 0 then
    local metric = format.DEFAULT_METRIC
    if included > 0 and whole then
      emit((rows:lines(n, format._DEFAULT_PREFIX, format._DEFAULT_HEX_PREFIX,
                       format._family_head(metric, c.families[metric]),
                       (htext or "") .. format._skipped_text(skips))))
      return true
    end
    if included > 0 then
      emit(format._family_head(metric, c.families[metric]))
      local more
      repeat
        local text
        text, more = rows:lines(CHUNK, format._DEFAULT_PREFIX, format._DEFAULT_HEX_PREFIX)
        if text ~= "" then emit(text) end
        if pause and more then pause() end
      until not more
    end
    if htext then emit(htext) end
    local gauge = format._skipped_text(skips)
    if gauge ~= "" then emit(gauge) end
    return true
  end
  local values, list, k, more = {}, {}, 0, n > 0
  while more do
    local nm, vs, m
    nm, vs, m, more = rows:names(CHUNK)
    for j = 1, m do
      k = k + 1
      list[k], values[nm[j]] = nm[j], vs[j]
    end
    if pause and more then pause() end
  end
  emit(render(values, c, list, skips, htext, pause))
  return true
end

-- tally.prometheus(db [, pattern [, { pause = fn, write = fn }]]) ->
-- exposition text of the matching counters' exact values (with write:
-- true, the text given to write(piece) piece by piece as it is made,
-- the pieces' concatenation being that text), or nil, msg, code if the
-- store's counters cannot be read. A counter that cannot be exposed (its
-- value unreadable, two counters mapping to one series, a name matching
-- its family pattern in more than one way) never fails the scrape: it is
-- left out, counted in the gauge tally_prometheus_skipped{reason=...}
-- and logged once. This process's buffered histograms of db are flushed
-- first. pause: called between chunks of 10,000 counters read or
-- rendered, so that a host can yield there (tally.openresty sleeps 1 ms
-- there); what it or write raises fails the scrape.
function _M.prometheus(db, pattern, opts)
  if not is_store(db) then
    argerror(1, "prometheus", "tally.store expected, got " .. typename(db), 2)
  end
  if pattern ~= nil and type(pattern) ~= "string" then
    argerror(2, "prometheus", "string expected, got " .. typename(pattern), 2)
  end
  local pause, write
  if opts ~= nil then
    if type(opts) ~= "table" then
      argerror(3, "prometheus", "options table expected, got " .. typename(opts), 2)
    end
    for k in pairs(opts) do
      if k ~= "pause" and k ~= "write" then
        argerror(3, "prometheus", "unknown option " .. printable(tostring(k))
                 .. "; expected pause or write", 2)
      end
    end
    pause, write = opts.pause, opts.write
    if pause ~= nil and type(pause) ~= "function" then
      argerror(3, "prometheus", "pause must be a function, got " .. typename(pause), 2)
    end
    if write ~= nil and type(write) ~= "function" then
      argerror(3, "prometheus", "write must be a function, got " .. typename(write), 2)
    end
  end
  -- what this process's buffered histograms hold goes in first (a flush
  -- that fails keeps it for the next: logged, the scrape goes on)
  local fok, fmsg = core.histograms_flush(db)
  if not fok then logger("prometheus: buffered histograms not flushed: " .. tostring(fmsg)) end
  local c = _M.mapping_of(db)
  local out, n = {}, 0
  local emit = write and function(piece) write_pieces(write, piece) end
               or function(piece) n = n + 1; out[n] = piece end
  local rows, ok, done, rmsg, rcode
  rows, rmsg, rcode = core._prom_rows(db, pattern, pause ~= nil)
  if rows then
    ok, done, rmsg, rcode = pcall(from_rows, db, rows, c, pause, emit, not write and not pause)
    rows:close()
    if not ok then error(done, 0) end
  end
  if not done then
    if rcode ~= "ECORRUPT" then return nil, rmsg, rcode end
    local text, msg, code = by_name(db, pattern, c, pause)
    if not text then return nil, msg, code end
    emit(text)
  end
  if write then return true end
  return n == 1 and out[1] or concat(out)
end

return _M
