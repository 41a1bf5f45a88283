-- tally.cmd.watch: `tally watch STORE [pattern]`, a live full-screen view of a
-- store's counters, refreshed like top.
--
-- Runs only under the `tally` command, which is Lua 5.4 (it uses
-- tally.term and tally.peek, preloaded by the command); never loaded by
-- require "tally", so the LuaJIT build does not need it.
--
-- Every refresh lists the matching names and reads each counter once
-- through tally.peek (exact value, last rollup record), all lock-free: no
-- writer ever waits for watch. The rate of a counter is the change of its
-- exact value between the last two refreshes, divided by the time between
-- them; before the second refresh it is the rate of the counter's last
-- rollup, if any. The sparkline shows the rate over time: from the
-- counter's finest rollup history ring when it keeps one (so it reaches
-- back before watch started), else from the rates watch has computed.
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

local type, tostring, ipairs, pcall, error = type, tostring, ipairs, pcall, error
local fmt, rep = string.format, string.rep
local concat, sort = table.concat, table.sort
local floor, max, min = math.floor, math.max, math.min

local _M = {}

local INTERVALS = { 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300, 900, 3600 }
local SORTS = { "rate", "value", "name" }
local KEEP = 120   -- rates kept per counter for its sparkline

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

-- Sort rows by rate or value (largest first; unknown last) or name.
local function order(rows, key)
  sort(rows, function(a, b)
    if key == "rate" then
      local x, y = a.s.rate, b.s.rate
      if x ~= y then
        if x == nil then return false end
        if y == nil then return true end
        return x > y
      end
    elseif key == "value" then
      local x, y = a.value, b.value
      if type(x) == "number" and type(y) == "number" and x ~= y then return x > y end
    end
    return a.name < b.name
  end)
end

local function loop(db, o)
  local glyphs = utf8_terminal() and BLOCKS or ASCII
  local sortby, interval, scroll = o.sort, o.interval, 0
  local seen = {}              -- name -> { t=, v=, rate=, rates = {...}, rolled = }
  local rows, total = {}, 0
  local last_sample = nil

  local function sample()
    local now = tally.now()
    local names, nmsg = db:names(o.pattern)
    if not names then cli.fail(tostring(nmsg)) end   -- a damaged store
    local fresh = {}
    rows, total = {}, 0
    for _, name in ipairs(names) do
      local p, pmsg, pcode = peek.counter(db, name)
      if not p and pcode ~= "ENOENT" then cli.fail(tostring(pmsg)) end
      if p then                                  -- else dropped meanwhile
        local s = seen[name] or { rates = {} }
        local v = p.value
        if type(v) == "number" and type(s.v) == "number" and s.t and now > s.t then
          s.rate = (v - s.v) / (now - s.t)
          s.rates[#s.rates + 1] = s.rate
          if #s.rates > KEEP then table.remove(s.rates, 1) end
        elseif p.rolled and not s.t then
          s.rate = p.rolled.rate
        end
        s.t, s.v, s.rolled = now, v, p.rolled
        fresh[name] = s
        rows[#rows + 1] = { name = name, value = v, s = s }
        if type(v) == "number" then total = total + v end
      end
    end
    seen = fresh
    last_sample = now
    order(rows, sortby)
  end

  local function draw()
    local cols, lines = term.size()
    local body = max(1, lines - 3)
    if scroll > max(0, #rows - body) then scroll = max(0, #rows - body) end
    local out = {}
    local head = fmt("tally watch  %s  sort: %s  every %gs  %d counter%s  total %s  %s%s",
                     os.date("%H:%M:%S"), sortby, interval, #rows, #rows == 1 and "" or "s",
                     tostring(total), o.store, o.pattern and ("  " .. o.pattern) or "")
    out[1] = fit(head, cols)
    -- columns: NAME  VALUE  RATE/S  HISTORY
    local nw, vw, rw = 4, 5, 6
    for i = scroll + 1, min(#rows, scroll + body) do
      local r = rows[i]
      nw = max(nw, #r.name)
      vw = max(vw, #tostring(r.value))
      rw = max(rw, #cli.rate_text(r.s.rate))
    end
    -- the name as long as it is (up to what leaves 10 columns of history),
    -- then the sparkline takes what is left, up to 60
    nw = max(4, min(nw, cols - vw - rw - 6 - 10))
    local hw = max(0, min(60, cols - nw - vw - rw - 6))
    out[2] = "\27[7m" .. fit(fit("NAME", nw) .. "  " .. rjust("VALUE", vw) .. "  "
                              .. rjust("RATE/S", rw) .. "  " .. "HISTORY", cols) .. "\27[0m"
    for i = scroll + 1, min(#rows, scroll + body) do
      local r = rows[i]
      local spark = ""
      if hw > 0 then
        local xs = r.s.rates
        if r.s.rolled then
          local _, buckets = peek.history(db, r.name, hw + 1)
          if buckets and #buckets >= 2 then xs = ring_rates(buckets) end
        end
        spark = sparkline(xs, hw, glyphs)
      end
      out[#out + 1] = fit(r.name, nw) .. "  " .. rjust(tostring(r.value), vw) .. "  "
                      .. rjust(cli.rate_text(r.s.rate), rw) .. "  " .. spark
    end
    if #rows == 0 then
      out[#out + 1] = o.pattern and ("no counter matches " .. o.pattern) or "the store has no counters"
    end
    while #out < lines - 1 do out[#out + 1] = "" end
    local more = #rows > body and fmt("  rows %d-%d of %d", scroll + 1, min(#rows, scroll + body), #rows) or ""
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
      sample()
      next_at = now + interval
      draw()
    end
    local ev, data = term.readkey(max(0, next_at - tally.now()))
    if ev == "key" then
      local _, lines = term.size()
      local page = max(1, lines - 4)
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
        elseif k == "\27[F" or k == "\27[4~" or k == "\27OF" or k == "G" then scroll = #rows
        end
      end
      order(rows, sortby)   -- what is there now; the next sample comes on time
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
