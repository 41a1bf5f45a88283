-- tally.sink: where rollup records go.
--
--   tally.sink.file{ path = , max_queue = }          JSON lines, appended
--   tally.sink.http{ url = , format = "json" | "prometheus" | "influx",
--                    headers = , timeout = , max_queue = , batch = ,
--                    measurement = , precision = }     via libcurl
--   tally.sink.fn(f [, { max_queue = }])  or a plain function: f(record)
--
-- Every sink takes every record of its schedule, in order, and never blocks
-- a tick for long: HTTP bodies go to a background thread (core.sender);
-- file and function sinks deliver at the tick and keep what failed for the
-- next one. Each sink holds at most max_queue records (default 100000);
-- past that the oldest are dropped and counted. sink:stats() gives
-- { sent, failures, dropped, queued, last_error }.

local core = require "tally.core"
-- tally.format is loaded on first use: sinks that never format need not
-- pay for lua-cjson.
local format = setmetatable({}, { __index = function(t, k)
  local m = require "tally.format"
  setmetatable(t, { __index = m })
  return m[k]
end })

local type, error, pcall, tostring, pairs, ipairs = type, error, pcall, tostring, pairs, ipairs
local tointeger = require("tally.compat").tointeger
local json = require "tally.json"          -- small; it loads lua-cjson on first decode
local check_self = require("tally.util").self
local concat = table.concat
local fmt = string.format

local argerror = require("tally.util").argerror
local describe, printable = require("tally.util").describe, require("tally.util").printable

local _M = {}

local DEFAULT_QUEUE = 100000

local function check_opts(opts, allowed, what, level)
  if type(opts) ~= "table" then
    argerror(1, what, fmt("options table expected, got %s", type(opts)), level + 1)
  end
  for k in pairs(opts) do
    if not allowed[k] then
      local names = {}
      for n in pairs(allowed) do names[#names + 1] = n end
      table.sort(names)
      argerror(1, what, fmt("unknown option '%s'; expected %s",
                printable(tostring(k)), concat(names, ", ")), level + 1)
    end
  end
end

local function check_count(v, name, what, default, level)
  if v == nil then return default end
  local n = tointeger(v)
  if not n or n < 1 then
    argerror(1, what, fmt("%s must be a positive integer, got %s", name,
              printable(tostring(v))), level + 1)
  end
  return n
end

-- A sink's push or pump raised (a bug in a sink object, or a closed
-- sink): the n records it was given are lost to it, and counted, and the
-- tick goes on.
function _M.failed(s, err, n)
  s.lost = (s.lost or 0) + n
  s.lost_error = tostring(err)
end

-- Stats with what failed() counted folded in.
local function with_lost(s, st)
  if s.lost then
    st.dropped = (st.dropped or 0) + s.lost
    st.failures = (st.failures or 0) + 1
    st.last_error = s.lost_error
  end
  return st
end
_M.with_lost = with_lost

-- ---- sinks delivered from Lua: a bounded queue ----------------------------------

local Queued = { __name = "tally.sink" }
Queued.__index = Queued

local function queued(kind, deliver, max_queue)
  return setmetatable({ kind = kind, deliver = deliver, max_queue = max_queue,
                        q = {}, head = 1, tail = 0, sent = 0, failures = 0,
                        dropped = 0, last_error = "" }, Queued)
end

