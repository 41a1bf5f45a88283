-- bench/many_names.lua: db:incr(name) over many names taken at random,
-- standalone (no nginx), handle_admit = "repeat" (the default) against
-- "always", interleaved in one run; also the first pass that creates them.
--
--   luajit bench/many_names.lua BUILD [N [SECS [REPS]]]
--   lua5.4 bench/many_names.lua BUILD ...
--
-- BUILD: a build tree (scripts/bench's build-bench: tally/ holds the Lua
-- 5.4 module, luajit/tally/ the LuaJIT one). N names (default 1,000,000)
-- "k:1".."k:N" in a fresh file store under $TMPDIR; each timed run is SECS
-- seconds (default 1) of db:incr on the names in one pseudo-random order
-- (a full-period LCG over the index, as scripts/bench-openresty's), with
-- the default handle_cache; the median of REPS (default 3) per mode.
local build = assert(arg[1], "usage: bench/many_names.lua BUILD [N [SECS [REPS]]]")
local jit = rawget(_G, "jit")
local dir = build .. (jit and "/luajit" or "")
package.path = dir .. "/?.lua;" .. dir .. "/?/init.lua;" .. package.path
package.cpath = dir .. "/?.so;" .. build .. "/?.so;" .. package.cpath
local tally = require "tally"
local core = require "tally.core"

local n = tonumber(arg[2]) or 1000000
local secs = tonumber(arg[3]) or 1
local reps = tonumber(arg[4]) or 3
local path = (os.getenv("TMPDIR") or "/tmp") .. "/tally-many-names-" .. os.time() .. ".tly"
os.remove(path)

local names = {}
for i = 1, n do names[i] = "k:" .. i end
local m = 1
while m < n do m = m * 2 end

-- ns per db:incr over secs of the LCG order (skipping indexes past n)
local function run(db)
  local x, ops, t0 = 0, 0, os.clock()
  local deadline = t0 + secs
  while true do
    for _ = 1, 10000 do
      x = (x * 1103515245 + 12345) % m
      if x < n then db:incr(names[x + 1]) end
    end
    ops = ops + 10000
    local t = os.clock()
    if t >= deadline then return (t - t0) * 1e9 / ops end
  end
end

local db = assert(tally.open("file:" .. path))
local t0 = os.clock()
for i = 1, n do db:incr(names[i]) end
local first = (os.clock() - t0) * 1e9 / n
db:close()

local got = { ["repeat"] = {}, always = {} }
for _ = 1, reps do
  for _, mode in ipairs({ "repeat", "always" }) do
    db = assert(tally.open("file:" .. path, { handle_admit = mode }))
    local ns = run(db)
    local held = core._store_cache_stats(db).held
    db:close()
    collectgarbage()
    table.insert(got[mode], ns)
    io.stderr:write(string.format("%s: %.0f ns (%d handles held)\n", mode, ns, held))
  end
end
os.remove(path)

local function median(t)
  table.sort(t)
  return t[math.floor((#t + 1) / 2)] or 0 / 0
end
local r, a = median(got["repeat"]), median(got.always)
print(string.format("%s, %d names, default handle_cache, median of %d x %.1f s:",
                    jit and jit.version or _VERSION, n, reps, secs))
print(string.format("  first pass (creates them):   %8.0f ns per name", first))
print(string.format("  handle_admit = \"repeat\":     %8.0f ns per db:incr(name)", r))
print(string.format("  handle_admit = \"always\":     %8.0f ns per db:incr(name) (%.1fx)", a, a / r))
