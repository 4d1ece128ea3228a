"use strict";
(function () {
  function cell(row, text, cls) {
    var td = document.createElement("td");
    if (cls) td.className = cls;
    td.textContent = text;
    row.appendChild(td);
    return td;
  }
  fetch("/v1/openenv/runs", { credentials: "same-origin" }).then(function (r) {
    if (!r.ok) throw new Error("runs: HTTP " + r.status);
    return r.json();
  }).then(function (body) {
    var tbody = document.querySelector("#runs tbody");
    body.runs.forEach(function (run) {
      var tr = document.createElement("tr");
      tr.dataset.runId = run.run_id;
      var link = document.createElement("a");
      link.href = "/runs/" + encodeURIComponent(run.run_id);
      link.textContent = run.run_id.slice(0, 8);
      cell(tr, "").appendChild(link);
      var badge = document.createElement("span");
      badge.className = "state state-" + run.state;
      badge.textContent = run.state;
      cell(tr, "").appendChild(badge);
      cell(tr, run.kind || "-");
      cell(tr, run.output_adapter || "-");
      cell(tr, KilnCharts.fmt(run.mean_return), "num");
      // A completed run published without an evaluation was not judged: say so, not "yes".
      cell(tr, run.state === "completed" && run.evaluated === false ? "not evaluated"
        : run.promoted === true ? "yes" : run.promoted === false ? "no" : "-", "promoted");
      cell(tr, run.failure_code || "", "failure-code");
      cell(tr, run.started_at || "-");
      tbody.appendChild(tr);
    });
    document.getElementById("runs-note").textContent = body.runs.length + " run(s)";
  }).catch(function (err) {
    document.getElementById("runs-note").textContent = String(err.message || err);
  });
})();
