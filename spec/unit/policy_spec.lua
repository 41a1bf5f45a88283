-- Shard policies: which shard an increment lands on.
local helper = require "spec.support.helper"
local tally = require "tally"

local err, sum, nonzero = helper.err, helper.sum, helper.nonzero

describe("tally policies", function()
  local db
  before_each(function() db = assert(tally.open()) end)
  after_each(function() db:close() end)

  describe("thread", function()
    it("keeps one thread to one shard", function()
      local c = db:counter("t", { shards = 16, policy = "thread" })
      for _ = 1, 1000 do c:incr() end
      local s = c:shards()
      assert.equal(1, nonzero(s))
      assert.equal(1000, sum(s))
    end)
  end)

  describe("random", function()
    it("spreads increments over the shards", function()
      local c = db:counter("r", { shards = 16, policy = "random" })
      for _ = 1, 3200 do c:incr() end
      local s = c:shards()
      assert.equal(3200, sum(s))
      -- 200 per shard on average: an empty shard has odds ~16 * e^-200
      assert.equal(16, nonzero(s))
    end)
  end)

  describe("round_robin", function()
    it("cycles through the shards", function()
      local c = db:counter("rr", { shards = 16, policy = "round_robin" })
      for _ = 1, 48 do c:incr() end
      local s = c:shards()
      for i = 1, 16 do assert.equal(3, s[i], "shard " .. i) end
    end)
  end)

  describe("key", function()
    it("sends the same key to the same shard", function()
      local c = db:counter("k", { shards = 64, policy = "key" })
      for _ = 1, 10 do c:incr(1, "user:1") end
      assert.equal(1, nonzero(c:shards()))
      assert.equal(10, c:value())
    end)

    it("spreads different keys", function()
      local c = db:counter("k", { shards = 16, policy = "key" })
      for i = 1, 1000 do c:incr(1, "user:" .. i) end
      assert.equal(1000, c:value())
      assert.truthy(nonzero(c:shards()) >= 12)
    end)

    it("puts a key where core.key_shard says, the remote stores' shard", function()
      local key_shard = require("tally.remote").key_shard
      assert.equal(require("tally.core").key_shard, key_shard)
      for _, n in ipairs({ 2, 7, 64, 1000 }) do
        local c = db:counter("ks" .. n, { shards = n, policy = "key" })
        for i = 1, 300 do
          local key = "k" .. string.rep("x", i % 19) .. i   -- every tail length
          c:incr(i, key)
          local s = c:shards()
          assert.equal(i, s[key_shard(key, n)], key)
          c:decr(i, key)
        end
      end
      assert.error_matches(function() key_shard("a", 0) end, "shard count out of range")
    end)

    it("names a remote shard's Redis key by the flusher's rule, for the Redis store too", function()
      local shard_key = require("tally.core").redis_shard_key
      assert.equal("tally:{post:1:likes#0}", shard_key("post:1:likes", 0))
      assert.equal("tally:{a}b#63}", shard_key("a}b", 63))
      assert.equal("tally:{" .. string.rep("n", 255) .. "#4294967295}",
                   shard_key(string.rep("n", 255), 4294967295))
      assert.error_matches(function() shard_key("", 0) end, "a counter name is 1 to 255 bytes")
      assert.error_matches(function() shard_key("a", -1) end, "shard index out of range")
    end)

    it("treats a number key as its string", function()
      local c = db:counter("k", { shards = 64, policy = "key" })
      c:incr(1, 12345)
      c:incr(1, "12345")
      c:decr(1, 12345)
      c:incr(5, 12345)
      assert.equal(1, nonzero(c:shards()))
      assert.equal(6, c:value())
    end)

    it("raises without a key", function()
      local c = db:counter("k", { policy = "key" })
      assert.equal("bad argument #2 to 'incr' (key expected for a counter with the key policy)",
                   err(function() c:incr(1) end))
      assert.equal("bad argument #2 to 'incr' (key expected for a counter with the key policy)",
                   err(function() c:incr() end))
      assert.equal("bad argument #2 to 'decr' (key expected for a counter with the key policy)",
                   err(function() c:decr(1, nil) end))
      assert.equal("bad argument #2 to 'incr' (string or number expected, got table)",
                   err(function() c:incr(1, {}) end))
      assert.equal("bad argument #3 to 'incr' (key expected for a counter with the key policy)",
                   err(function() db:incr("k", 1) end))
      assert.equal(0, c:value())
    end)

    it("takes the key through db:incr()", function()
      db:counter("k", { shards = 8, policy = "key" })
      for _ = 1, 5 do db:incr("k", 2, "same") end
      db:decr("k", 1, "same")
      assert.equal(9, db:value("k"))
      assert.equal(1, nonzero(db:counter("k"):shards()))
    end)

    it("creates nothing by name when the key is missing or of a wrong type", function()
      db:family("kp:*", { shards = 4, policy = "key" })
      assert.matches("key expected for a counter with the key policy",
                     helper.err(db.incr, db, "kp:1", 5), 1, true)
      assert.matches("string or number expected, got table",
                     helper.err(db.incr, db, "kp:1", 5, {}), 1, true)
      assert.matches("string or number expected, got boolean",
                     helper.err(db.decr, db, "kp:1", 5, true), 1, true)
      assert.same({ nil, "no such counter 'kp:1'", "ENOENT" }, { db:value("kp:1") })
      assert.is_true(db:incr("kp:1", 5, "a"))
      assert.equal(5, db:value("kp:1"))
    end)
  end)

  describe("cpu", function()
    -- shards: 1 for resets, P for the thread policy's path, P one per CPU
    local function parts(s)
      local p = (#s - 1) // 2
      local fallback, percpu = 0, 0
      for i = 2, p + 1 do fallback = fallback + s[i] end
      for i = p + 2, #s do percpu = percpu + s[i] end
      return fallback, percpu
    end

    it("says in info() whether its adds run as restartable sequences", function()
      local c = db:counter("cpu", { policy = "cpu" })
      local info = c:info()
      assert.equal("cpu", info.policy)
      assert.is_boolean(info.rseq)
      local tunables = os.getenv("GLIBC_TUNABLES") or ""
      if tunables:find("glibc.pthread.rseq=0", 1, true) then assert.is_false(info.rseq) end
      assert.equal(1, info.shards % 2)
      assert.is_true(info.shards >= 3)
      assert.is_nil(info.auto)
      for _ = 1, 1000 do c:incr() end
      c:decr(10)
      assert.equal(990, c:value())
      local fallback, percpu = parts(c:shards())
      -- the path info() names is the one the adds took (but the first on
      -- each CPU, which notes the CPU in the store on the thread path)
      assert.equal(990, fallback + percpu)
      if info.rseq then
        assert.is_true(fallback <= (info.shards - 1) // 2, fallback .. " on the thread path")
      else
        assert.equal(0, percpu)
      end
    end)

    it("resets exactly and keeps counting", function()
      local c = db:counter("cpu", { policy = "cpu" })
      for _ = 1, 100 do c:incr(3) end
      assert.equal(300, c:reset())
      assert.equal(0, c:value())
      c:incr(7)
      db:incr("cpu", 2)
      assert.equal(9, c:value())
      assert.equal(9, c:reset())
    end)

    it("has the shard count of the machine, and no other", function()
      local n = db:counter("cpu", { policy = "cpu" }):info().shards
      assert.equal(n, db:counter("cpu2", { policy = "cpu", shards = "auto" }):info().shards)
      assert.same({ nil, "the cpu policy has " .. n .. " shards here, not 16", "ESHARDS" },
                  { db:counter("cpu3", { policy = "cpu", shards = 16 }) })
    end)

    it("refuses a reshard and keys", function()
      local c = db:counter("cpu", { policy = "cpu" })
      assert.same({ nil, "counter 'cpu' has the cpu policy: one shard per CPU", "EPOLICY" },
                  { c:reshard(4) })
    end)

    -- an export from a machine of 1 CPU (3 shards) or 4 (9 shards)
    local function doc(name, counts)
      local shards = {}
      for i, v in ipairs(counts) do shards[i] = ('"%d":{"count":%d}'):format(i - 1, v) end
      return ('{"counters":{"%s":{"num_shards":%d,"policy":"cpu","shards":{%s}}}}\n')
             :format(name, #counts, table.concat(shards, ","))
    end

    it("imports another machine's counters whole, whatever its CPUs", function()
      local n = db:counter("cpu", { policy = "cpu" }):info().shards
      for _, counts in ipairs({ { -5, 2, 10 }, { 0, 1, 2, 3, 4, 5, 6, 7, 8 } }) do
        local want = 0
        for _, v in ipairs(counts) do want = want + v end
        local text = doc("m" .. #counts, counts)
        assert.equal(1, db:import(text))                       -- created with n shards
        local c = db:counter("m" .. #counts)
        assert.same({ n, "cpu", want }, { c:info().shards, c:info().policy, c:value() })
        c:incr(4)
        assert.equal(1, db:import(text))                       -- replace: the value again
        assert.equal(want, c:value())
        assert.equal(1, db:import(text, { mode = "add" }))
        assert.equal(2 * want, c:value())
        local back = db:export("m" .. #counts)                 -- and out again, with n
        assert.matches('"num_shards":' .. n .. ',"policy":"cpu"', back, 1, true)
      end
    end)

    it("applies to a family's counters", function()
      db:family("pc:*", { policy = "cpu" })
      db:incr("pc:1", 5)
      assert.equal("cpu", db:counter("pc:1"):info().policy)
      assert.equal(5, db:value("pc:1"))
    end)
  end)

  describe("function", function()
    it("is called with the shard count and the key, and picks the shard", function()
      local calls = {}
      local c = db:counter("f", { shards = 4, policy = function(n, key)
        calls[#calls + 1] = { n, key }
        return key
      end })
      c:incr(5, 3)
      c:decr(1, 1)
      assert.same({ -1, 0, 5, 0 }, c:shards())
      assert.same({ { 4, 3 }, { 4, 1 } }, calls)
      assert.equal("function", c:info().policy)
    end)

    it("gets nil as the key when there is none", function()
      local seen = "unset"
      local c = db:counter("f", { shards = 2, policy = function(_, key) seen = key; return 2 end })
      c:incr()
      assert.is_nil(seen)
      assert.same({ 0, 1 }, c:shards())
    end)

    it("sees the new shard count after a reshard", function()
      local last
      local c = db:counter("f", { shards = 2, policy = function(n) last = n; return n end })
      c:incr()
      assert.equal(2, last)
      c:reshard(5)
      assert.equal(1, c:reset())
      c:incr(2)
      assert.equal(5, last)
      assert.same({ 0, 0, 0, 0, 2 }, c:shards())
    end)

    it("raises when it returns something other than a shard number", function()
      local ret
      local c = db:counter("f", { shards = 16, policy = function() return ret end })
      local msg = "policy function for 'f' returned %s (expected an integer from 1 to 16)"
      for _, case in ipairs({ { 0, "0" }, { 17, "17" }, { -1, "-1" }, { 1.5, "1.5" },
                              { "2", "'2'" }, { nil, "nil" }, { {}, "table" } }) do
        ret = case[1]
        assert.equal(msg:format(case[2]), err(function() c:incr() end))
      end
      ret = 16.0
      assert.is_true(c:incr())
      assert.equal(1, c:shards()[16])
      assert.equal(1, c:value())
    end)

    it("passes its errors through", function()
      local c = db:counter("f", { policy = function() error("boom", 0) end })
      assert.equal("boom", err(function() c:incr() end))
      assert.equal(0, c:value())
    end)

    it("is not known to handles opened without it", function()
      db:counter("f", { shards = 4, policy = function() return 1 end }):incr()
      local other = assert(tally.open())
      other:close()
      local c = db:counter("f")
      assert.equal("function", c:info().policy)
      assert.equal("counter 'f' has a function policy: pass it as policy = function to db:counter",
                   err(function() c:incr() end))
      assert.equal(1, c:value())
    end)

    it("is used by db:incr() once db:counter() gave it", function()
      db:counter("f", { shards = 3, policy = function(_, key) return key end })
      db:incr("f", 10, 3)
      db:incr("f", 1, 1)
      assert.same({ 1, 0, 10 }, db:counter("f"):shards())
    end)

    it("raises in db:incr() when the store does not know the function", function()
      local path = helper.tmpfile()
      local a = assert(tally.open("file:" .. path))
      a:counter("f", { policy = function() return 1 end }):incr()
      local b = assert(tally.open("file:" .. path))
      assert.equal("counter 'f' has a function policy: pass it as policy = function to db:counter",
                   err(function() b:incr("f") end))
      assert.equal(1, b:value("f"))
      a:close(); b:close()
    end)

    it("raises when it closes the counter it was called for", function()
      local c
      c = db:counter("f", { policy = function() c:close(); return 1 end })
      assert.equal("attempt to use a closed counter", err(function() c:incr() end))
    end)
  end)
end)
