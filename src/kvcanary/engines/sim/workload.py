"""Seeded request streams for the simulated engine: shared system prompts (prefix sharing),
random suffixes, mixed prompt and output lengths, random aborts."""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class SimWorkload:
    """arrival_prob: chance per step that one request arrives (two when it hits twice).
    shared_prefixes: distinct system prompts; share_prob: chance a prompt starts with one.
    abort_prob: chance per step that one running request is aborted."""

    seed: int = 0
    vocab: int = 32000
    shared_prefixes: int = 3
    shared_prefix_len: tuple[int, int] = (8, 40)
    share_prob: float = 0.7
    prompt_len: tuple[int, int] = (1, 60)
    new_tokens: tuple[int, int] = (1, 40)
    arrival_prob: float = 0.6
    abort_prob: float = 0.02

    def stream(self, max_context: int):
        """Yields, per step, a list of (prompt tokens, max new tokens)."""
        rng = random.Random(self.seed)
        prefixes = [
            [rng.randrange(1, self.vocab) for _ in range(rng.randint(*self.shared_prefix_len))]
            for _ in range(self.shared_prefixes)
        ]
        while True:
            arrivals = []
            for _ in range(2):
                if rng.random() < self.arrival_prob:
                    prompt = list(rng.choice(prefixes)) if rng.random() < self.share_prob else []
                    prompt += [rng.randrange(1, self.vocab) for _ in range(rng.randint(*self.prompt_len))]
                    new = rng.randint(*self.new_tokens)
                    prompt = prompt[: max_context - new - 1]
                    arrivals.append((prompt, new))
            yield arrivals
