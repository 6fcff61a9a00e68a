"""The engine's C++ kernels, built per machine: the sampler's for plain rows (greedy or
temperature only) and decode attention (``csrc/decode_attention.cpp``, used by
``model_executor/attention/torch_backend.py``), compiled into one library.

A row sampled from the whole softmax (the OpenAI default: temperature only) would need every
vocabulary entry's ``exp`` to find its inverse CDF. ``csrc/sample_rows.cpp`` draws each row
in one call, straight from the logits in the model's dtype:

* unseeded rows by proposals: one vertical max gives the maxima of 8,080 strided groups of
  16 entries; a group proposed by its bound and a member accepted with probability
  ``exp((x - group max) / T)`` is an exact draw, with no exp per entry (at least 1 proposal
  in 16 is accepted; after ``MAX_PROPOSALS`` the row takes the inverse CDF);
* seeded rows by inverse CDF at their own generator's uniform, as the float32 path draws
  them, so a seeded request's tokens do not depend on its batch: the row max, 128-entry
  block masses with torch's ``exp_u20`` (the exp torch.softmax uses on CPU), then the block
  and the entry;
* greedy rows (inverse temperature 0) by their argmax.

At [32, 129,280] bf16 on the 2-core AMD EPYC here: 0.3 ms by proposals, 1.0 by inverse CDF,
0.4 greedy, against 1.6-1.8 for the AOTInductor block sums and torch search it replaced.

``python -m services.scheduler.ops.cpu_kernels --model DIR`` (``make kernels``) compiles them
with the machine's C++ compiler against torch's headers into ``DIR/kernels/``, keyed by
everything the machine code depends on: torch version, CPU flags, compiler flags and the
sources. The engine loads the library with ``torch.ops.load_library`` in about a
millisecond and keeps the eager paths wherever none matches (no compiler, the container
image, which drops torch's headers, a GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

KERNEL_DIR = "kernels"
_CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (_CSRC / "sample_rows.cpp", _CSRC / "decode_attention.cpp")
HEADERS = (_CSRC / "float_vec.h",)  # included by the sources: part of the key too
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_PROPOSALS = 256
"""Proposals a row may reject before its inverse CDF decides. At least 1 in 16 is accepted
whatever the row, so at most (15/16)^256 < 1e-7 of rows get there; a proposal costs about
0.1 us, the inverse CDF of a 129,280-entry row about 60."""


class SampleKernel:
    """``torch.ops.tokenline.sample_rows``, once a built library has registered it."""

    def fits(self, logits: torch.Tensor) -> bool:
        return logits.device.type == "cpu" and logits.dtype in _DTYPES and logits.dim() == 2

    def __call__(
        self,
        logits: torch.Tensor,
        inv_temperature: torch.Tensor,
        uniforms: torch.Tensor,
        seed: int,
        max_proposals: int = MAX_PROPOSALS,
    ) -> torch.Tensor:
        """One token id per row of ``logits`` [n, V]: its argmax where ``inv_temperature``
        [n] is 0; else a draw from ``softmax(logits * inv_temperature)``, by inverse CDF at
        the row's uniform where ``uniforms`` [n] holds one in [0, 1), by proposals from
        Philox(``seed``, row) where it is negative. Both tensors float32."""
        return torch.ops.tokenline.sample_rows(
            logits, inv_temperature, uniforms, seed, max_proposals
        )

    @classmethod
    def load(cls, model_dir: str | Path) -> SampleKernel | None:
        """The kernel built for this machine, or None when there is none (or it won't load).
        A process registers the op once: a second load finds it registered."""
        if is_registered("sample_rows"):
            return cls()
        try:
            path = kernel_path(model_dir)
        except OSError as exc:  # an install without the C++ sources cannot key a build
            logger.warning("no kernel sources (%s); eager paths", exc)
            return None
        if not path.is_file():
            return None
        try:
            torch.ops.load_library(str(path))
        except (OSError, RuntimeError) as exc:
            logger.warning("kernels %s did not load (%s); eager paths", path, exc)
            return None
        return cls() if is_registered("sample_rows") else None


def is_registered(op: str) -> bool:
    """Whether ``torch.ops.tokenline.<op>`` has a CPU kernel in this process."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"tokenline::{op}", "CPU")
    except RuntimeError:  # "operator ... does not exist"
        return False


def kernel_path(model_dir: str | Path) -> Path:
    return Path(model_dir) / KERNEL_DIR / f"{kernel_key()}.so"


def kernel_key() -> str:
    """What the compiled machine code depends on; anything else gets another file."""
    parts = [torch.__version__, _cpu_flags(), " ".join(isa_flags())]
    parts += [source.read_text() for source in (*SOURCES, *HEADERS)]
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return f"tokenline_ops-{digest}"


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), which decide the instructions the build emits."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.partition(":")[2].split()))
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability()


