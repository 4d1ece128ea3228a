"""gpt-oss's harmony chat format: its special tokens, Kiln's harmony template, how an action splits (pure).

A harmony conversation is a list of messages ``<|start|>ROLE[<|channel|>CHANNEL]<|message|>TEXT``
closed by ``<|end|>``; the assistant writes its reasoning on the ``analysis`` channel and its answer
on the ``final`` channel, ending the answer with ``<|return|>`` (a tool call, on the ``commentary``
channel, ends with ``<|call|>``). One gpt-oss turn is therefore two assistant messages::

    <|start|>assistant<|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

How Kiln serves it (:class:`kiln.core.policy.runtime.PolicyRuntime`, detected by
:func:`is_harmony_vocab`):

* **The channel is part of the prompt.** After the template's generation prompt
  (``<|start|>assistant``) Kiln appends the channel header: ``<|channel|>analysis<|message|>`` with
  thinking on, ``<|channel|>final<|message|>`` with thinking off (the model then answers directly;
  gpt-oss has no other way to skip its reasoning). A template that already ends its prompt with the
  header gets nothing added. Real gpt-oss checkpoints' templates and Kiln's own (:data:`TEMPLATE`)
  behave alike.
* **Sampling stops at** ``<|return|>`` **or** ``<|call|>``, never at ``<|end|>``: the sampler
  continues through the analysis message into the final one.
* **The reasoning closes at the next** ``<|message|>``: the first ``<|message|>`` the model writes
  opens the message after its analysis. Its header says whose text it is: the final channel's text
  is the answer (the action parsed for the environment); any other channel (a commentary or tool
  message) is no answer. ``<|message|>`` plays ``</think>``'s part for the thinking budget (tokens
  before it) and for constrained actions (the grammar starts after it).
* **The trainable action is all of it**: analysis + header + final text + stop, as the reasoning
  and the answer together form the action everywhere in Kiln.
* **Later turns are appended ids** (never a re-render): a past action keeps its analysis and ends
  with ``<|return|>``, then ``<|start|>user<|message|>OBSERVATION<|end|><|start|>assistant`` and the
  channel header follow.
"""

from __future__ import annotations

from typing import Container

STARTOFTEXT = "<|startoftext|>"
ENDOFTEXT = "<|endoftext|>"
START = "<|start|>"
END = "<|end|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
RETURN = "<|return|>"
CALL = "<|call|>"
CONSTRAIN = "<|constrain|>"

# gpt-oss's special tokens (o200k_harmony), all special (skipped when decoding without specials).
SPECIAL_TOKENS = (STARTOFTEXT, ENDOFTEXT, RETURN, CONSTRAIN, CHANNEL, START, END, MESSAGE, CALL)
REQUIRED = (START, END, MESSAGE, CHANNEL, RETURN)  # what makes a vocabulary harmony's

ANALYSIS_HEADER = CHANNEL + "analysis" + MESSAGE
FINAL_HEADER = CHANNEL + "final" + MESSAGE

# Kiln's harmony template (written for Kiln, not copied). Rendering: a system message of Kiln's
# preamble (``reasoning_effort``, default medium); a leading system/developer message's text as
# the developer message's instructions (with the tools, when given); user turns; an assistant turn
# as its final-channel message (closed by <|end|>, or <|return|> when it is the last message and no
# generation prompt follows, where its reasoning_content is rendered on the analysis channel too);
# tool calls on the commentary channel closed by <|call|>; tool results as messages from
# functions.NAME; the generation prompt is <|start|>assistant.
TEMPLATE = (
    "{%- set effort = reasoning_effort if reasoning_effort is defined else 'medium' -%}"
    "{{- '<|start|>system<|message|>You are a helpful assistant.\\nReasoning: ' + effort + '\\n\\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>' -}}"
    "{%- if messages and messages[0].role in ('system', 'developer') -%}"
    "{%- set instructions = messages[0].content if messages[0].content is string else '' -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set instructions = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- if instructions or tools -%}"
    "{{- '<|start|>developer<|message|>' -}}"
    "{%- if instructions -%}{{- '# Instructions\\n\\n' + instructions -}}{%- endif -%}"
    "{%- if tools -%}"
    "{{- ('\\n\\n' if instructions else '') + '# Tools\\n\\n## functions\\n\\nnamespace functions {' -}}"
    "{%- for tool in tools -%}"
    "{%- set fn = tool.function if tool.function is defined else tool -%}"
    "{{- '\\n\\n// ' + (fn.description or '') + '\\ntype ' + fn.name + ' = (_: ' + (fn.parameters | tojson) + ') => any;' -}}"
    "{%- endfor -%}"
    "{{- '\\n\\n} // namespace functions' -}}"
    "{%- endif -%}"
    "{{- '<|end|>' -}}"
    "{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- set content = message.content if message.content is string else '' -%}"
    "{%- if message.role == 'assistant' -%}"
    "{%- set closing = loop.last and not add_generation_prompt -%}"
    "{%- if closing and message.reasoning_content is string and message.reasoning_content -%}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.reasoning_content + '<|end|>' -}}"
    "{%- endif -%}"
    "{%- if message.tool_calls -%}"
    "{%- for call in message.tool_calls -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{{- '<|start|>assistant<|channel|>commentary to=functions.' + fn.name + ' <|constrain|>json<|message|>' -}}"
    "{{- fn.arguments if fn.arguments is string else fn.arguments | tojson -}}"
    "{{- '<|call|>' -}}"
    "{%- endfor -%}"
    "{%- else -%}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + content + ('<|return|>' if closing else '<|end|>') -}}"
    "{%- endif -%}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<|start|>functions.' + (message.name or 'tool') + ' to=assistant<|channel|>commentary<|message|>' -}}"
    "{{- content + '<|end|>' -}}"
    "{%- else -%}"
    "{{- '<|start|>' + message.role + '<|message|>' + content + '<|end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}"
)


def is_harmony_vocab(vocab: Container[str]) -> bool:
    """The vocabulary has harmony's message tokens (``<|start|>``, ``<|channel|>``, ``<|message|>``,
    ``<|end|>``, ``<|return|>``)."""
    return all(token in vocab for token in REQUIRED)


def channel_header(thinking: bool) -> str:
    """The header Kiln opens the assistant's message with: analysis (thinking) or final."""
    return ANALYSIS_HEADER if thinking else FINAL_HEADER


def split_action(text: str, *, thinking: bool) -> tuple[str, str | None]:
    """(reasoning, answer) of an action's text (specials kept, the stop token removed).

    Thinking (the prompt opened the analysis channel): reasoning = the analysis message's text (up
    to its ``<|end|>``); answer = everything after the first ``<|message|>``, stripped, when the
    header before it names the final channel, else None (no next message yet, or a commentary /
    tool message). Not thinking (the prompt opened the final channel): ("", the text stripped)."""
    if not thinking:
        return "", text.strip()
    cut = text.find(MESSAGE)
    if cut < 0:
        return text.split(END, 1)[0], None
    head, body = text[:cut], text[cut + len(MESSAGE) :]
    header = head.rsplit(START, 1)[-1] if START in head else ""
    channel = header.split(CHANNEL, 1)[1].split() if CHANNEL in header else []
    final = bool(channel) and channel[0] == "final"
    return head.split(END, 1)[0], (body.strip() if final else None)


__all__ = [
    "ANALYSIS_HEADER",
    "CALL",
    "END",
    "FINAL_HEADER",
    "MESSAGE",
    "RETURN",
    "SPECIAL_TOKENS",
    "START",
    "TEMPLATE",
    "channel_header",
    "is_harmony_vocab",
    "split_action",
]
