"""gpt-oss's harmony format end to end on the policy side.

- Kiln's harmony template's render-diff glue, the action split (the final channel's text is the
  answer) and the offline verifier's split agree.
- ``kiln model random --shape gpt-oss-tiny`` writes a harmony tokenizer built from Kiln's Qwen
  tokenizer (harmony's specials after Qwen3's 151,669 tokens) and the harmony template; the runtime
  derives ``<|return|>`` / ``<|call|>`` as stops and ``<|message|>`` as the reasoning close, and
  opens the analysis (thinking) or final channel in every prompt and observation turn.
- On a tiny gpt-oss warmed up on the turn format (:mod:`tests.support.harmony_model`): sampling
  runs through the analysis message into the final one and stops at ``<|return|>``; the parsed
  answer is the final channel's text; the sampler's log-probs match one-pass scoring within 1e-4
  (float32), constrained or not; a thinking budget stops a row inside its analysis.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.core.policy import harmony as h

SCHEMA = {"type": "object", "properties": {"amount": {"type": "integer", "minimum": 1, "maximum": 5}},
          "required": ["amount"], "additionalProperties": False}
SYSTEM = "You are an agent acting in an environment."


def _render(template: str):
    from transformers.utils.chat_template_utils import _compile_jinja_template

    compiled = _compile_jinja_template(template)
    return lambda messages, gen, thinking: compiled.render(messages=messages, add_generation_prompt=gen,
                                                           enable_thinking=thinking)


def test_the_harmony_template_glue_is_harmonys_messages() -> None:
    from kiln.core.policy.chat_glue import derive_glue

    glue = derive_glue(_render(h.TEMPLATE))
    assert glue.generation_prompt == {True: "<|start|>assistant", False: "<|start|>assistant"}
    assert glue.between[True] == glue.between[False] == "<|end|><|start|>user<|message|>"
    assert glue.after_observation[True] == "<|end|><|start|>assistant"
    last = _render(h.TEMPLATE)([{"role": "user", "content": "U"},
                                {"role": "assistant", "content": "A", "reasoning_content": "R"}], False, True)
    assert last.endswith("<|start|>user<|message|>U<|end|><|start|>assistant<|channel|>analysis<|message|>R<|end|>"
                         "<|start|>assistant<|channel|>final<|message|>A<|return|>")


@pytest.mark.parametrize(("text", "thinking", "expected"), [
    ('think<|end|><|start|>assistant<|channel|>final<|message|> {"amount": 2}', True, ("think", '{"amount": 2}')),
    ("<|end|><|start|>assistant<|channel|>final<|message|>", True, ("", "")),
    ("still thinking", True, ("still thinking", None)),
    ("t<|end|><|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}", True, ("t", None)),
    ('t<|end|><|start|>assistant<|channel|>analysis<|message|>more', True, ("t", None)),
    (' {"amount": 4} ', False, ("", '{"amount": 4}')),
])
def test_the_answer_is_the_final_channels_text(text: str, thinking: bool, expected: tuple) -> None:
    from kiln.core.rollout.verify.trajectory import split_answer

    assert h.split_action(text, thinking=thinking) == expected
    assert split_answer(text, thinking) == expected[1]  # the offline verifier reads it alike


def test_an_analysis_that_never_closes_is_unfinished_thinking() -> None:
    from kiln.core.unfinished_thinking import ended_inside_thinking

    def completion(text: str) -> dict:
        return {"harness_code": "MODEL_ACTION_NO_OUTPUT", "trajectory": [{"kind": "action", "content": text}]}

    assert ended_inside_thinking(completion("reasoning that ran out"))
    assert not ended_inside_thinking(completion("r<|end|><|start|>assistant<|channel|>final<|message|>"))


@pytest.mark.timeout(300)
def test_kiln_model_random_gpt_oss_speaks_harmony(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from kiln.cli.app import app as cli_app
    from kiln.core.policy.runtime import PolicyRuntime

    out = CliRunner().invoke(cli_app, ["model", "random", "--shape", "gpt-oss-tiny", "--dtype", "float32",
                                       str(tmp_path / "oss")])
    assert out.exit_code == 0, out.output
    config = json.loads((tmp_path / "oss" / "config.json").read_text())
    assert config["architectures"] == ["GptOssForCausalLM"] and config["vocab_size"] == 201088
    assert config["layer_types"] == ["sliding_attention", "full_attention"] and config["eos_token_id"] == 151670
    assert json.loads((tmp_path / "oss" / "generation_config.json").read_text())["eos_token_id"] == [151670, 151676]
    rt = PolicyRuntime.load(tmp_path / "oss", device="cpu")
    ids = {t: rt.tokenizer.convert_tokens_to_ids(t) for t in h.SPECIAL_TOKENS}
    assert ids == {"<|startoftext|>": 151669, "<|endoftext|>": 151643, "<|return|>": 151670,
                   "<|constrain|>": 151671, "<|channel|>": 151672, "<|start|>": 151673, "<|end|>": 151674,
                   "<|message|>": 151675, "<|call|>": 151676}
    assert rt.tokenizer.encode("Hello world!", add_special_tokens=False) == [9707, 1879, 0]  # Qwen's ids
    assert (rt.harmony, rt.stop_id, rt.extra_stop_ids, rt.think_close_id) == (True, 151670, (151676,), 151675)
    assert rt.supports_thinking and rt.resolve_thinking("auto") is True
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Count is 3."}]
    assert rt.decode(rt.encode_prompt(messages, thinking=True)).endswith(
        "<|start|>developer<|message|># Instructions\n\n" + SYSTEM + "<|end|>"
        "<|start|>user<|message|>Count is 3.<|end|><|start|>assistant<|channel|>analysis<|message|>")
    assert rt.decode(rt.encode_prompt(messages, thinking=False)).endswith(
        "<|start|>assistant<|channel|>final<|message|>")
    turn = rt.encode_observation_turn("Count is 5.", thinking=True)
    assert [rt.decode(part) for part in turn] == [
        "<|start|>user<|message|>", "Count is 5.", "<|end|><|start|>assistant<|channel|>analysis<|message|>"]
    assert rt.split_action([*rt.tokenizer.encode("x<|end|><|start|>assistant<|channel|>final<|message|>{}"),
                            151676], thinking=True) == ("x", "{}")


@pytest.fixture(scope="module")
def warmed(tmp_path_factory: pytest.TempPathFactory):
    from kiln.core.policy.runtime import PolicyRuntime
    from tests.support.harmony_model import build_harmony_model

    return PolicyRuntime.load(build_harmony_model(tmp_path_factory.mktemp("harmony")), device="cpu")


def _final_text(rt, ids: list[int]) -> str:
    """The final message's text, found by its header's ids (written out independently of the split)."""
    header = rt.tokenizer.encode(h.START + "assistant" + h.FINAL_HEADER, add_special_tokens=False)
    at = next(i for i in range(len(ids)) if ids[i : i + len(header)] == header)
    assert ids[-1] == rt.stop_id
    return rt.decode(ids[at + len(header) : -1]).strip()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sampling_runs_through_analysis_into_final_and_stops_at_return(warmed) -> None:
    rt = warmed
    end = rt.tokenizer.convert_tokens_to_ids(h.END)
    prompt = rt.encode_prompt([{"role": "system", "content": SYSTEM},
                               {"role": "user", "content": "Count is 3. Target is 10."}], thinking=True)
    samples = rt.sample([prompt] * 6, list(range(6)), max_new_tokens=40, temperature=1.0, thinking=True)
    for sample in samples:
        assert sample.finished and sample.ids[-1] == rt.stop_id and end in sample.ids
        reasoning, answer = rt.split_action(sample.ids, thinking=True)
        assert answer == _final_text(rt, sample.ids)
        assert json.loads(answer)["amount"] in range(1, 6)
        assert reasoning == rt.decode(sample.ids[: sample.ids.index(end)])
        scored = rt.logprobs_of(prompt, sample.ids, temperature=1.0)
        assert max(abs(a - b) for a, b in zip(scored, sample.logprobs)) < 1e-4
    # Constrained: free through the analysis, the schema's JSON after the final <|message|>.
    constrained = rt.sample([prompt] * 4, [11, 12, 13, 14], max_new_tokens=40, temperature=1.0,
                            thinking=True, action_schema=SCHEMA)
    for sample in constrained:
        answer = rt.split_action(sample.ids, thinking=True)[1]
        assert sample.finished and answer == _final_text(rt, sample.ids)
        assert set(json.loads(answer)) == {"amount"}
        scored = rt.logprobs_of(prompt, sample.ids, temperature=1.0, action_schema=SCHEMA, thinking=True)
        assert max(abs(a - b) for a, b in zip(scored, sample.logprobs)) < 1e-4
    # A thinking budget of 1 stops a row inside its analysis (unfinished, never force-closed).
    cut = rt.sample([prompt], [3], max_new_tokens=40, temperature=1.0, thinking=True, stop_after_think_budget=1)[0]
    assert not cut.finished and len(cut.ids) == 1 and rt.split_action(cut.ids, thinking=True)[1] is None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_thinking_off_opens_the_final_channel_and_call_is_a_stop(warmed) -> None:
    from kiln.core.policy.engine import GenerationRequest

    rt = warmed
    prompt = rt.encode_prompt([{"role": "user", "content": "Count is 1. Target is 9."}], thinking=False)
    assert rt.decode(prompt).endswith(h.FINAL_HEADER)
    for sample in rt.sample([prompt] * 4, [5, 6, 7, 8], max_new_tokens=24, temperature=1.0, thinking=False):
        assert sample.finished and sample.ids[-1] == rt.stop_id
        assert rt.split_action(sample.ids, thinking=False) == ("", rt.decode(sample.ids[:-1]).strip())
        assert rt.tokenizer.convert_tokens_to_ids(h.END) not in sample.ids  # no analysis message
    # A row ends at any of its stop ids: with its own first token as an extra stop, after one token.
    first = rt.sample([prompt], [5], max_new_tokens=24, temperature=1.0, thinking=False)[0].ids[0]

    request = GenerationRequest(prompt_ids=tuple(prompt), seed=5, max_tokens=24, temperature=1.0,
                                stop_id=rt.stop_id, extra_stop_ids=(first,))
    out = rt.engine.generate([request])[0]
    assert out.ids == [first] and out.finished
