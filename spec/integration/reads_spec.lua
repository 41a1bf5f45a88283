-- Reads of many counters (db:values, db:snapshot: one walk in C each)
-- while another process writes: 100,000 slot counters in pairs p:I:a,
-- p:I:b that the writer batches together ({a + 1, b + 2}). Each counter
-- only grows, so a value either read gives lies between a per-name read
-- before it and one after it; a snapshot is also a consistent cut, so in
-- it every pair has b = 2a.
local helper = require "spec.support.helper"
local tally = require "tally"

local PAIRS = 50000

local WRITER = [[
  local tally = require "tally"
  local db = assert(tally.open("file:" .. arg[1]))
  local n, stop = tonumber(arg[2]), arg[3]
  local a, b, seed = {}, {}, 1
  for i = 1, n do
    a[i] = db:counter("p:" .. i .. ":a", { policy = "slot" })
    b[i] = db:counter("p:" .. i .. ":b", { policy = "slot" })
  end
  io.write("ready\n") io.flush()
  local t0, batches = tally.now(), 0
  while tally.now() - t0 < 60 do
    for _ = 1, 200 do
      seed = (seed * 1103515245 + 12345) % 2147483648
      local i = seed % n + 1
      assert(db:incr_many({ { a[i], 1 }, { b[i], 2 } }))
      batches = batches + 1
    end
    local f = io.open(stop)
    if f then f:close(); break end
  end
  io.write("done ", batches, "\n")
]]

-- Every counter's value, one per-name read each.
local function each(db)
  local t = {}
  for i = 1, PAIRS do
    for _, s in ipairs({ "a", "b" }) do
      local name = "p:" .. i .. ":" .. s
      t[name] = assert(db:value(name))
    end
  end
  return t
end

-- got lies between before and after for every counter, and holds no other.
local function between(before, got, after)
  local n, bad = 0, nil
  for name, v in pairs(got) do
    n = n + 1
    if not (before[name] and before[name] <= v and v <= after[name]) then
      bad = bad or (name .. ": " .. tostring(before[name]) .. " <= " .. v .. " <= "
                    .. tostring(after[name]))
    end
  end
  assert.is_nil(bad)
  assert.equal(2 * PAIRS, n)
end

describe("reads of many counters under a writer", function()
  it("db:values and db:snapshot give what per-name reads bound", function()
    local path, script = helper.tmpfile(), helper.tmpfile("writer.lua")
    local stop = helper.tmpfile("stop")
    os.remove(stop)
    helper.write(script, WRITER)
    local db = assert(tally.open("file:" .. path))
    for i = 1, PAIRS do                   -- made here first: the writer only opens them
      assert(db:counter("p:" .. i .. ":a", { policy = "slot" }))
      assert(db:counter("p:" .. i .. ":b", { policy = "slot" }))
    end
    local p = assert(io.popen(helper.q(helper.bin) .. " " .. helper.q(script) .. " "
                              .. helper.q(path) .. " " .. PAIRS .. " " .. helper.q(stop), "r"))
    assert.equal("ready", p:read("l"))
    local moved = 0
    for _ = 1, 2 do
      local before = each(db)
      local values = assert(db:values("p:*"))
      local snap = assert(db:snapshot("p:*"))
      local after = each(db)
      between(before, values, after)
      between(before, snap, after)
      for i = 1, PAIRS do                 -- the cut: batches whole
        local a, b = snap["p:" .. i .. ":a"], snap["p:" .. i .. ":b"]
        if b ~= 2 * a then assert.equal(2 * a, b, "pair " .. i) end
      end
      for name, v in pairs(after) do
        if v ~= before[name] then moved = moved + 1 end
      end
    end
    helper.write(stop, "")
    local done = p:read("l")
    p:close()
    assert.matches("^done %d+", done)
    assert.is_true(moved > 0, "the writer wrote nothing meanwhile")
    -- at rest, all three agree
    local values, snap, after = db:values("p:*"), db:snapshot("p:*"), each(db)
    assert.same(after, values)
    assert.same(after, snap)
    db:close()
  end)
end)
