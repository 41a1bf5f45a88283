-- spec/support/flush_contract.lua: what every db:flush_to backend keeps
-- (lua/tally/flush.lua: one frame, one protocol), as one set of cases that
-- redis_spec.lua and firestore_spec.lua run against their remote:
--
--   require("spec.support.flush_contract")(remote, { describe = describe,
--                                                    it = it, assert = assert })
--
--   remote.uri()              the URI of a live remote
--   remote.name(prefix)       a counter name under prefix no other case uses
--   remote.lose(name, writer) take what writer flushed of name out of the
--                             remote, marker included, as a write a failover
--                             lost would
--   remote.opts               options every flush_to of the cases adds
--
-- The second argument is the spec's describe, it and assert (busted gives
-- them to the spec file, not to modules it requires).
local helper = require "spec.support.helper"
local tally = require "tally"

return function(remote, bt)
  local describe, it, assert = bt.describe, bt.it, bt.assert
  local function flush_to(db, opts)
    local o = {}
    for k, v in pairs(remote.opts or {}) do o[k] = v end
    for k, v in pairs(opts or {}) do o[k] = v end
    return db:flush_to(remote.uri(), o)
  end

  -- upkeep at t seconds, then 10 s later: what is idle 10 s expires
  local function upkeep(db, t)
    db:maintain(t * 1000)
    return db:maintain((t + 10) * 1000)
  end

  describe("the flush protocol (" .. remote.kind .. ")", function()
    it("counts every increment once, across a schedule made again", function()
      local db = assert(tally.open("file:" .. helper.tmpfile()))
      local a, b = remote.name("once"), remote.name("once")
      local rf = flush_to(db, { writer = "w-once" })
      db:incr(a, 3)
      db:incr(b, 4)
      assert(rf:sync(10))
      assert.equal(3, rf:remote_value(a))
      db:incr(a, 2)
      rf:close()
      rf = flush_to(db, { writer = "w-once" })   -- a restart: it knows no marker
      assert(rf:sync(10))
      assert(rf:sync(10))                          -- and nothing twice
      assert.equal(5, rf:remote_value(a))
      assert.equal(4, rf:remote_value(b))
      rf:close()
      db:close()
    end)

    it("counts a counter dropped and made again from 0", function()
      local db = assert(tally.open("file:" .. helper.tmpfile()))
      local a = remote.name("again")
      local rf = flush_to(db, { writer = "w-again" })
      db:incr(a, 5)
      assert(rf:sync(10))
      assert(db:drop(a))
      db:incr(a, 3)                                -- a new incarnation
      assert(rf:sync(10))
      assert.equal(8, rf:remote_value(a))
      rf:close()
      db:close()
    end)

    it("lets a counter expire only once its final value is in the remote", function()
      local db = assert(tally.open("file:" .. helper.tmpfile()))
      local prefix = remote.name("exp")
      local a = prefix .. ":a"
      db:family(prefix .. ":*", { idle = 10 })
      local rf = flush_to(db, { writer = "w-exp" })
      assert(rf:sync(10))                          -- registered: its counters are held
      db:incr(a, 3)
      upkeep(db, 1000)
      assert.same({ a }, db:names(prefix .. ":*"))  -- 3 not in the remote yet
      assert(rf:sync(10))
      upkeep(db, 2000)
      assert.same({}, db:names(prefix .. ":*"))
      assert.equal(3, rf:remote_value(a))
      rf:close()
      db:close()
    end)

    it("reads every marker again on verify and resends what the remote lost", function()
      local db = assert(tally.open("file:" .. helper.tmpfile()))
      local a = remote.name("lost")
      local rf = flush_to(db, { writer = "w-lost" })
      db:incr(a, 6)
      assert(rf:sync(10))
      remote.lose(a, "w-lost")
      assert(rf:sync(10))
      assert.equal(0, rf:remote_value(a))          -- what it knows: nothing to send
      rf:verify()
      assert(rf:sync(10))
      assert.equal(6, rf:remote_value(a))
      rf:close()
      db:close()
    end)

    it("takes the same options and says the same of bad ones", function()
      local db = tally.open("memory")
      local function err(opts) return helper.err(flush_to, db, opts) end
      assert.matches("unknown option 'bogus'; expected every, pattern, shards, writer, timeout, ",
                     err({ bogus = 1 }), 1, true)
      assert.matches("every must be from 0.001 s to 366 days, got 0", err({ every = 0 }), 1, true)
      assert.matches("shards must be an integer from 1 to", err({ shards = 1.5 }), 1, true)
      assert.matches("timeout must be a number from 0.001 to 86400", err({ timeout = 0 }), 1, true)
      assert.matches("writer must be a string of 1 to 128 bytes", err({ writer = "" }), 1, true)
      assert.matches("pattern must be a non-empty string", err({ pattern = "" }), 1, true)
      -- the caller's line is the one blamed
      local line = debug.getinfo(1, "l").currentline + 1
      local function call() local s = db:flush_to(remote.uri(), { every = 0 }) return s end
      local _, e = pcall(call)
      assert.matches("flush_contract.lua:" .. line .. ": bad argument #2 to 'flush_to'", e, 1, true)
      local rf = flush_to(db, { writer = "dup" })
      assert.matches("already flushes '*' as writer 'dup'", err({ writer = "dup" }), 1, true)
      assert.equal("tally.flush_to", tostring(rf):match("^tally%.flush_to"))
      rf:close()
      assert.matches("closed flush schedule", helper.err(rf.flush_now, rf), 1, true)
      assert.same({}, db:tick(1e6))                -- closed: no longer scheduled
      db:close()
    end)
  end)
end
