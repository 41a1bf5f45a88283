-- Counter values beyond 2^53 under LuaJIT: returned as int64_t cdata, never
-- rounded; inputs must be exact.
local helper = require "spec.luajit.helper"
local tally = require "tally"
local ffi = require "ffi"

local int64 = ffi.typeof("int64_t")
local uint64 = ffi.typeof("uint64_t")
local function I(s) return require("tally.compat").tointeger(s) end  -- exact from text

for _, path in ipairs(helper.paths) do
  describe("int64 values (" .. path .. " path)", function()
    local db
    before_each(function()
      helper.use(path)
      db = assert(tally.open())
    end)
    after_each(function()
      db:close()
      helper.use("ffi")
    end)

    it("are plain numbers up to 2^53 and int64_t cdata beyond", function()
      local c = db:counter("edge", { shards = 4, policy = "thread" })
      c:incr(2^53)
      assert.equal("number", type(c:value()))
      assert.equal(2^53, c:value())
      c:incr()
      local v = c:value()
      assert.equal("cdata", type(v))
      assert.is_true(ffi.istype(int64, v))
      assert.equal("9007199254740993LL", tostring(v))
      assert.equal("9007199254740993LL", tostring(db:value("edge")))
      c:decr(2)
      assert.equal(2^53 - 1, c:value())
      assert.equal("number", type(c:value()))
      c:decr(int64(2^53) * 2)
      assert.equal("-9007199254740993LL", tostring(c:value()))
      c:decr(-1)
      assert.equal(-2^53, c:value())
      assert.equal("number", type(c:value()))
    end)

    it("take int64_t and uint64_t decrements in a batch as c:decr does", function()
      local a = db:counter("a", { policy = "slot" })
      assert.is_true(db:batch(function(b) b:decr(a, int64(2)^60); b:decr(a, uint64(3)) end))
      assert.equal("-1152921504606846979LL", tostring(a:value()))
      -- refused as c:decr refuses them, and nothing is added
      local U = uint64(-1)                              -- beyond int64_t
      assert.has_error(function() a:decr(U) end)
      assert.has_error(function() db:batch(function(b) b:decr(a, U) end) end)
      assert.has_error(function() a:decr(2^60) end)     -- a double beyond 2^53: inexact
      assert.has_error(function() db:batch(function(b) b:decr(a, 2^60) end) end)
      assert.is_true(db:batch(function(b) b:decr(a, "5") end))
      assert.equal("-1152921504606846984LL", tostring(a:value()))
    end)

    it("take decimal integer strings exactly, as Lua 5.4 does, beyond 2^53 too", function()
      local c = db:counter("str", { shards = 2, policy = "random" })
      assert.is_true(c:incr("9007199254740993"))
      assert.equal("9007199254740993LL", tostring(c:value()))
      assert.is_true(db:incr("str", " -9007199254740994 "))     -- spaces and a sign, as Lua's
      assert.equal(-1, c:value())
      assert.is_true(c:decr("+1152921504606846976"))
      assert.equal("-1152921504606846977LL", tostring(c:value()))
      -- other numeric strings convert as LuaJIT reads them, and are checked
      -- as numbers are
      assert.is_true(c:incr("0x10"))
      assert.is_true(c:incr("2e3"))
      assert.equal("-1152921504606844961LL", tostring(c:value()))
      assert.has_error(function() c:incr("1.5") end)
      assert.has_error(function() c:incr("99999999999999999999") end)   -- beyond int64_t
      assert.has_error(function() c:incr("12abc") end)
      assert.equal("-1152921504606844961LL", tostring(c:value()))
    end)

    it("take int64_t and uint64_t increments exactly", function()
      local c = db:counter("big", { shards = 2, policy = "round_robin" })
      c:incr(int64(2)^60)
      c:incr(uint64(3))
      c:decr(int64(1))
      db:incr("big", int64(2)^60 + 7)
      db:decr("big", uint64(5))
      assert.equal("2305843009213693956LL", tostring(c:value()))
      assert.equal(tostring(c:value()), tostring(db:value("big")))
      assert.is_true(db:value("big") - int64(2)^61 == 4)
      local sh = c:shards()
      assert.equal(2, #sh)
      assert.equal(c:value(), sh[1] + sh[2])
      assert.equal(tostring(I("2305843009213693956")), tostring(c:reset()))
      assert.equal(0, c:value())
    end)

    it("come back exact from shards, reset, sum and add_shard", function()
      local c = db:counter("parts", { shards = 3, policy = "thread" })
      local big = I("4611686018427387903")         -- 2^62 - 1, a shard's maximum
      assert.is_true(c:add_shard(1, big))
      assert.is_true(c:add_shard(2, uint64(12345)))
      assert.is_true(c:add_shard(3, -big))
      assert.same({ "4611686018427387903LL", "12345", "-4611686018427387903LL" },
                  { tostring(c:shards()[1]), tostring(c:shards()[2]), tostring(c:shards()[3]) })
      assert.equal(12345, c:value())
      db:counter("other"):add_shard(1, big)
      local sum, n = db:sum("*")
      assert.equal("4611686018427400248LL", tostring(sum))
      assert.equal(2, n)
      assert.equal(12345, c:reset())
      assert.same({ 0, 0, 0 }, c:shards())
    end)

    it("report ERANGE when a shard or the sum would leave its range", function()
      local c = db:counter("r", { shards = 2, policy = "thread" })
      local max = I("4611686018427387903")
      assert.is_true(c:incr(max))
      local ok, err, code = c:incr(1)
      assert.is_nil(ok)
      assert.equal("ERANGE", code)
      assert.is_string(err)
      ok, err, code = db:incr("r", int64(1))
      assert.is_nil(ok)
      assert.equal("ERANGE", code)
      assert.equal(tostring(max), tostring(c:value()))
      -- a sum beyond int64_t: 2 shards of 2^62-1 plus
      local w = db:counter("wide", { shards = 4, policy = "thread" })
      for i = 1, 3 do w:add_shard(i, max) end
      local v, verr, vcode = w:value()
      assert.is_nil(v)
      assert.equal("ERANGE", vcode)
      assert.is_string(verr)
      v, verr, vcode = db:value("wide")
      assert.is_nil(v)
      assert.equal("ERANGE", vcode)
    end)
  end)
end

describe("tally.core alone under LuaJIT", function()
  it("returns values within 2^53 and refuses to round larger ones", function()
    local out, rc = helper.spawn([[
      local core = require "tally.core"
      local db = core.open()
      local c = db:counter("x")
      c:incr(2^53)
      io.write(tostring(c:value()), "\n")
      c:incr(1)
      local ok, err = pcall(c.value, c)
      io.write(tostring(ok), " ", err, "\n")
      io.write(tostring(pcall(c.incr, c, require("ffi").new("int64_t", 1))), "\n")
    ]]).wait()
    assert.equal(0, rc, out)
    assert.equal("9.007199254741e+15\n"
      .. "false a value beyond +-2^53 cannot be returned exactly as a LuaJIT number: "
      .. "require \"tally\" (it registers the int64_t box)\n"
      .. "false\n", out)
  end)
end)

describe("tally.core's tables of values under LuaJIT", function()
  it("refuses a value beyond 2^53 without the box, and builds none of the table", function()
    local out, rc = helper.spawn([[
      local core = require "tally.core"
      local db = core.open()
      db:counter("small"):incr(7)
      local c = db:counter("x")
      c:incr(2^53)
      c:incr(2)
      for _, f in ipairs({ core.snapshot, db._values }) do
        local t, err, code = f(db)
        io.write(tostring(t), " ", code, " ", err, "\n")
      end
      local t = core.snapshot(db, "small")
      io.write(t.small, "\n")
    ]]).wait()
    assert.equal(0, rc, out)
    assert.equal("nil ERANGE a value beyond 2^53 (require \"tally\")\n"
      .. "nil ERANGE a value beyond 2^53 (require \"tally\")\n"
      .. "7\n", out)
  end)
end)

describe("tally.compat under LuaJIT", function()
  local compat = require "tally.compat"

  it("parses decimal text exactly", function()
    assert.equal("9007199254740993LL", tostring(compat.tointeger("9007199254740993")))
    assert.equal("-9223372036854775808LL", tostring(compat.tointeger("-9223372036854775808")))
    assert.equal(12, compat.tointeger(" 12 "))
    assert.equal(0, compat.tointeger("-0"))
    assert.equal(16, compat.tointeger("0x10"))
    assert.is_nil(compat.tointeger("9223372036854775808"))
    assert.is_nil(compat.tointeger("1.5"))
    assert.is_nil(compat.tointeger(0 / 0))
    assert.equal(5, compat.tointeger(int64(5)))
  end)

  it("writes integers exactly", function()
    assert.equal("0", compat.int_text(-0.0))
    assert.equal("9007199254740992", compat.int_text(2^53))
    assert.equal("4611686018427387904", compat.int_text(2^62))
    assert.equal("-9223372036854775808", compat.int_text(compat.tointeger("-9223372036854775808")))
    assert.equal("18446744073709551615", compat.int_text(uint64(0) - 1))
    assert.is_nil(compat.int_text(1.5))
    assert.is_nil(compat.int_text(2^63))
    assert.is_nil(compat.int_text("5"))
  end)

  it("does integer arithmetic like Lua 5.4", function()
    local code = {}
    local cases = {}
    local vals = { 7, -7, 2, -2, 1000, 1700000000123, -1, 0, 2^52, 2^53 - 1, 4503599627370497 }
    for _, a in ipairs(vals) do
      for _, b in ipairs(vals) do
        if b ~= 0 then
          cases[#cases + 1] = { a, b }
          code[#code + 1] = ("print(%s // %s, %s %% %s, %s * %s, %s + %s, %s - %s)"):format(
            compat.int_text(a), compat.int_text(b), compat.int_text(a), compat.int_text(b),
            compat.int_text(a), compat.int_text(b), compat.int_text(a), compat.int_text(b),
            compat.int_text(a), compat.int_text(b))
        end
      end
    end
    local f = helper.tmpfile("arith.lua")
    local h = assert(io.open(f, "w"))
    h:write(table.concat(code, "\n"), "\n")
    h:close()
    local out, rc = helper.sh(helper.q(helper.lua54) .. " " .. helper.q(f))
    assert.equal(0, rc, out)
    local i = 0
    for line in out:gmatch("[^\n]+") do
      i = i + 1
      local a, b = cases[i][1], cases[i][2]
      local got = table.concat({ compat.int_text(compat.idiv(a, b)), compat.int_text(compat.mod(a, b)),
        compat.int_text(compat.mul(a, b)), compat.int_text(compat.add(a, b)),
        compat.int_text(compat.sub(a, b)) }, "\t")
      assert.equal(line, got, compat.int_text(a) .. ", " .. compat.int_text(b))
    end
    assert.equal(#cases, i)
  end)

  it("checks UTF-8 as Lua 5.4's utf8.len does", function()
    local strs = { "", "abc", "h\195\169llo", "\226\130\172", "\240\157\132\158", "\255",
      "\192\128", "\193\191", "\224\128\128", "\224\160\128", "\237\159\191", "\237\160\128",
      "\237\191\191", "\238\128\128", "\240\143\191\191", "\240\144\128\128", "\244\143\191\191",
      "\244\144\128\128", "\245\128\128\128", "\226\130", "a\128", "\194", "\194\127",
      "\223\191", "\239\191\191x" }
    local code = {}
    for i, s in ipairs(strs) do code[i] = ("print((utf8.len(%q)))"):format(s) end
    local f = helper.tmpfile("utf8.lua")
    local h = assert(io.open(f, "w"))
    h:write(table.concat(code, "\n"), "\n")
    h:close()
    local out, rc = helper.sh(helper.q(helper.lua54) .. " " .. helper.q(f))
    assert.equal(0, rc, out)
    local i = 0
    for line in out:gmatch("[^\n]+") do
      i = i + 1
      assert.equal(line, tostring((compat.utf8len(strs[i]))), "string " .. i)
    end
    assert.equal(#strs, i)
  end)
end)

describe("tally.json under LuaJIT", function()
  local json = require "tally.json"

  it("encodes int64_t cdata exactly and bytes that are not UTF-8 as \\udcXX", function()
    assert.equal('{"big":9007199254740993,"n":-9223372036854775808,"p":"bytes:\\udcff*","r":0.1}',
                 json.encode({ big = int64(2^53) + 1, n = I("-9223372036854775808"),
                               p = "bytes:\255*", r = 0.1 }))
    assert.equal("[1000000000000000]", json.encode({ 1e15 }))
    assert.same({ nil, "cannot write a cdata as JSON" }, { json.encode({ ffi.new("double", 1.5) }) })
  end)
end)
