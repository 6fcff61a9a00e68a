"""Row buckets for linear layers on oneDNN (CPU bf16/fp16).

torch's CPU bf16 and fp16 matmuls go through oneDNN, which builds and keeps a
kernel for every distinct input shape it sees, about 0.5 MiB each, and never
frees them. A serving step's row count is its token count (1 to
``--max-num-batched-tokens``), so a long-running scheduler kept growing until it
had seen every count: ~0.3 GiB over 400 counts at one layer width, measured. Padding
each linear's rows up to a bucket (exact up to 8, then eight buckets per power of
two, so at most 12.5 % extra rows) caps the distinct shapes at a few dozen and
makes the later steps reuse kernels instead of building new ones. float32 goes
through MKL, which caches nothing per shape, and CUDA through cuBLAS: neither pads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def row_bucket(num_rows: int) -> int:
    """The padded row count: ``num_rows`` up to 8, else rounded up to an eighth of the
    power of two below it (100 -> 104, 500 -> 512)."""
    if num_rows <= 8:
        return num_rows
    step = 1 << (num_rows.bit_length() - 4)
    return -(-num_rows // step) * step


def needs_row_buckets(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)


class BucketedLinear(nn.Linear):
    """``nn.Linear`` (same parameters, same checkpoint names) whose input rows are padded
    to ``row_bucket`` while ``pad_rows`` is on; the padding rows are dropped after."""

    pad_rows: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        num_rows = x.shape[0]
        padded = row_bucket(num_rows) if self.pad_rows else num_rows
        if padded == num_rows:
            return super().forward(x)
        return super().forward(F.pad(x, (0, 0, 0, padded - num_rows)))[:num_rows]


def enable_row_buckets(model: nn.Module) -> int:
    """Turn padding on in every BucketedLinear of ``model``; returns how many."""
    layers = [m for m in model.modules() if isinstance(m, BucketedLinear)]
    for layer in layers:
        layer.pad_rows = True
    return len(layers)
