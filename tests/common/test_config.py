"""common.config: defaults, the YAML file, BATON_* env overrides, type checks and validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import (
    BatchLevelConfig,
    BatonConfig,
    ExecutorConfig,
    LoadAwareConfig,
    RequestLevelConfig,
)
from common.config_loading import env_overrides, load_config, with_overrides


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "baton.yaml"
    path.write_text(text)
    return path


def test_defaults_load_without_file_or_env() -> None:
    config = load_config(None, environ={})
    assert config == BatonConfig()
    assert config.scheduler.port == 50051
    assert config.scheduler.request_level.default_priority == 5
    assert config.scheduler.request_level.priority_credit_ms == 1000.0
    assert config.scheduler.batch_level.max_batch_size == 256
    assert config.executor.dtype == "float32"
    assert config.distributed.key_prefix == "baton"
    assert config.monitoring.log_level == "INFO"


def test_yaml_file_values_are_loaded_and_unset_keys_keep_defaults(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
scheduler:
  port: 6000
  request_level: {default_priority: 3, priority_credit_ms: 250}
  batch_level: {max_batch_size: 8, min_batch_size: 2}
  load_aware: {low_load_threshold: 0.1, high_load_threshold: 0.9}
executor:
  model: /models/tiny
  dtype: bfloat16
distributed:
  key_prefix: other
monitoring:
  log_level: debug
""",
    )
    config = load_config(path, environ={})
    assert config.scheduler.port == 6000
    assert config.scheduler.request_level.default_priority == 3
    # An int in the file is accepted for a float key and becomes a float.
    assert config.scheduler.request_level.priority_credit_ms == 250.0
    assert isinstance(config.scheduler.request_level.priority_credit_ms, float)
    assert config.scheduler.batch_level == BatchLevelConfig(max_batch_size=8, min_batch_size=2)
    assert config.scheduler.load_aware == LoadAwareConfig(0.1, 0.9)
    assert config.executor.model == "/models/tiny"
    assert config.executor.dtype == "bfloat16"
    assert config.distributed.key_prefix == "other"
    assert config.monitoring.log_level == "debug"
    # Untouched keys keep their defaults.
    assert config.scheduler.token_level.token_budget == 2048
    assert config.scheduler.request_level.default_max_tokens == 256
    assert config.executor.block_size == 16


def test_empty_yaml_file_gives_defaults(tmp_path: Path) -> None:
    assert load_config(_write(tmp_path, ""), environ={}) == BatonConfig()


def test_yaml_file_whose_top_level_is_not_a_mapping_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="top level must be a mapping"):
        load_config(_write(tmp_path, "- a\n- b\n"), environ={})


def test_section_that_is_not_a_mapping_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="scheduler"):
        load_config(_write(tmp_path, "scheduler: [1, 2]\n"), environ={})


def test_unknown_top_level_key_raises_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown config key schedular"):
        load_config(_write(tmp_path, "schedular:\n  port: 1\n"), environ={})


def test_unknown_nested_key_raises_naming_the_full_path(tmp_path: Path) -> None:
    path = _write(tmp_path, "scheduler:\n  batch_level:\n    max_batch: 4\n")
    with pytest.raises(ValueError, match=r"unknown config key scheduler\.batch_level\.max_batch") as info:
        load_config(path, environ={})
    # The message lists the keys that do exist, to help fix a typo.
    assert "max_batch_size" in str(info.value)


def test_unknown_env_key_raises_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"unknown config key executor\.dtpye"):
        load_config(None, environ={"BATON_EXECUTOR__DTPYE": "float16"})


def test_unknown_env_section_raises_naming_the_key() -> None:
    with pytest.raises(ValueError, match="unknown config key nonsense"):
        load_config(None, environ={"BATON_NONSENSE__KEY": "1"})


def test_env_overrides_parse_yaml_scalars_into_a_nested_mapping() -> None:
    tree = env_overrides(
        {
            "BATON_SCHEDULER__BATCH_LEVEL__MAX_BATCH_SIZE": "32",
            "BATON_SCHEDULER__LOAD_AWARE__HIGH_LOAD_THRESHOLD": "0.5",
            "BATON_EXECUTOR__DTYPE": "bfloat16",
            "BATON_EXECUTOR__MODEL": "",
            "BATON_NO_DOUBLE_UNDERSCORE": "ignored",
            "PATH": "/usr/bin",
        }
    )
    assert tree == {
        "scheduler": {"batch_level": {"max_batch_size": 32}, "load_aware": {"high_load_threshold": 0.5}},
        "executor": {"dtype": "bfloat16", "model": ""},
    }