def isa_flags() -> list[str]:
    """The vector ISA torch's own CPU code generator picks here (its compiler flags and the
    ``CPU_CAPABILITY`` macro that selects ``at::vec``'s implementation); none: scalar.

    Picking it compiles and runs probe programs (~3 s), so the answer is kept on disk
    (``isa_cache_path``), keyed by everything it depends on."""
    cache = isa_cache_path()
    try:
        return list(json.loads(cache.read_text()))
    except (OSError, ValueError):
        pass
    flags = _probe_isa_flags()
    with contextlib.suppress(OSError):  # a read-only home: probe again next time
        cache.parent.mkdir(parents=True, exist_ok=True)
        scratch = cache.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(json.dumps(flags))
        scratch.replace(cache)  # atomic: a concurrent start reads all or nothing
    return flags


def isa_cache_path() -> Path:
    """Where the ISA probe's answer for this CPU, torch, compiler and capability cap lives:
    ``$TOKENLINE_CACHE_DIR``, else ``$XDG_CACHE_HOME/tokenline`` or ``~/.cache/tokenline``."""
    parts = [torch.__version__, _cpu_flags(), _compiler_version()]
    parts.append(os.environ.get("ATEN_CPU_CAPABILITY", ""))
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokenline"
    root = Path(os.environ.get("TOKENLINE_CACHE_DIR") or default)
    return root / f"vec-isa-{digest}.json"


def _compiler_version() -> str:
    """The first line of the C++ compiler's ``--version``; empty where there is none."""
    compiler = find_compiler()
    if compiler is None:
        return ""
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.partition("\n")[0]


def _probe_isa_flags() -> list[str]:
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        with warnings.catch_warnings():
            # Its probe builds add Python's include dir, absent where no python3-dev is
            # installed (the image); the probe code does not include Python.h.
            warnings.filterwarnings("ignore", message="Can't find Python.h")
            isa = pick_vec_isa()
        if not isa:
            return []
        return [*isa.build_arch_flags().split(), *(f"-D{m}" for m in isa.build_macro())]
    except Exception:  # an inductor without this helper: build for the baseline ISA
        return []


def find_compiler() -> str | None:
    """The C++ compiler a build uses: ``$CXX``, else ``c++`` or ``g++`` on the path."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def compile_commands(
    sources: tuple[Path, ...], scratch: Path, output: Path
) -> tuple[list[list[str]], list[str]]:
    """One compile per source (``scratch/<name>.o``; they run at once, a core each) and
    the link of their objects into ``output``."""
    from torch.utils.cpp_extension import include_paths, library_paths

    compiler = find_compiler()
    if compiler is None:
        raise FileNotFoundError("no C++ compiler (c++ / g++, or $CXX)")
    flags = [
        "-O3",
        "-std=c++20",
        "-fPIC",
        "-fopenmp",  # at::parallel_for splits rows over torch's OpenMP threads
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *isa_flags(),
        *(f"-I{path}" for path in include_paths()),
    ]
    objects = [scratch / f"{source.stem}.o" for source in sources]
    compiles = [
        [compiler, *flags, "-c", str(source), "-o", str(obj)]
        for source, obj in zip(sources, objects, strict=True)
    ]
    libs = library_paths()
    link = [
        compiler,
        "-shared",
        "-fopenmp",
        *(str(obj) for obj in objects),
        "-o",
        str(output),
        *(f"-L{path}" for path in libs),
        *(f"-Wl,-rpath,{path}" for path in libs),
        "-lc10",
        "-ltorch_cpu",
        "-ltorch",
    ]
    return compiles, link


def build(model_dir: str | Path) -> Path:
    """Compile the kernels for this machine into ``model_dir/kernels`` (kept if present)."""
    path = kernel_path(model_dir)
    if path.is_file():
        return path
    isa = " ".join(isa_flags()) or "the baseline ISA, no vector flags"
    logger.info("compiling the CPU kernels for this machine (%s) into %s", isa, path.parent)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        staged = Path(scratch) / "kernel.so"
        compiles, link = compile_commands(SOURCES, Path(scratch), staged)
        running = [
            subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for cmd in compiles
        ]
        finished = [(proc, proc.communicate()[1]) for proc in running]
        errors = [err for proc, err in finished if proc.returncode != 0]
        if not errors:
            done = subprocess.run(link, capture_output=True, text=True, check=False)
            errors = [done.stderr] if done.returncode != 0 else []
        if errors:
            names = ", ".join(source.name for source in SOURCES)
            raise RuntimeError(f"compiling {names} failed:\n{''.join(errors)[-4000:]}")
        os.replace(staged, path)  # atomic: a concurrent loader sees all of it or nothing
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.scheduler.ops.cpu_kernels")
    parser.add_argument("--model", required=True, help="model directory (kernels/ goes in it)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = build(args.model)
    except (OSError, RuntimeError) as exc:  # no compiler, no headers: eager it is
        logger.warning(
            "kernels not built (%s: %s); the engine keeps its eager paths", type(exc).__name__, exc
        )
        return 1
    logger.info("kernels %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
