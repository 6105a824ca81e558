"""Presets whose requests share prompt prefixes: what a prefix cache speeds up.

Apart from ``workload.SCENARIOS`` (random prompts, nothing shared), and run only when named:
``baton bench --scenario shared-prefix multi-turn``.
"""

from __future__ import annotations

from baton.bench.multi_turn import MultiTurnSpec
from baton.bench.shared_prefix import SharedPrefixSpec
from baton.bench.workload import Scenario

PREFIX_SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "shared-prefix",
            "8 system prompts of 384 tokens, 12 questions of 16-64 tokens behind each, sent shuffled "
            "(after SGLang's generated-shared-prefix)",
            SharedPrefixSpec(),
            16,
        ),
        Scenario(
            "multi-turn",
            "8 conversations of 4 turns, each turn the whole history plus a 32-64-token message",
            MultiTurnSpec(),
            8,
        ),
    )
}
