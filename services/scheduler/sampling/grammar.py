"""Grammar-constrained decoding on the engine: compile cache, a matcher per request, batch masks.

Three owners, one job each:

* ``GrammarCompiler`` compiles each distinct ``GrammarSpec`` once against the model's
  vocabulary, on a worker thread of its own, so the engine thread never waits for a
  compile. The n choices of a request, and every later request with the same schema,
  share one compiled grammar.
* ``RequestGrammar`` lives on a request (``HasGrammar``): its compile future until that
  is done, then its ``GrammarMatcher``, advanced by exactly the tokens the request keeps. A
  retracted request keeps its output tokens, so its matcher stays where it is and resumes
  with it.
* ``GrammarMasker`` (the logits processor's) fills the allowed-token bitmask of every row
  with a grammar, beside the forward pass, and turns it into -inf on the logits before
  sampling, greedy rows included.

A grammar may end on the request's stop tokens and the model's EOS (even with ignore_eos:
a grammar has to end somewhere), and on nothing else; once its matcher has accepted one,
the request finishes with ``stop``.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import torch

from services.common.grammar import GrammarError, build_grammar
from services.common.sampling_params import GrammarSpec
from services.common.tokenizer import TailDecoder

if TYPE_CHECKING:
    import xgrammar
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Per byte of a bitmask, the additive mask of its 8 tokens: 0 where the bit is set, else -inf.
# A table lookup plus one add over the rows was 10x cheaper on CPU than xgrammar's own
# kernel or a masked_fill (both ~8-12 ms at 32 x 129,280; this ~1 ms).
_BYTE_MASKS = torch.where(
    ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool(), 0.0, float("-inf")
)


class GrammarCompiler:
    """Compiles grammars for one model's vocabulary; the results are cached by spec.

    ``get`` may be called from any thread and never compiles on the caller's: it returns
    a future, already done on a cache hit. The xgrammar ``TokenizerInfo`` (0.4-0.6 s for
    a 129k vocabulary) is built on the worker too, with the first compile, so a scheduler
    that never sees a grammar never pays for it, and once per tokenizer in the process
    (``tokenizer_info``).
    """

    def __init__(
        self,
        tokenizer: TailDecoder,  # a Hugging Face tokenizer: xgrammar reads its vocabulary
        vocab_size: int,
        eos_token_ids: Iterable[int],
        *,
        max_entries: int = 256,
    ) -> None:
        self.vocab_size = vocab_size  # the LM head's width, which may exceed the tokenizer's
        self.eos_token_ids = sorted(eos_token_ids)
        self.max_entries = max_entries
        self._tokenizer = tokenizer
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._cache: OrderedDict[GrammarSpec, Future[xgrammar.CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def get(self, spec: GrammarSpec) -> Future[xgrammar.CompiledGrammar]:
        """The compiled grammar of ``spec``; a failed compile holds a GrammarError."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
            future = self._pool.submit(self._compile, spec)
            self._cache[spec] = future
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
            return future

    def compile_now(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        """``get`` and wait: for tests and benchmarks."""
        return self.get(spec).result()

    def _compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        compiler = self._compiler or self._create_compiler()
        return compiler.compile_grammar(build_grammar(spec))

    def _create_compiler(self) -> xgrammar.GrammarCompiler:
        import xgrammar

        # The scheduler's stop-string tokenizer, which is a Hugging Face one.
        hf_tokenizer = cast("PreTrainedTokenizerBase", self._tokenizer)
        info = tokenizer_info(hf_tokenizer, self.vocab_size, tuple(self.eos_token_ids))
        # One worker thread calls this, so the compiler is built once.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        return self._compiler


@functools.lru_cache(maxsize=4)
def tokenizer_info(
    tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: tuple[int, ...]
) -> xgrammar.TokenizerInfo:
    """xgrammar's read-only view of a vocabulary, shared by every compiler in the process
    over the same tokenizer object: reading 129k tokens takes ~0.6 s, which tests and
    benchmarks building many schedulers over one tokenizer paid once per scheduler."""
    import xgrammar

    return xgrammar.TokenizerInfo.from_huggingface(
        tokenizer,
        vocab_size=vocab_size,
        stop_token_ids=list(stop_token_ids),
    )


@dataclass(slots=True, eq=False)
class RequestGrammar:
    """One request's grammar state. Engine thread only (after ``GrammarCompiler.get``)."""

    spec: GrammarSpec
    future: Future[xgrammar.CompiledGrammar]
    stop_token_ids: list[int]
    matcher: xgrammar.GrammarMatcher | None = None
    error: str | None = None  # the compile failed, or the matcher refused a sampled token
    num_accepted: int = 0
    is_terminated: bool = False  # its matcher accepted a stop token: the grammar is complete

    def poll(self) -> bool:
        """True once the request may decode; creates the matcher when its compile is done,
        or records why it failed (``error``)."""
        if self.matcher is not None:
            return True
        if self.error is not None or not self.future.done():
            return False
        try:
            compiled = self.future.result()
        except Exception as exc:  # any failed compile ends this request, never the engine
            reason = exc if isinstance(exc, GrammarError) else type(exc).__name__
            self.error = f"invalid {self.spec.kind}: {reason}"
            return False
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids)
        return True

    def accept(self, token_id: int) -> None:
        """Advance by the token the request kept. A token the grammar does not allow can
        only come from a bug; it is recorded, and the request ends (``error``)."""
        if self.matcher is None or self.is_terminated or self.error is not None:
            return
        if not self.matcher.accept_token(token_id):
            self.error = f"the grammar refused token {token_id}"
            logger.error("grammar matcher refused token %d", token_id)
            return
        self.num_accepted += 1
        self.is_terminated = self.matcher.is_terminated()


