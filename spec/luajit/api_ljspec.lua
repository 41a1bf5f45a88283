-- Stores and counters under LuaJIT, through the FFI path and the classic
-- binding alike.
local helper = require "spec.luajit.helper"
local tally = require "tally"
local ffi = require "ffi"

describe("tally under LuaJIT", function()
  it("loads the LuaJIT build and uses the FFI path by default", function()
    assert.is_table(jit)
    assert.equal(helper.build .. "/tally/core.so", package.searchpath("tally.core", package.cpath))
    assert.is_nil(require("tally.ffi").reason)
    assert.is_true(tally.ffi)
  end)

  it("keeps the classic binding with TALLY_NO_FFI=1", function()
    local code = 'local t = require "tally"; io.write(tostring(t.ffi), " ", '
                 .. 'require("tally.ffi").reason or "-")'
    local out, rc = helper.spawn(code, "TALLY_NO_FFI=1").wait()
    assert.equal(0, rc, out)
    assert.equal("false TALLY_NO_FFI=1", out)
    out, rc = helper.spawn(code, "TALLY_NO_FFI=0").wait()
    assert.equal(0, rc, out)
    assert.equal("true -", out)
  end)

  it("switches paths with tally.ffi telling which is in use", function()
    helper.use("classic")
    assert.is_false(tally.ffi)
    assert.equal(require("tally.core")._classic.counter_incr, tally.counter_methods.incr)
    helper.use("ffi")
    assert.is_true(tally.ffi)
    assert.not_equal(require("tally.core")._classic.counter_incr, tally.counter_methods.incr)
  end)
end)

