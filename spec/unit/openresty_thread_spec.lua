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

-- A scrape as the pool's VM makes it (here in this VM, through a parcel)
-- against tally.prometheus on the worker's handle.
describe("tally.openresty_thread.scrape", function()
  local tally = require "tally"
  local core = require "tally.core"
  local helper = require "spec.support.helper"
  local thread = require "tally.openresty_thread"

  local function scraped(spec, db, pattern)
    local p = core.parcel()
    local ok, err = thread.scrape(spec, nil, db:mappings(), pattern, p:id())
    local got = {}
    for piece in function() return p:take() end do got[#got + 1] = piece end
    p:free()
    if not ok then return nil, err end
    return table.concat(got)
  end

  it("makes tally.prometheus' text with the worker's mappings, metric-less histograms among them", function()
    local path = helper.tmpfile("thread.tly")
    os.remove(path)
    local spec = "file:" .. path
    local db = assert(tally.open(spec))
    assert(db:family("lat:*", { histogram = true }))      -- buckets only: exposed by name
    assert(db:family("http:*", { metric = "http_requests", labels = { "path" }, type = "counter" }))
    db:incr("http:/a", 3)
    assert(db:histogram("lat:x"):observe(0.2))
    assert(core.histograms_flush(db))
    local want = assert(tally.prometheus(db))
    assert.matches("\nlat:x_count 1\n", want, 1, true)
    assert.equal(want, assert(scraped(spec, db)))
    db:close()
    os.remove(path)
  end)
end)
