"""``kiln``: serve the stack, build the demo model, inspect environments, submit and follow runs."""

from __future__ import annotations

import asyncio
import enum
import json
from pathlib import Path
from typing import Any, Optional

import typer

from kiln.core.contracts import (
    EchoConfig,
    EnvironmentEvalConfig,
    GateConfig,
    PostEvalConfig,
    RunRequest,
    TrainingConfig,
)
from kiln.cli.console import JsonAwareGroup, console, fail as _fail, print_json, progress
from kiln.cli.flags import check_request, literal_choices
from kiln.cli.follow import FOLLOW_OPT

# Help panels of `openenv train`/`rollout` (kiln.cli.help draws them; unpanelled options come last).
from kiln.cli.help import COLLECTION, EVALUATION, ONLINE_RL, OUTPUT, POLICY, TRAINING
from kiln.core.errors import KilnError
from kiln.core.settings import load_settings


from kiln.cli.model_options import default, describe

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


def _api() -> Any:
    from kiln.client.http import ApiClient

    return ApiClient()


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


def _submit_and_follow(request: dict[str, Any], follow_run: bool, as_json: bool, preflight: bool = True) -> None:
    from kiln.cli.follow import exit_code, follow, print_links, print_outcome

    api = _api()
    try:
        code, status = api.submit(request, preflight=preflight)
    except KilnError as error:
        _fail(error)
        return
    run_id = status.run_id
    out = progress()  # stderr under --json: stdout then holds only the JSON document
    if not follow_run:
        if as_json:
            print_json(status)
        else:
            out.print(f"run {run_id} {'submitted' if code == 202 else 'already exists'}")
            print_links(status, out, api.base_url)
        return
    out.print(f"run {run_id} {'submitted' if code == 202 else 'already exists (idempotent retry)'}")
    print_links(status, out, api.base_url)
    final = follow(lambda: api.status(run_id), out)
    if as_json:
        print_json(final)
        raise typer.Exit(exit_code(final))
    raise typer.Exit(print_outcome(final, out, api.base_url))


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
    thinking: str,
    thinking_budget_tokens: Optional[int],
    adapter: str,
    output_adapter: Optional[str],
    idempotency_key: Optional[str],
    reset_options: Optional[Path],
    environment_reset_options: Optional[list[str]] = None,
    credential_id: Optional[list[str]] = None,
    constrained_actions: bool = False,
    model: Optional[str] = None,
    reset_determinism: str = default(RunRequest, "reset_determinism"),
    replay_ignore: Optional[list[str]] = None,
    context_policy: Any = default(RunRequest, "context_policy"),
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
        "thinking": THINKING_VALUES[Thinking(thinking).value],
        "adapter": adapter,
    }
    if model is not None:
        request["model"] = model
    if thinking_budget_tokens is not None:
        request["thinking_budget_tokens"] = thinking_budget_tokens
    if constrained_actions:
        request["constrained_actions"] = True
    if reset_determinism != default(RunRequest, "reset_determinism"):
        request["reset_determinism"] = str(
            reset_determinism.value if isinstance(reset_determinism, enum.Enum) else reset_determinism
        )
    if replay_ignore:
        request["replay_ignore"] = list(replay_ignore)
    policy = str(context_policy.value if isinstance(context_policy, enum.Enum) else context_policy)
    if policy != default(RunRequest, "context_policy"):
        request["context_policy"] = policy
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


def _check_flags(request: dict[str, Any]) -> None:
    """The request the flags built, validated here: errors name the flags, nothing is submitted."""
    try:
        check_request(RunRequest, request)
    except KilnError as error:
        _fail(error)


def _read_json_object(path: Path, flag: str) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        _fail(KilnError(f"{flag} {path}: {exc}", code="openenv_invalid_request"))
    if not isinstance(value, dict):
        _fail(KilnError(f"{flag} {path}: must hold one JSON object", code="openenv_invalid_request"))
    return value


