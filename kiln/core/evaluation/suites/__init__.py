"""Installed static evaluation suites for ``post_eval``, shipped as package data.

Each ``<name>.jsonl`` file here is one suite; ``<name>`` is what a run request names in
``post_eval.suite``. One case per line::

    {"id": str, "messages": [{"role": ..., "content": ...}, ...], "expected": str}

Scoring (:func:`kiln.core.evaluation.static_suite.score_answer`) is exact match on the policy's final
answer; JSON objects compare by canonical JSON.

Shipped suites:

- ``counter-format`` (24 cases): Kiln's exact counter system prompt (``kiln.core.rollout.prompts``, the
  action schema of ``examples/envs/counter``) and a user turn ``Count is C. Target is T.`` for
  targets 8..12 and counts below them. The expected answer of **every** case is
  ``{"amount": 1}``: in the counter game adding 1 each turn is always a best action (it never
  overshoots and earns the maximal return ``min(target, max_steps)``). The suite therefore
  measures "emits the action format *and* chooses the best (smallest) amount"; a policy choosing
  amounts uniformly scores about 20 %.
"""
