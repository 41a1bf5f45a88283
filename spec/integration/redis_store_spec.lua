-- The Redis store: tally.open("redis://...") and "redis+cluster://...",
-- against the real servers of spec/support/redis.lua (started once for this file).
local helper = require "spec.support.helper"
local redis = require "spec.support.redis"
local tally = require "tally"
local core = require "tally.core"

local WORKER = "spec/support/fixtures/redis_store_worker.lua"

local srv
local fresh = redis.fresh

setup(function() srv = redis.start() end)
teardown(function() if srv then srv.stop() end end)

-- The master port serving each slot range, from CLUSTER SLOTS.
local function slot_owner(r)
  local ranges = assert(r:command("CLUSTER", "SLOTS"))
  return function(slot)
    for _, rg in ipairs(ranges) do
      if slot >= rg[1] and slot <= rg[2] then return rg[3][2] end
    end
  end
end

local function both(fn)
  return function()
    for _, uri in ipairs({ srv.uri, srv.cluster_uri }) do fn(uri) end
  end
end

describe("the redis store", function()
  it("creates, gets, increments and reads exactly", both(function(uri)
    local db = assert(tally.open(uri))
    assert.matches("^tally.store %(redis", tostring(db))
    local name = fresh("a")
    local c = db:counter(name, { shards = 4, policy = "round_robin" })
    assert.equal(0, c:value())
    for i = 1, 8 do assert.is_true(c:incr(i)) end
    assert.is_true(c:decr(6))
    assert.equal(30, c:value())
    assert.same({ name = name, shards = 4, policy = "round_robin" }, c:info())
    assert.equal(name, c:name())
    assert.equal(db, c:store())
    local sh = c:shards()
    assert.equal(4, #sh)
    assert.equal(30, helper.sum(sh))
    assert.is_true(helper.nonzero(sh) >= 3)  -- round_robin: 8 increments over 4 shards, then one decr
    -- exact 64-bit values
    local big = fresh("big")
    assert.is_true(db:incr(big, math.maxinteger - 5))
    assert.is_true(db:incr(big, 3))
    assert.equal(math.maxinteger - 2, db:value(big))
    local ok, msg, code = db:counter(big):incr(math.maxinteger)
    assert.is_nil(ok)
    assert.equal("ERANGE", code)
    assert.is_string(msg)
    -- get: same options from another handle; db:incr/db:value by name
    local db2 = assert(tally.open(uri))
    local c2 = db2:counter(name)
    assert.same(c:info(), c2:info())
    assert.is_true(db2:incr(name, 10))
    assert.equal(40, db:value(name))
    assert.is_nil((db:counter(fresh("none"), { create = false })))
    local v, err, ecode = db:value(fresh("none"))
    assert.is_nil(v)
    assert.matches("no such counter", err)
    assert.equal("ENOENT", ecode)
    db2:close()
    db:close()
    assert.equal("attempt to use a closed store", helper.err(c.incr, c))
    assert.equal("attempt to use a closed store", helper.err(db.value, db, name))
    db:close()
  end))

  it("raises on an options mismatch and on bad arguments", both(function(uri)
    local db = assert(tally.open(uri))
    local name = fresh("m")
    db:counter(name, { shards = 16 })
    assert.equal(("counter '%s' exists with 16 shards and policy thread (asked for 8 shards)"):format(name),
      helper.err(db.counter, db, name, { shards = 8 }))
    assert.equal(("counter '%s' exists with 16 shards and policy thread (asked for policy key)"):format(name),
      helper.err(db.counter, db, name, { policy = "key" }))
    assert.matches("shards must be an integer from 1 to 1024, got 0",
      helper.err(db.counter, db, fresh("x"), { shards = 0 }), 1, true)
    assert.matches("unknown option 'nope'", helper.err(db.counter, db, fresh("x"), { nope = 1 }), 1, true)
    assert.matches("function policies are not supported by the redis store",
      helper.err(db.counter, db, fresh("x"), { policy = function() return 1 end }), 1, true)
    assert.matches("integer expected", helper.err(db.incr, db, name, 1.5), 1, true)
    -- a counter's own methods; like the C methods' errors, with no position
    local c = db:counter(name)
    assert.equal("bad argument #1 to 'incr' (integer expected, got 1.5)", helper.err(c.incr, c, 1.5))
    assert.equal("bad argument #1 to 'decr' (integer expected, got table)", helper.err(c.decr, c, {}))
    local ok, msg = pcall(function() local r = c:incr("x"); return r end)
    assert.is_false(ok)
    assert.equal("bad argument #1 to 'incr' (integer expected, got string)", msg)
    local k = db:counter(fresh("k"), { policy = "key", shards = 8 })
    assert.matches("pass a key", helper.err(k.incr, k, 1), 1, true)
    db:close()
  end))

  it("writes a name's control bytes and bytes that are not UTF-8 as \\xNN in messages", both(function(uri)
    local db = assert(tally.open(uri))
    local name = fresh("a\nb\27[1m\255")
    local odd = name:gsub("\n", "\\x0a"):gsub("\27", "\\x1b"):gsub("\255", "\\xff")
    db:counter(name, { shards = 2, policy = "key" })
    assert.equal(("counter '%s' exists with 2 shards and policy key (asked for 4 shards)"):format(odd),
      helper.err(db.counter, db, name, { shards = 4 }))
    assert.equal(("counter '%s' has the key policy: pass a key to incr"):format(odd),
      helper.err(db.incr, db, name))
    local _, msg = db:counter(name .. "\n", { create = false })
    assert.equal(("no such counter '%s\\x0a'"):format(odd), msg)
    local cafe = fresh("caf\195\169")
    db:counter(cafe, { shards = 2 })
    assert.equal(("counter '%s' exists with 2 shards and policy thread (asked for 4 shards)"):format(cafe),
      helper.err(db.counter, db, cafe, { shards = 4 }))
    db:drop(name)
    db:drop(cafe)
    db:close()
  end))

  it("shards keys like the C core's key policy", function()
    local db = assert(tally.open(srv.uri))
    local mem = tally.open("memory")
    for _, key in ipairs({ "a", "user:42", "abcdefgh", "a somewhat longer key here" }) do
      local name = fresh("kp")
      local rc = db:counter(name, { shards = 7, policy = "key" })
      local mc = mem:counter(name, { shards = 7, policy = "key" })
      rc:incr(1, key)
      mc:incr(1, key)
      assert.same(mc:shards(), rc:shards())
    end
    db:close()
  end)

  it("spreads the shards of one counter over all three masters", function()
    local db = assert(tally.open(srv.cluster_uri))
    local r = assert(core.redis(srv.cluster_uri))
    local owner = slot_owner(r)
    local name = fresh("spread")
    local c = db:counter(name, { shards = 32, policy = "round_robin" })
    for _ = 1, 64 do c:incr() end
    local masters = {}
    for i = 0, 31 do
      local key = ("tally:{%s#%d}"):format(name, i)
      assert.equal("2", r:command("HGET", key, "v"))
      masters[owner(r:command("CLUSTER", "KEYSLOT", key))] = true
    end
    for _, p in ipairs(srv.masters) do assert.is_true(masters[p], "no shard on " .. p) end
    assert.equal(64, c:value())
    r:close()
    db:close()
  end)

  it("counts exactly with several processes on the cluster", function()
    local name = fresh("procs")
    local each, n = 1500, 4
    local procs = {}
    for i = 1, n do procs[i] = helper.spawn(WORKER, srv.cluster_uri, name, each, 8) end
    for i = 1, n do
      local out = procs[i]:read("a")
      procs[i]:close()
      assert.matches("worker done " .. each .. " failed 0", out, 1, true)
    end
    local db = assert(tally.open(srv.cluster_uri))
    assert.equal(each * n, db:value(name))
    db:close()
  end)

  it("resets under concurrent increments without losing any", function()
    local name = fresh("reset")
    local db = assert(tally.open(srv.cluster_uri))
    local c = db:counter(name, { shards = 8, policy = "thread" })
    local each, n = 1500, 3
    local procs = {}
    for i = 1, n do procs[i] = helper.spawn(WORKER, srv.cluster_uri, name, each, 8) end
    local removed = 0
    for _ = 1, 20 do
      removed = removed + assert(c:reset())
      tally.sleep(0.02)
    end
    for i = 1, n do
      local out = procs[i]:read("a")
      procs[i]:close()
      assert.matches("failed 0", out, 1, true)
    end
    assert.is_true(removed > 0)
    assert.equal(each * n, removed + c:value())
    assert.equal(c:value(), c:reset())
    assert.equal(0, c:value())
    db:close()
  end)

  it("lists, sums, drops, and applies families", both(function(uri)
    local db = assert(tally.open(uri))
    local p = fresh("grp")
    db:incr(p .. ".a", 1)
    db:incr(p .. ".b", 2)
    db:incr(p .. ".c", 4)
    assert.same({ p .. ".a", p .. ".b", p .. ".c" }, db:names(p .. ".*"))
    assert.same({ p .. ".a", p .. ".b", p .. ".c" }, db:names(p .. ".?"))
    assert.same({ p .. ".b" }, db:names(p .. ".b"))
    local s, count = db:sum(p .. ".*")
    assert.equal(7, s)
    assert.equal(3, count)
    assert.same({ [p .. ".a"] = 1, [p .. ".b"] = 2, [p .. ".c"] = 4 }, db:values(p .. ".*"))
    local top = db:top(p .. ".*", 2)
    assert.same({ { name = p .. ".c", value = 4 }, { name = p .. ".b", value = 2 } }, top)
    assert.is_true(db:drop(p .. ".b"))
    assert.same({ p .. ".a", p .. ".c" }, db:names(p .. ".*"))
    local ok, msg, code = db:drop(p .. ".b")
    assert.is_nil(ok)
    assert.matches("no such counter", msg)
    assert.equal("ENOENT", code)
    assert.is_nil(db:value(p .. ".b"))
    assert.is_true(db:stats().counters >= 2)
    assert.equal("redis", db:stats().kind)
    -- families: newest matching wins
    local f = fresh("fam")
    assert.is_true(db:family(f .. ".*", { shards = 3, policy = "random" }))
    assert.is_true(db:family(f .. ".x*", { shards = 5 }))
    assert.same({ name = f .. ".y", shards = 3, policy = "random" }, db:counter(f .. ".y"):info())
    assert.same({ name = f .. ".xz", shards = 5, policy = "thread" }, db:counter(f .. ".xz"):info())
    assert.matches("unknown option 'metric'",
      helper.err(db.family, db, f .. "*", { metric = "m" }), 1, true)
    db:close()
  end))

  -- ACL SETUSER default RULE... on the standalone server: refuses a command
  -- (or a key) the way a node down or a lost connection does in the field
  local function acl(...) assert.equal("OK", redis.cli(srv.standalone, "ACL", "SETUSER", "default", ...)) end

  it("finishes a create or a drop that failed midway when run again", function()
    -- one command of each refused
    local db = assert(tally.open(srv.uri))
    local x, y = fresh("half-x"), fresh("half-y")
    local ok, err = pcall(function()
      acl("-sadd")
      local c, msg, code = db:counter(x)
      assert.is_nil(c)
      assert.matches("NOPERM", msg)
      assert.equal("EREDIS", code)
      acl("+sadd")
      assert.is_true(db:incr(x, 7))
      assert.same({ x }, db:names(x))
      assert.equal(7, (db:sum(x)))
      assert.is_true(db:incr(y, 5))
      acl("-srem")
      assert.is_nil((db:drop(y)))
      acl("+srem")
      assert.is_true(db:drop(y))
      assert.same({}, db:names(y))
      assert.equal(0, db:counter(y):value())  -- created again: nothing of the old one
    end)
    acl("+@all")
    db:close()
    assert(ok, err)
  end)

  it("lists and drops no name without meta; a create refused midway leaves none", both(function(uri)
    -- a name without meta: a db:counter racing a drop puts it back
    local db = assert(tally.open(uri))
    local r = assert(core.redis(uri))
    local x, y = fresh("nometa-x"), fresh("nometa-y")
    assert.equal(1, r:command("SADD", "tally:names", x))
    assert.equal(1, r:command("SADD", "tally:names", y))
    assert.equal(1, r:command("HSET", "tally:{" .. y .. "#0}", "v", "5")) -- a flusher's, not registered
    assert.is_true(db:incr(fresh("nometa-z"), 2))
    assert.same({}, db:names(x))
    assert.equal(1, #db:names("nometa-*"))
    assert.equal(#db:names(), db:stats().counters)
    assert.same({ 0, 0 }, { db:sum(x) })
    for _, nm in ipairs({ x, y }) do
      local ok, msg, code = db:drop(nm)
      assert.is_nil(ok)
      assert.equal(("no such counter '%s'"):format(nm), msg)
      assert.equal("ENOENT", code)
      assert.equal(0, r:command("SISMEMBER", "tally:names", nm)) -- taken out
    end
    assert.equal("5", r:command("HGET", "tally:{" .. y .. "#0}", "v")) -- left alone
    assert.equal(5, db:counter(y, { shards = 1 }):value())
    assert.same({ y }, db:names(y))
    r:close()
    db:close()
  end))

  it("refused midway, a create leaves no name; a drop's meta is listed again on open", function()
    local db = assert(tally.open(srv.uri))
    local x, y = fresh("half2-x"), fresh("half2-y")
    local ok, err = pcall(function()
      acl("-eval") -- the create's meta hash
      local c, msg, code = db:counter(x)
      assert.is_nil(c)
      assert.matches("NOPERM", msg)
      assert.equal("EREDIS", code)
      acl("+eval")
      assert.same({}, db:names(x))
      -- a drop whose last step (DEL of the meta hash) is refused
      assert.is_true(db:incr(y, 5))
      acl("resetkeys", "~tally:{*", "~tally:names", "%R~tally:meta:*")
      assert.is_nil((db:drop(y)))
      acl("allkeys")
      assert.same({}, db:names(y))
      local cy = db:counter(y)      -- before the drop is run again
      assert.is_true(cy:incr(3))
      assert.same({ y }, db:names(y))
      assert.same({ 3, 1 }, { db:sum(y) })
      assert.same({ { name = y, value = 3 } }, db:top(y, 5))
      assert.is_true(db:drop(y))
      assert.same({}, db:names(y))
    end)
    acl("+@all", "allkeys")
    db:close()
    assert(ok, err)
  end)

  it("says ERANGE for a value, a sum or a reset beyond int64, as the file store", function()
    local db = assert(tally.open(srv.uri))
    local name = fresh("big")
    local c = assert(db:counter(name, { shards = 2, policy = "round_robin" }))
    assert.is_true(c:incr(math.maxinteger))
    assert.is_true(c:incr(2))
    local why = "counter '" .. name .. "': value does not fit in 64 bits"
    assert.same({ nil, why, "ERANGE" }, { c:value() })
    assert.same({ nil, why, "ERANGE" }, { db:value(name) })
    local ok, msg, code = db:sum(name)
    assert.same({ nil, "ERANGE" }, { ok, code })
    assert.matches("does not fit in 64 bits", msg, 1, true)
    assert.same({ nil, "counter '" .. name .. "': the amount to remove does not fit in 64 bits; "
                       .. "nothing was removed", "ERANGE" }, { c:reset() })
    local shards = c:shards()
    table.sort(shards)
    assert.same({ 2, math.maxinteger }, shards)   -- given back
    db:drop(name)
    db:close()
  end)

  it("reads the totals db:flush_to wrote from a local file store", function()
    local name = fresh("flushed")
    local path = helper.tmpfile()
    local loc = assert(tally.open("file:" .. path))
    local rf = loc:flush_to(srv.cluster_uri, { shards = 8, writer = fresh("w") })
    loc:incr(name, 123)
    local st = assert(rf:flush_now())
    assert.equal(1, st.flushed)
    local db = assert(tally.open(srv.cluster_uri))
    local c = db:counter(name, { shards = 8 })
    assert.equal(123, c:value())
    assert.equal(rf:remote_value(name), c:value())
    c:incr(7)
    assert.equal(130, rf:remote_value(name))
    rf:close()
    loc:close()
    os.remove(path)
    os.remove(path .. ".writer")
    db:close()
  end)

  it("raises a clear error for every unsupported method", function()
    local db = assert(tally.open(srv.uri))
    local c = db:counter(fresh("u"))
    for _, m in ipairs({ "reshard", "add_shard", "rollup", "tick", "history", "rolled",
                         "export", "import", "check", "sync", "flush_to", "run", "mappings" }) do
      local obj = (m == "reshard" or m == "add_shard" or m == "history" or m == "rolled") and c or db
      assert.equal(m .. " is not supported by the redis store", helper.err(obj[m], obj, 1))
    end
    assert.matches("top by rate is not supported", helper.err(db.top, db, 3, nil, "rate"), 1, true)
    db:close()
  end)

  it("gives nil, message, code for bad URIs and a server that is down", function()
    for _, u in ipairs({ "redis://", "redis://127.0.0.1:0", "redis://127.0.0.1:x", "redis://a:1,b:2",
                         "redis://127.0.0.1:1/2", "redis://user:pw@bad host:1", "redis+cluster://127.0.0.1:1," }) do
      local db, msg, code = tally.open(u)
      assert.is_nil(db)
      assert.matches("bad Redis URI", msg, 1, true)
      assert.is_nil(msg:find("pw", 1, true))
      assert.equal("EINVAL", code)
    end
    local db, msg, code = tally.open("redis://127.0.0.1:1", { timeout = 0.5 })
    assert.is_nil(db)
    assert.matches("127.0.0.1:1", msg, 1, true)
    assert.is_string(code)
    db, msg, code = tally.open("redis+cluster://127.0.0.1:1,127.0.0.1:2", { timeout = 0.5 })
    assert.is_nil(db)
    assert.is_string(msg)
    assert.is_string(code)
    assert.matches("unknown option 'mode'", helper.err(tally.open, srv.uri, { mode = 384 }), 1, true)
    -- file and memory specs still go to the C open
    assert.matches("unknown store", helper.err(tally.open, "foo:x"), 1, true)
    assert.is_not_nil(tally.open("memory"))
  end)
end)

describe("the redis store with replicas = N (WAIT)", function()
  it("acknowledges an increment once N replicas have it, else says so", function()
    local rep = redis.start_standalone({ "--replicaof", "127.0.0.1", tostring(srv.standalone) })
    local ok, err = pcall(function()
      -- the replica's link up
      for _ = 1, 200 do
        if redis.cli(rep.port, "INFO", "replication"):find("master_link_status:up", 1, true) then break end
        tally.sleep(0.05)
      end
      local db = assert(tally.open(srv.uri, { replicas = 1, replica_timeout = 2000 }))
      assert.same({ 1, 2000 }, { db:stats().replicas, db:stats().replica_timeout })
      local name = fresh("wait")
      local c = assert(db:counter(name, { shards = 2 }))
      for _ = 1, 20 do assert.is_true(c:incr()) end
      assert.is_true(db:incr(name, 5))
      assert.is_true(c:decr(2))
      -- the replica has every acknowledged increment
      local function on_replica(i)
        return tonumber(redis.cli(rep.port, "HGET", "tally:{" .. name .. "#" .. i .. "}", "v")) or 0
      end
      assert.equal(23, on_replica(0) + on_replica(1))
      -- two replicas asked, one there: applied on the master, reported
      local db2 = assert(tally.open(srv.uri, { replicas = 2, replica_timeout = 50 }))
      local v, msg, code = db2:incr(name, 100)
      assert.is_nil(v)
      assert.equal("EREPLICAS", code)
      assert.matches("applied on the master but acknowledged by 1 of 2 replicas within 50 ms",
                     msg, 1, true)
      assert.equal(123, db2:value(name))
      db:close()
      db2:close()
    end)
    rep.stop()
    assert(ok, err)
  end)

  it("checks the options", function()
    assert.matches("replicas must be an integer from 1",
      helper.err(tally.open, srv.uri, { replicas = 0 }), 1, true)
    assert.matches("replica_timeout must be an integer number of milliseconds",
      helper.err(tally.open, srv.uri, { replicas = 1, replica_timeout = 0.5 }), 1, true)
    assert.matches("replica_timeout needs replicas",
      helper.err(tally.open, srv.uri, { replica_timeout = 10 }), 1, true)
    local r = assert(core.redis(srv.uri))
    assert.matches("replicas must be an integer",
      helper.err(r.command_wait, r, -1, 10, "PING"), 1, true)
    local v, acked = r:command_wait(0, 10, "INCR", fresh("cw"))
    assert.same({ 1, 0 }, { v, acked })
    r:close()
  end)
end)
