"""Regenerate Baton's protobuf code into ``common/pb``.

Run ``python -m common.protogen`` after editing ``proto/``; ``--check`` exits 1 when the
committed code is stale (a test runs it).
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = Path(__file__).resolve().parent / "pb"
PROTOS = ("baton/v1/generate.proto", "baton/v1/executor.proto")
_ABSOLUTE_IMPORT = re.compile(r"^from baton\.v1 import (\w+_pb2)", re.MULTILINE)


def _generate(into: Path) -> None:
    from grpc_tools import protoc

    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={into}",
        f"--pyi_out={into}",
        f"--grpc_python_out={into}",
        *(str(PROTO_DIR / p) for p in PROTOS),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    generated = into / "baton" / "v1"
    for path in sorted(generated.iterdir()):
        if path.suffix not in (".py", ".pyi"):
            continue
        # protoc writes package-absolute imports; ours live in common.pb, so make them relative.
        text = _ABSOLUTE_IMPORT.sub(r"from . import \1", path.read_text())
        (into / path.name).write_text(text)
    shutil.rmtree(into / "baton")
    (into / "__init__.py").write_text('"""Generated protobuf code; regenerate with python -m common.protogen."""\n')


def _stale_files(fresh: Path) -> list[str]:
    names = sorted(p.name for p in fresh.iterdir())
    current = sorted(p.name for p in OUT_DIR.iterdir() if p.is_file()) if OUT_DIR.exists() else []
    stale = sorted(set(names) ^ set(current))
    stale += [n for n in names if n in current and not filecmp.cmp(fresh / n, OUT_DIR / n, shallow=False)]
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if common/pb is stale")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        _generate(fresh)
        if args.check:
            stale = _stale_files(fresh)
            if stale:
                print(f"stale generated files: {', '.join(stale)}", file=sys.stderr)
                return 1
            return 0
        if OUT_DIR.exists():
            shutil.rmtree(OUT_DIR)
        shutil.copytree(fresh, OUT_DIR)
    return 0


if __name__ == "__main__":
    sys.exit(main())
