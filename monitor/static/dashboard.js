// fp8mon dashboard: vanilla JS over the /api/v1 REST API, charts with the plotly.js served by the monitor.
"use strict";

(function () {
  const INTERVAL_KEY = "fp8mon.refresh";
  const RUN_PAGE = 50; // runs per "more"
  const RUN_LIMIT_MAX = 1000; // the API's page limit
  const SERIES_POINTS = 1500;
  const HEATMAP_COLUMNS = 600;
  const SEVERITY_COLOURS = { info: "#2f6fdb", warning: "#e08a00", critical: "#d93025" };
  const PREFERRED_STATS = ["kurtosis", "amax", "underflow_frac", "overflow_frac", "rms", "outlier_frac", "crest",
    "nonfinite", "scale"];
  // Statistics spanning decades (kurtosis 3 -> 1000s): a log colour scale keeps the healthy layers readable.
  const LOG_STATS = new Set(["kurtosis", "kurtosis_central", "amax", "rms", "crest", "scale", "amax_history_max"]);

  const state = {
    runs: [],
    runTotal: 0,
    runLimit: RUN_PAGE,
    runRequest: 0, // bumped per run-list request: an older answer does not overwrite a newer search
    rankKey: "",
    selected: null,
    generation: 0, // bumped on every run switch: responses for an older selection are dropped
    catalogueKey: "",
    paused: false,
    timer: null,
    ticking: false,
    again: false, // a refresh was asked for while one was running
  };

  const { TOKEN_KEY, $, ApiError, runPath, api, isAuthError, num, nonFinite, fmt,
    el, showMessage, showBanner, errorMessage, hasPlotly, drawChart, blankChart } = window.fp8mon;

  // ---- URL and token ---------------------------------------------------------------------------------------

  function readUrl() {
    const params = new URLSearchParams(window.location.search);
    if (params.has("token")) {
      sessionStorage.setItem(TOKEN_KEY, params.get("token"));
      params.delete("token"); // keep the secret out of the address bar and the history
    }
    const interval = Number(params.get("refresh") || localStorage.getItem(INTERVAL_KEY));
    if (interval > 0) setIntervalOption(interval);
    writeUrl(params);
    return params;
  }

  function writeUrl(params) {
    const query = params.toString();
    window.history.replaceState(null, "", window.location.pathname + (query ? "?" + query : ""));
  }

  function updateUrl(changes) {
    const params = new URLSearchParams(window.location.search);
    for (const [key, value] of Object.entries(changes)) {
      if (value) params.set(key, value);
      else params.delete(key);
    }
    writeUrl(params);
  }

  function setIntervalOption(seconds) {
    const select = $("refresh-interval");
    if (![...select.options].some((o) => Number(o.value) === seconds)) {
      select.append(el("option", { text: seconds + " s" }));
      select.lastChild.value = String(seconds);
    }
    select.value = String(seconds);
  }

  function askForToken(err) {
    showBanner("The monitor needs an API token: " + err.message + ". Enter it below, or open this page as "
      + "/?token=<your token>.");
    $("token-form").hidden = false;
    $("token-input").focus();
  }

  function bindTokenForm() {
    $("token-button").addEventListener("click", () => {
      $("token-form").hidden = !$("token-form").hidden;
    });
    $("token-form").addEventListener("submit", (event) => {
      event.preventDefault();
      sessionStorage.setItem(TOKEN_KEY, $("token-input").value.trim());
      $("token-input").value = "";
      $("token-form").hidden = true;
      showBanner("");
      refreshNow();
    });
    $("token-clear").addEventListener("click", () => {
      sessionStorage.removeItem(TOKEN_KEY);
      $("token-form").hidden = true;
      refreshNow();
    });
  }

  // ---- run list --------------------------------------------------------------------------------------------
  // One request per refresh: the server pages, searches and sorts every run, and counts each run's firing
  // alerts and latest risk itself.

  function runQuery() {
    const tags = [];
    const words = [];
    for (const word of $("run-filter").value.trim().split(/\s+/).filter(Boolean)) {
      (word.includes("=") ? tags : words).push(word);
    }
    return { name: words.join(" ") || null, tag: tags, order_by: $("run-sort").value, limit: state.runLimit };
  }

  async function loadRuns() {
    const query = runQuery();
    const params = new URLSearchParams();
    for (const [key, value] of Object.entries(query)) {
      for (const v of [].concat(value)) if (v !== null && v !== undefined) params.append(key, v);
    }
    return api("/runs?" + params.toString());
  }

  async function latestPrediction(name) {
    // ?limit=1 rather than /predictions/latest: a run without predictions is an empty list, not a 404.
    const body = await api(`/runs/${runPath(name)}/predictions`, { params: { limit: 1 } });
    return body.predictions.length ? body.predictions[body.predictions.length - 1] : null;
  }

  function renderRuns() {
    const runs = state.runs;
    $("run-list").replaceChildren(...runs.map(runItem));
    const searching = $("run-filter").value.trim() !== "";
    if (!runs.length) {
      showMessage("run-list-message", searching ? "No run matches the search."
        : "No runs yet: start a training with the agent attached.");
    } else {
      const capped = runs.length < state.runTotal && state.runLimit >= RUN_LIMIT_MAX ? ": search to narrow" : "";
      showMessage("run-list-message",
        `${runs.length} of ${state.runTotal} run${state.runTotal === 1 ? "" : "s"}${capped}`);
    }
    $("run-more").hidden = runs.length >= state.runTotal || state.runLimit >= RUN_LIMIT_MAX;
  }

  function runItem(run) {
    const severity = run.worst_severity ? " sev-" + run.worst_severity : "";
    const selected = run.name === state.selected ? " selected" : "";
    const risk = run.risk;
    const health = el("div", { cls: "run-health" }, [
      el("span", { cls: "badge status-" + run.status, text: run.status }),
      el("span", { cls: "run-step", text: run.last_step === null ? "no steps" : "step " + run.last_step }),
      el("span", { cls: "run-risk " + riskClass(risk), text: risk === null ? "risk –" : "risk " + fmt(risk, 2) }),
      el("span", { cls: "run-firing" + (run.firing ? " firing-" + run.worst_severity : ""),
        text: run.firing + " firing" }),
    ]);
    const counts = Object.entries(run.firing_by_severity).map(([sev, n]) => `${n} ${sev}`).join(", ");
    const title = run.firing ? `${run.firing} firing alert(s): ${counts}` : "no firing alert";
    const item = el("li", { cls: "run-item" + severity + selected, title, data: { run: run.name } },
      [el("div", { cls: "run-name", text: run.name }), health]);
    item.addEventListener("click", () => selectRun(run.name));
    window.fp8monCompare.decorate(item, run); // the tick box that picks it for comparison
    return item;
  }

  function riskClass(risk) {
    if (risk === null || risk === undefined) return "";
    return risk >= 0.7 ? "risk-high" : risk >= 0.3 ? "risk-mid" : "risk-low";
  }

  async function refreshRuns() {
    const asked = ++state.runRequest;
    try {
      const list = await loadRuns();
      if (asked !== state.runRequest) return true; // a newer search or sort is under way: it renders
      state.runs = list.runs;
      state.runTotal = list.total;
      showBanner("");
      renderRuns();
      return true;
    } catch (err) {
      if (isAuthError(err)) askForToken(err);
      else showBanner("Could not load the runs: " + errorMessage(err));
      return false;
    }
  }

  function bindRunListControls(params) {
    if (params.get("q")) $("run-filter").value = params.get("q");
    if (params.get("sort")) $("run-sort").value = params.get("sort");
    if (!$("run-sort").value) $("run-sort").value = "-created_at";
    let timer = null;
    $("run-filter").addEventListener("input", () => {
      clearTimeout(timer);
      timer = setTimeout(() => {
        state.runLimit = RUN_PAGE;
        updateUrl({ q: $("run-filter").value.trim() || null });
        refreshRuns();
      }, 250);
    });
    $("run-sort").addEventListener("change", () => {
      state.runLimit = RUN_PAGE;
      updateUrl({ sort: $("run-sort").value === "-created_at" ? null : $("run-sort").value });
      refreshRuns();
    });
    $("run-more").addEventListener("click", () => {
      state.runLimit = Math.min(RUN_LIMIT_MAX, state.runLimit + RUN_PAGE);
      refreshRuns();
    });
  }

  // ---- one run ---------------------------------------------------------------------------------------------

  function selectRun(name) {
    if (name === state.selected) return;
    state.selected = name;
    state.generation += 1;
    state.catalogueKey = "";
    state.rankKey = "";
    updateUrl({ run: name, stat: null, site: null, rank: null });
    for (const item of document.querySelectorAll(".run-item")) {
      item.classList.toggle("selected", item.dataset.run === name);
    }
    ["loss-chart", "grad-norm-chart", "heatmap-chart"].forEach(blankChart);
    window.fp8monAlerts.reset();
    $("prediction").replaceChildren();
    showMessage("run-empty", "Loading " + name + " …");
    refreshRun();
  }

  async function refreshRun() {
    const name = state.selected;
    const generation = state.generation;
    if (!name) return;
    const current = () => generation === state.generation;
    try {
      const [run, catalogue] = await Promise.all([api(`/runs/${runPath(name)}`),
        api(`/runs/${runPath(name)}/catalogue`)]);
      if (!current()) return;
      showRunHeader(run);
      fillHeatmapSelectors(catalogue);
      fillRankSelector(catalogue.ranks);
    } catch (err) {
      if (current()) showRunError(name, err);
      return;
    }
    const alerts = await window.fp8monAlerts.load(name, () => generation === state.generation);
    await Promise.all([
      drawScalar(name, generation, "loss", "loss-chart", "loss-message", alerts),
      drawScalar(name, generation, "grad_norm", "grad-norm-chart", "grad-norm-message", alerts),
      drawHeatmap(name, generation),
      drawPrediction(name, generation),
    ]);
  }

  function showRunHeader(run) {
    $("run-empty").hidden = true;
    $("run-view").hidden = false;
    $("run-title").textContent = run.name;
    $("run-status").textContent = run.status;
    $("run-status").className = "badge status-" + run.status;
    $("run-steps").textContent = run.last_step === null ? "no steps yet"
      : `steps ${run.first_step}–${run.last_step} · ${run.tensor_series} layer×site series`;
    document.title = run.name + " · fp8mon";
  }

  function showRunError(name, err) {
    if (isAuthError(err)) askForToken(err);
    $("run-view").hidden = true;
    $("run-empty").hidden = false;
    showMessage("run-empty", `Cannot show run '${name}': ${errorMessage(err)}`, true);
  }

  // ---- loss and grad-norm with alert markers -----------------------------------------------------------------

  async function drawScalar(name, generation, scalar, chartId, messageId, alerts) {
    let series;
    try {
      series = await api(`/runs/${runPath(name)}/series`, { params: { scalar, max_points: SERIES_POINTS } });
    } catch (err) {
      if (generation !== state.generation) return;
      blankChart(chartId);
      const missing = err instanceof ApiError && err.status === 404;
      showMessage(messageId, missing ? `No ${scalar} reported for this run yet.` : errorMessage(err), !missing);
      return;
    }
    if (generation !== state.generation) return;
    if (!series.points.step.length) {
      blankChart(chartId);
      showMessage(messageId, `No ${scalar} reported for this run yet.`);
      return;
    }
    showMessage(messageId, series.downsampled ? `${series.bucket_width} steps per point: the band is each `
      + "bucket's min–max, the line its mean." : "");
    const traces = [...seriesTraces(series, scalar), ...window.fp8monAlerts.markerTraces(alerts)];
    drawChart(chartId, traces, scalarLayout(name, scalar, alerts));
  }

  function seriesTraces(series, scalar) {
    const p = series.points;
    const colour = scalar === "loss" ? "#1d4fa8" : "#6b4fbb";
    const traces = [];
    if (p.value) {
      traces.push({ type: "scatter", mode: "lines", name: scalar, x: p.step, y: p.value.map(num),
        line: { color: colour, width: 1.5 } });
    } else {
      traces.push({ type: "scatter", mode: "lines", name: "min", x: p.step, y: p.min.map(num), line: { width: 0 },
        showlegend: false, hoverinfo: "skip" });
      traces.push({ type: "scatter", mode: "lines", name: "min–max", x: p.step, y: p.max.map(num),
        fill: "tonexty", fillcolor: "rgba(47,111,219,0.2)", line: { width: 0 } });
      traces.push({ type: "scatter", mode: "lines", name: scalar + " (mean)", x: p.step, y: p.mean.map(num),
        line: { color: colour, width: 1.5 } });
    }
    const raw = p.value || p.max;
    const bad = p.step.filter((_, i) => nonFinite(raw[i]));
    if (bad.length) {
      traces.push({ type: "scatter", mode: "markers", name: "non-finite", x: bad, y: bad.map(() => 0.5),
        yaxis: "y2", marker: { symbol: "x", size: 10, color: SEVERITY_COLOURS.critical } });
    }
    return traces;
  }

  function scalarLayout(name, scalar, alerts) {
    const shapes = window.fp8monAlerts.markerShapes(alerts);
    return {
      uirevision: name, // the user's zoom survives live updates, and resets on another run
      margin: { l: 56, r: 16, t: 10, b: 40 },
      xaxis: { title: { text: "step" } },
      yaxis: { title: { text: scalar } },
      yaxis2: { overlaying: "y", range: [0, 1.02], visible: false, fixedrange: true },
      legend: { orientation: "h", x: 0, y: 1.15 },
      hovermode: "closest",
      shapes,
    };
  }

  // ---- layer x step heatmap ----------------------------------------------------------------------------------

  function fillHeatmapSelectors(catalogue) {
    const key = catalogue.stats.join(",") + "|" + catalogue.sites.join(",");
    if (key === state.catalogueKey) return;
    state.catalogueKey = key;
    const params = new URLSearchParams(window.location.search);
    const stats = [...PREFERRED_STATS.filter((s) => catalogue.stats.includes(s)),
      ...catalogue.stats.filter((s) => !PREFERRED_STATS.includes(s))];
    fillSelect("heatmap-stat", stats, params.get("stat") || $("heatmap-stat").value || "kurtosis");
    fillSelect("heatmap-site", catalogue.sites, params.get("site") || $("heatmap-site").value || "input");
    $("heatmap-log").checked = LOG_STATS.has($("heatmap-stat").value);
  }

  function fillRankSelector(ranks) {
    // merged (-1) when the run reduces over ranks, else rank 0; "worst" when several ranks report
    const key = ranks.join(",");
    if (key === state.rankKey) return;
    state.rankKey = key;
    const perRank = ranks.filter((r) => r >= 0);
    const options = ranks.map((r) => ({ value: String(r), text: r === -1 ? "merged (−1)" : "rank " + r }));
    if (perRank.length > 1) options.push({ value: "worst", text: "worst over ranks" });
    const select = $("heatmap-rank");
    select.replaceChildren(...options.map((o) => {
      const option = el("option", { text: o.text });
      option.value = o.value;
      return option;
    }));
    const values = options.map((o) => o.value);
    const asked = new URLSearchParams(window.location.search).get("rank");
    const fallback = ranks.includes(-1) ? "-1" : ranks.includes(0) ? "0" : (values[0] || "0");
    select.value = values.includes(asked) ? asked : fallback;
    select.disabled = options.length < 2;
  }

  function rankParams() {
    const value = $("heatmap-rank").value || "0";
    return value === "worst" ? { worst_over_ranks: true } : { rank: value };
  }

  function rankLabel(value) {
    return value === "worst" ? "any rank" : value === "-1" ? "the merged rank (−1)" : "rank " + value;
  }

  function fillSelect(id, values, preferred) {
    const select = $(id);
    select.replaceChildren(...values.map((v) => el("option", { text: v })));
    select.value = values.includes(preferred) ? preferred : (values[0] || "");
  }

  async function drawHeatmap(name, generation) {
    const stat = $("heatmap-stat").value;
    const site = $("heatmap-site").value;
    const rank = $("heatmap-rank").value;
    if (!stat || !site) {
      blankChart("heatmap-chart");
      showMessage("heatmap-message", "No per-layer statistics in this run yet.");
      return;
    }
    let heatmap;
    try {
      heatmap = await api(`/runs/${runPath(name)}/heatmap`, {
        params: { stat, site, agg: $("heatmap-agg").value, max_points: HEATMAP_COLUMNS, ...rankParams() } });
    } catch (err) {
      if (generation !== state.generation) return;
      blankChart("heatmap-chart");
      showMessage("heatmap-message", errorMessage(err), true);
      return;
    }
    if (generation !== state.generation || stat !== $("heatmap-stat").value || site !== $("heatmap-site").value
        || rank !== $("heatmap-rank").value) {
      return; // the user switched while this was loading; the newer request draws
    }
    const empty = emptyHeatmapReason(heatmap, stat, site, rank);
    if (empty) {
      blankChart("heatmap-chart");
      showMessage("heatmap-message", empty);
      return;
    }
    const worst = rank === "worst" ? `Each cell: the largest over ranks ${heatmap.ranks.join(", ")}. ` : "";
    showMessage("heatmap-message", worst + (heatmap.downsampled
      ? `${heatmap.bucket_width} steps per column (${heatmap.agg} of each bucket).` : ""));
    drawChart("heatmap-chart", heatmapTraces(heatmap), heatmapLayout(name));
  }

  function emptyHeatmapReason(heatmap, stat, site, rank) {
    if (!heatmap.layers.length || !heatmap.edges.length) return `No ${stat} at the ${site} site in this run.`;
    if (heatmap.values.some((row) => row.some((v) => v !== null))) return "";
    const others = heatmap.run_ranks.map((r) => rankLabel(String(r))).join(", ");
    return `No ${stat} at the ${site} site on ${rankLabel(rank)}` + (others ? `: this run reports it on ${others}.` : ".");
  }

  function reportedColumns(heatmap) {
    // Statistics every N steps leave N-1 empty columns in between; drawn, they would stripe the map.
    return heatmap.edges.slice(0, -1).map((_, c) => c)
      .filter((c) => heatmap.values.some((row) => row[c] !== null));
  }

  function heatmapTraces(heatmap) {
    const log = $("heatmap-log").checked;
    const columns = reportedColumns(heatmap);
    const cell = (v) => {
      const value = num(v);
      if (!log || value === null) return value;
      return value > 0 ? Math.log10(value) : null;
    };
    const first = (c) => heatmap.edges[c];
    const last = (c) => heatmap.edges[c + 1] - 1;
    const trace = {
      type: "heatmap", name: heatmap.stat, x: columns.map((c) => (first(c) + last(c)) / 2), y: heatmap.layers,
      z: heatmap.values.map((row) => columns.map((c) => cell(row[c]))),
      colorscale: "Viridis", hoverongaps: false,
      colorbar: { title: { text: (log ? "log₁₀ " : "") + heatmap.stat }, thickness: 12 },
      customdata: heatmap.values.map((row) => columns.map((c) =>
        [first(c) === last(c) ? first(c) : `${first(c)}–${last(c)}`, typeof row[c] === "number" ? fmt(row[c], 4)
          : String(row[c])])),
      hovertemplate: "%{y}<br>step %{customdata[0]}<br>" + heatmap.stat + " %{customdata[1]}<extra></extra>",
    };
    const bad = { x: [], y: [] };
    heatmap.values.forEach((row, r) => columns.forEach((c) => {
      if (nonFinite(row[c])) {
        bad.x.push((first(c) + last(c)) / 2);
        bad.y.push(heatmap.layers[r]);
      }
    }));
    const traces = [trace];
    if (bad.x.length) {
      traces.push({ type: "scatter", mode: "markers", name: "non-finite", ...bad, hoverinfo: "x+y+name",
        marker: { symbol: "x", size: 9, color: SEVERITY_COLOURS.critical } });
    }
    return traces;
  }

  function heatmapLayout(name) {
    return {
      uirevision: name,
      margin: { l: 10, r: 10, t: 10, b: 40 },
      xaxis: { title: { text: "step" } },
      yaxis: { autorange: "reversed", automargin: true, type: "category" },
      showlegend: false,
    };
  }

  function bindHeatmapControls() {
    const redraw = () => {
      updateUrl({ stat: $("heatmap-stat").value, site: $("heatmap-site").value, rank: $("heatmap-rank").value });
      if (state.selected) drawHeatmap(state.selected, state.generation);
    };
    $("heatmap-stat").addEventListener("change", () => {
      $("heatmap-log").checked = LOG_STATS.has($("heatmap-stat").value);
      redraw();
    });
    $("heatmap-site").addEventListener("change", redraw);
    $("heatmap-agg").addEventListener("change", redraw);
    $("heatmap-rank").addEventListener("change", redraw);
    $("heatmap-log").addEventListener("change", redraw);
  }

  // ---- prediction --------------------------------------------------------------------------------------------

  async function drawPrediction(name, generation) {
    let prediction;
    try {
      prediction = await latestPrediction(name);
    } catch (err) {
      if (generation === state.generation) $("prediction").replaceChildren(el("p", { cls: "message error",
        text: errorMessage(err) }));
      return;
    }
    if (generation !== state.generation) return;
    if (!prediction) {
      $("prediction").replaceChildren(el("p", { cls: "message", text: "No prediction yet." }));
      return;
    }
    $("prediction").replaceChildren(el("div", { cls: "prediction" }, [
      figure("risk", fmt(prediction.risk, 2), riskClass(prediction.risk)),
      figure("steps to divergence", prediction.steps_to_divergence === null ? "no trend"
        : "≈ " + Math.round(prediction.steps_to_divergence)),
      figure("at step", String(prediction.step)),
      listBlock("signals", signalLines(prediction.signals)),
      listBlock("culprits", prediction.culprits.slice(0, 6).map(culpritLine)),
    ]));
  }

  function figure(label, value, cls = "") {
    return el("div", {}, [el("div", { cls: "label", text: label }), el("div", { cls: "figure " + cls, text: value })]);
  }

  function listBlock(label, lines) {
    const items = lines.length ? lines.map((line) => el("li", { text: line })) : [el("li", { text: "none" })];
    return el("div", { cls: "list-" + label }, [el("div", { cls: "label", text: label }), el("ul", {}, items)]);
  }

  function signalLines(signals) {
    return Object.entries(signals)
      .filter(([, score]) => score !== 0 && score !== null)
      .sort((a, b) => (num(b[1]) ?? Infinity) - (num(a[1]) ?? Infinity))
      .map(([signal, score]) => `${signal} ${fmt(score, 2)}`);
  }

  function culpritLine(culprit) {
    const where = culprit.layer ? `${culprit.layer}${culprit.site ? " " + culprit.site : ""}` : "model";
    return `${where}: ${culprit.signal} ${fmt(culprit.value)}`;
  }

  // ---- live refresh ------------------------------------------------------------------------------------------

  function intervalSeconds() {
    return Number($("refresh-interval").value) || 5;
  }

  function schedule() {
    clearTimeout(state.timer);
    state.timer = null;
    if (!state.paused) state.timer = setTimeout(tick, intervalSeconds() * 1000);
  }

  async function tick() {
    if (state.ticking) {
      state.again = true;
      return;
    }
    state.ticking = true;
    let status = "update failed at ";
    try {
      // the run list and the selected run at once: a first render waits for one round trip less
      const [listed] = await Promise.all([refreshRuns(), refreshRun()]);
      if (listed) status = "updated ";
    } catch (err) {
      showBanner(errorMessage(err)); // the draw functions handle API errors; this is a last resort
    } finally {
      state.ticking = false;
      $("refresh-status").textContent = state.paused ? "paused" : status + new Date().toLocaleTimeString();
      if (state.again) {
        state.again = false;
        setTimeout(tick, 0);
      } else {
        schedule();
      }
    }
  }

  function refreshNow() {
    clearTimeout(state.timer);
    tick();
  }

  function togglePause() {
    state.paused = !state.paused;
    $("refresh-toggle").textContent = state.paused ? "Resume" : "Pause";
    if (state.paused) {
      // "paused" once the update under way (if any) has landed: nothing changes after that
      $("refresh-status").textContent = state.ticking ? "pausing…" : "paused";
      schedule();
    } else {
      refreshNow();
    }
  }

  function bindRefreshControls() {
    $("refresh-interval").addEventListener("change", () => {
      localStorage.setItem(INTERVAL_KEY, $("refresh-interval").value);
      schedule();
    });
    $("refresh-toggle").addEventListener("click", togglePause);
  }

  // ---- start -------------------------------------------------------------------------------------------------

  function start() {
    const params = readUrl();
    bindTokenForm();
    bindRefreshControls();
    bindHeatmapControls();
    bindRunListControls(params);
    // an acknowledgement changes the run list's firing counts; the severity filter changes the chart markers
    document.addEventListener("fp8mon:alerts-changed", () => refreshRuns());
    document.addEventListener("fp8mon:alert-filter", () => refreshRun());
    if (!hasPlotly()) showBanner("plotly.js did not load from /static/plotly.min.js: charts are off, tables work.");
    if (params.get("run")) {
      state.selected = params.get("run");
      $("run-empty").textContent = "Loading " + state.selected + " …";
    }
    refreshNow();
  }

  start();
})();
