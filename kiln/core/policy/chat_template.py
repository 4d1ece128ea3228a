"""Kiln's own ChatML chat template (with ``<think>`` reasoning), carried by the tiny demo model.

Rendering rules (one message = ``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n``):

* system / user / tool / any other role: the content verbatim.
* assistant, when ``enable_thinking`` is on (the default): ``<think>\\n`` + ``reasoning_content``
  (verbatim, may be empty) + ``</think>\\n\\n`` + content. Unlike Qwen3's template, the reasoning of
  earlier turns is *kept*, so a re-render equals the appended token ids of the real episode.
* assistant, thinking off: the content verbatim.
* generation prompt: ``<|im_start|>assistant\\n`` plus ``<think>\\n`` when thinking is on. The policy
  then writes ``REASONING</think>\\n\\nANSWER<|im_end|>`` (or ``ANSWER<|im_end|>``).

The runtime does not use these strings: it derives the glue of whatever template a model carries
(:mod:`kiln.core.policy.chat_glue`); for this template that is ``\n<|im_start|>user\n`` before an
observation and ``<|im_end|>\n`` + the generation prompt after it, and the tests check that
appending equals the template's render.
"""

from __future__ import annotations

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
ADDED_TOKENS = [THINK_OPEN, THINK_CLOSE]

CHAT_TEMPLATE = (
    "{%- set thinking = enable_thinking is not defined or enable_thinking -%}"
    "{%- for message in messages -%}"
    "{%- set content = message['content'] if message['content'] is string else '' -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if thinking -%}"
    "{%- set reasoning = message.get('reasoning_content') or '' -%}"
    "{{- '<think>\\n' + reasoning + '</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- content + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if thinking -%}{{- '<think>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)


def generation_prompt(thinking: bool) -> str:
    """The text the template appends for ``add_generation_prompt=True``."""
    return IM_START + "assistant\n" + (THINK_OPEN + "\n" if thinking else "")


def render(messages: list[dict], *, thinking: bool, add_generation_prompt: bool) -> str:
    """Pure-Python render equal to :data:`CHAT_TEMPLATE` (used by tools that do not load Jinja)."""
    out: list[str] = []
    for message in messages:
        content = message.get("content")
        content = content if isinstance(content, str) else ""
        if message["role"] == "assistant":
            out.append(IM_START + "assistant\n")
            if thinking:
                reasoning = message.get("reasoning_content") or ""
                out.append(THINK_OPEN + "\n" + reasoning + THINK_CLOSE + "\n\n")
            out.append(content + IM_END + "\n")
        else:
            out.append(IM_START + message["role"] + "\n" + content + IM_END + "\n")
    if add_generation_prompt:
        out.append(generation_prompt(thinking))
    return "".join(out)
