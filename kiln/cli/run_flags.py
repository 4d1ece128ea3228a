"""The options of ``kiln openenv train``/``rollout`` and ``kiln train grpo``, and the request their
flags build: one definition and one help text per option, each default read from the request
models (``tests/unit/test_cli_defaults.py`` proves every one equals the model's)."""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from kiln.cli.console import fail as _fail
from kiln.cli.flags import check_request, literal_choices

# Help panels of `openenv train`/`rollout` (kiln.cli.help draws them; unpanelled options come last).
from kiln.cli.help import COLLECTION, EVALUATION, ONLINE_RL, OUTPUT, POLICY, TRAINING
from kiln.cli.model_options import default, describe
from kiln.core.contracts import RunRequest
from kiln.core.errors import KilnError
from kiln.core.training_config import EchoConfig, EnvironmentEvalConfig, GateConfig, PostEvalConfig, TrainingConfig

# Choice flags: the values come from the request models' Literal types (validated locally).
# typer reads the generated classes; mypy, which cannot see generated members, sees a StrEnum.
if TYPE_CHECKING:
    ResetDeterminism = enum.StrEnum
    ContextPolicy = enum.StrEnum
    Optimizer = enum.StrEnum
    IsLevel = enum.StrEnum
    BehaviorPolicy = enum.StrEnum
    ReportTo = enum.StrEnum
else:
    ResetDeterminism = literal_choices("ResetDeterminism", RunRequest, "reset_determinism")
    ContextPolicy = literal_choices("ContextPolicy", RunRequest, "context_policy")
    Optimizer = literal_choices("Optimizer", TrainingConfig, "optimizer")
    IsLevel = literal_choices("IsLevel", TrainingConfig, "is_level")
    BehaviorPolicy = literal_choices("BehaviorPolicy", TrainingConfig, "behavior_policy")
    ReportTo = literal_choices("ReportTo", RunRequest, "report_to")

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
RESET_DETERMINISM_OPT = typer.Option(
    ResetDeterminism(default(RunRequest, "reset_determinism")),
    "--reset-determinism",
    rich_help_panel=COLLECTION,
    help=describe(RunRequest, "reset_determinism"),
)
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


OUTPUT_ADAPTER_OPT = typer.Option(..., "--output-adapter", rich_help_panel=OUTPUT, help="Name of the adapter to train.")
JSON_OPT = typer.Option(False, "--json", rich_help_panel=OUTPUT, help="Print the final status as JSON.")
# Options of `openenv train` alone: the optimizer, online RL, and the evaluations after training.
OPTIMIZER_OPT = typer.Option(
    Optimizer(default(TrainingConfig, "optimizer")),
    rich_help_panel=TRAINING,
    help=describe(TrainingConfig, "optimizer"),
)
IS_LEVEL_OPT = typer.Option(
    IsLevel(default(TrainingConfig, "is_level")),
    "--is-level",
    rich_help_panel=TRAINING,
    help=describe(TrainingConfig, "is_level"),
)
CHECKPOINT_INTERVAL_OPT = typer.Option(
    default(TrainingConfig, "checkpoint_interval"),
    rich_help_panel=TRAINING,
    help=describe(TrainingConfig, "checkpoint_interval"),
)
ITERATIONS_OPT = typer.Option(
    default(RunRequest, "iterations"), rich_help_panel=ONLINE_RL, help=describe(RunRequest, "iterations")
)
EVAL_EVERY_OPT = typer.Option(
    default(RunRequest, "eval_every"),
    rich_help_panel=ONLINE_RL,
    help=describe(RunRequest, "eval_every") + " Needs --eval-groups.",
)
MAX_STALENESS_OPT = typer.Option(
    default(RunRequest, "max_staleness"), rich_help_panel=ONLINE_RL, help=describe(RunRequest, "max_staleness")
)
EVAL_GROUPS_OPT = typer.Option(
    0, rich_help_panel=EVALUATION, help="Held-out seed groups for the paired evaluation (0 = none; otherwise >= 1)."
)
EVAL_GROUP_SIZE_OPT = typer.Option(
    default(EnvironmentEvalConfig, "group_size"),
    rich_help_panel=EVALUATION,
    help=describe(EnvironmentEvalConfig, "group_size"),
)
EVAL_SEED_START_OPT = typer.Option(
    default(EnvironmentEvalConfig, "seed_start"),
    rich_help_panel=EVALUATION,
    help=describe(EnvironmentEvalConfig, "seed_start", with_bounds=False),
)
GATE_OPT = typer.Option(
    False,
    "--gate/--no-gate",
    rich_help_panel=EVALUATION,
    help="Gate promotion on the paired sign test (needs >= 20 eval groups).",
)
MIN_MEAN_IMPROVEMENT_OPT = typer.Option(
    default(GateConfig, "min_mean_improvement"),
    rich_help_panel=EVALUATION,
    help=describe(GateConfig, "min_mean_improvement"),
)
MIN_MEAN_RETURN_OPT = typer.Option(
    default(GateConfig, "min_mean_return"), rich_help_panel=EVALUATION, help=describe(GateConfig, "min_mean_return")
)
POST_EVAL_SUITE_OPT = typer.Option(
    None, rich_help_panel=EVALUATION, help="Installed static suite to score the adapter on (e.g. counter-format)."
)
POST_EVAL_MIN_ACCURACY_OPT = typer.Option(
    None, rich_help_panel=EVALUATION, help=describe(PostEvalConfig, "min_accuracy")
)


