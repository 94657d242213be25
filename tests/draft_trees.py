"""Helpers for tests of proposers that return trees of drafts (parents before children)."""
from __future__ import annotations


def branches(drafts: list[int], parents: list[int]) -> list[list[int]]:
    """Every root-to-leaf token sequence of a tree, in the order its nodes come."""
    kids = {i: [j for j, p in enumerate(parents) if p == i] for i in range(-1, len(drafts))}

    def walk(node, prefix):
        if not kids[node]:
            return [prefix]
        return [b for c in kids[node] for b in walk(c, prefix + [drafts[c]])]
    return walk(-1, [])
