"""Regenerate specserve_pb2.py / specserve_pb2_grpc.py from specserve.proto.

Run from the repository root: `python -m serving.proto.generate`. The proto is compiled with the repository
root as its include path, so the generated gRPC module imports `serving.proto.specserve_pb2` (a package
import) instead of a bare `specserve_pb2` that only works with serving/proto on sys.path.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO = "serving/proto/specserve.proto"


def main() -> int:
    from grpc_tools import protoc  # only needed to regenerate: `pip install grpcio-tools`

    rc = protoc.main(["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={ROOT}", f"--pyi_out={ROOT}",
                      f"--grpc_python_out={ROOT}", str(ROOT / PROTO)])
    if rc != 0:
        print(f"protoc failed with exit status {rc}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
