-- tally.firestore.store: a store whose counters are Cloud Firestore's
-- distributed counters (the seeds' layout), over the REST API
-- (tally/firestore/rest.lua). tally.open("firestore://PROJECT?emulator=H:P")
-- returns one.
--
--   counters/{ID}              { num_shards: N [, policy: "random"] }
--   counters/{ID}/shards/{i}   { count: n }              i = 0 .. N-1
--   counters/{ID}/writers/{W}  { flushed, inc, writer }  db:flush_to's markers
--   tally_families/{PATTERN}   { shards, policy, seq }   db:family
--
-- ID is the counter name escaped as rest.lua says (most names are their
-- own id). A counter document without `policy` (made by the seeds' code)
-- has the seeds' policy, random; `numShards` (the blog's variant) is read
-- too.
--
-- db:counter(name, { shards = N }) creates the counter as the seeds'
-- createCounter does, in one commit: the counter document (precondition:
-- it does not exist) and its N shards, each an increment by 0, which makes
-- count 0 where a shard is missing and keeps a count already there.
-- c:incr(n) is one commit of one field increment on the shard its policy
-- picks; it is not retried: when the reply is lost it returns nil, msg,
-- code and the increment may or may not have been applied (for
-- exactly-once, count locally and use db:flush_to). c:value() is one
-- batchGet of the N shards: one consistent snapshot (readTime).
-- c:reset() reads the shards with their updateTimes and commits, for each
-- non-zero shard, an increment by minus its count guarded by that
-- updateTime: a concurrent increment makes the commit fail whole, and it
-- is read and tried again (up to 20 times), so the amount returned is
-- exactly what was removed and no concurrent increment is lost.

local core = require "tally.core"
local compat = require "tally.compat"
local rest = require "tally.firestore.rest"

local tonumber, setmetatable, ipairs = tonumber, setmetatable, ipairs
local fmt, sort = string.format, table.sort
local add, sub, int_text = compat.add, compat.sub, compat.int_text

local printable = require("tally.util").printable
local remote = require "tally.remote"
local check_name, glob_pattern = remote.check_name, remote.glob_pattern
local check_pattern = remote.check_pattern

local _M = {}

local POLICIES = remote.POLICIES
local DEFAULT_POLICY = "random"          -- the seeds' policy
local FAMILIES = "tally_families"

local Store, Counter = {}, {}
local StoreMT = { __name = "tally.firestore_store" }
local CounterMT = { __name = "tally.firestore_counter" }

local function shard_write(cl, path, i, k)
  return { transform = { document = cl:name(path .. "/shards/" .. i),
           fieldTransforms = { { fieldPath = "count", increment = { integerValue = int_text(k) } } } } }
end

-- k added to shard i (1-based) of counter c of store db: one commit of
-- one field increment (c:incr's, through remote.classes, and c:add_shard's)
local function add_to(c, db, i, k)
  local ok, err, code = db.cl:commit({ shard_write(db.cl, c.path, i - 1, k) })
  if not ok then return nil, err, code end
  return true
end

-- db:close, db:sum, c:incr, c:decr, c:value, c:info, c:name, c:store,
-- c:close, and tostring; the client is db.cl
local live, cdb = remote.classes("cl", Store, Counter, StoreMT, CounterMT, add_to)

-- the document paths of counter name
local function cpath(self, name) return self.root .. "/" .. rest.escape(name) end
_M.cpath = function(root, name) return root .. "/" .. rest.escape(name) end

-- { shards =, policy = } of a counter document's fields, or nil
local function doc_options(doc)
  local f = doc and doc.fields
  if not f then return nil end
  local ns = f.num_shards or f.numShards
  local n = ns and rest.toint(ns)
  if not n or n < 1 then return nil end
  local p = f.policy and f.policy.stringValue
  return { shards = tonumber(n), policy = POLICIES[p] and p or DEFAULT_POLICY }
end
_M.doc_options = doc_options


-- options of a new counter: the newest matching family, else defaults
local function family_options(self, name)
  local docs, msg, code = live(self):list(FAMILIES)
  if not docs then return nil, msg, code end
  local best, bseq
  for _, d in ipairs(docs) do
    local f = d.fields or {}
    local pat = f.pattern and f.pattern.stringValue
    local seq = f.seq and rest.toint(f.seq)
    if pat and seq and name:match(glob_pattern(pat)) and (not bseq or seq > bseq) then
      best, bseq = { shards = tonumber(rest.toint(f.shards)),
                     policy = f.policy and f.policy.stringValue }, seq
    end
  end
  return best or {}
end

local get_ticket = remote.ticket

local function new_counter(self, name, shards, policy)
  return setmetatable({ db = self, nm = name, n = shards, policy = policy,
                        path = cpath(self, name), rr = get_ticket() % shards }, CounterMT)
end

-- db:counter(name [, opts]) -> counter, or nil, msg, code
function Store:counter(name, opts)
  check_name(name, "counter", 1)
  local shards, policy, create = remote.check_counter_opts("firestore", opts, "counter", 2)
  local cl = live(self)
  local path = cpath(self, name)
  for _ = 1, 3 do
    local got, msg, code = cl:batch_get({ path })
    if not got then return nil, msg, code end
    local o = doc_options(got[path])
    if o then
      remote.check_same(name, shards, policy, o.shards, o.policy)
      return new_counter(self, name, o.shards, o.policy)
    end
    if got[path] then return nil, fmt("counters document of '%s' has no num_shards", printable(name)), "EPROTO" end
    if not create then return nil, fmt("no such counter '%s'", printable(name)), "ENOENT" end
    local fam
    fam, msg, code = family_options(self, name)
    if not fam then return nil, msg, code end
    local s = shards or fam.shards or core.DEFAULT_SHARDS
    local p = policy or fam.policy or DEFAULT_POLICY
    local fields = { num_shards = rest.int(s) }
    if p ~= DEFAULT_POLICY then fields.policy = { stringValue = p } end
    local writes = { { update = { name = cl:name(path), fields = fields },
                       currentDocument = { exists = false } } }
    for i = 0, s - 1 do
      writes[#writes + 1] = { transform = { document = cl:name(path .. "/shards/" .. i),
        fieldTransforms = { { fieldPath = "count", increment = { integerValue = "0" } } } } }
    end
    local ok
    ok, msg, code = cl:commit(writes)
    if ok then return new_counter(self, name, s, p) end
    if code ~= "ALREADY_EXISTS" then return nil, msg, code end
    -- created meanwhile by another writer: read it again
  end
  return nil, fmt("counter '%s' keeps changing", printable(name)), "EAGAIN"
