"""Which running requests a waiting one may preempt: pure logic, no I/O.

A waiting request may evict running work when no executor has room for it and it outranks the
victims by at least ``preempt_priority_gap`` levels. Victims are the least important first and,
among equals, those with the fewest generated tokens (the least work to redo). A request already
preempted ``max_preemptions`` times is never chosen again, which bounds thrash: under a steady
stream of important arrivals each request is set back at most that many times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RunningRequest:
    request_id: str
    priority: int
    preemptions: int  # times it was already preempted
    blocks: int  # KV blocks it holds
    generated: int  # tokens generated so far


def choose_victims(
    waiting_priority: int,
    need_blocks: int,
    free_blocks: int,
    free_slots: int,
    running: Sequence[RunningRequest],
    priority_gap: int,
    max_preemptions: int,
) -> list[str]:
    """The fewest victims that make room for one request, or [] if no allowed set does."""
    if priority_gap <= 0:
        return []
    eligible = sorted(
        (r for r in running if waiting_priority - r.priority >= priority_gap and r.preemptions < max_preemptions),
        key=lambda r: (r.priority, r.generated),
    )
    victims: list[RunningRequest] = []
    for victim in eligible:
        if free_slots >= 1 and free_blocks >= need_blocks:
            break
        victims.append(victim)
        free_slots += 1
        free_blocks += victim.blocks
    if free_slots < 1 or free_blocks < need_blocks:
        return []
    # A later, larger victim may make an earlier one unneeded: spare every victim the rest make
    # room without, the costliest to redo first.
    for victim in reversed(list(victims)):
        if free_slots - 1 >= 1 and free_blocks - victim.blocks >= need_blocks:
            victims.remove(victim)
            free_slots -= 1
            free_blocks -= victim.blocks
    return [victim.request_id for victim in victims]
