-- Batches and snapshots from Lua: db:batch, db:incr_many, db:snapshot and
-- counters of policy "slot" (src/core/batch.c; the C test test_batch holds
-- threads, processes and SIGKILL).
local helper = require "spec.support.helper"
local tally = require "tally"

describe("slot counters", function()
  it("have one shard per writer slot and refuse what would pick a shard", function()
    local db = tally.open()
    local c = db:counter("s", { policy = "slot" })
    assert.same({ 64, "slot" }, { c:info().shards, c:info().policy })
    assert.is_true(c:incr(5))
    assert.is_true(c:decr(2))
    assert.equal(3, c:value())
    assert.equal(3, helper.sum(c:shards()))           -- all in this thread's shard
    assert.equal(1, helper.nonzero(c:shards()))
    assert.same({ nil, "counter 's' has the slot policy: one shard per writer", "EPOLICY" },
                { c:reshard(4) })
    assert.same({ nil, "the slot policy has one shard per writer slot: 64 shards, not 16",
                  "ESHARDS" }, { db:counter("t", { policy = "slot", shards = 16 }) })
    -- the same counter opened again, with no shard count or "auto"
    assert.equal(3, db:counter("s", { policy = "slot", shards = "auto" }):value())
    assert.equal(3, db:counter("s"):value())
    assert.same({ "thread", "random", "round_robin", "key", "slot" }, tally.policies)
    db:close()
  end)
end)

