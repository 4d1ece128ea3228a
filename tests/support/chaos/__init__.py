"""Chaos-test support: a real Kiln stack in separate processes, faults injected for real.

Modules, one job each:

- :mod:`~tests.support.chaos.stack` — the stack processes (Temporal, SeaweedFS, counter env,
  workers), each restartable in place (:class:`ChaosStack`, :func:`serve_counter`);
- :mod:`~tests.support.chaos.worker` — the worker processes' entry point
  (``python -m tests.support.chaos worker control|gpu|all``);
- :mod:`~tests.support.chaos.faults` — fault injection (:class:`FaultHooks`, :func:`install_hooks`);
- :mod:`~tests.support.chaos.runs` — driving runs through Temporal and comparing their outcomes;
- :mod:`~tests.support.chaos.environments` — holding/probing environment sessions, a stalled server;
- :mod:`~tests.support.chaos.assertions` — known-bug markers, published-artifact checks, figures.
"""
