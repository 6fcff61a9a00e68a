"""Builds the engine from the scheduler's flags: the machine's compiled kernels, the model
in the dtype the hardware computes natively (its attention backend given the decode
kernel), the KV pool and the ``Scheduler`` (its sampler given the sampling kernel). Runs
wherever the engine runs: in the engine process (``engine_process.py``), or in-process
for tests and benchmarks."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from services.common.auth.cluster_token import ClusterToken
from services.common.tls import TlsSettings
from services.common.tokenizer import load_tokenizer
from services.scheduler.core.messages import Runner
from services.scheduler.core.scheduler import Scheduler, SchedulerConfig
from services.scheduler.core.stop_checker import StopChecker
from services.scheduler.mem_cache.kv_pool import KVPool
from services.scheduler.model_executor.attention import AttentionBackend
from services.scheduler.model_executor.models.config import ModelConfig
from services.scheduler.model_executor.models.dtype import choose_dtype
from services.scheduler.model_executor.models.loader import load_model
from services.scheduler.model_executor.models.model_impl import resolve_model_impl
from services.scheduler.model_executor.row_kernels import use_row_kernels
from services.scheduler.ops.cpu_kernels import (
    SampleKernel,
    first_library,
    is_registered,
    kernel_folders,
)
from services.scheduler.ops.cpu_kernels import build as build_kernels
from services.scheduler.ops.isa_levels import machine_level
from services.scheduler.transport.heap import keep_heap

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SchedulerProcessConfig:
    model: str
    host: str
    port: int
    metrics_port: int
    detokenizer_addr: str
    dtype: str
    device: str
    engine: str  # "process" | "thread"
    attention_backend: str
    model_impl: str  # auto | native | transformers (model/model_impl.py)
    batch_invariant: bool
    quantization: str  # none | int8 | w8a8 (model/quantization.py)
    decode_copy: bool | None  # bf16 weights also in the decode kernel's layout; None: auto
    kv_cache_tokens: int
    kv_cache_memory_mb: int
    max_running_requests: int
    max_waiting_requests: int
    max_num_batched_tokens: int
    context_length: int
    disable_prefix_cache: bool
    num_threads: int
    heap_tuning: bool
    stream_interval: int
    overlap_schedule: bool
    runner: Runner
    build_kernels: bool
    kernels_dir: str  # prebuilt kernels (the image's), read after MODEL/kernels
    drain_timeout: float
    log_level: str
    log_json: bool
    cluster_token: ClusterToken
    tls: TlsSettings


def build_scheduler(config: SchedulerProcessConfig) -> tuple[Scheduler, str]:
    """Load this machine's kernels and the model, and size the KV pool; returns the
    scheduler (its context length, capped to the pool, is ``scheduler.limits.context_length``)
    and the name of the dtype the model runs in."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = torch.device(config.device)
    if config.heap_tuning and device.type == "cpu":
        keep_heap()
    if config.build_kernels and device.type == "cpu":
        build_kernels_if_missing(config.model, config.kernels_dir)
    kernels = load_kernels(config.model, device, config.kernels_dir)
    impl = resolve_model_impl(config.model, config.model_impl)
    choice = choose_dtype(config.dtype, impl.dtype, device)
    model, model_config = load_model(
        config.model,
        choice.dtype,
        device,
        config.attention_backend,
        model_impl=impl.path,
        batch_invariant=config.batch_invariant,
        decode_kernel=kernels.decode_attention,
        quantization=config.quantization,
        decode_copy=config.decode_copy,
    )
    logger.info("model %s in %s on %s (%s)", config.model, choice.name, device, choice.reason)
    if kernels.row_kernels:
        use_row_kernels(model)  # a native model's norms, RoPE and MLPs; transformers' keep theirs
    if device.type == "cpu":
        log_kernels(kernels, model.attn_backend, config.model)
    kv_pool = create_kv_pool(config, model_config, choice.dtype, device)
    context = config.context_length or model_config.max_context_len
    if kv_pool.num_tokens < context:
        # One request's KV must fit the pool, so the pool bounds the context; GetInfo
        # reports this figure and the frontends validate against it.
        logger.info("context length %d capped to the KV pool's %d", context, kv_pool.num_tokens)
        context = kv_pool.num_tokens
    stop_checker = StopChecker(
        load_tokenizer(config.model), set(model_config.eos_token_ids), context
    )
    scheduler = Scheduler.create(
        model,
        kv_pool,
        stop_checker,
        SchedulerConfig(
            max_running_requests=config.max_running_requests,
            max_waiting_requests=config.max_waiting_requests,
            max_num_batched_tokens=config.max_num_batched_tokens,
            context_length=context,
            enable_prefix_cache=not config.disable_prefix_cache
            and is_prefix_cache_exact(model_config),
            stream_interval=config.stream_interval,
            overlap_schedule=config.overlap_schedule,
            runner=config.runner,
        ),
        device,
        sample_kernel=kernels.sample,
    )
    if config.overlap_schedule:
        logger.info("overlap scheduling on: decode steps overlap on a forward worker thread")
    if config.runner == "pooling":
        logger.info("runner pooling: only pooling (embedding) requests are served")
    return scheduler, choice.name


