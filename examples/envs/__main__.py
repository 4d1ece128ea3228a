"""``python -m examples.envs NAME --port P``: serve an example environment on loopback."""

from __future__ import annotations

import argparse
import threading
import time

import uvicorn

from examples.envs import EXAMPLE_ENVS, build_example_app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve a Kiln example OpenEnv environment.")
    parser.add_argument("name", choices=sorted(EXAMPLE_ENVS))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8990)
    parser.add_argument("--max-concurrent-envs", type=int, default=8)
    parser.add_argument("--schema-variant", type=int, default=1)
    parser.add_argument(
        "--drift-step",
        type=int,
        default=None,
        help="counter only: answer a different reward at this step index (replay drift tests)",
    )
    args = parser.parse_args(argv)
    options: dict[str, object] = {
        "max_concurrent_envs": args.max_concurrent_envs,
        "schema_variant": args.schema_variant,
    }
    if args.drift_step is not None:
        options["drift_step"] = args.drift_step
    app = build_example_app(args.name, **options)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"))
    url = f"http://{args.host}:{args.port}"
    threading.Thread(target=_announce, args=(server, f"{args.name} environment ready at {url}"), daemon=True).start()
    server.run()


def _announce(server: uvicorn.Server, line: str) -> None:
    """One line on stdout once the server listens (a failed bind prints uvicorn's error instead)."""
    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.05)
    print(line, flush=True)


if __name__ == "__main__":
    main()
