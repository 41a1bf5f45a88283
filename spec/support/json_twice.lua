-- spec/support/json_twice.lua: tally.json.twice on a large document, for
-- Lua 5.4 (spec/unit/json_spec.lua) and LuaJIT (spec/luajit/json_ljspec.lua).
-- Refusing a key given twice must cost no more than reading the document:
-- twice took minutes under LuaJIT on names alike in the few bytes its
-- string hash reads. Lua 5.1 syntax.
--
-- run(helper, bt): bt the spec's describe, it and assert.
local json = require "tally.json"

local N = 20000           -- names; the old twice took 6 s under LuaJIT, decode 0.8 s

-- Name i: 40 bytes that are not UTF-8, the same but for bytes 26 to 28.
local function name(i)
  local a, b, c = 128 + i % 128, 128 + math.floor(i / 128) % 128, 128 + math.floor(i / 16384) % 128
  return string.rep("\200", 25) .. string.char(a, b, c) .. string.rep("\201", 12)
end

return function(helper, bt)
  local describe, it, assert = bt.describe, bt.it, bt.assert
  local _ = helper

  describe("tally.json.twice", function()
    it("names a key given twice among 20,000 binary names in less time than decode reads them", function()
      local parts = {}
      for i = 1, N do parts[i] = json.quote(name(i)) .. ":1" end
      local dup = name(12345)
      parts[N + 1] = json.quote(dup) .. ":2"
      -- the same key written as escapes of its bytes, and its first bytes
      -- raw (tally.json.quote writes \udcXX for each)
      local text = "{" .. table.concat(parts, ",") .. ',"x":{"\\u00e9":1,"\195\169":2}}'
      local t0 = os.clock()
      local v, keys = json.decode(text)
      local decode_s = os.clock() - t0
      assert.equal(N + 4, keys)
      assert.equal(2, v[dup])
      t0 = os.clock()
      local path = json.twice(text)
      local twice_s = os.clock() - t0
      assert.same({ dup }, path)
      assert.is_true(twice_s < decode_s, ("twice took %.3f s, decode %.3f s"):format(twice_s, decode_s))
      assert.same({ "x", "\195\169" }, json.twice('{"x":{"\\u00e9":1,"\195\169":2}}'))
      assert.same({ "\200\201" }, json.twice('{"\\udcc8\\udcc9":1,"\200\201":2}'))
    end)
  end)
end
