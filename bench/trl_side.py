"""TRL side of ``bench/vs_trl.py``: GRPOTrainer + ``rollout_func`` on the real counter (or guess) server.

Runs in the TRL venv (``.venv-trl``, ``bench/requirements-trl.txt``), never in Kiln's: it imports
nothing from Kiln. ``bench/vs_trl.py`` launches it as ``PYTHON bench/trl_side.py CONFIG.json`` and
reads the one line starting with ``TRL_RESULT `` (JSON: per-iteration wall seconds and mean
return, setup seconds, versions). After each iteration's last optimizer step the LoRA adapter is
saved to ``OUTPUT_DIR/iteration-K`` (outside the timed span), so ``bench/vs_trl.py`` evaluates both
sides' adapters with one evaluator on the same held-out seeds.

The environment hook is TRL's ``rollout_func`` (``environment_factory`` exposes an environment as
tool calls in the chat template's tool format, which the demo model was never taught; Kiln's
policy replies with a bare JSON action, so the multi-turn loop is written here, as TRL's OpenEnv
guide does for its examples). Each dataset row names a seed (``"seed N"``); ``rollout_func``
receives every row ``num_generations`` times (TRL's RepeatSampler), opens one WebSocket session
per episode on the counter server, resets it with that seed, shows the policy the same system
prompt and observation text Kiln does (the system prompt is rendered by Kiln and passed in the
config), and plays all episodes of the generation batch in lock-step: one batched
``model.generate`` per turn (temperature 1, no top-k/top-p, as Kiln samples), the action parsed
and validated as Kiln does (text after ``</think>``, one JSON object, ``amount`` an integer 1-5;
for the guess env ``guess`` an integer, the config's ``action_spec``;
anything else ends the episode with the protocol-error reward), then one ``step`` per live
episode. The completion is every token after the prompt: the actions (loss mask 1) and the
observation turns between them (``env_mask`` 0). The episode return (sum of step rewards, plus
the penalty for an invalid action) is the reward, passed to the reward function as an extra field.
"""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PLACEHOLDER_ACTION = "@@KILN_BENCH_ACTION@@"
PLACEHOLDER_OBSERVATION = "@@KILN_BENCH_OBSERVATION@@"
SEED_RE = re.compile(r"^seed (\d+)$")


# ----------------------------------------------------------------------------- environment
class CounterSession:
    """One WebSocket session on an OpenEnv server (lock-step request → reply, docs/openenv-protocol.md)."""

    def __init__(self, ws_url: str) -> None:
        from websockets.sync.client import connect

        # A long-lived session (entered here, closed by close()).
        self._ws = connect(ws_url, max_size=None, open_timeout=30).__enter__()

    def _call(self, message: dict[str, Any]) -> dict[str, Any]:
        self._ws.send(json.dumps(message))
        reply = json.loads(self._ws.recv(timeout=60))
        if reply.get("type") == "error":
            raise RuntimeError(f"environment error: {reply.get('data')}")
        return reply["data"]

    def reset(self, seed: int) -> dict[str, Any]:
        return self._call({"type": "reset", "data": {"seed": seed}})

    def step(self, action: dict[str, Any]) -> dict[str, Any]:
        return self._call({"type": "step", "data": action})

    def close(self) -> None:
        try:
            self._ws.send(json.dumps({"type": "close"}))
        finally:
            self._ws.close()


def observation_text(wire: dict[str, Any]) -> str:
    """What Kiln shows the policy for the counter: the observation's ``input_text``."""
    text = (wire.get("observation") or {}).get("input_text")
    if isinstance(text, str) and text.strip():
        return text
    return json.dumps(wire, separators=(",", ":"), sort_keys=True)


COUNTER_ACTION = {"field": "amount", "minimum": 1, "maximum": 5}


