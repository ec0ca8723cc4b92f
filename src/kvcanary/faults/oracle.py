"""The token oracle: a sampler that ignores logits and emits a token fixed in advance by
(request id, position), so the tokens an engine *should* write are known before it runs and the
write-input assert (`BatchDescription.expected_input_ids`) checks every written token end to end.

`oracle_token(rid, position, vocab)`: ``1 + blake2b(rid, position) mod (vocab - 1)`` (never token 0).
`TokenOracle` remembers each request's prompt and answers the expected input id of any position.
On transformers continuous batching the same oracle is the engine's sampler: `kvcanary.faults.tf_oracle`.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Optional, Sequence

import torch

from kvcanary.errors import KvCanaryValueError


def oracle_token(rid: str, position: int, vocab: int) -> int:
    """The token the oracle samples for request ``rid`` at sequence position ``position`` (int in [1, vocab))."""
    if vocab < 2:
        raise KvCanaryValueError(f"kv-canary: oracle vocab must be >= 2, got {vocab}")
    digest = hashlib.blake2b(f"{rid}\x00{position}".encode(), digest_size=8).digest()
    return 1 + int.from_bytes(digest, "little") % (vocab - 1)


class TokenOracle:
    """Prompts by request id + `oracle_token` for generated positions.

    ``sample(rid, position)`` is the engine-side sampler; ``expected_ids(rids, positions_per_row)``
    builds the int64 ``expected_input_ids`` of a batch (the prompt token inside the prompt, the
    oracle's token after it)."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.prompts: dict[str, tuple[int, ...]] = {}

    def register(self, rid: str, prompt: Sequence[int]) -> None:
        self.prompts[rid] = tuple(int(t) for t in prompt)

    def sample(self, rid: str, position: int) -> int:
        return oracle_token(rid, position, self.vocab)

    def expected(self, rid: str, position: int) -> int:
        prompt = self.prompts.get(rid)
        if prompt is None:
            raise KeyError(f"kv-canary: token oracle has no prompt for request {rid!r}")
        return prompt[position] if position < len(prompt) else self.sample(rid, position)

    def expected_ids(self, request_ids: Sequence[Optional[str]], prefix_lens: torch.Tensor,
                     extend_lens: torch.Tensor, *, committed_lens: Optional[torch.Tensor] = None,
                     input_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """int64 [sum(extend_lens)]: the oracle's token for each row's positions ``prefix + i`` (the
        positions the engine should be writing, whatever it wrote); padding rows keep -1. With ``committed_lens``
        (a verify forward), positions at or past a row's committed length are drafts the oracle cannot judge: they
        expect what the engine wrote (``input_ids``)."""
        out = torch.full((int(extend_lens.sum()),), -1, dtype=torch.int64)
        committed = committed_lens.tolist() if committed_lens is not None else [None] * len(request_ids)
        start = 0
        for rid, p, n, c in zip(request_ids, prefix_lens.tolist(), extend_lens.tolist(), committed):
            if rid is not None:
                out[start : start + n] = torch.tensor([self.expected(rid, p + i) for i in range(n)], dtype=torch.int64)
                if c is not None and p + n > c:
                    first = start + max(0, c - p)
                    out[first : start + n] = input_ids[first : start + n].cpu().to(torch.int64)
            start += n
        return out

    def sim_hook(self):
        """A sim-engine batch hook that sets ``expected_input_ids`` from the oracle (install it last)."""

        def hook(batch):
            exp = self.expected_ids(batch.request_ids, batch.prefix_lens, batch.extend_lens,
                                    committed_lens=batch.committed_lens, input_ids=batch.input_ids)
            return dataclasses.replace(batch, expected_input_ids=exp.to(batch.input_ids.device))

        return hook
