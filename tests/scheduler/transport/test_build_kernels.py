"""``--build-kernels``: when the scheduler compiles its CPU kernels at start. Builds here
compile one-line sources, or fake the compiler where only its failure matters (the real
kernels are built in ``kernel_model_dir``, conftest.py); what is under test is the decision
around the build and the flag that asks for it."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from services.scheduler.__main__ import parse_args
from services.scheduler.ops import cpu_kernels
from services.scheduler.ops.cpu_kernels import isa_cache_path, isa_flags, kernel_path
from services.scheduler.transport import engine_build
from services.scheduler.transport.engine_build import build_kernels_if_missing
from tests.scheduler.conftest import needs_compiler


@needs_compiler
def test_kernels_are_built_only_when_none_fit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A real compile of a one-line source: the first start builds and says for which ISA,
    the second finds the library and leaves it untouched."""
    source = tmp_path / "one.cpp"
    source.write_text("int tokenline_one() { return 1; }\n")
    monkeypatch.setattr(cpu_kernels, "SOURCES", (source,))
    monkeypatch.setattr(cpu_kernels, "HEADERS", ())
    with caplog.at_level(logging.INFO, logger=cpu_kernels.__name__):
        build_kernels_if_missing(str(tmp_path))
        built = kernel_path(tmp_path).stat()
        build_kernels_if_missing(str(tmp_path))  # this machine's build is there now
    compiled = [r.getMessage() for r in caplog.records if "compiling the CPU kernels" in r.message]
    assert len(compiled) == 1
    flags = " ".join(cpu_kernels.isa_flags()) or "the baseline ISA"
    assert flags in compiled[0]
    again = kernel_path(tmp_path).stat()
    assert (again.st_ino, again.st_mtime_ns) == (built.st_ino, built.st_mtime_ns)


def test_a_failed_build_is_a_warning_not_a_failed_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def no_compiler(model_dir: str) -> Path:
        raise FileNotFoundError("no C++ compiler (c++ / g++, or $CXX)")

    monkeypatch.setattr(engine_build, "build_kernels", no_compiler)
    with caplog.at_level(logging.WARNING, logger=engine_build.__name__):
        build_kernels_if_missing(str(tmp_path))
    assert "kernels not built (FileNotFoundError: no C++ compiler" in caplog.text


def test_the_flag_and_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENLINE_BUILD_KERNELS", raising=False)
    assert parse_args(["--model", "m"]).build_kernels is False
    assert parse_args(["--model", "m", "--build-kernels"]).build_kernels is True
    monkeypatch.setenv("TOKENLINE_BUILD_KERNELS", "1")
    assert parse_args(["--model", "m"]).build_kernels is True
    assert parse_args(["--model", "m", "--no-build-kernels"]).build_kernels is False


def test_an_install_without_the_sources_warns_and_runs_eagerly(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An install that lost csrc/ (the wheel once did) must not stop the scheduler: both
    the build at start and the load say why and leave the eager paths."""
    missing = tmp_path / "csrc" / "sample_rows.cpp"
    monkeypatch.setattr(cpu_kernels, "SOURCES", (missing,))
    with caplog.at_level(logging.WARNING, logger=engine_build.__name__):
        build_kernels_if_missing(str(tmp_path))
    assert "kernels not built (FileNotFoundError" in caplog.text
    # A fresh process: this one may have registered the op already (then load needs no key).
    code = (
        "from pathlib import Path\n"
        "from services.scheduler.ops import cpu_kernels\n"
        f"cpu_kernels.SOURCES = (Path({str(missing)!r}),)\n"
        f"assert cpu_kernels.SampleKernel.load({str(tmp_path)!r}) is None\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "no kernel sources" in done.stderr


@needs_compiler
def test_a_source_that_does_not_compile_fails_the_build_and_leaves_no_library(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The sources compile at once, each in its own process: one that fails fails the
    build with its compiler's message, and nothing half-built is left to load."""
    good, bad = tmp_path / "good.cpp", tmp_path / "bad.cpp"
    good.write_text("int tokenline_fine() { return 1; }\n")
    bad.write_text("int tokenline_broken( { return 1; }\n")
    monkeypatch.setattr(cpu_kernels, "SOURCES", (good, bad))
    monkeypatch.setattr(cpu_kernels, "HEADERS", ())
    with pytest.raises(RuntimeError, match=r"(?s)compiling good\.cpp, bad\.cpp failed:.*bad\.cpp"):
        cpu_kernels.build(tmp_path)
    assert not kernel_path(tmp_path).exists()
    assert list((tmp_path / "kernels").iterdir()) == []  # the scratch directory went too
    monkeypatch.setattr(cpu_kernels, "SOURCES", (good,))
    assert cpu_kernels.build(tmp_path) == kernel_path(tmp_path)  # alone it links


def test_the_isa_probe_answer_is_kept_on_disk_and_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scheduler start probes the vector ISA once per machine (~3 s of compiles), then
    reads the answer: the file is keyed by CPU flags, torch, compiler and capability cap."""
    monkeypatch.setenv("TOKENLINE_CACHE_DIR", str(tmp_path))
    cache = isa_cache_path()
    assert cache.parent == tmp_path and not cache.exists()
    probed = isa_flags()
    assert json.loads(cache.read_text()) == probed
    cache.write_text(json.dumps(["-mwritten-here"]))  # what a later start finds is used
    assert isa_flags() == ["-mwritten-here"]
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")  # a capped process: its own entry
    assert isa_cache_path() != cache
