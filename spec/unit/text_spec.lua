-- The core's rules for bytes as text, as the Lua side gets them
-- (src/lua/lua_text.c): core.utf8len is Lua 5.4's utf8.len, and
-- core.printable is tally_printable, the one rule for showing a name.
local core = require "tally.core"

local char = string.char

-- both results of f(s), for comparing a failure's position too
local function both(f, s)
  local a, b = f(s)
  return { a, b }
end

describe("core.utf8len", function()
  it("agrees with utf8.len at every boundary of the strict rule", function()
    local cases = {
      "", "abc", "\0", "\127",
      "\194\128", "\223\191", "\192\128", "\193\191",              -- 2 bytes; overlong
      "\224\160\128", "\224\159\191", "\239\191\191",              -- 3 bytes; overlong
      "\237\159\191", "\237\160\128", "\237\191\191",              -- surrogates
      "\240\144\128\128", "\240\143\191\191", "\244\143\191\191",  -- 4 bytes; overlong
      "\244\144\128\128", "\245\128\128\128", "\255",              -- past U+10FFFF
      "\128", "\191", "\194", "\224\160", "\240\144\128",          -- cut short
      "a\194\128b\226\130\172", "ok\237\160\128then",
    }
    for _, s in ipairs(cases) do
      assert.same(both(utf8.len, s), both(core.utf8len, s), ("%q"):format(s))
    end
  end)

  it("agrees with utf8.len on 20,000 random strings", function()
    local seed = 12345
    local function rnd(n)
      seed = (seed * 1103515245 + 12345) % 2147483648
      return seed % n
    end
    for _ = 1, 20000 do
      local t = {}
      for i = 1, rnd(8) + 1 do
        -- mostly the bytes that start or continue sequences
        t[i] = char(rnd(4) == 0 and rnd(128) or 128 + rnd(128))
      end
      local s = table.concat(t)
      assert.same(both(utf8.len, s), both(core.utf8len, s), ("%q"):format(s))
    end
  end)
end)

describe("core.printable", function()
  it("keeps valid UTF-8 and escapes what would drive a terminal", function()
    assert.equal("caf\195\169 x:1", core.printable("caf\195\169 x:1"))
    assert.equal("\\x1b[2J", core.printable("\27[2J"))
    assert.equal("a\\x00b\\x7f", core.printable("a\0b\127"))
    assert.equal("c\\xc2\\x9b2J", core.printable("c\194\1552J"))   -- CSI, a C1 control
    assert.equal("bad\\xff", core.printable("bad\255"))
    assert.equal("\\xed\\xa0\\x80", core.printable("\237\160\128")) -- a surrogate
  end)

  it("is tally.util's printable", function()
    assert.equal(core.printable, require("tally.util").printable)
  end)
end)
