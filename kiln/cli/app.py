"""``kiln``: serve the stack, build the demo model, inspect environments, submit and follow runs."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from kiln.cli.output import JsonAwareGroup, fail, progress
from kiln.errors import KilnError
from kiln.settings import load_settings

app = typer.Typer(cls=JsonAwareGroup, help="Kiln: OpenEnv environments in, verified LoRA adapters out.", no_args_is_help=True)
openenv_app = typer.Typer(cls=JsonAwareGroup, help="Inspect OpenEnv environments and run collection/training.", no_args_is_help=True)
model_app = typer.Typer(cls=JsonAwareGroup, help="Local models.", no_args_is_help=True)
app.add_typer(openenv_app, name="openenv")
app.add_typer(model_app, name="model")
train_app = typer.Typer(cls=JsonAwareGroup, help="Train adapters from saved rollouts.", no_args_is_help=True)
app.add_typer(train_app, name="train")

console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)


def _fail(error: KilnError) -> None:
    fail(error)  # under --json: the error envelope on stdout as well


def _api() -> Any:
    from kiln.cli.api_client import ApiClient

    return ApiClient(load_settings().resolved_api_url)


@app.command()
def serve() -> None:
    """Start the embedded stack (Temporal dev server, SeaweedFS), the workers and the REST API.

    Set KILN_TEMPORAL_ADDRESS / KILN_S3_ENDPOINT (+ KILN_S3_ACCESS_KEY, KILN_S3_SECRET_KEY,
    KILN_S3_BUCKET) to use existing servers instead. KILN_MODEL_PATH selects the local model.
    """
    from kiln.cli.serve import serve as run_serve

    try:
        run_serve(load_settings(), console)
    except KilnError as error:
        _fail(error)


@model_app.command("tiny")
def model_tiny(directory: Path = typer.Argument(..., help="Folder to write the tiny model into.")) -> None:
    """Build the deterministic tiny Qwen3-architecture demo model (same bytes every time)."""
    from kiln.policy.tiny import build_tiny_model

    path = build_tiny_model(directory)
    console.print(f"tiny model written to {path}")


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
    credential_env: Optional[str] = typer.Option(
        None, "--credential-env", help="Name of an environment variable holding a bearer token for this URL."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the inspection as JSON."),
) -> None:
    """Discover an environment: identity, digests and action schema (direct, no server needed)."""
    from kiln.openenv.discovery import inspect_environment
    from kiln.openenv.urls import normalize_url, require_allowed_host

    settings = load_settings()
    try:
        url = normalize_url(environment)
        require_allowed_host(url, allow_remote=settings.allow_remote_environments)
        token = None
        if credential_env:
            from kiln.openenv.credentials import prepare_token, read_token_from_env

            token = prepare_token(url, read_token_from_env(credential_env))
        inspection = asyncio.run(inspect_environment(url, bearer_token=token))
    except KilnError as error:
        _fail(error)
        return
    if as_json:
        sys.stdout.write(json.dumps(inspection, indent=2, sort_keys=True) + "\n")
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


def _submit_and_follow(request: dict[str, Any], follow_run: bool, as_json: bool) -> None:
    from kiln.cli.follow import follow, print_outcome

    api = _api()
    try:
        code, status = api.submit(request)
    except KilnError as error:
        _fail(error)
        return
    run_id = status["run_id"]
    out = progress()  # stderr under --json: stdout then holds only the JSON document
    if not follow_run:
        if as_json:
            sys.stdout.write(json.dumps(status, indent=2, sort_keys=True) + "\n")
        else:
            out.print(f"run {run_id} {'submitted' if code == 202 else 'already exists'}")
            if status.get("temporal_ui"):
                out.print(f"web ui {status['temporal_ui']}")
        return
    out.print(f"run {run_id} {'submitted' if code == 202 else 'already exists (idempotent retry)'}")
    if status.get("temporal_ui"):
        out.print(f"web ui {status['temporal_ui']}")
    final = follow(lambda: api.status(run_id), out)
    if as_json:
        sys.stdout.write(json.dumps(final, indent=2, sort_keys=True) + "\n")
        raise typer.Exit(0 if final.get("state") == "completed" else 1)
    raise typer.Exit(print_outcome(final, out))


def _request_from_flags(
    kind: str,
    environment: list[str],
    groups: int,
    group_size: int,
    seed_start: int,
    max_steps: int,
    concurrency: int,
    max_action_tokens: int,
    temperature: float,
    thinking: bool,
    thinking_budget_tokens: Optional[int],
    adapter: str,
    output_adapter: Optional[str],
    idempotency_key: Optional[str],
    reset_options: Optional[Path],
    environment_reset_options: Optional[list[str]] = None,
    credential_id: Optional[list[str]] = None,
    constrained_actions: bool = False,
) -> dict[str, Any]:
    request: dict[str, Any] = {
        "kind": kind,
        "environment_urls": environment,
        "groups": groups,
        "group_size": group_size,
        "seed_start": seed_start,
        "max_steps": max_steps,
        "concurrency": concurrency,
        "max_action_tokens": max_action_tokens,
        "temperature": temperature,
        "thinking": thinking,
        "adapter": adapter,
    }
    if thinking_budget_tokens is not None:
        request["thinking_budget_tokens"] = thinking_budget_tokens
    if constrained_actions:
        request["constrained_actions"] = True
    if output_adapter is not None:
        request["output_adapter"] = output_adapter
    if idempotency_key is not None:
        request["idempotency_key"] = idempotency_key
    if reset_options is not None:
        request["reset_options"] = _read_json_object(reset_options, "--reset-options")
    if environment_reset_options:
        if len(environment_reset_options) != len(environment):
            _fail(
                KilnError(
                    f"got {len(environment_reset_options)} --environment-reset-options for "
                    f"{len(environment)} --environment values",
                    code="openenv_invalid_request",
                    hint="give one file per --environment, in order ('-' = no options)",
                )
            )
        request["environment_reset_options"] = [
            {} if item == "-" else _read_json_object(Path(item), "--environment-reset-options")
            for item in environment_reset_options
        ]
    if credential_id:
        request["credential_ids"] = [None if c == "-" else c for c in credential_id]
    return request


def _read_json_object(path: Path, flag: str) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        _fail(KilnError(f"{flag} {path}: {exc}", code="openenv_invalid_request"))
    if not isinstance(value, dict):
        _fail(KilnError(f"{flag} {path}: must hold one JSON object", code="openenv_invalid_request"))
    return value


CONSTRAINED_OPT = typer.Option(False, "--constrained-actions", help="Decode the final answer under a grammar compiled from the action schema (reasoning stays free).")
RESET_OPTS = typer.Option(None, "--environment-reset-options", help="Reset options file per --environment, in order ('-' = none).")
CREDENTIAL_OPTS = typer.Option(None, "--credential-id", help="Credential id per --environment ('-' = public); ids are configured on the workers in KILN_CREDENTIALS.")

# Collection options shared by `train` and `rollout` (one definition, one help text).
ENV_OPT = typer.Option(..., "--environment", help="Environment base URL (repeat for a portfolio).")
GROUPS_OPT = typer.Option(8, help="Seed groups to collect (1-16384).")
SEED_START_OPT = typer.Option(0, help="Seed of the first group; group g uses seed_start+g.")
MAX_STEPS_OPT = typer.Option(8, help="Environment steps per episode (1-256).")
CONCURRENCY_OPT = typer.Option(4, help="Concurrent sessions per group (1-256).")
MAX_ACTION_TOKENS_OPT = typer.Option(256, help="Token limit of one action (1-16384).")
TEMPERATURE_OPT = typer.Option(1.0, help="Sampling temperature (>= 0).")
THINKING_OPT = typer.Option(True, "--thinking/--no-thinking", help="Let the policy reason in <think> first.")
THINKING_BUDGET_OPT = typer.Option(None, help="Bound on reasoning tokens (< max-action-tokens).")
ADAPTER_OPT = typer.Option("base", help="Behaviour policy adapter (base = the base model).")
IDEMPOTENCY_OPT = typer.Option(None, help="Retry-safe submission key.")
RESET_OPTIONS_OPT = typer.Option(None, help="JSON file of reset options for every environment.")


@openenv_app.command("train")
def train_cmd(
    environment: list[str] = ENV_OPT,
    groups: int = GROUPS_OPT,
    group_size: int = typer.Option(4, help="Candidates per seed group (2-256 for training)."),
    output_adapter: str = typer.Option(..., "--output-adapter", help="Name of the adapter to train."),
    seed_start: int = SEED_START_OPT,
    max_steps: int = MAX_STEPS_OPT,
    concurrency: int = CONCURRENCY_OPT,
    max_action_tokens: int = MAX_ACTION_TOKENS_OPT,
    temperature: float = TEMPERATURE_OPT,
    thinking: bool = THINKING_OPT,
    thinking_budget_tokens: Optional[int] = THINKING_BUDGET_OPT,
    adapter: str = ADAPTER_OPT,
    idempotency_key: Optional[str] = IDEMPOTENCY_OPT,
    reset_options: Optional[Path] = RESET_OPTIONS_OPT,
    learning_rate: float = typer.Option(1e-4, help="AdamW learning rate of the LoRA parameters."),
    epochs: int = typer.Option(4, help="Passes over the collected groups (one optimizer step per group)."),
    lora_rank: int = typer.Option(16, help="LoRA rank (attention and MLP projections)."),
    lora_alpha: float = typer.Option(32.0, help="LoRA alpha."),
    kl_coeff: float = typer.Option(0.0, help="k1 KL penalty to the base policy (0 = off)."),
    echo_lambda: float = typer.Option(0.05, help="ECHO weight on observation cross-entropy (0 = off)."),
    checkpoint_interval: Optional[int] = typer.Option(None, help="Checkpoint every N optimizer steps."),
    eval_groups: int = typer.Option(0, help="Held-out seed groups for the paired evaluation (0 = none)."),
    eval_group_size: int = typer.Option(1, help="Episodes per held-out seed group."),
    eval_seed_start: Optional[int] = typer.Option(None, help="First held-out seed (default: after the training seeds)."),
    gate: bool = typer.Option(False, "--gate/--no-gate", help="Gate promotion on the paired sign test (needs >= 20 eval groups)."),
    min_mean_improvement: float = typer.Option(0.0, help="Gate: minimum candidate - baseline mean return."),
    min_mean_return: Optional[float] = typer.Option(None, help="Gate: minimum candidate mean return."),
    auto_load: bool = typer.Option(True, "--auto-load/--no-auto-load", help="Promote the adapter name when allowed."),
    post_eval_suite: Optional[str] = typer.Option(None, help="Installed static suite to score the adapter on (e.g. counter-format)."),
    post_eval_min_accuracy: Optional[float] = typer.Option(None, help="Promote only at or above this suite accuracy (0-1)."),
    environment_reset_options: Optional[list[str]] = RESET_OPTS,
    credential_id: Optional[list[str]] = CREDENTIAL_OPTS,
    constrained_actions: bool = CONSTRAINED_OPT,
    follow_run: bool = typer.Option(True, "--follow/--no-follow", help="Follow progress until the run ends."),
    as_json: bool = typer.Option(False, "--json", help="Print the final status as JSON."),
) -> None:
    """Collect seed-matched groups and train a LoRA adapter (GRPO + ECHO) as one durable run."""
    request = _request_from_flags(
        "train", environment, groups, group_size, seed_start, max_steps, concurrency,
        max_action_tokens, temperature, thinking, thinking_budget_tokens, adapter, output_adapter,
        idempotency_key, reset_options, environment_reset_options, credential_id, constrained_actions,
    )
    request["training_config"] = {
        "learning_rate": learning_rate,
        "epochs": epochs,
        "lora_rank": lora_rank,
        "lora_alpha": lora_alpha,
        "kl_coeff": kl_coeff,
        "checkpoint_interval": checkpoint_interval,
        "echo": {"lambda": echo_lambda} if echo_lambda > 0 else None,
    }
    request["auto_load"] = auto_load
    if post_eval_suite is not None:
        request["post_eval"] = {"suite": post_eval_suite}
        if post_eval_min_accuracy is not None:
            request["post_eval"]["min_accuracy"] = post_eval_min_accuracy
    if eval_groups > 0:
        evaluation: dict[str, Any] = {"groups": eval_groups, "group_size": eval_group_size}
        if eval_seed_start is not None:
            evaluation["seed_start"] = eval_seed_start
        if gate:
            evaluation["gate"] = {"min_mean_improvement": min_mean_improvement}
            if min_mean_return is not None:
                evaluation["gate"]["min_mean_return"] = min_mean_return
        request["environment_eval"] = evaluation
    elif gate:
        _fail(KilnError("--gate needs --eval-groups >= 20", code="openenv_invalid_request"))
    _submit_and_follow(request, follow_run, as_json)


@openenv_app.command("rollout")
def rollout_cmd(
    environment: list[str] = ENV_OPT,
    groups: int = GROUPS_OPT,
    group_size: int = typer.Option(4, help="Candidates per seed group (1-256)."),
    seed_start: int = SEED_START_OPT,
    max_steps: int = MAX_STEPS_OPT,
    concurrency: int = CONCURRENCY_OPT,
    max_action_tokens: int = MAX_ACTION_TOKENS_OPT,
    temperature: float = TEMPERATURE_OPT,
    thinking: bool = THINKING_OPT,
    thinking_budget_tokens: Optional[int] = THINKING_BUDGET_OPT,
    adapter: str = ADAPTER_OPT,
    idempotency_key: Optional[str] = IDEMPOTENCY_OPT,
    reset_options: Optional[Path] = RESET_OPTIONS_OPT,
    environment_reset_options: Optional[list[str]] = RESET_OPTS,
    credential_id: Optional[list[str]] = CREDENTIAL_OPTS,
    constrained_actions: bool = CONSTRAINED_OPT,
    output: Optional[Path] = typer.Option(None, "--output", help="Write the rollouts JSONL here (e.g. X.rollouts.jsonl)."),
    replay_output: Optional[Path] = typer.Option(None, "--replay-output", help="Write the replay transcript here (X.replay.json)."),
    summary_output: Optional[Path] = typer.Option(None, "--summary-output", help="Write the summary here (X.rollout-summary.json)."),
    force: bool = typer.Option(False, "--force", help="Overwrite existing output files."),
    follow_run: bool = typer.Option(True, "--follow/--no-follow", help="Follow progress."),
    as_json: bool = typer.Option(False, "--json", help="Print the final status as JSON."),
) -> None:
    """Collect rollouts only (a run of kind rollout): dataset, replay and summary artifacts.

    With --output/--replay-output/--summary-output the command waits for the run and downloads
    the files (size and SHA-256 rechecked against the manifest); `kiln openenv verify
    --summary X.rollout-summary.json` then checks them offline.
    """
    request = _request_from_flags(
        "rollout", environment, groups, group_size, seed_start, max_steps, concurrency,
        max_action_tokens, temperature, thinking, thinking_budget_tokens, adapter, None,
        idempotency_key, reset_options, environment_reset_options, credential_id, constrained_actions,
    )
    if output is None and replay_output is None and summary_output is None:
        _submit_and_follow(request, follow_run, as_json)
        return
    from kiln.cli.control_cmds import follow_and_download, rollout_output_mapping

    api = _api()
    try:
        code, status = api.submit(request)
    except KilnError as error:
        _fail(error)
        return
    run_id = status["run_id"]
    out = progress()
    out.print(f"run {run_id} {'submitted' if code == 202 else 'already exists (idempotent retry)'}")
    exit_code = follow_and_download(
        api, run_id, rollout_output_mapping(output, replay_output, summary_output), force=force, out=out
    )
    if as_json:  # --output does not turn --json off: the final status, then the exit code
        sys.stdout.write(json.dumps(api.status(run_id), indent=2, sort_keys=True) + "\n")
    raise typer.Exit(exit_code)


@openenv_app.command("start")
def start_cmd(
    request_file: Path = typer.Option(..., "--request", help="JSON run request file (≤ 1 MiB)."),
    follow_run: bool = typer.Option(False, "--follow/--no-follow", help="Follow progress."),
    as_json: bool = typer.Option(False, "--json", help="Print status as JSON."),
) -> None:
    """Submit a run request file (the body of POST /v1/openenv/runs)."""
    if request_file.stat().st_size > 1024 * 1024:
        _fail(KilnError("request file is larger than 1 MiB", code="openenv_invalid_request"))
    _submit_and_follow(json.loads(request_file.read_text()), follow_run, as_json)


@train_app.command("grpo")
def train_grpo_cmd(
    input_path: Path = typer.Option(..., "--input", help="A rollouts JSONL written by Kiln (kiln openenv rollout --output)."),
    output_adapter: str = typer.Option(..., "--output-adapter", help="Name of the adapter to train."),
    learning_rate: float = typer.Option(1e-4, help="AdamW learning rate of the LoRA parameters."),
    epochs: int = typer.Option(4, help="Passes over the groups."),
    lora_rank: int = typer.Option(16, help="LoRA rank."),
    lora_alpha: float = typer.Option(32.0, help="LoRA alpha."),
    kl_coeff: float = typer.Option(0.0, help="k1 KL penalty to the base policy."),
    echo_lambda: float = typer.Option(0.05, help="ECHO weight (0 = off)."),
    behavior_policy: str = typer.Option("no_importance_correction", help="no_importance_correction | recorded."),
    auto_load: bool = typer.Option(True, "--auto-load/--no-auto-load", help="Promote the adapter name."),
    follow_run: bool = typer.Option(True, "--follow/--no-follow", help="Follow progress."),
    as_json: bool = typer.Option(False, "--json", help="Print the final status as JSON."),
) -> None:
    """Train GRPO+ECHO from a saved rollouts file, through the same training activity as a run.

    The rollouts' behaviour policy must match the workers' base model (and the published adapter
    it names, if any): the on-policy proof fails closed otherwise.
    """
    from kiln.cli.follow import follow, print_outcome

    if not input_path.is_file():
        _fail(KilnError(f"--input {input_path} is not a file", code="openenv_invalid_request"))
    if input_path.stat().st_size > 256 * 1024 * 1024:
        _fail(KilnError(f"--input {input_path} is larger than 256 MiB", code="openenv_invalid_request"))
    api = _api()
    try:
        dataset = api.upload_dataset(input_path.read_bytes())
        status = api.train_dataset(
            {
                "dataset": dataset,
                "output_adapter": output_adapter,
                "auto_load": auto_load,
                "training_config": {
                    "learning_rate": learning_rate,
                    "epochs": epochs,
                    "lora_rank": lora_rank,
                    "lora_alpha": lora_alpha,
                    "kl_coeff": kl_coeff,
                    "behavior_policy": behavior_policy,
                    "echo": {"lambda": echo_lambda} if echo_lambda > 0 else None,
                },
            }
        )
    except KilnError as error:
        _fail(error)
        return
    run_id = status["run_id"]
    console.print(f"training run {run_id} submitted (dataset {dataset['sha256']}, {dataset['bytes']} B)")
    if not follow_run:
        return
    final = follow(lambda: api.status(run_id), console)
    if as_json:
        sys.stdout.write(json.dumps(final, indent=2, sort_keys=True) + "\n")
        raise typer.Exit(0 if final.get("state") == "completed" else 1)
    raise typer.Exit(print_outcome(final, console))


def _register_extensions() -> None:
    from kiln.cli.control_cmds import register as register_control
    from kiln.cli.verify_cmds import register as register_verify

    register_control(openenv_app)
    register_verify(openenv_app)


_register_extensions()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