CONSTRAINED_OPT = typer.Option(
    default(RunRequest, "constrained_actions"),
    "--constrained-actions",
    rich_help_panel=POLICY,
    help=describe(RunRequest, "constrained_actions"),
)
RESET_OPTS = typer.Option(
    None,
    "--environment-reset-options",
    rich_help_panel=COLLECTION,
    help="Reset options file per --environment, in order ('-' = none).",
)
CREDENTIAL_OPTS = typer.Option(
    None,
    "--credential-id",
    rich_help_panel=COLLECTION,
    help="Credential id per --environment ('-' = public); ids are configured on the workers in KILN_CREDENTIALS.",
)
ResetDeterminism = literal_choices("ResetDeterminism", RunRequest, "reset_determinism")
RESET_DETERMINISM_OPT = typer.Option(
    ResetDeterminism(default(RunRequest, "reset_determinism")),
    "--reset-determinism",
    rich_help_panel=COLLECTION,
    help=describe(RunRequest, "reset_determinism"),
)
ContextPolicy = literal_choices("ContextPolicy", RunRequest, "context_policy")
CONTEXT_POLICY_OPT = typer.Option(
    ContextPolicy(default(RunRequest, "context_policy")),
    "--context-policy",
    rich_help_panel=COLLECTION,
    help=describe(RunRequest, "context_policy"),
)
REPLAY_IGNORE_OPT = typer.Option(
    default(RunRequest, "replay_ignore"),
    "--replay-ignore",
    rich_help_panel=COLLECTION,
    help=describe(RunRequest, "replay_ignore") + " Repeatable.",
)

# Collection options shared by `train` and `rollout` (one definition, one help text; defaults
# from the model — tests/unit/test_cli_defaults.py proves every one equals the model's).
GROUP_SIZE_OPT = typer.Option(
    default(RunRequest, "group_size"), rich_help_panel=COLLECTION, help=describe(RunRequest, "group_size")
)
ENV_OPT = typer.Option(
    ..., "--environment", rich_help_panel=COLLECTION, help="Environment base URL (repeat for a portfolio)."
)
GROUPS_OPT = typer.Option(
    default(RunRequest, "groups"), rich_help_panel=COLLECTION, help=describe(RunRequest, "groups")
)
SEED_START_OPT = typer.Option(
    default(RunRequest, "seed_start"),
    rich_help_panel=COLLECTION,
    help=describe(RunRequest, "seed_start", with_bounds=False),
)
MAX_STEPS_OPT = typer.Option(
    default(RunRequest, "max_steps"), rich_help_panel=COLLECTION, help=describe(RunRequest, "max_steps")
)
CONCURRENCY_OPT = typer.Option(
    default(RunRequest, "concurrency"), rich_help_panel=COLLECTION, help=describe(RunRequest, "concurrency")
)
MAX_ACTION_TOKENS_OPT = typer.Option(
    default(RunRequest, "max_action_tokens"), rich_help_panel=POLICY, help=describe(RunRequest, "max_action_tokens")
)
TEMPERATURE_OPT = typer.Option(
    default(RunRequest, "temperature"), rich_help_panel=POLICY, help=describe(RunRequest, "temperature")
)


class Thinking(str, enum.Enum):
    """``--thinking``: auto = reason in <think> first when the model's chat template supports it."""

    auto = "auto"
    on = "on"
    off = "off"


