"""Every entry attention reads is verified or reported (transformers continuous batching, CPU).

Re-enactment of a surplus page read: the engine hands attention one page more than a request owns (a block
allocated ahead of need, still holding a previous occupant's KV). The patch lives in the test only: it wraps the
cache allocators' ``get_seqlen_k`` / ``get_read_indices`` so that, in one forward, the target request's key length
and read index carry one extra page of a block another request wrote. The canary must report a
``read_table_mismatch`` against that request; the same workload unpatched, and clean runs over page sizes,
sliding windows, block sharing and chunked prefill, must stay silent.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import GenerationConfig  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402
from transformers.generation.continuous_batching.cache_allocators import (  # noqa: E402
    FullAttentionCacheAllocator,
    SlidingAttentionCacheAllocator,
)
from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs  # noqa: E402

import kvcanary  # noqa: E402
from engines.cb_support import padded_like_graphs  # noqa: E402
from kvcanary.cli.demo import workload  # noqa: E402
from kvcanary.runtime import CanaryViolationError  # noqa: E402
from kvcanary.runtime.reads import READ_TABLE_MISMATCH  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_engine")


def run(model, prompts, *, page_size=16, num_blocks=48, max_batch_tokens=64, per_batch=4, sharing=True,
        max_new_tokens=5, **canary):
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                  max_requests_per_batch=per_batch, allow_block_sharing=sharing,
                                  use_cuda_graph=False, use_async_batching=False)
    with kvcanary.attach(model, **{"mode": "log", **canary}) as handle:
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, progress_bar=False)
    return handle, {rid: list(o.generated_tokens) for rid, o in out.items()}


class SurplusPage:
    """In one forward, the target request's attention (allocator class ``cls``) reads one extra page: its key
    length grows by a page and its read index gets the page's rows — at the end (``where="end"``) or between its
    cached prefix and its new tokens (``"between"``, full attention only). The page is a block another request
    wrote, preferably one freed since (a previous occupant's KV)."""

    def __init__(self, monkeypatch, cls, *, target: str, where: str = "end", after: int = 2) -> None:
        self.target, self.where, self.after = target, where, after
        self.fired: dict = {}  # request id, past length, physical rows, block, of the forward it fired in
        self.writers: dict[int, str] = {}  # block -> last request that wrote it
        self._batch: list = []
        self._calls = 0
        self._seen = 0
        prepare, seqlen, reads, writes = (ContinuousBatchingIOs.prepare_batch_tensors, cls.get_seqlen_k,
                                          cls.get_read_indices, cls.get_write_indices)
        me = self

        def prepare_batch_tensors(io, requests_in_batch, *args, **kwargs):
            me._batch, me._calls = list(requests_in_batch), 0
            return prepare(io, requests_in_batch, *args, **kwargs)

        def get_seqlen_k(alloc, past, query):
            i, me._calls = me._calls, me._calls + 1
            rid = me._batch[i].state.request_id if i < len(me._batch) else None
            n = seqlen(alloc, past, query)
            if rid == me.target and past > 0 and not me.fired:
                me._seen += 1
                if me._seen > me.after:
                    me.fired = {"rid": rid, "past": past, "pending": True}
            if me.fired.get("pending") and rid == me.target and past == me.fired["past"]:
                return n + alloc.tokens_per_page
            return n

        def get_read_indices(alloc, request_id, past, query):
            out = reads(alloc, request_id, past, query)
            f = me.fired
            if not (f.get("pending") and request_id == me.target and past == f["past"]):
                return out
            f["pending"] = False
            own = set(alloc.block_table[request_id])
            live = {b for r, bs in alloc.block_table.items() for b in bs}
            others = [b for b, w in me.writers.items() if w != request_id and b not in own]
            block = ([b for b in others if b not in live] or others)[-1]
            page = [block * alloc.block_physical_stride + o for o in range(alloc.tokens_per_page)]
            f.update(block=block, rows=page, freed=block not in live)
            if me.where == "between":
                return out[:past] + page + out[past:]
            return out + page

        def get_write_indices(alloc, request_id, past, query):
            out = writes(alloc, request_id, past, query)
            for phys in out:
                me.writers[phys // alloc.block_physical_stride] = request_id
            return out

        monkeypatch.setattr(ContinuousBatchingIOs, "prepare_batch_tensors", prepare_batch_tensors)
        monkeypatch.setattr(cls, "get_seqlen_k", get_seqlen_k)
        monkeypatch.setattr(cls, "get_read_indices", get_read_indices)
        monkeypatch.setattr(cls, "get_write_indices", get_write_indices)


def _prompts():
    return workload(seed=3, num_requests=6)


@pytest.mark.parametrize("model_name, cls, group, where", [
    ("llama", FullAttentionCacheAllocator, "full", "end"),
    ("llama", FullAttentionCacheAllocator, "full", "between"),
    ("qwen3", SlidingAttentionCacheAllocator, "swa", "end"),
])
def test_surplus_page_read_is_reported_against_the_reading_request(request, monkeypatch, model_name, cls, group, where):
    model = request.getfixturevalue(model_name)
    clean, _ = run(model, _prompts())
    assert clean.counters()["total"] == 0  # the clean twin
    surplus = SurplusPage(monkeypatch, cls, target="req_5", where=where)
    handed = []  # the read index each forward hands attention (for the allocator's group)
    hook = model.register_forward_pre_hook(
        lambda m, a, kw: handed.append([r for idx in kw["read_index"] for r in idx.tolist()]), with_kwargs=True)
    try:
        handle, _ = run(model, _prompts())
    finally:
        hook.remove()
    assert surplus.fired and not surplus.fired["pending"], "the re-enactment did not fire"
    assert any(set(surplus.fired["rows"]) <= set(reads) for reads in handed)  # attention was handed the page
    found = [v for v in handle.violations() if int(v.reasons) & READ_TABLE_MISMATCH]
    assert found, handle.counters()
    (v,) = found  # one forward, one request: one row
    assert v.request_id == "req_5" and v.group == group and v.launch_tag.name == f"HEAD_K_{group.upper()}"
    assert v.reason_label == "read_table_mismatch" and v.op == "verify"
    page_slots = set(range(surplus.fired["block"] * 16, surplus.fired["block"] * 16 + 16))
    assert v.slot in page_slots and v.reads == v.owned_reads + 16
    if where == "end":
        assert v.expected_slot is None and v.expected_position >= surplus.fired["past"] + 1  # past what it owns
    counters = handle.counters()
    assert counters["by_reason"].get("read_table_mismatch") == 1 and counters["by_tag"][v.launch_tag.name] >= 1
    assert "read_table_mismatch" in v.log_line() and "reads:" in v.readable()


def test_surplus_page_read_raises_in_raise_mode(llama, monkeypatch):
    surplus = SurplusPage(monkeypatch, FullAttentionCacheAllocator, target="req_2")
    gen = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=48, max_batch_tokens=64, max_requests_per_batch=4,
                                  use_cuda_graph=False, use_async_batching=False)
    with pytest.raises(CanaryViolationError, match="read_table_mismatch"):
        with kvcanary.attach(llama, mode="raise"):
            llama.generate_batch(_prompts(), generation_config=gen, continuous_batching_config=cb, progress_bar=False)
    assert surplus.fired


def test_surplus_page_read_is_reported_in_padded_graph_layout(llama, monkeypatch):
    """Padded static shapes and the compute_batch-driven steps of graph mode (everything but the capture)."""
    padded_like_graphs(monkeypatch)
    surplus = SurplusPage(monkeypatch, FullAttentionCacheAllocator, target="req_4")
    handle, _ = run(llama, _prompts(), graph_driver=True)
    found = [v for v in handle.violations() if int(v.reasons) & READ_TABLE_MISMATCH]
    assert surplus.fired and [v.request_id for v in found] == ["req_4"]
    c = handle.counters()
    assert c["total"] == 1 and c["checked_forwards"] == c["engine_forwards"]


CLEAN = [  # model, page size, blocks, max batch tokens, requests per batch, block sharing, padded (graph layout)
    ("llama", 4, 160, 16, 3, True, False),
    ("llama", 16, 48, 64, 4, False, True),
    ("qwen3", 8, 96, 24, 4, True, False),
    ("qwen3", 16, 48, 64, 2, True, True),
]


@pytest.mark.parametrize("model_name, page, blocks, tokens, per_batch, sharing, padded", CLEAN)
def test_clean_runs_report_no_read_table_mismatch(request, monkeypatch, model_name, page, blocks, tokens, per_batch,
                                                  sharing, padded):
    if padded:
        padded_like_graphs(monkeypatch)
    model = request.getfixturevalue(model_name)
    handle, _ = run(model, workload(seed=5, num_requests=7), page_size=page, num_blocks=blocks, max_batch_tokens=tokens,
                    per_batch=per_batch, sharing=sharing, max_new_tokens=6, sweep_interval=3, graph_driver=padded)
    c = handle.counters()
    assert c["total"] == 0 and not handle.violations(), c["by_reason"]
    assert c["checked_forwards"] == c["engine_forwards"] > 0


def test_decode_fast_path_key_length_is_checked():
    """Block-table forwards (flash decode, GPU only): the kernel reads positions [0, key length) of a row's blocks,
    so a key length past P + E is a surplus read, named by the slot of the first position past the row's."""
    from kvcanary.engines.transformers_cb.forward_view import ForwardTranslator
    from kvcanary.engines.transformers_cb.layout import GroupLayout

    t = ForwardTranslator.__new__(ForwardTranslator)  # only what _paged reads
    t._arange, t.max_context = torch.arange(256), 64
    g = GroupLayout(name="full", layer_type="full_attention", index=0, layer_ids=(0,), page_size=4, block_stride=8,
                    first_data_block=2, total_blocks=16, sliding_window=0, pages_stride=2)
    table = torch.zeros(5, 64, dtype=torch.int32)
    pages = torch.tensor([[4, 6, 8], [10, 12, -1]])  # blocks 2, 3, 4 and 5, 6
    rows, prefix, extend = torch.tensor([1, 2]), torch.tensor([9, 5]), torch.tensor([1, 1])
    args = (g, table, pages, rows, prefix, extend)
    tokens = (torch.tensor([0, 1]), torch.tensor([True, True]), torch.tensor([9, 5]))
    _, clean = t._paged(*args, torch.tensor([0, 10, 16]), 2, *tokens)
    assert clean.mismatch.tolist() == [False, False]
    _, check = t._paged(*args, torch.tensor([0, 14, 20]), 2, *tokens)
    assert check.mismatch.tolist() == [True, False]
    assert (int(check.slot[0]), int(check.position[0]), int(check.expected_slot[0])) == (4 * 4 + 2, 10, -1)
    assert check.reads.tolist() == [14, 6] and check.owned.tolist() == [10, 6]
