"""Storing one online-RL iteration: its bundle, its record, and its row of the learning curve.

Runs on the control worker after iteration ``k`` trained (and was evaluated, when scheduled). The
bundle (rollouts.jsonl, replay.json, summary.json) is built by the same code as a run's published
bundle, so every iteration verifies on its own; the record (``kiln.core.artifacts.iterations``) binds
it to the adapter and receipt the iteration trained and to the identity that sampled it.
"""

from __future__ import annotations

from typing import Any

from kiln.core.artifacts.iterations import iteration_key, record_bytes
from kiln.core.artifacts.selections import full_selection
from kiln.core.artifacts.store import S3Store
from kiln.core.canonical import sha256_bytes
from kiln.core.records import EvaluationResult, IterationFiles, IterationInput, TrainResult
from kiln.core.run_status import invalid_action_rate, training_figures
from kiln.core.stages.evaluation import store_bundle
from kiln.core.telemetry.live import put_iteration


def _training_block(training: TrainResult) -> dict[str, Any]:
    return {
        **training.model_dump(include={"trained", "skip_reason", "adapter_sha256", "receipt", "steps"}),
        "adapter_files": [{"name": f.name, **f.object.model_dump()} for f in training.adapter_files],
    }


def _evaluation_block(evaluation: EvaluationResult) -> dict[str, Any]:
    return {
        **evaluation.model_dump(include={"decision", "outcome", "receipt"}),
        "sides": {
            side.side: {name: obj.model_dump() for name, obj in sorted(side.files.items())}
            for side in (evaluation.baseline, evaluation.candidate)
        },
    }


def curve_row(inp: IterationInput, stats: dict[str, Any]) -> dict[str, Any]:
    """The iteration's figures for status and ``metrics.jsonl`` (kind ``iteration``)."""
    evaluation = inp.evaluation
    return {
        "kind": "iteration",
        "iteration": inp.iteration,
        "seed_start": inp.bundle.seed_start,
        "staleness": inp.staleness,
        "mean_return": stats.get("mean_episode_return"),
        "invalid_action_rate": invalid_action_rate(stats),
        **training_figures(inp.training),
        "eval_mean_return": evaluation.candidate.stats.get("mean_episode_return") if evaluation else None,
        "eval_baseline_mean_return": evaluation.baseline.stats.get("mean_episode_return") if evaluation else None,
    }


def store_iteration(store: S3Store, inp: IterationInput) -> IterationFiles:
    stored, stats = store_bundle(store, inp, full_selection(store, inp.training))
    data = record_bytes(
        {
            "iteration": inp.iteration,
            "run_id": inp.run_id,
            "staleness": inp.staleness,
            "behavior_policy": inp.behavior_policy,
            "files": {name: obj.model_dump() for name, obj in sorted(stored.items())},
            "stats": stats,
            "training": _training_block(inp.training) if inp.training is not None else None,
            "evaluation": _evaluation_block(inp.evaluation) if inp.evaluation is not None else None,
            **(
                {"dynamic_sampling": inp.bundle.dynamic_sampling.model_dump(mode="json")}
                if inp.bundle.dynamic_sampling is not None
                else {}
            ),
            **({"stale": inp.bundle.staleness.model_dump(mode="json")} if inp.bundle.staleness is not None else {}),
        }
    )
    store.put_key(iteration_key(inp.run_id, inp.iteration), data, action="put iteration record")
    put_iteration(store, inp.run_id, curve_row(inp, stats))
    return IterationFiles(iteration=inp.iteration, record_sha256=sha256_bytes(data), stats=stats)
