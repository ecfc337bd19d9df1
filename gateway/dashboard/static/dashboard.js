// hedge-gateway dashboard: polls the gateway's own JSON once a second and draws SVG.
// No library, no request to any other origin (the page's CSP forbids it anyway).
"use strict";

(function () {
  const SVG = "http://www.w3.org/2000/svg";
  const KEEP = 600;               // points kept per pool: 10 minutes at one a second
  // Under `serve --workers N` any worker may answer, one a point or two behind the others:
  // only a `seq` further back than this means the gateway restarted.
  const LAG = 5;
  const PALETTE = ["#3b6fd8", "#e07b1f", "#2f9e57", "#8a5cc7", "#c2417a", "#1f9bb0"];
  const SUPPRESS_COLORS = {
    budget: "#d23c3c", max_attempts: "#8a5cc7", no_backend: "#6b7280",
    deadline: "#c98a0b", ineffective: "#c2417a", disabled: "#9ca3af", cold: "#3b9fc2",
  };
  const state = { seq: 0, points: {}, stats: null, races: [], updates: 0 };

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function svgEl(tag, attrs) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    return node;
  }

  function fmt(v, digits) {
    if (v === null || v === undefined || Number.isNaN(v)) return "–";
    if (Math.abs(v) >= 1e6) return (v / 1e6).toFixed(1) + "M";
    if (Math.abs(v) >= 1e4) return (v / 1e3).toFixed(1) + "k";
    return Number(v).toFixed(digits === undefined ? 0 : digits);
  }

  // A "nice" upper bound for an axis: 1, 2 or 5 times a power of ten.
  function niceMax(v) {
    if (!(v > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 5, 10]) if (v <= m * p) return m * p;
    return 10 * p;
  }

  // lines: [{name, color, dash, values: [[t, v|null], ...]}]; x is seconds since start.
  function lineChart(title, unit, lines) {
    const W = 520, H = 170, L = 44, R = 8, T = 8, B = 20;
    const box = el("div", { class: "chart" });
    box.appendChild(el("h3", {}, title));
    const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
    let tMax = 0, vMax = 0;
    for (const line of lines) {
      for (const [t, v] of line.values) {
        if (t > tMax) tMax = t;
        if (v !== null && v > vMax) vMax = v;
      }
    }
    const tMin = Math.max(0, tMax - KEEP);
    const yMax = niceMax(vMax);
    const x = (t) => L + ((t - tMin) / Math.max(1, tMax - tMin)) * (W - L - R);
    const y = (v) => T + (1 - v / yMax) * (H - T - B);
    for (let i = 0; i <= 4; i++) {
      const v = (yMax * i) / 4;
      svg.appendChild(svgEl("line", { class: "axis", x1: L, x2: W - R, y1: y(v), y2: y(v) }));
      const label = svgEl("text", { x: L - 4, y: y(v) + 3, "text-anchor": "end" });
      label.textContent = fmt(v, Number.isInteger(v) ? 0 : 1);
      svg.appendChild(label);
    }
    const span = tMax - tMin;
    for (const frac of [0, 0.5, 1]) {
      const t = tMin + frac * span;
      const label = svgEl("text", { x: x(t), y: H - 5, "text-anchor": frac === 0 ? "start" :
        frac === 1 ? "end" : "middle" });
      label.textContent = frac === 1 ? "now" : `-${Math.round(tMax - t)} s`;
      svg.appendChild(label);
    }
    for (const line of lines) {
      let d = "";
      let pen = false;
      for (const [t, v] of line.values) {
        if (v === null || t < tMin) { pen = false; continue; }
        d += `${pen ? "L" : "M"}${x(t).toFixed(1)},${y(v).toFixed(1)}`;
        pen = true;
      }
      if (!d) continue;
      const path = svgEl("path", {
        d, fill: "none", stroke: line.color, "stroke-width": line.width || 1.5,
        class: "line", "data-name": line.name,
      });
      if (line.dash) path.setAttribute("stroke-dasharray", "4 3");
      svg.appendChild(path);
    }
    box.appendChild(svg);
    const legend = el("div", { class: "legend" });
    for (const line of lines) {
      const item = el("span", {});
      const swatch = el("i", { class: line.dash ? "dash" : "" });
      swatch.style.color = line.color;
      if (!line.dash) swatch.style.background = line.color;
      item.appendChild(swatch);
      item.appendChild(document.createTextNode(line.name + (unit ? ` (${unit})` : "")));
      legend.appendChild(item);
    }
    box.appendChild(legend);
    return box;
  }

  function tile(label, value) {
    const t = el("div", { class: "tile" });
    t.appendChild(el("div", { class: "v" }, value));
    t.appendChild(el("div", { class: "k" }, label));
    return t;
  }

  // One row per request (newest on top), one bar per attempt from its start to its first
  // token or its end; the winner outlined and marked with a dot at its first token.
  function racesChart(races) {
    const box = el("div", { class: "races" });
    box.appendChild(el("h3", {}, `recent races (last ${races.length}): ` +
      "bar = attempt from its start to its first token, failure or cancellation; ● winner"));
    // each attempt has its own lane; a race's lanes are grouped, races a little apart
    const W = 1060, L = 150, R = 30, LANE = 7, GAP = 4, T = 4, B = 18;
    const lanes = races.reduce((n, race) => n + Math.max(1, race.attempts.length), 0);
    const H = T + B + LANE * lanes + GAP * races.length;
    const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, class: "timeline" });
    let msMax = 0;
    for (const race of races) {
      for (const a of race.attempts) if (a.end_ms > msMax) msMax = a.end_ms;
    }
    const xMax = niceMax(msMax);
    const x = (ms) => L + (ms / xMax) * (W - L - R);
    for (let i = 0; i <= 4; i++) {
      const ms = (xMax * i) / 4;
      svg.appendChild(svgEl("line", { class: "axis", x1: x(ms), x2: x(ms), y1: T, y2: H - B }));
      const label = svgEl("text", { x: x(ms), y: H - 5, "text-anchor": i === 4 ? "end" :
        i === 0 ? "start" : "middle" });
      label.textContent = `${fmt(ms)} ms`;
      svg.appendChild(label);
    }
    const newestFirst = races.slice().reverse();
    let top = T;
    newestFirst.forEach((race) => {
      const rowHeight = LANE * Math.max(1, race.attempts.length);
      const label = svgEl("text", { x: 2, y: top + rowHeight / 2 + 3.5 });
      const kinds = race.attempts.map((a) => a.kind[0]).join("");
      label.textContent = `${race.id.slice(-10)} ${kinds} ${race.outcome}`;
      svg.appendChild(label);
      race.attempts.forEach((a, index) => {
        const won = race.winner === index;
        const y = top + index * LANE;
        const width = Math.max(1.5, x(a.end_ms) - x(a.start_ms));
        const bar = svgEl("rect", {
          x: x(a.start_ms), y: y + 0.5, width, height: LANE - 1.5, rx: 1.5,
          class: `bar bar-${a.kind} bar-${a.outcome || "open"}${won ? " winner" : ""}`,
        });
        const tip = svgEl("title", {});
        tip.textContent = `${a.kind} → ${a.backend}: ${a.outcome || "?"}, ` +
          `${fmt(a.start_ms, 1)}–${fmt(a.end_ms, 1)} ms` + (a.reason ? ` (${a.reason})` : "") +
          (race.worker !== undefined ? ` · worker ${race.worker}` : "");
        bar.appendChild(tip);
        svg.appendChild(bar);
        if (won) {
          svg.appendChild(svgEl("circle", {
            class: "winmark", cx: x(a.end_ms), cy: y + LANE / 2 - 0.25, r: 3,
          }));
        }
      });
      top += rowHeight + GAP;
    });
    box.appendChild(svg);
    const legend = el("div", { class: "legend" });
    for (const [kind, color] of [["primary", "#3b6fd8"], ["hedge", "#e07b1f"],
      ["failover", "#8a5cc7"], ["continuation", "#2a9d8f"]]) {
      const item = el("span", {});
      const swatch = el("i", {});
      swatch.style.background = color;
      item.appendChild(swatch);
      item.appendChild(document.createTextNode(kind));
      legend.appendChild(item);
    }
    legend.appendChild(el("span", {}, "faded: lost, cancelled or failed"));
    box.appendChild(legend);
    return box;
  }

  function backendTable(pool, backends) {
    const table = el("table", { class: "backends" });
    const head = el("tr", {});
    for (const h of ["backend", "state", "headroom", "quota skips", "in flight", "hedge delay",
      "prefill ms/1k",
      "TTFT p50", "TTFT p99", "attempts", "won", "hedges won", "tokens in", "tokens out"]) {
      head.appendChild(el("th", {}, h));
    }
    table.appendChild(head);
    for (const [name, b] of Object.entries(backends)) {
      const life = b.lifetime || {};
      const win = b.window || {};
      const tokens = life.tokens || {};
      const row = el("tr", {});
      row.appendChild(el("td", {}, name));
      const stateCell = el("td", { class: `state-${b.state}` },
        b.state + (b.reason ? ` (${b.reason})` : ""));
      row.appendChild(stateCell);
      // the least share of a quota left, as the backend's latest rate-limit headers said
      const headroom = b.headroom === null || b.headroom === undefined ? "–"
        : `${fmt(b.headroom * 100, 1)} % ${b.headroom_resource || ""}`;
      row.appendChild(el("td", { class: "headroom" }, headroom));
      const cells = [life.headroom_skips, b.inflight,
        `${fmt(b.hedge_delay_ms, 1)} ms ${b.hedge_delay_mode || ""}`, fmt(b.prefill_ms_per_1k, 1),
        fmt((win.ttft_ms || {}).p50, 1), fmt((win.ttft_ms || {}).p99, 1), life.attempts,
        life.won, life.hedges_won, fmt(tokens.input), fmt(tokens.output)];
      for (const c of cells) row.appendChild(el("td", {}, String(c === undefined ? "–" : c)));
      table.appendChild(row);
    }
    return table;
  }

  function renderPool(name, stats) {
    const section = el("section", { class: "pool", "data-pool": name });
    section.appendChild(el("h2", {}, `pool ${name}`));
    const points = state.points[name] || [];
    const last = points.length ? points[points.length - 1] : {};
    const life = stats.lifetime || {};
    const win = stats.window || {};
    const tokens = life.tokens || {};
    const budget = stats.budget || {};
    const tiles = el("div", { class: "tiles" });
    tiles.appendChild(tile("requests / s", fmt(last.requests, 1)));
    tiles.appendChild(tile("client TTFT p50 / p99 (ms)",
      `${fmt((win.ttft_ms || {}).p50)} / ${fmt((win.ttft_ms || {}).p99)}`));
    tiles.appendChild(tile("hedges started / won", `${fmt((life.hedges || {}).started)} / ` +
      `${fmt((life.hedges || {}).won)}`));
    tiles.appendChild(tile("budget tokens", fmt(budget.tokens, 1) +
      (budget.ineffective ? " (probe only)" : "")));
    tiles.appendChild(tile("loser close p99 (ms)", fmt(((win.losers || {}).close_ms || {}).p99, 2)));
    tiles.appendChild(tile("tokens in / out", `${fmt(tokens.input)} / ${fmt(tokens.output)}`));
    tiles.appendChild(tile("hedge cost (input tokens)", fmt(tokens.hedge_input)));
    const share = (x) => (x === null || x === undefined ? "–" : `${fmt(100 * x, 1)} %`);
    tiles.appendChild(tile("prompt cache hit rate", share(tokens.cache_hit_rate)));
    tiles.appendChild(tile("hedge cost: cache misses", share(tokens.hedge_input_miss_share)));
    const affinity = life.affinity || {};
    tiles.appendChild(tile("affinity hit / spill / miss",
      `${fmt(affinity.hits)} / ${fmt(affinity.spills)} / ${fmt(affinity.misses)}`));
    section.appendChild(tiles);

    const grid = el("div", { class: "grid" });
    const ttft = [
      { name: "client p50", color: "#111827", width: 2.2, values: points.map(
        (p) => [p.t, p.client_ttft_ms.p50]) },
      { name: "client p99", color: "#111827", width: 2.2, dash: true, values: points.map(
        (p) => [p.t, p.client_ttft_ms.p99]) },
    ];
    Object.keys(stats.backends || {}).forEach((backend, i) => {
      const color = PALETTE[i % PALETTE.length];
      const pick = (q) => points.map((p) => [p.t, ((p.backends[backend] || {}).ttft_ms || {})[q]
        ?? null]);
      ttft.push({ name: `${backend} p50`, color, values: pick("p50") });
      ttft.push({ name: `${backend} p99`, color, dash: true, values: pick("p99") });
    });
    grid.appendChild(lineChart("TTFT: client vs each backend's attempts", "ms", ttft));
    grid.appendChild(lineChart("hedges per second", "/s", [
      { name: "started", color: "#e07b1f", values: points.map((p) => [p.t, p.hedges_started]) },
      { name: "won", color: "#2f9e57", values: points.map((p) => [p.t, p.hedges_won]) },
      { name: "failovers", color: "#8a5cc7", values: points.map((p) => [p.t, p.failovers]) },
    ]));
    grid.appendChild(lineChart("hedge budget", "tokens", [
      { name: "budget", color: "#3b6fd8", width: 2,
        values: points.map((p) => [p.t, p.budget_tokens ?? null]) },
    ]));
    const suppressed = Object.entries(SUPPRESS_COLORS).map(([reason, color]) => ({
      name: reason, color, values: points.map((p) => [p.t, (p.suppressed || {})[reason] ?? 0]),
    }));
    grid.appendChild(lineChart("hedges suppressed per second, by reason", "/s", suppressed));
    grid.appendChild(lineChart("losers: cancel to upstream closed, p99", "ms", [
      { name: "loser close p99", color: "#c2417a", values: points.map(
        (p) => [p.t, p.loser_close_ms_p99]) },
    ]));
    grid.appendChild(lineChart("tokens per second and hedge cost", "/s", [
      { name: "output", color: "#2f9e57", values: points.map((p) => [p.t, p.tokens_output]) },
      { name: "input", color: "#3b6fd8", values: points.map((p) => [p.t, p.tokens_input]) },
      { name: "hedge input (paid again)", color: "#e07b1f", dash: true, values: points.map(
        (p) => [p.t, p.hedge_input_tokens]) },
    ]));
    section.appendChild(grid);
    section.appendChild(backendTable(name, stats.backends || {}));
    section.appendChild(racesChart(state.races.filter((r) => r.pool === name)));
    return section;
  }

  function render() {
    const root = document.getElementById("pools");
    const pools = (state.stats && state.stats.pools) || {};
    const fresh = document.createDocumentFragment();
    for (const [name, stats] of Object.entries(pools)) fresh.appendChild(renderPool(name, stats));
    root.replaceChildren(fresh);
    document.getElementById("uptime").textContent =
      `up ${fmt(state.stats.uptime_s)} s · window ${fmt(state.stats.window_s)} s`;
    document.getElementById("window").textContent = fmt(state.stats.window_s);
  }

  async function getJSON(path) {
    const response = await fetch(path, { cache: "no-store" });
    if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
    return response.json();
  }

  async function refresh() {
    const status = document.getElementById("status");
    try {
      const [stats, series, races] = await Promise.all([
        getJSON("/hedge/stats"),
        getJSON(`/hedge/series?since=${state.seq}`),
        getJSON("/hedge/races"),
      ]);
      if (series.seq + LAG < state.seq) {  // the gateway restarted
        state.points = {};
        state.seq = 0;
      }
      for (const [pool, points] of Object.entries(series.pools)) {
        const fresh = points.filter((p) => p.seq > state.seq);
        const kept = (state.points[pool] || []).concat(fresh);
        state.points[pool] = kept.slice(Math.max(0, kept.length - KEEP));
      }
      state.seq = Math.max(state.seq, series.seq);
      state.stats = stats;
      state.races = races.races;
      render();
      state.updates += 1;
      document.body.dataset.updates = String(state.updates);
      document.body.dataset.points = String(
        Object.values(state.points).reduce((n, points) => n + points.length, 0));
      status.textContent = `live · ${new Date().toLocaleTimeString()}`;
      status.className = "status live";
    } catch (err) {
      // the gateway is away (restart, network): say so and try again next second
      status.textContent = `no data: ${err.message}`;
      status.className = "status down";
    }
  }

  async function loop() {
    await refresh();
    setTimeout(loop, 1000);
  }

  loop();
})();
