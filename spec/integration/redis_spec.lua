-- Redis and Redis Cluster: core.redis, core.flusher and db:flush_to against
-- real servers (spec/support/redis.lua starts them once for the whole file).
local helper = require "spec.support.helper"
local redis = require "spec.support.redis"
local tally = require "tally"
local core = require "tally.core"

local WORKER = "spec/support/fixtures/redis_worker.lua"

local srv
local fresh = redis.fresh

setup(function() srv = redis.start() end)
teardown(function() if srv then srv.stop() end end)

-- Flush until a round succeeds with nothing left to send.
local function settle(rf)
  for _ = 1, 100 do
    local st = rf:flush_now()
    if st and st.errors == 0 and st.flushed == 0 and st.conflicts == 0 then return st end
    tally.sleep(0.05)
  end
  error("flushes did not settle: " .. tostring(rf:stats().last_error))
end

describe("core.redis", function()
  it("runs commands on a standalone server and converts the replies", function()
    local r = assert(core.redis(srv.uri, { timeout = 2 }))
    local k = fresh("k")
    assert.equal("OK", r:command("SET", k, 5))
    assert.equal(12, r:command("INCRBY", k, "7"))
    assert.equal("12", r:command("GET", k))
    assert.is_nil(r:command("GET", k .. "-none"))
    assert.equal(2, r:command("RPUSH", k .. "-l", "a", "b"))
    assert.same({ "a", "b" }, r:command("LRANGE", k .. "-l", 0, -1))
    local v, err = r:command("INCR", k .. "-l")
    assert.is_nil(v)
    assert.matches("WRONGTYPE", err)
    assert.equal("PONG", r:command("PING"))
    assert.is_false(r:stats().cluster)
    r:close()
    assert.equal("attempt to use a closed redis handle", helper.err(r.command, r, "PING"))
    r:close()  -- twice is fine
  end)

  it("detects a cluster and routes keys to their masters", function()
    for _, uri in ipairs({ srv.cluster_uri, "redis://127.0.0.1:" .. srv.masters[2] }) do
      local r = assert(core.redis(uri))
      assert.is_true(r:stats().cluster)
      for i = 1, 30 do
        local k = fresh("c" .. i)
        assert.equal(i, r:command("INCRBY", k, i))
        assert.equal(tostring(i), r:command("GET", k))
      end
      assert.equal(0, r:stats().moved)
      r:close()
    end
  end)

  it("gives clear errors for bad URIs and options", function()
    local cases = {
      { "http://127.0.0.1:1", "expected redis://host:port" },
      { "redis://", "no host" },
      { "redis://127.0.0.1:0", "port must be 1 to 65535" },
      { "redis://127.0.0.1:x", "bad port" },
      { "redis://a:1,b:2", "several hosts need redis+cluster://" },
      { "redis://127.0.0.1:1/2", "only database 0" },
      { "redis://user:pw@bad host:1", "bad Redis URI 'redis://***@bad host:1': bad character in host" },
      { "redis://127.0.0.1:1?db=0&x=pw", "bad Redis URI 'redis://127.0.0.1:1?***': an unknown query parameter (expected password, user, username, db; write '&' and '=' in a value as %26 and %3D)" },
      { "redis+cluster://127.0.0.1:1,", "empty host" },
    }
    for _, c in ipairs(cases) do
      assert.matches(c[2], helper.err(core.redis, c[1]), 1, true)
    end
    assert.matches("timeout must be a positive number",
      helper.err(core.redis, srv.uri, { timeout = 0 }), 1, true)
    assert.matches("unknown option 'x'", helper.err(core.redis, srv.uri, { x = 1 }), 1, true)
    local r, msg, code = core.redis("redis://127.0.0.1:1", { timeout = 0.5 })
    assert.is_nil(r)
    assert.matches("127.0.0.1:1", msg, 1, true)
    assert.is_string(code)
  end)
end)

