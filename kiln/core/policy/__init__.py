"""The policy: model loading on a device/dtype, chat-template glue, tokenizers, sampling runtime.

Importing this package must not import torch: ``kiln.core.policy.identity``, ``kiln.core.policy.chat_glue``,
``kiln.core.policy.chat_template``, ``kiln.core.policy.templates``, ``kiln.core.policy.harmony`` (gpt-oss's
harmony format) and ``kiln.core.policy.families`` (the model family table) are pure; ``device``, ``loading``,
``runtime``, ``sampling``, ``tiny``, ``qwen_vocab`` and ``random_model`` need torch/transformers
(the ``train`` extra) and are imported explicitly by the gpu worker, the CLI and the benches.
"""
