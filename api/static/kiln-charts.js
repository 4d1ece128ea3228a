// Kiln's own tiny SVG line charts (no dependencies, nothing fetched): one <circle class="pt">
// per data point, so a page test can count points. Y ticks are round (1, 2 or 5 × 10^k apart);
// the left margin is measured from the widest tick label (<text class="ytick">), so no label is
// clipped. A chart of a feature that is off shows a note ("KL off") instead of a flat zero.
"use strict";
(function (global) {
  var NS = "http://www.w3.org/2000/svg";
  function el(name, attrs, parent) {
    var node = document.createElementNS(NS, name);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, String(attrs[k])); });
    if (parent) parent.appendChild(node);
    return node;
  }
  function fmt(v) {
    if (v === null || v === undefined || !isFinite(v)) return "-";
    return Number(v).toPrecision(4).replace(/\.?0+(e|$)/, "$1");
  }
  // Round axis ticks: a step of 1, 2 or 5 × 10^k giving about `count` intervals over [lo, hi].
  function niceTicks(lo, hi, count) {
    if (lo === hi) { var pad = Math.abs(lo) * 0.1 || 1; lo -= pad; hi += pad; }
    var raw = (hi - lo) / count, power = Math.pow(10, Math.floor(Math.log10(raw)));
    var step = [1, 2, 5, 10].map(function (m) { return m * power; }).filter(function (s) { return s >= raw; })[0];
    var first = Math.floor(lo / step + 1e-9) * step, last = Math.ceil(hi / step - 1e-9) * step;
    var decimals = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
    var ticks = [];
    for (var v = first; v <= last + step / 2; v += step) ticks.push(Number(v.toFixed(decimals)));
    return { ticks: ticks, decimals: decimals };
  }
  function tickLabel(v, decimals) {
    return Math.abs(v) >= 1e6 ? Number(v).toExponential(1) : v.toFixed(decimals);
  }
  function note(svg, W, H, message, cls) {
    var t = el("text", { x: W / 2, y: H / 2, "text-anchor": "middle", fill: "#6b7385", "class": cls || "note" }, svg);
    t.textContent = message;
    return t;
  }
  // series: [{name, color, points: [[x, y], ...]}]; opts.off: a message shown instead of a chart
  // (a feature that is off draws no zeros).
  function lineChart(container, title, series, xLabel, opts) {
    var W = 340, H = 190, R = 14, T = 10, B = 28;
    var box = document.createElement("div");
    box.className = "chart";
    var head = document.createElement("div");
    head.className = "title";
    head.textContent = title;
    box.appendChild(head);
    container.appendChild(box);  // in the document first: the labels are measured below
    var svg = el("svg", { viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": title }, box);
    if (opts && opts.off) {
      box.classList.add("off");
      note(svg, W, H, opts.off, "off");
      return box;
    }
    var all = [];
    series.forEach(function (s) { s.points.forEach(function (p) { if (p[1] !== null && isFinite(p[1])) all.push(p); }); });
    if (!all.length) {
      note(svg, W, H, (opts && opts.empty) || "no data yet");  // empty: what an ended run says instead
      return box;
    }
    var xs = all.map(function (p) { return p[0]; }), ys = all.map(function (p) { return p[1]; });
    var x0 = Math.min.apply(null, xs), x1 = Math.max.apply(null, xs);
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    var axis = niceTicks(Math.min.apply(null, ys), Math.max.apply(null, ys), 4);
    var y0 = axis.ticks[0], y1 = axis.ticks[axis.ticks.length - 1];
    // The y labels first: the left margin is the widest label plus a gap, so none is clipped.
    var labels = axis.ticks.map(function (v) {
      var t = el("text", { "class": "ytick", "text-anchor": "end", "font-size": 10, fill: "#6b7385" }, svg);
      t.textContent = tickLabel(v, axis.decimals);
      return t;
    });
    var widest = Math.max.apply(null, labels.map(function (t) { return t.getComputedTextLength(); }));
    var L = Math.ceil(widest) + 10;
    function sx(x) { return L + (x - x0) / (x1 - x0) * (W - L - R); }
    function sy(y) { return H - B - (y - y0) / (y1 - y0) * (H - T - B); }
    labels.forEach(function (t, i) { t.setAttribute("x", L - 5); t.setAttribute("y", sy(axis.ticks[i]) + 3.5); });
    axis.ticks.forEach(function (v) {
      el("line", { x1: L, y1: sy(v), x2: W - R, y2: sy(v), stroke: "#eef0f4" }, svg);
    });
    el("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#b8bfcc" }, svg);
    el("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#b8bfcc" }, svg);
    [[x0, "start"], [x1, "end"]].forEach(function (pair) {
      el("text", { "class": "xtick", x: sx(pair[0]), y: H - B + 14, "text-anchor": pair[1], "font-size": 10, fill: "#6b7385" }, svg).textContent = fmt(pair[0]);
    });
    el("text", { x: (L + W - R) / 2, y: H - 3, "text-anchor": "middle", "font-size": 10, fill: "#6b7385" }, svg).textContent = xLabel || "";
    series.forEach(function (s) {
      var pts = s.points.filter(function (p) { return p[1] !== null && isFinite(p[1]); });
      var g = el("g", { "class": "series", "data-name": s.name }, svg);
      el("polyline", { points: pts.map(function (p) { return sx(p[0]) + "," + sy(p[1]); }).join(" "),
        fill: "none", stroke: s.color, "stroke-width": 1.6 }, g);
      pts.forEach(function (p) {
        var c = el("circle", { "class": "pt", cx: sx(p[0]), cy: sy(p[1]), r: 2.4, fill: s.color }, g);
        el("title", {}, c).textContent = s.name + " @" + p[0] + ": " + fmt(p[1]);
      });
    });
    if (series.length > 1) {
      var legend = document.createElement("div");
      legend.className = "muted";
      legend.textContent = series.map(function (s) { return "● " + s.name; }).join("   ");
      box.appendChild(legend);
    }
    return box;
  }
  global.KilnCharts = { lineChart: lineChart, fmt: fmt, niceTicks: niceTicks };
})(window);
