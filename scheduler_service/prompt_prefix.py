"""A queued prompt's block names, as its request record keeps them for placement by cached prefix.

At submit the scheduler names the prompt's full blocks exactly as executors name the blocks they
cache (``common.block_hashing``), with the fleet's block size. Admission then asks each
executor's index how many of those names, from the first on, it holds: that many blocks of the
prompt need no prefill there.

Names are stored as lowercase hex without padding (at most 16 characters for 64 bits, against
up to 20 in decimal), comma-joined in the record's ``prefix`` field, with the block size they
were computed for in ``prefix_block``: an executor with another block size names other blocks.
The executors' index sets hold the same text, so Redis compares the strings directly. A salted
request's chain root goes in ``prefix_root``, for its executor to name its blocks from.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from common.block_hashing import ROOT, UNKEYED, BlockNaming

# Only the first 256 blocks are named (4,096 tokens with 16-token blocks). Admission looks names
# up in a Lua script that runs atomically on Redis, one call per candidate, each walking the names
# for every executor until its first miss: the cap bounds that walk, and so how long one call can
# hold Redis, to 256 lookups per executor, and keeps the record small (about 4 KiB of names).
# A longer shared prefix still ranks its holders first; they only stop gaining past the cap.
MAX_PREFIX_BLOCKS = 256

PREFIX_FIELD = "prefix"
BLOCK_SIZE_FIELD = "prefix_block"
ROOT_FIELD = "prefix_root"


def name_text(name: int) -> str:
    """How a block name is written in Redis (records and index sets alike)."""
    return f"{name:x}"


def names_text(names: Iterable[int]) -> list[str]:
    return [name_text(name) for name in names]


def prefix_fields(
    prompt_ids: Sequence[int], block_size: int, cache_salt: str = "", naming: BlockNaming = UNKEYED
) -> dict[str, str]:
    """The record fields naming the prompt's first full blocks as the fleet's executors name them,
    from its cache salt's root: none when the block size is unknown (no executor said it) or the
    prompt fills no block; and a salted request's root, always (the blocks its output fills are
    named from it as well)."""
    root = naming.root(cache_salt)
    fields = {ROOT_FIELD: name_text(root)} if root != ROOT else {}
    if block_size < 1:
        return fields
    names = naming.block_hashes(prompt_ids[: MAX_PREFIX_BLOCKS * block_size], block_size, parent=root)
    if names:
        fields |= {PREFIX_FIELD: ",".join(names_text(names)), BLOCK_SIZE_FIELD: str(block_size)}
    return fields
