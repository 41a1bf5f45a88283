-- Cloud Firestore: the firestore:// store and db:flush_to("firestore://...")
-- against Google's Firestore emulator (spec/support/firestore.lua starts
-- one for the whole file; skipped with a message where it is not installed).
local helper = require "spec.support.helper"
local firestore = require "spec.support.firestore"
local tally = require "tally"
local core = require "tally.core"

local WORKER = "spec/support/fixtures/firestore_worker.lua"
local P = "projects/demo-tally/databases/(default)/documents/"

local missing = firestore.missing()
if missing then
  describe("firestore", function() pending(missing) end)
  return
end

local emu
setup(function() emu = firestore.start() end)
teardown(function() if emu then emu.stop() end end)
before_each(function() emu.wipe() end)

local function int(n) return { integerValue = tostring(n) } end

-- The seeds' createCounter, as the Web SDK's batch sends it: one commit
-- setting counters/{ID} = { num_shards } and shards/{i} = { count: 0 }.
local function seeds_create(id, n, field)
  local writes = { { update = { name = P .. "counters/" .. id,
                                fields = { [field or "num_shards"] = int(n) } } } }
  for i = 0, n - 1 do
    writes[#writes + 1] = { update = { name = P .. "counters/" .. id .. "/shards/" .. i,
                                       fields = { count = int(0) } } }
  end
  local st, _, raw = emu.rest("POST", ":commit", { writes = writes })
  assert.equal(200, st, raw)
end

-- The seeds' incrementCounter: a random shard, read and written in a
-- transaction (retried when ABORTED, as the SDKs do).
local function seeds_incr(id, n, by)
  local shard = P .. "counters/" .. id .. "/shards/" .. math.random(0, n - 1)
  for _ = 1, 20 do
    local _, tx = emu.rest("POST", ":beginTransaction", { options = { readWrite = {} } })
    local _, got = emu.rest("POST", ":batchGet", { documents = { shard }, transaction = tx.transaction })
    local cur = got[1].found and tonumber(got[1].found.fields.count.integerValue) or 0
    local st = emu.rest("POST", ":commit", { transaction = tx.transaction, writes = {
      { update = { name = shard, fields = { count = int(cur + by) } } } } })
    if st == 200 then return end
  end
  error("seeds_incr: too many aborts")
end

