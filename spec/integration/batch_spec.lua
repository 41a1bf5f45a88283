-- Batches and snapshots across processes: two writer processes batch
-- {a+1, b+2, c+3} into one file store while this one takes snapshots; then
-- writers are SIGKILLed while they batch. Every snapshot must hold b = 2a
-- and c = 3a (src/core/batch.c). The full million snapshots are a
-- benchmark (scripts/bench); this takes fewer.
local helper = require "spec.support.helper"
local tally = require "tally"

local BATCHER = [[
  local tally = require "tally"
  local db = assert(tally.open("file:" .. arg[1]))
  local list = {}
  for i, name in ipairs({ "a", "b", "c" }) do
    list[i] = { db:counter(name, { policy = "slot" }), i }
  end
  io.write("ready\n") io.flush()
  local n = tonumber(arg[2])
  for _ = 1, n do assert(db:incr_many(list)) end
  io.write("done\n")
]]

-- Start a batcher of n batches; returns its pipe and pid.
local function start(script, path, n)
  local p = assert(io.popen("echo $$; exec " .. helper.q(helper.bin) .. " " .. helper.q(script)
                            .. " " .. helper.q(path) .. " " .. n, "r"))
  local pid = assert(tonumber(p:read("l")))
  assert.equal("ready", p:read("l"))
  return p, pid
end

local function consistent(s)
  local a = s.a or 0
  return (s.b or 0) == 2 * a and (s.c or 0) == 3 * a, a
end

describe("batches across processes", function()
  it("are whole in every snapshot while two processes batch", function()
    local path, script = helper.tmpfile(), helper.tmpfile("batcher.lua")
    helper.write(script, BATCHER)
    local db = assert(tally.open("file:" .. path))
    local N = 100000
    local p1 = start(script, path, N)
    local p2 = start(script, path, N)
    local taken, bad, a = 0, 0, 0
    local deadline = tally.now() + 120
    repeat
      local ok
      ok, a = consistent(db:snapshot())
      if not ok then bad = bad + 1 end
      taken = taken + 1
    until a == 2 * N or tally.now() > deadline
    assert.equal("done", p1:read("l"))
    assert.equal("done", p2:read("l"))
    p1:close()
    p2:close()
    assert.equal(0, bad)
    assert.is_true(taken >= 100, "only " .. taken .. " snapshots")
    assert.same({ a = 2 * N, b = 4 * N, c = 6 * N }, db:snapshot())
    db:close()
  end)

  it("never show half a batch of a writer SIGKILLed mid-run, nor wait for it", function()
    local path, script = helper.tmpfile(), helper.tmpfile("batcher.lua")
    helper.write(script, BATCHER)
    local db = assert(tally.open("file:" .. path))
    local worst, bad = 0, 0
    for round = 1, 8 do
      local p, pid = start(script, path, 10000000)
      local until_t = tally.now() + 0.01 * round
      while tally.now() < until_t do
        if not consistent(db:snapshot()) then bad = bad + 1 end
      end
      os.execute("kill -9 " .. pid)
      p:close()
      local t0 = tally.now()
      if not consistent(db:snapshot()) then bad = bad + 1 end
      worst = math.max(worst, tally.now() - t0)
    end
    assert.equal(0, bad)
    assert.is_true(worst < 0.1, ("a snapshot after a kill took %.1f ms"):format(worst * 1e3))
    assert.is_true(db:check())
    db:close()
  end)
end)
