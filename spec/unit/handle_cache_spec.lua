-- The store's cache of counter handles by name (db:incr(name), db:decr,
-- db:value): tally.open's handle_cache option, its bound, what stays and
-- what goes, and drop, expiry and close through it.
local helper = require "spec.support.helper"
local tally = require "tally"
local core = require "tally.core"

local err = helper.err

local T = 1700000040             -- a made-up clock (seconds) for db:tick

local look = require "spec.support.cache"
local gc, cached, stats = look.gc, look.cached, look.stats

describe("tally.open(spec, { handle_cache = N })", function()
  it("holds 10000 handles by default", function()
    local db = assert(tally.open())
    assert.equal(10000, core.HANDLE_CACHE)
    assert.same({ young = 0, old = 0, held = 0, cap = 10000, rotations = 0 }, stats(db))
    assert.same({ by_name = 0, admitted = 0, clears = 0, set = 0, bits = 131072 },
                core._store_cache_door(db))
    db:close()
  end)

  it("admits a name on its repeat by default, on its first miss with handle_admit = 'always'", function()
    local db = assert(tally.open("memory", { handle_admit = "always" }))
    assert.is_nil(core._store_cache_door(db))
    db:incr("a")
    assert.equal(1, stats(db).held)
    db:close()
    assert.equal("bad argument #2 to 'open' (handle_admit must be 'repeat' or 'always', got 'often')",
                 err(tally.open, "memory", { handle_admit = "often" }))
    assert.equal("bad argument #2 to 'open' (handle_admit must be 'repeat' or 'always', got true)",
                 err(tally.open, "memory", { handle_admit = true }))
  end)

  it("raises on a handle_cache that is not an integer from 0 to 2^31-1", function()
    local function msg(got)
      return "bad argument #2 to 'open' (handle_cache must be an integer from 0 to "
             .. "2147483647 (handles), got " .. got .. ")"
    end
    assert.equal(msg("-1"), err(tally.open, "memory", { handle_cache = -1 }))
    assert.equal(msg("1.5"), err(tally.open, "memory", { handle_cache = 1.5 }))
    assert.equal(msg("'100'"), err(tally.open, "memory", { handle_cache = "100" }))
    assert.equal(msg("true"), err(tally.open, "memory", { handle_cache = true }))
    assert.equal(msg("2147483648"), err(tally.open, "memory", { handle_cache = 2^31 | 0 }))
    local db = assert(tally.open("memory", { handle_cache = 2147483647, handle_admit = "always" }))
    assert.equal(2147483647, stats(db).cap)
    db:close()
  end)
end)

