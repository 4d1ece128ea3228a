"""Kiln's domain core: OpenEnv discovery, collection, training, evaluation and receipts.

Nothing under ``kiln/`` imports temporalio or fastapi; only ``kiln.core.policy`` and ``kiln.core.train``
import torch (and only in the modules that need it).
"""

__version__ = "0.1.0"
