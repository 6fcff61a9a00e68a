"""An openai client on the gateway of the module's live stack (``stack``, tests/conftest.py)."""

from __future__ import annotations

import openai
import pytest

from services.launch import LocalStack


@pytest.fixture(scope="module")
def client(stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id
