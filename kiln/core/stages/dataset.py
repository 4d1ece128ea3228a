"""Training from a saved rollouts JSONL: validate it, split it into group objects, find its policy.

The same ``train_adapter`` activity then trains from those groups, so a saved dataset is held to
the same on-policy proof as a live run: every completion must carry one behaviour policy, whose
base model must be the trainer's and whose adapter (if any) must be the published one.
"""

from __future__ import annotations

import json
from typing import Any

from kiln.core.artifacts.store import S3Store
from kiln.core.canonical import canonical_json
from kiln.core.errors import DatasetInvalid, PolicyIdentityChanged
from kiln.core.artifacts.group_sets import group_set
from kiln.core.records import AdapterRef, GroupSet, StoredObject
from kiln.core.artifacts.adapters import read_pointer

DATASET_GROUP_SCHEMA = "kiln.openenv-dataset-group.v1"


def _line_error(index: int, reason: str) -> DatasetInvalid:
    return DatasetInvalid(
        f"rollouts line {index + 1}: {reason}",
        hint="train from a rollouts.jsonl that Kiln wrote (kiln openenv rollout --output FILE)",
    )


def read_training_lines(data: bytes) -> list[dict[str, Any]]:
    """The AgenticGroup lines of a rollouts JSONL, with the fields training relies on checked."""
    if not data.endswith(b"\n"):
        raise DatasetInvalid("the rollouts file must end with a newline (one JSON group per line)")
    lines = [_checked_line(index, raw) for index, raw in enumerate(data.split(b"\n")[:-1])]
    if not lines:
        raise DatasetInvalid("the rollouts file holds no groups")
    return lines


def _checked_line(index: int, raw: bytes) -> dict[str, Any]:
    """One rollouts line, parsed, with the fields training relies on checked."""
    try:
        line = json.loads(raw)
    except ValueError:
        raise _line_error(index, "not JSON") from None
    if not isinstance(line, dict) or not isinstance(line.get("completions"), list) or not line["completions"]:
        raise _line_error(index, "not an AgenticGroup with completions")
    for position, completion in enumerate(line["completions"]):
        pieces = (completion.get("tokens") or {}).get("pieces") if isinstance(completion, dict) else None
        if not isinstance(pieces, list) or not pieces:
            raise _line_error(index, f"completion {position} has no token pieces")
        provenance = completion.get("openenv")
        if not isinstance(provenance, dict) or not isinstance(provenance.get("behavior_policy"), dict):
            raise _line_error(index, f"completion {position} has no OpenEnv behaviour policy")
        if completion.get("reward") != provenance.get("episode_return"):
            raise _line_error(index, f"completion {position}: reward differs from episode_return")
    return line


FIRST_LINE_CHECKED_BYTES = 8 * 1024 * 1024  # a first line longer than this is checked at training


def check_first_line(head: bytes, total_bytes: int) -> None:
    """Refuse (``training_invalid_dataset``) a dataset whose first line (within ``head``, the
    file's first bytes; ``total_bytes`` its size) is not a rollouts group: what the API checks at
    upload and at submit, before a run is started on it."""
    end = head.find(b"\n")
    if end < 0 and len(head) >= total_bytes:
        raise DatasetInvalid("the rollouts file must end with a newline (one JSON group per line)")
    if end >= 0:
        _checked_line(0, head[:end])
    elif not head.lstrip().startswith(b"{"):
        raise _line_error(0, "not JSON")


def corpus_behavior_policy(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """The one behaviour policy of the whole corpus; mixed policies fail closed."""
    policies = {
        canonical_json(completion["openenv"]["behavior_policy"]) for line in lines for completion in line["completions"]
    }
    if len(policies) != 1:
        raise PolicyIdentityChanged(
            f"the rollouts mix {len(policies)} behaviour policies; one run's data must share one",
            stage="training",
        )
    return json.loads(policies.pop())


def split_dataset(store: S3Store, dataset: StoredObject) -> tuple[GroupSet, dict[str, Any], AdapterRef | None]:
    data = store.get_bytes(dataset.ref())
    lines = read_training_lines(data)
    policy = corpus_behavior_policy(lines)
    base_adapter: AdapterRef | None = None
    if policy.get("adapter"):
        base_adapter = read_pointer(store, str(policy["adapter"]))
        if base_adapter.adapter_sha256 != policy.get("adapter_sha256"):
            raise PolicyIdentityChanged(
                f"the rollouts were sampled with adapter {policy['adapter']!r} at "
                f"{policy.get('adapter_sha256')}, but that name now holds {base_adapter.adapter_sha256}",
                hint="train from rollouts of the currently published adapter, or of the base model",
                stage="training",
            )
    refs: list[StoredObject] = []
    for index, line in enumerate(lines):
        ref = store.put_blob(canonical_json({"schema": DATASET_GROUP_SCHEMA, "group_index": index, "line": line}))
        refs.append(StoredObject.of(ref))
    return group_set(store, [refs]), policy, base_adapter
