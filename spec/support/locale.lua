-- spec/support/locale.lua: tally's machine-read text under a locale whose
-- decimal point is a comma (de_DE.UTF-8), for Lua 5.4
-- (spec/integration/locale_spec.lua) and LuaJIT
-- (spec/luajit/locale_ljspec.lua). A host may call setlocale(LC_NUMERIC,
-- "") (nginx modules, readline hosts) or os.setlocale: printf then writes
-- 0,1, and so do Lua 5.4's string.format and tostring. Every float tally
-- writes for a machine (the JSON lines sink, the webhook, the status page,
-- line protocol, Prometheus text, histogram member names) must be the
-- same whatever the locale, and what it wrote must read back. Lua 5.1
-- syntax.
--
-- run(helper, bt): helper gives tmpfile; bt the spec's describe, it,
-- setup, teardown, pending and assert (busted gives them to the
-- spec file, not to modules it requires).
local path, cpath = package.path, package.cpath
local peers = require "spec.support.peers"   -- its helper puts the Lua 5.4 tree
package.path, package.cpath = path, cpath     -- first: LuaJIT keeps its own
local tally = require "tally"
local json = require "tally.json"

local LOCALE = "de_DE.UTF-8"
local WIDE = "ps_AF.UTF-8"   -- its decimal point is U+066B, two bytes
local T0 = 1763769600

local function sh(cmd)
  local ok = os.execute(cmd .. " >/dev/null 2>&1")
  return ok == true or ok == 0
end

-- nil if the locale (LOCALE by default) can be had (made with localedef
-- when missing, as root), else why not.
local function missing(locale)
  locale = locale or LOCALE
  local def = "localedef -i " .. locale:match("^[^.]+") .. " -f UTF-8 " .. locale
  if not os.setlocale(locale, "numeric") then
    if sh("command -v localedef") and sh("test \"$(id -u)\" = 0") then sh(def) end
    if not os.setlocale(locale, "numeric") then
      return "the locale " .. locale .. " is missing and cannot be made here (install Debian's "
        .. "locales package and run, as root: " .. def .. ")"
    end
  end
  os.setlocale("C", "numeric")
  return nil
end

