-- bench_lua.lua -- the Lua side of scripts/bench: the binding's cost per call.
--
-- Usage: lua5.4 bench/bench_lua.lua BUILD_DIR [SECS] [REPS]
-- Loads the tally module from BUILD_DIR (tally/init.lua, tally/core.so) and
-- prints "RESULT key ns_per_op" lines, each the median of REPS runs:
--   lua.incr      c:incr()                 on a 16-shard thread-policy counter
--   lua.incr_cpu  c:incr()                 on a cpu-policy counter
--   lua.db_incr   db:incr(name, 1)         lookup by name each time
--   lua.observe   h:observe(v)             a histogram of 11 bounds, the next
--                                          of 1,024 log-spaced values
--   lua.table     t[k] = t[k] + 1          pure Lua, no C at all
--   lua.nop       c:_nop()                 a C method that does nothing:
--                                          the floor of any method call
-- Times are CPU time (os.clock) of a loop of N calls, loop overhead included
-- in every row alike.
local build = assert(arg[1], "usage: bench_lua.lua BUILD_DIR [SECS] [REPS]")
local secs = tonumber(arg[2]) or 0.3
local reps = tonumber(arg[3]) or 5

package.path = build .. "/?.lua;" .. build .. "/?/init.lua;" .. package.path
package.cpath = build .. "/?.so;" .. package.cpath

local clock = os.clock
local ok, tally = pcall(require, "tally")
if not ok then
  io.stderr:write("bench_lua: cannot load tally from ", build, ": ", tostring(tally), "\n")
  os.exit(1)
end

local db = assert(tally.open())
local c = db:counter("bench", { shards = 16, policy = "thread" })
local ccpu = db:counter("bench_cpu", { policy = "cpu" })
local name = "bench"

-- f(n) runs the operation n times. Calibrate n to ~secs, then time reps runs.
local function measure(f)
  local n = 1000
  while true do
    local t0 = clock()
    f(n)
    local dt = clock() - t0
    if dt >= secs / 4 or n >= 1e9 then
      n = math.max(1000, math.floor(n * secs / math.max(dt, 1e-6)))
      break
    end
    n = n * 4
  end
  local v = {}
  for r = 1, reps do
    local t0 = clock()
    f(n)
    v[r] = (clock() - t0) * 1e9 / n
  end
  table.sort(v)
  return v[(reps + 1) // 2]
end

local h = assert(db:histogram("bench_h"))
local vals = {}
for i = 1, 1024 do vals[i] = 0.0005 * 40000 ^ ((i - 1) / 1023) end

local ops = {
  { "lua.incr", function(n) local c_ = c for _ = 1, n do c_:incr() end end },
  { "lua.incr_cpu", function(n) local c_ = ccpu for _ = 1, n do c_:incr() end end },
  { "lua.observe", function(n)
      local h_, vs = h, vals for i = 1, n do h_:observe(vs[(i & 1023) + 1]) end end },
  { "lua.db_incr", function(n) local db_, nm = db, name for _ = 1, n do db_:incr(nm, 1) end end },
  { "lua.table", function(n) local t, k = { bench = 0 }, name for _ = 1, n do t[k] = t[k] + 1 end end },
}
if c._nop then
  ops[#ops + 1] = { "lua.nop", function(n) local c_ = c for _ = 1, n do c_:_nop() end end }
else
  io.stderr:write("bench_lua: the counter handle has no _nop method; lua.nop not measured\n")
end

local expect = 0
for _, op in ipairs(ops) do
  local ns = measure(op[2])
  io.write(string.format("RESULT %s %.2f\n", op[1], ns))
  io.flush()
end
-- the increments all landed (and nothing was lost along the way)
expect = c:value()
assert(expect > 0 and expect == db:value(name))
db:close()
