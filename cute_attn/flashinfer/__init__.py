"""FlashInfer-compatible wrappers: swap ``flashinfer.X`` for ``cute_attn.flashinfer.X`` in an engine.

The three classes keep FlashInfer 0.7.x's constructor, ``plan(...)`` and ``run(...)`` signatures
(positional order, keyword names, defaults) for the subset cute_attn implements; an argument outside
that subset raises ``NotImplementedError`` naming it and the value given. Each ``plan()`` checks and
keeps the batch's index tensors; ``run()`` calls the public entry point with them, whose plan cache
makes every layer after the first reuse one plan (``indices.py``).
"""

from .decode import BatchDecodeWithPagedKVCacheWrapper
from .mla import BatchMLAPagedAttentionWrapper
from .prefill import BatchPrefillWithPagedKVCacheWrapper

__all__ = [
    "BatchDecodeWithPagedKVCacheWrapper",
    "BatchMLAPagedAttentionWrapper",
    "BatchPrefillWithPagedKVCacheWrapper",
]
