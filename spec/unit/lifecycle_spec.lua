-- Counter lifecycle: idle expiry through db:tick, handles that outlive
-- their counter, caps on a family, reuse of retired space, and what
-- db:stats(), db:grace() and c:info() say about it.
local helper = require "spec.support.helper"
local tally = require "tally"

local q, err = helper.q, helper.err

local T = 1700000040             -- a made-up clock (seconds): ticks get it explicitly

-- Start a tally process in the background with the store at path open,
-- running code (db is the store); it prints "ready" once that is done and
-- then sleeps. Returns the pipe and the process's pid.
local function holder(path, code)
  local script = helper.tmpfile("holder.lua")
  helper.write(script, "local tally = require 'tally'\n"
               .. "local db = assert(tally.open('file:' .. arg[1]))\n" .. code .. "\n"
               .. "print('ready') io.stdout:flush() tally.sleep(60)\n")
  local p = assert(io.popen("sh -c 'echo $$; exec \"$0\" \"$@\"' " .. q(helper.bin) .. " "
                            .. q(script) .. " " .. q(path) .. " 2>&1", "r"))
  local pid = math.tointeger(tonumber(p:read("l")))
  assert.equal("ready", p:read("l"))
  return p, pid
end

local function stop(p, pid)
  os.execute("kill " .. pid)
  p:close()                      -- reaped: a zombie would still pass for alive
end

describe("db:family() lifecycle options", function()
  local db
  before_each(function() db = assert(tally.open()) end)
  after_each(function() db:close() end)

  it("checks idle and max_counters", function()
    assert.equal("bad argument #2 to 'family' (idle must be an integer number of seconds "
                 .. "from 0 to 4294967295, got -1)", err(db.family, db, "a:*", { idle = -1 }))
    assert.equal("bad argument #2 to 'family' (idle must be an integer number of seconds "
                 .. "from 0 to 4294967295, got 1.5)", err(db.family, db, "a:*", { idle = 1.5 }))
    assert.equal("bad argument #2 to 'family' (idle must be an integer number of seconds "
                 .. "from 0 to 4294967295, got '60')", err(db.family, db, "a:*", { idle = "60" }))
    assert.matches("idle must be an integer number of seconds from 0 to 4294967295, got 4294967296",
                   err(db.family, db, "a:*", { idle = 2^32 }), 1, true)
    assert.equal("bad argument #2 to 'family' (max_counters must be an integer >= 0, got -1)",
                 err(db.family, db, "a:*", { max_counters = -1 }))
    assert.equal("bad argument #2 to 'family' (max_counters must be an integer >= 0, got true)",
                 err(db.family, db, "a:*", { max_counters = true }))
    assert.equal("bad argument #2 to 'family' (unknown option 'idel')",
                 err(db.family, db, "a:*", { idel = 5 }))
    assert.is_true(db:family("a:*", { idle = 4294967295, max_counters = 0, shards = 2 }))
    assert.equal(2, db:counter("a:1"):info().shards)  -- the shared options still apply
  end)

  it("takes them through the Prometheus wrapper too (metric options)", function()
    assert.is_true(db:family("m:*", { metric = "m_total", labels = { "id" }, idle = 10,
                                      max_counters = 1 }))
    db:incr("m:1")
    db:incr("m:2")
    assert.same({ "m:1", "m:_overflow" }, db:names("m:*"))
    assert.equal(1, db:stats().capped)
  end)
end)

