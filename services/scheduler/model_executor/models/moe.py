"""A sparse mixture-of-experts MLP, its experts computed grouped by expert over the step.

The router picks ``top_k`` experts per token. Rather than loop over tokens, the step's
(token, expert) pairs are sorted by expert so that each expert that any token chose runs
one matmul over all of its tokens; the outputs are weighted and summed back per token
(``route`` and ``combine``: with the kernels, one call each in place of about twenty small
ops per layer, a tenth of a one-request decode step). The expert weights live stacked in
``[num_experts, ...]`` parameters (the loader stacks HF's per-expert tensors into them).
``prepare_linears`` then packs each expert's pair for oneDNN and pads or tiles its rows as
it does a ``Linear``'s (``linear.py``): a decode step gives most experts one to three rows,
where oneDNN's packed matmul streams the weight about 1.6x as fast as ``F.linear`` from the
[out, in] layout.
With the decode copy an expert of up to ``decode_copy_rows`` rows multiplies by its weights'
decode copies (``linear.py``): up to 4 with AMX, every step without (then the copies replace
the packed weights). The copies are stacked per projection (``ExpertCopies``), so a step
whose experts all take them runs each projection for every expert in one grouped call
(``bf16_grouped_blocks_mm``): one parallel region where the loop opens one per expert, and
no Python per expert. With ``--quantization int8`` each expert's weights are int8
(``int8_weight.py``); the router stays in full precision, since a rounded router score can
send a token to another expert.
"""

from __future__ import annotations

from itertools import pairwise
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from services.scheduler.model_executor.models.config import ModelConfig, MoeConfig
from services.scheduler.model_executor.models.int8.int8_weight import Int8Weight
from services.scheduler.model_executor.models.int8.w8a8_weight import QuantizedWeight
from services.scheduler.model_executor.models.layers import ACTIVATIONS, MLP, gated
from services.scheduler.model_executor.models.linear import (
    DecodeCopy,
    Linear,
    RowShaped,
    can_copy_for_decode,
)


class Routing(NamedTuple):
    """A step's (token, expert) pairs sorted by expert, stably (so by token within one):
    ``token_of`` [T * k] each pair's token, ``weights`` [T * k] its routing weight in
    float32, ``offsets`` [E + 1] where expert e's pairs start."""

    token_of: torch.Tensor
    weights: torch.Tensor
    offsets: torch.Tensor


