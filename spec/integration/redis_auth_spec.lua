-- Redis passwords: URIs with user:password@, the password and user
-- options, TALLY_REDIS_PASSWORD, and that no message ever shows a password.
-- One standalone server with --requirepass and an ACL user (Redis 6+).
local helper = require "spec.support.helper"
local redis = require "spec.support.redis"
local tally = require "tally"
local core = require "tally.core"

local PW, APW = "s3cr3t-Pw", "al!ce:pw@x"   -- the ACL one needs %-escapes in a URI
local srv

setup(function()
  srv = redis.start_standalone({ "--requirepass", PW,
                                 "--user", "alice", "on", ">" .. APW, "~*", "&*", "+@all" })
end)
teardown(function() if srv then srv.stop() end end)

local function hostport() return "127.0.0.1:" .. srv.port end

-- Every string reachable from v (tables walked), concatenated.
local function text(...)
  local out = {}
  local function walk(v, seen)
    if type(v) == "table" then
      if seen[v] then return end
      seen[v] = true
      for k, x in pairs(v) do walk(k, seen); walk(x, seen) end
    elseif v ~= nil then
      out[#out + 1] = tostring(v)
    end
  end
  for i = 1, select("#", ...) do walk((select(i, ...)), {}) end
  return table.concat(out, "\n")
end

local function no_secret(s)
  assert.is_nil(s:find(PW, 1, true), "password leaked: " .. s)
  assert.is_nil(s:find("al!ce", 1, true), "password leaked: " .. s)
  assert.is_nil(s:find("wrong-pw", 1, true), "password leaked: " .. s)
end

describe("Redis passwords", function()
  it("authenticates with a password in the URI", function()
    local r = assert(core.redis("redis://:" .. PW .. "@" .. hostport()))
    assert.equal("PONG", r:command("PING"))
    assert.equal("default", r:command("ACL", "WHOAMI"))
    r:close()
  end)

  it("authenticates an ACL user (AUTH user password), %-escapes decoded", function()
    local r = assert(core.redis("redis://alice:al%21ce%3Apw%40x@" .. hostport()))
    assert.equal("alice", r:command("ACL", "WHOAMI"))
    r:close()
    r = assert(core.redis("redis+cluster://alice:al%21ce%3Apw%40x@" .. hostport()))
    assert.equal("alice", r:command("ACL", "WHOAMI"))
    r:close()
  end)

  it("takes the password from an option or TALLY_REDIS_PASSWORD", function()
    local r = assert(core.redis(srv.uri, { password = PW }))
    assert.equal("PONG", r:command("PING"))
    r:close()
    r = assert(core.redis(srv.uri, { user = "alice", password = APW }))
    assert.equal("alice", r:command("ACL", "WHOAMI"))
    r:close()
    -- the environment: a child process, as a deployment would set it
    local script = helper.tmpfile("auth-env.lua")
    helper.write(script, ("package.path = %q; package.cpath = %q\n"
      .. "local r = assert(require('tally.core').redis(%q)); io.write(r:command('PING'))")
      :format(package.path, package.cpath, srv.uri))
    local out = helper.sh("env TALLY_REDIS_PASSWORD=" .. helper.q(PW) .. " lua5.4 " .. helper.q(script))
    assert.equal("PONG", out)
    -- the redis store and flush_to take the same options
    local db = assert(tally.open(srv.uri, { password = PW }))
    local name = redis.fresh("auth")
    assert(db:incr(name, 3))
    assert.equal(3, db:value(name))
    db:close()
    local mem = tally.open("memory")
    name = redis.fresh("auth")   -- not the store's counter: its shards share the key layout
    mem:counter(name):incr(4)
    local rf = mem:flush_to(srv.uri, { user = "alice", password = APW, shards = 2 })
    assert(rf:flush_now())
    assert.equal(4, rf:remote_value(name))
    rf:close()
    mem:close()
  end)

  it("takes the password and user from the URI's query, as redis-py and go-redis do", function()
    local r = assert(core.redis(srv.uri .. "?password=" .. PW))
    assert.equal("default", r:command("ACL", "WHOAMI"))
    r:close()
    for _, uri in ipairs({ srv.uri .. "/0?user=alice&password=al%21ce%3Apw%40x",
                           srv.uri .. "?username=alice&db=0&password=al%21ce%3Apw%40x",
                           "redis://alice@" .. hostport() .. "?password=al%21ce%3Apw%40x",
                           "redis+cluster://" .. hostport() .. "/?user=alice&password=al%21ce%3Apw%40x" }) do
      r = assert(core.redis(uri))
      assert.equal("alice", r:command("ACL", "WHOAMI"))
      r:close()
    end
    -- the redis store and flush_to
    local db = assert(tally.open(srv.uri .. "?password=" .. PW))
    local name = redis.fresh("qauth")
    assert(db:incr(name, 3))
    assert.equal(3, db:value(name))
    no_secret(text(tostring(db), db:stats()))
    db:close()
    local mem = tally.open("memory")
    name = redis.fresh("qauth")
    mem:counter(name):incr(4)
    local rf = mem:flush_to("redis+cluster://" .. hostport() .. "?user=alice&password=al%21ce%3Apw%40x",
                            { shards = 2 })
    assert(rf:flush_now())
    assert.equal(4, rf:remote_value(name))
    no_secret(text(tostring(rf), rf:stats()))
    rf:close()
    mem:close()
  end)

  it("never quotes a URI's query: bad URIs, servers down, wrong passwords", function()
    local S = "S3CRETPW"
    local function clean(v)
      v = text(v)
      assert.is_nil(v:find(S, 1, true), "password leaked: " .. v)
      assert.is_nil(v:find("wrong-pw", 1, true), "password leaked: " .. v)
      return v
    end
    local mem = tally.open("memory")
    -- each URI, and the reason its message gives
    for _, case in ipairs({
      { "redis://127.0.0.1:0?password=" .. S, "port must be 1 to 65535" },
      { "redis://127.0.0.1:x?password=" .. S, "bad port" },
      { "redis://127.0.0.1:1/3?password=" .. S, "only database 0 is supported" },
      { "redis://127.0.0.1:1?db=2&password=" .. S, "only database 0 is supported" },
      { "redis://127.0.0.1:1?password=" .. S .. "&passwd=" .. S, "an unknown query parameter" },
      -- a password with an unescaped '&': its rest is no parameter's name
      { "redis://127.0.0.1:1?password=ab&" .. S .. "=1", "an unknown query parameter" },
      { "redis://127.0.0.1:1?password=ab&" .. S .. "=", "an unknown query parameter" },
      { "redis://127.0.0.1:1?" .. S, "a query parameter without '='" },
      { "redis://127.0.0.1:1?password=" .. S .. "%zz", "bad %-escape in the query" },
      { "redis://:" .. S .. "@127.0.0.1:1?password=" .. S, "password given twice" },
      { "redis://127.0.0.1:1?user=a&username=b&password=" .. S, "user given twice" },
      { "redis+cluster://127.0.0.1:1,127.0.0.1:0?password=" .. S, "port must be 1 to 65535" },
      { "redis+cluster://127.0.0.1:1/0?password=" .. S, "bad port" },
    }) do
      local uri, why = case[1], case[2]
      local ok, err = pcall(core.redis, uri)
      assert.is_false(ok)
      assert.matches(why, clean(err), 1, true)
      assert.matches("?***", err, 1, true)
      local db, msg, code = tally.open(uri)
      assert.same({ nil, "EINVAL" }, { db, code })
      assert.matches(why, clean(msg), 1, true)
      ok, err = pcall(mem.flush_to, mem, uri)
      assert.is_false(ok)
      assert.matches(why, clean(err), 1, true)
    end
    -- servers that are down, and one that refuses the password
    for _, uri in ipairs({ "redis://127.0.0.1:1?password=" .. S,
                           "redis+cluster://127.0.0.1:1,127.0.0.1:2?password=" .. S,
                           srv.uri .. "?password=wrong-pw",
                           "redis+cluster://" .. hostport() .. "?user=alice&password=wrong-pw" }) do
      local r, err = core.redis(uri)
      assert.is_nil(r)
      clean(err)
      local db, msg = tally.open(uri)
      assert.is_nil(db)
      clean(msg)
      local rf = mem:flush_to(uri, { every = 0.001, pattern = redis.fresh("down") })
      tally.sleep(0.01)
      clean({ mem:tick(), tostring(rf), rf:stats() })
      rf:close()
    end
    local r, err = core.redis(srv.uri .. "?password=wrong-pw")
    assert.is_nil(r)
    assert.matches("AUTH %(password%) refused: WRONGPASS", err)
    mem:close()
    -- the command
    local out, code = helper.tally("ls", "redis://127.0.0.1:1?password=" .. S)
    assert.equal(1, code)
    clean(out)
    assert.truthy(out:find("redis://127.0.0.1:1?***", 1, true), out)
  end)

  it("refuses a wrong password clearly, without echoing it", function()
    local r, err, code = core.redis("redis://:wrong-pw@" .. hostport())
    assert.is_nil(r)
    assert.equal("EREMOTE", code)
    assert.matches("AUTH %(password%) refused: WRONGPASS", err)
    no_secret(err)
    r, err = core.redis("redis://alice:wrong-pw@" .. hostport())
    assert.is_nil(r)
    assert.matches("AUTH %(user and password%) refused: WRONGPASS", err)
    no_secret(err)
    local db
    db, err = tally.open("redis://:wrong-pw@" .. hostport())
    assert.is_nil(db)
    no_secret(err)
    r, err = core.redis(srv.uri, { password = "wrong-pw" })
    assert.is_nil(r)
    no_secret(err)
  end)

  it("says how to pass a password when none was given", function()
    local r, err = core.redis(srv.uri)
    assert.is_nil(r)
    assert.matches("NOAUTH", err)
    assert.matches("redis://:PASSWORD@host:port", err, 1, true)
    assert.matches("TALLY_REDIS_PASSWORD", err, 1, true)
    assert.matches("password = ...", err, 1, true)
  end)

  it("never shows the password in errors, tostring or stats", function()
    local uri = "redis://alice:" .. PW .. "@" .. hostport()
    assert.equal("redis://***@" .. hostport(), core.uri_redact(uri))
    assert.equal("redis+cluster://***@h:1,h:2", core.uri_redact("redis+cluster://:x@h:1,h:2"))
    assert.equal(srv.uri, core.uri_redact(srv.uri))
    assert.equal(srv.uri .. "/0?***", core.uri_redact(srv.uri .. "/0?user=alice&password=" .. PW))
    -- an '@' after the '?': a password with a '?' or a query value with an '@'
    assert.equal("redis://***?***", core.uri_redact("redis://:" .. PW .. "?x@h:1"))
    -- bad URIs
    for _, bad in ipairs({ "redis://:" .. PW .. "@127.0.0.1:0",
                           "redis://:" .. PW .. "@127.0.0.1:1/3",
                           "redis://:" .. PW .. "@h1:1,h2:2",
                           "redis://:" .. PW .. "%zz@127.0.0.1:1",
                           "redis://:" .. PW .. "@bad host:1" }) do
      local ok, err = pcall(core.redis, bad)
      assert.is_false(ok)
      assert.matches("://***@", err, 1, true)
      no_secret(err)
      local db, msg = tally.open(bad)
      assert.is_nil(db)
      no_secret(msg)
      local mem = tally.open("memory")
      ok, err = pcall(mem.flush_to, mem, bad)
      assert.is_false(ok)
      no_secret(err)
      mem:close()
    end
    -- a server that is down: the message names host and port only
    local down = "redis://:" .. PW .. "@127.0.0.1:1"
    local r, err = core.redis(down)
    assert.is_nil(r)
    no_secret(err)
    -- the store and the flush schedule show the redacted URI
    local db = assert(tally.open("redis://:" .. PW .. "@" .. hostport()))
    no_secret(text(tostring(db), db:stats(), tostring(db:counter(redis.fresh("t")))))
    assert.matches("://***@", tostring(db), 1, true)
    db:close()
    local mem = tally.open("memory")
    mem:counter("x"):incr()
    local rf = mem:flush_to(uri, { every = 0.001 })
    local rf2 = mem:flush_to(down, { every = 0.001, pattern = "y*" })
    tally.sleep(0.01)
    local results = mem:tick()
    no_secret(text(tostring(rf), rf:stats(), tostring(rf2), rf2:stats(), results))
    assert.matches("://***@", tostring(rf), 1, true)
    rf:close()
    rf2:close()
    mem:close()
    -- options never quote a bad value
    local ok
    ok, err = pcall(core.redis, srv.uri, { password = 12345 })
    assert.is_false(ok)
    assert.matches("password must be a string, got number", err, 1, true)
  end)

  it("never echoes a password with '/' in it, nor one in a URI of another scheme", function()
    local secret = "se/cr@t/" .. PW
    local function clean(...)
      for i = 1, select("#", ...) do
        local v = tostring((select(i, ...)))
        assert.is_nil(v:find(secret, 1, true), "password leaked: " .. v)
        assert.is_nil(v:find("se/cr", 1, true), "password leaked: " .. v)
      end
    end
    clean(tally.open("redis://:" .. secret .. "@127.0.0.1:1"))
    clean(pcall(tally.open, "rediss://:" .. secret .. "@127.0.0.1:1"))
    clean(pcall(tally.open, "REDIS://user:" .. secret .. "@127.0.0.1:1"))
    local mem = tally.open("memory")
    clean(pcall(mem.flush_to, mem, "redis://user:" .. secret .. "@127.0.0.1:1", { every = 1 }))
    mem:close()
    local out, code = helper.tally("ls", "redis://:" .. secret .. "@127.0.0.1:1")
    assert.equal(1, code)
    clean(out)
    assert.truthy(out:find("redis://***@127.0.0.1:1", 1, true), out)
  end)
end)
