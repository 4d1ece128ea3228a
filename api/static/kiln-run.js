"use strict";
(function () {
  var runId = decodeURIComponent(location.pathname.split("/").filter(Boolean)[1] || "");
  var api = "/v1/openenv/runs/" + encodeURIComponent(runId);
  var fmt = KilnCharts.fmt;
  var PAGE = 5;
  var offset = 0;
  var STAGES = [
    ["admission", ["admitting", "queued"]], ["discovery", ["discovering"]], ["collection", ["collecting"]],
    ["revalidation", ["revalidating"]], ["training", ["training"]], ["evaluation", ["evaluating", "post_evaluating"]],
    ["publication", ["publishing"]]
  ];
  var STAGE_OF_FAILURE = { admission: "admission", discovery: "discovery", collection: "collection",
    identity_verification: "revalidation", training: "training", environment_evaluation: "evaluation",
    post_evaluation: "evaluation", artifact_publication: "publication" };

  function get(path) {
    return fetch(path, { credentials: "same-origin" }).then(function (r) {
      if (!r.ok) throw new Error(path + ": HTTP " + r.status);
      return r.json();
    });
  }
  function text(id, value) { document.getElementById(id).textContent = value; }
  function td(tr, value, cls, pre) {
    var cell = document.createElement("td");
    if (cls) cell.className = cls;
    if (pre) { var p = document.createElement("pre"); p.textContent = value; cell.appendChild(p); }
    else cell.textContent = value;
    tr.appendChild(cell);
  }

  function timeline(status) {
    var ol = document.getElementById("timeline");
    ol.textContent = "";
    var stages = STAGES.filter(function (s) {
      return !(s[0] === "training" && status.kind === "rollout") && !(s[0] === "evaluation" && !status.environment_evaluation && !status.post_evaluation);
    });
    var state = status.state, current = -1;
    stages.forEach(function (s, i) { if (s[1].indexOf(status.phase) >= 0) current = i; });
    if ((state === "failed" || state === "terminated") && status.failure && status.failure.stage) {
      var name = STAGE_OF_FAILURE[status.failure.stage];
      stages.forEach(function (s, i) { if (s[0] === name) current = i; });
    }
    if (state === "cancelled" && status.cancelled_stage) {
      var cname = STAGE_OF_FAILURE[status.cancelled_stage];
      stages.forEach(function (s, i) { if (s[0] === cname) current = i; });
    }
    stages.forEach(function (s, i) {
      var li = document.createElement("li");
      li.textContent = s[0];
      li.dataset.stage = s[0];
      if (state === "completed" || i < current) li.className = "done";
      else if (i === current) li.className = state === "running" ? "current" : state;
      ol.appendChild(li);
    });
  }

  function overview(status) {
    text("run-id", runId);
    var badge = document.getElementById("state");
    badge.textContent = status.state;
    badge.className = "state state-" + status.state;
    var parts = [status.kind || "run", "phase " + status.phase];
    if (status.mean_return !== null && status.mean_return !== undefined) parts.push("mean return " + fmt(status.mean_return));
    if (status.training && status.training.final_loss !== undefined) parts.push("final loss " + fmt(status.training.final_loss));
    if (status.state === "completed") {
      var evaluated = status.environment_evaluation || status.post_evaluation;
      parts.push(!evaluated ? "not evaluated" : status.promoted ? "promoted" : "not promoted");
    }
    text("summary", parts.join(" · "));
    var link = document.getElementById("temporal-link");
    if (status.temporal_ui) link.href = status.temporal_ui; else link.remove();
    if (status.termination) text("failure", "terminated through Temporal at " + status.termination.stage + " by " +
      status.termination.identity + ": " + status.termination.reason);
    else if (status.failure) text("failure", status.failure.code + " at " + status.failure.stage + ": " + status.failure.message);
    else if (status.state === "cancelled") text("failure", (status.warnings || []).join("; "));
    timeline(status);
    var ul = document.getElementById("artifacts");
    ul.textContent = "";
    (status.artifacts || []).forEach(function (a) {
      var li = document.createElement("li"), link2 = document.createElement("a");
      link2.href = api + "/artifacts/" + a.name;
      link2.textContent = a.name;
      li.appendChild(link2);
      li.appendChild(document.createTextNode(" (" + a.bytes + " bytes)"));
      ul.appendChild(li);
    });
    if (!ul.children.length) ul.textContent = "nothing published";
  }

  function curves(events, status) {
    var groups = events.filter(function (e) { return e.kind === "group" && e.label === "group"; });
    var steps = events.filter(function (e) { return e.kind === "train_step"; });
    // An ended run's missing figures will never come: say so instead of "no data yet".
    var empty = status.state === "running" ? null : "none: the run " + status.state + " without one";
    function opts(extra) { var o = extra || {}; o.empty = empty; return o; }
    var reward = document.getElementById("reward-charts");
    reward.textContent = "";
    function gseries(name, field, color) {
      return { name: name, color: color, points: groups.map(function (e) { return [e.group_index, e[field]]; }) };
    }
    KilnCharts.lineChart(reward, "mean return", [gseries("mean return", "mean_return", "#0b63ce")], "group", opts()).id = "chart-reward";
    KilnCharts.lineChart(reward, "invalid-action rate", [gseries("invalid-action rate", "invalid_action_rate", "#c0392b")], "group", opts());
    KilnCharts.lineChart(reward, "episode latency (ms)", [gseries("episode latency", "episode_latency_ms", "#7d5ba6")], "group", opts()).id = "chart-latency";
    var train = document.getElementById("train-charts");
    train.textContent = "";
    function sseries(name, field, color) {
      return { name: name, color: color, points: steps.map(function (e) { return [e.step, e[field]]; }) };
    }
    KilnCharts.lineChart(train, "loss", [sseries("loss", "loss", "#0b63ce"), sseries("policy loss", "policy_loss", "#e67e22")], "step", opts()).id = "chart-loss";
    // A feature that is off reports null on every step: say so instead of drawing zeros.
    function off(field, message) {
      return steps.length && steps.every(function (e) { return e[field] === null || e[field] === undefined; }) ? message : null;
    }
    KilnCharts.lineChart(train, "KL", [sseries("KL", "kl", "#16a085")], "step", opts({ off: off("kl", "KL off") })).id = "chart-kl";
    KilnCharts.lineChart(train, "env-CE (ECHO)", [sseries("env-CE", "env_ce", "#8e44ad")], "step", opts({ off: off("env_ce", "ECHO off") })).id = "chart-env-ce";
    KilnCharts.lineChart(train, "grad norm", [sseries("grad norm", "grad_norm", "#34495e")], "step", opts());
    text("train-note", steps.length ? steps.length + " step(s)" : (status.kind === "train" ? "no training step yet" : "a rollout run does not train"));
  }

  function evaluation(events, status) {
    var block = status.environment_evaluation;
    if (!block) return;
    var ev = block.evidence || {};
    text("verdict", [block.decision ? "decision " + block.decision : block.state, block.outcome ? "outcome " + block.outcome : "",
      block.verdict || "", ev.improved_groups !== undefined ? ev.improved_groups + " improved / " + ev.regressed_groups + " regressed" : "",
      ev.mean_return_improvement !== undefined ? "Δ mean " + fmt(ev.mean_return_improvement) : ""].filter(Boolean).join(" · "));
    var bySeed = {};
    events.filter(function (e) { return e.kind === "group" && e.label !== "group"; }).forEach(function (e) {
      bySeed[e.seed] = bySeed[e.seed] || {};
      bySeed[e.seed][e.label.indexOf("candidate") >= 0 ? "candidate" : "baseline"] = e.mean_return;
    });
    var tbody = document.querySelector("#paired tbody");
    tbody.textContent = "";
    Object.keys(bySeed).map(Number).sort(function (a, b) { return a - b; }).forEach(function (seed) {
      var row = bySeed[seed], tr = document.createElement("tr");
      td(tr, String(seed)); td(tr, fmt(row.baseline), "num"); td(tr, fmt(row.candidate), "num");
      td(tr, row.baseline !== undefined && row.candidate !== undefined ? fmt(row.candidate - row.baseline) : "-", "num");
      tbody.appendChild(tr);
    });
  }

  // Online RL: one row per iteration the status keeps (the whole curve is in metrics.jsonl).
  function iterations(status) {
    var rows = status.iterations || [];
    var section = document.getElementById("iterations-section");
    section.style.display = (status.iterations_total || 1) > 1 && rows.length ? "" : "none";
    var tbody = document.querySelector("#iterations tbody");
    tbody.textContent = "";
    rows.forEach(function (r) {
      var tr = document.createElement("tr");
      tr.dataset.iteration = String(r.iteration);
      td(tr, r.iteration + (status.iterations_total ? " of " + status.iterations_total : ""));
      td(tr, String(r.seed_start), "num");
      td(tr, fmt(r.mean_return), "num");
      td(tr, fmt(r.eval_mean_return), "num");
      td(tr, String(r.steps), "num");
      td(tr, fmt(r.kl_to_previous), "num kl-previous");
      td(tr, fmt(r.kl_to_base), "num kl-base");
      td(tr, r.early_stop_step === null || r.early_stop_step === undefined ? "" : "target_kl at step " + r.early_stop_step);
      td(tr, r.adapter_sha256 ? r.adapter_sha256.slice(0, 19) + "…" : "-");
      tbody.appendChild(tr);
    });
  }

  function episodes(status) {
    var tbody = document.querySelector("#episodes tbody");
    if (!status.manifest) {
      text("episodes-note", status.state === "running" ? "episodes appear when the run has published its artifacts"
        : "no episodes: the run " + status.state + " without publishing any");
      document.getElementById("prev").disabled = document.getElementById("next").disabled = true;
      return;
    }
    get(api + "/episodes?offset=" + offset + "&limit=" + PAGE).then(function (page) {
      tbody.textContent = "";
      // Per episode: the reset observation, then per turn reasoning → action → observation → reward.
      page.episodes.forEach(function (ep) {
        var reset = document.createElement("tr");
        reset.dataset.episode = ep.group_index + ":" + ep.candidate_index;
        reset.className = "reset";
        td(reset, String(ep.group_index)); td(reset, String(ep.candidate_index)); td(reset, "reset");
        td(reset, ""); td(reset, ""); td(reset, ep.reset_observation, "", true); td(reset, "", "num");
        tbody.appendChild(reset);
        ep.turns.forEach(function (turn) {
          var tr = document.createElement("tr");
          tr.dataset.episode = ep.group_index + ":" + ep.candidate_index;
          td(tr, ""); td(tr, ""); td(tr, String(turn.turn));
          td(tr, turn.reasoning, "", true); td(tr, turn.action, "", true); td(tr, turn.observation, "", true);
          td(tr, fmt(turn.reward), "num");
          tbody.appendChild(tr);
        });
      });
      var last = Math.min(page.offset + page.limit, page.total);
      text("page-info", "episodes " + (page.total ? page.offset + 1 : 0) + "–" + last + " of " + page.total);
      document.getElementById("prev").disabled = page.offset === 0;
      document.getElementById("next").disabled = last >= page.total;
    }).catch(function (err) { text("episodes-note", String(err.message || err)); });
  }
  document.getElementById("prev").addEventListener("click", function () { offset = Math.max(0, offset - PAGE); episodes(window.kilnStatus); });
  document.getElementById("next").addEventListener("click", function () { offset += PAGE; episodes(window.kilnStatus); });

  function load() {
    return Promise.all([get(api), get(api + "/metrics")]).then(function (both) {
      var status = both[0], events = both[1].events;
      window.kilnStatus = status;
      overview(status);
      curves(events, status);
      evaluation(events, status);
      iterations(status);
      if (!window.kilnEpisodesLoaded || status.state !== "running") { episodes(status); window.kilnEpisodesLoaded = true; }
      document.body.dataset.loaded = "true";
      if (status.state === "running") setTimeout(load, 2000);
    }).catch(function (err) { text("failure", String(err.message || err)); document.body.dataset.loaded = "error"; });
  }
  load();
})();
