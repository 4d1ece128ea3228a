#!/usr/bin/env bash
# The house checks over the product folders, each at zero findings (docs/testing.md, "Checks"):
# ruff's lint rules, ruff's formatter (check only) and mypy (configured in pyproject.toml).
# Tools come from the test extra (scripts/setup.sh installs it); RUFF/MYPY override the binaries.
set -uo pipefail
cd "$(dirname "$0")/.."
RUFF=${RUFF:-.venv/bin/ruff}
MYPY=${MYPY:-.venv/bin/mypy}
PRODUCT=(kiln api activities workers workflows)
status=0
echo "== ruff check ==";          "$RUFF" check "${PRODUCT[@]}" || status=1
echo "== ruff format --check =="; "$RUFF" format --check "${PRODUCT[@]}" || status=1
echo "== mypy ==";                "$MYPY" --python-executable .venv/bin/python || status=1
exit "$status"
