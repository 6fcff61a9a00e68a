"""`tokenline <command> [flags]`: one entry point for every process in the image.

Containers select the service by command (`tokenline scheduler --model ...`);
each command execs the service's own module so its flags and `--help` are the
service's real argument parser.
"""

from __future__ import annotations

import os
import sys

COMMANDS = {
    "gateway": "gateway",
    "frontend": "services.frontend",
    "scheduler": "services.scheduler",
    "detokenizer": "services.detokenizer",
    "build-model": "services.common.default_model",
    "healthcheck": "services.healthcheck",
    "serve": "services.launch",  # tokenline serve MODEL [any service's flags]
    "launch": "services.launch",  # the same, by its older name
}


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in COMMANDS:
        names = ", ".join(COMMANDS)
        print(f"usage: tokenline {{{names}}} [flags]  (each command has --help)", file=sys.stderr)
        raise SystemExit(2)
    module = COMMANDS[args[0]]
    os.execv(sys.executable, [sys.executable, "-m", module, *args[1:]])


if __name__ == "__main__":
    main()
