-- Histograms across processes: two writer processes observe into one
-- histogram of a file store (one under Lua 5.4 through core.batch, the
-- other under LuaJIT through the FFI when the LuaJIT build is there) while
-- this one takes snapshots. Every snapshot must hold what only an atomic
-- observe gives: the sum equals the sum of what the buckets say was
-- observed (each writer observes 1, 2, 3 and 4 in turn into buckets 1, 2,
-- 3 and +Inf, unit 1). Then a writer is SIGKILLed while it observes: the
-- histogram stays consistent and readers do not stall. The full million
-- snapshots are a benchmark (scripts/bench); this takes fewer.
local helper = require "spec.support.helper"
local tally = require "tally"

local SNAPSHOTS = 20000

local WRITER = [[
  local tally = require "tally"
  local path, stop, max = arg[1], arg[2], tonumber(arg[3])
  local db = assert(tally.open("file:" .. path))
  local h = assert(db:histogram("t", { buckets = { 1, 2, 3 }, unit = 1 }))
  io.write("ready ", tostring(tally.ffi), "\n") io.flush()
  local n = 0
  while n < max do
    for v = 1, 4 do assert(h:observe(v)) end
    n = n + 4
    if n % 4000 == 0 then
      local f = io.open(stop, "rb")
      if f then f:close() break end
    end
  end
  io.write("done ", n, "\n")
]]

-- The LuaJIT build and interpreter, or nil (then both writers are Lua 5.4).
local function luajit()
  local dir = os.getenv("TALLY_LUAJIT_BUILD")
  if not dir or dir == "" or not io.open(dir .. "/tally/core.so", "rb") then return nil end
  if helper.sh("command -v luajit || true") == "" then return nil end
  return dir
end

-- Start a writer; returns its pipe, pid and whether it uses the FFI.
local function start(script, path, stop, max, lj)
  local cmd
  if lj then
    cmd = "exec luajit -e " .. helper.q("package.path='" .. lj .. "/?.lua;" .. lj
                                        .. "/?/init.lua;'..package.path package.cpath='"
                                        .. lj .. "/?.so;'..package.cpath")
          .. " " .. helper.q(script)
  else
    cmd = "exec " .. helper.q(helper.bin) .. " " .. helper.q(script)
  end
  local p = assert(io.popen("echo $$; " .. cmd .. " " .. helper.q(path) .. " " .. helper.q(stop)
                            .. " " .. max .. " 2>&1", "r"))
  local pid = assert(tonumber(p:read("l")))
  local ready = p:read("l")
  assert.matches("^ready ", ready)
  return p, pid, ready == "ready true"
end

-- nil if the snapshot s (of t{*}) is consistent, else what is wrong.
local function check(s)
  local n1, n2, n3 = s["t{le=1}"] or 0, s["t{le=2}"] or 0, s["t{le=3}"] or 0
  local n4, sum = s["t{le=+Inf}"] or 0, s["t{sum,unit=1}"] or 0
  if sum ~= n1 + 2 * n2 + 3 * n3 + 4 * n4 then
    return ("sum %d, buckets %d %d %d %d"):format(sum, n1, n2, n3, n4)
  end
  return nil, n1 + n2 + n3 + n4
end

describe("a histogram observed by two processes", function()
  it("is consistent in every snapshot", function()
    local path, script = helper.tmpfile(), helper.tmpfile("writer.lua")
    local stop = helper.tmpfile("stop")
    os.remove(stop)
    helper.write(script, WRITER)
    local db = assert(tally.open("file:" .. path))
    local h = assert(db:histogram("t", { buckets = { 1, 2, 3 }, unit = 1 }))
    local lj = luajit()
    local p1 = start(script, path, stop, 100000000)
    local p2, _, ffi = start(script, path, stop, 100000000, lj)
    if lj then assert.is_true(ffi, "the LuaJIT writer does not use the FFI") end
    local bad, first, last, moved = {}, nil, 0, 0
    local deadline = tally.now() + 120
    for _ = 1, SNAPSHOTS do
      local s = assert(db:snapshot("t{*}"))
      local wrong, count = check(s)
      if wrong then bad[#bad + 1] = wrong end
      if count and count ~= last then moved = moved + 1 end
      last = count or last
      first = first or count
      if tally.now() > deadline then break end
    end
    helper.write(stop, "stop")
    local out1, out2 = p1:read("a"), p2:read("a")
    p1:close()
    p2:close()
    local n1 = assert(tonumber(out1:match("done (%d+)")), out1)
    local n2 = assert(tonumber(out2:match("done (%d+)")), out2)
    assert.same({}, { table.unpack(bad, 1, 5) })    -- the first few, if any
    assert.equal(0, #bad)
    assert.is_true(moved >= 10, "the writers moved the histogram in only " .. moved
                   .. " of " .. SNAPSHOTS .. " snapshots")
    -- at the end: every observation, exactly
    local s = h:snapshot()
    assert.equal(n1 + n2, s.count)
    assert.equal((n1 + n2) / 4 * (1 + 2 + 3 + 4), s.sum)
    assert.same({ 1, 2, 3, 4 }, { s.buckets[1].count * 4 / s.count, s.buckets[2].count * 4 / s.count,
                                  s.buckets[3].count * 4 / s.count, s.buckets[4].count * 4 / s.count })
    db:close()
  end)

  it("stays consistent, and readers go on, when a writer is SIGKILLed while it observes", function()
    local path, script = helper.tmpfile(), helper.tmpfile("writer.lua")
    local stop = helper.tmpfile("stop")
    os.remove(stop)
    helper.write(script, WRITER)
    local db = assert(tally.open("file:" .. path))
    assert(db:histogram("t", { buckets = { 1, 2, 3 }, unit = 1 }))
    for round = 1, 5 do
      local p, pid = start(script, path, stop, 100000000, round % 2 == 0 and luajit() or nil)
      for _ = 1, 200 do assert.is_nil((check(assert(db:snapshot("t{*}"))))) end
      assert(os.execute("kill -KILL " .. pid))
      p:read("a")
      p:close()
      local worst = 0
      for _ = 1, 50 do
        local t0 = tally.now()
        local s = assert(db:snapshot("t{*}"))
        local dt = tally.now() - t0
        if dt > worst then worst = dt end
        assert.is_nil((check(s)))
      end
      assert.is_true(worst < 0.1, ("a snapshot took %.1f ms after the kill"):format(worst * 1000))
    end
    assert.is_true(db:check())
    db:close()
  end)
end)
