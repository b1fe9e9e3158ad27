#!/usr/bin/env python3
"""MoE load balance of a training run, per layer, from its metrics.jsonl.

  scripts/load_balance.py [--after STEP|warmup] [--threshold 1.5] RUN...

RUN is a run directory (holding metrics.jsonl) or the file itself. For every MoE layer it prints the
mean and the worst of the per-step max/mean load (`moe_max_over_mean`; 1 = balanced) over the steps
after STEP (default: the last quarter of the run; `warmup`: each run's own optimizer.warmup_steps,
from the config.yaml the trainer wrote beside its metrics), then the worst layer's per-step value
averaged and at its maximum, and how many steps have a layer over --threshold. Exits 1 when the worst layer's
average is at or above --threshold. Optional tooling: the engine does not need Python.
"""
import argparse
import json
import os
import re
import sys


def rows(path):
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    with open(path) as f:
        try:
            return [json.loads(line) for line in f if line.strip()]
        except json.JSONDecodeError as e:
            sys.exit(f"{path}: not a metrics.jsonl file ({e})")


def run_warmup(path):
    """optimizer.warmup_steps from the resolved config.yaml of the run that wrote `path`."""
    run_dir = path if os.path.isdir(path) else os.path.dirname(path)
    cfg = os.path.join(run_dir, "config.yaml")
    try:
        with open(cfg) as f:
            m = re.search(r"^\s*warmup_steps:\s*(\d+)", f.read(), re.M)
    except OSError as e:
        sys.exit(f"{path}: --after warmup needs the run's config.yaml ({e})")
    if not m:
        sys.exit(f"{cfg}: no optimizer.warmup_steps")
    return int(m.group(1))


def after_arg(v):
    if v == "warmup":
        return v
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a step number or 'warmup', got '{v}'")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--after", type=after_arg, default=None,
                   help="last step left out, or 'warmup' (default: the first three quarters)")
    p.add_argument("--threshold", type=float, default=1.5)
    p.add_argument("runs", nargs="+")
    args = p.parse_args()
    rc = 0
    for run in args.runs:
        data = [r for r in rows(run) if r.get("moe_max_over_mean")]
        if not data:
            print(f"{run}: no MoE load statistics")
            rc = 1
            continue
        last = max(int(r["step"]) for r in data)
        if args.after == "warmup":
            after = run_warmup(run)
        else:
            after = args.after if args.after is not None else last - last // 4
        tail = [r["moe_max_over_mean"] for r in data if int(r["step"]) > after]
        if not tail:
            print(f"{run}: no steps after {after}")
            rc = 1
            continue
        layers = list(zip(*tail))
        per_layer = " ".join(f"{sum(v) / len(v):.3f}/{max(v):.2f}" for v in layers)
        worst = [max(step) for step in tail]
        avg = sum(worst) / len(worst)
        print(f"{run}: steps {after + 1}-{last}, per MoE layer mean/max: {per_layer}")
        over = sum(w > args.threshold for w in worst)
        # The verdict is on the average; the maximum and the count of steps over say how it is reached.
        print(f"{run}: worst layer per step: mean {avg:.3f} "
              f"({'under' if avg < args.threshold else 'NOT under'} {args.threshold}), max {max(worst):.3f}; "
              f"{over} of {len(worst)} steps have a layer over {args.threshold}")
        if avg >= args.threshold:
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
