-- tally.firestore.flush: the Cloud Firestore backend of db:flush_to
-- (tally/flush.lua: the schedule, its options and methods): it ships the
-- local counters of a store handle to Firestore's distributed counters
-- exactly once per writer.
--
--   local ff = db:flush_to("firestore://my-project", { every = 1, writer = "web-7" })
--   db:run(60)
--   ff:remote_value("post:42:likes")   -- every writer's completed flushes
--   ff:stats()                         -- lag, commits, writes, errors, ...
--
-- The protocol. Each (counter, writer) has a marker document
-- counters/{ID}/writers/{W} = { flushed = V, inc = INCARNATION, writer = W }:
-- the local value V of that incarnation of the counter that Firestore
-- already holds. A flush of a counter whose local value is now V' is part
-- of one commit holding
--   1. counters/{ID} = { num_shards = N } with currentDocument.exists =
--      false, only while the counter document is not known to exist;
--   2. an increment of counters/{ID}/shards/{k}.count by V' - V, where k =
--      hash(W) mod N (N from the counter document: the seeds' counters
--      keep their own shard count), so a writer only writes its own shard;
--   3. the marker = { flushed = V', ... } with currentDocument.updateTime =
--      the marker's updateTime from the last commit or read (exists =
--      false when there is none).
-- A commit is atomic: when a reply is lost and the commit is sent again
-- (or a process restarts and sends an old delta) the precondition of 3
-- fails and the whole commit is rejected, 2 included. After any failure
-- (lost reply, timeout, FAILED_PRECONDITION, ALREADY_EXISTS, ABORTED, ...)
-- the counters of that commit are read again (batchGet of the counter and
-- marker documents) and the delta is computed from what Firestore holds,
-- never from what was sent. A counter met for the first time (by a new
-- process) is not read first: its commit assumes neither document exists
-- (exists = false preconditions); if one does (a restart, a counter of
-- another writer or of the seeds' code) the commit is refused whole and
-- they are read. So a process killed mid-flush resends exactly its
-- unflushed delta after a restart, and nothing twice.
-- Several counters share one commit (opts.batch); it is still all or none.
--
-- A counter that expires locally (docs/lifecycle.md) leaves only once its
-- final value is in Firestore (core.ship / core.counter_ship, as the
-- Redis flusher): the flusher registers the pattern, and marks each value
-- it has flushed, or read back. Before a commit goes out it marks the
-- counter unknown (held whatever its value: the commit may land with its
-- reply lost) and reads the value to send again, so a counter never
-- expires at the old mark while Firestore holds a later value; the mark
-- stays until the commit's reply or a read back gives Firestore's value.
-- A counter created again is a new incarnation: its value is flushed in
-- full, the marker then names the new incarnation.
--
-- Limits (enforced here; the emulator enforces none):
--   doc_interval  at least this many seconds between two writes of one
--                 document by this writer (default 1: Firestore's sustained
--                 one write per second per document)
--   rate          writes per second at start (default 500), growing by ramp
--                 (default 1.5) every ramp_every seconds (default 300) of
--                 flushing: Firestore's 500/50/5 rule; a token bucket
--   batch         counters per commit (default 100; 2 or 3 writes each)
--   backoff       on ABORTED, RESOURCE_EXHAUSTED, UNAVAILABLE, timeouts:
--                 the next round waits backoff s (default 0.25), doubling
--                 up to max_backoff (default 30), with jitter
-- Counters not flushed in a round (rate, interval, backoff) stay pending;
-- ff:stats().lag is the age of the oldest pending delta, in seconds.

local core = require "tally.core"
local compat = require "tally.compat"
local rest = require "tally.firestore.rest"
local fstore = require "tally.firestore.store"

local flush = require "tally.flush"

local pcall, pairs, ipairs = pcall, pairs, ipairs
local min, random = math.min, math.random
local int_text = compat.int_text

local argerror = require("tally.util").argerror
local key_shard = require("tally.remote").key_shard
local now = core.now

local Remote = flush.backend({}, {
  options = { "rate", "ramp", "ramp_every", "doc_interval", "batch", "backoff", "max_backoff" },
  timeout = 10 })

local NO_INC = "0000000000000000"
local RETRY = rest.RETRY

-- ---- the rate limits -------------------------------------------------------------

-- writes allowed per second now (the ramp-up rule)
function Remote:_rate(t)
  if not self.t0 then return self.rate end
  local steps = math.floor((t - self.t0) / self.ramp_every)
  return self.rate * self.ramp ^ min(steps, 60)
end

-- take n write tokens if there are; the bucket holds one second of rate
function Remote:_take(n, t)
  local rate = self:_rate(t)
  self.tokens = min(rate, self.tokens + (t - self.tlast) * rate)
  self.tlast = t
  if self.tokens < n then return false end
  self.tokens = self.tokens - n
  return true
end

-- a request failed: the next rounds back off (the frame counts the error)
function Remote:_fail(code)
  if RETRY[code] or code == "ETIMEDOUT" or code == "ECONNECT" or code == "EHTTP" then
    self.backoffs = self.backoffs + 1
    local b = self.cur_backoff
    self.cur_backoff = min(self.max_backoff, b * 2)
    self.not_before = now() + b * (0.5 + random())
  end
end

-- ---- the protocol --------------------------------------------------------------------

-- read the counter and marker documents of the unknown entries
function Remote:_read(list)
  local paths = {}
  for _, en in ipairs(list) do
    paths[#paths + 1] = en.cpath
    paths[#paths + 1] = en.mpath
  end
  local got, msg, code = self.cl:batch_get(paths)
  self.reads = self.reads + #paths
  if not got then return nil, msg, code end
  for _, en in ipairs(list) do
    local cdoc, mdoc = got[en.cpath], got[en.mpath]
    local o = fstore.doc_options(cdoc)
    en.exists = cdoc and true or false
    en.rshards = o and o.shards or nil
    if mdoc then
      local f = mdoc.fields or {}
      en.flushed = rest.toint(f.flushed) or 0
      local inc = f.inc and f.inc.stringValue
      if inc ~= nil and (#inc ~= 16 or inc:find("[^0-9a-f]")) then
        en.flushed, inc = 0, nil  -- not an incarnation tally writes: another's, counted from 0
      end
      en.minc = inc or NO_INC     -- none: written before incarnations, this one's
      en.utime = mdoc.updateTime
    else
      en.flushed, en.minc, en.utime = 0, nil, nil
    end
    en.known, en.guess = true, nil
  end
  return true
end

-- what en still has to send over its marker: the delta; false when
-- nothing; nil, msg, code when it cannot be sent (beyond int64)
local function delta_of(en)
  local d, msg, code = core.send_delta(en.v, en.inc, en.flushed, en.minc or NO_INC)
  if d == nil then return nil, msg, code end
  return d ~= 0 and d
end

-- Before en's commit goes out (core.counter_send_begin): mark it unknown,
-- then read the value to send again. -> the delta to send; or nil and why
-- not: "gone" (expired, dropped or made again twice meanwhile: the next
-- round sees it afresh), "failed" (still pending; and the message and
-- code), "back" (it moved back to the value Firestore holds: nothing to
-- send).
local GONE = { ENOENT = true, EDROPPED = true, EBUSY = true }
local function mark_sending(en)
  local pok, d, v, inc = pcall(core.counter_send_begin, en.c, en.flushed, en.minc or NO_INC)
  en.shipv, en.unmarked = nil, true   -- (it may be marked) to be marked again once known
  if not pok then return nil, "failed", d end
  if d == nil then return nil, GONE[inc] and "gone" or "failed", v, inc end
  en.v, en.inc = v, inc
  if d == 0 then return nil, "back" end
  return d
end

-- one commit for the entries of batch; true, or nil, msg, code
function Remote:_commit(batch)
  local cl = self.cl
  local writes, mark = {}, {}
  for _, en in ipairs(batch) do
    local n = en.rshards or en.lshards
    if not en.exists then
      writes[#writes + 1] = { update = { name = cl:name(en.cpath), fields = { num_shards = rest.int(n) } },
                              currentDocument = { exists = false } }
    end
    local k = key_shard(self.writer, n) - 1
    writes[#writes + 1] = { transform = { document = cl:name(en.cpath .. "/shards/" .. k),
      fieldTransforms = { { fieldPath = "count", increment = { integerValue = int_text(en.d) } } } } }
    writes[#writes + 1] = { update = { name = cl:name(en.mpath), fields = {
        flushed = rest.int(en.v), inc = { stringValue = en.inc }, writer = { stringValue = self.writer } } },
      currentDocument = en.utime and { updateTime = en.utime } or { exists = false } }
    mark[#mark + 1] = #writes
  end
  -- writes per calendar second they were sent in, the peak (counted when
  -- sent, as the token bucket counts them, not when the reply came)
  local sec = math.floor(now())
  if sec ~= self.sec then self.sec, self.sec_writes = sec, 0 end
  self.sec_writes = self.sec_writes + #writes
  if self.sec_writes > self.peak then self.peak = self.sec_writes end
  local rep, msg, code = cl:commit(writes)
  self.commits = self.commits + 1
  self.writes = self.writes + #writes
  local t = now()
  if not rep then
    -- the outcome is unknown or refused: read them again before anything else
    for _, en in ipairs(batch) do
      en.known = false
      if code == "ELOST" or code == "ETIMEDOUT" or code == "EHTTP" then en.last = t end  -- may be written
    end
    if code == "FAILED_PRECONDITION" or code == "ALREADY_EXISTS" then self.conflicts = self.conflicts + 1 end
    return nil, msg, code
  end
  local wr = rep.writeResults or {}
  for i, en in ipairs(batch) do
    local r = wr[mark[i]]
    en.utime = r and r.updateTime
    if not en.utime then en.known = false end      -- cannot happen; read it again
    en.flushed, en.minc, en.exists, en.guess = en.v, en.inc, true, nil
    en.rshards = en.rshards or en.lshards
    en.last, en.since = t, nil
    self.flushed = self.flushed + 1
    self.delta = compat.add(self.delta, en.d)
    pcall(core.counter_ship, en.c, en.inc, en.v)
    en.shipv = en.v
  end
  return true
end

-- one round: true, stats of the round; or nil, msg, code
function Remote:_round()
  local t = now()
  local st = { counters = 0, flushed = 0, pending = 0, commits = 0, errors = 0 }
  if self.not_before and t < self.not_before then
    st.waiting = self.not_before - t
    return self:_lag(st, t)
  end
  if not self.shipped then
    local ok, msg, code = core.ship(self.db, self.writer, self.pattern)
    if not ok then return nil, msg, code end
    self.shipped = true
  end
  local names, msg, code = self.db:names(self.pattern)
  if not names then return nil, msg, code end
  local ents = self.ents
  local unknown, due, live = {}, {}, {}
  for _, name in ipairs(names) do
    local en = ents[name]
    if not en then
      local path = fstore.cpath(self.root, name)
      -- first guess: nothing in Firestore yet (a new counter, a new
      -- writer). Its commit then requires the counter and marker documents
      -- not to exist; if they do (a restart, another writer's counter) it
      -- is rejected whole and they are read, as after any failure.
      en = { name = name, cpath = path, mpath = path .. "/writers/" .. rest.escape(self.writer),
             known = true, exists = false, flushed = 0, guess = true }
      ents[name] = en
    end
    local v, inc
    for _ = 1, 2 do
      if not en.c then en.c = self.db:counter(name, { create = false }) end
      if not en.c then break end
      v, inc = core.counter_read(en.c)
      if v ~= nil then break end
      en.c = nil                                          -- dropped: open it again by name
    end
    if v ~= nil and inc ~= NO_INC then
      live[name] = true
      st.counters = st.counters + 1
      en.v, en.inc = v, inc
      if not en.lshards then en.lshards = self.shards or en.c:info().shards end
      if not en.known then unknown[#unknown + 1] = en else due[#due + 1] = en end
    end
  end
  -- a counter gone (dropped, expired: what it counted is in Firestore, or
  -- given up by the drop) leaves nothing pending, and its entry goes: a
  -- flusher over short-lived keys stays the size of the live ones. Made
  -- again, it is a first guess (read when its commit is refused).
  for name in pairs(ents) do
    if not live[name] then ents[name] = nil end
  end
  -- what Firestore holds for the unknown ones
  for i = 1, #unknown, 250 do
    local part = {}
    for j = i, min(i + 249, #unknown) do part[#part + 1] = unknown[j] end
    local ok
    ok, msg, code = self:_read(part)
    if not ok then
      self:_fail(code)
      return nil, msg, code
    end
    for _, en in ipairs(part) do due[#due + 1] = en end
  end
  -- choose what to send now
  local batch, nw, failure = {}, 0, nil
  local function send()
    if #batch == 0 then return true end
    local ok, m, c = self:_commit(batch)
    st.commits = st.commits + 1
    if ok then st.flushed = st.flushed + #batch end
    batch, nw = {}, 0
    if not ok then
      st.errors = st.errors + 1
      self:_fail(c)
      return nil, m, c
    end
    self.cur_backoff = self.backoff
    return true
  end
  -- nothing to send: Firestore holds en.v for this incarnation (as its
  -- marker, or nothing of it when the marker is another's and en.v is 0),
  -- unless that is only the first guess (a restarted writer may have
  -- flushed a value this one has not read)
  local function settled(en)
    en.since = nil
    if en.guess then
      -- marked unknown (mark_sending) and back to the guessed value: only
      -- a read of Firestore may mark it again; unread it is held for good
      if en.unmarked then en.known = false end
    elseif en.shipv ~= en.v then                     -- read back: may expire at this value
      pcall(core.counter_ship, en.c, en.inc, en.v)
      en.shipv = en.v
    end
  end
  -- first guesses go last, in commits of their own: a guess refused
  -- (ALREADY_EXISTS: a name forgotten and made again, a restart) then
  -- refuses only guesses, never the known counters it would have shared
  -- a commit with, round after round
  local order = {}
  for _, en in ipairs(due) do
    if not en.guess then order[#order + 1] = en end
  end
  local nknown = #order
  for _, en in ipairs(due) do
    if en.guess then order[#order + 1] = en end
  end
  for i, en in ipairs(order) do
    if i == nknown + 1 then
      local ok, m, c = send()                          -- the known ones' last commit
      if not ok then return nil, m, c end
    end
    local d, dmsg, dcode = delta_of(en)
    if d == nil then                                   -- never marked shipped: held
      en.since = en.since or t
      st.pending, st.errors = st.pending + 1, st.errors + 1
      failure = failure or { dmsg, dcode }
    elseif not d then
      settled(en)
    else
      en.since = en.since or t
      local w = en.exists and 2 or 3
      if en.last and t - en.last < self.doc_interval then
        st.pending = st.pending + 1                    -- its documents were written < 1 s ago
      elseif not self:_take(w, t) then
        st.pending = st.pending + 1                    -- over the ramp-up budget
        st.limited = true
      else
        local why, fmsg, fcode
        d, why, fmsg, fcode = mark_sending(en)
        if not d then
          self.tokens = self.tokens + w                -- not sent: its writes are not spent
          if why == "failed" then
            st.pending, st.errors = st.pending + 1, st.errors + 1
            failure = failure or { fmsg, fcode }
          elseif why == "back" then settled(en)
          else en.since = nil end                      -- gone: the next round sees it afresh
        else
          if not self.t0 then self.t0 = t end
          en.d = d
          batch[#batch + 1] = en
          nw = nw + w
          if #batch >= self.batch then
            local ok, m, c = send()
            if not ok then return nil, m, c end
          end
        end
      end
    end
  end
  local ok, m, c = send()
  if not ok then return nil, m, c end
  self:_lag(st, t)
  -- a counter that could not be sent fails the round once the others went
  if failure then return nil, tostring(failure[1]), failure[2] end
  return st
end

function Remote:_lag(st, t)
  local oldest, pending = nil, 0
  for _, en in pairs(self.ents) do
    if en.since then
      pending = pending + 1
      if not oldest or en.since < oldest then oldest = en.since end
    end
  end
  self.lag = oldest and (t - oldest) or 0
  self.pending = pending
  st.lag, st.pending = self.lag, pending
  return st
end

-- nothing pending, nothing failed, every marker known
function Remote:_settled(st)
  if st.pending ~= 0 or st.errors ~= 0 then return false end
  for _, en in pairs(self.ents) do if en.known == false then return false end end
  return true
end

-- the total in Firestore (every writer's completed flushes and any other
-- increments)
function Remote:_remote_value(name)
  local c, msg, code = self.remote:counter(name, { create = false })
  if not c then return nil, msg, code end
  return c:value()
end

-- the next round reads every marker (and counter document) again
function Remote:_verify()
  for _, en in pairs(self.ents) do en.known = false end
end

function Remote:_stats(t)
  t.commits, t.writes, t.reads, t.conflicts = self.commits, self.writes, self.reads, self.conflicts
  t.backoffs, t.delta, t.peak_writes_per_s = self.backoffs, self.delta, self.peak
  t.lag, t.pending, t.rate = self.lag, self.pending, self:_rate(now())
  t.requests = self.cl and self.cl.requests
end

-- ff:http(): the http handle (tests inject lost replies through it)
function Remote:http() return self.cl.h end

function Remote:_close()
  if self.remote then self.remote:close() end
  self.cl = nil
end

local number = flush.number

function Remote.new(self, uri, opts)
  local u, err = rest.parse(uri)
  if not u then argerror(1, "flush_to", err, 4) end
  self.uri, self.root = u.redacted, u.root
  self.rate = number(opts, "rate", 500, 1, 1e9)
  self.ramp = number(opts, "ramp", 1.5, 1, 100)
  self.ramp_every = number(opts, "ramp_every", 300, 0.001, 1e9)
  self.doc_interval = number(opts, "doc_interval", 1, 0, 86400)
  self.batch = number(opts, "batch", 100, 1, 10000, true)
  self.backoff = number(opts, "backoff", 0.25, 0.001, 3600)
  self.max_backoff = number(opts, "max_backoff", 30, 0.001, 86400)
  self.commits, self.writes, self.reads, self.conflicts, self.backoffs = 0, 0, 0, 0, 0
  self.delta, self.lag, self.pending, self.ents, self.peak, self.sec_writes = 0, 0, 0, {}, 0, 0
  self.cur_backoff = self.backoff
  self.tokens, self.tlast = self.rate, now()
  -- no request yet: a Firestore that is down is counted by the rounds
  self.remote = fstore.new(u, self.timeout)
  self.cl = self.remote.cl
end

return Remote
