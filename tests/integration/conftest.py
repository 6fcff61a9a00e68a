"""A live four-process stack on free loopback ports, shared by a test module, and an
openai client on its gateway."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from services.launch import LocalStack
from tests.live_stack import running_stack


@pytest.fixture(scope="module")
def stack(
    default_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[LocalStack]:
    with running_stack(
        default_model_dir,
        tmp_path_factory.mktemp("stack-logs"),
        request,
        scheduler_args=["--kv-cache-tokens", "16384", "--num-threads", "1"],
    ) as stack:
        yield stack


@pytest.fixture(scope="module")
def client(stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id
