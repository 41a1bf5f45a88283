-- db:export and db:import of 50,000 counters, streamed: export writes as
-- it walks (write(chunk)), import checks a document as export writes it a
-- piece at a time and applies it from a temporary file, holding neither
-- the document nor a table per counter. The text is the same bytes as the
-- Lua path of any store (export_any), the copy is exact, a bad document
-- changes nothing, and an import killed midway (a real process, SIGKILL)
-- leaves what it had applied, as docs/command.md says.
local helper = require "spec.support.helper"
local tally = require "tally"
local core = require "tally.core"
local export = require "tally.export"

local q, fmt = helper.q, string.format
local N = 50000
local TOP, BOTTOM, SAFE = (1 << 62) - 1, -(1 << 62), (1 << 53) - 1

-- Counter i of N: several shard counts and policies; names with bytes
-- that are not UTF-8, quotes, UTF-8; counts over the whole range (strings
-- past +-(2^53-1)); two slot counters and two cpu counters.
local POLICIES = { "thread", "random", "round_robin", "key" }
local function spec_of(i)
  local name = i % 97 == 0 and fmt("x\255%d", i) or i % 89 == 0 and fmt('q"\\%d', i)
               or i % 83 == 0 and fmt("é✓%d", i) or fmt("post:%d:likes", i)
  return name, i % 10 == 0 and 4 or i % 1001 == 0 and 64 or 1, POLICIES[i % 4 + 1]
end
local function fill(db, n, seed, small)
  for i = 1, n do
    local name, shards, policy = spec_of(i)
    local c = db:counter(name, { shards = shards, policy = policy })
    for s = 1, shards do
      local r = small and 50 or (i * 7919 + s * seed) % 50
      c:add_shard(s, r == 0 and TOP or r == 1 and BOTTOM or r == 2 and SAFE + 1
                     or r == 3 and -SAFE - 2 or (i * 31 + s * seed) % 100003 - 500)
    end
  end
  for i = 1, 2 do
    db:counter("slot:" .. i, { policy = "slot" }):incr(i * seed)
    db:counter("cpu:" .. i, { policy = "cpu" }):incr(i * seed)
  end
end

-- An export's text with each cpu counter's shards replaced by their sum:
-- an import adds a cpu counter's total through one increment, which
-- lands in the cell of whichever CPU the importer is on.
local function cpu_summed(text)
  return (text:gsub('("cpu:%d+"):(%b{})', function(name, body)
    local sum = 0
    for count in body:gmatch('"count":(%-?%d+)') do sum = sum + tonumber(count) end
    return name .. ":" .. sum
  end))
end

-- db:import(doc) while name is dropped and made again with opts once
-- every piece is checked, before any is applied.
local function import_remaking(db, doc, name, opts)
  return db:import(doc, { progress = function(phase, done, total)
    if phase == "read" and done == total then
      db:drop(name)
      db:counter(name, opts):incr(1)
    end
  end })
end

-- The most Lua memory held (KiB: in use after a full collection) seen by
-- probe() while fn runs, above what was held before it.
local function peak(fn)
  collectgarbage()
  collectgarbage()
  local base, top = collectgarbage("count"), 0
  local function probe()
    collectgarbage()
    local m = collectgarbage("count") - base
    if m > top then top = m end
  end
  local r = table.pack(fn(probe))
  return top, table.unpack(r, 1, r.n)
end

