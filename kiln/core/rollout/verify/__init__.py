"""Offline verification of a rollout bundle: network-free, fail closed.

What is checked, file by file, is specified in ``docs/verify.md``. Modules: ``checks`` (failures
and value checks), ``files`` (paths, reads, canonical parsing), ``summary``, ``replay``,
``trajectory`` (dataset completions) and ``load`` (the driver).
"""

from kiln.core.rollout.verify.checks import VerificationFailed, Where
from kiln.core.rollout.verify.files import Bundle, default_paths
from kiln.core.rollout.verify.load import VERIFICATION_SCHEMA, load_bundle, verify_bundle
from kiln.core.rollout.verify.replay import CandidateFacts, check_replay_candidate, recompute_return
from kiln.core.rollout.verify.summary import UNBOUND_SUMMARY_FIELDS

__all__ = [
    "UNBOUND_SUMMARY_FIELDS",
    "VERIFICATION_SCHEMA",
    "Bundle",
    "CandidateFacts",
    "VerificationFailed",
    "Where",
    "check_replay_candidate",
    "default_paths",
    "load_bundle",
    "recompute_return",
    "verify_bundle",
]
