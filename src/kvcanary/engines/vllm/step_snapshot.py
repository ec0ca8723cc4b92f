"""`StepSnapshot`: the device inputs of a vLLM forward copied before it runs, so the canary checks it afterwards.

The adapter takes the snapshot in ``bind_connector_metadata`` (before the model runs) and checks the forward in
``wait_for_save``, after vLLM has launched it, so that the canary's host work can overlap the forward on the device
(on a host-bound H100 it made no clear difference: docs/vllm.md). What attention reads and writes is what the snapshot holds — the input ids,
positions, each group's slot mapping and block table (and the V2 runner's device lengths) — copied on the
engine's stream ahead of the forward, so a block-table entry or slot mapping that is wrong only while the forward
runs (restored afterwards, or overwritten by a speculative drafter in between) is still what the canary checks.

The copies land in buffers the snapshot owns: one per input, grown (new address) only when a forward needs more.
A group's block table keeps its address while its width stays: the canary's graphs read it by reference
(`kvcanary.runtime.batch.BlockTable`).
"""
from __future__ import annotations

from types import SimpleNamespace
import torch

from kvcanary.engines.vllm.forward_view import StepInputs, block_table_of
from kvcanary.engines.vllm.layout import GroupLayout


class StepSnapshot:
    """``take(step, num_tokens) -> StepInputs`` whose device tensors are copies owned here (one ``copy_`` each).

    The returned ``attn_metadata`` holds, for each group's first layer, only ``slot_mapping`` (``[num_tokens]``)
    and ``block_table`` (``[rows, width]``): what `WorkerView.describe` reads."""

    def __init__(self, layouts: list[GroupLayout], min_rows: int) -> None:
        self.layouts = list(layouts)
        self.min_rows = int(min_rows)
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, step: StepInputs, num_tokens: int) -> StepInputs:
        n = len(step.req_ids)
        metas = {}
        for g in self.layouts:
            meta = step.attn_metadata[g.layer_names[0]]
            bt = block_table_of(step, g, meta)
            metas[g.layer_names[0]] = SimpleNamespace(
                slot_mapping=self._copy(f"slots/{g.name}", meta.slot_mapping[:num_tokens]),
                block_table=self._copy(f"table/{g.name}", bt, min_rows=self.min_rows),
            )
        seq_lens = step.seq_lens
        return StepInputs(
            req_ids=step.req_ids, query=step.query, prefix=step.prefix,
            input_ids=self._copy("input_ids", step.input_ids[:num_tokens]),
            positions=self._copy("positions", step.positions[:num_tokens]),
            attn_metadata=metas, graph_mode=step.graph_mode,
            seq_lens=None if seq_lens is None else self._copy("seq_lens", seq_lens[:n]),
            block_tables=None,
        )

    def _copy(self, name: str, src: torch.Tensor, min_rows: int = 256) -> torch.Tensor:
        """``src`` (1-D, or a block table ``[rows, width]``) copied into the buffer ``name`` (at least ``min_rows``
        rows, so its address stays while forwards grow up to them); returns the filled rows."""
        buf = self._buffers.get(name)
        if (buf is None or buf.dtype != src.dtype or buf.device != src.device or buf.shape[0] < src.shape[0]
                or buf.shape[1:] != src.shape[1:]):
            rows = max(src.shape[0], min_rows, 0 if buf is None else 2 * buf.shape[0])
            buf = self._buffers[name] = torch.empty((rows, *src.shape[1:]), dtype=src.dtype, device=src.device)
        out = buf[: src.shape[0]]
        out.copy_(src, non_blocking=True)
        return out