describe("the handle cache", function()
  local db
  after_each(function() if db then db:close() end end)

  it("holds at most handle_cache handles, and strongly: the newest names stay", function()
    db = assert(tally.open("memory", { handle_cache = 100, handle_admit = "always" }))
    for i = 1, 300 do assert.is_true(db:incr("n:" .. i)) end
    gc()
    local s = stats(db)
    assert.is_true(s.held <= 100, "held " .. s.held)   -- unbounded: 300
    assert.equal(50, s.young)                           -- weak: 0 after a collection
    assert.equal(50, s.old)
    assert.equal(5, s.rotations)
    for i = 201, 300 do assert.is_userdata(cached(db, "n:" .. i), "n:" .. i) end
    assert.is_nil(cached(db, "n:200"))
    for i = 1, 300 do assert.equal(1, db:value("n:" .. i)) end
    assert.is_true(stats(db).held <= 100)               -- db:value goes through it too
  end)

  it("keeps the handle of a name in use across rotations", function()
    db = assert(tally.open("memory", { handle_cache = 20, handle_admit = "always" }))
    db:incr("hot")
    local seen = setmetatable({ [cached(db, "hot")] = true }, { __mode = "k" })
    for r = 1, 10 do
      for i = 1, 7 do db:decr("new:" .. r .. ":" .. i) end
      gc()
      assert.is_true(db:incr("hot"))
    end
    gc()
    assert.is_true(seen[cached(db, "hot")])   -- the very handle of the first db:incr
    assert.is_true(stats(db).rotations >= 6)
    assert.equal(11, db:value("hot"))
    assert.is_true(stats(db).held <= 20)
  end)

  it("moves a name found in the old generation into the young one", function()
    db = assert(tally.open("memory", { handle_cache = 10, handle_admit = "always" }))
    db:incr("p")
    local h = cached(db, "p")
    for i = 1, 5 do db:incr("n:" .. i) end   -- young was full at 5: it became old
    local st = core._store_cache(db)
    assert.equal(1, stats(db).rotations)
    assert.equal(h, st[2].p)
    assert.is_nil(st[1].p)
    assert.equal(1, db:value("p"))
    assert.equal(h, st[1].p)
    assert.is_nil(st[2].p)
    assert.same({ young = 2, old = 4, held = 6, cap = 10, rotations = 1 }, stats(db))
  end)

  it("lets go of a name not used for handle_cache/2 new names", function()
    db = assert(tally.open("memory", { handle_cache = 10, handle_admit = "always" }))
    db:incr("cold")
    for i = 1, 10 do db:incr("n:" .. i) end
    assert.is_nil(cached(db, "cold"))
    assert.equal(2, stats(db).rotations)
    assert.is_true(db:incr("cold"))          -- opened again by name: the same counter
    assert.equal(2, db:value("cold"))
  end)

  it("with 1 holds one handle", function()
    db = assert(tally.open("memory", { handle_cache = 1, handle_admit = "always" }))
    for i = 1, 5 do db:incr("n:" .. i) end
    assert.same({ young = 1, old = 0, held = 1, cap = 1, rotations = 4 }, stats(db))
    assert.is_userdata(cached(db, "n:5"))
    for i = 1, 5 do assert.equal(1, db:value("n:" .. i)) end
  end)

  it("with 0 holds its handles weakly, only while something else does", function()
    db = assert(tally.open("memory", { handle_cache = 0, handle_admit = "always" }))
    for i = 1, 300 do db:incr("n:" .. i) end
    local c = db:counter("kept")
    gc()
    assert.same({ young = 1, old = 0, held = 1, cap = 0, rotations = 0 }, stats(db))
    assert.equal(c, cached(db, "kept"))
    for i = 1, 300 do assert.equal(1, db:value("n:" .. i)) end
    assert.is_true(db:incr("kept"))
    assert.equal(1, c:value())
  end)

  it("shares db:counter's handle, and counts it", function()
    db = assert(tally.open("memory", { handle_cache = 4, handle_admit = "always" }))
    local c = db:counter("c")
    assert.equal(c, cached(db, "c"))
    for i = 1, 8 do db:counter("n:" .. i) end
    assert.is_true(stats(db).held <= 4)
    assert.is_nil(cached(db, "c"))
    assert.is_true(db:incr("c", 3))
    assert.equal(3, c:value())
  end)

  it("forgets a dropped name in either generation; db:incr then creates it anew", function()
    db = assert(tally.open("memory", { handle_cache = 10, handle_admit = "always" }))
    -- round_robin: no name slots, so db:incr moves a name from old to young
    db:family("*", { policy = "round_robin" })
    db:incr("young", 5)
    db:incr("old", 7)
    for i = 1, 3 do db:incr("n:" .. i) end
    db:incr("young", 5)
    for i = 4, 5 do db:incr("n:" .. i) end   -- n:4 found young full (5): it rotated
    local st = core._store_cache(db)
    assert.is_userdata(st[2].old)
    db:incr("young")                          -- back into young
    assert.is_userdata(st[1].young)
    assert.is_true(db:drop("young"))
    assert.is_true(db:drop("old"))
    assert.is_nil(cached(db, "young"))
    assert.is_nil(cached(db, "old"))
    local s = stats(db)
    assert.same({ young = 2, old = 3 }, { young = s.young, old = s.old })   -- n:4 n:5; n:1-3
    assert.same({ nil, "no such counter 'old'", "ENOENT" }, { db:value("old") })
    assert.is_true(db:incr("old"))
    assert.is_true(db:decr("young", 2))
    assert.equal(1, db:value("old"))
    assert.equal(-2, db:value("young"))
  end)

  it("reopens a name another handle dropped under a cached handle", function()
    local path = helper.tmpfile("handle_cache.tly")
    os.remove(path)
    db = assert(tally.open("file:" .. path, { handle_cache = 10, handle_admit = "always" }))
    local other = assert(tally.open("file:" .. path))
    db:incr("d", 4)
    for i = 1, 5 do db:incr("n:" .. i) end     -- "d" is in the old generation
    db:incr("e", 5)
    assert.is_true(other:drop("d"))            -- the cache of db does not know
    assert.is_true(other:drop("e"))
    assert.is_true(db:incr("d"))               -- EDROPPED, then created anew
    assert.is_true(db:incr("e"))
    assert.equal(1, db:value("d"))
    assert.equal(1, other:value("e"))
    assert.is_true(stats(db).held <= 10)
    other:close()
    db:close()
    db = nil
    os.remove(path)
  end)

  it("sees an expired counter go and come back, in either generation", function()
    db = assert(tally.open("memory", { handle_cache = 10, handle_admit = "always" }))
    db:family("s:*", { idle = 10, policy = "round_robin" })   -- no name slots
    db:incr("s:young", 3)
    db:incr("s:old", 4)
    for i = 1, 4 do db:incr("n:" .. i) end
    db:incr("s:young", 3)
    local st = core._store_cache(db)
    assert.is_userdata(st[2]["s:old"])
    assert.is_userdata(st[1]["s:young"])
    db:tick(T)
    db:tick(T + 11)
    assert.same({ "n:1", "n:2", "n:3", "n:4" }, db:names())
    assert.same({ nil, "no such counter 's:young'", "ENOENT" }, { db:value("s:young") })
    assert.same({ nil, "no such counter 's:old'", "ENOENT" }, { db:value("s:old") })
    assert.same({ "n:1", "n:2", "n:3", "n:4" }, db:names())   -- reading made nothing
    assert.is_true(db:incr("s:young"))
    assert.is_true(db:incr("s:old", 2))
    assert.equal(1, db:value("s:young"))
    assert.equal(2, db:value("s:old"))
  end)

  it("lets every handle go when the store closes", function()
    db = assert(tally.open("memory", { handle_cache = 10, handle_admit = "always" }))
    for i = 1, 8 do db:incr("n:" .. i) end
    assert.equal(8, stats(db).held)
    db:close()
    assert.same({ young = 0, old = 0, held = 0, cap = 10, rotations = 1 }, stats(db))
    assert.equal("attempt to use a closed store", err(db.incr, db, "n:1"))
    db = nil
  end)
end)

