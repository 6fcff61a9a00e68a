"""An ahead-of-time compiled CPU kernel for the sampler's dense rows.

A row sampled from the whole softmax (the OpenAI default: temperature only) needs every
entry's ``exp``; in eager torch that is a float32 copy of the bf16 logits, an in-place
softmax and the 128-entry block sums the two-stage inverse CDF searches (1.85 ms at
[32, 129,280], 4.4 at 64 rows on the 2-core AMD EPYC here). This kernel reads the logits in
the model's dtype once for the row maximum of ``x / T`` and once for the block sums of
``exp(x / T - max)`` (1.2 and 2.4 ms), with no float32 copy.

AOTInductor compiles it once per machine (``python -m services.scheduler.block_mass_kernel
--model DIR``; ``make model`` runs it) into ``DIR/kernels/``, keyed by everything the
machine code depends on: dtype, vocabulary, torch version, CPU flags and this module's
kernel source. The engine loads the shared library with torch's AOTI runner in about a
millisecond, and keeps the eager path wherever no kernel matches (no C++ compiler, the
container image, a GPU). ``torch.compile`` at start-up was measured at 4.3 s a process.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import logging
import os
import sys
import tempfile
import warnings
import zipfile
from pathlib import Path

import torch

from services.scheduler.row_argmax import BLOCK  # the sampler's search uses the same

logger = logging.getLogger(__name__)

KERNEL_DIR = "kernels"
_MAX_ROWS = 4096


class _BlockMass(torch.nn.Module):
    """Row max of ``x / T`` [n, 1] and block sums of ``exp(x / T - max)`` [n, V / BLOCK]."""

    def forward(
        self, logits: torch.Tensor, inv_temperature: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scaled = logits.float() * inv_temperature
        top = scaled.amax(dim=-1, keepdim=True)
        mass = torch.exp(scaled - top).view(scaled.shape[0], -1, BLOCK).sum(dim=-1)
        return top, mass


class BlockMassKernel:
    """The compiled ``_BlockMass`` for one dtype and vocabulary size."""

    def __init__(self, runner: object, dtype: torch.dtype, vocab: int) -> None:
        self._runner = runner
        self.dtype = dtype
        self.vocab = vocab

    def fits(self, logits: torch.Tensor) -> bool:
        return (
            logits.device.type == "cpu"
            and logits.dtype == self.dtype
            and logits.shape[-1] == self.vocab
            and 0 < logits.shape[0] <= _MAX_ROWS
        )

    def __call__(
        self, logits: torch.Tensor, inv_temperature: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``logits`` [n, V] in the kernel's dtype, ``inv_temperature`` [n, 1] float32.
        Both are made contiguous: the compiled code assumes it and reads strided input wrong."""
        top, mass = self._runner.run(  # type: ignore[attr-defined]
            [logits.contiguous(), inv_temperature.float().contiguous()]
        )
        return top, mass

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype, vocab: int) -> BlockMassKernel | None:
        """The kernel built for this machine, or None when there is none (or it won't load)."""
        path = kernel_path(model_dir, dtype, vocab)
        if not path.is_file():
            return None
        try:
            runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(path), 1)
        except (AttributeError, RuntimeError) as exc:
            logger.warning("sampler kernel %s did not load (%s); eager sampling", path, exc)
            return None
        return cls(runner, dtype, vocab)


def kernel_path(model_dir: str | Path, dtype: torch.dtype, vocab: int) -> Path:
    return Path(model_dir) / KERNEL_DIR / f"{kernel_key(dtype, vocab)}.so"


def kernel_key(dtype: torch.dtype, vocab: int) -> str:
    """What the compiled machine code depends on; anything else gets another file."""
    dtype_name = str(dtype).removeprefix("torch.")
    parts = [dtype_name, str(vocab), torch.__version__, _cpu_flags(), inspect.getsource(_BlockMass)]
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return f"block_mass-{dtype_name}-v{vocab}-{digest}"


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), which decide the instructions inductor emits."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.partition(":")[2].split()))
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability()


def build(model_dir: str | Path, dtype: torch.dtype, vocab: int) -> Path:
    """Compile the kernel for this machine into ``model_dir/kernels`` (kept if present)."""
    path = kernel_path(model_dir, dtype, vocab)
    if path.is_file():
        return path
    if vocab % BLOCK:
        raise ValueError(f"vocabulary {vocab} is not a multiple of {BLOCK}")
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = torch.export.Dim("rows", min=1, max=_MAX_ROWS)
    example = (torch.zeros(8, vocab, dtype=dtype), torch.ones(8, 1))
    program = torch.export.export(
        _BlockMass(), example, dynamic_shapes=({0: rows}, {0: rows}), strict=False
    )
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        package = Path(scratch) / "block_mass.pt2"
        torch._inductor.aoti_compile_and_package(program, package_path=str(package))
        with zipfile.ZipFile(package) as archive:
            (library,) = [n for n in archive.namelist() if n.endswith(".wrapper.so")]
            staged = Path(scratch) / "kernel.so"
            staged.write_bytes(archive.read(library))
        os.replace(staged, path)  # atomic: a concurrent loader sees all of it or nothing
    return path


def main(argv: list[str] | None = None) -> int:
    from services.scheduler.model.config import ModelConfig
    from services.scheduler.model.dtype import AUTO, DTYPES, choose_dtype

    parser = argparse.ArgumentParser(prog="python -m services.scheduler.block_mass_kernel")
    parser.add_argument("--model", required=True, help="model directory (kernels/ goes in it)")
    parser.add_argument("--dtype", choices=[AUTO, *DTYPES], default=AUTO)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = ModelConfig.from_dir(args.model)
    choice = choose_dtype(args.dtype, config.dtype, torch.device("cpu"))
    try:
        with warnings.catch_warnings():  # export's deprecation chatter is not ours to fix
            warnings.simplefilter("ignore", category=FutureWarning)
            warnings.simplefilter("ignore", category=DeprecationWarning)
            path = build(args.model, choice.dtype, config.vocab_size)
    except Exception as exc:  # no compiler, no headers, an unsupported torch: eager it is
        logger.warning(
            "sampler kernel not built (%s: %s); the engine samples eagerly", type(exc).__name__, exc
        )
        return 1
    logger.info("sampler kernel %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
