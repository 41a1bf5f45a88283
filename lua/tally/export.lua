-- tally.export: db:export() and db:import(), counters as JSON in the Cloud
-- Firestore distributed-counter layout.
--
--   { "counters": { "<name>": { "num_shards": N, "policy": "thread",
--       "shards": { "0": { "count": n }, "1": { "count": n }, ... } } } }
--
-- One object per counter (the counters/{ID} document) with its shards
-- keyed by their 0-based id as a string (the shards/{N} documents). Export
-- sorts names bytewise and writes shards in order, one counter per line,
-- so equal stores give equal text. Counts are exact: a count within
-- +-(2^53-1) is a JSON number, any other is a decimal string ("count":
-- "9007199254740993"), because a JSON reader holds numbers as doubles.
-- A name's bytes that are not UTF-8 are written \udcXX and read back as
-- bytes (tally.json). Import validates the whole document, and refuses a
-- key given twice, before it changes anything.

local core = require "tally.core"

local type, error, pairs, ipairs, next, tostring, pcall =
      type, error, pairs, ipairs, next, tostring, pcall
local fmt, find, match, gsub, ssub, byte = string.format, string.find, string.match, string.gsub,
      string.sub, string.byte
local concat, sort = table.concat, table.sort
local huge = math.huge
local compat = require "tally.compat"
local tointeger, int_text, add, sub = compat.tointeger, compat.int_text, compat.add, compat.sub

local describe, typename = require("tally.util").describe, require("tally.util").typename
local printable = require("tally.util").printable
local check_self = require("tally.util").self
local json_string = require("tally.format").json_string
local argerror = require("tally.util").argerror

-- Documents are read by tally.json (lua-cjson underneath, loaded on first
-- use: require "tally" does not load it); numbers are written here, exactly.
local json = require "tally.json"
local cjson

local store = core.store_methods

local SAFE = 2^53 - 1                    -- the largest count a double holds exactly, and its neighbours
local SHARD_MIN = tointeger("-4611686018427387904")   -- -2^62
local SHARD_MAX = tointeger("4611686018427387903")    -- 2^62 - 1
local POLICIES = { thread = true, random = true, round_robin = true, key = true, slot = true,
                   cpu = true, ["function"] = true }

