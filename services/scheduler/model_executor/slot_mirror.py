"""Device copies of the running requests' KV slot lists, kept from step to step.

A step's attention reads every slot of every request in it, but a decode step adds only
one slot per request. Converting each request's whole host list into a tensor every
step made the step's host work grow with the context: 1.9 ms at 16 requests of 2,000
tokens on the Zen 4 EPYC, a third of a tiny model's step. The mirror keeps one growing
device buffer per slot list and copies in only the entries added since the step before.

It relies on how the scheduler treats a request's ``kv_slots`` (core/req.py): while the
request runs the list only grows; matching a cached prefix, caching one, retracting or
finishing replaces the list object. A list the mirror has not seen in the step before is
converted whole. Owned by the ``ModelRunner``, engine thread only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class _Mirror:
    source: list[int]  # the host list mirrored (held: its id cannot be reused meanwhile)
    buffer: torch.Tensor  # [capacity] int64 on the device; the first `synced` entries valid
    synced: int


class SlotMirror:
    """``tensors(lists)``: each list's slots as a device int64 tensor (a view of a buffer
    kept for the next step), copying only what the list gained since it was last seen."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._mirrors: dict[int, _Mirror] = {}

    def tensors(self, lists: list[list[int]]) -> list[torch.Tensor]:
        mirrors: list[_Mirror] = []
        gained: list[int] = []
        for slots in lists:
            mirror = self._mirrors.get(id(slots))
            if mirror is None or mirror.source is not slots or mirror.synced > len(slots):
                mirror = _Mirror(slots, torch.empty(0, dtype=torch.int64, device=self.device), 0)
            gained.extend(slots[mirror.synced :])
            mirrors.append(mirror)
        new_values = torch.tensor(gained, dtype=torch.int64, device=self.device)
        out, offset = [], 0
        for mirror in mirrors:
            length = len(mirror.source)
            if length > mirror.buffer.shape[0]:
                mirror.buffer = self._grown(mirror, length)
            count = length - mirror.synced
            if count:
                mirror.buffer[mirror.synced : length].copy_(new_values[offset : offset + count])
                offset += count
                mirror.synced = length
            out.append(mirror.buffer[:length])
        # Only the lists of this step stay mirrored: a finished request's buffer goes.
        self._mirrors = {id(mirror.source): mirror for mirror in mirrors}
        return out

    def _grown(self, mirror: _Mirror, length: int) -> torch.Tensor:
        """A buffer of at least ``length`` entries (doubling), holding the synced ones."""
        capacity = max(length, 2 * mirror.buffer.shape[0], 64)
        buffer = torch.empty(capacity, dtype=torch.int64, device=self.device)
        buffer[: mirror.synced].copy_(mirror.buffer[: mirror.synced])
        return buffer
