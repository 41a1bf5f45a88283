-- tally.cmd.cli: the subcommands of the tally command (ls, get, incr, export,
-- import, info, compact, watch, serve, help) and its help texts. src/cli/main.c calls
-- main(command, args...) and exits with what it returns: 0, 1 for a failure
-- (a missing store or counter, a bad file), 2 for a usage error.
--
-- Runs only under the `tally` command, which is Lua 5.4 (it uses
-- tally.term and tally.peek, preloaded by the command); never loaded by
-- require "tally", so the LuaJIT build does not need it.
--
-- User errors never show a Lua traceback: they are raised as `fail`
-- objects and printed as "tally CMD: message". Anything else raised is a
-- bug, printed with its traceback.

local tally = require "tally"
local term = require "tally.term"
local peek = require "tally.peek"

local type, tostring, tonumber, ipairs, error, setmetatable, getmetatable =
      type, tostring, tonumber, ipairs, error, setmetatable, getmetatable
local fmt, rep = string.format, string.rep
local concat = table.concat
local floor, mtype = math.floor, math.type

local _M = {}

-- ---- help -------------------------------------------------------------------

local USAGE = {
  tally = "tally [options] [script [args...]]\n"
       .. "       tally run [options] script [args...]\n"
       .. "       tally COMMAND [args...]",
  run = "tally run [options] script [args...]",
  ls = "tally ls STORE [pattern] [--json]",
  get = "tally get STORE name [--shards]",
  incr = "tally incr STORE name [n] [--key KEY] [--create]",
  export = "tally export STORE [pattern]",
  import = "tally import STORE FILE [--add] [--create]",
  info = "tally info STORE [--json] [--check]",
  compact = "tally compact STORE",
  watch = "tally watch STORE [pattern] [--interval S] [--sort rate|value|name]",
  serve = "tally serve STORE [--listen ADDR:PORT] [--auth TOKEN|USER:PASS] [--connections N]\n"
       .. "                  [--timeout S] [--families FILE] [--nice N]",
  help = "tally help [command | --man]",
}

local HELP = {}

HELP.tally = [[
With no script and no -e, tally starts an interactive Lua 5.4 prompt with
the module loaded as 'tally' and a store opened as 'db' (a memory store
unless --store names one): line editing and history (~/.tally_history),
Tab completion, multi-line statements; `=expr` and bare expressions print
their values. With a script, tally runs it like lua5.4 does, with the
module preloaded.

Commands:
  ls STORE [pattern] [--json]        counters: value, shards, last rollup
  get STORE name [--shards]          a counter's exact value
  incr STORE name [n] [--key K] [--create]   add n (default 1); print the value
  export STORE [pattern]             counters as JSON (Firestore layout) on stdout
  import STORE FILE [--add] [--create]   read an export ('-': stdin)
  info STORE [--json] [--check]      format, counters, size, space, reuse, writers
  compact STORE                      rewrite the store without its retired space
  watch STORE [pattern] [--interval S] [--sort rate|value|name]
                                     a live view, like top
  serve STORE [--listen ADDR:PORT] [--auth TOKEN|USER:PASS]
                                     /metrics, a JSON API and a live dashboard
  help [command]                     this text, or a command's

Options:
  --store STORE   open STORE as 'db' (for the prompt, -e chunks and scripts)
  --create        with --store: make the store if it does not exist
  -e code         run code (the module is the global 'tally')
  -i              enter the prompt after running the script or -e
  -v, --version   print the version
  -h, --help      print this help
  --              stop handling options
  -               run stdin as the script

STORE is file:PATH or a path. Every command that opens a STORE refuses a
symbolic link and a file owned by another user (it could have been planted
to make this user write through it) unless given --trust (for example root
looking at a store nginx workers running as nobody made).
A command is recognised only as the first
argument: to run a script named like one, write 'tally ./ls' or
'tally run ls'. No command creates a store unless given --create.
Exit status: 0 done, 1 failed (a missing store or counter, a bad file),
2 usage error, 130 interrupted.
]]

HELP.run = [[
Run script with the module loaded (require "tally"), arg set as lua5.4
sets it (arg[0] the script, arg[1..] its arguments, which are also passed
as '...'). The same as 'tally script', except that script may be named like
a command: 'tally run ls' runs the file ls. Options as for tally (-e, -i,
--store, --create). A failing script prints 'tally: message' and a
traceback and exits 1; os.exit(n) exits n.
]]

HELP.ls = [[
List the counters of STORE whose names match pattern (a glob: * any run of
bytes, ? one byte; default all), sorted by name, as an aligned table:

  NAME  VALUE  SHARDS  POLICY  ROLLED AT  RATE/S

VALUE is exact (the sum of the shards now); ROLLED AT and RATE/S come from
the counter's last rollup ('-' if it has none). Histograms (db:histogram)
among them are also listed after the table, one line each: COUNT, SUM and
the bucket bounds that hold the 50th, 90th and 99th percentiles.

  --json   a JSON array, one counter per line: {"name":, "value":,
           "shards":, "policy":, "rolled": {"value":, "at":, "delta":,
           "rate":, "count":} or null}, a histogram's member counters
           with "histogram": its name; then one line per histogram:
           {"name":, "type": "histogram", "count":, "sum":, "sum_units":,
           "unit":, "p50":, "p90":, "p99":, "buckets": [{"le": "0.1",
           "count":}, ... {"le": "+Inf", "count":}]} (counts cumulative);
           integers written exactly

Reads only: never creates the store or a counter, never takes the store
lock after opening it.
]]