return function(helper, bt)
  local describe, it, setup, teardown, pending, assert =
    bt.describe, bt.it, bt.setup, bt.teardown, bt.pending, bt.assert

  -- lua-cjson's cjson.new() aborts the process under a locale whose
  -- decimal point is not one byte ("wide characters found or printf()
  -- bug"): a child process tries it.
  describe("under a locale whose decimal point is two bytes", function()
    local wide = missing(WIDE)
    if wide then pending(wide) return end
    it("json.decode reads floats after the host switched to it, and does not abort", function()
      local script = helper.tmpfile("wide.lua")
      local f = assert(io.open(script, "w"))
      f:write(([[
        package.path, package.cpath = %q, %q
        local json = require "tally.json"
        assert(json.decode('{"a":0.5}').a == 0.5)
        assert(os.setlocale(%q, "numeric"))
        local v = assert(json.decode('{"a":0.25,"b":[1.5e-3]}'))
        assert(v.a == 0.25 and v.b[1] == 1.5e-3, "misread")
        assert(os.setlocale(nil, "numeric") == %q, "the locale changed")
        io.write("read")
      ]]):format(package.path, package.cpath, WIDE, WIDE))
      f:close()
      local lua = _VERSION == "Lua 5.4" and "lua5.4" or "luajit"
      local out, code = helper.sh(lua .. " " .. helper.q(script))
      assert.equal("read", out)
      assert.equal(0, code)
    end)
  end)

  local why = missing()
  if why then
    describe("under a locale with a decimal comma", function() pending(why) end)
    return
  end

  -- fn() run with LOCALE's LC_NUMERIC; the C locale again afterwards
  local function comma(fn)
    assert(os.setlocale(LOCALE, "numeric"))
    local ok, err = pcall(fn)
    os.setlocale("C", "numeric")
    if not ok then error(err, 0) end
  end

  -- fn(db) with a new memory store, closed afterwards
  local function with_db(fn)
    local db = assert(tally.open())
    local ok, err = pcall(fn, db)
    db:close()
    if not ok then error(err, 0) end
  end

  -- text is JSON that lua-cjson reads in the C locale, as any reader would
  -- (cjson.new() takes the decimal point of the locale now)
  local function decoded(text)
    local ok, v = pcall(require("cjson").new().decode, text)
    assert(ok, "not JSON: " .. tostring(text) .. " (" .. tostring(v) .. ")")
    return v
  end

  describe("under a locale with a decimal comma", function()
    it("is such a locale: printf (Lua 5.4's string.format) writes 0,5 there", function()
      comma(function()
        if _VERSION == "Lua 5.4" then assert.equal("0,5", string.format("%.1f", 0.5)) end
      end)
    end)

    it("a JSON lines file sink writes rates and times with a point", function()
      local file = helper.tmpfile("comma.jsonl")
      with_db(function(db)
        comma(function()
          db:rollup("l:*", { every = 10, sinks = { tally.sink.file(file) } })
          db:incr("l:a", 1)
          db:tick(T0 + 0.25)
          db:incr("l:a", 1)
          db:tick(T0 + 10.25)
        end)
        local lines = {}
        for line in io.lines(file) do lines[#lines + 1] = line end
        assert.equal(2, #lines)
        assert.truthy(lines[2]:find('"at":1763769610.250,', 1, true), lines[2])
        assert.truthy(lines[2]:find('"rate":0.1}', 1, true), lines[2])
        local r = decoded(lines[2])
        assert.equal(0.1, r.rate)
        assert.equal(T0 + 10.25, r.at)
      end)
    end)

    it("the encoders write floats with a point: JSON, line protocol, Prometheus text", function()
      local out = {}
      comma(function()
        local f = tally.format
        local r = { name = "f:a", value = 7, at = T0 + 0.5, delta = 1, rate = 0.125 }
        out.json, out.array = f.json(r), f.json_array({ r })
        out.influx = f.influx({ r })
        out.prom = f.prometheus({ { name = "f_a", value = 0.5 } })
        out.encode = json.encode({ x = 0.1, y = { 1.5, -2.25e-7 } })
        out.number = f.json_number(1 / 3)
      end)
      assert.equal('{"name":"f:a","value":7,"at":1763769600.500,"delta":1,"rate":0.125}', out.json)
      assert.equal(0.125, decoded(out.array)[1].rate)
      assert.truthy(out.influx:find("rate=0.125", 1, true), out.influx)
      assert.truthy(out.prom:find(" 0.5\n", 1, true), out.prom)
      assert.equal('{"x":0.1,"y":[1.5,-2.25e-07]}', out.encode)
      assert.equal("0.3333333333333333", out.number)
    end)

    it("a histogram's member names and exposition do not depend on it", function()
      with_db(function(db)
        local names, text
        comma(function()
          local h = db:histogram("lat", { buckets = { 0.005, 0.5 }, unit = 0.001 })
          h:observe(0.25)
          names = h:names()
          text = assert(tally.prometheus(db))
        end)
        assert.same({ "lat{le=0.005}", "lat{le=0.5}", "lat{le=+Inf}", "lat{sum,unit=0.001}" }, names)
        assert.truthy(text:find('lat_bucket{le="0.5"} 1\n', 1, true), text)
        assert.truthy(text:find("lat_sum 0.25\n", 1, true), text)
        assert.truthy(db:histogram("lat", { buckets = { 0.005, 0.5 }, unit = 0.001 }))  -- the same one
      end)
    end)

    it("an export imports again, and a JSON float reads back, whatever the locale", function()
      with_db(function(db)
        db:incr("e:a", 5)
        local doc = db:export()
        assert.equal(0.25, assert(json.decode('{"a":0.25}')).a)          -- lua-cjson made in C
        comma(function()
          assert.equal(doc, db:export())
          assert(db:import(doc, { mode = "add" }))
          assert.equal(0.25, assert(json.decode('{"a":0.25}')).a)
        end)
        assert.equal(0.25, assert(json.decode('{"a":0.25}')).a)          -- and back in C
        assert.equal(10, db:value("e:a"))
      end)
    end)

    it("the openresty status page is JSON", function()
      local clock = 1000
      local said, status = {}, nil
      local stub = {
        ERR = 4, WARN = 5, NOTICE = 6, INFO = 7, header = {},
        get_phase = function() return "init_worker" end,
        now = function() return clock end, update_time = function() end,
        worker = { pid = function() return 424242 end, id = function() return 0 end,
                   exiting = function() return false end },
        log = function() end, timer = { every = function() return true end },
        say = function(...) said[#said + 1] = table.concat({ ... }) end,
        exit = function(code) status = code end,
      }
      local old_mod, old_ngx = package.loaded["tally.openresty"], rawget(_G, "ngx")
      local core = require "tally.core"
      local old_logger, old_mark = tally.logger(), core._process_mark()
      _G.ngx, package.loaded["tally.openresty"] = stub, nil
      local fresh = require "tally.openresty"
      local ok, err = pcall(comma, function()
        local db = assert(fresh.init_worker({ store = "file:" .. helper.tmpfile("status.tally"),
                                              tick = 0.25 }))
        db:rollup("s:*", { every = 0.5, sinks = { tally.sink.fn(function() end) } })
        fresh.status()
      end)
      if fresh.db() then fresh.db():close() end
      core._process_mark(old_mark)
      tally.logger(old_logger)
      _G.ngx, package.loaded["tally.openresty"] = old_ngx, old_mod
      assert(ok, err)
      assert.equal(200, status)
      local s = decoded(said[1])
      assert.equal(0.25, s.tick)
      assert.equal(0.5, s.schedules[1].every)
      assert.truthy(said[1]:find('"every":0.5', 1, true), said[1])
    end)

    describe("a webhook", function()
      local hook
      setup(function() hook = peers.start_http_sink {} end)
      teardown(function() if hook then hook.stop() end end)

      it("gets JSON with a point in its rates and times", function()
        with_db(function(db)
          comma(function()
            local s = tally.sink.http { url = hook.url .. "/hook", format = "json", timeout = 5 }
            db:rollup("w:*", { every = 4, sinks = { s } })
            db:incr("w:a", 1)
            db:tick(T0)
            db:incr("w:a", 1)
            db:tick(T0 + 4)
            assert.is_true(db:flush(5))
          end)
          local reqs = hook.requests()
          assert.equal(2, #reqs)
          local body = reqs[2].body
          assert.truthy(body:find('"rate":0.25', 1, true), body)
          local r = decoded(body)[1]
          assert.same({ name = "w:a", value = 2, at = T0 + 4, delta = 1, rate = 0.25 }, r)
        end)
      end)
    end)
  end)
end
