// fp8mon dashboard: a run's overview. Status as the server reads it (a stalled run says since when), wall-clock
// start, end and last data, host, steps, ranks, layers, tags and the config the run reported.
"use strict";

(function () {
  const { $, el } = window.fp8mon;
  const HOST_KEYS = ["host", "hostname", "node"];

  function wallClock(iso) {
    if (!iso) return "–";
    const date = new Date(iso);
    return date.toLocaleString(undefined, { year: "numeric", month: "short", day: "numeric", hour: "2-digit",
      minute: "2-digit", second: "2-digit" });
  }

  function ago(iso) {
    if (!iso) return "";
    const seconds = Math.max(0, (Date.now() - new Date(iso).getTime()) / 1000);
    return "(" + duration(seconds) + " ago)";
  }

  function duration(seconds) {
    if (seconds < 10) return Number(seconds.toPrecision(2)) + " s";
    if (seconds < 90) return Math.round(seconds) + " s";
    if (seconds < 5400) return Math.round(seconds / 60) + " min";
    if (seconds < 172800) return (seconds / 3600).toFixed(1) + " h";
    return (seconds / 86400).toFixed(1) + " d";
  }

  function statusText(run) {
    if (run.status === "stalled") {
      const usual = run.report_interval_s ? `; it usually reports every ${duration(run.report_interval_s)}` : "";
      return `stalled: no data since ${wallClock(run.last_seen_at)} ${ago(run.last_seen_at)}${usual}`;
    }
    if (run.status === "diverged" && run.reported_status === "running") {
      return "diverged: the loss met the divergence rule (the trainer still reports running)";
    }
    return run.status;
  }

  function host(run) {
    for (const source of [run.tags || {}, run.config || {}]) {
      for (const key of HOST_KEYS) if (typeof source[key] === "string") return source[key];
    }
    return "not reported";
  }

  function item(label, value, { cls, title } = {}) {
    return [el("dt", { text: label }), el("dd", { cls, title, text: value })];
  }

  function configValue(value) {
    if (typeof value === "string") return value;
    if (Array.isArray(value) && value.every((v) => typeof v === "string")) return value.join(" "); // a command line
    return JSON.stringify(value);
  }

  function render(run, catalogue) {
    const layers = catalogue.layers.length;
    const ranks = catalogue.ranks.map((r) => (r === -1 ? "merged" : String(r))).join(", ") || "–";
    const ended = run.ended_at ? wallClock(run.ended_at) : "–";
    $("run-overview").replaceChildren(...[
      ...item("status", statusText(run), { cls: "overview-status status-" + run.status }),
      ...item("started", wallClock(run.started_at), { title: run.started_at || "" }),
      ...item("ended", ended, { title: run.ended_at || "" }),
      ...item("last data", `${wallClock(run.last_seen_at)} ${ago(run.last_seen_at)}`,
        { cls: "overview-last-seen", title: run.last_seen_at || "" }),
      ...item("host", host(run)),
      ...item("steps", run.last_step === null ? "none yet" : `${run.first_step}–${run.last_step}`),
      ...item("ranks", ranks),
      ...item("layers", `${layers} (${catalogue.sites.join(", ") || "no sites"})`),
    ]);
    const tags = Object.entries(run.tags || {});
    $("run-tags").replaceChildren(...(tags.length ? tags.map(([k, v]) => el("span", { cls: "tag",
      text: `${k}=${configValue(v)}` })) : [el("span", { cls: "muted", text: "no tags" })]));
    const config = Object.entries(run.config || {});
    $("run-config").replaceChildren(...config.map(([k, v]) => el("tr", {}, [el("th", { text: k }),
      el("td", { text: configValue(v) })])));
    $("run-config-box").hidden = !config.length;
  }

  window.fp8mon.overview = { render };
})();
