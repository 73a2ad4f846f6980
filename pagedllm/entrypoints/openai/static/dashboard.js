// pagedllm live KV-cache dashboard: no build step, no dependencies. Draws /dashboard/snapshot and
// the /dashboard/events stream (SSE, ~4 Hz). With --api-key, open /dashboard?api_key=KEY or type it
// when asked (kept in sessionStorage for this tab).
"use strict";
(function () {
  const MAX_CELLS = 2048;          // larger pools: one cell per group of blocks
  const WINDOW_S = 300;            // charts show the last five minutes
  const params = new URLSearchParams(location.search);
  let apiKey = params.get("api_key") || sessionStorage.getItem("pagedllm_api_key") || "";
  const state = { last: null, history: [], gpu: null, cpu: null, source: null, renders: 0, error: null };
  window.pagedllmDashboard = state;   // for scripts and tests: the snapshot on screen is state.last

  const $ = (id) => document.getElementById(id);
  const fmt = (x) => (x === undefined || x === null ? "–" : Number(x).toLocaleString("en-US"));
  const pct = (x) => (x === undefined || x === null ? "–" : x.toFixed(1) + " %");
  const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));
  const query = () => (apiKey ? "?api_key=" + encodeURIComponent(apiKey) : "");

  function setStatus(text, bad) { const el = $("status"); el.textContent = text; el.classList.toggle("bad", !!bad); }

  function sharedColor(rc) { // darker with the refcount
    const light = rc <= 2 ? 62 : rc === 3 ? 48 : Math.max(20, 34 - 4 * (rc - 4));
    return "hsl(" + (rc <= 2 ? 30 : rc === 3 ? 24 : 18) + ", 80%, " + light + "%)";
  }

  function blockState(rc, cached) { return rc > 1 ? "shared" : rc === 1 ? "used" : cached ? "cached_free" : "free"; }

  // -- the block grids --------------------------------------------------------------------------
  function makeGrid(el, numBlocks, cols) {
    const group = Math.max(1, Math.ceil(numBlocks / MAX_CELLS));
    const numCells = Math.ceil(numBlocks / group);
    el.textContent = "";
    cols = cols || Math.max(16, Math.min(64, Math.ceil(Math.sqrt(numCells * 4))));
    el.style.setProperty("--cols", String(cols));
    const cells = [];
    const frag = document.createDocumentFragment();
    for (let i = 0; i < numCells; i++) {
      const c = document.createElement("div");
      c.className = "cell free";
      c.dataset.cell = String(i);
      const f = document.createElement("div");
      f.className = "fill";
      c.appendChild(f);
      frag.appendChild(c);
      cells.push({ el: c, fill: f, cls: "free", bg: "", w: "" });
    }
    el.appendChild(frag);
    return { el, group, numBlocks, cells, cols };
  }

  function paintGrid(grid, pool, cachedSet, blockSize) {
    const rcs = pool.ref_counts, fills = pool.fill || null;
    for (let i = 0; i < grid.cells.length; i++) {
      const lo = i * grid.group, hi = Math.min(grid.numBlocks, lo + grid.group);
      let maxRc = 0, anyCached = false, filled = 0;
      for (let b = lo; b < hi; b++) {
        if (rcs[b] > maxRc) maxRc = rcs[b];
        if (rcs[b] === 0 && cachedSet.has(b)) anyCached = true;
        if (fills && rcs[b] > 0) filled += fills[b];
      }
      const cls = blockState(maxRc, anyCached);
      const cell = grid.cells[i];
      if (cell.cls !== cls) { cell.el.className = "cell " + cls; cell.cls = cls; }
      const bg = cls === "shared" ? sharedColor(maxRc) : "";
      if (cell.bg !== bg) { cell.el.style.background = bg; cell.bg = bg; }
      const w = fills && maxRc > 0 ? Math.round((100 * filled) / (blockSize * (hi - lo))) + "%" : "0%";
      if (cell.w !== w) { cell.fill.style.width = w; cell.w = w; }
    }
  }

  function describeCell(kind, i) {
    const snap = state.last, grid = kind === "gpu" ? state.gpu : state.cpu;
    if (!snap || !grid) return "";
    const pool = snap[kind], bs = snap.block_size;
    const lo = i * grid.group, hi = Math.min(grid.numBlocks, lo + grid.group);
    const cached = new Set(kind === "gpu" ? pool.cached_free : []);
    if (hi - lo === 1) {
      const rc = pool.ref_counts[lo], owners = pool.owners[String(lo)] || [];
      const st = kind === "gpu" ? blockState(rc, cached.has(lo)) : rc > 0 ? "swapped out" : "free";
      let html = "<b>" + (kind === "gpu" ? "block " : "CPU block ") + lo + "</b> · " + st + "<br>refcount " + rc;
      if (kind === "gpu") html += " · fill " + (rc > 0 || cached.has(lo) ? pool.fill[lo] : 0) + " / " + bs + " slots";
      if (owners.length) html += "<br>owners: " + owners.map((o) => "<code>" + esc(o) + "</code>").join(", ");
      return html;
    }
    const tally = { free: 0, cached_free: 0, used: 0, shared: 0 };
    for (let b = lo; b < hi; b++) tally[blockState(pool.ref_counts[b], cached.has(b))]++;
    return "<b>blocks " + lo + "–" + (hi - 1) + "</b> (" + (hi - lo) + " per cell)<br>" +
      Object.entries(tally).filter(([, n]) => n).map(([k, n]) => k + " " + n).join(" · ");
  }

  function wireTooltip(el, kind) {
    const tip = $("tip");
    el.addEventListener("mousemove", (ev) => {
      const c = ev.target.closest(".cell");
      if (!c) { tip.hidden = true; return; }
      tip.innerHTML = describeCell(kind, Number(c.dataset.cell));
      tip.hidden = false;
      tip.style.left = Math.min(window.innerWidth - 350, ev.clientX + 14) + "px";
      tip.style.top = ev.clientY + 14 + "px";
    });
    el.addEventListener("mouseleave", () => { tip.hidden = true; });
  }

  // -- queues -------------------------------------------------------------------------------------
  function renderQueue(name, reqs, snap) {
    $("q-" + name + "-n").textContent = "(" + reqs.length + ")";
    const el = $("q-" + name);
    if (!reqs.length) { el.innerHTML = '<div class="empty">empty</div>'; return; }
    const rcs = snap.gpu.ref_counts;
    el.innerHTML = reqs.slice(0, 60).map((r) => {
      const seqs = r.seqs.map((s) => {
        const chips = s.blocks.map((b) => '<i class="chip' + (rcs[b] > 1 ? " shared" : "") + '" title="block ' + b + '"></i>')
          .concat(s.cpu_blocks.map((b) => '<i class="chip cpu" title="CPU block ' + b + '"></i>')).join("");
        return '<div class="seqrow"><span class="sid">seq ' + s.seq_id + "</span>" + chips + "</div>";
      }).join("");
      const toks = r.seqs.length ? r.seqs[0].num_computed_tokens + "/" + r.seqs[0].num_tokens + " tok" : "";
      return '<div class="req" data-request="' + esc(r.request_id) + '"><span class="rid">' + esc(r.request_id) +
        '</span><span class="meta">' + r.seqs.length + " seq · " + toks + "</span>" + seqs + "</div>";
    }).join("") + (reqs.length > 60 ? '<div class="empty">… ' + (reqs.length - 60) + " more</div>" : "");
  }

  function highlightRequest(rid) {
    const snap = state.last;
    document.querySelectorAll(".cell.hl").forEach((c) => c.classList.remove("hl"));
    if (!rid || !snap || !state.gpu) return;
    for (const [b, owners] of Object.entries(snap.gpu.owners)) {
      if (owners.includes(rid)) state.gpu.cells[Math.floor(Number(b) / state.gpu.group)].el.classList.add("hl");
    }
  }

  // -- charts (canvas, drawn by hand) ----------------------------------------------------------------
  function drawChart(canvas, series, fixedMax) {
    const dpr = window.devicePixelRatio || 1, w = canvas.clientWidth, h = canvas.clientHeight;
    if (canvas.width !== w * dpr || canvas.height !== h * dpr) { canvas.width = w * dpr; canvas.height = h * dpr; }
    const g = canvas.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, h);
    const now = Date.now() / 1000, left = 38, right = w - 6, top = 6, bottom = h - 16;
    let max = fixedMax || 0;
    if (!fixedMax) for (const s of series) for (const p of s.points) if (p[1] > max) max = p[1];
    max = max > 0 ? (fixedMax ? max : max * 1.15) : 1;
    g.strokeStyle = "#e6e9ef"; g.fillStyle = "#8a91a0"; g.font = "10px system-ui, sans-serif"; g.lineWidth = 1;
    for (let k = 0; k <= 2; k++) {
      const y = bottom - ((bottom - top) * k) / 2;
      g.beginPath(); g.moveTo(left, y); g.lineTo(right, y); g.stroke();
      const v = (max * k) / 2;
      g.fillText(v >= 100 ? Math.round(v).toString() : v.toFixed(v >= 10 ? 0 : 1), 2, y + 3);
    }
    const first = state.history.length ? state.history[0].t : now;
    const span = Math.max(30, Math.min(WINDOW_S, now - first));  // up to five minutes, as far back as known
    g.fillText(span >= 120 ? "-" + Math.round(span / 60) + " min" : "-" + Math.round(span) + " s", left, h - 3);
    g.fillText("now", right - 18, h - 3);
    const x = (t) => right - ((now - t) / span) * (right - left);
    const y = (v) => bottom - (v / max) * (bottom - top);
    for (const s of series) {
      const pts = s.points.filter((p) => now - p[0] <= span);
      if (!pts.length) continue;
      g.strokeStyle = s.color; g.lineWidth = 1.6; g.beginPath();
      pts.forEach((p, i) => (i ? g.lineTo(x(p[0]), y(p[1])) : g.moveTo(x(p[0]), y(p[1]))));
      g.stroke();
      const lastV = pts[pts.length - 1][1];
      g.fillStyle = s.color; g.font = "bold 11px system-ui, sans-serif";
      g.fillText(lastV >= 100 ? Math.round(lastV).toLocaleString("en-US") : lastV.toFixed(1), right - 44, top + 10 + 12 * series.indexOf(s));
    }
  }

  function drawCharts() {
    const hist = state.history, col = (k) => hist.map((p) => [p.t, p[k]]);
    drawChart($("c-tps"), [{ points: col("generation_tokens_per_s"), color: "#3d85c6" },
                           { points: col("prompt_tokens_per_s"), color: "#93c47d" }]);
    drawChart($("c-usage"), [{ points: col("kv_usage"), color: "#e69138" }], 100);
    drawChart($("c-frag"), [{ points: col("fragmentation_slots"), color: "#cc4125" }]);
    drawChart($("c-saved"), [{ points: col("blocks_saved_by_sharing"), color: "#6aa84f" }]);
    drawChart($("c-preempt"), [{ points: col("num_preemptions"), color: "#8e7cc3" }]);
    drawChart($("c-hit"), [{ points: col("prefix_cache_hit_rate"), color: "#45818e" }], 100);
  }

  function addHistoryPoint(p) {
    if (!p) return;
    const h = state.history;
    if (h.length && h[h.length - 1].t >= p.t) return;
    h.push(p);
    while (h.length && Date.now() / 1000 - h[0].t > WINDOW_S + 5) h.shift();
  }

  // -- one snapshot on screen ------------------------------------------------------------------------
  function render(snap) {
    if (!state.gpu || state.gpu.numBlocks !== snap.gpu.num_blocks) state.gpu = makeGrid($("gpu-grid"), snap.gpu.num_blocks);
    if (!state.cpu || state.cpu.numBlocks !== snap.cpu.num_blocks) state.cpu = makeGrid($("cpu-grid"), snap.cpu.num_blocks, state.gpu.cols);
    paintGrid(state.gpu, snap.gpu, new Set(snap.gpu.cached_free), snap.block_size);
    paintGrid(state.cpu, snap.cpu, new Set(), snap.block_size);
    const c = snap.counts, st = snap.stats || {};
    $("gpu-caption").textContent = snap.gpu.num_blocks + " blocks × " + snap.block_size + " tokens" +
      (state.gpu.group > 1 ? " · one cell = " + state.gpu.group + " blocks" : " · one cell = one block");
    $("cpu-caption").textContent = snap.cpu.num_blocks ? snap.cpu.num_blocks + " blocks" +
      (state.cpu.group > 1 ? " · one cell = " + state.cpu.group + " blocks" : "") : "none (swap_space 0)";
    $("n-free").textContent = fmt(c.kv_blocks_free_uncached);
    $("n-cached_free").textContent = fmt(c.kv_blocks_cached_free);
    $("n-used").textContent = fmt(c.kv_blocks_used);
    $("n-shared").textContent = fmt(c.kv_blocks_shared);
    $("n-saved").textContent = fmt(c.kv_blocks_saved_by_sharing);
    $("n-usage").textContent = pct((100 * (c.kv_blocks_total - c.kv_blocks_free)) / Math.max(1, c.kv_blocks_total));
    $("n-frag").textContent = fmt(c.kv_slots_empty_in_last_blocks) + " / " + fmt(c.kv_slots_allocated);
    $("n-cpu").textContent = fmt(c.cpu_blocks_used) + " / " + fmt(c.cpu_blocks_total);
    $("n-queues").textContent = c.num_running + " / " + c.num_waiting + " / " + c.num_swapped;
    $("n-preempt").textContent = fmt(st.num_preemptions) + " (" + fmt(st.num_swap_preemptions) + " / " + fmt(st.num_recompute_preemptions) + ")";
    $("n-hit").textContent = st.prefix_cache_queries ? pct((100 * st.prefix_cache_hits) / st.prefix_cache_queries) : "–";
    $("n-cow").textContent = fmt(st.num_cow_copies);
    for (const q of ["running", "waiting", "swapped"]) renderQueue(q, snap.queues[q], snap);
    addHistoryPoint(snap.history_point);
    drawCharts();
    state.last = snap;
    state.renders++;
    setStatus("live · snapshot #" + snap.snapshot_id + " · step " + fmt(snap.num_steps) + " · " +
      new Date(snap.time * 1000).toLocaleTimeString());
  }

  // -- data ----------------------------------------------------------------------------------------
  async function fetchSnapshot() {
    const r = await fetch("/dashboard/snapshot", { headers: apiKey ? { Authorization: "Bearer " + apiKey } : {} });
    if (r.status === 401) {
      const k = window.prompt("This server needs its API key (pagedllm serve --api-key):");
      if (!k) throw new Error("an API key is needed: open /dashboard?api_key=KEY");
      apiKey = k; sessionStorage.setItem("pagedllm_api_key", k);
      return fetchSnapshot();
    }
    if (!r.ok) throw new Error("GET /dashboard/snapshot: HTTP " + r.status);
    return r.json();
  }

  function openEvents() {
    const es = new EventSource("/dashboard/events" + query());
    state.source = es;
    es.addEventListener("history", (ev) => { for (const p of JSON.parse(ev.data)) addHistoryPoint(p); drawCharts(); });
    es.addEventListener("snapshot", (ev) => render(JSON.parse(ev.data)));
    es.addEventListener("failure", (ev) => { state.error = JSON.parse(ev.data); setStatus("engine: " + state.error.error.message, true); });
    es.onerror = () => setStatus("disconnected, retrying…", true);
  }

  async function start() {
    wireTooltip($("gpu-grid"), "gpu");
    wireTooltip($("cpu-grid"), "cpu");
    for (const q of ["running", "waiting", "swapped"]) {
      $("q-" + q).addEventListener("mouseover", (ev) => { const r = ev.target.closest(".req"); highlightRequest(r && r.dataset.request); });
      $("q-" + q).addEventListener("mouseleave", () => highlightRequest(null));
    }
    window.addEventListener("resize", drawCharts);
    try {
      render(await fetchSnapshot());
      openEvents();
    } catch (e) {
      state.error = String(e);
      setStatus(String(e), true);
    }
  }
  start();
})();
