// fp8mon dashboard, run comparison: tick 2-8 runs in the run list, then one view with their scalars overlaid, a
// layer x step difference heatmap of two of them, and the parity view: runs paired by a config key (precision,
// with everything else equal) and each pair's loss gap over steps. `?compare=a&compare=b` opens it; `?parity=all`
// pairs every listed run.
"use strict";

window.fp8monCompare = (function () {
  const MAX_RUNS = 8;
  const SERIES_POINTS = 1500;
  const HEATMAP_COLUMNS = 600;
  const COLOURS = ["#1d4fa8", "#d93025", "#188038", "#e08a00", "#6b4fbb", "#00838f", "#c2185b", "#5f6368"];
  const PREFERRED_SCALARS = ["loss", "grad_norm", "lr", "tokens_per_s"];

  const { $, runPath, api, fmt, el, showMessage, drawChart, blankChart, errorMessage, num } = window.fp8mon;
  const params = new URLSearchParams(window.location.search);
  const picked = new Set(params.getAll("compare").slice(0, MAX_RUNS));
  const view = { open: false, mode: "runs", request: 0, runs: [], stamp: null }; // stamp: the data drawn

  // ---- ticking runs in the run list ------------------------------------------------------------------------

  function decorate(item, run) {
    const box = el("input", { cls: "compare-pick", title: "compare this run" });
    box.type = "checkbox";
    box.checked = picked.has(run.name);
    box.setAttribute("aria-label", "compare " + run.name);
    box.addEventListener("click", (event) => event.stopPropagation()); // ticking is not opening the run
    box.addEventListener("change", () => {
      if (box.checked && picked.size >= MAX_RUNS) {
        box.checked = false;
        showMessage("run-list-message", `At most ${MAX_RUNS} runs can be compared.`, true);
        return;
      }
      if (box.checked) picked.add(run.name);
      else picked.delete(run.name);
      updateBar();
    });
    item.prepend(box);
    item.addEventListener("click", () => close());
  }

  function updateBar() {
    const n = picked.size;
    $("compare-count").textContent = n ? `${n} run${n === 1 ? "" : "s"} ticked` : "tick 2–8 runs to compare them";
    $("compare-open").disabled = n < 2;
    $("compare-clear").hidden = n === 0;
  }

  function clearPicked() {
    picked.clear();
    for (const box of document.querySelectorAll(".compare-pick")) box.checked = false;
    updateBar();
  }

  // ---- opening and closing ---------------------------------------------------------------------------------

  function setUrl(compare, parity) {
    const url = new URL(window.location.href);
    url.searchParams.delete("compare");
    url.searchParams.delete("parity");
    for (const name of compare) url.searchParams.append("compare", name);
    if (parity) url.searchParams.set("parity", parity);
    window.history.replaceState(null, "", url.pathname + url.search);
  }

  function show(mode) {
    view.open = true;
    view.mode = mode;
    document.body.classList.add("comparing");
    $("compare-view").hidden = false;
    $("compare-scalars-panel").hidden = mode !== "runs";
    $("compare-diff-panel").hidden = mode !== "runs";
    $("compare-title").textContent = mode === "runs" ? `Compare ${picked.size} runs` : "FP8 vs BF16 parity";
    load();
  }

  function open() {
    if (picked.size < 2) return;
    setUrl([...picked], null);
    show("runs");
  }

  function openParity() {
    setUrl([], "all");
    show("parity");
  }

  function close() {
    if (!view.open) return;
    view.open = false;
    view.request += 1;
    setUrl([], null);
    document.body.classList.remove("comparing");
    $("compare-view").hidden = true;
  }

  // ---- loading ---------------------------------------------------------------------------------------------

  async function load() {
    const request = ++view.request;
    const current = () => request === view.request && view.open;
    if (view.mode === "parity") {
      $("compare-runs").replaceChildren();
      await drawParity(current);
      return;
    }
    const names = [...picked];
    let details;
    try {
      details = await Promise.all(names.map(async (name) => {
        const [run, catalogue] = await Promise.all([api(`/runs/${runPath(name)}`),
          api(`/runs/${runPath(name)}/catalogue`)]);
        return { name, run, catalogue };
      }));
    } catch (err) {
      if (current()) showMessage("compare-scalar-message", errorMessage(err), true);
      return;
    }
    if (!current()) return;
    view.runs = details;
    view.stamp = runsStamp(details.map((d) => d.run));
    $("compare-runs").replaceChildren(...details.map((d, i) => chip(d.name, COLOURS[i % COLOURS.length])));
    fillControls(details);
    await Promise.all([drawScalars(current), drawDifference(current), drawParity(current)]);
  }

  function chip(name, colour) {
    const remove = el("button", { cls: "chip-remove", text: "×", title: "leave " + name + " out" });
    remove.type = "button";
    remove.addEventListener("click", () => {
      picked.delete(name);
      for (const box of document.querySelectorAll(".compare-pick")) {
        if (box.closest(".run-item")?.dataset.run === name) box.checked = false;
      }
      updateBar();
      if (picked.size < 2) close();
      else open();
    });
    const swatch = el("span", { cls: "swatch" });
    swatch.style.background = colour;
    return el("li", { cls: "compare-chip", data: { run: name } }, [swatch, el("span", { text: name }), remove]);
  }

  function fillSelect(id, values, preferred, labels = null) {
    const select = $(id);
    const before = select.value;
    select.replaceChildren(...values.map((v, i) => {
      const option = el("option", { text: labels ? labels[i] : v });
      option.value = v;
      return option;
    }));
    const want = values.includes(before) ? before : preferred;
    select.value = values.includes(want) ? want : (values[0] || "");
  }

  function fillControls(details) {
    const scalars = [...new Set(details.flatMap((d) => d.catalogue.scalars))];
    scalars.sort((a, b) => rank(a) - rank(b) || a.localeCompare(b));
    fillSelect("compare-scalar", scalars, "loss");
    const names = details.map((d) => d.name);
    fillSelect("compare-base", names, names[0]);
    fillSelect("compare-other", names, names[1]);
    if ($("compare-other").value === $("compare-base").value) $("compare-other").value = names[1];
    const stats = details[0].catalogue.stats;
    const sites = [...new Set(details.flatMap((d) => d.catalogue.sites))];
    fillSelect("compare-stat", stats, "kurtosis");
    fillSelect("compare-site", sites, "input");
  }

  function rank(scalar) {
    const i = PREFERRED_SCALARS.indexOf(scalar);
    return i < 0 ? PREFERRED_SCALARS.length : i;
  }

  // ---- overlaid scalars ------------------------------------------------------------------------------------

  async function drawScalars(current) {
    const scalar = $("compare-scalar").value;
    if (!scalar) {
      blankChart("compare-scalar-chart");
      showMessage("compare-scalar-message", "These runs report no scalar.");
      return;
    }
    const names = view.runs.map((d) => d.name);
    const read = await Promise.all(names.map((name) => api(`/runs/${runPath(name)}/series`,
      { params: { scalar, max_points: SERIES_POINTS } }).catch(() => null)));
    if (!current() || scalar !== $("compare-scalar").value) return;
    const traces = [];
    const missing = [];
    read.forEach((series, i) => {
      if (!series || !series.points.step.length) {
        missing.push(names[i]);
        return;
      }
      const p = series.points;
      traces.push({ type: "scatter", mode: "lines", name: names[i], x: p.step, y: (p.value || p.mean).map(num),
        line: { color: COLOURS[i % COLOURS.length], width: 1.5 } });
    });
    showMessage("compare-scalar-message", missing.length ? `No ${scalar} in ${missing.join(", ")}.` : "");
    if (!traces.length) {
      blankChart("compare-scalar-chart");
      return;
    }
    drawChart("compare-scalar-chart", traces, {
      uirevision: "compare:" + names.join("|"), margin: { l: 56, r: 16, t: 10, b: 40 },
      xaxis: { title: { text: "step" }, tickformat: "d", hoverformat: "d" },
      yaxis: { title: { text: scalar }, type: $("compare-logy").checked ? "log" : "linear" },
      legend: { orientation: "h", x: 0, y: 1.15 }, hovermode: "x unified",
    });
  }

  // ---- difference heatmap ----------------------------------------------------------------------------------

  async function drawDifference(current) {
    const base = $("compare-base").value;
    const other = $("compare-other").value;
    const stat = $("compare-stat").value;
    const site = $("compare-site").value;
    const mode = $("compare-mode").value;
    if (!base || !other || base === other || !stat || !site) {
      blankChart("compare-diff-chart");
      showMessage("compare-diff-message", "Pick two different runs.");
      return;
    }
    let diff;
    try {
      diff = await api("/compare/heatmap", { params: { base, other, stat, site, mode,
        max_points: HEATMAP_COLUMNS } });
    } catch (err) {
      if (current()) {
        blankChart("compare-diff-chart");
        showMessage("compare-diff-message", errorMessage(err), true);
      }
      return;
    }
    if (!current() || base !== $("compare-base").value || other !== $("compare-other").value
        || stat !== $("compare-stat").value || site !== $("compare-site").value) return;
    if (!diff.layers.length || diff.edges.length < 2) {
      blankChart("compare-diff-chart");
      showMessage("compare-diff-message", `No ${stat} at the ${site} site over steps and layers both runs have.`);
      return;
    }
    const columns = diff.edges.slice(0, -1).map((_, c) => c).filter((c) => diff.values.some((r) => r[c] !== null));
    const centre = (c) => (diff.edges[c] + diff.edges[c + 1] - 1) / 2;
    const z = diff.values.map((row) => columns.map((c) => num(row[c])));
    const extent = Math.max(1e-12, ...z.flat().filter((v) => v !== null).map(Math.abs));
    const label = mode === "difference" ? `${stat}: ${other} − ${base}` : `log₁₀(${other} / ${base})`;
    const traces = [{
      type: "heatmap", x: columns.map(centre), y: diff.layers, z, colorscale: "RdBu", reversescale: true,
      zmin: -extent, zmax: extent, hoverongaps: false,
      colorbar: { title: { text: mode === "difference" ? "Δ " + stat : "log₁₀ ratio" }, thickness: 12 },
      hovertemplate: "%{y}<br>step %{x:d}<br>" + (mode === "difference" ? "Δ " : "log₁₀ ratio ")
        + "%{z:.4g}<extra></extra>",
    }];
    const only = Object.entries(diff.only_in).filter(([, layers]) => layers.length)
      .map(([run, layers]) => `${layers.length} layer(s) only in ${run}`);
    showMessage("compare-diff-message", `${label}, steps ${diff.edges[0]}–${diff.edges[diff.edges.length - 1] - 1}`
      + (diff.bucket_width > 1 ? `, ${diff.bucket_width} steps per column` : "") + "."
      + (only.length ? " " + only.join("; ") + "." : ""));
    $("compare-diff-chart").style.height = Math.max(240, Math.min(1400, 60 + 14 * diff.layers.length)) + "px";
    drawChart("compare-diff-chart", traces, {
      uirevision: "diff:" + base + "|" + other, margin: { l: 10, r: 10, t: 10, b: 40 },
      xaxis: { title: { text: "step" }, tickformat: "d" },
      yaxis: { autorange: "reversed", automargin: true, type: "category" }, showlegend: false,
    });
  }

  // ---- parity ----------------------------------------------------------------------------------------------

  function parityParams() {
    const out = { key: $("parity-key").value || null };
    if (view.mode === "runs") {
      out.run = view.runs.map((d) => d.name);
      return out;
    }
    const words = [];
    out.tag = [];
    const search = $("run-filter").value || params.get("q") || ""; // (the run list may not have read ?q= yet)
    for (const word of search.trim().split(/\s+/).filter(Boolean)) {
      (word.includes("=") ? out.tag : words).push(word);
    }
    out.name = words.join(" ") || null;
    return out;
  }

  function readParity() {
    const query = new URLSearchParams();
    for (const [key, value] of Object.entries(parityParams())) {
      for (const v of [].concat(value)) if (v !== null && v !== undefined) query.append(key, v);
    }
    return api("/compare/parity?" + query.toString());
  }

  async function drawParity(current, read = null) {
    let parity = read;
    try {
      parity = parity || await readParity();
    } catch (err) {
      if (current()) showMessage("parity-message", errorMessage(err), true);
      return;
    }
    if (!current()) return;
    if (view.mode === "parity") view.stamp = JSON.stringify(parity);
    fillSelect("parity-key", parity.keys.length ? parity.keys : [parity.key], parity.key);
    $("parity-reference").textContent = parity.reference ? `gap: each run minus its ${parity.reference} twin` : "";
    renderParityTable(parity);
    if (!parity.pairs.length) {
      blankChart("parity-chart");
      showMessage("parity-message", `No two runs are equal but for ${parity.key}.`
        + (parity.unpaired.length ? ` Unpaired: ${parity.unpaired.slice(0, 10).join(", ")}` : ""));
      return;
    }
    const traces = parity.pairs.map((pair, i) => ({
      type: "scatter", mode: "lines", name: `${pair.other} − ${pair.reference}`, x: pair.gap.step,
      y: pair.gap.gap.map(num), line: { color: COLOURS[i % COLOURS.length], width: 1.5 },
    }));
    const more = parity.more_pairs ? ` (${parity.more_pairs} more pairs not drawn)` : "";
    showMessage("parity-message", `${parity.pairs.length} pair(s) by ${parity.key}${more}: the loss gap over the `
      + "steps both runs have; above 0, the run does worse than its reference twin.");
    drawChart("parity-chart", traces, {
      uirevision: "parity:" + parity.key, margin: { l: 56, r: 16, t: 10, b: 40 },
      xaxis: { title: { text: "step" }, tickformat: "d", hoverformat: "d" },
      yaxis: { title: { text: "loss gap" }, zeroline: true },
      legend: { orientation: "h", x: 0, y: 1.2 }, hovermode: "x unified",
    });
  }

  function renderParityTable(parity) {
    const table = $("parity-table");
    table.hidden = !parity.pairs.length;
    table.tBodies[0].replaceChildren(...parity.pairs.map((pair) => {
      const gaps = pair.gap.gap.filter((g) => typeof g === "number");
      const last = gaps.length ? gaps[gaps.length - 1] : null;
      const worst = gaps.length ? gaps.reduce((a, b) => (Math.abs(b) > Math.abs(a) ? b : a)) : null;
      return el("tr", { data: { other: pair.other } }, [
        el("td", { text: pair.reference }), el("td", { text: pair.other }), el("td", { text: pair.value }),
        el("td", { cls: "num", text: fmt(last, 3) }), el("td", { cls: "num", text: fmt(worst, 3) }),
      ]);
    }));
  }

  // ---- live refresh ----------------------------------------------------------------------------------------

  function runsStamp(runs) {
    return runs.map((run) => `${run.name}|${run.last_seen_at}|${run.last_step}`).join(";");
  }

  async function refresh() {
    // each interval of the dashboard's live refresh: the open view draws again when what it shows has new data
    // (its runs' last step or last data; the parity view: its pairs' gaps), keeping the zoom (uirevision)
    if (!view.open) return;
    const request = view.request;
    const current = () => request === view.request && view.open;
    try {
      if (view.mode === "runs") {
        const runs = await Promise.all(view.runs.map((d) => api(`/runs/${runPath(d.name)}`)));
        if (current() && runsStamp(runs) !== view.stamp) await load();
      } else {
        const parity = await readParity();
        if (current() && JSON.stringify(parity) !== view.stamp) await drawParity(current, parity);
      }
    } catch (err) {
      // the view keeps what it drew; load() and drawParity() show errors when the user asks
    }
  }

  // ---- start -----------------------------------------------------------------------------------------------

  function bind() {
    $("compare-open").addEventListener("click", open);
    $("compare-clear").addEventListener("click", clearPicked);
    $("parity-open").addEventListener("click", openParity);
    $("compare-close").addEventListener("click", close);
    const current = () => view.open;
    $("compare-scalar").addEventListener("change", () => drawScalars(current));
    $("compare-logy").addEventListener("change", () => drawScalars(current));
    for (const id of ["compare-base", "compare-other", "compare-stat", "compare-site", "compare-mode"]) {
      $(id).addEventListener("change", () => drawDifference(current));
    }
    $("parity-key").addEventListener("change", () => drawParity(current));
    updateBar();
    if (params.get("parity")) show("parity");
    else if (picked.size >= 2) show("runs");
  }

  bind();
  return { decorate, close, picked, refresh };
})();
