-- The tally executable: scripts, -e, the prompt, errors; and the likes demo.
local helper = require "spec.helper"
local tally = require "tally"

local q = helper.q

describe("the tally command", function()
  it("runs a script with arg and ... set as lua5.4 sets them", function()
    local script = helper.tmpfile("args.lua")
    helper.write(script, [[
      local t = require "tally"
      print(arg[0] == ... and "?" or arg[0]:match("[^/]+$"), arg[1], arg[2], select("#", ...), ...)
      print(type(arg[-1]), t.version, package.preload["tally.core"] ~= nil)
    ]])
    local out, code = helper.tally(script, "a b", "c")
    assert.equal(0, code)
    assert.equal(script:match("[^/]+$") .. "\ta b\tc\t2\ta b\tc\n"
                 .. "string\t" .. tally.version .. "\ttrue\n", out)
  end)

  it("runs -e chunks with the module as the global 'tally'", function()
    local out, code = helper.tally("-e", "print(tally.version)", "-e", "print(type(tally.open))")
    assert.equal(0, code)
    assert.equal(tally.version .. "\nfunction\n", out)
  end)

  it("prints 'tally: message' and a traceback, and exits 1, on an error", function()
    local script = helper.tmpfile("fails.lua")
    helper.write(script, "local function f() error('it broke') end\nf()\n")
    local out, code = helper.tally(script)
    assert.equal(1, code)
    assert.matches("^tally: [^\n]*fails%.lua:1: it broke\nstack traceback:\n", out)
  end)

  it("reports a script that does not load", function()
    local out, code = helper.tally(helper.tmpfile("missing.lua"))
    assert.equal(1, code)
    assert.matches("^tally: cannot open ", out)
    out, code = helper.tally("-e", "x = = 1")
    assert.equal(1, code)
    assert.matches("^tally: %(command line%):1: unexpected symbol", out)
  end)

  it("passes os.exit statuses through", function()
    local _, code = helper.tally("-e", "os.exit(3)")
    assert.equal(3, code)
  end)

  it("runs a prompt on stdin when given no script", function()
    local input = helper.tmpfile("input.txt")
    helper.write(input, table.concat({
      "1 + 1",
      "db = tally.open()",
      "db:incr('x', 5)",
      "db:value('x'), 'two'",
      "error('oops')",
      "for i = 1, 2 do",
      "  print('line', i)",
      "end",
      "db",
      "",
    }, "\n"))
    local out, code = helper.sh(q(helper.bin) .. " < " .. q(input))
    assert.equal(0, code)
    assert.matches("^2\ntrue\n5\ttwo\ntally: stdin:1: oops\nstack traceback:\n.-\n"
                   .. "line\t1\nline\t2\ntally%.store %(memory%)\n$", out)
  end)

  it("shows its version with -v", function()
    local out, code = helper.tally("-v")
    assert.equal(0, code)
    local want = "tally " .. tally.version .. " (" .. _VERSION .. "."
    assert.equal(want, out:sub(1, #want))
  end)
end)

describe("examples/likes.lua", function()
  it("counts every like from several processes exactly", function()
    local path = helper.tmpfile()
    local out, code = helper.tally("examples/likes.lua", path, "3", "5000")
    assert.equal(0, code, out)
    for i = 1, 3 do assert.matches("worker " .. i .. ": 5000 likes", out) end
    assert.matches("\ntotal: 15000 likes %(expected 15000%)", out)
    assert.matches("\nexact: every like counted\n$", out)
    local db = assert(tally.open("file:" .. path))
    assert.equal(15000, db:value("post:42:likes"))
    assert.same({ name = "post:42:likes", shards = 16, policy = "thread" },
                db:counter("post:42:likes"):info())
    db:close()
  end)
end)
