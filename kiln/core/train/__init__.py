"""GRPO + ECHO LoRA training over collected OpenEnv seed groups.

Modules (import them directly; this package imports nothing, so ``kiln.core.train.selection``
stays usable without torch in the control worker):

- ``selection``   group selection (pure)
- ``advantages``  group-normalised advantages (pure)
- ``tokens``      token pieces → ids and disjoint action / ECHO masks, receipt token counts (pure)
- ``batches``     seed groups → rows → padded micro-batches by token budget (torch)
- ``losses``      chunked tempered log-probs, PPO-clip / CISPO surrogate, ECHO CE, k1/k3 KL (torch)
- ``step``        one optimizer step: micro-batches, gradient accumulation, cached old/ref log-probs
- ``optim``       Muon / AdamW and the learning-rate schedule
- ``plan``        admission (on-policy check, sampling settings), selection, step schedule
- ``model``       base model + LoRA, adapter save and content digests (torch, peft)
- ``checkpoints`` exact checkpoints: weights, optimizer, RNG, cached log-probs, data cursor; tar packing
- ``continuation`` the optimizer state handed from one online-run iteration's training to the next
- ``staleness``   stale data: the behaviour policy's log-probs, scored by the behaviour adapter
- ``receipt``     ``kiln.train-receipt.v1``
- ``trainer``     ``train_grpo`` and ``TrainedAdapter`` (its local output)
"""
