"""The engine's C++ kernels, built per machine: the sampler's for plain rows (greedy or
temperature only), decode attention (``csrc/decode_attention.cpp``, used by
``model_executor/attention/torch_backend.py``) and a layer's row-wise element work, RMSNorm
and SiLU-and-multiply (``csrc/fused_rows.cpp``, used by ``model_executor/models/
layers.py``), the int8 weight-only matmul of few rows (``csrc/int8_rows.cpp``, used by
``model_executor/models/int8/int8_weight.py``), the w8a8 int8 x int8 matmul (``csrc/w8a8.cpp``,
used by ``model_executor/models/int8/w8a8_weight.py``), the bf16 decode copy's matmul
(``csrc/bf16_blocks.cpp``, used by ``model_executor/models/linear.py`` and ``moe.py``) and
bf16 prompt attention where there is no AMX (``csrc/prompt_attention.cpp``, used by the
attention backend) and a MoE layer's routing and weighted sum (``csrc/moe_routing.cpp``,
used by ``model_executor/models/moe.py``), compiled into one library.

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

Each vector ISA level (``isa_levels.py``) gets its own library, and a folder of them
carries a ``manifest.json`` naming the library of each level for one torch version and one
set of sources. ``python -m services.scheduler.ops.cpu_kernels --model DIR`` (``make
kernels``) builds this machine's level into ``DIR/kernels/``; ``--out DIR --levels all``
builds every level, as the container image does at build time, so its runtime needs no
compiler. A library's file name is keyed by everything its machine code depends on (torch
version, compiler version, compiler flags, sources); a build removes the libraries its
manifest no longer names. The engine loads its level's library with
``torch.ops.load_library`` in about a millisecond, first from the model's folder, then from
``--kernels-dir``, and keeps the eager paths wherever none matches (no build, a GPU).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch

from services.scheduler.ops.isa_levels import (
    LEVEL_NAMES,
    IsaLevel,
    level_named,
    machine_level,
)

logger = logging.getLogger(__name__)

KERNEL_DIR = "kernels"
MANIFEST = "manifest.json"
_CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (
    _CSRC / "sample_rows.cpp",
    _CSRC / "decode_attention.cpp",
    _CSRC / "fused_rows.cpp",
    _CSRC / "int8_rows.cpp",
    _CSRC / "bf16_blocks.cpp",
    _CSRC / "prompt_attention.cpp",
    _CSRC / "w8a8.cpp",
    _CSRC / "moe_routing.cpp",
)
HEADERS = (
    _CSRC / "float_vec.h",
    _CSRC / "bf16_pairs.h",
    _CSRC / "transpose16.h",
    _CSRC / "row_count.h",
    _CSRC / "parallel_shared.h",
)  # included by the sources: part of the key too
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
    def load(
        cls, model_dir: str | Path, prebuilt_dir: str | Path | None = None
    ) -> SampleKernel | None:
        """The library of this machine's level from ``model_dir/kernels``, else from
        ``prebuilt_dir`` (the image's), loaded; None when neither has one or it won't load.
        A process registers the op once: a second load finds it registered."""
        if is_registered("sample_rows"):
            return cls()
        try:
            level = machine_level()
            path = first_library(kernel_folders(model_dir, prebuilt_dir), level)
        except OSError as exc:  # an install without the C++ sources cannot key a build
            logger.warning("no kernel sources (%s); eager paths", exc)
            return None
        if path is None:
            return None
        try:
            torch.ops.load_library(str(path))
        except (OSError, RuntimeError) as exc:
            logger.warning("kernels %s did not load (%s); eager paths", path, exc)
            return None
        logger.info("CPU kernels for %s from %s", level.name, path)
        return cls() if is_registered("sample_rows") else None


def is_registered(op: str) -> bool:
    """Whether ``torch.ops.tokenline.<op>`` has a CPU kernel in this process."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"tokenline::{op}", "CPU")
    except RuntimeError:  # "operator ... does not exist"
        return False


def kernel_folders(model_dir: str | Path, prebuilt_dir: str | Path | None = None) -> list[Path]:
    """Where a scheduler looks for its kernels, in order: the model's own, then the
    prebuilt folder (the image's)."""
    return [Path(model_dir) / KERNEL_DIR, *([Path(prebuilt_dir)] if prebuilt_dir else [])]


def first_library(folders: list[Path], level: IsaLevel) -> Path | None:
    """``level``'s library from the first of ``folders`` that has one."""
    return next(filter(None, (find_library(folder, level) for folder in folders)), None)


def find_library(folder: Path, level: IsaLevel) -> Path | None:
    """``level``'s library in ``folder`` when its manifest was written for this torch and
    these sources; None otherwise."""
    manifest = _read_manifest(folder)
    if manifest.get("torch") != torch.__version__ or manifest.get("sources") != sources_digest():
        return None
    name = manifest.get("libraries", {}).get(level.name)
    path = folder / name if isinstance(name, str) else None
    return path if path is not None and path.is_file() else None


def sources_digest() -> str:
    """The kernels' sources and headers, hashed (OSError when they are not installed)."""
    texts = [source.read_text() for source in (*SOURCES, *HEADERS)]
    return hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]


