// fp8mon dashboard: one layer x site in detail, opened by a click on the heatmap (or picked here): every statistic
// the run reports there as its own small chart, all on one step axis, and the site's log2 histograms (histogram.js).
"use strict";

(function () {
  const { $, api, runPath, num, nonFinite, el, showMessage, errorMessage, drawChart, blankChart } = window.fp8mon;
  const POINTS = 600;
  const CHART = "detail-chart";
  const ROW_PX = 150;
  const NARROW_PX = 640; // below this width the small charts stack one per row

  const state = { layer: null, site: null, layersKey: "", sites: {}, updateUrl: () => {}, ctx: null,
    drawn: "" }; // the run's data and the layer last drawn: a poll without new data asks for nothing

  function fill(catalogue) {
    state.sites = Object.fromEntries(catalogue.layers.map((entry) => [entry.layer, entry.sites]));
    const key = catalogue.layers.map((entry) => entry.layer).join("\u0000");
    if (key !== state.layersKey) {
      state.layersKey = key;
      const choose = el("option", { text: "choose a layer…" });
      choose.value = "";
      $("detail-layer").replaceChildren(choose, ...catalogue.layers.map((entry) => el("option", { text: entry.layer })));
      const params = new URLSearchParams(window.location.search);
      if (!state.layer && params.get("layer") && state.sites[params.get("layer")]) {
        state.layer = params.get("layer");
        state.site = params.get("lsite");
      }
    }
    $("detail-layer").value = state.layer || "";
    fillSites();
  }

  function fillSites() {
    const sites = state.sites[state.layer] || [];
    $("detail-site").replaceChildren(...sites.map((s) => el("option", { text: s })));
    if (!sites.includes(state.site)) state.site = sites.includes("input") ? "input" : (sites[0] || null);
    $("detail-site").value = state.site || "";
    $("detail-site").disabled = !sites.length;
  }

  function open(layer, site) {
    state.layer = layer;
    state.site = site;
    $("detail-layer").value = layer;
    fillSites();
    state.updateUrl({ layer: state.layer, lsite: state.site });
    $("detail-panel").scrollIntoView({ block: "start" });
    if (state.ctx && state.ctx.current()) draw(state.ctx);
  }

  async function draw(ctx) {
    state.ctx = ctx;
    const { layer, site } = state;
    $("detail-title").textContent = layer ? `${layer} · ${site}` : "";
    if (!layer || !site) {
      blankChart(CHART);
      showMessage("detail-message", "Click a cell of the heatmap, or choose a layer here, for its statistics and "
        + "its log2 histograms.");
      window.fp8mon.histogram.clear();
      return;
    }
    const { rankParams, rankLabel } = window.fp8mon.heatmap;
    const chosen = $("heatmap-rank").value;
    const stats = ctx.catalogue.stats;
    const key = JSON.stringify([ctx.name, ctx.stamp, layer, site, chosen, stats, $("histogram-format").value]);
    if (key === state.drawn) return;
    const base = `/runs/${runPath(ctx.name)}/series`;
    let all;
    try {
      all = await Promise.all(stats.map((stat) => api(base, { params: { stat, layer, site, ...rankParams(),
        max_points: POINTS } })));
    } catch (err) {
      if (!ctx.current()) return;
      blankChart(CHART);
      showMessage("detail-message", errorMessage(err), true);
      return;
    }
    if (!ctx.current() || layer !== state.layer || site !== state.site) return;
    state.drawn = key;
    const shown = all.filter((series) => series.points.step.length);
    if (!shown.length) {
      blankChart(CHART);
      showMessage("detail-message", `No statistics of ${layer} at the ${site} site on ${rankLabel(chosen)}.`);
    } else {
      const scope = chosen === "worst" ? `at each step the largest over ranks ${all[0].ranks.join(", ")}`
        : chosen === "-1" ? "merged over ranks" : "rank " + chosen;
      showMessage("detail-message", `${shown.length} statistics, ${scope}`
        + (shown[0].downsampled ? `; ${shown[0].bucket_width} steps per point (mean, min–max band).` : "."));
      const columns = $("detail-panel").clientWidth < NARROW_PX ? 1 : 3; // (the chart itself may be hidden)
      const rows = Math.ceil(shown.length / columns);
      $(CHART).style.height = rows * ROW_PX + 40 + "px";
      drawChart(CHART, shown.flatMap((series, i) => traces(series, i)), layout(ctx.name, shown, rows, columns));
    }
    await window.fp8mon.histogram.draw(ctx, layer, site, chosen || "0");
  }

  function axis(i) {
    return i === 0 ? "" : String(i + 1);
  }

  function traces(series, i) {
    const p = series.points;
    const xaxis = "x" + axis(i);
    const yaxis = "y" + axis(i);
    const centre = (p.value || p.mean).map(num);
    const out = [];
    if (!p.value) {
      out.push({ type: "scatter", mode: "lines", x: p.step, y: p.min.map(num), xaxis, yaxis, line: { width: 0 },
        hoverinfo: "skip", name: series.stat + " min" });
      out.push({ type: "scatter", mode: "lines", x: p.step, y: p.max.map(num), xaxis, yaxis, line: { width: 0 },
        fill: "tonexty", fillcolor: "rgba(47,111,219,0.2)", name: series.stat + " max" });
    }
    out.push({ type: "scatter", mode: "lines", name: series.stat, x: p.step, y: centre, xaxis, yaxis,
      line: { color: "#1d4fa8", width: 1.3 } });
    const raw = p.value || p.max;
    const bad = p.step.filter((_, k) => nonFinite(raw[k]));
    if (bad.length) { // drawn at the top of the chart: the value itself has no place on the axis
      const finite = centre.filter((v) => v !== null);
      const top = finite.length ? Math.max(...finite) : 0;
      out.push({ type: "scatter", mode: "markers", name: series.stat + " non-finite", x: bad,
        y: bad.map(() => top), xaxis, yaxis, marker: { symbol: "x", size: 9, color: "#d93025" } });
    }
    return out;
  }

  function layout(name, shown, rows, columns) {
    const out = {
      uirevision: name + "|" + state.layer + "|" + state.site,
      grid: { rows, columns, pattern: "independent", ygap: 0.45, xgap: 0.12 },
      margin: { l: 50, r: 10, t: 24, b: 30 },
      showlegend: false,
      annotations: shown.map((series, i) => ({ text: series.stat, showarrow: false, xref: `x${axis(i)} domain`,
        yref: `y${axis(i)} domain`, x: 0, y: 1, xanchor: "left", yanchor: "bottom", font: { size: 12 } })),
    };
    shown.forEach((_, i) => {
      // one step axis: zooming one small chart zooms them all
      out["xaxis" + axis(i)] = i === 0 ? { tickfont: { size: 10 } } : { matches: "x", tickfont: { size: 10 } };
      out["yaxis" + axis(i)] = { tickfont: { size: 10 }, automargin: true };
    });
    return out;
  }

  function reset() {
    state.drawn = "";
    state.layer = null;
    state.site = null;
    state.layersKey = "";
    blankChart(CHART);
    window.fp8mon.histogram.clear();
  }

  function bind({ updateUrl }) {
    state.updateUrl = updateUrl;
    $("detail-layer").addEventListener("change", () => {
      state.layer = $("detail-layer").value || null;
      fillSites();
      updateUrl({ layer: state.layer, lsite: state.site });
      if (state.ctx && state.ctx.current()) draw(state.ctx);
    });
    $("histogram-format").addEventListener("change", () => {
      if (state.ctx && state.ctx.current()) draw(state.ctx);
    });
    $("detail-site").addEventListener("change", () => {
      state.site = $("detail-site").value;
      updateUrl({ layer: state.layer, lsite: state.site });
      if (state.ctx && state.ctx.current()) draw(state.ctx);
    });
  }

  window.fp8mon.drilldown = { bind, fill, open, draw, reset };
})();
