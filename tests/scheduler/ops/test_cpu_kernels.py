"""The compiled plain-row kernel (csrc/sample_rows.cpp): built here with the machine's C++
compiler, loaded as a torch op, and checked against float64 references: a draw at a row's
own uniform is the inverse CDF of the exact softmax there, draws by proposals pass a
chi-square test against it (on rows from flat to heavy-tailed, and through the fallback),
and each greedy row is torch's argmax."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.scheduler.ops.cpu_kernels import SampleKernel
from services.scheduler.sampling.row_argmax import BLOCK
from services.scheduler.sampling.sampler import Sampler
from tests.scheduler.conftest import needs_compiler
from tests.scheduler.sampling.test_sampler import assert_goodness_of_fit, req_with_history

RAGGED_VOCAB = 8 * BLOCK + 5  # a last block of 5 entries, shorter than one vector
DTYPES = [torch.bfloat16, torch.float32, torch.float16]

pytestmark = needs_compiler


@pytest.fixture(scope="module")
def kernel(kernel_model_dir: Path) -> SampleKernel:
    loaded = SampleKernel.load(kernel_model_dir)
    assert loaded is not None
    return loaded


def logits_of(rows: int, seed: int, dtype: torch.dtype, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, RAGGED_VOCAB, generator=gen) * scale).to(dtype)


def exact_inverse_cdf(row: torch.Tensor, inv_temperature: float, uniforms: torch.Tensor):
    """The token each uniform picks from softmax(row * inv_temperature) in float64, and how
    far each uniform lies from the nearest edge between two tokens."""
    probs = torch.softmax(row.double() * inv_temperature, dim=-1)
    cdf = probs.cumsum(dim=-1)
    u = uniforms.double()
    tokens = torch.searchsorted(cdf, u, right=True).clamp_max(row.numel() - 1)
    edges = torch.cat((cdf.new_zeros(1), cdf))
    distance = (u.unsqueeze(1) - edges).abs().min(dim=1).values
    return tokens, distance


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_each_draw_is_the_exact_inverse_cdf_at_its_uniform(
    kernel: SampleKernel, dtype: torch.dtype, temperature: float
) -> None:
    """4,000 uniforms against one row: a token may differ from the float64 inverse CDF only
    where the uniform lies within rounding (1e-5) of the edge between two tokens."""
    row = logits_of(1, seed=7, dtype=dtype)[0]
    uniforms = torch.rand(4_000, generator=torch.Generator().manual_seed(1))
    logits = row.expand(len(uniforms), -1).contiguous()
    inverse = torch.full((len(uniforms),), 1.0 / temperature)
    tokens = kernel(logits, inverse, uniforms, seed=0)
    expected, distance = exact_inverse_cdf(row, 1.0 / temperature, uniforms)
    differs = tokens != expected
    assert bool((distance[differs] < 1e-5).all()), distance[differs]
    assert int(differs.sum()) <= 2
    assert len(set(tokens.tolist())) > 30  # the draws spread over the row


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_greedy_rows_take_torchs_argmax_ties_and_nan_included(
    kernel: SampleKernel, dtype: torch.dtype
) -> None:
    logits = logits_of(4, seed=2, dtype=dtype)
    logits[1, 300] = logits[1, 900] = logits[1].max() + 1  # a tie: the first one wins
    logits[2, RAGGED_VOCAB - 1] = 1e4  # the maximum in the ragged tail
    logits[3, 777] = float("nan")  # torch counts NaN as the maximum
    tokens = kernel(logits, torch.zeros(4), torch.rand(4), seed=0)
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()
    assert tokens.tolist()[1:] == [300, RAGGED_VOCAB - 1, 777]


def test_a_row_with_its_own_uniform_draws_the_same_token_alone_in_a_batch_or_strided(
    kernel: SampleKernel,
) -> None:
    """Seeded draws must not depend on the batch: rows are independent in the kernel, and
    neither the call's seed nor the rows beside one change its inverse CDF draw."""
    logits = logits_of(9, seed=3, dtype=torch.bfloat16)
    inverse = torch.tensor([1.0, 0.0, 2.0, 1.0 / 0.7, 1.0, 0.0, 0.5, 1.0, 1.3])
    uniforms = torch.rand(9, generator=torch.Generator().manual_seed(4))
    tokens = kernel(logits, inverse, uniforms, seed=1)
    for start, stop in ((4, 5), (0, 3), (3, 9)):
        part = kernel(logits[start:stop], inverse[start:stop], uniforms[start:stop], seed=2)
        assert torch.equal(part, tokens[start:stop])
    every_other = kernel(logits[::2], inverse[::2], uniforms[::2], seed=3)
    assert torch.equal(every_other, tokens[::2])