for _, path in ipairs(helper.paths) do
  describe("the " .. path .. " path", function()
    local db
    before_each(function()
      helper.use(path)
      db = assert(tally.open())
    end)
    after_each(function()
      db:close()
      helper.use("ffi")
    end)

    it("counts with c:incr, c:decr and c:value", function()
      local c = db:counter("post:1:likes", { shards = 10, policy = "random" })
      assert.is_true(c:incr())
      assert.is_true(c:incr(5))
      assert.is_true(c:decr(2))
      assert.is_true(c:decr())
      assert.equal(3, c:value())
      assert.equal("number", type(c:value()))
      local s = 0
      for _, v in ipairs(c:shards()) do s = s + v end
      assert.equal(3, s)
      assert.equal(3, c:reset())
      assert.equal(0, c:value())
      local info = c:info()
      assert.matches("^" .. ("%x"):rep(16) .. "$", info.incarnation)   -- all 64 bits, as text
      info.incarnation = nil
      assert.same({ name = "post:1:likes", shards = 10, policy = "random" }, info)
    end)

    it("counts by name with db:incr, db:decr and db:value", function()
      assert.is_true(db:incr("a"))
      assert.is_true(db:incr("a", 41))
      assert.is_true(db:decr("a", 2))
      assert.is_true(db:decr("a"))
      assert.equal(39, db:value("a"))
      local n, err, code = db:value("absent")
      assert.is_nil(n)
      assert.equal("no such counter 'absent'", err)
      assert.equal("ENOENT", code)
      assert.same({ 39, 1 }, { db:sum("*") })
      assert.same({ "a" }, db:names())
    end)

    it("shares the counter between db:counter and db:incr", function()
      local c = db:counter("x", { shards = 4, policy = "thread" })
      for _ = 1, 1000 do db:incr("x") end
      for _ = 1, 1000 do c:incr(2) end
      assert.equal(3000, c:value())
      assert.equal(3000, db:value("x"))
    end)

    it("counts exactly in a loop the JIT compiles", function()
      local c = db:counter("hot", { shards = 16 })
      local n = 0
      for i = 1, 200000 do
        c:incr()
        db:incr("hot2", 3)
        if i % 1000 == 0 then n = n + c:value() end
      end
      assert.equal(200000, c:value())
      assert.equal(600000, db:value("hot2"))
      assert.equal(1000 * 200 * 201 / 2, n)
    end)

    it("takes the key and function policies (through the classic methods)", function()
      local k = db:counter("k", { shards = 8, policy = "key" })
      k:incr(1, "alice")
      k:incr(2, "alice")
      db:incr("k", 3, "bob")
      assert.equal(6, k:value())
      assert.equal("key expected for a counter with the key policy",
                   helper.err(k.incr, k, 1):match("%((.*)%)"))
      local f = db:counter("f", { shards = 3, policy = function(n, key) return key end })
      f:incr(5, 2)
      f:incr(1, 3)
      assert.same({ 0, 5, 1 }, f:shards())
      assert.equal("policy function for 'f' returned 1.5 (expected an integer from 1 to 3)",
                   helper.err(f.incr, f, 1, 1.5))
    end)

    it("raises for misuse with the classic binding's messages", function()
      local c = db:counter("m")
      local cases = {
        { function() c:incr(1.5) end, "bad argument #1 to 'incr' (number has no integer representation)" },
        { function() c:incr(0 / 0) end, "bad argument #1 to 'incr' (number has no integer representation)" },
        { function() c:incr(math.huge) end, "bad argument #1 to 'incr' (number has no integer representation)" },
        { function() c:incr("x") end, "bad argument #1 to 'incr' (number expected, got string)" },
        { function() c:incr({}) end, "bad argument #1 to 'incr' (number expected, got table)" },
        { function() c:decr(true) end, "bad argument #1 to 'decr' (number expected, got boolean)" },
        { function() c:incr(2^53 + 2) end,
          "bad argument #1 to 'incr' (integer beyond +-2^53 is not exact as a LuaJIT number (pass an int64_t cdata))" },
        { function() c:incr(-2^60) end,
          "bad argument #1 to 'incr' (integer beyond +-2^53 is not exact as a LuaJIT number (pass an int64_t cdata))" },
        { function() c:incr(ffi.new("double", 1)) end, "bad argument #1 to 'incr' (number expected, got cdata)" },
        { function() c:incr(ffi.new("uint64_t", 2^63)) end,
          "bad argument #1 to 'incr' (uint64_t value beyond the int64_t range)" },
        { function() c.incr(db) end, "bad argument #1 to 'incr' (tally.counter expected, got tally.store)" },
        { function() c.incr({}) end, "bad argument #1 to 'incr' (tally.counter expected, got table)" },
        { function() c.value(nil) end, "bad argument #1 to 'value' (tally.counter expected, got nil)" },
        { function() db:incr() end, "bad argument #1 to 'incr' (string expected, got no value)" },
        { function() db:incr(5) end, "bad argument #1 to 'incr' (string expected, got number)" },
        { function() db:incr("m", 0.5) end, "bad argument #2 to 'incr' (number has no integer representation)" },
        { function() db:decr("m", 2^54) end,
          "bad argument #2 to 'decr' (integer beyond +-2^53 is not exact as a LuaJIT number (pass an int64_t cdata))" },
        { function() db:value() end, "bad argument #1 to 'value' (string expected, got no value)" },
        { function() db.value(c, "m") end, "bad argument #1 to 'value' (tally.store expected, got tally.counter)" },
        { function() db:counter("s", { shards = 1.5 }) end,
          "bad argument #2 to 'counter' (shards must be an integer from 1 to 1024 or \"auto\", got 1.5)" },
        { function() db:counter("s", { shards = 0 }) end,
          "bad argument #2 to 'counter' (shards must be an integer from 1 to 1024 or \"auto\", got 0)" },
        { function() c:reshard(2.5) end,
          "bad argument #1 to 'reshard' (shards must be an integer from 1 to 1024, got 2.5)" },
        { function() c:add_shard(1, 0.5) end, "bad argument #2 to 'add_shard' (number has no integer representation)" },
        { function() c:add_shard(1.5, 1) end, "bad argument #1 to 'add_shard' (shard must be an integer from 1 to 1, got 1.5)" },
        { function() tally.open("memory", { mode = 1.5 }) end,
          "bad argument #2 to 'open' (mode must be an integer from 0 to 4095 (permission bits), got 1.5)" },
      }
      for i, case in ipairs(cases) do
        assert.equal(case[2], helper.err(case[1]), "case " .. i)
      end
      assert.equal(0, c:value())             -- nothing was counted by the failures
      assert.equal("10", tostring(c:incr("10") and c:value()))  -- numeric strings, as in Lua 5.4
    end)

    it("raises on closed counters and stores, never touching freed memory", function()
      local c = db:counter("c")
      local d = db:counter("d")
      c:incr(3)
      c:close()
      assert.equal("attempt to use a closed counter", helper.err(c.incr, c))
      assert.equal("attempt to use a closed counter", helper.err(c.value, c))
      assert.equal("attempt to use a closed counter", helper.err(c.decr, c, 1))
      assert.equal(3, db:value("c"))          -- another handle
      db:incr("d", 2)
      db:close()
      assert.equal("attempt to use a closed store", helper.err(d.incr, d))
      assert.equal("attempt to use a closed store", helper.err(d.value, d))
      assert.equal("attempt to use a closed store", helper.err(db.incr, db, "d"))
      assert.equal("attempt to use a closed store", helper.err(db.value, db, "d"))
      db = assert(tally.open())                -- for after_each
    end)

    it("survives garbage collection of handles between calls", function()
      for i = 1, 2000 do
        assert.is_true(db:incr("g" .. (i % 7), 1))
        if i % 100 == 0 then collectgarbage() end
        db:counter("g" .. (i % 5)):incr()     -- a handle left to the collector
      end
      collectgarbage()
      collectgarbage()
      local sum = db:sum("g*")
      assert.equal(4000, sum)
    end)

    it("reopens a counter dropped under a cached handle", function()
      db:incr("gone", 5)
      assert.is_true(db:drop("gone"))
      assert.is_true(db:incr("gone", 2))
      assert.equal(2, db:value("gone"))
      local c = db:counter("gone")
      db:drop("gone")
      local ok, err, code = c:incr()
      assert.is_nil(ok)
      assert.equal("counter 'gone' was dropped", err)
      assert.equal("EDROPPED", code)
      local v, verr, vcode = c:value()
      assert.is_nil(v)
      assert.equal("counter 'gone' was dropped", verr)
      assert.equal("EDROPPED", vcode)
    end)

    it("returns nil, message, code for failures of the environment", function()
      local v, err, code = tally.open("file:/nonexistent-dir/x.tly")
      assert.is_nil(v)
      assert.matches("/nonexistent%-dir/x%.tly", err)
      assert.equal("ESYS", code)
    end)

    it("keeps c:value(opts) and the methods written in Lua", function()
      local c = db:counter("v")
      c:incr(7)
      assert.same({ 7, "exact" }, { c:value({ max_age = 10 }) })
      local top = db:top(1)
      assert.equal("v", top[1].name)
      assert.equal(7, top[1].value)
      local sk = c:skew()
      assert.equal(7, sk.max)
      assert.equal(1, sk.shards)
    end)
  end)
