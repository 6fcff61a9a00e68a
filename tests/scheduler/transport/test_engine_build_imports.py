"""A scheduler start on a native model leaves torch's compiler stack and transformers'
modeling code unimported: together they cost seconds of CPU per start, and the suite
starts a scheduler dozens of times."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY_MODULES = ("torch._dynamo", "transformers.modeling_utils")


@pytest.mark.live  # a fresh interpreter: the live tier holds subprocesses
def test_building_the_engine_imports_no_compiler_stack(default_model_dir: Path) -> None:
    probe = f"""
import json, sys
from services.scheduler.__main__ import parse_args
from services.scheduler.transport.engine_build import build_scheduler
config = parse_args(["--model", {str(default_model_dir)!r}, "--detokenizer-addr", "127.0.0.1:1",
                     "--kv-cache-tokens", "256", "--num-threads", "1"])
scheduler, dtype = build_scheduler(config)
print(json.dumps([name for name in {HEAVY_MODULES!r} if name in sys.modules]))
"""
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(out.strip().splitlines()[-1]) == []
