"""Random op scenarios shared by the Triton parity tests (interpreter on CPU, real GPU).

``make_case`` draws one consistent batch: a canary buffer with random bytes, 0-4 real-KV sources,
a request table (optionally SWA with a LUT and an expected-token table), and the write inputs
that follow the plan. ``run_plan/run_write/run_verify/run_scatter`` apply one implementation to
clones of the case and return everything the op may touch, for exact comparison.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Optional

import torch

from kvcanary.ops.constants import CanaryLaunchTag, RealKvHashMode
from kvcanary.ops.records import RealKvSource, VerifyOrWriteContext, VerifyPlan, WritePlan

RING_SENTINEL = -77


def make_source(g, device, *, num_slots, page_size, nbpt, read_bytes, dtype, pad_bytes=0):
    rows = -(-num_slots // page_size)
    es = torch.empty(0, dtype=dtype).element_size()
    row_bytes = page_size * nbpt
    raw = torch.randint(0, 256, (rows, row_bytes + pad_bytes), dtype=torch.uint8, generator=g)
    t = raw.view(dtype)[:, : row_bytes // es].to(device)
    return RealKvSource(tensor=t, page_size=page_size, num_bytes_per_token=nbpt, read_bytes=read_bytes)


def make_context(g, device, *, num_slots, stride_bytes, ring_cap, sources, mode, chain_assert, kind, write_index=0):
    buf = torch.randint(0, 256, (num_slots, stride_bytes), dtype=torch.uint8, generator=g).to(device)
    counters = torch.arange(100, 100 + 2 * len(CanaryLaunchTag), dtype=torch.int64, device=device)
    k = int(kind)
    return VerifyOrWriteContext(
        canary_buf=buf, kernel_kind=kind,
        violation_ring=torch.full((ring_cap, 8), RING_SENTINEL, dtype=torch.int64, device=device),
        violation_write_index=torch.tensor([write_index], dtype=torch.int32, device=device),
        slot_run_counter=counters[k:k + 1], kernel_run_counter=counters[12 + k:12 + k + 1],
        real_kv_sources=tuple(sources), real_kv_hash_mode=mode,
        enable_chain_position_assert=torch.tensor([chain_assert], dtype=torch.int32, device=device),
    )


def write_plan(lengths, seeds) -> WritePlan:
    """A CPU write plan of requests with these token counts and seed slots."""
    wp = WritePlan.allocate(len(lengths), "cpu")
    wp.write_offsets.copy_(torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist()))
    wp.write_seed_slot_indices.copy_(torch.tensor(seeds))
    wp.write_num_valid_reqs[0] = len(lengths)
    return wp


def write_inputs(ids, pos, loc, expected=None) -> dict:
    """Write-op keyword inputs (int64 CPU tensors); ``expected`` = (tokens, positions) turns the
    write-input assert on."""
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    kw = dict(input_ids=t(ids), positions=t(pos), out_cache_loc=t(loc), enable_write_input_assert=False,
              expected_input_tokens=None, expected_input_positions=None)
    if expected is not None:
        kw.update(enable_write_input_assert=True, expected_input_tokens=t(expected[0]),
                  expected_input_positions=t(expected[1]))
    return kw


def clone_context(ctx: VerifyOrWriteContext) -> VerifyOrWriteContext:
    counters = ctx.slot_run_counter._base.clone() if ctx.slot_run_counter._base is not None else None
    if counters is not None:
        so = ctx.slot_run_counter.storage_offset()
        ko = ctx.kernel_run_counter.storage_offset()
        slot_c, kern_c = counters[so:so + 1], counters[ko:ko + 1]
    else:
        slot_c, kern_c = ctx.slot_run_counter.clone(), ctx.kernel_run_counter.clone()
    return VerifyOrWriteContext(
        canary_buf=ctx.canary_buf.clone(), kernel_kind=ctx.kernel_kind,
        violation_ring=ctx.violation_ring.clone(), violation_write_index=ctx.violation_write_index.clone(),
        slot_run_counter=slot_c, kernel_run_counter=kern_c, real_kv_sources=ctx.real_kv_sources,
        real_kv_hash_mode=ctx.real_kv_hash_mode, enable_chain_position_assert=ctx.enable_chain_position_assert,
    )


def context_state(ctx: VerifyOrWriteContext) -> dict:
    """Everything an op may change, on the CPU; ring rows as recorded plus the full ring."""
    base = ctx.slot_run_counter._base
    return dict(
        buf=ctx.canary_buf.cpu().clone(),
        ring=ctx.violation_ring.cpu().clone(),
        index=int(ctx.violation_write_index[0]),
        counters=(base if base is not None else torch.cat([ctx.slot_run_counter, ctx.kernel_run_counter])).cpu().clone(),
    )


def assert_same_state(before: dict, twin: dict, fast: dict, *, ordered: bool = False) -> None:
    """Bit-identical buffer, counters and index; ring rows equal as a multiset (or in order).

    When the launch overflowed the ring, the kept rows of ``fast`` must be rows the twin recorded
    in a full ring; that check is done by the caller with a large ring."""
    assert torch.equal(twin["buf"], fast["buf"]), _first_diff(twin["buf"].view(torch.int64), fast["buf"].view(torch.int64))
    assert torch.equal(twin["counters"], fast["counters"]), (twin["counters"], fast["counters"])
    assert twin["index"] == fast["index"], (twin["index"], fast["index"])
    cap = twin["ring"].shape[0]
    old = max(before["index"], 0)
    lo, hi = min(old, cap), min(twin["index"], cap)
    assert torch.equal(twin["ring"][:lo], fast["ring"][:lo])
    assert torch.equal(twin["ring"][hi:], fast["ring"][hi:])
    a, b = twin["ring"][lo:hi], fast["ring"][lo:hi]
    if ordered:
        assert torch.equal(a, b)
    else:
        assert sorted(map(tuple, a.tolist())) == sorted(map(tuple, b.tolist())), (a, b)


def _first_diff(a, b):
    bad = (a != b).nonzero()
    return f"first differing (row, field): {bad[:5].tolist()} twin={a[bad[0,0]].tolist()} fast={b[bad[0,0]].tolist()}" if len(bad) else ""


@dataclass
class Case:
    device: torch.device
    ctx: VerifyOrWriteContext
    plan_kwargs: dict
    verify_plan: VerifyPlan
    write_plan: WritePlan
    write_kwargs: dict = field(default_factory=dict)


def make_case(seed: int, device="cpu", *, small=True, mode=None, nsrc=None, window=None) -> Case:
    g = torch.Generator().manual_seed(seed)
    dev = torch.device(device)

    def rint(lo, hi):  # inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    num_slots = rint(40, 160) if small else 1 << 16
    stride_bytes = [32, 40, 48, 64][rint(0, 3)]
    mode = RealKvHashMode(rint(0, 2)) if mode is None else RealKvHashMode(mode)
    nsrc = rint(0, 4) if nsrc is None else nsrc
    sources = []
    for _ in range(nsrc):
        nbpt = [16, 32, 64][rint(0, 2)]
        sources.append(make_source(
            g, dev, num_slots=num_slots, page_size=[1, 4, 16][rint(0, 2)], nbpt=nbpt,
            read_bytes=16 * rint(1, nbpt // 16), dtype=[torch.uint8, torch.bfloat16, torch.int32][rint(0, 2)],
            pad_bytes=16 * rint(0, 2)))
    ctx = make_context(
        g, dev, num_slots=num_slots, stride_bytes=stride_bytes, ring_cap=[2, 8, 64, 512][rint(0, 3)],
        sources=sources, mode=mode, chain_assert=rint(0, 1), kind=rint(0, 11), write_index=[0, 0, 3][rint(0, 2)])

    # Request table: each request row owns a random permutation of slots (slot 0 sometimes).
    bs = rint(0, 9) if small else 64
    max_reqs, max_len = bs + 3, rint(8, 48) if small else 4096
    perm = torch.randperm(num_slots, generator=g)
    rtt = perm[torch.arange(max_reqs * max_len) % num_slots].reshape(max_reqs, max_len).to(torch.int32)
    if rint(0, 3) == 0:  # shared prefix between two rows
        rtt[2, : max_len // 2] = rtt[1, : max_len // 2]
    rp = torch.randint(0, max_reqs, (bs,), generator=g)
    prefix = torch.randint(0, max_len // 2 + 1, (bs,), generator=g)
    extend = torch.randint(-1, max_len // 2, (bs,), generator=g)
    if bs and rint(0, 1):
        extend[torch.randint(0, bs, (1,), generator=g)] = 1
    window = (rint(0, 8) if rint(0, 1) else 0) if window is None else window
    lut = None
    if window > 0 or rint(0, 3) == 0:
        lut = torch.randint(1, num_slots, (num_slots,), generator=g)  # in-range slots (negative ones are outside the contract)
    table = valid = None
    if rint(0, 1):
        table = torch.randint(-5, 1000, (max_reqs, max_len + 2), generator=g).to(torch.int32)
        valid = torch.randint(0, max_len + 2, (bs,), generator=g)
    itype = [torch.int32, torch.int64][rint(0, 1)]
    v_cap = [max(1, rint(1, 8)), 512][rint(0, 1)] if small else 1 << 20
    w_cap = max(1, bs + [-2, 0, 3][rint(0, 2)])
    vp = VerifyPlan.allocate(v_cap, dev)
    wp = WritePlan.allocate(w_cap, dev)
    for t in (vp.verify_slot_indices, vp.verify_expected_tokens, vp.verify_expected_positions,
              vp.verify_prev_slot_indices, wp.write_offsets, wp.write_seed_slot_indices):
        t.copy_(torch.randint(-9, 9, t.shape, generator=g))
    to = lambda t: None if t is None else t.to(dev)  # noqa: E731
    plan_kwargs = dict(
        req_pool_indices=rp.to(itype).to(dev), prefix_lens=prefix.to(itype).to(dev),
        extend_seq_lens=extend.to(itype).to(dev), req_to_token=rtt.to(dev), swa_window_size=window,
        full_to_swa_index_mapping=to(lut), verify_capacity=v_cap, req_to_verify_expected_tokens=to(table),
        req_to_verify_expected_tokens_valid_lens=None if valid is None else valid.to(itype).to(dev),
        kv_token_id_vs_position_offset=rint(-1, 1),
    )
    case = Case(device=dev, ctx=ctx, plan_kwargs=plan_kwargs, verify_plan=vp, write_plan=wp)
    # Write inputs: extend tokens at positions P.. in fresh slots (some negative, some repeated,
    # sometimes a seed slot reused); expected inputs with a few mismatches.
    n_entries = int(torch.where((rp != 0) & (extend > 0), extend, 0).sum()) + rint(0, 3)
    loc = torch.randint(1, num_slots, (n_entries,), generator=g)
    loc[torch.rand(n_entries, generator=g) < 0.1] = -1
    if rint(0, 2) == 0 and n_entries > 1:
        loc[rint(0, n_entries - 1)] = loc[rint(0, n_entries - 1)]  # duplicate slot
    ids = torch.randint(0, 50000, (n_entries,), generator=g)
    pos = torch.randint(0, max_len, (n_entries,), generator=g)
    assert_on = bool(rint(0, 1))
    case.write_kwargs = dict(
        input_ids=ids.to(itype).to(dev), positions=pos.to(itype).to(dev), out_cache_loc=loc.to(itype).to(dev),
        enable_write_input_assert=assert_on,
        expected_input_tokens=torch.where(torch.rand(n_entries, generator=g) < 0.1, ids + 1, ids).to(dev) if assert_on else None,
        expected_input_positions=torch.where(torch.rand(n_entries, generator=g) < 0.1, pos - 1, pos).to(dev) if assert_on else None,
    )
    return case


def plan_state(vp: VerifyPlan, wp: WritePlan) -> list:
    return [t.cpu().clone() for t in (
        vp.verify_slot_indices, vp.verify_expected_tokens, vp.verify_expected_positions, vp.verify_prev_slot_indices,
        vp.verify_num_valid, vp.enable, wp.write_offsets, wp.write_seed_slot_indices, wp.write_num_valid_reqs)]


def clone_plans(case: Case) -> tuple[VerifyPlan, WritePlan]:
    vp, wp = case.verify_plan, case.write_plan
    return (VerifyPlan(**{k: getattr(vp, k).clone() for k in vp.__dataclass_fields__}),
            WritePlan(**{k: getattr(wp, k).clone() for k in wp.__dataclass_fields__}))


def run_plan(impl, case: Case):
    """(nine output tensors, error message or None)."""
    vp, wp = clone_plans(case)
    try:
        impl(verify_plan_out=vp, write_plan_out=wp, **case.plan_kwargs)
        err = None
    except ValueError as e:
        err = str(e)
    return plan_state(vp, wp), err, (vp, wp)


def sibling_context(ctx: VerifyOrWriteContext, seed: int, *, mode=None, sources=None, kind=3, stride_bytes=None):
    """A second context over the same slots (as many rows): its own buffer (``ctx``'s bytes, a few fields
    flipped), ring, counters, chain-assert flag, and optionally other sources / mode / row width."""
    g = torch.Generator().manual_seed(1000 + seed)
    width = ctx.canary_buf.shape[1] if stride_bytes is None else stride_bytes
    other = make_context(g, ctx.canary_buf.device, num_slots=ctx.canary_buf.shape[0], stride_bytes=width,
                         ring_cap=[3, 64][seed % 2], sources=ctx.real_kv_sources if sources is None else sources,
                         mode=ctx.real_kv_hash_mode if mode is None else mode, chain_assert=1 - seed % 2, kind=kind,
                         write_index=seed % 3)
    common = min(width, ctx.canary_buf.shape[1])
    other.canary_buf[:, :common].copy_(ctx.canary_buf[:, :common])
    f = other.canary_buf.view(torch.int64)
    bad = torch.randint(0, f.shape[0], (4,), generator=g).to(f.device)
    f[bad, torch.randint(0, 4, (4,), generator=g).to(f.device)] ^= 1 << 5
    return other


def many_requests_write(aliased: bool = False) -> tuple[WritePlan, dict]:
    """150 requests, mostly one token (over 32 per chain program: the lane loop runs twice) with a 40- and a
    3-token request, an empty one, seeds from earlier slots and one chain-position row; ``aliased``: request 120
    seeds from a slot request 3 stores (serial mode). Slots 1..n of a 512-slot buffer."""
    lengths = [1] * 150
    lengths[7], lengths[90] = 40, 3
    lengths[33] = 0
    seeds = [(-1 if r % 5 == 0 else 300 + r) for r in range(150)]
    n = sum(lengths)
    loc = list(range(1, n + 1))
    pos = [(r * 3 + k) for r, ln in enumerate(lengths) for k in range(ln)]
    pos[12] += 1  # a chain-position row
    if aliased:
        seeds[120] = loc[3]
    return write_plan(lengths, seeds), write_inputs(list(range(5000, 5000 + n)), pos, loc)


def assert_same_states(before: list, twin: list, fast: list, *, kept_rows_may_differ: bool = False) -> None:
    """`assert_same_state` per context. ``kept_rows_may_differ``: a ring that filled within the launch is compared
    only below where it stood before (which rows are kept may then differ, docs/design.md §3.9)."""
    for b, t, f in zip(before, twin, fast):
        cap = t["ring"].shape[0]
        if kept_rows_may_differ and t["index"] > cap:
            lo = min(max(b["index"], 0), cap)
            t, f = dict(t, ring=t["ring"][:lo]), dict(f, ring=f["ring"][:lo])
        assert_same_state(b, t, f)


def compare_context_runs(contexts, run_twin, run_fast, *, kept_rows_may_differ: bool = False) -> list:
    """Run ``run_twin`` and ``run_fast`` (each takes a list of contexts) on clones of ``contexts``: the same error
    (message or none) and the same states; returns the twin's clones."""
    before = [context_state(c) for c in contexts]
    runs = []
    for run in (run_twin, run_fast):
        clones = [clone_context(c) for c in contexts]
        try:
            run(clones)
            err = None
        except ValueError as e:
            err = str(e)
        runs.append((clones, err))
    (twin, err_t), (fast, err_f) = runs
    assert err_t == err_f
    assert_same_states(before, [context_state(c) for c in twin], [context_state(c) for c in fast],
                       kept_rows_may_differ=kept_rows_may_differ)
    return twin
