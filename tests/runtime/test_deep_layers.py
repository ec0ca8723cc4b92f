"""`Canary.set_kv_cache(deep_layers=...)`: deep fingerprints read every layer's full storage from
``deep_layers`` while the TAIL sources come from ``layers`` (an adapter's partial copies of a few layers)."""
from __future__ import annotations

import pytest
import torch

from kvcanary.errors import KvCanaryValueError
from kvcanary.runtime import Canary, CanaryConfig, GroupSpec

SLOTS, LAYERS, BYTES = 64, 6, 64  # bfloat16: 32 elements per slot and side


def _canary() -> Canary:
    return Canary(CanaryConfig(mode="log"), groups=[GroupSpec(name="full", num_slots=SLOTS, layer_ids=tuple(range(LAYERS)))],
                  max_requests=4, max_context=32, max_batch_tokens=32, device=torch.device("cpu"))


def test_deep_fingerprints_read_deep_layers_while_tail_reads_the_partial_copies():
    full = {l: (torch.randn(SLOTS, BYTES // 2).to(torch.bfloat16), torch.randn(SLOTS, BYTES // 2).to(torch.bfloat16))
            for l in range(LAYERS)}
    partial = {l: (full[l][0][:, :8].clone(), full[l][1][:, :8].clone()) for l in (0, LAYERS - 1)}  # 16 bytes, 2 layers
    c = _canary()
    with pytest.raises(KvCanaryValueError, match=r"has no tensors for layer 1 \(deep_fingerprints"):
        c.set_kv_cache("full", partial)  # what an adapter handing partial copies got before
    c.set_kv_cache("full", partial, deep_layers=full)
    g = c.groups["full"]
    assert [s.tensor.data_ptr() for s in g.sources["k"]] == [partial[0][0].data_ptr(), partial[LAYERS - 1][0].data_ptr()]
    deep_k = [s.tensor.data_ptr() for chunk in g.deep_chunks() for s in g.deep_sources[(chunk, "k")]]
    assert deep_k == [full[l][0].data_ptr() for l in range(LAYERS)]
    assert all(s.read_bytes == BYTES for chunk in g.deep_chunks() for s in g.deep_sources[(chunk, "v")])
    c.close()


def test_deep_page_size_pages_the_deep_storage():
    paged = {l: (torch.zeros(SLOTS // 4, 4 * BYTES // 2, dtype=torch.bfloat16),) * 2 for l in range(LAYERS)}
    slots = {l: (torch.zeros(SLOTS, BYTES // 2, dtype=torch.bfloat16),) * 2 for l in range(LAYERS)}
    c = _canary()
    c.set_kv_cache("full", slots, deep_layers=paged, deep_page_size=4)
    g = c.groups["full"]
    assert {s.page_size for chunk in g.deep_chunks() for s in g.deep_sources[(chunk, "k")]} == {4}
    assert {s.page_size for s in g.sources["k"]} == {1}
    c.close()
