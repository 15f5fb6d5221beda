// fp8mon dashboard: the stored log2 histograms of one layer x site as a binade x step map, with the FP8 format's
// limits at the scale in use drawn over it: above the overflow line values saturate, at or below the underflow
// line they become zero, between that and the min-normal line they are subnormal.
"use strict";

(function () {
  const { $, api, runPath, fmt, showMessage, errorMessage, drawChart, blankChart } = window.fp8mon;
  const CHART = "histogram-chart";
  const COLUMNS = 300;
  const LINES = { overflow_log2: ["overflow", "#d93025", "solid"], underflow_log2: ["underflow (→ 0)", "#e08a00", "solid"],
    min_normal_log2: ["min normal", "#e08a00", "dot"] };

  async function draw(ctx, layer, site, rank) {
    // rank: a rank, or "worst": a histogram has no largest, so each step's are summed over the ranks
    const format = $("histogram-format").value;
    const summed = rank === "worst";
    let body;
    try {
      body = await api(`/runs/${runPath(ctx.name)}/histogram`, { params: { layer, site, max_points: COLUMNS,
        ...(summed ? { sum_over_ranks: true } : { rank }), format: format === "auto" ? null : format } });
    } catch (err) {
      if (!ctx.current()) return;
      blankChart(CHART);
      showMessage("histogram-message", errorMessage(err), true);
      return;
    }
    if (!ctx.current()) return;
    if (!body.step.length) {
      blankChart(CHART);
      showMessage("histogram-message", `No log2 histograms stored for ${layer} at the ${site} site on `
        + (summed ? "any rank" : `rank ${rank}`) + ": "
        + "the agent takes them with hist=True, every hist_every-th reporting step.");
      return;
    }
    const limits = body.limits;
    const what = limits ? `${limits.format.name.toUpperCase()} limits at the scale in use` : "no FP8 format at this "
      + "site: choose one to draw its limits";
    showMessage("histogram-message", `Share of the tensor's nonzero values per binade`
      + (summed ? ", all ranks' values together" : "") + `; ${what}.`
      + (body.per_column > 1 ? ` ${body.per_column} histogram steps summed per column.` : ""));
    drawChart(CHART, traces(body), layout(ctx.name, layer, site, span(body)));
  }

  function span(body) {
    // the binades holding values and the limit lines, not all 56 of them (2^-40 .. 2^16)
    const used = [];
    body.counts.forEach((column) => column.forEach((n, j) => { if (n) used.push(body.binade_lo + j); }));
    if (!used.length) return [body.binade_lo, body.binade_lo + body.bins];
    let lo = Math.min(...used);
    let hi = Math.max(...used) + 1;
    for (const key of Object.keys(LINES)) {
      for (const y of (body.limits ? body.limits[key] : [])) {
        lo = Math.min(lo, y);
        hi = Math.max(hi, y);
      }
    }
    return [Math.max(body.binade_lo, Math.floor(lo) - 2), Math.min(body.binade_lo + body.bins, Math.ceil(hi) + 2)];
  }

  function columnX(body) {
    return body.step.map((s, i) => (s + body.step_last[i]) / 2);
  }

  function traces(body) {
    const x = columnX(body);
    const binades = Array.from({ length: body.bins }, (_, j) => body.binade_lo + j + 0.5); // bin j spans [lo+j, lo+j+1)
    const shares = body.counts.map((column) => {
      const total = column.reduce((a, b) => a + b, 0);
      return column.map((n) => (total && n ? n / total : null));
    });
    const map = {
      type: "heatmap", name: "log2 histogram", x, y: binades,
      z: binades.map((_, j) => shares.map((column) => (column[j] === null ? null : Math.log10(column[j])))),
      customdata: binades.map((_, j) => shares.map((column, i) => [fmt(column[j] === null ? 0 : column[j], 3),
        body.counts[i][j], body.step[i] === body.step_last[i] ? body.step[i] : `${body.step[i]}–${body.step_last[i]}`,
        body.binade_lo + j, body.binade_lo + j + 1])),
      hovertemplate: "step %{customdata[2]}<br>2^%{customdata[3]} ≤ |x| < 2^%{customdata[4]}<br>"
        + "share %{customdata[0]} (%{customdata[1]} values)<extra></extra>",
      colorscale: "Viridis", hoverongaps: false, zmin: -6, zmax: 0,
      colorbar: { title: { text: "log₁₀ share" }, thickness: 12 },
    };
    const out = [map];
    if (body.limits) {
      const name = body.limits.format.name.toUpperCase();
      for (const [key, [label, colour, dash]] of Object.entries(LINES)) {
        out.push({ type: "scatter", mode: "lines", name: `${name} ${label}`, x, y: body.limits[key],
          line: { color: colour, width: 2, dash, shape: "hv" }, hovertemplate: `${name} ${label}: 2^%{y:.2f}<extra></extra>` });
      }
    }
    return out;
  }

  function layout(name, layer, site, range) {
    return {
      uirevision: `${name}|${layer}|${site}`,
      margin: { l: 56, r: 10, t: 10, b: 40 },
      xaxis: { title: { text: "step" } },
      yaxis: { title: { text: "log₂ |x|" }, range, dtick: range[1] - range[0] > 24 ? 4 : 2 },
      legend: { orientation: "h", x: 0, y: 1.12 },
    };
  }

  function clear() {
    blankChart(CHART);
    showMessage("histogram-message", "");
  }

  window.fp8mon.histogram = { draw, clear };
})();
