"""Chat glue derived from three template families (ChatML/Qwen3 with <think>, Llama-3, Gemma-3)."""

from __future__ import annotations

import json
import shutil

import pytest

from kiln.core.errors import ModelUnsupported
from tests.support.models import shared_family_model

MESSAGES = [
    {"role": "system", "content": "You are an agent."},
    {"role": "user", "content": "Count is 0. Reply with JSON."},
]

EXPECTED = {
    # family: (stop, glue before observation, glue after observation by thinking, supports thinking)
    "qwen3": ("<|im_end|>", "\n<|im_start|>user\n",
              {True: "<|im_end|>\n<|im_start|>assistant\n",
               False: "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"}, True),
    "llama3": ("<|eot_id|>", "<|start_header_id|>user<|end_header_id|>\n\n",
               {False: "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"}, False),
    "gemma": ("<end_of_turn>", "\n<start_of_turn>user\n",
              {False: "<end_of_turn>\n<start_of_turn>model\n"}, False),
}


@pytest.fixture(scope="module", params=sorted(EXPECTED))
def family(request, tmp_path_factory):
    from kiln.core.policy.runtime import PolicyRuntime

    path = shared_family_model(request.param, tmp_path_factory)
    return request.param, PolicyRuntime.load(path, device="cpu", dtype="float32")


@pytest.mark.timeout(120)
def test_glue_is_derived_from_the_template(family) -> None:
    name, rt = family
    stop, before, after, thinking = EXPECTED[name]
    assert rt.decode([rt.stop_id]) == stop
    assert rt.supports_thinking is thinking
    assert rt.resolve_thinking("auto") is thinking
    for mode, text in after.items():
        glue_before, content, glue_after = rt.encode_observation_turn("Count is 3.", thinking=mode)
        assert rt.decode(glue_before) == before
        assert rt.decode(content) == "Count is 3."
        assert rt.decode(glue_after) == text


@pytest.mark.timeout(120)
def test_appended_turns_equal_the_templates_own_render(family) -> None:
    """Llama-3 and Gemma re-render earlier turns verbatim, so appending must equal re-rendering
    (Qwen3 drops earlier reasoning blocks on re-render: checked against its expected strings)."""
    name, rt = family
    if name == "qwen3":
        prompt = rt.encode_prompt(MESSAGES, thinking=False)
        assert rt.decode(prompt).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert rt.decode(rt.encode_prompt(MESSAGES, thinking=True)).endswith("<|im_start|>assistant\n")
        return
    ids = rt.encode_prompt(MESSAGES, thinking=False)
    conversation = list(MESSAGES)
    for turn, answer in enumerate(['{"amount": 1}', '{"amount": 4}']):
        ids += rt.tokenizer.encode(answer, add_special_tokens=False) + [rt.stop_id]
        conversation.append({"role": "assistant", "content": answer})
        observation = f"Count is {turn + 1}. Reply with JSON."
        before, content, after = rt.encode_observation_turn(observation, thinking=False)
        ids += before + content + after
        conversation.append({"role": "user", "content": observation})
        assert rt.decode(ids) == rt.decode(rt.encode_prompt(conversation, thinking=False))


@pytest.mark.timeout(120)
def test_thinking_on_needs_a_thinking_template(family) -> None:
    name, rt = family
    if rt.supports_thinking:
        assert rt.resolve_thinking("on") is True
        return
    with pytest.raises(ModelUnsupported) as info:
        rt.encode_prompt(MESSAGES, thinking=True)
    assert info.value.code == "model_unsupported"
    assert info.value.details == {"field": "thinking"}
    assert "no thinking mode" in info.value.message


@pytest.mark.timeout(120)
def test_a_model_without_chat_template_is_refused_naming_it(tmp_path, tmp_path_factory) -> None:
    from kiln.core.policy.runtime import PolicyRuntime

    folder = tmp_path / "no-template"
    shutil.copytree(shared_family_model("llama3", tmp_path_factory), folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ModelUnsupported) as info:
        PolicyRuntime.load(folder, device="cpu")
    assert info.value.code == "model_unsupported"
    assert info.value.details["missing"] == "chat_template"
    assert str(folder) in info.value.message and "chat template" in info.value.message


@pytest.mark.timeout(120)
def test_qwen3_template_keeps_only_reasoning_after_the_last_query(tmp_path_factory) -> None:
    from kiln.core.policy.runtime import PolicyRuntime

    rt = PolicyRuntime.load(shared_family_model("qwen3", tmp_path_factory), device="cpu")
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "reasoning_content": "r1", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "<think>\nr2\n</think>\n\na2"},
    ]
    assert rt._render(messages, False, True) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nq1<|im_end|>\n"
        "<|im_start|>assistant\na1<|im_end|>\n<|im_start|>user\nq2<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nr2\n</think>\n\na2<|im_end|>\n"
    )
    tools = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": "X"},
        {"role": "tool", "content": "Y"},
    ]
    assert rt._render(tools, True, False).endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nX\n</tool_response>\n<tool_response>\nY\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
