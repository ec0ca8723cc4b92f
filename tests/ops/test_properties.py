"""Property tests (hypothesis).

(a) plan -> verify -> write over random multi-request, multi-step lifecycles (prefill, chunked
    prefill, decode, prefix sharing, slot reuse, a sliding-window group with a full->swa LUT,
    int32 and int64 inputs) stays clean, with exactly the expected counters and records.
(b) every op agrees field for field with the scalar oracle of ``oracle.py`` on random valid inputs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvcanary.ops import (
    CANARY_FIELD_PREV_HASH,
    CANARY_FIELD_POSITION,
    CANARY_FIELD_TOKEN,
    RealKvHashMode,
    VerifyPlan,
    WritePlan,
    launch_canary_plan_kernels,
    launch_canary_plan_kernels_torch_reference,
    launch_canary_verify_kernel,
    launch_canary_verify_kernel_torch_reference,
    launch_canary_write_kernel,
    launch_canary_write_kernel_torch_reference,
    launch_scatter_req_token_ids_kernel,
    scatter_req_token_ids_torch_reference,
)
from kvcanary.ops.reference import chain_scan

from . import oracle
from .oracle import H0, mix3, s64

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
I32 = st.integers(-(2**31), 2**31 - 1)
# For a longer hunt: KVCANARY_TEST_EXAMPLES_SCALE=20 python -m pytest tests/ops/test_properties.py
_SCALE = int(os.environ.get("KVCANARY_TEST_EXAMPLES_SCALE", "1"))


def examples(n: int) -> int:
    return n * _SCALE


# --------------------------------------------------------------------------- shared strategies
def draw_sources(data, make_source, num_slots, max_sources=4):
    n = data.draw(st.integers(0, max_sources), label="n_sources")
    seed = data.draw(st.integers(0, 2**31), label="kv_seed")
    g = torch.Generator().manual_seed(seed)
    sources = []
    for _ in range(n):
        nbpt = data.draw(st.sampled_from([16, 32, 48]))
        dtype = data.draw(st.sampled_from([torch.uint8, torch.bfloat16, torch.float32]))
        es = torch.empty(0, dtype=dtype).element_size()
        sources.append(make_source(
            num_slots=num_slots,
            page_size=data.draw(st.sampled_from([1, 4, 16])),
            num_bytes_per_token=nbpt,
            read_bytes=data.draw(st.sampled_from([r for r in (16, 32, 48) if r <= nbpt])),
            dtype=dtype,
            row_pad_bytes=data.draw(st.sampled_from([0, 16])),
            stride_pad_bytes=data.draw(st.sampled_from([0, 16, 32])),
            inner_shape=data.draw(st.sampled_from([None, (2, -1)])) if (nbpt // es) % 2 == 0 else None,
            generator=g,
        ))
    return sources


def clone_context(ctx):
    """An independent copy of a context's mutable tensors (sources shared: ops never write them)."""
    fields = {f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx)}
    for name in ("canary_buf", "violation_ring", "violation_write_index", "slot_run_counter",
                 "kernel_run_counter", "enable_chain_position_assert"):
        fields[name] = fields[name].clone()
    return type(ctx)(**fields)


def draw_context(data, make_context, make_source, num_slots):
    sources = draw_sources(data, make_source, num_slots)
    ctx = make_context(
        num_slots=num_slots,
        stride_bytes=data.draw(st.sampled_from([32, 40, 64])),
        ring_capacity=data.draw(st.integers(1, 6)),
        kind=data.draw(st.integers(0, 11)),
        sources=sources,
        mode=data.draw(st.sampled_from([0, 1, 2, 3, RealKvHashMode.PARTIAL])),
        chain_assert=data.draw(st.sampled_from([0, 1, -3])),
        write_index=data.draw(st.sampled_from([0, 0, 1, 3, 7])),
        slot_count=data.draw(st.integers(0, 5)),
        kernel_count=data.draw(st.integers(0, 5)),
        fill="random",
        generator=torch.Generator().manual_seed(data.draw(st.integers(0, 2**31))),
    )
    # Small positions in many records so chain-position asserts can pass as well as fail.
    f = ctx.canary_buf.view(torch.int64)
    for s in range(num_slots):
        if data.draw(st.booleans()):
            f[s, CANARY_FIELD_POSITION] = data.draw(st.integers(-1, 8))
    return ctx


