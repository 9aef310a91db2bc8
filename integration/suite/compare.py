#!/usr/bin/env python3
"""Compares two replay suites (integration/suite/run.sh) side by side.

Usage: integration/suite/compare.py BEFORE AFTER

Per configuration, kvroute's medians over the seeds both suites ran: share
of the pooled-cache bound, TTFT p50 / p90 / p99 (ms), max pod share (x fair,
the worst seed) and, in the mixed pool, the fast pods' share of the prefill.
Per trace and load, the same beside the better baseline's p50 / p99. Rows
that changed are marked *. Only kvroute's figures are compared; the
baselines do not depend on kvroute's code.
"""
import json
import statistics
import sys
from pathlib import Path


def seeds(suite):
    return {p.name for p in Path(suite).glob("s*") if p.is_dir()}


def workload_row(run_dir):
    results = json.loads((run_dir / "results.json").read_text())
    kvroute = next(p for p in results["policies"] if p["policy"] == "kvroute")
    pods = results["pods"]["count"]
    row = {
        "bound %": 100 * kvroute["hitRate"] / results["bounds"]["pooledCache"],
        "p50": kvroute["ttftP50Ms"],
        "p90": kvroute["ttftP90Ms"],
        "p99": kvroute["ttftP99Ms"],
        "share x": kvroute["maxPodShare"] * pods,
    }
    speeds = results["pods"].get("prefillSpeeds", [])
    speeds = speeds + [1.0] * (pods - len(speeds))
    if max(speeds) > min(speeds):
        row["fast %"] = 100 * sum(s for s, v in zip(kvroute["prefillShares"], speeds) if v == max(speeds))
    return row


def sweep_rows(run_dir):
    sweep = json.loads((run_dir / "load-sweep.json").read_text())
    rows = {}
    for load in sorted({p["load"] for p in sweep["points"]}):
        points = [p for p in sweep["points"] if p["load"] == load]
        kvroute = next(p for p in points if p["policy"] == "kvroute")
        others = [p for p in points if p["policy"] != "kvroute"]
        rows[f"{load:.2f}x"] = {
            "bound %": 100 * kvroute["ofPooledBound"],
            "p50": kvroute["ttftP50Ms"] / 1000,
            "p90": kvroute["ttftP90Ms"] / 1000,
            "p99": kvroute["ttftP99Ms"] / 1000,
            "best other p50": min((p["ttftP50Ms"] for p in others), default=float("nan")) / 1000,
            "best other p99": min((p["ttftP99Ms"] for p in others), default=float("nan")) / 1000,
        }
    return rows


def medians(rows):
    """Median per figure over seeds; the worst seed for max pod share."""
    keys = dict.fromkeys(k for row in rows for k in row)
    return {k: (max if k == "share x" else statistics.median)(r[k] for r in rows if k in r) for k in keys}


def digits(figure):
    return 2 if figure == "share x" else 1


def text(value, figure):
    return "–" if value is None else f"{value:.{digits(figure)}f}"


def cell(before, after, figure):
    b, a = text(before, figure), text(after, figure)
    return b if b == a else f"{b} → {a}"


def table(title, names, before, after):
    figures = list(dict.fromkeys(k for rows in (before, after) for row in rows.values() for k in row))
    lines = [f"### {title}", "", "| | " + " | ".join(figures) + " |", "|---" * (len(figures) + 1) + "|"]
    for name in names:
        b, a = before[name], after[name]
        cells = [cell(b.get(k), a.get(k), k) for k in figures]
        changed = any("→" in c for c in cells)
        lines.append(f"| {name}{' *' if changed else ''} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    before_dir, after_dir = (Path(a) for a in sys.argv[1:])
    common = sorted(seeds(before_dir) & seeds(after_dir))
    if not common:
        sys.exit("compare.py: the two suites share no seed folder (s1, s2, ...)")
    # The configurations every seed of both suites ran.
    ran = [{p.name for p in (d / s).iterdir() if (p / "results.json").exists()} for d in (before_dir, after_dir) for s in common]
    configs = sorted(set.intersection(*ran))
    out = [f"Seeds {', '.join(s[1:] for s in common)}; BEFORE → AFTER where they differ.\n"]
    summary = {}
    for suite in (before_dir, after_dir):
        summary[suite] = {c: medians([workload_row(suite / s / c) for s in common]) for c in configs}
    out.append(table("Benchmark workloads (TTFT in ms)", configs, summary[before_dir], summary[after_dir]))
    for trace in ("mooncake", "azure"):
        if not all((d / s / trace / "load-sweep.json").exists() for d in (before_dir, after_dir) for s in common):
            continue
        per_suite = {}
        for suite in (before_dir, after_dir):
            runs = [sweep_rows(suite / s / trace) for s in common]
            per_suite[suite] = {load: medians([r[load] for r in runs]) for load in runs[0]}
        loads = list(per_suite[before_dir])
        out.append(table(f"{trace} trace, 4 pods, load × cache-blind capacity (TTFT in s)", loads,
                         per_suite[before_dir], per_suite[after_dir]))
    print("\n".join(out))


if __name__ == "__main__":
    main()
