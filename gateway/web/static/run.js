// The run page's live curves: step points from the run's event stream, drawn with uPlot (vendored,
// see README). One chart per family of metrics; a chart is rebuilt when a new metric appears.
(function () {
  "use strict";
  var box = document.getElementById("charts");
  if (!box) return;
  var run = box.dataset.run;
  var FAMILIES = [
    ["reward per component", function (k) { return k === "reward_mean" || k === "accuracy" || k.indexOf("reward/") === 0; }],
    ["length (tokens)", function (k) { return k === "length_mean" || k === "length_max"; }],
    ["learner: loss, clipping, advantages", function (k) {
      return ["learner/loss", "learner/clip_frac", "learner/adv_abs_mean", "learner/kl", "learner/entropy"].indexOf(k) >= 0;
    }],
    ["learner: grad norm", function (k) { return k === "learner/grad_norm"; }],
    ["behaviour / learner log-prob mismatch", function (k) { return k.indexOf("learner/logprob_mismatch") === 0; }],
    ["throughput (tokens/s)", function (k) { return k === "tokens_per_s"; }],
    ["staleness / policy version", function (k) { return k === "staleness" || k === "staleness_observed" || k === "policy_version"; }],
  ];
  var COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"];
  var points = [];
  var charts = {};
  window.loomRun = { points: points, charts: charts };

  function keysOf(test) {
    var seen = {};
    points.forEach(function (p) { Object.keys(p).forEach(function (k) { if (test(k)) seen[k] = true; }); });
    return Object.keys(seen).sort();
  }

  function draw() {
    var width = Math.max(320, Math.min(box.clientWidth || 900, 900) / (box.clientWidth > 700 ? 2 : 1) - 16);
    FAMILIES.forEach(function (fam, i) {
      var title = fam[0], keys = keysOf(fam[1]);
      if (!keys.length) return;
      var data = [points.map(function (p) { return p.step; })];
      keys.forEach(function (k) { data.push(points.map(function (p) { return k in p ? p[k] : null; })); });
      var c = charts[title];
      if (c && c.keys.join() === keys.join()) { c.plot.setData(data); return; }
      if (c) { c.plot.destroy(); c.div.remove(); }
      var div = document.createElement("div");
      div.className = "chart";
      div.dataset.chart = title;
      box.appendChild(div);
      var series = [{ label: "step" }].concat(keys.map(function (k, j) {
        return { label: k, stroke: COLORS[j % COLORS.length], width: 1.5, points: { show: true, size: 4 } };
      }));
      var plot = new uPlot({ title: title, width: width, height: 220, series: series, scales: { x: { time: false } } }, data, div);
      charts[title] = { plot: plot, keys: keys, div: div };
    });
    document.getElementById("points").textContent = String(points.length);
    var last = document.getElementById("last-step");
    if (last && points.length) {
      var p = points[points.length - 1];
      last.innerHTML = "";
      Object.keys(p).sort().forEach(function (k) {
        var tr = document.createElement("tr"), a = document.createElement("td"), b = document.createElement("td");
        a.textContent = k;
        b.textContent = Number.isInteger(p[k]) ? String(p[k]) : p[k].toPrecision(4);
        tr.appendChild(a); tr.appendChild(b); last.appendChild(tr);
      });
    }
    if (points.length) document.getElementById("version").textContent = String(points[points.length - 1].policy_version);
  }

  var source = new EventSource("/ui/runs/" + encodeURIComponent(run) + "/events");
  var pending = null;
  source.addEventListener("step", function (ev) {
    points.push(JSON.parse(ev.data));
    if (pending === null) pending = setTimeout(function () { pending = null; draw(); }, 100);
  });
  source.addEventListener("end", function (ev) {
    var end = JSON.parse(ev.data);
    document.getElementById("run-status").textContent = end.status;
    document.getElementById("run-status").className = "status s-" + end.status;
    source.close();
    draw();
  });
})();
