"""HF transformers' pooled hidden states, the reference the live embedding tests compare
the served vectors with: the same checkpoint in float32, ``output_hidden_states=True``,
``hidden_states[-1]`` (after the final norm, as tests/scheduler/model_executor/
test_pooling.py checks), pooled and L2-normalised."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

ATOL = 1e-4  # float32 served against float32 HF


def load_reference(model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def pooled(model: PreTrainedModel, ids: list[int], method: str) -> list[float]:
    with torch.no_grad():
        hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    rows = {"last": hidden[-1:], "cls": hidden[:1], "mean": hidden}[method]
    return torch.nn.functional.normalize(rows.mean(dim=0), dim=0).tolist()


def max_error(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want)
    return max(abs(a - b) for a, b in zip(got, want, strict=True))
