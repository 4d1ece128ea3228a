"""Kiln's domain core: everything Kiln knows, behind no door.

The doors sit beside this package and stand on it: `kiln.cli` (the `kiln` command),
`kiln.client` (the Python client), `kiln.devstack` (the embedded local stack behind
`kiln serve`) and `kiln.api_models` (the REST API's wire shapes). The Temporal shell and the
REST service live at the repository's top level (`workflows/`, `activities/`, `workers/`,
`api/`). Nothing in this package imports a door; `tests/unit/test_layering.py` holds that.
"""
