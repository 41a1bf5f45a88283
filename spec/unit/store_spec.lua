-- tally.open and the store handle: specs, errors, sharing, closing.
local helper = require "spec.support.helper"
local tally = require "tally"

local err = helper.err

-- c:info() less its incarnation (random per creation), which must be there.
local function plain_info(c)
  local info = c:info()
  assert.matches("^" .. ("%x"):rep(16) .. "$", info.incarnation)
  info.incarnation = nil
  return info
end

describe("tally", function()
  it("has a version and the list of policies", function()
    assert.is_string(tally.version)
    assert.matches("^%d+%.%d+%.%d+$", tally.version)
    assert.equal(tally.version, tally._VERSION)
    assert.same({ "thread", "random", "round_robin", "key", "slot" }, tally.policies)
  end)

  it("exposes the method tables of its handles", function()
    assert.is_function(tally.store_methods.incr)
    assert.is_function(tally.counter_methods.incr)
    assert.is_function(tally.counter_methods._nop)
    local db = tally.open()
    assert.equal(tally.store_methods.counter, db.counter)
    assert.equal(tally.counter_methods.incr, db:counter("x").incr)
    db:close()
  end)
end)

describe("tally.open()", function()
  it("opens a memory store with no spec or 'memory'", function()
    for _, spec in ipairs({ "memory" }) do
      local db = assert(tally.open(spec))
      assert.equal("tally.store (memory)", tostring(db))
      assert.equal("memory", db:stats().kind)
      db:close()
    end
    local db = assert(tally.open())
    assert.equal("tally.store (memory)", tostring(db))
    db:close()
  end)

  it("keeps memory stores apart", function()
    local a, b = tally.open(), tally.open()
    a:incr("x", 5)
    assert.equal(5, a:value("x"))
    assert.same({ nil, "no such counter 'x'", "ENOENT" }, { b:value("x") })
    a:close(); b:close()
  end)

  it("creates a file store and opens it again", function()
    local path = helper.tmpfile()
    local db = assert(tally.open("file:" .. path))
    assert.equal("tally.store (file:" .. path .. ")", tostring(db))
    assert.equal("file", db:stats().kind)
    db:incr("x", 42)
    db:close()
    db = assert(tally.open("file:" .. path, { create = false }))
    assert.equal(42, db:value("x"))
    db:close()
  end)

  it("creates new files with mode 0600 by default, or opts.mode", function()
    local p1, p2 = helper.tmpfile(), helper.tmpfile()
    assert(tally.open("file:" .. p1)):close()
    assert(tally.open("file:" .. p2, { mode = tonumber("640", 8) })):close()
    assert.equal("600\n", (helper.sh("stat -c %a " .. helper.q(p1))))
    assert.equal("640\n", (helper.sh("stat -c %a " .. helper.q(p2))))
  end)

  describe("raises on misuse", function()
    it("of the spec", function()
      assert.equal("bad argument #1 to 'open' (string expected, got number)",
                   err(function() tally.open(42) end))
      assert.equal("bad argument #1 to 'open' (string expected, got table)",
                   err(function() tally.open({}) end))
      assert.equal("bad argument #1 to 'open' (unknown store 'foo:x' (expected 'memory' or 'file:PATH'))",
                   err(function() tally.open("foo:x") end))
      assert.equal("bad argument #1 to 'open' (unknown store 'file:' (expected 'memory' or 'file:PATH'))",
                   err(function() tally.open("file:") end))
      assert.equal("bad argument #1 to 'open' (unknown store 'Memory' (expected 'memory' or 'file:PATH'))",
                   err(function() tally.open("Memory") end))
      assert.equal("bad argument #1 to 'open' (a store spec holds no NUL byte)",
                   err(function() tally.open("file:/tmp/a\0b") end))
    end)

    it("of the options", function()
      assert.equal("bad argument #2 to 'open' (table expected, got string)",
                   err(function() tally.open("memory", "x") end))
      assert.equal("bad argument #2 to 'open' (unknown option 'modes')",
                   err(function() tally.open("memory", { modes = 1 }) end))
      assert.equal("bad argument #2 to 'open' (mode must be an integer from 0 to 4095 (permission bits), got '0600')",
                   err(function() tally.open("memory", { mode = "0600" }) end))
      assert.equal("bad argument #2 to 'open' (mode must be an integer from 0 to 4095 (permission bits), got 4096)",
                   err(function() tally.open("memory", { mode = 4096 }) end))
      assert.equal("bad argument #2 to 'open' (create must be a boolean, got 'yes')",
                   err(function() tally.open("memory", { create = "yes" }) end))
    end)
  end)

  describe("returns nil, message, code", function()
    it("for a missing directory", function()
      local path = helper.tmpfile("no-such-dir") .. "/x.tly"
      local db, msg, code = tally.open("file:" .. path)
      assert.is_nil(db)
      assert.is_string(msg)
      assert.truthy(msg:find(path, 1, true))
      assert.truthy(msg:find("No such file or directory", 1, true))
      assert.equal("ESYS", code)
    end)

    it("for a missing file with create = false", function()
      local path = helper.tmpfile()
      local db, msg, code = tally.open("file:" .. path, { create = false })
      assert.is_nil(db)
      assert.truthy(msg:find(path, 1, true))
      assert.equal("ESYS", code)
      assert.is_nil(io.open(path, "rb"))           -- and nothing was created
    end)

    it("for a foreign file, and leaves it alone", function()
      local path = helper.tmpfile("foreign.txt")
      local text = ("this is not a tally store\n"):rep(200)
      helper.write(path, text)
      local db, msg, code = tally.open("file:" .. path)
      assert.is_nil(db)
      assert.truthy(msg:find("not a tally store", 1, true))
      assert.truthy(msg:find(path, 1, true))
      assert.equal("ENOTSTORE", code)
      local f = assert(io.open(path, "rb"))
      assert.equal(text, f:read("a"))
      f:close()
    end)

    it("for an empty file", function()
      local path = helper.tmpfile()
      helper.write(path, "")
      local db, msg, code = tally.open("file:" .. path)
      assert.is_nil(db)
      assert.truthy(msg:find("not a tally store", 1, true))
      assert.equal("ENOTSTORE", code)
    end)

    it("for a truncated store", function()
      local path = helper.tmpfile()
      local db = assert(tally.open("file:" .. path))
      db:incr("x")
      db:close()
      local f = assert(io.open(path, "rb"))
      local head = f:read(100)
      f:close()
      helper.write(path, head)
      local db2, msg, code = tally.open("file:" .. path)
      assert.is_nil(db2)
      assert.is_string(msg)
      assert.truthy(code == "ECORRUPT" or code == "ENOTSTORE", code)
    end)

    it("for a file without permission", function()
      local path = helper.tmpfile()
      assert(tally.open("file:" .. path, { mode = 0 })):close() -- 0 means 0600
      os.execute("chmod 000 " .. helper.q(path))
      local probe = io.open(path, "rb")
      if probe then                     -- root ignores permission bits:
        probe:close()                   -- try as nobody in a child process
        local out, code = helper.sh("setpriv --reuid=65534 --regid=65534 --clear-groups "
          .. helper.q(helper.bin) .. " -e " .. helper.q(
            ("print(select(2, tally.open('file:%s')), select(3, tally.open('file:%s')))")
            :format(path, path)))
        if code ~= 0 then
          pending("running as root, and cannot run a child as nobody: " .. out)
          return
        end
        assert.truthy(out:find(path .. ": ", 1, true), out)
        assert.truthy(out:find("Permission denied\tESYS\n$"), out)
        return
      end
      local db, msg, code = tally.open("file:" .. path)
      assert.is_nil(db)
      assert.truthy(msg:find("Permission denied", 1, true))
      assert.equal("ESYS", code)
    end)
  end)
end)

