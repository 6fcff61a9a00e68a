"""Generate Python stubs beside the .proto files (`make proto`).

The google/api annotation protos come from googleapis-common-protos, which is
installed as a dependency, so no include path is configured by hand.
"""

from __future__ import annotations

import sys
from pathlib import Path

import google.api
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "proto"


def include_paths() -> list[str]:
    googleapis = Path(google.api.__path__[0]).parents[1]
    grpc_tools_protos = Path(protoc.__file__).parent / "_proto"
    return [str(PROTO_ROOT), str(googleapis), str(grpc_tools_protos)]


def main() -> int:
    protos = sorted(str(p) for p in (PROTO_ROOT / "tokenline" / "v1").glob("*.proto"))
    args = ["protoc", *(f"-I{p}" for p in include_paths())]
    args += [
        f"--python_out={PROTO_ROOT}",
        f"--pyi_out={PROTO_ROOT}",
        f"--grpc_python_out={PROTO_ROOT}",
        *protos,
    ]
    code = protoc.main(args)
    if code != 0:
        print("protoc failed", file=sys.stderr)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
