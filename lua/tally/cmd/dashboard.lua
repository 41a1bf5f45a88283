-- tally.cmd.dashboard: the page `tally serve` answers at / and its script
-- (/dashboard.js). The page polls the JSON API once a second and draws with
-- Chart.js, which the server answers at /chart.js from Debian's
-- libjs-chart.js: nothing is loaded from anywhere else.
--
-- What it shows: the store's health (/api/stats), the top counters by
-- rolled rate, or by value while none has been rolled up (/api/top), with
-- each one's rate over time (from the values the page saw), totals per
-- family (/api/sum over the name prefixes of the top counters, or the
-- patterns in the page's ?totals=a:*,b:*), and the histograms
-- (/api/histograms): the buckets of each and its p50/p90/p99 over time.
-- With ?probe in its URL each canvas gets data-ink, its count of painted
-- pixels after the third refresh, for a headless browser's test to read
-- from the DOM.

local _M = {}

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
<script src="/chart.js"></script>
<script src="/dashboard.js"></script>
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
    rateChart.data.datasets = top.slice(0, LINES).map((e, i) => {
      const s = seen[e.name], pts = [];
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
    const rows = await Promise.all(pats.map((p) => get("/api/sum?pattern=" + encodeURIComponent(p))));
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
      const st = await get("/api/stats");
      $("store").textContent = st.store;
      cards(st);
      // histograms' member counters (NAME{le=..}) have their own charts
      const plain = (t) => t.top.filter((e) => !/\{.*\}$/.test(e.name)).slice(0, TOP);
      let top = plain(await get("/api/top?by=rate&n=" + 5 * TOP));
      if (!top.some((e) => e.rate != null)) top = plain(await get("/api/top?by=value&n=" + 5 * TOP));
      topTable(top, now);
      await totals(top);
      histograms((await get("/api/histograms")).histograms, now);
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

return _M
