"""``docs/errors.md`` is generated from ``kiln/core/errors/`` and names every code the product raises."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kiln.core.errors import registered_errors
from kiln.core.errors_doc import render

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(30)
def test_docs_errors_md_is_what_the_generator_prints() -> None:
    assert (ROOT / "docs" / "errors.md").read_text(encoding="utf-8") == render(), (
        "regenerate: python -m kiln.core.errors_doc > docs/errors.md"
    )


def _literal_codes() -> set[str]:
    """Every ``code="…"`` keyword given to a call in the product folders."""
    codes = set()
    for folder in ("kiln", "api", "activities", "workers", "workflows"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.keyword) and node.arg == "code" and isinstance(node.value, ast.Constant):
                    if isinstance(node.value.value, str):
                        codes.add(node.value.value)
    return codes


@pytest.mark.timeout(60)
def test_every_code_in_the_product_is_documented() -> None:
    text = render()
    codes = _literal_codes() | set(registered_errors())
    assert len(codes) > 60
    assert sorted(code for code in codes if f"| `{code}` |" not in text) == []
