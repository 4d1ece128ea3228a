"""The home at rest on a shared machine: another local user can read nothing under it and cannot
use the embedded S3 with the old documented default keys.

Real Temporal dev server and SeaweedFS started by ``start_devstack`` on a home made private by
``secure_home``; the other user is ``nobody`` (via ``runuser``), which needs root to switch to.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from kiln.core.artifacts.store import S3Store
from kiln.core.home import S3_CREDENTIALS_FILE, home_s3_key_pair, secure_home
from kiln.core.settings import Settings
from kiln.devstack import start_devstack
from kiln.devstack.common import GRPC_OFFSET
from kiln.devstack.processes import free_port_block

OLD_DEFAULT_KEYS = ("kiln", "kiln-secret-key")  # what Kiln used to configure for every home
OTHER_USER = "nobody"

# Run as the other user with the system Python: prints every path it could open or list.
PROBE = """
import os, sys
for path in sys.argv[1:]:
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            open(path, "rb").read(1)
        print(path)
    except OSError:
        pass
"""


def test_explicit_keys_win_and_the_generated_pair_is_private_and_stable(tmp_path: Path) -> None:
    home = tmp_path / "home"
    pair = Settings(home=home).s3_key_pair()
    assert pair == Settings(home=home).s3_key_pair() == home_s3_key_pair(home)
    assert pair[0] != OLD_DEFAULT_KEYS[0] and pair[1] != OLD_DEFAULT_KEYS[1] and len(pair[1]) >= 40
    assert stat.S_IMODE((home / S3_CREDENTIALS_FILE).stat().st_mode) == 0o600
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert Settings(home=tmp_path / "other").s3_key_pair() != pair  # one pair per home
    assert Settings(home=home, s3_access_key="a", s3_secret_key="b").s3_key_pair() == ("a", "b")
    assert Settings(home=home, s3_secret_key="b").s3_key_pair() == (pair[0], "b")


def _as_other_user(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", OTHER_USER, "--", *argv], capture_output=True, text=True,
                          timeout=60, cwd="/")


def _curl_s3(endpoint: str, keys: tuple[str, str], method: str, path: str, *, as_other: bool) -> int:
    argv = ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", method,
            "--aws-sigv4", "aws:amz:us-east-1:s3", "--user", f"{keys[0]}:{keys[1]}"]
    if method == "PUT":
        argv += ["--data-binary", "written-by-another-user"]
    argv.append(f"{endpoint}{path}")
    result = _as_other_user(argv) if as_other else subprocess.run(argv, capture_output=True, text=True, timeout=60)
    return int(result.stdout or 0)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_another_local_user_reads_nothing_and_cannot_use_s3() -> None:
    if os.geteuid() != 0:
        pytest.skip("switching to another local user (runuser -u nobody) needs root")
    if shutil.which("runuser") is None or shutil.which("curl") is None:
        pytest.skip("needs runuser and curl (with --aws-sigv4) to act as another user")
    # A world-traversable parent (unlike pytest's 0700 tmp dirs): only the home's own modes protect it.
    parent = Path(tempfile.mkdtemp(prefix="kiln-at-rest-"))
    os.chmod(parent, 0o755)
    home = parent / "home"
    # What an older Kiln left: a world-readable home with a readable log.
    (home / "logs").mkdir(parents=True, mode=0o755)
    os.chmod(home, 0o755)
    (home / "logs" / "old.log").write_text("run request of an older version\n")
    os.chmod(home / "logs" / "old.log", 0o644)
    temporal, ui, s3 = free_port_block(3, grpc_offset=GRPC_OFFSET)
    settings = Settings(home=home, temporal_port=temporal, temporal_ui_port=ui, s3_port=s3, s3_bucket="kiln")
    stack = None
    try:
        secure_home(home)
        stack = start_devstack(settings)
        store = S3Store.from_settings(settings)
        store.put_key("runs/secret/request.json", b'{"secret": "canary"}')
        endpoint = stack.s3_endpoint

        paths = [str(p) for p in home.rglob("*")] + [str(home)]
        names = {Path(p).name for p in paths}
        assert {"temporal.db", "temporal.log", "seaweedfs.log", S3_CREDENTIALS_FILE, "old.log"} <= names
        assert any(name.endswith(".dat") for name in names)  # SeaweedFS volume data
        probe = _as_other_user(["/usr/bin/python3", "-c", PROBE, *paths])
        assert probe.returncode == 0, probe.stderr
        assert probe.stdout == ""  # nothing under the home could be opened or listed

        # Folders are 0700 and files 0600. SeaweedFS sets 0644 on some files it writes itself
        # (volume .vif files) whatever the umask: they sit in 0700 folders, and `kiln serve`
        # narrows them at start and every minute (secure_home), as here.
        secure_home(home)
        loose = []
        for path in map(Path, paths):
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode) or stat.S_ISSOCK(mode):
                continue
            if stat.S_IMODE(mode) & 0o077 or (stat.S_ISDIR(mode) and stat.S_IMODE(mode) != 0o700):
                loose.append((str(path), oct(stat.S_IMODE(mode))))
        assert loose == []

        # The S3 endpoint: the old default keys are refused for list, write and read ...
        for method, path in (("GET", "/kiln/"), ("PUT", "/kiln/runs/intruder.txt"),
                             ("GET", "/kiln/runs/secret/request.json"),
                             ("DELETE", "/kiln/runs/secret/request.json")):
            assert _curl_s3(endpoint, OLD_DEFAULT_KEYS, method, path, as_other=True) == 403, (method, path)
        # ... while the same signed request with the home's own keys works (the probe is sound).
        assert _curl_s3(endpoint, settings.s3_key_pair(), "GET", "/kiln/runs/secret/request.json",
                        as_other=False) == 200
        assert store.get_key("runs/secret/request.json") == b'{"secret": "canary"}'
        assert not store.exists("runs/intruder.txt")
        assert json.loads((home / S3_CREDENTIALS_FILE).read_text())["access_key"] == settings.s3_key_pair()[0]
    finally:
        if stack is not None:
            stack.stop()
        shutil.rmtree(parent, ignore_errors=True)
