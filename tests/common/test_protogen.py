"""common.protogen: the committed common/pb matches proto/, and --check notices when it does not.

The staleness tests work on a copy of common/pb; the real one is never written.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common import protogen

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def pb_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of common/pb that protogen treats as its output directory."""
    copy = tmp_path / "pb"
    shutil.copytree(protogen.OUT_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(protogen, "OUT_DIR", copy)
    return copy


def test_check_exits_zero_on_the_committed_code() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "common.protogen", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"common/pb is stale; run python -m common.protogen\n{result.stderr}"


def test_check_on_an_unmodified_copy_exits_zero(pb_copy: Path) -> None:
    assert protogen.main(["--check"]) == 0


def test_check_on_an_edited_copy_exits_one_and_names_the_file(
    pb_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = pb_copy / "generate_pb2.py"
    target.write_text(target.read_text() + "\n# hand edit\n")
    assert protogen.main(["--check"]) == 1
    assert "generate_pb2.py" in capsys.readouterr().err


def test_check_on_a_copy_missing_a_file_exits_one(pb_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (pb_copy / "executor_pb2_grpc.py").unlink()
    assert protogen.main(["--check"]) == 1
    assert "executor_pb2_grpc.py" in capsys.readouterr().err


def test_check_on_a_copy_with_an_extra_file_exits_one(pb_copy: Path) -> None:
    (pb_copy / "leftover_pb2.py").write_text("# not generated\n")
    assert protogen.main(["--check"]) == 1


def test_regenerating_into_the_copy_makes_it_fresh_again(pb_copy: Path) -> None:
    target = pb_copy / "executor_pb2.pyi"
    target.write_text("# broken\n")
    assert protogen.main(["--check"]) == 1
    assert protogen.main([]) == 0
    assert protogen.main(["--check"]) == 0
    # Regeneration reproduces the committed file byte for byte.
    assert target.read_bytes() == (REPO / "common" / "pb" / "executor_pb2.pyi").read_bytes()


def test_generated_code_imports_its_sibling_relatively() -> None:
    grpc_code = (REPO / "common" / "pb" / "generate_pb2_grpc.py").read_text()
    assert "from . import generate_pb2" in grpc_code
    assert "from baton.v1 import" not in grpc_code
