-- tally compact: rewriting a store without its retired and reusable space.
local helper = require "spec.support.helper"
local tally = require "tally"

local q = helper.q

local function run(...)
  return helper.tally_split(nil, ...)
end

local function size_of(path)
  local f = assert(io.open(path, "rb"))
  local n = f:seek("end")
  f:close()
  return n
end

-- A store with counters worth keeping (families, a reshard, a rollup with
-- history) and the space of 20000 dropped ones.
local function churned_store()
  local path = helper.tmpfile()
  local db = assert(tally.open("file:" .. path))
  db:family("keep:*", { shards = 4, policy = "round_robin" })
  for i = 1, 100 do db:incr("keep:" .. i, i * 1000 + 7) end
  db:counter("wide", { shards = 2 }):add_shard(2, -5)
  db:counter("wide"):reshard(64)
  db:rollup("keep:1*", { every = 60, keep = { "10x1m" } })
  db:tick(1700000040)
  for i = 1, 20000 do db:incr("churn:" .. i) end
  for i = 1, 20000 do db:drop("churn:" .. i) end
  db:close()
  return path
end

describe("tally compact", function()
  it("shrinks a churned store and keeps every counter as it was", function()
    local path = churned_store()
    local export_before = assert(run("export", path))
    local before = size_of(path)
    local info = require("cjson").decode((run("info", path, "--json")))
    assert.is_true(info.retired_bytes + info.reusable_bytes > 1000000)
    local out, err, code = run("compact", path)
    assert.equal(0, code, err)
    local after = size_of(path)
    assert.is_true(after < before, after .. " < " .. before)
    assert.matches("^compacted " .. path:gsub("%p", "%%%0") .. ": [%d.]+ [KM]?i?B %-> [%d.]+ "
                   .. "[KM]?i?B %(" .. before .. " %-> " .. after .. " bytes%)\n$", out)
    assert.equal("compact: 101 counters rewritten\n", err)     -- no terminal: one line
    assert.equal(export_before, (run("export", path)))          -- values, shards, policies
    info = require("cjson").decode((run("info", path, "--json")))
    assert.same({ 0, 0, 101 }, { info.retired_bytes, info.reusable_bytes, info.counters })
    local db = assert(tally.open("file:" .. path))
    assert.equal(1007, db:value("keep:1"))
    assert.equal(-5, db:value("wide"))
    assert.equal(64, db:counter("wide"):info().shards)
    assert.equal("round_robin", db:counter("keep:5"):info().policy)
    assert.equal(4, db:counter("keep:new"):info().shards)       -- the family is kept
    assert.same({ value = 1007, at = 1700000040 },
                { value = db:counter("keep:1"):rolled().value,
                  at = db:counter("keep:1"):rolled().at })
    assert.equal(1007, db:counter("keep:1"):history("1m")[1].v)
    db:close()
  end)

  it("refuses while another process has the store open, and says so", function()
    local path = churned_store()
    local before = size_of(path)
    local script = helper.tmpfile("holder.lua")
    helper.write(script, "local tally = require 'tally'\n"
                 .. "local db = assert(tally.open('file:' .. arg[1]))\n"
                 .. "print('ready') io.stdout:flush() tally.sleep(60)\n")
    local h = assert(io.popen("sh -c 'echo $$; exec \"$0\" \"$@\"' " .. q(helper.bin) .. " "
                              .. q(script) .. " " .. q(path) .. " 2>&1", "r"))
    local pid = math.tointeger(tonumber(h:read("l")))
    assert.equal("ready", h:read("l"))
    local out, err, code = run("compact", path)
    os.execute("kill " .. pid)
    h:close()
    assert.equal(1, code)
    assert.equal("", out)
    assert.equal("tally compact: " .. path .. ": store is in use by process " .. pid
                 .. " (compaction needs it closed everywhere)\n", err)
    assert.not_matches("traceback", err, 1, true)
    assert.equal(before, size_of(path))                 -- untouched
    out, err, code = run("compact", path)              -- alone now
    assert.equal(0, code, err)
    assert.is_true(size_of(path) < before)
  end)

  it("says what is wrong with its arguments or the file", function()
    local missing = helper.tmpfile()
    local out, err, code = run("compact", missing)
    assert.equal(1, code)
    assert.equal("", out)
    assert.equal("tally compact: no store at " .. missing .. " (no such file)\n", err)
    assert.is_nil(io.open(missing))
    out, err, code = run("compact", "memory")
    assert.equal(1, code)
    assert.matches("^tally compact: 'memory' is a store of one process", err)
    out, err, code = run("compact")
    assert.equal(2, code)
    assert.matches("^tally compact: a store is needed\nusage: tally compact STORE", err)
    out, err, code = run("compact", missing, "extra")
    assert.equal(2, code)
    assert.matches("^tally compact: unexpected argument 'extra'\n", err)
    local junk = helper.tmpfile("junk")
    helper.write(junk, ("not a store at all\n"):rep(100))
    out, err, code = run("compact", junk)
    assert.equal(1, code)
    assert.matches("^tally compact: [^\n]*not a tally store", err)
    assert.not_matches("traceback", err, 1, true)
    assert.equal(("not a store at all\n"):rep(100), helper.slurp(junk))
    out, err, code = run("help", "compact")
    assert.equal(0, code, err)
    assert.matches("^usage: tally compact STORE\n\nRewrite STORE without", out)
  end)
end)