THINKING_VALUES: dict[str, Any] = {"auto": "auto", "on": True, "off": False}  # → RunRequest.thinking
THINKING_OPT = typer.Option(
    Thinking(default(RunRequest, "thinking")),
    "--thinking",
    rich_help_panel=POLICY,
    help="Reason in <think> first (auto: when the model's chat template supports it).",
)
MODEL_OPT = typer.Option(
    default(RunRequest, "model"), "--model", rich_help_panel=POLICY, help=describe(RunRequest, "model")
)
THINKING_BUDGET_OPT = typer.Option(
    default(RunRequest, "thinking_budget_tokens"),
    rich_help_panel=POLICY,
    help=describe(RunRequest, "thinking_budget_tokens"),
)
ADAPTER_OPT = typer.Option(default(RunRequest, "adapter"), rich_help_panel=POLICY, help=describe(RunRequest, "adapter"))
IDEMPOTENCY_OPT = typer.Option(None, rich_help_panel=OUTPUT, help=describe(RunRequest, "idempotency_key"))
# GRPO/ECHO options shared by `openenv train` and `train grpo`.
LEARNING_RATE_OPT = typer.Option(
    default(TrainingConfig, "learning_rate"), rich_help_panel=TRAINING, help=describe(TrainingConfig, "learning_rate")
)
EPOCHS_OPT = typer.Option(
    default(TrainingConfig, "epochs"), rich_help_panel=TRAINING, help=describe(TrainingConfig, "epochs")
)
LORA_RANK_OPT = typer.Option(
    default(TrainingConfig, "lora_rank"), rich_help_panel=TRAINING, help=describe(TrainingConfig, "lora_rank")
)
LORA_ALPHA_OPT = typer.Option(
    default(TrainingConfig, "lora_alpha"), rich_help_panel=TRAINING, help=describe(TrainingConfig, "lora_alpha")
)
KL_COEFF_OPT = typer.Option(
    default(TrainingConfig, "kl_coeff"), rich_help_panel=TRAINING, help=describe(TrainingConfig, "kl_coeff")
)
ECHO_LAMBDA_OPT = typer.Option(
    default(EchoConfig, "lambda_"), rich_help_panel=TRAINING, help=describe(EchoConfig, "lambda_")
)
# Choice flags: the values come from the request models' Literal types (validated locally).
Optimizer = literal_choices("Optimizer", TrainingConfig, "optimizer")
IsLevel = literal_choices("IsLevel", TrainingConfig, "is_level")
BehaviorPolicy = literal_choices("BehaviorPolicy", TrainingConfig, "behavior_policy")
ReportTo = literal_choices("ReportTo", RunRequest, "report_to")
REPORT_TO_OPT = typer.Option(
    ReportTo(default(RunRequest, "report_to")),
    "--report-to",
    rich_help_panel=TRAINING,
    help=describe(RunRequest, "report_to"),
)
AUTO_LOAD_OPT = typer.Option(
    default(RunRequest, "auto_load"),
    "--auto-load/--no-auto-load",
    rich_help_panel=OUTPUT,
    help=describe(RunRequest, "auto_load"),
)
RESET_OPTIONS_OPT = typer.Option(
    None, rich_help_panel=COLLECTION, help="JSON file of reset options for every environment."
)
PREFLIGHT_OPT = typer.Option(
    True,
    "--preflight/--no-preflight",
    rich_help_panel=COLLECTION,
    help="Refuse the run unless every environment answers GET /health now (3 s, in parallel).",
)


