"""The AOT-compiled dense-row kernel: built here for a small vocabulary, loaded through
torch's AOTI runner, checked against eager torch and through the sampler's draws."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from services.scheduler.block_mass_kernel import BLOCK, BlockMassKernel, build, kernel_path
from services.scheduler.sampler import Sampler
from tests.scheduler.test_sampler import assert_goodness_of_fit, req_with_history

VOCAB = 8 * BLOCK

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="AOTInductor needs a C++ compiler",
)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> BlockMassKernel:
    model_dir = tmp_path_factory.mktemp("model")
    path = build(model_dir, torch.bfloat16, VOCAB)
    assert path == kernel_path(model_dir, torch.bfloat16, VOCAB) and path.is_file()
    loaded = BlockMassKernel.load(model_dir, torch.bfloat16, VOCAB)
    assert loaded is not None
    return loaded


def bf16_logits(rows: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, VOCAB, generator=gen) * scale).to(torch.bfloat16)


def test_block_masses_are_eager_softmax_block_sums(kernel: BlockMassKernel) -> None:
    logits = bf16_logits(5, seed=1)
    inv_temperature = torch.tensor([[1.0], [0.5], [2.0], [1.0 / 0.7], [1.0]])
    top, mass = kernel(logits, inv_temperature)
    scaled = logits.float() * inv_temperature
    assert torch.equal(top, scaled.amax(dim=-1, keepdim=True))
    expected = torch.softmax(scaled, dim=-1).view(5, -1, BLOCK).sum(dim=-1)
    torch.testing.assert_close(
        mass / mass.sum(dim=-1, keepdim=True), expected, rtol=1e-5, atol=1e-7
    )


def test_a_row_gets_the_same_bits_alone_in_a_batch_or_strided(kernel: BlockMassKernel) -> None:
    """Seeded draws must not depend on the batch: the kernel's rows are independent, and a
    strided view (which the compiled code would misread) is made contiguous first."""
    logits, inv_temperature = bf16_logits(9, seed=2), torch.full((9, 1), 0.8)
    top, mass = kernel(logits, inv_temperature)
    for start, stop in ((4, 5), (0, 3), (3, 9)):
        part_top, part_mass = kernel(logits[start:stop], inv_temperature[start:stop])
        assert torch.equal(part_mass, mass[start:stop]) and torch.equal(part_top, top[start:stop])
    every_other = kernel(logits[::2], inv_temperature[::2])[1]
    assert torch.equal(every_other, mass[::2])


def test_a_kernel_is_found_only_for_its_dtype_and_vocabulary(
    kernel: BlockMassKernel, tmp_path: Path
) -> None:
    assert kernel.fits(bf16_logits(3, seed=0))
    assert not kernel.fits(bf16_logits(3, seed=0).float())
    assert not kernel.fits(torch.zeros(3, VOCAB + BLOCK, dtype=torch.bfloat16))
    assert BlockMassKernel.load(tmp_path, torch.bfloat16, VOCAB) is None  # nothing built there
    model_dir = kernel_path(tmp_path, torch.bfloat16, VOCAB).parent.parent
    assert kernel_path(model_dir, torch.float32, VOCAB) != kernel_path(
        model_dir, torch.bfloat16, VOCAB
    )


def test_temperature_draws_through_the_kernel_follow_the_softmax(kernel: BlockMassKernel) -> None:
    """Chi-square (alpha 1e-4) of 20,000 seeded draws at T = 0.7 from a peaked bf16 row,
    against softmax(x / T) computed here in float64."""
    row = bf16_logits(1, seed=4, scale=2.0)
    sampler = Sampler(block_mass=kernel)
    tokens: list[int] = []
    for batch in range(5):  # batches the kernel takes (at most 4,096 rows)
        reqs = [
            req_with_history([2], [], seed=batch * 4_000 + i, temperature=0.7) for i in range(4_000)
        ]
        logits = row.expand(len(reqs), VOCAB).clone()
        assert kernel.fits(logits)
        tokens += sampler.sample(logits, reqs).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
    expected = torch.softmax(row[0].double() / 0.7, dim=-1).tolist()
    assert_goodness_of_fit(counts, expected)


def test_greedy_rows_beside_kernel_rows_and_seeds_that_ignore_the_batch(
    kernel: BlockMassKernel,
) -> None:
    logits = bf16_logits(4, seed=5)
    sampler = Sampler(block_mass=kernel)
    reqs = [
        req_with_history([2], [], temperature=0.0),
        req_with_history([2], [], seed=11, temperature=1.0),
        req_with_history([2], [], temperature=0.0),
        req_with_history([2], [], seed=12, temperature=0.5),
    ]
    tokens = sampler.sample(logits.clone(), reqs).token_ids
    greedy = logits.float().argmax(dim=-1).tolist()
    assert tokens[0] == greedy[0] and tokens[2] == greedy[2]
    alone = Sampler(block_mass=kernel).sample(
        logits[1:2].clone(), [req_with_history([2], [], seed=11, temperature=1.0)]
    )
    assert alone.token_ids == [tokens[1]]
