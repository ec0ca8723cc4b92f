"""vLLM's GPU KV layouts and the V2 model runner's batch, without vLLM or a GPU: real tensors shaped and strided as
vLLM 0.26-0.32 allocate them for FlashAttention / Triton attention / FlashInfer (logical [blocks, heads, block, 2 * dim];
NHD or HND memory order), and a V2 ``InputBatch`` / attention metadata stand-in with the fields the adapter reads.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvcanary.engines.vllm.forward_view import WorkerView, v2_step
from kvcanary.engines.vllm.layout import FULL, GroupLayout, gpu_kv_layout, gpu_kv_sources, gpu_token_views
from kvcanary.ops.records import RealKvSource

from .vllm_support import head_filled

NB, H, B, D = 6, 3, 16, 8


def _nhd(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(logical view, memory tensor [blocks, block, heads, 2 * dim]) — how FlashAttention's cache is laid out."""
    g = torch.Generator().manual_seed(seed)
    mem = torch.randn(NB, B, H, 2 * D, generator=g).to(torch.bfloat16)
    return mem.permute(0, 2, 1, 3), mem


def test_nhd_sources_are_views_holding_every_byte_of_each_slot():
    kv, mem = _nhd()
    assert gpu_kv_layout(kv) == "nhd"
    k, v, page = gpu_kv_sources(kv, "nhd")
    assert page == 1 and k.data_ptr() == kv.data_ptr()
    for slot in (0, 17, NB * B - 1):
        b, t = divmod(slot, B)
        assert torch.equal(k[slot], mem[b, t].reshape(-1))  # every head's K and V
        assert torch.equal(v[slot], kv[b, 0, t, D:])  # head 0's V
    # the canary's kernels read them directly: contiguous rows, 16-byte row stride
    RealKvSource(tensor=k, page_size=1, num_bytes_per_token=k.shape[1] * 2, read_bytes=k.shape[1] * 2)
    RealKvSource(tensor=v, page_size=1, num_bytes_per_token=v.shape[1] * 2, read_bytes=16)
    # a write into the engine's cache shows in the sources (no copy)
    mem[2, 5, 1, 3] += 1
    assert torch.equal(k[2 * B + 5], mem[2, 5].reshape(-1))


def test_hnd_and_unknown_layouts():
    kv = torch.zeros(NB, H, B, 2 * D, dtype=torch.float16)
    assert gpu_kv_layout(kv) == "hnd"
    k, v, page = gpu_kv_sources(kv, "hnd")
    assert page == B and k.shape == (NB, B, 2 * D) and v.shape == (NB, B, 2 * D)
    assert gpu_kv_layout(torch.zeros(NB, 2 * D, B, H).permute(0, 3, 2, 1)) is None and gpu_kv_layout(kv[..., :D]) is None
    with pytest.raises(ValueError, match="^kv-canary: unknown GPU KV layout"):
        gpu_kv_sources(kv, "xyz")


def test_token_views_name_the_keys_and_values_of_each_token():
    kv, mem = _nhd(1)
    k, v = gpu_token_views(kv)
    assert torch.equal(k[3, 7, 2], mem[3, 7, 2, :D]) and torch.equal(v[3, 7, 2], mem[3, 7, 2, D:])


def _metadata(block_table: torch.Tensor, slots: list[int]) -> dict:
    meta = SimpleNamespace(block_table=block_table, slot_mapping=torch.tensor(slots + [-1, -1], dtype=torch.int64))
    return {"model.layers.0.self_attn.attn": meta}


