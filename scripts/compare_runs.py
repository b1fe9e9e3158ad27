#!/usr/bin/env python3
"""Compares training loss curves of several runs with the first (the baseline), step by step.

  scripts/compare_runs.py [--tolerance 0.01] [--window 10] BASE_RUN RUN...

Each run is a run directory (holding metrics.jsonl) or a metrics.jsonl file. For every other run it
prints the largest relative deviation |loss - base| / base over all steps, the same after a centred
moving average of --window steps (the per-step noise of two runs that round differently), the steps
whose own deviation exceeds --tolerance, and the final losses. Exits 1 when a smoothed deviation
exceeds --tolerance. Optional tooling: the engine does not need Python.
"""
import argparse
import json
import os
import sys


def losses(path):
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    out = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                if row.get("loss") is not None:
                    out[int(row["step"])] = float(row["loss"])
    return out


def smooth(values, window):
    half = window // 2
    return [sum(values[max(0, i - half):i + half + 1]) / len(values[max(0, i - half):i + half + 1])
            for i in range(len(values))]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tolerance", type=float, default=0.01)
    p.add_argument("--window", type=int, default=10)
    p.add_argument("runs", nargs="+")
    a = p.parse_args()
    base = losses(a.runs[0])
    ok = True
    for run in a.runs[1:]:
        other = losses(run)
        steps = sorted(set(base) & set(other))
        if not steps:
            print(f"{run}: no steps in common with {a.runs[0]}")
            ok = False
            continue
        b = [base[s] for s in steps]
        o = [other[s] for s in steps]
        raw = max(abs(x - y) / y for x, y in zip(o, b))
        over = [s for s, x, y in zip(steps, o, b) if abs(x - y) / y > a.tolerance]
        sb, so = smooth(b, a.window), smooth(o, a.window)
        devs = [abs(x - y) / y for x, y in zip(so, sb)]
        worst = max(range(len(devs)), key=devs.__getitem__)
        verdict = "ok" if devs[worst] <= a.tolerance else "EXCEEDS"
        ok = ok and devs[worst] <= a.tolerance
        print(f"parity {os.path.basename(run.rstrip('/'))} vs {os.path.basename(a.runs[0].rstrip('/'))}: "
              f"{len(steps)} steps, max relative deviation {raw:.4f} per step, {devs[worst]:.4f} smoothed over "
              f"{a.window} (at step {steps[worst]}), final loss {o[-1]:.4f} vs {b[-1]:.4f}: {verdict} "
              f"(tolerance {a.tolerance}); {len(over)} single steps beyond it"
              + (f" (steps {', '.join(map(str, over[:8]))}{', ...' if len(over) > 8 else ''})" if over else ""))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