def parse_action(answer: str | None, spec: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The action of the policy's answer, or None when Kiln would reject it. ``spec``: the action's
    one integer field and its bounds (None: unbounded), as the environment's schema says (default:
    the counter's ``amount`` 1-5; the guess env's is ``guess`` with no bounds)."""
    spec = spec or COUNTER_ACTION
    name = spec["field"]
    if answer is None:
        return None
    body = answer.strip()
    if body.startswith("```"):
        body = body[3:]
        body = body[4:] if body[:4].lower() == "json" else body
        if not body.rstrip().endswith("```"):
            return None
        body = body.rstrip()[:-3]
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not set(value) <= {name, "metadata"}:
        return None
    number = value.get(name)
    if isinstance(number, bool) or not isinstance(number, int):
        return None
    if (spec.get("minimum") is not None and number < spec["minimum"]) or (
            spec.get("maximum") is not None and number > spec["maximum"]):
        return None
    if "metadata" in value and not isinstance(value["metadata"], dict):
        return None
    return value


# ----------------------------------------------------------------------------- episodes
@dataclass
class Episode:
    seed: int
    session: CounterSession
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    episode_return: float = 0.0
    steps: int = 0
    live: bool = True

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.completion_ids


class Glue:
    """Token glue of the chat template around an observation turn (derived once, by rendering)."""

    def __init__(self, tokenizer: Any, thinking: bool) -> None:
        messages = [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": PLACEHOLDER_ACTION},
            {"role": "user", "content": PLACEHOLDER_OBSERVATION},
        ]
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
        )
        tail = text.split(PLACEHOLDER_ACTION, 1)[1]
        between, after = tail.split(PLACEHOLDER_OBSERVATION, 1)
        if not between.startswith(tokenizer.eos_token):
            raise SystemExit(f"unexpected chat template glue {between!r}")
        self.tokenizer = tokenizer
        self.thinking = thinking
        self.before = self.encode(between[len(tokenizer.eos_token):])
        self.after = self.encode(after)
        self.eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
        self.think_close_id = tokenizer.convert_tokens_to_ids("</think>")

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt(self, system: str, observation: str) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": observation}],
            tokenize=False, add_generation_prompt=True, enable_thinking=self.thinking,
        )
        return self.encode(text)

    def answer(self, ids: list[int]) -> str | None:
        """Kiln's split: the text after ``</think>`` (thinking) or all text, without the stop token."""
        ids = ids[:-1] if ids and ids[-1] == self.eos_id else ids
        if self.thinking:
            if self.think_close_id not in ids:
                return None
            ids = ids[ids.index(self.think_close_id) + 1:]
        return self.tokenizer.decode(ids, skip_special_tokens=False).strip()


def sample_batch(model: Any, contexts: list[list[int]], glue: Glue, cfg: dict[str, Any]) -> list[tuple[list[int], list[float]]]:
    """One batched sampling call: (action ids ending at the stop token, their log-probs) per context."""
    import torch

    pad_id = glue.tokenizer.pad_token_id
    width = max(len(c) for c in contexts)
    input_ids = torch.tensor([[pad_id] * (width - len(c)) + c for c in contexts])
    attention = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts])
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids, attention_mask=attention, max_new_tokens=cfg["max_action_tokens"],
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=glue.eos_id,
            pad_token_id=pad_id, output_logits=True, return_dict_in_generate=True,
        )
    new = out.sequences[:, width:]
    logps = torch.stack([torch.log_softmax(step.float(), dim=-1) for step in out.logits], dim=1)
    picked = logps.gather(-1, new[:, : logps.shape[1]].unsqueeze(-1)).squeeze(-1)
    results = []
    for row in range(len(contexts)):
        ids = new[row].tolist()
        if glue.eos_id in ids:
            ids = ids[: ids.index(glue.eos_id) + 1]
        results.append((ids, picked[row, : len(ids)].tolist()))
    return results