def test_env_overrides_take_precedence_over_the_file(tmp_path: Path) -> None:
    path = _write(
        tmp_path, "scheduler:\n  port: 6000\n  batch_level: {max_batch_size: 8}\nexecutor: {dtype: float16}\n"
    )
    environ = {
        "BATON_SCHEDULER__BATCH_LEVEL__MAX_BATCH_SIZE": "32",
        "BATON_EXECUTOR__DTYPE": "bfloat16",
        "BATON_SCHEDULER__REQUEST_LEVEL__PRIORITY_CREDIT_MS": "12.5",
        "BATON_DISTRIBUTED__REDIS_URL": "redis://example:6380/1",
        "UNRELATED": "x",
    }
    config = load_config(path, environ=environ)
    assert config.scheduler.batch_level.max_batch_size == 32
    assert config.executor.dtype == "bfloat16"
    assert config.scheduler.request_level.priority_credit_ms == 12.5
    assert config.distributed.redis_url == "redis://example:6380/1"
    # File values the env does not mention are kept.
    assert config.scheduler.port == 6000


def test_env_override_of_an_int_key_is_an_int_not_a_string() -> None:
    config = load_config(None, environ={"BATON_SCHEDULER__PORT": "7000"})
    assert config.scheduler.port == 7000
    assert isinstance(config.scheduler.port, int)


def test_env_override_naming_a_value_as_a_section_raises() -> None:
    with pytest.raises(ValueError, match=r"scheduler\.port"):
        load_config(None, environ={"BATON_SCHEDULER__PORT__DEEPER": "1"})


def test_string_for_an_int_key_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"scheduler\.port must be int"):
        load_config(_write(tmp_path, "scheduler: {port: fifty}\n"), environ={})


def test_string_for_an_int_key_from_env_raises() -> None:
    with pytest.raises(ValueError, match=r"scheduler\.batch_level\.max_batch_size must be int"):
        load_config(None, environ={"BATON_SCHEDULER__BATCH_LEVEL__MAX_BATCH_SIZE": "lots"})


def test_bool_for_an_int_key_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"executor\.block_size must be int"):
        load_config(_write(tmp_path, "executor: {block_size: true}\n"), environ={})


def test_bool_for_a_float_key_raises() -> None:
    with pytest.raises(ValueError, match=r"priority_credit_ms must be float"):
        load_config(None, environ={"BATON_SCHEDULER__REQUEST_LEVEL__PRIORITY_CREDIT_MS": "true"})


def test_float_for_an_int_key_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"scheduler\.port must be int"):
        load_config(_write(tmp_path, "scheduler: {port: 1.5}\n"), environ={})


def test_mapping_for_a_scalar_key_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"executor\.dtype must be str"):
        load_config(_write(tmp_path, "executor: {dtype: {a: 1}}\n"), environ={})


def test_number_for_a_string_key_becomes_a_string() -> None:
    config = load_config(None, environ={"BATON_EXECUTOR__EXECUTOR_ID": "42"})
    assert config.executor.executor_id == "42"


def test_min_batch_size_above_max_batch_size_raises(tmp_path: Path) -> None:
    path = _write(tmp_path, "scheduler:\n  batch_level: {max_batch_size: 4, min_batch_size: 8}\n")
    with pytest.raises(ValueError, match="min_batch_size <= max_batch_size"):
        load_config(path, environ={})


def test_zero_min_batch_size_raises() -> None:
    with pytest.raises(ValueError, match="batch_level"):
        BatchLevelConfig(max_batch_size=4, min_batch_size=0)


def test_unknown_dtype_raises_naming_it() -> None:
    with pytest.raises(ValueError, match="float64"):
        load_config(None, environ={"BATON_EXECUTOR__DTYPE": "float64"})


def test_the_backend_and_private_ops_switch_come_from_the_environment() -> None:
    assert (ExecutorConfig().backend, ExecutorConfig().torch_private_ops) == ("auto", True)
    environ = {"BATON_EXECUTOR__BACKEND": "torch", "BATON_EXECUTOR__TORCH_PRIVATE_OPS": "false"}
    config = load_config(None, environ=environ)
    assert (config.executor.backend, config.executor.torch_private_ops) == ("torch", False)
    with pytest.raises(ValueError, match=r"executor\.backend"):
        ExecutorConfig(backend="")


