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
-- The page and the JSON answers are tally.dashboard's (nginx serves the
-- same through tally.openresty); this file adds the HTTP side: /metrics,
-- credentials, a cache and a CPU budget for the answers, and the store
-- opened again while it cannot be read. Answers: 200 with JSON
-- (tally.json: integers exact, names as bytes), 400 for a bad query (its
-- message says which parameter and what it takes), 401 without the
-- credentials --auth names, 404 for another path, 405 for a method other
-- than GET or HEAD, 503 with the store's own message when the store cannot
-- be read (damaged, truncated, not a tally store).

local tally = require "tally"
local httpd = require "tally.httpd"
local peek = require "tally.peek"
local json = require "tally.json"
local dashboard = require "tally.dashboard"
local printable = require("tally.util").printable

local tostring, tonumber, pairs = tostring, tonumber, pairs
local fmt, concat = string.format, table.concat
local yield, wrap = coroutine.yield, coroutine.wrap
local min = math.min
local clock = os.clock

local _M = {}

local CHARTJS = dashboard.CHARTJS
local CACHE_S = 0.5             -- an API answer is reused this long (one walk for many pages)
local SHARE = 0.06              -- of a core, what making API answers may take over time
local BURST = 0.5               -- seconds of CPU the budget holds at most

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
    local ok, msg = tally.prometheus(db, pattern, { pause = function() yield("") end,
                                                     write = yield })
    if not ok then return false, msg end
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

-- Whether the string given equals the secret, in a time that depends on
-- their lengths only: == stops at the first byte that differs, which a
-- client that times many answers could use to find the secret a byte at
-- a time.
local function same_secret(given, secret)
  if type(given) ~= "string" or #given ~= #secret then return false end
  local diff = 0
  for i = 1, #secret do diff = diff | (given:byte(i) ~ secret:byte(i)) end
  return diff == 0
end
_M.same_secret = same_secret

-- Whether req carries the credentials --auth names (bearer token or
-- user:password, compared whole).
local function authorized(s, req)
  local a = s.auth
  if not a then return true end
  if a.user then
    -- both compared, whichever is wrong
    local user_ok = same_secret(req.user, a.user)
    return same_secret(req.password, a.password) and user_ok
  end
  -- the scheme's name in any case (RFC 7235)
  local scheme, token = (req.authorization or ""):match("^%s*(%a+)%s+(%S+)%s*$")
  return scheme ~= nil and scheme:lower() == "bearer" and same_secret(token, a.token)
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

-- Only the parameters in allowed, or the 400 answer that says so.
local function no_other(req, allowed)
  for k in pairs(req.query) do
    if k ~= allowed then
      return answer(400, fmt("unknown query parameter '%s' (%s takes %s)", printable(k), req.path,
                             allowed or "none"))
    end
  end
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
  if req.nul_in_path then   -- req.path ends at the %00
    return answer(400, "a path cannot hold a NUL byte (%00)")
  end
  local path = req.path
  local gz = takes_gzip(req.accept_encoding)
  if path == "/" then   -- its query is the page's own (?totals=, ?probe)
    return 200, { ["Content-Type"] = "text/html; charset=utf-8" }, dashboard.html, gz
  elseif path == "/dashboard.js" or path == "/chart.js" then
    local status, h, msg = no_other(req)
    if status then return status, h, msg end
    if path == "/dashboard.js" then
      return 200, { ["Content-Type"] = "text/javascript; charset=utf-8" }, dashboard.js, gz
    end
    s.chartjs = s.chartjs or slurp(CHARTJS)
    if not s.chartjs then
      return answer(404, CHARTJS .. " is missing: install Debian's libjs-chart.js")
    end
    return 200, { ["Content-Type"] = "text/javascript; charset=utf-8",
                  ["Cache-Control"] = "max-age=3600" }, s.chartjs, gz
  end
  local name = path:match("^/api/(%a+)$")
  if path ~= "/metrics" and not name then
    return answer(404, "no such path: " .. printable(path) .. " (try /, /metrics, /api/"
                  .. concat(dashboard.ENDPOINTS, ", /api/") .. ")")
  end
  for k, v in pairs(req.query) do   -- given twice: which one was meant is not ours to guess
    if type(v) ~= "string" then return answer(400, fmt("query parameter '%s' must be given once", printable(k))) end
  end
  local db, msg = store_of(s)
  if not db then return answer(503, msg) end
  s.dirty = true
  if path == "/metrics" then
    s.by_name = true   -- tally.prometheus reads each value by name
    local status, h, m = no_other(req, "pattern")
    if status then return status, h, m end
    local p = req.query.pattern
    local body, err = metrics_body(db, p ~= "" and p or nil)
    if not body then return answer(503, tostring(err)) end
    return 200, PROM_TYPE, body, gz
  end
  -- JSON answers are kept CACHE_S seconds, so many pages open cost one
  -- walk; and making them may take SHARE of a core over time (a budget of
  -- CPU seconds, refilled as time passes): past it, the last answer is
  -- given again, with its Age, so a dashboard open over a million
  -- counters refreshes less often instead of taking a core
  local key = dashboard.answer_key(path, req.query)
  local now = tally.now()
  s.budget = min(BURST, (s.budget or BURST) + (now - (s.refilled or now)) * SHARE)
  s.refilled = now
  local hit = s.cache[key]
  if hit and (now - hit.at < CACHE_S or s.budget < 0) then
    return 200, { ["Content-Type"] = JSON_TYPE["Content-Type"], ["Cache-Control"] = "no-store",
                  Age = fmt("%d", math.floor(now - hit.at)) }, hit.body, gz
  end
  local cpu = clock()
  local status, res = dashboard.api(db, name, req.query,
                                    { schedules = peek.schedules, store = s.store })
  s.budget = s.budget - (clock() - cpu)
  if status ~= 200 then return answer(status, res) end
  local body = assert(json.encode(res))
  if s.cached >= 64 then s.cache, s.cached = {}, 0 end
  if not hit then s.cached = s.cached + 1 end
  s.cache[key] = { at = now, body = body }
  return 200, JSON_TYPE, body, gz
