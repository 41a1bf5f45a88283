-- bench/many_names.lua -- where db:incr(name) over a million names goes,
-- under LuaJIT outside nginx: the rows scripts/bench-openresty measures in
-- a worker, taken apart.
--
--   luajit bench/many_names.lua BUILD [N] [REPS]
--
-- BUILD: a build tree with the LuaJIT module (build-bench after
-- scripts/bench, or BUILD_TYPE=Release scripts/build build-bench) and
-- bench/libffi_atomic.so. N names "k:1".."k:N" (default 1,000,000), each
-- row the median of REPS runs (default 5) of 3,000,000 increments in the
-- pseudo-random order bench-openresty uses. Rows, in one process each
-- (so that no row's memory is another's), run by turns:
--   floor     a Lua table from name to index, an FFI atomic add on an array
--   checked   a table from name to (generation, index), one FFI call that
--             checks the region's generation, adds, and checks the result:
--             what an exact design that holds the cell pays at the least
--   stamp     tally: the store's name table (its stamps), one FFI call to
--             tally_vector_stamp_incr: db:incr's work without its Lua
--   stamp1    the same, counters of 1 fixed shard (no sampling for
--             automatic shards)
--   incr      tally: db:incr(name), as a user writes it (default counters)
local build, N, REPS = arg[1], tonumber(arg[2]) or 1000000, tonumber(arg[3]) or 5
local row = arg[4]
if not build then
  io.stderr:write("usage: luajit bench/many_names.lua BUILD [N] [REPS]\n")
  os.exit(2)
end
if not row then -- the driver: each row in a process of its own, by turns
  local rows, got = { "floor", "checked", "stamp", "stamp1", "incr" }, {}
  for _, r in ipairs(rows) do got[r] = {} end
  for _ = 1, REPS do
    for _, r in ipairs(rows) do
      local p = assert(io.popen(("%q %q %q %d 1 %s"):format(arg[-1], arg[0], build, N, r)))
      local out = p:read("*a")
      p:close()
      local ns = tonumber(out:match("ns (%S+)"))
      if not ns then error("row " .. r .. " failed: " .. out) end
      table.insert(got[r], ns)
    end
  end
  local function median(t)
    table.sort(t)
    return t[math.floor((#t + 1) / 2)]
  end
  local floor, checked = median(got.floor), median(got.checked)
  print(("| row (LuaJIT, %d names, 3,000,000 increments at random) | ns | vs the floor | vs checked |"):format(N))
  print("|---|---|---|---|")
  for _, r in ipairs(rows) do
    local m = median(got[r])
    print(("| %s | %.1f | %.2fx | %.2fx |"):format(r, m, m / floor, m / checked))
  end
  print(("Medians of %d runs, one process a row, by turns. Reproduce with: "
         .. "luajit bench/many_names.lua %s %d %d"):format(REPS, build, N, REPS))
  return
end

local LJ = build .. "/luajit"
package.path = LJ .. "/?.lua;" .. LJ .. "/?/init.lua;" .. package.path
package.cpath = LJ .. "/?.so;" .. package.cpath
local ffi = require "ffi"
ffi.cdef [[
int ffi_atomic_add(int64_t *, int64_t);
struct ffi_cells { int64_t *cells; const uint64_t *gens; };
int ffi_checked_add(const struct ffi_cells *t, int64_t entry, int64_t delta);
]]
local A = ffi.load(build .. "/bench/libffi_atomic.so")
local tally = require "tally"
local K = 3000000
local LCG_A, LCG_C = 1664525, 1013904223
local names = {}
for i = 1, N do names[i] = "k:" .. i end
local m = 1
while m < N do m = m * 2 end

local idx, loop = {}, nil
if row == "floor" then
  local cells = ffi.new("int64_t[?]", N)
  for i = 1, N do idx[names[i]] = i - 1 end
  loop = function(x)
    local f = A.ffi_atomic_add
    for _ = 1, K do
      repeat x = (x * LCG_A + LCG_C) % m until x < N
      f(cells + idx[names[x + 1]], 1)
    end
    return x
  end
elseif row == "checked" then
  local cells, gens = ffi.new("int64_t[?]", N), ffi.new("uint64_t[?]", math.floor(N / 8192) + 1)
  for g = 0, math.floor(N / 8192) do gens[g] = 7 end
  local t = ffi.new("struct ffi_cells", { cells, gens })
  for i = 1, N do idx[names[i]] = 7 * 2 ^ 33 + (i - 1) end
  loop = function(x)
    local f = A.ffi_checked_add
    for _ = 1, K do
      repeat x = (x * LCG_A + LCG_C) % m until x < N
      if f(t, idx[names[x + 1]], 1) ~= 0 then error("stale") end
    end
    return x
  end
else
  local path = os.tmpname()
  os.remove(path)
  local db = assert(tally.open("file:" .. path, { handle_cache = 2 * N }))
  if row == "stamp1" then db:family("k:*", { shards = 1 }) end
  -- create, admit to the handle cache, then the first hit stamps
  for _ = 1, 3 do for i = 1, N do assert(db:incr(names[i])) end end
  os.remove(path) -- the mapping stays
  if row == "incr" then
    loop = function(x)
      local d = db
      for _ = 1, K do
        repeat x = (x * LCG_A + LCG_C) % m until x < N
        d:incr(names[x + 1])
      end
      return x
    end
  else
    local sl = require("tally.core")._store_slots(db)
    local v = ffi.cast("struct tally_ffi_store *", db).vec
    local f = require("tally.ffi").lib.tally_vector_stamp_incr
    for i = 1, N do assert(sl[names[i]] >= 2 ^ 31, "not stamped") end
    loop = function(x)
      for _ = 1, K do
        repeat x = (x * LCG_A + LCG_C) % m until x < N
        if f(v, sl[names[x + 1]], 1) < 0 then error("stale stamp") end
      end
      return x
    end
  end
end
local x = loop(0) -- warm: the trace, the caches
local t0 = os.clock()
loop(x)
print(("ns %.2f"):format((os.clock() - t0) * 1e9 / K))
