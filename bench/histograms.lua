-- histograms.lua -- what many histograms cost: opening them and a scrape.
--
-- Usage: lua5.4 bench/histograms.lua BUILD_DIR [N]   (or luajit, BUILD_DIR/luajit)
-- Opens N histograms (default 20,000: lat:/rI under a histogram family
-- with the default buckets, 13 member counters each) in a memory store,
-- one observation each, reopens them all (existing now), then times
-- tally.prometheus(db) twice. CPU seconds. Opening a new or an existing
-- histogram, or a scrape, that walked the whole store once per histogram
-- was quadratic: run it against two builds.
local build = assert(arg[1], "usage: histograms.lua BUILD_DIR [N]")
package.path = build .. "/?.lua;" .. build .. "/?/init.lua;" .. package.path
package.cpath = build .. "/?.so;" .. package.cpath
local tally = require "tally"
local db = assert(tally.open("memory"))
local n = tonumber(arg[2]) or 20000
db:family("lat:*", { histogram = true, metric = "lat_seconds", labels = { "route" } })
local t0 = os.clock()
for i = 1, n do assert(db:histogram("lat:/r" .. i)):observe(i % 7 / 10) end
print(string.format("%d histograms opened, one observation each: %.2f s", n, os.clock() - t0))
t0 = os.clock()
for i = 1, n do assert(db:histogram("lat:/r" .. i)):observe(i % 7 / 10) end
print(string.format("the same %d reopened (existing), one observation each: %.2f s", n,
                    os.clock() - t0))
for _ = 1, 2 do
  t0 = os.clock()
  local text = tally.prometheus(db)
  print(string.format("tally.prometheus(db): %.2f s, %.1f MB", os.clock() - t0, #text / 1e6))
end
