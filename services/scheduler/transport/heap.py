"""glibc's heap set up for an engine process that allocates the same large tensors every step.

A CPU forward allocates and frees the same activations step after step (a 1,024-token
prefill chunk's gate-up output in bf16 is 20 MB, a decode step's float32 logits at C = 64
are 33 MB). glibc serves every block over its mmap threshold with a fresh ``mmap`` and
unmaps it on ``free``, so each step page-faults all of that memory in again: measured on a
2-core Intel Xeon with AMX (torch 2.13, the 0.5B-shaped checkpoint, a quiet machine), a
chunked 2,048-token prefill ran at 827-834 prompt tokens/s with glibc's defaults and at
1,112-1,180 with its heap kept (``bench.limits``, docs/benchmarks.md), and the model's own
GEMMs measured 1.39 TFLOP/s against 2.05.
This is what vLLM's and SGLang's CPU guides get by preloading tcmalloc; ``mallopt`` gets
it from the allocator already loaded, with no library to install:

* ``M_MMAP_MAX = 0``: no block is served by ``mmap``; all come from the heap and are reused;
* ``M_TRIM_THRESHOLD`` at 1 GiB: freed memory at the heap's top stays mapped for the next
  step instead of going back to the kernel.

The cost is that the process keeps its peak heap: the engine's peak is bounded by
``--max-num-batched-tokens`` and the batch, and the KV pool and weights are held for its
whole life anyway. ``--no-heap-tuning`` keeps glibc's defaults; on a C library other
than glibc nothing changes.
"""

from __future__ import annotations

import ctypes
import logging
import platform

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's malloc.h parameter numbers
M_MMAP_MAX = -4
TRIM_THRESHOLD_BYTES = 1 << 30


def keep_heap() -> bool:
    """Apply the settings above to this process (and the children it forks after); returns
    whether glibc took both."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        logger.info("heap tuning skipped: the C library is not glibc")
        return False
    mallopt = ctypes.CDLL("libc.so.6").mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    done = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    if done:
        logger.info("heap tuned: no mmap per block, freed memory kept (transport/heap.py)")
    else:
        logger.warning("heap tuning refused by glibc's mallopt; its defaults stay")
    return done
