"""Blackwell (sm_100a) kernels: tcgen05 MMA warp, TMEM accumulators, TMA producer, softmax/correction roles.

Modules here register themselves at import (``compile.import_all_kernels`` walks this package).
"""
