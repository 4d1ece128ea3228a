"""The command line of a test server module: ``python -m tests.support.X --port P
[--max-concurrent-envs N]`` serves ``build_app(N)`` on 127.0.0.1:P."""

from __future__ import annotations

import argparse
from typing import Any, Callable


def serve_main(build_app: Callable[[int], Any], description: str | None, argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-concurrent-envs", type=int, default=1)
    args = parser.parse_args(argv)
    uvicorn.run(build_app(args.max_concurrent_envs), host="127.0.0.1", port=args.port, log_level="warning")
