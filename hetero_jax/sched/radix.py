"""A radix tree over token ids: the longest-prefix-match (LPM) baseline Feather compares with.

In: `insert(tokens)` and `remove(tokens)` of the sequences the tree holds (reference counted,
so two requests with one prompt are two references), `match(tokens)`, the length of the
longest prefix of `tokens` that some held sequence starts with. SGLang's LPM policy orders
its waiting queue by that length (longest first), matching every waiting request against the
tree each time it schedules, and falls back to arrival order beyond 128 waiting requests
because of that cost (`LPM_FALLBACK`). Edges hold runs of tokens (a compressed trie); a
node's children are keyed by the first token of their edge. Plain Python; imports no jax.
"""
from __future__ import annotations

LPM_FALLBACK = 128  # SGLang: waiting queues longer than this are served in arrival order


class _Node:
    __slots__ = ("children", "refs")

    def __init__(self):
        self.children: dict = {}  # first token -> (edge tuple, child)
        self.refs = 0  # held sequences that pass through (or end at) this node


class RadixTree:
    def __init__(self):
        self.root = _Node()

    def insert(self, tokens) -> None:
        node, tokens = self.root, tuple(tokens)
        node.refs += 1
        i = 0
        while i < len(tokens):
            entry = node.children.get(tokens[i])
            if entry is None:
                child = _Node()
                node.children[tokens[i]] = (tokens[i:], child)
                child.refs += 1
                return
            edge, child = entry
            n = _lcp(edge, tokens, i)
            if n < len(edge):  # split the edge at n
                mid = _Node()
                mid.refs = child.refs
                mid.children[edge[n]] = (edge[n:], child)
                node.children[tokens[i]] = (edge[:n], mid)
                child = mid
            child.refs += 1
            node, i = child, i + n

    def remove(self, tokens) -> None:
        """Drop one reference to `tokens` (inserted before); prune edges no one holds."""
        node, tokens = self.root, tuple(tokens)
        node.refs -= 1
        i = 0
        while i < len(tokens):
            edge, child = node.children[tokens[i]]
            assert tokens[i:i + len(edge)] == edge, "removing a sequence that was not inserted"
            child.refs -= 1
            if child.refs == 0:
                del node.children[tokens[i]]
                return
            node, i = child, i + len(edge)

    def match(self, tokens) -> int:
        """Length of the longest prefix of `tokens` held in the tree."""
        node, i = self.root, 0
        while i < len(tokens):
            entry = node.children.get(tokens[i])
            if entry is None:
                return i
            edge, child = entry
            n = _lcp(edge, tokens, i)
            i += n
            if n < len(edge):
                return i
            node = child
        return i


def _lcp(edge: tuple, tokens, start: int) -> int:
    """How many leading tokens of `edge` equal `tokens[start:]`."""
    n = min(len(edge), len(tokens) - start)
    for j in range(n):
        if edge[j] != tokens[start + j]:
            return j
    return n
