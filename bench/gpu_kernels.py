"""GPU benchmark of the Triton canary kernels against floors measured in the same run (SPEC §7).

Floors first: device copy bandwidth; a bare gather kernel (own record + predecessor record +
plan arrays, no hashing) on a paged layout (16-slot pages in random order) and on fully random
slots; the latency of one chain-recurrence step (a kernel that runs only the recurrence over
128k tokens). Then the canary ops, each as a rate, its fraction of the floor and the target.
Run: PYTHONPATH=src python bench/gpu_kernels.py  (needs CUDA + Triton). Prints a table last.
"""
from __future__ import annotations

import platform

import torch
import triton
import triton.language as tl

from kvcanary.ops import (
    RealKvHashMode,
    RealKvSource,
    VerifyOrWriteContext,
    VerifyPlan,
    WritePlan,
    launch_canary_plan_kernels,
    launch_canary_verify_kernel,
    launch_canary_write_kernel,
)
from kvcanary.ops.triton.hashing import as_i64, as_u64, mix3

DEV = "cuda"
ROWS: list[tuple] = []


def bench_graph(fn, reps=20, iters=10):
    """Median ms per call of ``fn`` captured ``iters`` times in one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / iters)
    times.sort()
    return times[len(times) // 2]


def bench(fn, reps=30):
    return triton.testing.do_bench(fn, warmup=25, rep=reps * 4, return_mode="median")


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
        v = as_u64(i.to(tl.int64))
        h = mix3(h, v, v)
    tl.store(out_ptr, as_i64(h))


def floors(n_entries):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.empty(1 << 30, dtype=torch.uint8, device=DEV).random_()
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    copy_bw = 2 * x.numel() / ms / 1e6  # GB/s
    del x, y
    out = {"copy_GBps": copy_bw}
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
    n = 128 * 1024
    ms = bench(lambda: _recurrence_floor_kernel[(1,)](rec, n, UNROLL=4, num_warps=1))
    out["step_ns"] = ms * 1e6 / n
    out["recurrence_128k_ms"] = ms
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


def make_ctx(num_slots, sources=(), mode=RealKvHashMode.NONE, kind=2):
    return VerifyOrWriteContext(
        canary_buf=torch.zeros(num_slots, 32, dtype=torch.uint8, device=DEV), kernel_kind=kind,
        violation_ring=torch.zeros(4096, 8, dtype=torch.int64, device=DEV),
        violation_write_index=torch.zeros(1, dtype=torch.int32, device=DEV),
        slot_run_counter=torch.zeros(1, dtype=torch.int64, device=DEV),
        kernel_run_counter=torch.zeros(1, dtype=torch.int64, device=DEV),
        real_kv_sources=tuple(sources), real_kv_hash_mode=mode,
        enable_chain_position_assert=torch.ones(1, dtype=torch.int32, device=DEV),
    )


def kv_sources(num_slots, nbpt=256, n=2):
    return [RealKvSource(tensor=torch.empty(num_slots // 16, 16 * nbpt // 2, dtype=torch.bfloat16, device=DEV).normal_(),
                         page_size=16, num_bytes_per_token=nbpt, read_bytes=nbpt) for _ in range(n)]


def verify_case(layout, n, mode, nsrc):
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
    from kvcanary.ops.hashing import CHAIN_HEAD_HASH, to_signed64
    from kvcanary.ops.reference.common import slot_hash
    from kvcanary.ops.reference.real_kv import fingerprint_slots
    f = ctx.canary_buf.view(torch.int64)
    f[slot, 1] = torch.arange(n, device=DEV)
    f[slot, 3] = fingerprint_slots(ctx.real_kv_sources, ctx.real_kv_hash_mode, slot, f.device)
    heads = torch.arange(0, n, 4096, device=DEV)
    f[slot[heads], 2] = to_signed64(CHAIN_HEAD_HASH)
    for k in range(1, 4096):
        f[slot[heads + k], 2] = slot_hash(f, slot[heads + k - 1])
    ms = bench(lambda: launch_canary_verify_kernel(context=ctx, plan=vp, check_verify_expected_token=False))
    viol = int(ctx.violation_write_index[0])
    return n / ms / 1e6, ms, viol


def plan_case(bs, prefix):
    num_slots = bs * (prefix + 16) + 16
    pages = torch.randperm(num_slots // 16 - 1, device=DEV)[: bs * ((prefix + 16) // 16)] + 1
    rtt = (pages.reshape(bs, -1)[:, :, None] * 16 + torch.arange(16, device=DEV)).reshape(bs, -1).to(torch.int32)
    rtt = torch.cat([torch.zeros(1, rtt.shape[1], dtype=torch.int32, device=DEV), rtt])
    v_cap = bs * prefix
    vp, wp = VerifyPlan.allocate(v_cap, DEV), WritePlan.allocate(bs, DEV)
    kw = dict(verify_plan_out=vp, write_plan_out=wp, req_pool_indices=torch.arange(1, bs + 1, device=DEV),
              prefix_lens=torch.full((bs,), prefix, device=DEV), extend_seq_lens=torch.ones(bs, dtype=torch.int64, device=DEV),
              req_to_token=rtt, swa_window_size=0, full_to_swa_index_mapping=None, verify_capacity=v_cap,
              req_to_verify_expected_tokens=None, req_to_verify_expected_tokens_valid_lens=None,
              kv_token_id_vs_position_offset=0)
    return kw, rtt, num_slots


def main():
    props = torch.cuda.get_device_properties(0)
    print(f"machine: {props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB; "
          f"host {platform.node()}; torch {torch.__version__}, triton {triton.__version__}, "
          f"python {platform.python_version()}")
    N = 1 << 24
    fl = floors(N)
    print("floors:", {k: round(v, 2) for k, v in fl.items()})
    res = {}
    for layout in ("paged", "random"):
        rate, ms, viol = verify_case(layout, N, RealKvHashMode.NONE, 0)
        res[f"verify_none_{layout}"] = (rate, ms, viol)
        print(f"verify NONE {layout}: {rate:.1f} G entries/s ({ms*1e3:.0f} us, {viol} violations)")
    rate, ms, viol = verify_case("paged", N // 2, RealKvHashMode.PARTIAL, 2)
    res["verify_partial2_paged"] = (rate, ms, viol)
    print(f"verify PARTIAL 2 sources paged: {rate:.1f} G entries/s ({ms*1e3:.0f} us, {viol} violations)")

    # Launch-shape sweep for verify (the table below uses the module's defaults).
    import kvcanary.ops.triton.verify as tv
    default = dict(tv.CONFIG)
    for block, per_sm, warps in ((256, 16, 4), (64, 32, 2)):
        tv.CONFIG.update(block=block, programs_per_sm=per_sm, num_warps=warps)
        r1 = verify_case("paged", N, RealKvHashMode.NONE, 0)[0]
        r2 = verify_case("paged", N // 2, RealKvHashMode.PARTIAL, 2)[0]
        print(f"sweep verify block={block} programs/SM={per_sm} warps={warps}: NONE paged {r1:.1f} G/s, PARTIAL2 paged {r2:.1f} G/s")
    tv.CONFIG.update(default)

    # Plan: 4096 requests x 4096 prefix = 16M entries.
    kw, rtt, num_slots = plan_case(4096, 4096)
    ms = bench(lambda: launch_canary_plan_kernels(**kw))
    res["plan"] = (4096 * 4096 / ms / 1e6, ms)
    print(f"plan 4096x4096: {res['plan'][0]:.1f} G entries/s ({ms*1e3:.0f} us)")

    # Write: 4096 one-token requests (decode), CUDA graph.
    bs = 4096
    ctx = make_ctx(1 << 20, kv_sources(1 << 20, n=2), RealKvHashMode.PARTIAL)
    wp = WritePlan.allocate(bs, DEV)
    wp.write_offsets.copy_(torch.arange(bs + 1, device=DEV))
    wp.write_seed_slot_indices.copy_(torch.randperm(1 << 19, device=DEV)[:bs] + 1)
    wp.write_num_valid_reqs.fill_(bs)
    loc = torch.randperm(1 << 19, device=DEV)[:bs] + (1 << 19)
    wkw = dict(input_ids=torch.randint(0, 1000, (bs,), device=DEV), positions=torch.randint(0, 1000, (bs,), device=DEV),
               out_cache_loc=loc, enable_write_input_assert=False, expected_input_tokens=None, expected_input_positions=None)
    ctx.enable_chain_position_assert.zero_()
    us = bench_graph(lambda: launch_canary_write_kernel(context=ctx, plan=wp, **wkw)) * 1e3
    res["write_decode"] = us
    print(f"write 4096 one-token requests: {us:.1f} us per launch (graph)")
    import kvcanary.ops.triton.write as tw
    wdefault = dict(tw.CONFIG)
    for cfg in (dict(prep_block=128), dict(prep_block=128, prep_warps=2), dict(prep_block=512, prep_warps=8)):
        tw.CONFIG.update(cfg)
        us_v = bench_graph(lambda: launch_canary_write_kernel(context=ctx, plan=wp, **wkw)) * 1e3
        print(f"sweep write 4096x1 {tw.CONFIG}: {us_v:.1f} us per launch (graph)")
        tw.CONFIG.update(wdefault)

    # Write: one 128k-token request.
    n = 128 * 1024
    ctx = make_ctx(1 << 20, kv_sources(1 << 20, n=2), RealKvHashMode.PARTIAL)
    wp = WritePlan.allocate(1, DEV)
    wp.write_offsets.copy_(torch.tensor([0, n], device=DEV))
    wp.write_seed_slot_indices.fill_(-1)
    wp.write_num_valid_reqs.fill_(1)
    wkw = dict(input_ids=torch.randint(0, 1000, (n,), device=DEV), positions=torch.arange(n, device=DEV),
               out_cache_loc=torch.randperm(1 << 20, device=DEV)[:n], enable_write_input_assert=False,
               expected_input_tokens=None, expected_input_positions=None)
    ms = bench(lambda: launch_canary_write_kernel(context=ctx, plan=wp, **wkw), reps=5)
    res["write_128k"] = ms
    print(f"write one 128k-token request: {ms:.2f} ms; recurrence floor {fl['recurrence_128k_ms']:.2f} ms")
    # Chain-kernel sweep (the table uses the module default); each variant's bytes vs the default's.
    import kvcanary.ops.triton.write as tw
    wdefault = dict(tw.CONFIG)

    def one_write(cfg):
        tw.CONFIG.update(cfg)
        c = make_ctx(1 << 20, ctx.real_kv_sources, RealKvHashMode.PARTIAL)
        launch_canary_write_kernel(context=c, plan=wp, **wkw)
        torch.cuda.synchronize()
        return c.canary_buf.clone(), int(c.slot_run_counter[0])

    ref_bytes = one_write(wdefault)
    for cfg in (dict(unroll=4), dict(chunk=64), dict(unroll=16)):
        cfg = {**wdefault, **cfg}
        same = all(torch.equal(x, y) if torch.is_tensor(x) else x == y for x, y in zip(one_write(cfg), ref_bytes))
        ms_v = bench(lambda: launch_canary_write_kernel(context=ctx, plan=wp, **wkw), reps=5)
        print(f"sweep write 128k {cfg}: {ms_v:.2f} ms ({ms_v / fl['recurrence_128k_ms']:.3f}x floor), bytes same as default: {same}")
    tw.CONFIG.update(wdefault)

    # Decode step: 64 requests x 4k context: plan + HEAD verify/write + TAIL verify/write (graph).
    kw, rtt, num_slots = plan_case(64, 4096)
    heads = make_ctx(num_slots, (), RealKvHashMode.NONE, kind=0)
    tails = make_ctx(num_slots, kv_sources(num_slots, n=2), RealKvHashMode.PARTIAL, kind=2)
    ids = torch.randint(0, 1000, (64,), device=DEV)
    dkw = dict(input_ids=ids, positions=torch.full((64,), 4096, device=DEV), out_cache_loc=rtt[1:, 4096].to(torch.int64),
               enable_write_input_assert=False, expected_input_tokens=None, expected_input_positions=None)
    vp, wp = kw["verify_plan_out"], kw["write_plan_out"]
    # Prefill both buffers (64 x 4096 tokens) so the decode step's verifies are clean.
    pre = dict(kw, prefix_lens=torch.zeros(64, dtype=torch.int64, device=DEV),
               extend_seq_lens=torch.full((64,), 4096, dtype=torch.int64, device=DEV))
    launch_canary_plan_kernels(**pre)
    pkw = dict(input_ids=torch.randint(0, 1000, (64 * 4096,), device=DEV),
               positions=torch.arange(4096, device=DEV).repeat(64),
               out_cache_loc=rtt[1:, :4096].reshape(-1).to(torch.int64), enable_write_input_assert=False,
               expected_input_tokens=None, expected_input_positions=None)
    launch_canary_write_kernel(context=heads, plan=wp, **pkw)
    launch_canary_write_kernel(context=tails, plan=wp, **pkw)

    def step():
        launch_canary_plan_kernels(**kw)
        launch_canary_verify_kernel(context=heads, plan=vp, check_verify_expected_token=False)
        launch_canary_write_kernel(context=heads, plan=wp, **dkw)
        launch_canary_verify_kernel(context=tails, plan=vp, check_verify_expected_token=False)
        launch_canary_write_kernel(context=tails, plan=wp, **dkw)

    us = bench_graph(step) * 1e3
    res["decode_step"] = us
    torch.cuda.synchronize()
    print("decode-step violations (HEAD, TAIL):", int(heads.violation_write_index[0]), int(tails.violation_write_index[0]))
    print(f"decode step 64 x 4k (plan + HEAD + TAIL, graph): {us:.1f} us")

    print()
    print(f"{'figure':34s} {'measured':>16s} {'floor (same run)':>18s} {'of floor':>9s} {'target':>14s}  ok")
    gp, gr = fl["gather_paged"], fl["gather_random"]
    table = [
        ("device copy", f"{fl['copy_GBps']/1e3:.2f} TB/s", "", "", "", ""),
        ("bare gather paged", f"{gp:.1f} G/s", "", "", "", ""),
        ("bare gather random", f"{gr:.1f} G/s", "", "", "", ""),
        ("recurrence step", f"{fl['step_ns']:.1f} ns", "", "", "", ""),
        ("verify NONE paged", f"{res['verify_none_paged'][0]:.1f} G/s", f"{gp:.1f} G/s", f"{res['verify_none_paged'][0]/gp:.2f}", ">= 35 G/s", res['verify_none_paged'][0] >= 35),
        ("verify NONE random", f"{res['verify_none_random'][0]:.1f} G/s", f"{gr:.1f} G/s", f"{res['verify_none_random'][0]/gr:.2f}", ">= 12 G/s", res['verify_none_random'][0] >= 12),
        ("verify PARTIAL 2 src paged", f"{res['verify_partial2_paged'][0]:.1f} G/s", f"{gp:.1f} G/s", f"{res['verify_partial2_paged'][0]/gp:.2f}", ">= 15 G/s", res['verify_partial2_paged'][0] >= 15),
        ("plan 4096 x 4096", f"{res['plan'][0]:.1f} G/s", f"{gp:.1f} G/s", f"{res['plan'][0]/gp:.2f}", ">= 30 G/s", res['plan'][0] >= 30),
        ("write 4096 x 1 token", f"{res['write_decode']:.1f} us", "", "", "<= 10 us", res['write_decode'] <= 10),
        ("write 1 x 128k tokens", f"{res['write_128k']:.2f} ms", f"{fl['recurrence_128k_ms']:.2f} ms", f"{res['write_128k']/fl['recurrence_128k_ms']:.2f}x", "<= 1.2x floor", res['write_128k'] <= 1.2 * fl['recurrence_128k_ms']),
        ("decode step 64 x 4k (graph)", f"{res['decode_step']:.1f} us", "", "", "<= 50 us", res['decode_step'] <= 50),
    ]
    for row in table:
        print(f"{row[0]:34s} {row[1]:>16s} {row[2]:>18s} {row[3]:>9s} {row[4]:>14s}  {row[5] if row[5] != '' else ''}")


if __name__ == "__main__":
    main()
