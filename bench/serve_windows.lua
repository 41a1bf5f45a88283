-- bench/serve_windows.lua -- what scripts/bench-serve prints of its windows.
--
--   lua5.4 bench/serve_windows.lua W1 W2 WINDOWS
--
-- W1, W2: each writer's notes, a line "TIME COUNT" every 50 ms or so.
-- WINDOWS: a line "WHAT START END" (wall clock) for each window, "alone"
-- and another in turn, beginning and ending with "alone". A window's rate
-- is both writers' increments a second from a second after its start to
-- its end; each other window's rate is taken to the mean of the windows
-- alone on either side of it, and the median of those ratios printed for
-- each kind ("0", "19", "spin"). Fails, saying so, for a window in which a
-- writer noted fewer than two counts after its first second.
local function samples(path)
  local s = {}
  for line in io.lines(path) do
    local t, n = line:match("^(%S+) (%S+)$")
    s[#s + 1] = { tonumber(t), tonumber(n) }
  end
  return s
end
local w = { samples(arg[1]), samples(arg[2]) }
-- increments a second of both writers from a + 1 s to b
local function rate(what, a, b)
  local sum = 0
  for k, s in ipairs(w) do
    local first, last
    for _, p in ipairs(s) do
      if p[1] >= a + 1 and p[1] <= b then
        first = first or p
        last = p
      end
    end
    if not first or last[1] <= first[1] then
      io.stderr:write(string.format("bench-serve: writer %d noted fewer than 2 counts in the %.2f s "
                                    .. "of the window '%s' after its first second (SECS too small, "
                                    .. "or the writer stopped)\n", k, b - a - 1, what))
      os.exit(1)
    end
    sum = sum + (last[2] - first[2]) / (last[1] - first[1])
  end
  return sum
end
local wins = {}
for line in io.lines(arg[3]) do
  local what, a, b = line:match("^(%S+) (%S+) (%S+)$")
  wins[#wins + 1] = { what = what, rate = rate(what, tonumber(a), tonumber(b)) }
end
local pcts, rows = { ["0"] = {}, ["19"] = {}, spin = {} }, {}
for i = 2, #wins - 1, 2 do
  local alone = (wins[i - 1].rate + wins[i + 1].rate) / 2
  local pct = 100 * wins[i].rate / alone
  table.insert(pcts[wins[i].what], pct)
  rows[#rows + 1] = string.format("  %-5s %.0f incr/s, %.1f%% of the mean %.0f alone around it",
                                  wins[i].what, wins[i].rate, pct, alone)
end
local function median(t)
  table.sort(t)
  return #t % 2 == 1 and t[(#t + 1) // 2] or (t[#t // 2] + t[#t // 2 + 1]) / 2
end
local n = #pcts["0"]
print(string.format("2 writers while /metrics is scraped back to back: %.1f%% of their rate alone "
                    .. "(median of %d rounds);", median(pcts["0"]), n))
print(string.format("  the same with curl at niceness 19 (a Prometheus elsewhere): %.1f%%;",
                    median(pcts["19"])))
print(string.format("  beside a busy loop that never touches the store: %.1f%%", median(pcts.spin)))
local lo, hi = math.huge, 0
for i = 1, #wins, 2 do lo, hi = math.min(lo, wins[i].rate), math.max(hi, wins[i].rate) end
print(string.format("  (the writers alone: %.0f to %.0f incr/s)", lo, hi))
for _, r in ipairs(rows) do print(r) end