@openenv_app.command("train")
def train_cmd(
    environment: list[str] = ENV_OPT,
    groups: int = GROUPS_OPT,
    group_size: int = GROUP_SIZE_OPT,
    output_adapter: str = typer.Option(
        ..., "--output-adapter", rich_help_panel=OUTPUT, help="Name of the adapter to train."
    ),
    seed_start: int = SEED_START_OPT,
    max_steps: int = MAX_STEPS_OPT,
    concurrency: int = CONCURRENCY_OPT,
    max_action_tokens: int = MAX_ACTION_TOKENS_OPT,
    temperature: float = TEMPERATURE_OPT,
    thinking: Thinking = THINKING_OPT,
    thinking_budget_tokens: Optional[int] = THINKING_BUDGET_OPT,
    model: Optional[str] = MODEL_OPT,
    adapter: str = ADAPTER_OPT,
    idempotency_key: Optional[str] = IDEMPOTENCY_OPT,
    reset_options: Optional[Path] = RESET_OPTIONS_OPT,
    learning_rate: Optional[float] = LEARNING_RATE_OPT,
    epochs: int = EPOCHS_OPT,
    lora_rank: int = LORA_RANK_OPT,
    lora_alpha: float = LORA_ALPHA_OPT,
    kl_coeff: float = KL_COEFF_OPT,
    echo_lambda: float = ECHO_LAMBDA_OPT,
    optimizer: Optimizer = typer.Option(
        Optimizer(default(TrainingConfig, "optimizer")),
        rich_help_panel=TRAINING,
        help=describe(TrainingConfig, "optimizer"),
    ),
    is_level: IsLevel = typer.Option(
        IsLevel(default(TrainingConfig, "is_level")),
        "--is-level",
        rich_help_panel=TRAINING,
        help=describe(TrainingConfig, "is_level"),
    ),
    checkpoint_interval: Optional[int] = typer.Option(
        default(TrainingConfig, "checkpoint_interval"),
        rich_help_panel=TRAINING,
        help=describe(TrainingConfig, "checkpoint_interval"),
    ),
    iterations: int = typer.Option(
        default(RunRequest, "iterations"), rich_help_panel=ONLINE_RL, help=describe(RunRequest, "iterations")
    ),
    eval_every: Optional[int] = typer.Option(
        default(RunRequest, "eval_every"),
        rich_help_panel=ONLINE_RL,
        help=describe(RunRequest, "eval_every") + " Needs --eval-groups.",
    ),
    max_staleness: int = typer.Option(
        default(RunRequest, "max_staleness"), rich_help_panel=ONLINE_RL, help=describe(RunRequest, "max_staleness")
    ),
    eval_groups: int = typer.Option(
        0, rich_help_panel=EVALUATION, help="Held-out seed groups for the paired evaluation (0 = none; otherwise >= 1)."
    ),
    eval_group_size: int = typer.Option(
        default(EnvironmentEvalConfig, "group_size"),
        rich_help_panel=EVALUATION,
        help=describe(EnvironmentEvalConfig, "group_size"),
    ),
    eval_seed_start: Optional[int] = typer.Option(
        default(EnvironmentEvalConfig, "seed_start"),
        rich_help_panel=EVALUATION,
        help=describe(EnvironmentEvalConfig, "seed_start", with_bounds=False),
    ),
    gate: bool = typer.Option(
        False,
        "--gate/--no-gate",
        rich_help_panel=EVALUATION,
        help="Gate promotion on the paired sign test (needs >= 20 eval groups).",
    ),
    min_mean_improvement: float = typer.Option(
        default(GateConfig, "min_mean_improvement"),
        rich_help_panel=EVALUATION,
        help=describe(GateConfig, "min_mean_improvement"),
    ),
    min_mean_return: Optional[float] = typer.Option(
        default(GateConfig, "min_mean_return"), rich_help_panel=EVALUATION, help=describe(GateConfig, "min_mean_return")
    ),
    auto_load: bool = AUTO_LOAD_OPT,
    post_eval_suite: Optional[str] = typer.Option(
        None, rich_help_panel=EVALUATION, help="Installed static suite to score the adapter on (e.g. counter-format)."
    ),
    post_eval_min_accuracy: Optional[float] = typer.Option(
        None, rich_help_panel=EVALUATION, help=describe(PostEvalConfig, "min_accuracy")
    ),
    environment_reset_options: Optional[list[str]] = RESET_OPTS,
    credential_id: Optional[list[str]] = CREDENTIAL_OPTS,
    constrained_actions: bool = CONSTRAINED_OPT,
    reset_determinism: ResetDeterminism = RESET_DETERMINISM_OPT,
    replay_ignore: list[str] = REPLAY_IGNORE_OPT,
    context_policy: ContextPolicy = CONTEXT_POLICY_OPT,
    report_to: ReportTo = REPORT_TO_OPT,
    follow_run: bool = FOLLOW_OPT,
    as_json: bool = typer.Option(False, "--json", rich_help_panel=OUTPUT, help="Print the final status as JSON."),
    preflight: bool = PREFLIGHT_OPT,
) -> None:
    """Collect seed-matched groups and train a LoRA adapter (GRPO + ECHO) as one durable run."""
    request = _request_from_flags(
        "train",
        environment,
        groups,
        group_size,
        seed_start,
        max_steps,
        concurrency,
        max_action_tokens,
        temperature,
        thinking,
        thinking_budget_tokens,
        adapter,
        output_adapter,
        idempotency_key,
        reset_options,
        environment_reset_options,
        credential_id,
        constrained_actions,
        model,
        reset_determinism,
        replay_ignore,
        context_policy,
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
    request["training_config"]["optimizer"] = optimizer.value
    request["training_config"]["is_level"] = is_level.value
    request["auto_load"] = auto_load
    if iterations != 1:
        request["iterations"] = iterations
    if eval_every is not None:
        request["eval_every"] = eval_every
    if max_staleness:
        request["max_staleness"] = max_staleness
    if report_to.value != "none":
        request["report_to"] = report_to.value
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
    _check_flags(request)
    _submit_and_follow(request, follow_run, as_json, preflight)


@openenv_app.command("rollout")
def rollout_cmd(
    environment: list[str] = ENV_OPT,
    groups: int = GROUPS_OPT,
    group_size: int = GROUP_SIZE_OPT,
    seed_start: int = SEED_START_OPT,
    max_steps: int = MAX_STEPS_OPT,
    concurrency: int = CONCURRENCY_OPT,
    max_action_tokens: int = MAX_ACTION_TOKENS_OPT,
    temperature: float = TEMPERATURE_OPT,
    thinking: Thinking = THINKING_OPT,
    thinking_budget_tokens: Optional[int] = THINKING_BUDGET_OPT,
    model: Optional[str] = MODEL_OPT,
    adapter: str = ADAPTER_OPT,
    idempotency_key: Optional[str] = IDEMPOTENCY_OPT,
    reset_options: Optional[Path] = RESET_OPTIONS_OPT,
    environment_reset_options: Optional[list[str]] = RESET_OPTS,
    credential_id: Optional[list[str]] = CREDENTIAL_OPTS,
    constrained_actions: bool = CONSTRAINED_OPT,
    reset_determinism: ResetDeterminism = RESET_DETERMINISM_OPT,
    replay_ignore: list[str] = REPLAY_IGNORE_OPT,
    context_policy: ContextPolicy = CONTEXT_POLICY_OPT,
    output: Optional[Path] = typer.Option(
        None, "--output", rich_help_panel=OUTPUT, help="Write the rollouts JSONL here (e.g. X.rollouts.jsonl)."
    ),
    replay_output: Optional[Path] = typer.Option(
        None, "--replay-output", rich_help_panel=OUTPUT, help="Write the replay transcript here (X.replay.json)."
    ),
    summary_output: Optional[Path] = typer.Option(
        None, "--summary-output", rich_help_panel=OUTPUT, help="Write the summary here (X.rollout-summary.json)."
    ),
    force: bool = typer.Option(False, "--force", rich_help_panel=OUTPUT, help="Overwrite existing output files."),
    follow_run: bool = FOLLOW_OPT,
    as_json: bool = typer.Option(False, "--json", rich_help_panel=OUTPUT, help="Print the final status as JSON."),
    preflight: bool = PREFLIGHT_OPT,
) -> None:
    """Collect rollouts only (a run of kind rollout): dataset, replay and summary artifacts.

    With --output/--replay-output/--summary-output the command waits for the run and downloads
    the files (size and SHA-256 rechecked against the manifest); `kiln openenv verify
    --summary X.rollout-summary.json` then checks them offline.
    """
    request = _request_from_flags(
        "rollout",
        environment,
        groups,
        group_size,
        seed_start,
        max_steps,
        concurrency,
        max_action_tokens,
        temperature,
        thinking,
        thinking_budget_tokens,
        adapter,
        None,
        idempotency_key,
        reset_options,
        environment_reset_options,
        credential_id,
        constrained_actions,
        model,
        reset_determinism,
        replay_ignore,
        context_policy,
    )
    _check_flags(request)
    if output is None and replay_output is None and summary_output is None:
        _submit_and_follow(request, follow_run, as_json, preflight)
        return
    from kiln.cli.control_cmds import follow_and_download, rollout_output_mapping
    from kiln.cli.follow import print_links

    api = _api()
    try:
        code, status = api.submit(request, preflight=preflight)
    except KilnError as error:
        _fail(error)
        return
    run_id = status.run_id
    out = progress()
    out.print(f"run {run_id} {'submitted' if code == 202 else 'already exists (idempotent retry)'}")
    print_links(status, out, api.base_url)
    exit_code = follow_and_download(
        api, run_id, rollout_output_mapping(output, replay_output, summary_output), force=force, out=out
    )
    if exit_code == 0 and output is not None and replay_output is not None and summary_output is not None:
        from kiln.core.rollout.verify.files import verify_command

        command = verify_command(summary_output, output, replay_output)
        if command is not None:  # names the summary does not pair with by itself
            out.print(f"verify with: {command}", markup=False, highlight=False)
    if as_json:  # --output does not turn --json off: the final status, then the exit code
        print_json(api.status(run_id))
    raise typer.Exit(exit_code)


@openenv_app.command("start")
def start_cmd(
    request_file: Path = typer.Option(..., "--request", help="JSON run request file (≤ 1 MiB)."),
    follow_run: bool = FOLLOW_OPT,
    as_json: bool = typer.Option(False, "--json", help="Print status as JSON."),
    preflight: bool = PREFLIGHT_OPT,
) -> None:
    """Submit a run request file (the body of POST /v1/openenv/runs)."""
    if request_file.stat().st_size > 1024 * 1024:
        _fail(KilnError("request file is larger than 1 MiB", code="openenv_invalid_request"))
    _submit_and_follow(json.loads(request_file.read_text()), follow_run, as_json, preflight)


@train_app.command("grpo")
def train_grpo_cmd(
    input_path: Path = typer.Option(
        ..., "--input", help="A rollouts JSONL written by Kiln (kiln openenv rollout --output)."
    ),
    output_adapter: str = typer.Option(
        ..., "--output-adapter", rich_help_panel=OUTPUT, help="Name of the adapter to train."
    ),
    learning_rate: Optional[float] = LEARNING_RATE_OPT,
    epochs: int = EPOCHS_OPT,
    lora_rank: int = LORA_RANK_OPT,
    lora_alpha: float = LORA_ALPHA_OPT,
    kl_coeff: float = KL_COEFF_OPT,
    echo_lambda: float = ECHO_LAMBDA_OPT,
    behavior_policy: BehaviorPolicy = typer.Option(
        BehaviorPolicy(default(TrainingConfig, "behavior_policy")), help=describe(TrainingConfig, "behavior_policy")
    ),
    auto_load: bool = AUTO_LOAD_OPT,
    report_to: ReportTo = REPORT_TO_OPT,
    follow_run: bool = FOLLOW_OPT,
    as_json: bool = typer.Option(False, "--json", rich_help_panel=OUTPUT, help="Print the final status as JSON."),
) -> None:
    """Train GRPO+ECHO from a saved rollouts file, through the same training activity as a run.

    The rollouts' behaviour policy must match the workers' base model (and the published adapter
    it names, if any): the on-policy proof fails closed otherwise.
    """
    from kiln.cli.follow import exit_code, follow, print_links, print_outcome

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
                "report_to": report_to.value,
                "training_config": {
                    "learning_rate": learning_rate,
                    "epochs": epochs,
                    "lora_rank": lora_rank,
                    "lora_alpha": lora_alpha,
                    "kl_coeff": kl_coeff,
                    "behavior_policy": behavior_policy.value,
                    "echo": {"lambda": echo_lambda} if echo_lambda > 0 else None,
                },
            }
        )
    except KilnError as error:
        _fail(error)
        return
    run_id = status.run_id
    progress().print(f"training run {run_id} submitted (dataset {dataset['sha256']}, {dataset['bytes']} B)")
    print_links(status, progress(), api.base_url)
    if not follow_run:
        return
    final = follow(lambda: api.status(run_id), console)
    if as_json:
        print_json(final)
        raise typer.Exit(exit_code(final))
    raise typer.Exit(print_outcome(final, console, api.base_url))


def _register_extensions() -> None:
    from kiln.cli.control_cmds import register as register_control
    from kiln.cli.verify_cmds import register as register_verify

    register_control(openenv_app)
    register_verify(openenv_app)


_register_extensions()


def main() -> None:
    from kiln.cli.console import flush_quietly
    from kiln.cli.help import plain_command

    try:
        plain_command(app)()
    finally:
        flush_quietly()  # `kiln … | head`: exit with the command's own code, quietly


if __name__ == "__main__":
    main()
