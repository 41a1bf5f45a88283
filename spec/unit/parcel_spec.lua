-- tally.core.parcel: text handed between Lua states of one process by
-- number (tally.openresty's scrape on nginx's thread pool). The states are
-- one here; spec/integration/nginx_spec.lua hands a scrape across two.
local core = require "tally.core"

describe("a parcel", function()
  it("gives back what was appended by its number, in pieces of at most max bytes", function()
    local p = core.parcel()
    local id = p:id()
    assert.is_true(core.parcel_add(id, "abc"))
    assert.is_true(core.parcel_add(id, ""))
    assert.is_true(core.parcel_add(id, string.rep("x", 70000)))
    assert.equal(70003, p:size())
    assert.equal("ab", p:take(2))
    local rest = {}
    for piece in function() return p:take() end do
      assert.is_true(#piece <= 65536)
      rest[#rest + 1] = piece
    end
    assert.equal("c" .. string.rep("x", 70000), table.concat(rest))
    assert.equal(2, #rest)
    assert.is_nil(p:take())                     -- and stays taken
    p:free()
  end)

  it("keeps text longer than its blocks whole, however it was appended", function()
    local p = core.parcel()
    local parts, want = {}, {}
    for i = 1, 40 do                             -- 40 x 65,537 bytes: 2.5 MiB
      parts[i] = string.rep(string.char(64 + i), 65536) .. "\n"
      want[i] = parts[i]
      core.parcel_add(p:id(), parts[i])
    end
    core.parcel_add(p:id(), string.rep("z", 3 * 1048576))   -- longer than a block
    want[#want + 1] = string.rep("z", 3 * 1048576)
    local got = {}
    for piece in function() return p:take(100000) end do got[#got + 1] = piece end
    assert.equal(table.concat(want), table.concat(got))
    p:free()
  end)

  it("refuses an append once taking has begun, and one after it is freed", function()
    local p = core.parcel()
    local id = p:id()
    core.parcel_add(id, "ab")
    assert.equal("a", p:take(1))
    local ok, err = pcall(core.parcel_add, id, "c")
    assert.is_false(ok)
    assert.matches("parcel " .. id .. " is sealed", err, 1, true)
    assert.equal("b", p:take())                -- what was there, unchanged
    p:free()
    ok, err = pcall(core.parcel_add, id, "c")
    assert.is_false(ok)
    assert.matches("parcel " .. id .. " is gone", err, 1, true)
  end)

  it("is freed with its owner: the number then names nothing, and is never used again", function()
    local p = core.parcel()
    local id = p:id()
    p = nil  -- luacheck: ignore
    collectgarbage()
    collectgarbage()
    local ok, err = pcall(core.parcel_add, id, "late")
    assert.is_false(ok)
    assert.matches("parcel " .. id .. " is gone", err, 1, true)
    local q = core.parcel()
    assert.is_true(q:id() > id)
    q:free()
  end)

  it("checks its arguments", function()
    local p = core.parcel()
    assert.has_error(function() p:take(0) end)
    assert.has_error(function() core.parcel_add(p:id(), {}) end)
    assert.has_error(function() core.parcel_add("x", "a") end)
    p:free()
    p:free()                                    -- twice is harmless
    assert.has_error(function() p:id() end)
    assert.has_error(function() p:take() end)
    assert.equal(0, p:size())
  end)
end)
