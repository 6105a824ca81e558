"""Where phase (a)'s CPU went against phase (b)'s, and what that bounds a/b to (P2, issue 5).

When both phases keep every core busy, each phase's time is its CPU divided by the cores. So a/b
is the engines' CPU in (b) over everything (a) spent: its executors, the scheduler, Redis and the
client. That splits the gap in two:

- what the executors spent beyond (b)'s engines for the same tokens (their service threads, and
  steps made slower by what else ran on the cores);
- what the other processes spent.

It also gives a ceiling: with a scheduler that cost nothing and executors that cost no more than
(b)'s engines, a/b could be at most engines / (engines + Redis + client). On a GPU, or whenever
either phase left cores idle (a small workload end to end can be bound by latency, not CPU), the
phases are not both CPU-bound and this says nothing (``account`` returns None).
"""

from __future__ import annotations

from dataclasses import dataclass

from throughput_setup import Result

SATURATED = 0.9  # a phase counts as CPU-bound when its processes used this share of every core


@dataclass(frozen=True)
class CpuAccount:
    cores: int
    engines_b: float  # CPU-s (b)'s engine processes used
    executors_a: float  # CPU-s (a)'s executor processes used
    others_a: dict[str, float]  # CPU-s of (a)'s other processes: scheduler, redis, client

    @property
    def predicted(self) -> float:
        """a/b if both phases were purely CPU-bound: (b)'s engine CPU over all of (a)'s."""
        return self.engines_b / (self.executors_a + sum(self.others_a.values()))

    @property
    def ceiling_free_scheduler(self) -> float:
        """a/b with a scheduler that cost nothing and executors no dearer than (b)'s engines."""
        rest = sum(cpu for name, cpu in self.others_a.items() if name != "scheduler")
        return self.engines_b / (self.engines_b + rest)

    def describe(self) -> str:
        others = ", ".join(f"{name} {cpu:.2f}" for name, cpu in self.others_a.items())
        return (
            f"CPU account ({self.cores} cores, both phases CPU-bound): (b)'s engines used {self.engines_b:.2f} CPU-s, "
            f"(a)'s executors {self.executors_a:.2f} (x{self.executors_a / self.engines_b:.2f}) and beside them "
            f"{others}; so a/b ~ {self.predicted:.3f}, and at most {self.ceiling_free_scheduler:.3f} "
            "with a scheduler that cost nothing and executors no dearer than (b)'s engines"
        )


def account(results: dict[str, Result], cores: int) -> CpuAccount | None:
    """The account of (a) against (b), or None when either lacks CPU figures or left cores idle."""
    a, b = results.get("a"), results.get("b")
    if a is None or b is None or not a.cpu_seconds or not b.cpu_seconds or min(a.seconds, b.seconds) <= 0:
        return None
    engines = sum(b.cpu_seconds.values())
    if engines < SATURATED * cores * b.seconds or sum(a.cpu_seconds.values()) < SATURATED * cores * a.seconds:
        return None
    executors = sum(cpu for name, cpu in a.cpu_seconds.items() if name.startswith("executor"))
    others = {name: cpu for name, cpu in a.cpu_seconds.items() if not name.startswith("executor")}
    if executors <= 0:
        return None
    return CpuAccount(cores, engines, executors, others)
