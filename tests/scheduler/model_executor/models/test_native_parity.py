"""Every native architecture against HF transformers, on tiny random checkpoints that
transformers itself builds and saves (tests/checkpoints.py), in float32.

Per architecture: greedy continuations of mixed-length prompts equal HF's ``generate``
(tests/scheduler/parity.py says what "equal" means), prompt logprobs are within 1e-3, one
step mixing prefills, a prefill chunk and decodes equals each request alone, and the
scheduler's continuous batch gives each request HF's tokens, as it gets alone. Windowed
layers see prompts longer than their window, through SDPA and the compiled decode kernel.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedModel

from services.scheduler.core.output_row import OutputRow
from services.scheduler.model_executor.forward_batch import ForwardBatch
from services.scheduler.model_executor.models.causal_lm import NativeCausalLM
from services.scheduler.model_executor.models.config import ModelConfig
from services.scheduler.model_executor.models.loader import load_model
from services.scheduler.ops.cpu_kernels import SampleKernel, is_registered
from services.scheduler.transport.engine_build import is_prefix_cache_exact
from tests.checkpoints import (
    ARCHITECTURES,
    LONGROPE_ORIGINAL,
    SLIDING_WINDOW,
    build_hf_model,
    save_checkpoint,
)
from tests.scheduler.factories import make_req, make_scheduler, run_to_completion
from tests.scheduler.parity import (
    assert_mixed_batch_matches_alone,
    assert_same_greedy,
    hf_greedy,
    hf_step_logprobs,
    new_pool,
    our_greedy,
)

NEW_TOKENS = 8
LOGPROB_ATOL = 1e-3
PROMPTS = {
    "short": "Hello",
    "medium": "The quick brown fox jumps over the lazy dog. " * 2,
    "long": " ".join(f"item {i}: value {i * 7 % 13};" for i in range(8)),
}
Case = tuple[Path, PreTrainedModel, NativeCausalLM, ModelConfig]


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def case(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    default_model_dir: Path,
) -> Iterator[Case]:
    """One architecture's checkpoint (saved by HF), HF's model and ours loaded from it."""
    hf_model = build_hf_model(request.param)
    out = save_checkpoint(hf_model, tmp_path_factory.mktemp(request.param), default_model_dir)
    model, config = load_model(out, torch.float32, "cpu")
    assert type(model).__name__ == ARCHITECTURES[request.param][1] or config.architecture in (
        "MistralForCausalLM",
    )
    yield out, hf_model, model, config


@pytest.fixture(scope="module")
def prompt_ids(default_model_dir: Path) -> dict[str, list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    ids = {n: [0, *tokenizer.encode(t, add_special_tokens=False)] for n, t in PROMPTS.items()}
    # The features need these lengths: windows shorter than all but the shortest prompt,
    # LongRoPE's original context passed by the long prompt and not reached by the others
    # (a sequence that crosses it while generating has a test of its own, at the end).
    assert len(ids["short"]) < SLIDING_WINDOW < len(ids["medium"])
    assert len(ids["medium"]) + NEW_TOKENS <= LONGROPE_ORIGINAL < len(ids["long"])
    return ids


@pytest.fixture(scope="module")
def hf_expected(case: Case, prompt_ids: dict[str, list[int]]) -> dict[str, tuple[list, list]]:
    """HF's greedy tokens and top-2 gaps per prompt, computed once per architecture."""
    return {n: hf_greedy(case[1], ids, NEW_TOKENS) for n, ids in prompt_ids.items()}


@pytest.fixture
def decode_kernel(case: Case, default_model_dir: Path) -> Iterator[None]:
    """The compiled decode-attention kernel on for ``case``'s model (built by `make model`)."""
    if not any(case[3].layer_windows):
        pytest.skip("no windowed layers: the kernel path is the default model's tests' job")
    if SampleKernel.load(default_model_dir) is None or not is_registered("decode_attention"):
        pytest.skip("no compiled kernels for this machine in the default model directory")
    backend = case[2].attn_backend
    backend.decode_kernel = True  # type: ignore[attr-defined]
    yield
    backend.decode_kernel = False  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_greedy_matches_hf(
    name: str, case: Case, prompt_ids: dict[str, list[int]], hf_expected: dict
) -> None:
    _, _, model, config = case
    expected, gaps = hf_expected[name]
    assert_same_greedy(
        name, expected, gaps, our_greedy(model, config, prompt_ids[name], NEW_TOKENS)
    )


def test_greedy_matches_hf_with_decode_kernel(
    case: Case, prompt_ids: dict[str, list[int]], hf_expected: dict, decode_kernel: None
) -> None:
    """The compiled decode kernel reads a windowed layer's last keys only, like HF."""
    _, _, model, config = case
    expected, gaps = hf_expected["long"]
    assert_same_greedy(
        "long", expected, gaps, our_greedy(model, config, prompt_ids["long"], NEW_TOKENS)
    )


