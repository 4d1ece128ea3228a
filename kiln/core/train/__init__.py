"""GRPO + ECHO training (LoRA, or every weight with ``adapter: full``) over collected OpenEnv seed groups.

Modules (import them directly; this package imports nothing, so ``kiln.core.train.selection``
stays usable without torch in the control worker):

- ``selection``   group selection (pure)
- ``advantages``  group-normalised advantages (pure)
- ``tokens``      token pieces → ids and disjoint action / ECHO masks, receipt token counts (pure)
- ``batches``     seed groups → rows → padded micro-batches by token budget (torch)
- ``losses``      chunked tempered log-probs, PPO-clip / CISPO surrogate, ECHO CE, k1/k3 KL (torch)
- ``step``        one optimizer step: micro-batches, gradient accumulation, cached old/ref log-probs
- ``optim``       Muon / AdamW and the learning-rate schedule
- ``muon``        Kiln's Muon (float32 Newton–Schulz)
- ``plan``        admission (on-policy check, sampling settings), selection, step schedule
- ``model``       base model + LoRA, adapter save and content digests (torch, peft)
- ``full``        full fine-tuning (``adapter: full``): its own trainable copy, the full-weights folder
- ``checkpoints`` exact checkpoints: weights, optimizer, RNG, cached log-probs, data cursor; tar packing
- ``continuation`` the optimizer state handed from one online-run iteration's training to the next
- ``staleness``   stale data: the behaviour policy's log-probs, scored by the behaviour adapter
- ``receipt``     ``kiln.train-receipt.v1``
- ``prepare``     everything before the first step: admission, model, rows, optimizer, start state
- ``loop``        the live training state and its step loop (progress, checkpoints)
- ``finish``      after the last step: final scoring, adapter, continuation state, receipt
- ``trainer``     ``train_grpo`` (prepare → loop → finish) and ``TrainedAdapter`` (its local output)
"""
