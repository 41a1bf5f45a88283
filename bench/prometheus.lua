-- prometheus.lua -- what a /metrics scrape of many counters costs.
--
-- Usage: lua5.4 bench/prometheus.lua BUILD_DIR [N] [REPS]   (or luajit)
-- Makes N counters (default 1,000,000: post:I:likes, values I) in a memory
-- store, then times, REPS times each (median, and the spread):
--   tally.prometheus(db)           every counter under the default metric
--   tally.prometheus(db), labels   the same names under a family with a
--                                  metric and a label (post="I"), then
--                                  under one with two (post:*:*: post="I",
--                                  what="likes")
-- beside, in the same process, the reads any scrape makes: db:names() (the
-- sorted names) and db:values() (every value in one walk). CPU seconds.
-- Compare two revisions by running it against each build directory in
-- turn (processes on this VM differ by up to 2x).
local build = assert(arg[1], "usage: prometheus.lua BUILD_DIR [N] [REPS]")
local n = tonumber(arg[2]) or 1000000
local reps = tonumber(arg[3]) or 3

package.path = build .. "/?.lua;" .. build .. "/?/init.lua;" .. package.path
package.cpath = build .. "/?.so;" .. package.cpath
local tally = require "tally"
local clock = os.clock

local db = assert(tally.open("memory"))
db:family("post:*:likes", { shards = 1 })
for i = 1, n do assert(db:incr("post:" .. i .. ":likes", i)) end

local function measure(label, f)
  local t = {}
  for r = 1, reps do
    collectgarbage()
    local t0 = clock()
    f()
    t[r] = clock() - t0
  end
  table.sort(t)
  print(string.format("%-46s median %6.2f s (%.2f-%.2f)", label, t[math.floor((reps + 1) / 2)], t[1],
                      t[reps]))
end

local bytes
measure("db:names()", function() db:names() end)
measure("db:values()", function() db:values() end)
measure("tally.prometheus(db), default metric", function() bytes = #tally.prometheus(db) end)
db:family("post:*:likes", { shards = 1, metric = "likes", labels = { "post" } })
measure("tally.prometheus(db), a family with a label", function() tally.prometheus(db) end)
db:family("post:*:*", { shards = 1, metric = "posts", labels = { "post", "what" } })
measure("tally.prometheus(db), a family with two labels", function() tally.prometheus(db) end)
print(string.format("%d counters, %s; exposition %.1f MB (default metric)", n,
                    rawget(_G, "jit") and jit.version or _VERSION, bytes / 1e6))
