-- tally.cmd.watch: `tally watch STORE [pattern]`, a live full-screen view of a
-- store's counters, refreshed like top.
--
-- Runs only under the `tally` command, which is Lua 5.4 (it uses
-- tally.term and tally.peek, preloaded by the command); never loaded by
-- require "tally", so the LuaJIT build does not need it.
--
-- Every refresh reads each matching counter once in one walk in C
-- (tally.peek.watch, src/cli/cli_watch.c), lock-free: no writer ever waits
-- for watch. The walk counts and adds them up and keeps only the rows on
-- screen (those that rank scroll+1 .. scroll+body by the sort), so a
-- million counters cost a walk a refresh, not a table each. The rate of a
-- counter is the change of its exact value between the last two
-- refreshes, divided by the time between them; before the second refresh
-- it is the rate of the counter's last rollup, if any. The sparkline shows
-- the rate over time: from the counter's finest rollup history ring when
-- it keeps one (so it reaches back before watch started), else from the
-- rates watch has computed while the row was on screen.
--
-- Histograms (tally.histogram) among the matching names are shown grouped,
-- one row each below the counters, and their member counters are not
-- listed as counters. All of them are read from one db:snapshot per
-- refresh (of the pattern's names with a brace, braced()), so a
-- row's count (the sum of its buckets), its sum and its quantiles come
-- from one consistent cut: an observation is in all of them or in none.
-- The row shows COUNT, RATE/S (of the count, between the last two
-- refreshes), SUM, MEAN and the upper bounds of the buckets the 50th, 90th
-- and 99th percentiles fall in (tally.histogram.quantile).
--
-- The screen is the terminal's alternate screen, drawn whole on each
-- refresh; stdin is in raw mode (tally.term) so keys arrive at once and
-- Ctrl-C is a key. Both are restored however the loop ends. run() returns
-- the exit status: 0 for q (or Ctrl-D, or the terminal going away), 130
-- for Ctrl-C (interrupted, as the README says), 143 and 129 for SIGTERM and
-- SIGHUP.

local tally = require "tally"
local term = require "tally.term"
local peek = require "tally.peek"
local cli = require "tally.cmd.common"

local type, tostring, ipairs, pairs, next, pcall, error =
      type, tostring, ipairs, pairs, next, pcall, error
local fmt, rep = string.format, string.rep
local concat, sort = table.concat, table.sort
local floor, max, min, huge = math.floor, math.max, math.min, math.huge
local histogram = tally.histogram

local _M = {}

local INTERVALS = { 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300, 900, 3600 }
local SORTS = { "rate", "value", "name" }
local KEEP = 120   -- rates kept per counter for its sparkline
local SLACK = 64   -- rows past the screen read when ranking from the end

local function utf8_terminal()
  for _, k in ipairs({ "LC_ALL", "LC_CTYPE", "LANG" }) do
    local v = os.getenv(k)
    if v and v ~= "" then return v:lower():find("utf%-?8") ~= nil end
  end
  return false
end

local BLOCKS = { "▁", "▂", "▃", "▄", "▅", "▆", "▇", "█" }
local ASCII = { "_", ".", "-", "=", "+", "*", "#", "@" }

-- A sparkline of the numbers in xs (nil: no data there), w columns wide,
-- right-aligned; returns the text and its width in columns.
local function sparkline(xs, w, glyphs)
  local n = #xs
  local from = max(1, n - w + 1)
  local top = 0
  for i = from, n do
    local x = xs[i]
    if x and x > top then top = x end
  end
  local out = {}
  for i = from, n do
    local x = xs[i]
    if x == nil then
      out[#out + 1] = " "
    else
      local level = top > 0 and x > 0 and floor(x / top * 7 + 0.5) + 1 or 1
      out[#out + 1] = glyphs[min(8, max(1, level))]
    end
  end
  return concat(out), n - from + 1
end

-- Rates between successive buckets of a history ring.
local function ring_rates(buckets)
  local rates = {}
  for i = 2, #buckets do
    local a, b = buckets[i - 1], buckets[i]
    local dt = b.t - a.t
    rates[#rates + 1] = dt > 0 and (b.v - a.v) / dt or nil
  end
  return rates
end

local function fit(s, w)
  if #s <= w then return s .. rep(" ", w - #s) end
  if w <= 1 then return s:sub(1, w) end
  return s:sub(1, w - 1) .. "~"
end

local function rjust(s, w)
  if #s >= w then return s end
  return rep(" ", w - #s) .. s
end

-- Split what one read() gave into keys: escape sequences stay whole.
local function keys(bytes)
  local out, i = {}, 1
  while i <= #bytes do
    local c = bytes:sub(i, i)
    if c == "\27" and bytes:sub(i + 1, i + 1) == "[" then
      local j = bytes:find("[%a~]", i + 2)
      j = j or #bytes
      out[#out + 1] = bytes:sub(i, j)
      i = j + 1
    elseif c == "\27" and bytes:sub(i + 1, i + 1) == "O" then
      out[#out + 1] = bytes:sub(i, i + 2)
      i = i + 3
    else
      out[#out + 1] = c
      i = i + 1
    end
  end
  return out
end

-- Sort rows by rate or value (largest first; unknown last) or name;
-- value_of(row) gives a row's value (a counter's, a histogram's count).
local function order(rows, key, value_of)
  sort(rows, function(a, b)
    if key == "rate" then
      local x, y = a.s.rate, b.s.rate
      if x ~= y then
        if x == nil then return false end
        if y == nil then return true end
        return x > y
      end
    elseif key == "value" then
      local x, y = value_of(a), value_of(b)
      if type(x) == "number" and type(y) == "number" and x ~= y then return x > y end
    end
    return a.name < b.name
  end)
end
local function counter_value(row) return row.value end
local function hist_count(row) return row.r.count end

-- A quantile's bucket bound as text ("-": no observations).
local function bound_text(r, q)
  local b = histogram.quantile(r, q)
  if b == nil then return "-" end
  return b == huge and "+Inf" or histogram.num_text(b)
end

local HIST_HEAD = { "HISTOGRAM", "COUNT", "RATE/S", "SUM", "MEAN", "P50<=", "P90<=", "P99<=" }

-- The cells of a histogram row, as HIST_HEAD names them.
local function hist_cells(h)
  local r = h.r
  return { cli.printable(h.name), fmt("%d", r.count), cli.rate_text(h.s.rate), cli.hist_sum_text(r),
           r.count > 0 and fmt("%.4g", r.sum / r.count) or "-",
           bound_text(r, 0.5), bound_text(r, 0.9), bound_text(r, 0.99) }
end

-- A pattern for the names of pattern p that hold a brace (every member of
-- a histogram does), for the histograms' snapshot: a pattern that ends in
-- '*' (with no brace before it) takes "{*}" after it, so that the snapshot
-- of 'post:*' over a million counters holds only the members.
local function braced(p)
  if p == nil then return "*{*}" end
  if p:sub(-1) == "*" and not p:find("{", 1, true) then return p .. "{*}" end
  return p
end

local function loop(db, o)
  local glyphs = utf8_terminal() and BLOCKS or ASCII
  local sortby, interval, scroll = o.sort, o.interval, 0
  local w = peek.watcher()     -- each counter's value and rate at the last refresh (C)
  local spark = {}             -- name -> rates seen while on screen, for its sparkline
  local hseen = {}             -- histogram name -> { t=, v= (count), rate= }
  local rows, count, total = {}, 0, 0
  local row1 = 1               -- the rank of rows[1]
  local hrows = {}             -- { name =, r = (histogram.read), s = hseen[name] }
  local last_sample = nil

  -- Read the rows the screen shows: the counters that rank scroll+1 ..
  -- scroll+body (one walk in C, peek.watch), the histograms on a refresh.
  -- refresh false: the sort or the scroll changed; the rates stay those of
  -- the last refresh.
  local function sample(refresh)
    local now = tally.now()
    local _, lines = term.size()
    local body = max(1, lines - 3)
    local k = scroll + body
    -- far down a long list, rank from its end: the walk then holds the
    -- rows below the screen's top (and some more, as counters come),
    -- not the ones above it
    local rev_first, below = max(1, count - scroll - body + 1 - SLACK), count - scroll + SLACK
    local rev = count > 0 and below < k
    local got, msg
    if rev then
      got, msg = peek.watch(w, db, o.pattern, sortby, rev_first, below, refresh and now or nil, true)
    else
      got, msg = peek.watch(w, db, o.pattern, sortby, scroll + 1, k, refresh and now or nil)
    end
    if not got then cli.fail(tostring(msg)) end   -- a damaged store
    -- histograms: complete ones among the names that may be members
    local mnames, mrow = {}, {}
    for i, r in ipairs(got.members) do mnames[i] = r.name; mrow[r.name] = r end
    local hs, others = histogram.group(mnames)
    if #others > 0 then
      -- names of a member's form that are not members are counters: they
      -- take their place among the rows, so rank all of them from the first
      got = assert(peek.watch(w, db, o.pattern, sortby, 1, k))
      row1 = 1
    elseif rev then                              -- back in watch's order
      local r, n = got.rows, #got.rows
      local fwd = {}
      for i = 1, n do fwd[i] = r[n - i + 1] end
      got.rows = fwd
      row1 = got.count - (rev_first + n - 1) + 1
    else
      row1 = scroll + 1
    end
    if refresh then
      hrows = {}
      if next(hs) then
        -- one snapshot for all of them: each row from one consistent cut
        local snap, smsg = db:snapshot(braced(o.pattern))
        if not snap then cli.fail(tostring(smsg)) end
        local snames, hfresh = {}, {}
        for n in pairs(snap) do snames[#snames + 1] = n end
        for base, h in pairs((histogram.group(snames))) do
          local r = histogram.read(snap, h)
          local s = hseen[base] or {}
          if s.t and now > s.t then s.rate = (r.count - s.v) / (now - s.t) end
          s.t, s.v = now, r.count
          hfresh[base] = s
          hrows[#hrows + 1] = { name = base, r = r, s = s }
        end
        hseen = hfresh
      else
        hseen = {}
      end
    end
    rows, count, total = got.rows, got.count, got.total
    for _, r in ipairs(rows) do r.s = { rate = r.rate } end
    for _, name in ipairs(others) do
      local r = mrow[name]
      r.s = { rate = r.rate }
      rows[#rows + 1] = r
      count = count + 1
      -- exact, or false once it leaves int64 (or a value already has)
      local v = r.value
      if total and v then
        local t = total + v                      -- wraps: same signs in, other out
        if (v >= 0) == (total >= 0) and (t >= 0) ~= (v >= 0) then t = false end
        total = t
      else
        total = false
      end
    end
    if #others > 0 then
      order(rows, sortby, counter_value)
      for i = k + 1, #rows do rows[i] = nil end
    end
    local fresh = refresh and {} or spark
    for _, r in ipairs(rows) do
      if r.value == nil then                     -- beyond int64: its exact decimal
        local p = peek.counter(db, r.name)
        r.value = p and p.value or "?"
      end
      local xs = spark[r.name] or {}
      if refresh and r.diff then
        xs[#xs + 1] = r.rate
        if #xs > KEEP then table.remove(xs, 1) end
      end
      r.s.rates, fresh[r.name] = xs, xs
    end
    spark = fresh
    if refresh then last_sample = now end
    order(hrows, sortby, hist_count)
  end

  local function draw()
    local cols, lines = term.size()
    local body = max(1, lines - 3)
    -- what scrolls: the counter rows, then the histograms under their own
    -- header (a blank line before it); with no counter rows the histogram
    -- header takes the counters' place on line 2. Of the counters, only
    -- the rows on screen were read (rows[1] ranks row1).
    local HHEAD = {}
    local gap = #hrows > 0 and count > 0 and 2 or 0
    local nitems = count + gap + #hrows
    local function item(i)
      if i <= count then return rows[i - row1 + 1] end
      i = i - count
      if gap > 0 and i <= 2 then return i == 1 and "" or HHEAD end
      return hrows[i - gap]
    end
    if scroll > max(0, nitems - body) then scroll = max(0, nitems - body) end
    local first, last = scroll + 1, min(nitems, scroll + body)
    if first <= min(last, count) and (first < row1 or min(last, count) > row1 + #rows - 1) then
      sample(false)                              -- scrolled, or a taller screen
      nitems = count + gap + #hrows
      if scroll > max(0, nitems - body) then scroll = max(0, nitems - body) end
      first, last = scroll + 1, min(nitems, scroll + body)
    end
    local items = {}
    for i = first, last do items[i] = item(i) end
    local out = {}
    local head = fmt("tally watch  %s  sort: %s  every %gs  %d counter%s  total %s  %s%s%s",
                     os.date("%H:%M:%S"), sortby, interval, count, count == 1 and "" or "s",
                     total and tostring(total) or "beyond int64",
                     #hrows > 0 and fmt("%d histogram%s  ", #hrows, #hrows == 1 and "" or "s") or "",
                     o.store, o.pattern and ("  " .. o.pattern) or "")
    out[1] = fit(head, cols)
    -- counter columns: NAME  VALUE  RATE/S  HISTORY
    local nw, vw, rw = 4, 5, 6
    for i = first, last do
      local r = items[i]
      if type(r) == "table" and r ~= HHEAD and not r.r then
        nw = max(nw, #cli.printable(r.name))
        vw = max(vw, #tostring(r.value))
        rw = max(rw, #cli.rate_text(r.s.rate))
      end
    end
    -- the name as long as it is (up to what leaves 10 columns of history),
    -- then the sparkline takes what is left, up to 60
    nw = max(4, min(nw, cols - vw - rw - 6 - 10))
    local hw = max(0, min(60, cols - nw - vw - rw - 6))
    -- histogram columns: widths from all of them (they are few), so the
    -- columns stay put while the rows scroll
    local hcells, hwid = {}, {}
    for k, t in ipairs(HIST_HEAD) do hwid[k] = #t end
    for _, h in ipairs(hrows) do
      local c = hist_cells(h)
      hcells[h] = c
      for k = 2, #c do hwid[k] = max(hwid[k], #c[k]) end
      hwid[1] = max(hwid[1], #c[1])
    end
    local rest = 0
    for k = 2, #hwid do rest = rest + 2 + hwid[k] end
    hwid[1] = max(#HIST_HEAD[1], min(hwid[1], cols - rest))
    local function hline(c)
      local t = { fit(c[1], hwid[1]) }
      for k = 2, #c do t[k] = rjust(c[k], hwid[k]) end
      return fit(concat(t, "  "), cols)
    end
    local function reverse(text) return "\27[7m" .. fit(text, cols) .. "\27[0m" end
    if count == 0 and #hrows > 0 then
      out[2] = reverse(hline(HIST_HEAD))
    else
      out[2] = reverse(fit("NAME", nw) .. "  " .. rjust("VALUE", vw) .. "  "
                       .. rjust("RATE/S", rw) .. "  " .. "HISTORY")
    end
    for i = first, last do
      local r = items[i]
      if r == "" or r == nil then
        out[#out + 1] = ""
      elseif r == HHEAD then
        out[#out + 1] = reverse(hline(HIST_HEAD))
      elseif r.r then                             -- a histogram
        out[#out + 1] = hline(hcells[r])
      else
        local spark = ""
        if hw > 0 then
          local xs = r.s.rates
          local _, buckets = peek.history(db, r.name, hw + 1)   -- nil: it keeps no ring
          if buckets and #buckets >= 2 then xs = ring_rates(buckets) end
          spark = sparkline(xs, hw, glyphs)
        end
        out[#out + 1] = fit(cli.printable(r.name), nw) .. "  " .. rjust(tostring(r.value), vw) .. "  "
                        .. rjust(cli.rate_text(r.s.rate), rw) .. "  " .. spark
      end
    end
    if nitems == 0 then
      out[#out + 1] = o.pattern and ("no counter matches " .. o.pattern) or "the store has no counters"
    end
    while #out < lines - 1 do out[#out + 1] = "" end
    local more = nitems > body and fmt("  rows %d-%d of %d", first, last, nitems) or ""
    out[lines] = fit("q quit  s sort (r v n)  +/- interval  arrows scroll" .. more, cols)
    local screen = {}
    for i = 1, lines do screen[i] = out[i] .. "\27[K" end
    io.stdout:write("\27[H", concat(screen, "\r\n"), "\27[J")
    io.stdout:flush()
  end

  local function step_interval(dir)
    if dir > 0 then
      for _, v in ipairs(INTERVALS) do
        if v > interval * 1.0001 then interval = v; return end
      end
    else
      for i = #INTERVALS, 1, -1 do
        if INTERVALS[i] < interval * 0.9999 then interval = INTERVALS[i]; return end
      end
    end
  end

  local next_at = 0
  while true do
    local now = tally.now()
    if now >= next_at then
      sample(true)
      next_at = now + interval
      draw()
    end
    local ev, data = term.readkey(max(0, next_at - tally.now()))
    if ev == "key" then
      local _, lines = term.size()
      local page = max(1, lines - 4)
      local was = sortby
      for _, k in ipairs(keys(data)) do
        if k == "q" or k == "Q" or k == "\4" then return 0 end
        if k == "\3" then return 130 end           -- Ctrl-C: interrupted
        if k == "s" then
          for i, s in ipairs(SORTS) do
            if s == sortby then sortby = SORTS[i % #SORTS + 1]; break end
          end
        elseif k == "r" then sortby = "rate"
        elseif k == "v" then sortby = "value"
        elseif k == "n" then sortby = "name"
        elseif k == "+" or k == "=" then step_interval(1); next_at = (last_sample or 0) + interval
        elseif k == "-" or k == "_" then step_interval(-1); next_at = (last_sample or 0) + interval
        elseif k == "\27[A" or k == "\27OA" or k == "k" then scroll = max(0, scroll - 1)
        elseif k == "\27[B" or k == "\27OB" or k == "j" then scroll = scroll + 1
        elseif k == "\27[5~" then scroll = max(0, scroll - page)
        elseif k == "\27[6~" or k == " " then scroll = scroll + page
        elseif k == "\27[H" or k == "\27[1~" or k == "\27OH" or k == "g" then scroll = 0
        elseif k == "\27[F" or k == "\27[4~" or k == "\27OF" or k == "G" then scroll = count + #hrows + 2
        end
      end
      -- the rows of this sort (a scroll reads them in draw); the rates
      -- stay those of the last refresh, and the next comes on time
      if sortby ~= was then sample(false) end
      draw()
    elseif ev == "resize" then
      draw()
    elseif ev == "signal" then
      if data == "INT" then return 130 end
      return data == "HUP" and 129 or 143
    elseif ev == "eof" then
      return 0                                     -- the terminal went away
    end
  end
end

-- run(db, { store =, pattern =, interval =, sort = }) -> exit status
function _M.run(db, o)
  local ok, err = term.raw()
  if not ok then error(err, 0) end
  io.stdout:write("\27[?1049h\27[?25l\27[H\27[2J")   -- alternate screen, no cursor
  io.stdout:flush()
  local done, res = pcall(loop, db, o)
  io.stdout:write("\27[0m\27[?25h\27[?1049l")       -- back to the normal screen
  io.stdout:flush()
  term.restore()
  if not done then error(res, 0) end
  return res
end

return _M
