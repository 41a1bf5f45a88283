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