def test_prompt_logprobs_match_hf(case: Case, prompt_ids: dict[str, list[int]]) -> None:
    _, hf_model, model, config = case
    prompt = prompt_ids["long"]
    pool = new_pool(config, len(prompt))
    batch = ForwardBatch.build([prompt], [0], [pool.allocate(len(prompt))])
    ours = torch.log_softmax(model(batch, pool, all_logits=True), dim=-1)
    with torch.no_grad():
        theirs = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0], dim=-1)
    targets = torch.tensor(prompt[1:])[:, None]
    got, want = ours[:-1].gather(1, targets), theirs[:-1].gather(1, targets)
    print(f"max |prompt logprob - HF| = {(got - want).abs().max():.2e}")
    torch.testing.assert_close(got, want, atol=LOGPROB_ATOL, rtol=0.0)


def test_mixed_batch_matches_requests_alone(case: Case, prompt_ids: dict[str, list[int]]) -> None:
    """One step holding a full prefill, a second prefill chunk and two decodes (windowed
    layers past their window, LongRoPE past its original context in some)."""
    _, _, model, config = case
    long, medium = prompt_ids["long"], prompt_ids["medium"]
    reqs = [
        [medium[:11]],  # full prefill, nothing cached
        [long[:20], long[20:45]],  # chunked prefill: second chunk of 25
        [medium[:9], [4242]],  # decode after a 9-token prompt
        [long[:40], [77], [1234], [99]],  # decode after prompt + three decodes
    ]
    assert_mixed_batch_matches_alone(model, config, reqs)


def test_scheduler_batch_matches_hf(
    case: Case, prompt_ids: dict[str, list[int]], hf_expected: dict
) -> None:
    """Through the scheduler (continuous batching, chunked prefill at a 16-token budget),
    all prompts sent together: each gets HF's greedy tokens, i.e. what it gets alone
    (``test_greedy_matches_hf``)."""
    out, _, _, config = case
    scheduler = make_scheduler(
        out, max_num_batched_tokens=16, enable_prefix_cache=is_prefix_cache_exact(config)
    )
    reqs = [
        make_req(n, ids, temperature=0.0, max_new_tokens=NEW_TOKENS)
        for n, ids in prompt_ids.items()
    ]
    together = run_to_completion(scheduler, {0: reqs})
    for name in prompt_ids:
        assert_same_greedy(name, *hf_expected[name], together[name])


def test_a_sequence_crossing_longrope_original_context_matches_hf(
    case: Case, prompt_ids: dict[str, list[int]]
) -> None:
    """A prompt below Phi-3's original context that generates past it: HF's ``generate``
    recomputes the whole cache with the long factors at the crossing, and so does the
    scheduler (``Scheduler._recompute_long``), alone and batched beside a long prompt and
    a short one, with chunked prefill. The random model repeats its tokens, so each step's
    top-5 logprobs are compared too (keeping the short-factor keys moves them by up to 20)."""
    out, hf_model, _, config = case
    if not config.rope_scaling.has_long_factors:
        pytest.skip("only LongRoPE checkpoints switch factors mid-sequence")
    prompt = prompt_ids["medium"]
    new_tokens = LONGROPE_ORIGINAL - len(prompt) + 6
    assert len(prompt) <= LONGROPE_ORIGINAL < len(prompt) + new_tokens - 1  # crosses
    expected, gaps = hf_greedy(hf_model, prompt, new_tokens)
    hf_logprobs = hf_step_logprobs(hf_model, prompt, new_tokens)
    for beside in ((), ("short", "long")):
        crossing = make_req("crossing", prompt, temperature=0.0, max_new_tokens=new_tokens)
        crossing.return_logprob, crossing.top_logprobs_num = True, 5
        reqs = [crossing] + [
            make_req(n, prompt_ids[n], temperature=0.0, max_new_tokens=NEW_TOKENS) for n in beside
        ]
        scheduler = make_scheduler(out, max_num_batched_tokens=16, enable_prefix_cache=False)
        rows: list[OutputRow] = []
        got = run_to_completion(scheduler, {0: reqs}, after_step=rows.extend)
        assert min(gaps) > 0.1  # no HF near-tie on the way: the tokens must be equal
        assert got["crossing"] == expected, beside
        steps = [entry for row in rows if row.rid == "crossing" for entry in row.logprobs]
        assert len(steps) == new_tokens
        for step, (_, _, top) in enumerate(steps):
            for token, logprob in top:
                want = float(hf_logprobs[step][token])
                assert abs(logprob - want) < LOGPROB_ATOL, (beside, step, token, logprob, want)
