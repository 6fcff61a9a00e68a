"""The whole request path, end to end, through the official openai client."""

from __future__ import annotations

from pathlib import Path

import openai
from transformers import AutoTokenizer

from services.launch import LocalStack

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours, please."},
]


def expected_prompt_tokens(model_dir: Path, messages: list[dict]) -> int:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_models_lists_the_served_model(client: openai.OpenAI, default_model_dir: Path) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [default_model_dir.name]


def test_stream_equals_non_stream_at_temperature_zero(
    client: openai.OpenAI, model_id: str, default_model_dir: Path
) -> None:
    kwargs = dict(model=model_id, messages=MESSAGES, temperature=0, max_tokens=24)
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content
    assert len(streamed) > 0
    finishes = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finishes) == 1
    assert finishes[0].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and not chunks[-1].choices
    prompt_tokens = expected_prompt_tokens(default_model_dir, MESSAGES)
    assert full.usage.prompt_tokens == prompt_tokens
    assert usage_chunks[0].usage.prompt_tokens == prompt_tokens
    assert full.usage.completion_tokens == usage_chunks[0].usage.completion_tokens
    assert full.usage.total_tokens == prompt_tokens + full.usage.completion_tokens
    if full.choices[0].finish_reason == "length":
        assert full.usage.completion_tokens == 24
    else:
        assert 1 <= full.usage.completion_tokens <= 24


def test_completion_counts_tokens_and_respects_max_tokens(
    client: openai.OpenAI, model_id: str, default_model_dir: Path
) -> None:
    prompt = "The quick brown fox"
    result = client.completions.create(
        model=model_id, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    assert result.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert result.usage.completion_tokens == 12
    assert result.choices[0].finish_reason == "length"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model_id,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        if c.choices
    )
    assert streamed == result.choices[0].text


def test_completion_text_matches_decoding_of_generated_ids(
    stack: LocalStack, default_model_dir: Path
) -> None:
    import httpx

    body = {
        "text": ["Once upon a time"],
        "sampling_params": {"temperature": 0, "max_new_tokens": 16},
    }
    out = httpx.post(
        f"http://{stack.host}:{stack.ports.gateway}/generate", json=body, timeout=60
    ).json()[0]  # a list of prompts answers a list (SGLang)
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    ids = [int(i) for i in out["output_ids"]]
    assert 1 <= len(ids) <= 16
    assert out["text"] == tokenizer.decode(
        ids[:-1] if ids[-1] == tokenizer.eos_token_id else ids, skip_special_tokens=True
    )