describe("handle_admit = 'repeat' (the default)", function()
  local db
  after_each(function() if db then db:close() end end)

  local function door(d) return core._store_cache_door(d or db) end

  it("adds a name's first increment by name, caches it on its repeat", function()
    db = assert(tally.open("memory", { handle_cache = 100 }))
    assert.is_true(db:incr("a", 2))
    assert.is_nil(cached(db, "a"))
    assert.same({ by_name = 1, admitted = 0, clears = 0, set = 1, bits = 131072 }, door())
    assert.is_true(db:decr("a"))                -- its repeat: opened and cached
    assert.is_userdata(cached(db, "a"))
    assert.same({ by_name = 1, admitted = 1, clears = 0, set = 1, bits = 131072 }, door())
    assert.is_true(db:incr("a", 5))             -- through the cached handle
    assert.equal(1, door().by_name)
    assert.equal(6, db:value("a"))
  end)

  it("holds no handle for names seen once (but a few whose bit another set), and counts them exactly", function()
    db = assert(tally.open("memory", { handle_cache = 100 }))
    for i = 1, 3000 do assert.is_true(db:incr("n:" .. i, i)) end
    gc()
    local s, d = stats(db), door()
    assert.equal(3000, d.by_name + d.admitted)
    assert.is_true(d.admitted < 60, d.admitted .. " admitted")   -- 2^17 bits: about 34 collide
    assert.equal(d.admitted, s.held)                             -- "always": 100, after 59 rotations
    assert.equal(0, s.rotations)
    assert.equal(3000, #db:names("n:*"))
    for i = 1, 3000, 7 do assert.equal(i, db:value("n:" .. i)) end
    assert.equal(3000 * 3001 // 2, db:sum("n:*"))
  end)

  it("forgets what it saw after 8192 names, and when young rotates", function()
    db = assert(tally.open("memory", { handle_cache = 1000 }))
    local i = 0
    repeat
      i = i + 1
      db:incr("n:" .. i)
    until door().clears == 1 or i == 9000
    assert.same({ 8192, 1, 0 }, { door().by_name, door().clears, door().set })
    db:incr("n:1")                              -- seen before the clear: by name again
    assert.is_nil(cached(db, "n:1"))
    assert.equal(8193, door().by_name)
    db:close()
    db = assert(tally.open("memory", { handle_cache = 4 }))
    for _, n in ipairs({ "x", "y", "z" }) do db:incr(n); db:incr(n) end   -- 3 admitted: young (2) rotates
    assert.equal(1, stats(db).rotations)
    assert.same({ 3, 3, 1, 0 }, { door().by_name, door().admitted, door().clears, door().set })
    db:incr("x")                                -- in old: promoted, not by name
    db:incr("w")
    db:incr("w")                                -- by name, then admitted
    assert.same({ 4, 4 }, { door().by_name, door().admitted })
    assert.equal(3, db:value("x"))
  end)

  it("sizes its bits to the cache: a name that comes back within handle_cache/2 misses is admitted", function()
    db = assert(tally.open("memory", { handle_cache = 100000 }))
    assert.equal(2^20, door().bits)             -- 8 per handle, a power of two
    for i = 1, 40000 do db:incr("n:" .. i) end  -- past the 8,192 of the smallest
    assert.equal(0, door().clears)
    for i = 1, 40000 do db:incr("n:" .. i) end
    local d = door()
    assert.is_true(d.admitted >= 40000, d.admitted .. " admitted")
    assert.is_true(d.by_name <= 40000 + 2000, d.by_name .. " by name")   -- a few collide
    assert.equal(2, db:value("n:1"))
    db:close()
    db = assert(tally.open("memory", { handle_cache = 2000000000 }))
    assert.equal(2^28, door().bits)             -- at most 32 MiB
  end)

  it("reads a name it does not hold by name too, and caches it on its repeat", function()
    db = assert(tally.open("memory", { handle_cache = 100 }))
    local other = db:counter("seen", { shards = 4 })   -- cached: db:counter always caches
    other:incr(7)
    core._store_cache(db)[1].seen = nil                -- forgotten, as after a rotation
    assert.equal(7, db:value("seen"))
    assert.is_nil(cached(db, "seen"))
    assert.same({ 1, 0 }, { door().by_name, door().admitted })
    assert.same({ nil, "no such counter 'absent'", "ENOENT" }, { db:value("absent") })
    assert.equal(1, door().by_name)                     -- an absent name is not marked
    assert.equal(7, db:value("seen"))                   -- its repeat: opened and cached
    assert.is_userdata(cached(db, "seen"))
    assert.same({ 1, 1 }, { door().by_name, door().admitted })
    for i = 1, 500 do db:incr("v:" .. i, i) end
    local got = 0
    for i = 1, 500 do got = got + db:value("v:" .. i) end   -- marked by the increments: cached now
    assert.equal(500 * 501 // 2, got)
    assert.equal("bad argument #1 to 'value' (name must be 1 to 255 bytes, got 0)", err(function() db:value("") end))
  end)

  it("creates a new name by name with its family's options, and fails as before", function()
    db = assert(tally.open("memory"))
    db:family("r:*", { shards = 4, policy = "random" })
    db:family("k:*", { policy = "key" })
    db:family("f:*", { shards = 4, policy = function() return 3 end })
    assert.is_true(db:incr("r:1", 10))
    assert.same({ name = "r:1", shards = 4, policy = "random" },
                 (function(i) return { name = i.name, shards = i.shards, policy = i.policy } end)(db:counter("r:1"):info()))
    assert.equal("bad argument #3 to 'incr' (key expected for a counter with the key policy)",
                 err(function() db:incr("k:1") end))
    assert.same({}, db:names("k:*"))            -- nothing left behind
    assert.is_true(db:incr("k:1", 1, "some key"))
    assert.same({ nil, "counter 'big': adding 4611686018427387904 would overflow a shard (shards hold -2^62 to 2^62-1)", "ERANGE" },
                { db:incr("big", 1 << 62) })
    assert.same({}, db:names("big"))
    assert.is_true(db:incr("f:1", 2))           -- a Lua policy: through a handle
    assert.same({ 0, 0, 2, 0 }, db:counter("f:1"):shards())   -- shard 3 of 4, as with "always"
    assert.equal(1, door().by_name)             -- r:1 only
  end)

  it("creates anew a name dropped through another handle of the store", function()
    local path = helper.tmpfile("handle_admit.tly")
    os.remove(path)
    db = assert(tally.open("file:" .. path))
    local other = assert(tally.open("file:" .. path))
    assert.is_true(db:incr("d", 4))
    assert.is_true(other:drop("d"))
    assert.same({ nil, "no such counter 'd'", "ENOENT" }, { db:value("d") })
    assert.is_true(db:incr("d"))
    assert.equal(1, other:value("d"))
    assert.same({ 1, 2 }, { door().by_name, door().admitted })   -- db:value and db:incr: its repeats
    other:close()
    db:close()
    db = nil
    os.remove(path)
  end)
end)
