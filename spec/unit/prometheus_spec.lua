-- Metric mappings on families, and tally.prometheus(db [, pattern]).
local helper = require "spec.support.helper"
local tally = require "tally"
local prom = require "tally.prometheus"

-- c:info() less its incarnation (random per creation), which must be there.
local function plain(info)
  assert.matches("^" .. ("%x"):rep(16) .. "$", info.incarnation)
  info.incarnation = nil
  return info
end

local err = helper.err

local DEFAULT = "# HELP tally_value Exact value of a tally counter (the sum of its shards), by counter name.\n"
                .. "# TYPE tally_value gauge\n"
local LIKES = { shards = 16, policy = "thread", metric = "likes_total", labels = { "post" },
                type = "counter", help = "Likes per post" }

-- promtool check metrics on text: its exit code and output, or nil if
-- promtool is not installed.
local function promtool(text)
  local _, code = helper.sh("command -v promtool")
  if code ~= 0 then return nil end
  local path = helper.tmpfile("metrics.txt")
  helper.write(path, text)
  local out, rc = helper.sh("promtool check metrics < " .. helper.q(path))
  os.remove(path)
  return rc, out
end

describe("tally.store", function()
  local db
  before_each(function() db = assert(tally.open()) end)
  after_each(function() db:close() end)

  describe(":family() with metric options", function()
    it("records the mapping and passes shards and policy on", function()
      assert.is_true(db:family("post:*:likes", LIKES))
      assert.same({ name = "post:1:likes", shards = 16, policy = "thread" },
                  plain(db:counter("post:1:likes"):info()))
      assert.is_true(db:family("v:*", { shards = 4, policy = "random", metric = "views" , labels = { "page" } }))
      assert.same({ name = "v:1", shards = 4, policy = "random" }, plain(db:counter("v:1"):info()))
      assert.same({
        { pattern = "post:*:likes", metric = "likes_total", labels = { "post" }, type = "counter",
          help = "Likes per post" },
        { pattern = "v:*", metric = "views", labels = { "page" }, type = "gauge" },
      }, db:mappings())
    end)

    it("with metric options only, leaves the shard options of families alone", function()
      db:family("post:*", { shards = 2, policy = "random" })
      assert.is_true(db:family("post:*:likes", { metric = "likes_total", labels = { "post" },
                                                  type = "counter" }))
      assert.same({ name = "post:1:likes", shards = 2, policy = "random" },
                  plain(db:counter("post:1:likes"):info()))
      db:family("x:*", { metric = "x" , labels = { "id" } })
      assert.same({ name = "x:1", shards = 1, policy = "thread", auto = true, grown = 0, shrunk = 0 }, plain(db:counter("x:1"):info()))
    end)

    it("without metric options, leaves the mapping alone", function()
      db:family("post:*:likes", LIKES)
      db:family("post:*:likes", { shards = 3 })
      assert.equal(3, db:counter("post:1:likes"):info().shards)
      assert.equal(1, #db:mappings())
    end)

    it("replaces the mapping of a pattern defined again, which becomes the newest", function()
      db:family("p:*", { metric = "a", labels = { "x" } })
      db:family("p:1*", { metric = "b", labels = { "y" } })
      db:incr("p:12")
      assert.equal('# TYPE b gauge\nb{y="2"} 1\n', tally.prometheus(db))
      db:family("p:*", { metric = "c", labels = { "z" } })
      assert.equal('# TYPE c gauge\nc{z="12"} 1\n', tally.prometheus(db))
      assert.same({ "p:1*", "p:*" }, { db:mappings()[1].pattern, db:mappings()[2].pattern })
    end)

    it("is kept per store handle, in this process", function()
      local path = helper.tmpfile()
      local a = assert(tally.open("file:" .. path))
      local b = assert(tally.open("file:" .. path))
      a:family("post:*:likes", LIKES)
      a:family("n:*", { shards = 3, metric = "n", labels = { "id" } })
      b:incr("post:1:likes", 2)
      assert.equal(3, b:counter("n:1"):info().shards)          -- the shard options are in the file
      assert.same({}, b:mappings())
      assert.equal(DEFAULT .. 'tally_value{counter="n:1"} 0\ntally_value{counter="post:1:likes"} 2\n',
                   tally.prometheus(b))
      assert.equal('# HELP likes_total Likes per post\n# TYPE likes_total counter\nlikes_total{post="1"} 2\n'
                   .. '# TYPE n gauge\nn{id="1"} 0\n', tally.prometheus(a))
      a:close(); b:close()
    end)

    it("gives copies from db:mappings()", function()
      db:family("a:*", { metric = "a", labels = { "x" } })
      local m = db:mappings()
      m[1].labels[1] = "changed"
      m[1].metric = "changed"
      assert.same({ { pattern = "a:*", metric = "a", labels = { "x" }, type = "gauge" } }, db:mappings())
    end)

    it("raises on bad metric options, and records nothing", function()
      local function bad(opts) return err(function() db:family("post:*:likes", opts) end) end
      assert.equal("bad argument #2 to 'family' (metric must be a Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*), got 'likes-total')",
                   bad({ shards = 2, metric = "likes-total", labels = { "post" } }))
      assert.equal("bad argument #2 to 'family' (metric must be a Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*), got '9lives')",
                   bad({ metric = "9lives", labels = { "post" } }))
      assert.equal("bad argument #2 to 'family' (metric must be a Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*), got 12)",
                   bad({ metric = 12, labels = { "post" } }))
      assert.equal("bad argument #2 to 'family' (labels, type and help need a metric)",
                   bad({ labels = { "post" } }))
      assert.equal("bad argument #2 to 'family' (labels[1] must be a Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*, not starting with __), got 'post id')",
                   bad({ metric = "m", labels = { "post id" } }))
      assert.equal("bad argument #2 to 'family' (labels[1] must be a Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*, not starting with __), got '__name__')",
                   bad({ metric = "m", labels = { "__name__" } }))
      assert.equal("bad argument #2 to 'family' (labels must name the 1 wildcard of 'post:*:likes' in order, got 0 names)",
                   bad({ metric = "m" }))
      assert.equal("bad argument #2 to 'family' (labels must name the 1 wildcard of 'post:*:likes' in order, got 2 names)",
                   bad({ metric = "m", labels = { "a", "b" } }))
      assert.equal("bad argument #2 to 'family' (labels has 'a' twice)",
                   err(function() db:family("*:*", { metric = "m", labels = { "a", "a" } }) end))
      assert.equal("bad argument #2 to 'family' (labels must be a table of label names, got 'post')",
                   bad({ metric = "m", labels = "post" }))
      assert.equal("bad argument #2 to 'family' (type must be 'counter', 'gauge', 'untyped' or 'histogram', got 'summary')",
                   bad({ metric = "m", labels = { "post" }, type = "summary" }))
      assert.equal("bad argument #2 to 'family' (help must be a UTF-8 string, got 5)",
                   bad({ metric = "m", labels = { "post" }, help = 5 }))
      assert.equal("bad argument #2 to 'family' (metric 'tally_value' is reserved for counters without a mapping)",
                   bad({ metric = "tally_value", labels = { "post" } }))
      -- the C side still checks shards and policy, and nothing is recorded
      assert.equal("bad argument #2 to 'family' (shards must be an integer from 1 to 1024 or \"auto\", got 0)",
                   bad({ shards = 0, metric = "m", labels = { "post" } }))
      assert.equal("bad argument #2 to 'family' (unknown option 'every')",
                   bad({ every = 1, metric = "m", labels = { "post" } }))
      assert.equal("bad argument #1 to 'family' (pattern must be 1 to 255 bytes, got 0)",
                   err(function() db:family("", { metric = "m" }) end))
      assert.same({}, db:mappings())
      assert.equal(1, db:counter("post:1:likes"):info().shards)
    end)

    it("refuses a second type for one metric", function()
      db:family("a:*", { metric = "m", labels = { "id" }, type = "counter" })
      assert.equal("bad argument #2 to 'family' (metric 'm' is a counter (family 'a:*'), not a gauge)",
                   err(function() db:family("b:*", { metric = "m", labels = { "id" } }) end))
      db:family("a:*", { metric = "m", labels = { "id" }, type = "gauge" })   -- redefining is fine
      assert.equal(1, #db:mappings())
    end)

    it("raises on a closed store", function()
      db:close()
      assert.equal("attempt to use a closed store",
                   err(function() db:family("a:*", { metric = "m", labels = { "id" } }) end))
      assert.equal("attempt to use a closed store", err(tally.prometheus, db))
    end)
  end)
end)

describe("tally.prometheus()", function()
  local db
  before_each(function() db = assert(tally.open()) end)
  after_each(function() db:close() end)

  it("exposes every counter's exact value, by the family mapping or the default", function()
    db:family("post:*:likes", LIKES)
    db:incr("post:123:likes", 5)
    db:incr("post:9:likes", 2)
    db:incr("page:views", 7)
    assert.equal("# HELP likes_total Likes per post\n# TYPE likes_total counter\n"
                 .. 'likes_total{post="123"} 5\nlikes_total{post="9"} 2\n'
                 .. DEFAULT .. 'tally_value{counter="page:views"} 7\n', tally.prometheus(db))
    assert.equal("", tally.prometheus(tally.open()))
  end)

  it("maps a store's counters in C exactly as the Lua renderer does", function()
    -- random families (one '*' or several, '?', metrics shared by two)
    -- over random names (escapes, non-UTF-8, ambiguous, duplicate series,
    -- sums beyond int64): the scrape mapped in C (rows:map), whole and in
    -- chunks, against the names handed to the renderer (_lua_lines_only)
    local bits = { "a", "b", ":", "ab", "\u{e9}", '"', "\\", "\n", "" }
    local r, word = helper.random_words(7, bits)
    local saved, chunk = prom.logger(function() end), prom._chunk
    local kinds = {}
    for case = 1, 120 do
      local s = assert(tally.open())
      local patterns = {}
      for m = 1, r(3) do
        local pieces, nwild = { word(2) }, 0
        for _ = 1, r(3) do
          pieces[#pieces + 1] = (r(5) == 1 and "?" or "*") .. word(2)
          nwild = nwild + 1
        end
        local pattern = table.concat(pieces)
        local labels = {}
        for j = 1, nwild do labels[j] = "l" .. j end
        if pcall(s.family, s, pattern, { labels = labels,
                 metric = (r(4) == 1 and m > 1) and "m1" or "m" .. m }) then
          patterns[#patterns + 1] = pattern
        end
      end
      for _ = 1, 40 do
        local name
        if r(3) == 1 or #patterns == 0 then
          name = word(6) .. (r(4) == 1 and "\255" or "")
        else
          name = patterns[r(#patterns)]:gsub("[*?]", function(w)
            return w == "?" and bits[r(3)] or word(3)
          end)
        end
        if name ~= "" and #name < 200 then
          if r(12) == 1 then
            local ok, c = pcall(s.counter, s, name, { shards = 3 })
            if ok and c then for i = 1, 3 do pcall(c.add_shard, c, i, (1 << 62) - 1) end end
          else
            s:incr(name, r(2000) - 1000)
          end
        end
      end
      for _, e in ipairs(prom.mapping_of(s).entries) do
        local k = e.simple and "simple" or e.split and "split" or "general"
        kinds[k] = (kinds[k] or 0) + 1
      end
      local fast = tally.prometheus(s)
      prom._chunk = 3
      local pieces = {}
      assert(tally.prometheus(s, nil, { pause = function() end,
                                        write = function(p) pieces[#pieces + 1] = p end }))
      prom._chunk = chunk
      prom._lua_lines_only = true
      local ok, slow = pcall(tally.prometheus, s)
      prom._lua_lines_only = nil
      s:close()
      assert(ok, slow)
      assert.equal(slow, fast, "case " .. case)
      assert.equal(slow, table.concat(pieces), "case " .. case)
    end
    prom.logger(saved)
    assert.is_true(kinds.simple > 20 and kinds.split > 20 and kinds.general > 20)
  end)

  it("logs what a mapped scrape leaves out outside C, so a logger may yield", function()
    db:family("r**", { metric = "m3", labels = { "x", "y" } })   -- 'rab': two ways
    db:incr("rab", 1)
    local got = {}
    local saved = prom.logger(function(m) coroutine.yield("log"); got[#got + 1] = m end)
    local co = coroutine.wrap(function() return "done", tally.prometheus(db) end)
    local r, text = co()
    while r == "log" do r, text = co() end
    prom.logger(saved)
    assert.equal("done", r)
    assert.matches('tally_prometheus_skipped{reason="ambiguous"} 1', text, 1, true)
    assert.equal(1, #got)
    assert.matches("counter 'rab' matches 'r**' in more than one way", got[1], 1, true)
  end)

  it("refuses rows mapped by a mapping that failed", function()
    local core = require "tally.core"
    db:incr("a", 1)
    local rows = assert(core._prom_rows(db))
    repeat until rows:collect(100000)
    assert.matches("unknown kind 'bogus'", err(rows.mapping, rows, { { kind = "bogus" } }))
    assert.matches("pieces%[2%] is not a string",
                   err(rows.mapping, rows, { { kind = "split", pieces = { "a", 1, "b" },
                                               prefixes = { '{x="', ',y="' }, metric = "m" } }))
    assert.matches("before a rows:mapping that succeeded",
                   err(rows.map, rows, 10, function() return true end))
    rows:mapping({ { kind = "general", pattern = "b*" } })
    assert.is_false(rows:map(10, function() return true end))
    assert.same({ tally_value = 'tally_value{counter="a"} 1\n' }, rows:mapped())
    rows:close()
  end)

  it("takes only the counters matching the pattern", function()
    db:family("post:*:likes", LIKES)
    db:incr("post:1:likes", 1)
    db:incr("post:1:views", 2)
    db:incr("other", 3)
    assert.equal("# HELP likes_total Likes per post\n# TYPE likes_total counter\n"
                 .. 'likes_total{post="1"} 1\n' .. DEFAULT .. 'tally_value{counter="post:1:views"} 2\n',
                 tally.prometheus(db, "post:*"))
    assert.equal("", tally.prometheus(db, "nothing*"))
  end)

  it("writes values near the shard range exactly", function()
    local c = db:counter("big", { shards = 2 })
    c:add_shard(1, (1 << 62) - 1)
    c:add_shard(2, (1 << 62) - 1)
    local d = db:counter("small", { shards = 2 })
    d:add_shard(1, -(1 << 62))
    d:add_shard(2, -(1 << 62))
    assert.equal(DEFAULT .. 'tally_value{counter="big"} 9223372036854775806\n'
                 .. 'tally_value{counter="small"} -9223372036854775808\n', tally.prometheus(db))
  end)

  it("writes a value beyond int64 (shards summing past it) as a float", function()
    local c = db:counter("huge", { shards = 3 })
    for i = 1, 3 do c:add_shard(i, (1 << 62) - 1) end
    assert.is_nil((db:value("huge")))
    local v = tally.prometheus(db):match('tally_value{counter="huge"} (%S+)\n')
    assert.equal(3 * 2.0^62, tonumber(v))
  end)

  it("escapes names, and two names never share a series", function()
    local names = { 'q"uote', "back\\slash", "new\nline", "sp ace", "com,ma", "a:b", "a_b",
                    "é✓", "x\255", "1st" }
    for i, n in ipairs(names) do db:incr(n, i) end
    local text = tally.prometheus(db)
    local count = 0
    for _ in text:gmatch("\ntally_value{") do count = count + 1 end
    assert.equal(#names, count)
    assert.matches('tally_value{counter="q\\"uote"} 1\n', text, 1, true)
    assert.matches('tally_value{counter="back\\\\slash"} 2\n', text, 1, true)
    assert.matches('tally_value{counter="new\\nline"} 3\n', text, 1, true)
    assert.matches('tally_value{counter_hex="78ff"} 9\n', text, 1, true)
  end)

  it("matches patterns as db:names() does, and captures each wildcard's part", function()
    -- random patterns and names over a small alphabet, checked against the C matcher
    math.randomseed(7)
    local alpha = { "a", "b", ":", "*", "?" }
    local function rnd(n, chars)
      local t = {}
      for i = 1, n do t[i] = chars[math.random(#chars)] end
      return table.concat(t)
    end
    for _ = 1, 40 do
      local store = tally.open()
      local names = {}
      for i = 1, 30 do
        local n = rnd(math.random(1, 7), { "a", "b", ":" })
        names[n] = true
        store:incr(n)
      end
      for _ = 1, 10 do
        local pattern = rnd(math.random(1, 6), alpha)
        local want = {}
        for _, n in ipairs(store:names(pattern)) do want[n] = true end
        local g = prom._glob_compile(pattern)
        for n in pairs(names) do
          local caps = prom._glob_captures(g, n)
          assert.equal(want[n] or false, caps ~= nil, pattern .. " vs " .. n)
          if caps then
            -- putting the parts back into the pattern gives the name
            local i = 0
            local back = pattern:gsub("[*?]", function() i = i + 1; return caps[i] end)
            assert.equal(n, back)
            assert.equal(g.nwild, #caps)
            -- ambiguous exactly when the name matches in more than one way
            local function ways(p, pi, ni)
              if pi > #p then return ni > #n and 1 or 0 end
              local ch = p:sub(pi, pi)
              if ch == "*" then
                local w = 0
                for j = ni, #n + 1 do w = w + ways(p, pi + 1, j) end
                return w
              end
              if ni > #n or (ch ~= "?" and ch ~= n:sub(ni, ni)) then return 0 end
              return ways(p, pi + 1, ni + 1)
            end
            assert.equal(ways(pattern, 1, 1) > 1, prom._glob_ambiguous(g, n), pattern .. " vs " .. n)
          end
        end
      end
      store:close()
    end
  end)

  describe("never fails the scrape for a bad counter", function()
    local logged, capture, restore = helper.logger_capture()
    before_each(capture)
    after_each(restore)

    local SKIPPED = "# HELP tally_prometheus_skipped Counters left out of this exposition, by "
      .. "reason: ambiguous (a name that matches its family pattern in more than one way), "
      .. "duplicate (two or more counters map to one series), unreadable (its value could not "
      .. "be read).\n# TYPE tally_prometheus_skipped gauge\n"

    it("leaves out counters that map to one series, counts them and logs them once", function()
      db:family("post:*:likes", LIKES)
      db:family("article:*:likes", { metric = "likes_total", labels = { "post" }, type = "counter" })
      db:incr("post:1:likes")
      db:incr("article:2:likes", 2)
      local clean = tally.prometheus(db)
      assert.not_matches("tally_prometheus_skipped", clean, 1, true)
      db:incr("article:1:likes", 3)
      db:incr("post:3:likes", 4)
      for _ = 1, 3 do
        local text = tally.prometheus(db)
        assert.equal("# HELP likes_total Likes per post\n# TYPE likes_total counter\n"
                     .. 'likes_total{post="2"} 2\nlikes_total{post="3"} 4\n'
                     .. SKIPPED .. 'tally_prometheus_skipped{reason="duplicate"} 2\n', text)
      end
      assert.same({ 'prometheus: left out of the exposition (counted in tally_prometheus_skipped'
                    .. '{reason="duplicate"}): counters \'article:1:likes\' and \'post:1:likes\' both '
                    .. 'map to the series likes_total{post="1"}' }, logged)
      local rc, out = promtool(tally.prometheus(db))
      if rc == nil then pending("promtool is not installed (Debian package prometheus)") end
      assert.equal(0, rc, out)
    end)

    it("leaves out a name that matches its family pattern in more than one way", function()
      db:family("resp:*:*", { metric = "resp_total", labels = { "route", "status" }, type = "counter",
                              help = "Responses" })
      db:incr("resp:a:200", 1)
      db:incr("resp:a:b:200", 2)          -- route "a:b" and status "200", or "a" and "b:200"?
      db:incr("resp:x::500", 3)
      db:incr("resp:/v1/x:404", 4)
      local text = tally.prometheus(db)
      assert.equal("# HELP resp_total Responses\n# TYPE resp_total counter\n"
                   .. 'resp_total{route="/v1/x",status="404"} 4\n'
                   .. 'resp_total{route="a",status="200"} 1\n'
                   .. SKIPPED .. 'tally_prometheus_skipped{reason="ambiguous"} 2\n', text)
      assert.equal(2, #logged)
      assert.matches("counter 'resp:a:b:200' matches 'resp:*:*' in more than one way", logged[1], 1, true)
      tally.prometheus(db)
      assert.equal(2, #logged)            -- once
      local rc, out = promtool(text)
      if rc == nil then pending("promtool is not installed (Debian package prometheus)") end
      assert.equal(0, rc, out)
    end)

    it("leaves out a counter whose value cannot be read", function()
      -- c:35's cell damaged in the file (as a bad copy leaves it): its
      -- read fails, the names still list it
      local path = helper.tmpfile("damaged.tly")
      local fdb = assert(tally.open("file:" .. path))
      local MARK = 0x123456789AB
      for i = 31, 39 do fdb:incr("c:" .. i, i == 35 and MARK or i) end
      fdb:close()
      local data = assert(helper.slurp(path))
      local at = assert(data:find(string.pack("<i8", MARK), 1, true))
      helper.write(path, data:sub(1, at - 1) .. string.pack("<i8", math.mininteger)
                         .. data:sub(at + 8))
      fdb = assert(tally.open("file:" .. path))
      local ok, text = pcall(tally.prometheus, fdb, "c:3?")
      fdb:close()
      assert(ok, text)
      local want = {}
      for i = 31, 39 do
        if i ~= 35 then want[#want + 1] = 'tally_value{counter="c:' .. i .. '"} ' .. i .. "\n" end
      end
      assert.equal(DEFAULT .. table.concat(want)
                   .. SKIPPED .. 'tally_prometheus_skipped{reason="unreadable"} 1\n', text)
      assert.equal(1, #logged)
      assert.matches('prometheus: left out of the exposition (counted in tally_prometheus_skipped'
                     .. '{reason="unreadable"}): counter \'c:35\': ' .. path
                     .. ": tally store is corrupt (counter 'c:35' shard 0 holds", logged[1], 1, true)
    end)

    it("refuses the self-metric's name for a family, and a logger that is not a function", function()
      assert.equal("bad argument #2 to 'family' (metric 'tally_prometheus_skipped' is reserved for "
                   .. "the counters a scrape leaves out)",
                   err(db.family, db, "x:*", { metric = "tally_prometheus_skipped", labels = { "x" } }))
      assert.equal("bad argument #1 to 'logger' (function or false expected, got number)",
                   err(tally.logger, 5))
    end)
  end)

  it("raises on bad arguments", function()
    assert.equal("bad argument #1 to 'prometheus' (tally.store expected, got nil)",
                 err(tally.prometheus))
    assert.equal("bad argument #1 to 'prometheus' (tally.store expected, got tally.counter)",
                 err(tally.prometheus, db:counter("x")))
    assert.equal("bad argument #2 to 'prometheus' (string expected, got number)",
                 err(tally.prometheus, db, 5))
    assert.equal("bad argument #3 to 'prometheus' (options table expected, got function)",
                 err(tally.prometheus, db, nil, print))
    assert.equal("bad argument #3 to 'prometheus' (unknown option yield; expected pause or write)",
                 err(tally.prometheus, db, nil, { yield = print }))
    assert.equal("bad argument #3 to 'prometheus' (pause must be a function, got number)",
                 err(tally.prometheus, db, nil, { pause = 1 }))
  end)

  it("calls pause between chunks of counters, and writes the same text", function()
    db:family("post:*:likes", LIKES)                                   -- one '*': C lines
    db:family("api:*:*:calls", { metric = "api_calls_total", labels = { "key", "method" } })
    db:family("temp:?", { metric = "temperature_celsius", labels = { "room" } })  -- Lua lines
    db:family("lat:*", { histogram = true, metric = "lat_seconds", labels = { "route" } })
    for i = 1, 23 do
      db:incr("post:" .. i .. ":likes", i)
      db:incr("api:k" .. i .. ":GET:calls", 2 * i)
      db:incr("plain:" .. i, -i)
      db:incr("x" .. i .. "\255", i)                  -- not UTF-8: the hex label
    end
    for _, r in ipairs({ "A", "B", "C" }) do db:incr("temp:" .. r, 5) end
    for i = 1, 4 do assert(db:histogram("lat:/" .. i)):observe(i / 10) end
    local whole = tally.prometheus(db)
    local chunk, pauses = prom._chunk, 0
    prom._chunk = 7
    local ok, text = pcall(tally.prometheus, db, nil, { pause = function() pauses = pauses + 1 end })
    local plain_ok, plain = pcall(tally.prometheus, db)
    prom._chunk = chunk
    assert(ok, text)
    assert(plain_ok, plain)
    assert.equal(whole, text)
    assert.equal(whole, plain)
    -- 95 counters (the histograms' 52 members apart) read and mapped in
    -- chunks of 7: 13 pauses (the index's slots, fewer than a slice: none)
    assert.equal(13, pauses)
    -- what pause raises fails the scrape
    prom._chunk = 7
    local ok2, e = pcall(tally.prometheus, db, nil, { pause = function() error("stop here") end })
    prom._chunk = chunk
    assert.is_false(ok2)
    assert.matches("stop here", e, 1, true)
  end)

  it("writes a scrape of 100,000 counters piece by piece, the same text as the whole", function()
    -- the default metric's lines come from C, chunk by chunk; families
    -- of each kind go through the renderer
    local N = 100000
    for i = 1, N do db:incr("post:" .. i .. ":likes", i % 1000 - 500) end
    for i = 1, 50 do
      db:incr("odd{" .. i .. "}", i)                                   -- ends in '}', no histogram
      db:incr("x" .. i .. "\255\n\"", i)                             -- hex label, escapes
    end
    db:family("lat:*", { histogram = true, metric = "lat_seconds", labels = { "route" } })
    for i = 1, 3 do assert(db:histogram("lat:/" .. i)):observe(i / 10) end
    local function scrape(chunk, pause)
      local pieces, old, slice = {}, prom._chunk, prom._slice
      prom._chunk, prom._slice = chunk or old, 4096        -- a slice of the index: 4,096 slots
      local pauses = 0
      local ok, r = pcall(tally.prometheus, db, nil, {
        write = function(p) pieces[#pieces + 1] = p end,
        pause = pause and function() pauses = pauses + 1 end })
      prom._chunk, prom._slice = old, slice
      assert(ok, r)
      assert.equal(true, r)
      return pieces, pauses
    end
    local whole = tally.prometheus(db)
    local pieces = scrape(7919)
    assert.equal(whole, table.concat(pieces))
    assert.truthy(#pieces >= N / 7919, #pieces)
    -- read a slice of the index at a time (a host that pauses): sorted runs, merged
    local sliced, pauses = scrape(7919, true)
    assert.equal(whole, table.concat(sliced))
    assert.truthy(pauses >= 2 * N / 4096, pauses)
    -- chunks of 7,919 lines joined into pieces of 64 KiB, the last one shorter
    for i, p in ipairs(pieces) do
      if i < #pieces then assert.equal(65536, #p) else assert.truthy(#p <= 65536 and #p > 0) end
    end
    -- every counter once, in name order, at its value
    local values, names, n = db:values(), {}, 0
    for line in whole:gmatch('tally_value{counter="post:[^\n]*') do
      n = n + 1
      local name, v = line:match('^tally_value{counter="(post:%d+:likes)"} (%-?%d+)$')
      names[n] = name
      assert.equal(values[name], tonumber(v), line)
    end
    assert.equal(N, n)
    local sorted = { table.unpack(names) }
    table.sort(sorted)
    assert.same(sorted, names)
    -- with a family of each kind: the renderer's text, streamed the same
    db:family("post:*:likes", LIKES)
    db:family("x*\255?\"", { metric = "x_total", labels = { "id", "q" },
                                   type = "counter", help = "x" })
    whole = tally.prometheus(db)
    assert.equal(whole, table.concat((scrape(1000))))
    assert.equal(N, select(2, whole:gsub("\nlikes_total{post=", "")))
    local rc, out = promtool(whole)
    if rc ~= nil then
      assert.equal("", out)
      assert.equal(0, rc)
    end
  end)

  it("merges runs of names that tie on the bytes after what they share", function()
    -- the merge compares 8 bytes after the prefix every name shares, and
    -- the rest of a name only on a tie: names that tie there, end there,
    -- or begin one another, in many small runs
    local rng, names, seen = 7, {}, {}
    local function rand(k) rng = (rng * 69069 + 1) % 4294967296; return math.floor(rng / 65536) % k end
    for _ = 1, 3000 do
      local tail = {}
      for j = 1, rand(14) do tail[j] = rand(2) == 0 and "a" or "b" end
      local name = "k:" .. ("ab"):sub(1 + rand(2), 1 + rand(2)) .. "aaaaaaa" .. table.concat(tail)
      if not seen[name] then seen[name] = true; names[#names + 1] = name end
    end
    for _, name in ipairs({ "z", "k:", "k:a", "k:aaaaaaaa", "k:aaaaaaaaa" }) do
      if not seen[name] then seen[name] = true; names[#names + 1] = name end
    end
    for i, name in ipairs(names) do db:incr(name, i) end
    table.sort(names)
    for _, pattern in ipairs({ "*", "k:a*" }) do    -- nothing shared; "k:a" shared
      local slice = prom._slice
      prom._slice = 64
      local ok, text = pcall(tally.prometheus, db, pattern, { pause = function() end })
      prom._slice = slice
      assert(ok, text)
      local got = {}
      for name, v in text:gmatch('tally_value{counter="([^"]*)"} (%d+)') do
        got[#got + 1] = name
        assert.equal(db:value(name), tonumber(v))
      end
      local want = {}
      for _, name in ipairs(names) do
        if pattern == "*" or name:sub(1, 3) == "k:a" then want[#want + 1] = name end
      end
      assert.is_true(#want > 1000)
      assert.same(want, got)
    end
  end)

  it("keeps each chunk it handed out while it writes the next, and refuses closed rows", function()
    local core = require "tally.core"
    for i = 1, 3000 do db:incr(("n%05d"):format(i), i) end
    local rows = assert(core._prom_rows(db))
    local slices, done = 0, false
    repeat
      done = rows:collect(64)
      assert.is_not_nil(done)
      slices = slices + 1
    until done
    assert.is_true(slices > 1)                       -- runs, merged as they are written
    local a = rows:lines(1000)             -- written in memory the rows keep
    local b, more = rows:lines(1000)
    assert.is_true(more)
    assert.equal(1002, select(2, a:gsub("\n", "")))      -- the HELP and TYPE lines first
    assert.matches('^# HELP tally_value [^\n]*\n# TYPE tally_value gauge\ntally_value{counter="n00001"} 1\n', a)
    assert.matches('\ntally_value{counter="n01000"} 1000\n$', a)
    assert.matches('^tally_value{counter="n01001"} 1001\n', b)
    local c, last = rows:lines(5000)
    assert.is_false(last)
    assert.matches('\ntally_value{counter="n03000"} 3000\n$', c)
    assert.same({ "", false }, { rows:lines(1) })       -- done: nothing more
    rows:close()
    assert.equal("the scrape's rows are closed", err(rows.lines, rows, 1))
    assert.equal("the scrape's rows are closed", err(rows.count, rows))
    rows:close()                                           -- again: nothing
  end)

  it("gives text that promtool check metrics accepts", function()
    db:family("post:*:likes", LIKES)
    db:family("api:*:*:calls", { metric = "api_calls_total", labels = { "key", "method" },
                                 type = "counter", help = "API calls by key and method\nwith \\ and \"" })
    db:family("temp:?", { metric = "temperature_celsius", labels = { "room" }, help = "Temperature" })
    db:incr("post:123:likes", 5)
    db:incr("post:é✓:likes", 2)
    db:incr("api:k1:GET:calls", (1 << 62) - 1)
    db:incr("api:k\"2\\:POST:calls", 3)
    db:incr("temp:A", -4)
    for _, n in ipairs({ 'q"uote', "back\\slash", "new\nline", "sp ace,comma=eq", "x\255", "a:b", "a_b" }) do
      db:incr(n, -(1 << 62))
    end
    local text = tally.prometheus(db)
    local rc, out = promtool(text)
    if rc == nil then
      pending("promtool is not installed (Debian package prometheus): exposition not checked by it")
    end
    assert.equal("", out)
    assert.equal(0, rc)
    -- and its lint speaks up where it should: a counter without _total, no help
    db:family("b:*", { metric = "bytes", labels = { "id" }, type = "counter" })
    db:incr("b:1")
    rc, out = promtool(tally.prometheus(db, "b:*"))
    assert.equal(3, rc)
    assert.matches('counter metrics should have "_total" suffix', out, 1, true)
    assert.matches("no help text", out, 1, true)
  end)
end)
