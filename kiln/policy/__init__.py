"""The policy: tiny demo model builder, tokenizer, chat template, in-process sampling runtime.

Importing this package must not import torch: ``kiln.policy.identity`` and
``kiln.policy.chat_template`` are pure; ``runtime``, ``sampling`` and ``tiny`` need torch and
transformers (the ``train`` extra) and are imported explicitly by the gpu worker.
"""
