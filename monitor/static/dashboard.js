// fp8mon dashboard: vanilla JS over the /api/v1 REST API, charts with the plotly.js served by the monitor.
"use strict";

(function () {
  const INTERVAL_KEY = "fp8mon.refresh";
  const RUN_PAGE = 50; // runs per "more"
  const RUN_LIMIT_MAX = 1000; // the API's page limit
  const ALERT_LIMIT = 500;
  const SEVERITY_COLOURS = { info: "#2f6fdb", warning: "#e08a00", critical: "#d93025" };
  const SEVERITY_RANK = { info: 1, warning: 2, critical: 3 };

  const state = {
    runs: [],
    runTotal: 0,
    runLimit: RUN_PAGE,
    runRequest: 0, // bumped per run-list request: an older answer does not overwrite a newer search
    selected: null,
    generation: 0, // bumped on every run switch: responses for an older selection are dropped
    paused: false,
    timer: null,
    ticking: false,
    again: false, // a refresh was asked for while one was running
  };

  const { TOKEN_KEY, $, ApiError, runPath, api, isAuthError, num, fmt,
    el, showMessage, showBanner, errorMessage, hasPlotly, drawChart, blankChart } = window.fp8mon;
  // the run view's parts, one file each
  const { overview, scalars, heatmap, drilldown } = window.fp8mon;

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
      el("span", { cls: "badge status-" + run.status, text: run.status,
        title: run.status === "stalled" ? "no data since " + new Date(run.last_seen_at).toLocaleString() : "" }),
      ...(run.status === "stalled" ? [el("span", { cls: "run-last-seen", text: "since " + since(run.last_seen_at) })]
        : []),
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
    return item;
  }

  function since(iso) {
    // a stalled run's last data: the time today, else the date too
    const date = new Date(iso);
    const time = date.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
    return date.toDateString() === new Date().toDateString() ? time : date.toLocaleDateString() + " " + time;
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
    updateUrl({ run: name, stat: null, site: null, rank: null, rows: null, layer: null, lsite: null });
    for (const item of document.querySelectorAll(".run-item")) {
      item.classList.toggle("selected", item.dataset.run === name);
    }
    [scalars, heatmap, drilldown].forEach((part) => part.reset());
    blankChart("alert-chart");
    $("alert-table").hidden = true;
    $("prediction").replaceChildren();
    showMessage("run-empty", "Loading " + name + " …");
    refreshRun();
  }

  async function refreshRun() {
    const name = state.selected;
    const generation = state.generation;
    if (!name) return;
    const current = () => generation === state.generation;
    let run;
    let catalogue;
    try {
      [run, catalogue] = await Promise.all([api(`/runs/${runPath(name)}`), api(`/runs/${runPath(name)}/catalogue`)]);
      if (!current()) return;
      showRunHeader(run);
      overview.render(run, catalogue);
      heatmap.fillSelectors(catalogue);
      heatmap.fillRanks(catalogue.ranks);
      drilldown.fill(catalogue);
    } catch (err) {
      if (current()) showRunError(name, err);
      return;
    }
    const alerts = await loadRunAlerts(name, generation);
    // the parts fetch again only when the run has new data (`stamp`) or the user changed what they show
    const view = { name, catalogue, current, stamp: `${run.last_seen_at}|${run.last_step}` };
    await Promise.all([
      scalars.draw(view, alerts, { traces: alertMarkerTraces, layout: scalarLayout }),
      heatmap.draw(view),
      drilldown.draw(view),
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

  // ---- alert markers on the scalar charts (scalars.js draws the charts) -------------------------------------

  function firedGroups(alerts) {
    // One marker per fired step, coloured by its worst alert: dozens of layer alerts often fire together.
    const groups = new Map();
    for (const alert of alerts) {
      if (alert.fired_step === null) continue;
      const group = groups.get(alert.fired_step) || { step: alert.fired_step, severity: "info", lines: [] };
      if (SEVERITY_RANK[alert.severity] > SEVERITY_RANK[group.severity]) group.severity = alert.severity;
      const escalated = alert.escalated_step === null ? "" : ` (from step ${alert.escalated_step})`;
      group.lines.push(`${alert.severity}${escalated}: ${alert.message}`);
      groups.set(alert.fired_step, group);
    }
    return [...groups.values()].sort((a, b) => a.step - b.step);
  }

  function alertMarkerTraces(alerts) {
    const groups = firedGroups(alerts);
    if (!groups.length) return [];
    return [{
      type: "scatter", mode: "markers", name: "alerts fired", x: groups.map((g) => g.step),
      y: groups.map(() => 1), yaxis: "y2", cliponaxis: false,
      marker: { symbol: "triangle-down", size: 11, color: groups.map((g) => SEVERITY_COLOURS[g.severity]) },
      text: groups.map((g) => `step ${g.step}<br>` + g.lines.slice(0, 8).join("<br>")
        + (g.lines.length > 8 ? `<br>… ${g.lines.length - 8} more` : "")),
      hoverinfo: "text",
    }];
  }

  function scalarLayout(name, scalar, alerts) {
    const shapes = firedGroups(alerts).map((g) => ({
      type: "line", xref: "x", yref: "paper", x0: g.step, x1: g.step, y0: 0, y1: 1,
      line: { color: SEVERITY_COLOURS[g.severity], width: 1, dash: "dot" },
    }));
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

  // ---- alerts ------------------------------------------------------------------------------------------------

  async function loadRunAlerts(name, generation) {
    let body;
    try {
      body = await api(`/runs/${runPath(name)}/alerts`, { params: { limit: ALERT_LIMIT } });
    } catch (err) {
      if (generation === state.generation) showMessage("alert-message", errorMessage(err), true);
      return [];
    }
    if (generation !== state.generation) return [];
    const more = body.total > body.alerts.length ? ` (the ${body.alerts.length} most recent of ${body.total})` : "";
    showMessage("alert-message", body.alerts.length ? more : "No alerts for this run.");
    drawAlertTimeline(name, body.alerts);
    renderAlertTable(body.alerts);
    return body.alerts;
  }

  function alertLabel(alert) {
    const where = alert.layer ? ` · ${alert.layer}${alert.site ? " " + alert.site : ""}` : "";
    return alert.rule + where;
  }

  function alertEnd(alert) {
    return alert.resolved_step ?? alert.last_step ?? alert.first_step;
  }

  function drawAlertTimeline(name, alerts) {
    const timed = alerts.filter((a) => a.first_step !== null);
    if (!timed.length) {
      blankChart("alert-chart");
      return;
    }
    const traces = ["critical", "warning", "info"].map((severity) => {
      const mine = timed.filter((a) => a.severity === severity);
      return {
        type: "bar", orientation: "h", name: severity, y: mine.map(alertLabel),
        base: mine.map((a) => a.first_step), x: mine.map((a) => Math.max(1, alertEnd(a) - a.first_step)),
        marker: { color: SEVERITY_COLOURS[severity], opacity: mine.map((a) => (a.state === "resolved" ? 0.35 : 0.9)),
          pattern: { shape: mine.map((a) => (a.state === "pending" ? "/" : "")) } },
        text: mine.map((a) => `${a.state}: ${a.message}`), hoverinfo: "text", textposition: "none",
      };
    }).filter((t) => t.y.length);
    const rows = new Set(timed.map(alertLabel)).size;
    const height = Math.min(600, 80 + 20 * rows);
    $("alert-chart").style.height = height + "px"; // one row per alert identity: grow the box with them
    drawChart("alert-chart", traces, {
      uirevision: name, barmode: "overlay", height,
      margin: { l: 10, r: 10, t: 10, b: 36 },
      xaxis: { title: { text: "step" } },
      yaxis: { automargin: true, autorange: "reversed", type: "category" },
      legend: { orientation: "h", x: 0, y: 1.1 },
    });
  }

  function renderAlertTable(alerts) {
    const table = $("alert-table");
    table.hidden = !alerts.length;
    table.tBodies[0].replaceChildren(...alerts.map(alertRow));
  }

  function alertRow(alert) {
    const where = alert.layer ? `${alert.layer}${alert.site ? " / " + alert.site : ""}` : "model";
    const cells = [
      el("td", { text: alert.rule }),
      el("td", { text: where }),
      el("td", {}, [el("span", { cls: "badge sev-" + alert.severity, text: alert.severity })]),
      el("td", { cls: "state", text: alert.state }),
      el("td", { cls: "num", text: fmt(alert.first_step) }),
      el("td", { cls: "num", text: fmt(alert.fired_step) }),
      el("td", { cls: "num", text: fmt(alert.escalated_step) }),
      el("td", { cls: "num", text: fmt(alertEnd(alert)) }),
      el("td", { cls: "alert-text", text: alert.message }),
      el("td", {}, [ackButton(alert)]),
    ];
    return el("tr", { cls: "state-" + alert.state, data: { alertId: alert.id } }, cells);
  }

  function ackButton(alert) {
    const button = el("button", { cls: "ack", text: alert.acknowledged_at ? "acknowledged" : "Acknowledge",
      title: alert.acknowledged_at ? "acknowledged at " + alert.acknowledged_at : "" });
    button.type = "button";
    button.disabled = Boolean(alert.acknowledged_at);
    button.addEventListener("click", () => acknowledge(alert, button));
    return button;
  }

  async function acknowledge(alert, button) {
    button.disabled = true;
    try {
      const acked = await api(`/alerts/${alert.id}/ack`, { method: "POST" });
      button.textContent = "acknowledged";
      button.title = "acknowledged at " + acked.acknowledged_at;
    } catch (err) {
      button.disabled = false;
      const why = err instanceof ApiError && err.status === 403 ? " (acknowledging needs a write token)" : "";
      showMessage("alert-message", "Could not acknowledge alert " + alert.id + ": " + errorMessage(err) + why, true);
    }
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
      if (await refreshRuns()) {
        await refreshRun();
        status = "updated ";
      }
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
    scalars.bind();
    heatmap.bind({ updateUrl, onCell: (layer, site) => drilldown.open(layer, site) });
    drilldown.bind({ updateUrl });
    bindRunListControls(params);
    if (!hasPlotly()) showBanner("plotly.js did not load from /static/plotly.min.js: charts are off, tables work.");
    if (params.get("run")) {
      state.selected = params.get("run");
      $("run-empty").textContent = "Loading " + state.selected + " …";
    }
    refreshNow();
  }

  start();
})();
