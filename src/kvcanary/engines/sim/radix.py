"""A block-granular prefix cache: a trie whose edges are blocks of ``block_size`` tokens.

Each node owns the full slots (and sliding-window slots, 0 once dropped) of its block. Nodes are
locked while a running request uses them; unlocked leaves are evicted least recently used first.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(eq=False)
class RadixNode:
    key: tuple[int, ...]
    full_slots: list[int]
    swa_slots: list[int]
    parent: Optional["RadixNode"]
    children: dict = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0


class RadixCache:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.root = RadixNode(key=(), full_slots=[], swa_slots=[], parent=None)
        self._clock = 0

    def _blocks(self, tokens: list[int], n_blocks: int) -> list[tuple[int, ...]]:
        b = self.block_size
        return [tuple(tokens[i * b : (i + 1) * b]) for i in range(n_blocks)]

    def match(self, tokens: list[int], max_tokens: int) -> list[RadixNode]:
        """Nodes of the longest cached block prefix of ``tokens`` covering at most ``max_tokens``."""
        self._clock += 1
        path, node = [], self.root
        for key in self._blocks(tokens, max_tokens // self.block_size):
            node = node.children.get(key)
            if node is None:
                break
            node.last_access = self._clock
            path.append(node)
        return path

    @staticmethod
    def lock(path: list[RadixNode], delta: int) -> None:
        for node in path:
            node.lock_ref += delta

    def insert(self, tokens: list[int], full_slots: list[int], swa_slots: list[int], n_blocks: int,
               path: list[RadixNode]) -> tuple[list[int], list[int]]:
        """Insert blocks ``len(path) .. n_blocks`` of a finished request below ``path``; returns the
        request's (full, swa) slots that duplicate blocks already cached (to be freed)."""
        self._clock += 1
        node = path[-1] if path else self.root
        dup_full: list[int] = []
        dup_swa: list[int] = []
        b = self.block_size
        for i, key in enumerate(self._blocks(tokens, n_blocks)):
            if i < len(path):
                continue
            lo, hi = i * b, (i + 1) * b
            child = node.children.get(key)
            if child is None:
                child = RadixNode(key=key, full_slots=full_slots[lo:hi], swa_slots=swa_slots[lo:hi], parent=node)
                node.children[key] = child
            else:
                dup_full += full_slots[lo:hi]
                dup_swa += [s for s in swa_slots[lo:hi] if s]
            child.last_access = self._clock
            node = child
        return dup_full, dup_swa

    def evict(self, needed: int) -> list[RadixNode]:
        """Detach unlocked leaves, least recently used first, until they hold ``needed`` full slots."""
        evicted, freed = [], 0
        while freed < needed:
            leaves = [n for n in self.nodes() if not n.children and n.lock_ref == 0]
            if not leaves:
                break
            victim = min(leaves, key=lambda n: n.last_access)
            del victim.parent.children[victim.key]
            evicted.append(victim)
            freed += len(victim.full_slots)
        return evicted

    def nodes(self) -> list[RadixNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out