end

remote.by_name(Store) -- db:incr(name), db:decr, db:value(name)

-- the counter documents matching pattern: { { name =, shards = }, ... } sorted
local function listed(self, pattern)
  -- both spellings: numShards is the blog variant's (doc_options)
  local docs, err, code = live(self):list(self.root, { "num_shards", "numShards" })
  if not docs then return nil, err, code end
  local out = {}
  local lp = pattern and pattern ~= "*" and glob_pattern(pattern)
  for _, d in ipairs(docs) do
    local nm = rest.unescape(rest.id_of(d.name))
    if not lp or nm:match(lp) then
      local o = doc_options(d)
      out[#out + 1] = { name = nm, shards = o and o.shards }
    end
  end
  sort(out, function(a, b) return a.name < b.name end)
  return out
end

-- db:names([pattern]) -> sorted names of the counter documents
function Store:names(pattern)
  check_pattern(pattern, "names")
  local l, err, code = listed(self, pattern)
  if not l then return nil, err, code end
  local out = {}
  for i, e in ipairs(l) do out[i] = e.name end
  return out
end

-- db:values([pattern]) -> { [name] = value }: one listing, then batchGets
-- of every shard document (500 a request); not one snapshot across them.
-- db:sum (remote.classes) adds them.
function Store:values(pattern)
  check_pattern(pattern, "values")
  local l, err, code = listed(self, pattern)
  if not l then return nil, err, code end
  local paths, owner = {}, {}
  for _, e in ipairs(l) do
    if e.shards then
      local base = cpath(self, e.name) .. "/shards/"
      for i = 0, e.shards - 1 do
        paths[#paths + 1] = base .. i
        owner[#paths] = e.name
      end
    end
  end
  local got
  got, err, code = self.cl:batch_get(paths)
  if not got then return nil, err, code end
  local shards = {}
  for _, e in ipairs(l) do if e.shards then shards[e.name] = {} end end
  for i, p in ipairs(paths) do
    local d = got[p]
    local v, why = rest.toint(d and d.fields and d.fields.count)
    if v == nil then return nil, fmt("counter '%s': %s", printable(owner[i]), why), "EPROTO" end
    local vs = shards[owner[i]]
    vs[#vs + 1] = v
  end
  local out = {}
  for _, e in ipairs(l) do   -- in name order: which overflow is told is fixed
    if e.shards then
      out[e.name], err, code = remote.shards_sum(e.name, shards[e.name])
      if out[e.name] == nil then return nil, err, code end
    end
  end
  return out
end

-- db:drop(name): one commit deleting the counter document, its shards and
-- its writer markers (a flusher still running re-creates what it flushes).
function Store:drop(name)
  check_name(name, "drop", 1)
  local cl = live(self)
  local path = cpath(self, name)
  local got, err, code = cl:batch_get({ path })
  if not got then return nil, err, code end
  local o = doc_options(got[path])
  if not got[path] then return nil, fmt("no such counter '%s'", printable(name)), "ENOENT" end
  local writes = { { delete = cl:name(path) } }
  for _, sub_ in ipairs({ "shards", "writers" }) do
    local docs
    docs, err, code = cl:list(path .. "/" .. sub_)
    if not docs then return nil, err, code end
    for _, d in ipairs(docs) do writes[#writes + 1] = { delete = d.name } end
  end
  if o then
    for i = 0, o.shards - 1 do writes[#writes + 1] = { delete = cl:name(path .. "/shards/" .. i) } end
  end
  local ok
  ok, err, code = cl:commit(writes)
  if not ok then return nil, err, code end
  self.cache[name] = nil
  return true
end

-- db:family(pattern, { shards =, policy = }): kept in tally_families/{PATTERN}
function Store:family(pattern, opts)
  remote.check_family(pattern)
  local shards, policy = remote.check_counter_opts("firestore", opts, "family", 2)
  local cl = live(self)
  self.fseq = (self.fseq or 0) + 1
  local seq = add(compat.mul(os.time(), 1000000), (get_ticket() % 1000) * 1000 + self.fseq % 1000)
  local ok, err, code = cl:commit({ { update = { name = cl:name(FAMILIES .. "/" .. rest.escape(pattern)),
    fields = { pattern = { stringValue = pattern }, shards = rest.int(shards or core.DEFAULT_SHARDS),
               policy = { stringValue = policy or DEFAULT_POLICY }, seq = rest.int(seq) } } } })
  if not ok then return nil, err, code end
  return true
end

function Store:stats()
  local names, err, code = self:names()
  if not names then return nil, err, code end
  return { kind = "firestore", uri = self.uri, counters = #names, requests = self.cl.requests }
end

-- db:export([pattern]) / db:import(json [, opts]): the code of tally/export.lua
function Store:export(pattern, write) return require("tally.export").export_any(self, pattern, write) end
function Store:import(text, opts) return require("tally.export").import_any(self, text, opts) end

-- ---- counters ---------------------------------------------------------------------

-- the shard documents: { count, ... } (1-based), { updateTime or false, ... }
local function read_shards(self)
  local db = cdb(self)
  local paths = {}
  for i = 0, self.n - 1 do paths[i + 1] = self.path .. "/shards/" .. i end
  local got, err, code = db.cl:batch_get(paths)
  if not got then return nil, err, code end
  local vals, times = {}, {}
  for i, p in ipairs(paths) do
    local d = got[p]
    local v, why = rest.toint(d and d.fields and d.fields.count)
    if v == nil then return nil, fmt("counter '%s' shard %d: %s", printable(self.nm), i - 1, why), "EPROTO" end
    vals[i], times[i] = v, d and d.updateTime or false
  end
  return vals, times
end

-- c:shards() -> { v1, ..., vn } (shard i is the document shards/{i-1}),
-- or nil, msg, code
function Counter:shards()
  local vals, times, code = read_shards(self)
  if not vals then return nil, times, code end
  return vals
end

function Counter:reset()
  local db = cdb(self)
  for _ = 1, 20 do
    local vals, times, code = read_shards(self)
    if not vals then return nil, times, code end
    local writes, removed = {}, 0
    for i, v in ipairs(vals) do
      if v ~= 0 then
        local w = shard_write(db.cl, self.path, i - 1, sub(0, v))
        w.currentDocument = { updateTime = times[i] }
        writes[#writes + 1] = w
        removed = remote.add_fits(removed, v)
        if removed == nil then return remote.reset_range(self.nm) end  -- nothing sent
      end
    end
    if #writes == 0 then return 0 end
    local ok, err
    ok, err, code = db.cl:commit(writes)
    if ok then return removed end
    if code ~= "FAILED_PRECONDITION" and code ~= "ABORTED" then return nil, err, code end
  end
  return nil, fmt("reset of '%s': the shards kept changing", printable(self.nm)), "EAGAIN"
end

-- c:add_shard(i, n): add n to shard i (1-based), as db:import does
function Counter:add_shard(i, n) return add_to(self, cdb(self), i, n) end

-- anything else the file store offers raises
StoreMT.__index = remote.index_with(Store, core.store_methods, "firestore")
CounterMT.__index = remote.index_with(Counter, core.counter_methods, "firestore")

_M.Store, _M.Counter = Store, Counter

-- a store on parsed URI u, with no request made
function _M.new(u, timeout)
  local cl = rest.client(u, { timeout = timeout })
  return setmetatable({ uri = u.redacted, u = u, cl = cl, root = u.root, cache = {} }, StoreMT)
end

-- tally.open(uri [, { timeout = s }]) -> store, or nil, msg, code
function _M.open(uri, opts)
  local o = remote.open_options("firestore", opts, "timeout")
  local u, err = rest.parse(uri)
  if not u then return nil, err, "EINVAL" end
  local self = _M.new(u, o.timeout or 10)
  local cl = self.cl
  -- one request now, so a server that is down is found here
  local ok, msg, code = cl:batch_get({ u.root .. "/%5F%5Fprobe" })
  if not ok then
    cl:close()
    return nil, msg, code
  end
  return self
end

return _M
