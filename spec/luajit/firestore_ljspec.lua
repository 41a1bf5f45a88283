-- Cloud Firestore under LuaJIT: the firestore:// store, db:flush_to and
-- import of db:export's JSON against Google's Firestore emulator, as
-- spec/integration/firestore_spec.lua checks them under Lua 5.4 (skipped
-- with a message where the emulator is not installed). Lua 5.1 syntax.
local helper = require "spec.luajit.helper"
local path, cpath = package.path, package.cpath
local firestore = require "spec.support.firestore"  -- its helper puts the Lua 5.4
package.path, package.cpath = path, cpath            -- tree first: LuaJIT loads its own
local tally = require "tally"
local ffi = require "ffi"

local P = "projects/demo-tally/databases/(default)/documents/"

local missing = firestore.missing()
if missing then
  describe("firestore under LuaJIT", function() pending(missing) end)
  return
end

local emu
setup(function() emu = firestore.start() end)
teardown(function() if emu then emu.stop() end end)
before_each(function() emu.wipe() end)

local function int(n) return { integerValue = tostring(n) } end

local function fields_of(path)
  local _, got = emu.rest("POST", ":batchGet", { documents = { P .. path } })
  return got[1].found and got[1].found.fields
end

-- The shards' counts summed, as the seeds' getCount does.
local function shards_sum(id, n)
  local names = {}
  for i = 0, n - 1 do names[#names + 1] = P .. "counters/" .. id .. "/shards/" .. i end
  local _, got = emu.rest("POST", ":batchGet", { documents = names })
  local sum = 0
  for _, r in ipairs(got) do
    if r.found then sum = sum + tonumber(r.found.fields.count.integerValue) end
  end
  return sum
end

describe("firestore under LuaJIT", function()
  it("runs the firestore:// store: counters in the seeds' layout, exact", function()
    local db = assert(tally.open(emu.uri))
    local c = assert(db:counter("post:42:likes", { shards = 5 }))
    assert.same({ num_shards = int(5) }, fields_of("counters/post:42:likes"))
    for _ = 1, 20 do assert.is_true(c:incr()) end
    assert(c:incr(100))
    assert(c:decr(10))
    assert.equal(110, c:value())
    assert.equal(110, shards_sum("post:42:likes", 5))
    assert.equal(110, db:value("post:42:likes"))
    assert.same({ "post:42:likes" }, db:names("post:*"))
    -- beyond 2^53: exact, as the int64_t cdata the LuaJIT module uses
    local big = ffi.new("int64_t", 2 ^ 53) + 1
    assert(db:counter("big", { shards = 1 }):incr(big))
    assert.equal("9007199254740993LL", tostring(db:value("big")))
    assert.same(int("9007199254740993"), fields_of("counters/big/shards/0").count)
    db:close()
  end)

  it("flushes a file store exactly once, replies lost or not", function()
    local db = assert(tally.open("file:" .. helper.tmpfile()))
    local ff = db:flush_to(emu.uri, { writer = "lj", doc_interval = 0 })
    local h = ff:http()
    local c = db:counter("post:1:likes", { shards = 4 })
    local total = 0
    for round = 1, 6 do
      c:incr(round)
      total = total + round
      if round % 2 == 0 then h:lose_replies(1) end   -- applied, its reply lost
      ff:flush_now()
      assert(ff:sync(10))
      assert.equal(total, ff:remote_value("post:1:likes"))
    end
    assert.equal(0, ff:stats().pending)
    assert.same(int(total), fields_of("counters/post:1:likes/writers/lj").flushed)
    db:close()
  end)

  it("imports db:export's JSON, both ways", function()
    local loc = assert(tally.open())
    loc:counter("a", { shards = 2, policy = "random" }):incr(5)
    loc:counter("b:c", { shards = 3, policy = "random" }):incr(9)
    local text = assert(loc:export())
    local db = assert(tally.open(emu.uri))
    assert.equal(2, db:import(text))
    assert.equal(5, db:value("a"))
    assert.equal(9, db:value("b:c"))
    assert.equal(text, db:export())
    local back = assert(tally.open())
    assert.equal(2, back:import(assert(db:export())))
    assert.equal(9, back:value("b:c"))
    db:close()
  end)
end)