function Queued:push(recs)
  check_self(self, "tally.sink", "push")
  if self.closed then return _M.failed(self, "sink is closed", #recs) end
  local q = self.q
  for i = 1, #recs do
    self.tail = self.tail + 1
    q[self.tail] = recs[i]
  end
  local over = (self.tail - self.head + 1) - self.max_queue
  if over > 0 then  -- drop the oldest: the newest values matter most
    for i = self.head, self.head + over - 1 do q[i] = nil end
    self.head = self.head + over
    self.dropped = self.dropped + over
  end
  self:pump()
end

-- Deliver what is queued, oldest first: deliver(q, from, to) returns how
-- many records went through and, if it stopped early, why. The rest wait
-- for the next tick.
function Queued:pump()
  check_self(self, "tally.sink", "pump")
  if self.head > self.tail then return true end
  local ok, n, err = pcall(self.deliver, self.q, self.head, self.tail)
  if not ok then n, err = 0, n end
  for i = self.head, self.head + n - 1 do self.q[i] = nil end
  self.head = self.head + n
  self.sent = self.sent + n
  if err ~= nil then
    self.failures = self.failures + 1
    self.last_error = tostring(err)
  end
  if self.head > self.tail then self.head, self.tail = 1, 0 end
  return err == nil
end

function Queued:flush()
  check_self(self, "tally.sink", "flush")
  return self:pump() and self.head > self.tail
end

function Queued:stats()
  check_self(self, "tally.sink", "stats")
  return with_lost(self, { kind = self.kind, sent = self.sent, failures = self.failures,
                           dropped = self.dropped, queued = self.tail - self.head + 1,
                           last_error = self.last_error })
end

function Queued:close()
  check_self(self, "tally.sink", "close")
  self:pump()
  local left = self.tail - self.head + 1
  self.dropped = self.dropped + left
  self.q, self.head, self.tail = {}, 1, 0
  self.closed = true
end

-- tally.sink.fn(f [, { max_queue = }]): f(record) for each record. If f
-- raises, that record and the ones after it wait for the next tick.
function _M.fn(f, opts)
  if type(f) ~= "function" then
    argerror(1, "fn", "function expected, got " .. type(f), 2)
  end
  opts = opts or {}
  check_opts(opts, { max_queue = true }, "fn", 2)
  local max_queue = check_count(opts.max_queue, "max_queue", "fn", DEFAULT_QUEUE, 2)
  return queued("function", function(q, from, to)
    for i = from, to do
      local r = q[i]  -- a copy: other sinks share the record
      local ok, err = pcall(f, { name = r.name, value = r.value, at = r.at,
                                 delta = r.delta, rate = r.rate })
      if not ok then return i - from, err end
    end
    return to - from + 1
  end, max_queue)
end

-- tally.sink.file{ path = [, max_queue = ] } or tally.sink.file(path):
-- one JSON object per line, appended; the file is opened for each batch so
-- it can be rotated underneath.
function _M.file(opts)
  if type(opts) == "string" then opts = { path = opts } end
  check_opts(opts, { path = true, max_queue = true }, "file", 2)
  if type(opts.path) ~= "string" or #opts.path == 0 then
    argerror(1, "file", "path must be a non-empty string, got "
          .. tostring(opts.path), 2)
  end
  local path = opts.path
  local max_queue = check_count(opts.max_queue, "max_queue", "file", DEFAULT_QUEUE, 2)
  local s = queued("file", function(q, from, to)
    local lines = {}
    for i = from, to do lines[#lines + 1] = format.json(q[i]) end
    lines[#lines + 1] = ""
    local f, err = io.open(path, "a")
    if not f then return 0, err end
    local ok, werr = f:write(concat(lines, "\n"))
    local cok, cerr = f:close()
    if not ok or not cok then return 0, werr or cerr end
    return to - from + 1
  end, max_queue)
  s.path = path
  return s
end

-- ---- HTTP ------------------------------------------------------------------------------

local Http = { __name = "tally.sink" }
Http.__index = Http

local CONTENT_TYPE = {
  json = "application/json",
  prometheus = "text/plain; version=0.0.4",
  influx = "text/plain; charset=utf-8",
}

-- InfluxDB precisions that name one unit
local SAME_UNIT = { n = "ns", ns = "ns", u = "u", us = "u", ms = "ms", s = "s", m = "m", h = "h" }

local HTTP_OPTIONS = { url = true, format = true, headers = true, timeout = true,
                       max_queue = true, batch = true, measurement = true,
                       precision = true, method = true, spool = true }

-- ---- the spool: records an HTTP sink has not delivered yet, on disk -----------
--
-- With spool = DIR (or true: STORE.spool beside the file store), every
-- record is appended to this sink's own file in DIR, fdatasync'ed, before
-- it is posted: one JSON object per line, with its identity in "id"
-- ("NAME|EVERY|AT_MS": the counter, the schedule's period length, the
-- period's time). When everything this sink posted has been delivered the
-- file is removed. A file left behind (the process exited or died with
-- records undelivered) is taken over by the next sink for the same url and
-- format that sees it (at its schedule's definition and then every
-- RECOVER_EVERY seconds): its records are appended to the taker's own
-- file and posted before the taker's new ones. A file is taken by
-- renaming it into the taker's name, so two processes never take one file;
-- it is taken only when the process named in it is gone (/proc/PID). So
-- delivery is at least once: a receiver drops duplicates by "id".

local RECOVER_EVERY = 10     -- seconds between two looks for files left behind
local spool_seq = 0

-- A file name for the url: two 32-bit hashes as 16 hex digits (djb2 alone,
-- as before 0.1.1, made "/hook/ab" and "/hook/bA" one name, so one url's
-- records could go to the other). legacy: the djb2 half, the name files
-- left by the old version have, which are still taken.
local function url_key(str, legacy)
  local h, g = 5381, 7
  for i = 1, #str do
    local c = str:byte(i)
    h = (h * 33 + c) % 4294967296
    g = (g * 131 + c) % 4294967291        -- a prime: not djb2's collisions
  end
  if legacy then return fmt("%08x", h) end
  return fmt("%08x%08x", h, g)
end

local function process_alive(pid)
  local f = io.open("/proc/" .. pid .. "/stat", "rb")
  if f then f:close() end
  return f ~= nil
end

local live_files = {}        -- names of the spool files this process writes or takes

local function unique_name(sp)
  spool_seq = spool_seq + 1
  return fmt("%s%d-%x%x", sp.prefix, core.getpid(), math.floor(core.now() * 1000) % 4294967296,
             spool_seq)
end

-- The label names of a Pushgateway group url's grouping key
-- (.../metrics/job/NAME[/LABEL/VALUE...], a name may end in @base64), or
-- nil: the Pushgateway sets them on every series pushed there.
local function grouping_labels(url)
  local path = url:match("^https?://[^/?#]*(/[^?#]*)")
  local rest = path and path:match("^.-/metrics/(.*)$")
  if not rest then return nil end
  local keys, i = {}, 0
  for seg in rest:gmatch("[^/]+") do
    i = i + 1
    if i % 2 == 1 then keys[(seg:gsub("@base64$", ""))] = true end
  end
  return keys
end

-- tally.sink.http{ url = , format = "json" | "prometheus" | "influx", ... }
--   json:       POST a JSON array of records (a webhook)
--   prometheus: POST text exposition (a Pushgateway group URL,
--               http://host:9091/metrics/job/NAME[/label/value...])
--   influx:     POST line protocol (http://host:8086/write?db=NAME)
function _M.http(opts)
  check_opts(opts, HTTP_OPTIONS, "http", 2)
  local fmt_name = opts.format or "json"
  if not CONTENT_TYPE[fmt_name] then
    argerror(1, "http", "format must be json, prometheus or influx, got "
          .. printable(tostring(fmt_name)), 2)
  end
  if type(opts.url) ~= "string" or not opts.url:match("^https?://.") then
    argerror(1, "http", "url must be an http:// or https:// URL, got "
          .. printable(tostring(opts.url)), 2)
  end
  local batch = check_count(opts.batch, "batch", "http", 1000, 2)
  local headers = { "Content-Type: " .. CONTENT_TYPE[fmt_name] }
  if opts.headers ~= nil then
    if type(opts.headers) ~= "table" then
      argerror(1, "http", "headers must be a table, got " .. type(opts.headers), 2)
    end
    for k, v in pairs(opts.headers) do
      if type(k) == "string" and type(v) == "string" then
        headers[#headers + 1] = k .. ": " .. v
      elseif type(k) == "number" and type(v) == "string" then
        headers[#headers + 1] = v
      else
        argerror(1, "http", "headers must map names to strings", 2)
      end
    end
  end
  local precision = opts.precision
  if fmt_name == "influx" then
    -- the url's precision is the one InfluxDB reads the timestamps in
    local url_precision = opts.url:match("[?&]precision=([^&#]*)")
    if url_precision == "" then url_precision = nil end   -- InfluxDB: ns
    if precision ~= nil and not url_precision then
      argerror(1, "http", "the url must carry precision=" .. printable(tostring(precision))
               .. " too, so InfluxDB reads the timestamps as sent", 2)
    end
    if precision ~= nil and SAME_UNIT[precision] ~= SAME_UNIT[url_precision] then
      argerror(1, "http", "precision " .. describe(precision) .. " but the url has precision="
               .. printable(url_precision) .. ": InfluxDB would read the timestamps in the url's", 2)
    end
    precision = precision or url_precision or "ns"
    -- what format.influx refuses (a measurement, a precision), refused now:
    -- at the tick it would drop every record
    local ok, err = pcall(format.influx, {}, { measurement = opts.measurement,
                                               precision = precision })
    if not ok then argerror(1, "http", (err:gsub("^bad argument #%d+ to 'influx' %((.*)%)$", "%1")), 2) end
  end
  local ok, sender = pcall(core.sender, {
    url = opts.url, method = opts.method, headers = headers, timeout = opts.timeout,
    max_queue = opts.max_queue,
  })
  if not ok then error(sender, 2) end
  local spool
  if opts.spool ~= nil then
    if opts.spool ~= true and (type(opts.spool) ~= "string" or opts.spool == "") then
      argerror(1, "http", "spool must be a directory path or true, got "
            .. tostring(opts.spool), 2)
    end
    spool = { dir = opts.spool, posted = 0, sent0 = 0, stuck = false, errors = 0 }
  end
  return setmetatable({ kind = "http", format = fmt_name, url = opts.url, batch = batch,
                        sender = sender, measurement = opts.measurement,
                        precision = precision, spool = spool,
                        grouping = fmt_name == "prometheus" and grouping_labels(opts.url) or nil },
                      Http)
end

-- ---- the spool (see the top of this part) ----

local function spooled_record(line)       -- a spool line back to its record, exactly
  local t = json.decode(line)             -- a name that is not UTF-8 comes back as its bytes
  if type(t) ~= "table" or type(t.name) ~= "string" or type(t.id) ~= "string" then
    return nil
  end
  local head = '{"name":' .. format.json_string(t.name) .. ',"value":'
  if line:sub(1, #head) ~= head then      -- or a line of a version before \udcXX
    head = '{"name":' .. json.quote_bytes(t.name) .. ',"value":'
    if line:sub(1, #head) ~= head then return nil end
  end
  local rest = line:sub(#head + 1)         -- no string before "id" is left in it
  local v = tointeger(rest:match("^(%-?%d+)"))
  if not v then return nil end
  local d = rest:match(',"delta":(%-?%d+)')
  local rate = t.rate
  if type(rate) ~= "number" then rate = nil end
  return { name = t.name, value = v, at = t.at, delta = d and tointeger(d), rate = rate, id = t.id }
end

-- Make the spool directory and this sink's file name (spool = true needs
-- the store: STORE.spool). true, or nil and why.
local function spool_ready(self, db)
  local sp = self.spool
  if sp.file then return true end
  local dir = sp.dir
  if dir == true then
    local path = db ~= nil and tostring(db):match("^tally%.store %(file:(.*)%)$")
    if not path then return nil, "spool = true needs a file store (or give spool a directory)" end
    dir = path .. ".spool"
  end
  local ok, err = core.spool_mkdir(dir)
  if not ok then return nil, err end
  sp.dir = dir
  sp.prefix = "http-" .. url_key(self.format .. " " .. self.url) .. "."
  sp.legacy = "http-" .. url_key(self.format .. " " .. self.url, true) .. "."
  sp.base = unique_name(sp) .. ".spool"
  sp.file = dir .. "/" .. sp.base
  live_files[sp.base] = true
  return true
end

local function spool_error(self, err)
  self.spool.errors = self.spool.errors + 1
  self.spool.last_error = tostring(err)
end

-- Encode and post records in batches; returns how many were posted and
-- how many could not be encoded (dropped: they never will be). What cannot
-- be encoded or queued is counted as failed.
local function post_records(self, recs, db)
  local posted_n, unencodable = 0, 0
  local batch = self.format == "prometheus" and #recs or self.batch
  for from = 1, #recs, batch do
    local to = math.min(from + batch - 1, #recs)
    local part = {}
    for i = from, to do part[#part + 1] = recs[i] end
    local ok, body = self:encode(part, db)
    if not ok and self.format ~= "prometheus" then  -- keep the records that encode
      local good = {}
      for _, r in ipairs(part) do
        if self:encode({ r }, db) then good[#good + 1] = r end
      end
      _M.failed(self, body, #part - #good)
      unencodable = unencodable + #part - #good
      part = good
      if #part > 0 then ok, body = self:encode(part, db) end
    elseif not ok then
      _M.failed(self, body, #part)
      unencodable = unencodable + #part
    end
    if ok and #part > 0 then
      local posted, err = self.sender:post(body, #part)
      if not posted then _M.failed(self, err, #part) else posted_n = posted_n + #part end
    end
  end
  return posted_n, unencodable
end

-- Everything posted since the file was last emptied is delivered: empty it
-- (and the files taken from dead processes that could not be copied into
-- it, sp.held).
local function spool_settle(self)
  local sp = self.spool
  if not sp.file or sp.stuck or sp.posted == 0 then return end
  local st = self.sender:stats()
  if st.sent - sp.sent0 >= sp.posted and st.queued == 0 then
    os.remove(sp.file)
    for _, f in ipairs(sp.held or {}) do
      os.remove(sp.dir .. "/" .. f)
      live_files[f] = nil
    end
    sp.held = nil
    sp.sent0, sp.posted = sp.sent0 + sp.posted, 0
  end
end

-- Append records (with their ids) to this sink's file and post them.
-- durable: they are on disk already (in a file taken from a dead process).
-- Returns whether the append succeeded.
local function spool_post(self, recs, db, durable)
  local sp = self.spool
  local lines = {}
  for i, r in ipairs(recs) do
    local ok, line = pcall(format.json, r)
    lines[i] = ok and line or nil
  end
  local ok, err = core.spool_append(sp.file, concat(lines, "\n") .. "\n")
  if not ok then spool_error(self, err) end
  local n, unencodable = post_records(self, recs, db)
  sp.posted = sp.posted + n
  -- in a file, never posted: keep it (what cannot be encoded is dropped)
  if (ok or durable) and n + unencodable < #recs then sp.stuck = true end
  return ok
end

-- Take over the files of sinks for this url and format whose process is
-- gone, and post their records first. At most every RECOVER_EVERY seconds.
local function spool_recover(self, db, force)
  local sp = self.spool
  local now = core.now()
  if not force and sp.checked and now - sp.checked < RECOVER_EVERY then return end
  sp.checked = now
  local names = core.spool_list(sp.dir)
  if not names then return end
  table.sort(names)
  local pat = "^" .. sp.prefix:gsub("%p", "%%%0") .. "(%d+)%-"
  local old = "^" .. sp.legacy:gsub("%p", "%%%0") .. "(%d+)%-"
  local mypid = core.getpid()
  for _, n in ipairs(names) do
    local pid = tonumber(n:match(pat) or n:match(old) or "")
    if pid and not live_files[n] and (pid == mypid or not process_alive(pid)) then
      local base = unique_name(sp) .. ".take"
      local take = sp.dir .. "/" .. base
      live_files[base] = true
      if os.rename(sp.dir .. "/" .. n, take) then   -- ours now: nobody else has it
        local f, ferr = io.open(take, "rb")
        local data = f and f:read("a")
        if f then f:close() end
        local recs = {}
        for line in (data or ""):gmatch("[^\n]+") do   -- a torn last line (a crash mid-write) is left out
          recs[#recs + 1] = spooled_record(line)
        end
        if not data then     -- unreadable (another user's): leave it, and say so
          os.rename(take, sp.dir .. "/" .. n)
          live_files[base] = nil
          spool_error(self, ferr or ("cannot read " .. take))
        elseif #recs == 0 or spool_post(self, recs, db, true) then
          os.remove(take)
          live_files[base] = nil
        else          -- not copied into ours (a full disk): ours until delivered
          sp.held = sp.held or {}
          sp.held[#sp.held + 1] = base
        end
      else
        live_files[base] = nil
      end
    end
  end
end

-- Called by db:rollup with the store: the spool is set up and files left
-- behind are delivered now, before any new record.
function Http:_attach(db)
  self.db = db
  if not self.spool then return end
  local ok, err = spool_ready(self, db)
  if not ok then return spool_error(self, err) end
  spool_recover(self, db, true)
end

local function identity(r, every)   -- every in the fewest digits: 0.2, not 0.20000000000000001
  local at = type(r.at) == "number" and math.floor(r.at * 1000 + 0.5) or 0
  return fmt("%s|%s|%d", r.name, every and format.json_number(every) or "-", at)
end

-- Encode records[from..to] as one body: nil, message if it cannot be.
function Http:encode(part, db)
  if self.format == "json" then return pcall(format.json_array, part) end
  if self.format == "influx" then
    return pcall(format.influx, part, { measurement = self.measurement, precision = self.precision })
  end
  local prometheus = require "tally.prometheus"   -- (it requires this module's format)
  local c = prometheus.mapping_of(db)
  if self.grouping then
    -- a series with a label of the group's key (a family's label 'job'):
    -- the Pushgateway replaces its value, so two such counters are one
    -- series and it refuses the whole body; left out and counted
    local keep, why = {}, nil
    for _, r in ipairs(part) do
      local clash
      for _, l in ipairs(prometheus._series_labels(c, r.name)) do
        if self.grouping[l] then clash = l; break end
      end
      if clash then
        why = why or fmt("counter '%s' has the label '%s', which the Pushgateway group url "
                         .. "sets on every series: give the family another label name", r.name, clash)
      else
        keep[#keep + 1] = r
      end
    end
    -- none left: nothing to push (the caller counts them; an empty body
    -- PUT would empty the group of what other pushes put there)
    if why and #keep == 0 then return false, why end
    if why then _M.failed(self, why, #part - #keep); part = keep end
  end
  -- lenient: a counter that cannot be exposed (two counters mapping to one
  -- series, an ambiguous name) is left out and counted, not the whole body
  local text, skipped = prometheus._render_prometheus(part, c, nil, true)
  if not text then return false, skipped end
  if #skipped > 0 then
    if #skipped == #part then return false, skipped[1].msg end   -- none left, as above
    _M.failed(self, skipped[1].msg, #skipped)
  end
  return true, text
end

-- Queue the records as request bodies. A record that cannot be encoded
-- (a name line protocol cannot carry, two counters mapped to one
-- Prometheus series) is dropped and counted, never the whole tick.
-- Prometheus goes as one body per tick: a Pushgateway POST replaces the
-- group's metrics of the same names, so batches would undo each other.
function Http:push(recs, db, sch)
  check_self(self, "tally.sink", "push")
  if self.closed then return _M.failed(self, "sink is closed", #recs) end
  if self.spool then
    local ok, err = spool_ready(self, db)
    if ok then
      spool_settle(self)
      spool_recover(self, db)
      local every = type(sch) == "table" and sch.every or nil
      local list = {}
      for i, r in ipairs(recs) do      -- copies: other sinks share the records
        list[i] = { name = r.name, value = r.value, at = r.at, delta = r.delta, rate = r.rate,
                    id = identity(r, every) }
      end
      return spool_post(self, list, db)
    end
    spool_error(self, err)
  end
  post_records(self, recs, db)
end

function Http:pump()                  -- the sender thread retries by itself
  check_self(self, "tally.sink", "pump")
  if self.spool and self.spool.file and not self.closed then
    spool_settle(self)
    spool_recover(self, self.db)
  end
  return true
end

function Http:flush(timeout)
  check_self(self, "tally.sink", "flush")
  if self.closed then return true end
  local ok, err, code = self.sender:flush(timeout or 5)
  if self.spool then spool_settle(self) end
  return ok, err, code
end

function Http:stats()
  check_self(self, "tally.sink", "stats")
  local st = self.final or self.sender:stats()
  local out = {}
  for k, v in pairs(st) do out[k] = v end
  out.kind = "http"
  local sp = self.spool
  if sp then                      -- records in the spool file not known delivered
    out.spool_file = sp.file
    out.spooled = math.max(0, sp.posted - (st.sent - sp.sent0))
    out.spool_errors, out.spool_last_error = sp.errors, sp.last_error
  end
  return with_lost(self, out)
end

-- close([drain]): deliver for up to drain seconds (default 0), then stop;
-- records pushed afterwards are counted as dropped.
function Http:close(drain)
  check_self(self, "tally.sink", "close")
  if drain ~= nil and (type(drain) ~= "number" or drain ~= drain or drain < 0) then
    argerror(1, "close", "drain must be a number of seconds >= 0, got " .. describe(drain), 2)
  end
  if self.closed then return end
  if drain and drain > 0 then self.sender:flush(drain) end
  local sp = self.spool
  if sp then
    spool_settle(self)                 -- what is left stays in the file, for the next
    if sp.base then live_files[sp.base] = nil end   -- sink, this process's too
    for _, f in ipairs(sp.held or {}) do live_files[f] = nil end
  end
  local st = self.sender:stats()
  self.sender:close(0)
  st.dropped, st.queued = st.dropped + st.queued, 0  -- what close threw away
  self.final, self.closed = st, true
end


-- A sink as given in a schedule's sinks list (the i-th): a sink object or
-- a plain function.
function _M.wrap(s, i)
  if type(s) == "function" then return _M.fn(s) end
  if type(s) == "table" and type(s.push) == "function" and type(s.stats) == "function" then
    return s
  end
  argerror(2, "rollup", fmt("sinks[%d] must be a sink (tally.sink.file, "
            .. "tally.sink.http, tally.sink.fn) or a function, got %s", i, type(s)), 3)
end

return _M
