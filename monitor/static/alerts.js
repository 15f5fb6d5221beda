// fp8mon dashboard, the alerts panel of a run: one row per rule with its layers, a severity filter (warning
// and above by default), sorting, acknowledge / un-acknowledge / acknowledge all, a timeline with one row per
// rule, and the chart markers of the scalar panels, each coloured by the alert's severity at its step.
"use strict";

window.fp8monAlerts = (function () {
  const LIMIT = 1000; // the API's page limit: every alert of any run we have seen
  const COLOURS = { info: "#2f6fdb", warning: "#e08a00", critical: "#d93025" };
  const RANK = { info: 1, warning: 2, critical: 3 };
  const SEVERITIES = ["info", "warning", "critical"];
  const LAYERS_SHOWN = 6;

  const { $, ApiError, runPath, api, el, showMessage, drawChart, blankChart, errorMessage } = window.fp8mon;
  const view = { run: null, alerts: [], total: 0, open: new Set(), bound: false };

  // ---- steps and severities ----------------------------------------------------------------------------------

  function stepText(step) {
    return step === null || step === undefined ? "–" : String(step); // exact: 120350, never 1.20e+5
  }

  function alertEnd(alert) {
    return alert.resolved_step ?? alert.last_step ?? alert.first_step;
  }

  function lower(severity) {
    return SEVERITIES[Math.max(0, RANK[severity] - 2)];
  }

  function escalations(alert) {
    // Every rise of severity after firing, [{step, severity, from}] in step order. A server that keeps only the
    // last rise (escalated_step) gives one, from one level below (the level it rose from is not known then).
    if (Array.isArray(alert.escalations) && alert.escalations.length) return alert.escalations;
    if (alert.escalated_step === null || alert.escalated_step === undefined) return [];
    return [{ step: alert.escalated_step, severity: alert.severity, from: null }];
  }

  function severityAt(alert, step) {
    const rises = escalations(alert);
    if (!rises.length) return alert.severity;
    let severity = rises[0].from || lower(rises[0].severity);
    for (const rise of rises) if (rise.step <= step) severity = rise.severity;
    return severity;
  }

  function floor() {
    return $("alert-severity") ? $("alert-severity").value : "warning";
  }

  function shown(alerts) {
    const min = RANK[floor()] || 1;
    return alerts.filter((a) => RANK[a.severity] >= min);
  }

  function where(alert) {
    return alert.layer ? `${alert.layer}${alert.site ? " " + alert.site : ""}` : "model";
  }

  // ---- chart markers ---------------------------------------------------------------------------------------

  function markerEvents(alerts) {
    // A marker where an alert fired and where it escalated, each coloured by the severity it had then; one
    // marker per step, coloured by its worst: dozens of layer alerts often fire together.
    const groups = new Map();
    const add = (step, severity, line) => {
      const group = groups.get(step) || { step, severity: "info", lines: [] };
      if (RANK[severity] > RANK[group.severity]) group.severity = severity;
      group.lines.push(line);
      groups.set(step, group);
    };
    for (const alert of shown(alerts)) {
      if (alert.fired_step !== null && alert.fired_step !== undefined) {
        const severity = severityAt(alert, alert.fired_step);
        add(alert.fired_step, severity, `${severity} fired: ${alert.message}`);
      }
      for (const rise of escalations(alert)) {
        add(rise.step, rise.severity, `escalated to ${rise.severity}: ${alert.message}`);
      }
    }
    return [...groups.values()].sort((a, b) => a.step - b.step);
  }

  function markerTraces(alerts) {
    const groups = markerEvents(alerts);
    if (!groups.length) return [];
    return [{
      type: "scatter", mode: "markers", name: "alerts fired", x: groups.map((g) => g.step),
      y: groups.map(() => 1), yaxis: "y2", cliponaxis: false,
      marker: { symbol: "triangle-down", size: 11, color: groups.map((g) => COLOURS[g.severity]) },
      text: groups.map((g) => `step ${g.step}<br>` + g.lines.slice(0, 8).join("<br>")
        + (g.lines.length > 8 ? `<br>… ${g.lines.length - 8} more` : "")),
      customdata: groups.map((g) => g.severity),
      hoverinfo: "text",
    }];
  }

  function markerShapes(alerts) {
    return markerEvents(alerts).map((g) => ({
      type: "line", xref: "x", yref: "paper", x0: g.step, x1: g.step, y0: 0, y1: 1,
      line: { color: COLOURS[g.severity], width: 1, dash: "dot" },
    }));
  }

  // ---- loading ---------------------------------------------------------------------------------------------

  async function load(name, isCurrent = () => true) {
    bindControls();
    let body;
    try {
      body = await api(`/runs/${runPath(name)}/alerts`, { params: { limit: LIMIT } });
    } catch (err) {
      if (isCurrent()) showMessage("alert-message", errorMessage(err), true);
      return [];
    }
    if (!isCurrent()) return [];
    if (view.run !== name) view.open.clear();
    view.run = name;
    view.alerts = body.alerts;
    view.total = body.total;
    render();
    return body.alerts;
  }

  function render() {
    const alerts = view.alerts;
    const visible = shown(alerts);
    const hidden = alerts.length - visible.length;
    const more = view.total > alerts.length ? ` The ${alerts.length} most recent of ${view.total}.` : "";
    const active = visible.filter((a) => a.state !== "resolved" && !a.acknowledged_at).length;
    $("alert-ack-all").disabled = active === 0;
    $("alert-ack-all").textContent = active ? `Acknowledge all (${active})` : "Acknowledge all";
    if (!alerts.length) {
      showMessage("alert-message", "No alerts for this run.");
    } else {
      const below = hidden ? ` ${hidden} below ${floor()} hidden.` : "";
      showMessage("alert-message", `${visible.length} alert${visible.length === 1 ? "" : "s"} in `
        + `${groupAlerts(visible).length} rule${groupAlerts(visible).length === 1 ? "" : "s"}.${below}${more}`);
    }
    drawTimeline(visible);
    renderGroups(visible);
  }

  // ---- one row per rule ------------------------------------------------------------------------------------

  function groupAlerts(alerts) {
    const groups = new Map();
    for (const alert of alerts) {
      const group = groups.get(alert.rule) || { rule: alert.rule, alerts: [], severity: "info", live: null,
        first: null, last: null, states: {} };
      group.alerts.push(alert);
      if (RANK[alert.severity] > RANK[group.severity]) group.severity = alert.severity;
      const live = alert.state !== "resolved" && !alert.acknowledged_at;
      if (live && (group.live === null || RANK[alert.severity] > RANK[group.live])) group.live = alert.severity;
      if (alert.first_step !== null && (group.first === null || alert.first_step < group.first)) {
        group.first = alert.first_step;
      }
      const end = alertEnd(alert);
      if (end !== null && (group.last === null || end > group.last)) group.last = end;
      const state = alert.acknowledged_at && alert.state !== "resolved" ? "acknowledged" : alert.state;
      group.states[state] = (group.states[state] || 0) + 1;
      groups.set(alert.rule, group);
    }
    return [...groups.values()];
  }

  // Worst first: what is firing or pending and not acknowledged ranks by its own severity, before what is over.
  const SORTS = {
    severity: (a, b) => (RANK[b.live] || 0) - (RANK[a.live] || 0) || activeCount(b) - activeCount(a)
      || RANK[b.severity] - RANK[a.severity] || (a.first ?? Infinity) - (b.first ?? Infinity),
    first: (a, b) => (a.first ?? Infinity) - (b.first ?? Infinity),
    recent: (a, b) => (b.last ?? -Infinity) - (a.last ?? -Infinity),
    count: (a, b) => b.alerts.length - a.alerts.length,
    rule: (a, b) => a.rule.localeCompare(b.rule),
  };

  function activeCount(group) {
    return group.alerts.filter((a) => a.state !== "resolved" && !a.acknowledged_at).length;
  }

  function renderGroups(alerts) {
    const table = $("alert-table");
    const groups = groupAlerts(alerts).sort(SORTS[$("alert-sort").value] || SORTS.severity);
    table.hidden = !groups.length;
    const rows = [];
    for (const group of groups) {
      rows.push(groupRow(group));
      if (view.open.has(group.rule)) {
        const byWorst = [...group.alerts].sort((a, b) => RANK[b.severity] - RANK[a.severity]
          || (a.first_step ?? 0) - (b.first_step ?? 0));
        rows.push(...byWorst.map(alertRow));
      }
    }
    table.tBodies[0].replaceChildren(...rows);
  }

  function groupRow(group) {
    const layers = [...new Set(group.alerts.map(where))];
    const listed = layers.slice(0, LAYERS_SHOWN).join(", ")
      + (layers.length > LAYERS_SHOWN ? ` … +${layers.length - LAYERS_SHOWN} more` : "");
    const states = ["firing", "pending", "acknowledged", "resolved"].filter((s) => group.states[s])
      .map((s) => `${group.states[s]} ${s}`).join(" · ");
    const open = view.open.has(group.rule);
    const toggle = el("button", { cls: "alert-toggle", text: (open ? "▾ " : "▸ ") + group.rule,
      title: open ? "hide this rule's alerts" : "show this rule's alerts" });
    toggle.type = "button";
    toggle.setAttribute("aria-expanded", String(open));
    toggle.addEventListener("click", () => {
      if (view.open.has(group.rule)) view.open.delete(group.rule);
      else view.open.add(group.rule);
      render();
    });
    const severity = group.live || group.severity; // a rule whose alerts are all over shows its worst, dimmed
    const title = group.live ? "the worst of its live alerts" : "none live: the worst it reached";
    return el("tr", { cls: "alert-group sev-" + severity + (group.live ? "" : " over"), data: { rule: group.rule } }, [
      el("td", {}, [toggle]),
      el("td", {}, [el("span", { cls: "badge sev-" + severity, text: severity, title })]),
      el("td", { cls: "alert-states", text: states }),
      el("td", { cls: "alert-layers", text: listed, title: layers.join("\n") }),
      el("td", { cls: "num", text: stepText(group.first) }),
      el("td", { cls: "num", text: stepText(group.last) }),
    ]);
  }

  function alertRow(alert) {
    const rises = escalations(alert);
    const severity = rises.length ? [severityAt(alert, rises[0].step - 1), ...rises.map((r) => r.severity)]
      .join(" → ") : alert.severity;
    const steps = `first ${stepText(alert.first_step)} · fired ${stepText(alert.fired_step)}`
      + rises.map((r) => ` · escalated ${stepText(r.step)}`).join("") + ` · last ${stepText(alertEnd(alert))}`;
    return el("tr", { cls: "alert-detail state-" + alert.state, data: { alertId: alert.id } }, [
      el("td", { cls: "alert-where", text: where(alert) }),
      el("td", {}, [el("span", { cls: "badge sev-" + alert.severity, text: severity })]),
      el("td", { cls: "state", text: alert.state + (alert.acknowledged_at ? " · acknowledged" : "") }),
      el("td", { cls: "alert-text", text: alert.message }),
      el("td", { cls: "alert-steps", text: steps }),
      el("td", {}, alert.state === "resolved" ? [] : [ackButton(alert)]),
    ]);
  }

  function ackButton(alert) {
    const acked = Boolean(alert.acknowledged_at);
    const button = el("button", { cls: acked ? "unack" : "ack", text: acked ? "Un-acknowledge" : "Acknowledge",
      title: acked ? "acknowledged at " + alert.acknowledged_at : "stop counting it among the run's firing alerts" });
    button.type = "button";
    button.addEventListener("click", () => change(button, `/alerts/${alert.id}/${acked ? "unack" : "ack"}`));
    return button;
  }

  async function change(button, path) {
    button.disabled = true;
    try {
      await api(path, { method: "POST" });
    } catch (err) {
      button.disabled = false;
      const why = err instanceof ApiError && err.status === 403 ? " (this needs a write token)" : "";
      showMessage("alert-message", "Could not change the acknowledgement: " + errorMessage(err) + why, true);
      return;
    }
    const run = view.run;
    await load(run, () => view.run === run);
    document.dispatchEvent(new CustomEvent("fp8mon:alerts-changed", { detail: { run } }));
  }

  function acknowledgeAll() {
    if (!view.run) return;
    const query = new URLSearchParams(); // one severity= per severity (api() sends a list as one value)
    for (const severity of SEVERITIES.filter((s) => RANK[s] >= (RANK[floor()] || 1))) {
      query.append("severity", severity);
    }
    change($("alert-ack-all"), `/runs/${runPath(view.run)}/alerts/ack?${query}`);
  }

  // ---- the timeline: one row per rule ----------------------------------------------------------------------

  function segments(alerts) {
    // Overlapping alerts of one rule and severity merge into one bar saying how many and which layers.
    const sorted = [...alerts].sort((a, b) => a.first_step - b.first_step);
    const out = [];
    for (const alert of sorted) {
      const end = Math.max(alertEnd(alert), alert.first_step);
      const last = out[out.length - 1];
      if (last && alert.first_step <= last.end + 1) {
        last.end = Math.max(last.end, end);
        last.alerts.push(alert);
      } else {
        out.push({ start: alert.first_step, end, alerts: [alert] });
      }
    }
    return out;
  }

  function segmentText(rule, severity, segment) {
    const layers = [...new Set(segment.alerts.map(where))];
    const firing = segment.alerts.filter((a) => a.state === "firing").length;
    return `${rule} · ${severity}<br>steps ${segment.start}–${segment.end}<br>${segment.alerts.length} alert(s)`
      + (firing ? `, ${firing} firing` : "") + "<br>" + layers.slice(0, 8).join("<br>")
      + (layers.length > 8 ? `<br>… +${layers.length - 8} more` : "");
  }

  function drawTimeline(alerts) {
    const timed = alerts.filter((a) => a.first_step !== null && a.first_step !== undefined);
    if (!timed.length) {
      blankChart("alert-chart");
      return;
    }
    const traces = [];
    for (const severity of ["info", "warning", "critical"]) { // the worst drawn last, on top
      const mine = timed.filter((a) => a.severity === severity);
      const bars = { y: [], base: [], x: [], text: [], opacity: [] };
      for (const rule of [...new Set(mine.map((a) => a.rule))]) {
        for (const segment of segments(mine.filter((a) => a.rule === rule))) {
          bars.y.push(rule);
          bars.base.push(segment.start);
          bars.x.push(Math.max(1, segment.end - segment.start + 1));
          bars.text.push(segmentText(rule, severity, segment));
          const live = segment.alerts.some((a) => a.state !== "resolved" && !a.acknowledged_at);
          bars.opacity.push(live ? 0.9 : 0.35);
        }
      }
      if (!bars.y.length) continue;
      traces.push({ type: "bar", orientation: "h", name: severity, y: bars.y, base: bars.base, x: bars.x,
        marker: { color: COLOURS[severity], opacity: bars.opacity }, text: bars.text, hoverinfo: "text",
        textposition: "none" });
    }
    const rules = new Set(timed.map((a) => a.rule)).size;
    const height = Math.min(640, 90 + 26 * rules);
    $("alert-chart").style.height = height + "px";
    drawChart("alert-chart", traces, {
      uirevision: view.run, barmode: "overlay", height,
      margin: { l: 10, r: 10, t: 10, b: 36 },
      xaxis: { title: { text: "step" }, tickformat: "d", hoverformat: "d" },
      yaxis: { automargin: true, autorange: "reversed", type: "category" },
      legend: { orientation: "h", x: 0, y: 1.12 },
    });
  }

  // ---- controls --------------------------------------------------------------------------------------------

  function bindControls() {
    if (view.bound || !$("alert-severity")) return;
    view.bound = true;
    const params = new URLSearchParams(window.location.search);
    if (SEVERITIES.includes(params.get("alerts"))) $("alert-severity").value = params.get("alerts");
    $("alert-severity").addEventListener("change", () => {
      const url = new URL(window.location.href);
      if ($("alert-severity").value === "warning") url.searchParams.delete("alerts");
      else url.searchParams.set("alerts", $("alert-severity").value);
      window.history.replaceState(null, "", url.pathname + url.search);
      render();
      document.dispatchEvent(new CustomEvent("fp8mon:alert-filter", { detail: { severity: floor() } }));
    });
    $("alert-sort").addEventListener("change", render);
    $("alert-ack-all").addEventListener("click", acknowledgeAll);
  }

  function reset() {
    view.run = null;
    view.alerts = [];
    view.open.clear();
    blankChart("alert-chart");
    $("alert-table").hidden = true;
  }

  return { load, reset, markerTraces, markerShapes, severityAt, stepText };
})();
