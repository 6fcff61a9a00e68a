"""`compare`'s peer server: a start that cannot succeed fails with the reason, and its
process is gone afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.serve.servers import ServerStartError, TokenlineServer, TransformersServer


@pytest.mark.live  # starts `transformers serve`
def test_transformers_serve_that_cannot_load_says_why(tmp_path: Path) -> None:
    empty_model_dir = tmp_path / "not-a-model"
    empty_model_dir.mkdir()
    server = TransformersServer(
        str(empty_model_dir), "bfloat16", "cpu", "", tmp_path / "logs", timeout=120
    )
    with pytest.raises(ServerStartError) as info, server:
        pass
    message = str(info.value)
    assert "`transformers serve` exited with code" in message
    assert str(empty_model_dir) in message  # the command line, then the server's own words
    reason = message.rsplit("\nreason: ", 1)[1]
    assert reason.startswith(("ValueError", "OSError")) and "not-a-model" in reason
    assert server.proc is not None and server.proc.poll() is not None


@pytest.mark.parametrize(("device", "builds"), [("cpu", True), ("cuda", False)])
def test_tokenline_on_cpu_serves_with_its_compiled_kernels(
    device: str, builds: bool, tmp_path: Path
) -> None:
    """A model folder the benchmarks built (make model-small, bench.checkpoints) has no
    kernels until someone runs `make kernels`; the server builds them at start as `make
    run` would, or it would measure the eager sampler and decode attention."""
    server = TokenlineServer("models/tokenline-small", "float32", device, "", tmp_path, 60)
    assert ("--build-kernels" in server.stack.scheduler_args) is builds
    assert server.stack.scheduler_args[:4] == ["--dtype", "float32", "--device", device]
