"""Checkpoints by default: a train request that says nothing about them checkpoints every 10
steps (a killed attempt re-does at most 10; the figure behind it is in docs/durability.md), one
that names an interval keeps it, and null still turns them off."""

from __future__ import annotations

from kiln.core.contracts import parse_run_request

BASE = {"kind": "train", "environment_urls": ["http://127.0.0.1:9"], "output_adapter": "a"}


def test_a_train_request_checkpoints_every_10_steps_unless_it_says_otherwise() -> None:
    assert parse_run_request(BASE).effective_training_config().checkpoint_interval == 10
    assert parse_run_request({**BASE, "training_config": {"epochs": 2}}).effective_training_config().checkpoint_interval == 10
    named = parse_run_request({**BASE, "training_config": {"checkpoint_interval": 3}})
    assert named.effective_training_config().checkpoint_interval == 3
    off = parse_run_request({**BASE, "training_config": {"checkpoint_interval": None}})
    assert off.effective_training_config().checkpoint_interval is None
