"""The house rules of the layout, enforced (docs/architecture.md draws them):

- the domain core ``kiln/`` never imports temporalio or fastapi; only kiln/core/policy and kiln/core/train
  import torch/transformers/peft;
- ``workflows/`` do no I/O: they import no I/O library and, from ``kiln``, only the pure modules in
  ``WORKFLOW_KILN_MODULES``; from ``activities`` only the activity classes they call by reference;
- ``api/`` imports nothing from ``activities/`` and, from ``workflows/``, only ``workflows.names``
  (the type names it submits), so the API process never loads workflow or activity code;
- ``activities/`` import nothing from ``workflows/`` but ``workflows.names`` (update-with-start
  names the queue workflow by type);
- the floors inside ``kiln/``: the core never imports a door (``kiln.cli``, ``kiln.client``,
  ``kiln.devstack``, ``kiln.api_models``); nothing outside ``kiln.cli`` imports the CLI, and the CLI
  reaches the API only through ``kiln.client`` (no HTTP library of its own)."""

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


def _full_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from kiln.core import records`` imports the module kiln.core.records.
            folder = ROOT.joinpath(*node.module.split("."))
            for alias in node.names:
                child = folder / alias.name
                if child.with_suffix(".py").is_file() or (child / "__init__.py").is_file():
                    names.add(f"{node.module}.{alias.name}")
                else:
                    names.add(node.module)
    return names


# The kiln modules a workflow may import: pure records, rules and status, no I/O.
WORKFLOW_KILN_MODULES = {
    "kiln",
    "kiln.core",
    "kiln.core.records",
    "kiln.core.side_records",
    "kiln.core.contracts",
    "kiln.core.run_plan",
    "kiln.core.stale_pipeline",
    "kiln.core.openenv.capacity",
    "kiln.core.openenv.urls",
    "kiln.core.run_status",
    "kiln.core.search_attributes",
    "kiln.core.unfinished_thinking",
}
WORKFLOW_ACTIVITY_MODULES = {"activities.control", "activities.gpu"}


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
        if relative.startswith(("kiln/core/policy/", "kiln/core/train/")):
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


def test_workflows_import_only_pure_kiln_modules() -> None:
    offenders = {}
    for path in _modules("workflows"):
        imported = _full_imports(path)
        bad = sorted(
            name
            for name in imported
            if (name.startswith("kiln") and name not in WORKFLOW_KILN_MODULES)
            or (name.startswith("activities") and name not in WORKFLOW_ACTIVITY_MODULES)
        )
        if bad:
            offenders[path.relative_to(ROOT).as_posix()] = bad
    assert offenders == {}


def test_api_and_activities_import_only_workflow_names() -> None:
    offenders = {}
    for folder in ("api", "activities"):
        for path in _modules(folder):
            bad = sorted(
                name
                for name in _full_imports(path)
                if (name.startswith("workflows") and name != "workflows.names")
                or (folder == "api" and name.startswith("activities"))
            )
            if bad:
                offenders[path.relative_to(ROOT).as_posix()] = bad
    assert offenders == {}


def test_api_process_loads_no_workflow_or_activity_code() -> None:
    import subprocess
    import sys

    code = (
        "import sys, api.app;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('workflows', 'activities', 'workers')"
        " and m not in ('workers', 'workers.client', 'workers.converter', 'workers.metrics')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['workflows', 'workflows.names']"


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


# The doors of kiln/: what users and processes enter through. Everything else in kiln/ is the core,
# which never imports a door (a door may import the core and, the CLI, the client).
KILN_EDGES = ("kiln.cli", "kiln.client", "kiln.devstack", "kiln.api_models")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_edge(name: str) -> bool:
    return any(name == edge or name.startswith(edge + ".") for edge in KILN_EDGES)


def _floor_offenders(paths: list[Path]) -> dict[str, list[str]]:
    offenders = {}
    for path in paths:
        if _is_edge(_module_name(path)):
            continue
        bad = sorted(name for name in _full_imports(path) if _is_edge(name))
        if bad:
            offenders[path.relative_to(ROOT).as_posix()] = bad
    return offenders


def test_the_kiln_core_never_imports_an_edge() -> None:
    assert _floor_offenders(_modules("kiln")) == {}


def _in_cli(name: str) -> bool:
    return name == "kiln.cli" or name.startswith("kiln.cli.")


def test_nothing_but_the_cli_imports_the_cli_and_the_cli_reaches_the_api_through_the_client() -> None:
    offenders = {}
    for folder in ("kiln", "api", "activities", "workers", "workflows"):
        for path in _modules(folder):
            module = _module_name(path)
            names = _full_imports(path)
            in_cli = _in_cli(module)
            bad = sorted(n for n in names if _in_cli(n) and not in_cli)
            if in_cli:
                bad += sorted(names & {"httpx", "requests", "urllib.request", "http.client"})
            if bad:
                offenders[path.relative_to(ROOT).as_posix()] = bad
    assert offenders == {}


def test_the_floor_rule_catches_a_planted_upward_import(tmp_path: Path) -> None:
    planted = ROOT / "kiln" / "core" / "rollout" / "_planted_upward_import.py"
    planted.write_text("from kiln.cli.console import console\n", encoding="utf-8")
    try:
        assert _floor_offenders([planted]) == {"kiln/core/rollout/_planted_upward_import.py": ["kiln.cli.console"]}
    finally:
        planted.unlink()
