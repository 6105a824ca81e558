"""bench/vllm_compare.py never runs in CI (it needs a vLLM venv and minutes); only its flags are checked."""

from __future__ import annotations

import pytest

from bench import vllm_compare as compare


def test_defaults_alternate_three_pairs_on_both_models_and_dtypes() -> None:
    args = compare.parse_args([])
    assert args.sizes == ["tiny", "small"] and args.dtypes == ["bfloat16", "float32"]
    assert args.pairs == 3 and args.num_requests == 64
    assert args.threads == 0, "each side runs as it would by default on the machine"
    assert not args.vllm_multiprocess
    assert not args.vllm_prefix_caching, "the repeated workload would hit the previous run's prompts"
    assert not args.vllm_default_malloc, "vLLM gets the allocator settings Baton's executor gives itself"
    assert args.stream_interval == 1, "Baton streams every token, as vLLM does by default"
    assert args.executors == 1
    assert args.rpc == "generate", "a Generate stream per request unless asked"


def test_flags() -> None:
    args = compare.parse_args(["--sizes", "tiny", "--dtypes", "float32", "--pairs", "5", "--threads", "2"])
    assert (args.sizes, args.dtypes, args.pairs, args.threads) == (["tiny"], ["float32"], 5, 2)
    assert compare.parse_args(["--stream-interval", "4"]).stream_interval == 4
    assert compare.parse_args(["--executors", "2"]).executors == 2
    assert compare.parse_args(["--rpc", "batch"]).rpc == "batch"
    assert compare.parse_args(["--request-stream-interval", "8"]).request_stream_interval == 8
    with pytest.raises(SystemExit):
        compare.parse_args(["--executors", "0"])
    with pytest.raises(SystemExit):
        compare.parse_args(["--pairs", "0"])
    with pytest.raises(SystemExit):
        compare.parse_args(["--sizes", "huge"])


def test_same_openmp_settings_for_both_sides() -> None:
    assert compare.omp_env(2) == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}


def test_default_threads_give_vllm_every_core() -> None:
    assert compare.vllm_threads(compare.parse_args([])) >= 1
    assert compare.vllm_threads(compare.parse_args(["--threads", "3"])) == 3
