-- The store's cache of counter handles by name under LuaJIT: the FFI
-- path's db:incr(name), db:decr and db:value look in the same young table
-- as the classic methods, follow it when the generations rotate, and let
-- an abandoned store be collected.
local helper = require "spec.luajit.helper"
local tally = require "tally"
local core = require "tally.core"

local look = require "spec.support.cache"
local gc, cached = look.gc, look.cached

for _, path in ipairs(helper.paths) do
  describe("the handle cache on the " .. path .. " path", function()
    local db
    before_each(function() helper.use(path) end)
    after_each(function()
      if db then db:close() end
      db = nil
      helper.use("ffi")
    end)

    it("holds at most handle_cache handles and counts exactly through rotations", function()
      db = assert(tally.open("memory", { handle_cache = 16, handle_admit = "always" }))
      local want = {}
      for i = 1, 200 do
        local name = "n:" .. (i % 40)
        assert.is_true(db:incr(name, 2))
        assert.is_true(db:decr(name))
        assert.is_true(db:incr("hot"))
        want[name] = (want[name] or 0) + 1
        if i % 25 == 0 then gc() end
      end
      local s = core._store_cache_stats(db)
      assert.is_true(s.held <= 16, "held " .. s.held)
      assert.is_true(s.rotations > 10)
      for name, v in pairs(want) do assert.equal(v, db:value(name)) end
      assert.equal(200, db:value("hot"))
    end)

    it("keeps the handle of a name in use across rotations", function()
      db = assert(tally.open("memory", { handle_cache = 20, handle_admit = "always" }))
      db:incr("hot")
      local seen = setmetatable({}, { __mode = "k" })
      seen[cached(db, "hot")] = true
      for r = 1, 10 do
        for i = 1, 7 do db:incr("new:" .. r .. ":" .. i) end
        gc()
        assert.is_true(db:incr("hot"))
      end
      gc()
      assert.is_true(seen[cached(db, "hot")])   -- weak: a new handle
      assert.equal(11, db:value("hot"))
    end)

    it("finds the young table after a rotation: a name in old is moved", function()
      db = assert(tally.open("memory", { handle_cache = 10, handle_admit = "always" }))
      -- round_robin: no name slot (slots_ljspec), db:incr looks in young
      db:family("p", { policy = "round_robin" })
      db:family("q", { policy = "round_robin" })
      db:incr("p")                         -- the FFI path keeps the cache's state now
      db:incr("q")
      local st = core._store_cache(db)
      local h = st[1].p
      for i = 1, 4 do db:incr("n:" .. i) end   -- young was full: it became old
      assert.equal(1, core._store_cache_stats(db).rotations)
      assert.equal(h, st[2].p)
      assert.is_true(db:incr("p"))         -- a stale young table would hit here
      assert.equal(h, st[1].p)
      assert.is_nil(st[2].p)
      assert.equal(1, db:value("q"))       -- db:value moves it too
      assert.is_userdata(st[1].q)
      assert.is_nil(st[2].q)
      assert.equal(2, db:value("p"))
    end)

    it("forgets a dropped name; db:incr then creates it anew", function()
      db = assert(tally.open("memory", { handle_cache = 10, handle_admit = "always" }))
      db:incr("d", 5)
      for i = 1, 5 do db:incr("n:" .. i) end
      assert.is_userdata(core._store_cache(db)[2].d)
      assert.is_true(db:drop("d"))
      assert.is_nil(cached(db, "d"))
      assert.is_nil(db:value("d"))
      assert.is_true(db:incr("d"))
      assert.equal(1, db:value("d"))
    end)

    it("lets a store nothing refers to be collected, with its handles", function()
      local gone = setmetatable({}, { __mode = "k" })
      do
        local s = assert(tally.open("memory", { handle_cache = 100, handle_admit = "always" }))
        for i = 1, 50 do s:incr("n:" .. i) end
        assert.equal(1, s:value("n:1"))
        assert.equal(50, core._store_slots_stats(s).lent)   -- and their name slots
        gone[s] = true
      end
      gc()
      assert.is_nil(next(gone))
    end)
  end)
end
