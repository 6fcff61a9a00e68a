"""The CPU kernels' build and choice: one library per ISA level under a manifest, the level
this machine runs picked from its CPU flags, prebuilt folders (the image's) read after the
model's own, and ``--build-kernels`` compiling only when no folder has a library for this
machine. Builds here compile one-line sources, or fake the compiler where only its failure
matters (the real kernels are built in ``kernel_model_dir``, conftest.py)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from services.scheduler.__main__ import parse_args
from services.scheduler.ops import cpu_kernels
from services.scheduler.ops.cpu_kernels import KERNEL_DIR, MANIFEST, build, find_library
from services.scheduler.ops.isa_levels import LEVELS, level_named, machine_level
from services.scheduler.transport import engine_build
from services.scheduler.transport.engine_build import build_kernels_if_missing
from tests.scheduler.conftest import needs_compiler

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
AVX512 = AVX2 | {"avx512f", "avx512dq", "avx512vl", "avx512bw"}
SAPPHIRE_RAPIDS = AVX512 | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}


@pytest.fixture
def one_line_sources(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    source = tmp_path / "one.cpp"
    source.write_text("int tokenline_one() { return 1; }\n")
    monkeypatch.setattr(cpu_kernels, "SOURCES", (source,))
    monkeypatch.setattr(cpu_kernels, "HEADERS", ())


@pytest.mark.parametrize(
    ("flags", "cap", "level"),
    [
        (frozenset({"sse4_2"}), "", "baseline"),
        (AVX2, "", "avx2"),
        (AVX512, "", "avx512"),
        (SAPPHIRE_RAPIDS, "", "avx512_bf16"),  # no AMX build: the kernels issue no AMX
        (SAPPHIRE_RAPIDS, "avx2", "avx2"),  # ATEN_CPU_CAPABILITY caps it, as torch's own
        (SAPPHIRE_RAPIDS, "default", "baseline"),
        (AVX2, "avx512", "avx2"),  # a cap never adds what the CPU lacks
    ],
)
def test_the_level_is_the_highest_the_cpu_has_within_the_cap(
    flags: frozenset[str], cap: str, level: str
) -> None:
    assert machine_level(flags, cap).name == level


def test_every_level_runs_on_the_cpus_of_the_next(tmp_path: Path) -> None:
    """Each level's required flags include the one below's: a machine that runs a level
    runs every lesser one (what an ISA cap relies on)."""
    for lower, higher in zip(LEVELS, LEVELS[1:], strict=False):
        assert lower.cpu_flags <= higher.cpu_flags, (lower.name, higher.name)


@needs_compiler
def test_levels_build_into_one_folder_under_a_manifest(
    one_line_sources: None, tmp_path: Path
) -> None:
    """Two levels (one this CPU cannot run: compiling needs no such CPU), one manifest;
    a stale library of an older key is removed; each level is found by its name."""
    folder = tmp_path / "kernels"
    folder.mkdir()
    (folder / "tokenline_ops-avx2-0000000000000000.so").write_bytes(b"an older build")
    levels = [level_named("baseline"), level_named("avx512_bf16")]
    built = build(folder, levels)
    assert set(built) == {"baseline", "avx512_bf16"}
    assert sorted(p.name for p in folder.glob("*.so")) == sorted(p.name for p in built.values())
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["libraries"] == {name: path.name for name, path in built.items()}
    for level in levels:
        assert find_library(folder, level) == built[level.name]
    assert find_library(folder, level_named("avx2")) is None


@needs_compiler
def test_a_changed_source_or_compiler_gets_a_new_library(
    one_line_sources: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "kernels"
    level = level_named("baseline")
    first = build(folder, [level])["baseline"]
    assert build(folder, [level])["baseline"] == first  # unchanged: kept, not rebuilt
    monkeypatch.setattr(cpu_kernels, "_compiler_version", lambda: "c++ (a newer one) 99.1")
    second = build(folder, [level])["baseline"]
    assert second != first and not first.exists()  # the old key's library is gone
    (tmp_path / "one.cpp").write_text("int tokenline_one() { return 2; }\n")
    assert find_library(folder, level) is None  # the manifest was for other sources


@needs_compiler
def test_kernels_are_built_only_when_no_folder_has_this_machines_level(
    one_line_sources: None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A prebuilt folder holding this machine's level is used as is; without one the
    start builds into the model's folder once, and a second start leaves it alone."""
    prebuilt = tmp_path / "prebuilt"
    build(prebuilt, [machine_level()])
    model = tmp_path / "model"
    with caplog.at_level(logging.INFO, logger=cpu_kernels.__name__):
        build_kernels_if_missing(str(model), str(prebuilt))
        assert not (model / KERNEL_DIR).exists()
        build_kernels_if_missing(str(model))
        built = next((model / KERNEL_DIR).glob("*.so")).stat()
        build_kernels_if_missing(str(model))
    compiled = [r.getMessage() for r in caplog.records if "compiling the CPU kernels" in r.message]
    assert len(compiled) == 1  # the model's, once
    assert f"for {machine_level().name} " in compiled[0] and str(model) in compiled[0]
    again = next((model / KERNEL_DIR).glob("*.so")).stat()
    assert (again.st_ino, again.st_mtime_ns) == (built.st_ino, built.st_mtime_ns)


