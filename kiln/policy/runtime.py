"""The in-process policy runtime of the gpu worker: base model, tokenizer, LRU of LoRA adapters.

Token-in, token-out: prompts are token ids rendered once with Kiln's chat template
(:meth:`PolicyRuntime.encode_prompt`); later turns are *appended* ids
(:meth:`PolicyRuntime.encode_observation_turn`), never a re-render. :meth:`PolicyRuntime.sample`
returns the sampled ids with their behaviour log-probs (:mod:`kiln.policy.sampling`), and
:meth:`PolicyRuntime.logprobs_of` recomputes them in one forward pass. With ``action_schema=`` both
decode/score the final answer under a grammar compiled from the schema
(:mod:`kiln.policy.constrained`, optional; reasoning stays free).

Adapters are PEFT LoRA directories, loaded from local paths only and kept in an LRU keyed by their
content digest (:func:`kiln.policy.identity.adapter_content_sha256`); ``adapter_dir=None`` is the
base model (adapters disabled). The identity of every action is
``{"base_model_sha256", "runtime": {...versions, device, dtype}, "adapter_sha256"}``.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from contextlib import contextmanager, nullcontext
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from kiln.errors import AdapterNotFound, ModelNotFound  # noqa: E402
from kiln.policy.chat_template import (  # noqa: E402
    ENDOFTEXT,
    GLUE_BEFORE_OBSERVATION,
    IM_END,
    THINK_CLOSE,
    glue_after_observation,
)
from kiln.policy.identity import ADAPTER_FILES, adapter_content_sha256, model_content_sha256  # noqa: E402
from kiln.policy.sampling import Sample, completion_logprobs, sample_batch  # noqa: E402

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

__all__ = ["PolicyRuntime", "Sample"]


class PolicyRuntime:
    """Holds one base model + tokenizer and an LRU of adapters; samples and scores token ids."""

    def __init__(self, model, tokenizer, *, model_path: Path, device: str, dtype: str, max_adapters: int):
        self.model = model
        self.tokenizer = tokenizer
        self.model_path = Path(model_path)
        self.device = device
        self.dtype = dtype
        self.max_adapters = max(1, int(max_adapters))
        self.base_model_sha256 = model_content_sha256(self.model_path)
        self._peft = None
        self._adapters: OrderedDict[str, str] = OrderedDict()  # digest -> peft adapter name
        self.stop_id = self._token_id(IM_END)
        self.pad_id = self._token_id(ENDOFTEXT)
        self.think_close_id = self._token_id(THINK_CLOSE)
        self._action_grammars = None  # kiln.policy.constrained.ActionGrammarCache, built on first use

    # ----------------------------------------------------------------------------------- loading
    @classmethod
    def load(
        cls, model_path: Path, *, device: str = "cpu", dtype: str = "float32", max_adapters: int = 4
    ) -> "PolicyRuntime":
        """Load a local model directory (never downloads). Raises ModelNotFound when unusable."""
        path = Path(model_path)
        hint = (
            "point KILN_MODEL_PATH at a local Hugging Face model directory, or build the demo model "
            "with `kiln model tiny DIR`"
        )
        if not path.is_dir():
            raise ModelNotFound(f"model directory not found: {path}", hint=hint, details={"path": str(path)})
        if not (path / "config.json").is_file():
            raise ModelNotFound(
                f"not a model directory (no config.json): {path}", hint=hint, details={"path": str(path)}
            )
        if dtype not in _DTYPES:
            raise ModelNotFound(f"unsupported dtype {dtype!r}", hint=f"use one of {sorted(_DTYPES)}")
        os.environ["HF_HUB_OFFLINE"] = "1"
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(
                str(path), local_files_only=True, dtype=_DTYPES[dtype]
            )
        except (OSError, ValueError) as exc:
            raise ModelNotFound(
                f"could not load the model at {path}: {exc}", hint=hint, details={"path": str(path)}
            ) from exc
        model.to(device)
        model.eval()
        return cls(model, tokenizer, model_path=path, device=device, dtype=dtype, max_adapters=max_adapters)

    def _token_id(self, token: str) -> int:
        tid = self.tokenizer.convert_tokens_to_ids(token)
        if tid is None or tid == self.tokenizer.unk_token_id:
            raise ModelNotFound(f"the tokenizer at {self.model_path} lacks the token {token}")
        return int(tid)

    # ---------------------------------------------------------------------------------- identity
    def runtime_identity(self) -> dict:
        import transformers

        import kiln

        return {
            "kiln": kiln.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "device": self.device,
            "dtype": self.dtype,
        }

    def identity(self, adapter_dir: Path | None = None) -> dict:
        """The behaviour-policy identity of actions sampled with ``adapter_dir`` (None = base)."""
        return {
            "base_model_sha256": self.base_model_sha256,
            "runtime": self.runtime_identity(),
            "adapter_sha256": None if adapter_dir is None else self._adapter_digest(Path(adapter_dir)),
        }

    # ---------------------------------------------------------------------------------- adapters
    def _adapter_digest(self, adapter_dir: Path) -> str:
        missing = [name for name in ADAPTER_FILES if not (adapter_dir / name).is_file()]
        if missing:
            raise AdapterNotFound(
                f"adapter directory {adapter_dir} lacks {', '.join(missing)}",
                details={"path": str(adapter_dir)},
            )
        return adapter_content_sha256(adapter_dir)

    def _activate(self, adapter_dir: Path | None):
        """A context manager under which ``self.model`` computes with the requested adapter."""
        if adapter_dir is None:
            return self._peft.disable_adapter() if self._peft is not None else nullcontext()
        adapter_dir = Path(adapter_dir)
        digest = self._adapter_digest(adapter_dir)
        name = self._adapters.get(digest)
        if name is None:
            name = "a" + digest.split(":", 1)[1][:24]
            self._load_adapter(adapter_dir, name)
            self._adapters[digest] = name
        self._adapters.move_to_end(digest)
        self._peft.set_adapter(name)
        while len(self._adapters) > self.max_adapters:
            _, old = self._adapters.popitem(last=False)
            self._peft.delete_adapter(old)
        return _as_eval(self._peft)

    def _load_adapter(self, adapter_dir: Path, name: str) -> None:
        from peft import PeftModel

        try:
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

    @property
    def loaded_adapters(self) -> list[str]:
        """Digests of the adapters currently held, least recently used first."""
        return list(self._adapters)

    # ------------------------------------------------------------------------------------ tokens
    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_prompt(self, messages: list[dict], *, thinking: bool) -> list[int]:
        """Render ``messages`` with the chat template plus the generation prompt; token ids."""
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
        )
        return self._encode(text)

    def encode_observation_turn(
        self, content: str, *, thinking: bool
    ) -> tuple[list[int], list[int], list[int]]:
        """Ids appended after an action ending with ``<|im_end|>``: (glue_before, content, glue_after)."""
        return (
            self._encode(GLUE_BEFORE_OBSERVATION),
            self._encode(content),
            self._encode(glue_after_observation(thinking)),
        )

    def decode(self, ids: list[int]) -> str:
        """Verbatim text of ``ids`` (special tokens kept)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def split_action(self, ids: list[int], *, thinking: bool) -> tuple[str, str | None]:
        """(reasoning, answer) of sampled action ids.

        Thinking: reasoning = text before the first ``</think>`` (verbatim), answer = the text after
        it without the trailing ``<|im_end|>``, whitespace-stripped; answer is None when ``</think>``
        is absent (reasoning is then all the text). Not thinking: ("", whole text stripped).
        """
        ids = list(ids)
        if ids and ids[-1] == self.stop_id:
            ids = ids[:-1]
        if not thinking:
            return "", self.decode(ids).strip()
        if self.think_close_id not in ids:
            return self.decode(ids), None
        cut = ids.index(self.think_close_id)
        return self.decode(ids[:cut]), self.decode(ids[cut + 1 :]).strip()

    # ------------------------------------------------------------------------- constrained actions
    def action_grammar(self, action_schema: dict):
        """The compiled decoding grammar of ``action_schema`` (compiled once per schema digest).

        Raises :class:`kiln.policy.constrained.ConstrainedDecodingUnavailable` when xgrammar is
        missing or cannot compile the schema.
        """
        if self._action_grammars is None:
            from kiln.policy.constrained import ActionGrammarCache

            vocab = getattr(getattr(self.model, "config", None), "vocab_size", None) or len(self.tokenizer)
            self._action_grammars = ActionGrammarCache(
                self.tokenizer, vocab_size=vocab, stop_id=self.stop_id, think_close_id=self.think_close_id
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
    ) -> list[Sample]:
        """Sample all ``prompts`` in one batch (one forward per token); rows stop at ``<|im_end|>``.

        With thinking on and ``stop_after_think_budget`` set, a row that has not produced
        ``</think>`` within that many tokens is stopped unfinished (never force-closed).

        With ``action_schema`` (the policy-facing schema), each row's final answer is decoded under
        the schema's grammar: free while reasoning (``thinking`` and no ``</think>`` yet), then
        optional leading whitespace + one schema-valid JSON object, then only ``<|im_end|>``.
        ``Sample.logprobs`` are then log-probs under the masked, renormalised distribution actually
        sampled from; :meth:`logprobs_of` with the same ``action_schema``/``thinking`` reproduces
        them. Absent, sampling is exactly the unconstrained one.
        """
        extra = {}
        if action_schema is not None:
            grammar = self.action_grammar(action_schema)
            extra["constraints"] = [grammar.row(thinking=thinking) for _ in prompts]
        with self._activate(adapter_dir):
            return sample_batch(
                self.model,
                prompts,
                seeds,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                stop_id=self.stop_id,
                pad_id=self.pad_id,
                think_close_id=self.think_close_id,
                think_budget=stop_after_think_budget if thinking else None,
                device=self.device,
                **extra,
            )

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
        extra = {}
        if action_schema is not None:
            extra["constraint"] = self.action_grammar(action_schema).row(thinking=thinking)
        with self._activate(adapter_dir):
            return completion_logprobs(
                self.model, prompt_ids, completion_ids, temperature=temperature, device=self.device, **extra
            )


@contextmanager
def _as_eval(model):
    model.eval()
    yield model
