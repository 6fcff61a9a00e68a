"""What one engine step asks of the model: a flat batch of new tokens.

Prefill chunks and decode tokens share one layout (SGLang's "extend" view):
request ``i`` contributes ``extend_lens[i]`` new tokens whose positions end at
``seq_lens[i] - 1``; its full KV (cached prefix + new tokens) lives in the pool
at ``kv_slots[i]``.

Owns nothing long-lived: a step's device tensors, built from host lists by
``ModelRunner`` (tests build one directly), read by the model and the attention
backend, and dropped when the step ends. The slot tensors may be views of the buffers
the runner's ``SlotMirror`` keeps across steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.scheduler.model_executor.slot_mirror import SlotMirror


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, new tokens of every request, concatenated
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    out_cache_loc: torch.Tensor  # [T] int64, pool slot each new token's K/V goes to
    seq_lens: list[int]  # per request: tokens in KV after this step (prefix + new)
    extend_lens: list[int]  # per request: new tokens in this step
    kv_slots: list[torch.Tensor]  # per request: [seq_len] int64 pool slots, in order
    # per request: its prompt's length, where the caller knows it. LongRoPE reads it: HF
    # picks one factor set for a whole prompt by the prompt's length. None = unknown.
    prompt_lens: list[int] | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.extend_lens)

    @classmethod
    def build(
        cls,
        new_token_ids: list[list[int]],
        prefix_lens: list[int],
        kv_slots: list[list[int]],
        device: torch.device | str = "cpu",
        prompt_lens: list[int] | None = None,
        slot_mirror: SlotMirror | None = None,
    ) -> ForwardBatch:
        """Assemble a batch from per-request new tokens and their full slot lists.

        Host lists become device tensors, one copy each whatever the batch size. The
        per-request slot tensors come from ``slot_mirror`` where the caller keeps one
        across steps (only the slots added since are copied); otherwise they are views
        of one tensor of all the lists.
        """
        input_ids: list[int] = []
        positions: list[int] = []
        out_loc: list[int] = []
        seq_lens, extend_lens = [], []
        for ids, prefix_len, slots in zip(new_token_ids, prefix_lens, kv_slots, strict=True):
            seq_len = prefix_len + len(ids)
            if len(slots) != seq_len:
                raise ValueError(f"kv_slots has {len(slots)} entries, expected {seq_len}")
            input_ids.extend(ids)
            positions.extend(range(prefix_len, seq_len))
            out_loc.extend(slots[prefix_len:])
            seq_lens.append(seq_len)
            extend_lens.append(len(ids))

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        if slot_mirror is not None:
            slot_tensors = slot_mirror.tensors(kv_slots)
        else:
            slot_tensors = list(as_tensor([s for slots in kv_slots for s in slots]).split(seq_lens))
        return cls(
            input_ids=as_tensor(input_ids),
            positions=as_tensor(positions),
            out_cache_loc=as_tensor(out_loc),
            seq_lens=seq_lens,
            extend_lens=extend_lens,
            kv_slots=slot_tensors,
            prompt_lens=prompt_lens,
        )