def is_prefix_cache_exact(model_config: ModelConfig) -> bool:
    """Whether a cached prefix's K/V is what this request would compute itself. LongRoPE's
    factors depend on the prompt's length, so a prefix cached by a shorter (or longer)
    prompt can hold keys rotated by the other factor set: its cache stays off."""
    if model_config.rope_scaling.has_long_factors:
        logger.info("prefix cache off: LongRoPE keys depend on each prompt's length")
        return False
    return True


def build_kernels_if_missing(model_dir: str, kernels_dir: str = "") -> None:
    """Compile this machine's kernels into ``model_dir/kernels`` unless a library for its
    level is there or in ``kernels_dir`` (``--build-kernels``, for a volume that may move
    between machines). A failure leaves the engine on its eager paths."""
    level = machine_level()
    folders = kernel_folders(model_dir, kernels_dir)
    try:
        if first_library(folders, level) is not None:
            return
        build_kernels(folders[0], [level])
    except (OSError, RuntimeError) as exc:
        logger.warning("kernels not built (%s: %s); eager paths", type(exc).__name__, exc)


@dataclass(frozen=True, slots=True)
class Kernels:
    """This machine's compiled kernels, handed to the sampler and the attention backend
    when they are built."""

    sample: SampleKernel | None = None
    decode_attention: bool = False  # ``torch.ops.tokenline.decode_attention`` is loaded
    row_kernels: bool = False  # ``rms_norm``, ``rotary``, ``silu_and_mul`` (csrc/fused_rows.cpp)


def load_kernels(model_dir: str, device: torch.device, kernels_dir: str = "") -> Kernels:
    """Load the compiled kernels of this machine's ISA level, if any (``model_dir/kernels``
    first, then ``kernels_dir``); none off CPU."""
    if device.type != "cpu":
        return Kernels()
    kernel = SampleKernel.load(model_dir, kernels_dir or None)
    if kernel is None:
        return Kernels()
    return Kernels(kernel, is_registered("decode_attention"), is_registered("rms_norm"))


def log_kernels(kernels: Kernels, backend: AttentionBackend, model_dir: str) -> None:
    """Say which of the sampler, decode and prompt attention and the row-wise ops (RMSNorm,
    RoPE, SiLU-and-multiply: native models only) run compiled kernels."""
    if kernels.sample is None:
        logger.info(
            "sampler and decode attention: eager (no compiled kernels for this machine; "
            "python -m services.scheduler.ops.cpu_kernels --model %s builds them)",
            model_dir,
        )
    elif getattr(backend, "decode_kernel", False):
        rows = ", RMSNorm, RoPE and SiLU-and-multiply" if kernels.row_kernels else ""
        prompt = ", bf16 prompt attention" if getattr(backend, "prompt_kernel", False) else ""
        logger.info("sampler, decode attention%s%s: compiled kernels", prompt, rows)
    else:
        logger.info("sampler: compiled plain-row kernel")


def create_kv_pool(
    config: SchedulerProcessConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
) -> KVPool:
    """The KV pool, sized by --kv-cache-tokens or else --kv-cache-memory-mb."""
    shape = (model_config.num_layers, model_config.num_kv_heads, model_config.head_dim, dtype)
    per_token = KVPool.bytes_per_token(*shape)
    num_tokens = config.kv_cache_tokens or KVPool.tokens_for_budget(
        config.kv_cache_memory_mb * 2**20, *shape
    )
    if num_tokens < 1:
        raise SystemExit(
            f"KV pool of {num_tokens} tokens: raise --kv-cache-tokens or --kv-cache-memory-mb "
            f"(one token takes {per_token} bytes)"
        )
    logger.info("KV pool %d tokens (%.1f MiB)", num_tokens, num_tokens * per_token / 2**20)
    return KVPool(num_tokens, *shape, device)
