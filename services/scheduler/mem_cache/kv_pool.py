"""Token-granular KV pool: the only owner of KV memory in tokenline.

One slot holds the K and V of one token for every layer. Requests own lists of
slot indices (their "page table" at page size 1), which lets the radix cache
share prefixes token by token. The pool is allocated once at start.
"""

from __future__ import annotations

import torch


class KVPool:
    """Fixed-size K/V buffers plus a free list of slot indices.

    Callers use ``can_allocate`` before ``allocate``; ``free`` returns slots.
    Only the scheduler calls ``allocate``/``free``; the model only writes into
    the slots it is handed (``ForwardBatch.out_cache_loc``).
    """

    def __init__(
        self,
        num_tokens: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_tokens <= 0:
            raise ValueError(f"KV pool needs at least one token slot, got {num_tokens}")
        self.num_tokens = num_tokens
        self.num_layers = num_layers
        shape = (num_tokens, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._free_slots: list[int] = list(range(num_tokens))

    @property
    def num_free(self) -> int:
        return len(self._free_slots)

    def can_allocate(self, num: int) -> bool:
        return num <= len(self._free_slots)

    def allocate(self, num: int) -> list[int]:
        """Take ``num`` free slots; raises if the caller did not check first."""
        if num > len(self._free_slots):
            raise RuntimeError(f"KV pool exhausted: need {num}, have {len(self._free_slots)}")
        taken = self._free_slots[-num:] if num else []
        del self._free_slots[len(self._free_slots) - num :]
        return taken

    def free(self, slots: list[int]) -> None:
        self._free_slots.extend(slots)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new K/V ([T, kv_heads, head_dim]) at ``slots`` ([T])."""
        self.k_buffers[layer][slots] = k.to(self.k_buffers[layer].dtype)
        self.v_buffers[layer][slots] = v.to(self.v_buffers[layer].dtype)

    @property
    def num_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (*self.k_buffers, *self.v_buffers))

    @classmethod
    def tokens_for_budget(
        cls,
        memory_bytes: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        """How many token slots fit in ``memory_bytes`` (K and V of every layer)."""
        return memory_bytes // cls.bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return (
            2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
        )