end

describe("the FFI and classic paths", function()
  after_each(function() helper.use("ffi") end)

  -- A deterministic mix of calls, good and bad, on a fresh store.
  local function script()
    local db = assert(tally.open())
    local out = {}
    local seed = 12345
    local function rnd(n)
      seed = (seed * 1103515245 + 12345) % 2147483648
      return seed % n + 1
    end
    local args = { 1, 0, -3, 7, 1.5, "2", nil, 2^53, -2^53, 2^53 + 2, ffi.new("int64_t", 5),
                   ffi.new("uint64_t", 9), ffi.new("int64_t", 2)^60, true, 0 / 0 }
    db:counter("k", { shards = 4, policy = "key" })
    local names = { "a", "b", "k", 3 }
    local handles = {}
    for i = 1, 3000 do
      local name = names[rnd(#names)]
      local a = args[rnd(#args)]
      local op = rnd(8)
      local r
      if op == 1 then r = helper.outcome(db.incr, db, name, a, "key")
      elseif op == 2 then r = helper.outcome(db.decr, db, name, a)
      elseif op == 3 then r = helper.outcome(db.value, db, name)
      elseif op == 4 then
        local ok, c = pcall(db.counter, db, name)
        if ok and c then handles[#handles + 1] = c end
        r = { ok }
      elseif op == 5 and #handles > 0 then
        local c = handles[rnd(#handles)]
        r = helper.outcome(c.incr, c, a, "key")
      elseif op == 6 and #handles > 0 then
        local c = handles[rnd(#handles)]
        r = helper.outcome(c.value, c)
      elseif op == 7 and #handles > 0 then
        local c = table.remove(handles, rnd(#handles))
        c:close()
        r = helper.outcome(c.incr, c, 1)
      else
        r = helper.outcome(db.value, db, name)
      end
      for j, v in ipairs(r) do if type(v) == "cdata" then r[j] = tostring(v) end end
      out[i] = r
    end
    out[#out + 1] = { db:sum("*") }
    for j, v in ipairs(out[#out]) do out[#out][j] = tostring(v) end
    db:close()
    return out
  end

  it("give identical results, errors and messages", function()
    helper.use("ffi")
    local a = script()
    helper.use("classic")
    local b = script()
    assert.equal(#a, #b)
    for i = 1, #a do assert.same(a[i], b[i], "call " .. i) end
  end)

  it("compile c:incr and db:incr into traces without aborts (FFI path)", function()
    helper.use("ffi")
    local db = assert(tally.open())
    local c = db:counter("traced", { shards = 16 })
    local aborts, stops = {}, 0
    local function loop(n)
      for _ = 1, n do
        c:incr()
        c:incr(2)
        db:incr("traced", 1)
        c:decr(1)
      end
    end
    local function on_trace(what, tr, func, pc, otr, oex)
      if what == "abort" and func == loop then aborts[#aborts + 1] = tostring(oex) end
      if what == "stop" then stops = stops + 1 end
    end
    jit.flush()
    jit.attach(on_trace, "trace")
    loop(100000)
    jit.attach(on_trace)                       -- detach
    assert.same({}, aborts)
    assert.is_true(stops > 0)
    assert.equal(300000, c:value())
    db:close()
  end)
end)
