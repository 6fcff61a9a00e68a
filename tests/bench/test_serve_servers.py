"""`compare`'s peer server: a start that cannot succeed fails with the reason, and its
process is gone afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.serve.servers import ServerStartError, TransformersServer


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