describe("core.flusher", function()
  it("flushes exactly once and reads completed flushes only", function()
    local r = assert(core.redis(srv.cluster_uri))
    local db = tally.open("memory")
    local name = fresh("f")
    local f = core.flusher(db, r, { writer = fresh("w"), shards = 4 })
    db:incr(name, 10)
    local st = assert(f:run())
    assert.equal(1, st.flushed)
    assert.equal(10, f:remote_value(name))
    db:incr(name, 5)
    assert.equal(10, f:remote_value(name))  -- not flushed yet: not included
    assert.equal(5, assert(f:run()).delta)
    assert.equal(15, f:remote_value(name))
    assert.equal(0, assert(f:run()).flushed)
    assert.equal(0, f:remote_value(fresh("none")))
    f:close()
    r:close()
  end)

  it("raises on a closed store and survives closing in any order", function()
    local r = assert(core.redis(srv.uri))
    local db = tally.open("memory")
    local f = core.flusher(db, r, { writer = fresh("w") })
    db:incr("x")
    db:close()
    assert.equal("attempt to use a closed store", helper.err(f.run, f))
    assert.equal("attempt to use a closed store", helper.err(f.remote_value, f, "x"))
    f:close()
    local db2 = tally.open("memory")
    local f2 = core.flusher(db2, r, { writer = fresh("w") })
    r:close()
    assert.equal("attempt to use a closed flusher", helper.err(f2.run, f2))
    db2:close()
    f2 = nil
    collectgarbage()
    collectgarbage()
  end)

  it("checks its options", function()
    local r = assert(core.redis(srv.uri))
    local db = tally.open("memory")
    assert.matches("writer is required", helper.err(core.flusher, db, r, {}), 1, true)
    assert.matches("writer must be 1 to 128 bytes",
      helper.err(core.flusher, db, r, { writer = ("x"):rep(129) }), 1, true)
    assert.matches("shards must be an integer from 1 to",
      helper.err(core.flusher, db, r, { writer = "a", shards = 0 }), 1, true)
    assert.matches("unknown option 'every'",
      helper.err(core.flusher, db, r, { writer = "a", every = 1 }), 1, true)
    assert.matches("verify must be a number of seconds",
      helper.err(core.flusher, db, r, { writer = "a", verify = -1 }), 1, true)
    r:close()
  end)

  -- What a failover that lost an acknowledged flush leaves behind (the
  -- real failover is tests/test_redis_failover.c): w:WRITER and v set
  -- back by hand. An idle counter is resent only once re-verified.
  it("re-reads w:WRITER on verify and resends what Redis lost, once", function()
    local r = assert(core.redis(srv.uri))
    local db = tally.open("memory")
    local name, w = fresh("lost"), fresh("w")
    local f = core.flusher(db, r, { writer = w, shards = 1, verify = 0 })
    db:counter(name):incr(150)
    local st = assert(f:run())
    assert.equal(1, st.flushed)
    local key = "tally:{" .. name .. "#0}"
    assert.equal(150, f:remote_value(name))
    local inc = db:counter(name):info().incarnation
    assert.equal(inc .. ":150", r:command("HGET", key, "w:" .. w))
    st = assert(f:run())                              -- quiet: read back once
    assert.same({ 1, 0 }, { st.commands, st.flushed })
    r:command("HSET", key, "v", 100, "w:" .. w, inc .. ":100")  -- the lost flush of 50
    st = assert(f:run())
    assert.equal(0, st.commands)                      -- believed up to date
    assert.equal(100, f:remote_value(name))
    f:verify()
    st = assert(f:run())
    assert.same({ 1, 1, 1 }, { st.verified, st.repaired, st.flushed })
    assert.equal(150, f:remote_value(name))
    f:verify()
    st = assert(f:run())
    assert.same({ 1, 0, 0 }, { st.verified, st.repaired, st.flushed })
    assert.equal(150, f:remote_value(name))
    -- the timer: verify = 0.2 s re-reads by itself
    local f2 = core.flusher(db, r, { writer = w .. "b", shards = 1, verify = 0.2 })
    assert(f2:run())
    assert.equal(1, assert(f2:run()).commands)        -- read back once
    r:command("HSET", key, "v", 0, "w:" .. w .. "b", 0)
    r:command("HDEL", key, "w:" .. w)
    assert.equal(0, assert(f2:run()).verified)
    tally.sleep(0.25)
    st = assert(f2:run())
    assert.same({ 1, 1, 1 }, { st.verified, st.repaired, st.flushed })
    f:verify()
    assert(f:run())
    assert.equal(300, f:remote_value(name))            -- both writers, once each
    f:close(); f2:close(); r:close(); db:close()
  end)
end)

