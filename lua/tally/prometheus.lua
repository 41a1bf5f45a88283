-- tally.prometheus: every Prometheus rule of the Lua side, in one place:
-- the text exposition format 0.0.4 (metric and label names, escapes, the
-- default metric, HELP and TYPE, the skipped-series gauge), metric
-- mappings for families, and the exposition of a store's counters. The C
-- side's is the core's src/core/exposition.c (a store's unmapped counters,
-- tally_prometheus in tally.h: the walk, the default metric's lines) and
-- src/lua/lua_exposition.c (the lines of lists of names, a family's, and
-- a scrape's rows mapped by the families as the walk's runs are merged);
-- tally.format.prometheus and the sinks' Pushgateway format call the
-- encoder here.
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
-- counters' exact values in one walk and renders them by the rules
-- below, the newest matching mapping deciding each counter's series,
-- then the histograms among them.

local core = require "tally.core"
local float_text = require("tally.format")._float_text

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
local int_text, isnum = compat.int_text, compat.isnum
local huge, tinsert = math.huge, table.insert
local histograms_text               -- below

local _M = {}


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
-- (The C core writes this metric's lines of a store's counters, and these
-- names are its: tally.h's TALLY_PROM_*.)
_M.DEFAULT_METRIC = core.PROM_METRIC
_M.DEFAULT_LABEL = core.PROM_LABEL
_M.DEFAULT_HEX_LABEL = core.PROM_HEX_LABEL
_M.DEFAULT_HELP = core.PROM_HELP

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

-- Place each middle piece of compiled glob g in name at its leftmost
-- occurrence after the one before (left[i]: where piece i starts); false
-- if one does not fit before the last piece.
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

local placed = {}                            -- place_left's, scratch

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
  if last_at < pos or not place_left(g, name, placed) then return nil end
  if last.len > 0 and not find(name, last.pat, last_at) then return nil end
  placed[k] = last_at                          -- the last piece ends the name
  for i = 2, k do                              -- each star's run, then the piece's '?'s
    local piece, a = pieces[i], placed[i]
    nc = nc + 1
    caps[nc] = sub(name, pos, a - 1)
    qs = piece.qs
    for j = 1, #qs do
      nc = nc + 1
      caps[nc] = sub(name, a + qs[j], a + qs[j])
    end
    pos = a + piece.len
  end
  return caps
end
_M._glob_captures = glob_captures

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
local function glob_ambiguous(g, name)
  if #g.pieces < 3 then return false end     -- at most one '*': one way
  place_left(g, name, placed)
  return moves_right(g, name, placed)
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
-- its pause (_render_prometheus: 500 lines, about 0.1 ms); a knob for
-- tests.
_M._chunk = 500

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
                     prefix = e.metric .. e.prefixes[1], lit1 = lit1, lit2 = lit2 }
      end
    end
  end
  -- the entries as a scrape's rows map them in C (core rows:mapping):
  -- simple and split ones written there, general ones handed back
  local cmap = {}
  for i, e in ipairs(entries) do
    local q = e.simple
    if q then
      cmap[i] = { kind = "simple", head = q.lit1, tail = q.lit2, prefix = q.prefix,
                  metric = e.metric }
    elseif e.split then
      cmap[i] = { kind = "split", pieces = e.split.pieces, prefixes = e.split.prefixes,
                  metric = e.metric }
    else
      cmap[i] = { kind = "general", pattern = e.pattern }
    end
  end
  return { [COMPILED] = true, entries = entries, hists = hists, families = families,
           cmap = cmap }
end

-- _M.compile_mapping(mapping) -> the mapping compiled, to pass to
-- samples_text() in its place when it serves many calls.
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
  if last_at < first.len + 1 or not place_left(g, name, placed) then return nil end
  if last.len > 0 and not find(name, last.pat, last_at) then return nil end
  return moves_right(g, name, placed) and 2 or 1
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

-- The series of names that general entries map (entry_series), which two
-- names may share: kept in parallel arrays (not a table per row) until
-- every name is seen. Two names of one series are both left out, through
-- skip(name, "duplicate", msg); with no skip, add refuses the second and
-- returns the message. lines_into(lines) appends the others' lines to
-- lines[metric].
local function series_keeper(skip)
  local owner, bad = {}, {}
  local rmetric, rseries, rkey, rvalue, nrows = {}, {}, {}, {}, 0
  local keeper = {}
  function keeper.add(name, metric, series, key, v)
    local other = owner[key]
    if other then
      local msg = fmt("counters '%s' and '%s' both map to the series %s", printable(other),
                      printable(name), printable(series))
      if not skip then return msg end
      if not bad[key] then bad[key] = true; skip(other, "duplicate", msg) end
      skip(name, "duplicate", msg)
    else
      owner[key] = name
    end
    nrows = nrows + 1
    rmetric[nrows], rseries[nrows], rkey[nrows], rvalue[nrows] = metric, series, key, v
  end
  function keeper.lines_into(lines)
    for i = 1, nrows do
      if not bad[rkey[i]] then
        local metric = rmetric[i]
        local l = lines[metric]
        if not l then l = {}; lines[metric] = l end
        local n = #l
        l[n + 1], l[n + 2], l[n + 3], l[n + 4] = rseries[i], " ", value_text(rvalue[i]), "\n"
      end
    end
  end
  return keeper
end

-- Each metric of lines ({ [metric] = { text... } }) in name order, its
-- # HELP and # TYPE (families[metric]) before its lines, handed to emit.
local function families_out(lines, families, emit)
  local metrics = {}
  for metric in pairs(lines) do metrics[#metrics + 1] = metric end
  sort(metrics)
  for _, metric in ipairs(metrics) do
    local l = lines[metric]
    emit(_M._family_head(metric, families[metric]))
    emit(#l == 1 and l[1] or concat(l))
  end
end

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
  local lines = {}                       -- metric -> lines
  local skipped, counts = {}, {}
  local function skip(name, reason, msg)
    skipped[#skipped + 1] = { name = name, reason = reason, msg = msg }
    counts[reason] = (counts[reason] or 0) + 1
  end
  local keeper = series_keeper(lenient and skip or nil)
  -- Lines written in C, from a list of names and values each (a million
  -- counters took 8 s in Lua, three new strings a line): the default
  -- metric's (the names themselves, escaped or in hex) and each simple or
  -- split entry's (compile_mapping); no two of their names share a series. Other
  -- mapped names may, so they wait for every name to be seen (series_keeper).
  local default, inc, entries = _M.DEFAULT_METRIC, {}, c.entries
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
        local dup = keeper.add(name, metric, series, key, v)
        if dup then return nil, dup, 0 end
      end
    end
  end
  for list, l in pairs(inc) do flush(list, l) end
  keeper.lines_into(lines)
  local out = {}
  families_out(lines, c.families, function(piece) out[#out + 1] = piece end)
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

-- samples_text(samples [, mapping]) -> exposition text (format 0.0.4);
-- tally.format.prometheus is this.
-- samples: an array of { name = counter name, value = number } (rollup
-- records qualify) or a table { [name] = value }. mapping: an array of
-- { pattern=, metric=, labels=, type=, help= } as db:mappings() returns,
-- or the result of _M.compile_mapping();
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
function _M.samples_text(samples, mapping)
  local text, msg, arg = _M._render_prometheus(samples, mapping)
  if text then return text end
  if arg == 0 then error("prometheus: " .. msg, 2) end
  argerror(arg, "prometheus", msg, 2)
end

-- ---- mappings per store handle ------------------------------------------------

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
  if metric == _M.SKIPPED_METRIC then
    return nil, "metric '" .. metric .. "' is reserved for the counters a scrape leaves out"
  end
  if metric == _M.DEFAULT_METRIC then
    return nil, "metric '" .. metric .. "' is reserved for counters without a mapping"
  end
  local nwild = _M._glob_compile(pattern).nwild
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
  if not hist and not _M.TYPES[kind] then
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
  entry.glob = _M._glob_compile(pattern)
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
-- (copies), in the shape samples_text (tally.format.prometheus) takes.
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
    if e.histogram and _M._glob_captures(e.glob, name) then return e end
  end
  return nil
end

-- The compiled mapping of store handle db (compiled once per change).
function _M.mapping_of(db)
  local list = registry[db] or NONE
  local c = compiled[list]
  if not c then
    c = _M.compile_mapping(list)
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
    msg = "prometheus: left out of the exposition (counted in " .. _M.SKIPPED_METRIC
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
-- compiled mapping c: each histogram family's metric
-- (_histogram_series: the newest histogram family with a metric whose
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
  local taken = { [_M.SKIPPED_METRIC] = true }
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
    local m, labels, key = _M._histogram_series(c, base)
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
                 or "tally histogram '" .. _M.utf8_text(first.base) .. "' (sum kept in units of "
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
  local text, skipped = _M._render_prometheus(values, c, names, true, skips, htext, pause)
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
  local chunk = _M._chunk
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
-- and may yield between them. A scrape that pauses reads the name index
-- _slice slots at a time (about 0.1 ms on the 2-core VM: 1,000 counters,
-- read and sorted) and pauses between slices, and between chunks of
-- _chunk lines; tally.openresty yields once a few of them have passed.
local PIECE = 65536
_M._slice = 2048                    -- a knob for tests

-- put(text), flush(): the texts put joined and handed to write in pieces
-- of PIECE bytes, the last one shorter at the flush; so a host sends few
-- large pieces however short the chunks between two pauses (serve's
-- client woke for each one, and took the writers' CPU).
local function piece_writer(write)
  local held, n, size = {}, 0, 0
  local function put(text)
    n, size = n + 1, size + #text
    held[n] = text
    if size < PIECE then return end
    local all = concat(held, "", 1, n)
    local full = #all - #all % PIECE
    for i = 1, full, PIECE do write(sub(all, i, i + PIECE - 1)) end
    held, n, size = { sub(all, full + 1) }, 1, #all - full
  end
  local function flush()
    if size > 0 then write(concat(held, "", 1, n)) end
    held, n, size = {}, 0, 0
  end
  return put, flush
end

-- The exposition of the n rows read (from_rows) under the families of
-- compiled mapping c, mapped in C (rows:map): the default metric's lines
-- and those of each simple or split entry are written there; the rows of
-- general entries, and names a split entry matches in more than one way,
-- come back here one by one (decide) and are rendered as
-- _render_prometheus renders them, which the randomized spec compares.
-- What the scrape leaves out is counted in skips, and logged once each
-- chunk is mapped: decide runs inside C, where a logger could not yield.
local function map_rows(rows, c, n, skips, htext, pause, emit)
  local entries = c.entries
  local held, nheld = {}, 0                  -- skips to log: name, reason, msg
  local function skip(name, reason, msg)
    skips[reason] = (skips[reason] or 0) + 1
    held[nheld + 1], held[nheld + 2], held[nheld + 3] = name, reason, msg
    nheld = nheld + 3
  end
  local keeper = series_keeper(skip)
  local function decide(name, v)             -- true: the default metric's line
    local e, caps = first_entry(entries, name)
    local metric, series, key = entry_series(e, name, caps)
    if metric == false then return true end
    if not metric then
      skip(name, series, key)
    else
      keeper.add(name, metric, series, key, v)
    end
    return false
  end
  rows:mapping(c.cmap)
  local more, CHUNK = n > 0, _M._chunk
  while more do
    more = rows:map(CHUNK, decide)
    for i = 1, nheld, 3 do log_once(held[i], held[i + 1], held[i + 2]) end
    held, nheld = {}, 0
    if pause and more then pause() end
  end
  local lines = {}            -- C's metrics and the general entries' are apart
  for metric, text in pairs(rows:mapped()) do lines[metric] = { text } end
  keeper.lines_into(lines)
  families_out(lines, c.families, emit)
  if htext then emit(htext) end
  local gauge = _M._skipped_text(skips)
  if gauge ~= "" then emit(gauge) end
  return true
end

-- The exposition from one walk of the matching counters (core._prom_rows:
-- the C core's tally_exposition, names and values in name order, no
-- handle per counter). Only the names that may be histogram members
-- (ending in '}') come to Lua here. Without counter families (the common
-- case) the default metric's lines are the core's, CHUNK counters at a
-- time, each chunk handed to emit as it is made (whole: all of them at
-- once, in one buffer); with families, the rows' names and values go to
-- the renderer (a value beyond int64 as the core's text of it).
local function from_rows(db, rows, c, pause, emit, whole)
  -- the counters are read a slice of the index at a time (a host that
  -- yields pauses between slices; without one, slices 16 times as large
  -- merge faster); nothing is emitted before they are read
  local slice = pause and _M._slice or 16 * _M._slice
  while true do
    local done, msg, code = rows:collect(slice)
    if done then break end
    if done == nil then return nil, msg, code end
    if pause then pause() end
  end
  local idx, names = rows:braced()
  local brace, at = {}, {}
  for k, name in ipairs(names) do       -- a name read twice (made again meanwhile): once
    if not at[name] then brace[#brace + 1] = name end
    at[name] = idx[k]
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
  local CHUNK = _M._chunk
  if #c.entries == 0 then
    if included > 0 and whole then       -- one buffer (and a copy with a tail)
      emit((rows:lines(n)))
      local tail = (htext or "") .. _M._skipped_text(skips)
      if tail ~= "" then emit(tail) end
      return true
    end
    local more = included > 0
    while more do
      local text
      text, more = rows:lines(CHUNK)
      if text ~= "" then emit(text) end
      if pause and more then pause() end
    end
    if htext then emit(htext) end
    local gauge = _M._skipped_text(skips)
    if gauge ~= "" then emit(gauge) end
    return true
  end
  if not _M._lua_lines_only then return map_rows(rows, c, n, skips, htext, pause, emit) end
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
-- first. pause: called between slices of the index read (2,048 slots)
-- and chunks of 500 counters rendered, so that a host can yield there
-- (tally.openresty sleeps 1 ms once 0.3 ms of work have passed); what it
-- or write raises fails the scrape.
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
  local out, n, flush = {}, 0, nil
  local emit = function(piece) n = n + 1; out[n] = piece end
  if write then emit, flush = piece_writer(write) end
  local rows, ok, done, rmsg, rcode
  rows, rmsg, rcode = core._prom_rows(db, pattern)
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
  if write then
    flush()
    return true
  end
  return n == 1 and out[1] or concat(out)
end

return _M
