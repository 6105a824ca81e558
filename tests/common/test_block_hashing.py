"""Block names for the prefix cache: a name stands for the whole prefix up to its block's end."""

from __future__ import annotations

import pytest

from common.block_hashing import ROOT, BlockNaming, block_hash, block_hashes, chain_root


def test_only_full_blocks_are_named() -> None:
    assert len(block_hashes(list(range(15)), 4)) == 3
    assert block_hashes(list(range(3)), 4) == []


def test_a_name_depends_on_every_token_before_it() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_hashes([1, 2, 3, 9, 5, 6, 7, 8], 4)
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different prefix


def test_sequences_that_share_a_prefix_share_its_names() -> None:
    system = list(range(100, 132))
    a = block_hashes([*system, 1, 2, 3, 4], 16)
    b = block_hashes([*system, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9], 16)
    assert a[:2] == b[:2] and len(a) == 2 and len(b) == 3


def test_the_chain_can_resume_from_a_known_block() -> None:
    tokens = list(range(40))
    whole = block_hashes(tokens, 8)
    assert block_hashes(tokens, 8, start=2, parent=whole[1]) == whole[2:]
    assert whole[0] == block_hash(ROOT, tokens[:8])


def test_extra_keys_change_the_name() -> None:
    assert block_hash(ROOT, [1, 2], b"lora-a") != block_hash(ROOT, [1, 2])


def test_block_size_is_checked() -> None:
    with pytest.raises(ValueError):
        block_hashes([1], 0)


def test_a_cache_salt_renames_every_block_of_its_chain() -> None:
    tokens = list(range(48))
    plain = block_hashes(tokens, 16)
    salted = block_hashes(tokens, 16, parent=chain_root("tenant-a secret"))
    other = block_hashes(tokens, 16, parent=chain_root("tenant-b secret"))
    assert chain_root("") == ROOT and chain_root("x") not in (ROOT, chain_root("y"))
    assert not set(salted) & set(plain) and not set(salted) & set(other)
    assert block_hashes(tokens, 16, parent=chain_root("tenant-a secret")) == salted  # the same salt, the same names


def test_a_fleet_secret_keys_every_name() -> None:
    tokens = list(range(48))
    keyed = BlockNaming.for_fleet("0f1e2d3c4b5a69788796a5b4c3d2e1f0")
    assert BlockNaming.for_fleet("") == BlockNaming()  # no secret: the unkeyed names
    assert keyed == BlockNaming.for_fleet("0f1e2d3c4b5a69788796a5b4c3d2e1f0")  # every process derives the same key
    assert not set(keyed.block_hashes(tokens, 16)) & set(block_hashes(tokens, 16))
    assert keyed.root("s") not in (chain_root("s"), ROOT)
    other = BlockNaming.for_fleet("1f1e2d3c4b5a69788796a5b4c3d2e1f0")
    assert not set(keyed.block_hashes(tokens, 16)) & set(other.block_hashes(tokens, 16))
