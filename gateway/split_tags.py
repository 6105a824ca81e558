"""Tags in streamed text: a tag (``<tool_call>``, ``</think>``) can arrive split across two
messages, so the end of a message that could begin one is held back until the next shows."""

from __future__ import annotations


def tag_prefix_len(text: str, *tags: str) -> int:
    """How many of ``text``'s last characters could begin one of ``tags`` (0: none)."""
    longest = 0
    for tag in tags:
        for size in range(min(len(tag) - 1, len(text)), longest, -1):
            if tag.startswith(text[-size:]):
                longest = size
                break
    return longest
