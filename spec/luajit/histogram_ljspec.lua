-- Histograms under LuaJIT: h:observe calls its writer through the FFI
-- (tally.ffi.observe) and gives exactly what the classic path
-- (core.histogram_observe) gives; a closed store, a NaN or a value out of
-- range fall back to the classic path, which raises as it does. Lua 5.1
-- syntax.
local helper = require "spec.luajit.helper"
local tally = require "tally"
local tffi = require "tally.ffi"

local VALUES = { 0.0001, 0.005, 0.0051, 0.01, 0.3, 0.25, 1, 7, 11, 1e3, -0.5, 0.0000005, 2.5e-7 }

-- Observe VALUES (and a run of pseudo-random ones) into a fresh histogram;
-- returns the raw member values and the snapshot.
local function scenario(db, name, buffer)
  local h = assert(db:histogram(name, { buckets = { 0.005, 0.01, 0.25, 1, 10 }, buffer = buffer }))
  for _, v in ipairs(VALUES) do assert(h:observe(v)) end
  local x = 12345
  for _ = 1, 20000 do
    x = (x * 1103515245 + 12345) % 2147483648
    assert(h:observe(x / 2147483648 * 12))
  end
  local raw = {}
  assert(h:flush())
  for n, v in pairs(db:snapshot(name .. "{*}")) do raw[n:sub(#name + 1)] = v end
  return raw, h:snapshot(), h
end

describe("h:observe under LuaJIT", function()
  it("goes through the FFI when it is on", function()
    if tffi.reason or tffi.observe_reason then
      return pending("FFI off: " .. tostring(tffi.reason or tffi.observe_reason))
    end
    local db = assert(tally.open("memory"))
    local h = assert(db:histogram("h", { buckets = { 1 } }))
    assert.is_true(tally.ffi)
    local real, calls, done = tffi.observe, 0, 0
    tffi.observe = function(w, v)
      calls = calls + 1
      local ok = real(w, v)
      if ok then done = done + 1 end
      return ok
    end
    local ok, err = pcall(function()
      for _, v in ipairs({ 0.5, 2, 1 }) do assert(h:observe(v)) end
    end)
    tffi.observe = real
    assert(ok, err)
    assert.equal(3, calls)
    assert.equal(3, done)                     -- none fell back to the classic path
    local s = h:snapshot()
    assert.equal(3, s.count)
    assert.equal(2, s.buckets[1].count)       -- 0.5 and 1 (a bound takes its own value)
    assert.equal(3.5, s.sum)
    db:close()
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

  it("buffers through the FFI as through the classic path", function()
    local db = assert(tally.open("file:" .. helper.tmpfile()))
    local on = tffi.enable(true)
    local raw_ffi, s_ffi, h = scenario(db, "a", 333)
    tffi.enable(false)
    local raw_classic, s_classic = scenario(db, "b", 333)
    tffi.enable(on)
    local raw_plain, s_plain = scenario(db, "c")
    assert.same(raw_plain, raw_ffi)
    assert.same(raw_plain, raw_classic)
    assert.same(s_plain, s_ffi)
    assert.same(s_plain, s_classic)
    assert.equal(333, h.buffer)
    h:observe(1)                               -- held: not in the store
    local stored = 0
    for _, v in pairs(db:snapshot("a{le=*}")) do stored = stored + v end
    assert.equal(s_ffi.count, stored)
    assert.equal(s_ffi.count + 1, h:snapshot().count)
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

  it("adds nothing through the FFI for a NaN or a value out of range", function()
    if tffi.reason or tffi.observe_reason then
      return pending("FFI off: " .. tostring(tffi.reason or tffi.observe_reason))
    end
    local db = assert(tally.open("memory"))
    local h = assert(db:histogram("h", { buckets = { 1 } }))
    assert.is_false(tffi.observe(h.w, 0 / 0))
    assert.is_false(tffi.observe(h.w, math.huge))
    assert.is_false(tffi.observe(h.w, -math.huge))
    assert.is_false(tffi.observe(h.w, 2 ^ 53 * 1e-6 * 1.01))
    assert.is_true(tffi.observe(h.w, 2 ^ 52 * 1e-6))
    local s = h:snapshot()
    assert.equal(1, s.count)
    assert.equal(1, s.buckets[2].count)
    db:close()
    assert.is_false(tffi.observe(h.w, 0.5))   -- closed with its store
  end)

  it("checks the handles' layout against core._ffi_info, and stays classic if it differs", function()
    if tffi.reason then return pending("FFI off: " .. tffi.reason) end
    local ffi = require "ffi"
    local core = require "tally.core"
    local info = core._ffi_info()
    assert.equal(ffi.offsetof("struct tally_ffi_store", "key"), info.store_key)
    assert.equal(ffi.offsetof("struct tally_ffi_store", "store"), info.store_store)
    assert.is_true(info.store_size >= ffi.sizeof("struct tally_ffi_store"))
    assert.equal(ffi.offsetof("struct tally_ffi_hist", "h"), info.hist_h)
    assert.is_nil(tffi.store_reason)
    assert.is_nil(tffi.observe_reason)
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
    local same = load_with(function() end)
    assert.is_nil(same.store_reason)
    assert.is_function(same.observe)
    for _, change in ipairs({
      function(t) t.store_store = t.store_store + 8 end,
      function(t) t.store_key = 8 end,
      function(t) t.store_size = 8 end,
      function(t) t.store_vec = t.store_vec + 8 end,
      function(t) t.store_store, t.store_size = nil, nil end,   -- an older core.so
    }) do
      local m = load_with(change)
      assert.equal("the store handle layout does not match struct tally_ffi_store", m.store_reason)
      assert.is_nil(m.reason)                   -- the counters' FFI path is not concerned
    end
    for _, change in ipairs({
      function(t) t.hist_h = t.hist_h + 8 end,
      function(t) t.hist_h = nil end,           -- an older core.so
    }) do
      local m = load_with(change)
      assert.equal("the histogram writer layout does not match struct tally_ffi_hist",
                   m.observe_reason)
      assert.is_nil(m.observe)                  -- h:observe stays classic
      assert.is_nil(m.reason)
    end
  end)

  it("observes into a histogram family's histograms through the FFI", function()
    local db = assert(tally.open("memory"))
    db:family("lat:*", { histogram = { buckets = { 0.1, 1 } }, metric = "latency_seconds",
                         labels = { "route" }, help = "Latency" })
    local h = assert(db:histogram("lat:/a"))
    assert.same({ 0.1, 1 }, h.buckets)
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
