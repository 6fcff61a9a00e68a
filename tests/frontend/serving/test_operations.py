"""Which live requests an /abort_request id names (services/frontend/serving/operations.py)."""

from __future__ import annotations

import pytest

from services.frontend.serving.operations import is_label_of


@pytest.mark.parametrize(
    ("label", "client_id", "named"),
    [
        ("job", "job", True),  # a single prompt
        ("job-0", "job", True),  # batch element 0
        ("job-1-3", "job", True),  # choice 3 of batch element 1 (n > 1)
        ("job-1", "job-1", True),  # one element by the id meta_info.id showed
        ("job-1-3", "job-1", True),
        ("jobs", "job", False),
        ("job-x", "job", False),
        ("job-1-2-3", "job", False),
        ("other-job", "job", False),
        ("job", "job-0", False),
    ],
)
def test_a_client_id_names_its_request_and_its_batch_elements(
    label: str, client_id: str, named: bool
) -> None:
    assert is_label_of(label, client_id) is named
