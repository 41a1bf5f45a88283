-- The tally executable without a terminal: scripts, -e, run, the prompt on
-- stdin, the inspection commands (through their output and exit status),
-- help and usage errors; and the likes demo. The prompt and watch on a
-- terminal are in repl_spec.lua and watch_spec.lua.
local helper = require "spec.support.helper"
local tally = require "tally"

local q = helper.q

-- Run tally with stdout and stderr apart: out, err, exit code.
local function run(...)
  return helper.tally_split(nil, ...)
end

local function exists(path)
  local f = io.open(path)
  if f then f:close() end
  return f ~= nil
end

local function slurp(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("a")
  f:close()
  return s
end

describe("the tally command", function()
  it("runs a script with arg and ... set as lua5.4 sets them", function()
    local script = helper.tmpfile("args.lua")
    helper.write(script, [[
      local t = require "tally"
      print(arg[0] == ... and "?" or arg[0]:match("[^/]+$"), arg[1], arg[2], select("#", ...), ...)
      print(type(arg[-1]), t.version, package.preload["tally.core"] ~= nil)
    ]])
    local out, code = helper.tally(script, "a b", "c")
    assert.equal(0, code)
    assert.equal(script:match("[^/]+$") .. "\ta b\tc\t2\ta b\tc\n"
                 .. "string\t" .. tally.version .. "\ttrue\n", out)
  end)

  it("runs a script through 'run', even one named like a command", function()
    local dir = helper.tmpfile("dir")
    os.execute("mkdir -p " .. q(dir))
    helper.write(dir .. "/ls", "print('the script ls', arg[0], ...)\n")
    local out, code = helper.sh("cd " .. q(dir) .. " && " .. q(helper.bin) .. " run ls x y")
    assert.equal(0, code, out)
    assert.equal("the script ls\tls\tx\ty\n", out)
    out, code = helper.sh("cd " .. q(dir) .. " && " .. q(helper.bin) .. " ./ls z")
    assert.equal(0, code, out)
    assert.equal("the script ls\t./ls\tz\n", out)
    out, code = helper.sh("cd " .. q(dir) .. " && " .. q(helper.bin) .. " ls")  -- the command
    assert.equal(2, code)
    assert.matches("^tally ls: a store is needed\nusage: tally ls STORE", out)
    local err
    out, err, code = run("run")
    assert.equal(2, code)
    assert.matches("^tally run: a script is needed\nusage: tally run ", err)
  end)

  it("runs -e chunks with the module as the global 'tally'", function()
    local out, code = helper.tally("-e", "print(tally.version)", "-e", "print(type(tally.open))")
    assert.equal(0, code)
    assert.equal(tally.version .. "\nfunction\n", out)
  end)

  it("opens --store as the global db for -e and scripts; never creates it without --create", function()
    local path = helper.tmpfile()
    local out, err, code = run("--store", path, "-e", "print(db)")
    assert.equal(1, code)
    assert.equal("tally: no store at " .. path .. " (no such file; --create makes one)\n", err)
    assert.is_false(exists(path))
    out, err, code = run("--store", path, "--create", "-e", "db:incr('a', 2) print(db:value('a'))")
    assert.equal(0, code, err)
    assert.equal("2\n", out)
    out, err, code = run("--store=file:" .. path, "-e", "print(db:value('a'))")
    assert.equal(0, code, err)
    assert.equal("2\n", out)
  end)

  it("prints 'tally: message' and a traceback, and exits 1, on an error", function()
    local script = helper.tmpfile("fails.lua")
    helper.write(script, "local function f() error('it broke') end\nf()\n")
    local out, code = helper.tally(script)
    assert.equal(1, code)
    assert.matches("^tally: [^\n]*fails%.lua:1: it broke\nstack traceback:\n", out)
  end)

  it("reports a script that does not load", function()
    local out, code = helper.tally(helper.tmpfile("missing.lua"))
    assert.equal(1, code)
    assert.matches("^tally: cannot open ", out)
    out, code = helper.tally("-e", "x = = 1")
    assert.equal(1, code)
    assert.matches("^tally: %(command line%):1: unexpected symbol", out)
  end)

  it("passes os.exit statuses through", function()
    local _, code = helper.tally("-e", "os.exit(3)")
    assert.equal(3, code)
  end)

  it("runs a prompt on stdin when given no script: no prompts, values printed", function()
    local input = helper.tmpfile("input.txt")
    helper.write(input, table.concat({
      "1 + 1",
      "db:incr('x', 5)",
      "db:value('x'), 'two'",
      "error('oops')",
      "for i = 1, 2 do",
      "  print('line', i)",
      "end",
      "db",
      "{ b = { 1, 'two' }, a = true }",
      "=#'four'",
      "",
    }, "\n"))
    local out, code = helper.sh(q(helper.bin) .. " < " .. q(input))
    assert.equal(0, code)
    assert.matches("^2\ntrue\n5\ttwo\ntally: stdin:1: oops\nstack traceback:\n.-\n"
                   .. "line\t1\nline\t2\ntally%.store %(memory%): 1 counter\n  x  5\n"
                   .. '{ a = true, b = { 1, "two" } }\n4\n$', out)
    out, code = helper.sh("echo 'print(1)' | " .. q(helper.bin))
    assert.equal(0, code)
    assert.equal("1\n", out)
  end)

  it("reports a statement left unfinished at the end of stdin, as lua5.4 would", function()
    local out, code = helper.sh("printf 'print(0)\\nfor i=1,3 do\\nprint(i)\\n' | " .. q(helper.bin))
    assert.equal(0, code, out)      -- as for every error in piped input: the status is 0
    assert.equal("0\ntally: stdin:2: 'end' expected (to close 'for' at line 1) near <eof>\n", out)
    out, code = helper.sh("printf 'x = { 1,\\n2' | " .. q(helper.bin))   -- an expression, no last newline
    assert.equal(0, code, out)
    assert.equal("tally: stdin:2: '}' expected (to close '{' at line 1) near <eof>\n", out)
    out, code = helper.sh("printf '=f(1,' | " .. q(helper.bin))
    assert.equal("tally: stdin:1: unexpected symbol near <eof>\n", out)
    -- a whole chunk followed by nothing unfinished says nothing more
    out, code = helper.sh("printf 'for i=1,2 do\\nprint(i)\\nend\\n\\n' | " .. q(helper.bin))
    assert.equal(0, code, out)
    assert.equal("1\n2\n", out)
  end)

  it("shows its version with -v", function()
    local out, code = helper.tally("-v")
    assert.equal(0, code)
    local want = "tally " .. tally.version .. " (" .. _VERSION .. "."
    assert.equal(want, out:sub(1, #want))
  end)

  it("exits 1 and says so when its output cannot be written", function()
    local store = helper.tmpfile("full.tly")
    assert.equal(0, select(2, helper.tally("incr", store, "x", "--create")))
    for _, args in ipairs({ { "export", store }, { "ls", store }, { "-v" } }) do
      local words = { q(helper.bin) }
      for i, a in ipairs(args) do words[i + 1] = q(a) end
      local cmd = "{ " .. table.concat(words, " ") .. " > /dev/full; }"
      local out, code = helper.sh(cmd)
      assert.equal(1, code, cmd)
      assert.matches("tally: cannot write to standard output", out, 1, true)
    end
  end)

  it("has --help, help COMMAND and COMMAND --help", function()
    local out, err, code = run("--help")
    assert.equal(0, code, err)
    assert.matches("^usage: tally %[options%] %[script %[args%.%.%.%]%]\n", out)
    for _, c in ipairs({ "ls", "get", "incr", "export", "import", "info", "compact", "watch",
                         "help" }) do
      assert.matches("\n  " .. c .. " ", out)
      local a = run("help", c)
      local b, _, bcode = run(c, "--help")
      assert.equal(0, bcode)
      assert.matches("^usage: tally " .. c .. " ", a)
      assert.equal(a, b)
    end
    out, err, code = run("-h")
    assert.equal(0, code)
    assert.matches("^usage: tally ", out)
    out, err, code = run("run", "--help")
    assert.equal(0, code, err)
    assert.matches("^usage: tally run ", out)
    out, err, code = run("help", "nope")
    assert.equal(2, code)
    assert.matches("^tally help: no command 'nope'", err)
  end)

  it("says so, with status 2, for an unknown command or option", function()
    local out, err, code = run("lss", "x")
    assert.equal(2, code)
    assert.equal("", out)
    assert.equal("tally: 'lss' is neither a command nor a script file (did you mean 'ls'?)\n"
                 .. "Run 'tally help' for the commands.\n", err)
    out, err, code = run("--bogus")
    assert.equal(2, code)
    assert.equal("tally: unrecognized option '--bogus' (see 'tally --help')\n", err)
    for _, a in ipairs({ "--store", "--store=" }) do
      out, err, code = run(a)
      assert.equal(2, code)
      assert.equal("tally: " .. a .. " needs a store (file:PATH or a path) (see 'tally --help')\n", err)
    end
    out, err, code = run("ls", helper.tmpfile(), "--jsno")
    assert.equal(2, code)
    assert.equal("tally ls: unknown option '--jsno'\nusage: tally ls STORE [pattern] [--json]"
                 .. "   ('tally help ls' for more)\n", err)
    out, err, code = run("get", helper.tmpfile())
    assert.equal(2, code)
    assert.matches("^tally get: missing counter name\n", err)
    out, err, code = run("get", "a", "b", "c")
    assert.equal(2, code)
    assert.matches("^tally get: unexpected argument 'c'\n", err)
    out, err, code = run("incr", helper.tmpfile(), "x", "1.5")
    assert.equal(2, code)
    assert.matches("^tally incr: n must be an integer from %-9223372036854775808 to 9223372036854775807, got '1%.5'\n", err)
    out, err, code = run("watch", helper.tmpfile(), "--interval", "0")
    assert.equal(2, code)
    assert.matches("^tally watch: %-%-interval must be seconds from 0%.1 to 3600, got '0'\n", err)
  end)
end)

describe("tally inspection commands", function()
  local path

  before_each(function()
    path = helper.tmpfile()
    local db = assert(tally.open("file:" .. path))
    db:counter("post:1:likes", { shards = 4 }):add_shard(2, 7)
    db:counter("post:2:likes", { shards = 2, policy = "random" }):add_shard(1, 9007199254740993)
    db:incr("views", 3)
    db:close()
  end)

  it("never create a missing store, and say so", function()
    local missing = helper.tmpfile()
    for _, cmd in ipairs({ { "ls" }, { "get", "x" }, { "export" }, { "info" }, { "watch" },
                           { "incr", "x" } }) do
      local out, err, code = run(cmd[1], missing, table.unpack(cmd, 2))
      assert.equal(1, code, cmd[1])
      assert.equal("", out)
      assert.matches("^tally " .. cmd[1] .. ": no store at " .. missing:gsub("%p", "%%%0"), err)
      assert.is_false(exists(missing), cmd[1])
    end
    local junk = helper.tmpfile("junk")
    helper.write(junk, "not a store at all")
    local _, err, code = run("ls", junk)
    assert.equal(1, code)
    assert.equal("tally ls: " .. junk .. ": not a tally store (bad magic)\n", err)
    _, err, code = run("ls", "memory")
    assert.equal(1, code)
    assert.matches("^tally ls: 'memory' is a store of one process", err)
  end)

  it("say that a store they cannot write cannot be read either, and why", function()
    -- opening a store takes its lock, so even reading needs write permission
    os.execute("chmod 0444 " .. q(path))
    local as = ""                        -- root writes anything: be nobody then
    if helper.is_root() then
      if not os.execute("command -v setpriv >/dev/null 2>&1") then
        pending("running as root without setpriv (util-linux) to be another user")
        return
      end
      as = "setpriv --reuid=65534 --regid=65534 --clear-groups "
    end
    for _, c in ipairs({ { "ls" }, { "get", "views" }, { "info" }, { "export" }, { "watch" } }) do
      local out, code = helper.sh(as .. q(helper.bin) .. " " .. c[1] .. " " .. q(path) .. " "
                                  .. table.concat(c, " ", 2) .. " </dev/null")
      assert.equal(1, code, c[1])
      assert.equal("tally " .. c[1] .. ": " .. path .. ": cannot open: Permission denied (the "
                   .. "store must be writable by this user: it takes the store's lock even to "
                   .. "read; see 'tally help " .. c[1] .. "')\n", out)
    end
    local out, code = helper.sh(as .. q(helper.bin) .. " incr " .. q(path) .. " views")
    assert.equal(1, code)
    assert.equal("tally incr: " .. path .. ": cannot open: Permission denied (the store must be "
                 .. "writable by this user)\n", out)
    out, code = helper.sh(as .. q(helper.bin) .. " --store " .. q(path) .. " -e 'print(1)'")
    assert.equal(1, code)
    assert.equal("tally: " .. path .. ": cannot open: Permission denied (the store must be "
                 .. "writable by this user: it takes the store's lock even to read)\n", out)
    local help = run("help", "ls")
    assert.matches("even to read", help)
  end)

  it("ls: an aligned table, sorted by name, with a pattern", function()
    local out, err, code = run("ls", path)
    assert.equal(0, code, err)
    assert.equal(
      "NAME                     VALUE  SHARDS  POLICY  ROLLED AT            RATE/S\n" ..
      "post:1:likes                 7       4  thread  -                         -\n" ..
      "post:2:likes  9007199254740993       2  random  -                         -\n" ..
      "views                        3  1 auto  thread  -                         -\n", out)
    out, err, code = run("ls", "file:" .. path, "post:*")
    assert.equal(0, code, err)
    assert.equal(3, select(2, out:gsub("\n", "")))
    out, err, code = run("ls", path, "nothing*")
    assert.equal(0, code)
    assert.equal("", out)
    assert.equal("tally ls: no counter matches 'nothing*'\n", err)
  end)

  it("ls streams: 200,000 counters in order, in memory for a batch, not for all", function()
    local big, script = helper.tmpfile(), helper.tmpfile("make.lua")
    helper.write(script, ([[
      local db = assert(require("tally").open("file:" .. %q))
      for i = 1, 200000 do assert(db:incr("post:" .. i .. ":likes", i %% 1000)) end
      local c = db:counter("post:0:big", { shards = 4, policy = "round_robin" })
      for _ = 1, 4 do assert(c:incr(1 << 61)) end  -- beyond int64: read again by handle
      db:close()
    ]]):format(big))
    local out, code = helper.sh(helper.q(helper.bin) .. " " .. helper.q(script))
    assert.equal(0, code, out)
    -- the peak of the command's own (anonymous) memory, the mapped store
    -- aside: polled every 5 ms, since a listing that held every name
    -- holds them to the end
    local listing = helper.tmpfile("ls.out")
    out, code = helper.sh(("%s ls %s > %s & pid=$!; peak=0; "
      .. "while kill -0 $pid 2>/dev/null; do "
      .. "a=$(awk '/^RssAnon/{print $2}' /proc/$pid/status 2>/dev/null); "
      .. "[ -n \"$a\" ] && [ \"$a\" -gt \"$peak\" ] && peak=$a; sleep 0.005; done; "
      .. "wait $pid; echo \"exit $? peak $peak\""):format(helper.q(helper.bin), helper.q(big),
                                                       helper.q(listing)))
    local status, peak = out:match("exit (%d+) peak (%d+)")
    assert.equal("0", status, out)
    local lines, prev, n = {}, nil, 0
    for line in io.lines(listing) do
      n = n + 1
      if n > 1 then
        local name = line:match("^(%S+)")
        assert.is_true(prev == nil or prev < name, "not in order: " .. tostring(prev) .. ", " .. name)
        prev = name
        if name == "post:0:big" or name == "post:1000:likes" then lines[name] = line end
      end
    end
    assert.equal(200002, n)
    assert.matches("^post:0:big%s+9223372036854775808%s+4%s", lines["post:0:big"])
    assert.matches("^post:1000:likes%s+0%s+1 auto", lines["post:1000:likes"])
    if not os.getenv("LD_PRELOAD") then  -- a sanitizer's runtime keeps freed memory
      -- a listing that holds every name and row took 39 MB here; one
      -- batch at a time, and 8-byte keys to sort, about 10
      assert.is_true(tonumber(peak) < 20000, "peak anonymous memory " .. peak .. " kB")
    end
  end)

  it("ls: a sum beyond int64 exactly, a function policy by that name, a rate's decimals", function()
    local p = helper.tmpfile()
    local db = assert(tally.open("file:" .. p))
    local big = db:counter("big", { shards = 4, policy = "thread" })
    for i = 1, 3 do assert(big:add_shard(i, (1 << 62) - 1)) end   -- 3 * (2^62 - 1)
    db:counter("fn", { shards = 2, policy = function() return 2 end }):incr(5)
    db:rollup("slow", { every = 10 })
    db:incr("slow", 1)
    db:tick(1700000000)
    db:incr("slow", 3)
    db:tick(1700000010)
    db:close()
    local out, err, code = run("ls", p)
    assert.equal(0, code, err)
    local when = os.date("%Y-%m-%d %H:%M:%S", 1700000010)
    assert.equal("NAME                 VALUE  SHARDS  POLICY    ROLLED AT            RATE/S\n"
                 .. "big   13835058055282163709       4  thread    -                         -\n"
                 .. "fn                       5       2  function  -                         -\n"
                 .. "slow                     4  1 auto  thread    " .. when .. "    0.30\n", out)
  end)

  it("ls: the last rollup's time and rate", function()
    local db = assert(tally.open("file:" .. path))
    db:rollup("views", { every = 10 })
    db:tick(1700000000)
    db:incr("views", 20)
    db:tick(1700000010)
    db:close()
    local out, err, code = run("ls", path, "views")
    assert.equal(0, code, err)
    local when = os.date("%Y-%m-%d %H:%M:%S", 1700000010)
    assert.equal("NAME   VALUE  SHARDS  POLICY  ROLLED AT            RATE/S\n"
                 .. "views     23  1 auto  thread  " .. when .. "       2\n", out)
    out = run("ls", path, "views", "--json")
    assert.equal('[\n{"name":"views","value":23,"shards":1,"auto":true,"grown":0,"shrunk":0,'
                 .. '"policy":"thread","rolled":'
                 .. '{"value":23,"at":1700000010.000,"delta":20,"rate":2,"count":2}}\n]\n', out)
  end)

  it("ls --json: exact integers, one counter per line", function()
    local out, err, code = run("ls", path, "--json")
    assert.equal(0, code, err)
    assert.equal('[\n'
      .. '{"name":"post:1:likes","value":7,"shards":4,"policy":"thread","rolled":null},\n'
      .. '{"name":"post:2:likes","value":9007199254740993,"shards":2,"policy":"random","rolled":null},\n'
      .. '{"name":"views","value":3,"shards":1,"auto":true,"grown":0,"shrunk":0,"policy":"thread",'
      .. '"rolled":null}\n]\n', out)
    local doc = require("cjson").decode(out)
    assert.equal(3, #doc)
    out = run("ls", path, "none", "--json")
    assert.equal("[]\n", out)
  end)

  it("ls --json, export and import: a name that is not UTF-8 goes as \\udcXX and comes back", function()
    local db = assert(tally.open("file:" .. path))
    db:incr("x\255", 2)
    db:incr("x\\udcff", 3)                              -- the text, not the byte
    db:close()
    local out, err, code = run("ls", path, "x*", "--json")
    assert.equal(0, code, err)
    local function obj(name, v)
      return '{"name":"' .. name .. '","value":' .. v .. ',"shards":1,"auto":true,"grown":0,"shrunk":0,'
             .. '"policy":"thread","rolled":null}'
    end
    assert.equal("[\n" .. obj("x\\\\udcff", 3) .. ",\n" .. obj("x\\udcff", 2) .. "\n]\n", out)
    assert.truthy(utf8.len(out))                          -- JSON text is UTF-8 (RFC 8259)
    local doc = assert(require("tally.json").decode(out))
    assert.same({ "x\\udcff", "x\255" }, { doc[1].name, doc[2].name })
    -- export, then import into a new store: the same names, bytes and values
    out, err, code = run("export", path)
    assert.equal(0, code, err)
    assert.truthy(utf8.len(out))
    local json = helper.tmpfile("export.json")
    helper.write(json, out)
    local copy = helper.tmpfile()
    out, err, code = run("import", copy, json, "--create")
    assert.equal(0, code, err)
    assert.equal("imported 5 counters into " .. copy .. " (replaced)\n", out)
    db = assert(tally.open("file:" .. copy))
    assert.same({ "post:1:likes", "post:2:likes", "views", "x\\udcff", "x\255" }, db:names())
    assert.equal(2, db:value("x\255"))
    assert.equal(3, db:value("x\\udcff"))
    db:close()
    assert.equal(slurp(json), (run("export", copy)))
  end)

  it("get: the exact value, or each shard", function()
    local out, err, code = run("get", path, "post:2:likes")
    assert.equal(0, code, err)
    assert.equal("9007199254740993\n", out)
    out = run("get", path, "post:1:likes", "--shards")
    assert.equal("0\n7\n0\n0\n", out)
    out, err, code = run("get", path, "nope")
    assert.equal(1, code)
    assert.equal("", out)
    assert.equal("tally get: no such counter 'nope'\n", err)
    -- a name's control bytes and bytes that are not UTF-8 as \xNN, UTF-8 as it is
    out, err = run("get", path, "a\nb\27[1m\255")
    assert.equal("", out)
    assert.equal("tally get: no such counter 'a\\x0ab\\x1b[1m\\xff'\n", err)
    out, err = run("ls", path, "caf\195\169*")
    assert.equal("", out)
    assert.equal("tally ls: no counter matches 'caf\195\169*'\n", err)
  end)

  it("ls, get and their messages write a name's control bytes as \\xNN, never to the terminal", function()
    -- names often come from requests: one must not clear the screen,
    -- retitle the window or make a row of its own
    local db = assert(tally.open("file:" .. path))
    db:incr("evil\27]0;owned\7\27[2J", 1)
    db:incr("two\nviews  99", 2)
    db:incr("c1\194\155x", 3)                     -- U+009B, CSI to some terminals
    db:close()
    local out, err, code = run("ls", path)
    assert.equal(0, code, err)
    assert.equal(
      "NAME                                    VALUE  SHARDS  POLICY  ROLLED AT            RATE/S\n" ..
      "c1\\xc2\\x9bx                                 3  1 auto  thread  -                         -\n" ..
      "evil\\x1b]0;owned\\x07\\x1b[2J                 1  1 auto  thread  -                         -\n" ..
      "post:1:likes                                7       4  thread  -                         -\n" ..
      "post:2:likes                 9007199254740993       2  random  -                         -\n" ..
      "two\\x0aviews  99                            2  1 auto  thread  -                         -\n" ..
      "views                                       3  1 auto  thread  -                         -\n", out)
    out, err, code = run("get", path, "no\27[31mpe")
    assert.equal(1, code)
    assert.equal("tally get: no such counter 'no\\x1b[31mpe'\n", err)
    out, err, code = run("incr", path, "x\27[31m", "9223372036854775807")
    assert.equal(1, code)
    assert.equal("tally incr: counter 'x\\x1b[31m': adding 9223372036854775807 would overflow a shard "
                 .. "(shards hold -2^62 to 2^62-1)\n", err)
  end)

  it("incr: adds 1 or n (negative too), creating the counter, and prints the value", function()
    assert.equal("4\n", (run("incr", path, "views")))
    assert.equal("14\n", (run("incr", path, "views", "10")))
    assert.equal("9\n", (run("incr", path, "views", "-5")))
    assert.equal("1\n", (run("incr", path, "fresh")))
    local db = assert(tally.open("file:" .. path))
    assert.equal(9, db:value("views"))
    assert.equal(1, db:value("fresh"))
    db:close()
    db = assert(tally.open("file:" .. path))
    db:counter("by-user", { policy = "key" })
    db:close()
    local out, err, code = run("incr", path, "by-user", "2")
    assert.equal(1, code)
    assert.equal("tally incr: key expected for a counter with the key policy\n", err)
    assert.equal("2\n", (run("incr", path, "by-user", "2", "--key", "alice")))
    -- n is read exactly: out of int64's range, or not an integer, is a usage error
    for _, bad in ipairs({ "-9223372036854775809", "9223372036854775808",
                           "-99999999999999999999", "1.5", "1e3", "0x10", "ten", "" }) do
      out, err, code = run("incr", path, "views", bad)
      assert.equal(2, code, bad)
      assert.equal("", out)
      assert.matches("^tally incr: n must be an integer from %-9223372036854775808 to "
                     .. "9223372036854775807, got '" .. bad:gsub("%p", "%%%0") .. "'\n", err)
    end
    -- in range, it reaches the core exactly (which refuses what a shard cannot hold)
    out, err, code = run("incr", path, "views", "-9223372036854775808")
    assert.equal(1, code)
    assert.equal("tally incr: counter 'views': adding -9223372036854775808 would overflow a "
                 .. "shard (shards hold -2^62 to 2^62-1)\n", err)
    assert.equal("9\n", (run("incr", path, "views", "+0")))
    assert.equal("9\n", (run("incr", path, "views", "-000")))
    local made = helper.tmpfile()
    out, err, code = run("incr", made, "a", "--create")
    assert.equal(0, code, err)
    assert.equal("1\n", out)
    assert.is_true(exists(made))
  end)

  it("export and import: a round trip through files and stdin, replace and add", function()
    local json = helper.tmpfile("export.json")
    local out, err, code = run("export", path)
    assert.equal(0, code, err)
    local db = assert(tally.open("file:" .. path))
    assert.equal(db:export(), out)
    db:close()
    helper.write(json, out)
    local copy = helper.tmpfile()
    out, err, code = run("import", copy, json)
    assert.equal(1, code)
    assert.matches("^tally import: no store at .*; %-%-create makes one%)\n$", err)
    out, err, code = run("import", copy, json, "--create")
    assert.equal(0, code, err)
    assert.equal("imported 3 counters into " .. copy .. " (replaced)\n", out)
    assert.equal("", err)
    assert.equal(slurp(json), (run("export", copy)))
    -- from stdin, adding
    out, code = helper.sh(q(helper.bin) .. " import " .. q(copy) .. " - --add < " .. q(json))
    assert.equal(0, code, out)
    assert.equal("imported 3 counters into " .. copy .. " (added)\n", out)
    assert.equal("6\n", (run("get", copy, "views")))
    assert.equal("14\n", (run("get", copy, "post:1:likes")))
    -- a pattern
    out = run("export", copy, "views")
    assert.equal('{"counters":{\n"views":', out:sub(1, 22))
    out, err, code = run("export", copy, "nothing*")    -- nothing matches: an empty document
    assert.equal(0, code, err)
    assert.equal('{"counters":{}}\n', out)
  end)

  it("import: a bad document changes nothing and is reported without a traceback", function()
    local bad = helper.tmpfile("bad.json")
    helper.write(bad, '{"counters":{"views":{"num_shards":16,"shards":{"0":{"count":1.5}}}}}')
    local out, err, code = run("import", path, bad)
    assert.equal(1, code)
    assert.equal("", out)
    assert.equal("tally import: counter 'views': num_shards is 16 but 1 shards are given\n", err)
    helper.write(bad, "{ nope")
    out, err, code = run("import", path, bad)
    assert.equal(1, code)
    assert.matches("^tally import: malformed JSON: ", err)
    assert.not_matches("traceback", err)
    out, err, code = run("import", path, helper.tmpfile("missing.json"))
    assert.equal(1, code)
    assert.matches("^tally import: cannot read .*missing%.json: No such file or directory\n$", err)
    local dir = helper.tmpfile("dir")      -- opens, but reading fails: said so, not "malformed"
    os.execute("mkdir -p " .. q(dir))
    out, err, code = run("import", path, dir)
    assert.equal(1, code)
    assert.equal("", out)
    assert.equal("tally import: " .. dir .. ": Is a directory\n", err)
    -- what is not a JSON object is refused from its first bytes, so a
    -- stream that never ends fails at once instead of filling memory
    out, err, code = run("import", path, "/dev/zero")
    assert.equal(1, code)
    assert.equal("tally import: /dev/zero is not a tally export: it must be a JSON object ('{' "
                 .. "first), not byte 0x00\n", err)
    helper.write(bad, ' \n [{"counters":{}}]')
    out, err, code = run("import", path, bad)
    assert.equal(1, code)
    assert.equal("tally import: " .. bad .. " is not a tally export: it must be a JSON object ('{' "
                 .. "first), not '['\n", err)
    -- --create makes no store for a file that is not an export, from a
    -- path or from stdin
    local fresh = helper.tmpfile("fresh.tly")
    out, err, code = run("import", fresh, bad, "--create")
    assert.equal(1, code)
    assert.matches("is not a tally export", err)
    assert.is_nil(io.open(fresh))
    out, code = helper.sh(q(helper.bin) .. " import --create " .. q(fresh) .. " - < /dev/zero")
    assert.equal(1, code)
    assert.matches("stdin is not a tally export", out)
    assert.is_nil(io.open(fresh))
    -- nor for one with nothing in it but white space (here after more
    -- than the first piece a file is looked at)
    helper.write(bad, "")
    out, err, code = run("import", fresh, bad, "--create")
    assert.equal(1, code)
    assert.equal("tally import: " .. bad .. " is not a tally export: it is empty\n", err)
    assert.is_nil(io.open(fresh))
    helper.write(bad, (" \n"):rep(5000))
    out, err, code = run("import", fresh, bad, "--create")
    assert.equal(1, code)
    assert.equal("tally import: " .. bad .. " is not a tally export: it is empty but for white "
                 .. "space\n", err)
    assert.is_nil(io.open(fresh))
    out, code = helper.sh("printf ' \\n' | " .. q(helper.bin) .. " import --create " .. q(fresh)
                          .. " -")
    assert.equal(1, code)
    assert.equal("tally import: stdin is not a tally export: it is empty but for white space\n", out)
    assert.is_nil(io.open(fresh))
    -- a document that begins with more white space than a piece is read
    helper.write(bad, (" "):rep(5000) .. '{"counters":{}}')
    out, err, code = run("import", fresh, bad, "--create")
    assert.equal(0, code, err)
    assert.equal("imported 0 counters into " .. fresh .. " (replaced)\n", out)
    os.remove(fresh)
    -- one that looks like one ends at the limit (4 GiB; here 100,000 bytes)
    local cmd = "yes '{' | TALLY_IMPORT_MAX_BYTES=100000 timeout 60 " .. q(helper.bin)
                .. " import " .. q(path) .. " -"
    out, code = helper.sh(cmd)
    assert.equal(1, code)
    assert.equal("tally import: stdin is larger than 100000 bytes, the most tally import reads "
                 .. "(TALLY_IMPORT_MAX_BYTES): export and import the store in parts (tally export "
                 .. "STORE PATTERN)\n", out)
    out, code = helper.sh("TALLY_IMPORT_MAX_BYTES=1e9 " .. q(helper.bin) .. " import " .. q(path)
                          .. " " .. q(bad))
    assert.equal(2, code)
    assert.equal("tally import: TALLY_IMPORT_MAX_BYTES must be a count of bytes, got '1e9'\n", out)
    assert.equal("3\n", (run("get", path, "views")))
  end)

  it("import: a counter given twice is refused, named, before anything changes", function()
    -- two exports pasted into one document: one of the two values would be lost
    local before = run("export", path)
    local twice = helper.tmpfile("twice.json")
    helper.write(twice, '{"counters":{\n"views":{"num_shards":1,"shards":{"0":{"count":10}}},\n'
                        .. '"new":{"num_shards":1,"shards":{"0":{"count":1}}},\n'
                        .. '"views":{"num_shards":1,"shards":{"0":{"count":20}}}\n}}\n')
    for _, mode in ipairs({ "--create", "--add" }) do
      local out, err, code = run("import", path, twice, mode)
      assert.equal(1, code)
      assert.equal("", out)
      assert.equal("tally import: counter 'views' is given twice\n", err)
      assert.equal(before, (run("export", path)))
    end
  end)

  it("info: what an operator needs, as text and JSON", function()
    local out, err, code = run("info", path)
    assert.equal(0, code, err)
    assert.matches("^store      file:" .. path:gsub("%p", "%%%0") .. "\n", out)
    assert.matches("\nformat     9\n", out)
    assert.matches("\ncounters   3\n", out)
    assert.matches("\nfile size  [%d.]+ [KMG]?i?B %(%d+ bytes%)\n", out)
    assert.matches("\nused       [%d.]+ [KMG]?i?B; [%d.]+ [KMG]?i?B free inside the file\n", out)
    assert.matches("\ncan grow   by [%d.]+ GiB more %(limit 32%.0 GiB%); [%d.]+ [KMGT]?i?B free on the file system\n", out)
    assert.matches("\nlive       [%d.]+ [KMG]?i?B in use\n", out)
    assert.matches("\nretired    0 B ", out)
    assert.matches("\nreusable   0 B ", out)
    assert.matches("\nreused     0 B handed out again so far\n", out)
    assert.matches("\nexpired    0 counters expired for idleness\n", out)
    assert.matches("\ncapped     0 new names sent to an overflow counter\n", out)
    assert.matches("\nprocesses  no other process has the store open\n", out)
    assert.matches("\nwriters    1 thread ticket drawn\n", out)  -- this process's db:incr
    assert.matches("\nrollups    none\n$", out)
    out, err, code = run("info", path, "--json", "--check")
    assert.equal(0, code, err)
    local doc = require("cjson").decode(out)
    local db = assert(tally.open("file:" .. path))
    local st = db:stats()
    db:close()
    assert.same({ store = "file:" .. path, format = 9, counters = 3, file_bytes = st.file_bytes,
                  used_bytes = st.used_bytes, free_bytes = st.file_bytes - st.used_bytes,
                  max_bytes = 32 * 2^30, fs_avail_bytes = doc.fs_avail_bytes,
                  live_bytes = st.live_bytes, retired_bytes = 0, reusable_bytes = 0,
                  reused_bytes = 0, expired = 0, capped = 0, processes = 0, behind = 0,
                  oldest_pid = require("cjson").null, writers = 1, rollups = {},
                  check = "ok" }, doc)
    assert.is_true(doc.fs_avail_bytes > 0)
  end)

  it("info: lists the rollup schedules the store keeps", function()
    local p = helper.tmpfile("sched.tly")
    local db = assert(tally.open("file:" .. p))
    db:rollup("views", { every = 10 })
    db:rollup("*", { every = 3600 })
    db:incr("views")
    db:tick(1700000005)          -- periods starting 1700000000 (10 s) and 1699999200 (1 h)
    db:close()
    local out, err, code = run("info", p)
    assert.equal(0, code, err)
    assert.matches("\nrollups    every 10 s, last period 2023%-11%-14 22:13:20 UTC\n"
                   .. "           every 1 h, last period 2023%-11%-14 22:00:00 UTC\n$", out)
    out = run("info", p, "--json")
    local doc = require("cjson").decode(out)
    assert.same({ { every = 10, last_period = 1700000000 }, { every = 3600, last_period = 1699999200 } },
                doc.rollups)
  end)

  it("info: says what expiry and caps did, and who holds reuse back", function()
    local p = helper.tmpfile("held.tly")
    local db = assert(tally.open("file:" .. p))
    db:family("cap:*", { max_counters = 1 })
    db:incr("cap:1")
    db:incr("cap:2")                     -- to cap:_overflow
    db:family("idle:*", { idle = 5 })
    db:incr("idle:1")
    db:tick(1700000000)
    db:tick(1700000010)                  -- idle:1 expires
    -- another process with a counter handle, that has passed a grace step
    -- and then sleeps: what a drop retires now waits for it
    local script = helper.tmpfile("holder.lua")
    helper.write(script, "local tally = require 'tally'\n"
                 .. "local db = assert(tally.open('file:' .. arg[1]))\n"
                 .. "local c = db:counter('held') db:maintain(0)\n"
                 .. "print('ready') io.stdout:flush() tally.sleep(60)\n")
    local h = assert(io.popen("sh -c 'echo $$; exec \"$0\" \"$@\"' " .. q(helper.bin) .. " "
                              .. q(script) .. " " .. q(p) .. " 2>&1", "r"))
    local pid = math.tointeger(tonumber(h:read("l")))
    assert.equal("ready", h:read("l"))
    db:incr("gone")
    db:drop("gone")
    db:close()
    local out, err, code = run("info", p)
    local jout = run("info", p, "--json")
    os.execute("kill " .. pid)
    h:close()
    assert.equal(0, code, err)
    assert.matches("\nexpired    1 counter expired for idleness\n", out)
    assert.matches("\ncapped     1 new name sent to an overflow counter\n", out)
    assert.matches("\nprocesses  1 other has the store open; 1 holds reuse back "
                   .. "%(furthest behind: pid " .. pid .. "%)\n", out)
    local doc = require("cjson").decode(jout)
    assert.same({ 1, 1, 1, pid }, { doc.expired, doc.capped, doc.processes, doc.oldest_pid })
    assert.equal(1, doc.behind)
    assert.is_true(doc.retired_bytes > 0)           -- the drop's, held back
    assert.is_true(doc.live_bytes + doc.retired_bytes + doc.reusable_bytes <= doc.used_bytes)
    out = run("info", p)                            -- it is gone now
    assert.matches("\nprocesses  no other process has the store open\n", out)
  end)

  it("watch: needs a terminal", function()
    local out, err, code = run("watch", path)
    assert.equal(1, code)
    assert.equal("", out)
    assert.equal("tally watch: needs a terminal (stdout is not one); 'tally ls' lists the "
                 .. "counters once\n", err)
  end)
end)

describe("tally incr that fails", function()
  local function names_in(path)
    local db = assert(tally.open("file:" .. path, { create = false }))
    local names = db:names()
    db:close()
    return names
  end

  it("creates no counter, and with --create no store", function()
    local path = helper.tmpfile()
    for _, n in ipairs({ "9223372036854775807", "4611686018427387904", "-4611686018427387905",
                         "-9223372036854775808" }) do
      local out, err, code = run("incr", "--create", path, "big", n)
      assert.equal(1, code, n)
      assert.equal("", out)
      assert.equal("tally incr: counter 'big': adding " .. n .. " would overflow a shard "
                   .. "(shards hold -2^62 to 2^62-1)\n", err)
      assert.is_false(exists(path), n)
    end
    assert.equal(0, select(3, run("incr", "--create", path, "other", "1")))
    for _, n in ipairs({ "9223372036854775807", "4611686018427387904", "-4611686018427387905" }) do
      local out, err, code = run("incr", path, "big", n)
      assert.equal(1, code, n)
      assert.equal("", out)
      assert.equal(1, err:find("tally incr: counter 'big': adding " .. n .. " would overflow", 1, true))
      out, err, code = run("ls", path)
      assert.equal(0, code, err)
      assert.not_matches("big", out, 1, true)
      assert.same({ "other" }, names_in(path))
    end
    -- the edges a new counter can take are taken
    assert.equal("4611686018427387903\n", (run("incr", path, "hi", "4611686018427387903")))
    assert.equal("-4611686018427387904\n", (run("incr", path, "lo", "-4611686018427387904")))
  end)

  it("without the key a family's key policy needs, creates no counter", function()
    local path = helper.tmpfile()
    local db = assert(tally.open("file:" .. path))
    db:family("k:*", { policy = "key" })
    assert.has_error(function() db:incr("k:1", 1) end,
                     "bad argument #3 to 'incr' (key expected for a counter with the key policy)")
    assert.same({}, db:names())
    local v, msg, code = db:incr("big", math.maxinteger)
    assert.is_nil(v)
    assert.equal("counter 'big': adding 9223372036854775807 would overflow a shard "
                 .. "(shards hold -2^62 to 2^62-1)", msg)
    assert.equal("ERANGE", code)
    assert.same({}, db:names())
    db:close()
    local out, err, code2 = run("incr", path, "k:2")
    assert.equal(1, code2)
    assert.equal("", out)
    assert.equal("tally incr: key expected for a counter with the key policy\n", err)
    assert.same({}, names_in(path))
    assert.equal("1\n", (run("incr", path, "k:2", "--key", "a")))
    assert.same({ "k:2" }, names_in(path))
  end)
end)

describe("tally commands on a damaged or foreign file", function()
  -- A store whose counter record for "c:30" has a damaged cell location
  -- (the record's first word, 24 bytes before its name): it opens, and
  -- listing its names fails with the store's own ECORRUPT message.
  local function damaged_store()
    local path = helper.tmpfile()
    local db = assert(tally.open("file:" .. path))
    for i = 1, 50 do db:incr("c:" .. i, i) end
    db:close()
    local data = slurp(path)
    local at = assert(data:find("c:30\0", 1, true)) - 24     -- 1-based start of the record
    local b = data:byte(at + 2)
    helper.write(path, data:sub(1, at + 1) .. string.char(b ~ 0x80) .. data:sub(at + 3))
    return path
  end

  local function all_commands(path, import_file)
    return { { "ls" }, { "ls", "--json" }, { "ls", "c:*" }, { "get", "c:30" },
             { "get", "c:30", "--shards" }, { "export" }, { "export", "c:*" }, { "info" },
             { "info", "--json" }, { "info", "--check" }, { "incr", "c:30" },
             { "incr", "c:30", "5" }, { "import", import_file }, { "import", import_file, "--add" },
             { "watch" } }, path
  end

  it("print the store's message and exit 1, never a traceback", function()
    local import_file = helper.tmpfile("import.json")
    helper.write(import_file, '{"counters":{"c:30":{"num_shards":1,"shards":{"0":{"count":1}}}}}')
    local path = damaged_store()
    local db = assert(tally.open("file:" .. path))
    local _, want = db:names()
    db:close()
    assert.matches("tally store is corrupt", want)
    local cmds = all_commands(path, import_file)
    for _, cmd in ipairs(cmds) do
      local out, err, code = run(cmd[1], path, table.unpack(cmd, 2))
      local what = table.concat(cmd, " ")
      assert.equal(1, code, what .. ": " .. err)
      assert.not_matches("traceback", err, 1, true)
      assert.not_matches("attempt to", err, 1, true)
      assert.equal("tally " .. cmd[1] .. ": " .. want .. "\n", err, what)
      if cmd[1] ~= "export" then assert.equal("", out, what) end
    end
  end)

  it("say what a foreign, empty, truncated or re-stamped file is, for every command", function()
    local import_file = helper.tmpfile("import.json")
    helper.write(import_file, '{"counters":{}}')
    local good = helper.tmpfile()
    local db = assert(tally.open("file:" .. good))
    db:incr("c:1", 1)
    db:close()
    local data = slurp(good)
    local cases = {
      { "text", ("not a store at all\n"):rep(1000), "not a tally store %(bad magic%)" },
      { "binary", slurp(helper.bin), "not a tally store %(bad magic%)" },
      { "empty", "", "not a tally store %(empty file%)" },
      { "magic", "XXXX" .. data:sub(5), "not a tally store %(bad magic%)" },
      { "truncated", data:sub(1, 100), "tally store is truncated" },
    }
    for _, case in ipairs(cases) do
      local path = helper.tmpfile(case[1] .. ".tly")
      helper.write(path, case[2])
      for _, cmd in ipairs((all_commands(path, import_file))) do
        local _, err, code = run(cmd[1], path, table.unpack(cmd, 2))
        local what = case[1] .. ": " .. table.concat(cmd, " ")
        assert.equal(1, code, what .. ": " .. err)
        assert.not_matches("traceback", err, 1, true)
        assert.matches("^tally " .. cmd[1] .. ": " .. path:gsub("%p", "%%%0") .. ": " .. case[3]
                       .. "[^\n]*\n$", err, nil, what)
      end
    end
  end)

  it("db:values, db:top, db:export and tally.prometheus return the message", function()
    local path = damaged_store()
    local db = assert(tally.open("file:" .. path))
    local _, want, wcode = db:names()
    for name, f in pairs({ values = db.values, export = db.export,
                           top = function(d) return d:top(3) end,
                           prometheus = tally.prometheus }) do
      local v, msg, code = f(db)
      assert.is_nil(v, name)
      assert.equal(want, msg, name)
      assert.equal(wcode, code, name)
    end
    db:close()
  end)
end)

describe("examples/likes.lua", function()
  it("counts every like from several processes exactly", function()
    local path = helper.tmpfile()
    local out, code = helper.tally("examples/likes.lua", path, "3", "5000")
    assert.equal(0, code, out)
    for i = 1, 3 do assert.matches("worker " .. i .. ": 5000 likes", out) end
    assert.matches("\ntotal: 15000 likes %(expected 15000%)", out)
    assert.matches("\nexact: every like counted\n$", out)
    local db = assert(tally.open("file:" .. path))
    assert.equal(15000, db:value("post:42:likes"))
    local info = db:counter("post:42:likes"):info()
    assert.matches("^" .. ("%x"):rep(16) .. "$", info.incarnation)
    info.incarnation = nil
    assert.same({ name = "post:42:likes", shards = 16, policy = "thread" }, info)
    db:close()
  end)
end)

describe("tally ls with histograms", function()
  it("lists each histogram once more after the table: exact sum, aligned", function()
    local path = helper.tmpfile()
    local db = assert(tally.open("file:" .. path))
    local h = assert(db:histogram("lat", { buckets = { 0.1, 1 } }))
    for _, v in ipairs({ 0.05, 0.2, 0.305 }) do assert(h:observe(v)) end
    assert(db:histogram("big", { buckets = { 10 }, unit = 1 })):observe(1e6)
    db:close()
    local out, err, code = run("ls", path)
    assert.equal(0, code, err)
    assert.equal(table.concat({
      "HISTOGRAM  COUNT      SUM  P50<=  P90<=  P99<=  BUCKETS",
      "big            1  1000000   +Inf   +Inf   +Inf        2",
      "lat            3    0.555      1      1      1        3", "" }, "\n"),
      out:match("\n\n(HISTOGRAM.*)$"))
    -- with a pattern: only the histograms it matches; '' matches all, as '*'
    out = run("ls", path, "l*")
    assert.matches("\n\nHISTOGRAM[^\n]*\nlat ", out)
    assert.is_nil(out:find("\nbig ", 1, true))
    local all = run("ls", path, "")
    assert.equal(run("ls", path), all)
  end)

  it("--json: one object per histogram, marked, after its members, which say whose they are", function()
    local path = helper.tmpfile()
    local db = assert(tally.open("file:" .. path))
    db:family("lat:*", { histogram = { buckets = { 0.1, 1 } }, metric = "latency_seconds",
                         labels = { "route" } })
    local h = assert(db:histogram("lat:/api"))
    for _, v in ipairs({ 0.05, 0.2, 0.305 }) do assert(h:observe(v)) end
    assert(db:histogram("big", { buckets = { 10 }, unit = 1 })):observe(2^53)
    assert(db:histogram("idle", { buckets = { 1 }, unit = 0.25 }))
    db:incr("views", 3)
    db:incr("x{le=1}", 2)                        -- looks like a member, is not one
    db:close()
    local out, err, code = run("ls", path, "--json")
    assert.equal(0, code, err)
    local function member(name, value, of)
      return '{"name":"' .. name .. '","value":' .. value .. ',"shards":64,"policy":"slot",'
             .. '"rolled":null,"histogram":"' .. of .. '"}'
    end
    assert.equal("[\n" .. table.concat({
      member("big{le=+Inf}", 1, "big"), member("big{le=10}", 0, "big"),
      member("big{sum,unit=1}", 9007199254740992, "big"),
      member("idle{le=+Inf}", 0, "idle"), member("idle{le=1}", 0, "idle"),
      member("idle{sum,unit=0.25}", 0, "idle"),
      member("lat:/api{le=+Inf}", 0, "lat:/api"), member("lat:/api{le=0.1}", 1, "lat:/api"),
      member("lat:/api{le=1}", 2, "lat:/api"), member("lat:/api{sum,unit=1e-06}", 555000, "lat:/api"),
      '{"name":"views","value":3,"shards":1,"auto":true,"grown":0,"shrunk":0,"policy":"thread",'
        .. '"rolled":null}',
      '{"name":"x{le=1}","value":2,"shards":1,"auto":true,"grown":0,"shrunk":0,"policy":"thread",'
        .. '"rolled":null}',
      '{"name":"big","type":"histogram","count":1,"sum":9007199254740992,'
        .. '"sum_units":9007199254740992,"unit":1,"p50":"+Inf","p90":"+Inf","p99":"+Inf",'
        .. '"buckets":[{"le":"10","count":0},{"le":"+Inf","count":1}]}',
      '{"name":"idle","type":"histogram","count":0,"sum":0,"sum_units":0,"unit":0.25,'
        .. '"p50":null,"p90":null,"p99":null,"buckets":[{"le":"1","count":0},{"le":"+Inf","count":0}]}',
      '{"name":"lat:/api","type":"histogram","count":3,"sum":0.555,"sum_units":555000,"unit":1e-06,'
        .. '"p50":"1","p90":"1","p99":"1",'
        .. '"buckets":[{"le":"0.1","count":1},{"le":"1","count":3},{"le":"+Inf","count":3}]}',
    }, ",\n") .. "\n]\n", out)
    local doc = require("cjson").decode(out)
    assert.equal(15, #doc)
    assert.equal("histogram", doc[15].type)
    assert.equal(3, doc[15].buckets[3].count)
    -- a pattern selects histograms by their members' names, as in the table
    out = run("ls", path, "lat:*", "--json")
    assert.equal(5, #require("cjson").decode(out))
    assert.matches('\n{"name":"lat:/api","type":"histogram",', out, 1, true)
    out = run("ls", path, "views", "--json")
    assert.equal('[\n{"name":"views","value":3,"shards":1,"auto":true,"grown":0,"shrunk":0,'
                 .. '"policy":"thread","rolled":null}\n]\n', out)
  end)

  it("lists the histograms of a histogram family by their names", function()
    local path = helper.tmpfile()
    local db = assert(tally.open("file:" .. path))
    db:family("lat:*", { histogram = { buckets = { 0.1, 1 } }, metric = "latency_seconds",
                         labels = { "route" } })
    for route, v in pairs({ ["/api"] = 0.05, ["/"] = 2 }) do
      assert(assert(db:histogram("lat:" .. route)):observe(v))
    end
    db:close()
    local out, err, code = run("ls", path, "lat:*")
    assert.equal(0, code, err)
    assert.equal(table.concat({
      "HISTOGRAM  COUNT   SUM  P50<=  P90<=  P99<=  BUCKETS",
      "lat:/          1     2   +Inf   +Inf   +Inf        3",
      "lat:/api       1  0.05    0.1    0.1    0.1        3", "" }, "\n"),
      out:match("\n\n(HISTOGRAM.*)$"))
  end)
end)