end

-- A handler for tally.httpd.
function _M.handler(s)
  s.cache, s.cached = s.cache or {}, s.cached or 0
  return function(req) return handle(s, req) end
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

-- families(db, chunk, file) -> true, or nil, message: run the Lua chunk
-- of --families FILE with a stand-in for db, whose family(pattern, opts)
-- records the metric mappings of opts on db (tally.prometheus.map_only):
-- the file the writers run (`loadfile(FILE)(db)`) names and labels the
-- series here the same way, while serve still writes nothing. Another
-- method of db is refused, by name.
function _M.families(db, chunk, file)
  local prometheus = require "tally.prometheus"
  local stand_in = setmetatable({}, { __index = function(_, k)
    if k == "family" then
      return function(_, pattern, opts) return prometheus.map_only(db, pattern, opts) end
    end
    error(fmt("db:%s is not run by tally serve (a --families file gives db:family only)",
              tostring(k)), 2)
  end })
  local ok, err = pcall(chunk, stand_in)
  if not ok then return nil, fmt("--families %s: %s", file, tostring(err)) end
  return true
end

-- run(s, opts) -> exit status. s: { db= or nil, open = fn, store = text,
-- auth = }; opts: host, port, connections, per_ip, timeout, memory.
-- This process's id (the server's own slot in db:grace()).
local function self_pid()
  local f = io.open("/proc/self/stat", "r")
  local pid = f and tonumber(f:read("l"):match("^(%d+)"))
  if f then f:close() end
  return pid
end

-- After the requests, so the server does not hold the store's reuse back
-- (docs/lifecycle.md): its counter handles (the handle cache is kept
-- weakly here) are collected, and a lookup of a name no counter has (O(1),
-- reads only) ends with the process published idle, as one that holds no
-- handle is. A process that has read values by name (tally.prometheus
-- does, for now: s.by_name) is never idle again: from then on, once a
-- second, while it is the one holding reuse back it runs a grace step
-- (db:maintain with a budget of 0: no expiry), what every writer's
-- db:tick does. Returns true to be called again a second later.
local function settle(s)
  local db = s.db
  if not db then return false end
  if s.dirty then
    s.dirty = false
    collectgarbage("collect")
    peek.counter(db, "tally serve: no such counter")
  end
  if not s.by_name then return false end
  local g = db:grace()
  s.pid = s.pid or self_pid()
  if g and g.behind > 0 and g.oldest_pid == s.pid then
    db:maintain(math.floor(tally.now() * 1000), 0)
  end
  return true
end
_M.settle = settle

function _M.run(s, opts)
  opts.after = function() return settle(s) end
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
