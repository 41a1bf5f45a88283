-- spec/support/slots.lua: the name slots' specs (src/lua/lua_slots.c), for
-- Lua 5.4 (spec/unit/slots_spec.lua) and LuaJIT, on its FFI and classic
-- paths (spec/luajit/slots_ljspec.lua). db:incr(name) and db:decr find a
-- cached handle's slot in one table and add through the store handle's
-- vector. Every increment lands in its own counter; a slot names its
-- counter's handle or nothing: when the handle closes, is collected, or
-- its counter is dropped, the name's next increment takes the cache's path
-- and counts; a name hit only through its slot stays cached; db:close
-- empties them all.
--
-- run(helper, paths, use, bt): helper gives tmpfile; paths the paths to
-- run (use(path) switches to one; nil under Lua 5.4: { "classic" }); bt
-- the spec's describe, it, before_each, after_each and assert (busted
-- gives them to the spec file, not to modules it requires).
local tally = require "tally"
local core = require "tally.core"

local look = require "spec.support.cache"
local gc, cached = look.gc, look.cached
local jit = rawget(_G, "jit")

-- The slot an entry names: -1 - slot until an increment hits it.
local function slot(v)
  return v and (v < 0 and -1 - v or v)
end

-- Take name out of the cache (the handle stays alive in the caller): an
-- increment that does not go through the slot puts it back.
local function uncache(db, name)
  local st = core._store_cache(db)
  local h = st[1][name] or (st[2] and st[2][name])
  st[1][name] = nil
  if st[2] then st[2][name] = nil end
  return h
end

