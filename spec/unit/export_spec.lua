-- db:export() and db:import(): counters as JSON in the Firestore
-- distributed-counter layout, exact per shard.
local helper = require "spec.support.helper"
local tally = require "tally"
local cjson = require "cjson"

-- c:info() less its incarnation (random per creation), which must be there.
local function plain(info)
  assert.matches("^" .. ("%x"):rep(16) .. "$", info.incarnation)
  info.incarnation = nil
  return info
end

local err = helper.err
local fmt = string.format

local TOP, BOTTOM = (1 << 62) - 1, -(1 << 62)   -- a shard's range
local SAFE = (1 << 53) - 1

-- A counter document: shards given as a Lua array of count texts.
local function doc(counters)
  local parts = {}
  for _, c in ipairs(counters) do
    local shards = {}
    for i, v in ipairs(c.shards) do shards[i] = fmt('"%d":{"count":%s}', i - 1, v) end
    parts[#parts + 1] = fmt('%s:{"num_shards":%s%s,"shards":{%s}}', cjson.encode(c.name),
                            c.num_shards or #c.shards,
                            c.policy and (',"policy":' .. cjson.encode(c.policy)) or "",
                            table.concat(shards, ","))
  end
  return '{"counters":{' .. table.concat(parts, ",") .. "}}"
end

