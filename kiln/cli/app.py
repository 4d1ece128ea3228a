"""``kiln``: the command tree; serve the stack, build models, serve an example environment and inspect
one. The run commands are ``kiln.cli.run_cmds``, the control and verify commands their own modules."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Optional

import typer

from kiln.cli.console import JsonAwareGroup, console, fail as _fail, print_json
from kiln.core.errors import KilnError
from kiln.core.settings import load_settings

app = typer.Typer(
    help="Kiln: OpenEnv environments in, verified LoRA adapters out.",
    no_args_is_help=True,
    rich_markup_mode=None,
    cls=JsonAwareGroup,
)
openenv_app = typer.Typer(
    help="Inspect OpenEnv environments and run collection/training.",
    no_args_is_help=True,
    rich_markup_mode=None,
    cls=JsonAwareGroup,
)
model_app = typer.Typer(help="Local models.", no_args_is_help=True, rich_markup_mode=None, cls=JsonAwareGroup)
app.add_typer(openenv_app, name="openenv")
app.add_typer(model_app, name="model")
train_app = typer.Typer(
    help="Train adapters from saved rollouts.", no_args_is_help=True, rich_markup_mode=None, cls=JsonAwareGroup
)
app.add_typer(train_app, name="train")


def _serve_help() -> str:
    """``kiln serve --help``: what it starts, where, and the variables that move it (defaults
    read from ``Settings``, where they live)."""
    from kiln.core.settings import Settings

    d = {name: field.default for name, field in Settings.model_fields.items()}
    return (
        "Start the embedded stack (Temporal dev server, SeaweedFS), the workers and the REST API.\n\n"
        f"Data, logs and PID files go under KILN_HOME (default {d['home']}). Ports on 127.0.0.1: "
        f"KILN_TEMPORAL_PORT (default {d['temporal_port']}), KILN_TEMPORAL_UI_PORT (default "
        f"{d['temporal_ui_port']}), KILN_S3_PORT (default {d['s3_port']}), KILN_API_PORT "
        f"(default {d['api_port']}, bound to KILN_API_HOST, default {d['api_host']}).\n\n"
        "Set KILN_TEMPORAL_ADDRESS / KILN_S3_ENDPOINT (+ KILN_S3_ACCESS_KEY, KILN_S3_SECRET_KEY, "
        "KILN_S3_BUCKET) to use existing servers instead. KILN_MODEL_PATH selects the local model. "
        "Every variable: README.md, Configuration."
    )


@app.command(help=_serve_help())
def serve() -> None:
    """Start the embedded stack, the workers and the REST API (help: :func:`_serve_help`)."""
    from kiln.cli.serve import serve as run_serve

    try:
        run_serve(load_settings(), console)
    except KilnError as error:
        _fail(error)


@model_app.command("tiny")
def model_tiny(directory: Path = typer.Argument(..., help="Folder to write the tiny model into.")) -> None:
    """Build the deterministic tiny Qwen3-architecture demo model (same bytes every time)."""
    from kiln.core.policy.tiny import build_tiny_model

    path = build_tiny_model(directory)
    console.print(f"tiny model written to {path}")


@model_app.command("random")
def model_random(
    directory: Path = typer.Argument(..., help="Folder to write the model into."),
    shape: str = typer.Option(
        "qwen3-0.6b",
        help="Architecture: qwen3-0.6b, qwen3-4b, qwen3.5-0.8b, qwen3.5-4b, qwen3-30b-a3b, "
        "gpt-oss-20b, tiny or qwen3.5-tiny (docs/models.md).",
    ),
    layers: Optional[int] = typer.Option(
        None,
        min=1,
        help="Fewer layers than the real shape, keeping its layer pattern (a multiple of "
        "4 for qwen3.5, of 2 for gpt-oss).",
    ),
    dtype: str = typer.Option("bfloat16", help="Weights dtype on disk: bfloat16, float16 or float32."),
    seed: int = typer.Option(0, min=0, help="Initialisation seed (same seed, same bytes)."),
) -> None:
    """Random-init model of a real architecture (the hub's folder layout: Qwen3.5 as its
    vision-language checkpoint) with Qwen's real tokenizer and Qwen3 chat template (weights
    random: for throughput/memory/scale tests). Needs qwen.tiktoken from scripts/setup.sh."""
    from kiln.core.policy.random_model import SHAPES, build_random_model, shape_config

    if shape not in SHAPES or dtype not in ("bfloat16", "float16", "float32"):
        _fail(
            KilnError(
                f"unknown shape {shape!r} or dtype {dtype!r}",
                code="openenv_invalid_request",
                hint=f"shapes: {', '.join(SHAPES)}; dtypes: bfloat16, float16, float32",
            )
        )
    try:
        shape_config(shape, layers=layers)
    except ValueError as exc:
        _fail(KilnError(f"--layers {layers}: {exc}", code="openenv_invalid_request", details={"field": "layers"}))
    try:
        path = build_random_model(directory, shape=shape, layers=layers, dtype=dtype, seed=seed)
    except KilnError as error:
        _fail(error)
    console.print(f"random {shape} model written to {path}")


@app.command("example-env")
def example_env(
    name: str = typer.Argument("counter", help="Example environment name (counter)."),
    port: int = typer.Option(8990, help="Port on 127.0.0.1."),
    max_concurrent_envs: int = typer.Option(8, help="Maximum concurrent WebSocket sessions."),
) -> None:
    """Serve an example OpenEnv environment (a real openenv server) on loopback."""
    from examples.envs.__main__ import main as serve_env

    serve_env([name, "--port", str(port), "--max-concurrent-envs", str(max_concurrent_envs)])


@openenv_app.command("inspect")
def inspect_cmd(
    environment: str = typer.Option(..., "--environment", help="Environment base URL."),
    credential_id: Optional[str] = typer.Option(
        None, "--credential-id", help="Credential id from KILN_CREDENTIALS for this URL."
    ),
    credential_env: Optional[str] = typer.Option(None, "--credential-env", hidden=True),  # old name
    as_json: bool = typer.Option(False, "--json", help="Print the inspection as JSON."),
) -> None:
    """Discover an environment: identity, digests and action schema (direct, no server needed)."""
    from kiln.core.openenv.discovery import inspect_environment
    from kiln.core.openenv.urls import normalize_url, require_allowed_host

    settings = load_settings()
    try:
        url = normalize_url(environment)
        require_allowed_host(url, allow_remote=settings.allow_remote_environments)
        token = None
        if credential_id:
            from kiln.core.openenv.credential_config import resolve_bearer_token

            token = resolve_bearer_token(settings.credentials, credential_id, url)
        elif credential_env:
            from kiln.core.openenv.credentials import prepare_token, read_token_from_env

            token = prepare_token(url, read_token_from_env(credential_env))
        inspection = asyncio.run(inspect_environment(url, bearer_token=token))
    except KilnError as error:
        _fail(error)
        return
    from kiln.core.openenv.tool_calls import action_contract

    # What the policy is shown and constrained by: for MCP tool servers the union of one call per
    # tool, not the generic call form the server advertises.
    shown, _validator = action_contract(inspection)
    if as_json:
        print_json({**inspection, "policy_action_schema": shown})
        return
    identity = inspection["identity"]
    metadata = identity.get("metadata") or {}
    console.print(f"environment     {metadata.get('name')} — {metadata.get('description')}")
    console.print(f"base url        {identity['base_url']}")
    console.print(f"websocket url   {identity['websocket_url']}")
    console.print(f"client profile  {identity['client_profile']}")
    console.print(f"openapi version {identity.get('openapi_version')}")
    console.print(f"environments    {', '.join(identity.get('environments') or []) or '(not advertised)'}")
    console.print(f"schema sha256   {identity['schema_sha256']}")
    console.print(f"discovery sha256 {identity.get('discovery_sha256')}")
    console.print("action schema:")
    console.print_json(json.dumps(inspection["schema"]["action"]))
    for tool in identity.get("tools") or []:  # MCP tool environments
        console.print(f"tool {tool['name']} — {tool['description']}", markup=False, highlight=False)
        console.print_json(json.dumps(tool["input_schema"]))
    console.print("policy action schema (what the policy is shown and constrained decoding compiles):")
    console.print_json(json.dumps(shown))


def _register_commands() -> None:
    from kiln.cli import run_cmds
    from kiln.cli.control_cmds import register as register_control
    from kiln.cli.verify_cmds import register as register_verify

    openenv_app.command("train")(run_cmds.train_cmd)
    openenv_app.command("rollout")(run_cmds.rollout_cmd)
    openenv_app.command("start")(run_cmds.start_cmd)
    train_app.command("grpo")(run_cmds.train_grpo_cmd)
    register_control(openenv_app)
    register_verify(openenv_app)


_register_commands()


def main() -> None:
    from kiln.cli.console import flush_quietly
    from kiln.cli.help import plain_command

    try:
        plain_command(app)()
    finally:
        flush_quietly()  # `kiln … | head`: exit with the command's own code, quietly


if __name__ == "__main__":
    main()
