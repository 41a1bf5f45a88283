-- tally.redis.flush: the Redis and Redis Cluster backend of db:flush_to
-- (tally/flush.lua: the schedule, its options and methods). The protocol
-- runs in C (include/tally_net.h, src/net/redis_flush.c); this file
-- connects it and hands it the rounds.
--
--   local rf = db:flush_to("redis+cluster://10.0.0.1:7000,10.0.0.2:7000",
--                          { every = 1, pattern = "*", shards = 8,
--                            writer = "web-7", timeout = 5 })
--
-- Its own options: password, user (else from the URI or the environment,
-- as core.redis takes them) and verify (seconds between two forced reads
-- of every w:W; 0: only after a topology change or rf:verify()). shards is
-- the remote shard count (default 8), timeout a command's (default 5 s).
--
-- The writer id. Each (local store, writer) pair is one writer in Redis:
-- its local counter values ARE what it has contributed, so the id must
-- stay the same for as long as the local values do (tally.remote's
-- default_writer). Only one process at a time may flush a given file
-- store (its writer id is shared by every handle on that file).
--
-- Failures (Redis down, a connection dropped) are counted in :stats() and
-- never raised by db:tick(); the next period retries. Bad URIs and options
-- raise at once.

local core = require "tally.core"
local flush = require "tally.flush"

local type, error, tostring, pcall, setmetatable, ipairs =
      type, error, tostring, pcall, setmetatable, ipairs

local argerror = require("tally.util").argerror

local Redis = flush.backend({}, { options = { "password", "user", "verify" }, shards = 8,
                                  timeout = 5 })

-- The URI and credentials to connect with, kept out of the schedule's
-- table (stats, tostring and tick results show the redacted URI only).
local secrets = setmetatable({}, { __mode = "k" })

-- the redis handle and the flusher over it: true, or nil, msg
local function attach(self, rh)
  local ok, fl = pcall(core.flusher, self.db, rh, { writer = self.writer, shards = self.shards,
                                                  verify = self.verify_every })
  if not ok or not fl then
    rh:close()
    return nil, tostring(fl)
  end
  self.redis, self.flusher = rh, fl
  return true
end

-- Open the redis handle and the flusher if not open yet: true, or nil,
-- msg, code.
local function connect(self)
  if self.flusher then return true end
  local sec = secrets[self]
  local rh, err, code = core.redis(sec.uri, { timeout = self.timeout, password = sec.password,
                                              user = sec.user })
  if not rh then return nil, err, code end
  return attach(self, rh)
end

function Redis.new(self, uri, opts)
  if type(uri) ~= "string" then
    argerror(1, "flush_to", "Redis URI expected, got " .. type(uri), 4)
  end
  for _, k in ipairs({ "password", "user" }) do
    if opts[k] ~= nil and (type(opts[k]) ~= "string" or opts[k] == "") then
      argerror(2, "flush_to", k .. " must be a non-empty string, got " .. type(opts[k]), 4)
    end                                     -- never quote the value
  end
  self.verify_every = flush.number(opts, "verify", 60, 0, 4294967)
  self.uri, self.commands = core.uri_redact(uri), 0
  secrets[self] = { uri = uri, password = opts.password, user = opts.user }
  -- Connect now so a bad URI raises here; a server that is down is only
  -- counted (the schedule connects on its next period).
  local ok, rh, err = pcall(core.redis, uri, { timeout = self.timeout, password = opts.password,
                                               user = opts.user })
  if not ok then
    error((tostring(rh):gsub("^bad argument #1 to '[^']*'", "bad argument #1 to 'flush_to'")), 4)
  end
  if rh then self.redis = rh else self.last_error = err end
end

-- the flusher over the connection made by new, now that the writer is
-- known (raising: a refused flusher is a bad option)
function Redis:_start()
  if not self.redis then return end
  local rh = self.redis
  self.redis = nil
  local ok, msg = attach(self, rh)
  if not ok then error(msg, 4) end
end

function Redis:_round()
  local ok, err, code = connect(self)
  if not ok then return nil, err, code end
  local st, msg, rcode = self.flusher:run(self.pattern)
  if not st then return nil, msg, rcode end
  self.flushed = self.flushed + st.flushed
  self.commands = self.commands + st.commands
  return st
end

-- nothing was sent: every w:W was known, and read back where it had to be
function Redis:_settled(st) return st.commands == 0 end

function Redis:_remote_value(name)
  local ok, err, code = connect(self)
  if not ok then return nil, err, code end
  return self.flusher:remote_value(name)
end

function Redis:_verify()
  if self.flusher then self.flusher:verify() end
end

function Redis:_stats(t)
  t.commands = self.commands
  if self.redis then
    local ok, s = pcall(self.redis.stats, self.redis)
    t.redis = ok and s or nil
  end
end

function Redis:_close()
  if self.flusher then self.flusher:close() end
  if self.redis then self.redis:close() end
  self.flusher, self.redis = nil, nil
end

return Redis