describe("tally.store:batch and :incr_many", function()
  it("add to several slot counters at once, by handle or by name", function()
    local db = tally.open()
    local a = db:counter("a", { policy = "slot" })
    assert.is_true(db:batch(function(b)
      b:incr(a, 2)
      b:incr("b", 3)       -- created as a slot counter
      b:decr("c")
      b:incr(a)            -- a counter named twice gets both
    end))
    assert.same({ a = 3, b = 3, c = -1 }, db:snapshot())
    assert.equal("slot", db:counter("b"):info().policy)
    assert.is_true(db:incr_many{ { a }, { "b", 10 }, { "c", -1 } })
    assert.same({ a = 4, b = 13, c = -2 }, db:snapshot())
    assert.is_true(db:batch(function() end))          -- nothing to add
    db:close()
  end)

  it("sum the entries of one counter named through several handles or by name", function()
    local db = tally.open()
    local a = db:counter("a", { policy = "slot" })
    local a2 = db:counter("a", { policy = "slot" })     -- another handle, one cell
    assert.is_true(db:batch(function(b) b:incr(a, 1); b:incr(a2, 100) end))
    assert.equal(101, a:value())
    assert.is_true(db:incr_many{ { "b", 10 }, { "b", 5 } })
    assert.equal(15, db:value("b"))
    assert.is_true(db:incr_many{ { a, 1 }, { "a", 2 }, { a2, 3 } })
    assert.equal(107, a:value())
    db:close()
  end)

  it("subtract in b:decr as c:decr does, after the same checks", function()
    local db = tally.open()
    local a = db:counter("a", { policy = "slot" })
    assert.is_true(db:batch(function(b) b:decr(a, "5"); b:decr(a, 2); b:decr(a) end))
    assert.equal(-8, a:value())
    assert.is_true(a:decr("5"))
    assert.equal(-13, a:value())
    -- what c:decr refuses, b:decr refuses, and the batch adds nothing
    assert.has_error(function() db:batch(function(b) b:incr(a, 1); b:decr(a, 1.5) end) end)
    local ok, msg, code = db:batch(function(b) b:decr(a, math.mininteger) end)
    assert.same({ nil, "counter 'a': subtracting -2^63 would overflow", "ERANGE" },
                { ok, msg, code })
    -- (under LuaJIT: spec/luajit/int64_ljspec.lua)
    assert.equal(-13, a:value())
    -- a name whose slot counter cannot be had (a capped family's overflow
    -- counter of another policy stands in for it) raises, as db:counter
    -- does, and the batch adds nothing
    db:family("q:*", { max_counters = 1 })
    db:incr("q:a")
    db:incr("q:b")                                     -- q:_overflow, policy thread
    local why = "counter 'q:c' falls under a family at its cap (max_counters), whose overflow "
                .. "counter exists with other options"
    assert.matches(why, helper.err(db.batch, db, function(b) b:incr(a, 1); b:incr("q:c", 1) end),
                   1, true)
    assert.matches(why, helper.err(db.incr_many, db, { { a, 1 }, { "q:c", 1 } }), 1, true)
    assert.matches(why, helper.err(db.counter, db, "q:c", { policy = "slot" }), 1, true)
    assert.equal(-13, a:value())
    assert.equal(1, db:value("q:_overflow"))
    db:close()
  end)

  it("add nothing when the function raises or any entry is refused", function()
    local db = tally.open()
    local a = db:counter("a", { policy = "slot" })
    local plain = db:counter("plain")
    assert.has_error(function() db:batch(function(b) b:incr(a, 5); error("boom") end) end)
    assert.equal(0, a:value())
    local ok, msg, code = db:incr_many{ { a, 1 }, { plain, 1 } }
    assert.same({ nil, "counter 'plain' has the thread policy: only slot counters can be batched",
                  "EPOLICY" }, { ok, msg, code })
    ok, msg, code = db:incr_many{ { a, 1 }, { "b", 2 ^ 62 } }
    assert.is_nil(ok)
    assert.equal("ERANGE", code)
    assert.same({ 0, 0, 0 }, { a:value(), plain:value(), db:value("b") })
    local many = {}
    for i = 1, 65 do many[i] = { "m" .. i } end
    ok, msg, code = db:incr_many(many)
    assert.same({ nil, "a batch holds at most 64 counters", "EINVAL" }, { ok, msg, code })
    many[65] = nil
    assert.is_true(db:incr_many(many))
    assert.equal(64, db:sum("m*"))
    db:close()
  end)

  it("raise on misuse", function()
    local db = tally.open()
    local other = tally.open()
    local theirs = other:counter("x", { policy = "slot" })
    assert.equal("bad argument #2 to 'incr_many' (table expected, got nil)",
                 helper.err(db.incr_many, db))
    assert.equal("bad argument #2 to 'incr_many' (entry 1 must be { counter_or_name [, n] }, got 3)",
                 helper.err(db.incr_many, db, { 3 }))
    assert.equal("bad argument #2 to 'batch' (function expected, got 'x')",
                 helper.err(db.batch, db, "x"))
    assert.matches("belongs to another store", helper.err(db.incr_many, db, { { theirs } }))
    -- a bad n is refused where it is given, naming that call and argument,
    -- before a name is opened (b:incr(c, n): c is #1, n #2, as in db:incr)
    assert.equal("bad argument #2 to 'incr_many' (entry 1: number has no integer representation)",
                 helper.err(db.incr_many, db, { { "n", 1.5 } }))
    assert.equal("bad argument #2 to 'incr_many' (entry 2: number expected, got table)",
                 helper.err(db.incr_many, db, { { "n" }, { "n", {} } }))
    assert.equal("bad argument #2 to 'incr' (number has no integer representation)",
                 helper.err(db.batch, db, function(b) b:incr("n", 0.5) end))
    assert.equal("bad argument #2 to 'decr' (number expected, got boolean)",
                 helper.err(db.batch, db, function(b) b:decr("n", true) end))
    local ok, msg = pcall(db.batch, db, function(b)
      b:incr("n", "x") -- this line
    end)
    assert.is_false(ok)
    assert.matches("batch_spec.lua:" .. debug.getinfo(1, "l").currentline - 3 .. ": bad argument #2 "
                   .. "to 'incr' (number expected, got string)", msg, 1, true)
    assert.same({}, db:names("n"))
    -- core.batch itself names the list entry (not a stack position)
    assert.equal("entry 2: number has no integer representation",
                 helper.err(require("tally.core").batch, db, { db:counter("s", { policy = "slot" }),
                                                             db:counter("s", { policy = "slot" }) },
                            { 1, 2.5 }):match("%((.*)%)$"))
    assert.matches("counter or name expected, got true",
                   helper.err(db.batch, db, function(b) b:incr(true) end))
    local list = {}
    for i = 1, 1025 do list[i] = { "s" .. i % 10 } end
    assert.matches("at most 1024 entries in a batch, got 1025", helper.err(db.incr_many, db, list),
                   1, true)
    db:close()
    other:close()
  end)
end)

describe("tally.store:snapshot", function()
  it("holds slot and other counters, filtered by a pattern", function()
    local db = tally.open()
    db:incr("plain", 7)
    db:incr_many{ { "h:a", 1 }, { "h:b", 2 } }
    assert.same({ plain = 7, ["h:a"] = 1, ["h:b"] = 2 }, db:snapshot())
    assert.same({ ["h:a"] = 1, ["h:b"] = 2 }, db:snapshot("h:*"))
    assert.same({}, db:snapshot("none*"))
    db:drop("h:a")
    assert.same({ ["h:b"] = 2 }, db:snapshot("h:*"))
    db:close()
  end)
end)

describe("slot counters in export and import", function()
  it("round-trip, the importer adding the difference in its own shard", function()
    local db = tally.open()
    db:incr_many{ { "h:a", 5 }, { "h:b", 7 } }
    local json = assert(db:export("h:*"))
    assert.matches('"policy":"slot"', json)
    local other = tally.open()
    assert.equal(2, other:import(json))
    assert.same({ ["h:a"] = 5, ["h:b"] = 7 }, other:snapshot())
    assert.equal("slot", other:counter("h:a"):info().policy)
    assert.equal(2, other:import(json))                    -- replace: no change
    assert.same({ ["h:a"] = 5, ["h:b"] = 7 }, other:snapshot())
    assert.equal(2, other:import(json, { mode = "add" }))
    assert.same({ ["h:a"] = 10, ["h:b"] = 14 }, other:snapshot())
    db:close()
    other:close()
  end)

  -- a document of a slot counter with 64 shards of the given counts
  local function slot_doc(counts)
    local shards = {}
    for i = 0, 63 do
      shards[#shards + 1] = string.format('"%d":{"count":"%s"}', i, counts[i + 1] or "0")
    end
    return '{"counters":{"s":{"num_shards":64,"policy":"slot","shards":{'
           .. table.concat(shards, ",") .. "}}}}"
  end

  it("refuse counts that add up beyond a shard, before anything changes", function()
    local db = tally.open()
    local max = "4611686018427387903"                     -- 2^62 - 1
    for _, counts in ipairs({ { max, max, max, max }, { max, "1" } }) do
      local ok, msg = pcall(db.import, db, slot_doc(counts))
      assert.is_false(ok)
      assert.matches("counter 's': the counts of a slot counter add up beyond a shard's range",
                     tostring(msg), 1, true)
      assert.same({}, db:names())
    end
    -- what fits is added whole, even when a part of the way is beyond
    assert.equal(1, db:import(slot_doc({ max, max, "-" .. max, "-" .. max, "6" })))
    assert.equal(6, db:value("s"))
    -- replace: the difference with what is there must fit too; else undone
    db:incr_many{ { "s", -4611686018427387000 } }
    local ok, msg, code = db:import(slot_doc({ max }))
    assert.same({ nil, "ERANGE" }, { ok, code })
    assert.matches("beyond a shard's range", msg, 1, true)
    assert.equal(6 - 4611686018427387000, db:value("s"))
    local bad = '{"counters":{"t":{"num_shards":2,"policy":"slot","shards":{'
                .. '"0":{"count":1},"1":{"count":2}}}}}'
    assert.matches("num_shards is 2, but a slot counter has 64 (one per writer slot)",
                   tostring(select(2, pcall(db.import, db, bad))), 1, true)
    db:close()
  end)
end)
