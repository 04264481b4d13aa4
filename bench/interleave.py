"""Rounds of a sweep in alternating order, and pdserve against the better peer per level.

A machine can drift or slow under back-to-back load (the Zen 3 VM of docs/benchmarks.md: of two runs back to back
the first won 7 of 7), so a sweep that always runs its systems in one order favours whichever comes first. With
`--rounds R` every system runs R times, the order reversed each round (ABC, CBA, ABC...): each system's mean
position is the same, and a drift that is linear in time cancels over two rounds.
"""
from __future__ import annotations

import statistics
from typing import Callable, Iterable, TypeVar

T = TypeVar("T")
SUMMED = ("completed", "failed", "output_tokens", "duration_s")  # totals over all rounds (counts and time), not medians


def round_order(plan: list[T], rounds: int) -> list[tuple[int, T]]:
    """[(round, item)]: the plan forward in even rounds, reversed in odd ones.

    Raises:
        ValueError: rounds < 1.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    return [(r, item) for r in range(rounds) for item in (plan if r % 2 == 0 else plan[::-1])]


def combine(per_round: list[list[dict]]) -> list[dict]:
    """One system's level rows from several rounds -> one row per level: the median of each number over the rounds
    that ran the level (SUMMED's totals summed), `rounds` the number of them, and the rounds' errors together.

    per_round: [[row per level] per round]; a row has `concurrency`, numbers from bench/metrics.summarize and
    optionally `errors` (list of str).
    """
    by_level: dict[int, list[dict]] = {}
    for rows in per_round:
        for row in rows:
            by_level.setdefault(row["concurrency"], []).append(row)
    out = []
    for conc, rows in by_level.items():
        row: dict = {"concurrency": conc, "rounds": len(rows)}
        for key in rows[0]:
            if key in ("concurrency", "errors"):
                continue
            values = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and r[key] == r[key]]
            if key in SUMMED:
                row[key] = sum(values)
            elif values:
                row[key] = statistics.median(values)
            else:
                row[key] = float("nan")
        errors = sorted({e for r in rows for e in r.get("errors", [])})
        if errors:
            row["errors"] = errors[:5]
        out.append(row)
    return out


def head_to_head(systems: dict[str, list[dict]], is_ours: Callable[[str], bool],
                 baselines: Iterable[str] = ("naive",)) -> dict[str, dict[int, dict]]:
    """Each of our systems against the better peer at each concurrency level, by output tok/s.

    systems: {name: [level rows]}; a peer is any system that is neither ours nor a baseline (the naive server is a
    floor, not a peer). Returns {our name: {concurrency: {"peer": name, "ratio": our tok/s / the peer's,
    "ttft_p99_ratio", "itl_p99_ratio": ours over that peer's (below 1 is better)}}}; levels no peer ran are left out.
    """
    baselines = set(baselines)
    best: dict[int, tuple[str, dict]] = {}
    for name, rows in systems.items():
        if is_ours(name) or name in baselines:
            continue
        for row in rows:
            if row.get("completed") and (row["concurrency"] not in best or
                                         row["output_tok_s"] > best[row["concurrency"]][1]["output_tok_s"]):
                best[row["concurrency"]] = (name, row)
    out: dict[str, dict[int, dict]] = {}
    for name, rows in systems.items():
        if not is_ours(name):
            continue
        for row in rows:
            if row["concurrency"] not in best or not row.get("completed"):
                continue
            peer, theirs = best[row["concurrency"]]
            out.setdefault(name, {})[row["concurrency"]] = {
                "peer": peer, "ratio": row["output_tok_s"] / theirs["output_tok_s"],
                "ttft_p99_ratio": _ratio(row.get("ttft_ms_p99"), theirs.get("ttft_ms_p99")),
                "itl_p99_ratio": _ratio(row.get("itl_ms_p99"), theirs.get("itl_ms_p99"))}
    return out


def _ratio(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b and a == a and b == b else float("nan")
