"""Reporting helpers of the experiment scripts. docs/compression.md is written by several of them: each
replaces its own sections ("## E2: ..." up to the next "## "), so any one can be rerun without the
others."""
from __future__ import annotations

import statistics
from pathlib import Path


def _split(text: str) -> tuple[list[str], list[list[str]]]:
    preamble, sections = [], []
    for line in text.splitlines():
        if line.startswith("## "):
            sections.append([line])
        elif sections:
            sections[-1].append(line)
        else:
            preamble.append(line)
    return preamble, sections


def _key(heading: str) -> str:
    """'## E2: independent ...' -> 'E2'."""
    return heading[3:].split(":", 1)[0].strip()


def update_sections(path: Path, lines: list[str], preamble: bool = False) -> None:
    """Put the sections in `lines` into the file at `path`, replacing sections with the same key and
    appending new ones; with preamble=True, `lines`' text before its first section replaces the file's."""
    path = Path(path)
    old_pre, old = _split(path.read_text()) if path.exists() else ([], [])
    new_pre, new = _split("\n".join(lines))
    fresh = {_key(s[0]): s for s in new}
    merged = [fresh.pop(_key(s[0]), s) for s in old]
    merged += [s for s in new if _key(s[0]) in fresh]
    pre = new_pre if preamble or not old_pre else old_pre
    body = [_strip(pre)] + [_strip(s) for s in merged]
    path.write_text("\n\n".join(part for part in body if part) + "\n")


def _strip(block: list[str]) -> str:
    return "\n".join(block).strip("\n")


def json_safe(obj):
    """JSON without Infinity/NaN (not JSON): None instead (e.g. a break-even that never comes)."""
    if isinstance(obj, float) and (obj != obj or obj in (float("inf"), float("-inf"))):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def steps_text(v: float) -> str:
    """A number of steps, or "never" for infinity."""
    return "never" if v == float("inf") else f"{v:.0f}"


def spread(values, digits: int, suffix: str = "") -> str:
    """The median of `values` with (min-max) when they differ at the digits shown: how a table cell
    gives results over seeds."""
    v = sorted(values)
    low, high = f"{v[0]:.{digits}f}", f"{v[-1]:.{digits}f}"
    med = f"{float(statistics.median(v)):.{digits}f}{suffix}"
    return med if low == high else f"{med} ({low}-{high})"


def cheapest_level(candidates: dict):
    """The best fixed level in hindsight: candidates[level] = [(steps to the target or None, bits to it)
    per seed]; the level whose runs all reach the target with the fewest bits on average (the first
    listed on ties), and its runs; (None, None) if no level reaches it in every run."""
    reached = {level: runs for level, runs in candidates.items() if all(s is not None for s, _ in runs)}
    if not reached:
        return None, None
    best = min(reached, key=lambda level: statistics.fmean(b for _, b in reached[level]))
    return best, reached[best]
