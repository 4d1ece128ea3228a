// Kiln's own tiny SVG line charts (no dependencies, nothing fetched): one <circle class="pt">
// per data point, so a page test can count points.
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
  // series: [{name, color, points: [[x, y], ...]}]
  function lineChart(container, title, series, xLabel) {
    var W = 340, H = 190, L = 52, R = 10, T = 10, B = 28;
    var box = document.createElement("div");
    box.className = "chart";
    var head = document.createElement("div");
    head.className = "title";
    head.textContent = title;
    box.appendChild(head);
    var all = [];
    series.forEach(function (s) { s.points.forEach(function (p) { if (isFinite(p[1])) all.push(p); }); });
    var svg = el("svg", { viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": title }, box);
    if (!all.length) {
      el("text", { x: W / 2, y: H / 2, "text-anchor": "middle", fill: "#6b7385" }, svg).textContent = "no data yet";
      container.appendChild(box);
      return box;
    }
    var xs = all.map(function (p) { return p[0]; }), ys = all.map(function (p) { return p[1]; });
    var x0 = Math.min.apply(null, xs), x1 = Math.max.apply(null, xs);
    var y0 = Math.min.apply(null, ys), y1 = Math.max.apply(null, ys);
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    if (y0 === y1) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
    function sx(x) { return L + (x - x0) / (x1 - x0) * (W - L - R); }
    function sy(y) { return H - B - (y - y0) / (y1 - y0) * (H - T - B); }
    el("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#b8bfcc" }, svg);
    el("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#b8bfcc" }, svg);
    [y0, (y0 + y1) / 2, y1].forEach(function (v) {
      el("text", { x: L - 4, y: sy(v) + 4, "text-anchor": "end", "font-size": 10, fill: "#6b7385" }, svg).textContent = fmt(v);
    });
    [x0, x1].forEach(function (v) {
      el("text", { x: sx(v), y: H - B + 14, "text-anchor": "middle", "font-size": 10, fill: "#6b7385" }, svg).textContent = fmt(v);
    });
    el("text", { x: (L + W - R) / 2, y: H - 3, "text-anchor": "middle", "font-size": 10, fill: "#6b7385" }, svg).textContent = xLabel || "";
    series.forEach(function (s) {
      var pts = s.points.filter(function (p) { return isFinite(p[1]); });
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
    container.appendChild(box);
    return box;
  }
  global.KilnCharts = { lineChart: lineChart, fmt: fmt };
})(window);
