"""Which modules of a native model run the compiled row kernels (``ops/csrc/fused_rows.cpp``:
RMSNorm, RoPE, SiLU-and-multiply; ``ops/csrc/moe_routing.cpp``: a MoE layer's routing and
weighted sum), switched on at load once the kernel library is loaded.

Each module keeps its eager path for other devices, dtypes and shapes; the switch is a flag
on the module (``kernel``), read in its ``forward``.
"""

from __future__ import annotations

from torch import nn

from services.scheduler.model_executor.models.layers import MLP, Attention, RMSNorm
from services.scheduler.model_executor.models.moe import Experts, SparseMoeBlock


def use_row_kernels(model: nn.Module, enabled: bool = True) -> int:
    """Switch ``model``'s RMSNorms (Llama's, not Gemma's ``1 + weight`` one), RoPE, SiLU
    MLPs and experts, and MoE routing to the compiled row kernels, or back to eager; returns
    how many modules it switched. For the CPU only, once the kernel library is loaded
    (``cpu_kernels.py``)."""
    count = 0
    for module in model.modules():
        if not isinstance(module, (RMSNorm, MLP, Attention, Experts, SparseMoeBlock)):
            continue
        if isinstance(module, RMSNorm) and type(module) is not RMSNorm:
            continue  # a subclass normalises otherwise (Gemma's)
        if isinstance(module, (MLP, Experts)) and not module.is_silu:
            continue
        module.kernel = enabled
        count += 1
    return count
