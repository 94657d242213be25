"""Draw one draft tree and the branch the target accepted (docs/draft_tree.png).

Runs a real target with its draft model proposing trees (default: the default model and its
shipped draft; ``--model`` / ``--draft-model`` for others), records every step's tree and the
accepted path, and draws the step whose accepted branch is the deepest among those not on the
tree's first branch (ties: the larger tree). Nodes show the drafted token and its cumulative
draft probability rank; the accepted branch is drawn in bold, the target's own next token after
it in a box.

    python benchmarks/draft_tree_figure.py --out docs/draft_tree.png
"""
from __future__ import annotations

import argparse

import torch

from specserve import LLM, SamplingParams

PROMPT = "Write a Python function that returns the n-th Fibonacci number iteratively."


def record_trees(llm: LLM):
    """Wrap the engine so every verified tree step is kept: (tokens, parents, path, emitted)."""
    engine, steps = llm.engine, []
    real_propose, real_verify = engine.proposer.propose, engine.verifier.verify_isolated

    def propose(scheduled):
        proposal = real_propose(scheduled)
        for s, tokens, parents in zip(scheduled, proposal.token_ids, proposal.parents or []):
            s.request._tree_for_figure = (list(tokens), list(parents or []))
        return proposal

    def verify(reqs, logits):
        out = real_verify(reqs, logits)
        for r in reqs:
            tree, v = getattr(r, "_tree_for_figure", None), out.get(r.request_id)
            if tree is not None and not isinstance(v, BaseException) and v.tree_path is not None:
                steps.append((*tree, list(v.tree_path), list(v.token_ids)))
        return out

    engine.proposer.propose, engine.verifier.verify_isolated = propose, verify
    return steps


def pick_step(steps):
    def first_branch(parents):
        node, branch = -1, []
        while True:
            kids = [i for i, p in enumerate(parents) if p == node]
            if not kids:
                return branch
            node = kids[0]
            branch.append(node)
    off_first = [s for s in steps if s[2] and s[2] != first_branch(s[1])[: len(s[2])]]
    pool = off_first or steps
    return max(pool, key=lambda s: (len(s[2]), len(s[0])))


def draw(step, tokenizer, out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens, parents, path, emitted = step
    kids = {i: [j for j, p in enumerate(parents) if p == i] for i in range(-1, len(tokens))}
    y: dict[int, float] = {}
    leaves = [0]

    def place(node):        # leaves top to bottom in drafting order, parents centred on their children
        if not kids[node]:
            y[node] = leaves[0]
            leaves[0] += 1
            return
        for c in kids[node]:
            place(c)
        y[node] = sum(y[c] for c in kids[node]) / len(kids[node])
    place(-1)
    depth = {-1: 0}
    for i, p in enumerate(parents):
        depth[i] = depth[p] + 1
    on_path = set(path) | {-1}
    fig, ax = plt.subplots(figsize=(2.2 * (max(depth.values()) + 2), 0.42 * max(leaves[0], 4) + 1.2))
    for i, p in enumerate(parents):
        bold = i in on_path and p in on_path
        ax.plot([depth[p], depth[i]], [y[p], y[i]], color="tab:green" if bold else "0.75", lw=2.5 if bold else 1,
                zorder=1)
    text = {i: repr(tokenizer.decode([t]))[1:-1] or "∅" for i, t in enumerate(tokens)}
    text[-1] = "last token"
    for node, (dx, dy) in ((n, (depth[n], y[n])) for n in depth):
        accepted = node in on_path
        ax.text(dx, dy, text[node], ha="center", va="center", fontsize=9, zorder=2,
                fontweight="bold" if accepted else "normal",
                bbox=dict(boxstyle="round,pad=0.25", fc="#d9f2d9" if accepted else "white",
                          ec="tab:green" if accepted else "0.6"))
    last = path[-1] if path else -1
    ax.annotate(f"target: {repr(tokenizer.decode([emitted[-1]]))[1:-1]}", xy=(depth[last] + 0.45, y[last]),
                xytext=(depth[last] + 0.9, y[last]), fontsize=9, va="center",
                arrowprops=dict(arrowstyle="<-", color="tab:green"),
                bbox=dict(boxstyle="square,pad=0.25", fc="white", ec="tab:green"))
    ax.set_xlim(-0.6, max(depth.values()) + 1.8)
    ax.set_ylim(leaves[0] - 0.4, -0.6)
    ax.set_xticks(range(max(depth.values()) + 1), ["root"] + [f"depth {d}" for d in range(1, max(depth.values()) + 1)])
    ax.set_yticks([])
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}: {len(tokens)} drafts, {len(path)} accepted")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft-model", default=None, help="default: the target's shipped draft")
    ap.add_argument("--tree", default="4/16", help="TOP_K/MAX_NODES[/MAX_DEPTH] (SpeculativeConfig.tree)")
    ap.add_argument("--k", type=int, default=5, help="tree depth (num_speculative_tokens)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default="docs/draft_tree.png")
    args = ap.parse_args()
    torch.manual_seed(0)
    spec = {"method": "draft_model", "num_speculative_tokens": args.k, "tree": args.tree}
    if args.draft_model:
        spec["model"] = args.draft_model
    llm = LLM(model=args.model, speculative_config=spec)
    steps = record_trees(llm)
    prompt = llm.apply_chat_template([{"role": "user", "content": PROMPT}])
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=args.max_tokens), use_tqdm=False)
    step = pick_step(steps)
    name = args.model or "the default model"
    draw(step, llm.engine.tokenizer, args.out,
         f"One draft tree ({name}, draft tree {args.tree}, greedy): the accepted branch in green")


if __name__ == "__main__":
    main()
