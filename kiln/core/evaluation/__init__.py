"""Paired held-out environment evaluation and the promotion gate (R8). Pure: no torch.

Modules (import them directly; this package imports nothing):

- ``sign_test``  exact two-sided binomial sign test (integer / Fraction arithmetic)
- ``pairing``    baseline vs candidate bundle pairing checks → ``PairedGroup`` per seed group;
                 ``EnvironmentEvaluationFailed`` (code ``environment_evaluation_failed``)
- ``gate``       ``paired_return_sign_test_v1`` evidence, first-match decision, outcome
- ``receipt``    ``kiln.openenv-environment-evaluation.v1`` receipt: build, validate, serialise

The torch side ("world model" observation cross-entropy on the evaluation transcripts) lives in
``kiln.core.train.world_model``.
"""