def _choice(value: Any) -> str:
    return str(value.value if isinstance(value, enum.Enum) else value)


def collection_request(
    kind: str,
    *,
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
    idempotency_key: Optional[str],
    reset_options: Optional[Path],
    environment_reset_options: Optional[list[str]],
    credential_id: Optional[list[str]],
    constrained_actions: bool,
    model: Optional[str],
    reset_determinism: Any,
    replay_ignore: Optional[list[str]],
    context_policy: Any,
    output_adapter: Optional[str] = None,
    **_other_flags: Any,  # a command's own flags, read by its own builder
) -> dict[str, Any]:
    """The run request the collection flags of ``train``/``rollout`` give (only what differs
    from the model's defaults beyond the always-sent core)."""
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
    optional = {
        "model": model,
        "thinking_budget_tokens": thinking_budget_tokens,
        "output_adapter": output_adapter,
        "idempotency_key": idempotency_key,
    }
    request.update({name: value for name, value in optional.items() if value is not None})
    if constrained_actions:
        request["constrained_actions"] = True
    for name, value in (("reset_determinism", reset_determinism), ("context_policy", context_policy)):
        if _choice(value) != default(RunRequest, name):
            request[name] = _choice(value)
    if replay_ignore:
        request["replay_ignore"] = list(replay_ignore)
    if reset_options is not None:
        request["reset_options"] = _read_json_object(reset_options, "--reset-options")
    if environment_reset_options:
        request["environment_reset_options"] = _per_environment_options(environment_reset_options, len(environment))
    if credential_id:
        request["credential_ids"] = [None if c == "-" else c for c in credential_id]
    return request


def _per_environment_options(files: list[str], environments: int) -> list[dict[str, Any]]:
    if len(files) != environments:
        _fail(
            KilnError(
                f"got {len(files)} --environment-reset-options for {environments} --environment values",
                code="openenv_invalid_request",
                hint="give one file per --environment, in order ('-' = no options)",
            )
        )
    return [{} if item == "-" else _read_json_object(Path(item), "--environment-reset-options") for item in files]


def training_config(
    *,
    learning_rate: Optional[float],
    epochs: int,
    lora_rank: int,
    lora_alpha: float,
    kl_coeff: float,
    echo_lambda: float,
    **extra: Any,
) -> dict[str, Any]:
    """``training_config`` from the GRPO/ECHO flags ``openenv train`` and ``train grpo`` share;
    ``extra`` holds a command's further training settings (already request values)."""
    config: dict[str, Any] = {
        "learning_rate": learning_rate,
        "epochs": epochs,
        "lora_rank": lora_rank,
        "lora_alpha": lora_alpha,
        "kl_coeff": kl_coeff,
        "echo": {"lambda": echo_lambda} if echo_lambda > 0 else None,
    }
    return {**config, **extra}


def train_request(flags: dict[str, Any]) -> dict[str, Any]:
    """The whole ``openenv train`` request from its flags (``flags``: the command's parameters)."""
    request = collection_request("train", **flags)
    request["training_config"] = training_config(
        **{name: flags[name] for name in ("learning_rate", "epochs", "lora_rank", "lora_alpha", "kl_coeff")},
        echo_lambda=flags["echo_lambda"],
        checkpoint_interval=flags["checkpoint_interval"],
        optimizer=flags["optimizer"].value,
        is_level=flags["is_level"].value,
    )
    request["auto_load"] = flags["auto_load"]
    if flags["iterations"] != 1:
        request["iterations"] = flags["iterations"]
    if flags["eval_every"] is not None:
        request["eval_every"] = flags["eval_every"]
    if flags["max_staleness"]:
        request["max_staleness"] = flags["max_staleness"]
    if flags["report_to"].value != "none":
        request["report_to"] = flags["report_to"].value
    if flags["post_eval_suite"] is not None:
        request["post_eval"] = {"suite": flags["post_eval_suite"]}
        if flags["post_eval_min_accuracy"] is not None:
            request["post_eval"]["min_accuracy"] = flags["post_eval_min_accuracy"]
    evaluation = _environment_eval(flags)
    if evaluation is not None:
        request["environment_eval"] = evaluation
    return request


def _environment_eval(flags: dict[str, Any]) -> dict[str, Any] | None:
    if flags["eval_groups"] <= 0:
        if flags["gate"]:
            _fail(KilnError("--gate needs --eval-groups >= 20", code="openenv_invalid_request"))
        return None
    evaluation: dict[str, Any] = {"groups": flags["eval_groups"], "group_size": flags["eval_group_size"]}
    if flags["eval_seed_start"] is not None:
        evaluation["seed_start"] = flags["eval_seed_start"]
    if flags["gate"]:
        evaluation["gate"] = {"min_mean_improvement": flags["min_mean_improvement"]}
        if flags["min_mean_return"] is not None:
            evaluation["gate"]["min_mean_return"] = flags["min_mean_return"]
    return evaluation


def check_flags(request: dict[str, Any]) -> None:
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
