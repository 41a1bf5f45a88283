-- A module built for one Lua never loads into the other: require fails
-- with an error (dlopen's undefined symbol), never a crash or a module
-- that misbehaves.
local helper = require "spec.luajit.helper"

describe("loading the wrong build", function()
  it("refuses the Lua 5.4 module in LuaJIT", function()
    local out, rc = helper.spawn(([[
      package.cpath = %q
      local ok, err = pcall(require, "tally.core")
      io.write(tostring(ok), "\n", tostring(err), "\n")
      ok, err = pcall(require, "tally")
      io.write(tostring(ok), "\n")
    ]]):format(helper.build54 .. "/?.so"), nil).wait()
    assert.equal(0, rc, out)
    assert.matches("^false\nerror loading module 'tally.core' from file '[^']*" .. "/tally/core%.so':", out)
    assert.matches("undefined symbol: lua", out)
    assert.matches("\nfalse\n$", out)
  end)

  it("refuses the LuaJIT module in Lua 5.4", function()
    local code = ("package.cpath = %q; local ok, err = pcall(require, 'tally.core'); "
                  .. "io.write(tostring(ok), '\\n', tostring(err), '\\n')"):format(helper.build .. "/?.so")
    local out, rc = helper.sh(helper.q(helper.lua54) .. " -e " .. helper.q(code))
    assert.equal(0, rc, out)
    assert.matches("^false\nerror loading module 'tally.core' from file '[^']*/luajit/tally/core%.so':", out)
    assert.matches("undefined symbol: luaJIT_setmode", out, 1, true)
  end)

  it("finds every Lua file of the module valid LuaJIT", function()
    local out = helper.sh("ls " .. helper.q(helper.build .. "/tally"))
    local n = 0
    for name in out:gmatch("([%w_]+%.lua)\n") do
      local f, err = loadfile(helper.build .. "/tally/" .. name)
      assert(f, err)
      n = n + 1
    end
    assert.is_true(n >= 9)
  end)
end)
