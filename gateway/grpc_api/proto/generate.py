"""Regenerate the Python code for specgate.proto: `python -m gateway.grpc_api.proto.generate` from anywhere.

Needs grpcio-tools (a dev dependency). The include root is the repo root, so the generated modules
import each other as `gateway.grpc_api.proto.specgate_pb2` and work as a package. Commit the output
(specgate_pb2.py, specgate_pb2.pyi, specgate_pb2_grpc.py). The generated code checks at import
that the installed protobuf and grpcio are at least the versions it was generated with, so keep
pyproject's floors at grpcio-tools' versions when regenerating with a newer grpcio-tools.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PROTO = "gateway/grpc_api/proto/specgate.proto"


def generate(out_dir: Path = ROOT, *extra: str) -> int:
    """Run protoc on specgate.proto, writing under `out_dir` (as gateway/grpc_api/proto/...); protoc's status."""
    from grpc_tools import protoc  # dev dependency: imported here so that serving never needs it

    return protoc.main(["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
                        f"--grpc_python_out={out_dir}", *extra, str(ROOT / PROTO)])


if __name__ == "__main__":
    rc = generate()
    if rc != 0:
        print(f"protoc failed ({rc})", file=sys.stderr)
    raise SystemExit(rc)
