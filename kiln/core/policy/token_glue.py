"""The token-level face of a chat model: its glue derived from its own chat template.

The stop token, the observation turn's opening and closing, the generation prompt and thinking
support come from the template by render-diff (:mod:`kiln.core.policy.chat_glue`); gpt-oss's
harmony format (:mod:`kiln.core.policy.harmony`) adds its channel header and stops. Prompts are
rendered once; later turns are appended ids, never a re-render. :class:`TokenGlue` is the part of
:class:`kiln.core.policy.runtime.PolicyRuntime` that needs only ``tokenizer`` and ``model_path``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.core.errors import ModelUnsupported
from kiln.core.policy import harmony
from kiln.core.policy.chat_glue import THINK_CLOSE, ThinkingMode, derive_glue, resolve_thinking


class TokenGlue:
    """Token glue and encoding of one tokenizer + chat template (set ``tokenizer`` and
    ``model_path``, then call :meth:`_derive_glue`)."""

    tokenizer: Any
    model_path: Path

    def _render(self, messages: list[dict], add_generation_prompt: bool, thinking: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, enable_thinking=thinking
        )

    def _derive_glue(self) -> None:
        """Stop token, observation glue and thinking support from the model's own chat template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ModelUnsupported(
                f"the model at {self.model_path} has no chat template",
                hint="add a chat template to the model folder (chat_template.jinja, or chat_template "
                "in tokenizer_config.json); Kiln renders prompts with the model's own template",
                details={"path": str(self.model_path), "missing": "chat_template"},
            )
        self.glue = derive_glue(self._render)
        ids = self._encode(self.glue.between[False])
        specials = set(self.tokenizer.all_special_ids) | set(getattr(self.tokenizer, "added_tokens_decoder", {}))
        if not ids or ids[0] not in specials:
            raise ModelUnsupported(
                f"the chat template of {self.model_path} does not end an assistant turn with a special "
                f"token (it writes {self.glue.between[False]!r} after an assistant message)",
                hint="use a chat template that closes assistant turns with an end-of-turn token",
                details={"path": str(self.model_path), "missing": "end_of_turn_token"},
            )
        self.stop_id = int(ids[0])
        self.turn_end_text = self.decode([self.stop_id])  # what closes a past turn in the template
        for thinking, between in self.glue.between.items():
            if not between.startswith(self.turn_end_text):
                raise ModelUnsupported(f"the chat template's end-of-turn text differs with thinking={thinking}")
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.stop_id)
        vocab = self.tokenizer.get_vocab()
        close = vocab.get(THINK_CLOSE)
        self.think_close_id = int(close) if close is not None else None
        self.supports_thinking = self.glue.thinking_switch and self.think_close_id is not None
        self.extra_stop_ids: tuple[int, ...] = ()
        # The channel header Kiln appends to each generation prompt (harmony only; "" otherwise).
        self.prompt_header = {True: "", False: ""}
        self.harmony = harmony.is_harmony_vocab(vocab)
        if self.harmony:
            self._harmony_glue(vocab)
        self.stop_text = self.decode([self.stop_id])

    def _harmony_glue(self, vocab: dict[str, int]) -> None:
        """gpt-oss's harmony (:mod:`kiln.core.policy.harmony`): the prompt opens the analysis
        (thinking) or final channel, sampling stops at ``<|return|>`` / ``<|call|>`` (never at a
        message's ``<|end|>``), and the next ``<|message|>`` closes the reasoning."""
        self.stop_id = int(vocab[harmony.RETURN])
        self.extra_stop_ids = (int(vocab[harmony.CALL]),) if harmony.CALL in vocab else ()
        self.think_close_id = int(vocab[harmony.MESSAGE])
        self.supports_thinking = True
        for thinking in (True, False):
            header = harmony.channel_header(thinking)
            if not self.glue.generation_prompt[thinking].endswith(header):
                self.prompt_header[thinking] = header

    def resolve_thinking(self, mode: ThinkingMode | bool) -> bool:
        """``auto`` → thinking iff the template supports it; ``on`` on a template without → error.

        Every method taking ``thinking=`` accepts ``True``/``False`` or ``"auto"|"on"|"off"``."""
        return resolve_thinking(mode, supported=self.supports_thinking, model=str(self.model_path))

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_prompt(self, messages: list[dict], *, thinking: bool) -> list[int]:
        """Render ``messages`` with the chat template plus the generation prompt; token ids."""
        thinking = self.resolve_thinking(thinking)
        return self._encode(self._render(messages, True, thinking) + self.prompt_header[thinking])

    def encode_observation_turn(self, content: str, *, thinking: bool) -> tuple[list[int], list[int], list[int]]:
        """Ids appended after an action ending with the stop token: (glue_before, content, glue_after)."""
        thinking = self.resolve_thinking(thinking)
        return (
            self._encode(self.glue.between[thinking][len(self.turn_end_text) :]),
            self._encode(content),
            self._encode(self.glue.after_observation[thinking] + self.prompt_header[thinking]),
        )

    def decode(self, ids: list[int]) -> str:
        """Verbatim text of ``ids`` (special tokens kept)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
