"""Iteration records of an online-RL run: one immutable JSON object per iteration, and their chain.

Iteration ``k`` of run ``R`` is stored at ``runs/R/iterations/<k:06d>.json``
(``kiln.run-iteration.v1``: its bundle files, the adapter files and receipt its training wrote,
its evaluation receipt when it was evaluated, the behaviour identity that sampled it and its
staleness). The bytes are a pure function of the iteration's inputs, so a retried store writes the
same object. The run workflow keeps only a digest chain over the records
(``chain_k = sha256(chain_{k−1} ‖ record_sha256_k)``), and publication re-reads every record and
recomputes the chain, so the manifest lists exactly the iterations the run stored.
"""

from __future__ import annotations

import json
from typing import Any

from kiln.core.canonical import pretty_json, sha256_bytes
from kiln.core.errors import ArtifactIntegrityFailed
from kiln.core.run_plan import extend_chain

ITERATION_SCHEMA = "kiln.run-iteration.v1"


def iteration_key(run_id: str, iteration: int) -> str:
    return f"runs/{run_id}/iterations/{iteration:06d}.json"


def iteration_prefix(iteration: int) -> str:
    """The manifest path prefix of an iteration's artifacts."""
    return f"iterations/{iteration:06d}/"


def record_bytes(record: dict[str, Any]) -> bytes:
    return pretty_json({"schema": ITERATION_SCHEMA, **record})


def read_records(store: Any, run_id: str, count: int, chain: str | None) -> list[dict[str, Any]]:
    """Records 1…``count`` of ``run_id``, checked against ``chain``."""
    records: list[dict[str, Any]] = []
    running: str | None = None
    for iteration in range(1, count + 1):
        key = iteration_key(run_id, iteration)
        data = store.get_key(key)
        if data is None:
            raise ArtifactIntegrityFailed(f"iteration record {key} is missing")
        running = extend_chain(running, sha256_bytes(data))
        record = json.loads(data)
        if record.get("schema") != ITERATION_SCHEMA or record.get("iteration") != iteration:
            raise ArtifactIntegrityFailed(f"{key} is not the record of iteration {iteration}")
        records.append(record)
    if running != chain:
        raise ArtifactIntegrityFailed(
            f"the {count} iteration records of {run_id} do not hash to the chain the run recorded"
        )
    return records
