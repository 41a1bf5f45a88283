-- `tally watch` on a terminal (tmux, spec/support/tty.lua), while other processes
-- write the store; and progress bars on a terminal.
local helper = require "spec.support.helper"
local tty = require "spec.support.tty"
local tally = require "tally"

local q = helper.q

local function store_with(values)
  local path = helper.tmpfile()
  local db = assert(tally.open("file:" .. path))
  for name, v in pairs(values) do db:incr(name, v) end
  db:close()
  return path
end

-- The row of counter `name` on the screen: value, rate (strings), or nil.
local function row(screen, name)
  for line in screen:gmatch("[^\n]+") do
    local v, rate = line:match("^" .. name:gsub("%p", "%%%0") .. "%s+(%-?%d+)%s+(%S+)")
    if v then return v, rate end
  end
end

-- Waits for a whole frame that matches `pattern`: tmux may capture the pane
-- while a frame is still being written, so the footer (the frame's last
-- line) must be there too before the rows above it are read.
local function frame(t, pattern)
  return t:wait(function(x) return x:find(pattern) and x:find("\nq quit[^\n]*$") end)
end

-- Names in the order the rows show them.
local function order(screen, names)
  local at = {}
  for _, n in ipairs(names) do
    at[#at + 1] = { n = n, i = screen:find("\n" .. n:gsub("%p", "%%%0") .. " ") }
  end
  table.sort(at, function(a, b) return (a.i or math.huge) < (b.i or math.huge) end)
  local out = {}
  for i, a in ipairs(at) do out[i] = a.n end
  return out
end

describe("tally watch", function()
  local t
  after_each(function() if t then t:close(); t = nil end end)

  it("shows the counters and follows another process's increments", function()
    local path = store_with({ ["post:1:likes"] = 10, views = 3 })
    t = tty.open(q(tty.bin()) .. " watch " .. q(path) .. " --interval 0.2")
    local s = frame(t, "\nviews%s+3 ")
    assert.matches("^tally watch  %d%d:%d%d:%d%d  sort: rate  every 0%.2s  2 counters  total 13"
                   .. "  file:/", s)
    assert.matches("\nNAME%s+VALUE%s+RATE/S%s+HISTORY", s)
    assert.equal("10", (row(s, "post:1:likes")))
    -- a second process writes; the screen follows
    local out, code = helper.tally("incr", path, "post:1:likes", "5")
    assert.equal(0, code, out)
    s = t:wait(function(x) return row(x, "post:1:likes") == "15" end)
    assert.matches("2 counters  total 18", s)
    -- another writer keeps adding to views: it climbs to the top (sorted by rate)
    local writer = helper.spawn("-e", ("local db = tally.open(%q) local t0 = tally.now() "
      .. "while tally.now() - t0 < 2 do db:incr('views', 10) tally.sleep(0.01) end")
      :format("file:" .. path))
    s = t:wait(function(x)
      local v, rate = row(x, "views")
      return v and tonumber(v) > 3 and tonumber(rate) and tonumber(rate) > 0 and
             order(x, { "views", "post:1:likes" })[1] == "views"
    end)
    writer:close()
    assert.matches("sort: rate", s)
    t:keys("q")
    t:wait("%[exit 0%]")
  end)

  it("takes a counter dropped and made again for a new one, not a fall of its value", function()
    local path = store_with({ a = 1000, b = 1 })
    t = tty.open(q(tty.bin()) .. " watch " .. q(path) .. " --interval 2 --sort name")
    frame(t, "\na%s+1000 ")
    local db = assert(tally.open("file:" .. path))
    assert(db:drop("a"))
    assert(db:incr("a", 5))
    db:close()
    -- the refresh that first sees the new one: no rate yet (it has no
    -- rollup), where a fall from 1000 to 5 would be -497.5 a second
    local s = t:wait(function(x) return row(x, "a") == "5" and x:find("\nq quit[^\n]*$") end)
    local _, rate = row(s, "a")
    assert.equal("-", rate, s)
    t:keys("q")
    t:wait("%[exit 0%]")
  end)

  it("writes a name's control bytes as \\xNN: a name cannot drive the terminal", function()
    local path = store_with({ ["evil\27[2J\27]0;owned\7"] = 4, ["two\nrows"] = 5 })
    t = tty.open(q(tty.bin()) .. " watch " .. q(path) .. " --interval 0.2 --sort name")
    local s = frame(t, "2 counters")
    assert.matches("\nevil\\x1b%[2J\\x1b%]0;owned\\x07%s+4 ", s)
    assert.matches("\ntwo\\x0arows%s+5 ", s)
    t:keys("q")
    t:wait("%[exit 0%]")
  end)

  it("adds the total exactly, and says when it leaves int64", function()
    -- two counters of 2^63 - 2 each (two shards of 2^62 - 1): their sum wrapped to -4
    local path = helper.tmpfile()
    local db = assert(tally.open("file:" .. path))
    for _, n in ipairs({ "a", "b" }) do
      local c = db:counter(n, { policy = "key", shards = 2 })
      assert(c:incr((1 << 62) - 1, "x"))
      assert(c:incr((1 << 62) - 1, "y"))
    end
    db:close()
    t = tty.open(q(tty.bin()) .. " watch " .. q(path) .. " --interval 0.2")
    local s = frame(t, "2 counters")
    assert.matches("2 counters  total beyond int64  ", s, 1, true)
    t:keys("q")
    t:wait("%[exit 0%]")
  end)

  it("changes the sort with s, v, n and r", function()
    local path = store_with({ b = 2, a = 1, c = 30 })
    t = tty.open(q(tty.bin()) .. " watch " .. q(path) .. " --sort name")
    frame(t, "\nc%s+30 ")
    assert.same({ "a", "b", "c" }, order(t:screen(), { "a", "b", "c" }))
    t:keys("v")
    local s = t:wait("sort: value")
    assert.same({ "c", "b", "a" }, order(s, { "a", "b", "c" }))
    t:keys("n")
    s = t:wait("sort: name")
    assert.same({ "a", "b", "c" }, order(s, { "a", "b", "c" }))
    t:keys("s")
    t:wait("sort: rate")
    t:keys("+")
    t:wait("every 2s")
    t:keys("-", "-")
    t:wait("every 0%.5s")
  end)

  it("ranks counters of equal value by name, bytewise, past their first 8 bytes", function()
    -- watch compares the names' first 8 bytes as one number, then the rest
    local want = { "a:long:name", "post:1", "post:100", "post:1000", "post:10000:likes",
                   "post:1000:like", "post:1000:likes", "post:1000:likes2", "post:1001",
                   "post:99" }
    local values = {}
    for _, n in ipairs(want) do values[n] = 7 end
    local path = store_with(values)
    t = tty.open(q(tty.bin()) .. " watch " .. q(path) .. " --sort value")
    local s = frame(t, "\npost:99%s+7 ")
    assert.same(want, order(s, want))
    t:keys("r")                                  -- by rate: none has one, all tie
    s = frame(t, "sort: rate")
    assert.same(want, order(s, want))
  end)

  it("shows the rollup history as a sparkline", function()
    local path = helper.tmpfile()
    local db = assert(tally.open("file:" .. path))
    db:rollup("*", { every = 1, keep = { "60x1s" } })
    local now = math.floor(tally.now())
    for i = 1, 12 do                    -- 12 rollups, one a second, ending now
      db:incr("hits", i * i)
      db:tick(now - 12 + i)
    end
    db:close()
    t = tty.open(q(tty.bin()) .. " watch " .. q(path))
    local s = frame(t, "\nhits ")
    local spark = s:match("\nhits%s+%d+%s+%S+%s+(%S+)")
    assert.truthy(spark, s)
    -- the rate grows with every bucket: the line climbs from low to full
    assert.matches("█$", spark)
    assert.truthy(utf8.len(spark) >= 10, spark)
    t:keys("C-c")                       -- Ctrl-C is a key here: it quits, as interrupted
    t:wait("%[exit 130%]")
  end)

  it("shows histograms grouped, each row from one consistent cut", function()
    local path = helper.tmpfile()
    local db = assert(tally.open("file:" .. path))
    db:incr("plain", 7)
    local h = assert(db:histogram("lat", { buckets = { 0.01, 0.1, 1 } }))
    for _, e in ipairs({ { 50, 0.005 }, { 40, 0.05 }, { 9, 0.5 }, { 1, 5 } }) do
      for _ = 1, e[1] do assert(h:observe(e[2])) end
    end
    assert(assert(db:histogram("busy")):observe(0.002))
    db:close()
    -- HISTOGRAM  COUNT  RATE/S  SUM  MEAN  P50<=  P90<=  P99<= of one row
    local function hrow(screen, name)
      for line in screen:gmatch("[^\n]+") do
        local c = { line:match("^" .. name .. "%s+(%d+)%s+(%S+)%s+(%S+)%s+(%S+)%s+(%S+)%s+(%S+)%s+(%S+)%s*$") }
        if c[1] then return c end
      end
    end
    -- refreshes far enough apart that two captures often fall between them
    t = tty.open(q(tty.bin()) .. " watch " .. q(path) .. " --interval 0.5 --sort name")
    local s = frame(t, "\nlat ")
    assert.matches("  1 counter  total 7  2 histograms  file:/", s)
    assert.matches("\nplain%s+7 ", s)
    assert.not_matches("{le=", s)                -- the members are not counter rows
    assert.not_matches("{sum,", s)
    assert.matches("\n\nHISTOGRAM%s+COUNT%s+RATE/S%s+SUM%s+MEAN%s+P50<=%s+P90<=%s+P99<=\n", s)
    local c = hrow(s, "lat")
    assert.truthy(c, s)
    -- count 100, sum 0.25 + 2 + 4.5 + 5; rank 50 is in le=0.01, 90 in 0.1, 99 in 1
    assert.same({ "100", "11.75", "0.1175", "0.01", "0.1", "1" }, { c[1], c[3], c[4], c[5], c[6], c[7] })
    assert.truthy(c[2] == "-" or c[2] == "0", c[2])
    -- another process observes 0.002 (2000 units of 1e-6) as fast as it can,
    -- until told to stop (40 s at most): on every screen, busy's sum is
    -- exactly 0.002 x its count
    local stop = helper.tmpfile("stop")
    local writer = helper.spawn("-e", ("local db = tally.open(%q) local h = assert(db:histogram('busy')) "
      .. "local t0 = tally.now() while tally.now() - t0 < 40 and not io.open(%q) do "
      .. "for _ = 1, 100 do assert(h:observe(0.002)) end end"):format("file:" .. path, stop))
    local counts, moving = {}, 0
    local ok, err = pcall(t.wait, t, function(x)
      local b = hrow(x, "busy")
      -- a whole screen: the same in a second capture (not one caught mid-draw)
      if not b or counts[b[1]] or t:screen() ~= x then return false end
      local n = tonumber(b[1])
      counts[b[1]] = true
      assert.equal(n * 2000, math.floor(tonumber(b[3]) * 1e6 + 0.5),
                   "count " .. b[1] .. " and sum " .. b[3] .. " disagree:\n" .. x)
      assert.equal("0.002", b[4], x)
      if n > 1 and tonumber(b[2]) and tonumber(b[2]) > 0 then moving = moving + 1 end
      return moving >= 4
    end, 30)
    helper.write(stop, "")                       -- the writer stops, whatever happened
    writer:close()
    if not ok then error(err, 0) end
    t:keys("q")
    t:wait("%[exit 0%]")
    t:close()
    -- only histograms match: their header takes the counters' place
    t = tty.open(q(tty.bin()) .. " watch " .. q(path) .. " 'lat*'")
    s = frame(t, "\nlat ")
    assert.matches("  0 counters  total 0  1 histogram  file:/", s)
    assert.matches("^[^\n]+\nHISTOGRAM%s+COUNT", s)
    assert.same("100", hrow(s, "lat")[1])
  end)

  it("shows a histogram family's histograms by their names", function()
    local path = helper.tmpfile()
    local db = assert(tally.open("file:" .. path))
    db:family("lat:*", { histogram = { buckets = { 0.1, 1 } }, metric = "latency_seconds",
                         labels = { "route" } })
    for _ = 1, 3 do assert(assert(db:histogram("lat:/api")):observe(0.05)) end
    assert(assert(db:histogram("lat:/")):observe(0.5))
    db:close()
    t = tty.open(q(tty.bin()) .. " watch " .. q(path) .. " 'lat:*' --sort name")
    local s = frame(t, "\nlat:/api ")
    assert.matches("  0 counters  total 0  2 histograms  file:/", s)
    assert.matches("\nlat:/%s+1%s+%S+%s+0.5%s+0.5%s+1%s+1%s+1%s*\n", s)
    assert.matches("\nlat:/api%s+3%s+%S+%s+0.15%s+0.05%s+0.1%s+0.1%s+0.1%s*\n", s)
    assert.not_matches("{le=", s)
    t:keys("q")
    t:wait("%[exit 0%]")
  end)

  it("shows the right rows of a large store, holding only those", function()
    -- 100,000 counters of distinct values: each refresh walks them all but
    -- keeps only the rows on screen (the whole store once took ~1 KB a
    -- counter: a Lua table each, the list of names, a row each)
    local N = 100000
    local path = helper.tmpfile()
    local db = assert(tally.open("file:" .. path))
    local all, total = {}, 0
    for i = 1, N do
      local name, v = ("c:%06d"):format(i), (i * 7919) % 100003   -- distinct: 100003 is prime
      assert(db:incr(name, v))
      all[i], total = { name = name, v = v }, total + v
    end
    db:close()
    table.sort(all, function(a, b) return a.v > b.v end)
    local pidfile = helper.tmpfile("pid")
    t = tty.open("sh -c 'echo $$ > " .. pidfile .. "; exec " .. q(tty.bin()) .. " watch "
                 .. q(path) .. " --sort value --interval 0.2'")
    -- the rows of the screen, names in order
    local function names(screen)
      local out = {}
      for name in screen:gmatch("\n(c:%d+)%s") do out[#out + 1] = name end
      return out
    end
    local function want(from, to, key)
      local out = {}
      for i = from, to do out[#out + 1] = all[i][key] end
      return out
    end
    local s = frame(t, "\nc:%d+%s")
    assert.matches("sort: value  every 0%.2s  100000 counters  total " .. total .. "  ", s)
    assert.same(want(1, 37, "name"), names(s))   -- 40 lines: the header, 37 rows, the footer
    assert.matches("rows 1%-37 of 100000$", s)
    -- a few refreshes later (rates between them now): the same rows, and
    -- memory for the rows on screen, not for every counter
    s = t:wait(function(x) return x:find("\nc:%d+%s+%d+%s+0 ") and x:find("rows 1%-37") end)
    assert.same(want(1, 37, "name"), names(s))
    if not os.getenv("LD_PRELOAD") then        -- (a sanitizer's runtime holds its own)
      local f = assert(io.open(pidfile))
      local pid = math.tointeger(f:read("n"))
      f:close()
      local status = assert(io.open("/proc/" .. pid .. "/status")):read("a")
      local kb = tonumber(status:match("RssAnon:%s*(%d+) kB"))
      assert.truthy(kb < 48 * 1024, "resident (anonymous): " .. kb .. " kB")
    end
    -- by name; then the last rows (End), read for that screen only
    t:keys("n")
    s = frame(t, "sort: name")
    for i = 1, N do all[i].name = ("c:%06d"):format(i) end
    assert.same(want(1, 37, "name"), names(s))
    t:keys("End")
    s = frame(t, "rows 99964%-100000 of 100000")
    assert.same(want(99964, 100000, "name"), names(s))
    t:keys("PageUp")
    s = frame(t, "rows 99928%-99964 of 100000")
    assert.same(want(99928, 99964, "name"), names(s))
    t:keys("q")
    t:wait("%[exit 0%]")
  end)

  it("lists names of a member's form that are in no histogram as counters", function()
    -- odd{le=1} has no +Inf bucket and no sum: a counter, ranked with the rest
    local path = store_with({ ["odd{le=1}"] = 5, plain = 7, ["z{sum,unit=0.001}"] = 9 })
    t = tty.open(q(tty.bin()) .. " watch " .. q(path) .. " --sort value --interval 0.2")
    local s = frame(t, "\nplain%s+7 ")
    assert.matches("  3 counters  total 21  file:/", s)
    assert.same({ "z{sum,unit=0.001}", "plain", "odd{le=1}" },
                order(s, { "odd{le=1}", "plain", "z{sum,unit=0.001}" }))
    t:keys("n")
    s = frame(t, "sort: name")
    assert.same({ "odd{le=1}", "plain", "z{sum,unit=0.001}" },
                order(s, { "odd{le=1}", "plain", "z{sum,unit=0.001}" }))
    t:keys("q")
    t:wait("%[exit 0%]")
  end)

  it("restores the terminal when it quits", function()
    local path = store_with({ x = 1 })
    local before, after = helper.tmpfile("stty1"), helper.tmpfile("stty2")
    t = tty.open("stty -g > " .. q(before) .. "; " .. q(tty.bin()) .. " watch " .. q(path)
                 .. "; stty -g > " .. q(after) .. "; echo done")
    frame(t, "\nx%s+1 ")
    t:keys("q")
    local s = t:wait("done\n%[exit 0%]$")
    assert.not_matches("tally watch", s)     -- the normal screen is back
    local f1, f2 = assert(io.open(before)), assert(io.open(after))
    assert.equal(f1:read("a"), f2:read("a"))
    f1:close(); f2:close()
  end)

  it("gives back the signals it caught without losing one that came meanwhile", function()
    -- SIGTERM comes while tally.term holds it blocked; restore() must put
    -- the old action (here the default: die) back before unblocking it
    local out, code = helper.sh(q(tty.bin()) .. " -e " .. q("local term = require 'tally.term' "
      .. "assert(term.raw()) os.execute('kill -TERM $PPID') term.restore() print('survived')")
      .. " < /dev/null")
    assert.equal(143, code, out)           -- killed by it (the shell may say "Terminated")
    assert.not_matches("survived", out)
  end)

  it("stops on SIGTERM, restoring the terminal", function()
    local path = store_with({ x = 1 })
    local before, after = helper.tmpfile("stty1"), helper.tmpfile("stty2")
    local pidfile = helper.tmpfile("pid")
    t = tty.open("stty -g > " .. q(before) .. "; sh -c 'echo $$ > " .. pidfile .. "; exec "
                 .. q(tty.bin()) .. " watch " .. q(path) .. "'; st=$?; stty -g > " .. q(after)
                 .. "; echo status=$st")
    frame(t, "\nx%s+1 ")
    local f = assert(io.open(pidfile))
    local pid = f:read("n")
    f:close()
    os.execute("kill -TERM " .. math.tointeger(pid))
    t:wait("status=143")
    local f1, f2 = assert(io.open(before)), assert(io.open(after))
    assert.equal(f1:read("a"), f2:read("a"))
    f1:close(); f2:close()
  end)
end)

describe("progress bars", function()
  local t
  after_each(function() if t then t:close(); t = nil end end)

  it("follow a large import on a terminal, and leave no trace when done", function()
    local src = helper.tmpfile()
    local db = assert(tally.open("file:" .. src))
    -- 16 shards each: an export large enough that every phase shows a bar
    for i = 1, 5000 do db:counter("c:" .. i, { shards = 16 }):incr(i) end
    local text = assert(db:export())
    db:close()
    -- export's own layout streams (check, apply); another layout (a space
    -- after the first key) is held whole (parse, check, create, apply)
    local json = helper.tmpfile("export.json")
    helper.write(json, text)
    local spaced = helper.tmpfile("spaced.json")
    helper.write(spaced, (text:gsub('^{"counters":{', '{"counters": {')))
    local dst = helper.tmpfile()
    t = tty.open("sh")
    local rec = t:record()
    t:line(q(tty.bin()) .. " import " .. q(dst) .. " " .. q(json) .. " --create")
    t:wait("imported 5000 counters into ")
    os.remove(dst)
    t:line("clear; " .. q(tty.bin()) .. " import " .. q(dst) .. " " .. q(spaced) .. " --create")
    local s = t:wait("imported 5000 counters into ")
    assert.not_matches("import: ", s)        -- the bar is gone from the screen
    local raw = t:recorded(rec, "imported 5000 counters.*imported 5000 counters")
    local first = raw:find("imported 5000 counters", 1, true)
    local streamed, whole = raw:sub(1, first), raw:sub(first)
    for _, phase in ipairs({ "check", "apply" }) do
      assert.matches("import: " .. phase .. " ", streamed)
    end
    assert.not_matches("import: parse ", streamed)
    for _, phase in ipairs({ "parse", "check", "create", "apply" }) do
      assert.matches("import: " .. phase .. " ", whole)
    end
    assert.matches("%[#+%] 100%%  5000 / 5000 counters", streamed)
    assert.matches("%[#+%] 100%%  5000 / 5000 counters", whole)
    -- not on a terminal: nothing but the result
    local out, code = helper.sh(q(helper.bin) .. " import " .. q(dst) .. " " .. q(json)
                                .. " 2>&1 | cat")
    assert.equal(0, code)
    assert.equal("imported 5000 counters into " .. dst .. " (replaced)\n", out)
  end)
end)
