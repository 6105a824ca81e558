"""Names of full KV blocks for the prefix cache: a chained hash over token ids.

Block ``i`` of a sequence is named by the hash of the name of block ``i - 1`` (``ROOT`` for the
first), the block's token ids, and extra keys where they change the K/V (a LoRA adapter's name,
say; none today). So a name stands for the whole prefix up to the end of its block: two sequences
share block ``i``'s name only when their first ``(i + 1) * block_size`` tokens agree, as in
vLLM's and nano-vllm's block managers. Executors name the blocks they cache this way, and the
scheduler names a queued prompt's blocks the same way to find the executor that holds the most
of it. Only full blocks have names: a partial block's K/V is still growing.

A request may carry a cache salt (vLLM's ``cache_salt``): its chain then starts from the salt's
hash instead of ``ROOT`` (``BlockNaming.root``), so its blocks' names differ from every other
chain's and it shares cached blocks only with requests of the same salt. That keeps one tenant
from learning, by timing its prefills, which prompts another sent.

Why BLAKE2b and a key: a request that found another prompt's name for a block of its own would
read that prompt's K/V, or leave its own under that name for the other to read, and so change
what another request generates. A non-cryptographic hash (xxHash, Python's ``hash``) lets anyone
who can send prompts construct such collisions offline, as vLLM's CVE-2025-25183 showed with
Python's ``hash``; vLLM names blocks with SHA-256 since. Names here stay 64 bits (they fill the
fleet's index in Redis), so a fleet with a fleet secret keys the hash with it
(``BlockNaming.for_fleet``): without the key nobody can compute a name at all, and reaching a
name another request's block holds by trial would take some 2**64 requests over the number of
blocks cached. Without one (``baton dev``, on loopback), a second block with a given block's
name still costs some 2**64 hashes. Schedulers and
executors must name alike, or placement finds nothing cached (exactness never depends on it):
they read the same secret. BLAKE2b costs about a microsecond a block in Python (XXH3 0.13).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

ROOT = 0  # the parent of a sequence's first block
_DIGEST_BYTES = 8
_SALT_DOMAIN = b"baton cache salt\0"  # so a salt's hash is never the hash of some block's bytes
_KEY_DOMAIN = b"baton block names\0"  # the fleet secret's other uses never see this key


@dataclass(frozen=True)
class BlockNaming:
    """How a fleet names blocks: keyed BLAKE2b, the key derived from its fleet secret (none: unkeyed)."""

    key: bytes = b""
    # The keyed hash before any data, copied for each name: the key's own compression is done once
    # (about a quarter of a block name's cost).
    _start: hashlib._Hash = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_start", hashlib.blake2b(digest_size=_DIGEST_BYTES, key=self.key))

    @classmethod
    def for_fleet(cls, fleet_secret: str) -> BlockNaming:
        if not fleet_secret:
            return cls()
        return cls(hashlib.blake2b(_KEY_DOMAIN + fleet_secret.encode(), digest_size=32).digest())

    def _digest(self, data: bytes) -> int:
        hasher = self._start.copy()
        hasher.update(data)
        return int.from_bytes(hasher.digest(), "little")

    def block_hash(self, parent: int, token_ids: Sequence[int], extra: bytes = b"") -> int:
        """The name of a full block holding ``token_ids`` after the block named ``parent``."""
        return self._digest(parent.to_bytes(_DIGEST_BYTES, "little") + array("I", token_ids).tobytes() + extra)

    def block_hashes(
        self, token_ids: Sequence[int], block_size: int, start: int = 0, parent: int = ROOT, extra: bytes = b""
    ) -> list[int]:
        """Names of the full blocks of ``token_ids`` from block ``start`` on, ``parent`` naming block
        ``start - 1``; a trailing partial block has none."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        names: list[int] = []
        for begin in range(start * block_size, len(token_ids) - block_size + 1, block_size):
            parent = self.block_hash(parent, token_ids[begin : begin + block_size], extra)
            names.append(parent)
        return names

    def root(self, cache_salt: str) -> int:
        """The parent of the first block of a request with this cache salt; ``ROOT`` without one."""
        return self._digest(_SALT_DOMAIN + cache_salt.encode()) if cache_salt else ROOT


UNKEYED = BlockNaming()  # a fleet without a fleet secret: ``baton dev`` and the tests
block_hash = UNKEYED.block_hash
block_hashes = UNKEYED.block_hashes
chain_root = UNKEYED.root