def test_the_executors_nice_value_comes_from_the_environment_within_0_to_19() -> None:
    assert ExecutorConfig().nice == 0
    assert load_config(None, environ={"BATON_EXECUTOR__NICE": "10"}).executor.nice == 10
    for nice in (-1, 20):
        with pytest.raises(ValueError, match=r"executor\.nice must be 0-19"):
            ExecutorConfig(nice=nice)


def test_low_load_threshold_above_high_raises() -> None:
    with pytest.raises(ValueError, match="low_load_threshold <= high_load_threshold"):
        LoadAwareConfig(low_load_threshold=0.9, high_load_threshold=0.5)


def test_load_threshold_above_one_raises() -> None:
    with pytest.raises(ValueError, match="load_aware"):
        LoadAwareConfig(low_load_threshold=0.5, high_load_threshold=1.5)


def test_nan_load_threshold_raises() -> None:
    with pytest.raises(ValueError, match="load_aware"):
        LoadAwareConfig(low_load_threshold=float("nan"))


def test_default_priority_above_max_priority_raises() -> None:
    with pytest.raises(ValueError, match="default_priority"):
        RequestLevelConfig(default_priority=11)


def test_negative_priority_credit_raises() -> None:
    with pytest.raises(ValueError, match="priority_credit_ms"):
        RequestLevelConfig(priority_credit_ms=-1.0)


def test_nan_priority_credit_raises() -> None:
    with pytest.raises(ValueError, match="priority_credit_ms"):
        RequestLevelConfig(priority_credit_ms=float("nan"))


def test_zero_default_max_tokens_raises() -> None:
    with pytest.raises(ValueError, match="default_max_tokens"):
        RequestLevelConfig(default_max_tokens=0)


def test_zero_block_size_raises() -> None:
    with pytest.raises(ValueError, match="block_size"):
        ExecutorConfig(block_size=0)


def test_heartbeat_not_below_lease_ttl_raises() -> None:
    with pytest.raises(ValueError, match="heartbeat_interval_ms < lease_ttl_ms"):
        load_config(
            None,
            environ={"BATON_DISTRIBUTED__LEASE_TTL_MS": "500", "BATON_DISTRIBUTED__HEARTBEAT_INTERVAL_MS": "500"},
        )


def test_unknown_log_level_raises() -> None:
    with pytest.raises(ValueError, match="log_level"):
        load_config(None, environ={"BATON_MONITORING__LOG_LEVEL": "CHATTY"})


def test_with_overrides_replaces_given_keys_and_ignores_none() -> None:
    base = load_config(None, environ={"BATON_EXECUTOR__DTYPE": "float16", "BATON_SCHEDULER__PORT": "6000"})
    out = with_overrides(
        base,
        executor={"model": "/models/x", "dtype": None, "device": None},
        scheduler={"port": None},
    )
    assert out.executor.model == "/models/x"
    # None means "flag not given": the value already there is kept.
    assert out.executor.dtype == "float16"
    assert out.executor.device == "auto"
    assert out.scheduler.port == 6000
    # The input is frozen and unchanged.
    assert base.executor.model == ""


def test_with_overrides_with_only_none_values_returns_an_equal_config() -> None:
    base = BatonConfig()
    assert with_overrides(base, executor={"model": None}, distributed={"redis_url": None}) == base


def test_with_overrides_validates_the_result() -> None:
    with pytest.raises(ValueError, match="dtype"):
        with_overrides(BatonConfig(), executor={"dtype": "int8"})
    with pytest.raises(ValueError, match=r"unknown config key executor\.modle"):
        with_overrides(BatonConfig(), executor={"modle": "/x"})


def test_fleet_secret_file_from_the_environment(tmp_path: Path) -> None:
    config = load_config(None, environ={"BATON_SECURITY__FLEET_SECRET_FILE": "/run/secrets/fleet"})
    assert config.security.fleet_secret_file == "/run/secrets/fleet" and config.security.fleet_secret == ""
    with pytest.raises(ValueError, match="not both"):
        load_config(
            None,
            environ={"BATON_SECURITY__FLEET_SECRET_FILE": "/f", "BATON_SECURITY__FLEET_SECRET": "inline"},
        )
