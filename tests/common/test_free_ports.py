"""services.launch.free_ports: a stack's ports must be distinct. CI once got
StackPorts(frontend=42755, scheduler=42755, ...) from ports bound and released one at a
time; both gRPC servers bound 42755 and the scheduler's calls reached the frontend."""

from __future__ import annotations

import socket
from dataclasses import astuple

from services.launch import StackPorts, free_ports


def test_ports_picked_together_are_distinct_and_bindable() -> None:
    ports = free_ports(64)
    assert len(set(ports)) == 64
    with socket.socket() as s:  # released again once picked
        s.bind(("127.0.0.1", ports[0]))


def test_a_free_stack_has_no_port_twice() -> None:
    for _ in range(20):
        ports = astuple(StackPorts.free())
        assert len(set(ports)) == len(ports)
