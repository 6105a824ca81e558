"""Printing benchmark results: a rich table per scenario, and ``vllm bench serve``'s text layout."""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from baton.bench.reuse import PrefixReuse
from baton.bench.stats import Summary


@dataclass(frozen=True)
class ScenarioResult:
    name: str
    description: str
    batch_size: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    summary: Summary
    reuse: PrefixReuse | None = None  # first-of-group vs repeat TTFT, for workloads that share prefixes
    ttft_by_turn: tuple[float, ...] = ()  # mean TTFT (ms) of each turn index, for multi-turn runs


def _ms(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.1f}"


def _span(lens: tuple[int, int]) -> str:
    return str(lens[0]) if lens[0] == lens[1] else f"{lens[0]}-{lens[1]}"


def _reuse_cells(reuse: PrefixReuse | None) -> list[str]:
    if reuse is None:
        return ["-"] * 3
    return [_ms(reuse.first_ttft_ms), _ms(reuse.repeat_ttft_ms), f"{reuse.ratio:.2f}"]


def scenario_table(results: Sequence[ScenarioResult]) -> Table:
    table = Table(title="baton bench", title_justify="left")
    for name in ("scenario", "requests", "in flight", "prompt", "output"):
        table.add_column(name)
    for name in ("seconds", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "failed"):
        table.add_column(name, justify="right")
    table.add_column("prompt cached", justify="right")  # the share of prompt tokens read from a prefix cache
    reuse = any(r.reuse for r in results)
    if reuse:
        for name in ("first TTFT ms", "repeat TTFT ms", "repeat/first"):
            table.add_column(name, justify="right")
    for r in results:
        s = r.summary
        extra = _reuse_cells(r.reuse) if reuse else []
        table.add_row(
            r.name,
            str(s.completed + s.failed),
            str(r.batch_size),
            _span(r.input_len),
            _span(r.output_len),
            f"{s.duration_s:.2f}",
            f"{s.output_throughput:.1f}",
            _ms(s.ttft.p50),
            _ms(s.ttft.p99),
            _ms(s.tpot.p50),
            _ms(s.tpot.p99),
            str(s.failed),
            f"{s.cached_input_tokens / s.input_tokens:.0%}" if s.input_tokens else "-",
            *extra,
        )
    return table


def turn_table(results: Sequence[ScenarioResult]) -> Table | None:
    """Mean TTFT of each turn index, for the results that have turns; None when none has."""
    with_turns = [r for r in results if r.ttft_by_turn]
    if not with_turns:
        return None
    table = Table(title="TTFT by turn (mean ms)", title_justify="left")
    table.add_column("scenario")
    turns = max(len(r.ttft_by_turn) for r in with_turns)
    for k in range(turns):
        table.add_column(f"turn {k + 1}", justify="right")
    table.add_column("later/turn 1", justify="right")
    for r in with_turns:
        cells = [_ms(v) for v in r.ttft_by_turn] + ["-"] * (turns - len(r.ttft_by_turn))
        table.add_row(r.name, *cells, f"{r.reuse.ratio:.2f}" if r.reuse else "-")
    return table


def print_scenarios(results: Sequence[ScenarioResult], console: Console | None = None) -> None:
    console = console or Console()
    if not console.is_terminal:
        console.width = 260  # piped to a file: no need to squeeze the table into 80 columns
    console.print(scenario_table(results))
    turns = turn_table(results)
    if turns is not None:
        console.print(turns)


def serve_text(summary: Summary, title: str = "Serving Benchmark Result") -> str:
    """The result block in ``vllm bench serve``'s layout, with p50 and p90 added to its p99."""
    lines = [f"{f' {title} ':=^50}"]

    def row(label: str, value: object) -> None:
        lines.append(f"{label:<40}{value:<10}")

    row("Successful requests:", summary.completed)
    row("Failed requests:", summary.failed)
    row("Benchmark duration (s):", f"{summary.duration_s:.2f}")
    row("Total input tokens:", summary.input_tokens)
    row("Cached input tokens:", summary.cached_input_tokens)
    row("Total generated tokens:", summary.output_tokens)
    row("Request throughput (req/s):", f"{summary.request_throughput:.2f}")
    if summary.request_goodput is not None:
        row("Request goodput (req/s):", f"{summary.request_goodput:.2f}")
    row("Output token throughput (tok/s):", f"{summary.output_throughput:.2f}")
    row("Total Token throughput (tok/s):", f"{summary.total_token_throughput:.2f}")
    sections = (
        ("Time to First Token", "TTFT", summary.ttft),
        ("Time per Output Token (excl. 1st token)", "TPOT", summary.tpot),
        ("Inter-token Latency", "ITL", summary.itl),
        ("End-to-end Latency", "E2EL", summary.e2el),
    )
    for heading, short, dist in sections:
        lines.append(f"{heading:-^50}")
        row(f"Mean {short} (ms):", _ms(dist.mean))
        row(f"Median {short} (ms):", _ms(dist.p50))
        row(f"P90 {short} (ms):", _ms(dist.p90))
        row(f"P99 {short} (ms):", _ms(dist.p99))
    lines.append("=" * 50)
    return "\n".join(lines)


@contextlib.contextmanager
def progress_bar(total: int, description: str, enabled: bool = True) -> Iterator[Callable[[object], None]]:
    """A transient bar on stderr while a person waits; yields a callback that advances it by one."""
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(file=sys.stderr),
        transient=True,
        disable=not enabled,
    )
    with progress:
        task = progress.add_task(description, total=total)
        yield lambda _done: progress.advance(task)