-- for the commands that only read: they need write permission all the same
local function writable(name)
  return ([[

The store must be writable by the user running this, even to read: opening
a store opens it read-write and takes its lock for a moment (to finish a
move a process that died left), as every open does. For a store nginx
workers write, run it as their user (sudo -u nobody tally NAME STORE ...),
or give the store a group and mode 0660 and run it as a member of that
group (chgrp and chmod an existing store; a new one gets the mode from
tally.open(spec, { mode = 432 }), 432 being octal 660, or from the OpenResty
glue's open option).
]]):gsub("NAME", name)
end
HELP.ls = HELP.ls .. writable("ls")

HELP.get = [[
Print the exact value of counter name (the sum of its shards now).

  --shards   print each shard's value instead, one per line

Exits 1 if there is no such counter. Reads only.
]] .. writable("get")

HELP.incr = [[
Add n to counter name (an integer, default 1; negative subtracts), creating
the counter if absent with its family's options or the store's defaults
(16 shards, thread policy), and print the counter's value read just after.

  --key KEY  the key, for a counter with the key policy
  --create   make STORE if it does not exist
]]

HELP.export = [[
Write the counters matching pattern (default all) to stdout as JSON, exact
per shard, in the Cloud Firestore distributed-counter layout that
'tally import' and db:import read (README: "Export and import"). Reads only.
]] .. writable("export")

HELP.import = [[
Read an export from FILE ('-' for stdin) into STORE and print how many
counters it holds. The whole document is checked before anything changes.
By default each counter's shards are made equal to the document's counts;
increments other processes make meanwhile are kept.

  --add      add the counts to what is there instead
  --create   make STORE if it does not exist

FILE must be a JSON object of at most 4 GiB (TALLY_IMPORT_MAX_BYTES in the
environment sets another limit); export a larger store in parts, by
pattern. A document as 'tally export' writes it streams: checked a piece
at a time into a temporary file in $TMPDIR, then applied from it; another
layout is held whole.

On a terminal, an import of 1 MiB or more shows a progress bar on stderr
through its phases (check, apply; another layout: parse, check, create,
apply; from stdin, read first). Ctrl-C stops it while nothing has changed; once
the store starts changing, the import runs to the end.
]]

HELP.info = [[
Describe STORE for an operator: format version; counters; file size; space
used and free inside the file; room left to grow (to the store's 32 GiB
limit and on the file system); how the space used splits: live (in use),
retired (left by drop, idle expiry, reshard and the index's growth, waiting
out its grace period) and reusable (past it, handed out again before the
file grows); bytes reused so far; counters expired for idleness and new
names sent to a family's overflow counter (max_counters); the other
processes that have the store open and how many of them hold reuse back
(a process holds it back until its next db:tick, create or drop; the pid
of the one furthest behind); thread tickets drawn (each thread, in any
process, that has incremented a 'thread' counter draws one: the writers so
far); the rollup schedules the store keeps (period, last period rolled up,
lease holder). 'tally compact' gives retired and reusable space back to
the file system.

  --json    the same as one JSON object (integers exact; processes counts
            the others, not this command)
  --check   also verify every structure of the store (db:check(), which
            holds the store lock while it runs)
]] .. writable("info")

HELP.compact = [[
Rewrite STORE without retired or reusable space (what drops, idle expiry,
reshards and the index's growth leave behind: 'tally info' shows how
much), so the file shrinks to what its counters use. Counters (values,
shards, policies), families, rollup records and history are kept. Print
the size before and after.

The store must not be open in any other process: compact refuses (exit
status 1, naming one) while one has it open ('tally info' counts them);
stop them first. On a terminal a progress bar shows on stderr; otherwise one
line there says how many counters were rewritten. Ctrl-C does not stop a
compaction that has begun.
]]

HELP.watch = [[
A live view of the counters matching pattern, refreshed like top: NAME,
VALUE (exact), RATE/S (between the last two refreshes; from the last
rollup until there are two) and HISTORY, a sparkline of the rate: from the
counter's finest rollup history if it keeps one, else from what watch has
seen of it on screen. Each refresh reads every matching counter in one walk
but keeps only the rows on screen. Histograms get one row each after the counters:
COUNT, RATE/S of the count, SUM, MEAN and the bucket bounds of P50, P90
and P99, all read from one consistent snapshot per refresh.

  --interval S   seconds between refreshes (default 1, 0.1 to 3600)
  --sort KEY     rate (default), value or name

Keys: q quits (exit status 0), Ctrl-C too (130, interrupted); s cycles the
sort, r, v and n pick it; + and - refresh slower and faster; arrows, PgUp,
PgDn, Home scroll. The terminal is restored on exit. Reads only, without
the store lock (after opening the store, as every open does for a moment):
writers never wait for it. Needs a terminal.
]] .. writable("watch")

HELP.serve = [[
Serve STORE over HTTP until SIGTERM (exit status 0) or Ctrl-C (130):

  GET /metrics     the Prometheus text of the store, as tally.prometheus
                   gives it (?pattern=GLOB for part of it); gzip when the
                   client asks for it
  GET /api/stats   the store's health, as 'tally info --json' has it
  GET /api/top     ?n=10&by=value|rate&pattern=GLOB&history=N: the top
                   counters (db:top), with N points of history each
  GET /api/values  ?pattern=GLOB: { "values": { name: value } } (db:values)
  GET /api/sum     ?pattern=GLOB: the exact sum and count (db:sum)
  GET /api/counter ?name=NAME: value, shards, last rollup, history rings
  GET /api/histograms  ?pattern=GLOB: buckets, count, sum, p50/p90/p99
  GET /api/rollups the rollup schedules the store keeps
  GET /            a live dashboard (Chart.js from Debian's libjs-chart.js,
                   served from here: no other site is asked for anything)

  --listen ADDR:PORT   where to listen (default 127.0.0.1:9145; [::1]:PORT
                       for IPv6; port 0: any free port, named on stderr)
  --auth TOKEN         require 'Authorization: Bearer TOKEN'; USER:PASS
                       requires HTTP Basic auth instead. Needed to listen
                       beyond loopback. TALLY_SERVE_AUTH in the environment
                       gives it without showing it in ps.
  --connections N      connections at once (default 256; 32 per client
                       address)
  --timeout S          close a connection idle for S seconds (default 10)
  --nice N             run at niceness N at least (0 to 19, default 12): where
                       the writers keep every CPU busy, the scheduler gives
                       them what answering would take
  --families FILE      a Lua file run with the store as its argument ('...'),
                       whose db:family(pattern, { metric =, labels = ... })
                       calls name and label the series of /metrics, as the
                       same file run by the writers does there; only their
                       metric options are taken (serve writes nothing)

Reads only: the store must exist (serve never creates it), no counter is
created and nothing is written, and reads take no lock, so writers never
wait for it. A store that cannot be read (damaged, not a tally store) is
answered with 503 and its message, and opened again on the next request.
A bad query is 400 with a message, an unknown path 404; requests are
bounded (32 KiB of headers per connection). docs/serve.md has more.
]] .. writable("serve")

HELP.help = [[
Print the help of the tally command, or of one command. --man prints the
same texts as a manual page (roff), the one installed as tally(1).
]]

local COMMANDS = { "ls", "get", "incr", "export", "import", "info", "compact", "watch", "serve",
                   "help" }

local function help_text(name)
  return "usage: " .. USAGE[name] .. "\n\n" .. HELP[name]
end
_M.help_text = help_text

-- ---- failing ------------------------------------------------------------------

local common = require "tally.cmd.common"
local Fail, fail = common.Fail, common.fail
local printable = common.printable
_M.fail = fail

local current = "tally"   -- the command running, for messages

local function usage_error(msg)
  fail(msg .. "\nusage: " .. USAGE[current] .. "   ('tally help " .. current .. "' for more)", 2)
end

-- ---- arguments ------------------------------------------------------------------

-- parse(args, spec) -> options, positionals. spec.flags and spec.values
-- name the options (--name, or --name VALUE / --name=VALUE); spec.min and
-- spec.max bound the positionals. "-h"/"--help" sets options.help. An
-- argument like -5 is a positional (incr STORE name -5).
local trust = false   -- --trust: open a symlink or another user's store

local function parse(args, spec)
  local o, pos, only = {}, {}, false
  local i = 1
  while i <= #args do
    local a = args[i]
    if only or a == "-" or a:sub(1, 1) ~= "-" or a:find("^%-%d") then
      pos[#pos + 1] = a
    elseif a == "--" then
      only = true
    elseif a == "-h" or a == "--help" then
      o.help = true
    elseif a == "--trust" then
      trust = true                       -- every command that opens a STORE
    else
      local name, val = a:match("^%-%-([%w][%w-]*)=(.*)$")
      if not name then name = a:match("^%-%-([%w][%w-]*)$") end
      if name and spec.flags and spec.flags[name] then
        if val then usage_error("option --" .. name .. " takes no value") end
        o[name] = true
      elseif name and spec.values and spec.values[name] then
        if not val then
          i = i + 1
          val = args[i]
          if val == nil then usage_error("option --" .. name .. " needs a value") end
        end
        o[name] = val
      else
        usage_error("unknown option '" .. printable(a) .. "'")
      end
    end
    i = i + 1
  end
  if o.help then return o, pos end
  if #pos < (spec.min or 0) then
    usage_error(spec.min == 1 and "a store is needed" or "missing " .. spec.missing)
  end
  if spec.max and #pos > spec.max then usage_error("unexpected argument '" .. printable(pos[spec.max + 1]) .. "'") end
  return o, pos
end

-- ---- stores -------------------------------------------------------------------

-- open_store(uri [, { create = bool, memory = bool, writes = bool, help = cmd,
-- handle_cache = n }]) -> db or nil, message.
-- uri: "file:PATH", a bare path, or "memory" (unless opts.memory is false).
-- Without create, a missing file is an error and nothing is made (the
-- message suggests --create when opts.create is false rather than nil).
-- Opening a file store opens it read-write and takes its lock for a moment,
-- even to read: "Permission denied" says so (opts.writes: the caller is
-- about to write anyway, so less is said; opts.help: the command whose help
-- tells more).
-- A store spec as messages show it: the userinfo and query of a URI
-- masked (redis://user:secret@host?password=x -> redis://***@host?***).
local shown = require("tally.core").uri_redact

-- A refusal of a symlink or another user's store, with the command's way
-- to trust it.
local function trust_hint(msg, code)
  return code == "EUNTRUSTED" and msg .. "; here: --trust" or msg
end

function _M.open_store(uri, opts)
  opts = opts or {}
  if type(uri) ~= "string" or uri == "" then return nil, "a store is needed (file:PATH or a path)" end
  if uri == "memory" then
    if opts.memory == false then
      return nil, "'memory' is a store of one process, empty here: give a file store (file:PATH or a path)"
    end
    return tally.open()
  end
  local path = uri:match("^file:(.*)$") or uri
  if path == "" then return nil, "empty store path in '" .. shown(uri) .. "'" end
  if not opts.create then
    local f, _, code = io.open(path, "rb")
    if f then
      f:close()
    elseif code == 2 then
      return nil, fmt("no store at %s (no such file%s)", printable(shown(path)),
                      opts.create == false and "; --create makes one" or "")
    end
  end
  local db, msg, code = tally.open("file:" .. path, { create = opts.create and true or false,
                                                       trust = opts.trust and true or false,
                                                       handle_cache = opts.handle_cache })
  if not db then
    msg = trust_hint(msg, code)
    if type(msg) == "string" and msg:find("Permission denied$") then
      msg = msg .. " (the store must be writable by this user"
        .. (opts.writes and "" or ": it takes the store's lock even to read")
        .. (opts.help and not opts.writes and ("; see 'tally help " .. opts.help .. "'") or "")
        .. ")"
    end
    return nil, msg
  end
  return db, path
end

local READS = { ls = true, get = true, info = true, export = true, watch = true, serve = true }

local function open(uri, create)
  local db, path = _M.open_store(uri, { create = create, memory = false, trust = trust,
                                        writes = not READS[current], help = current })
  if not db then fail(path) end
  return db, path
end

-- must(v, msg, ...) -> v, ...: a store method's nil, message (a damaged
-- store) fails the command with the store's own message.
local function must(v, msg, ...)
  if v == nil then fail(tostring(msg)) end
  return v, msg, ...
end

-- peek.counter, where a counter dropped meanwhile is nil and any other
-- failure (a damaged store) fails the command.
local function peek_counter(db, name, cells)
  local p, msg, code = peek.counter(db, name, cells)
  if not p and code ~= "ENOENT" then fail(tostring(msg)) end
  return p
end

-- ---- formatting -----------------------------------------------------------------

local function bytes(n)
  if n < 1024 then return fmt("%d B", n) end
  local units = { "KiB", "MiB", "GiB", "TiB" }
  local v, u = n / 1024, 1
  while v >= 1024 and u < #units do v, u = v / 1024, u + 1 end
  return fmt(v < 10 and "%.2f %s" or "%.1f %s", v, units[u])
end
_M.bytes = bytes

_M.rate_text = common.rate_text

-- JSON through tally.format, the one writer (a sum beyond int64 comes as
-- its decimal string and is written as a JSON string).
local jstr = tally.format.json_string
local function jnum(x)
  if type(x) == "string" then return jstr(x) end
  return tally.format.json_number(x)
end

local function jobject(keys, t)
  local parts = {}
  for i, k in ipairs(keys) do
    local v = t[k]
    local text
    if type(v) == "boolean" then text = tostring(v)
    elseif type(v) == "table" then text = v.json
    elseif k == "at" and type(v) == "number" then text = tally.format.at_text(v) or "null"
    elseif type(v) == "string" and k ~= "value" then text = jstr(v)
    else text = jnum(v) end
    parts[i] = jstr(k) .. ":" .. text
  end
  return "{" .. concat(parts, ",") .. "}"
end

local function out(...)
  io.stdout:write(...)
end

-- ---- progress bars ------------------------------------------------------------------

-- A progress bar on stderr (only when stderr is a terminal): update(phase,
-- done, total, unit) redraws at most ten times a second; done() clears it.
local function progress(label)
  if not term.isatty(2) then return nil end
  local last, shown = 0, false
  local bar = {}
  function bar.update(phase, done, total, unit, force)
    local now = tally.now()
    if not force and now - last < 0.1 then return end
    last, shown = now, true
    local cols = term.size()
    local amount
    if unit == nil then
      amount = ""
    elseif unit == "bytes" then
      amount = total and (bytes(done) .. " / " .. bytes(total)) or bytes(done)
    else
      amount = total and fmt("%d / %d %s", done, total, unit or "") or fmt("%d %s", done, unit or "")
    end
    local left = fmt("%s: %-8s ", label, phase)
    local right = total and total > 0 and fmt(" %3d%%  %s", floor(done * 100 / total), amount)
                  or "  " .. amount
    local w = cols - #left - #right - 3
    if w > 40 then w = 40 end
    local line
    if total and total > 0 and w >= 5 then
      local fill = floor(w * done / total)
      if fill > w then fill = w end
      line = left .. "[" .. rep("#", fill) .. rep("-", w - fill) .. "]" .. right
    else
      line = left .. right
    end
    io.stderr:write("\r", line:sub(1, cols - 1), "\27[K")
    io.stderr:flush()
  end
  function bar.done()
    if shown then io.stderr:write("\r\27[K"); io.stderr:flush() end
  end
  return bar
end
_M.progress = progress

-- ---- commands ------------------------------------------------------------------------

local cmd = {}

-- The histograms (tally.histogram.group) among names, and their names sorted.
local function histograms_of(names)
  local hs, hnames = tally.histogram.group(names), {}
  for base in pairs(hs) do hnames[#hnames + 1] = base end
  table.sort(hnames)
  return hs, hnames
end

-- A reader of the histograms (h from histograms_of): each read
-- (tally.histogram.read) from one snapshot of all their members, taken on
-- the first read; nil if it cannot be taken. One walk of the store, where
-- a snapshot per histogram was a walk each.
local function histogram_reader(db)
  local snap
  return function(h)
    if snap == nil then snap = db:snapshot("*{*}") or false end
    return snap and tally.histogram.read(snap, h) or nil
  end
end

-- The upper bound of the bucket the q-quantile of r falls in, as member
-- names write it ("+Inf" above the last bound), or "-" with no observations.
local function quantile_text(r, q)
  local v = tally.histogram.quantile(r, q)
  return v == nil and "-" or v == math.huge and "+Inf" or tally.histogram.num_text(v)
end

-- The histograms among the counters matching pattern (nil: all): their
-- members' names end with '}', so only those are listed.
local function histograms_matching(db, pattern)
  local names = must(db:names("*}"))
  if pattern and pattern ~= "" then   -- '' is every counter, as for db:names
    local prometheus = require "tally.prometheus"
    local g, kept = prometheus._glob_compile(pattern), {}
    for _, n in ipairs(names) do
      if prometheus._glob_captures(g, n) then kept[#kept + 1] = n end
    end
    names = kept
  end
  return histograms_of(names)
end

-- Every matching counter in name order, a batch at a time (peek.rows: one
-- walk, no handle per counter, memory for one batch), to each(p) with p as
-- peek.counter gives it; a value beyond int64 is read again by handle for
-- its exact decimal. Returns how many there were.
local function each_row(db, pattern, each)
  local n = 0
  must(peek.rows(db, pattern, function(list)
    for _, p in ipairs(list) do
      if p.value == nil then p = peek_counter(db, p.name) end   -- nil: dropped since
      if p then
        n = n + 1
        each(p)
      end
    end
  end))
  return n
end

function cmd.ls(args)
  local o, pos = parse(args, { flags = { json = true }, min = 1, max = 2 })
  if o.help then return "help" end
  local db = open(pos[1])
  local hs, hnames = histograms_matching(db, pos[2])
  if o.json then
    local member = {}                             -- member counter -> its histogram
    for _, base in ipairs(hnames) do
      for _, n in ipairs(hs[base].names) do member[n] = base end
    end
    local first = true
    out("[")
    each_row(db, pos[2], function(p)
      local r = p.rolled
      if r then r.json = jobject({ "value", "at", "delta", "rate", "count" }, r) end
      local keys = p.auto and { "name", "value", "shards", "auto", "grown", "shrunk", "policy",
                                "rolled" }
                   or { "name", "value", "shards", "policy", "rolled" }
      if member[p.name] then keys[#keys + 1] = "histogram" end
      out(first and "\n" or ",\n",
          jobject(keys, { name = p.name, value = p.value, shards = p.shards, policy = p.policy,
                          auto = p.auto, grown = p.grown, shrunk = p.shrunk,
                          rolled = r or { json = "null" }, histogram = member[p.name] }))
      first = false
    end)
    local read = histogram_reader(db)
    for _, base in ipairs(hnames) do               -- then each histogram, one object
      local r = read(hs[base])
      if r then
        local buckets = {}
        for i, b in ipairs(r.buckets) do
          buckets[i] = '{"le":' .. jstr(hs[base].les[i][2]) .. ',"count":' .. jnum(b.count) .. "}"
        end
        local function q(x)
          local v = quantile_text(r, x)
          return { json = v == "-" and "null" or jstr(v) }
        end
        out(first and "\n" or ",\n",
            jobject({ "name", "type", "count", "sum", "sum_units", "unit", "p50", "p90", "p99",
                      "buckets" },
                    { name = base, type = "histogram", count = r.count,
                      sum = { json = common.hist_sum_text(r) }, sum_units = r.sum_units,
                      unit = r.unit, p50 = q(0.5), p90 = q(0.9), p99 = q(0.99),
                      buckets = { json = "[" .. concat(buckets, ",") .. "]" } }))
        first = false
      end
    end
    out(first and "]\n" or "\n]\n")
    return 0
  end
  -- the table, written by C as the walk reads (peek.ls: columns as wide
  -- as the first 5,000 rows need; a million counters stream; io.stdout
  -- is the same FILE, so what Lua writes after follows it)
  local i = must(peek.ls(db, pos[2]))
  if i == 0 then
    if pos[2] then io.stderr:write("tally ls: no counter matches '", printable(pos[2]), "'\n")
    else io.stderr:write("tally ls: the store has no counters\n") end
    return 0
  end
  -- histograms among them (tally.histogram): one line each, from one snapshot
  if #hnames > 0 then
    local rows = { { "HISTOGRAM", "COUNT", "SUM", "P50<=", "P90<=", "P99<=", "BUCKETS" } }
    local read = histogram_reader(db)
    for _, base in ipairs(hnames) do
      local r = read(hs[base])
      if r then
        rows[#rows + 1] = { printable(base), tostring(r.count), common.hist_sum_text(r), quantile_text(r, 0.5),
                            quantile_text(r, 0.9), quantile_text(r, 0.99), tostring(#r.buckets) }
      end
    end
    local w = {}
    for _, row in ipairs(rows) do
      for i, cell in ipairs(row) do
        if #cell > (w[i] or 0) then w[i] = #cell end
      end
    end
    out("\n")
    for _, row in ipairs(rows) do -- the name left, the figures right, as the table above
      local line = { row[1] .. rep(" ", w[1] - #row[1]) }
      for i = 2, #row do line[i] = rep(" ", w[i] - #row[i]) .. row[i] end
      out(table.concat(line, "  "), "\n")
    end
  end
  return 0
end

function cmd.get(args)
  local o, pos = parse(args, { flags = { shards = true }, min = 2, max = 2, missing = "counter name" })
  if o.help then return "help" end
  local db = open(pos[1])
  local p = peek_counter(db, pos[2], o.shards)
  if not p then fail(fmt("no such counter '%s'", printable(pos[2]))) end
  if o.shards then
    out(concat(p.cells, "\n", 1, #p.cells), "\n")
  else
    out(tostring(p.value), "\n")
  end
  return 0
end

function cmd.incr(args)
  local o, pos = parse(args, { flags = { create = true }, values = { key = true }, min = 2, max = 3,
                               missing = "counter name" })
  if o.help then return "help" end
  local n = 1
  if pos[3] then
    -- exact: Lua 5.4 reads a decimal numeral that fits an integer as one,
    -- and one out of range as a float (which must not round to -2^63)
    n = pos[3]:find("^[+-]?%d+$") and tonumber(pos[3])
    if mtype(n) ~= "integer" then
      usage_error("n must be an integer from " .. fmt("%d", math.mininteger) .. " to "
                  .. fmt("%d", math.maxinteger) .. ", got '" .. printable(pos[3]) .. "'")
    end
  end
  -- a store --create would make is empty: an n no shard can hold fails
  -- before it is made (db:incr itself creates no counter it cannot add to)
  if o.create and (n < -4611686018427387904 or n > 4611686018427387903)   -- -2^62, 2^62-1
     and type(pos[1]) == "string" then
    local f = io.open(pos[1]:match("^file:(.*)$") or pos[1], "rb")
    if f then f:close() else
      fail(fmt("counter '%s': adding %d would overflow a shard (shards hold -2^62 to 2^62-1)",
               printable(pos[2]), n))
    end
  end
  local db = open(pos[1], o.create or false)
  local ok, done, msg = pcall(db.incr, db, pos[2], n, o.key)
  if not ok then fail((tostring(done):gsub("^bad argument #%d+ to '[^']*' %((.*)%)$", "%1"))) end
  if not done then fail(msg) end
  local v, vmsg = db:value(pos[2])
  if v == nil then fail(vmsg) end
  out(tostring(v), "\n")
  return 0
end

function cmd.export(args)
  local o, pos = parse(args, { min = 1, max = 2 })
  if o.help then return "help" end
  local db = open(pos[1])
  -- streamed as the walk goes; a write that fails is told at exit (main.c)
  local ok, msg = db:export(pos[2], out)
  if not ok then fail(msg) end
  return 0
end

local BIG = 1048576   -- 1 MiB: an import this large gets a progress bar
-- The most an import reads: a document that is not as export writes it is
-- held whole, then decoded at a few times its size, and a stream that
-- never ends (/dev/zero) must fail, not fill memory or the disk. A million
-- counters export in about 90 MiB. The environment's
-- TALLY_IMPORT_MAX_BYTES sets another limit.
local MAX_IMPORT = 4 * 1024 * 1024 * 1024
local function max_import()
  local v = os.getenv("TALLY_IMPORT_MAX_BYTES")
  if v == nil or v == "" then return MAX_IMPORT, "4 GiB" end
  local n = v:match("^%d+$") and tonumber(v)
  if not n or n < 1 then
    fail("TALLY_IMPORT_MAX_BYTES must be a count of bytes, got '" .. printable(v) .. "'", 2)
  end
  return n, fmt("%d bytes", n)
end
local PHASES = { read = "check", decode = "parse", validate = "check", create = "create",
                 apply = "apply" }

function cmd.import(args)
  local o, pos = parse(args, { flags = { add = true, create = true }, min = 2, max = 2,
                               missing = "FILE ('-' for stdin)" })
  if o.help then return "help" end
  local file = pos[2]
  local shown = file == "-" and "stdin" or printable(file)
  local f, err
  if file == "-" then f = io.stdin else f, err = io.open(file, "rb") end
  if not f then fail("cannot read " .. printable(tostring(err))) end   -- (the path is in err)
  local limit, limit_text = max_import()
  -- a file is read where it is; stdin (which may be a file read from
  -- where it stands) is copied to a temporary file first, which the
  -- import reads as it checks, then again
  local size = file ~= "-" and f:seek("end") or nil
  if size then f:seek("set") end
  -- a store --create is to make is made once the file has been read and
  -- looks like an export, so a wrong file leaves no empty store behind
  local db, path
  local there = o.create and pos[1] ~= "memory" and io.open(pos[1]:match("^file:(.*)$") or pos[1], "rb")
  if there then there:close() end
  if not o.create or there or pos[1] == "memory" then db, path = open(pos[1], o.create or false) end
  local bar = (size == nil or size >= BIG) and progress("import") or nil
  term.catch_interrupt(true)
  local ok, n, msg, changing, stopped = true, nil, nil, false, false
  local function check_stop()
    if not changing and term.interrupted() then error({ stop = true }, 0) end
  end
  local src = f
  ok, err = pcall(function()
    local got, seen = 0, false                  -- seen: a byte that is not white space
    while true do
      local s, rerr = f:read(size and 4096 or BIG)
      if not s then
        if rerr then fail(shown .. ": " .. tostring(rerr)) end
        break                                     -- the end of the file
      end
      if not seen then   -- an export is a JSON object: say so before reading on
        local first = s:match("^[ \t\r\n]*()")
        local b = s:byte(first)
        if b and b ~= 123 then
          fail(fmt("%s is not a tally export: it must be a JSON object ('{' first), not %s",
                   shown, b >= 32 and b < 127 and fmt("'%s'", s:sub(first, first))
                     or fmt("byte 0x%02x", b)))
        end
        seen = b ~= nil
      end
      got = got + #s
      if got > limit or (size and size > limit) then
        fail(fmt("%s is larger than %s, the most tally import reads (TALLY_IMPORT_MAX_BYTES): "
                 .. "export and import the store in parts (tally export STORE PATTERN)",
                 shown, limit_text))
      end
      if size then                                -- a file: its first bytes were all to see
        if seen then break end
      else
        if src == f then
          local tmp
          tmp, rerr = io.tmpfile()
          if not tmp then fail("cannot make a temporary file: " .. tostring(rerr)) end
          src = tmp
        end
        if not src:write(s) then fail("cannot write a temporary file (a full disk?)") end
        if bar and got >= BIG then bar.update("read", got, nil, "bytes") end
      end
      check_stop()
    end
    if not seen then   -- nothing to decode: said before a --create makes the store
      fail(fmt("%s is not a tally export: it is empty%s", shown,
               got > 0 and " but for white space" or ""))
    end
    if src ~= f then src:seek("set") elseif size then f:seek("set") end
    if bar and got < BIG and not size then bar = nil end
    if not db then db, path = open(pos[1], true) end
    local opts = { mode = o.add and "add" or "replace" }
    opts.progress = function(phase, done, total)
      if phase == "create" or phase == "apply" then changing = true end
      check_stop()
      if bar then
        bar.update(PHASES[phase] or phase, done, total,
                   phase == "read" and "bytes" or phase ~= "decode" and "counters" or nil,
                   done == total)
      end
    end
    n, msg = db:import(src, opts)
  end)
  if src ~= f then src:close() end
  if f ~= io.stdin then f:close() end
  if bar then bar.done() end
  stopped = term.interrupted()
  term.catch_interrupt(false)
  if not ok then
    if type(err) == "table" and err.stop then
      fail("interrupted; nothing was imported", 130)
    end
    if type(err) == "string" and err:find("import: ", 1, true) then
      fail((err:gsub("^.-import: ", "", 1)))
    end
    error(err, 0)
  end
  if not n then fail(msg) end
  out(fmt("imported %d counter%s into %s (%s)\n", n, n == 1 and "" or "s", path,
          o.add and "added" or "replaced"))
  if stopped then
    io.stderr:write("tally import: Ctrl-C came after the store began to change: the import was completed\n")
  end
  return 0
end

-- 90 -> "90 s", 600 -> "10 m", 3600 -> "1 h": the largest unit that divides it.
local function duration(secs)
  for _, u in ipairs({ { 86400, "d" }, { 3600, "h" }, { 60, "m" } }) do
    if secs >= u[1] and secs % u[1] == 0 then return fmt("%d %s", floor(secs / u[1]), u[2]) end
  end
  return fmt("%g s", secs)
end

local function plural(n) return n == 1 and "" or "s" end

-- Who else has the store open, and who holds reuse back.
local function processes_text(info)
  local n = info.processes
  if n == 0 then return "no other process has the store open" end
  local text = fmt("%d other%s ha%s the store open; ", n, n == 1 and "" or "s", n == 1 and "s" or "ve")
  if info.behind == 0 then return text .. "none holds reuse back" end
  return text .. fmt("%d hold%s reuse back (furthest behind: pid %d)", info.behind,
                     info.behind == 1 and "s" or "", info.oldest_pid or 0)
end

-- One schedule identity as tally info shows it (the store keeps no pattern:
-- that lives in the processes defining the schedule).
local function schedule_text(sc)
  local every = sc.every and ("every " .. duration(sc.every)) or "every ?"
  local last = sc.last_period and ("last period " .. os.date("!%Y-%m-%d %H:%M:%S", floor(sc.last_period)) .. " UTC")
               or "not run yet"
  local holder = sc.holder and fmt(", lease taken last by pid %d", sc.holder) or ""
  return every .. ", " .. last .. holder
end

function cmd.info(args)
  local o, pos = parse(args, { flags = { json = true, check = true }, min = 1, max = 1 })
  if o.help then return "help" end
  local db, path = open(pos[1])
  local st = must(db:stats())
  local grace = must(db:grace())
  local schedules = must(peek.schedules(db))
  local fs = peek.fs(path)
  local free_in_file = st.file_bytes - st.used_bytes
  local grow = st.max_bytes - st.file_bytes
  local checked, check_msg
  if o.check then checked, check_msg = db:check() end
  local rollups = {}
  for i, sc in ipairs(schedules) do
    local keys = {}
    for _, k in ipairs({ "every", "last_period", "holder" }) do
      if sc[k] then keys[#keys + 1] = k end
    end
    rollups[i] = jobject(keys, sc)
  end
  local info = {
    store = "file:" .. path, format = st.format, counters = st.counters,
    file_bytes = st.file_bytes, used_bytes = st.used_bytes, free_bytes = free_in_file,
    max_bytes = st.max_bytes, fs_avail_bytes = fs and fs.avail or nil,
    live_bytes = st.live_bytes, retired_bytes = st.retired_bytes,
    reusable_bytes = st.reusable_bytes, reused_bytes = st.reused_bytes,
    expired = st.expired, capped = st.capped,
    -- this command has the store open too (idle: it holds nothing back)
    processes = grace.processes > 0 and grace.processes - 1 or 0, behind = grace.behind,
    oldest_pid = grace.oldest_pid ~= 0 and grace.oldest_pid or nil,
    writers = st.writers, rollups = { json = "[" .. concat(rollups, ",") .. "]" },
  }
  if o.check then info.check = checked and "ok" or check_msg end
  if o.json then
    local keys = { "store", "format", "counters", "file_bytes", "used_bytes", "free_bytes",
                   "max_bytes", "fs_avail_bytes", "live_bytes", "retired_bytes", "reusable_bytes",
                   "reused_bytes", "expired", "capped", "processes", "behind", "oldest_pid",
                   "writers", "rollups" }
    if o.check then keys[#keys + 1] = "check" end
    out(jobject(keys, info), "\n")
  else
    local lines = {
      { "store", info.store },
      { "format", tostring(st.format) },
      { "counters", tostring(st.counters) },
      { "file size", fmt("%s (%d bytes)", bytes(st.file_bytes), st.file_bytes) },
      { "used", fmt("%s; %s free inside the file", bytes(st.used_bytes), bytes(free_in_file)) },
      { "can grow", fmt("by %s more (limit %s)%s", bytes(grow), bytes(st.max_bytes),
                        fs and fmt("; %s free on the file system", bytes(fs.avail)) or "") },
      { "live", fmt("%s in use", bytes(st.live_bytes)) },
      { "retired", fmt("%s (left by drop, expiry, reshard, index growth: in its grace period)",
                       bytes(st.retired_bytes)) },
      { "reusable", fmt("%s (past it: handed out again before the file grows)",
                        bytes(st.reusable_bytes)) },
      { "reused", fmt("%s handed out again so far", bytes(st.reused_bytes)) },
      { "expired", fmt("%d counter%s expired for idleness", st.expired, plural(st.expired)) },
      { "capped", fmt("%d new name%s sent to an overflow counter", st.capped, plural(st.capped)) },
      { "processes", processes_text(info) },
      { "writers", fmt("%d thread ticket%s drawn", st.writers, st.writers == 1 and "" or "s") },
    }
    if #schedules == 0 then lines[#lines + 1] = { "rollups", "none" } end
    for i, sc in ipairs(schedules) do
      lines[#lines + 1] = { i == 1 and "rollups" or "", schedule_text(sc) }
    end
    if o.check then lines[#lines + 1] = { "check", info.check } end
    for _, l in ipairs(lines) do out(fmt("%-10s %s\n", l[1], l[2])) end
  end
  if o.check and not checked then return 1 end
  return 0
end

-- The length of the file at path, or nil, message.
local function file_size(path)
  local f, msg = io.open(path, "rb")
  if not f then return nil, msg end
  local n, smsg = f:seek("end")
  f:close()
  return n, smsg
end

function cmd.compact(args)
  local o, pos = parse(args, { min = 1, max = 1 })
  if o.help then return "help" end
  local uri = pos[1]
  if uri == "memory" then
    fail("'memory' is a store of one process, empty here: give a file store (file:PATH or a path)")
  end
  local path = uri:match("^file:(.*)$") or uri
  if path == "" then fail("empty store path in '" .. uri .. "'") end
  local before, msg = file_size(path)
  if not before then
    if msg:find("No such file or directory$") then fail(fmt("no store at %s (no such file)", printable(path))) end
    fail(printable(msg))                  -- (the path is in msg)
  end
  local compact = tally.compact or require("tally.core").compact
  if not compact then fail("this build of tally has no compact") end
  -- the rewrite cannot stop half-way: Ctrl-C is noted, not raised
  local bar, total = progress("compact"), nil
  term.catch_interrupt(true)
  local ok, done, cmsg, ccode = pcall(compact, "file:" .. path, function(n, of)
    total = of
    if bar then pcall(bar.update, "rewrite", n, of, "counters", n == of) end
  end, { trust = trust })
  if bar then bar.done() end
  local stopped = term.interrupted()
  term.catch_interrupt(false)
  if not ok then error(done, 0) end
  if not done then                            -- EBUSY names a process that has it open
    fail(trust_hint(tostring(cmsg), ccode))
  end
  if not bar and total then
    io.stderr:write(fmt("compact: %d counter%s rewritten\n", total, plural(total)))
  end
  local after = file_size(path) or 0
  out(fmt("compacted %s: %s -> %s (%d -> %d bytes)\n", path, bytes(before), bytes(after),
          before, after))
  if stopped then
    io.stderr:write("tally compact: Ctrl-C came while compacting: the compaction was completed\n")
  end
  return 0
end

function cmd.watch(args)
  local o, pos = parse(args, { values = { interval = true, sort = true }, min = 1, max = 2 })
  if o.help then return "help" end
  local interval = 1
  if o.interval then
    interval = tonumber(o.interval)
    if not interval or interval ~= interval or interval < 0.1 or interval > 3600 then
      usage_error("--interval must be seconds from 0.1 to 3600, got '" .. printable(o.interval) .. "'")
    end
  end
  local sort = o.sort or "rate"
  if sort ~= "rate" and sort ~= "value" and sort ~= "name" then
    usage_error("--sort must be rate, value or name, got '" .. printable(sort) .. "'")
  end
  local db, path = open(pos[1])
  must(db:top(pos[2], 1))                -- a damaged store: said before the screen is taken
  if not term.isatty(1) then
    fail("needs a terminal (stdout is not one); 'tally ls' lists the counters once")
  end
  return require("tally.cmd.watch").run(db, { store = "file:" .. path, pattern = pos[2],
                                          interval = interval, sort = sort })
end

function cmd.serve(args)
  local o, pos = parse(args, { values = { listen = true, auth = true, connections = true,
                                          timeout = true, families = true, nice = true },
                               min = 1, max = 1 })
  if o.help then return "help" end
  local serve = require "tally.cmd.serve"
  local host, port = serve.parse_listen(o.listen or "127.0.0.1:9145")
  if not host then usage_error(port) end
  local auth_text = o.auth or os.getenv("TALLY_SERVE_AUTH")
  if auth_text == "" and not o.auth then auth_text = nil end
  local auth, amsg = serve.parse_auth(auth_text)
  if amsg then usage_error(amsg) end
  if not serve.loopback(host) and not auth then
    usage_error(fmt("listening on %s is beyond loopback: give --auth TOKEN or --auth USER:PASS",
                    printable(o.listen)))
  end
  local function num(k, lo, hi, default)
    if o[k] == nil then return default end
    local n = o[k]:find("^%d+$") and tonumber(o[k])
    if mtype(n) ~= "integer" or n < lo or n > hi then
      usage_error(fmt("--%s must be an integer from %d to %d, got '%s'", k, lo, hi, printable(o[k])))
    end
    return n
  end
  local connections = num("connections", 1, 100000, 256)
  local timeout = num("timeout", 1, 3600, 10)
  local niceness = num("nice", 0, 19, 12)
  local uri = pos[1]
  local families
  if o.families then
    local lerr
    families, lerr = loadfile(o.families)
    if not families then fail("--families: " .. printable(lerr)) end
  end
  local function open_it()
    -- handles kept weakly: collected, they leave the server idle (serve.lua)
    local db, msg = _M.open_store(uri, { memory = false, trust = trust, help = "serve",
                                         handle_cache = 0 })
    if db and families then
      local ok, ferr = serve.families(db, families, o.families)
      if not ok then
        db:close()
        return nil, ferr, "families"
      end
    end
    return db, msg
  end
  local db, path, why = open_it()
  if why == "families" then fail(printable(path)) end
  if not db then
    -- missing: nothing to serve; there but unreadable: 503 until it reads
    local p = type(uri) == "string" and (uri:match("^file:(.*)$") or uri) or ""
    local f = p ~= "" and uri ~= "memory" and io.open(p, "rb")
    if not f then fail(path) end
    f:close()
    io.stderr:write("tally serve: ", printable(path), " (answering 503 until it can be read)\n")
    path = p
  end
  local status, msg = serve.run({ db = db or nil, open = open_it, store = "file:" .. path, auth = auth },
                                { host = host, port = port, connections = connections,
                                  per_ip = math.min(32, connections), timeout = timeout,
                                  memory = 32768, nice = niceness })
  if not status then fail(msg) end
  return status
end

-- The manual page (roff), made from the same USAGE and HELP texts: the
-- build writes it to tally.1 with `tally help --man`, so the help has one
-- source.
local function roff(text)
  return (text:gsub("\\", "\\e"):gsub("\n([.'])", "\n\\&%1"):gsub("^([.'])", "\\&%1"))
end

function _M.man()
  local parts = {
    '.TH TALLY 1 "" "tally ' .. tally.version .. '" "User Commands"',
    ".SH NAME",
    "tally \\- Lua prompt, script runner and inspector for tally counter stores",
    ".SH SYNOPSIS", ".nf", roff(USAGE.tally), ".fi",
    ".SH DESCRIPTION", ".nf", roff(HELP.tally), ".fi",
    ".SH COMMANDS",
  }
  for _, name in ipairs({ "run", "ls", "get", "incr", "export", "import", "info", "compact", "watch",
                          "serve", "help" }) do
    parts[#parts + 1] = ".SS " .. name
    parts[#parts + 1] = ".nf"
    parts[#parts + 1] = roff(USAGE[name])
    parts[#parts + 1] = ""
    parts[#parts + 1] = roff(HELP[name])
    parts[#parts + 1] = ".fi"
  end
  parts[#parts + 1] = ".SH SEE ALSO"
  parts[#parts + 1] = "The tally documentation: README.md and docs/ in the source tree."
  return concat(parts, "\n") .. "\n"
end

function cmd.help(args)
  local name = args[1]
  if name == "--man" then
    out(_M.man())
    return 0
  end
  if name == "-h" or name == "--help" then name = "help" end
  if name == nil or name == "tally" then
    out("usage: " .. USAGE.tally .. "\n\n" .. HELP.tally)
    return 0
  end
  if not HELP[name] then
    usage_error("no command '" .. printable(name) .. "' (commands: " .. concat(COMMANDS, ", ") .. ")")
  end
  out(help_text(name))
  return 0
end

-- ---- entry points ------------------------------------------------------------------

local function distance(a, b)
  local d = {}
  for i = 0, #a do d[i] = { [0] = i } end
  for j = 0, #b do d[0][j] = j end
  for i = 1, #a do
    for j = 1, #b do
      local c = a:sub(i, i) == b:sub(j, j) and 0 or 1
      d[i][j] = math.min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + c)
    end
  end
  return d[#a][#b]
end

-- unknown(word): the first argument was neither a command nor a file.
function _M.unknown(word)
  local best, bd = nil, 3
  for _, c in ipairs(COMMANDS) do
    local d = distance(word, c)
    if d < bd then best, bd = c, d end
  end
  io.stderr:write(fmt("tally: '%s' is neither a command nor a script file%s\n"
                      .. "Run 'tally help' for the commands.\n", printable(word),
                      best and fmt(" (did you mean '%s'?)", best) or ""))
  return 2
end

local function handler(e)
  if getmetatable(e) == Fail then return e end
  if type(e) == "string" and e:find("interrupted!$") then   -- Ctrl-C (cli_docall's hook)
    return setmetatable({ msg = "interrupted", status = 130 }, Fail)
  end
  return debug.traceback(tostring(e), 2)
end

-- main(command, args...) -> exit status
function _M.main(name, ...)
  local args = { ... }
  local f = cmd[name]
  if not f then return _M.unknown(tostring(name)) end
  current = name
  local ok, res = xpcall(f, handler, args)
  io.stdout:flush()
  if ok then
    if res == "help" then
      out(help_text(name))
      return 0
    end
    return res or 0
  end
  if getmetatable(res) == Fail then
    io.stderr:write("tally ", name, ": ", printable(tostring(res.msg), true), "\n")
    return res.status
  end
  io.stderr:write("tally ", name, ": ", tostring(res), "\n")
  return 1
end

return _M
