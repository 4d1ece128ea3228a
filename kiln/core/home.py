"""The Kiln home at rest (``KILN_HOME``): private to its owner, and the embedded S3's key pair.

Owns:

- :func:`secure_home`: the home's folders are 0700 and its files 0600 (also for a home an older
  Kiln left world-readable); processes Kiln starts write with umask 077
  (:func:`kiln.devstack.processes.start_process`), so ``temporal.db``, the SeaweedFS data and
  the logs stay private as they grow;
- :func:`home_s3_key_pair`: a random S3 key pair generated once per home and kept in
  ``<home>/s3-credentials.json`` (0600). The embedded SeaweedFS accepts only that pair; serve,
  workers and the API of the same home read it from there. Explicit ``KILN_S3_ACCESS_KEY`` /
  ``KILN_S3_SECRET_KEY`` settings win over it;
- :func:`write_private_json`: an atomic, owner-only JSON write.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
PRIVATE_UMASK = 0o077
S3_CREDENTIALS_FILE = "s3-credentials.json"


def create_private_dirs(path: Path) -> Path:
    """Create ``path`` and its missing parents 0700; folders that exist are left as they are."""
    path = Path(path)
    if not path.is_dir():
        create_private_dirs(path.parent)
        path.mkdir(mode=PRIVATE_DIR, exist_ok=True)
    return path


def make_private_dir(path: Path) -> Path:
    """Create ``path`` if needed (missing parents 0700 too) and make it 0700.

    Refuses a shared folder (sticky bit, such as ``/tmp``): Kiln only narrows folders it owns.
    """
    path = create_private_dirs(Path(path))
    if path.stat().st_mode & stat.S_ISVTX:
        from kiln.core.errors import KilnError

        raise KilnError(
            f"{path} is a shared folder (sticky bit); Kiln will not make it private",
            code="home_not_private",
            hint="point KILN_HOME at a folder of its own, e.g. ./.kiln",
        )
    os.chmod(path, PRIVATE_DIR)
    return path


def secure_home(home: Path) -> Path:
    """Create the home 0700 and bring everything under it to folders 0700 / files 0600.

    Symbolic links are left alone (their targets are not the home's to change).
    """
    home = make_private_dir(Path(home))
    for root, dirs, files in os.walk(home):
        for name in dirs + files:
            path = os.path.join(root, name)
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(mode):
                continue
            current = stat.S_IMODE(mode)
            # Folders 0700; files 0600 (an owner-executable bit, if any, is kept).
            wanted = PRIVATE_DIR if stat.S_ISDIR(mode) else (current & 0o100) | PRIVATE_FILE
            if current != wanted:
                try:
                    os.chmod(path, wanted)
                except FileNotFoundError:
                    continue
    return home


def write_private(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` readable by this user only (the file may hold secrets)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data.encode("utf-8") if isinstance(data, str) else data)
    os.chmod(path, PRIVATE_FILE)


def write_private_json(path: Path, value: Any) -> None:
    """Write ``value`` as JSON to ``path`` (owner-only, replaced atomically)."""
    path = Path(path)
    make_private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(json.dumps(value, indent=2) + "\n")
    os.replace(tmp, path)


def home_s3_key_pair(home: Path) -> tuple[str, str]:
    """The home's S3 key pair ``(access_key, secret_key)``, generated on first use (0600)."""
    path = Path(home) / S3_CREDENTIALS_FILE
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        return str(saved["access_key"]), str(saved["secret_key"])
    except FileNotFoundError:
        pass
    except (ValueError, KeyError, TypeError) as exc:
        from kiln.core.errors import KilnError

        raise KilnError(
            f"{path} is not a valid S3 key file ({type(exc).__name__})",
            code="s3_credentials_invalid",
            hint=f"remove {path} to generate a new pair (the embedded S3 takes it at its next "
            "start), or set KILN_S3_ACCESS_KEY and KILN_S3_SECRET_KEY",
        ) from None
    pair = {"access_key": f"kiln-{secrets.token_hex(6)}", "secret_key": secrets.token_urlsafe(32)}
    make_private_dir(Path(home))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(json.dumps(pair, indent=2) + "\n")
    try:
        os.link(tmp, path)  # never replaces a pair another process wrote meanwhile
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    return home_s3_key_pair(home)