def proposal_draws(
    kernel: SampleKernel, row: torch.Tensor, temperature: float, draws: int, **kwargs: int
) -> torch.Tensor:
    """``draws`` tokens by proposals from copies of ``row``, 2,000 rows (Philox
    subsequences) per call, a new seed per call; their counts per token."""
    tokens = []
    for call in range(draws // 2_000):
        logits = row.expand(2_000, -1).contiguous()
        inverse = torch.full((2_000,), 1.0 / temperature)
        tokens.append(kernel(logits, inverse, -torch.ones(2_000), seed=1_000 + call, **kwargs))
    return torch.bincount(torch.cat(tokens), minlength=row.numel()).double()


PROPOSAL_ROWS = {
    "peaked-bf16-T0.7": (torch.bfloat16, 3.0, 0.7),
    "flat-bf16": (torch.bfloat16, 0.1, 1.0),
    "heavy-tailed-bf16": (torch.bfloat16, 8.0, 1.0),  # like the default model's logits
    "float32-T1.3": (torch.float32, 2.0, 1.3),
    "float16": (torch.float16, 2.0, 1.0),
}


@pytest.mark.parametrize("case", PROPOSAL_ROWS.values(), ids=PROPOSAL_ROWS.keys())
def test_draws_by_proposals_follow_the_softmax(kernel: SampleKernel, case: tuple) -> None:
    """Chi-square (alpha 1e-4) of 40,000 draws against softmax(x / T) in float64."""
    dtype, scale, temperature = case
    row = logits_of(1, seed=8, dtype=dtype, scale=scale)[0]
    counts = proposal_draws(kernel, row, temperature, 40_000)
    assert_goodness_of_fit(counts, torch.softmax(row.double() / temperature, dim=-1).tolist())


@pytest.mark.parametrize("max_proposals", [0, 1, 3])
def test_rows_that_accept_no_proposal_fall_back_without_bias(
    kernel: SampleKernel, max_proposals: int
) -> None:
    """With no proposals (every row falls back to the inverse CDF at a Philox uniform), or
    so few that many rows fall back, the draws still follow the softmax: the fallback is
    taken with fresh randomness."""
    row = logits_of(1, seed=9, dtype=torch.bfloat16, scale=8.0)[0]
    counts = proposal_draws(kernel, row, 1.0, 40_000, max_proposals=max_proposals)
    assert_goodness_of_fit(counts, torch.softmax(row.double(), dim=-1).tolist())


def test_a_call_seed_decides_the_proposals(kernel: SampleKernel) -> None:
    logits = logits_of(1, seed=10, dtype=torch.bfloat16)[0].expand(64, -1).contiguous()
    inverse, unseeded = torch.ones(64), -torch.ones(64)
    first = kernel(logits, inverse, unseeded, seed=5)
    assert torch.equal(kernel(logits, inverse, unseeded, seed=5), first)
    assert not torch.equal(kernel(logits, inverse, unseeded, seed=6), first)
    assert len(set(first.tolist())) > 1  # the rows are different Philox streams


def test_masked_entries_are_never_drawn(kernel: SampleKernel) -> None:
    logits = torch.full((500, RAGGED_VOCAB), float("-inf"))
    allowed = [3, 130, 131, RAGGED_VOCAB - 2]
    logits[:, allowed] = torch.tensor([0.5, 0.0, -1.0, 2.0])
    for uniforms in (torch.rand(500), -torch.ones(500)):  # inverse CDF, then proposals
        tokens = kernel(logits, torch.ones(500), uniforms, seed=0)
        assert set(tokens.tolist()) == set(allowed)


def test_bad_arguments_raise_instead_of_reading_memory_wrong(kernel: SampleKernel) -> None:
    logits = logits_of(3, seed=0, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="float32"):
        kernel(logits, torch.ones(3, dtype=torch.float64), torch.rand(3), seed=0)
    with pytest.raises(RuntimeError, match=r"\[rows\]"):
        kernel(logits, torch.ones(2), torch.rand(3), seed=0)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernel(logits.to(torch.int32), torch.ones(3), torch.rand(3), seed=0)
    with pytest.raises(RuntimeError, match="max_proposals"):
        kernel(logits, torch.ones(3), torch.rand(3), seed=0, max_proposals=-1)


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
def test_temperature_draws_through_the_sampler_follow_the_softmax(
    kernel: SampleKernel, seeded: bool
) -> None:
    """Chi-square (alpha 1e-4) of 20,000 draws at T = 0.7 from a peaked bf16 row, against
    softmax(x / T) computed here in float64: seeded requests draw by inverse CDF at their
    own uniform, unseeded ones by proposals."""
    row = logits_of(1, seed=4, dtype=torch.bfloat16, scale=2.0)
    sampler = Sampler(kernel=kernel)
    tokens: list[int] = []
    for batch in range(5):
        reqs = [
            req_with_history([2], [], seed=batch * 4_000 + i if seeded else None, temperature=0.7)
            for i in range(4_000)
        ]
        tokens += sampler.sample(row.expand(len(reqs), -1).clone(), reqs).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=RAGGED_VOCAB).double()
    expected = torch.softmax(row[0].double() / 0.7, dim=-1).tolist()
    assert_goodness_of_fit(counts, expected)


