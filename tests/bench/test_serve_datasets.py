"""bench/serve datasets, built with the default model's real tokenizer."""

from __future__ import annotations

import os

import pytest
from transformers import PreTrainedTokenizerBase

from bench.serve.datasets import DatasetConfig, build_dataset


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_random_prompts_have_the_asked_token_lengths(tokenizer: PreTrainedTokenizerBase) -> None:
    prompts = build_dataset(DatasetConfig("random", 20, 48, 12, seed=1), tokenizer)
    assert len(prompts) == 20
    for prompt in prompts:
        assert prompt.prompt_len == len(encode(tokenizer, prompt.user))
        assert abs(prompt.prompt_len - 48) <= 1
        assert prompt.output_len == 12
        assert prompt.system is None and prompt.completion_text() == prompt.user
    assert len({p.user for p in prompts}) == 20


def test_random_lengths_spread_over_the_range_ratio(tokenizer: PreTrainedTokenizerBase) -> None:
    prompts = build_dataset(DatasetConfig("random", 30, 40, 20, range_ratio=0.5, seed=2), tokenizer)
    inputs = [p.prompt_len for p in prompts]
    outputs = [p.output_len for p in prompts]
    assert all(19 <= n <= 61 for n in inputs) and len(set(inputs)) > 5
    assert all(10 <= n <= 30 for n in outputs) and len(set(outputs)) > 5


def test_random_dataset_is_seeded(tokenizer: PreTrainedTokenizerBase) -> None:
    config = DatasetConfig("random", 4, 16, 4, seed=7)
    assert build_dataset(config, tokenizer) == build_dataset(config, tokenizer)
    other = DatasetConfig("random", 4, 16, 4, seed=8)
    assert build_dataset(config, tokenizer) != build_dataset(other, tokenizer)


def test_shared_prefix_groups_share_their_prefix_tokens(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    config = DatasetConfig("shared-prefix", 9, 16, 8, prefix_len=64, num_groups=3, seed=0)
    prompts = build_dataset(config, tokenizer)
    assert [p.group for p in prompts] == [0, 1, 2] * 3
    firsts = []
    for group in range(3):
        members = [p for p in prompts if p.group == group]
        ids = [encode(tokenizer, p.completion_text()) for p in members]
        prefix = encode(tokenizer, members[0].system)
        assert len(prefix) == 64
        assert all(seq[:64] == prefix for seq in ids)  # every token of the prefix, exactly
        assert len(os.path.commonprefix(ids)) < 64 + 16  # the questions differ
        assert [p.prompt_len for p in members] == [len(seq) for seq in ids]
        assert {p.system for p in members} == {members[0].system}
        firsts.append(prefix)
    assert all(abs(len(encode(tokenizer, p.user)) - 16) <= 1 for p in prompts)
    assert len(os.path.commonprefix(firsts)) < 4  # groups do not share one prefix


def test_unknown_dataset_is_refused(tokenizer: PreTrainedTokenizerBase) -> None:
    with pytest.raises(ValueError, match="unknown dataset"):
        build_dataset(DatasetConfig("sharegpt", 1, 1, 1), tokenizer)  # type: ignore[arg-type]