describe("tally.store", function()
  local db
  before_each(function() db = assert(tally.open()) end)
  after_each(function() db:close() end)

  describe(":export()", function()
    it("writes the Firestore layout: sorted names, shards by 0-based id, exact counts", function()
      local b = db:counter("b", { shards = 2, policy = "random" })
      b:add_shard(1, 3)
      b:add_shard(2, -4)
      db:counter("a", { shards = 1, policy = "key" }):add_shard(1, 7)
      assert.equal('{"counters":{\n'
                   .. '"a":{"num_shards":1,"policy":"key","shards":{"0":{"count":7}}},\n'
                   .. '"b":{"num_shards":2,"policy":"random","shards":{"0":{"count":3},"1":{"count":-4}}}\n'
                   .. "}}\n", db:export())
    end)

    it("writes shards in order of their id", function()
      local c = db:counter("c", { shards = 12 })
      for i = 1, 12 do c:add_shard(i, i) end
      local ids = {}
      for id in db:export():gmatch('"(%d+)":{"count"') do ids[#ids + 1] = tonumber(id) end
      assert.same({ 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11 }, ids)
    end)

    it("takes the counters matching the pattern, and gives an empty document for none", function()
      db:incr("post:1:likes")
      db:incr("post:1:views")
      local d = cjson.decode(db:export("post:*:likes"))
      assert.same({ "post:1:likes" }, (function()
        local t = {}
        for k in pairs(d.counters) do t[#t + 1] = k end
        return t
      end)())
      assert.equal('{"counters":{}}\n', db:export("nothing*"))
      assert.equal('{"counters":{}}\n', tally.open():export())
    end)

    it("writes counts beyond +-(2^53-1) as decimal strings", function()
      local c = db:counter("x", { shards = 6 })
      for i, v in ipairs({ SAFE, -SAFE, SAFE + 1, -SAFE - 1, TOP, BOTTOM }) do c:add_shard(i, v) end
      assert.equal('{"counters":{\n"x":{"num_shards":6,"policy":"thread","shards":{'
                   .. '"0":{"count":9007199254740991},"1":{"count":-9007199254740991},'
                   .. '"2":{"count":"9007199254740992"},"3":{"count":"-9007199254740992"},'
                   .. '"4":{"count":"4611686018427387903"},"5":{"count":"-4611686018427387904"}}}\n}}\n',
                   db:export())
    end)

    it("exports and imports a counter whose sum is beyond int64", function()
      local c = db:counter("huge", { shards = 3 })
      for i = 1, 3 do c:add_shard(i, TOP) end
      local text = db:export()
      assert.matches('"huge":{"num_shards":3', text, 1, true)
      local fresh = tally.open()
      assert.equal(1, fresh:import(text))
      assert.same({ TOP, TOP, TOP }, fresh:counter("huge"):shards())
      assert.equal(1, fresh:import(text))                   -- replace: also when it exists
      assert.same({ TOP, TOP, TOP }, fresh:counter("huge"):shards())
      fresh:close()
    end)

    it("escapes names and stays JSON", function()
      local names = { 'q"uote', "back\\slash", "new\nline", "sp ace,comma", "slash/", "é✓𝄞", "\1" }
      for i, n in ipairs(names) do db:incr(n, i) end
      local d = cjson.decode(db:export())
      for i, n in ipairs(names) do
        assert.equal(1, d.counters[n].num_shards)
        local sum = 0
        for _, s in pairs(d.counters[n].shards) do sum = sum + s.count end
        assert.equal(i, sum)
      end
    end)

    it("writes each byte that is not UTF-8 as \\udcXX (surrogateescape), so the text is JSON", function()
      -- a lone byte, a UTF-8 surrogate, an overlong form, a cut sequence, and
      -- UTF-8 around them, which stays as it is
      local names = { "x\255", "mix\255é\128", "\237\160\128", "\192\128", "\240\159\152", "é✓" }
      for i, n in ipairs(names) do db:incr(n, i) end
      local function line(name, i)
        return fmt('"%s":{"num_shards":1,"policy":"thread","shards":{"0":{"count":%d}}}', name, i)
      end
      local text = db:export()
      assert.equal('{"counters":{\n' .. table.concat({
        line("mix\\udcffé\\udc80", 2), line("x\\udcff", 1), line("\\udcc0\\udc80", 4),
        line("é✓", 6), line("\\udced\\udca0\\udc80", 3), line("\\udcf0\\udc9f\\udc98", 5),
      }, ",\n") .. "\n}}\n", text)
      assert.truthy(utf8.len(text))                     -- JSON text is UTF-8 (RFC 8259)
    end)

    it("raises on bad arguments and a closed store", function()
      assert.equal("bad argument #1 to 'export' (string expected, got number)",
                   err(db.export, db, 1))
      assert.equal("bad argument #1 to 'export' (tally.store expected, got table)",
                   err(db.export, {}))
      db:close()
      assert.equal("attempt to use a closed store", err(db.export, db))
      assert.equal("attempt to use a closed store", err(db.import, db, '{"counters":{}}'))
    end)
  end)

  describe(":import()", function()
    -- a store with counters of several shard counts, policies and names,
    -- shard values spread over the whole range
    local function fill(store)
      math.randomseed(42)
      local specs = {
        { "post:1:likes", 16, "thread" }, { "post:2:likes", 1, "random" },
        { "api:k1", 7, "key" }, { "rr", 3, "round_robin" }, { 'we"ird\\ na\nme', 2, "thread" },
        { "é✓", 1024, "random" }, { "x\255", 5, "thread" },
      }
      for _, s in ipairs(specs) do
        local c = store:counter(s[1], { shards = s[2], policy = s[3] })
        for i = 1, s[2] do
          local r = math.random(6)
          local v = r == 1 and TOP or r == 2 and BOTTOM or r == 3 and SAFE + math.random(0, 3)
                    or r == 4 and -SAFE - math.random(0, 3) or math.random(-1000, 1000)
          c:add_shard(i, v)
        end
      end
      return specs
    end

    it("round-trips exactly, per shard, into a fresh store", function()
      local specs = fill(db)
      local text = db:export()
      local fresh = tally.open()
      assert.equal(#specs, fresh:import(text))
      for _, s in ipairs(specs) do
        assert.same(plain(db:counter(s[1]):info()), plain(fresh:counter(s[1]):info()))
        assert.same(db:counter(s[1]):shards(), fresh:counter(s[1]):shards())
      end
      assert.equal(text, fresh:export())
      fresh:close()
    end)

    it("round-trips names that are not UTF-8, byte for byte, apart from the text \\udcXX", function()
      local names = { "\255", "a\128b", "mix\255é\128", "\237\160\128", "\192\128", "\240\159\152",
                      "a\128", "a\\udc80", "\\udcff", "a\\u0080" }
      for b = 128, 255 do names[#names + 1] = "b" .. string.char(b) end
      for i, n in ipairs(names) do db:counter(n, { shards = 2 }):add_shard(2, i) end
      local text = db:export()
      assert.truthy(utf8.len(text))
      assert.matches('"a\\udc80":', text, 1, true)      -- the byte 0x80
      assert.matches('"a\\\\udc80":', text, 1, true)    -- the text, its backslash escaped
      local fresh = tally.open()
      assert.equal(#names, fresh:import(text))
      assert.same(db:names(), fresh:names())
      for i, n in ipairs(names) do assert.same({ 0, i }, fresh:counter(n, { create = false }):shards()) end
      assert.equal(text, fresh:export())
      fresh:close()
    end)

    it("reads \\udcXX as the byte, as Python's json writes a surrogateescape name", function()
      -- json.dumps({"counters": {b"x\xff".decode("utf-8", "surrogateescape"): ...}}), and
      -- surrogate pairs, which stay characters (U+10080 then the byte 0x80; U+1F44D)
      local one = '{"num_shards":1,"shards":{"0":{"count":1}}}'
      assert.equal(3, db:import('{"counters":{"x\\udcff":' .. one .. ',"\\ud800\\udc80\\uDC80":'
                                .. one .. ',"\\uD83D\\uDC4D":' .. one .. "}}"))
      assert.same({ "x\255", "\240\144\130\128\128", "\240\159\145\141" }, db:names())
      -- keys are told apart by their bytes: \u0041 is A, a\\u0061 the text
      assert.equal(3, db:import('{"counters":{"a":' .. one .. ',"\\u0041":' .. one .. ',"a\\\\u0061":'
                                .. one .. "}}"))
      assert.same({ "A", "a", "a\\u0061", "x\255", "\240\144\130\128\128", "\240\159\145\141" },
                  db:names())
    end)

    it("round-trips through a file store", function()
      fill(db)
      local text = db:export()
      local path = helper.tmpfile()
      local f = assert(tally.open("file:" .. path))
      f:import(text)
      f:close()
      f = assert(tally.open("file:" .. path))
      assert.equal(text, f:export())
      f:close()
    end)

    it("replaces each counter's shards by default, creating counters as needed", function()
      local c = db:counter("a", { shards = 3 })
      c:add_shard(1, 10)
      c:add_shard(3, 5)
      db:incr("untouched", 4)
      assert.equal(2, db:import(doc({ { name = "a", shards = { 1, 2, '"-3"' } },
                                      { name = "new", shards = { 8, 9 }, policy = "random" } })))
      assert.same({ 1, 2, -3 }, c:shards())
      assert.same({ name = "new", shards = 2, policy = "random" }, plain(db:counter("new"):info()))
      assert.same({ 8, 9 }, db:counter("new"):shards())
      assert.equal(4, db:value("untouched"))
      assert.equal(1, db:import(doc({ { name = "a", shards = { 0, 0, 0 } } }), { mode = "replace" }))
      assert.same({ 0, 0, 0 }, c:shards())
    end)

    it("adds to each shard with mode = 'add'", function()
      local c = db:counter("a", { shards = 2 })
      c:add_shard(1, 10)
      assert.equal(2, db:import(doc({ { name = "a", shards = { 1, '"-2"' } },
                                      { name = "b", shards = { 5 } } }), { mode = "add" }))
      assert.same({ 11, -2 }, c:shards())
      assert.same({ 5 }, db:counter("b"):shards())
      db:import(doc({ { name = "a", shards = { 1, 2 } } }), { mode = "add" })
      assert.same({ 12, 0 }, c:shards())
    end)

    it("gives new counters without a policy their family's", function()
      db:family("f:*", { shards = 4, policy = "round_robin" })
      db:import(doc({ { name = "f:1", shards = { 1, 2 } } }))
      assert.same({ name = "f:1", shards = 2, policy = "round_robin" }, plain(db:counter("f:1"):info()))
    end)

    it("refuses a new counter that a family at its cap would send to its overflow counter", function()
      -- two names, one overflow counter: a replace would set it to the last
      -- one's counts and lose the others' (and what it held before)
      db:family("client:*", { max_counters = 1 })
      db:incr("client:a", 1)
      db:incr("client:z", 100)                   -- capped: counted in client:_overflow
      local before = db:export()
      local text = doc({ { name = "client:b", shards = { 7 } }, { name = "client:c", shards = { 11 } } })
      for _, mode in ipairs({ "replace", "add" }) do
        assert.same({ nil, "counter 'client:b' falls under a family at its cap "
                      .. "(max_counters): it would be counted in the family's overflow counter",
                      "EFULL" }, { db:import(text, { mode = mode }) })
        assert.equal(before, db:export())
        assert.same({ 101, 2 }, { db:sum("client:*") })
      end
    end)

    it("imports into a counter with a function policy, but cannot create one", function()
      local c = db:counter("fn", { shards = 2, policy = function() return 2 end })
      local text = db:export()
      assert.matches('"policy":"function"', text, 1, true)
      assert.equal(1, db:import(doc({ { name = "fn", shards = { 4, 5 }, policy = "function" } })))
      assert.same({ 4, 5 }, c:shards())
      local fresh = tally.open()
      assert.equal("import: counter 'fn': policy function cannot be created by an import: "
                   .. "create the counter first with db:counter(name, { shards = 2, policy = fn })",
                   err(fresh.import, fresh, text))
      assert.same({}, fresh:names())
    end)

    it("accepts an empty document, and counts written as integral floats or padded strings", function()
      assert.equal(0, db:import('{"counters":{}}'))
      assert.equal(0, db:import(' { "counters" : [ ] } '))
      db:import('{"counters":{"a":{"num_shards":2.0,"shards":{"1":{"count":"-007"},"0":{"count":1e3}}}}}')
      assert.same({ 1000, -7 }, db:counter("a"):shards())
      db:import('{"counters":{"a":{"num_shards":2,"shards":{"0":{"count":"-0"},"1":{"count":"000"}}}}}')
      assert.same({ 0, 0 }, db:counter("a"):shards())
    end)

    it("undoes what it applied when another process changes the store under it", function()
      -- stand-ins for what only a concurrent writer can cause: a shard add
      -- that fails midway (ERANGE, EDROPPED), a counter that cannot be made
      local c = db:counter("a", { shards = 2 })
      c:add_shard(1, 5)
      db:counter("b", { shards = 1 }):add_shard(1, 7)
      local before = db:export()
      local text = doc({ { name = "a", shards = { 1, 2 } }, { name = "b", shards = { 3 } },
                         { name = "c", shards = { 4, 4 } }, { name = "d", shards = { 9 } } })
      local methods = tally.counter_methods
      local add_shard, calls = methods.add_shard, 0
      methods.add_shard = function(h, i, n)
        calls = calls + 1
        if calls == 5 then return nil, "counter 'c' was dropped", "EDROPPED" end
        return add_shard(h, i, n)
      end
      local ok, r1, r2, r3 = pcall(db.import, db, text)
      methods.add_shard = add_shard
      assert.same({ true, nil, "counter 'c' was dropped", "EDROPPED" }, { ok, r1, r2, r3 })
      assert.equal(before, db:export())
      assert.same({ "a", "b" }, db:names())

      local counter = tally.store_methods.counter
      tally.store_methods.counter = function(store, name, opts)
        if name == "d" then return nil, "no space left on device", "ENOSPC" end
        return counter(store, name, opts)
      end
      ok, r1, r2, r3 = pcall(db.import, db, text)
      tally.store_methods.counter = counter
      assert.same({ true, nil, "no space left on device", "ENOSPC" }, { ok, r1, r2, r3 })
      assert.equal(before, db:export())

      -- another process reshards "b" after the import has validated it
      local shards = methods.shards
      methods.shards = function(h)
        if h:name() == "b" then h:reshard(2) end
        return shards(h)
      end
      ok, r1, r2, r3 = pcall(db.import, db, text)
      methods.shards = shards
      assert.same({ true, nil, "counter 'b' was resharded to 2 shards during the import",
                    "EMISMATCH" }, { ok, r1, r2, r3 })
      assert.same({ 5, 0 }, db:counter("a"):shards())
      assert.same({ "a", "b" }, db:names())
      db:counter("b"):reshard(1)
      assert.equal(before, db:export())
      assert.equal(4, db:import(text))
    end)

    it("undoes what it applied or made before raising what progress raises", function()
      db:counter("b", { shards = 1 }):add_shard(1, 5)
      local before = db:export()   -- "a" is made, then "b" changed
      -- spaces: not export's text, so the whole document's path
      local text = doc({ { name = "a", shards = { 1 } }, { name = "b", shards = { 2 } } })
        :gsub(",", ", ")
      for _, phase in ipairs({ "create", "apply" }) do
        local ok, e = pcall(db.import, db, text, { progress = function(p, done, total)
          if p == phase and done == total then error("stop in " .. phase, 0) end
        end })
        assert.same({ false, "stop in " .. phase }, { ok, e })
        assert.equal(before, db:export())
      end
      assert.equal(2, db:import(text))
      assert.same({ 1, 2 }, { db:value("a"), db:value("b") })
    end)

    it("never drops on undo a counter another writer made during the import", function()
      local src = tally.open()
      for name, v in pairs({ a = 1, b = 7, z = 3 }) do src:counter(name, { shards = 1 }):add_shard(1, v) end
      local streamed = src:export()                      -- export's own text: streamed
      local whole = streamed:gsub(",", ", ")             -- any other: the whole document's path
      for _, case in ipairs({ { streamed, "apply" }, { whole, "validate" } }) do
        db = assert(tally.open())
        db:counter("z", { shards = 1 }):add_shard(1, 3)
        -- once the import has checked which counters exist: another writer
        -- makes "b", and "z" is dropped, which fails the import
        local r = { db:import(case[1], { progress = function(phase, done, total)
          if phase == case[2] and done == (phase == "apply" and 0 or total) then
            assert(db:incr("b", 100))
            assert(db:drop("z"))
          end
        end }) }
        assert.same({ nil, "counter 'z' was dropped", "EDROPPED" }, r)
        assert.same({ "b" }, db:names())                 -- "a" undone, "b" the writer's
        assert.equal(100, db:value("b"))
      end
    end)

    it("refuses a counter another writer made during the import unlike the document", function()
      local src = tally.open()
      for name, v in pairs({ a = 1, b = 7, z = 3 }) do src:counter(name, { shards = 4 }):add_shard(2, v) end
      local streamed = src:export()
      local whole = streamed:gsub(",", ", ")
      for _, case in ipairs({ { streamed, "apply" }, { whole, "validate" } }) do
        for _, opts in ipairs({ { shards = 1 }, { shards = 4, policy = "random" } }) do
          db = assert(tally.open())
          local r = { db:import(case[1], { progress = function(phase, done, total)
            if phase == case[2] and done == (phase == "apply" and 0 or total) then
              assert(db:counter("b", opts)):incr(100)   -- made since the check, unlike "b"
            end
          end }) }
          assert.same({ nil, ("counter 'b' was made during the import with %d shards and policy %s")
                             :format(opts.shards, opts.policy or "thread"), "EMISMATCH" }, r)
          assert.same({ "b" }, db:names())               -- "a" undone, "b" the writer's
          assert.equal(100, db:value("b"))
        end
      end
    end)

    describe("refuses, naming the counter and field, and changes nothing:", function()
      local before
      before_each(function()
        local c = db:counter("a", { shards = 2 })
        c:add_shard(1, 5)
        c:add_shard(2, -6)
        db:counter("z", { shards = 1, policy = "random" }):add_shard(1, TOP)
        before = db:export()
      end)

      local function refuses(msg, text, opts)
        assert.equal(msg, err(db.import, db, text, opts))
        assert.equal(before, db:export())
      end
      -- a valid counter "a" first, so an import that applied as it went would show
      local function with(name, body)
        return '{"counters":{"a":{"num_shards":2,"shards":{"0":{"count":1},"1":{"count":2}}},'
               .. cjson.encode(name) .. ":" .. body .. "}}"
      end

      it("malformed JSON", function()
        for _, text in ipairs({ "", "{", '{"counters":{}} x', '{"counters":{"a":NaN}}',
                                '{"counters":{"a":{"num_shards":0x10}}}', "nul", "[1,]" }) do
          local msg = err(db.import, db, text)
          assert.matches("^import: malformed JSON: ", msg)
          assert.equal(before, db:export())
        end
        -- lua-cjson stops at a NUL: what follows was counted, or crashed the search
        for _, text in ipairs({ '{"counters":{}}\n\0 "note": x', '{"counters":{}}\n\0:"' }) do
          assert.equal("import: malformed JSON: Expected value but found a NUL byte at character 17",
                       err(db.import, db, text))
          assert.equal(before, db:export())
        end
      end)

      it("a name with a NUL, beside the same bytes written as \\udcXX", function()
        -- "\u000080" is NUL, "8", "0"; "\udc80" the byte 0x80: two names, not one
        local one = '{"num_shards":1,"shards":{"0":{"count":1}}}'
        local msg = err(db.import, db, '{"counters":{"\\u000080":' .. one .. ',"\\udc80":' .. one .. "}}")
        assert.matches("^import: counter name '\\x0080", msg)
        assert.equal(before, db:export())
      end)

      it("a document of the wrong shape", function()
        refuses('import: the document must be an object with "counters", got an array', "[1]")
        refuses('import: the document must be an object with "counters", got an empty object', "{}")
        refuses('import: the document must be an object with "counters", got 5', "5")
        refuses("import: unknown top-level field 'version' (expected counters)",
                '{"counters":{},"version":1}')
        refuses('import: "counters" must be an object of counters by name, got an array',
                '{"counters":[1]}')
        refuses('import: "counters" must be an object of counters by name, got null',
                '{"counters":null}')
      end)

      it("wrong types anywhere", function()
        refuses("import: counter 'b': must be an object with num_shards and shards, got 5",
                with("b", "5"))
        refuses("import: counter 'b': num_shards must be an integer from 1 to 1024, got '2'",
                with("b", '{"num_shards":"2","shards":{"0":{"count":1},"1":{"count":1}}}'))
        refuses("import: counter 'b': num_shards must be an integer from 1 to 1024, got 1.5",
                with("b", '{"num_shards":1.5,"shards":{"0":{"count":1}}}'))
        refuses([[import: counter 'b': shards must be an object of shard ids "0" to "0", got an array]],
                with("b", '{"num_shards":1,"shards":[{"count":1}]}'))
        refuses([[import: counter 'b': shards["0"] must be an object with a count, got 5]],
                with("b", '{"num_shards":1,"shards":{"0":5}}'))
        refuses([[import: counter 'b': shards["0"].count must be an integer or a decimal string, got nothing]],
                with("b", '{"num_shards":1,"shards":{"0":{}}}'))
        refuses([[import: counter 'b': shards["0"].count must be an integer or a decimal string, got true]],
                with("b", '{"num_shards":1,"shards":{"0":{"count":true}}}'))
        refuses([[import: counter 'b': shards["0"].count must be an integer or a decimal string, got null]],
                with("b", '{"num_shards":1,"shards":{"0":{"count":null}}}'))
        refuses([[import: counter 'b': shards["0"].count must be an integer, got 1.5]],
                with("b", '{"num_shards":1,"shards":{"0":{"count":1.5}}}'))
        refuses([[import: counter 'b': shards["0"].count must be an integer or a decimal string, got '12abc']],
                with("b", '{"num_shards":1,"shards":{"0":{"count":"12abc"}}}'))
        refuses([[import: counter 'b': shards["0"].count must be an integer or a decimal string, got '0x10']],
                with("b", '{"num_shards":1,"shards":{"0":{"count":"0x10"}}}'))
        refuses([[import: counter 'b': shards["0"] has unknown field 'cnt']],
                with("b", '{"num_shards":1,"shards":{"0":{"count":1,"cnt":1}}}'))
        refuses("import: counter 'b': unknown field 'count' (expected num_shards, shards and policy)",
                with("b", '{"num_shards":1,"count":3,"shards":{"0":{"count":1}}}'))
        refuses("import: counter name '' must be 1 to 255 bytes without NUL",
                with("", '{"num_shards":1,"shards":{"0":{"count":1}}}'))
        refuses("import: counter name 'n\\x00ul' must be 1 to 255 bytes without NUL",
                with("n\0ul", '{"num_shards":1,"shards":{"0":{"count":1}}}'))
        refuses("import: counter name '" .. ("x"):rep(256) .. "' must be 1 to 255 bytes without NUL",
                with(("x"):rep(256), '{"num_shards":1,"shards":{"0":{"count":1}}}'))
        -- a NUL stays one beside bytes written \udcXX (which are read back)
        refuses("import: counter name 'a\\x0080' must be 1 to 255 bytes without NUL",
                '{"counters":{"a\\u000080":{"num_shards":1,"shards":{"0":{"count":1}}},'
                .. '"b\\udc80":{"num_shards":1,"shards":{"0":{"count":1}}}}}')
      end)

      it("a counter or a field given twice, however it is written", function()
        -- lua-cjson keeps the last and drops the others: a value lost without a word
        local one = '{"num_shards":1,"shards":{"0":{"count":1}}}'
        local function counters(...) return '{"counters":{' .. table.concat({ ... }, ",") .. "}}" end
        refuses("import: counter 'a' is given twice",             -- with(): "a" first
                with("a", '{"num_shards":2,"shards":{"0":{"count":7},"1":{"count":8}}}'))
        refuses("import: counter 'a' is given twice",
                with("a", '{"num_shards":2,"shards":{"0":{"count":7},"1":{"count":8}}}'), { mode = "add" })
        refuses("import: counter 'b' is given twice", counters('"b":' .. one, '"\\u0062":' .. one))
        refuses("import: counter 'é' is given twice", counters('"é":' .. one, '"\\u00e9":' .. one))
        refuses("import: counter 'é' is given twice",                 -- its two bytes, each escaped
                counters('"\\udcc3\\udca9":' .. one, '"é":' .. one))
        refuses("import: counter '\\xff' is given twice",
                counters('"\\udcff":' .. one, '"\\uDCFF":' .. one))
        refuses("import: counter 'b' is given twice", counters('"b":5', '"b":' .. one))
        refuses("import: 'counters' is given twice", '{"counters":{},"counters":{"b":' .. one .. "}}")
        refuses("import: counter 'b': num_shards is given twice",
                with("b", '{"num_shards":1,"num_shards":1,"shards":{"0":{"count":1}}}'))
        refuses([[import: counter 'b': shards["0"] is given twice]],
                with("b", '{"num_shards":1,"shards":{"0":{"count":1},"0":{"count":2}}}'))
        refuses([[import: counter 'b': shards["0"] is given twice]],      -- not "2 but 1 shards"
                with("b", '{"num_shards":2,"shards":{"0":{"count":1},"0":{"count":2}}}'))
        refuses([[import: counter 'b': shards["0"].count is given twice]],
                with("b", '{"num_shards":1,"shards":{"0":{"count":1,"count":2}}}'))
        -- the text \udcff is not the byte; a\u0062 (with its backslash) is not ab
        assert.equal(4, db:import(counters('"\\udcff":' .. one, '"\\\\udcff":' .. one,
                                           '"ab":' .. one, '"a\\\\u0062":' .. one)))
      end)

      it("a shard count that does not add up", function()
        refuses("import: counter 'b': num_shards is 3 but 2 shards are given",
                with("b", '{"num_shards":3,"shards":{"0":{"count":1},"1":{"count":1}}}'))
        refuses([[import: counter 'b': shards has id '2' (expected "0" to "1" for num_shards 2)]],
                with("b", '{"num_shards":2,"shards":{"0":{"count":1},"2":{"count":1}}}'))
        refuses([[import: counter 'b': shards has id '01' (expected "0" to "1" for num_shards 2)]],
                with("b", '{"num_shards":2,"shards":{"0":{"count":1},"01":{"count":1}}}'))
        refuses("import: counter 'b': num_shards must be an integer from 1 to 1024, got 0",
                with("b", '{"num_shards":0,"shards":{"0":{"count":1}}}'))
        refuses("import: counter 'b': num_shards must be an integer from 1 to 1024, got 1025",
                with("b", '{"num_shards":1025,"shards":{"0":{"count":1}}}'))
        refuses("import: counter 'z': num_shards is 2 but the counter exists with 1 shards",
                with("z", '{"num_shards":2,"shards":{"0":{"count":1},"1":{"count":1}}}'))
      end)

      it("counts a double cannot carry, or a shard cannot hold", function()
        refuses([[import: counter 'b': shards["0"].count 9007199254740992 is beyond +-(2^53-1), where a JSON number is not exact: write it as a decimal string]],
                with("b", '{"num_shards":1,"shards":{"0":{"count":9007199254740993}}}'))
        refuses([[import: counter 'b': shards["0"].count -9007199254740992 is beyond +-(2^53-1), where a JSON number is not exact: write it as a decimal string]],
                with("b", '{"num_shards":1,"shards":{"0":{"count":-9007199254740992}}}'))
        refuses([[import: counter 'b': shards["0"].count must be an integer, got 1e+300]],
                with("b", '{"num_shards":1,"shards":{"0":{"count":1e300}}}'))
        refuses([[import: counter 'b': shards["0"].count must be a finite integer]],
                with("b", '{"num_shards":1,"shards":{"0":{"count":1e400}}}'))
        refuses([[import: counter 'b': shards["0"].count 4611686018427387904 is out of a shard's range (-2^62 to 2^62-1)]],
                with("b", '{"num_shards":1,"shards":{"0":{"count":"4611686018427387904"}}}'))
        refuses([[import: counter 'b': shards["0"].count -4611686018427387905 is out of a shard's range (-2^62 to 2^62-1)]],
                with("b", '{"num_shards":1,"shards":{"0":{"count":"-4611686018427387905"}}}'))
        refuses([[import: counter 'b': shards["0"].count 9223372036854775808 is out of a shard's range (-2^62 to 2^62-1)]],
                with("b", '{"num_shards":1,"shards":{"0":{"count":"9223372036854775808"}}}'))
        refuses([[import: counter 'b': shards["0"].count -9223372036854775809 is out of a shard's range (-2^62 to 2^62-1)]],
                with("b", '{"num_shards":1,"shards":{"0":{"count":"-9223372036854775809"}}}'))
        refuses([[import: counter 'z': shards["0"].count 1 would take the shard (now 4611686018427387903) out of its range (-2^62 to 2^62-1)]],
                with("z", '{"num_shards":1,"shards":{"0":{"count":1}}}'), { mode = "add" })
      end)

      it("an unknown or mismatched policy", function()
        refuses("import: counter 'b': policy must be thread, random, round_robin, key, slot, cpu or function, got 'fast'",
                with("b", '{"num_shards":1,"policy":"fast","shards":{"0":{"count":1}}}'))
        refuses("import: counter 'b': policy must be thread, random, round_robin, key, slot, cpu or function, got 3",
                with("b", '{"num_shards":1,"policy":3,"shards":{"0":{"count":1}}}'))
        refuses("import: counter 'z': policy is thread but the counter exists with policy random",
                with("z", '{"num_shards":1,"policy":"thread","shards":{"0":{"count":1}}}'))
      end)

      it("bad arguments", function()
        refuses("bad argument #2 to 'import' (mode must be 'replace' or 'add', got 'merge')",
                '{"counters":{}}', { mode = "merge" })
        refuses("bad argument #2 to 'import' (unknown option 'dry_run')",
                '{"counters":{}}', { dry_run = true })
        refuses("bad argument #2 to 'import' (table expected, got string)", '{"counters":{}}', "add")
        refuses("bad argument #1 to 'import' (string expected, got table)", { counters = {} })
        assert.equal("bad argument #1 to 'import' (tally.store expected, got nil)",
                     err(db.import, nil, "{}"))
      end)
    end)
  end)
end)

describe("tally.json", function()
  local json = require "tally.json"

  it("reads a key \\u0000XX and a key \\udcXX of one object as two keys, in either order", function()
    -- unmarked, the first is NUL "XX"; marked, the second was NUL "XX" too
    for x = 0x80, 0xff do
      for _, text in ipairs({ fmt('{"\\u0000%02x":1,"\\udc%02x":2}', x, x),
                              fmt('{"\\udc%02x":2,"\\u0000%02x":1}', x, x) }) do
        local v = assert(json.decode(text))
        assert.equal(2, v[string.char(x)])
        assert.equal(1, v["\0" .. fmt("%02x", x)])
      end
    end
  end)

  describe(".encode()", function()
    it("writes bytes that are not UTF-8 as \\udcXX, in keys and values, as quote does", function()
      local v = { pattern = "bytes:\255*", ["k\xc3"] = { "x\xff", "é" }, ok = "é\n" }
      local text = assert(json.encode(v))
      assert.equal('{"k\\udcc3":["x\\udcff","é"],"ok":"é\\n","pattern":"bytes:\\udcff*"}', text)
      assert.is_truthy(utf8.len(text))
      assert.same(v, json.decode(text))
      for b = 0, 255 do                    -- every byte, alone and after UTF-8
        for _, x in ipairs({ string.char(b), "é" .. string.char(b) .. "z" }) do
          local t = assert(json.encode({ s = x }))
          assert.is_truthy(utf8.len(t), t)
          assert.equal(x, assert(json.decode(t)).s)
        end
      end
    end)

    it("writes integers exactly, NaN and infinities as null, lists as arrays", function()
      assert.equal('{"a":[1,2,3],"big":9223372036854775807,"e":{},"l":[],"nan":null,"r":0.1,'
                   .. '"t":true}', json.encode({ a = { 1, 2, 3 }, big = math.maxinteger, e = {},
                                                 l = json.empty_array, nan = 0 / 0, r = 0.1, t = true }))
      assert.equal('{"1":"a","2":"b","x":1}', json.encode({ "a", "b", x = 1 }))
      assert.equal("null", json.encode(nil))
    end)

    it("answers nil and why for what JSON cannot hold", function()
      local loop = {}
      loop.loop = loop
      assert.same({ nil, "cannot write a function as JSON" }, { json.encode({ f = print }) })
      assert.same({ nil, "cannot write a boolean key as JSON" }, { json.encode({ [true] = 1 }) })
      assert.same({ nil, "key '1' is given twice" }, { json.encode({ [1] = 1, ["1"] = 2, x = 0 }) })
      assert.same({ nil, "tables nested deeper than 64 levels (a cycle?)" }, { json.encode(loop) })
      assert.has_error(function() json.empty_array[1] = 1 end, "tally.json.empty_array is read-only")
    end)
  end)

  it("refuses text with a NUL byte, and twice() answers nil for text decode refuses", function()
    assert.same({ nil, "Expected value but found a NUL byte at character 8" },
                { json.decode('{"a":1}\0{"a":2}') })
    for _, text in ipairs({ '{"a', '{"a":"\\', '{"\\uZZZZ":1}', '{"a":1}\0:"' }) do
      assert.is_nil(json.twice(text))
    end
  end)
end)
