-- The Lua side behaves the same under LuaJIT and Lua 5.4: one scenario
-- (rollups with injected time, rolled records, history, function and file
-- sinks, Prometheus text, export and import, the record encoders, values
-- beyond 2^53) run by lua5.4 against build/ and by luajit against
-- build/luajit through both paths prints the same text.
local helper = require "spec.luajit.helper"

local SCENARIO = "spec/luajit/fixtures/scenario.lua"

local function run(interp, build, env)
  local dir = helper.tmpfile("scenario")
  assert(os.execute("mkdir -p " .. helper.q(dir)))
  local out, rc = helper.sh((env and env .. " " or "") .. helper.q(interp) .. " "
                            .. helper.q(SCENARIO) .. " " .. helper.q(build) .. " " .. helper.q(dir))
  assert.equal(0, rc, out)
  assert.matches("\ndone\n$", out)
  return out
end

describe("the Lua side under LuaJIT and Lua 5.4", function()
  it("prints the same scenario through lua5.4, the FFI path and the classic one", function()
    local lua54 = run(helper.lua54, helper.build54)
    local viaffi = run(helper.luajit, helper.build)
    local classic = run(helper.luajit, helper.build, "TALLY_NO_FFI=1")
    assert.equal(lua54, viaffi)
    assert.equal(lua54, classic)
    -- and it did go through values beyond 2^53 and the sinks
    assert.matches('likes_total{post=\\"2\\"} 4611686018427387003', viaffi, 1, true)
    assert.matches('tally_value{counter=\\"neg\\"} -9007199254740993', viaffi, 1, true)
    assert.matches('fn sink 8: "{\\"name\\":\\"post:2:likes\\",\\"value\\":4611686018427387003,',
                   viaffi, 1, true)
    assert.matches('"count\\":\\"-9007199254740993\\"}', viaffi, 1, true)
    -- and through names that are not UTF-8, and a counter given twice
    assert.matches('"x\\\\udcff\\":{\\"num_shards', viaffi, 1, true)
    assert.matches('odd names: {1="x\\\\udcff",2="x\255",3="\237\160\128"}', viaffi, 1, true)
    assert.matches("export odd again: true\n", viaffi, 1, true)
    assert.matches("import twice: \"import: counter 'b' is given twice\"\n", viaffi, 1, true)
  end)
end)
