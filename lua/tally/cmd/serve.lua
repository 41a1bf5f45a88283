-- tally.cmd.serve: `tally serve STORE`, the store's Prometheus exporter, its
-- JSON API and a live dashboard, over HTTP (tally.httpd, src/cli/cli_httpd.c).
--
-- Runs only under the `tally` command (Lua 5.4; tally.httpd and tally.peek
-- are preloaded by it). Everything it reads goes through the library's
-- lock-free reads (the C walks of db:values, db:top, db:sum, tally.peek):
-- it never creates a counter, never ticks, never writes the store, so the
-- processes writing it never wait for it. One thread: the HTTP loop calls
-- handle(req) for each request; a /metrics body is a producer the loop
-- pulls pieces from, so a scrape of many counters is cut into steps with
-- other requests served between them.
--
-- Answers: 200 with JSON (tally.json: integers exact, names as bytes), 400
-- for a bad query (its message says which parameter and what it takes),
-- 401 without the credentials --auth names, 404 for another path, 405 for
-- a method other than GET or HEAD, 503 with the store's own message when
-- the store cannot be read (damaged, truncated, not a tally store).

local tally = require "tally"
local httpd = require "tally.httpd"
local peek = require "tally.peek"
local json = require "tally.json"
local dashboard = require "tally.cmd.dashboard"

local tostring, tonumber, ipairs, pairs, pcall, getmetatable, setmetatable =
      tostring, tonumber, ipairs, pairs, pcall, getmetatable, setmetatable
local fmt, concat, sort = string.format, table.concat, table.sort
local yield, wrap = coroutine.yield, coroutine.wrap
local mtype, min = math.type, math.min
local clock = os.clock

local _M = {}

local CHARTJS = "/usr/share/javascript/chart.js/chart.min.js"   -- Debian's libjs-chart.js
local MAX_TOP = 1000            -- most counters /api/top answers
local CACHE_S = 0.5             -- an API answer is reused this long (one walk for many pages)
local SHARE = 0.1               -- of a core, what making API answers may take over time
local BURST = 1                 -- seconds of CPU the budget holds at most

local JSON_TYPE = { ["Content-Type"] = "application/json; charset=utf-8",
                    ["Cache-Control"] = "no-store" }
local PROM_TYPE = { ["Content-Type"] = "text/plain; version=0.0.4; charset=utf-8" }

-- ---- the /metrics body ----------------------------------------------------------

-- A producer of the Prometheus text of db's counters matching pattern:
-- each call gives the next piece ("" while a step made none), nil at the
-- end; or, when the store's names cannot be read, nil, message at once.
-- The one place that asks tally.prometheus (its pause yields a step).
local function metrics_body(db, pattern)
  local next_piece = wrap(function()
    local text, msg = tally.prometheus(db, pattern, { pause = function() yield("") end })
    if not text then return false, msg end
    yield(text)
    return nil
  end)
  local first, msg = next_piece()
  if first == false then return nil, msg end
  local done = first == nil
  return function()
    if first then
      local p = first
      first = nil
      return p
    end
    if done then return nil end
    local p, m = next_piece()
    if p == false then error(m, 0) end   -- the store failed mid-scrape: the connection is cut
    if p == nil then done = true end
    return p
  end
end
_M.metrics_body = metrics_body

-- ---- requests -------------------------------------------------------------------

-- An error answer: status, text/plain, the message and a newline.
local function answer(status, msg, headers)
  local h = { ["Content-Type"] = "text/plain; charset=utf-8" }
  for k, v in pairs(headers or {}) do h[k] = v end
  return status, h, msg .. "\n"
end

local Bad = {}   -- raised by the checks below: { status=, msg= }
local function bad(status, msg) error(setmetatable({ status = status, msg = msg }, Bad), 0) end

