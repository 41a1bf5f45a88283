-- Methods written in Lua check self as the C methods do: a wrong self
-- names the argument (luaL_argerror's two forms), never an internal error.
local helper = require "spec.support.helper"
local tally = require "tally"

local err = helper.err

describe("methods written in Lua, given a wrong self", function()
  local db, c, sch, fsink, filesink, hsink
  before_each(function()
    db = assert(tally.open())
    c = db:counter("a")
    fsink = tally.sink.fn(function() end)
    filesink = tally.sink.file(helper.tmpfile("sink.jsonl"))
    hsink = tally.sink.http{ url = "http://127.0.0.1:1/" }
    sch = db:rollup("a", { every = 1, keep = { "10x1s" }, sinks = { fsink, filesink, hsink } })
  end)
  after_each(function()
    hsink:close()
    db:close()
  end)

  -- every Lua method, with the type its self must have
  local function methods()
    return {
      { db, "tally.store", { "top", "values", "export", "import", "mappings", "rollup", "tick",
                             "run", "flush", "flush_to", "schedules", "clock" } },
      { c, "tally.counter", { "skew", "history", "keeps" } },
      { sch, "tally.schedule", { "stats" } },
      { fsink, "tally.sink", { "push", "pump", "flush", "stats", "close" } },
      { filesink, "tally.sink", { "push", "pump", "flush", "stats", "close" } },
      { hsink, "tally.sink", { "push", "pump", "flush", "stats", "close" } },
    }
  end

  it("raise 'bad argument #1 to NAME (T expected, got X)' when called as a function", function()
    local bad = { 5, "s", {}, false, c, db }
    local names = { number = "number", string = "string", table = "table", boolean = "boolean" }
    for _, m in ipairs(methods()) do
      local obj, tname, list = m[1], m[2], m[3]
      for _, name in ipairs(list) do
        local f = obj[name]
        assert.is_function(f, name)
        for _, v in ipairs(bad) do
          local got = names[type(v)] or getmetatable(v).__name
          if got ~= tname then
            assert.equal("bad argument #1 to '" .. name .. "' (" .. tname .. " expected, got "
                         .. got .. ")", err(function() local r = f(v); return r end), name)
          end
        end
        assert.equal("bad argument #1 to '" .. name .. "' (" .. tname .. " expected, got nil)",
                     err(function() local r = f(); return r end), name)
      end
    end
  end)

  it("raise 'calling NAME on bad self' when called as a method of something else", function()
    for _, m in ipairs(methods()) do
      local tname, list = m[2], m[3]
      for _, name in ipairs(list) do
        -- compiled so the call is other:NAME(), a method call
        local call = assert(load("local other = ... local r = other:" .. name .. "() return r"))
        local other = { [name] = m[1][name] }
        assert.equal("calling '" .. name .. "' on bad self (" .. tname .. " expected, got table)",
                     err(call, other), name)
      end
    end
  end)

  it("say what the C methods say, word for word", function()
    -- the C method db:value and the Lua method db:values, side by side
    assert.equal("bad argument #1 to 'value' (tally.store expected, got number)",
                 err(function() local r = db.value(5); return r end))
    assert.equal("bad argument #1 to 'values' (tally.store expected, got number)",
                 err(function() local r = db.values(5); return r end))
    local t = { value = db.value, values = db.values }
    assert.equal("calling 'value' on bad self (tally.store expected, got table)",
                 err(function() local r = t:value("a"); return r end))
    assert.equal("calling 'values' on bad self (tally.store expected, got table)",
                 err(function() local r = t:values(); return r end))
  end)

  it("still work on the right self", function()
    db:incr("a", 3)
    db:tick()
    assert.same({ a = 3 }, db:values())
    assert.equal(1, c:skew().shards > 0 and 1 or 0)
    assert.same({ "10x1s" }, c:keeps())
    assert.is_table(c:history("1s"))
    assert.equal("a", sch:stats().pattern)
    assert.equal(1, fsink:stats().sent)
    assert.equal("http", hsink:stats().kind)
    assert.is_true(hsink:pump())
  end)
end)