describe("tally.store", function()
  local db
  before_each(function() db = assert(tally.open()) end)
  after_each(function() db:close() end)

  describe(":counter(name, { create = false })", function()
    it("opens an existing counter only, never creating one", function()
      assert.same({ nil, "no such counter 'none'", "ENOENT" }, { db:counter("none", { create = false }) })
      assert.same({}, db:names())
      db:incr("there", 3)
      assert.equal(3, db:counter("there", { create = false }):value())
      db:drop("there")
      assert.is_nil((db:counter("there", { create = false })))
      assert.same({}, db:names())
      assert.matches("create must be a boolean or \"new\"", helper.err(db.counter, db, "x", { create = "no" }))
    end)
  end)

  describe(':counter(name, { create = "new" })', function()
    it("creates a new counter only, never opening one that exists", function()
      local c = assert(db:counter("fresh", { create = "new", shards = 2 }))
      assert.equal(2, c:info().shards)
      c:incr(4)
      assert.same({ nil, "counter 'fresh' exists", "EEXIST" }, { db:counter("fresh", { create = "new" }) })
      assert.equal(4, db:value("fresh"))
      db:drop("fresh")
      assert.equal(0, db:counter("fresh", { create = "new" }):value())   -- dropped: new again
    end)
  end)

  describe(":incr() and :decr()", function()
    it("create the counter with the defaults and count", function()
      assert.is_true(db:incr("a"))
      assert.is_true(db:incr("a", 5))
      assert.is_true(db:decr("a", 2))
      assert.is_true(db:decr("a"))
      assert.equal(3, db:value("a"))
      assert.same({ name = "a", shards = 1, policy = "thread", auto = true, grown = 0, shrunk = 0 }, plain_info(db:counter("a")))
    end)

    it("accept negative amounts and integral floats", function()
      db:incr("a", -7)
      db:decr("a", -2.0)
      assert.equal(-5, db:value("a"))
      assert.equal(math.type(db:value("a")), "integer")
    end)

    it("raise on bad arguments", function()
      assert.equal("bad argument #1 to 'incr' (string expected, got number)",
                   err(function() db:incr(1) end))
      assert.equal("bad argument #1 to 'incr' (string expected, got no value)",
                   err(function() db:incr() end))
      assert.equal("bad argument #1 to 'incr' (name must be 1 to 255 bytes, got 0)",
                   err(function() db:incr("") end))
      assert.equal("bad argument #2 to 'incr' (number has no integer representation)",
                   err(function() db:incr("a", 1.5) end))
      assert.equal("bad argument #2 to 'incr' (number expected, got string)",
                   err(function() db:incr("a", "x") end))
      assert.equal("bad argument #2 to 'decr' (number expected, got table)",
                   err(function() db:decr("a", {}) end))
      assert.same({}, db:names())
    end)

    it("return nil, message on overflow and count nothing", function()
      db:counter("o", { shards = 1 })
      assert.is_true(db:incr("o", 2^61 | 0))
      local ok, msg, code = db:incr("o", 2^61 | 0)
      assert.is_nil(ok)
      assert.is_string(msg)
      assert.equal("ERANGE", code)
      assert.equal(2^61 | 0, db:value("o"))
    end)

    it("recreate a counter dropped behind their back", function()
      db:incr("a", 5)
      local other = db:counter("a")
      assert.is_true(db:drop("a"))
      assert.is_true(db:incr("a", 2))
      assert.equal(2, db:value("a"))
      assert.same({ nil, "counter 'a' was dropped", "EDROPPED" }, { other:incr() })
    end)

    it("see a counter dropped and recreated by another handle", function()
      local path = helper.tmpfile()
      local a = assert(tally.open("file:" .. path))
      local b = assert(tally.open("file:" .. path))
      a:incr("x", 10)
      assert.equal(10, b:value("x"))
      assert.is_true(b:drop("x"))
      b:incr("x", 3)
      a:incr("x", 1)
      assert.equal(4, b:value("x"))
      a:close(); b:close()
    end)
  end)

  describe(":value()", function()
    it("returns nil, message for an absent counter and does not create it", function()
      assert.same({ nil, "no such counter 'nope'", "ENOENT" }, { db:value("nope") })
      assert.same({}, db:names())
    end)

    it("raises on a bad name", function()
      assert.equal("bad argument #1 to 'value' (string expected, got nil)",
                   err(function() db:value(nil) end))
      assert.equal("bad argument #1 to 'value' (name must be 1 to 255 bytes, got 256)",
                   err(function() db:value(("x"):rep(256)) end))
    end)
  end)

  describe(":drop()", function()
    it("removes the counter", function()
      db:incr("a", 3); db:incr("b", 4)
      assert.is_true(db:drop("a"))
      assert.same({ "b" }, db:names())
      assert.same({ nil, "no such counter 'a'", "ENOENT" }, { db:value("a") })
      assert.same({ nil, "no such counter 'a'", "ENOENT" }, { db:drop("a") })
    end)

    it("makes other handles report the drop", function()
      local c = db:counter("a")
      c:incr(3)
      db:drop("a")
      assert.same({ nil, "counter 'a' was dropped", "EDROPPED" }, { c:incr() })
      assert.same({ nil, "counter 'a' was dropped", "EDROPPED" }, { c:value() })
    end)

    it("raises on a bad name", function()
      assert.equal("bad argument #1 to 'drop' (string expected, got boolean)",
                   err(function() db:drop(true) end))
    end)
  end)

  describe(":names()", function()
    it("lists every counter, sorted", function()
      for _, n in ipairs({ "b", "a:2", "a:10", "c", "a" }) do db:incr(n) end
      assert.same({ "a", "a:10", "a:2", "b", "c" }, db:names())
      assert.same({ "a", "a:10", "a:2", "b", "c" }, db:names("*"))
    end)

    it("sorts by bytes: high bytes last, a shorter name first, long shared prefixes", function()
      local function before(x, y)                 -- memcmp's order, a prefix first
        for i = 1, math.min(#x, #y) do
          local a, b = x:byte(i), y:byte(i)
          if a ~= b then return a < b end
        end
        return #x < #y
      end
      local pieces = { "a", "b", "\1", "\127", "\128", "\255", "abcdefgh", "é", ":" }
      local seed, names, seen = 7, {}, {}
      for _ = 1, 3000 do
        local t = {}
        repeat
          seed = (seed * 16807) % 2147483647
          t[#t + 1] = pieces[seed % #pieces + 1]
          seed = (seed * 16807) % 2147483647
        until seed % 5 == 0 or #t > 12
        local name = table.concat(t)
        if not seen[name] then
          seen[name] = true
          names[#names + 1] = name
          db:incr(name)
        end
      end
      -- names of exactly 8 and 16 bytes (the sort reads 8 at a time) tie
      -- on their last 8 with the longer names they begin: several groups,
      -- so that in some the short name comes first in the walk's order
      for g = 1, 60 do
        local p8 = string.format("%08d", g)
        for _, tail in ipairs({ "", "c", "b", "a", "12345678", "12345678b", "12345678a", "\255" }) do
          names[#names + 1] = p8 .. tail
          db:incr(p8 .. tail)
        end
      end
      table.sort(names, before)
      local got = db:names()
      assert.equal(#names, #got)
      for i = 1, #names do assert.equal(names[i], got[i], "name " .. i) end
    end)

    it("lists the counters matching a pattern", function()
      for _, n in ipairs({ "post:1:likes", "post:2:likes", "post:1:views", "user:1" }) do
        db:incr(n)
      end
      assert.same({ "post:1:likes", "post:2:likes" }, db:names("post:*:likes"))
      assert.same({ "post:1:likes", "post:1:views" }, db:names("post:1:*"))
      assert.same({ "post:1:likes", "post:2:likes" }, db:names("post:?:l*"))
      assert.same({}, db:names("nothing*"))
    end)

    it("matches names that hold '*' or '?' as any other bytes", function()
      db:family("post:*", { shards = 4 })
      for _, n in ipairs({ "*a", "**", "post:*1", "post:?", "b" }) do db:incr(n, 2) end
      assert.same({ "**", "*a", "b", "post:*1", "post:?" }, db:names())
      assert.same({ "post:*1", "post:?" }, db:names("post:*"))
      assert.same(10, (db:sum()))
      assert.equal(4, db:counter("post:*1"):info().shards)   -- its family's options
      assert.matches('"post:%*1"', db:export("post:*"))
    end)

    it("raises on a bad pattern", function()
      assert.equal("bad argument #1 to 'names' (string expected, got number)",
                   err(function() db:names(1) end))
    end)
  end)

  describe(":sum()", function()
    it("sums the matching counters and counts them", function()
      db:incr("post:1:likes", 3)
      db:incr("post:2:likes", 4)
      db:incr("post:2:views", 100)
      assert.same({ 7, 2 }, { db:sum("post:*:likes") })
      assert.same({ 107, 3 }, { db:sum() })
      assert.same({ 0, 0 }, { db:sum("none:*") })
    end)
  end)

  describe(":stats()", function()
    it("reports the store's sizes", function()
      db:incr("a"); db:incr("b")
      local st = db:stats()
      assert.equal(2, st.counters)
      assert.equal("memory", st.kind)
      for _, k in ipairs({ "file_bytes", "used_bytes", "retired_bytes" }) do
        assert.equal("integer", math.type(st[k]), k)
      end
      assert.truthy(st.used_bytes > 0)
      db:counter("a"):reshard(32)
      assert.truthy(db:stats().retired_bytes > st.retired_bytes)
    end)
  end)

  describe(":sync() and :check()", function()
    it("return true on a healthy store", function()
      local path = helper.tmpfile()
      local f = assert(tally.open("file:" .. path))
      f:incr("a", 1)
      assert.is_true(f:sync())
      assert.is_true(f:check())
      assert.is_true(db:sync())
      assert.is_true(db:check())
      f:close()
    end)

    -- The guarantee "db:sync() makes it survive the machine" rests on two
    -- calls: msync(MS_SYNC) over the mapping, then fsync of the store's
    -- file. A machine cannot be pulled here; strace shows both are made.
    it("writes the mapping and the file to disk (msync MS_SYNC, then fsync)", function()
      if not helper.on_path("strace") then
        pending("strace is not installed (scripts/setup installs it)")
        return
      end
      local path, script, trace = helper.tmpfile(), helper.tmpfile("sync.lua"), helper.tmpfile("trace")
      helper.write(script, ([[
        local db = assert(require("tally").open("file:" .. %q))
        db:incr("a", 7)
        io.stderr:write("synced\n")
        assert(db:sync())
        db:close()
      ]]):format(path))
      local out, code = helper.sh("strace -f -s 4096 -e trace=openat,msync,fsync,write -o " .. helper.q(trace)
                                  .. " " .. helper.q(helper.bin) .. " " .. helper.q(script))
      assert.equal(0, code, out)
      local fd, after, msynced, fsynced
      for line in io.lines(trace) do
        local opened = line:match('openat%(AT_FDCWD, "' .. path:gsub("%p", "%%%0") .. '", [^)]*%) = (%d+)')
        if opened then fd = opened end
        if line:find('write(2, "synced\\n"', 1, true) then after = true end
        if after and line:find("msync%(0x%x+, %d+, MS_SYNC%)%s+= 0") then msynced = true end
        if msynced and fd and line:find("fsync%(" .. fd .. "%)%s+= 0") then fsynced = true end
      end
      assert.truthy(fd, "the store was never opened")
      assert.is_true(msynced == true, "no msync(MS_SYNC) after the increment")
      assert.is_true(fsynced == true, "no fsync of the store's file after its msync")
    end)
  end)

  describe(":close()", function()
    it("is idempotent and makes every method raise", function()
      local c = db:counter("a")
      db:close()
      db:close()
      assert.equal("tally.store (closed)", tostring(db))
      for _, call in ipairs({
        function() db:incr("a") end, function() db:decr("a") end,
        function() db:value("a") end, function() db:counter("a") end,
        function() db:drop("a") end, function() db:family("a*", {}) end,
        function() db:sum() end, function() db:names() end,
        function() db:sync() end, function() db:check() end,
        function() db:stats() end,
      }) do
        assert.equal("attempt to use a closed store", err(call))
      end
      assert.equal("tally.counter (closed)", tostring(c))
      for _, m in ipairs({ "incr", "decr", "value", "shards", "reset", "info" }) do
        assert.equal("attempt to use a closed store", err(c[m], c))
      end
      assert.equal("attempt to use a closed store", err(c.reshard, c, 2))
      c:close()                                  -- still fine
    end)

    it("closes the store at the end of a <close> block", function()
      local path = helper.tmpfile()
      local outer
      do
        local s <close> = assert(tally.open("file:" .. path))
        outer = s
        s:incr("x", 9)
      end
      assert.equal("tally.store (closed)", tostring(outer))
      local again <close> = assert(tally.open("file:" .. path))
      assert.equal(9, again:value("x"))
    end)

    it("closes the store when it is collected", function()
      local path = helper.tmpfile()
      do
        local s = assert(tally.open("file:" .. path))
        s:counter("x"):incr(4)
      end
      collectgarbage(); collectgarbage()
      local again = assert(tally.open("file:" .. path))
      assert.equal(4, again:value("x"))
      again:close()
    end)
  end)

  it("raises when called on something else", function()
    assert.equal("bad argument #1 to 'incr' (tally.store expected, got tally.counter)",
                 err(function() local c = db:counter("a"); db.incr(c, "a") end))
    assert.equal("bad argument #1 to 'value' (tally.store expected, got string)",
                 err(function() db.value("a") end))
  end)
end)

describe("a file store", function()
  it("is shared by two handles in one process", function()
    local path = helper.tmpfile()
    local a = assert(tally.open("file:" .. path))
    local b = assert(tally.open("file:" .. path))
    local ca = a:counter("hits", { shards = 4 })
    local cb = b:counter("hits")
    assert.same({ name = "hits", shards = 4, policy = "thread" }, plain_info(cb))
    assert.equal(ca:info().incarnation, cb:info().incarnation)   -- one counter
    ca:incr(3)
    cb:incr(4)
    assert.equal(7, ca:value())
    assert.equal(7, b:value("hits"))
    ca:reshard(8)
    assert.equal(8, cb:info().shards)
    assert.equal(7, cb:value())
    a:close()
    assert.equal(7, cb:value())           -- b is independent of a
    b:close()
  end)

  it("is shared with a child process", function()
    local path = helper.tmpfile()
    local db = assert(tally.open("file:" .. path))
    db:incr("shared", 5)
    local out, code = helper.tally("-e", ([[
      local db = assert(tally.open("file:%s"))
      print(db:value("shared"))
      db:incr("shared", 10)
      db:incr("child", 1)
      db:close()
    ]]):format(path))
    assert.equal("5\n", out)
    assert.equal(0, code)
    assert.equal(15, db:value("shared"))
    assert.equal(1, db:value("child"))
    assert.same({ "child", "shared" }, db:names())
    db:close()
  end)
end)

describe("tally.store:stats()", function()
  it("says the format, the size limit, the writers and the schedules kept", function()
    local db = assert(tally.open("file:" .. helper.tmpfile()))
    local st = db:stats()
    assert.same({ 9, 32 * 2^30, 0, 0 }, { st.format, st.max_bytes, st.writers, st.schedules })
    db:incr("a")                                    -- this thread draws a ticket
    db:rollup("a", { every = 10 })
    db:rollup("*", { every = 60 })
    db:tick(1700000005)
    st = db:stats()
    assert.same({ "file", 1, 1, 2 }, { st.kind, st.counters, st.writers, st.schedules })
    db:close()
  end)

  it("says how the space used splits, and what reuse, expiry and caps did", function()
    local db = assert(tally.open("file:" .. helper.tmpfile()))
    local st = db:stats()
    assert.same({ 0, 0, 0, 0, 0 }, { st.retired_bytes, st.reusable_bytes, st.reused_bytes,
                                     st.expired, st.capped })
    assert.is_true(st.live_bytes > 0 and st.live_bytes <= st.used_bytes)
    db:incr("a")
    db:drop("a")
    st = db:stats()
    assert.is_true(st.retired_bytes + st.reusable_bytes > 0)
    assert.is_true(st.live_bytes + st.retired_bytes + st.reusable_bytes <= st.used_bytes)
    db:close()
  end)
end)