def route(logits: torch.Tensor, top_k: int, renormalize: bool, kernel: bool) -> Routing:
    """Each token's ``top_k`` experts by softmax of its router ``logits`` [T, E], their
    probabilities renormalised to sum to one where the model asks. The kernel is one call
    for the fifteen small ops below, with the same pairs (``csrc/moe_routing.cpp``)."""
    if kernel:
        token_of, weights, offsets = torch.ops.tokenline.moe_route(logits, top_k, renormalize)
        return Routing(token_of, weights, offsets)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=logits.shape[-1])
    offsets = F.pad(counts.cumsum(0), (1, 0))
    return Routing(order // top_k, weights.reshape(-1)[order], offsets)


def combine(outputs: torch.Tensor, routing: Routing, tokens: int, kernel: bool) -> torch.Tensor:
    """[tokens, H]: each token's expert ``outputs`` (in ``routing``'s order) times their
    weights in the model dtype, summed. The kernel gives the same bits in one call."""
    if kernel:
        out: torch.Tensor = torch.ops.tokenline.moe_combine(
            outputs, routing.weights, routing.token_of, tokens
        )
        return out
    weighted = outputs * routing.weights.to(outputs.dtype)[:, None]
    summed = outputs.new_zeros(tokens, outputs.shape[1])
    return summed.index_add_(0, routing.token_of, weighted)


class ExpertCopies(NamedTuple):
    """One projection's weights for every expert in the decode copy's layout, stacked:
    ``[E, N/64, K/2, 64, 2]``; N output channels each."""

    blocks: torch.Tensor
    outputs: int

    @classmethod
    def of(cls, stack: torch.Tensor) -> ExpertCopies:
        """From a stack of [E, N, K] bf16 weights."""
        pack = torch.ops.tokenline.pack_bf16_blocks
        return cls(torch.stack([pack(weight.detach()) for weight in stack]), stack.shape[1])

    def expert(self, expert: int) -> DecodeCopy:
        return DecodeCopy(self.blocks[expert], self.outputs)

    def grouped_matmul(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Rows ``offsets[e]:offsets[e + 1]`` of ``rows`` times expert e's weight, for every e."""
        out: torch.Tensor = torch.ops.tokenline.bf16_grouped_blocks_mm(
            rows, offsets, self.blocks, self.outputs
        )
        return out


class Experts(nn.Module, RowShaped):
    """``num_experts`` gated MLPs: ``gate_up_proj`` [E, 2 * I, H], ``down_proj`` [E, H, I].
    SiLU-and-multiply through ``torch.ops.tokenline.silu_and_mul`` once ``use_row_kernels``
    has switched it on."""

    kernel: bool = False

    def __init__(self, config: ModelConfig, moe: MoeConfig) -> None:
        super().__init__()
        size, hidden = moe.intermediate_size, config.hidden_size
        self.intermediate_size = size
        self.num_experts = moe.num_experts
        # Per expert (gate_up, down) once ``quantize`` has run; the stacks are then None.
        self.int8: list[tuple[QuantizedWeight, QuantizedWeight]] | None = None
        # Per expert (gate_up, down) in oneDNN's layout once ``pack`` has run; likewise.
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        # (gate_up, down) for every expert in the decode kernel's layout (``--decode-copy``).
        self.decode_copies: tuple[ExpertCopies, ExpertCopies] | None = None
        self.gate_up_proj = nn.Parameter(torch.empty(moe.num_experts, 2 * size, hidden))
        self.down_proj = nn.Parameter(torch.empty(moe.num_experts, hidden, size))
        self.act = ACTIVATIONS[config.hidden_act]
        self.is_silu = config.hidden_act == "silu"

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Every routed pair's expert output [T * k, H], in ``routing``'s order."""
        rows = x.index_select(0, routing.token_of)
        spans = list(pairwise(routing.offsets.tolist()))  # expert e's rows: spans[e]
        most = max(end - start for start, end in spans)
        if self.decode_copies is not None and most <= self.decode_copy_rows:
            return self._grouped(rows, routing.offsets)
        outputs = torch.empty_like(rows)
        for expert, (start, end) in enumerate(spans):
            if end > start:
                outputs[start:end] = self._expert(expert, rows[start:end])
        return outputs

    def _grouped(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Every expert's rows (``rows`` sorted by expert, expert e's from ``offsets[e]``)
        through its MLP by the stacked decode copies: the same sums as ``_expert`` per
        expert."""
        assert self.decode_copies is not None
        gate_up, down = self.decode_copies
        return down.grouped_matmul(self._activate(gate_up.grouped_matmul(rows, offsets)), offsets)

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            gate_up_int8, down_int8 = self.int8[expert]
            return down_int8.matmul(self._activate(gate_up_int8.matmul(x)))
        copies: tuple[DecodeCopy | None, DecodeCopy | None] = (None, None)
        if self.decode_copies is not None:
            copies = (self.decode_copies[0].expert(expert), self.decode_copies[1].expert(expert))
        if self.packed is not None:
            gate_up_packed, down_packed = self.packed[expert]
            hidden = self._activate(self.matmul_rows(x, gate_up_packed, None, None, copies[0]))
            return self.matmul_rows(hidden, down_packed, None, None, copies[1])
        # Dense, or None where the copies replaced the packed weights (no AMX).
        gate_up = None if self.gate_up_proj is None else self.gate_up_proj[expert]
        down = None if self.down_proj is None else self.down_proj[expert]
        hidden = self._activate(self.matmul_rows(x, None, gate_up, None, copies[0]))
        return self.matmul_rows(hidden, None, down, None, copies[1])

    def _activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        return gated(gate_up, self.act, self.intermediate_size, self.kernel)

    @property
    def quantized_weights(self) -> bool:
        return self.int8 is not None

    @torch.no_grad()
    def pack(self, keep_dense: bool) -> None:
        def reorder(stack: torch.Tensor, expert: int) -> torch.Tensor:
            return torch.ops.mkldnn._reorder_linear_weight(stack[expert].detach(), None)

        self.packed = [
            (reorder(self.gate_up_proj, e), reorder(self.down_proj, e))
            for e in range(self.num_experts)
        ]
        if not keep_dense:
            self.drop_dense()

    def drop_dense(self) -> None:
        self.gate_up_proj = self.down_proj = None  # type: ignore[assignment]

    @torch.no_grad()
    def copy_for_decode(self) -> int:
        stacks = (self.gate_up_proj, self.down_proj)
        if not all(can_copy_for_decode(stack) for stack in stacks):
            return 0
        self.decode_copies = (ExpertCopies.of(self.gate_up_proj), ExpertCopies.of(self.down_proj))
        return sum(copies.blocks.nbytes for copies in self.decode_copies)

    def quantize(self, row_independent: bool) -> None:
        """Hold every expert's weights as int8 and free the float stacks."""
        gate_up = Int8Weight.quantize(self.gate_up_proj, row_independent)
        down = Int8Weight.quantize(self.down_proj, row_independent)
        self.int8 = [(gate_up.select(e), down.select(e)) for e in range(self.num_experts)]
        self.drop_dense()


class SparseMoeBlock(nn.Module):
    """Router (``gate``) and experts; HF's names, so checkpoints map one to one. Routing and
    the weighted sum run ``csrc/moe_routing.cpp``'s kernels once ``use_row_kernels`` has
    switched ``kernel`` on."""

    kernel: bool = False

    def __init__(self, config: ModelConfig, moe: MoeConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.gate = Linear(config.hidden_size, moe.num_experts, bias=False)
        self.experts = Experts(config, moe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = route(self.gate(x), self.top_k, self.norm_topk_prob, self.kernel)
        return combine(self.experts(x, routing), routing, x.shape[0], self.kernel)


def create_mlp(config: ModelConfig, layer_id: int) -> nn.Module:
    """The layer's MLP: experts where the config makes the layer sparse, else dense."""
    moe = config.moe
    if moe is not None and layer_id in moe.sparse_layers:
        return SparseMoeBlock(config, moe)
    return MLP(config)