# --------------------------------------------------------------------------- (b) write
@settings(max_examples=examples(120), **SETTINGS)
@given(data=st.data())
def test_write_matches_oracle(data, make_context, make_source):
    num_slots = data.draw(st.integers(2, 24), label="num_slots")
    ctx = draw_context(data, make_context, make_source, num_slots)
    dtype = data.draw(st.sampled_from([torch.int32, torch.int64]))

    n_req = data.draw(st.integers(0, 5), label="n_req")
    cap = n_req + data.draw(st.integers(0, 2)) or 1
    lengths = [data.draw(st.integers(0, 5)) for _ in range(n_req)]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    offsets += [offsets[-1]] * (cap + 1 - len(offsets))
    total = offsets[-1]
    slot_st = st.integers(-2, num_slots - 1)
    loc = [data.draw(slot_st) for _ in range(total)]
    # seeds: a chain head, any slot (0 included), or a slot written earlier in this launch
    seeds = []
    for r in range(cap):
        earlier = [s for s in loc[: offsets[min(r, n_req)]] if s >= 0]
        choices = [st.just(-1), st.integers(-3, num_slots - 1)] + ([st.sampled_from(earlier)] if earlier else [])
        seeds.append(data.draw(st.one_of(*choices)))
    num_valid = data.draw(st.integers(-1, cap + 2), label="num_valid")
    ids = [data.draw(st.one_of(st.integers(0, 9), I32)) for _ in range(total)]
    sequential = data.draw(st.booleans())
    pos = list(range(total)) if sequential else [data.draw(st.integers(-1, 9)) for _ in range(total)]
    pad = data.draw(st.integers(0, 3))  # CUDA-graph padding past the last offset: never read
    ids += [7] * pad
    pos += [7] * pad
    loc += [10**9] * pad
    input_assert = data.draw(st.booleans())
    exp_tok = [t if data.draw(st.booleans()) else data.draw(I32) for t in ids] if input_assert else None
    exp_pos = [p if data.draw(st.booleans()) else data.draw(st.integers(-2, 9)) for p in pos] if input_assert else None

    plan = WritePlan.allocate(cap, "cpu")
    plan.write_offsets.copy_(torch.tensor(offsets))
    plan.write_seed_slot_indices.copy_(torch.tensor(seeds))
    plan.write_num_valid_reqs.fill_(num_valid)
    plan_before = [plan.write_offsets.clone(), plan.write_seed_slot_indices.clone(), plan.write_num_valid_reqs.clone()]

    want = oracle.OracleCanary.of(ctx)
    oracle.oracle_write(want, offsets=offsets, seeds=seeds, num_valid_reqs=num_valid, input_ids=ids, positions=pos,
                        out_cache_loc=loc, input_assert=input_assert, expected_tokens=exp_tok,
                        expected_positions=exp_pos)
    new_rows = want.write_index - int(ctx.violation_write_index[0])
    event(f"write rows: {min(new_rows, 3)}")
    event(f"ring overflow: {want.write_index > ctx.violation_ring.shape[0]}")
    a = min(max(num_valid, 0), cap)
    written_before = [set(loc[offsets[0]: offsets[r]]) for r in range(a)]
    event(f"seed written earlier in launch: {any(seeds[r] >= 0 and seeds[r] in written_before[r] for r in range(a))}")
    event(f"slot written twice: {len([x for x in loc[: offsets[a]] if x >= 0]) > len({x for x in loc[: offsets[a]] if x >= 0})}")
    use_launcher = data.draw(st.booleans())
    python_scan = data.draw(st.booleans())
    buf_before = ctx.canary_buf.clone()
    sources_before = [src.tensor.contiguous().view(torch.uint8).clone() for src in ctx.real_kv_sources]
    tensors = dict(
        input_ids=torch.tensor(ids, dtype=dtype), positions=torch.tensor(pos, dtype=dtype),
        out_cache_loc=torch.tensor(loc, dtype=torch.int64 if pad else dtype),
        expected_input_tokens=torch.tensor(exp_tok, dtype=dtype) if input_assert else None,
        expected_input_positions=torch.tensor(exp_pos, dtype=dtype) if input_assert else None,
    )
    op = launch_canary_write_kernel if use_launcher else launch_canary_write_kernel_torch_reference
    with chain_scan.python_loop() if python_scan else contextlib.nullcontext():
        op(context=ctx, plan=plan, enable_write_input_assert=input_assert, **tensors)
    oracle.assert_context_matches(ctx, want, buf_before)
    assert all(torch.equal(src.tensor.contiguous().view(torch.uint8), b)  # bytes: NaN patterns != themselves
               for src, b in zip(ctx.real_kv_sources, sources_before))
    for a, b in zip([plan.write_offsets, plan.write_seed_slot_indices, plan.write_num_valid_reqs], plan_before):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- (b) verify
