"""Old vs new code on many small tensors, from pairs of result files made in one GPU run each.

Each pair is a ``stateshift bench`` result of the new code and one of the old code (``--small`` rows only)
made on the same machine one after the other; the host differs between runs, so compare within a run.

    python3 benchmarks/small_old_vs_new.py --out benchmarks/results/NAME.json \\
        --pair NEW.json OLD.json [--pair NEW2.json OLD2.json ...] [--old-sha SHA]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from stateshift.bench import plot_ratios


def pair_rows(new: dict[str, Any], old: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per small-tensor case and verb: both codes' GB/s, ratio to the ceiling and ratio to the loop."""
    out = []
    for r in new["rows"]:
        if not r["case"].startswith("small"):
            continue
        o = next(x for x in old["rows"] if x["case"] == r["case"] and x["op"] == r["op"])
        out.append({"case": r["case"], "op": r["op"], "new_gbps": r["gbps"], "new_ratio": r["ratio"], "new_vs_loop": r["vs_loop"],
                    "old_gbps": o["gbps"], "old_ratio": o["ratio"], "old_vs_loop": o["vs_loop"], "loop_gbps": r["loop_gbps"]})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the JSON to write (a PNG of vs-loop ratios beside it)")
    p.add_argument("--pair", nargs=2, action="append", required=True, metavar=("NEW", "OLD"))
    p.add_argument("--old-sha", default=None, help="the old code's commit, where its files name another (a run that set "
                   "STATESHIFT_GIT_SHA for both)")
    args = p.parse_args()
    runs = []
    for new_path, old_path in args.pair:
        new, old = json.loads(Path(new_path).read_text()), json.loads(Path(old_path).read_text())
        runs.append({"new": new["stateshift"], "old": args.old_sha or old["stateshift"], "machine": new["machine"], "host": new.get("host"),
                     "host_memcpy_gbps": new["ceilings"].get("host_memcpy_gbps"), "rows": pair_rows(new, old)})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": runs}, indent=1))
    labels, ratios = [], []
    print(f"{'run':<4} {'case':<13} {'op':<9} {'new x loop':>10} {'old x loop':>10} {'new/ceil':>8} {'old/ceil':>8}")
    for i, run in enumerate(runs):
        for r in run["rows"]:
            print(f"{i:<4} {r['case']:<13} {r['op']:<9} {r['new_vs_loop']:>10.2f} {r['old_vs_loop']:>10.2f} {r['new_ratio']:>8.2f} {r['old_ratio']:>8.2f}")
            for code in ("new", "old"):
                labels.append(f"run {i} {code}\n{r['case'][6:]}\n{r['op']}")
                ratios.append(r[f"{code}_vs_loop"])
    plot_ratios(labels, ratios, "many small tensors, old vs new code", args.out.with_suffix(".png"),
                ylabel="throughput / plain copy_ loop of the same run", target=1.0)


if __name__ == "__main__":
    main()
