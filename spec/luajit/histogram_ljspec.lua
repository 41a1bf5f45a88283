-- Histograms under LuaJIT: h:observe goes through the FFI (tally.ffi.batch2)
-- and gives exactly what the classic path (core.batch) gives; a closed
-- store or a foreign store handle falls back to the classic path, which
-- raises as it does. Lua 5.1 syntax.
local helper = require "spec.luajit.helper"
local tally = require "tally"
local tffi = require "tally.ffi"

local VALUES = { 0.0001, 0.005, 0.0051, 0.01, 0.3, 0.25, 1, 7, 11, 1e3, -0.5, 0.0000005, 2.5e-7 }

-- Observe VALUES (and a run of pseudo-random ones) into a fresh histogram;
-- returns the raw member values and the snapshot.
local function scenario(db, name)
  local h = assert(db:histogram(name, { buckets = { 0.005, 0.01, 0.25, 1, 10 } }))
  for _, v in ipairs(VALUES) do assert(h:observe(v)) end
  local x = 12345
  for _ = 1, 20000 do
    x = (x * 1103515245 + 12345) % 2147483648
    assert(h:observe(x / 2147483648 * 12))
  end
  local raw = {}
  for n, v in pairs(db:snapshot(name .. "{*}")) do raw[n:sub(#name + 1)] = v end
  return raw, h:snapshot(), h
end

describe("h:observe under LuaJIT", function()
  it("goes through the FFI when it is on", function()
    if not tffi.reason then
      local db = assert(tally.open("memory"))
      local h = assert(db:histogram("h"))
      assert.is_true(h.ffi_ok)
      assert.is_true(tally.ffi)
      db:close()
    else
      pending("FFI off: " .. tffi.reason)
    end
  end)

  it("gives the same counts and sum through the FFI and the classic path", function()
    local db = assert(tally.open("file:" .. helper.tmpfile()))
    local on = tffi.enable(true)
    local raw_ffi, s_ffi = scenario(db, "a")
    tffi.enable(false)
    local raw_classic, s_classic = scenario(db, "b")
    tffi.enable(on)
    assert.same(raw_classic, raw_ffi)
    assert.same(s_classic, s_ffi)
    assert.equal(20000 + #VALUES, s_ffi.count)
    assert.equal(s_ffi.count, s_ffi.buckets[#s_ffi.buckets].count)
    db:close()
  end)

  it("falls back to the classic path for a closed store, which raises", function()
    local db = assert(tally.open("memory"))
    local h = assert(db:histogram("h", { buckets = { 1 } }))
    assert(h:observe(0.5))
    db:close()
    local ok, msg = pcall(h.observe, h, 0.5)
    assert.is_false(ok)
    assert.matches("attempt to use a closed store", msg, 1, true)
  end)

  it("checks the store handle's layout before using it", function()
    local db = assert(tally.open("memory"))
    local c = db:counter("x", { policy = "slot" })
    if not tffi.reason then
      assert.is_true(tffi.batch_ok(db, c))
      local other = assert(tally.open("memory"))
      assert.is_false(tffi.batch_ok(other, c))      -- c belongs to db, not other
      assert.is_false(tffi.batch_ok({}, c))
      assert.is_false(tffi.batch_ok(db, {}))
      other:close()
    end
    db:close()
  end)

  it("checks the handles' layout against core._ffi_info, and stays classic if it differs", function()
    if tffi.reason then return pending("FFI off: " .. tffi.reason) end
    local ffi = require "ffi"
    local core = require "tally.core"
    local info = core._ffi_info()
    assert.equal(ffi.offsetof("struct tally_ffi_store", "key"), info.store_key)
    assert.equal(ffi.offsetof("struct tally_ffi_store", "store"), info.store_store)
    assert.is_true(info.store_size >= ffi.sizeof("struct tally_ffi_store"))
    assert.equal(ffi.offsetof("struct tally_ffi_counter", "db"), info.counter_db)
    assert.is_nil(tffi.batch_reason)
    -- tally.ffi loaded again under a core whose handles are laid out otherwise
    local real = core._ffi_info
    local function load_with(change)
      package.loaded["tally.ffi"] = nil
      core._ffi_info = function()
        local t = real()
        change(t)
        return t
      end
      local ok, m = pcall(require, "tally.ffi")
      core._ffi_info, package.loaded["tally.ffi"] = real, tffi
      assert(ok, m)
      return m
    end
    local db = assert(tally.open("memory"))
    local a, b = db:counter("a", { policy = "slot" }), db:counter("b", { policy = "slot" })
    assert.is_true(load_with(function() end).batch_ok(db, a, b))
    for _, change in ipairs({
      function(t) t.store_store = t.store_store + 8 end,
      function(t) t.store_key = 8 end,
      function(t) t.store_size = 8 end,
      function(t) t.counter_db = t.counter_db + 8 end,
      function(t) t.store_store, t.store_size = nil, nil end,   -- an older core.so
    }) do
      local m = load_with(change)
      assert.equal("the store handle layout does not match struct tally_ffi_store", m.batch_reason)
      assert.is_false(m.batch_ok(db, a, b))
      assert.is_nil(m.reason)                   -- the counters' FFI path is not concerned
    end
    db:close()
  end)

  it("observes into a histogram family's histograms through the FFI", function()
    local db = assert(tally.open("memory"))
    db:family("lat:*", { histogram = { buckets = { 0.1, 1 } }, metric = "latency_seconds",
                         labels = { "route" }, help = "Latency" })
    local h = assert(db:histogram("lat:/a"))
    assert.same({ 0.1, 1 }, h.buckets)
    assert.equal(not tffi.reason, h.ffi_ok)
    for _, v in ipairs({ 0.05, 0.5, 5 }) do assert(h:observe(v)) end
    local text = tally.prometheus(db)
    assert.matches('\nlatency_seconds_bucket{route="/a",le="1"} 2\n', text, 1, true)
    assert.matches('\nlatency_seconds_sum{route="/a"} 5.55\nlatency_seconds_count{route="/a"} 3\n',
                   text, 1, true)
    db:close()
  end)

  it("raises for bad observations as under Lua 5.4", function()
    local db = assert(tally.open("memory"))
    local h = assert(db:histogram("h", { buckets = { 1 } }))
    local ok, msg = pcall(h.observe, h, 0 / 0)
    assert.is_false(ok)
    assert.matches("bad argument #1 to 'observe' (number expected, got nan)", msg, 1, true)
    ok, msg = pcall(h.observe, h, math.huge)
    assert.is_false(ok)
    assert.matches("out of range", msg, 1, true)
    assert.equal(0, h:snapshot().count)
    db:close()
  end)
end)