def test_a_failed_build_is_a_warning_not_a_failed_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def no_compiler(folder: Path, levels: object) -> dict[str, Path]:
        raise FileNotFoundError("no C++ compiler (c++ / g++, or $CXX)")

    monkeypatch.setattr(engine_build, "build_kernels", no_compiler)
    with caplog.at_level(logging.WARNING, logger=engine_build.__name__):
        build_kernels_if_missing(str(tmp_path))
    assert "kernels not built (FileNotFoundError: no C++ compiler" in caplog.text


def test_the_flags_and_their_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENLINE_BUILD_KERNELS", raising=False)
    monkeypatch.delenv("TOKENLINE_KERNELS_DIR", raising=False)
    assert parse_args(["--model", "m"]).build_kernels is False
    assert parse_args(["--model", "m", "--build-kernels"]).build_kernels is True
    assert parse_args(["--model", "m"]).kernels_dir == ""
    monkeypatch.setenv("TOKENLINE_BUILD_KERNELS", "1")
    monkeypatch.setenv("TOKENLINE_KERNELS_DIR", "/opt/tokenline/kernels")
    assert parse_args(["--model", "m"]).build_kernels is True
    assert parse_args(["--model", "m", "--no-build-kernels"]).build_kernels is False
    assert parse_args(["--model", "m"]).kernels_dir == "/opt/tokenline/kernels"


@pytest.mark.live  # a fresh interpreter: the live tier holds subprocesses
def test_an_install_without_the_sources_warns_and_runs_eagerly(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An install that lost csrc/ (the wheel once did) must not stop the scheduler: both
    the build at start and the load say why and leave the eager paths."""
    missing = tmp_path / "csrc" / "sample_rows.cpp"
    monkeypatch.setattr(cpu_kernels, "SOURCES", (missing,))
    (tmp_path / KERNEL_DIR).mkdir()  # a manifest to check against the (missing) sources
    manifest = {"torch": cpu_kernels.torch.__version__, "sources": "?", "libraries": {}}
    (tmp_path / KERNEL_DIR / MANIFEST).write_text(json.dumps(manifest))
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
    folder = tmp_path / "kernels"
    with pytest.raises(RuntimeError, match=r"(?s)compiling good\.cpp, bad\.cpp failed:.*bad\.cpp"):
        build(folder, [level_named("baseline")])
    assert list(folder.iterdir()) == []  # no library, no manifest, no scratch directory
    monkeypatch.setattr(cpu_kernels, "SOURCES", (good,))
    assert build(folder, [level_named("baseline")])["baseline"].is_file()  # alone it links
