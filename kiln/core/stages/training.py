"""Training on a gpu worker: load the groups, select, train GRPO+ECHO, store adapter and receipt.

Imports ``kiln.core.train`` (torch): only the gpu worker imports this module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from kiln.core.artifacts.store import S3Store
from kiln.core.canonical import pretty_json
from kiln.core.errors import ArtifactIntegrityFailed, ArtifactNotFound, PolicyIdentityChanged, TrainingFailed
from kiln.core.policy.identity import model_content_sha256
from kiln.core.artifacts.group_sets import read_group_documents
from kiln.core.records import AdapterFile, GroupSet, StoredObject, TrainInput, TrainResult
from kiln.core.stale_pipeline import StaleBound, bound_groups
from kiln.core.artifacts.adapters import materialise
from kiln.core.artifacts.selections import brief_selection, store_selection
from kiln.core.train.checkpoints import pack_folder, unpack_folder
from kiln.core.train.selection import select_groups
from kiln.core.train.trainer import train_grpo
from kiln.core.unfinished_thinking import FIX, groups_named, unfinished_thinking_groups, unfinished_thinking_message


def load_group_lines(store: S3Store, groups: GroupSet) -> list[dict[str, Any]]:
    documents = read_group_documents(store, groups)
    documents.sort(key=lambda doc: doc["group_index"])
    return [doc["line"] for doc in documents]


def _train(launch: Any, **kwargs: Any) -> Any:
    """``train_grpo`` in this process, or across the ranks of ``launch`` (a
    :class:`kiln.core.train.launch.Launch`: spawned ranks, rank 0's result)."""
    if launch is None:
        return train_grpo(**kwargs)
    from kiln.core.train.launch import train_across

    kwargs.pop("device", None)  # each rank has its own
    kwargs.pop("shared_base", None)  # each rank loads (and shards) its own base model
    return train_across(launch, **kwargs)


def stale_bound(inp: TrainInput, groups: int) -> StaleBound | None:
    """The version bound of a run with ``max_staleness`` > 1 over this training's ``groups`` (all
    sampled by ``behavior_version``; training starts from version ``iteration − 1``); None otherwise."""
    if inp.max_staleness is None or inp.behavior_version is None or inp.iteration is None:
        return None
    if inp.staleness != inp.iteration - 1 - inp.behavior_version:
        raise TrainingFailed(
            f"staleness {inp.staleness} disagrees with behavior_version {inp.behavior_version} at iteration "
            f"{inp.iteration} (the lag is iteration − 1 − behavior_version)",
            code="staleness_invalid",
            hint="give the staleness the pipeline's versions imply",
        )
    return bound_groups([inp.behavior_version] * groups, inp.iteration - 1, inp.max_staleness)


def train(
    inp: TrainInput,
    *,
    store: S3Store,
    model_path: Path,
    work_dir: Path,
    cache_dir: Path,
    heartbeat: Callable[[dict[str, Any]], None],
    should_cancel: Callable[[], bool],
    resume_checkpoint: StoredObject | None = None,
    resume_step: int | None = None,
    device: str | None = None,
    dtype: str = "float32",
    shared_base: Any = None,
    launch: Any = None,
) -> TrainResult:
    """Train one iteration's adapter from its stored groups (resuming from ``resume_checkpoint``
    when given) and store what it made; the record names the adapter files and the receipt."""
    lines = load_group_lines(store, inp.groups)
    config = inp.training_config
    bound = stale_bound(inp, len(lines))
    dropped = bound.warnings() if bound is not None else None
    kept, selection = select_groups(lines, config.on_no_output, dropped)  # once: train_grpo reuses it
    if bound is not None:
        selection["stale"] = bound.block()
    if not kept:
        return _nothing_to_train(store, inp, lines, selection)
    live_base = model_content_sha256(model_path)
    if inp.behavior_policy.get("base_model_sha256") != live_base:
        raise PolicyIdentityChanged(
            "the trainer's base model differs from the model the rollouts were sampled with",
            hint="train on the same KILN_MODEL_PATH the gpu workers collected with",
        )
    base_adapter_dir = materialise(store, inp.base_adapter, cache_dir) if inp.base_adapter else None
    behavior_dir = materialise(store, inp.behavior_adapter, cache_dir) if inp.behavior_adapter else None
    init_state = None
    if inp.init_state is not None:
        init_state = work_dir / "init_state.tar"
        init_state.write_bytes(store.get_bytes(inp.init_state.ref()))
    resume_dir, resume_refused = _unpack_resume(store, resume_checkpoint, work_dir)

    # Until this attempt writes its own checkpoint, keep naming the one it resumed from, so an
    # attempt that dies early does not make the next one start over from step 0.
    last_checkpoint: dict[str, Any] = (
        {"checkpoint": resume_checkpoint.model_dump(), "checkpoint_step": resume_step}
        if resume_checkpoint is not None
        else {}
    )

    def on_progress(details: dict[str, Any]) -> None:
        heartbeat({**details, **last_checkpoint})

    def on_checkpoint(step: int, folder: Path) -> None:
        ref = store.put_blob(pack_folder(folder))
        last_checkpoint.clear()
        last_checkpoint["checkpoint"] = StoredObject.of(ref).model_dump()
        last_checkpoint["checkpoint_step"] = step
        heartbeat(dict(last_checkpoint))

    result = _train(
        launch,
        model_path=model_path,
        groups=lines,
        config=config,
        output_dir=work_dir / "out",
        base_adapter_dir=base_adapter_dir,
        expected_behavior_policy=inp.behavior_policy,
        progress=on_progress,
        resume_from=resume_dir,
        checkpoint_sink=on_checkpoint,
        should_cancel=should_cancel,
        device=device,
        dtype=dtype,
        shared_base=shared_base,
        selected=(kept, selection),
        init_state=init_state,
        keep_state=inp.keep_state,
        behavior_adapter_dir=behavior_dir,
        staleness=inp.staleness,
        iteration=inp.iteration,
        iterations_total=inp.iterations_total,
        lr_horizon_steps=inp.lr_horizon_steps,
        resume_refused=resume_refused,
    )
    return _stored(store, inp, result, selection)


def _nothing_to_train(
    store: S3Store, inp: TrainInput, lines: list[dict[str, Any]], selection: dict[str, Any]
) -> TrainResult:
    """Every group was skipped: fail with the cause (``training_failed``, ``zero_groups``), or, where
    the request allows an empty training, complete untrained with the skip reasons."""
    # The cause first when it is thinking that never finished (the fix is the user's to make).
    unfinished = unfinished_thinking_groups(lines)
    cause = [unfinished_thinking_message(groups_named(unfinished, len(lines)))] if unfinished else []
    if not inp.allow_empty_training:
        raise TrainingFailed(
            "every seed group was skipped before training, so no adapter was trained: "
            + "; ".join(cause + selection.get("warnings", [])[:8]),
            hint=(FIX + "; " if unfinished else "") + "groups need reward variation and final model actions; "
            "collect more or larger groups, or set allow_empty_training: true to let such a run complete "
            "without an adapter",
            retryable=False,
            details={
                "reason": "zero_groups",
                "groups_submitted": selection.get("groups_submitted"),
                **({"unfinished_thinking_groups": unfinished[:64]} if unfinished else {}),
            },
        )
    warnings = cause + selection.get("warnings", [])
    more = f"; and {len(warnings) - 8} more" if len(warnings) > 8 else ""
    return TrainResult(
        trained=False,
        skip_reason="every seed group was skipped before training: " + "; ".join(warnings[:8]) + more,
        selection=brief_selection(selection),
        selection_ref=store_selection(store, selection),
    )


def _stored(store: S3Store, inp: TrainInput, result: Any, selection: dict[str, Any]) -> TrainResult:
    """Store the adapter files, the receipt and the final optimizer state; the record naming them."""
    receipt = dict(result.receipt)
    receipt["adapter_name"] = inp.output_adapter
    receipt["run_id"] = inp.run_id
    receipt["selection"] = selection
    receipt_ref = store.put_blob(pretty_json(receipt))
    files = [
        AdapterFile(name=path.name, object=StoredObject.of(store.put_file(path)))
        for path in sorted(result.adapter_dir.iterdir())
        if path.is_file()
    ]
    loss = receipt.get("loss") or {}
    counts = receipt["token_counts"]
    final_state = None
    if result.final_state is not None:
        final_state = StoredObject.of(store.put_file(result.final_state))
    return TrainResult(
        trained=True,
        selection=brief_selection(selection),
        selection_ref=store_selection(store, selection),
        adapter_files=files,
        adapter_sha256=receipt.get("adapter_sha256"),
        receipt=StoredObject.of(receipt_ref),
        steps=result.steps,
        final_loss=loss.get("final"),
        final_state=final_state,
        kl=result.kl,
        kl_to_previous=result.kl_to_previous,
        kl_to_base=result.kl_to_base,
        early_stop_step=result.early_stop_step,
        tokens=counts["action_tokens"] + counts["context_tokens"] + counts["env_tokens_before_warning_filter"],
        action_tokens=counts["action_tokens"],
    )


def _unpack_resume(store: S3Store, checkpoint: StoredObject | None, work_dir: Path) -> tuple[Path | None, str | None]:
    """The checkpoint to resume from, unpacked, or why it could not be (training then restarts)."""
    if checkpoint is None:
        return None, None
    try:  # an outage is waited out by the store; a checkpoint gone or damaged restarts training
        return unpack_folder(store.get_bytes(checkpoint.ref()), work_dir / "resume"), None
    except (ArtifactNotFound, ArtifactIntegrityFailed, TrainingFailed) as exc:
        return None, f"the checkpoint could not be fetched: {exc.message}"
