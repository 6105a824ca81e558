"""The ``baton`` command line: input it cannot use is one line naming it, and exit status 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton.cli import main
from common.config import ExecutorConfig
from executor_service.model_loader import load_engine
from tests.conftest import free_port


def test_a_config_file_that_is_not_there_is_named_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nowhere.yaml"
    assert main(["scheduler", "--config", str(missing)]) == 2
    assert capsys.readouterr().err.strip() == f"baton: [Errno 2] No such file or directory: '{missing}'"


def test_a_model_that_cannot_be_loaded_is_refused_with_its_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"executor\.model .*nowhere.* cannot be loaded"):
        load_engine(ExecutorConfig(model=str(tmp_path / "nowhere")))


def test_inspect_of_an_unreachable_redis_names_it_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    assert main(["inspect", "--redis-url", url]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"baton inspect: cannot read Redis at {url}: ") and "Traceback" not in err
