"""The bundle's three files: default paths, size-capped reads and strict canonical parsing.

Every file must be in Kiln's canonical serialisation (summary and replay byte-equal to
``pretty_json`` of their parse, each dataset line byte-equal to ``canonical_json`` + ``\\n``), so
no byte can change without changing a parsed value.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.core.canonical import canonical_json, pretty_json, strict_loads
from kiln.core.rollout.bundle import MAX_ARTIFACT_BYTES
from kiln.core.rollout.verify.checks import DATASET_FILE, Where, fail, need_dict


_STEMMED = (".rollout-summary.json", ".summary.json")


def paired_paths(summary_path: Path) -> tuple[list[Path], list[Path]]:
    """Where a bundle's dataset and replay may lie, in the order they are looked for: beside the
    summary, ``X.rollout-summary.json`` / ``X.summary.json`` pair with ``X.rollouts.jsonl`` and
    ``X.replay.json`` (the CLI naming), and every summary with ``rollouts.jsonl`` and
    ``replay.json`` (the run-folder naming). See docs/verify.md."""
    name = summary_path.name
    datasets: list[Path] = []
    replays: list[Path] = []
    for suffix in _STEMMED:
        if name.endswith(suffix) and len(name) > len(suffix):
            stem = name[: -len(suffix)]
            datasets.append(summary_path.with_name(f"{stem}.rollouts.jsonl"))
            replays.append(summary_path.with_name(f"{stem}.replay.json"))
            break
    datasets.append(summary_path.with_name("rollouts.jsonl"))
    replays.append(summary_path.with_name("replay.json"))
    return datasets, replays


def default_paths(summary_path: Path) -> tuple[Path, Path]:
    """``(dataset, replay)`` the summary pairs with: the first of :func:`paired_paths` that exists
    (the first named when none does)."""
    datasets, replays = paired_paths(summary_path)
    return (
        next((p for p in datasets if p.is_file()), datasets[0]),
        next((p for p in replays if p.is_file()), replays[0]),
    )


def bundle_paths(summary_path: Path, dataset_path: Path | None, replay_path: Path | None) -> tuple[Path, Path]:
    """The dataset and replay of the bundle ``summary_path`` heads: the explicit paths, else the
    paired ones beside it. A paired file that is missing (renamed after collection) fails naming
    the file it expected and the option that names it."""
    datasets, replays = paired_paths(summary_path)
    out = []
    for given, candidates, file, option in (
        (dataset_path, datasets, DATASET_FILE, "--dataset"),
        (replay_path, replays, "replay", "--replay"),
    ):
        if given is not None:
            out.append(Path(given))
            continue
        found = next((p for p in candidates if p.is_file()), None)
        if found is None:
            expected = " or ".join(p.name for p in candidates)
            raise fail(
                Where(file),
                "path",
                f"the {file} of {summary_path.name} is not beside it: expected "
                f"{expected} in {summary_path.parent}; a renamed file is named with {option} FILE "
                "(kiln openenv verify and replay)",
            )
        out.append(found)
    return out[0], out[1]


def verify_command(summary: Path, dataset: Path, replay: Path) -> str | None:
    """The ``kiln openenv verify`` command line for files written under these names: None when the
    summary pairs with them by itself, else one naming them with ``--dataset``/``--replay``."""
    datasets, replays = paired_paths(summary)
    options = ""
    if Path(dataset).resolve() != datasets[0].resolve():
        options += f" --dataset {dataset}"
    if Path(replay).resolve() != replays[0].resolve():
        options += f" --replay {replay}"
    return f"kiln openenv verify --summary {summary}{options}" if options else None


def read_capped(path: Path, file: str) -> bytes:
    where = Where(file)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise fail(where, "path", f"cannot read {path}: {exc.strerror or exc}") from None
    if size > MAX_ARTIFACT_BYTES:
        raise fail(where, "bytes", f"{path} is larger than {MAX_ARTIFACT_BYTES} bytes")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise fail(where, "path", f"cannot read {path}: {exc.strerror or exc}") from None


def parse_json(data: bytes, where: Where, field: str = "json") -> Any:
    """Strict JSON: UTF-8, no NaN/Infinity; JSON errors become :class:`VerificationFailed`."""
    try:
        # A bundle file nests a few levels above the frames it records (each frame <= 64 deep).
        return strict_loads(data.decode("utf-8"), max_depth=128)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise fail(where, field, f"is not valid JSON ({type(exc).__name__})") from None


def parse_pretty(data: bytes, file: str) -> dict:
    """A pretty JSON object file that must be byte-equal to ``pretty_json`` of its parse."""
    where = Where(file)
    value = need_dict(parse_json(data, where), where, "json")
    if pretty_json(value) != data:
        raise fail(where, "json", "is not in Kiln's canonical pretty serialisation (bytes were altered)")
    return value


def parse_dataset(data: bytes) -> list[dict]:
    """One canonical compact JSON object per ``\\n``-terminated line, no blank lines."""
    if not data:
        return []
    if not data.endswith(b"\n"):
        raise fail(Where(DATASET_FILE), "json", "the last line is not terminated by a newline")
    lines = []
    for index, raw in enumerate(data[:-1].split(b"\n")):
        where = Where(DATASET_FILE, group=index)
        if not raw:
            raise fail(where, "json", "blank line")
        value = need_dict(parse_json(raw, where), where, "json")
        if canonical_json(value) != raw:
            raise fail(where, "json", "line is not canonical JSON (bytes were altered)")
        lines.append(value)
    return lines


@dataclass
class Bundle:
    """The parsed, verified files (returned for callers such as live replay)."""

    summary_path: Path
    dataset_path: Path
    replay_path: Path
    summary: dict
    replay: dict
    dataset: list[dict]
    report: dict
