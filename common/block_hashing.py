"""Names of full KV blocks for the prefix cache: a chained hash over token ids.

Block ``i`` of a sequence is named by the hash of the name of block ``i - 1`` (``ROOT`` for the
first), the block's token ids, and extra keys where they change the K/V (a LoRA adapter's name,
say; none today). So a name stands for the whole prefix up to the end of its block: two sequences
share block ``i``'s name only when their first ``(i + 1) * block_size`` tokens agree, as in
vLLM's and nano-vllm's block managers. Executors name the blocks they cache this way, and the
scheduler names a queued prompt's blocks the same way to find the executor that holds the most
of it. Only full blocks have names: a partial block's K/V is still growing.

A request may carry a cache salt (vLLM's ``cache_salt``): its chain then starts from the salt's
hash instead of ``ROOT`` (``chain_root``), so its blocks' names differ from every other chain's
and it shares cached blocks only with requests of the same salt. That keeps one tenant from
learning, by timing its prefills, which prompts another sent.

xxHash (XXH3, 64 bits) is fast on short inputs and well distributed; a collision would need two
different prefixes to meet in 64 bits, and the chain makes every name depend on every token
before it.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

ROOT = 0  # the parent of a sequence's first block
_SALT_DOMAIN = b"baton cache salt\0"  # so a salt's hash is never the hash of some block's bytes


def chain_root(cache_salt: str) -> int:
    """The parent of the first block of a request with this cache salt; ``ROOT`` without one."""
    if not cache_salt:
        return ROOT
    return xxhash.xxh3_64_intdigest(_SALT_DOMAIN + cache_salt.encode())


def block_hash(parent: int, token_ids: Sequence[int], extra: bytes = b"") -> int:
    """The name of a full block holding ``token_ids`` after the block named ``parent``."""
    hasher = xxhash.xxh3_64(parent.to_bytes(8, "little"))
    hasher.update(array("I", token_ids).tobytes())
    if extra:
        hasher.update(extra)
    return hasher.intdigest()


def block_hashes(
    token_ids: Sequence[int], block_size: int, start: int = 0, parent: int = ROOT, extra: bytes = b""
) -> list[int]:
    """Names of the full blocks of ``token_ids`` from block ``start`` on, ``parent`` naming block
    ``start - 1``; a trailing partial block has none."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    names: list[int] = []
    for begin in range(start * block_size, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[begin : begin + block_size], extra)
        names.append(parent)
    return names
