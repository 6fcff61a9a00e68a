"""Leases: which frontends may own requests on this scheduler right now.

A frontend holds one ``Attach`` stream per scheduler. Requests are accepted only
from a frontend that holds one, and when its last stream ends (crash, network
partition, restart) the scheduler aborts every request it owns. Both checks run
on the event loop, so an AddRequest is either accepted before the lease ends (and
aborted with the rest) or refused after it: no request outlives its owner.
Loop-only; no locking.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class _Lease:
    num_streams: int = 0
    num_accepted: int = 0  # requests accepted since the lease opened


class Leases:
    def __init__(self) -> None:
        self._leases: dict[str, _Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def open(self, owner: str) -> None:
        self._leases.setdefault(owner, _Lease()).num_streams += 1

    def close(self, owner: str) -> bool:
        """End one stream of ``owner``; True when it was the last (the lease is over)."""
        lease = self._leases[owner]
        lease.num_streams -= 1
        if lease.num_streams:
            return False
        del self._leases[owner]
        return True

    def holds(self, owner: str) -> bool:
        return owner in self._leases

    def count_accepted(self, owner: str) -> None:
        self._leases[owner].num_accepted += 1

    def num_accepted(self, owner: str) -> int:
        lease = self._leases.get(owner)
        return 0 if lease is None else lease.num_accepted
