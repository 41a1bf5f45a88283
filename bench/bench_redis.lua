-- bench/bench_redis.lua: run by scripts/bench-redis (see there). Starts a
-- 3-master cluster (spec/support/redis.lua), then measures, in this one run:
--   * events/s absorbed by local shards (c:incr on a memory store) while
--     db:flush_to flushes to the cluster every second (db:tick in the loop),
--     and the Redis commands per second those flushes cost;
--   * INCRBY per event from Lua (core.redis, unpipelined);
--   * INCRBY per event from redis-benchmark, unpipelined and pipelined 64
--     (one connection), sent straight to the master owning the key;
--   * the Redis store's c:incr on a standalone server, plain and with
--     replicas = 1 (HINCRBY + WAIT 1 per increment, a replica attached).
-- Each row checks its final remote total against the events it counted.
local secs = tonumber(arg[1]) or 3
local helper = require "spec.support.helper"
local redis = require "spec.support.redis"
local tally = require "tally"
local core = require "tally.core"

local srv = redis.start()
local ok, err = pcall(function()
  local rows = {}
  local r = assert(core.redis(srv.cluster_uri))

  -- 1. local shards + 1 s flush
  local db = tally.open("memory")
  local rf = db:flush_to(srv.cluster_uri, { every = 1, shards = 8, writer = "bench" })
  local c = db:counter("bench:local", { shards = 16 })
  local n, t0 = 0, tally.now()
  local stop = t0 + secs
  while true do
    for _ = 1, 4096 do c:incr() end
    n = n + 4096
    db:tick()
    if tally.now() >= stop then break end
  end
  local t1 = tally.now()
  local st = assert(rf:flush_now())
  local cmds = rf:stats().commands
  local remote = rf:remote_value("bench:local")
  rows[#rows + 1] = { "local shards, flush every 1 s (Lua 5.4, c:incr)", n / (t1 - t0),
                      cmds / (t1 - t0), remote == n, n, remote }
  rf:close()
  db:close()

  -- 2. INCRBY from Lua, unpipelined
  local key = "bench:incrby"
  r:command("DEL", key)
  n, t0 = 0, tally.now()
  stop = t0 + secs
  while tally.now() < stop do
    for _ = 1, 64 do r:command("INCRBY", key, 1) end
    n = n + 64
  end
  t1 = tally.now()
  remote = tonumber(r:command("GET", key))
  rows[#rows + 1] = { "INCRBY per event (Lua, core.redis, unpipelined)", n / (t1 - t0),
                      n / (t1 - t0), remote == n, n, remote }

  -- 3. redis-benchmark, to the master that owns the key
  local function owner(k)
    local slot = r:command("CLUSTER", "KEYSLOT", k)
    for _, e in ipairs(r:command("CLUSTER", "SLOTS")) do
      if slot >= e[1] and slot <= e[2] then return e[3][2] end
    end
  end
  for _, P in ipairs({ 1, 64 }) do
    local k = "bench:rb" .. P
    r:command("DEL", k)
    local port = owner(k)
    local count = P == 1 and 100000 or 2000000
    local out = helper.sh(("env -u LD_PRELOAD redis-benchmark -h 127.0.0.1 -p %d -c 1 -P %d -n %d --csv INCRBY %s 1")
      :format(port, P, count, k))
    local rps = tonumber(out:match('"INCRBY[^"]*","([%d.]+)"'))
    if not rps then error("redis-benchmark: " .. out) end
    remote = tonumber(r:command("GET", k))
    rows[#rows + 1] = { ("INCRBY per event (redis-benchmark, -c 1 -P %d)"):format(P), rps, rps,
                        remote == count, count, remote }
  end
  r:close()

  -- 4. the Redis store's c:incr on the standalone server, without and with
  --    replicas = 1 (HINCRBY + WAIT 1, pipelined), a replica attached
  local rep = redis.start_standalone({ "--replicaof", "127.0.0.1", tostring(srv.standalone) })
  local rok, rerr = pcall(function()
    for _ = 1, 200 do
      if redis.cli(rep.port, "INFO", "replication"):find("master_link_status:up", 1, true) then break end
      tally.sleep(0.05)
    end
    for _, mode in ipairs({ false, true }) do
      local sdb = assert(tally.open(srv.uri, mode and { replicas = 1, replica_timeout = 1000 } or nil))
      local name = "bench:store:" .. (mode and "wait" or "plain")
      local sc = assert(sdb:counter(name, { shards = 8, policy = "random" }))
      n, t0 = 0, tally.now()
      stop = t0 + secs
      while tally.now() < stop do
        for _ = 1, 64 do assert(sc:incr()) end
        n = n + 64
      end
      t1 = tally.now()
      remote = sdb:value(name)
      local per = mode and 2 or 1
      rows[#rows + 1] = { mode and "Redis store c:incr, replicas = 1 (HINCRBY + WAIT 1; standalone + 1 replica)"
                               or "Redis store c:incr (HINCRBY; standalone)",
                          n / (t1 - t0), per * n / (t1 - t0), remote == n, n, remote }
      sdb:drop(name)
      sdb:close()
    end
  end)
  rep.stop()
  if not rok then error(rerr, 0) end

  local base = rows[2][2]
  print(("Redis: 3-master cluster on 127.0.0.1, %g s per row, redis %s"):format(secs,
    (helper.sh("redis-server --version"):match("v=([%d.]+)") or "?")))
  print()
  print("| method | events/s | Redis commands/s | vs INCRBY from Lua | final total exact |")
  print("|---|---:|---:|---:|---|")
  for _, row in ipairs(rows) do
    print(("| %s | %s | %s | %.1fx | %s (%d) |"):format(row[1], ("%.0f"):format(row[2]),
      ("%.0f"):format(row[3]), row[2] / base, row[4] and "yes" or "NO", row[5]))
  end
  print()
  print(("local shards vs pipelined-64 INCRBY: %.1fx"):format(rows[1][2] / rows[4][2]))
end)
srv.stop()
if not ok then error(err, 0) end
