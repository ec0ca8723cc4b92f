"""One simulated forward -> the runtime's `BatchDescription` (the adapter skeleton's forward view, docs/design.md).

A plan is the step's running requests in batch order, each ``(request, tokens computed now, full-group slots written,
swa-group slots written)``; the request's ``row``, ``num_computed``, ``tokens`` (committed), ``drafts`` (speculative
decoding) and ``context`` say the rest. The forward kind comes from the shared rule (`classify_forward`).
"""
from __future__ import annotations

from typing import Optional

import torch

from kvcanary.runtime import BatchDescription, GroupBatch, classify_forward


def describe(plan, *, table, full_to_swa: Optional[torch.Tensor], contexts: bool) -> BatchDescription:
    """The `BatchDescription` of ``plan`` (see the module docstring). ``table``: the engine's `RequestTable`
    (``req_to_token`` and ``tokens``, shared by both groups); ``full_to_swa``: the full -> swa slot LUT when the
    model has a sliding-window group, else None; ``contexts``: give every row's context key (once any was used)."""
    reqs = [p[0] for p in plan]
    ext = [p[1] for p in plan]
    pre = [r.num_computed for r in reqs]
    ids = [t for r, e in zip(reqs, ext) for t in (r.tokens + r.drafts)[r.num_computed : r.num_computed + e]]
    pos = [q for r, e in zip(reqs, ext) for q in range(r.num_computed, r.num_computed + e)]
    spec = any(r.drafts for r in reqs)
    groups = {"full": GroupBatch(req_to_token=table.req_to_token,
                                 out_cache_loc=torch.tensor([s for p in plan for s in p[2]], dtype=torch.int64))}
    if full_to_swa is not None:
        groups["swa"] = GroupBatch(
            req_to_token=table.req_to_token,
            out_cache_loc=torch.tensor([s for p in plan for s in p[3]], dtype=torch.int64),
            full_to_group_lut=full_to_swa,
        )
    return BatchDescription(
        req_pool_indices=torch.tensor([r.row for r in reqs], dtype=torch.int64),
        prefix_lens=torch.tensor(pre, dtype=torch.int64),
        extend_lens=torch.tensor(ext, dtype=torch.int64),
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(pos, dtype=torch.int64),
        groups=groups,
        request_ids=tuple(r.rid for r in reqs),
        token_table=table.tokens,
        token_table_lens=torch.tensor([len(r.tokens) + len(r.drafts) for r in reqs], dtype=torch.int64),
        committed_lens=torch.tensor([len(r.tokens) for r in reqs], dtype=torch.int64) if spec else None,
        forward_kind=classify_forward(pre, ext, [bool(r.drafts) for r in reqs]),
        context_keys=torch.tensor([r.context for r in reqs], dtype=torch.int64) if contexts else None,
    )
