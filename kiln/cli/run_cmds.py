"""The commands that submit runs: ``kiln openenv train``, ``rollout`` and ``start``, and ``kiln train
grpo`` (a saved rollouts file); each submits through ``kiln.client`` and follows the run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Optional

import typer

from kiln.cli.console import answer, console, fail as _fail, print_json, progress
from kiln.cli.control_cmds import api_client
from kiln.cli.follow import FOLLOW_OPT
from kiln.cli.help import OUTPUT
from kiln.cli.model_options import default, describe
from kiln.cli.run_flags import (
    ADAPTER_OPT,
    AUTO_LOAD_OPT,
    BehaviorPolicy,
    CHECKPOINT_INTERVAL_OPT,
    CONCURRENCY_OPT,
    CONSTRAINED_OPT,
    CONTEXT_POLICY_OPT,
    CREDENTIAL_OPTS,
    ContextPolicy,
    ECHO_LAMBDA_OPT,
    ENV_OPT,
    EPOCHS_OPT,
    EVAL_EVERY_OPT,
    EVAL_GROUPS_OPT,
    EVAL_GROUP_SIZE_OPT,
    EVAL_SEED_START_OPT,
    GATE_OPT,
    GROUPS_OPT,
    GROUP_SIZE_OPT,
    IDEMPOTENCY_OPT,
    IS_LEVEL_OPT,
    ITERATIONS_OPT,
    IsLevel,
    JSON_OPT,
    KL_COEFF_OPT,
    LEARNING_RATE_OPT,
    LORA_ALPHA_OPT,
    LORA_RANK_OPT,
    MAX_ACTION_TOKENS_OPT,
    MAX_STALENESS_OPT,
    MAX_STEPS_OPT,
    MIN_MEAN_IMPROVEMENT_OPT,
    MIN_MEAN_RETURN_OPT,
    MODEL_OPT,
    OPTIMIZER_OPT,
    OUTPUT_ADAPTER_OPT,
    Optimizer,
    POST_EVAL_MIN_ACCURACY_OPT,
    POST_EVAL_SUITE_OPT,
    PREFLIGHT_OPT,
    REPLAY_IGNORE_OPT,
    REPORT_TO_OPT,
    RESET_DETERMINISM_OPT,
    RESET_OPTIONS_OPT,
    RESET_OPTS,
    ReportTo,
    ResetDeterminism,
    SEED_START_OPT,
    TEMPERATURE_OPT,
    THINKING_BUDGET_OPT,
    THINKING_OPT,
    Thinking,
    check_flags,
    collection_request,
    train_request,
    training_config,
)
from kiln.core.errors import KilnError
from kiln.core.training_config import TrainingConfig

if TYPE_CHECKING:
    from rich.console import Console

    from kiln.client.http import ApiClient
    from kiln.core.run_view import RunView


def submit_and_follow(request: dict[str, Any], follow_run: bool, as_json: bool, preflight: bool = True) -> None:
    from kiln.cli.follow import print_links

    api = api_client()
    code, status = answer(lambda: api.submit(request, preflight=preflight))
    run_id = status.run_id
    out = progress()  # stderr under --json: stdout then holds only the JSON document
    if not follow_run:
        if as_json:
            print_json(status)
        else:
            out.print(f"run {run_id} {'submitted' if code == 202 else 'already exists'}")
            print_links(status, out, api.base_url)
        return
    _announce(api, code, status, out)
    _follow_to_end(api, run_id, out, as_json)


def _announce(api: ApiClient, code: int, status: RunView, out: Console) -> None:
    """The lines of a followed submission: the run id (new or an idempotent retry) and its links."""
    from kiln.cli.follow import print_links

    out.print(f"run {status.run_id} {'submitted' if code == 202 else 'already exists (idempotent retry)'}")
    print_links(status, out, api.base_url)


def _follow_to_end(api: ApiClient, run_id: str, out: Console, as_json: bool) -> NoReturn:
    """Follow the run to its end, print its outcome (or, under ``--json``, its final status) and
    exit with the status its state maps to."""
    from kiln.cli.follow import exit_code, follow, print_outcome

    final = follow(lambda: api.status(run_id), out)
    if as_json:
        print_json(final)
        raise typer.Exit(exit_code(final))
    raise typer.Exit(print_outcome(final, out, api.base_url))


def train_cmd(
    environment: list[str] = ENV_OPT,
    groups: int = GROUPS_OPT,
    group_size: int = GROUP_SIZE_OPT,
    output_adapter: str = OUTPUT_ADAPTER_OPT,
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
    optimizer: Optimizer = OPTIMIZER_OPT,
    is_level: IsLevel = IS_LEVEL_OPT,
    checkpoint_interval: Optional[int] = CHECKPOINT_INTERVAL_OPT,
    iterations: int = ITERATIONS_OPT,
    eval_every: Optional[int] = EVAL_EVERY_OPT,
    max_staleness: int = MAX_STALENESS_OPT,
    eval_groups: int = EVAL_GROUPS_OPT,
    eval_group_size: int = EVAL_GROUP_SIZE_OPT,
    eval_seed_start: Optional[int] = EVAL_SEED_START_OPT,
    gate: bool = GATE_OPT,
    min_mean_improvement: float = MIN_MEAN_IMPROVEMENT_OPT,
    min_mean_return: Optional[float] = MIN_MEAN_RETURN_OPT,
    auto_load: bool = AUTO_LOAD_OPT,
    post_eval_suite: Optional[str] = POST_EVAL_SUITE_OPT,
    post_eval_min_accuracy: Optional[float] = POST_EVAL_MIN_ACCURACY_OPT,
    environment_reset_options: Optional[list[str]] = RESET_OPTS,
    credential_id: Optional[list[str]] = CREDENTIAL_OPTS,
    constrained_actions: bool = CONSTRAINED_OPT,
    reset_determinism: ResetDeterminism = RESET_DETERMINISM_OPT,
    replay_ignore: list[str] = REPLAY_IGNORE_OPT,
    context_policy: ContextPolicy = CONTEXT_POLICY_OPT,
    report_to: ReportTo = REPORT_TO_OPT,
    follow_run: bool = FOLLOW_OPT,
    as_json: bool = JSON_OPT,
    preflight: bool = PREFLIGHT_OPT,
) -> None:
    """Collect seed-matched groups and train a LoRA adapter (GRPO + ECHO) as one durable run."""
    request = train_request(dict(locals()))
    check_flags(request)
    submit_and_follow(request, follow_run, as_json, preflight)


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
    as_json: bool = JSON_OPT,
    preflight: bool = PREFLIGHT_OPT,
) -> None:
    """Collect rollouts only (a run of kind rollout): dataset, replay and summary artifacts.

    With --output/--replay-output/--summary-output the command waits for the run and downloads
    the files (size and SHA-256 rechecked against the manifest); `kiln openenv verify
    --summary X.rollout-summary.json` then checks them offline.
    """
    request = collection_request("rollout", **locals())
    check_flags(request)
    if output is None and replay_output is None and summary_output is None:
        submit_and_follow(request, follow_run, as_json, preflight)
        return
    from kiln.cli.control_cmds import follow_and_download, rollout_output_mapping

    api = api_client()
    code, status = answer(lambda: api.submit(request, preflight=preflight))
    run_id = status.run_id
    out = progress()
    _announce(api, code, status, out)
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


def start_cmd(
    request_file: Path = typer.Option(..., "--request", help="JSON run request file (≤ 1 MiB)."),
    follow_run: bool = FOLLOW_OPT,
    as_json: bool = typer.Option(False, "--json", help="Print status as JSON."),
    preflight: bool = PREFLIGHT_OPT,
) -> None:
    """Submit a run request file (the body of POST /v1/openenv/runs)."""
    if request_file.stat().st_size > 1024 * 1024:
        _fail(KilnError("request file is larger than 1 MiB", code="openenv_invalid_request"))
    submit_and_follow(json.loads(request_file.read_text()), follow_run, as_json, preflight)


def train_grpo_cmd(
    input_path: Path = typer.Option(
        ..., "--input", help="A rollouts JSONL written by Kiln (kiln openenv rollout --output)."
    ),
    output_adapter: str = OUTPUT_ADAPTER_OPT,
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
    as_json: bool = JSON_OPT,
) -> None:
    """Train GRPO+ECHO from a saved rollouts file, through the same training activity as a run.

    The rollouts' behaviour policy must match the workers' base model (and the published adapter
    it names, if any): the on-policy proof fails closed otherwise.
    """
    from kiln.cli.follow import print_links

    if not input_path.is_file():
        _fail(KilnError(f"--input {input_path} is not a file", code="openenv_invalid_request"))
    if input_path.stat().st_size > 256 * 1024 * 1024:
        _fail(KilnError(f"--input {input_path} is larger than 256 MiB", code="openenv_invalid_request"))
    api = api_client()
    try:
        dataset = api.upload_dataset(input_path.read_bytes())
        status = api.train_dataset(
            {
                "dataset": dataset,
                "output_adapter": output_adapter,
                "auto_load": auto_load,
                "report_to": report_to.value,
                "training_config": training_config(
                    learning_rate=learning_rate,
                    epochs=epochs,
                    lora_rank=lora_rank,
                    lora_alpha=lora_alpha,
                    kl_coeff=kl_coeff,
                    echo_lambda=echo_lambda,
                    behavior_policy=behavior_policy.value,
                ),
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
    _follow_to_end(api, run_id, console, as_json)
