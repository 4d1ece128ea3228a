"""GRPO + ECHO LoRA training over collected OpenEnv seed groups.

Modules (import them directly; this package imports nothing, so ``kiln.train.selection``
stays usable without torch in the control worker):

- ``selection``   R5.4 group selection (pure)
- ``advantages``  group-normalised advantages (pure)
- ``tokens``      token pieces → ids and disjoint action / ECHO masks, receipt token counts (pure)
- ``batches``     one seed group → one padded, shifted training batch (torch)
- ``losses``      PPO-clip surrogate, ECHO cross-entropy, k1 KL (torch)
- ``model``       base model + LoRA, adapter save and content digests (torch, peft)
- ``checkpoints`` exact checkpoints: weights, optimizer, RNG, data cursor
- ``receipt``     ``kiln.train-receipt.v1``
- ``trainer``     ``train_grpo`` and ``TrainResult``
"""