def test_v2_batch_builds_tables_from_the_block_table_attention_reads():
    layout = GroupLayout(name=FULL, index=0, layer_names=("model.layers.0.self_attn.attn",), layer_ids=(0,),
                         block_size=4, manager_block_size=4, num_blocks=16, sliding_window=0)
    view = WorkerView(runner=None, layouts=[layout], max_requests=4, max_context=32, device=torch.device("cpu"))
    view.apply(tokens={"a": (0, list(range(100, 106))), "b": (0, list(range(200, 203)))}, finished=(), preempted=())
    # row a: 5 cached positions + 1 new token; row b: a 3-token prefill. Padded like vLLM's buffers.
    bt = torch.zeros(4, 8, dtype=torch.int32)
    bt[0, :2] = torch.tensor([3, 7])
    bt[1, :1] = torch.tensor([9])
    batch = SimpleNamespace(num_reqs=2, req_ids=["a", "b"], num_scheduled_tokens=np.array([1, 3], dtype=np.int32),
                            num_computed_tokens_np=np.array([5, 0], dtype=np.int32),
                            input_ids=torch.tensor([105, 200, 201, 202, 0, 0], dtype=torch.int32),
                            positions=torch.tensor([5, 0, 1, 2, 0, 0], dtype=torch.int64))
    step = v2_step(batch, _metadata(bt, [7 * 4 + 1, 36, 37, 38]), graph_mode="PIECEWISE")
    desc = head_filled(view.describe(step))
    assert desc.request_ids == ("a", "b") and desc.forward_kind == "mixed"
    assert desc.prefix_lens.tolist() == [5, 0] and desc.extend_lens.tolist() == [1, 3]
    ra, rb = desc.req_pool_indices.tolist()
    table = desc.groups[FULL].req_to_token
    assert table[ra, :6].tolist() == [12, 13, 14, 15, 28, 29] and table[rb, :3].tolist() == [36, 37, 38]
    assert desc.input_ids.tolist() == [105, 200, 201, 202] and desc.groups[FULL].out_cache_loc.tolist() == [29, 36, 37, 38]
    assert desc.token_table[ra, :6].tolist() == list(range(100, 106)) and desc.token_table_lens.tolist() == [6, 3]
    assert view.slots_reused() == 0
    # a slot written again later (its block was freed and handed out again) is counted, on the device
    view.apply(tokens={}, finished=("b",), preempted=())
    batch2 = SimpleNamespace(num_reqs=1, req_ids=["c"], num_scheduled_tokens=np.array([2], dtype=np.int32),
                             num_computed_tokens_np=np.array([0], dtype=np.int32),
                             input_ids=torch.tensor([300, 301], dtype=torch.int32), positions=torch.tensor([0, 1]))
    bt2 = torch.zeros(4, 8, dtype=torch.int32)
    bt2[0, 0] = 9
    assert head_filled(view.describe(v2_step(batch2, _metadata(bt2, [36, 37])))) is not None
    assert view.slots_reused() == 2


def test_token_history_matches_a_reference_model_under_random_scheduler_events():
    """Random steps of new tokens, resends from earlier positions, gaps, preemptions and finishes: after each forward,
    the token table rows and known lengths of the batch equal a plain per-request history model."""
    import random

    rng = random.Random(7)
    cap = 48
    layout = GroupLayout(name=FULL, index=0, layer_names=("model.layers.0.self_attn.attn",), layer_ids=(0,),
                         block_size=4, manager_block_size=4, num_blocks=64, sliding_window=0)
    view = WorkerView(runner=None, layouts=[layout], max_requests=6, max_context=cap, device=torch.device("cpu"))
    ref: dict[str, list[int]] = {}
    live: list[str] = []
    serial = 0
    bt = torch.arange(1, 6 * 12 + 1, dtype=torch.int32).view(6, 12)
    for _ in range(300):
        tokens, finished, preempted = {}, [], []
        if live and rng.random() < 0.15:
            finished.append(live.pop(rng.randrange(len(live))))
        if live and rng.random() < 0.1:
            preempted.append(rng.choice(live))
        while len(live) < 5 and rng.random() < 0.5:
            serial += 1
            live.append(f"q{serial}")
        for rid in live:
            have = ref.setdefault(rid, [])
            r = rng.random()
            start = len(have) if r < 0.7 else (rng.randrange(len(have) + 1) if r < 0.9 else len(have) + 2)  # resend / gap
            new = [rng.randrange(1000) for _ in range(rng.randrange(1, 4))]
            tokens[rid] = (start, new)
            if start <= len(have):
                del have[start:]
                have.extend(new)
        for rid in finished:
            ref.pop(rid, None)
        view.apply(tokens=tokens, finished=tuple(finished), preempted=tuple(preempted))
        if not live:
            continue
        n = len(live)
        seq = [min(len(ref[r]), cap - 1) or 1 for r in live]
        batch = SimpleNamespace(num_reqs=n, req_ids=list(live), num_scheduled_tokens=np.ones(n, dtype=np.int32),
                                num_computed_tokens_np=np.array([s - 1 for s in seq], dtype=np.int32),
                                input_ids=torch.zeros(n, dtype=torch.int32), positions=torch.tensor([s - 1 for s in seq]))
        desc = view.describe(v2_step(batch, _metadata(bt, [5] * n)))
        for i, rid in enumerate(live):
            row = int(desc.req_pool_indices[i])
            want = ref[rid][:min(cap, seq[i])]
            assert int(desc.token_table_lens[i]) == len(want)
            assert desc.token_table[row, :len(want)].tolist() == want


