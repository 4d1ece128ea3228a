"""Session fixtures: real Temporal dev server, real SeaweedFS, the tiny model, example envs.

Every process a fixture starts is stopped by its own PID at teardown.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterator

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _torch_single_thread() -> None:
    try:
        import torch
    except ImportError:  # control-plane-only install
        return
    torch.set_num_threads(1)


_torch_single_thread()


TIER_VARIABLE = "KILN_TEST_TIER"
TIERS = ("all", "suite", "heavy")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``KILN_TEST_TIER`` (set by ``scripts/test.sh``): ``suite`` deselects the cases marked ``heavy``,
    ``heavy`` keeps only them, ``all`` (the default of a plain ``pytest``) keeps every case."""
    tier = os.environ.get(TIER_VARIABLE, "all")
    if tier not in TIERS:
        raise pytest.UsageError(f"{TIER_VARIABLE}={tier!r} is not a test tier: use one of {', '.join(TIERS)}")
    if tier == "all":
        return
    keep = [item for item in items if (item.get_closest_marker("heavy") is not None) == (tier == "heavy")]
    if len(keep) < len(items):
        kept = set(map(id, keep))
        config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
        items[:] = keep


@pytest.fixture(scope="session", autouse=True)
def background_jobs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """The ``background`` jobs of the selected tests (``tests/support/background.py``), started now
    in one child process; it is killed at the session's end if it still runs."""
    from tests.support.background import BackgroundJobs
    from tests.support.child_call import stop_child

    names = sorted({m.args[0] for item in request.session.items for m in item.iter_markers("background")})
    jobs = BackgroundJobs(names, request, tmp_path_factory.mktemp("background"))
    try:
        yield jobs
    finally:
        if jobs.child is not None:
            stop_child(jobs.child)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The deterministic tiny demo model, built once per test session. The tests that use it start
    workers and servers: the fork server's imports run on the other core meanwhile."""
    from tests.support.forkserver import DISABLE_VARIABLE, fork_server
    from tests.support.models import shared_tiny_model

    if os.environ.get(DISABLE_VARIABLE, "1") != "0":
        fork_server().start_in_background()
    return shared_tiny_model(tmp_path_factory)


@pytest.fixture(scope="session")
def temporal_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from tests.support.stack import start_test_temporal

    proc, address = start_test_temporal(tmp_path_factory.mktemp("temporal"))
    try:
        yield address
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    from tests.support.stack import start_test_seaweedfs

    proc, endpoint, access_key, secret_key = start_test_seaweedfs(
        tmp_path_factory.mktemp("seaweedfs"), bucket="kiln-test"
    )
    try:
        yield {"endpoint": endpoint, "access_key": access_key, "secret_key": secret_key, "bucket": "kiln-test"}
    finally:
        proc.stop()


@pytest.fixture()
def kiln_settings(
    temporal_server: str, s3_server: dict[str, str], tiny_model_dir: Path, tmp_path: Path
) -> Callable[..., object]:
    """Settings pointing at the session's servers, with task queues unique to the test."""
    from kiln.core.settings import Settings
    from tests.support.kiln_workers import settings_for_tests

    def make(**overrides: object) -> Settings:
        return settings_for_tests(temporal_server, s3_server, tiny_model_dir, tmp_path / "kiln-home", **overrides)

    return make


@pytest.fixture(scope="session")
def counter_env_url() -> Iterator[str]:
    from tests.support.servers import serve_example_env

    with serve_example_env("counter", max_concurrent_envs=8) as url:
        yield url
