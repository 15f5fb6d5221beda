// fp8mon dashboard: the layer x step heatmap. Statistic, site, rank and bucket choice; every layer or the worst k
// (the server ranks them); rows tall enough to read, each named on hover; a step zoom that asks the server for finer
// buckets; a click on a cell opens that layer's detail (drilldown.js).
"use strict";

(function () {
  const { $, api, runPath, num, nonFinite, el, showMessage, errorMessage, drawChart, blankChart } = window.fp8mon;
  const COLUMNS = 600;
  const DIGITS = 4; // what a hover shows and a colour can tell apart: longer numbers only cost transfer and parsing
  const ROW_PX = 16; // one label of 10 px type per row
  const MIN_HEIGHT = 240;
  const MANY_LAYERS = 64; // above this many layers at a site, the map opens on the worst ones
  const DEFAULT_WORST = "32";
  const PREFERRED_STATS = ["kurtosis", "amax", "underflow_frac", "overflow_frac", "rms", "outlier_frac", "crest",
    "nonfinite", "scale"];
  // Statistics spanning decades (kurtosis 3 -> 1000s): a log colour scale keeps the healthy layers readable.
  const LOG_STATS = new Set(["kurtosis", "kurtosis_central", "amax", "rms", "crest", "scale", "amax_history_max"]);
  const NONFINITE_COLOUR = "#d93025";

  const state = {
    catalogueKey: "",
    rankKey: "",
    layersAt: {}, // site -> layers reporting it
    zoom: null, // [first, last] step asked for, null: the whole run
    rowsChosen: false, // the user (or the URL) picked the rows: no automatic switch
    ctx: null, // the run being drawn (from dashboard.js)
    drawn: "", // the run's data and the choice last drawn: a poll without new data asks for nothing
    onCell: () => {},
    updateUrl: () => {},
  };

  function urlParam(key) {
    return new URLSearchParams(window.location.search).get(key);
  }

  function fillSelect(id, values, preferred) {
    const select = $(id);
    select.replaceChildren(...values.map((v) => el("option", { text: v })));
    select.value = values.includes(preferred) ? preferred : (values[0] || "");
  }

  function fillSelectors(catalogue) {
    state.layersAt = {};
    for (const entry of catalogue.layers) {
      for (const site of entry.sites) (state.layersAt[site] = state.layersAt[site] || []).push(entry.layer);
    }
    const key = catalogue.stats.join(",") + "|" + catalogue.sites.join(",");
    if (key === state.catalogueKey) return;
    state.catalogueKey = key;
    const stats = [...PREFERRED_STATS.filter((s) => catalogue.stats.includes(s)),
      ...catalogue.stats.filter((s) => !PREFERRED_STATS.includes(s))];
    fillSelect("heatmap-stat", stats, urlParam("stat") || $("heatmap-stat").value || "kurtosis");
    fillSelect("heatmap-site", catalogue.sites, urlParam("site") || $("heatmap-site").value || "input");
    $("heatmap-log").checked = LOG_STATS.has($("heatmap-stat").value);
    const rows = urlParam("rows");
    state.rowsChosen = Boolean(rows);
    $("heatmap-rows").value = rows && [...$("heatmap-rows").options].some((o) => o.value === rows) ? rows : "all";
    defaultRows();
  }

  function defaultRows() {
    // hundreds of layers: a planted anomaly is one pixel high in the full map, so open on the worst ones
    if (state.rowsChosen) return;
    const many = (state.layersAt[$("heatmap-site").value] || []).length > MANY_LAYERS;
    $("heatmap-rows").value = many ? DEFAULT_WORST : "all";
  }

  function fillRanks(ranks) {
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
    const asked = urlParam("rank");
    const fallback = ranks.includes(-1) ? "-1" : ranks.includes(0) ? "0" : (values[0] || "0");
    select.value = values.includes(asked) ? asked : fallback;
    select.disabled = options.length < 2;
  }

  function rankParams() {
    // the API's parameters for the chosen rank: the heatmap, a layer's series and the scalar panels follow it
    const value = $("heatmap-rank").value || "0";
    return value === "worst" ? { worst_over_ranks: true } : { rank: value };
  }

  function rankLabel(value) {
    return value === "worst" ? "any rank" : value === "-1" ? "the merged rank (−1)" : "rank " + value;
  }

  function choice() {
    return { stat: $("heatmap-stat").value, site: $("heatmap-site").value, rank: $("heatmap-rank").value,
      agg: $("heatmap-agg").value, rows: $("heatmap-rows").value, zoom: JSON.stringify(state.zoom) };
  }

  async function draw(ctx) {
    state.ctx = ctx;
    const asked = choice();
    const { stat, site, rank, rows } = asked;
    const key = JSON.stringify([ctx.name, ctx.stamp, asked, $("heatmap-log").checked]);
    if (key === state.drawn) return;
    if (!stat || !site) {
      blankChart("heatmap-chart");
      showMessage("heatmap-message", "No per-layer statistics in this run yet.");
      return;
    }
    const params = { stat, site, agg: asked.agg, max_points: COLUMNS, digits: DIGITS, ...rankParams() };
    if (rows !== "all") params.top = rows;
    if (state.zoom) [params.start, params.end] = state.zoom;
    let heatmap;
    try {
      heatmap = await api(`/runs/${runPath(ctx.name)}/heatmap`, { params });
    } catch (err) {
      if (!ctx.current()) return;
      blankChart("heatmap-chart");
      showMessage("heatmap-message", errorMessage(err), true);
      return;
    }
    if (!ctx.current() || JSON.stringify(asked) !== JSON.stringify(choice())) {
      return; // the user switched while this was loading; the newer request draws
    }
    state.drawn = key;
    const empty = emptyReason(heatmap, stat, site, rank);
    if (empty) {
      blankChart("heatmap-chart");
      showMessage("heatmap-message", empty);
      return;
    }
    showMessage("heatmap-message", describe(heatmap, rank));
    const height = Math.max(MIN_HEIGHT, heatmap.layers.length * ROW_PX + 70);
    $("heatmap-chart").style.height = height + "px"; // the box scrolls past 70% of the window (CSS)
    performance.mark("fp8mon:heatmap-draw-start"); // bench/dashboard.py reads the measure: the browser's part
    drawChart("heatmap-chart", traces(heatmap), layout(ctx.name, height, heatmap.layers), key);
    performance.measure("fp8mon:heatmap-draw", "fp8mon:heatmap-draw-start");
    performance.clearMarks("fp8mon:heatmap-draw-start");
    bindChartEvents();
  }

  function describe(heatmap, rank) {
    const parts = [];
    if (heatmap.top !== null && heatmap.top !== undefined) {
      parts.push(`The ${heatmap.layers.length} of ${heatmap.layer_count} layers with the largest ${heatmap.stat}, `
        + "worst first.");
    }
    if (rank === "worst") parts.push(`Each cell: the largest over ranks ${heatmap.ranks.join(", ")}.`);
    if (heatmap.downsampled) parts.push(`${heatmap.bucket_width} steps per column (${heatmap.agg} of each bucket).`);
    if (state.zoom) parts.push(`Steps ${state.zoom[0]}–${state.zoom[1]} (double-click the map for the whole run).`);
    parts.push("Click a cell or a layer's name for its statistics.");
    return parts.join(" ");
  }

  function emptyReason(heatmap, stat, site, rank) {
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

  function traces(heatmap) {
    const log = $("heatmap-log").checked;
    const columns = reportedColumns(heatmap);
    const cell = (v) => {
      const value = num(v);
      if (!log || value === null) return value;
      return value > 0 ? Math.log10(value) : null;
    };
    const first = (c) => heatmap.edges[c];
    const last = (c) => heatmap.edges[c + 1] - 1;
    // Each column at the centre of its whole bucket (a partial first or last bucket too): evenly spaced columns let
    // plotly paint one pixel per cell and scale the image, instead of a rectangle per cell on a plot-sized canvas
    // (most of a switch's drawing time).
    const width = heatmap.bucket_width;
    const firstBucket = Math.floor(heatmap.start / width);
    const centre = (c) => (firstBucket + c) * width + (width - 1) / 2;
    const all = columns.length === heatmap.edges.length - 1;
    const steps = columns.map((c) => (first(c) === last(c) ? String(first(c)) : `${first(c)}–${last(c)}`));
    const trace = {
      type: "heatmap", name: heatmap.stat, x: columns.map(centre), y: heatmap.layers,
      z: heatmap.values.map((row) => columns.map((c) => cell(row[c]))),
      colorscale: "Viridis", hoverongaps: false,
      colorbar: { title: { text: (log ? "log₁₀ " : "") + heatmap.stat }, thickness: 12, len: 300, lenmode: "pixels",
        y: 1, yanchor: "top" },
      // hover: a column's steps (one array shared by every row) and the cell as the server sent it (4 significant
      // digits; NaN and infinities as words): nothing built per cell
      customdata: heatmap.layers.map(() => steps),
      text: all ? heatmap.values : heatmap.values.map((row) => columns.map((c) => row[c])),
      hovertemplate: "%{y}<br>step %{customdata}<br>" + heatmap.stat + " %{text}<extra></extra>",
    };
    const bad = { x: [], y: [] };
    heatmap.values.forEach((row, r) => columns.forEach((c) => {
      if (nonFinite(row[c])) {
        bad.x.push(centre(c));
        bad.y.push(heatmap.layers[r]);
      }
    }));
    const out = [trace];
    if (bad.x.length) {
      out.push({ type: "scatter", mode: "markers", name: "non-finite", ...bad, hoverinfo: "x+y+name",
        marker: { symbol: "x", size: 9, color: NONFINITE_COLOUR } });
    }
    return out;
  }

  function layout(name, height, labels) {
    const xaxis = { title: { text: "step" } };
    if (state.zoom) xaxis.range = [state.zoom[0], state.zoom[1]];
    else xaxis.autorange = true;
    return {
      uirevision: name, height,
      // the left margin from the longest label (10 px type): plotly's automargin measures every label on each draw,
      // most of a switch's time at a hundred layers
      margin: { l: 16 + 6.2 * Math.max(4, ...labels.map((label) => String(label).length)), r: 10, t: 10, b: 40 },
      xaxis,
      // every row keeps its label: dtick 1 on the category axis, and rows tall enough for the type
      yaxis: { autorange: "reversed", automargin: false, type: "category", dtick: 1, tickfont: { size: 10 } },
      showlegend: false,
    };
  }

  function labelClicked(event) {
    // a click on a row's label opens that layer too (plotly reports clicks on cells only)
    const tick = event.target.closest && event.target.closest(".ytick");
    if (tick && tick.textContent) state.onCell(tick.textContent, $("heatmap-site").value);
  }

  function bindChartEvents() {
    // bound after every draw: a blanked (purged) chart has lost its listeners
    const node = $("heatmap-chart");
    if (typeof node.on !== "function") return;
    node.removeAllListeners("plotly_relayout");
    node.removeAllListeners("plotly_click");
    node.on("plotly_relayout", zoomed);
    node.on("plotly_click", (event) => {
      const point = (event.points || []).find((p) => p.data.type === "heatmap") || (event.points || [])[0];
      if (point && point.y !== undefined) state.onCell(String(point.y), $("heatmap-site").value);
    });
  }

  function zoomed(event) {
    // a step zoom asks the server for that range: finer buckets than the whole run's
    let range;
    if (event["xaxis.range[0]"] !== undefined) range = [event["xaxis.range[0]"], event["xaxis.range[1]"]];
    else if (Array.isArray(event["xaxis.range"])) range = event["xaxis.range"];
    else if (event["xaxis.autorange"]) range = null;
    else return;
    const zoom = range ? [Math.max(0, Math.floor(range[0])), Math.max(0, Math.ceil(range[1]))] : null;
    if (JSON.stringify(zoom) === JSON.stringify(state.zoom)) return;
    state.zoom = zoom && zoom[1] > zoom[0] ? zoom : null;
    if (state.ctx) draw(state.ctx);
  }

  function reset() {
    state.drawn = "";
    state.catalogueKey = "";
    state.rankKey = "";
    state.zoom = null;
    blankChart("heatmap-chart");
  }

  function bind({ onCell, updateUrl, onRank }) {
    state.onCell = onCell;
    state.updateUrl = updateUrl;
    const redraw = () => {
      updateUrl({ stat: $("heatmap-stat").value, site: $("heatmap-site").value, rank: $("heatmap-rank").value,
        rows: state.rowsChosen ? $("heatmap-rows").value : null });
      if (state.ctx && state.ctx.current()) draw(state.ctx);
    };
    $("heatmap-stat").addEventListener("change", () => {
      $("heatmap-log").checked = LOG_STATS.has($("heatmap-stat").value);
      redraw();
    });
    $("heatmap-site").addEventListener("change", () => {
      defaultRows();
      redraw();
    });
    $("heatmap-rows").addEventListener("change", () => {
      state.rowsChosen = true;
      redraw();
    });
    for (const id of ["heatmap-agg", "heatmap-log"]) $(id).addEventListener("change", redraw);
    $("heatmap-rank").addEventListener("change", () => {
      updateUrl({ rank: $("heatmap-rank").value });
      onRank(); // the whole run view follows the rank: this map, the layer's series, the scalar panels
    });
    $("heatmap-chart").addEventListener("click", labelClicked);
  }

  window.fp8mon.heatmap = { bind, fillSelectors, fillRanks, draw, reset, rankParams, rankLabel };
})();
