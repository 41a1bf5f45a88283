-- tally.openresty_thread outside nginx: the key under which the thread
-- keeps the store handle it set the worker's mappings on.
describe("tally.openresty_thread's key of a list of mappings", function()
  local key_of = require("tally.openresty_thread")._key_of

  it("is the same for equal lists, whatever their tables' order", function()
    local a = { { pattern = "http:*", metric = "m", labels = { "path" }, type = "counter" } }
    local b = { { type = "counter", labels = { "path" }, metric = "m", pattern = "http:*" } }
    assert.equal(key_of(a), key_of(b))
  end)

  it("differs for lists that differ, however their texts look", function()
    -- a value that spells out the next key and value
    assert.are_not.equal(key_of({ { a = "b;string:c;string:d" } }), key_of({ { a = "b", c = "d" } }))
    -- bounds that differ past 14 digits (LuaJIT's tostring)
    local h1 = { { pattern = "h", histogram = { buckets = { 0.1 } } } }
    local h2 = { { pattern = "h", histogram = { buckets = { 0.1 + 2 ^ -55 } } } }
    assert.are_not.equal(key_of(h1), key_of(h2))
    assert.are_not.equal(key_of({ { "x" } }), key_of({ { x = true } }))
  end)
end)
