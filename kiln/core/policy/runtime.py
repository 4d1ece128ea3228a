"""The in-process policy runtime of the gpu worker: base model, tokenizer, LRU of LoRA adapters.

Any chat model folder works: the token glue (stop token, observation-turn opening and closing,
generation prompt, thinking support) is derived from the model's own chat template by render-diff
(:mod:`kiln.core.policy.chat_glue`). Token-in, token-out: prompts are token ids rendered once with the
template (:meth:`PolicyRuntime.encode_prompt`); later turns are *appended* ids
(:meth:`PolicyRuntime.encode_observation_turn`), never a re-render. The model is loaded on a
resolved device/dtype (:mod:`kiln.core.policy.device`), and the trainer borrows the same base model
(:meth:`PolicyRuntime.training_lease`) instead of loading a second copy. :meth:`PolicyRuntime.sample`
returns the sampled ids with their behaviour log-probs (:mod:`kiln.core.policy.sampling`), and
:meth:`PolicyRuntime.logprobs_of` recomputes them in one forward pass. With ``action_schema=`` both
decode/score the final answer under a grammar compiled from the schema
(:mod:`kiln.core.policy.constrained`, optional; reasoning stays free).

Adapters are PEFT LoRA directories, loaded from local paths only and kept in an LRU keyed by their
content digest (:func:`kiln.core.policy.identity.adapter_content_sha256`); ``adapter_dir=None`` is the
base model (adapters disabled). A full-weights folder (``adapter: full`` training's output, a model
folder) is served by a model of its own held beside the base (one at a time), digested as a model
folder. The identity of every action is
``{"base_model_sha256", "runtime": {...versions, device, dtype}, "adapter_sha256"}``.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from kiln.core.errors import AdapterNotFound, FullTrainingUnsupported, ModelNotFound
from kiln.core.policy import harmony
from kiln.core.policy.device import Placement, resolve_placement
from kiln.core.policy.families import load_identity_fields
from kiln.core.policy.identity import ADAPTER_FILES, adapter_content_sha256, is_full_weights, model_content_sha256
from kiln.core.policy.loading import TORCH_GLOBAL_STATE, check_model_dir, load_causal_lm, load_tokenizer
from kiln.core.policy.engine import (
    DEFAULT_DECODE_TILE,
    AdapterHandle,
    Engine,
    Generation,
    GenerationRequest,
    engine_identity_fields,
)
from kiln.core.policy.engine_hf import HfEngine
from kiln.core.policy.sampling import Sample, completion_logprobs
from kiln.core.policy.token_glue import TokenGlue

if TYPE_CHECKING:  # both imported where used (peft on the first adapter, xgrammar on the first schema)
    from peft import PeftModel

    from kiln.core.policy.constrained import ActionGrammarCache

__all__ = ["PolicyRuntime", "Sample"]


class PolicyRuntime(TokenGlue):
    """Holds one base model + tokenizer and an LRU of adapters; samples and scores token ids."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        model_path: Path,
        device: str,
        dtype: str,
        max_adapters: int,
        decode_tile: int = DEFAULT_DECODE_TILE,
    ):
        # Frozen from the start, as PEFT leaves it after an adapter load or a training lease: the
        # kernels a forward picks depend on ``requires_grad`` (even under inference mode), so a
        # worker's numerics must not depend on whether it has served adapters or training yet.
        model.requires_grad_(False)
        self.model = model
        self.tokenizer = tokenizer
        self.model_path = Path(model_path)
        self.device = device
        self.dtype = dtype
        self.max_adapters = max(1, int(max_adapters))
        self.base_model_sha256 = model_content_sha256(self.model_path)
        self.load_fields = load_identity_fields(self.model_path)  # {"model_part": …} for a composite
        self.lock = threading.RLock()  # sampling, scoring and training leases are serialised
        self._peft: PeftModel | None = None
        # The rollout engine (:mod:`kiln.core.policy.engine`): hf by default; :meth:`use_engine` swaps it.
        self.engine: Engine = HfEngine(self, decode_tile)
        self._adapters: OrderedDict[str, str] = OrderedDict()  # digest -> peft adapter name
        self._full: dict[str, Any] = {}  # digest -> its full-weights model (adapter: full), one at most
        self._action_grammars: ActionGrammarCache | None = None  # built on first use
        self._grammar_lock = threading.Lock()  # not the runtime's lock: compiling never waits on a decode
        self._derive_glue()

    # ----------------------------------------------------------------------------------- loading
    @classmethod
    def load(
        cls,
        model_path: Path,
        *,
        device: str = "auto",
        dtype: str = "auto",
        max_adapters: int = 4,
        decode_tile: int = DEFAULT_DECODE_TILE,
    ) -> "PolicyRuntime":
        """Load a local model directory (never downloads) on ``device``/``dtype`` (``auto`` =
        CUDA+bfloat16 when available, else CPU+float32). ModelNotFound / ModelUnsupported /
        DeviceUnavailable when unusable."""
        path = check_model_dir(Path(model_path))
        placement = resolve_placement(device, dtype)
        tokenizer = load_tokenizer(path)
        model = load_causal_lm(path, placement)
        return cls(
            model,
            tokenizer,
            model_path=path,
            device=placement.device,
            dtype=placement.dtype,
            max_adapters=max_adapters,
            decode_tile=decode_tile,
        )

    # ---------------------------------------------------------------------------------- identity
    def runtime_identity(self, decode_tile: int | None = None) -> dict:
        """Versions, the real placement (``cpu``/``cuda:N``, ``float32``/``bfloat16`` …) and the
        engine (the hf engine at ``decode_tile``, default its own)."""
        import transformers

        import kiln

        return {
            "kiln": kiln.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "device": self.device,
            "dtype": self.dtype,
            **self.load_fields,
            **engine_identity_fields(self.engine, decode_tile),
        }

    def use_engine(self, engine: Engine) -> None:
        """Sample with ``engine`` from now on (the previous one is closed)."""
        old, self.engine = self.engine, engine
        if old is not engine:
            old.close()

    def context_tokens(self) -> int | None:
        """The served context: the smaller of the config's ``max_position_embeddings`` and the
        engine's ``max_model_len`` (:func:`kiln.core.rollout.context.model_context`)."""
        from kiln.core.rollout.context import model_context

        return model_context(self.model, self.engine)

    def identity(self, adapter_dir: Path | None = None, decode_tile: int | None = None) -> dict:
        """The behaviour-policy identity of actions sampled with ``adapter_dir`` (None = base), at
        the hf engine's ``decode_tile`` (default its own)."""
        return {
            "base_model_sha256": self.base_model_sha256,
            "runtime": self.runtime_identity(decode_tile),
            "adapter_sha256": None if adapter_dir is None else self._adapter_digest(Path(adapter_dir)),
        }

    # ---------------------------------------------------------------------------------- adapters
    def adapter_handle(self, adapter_dir: Path | None) -> AdapterHandle | None:
        """The engine's view of ``adapter_dir`` (its path and content digest; None = base)."""
        if adapter_dir is None:
            return None
        adapter_dir = Path(adapter_dir)
        if self.engine.name != "hf" and is_full_weights(adapter_dir):
            raise FullTrainingUnsupported(
                f"the {self.engine.name} engine serves LoRA adapters only, not the full weights at {adapter_dir}",
                hint="sample full-weights adapters (training_config.adapter full) on workers with KILN_ENGINE=hf",
                details={"path": str(adapter_dir), "engine": self.engine.name},
            )
        return AdapterHandle(path=adapter_dir, sha256=self._adapter_digest(adapter_dir))

    def _forget_adapter(self, digest: str) -> None:
        with self.lock:
            self._full.pop(digest, None)
            name = self._adapters.pop(digest, None)
            if name is not None and self._peft is not None:
                self._peft.delete_adapter(name)

    def _adapter_digest(self, adapter_dir: Path) -> str:
        if is_full_weights(adapter_dir):
            return adapter_content_sha256(adapter_dir)
        missing = [name for name in ADAPTER_FILES if not (adapter_dir / name).is_file()]
        if missing:
            raise AdapterNotFound(
                f"adapter directory {adapter_dir} lacks {', '.join(missing)}",
                details={"path": str(adapter_dir)},
            )
        return adapter_content_sha256(adapter_dir)

    def _activate(self, adapter_dir: Path | None, digest: str | None = None):
        """A context manager under which ``self.model`` computes with the requested adapter
        (``digest``: its content digest when the caller already has it)."""
        if adapter_dir is None:
            return _frozen(self._peft, self._peft.disable_adapter()) if self._peft is not None else nullcontext()
        adapter_dir = Path(adapter_dir)
        digest = digest or self._adapter_digest(adapter_dir)
        if is_full_weights(adapter_dir):
            return self._full_weights(adapter_dir, digest)
        name = self._adapters.get(digest)
        peft = self._peft
        if name is None or peft is None:
            name = "a" + digest.split(":", 1)[1][:24]
            peft = self._load_adapter(adapter_dir, name)
            self._adapters[digest] = name
        self._adapters.move_to_end(digest)
        peft.set_adapter(name)
        while len(self._adapters) > self.max_adapters:
            _, old = self._adapters.popitem(last=False)
            peft.delete_adapter(old)
        return _frozen(peft, nullcontext())

    def _full_weights(self, adapter_dir: Path, digest: str):
        """Full weights (``adapter: full`` training's output): a model of their own, loaded once
        and held (one at a time) beside the base model, which stays untouched; ``self.model`` is
        that model for the block."""
        model = self._full.get(digest)
        if model is None:
            self._full.clear()  # at most one full copy besides the base
            try:
                model = load_causal_lm(adapter_dir, Placement(self.device, self.dtype))
            except ModelNotFound as exc:
                raise AdapterNotFound(
                    f"could not load the full weights at {adapter_dir}: {exc.message}",
                    details={"path": str(adapter_dir)},
                ) from exc
            model.requires_grad_(False)
            self._full[digest] = model
        return self._swapped(model)

    @contextmanager
    def _swapped(self, model: Any) -> Iterator[Any]:
        base = self.model
        self.model = model
        try:
            yield model
        finally:
            self.model = base

    def _load_adapter(self, adapter_dir: Path, name: str) -> PeftModel:
        from peft import PeftModel

        try:
            with TORCH_GLOBAL_STATE, torch.random.fork_rng(devices=[]):
                if self._peft is None:
                    self._peft = PeftModel.from_pretrained(
                        self.model, str(adapter_dir), adapter_name=name, is_trainable=False, local_files_only=True
                    )
                else:
                    self._peft.load_adapter(str(adapter_dir), adapter_name=name, is_trainable=False)
        except (OSError, ValueError, KeyError) as exc:
            raise AdapterNotFound(
                f"could not load the adapter at {adapter_dir}: {exc}", details={"path": str(adapter_dir)}
            ) from exc
        self._peft.eval()
        return self._peft

    @property
    def loaded_adapters(self) -> list[str]:
        """Digests of the adapters currently held, least recently used first."""
        return list(self._adapters)

    # ------------------------------------------------------------------------------------ tokens
    def split_action(self, ids: list[int], *, thinking: bool) -> tuple[str, str | None]:
        """(reasoning, answer) of sampled action ids.

        Thinking: reasoning = text before the first ``</think>`` (verbatim), answer = the text after
        it without the trailing stop token, whitespace-stripped; answer is None when ``</think>``
        is absent (reasoning is then all the text). Not thinking: ("", whole text stripped).
        Harmony: :func:`kiln.core.policy.harmony.split_action` (the answer is the final channel's text).
        """
        ids = list(ids)
        if ids and (ids[-1] == self.stop_id or ids[-1] in self.extra_stop_ids):
            ids = ids[:-1]
        if self.harmony:
            return harmony.split_action(self.decode(ids), thinking=self.resolve_thinking(thinking))
        if not self.resolve_thinking(thinking):
            return "", self.decode(ids).strip()
        if self.think_close_id not in ids:
            return self.decode(ids), None
        cut = ids.index(self.think_close_id)
        return self.decode(ids[:cut]), self.decode(ids[cut + 1 :]).strip()

    # ------------------------------------------------------------------------- constrained actions
    def action_grammar(self, action_schema: dict):
        """The compiled decoding grammar of ``action_schema`` (compiled once per schema digest).

        Raises :class:`kiln.core.policy.constrained.ConstrainedDecodingUnavailable` when xgrammar is
        missing or cannot compile the schema.
        """
        with self._grammar_lock:  # concurrent samplers (the engine batches them) share one cache
            if self._action_grammars is None:
                from kiln.core.policy.constrained import ActionGrammarCache

                vocab = getattr(getattr(self.model, "config", None), "vocab_size", None) or len(self.tokenizer)
                self._action_grammars = ActionGrammarCache(
                    self.tokenizer,
                    vocab_size=vocab,
                    stop_id=self.stop_id,
                    # -1: a template without thinking has no </think>; no sampled id ever equals it.
                    think_close_id=self.think_close_id if self.think_close_id is not None else -1,
                )
            return self._action_grammars.get(action_schema)

    # ---------------------------------------------------------------------------------- sampling
    def sample(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        *,
        max_new_tokens: int,
        temperature: float,
        adapter_dir: Path | None = None,
        stop_after_think_budget: int | None = None,
        thinking: bool = True,
        action_schema: dict | None = None,
        decode_tile: int | None = None,
    ) -> list[Generation]:
        """Sample all ``prompts`` in one call; rows stop at the stop token (``<|im_end|>`` …; harmony:
        ``<|return|>`` or ``<|call|>``).

        Batch-invariant (:mod:`kiln.core.policy.sampling`): a row's ids and log-probs do not depend on
        the other rows it is decoded with, in this call or in concurrent ones (a wave of 1 and a
        group of 8 record the same bytes); rows with the same prompt share one prefill.

        With thinking on and ``stop_after_think_budget`` set, a row that has not produced
        ``</think>`` within that many tokens is stopped unfinished (never force-closed).

        With ``action_schema`` (the policy-facing schema), each row's final answer is decoded under
        the schema's grammar: free while reasoning (``thinking`` and no ``</think>`` yet), then
        optional leading whitespace + one schema-valid JSON object, then only ``<|im_end|>``.
        ``Sample.logprobs`` are then log-probs under the masked, renormalised distribution actually
        sampled from; :meth:`logprobs_of` with the same ``action_schema``/``thinking`` reproduces
        them. Absent, sampling is exactly the unconstrained one.

        ``decode_tile`` is the hf engine's tile for these rows (default its own): a run is served at
        the tile its behaviour identity names (:func:`kiln.core.policy.engine.decode_tile_of`).
        """
        thinking = self.resolve_thinking(thinking)
        grammar = self.action_grammar(action_schema) if action_schema is not None else None
        adapter = self.adapter_handle(adapter_dir)
        requests = [
            GenerationRequest(
                prompt_ids=tuple(prompt),
                seed=int(seed),
                max_tokens=int(max_new_tokens),
                temperature=float(temperature),
                stop_id=self.stop_id,
                extra_stop_ids=self.extra_stop_ids,
                think_close_id=self.think_close_id,
                thinking_budget=stop_after_think_budget if thinking else None,
                thinking=thinking,
                grammar=grammar,
                adapter=adapter,
                decode_tile=decode_tile,
            )
            for prompt, seed in zip(prompts, seeds, strict=True)
        ]
        return self.engine.generate(requests)

    def logprobs_of(
        self,
        prompt_ids: list[int],
        completion_ids: list[int],
        *,
        temperature: float,
        adapter_dir: Path | None = None,
        action_schema: dict | None = None,
        thinking: bool = True,
    ) -> list[float]:
        """Log-probs of ``completion_ids`` given ``prompt_ids`` (same rule as ``Sample.logprobs``).

        With ``action_schema`` the completion is teacher-forced through a fresh grammar matcher
        (``thinking`` says whether it starts inside reasoning) and every answer position is scored
        under the same masked distribution :meth:`sample` used; ``ValueError`` when the completion
        violates the grammar. ``thinking`` is ignored without ``action_schema``.
        """
        thinking = self.resolve_thinking(thinking) if action_schema is not None else thinking
        extra = {}
        if action_schema is not None:
            extra["constraint"] = self.action_grammar(action_schema).row(thinking=thinking)
        with self.lock, self._activate(adapter_dir):
            return completion_logprobs(
                self.model, prompt_ids, completion_ids, temperature=temperature, device=self.device, **extra
            )

    # ---------------------------------------------------------------------------------- training
    @contextmanager
    def training_lease(self) -> Iterator[Any]:
        """Exclusive use of the shared base model for one training job (no second copy).

        Yields the model to attach the trainable LoRA to: the runtime's PeftModel when adapters
        are loaded (the trainer adds its own ``default`` adapter), else the plain base model. On
        exit every trace of the training adapter is removed and the held adapters stay loaded;
        sampling waits for the lease (one lock). The base model is left exactly as loaded (eval
        mode, every parameter frozen), so later sampling is bit-identical to a fresh runtime's.
        """
        from kiln.core.train.model import release_lora

        with self.lock, self.engine.exclusive():
            held = self._peft
            lease = _Lease(held if held is not None else self.model)
            try:
                yield lease
            finally:
                if lease.trained is not None:
                    release_lora(lease.trained, shared=held is not None)
                if held is not None:
                    held.eval()
                self.model.eval()
                self.model.requires_grad_(False)


class _Lease:
    """The model handed to the trainer, and the PEFT model it built on it (for cleanup)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.trained: Any = None


@contextmanager
def _frozen(model, inner):
    """``inner`` with ``model`` in eval mode and every parameter frozen, before, during and after.

    PEFT marks the active adapter trainable again in ``set_adapter`` and when ``disable_adapter()``
    exits; the runtime keeps every weight frozen so its module state (and so the kernels a forward
    picks) never depends on what it served before."""
    model.eval()
    model.requires_grad_(False)
    try:
        with inner:
            model.requires_grad_(False)
            yield model
    finally:
        model.requires_grad_(False)
