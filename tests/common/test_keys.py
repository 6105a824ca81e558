"""common.keys: every key one Lua script touches shares the {prefix} hash tag (one Cluster slot);
output streams do not, so they spread over a cluster's shards."""

from __future__ import annotations

import pytest

from common.keys import KeySchema, is_safe_name, sample_id, split_sample_id

SLOTS = 16384


def crc16_xmodem(data: bytes) -> int:
    """CRC16/XMODEM (poly 0x1021, init 0), the checksum Redis Cluster uses for key slots."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def hash_tag(key: str) -> str | None:
    """The Redis Cluster hash tag: what lies between the first '{' and the next '}', if non-empty."""
    start = key.find("{")
    if start == -1:
        return None
    end = key.find("}", start + 1)
    if end == -1 or end == start + 1:
        return None
    return key[start + 1 : end]


def key_slot(key: str) -> int:
    tag = hash_tag(key)
    return crc16_xmodem((key if tag is None else tag).encode()) % SLOTS


def test_crc16_matches_the_redis_cluster_reference_values() -> None:
    # The check value from the Redis Cluster spec, and slots redis-cli CLUSTER KEYSLOT reports.
    assert crc16_xmodem(b"123456789") == 0x31C3
    assert key_slot("foo") == 12182
    assert key_slot("bar") == 5061
    assert key_slot("{user1000}.following") == key_slot("{user1000}.followers")


def _script_key_groups(keys: KeySchema, rid: str, eid: str) -> dict[str, list[str]]:
    """The KEYS each Lua script in scheduler_service.store (request_scripts, lease_scripts) receives."""
    return {
        "ENQUEUE": [keys.request(rid), keys.pending],
        "FORGET_IDLE": [
            keys.tenants_seen,
            keys.tenants_waiting,
            keys.tenant_running,
            keys.tenant_counters,
            keys.estimator,
        ],
        "CLAIM": [keys.pending, keys.request(rid), keys.running(eid), keys.tokens(rid)],
        "APPEND_TOKENS": [keys.request(rid), keys.tokens(rid)],
        "FINISH": [keys.request(rid), keys.running(eid), keys.tokens(rid), keys.pending],
        "REQUEUE": [keys.request(rid), keys.running(eid), keys.pending],
        "CANCEL": [keys.request(rid), keys.pending, keys.tokens(rid)],
        "LEASE": [keys.lease(eid), keys.executors],
        "APPLY_EVENTS": [keys.cached_blocks(eid), keys.lease(eid)],
        "DROP": [keys.cached_blocks(eid), keys.lease(eid)],
        "LEADING_RUNS": [keys.request(rid), keys.cached_blocks(eid), keys.cached_blocks(eid + "-2")],
    }


@pytest.mark.parametrize("prefix", ["baton", "tenant-a", "x.y:z"])
def test_keys_touched_by_one_script_share_the_prefix_hash_tag(prefix: str) -> None:
    keys = KeySchema(prefix)
    for script, group in _script_key_groups(keys, "req-1", "exec-7").items():
        tags = {hash_tag(k) for k in group}
        assert tags == {prefix}, f"{script} keys {group} have hash tags {tags}"
        assert len({key_slot(k) for k in group}) == 1, f"{script} keys span slots"


def test_every_tagged_key_starts_with_the_braced_prefix() -> None:
    keys = KeySchema()
    tagged = [
        keys.pending,
        keys.request("r"),
        keys.tokens("r"),
        keys.executors,
        keys.executor("e"),
        keys.running("e"),
        keys.lease("e"),
        keys.cached_blocks("e"),
    ]
    for key in tagged:
        assert key.startswith("{baton}:"), key


def test_request_queue_running_and_tokens_keys_share_one_cluster_slot() -> None:
    keys = KeySchema()
    slots = {
        key_slot(k)
        for k in (
            keys.request("abc"),
            keys.request("another-request"),
            keys.pending,
            keys.running("exec-1"),
            keys.running("exec-2"),
            keys.tokens("abc"),
            keys.executors,
            keys.executor("exec-1"),
            keys.lease("exec-1"),
        )
    }
    assert slots == {crc16_xmodem(b"baton") % SLOTS}


def test_output_streams_carry_no_hash_tag_and_spread_over_slots() -> None:
    keys = KeySchema()
    assert keys.output("abc") == "baton:req:abc:out"
    outputs = [keys.output(f"request-{i}") for i in range(64)]
    assert all(hash_tag(k) is None for k in outputs)
    # Hashed on the whole key, 64 streams land on many slots, not all on the prefix's one.
    assert len({key_slot(k) for k in outputs}) > 32


def test_control_channel_is_not_tagged() -> None:
    assert KeySchema().control_channel == "baton:control"
    assert hash_tag(KeySchema().control_channel) is None


def test_documented_key_layout_for_the_default_prefix() -> None:
    keys = KeySchema()
    assert keys.pending == "{baton}:queue:pending"
    assert keys.request("R") == "{baton}:req:R"
    assert keys.tokens("R") == "{baton}:req:R:tokens"
    assert keys.executors == "{baton}:executors"
    assert keys.executor("E") == "{baton}:executor:E"
    assert keys.running("E") == "{baton}:executor:E:running"
    assert keys.lease("E") == "{baton}:lease:executor:E"
    assert keys.cached_blocks("E") == "{baton}:prefix:executor:E"


def test_the_schema_owns_every_key_it_builds_and_nothing_else() -> None:
    keys = KeySchema()
    built = [
        keys.pending,
        keys.tenant_queue("t"),
        keys.tenants_waiting,
        keys.tenants_seen,
        keys.request("R"),
        keys.tokens("R"),
        keys.output("R"),
        keys.executors,
        keys.executor("E"),
        keys.running("E"),
        keys.lease("E"),
        keys.cached_blocks("E"),
    ]
    assert all(keys.owns(key) for key in built), [key for key in built if not keys.owns(key)]
    for stray in ("{baton}:prefix:executor:", "{baton}:prefix:E", "{other}:prefix:executor:E", "{baton}:prefix:x:E"):
        assert not keys.owns(stray), stray
    sample = sample_id("R" * 128, 127)
    assert all(keys.owns(key) for key in (keys.request(sample), keys.tokens(sample), keys.output(sample)))
    for stray in ("{baton}:req:R~0", "{baton}:req:R~01", "{baton}:req:R~", "{baton}:req:~1", "{baton}:req:R~1~2"):
        assert not keys.owns(stray), stray
    assert not keys.owns(keys.tenant_queue("t~1")) and not keys.owns(keys.executor("E~1"))


def test_sample_ids_derive_from_the_request_id_and_no_client_can_choose_one() -> None:
    assert sample_id("job.1", 0) == "job.1" and sample_id("job.1", 2) == "job.1~2"
    assert split_sample_id("job.1~2") == ("job.1", 2)
    for own in ("job.1", "job~0", "job~x", "~3", "a~1~2", "job~01"):
        assert split_sample_id(own) == (own, 0), own
    assert not is_safe_name("job~2")  # a client's id never holds the separator
    with pytest.raises(ValueError):
        sample_id("job", 1024)


def test_custom_prefix_is_used_in_every_key() -> None:
    keys = KeySchema("staging")
    assert keys.pending == "{staging}:queue:pending"
    assert keys.request("R") == "{staging}:req:R"
    assert keys.running("E") == "{staging}:executor:E:running"
    assert keys.output("R") == "staging:req:R:out"
    assert keys.control_channel == "staging:control"
    assert key_slot(keys.pending) == crc16_xmodem(b"staging") % SLOTS


def test_different_prefixes_do_not_collide() -> None:
    a, b = KeySchema("a"), KeySchema("b")
    assert a.request("R") != b.request("R")
    assert a.output("R") != b.output("R")


@pytest.mark.parametrize("prefix", ["", "{baton}", "ba{ton", "bat}on", "has space"])
def test_invalid_prefix_raises(prefix: str) -> None:
    with pytest.raises(ValueError, match="key prefix"):
        KeySchema(prefix)
