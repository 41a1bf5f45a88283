-- tally.dashboard: the live dashboard of a store and the JSON API it
-- polls, for any HTTP host: `tally serve` (lua/tally/cmd/serve.lua) and
-- nginx through tally.openresty.dashboard(). Runs under Lua 5.4 and LuaJIT.
--
--   dashboard.html, dashboard.js   the page and its script
--   dashboard.api(db, name, query [, opts]) -> status, value or message
--       the answer of /api/NAME: 200 and a table for tally.json.encode,
--       or 400, 404 or 503 and a message (503: the store's own, for a
--       store that cannot be read). query: { param = value }.
--       opts.schedules(db) -> list or nil, msg: the rollup schedules the
--       store keeps (tally serve passes tally.peek's; without it /api/stats
--       and /api/rollups name none); opts.store: the store as shown.
--
-- The page uses relative URLs (api/stats, chart.js, dashboard.js), so it
-- works at / (tally serve) and under a location such as /tally/ (nginx),
-- and loads nothing from anywhere else: Chart.js comes from Debian's
-- libjs-chart.js through the same server (CHARTJS is its path).
--
-- What the page shows: the store's health (/api/stats), the top counters
-- by rolled rate, or by value while none has been rolled up (/api/top),
-- with each one's rate over time (from its finest rollup history, else
-- from the values the page saw), totals
-- per family (/api/sum over the name prefixes of the top counters, or the
-- patterns in the page's ?totals=a:*,b:*), and the histograms
-- (/api/histograms): the buckets of each and its p50/p90/p99 over time.
-- With ?probe in its URL each canvas gets data-ink, its count of painted
-- pixels after the third refresh, for a headless browser's test to read
-- from the DOM.

local tally = require "tally"
local json = require "tally.json"
local printable = require("tally.util").printable

local type, tostring, tonumber, ipairs, pairs, error, getmetatable, setmetatable, pcall =
      type, tostring, tonumber, ipairs, pairs, error, getmetatable, setmetatable, pcall
local fmt, concat, sort = string.format, table.concat, table.sort
local floor, max, huge = math.floor, math.max, math.huge

local _M = {}

_M.CHARTJS = "/usr/share/javascript/chart.js/chart.min.js"   -- Debian's libjs-chart.js
local MAX_TOP = 1000            -- most counters /api/top answers

_M.html = [[<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>tally</title>
<link rel="icon" href="data:,">
<style>
body { font: 14px system-ui, sans-serif; margin: 1em 2em; color: #222; }
h1 { font-size: 1.3em; margin: 0 0 .3em; } h2 { font-size: 1.1em; margin: 1.2em 0 .4em; }
#status { color: #666; } #status.err { color: #b00; font-weight: bold; }
.cards { display: flex; flex-wrap: wrap; gap: .6em; }
.card { border: 1px solid #ddd; border-radius: 4px; padding: .4em .8em; min-width: 8em; }
.card b { display: block; font-size: 1.2em; }
table { border-collapse: collapse; } td, th { padding: .15em .8em; text-align: right; }
td.name, th.name { text-align: left; font-family: monospace; }
.charts { display: flex; flex-wrap: wrap; gap: 1em; }
.chart { width: 520px; height: 260px; position: relative; }
</style>
</head>
<body>
<h1>tally <span id="store"></span></h1>
<div id="status">loading...</div>
<h2>Health</h2>
<div class="cards" id="health"></div>
<h2>Top counters</h2>
<div class="charts">
<table id="top"><thead><tr><th class="name">name</th><th>value</th><th>rate/s</th></tr></thead>
<tbody></tbody></table>
<div class="chart"><canvas id="ratechart"></canvas></div>
</div>
<h2>Totals</h2>
<table id="totals"><thead><tr><th class="name">pattern</th><th>sum</th><th>counters</th></tr></thead>
<tbody></tbody></table>
<h2>Histograms</h2>
<div id="histograms" class="charts"></div>
<script src="chart.js"></script>
<script src="dashboard.js"></script>
</body>
</html>
]]

_M.js = [==[
"use strict";
(function () {
  const KEEP = 120, TOP = 10, LINES = 5, HISTS = 4;
  const params = new URLSearchParams(location.search);
  const fixedTotals = (params.get("totals") || "").split(",").filter(Boolean);
  const seen = {};          // counter name -> [{t, v}] the values seen
  const quant = {};         // histogram name -> [{t, p50, p90, p99}]
  const hcharts = {};       // histogram name -> { buckets, quantiles }
  let refreshed = 0;
  const colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"];
  const $ = (id) => document.getElementById(id);
  const text = (s) => document.createTextNode(String(s));
  Chart.defaults.animation = false;

  const rateChart = new Chart($("ratechart"), {
    type: "line", data: { labels: [], datasets: [] },
    options: { responsive: true, maintainAspectRatio: false, parsing: false,
      scales: { x: { type: "linear", title: { display: true, text: "seconds ago" } },
                y: { beginAtZero: true, title: { display: true, text: "rate/s" } } },
      plugins: { title: { display: true, text: "rate of the top counters" } } } });

  let age = 0;              // the oldest answer's Age this refresh
  async function get(path) {
    const r = await fetch(path, { cache: "no-store" });
    if (!r.ok) throw new Error(path + ": " + r.status + " " + (await r.text()).trim());
    age = Math.max(age, +(r.headers.get("Age") || 0));
    return r.json();
  }

  function bytes(n) {
    const u = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : n) + " " + u[i];
  }

  function cards(st) {
    const s = st.stats, box = $("health");
    const items = [["counters", s.counters], ["file size", bytes(s.file_bytes)],
      ["used", bytes(s.used_bytes)], ["live", bytes(s.live_bytes)],
      ["retired", bytes(s.retired_bytes)], ["reusable", bytes(s.reusable_bytes)],
      ["reused", bytes(s.reused_bytes)], ["expired", s.expired], ["capped", s.capped],
      ["processes", st.processes], ["holding reuse", st.behind], ["writers", s.writers],
      ["rollups", st.rollups.length]];
    box.replaceChildren(...items.map(([k, v]) => {
      const d = document.createElement("div");
      d.className = "card";
      d.dataset.key = k;
      const b = document.createElement("b");
      b.appendChild(text(v));
      d.append(b, text(k));
      return d;
    }));
  }

  function rateOf(name) {
    const s = seen[name];
    if (!s || s.length < 2) return null;
    const a = s[s.length - 2], b = s[s.length - 1];
    return b.t > a.t ? (b.v - a.v) / (b.t - a.t) : null;
  }

  function topTable(top, now) {
    for (const e of top) {
      const s = seen[e.name] || (seen[e.name] = []);
      s.push({ t: now, v: e.value });
      if (s.length > KEEP) s.shift();
    }
    const body = $("top").tBodies[0];
    body.replaceChildren(...top.map((e) => {
      const tr = document.createElement("tr");
      tr.dataset.name = e.name;
      const r = e.rate != null ? e.rate : rateOf(e.name);
      for (const [cls, v] of [["name", e.name], ["value", e.value],
                              ["rate", r == null ? "-" : (+r.toFixed(2))]]) {
        const td = document.createElement("td");
        td.className = cls;
        td.appendChild(text(v));
        tr.appendChild(td);
      }
      return tr;
    }));
    // each line: the rate between the buckets of the counter's finest
    // rollup history, else between the values this page has seen
    rateChart.data.datasets = top.slice(0, LINES).map((e, i) => {
      const ring = e.history && e.history.points.length >= 2 ? e.history.points : null;
      const s = ring || seen[e.name], pts = [];
      for (let k = 1; k < s.length; k++) {
        const dt = s[k].t - s[k - 1].t;
        if (dt > 0) pts.push({ x: +(s[k].t - now).toFixed(1), y: (s[k].v - s[k - 1].v) / dt });
      }
      return { label: e.name, data: pts, borderColor: colors[i], backgroundColor: colors[i],
               pointRadius: 0, borderWidth: 2 };
    });
    rateChart.update();
  }

  async function totals(top) {
    let pats = fixedTotals;
    if (!pats.length) {
      const set = new Set();
      for (const e of top) {
        const i = e.name.indexOf(":");
        if (i > 0) set.add(e.name.slice(0, i + 1) + "*");
      }
      pats = [...set].slice(0, 8);
    }
    const rows = await Promise.all(pats.map((p) => get("api/sum?pattern=" + encodeURIComponent(p))));
    $("totals").tBodies[0].replaceChildren(...rows.map((r) => {
      const tr = document.createElement("tr");
      for (const [cls, v] of [["name", r.pattern], ["sum", r.sum], ["count", r.count]]) {
        const td = document.createElement("td");
        td.className = cls;
        td.appendChild(text(v));
        tr.appendChild(td);
      }
      return tr;
    }));
  }

  function histograms(list, now) {
    const box = $("histograms");
    for (const h of list.slice(0, HISTS)) {
      let c = hcharts[h.name];
      if (!c) {
        const wrap = (id) => {
          const d = document.createElement("div");
          d.className = "chart";
          const cv = document.createElement("canvas");
          d.appendChild(cv);
          box.appendChild(d);
          return cv;
        };
        c = hcharts[h.name] = {
          buckets: new Chart(wrap(), { type: "bar", data: { labels: [], datasets: [
            { label: h.name + " (count per bucket)", data: [], backgroundColor: "#1f77b4" }] },
            options: { responsive: true, maintainAspectRatio: false } }),
          quantiles: new Chart(wrap(), { type: "line", data: { datasets: [] },
            options: { responsive: true, maintainAspectRatio: false, parsing: false,
              scales: { x: { type: "linear", title: { display: true, text: "seconds ago" } } },
              plugins: { title: { display: true, text: h.name + " p50 / p90 / p99 (bucket bound)" } } } }),
        };
      }
      let prev = 0;
      c.buckets.data.labels = h.buckets.map((b) => "<= " + b.le);
      c.buckets.data.datasets[0].data = h.buckets.map((b) => { const n = b.count - prev; prev = b.count; return n; });
      c.buckets.update();
      const q = quant[h.name] || (quant[h.name] = []);
      const num = (v) => (v === "+Inf" || v == null ? null : v);
      q.push({ t: now, p50: num(h.p50), p90: num(h.p90), p99: num(h.p99) });
      if (q.length > KEEP) q.shift();
      c.quantiles.data.datasets = ["p50", "p90", "p99"].map((k, i) => ({
        label: k, borderColor: colors[i], backgroundColor: colors[i], pointRadius: 0,
        data: q.filter((p) => p[k] != null).map((p) => ({ x: +(p.t - now).toFixed(1), y: p[k] })) }));
      c.quantiles.update();
    }
  }

  // ?probe (for tests): each canvas's count of painted pixels in data-ink
  function ink() {
    for (const cv of document.querySelectorAll("canvas")) {
      const px = cv.getContext("2d").getImageData(0, 0, cv.width, cv.height).data;
      let n = 0;
      for (let i = 3; i < px.length; i += 4) if (px[i] !== 0) n++;
      cv.dataset.ink = n;
    }
  }

  async function refresh() {
    const now = Date.now() / 1000;
    age = 0;
    try {
      const st = await get("api/stats");
      $("store").textContent = st.store;
      cards(st);
      // histograms' member counters (NAME{le=..}) have their own charts
      const plain = (t) => t.top.filter((e) => !/\{.*\}$/.test(e.name)).slice(0, TOP);
      let top = plain(await get("api/top?by=rate&history=" + KEEP + "&n=" + 5 * TOP));
      if (!top.some((e) => e.rate != null)) top = plain(await get("api/top?by=value&n=" + 5 * TOP));
      topTable(top, now);
      await totals(top);
      histograms((await get("api/histograms")).histograms, now);
      if (params.has("probe") && ++refreshed === 3) ink();   // once: one readback each
      $("status").className = "";
      $("status").textContent = "updated " + new Date().toLocaleTimeString() +
        (age > 1 ? " (the server gave answers up to " + age + " s old: a large store is read less often)" : "");
    } catch (e) {
      $("status").className = "err";
      $("status").textContent = String(e.message || e);
    }
    setTimeout(refresh, 1000);
  }
  refresh();
})();
]==]

-- ---- the JSON API ------------------------------------------------------------------

local Bad = {}   -- raised by the checks below: { status=, msg= }
local function bad(status, msg) error(setmetatable({ status = status, msg = msg }, Bad), 0) end

-- The query's parameters, checked against the names an endpoint takes.
local function params(name, query, allowed)
  for k in pairs(query) do
    if not allowed[k] then
      local names = {}
      for n in pairs(allowed) do names[#names + 1] = n end
      sort(names)
      bad(400, fmt("unknown query parameter '%s' (/api/%s takes %s)", printable(tostring(k)), name,
                   #names > 0 and concat(names, ", ") or "none"))
    end
  end
  return query
end

local function str_param(q, k)
  local v = q[k]
  if v ~= nil and type(v) ~= "string" then bad(400, printable(k) .. " must be given once, as text") end
  return v
end

local function int_param(q, k, lo, hi, default)
  local v = str_param(q, k)
  if v == nil then return default end
  local n = v:find("^%d+$") and tonumber(v)
  if not n or n ~= floor(n) or n < lo or n > hi then
    bad(400, fmt("%s must be an integer from %d to %d, got '%s'", k, lo, hi, printable(v)))
  end
  return n
end

local function pattern_param(q)
  local p = str_param(q, "pattern")
  if p == "" then return nil end
  return p
end

-- A store failure: 503 with the store's own message.
local function must(v, msg, ...)
  if v == nil then bad(503, tostring(msg)) end
  return v, msg, ...
end

local function array(t) return #t > 0 and t or json.empty_array end

-- The counter name's handle, never creating it (nil: no such counter), to
-- f(c); closed at once: a server holding no handle never holds the
-- store's reuse back.
local function with_counter(db, name, f)
  local c, msg, code = db:counter(name, { create = false })
  if not c then
    if code == "ENOENT" then return nil end
    bad(503, tostring(msg))
  end
  local ok, res = pcall(f, c)
  c:close()
  if not ok then error(res, 0) end
  return res
end

local UNIT = { s = 1, m = 60, h = 3600, d = 86400, w = 604800 }

-- The last n points of c's finest history ring: { res =, points = }, or
-- nil for a counter that keeps none.
local function finest_history(c, n)
  local best, best_s
  for _, k in ipairs(c:keeps() or {}) do
    local width, unit = k:match("x(%d+)(%a)$")
    local secs = width and UNIT[unit] and tonumber(width) * UNIT[unit]
    if secs and (not best_s or secs < best_s) then best, best_s = k:match("x(.*)$"), secs end
  end
  local ring = best and c:history(best)
  if not ring then return nil end
  local pts = {}
  for i = max(1, #ring - n + 1), #ring do pts[#pts + 1] = ring[i] end
  return { res = best, points = array(pts) }
end

local api = {}

function api.stats(db, q, opts)
  params("stats", q, {})
  local st = must(db:stats())
  local grace = must(db:grace())
  local schedules = opts.schedules and must(opts.schedules(db)) or {}
  return {
    store = opts.store, now = tally.now(), stats = st,
    -- the server has the store open too (idle: it holds nothing back)
    processes = grace.processes > 0 and grace.processes - 1 or 0, behind = grace.behind,
    oldest_pid = grace.oldest_pid ~= 0 and grace.oldest_pid or nil,
    rollups = array(schedules),
  }
end

function api.values(db, q)
  params("values", q, { pattern = true })
  return { values = must(db:values(pattern_param(q))) }
end

function api.top(db, q)
  params("top", q, { pattern = true, n = true, by = true, history = true })
  local n = int_param(q, "n", 1, MAX_TOP, 10)
  local by = str_param(q, "by") or "value"
  if by ~= "value" and by ~= "rate" then bad(400, "by must be value or rate, got '" .. printable(by) .. "'") end
  local hist = int_param(q, "history", 0, 1000, 0)
  local top = must(db:top(pattern_param(q) or "*", n, by))
  if hist > 0 then
    for _, e in ipairs(top) do
      e.history = with_counter(db, e.name, function(c) return finest_history(c, hist) end)
    end
  end
  return { by = by, top = array(top) }
end

function api.sum(db, q)
  params("sum", q, { pattern = true })
  local sum, count = db:sum(pattern_param(q))
  must(sum, count)
  return { pattern = str_param(q, "pattern") or "*", sum = sum, count = count }
end

function api.counter(db, q)
  params("counter", q, { name = true })
  local name = str_param(q, "name")
  if name == nil or name == "" then bad(400, "name is needed: api/counter?name=NAME") end
  -- no counter has such a name (db:counter would raise on it)
  if #name > tally.NAME_MAX then
    bad(400, fmt("name must be 1 to %d bytes, got %d", tally.NAME_MAX, #name))
  end
  if name:find("\0", 1, true) then bad(400, "name must not contain a NUL byte") end
  local out = with_counter(db, name, function(c)
    local info = c:info()
    local o = { name = name, value = c:value(), shards = c:shards(), policy = info.policy,
                rolled = c:rolled(), auto = info.auto, grown = info.grown, shrunk = info.shrunk }
    local keeps = c:keeps()
    if keeps then       -- every history ring, as c:history gives it
      o.keeps, o.history = keeps, {}
      for _, k in ipairs(keeps) do
        local res = k:match("x(.*)$")
        o.history[res] = array(c:history(res) or {})
      end
    end
    return o
  end)
  if not out then bad(404, fmt("no such counter '%s'", printable(name))) end
  return out
end

-- Histograms whose names match pattern, each from one snapshot of its
-- members: the names with a brace (one walk), then, if there are
-- histograms, one snapshot of them (a second).
function api.histograms(db, q)
  params("histograms", q, { pattern = true })
  local groups = tally.histogram.group(must(db:names("*}")))
  local pattern = pattern_param(q)
  local glob = require "tally.prometheus"
  local g = pattern and glob._glob_compile(pattern)
  local bases = {}
  for base in pairs(groups) do
    if not g or glob._glob_captures(g, base) then bases[#bases + 1] = base end
  end
  sort(bases)
  local out = {}
  if #bases > 0 then
    local snap = must(db:snapshot("*{*}"))
    for _, base in ipairs(bases) do
      local h = groups[base]
      local r = tally.histogram.read(snap, h)
      if r then
        local buckets = {}
        for i, b in ipairs(r.buckets) do buckets[i] = { le = h.les[i][2], count = b.count } end
        local function qt(x)
          local v = tally.histogram.quantile(r, x)
          if v == huge then return "+Inf" end
          return v
        end
        out[#out + 1] = { name = base, count = r.count, sum = r.sum, unit = r.unit,
                          buckets = buckets, p50 = qt(0.5), p90 = qt(0.9), p99 = qt(0.99) }
      end
    end
  end
  return { histograms = array(out) }
end

function api.rollups(db, q, opts)
  params("rollups", q, {})
  return { rollups = array(opts.schedules and must(opts.schedules(db)) or {}) }
end

_M.ENDPOINTS = { "stats", "top", "values", "sum", "counter", "histograms", "rollups" }

-- answer_key(what, query) -> the key an answer to what?query is kept
-- under (tally serve, tally.openresty): each parameter and value with its
-- length, so that no value can read as other parameters ("x&y=1" as a
-- pattern is not "x" and y = "1"). A value that is not text (nginx gives
-- true for a bare key, a table for a key given twice) is "-" and what
-- tostring makes of it, so "?pattern" is not "?pattern=true".
function _M.answer_key(what, query)
  local keys = {}
  for k, v in pairs(query) do
    k = tostring(k)
    v = type(v) == "string" and fmt("%d:%s", #v, v) or "-" .. tostring(v)
    keys[#keys + 1] = fmt("%d:%s%s", #k, k, v)
  end
  sort(keys)
  return what .. "?" .. concat(keys, "&")
end

function _M.api(db, name, query, opts)
  local f = api[name]
  if not f then
    return 404, "no such path: api/" .. tostring(name) .. " (the API: api/"
                .. concat(_M.ENDPOINTS, ", api/") .. ")"
  end
  local ok, res = pcall(f, db, query or {}, opts or {})
  if ok then return 200, res end
  if getmetatable(res) == Bad then return res.status, res.msg end
  error(res, 0)
end

return _M
