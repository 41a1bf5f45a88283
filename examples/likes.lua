-- likes.lua: a viral post, several processes liking it at once through the
-- file store, the total printed exactly.
--
--   build/bin/tally examples/likes.lua [store-path] [procs] [likes-per-proc]
--
-- The parent opens (or creates) the store, defines the family post:*:likes
-- (16 shards, thread policy: each process keeps to its own shard), creates
-- post:42:likes, starts the workers at once by running this same script
-- with the same interpreter ("worker" as first argument), waits for all of
-- them, then prints each worker's report, the per-shard values and the
-- exact total. It exits with status 1 if the total is not procs * likes.

local tally = require "tally"

local NAME = "post:42:likes"

local function q(s)  -- a shell word
  return "'" .. tostring(s):gsub("'", "'\\''") .. "'"
end

-- Wall-clock seconds, as precise as the system gives them.
local function now()
  local p = io.popen("date +%s.%N 2>/dev/null")
  local t = p and tonumber(p:read("l"))
  if p then p:close() end
  return t or os.time()
end

if arg[1] == "worker" then
  local path, id, likes = arg[2], arg[3], math.tointeger(tonumber(arg[4]))
  local db = assert(tally.open("file:" .. path, { create = false }))
  local post = db:counter(NAME)
  local t0 = os.clock()
  for _ = 1, likes do post:incr() end
  local cpu = os.clock() - t0
  io.write(string.format("worker %s: %d likes in %.3f s cpu (%.1f ns/like)\n",
                         id, likes, cpu, cpu / likes * 1e9))
  db:close()
  return
end

local path = arg[1]
local procs = math.tointeger(tonumber(arg[2] or 4))
local likes = math.tointeger(tonumber(arg[3] or 1000000))
if not procs or procs < 1 or not likes or likes < 0 then
  io.stderr:write("usage: tally examples/likes.lua [store-path] [procs] [likes-per-proc]\n")
  os.exit(2)
end
local temporary = path == nil
if temporary then
  local t = os.tmpname()
  os.remove(t)
  path = t .. "-likes.tly"
end

-- The interpreter running us: the lowest arg index (arg[-1] for `tally`).
local interp, lowest = arg[-1], -1
while arg[lowest - 1] do lowest = lowest - 1; interp = arg[lowest] end
local script = arg[0]

local db = assert(tally.open("file:" .. path))
db:family("post:*:likes", { shards = 16, policy = "thread" })
local post = db:counter(NAME, { shards = 16, policy = "thread" })
local before = post:value()

print(string.format("%s: %d processes x %d likes on %s (%s)", script, procs, likes, NAME, path))
local t0 = now()
local workers = {}
for i = 1, procs do
  workers[i] = assert(io.popen(table.concat({
    q(interp), q(script), "worker", q(path), tostring(i), tostring(likes) }, " ") .. " 2>&1"))
end
local failed = 0
for i = 1, procs do
  local out = workers[i]:read("a")
  local ok, _, code = workers[i]:close()
  io.write(out)
  if not ok then
    failed = failed + 1
    io.write(string.format("worker %d failed (status %s)\n", i, tostring(code)))
  end
end
local elapsed = now() - t0

local total = post:value() - before
local expected = procs * likes
print("shards: " .. table.concat(post:shards(), " "))
print(string.format("total: %d likes (expected %d) in %.3f s wall, %.0f likes/s",
                    total, expected, elapsed, elapsed > 0 and total / elapsed or 0))
db:close()
if temporary then os.remove(path) end

if failed > 0 or total ~= expected then
  print(string.format("MISMATCH: %d likes missing", expected - total))
  os.exit(1)
end
print("exact: every like counted")