def play(model: Any, seeds: list[int], glue: Glue, cfg: dict[str, Any]) -> list[Episode]:
    """All episodes of one generation batch, in lock-step turns, on the real server."""
    episodes = []
    for seed in seeds:
        session = CounterSession(cfg["ws_url"])
        wire = session.reset(seed)
        episodes.append(Episode(seed, session, glue.prompt(cfg["system_prompt"], observation_text(wire))))
    try:
        for _turn in range(cfg["max_steps"]):
            live = [ep for ep in episodes if ep.live]
            if not live:
                break
            for ep, (ids, logps) in zip(live, sample_batch(model, [ep.context for ep in live], glue, cfg)):
                ep.completion_ids += ids
                ep.logprobs += logps
                ep.env_mask += [1] * len(ids)
                action = (parse_action(glue.answer(ids), cfg.get("action_spec"))
                          if ids and ids[-1] == glue.eos_id else None)
                if action is None:
                    ep.episode_return += cfg["protocol_error_reward"]
                    ep.live = False
                    continue
                wire = ep.session.step(action)
                ep.steps += 1
                ep.episode_return += float(wire.get("reward") or 0.0)
                if wire.get("done") or ep.steps >= cfg["max_steps"]:
                    ep.live = False
                    continue
                turn = glue.before + glue.encode(observation_text(wire)) + glue.after
                ep.completion_ids += turn
                ep.logprobs += [0.0] * len(turn)
                ep.env_mask += [0] * len(turn)
    finally:
        for ep in episodes:
            ep.session.close()
    return episodes


# ----------------------------------------------------------------------------- trainer
def main(config_path: str) -> int:
    cfg = json.loads(Path(config_path).read_text())
    import torch

    torch.set_num_threads(cfg["threads"])
    import peft
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(cfg["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(cfg["model_dir"], dtype=torch.float32)
    glue = Glue(tokenizer, cfg["thinking"])
    groups, group_size, iterations = cfg["groups"], cfg["group_size"], cfg["iterations"]
    seeds = list(range(cfg["seed_start"], cfg["seed_start"] + groups * iterations))
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"seed {s}"}] for s in seeds]})
    returns: list[float] = []
    timing: dict[str, Any] = {"marks": [], "walls": []}

    def rollout(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        batch_seeds = [int(SEED_RE.match(p[-1]["content"]).group(1)) for p in prompts]
        episodes = play(trainer.model, batch_seeds, glue, cfg)
        returns.append(sum(ep.episode_return for ep in episodes) / len(episodes))
        return {
            "prompt_ids": [ep.prompt_ids for ep in episodes],
            "completion_ids": [ep.completion_ids for ep in episodes],
            "logprobs": [ep.logprobs for ep in episodes],
            "env_mask": [ep.env_mask for ep in episodes],
            "episode_return": [ep.episode_return for ep in episodes],
        }

    def episode_reward(completions: list[Any], episode_return: list[float], **_: Any) -> list[float]:
        return list(episode_return)

    steps_per_iteration = groups * cfg["epochs"]

    class IterationClock(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            if state.global_step % steps_per_iteration == 0:
                timing["marks"].append(time.perf_counter())

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step % steps_per_iteration == 0:
                timing["walls"].append(time.perf_counter() - timing["marks"][-1])
                iteration = state.global_step // steps_per_iteration
                kwargs["model"].save_pretrained(str(Path(cfg["output_dir"]) / f"iteration-{iteration}"))

    args = GRPOConfig(
        output_dir=cfg["output_dir"], use_cpu=True, bf16=False, seed=cfg["seed"], report_to="none",
        save_strategy="no", logging_steps=steps_per_iteration, disable_tqdm=True,
        num_generations=group_size, per_device_train_batch_size=group_size, gradient_accumulation_steps=1,
        steps_per_generation=groups, num_iterations=cfg["epochs"], max_steps=steps_per_iteration * iterations,
        shuffle_dataset=False, max_completion_length=cfg["max_completion_length"],
        learning_rate=cfg["learning_rate"], lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=cfg["max_grad_norm"],
        loss_type=cfg["loss_type"], epsilon=cfg["clip_epsilon"], epsilon_high=cfg["epsilon_high"], beta=0.0,
        temperature=1.0, dataloader_num_workers=0, gradient_checkpointing=False,
    )
    lora = peft.LoraConfig(r=cfg["lora_rank"], lora_alpha=cfg["lora_alpha"], target_modules=cfg["lora_targets"],
                           lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=episode_reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=lora, rollout_func=rollout,
                          callbacks=[IterationClock()])
    setup_s = time.perf_counter() - started
    trainer.train()
    result = {
        "iteration_wall_s": timing["walls"], "mean_returns": returns, "setup_s": setup_s,
        "versions": {"trl": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "peft": peft.__version__},
    }
    print("TRL_RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python bench/trl_side.py CONFIG.json (launched by bench/vs_trl.py)")
    raise SystemExit(main(sys.argv[1]))