def create_request_grammar(
    compiler: GrammarCompiler, spec: GrammarSpec, stop_token_ids: Sequence[int]
) -> RequestGrammar:
    """Start (or reuse) the compile of ``spec``; the grammar may end on ``stop_token_ids``
    and the model's EOS."""
    stops = sorted({*stop_token_ids, *compiler.eos_token_ids})
    return RequestGrammar(spec, compiler.get(spec), stops)


@dataclass(frozen=True, slots=True)
class NextTokenMask:
    """What a step's constrained rows may sample: the bitmask [n, ceil(V / 32)] and, for CPU
    logits, the same as an additive mask [n, V] (0 or -inf)."""

    bitmask: torch.Tensor
    additive: torch.Tensor | None


class HasGrammar(Protocol):
    """What the masker reads of a request (the scheduler's ``Req`` is one): its grammar."""

    @property
    def grammar(self) -> RequestGrammar | None: ...


class GrammarMasker:
    """Sets to -inf every token a row's grammar does not allow next. Engine thread only.

    ``prefetch`` builds the mask on a worker thread before the forward pass: it needs only
    the matchers, not the logits, and both xgrammar's fill and torch release the GIL, so on
    a GPU it is hidden behind the forward and on a CPU it runs beside it. ``__call__`` then
    waits for it and adds it to the logits, or builds it now when nothing was prefetched for
    exactly these rows. Buffers are kept between steps and grow with the number of
    constrained rows: a fresh 16 MB buffer per step costs its page faults again.
    """

    def __init__(self, max_threads: int | None = None) -> None:
        self.max_threads = max_threads
        self._batch: xgrammar.BatchGrammarMatcher | None = None
        self._bitmask = torch.empty(0, 0, dtype=torch.int32)
        self._additive = torch.empty(0)
        self._pool: ThreadPoolExecutor | None = None
        self._pending: tuple[list[HasGrammar], Future[NextTokenMask]] | None = None

    def prefetch(self, reqs: Sequence[HasGrammar], vocab_size: int, device: torch.device) -> None:
        """Start building the mask of ``reqs``, the rows the next ``__call__`` will get.
        Until then nothing may advance their matchers (the engine samples after the forward)."""
        self._wait_pending()
        matchers = _matchers(reqs)
        if not matchers:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        future = self._pool.submit(self.build, matchers, vocab_size, device.type == "cpu")
        self._pending = (list(reqs), future)

    def __call__(self, logits: torch.Tensor, reqs: Sequence[HasGrammar]) -> None:
        pending = self._pending
        if pending is None and not any(r.grammar is not None for r in reqs):
            return  # the common case costs one scan of the batch
        mask = self._wait_pending()
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None and r.grammar.matcher]
        if not rows:
            return
        if mask is None or not _same_rows(pending[0], reqs):  # type: ignore[index]
            mask = self.build(_matchers(reqs), logits.shape[-1], logits.device.type == "cpu")
        self.apply(logits, mask, rows)

    def build(
        self, matchers: list[xgrammar.GrammarMatcher], vocab_size: int, additive: bool
    ) -> NextTokenMask:
        bitmask = self.fill(matchers, vocab_size)
        return NextTokenMask(bitmask, self.expand(bitmask, vocab_size) if additive else None)

    def fill(self, matchers: list[xgrammar.GrammarMatcher], vocab_size: int) -> torch.Tensor:
        """The next-token bitmask [len(matchers), ceil(V / 32)] int32, one row per matcher."""
        import xgrammar

        words = (vocab_size + 31) // 32
        if self._bitmask.shape[0] < len(matchers) or self._bitmask.shape[1] != words:
            self._bitmask = xgrammar.allocate_token_bitmask(len(matchers), vocab_size)
        if self._batch is None:
            self._batch = xgrammar.BatchGrammarMatcher(self.max_threads or "auto")
        bitmask = self._bitmask[: len(matchers)]
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask)
        return bitmask

    def expand(self, bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """The bitmask as an additive mask [n, vocab_size]: 0 where a bit is set, else -inf."""
        num_rows, num_tokens = bitmask.shape[0], bitmask.shape[1] * 32
        if self._additive.numel() < num_rows * num_tokens:
            self._additive = torch.empty(num_rows * num_tokens, dtype=torch.float32)
        out = self._additive[: num_rows * num_tokens].view(-1, 8)
        byte_ids = bitmask.contiguous().view(torch.uint8).view(-1).to(torch.int32)
        torch.index_select(_BYTE_MASKS, 0, byte_ids, out=out)
        return out.view(num_rows, num_tokens)[:, :vocab_size]

    def apply(self, logits: torch.Tensor, mask: NextTokenMask, rows: list[int]) -> None:
        """-inf where a row's grammar forbids the token; mask row j is logits row rows[j]."""
        if mask.additive is None:  # CUDA: xgrammar's kernel
            import xgrammar

            full = torch.ones(
                logits.shape[0], mask.bitmask.shape[1], dtype=torch.int32, device=logits.device
            ).neg_()  # all bits set: rows without a grammar stay as they are
            full[torch.tensor(rows, device=logits.device)] = mask.bitmask.to(logits.device)
            xgrammar.apply_token_bitmask_inplace(logits, full, indices=rows)
        elif len(rows) == logits.shape[0]:
            logits.add_(mask.additive.to(logits.dtype))
        else:
            index = torch.tensor(rows, dtype=torch.int64)
            logits.index_add_(0, index, mask.additive.to(logits.dtype))

    def _wait_pending(self) -> NextTokenMask | None:
        """The prefetched mask, once built (a build never outlives its step)."""
        if self._pending is None:
            return None
        _, future = self._pending
        self._pending = None
        return future.result()


def _matchers(reqs: Sequence[HasGrammar]) -> list[xgrammar.GrammarMatcher]:
    return [r.grammar.matcher for r in reqs if r.grammar is not None and r.grammar.matcher]


def _same_rows(a: Sequence[HasGrammar], b: Sequence[HasGrammar]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))
