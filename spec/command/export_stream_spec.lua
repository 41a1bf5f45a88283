-- db:export of 100,000 counters, streamed: export writes as it walks
-- (write(chunk)), the same bytes as the Lua path of any store (export_any).
local helper = require "spec.support.helper"
local tally = require "tally"
local export = require "tally.export"

local fmt = string.format
local N = 100000
local TOP, BOTTOM, SAFE = (1 << 62) - 1, -(1 << 62), (1 << 53) - 1

-- Counter i of N: several shard counts and policies; names with bytes
-- that are not UTF-8, quotes, UTF-8; counts over the whole range (strings
-- past +-(2^53-1)); and two slot counters.
local POLICIES = { "thread", "random", "round_robin", "key" }
local function spec_of(i)
  local name = i % 97 == 0 and fmt("x\255%d", i) or i % 89 == 0 and fmt('q"\\%d', i)
               or i % 83 == 0 and fmt("é✓%d", i) or fmt("post:%d:likes", i)
  return name, i % 10 == 0 and 4 or i % 1001 == 0 and 64 or 1, POLICIES[i % 4 + 1]
end
local function fill(db, n, seed, small)
  for i = 1, n do
    local name, shards, policy = spec_of(i)
    local c = db:counter(name, { shards = shards, policy = policy })
    for s = 1, shards do
      local r = small and 50 or (i * 7919 + s * seed) % 50
      c:add_shard(s, r == 0 and TOP or r == 1 and BOTTOM or r == 2 and SAFE + 1
                     or r == 3 and -SAFE - 2 or (i * 31 + s * seed) % 100003 - 500)
    end
  end
  for i = 1, 2 do db:counter("slot:" .. i, { policy = "slot" }):incr(i * seed) end
end

describe("export of " .. N .. " counters, streamed", function()
  local db, text
  setup(function()
    db = assert(tally.open())
    fill(db, N, 3)
    text = assert(db:export())
  end)
  teardown(function() db:close() end)

  it("export writes the bytes the Lua path writes, a piece at a time", function()
    assert.equal(export.export_any(db), text)
    local pieces, biggest, sum = 0, 0, 0
    assert.is_true(db:export(nil, function(s)
      pieces, sum = pieces + 1, sum + #s
      if #s > biggest then biggest = #s end
    end))
    assert.equal(#text, sum)
    assert.is_true(pieces > 50, pieces .. " pieces")
    assert.is_true(biggest < 128 * 1024, "a piece of " .. biggest .. " bytes")
    local chunks = {}
    assert.is_true(db:export("post:1*", function(s) chunks[#chunks + 1] = s end))
    assert.equal(db:export("post:1*"), table.concat(chunks))
    assert.equal(export.export_any(db, "post:1*"), table.concat(chunks))
    assert.equal('{"counters":{}}\n', db:export("none*"))
    assert.equal("bad argument #2 to 'export' (function expected, got table)",
                 helper.err(db.export, db, nil, {}))
  end)

end)
