"""services.launch.free_ports: a stack's ports must be distinct. CI once got
StackPorts(frontend=42755, scheduler=42755, ...) from ports bound and released one at a
time; both gRPC servers bound 42755 and the scheduler's calls reached the frontend."""

from __future__ import annotations

import socket
from dataclasses import astuple

from services.launch import StackPorts, _ephemeral_floor, free_ports


def test_ports_picked_together_are_distinct_and_bindable() -> None:
    ports = free_ports(64)
    assert len(set(ports)) == 64
    with socket.socket() as s:  # released again once picked
        s.bind(("127.0.0.1", ports[0]))


def test_a_free_stack_has_no_port_twice() -> None:
    for _ in range(20):
        ports = astuple(StackPorts.free())
        assert len(set(ports)) == len(ports)


def test_ports_come_from_below_the_kernels_ephemeral_range() -> None:
    """An outgoing connection's local port comes from the ephemeral range; a port picked
    there may be taken by one before its service binds it (seen in CI: EADDRINUSE)."""
    floor = _ephemeral_floor()
    assert all(port < floor for port in free_ports(64))


def test_many_picks_in_one_process_do_not_repeat_a_port_soon() -> None:
    """Stacks started side by side (three at once in one test) each get their own ports,
    though each pick releases its sockets before the services bind them."""
    picks = [port for _ in range(30) for port in free_ports(7)]
    assert len(set(picks)) == len(picks)
