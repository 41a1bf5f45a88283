-- rollup_to_pushgateway.lua: roll counters up every second and push them to
-- a Prometheus Pushgateway, with the family's name parts as labels.
--
--   build/bin/tally examples/rollup_to_pushgateway.lua [pushgateway-url] [seconds]
--
-- pushgateway-url defaults to http://127.0.0.1:9091 (start one with
-- `prometheus-pushgateway --web.listen-address=127.0.0.1:9091`). The
-- script counts likes on a few posts for `seconds` (default 3), pushes
-- every rollup to /metrics/job/tally_example as likes_total{post="..."},
-- waits for the last push, and prints the sink's statistics. It exits
-- with status 1 if anything was dropped or still waits to be sent.

local tally = require "tally"

local url = (arg[1] or "http://127.0.0.1:9091"):gsub("/+$", "")
local seconds = tonumber(arg[2]) or 3

local db = assert(tally.open())
db:family("post:*:likes", { shards = 4, metric = "likes_total", labels = { "post" },
                            help = "Likes per post." })
local push = tally.sink.http { url = url .. "/metrics/job/tally_example",
                               format = "prometheus", timeout = 2 }
db:rollup("post:*:likes", { every = 1, sinks = { push } })

local posts = { "101", "102", "103" }
local deadline = tally.now() + seconds
while tally.now() < deadline do
  for i, post in ipairs(posts) do db:incr("post:" .. post .. ":likes", i) end
  db:tick()
  tally.sleep(0.01)
end
db:tick(math.floor(tally.now()) + 1)       -- one last rollup of the final values
local ok, err = db:flush(5)

local st = push:stats()
print(string.format("pushed to %s: %d records in %d requests, %d failures, %d dropped, %d queued",
                    url, st.sent, st.requests, st.failures, st.dropped, st.queued))
if st.last_error ~= "" then print("last error: " .. st.last_error) end
for _, post in ipairs(posts) do
  print(string.format('likes_total{post="%s"} %d', post, db:value("post:" .. post .. ":likes")))
end
db:close()
if not ok or st.dropped > 0 then
  io.stderr:write("rollup_to_pushgateway: " .. (err or "records were dropped") .. "\n")
  os.exit(1)
end
