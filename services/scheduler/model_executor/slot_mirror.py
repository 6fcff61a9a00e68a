"""Device copies of the running requests' KV slot lists, kept from step to step.

A step's attention reads every slot of every request in it, but a decode step adds only
one slot per request. Converting each request's whole host list into a tensor every
step made the step's host work grow with the context: 1.9 ms at 16 requests of 2,000
tokens on the Zen 4 EPYC, a third of a tiny model's step. The mirror keeps one growing
device buffer per slot list and copies in only the entries added since the step before.

It relies on how the scheduler treats a request's ``kv_slots`` (core/req.py): while the
request runs the list only grows; matching a cached prefix, caching one, retracting or
finishing replaces the list object. A list the mirror has not seen in the step before is
converted whole, into a view of the step's one tensor, so a step of new lists (a prefill,
or every step under overlap scheduling, which hands the forward copies) costs what
converting them always did. Owned by the ``ModelRunner``, engine thread only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class _Mirror:
    source: list[int]  # the host list mirrored (held: its id cannot be reused meanwhile)
    # [capacity] int64 on the device, the first `synced` entries valid. A list seen for the
    # first time gets a view of that step's tensor instead (capacity = synced): only a
    # list that comes back, and grew, gets a buffer of its own.
    buffer: torch.Tensor
    synced: int


class SlotMirror:
    """``tensors(lists)``: each list's slots as a device int64 tensor (a view of a buffer
    kept for the next step), copying only what the list gained since it was last seen."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._mirrors: dict[int, _Mirror] = {}

    def tensors(self, lists: list[list[int]]) -> list[torch.Tensor]:
        mirrors: list[_Mirror | None] = []  # None: a list not mirrored in the step before
        gained: list[int] = []
        for slots in lists:
            mirror = self._mirrors.get(id(slots))
            if mirror is not None and (mirror.source is not slots or mirror.synced > len(slots)):
                mirror = None
            gained.extend(slots[mirror.synced :] if mirror is not None else slots)
            mirrors.append(mirror)
        new_values = torch.tensor(gained, dtype=torch.int64, device=self.device)
        out, offset = [], 0
        kept: dict[int, _Mirror] = {}  # only this step's lists: a finished request's goes
        for slots, mirror in zip(lists, mirrors, strict=True):
            length = len(slots)
            if mirror is None:  # its slots are a view of this step's tensor, as they are
                mirror = _Mirror(slots, new_values[offset : offset + length], length)
                offset += length
            elif length > mirror.synced:
                if length > mirror.buffer.shape[0]:
                    mirror.buffer = self._grown(mirror, length)
                count = length - mirror.synced
                mirror.buffer[mirror.synced : length].copy_(new_values[offset : offset + count])
                offset += count
                mirror.synced = length
            out.append(mirror.buffer[:length])
            kept[id(slots)] = mirror
        self._mirrors = kept
        return out

    def _grown(self, mirror: _Mirror, length: int) -> torch.Tensor:
        """A buffer of at least ``length`` entries (doubling), holding the synced ones."""
        capacity = max(length, 2 * mirror.buffer.shape[0], 64)
        buffer = torch.empty(capacity, dtype=torch.int64, device=self.device)
        buffer[: mirror.synced].copy_(mirror.buffer[: mirror.synced])
        return buffer
