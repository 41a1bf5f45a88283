-- bench_luajit.lua -- the LuaJIT side of scripts/bench: tally's hot calls
-- under LuaJIT, through the FFI path or the classic binding.
--
-- Usage: luajit bench/bench_luajit.lua BUILD_DIR [SECS] [REPS]
-- Loads tally from BUILD_DIR/luajit (tally/init.lua, tally/core.so) and the
-- baseline library BUILD_DIR/bench/libffi_atomic.so, and prints
-- "RESULT key ns_per_op" lines, each the median of REPS runs. PATH is "ffi"
-- or "classic" (run it again with TALLY_NO_FFI=1 for the classic rows):
--   lj.PATH.incr      c:incr()           16-shard thread-policy counter
--   lj.PATH.incr_cpu  c:incr()           a cpu-policy counter
--   lj.PATH.db_incr   db:incr(name, 1)   lookup by name each time
--   lj.PATH.value     c:value()          the sum of 16 shards
--   lj.PATH.db_value  db:value(name)
--   lj.PATH.observe   h:observe(v)       11 bounds, the next of 1,024 values
--   lj.atomic         ffi_atomic_add(cell, 1) through the FFI: one atomic add
--   lj.table          t[k] = t[k] + 1    pure Lua
--   lj.nop            c:_nop()           a classic C method that does nothing
-- Times are CPU time (os.clock) of a loop of N calls, loop overhead included
-- in every row alike; each loop runs once untimed first, so the JIT has
-- compiled it.
local build = assert(arg[1], "usage: bench_luajit.lua BUILD_DIR [SECS] [REPS]")
local secs = tonumber(arg[2]) or 0.3
local reps = tonumber(arg[3]) or 5

local lj = build .. "/luajit"
package.path = lj .. "/?.lua;" .. lj .. "/?/init.lua;" .. package.path
package.cpath = lj .. "/?.so;" .. package.cpath

local ffi = require "ffi"
local clock = os.clock
local ok, tally = pcall(require, "tally")
if not ok then
  io.stderr:write("bench_luajit: cannot load tally from ", lj, ": ", tostring(tally), "\n")
  os.exit(1)
end
local path = tally.ffi and "ffi" or "classic"

ffi.cdef "int ffi_atomic_add(int64_t *cell, int64_t delta);"
local ok_a, atomic = pcall(ffi.load, build .. "/bench/libffi_atomic.so")
if not ok_a then
  io.stderr:write("bench_luajit: ", tostring(atomic), "; lj.atomic not measured\n")
  atomic = nil
end

local db = assert(tally.open())
local c = db:counter("bench", { shards = 16, policy = "thread" })
local ccpu = db:counter("bench_cpu", { policy = "cpu" })
local name = "bench"

-- f(n) runs the operation n times. Calibrate n to ~secs, then time reps runs.
local function measure(f)
  local n = 1000
  f(n)
  while true do
    local t0 = clock()
    f(n)
    local dt = clock() - t0
    if dt >= secs / 4 or n >= 1e10 then
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
  return v[math.floor((reps + 1) / 2)]
end

local sink = 0  -- keeps value() results alive
local h = assert(db:histogram("bench_h"))
local vals = {}
for i = 1, 1024 do vals[i] = 0.0005 * 40000 ^ ((i - 1) / 1023) end
local band = require("bit").band
local ops = {
  { "lj." .. path .. ".observe", function(n)
      local h_, vs = h, vals for i = 1, n do h_:observe(vs[band(i, 1023) + 1]) end end },
  { "lj." .. path .. ".incr", function(n) local c_ = c for _ = 1, n do c_:incr() end end },
  { "lj." .. path .. ".incr_cpu", function(n) local c_ = ccpu for _ = 1, n do c_:incr() end end },
  { "lj." .. path .. ".db_incr", function(n) local db_, nm = db, name for _ = 1, n do db_:incr(nm, 1) end end },
  { "lj." .. path .. ".value", function(n)
      local c_, s = c, 0 for _ = 1, n do s = s + c_:value() end sink = sink + s end },
  { "lj." .. path .. ".db_value", function(n)
      local db_, nm, s = db, name, 0 for _ = 1, n do s = s + db_:value(nm) end sink = sink + s end },
  { "lj.table", function(n) local t, k = { bench = 0 }, name for _ = 1, n do t[k] = t[k] + 1 end end },
  { "lj.nop", function(n) local c_ = c for _ = 1, n do c_:_nop() end end },
}
if atomic then
  local cell = ffi.new("int64_t[8]")
  table.insert(ops, 1, { "lj.atomic", function(n)
    local add, p = atomic.ffi_atomic_add, cell for _ = 1, n do add(p, 1) end end })
end

for _, op in ipairs(ops) do
  local ns = measure(op[2])
  io.write(string.format("RESULT %s %.2f\n", op[1], ns))
  io.flush()
end
-- the increments all landed (and nothing was lost along the way)
local v = c:value()
assert(v > 0 and v == db:value(name) and sink > 0)
db:close()
