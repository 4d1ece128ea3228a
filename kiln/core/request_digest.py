"""The request digest: the typed, default-filled run request's canonical SHA-256, which
idempotent submissions compare. Fields added after digests existed stay out while "off", so an
old request digests as it always did."""

from __future__ import annotations

from typing import Any

from kiln.core.canonical import digest_json
from kiln.core.contracts import RunRequest


# Training settings added after receipts, checkpoints and request digests existed: left out of the
# effective config (so of the config digest a checkpoint must match) and of the request digest
# while at their defaults.
LATER_SETTINGS: dict[str, Any] = {
    "advantage_norm": "group_std",
    "loss_normaliser": "tokens",
    "overlong": "keep",
    "overlong_buffer_tokens": 0,
    "overlong_penalty": 1.0,
    "entropy_coeff": 0.0,
    "packing": False,
    "dynamic_sampling": None,
    "adapter": "lora",
}


def request_digest(request: RunRequest) -> str:
    """Digest of the typed, default-filled request (idempotency comparisons use it). Fields added
    later are left out while they hold their "off" value (``model`` unset, one iteration, no
    ``eval_every``, staleness 0, no ``replay_ignore``, context policy ``end``, the training settings
    of :data:`LATER_SETTINGS` at their defaults), so a request that does not use them digests as before."""
    data = request.model_dump(mode="json", by_alias=False)
    for name, off in (
        ("model", None),
        ("iterations", 1),
        ("eval_every", None),
        ("max_staleness", 0),
        ("replay_ignore", []),
        ("context_policy", "end"),
    ):
        if data.get(name) == off:
            data.pop(name, None)
    if isinstance(data.get("training_config"), dict):
        for name, off in LATER_SETTINGS.items():
            if data["training_config"].get(name) == off:
                data["training_config"].pop(name)
    return digest_json(data)
