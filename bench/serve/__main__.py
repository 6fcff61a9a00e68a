"""`python -m bench.serve [flags]` benchmarks one server; `... compare [flags]` two;
`... sweep [flags]` two over concurrency x temperature x dtype."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compare"]:
        from bench.serve import side_by_side

        return side_by_side.main(argv[1:])
    if argv[:1] == ["sweep"]:
        from bench.serve import sweep

        return sweep.main(argv[1:])
    from bench.serve import session

    return session.main(argv)


if __name__ == "__main__":
    sys.exit(main())
