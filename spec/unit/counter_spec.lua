-- Counter handles: db:counter() and every method of tally.counter.
local helper = require "spec.support.helper"
local tally = require "tally"

-- c:info() less its incarnation (random per creation), which must be there.
local function plain(info)
  assert.matches("^" .. ("%x"):rep(16) .. "$", info.incarnation)
  info.incarnation = nil
  return info
end

local err, sum = helper.err, helper.sum

describe("tally.counter", function()
  local db
  before_each(function() db = assert(tally.open()) end)
  after_each(function() db:close() end)

  describe("db:counter()", function()
    it("creates a counter with automatic shards (one cell) and the thread policy by default", function()
      local c = db:counter("a")
      assert.same({ name = "a", shards = 1, policy = "thread", auto = true, grown = 0, shrunk = 0 }, plain(c:info()))
      assert.equal(0, c:value())
      assert.same({ "a" }, db:names())
    end)

    it("creates a counter with the options given", function()
      local c = db:counter("a", { shards = 8, policy = "random" })
      assert.same({ name = "a", shards = 8, policy = "random" }, plain(c:info()))
      assert.same({ name = "b", shards = 1, policy = "thread" },
                  plain(db:counter("b", { shards = 1 }):info()))
      assert.same({ name = "c", shards = 1024, policy = "key" },
                  plain(db:counter("c", { shards = 1024, policy = "key" }):info()))
    end)

    it("creates a counter whose shards the engine sizes with shards = 'auto'", function()
      local c = db:counter("a", { shards = "auto" })
      assert.same({ name = "a", shards = 1, policy = "thread", auto = true, grown = 0,
                    shrunk = 0 }, plain(c:info()))
      assert.matches("'a' %(1 auto shards, thread%)", tostring(c))
      c:incr(3)
      c:reshard(4)                     -- by hand, too: it stays automatic
      assert.same({ 4, true, 3 }, { c:info().shards, c:info().auto, c:value() })
      assert.equal(3, db:counter("a", { shards = "auto" }):value())
      assert.has_error(function() db:counter("a", { shards = 8 }) end)
      assert.matches("needs a policy that picks the shard itself",
                     err(db.counter, db, "f", { shards = "auto", policy = "key" }), 1, true)
      db:family("fam:*", { shards = "auto" })
      assert.is_true(db:counter("fam:1"):info().auto)
      assert.is_nil(db:counter("b", { shards = 16 }):info().auto)
      assert.has_error(function() db:counter("b", { shards = "auto" }) end)
    end)

    it("gets the existing counter with no options or the same ones", function()
      db:counter("a", { shards = 8, policy = "random" }):incr(5)
      assert.equal(5, db:counter("a"):value())
      assert.same({ name = "a", shards = 8, policy = "random" }, plain(db:counter("a"):info()))
      assert.equal(5, db:counter("a", { shards = 8 }):value())
      assert.equal(5, db:counter("a", { policy = "random" }):value())
      assert.equal(5, db:counter("a", { shards = 8, policy = "random" }):value())
    end)

    it("accepts names of 1 to 255 bytes, any bytes but NUL", function()
      local long = ("n"):rep(255)
      assert.equal(long, db:counter(long):info().name)
      assert.equal("\xff:é", db:counter("\xff:é"):info().name)
    end)

    it("raises when the options differ from the existing counter's", function()
      db:counter("a")
      assert.equal("counter 'a' exists with 1 (auto) shards and policy thread (asked for 8 shards)",
                   err(function() db:counter("a", { shards = 8 }) end))
      assert.equal("counter 'a' exists with 1 (auto) shards and policy thread (asked for policy key)",
                   err(function() db:counter("a", { policy = "key" }) end))
      assert.equal("counter 'a' exists with 1 (auto) shards and policy thread (asked for 2 shards and policy random)",
                   err(function() db:counter("a", { shards = 2, policy = "random" }) end))
      assert.equal("counter 'a' exists with 1 (auto) shards and policy thread (asked for policy function)",
                   err(function() db:counter("a", { policy = function() return 1 end }) end))
      assert.same({ name = "a", shards = 1, policy = "thread", auto = true, grown = 0, shrunk = 0 }, plain(db:counter("a"):info()))
    end)

    it("raises on a bad name", function()
      assert.equal("bad argument #1 to 'counter' (string expected, got number)",
                   err(function() db:counter(1) end))
      assert.equal("bad argument #1 to 'counter' (string expected, got no value)",
                   err(function() db:counter() end))
      assert.equal("bad argument #1 to 'counter' (name must be 1 to 255 bytes, got 0)",
                   err(function() db:counter("") end))
      assert.equal("bad argument #1 to 'counter' (name must be 1 to 255 bytes, got 256)",
                   err(function() db:counter(("n"):rep(256)) end))
      assert.equal("bad argument #1 to 'counter' (name must not contain a NUL byte)",
                   err(function() db:counter("a\0b") end))
      assert.same({}, db:names())
    end)

    it("raises on bad shards", function()
      local msg = "bad argument #2 to 'counter' (shards must be an integer from 1 to 1024 or \"auto\", got %s)"
      for _, case in ipairs({ { 0, "0" }, { 1025, "1025" }, { -1, "-1" }, { 1.5, "1.5" },
                              { "8", "'8'" }, { true, "true" }, { {}, "table" } }) do
        assert.equal(msg:format(case[2]), err(function() db:counter("a", { shards = case[1] }) end))
      end
      assert.same({}, db:names())
    end)

    it("raises on a bad policy", function()
      local msg = "bad argument #2 to 'counter' (policy must be one of thread, random, round_robin, key, slot, cpu or a function, got %s)"
      for _, case in ipairs({ { "x", "'x'" }, { "custom", "'custom'" }, { "Thread", "'Thread'" },
                              { 5, "5" }, { false, "false" }, { {}, "table" } }) do
        assert.equal(msg:format(case[2]), err(function() db:counter("a", { policy = case[1] }) end))
      end
    end)

    it("raises on unknown options and options that are not a table", function()
      assert.equal("bad argument #2 to 'counter' (unknown option 'shard')",
                   err(function() db:counter("a", { shard = 2 }) end))
      assert.equal("bad argument #2 to 'counter' (unknown option 1)",
                   err(function() db:counter("a", { 2 }) end))
      assert.equal("bad argument #2 to 'counter' (table expected, got string)",
                   err(function() db:counter("a", "random") end))
      assert.same({}, db:names())
    end)
  end)

  describe(":incr()", function()
    it("adds 1 by default, or n, and returns true", function()
      local c = db:counter("a")
      assert.is_true(c:incr())
      assert.is_true(c:incr(41))
      assert.equal(42, c:value())
      assert.is_true(c:incr(-50))
      assert.equal(-8, c:value())
      assert.is_true(c:incr(nil))
      assert.equal(-7, c:value())
    end)

    it("accepts floats with an integer value", function()
      local c = db:counter("a")
      c:incr(3.0)
      assert.equal(3, c:value())
      assert.equal("integer", math.type(c:value()))
    end)

    it("raises on an amount that is not an integer", function()
      local c = db:counter("a")
      assert.equal("bad argument #1 to 'incr' (number has no integer representation)",
                   err(function() c:incr(1.5) end))
      assert.equal("bad argument #1 to 'incr' (number has no integer representation)",
                   err(function() c:incr(2^63) end))
      assert.equal("bad argument #1 to 'incr' (number expected, got string)",
                   err(function() c:incr("x") end))
      assert.equal("bad argument #1 to 'incr' (number expected, got boolean)",
                   err(function() c:incr(true) end))
      assert.equal(0, c:value())
    end)

    it("returns nil, message, ERANGE when a shard would overflow", function()
      local c = db:counter("a", { shards = 1 })
      local big = 1 << 61
      assert.is_true(c:incr(big))
      local ok, msg, code = c:incr(big)
      assert.is_nil(ok)
      assert.is_string(msg)
      assert.equal("ERANGE", code)
      assert.equal(big, c:value())
      ok, msg, code = c:incr(math.mininteger)
      assert.is_nil(ok)
      assert.equal("ERANGE", code)
      assert.equal(big, c:value())
      -- decrementing by -2^63 is adding 2^63, which no int64 holds
      local want = { nil, "counter 'a': subtracting -2^63 would overflow", "ERANGE" }
      assert.same(want, { c:decr(math.mininteger) })
      assert.same(want, { db:decr("a", math.mininteger) })
      assert.equal(big, c:value())
    end)

    it("returns nil, message when the counter was dropped", function()
      local c = db:counter("gone")
      c:incr()
      db:drop("gone")
      assert.same({ nil, "counter 'gone' was dropped", "EDROPPED" }, { c:incr() })
      assert.same({ nil, "counter 'gone' was dropped", "EDROPPED" }, { c:decr() })
      db:counter("gone"):incr(7)             -- a new counter of that name
      assert.same({ nil, "counter 'gone' was dropped", "EDROPPED" }, { c:incr() })
      assert.equal(7, db:value("gone"))
    end)

    it("raises when called on something else", function()
      local c = db:counter("a")
      assert.equal("bad argument #1 to 'incr' (tally.counter expected, got tally.store)",
                   err(function() c.incr(db) end))
      assert.equal("bad argument #1 to 'incr' (tally.counter expected, got number)",
                   err(function() c.incr(42) end))
      assert.equal("bad argument #1 to 'incr' (tally.counter expected, got table)",
                   err(function() c.incr({}) end))
      assert.equal("calling 'incr' on bad self (tally.counter expected, got table)",
                   err(function() local t = { incr = c.incr }; t:incr() end))
    end)
  end)

  describe(":decr()", function()
    it("subtracts 1 by default, or n", function()
      local c = db:counter("a")
      assert.is_true(c:decr())
      assert.is_true(c:decr(4))
      assert.is_true(c:decr(-10))
      assert.equal(5, c:value())
    end)

    it("raises on an amount that is not an integer", function()
      local c = db:counter("a")
      assert.equal("bad argument #1 to 'decr' (number has no integer representation)",
                   err(function() c:decr(0.5) end))
      assert.equal("bad argument #1 to 'decr' (number expected, got table)",
                   err(function() c:decr({}) end))
    end)
  end)

  describe(":value()", function()
    it("is the sum of the shards", function()
      local c = db:counter("a", { shards = 4, policy = "round_robin" })
      for i = 1, 10 do c:incr(i) end
      assert.equal(55, c:value())
      assert.equal(55, sum(c:shards()))
    end)
  end)

  describe(":value() beyond int64", function()
    it("returns nil, message, ERANGE, and so do db:value() and db:sum()", function()
      local c = db:counter("huge", { shards = 4, policy = "round_robin" })
      local near = (1 << 62) - 1
      for _ = 1, 4 do assert.is_true(c:incr(near)) end
      assert.same({ near, near, near, near }, c:shards())
      local v, msg, code = c:value()
      assert.is_nil(v)
      assert.is_string(msg)
      assert.equal("ERANGE", code)
      assert.same({ nil, msg, "ERANGE" }, { db:value("huge") })
      assert.equal("ERANGE", select(3, db:sum("huge")))
      assert.equal("ERANGE", select(3, c:reset()))
      assert.same({ near, near, near, near }, c:shards())  -- nothing removed
      -- db:values reads in one pass and leaves it out, the others in
      assert.is_true(db:incr("small", 5))
      assert.same({ small = 5 }, db:values())
    end)
  end)

  describe(":shards()", function()
    it("returns one integer per shard", function()
      local c = db:counter("a", { shards = 5 })
      assert.same({ 0, 0, 0, 0, 0 }, c:shards())
      c:incr(3)
      local s = c:shards()
      assert.equal(5, #s)
      assert.equal(3, sum(s))
      assert.equal(1, helper.nonzero(s))        -- one thread, one shard
      for _, v in ipairs(s) do assert.equal("integer", math.type(v)) end
    end)
  end)

  describe(":reset()", function()
    it("zeroes every shard and returns the amount removed", function()
      local c = db:counter("a", { shards = 4, policy = "round_robin" })
      for _ = 1, 10 do c:incr() end
      c:decr(3)
      assert.equal(7, c:reset())
      assert.equal(0, c:value())
      assert.same({ 0, 0, 0, 0 }, c:shards())
      assert.equal(0, c:reset())
      c:incr(2)
      assert.equal(2, c:value())
    end)
  end)

  describe(":reshard()", function()
    it("keeps the value when growing", function()
      local c = db:counter("a", { shards = 4, policy = "round_robin" })
      for i = 1, 20 do c:incr(i) end
      assert.is_true(c:reshard(64))
      assert.equal(210, c:value())
      assert.equal(64, #c:shards())
      assert.equal(64, c:info().shards)
      c:incr(5)
      assert.equal(215, c:value())
    end)

    it("keeps the value when shrinking", function()
      local c = db:counter("a", { shards = 16, policy = "round_robin" })
      for i = 1, 40 do c:incr(i) end
      assert.is_true(c:reshard(1))
      assert.same({ 820 }, c:shards())
      assert.is_true(c:reshard(3))
      assert.equal(820, c:value())
    end)

    it("is seen by other handles to the counter", function()
      local c1, c2 = db:counter("a"), db:counter("a")
      c1:incr(9)
      c1:reshard(2)
      assert.equal(2, c2:info().shards)
      assert.equal(2, #c2:shards())
      assert.equal("tally.counter 'a' (2 auto shards, thread)", tostring(c2))
      c2:incr(1)
      assert.equal(10, c1:value())
      assert.same({ name = "a", shards = 2, policy = "thread", auto = true, grown = 0, shrunk = 0 },
                  plain(db:counter("a", { shards = 2 }):info()))
    end)

    it("raises on a bad shard count", function()
      local c = db:counter("a")
      local msg = "bad argument #1 to 'reshard' (shards must be an integer from 1 to 1024, got %s)"
      assert.equal(msg:format("0"), err(function() c:reshard(0) end))
      assert.equal(msg:format("1025"), err(function() c:reshard(1025) end))
      assert.equal(msg:format("2.5"), err(function() c:reshard(2.5) end))
      assert.equal(msg:format("no value"), err(function() c:reshard() end))
      assert.equal(1, c:info().shards)
    end)
  end)

  describe(":info()", function()
    it("returns name, shards and policy", function()
      assert.same({ name = "p:1", shards = 3, policy = "round_robin" },
                  plain(db:counter("p:1", { shards = 3, policy = "round_robin" }):info()))
      assert.equal("a", db:counter("a"):name())
    end)
  end)

  describe(":close()", function()
    it("is idempotent and makes the handle unusable", function()
      local c = db:counter("a")
      c:incr(2)
      c:close()
      c:close()
      assert.equal("tally.counter (closed)", tostring(c))
      for _, m in ipairs({ "incr", "decr", "value", "shards", "reset", "info", "name" }) do
        assert.equal("attempt to use a closed counter", err(c[m], c))
      end
      assert.equal("attempt to use a closed counter", err(c.reshard, c, 2))
      assert.equal(2, db:value("a"))             -- the counter itself stays
    end)

    it("does not disturb db:incr() on the same name", function()
      local c = db:counter("a")
      db:incr("a")
      c:close()
      assert.is_true(db:incr("a"))
      assert.equal(2, db:value("a"))
    end)

    it("happens at the end of a <close> block", function()
      local outer
      do
        local c <close> = db:counter("a")
        outer = c
        c:incr()
      end
      assert.equal("tally.counter (closed)", tostring(outer))
      assert.equal(1, db:value("a"))
    end)

    it("happens when the handle is collected", function()
      for _ = 1, 1000 do db:counter("a"):incr() end
      collectgarbage(); collectgarbage()
      assert.equal(1000, db:value("a"))
    end)
  end)

  describe("__tostring", function()
    it("shows name, shards and policy", function()
      assert.equal("tally.counter 'x' (1 auto shards, thread)", tostring(db:counter("x")))
      assert.equal("tally.counter 'y' (4 shards, key)",
                   tostring(db:counter("y", { shards = 4, policy = "key" })))
      assert.equal("tally.counter 'z' (2 shards, function)",
                   tostring(db:counter("z", { shards = 2, policy = function() return 1 end })))
    end)
  end)

  describe(":_nop()", function()
    it("does nothing and returns nothing", function()
      local c = db:counter("a")
      assert.equal(0, select("#", c:_nop()))
      assert.equal(0, select("#", c:_nop(1, 2, 3)))
      assert.equal(0, c:value())
    end)
  end)
end)