-- The seeds' getCount: every shard document summed (a batchGet of
-- shards/0..n-1: the ids with ':' cannot go through runQuery's URL).
local function seeds_count(id, n)
  local names = {}
  for i = 0, n - 1 do names[#names + 1] = P .. "counters/" .. id .. "/shards/" .. i end
  local _, got = emu.rest("POST", ":batchGet", { documents = names })
  local sum = 0
  for _, r in ipairs(got) do
    if r.found then sum = sum + math.tointeger(r.found.fields.count.integerValue) end
  end
  return sum
end

local function fields_of(path)
  local _, got = emu.rest("POST", ":batchGet", { documents = { P .. path } })
  return got[1].found and got[1].found.fields
end

describe("tally.open('firestore://...')", function()
  it("creates counters as the seeds' createCounter does, and counts in their shards", function()
    local db = assert(tally.open(emu.uri))
    local c = assert(db:counter("post:42:likes", { shards = 5 }))
    assert.same({ num_shards = int(5) }, fields_of("counters/post:42:likes"))
    for i = 0, 4 do assert.same({ count = int(0) }, fields_of("counters/post:42:likes/shards/" .. i)) end
    for _ = 1, 20 do assert.is_true(c:incr()) end
    assert(c:incr(100))
    assert(c:decr(10))
    assert.equal(110, c:value())
    assert.equal(110, helper.sum(c:shards()))
    assert.equal(110, seeds_count("post:42:likes", 5))
    assert.is_true(helper.nonzero(c:shards()) > 1)       -- random: spread over the shards
    assert.same({ name = "post:42:likes", shards = 5, policy = "random" }, c:info())
    assert.equal(110, db:value("post:42:likes"))
    assert.same({ "post:42:likes" }, db:names("post:*"))
    local again = assert(db:counter("post:42:likes"))
    assert.equal(5, again:info().shards)
    assert.matches("exists with 5 shards", helper.err(db.counter, db, "post:42:likes", { shards = 6 }))
    local none, _, code = db:counter("nope", { create = false })
    assert.is_nil(none)
    assert.equal("ENOENT", code)
    db:close()
    assert.matches("closed store", helper.err(db.value, db, "x"))
  end)

  it("reads and increments counters written by the seeds' code, and the other way round", function()
    seeds_create("post-123-views", 10)
    for _ = 1, 7 do seeds_incr("post-123-views", 10, 1) end
    local db = assert(tally.open(emu.uri))
    local c = assert(db:counter("post-123-views"))
    assert.same({ name = "post-123-views", shards = 10, policy = "random" }, c:info())
    assert.equal(7, c:value())
    for _ = 1, 13 do assert(c:incr()) end
    assert.equal(20, seeds_count("post-123-views", 10))
    -- a counter tally made, incremented by the seeds' transactions
    assert(db:counter("made-by-tally", { shards = 3 }):incr(5))
    seeds_incr("made-by-tally", 3, 2)
    assert.equal(7, db:value("made-by-tally"))
    assert.equal(7, seeds_count("made-by-tally", 3))
    -- a name the local store refuses is refused here too (never flushable)
    assert.matches("name must be 1 to 255 bytes without NUL",
                   helper.err(db.incr, db, "a\0b"), 1, true)
    -- the blog variant's numShards: read by every method, listings too
    seeds_create("blog", 3, "numShards")
    seeds_incr("blog", 3, 5)
    assert.equal(5, db:value("blog"))
    assert.same({ ["blog"] = 5, ["made-by-tally"] = 7, ["post-123-views"] = 20 }, db:values())
    assert.same({ 32, 3 }, { db:sum() })
    db:close()
  end)

  it("escapes names Firestore does not take as ids, and reads them back", function()
    local db = assert(tally.open(emu.uri))
    local names = { "a/b", ".", "..", "__x__", "50%", "%2F", "post:42:likes", "é", "tab\tx" }
    for i, nm in ipairs(names) do
      assert(db:counter(nm, { shards = 2 }))
      assert(db:incr(nm, i))
    end
    for i, nm in ipairs(names) do assert.equal(i, db:value(nm), nm) end
    table.sort(names)
    assert.same(names, db:names())
    assert.truthy(fields_of("counters/a%2Fb"))
    assert.truthy(fields_of("counters/%2E."))
    assert.truthy(fields_of("counters/%5F_x__"))
    assert.truthy(fields_of("counters/50%25"))
    assert.is_true(db:drop("a/b"))
    assert.is_nil(fields_of("counters/a%2Fb"))
    assert.is_nil(fields_of("counters/a%2Fb/shards/0"))
    db:close()
  end)

  it("is exact beyond 2^53 and saturates on int64 overflow as Firestore does", function()
    local db = assert(tally.open(emu.uri))
    local c = assert(db:counter("big", { shards = 1 }))
    assert(c:incr(9007199254740993))
    assert(c:incr(9007199254740993))
    assert.equal(18014398509481986, c:value())
    assert(c:incr(math.maxinteger))
    assert.equal(math.maxinteger, c:value())          -- saturated (Firestore's increment)
    -- not an integer: raised as the C methods raise (no position)
    local ok, msg = pcall(function() local r = c:decr(0.5); return r end)
    assert.is_false(ok)
    assert.equal("bad argument #1 to 'decr' (integer expected, got 0.5)", msg)
    assert.equal(math.maxinteger, c:value())
    db:close()
  end)

  it("says ERANGE for a value, a sum or a reset beyond int64, as the file store", function()
    local db = assert(tally.open(emu.uri))
    local c = assert(db:counter("big", { shards = 2, policy = "round_robin" }))
    assert(c:incr(math.maxinteger))
    assert(c:incr(2))
    local why = "counter 'big': value does not fit in 64 bits"
    assert.same({ nil, why, "ERANGE" }, { c:value() })
    assert.same({ nil, why, "ERANGE" }, { db:value("big") })
    assert.same({ nil, why, "ERANGE" }, { db:values() })
    assert.same({ nil, why, "ERANGE" }, { db:sum() })
    assert.same({ nil, "counter 'big': the amount to remove does not fit in 64 bits; "
                       .. "nothing was removed", "ERANGE" }, { c:reset() })
    local shards = c:shards()
    table.sort(shards)
    assert.same({ 2, math.maxinteger }, shards)   -- nothing removed
    assert(db:drop("big"))
    -- counters each in range, their total not
    assert(db:counter("a", { shards = 1 }):incr(math.maxinteger))
    assert(db:counter("b", { shards = 1 }):incr(1))
    assert.same({ nil, "sum over '?' does not fit in 64 bits", "ERANGE" }, { db:sum("?") })
    db:close()
  end)

  it("checks and answers as the redis store: sum's pattern, info when closed, shards' errors", function()
    local db = assert(tally.open(emu.uri))
    assert.equal("bad argument #1 to 'sum' (string expected, got number)", helper.err(db.sum, db, 42))
    local c = assert(db:counter("odd", { shards = 1 }))
    local st, _, raw = emu.rest("POST", ":commit", { writes = { { update = {
      name = P .. "counters/odd/shards/0", fields = { count = { stringValue = "x" } } } } } })
    assert.equal(200, st, raw)
    local ok, msg, code = c:shards()
    assert.same({ nil, "EPROTO" }, { ok, code })
    assert.matches("counter 'odd' shard 0", msg, 1, true)
    db:close()
    assert.equal("attempt to use a closed store", helper.err(c.info, c))
  end)

  it("resets exactly, and keeps families", function()
    local db = assert(tally.open(emu.uri))
    assert(db:family("user:*", { shards = 3, policy = "round_robin" }))
    local c = assert(db:counter("user:1"))
    assert.same({ name = "user:1", shards = 3, policy = "round_robin" }, c:info())
    for _ = 1, 6 do assert(c:incr()) end
    assert.same({ 2, 2, 2 }, c:shards())
    assert.equal(6, c:reset())
    assert.equal(0, c:value())
    assert.equal(0, c:reset())
    assert(c:incr(4))
    local total, n = db:sum("user:*")
    assert.equal(4, total)
    assert.equal(1, n)
    db:close()
  end)

  it("imports db:export's JSON through the same code path, both ways", function()
    local loc = assert(tally.open())
    loc:counter("a", { shards = 2, policy = "random" }):incr(5)
    loc:counter("b:c", { shards = 3, policy = "random" }):incr(9007199254740993)
    local text = assert(loc:export())
    local db = assert(tally.open(emu.uri))
    assert.equal(2, db:import(text))
    assert.equal(5, db:value("a"))
    assert.equal(9007199254740993, db:value("b:c"))
    assert.equal(text, db:export())
    local back = assert(tally.open())
    assert.equal(2, back:import(assert(db:export())))
    assert.equal(9007199254740993, back:value("b:c"))
    assert.matches("num_shards is 2 but the counter exists with 3",
      helper.err(db.import, db, '{"counters":{"b:c":{"num_shards":2,"shards":{"0":{"count":1},"1":{"count":1}}}}}'))
    db:close()
  end)

  it("returns nil, message, code when nothing listens, and rejects bad URIs", function()
    local db, msg, code = tally.open("firestore://demo-tally?emulator=127.0.0.1:1")
    assert.is_nil(db)
    assert.matches("Firestore", msg)
    assert.equal("ECONNECT", code)
    db, msg, code = tally.open("firestore://?emulator=x")
    assert.is_nil(db)
    assert.equal("EINVAL", code)
    assert.matches("unknown Firestore URI option 'bogus'",
                   select(2, tally.open("firestore://p?bogus=1")))
    -- a database comes after a '/': de_mo is no project "de" and database "_mo"
    for _, bad in ipairs({ "firestore://de_mo", "firestore://demo(x)" }) do
      db, msg, code = tally.open(bad .. "?emulator=127.0.0.1:1")
      assert.same({ nil, "EINVAL" }, { db, code })
      assert.matches("bad Firestore URI", msg, 1, true)
    end
    db, msg, code = tally.open("firestore://demo/_mo?emulator=127.0.0.1:1")
    assert.equal("ECONNECT", code)                     -- parsed: project demo, database _mo
    assert.matches("root must be a collection id, got '.'",
                   select(2, tally.open("firestore://p?root=.")), 1, true)
  end)
end)

describe("db:flush_to('firestore://...')", function()
  local function local_db()
    return assert(tally.open("file:" .. helper.tmpfile()))
  end

  it("says why it backs off, in db:tick() and at the end of ff:sync()", function()
    local db = local_db()
    local ff = db:flush_to("firestore://demo-tally?emulator=127.0.0.1:1",
                           { writer = "w1", backoff = 5, every = 1 })
    db:counter("a"):incr(1)
    local t = 1000
    db:clock(function() return t end)
    local first = db:tick()
    t = t + 1
    local second = db:tick()
    local function flush_of(list) for _, r in ipairs(list) do if r.flush then return r end end end
    assert.equal("error", flush_of(first).status)
    local b = flush_of(second)
    assert.equal("backoff", b.status)                -- not "flushed" with nothing flushed
    assert.matches("connect", b.error)
    assert.is_true(b.waiting > 0)
    local ok, msg, code = ff:sync(0.2)
    assert.is_nil(ok)
    assert.matches("connect", msg)
    assert.equal("ECONNECT", code)
    ff:close()
    db:close()
  end)

  it("flushes exactly once when replies are lost after Firestore applied the commit", function()
    local db = local_db()
    local ff = db:flush_to(emu.uri, { writer = "w1", doc_interval = 0 })
    local h = ff:http()
    local c = db:counter("post:1:likes", { shards = 4 })
    local total = 0
    for round = 1, 12 do
      c:incr(round)
      total = total + round
      h:lose_replies(1)                               -- the commit is applied, its reply lost
      local st = ff:flush_now()
      assert.is_nil(st)
      assert(ff:sync(10))
      assert.equal(total, ff:remote_value("post:1:likes"))
    end
    assert.is_true(h:stats().lost >= 12)
    local s = ff:stats()
    assert.equal(0, s.pending)
    assert.equal(0, s.lag)
    -- the marker and the counter document, in the seeds' layout
    assert.same(int(total), fields_of("counters/post:1:likes/writers/w1").flushed)
    assert.same(int(4), fields_of("counters/post:1:likes").num_shards)
    db:close()
  end)

  it("a replayed commit is rejected whole (the updateTime precondition)", function()
    local db = local_db()
    local ff = db:flush_to(emu.uri, { writer = "w1", doc_interval = 0 })
    db:incr("x", 10)
    assert(ff:sync(10))
    -- replay the same commit body by hand: FAILED_PRECONDITION, nothing counted
    local m = fields_of("counters/x/writers/w1")
    assert.same(int(10), m.flushed)
    local _, got = emu.rest("POST", ":batchGet", { documents = { P .. "counters/x/writers/w1" } })
    local ut = got[1].found.updateTime
    db:incr("x", 1)
    assert(ff:sync(10))
    local st, rep = emu.rest("POST", ":commit", { writes = {
      { transform = { document = P .. "counters/x/shards/0", fieldTransforms = {
        { fieldPath = "count", increment = int(1) } } } },
      { update = { name = P .. "counters/x/writers/w1", fields = { flushed = int(11) } },
        currentDocument = { updateTime = ut } } } })
    assert.equal(400, st)
    assert.equal("FAILED_PRECONDITION", rep.error.status)
    assert.equal(11, ff:remote_value("x"))
    db:close()
  end)

  it("counts once when a commit that timed out lands later (the marker's precondition)", function()
    local db = local_db()
    local ff = db:flush_to(emu.uri, { writer = "w1", doc_interval = 0 })
    db:incr("late", 10)
    assert(ff:sync(10))
    db:incr("late", 5)
    -- the next commit is held back (the client sees a timeout) and lands
    -- just before the flusher's next commit, which was computed from the
    -- marker as it was: that one must be refused, then read back
    local cl, orig, held = ff.cl, ff.cl.call, nil
    cl.call = function(self, method, suffix, body)
      if suffix == ":commit" then
        if not held then
          held = body
          return nil, "Firestore: timed out (held back by the spec)", "ETIMEDOUT"
        elseif held ~= true then
          assert(orig(self, method, suffix, held))   -- the late one is applied
          held = true
        end
      end
      return orig(self, method, suffix, body)
    end
    assert.is_nil(ff:flush_now())
    assert(ff:sync(10))
    assert.equal(true, held)
    assert.is_true(ff:stats().conflicts >= 1)
    assert.equal(15, ff:remote_value("late"))
    db:close()
  end)

  -- Expiry (docs/lifecycle.md) with the flusher: upkeep drops an idle
  -- counter only while its value is the last one marked shipped. A commit
  -- going out may land, so its counter must be held whatever its value
  -- until Firestore's value is known again; a decrement back to the last
  -- mark must not let it expire with Firestore holding the later value.
  describe("holds an idle counter while a commit of it may have landed", function()
    local T = 1700000040                                -- upkeep's made-up clock (s)
    local function upkeep(db, t)
      db:maintain(t * 1000)                             -- notes the value ...
      return db:maintain((t + 10) * 1000)               -- ... idle 10 s later
    end
    local function flushed_at_10(path)
      local db = assert(tally.open("file:" .. path))
      db:family("k:*", { idle = 10 })
      local ff = db:flush_to(emu.uri, { writer = "w1", doc_interval = 0, timeout = 0.5, backoff = 0.01 })
      local c = db:counter("k:1", { shards = 2 })
      c:incr(10)
      assert(ff:sync(10))                               -- Firestore 10, marked shipped at 10
      assert.equal(10, seeds_count("k:1", 2))
      return db, ff, c
    end
    -- ff's next commit is refused for sure (it never reaches Firestore)
    local function refuse_next_commit(ff)
      local cl, orig = ff.cl, ff.cl.call
      cl.call = function(self, method, suffix, body)
        if suffix == ":commit" then
          cl.call = orig
          return nil, "Firestore: refused by the spec", "PERMISSION_DENIED"
        end
        return orig(self, method, suffix, body)
      end
    end
    -- after the fault: held, then flushed back to 10 and expired at 10
    local function settles(db, ff, t)
      upkeep(db, t)
      assert.same({ "k:1" }, db:names("k:*"),          -- on the code before: expired, Firestore 15
                  "expired locally at 10, Firestore holds " .. seeds_count("k:1", 2))
      assert.equal(15, seeds_count("k:1", 2))
      assert(ff:sync(10))
      assert.equal(10, seeds_count("k:1", 2))
      upkeep(db, t + 100)
      assert.same({}, db:names("k:*"))               -- its final value is in Firestore
      assert.equal(10, seeds_count("k:1", 2))
      db:close()
    end

    it("the emulator stopped past the timeout, then applying the commit", function()
      local db, ff, c = flushed_at_10(helper.tmpfile())
      c:incr(5)                                         -- 15
      emu.pause()
      local st, msg, code = ff:flush_now()              -- the commit of 15 goes out, no reply in 0.5 s
      emu.resume()
      assert.is_nil(st)
      assert.equal("ETIMEDOUT", code, msg)
      for _ = 1, 500 do                                 -- java reads the request once it runs again
        if seeds_count("k:1", 2) == 15 then break end
        tally.sleep(0.02)
      end
      assert.equal(15, seeds_count("k:1", 2))
      c:decr(5)                                         -- back to 10, the value last marked
      settles(db, ff, T)
    end)

    it("another process's upkeep while the commit is out (no fault)", function()
      local path = helper.tmpfile()
      local db, ff, c = flushed_at_10(path)
      local other = assert(tally.open("file:" .. path)) -- as another process (an nginx worker)
      c:incr(5)                                         -- 15, read by the round below
      local cl, orig = ff.cl, ff.cl.call
      cl.call = function(self, method, suffix, body)
        if suffix == ":commit" then                     -- sent after this: 15
          cl.call = orig
          other:decr("k:1", 5)                          -- back to 10 ...
          upkeep(other, T)                              -- ... and idle
        end
        return orig(self, method, suffix, body)
      end
      assert(ff:flush_now())
      assert.equal(15, seeds_count("k:1", 2))
      other:close()
      settles(db, ff, T + 1000)
    end)

    it("a commit refused for sure, then the value back to the last mark", function()
      local db, ff, c = flushed_at_10(helper.tmpfile())
      c:incr(5)
      refuse_next_commit(ff)
      assert.is_nil(ff:flush_now())
      c:decr(5)                                         -- 10: Firestore's value, read back below
      assert(ff:sync(10))
      assert.equal(10, seeds_count("k:1", 2))
      upkeep(db, T + 2000)
      assert.same({}, db:names("k:*"))               -- marked again once read back
      db:close()
    end)

    it("a new incarnation's first commit refused for sure, then back to 0", function()
      local db, ff, c = flushed_at_10(helper.tmpfile())
      upkeep(db, T + 2500)
      assert.same({}, db:names("k:*"))               -- expired at 10, Firestore's value
      c:incr(3)                                         -- created again: another incarnation
      refuse_next_commit(ff)
      assert.is_nil(ff:flush_now())
      c:decr(3)                                         -- 0: nothing of it is in Firestore
      assert(ff:sync(10))
      upkeep(db, T + 2600)
      assert.same({}, db:names("k:*"))
      assert.equal(10, seeds_count("k:1", 2))
      db:close()
    end)

    it("sends the value read after the mark, not the one the round began with", function()
      local db, ff, c = flushed_at_10(helper.tmpfile())
      c:incr(5)
      core._test_hook(function(where)                  -- moves between the mark and the commit
        if where == "send" then c:incr(2) end
      end)
      local st = ff:flush_now()
      core._test_hook(nil)
      assert(st)
      assert.equal(17, seeds_count("k:1", 2))           -- one commit: the value after the mark
      upkeep(db, T + 3000)
      assert.same({}, db:names("k:*"))
      db:close()
    end)

    it("a first guess marked unknown, then back to 0 before it is sent", function()
      local db = assert(tally.open("file:" .. helper.tmpfile()))
      db:family("k:*", { idle = 10 })
      local ff = db:flush_to(emu.uri, { writer = "w1", doc_interval = 0 })
      local c = db:counter("k:1", { shards = 2 })
      c:incr(7)                                         -- met first at 7: a first guess
      core._test_hook(function(where)                  -- 0 between the mark and the read after it
        if where == "send" then c:decr(7) end
      end)
      local st = ff:flush_now()
      core._test_hook(nil)
      assert(st)
      assert.equal(0, st.commits)                       -- "back": nothing sent
      assert(ff:sync(10))
      upkeep(db, T + 4000)
      assert.same({}, db:names("k:*"))               -- on the code before: held unknown for good
      assert.equal(0, seeds_count("k:1", 2))
      db:close()
    end)
  end)

  it("resends what a SIGKILLed process left unflushed, once, after restart", function()
    local path = helper.tmpfile()
    local log = helper.tmpfile("worker.log")
    local names = "k:a,k:b,k:c"
    for run = 1, 2 do
      local pid = tonumber((helper.sh(("%s %s %s %s %s 0 w-kill forever >%s 2>&1 </dev/null & echo $!"):format(
        helper.q(helper.bin), WORKER, helper.q(path), helper.q(emu.uri), names, helper.q(log)))))
      for _ = 1, 400 do
        if (helper.slurp(log) or ""):find("ready", 1, true) then break end
        tally.sleep(0.025)
      end
      assert.matches("ready", helper.slurp(log) or "", 1, true)
      tally.sleep(0.1 + 0.3 * math.random())                     -- mid-flush, mid-count
      os.execute("kill -KILL " .. pid)
      for _ = 1, 200 do
        local s = helper.slurp("/proc/" .. pid .. "/stat")
        if not s or s:match("%) Z") then break end
        tally.sleep(0.02)
      end
      assert.is_true(run <= 2)
    end
    -- a restart that only syncs
    local out = helper.tally(WORKER, path, emu.uri, names, "0", "w-kill")
    assert.matches("synced true", out, 1, true)
    local db = assert(tally.open("file:" .. path))
    local ff = db:flush_to(emu.uri, { writer = "w-check" })
    for nm in names:gmatch("[^,]+") do
      local v = db:value(nm)
      assert.is_true(v > 0)
      assert.equal(v, ff:remote_value(nm), nm)
    end
    db:close()
  end)

  it("stays exact with concurrent processes losing every 3rd reply", function()
    local pipes, n, each = {}, 4, 300
    for i = 1, n do
      pipes[i] = assert(io.popen(("TALLY_HTTP_LOSE_EVERY=3 %s %s %s %s shared:1,shared:2 %d w%d 2>&1"):format(
        helper.q(helper.bin), WORKER, helper.q(helper.tmpfile()), helper.q(emu.uri), each, i), "r"))
    end
    for i = 1, n do
      local out = pipes[i]:read("a")
      pipes[i]:close()
      assert.matches("synced true", out, 1, true)
    end
    local db = assert(tally.open(emu.uri))
    assert.equal(n * each, db:value("shared:1"))
    assert.equal(n * each, db:value("shared:2"))
    db:close()
  end)

  it("backs off on ABORTED (a transaction holds the shard) and stays exact", function()
    local db = local_db()
    local ff = db:flush_to(emu.uri, { writer = "w1", doc_interval = 0, backoff = 0.05, shards = 1 })
    db:incr("hot", 10)
    assert(ff:sync(10))
    -- the seeds' transaction reads the shard (a lock in the emulator) ...
    local _, tx = emu.rest("POST", ":beginTransaction", { options = { readWrite = {} } })
    local shard = P .. "counters/hot/shards/0"
    local _, got = emu.rest("POST", ":batchGet", { documents = { shard }, transaction = tx.transaction })
    local seen = tonumber(got[1].found.fields.count.integerValue)
    db:incr("hot", 5)
    local st, msg, code = ff:flush_now()                     -- ... so the flush waits, then ABORTED
    assert.is_nil(st)
    assert.equal("ABORTED", code, msg)
    assert.equal(1, ff:stats().backoffs)
    -- the transaction's commit fails or succeeds; either way the total is exact
    local cst = emu.rest("POST", ":commit", { transaction = tx.transaction, writes = {
      { update = { name = shard, fields = { count = int(seen + 100) } } } } })
    local extra = cst == 200 and 100 or 0
    assert(ff:sync(10))
    assert.equal(15 + extra, ff:remote_value("hot"))
    db:close()
  end)

  -- 3,000 counters are 9,000 document writes: 9 s at least at the rate
  -- set here, so the limit governs the run; TALLY_FIRESTORE_COUNTERS=N
  -- runs another count (scripts/bench-firestore measures the rate).
  local N = tonumber(os.getenv("TALLY_FIRESTORE_COUNTERS")) or 3000
  it(("flushes %d counters within the rate limits, exactly"):format(N), function()
    local db = assert(tally.open())
    local rate = 1000
    local ff = db:flush_to(emu.uri, { writer = "bulk", rate = rate, batch = 250, shards = 1 })
    for i = 1, N do db:incr("c:" .. i, i) end
    local t0 = core.now()
    assert(ff:sync(600))
    local dt = core.now() - t0
    local s = ff:stats()
    assert.equal(N, s.flushed)
    assert.equal(3 * N, s.writes)                    -- counter doc + shard + marker each
    -- the bucket starts with one second of rate: the rest took at least its time
    assert.is_true(dt >= (s.writes - rate) / rate * 0.95, "took " .. dt)
    assert.is_true(s.peak_writes_per_s <= 2 * rate)  -- a calendar second may span two bucket-seconds
    -- a second round right away: nothing to send
    assert(ff:sync(5))
    assert.equal(3 * N, ff:stats().writes)
    local fs = assert(tally.open(emu.uri))
    local total, count = fs:sum("c:*")
    assert.equal(N, count)
    assert.equal(N * (N + 1) // 2, total)
    fs:close()
    db:close()
  end)

  it("writes one document at most once per doc_interval, and reports its lag", function()
    local db = assert(tally.open())
    local ff = db:flush_to(emu.uri, { writer = "w1", every = 0.01, doc_interval = 1 })
    local c = db:counter("busy", { shards = 2 })
    local t0 = core.now()
    local maxlag = 0
    while core.now() - t0 < 2.5 do
      c:incr()
      db:tick()
      maxlag = math.max(maxlag, ff:stats().lag)
      tally.sleep(0.005)
    end
    local s = ff:stats()
    assert.is_true(s.commits <= 3, "commits " .. s.commits)      -- at 0, 1 and 2 s
    assert.is_true(s.commits >= 2)
    assert.is_true(maxlag > 0.5 and maxlag <= 2.5, "lag " .. maxlag)   -- loose: a loaded machine
    assert(ff:sync(5))
    assert.equal(c:value(), ff:remote_value("busy"))
    db:close()
  end)

  it("forgets counters that are gone: nothing left pending, no entry kept", function()
    local db = assert(tally.open())
    local ff = db:flush_to(emu.uri, { writer = "w1", doc_interval = 60 })
    for i = 1, 10 do assert(db:incr("gone:" .. i)) end
    assert(ff:sync(5))
    for i = 1, 10 do assert(db:incr("gone:" .. i)) end
    local st = assert(ff:flush_now())                   -- held back by doc_interval
    assert.equal(10, st.pending)
    for i = 1, 10 do assert(db:drop("gone:" .. i)) end
    assert(ff:sync(2))                                   -- was: "10 counters still pending"
    assert.equal(0, ff:stats().lag)
    local n = 0
    for _ in pairs(ff.ents) do n = n + 1 end
    assert.equal(0, n)
    assert.equal(1, ff:remote_value("gone:1"))           -- what was flushed stays
    assert(db:incr("gone:1", 5))                         -- made again: counts on
    assert(ff:sync(5))
    assert.equal(6, ff:remote_value("gone:1"))
    db:close()
  end)

  -- A name forgotten (gone in a round) and made again is a first guess
  -- whose commit Firestore refuses (ALREADY_EXISTS: its counter document
  -- is there from before). It must not take the known counters down with
  -- it: sharing their commit, it refused them all, round after round.
  it("a name forgotten and made again does not refuse the known counters' commit", function()
    local db = assert(tally.open())
    local ff = db:flush_to(emu.uri, { writer = "w1", doc_interval = 0 })
    for i = 1, 5 do assert(db:incr("re:" .. i, 1)) end
    assert(ff:sync(5))
    assert(db:drop("re:3"))
    assert(ff:flush_now())                              -- forgotten
    assert.is_nil(ff.ents["re:3"])
    assert(db:incr("re:3", 4))                          -- made again: a first guess
    for _, i in ipairs({ 1, 2, 4, 5 }) do assert(db:incr("re:" .. i, 10)) end
    local _, _, code = ff:flush_now()                   -- one round
    assert.equal("ALREADY_EXISTS", code)                -- the guess alone is refused
    for _, i in ipairs({ 1, 2, 4, 5 }) do             -- on the code before: 1 (refused with it)
      assert.equal(11, ff:remote_value("re:" .. i))
    end
    assert(ff:sync(5))
    assert.equal(5, ff:remote_value("re:3"))            -- what was flushed stays, the new one counts on
    assert.equal(1, ff:stats().conflicts)
    db:close()
  end)

  it("keeps the ramp-up rule: 500 writes/s, +50% every ramp_every", function()
    local db = assert(tally.open())
    local ff = db:flush_to(emu.uri, { writer = "w1", ramp_every = 0.5, doc_interval = 0 })
    assert.equal(500, ff:stats().rate)
    db:incr("r", 1)
    assert(ff:sync(5))
    tally.sleep(1.05)
    assert.near(1125, ff:stats().rate, 1)              -- 500 * 1.5^2
    db:close()
  end)
end)

describe("tally.open('firestore://...'), what it does not do", function()
  it("raises a clear error for a method of the file store it lacks", function()
    local db = assert(tally.open(emu.uri))
    local c = assert(db:counter("u"))
    for _, m in ipairs({ "top", "reshard", "rollup", "tick", "history", "snapshot", "flush_to" }) do
      local obj = (m == "reshard" or m == "history") and c or db
      assert.equal(m .. " is not supported by the firestore store", helper.err(obj[m], obj, 1))
    end
    db:close()
  end)
end)

describe("db:flush_to('firestore://...'), a counter it cannot send", function()
  it("holds a delta beyond int64 and says so, never marking it shipped", function()
    local db = assert(tally.open("file:" .. helper.tmpfile()))
    db:family("k:*", { idle = 10 })
    local ff = db:flush_to(emu.uri, { writer = "w1", doc_interval = 0, backoff = 0.01 })
    local c = assert(db:counter("k:1", { shards = 2, policy = "key" }))
    assert(c:incr(-200, "a"))
    assert(ff:sync(10))                                  -- the marker: -200
    assert(c:incr((1 << 62) - 1 + 200, "a"))             -- that shard at 2^62-1
    local filled = false
    for i = 1, 64 do                                     -- the other near it too
      if c:incr((1 << 62) - 1 - 50, "k" .. i) then filled = true break end
    end
    assert(filled)
    local v = c:value()                                  -- 2^63-52: - -200 leaves int64
    local st, msg, code = ff:flush_now()
    assert.same({ nil, "ERANGE" }, { st, code })
    assert.matches("overflows int64", msg, 1, true)
    assert.equal(1, ff:stats().errors)
    assert.is_nil(ff:sync(0.1))
    db:maintain(1700000000 * 1000)
    db:maintain(1700000020 * 1000)                       -- idle 20 s: held, not expired
    assert.equal(v, c:value())                           -- on the code before: 0, expired
    db:close()
  end)

  it("takes a marker with an incarnation tally never writes as another's", function()
    local st, _, raw = emu.rest("POST", ":commit", { writes = {
      { update = { name = P .. "counters/a:1", fields = { num_shards = int(1) } } },
      { update = { name = P .. "counters/a:1/writers/w1", fields = {
          flushed = int(3), inc = { stringValue = "ABCDEF0123456789" },
          writer = { stringValue = "w1" } } } } } })
    assert.equal(200, st, raw)
    local db = assert(tally.open("file:" .. helper.tmpfile()))
    local ff = db:flush_to(emu.uri, { writer = "w1", doc_interval = 0, backoff = 0.01 })
    assert(db:counter("a:1", { shards = 1 })):incr(5)
    assert(db:counter("b:1", { shards = 1 })):incr(7)
    assert(ff:sync(10))                                  -- on the code before: raised
    assert.equal(7, ff:remote_value("b:1"))
    assert.equal(5, ff:remote_value("a:1"))              -- counted from 0: all of it
    db:close()
  end)
end)

-- What every flush_to backend keeps, run against Firestore.
local seq = 0
require("spec.support.flush_contract")({
  kind = "Firestore",
  uri = function() return emu.uri end,
  name = function(prefix) seq = seq + 1 return prefix .. seq end,
  lose = function(name, writer)
    local doc = P .. "counters/" .. name
    local writes = { { delete = doc .. "/writers/" .. writer } }
    for i = 0, 63 do writes[#writes + 1] = { delete = doc .. "/shards/" .. i } end
    local st, _, raw = emu.rest("POST", ":commit", { writes = writes })
    assert.equal(200, st, raw)
  end,
  opts = { doc_interval = 0, backoff = 0.01 },
}, { describe = describe, it = it, assert = assert })
