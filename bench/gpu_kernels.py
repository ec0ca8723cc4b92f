"""GPU benchmark of the Triton canary kernels against floors measured in the same run (docs/design.md §7).

Floors first: device copy bandwidth; a bare gather kernel (own record + predecessor record +
plan arrays, no hashing) on a paged layout (16-slot pages in random order) and on fully random
slots; the latency of one chain-recurrence step (a kernel that runs only the recurrence over
128k tokens); the cost of a dependent launch in a CUDA graph (empty kernels, with and without
programmatic dependent launch). Then the canary ops, each as a rate or a time beside its floor
and target:

* verify / plan throughput, write 4096 x 1 token and 1 x 128k tokens (as in runs 1-7);
* the decode step of 64 requests x 4k context in one CUDA graph: mark + plan + HEAD verify +
  HEAD write + TAIL_K / TAIL_V verify + write (PARTIAL, 2 sources each) + stamps of the three
  tags; every op first on its own (its own graph), then the step, then variants;
* TAIL cost per prefill token on the transformers continuous-batching cache layout (flat cache,
  per-layer row-strided K / V views, page 32, 16 layers, 8 x 64 bf16 heads; first and last layer
  hashed): whether the launches reach Triton, and the time per token.

With ``--before DIR`` (a folder holding the package ``kvc_before``: the Triton modules of an
earlier commit), the same step and prefill cases also run on the earlier kernels ("before" rows).
``--quick``: only the launch floor, write 4096 x 1 and the decode step (per op, step, the two
one-launch paths against the multi-launch ones); with ``--verify-sweep`` also the verifies and the step over a
few verify launch shapes (block, programs per SM, warps). ``--dry-run``: tiny sizes on the CPU under the
Triton interpreter, host timers (checks the script).
Run: PYTHONPATH=src python bench/gpu_kernels.py [--before DIR]. Prints a table last.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time

import torch

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kvcanary.ops import (  # noqa: E402
    CanaryLaunchTag,
    RealKvHashMode,
    RealKvSource,
    VerifyOrWriteContext,
    VerifyPlan,
    WritePlan,
    launch_canary_plan_kernels,
    launch_canary_verify_kernel,
    launch_canary_write_kernel,
)
from kvcanary.ops.hashing import CHAIN_HEAD_HASH, to_signed64  # noqa: E402
from kvcanary.ops.reference.common import slot_hash  # noqa: E402
from kvcanary.ops.reference.real_kv import fingerprint_slots  # noqa: E402
from kvcanary.ops.triton import plan as tplan, stamp as tstamp, verify as tverify, write as twrite  # noqa: E402
from kvcanary.ops.triton.hashing import as_i64, as_u64, mix3  # noqa: E402
from kvcanary.ops.triton.launch import pdl_release, pdl_wait  # noqa: E402
from twin_fallbacks import count_twin_fallbacks  # noqa: E402  (bench/twin_fallbacks.py)

DEV = "cpu" if DRY else "cuda"
if DRY:  # Triton 3.6's interpreter vs numpy >= 2.4: loop bounds read from memory (see the tests)
    from triton.runtime import interpreter as _interp

    _patch = _interp._patch_lang_tensor

    def _patched(tensor, scope):
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interp._patch_lang_tensor = _patched
S = 1 / 64 if DRY else 1.0  # size scale
ROWS: list[tuple] = []


def sync():
    if not DRY:
        torch.cuda.synchronize()


def bench_graph(fn, reps=20, iters=10):
    """Median ms per call of ``fn`` captured ``iters`` times in one CUDA graph (host timer in a
    dry run)."""
    fn()
    sync()
    if DRY:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    sync()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        sync()
        times.append(a.elapsed_time(b) / iters)
    times.sort()
    return times[len(times) // 2]


def bench(fn, reps=30):
    """Median ms per call, eager launches."""
    if DRY:
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return triton.testing.do_bench(fn, warmup=25, rep=reps * 4, return_mode="median")


# --------------------------------------------------------------------------- floors


@triton.jit
def _gather_floor_kernel(fields_ptr, slot_ptr, tok_ptr, pos_ptr, prev_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros([BLOCK], tl.int64)
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        idx = start + tl.arange(0, BLOCK)
        m = idx < n
        s = tl.load(slot_ptr + idx, mask=m, other=0)
        p = tl.load(prev_ptr + idx, mask=m, other=0)
        t = tl.load(tok_ptr + idx, mask=m, other=0)
        q = tl.load(pos_ptr + idx, mask=m, other=0)
        own = tl.load(fields_ptr + (s * 4)[:, None] + tl.arange(0, 4)[None, :], mask=m[:, None], other=0)
        pre = tl.load(fields_ptr + (p * 4)[:, None] + tl.arange(0, 4)[None, :], mask=m[:, None] & (p > 0)[:, None], other=0)
        acc ^= tl.sum(own ^ pre, 1) ^ t ^ q
    tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), acc)


@triton.jit
def _recurrence_floor_kernel(out_ptr, n, UNROLL: tl.constexpr):
    h = as_u64(tl.load(out_ptr))
    for i in tl.range(0, n, loop_unroll_factor=UNROLL):
        v = as_u64(tl.zeros([], tl.int64) + i)
        h = mix3(h, v, v)
    tl.store(out_ptr, as_i64(h))


@triton.jit
def _empty_kernel(x_ptr, PDL: tl.constexpr):
    pdl_wait(PDL)
    pdl_release(PDL)
    if tl.program_id(0) == 1 << 30:  # never: keeps an argument alive
        tl.store(x_ptr, 1)


def floors(n_entries, quick=False):
    sms = 4 if DRY else torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.empty(int((1 << 30) * S), dtype=torch.uint8, device=DEV).random_()
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    out = {"copy_GBps": 2 * x.numel() / ms / 1e6}
    del x, y
    if quick:
        return out | _launch_floor()
    fields = torch.randint(-(2**62), 2**62, (n_entries, 4), device=DEV)
    tok = torch.randint(0, 1 << 20, (n_entries,), device=DEV)
    pos = torch.randint(0, 1 << 20, (n_entries,), device=DEV)
    sink = torch.empty(sms * 8 * 1024, dtype=torch.int64, device=DEV)
    for layout in ("paged", "random"):
        slot, prev = layout_slots(layout, n_entries)
        grid = (sms * 4,)
        ms = bench(lambda: _gather_floor_kernel[grid](fields, slot, tok, pos, prev, sink, n_entries, BLOCK=1024, num_warps=8))
        out[f"gather_{layout}"] = n_entries / ms / 1e6  # G entries/s
    rec = torch.zeros(1, dtype=torch.int64, device=DEV)
    n = int(128 * 1024 * S)
    ms = bench(lambda: _recurrence_floor_kernel[(1,)](rec, n, UNROLL=4, num_warps=1))
    out["step_ns"] = ms * 1e6 / n
    out["recurrence_128k_ms"] = ms / S
    return out | _launch_floor()


def _launch_floor():
    """us per dependent launch of an empty 132-program kernel, 13 in a row in one graph."""
    rec = torch.zeros(1, dtype=torch.int64, device=DEV)
    out = {}
    for pdl in (False, True):
        use = pdl and not DRY
        us = bench_graph(lambda: [_empty_kernel[(132,)](rec, PDL=use, num_warps=4, launch_pdl=use) for _ in range(13)]) * 1e3
        out[f"launch_us_pdl{int(pdl)}"] = us / 13
    return out


def layout_slots(layout, n, page=16):
    """Slots 1.. in 16-slot pages placed in random order (paged) or a random permutation; each
    entry's predecessor is the previous slot of its sequence (sequences of 4096 tokens)."""
    if layout == "paged":
        pages = torch.randperm(n // page, device=DEV)
        slot = (pages[:, None] * page + torch.arange(page, device=DEV)).reshape(-1)
    else:
        slot = torch.randperm(n, device=DEV)
    slot = slot + 1
    prev = torch.roll(slot, 1)
    prev[::4096] = -1
    return slot.contiguous(), prev.contiguous()


def make_ctx(num_slots, sources=(), mode=RealKvHashMode.NONE, kind=2, ring=None, widx=None):
    return VerifyOrWriteContext(
        canary_buf=torch.zeros(num_slots, 32, dtype=torch.uint8, device=DEV), kernel_kind=kind,
        violation_ring=ring if ring is not None else torch.zeros(4096, 8, dtype=torch.int64, device=DEV),
        violation_write_index=widx if widx is not None else torch.zeros(1, dtype=torch.int32, device=DEV),
        slot_run_counter=torch.zeros(1, dtype=torch.int64, device=DEV),
        kernel_run_counter=torch.zeros(1, dtype=torch.int64, device=DEV),
        real_kv_sources=tuple(sources), real_kv_hash_mode=mode,
        enable_chain_position_assert=torch.ones(1, dtype=torch.int32, device=DEV),
    )


def kv_sources(num_slots, nbpt=256, n=2):
    return [RealKvSource(tensor=torch.empty(-(-num_slots // 16), 16 * nbpt // 2, dtype=torch.bfloat16, device=DEV).normal_(),
                         page_size=16, num_bytes_per_token=nbpt, read_bytes=nbpt) for _ in range(n)]


def verify_case(layout, n, mode, nsrc, config=tverify.DEFAULT_VERIFY_CONFIG):
    slot, prev = layout_slots(layout, n)
    srcs = kv_sources(n + 16, n=nsrc) if nsrc else ()
    ctx = make_ctx(n + 16, srcs, mode)
    vp = VerifyPlan.allocate(n, DEV)
    vp.verify_slot_indices.copy_(slot)
    vp.verify_prev_slot_indices.copy_(prev)
    vp.verify_expected_positions.copy_(torch.arange(n, device=DEV))
    vp.verify_expected_tokens.fill_(-1)
    vp.verify_num_valid.fill_(n)
    # Records consistent with the plan, so the run records no violations: positions, real-KV
    # fingerprints, then prev_hash filled position by position along the 4096-token sequences.
    f = ctx.canary_buf.view(torch.int64)
    f[slot, 1] = torch.arange(n, device=DEV)
    f[slot, 3] = fingerprint_slots(ctx.real_kv_sources, ctx.real_kv_hash_mode, slot, f.device)
    seq = min(4096, n)
    heads = torch.arange(0, n, seq, device=DEV)
    f[slot[heads], 2] = to_signed64(CHAIN_HEAD_HASH)
    for k in range(1, seq):
        f[slot[heads + k], 2] = slot_hash(f, slot[heads + k - 1])
    ms = bench(lambda: tverify.launch_verify(context=ctx, plan=vp, check_verify_expected_token=False, config=config))
    return n / ms / 1e6, ms, int(ctx.violation_write_index[0])


def plan_case(bs, prefix, extend=1):
    num_slots = bs * (prefix + extend + 16) + 16
    pages = torch.randperm(num_slots // 16 - 1, device=DEV)[: bs * ((prefix + extend + 15) // 16)] + 1
    rtt = (pages.reshape(bs, -1)[:, :, None] * 16 + torch.arange(16, device=DEV)).reshape(bs, -1).to(torch.int32)
    rtt = torch.cat([torch.zeros(1, rtt.shape[1], dtype=torch.int32, device=DEV), rtt])
    v_cap = bs * (prefix + extend)
    vp, wp = VerifyPlan.allocate(v_cap, DEV), WritePlan.allocate(bs, DEV)
    kw = dict(verify_plan_out=vp, write_plan_out=wp, req_pool_indices=torch.arange(1, bs + 1, device=DEV),
              prefix_lens=torch.full((bs,), prefix, device=DEV),
              extend_seq_lens=torch.full((bs,), extend, dtype=torch.int64, device=DEV),
              req_to_token=rtt, swa_window_size=0, full_to_swa_index_mapping=None, verify_capacity=v_cap,
              req_to_verify_expected_tokens=None, req_to_verify_expected_tokens_valid_lens=None,
              kv_token_id_vs_position_offset=0)
    return kw, rtt, num_slots


# --------------------------------------------------------------------------- op sets


@dataclasses.dataclass(frozen=True)
class Ops:
    """One implementation of the four ops, called with the Triton launchers' keywords."""

    name: str
    plan: object
    verify: object
    write: object
    stamp: object  # None: no stamp op in this set
    verify_many: object = None  # TAIL K + V verified in one launch (None: one launch per buffer)
    write_many: object = None  # TAIL K + V written in one launch
    stamp_stacked: bool = False  # the step's three rings stamped by one launch


def new_ops(name="default", *, plan_cfg=None, verify_cfg=None, write_cfg=None, pdl=True, fused=True):
    plan_cfg = plan_cfg or tplan.DEFAULT_PLAN_CONFIG
    verify_cfg = verify_cfg or tverify.DEFAULT_VERIFY_CONFIG
    write_cfg = write_cfg or twrite.DEFAULT_WRITE_CONFIG
    if not pdl:
        plan_cfg = dataclasses.replace(plan_cfg, pdl=False)
        verify_cfg = dataclasses.replace(verify_cfg, pdl=False)
        write_cfg = dataclasses.replace(write_cfg, pdl=False)
    return Ops(
        name=name,
        plan=lambda **kw: tplan.launch_plan(config=plan_cfg, **kw),
        verify=lambda **kw: tverify.launch_verify(config=verify_cfg, **kw),
        write=lambda **kw: twrite.launch_write(config=write_cfg, **kw),
        stamp=lambda **kw: tstamp.launch_stamp(pdl=pdl, **kw),
        verify_many=(lambda **kw: tverify.launch_verify_many(config=verify_cfg, **kw)) if fused else None,
        write_many=(lambda **kw: twrite.launch_write_many(config=write_cfg, **kw)) if fused else None,
        stamp_stacked=fused,
    )


def before_ops(path):
    sys.path.insert(0, path)
    import kvc_before.plan as bp
    import kvc_before.verify as bv
    import kvc_before.write as bw
    return Ops(name="before", plan=bp.launch_plan, verify=bv.launch_verify, write=bw.launch_write, stamp=None)


# --------------------------------------------------------------------------- decode step


class DecodeStep:
    """64 requests x 4k context, one new token each: HEAD (NONE) and TAIL_K / TAIL_V (PARTIAL,
    2 sources each) buffers prefilled clean; rings stacked per tag as the runtime keeps them."""

    TAGS = (CanaryLaunchTag.HEAD_K_FULL, CanaryLaunchTag.TAIL_K_FULL, CanaryLaunchTag.TAIL_V_FULL)

    def __init__(self, bs=64, ctx_len=4096):
        ctx_len = max(64, int(ctx_len * S))
        self.bs, self.ctx_len = bs, ctx_len
        kw, rtt, num_slots = plan_case(bs, ctx_len)
        self.plan_kw, self.rtt = kw, rtt
        self.vp, self.wp = kw["verify_plan_out"], kw["write_plan_out"]
        cap = 4096
        self.rings = torch.zeros(3, cap, 8, dtype=torch.int64, device=DEV)
        self.widx = torch.zeros(3, dtype=torch.int32, device=DEV)
        self.rows_from = torch.zeros(3, dtype=torch.int32, device=DEV)
        self.stamps = torch.full((3, cap, 3), -1, dtype=torch.int64, device=DEV)
        self.step_no = torch.zeros(1, dtype=torch.int64, device=DEV)
        self.ctxs = [
            make_ctx(num_slots, (), RealKvHashMode.NONE, kind=int(self.TAGS[0]), ring=self.rings[0], widx=self.widx[0:1]),
            make_ctx(num_slots, kv_sources(num_slots), RealKvHashMode.PARTIAL, kind=int(self.TAGS[1]),
                     ring=self.rings[1], widx=self.widx[1:2]),
            make_ctx(num_slots, kv_sources(num_slots), RealKvHashMode.PARTIAL, kind=int(self.TAGS[2]),
                     ring=self.rings[2], widx=self.widx[2:3]),
        ]
        for c in self.ctxs:
            c.enable_chain_position_assert.zero_()
        self.winputs = dict(input_ids=torch.randint(0, 1000, (bs,), device=DEV),
                            positions=torch.full((bs,), ctx_len, device=DEV),
                            out_cache_loc=rtt[1:, ctx_len].to(torch.int64).contiguous(),
                            enable_write_input_assert=False, expected_input_tokens=None, expected_input_positions=None)
        # Prefill every buffer (bs x ctx_len tokens) so the step's verifies are clean.
        pre = dict(kw, prefix_lens=torch.zeros(bs, dtype=torch.int64, device=DEV),
                   extend_seq_lens=torch.full((bs,), ctx_len, dtype=torch.int64, device=DEV))
        launch_canary_plan_kernels(**pre)
        pkw = dict(input_ids=torch.randint(0, 1000, (bs * ctx_len,), device=DEV),
                   positions=torch.arange(ctx_len, device=DEV).repeat(bs),
                   out_cache_loc=rtt[1:, :ctx_len].reshape(-1).to(torch.int64), enable_write_input_assert=False,
                   expected_input_tokens=None, expected_input_positions=None)
        for c in self.ctxs:
            launch_canary_write_kernel(context=c, plan=self.wp, **pkw)
        launch_canary_plan_kernels(**kw)
        sync()

    # the ops of one step, each a callable
    def mark(self):
        self.rows_from.copy_(self.widx)

    def plan(self, ops):
        ops.plan(**self.plan_kw)

    def verify(self, ops, i):
        ops.verify(context=self.ctxs[i], plan=self.vp, check_verify_expected_token=False)

    def write(self, ops, i):
        ops.write(context=self.ctxs[i], plan=self.wp, **self.winputs)

    def verify_tail(self, ops):
        ops.verify_many(contexts=self.ctxs[1:], plan=self.vp, check_verify_expected_token=False)

    def write_tail(self, ops):
        ops.write_many(contexts=self.ctxs[1:], plan=self.wp, **self.winputs)

    def stamp(self, ops, i, k=1):
        """Stamp rings i .. i+k-1 (k > 1: one stacked launch)."""
        sl = slice(i, i + k) if k > 1 else i
        ops.stamp(violation_ring=self.rings[sl], violation_write_index=self.widx[i:i + k],
                  rows_from=self.rows_from[i:i + k], stamps=self.stamps[sl], step=self.step_no,
                  verify_plan=self.vp, write_plan=self.wp, out_cache_loc=self.winputs["out_cache_loc"],
                  positions=self.winputs["positions"], req_pool_indices=self.plan_kw["req_pool_indices"],
                  prefix_lens=self.plan_kw["prefix_lens"], swa_window_size=0)

    def step(self, ops, stamps=True):
        if stamps and ops.stamp is not None:
            self.mark()
        self.plan(ops)
        if ops.verify_many is not None:
            self.verify(ops, 0)
            self.write(ops, 0)
            self.verify_tail(ops)
            self.write_tail(ops)
        else:
            for i in range(3):
                self.verify(ops, i)
                self.write(ops, i)
        if stamps and ops.stamp is not None:
            if ops.stamp_stacked:
                self.stamp(ops, 0, k=3)
            else:
                for i in range(3):
                    self.stamp(ops, i)

    def per_op(self, ops):
        """us per op, each captured on its own."""
        out = {"plan": bench_graph(lambda: self.plan(ops)) * 1e3,
               "HEAD verify (NONE)": bench_graph(lambda: self.verify(ops, 0)) * 1e3,
               "HEAD write": bench_graph(lambda: self.write(ops, 0)) * 1e3,
               "TAIL verify (PARTIAL 2 src)": bench_graph(lambda: self.verify(ops, 1)) * 1e3,
               "TAIL write": bench_graph(lambda: self.write(ops, 1)) * 1e3}
        if ops.verify_many is not None:
            out["TAIL verify K+V (one launch)"] = bench_graph(lambda: self.verify_tail(ops)) * 1e3
            out["TAIL write K+V (one launch)"] = bench_graph(lambda: self.write_tail(ops)) * 1e3
        if ops.stamp is not None:
            out["stamp (no rows)"] = bench_graph(lambda: self.stamp(ops, 1)) * 1e3
            if ops.stamp_stacked:
                out["stamp 3 rings (one launch)"] = bench_graph(lambda: self.stamp(ops, 0, k=3)) * 1e3
            out["mark (torch copy)"] = bench_graph(self.mark) * 1e3
        return out

    def launches(self, ops):
        """Default launch shapes: mark, plan (one launch up to 256 rows), 3 writes (one kernel up to 256
        requests each), verifies (HEAD + one for TAIL K and V, or 3), stamps (one stacked, or 3)."""
        per = 1 if self.bs <= 256 else 2
        verifies = 2 if ops.verify_many is not None else 3
        writes = 2 if ops.write_many is not None and self.bs <= 256 else 3 * per
        stamps = 1 if ops.stamp_stacked else 3
        return 1 + per + writes + verifies + stamps


# --------------------------------------------------------------------------- prefill (transformers layout)


class PrefillLayout:
    """The transformers CB cache: one flat uint8 tensor of blocks; a block holds, per layer, a page
    of K then a page of V (page tokens x H x D bf16). Sources: row-strided [blocks, page*H*D]
    views of the first and last layer's K (TAIL_K) and V (TAIL_V)."""

    LAYERS, HEADS, DIM, PAGE = 16, 8, 64, 32

    def __init__(self, reqs=8, tokens=2048, contiguous=False):
        tokens = max(64, int(tokens * S))
        self.reqs, self.tokens = reqs, tokens
        per_token = self.HEADS * self.DIM  # bf16 elements
        per_page = self.PAGE * per_token
        per_block = self.LAYERS * 2 * per_page
        blocks_needed = reqs * 2 * tokens // self.PAGE
        self.total_blocks = blocks_needed + 2 + 8
        flat = torch.empty(self.total_blocks * per_block * 2, dtype=torch.uint8, device=DEV).random_()
        blocks = flat.view(torch.bfloat16).view(-1, 2, self.HEADS, self.DIM).reshape(-1).view(self.total_blocks, -1)

        def view(layer, side):
            cols = slice((2 * layer + side) * per_page, (2 * layer + side + 1) * per_page)
            v = blocks[:, cols]
            return v.contiguous() if contiguous else v

        nbpt = per_token * 2
        self.sources = {
            side: tuple(RealKvSource(tensor=view(layer, s), page_size=self.PAGE, num_bytes_per_token=nbpt,
                                     read_bytes=nbpt) for layer in (0, self.LAYERS - 1))
            for s, side in enumerate("kv")
        }
        self.num_slots = self.total_blocks * self.PAGE
        # Requests: 2 x tokens positions each on random data blocks (>= 2: the trash sectors).
        order = torch.randperm(blocks_needed, device=DEV) + 2
        per_req = 2 * tokens // self.PAGE
        rtt = (order.reshape(reqs, per_req)[:, :, None] * self.PAGE + torch.arange(self.PAGE, device=DEV)).reshape(reqs, -1)
        self.rtt = torch.cat([torch.zeros(1, rtt.shape[1], dtype=torch.int64, device=DEV), rtt]).to(torch.int32)
        self.ctxs = {side: make_ctx(self.num_slots, self.sources[side], RealKvHashMode.PARTIAL,
                                    kind=int(CanaryLaunchTag.TAIL_K_FULL) + s)
                     for s, side in enumerate("kv")}
        self.ctx_none = make_ctx(self.num_slots, (), RealKvHashMode.NONE, kind=int(CanaryLaunchTag.TAIL_K_FULL))

    def chunk(self, prefix):
        """Plans and write inputs of one step: every request writes positions [prefix, prefix + tokens)."""
        bs, t = self.reqs, self.tokens
        vp, wp = VerifyPlan.allocate(bs * (prefix + 1), DEV), WritePlan.allocate(bs, DEV)
        launch_canary_plan_kernels(
            verify_plan_out=vp, write_plan_out=wp, req_pool_indices=torch.arange(1, bs + 1, device=DEV),
            prefix_lens=torch.full((bs,), prefix, device=DEV), extend_seq_lens=torch.full((bs,), t, device=DEV),
            req_to_token=self.rtt, swa_window_size=0, full_to_swa_index_mapping=None,
            verify_capacity=bs * (prefix + 1), req_to_verify_expected_tokens=None,
            req_to_verify_expected_tokens_valid_lens=None, kv_token_id_vs_position_offset=0)
        w = dict(input_ids=torch.randint(0, 1000, (bs * t,), device=DEV),
                 positions=(prefix + torch.arange(t, device=DEV)).repeat(bs),
                 out_cache_loc=self.rtt[1:, prefix:prefix + t].reshape(-1).to(torch.int64).contiguous(),
                 enable_write_input_assert=False, expected_input_tokens=None, expected_input_positions=None)
        return vp, wp, w

    def run(self, ops, vp, wp, w, sides="kv", none=False):
        for side in sides:
            ctx = self.ctx_none if none else self.ctxs[side]
            ops.verify(context=ctx, plan=vp, check_verify_expected_token=False)
            ops.write(context=ctx, plan=wp, **w)


# --------------------------------------------------------------------------- main


def write_4096(ops):
    """us per launch of a write of 4096 one-token requests (PARTIAL, 2 sources), in a graph."""
    bs = max(64, int(4096 * S))
    nsl = int((1 << 20) * S)
    ctx = make_ctx(nsl, kv_sources(nsl, n=2), RealKvHashMode.PARTIAL)
    ctx.enable_chain_position_assert.zero_()
    wp = WritePlan.allocate(bs, DEV)
    wp.write_offsets.copy_(torch.arange(bs + 1, device=DEV))
    wp.write_seed_slot_indices.copy_(torch.randperm(nsl // 2, device=DEV)[:bs] + 1)
    wp.write_num_valid_reqs.fill_(bs)
    wkw = dict(input_ids=torch.randint(0, 1000, (bs,), device=DEV), positions=torch.randint(0, 1000, (bs,), device=DEV),
               out_cache_loc=torch.randperm(nsl // 2, device=DEV)[:bs] + nsl // 2, enable_write_input_assert=False,
               expected_input_tokens=None, expected_input_positions=None)
    return bench_graph(lambda: ops.write(context=ctx, plan=wp, **wkw)) * 1e3


def quick(fl, default, no_pdl, sweep=False):
    """The short run: write 4096 x 1, the decode step per op and whole, one-launch paths vs the
    multi-launch ones; then the table."""
    w4096 = write_4096(default)
    print(f"write 4096 one-token requests [default]: {w4096:.1f} us per launch (graph)")
    d = DecodeStep()
    n_launch = d.launches(default)
    print(f"decode step: {d.bs} requests x {d.ctx_len} context, {d.bs * d.ctx_len} verify entries per buffer, "
          f"{n_launch} launches (mark + plan + HEAD verify + write + TAIL K+V verify + write + one stamp of 3 rings)")
    sets = [default, new_ops("one launch per buffer", fused=False)]
    per_op = {o.name: d.per_op(o) for o in sets}
    for name in per_op[default.name]:
        cells = "  ".join(f"{o.name}: {per_op[o.name][name]:6.1f}" for o in sets if name in per_op[o.name])
        print(f"  per op (own graph) {name:28s} {cells} us")
    steps = {}
    for o in sets + [no_pdl]:
        steps[o.name] = bench_graph(lambda: d.step(o)) * 1e3
        print(f"decode step [{o.name}]: {steps[o.name]:.1f} us")
    sync()
    print("decode-step violations (HEAD, TAIL_K, TAIL_V):", d.widx.tolist())
    if sweep:
        verify_sweep(d)
    lf = fl["launch_us_pdl1"]
    bytes_step = d.bs * d.ctx_len * (32 + 3 * 56 + 2 * 2 * 64)
    floor_us = bytes_step / (fl["copy_GBps"] * 1e3)
    print()
    print(f"{'figure':40s} {'measured':>14s} {'floor (same run)':>24s} {'of floor':>9s} {'target':>14s}  ok")
    rows = [
        ("device copy", f"{fl['copy_GBps'] / 1e3:.2f} TB/s", "", "", "", ""),
        ("dependent launch (graph)", f"{fl['launch_us_pdl0']:.2f} us", "", "", f"PDL: {lf:.2f} us", ""),
        ("write 4096 x 1 token", f"{w4096:.1f} us", f"{2 * lf:.1f} us (2 launches)", "", "<= 10 us", w4096 <= 10),
        (f"decode step 64 x 4k ({n_launch} launches)", f"{steps['default']:.1f} us", f"{floor_us + n_launch * lf:.1f} us",
         f"{steps['default'] / (floor_us + n_launch * lf):.2f}x", "<= 50 us", steps["default"] <= 50),
        ("  of which TAIL verify K+V (one launch)", f"{per_op['default']['TAIL verify K+V (one launch)']:.1f} us", "", "",
         "", ""),
        ("  of which TAIL write K+V (one launch)", f"{per_op['default']['TAIL write K+V (one launch)']:.1f} us", "", "",
         "", ""),
        ("  (one launch per buffer: TAIL verify x 2)", f"{2 * per_op['default']['TAIL verify (PARTIAL 2 src)']:.1f} us",
         "", "", "", ""),
    ]
    for row in rows:
        print(f"{row[0]:40s} {row[1]:>14s} {row[2]:>24s} {row[3]:>9s} {row[4]:>14s}  {row[5] if row[5] != '' else ''}")
    print(f"(decode-step floor = its bytes at the measured copy rate, {floor_us:.1f} us, plus {n_launch} dependent "
          f"launches at the PDL launch cost)")


VERIFY_SWEEP = ((128, 32, 4), (64, 32, 2), (64, 32, 4), (128, 16, 4), (128, 8, 4), (256, 32, 4), (256, 16, 8),
                (256, 8, 8), (512, 8, 8), (512, 4, 16))


def verify_sweep(d: DecodeStep):
    """Launch shapes (block, programs per SM, warps) of the verifies against the decode step: the TAIL K+V
    launch, the HEAD launch and the whole step with that shape, in us (graph); the default shape first."""
    print("verify launch shapes (block, programs/SM, warps): HEAD (NONE), TAIL K+V, step, us")
    best = None
    for block, per_sm, warps in VERIFY_SWEEP:
        cfg = tverify.VerifyLaunchConfig(block=block, programs_per_sm=per_sm, num_warps=warps)
        o = new_ops(f"verify {block}/{per_sm}/{warps}", verify_cfg=cfg)
        head = bench_graph(lambda: d.verify(o, 0)) * 1e3
        tail = bench_graph(lambda: d.verify_tail(o)) * 1e3
        step = bench_graph(lambda: d.step(o)) * 1e3
        print(f"  {block:4d} {per_sm:3d} {warps:3d}   HEAD {head:6.1f}   TAIL K+V {tail:6.1f}   step {step:6.1f}")
        if best is None or step < best[0]:
            best = (step, block, per_sm, warps)
    print(f"fastest step: {best[0]:.1f} us at block {best[1]}, {best[2]} programs/SM, {best[3]} warps")


def pdl_probe():
    """Capture two dependent PDL launches in a graph; if that fails, turn PDL off everywhere
    (the launchers' defaults included) and say so."""
    x = torch.zeros(1, dtype=torch.int64, device=DEV)
    try:
        bench_graph(lambda: [_empty_kernel[(4,)](x, PDL=True, num_warps=4, launch_pdl=True) for _ in range(2)], reps=3)
        print("PDL probe: launches with programmatic dependent launch captured and replayed")
    except Exception as exc:  # noqa: BLE001 - report and carry on without PDL
        print(f"PDL probe FAILED ({type(exc).__name__}: {exc}); PDL turned off for this run")
        for module in (tplan, tverify, twrite, tstamp):
            module.pdl_enabled = lambda device, wanted: False


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", default=None, help="folder holding the package kvc_before")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--verify-sweep", action="store_true",
                        help="with --quick: time the verifies and the decode step over a few launch shapes")
    args = parser.parse_args()
    if DRY:
        print("DRY RUN (CPU, Triton interpreter, tiny sizes): timings are meaningless")
    else:
        props = torch.cuda.get_device_properties(0)
        print(f"machine: {props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB; "
              f"host {platform.node()}; torch {torch.__version__}, triton {triton.__version__}, "
              f"python {platform.python_version()}")
    if not DRY:
        pdl_probe()
    default = new_ops()
    no_pdl = new_ops("PDL off", pdl=False)
    before = before_ops(args.before) if args.before else None
    N = int((1 << 24) * S)
    fl = floors(N, quick=args.quick)
    print("floors:", {k: round(v, 3) for k, v in fl.items()})
    if args.quick:
        quick(fl, default, no_pdl, sweep=args.verify_sweep)
        return
    res = {}
    for layout in ("paged", "random"):
        res[f"verify_none_{layout}"] = verify_case(layout, N, RealKvHashMode.NONE, 0)
        print(f"verify NONE {layout}: {res[f'verify_none_{layout}'][0]:.1f} G entries/s "
              f"({res[f'verify_none_{layout}'][1] * 1e3:.0f} us, {res[f'verify_none_{layout}'][2]} violations)")
    res["verify_partial2_paged"] = verify_case("paged", N // 2, RealKvHashMode.PARTIAL, 2)
    print(f"verify PARTIAL 2 sources paged: {res['verify_partial2_paged'][0]:.1f} G entries/s "
          f"({res['verify_partial2_paged'][1] * 1e3:.0f} us, {res['verify_partial2_paged'][2]} violations)")
    for cfg in (tverify.VerifyLaunchConfig(block=64, programs_per_sm=32, num_warps=2),
                tverify.VerifyLaunchConfig(block=256, programs_per_sm=16)):
        r2 = verify_case("paged", N // 2, RealKvHashMode.PARTIAL, 2, cfg)[0]
        print(f"sweep verify {cfg}: PARTIAL2 paged {r2:.1f} G/s")

    kw, _rtt, _ = plan_case(max(8, int(4096 * S)), max(64, int(4096 * S)))
    ms = bench(lambda: launch_canary_plan_kernels(**kw))
    res["plan"] = (kw["verify_capacity"] / ms / 1e6, ms)
    print(f"plan 4096x4096: {res['plan'][0]:.1f} G entries/s ({ms * 1e3:.0f} us)")

    # Write: 4096 one-token requests (decode), CUDA graph.
    bs = max(64, int(4096 * S))
    nsl = int((1 << 20) * S)
    ctx = make_ctx(nsl, kv_sources(nsl, n=2), RealKvHashMode.PARTIAL)
    ctx.enable_chain_position_assert.zero_()
    wp = WritePlan.allocate(bs, DEV)
    wp.write_offsets.copy_(torch.arange(bs + 1, device=DEV))
    wp.write_seed_slot_indices.copy_(torch.randperm(nsl // 2, device=DEV)[:bs] + 1)
    wp.write_num_valid_reqs.fill_(bs)
    wkw = dict(input_ids=torch.randint(0, 1000, (bs,), device=DEV), positions=torch.randint(0, 1000, (bs,), device=DEV),
               out_cache_loc=torch.randperm(nsl // 2, device=DEV)[:bs] + nsl // 2, enable_write_input_assert=False,
               expected_input_tokens=None, expected_input_positions=None)
    write_sets = [default, no_pdl,
                  new_ops("chain 32 programs/SM", write_cfg=twrite.WriteLaunchConfig(chain_programs_per_sm=32)),
                  new_ops("chain 2 programs/SM", write_cfg=twrite.WriteLaunchConfig(chain_programs_per_sm=2)),
                  new_ops("prepare 256 x 4 warps", write_cfg=twrite.WriteLaunchConfig(prep_block=256))]
    if before:
        write_sets.append(before)
    w4096 = {}
    for ops in write_sets:
        w4096[ops.name] = bench_graph(lambda: ops.write(context=ctx, plan=wp, **wkw)) * 1e3
        print(f"write 4096 one-token requests [{ops.name}]: {w4096[ops.name]:.1f} us per launch (graph)")
    res["write_decode"] = w4096["default"]

    # Write: one 128k-token request.
    n = int(128 * 1024 * S)
    ctx = make_ctx(nsl, kv_sources(nsl, n=2), RealKvHashMode.PARTIAL)
    wp = WritePlan.allocate(1, DEV)
    wp.write_offsets.copy_(torch.tensor([0, n], device=DEV))
    wp.write_seed_slot_indices.fill_(-1)
    wp.write_num_valid_reqs.fill_(1)
    wkw = dict(input_ids=torch.randint(0, 1000, (n,), device=DEV), positions=torch.arange(n, device=DEV),
               out_cache_loc=torch.randperm(nsl, device=DEV)[:n], enable_write_input_assert=False,
               expected_input_tokens=None, expected_input_positions=None)
    ms = bench(lambda: default.write(context=ctx, plan=wp, **wkw), reps=5) / S
    res["write_128k"] = ms
    print(f"write one 128k-token request: {ms:.2f} ms; recurrence floor {fl['recurrence_128k_ms']:.2f} ms")

    # Decode step.
    d = DecodeStep()
    sync()
    print(f"decode step: {d.bs} requests x {d.ctx_len} context, {d.bs * d.ctx_len} verify entries per buffer, "
          f"{d.launches(default)} launches (mark + plan + HEAD verify + write + TAIL K+V verify + write + one stamp of 3 rings)")
    op_sets = [default, no_pdl] + ([before] if before else [])
    per_op = {o.name: d.per_op(o) for o in op_sets}
    for name in per_op[default.name]:
        cells = "  ".join(f"{o.name}: {per_op[o.name][name]:6.1f}" for o in op_sets if name in per_op[o.name])
        print(f"  per op (own graph) {name:28s} {cells} us")
    steps = {}
    for o in op_sets:
        steps[o.name] = bench_graph(lambda: d.step(o)) * 1e3
        print(f"decode step [{o.name}]: {steps[o.name]:.1f} us")
    steps["no stamps"] = bench_graph(lambda: d.step(default, stamps=False)) * 1e3
    print(f"decode step [default, without mark + stamps]: {steps['no stamps']:.1f} us")
    variants = [
        new_ops("plan in 2 launches", plan_cfg=tplan.PlanLaunchConfig(tile_rows=0)),
        new_ops("verify 64 x 2 warps", verify_cfg=tverify.VerifyLaunchConfig(block=64, num_warps=2)),
        new_ops("verify 256 / 16 per SM", verify_cfg=tverify.VerifyLaunchConfig(block=256, programs_per_sm=16)),
        new_ops("chain 32 programs/SM", write_cfg=twrite.WriteLaunchConfig(chain_programs_per_sm=32)),
    ]
    for o in variants:
        steps[o.name] = bench_graph(lambda: d.step(o)) * 1e3
        print(f"decode step [{o.name}]: {steps[o.name]:.1f} us")
    sync()
    print("decode-step violations (HEAD, TAIL_K, TAIL_V):", d.widx.tolist())
    res["decode_step"] = steps["default"]
    bytes_step = d.bs * d.ctx_len * (32 + 3 * 56 + 2 * 2 * 64)  # plan out; 3 verifies' plan+records; strips
    floor_us = bytes_step / (fl["copy_GBps"] * 1e3)

    # PARTIAL prefill on the transformers layout.
    pre = {}
    for contiguous in (False, True):
        lay = PrefillLayout(contiguous=contiguous)
        vp0, wp0, w0 = lay.chunk(0)
        lay.run(default, vp0, wp0, w0)  # positions [0, t): the next chunk verifies them clean
        lay.run(default, vp0, wp0, w0, sides="k", none=True)
        vp1, wp1, w1 = lay.chunk(lay.tokens)
        name = "contiguous copies" if contiguous else "row-strided views"
        sync()
        for label, (vp_, wp_, w_) in (("prefill (prefix 0)", (vp0, wp0, w0)), ("chunk after prefix", (vp1, wp1, w1))):
            ms, fallbacks = count_twin_fallbacks(lambda: (bench(lambda: lay.run(default, vp_, wp_, w_), reps=10), sync())[0])
            per_tok = ms * 1e3 / (lay.reqs * lay.tokens)
            pre[(name, label)] = per_tok
            print(f"TAIL K+V PARTIAL [{name}] {label}: {ms * 1e3:.0f} us per step = {per_tok:.4f} us per prefill "
                  f"token ({lay.reqs} x {lay.tokens} tokens, {int(vp_.verify_num_valid[0])} verify entries); "
                  f"launches handed to the torch twin: {fallbacks}")
            if not contiguous:
                msn = bench(lambda: lay.run(default, vp_, wp_, w_, sides="k", none=True), reps=10)
                print(f"TAIL K NONE {label}: {msn * 1e3:.0f} us per step = {msn * 1e3 / (lay.reqs * lay.tokens):.4f} us "
                      f"per prefill token")
                if before:
                    msb = bench(lambda: lay.run(before, vp_, wp_, w_), reps=10)
                    pre[("before", label)] = msb * 1e3 / (lay.reqs * lay.tokens)
                    print(f"TAIL K+V PARTIAL [before, {name}] {label}: {msb * 1e3:.0f} us per step = "
                          f"{pre[('before', label)]:.4f} us per prefill token")
        print("prefill violations (TAIL_K, TAIL_V):", int(lay.ctxs["k"].violation_write_index[0]),
              int(lay.ctxs["v"].violation_write_index[0]))
        del lay

    print()
    gp, gr = fl["gather_paged"], fl["gather_random"]
    lf = fl["launch_us_pdl1"]
    n_launch = d.launches(default)
    table = [
        ("device copy", f"{fl['copy_GBps'] / 1e3:.2f} TB/s", "", "", "", ""),
        ("bare gather paged", f"{gp:.1f} G/s", "", "", "", ""),
        ("bare gather random", f"{gr:.1f} G/s", "", "", "", ""),
        ("recurrence step", f"{fl['step_ns']:.1f} ns", "", "", "", ""),
        ("dependent launch (graph)", f"{fl['launch_us_pdl0']:.2f} us", "", "", "PDL: " + f"{lf:.2f} us", ""),
        ("verify NONE paged", f"{res['verify_none_paged'][0]:.1f} G/s", f"{gp:.1f} G/s",
         f"{res['verify_none_paged'][0] / gp:.2f}", ">= 35 G/s", res["verify_none_paged"][0] >= 35),
        ("verify NONE random", f"{res['verify_none_random'][0]:.1f} G/s", f"{gr:.1f} G/s",
         f"{res['verify_none_random'][0] / gr:.2f}", ">= 12 G/s", res["verify_none_random"][0] >= 12),
        ("verify PARTIAL 2 src paged", f"{res['verify_partial2_paged'][0]:.1f} G/s", f"{gp:.1f} G/s",
         f"{res['verify_partial2_paged'][0] / gp:.2f}", ">= 15 G/s", res["verify_partial2_paged"][0] >= 15),
        ("plan 4096 x 4096", f"{res['plan'][0]:.1f} G/s", f"{gp:.1f} G/s", f"{res['plan'][0] / gp:.2f}", ">= 30 G/s",
         res["plan"][0] >= 30),
        ("write 4096 x 1 token", f"{res['write_decode']:.1f} us", f"{2 * lf:.1f} us (2 launches)", "", "<= 10 us",
         res["write_decode"] <= 10),
        ("write 1 x 128k tokens", f"{res['write_128k']:.2f} ms", f"{fl['recurrence_128k_ms']:.2f} ms",
         f"{res['write_128k'] / fl['recurrence_128k_ms']:.2f}x", "<= 1.2x floor",
         res["write_128k"] <= 1.2 * fl["recurrence_128k_ms"]),
        (f"decode step 64 x 4k ({n_launch} launches)", f"{res['decode_step']:.1f} us",
         f"{floor_us + n_launch * lf:.1f} us", f"{res['decode_step'] / (floor_us + n_launch * lf):.2f}x", "<= 50 us",
         res["decode_step"] <= 50),
        ("TAIL K+V PARTIAL per prefill token", f"{pre[('row-strided views', 'prefill (prefix 0)')]:.4f} us",
         "", "", "", ""),
    ]
    print(f"{'figure':40s} {'measured':>14s} {'floor (same run)':>24s} {'of floor':>9s} {'target':>14s}  ok")
    for row in table:
        print(f"{row[0]:40s} {row[1]:>14s} {row[2]:>24s} {row[3]:>9s} {row[4]:>14s}  {row[5] if row[5] != '' else ''}")
    print(f"(decode-step floor = its bytes at the measured copy rate, {floor_us:.1f} us, plus {n_launch} dependent "
          f"launches at the PDL launch cost)")


if __name__ == "__main__":
    main()
