"""Generate the Python gRPC stubs from proto/ntp/v1 into ntp_manager/contract/proto (`make proto`).

Imports inside the generated files are rewritten to be package-relative to `ntp_manager.contract.proto`,
so the stubs work from an installed package. `generate(dest)` is also used by the test that fails
when the checked-in stubs differ from a fresh generation.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = Path(__file__).resolve().parent / "contract" / "proto"
_IMPORT = re.compile(r"^from ntp\.v1 import ", re.MULTILINE)


def proto_files() -> list[Path]:
    return sorted((PROTO_DIR / "ntp" / "v1").glob("*.proto"))


def generate(dest: Path) -> list[Path]:
    """Generate stubs under dest/ntp/v1. Returns the generated files."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *[str(p.relative_to(PROTO_DIR)) for p in proto_files()],
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed")
        out = []
        src_root = Path(tmp) / "ntp" / "v1"
        (dest / "ntp" / "v1").mkdir(parents=True, exist_ok=True)
        for f in sorted(src_root.iterdir()):
            text = _IMPORT.sub("from ntp_manager.contract.proto.ntp.v1 import ", f.read_text())
            target = dest / "ntp" / "v1" / f.name
            target.write_text(text)
            out.append(target)
        for pkg in (dest / "ntp", dest / "ntp" / "v1"):
            init = pkg / "__init__.py"
            if not init.exists():
                init.write_text("")
        return out


def main() -> int:
    stale = OUT_DIR / "ntp"
    if stale.exists():
        shutil.rmtree(stale)
    files = generate(OUT_DIR)
    for f in files:
        print(f"wrote {f.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