describe("export and import of " .. N .. " counters, streamed", function()
  local db, text
  setup(function()
    db = assert(tally.open())
    fill(db, N, 3)
    text = assert(db:export())
  end)
  teardown(function() db:close() end)

  it("export writes the bytes the Lua path writes, a piece at a time", function()
    assert.equal(export.export_any(db), text)
    local pieces, biggest, sum = 0, 0, 0
    assert.is_true(db:export(nil, function(s)
      pieces, sum = pieces + 1, sum + #s
      if #s > biggest then biggest = #s end
    end))
    assert.equal(#text, sum)
    assert.is_true(pieces > 50, pieces .. " pieces")
    assert.is_true(biggest < 128 * 1024, "a piece of " .. biggest .. " bytes")
    local chunks = {}
    assert.is_true(db:export("post:1*", function(s) chunks[#chunks + 1] = s end))
    assert.equal(db:export("post:1*"), table.concat(chunks))
    assert.equal(export.export_any(db, "post:1*"), table.concat(chunks))
    assert.equal('{"counters":{}}\n', db:export("none*"))
    assert.equal("bad argument #2 to 'export' (function expected, got table)",
                 helper.err(db.export, db, nil, {}))
  end)

  it("refuses to close the store from write, which runs inside the walk", function()
    local other = assert(tally.open())
    for i = 1, 20000 do other:incr(fmt("n%06d", i), i) end
    local calls = 0
    local ok, err = pcall(other.export, other, nil, function()
      calls = calls + 1
      other:close()
    end)
    assert.is_false(ok)
    assert.matches("cannot close the store while a walk of it runs", err, 1, true)
    assert.equal(1, calls)
    assert.equal(20000 * 20001 / 2, other:sum())   -- still open, every count there
    other:close()
  end)

  it("imports it back exactly into a fresh store, streamed, every counter and shard", function()
    local fresh = assert(tally.open())
    local phases = {}
    local top, n = peak(function(probe)
      return fresh:import(text, { progress = function(phase, done)
        if phase == "read" or done % 10240 == 0 then probe() end
        phases[phase] = (phases[phase] or 0) + 1
      end })
    end)
    assert.equal(N + 4, n)
    assert.is_nil(phases.decode)            -- not the whole-document path
    assert.is_true(phases.read > 1 and phases.apply > 1)
    -- the whole path held the decoded document, a table per counter:
    -- some hundred MiB here; the streamed one, a piece's
    assert.is_true(top < 48 * 1024, fmt("%.0f KiB", top))
    assert.truthy(cpu_summed(text):find('\n"cpu:2":' .. db:value("cpu:2") .. ',\n', 1, true))
    assert.equal(cpu_summed(text), cpu_summed(fresh:export()))
    for _, name in ipairs({ "post:1:likes", "post:10010:likes", "x\25597", 'q"\\89' }) do
      assert.same(db:counter(name):shards(), fresh:counter(name):shards())
      assert.same(db:counter(name):info().policy, fresh:counter(name):info().policy)
    end
    assert.same({ db:sum("slot:*") }, { fresh:sum("slot:*") })
    assert.same({ db:sum("cpu:*") }, { fresh:sum("cpu:*") })
    assert.equal("cpu", fresh:counter("cpu:1"):info().policy)
    -- from a file too, where it is
    local path = helper.tmpfile("doc.json")
    helper.write(path, "xyz" .. text)
    local other = assert(tally.open())
    local f = assert(io.open(path, "rb"))
    f:seek("set", 3)
    assert.equal(N + 4, other:import(f))
    f:close()
    assert.equal(cpu_summed(text), cpu_summed(other:export()))
    -- replace again: nothing changes
    assert.equal(N + 4, other:import(text))
    assert.equal(cpu_summed(text), cpu_summed(other:export()))
    -- add (counts that double within a shard's range): every shard doubles
    local src = assert(tally.open())
    fill(src, N, 5, true)
    local small = assert(src:export())
    local twice = assert(tally.open())
    assert.equal(N + 4, twice:import(small))
    assert.equal(N + 4, twice:import(small, { mode = "add" }))
    for _, name in ipairs({ "post:2:likes", "post:10010:likes", "x\255194", "é✓83" }) do
      local a, b = src:counter(name):shards(), twice:counter(name):shards()
      assert.is_true(#a > 0 and #a == #b)
      for i = 1, #a do assert.equal(2 * a[i], b[i]) end
    end
    assert.equal(2 * src:value("slot:2"), twice:value("slot:2"))
    assert.equal(2 * src:value("cpu:2"), twice:value("cpu:2"))
    src:close()
    twice:close()
    os.remove(path)
    fresh:close()
    other:close()
  end)

  -- A cpu counter has a shard per CPU of the machine that made it
  -- (2P + 1): a document from a machine of 1 CPU (3 shards) or 4 (9)
  -- imports streamed, each taken whole into this machine's shard count.
  it("takes another machine's cpu counters whole, streamed", function()
    local here = db:counter("cpu:1"):info().shards
    for _, shards in ipairs({ 3, 9 }) do
      local parts = {}
      for i = 1, shards do parts[i] = fmt('"%d":{"count":%d}', i - 1, i * 1000) end
      local doc = fmt('{"counters":{\n"cpu:1":{"num_shards":%d,"policy":"cpu","shards":{%s}},\n'
                      .. '"post:1":{"num_shards":1,"policy":"thread","shards":{"0":{"count":7}}}'
                      .. '\n}}\n', shards, table.concat(parts, ","))
      local sum = shards * (shards + 1) // 2 * 1000
      local into = assert(tally.open())
      into:counter("cpu:1", { policy = "cpu" }):incr(5)      -- replaced
      local phases = {}
      assert.equal(2, into:import(doc, { progress = function(phase) phases[phase] = true end }))
      assert.is_nil(phases.decode)                            -- streamed
      assert.is_true(phases.apply)
      assert.equal(sum, into:value("cpu:1"))
      assert.equal(here, into:counter("cpu:1"):info().shards)
      assert.equal(7, into:value("post:1"))
      assert.equal(2, into:import(doc, { mode = "add" }))
      assert.equal(2 * sum, into:value("cpu:1"))
      assert.equal(14, into:value("post:1"))
      -- made by the import
      local fresh = assert(tally.open())
      assert.equal(2, fresh:import(doc))
      assert.same({ sum, "cpu", here }, { fresh:value("cpu:1"), fresh:counter("cpu:1"):info().policy,
                                          fresh:counter("cpu:1"):info().shards })
      fresh:close()
      -- dropped and made again (another policy, or the same shards and
      -- another policy) after its piece was checked: refused, unchanged
      for _, remade in ipairs({ { shards = 4, policy = "thread" }, { policy = "slot" } }) do
        local moved = assert(tally.open())
        moved:counter("cpu:1", { policy = "cpu" }):incr(5)
        local n, msg, code = import_remaking(moved, doc, "cpu:1", remade)
        assert.same({ nil, "counter 'cpu:1' was dropped", "EDROPPED" }, { n, msg, code })
        assert.equal(1, moved:value("cpu:1"))
        assert.is_nil(moved:value("post:1"))
        moved:close()
      end
      -- into a counter of another policy: refused as the whole path says
      local thread = assert(tally.open())
      thread:counter("cpu:1", { shards = shards })
      assert.equal("import: counter 'cpu:1': policy is cpu but the counter exists with "
                   .. "policy thread", helper.err(thread.import, thread, doc))
      assert.equal(0, thread:value("cpu:1"))
      thread:close()
      into:close()
    end
  end)

  describe("refuses, as the whole-document path words it, and changes nothing:", function()
    local target, before, lines
    setup(function()
      -- the first 30,000 counters (2.6 MB: pieces enough), as export
      -- writes them
      lines = {}
      for line in text:gmatch("[^\n]+") do
        lines[#lines + 1] = line
        if #lines > 30000 then break end
      end
      lines[#lines] = lines[#lines]:gsub(",$", "")
      lines[#lines + 1] = "}}"
    end)
    before_each(function()
      target = assert(tally.open())
      target:counter("zz", { shards = 2 }):add_shard(2, 7)
      before = target:export()
    end)
    after_each(function() target:close() end)
    local function refuses(msg, doc, opts)
      assert.equal(msg, helper.err(target.import, target, doc, opts))
      assert.equal(before, target:export())
    end
    local function doc_of(t) return table.concat(t, "\n") .. "\n" end
    -- the last line up to i of a counter post:..., and its name
    local function post_at(i)
      while not lines[i]:find('^"post:') do i = i - 1 end
      return i, lines[i]:match('^"([^"]+)"')
    end

    it("a counter given twice: far apart, or spelt another way", function()
      local t = { table.unpack(lines) }
      local i, name = post_at(#t - 50)
      table.insert(t, 20, t[i])
      refuses(fmt("import: counter '%s' is given twice", name), doc_of(t))
      t = { table.unpack(lines) }
      i, name = post_at(5000)
      t[i + 1] = t[i]:gsub('^"p', '"\\u0070')          -- the same bytes
      refuses(fmt("import: counter '%s' is given twice", name), doc_of(t))
    end)

    it("a name that is not after the last piece's (the importer itself)", function()
      local json, quote = require "tally.json", require("tally.format").json_string
      local function line(name)
        return fmt('%s:{"num_shards":1,"policy":"thread","shards":{"0":{"count":1}}}',
                   quote(name))
      end
      local function check(imp, ...)
        local t = {}
        for i, name in ipairs({ ... }) do t[i] = line(name) end
        local piece = table.concat(t, ",\n")
        return imp:check(piece, assert(json.value("{" .. piece .. "}")), quote)
      end
      local imp = assert(core.importer(target, "replace"))
      assert.equal(2, check(imp, "b", "c"))
      assert.is_false(check(imp, "c", "d"))           -- c again, as the next piece's first
      assert.is_false(check(imp, "a"))
      assert.equal(1, check(imp, "c0"))               -- longer: after
      assert.is_false(check(imp, "d", "d"))           -- (cjson keeps one: not the text)
      assert.is_false(check(imp, "f", "e"))           -- not sorted
      -- quote may not close the importer whose entries it is called for
      local piece = line("g\1")
      assert.equal("importer: close during its check",
                   helper.err(imp.check, imp, piece, assert(json.value("{" .. piece .. "}")),
                              function(n) imp:close(); return quote(n) end))
      imp:close()
      assert.equal(before, target:export())
    end)

    it("a name a family's cap sends to its overflow, made by a writer before the undo", function()
      -- the refused counter was never made: the undo must not drop the
      -- one another writer makes under that name afterwards
      local json, quote = require "tally.json", require("tally.format").json_string
      local db = assert(tally.open())
      db:family("g:*", { max_counters = 1 })
      assert(db:incr("g:a", 1))
      local piece = fmt('%s:{"num_shards":1,"policy":"thread","shards":{"0":{"count":5}}}',
                        quote("g:b"))
      local imp = assert(core.importer(db, "replace"))
      assert.equal(1, imp:check(piece, assert(json.value("{" .. piece .. "}")), quote))
      local k, _, code = imp:apply(10)
      assert.is_nil(k)
      assert.equal("EFULL", code)
      assert(db:drop("g:a"))                          -- room under the cap, then the writer
      assert(db:incr("g:b", 9))
      imp:undo()
      imp:close()
      assert.equal(9, db:value("g:b"))
      db:close()
    end)

    it("a key given twice inside a counter", function()
      local t = { table.unpack(lines) }
      local i, name = post_at(5000)
      t[i] = t[i]:gsub('"num_shards":(%d+),', '"num_shards":%1,"num_shards":%1,')
      refuses(fmt("import: counter '%s': num_shards is given twice", name), doc_of(t))
    end)

    it("a bad count near the end", function()
      local t = { table.unpack(lines) }
      local i, name = post_at(#t - 2000)
      t[i] = t[i]:gsub('"0":{"count":[^}]+}', '"0":{"count":1.5}', 1)
      refuses(fmt('import: counter \'%s\': shards["0"].count must be an integer, got 1.5', name),
              doc_of(t))
    end)

    it("a counter the store has with another policy, or shard count", function()
      target:counter("post:5:likes", { shards = 1, policy = "round_robin" })
      target:counter("post:9:likes", { shards = 3, policy = select(3, spec_of(9)) })
      before = target:export()
      refuses("import: counter 'post:5:likes': policy is random but the counter exists "
              .. "with policy round_robin", text)
      target:drop("post:5:likes")
      before = target:export()
      refuses("import: counter 'post:9:likes': num_shards is 1 but the counter exists "
              .. "with 3 shards", text)
    end)

    it("an add that takes a shard out of its range", function()
      local c = target:counter("post:7:likes", { shards = 1, policy = select(3, spec_of(7)) })
      c:add_shard(1, BOTTOM + 1)
      before = target:export()
      local n = db:counter("post:7:likes"):shards()[1]
      assert.is_true(n < -1)
      refuses(fmt("import: counter 'post:7:likes': shards[\"0\"].count %d would take the shard "
                  .. "(now %d) out of its range (-2^62 to 2^62-1)", n, BOTTOM + 1),
              text, { mode = "add" })
    end)

    it("a counter with a function policy, into a store without it", function()
      local src = assert(tally.open())
      fill(src, 3000, 5)
      src:counter("post:2999:other", { shards = 2, policy = function() return 1 end })
      refuses("import: counter 'post:2999:other': policy function cannot be created by an "
              .. "import: create the counter first with db:counter(name, { shards = 2, "
              .. "policy = fn })", assert(src:export()))
      src:close()
    end)
  end)

  it("refuses a counter dropped and made again between its check and its apply", function()
    local target = assert(tally.open())
    local _, shards, policy = spec_of(3)
    assert.equal("key", policy)
    target:counter("post:3:likes", { shards = shards, policy = policy }):add_shard(1, 2)
    local n, msg, code = import_remaking(target, text, "post:3:likes",
                                         { shards = shards, policy = "random" })
    assert.same({ nil, "counter 'post:3:likes' was dropped", "EDROPPED" }, { n, msg, code })
    assert.equal(1, target:value("post:3:likes"))
    assert.is_nil(target:value("post:1:likes"))
    target:close()
  end)

  it("undoes what it applied when a counter changes under it, and what progress raises", function()
    local target = assert(tally.open())
    local late                                      -- applied after the first 25,000
    for i = 1, N, 7 do
      local name, shards, policy = spec_of(i)
      target:counter(name, { shards = shards, policy = policy }):add_shard(1, i)
      if shards == 1 and name:find("^post:9") and (not late or name > late) then late = name end
    end
    local before = target:export()
    local n, msg, code = target:import(text, { progress = function(phase, done)
      if phase == "apply" and done >= 25000 and target:counter(late):info().shards == 1 then
        target:counter(late):reshard(2)
      end
    end })
    assert.same({ nil, fmt("counter '%s' was resharded to 2 shards during the import", late),
                  "EMISMATCH" }, { n, msg, code })
    target:counter(late):reshard(1)
    assert.equal(before, target:export())
    local ok, err = pcall(target.import, target, text, { progress = function(phase, done)
      if phase == "apply" and done >= 25000 then error("stop", 0) end
    end })
    assert.same({ false, "stop" }, { ok, err })
    assert.equal(before, target:export())
    target:close()
  end)
end)

describe("an import killed midway", function()
  -- A child imports a document of N counters into a store that holds
  -- other values for them; once it has applied 20,000 it says so and
  -- waits, and is killed (SIGKILL). The counters it applied keep the
  -- document's counts, the others their own; a replace run again makes the
  -- store the document; an --add run again adds the applied ones twice.
  local function kill_midway(mode)
    local dir = helper.tmpfile("tmpdir")
    assert(os.execute("mkdir -p " .. q(dir)))
    local store, doc = helper.tmpfile("killed.tly"), helper.tmpfile("doc.json")
    local mark = dir .. "/applied"
    do
      local src = assert(tally.open())
      for i = 1, N do src:incr(fmt("c:%06d", i), i) end
      helper.write(doc, assert(src:export()))
      src:close()
      local db = assert(tally.open("file:" .. store))
      for i = 1, N do db:incr(fmt("c:%06d", i), 1000000 + i) end
      db:close()
    end
    local script = dir .. "/child.lua"
    helper.write(script, fmt([[
      local tally = require "tally"
      local core = require "tally.core"
      local db = assert(tally.open(%q))
      local f = assert(io.open(%q, "rb"))
      db:import(f, { mode = %q, progress = function(phase, done)
        if phase == "apply" and done >= 20000 then
          local m = assert(io.open(%q, "w"))
          m:write(done)
          m:close()
          local t = os.time() + 60
          while os.time() < t do core.sleep(0.01) end
        end
      end })
      os.exit(3)   -- not reached: killed in the wait above
    ]], "file:" .. store, doc, mode, mark))
    local pid = assert(helper.sh(("cd %s && TMPDIR=%s LUA_PATH=%s LUA_CPATH=%s lua5.4 %s "
                                  .. ">/dev/null 2>&1 & echo $!"):format(
      q(dir), q(dir), q(helper.build .. "/?.lua;" .. helper.build .. "/?/init.lua;;"),
      q(helper.build .. "/?.so;;"), q(script)))):match("^(%d+)")
    local applied
    for _ = 1, 6000 do                               -- at most 60 s
      applied = tonumber(helper.slurp(mark))
      if applied then break end
      core.sleep(0.01)
    end
    assert.is_number(applied)
    assert.is_true(os.execute("kill -9 " .. pid))
    for _ = 1, 1000 do                               -- gone (at most 10 s)
      if not os.execute("kill -0 " .. pid .. " 2>/dev/null") then break end
      core.sleep(0.01)
    end
    assert.is_falsy(os.execute("kill -0 " .. pid .. " 2>/dev/null"))
    -- its temporary files went with it
    assert.equal("applied\nchild.lua\n", (helper.sh("ls " .. q(dir))))
    local db = assert(tally.open("file:" .. store))
    for _, i in ipairs({ 1, applied // 2, applied, applied + 1, N }) do
      local want = i <= applied and (mode == "add" and 1000000 + 2 * i or i) or 1000000 + i
      assert.equal(want, db:value(fmt("c:%06d", i)), "c:" .. i)
    end
    db:close()
    return store, doc, applied, dir
  end

  it("leaves the counters it applied; a replace run again finishes it exactly", function()
    local store, doc, _, dir = kill_midway("replace")
    local out, err, code = helper.tally_split(nil, "import", store, doc)
    assert.same({ "imported " .. N .. " counters into " .. store .. " (replaced)\n", "", 0 },
                { out, err, code })
    local db = assert(tally.open("file:" .. store))
    assert.equal(helper.slurp(doc), db:export())
    db:close()
    os.remove(store)
    os.remove(doc)
    os.execute("rm -rf " .. q(dir))
  end)

  it("with --add, leaves the counters it added; run again, it adds those twice", function()
    local store, doc, applied, dir = kill_midway("add")
    local out, _, code = helper.tally_split(nil, "import", store, doc, "--add")
    assert.equal(0, code, out)
    local db = assert(tally.open("file:" .. store))
    for _, i in ipairs({ 1, applied, applied + 1, N }) do
      local want = 1000000 + i + (i <= applied and 2 or 1) * i
      assert.equal(want, db:value(fmt("c:%06d", i)), "c:" .. i)
    end
    db:close()
    os.remove(store)
    os.remove(doc)
    os.execute("rm -rf " .. q(dir))
  end)
end)

describe("tally import STORE -", function()
  it("reads stdin from where it stands, as the whole-document path did", function()
    local src = assert(tally.open())
    for i = 1, 3000 do src:incr(fmt("c:%06d", i), i) end
    local doc = helper.tmpfile("doc.json")
    helper.write(doc, "xyz\n" .. assert(src:export()))
    local store = helper.tmpfile("stdin.tly")
    -- the shell's read takes the first line a byte at a time: stdin is
    -- left at the export's first byte (no other program: under the
    -- sanitizers' preload one might not run)
    local out, code = helper.sh(fmt("{ read -r skip; %s import %s - --create; } < %s",
                                    q(helper.bin), q(store), q(doc)))
    assert.same({ "imported 3000 counters into " .. store .. " (replaced)\n", 0 }, { out, code })
    local db = assert(tally.open("file:" .. store))
    assert.equal(src:export(), db:export())
    db:close()
    src:close()
    os.remove(store)
    os.remove(doc)
  end)
end)
