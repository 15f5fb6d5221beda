// fp8mon dashboard, shared helpers: the API client, number formatting, DOM helpers and chart drawing.
"use strict";

window.fp8mon = (function () {
  const API = "/api/v1";
  const TOKEN_KEY = "fp8mon.token";
  const PLOT_CONFIG = { displaylogo: false, responsive: true };

  const $ = (id) => document.getElementById(id);
  const drawn = new Map(); // chart id -> what it shows now

  // ---- the API -------------------------------------------------------------------------------------------

  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  function runPath(name) {
    return name.split("/").map(encodeURIComponent).join("/");
  }

  function token() {
    return sessionStorage.getItem(TOKEN_KEY) || "";
  }

  async function api(path, { method = "GET", params = {} } = {}) {
    const url = new URL(API + path, window.location.origin);
    for (const [key, value] of Object.entries(params)) {
      if (value !== undefined && value !== null) url.searchParams.append(key, value);
    }
    // X-Fp8mon-Client: the monitor refuses a state-changing request without it (a cross-site form cannot send it).
    const headers = { Accept: "application/json", "X-Fp8mon-Client": "dashboard" };
    if (token()) headers.Authorization = "Bearer " + token();
    let response;
    try {
      response = await fetch(url, { method, headers });
    } catch (err) {
      throw new ApiError(0, "cannot reach the monitor server (" + err.message + ")");
    }
    if (!response.ok) throw new ApiError(response.status, await errorText(response));
    return response.json();
  }

  async function errorText(response) {
    let detail = "";
    try {
      const body = await response.json();
      detail = typeof body.detail === "string" ? body.detail
        : (body.detail || []).map((d) => (d.loc || []).slice(1).join(".") + ": " + d.msg).join("; ");
    } catch (err) {
      detail = response.statusText;
    }
    return (detail || "error") + " (HTTP " + response.status + ")";
  }

  function isAuthError(err) {
    return err instanceof ApiError && (err.status === 401 || err.status === 403);
  }

  // The API writes NaN and infinities as strings; plotly needs numbers or null.
  function num(value) {
    return typeof value === "number" ? value : null;
  }

  function nonFinite(value) {
    return typeof value === "string";
  }

  function fmt(value, digits = 3) {
    if (value === null || value === undefined) return "–";
    if (typeof value === "string") return value;
    const abs = Math.abs(value);
    if (abs !== 0 && (abs >= 1e5 || abs < 1e-3)) return value.toExponential(2);
    return Number(value.toPrecision(digits)).toString();
  }

  // ---- small DOM helpers -----------------------------------------------------------------------------------

  function el(tag, { cls, text, title, data } = {}, children = []) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    if (title) node.title = title;
    for (const [key, value] of Object.entries(data || {})) node.dataset[key] = value;
    for (const child of children) node.append(child);
    return node;
  }

  function showMessage(id, text, isError = false) {
    const node = $(id);
    node.textContent = text || "";
    node.classList.toggle("error", Boolean(isError));
  }

  function showBanner(text) {
    $("banner").textContent = text || "";
    $("banner").hidden = !text;
  }

  function errorMessage(err) {
    return err instanceof ApiError ? err.message : "unexpected error: " + (err && err.message ? err.message : err);
  }

  function hasPlotly() {
    return typeof window.Plotly !== "undefined";
  }

  function drawChart(id, traces, layout, signature = JSON.stringify([traces, layout])) {
    // `signature`: what the chart shows, when the caller has a cheaper one than its whole figure
    const node = $(id);
    if (!hasPlotly()) return;
    if (drawn.get(id) === signature) return; // a refresh without new data: no redraw
    drawn.set(id, signature);
    node.classList.remove("blank");
    window.Plotly.react(node, traces, layout, PLOT_CONFIG);
  }

  function blankChart(id) {
    const node = $(id);
    drawn.delete(id);
    if (hasPlotly()) window.Plotly.purge(node);
    node.classList.add("blank");
  }

  return { TOKEN_KEY, $, ApiError, runPath, api, isAuthError, num, nonFinite, fmt, el, showMessage, showBanner, errorMessage, hasPlotly, drawChart, blankChart };
})();
