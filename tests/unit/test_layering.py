"""The house rules of the layout, enforced: the domain core never imports temporalio or fastapi,
only kiln/policy and kiln/train import torch/transformers/peft, and workflows stay I/O-free."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def test_domain_core_never_imports_temporalio_or_fastapi() -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(_imports(path) & {"temporalio", "fastapi", "starlette"})
        for path in _modules("kiln")
    }
    assert {k: v for k, v in offenders.items() if v} == {}
    assert len(offenders) > 40


def test_only_policy_and_train_import_torch() -> None:
    heavy = {"torch", "transformers", "peft", "safetensors", "xgrammar"}
    offenders = {}
    for path in _modules("kiln"):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith(("kiln/policy/", "kiln/train/")):
            continue
        found = _imports(path) & heavy
        if found:
            offenders[relative] = sorted(found)
    assert offenders == {}


def test_workflows_do_no_io() -> None:
    forbidden = {"httpx", "boto3", "botocore", "websockets", "requests", "socket", "subprocess", "torch"}
    offenders = {
        str(path.relative_to(ROOT)): sorted(_imports(path) & forbidden) for path in _modules("workflows")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_control_worker_api_and_cli_start_without_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, workers.factory, api.app, activities.control, kiln.cli.app;"
        "print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