describe("db:flush_to", function()
  it("flushes through db:tick, each due period once", function()
    local db = tally.open("memory")
    local t = 1000
    db:clock(function() return t end)
    local name = fresh("t")
    local rf = db:flush_to(srv.uri, { every = 10 })
    db:incr(name, 3)
    local done = db:tick()
    assert.equal(1, #done)
    assert.equal("flushed", done[1].status)
    assert.equal(3, rf:remote_value(name))
    db:incr(name, 4)
    assert.same({}, db:tick())     -- same period: not due
    assert.equal(3, rf:remote_value(name))
    t = 1010
    assert.equal("flushed", db:tick()[1].status)
    assert.equal(7, rf:remote_value(name))
    local st = rf:stats()
    assert.equal(2, st.runs)
    assert.equal(0, st.errors)
    assert.matches("^mem%-", st.writer)
    -- rf:verify() (not hidden by the verify option): the next round reads
    -- the writer's record back, and what Redis holds is not counted twice
    rf:verify()
    t = 1020
    assert.equal("flushed", db:tick()[1].status)
    assert.equal(7, rf:remote_value(name))
    rf:close()
  end)

  -- Idle expiry (docs/lifecycle.md) of what a flush_to ships: a counter
  -- leaves only once its final value has been read back from Redis, and a
  -- late increment (a new incarnation) adds to the remote total.
  it("lets shipped counters expire only after their final value is in Redis", function()
    local db = tally.open("memory")
    local t = 1000
    db:clock(function() return t end)
    db:family("exp:*", { idle = 5 })
    local name = "exp:" .. fresh("x")
    local rf = db:flush_to(srv.uri, { every = 100, pattern = "exp:*" })
    db:incr(name, 3)
    db:tick()                          -- flushed: 3 written
    assert.equal(3, rf:remote_value(name))
    t = 1010; db:tick()                -- idle for 10 s: due to expire
    t = 1020; db:tick()
    assert.equal(0, db:stats().expired) -- held: 3 written, never read back
    t = 1100; db:tick()                -- the next round reads it back
    t = 1110; db:tick()
    assert.equal(1, db:stats().expired)
    assert.is_nil(db:value(name))
    db:incr(name, 4)                   -- late: a new incarnation
    t = 1200; db:tick()
    assert.equal(7, rf:remote_value(name))
    -- a writer that no longer flushes this store: nothing waits for it
    db:incr(name, 1)
    assert.is_true(rf:unship())
    t = 1210; db:tick()
    t = 1220; db:tick()
    assert.equal(2, db:stats().expired)
    assert.equal(7, rf:remote_value(name))  -- that 5th went nowhere, by request
    rf:close(); db:close()
  end)

  -- A flusher over short-lived names keeps entries for the live ones only
  -- (stats().entries); a name made again after its entry went is read from
  -- Redis first, then flushed on top of what it holds, once.
  it("forgets counters that are gone, and counts on when one is made again", function()
    local db = tally.open("memory")
    local pre = fresh("gone")
    local rf = db:flush_to(srv.uri, { every = 100, pattern = pre .. ":*" })
    for i = 1, 10 do db:incr(pre .. ":" .. i, i) end
    assert.equal(10, settle(rf).entries)
    for i = 1, 10 do assert(db:drop(pre .. ":" .. i)) end
    local st = assert(rf:flush_now())
    assert.same({ 0, 0, 0 }, { st.entries, st.counters, st.commands })
    assert.equal(1, rf:remote_value(pre .. ":1"))     -- what was flushed stays
    db:incr(pre .. ":1", 5)                           -- made again
    st = assert(rf:flush_now())
    assert.same({ 1, 1, 2, 5 }, { st.entries, st.flushed, st.commands, st.delta })
    settle(rf)
    assert.equal(6, rf:remote_value(pre .. ":1"))
    rf:close(); db:close()
  end)

  it("keeps totals exact through db:run on the cluster", function()
    local db = tally.open("memory")
    local names = { fresh("a"), fresh("b"), fresh("c") }
    local rf = db:flush_to(srv.cluster_uri, { every = 0.05, shards = 8 })
    local want = {}
    for round = 1, 5 do
      for i, n in ipairs(names) do
        db:incr(n, round * i)
        want[n] = (want[n] or 0) + round * i
      end
      db:run(0.12)
    end
    settle(rf)
    for _, n in ipairs(names) do assert.equal(want[n], rf:remote_value(n)) end
    assert.equal(0, rf:stats().errors)
  end)

  it("keeps the writer id of a file store across restarts", function()
    local path = helper.tmpfile()
    local name = fresh("p")
    local db = assert(tally.open("file:" .. path))
    local rf = db:flush_to(srv.cluster_uri)
    db:incr(name, 7)
    settle(rf)
    local writer = rf:stats().writer
    db:incr(name, 5)  -- unflushed when the process "dies"
    rf:close()
    db:close()
    db = assert(tally.open("file:" .. path))
    rf = db:flush_to(srv.cluster_uri)
    assert.equal(writer, rf:stats().writer)
    assert.equal(7, rf:remote_value(name))
    settle(rf)
    assert.equal(12, rf:remote_value(name))  -- the 7 not counted twice
    db:close()
  end)

  it("sends the deltas a SIGKILLed process left unflushed once, after restart", function()
    local path, script = helper.tmpfile(), helper.tmpfile("killed.lua")
    local name = fresh("k")
    helper.write(script, [[
      local tally = require "tally"
      local path, uri, name = ...
      local db = assert(tally.open("file:" .. path))
      local rf = db:flush_to(uri, { every = 3600 })
      db:incr(name, 1000)
      assert(rf:flush_now())            -- 1000 reach Redis
      for _ = 1, 234 do db:incr(name, 1) end   -- these only the local file has
      print("ready") io.stdout:flush()
      os.execute("kill -9 $PPID")        -- $PPID of that shell: this process
      tally.sleep(10)
    ]])
    -- the script kills itself: its shell's parent is the tally process
    local p = assert(io.popen("exec " .. helper.q(helper.bin) .. " " .. helper.q(script) .. " "
                              .. helper.q(path) .. " " .. helper.q(srv.cluster_uri) .. " "
                              .. helper.q(name) .. " 2>&1", "r"))
    local out = p:read("a")
    local _, how, code = p:close()
    assert.matches("ready", out, 1, true)
    assert.same({ "signal", 9 }, { how, code }, out)
    local db = assert(tally.open("file:" .. path))
    local rf = db:flush_to(srv.cluster_uri)
    assert.equal(1000, rf:remote_value(name))
    assert.equal(1234, db:value(name))
    settle(rf)
    assert.equal(1234, rf:remote_value(name))
    settle(rf)                           -- and never again
    assert.equal(1234, rf:remote_value(name))
    db:close()
  end)

  it("counts errors when Redis is away and catches up later", function()
    local db = tally.open("memory")
    local name = fresh("d")
    local rf = db:flush_to("redis://127.0.0.1:1", { every = 1, timeout = 0.2, writer = fresh("w") })
    assert.matches("127.0.0.1:1", rf:stats().last_error, 1, true)
    db:incr(name, 2)
    local done = db:tick(5000)
    assert.equal("error", done[1].status)
    assert.equal(1, rf:stats().errors)
    rf:close()
    assert.same({}, db:tick(6000))  -- closed: no longer scheduled
  end)

  it("gives clear errors for bad URIs and options", function()
    local db = tally.open("memory")
    assert.matches("bad argument #1 to 'flush_to' (bad Redis URI 'x:1'",
      helper.err(db.flush_to, db, "x:1"), 1, true)
    assert.matches("Redis URI expected", helper.err(db.flush_to, db, 42), 1, true)
    local path = helper.tmpfile()                -- no writer id made for a bad URI
    local fdb = assert(tally.open("file:" .. path))
    assert.matches("bad Redis URI", helper.err(fdb.flush_to, fdb, "x:1"), 1, true)
    assert.is_nil(io.open(path .. ".writer"))
    fdb:close()
    assert.matches("every must be from 0.001 s",
      helper.err(db.flush_to, db, srv.uri, { every = 0 }), 1, true)
    assert.matches("unknown option 'keep'",
      helper.err(db.flush_to, db, srv.uri, { keep = {} }), 1, true)
    assert.matches("shards must be an integer",
      helper.err(db.flush_to, db, srv.uri, { shards = 1.5 }), 1, true)
    assert.matches("writer must be a string",
      helper.err(db.flush_to, db, srv.uri, { writer = "" }), 1, true)
    db:flush_to(srv.uri, { writer = "dup" })
    assert.matches("already flushes '*' as writer 'dup'",
      helper.err(db.flush_to, db, srv.uri, { writer = "dup" }), 1, true)
    db:close()
    assert.matches("closed store", helper.err(db.flush_to, db, srv.uri), 1, true)
  end)

  it("stays exact when the flushers' connections are killed mid-run", function()
    local db = tally.open("memory")
    local name = fresh("k")
    local rf = db:flush_to(srv.cluster_uri, { every = 0.02, shards = 8 })
    local total = 0
    for round = 1, 40 do
      db:incr(name, round)
      total = total + round
      if round % 5 == 0 then
        for _, p in ipairs(srv.masters) do redis.cli(p, "CLIENT", "KILL", "TYPE", "normal") end
      end
      db:run(0.03)
    end
    settle(rf)
    assert.equal(total, rf:remote_value(name))
    assert.is_true(rf:stats().redis.reconnects > 0)
  end)
end)

describe("several processes flushing to the cluster", function()
  it("make the remote total equal every increment", function()
    local PROCS, EACH = 4, 20000
    local name = fresh("procs")
    local pipes = {}
    for i = 1, PROCS do
      pipes[i] = helper.spawn(WORKER, helper.tmpfile(), srv.cluster_uri, name,
                              tostring(EACH), "proc-" .. i .. "-" .. name)
    end
    -- meanwhile, kill their connections a few times
    for _ = 1, 3 do
      tally.sleep(0.1)
      for _, p in ipairs(srv.masters) do redis.cli(p, "CLIENT", "KILL", "TYPE", "normal") end
    end
    for i = 1, PROCS do
      local out = pipes[i]:read("a")
      local _, _, code = pipes[i]:close()
      assert.equal(0, code, out)
      assert.matches("done " .. EACH .. " flushed true", out, 1, true)
    end
    local r = assert(core.redis(srv.cluster_uri))
    local f = core.flusher(tally.open("memory"), r, { writer = "reader", shards = 8 })
    assert.equal(PROCS * EACH, f:remote_value(name))
    r:close()
  end)
end)

-- What every flush_to backend keeps, run against Redis.
require("spec.support.flush_contract")({
  kind = "Redis",
  uri = function() return srv.uri end,
  name = fresh,
  lose = function(name)
    local r = assert(core.redis(srv.uri))
    for i = 0, 7 do assert(r:command("DEL", core.redis_shard_key(name, i))) end
    r:close()
  end,
}, { describe = describe, it = it, assert = assert })