describe("idle expiry", function()
  local db
  before_each(function() db = assert(tally.open()) end)
  after_each(function() db:close() end)

  it("drops a family's counter whose value stood still idle seconds, through db:tick", function()
    db:family("s:*", { idle = 10 })
    db:incr("s:still", 5)
    db:incr("s:moving", 1)
    db:incr("other", 1)                 -- no idle family: never expires
    assert.same({}, db:tick(T))         -- the first scan notes each value and when
    db:incr("s:moving")
    db:tick(T + 5)
    assert.same({ "other", "s:moving", "s:still" }, db:names())
    db:incr("s:moving")
    db:tick(T + 11)                     -- s:still has not moved for 11 s
    assert.same({ "other", "s:moving" }, db:names())
    assert.equal(1, db:stats().expired)
    assert.same({ nil, "no such counter 's:still'", "ENOENT" }, { db:value("s:still") })
    db:tick(T + 30)                     -- s:moving moved at T + 11: 19 s ago
    assert.same({ "other" }, db:names())
    assert.equal(2, db:stats().expired)
    assert.equal(1, db:value("other"))
  end)

  it("expires nothing before idle seconds have passed since the value was seen", function()
    db:family("s:*", { idle = 10 })
    db:incr("s:1")
    local r = db:maintain(T * 1000)
    assert.same({ scanned = 1, expired = 0, held = 0 }, r)
    r = db:maintain((T + 9) * 1000 + 999)
    assert.same({ scanned = 1, expired = 0, held = 0 }, r)
    r = db:maintain((T + 10) * 1000)
    assert.same({ scanned = 1, expired = 1, held = 0 }, r)
    assert.same({}, db:names())
  end)

  it("runs in db:tick without any rollup schedule, and db:maintain checks its arguments", function()
    assert.equal(0, #db:schedules())
    db:family("s:*", { idle = 1 })
    db:incr("s:1")
    db:tick(T)
    db:tick(T + 1.5)                    -- fractional seconds: milliseconds count
    assert.same({}, db:names())
    assert.equal("bad argument #1 to 'maintain' (time in milliseconds (an integer from 0 to "
                 .. "4294967293000) expected, got -1)", err(function() db:maintain(-1) end))
    -- idle times are whole seconds in 32 bits: a time beyond is refused,
    -- where it overflowed (UBSan) and was cut short
    assert.matches("an integer from 0 to 4294967293000", err(function() db:maintain(math.maxinteger) end),
                   1, true)
    assert.matches("an integer from 0 to 4294967293000", err(function() db:maintain(4294967293001) end),
                   1, true)
    assert.is_table(db:maintain(4294967293000, 0))
    assert.same({}, db:tick(2 ^ 40))                 -- past 2106: upkeep skipped, nothing raised
    assert.equal("bad argument #2 to 'maintain' (budget must be an integer from 0 to "
                 .. "4294967295, got 1.5)", err(function() db:maintain(0, 1.5) end))
    db:incr("s:2")
    assert.same({ scanned = 0, expired = 0, held = 0 }, db:maintain(T * 1000, 0))
  end)

  it("lets a handle of an expired counter create it again, from the new increment", function()
    db:family("s:*", { idle = 10 })
    local c = db:counter("s:1", { shards = 4 })
    c:incr(7)
    local before = c:info().incarnation
    db:tick(T)
    db:tick(T + 10)
    assert.same({}, db:names())
    assert.equal(0, c:value())          -- the handle reads 0 meanwhile
    assert.same({ nil, "no such counter 's:1'", "ENOENT" }, { db:value("s:1") })
    assert.same({}, db:names())         -- reading made nothing
    assert.is_true(c:incr(2))           -- not EDROPPED: it is made again
    assert.equal(2, c:value())
    assert.equal(2, db:value("s:1"))
    assert.same({ "s:1" }, db:names())
    local info = c:info()
    assert.matches("^%x+$", info.incarnation)
    assert.equal(16, #info.incarnation)
    assert.not_equal(before, info.incarnation)    -- another counter by the same name
    -- by name too, through the store's cached handle
    db:tick(T + 20)
    db:tick(T + 40)
    assert.same({}, db:names())
    assert.is_true(db:incr("s:1", 3))
    assert.equal(3, db:value("s:1"))
    assert.equal(2, db:stats().expired)
  end)

  it("holds a counter a rollup covers until a rollup recorded its final value", function()
    local base = 1700000040             -- a multiple of 60
    db:family("r:*", { idle = 10 })
    db:rollup("r:*", { every = 60 })
    local c = db:counter("r:1")
    c:incr(3)
    db:tick(base)                       -- rolled up: 3
    c:incr(4)                           -- 7, which no rollup has recorded
    db:tick(base + 1)
    assert.same({ scanned = 1, expired = 0, held = 1 }, db:maintain((base + 20) * 1000))
    db:tick(base + 30)
    assert.same({ "r:1" }, db:names())
    db:tick(base + 60)                  -- the period's rollup records 7 (after the upkeep)
    assert.equal(7, c:rolled().value)
    assert.same({ "r:1" }, db:names())
    db:tick(base + 61)
    assert.same({}, db:names())
    assert.equal(1, db:stats().expired)
  end)
end)

describe("a shipped counter's expiry (core.ship, core.counter_ship)", function()
  it("waits for its value to be marked; a nil mark holds it whatever its value", function()
    local core = require "tally.core"
    local db = assert(tally.open())
    db:family("s:*", { idle = 10 })
    assert.is_true(core.ship(db, "w1", "s:*"))
    local c = db:counter("s:1")
    c:incr(5)
    local _, inc = core.counter_read(c)
    assert.is_true(core.counter_ship(c, inc, 5))
    assert.is_true(core.counter_ship(c, inc, nil))    -- a flush of it is out
    c:incr(-5)
    c:incr(5)                                         -- 5, the value last marked
    assert.same({ scanned = 1, expired = 0, held = 0 }, db:maintain(T * 1000))
    assert.same({ scanned = 1, expired = 0, held = 1 }, db:maintain((T + 20) * 1000))
    c:incr(-4)                                        -- 1 (nil was read as 1 before)
    assert.same({ scanned = 1, expired = 0, held = 0 }, db:maintain((T + 40) * 1000))
    assert.same({ scanned = 1, expired = 0, held = 1 }, db:maintain((T + 60) * 1000))
    assert.is_true(core.counter_ship(c, inc, 1))      -- read back
    assert.same({ scanned = 1, expired = 1, held = 0 }, db:maintain((T + 80) * 1000))
    assert.same({}, db:names())
    assert.equal("bad argument #3 to 'tally.core.counter_ship' (number expected, got table)",
                 err(core.counter_ship, c, inc, {}))
    db:close()
  end)
end)

describe("max_counters", function()
  it("sends new names past the cap to the family's overflow counter", function()
    local db = assert(tally.open())
    db:family("cap:*", { max_counters = 3 })
    for i = 1, 5 do assert.is_true(db:incr("cap:" .. i, i)) end
    assert.same({ "cap:1", "cap:2", "cap:3", "cap:_overflow" }, db:names("cap:*"))
    assert.equal(4 + 5, db:value("cap:_overflow"))
    assert.equal(15, (db:sum("cap:*")))          -- totals stay exact
    assert.equal(2, db:stats().capped)
    assert.is_true(db:incr("cap:2"))             -- names that have a counter keep it
    assert.equal(3, db:value("cap:2"))
    assert.equal(2, db:stats().capped)
    db:incr("free:1")                            -- other names are not capped
    assert.equal(2, db:stats().capped)
    db:close()
  end)
end)

describe("db:stats() lifecycle fields", function()
  it("are present and add up", function()
    local path = helper.tmpfile()
    local db = assert(tally.open("file:" .. path))
    for i = 1, 50 do db:incr("x:" .. i) end
    for i = 1, 20 do db:drop("x:" .. i) end
    db:counter("x:30"):reshard(32)
    local st = db:stats()
    for _, k in ipairs({ "live_bytes", "retired_bytes", "reusable_bytes", "reused_bytes",
                         "expired", "capped", "used_bytes", "file_bytes" }) do
      assert.equal("integer", math.type(st[k]), k)
      assert.is_true(st[k] >= 0, k)
    end
    assert.is_true(st.live_bytes > 0)
    assert.is_true(st.retired_bytes + st.reusable_bytes > 0)   -- 20 drops and a reshard
    assert.is_true(st.live_bytes + st.retired_bytes + st.reusable_bytes <= st.used_bytes)
    assert.is_true(st.used_bytes <= st.file_bytes)
    assert.equal(30, st.counters)
    db:close()
  end)
end)

describe("space reuse", function()
  it("hands dropped counters' space out again: the file stops growing", function()
    local path = helper.tmpfile()
    local script = helper.tmpfile("churn.lua")
    helper.write(script, [[
      local tally = require "tally"
      local db = assert(tally.open("file:" .. arg[1]))
      for r = 1, 5 do
        for i = 1, 2000 do assert(db:incr("churn:" .. r .. ":" .. i, i)) end
        for i = 1, 2000 do assert(db:drop("churn:" .. r .. ":" .. i)) end
        db:tick()
        local st = db:stats()
        print(st.file_bytes, st.used_bytes, st.reused_bytes, st.counters)
      end
    ]])
    local out, code = helper.sh("TALLY_GRACE_MS=0 " .. q(helper.bin) .. " " .. q(script) .. " "
                                .. q(path))
    assert.equal(0, code, out)
    local rows = {}
    for line in out:gmatch("[^\n]+") do
      local f, u, r, n = line:match("^(%d+)\t(%d+)\t(%d+)\t(%d+)$")
      assert.truthy(f, line)
      rows[#rows + 1] = { file = tonumber(f), used = tonumber(u), reused = tonumber(r),
                          counters = tonumber(n) }
    end
    assert.equal(5, #rows)
    assert.is_true(rows[5].reused > rows[1].reused)
    assert.is_true(rows[5].reused >= 4 * 2000 * 8)      -- at least the cells of 4 rounds
    assert.is_true(rows[5].used <= rows[2].used)        -- no growth after the first rounds
    assert.equal(rows[2].file, rows[5].file)
    assert.equal(0, rows[5].counters)
  end)

  it("waits for a process that holds a handle and has not passed a grace step", function()
    local path = helper.tmpfile()
    local db = assert(tally.open("file:" .. path))
    local g = db:grace()
    assert.same({ 1, 0, 0 }, { g.processes, g.behind, g.oldest_pid })
    local p, pid = holder(path, "local c = db:counter('held') db:maintain(0)")
    db:incr("gone")
    db:drop("gone")                                  -- retires space: a new epoch
    g = db:grace()
    assert.equal(2, g.processes)
    assert.equal(1, g.behind)
    assert.equal(pid, g.oldest_pid)
    assert.is_true(g.epoch > g.oldest_seen)
    stop(p, pid)
    g = db:grace()                                   -- a dead process holds nothing back
    assert.same({ 1, 0, 0 }, { g.processes, g.behind, g.oldest_pid })
    db:close()
  end)
end)
