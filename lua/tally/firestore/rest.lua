-- tally.firestore.rest: the Cloud Firestore REST API (v1) as tally uses it:
-- URIs, document ids, values, requests and errors. The store
-- (firestore/store.lua) and the flusher (firestore/flush.lua) build on it;
-- HTTP is core.http (src/lua/lua_http.c), JSON is lua-cjson.
--
-- URI: firestore://PROJECT[/DATABASE][?option&...]
--   emulator=HOST:PORT   plain HTTP to an emulator, no credentials
--   root=COLLECTION      the counters' collection (default "counters")
--   token_env=VAR        real Firestore: an OAuth2 bearer token read from
--                        environment variable VAR (default
--                        TALLY_FIRESTORE_TOKEN)
--   token_cmd=CMD        ... or the output of a command, e.g.
--                        "gcloud auth print-access-token" (%XX-escaped
--                        in the URI); run again when a request gets 401
-- Without emulator= the base URL is https://firestore.googleapis.com;
-- $FIRESTORE_EMULATOR_HOST (what Google's SDKs read) is honoured too.
--
-- Document ids. A counter name becomes the id of counters/{ID} by
-- escaping: '%' -> %25, '/' -> %2F, control bytes (0x00-0x1F, 0x7F) ->
-- %XX, bytes >= 0x80 -> %XX only if the name is not valid UTF-8; then an
-- id that Firestore reserves ('.', '..', '__*__') gets its first byte
-- escaped ('.' -> %2E, '_' -> %5F). Every other byte is itself, so
-- names such as "post:42:likes" or "post-123" are their own ids and the
-- seeds' documents are found under their names. unescape() is the inverse
-- (ids with no '%' are names as they are).
--
-- Values. Integers travel as decimal strings (integerValue), exact to
-- int64 under Lua 5.4 and LuaJIT (int64_t cdata beyond 2^53, tally.compat).

local core = require "tally.core"
local compat = require "tally.compat"

local type, tostring, tonumber, ipairs, error, pcall, setmetatable =
      type, tostring, tonumber, ipairs, error, pcall, setmetatable
local fmt, byte, char, gsub, find, sub, match =
      string.format, string.byte, string.char, string.gsub, string.find, string.sub, string.match
local tointeger, int_text = compat.tointeger, compat.int_text
local printable = require("tally.util").printable

local _M = {}

local cjson_mod, json
local function J()
  if not json then
    cjson_mod = require "cjson"
    json = cjson_mod.new()
    json.encode_sparse_array(true)
    json.decode_max_depth(64)
  end
  return json
end
_M.json = J

-- ---- ids -----------------------------------------------------------------------

local function hex(c) return fmt("%%%02X", byte(c)) end

function _M.escape(name)
  local id
  if compat.utf8len(name) then
    id = gsub(name, "[%%/%c\127]", hex)
  else
    id = gsub(name, "[%%/%c\127\128-\255]", hex)
  end
  if id == "." or id == ".." then
    id = "%2E" .. sub(id, 2)
  elseif find(id, "^__.*__$") then
    id = "%5F" .. sub(id, 2)
  end
  return id
end

function _M.unescape(id)
  if not find(id, "%", 1, true) then return id end
  return (gsub(id, "%%(%x%x)", function(h) return char(tonumber(h, 16)) end))
end

-- %XX for a URL query value
function _M.urlencode(s)
  return (gsub(s, "[^%w%-%._~]", hex))
end

-- %XX for what a URL path cannot hold as itself ('%' of escaped ids too)
function _M.pathencode(s)
  return (gsub(s, "[^%w%-%._~:@!$&'()*+,;=/]", hex))
end

local function urldecode(s)
  return (gsub(s, "%%(%x%x)", function(h) return char(tonumber(h, 16)) end))
end

-- ---- values ----------------------------------------------------------------------

function _M.int(v) return { integerValue = int_text(v) } end

-- A Value of a count field -> an integer (doubles that hold one are taken,
-- as the seeds' JavaScript may store them), or nil, why.
function _M.toint(val)
  if type(val) ~= "table" then return 0 end      -- absent field: 0
  if val.integerValue ~= nil then
    local n = tointeger(tostring(val.integerValue))
    if n == nil then return nil, "bad integerValue " .. tostring(val.integerValue) end
    return n
  end
  if val.doubleValue ~= nil then
    local d = tonumber(val.doubleValue)
    local n = d and d == math.floor(d) and d > -2^53 and d < 2^53 and tointeger(d)
    if not n then return nil, "count is a double (" .. tostring(val.doubleValue) .. ")" end
    return n
  end
  if val.nullValue ~= nil then return 0 end
  return nil, "count is not a number"
end

-- ---- URIs --------------------------------------------------------------------------

-- parse(uri) -> { project, database, root, base, emulator, token_env, token_cmd,
-- docs ("projects/P/databases/D/documents"), redacted } or nil, message
function _M.parse(uri)
  if type(uri) ~= "string" then return nil, "Firestore URI expected" end
  local rest = match(uri, "^firestore://(.*)$")
  if not rest then return nil, "Firestore URI must start with firestore://" end
  local path, query = match(rest, "^([^?]*)%??(.*)$")
  local project, database = match(path, "^([%w%-]+)/([%w%-_()]*)$")
  if not project then project, database = match(path, "^([%w%-]+)$"), "" end
  if not project or project == "" then
    return nil, "bad Firestore URI '" .. printable(core.uri_redact(uri))
                .. "' (expected firestore://PROJECT[/DATABASE][?emulator=HOST:PORT])"
  end
  if database == "" then database = "(default)" end
  local u = { project = project, database = database, root = "counters" }
  for pair in query:gmatch("[^&]+") do
    local k, v = match(pair, "^([^=]+)=(.*)$")
    if not k then return nil, "bad Firestore URI option (expected NAME=VALUE)" end
    v = urldecode(v)
    if k == "emulator" then
      if not match(v, "^[%w%.%-%[%]:]+:%d+$") then
        return nil, "emulator must be HOST:PORT, got '" .. printable(v) .. "'"
      end
      u.emulator = v
    elseif k == "root" then
      if v == "" or v == "." or v == ".." or find(v, "/", 1, true) or find(v, "^__.*__$") then
        return nil, "root must be a collection id, got '" .. printable(v) .. "'"
      end
      u.root = v
    elseif k == "token_env" then
      u.token_env = v
    elseif k == "token_cmd" then
      u.token_cmd = v
    else
      return nil, "unknown Firestore URI option '" .. printable(k) .. "' (emulator, root, token_env, token_cmd)"
    end
  end
  if not u.emulator and not u.token_cmd and not u.token_env then
    local env = os.getenv("FIRESTORE_EMULATOR_HOST")
    if env and env ~= "" then u.emulator = env end
  end
  u.base = u.emulator and ("http://" .. u.emulator) or "https://firestore.googleapis.com"
  u.docs = fmt("projects/%s/databases/%s/documents", project, database)
  u.redacted = core.uri_redact(uri)
  return u
end

-- ---- the client --------------------------------------------------------------------

local Client = {}
Client.__index = Client

-- The bearer token: nil for the emulator, else from the variable or command.
local function token(self, fresh)
  local u = self.u
  if u.emulator then return nil end
  if self.tok and not fresh then return self.tok end
  local t
  if u.token_cmd then
    local f = io.popen(u.token_cmd, "r")
    t = f and f:read("*a")
    if f then f:close() end
  else
    t = os.getenv(u.token_env or "TALLY_FIRESTORE_TOKEN")
  end
  t = t and gsub(t, "%s+$", "")
  if not t or t == "" then
    return nil, "no Firestore credentials: set " .. (u.token_cmd and ("token_cmd (" .. "it printed nothing)")
      or ("$" .. printable(u.token_env or "TALLY_FIRESTORE_TOKEN"))) .. " or use ?emulator=HOST:PORT"
  end
  self.tok = t
  return t
end

-- client(u, { timeout = s }) -> client
function _M.client(u, opts)
  local h = core.http(u.base, { timeout = opts and opts.timeout or 10 })
  return setmetatable({ u = u, h = h, prefix = "/v1/" .. u.docs, requests = 0 }, Client)
end

function Client:close() if self.h then self.h:close() self.h = nil end end

-- The full resource name of a document path ("counters/ID/shards/0").
function Client:name(path) return self.u.docs .. "/" .. path end

-- Firestore's error status names that say "try again later".
_M.RETRY = { ABORTED = true, RESOURCE_EXHAUSTED = true, UNAVAILABLE = true,
             DEADLINE_EXCEEDED = true, INTERNAL = true }

-- c:call(method, suffix, body) -> decoded reply, or nil, message, code.
-- suffix follows .../documents (":commit", "/counters?pageSize=..");
-- code: a Firestore status (ABORTED, FAILED_PRECONDITION, ALREADY_EXISTS,
-- NOT_FOUND, RESOURCE_EXHAUSTED, UNAVAILABLE, ...) or a transport code of
-- core.http (ETIMEDOUT, ECONNECT, ELOST, EHTTP).
function Client:call(method, suffix, body)
  if not self.h then error("attempt to use a closed store", 3) end
  local text = body and (type(body) == "string" and body or J().encode(body)) or nil
  for attempt = 1, 2 do
    local tok, terr = token(self, attempt == 2)
    if terr then return nil, terr, "EAUTH" end
    local st, reply, code = self.h:request(method, self.prefix .. suffix, text,
                                           tok and { "Authorization: Bearer " .. tok } or nil)
    self.requests = self.requests + 1
    if not st then return nil, "Firestore: " .. tostring(reply), code end
    -- a 401 from real Firestore: the token may have expired; fetch it once more
    if not (st == 401 and not self.u.emulator and attempt == 1) then
      local ok, doc = pcall(J().decode, reply)
      if st >= 200 and st < 300 then
        if not ok then return nil, "Firestore: malformed reply: " .. tostring(doc), "EPROTO" end
        return doc
      end
      local e = ok and type(doc) == "table" and (doc.error or (doc[1] and doc[1].error))
      if type(e) == "table" then
        return nil, fmt("Firestore: %s (%s)", tostring(e.message), tostring(e.status or st)),
               e.status or ("HTTP" .. st)
      end
      return nil, fmt("Firestore: HTTP %d: %s", st, sub(reply, 1, 200)), st == 429 and "RESOURCE_EXHAUSTED"
             or (st == 503 and "UNAVAILABLE") or ("HTTP" .. st)
    end
  end
end

-- batch_get(paths) -> { [path] = document or false }, or nil, msg, code.
-- Paths are relative to .../documents; documents have fields, updateTime.
function Client:batch_get(paths)
  local out = {}
  local pre = self.u.docs .. "/"
  for i = 1, #paths, 500 do
    local names = {}
    for j = i, math.min(i + 499, #paths) do names[#names + 1] = pre .. paths[j] end
    local rep, msg, code = self:call("POST", ":batchGet", { documents = names })
    if not rep then return nil, msg, code end
    for _, r in ipairs(rep) do
      if r.found then
        out[sub(r.found.name, #pre + 1)] = r.found
      elseif r.missing then
        out[sub(r.missing, #pre + 1)] = false
      end
    end
  end
  return out
end

-- list(collection_path [, mask]) -> { document, ... } (every page); mask: a
-- field path or a list of them, the fields each document comes with
function Client:list(cpath, mask)
  local out, tokn = {}, nil
  repeat
    local q = "/" .. _M.pathencode(cpath) .. "?pageSize=" .. (self.page or 1000)
    for _, f in ipairs(type(mask) == "table" and mask or { mask }) do
      q = q .. "&mask.fieldPaths=" .. f
    end
    if tokn then q = q .. "&pageToken=" .. _M.urlencode(tokn) end
    local rep, msg, code = self:call("GET", q)
    if not rep then return nil, msg, code end
    for _, d in ipairs(rep.documents or {}) do out[#out + 1] = d end
    tokn = rep.nextPageToken
    if tokn == "" then tokn = nil end
  until not tokn
  return out
end

-- commit(writes) -> reply, or nil, msg, code
function Client:commit(writes)
  return self:call("POST", ":commit", { writes = writes })
end

-- the last path segment of a document name
function _M.id_of(name) return match(name, "([^/]+)$") end

return _M
