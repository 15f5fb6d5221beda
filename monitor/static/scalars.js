// fp8mon dashboard: every scalar the run logs as its own panel (loss, grad_norm, lr, tokens/s, attention max-logit,
// logit logsumexp, custom ones), each with a log-y toggle, one smoothing for all, and one step zoom shared by every
// panel and the risk-over-time chart. Alert markers come from the alerts code (an overlay dashboard.js hands over).
"use strict";

(function () {
  const { $, api, runPath, num, nonFinite, el, showMessage, errorMessage, drawChart, blankChart } = window.fp8mon;
  const POINTS = 1500;
  const PREDICTIONS = 5000;
  // The agent's well-known scalars first (agent.wire.WELL_KNOWN_SCALARS), then the run's own in catalogue order.
  const KNOWN = ["loss", "grad_norm", "lr", "tokens_per_s", "attn_max_logit", "logit_logsumexp", "adam_update_rms"];
  const TITLES = { loss: "Loss", grad_norm: "Gradient norm", lr: "Learning rate", tokens_per_s: "Tokens / s",
    attn_max_logit: "Attention max-logit", logit_logsumexp: "Logit logsumexp", adam_update_rms: "Adam update RMS" };
  const COLOURS = ["#1d4fa8", "#6b4fbb", "#0f7b6c", "#b3541e", "#a3186b", "#4d6b00", "#375a7f"];
  const NONFINITE_COLOUR = "#d93025";
  const RISK_CHART = "risk-chart";

  const state = { key: "", panels: [], zoom: null, syncing: false, logY: new Set(), name: null,
    risk: { points: [], last: null } }; // the predictions drawn so far: each poll asks only for newer ones

  function chartId(name, taken) {
    // loss -> loss-chart, grad_norm -> grad-norm-chart; a clash of cleaned names gets its position
    let id = name.toLowerCase().replace(/[^a-z0-9]+/g, "-").replace(/^-|-$/g, "") || "scalar";
    if (taken.has(id)) id += "-" + taken.size;
    taken.add(id);
    return id;
  }

  function ordered(scalars) {
    return [...KNOWN.filter((s) => scalars.includes(s)), ...scalars.filter((s) => !KNOWN.includes(s))];
  }

  function buildPanels(catalogue) {
    const scalars = ordered(catalogue.scalars);
    const key = scalars.join("\u0000");
    if (key === state.key) return;
    state.key = key;
    for (const panel of state.panels) blankChart(panel.id + "-chart"); // forget what the old nodes showed
    const taken = new Set();
    state.panels = scalars.map((name, i) => ({ name, id: chartId(name, taken), colour: COLOURS[i % COLOURS.length] }));
    $("scalar-panels").replaceChildren(...state.panels.map(panelNode));
    $("scalar-empty").hidden = state.panels.length > 0;
  }

  function panelNode(panel) {
    const box = el("input");
    box.type = "checkbox";
    box.className = "log-y";
    box.checked = state.logY.has(panel.name);
    box.addEventListener("change", () => {
      if (box.checked) state.logY.add(panel.name);
      else state.logY.delete(panel.name);
      redrawLast(panel);
    });
    const head = el("div", { cls: "panel-head" }, [el("h4", { text: TITLES[panel.name] || panel.name,
      title: panel.name }), el("label", {}, [box, " log y"])]);
    const chart = el("div", { cls: "chart" });
    chart.id = panel.id + "-chart";
    const message = el("p", { cls: "message" });
    message.id = panel.id + "-message";
    return el("div", { cls: "scalar-panel", data: { scalar: panel.name } }, [head, chart, message]);
  }

  // ---- drawing ---------------------------------------------------------------------------------------------

  async function draw(ctx, alerts, overlay) {
    state.name = ctx.name;
    buildPanels(ctx.catalogue);
    const stamp = ctx.stamp + "|" + $("heatmap-rank").value; // new data, or another rank chosen
    await Promise.all([...state.panels.map((panel) => {
      if (panel.stamp !== stamp || !panel.last) return drawPanel(ctx, panel, alerts, overlay, stamp);
      panel.last = { ...panel.last, alerts, overlay }; // no new data: only the alert markers may have changed
      render(panel);
      return null;
    }), drawRisk(ctx)]);
  }

  async function drawPanel(ctx, panel, alerts, overlay, stamp) {
    const chart = panel.id + "-chart";
    const message = panel.id + "-message";
    const { rankParams, rankLabel } = window.fp8mon.heatmap;
    const chosen = $("heatmap-rank").value;
    // Scalars are never merged over ranks (under reduce_ranks rank 0 sends them as its own): with the merged rank
    // chosen, the panels read the ranks that have them.
    const over = chosen === "worst" || chosen === "-1";
    let series;
    try {
      series = await api(`/runs/${runPath(ctx.name)}/series`, { params: { scalar: panel.name, max_points: POINTS,
        ...(over ? { worst_over_ranks: true } : rankParams()) } });
    } catch (err) {
      if (!ctx.current()) return;
      blankChart(chart);
      showMessage(message, errorMessage(err), true);
      return;
    }
    if (!ctx.current() || chosen !== $("heatmap-rank").value) return; // another rank chosen meanwhile: it draws
    if (!series.points.step.length) {
      blankChart(chart);
      panel.last = null;
      showMessage(message, `No ${panel.name} reported ${over ? "" : "on " + rankLabel(chosen) + " "}for this run yet.`);
      return;
    }
    const scope = over && series.ranks.length > 1 ? `At each step the largest over ranks ${series.ranks.join(", ")}. `
      : "";
    showMessage(message, scope + (series.downsampled ? `${series.bucket_width} steps per point: the band is each `
      + "bucket's min–max, the line its mean." : ""));
    panel.last = { series, alerts, overlay };
    panel.stamp = stamp;
    render(panel);
  }

  function redrawLast(panel) {
    if (panel.last) render(panel);
  }

  function render(panel) {
    const { series, alerts, overlay } = panel.last;
    const traces = [...seriesTraces(series, panel), ...overlay.traces(alerts)];
    const layout = overlay.layout(state.name, panel.name, alerts);
    layout.yaxis = { ...layout.yaxis, type: state.logY.has(panel.name) ? "log" : "linear" };
    drawChart(panel.id + "-chart", traces, withZoom(layout));
    bindZoom(panel.id + "-chart");
  }

  function smoothing() {
    return Number($("scalar-smoothing").value) || 0;
  }

  function smoothed(ys) {
    // TensorBoard's debiased exponential moving average; a non-finite value is skipped, not spread
    const weight = smoothing();
    let last = 0;
    let n = 0;
    return ys.map((y) => {
      if (y === null || !Number.isFinite(y)) return null;
      last = last * weight + (1 - weight) * y;
      n += 1;
      return last / (1 - weight ** n);
    });
  }

  function seriesTraces(series, panel) {
    const p = series.points;
    const scalar = panel.name;
    const colour = panel.colour;
    const smooth = smoothing() > 0;
    const faded = smooth ? 0.3 : 1;
    const traces = [];
    let centre;
    if (p.value) {
      centre = p.value.map(num);
      traces.push({ type: "scatter", mode: "lines", name: scalar, x: p.step, y: centre, opacity: faded,
        line: { color: colour, width: 1.5 } });
    } else {
      centre = p.mean.map(num);
      traces.push({ type: "scatter", mode: "lines", name: "min", x: p.step, y: p.min.map(num), line: { width: 0 },
        showlegend: false, hoverinfo: "skip" });
      traces.push({ type: "scatter", mode: "lines", name: "min–max", x: p.step, y: p.max.map(num),
        fill: "tonexty", fillcolor: "rgba(47,111,219,0.2)", line: { width: 0 } });
      traces.push({ type: "scatter", mode: "lines", name: scalar + " (mean)", x: p.step, y: centre, opacity: faded,
        line: { color: colour, width: 1.5 } });
    }
    if (smooth) {
      traces.push({ type: "scatter", mode: "lines", name: scalar + " (smoothed)", x: p.step, y: smoothed(centre),
        line: { color: colour, width: 2 } });
    }
    const raw = p.value || p.max;
    const bad = p.step.filter((_, i) => nonFinite(raw[i]));
    if (bad.length) {
      traces.push({ type: "scatter", mode: "markers", name: "non-finite", x: bad, y: bad.map(() => 0.5),
        yaxis: "y2", marker: { symbol: "x", size: 10, color: NONFINITE_COLOUR } });
    }
    return traces;
  }

  async function drawRisk(ctx) {
    let body;
    const risk = state.risk;
    try {
      body = await api(`/runs/${runPath(ctx.name)}/predictions`, { params: { limit: PREDICTIONS, risk_only: true,
        from_step: risk.last === null ? null : risk.last + 1 } });
    } catch (err) {
      if (!ctx.current()) return;
      blankChart(RISK_CHART);
      showMessage("risk-message", errorMessage(err), true);
      return;
    }
    if (!ctx.current() || risk !== state.risk) return;
    const fresh = body.predictions.filter((p) => risk.last === null || p.step > risk.last);
    risk.points = risk.points.concat(fresh.map((p) => [p.step, p.risk])).slice(-PREDICTIONS);
    if (fresh.length) risk.last = fresh[fresh.length - 1].step;
    const predictions = risk.points;
    if (!predictions.length) {
      blankChart(RISK_CHART);
      showMessage("risk-message", "No prediction yet.");
      return;
    }
    showMessage("risk-message", predictions.length === PREDICTIONS ? `The last ${PREDICTIONS} predictions.` : "");
    const traces = [{ type: "scatter", mode: "lines", name: "risk", x: predictions.map((p) => p[0]),
      y: predictions.map((p) => p[1]), line: { color: "#d93025", width: 1.5, shape: "hv" },
      fill: "tozeroy", fillcolor: "rgba(217,48,37,0.12)" }];
    drawChart(RISK_CHART, traces, withZoom({
      uirevision: ctx.name, margin: { l: 56, r: 16, t: 10, b: 40 },
      xaxis: { title: { text: "step" } }, yaxis: { title: { text: "risk" }, range: [0, 1.02], fixedrange: true },
      showlegend: false, hovermode: "x",
    }));
    bindZoom(RISK_CHART);
  }

  // ---- one step zoom for every panel -----------------------------------------------------------------------

  function withZoom(layout) {
    layout.xaxis = { ...layout.xaxis };
    if (state.zoom) {
      layout.xaxis.range = state.zoom.slice();
      layout.xaxis.autorange = false;
    } else {
      layout.xaxis.autorange = true;
    }
    return layout;
  }

  function chartIds() {
    return [...state.panels.map((p) => p.id + "-chart"), RISK_CHART];
  }

  function bindZoom(id) {
    const node = $(id);
    if (typeof node.on !== "function") return;
    node.removeAllListeners("plotly_relayout"); // bound after every draw: a blanked chart lost its listeners
    node.on("plotly_relayout", (event) => zoomed(id, event));
  }

  function zoomed(source, event) {
    if (state.syncing) return;
    let range;
    if (event["xaxis.range[0]"] !== undefined) range = [event["xaxis.range[0]"], event["xaxis.range[1]"]];
    else if (Array.isArray(event["xaxis.range"])) range = event["xaxis.range"].slice();
    else if (event["xaxis.autorange"]) range = null;
    else return;
    if (JSON.stringify(range) === JSON.stringify(state.zoom)) return; // this zoom reached every panel already
    state.zoom = range;
    state.syncing = true;
    try {
      for (const id of chartIds()) {
        const node = $(id);
        if (id === source || !node.data || node.classList.contains("blank")) continue;
        window.Plotly.relayout(node, range ? { "xaxis.range": range.slice(), "xaxis.autorange": false }
          : { "xaxis.autorange": true });
      }
    } finally {
      state.syncing = false;
    }
  }

  function redrawAll() {
    for (const panel of state.panels) redrawLast(panel);
  }

  function reset() {
    state.key = "";
    state.zoom = null;
    state.risk = { points: [], last: null };
    for (const id of chartIds()) blankChart(id);
    state.panels = [];
    $("scalar-panels").replaceChildren();
  }

  function bind() {
    $("scalar-smoothing").addEventListener("input", () => {
      $("scalar-smoothing-value").textContent = smoothing().toFixed(2);
      redrawAll();
    });
  }

  window.fp8mon.scalars = { bind, draw, reset };
})();
