-- bench/scale.lua -- reading a million counters: each read of many
-- counters beside what the same answer costs a Lua script, in one run.
--
--   lua5.4 bench/scale.lua BUILD [N] [REPS]      (or luajit, with BUILD/luajit)
--
-- Makes N default counters post:I:likes (default 1,000,000) in a file store
-- with values that tie often, rolls them up twice (for the rates), then
-- times each row REPS times (default 5) and prints the median CPU seconds
-- and the median's ratio to its baseline, measured in the same process:
--   db:sum(p)                       the walk every other row is compared to
--   db:top(p, 10), by value, rate   target: within 3x db:sum
--   db:names(p)                     target 0.6 s; baseline: a Lua loop that
--                                   builds the same list of names
--   db:values(p), db:snapshot(p)    baseline: a Lua loop that builds the
--                                   same { [name] = value } table
--   top 10 of a Lua table           a Lua loop over { [name] = value },
--                                   keeping the 10 largest
--   tally.prometheus(db)            target 0.75 s
--   db:export(p, write), db:import  targets 3 s and 6 s (into a new store);
--                                   baseline: lua-cjson encoding, decoding
--                                   the { [name] = value } table
--   db:incr(name), c:incr()         N increments at random; baseline: a Lua
--                                   table by name, a Lua array by index
local build, N, REPS = arg[1], tonumber(arg[2]) or 1000000, tonumber(arg[3]) or 5
if not build then
  io.stderr:write("usage: lua5.4 bench/scale.lua BUILD [N] [REPS]\n")
  os.exit(2)
end
package.path = build .. "/?.lua;" .. build .. "/?/init.lua;" .. package.path
package.cpath = build .. "/?.so;" .. package.cpath
local tally = require "tally"
local clock, fmt, sort = os.clock, string.format, table.sort

local path = (os.getenv("TALLY_TEST_TMP") or "/tmp") .. "/bench-scale.tly"
os.remove(path)
local db = assert(tally.open("file:" .. path))
local t0 = clock()
for i = 1, N do assert(db:incr("post:" .. i .. ":likes", (i * 7919) % 100003)) end
local made = clock() - t0
db:rollup("post:*", { every = 1 })
local T0 = 1763769600
db:tick(T0)
for i = 1, N, 3 do assert(db:incr("post:" .. i .. ":likes", i % 17)) end
db:tick(T0 + 1)

local function median(f)
  local t = {}
  for r = 1, REPS do
    collectgarbage()
    collectgarbage()
    local a = clock()
    f()
    t[r] = clock() - a
  end
  sort(t)
  return t[math.floor((REPS + 1) / 2)]
end

local P = "post:*"
local lua_names = function()
  local t = {}
  for i = 1, N do t[i] = "post:" .. i .. ":likes" end
  sort(t)
  return t
end
local lua_values = function()
  local t = {}
  for i = 1, N do t["post:" .. i .. ":likes"] = (i * 7919) % 100003 end
  return t
end
local values = lua_values()
local lua_top = function()
  local top = {}
  for name, v in pairs(values) do
    if #top < 10 or v > top[#top].value then
      top[#top + 1] = { name = name, value = v }
      sort(top, function(a, b) return a.value > b.value end)
      top[11] = nil
    end
  end
  return top
end

local rows = {}
local function row(what, f, base_what, base, target)
  rows[#rows + 1] = { what = what, t = median(f), base_what = base_what, base = base,
                      target = target }
end
local sum = median(function() assert(db:sum(P)) end)
rows[#rows + 1] = { what = "db:sum(p)", t = sum }
row("db:top(p, 10)", function() assert(db:top(P, 10)) end, "db:sum(p)", sum, "3x")
row("db:top(p, 10, \"rate\")", function() assert(db:top(P, 10, "rate")) end,
    "db:sum(p)", sum, "3x")
local ltop = median(lua_top)
rows[#rows + 1] = { what = "top 10 of a Lua table (a Lua loop)", t = ltop }
local lnames = median(lua_names)
row("db:names(p)", function() assert(db:names(P)) end, "a Lua loop builds the sorted list",
    lnames, "0.6 s")
local lvalues = median(lua_values)
row("db:values(p)", function() assert(db:values(P)) end, "a Lua loop builds the table", lvalues)
row("db:snapshot(p)", function() assert(db:snapshot(P)) end, "a Lua loop builds the table",
    lvalues)
row("tally.prometheus(db)", function() assert(tally.prometheus(db)) end, nil, nil, "0.75 s")
-- export, streamed to a write that keeps nothing; import of its text into
-- a fresh file store (what tally import --create does); beside them,
-- lua-cjson writing and reading the { [name] = value } table
do
  local cjson = require "cjson"
  local text = assert(db:export(P))
  local lenc = median(function() assert(cjson.encode(values)) end)
  row("db:export(p, write)", function() assert(db:export(P, function() end)) end,
      "cjson.encode of the table", lenc, "3 s")
  local enc = cjson.encode(values)
  local ldec = median(function() assert(cjson.decode(enc)) end)
  local k = 0
  row("db:import(text) into a new store", function()
    k = k + 1
    local copy = path .. ".import" .. k
    local other = assert(tally.open("file:" .. copy))
    assert(other:import(text) == N)
    other:close()
    os.remove(copy)
  end, "cjson.decode of the table", ldec, "6 s")
end

-- increments at random over the N counters: by name beside a Lua table
-- t[name] = t[name] + 1 over the same names (target 1.5x), and through
-- handles picked from a Lua array beside a[k] = a[k] + 1 (target 3x); N
-- increments a row, in one pseudo-random order of the names
do
  local names, order, x = {}, {}, 12345
  for i = 1, N do names[i] = "post:" .. i .. ":likes" end
  for i = 1, N do
    x = (x * 1103515245 + 12345) % 2147483648
    order[i] = x % N + 1
  end
  local by_name = {}
  for i = 1, N do by_name[i] = names[order[i]] end
  local t = {}
  for i = 1, N do t[names[i]] = 0 end
  local ltable = median(function()
    for i = 1, N do
      local k = by_name[i]
      t[k] = t[k] + 1
    end
  end)
  row("db:incr(name), " .. N .. " at random", function()
    for i = 1, N do db:incr(by_name[i]) end
  end, "a Lua table t[name] = t[name] + 1", ltable, "1.5x")
  local hs, a = {}, {}
  for i = 1, N do
    hs[i] = db:counter(names[i])
    a[i] = 0
  end
  local larray = median(function()
    for i = 1, N do
      local k = order[i]
      a[k] = a[k] + 1
    end
  end)
  row("c:incr(), a handle of " .. N .. " at random", function()
    for i = 1, N do hs[order[i]]:incr() end
  end, "a Lua array a[k] = a[k] + 1", larray, "3x")
end

print(fmt("%s, %d counters (file store, default options; created in %.2f s), "
          .. "median CPU seconds of %d", jit and jit.version or _VERSION, N, made, REPS))
print()
print("| read | tally | baseline, same run | ratio | target |")
print("|---|---|---|---|---|")
for _, r in ipairs(rows) do
  print(fmt("| %s | %.3f s | %s | %s | %s |", r.what, r.t,
            r.base and fmt("%s: %.3f s", r.base_what, r.base) or "",
            r.base and fmt("%.2fx", r.t / r.base) or "", r.target or ""))
end
db:close()
os.remove(path)
