-- tally.openresty.dashboard(): the page and JSON API of tally.dashboard
-- inside nginx (examples/openresty/nginx.conf, location /tally/dashboard/),
-- read through the worker's own store handle.
local helper = require "spec.support.helper"
local nginx = require "spec.support.nginx"
local tally = require "tally"
local json = require "tally.json"

local q = helper.q

describe("tally.openresty.dashboard()", function()
  local srv
  after_each(function()
    if srv then srv.stop() end
    srv = nil
  end)

  it("serves the dashboard and answers its API as db:values and db:top", function()
    srv = nginx.start { conf = nginx.example { every = 1 } }
    local r = nginx.burst(srv.url .. "/page/[1-5]?r=[1-20]", { parallel = 4 }).wait()
    assert.equals(100, r.codes[200])
    local base = srv.url .. "/tally/dashboard/"
    local status, body, h = nginx.get(base)
    assert.equals(200, status, body)
    assert.equals("text/html; charset=utf-8", h["content-type"])
    assert.truthy(body:find('<script src="dashboard.js"></script>', 1, true))
    assert.equals(200, (nginx.get(base .. "dashboard.js")))
    assert.equals(200, (nginx.get(base .. "chart.js")))
    local db = assert(tally.open("file:" .. srv.dir .. "/data/tally.tly", { create = false }))
    status, body = nginx.get(base .. "api/values?pattern=http:*")
    assert.equals(200, status, body)
    local values = db:values("http:*")
    assert.same(values, json.decode(body).values)
    for i = 1, 5 do assert.equals(20, values["http:/page/" .. i]) end
    status, body = nginx.get(base .. "api/top?n=3&pattern=http:*")
    assert.equals(200, status, body)
    assert.same(db:top("http:*", 3), json.decode(body).top)
    status, body = nginx.get(base .. "api/counter?name=http:/page/2")
    assert.equals(200, status, body)
    assert.equals(20, json.decode(body).value)
    status, body = nginx.get(base .. "api/top?n=0")
    assert.equals(400, status)
    assert.equals("n must be an integer from 1 to 1000, got '0'\n", body)
    status, body = nginx.get(base .. "api/top?n=1&n=2")
    assert.equals(400, status)
    assert.equals("n must be given once, as text\n", body)
    status, body = nginx.get(base .. "api/counter?name=http:/page/2%00x")
    assert.equals(400, status, body)
    assert.equals("name must not contain a NUL byte\n", body)
    -- on one connection (one worker's kept answers): the answer kept for
    -- a pattern with "&zzz=1" in it is not the answer to a query with zzz
    local out = helper.sh(("env -u LD_PRELOAD curl -s -w '%%{http_code}\\n' -o /dev/null %s -o /dev/null %s")
                          :format(q(base .. "api/values?pattern=x%26zzz%3D1"),
                                  q(base .. "api/values?pattern=x&zzz=1")))
    assert.equals("200\n400\n", out)
    -- nor is the answer kept for pattern "true" that to a bare "pattern"
    -- (nginx: the value true), which is refused
    out = helper.sh(("env -u LD_PRELOAD curl -s -w '%%{http_code}\\n' -o /dev/null %s -o /dev/null %s")
                    :format(q(base .. "api/values?pattern=true"), q(base .. "api/values?pattern")))
    assert.equals("200\n400\n", out)
    status, body = nginx.get(base .. "api/nope")
    assert.equals(404, status, body)
    status, body = nginx.get(base .. "api/counter?name=http:/nope")
    assert.equals(404, status)
    assert.equals("no such counter 'http:/nope'\n", body)
    assert.is_nil(db:value("http:/nope"))
    db:close()
    assert.same({}, srv.errors())
  end)

  it("shows the top counter in headless Chromium", function()
    if not helper.on_path("chromium") then
      pending("chromium not found: install Debian's chromium (scripts/setup installs it)")
      return
    end
    srv = nginx.start { conf = nginx.example { every = 1 } }
    local r = nginx.burst(srv.url .. "/page/7?r=[1-30]", { parallel = 4 }).wait()
    assert.equals(30, r.codes[200])
    local dir = helper.tmpfile("chromium")
    os.execute("mkdir -p " .. q(dir))
    helper.sh(("{ cd %s && HOME=%s timeout -s KILL 60 env -u LD_PRELOAD chromium --headless "
      .. "--no-sandbox --disable-gpu --user-data-dir=%s --enable-logging=stderr --v=0 "
      .. "--virtual-time-budget=4000 --dump-dom %s >%s 2>%s; }"):format(q(dir), q(dir),
      q(dir .. "/profile"), q(srv.url .. "/tally/dashboard/?probe"), q(dir .. "/dom"), q(dir .. "/stderr")))
    local dom, log = helper.slurp(dir .. "/dom") or "", helper.slurp(dir .. "/stderr") or ""
    os.execute("rm -rf " .. q(dir))
    assert.truthy(dom:find('<tr data-name="http:/page/7"><td class="name">http:/page/7</td>'
                           .. '<td class="value">30</td>', 1, true), dom:sub(1, 3000))
    assert.is_nil(log:find(":CONSOLE", 1, true), log)
    assert.is_nil(dom:find('id="status" class="err"', 1, true))
  end)
end)
