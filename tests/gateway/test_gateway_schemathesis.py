"""Schemathesis over the gateway's own /openapi.json: every operation it documents, fed
requests drawn from its schemas, valid and invalid, answers below 500.

A client's bad input must be a 4xx naming what was wrong, never a server error; this holds
the HTTP door to that for every documented route at once. The gateway runs for real (uvicorn)
over the FAKE frontend (tests/gateway/fake_frontend.py), so what is checked is the gateway's
own parsing, validation and rendering; the live stack's gRPC door has its own fuzzing
(tests/integration/test_grpc_fuzz.py). Schemathesis's pytest plugin does not load under
this pytest, so its case strategies are driven by hypothesis directly.
"""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.generation import GenerationMode

pytestmark = pytest.mark.tooling

MODES = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]


@pytest.fixture(scope="module")
def operations(gateway_url: str) -> list[Any]:
    schema = schemathesis.openapi.from_url(f"{gateway_url}/openapi.json")
    found = [result.ok() for result in schema.get_all_operations()]
    assert len(found) >= 10  # the chat, completions, messages, models ... routes were read
    return found


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_no_documented_operation_answers_5xx(
    operations: list[Any], gateway_url: str, mode: GenerationMode
) -> None:
    statuses: set[int] = set()
    for operation in operations:

        @settings(
            max_examples=10,  # 15 took 41 s of the suite's six minutes
            deadline=None,
            derandomize=True,  # the same requests every run: a failure reproduces
            suppress_health_check=list(HealthCheck),
        )
        @given(operation.as_strategy(generation_mode=mode))
        def check(case: Any) -> None:
            response = case.call(base_url=gateway_url, timeout=30)
            statuses.add(response.status_code)
            assert response.status_code < 500, (case.method, case.path, response.text[:500])

        try:
            check()
        except Unsatisfiable:
            assert mode is GenerationMode.NEGATIVE  # an operation with no input has no invalid one
    if mode is GenerationMode.NEGATIVE:
        assert any(400 <= s < 500 for s in statuses)  # invalid input was drawn and refused
