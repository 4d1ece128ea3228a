"""Setup's torch check: only the version is asserted; a CPU or a CUDA build are both accepted.

``python scripts/check_torch.py`` checks the installed torch; ``--version V`` checks a version
string instead (what the tests do for ``2.13.0+cpu`` and ``2.13.0+cu128``). Exit 0 = acceptable.
"""

from __future__ import annotations

import argparse
import sys

REQUIRED_TORCH = "2.13.0"


def torch_version_problem(version: str, required: str = REQUIRED_TORCH) -> str | None:
    """None when ``version`` is ``required`` with any local build tag (``+cpu``, ``+cu128`` …)."""
    public = version.strip().split("+", 1)[0]
    if public != required:
        return f"torch {version} is installed but Kiln needs torch {required} (CPU or CUDA build)"
    return None


def build_kind(version: str, cuda: str | None) -> str:
    """``cuda X`` or ``cpu`` (informational only: both builds are fine)."""
    if cuda:
        return f"cuda {cuda}"
    tag = version.split("+", 1)[1] if "+" in version else ""
    return f"cuda ({tag})" if tag.startswith("cu") else "cpu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", help="check this version string instead of the installed torch")
    args = parser.parse_args(argv)
    if args.version is not None:
        version, cuda = args.version, None
    else:
        import torch

        version, cuda = torch.__version__, torch.version.cuda
    problem = torch_version_problem(version)
    if problem:
        print(problem, file=sys.stderr)
        return 1
    print(f"torch {version} ({build_kind(version, cuda)}) ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
