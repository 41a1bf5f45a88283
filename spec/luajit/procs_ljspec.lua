-- A file store shared by several luajit processes counts exactly, through
-- the FFI path and the classic binding at once.
local helper = require "spec.luajit.helper"
local tally = require "tally"

local PROCS, EACH = 4, 50000

local WORKER = [[
  local tally = require "tally"
  local path, each, via = %q, %d, %q
  local db = assert(tally.open("file:" .. path))
  local c = db:counter("hits", { shards = 8, policy = "thread" })
  local r = db:counter("spread", { shards = 8, policy = "random" })
  for i = 1, each do
    c:incr()
    r:incr(2)
    db:incr("byname", 3)
    if i %% 1000 == 0 then db:decr("byname", 1000) end
  end
  local v = c:value()
  db:close()
  io.write("done ", tostring(tally.ffi), " ", via, "\n")
]]

describe("a file store shared by luajit processes", function()
  it("counts every increment exactly, FFI and classic writers mixed", function()
    local path = helper.tmpfile()
    local db = assert(tally.open("file:" .. path))
    db:counter("hits", { shards = 8, policy = "thread" })
    local kids = {}
    for i = 1, PROCS do
      local via = i % 2 == 0 and "classic" or "ffi"
      kids[i] = helper.spawn(WORKER:format(path, EACH, via),
                             via == "classic" and "TALLY_NO_FFI=1" or nil)
    end
    for i = 1, PROCS do
      local out, rc = kids[i].wait()
      assert.equal(0, rc, out)
      local via = i % 2 == 0 and "classic" or "ffi"
      assert.equal("done " .. tostring(via == "ffi") .. " " .. via .. "\n", out)
    end
    assert.equal(PROCS * EACH, db:value("hits"))
    assert.equal(PROCS * EACH * 2, db:value("spread"))
    assert.equal(PROCS * (EACH * 3 - EACH), db:value("byname"))
    local s = 0
    for _, v in ipairs(db:counter("spread"):shards()) do s = s + v end
    assert.equal(PROCS * EACH * 2, s)
    assert.is_true(db:check())
    db:close()
  end)

  it("counts exactly through stamps while another process moves the counters", function()
    -- two FFI writers add by name (through stamps once hit) to 60 names
    -- while a third process reshards a third of them away and back and
    -- makes new counters, with no grace time, so freed space is reused
    -- soon: every add counts once, in its own name (an add through a
    -- stamp whose cell was retired must go the handle's way), and the new
    -- counters keep their values
    local path, NAMES, ADDS = helper.tmpfile(), 60, 200000
    local db = assert(tally.open("file:" .. path))
    for i = 1, NAMES do db:incr("st:" .. i, 0) end
    local writer = [[
      local tally = require "tally"
      local db = assert(tally.open("file:" .. %q, { handle_admit = "always" }))
      local names, added, x = %d, {}, %d
      for k = 1, %d do
        x = (x * 1103515245 + 12345) %% 2147483648
        local i = x %% names + 1
        assert(db:incr("st:" .. i))
        added[i] = (added[i] or 0) + 1
        if k %% 500 == 0 then db:tick() end
      end
      local slots, stamps = require("tally.core")._store_slots(db), 0
      for _, v in pairs(slots) do if v >= 2^31 then stamps = stamps + 1 end end
      for i = 1, names do io.write(added[i] or 0, " ") end
      io.write(stamps, "\n")
      db:close()
    ]]
    local mover = [[
      local tally = require "tally"
      local db = assert(tally.open("file:" .. %q))
      for r = 1, 100 do
        for i = 1, %d, 3 do
          local c = assert(db:counter("st:" .. i))
          assert(c:reshard(r %% 2 == 1 and 4 or 1))
          c:close()
        end
        db:tick()
        for i = 1, 20 do db:incr("fill:" .. r .. ":" .. i, 1000 + i) end
      end
      io.write("moved\n")
      db:close()
    ]]
    local env = "TALLY_GRACE_MS=0"
    local kids = {
      helper.spawn(writer:format(path, NAMES, 7, ADDS), env),
      helper.spawn(writer:format(path, NAMES, 11, ADDS), env),
      helper.spawn(mover:format(path, NAMES), env),
    }
    local want = {}
    for k = 1, 2 do
      local out, rc = kids[k].wait()
      assert.equal(0, rc, out)
      local i = 0
      for v in out:gmatch("%d+") do
        i = i + 1
        if i <= NAMES then want[i] = (want[i] or 0) + tonumber(v)
        else assert.is_true(tonumber(v) > 0, "no stamps") end
      end
      assert.equal(NAMES + 1, i, out)
    end
    local out, rc = kids[3].wait()
    assert.equal(0, rc, out)
    assert.equal("moved\n", out)
    for i = 1, NAMES do assert.equal(want[i], db:value("st:" .. i), "st:" .. i) end
    for r = 1, 100 do
      for i = 1, 20 do assert.equal(1000 + i, db:value("fill:" .. r .. ":" .. i)) end
    end
    assert.is_true(db:check())
    db:close()
  end)

  it("shares values beyond 2^53 between processes exactly", function()
    local path = helper.tmpfile()
    local kids = {}
    for i = 1, 3 do
      kids[i] = helper.spawn(([[
        local tally, ffi = require "tally", require "ffi"
        local db = assert(tally.open("file:" .. %q))
        for _ = 1, 1000 do db:incr("big", ffi.new("int64_t", 2)^50) end
        db:close()
        io.write("ok\n")
      ]]):format(path), i == 2 and "TALLY_NO_FFI=1" or nil)
    end
    for i = 1, 3 do
      local out, rc = kids[i].wait()
      assert.equal(0, rc, out)
      assert.equal("ok\n", out)
    end
    local db = assert(tally.open("file:" .. path))
    assert.equal("3377699720527872000LL", tostring(db:value("big")))   -- 3000 * 2^50
    db:close()
  end)
end)