-- a[1] + ... + a[n] (minus b[1] + ... + b[#b] when b is given), exactly,
-- or nil when it is beyond a shard's range. The terms are within +-2^62,
-- so a sum in doubles is within 2^16 of the true one: past the range by
-- more, it is; else the true sum fits int64, and adding with wrap-around
-- (what add and sub do past it) gives it exactly.
local function shard_sum(a, n, b)
  local approx, exact = 0, 0
  for i = 1, n do
    approx = approx + compat.tofloat(a[i])
    exact = add(exact, a[i])
  end
  for i = 1, b and #b or 0 do
    approx = approx - compat.tofloat(b[i])
    exact = sub(exact, b[i])
  end
  if approx > 2^62 + 2^20 or approx < -2^62 - 2^20 then return nil end
  if exact < SHARD_MIN or exact > SHARD_MAX then return nil end
  return exact
end

local function count_text(n)
  if n >= -SAFE and n <= SAFE then return int_text(n) end
  return '"' .. int_text(n) .. '"'
end

-- shard ids "0", "1", ..., and '"0":{"count":' ... for each
local SHARD_ID, SHARD_HEAD = {}, {}
for i = 1, core.MAX_SHARDS do
  SHARD_ID[i] = fmt("%d", i - 1)
  SHARD_HEAD[i] = fmt('"%d":{"count":', i - 1)
end

-- db:export([pattern [, write]]) -> JSON text of the matching counters,
-- exact per shard; with write, write(chunk) gets the text a piece at a
-- time as the walk goes (one walk in the names' order, no handle per
-- counter, core.export_write) and export returns true. nil, msg, code if
-- reading the store fails (a damaged store; write may have had part).
-- (export_any and import_any: the same, for any store with the methods
-- they call, such as the Firestore store, tally/firestore/store.lua)
local export_any, import_any, whole
local function export_args(pattern, write)
  if pattern ~= nil and type(pattern) ~= "string" then
    argerror(1, "export", "string expected, got " .. typename(pattern), 3)
  end
  if write ~= nil and type(write) ~= "function" then
    argerror(2, "export", "function expected, got " .. typename(write), 3)
  end
end
function store:export(pattern, write)
  check_self(self, "tally.store", "export")
  export_args(pattern, write)
  local out, n = {}, 0
  local ok, msg, code = core.export_write(self, pattern, json_string, write or function(s)
    n = n + 1
    out[n] = s
  end)
  if not ok then return nil, msg, code end
  return write and true or concat(out)
end
function export_any(self, pattern, write)
  export_args(pattern, write)
  local out, n = {}, 0
  local function put(s)
    if write then write(s) else n = n + 1; out[n] = s end
  end
  local names, nmsg, ncode = self:names(pattern)
  if not names then return nil, nmsg, ncode end   -- a damaged store
  local first = true
  for _, name in ipairs(names) do
    -- create = false: a counter dropped since names() listed it is left out
    local c, msg, code = self:counter(name, { create = false })
    if not c and code ~= "ENOENT" then return nil, msg, code end
    if c then
      local info, shards
      info, msg, code = c:info()
      if info then shards, msg, code = c:shards() end
      if not shards and code ~= "EDROPPED" then return nil, msg, code end
      if shards then                    -- else dropped meanwhile: left out
        local parts = {}
        for i = 1, #shards do parts[i] = SHARD_HEAD[i] .. count_text(shards[i]) .. "}" end
        put(fmt('%s%s:{"num_shards":%d,"policy":%s,"shards":{%s}}',
                first and '{"counters":{\n' or ",\n", json_string(name), #shards,
                json_string(info.policy), concat(parts, ",")))
        first = false
      end
    end
  end
  put(first and '{"counters":{}}\n' or "\n}}\n")
  return write and true or concat(out)
end

-- ---- import -----------------------------------------------------------------

-- A JSON value described for messages (decoded by cjson: null is a
-- light userdata, objects and arrays are tables).
local function jdescribe(v)
  if v == nil then return "nothing" end
  if v == cjson.null then return "null" end
  if type(v) == "table" then
    local k = next(v)
    if k == nil then return "an empty object" end
    return type(k) == "string" and "an object" or "an array"
  end
  if type(v) == "string" then return describe(v) end
  if type(v) == "number" and int_text(v) then return int_text(v) end
  return tostring(v)
end

local function is_object(v)
  if type(v) ~= "table" then return false end
  for k in pairs(v) do
    if type(k) ~= "string" then return false end
  end
  return true
end

-- The exact integer a count stands for, or nil and why not.
local function parse_count(v)
  if type(v) == "number" then
    if v ~= v or v == huge or v == -huge then return nil, "must be a finite integer" end
    local n = tointeger(v)
    if not n then return nil, "must be an integer, got " .. jdescribe(v) end
    if n > SAFE or n < -SAFE then
      return nil, fmt("%s is beyond +-(2^53-1), where a JSON number is not exact: "
                      .. "write it as a decimal string", jdescribe(v))
    end
    return n
  end
  if type(v) == "string" then
    local sign, digits = match(v, "^(%-?)0*(%d+)$")
    if not digits then
      return nil, "must be an integer or a decimal string, got " .. jdescribe(v)
    end
    local n = tointeger(sign .. digits)
    if not n or int_text(n) ~= (digits == "0" and "0" or sign .. digits) then
      return nil, v .. " is out of a shard's range (-2^62 to 2^62-1)"
    end
    return n
  end
  return nil, "must be an integer or a decimal string, got " .. jdescribe(v)
end

local function shard_id_ok(k, n)
  if not find(k, "^%d+$") or (#k > 1 and find(k, "^0")) then return nil end
  local i = tointeger(k)
  return i and i < n and i or nil
end

-- What a key given twice is (its path from json.decode): lua-cjson would
-- keep the last value and lose the others without a word.
local function twice_text(path)
  if path[1] == "counters" and path[2] and #path == 2 then
    return fmt("counter '%s' is given twice", printable(path[2]))
  elseif path[1] == "counters" and path[2] then
    local rest = {}
    for i = 3, #path do rest[i - 2] = path[i] end
    return fmt("counter '%s': %s is given twice", printable(path[2]), json.path_text(rest))
  end
  return fmt("'%s' is given twice", json.path_text(path))
end

-- Check one counter of the document; returns its plan { name=, shards=,
-- policy=, counts={...} }, or raises { msg = what is wrong }.
local function raise_msg(msg) error({ msg = msg }) end

local function check_counter(name, doc)
  local raise = raise_msg
  if #name < 1 or #name > core.NAME_MAX or find(name, "\0", 1, true) then
    raise(fmt("counter name '%s' must be 1 to %d bytes without NUL", printable(name), core.NAME_MAX))
  end
  local function bad(msg) raise(fmt("counter '%s': %s", printable(name), msg)) end
  if not is_object(doc) or next(doc) == nil then
    bad("must be an object with num_shards and shards, got " .. jdescribe(doc))
  end
  for k in pairs(doc) do
    if k ~= "num_shards" and k ~= "shards" and k ~= "policy" then
      bad("unknown field '" .. printable(k) .. "' (expected num_shards, shards and policy)")
    end
  end
  local n = type(doc.num_shards) == "number" and tointeger(doc.num_shards)
  if not n or n < 1 or n > core.MAX_SHARDS then
    bad(fmt("num_shards must be an integer from 1 to %d, got %s",
            core.MAX_SHARDS, jdescribe(doc.num_shards)))
  end
  local policy = doc.policy
  if policy ~= nil and (type(policy) ~= "string" or not POLICIES[policy]) then
    bad("policy must be thread, random, round_robin, key, slot, cpu or function, got "
        .. jdescribe(policy))
  end
  local shards = doc.shards
  local given = 0
  if type(shards) == "table" then
    for k in pairs(shards) do
      if type(k) ~= "string" then given = -1; break end
      given = given + 1
    end
  end
  if given <= 0 then
    bad("shards must be an object of shard ids \"0\" to \"" .. (n - 1) .. "\", got "
        .. jdescribe(shards))
  end
  local complete = given == n
  for i = 1, complete and n or 0 do
    if shards[SHARD_ID[i]] == nil then complete = false; break end
  end
  if not complete then                  -- say what is wrong
    for k in pairs(shards) do
      if not shard_id_ok(k, n) then
        bad(fmt("shards has id '%s' (expected \"0\" to \"%d\" for num_shards %d)", printable(k), n - 1, n))
      end
    end
    bad(fmt("num_shards is %d but %d shards are given", n, given))
  end
  local counts = {}
  for i = 1, n do
    local id = SHARD_ID[i]
    local s = shards[id]
    if type(s) ~= "table" then
      bad(fmt('shards["%s"] must be an object with a count, got %s', id, jdescribe(s)))
    end
    for k in pairs(s) do
      if k ~= "count" then
        if type(k) ~= "string" then
          bad(fmt('shards["%s"] must be an object with a count, got %s', id, jdescribe(s)))
        end
        bad(fmt('shards["%s"] has unknown field \'%s\'', id, printable(k)))
      end
    end
    local v, why = parse_count(s.count)
    if v == nil then bad(fmt('shards["%s"].count %s', id, why)) end
    if v < SHARD_MIN or v > SHARD_MAX then
      bad(fmt('shards["%s"].count %s is out of a shard\'s range (-2^62 to 2^62-1)', id, int_text(v)))
    end
    counts[i] = v
  end
  if policy == "slot" then
    -- one shard per writer slot; an import adds them all in its own
    if n ~= core.SLOT_SHARDS then
      bad(fmt("num_shards is %d, but a slot counter has %d (one per writer slot)", n,
              core.SLOT_SHARDS))
    end
    if not shard_sum(counts, n) then
      bad("the counts of a slot counter add up beyond a shard's range (-2^62 to 2^62-1), "
          .. "and an import adds them all in its own shard")
    end
  end
  if policy == "cpu" and not shard_sum(counts, n) then
    -- each shard is a CPU's (or resets'): an import adds them all at once
    bad("the counts of a cpu counter add up beyond a shard's range (-2^62 to 2^62-1), "
        .. "and an import adds them all at once")
  end
  return { name = name, shards = n, policy = policy, counts = counts }
end

-- Why a name cannot be imported: a family at its cap (max_counters) gives
-- its overflow counter for it, which other names share, so neither mode
-- could set or add the name's shards as the document asks.
local function capped(name)
  return fmt("counter '%s' falls under a family at its cap (max_counters): it would be "
             .. "counted in the family's overflow counter", printable(name))
end

-- Can the counter (its info) take document entry p? Its shard count,
-- unless both are cpu counters (a shard per CPU of the machine that made
-- each: taken whole), and its policy where p names one. lua_export.c's
-- fits_document is the streamed import's.
local function shards_fit(p, info)
  return info.shards == p.shards or (p.policy == "cpu" and info.policy == "cpu")
end
local function policy_fits(p, info) return not p.policy or p.policy == info.policy end

-- A counter another writer made since the check, unlike the document's:
-- refused, as the check refuses one that was there.
local function made_unlike(p, info)
  if not (shards_fit(p, info) and policy_fits(p, info)) then
    return fmt("counter '%s' was made during the import with %d shards and policy %s",
               printable(p.name), info.shards, info.policy)
  end
end

-- Undo what an import applied: the log holds the adds (counter handle,
-- shard, amount in three arrays), undone newest first; then the counters
-- it created are dropped. Only runs when another process changed or
-- dropped a counter under the import.
local function undo(db, log, created)
  local hs, ss, ns = log[1], log[2], log[3]
  for i = #hs, 1, -1 do
    if ss[i] == 0 then pcall(hs[i].incr, hs[i], sub(0, ns[i])) -- a slot counter (below)
    else pcall(hs[i].add_shard, hs[i], ss[i], sub(0, ns[i])) end
  end
  for i = #created, 1, -1 do db:drop(created[i]) end
end

-- db:import(json [, { mode = "replace" | "add", progress = fn }]) -> number
-- of counters. json is the text, or an open file read from where it is.
-- progress(phase, done, total), if given, is called as the work goes: a
-- document as export writes it streams, phase "read" (bytes checked), then
-- "apply" (counters); any other is held whole, phases "decode", "validate",
-- "create", "apply". An error progress raises once the store changes
-- (from "create" or "apply" on) is raised again after the import's changes
-- are undone.
function store:import(source, opts)
  check_self(self, "tally.store", "import")
  return import_any(self, source, opts, true)
end

local PIECE = 1048576                     -- what the streamed import reads at a time
local HEAD, TAIL = '{"counters":{\n', "\n}}\n"  -- around export's lines, joined by ",\n"
local LONGEST = 64 * PIECE                 -- a line longer than this is not export's

-- Where the last ",\n" of s begins (JSON text has a newline only between
-- values, never inside a string), or nil.
local function last_sep(s)
  for i = #s - 1, 1, -1 do
    if byte(s, i) == 44 and byte(s, i + 1) == 10 then return i end
  end
end

-- The streamed import of a local store (core.importer, lua_export.c):
-- pieces of about 1 MiB, each cut after a line, decoded by lua-cjson and
-- taken by imp:check only if they are byte for byte what export writes,
-- their names after the last piece's (so no name is given twice), and the
-- store can take every counter; checked counters wait in a temporary file.
-- Once all are checked, imp:apply applies them in order, and imp:undo
-- takes back what it applied if one fails. Returns false, having changed
-- nothing, for a document that is not export's or not right: the whole
-- document's path checks it then, with its messages.
local function streamed(self, source, mode, progress)
  local read, total
  if type(source) == "string" then
    local at = 1
    total = #source
    read = function()
      if at > total then return nil end
      at = at + PIECE
      return ssub(source, at - PIECE, at - 1)
    end
  else
    local here = source:seek("cur")
    local size = here and source:seek("end")
    if not size or not source:seek("set", here) then return false end
    total = size - here
    read = function() return source:read(PIECE) end
  end
  local buf = read()
  if not buf or ssub(buf, 1, #HEAD) ~= HEAD then return false end
  local imp = core.importer(self, mode)
  if not imp then return false end          -- no temporary file: the whole path
  buf = ssub(buf, #HEAD + 1)
  local n, got = 0, #HEAD
  local function take(piece)
    local v = json.value("{" .. piece .. "}")
    local k = type(v) == "table" and imp:check(piece, v, json_string)
    if not k then return false end
    n, got = n + k, got + #piece + 2
    if progress then progress("read", got, total) end
    return true
  end
  while true do
    local more = read()
    if not more then                        -- the end: export's last line, then TAIL
      if #buf <= #TAIL or ssub(buf, -#TAIL) ~= TAIL or not take(ssub(buf, 1, -#TAIL - 1)) then
        imp:close()
        return false
      end
      if progress then progress("read", total, total) end   -- (the tail too)
      break
    end
    local cut = last_sep(buf)
    if cut then
      if not take(ssub(buf, 1, cut - 1)) then
        imp:close()
        return false
      end
      buf = ssub(buf, cut + 2) .. more
    elseif #buf > LONGEST then
      imp:close()
      return false
    else
      buf = buf .. more
    end
  end
  if progress then progress("apply", 0, n) end
  local done = 0
  while done < n do
    local k, msg, code = imp:apply(1024)
    local ok, err = true, nil
    if k then
      done = done + k
      if progress then ok, err = pcall(progress, "apply", done, n) end
    end
    if not k or not ok then
      imp:undo()
      imp:close()
      if not ok then error(err, 0) end
      return nil, msg, code
    end
  end
  imp:close()
  return n
end

function import_any(self, source, opts, local_store)
  local file = io.type(source) == "file"
  if type(source) ~= "string" and not file then
    argerror(1, "import", "string expected, got " .. typename(source), 2)
  end
  local mode, progress = "replace", nil
  if opts ~= nil then
    if type(opts) ~= "table" then
      argerror(2, "import", "table expected, got " .. typename(opts), 2)
    end
    for k, v in pairs(opts) do
      if k == "progress" and type(v) == "function" then
        progress = v
      elseif k ~= "mode" then
        argerror(2, "import", "unknown option " .. describe(k), 2)
      elseif v ~= "replace" and v ~= "add" then
        argerror(2, "import", "mode must be 'replace' or 'add', got "
              .. describe(v), 2)
      else
        mode = v
      end
    end
  end
  self:stats()                           -- raises now if the store is closed
  local here = file and source:seek("cur")
  if local_store then
    local n, msg, code = streamed(self, source, mode, progress)
    if n ~= false then return n, msg, code end
  end
  local text = source
  if file then
    local rerr
    if here then source:seek("set", here) end
    text, rerr = source:read("a")
    if not text then error("import: " .. tostring(rerr), 2) end
  end
  return whole(self, text, mode, progress)
end

-- The whole document's import: decoded at once, checked, then applied.
function whole(self, text, mode, progress)
  local function raise(msg) error("import: " .. msg, 3) end
  local function step(phase, i, n)
    if progress and (i == n or i % 1024 == 0) then progress(phase, i, n) end
  end
  step("decode", 0, 1)
  cjson = cjson or require "cjson"       -- its null, for jdescribe
  local doc, nkeys, path = json.decode(text)
  step("decode", 1, 1)
  if path then raise(twice_text(path)) end
  if doc == nil then raise("malformed JSON: " .. gsub(nkeys, "^.-:%d+: ", "")) end
  -- lua-cjson keeps the last of a key given twice and drops the others.
  -- The checked counters tell how many keys doc holds; fewer than nkeys,
  -- and json.twice (slower) names the one. A failed check may come of one
  -- too ("num_shards is 2 but 1 shards are given"): or_twice(msg) is msg,
  -- or what is given twice.
  local function or_twice(msg)
    path = json.twice(text)
    return path and twice_text(path) or msg
  end
  if not is_object(doc) or doc.counters == nil then
    raise(or_twice("the document must be an object with \"counters\", got " .. jdescribe(doc)))
  end
  for k in pairs(doc) do
    if k ~= "counters" then
      raise(or_twice("unknown top-level field '" .. printable(k) .. "' (expected counters)"))
    end
  end
  local counters = doc.counters
  if not is_object(counters) then
    raise(or_twice("\"counters\" must be an object of counters by name, got "
                   .. jdescribe(counters)))
  end
  local names = {}
  for name in pairs(counters) do names[#names + 1] = name end
  sort(names)

  -- 1. validate everything, against the store as it is
  local plan, keys = {}, 1                -- keys: "counters", then each counter's
  for i, name in ipairs(names) do
    local cok, p = pcall(check_counter, name, counters[name])
    if not cok then
      if type(p) == "table" then raise(or_twice(p.msg)) end
      error(p, 0)
    end
    keys = keys + 1 + (p.policy and 3 or 2) + 2 * p.shards   -- name, fields, ids, counts
    local v, vmsg, code = self:value(name)
    if v == nil and code ~= "ENOENT" and code ~= "ERANGE" then
      return nil, vmsg, code                 -- a damaged store
    end
    if v ~= nil or code ~= "ENOENT" then     -- ERANGE: a sum beyond int64, but there
      local c, cmsg, ccode = self:counter(name)
      if not c then return nil, cmsg, ccode end
      local info, imsg, icode = c:info()
      if not info then return nil, imsg, icode end
      if info.overflow then return nil, capped(name), "EFULL" end   -- a handle db:counter cached
      -- a cpu counter has a shard per CPU of the machine that made it:
      -- another machine's is taken whole, whatever its CPUs (below)
      local cpu = p.policy == "cpu" and info.policy == "cpu"
      if not shards_fit(p, info) then
        raise(fmt("counter '%s': num_shards is %d but the counter exists with %d shards",
                  printable(name), p.shards, info.shards))
      end
      if not policy_fits(p, info) then
        raise(fmt("counter '%s': policy is %s but the counter exists with policy %s",
                  printable(name), p.policy, info.policy))
      end
      if mode == "add" and not cpu then
        local now, smsg, scode = c:shards()
        if not now then return nil, smsg, scode end
        for s = 1, p.shards do
          local sum = add(now[s], p.counts[s])  -- both within +-2^62: no overflow
          if sum < SHARD_MIN or sum > SHARD_MAX then
            raise(fmt('counter \'%s\': shards["%d"].count %s would take the shard '
                      .. "(now %s) out of its range (-2^62 to 2^62-1)",
                      printable(name), s - 1, int_text(p.counts[s]), int_text(now[s])))
          end
        end
      end
      p.c, p.here = c, info.shards
    elseif p.policy == "function" then
      raise(fmt("counter '%s': policy function cannot be created by an import: create the "
                .. "counter first with db:counter(name, { shards = %d, policy = fn })",
                printable(name), p.shards))
    end
    plan[i] = p
    step("validate", i, #names)
  end

  if keys ~= nkeys then raise(or_twice("a key is given twice")) end

  -- progress may raise once the store changes: what the import did is
  -- undone first, then that error raised again (as streamed does)
  local function step_or_undo(phase, i, n, log, created)
    local ok, err = pcall(step, phase, i, n)
    if not ok then
      undo(self, log, created)
      error(err, 0)
    end
  end

  -- 2. create the counters that do not exist
  local created = {}
  for i, p in ipairs(plan) do
    step_or_undo("create", i, #plan, { {}, {}, {} }, created)
    if not p.c then
      local cok, c, msg, code = pcall(self.counter, self, p.name, {
        shards = p.policy ~= "cpu" and p.shards or nil, policy = p.policy,  -- cpu: this machine's
        create = "new" })
      local mine = true
      if cok and not c and code == "EEXIST" then   -- made by another since the check: its own,
        mine = false                               -- never to be dropped by an undo
        cok, c, msg, code = pcall(self.counter, self, p.name, { create = false })
      end
      if not cok or not c then
        undo(self, { {}, {}, {} }, created)
        if not cok then error(c, 0) end
        return nil, msg, code
      end
      local info = c:info()
      if info and info.overflow then
        undo(self, { {}, {}, {} }, created)
        return nil, capped(p.name), "EFULL"
      end
      local unlike = not mine and info and made_unlike(p, info)
      if unlike then
        undo(self, { {}, {}, {} }, created)
        return nil, unlike, "EMISMATCH"
      end
      if mine then created[#created + 1] = p.name end
      p.c, p.here = c, info and info.shards
    end
  end

  -- 3. apply, shard by shard: "replace" adds the difference between the
  -- imported count and the shard as read just before, "add" the count. An
  -- increment another writer makes meanwhile stays in either way (as with
  -- c:reset(), which cannot serve here: it refuses a counter whose sum is
  -- beyond int64), and every add can be undone exactly.
  local log = { {}, {}, {} }
  local hs, ss, ns, k = log[1], log[2], log[3], 0
  for i, p in ipairs(plan) do
    step_or_undo("apply", i, #plan, log, created)
    local c = p.c
    local now, msg, code = c:shards()
    if now and #now ~= (p.here or p.shards) then
      now, msg, code = nil, fmt("counter '%s' was resharded to %d shards during the import",
                                printable(p.name), #now), "EMISMATCH"
    end
    if not now then
      undo(self, log, created)
      return nil, msg, code
    end
    local info = c:info()
    local slot = p.policy == "slot" or (info and info.policy == "slot")
    -- a cpu counter's shards are its CPUs' and its resets': added as one
    slot = slot or p.policy == "cpu" or (info and info.policy == "cpu")
    if slot then
      -- each shard of a slot counter is one writer's, journalled by it
      -- (src/core/batch.c): the importer adds the difference in its own
      local n = shard_sum(p.counts, p.shards, mode == "replace" and now or nil)
      if n == nil then
        undo(self, log, created)
        return nil, fmt("counter '%s': what the import adds to it is beyond a shard's range "
                        .. "(-2^62 to 2^62-1)", printable(p.name)), "ERANGE"
      end
      if n ~= 0 then
        local aok
        aok, msg, code = c:incr(n)
        if not aok then
          undo(self, log, created)
          return nil, msg, code
        end
        k = k + 1
        hs[k], ss[k], ns[k] = c, 0, n
      end
    end
    for s = 1, slot and 0 or p.shards do
      local n = p.counts[s]
      if mode == "replace" then n = sub(n, now[s]) end  -- both within +-2^62: no overflow
      if n ~= 0 then
        local cok, aok
        cok, aok, msg, code = pcall(c.add_shard, c, s, n)  -- raises if resharded just now
        if not cok then
          aok, msg, code = nil, fmt("counter '%s' was resharded during the import", printable(p.name)),
                           "EMISMATCH"
        end
        if not aok then
          undo(self, log, created)
          return nil, msg, code
        end
        k = k + 1
        hs[k], ss[k], ns[k] = c, s, n
      end
    end
  end
  return #plan
end

return { export = store.export, import = store.import, export_any = export_any,
         import_any = import_any }