def test_greedy_rows_beside_sampled_rows_and_seeds_that_ignore_the_batch(
    kernel: SampleKernel,
) -> None:
    logits = logits_of(4, seed=5, dtype=torch.bfloat16)
    sampler = Sampler(kernel=kernel)
    reqs = [
        req_with_history([2], [], temperature=0.0),
        req_with_history([2], [], seed=11, temperature=1.0),
        req_with_history([2], [], top_k=1, temperature=0.9),  # greedy by its top_k
        req_with_history([2], [], seed=12, temperature=0.5),
    ]
    tokens = sampler.sample(logits.clone(), reqs).token_ids
    greedy = logits.float().argmax(dim=-1).tolist()
    assert tokens[0] == greedy[0] and tokens[2] == greedy[2]
    alone = Sampler(kernel=kernel).sample(
        logits[1:2].clone(), [req_with_history([2], [], seed=11, temperature=1.0)]
    )
    assert alone.token_ids == [tokens[1]]


def test_a_second_load_reuses_the_registered_op(kernel: SampleKernel, tmp_path: Path) -> None:
    """A process registers ``tokenline::sample_rows`` once; loading again (another model
    directory, even one without a build) hands back the same op."""
    again = SampleKernel.load(tmp_path)
    assert again is not None
    logits = logits_of(2, seed=6, dtype=torch.float32)
    uniforms = torch.rand(2)
    assert torch.equal(
        again(logits, torch.ones(2), uniforms, seed=0),
        kernel(logits, torch.ones(2), uniforms, seed=0),
    )


@pytest.mark.live  # a fresh interpreter: the live tier holds subprocesses
def test_without_a_build_a_fresh_process_samples_eagerly(tmp_path: Path) -> None:
    """In a process that never registered the op, a model directory with no build gives no
    kernel (the engine then logs that it samples eagerly)."""
    code = (
        "from services.scheduler.ops.cpu_kernels import SampleKernel\n"
        f"assert SampleKernel.load({str(tmp_path)!r}) is None\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
