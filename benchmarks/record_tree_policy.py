"""Record what a dynamic draft tree's policy measures: run ``specserve bench`` with every step the
tree-size policy credits (its shape, the tokens each request emitted, the step's seconds) written to
a JSON file, for replaying the policy against fixed shapes on real step times
(tests/spec_decode/test_tree_policy.py reads such a recording).

    python benchmarks/record_tree_policy.py --out steps.json -- draft-trees \\
        --configs plain,draft:3,draft:5:tree=2/8/dynamic --temperature 0 --threads 2 --max-tokens 192

Everything after ``--`` is ``specserve bench``'s command line; the recording holds the steps of
every dynamic configuration it runs, in order, the bench's table, and each group's acceptance per
configuration from the bench's results file. ``--shapes chain:3`` holds every dynamic tree to the
listed shapes (what its machinery costs against the fixed proposer, without its choices).
"""
from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import sys
import tempfile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--results", help="keep the bench's results file in this folder (default: not kept)")
    parser.add_argument("--shapes", help="comma-separated shapes (chain:K, tree:TOP_K/NODES/DEPTH) every dynamic "
                                         "tree is held to, instead of its candidates")
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="-- then specserve bench's arguments")
    args = parser.parse_args()
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench

    from specserve.entrypoints.cli import main as cli_main
    from specserve.spec_decode import draft_tree, tree_policy

    if args.shapes:
        held = [_shape(text, tree_policy.TreeShape) for text in args.shapes.split(",")]
        draft_tree.candidate_shapes = lambda top_k, max_nodes, max_depth: list(held)

    steps: list[dict] = []
    record = tree_policy.TreeSizePolicy._record

    def recording(self, bucket, shape, deltas, budgets, seconds):
        record(self, bucket, shape, deltas, budgets, seconds)
        steps.append({"batch_bucket": bucket, "shape": str(shape), "tokens": list(deltas),
                      "seconds": round(seconds, 5)})

    tree_policy.TreeSizePolicy._record = recording
    with tempfile.TemporaryDirectory() as scratch:
        results = args.results or scratch
        sys.argv = ["specserve", "bench", *bench, "--results", results]
        cli_main()
        files = sorted(glob.glob(os.path.join(results, "*", "*.json.gz")), key=os.path.getmtime)
        run = json.load(gzip.open(files[-1])) if files else {}
    acceptance = [{"category": r["category"], "config": r["config"],
                   "acceptance_rate": (r.get("spec_decode") or {}).get("acceptance_rate")}
                  for r in run.get("samples", {}).get("results", [])]
    with open(args.out, "w") as f:
        json.dump({"command": "specserve bench " + " ".join(bench), "shapes": args.shapes,
                   "machine": run.get("machine"), "commit": run.get("commit"), "table": run.get("table"),
                   "acceptance": acceptance, "steps": steps}, f)
    print(f"wrote {len(steps)} steps to {args.out}")


def _shape(text: str, shape_type):
    """chain:K or tree:TOP_K/NODES/DEPTH (how the policy prints a shape) -> a TreeShape."""
    kind, _, spec = text.partition(":")
    if kind == "chain":
        return shape_type(1, int(spec), int(spec))
    top_k, nodes, depth = (int(v) for v in spec.split("/"))
    return shape_type(top_k, nodes, depth)


if __name__ == "__main__":
    main()
