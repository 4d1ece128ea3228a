"""Token-level glue of ANY chat template, derived from the template itself by render-diff (pure).

The runtime never re-renders a multi-turn conversation: it renders the first prompt once and then
*appends* ids (an earlier turn's reasoning may be dropped by a re-render, e.g. Qwen3). What it
appends around an observation comes from rendering probe conversations with unique marker texts
and taking the differences:

* ``generation_prompt[thinking]`` = render(conv, add_generation_prompt=True) minus
  render(conv, add_generation_prompt=False) (a suffix);
* ``between`` = the text of render(conv + [assistant A, user U]) between the end of ``A`` and the
  start of ``U``: it starts with the end-of-turn text the policy itself writes (``<|im_end|>``,
  ``<|eot_id|>``, ``<end_of_turn>`` …: the stop token) followed by the observation-turn opening;
* ``after_observation[thinking]`` = the text of render(conv + [assistant A, user U],
  add_generation_prompt=True) after ``U`` (observation turn close + next generation prompt).

Thinking is supported when the generation prompt changes with ``enable_thinking`` (Qwen3 style,
or Kiln's own template) and the vocabulary has ``</think>``. Templates that reject a system role
are probed without one. A template the probes cannot explain raises ``ModelUnsupported``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

from kiln.core.errors import ModelUnsupported

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
ThinkingMode = Literal["auto", "on", "off"]

_SYSTEM = "KILNPROBESYSTEM"
_USER_1 = "KILNPROBEUSERONE"
_ASSISTANT = "KILNPROBEASSISTANT"
_USER_2 = "KILNPROBEUSERTWO"

# render(messages, add_generation_prompt, thinking) -> text
Render = Callable[[list[dict], bool, bool], str]


@dataclass(frozen=True)
class ChatGlue:
    """The strings the runtime appends, per thinking mode (``True``/``False`` keys)."""

    generation_prompt: dict[bool, str]
    between: dict[bool, str]  # end-of-turn text + observation-turn opening
    after_observation: dict[bool, str]
    thinking_switch: bool  # the generation prompt depends on enable_thinking

    def prompt_suffix(self, thinking: bool) -> str:
        return self.generation_prompt[thinking]


def _suffix(longer: str, shorter: str, what: str) -> str:
    if not longer.startswith(shorter):
        raise ModelUnsupported(
            f"the chat template's {what} is not an extension of the shorter render",
            hint="Kiln appends token ids turn by turn; use a chat template whose renders extend each other",
        )
    return longer[len(shorter) :]


def _probe(render: Render, thinking: bool, with_system: bool) -> tuple[str, str, str]:
    head = [{"role": "system", "content": _SYSTEM}] if with_system else []
    first = head + [{"role": "user", "content": _USER_1}]
    gen = _suffix(render(first, True, thinking), render(first, False, thinking), "generation prompt")
    second = first + [{"role": "assistant", "content": _ASSISTANT}, {"role": "user", "content": _USER_2}]
    closed = render(second, False, thinking)
    opened = render(second, True, thinking)
    if _ASSISTANT not in closed or _USER_2 not in closed or _USER_2 not in opened:
        raise ModelUnsupported(
            "the chat template drops assistant or user messages from a multi-turn conversation",
            hint="use a chat template that renders every message",
        )
    start = closed.rindex(_ASSISTANT) + len(_ASSISTANT)
    between = closed[start : closed.rindex(_USER_2)]
    after = opened[opened.rindex(_USER_2) + len(_USER_2) :]
    if not between or not after:
        raise ModelUnsupported("the chat template writes nothing between turns (no end-of-turn marker)")
    return gen, between, after


def derive_glue(render: Render) -> ChatGlue:
    """Probe ``render`` (with a system message, else without) and return its glue."""
    try:
        probes = {t: _probe(render, t, True) for t in (True, False)}
    except ModelUnsupported:
        raise
    except Exception:  # noqa: BLE001 - a template may raise on a system role (Gemma-2 style)
        probes = {t: _probe(render, t, False) for t in (True, False)}
    return ChatGlue(
        generation_prompt={t: probes[t][0] for t in probes},
        between={t: probes[t][1] for t in probes},
        after_observation={t: probes[t][2] for t in probes},
        thinking_switch=probes[True][0] != probes[False][0],
    )


def resolve_thinking(mode: ThinkingMode | bool, *, supported: bool, model: str) -> bool:
    """``auto`` = thinking when the template supports it; ``on`` requires support; bools pass."""
    if mode is True or mode == "on":
        if not supported:
            raise ModelUnsupported(
                f"thinking was requested but the chat template of {model} has no thinking mode "
                f"(no enable_thinking switch or no {THINK_CLOSE} token)",
                hint="use thinking off (or auto) for this model",
                details={"field": "thinking"},
            )
        return True
    if mode is False or mode == "off":
        return False
    if mode == "auto":
        return supported
    raise ModelUnsupported(f"thinking must be auto, on or off, not {mode!r}", details={"field": "thinking"})


__all__ = ["ChatGlue", "THINK_CLOSE", "THINK_OPEN", "ThinkingMode", "derive_glue", "resolve_thinking"]