return function(helper, paths, use, bt)
  local describe, it, before_each, after_each, assert =
    bt.describe, bt.it, bt.before_each, bt.after_each, bt.assert
  for _, path in ipairs(paths) do
    describe("name slots on the " .. path .. " path", function()
      local db, other
      before_each(function() if use then use(path) end end)
      after_each(function()
        if db then db:close() end
        if other then other:close() end
        db, other = nil, nil
        if use then use(paths[1]) end
      end)

      it("are lent to cached handles, and increments through them land exactly", function()
        db = assert(tally.open("memory", { handle_cache = 1000, handle_admit = "always" }))
        local want = {}
        for i = 1, 3000 do
          local name = "n:" .. (i * 7919 % 300)
          if i % 3 == 0 then
            assert.is_true(db:decr(name, 2))
            want[name] = (want[name] or 0) - 2
          else
            assert.is_true(db:incr(name, i))
            want[name] = (want[name] or 0) + i
          end
        end
        local slots = core._store_slots(db)
        local st = core._store_slots_stats(db)
        assert.equal(300, st.lent)
        assert.equal(300, st.used)
        assert.is_true(st.size >= 300)
        local seen = {}
        for name, v in pairs(want) do
          assert.equal(v, db:value(name))
          local i = slot(slots[name])
          assert.is_number(i)
          assert.is_nil(seen[i], "two names in slot " .. i)
          seen[i] = true
        end
      end)

      it("are dense for names created in slot order: no slot word is read", function()
        db = assert(tally.open("memory", { handle_admit = "always" }))
        for i = 1, 2000 do assert.is_true(db:incr("d:" .. i)) end
        local st = core._store_slots_stats(db)
        assert.equal(2000, st.used)
        assert.equal(2000, st.dense)
        for i = 1, 2000, 97 do assert.equal(1, db:value("d:" .. i)) end
      end)

      it("carry db:incr(name) without the cache's table", function()
        db = assert(tally.open("memory", { handle_admit = "always" }))
        assert.is_true(db:incr("s", 3))
        local h = uncache(db, "s")
        assert.is_nil(cached(db, "s"))
        assert.is_true(db:incr("s", 4))
        assert.is_true(db:decr("s"))
        assert.is_nil(cached(db, "s"))         -- the classic path would have cached it
        assert.equal(6, h:value())
        -- what the slot cannot add (not an integer) goes to the classic method
        assert.has_error(function() db:incr("s", 1.5) end)
        assert.equal(6, db:value("s"))
        assert.is_true(db:incr("s", jit and require("ffi").new("int64_t", 2) or 2))
        assert.equal(8, db:value("s"))
      end)

      it("go to the thread and random policies only", function()
        db = assert(tally.open("memory", { handle_admit = "always" }))
        db:family("r:*", { policy = "random", shards = 4 })
        db:family("k:*", { policy = "key", shards = 4 })
        db:family("rr:*", { policy = "round_robin", shards = 4 })
        assert.is_true(db:incr("t:1"))
        assert.is_true(db:incr("r:1"))
        assert.is_true(db:incr("k:1", 1, "some key"))
        assert.is_true(db:incr("rr:1"))
        local slots = core._store_slots(db)
        assert.is_number(slots["t:1"])
        assert.is_number(slots["r:1"])
        assert.is_nil(slots["k:1"])
        assert.is_nil(slots["rr:1"])
        for _ = 1, 99 do
          db:incr("r:1")
          db:incr("rr:1")
        end
        assert.equal(100, db:value("r:1"))
        assert.equal(100, db:value("rr:1"))
      end)

      it("keep a name hit only through its slot in the cache across rotations", function()
        db = assert(tally.open("memory", { handle_cache = 20, handle_admit = "always" }))
        db:incr("hot")
        db:incr("cold")
        local h = cached(db, "hot")
        local slots = core._store_slots(db)
        for r = 1, 10 do
          for i = 1, 7 do db:incr("new:" .. r .. ":" .. i) end
          assert.is_true(db:incr("hot"))
          assert.is_true(slots.hot >= 0)       -- hit
          gc()
        end
        local st = core._store_cache_stats(db)
        assert.is_true(st.rotations >= 6, "rotations " .. st.rotations)
        assert.is_true(st.held <= 20, "held " .. st.held)
        assert.equal(h, cached(db, "hot"))     -- never let go, never reopened
        assert.is_nil(cached(db, "cold"))
        assert.is_nil(slots.cold)
        assert.equal(11, db:value("hot"))
      end)

      it("are given back by the handles a rotation lets go", function()
        db = assert(tally.open("memory", { handle_cache = 20, handle_admit = "always" }))
        for i = 1, 200 do db:incr("r:" .. i) end       -- no collection in between
        local st, held = core._store_slots_stats(db), core._store_cache_stats(db).held
        assert.is_true(st.lent <= held, st.lent .. " lent, " .. held .. " held")
        assert.is_true(st.used <= 30, "used " .. st.used)
        local n = 0
        for _ in pairs(core._store_slots(db)) do n = n + 1 end
        assert.equal(st.lent, n)
        for i = 1, 200 do assert.equal(1, db:value("r:" .. i)) end
      end)

      it("are given back when a handle closes or is collected, and reused", function()
        db = assert(tally.open("memory", { handle_cache = 16, handle_admit = "always" }))
        assert.is_true(db:incr("c", 2))
        local slots = core._store_slots(db)
        local i = slot(slots.c)
        assert.is_number(i)
        cached(db, "c"):close()
        assert.is_nil(slots.c)
        assert.equal(0, core._store_slots_stats(db).lent)
        assert.equal(1, core._store_slots_stats(db).spare)
        assert.is_true(db:incr("c", 3))        -- reopened, and lent the same slot
        assert.equal(i, slot(slots.c))
        assert.equal(5, db:value("c"))
        -- rotations let handles go: collected, they give their slots back
        local want = {}
        for r = 1, 40 do
          for k = 1, 10 do
            local name = "g:" .. r .. ":" .. k
            db:incr(name, k)
            want[name] = k
          end
          if r % 2 == 0 then gc() end
        end
        gc()
        local st = core._store_slots_stats(db)
        assert.is_true(st.lent <= 40, "lent " .. st.lent)
        assert.is_true(st.used <= 48, "used " .. st.used)   -- reused, not 401
        local n = 0
        for _ in pairs(slots) do n = n + 1 end
        assert.equal(st.lent, n)
        for name, v in pairs(want) do assert.equal(v, db:value(name)) end
      end)

      it("let a name dropped here or by another handle count again", function()
        local file = helper.tmpfile()
        db = assert(tally.open("file:" .. file, { handle_admit = "always" }))
        other = assert(tally.open("file:" .. file))
        assert.is_true(db:incr("d", 5))
        local slots = core._store_slots(db)
        assert.is_number(slots.d)
        assert.is_true(db:drop("d"))
        assert.is_true(db:incr("d"))
        assert.equal(1, db:value("d"))
        assert.is_true(db:incr("d", 2))        -- through the new handle's slot
        assert.equal(3, other:value("d"))
        -- dropped by another store handle: the slot's add fails, the cache's
        -- handle fails, and the name is opened (and created) again
        assert.is_true(other:drop("d"))
        assert.is_true(db:incr("d", 7))
        assert.equal(7, other:value("d"))
        assert.equal(7, db:value("d"))
        assert.is_number(slots.d)
        assert.equal(1, core._store_slots_stats(db).lent)
        assert.equal(1, core._store_slots_stats(db).used)   -- the old slot, reused
        assert.is_true(db:incr("d"))
        assert.equal(8, other:value("d"))
      end)

      it("follow reshards made through another handle", function()
        local file = helper.tmpfile()
        db = assert(tally.open("file:" .. file, { handle_admit = "always" }))
        other = assert(tally.open("file:" .. file))
        local total = 0
        for r = 1, 6 do
          for i = 1, 500 do
            assert.is_true(db:incr("m", i % 3 + 1))
            total = total + i % 3 + 1
          end
          assert(other:counter("m")):reshard(r % 2 == 1 and 8 or 1)
          assert.equal(total, other:value("m"))
        end
        assert.equal(total, db:value("m"))
      end)

      if path == "ffi" then
        local STAMP = 2^31   -- entries from here on are stamps: cells, not slots

        it("become their counter's stamp once hit, and add exactly through it", function()
          db = assert(tally.open("memory", { handle_admit = "always" }))
          local slots = core._store_slots(db)
          for i = 1, 50 do assert.is_true(db:incr("s:" .. i % 10, i)) end
          for i = 0, 9 do
            assert.is_true(slots["s:" .. i] >= STAMP, "s:" .. i)
            assert.is_true(db:decr("s:" .. i, 1000))
          end
          for i = 0, 9 do
            local want = -1000
            for k = 1, 50 do if k % 10 == i then want = want + k end end
            assert.equal(want, db:value("s:" .. i))
          end
          -- several shards: a slot, not a stamp
          assert(db:counter("wide", { shards = 4 }))
          for _ = 1, 3 do db:incr("wide") end
          assert.is_true(slots.wide < STAMP)
          assert.equal(3, db:value("wide"))
        end)

        it("made stale by a move elsewhere add nothing there, and are made again", function()
          local file = helper.tmpfile()
          db = assert(tally.open("file:" .. file, { handle_admit = "always" }))
          other = assert(tally.open("file:" .. file))
          local slots, total = core._store_slots(db), 0
          for r = 1, 2 do
            for i = 1, 300 do
              assert.is_true(db:incr("m", i % 3 + 1))
              total = total + i % 3 + 1
            end
            assert.is_true(slots.m >= STAMP)
            local before = slots.m
            -- to 4 shards and back: the stamp's cell is retired, then past
            -- the grace period (1 s) reused by new counters
            assert(other:counter("m")):reshard(4)
            assert(other:counter("m")):reshard(1)
            other:tick()
            db:tick()
            os.execute("sleep 1.1")
            other:tick()
            db:tick()
            local reused = other:stats().reused_bytes
            for i = 1, 100 do other:incr("fill:" .. r .. ":" .. i, 1000 + i) end
            assert.is_true(other:stats().reused_bytes > reused, "no space reused")
            assert.is_true(db:incr("m", 5))           -- stale: through the handle
            total = total + 5
            assert.is_true(slots.m >= STAMP and slots.m ~= before)   -- stamped again
            assert.equal(total, other:value("m"))
          end
          for r = 1, 2 do
            for i = 1, 100 do assert.equal(1000 + i, other:value("fill:" .. r .. ":" .. i)) end
          end
          assert.equal(total, db:value("m"))
          assert.is_true(db:check())
        end)

        it("go back to slots at a rotation, and are made again", function()
          db = assert(tally.open("memory", { handle_cache = 20, handle_admit = "always" }))
          local slots, want = core._store_slots(db), {}
          for r = 1, 30 do
            for i = 1, 6 do
              local name = "h:" .. i
              assert.is_true(db:incr(name, r))
              want[name] = (want[name] or 0) + r
            end
            db:incr("new:" .. r)                       -- young fills: rotations
            want["new:" .. r] = 1
            gc()
          end
          assert.is_true(core._store_cache_stats(db).rotations >= 3)
          local stamps = 0
          for name, v in pairs(slots) do
            if v >= STAMP then stamps = stamps + 1 end
          end
          assert.is_true(stamps >= 5, stamps .. " stamps")
          for name, v in pairs(want) do assert.equal(v, db:value(name), name) end
          local st, n = core._store_slots_stats(db), 0
          for _ in pairs(slots) do n = n + 1 end
          assert.equal(st.lent, n)
        end)

        it("made stale while the name's handle is in the old generation keep its slot", function()
          local file = helper.tmpfile()
          db = assert(tally.open("file:" .. file, { handle_cache = 8, handle_admit = "always" }))
          other = assert(tally.open("file:" .. file))
          local slots = core._store_slots(db)
          for _ = 1, 3 do db:incr("A") end
          for i = 1, 4 do db:incr("f" .. i) end            -- young rotates: A is old
          db:incr("A")                                     -- a hit through its stamp
          local st = core._store_cache(db)
          assert.is_nil(st[1].A)
          assert.is_true(slots.A >= STAMP)
          assert(other:counter("A")):reshard(2)
          assert(other:counter("A")):reshard(1)
          db:tick()
          assert.is_true(db:incr("A"))                      -- stale: the classic way
          assert.is_number(slots.A)                         -- its slot, or a new stamp
          for _ = 1, 3 do db:incr("A") end
          assert.equal(8, db:value("A"))
          local n = 0
          for _ in pairs(slots) do n = n + 1 end
          assert.equal(core._store_slots_stats(db).lent, n)
        end)

        it("stay exact when a stamped name is dropped, or its handle closes", function()
          db = assert(tally.open("memory", { handle_admit = "always" }))
          local slots = core._store_slots(db)
          for _ = 1, 3 do db:incr("d") end
          assert.is_true(slots.d >= STAMP)
          assert.is_true(db:drop("d"))
          assert.is_true(db:incr("d", 7))
          assert.equal(7, db:value("d"))
          for _ = 1, 3 do db:incr("d") end
          assert.equal(10, db:value("d"))
          assert.equal(1, core._store_slots_stats(db).lent)
          local c = uncache(db, "d")
          c:close()
          assert.is_nil(slots.d)
          assert.is_true(db:incr("d"))
          assert.equal(11, db:value("d"))
        end)

        it("stay their name's when its handle is collected in the middle of db:incr", function()
          -- a finalizer runs at an allocation or a trace exit: here a line
          -- hook collects on the line after by_name read the entry, and the
          -- hit wrote the freed slot back, which the next name was lent:
          -- x's increments went to y (or a slot was handed out twice)
          local src = assert(package.searchpath("tally.ffi", package.path))
          local line, n = nil, 0
          for l in io.lines(src) do
            n = n + 1
            if l == "  local d = delta(n)" then line = n end
          end
          assert.is_number(line)
          db = assert(tally.open("memory", { handle_cache = 0 }))   -- a weak cache
          do
            local c = db:counter("x") -- luacheck: ignore (held until the block ends)
            assert.is_number(core._store_slots(db).x)               -- lent
          end                                                       -- the weak cache's only
          local armed = true
          debug.sethook(function(_, l)
            if armed and l == line and debug.getinfo(2, "S").short_src:find("ffi.lua", 1, true) then
              armed = false
              collectgarbage("collect")
            end
          end, "l")
          local ok = db:incr("x")
          debug.sethook()
          assert.is_false(armed)
          assert.is_true(ok)
          local y = db:counter("y")
          for _ = 1, 3 do assert.is_true(db:incr("x")) end
          assert.same({ 4, 0 }, { db:value("x"), db:value("y") })
          assert.is_true(y:incr())
          assert.same({ 4, 1 }, { db:value("x"), db:value("y") })
        end)
      end

      it("are emptied by db:close; the store handle then refuses", function()
        db = assert(tally.open("memory", { handle_admit = "always" }))
        for i = 1, 10 do db:incr("x:" .. i) end
        local slots = core._store_slots(db)
        assert.is_not_nil(next(slots))
        db:close()
        assert.is_nil(next(slots))
        assert.equal(0, core._store_slots_stats(db).lent)
        assert.has_error(function() db:incr("x:1") end)
        db = nil
      end)
    end)
  end
end
