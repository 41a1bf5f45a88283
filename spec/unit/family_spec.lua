-- Counter families: options by name pattern, and aggregation over patterns.
local helper = require "spec.support.helper"
local tally = require "tally"

-- c:info() less its incarnation (random per creation), which must be there.
local function plain(info)
  assert.matches("^" .. ("%x"):rep(16) .. "$", info.incarnation)
  info.incarnation = nil
  return info
end

local err, nonzero = helper.err, helper.nonzero

describe("tally.store", function()
  local db
  before_each(function() db = assert(tally.open()) end)
  after_each(function() db:close() end)

  describe(":family()", function()
    it("gives its options to counters created under the pattern", function()
      assert.is_true(db:family("post:*:likes", { shards = 8, policy = "random" }))
      assert.same({ name = "post:1:likes", shards = 8, policy = "random" },
                  plain(db:counter("post:1:likes"):info()))
      db:incr("post:2:likes")
      assert.same({ name = "post:2:likes", shards = 8, policy = "random" },
                  plain(db:counter("post:2:likes"):info()))
      assert.same({ name = "post:1:views", shards = 1, policy = "thread", auto = true, grown = 0, shrunk = 0 },
                  plain(db:counter("post:1:views"):info()))
    end)

    it("fills options left out with the defaults", function()
      db:family("a:*", { shards = 4 })
      db:family("b:*", { policy = "round_robin" })
      db:family("c:*")
      assert.same({ name = "a:1", shards = 4, policy = "thread" }, plain(db:counter("a:1"):info()))
      assert.same({ name = "b:1", shards = 1, policy = "round_robin", auto = true, grown = 0, shrunk = 0 }, plain(db:counter("b:1"):info()))
      assert.same({ name = "c:1", shards = 1, policy = "thread", auto = true, grown = 0, shrunk = 0 }, plain(db:counter("c:1"):info()))
    end)

    it("lets options given to db:counter() win over the family's", function()
      db:family("a:*", { shards = 4, policy = "random" })
      assert.same({ name = "a:1", shards = 2, policy = "random" },
                  plain(db:counter("a:1", { shards = 2 }):info()))
    end)

    it("uses the most recently defined matching family", function()
      db:family("post:*", { shards = 2 })
      db:family("post:*:likes", { shards = 3 })
      assert.equal(3, db:counter("post:1:likes"):info().shards)
      assert.equal(2, db:counter("post:1:views"):info().shards)
      db:family("post:*", { shards = 5 })       -- redefined: now the latest
      assert.equal(5, db:counter("post:2:likes"):info().shards)
    end)

    it("does not change counters that already exist", function()
      db:incr("x:1", 4)
      db:family("x:*", { shards = 2 })
      assert.equal(1, db:counter("x:1"):info().shards)
      assert.equal(2, db:counter("x:2"):info().shards)
      assert.equal(4, db:value("x:1"))
    end)

    it("lives in the store, seen by every handle to a file", function()
      local path = helper.tmpfile()
      local a = assert(tally.open("file:" .. path))
      a:family("q:*", { shards = 7, policy = "key" })
      local b = assert(tally.open("file:" .. path))
      assert.same({ name = "q:1", shards = 7, policy = "key" }, plain(b:counter("q:1"):info()))
      local out = helper.tally("-e", ([[
        local db = assert(tally.open("file:%s"))
        local i = db:counter("q:2"):info()
        print(i.shards, i.policy)
      ]]):format(path))
      assert.equal("7\tkey\n", out)
      a:close(); b:close()
    end)

    it("may take space reused below older families, and the file still opens", function()
      -- rollup blocks of dropped counters, reusable once their grace period
      -- is over, then families of every record size up to theirs: some take
      -- a block's space, below the families made before
      local path = helper.tmpfile()
      local f = assert(tally.open("file:" .. path))
      for i = 1, 20 do assert(f:incr("c:" .. i)) end
      f:rollup("c:*", { every = 1, keep = { "1x1s" } })
      local t = tally.now()
      f:tick(t + 1)
      assert(f:family("a:*", { shards = 2 }))
      for i = 1, 20 do assert(f:drop("c:" .. i)) end
      os.execute("sleep 1.1")                          -- the default grace time (1 s)
      for i = 1, 3 do f:tick(t + 2 + i) end
      for len = 1, 64 do assert(f:family(string.rep("b", len) .. "*", { shards = 4 })) end
      assert.is_true(f:check())
      f:close()
      f = assert(tally.open("file:" .. path))
      assert.equal(4, f:counter("bbbbbbbbbbbbbbbbbbbbbbbb:1"):info().shards)
      assert.equal(2, f:counter("a:1"):info().shards)
      f:close()
    end)

    describe("with a function policy", function()
      it("gives the function to counters opened under it", function()
        local seen = {}
        db:family("fn:*", { shards = 4, policy = function(n, key)
          seen[#seen + 1] = key
          return n
        end })
        local c = db:counter("fn:1")
        assert.same({ name = "fn:1", shards = 4, policy = "function" }, plain(c:info()))
        c:incr(1, "k1")
        db:incr("fn:2", 2, "k2")
        assert.same({ 0, 0, 0, 1 }, c:shards())
        assert.same({ 0, 0, 0, 2 }, db:counter("fn:2"):shards())
        assert.same({ "k1", "k2" }, seen)
      end)

      it("uses the most recently defined matching function", function()
        db:family("fn:*", { shards = 4, policy = function() return 1 end })
        db:family("fn:x:*", { shards = 4, policy = function() return 2 end })
        db:incr("fn:x:1")
        db:incr("fn:y")
        assert.same({ 0, 1, 0, 0 }, db:counter("fn:x:1"):shards())
        assert.same({ 1, 0, 0, 0 }, db:counter("fn:y"):shards())
      end)

      it("forgets the function when the pattern is redefined without one", function()
        db:family("fn:*", { policy = function() return 1 end })
        db:incr("fn:1")
        db:family("fn:*", { policy = "round_robin" })
        assert.equal("round_robin", db:counter("fn:2"):info().policy)
        local c = db:counter("fn:1")           -- still a function counter
        assert.equal("counter 'fn:1' has a function policy: pass it as policy = function to db:counter",
                     err(function() c:incr() end))
      end)
    end)

    it("raises on a bad pattern", function()
      assert.equal("bad argument #1 to 'family' (string expected, got nil)",
                   err(function() db:family(nil, {}) end))
      assert.equal("bad argument #1 to 'family' (pattern must be 1 to 255 bytes, got 0)",
                   err(function() db:family("", {}) end))
      assert.equal("bad argument #1 to 'family' (pattern must not contain a NUL byte)",
                   err(function() db:family("a\0*", {}) end))
    end)

    it("raises on bad options", function()
      assert.equal("bad argument #2 to 'family' (shards must be an integer from 1 to 1024 or \"auto\", got 0)",
                   err(function() db:family("a:*", { shards = 0 }) end))
      assert.equal("bad argument #2 to 'family' (policy must be one of thread, random, round_robin, key, slot, cpu or a function, got 'x')",
                   err(function() db:family("a:*", { policy = "x" }) end))
      assert.equal("bad argument #2 to 'family' (unknown option 'every')",
                   err(function() db:family("a:*", { every = 10 }) end))
      assert.equal("bad argument #2 to 'family' (table expected, got number)",
                   err(function() db:family("a:*", 16) end))
      assert.equal(1, db:counter("a:1"):info().shards)
    end)

    it("takes the slot policy's options as db:counter does", function()
      local ok, msg, code = db:family("s:*", { policy = "slot", shards = 4 })
      assert.same({ nil, "the slot policy has one shard per writer slot: 64 shards, not 4", "ESHARDS" },
                  { ok, msg, code })
      assert.same({ nil, msg, code }, { db:counter("t", { policy = "slot", shards = 4 }) })
      assert.is_true(db:family("s:*", { policy = "slot", shards = "auto" }))   -- its own shards
      local info = db:counter("s:1"):info()
      assert.equal("slot", info.policy)
      assert.equal(64, info.shards)
      assert.equal(64, db:counter("u", { policy = "slot", shards = "auto" }):info().shards)
    end)
  end)

  describe(":sum() over a family", function()
    it("is exact across counters and shards", function()
      db:family("post:*:likes", { shards = 8, policy = "round_robin" })
      for p = 1, 10 do
        for _ = 1, p do db:incr("post:" .. p .. ":likes") end
      end
      db:incr("post:1:views", 1000)
      assert.same({ 55, 10 }, { db:sum("post:*:likes") })
      assert.equal(8, nonzero(db:counter("post:10:likes"):shards()))
    end)
  end)

  describe(":top()", function()
    it("lists the largest matching counters first, ties by name", function()
      db:incr("a", 5); db:incr("b", 9); db:incr("c", 1); db:incr("d", 9); db:incr("xx", 100)
      assert.same({ { name = "b", value = 9 }, { name = "d", value = 9 }, { name = "a", value = 5 } },
                  db:top(3, "?"))
      assert.equal(5, #db:top(10))
      assert.same({ name = "xx", value = 100 }, db:top(1)[1])
      assert.same({}, db:top(0))
    end)

    it("returns every counter for a count as large as math.maxinteger", function()
      -- in a child process with a time limit: the overflowing loop never returned
      local out, code = helper.sh("timeout 10 " .. helper.q(helper.bin) .. " -e "
        .. helper.q([[
          local db = tally.open()
          db:incr("a", 5); db:incr("b", 9); db:incr("c", 1)
          for _, n in ipairs({ math.maxinteger, math.maxinteger - 1, 3, 4 }) do
            local t = {}
            for i, r in ipairs(db:top(n)) do t[i] = r.name .. "=" .. r.value end
            print(table.concat(t, " "))
          end
          print(#db:top("*", math.maxinteger, "rate"), #db:top(math.maxinteger, "x*"))
        ]]))
      assert.equal(0, code, out)
      assert.equal("b=9 a=5 c=1\nb=9 a=5 c=1\nb=9 a=5 c=1\nb=9 a=5 c=1\n3\t0\n", out)
    end)

    it("raises on a bad count", function()
      assert.matches("bad argument #1 to 'top' %(non%-negative integer expected, got %-1%)",
                     err(function() db:top(-1) end))
    end)
  end)

  describe(":values()", function()
    it("maps matching names to values", function()
      db:incr("a:1", 2); db:incr("a:2", 3); db:incr("b", 4)
      assert.same({ ["a:1"] = 2, ["a:2"] = 3 }, db:values("a:*"))
    end)
  end)
end)