@settings(max_examples=examples(120), **SETTINGS)
@given(data=st.data())
def test_verify_matches_oracle(data, make_context, make_source):
    num_slots = data.draw(st.integers(2, 24), label="num_slots")
    ctx = draw_context(data, make_context, make_source, num_slots)
    # Lay down a few clean chains with the oracle (independent of the write op).
    base = oracle.OracleCanary.of(ctx)
    base.chain_assert = 0
    chains = []
    for _ in range(data.draw(st.integers(0, 3))):
        length = data.draw(st.integers(1, 5))
        slots = [data.draw(st.integers(1, num_slots - 1)) for _ in range(length)]
        toks = [data.draw(st.integers(0, 99)) for _ in range(length)]
        seed = data.draw(st.one_of(st.just(-1), st.integers(0, num_slots - 1)))
        oracle.oracle_write(base, offsets=[0, length], seeds=[seed], num_valid_reqs=1, input_ids=toks,
                            positions=list(range(length)), out_cache_loc=slots, input_assert=False,
                            expected_tokens=None, expected_positions=None)
        chains.append((seed, slots, toks))
    oracle.push_records(ctx, base)
    # Corrupt some records and some real-KV bytes.
    f = ctx.canary_buf.view(torch.int64)
    for _ in range(data.draw(st.integers(0, 3))):
        f[data.draw(st.integers(0, num_slots - 1)), data.draw(st.integers(0, 3))] += data.draw(st.sampled_from([1, -1, 2**40]))
    for src in ctx.real_kv_sources:
        if data.draw(st.booleans()):
            s = data.draw(st.integers(0, num_slots - 1))
            byte = data.draw(st.integers(0, src.num_bytes_per_token - 1))
            row = src.tensor[s // src.page_size].reshape(-1).view(torch.uint8)
            row[(s % src.page_size) * src.num_bytes_per_token + byte] ^= 0x41

    entries = []
    for seed, slots, toks in chains:
        for i, s in enumerate(slots):
            if data.draw(st.booleans()):
                prev = (seed if seed >= 0 else -1) if i == 0 else slots[i - 1]
                entries.append([s, toks[i], i, prev])
    for _ in range(data.draw(st.integers(0, 4))):
        entries.append([data.draw(st.integers(0, num_slots - 1)), data.draw(st.integers(-1, 99)),
                        data.draw(st.integers(-1, 5)), data.draw(st.integers(-3, num_slots - 1))])
    entries = data.draw(st.permutations(entries)) if entries else entries
    for e in entries:  # perturbations: padding slot, unreachable/head predecessor, sentinels, off-by-one
        k = data.draw(st.integers(0, 9))
        if k == 0:
            e[0] = 0
        elif k == 1:
            e[3] = 0
        elif k == 2:
            e[3] = data.draw(st.integers(-5, -1))
        elif k == 3:
            e[1] = -1
        elif k == 4:
            e[1] += 1
        elif k == 5:
            e[2] += 1
    cap = len(entries) + data.draw(st.integers(0, 2)) or 1
    junk = [[data.draw(st.integers(0, num_slots - 1)), 5, 5, data.draw(st.integers(-1, num_slots - 1))] for _ in range(cap - len(entries))]
    cols = list(zip(*(entries + junk)))
    plan = VerifyPlan.allocate(cap, "cpu")
    for arr, col in zip([plan.verify_slot_indices, plan.verify_expected_tokens, plan.verify_expected_positions,
                         plan.verify_prev_slot_indices], cols):
        arr.copy_(torch.tensor(col, dtype=torch.int64))
    num_valid = data.draw(st.one_of(st.just(len(entries)), st.integers(-1, cap + 1)), label="num_valid")
    enable = data.draw(st.sampled_from([1, 1, 1, 0, 2]))
    plan.verify_num_valid.fill_(num_valid)
    plan.enable.fill_(enable)
    check = data.draw(st.booleans())

    want = oracle.OracleCanary.of(ctx)
    oracle.oracle_verify(want, slots=list(cols[0]), expected_tokens=list(cols[1]), expected_positions=list(cols[2]),
                         prev_slots=list(cols[3]), num_valid=num_valid, enable=enable, check_token=check)
    event(f"verify rows: {min(want.write_index - int(ctx.violation_write_index[0]), 3)}")
    event(f"verify hashing: {ctx.hashing_on}")
    buf_before = ctx.canary_buf.clone()
    twin_ctx = clone_context(ctx)
    launch_canary_verify_kernel_torch_reference(context=twin_ctx, plan=plan, check_verify_expected_token=check)
    oracle.assert_context_matches(twin_ctx, want, buf_before)
    launch_canary_verify_kernel(context=ctx, plan=plan, check_verify_expected_token=check)
    oracle.assert_context_matches(ctx, want, buf_before)
    assert torch.equal(ctx.canary_buf, buf_before)


# --------------------------------------------------------------------------- (b) plan
@settings(max_examples=examples(150), **SETTINGS)
@given(data=st.data())
def test_plan_matches_oracle(data):
    max_reqs = data.draw(st.integers(1, 5), label="max_reqs")
    max_len = data.draw(st.integers(1, 8), label="max_len")
    lut_len = data.draw(st.integers(1, 24), label="lut_len")
    use_lut = data.draw(st.booleans())
    # mostly in range of the LUT, sometimes past it (a LUT error), sometimes negative
    cell = st.one_of(st.integers(0, lut_len - 1), st.integers(0, lut_len - 1), st.integers(-1, lut_len + 2))
    r2t = [[data.draw(cell) for _ in range(max_len)] for _ in range(max_reqs)]
    lut = [data.draw(st.integers(-1, 10**12)) for _ in range(lut_len)] if use_lut else None
    bs = data.draw(st.integers(0, 5), label="bs")
    rp = [data.draw(st.integers(0, max_reqs - 1)) for _ in range(bs)]
    prefix = [data.draw(st.integers(-1, max_len)) for _ in range(bs)]
    extend = [data.draw(st.integers(-1, 4)) for _ in range(bs)]
    W = data.draw(st.sampled_from([0, 0, -1, 1, 2, 3, 10]), label="W")
    use_table = data.draw(st.booleans())
    width = data.draw(st.integers(1, 8))
    table = [[data.draw(I32) for _ in range(width)] for _ in range(max_reqs)] if use_table else None
    valid = [data.draw(st.integers(-1, width)) for _ in range(bs)] if use_table else None
    offset = data.draw(st.integers(-2, 2))
    vcap = data.draw(st.integers(1, 20), label="vcap")
    wcap = data.draw(st.integers(1, 6), label="wcap")
    dtype = data.draw(st.sampled_from([torch.int32, torch.int64]))

    def outputs():
        vp, wp = VerifyPlan.allocate(vcap, "cpu"), WritePlan.allocate(wcap, "cpu")
        g = torch.Generator().manual_seed(vcap * 31 + wcap)
        for t in (vp.verify_slot_indices, vp.verify_expected_tokens, vp.verify_expected_positions,
                  vp.verify_prev_slot_indices, wp.write_offsets, wp.write_seed_slot_indices):
            t.copy_(torch.randint(-50, 50, t.shape, generator=g))
        vp.verify_num_valid.fill_(-4)
        vp.enable.fill_(9)
        wp.write_num_valid_reqs.fill_(-6)
        return vp, wp

    vp, wp = outputs()
    old = oracle.OraclePlanOut.of(vp, wp)
    event(f"plan lut: {use_lut}, table: {use_table}, W>0: {W > 0}")
    try:
        want = oracle.oracle_plan(old, req_pool_indices=rp, prefix_lens=prefix, extend_seq_lens=extend,
                                  req_to_token=r2t, swa_window_size=W, lut=lut, verify_capacity=vcap, table=table,
                                  valid_lens=valid, offset=offset)
        error = None
    except ValueError as exc:
        want, error = old, str(exc)
    event(f"plan: {'error' if error else ('overflow' if want.enable == 0 else 'ok')}")

    inputs = dict(
        req_pool_indices=torch.tensor(rp, dtype=dtype), prefix_lens=torch.tensor(prefix, dtype=dtype),
        extend_seq_lens=torch.tensor(extend, dtype=dtype), req_to_token=torch.tensor(r2t, dtype=torch.int32),
        swa_window_size=W, full_to_swa_index_mapping=torch.tensor(lut, dtype=torch.int64) if use_lut else None,
        verify_capacity=vcap,
        req_to_verify_expected_tokens=torch.tensor(table, dtype=torch.int32) if use_table else None,
        req_to_verify_expected_tokens_valid_lens=torch.tensor(valid, dtype=dtype) if use_table else None,
        kv_token_id_vs_position_offset=offset,
    )
    snap = {k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    ops = [launch_canary_plan_kernels_torch_reference]
    if W <= 0 or use_lut:
        ops.append(launch_canary_plan_kernels)
    for op in ops:
        vp, wp = outputs()
        if error is None:
            op(verify_plan_out=vp, write_plan_out=wp, **inputs)
        else:
            with pytest.raises(ValueError) as ei:
                op(verify_plan_out=vp, write_plan_out=wp, **inputs)
            assert str(ei.value) == error
        assert oracle.OraclePlanOut.of(vp, wp) == want
    for k, v in snap.items():
        assert torch.equal(inputs[k], v), k


# --------------------------------------------------------------------------- (b) scatter
@settings(max_examples=examples(100), **SETTINGS)
@given(data=st.data())
def test_scatter_matches_oracle(data):
    rows = data.draw(st.integers(1, 4))
    width = data.draw(st.integers(1, 6))
    flat = [data.draw(st.one_of(st.integers(-5, 50), st.integers(-(2**40), 2**40))) for _ in range(data.draw(st.integers(0, 12)))]
    bs = data.draw(st.integers(0, 4))
    offsets = [data.draw(st.integers(0, len(flat))) for _ in range(bs + 1)]
    rp = [data.draw(st.integers(0, rows - 1)) for _ in range(bs)]
    pool = [[data.draw(st.integers(-9, 9)) for _ in range(width)] for _ in range(rows)]
    want = oracle.oracle_scatter(pool, flat_in=flat, offsets=offsets, req_pool_indices=rp)
    for op in (scatter_req_token_ids_torch_reference, launch_scatter_req_token_ids_kernel):
        out = torch.tensor(pool, dtype=torch.int32)
        flat_t, off_t, rp_t = torch.tensor(flat, dtype=torch.int64), torch.tensor(offsets), torch.tensor(rp, dtype=torch.int64)
        op(flat_in=flat_t, offsets=off_t, req_pool_indices=rp_t, pool_out=out)
        assert out.tolist() == want
        assert flat_t.tolist() == flat and off_t.tolist() == offsets and rp_t.tolist() == rp


# --------------------------------------------------------------------------- (a) clean lifecycles
class _Engine:
    """A toy paged-KV engine: request rows, a slot allocator with reference counts, token histories."""

    def __init__(self, data, *, max_reqs, max_len, num_slots):
        self.data = data
        self.max_len = max_len
        self.free_rows = list(range(1, max_reqs))
        self.free_slots = list(data.draw(st.permutations(range(1, num_slots)), label="slot_order"))
        self.refs = [0] * num_slots
        self.r2t = torch.zeros(max_reqs, max_len, dtype=torch.int32)
        self.history = {}  # row -> tokens (cached + about to be written)
        self.cached = {}  # row -> number of positions whose canary records are written

    def admit(self):
        d = self.data
        if not self.free_rows:
            return
        row = self.free_rows.pop(0)
        donors = [r for r in self.cached if self.cached[r] > 0]
        shared = 0
        if donors and d.draw(st.booleans(), label="share_prefix"):
            donor = d.draw(st.sampled_from(donors))
            shared = d.draw(st.integers(1, self.cached[donor]))
            self.r2t[row, :shared] = self.r2t[donor, :shared]
            for s in self.r2t[row, :shared].tolist():
                self.refs[s] += 1
            self.history[row] = list(self.history[donor][:shared])
        else:
            self.history[row] = []
        self.cached[row] = shared

    def finish(self, row):
        for s in self.r2t[row, : self.cached[row]].tolist():
            self.refs[s] -= 1
            if self.refs[s] == 0:
                self.free_slots.append(s)
        self.r2t[row] = 0
        del self.history[row], self.cached[row]
        self.free_rows.append(row)

    def extend(self, row, n):
        """Allocate n slots for the next n positions; returns (tokens, positions, slots)."""
        p = self.cached[row]
        toks = [self.data.draw(st.integers(0, 50_000)) for _ in range(n)]
        slots = [self.free_slots.pop(0) for _ in range(n)]
        for j, s in enumerate(slots):
            self.refs[s] += 1
            self.r2t[row, p + j] = s
        self.history[row] = self.history[row][:p] + toks
        return toks, list(range(p, p + n)), slots


@settings(max_examples=examples(60), **SETTINGS)
@given(data=st.data())
def test_lifecycle_is_clean(data, make_context, make_source):
    max_reqs, max_len, num_full = 5, 16, 72
    dtype = data.draw(st.sampled_from([torch.int32, torch.int64]), label="dtype")
    swa = data.draw(st.booleans(), label="swa")
    W = data.draw(st.integers(1, 5), label="W") if swa else 0
    if swa:  # full slot -> group slot, a bijection keeping the padding slot 0 in place
        lut = torch.tensor([0] + list(data.draw(st.permutations(range(1, num_full)))), dtype=torch.int64)
    else:
        lut = None
    sources = draw_sources(data, make_source, num_full, max_sources=2)
    mode = data.draw(st.sampled_from([0, 1, 2, 3]), label="mode")
    ctx = make_context(num_slots=num_full, ring_capacity=4, chain_assert=1, sources=sources, mode=mode, fill="random")
    eng = _Engine(data, max_reqs=max_reqs, max_len=max_len, num_slots=num_full)
    vcap = data.draw(st.sampled_from([64, 64, 64, 6]), label="vcap")
    vp, wp = VerifyPlan.allocate(vcap, "cpu"), WritePlan.allocate(max_reqs + 1, "cpu")
    table = torch.zeros(max_reqs, max_len, dtype=torch.int32)
    want_kernel = want_slots = 0
    T = (lambda s: int(lut[s])) if swa else (lambda s: s)

    for _step in range(data.draw(st.integers(1, 6), label="steps")):
        for _ in range(data.draw(st.integers(0, 2))):
            eng.admit()
        batch_rows, prefix, ext, ids, pos, loc = [], [], [], [], [], []
        for row in list(eng.cached):
            room = eng.max_len - eng.cached[row]
            if room == 0 or len(eng.free_slots) == 0:
                eng.finish(row)
                continue
            if not data.draw(st.booleans(), label="in_batch"):
                continue
            n = data.draw(st.integers(1, min(room, 4, len(eng.free_slots))), label="extend")
            batch_rows.append(row)
            prefix.append(eng.cached[row])
            ext.append(n)
            t, p, s = eng.extend(row, n)
            ids += t
            pos += p
            loc += [T(x) for x in s]
        if data.draw(st.booleans(), label="padding_row"):  # engine padding row
            batch_rows.append(0)
            prefix.append(data.draw(st.integers(0, max_len)))
            ext.append(data.draw(st.integers(0, 3)))
        pad = data.draw(st.integers(0, 2))  # graph padding entries past the total: never read
        ids, pos, loc = ids + [0] * pad, pos + [0] * pad, loc + [-1] * pad

        bs = len(batch_rows)
        # expected-token table via the scatter op (histories, valid = all known tokens)
        flat = [tok for r in batch_rows for tok in eng.history.get(r, [])]
        offs = [0]
        for r in batch_rows:
            offs.append(offs[-1] + len(eng.history.get(r, [])))
        launch_scatter_req_token_ids_kernel(flat_in=torch.tensor(flat, dtype=torch.int64),
                                            offsets=torch.tensor(offs, dtype=torch.int64),
                                            req_pool_indices=torch.tensor(batch_rows, dtype=torch.int64),
                                            pool_out=table)
        valid = [len(eng.history.get(r, [])) for r in batch_rows]

        launch_canary_plan_kernels(
            verify_plan_out=vp, write_plan_out=wp, req_pool_indices=torch.tensor(batch_rows, dtype=dtype),
            prefix_lens=torch.tensor(prefix, dtype=dtype), extend_seq_lens=torch.tensor(ext, dtype=dtype),
            req_to_token=eng.r2t, swa_window_size=W, full_to_swa_index_mapping=lut, verify_capacity=vcap,
            req_to_verify_expected_tokens=table, req_to_verify_expected_tokens_valid_lens=torch.tensor(valid, dtype=dtype),
            kv_token_id_vs_position_offset=0,
        )
        n_verify = sum(len(range(max(0, P - W) if W else 0, P)) for r, P in zip(batch_rows, prefix) if r != 0)
        assert int(wp.write_num_valid_reqs[0]) == bs
        assert int(wp.write_offsets[bs]) == len(ids) - pad
        if n_verify <= vcap:
            assert int(vp.verify_num_valid[0]) == n_verify and int(vp.enable[0]) == 1
            want_slots += n_verify
        else:
            assert int(vp.enable[0]) == 0
        launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=True)
        assert int(ctx.violation_write_index[0]) == 0, ctx.violation_ring.tolist()
        t = torch.tensor(ids, dtype=dtype)
        launch_canary_write_kernel(
            context=ctx, plan=wp, input_ids=t, positions=torch.tensor(pos, dtype=dtype),
            out_cache_loc=torch.tensor(loc, dtype=dtype), enable_write_input_assert=True,
            expected_input_tokens=t.clone(), expected_input_positions=torch.tensor(pos, dtype=dtype),
        )
        want_kernel += 2
        want_slots += len(ids) - pad
        assert int(ctx.violation_write_index[0]) == 0, ctx.violation_ring.tolist()
        for r, n in zip(batch_rows, ext):
            if r != 0:
                eng.cached[r] += n
        assert int(ctx.kernel_run_counter[0]) == want_kernel and int(ctx.slot_run_counter[0]) == want_slots

    # Every live record holds exactly the chain of its request's history.
    f = ctx.canary_buf.view(torch.int64)
    for row, n in eng.cached.items():
        h = H0
        for p in range(n):
            s = T(int(eng.r2t[row, p]))
            tok = eng.history[row][p]
            assert [int(f[s, CANARY_FIELD_TOKEN]), int(f[s, CANARY_FIELD_POSITION]),
                    int(f[s, CANARY_FIELD_PREV_HASH])] == [tok, p, s64(h)]
            h = mix3(h, tok, p)
    # A sweep over every live slot (full chains, tokens checked) is clean too.
    entries = []
    for row, n in eng.cached.items():
        for p in range(n):
            prev = T(int(eng.r2t[row, p - 1])) if p > 0 else -1
            entries.append((T(int(eng.r2t[row, p])), eng.history[row][p], p, prev))
    if entries:
        sweep = VerifyPlan.allocate(len(entries), "cpu")
        for arr, col in zip([sweep.verify_slot_indices, sweep.verify_expected_tokens,
                             sweep.verify_expected_positions, sweep.verify_prev_slot_indices], zip(*entries)):
            arr.copy_(torch.tensor(col, dtype=torch.int64))
        sweep.verify_num_valid.fill_(len(entries))
        launch_canary_verify_kernel(context=ctx, plan=sweep, check_verify_expected_token=True)
        assert int(ctx.violation_write_index[0]) == 0, ctx.violation_ring.tolist()
        assert int(ctx.slot_run_counter[0]) == want_slots + len(entries)
    assert ctx.violation_ring.eq(-77).all()
