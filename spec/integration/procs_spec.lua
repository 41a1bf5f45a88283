-- Several processes counting into one file store at once.
local helper = require "spec.support.helper"
local tally = require "tally"

local WORKER = "spec/support/fixtures/worker.lua"
local PROCS, EACH = 4, 20000

-- Start n workers at once, wait for all, return their outputs.
local function run_workers(path, name, policy, n, each, via)
  local pipes = {}
  for i = 1, n do
    pipes[i] = helper.spawn(WORKER, path, name, policy, tostring(each), tostring(i), via)
  end
  local outs = {}
  for i = 1, n do
    outs[i] = pipes[i]:read("a")
    local _, _, code = pipes[i]:close()
    assert.equal(0, code, outs[i])
    assert.equal(("worker %d done %d\n"):format(i, each), outs[i])
  end
  return outs
end

describe("a file store shared by processes", function()
  for _, policy in ipairs({ "thread", "random", "round_robin", "key", "function" }) do
    it("counts exactly under the " .. policy .. " policy", function()
      local path = helper.tmpfile()
      local db = assert(tally.open("file:" .. path))
      local c = db:counter("hits", { shards = 16,
        policy = policy == "function" and function(n, key) return key % n + 1 end or policy })
      run_workers(path, "hits", policy, PROCS, EACH)
      assert.equal(PROCS * EACH, c:value())
      assert.equal(PROCS * EACH, helper.sum(c:shards()))
      if policy ~= "thread" then
        assert.equal(16, helper.nonzero(c:shards()))
      end
      assert.is_true(db:check())
      db:close()
    end)
  end

  it("counts exactly into a counter with automatic shards", function()
    local path = helper.tmpfile()
    local db = assert(tally.open("file:" .. path))
    local c = db:counter("auto", { shards = "auto" })
    assert.same({ 1, true, 0, 0 }, { c:info().shards, c:info().auto, c:info().grown,
                                     c:info().shrunk })
    run_workers(path, "auto", "family", PROCS, EACH * 10)
    assert.equal(PROCS * EACH * 10, c:value())
    assert.is_true(c:info().auto)
    assert.is_true(db:check())
    db:close()
  end)

  it("creates one counter when processes race to create it", function()
    local path = helper.tmpfile()
    assert(tally.open("file:" .. path)):close()
    run_workers(path, "raced", "family", PROCS, EACH, "db")
    local db = assert(tally.open("file:" .. path))
    assert.same({ "raced" }, db:names())
    assert.equal(PROCS * EACH, db:value("raced"))
    assert.same({ PROCS * EACH, 1 }, { db:sum("*") })
    db:close()
  end)

  it("keeps every increment across a reshard while processes count", function()
    local path = helper.tmpfile()
    local db = assert(tally.open("file:" .. path))
    local c = db:counter("moving", { shards = 16, policy = "random" })
    local pipes = {}
    for i = 1, PROCS do
      pipes[i] = helper.spawn(WORKER, path, "moving", "family", tostring(EACH * 10), tostring(i))
    end
    -- reshard over and over until the workers are well into their counting
    local deadline, sizes, k = os.time() + 60, { 64, 2, 32, 5 }, 0
    repeat
      k = k + 1
      assert.is_true(c:reshard(sizes[k % #sizes + 1]))
    until c:value() >= PROCS * EACH * 5 or os.time() > deadline
    assert.is_true(c:reshard(16))
    assert.truthy(k > 4)
    for i = 1, PROCS do
      local out = pipes[i]:read("a")
      local _, _, code = pipes[i]:close()
      assert.equal(0, code, out)
    end
    assert.equal(PROCS * EACH * 10, c:value())
    assert.equal(16, c:info().shards)
    db:close()
  end)

  it("loses nothing to resets taken while processes count", function()
    local path = helper.tmpfile()
    local db = assert(tally.open("file:" .. path))
    local c = db:counter("drained", { shards = 16, policy = "round_robin" })
    local pipes = {}
    for i = 1, PROCS do
      pipes[i] = helper.spawn(WORKER, path, "drained", "round_robin", tostring(EACH * 10), tostring(i))
    end
    -- reset over and over until half the increments have been taken
    local taken, deadline = 0, os.time() + 60
    repeat
      taken = taken + c:reset()
    until taken >= PROCS * EACH * 5 or os.time() > deadline
    for i = 1, PROCS do
      local out = pipes[i]:read("a")
      local _, _, code = pipes[i]:close()
      assert.equal(0, code, out)
    end
    assert.truthy(taken > 0)
    assert.equal(PROCS * EACH * 10, taken + c:value())
    db:close()
  end)

  it("opens and counts by name while another process drops and makes the name again", function()
    local path = helper.tmpfile()
    assert(tally.open("file:" .. path)):close()
    local script = helper.tmpfile("dropper.lua")
    local f = assert(io.open(script, "w"))
    f:write(([[
      local db = assert(require("tally").open("file:" .. %q))
      local t = os.time() + 20
      for _ = 1, 20000 do
        db:drop("x")
        assert(db:incr("x"))
        if os.time() > t then break end
      end
      db:close()
    ]]):format(path))
    f:close()
    local dropper = helper.spawn(script)
    local db = assert(tally.open("file:" .. path, { handle_admit = "always" }))
    local fails, why, t = 0, nil, os.time() + 20
    for i = 1, 20000 do
      local ok, msg = db:incr("x")
      if i % 2 == 0 then ok, msg = db:counter("x") end
      if not ok then fails, why = fails + 1, msg end
      if os.time() > t then break end
    end
    local out = dropper:read("a")
    local _, _, code = dropper:close()
    assert.equal(0, code, out)
    assert.equal(0, fails, why)   -- get or create: never "was dropped"
    db:close()
  end)

  it("opens and counts by name while another process expires the names", function()
    -- the upkeep's clock runs 3 s a tick against idle = 1: the names expire
    -- again and again; an open that raced an expiry said "no such counter"
    local path = helper.tmpfile()
    assert(tally.open("file:" .. path)):close()
    local script = helper.tmpfile("expirer.lua")
    local f = assert(io.open(script, "w"))
    f:write(([[
      local db = assert(require("tally").open("file:" .. %q))
      db:family("d*", { idle = 1 })
      local t, stop = 1e6, os.clock() + 2
      while os.clock() < stop do t = t + 3; db:tick(t) end
      db:close()
    ]]):format(path))
    f:close()
    local expirer = helper.spawn(script)
    local db = assert(tally.open("file:" .. path, { handle_cache = 2, handle_admit = "always" }))
    local fails, why, k, stop = 0, nil, 0, os.clock() + 1.5
    while os.clock() < stop do
      k = k + 1
      local name = "d" .. (k % 3 + 1)
      local ok, msg = db:incr(name)
      if k % 2 == 0 then ok, msg = db:counter(name) end
      if not ok then fails, why = fails + 1, msg end
    end
    local out = expirer:read("a")
    local _, _, code = expirer:close()
    assert.equal(0, code, out)
    assert.is_true(k > 1000)
    assert.equal(0, fails, why)   -- get or create: never "no such counter"
    db:close()
  end)
end)