def fixed_flags() -> list[str]:
    """The compiler flags every level shares."""
    return [
        "-O3",
        "-std=c++20",
        "-fPIC",
        "-fopenmp",  # at::parallel_for splits rows over torch's OpenMP threads
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
    ]


def library_name(level: IsaLevel, compiler_version: str) -> str:
    """The file name of ``level``'s library, keyed by everything its machine code depends on."""
    parts = [torch.__version__, compiler_version, *fixed_flags(), *level.build_flags]
    digest = hashlib.sha256("\n".join([*parts, sources_digest()]).encode()).hexdigest()[:16]
    return f"tokenline_ops-{level.name}-{digest}.so"


def _read_manifest(folder: Path) -> dict:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


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


def find_compiler() -> str | None:
    """The C++ compiler a build uses: ``$CXX``, else ``c++`` or ``g++`` on the path."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def compile_commands(
    level: IsaLevel, scratch: Path, output: Path
) -> tuple[list[list[str]], list[str]]:
    """One compile per source (``scratch/<name>.o``; they run at once, a core each) and
    the link of their objects into ``output``."""
    from torch.utils.cpp_extension import include_paths, library_paths

    compiler = find_compiler()
    if compiler is None:
        raise FileNotFoundError("no C++ compiler (c++ / g++, or $CXX)")
    flags = [*fixed_flags(), *level.build_flags, *(f"-I{path}" for path in include_paths())]
    objects = [scratch / f"{source.stem}.o" for source in SOURCES]
    compiles = [
        [compiler, *flags, "-c", str(source), "-o", str(obj)]
        for source, obj in zip(SOURCES, objects, strict=True)
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


def build(folder: str | Path, levels: Iterable[IsaLevel] | None = None) -> dict[str, Path]:
    """Compile ``levels`` (default: this machine's) into ``folder``, keeping libraries whose
    key is unchanged; then write the manifest and remove the libraries it does not name."""
    folder = Path(folder)
    wanted = list(levels) if levels is not None else [machine_level()]
    compiler_version = _compiler_version()
    manifest = _read_manifest(folder)
    same_build = (
        manifest.get("torch") == torch.__version__ and manifest.get("sources") == sources_digest()
    )
    libraries: dict[str, str] = dict(manifest.get("libraries", {})) if same_build else {}
    folder.mkdir(parents=True, exist_ok=True)
    for level in wanted:
        name = library_name(level, compiler_version)
        if not (folder / name).is_file():
            _compile(level, folder / name)
        libraries[level.name] = name
    libraries = {k: v for k, v in libraries.items() if (folder / v).is_file()}
    _write_manifest(folder, libraries)
    for stale in set(folder.glob("tokenline_ops-*.so")) - {folder / v for v in libraries.values()}:
        stale.unlink(missing_ok=True)
    return {level: folder / name for level, name in libraries.items()}


def _compile(level: IsaLevel, path: Path) -> None:
    flags = " ".join(level.build_flags) or "no vector flags"
    logger.info("compiling the CPU kernels for %s (%s) into %s", level.name, flags, path.parent)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        staged = Path(scratch) / "kernel.so"
        compiles, link = compile_commands(level, Path(scratch), staged)
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


def _write_manifest(folder: Path, libraries: dict[str, str]) -> None:
    manifest = {"torch": torch.__version__, "sources": sources_digest(), "libraries": libraries}
    scratch = folder / f"{MANIFEST}.{os.getpid()}.tmp"
    scratch.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    scratch.replace(folder / MANIFEST)  # atomic: a concurrent start reads all or nothing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.scheduler.ops.cpu_kernels")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="model directory: its kernels/ gets this machine's level")
    where.add_argument("--out", help="a folder of kernels for --levels (the image's)")
    parser.add_argument(
        "--levels",
        default="",
        help=f"comma-separated ISA levels or 'all' ({', '.join(LEVEL_NAMES)}); "
        "default: this machine's",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    folder = Path(args.model) / KERNEL_DIR if args.model else Path(args.out)
    names = LEVEL_NAMES if args.levels == "all" else [n for n in args.levels.split(",") if n]
    try:
        levels = [level_named(name) for name in names] or None
        built = build(folder, levels)
    except (OSError, RuntimeError, ValueError) as exc:  # no compiler, no headers: eager it is
        logger.warning(
            "kernels not built (%s: %s); the engine keeps its eager paths", type(exc).__name__, exc
        )
        return 1
    for level, path in built.items():
        logger.info("kernels for %s: %s", level, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