@pytest.mark.parametrize("seed", range(4))
def test_live_masks_hold_exactly_the_live_slots(seed):
    """The sweep's device masks (`WorkerView.live_masks`, built without a host read) mark the same slots as
    `live_slots` — running requests' stored positions (a sliding group: only what the next query reads) and the
    valid tokens of cached blocks — under random batches."""
    import random

    rng = random.Random(seed)
    names = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
    full = GroupLayout(name=FULL, index=0, layer_names=names[:1], layer_ids=(0,), block_size=4, manager_block_size=4,
                       num_blocks=40, sliding_window=0)
    swa = GroupLayout(name="sliding_window", index=1, layer_names=names[1:], layer_ids=(1,), block_size=4,
                      manager_block_size=4, num_blocks=40, sliding_window=6, window_left=5)
    view = WorkerView(runner=None, layouts=[full, swa], max_requests=32, max_context=32, device=torch.device("cpu"))
    for step in range(6):
        n = rng.randrange(1, 5)
        rids = [f"r{step}.{i}" for i in range(n)]
        lens = [rng.randrange(1, 20) for _ in rids]
        view.apply(tokens={r: (0, [rng.randrange(500) for _ in range(k)]) for r, k in zip(rids, lens)},
                   finished=(), preempted=())
        bt = torch.tensor([rng.sample(range(1, 40), 8) for _ in range(n)], dtype=torch.int32)
        slots = [int(bt[i, p // 4]) * 4 + p % 4 for i, k in enumerate(lens) for p in range(k)]
        batch = SimpleNamespace(num_reqs=n, req_ids=rids, num_scheduled_tokens=np.array(lens, dtype=np.int32),
                                num_computed_tokens_np=np.zeros(n, dtype=np.int32),
                                input_ids=torch.zeros(sum(lens), dtype=torch.int32),
                                positions=torch.tensor([p for k in lens for p in range(k)]))
        meta = {name: SimpleNamespace(block_table=bt, slot_mapping=torch.tensor(slots, dtype=torch.int64)) for name in names}
        head_filled(view.describe(v2_step(batch, meta)))
        view.apply(tokens={}, finished=tuple(r for r in rids if rng.random() < 0.5), preempted=())
        cached = [(rng.randrange(1, 40), rng.randrange(0, 5), rng.randrange(2)) for _ in range(rng.randrange(4))]
        masks = view.live_masks(cached)
        for g in (full, swa):
            want = torch.zeros(g.num_slots, dtype=torch.bool)
            want[view.live_slots(cached)[g.name]] = True
            assert torch.equal(masks[g.name], want), (step, g.name)


@pytest.mark.parametrize("layout_name", ["vec", "amx", "plain"])
def test_a_whole_mirror_refresh_copies_what_a_refresh_of_every_slot_copies(layout_name):
    from kvcanary.engines.vllm.layout import StripMirror

    kv = torch.randn(5, 2, 32, 2 * 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)  # [nb, H, B, 2D]
    for side in (0, 1):
        every, whole = (StripMirror(kv, layout_name, side, block_size=32) for _ in range(2))
        every.refresh(torch.arange(5 * 32))
        whole.refresh_all()
        assert every.mirror.abs().sum() > 0 and torch.equal(whole.mirror, every.mirror)


@pytest.mark.parametrize("device_lengths", [True, False])
def test_v2_lengths_from_the_device_when_async_scheduling_runs_ahead(device_lengths):
    """Async scheduling with speculative drafts: row a verified 3 drafts at positions 5-8 last step and 1 was
    accepted, but the host's count still takes all 3 (prefix 9); the runner's device ``seq_lens`` is exact (7 + 4 new
    tokens = 11) and so are its positions. With ``device_lengths`` the canary's prefix and table follow the device;
    without it, the host's upper bound (what made every verify forward after a rejection a false ``write_position``)."""
    layout = GroupLayout(name=FULL, index=0, layer_names=("model.layers.0.self_attn.attn",), layer_ids=(0,),
                         block_size=4, manager_block_size=4, num_blocks=16, sliding_window=0)
    view = WorkerView(runner=None, layouts=[layout], max_requests=4, max_context=32, device=torch.device("cpu"),
                      device_lengths=device_lengths)
    view.apply(tokens={"a": (0, list(range(100, 108)))}, finished=(), preempted=())
    bt = torch.zeros(4, 8, dtype=torch.int32)
    bt[0, :3] = torch.tensor([3, 7, 5])
    for start, n in ((0, 5), (5, 4)):  # the prefill, then the verify forward of 3 drafts (host and device agree)
        earlier = SimpleNamespace(num_reqs=1, req_ids=["a"], num_scheduled_tokens=np.array([n], dtype=np.int32),
                                  num_computed_tokens_np=np.array([start], dtype=np.int32),
                                  seq_lens=torch.tensor([start + n, 0], dtype=torch.int32),
                                  input_ids=torch.arange(100 + start, 100 + start + n, dtype=torch.int32),
                                  positions=torch.arange(start, start + n))
        slots = [bt[0, p // 4].item() * 4 + p % 4 for p in range(start, start + n)]
        assert head_filled(view.describe(v2_step(earlier, _metadata(bt, slots)))).prefix_lens.tolist() == [start]
    batch = SimpleNamespace(num_reqs=1, req_ids=["a"], num_scheduled_tokens=np.array([4], dtype=np.int32),
                            num_computed_tokens_np=np.array([9], dtype=np.int32),
                            seq_lens=torch.tensor([11, 0], dtype=torch.int32),
                            input_ids=torch.tensor([107, 1, 2, 3, 0], dtype=torch.int32),
                            positions=torch.tensor([7, 8, 9, 10, 0], dtype=torch.int64))
    desc = head_filled(view.describe(v2_step(batch, _metadata(bt, [7 * 4 + 3, 5 * 4, 5 * 4 + 1, 5 * 4 + 2]))))
    assert desc.extend_lens.tolist() == [4]
    assert desc.prefix_lens.tolist() == ([7] if device_lengths else [9])
    table = desc.groups[FULL].req_to_token[desc.req_pool_indices.tolist()[0]]
    assert table[:11].tolist() == [12, 13, 14, 15, 28, 29, 30, 31, 20, 21, 22]
    assert table[11:13].tolist() == ([0, 0] if device_lengths else [23, 0])


def test_v2_block_table_from_the_runner_when_the_backend_metadata_has_none():
    """FlashInfer's metadata keeps paged-KV indices, not the block table: the V2 runner's gathered block table of the
    group (by KV cache group index) gives the same position -> slot table; with neither, a named refusal."""
    layout = GroupLayout(name=FULL, index=0, layer_names=("model.layers.0.self_attn.attn",), layer_ids=(0,),
                         block_size=4, manager_block_size=4, num_blocks=16, sliding_window=0)
    bt = torch.zeros(4, 8, dtype=torch.int32)
    bt[0, :2] = torch.tensor([3, 7])

    def batch():
        return SimpleNamespace(num_reqs=1, req_ids=["a"], num_scheduled_tokens=np.array([6], dtype=np.int32),
                               num_computed_tokens_np=np.array([0], dtype=np.int32),
                               input_ids=torch.arange(100, 106, dtype=torch.int32), positions=torch.arange(6))

    slots = [12, 13, 14, 15, 28, 29]
    tables = []
    for meta, given in ((_metadata(bt, slots), None),
                        ({"model.layers.0.self_attn.attn": SimpleNamespace(slot_mapping=torch.tensor(slots))}, (bt,))):
        view = WorkerView(runner=None, layouts=[layout], max_requests=4, max_context=32, device=torch.device("cpu"))
        view.apply(tokens={"a": (0, list(range(100, 106)))}, finished=(), preempted=())
        desc = head_filled(view.describe(v2_step(batch(), meta, block_tables=given)))
        tables.append(desc.groups[FULL].req_to_token[desc.req_pool_indices.tolist()[0], :6].tolist())
    assert tables[0] == tables[1] == slots
    view = WorkerView(runner=None, layouts=[layout], max_requests=4, max_context=32, device=torch.device("cpu"))
    bare = {"model.layers.0.self_attn.attn": SimpleNamespace(slot_mapping=torch.tensor(slots))}
    with pytest.raises(RuntimeError, match=r"^kv-canary: the attention metadata of model.layers.0.self_attn.attn "
                                           r"\(SimpleNamespace\) holds no block table"):
        view.describe(v2_step(batch(), bare))
