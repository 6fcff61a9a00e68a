"""`tokenline serve MODEL [flags]` (services/launch_flags.py, services/launch.py): every
flag reaches the services that take it, typed by their own parsers; `make run` without
ARGS starts the same commands as before; a wrong flag or value stops it naming the flag;
``--help`` lists every service's flags by service, including one added later."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from services.launch import (
    LocalStack,
    StackPorts,
    create_serve_parser,
    service_parsers,
    stack_from_args,
)
from services.launch_flags import add_service_flags, route

FLAGS = [
    *("--tool-call-parser", "deepseek_v31"),  # the frontend's
    *("--dtype", "float32", "--batch-invariant", "--quantization", "int8"),  # the scheduler's
    *("--max-decode-states", "10"),  # the detokenizer's
    "--no-multiplex",  # the gateway's
    *("--log-level", "debug"),  # all four
    "--context-length=512",  # frontend and scheduler
]


def parsed(stack: LocalStack, name: str) -> argparse.Namespace:
    """What the service itself reads from the command the stack starts it with."""
    command = stack.commands()[name]
    return service_parsers()[name].parse_args(command[3:])  # after `python -m module`


def test_each_flag_reaches_the_services_that_take_it() -> None:
    stack = stack_from_args(["models/x", *FLAGS])
    assert stack.model == "models/x"
    frontend, scheduler = parsed(stack, "frontend"), parsed(stack, "scheduler")
    detokenizer, gateway = parsed(stack, "detokenizer"), parsed(stack, "gateway")
    assert frontend.tool_call_parser == "deepseek_v31" and frontend.context_length == 512
    assert scheduler.dtype == "float32" and scheduler.batch_invariant
    assert scheduler.quantization == "int8"
    assert scheduler.context_length == 512
    assert detokenizer.max_decode_states == 10 and gateway.multiplex is False
    assert {p.log_level.lower() for p in (frontend, scheduler, detokenizer, gateway)} == {"debug"}
    assert "--dtype" not in stack.frontend_args and "--tool-call-parser" not in stack.scheduler_args
    # The wiring is still the launcher's: the frontend dials the stack's own scheduler.
    assert list(frontend.scheduler_addrs) == [stack.addr("scheduler")]


def test_make_run_without_args_starts_what_it_started_before() -> None:
    stack = stack_from_args(["--model", "models/tokenline-tiny"])
    assert stack.commands() == LocalStack("models/tokenline-tiny", StackPorts()).commands()


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--bogus", "1"], "--bogus"),
        (["--dtype", "nope"], "--dtype"),
        (["--max-decode-states", "many"], "--max-decode-states"),
        (["--port", "1"], "--port"),  # each service's port is the launcher's
        (["models/a", "--model", "models/b"], "MODEL and --model"),
    ],
)
def test_a_wrong_flag_stops_the_launch_naming_it(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        stack_from_args(argv)
    assert info.value.code == 2 and named in capsys.readouterr().err


def test_help_lists_every_service_flag_under_its_service() -> None:
    parsers = service_parsers()
    help_text = create_serve_parser(parsers).format_help()
    sections = {s.split(":\n", 1)[0]: s for s in help_text.split("\n\n")}
    wired = {"--host", "--port", "--metrics-port", "--model", "--frontend-addr"}
    wired |= {"--scheduler-addrs", "--detokenizer-addr"}
    for name, parser in parsers.items():
        for action in parser._actions:
            option = action.option_strings[0] if action.option_strings else None
            if option is None or option in wired or option in ("-h", "--help"):
                continue
            if option.startswith("--tls-"):
                assert option in sections["TLS between services (default: plaintext)"]
                continue
            holders = [t for t, s in sections.items() if name in t and f"  {option}" in s]
            assert holders, (name, option)


def test_a_flag_a_service_adds_later_is_routed_and_listed() -> None:
    parsers = service_parsers()
    parsers["scheduler"].add_argument("--new-knob", type=int, default=1, help="a new knob")
    parser = create_serve_parser(parsers)
    flags = route(parser.parse_args(["--new-knob", "3"]), list(parsers))
    assert flags["scheduler"] == ["--new-knob", "3"] and flags["frontend"] == []
    assert "scheduler flags:\n" in parser.format_help() and "--new-knob NEW_KNOB" in (
        parser.format_help()
    )


def test_one_option_spelled_two_ways_is_a_build_error() -> None:
    a, b = argparse.ArgumentParser(), argparse.ArgumentParser()
    a.add_argument("--x")
    b.add_argument("--x", action="store_true")
    with pytest.raises(ValueError, match="--x"):
        add_service_flags(argparse.ArgumentParser(), {"a": a, "b": b}, {})


@pytest.mark.live  # a fresh interpreter: the live tier holds subprocesses
def test_tokenline_serve_is_the_launcher() -> None:
    """The console command's path: a wrong flag fails at once, before any service starts."""
    run = [sys.executable, "-m", "services.cli", "serve", "models/x", "--bogus"]
    done = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--bogus" in done.stderr
    assert "tokenline serve" in done.stderr and "starting" not in done.stdout


def test_make_run_hands_args_to_the_launcher() -> None:
    """`make run ARGS="..."` ends in the launcher with those flags; without ARGS, with none."""

    def run_line(*make_args: str) -> str:
        dry = subprocess.run(
            ["make", "--no-print-directory", "-n", "run", *make_args],
            capture_output=True,
            text=True,
        )
        assert dry.returncode == 0, dry.stderr
        return dry.stdout.strip().splitlines()[-1]

    with_args = run_line("ARGS=--dtype float32 --tool-call-parser deepseek_v31")
    assert with_args.endswith(
        "-m services.launch --model models/tokenline-tiny --dtype float32 "
        "--tool-call-parser deepseek_v31"
    )
    assert run_line().rstrip().endswith("-m services.launch --model models/tokenline-tiny")
