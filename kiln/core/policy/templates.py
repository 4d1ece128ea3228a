"""Chat templates Kiln writes into models it builds (random-init scale models, test families).

Written for Kiln (not copied): each reproduces the observable behaviour of a model family's own
template, which is what the runtime's render-diff glue (:mod:`kiln.core.policy.chat_glue`) is tested on.

* :data:`QWEN3_TEMPLATE` — Qwen3 behaviour: ChatML turns; a leading system message (with a tools
  preamble when ``tools`` are given); ``reasoning_content`` (or an inline ``<think>…</think>``) of an
  assistant turn is rendered only for turns after the last real user query, earlier reasoning is
  dropped; tool results are grouped into one user turn of ``<tool_response>`` blocks; the generation
  prompt is ``<|im_start|>assistant\\n`` and, with ``enable_thinking=false``, an empty
  ``<think>\\n\\n</think>\\n\\n`` block (the model then answers directly).
* :data:`LLAMA3_TEMPLATE` — Llama-3 header style: ``<|begin_of_text|>``, then per message
  ``<|start_header_id|>ROLE<|end_header_id|>\\n\\n`` + trimmed content + ``<|eot_id|>``; no thinking.
* :data:`GEMMA_TEMPLATE` — Gemma-3 style: ``<bos>``, the system text folded into the first user
  turn, ``<start_of_turn>user|model\\n`` + trimmed content + ``<end_of_turn>\\n``, strictly
  alternating roles; no thinking.
* :data:`kiln.core.policy.harmony.TEMPLATE` — gpt-oss's harmony messages (``<|start|>ROLE
  <|channel|>CHANNEL<|message|>…<|end|>``, the answer closed by ``<|return|>``); reasoning is the
  analysis channel, which the runtime opens itself (:mod:`kiln.core.policy.harmony`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.core.policy import harmony

QWEN3_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' -}}{{- tool | tojson -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' -}}'
    "{%- elif messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- set ns = namespace(searching=true, last_query=messages|length - 1) -%}"
    "{%- for message in messages[::-1] -%}"
    "{%- set index = (messages|length - 1) - loop.index0 -%}"
    "{%- if ns.searching and message.role == 'user' and message.content is string "
    "and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) -%}"
    "{%- set ns.searching = false -%}{%- set ns.last_query = index -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- set content = message.content if message.content is string else '' -%}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{%- set reasoning = '' -%}"
    "{%- if message.reasoning_content is string -%}{%- set reasoning = message.reasoning_content -%}"
    "{%- elif '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') -}}"
    "{%- else -%}"
    "{{- '<|im_start|>assistant\\n' + content -}}"
    "{%- endif -%}"
    "{%- if message.tool_calls -%}"
    "{%- for call in message.tool_calls -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- if loop.first and content -%}{{- '\\n' -}}{%- elif not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    '{{- \'<tool_call>\\n{"name": "\' + fn.name + \'", "arguments": \' -}}'
    "{{- fn.arguments if fn.arguments is string else fn.arguments | tojson -}}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)

LLAMA3_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- set content = message['content'] if message['content'] is string else '' -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + content | trim + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)

GEMMA_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set prefix = messages[0]['content'] | trim + '\\n\\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{%- set content = message['content'] if message['content'] is string else '' -%}"
    "{{- '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') + content | trim + '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class TemplateFamily:
    """A chat template with the special tokens its tokenizer needs."""

    name: str
    template: str
    special_tokens: tuple[str, ...]  # never split, skipped by skip_special_tokens
    added_tokens: tuple[str, ...]  # never split, kept as text
    bos: str | None
    eos: str  # the end-of-turn token the policy writes
    pad: str


FAMILIES = {
    "qwen3": TemplateFamily(
        "qwen3",
        QWEN3_TEMPLATE,
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
        None,
        "<|im_end|>",
        "<|endoftext|>",
    ),
    "llama3": TemplateFamily(
        "llama3",
        LLAMA3_TEMPLATE,
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        (),
        "<|begin_of_text|>",
        "<|eot_id|>",
        "<|end_of_text|>",
    ),
    "gemma": TemplateFamily(
        "gemma",
        GEMMA_TEMPLATE,
        ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
        (),
        "<bos>",
        "<end_of_turn>",
        "<pad>",
    ),
    "harmony": TemplateFamily(
        "harmony",
        harmony.TEMPLATE,
        harmony.SPECIAL_TOKENS,
        (),
        None,
        harmony.RETURN,
        harmony.ENDOFTEXT,
    ),
}

__all__ = ["FAMILIES", "GEMMA_TEMPLATE", "LLAMA3_TEMPLATE", "QWEN3_TEMPLATE", "TemplateFamily"]
