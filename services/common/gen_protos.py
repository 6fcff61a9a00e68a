"""Generate Python stubs beside the .proto files (`make proto`), or the descriptor set
Envoy's gRPC-JSON transcoder loads (`make descriptor`).

The google/api annotation protos come from googleapis-common-protos, which is
installed as a dependency, so no include path is configured by hand.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import google.api
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "proto"
DESCRIPTOR_SET = ROOT / "deploy" / "envoy" / "tokenline.pb"


def include_paths() -> list[str]:
    googleapis = Path(google.api.__path__[0]).parents[1]
    grpc_tools_protos = Path(protoc.__file__).parent / "_proto"
    return [str(PROTO_ROOT), str(googleapis), str(grpc_tools_protos)]


def _protoc(outputs: list[str]) -> int:
    protos = sorted(str(p) for p in (PROTO_ROOT / "tokenline" / "v1").glob("*.proto"))
    code = protoc.main(["protoc", *(f"-I{p}" for p in include_paths()), *outputs, *protos])
    if code != 0:
        print("protoc failed", file=sys.stderr)
    return code


def build_descriptor_set(out: Path = DESCRIPTOR_SET) -> int:
    """Every tokenline proto with its imports and source info (Envoy needs the imports)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return _protoc(["--include_imports", "--include_source_info", f"--descriptor_set_out={out}"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.common.gen_protos")
    parser.add_argument(
        "--descriptor-set",
        type=Path,
        metavar="PATH",
        help="write the FileDescriptorSet (with imports) here instead of the stubs",
    )
    args = parser.parse_args(argv)
    if args.descriptor_set is not None:
        return build_descriptor_set(args.descriptor_set)
    return _protoc(
        [f"--python_out={PROTO_ROOT}", f"--pyi_out={PROTO_ROOT}", f"--grpc_python_out={PROTO_ROOT}"]
    )


if __name__ == "__main__":
    raise SystemExit(main())
