-- Damage, truncation and planted files (issue 10, items 1 to 5), through
-- the Lua API and the real tally command: a healthy store is never called
-- corrupt; a store truncated by another program, before or while a
-- command runs, is reported by name and exit status 1, never a bus error
-- or a traceback; a symlink or another user's file is refused unless
-- trusted; mode bits above 0777 are dropped. (The rings and cells cases
-- need the file's layout: tests/test_damage.c.)
local helper = require "spec.support.helper"
local tally = require "tally"

local q = helper.q

-- Run tally with stdout and stderr apart: out, err, exit code.
local run = helper.tally_split

local function store_with_counters(n)
  local path = helper.tmpfile("damaged.tly")
  local db = assert(tally.open("file:" .. path))
  for i = 1, n do db:incr("c" .. i, i) end
  db:close()
  return path
end

-- A store of 3 counters given to uid 65534; nil (and pending) unless root.
local function foreign_store()
  if not helper.is_root() then
    pending("needs root to give a file away")
    return nil
  end
  local path = store_with_counters(3)
  helper.sh("chown 65534 " .. q(path))
  return path
end

local function mode_of(path)
  return (helper.sh("stat -c %a " .. q(path))):match("%d+")
end

describe("a healthy store", function()
  it("finds no corruption when a longer absent name meets the newest record", function()
    for _, spec in ipairs({ "memory", "file:" .. helper.tmpfile() }) do
      local db = assert(tally.open(spec))
      db:counter("q")
      local v, msg = db:value("big:163384")
      assert.is_nil(v)
      assert.equals("no such counter 'big:163384'", msg)
      assert.is_true(db:check())
      db:close()
    end
  end)
end)

describe("a store truncated by another program", function()
  for _, size in ipairs({ 0, 100, 4096, 8192, 65536 }) do
    it("is reported by ls, get, export, info and info --check (" .. size .. " bytes left)", function()
      local path = store_with_counters(30)
      assert.equals(0, select(2, helper.sh("truncate -s " .. size .. " " .. q(path))))
      for _, args in ipairs({ { "ls", path }, { "get", path, "c1" }, { "export", path },
                              { "info", path }, { "info", "--check", path } }) do
        local _, err, code = run(nil, table.unpack(args))
        local what = table.concat(args, " ")
        assert.equals(1, code, what)
        if size == 0 then
          assert.truthy(err:find("empty file", 1, true), what .. ": " .. err)
        else
          assert.truthy(err:find(path .. ": tally store is truncated", 1, true), what .. ": " .. err)
        end
        assert.is_nil(err:find("traceback", 1, true), what .. ": " .. err)
      end
    end)
  end

  it("while a script has it open: a message naming it, exit status 1", function()
    local path = store_with_counters(30)
    local out, err, code = run(nil, "--store", path, "-e",
      "print(db:value('c3')) os.execute('truncate -s 4096 " .. path .. "') print(db:sum('*'))")
    assert.equals("3\n", out)
    assert.equals(1, code)
    assert.equals("tally: " .. path .. ": tally store is truncated (the file shrank while it "
      .. "was open: another program truncated it; a bus error stopped this run)\n", err)
  end)

  it("while the prompt has it open: the same", function()
    local path = store_with_counters(30)
    local out, err, code = run("print(db:value('c2'))\nos.execute('truncate -s 8192 " .. path
      .. "')\nprint(db:value('c2'))\nprint('not reached')\n", "--store", path)
    assert.truthy(out:find("2\n", 1, true))
    assert.is_nil(out:find("not reached", 1, true))
    assert.equals(1, code)
    assert.truthy(err:find(path .. ": tally store is truncated", 1, true), err)
  end)

  it("is found by db:check() and db:stats() on a store already open", function()
    -- in a child: a mapping of a truncated file must not live on in the
    -- spec runner, where any later touch of it would be a bus error
    local path = store_with_counters(30)
    local out, err, code = run(nil, "-e", ([[
      local db = assert(tally.open("file:%s"))
      os.execute("truncate -s 65536 %s")
      print(db:check())
      print(db:stats())
      db:close()]]):format(path, path))
    assert.equals(0, code, err)
    local check, stats = out:match("^(.-)\n(.-)\n$")
    assert.truthy(check and check:find("^nil\t.*tally store is truncated %(header says .*\tECORRUPT$"), out)
    assert.truthy(stats:find("^nil\t.*tally store is truncated"), out)
  end)
end)

-- ok = 5 and c1..c10 = 0x123456789AB, then every word of that value
-- overwritten with INT64_MIN (as a bad copy leaves): issue 35, item 2.
local MARK = 0x123456789AB

local function overwrite_words(path, from, to)
  local data = assert(helper.slurp(path))
  local parts, n, last = {}, 0, 1
  for at = 1, #data - 7, 8 do
    if string.unpack("<i8", data, at) == from then
      parts[#parts + 1] = data:sub(last, at - 1) .. string.pack("<i8", to)
      last, n = at + 8, n + 1
    end
  end
  parts[#parts + 1] = data:sub(last)
  helper.write(path, table.concat(parts))
  return n
end

local function damaged_cells_store()
  local path = helper.tmpfile("cells.tly")
  local db = assert(tally.open("file:" .. path))
  db:incr("ok", 5)
  for i = 1, 10 do db:incr("c" .. i, MARK) end
  db:close()
  assert.equals(10, overwrite_words(path, MARK, math.mininteger))
  return path
end

local function corrupt_msg(path, name)
  return path .. ": tally store is corrupt (counter '" .. name .. "' shard 0 holds "
    .. "-9223372036854775808, farther outside the live range than an interrupted add "
    .. "leaves: the file was damaged)"
end

describe("cells damaged far outside the live range", function()
  -- before, each first read waited 2 s and then gave -2^62 for good
  it("are ECORRUPT at once in the Lua module, and the rest reads right", function()
    local path = damaged_cells_store()
    local out, code = helper.lua_within(10, ([[
      local tally = require "tally"
      local db = assert(tally.open("file:%s"))
      print(db:value("c3"))
      print(db:counter("c4"):value())
      print(db:incr("c5", 1))
      local v, msg, code = db:sum("*")
      print(v, msg:find("shard 0 holds -9223372036854775808, farther", 1, true) ~= nil, code)
      print(db:sum("ok"))
      print(select(3, db:check()))
      db:rollup("*", { every = 10, keep = { "10x10s" } })
      for _, r in ipairs(db:tick(1700000000)) do
        if r.pattern then print(r.status, r.counters, r.skipped) end
      end
      print(db:value("ok"))
      db:close()]]):format(path))
    assert.equals(0, code, out)
    assert.equals(table.concat({
      "nil\t" .. corrupt_msg(path, "c3") .. "\tECORRUPT",
      "nil\t" .. corrupt_msg(path, "c4") .. "\tECORRUPT",
      "nil\t" .. corrupt_msg(path, "c5") .. "\tECORRUPT",
      "nil\ttrue\tECORRUPT",
      "5\t1",
      "ECORRUPT",
      "ran\t1\t10", -- ok rolled; the damaged ones skipped and counted
      "5", "" }, "\n"), out)
  end)

  it("are reported at once by tally ls, get, export and info --check", function()
    local path = damaged_cells_store()
    for _, args in ipairs({ { "ls", path }, { "get", path, "c7" }, { "export", path },
                            { "info", "--check", path } }) do
      local what = table.concat(args, " ")
      local t = os.time()
      local out, err, code = helper.tally_within(10, nil, table.unpack(args))
      assert.is_true(os.time() - t <= 2, what)
      assert.equals(1, code, what .. ": " .. out .. err)
      local said = out .. err -- info prints its check line on stdout
      assert.truthy(said:find(path .. ": tally store is corrupt (counter 'c", 1, true), what .. ": " .. said)
      assert.truthy(said:find("farther outside the live range", 1, true), what .. ": " .. said)
      assert.is_nil(out:find("4611686018427387904", 1, true), what)
    end
    local out, err, code = helper.tally_within(10, nil, "get", path, "ok")
    assert.equals(0, code, err)
    assert.equals("5\n", out)
    -- nothing was written over the damage
    assert.equals(10, overwrite_words(path, math.mininteger, math.mininteger))
  end)
end)

-- Pages of a store swapped, copied over another, zeroed or filled, through
-- the Lua module and the command (tests/test_mutate.c runs many more
-- through the C API): each ends within its time limit with a value or an
-- error, never a signal or a traceback, and a counter whose cell's page
-- was left alone reads its own value or an error.
describe("a store with pages mutated at random", function()
  local PAGE = 4096
  local SEED = tonumber(os.getenv("TALLY_MUTATE_SEED") or "") or 0x35
  local MUTANTS = tonumber(os.getenv("TALLY_MUTANTS") or "") or 16
  local base, truth, pages

  -- each shard of each counter holds a word found nowhere else in the
  -- file (round robin: one increment a shard): the pages holding a
  -- counter's words are its cells', all of them (a page of live values
  -- over a cell is a live value: damage no reader can tell)
  local function build()
    base = helper.tmpfile("mutate-base.tly")
    local db = assert(tally.open("file:" .. base))
    truth = {}
    local words = {}
    db:family("f:*", { shards = 4, policy = "round_robin" })
    db:rollup("*", { every = 10, keep = { "30x10s", "10x1m" } })
    for k = 1, 12 do
      local name = (k % 3 == 0 and "f:" or "c:") .. k
      local c = db:counter(name, k % 3 ~= 0 and { shards = ({ 1, 2, 8 })[k % 3 + 1],
                                                   policy = "round_robin" } or nil)
      words[name] = {}
      for i = 1, c:info().shards do words[name][i] = 0x3500000000 + k * 0x10001 + i * 0x1000000 end
    end
    for t = 0, 4 do db:tick(1700000000 + t * 10) end
    for k = 1, 5 do
      db:incr("gone:" .. k, k)
      db:drop("gone:" .. k)
    end
    for name, ws in pairs(words) do -- after the ticks: not in a ring
      local c, sum = db:counter(name), 0
      for _, w in ipairs(ws) do
        assert(c:incr(w))
        sum = sum + w
      end
      truth[name] = sum
    end
    db:close()
    local data = assert(helper.slurp(base))
    pages = {}
    for name in pairs(truth) do pages[name] = {} end
    local by_value = {}
    for name, ws in pairs(words) do
      for _, w in ipairs(ws) do by_value[w] = name end
    end
    local found = 0
    for at = 1, #data - 7, 8 do
      local name = by_value[string.unpack("<i8", data, at)]
      if name then
        pages[name][(at - 1) // PAGE] = true
        found = found + 1
      end
    end
    local all = 0
    for _, ws in pairs(words) do all = all + #ws end
    assert.equals(all, found) -- every shard's word, once: each counter's cells are known
    return data
  end

  local function mutate(data, rng)
    local n = #data // PAGE
    local function page(i) return data:sub(i * PAGE + 1, (i + 1) * PAGE) end
    local function put(d, i, p) return d:sub(1, i * PAGE) .. p .. d:sub((i + 1) * PAGE + 1) end
    local kind, a, b = rng(4), rng(n) - 1, rng(n) - 1
    local fills = { string.pack("<i8", math.mininteger), string.pack("<i8", math.maxinteger),
                    string.pack("<i8", -(3 << 61)), string.pack("<i8", -1) }
    local what
    if kind == 1 then
      local pa, pb = page(a), page(b)
      data, what = put(put(data, a, pb), b, pa), ("swap pages %d and %d"):format(a, b)
    elseif kind == 2 then
      data, what = put(data, b, page(a)), ("copy page %d over %d"):format(a, b)
    elseif kind == 3 then
      data, what = put(data, b, ("\0"):rep(PAGE)), ("zero page %d"):format(b)
    else
      local f = rng(#fills)
      data, what = put(data, b, fills[f]:rep(PAGE // 8)), ("fill page %d with pattern %d"):format(b, f)
    end
    return data, what, { [a] = kind == 1 or nil, [b] = true }
  end

  local function wrong(name, got, touched)
    local v = truth[name]
    if not v or got == v or math.type(got) ~= "integer" then return false end -- an error code
    for p in pairs(pages[name]) do
      if touched[p] then return false end
    end
    return true
  end

  it("ends in time with a value or an error, and reads untouched counters right", function()
    local data = build()
    local state = SEED
    local function rng(n) -- an LCG: the same mutants for the same seed
      state = (state * 6364136223846793005 + 1442695040888963407) & 0x7fffffffffffffff
      return (state >> 20) % n + 1
    end
    print(("damage_spec: seed %d, %d mutants (again: TALLY_MUTATE_SEED=%d)"):format(SEED, MUTANTS, SEED))
    local path = helper.tmpfile("mutant.tly")
    local names = {}
    for name in pairs(truth) do names[#names + 1] = name end
    table.sort(names)
    for m = 1, MUTANTS do
      local mutant, what, touched = mutate(data, rng)
      local label = ("mutant %d (%s, seed %d)"):format(m, what, SEED)
      helper.write(path, mutant)
      local out, code = helper.lua_within(5, ([[
        local tally = require "tally"
        local db = tally.open("file:%s")
        if not db then return end
        for _, name in ipairs({ "%s" }) do
          local v, _, code = db:value(name)
          print(name, v or code)
        end
        db:sum("*")
        db:names("*")
        db:export()
        db:check()
        db:rollup("*", { every = 10, keep = { "30x10s", "10x1m" } })
        db:tick(1700001000)
        db:incr("new:1", 1)
        db:check()
        db:close()
        tally.compact("%s")]]):format(path, table.concat(names, '", "'), path))
      assert.equals(0, code, label .. ": " .. out)
      for name, v in out:gmatch("([%w:]+)\t(%S+)\n") do
        assert.is_false(wrong(name, math.tointeger(v) or v, touched),
          label .. ": the Lua module read " .. name .. " as " .. v)
      end
      helper.write(path, mutant) -- the command's reads, on the mutant as made
      -- (a few hundred more through the Lua module: the next test)
      for _, args in ipairs({ { "ls", path }, { "export", path }, { "info", "--check", path } }) do
        local cmd = label .. ": tally " .. table.concat(args, " ")
        local cout, cerr, ccode = helper.tally_within(5, nil, table.unpack(args))
        assert.is_true(ccode == 0 or ccode == 1, cmd .. " exited " .. tostring(ccode) .. ": " .. cerr)
        assert.is_nil(cerr:find("traceback", 1, true), cmd .. ": " .. cerr)
        if args[1] == "ls" then
          for name, v in cout:gmatch("\n([%w:]+)%s+(%-?%d+)") do
            assert.is_false(wrong(name, math.tointeger(v), touched), cmd .. " read " .. name .. " as " .. v)
          end
        end
      end
    end
  end)

  -- A few hundred more through the Lua module, in one child process (a
  -- process each costs more than the reads): each mutant is written,
  -- opened and read every way, and its time is measured; a hang is the
  -- child's time limit, a crash its exit, and the child says which
  -- mutant it was on.
  it("ends each of 300 mutants read through the Lua module within 5 s", function()
    local data = build()
    local n = tonumber(os.getenv("TALLY_LUA_MUTANTS") or "") or 300
    local src, path = helper.tmpfile("mutants-src.tly"), helper.tmpfile("mutant-lua.tly")
    helper.write(src, data)
    local names = {}
    for name in pairs(truth) do names[#names + 1] = ("%q"):format(name) end
    table.sort(names)
    local out, code = helper.lua_within(240, ([[
      local tally = require "tally"
      local f = assert(io.open(%q, "rb")); local data = f:read("a"); f:close()
      local PAGE, state = 4096, %d
      local function rng(n)
        state = (state * 6364136223846793005 + 1442695040888963407) & 0x7fffffffffffffff
        return (state >> 20) %% n + 1
      end
      local fills = { string.pack("<i8", math.mininteger), string.pack("<i8", math.maxinteger),
                      string.pack("<i8", -(3 << 61)), string.pack("<i8", -1) }
      local names = { %s }
      for m = 1, %d do
        local np = #data // PAGE
        local kind, a, b = rng(4), rng(np) - 1, rng(np) - 1
        local pa, pb = data:sub(a * PAGE + 1, (a + 1) * PAGE), data:sub(b * PAGE + 1, (b + 1) * PAGE)
        local pages = { [a] = pa, [b] = pb }
        if kind == 1 then pages[a], pages[b] = pb, pa
        elseif kind == 2 then pages[b] = pa
        elseif kind == 3 then pages[b] = ("\0"):rep(PAGE)
        else pages[b] = fills[rng(#fills)]:rep(PAGE // 8) end
        local out = assert(io.open(%q, "wb"))
        out:write(data)
        for p, bytes in pairs(pages) do out:seek("set", p * PAGE); out:write(bytes) end
        out:close()
        io.stderr:write("mutant ", m, " kind ", kind, " pages ", a, " ", b, "\n")
        local t0 = os.time()
        local db = tally.open("file:" .. %q)
        if db then
          for _, name in ipairs(names) do
            local v = db:value(name)
            if math.type(v) == "integer" then print(m, a, b, kind, name, v) end
          end
          db:sum("*"); db:names("*"); db:values("*"); db:top("*", 5); db:snapshot("*")
          db:export(); db:check(); db:stats()
          db:rollup("*", { every = 10, keep = { "30x10s", "10x1m" } })
          db:tick(1700001000)
          db:incr("new:1", 1)
          db:check()
          db:close()
        end
        if os.time() - t0 > 5 then error("mutant " .. m .. " took " .. (os.time() - t0) .. " s") end
      end
      print("done")]]):format(src, SEED + 1, table.concat(names, ", "), n, path, path))
    assert.equals(0, code, out:sub(-2000))
    assert.matches("done\n$", out)
    -- untouched counters read their own value
    for m, a, b, kind, name, v in out:gmatch("(%d+)\t(%d+)\t(%d+)\t(%d+)\t([%w:]+)\t(%-?%d+)\n") do
      local touched = { [tonumber(a)] = kind == "1" or nil, [tonumber(b)] = true }
      assert.is_false(wrong(name, math.tointeger(v), touched),
        ("mutant %s (kind %s, pages %s %s): the Lua module read %s as %s"):format(m, kind, a, b, name, v))
    end
  end)
end)

describe("tally.open and planted files", function()
  it("refuses a symbolic link unless trusted", function()
    local path = store_with_counters(3)
    local link = helper.tmpfile("link.tly")
    helper.sh("ln -s " .. q(path) .. " " .. q(link))
    local db, msg, code = tally.open("file:" .. link)
    assert.is_nil(db)
    assert.equals("EUNTRUSTED", code)
    assert.equals(link .. ": refusing to open a symbolic link as a store (open its target, "
      .. "or trust the path: TALLY_OPEN_TRUST, Lua { trust = true })", msg)
    db = assert(tally.open("file:" .. link, { trust = true }))
    assert.equals(3, db:value("c3"))
    db:close()
    -- the command says why too, and how to trust it, without a traceback
    local _, err, ecode = run(nil, "ls", link)
    assert.equals(1, ecode)
    assert.truthy(err:find("refusing to open a symbolic link", 1, true), err)
    assert.truthy(err:find("; here: --trust", 1, true), err)
    assert.is_nil(err:find("traceback", 1, true), err)
    -- compact too: refused, then trusted (its target rewritten)
    _, err, ecode = run(nil, "compact", link)
    assert.equals(1, ecode)
    assert.truthy(err:find("refusing to open a symbolic link", 1, true), err)
    assert.truthy(err:find("; here: --trust", 1, true), err)
    local out
    out, err, ecode = run(nil, "compact", link, "--trust")
    assert.equals(0, ecode, err)
    assert.truthy(out:find("^compacted "), out)
    db = assert(tally.open("file:" .. path))
    assert.equals(3, db:value("c3"))
    db:close()
    assert.truthy(helper.err(tally.compact, path, nil, { x = 1 })
                    :find("bad argument #3 to '.*compact' %(unknown option 'x' %(expected trust%)%)"))
  end)

  it("refuses a dangling symbolic link and creates nothing at its target", function()
    local target, link = helper.tmpfile("target.tly"), helper.tmpfile("dangling.tly")
    helper.sh("ln -s " .. q(target) .. " " .. q(link))
    local db, _, code = tally.open("file:" .. link)
    assert.is_nil(db)
    assert.equals("EUNTRUSTED", code)
    assert.is_nil(io.open(target))
  end)

  it("refuses a store owned by another user unless trusted (as root)", function()
    local path = foreign_store()
    if not path then return end
    local db, msg, code = tally.open("file:" .. path)
    assert.is_nil(db)
    assert.equals("EUNTRUSTED", code)
    assert.truthy(msg:find("refusing a store owned by another user (uid 65534, this process runs as 0", 1, true), msg)
    db = assert(tally.open("file:" .. path, { trust = true }))
    assert.equals(2, db:value("c2"))
    db:close()
  end)

  it("tally commands refuse another user's store and a symlink unless given --trust", function()
    local path = foreign_store()
    if not path then return end
    local out, err, code = run(nil, "get", path, "c3")
    assert.equals(1, code)
    assert.equals("", out)
    assert.truthy(err:find("^tally get: .*refusing a store owned by another user"), err)
    out, err, code = run(nil, "get", path, "c3", "--trust")
    assert.equals(0, code, err)
    assert.equals("3\n", out)
    local link = helper.tmpfile("link.tly")
    helper.sh("ln -s " .. q(path) .. " " .. q(link))
    out, err, code = run(nil, "ls", link, "--trust", "--json")
    assert.equals(0, code, err)
    assert.truthy(out:find('"name":"c3","value":3', 1, true), out)
    out, err, code = run(nil, "ls", link)
    assert.equals(1, code)
    assert.truthy(err:find("refusing to open a symbolic link", 1, true), err)
  end)

  it("drops setuid, setgid and sticky from mode", function()
    local path = helper.tmpfile()
    local db = assert(tally.open("file:" .. path, { mode = tonumber("7777", 8) }))
    db:close()
    assert.equals("777", mode_of(path))
    path = helper.tmpfile()
    db = assert(tally.open("file:" .. path, { mode = tonumber("4640", 8) }))
    db:close()
    assert.equals("640", mode_of(path))
  end)

  it("raises on a trust option that is not a boolean", function()
    assert.equals("bad argument #2 to 'open' (trust must be a boolean, got 'yes')",
      helper.err(tally.open, "file:" .. helper.tmpfile(), { trust = "yes" }))
  end)
end)