-- The query's parameters, checked against the names an endpoint takes.
local function params(req, allowed)
  for k in pairs(req.query) do
    if not allowed[k] then
      local names = {}
      for n in pairs(allowed) do names[#names + 1] = n end
      sort(names)
      bad(400, fmt("unknown query parameter '%s' (%s takes %s)", k, req.path,
                   #names > 0 and concat(names, ", ") or "none"))
    end
  end
  return req.query
end

local function int_param(q, k, lo, hi, default)
  local v = q[k]
  if v == nil then return default end
  local n = v:find("^%d+$") and tonumber(v)
  if mtype(n) ~= "integer" or n < lo or n > hi then
    bad(400, fmt("%s must be an integer from %d to %d, got '%s'", k, lo, hi, v))
  end
  return n
end

local function pattern_param(q)
  local p = q.pattern
  if p == "" then return nil end
  return p
end

-- A store failure: 503 with the store's own message.
local function must(v, msg, ...)
  if v == nil then bad(503, tostring(msg)) end
  return v, msg, ...
end

local function history_of(db, name, last)
  local res, ring = peek.history(db, name, last)
  if not res then return nil end
  return { res = res, points = #ring > 0 and ring or json.empty_array }
end

-- ---- endpoints -------------------------------------------------------------------

local api = {}

function api.stats(s, req)
  params(req, {})
  local db = s.db
  local st = must(db:stats())
  local grace = must(db:grace())
  local schedules = must(peek.schedules(db))
  return {
    store = s.store, now = tally.now(), stats = st,
    -- this server has the store open too (idle: it holds nothing back)
    processes = grace.processes > 0 and grace.processes - 1 or 0, behind = grace.behind,
    oldest_pid = grace.oldest_pid ~= 0 and grace.oldest_pid or nil,
    rollups = #schedules > 0 and schedules or json.empty_array,
  }
end

function api.values(s, req)
  local q = params(req, { pattern = true })
  return { values = must(s.db:values(pattern_param(q))) }
end

function api.top(s, req)
  local q = params(req, { pattern = true, n = true, by = true, history = true })
  local n = int_param(q, "n", 1, MAX_TOP, 10)
  local by = q.by or "value"
  if by ~= "value" and by ~= "rate" then bad(400, "by must be value or rate, got '" .. by .. "'") end
  local hist = int_param(q, "history", 0, 1000, 0)
  local top = must(s.db:top(pattern_param(q) or "*", n, by))
  if hist > 0 then
    for _, e in ipairs(top) do e.history = history_of(s.db, e.name, hist) end
  end
  return { by = by, top = #top > 0 and top or json.empty_array }
end

function api.sum(s, req)
  local q = params(req, { pattern = true })
  local sum, count = s.db:sum(pattern_param(q))
  must(sum, count)
  return { pattern = q.pattern or "*", sum = sum, count = count }
end

function api.counter(s, req)
  local q = params(req, { name = true })
  local name = q.name
  if name == nil or name == "" then bad(400, "name is needed: /api/counter?name=NAME") end
  local p, msg, code = peek.counter(s.db, name, true)
  if not p then
    if code == "ENOENT" then bad(404, fmt("no such counter '%s'", name)) end
    bad(503, tostring(msg))
  end
  local out = { name = p.name, value = p.value, shards = p.cells, policy = p.policy,
                rolled = p.rolled, auto = p.auto, grown = p.grown, shrunk = p.shrunk }
  -- every history ring, as c:history gives it (a handle, closed at once:
  -- a server that holds none never holds the store's reuse back)
  local c = s.db:counter(name, { create = false })
  if c then
    local keeps = c:keeps()
    if keeps then
      out.keeps = keeps
      out.history = {}
      for _, k in ipairs(keeps) do
        local res = k:match("x(.*)$")
        local ring = c:history(res)
        out.history[res] = ring and #ring > 0 and ring or json.empty_array
      end
    end
    c:close()
  end
  return out
end

-- Histograms whose names match pattern, each from one snapshot of its
-- members: the names with a brace (one walk), then, if there are
-- histograms, one snapshot of them (a second).
function api.histograms(s, req)
  local q = params(req, { pattern = true })
  local db = s.db
  local groups = tally.histogram.group(must(db:names("*}")))
  local pattern = pattern_param(q)
  local g = pattern and tally.format._glob_compile(pattern)
  local bases = {}
  for base in pairs(groups) do
    if not g or tally.format._glob_captures(g, base) then bases[#bases + 1] = base end
  end
  sort(bases)
  local out = {}
  if #bases > 0 then
    local snap = must(db:snapshot("*{*}"))
    for _, base in ipairs(bases) do
      local h = groups[base]
      local r = tally.histogram.read(snap, h)
      if r then
        local buckets = {}
        for i, b in ipairs(r.buckets) do buckets[i] = { le = h.les[i][2], count = b.count } end
        local function qt(x)
          local v = tally.histogram.quantile(r, x)
          return v == math.huge and "+Inf" or v
        end
        out[#out + 1] = { name = base, count = r.count, sum = r.sum, unit = r.unit,
                          buckets = buckets, p50 = qt(0.5), p90 = qt(0.9), p99 = qt(0.99) }
      end
    end
  end
  return { histograms = #out > 0 and out or json.empty_array }
end

function api.rollups(s, req)
  params(req, {})
  local schedules = must(peek.schedules(s.db))
  return { rollups = #schedules > 0 and schedules or json.empty_array }
end

-- ---- the server -----------------------------------------------------------------

local function slurp(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  return s
end

-- Whether the client takes gzip (Accept-Encoding names it, q not 0).
local function takes_gzip(ae)
  if not ae then return false end
  for part in ae:gmatch("[^,]+") do
    local coding, rest = part:match("^%s*([%w%-%*]+)%s*(.*)$")
    if coding == "gzip" or coding == "x-gzip" then
      local qv = rest:match(";%s*q%s*=%s*([%d.]+)")
      return not qv or tonumber(qv) ~= 0
    end
  end
  return false
end
_M.takes_gzip = takes_gzip

-- Whether req carries the credentials --auth names (bearer token or
-- user:password, compared whole).
local function authorized(s, req)
  local a = s.auth
  if not a then return true end
  if a.user then return req.user == a.user and req.password == a.password end
  local token = req.authorization and req.authorization:match("^%s*[Bb]earer%s+(%S+)%s*$")
  return token == a.token
end

-- (Re)open the store if it could not be read at the start: nil, message
-- until it can (tried at most once a second).
local function store_of(s)
  if s.db then return s.db end
  local now = tally.now()
  if s.tried and now - s.tried < 1 then return nil, s.open_msg end
  s.tried = now
  local db, msg = s.open()
  if not db then s.open_msg = msg; return nil, msg end
  s.db = db
  return db
end

local function handle(s, req)
  if req.method ~= "GET" and req.method ~= "HEAD" then
    return answer(405, "only GET and HEAD are served", { Allow = "GET, HEAD" })
  end
  if not authorized(s, req) then
    return answer(401, "credentials needed (tally serve --auth)",
                  { ["WWW-Authenticate"] = s.auth.user and 'Basic realm="tally"'
                                           or 'Bearer realm="tally"' })
  end
  if req.bad_escape then
    return answer(400, "bad percent-encoding in the path or query: '%' must be followed by two hex digits")
  end
  local path = req.path
  local gz = takes_gzip(req.accept_encoding)
  if path == "/" then   -- its query is the page's own (?totals=, ?probe)
    return 200, { ["Content-Type"] = "text/html; charset=utf-8" }, dashboard.html, gz
  elseif path == "/dashboard.js" then
    params(req, {})
    return 200, { ["Content-Type"] = "text/javascript; charset=utf-8" }, dashboard.js, gz
  elseif path == "/chart.js" then
    params(req, {})
    s.chartjs = s.chartjs or slurp(CHARTJS)
    if not s.chartjs then
      return answer(404, CHARTJS .. " is missing: install Debian's libjs-chart.js")
    end
    return 200, { ["Content-Type"] = "text/javascript; charset=utf-8",
                  ["Cache-Control"] = "max-age=3600" }, s.chartjs, gz
  end
  local name = path:match("^/api/(%a+)$")
  local endpoint = name and api[name]
  if path ~= "/metrics" and not endpoint then
    return answer(404, "no such path: " .. path
                  .. " (try /, /metrics, /api/stats, /api/top, /api/values, /api/sum, "
                  .. "/api/counter, /api/histograms, /api/rollups)")
  end
  local db, msg = store_of(s)
  if not db then return answer(503, msg) end
  if path == "/metrics" then
    local q = params(req, { pattern = true })
    local body, err = metrics_body(db, pattern_param(q))
    if not body then return answer(503, tostring(err)) end
    return 200, PROM_TYPE, body, gz
  end
  -- JSON answers are kept CACHE_S seconds, so many pages open cost one
  -- walk; and making them may take SHARE of a core over time (a budget of
  -- CPU seconds, refilled as time passes): past it, the last answer is
  -- given again, with its Age, so a dashboard open over a million
  -- counters refreshes less often instead of taking a core
  local keys = {}
  for k, v in pairs(req.query) do keys[#keys + 1] = k .. "=" .. v end
  sort(keys)
  local key = path .. "?" .. concat(keys, "&")
  local now = tally.now()
  s.budget = min(BURST, (s.budget or BURST) + (now - (s.refilled or now)) * SHARE)
  s.refilled = now
  local hit = s.cache[key]
  if hit and (now - hit.at < CACHE_S or s.budget < 0) then
    return 200, { ["Content-Type"] = JSON_TYPE["Content-Type"], ["Cache-Control"] = "no-store",
                  Age = fmt("%d", math.floor(now - hit.at)) }, hit.body, gz
  end
  local cpu = clock()
  local body = assert(json.encode(endpoint(s, req)))
  s.budget = s.budget - (clock() - cpu)
  if s.cached >= 64 then s.cache, s.cached = {}, 0 end
  if not hit then s.cached = s.cached + 1 end
  s.cache[key] = { at = now, body = body }
  return 200, JSON_TYPE, body, gz
end

-- A handler for tally.httpd: handle() with Bad raised as its answer.
function _M.handler(s)
  s.cache, s.cached = s.cache or {}, s.cached or 0
  return function(req)
    local ok, status, headers, body, gz = pcall(handle, s, req)
    if ok then return status, headers, body, gz end
    if getmetatable(status) == Bad then return answer(status.status, status.msg) end
    error(status, 0)
  end
end

-- Whether host (numeric) is a loopback address.
function _M.loopback(host)
  return host:find("^127%.%d+%.%d+%.%d+$") ~= nil or host == "::1"
end

-- "ADDR:PORT", "[V6]:PORT", ":PORT" or "PORT" -> host, port; or nil, message.
function _M.parse_listen(s)
  local host, port = s:match("^%[([%x:.]+)%]:(%d+)$")
  if not host then host, port = s:match("^([^:]*):(%d+)$") end
  if not host and s:find("^%d+$") then host, port = "", s end
  if not host then return nil, "--listen takes ADDR:PORT (127.0.0.1:9145, [::1]:9145, 0.0.0.0:9145), got '" .. s .. "'" end
  if host == "" then host = "127.0.0.1" end
  if host == "localhost" then host = "127.0.0.1" end
  port = tonumber(port)
  if port > 65535 then return nil, "--listen: the port must be 0 to 65535, got " .. port end
  return host, port
end

-- --auth VALUE: "USER:PASS" (HTTP Basic) or a bearer token.
function _M.parse_auth(v)
  if v == nil then return nil end
  if v == "" then return nil, "--auth needs a token or USER:PASS" end
  local user, pass = v:match("^([^:]*):(.*)$")
  if user then
    if user == "" or pass == "" then return nil, "--auth USER:PASS needs both a user and a password" end
    return { user = user, password = pass }
  end
  if v:find("[%s%c]") then return nil, "--auth: a token has no spaces or control characters" end
  return { token = v }
end

-- run(s, opts) -> exit status. s: { db= or nil, open = fn, store = text,
-- auth = }; opts: host, port, connections, per_ip, timeout, memory.
function _M.run(s, opts)
  local stopped, msg = httpd.serve(opts, _M.handler(s), function(port)
    local shown = opts.host:find(":", 1, true) and "[" .. opts.host .. "]" or opts.host
    io.stderr:write(fmt("tally serve: %s on http://%s:%d/ (metrics /metrics, API /api/...)\n",
                        s.store, shown, port))
    io.stderr:flush()
  end)
  if not stopped then return nil, msg end
  io.stderr:write("tally serve: stopped (" .. stopped .. ")\n")
  return stopped == "SIGINT" and 130 or 0
end

return _M
