"""--log-json / TOKENLINE_LOG_JSON: every line a service writes is one JSON object."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.envs import parse_bool
from services.common.logs import add_logging_args
from services.launch import free_port

pytestmark = pytest.mark.live


@pytest.mark.parametrize(("raw", "value"), [("1", True), ("on", True), ("0", False), ("no", False)])
def test_env_fallback_parses_booleans(
    raw: str, value: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENLINE_LOG_JSON", raw)
    p = argparse.ArgumentParser()
    add_logging_args(p)
    assert p.parse_args([]).log_json is value
    assert p.parse_args(["--no-log-json"]).log_json is False
    assert p.parse_args(["--log-json"]).log_json is True


def test_a_bad_value_is_refused() -> None:
    with pytest.raises(ValueError, match="expected 1/0"):
        parse_bool("maybe")


def test_a_service_started_with_the_env_logs_json_lines(default_model_dir: Path) -> None:
    env = {**os.environ, "TOKENLINE_LOG_JSON": "1"}
    cmd = [sys.executable, "-m", "services.detokenizer", "--model", str(default_model_dir)]
    cmd += ["--port", str(free_port())]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stderr:  # until the server says it listens
            lines.append(json.loads(line))
            if "gRPC listening" in lines[-1]["message"]:
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert lines and all({"time", "level", "logger", "message"} <= set(r) for r in lines)
    assert lines[-1]["logger"] == "services.common.rpc.server"
