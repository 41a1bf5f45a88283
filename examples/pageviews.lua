-- pageviews.lua: count page views, roll them up every second, and print a
-- live total and rate.
--
--   build/bin/tally examples/pageviews.lua [seconds] [store]
--
-- seconds: how long to run (default 5); store: a store spec such as
-- file:/tmp/views.tly (default: a memory store). Views arrive in bursts of
-- varying size, spread over a few pages, most of them on the home page.
-- Each second the rollup sums every page's shards once; the live line is
-- read from those rollup records alone (c:rolled()), which cost nothing
-- however many shards the pages have. At the end: the busiest pages, the
-- last minute of history of the home page, and a check that the rolled
-- total plus what came after the last rollup equals the exact total.

local tally = require "tally"

local seconds = tonumber(arg[1]) or 5
local db = assert(tally.open(arg[2]))

db:family("page:*", { shards = 8, policy = "thread" })
db:rollup("page:*", { every = 1, keep = { "60x1s", "60x1m" } })

local pages = { "/", "/", "/", "/pricing", "/blog", "/blog/sharded-counters", "/about" }
local handles = {}
for _, p in ipairs(pages) do handles[p] = handles[p] or db:counter("page:" .. p) end

-- The rolled total and rate over every page: one record per page.
local function rolled_totals()
  local total, rate = 0, 0
  for _, c in pairs(handles) do
    local r = c:rolled()
    if r then total, rate = total + r.value, rate + r.rate end
  end
  return total, rate
end

math.randomseed(42)
local deadline, views = tally.now() + seconds, 0
while tally.now() < deadline do
  local burst = math.random(200, 2000)
  for _ = 1, burst do handles[pages[math.random(#pages)]]:incr() end
  views = views + burst
  for _, run in ipairs(db:tick()) do
    if run.status == "ran" then
      local total, rate = rolled_totals()
      print(string.format("%s  total %9d  rate %9.0f views/s  (%d pages rolled up)",
                          os.date("!%H:%M:%S", math.floor(run.period * run.every)),
                          total, rate, run.counters))
    end
  end
  tally.sleep(0.002)
end

print("\nbusiest pages (exact):")
for i, row in ipairs(db:top("page:*", 3)) do
  print(string.format("  %d. %-26s %d", i, row.name, row.value))
end
local hist = db:counter("page:/"):history("1s")
local spark = {}
for i = math.max(1, #hist - 9), #hist do spark[#spark + 1] = hist[i].v end
print("page:/ in its last rolled seconds: " .. table.concat(spark, " "))

local exact = db:sum("page:*")
print(string.format("\n%d views counted, exact total %d, last rolled total %d",
                    views, exact, (rolled_totals())))
if exact ~= views then
  io.stderr:write("pageviews: the exact total does not match the views made\n")
  os.exit(1)
end
db:close()
