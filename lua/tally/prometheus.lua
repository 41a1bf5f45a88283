-- tally.prometheus: metric mappings for families, and the Prometheus
-- exposition of a store's counters.
--
-- db:family(pattern, opts) is wrapped here: the C method takes the store's
-- options (shards, policy, idle, max_counters), and this layer takes
-- metric, labels, type and help off the options, validates them and
-- records the mapping for the store handle (process-local, like a
-- function policy: other processes and other handles to the same file do
-- not see it). tally.prometheus(db [, pattern]) reads the matching
-- counters' exact values in one pass over db:names() and renders them with
-- tally.format.prometheus, the newest matching mapping deciding each
-- counter's series.

local core = require "tally.core"
local format = require "tally.format"

local type, error, pairs, ipairs, pcall, getmetatable, rawget =
      type, error, pairs, ipairs, pcall, getmetatable, rawget
local find, gsub, fmt = string.find, string.gsub, string.format
local compat = require "tally.compat"
local mtype, pack, unpack, utf8len, tofloat = compat.mtype, compat.pack, compat.unpack,
      compat.utf8len, compat.tofloat
local describe = require("tally.util").describe
local check_self = require("tally.util").self

local argerror = require("tally.util").argerror

local histogram = require "tally.histogram"
local next, sort, concat, gmatch = next, table.sort, table.concat, string.gmatch
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

local METRIC_KEYS = { metric = true, labels = true, type = true, help = true }

local function valid_pattern(p)
  return type(p) == "string" and #p >= 1 and #p <= core.NAME_MAX and not find(p, "\0", 1, true)
end

-- The mapping entry for pattern from opts (which has a metric key), or
-- nil and what is wrong.
local function check_mapping(db, pattern, opts)
  local metric, labels, kind, help = opts.metric, opts.labels, opts.type, opts.help
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
    if seen[l] then return nil, "labels has '" .. l .. "' twice" end
    seen[l] = true
    copy[i] = l
  end
  if #copy ~= nwild then
    return nil, fmt("labels must name the %d wildcard%s of '%s' in order, got %d name%s",
                    nwild, nwild == 1 and "" or "s", pattern, #copy, #copy == 1 and "" or "s")
  end
  if kind == nil then kind = "gauge" end
  if not format.TYPES[kind] then
    return nil, "type must be 'counter', 'gauge' or 'untyped', got " .. describe(kind)
  end
  if help ~= nil and (type(help) ~= "string" or not utf8len(help)) then
    return nil, "help must be a UTF-8 string, got " .. describe(help)
  end
  for _, e in ipairs(registry[db] or {}) do
    if e.metric == metric and e.type ~= kind and e.pattern ~= pattern then
      return nil, fmt("metric '%s' is a %s (family '%s'), not a %s",
                      metric, e.type, e.pattern, kind)
    end
  end
  return { pattern = pattern, metric = metric, labels = copy, type = kind, help = help }
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
  if opts.metric == nil then
    argerror(2, "family", "labels, type and help need a metric", 2)
  end
  local entry, msg = check_mapping(self, pattern, opts)
  if not entry then argerror(2, "family", msg, 2) end
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
  end
  return out
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

-- ---- histograms -------------------------------------------------------------------

-- The exposition of the histograms hs (histogram.group) of db, each read
-- from one snapshot of its members (so NAME_count always equals the +Inf
-- bucket and the buckets add up), as a function of the other families'
-- text (a histogram whose metric one of them has already is left out and
-- logged), and how many could not be read (left out, logged).
histograms_text = function(db, hs)
  local bases, unreadable, rendered = {}, 0, {}
  for base in pairs(hs) do bases[#bases + 1] = base end
  sort(bases)
  for _, base in ipairs(bases) do
    local h = hs[base]
    local snap, msg = db:snapshot(base .. "{*}")
    if not snap then
      unreadable = unreadable + 1
      log_once(base, "unreadable", "histogram '" .. base .. "': " .. tostring(msg))
    else
      rendered[#rendered + 1] = { base, format.metric_name(base), histogram.read(snap, h), h }
    end
  end
  sort(rendered, function(a, b) return a[2] < b[2] end)
  return function(text)
    local taken, out = {}, {}
    for m in gmatch(text, "# TYPE (%S+)") do taken[m] = true end
    for _, r in ipairs(rendered) do
      local base, m, v, h = r[1], r[2], r[3], r[4]
      if taken[m] then
        log_once(base, "duplicate", fmt("histogram '%s' maps to the metric %s, which another "
                                        .. "family has", base, m))
      else
        taken[m] = true
        out[#out + 1] = "# HELP " .. m .. " tally histogram '" .. gsub(base, "[\\\n]", HELP_ESC)
                        .. "' (sum kept in units of " .. h.unit_text .. ")\n# TYPE " .. m
                        .. " histogram\n"
        for i, b in ipairs(v.buckets) do
          out[#out + 1] = m .. '_bucket{le="' .. h.les[i][2] .. '"} ' .. int_text(b.count) .. "\n"
        end
        out[#out + 1] = m .. "_sum " .. histogram.num_text(v.sum) .. "\n" .. m .. "_count "
                        .. int_text(v.count) .. "\n"
      end
    end
    return concat(out)
  end, unreadable
end

-- tally.prometheus(db [, pattern]) -> exposition text of the matching
-- counters' exact values, or nil, msg, code if the store's names cannot be
-- read. A counter that cannot be exposed (its value unreadable, two
-- counters mapping to one series, a name matching its family pattern in
-- more than one way) never fails the scrape: it is left out, counted in
-- the gauge tally_prometheus_skipped{reason=...} and logged once.
function _M.prometheus(db, pattern)
  if not is_store(db) then
    argerror(1, "prometheus", "tally.store expected, got " .. typename(db), 2)
  end
  if pattern ~= nil and type(pattern) ~= "string" then
    argerror(2, "prometheus", "string expected, got " .. typename(pattern), 2)
  end
  local c = _M.mapping_of(db)
  local values, names, nmsg, ncode = {}, db:names(pattern)
  if not names then return nil, nmsg, ncode end   -- a damaged store
  local unreadable = 0
  local hs
  hs, names = histogram.group(names)              -- histograms apart (tally/histogram.lua)
  local htext
  if next(hs) then htext, unreadable = histograms_text(db, hs) end
  for _, name in ipairs(names) do
    local v, msg, code = db:value(name)
    if code == "ERANGE" then           -- the sum does not fit int64: as a float
      v = 0.0
      local c = db:counter(name, { create = false })
      for _, s in ipairs(c and c:shards() or {}) do v = v + tofloat(s) end
    elseif v == nil and code ~= "ENOENT" then   -- ENOENT: dropped meanwhile
      unreadable = unreadable + 1
      log_once(name, "unreadable", "counter '" .. name .. "': " .. tostring(msg))
    end
    values[name] = v
  end
  local text, skipped = format._render_prometheus(values, c, names, true,
                                                   unreadable > 0 and { unreadable = unreadable } or nil)
  if not text then error(skipped, 2) end   -- not reached: the values are all numbers
  for _, sk in ipairs(skipped) do log_once(sk.name, sk.reason, sk.msg) end
  if htext then text = text .. htext(text) end
  return text
end

return _M
