"""Prompts made of real tokens of the model's tokenizer, with known token lengths.

`random`: each prompt is random token ids decoded to text, re-encoded until its
length is what was asked (decoding random ids does not round-trip exactly).
`shared-prefix`: groups of prompts that share one long random system prefix, the
shape that exercises a prefix cache.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Literal

from transformers import PreTrainedTokenizerBase

DatasetName = Literal["random", "shared-prefix"]
# Re-encode rounds before accepting a length that is off by a token or two.
MAX_FIT_ROUNDS = 6


@dataclass(frozen=True, slots=True)
class DatasetConfig:
    name: DatasetName
    num_prompts: int
    input_len: int
    output_len: int
    range_ratio: float = 0.0
    prefix_len: int = 0
    num_groups: int = 1
    seed: int = 0


@dataclass(frozen=True, slots=True)
class BenchPrompt:
    """One request's input. `system` is the shared prefix (None for `random`)."""

    user: str
    prompt_len: int
    output_len: int
    system: str | None = None
    group: int | None = None

    def completion_text(self) -> str:
        """The plain prompt for /v1/completions: the prefix, then the question."""
        return self.user if self.system is None else self.system + self.user


class TokenSampler:
    """Draws text of a given token length from the tokenizer's regular vocabulary."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, rng: random.Random) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        special = set(tokenizer.all_special_ids)
        self.vocab = [i for i in range(tokenizer.vocab_size) if i not in special]

    def random_ids(self, n: int) -> list[int]:
        return [self.rng.choice(self.vocab) for _ in range(n)]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def text(self, num_tokens: int) -> tuple[str, int]:
        """Text whose encoding is `num_tokens` long (or within a token after the last round)."""
        ids = self.random_ids(num_tokens)
        text = self.tokenizer.decode(ids)
        for _ in range(MAX_FIT_ROUNDS):
            encoded = self.encode(text)
            if len(encoded) == num_tokens:
                break
            if len(encoded) > num_tokens:
                ids = encoded[:num_tokens]
            else:
                ids = encoded + self.random_ids(num_tokens - len(encoded))
            text = self.tokenizer.decode(ids)
        return text, len(self.encode(text))


def sample_len(rng: random.Random, mean: int, range_ratio: float) -> int:
    """Uniform in [mean·(1-r), mean·(1+r)], at least 1 (vLLM's `--random-range-ratio`)."""
    low = max(1, round(mean * (1 - range_ratio)))
    high = max(low, round(mean * (1 + range_ratio)))
    return rng.randint(low, high)


def build_random(config: DatasetConfig, tokenizer: PreTrainedTokenizerBase) -> list[BenchPrompt]:
    rng = random.Random(config.seed)
    sampler = TokenSampler(tokenizer, rng)
    prompts = []
    for _ in range(config.num_prompts):
        text, length = sampler.text(sample_len(rng, config.input_len, config.range_ratio))
        output_len = sample_len(rng, config.output_len, config.range_ratio)
        prompts.append(BenchPrompt(user=text, prompt_len=length, output_len=output_len))
    return prompts


def build_shared_prefix(
    config: DatasetConfig, tokenizer: PreTrainedTokenizerBase
) -> list[BenchPrompt]:
    """`num_groups` prefixes of `prefix_len` tokens; prompts go to groups round-robin.

    The prefix ends in a blank line so the question's first token cannot merge
    with the prefix's last one: every prompt of a group starts with the same ids.
    """
    rng = random.Random(config.seed)
    sampler = TokenSampler(tokenizer, rng)
    prefix_body = max(1, config.prefix_len - 1)  # the blank line is the last prefix token
    prefixes = [sampler.text(prefix_body)[0] + "\n\n" for _ in range(config.num_groups)]
    prompts = []
    for i in range(config.num_prompts):
        group = i % config.num_groups
        question, _ = sampler.text(sample_len(rng, config.input_len, config.range_ratio))
        prompt = BenchPrompt(
            user=question,
            prompt_len=0,
            output_len=sample_len(rng, config.output_len, config.range_ratio),
            system=prefixes[group],
            group=group,
        )
        prompt_len = len(sampler.encode(prompt.completion_text()))
        prompts.append(replace(prompt, prompt_len=prompt_len))
    return prompts


def build_dataset(config: DatasetConfig, tokenizer: PreTrainedTokenizerBase) -> list[BenchPrompt]:
    if config.name == "random":
        return build_random(config, tokenizer)
    if config.name == "shared-prefix":
        return build_shared_prefix(config, tokenizer)
    raise ValueError(f"unknown dataset {config.name!r}: expected 'random' or 'shared-prefix'")
