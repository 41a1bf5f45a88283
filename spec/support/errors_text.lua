-- spec/support/errors_text.lua: the messages the Lua side builds, for Lua
-- 5.4 (spec/unit/errors_text_spec.lua) and LuaJIT
-- (spec/luajit/errors_text_ljspec.lua). A name is any bytes but NUL, and
-- messages name counters: each user-given string in a message goes
-- through tally.util.printable, the C side's rule (src/core/error.c):
-- control bytes and bytes outside a valid UTF-8 sequence as \xNN, valid
-- UTF-8 as it is. Lua 5.1 syntax.
--
-- run(helper, bt): helper gives err (an error's message without its
-- position); bt the spec's describe, it, before_each, after_each and assert
-- (busted gives them to the spec file, not to modules it requires).
local tally = require "tally"
local util = require "tally.util"

-- a newline, ESC and a byte that is no UTF-8: what they must become
local ODD, ODD_TEXT = "a\nb\27[1m\255", "a\\x0ab\\x1b[1m\\xff"
local CAFE = "caf\195\169"                  -- UTF-8: kept as it is

return function(helper, bt)
  local describe, it, before_each, after_each, assert =
    bt.describe, bt.it, bt.before_each, bt.after_each, bt.assert

  -- msg for a failure's report: each byte outside ASCII's printable ones as \ddd
  local function shown(msg)
    return (tostring(msg):gsub("[%z\1-\31\127-\255]", function(c) return "\\" .. c:byte() end))
  end

  -- msg holds want (escapes and all) and no raw control byte or stray byte
  local function printable(msg, want)
    assert.is_string(msg, shown(msg))
    assert.truthy(msg:find(want, 1, true), "not found: " .. want .. " in: " .. shown(msg))
    assert.is_nil(msg:find("[%z\1-\31\127]"), "a raw control byte in: " .. shown(msg))
    assert.is_nil(msg:find("\255", 1, true), "a raw byte ff in: " .. shown(msg))
  end

  describe("tally.util", function()
    it("printable writes control bytes and bytes that are not UTF-8 as \\xNN", function()
      assert.equal(ODD_TEXT, util.printable(ODD))
      assert.equal("\\x00\\x09x\\x7f", util.printable("\0\tx\127"))
      -- a stray continuation byte, a truncated sequence, an overlong form,
      -- a surrogate, past U+10FFFF: each byte apart
      assert.equal("\\x80 \\xe2\\x82 \\xc0\\xaf \\xed\\xa0\\x80 \\xf4\\x90\\x80\\x80",
                   util.printable("\128 \226\130 \192\175 \237\160\128 \244\144\128\128"))
      assert.equal(CAFE .. " \226\130\172 \240\159\152\128", util.printable(CAFE .. " \226\130\172 \240\159\152\128"))
      assert.equal("plain", util.printable("plain"))
      -- C1 controls as UTF-8 (CSI, U+009B) drive terminals too; U+00A0 is text
      assert.equal("\\xc2\\x9b2J \194\160", util.printable("\194\1552J \194\160"))
    end)

    it("describe writes a string through printable", function()
      assert.equal("'" .. ODD_TEXT .. "'", util.describe(ODD))
      assert.equal("'" .. CAFE .. "'", util.describe(CAFE))
    end)
  end)

  describe("messages that name", function()
    local db
    before_each(function() db = assert(tally.open()) end)
    after_each(function() db:close() end)

    it("a family pattern (db:family)", function()
      printable(helper.err(db.family, db, ODD .. "*", { metric = "m", labels = {} }),
                "wildcard of '" .. ODD_TEXT .. "*' in order")
      printable(helper.err(db.family, db, "{" .. ODD, { histogram = true }),
                "got '{" .. ODD_TEXT .. "'")
      assert.is_true(db:family(ODD .. ":*", { metric = "m", labels = { "x" }, type = "counter" }))
      printable(helper.err(db.family, db, "b:*", { metric = "m", labels = { "x" } }),
                "metric 'm' is a counter (family '" .. ODD_TEXT .. ":*'), not a gauge")
      assert.equal("bad argument #2 to 'family' (labels must name the 1 wildcard of '" .. CAFE
                   .. "*' in order, got 0 names)",
                   helper.err(db.family, db, CAFE .. "*", { metric = "m", labels = {} }))
    end)

    it("a histogram (db:histogram)", function()
      printable(helper.err(db.histogram, db, ODD .. "{"), "got '" .. ODD_TEXT .. "{'")
      assert(db:histogram(ODD, { buckets = { 1, 2 } }))
      local h, msg, code = db:histogram(ODD, { buckets = { 1, 3 } })
      assert.is_nil(h)
      assert.equal("EEXIST", code)
      printable(msg, "histogram '" .. ODD_TEXT .. "' exists with buckets 1, 2, +Inf")
      assert.is_true(db:family(ODD .. ":*", { histogram = { buckets = { 5 } } }))
      printable(helper.err(db.histogram, db, ODD .. ":x", { buckets = { 6 } }),
                "differ from those of family '" .. ODD_TEXT .. ":*'")
      assert(db:histogram(CAFE, { buckets = { 1 } }))
      h, msg = db:histogram(CAFE, { buckets = { 2 } })
      assert.equal("histogram '" .. CAFE .. "' exists with buckets 1, +Inf, not 2, +Inf", msg)
    end)

    it("a counter of an imported document (db:import)", function()
      -- the name in JSON: a newline, ESC, and the byte ff as \udcff
      local doc = '{"counters":{"a\\nb\\u001b[1m\\udcff":{"num_shards":0,"shards":{}}}}'
      printable(helper.err(db.import, db, doc),
                "import: counter '" .. ODD_TEXT .. "': num_shards must be an integer")
      doc = '{"counters":{"x":{"num_shards":1,"shards":{"0":{"count":1}},"a\\u001b":1}}}'
      printable(helper.err(db.import, db, doc), "unknown field 'a\\x1b'")
      doc = '{"counters":{"' .. CAFE .. '":{"num_shards":0,"shards":{}}}}'
      assert.equal("import: counter '" .. CAFE .. "': num_shards must be an integer from 1 to "
                   .. tally.MAX_SHARDS .. ", got 0", helper.err(db.import, db, doc))
    end)

    it("a counter, in the messages the C binding builds (db:counter, db:value)", function()
      assert(db:counter(ODD, { shards = 2 }))
      printable(helper.err(db.counter, db, ODD, { shards = 4 }),
                "counter '" .. ODD_TEXT .. "' exists with 2 shards")
      printable(helper.err(db.counter, db, "x", { [ODD] = 1 }), "'" .. ODD_TEXT .. "'")
      local v, msg, code = db:value(ODD .. "?")
      assert.is_nil(v)
      assert.equal("ENOENT", code)
      printable(msg, "no such counter '" .. ODD_TEXT .. "?'")
      assert(db:counter(CAFE, { shards = 2 }))
      assert.truthy(helper.err(db.counter, db, CAFE, { shards = 4 }):find("'" .. CAFE .. "'", 1, true))
    end)

    it("a keep entry of a rollup (db:rollup)", function()
      printable(helper.err(db.rollup, db, "*", { every = 1, keep = { ODD } }),
                "bad keep entry '" .. ODD_TEXT .. "'")
    end)

    it("counters a scrape leaves out, in the log (tally.prometheus)", function()
      local logged = {}
      local old = tally.logger(function(msg) logged[#logged + 1] = msg end)
      assert.is_true(db:family("*:*", { metric = "m", labels = { "p", "q" } }))
      assert.is_true(db:incr(ODD .. ":x:y"))
      local text = tally.prometheus(db)
      tally.logger(old)
      assert.truthy(text:find('reason="ambiguous"', 1, true))
      assert.equal(1, #logged)
      printable(logged[1], "counter '" .. ODD_TEXT .. ":x:y' matches '*:*' in more than one way")
    end)
  end)
end
