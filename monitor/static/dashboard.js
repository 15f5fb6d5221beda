// fp8mon dashboard: vanilla JS over the /api/v1 REST API, charts with the plotly.js served by the monitor.
"use strict";

(function () {
  const INTERVAL_KEY = "fp8mon.refresh";
  const RUN_PAGE = 50; // runs per "more"
  const RUN_LIMIT_MAX = 1000; // the API's page limit

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
    window.fp8monCompare.decorate(item, run); // the tick box that picks it for comparison
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
    const alerts = await window.fp8monAlerts.load(name, () => generation === state.generation);
    // the parts fetch again only when the run has new data (`stamp`) or the user changed what they show
    const view = { name, catalogue, current, stamp: `${run.last_seen_at}|${run.last_step}` };
    await Promise.all([
      scalars.draw(view, alerts, { traces: window.fp8monAlerts.markerTraces, layout: scalarLayout }),
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
      // the run list, the selected run and an open comparison at once: a first render waits for one round trip less
      const [listed] = await Promise.all([refreshRuns(), refreshRun(), window.fp8monCompare.refresh()]);
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
    scalars.bind();
    heatmap.bind({ updateUrl, onCell: (layer, site) => drilldown.open(layer, site), onRank: () => refreshRun() });
    drilldown.bind({ updateUrl });
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
