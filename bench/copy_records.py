"""Moving canary records with a KV transfer: export + import (and the on-device slot copy) of
10 k blocks of 16 slots, beside a plain copy of the KV bytes those blocks carry.

Run alone: ``python bench/copy_records.py [--device cpu|cuda]`` (default: cuda when available).
Target (issue 9): export + import of the records of 160 k slots at >= 1 GB/s on the CPU.
Records: one group with a HEAD and two TAIL canary buffers (K, V), 32 bytes per slot each, so
96 bytes per slot; the KV they accompany: 2 (K, V) x 16 layers x 16 tokens x 1 KiB per block.
Every rate is the records' bytes (96 B per slot) over the time of the step, counted once.
On the CPU the KV copy runs over a slice of the blocks (``--kv-blocks``) and is scaled per block.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Optional

import torch

from kvcanary.ops import (
    canary_copy_slots_torch_reference,
    canary_records_from_bytes,
    canary_records_to_bytes,
    export_canary_records,
    export_canary_records_torch_reference,
    import_canary_records,
    import_canary_records_torch_reference,
    launch_canary_copy_slots_kernel,
)

PAGE = 16
BLOCKS = 10_000
TABLES = 3  # HEAD, TAIL_K, TAIL_V
RECORD_BYTES = 32
KV_BYTES_PER_BLOCK = 2 * 16 * PAGE * 1024  # K and V x 16 layers x 16 tokens x 1 KiB


def _machine(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} cores, torch {torch.__version__} (threads {torch.get_num_threads()})"


@dataclass(frozen=True)
class Timing:
    """Seconds per call: median and best wall clock; median process CPU time (all threads; CPU only)."""

    wall: float
    best: float
    cpu: Optional[float]


def _measure(fn, device: torch.device, repeats: int) -> Timing:
    fn()  # warm-up (Triton compile, allocator)
    walls, cpus = [], []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            walls.append(start.elapsed_time(end) / 1e3)
        else:
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
    return Timing(wall=statistics.median(walls), best=min(walls), cpu=statistics.median(cpus) if cpus else None)


def _paged_slots(num_blocks: int, pool_blocks: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Slots of ``num_blocks`` pages in random order from a pool (page 0 holds the padding slot)."""
    pages = torch.randperm(pool_blocks - 1, generator=gen)[:num_blocks] + 1
    return (pages[:, None] * PAGE + torch.arange(PAGE)).flatten().to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--blocks", type=int, default=BLOCKS)
    parser.add_argument("--kv-blocks", type=int, default=None, help="blocks in the KV copy (default: all on cuda, 512 on cpu)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    blocks = args.blocks
    kv_blocks = args.kv_blocks or (blocks if device.type == "cuda" else 512)
    gen = torch.Generator().manual_seed(0)

    pool_blocks = 2 * blocks + 1
    num_slots = pool_blocks * PAGE
    tables = tuple(
        torch.randint(0, 256, (num_slots, RECORD_BYTES), dtype=torch.uint8, generator=gen).to(device) for _ in range(TABLES)
    )
    src = _paged_slots(blocks, pool_blocks, gen, device)
    dst = _paged_slots(blocks, pool_blocks, gen, device)
    n = src.numel()
    record_bytes = n * RECORD_BYTES * TABLES
    counters = torch.zeros(2, dtype=torch.int64, device=device)

    records = export_canary_records(canary_bufs=tables, slots=src)
    host_records = records.cpu().pin_memory() if device.type == "cuda" else records.clone()  # offload buffers are pinned
    wire = canary_records_to_bytes(records)

    staging = torch.empty_like(records)  # caller-owned export buffer, reused (no fresh pages)

    def export():
        export_canary_records(canary_bufs=tables, slots=src, out=staging)

    def export_fresh():
        export_canary_records(canary_bufs=tables, slots=src)

    def import_():
        import_canary_records(canary_bufs=tables, slots=dst, records=host_records,
                              slot_run_counter=counters[0:1], kernel_run_counter=counters[1:2])

    def export_import():
        exported = export_canary_records(canary_bufs=tables, slots=src, out=staging)
        import_canary_records(canary_bufs=tables, slots=dst, records=exported.cpu())

    def copy_slots():
        launch_canary_copy_slots_kernel(canary_bufs=tables, src_slots=src, dst_slots=dst,
                                        slot_run_counter=counters[0:1], kernel_run_counter=counters[1:2])

    rows = [
        ("export (launcher, into a reused out)", export),
        ("export (launcher, fresh result tensor)", export_fresh),
        ("import from host memory (launcher)", import_),
        ("export -> host -> import (launcher)", export_import),
        ("copy_slots on the device (launcher)", copy_slots),
        ("records -> bytes (wire)", lambda: canary_records_to_bytes(records)),
        ("bytes -> records (wire)", lambda: canary_records_from_bytes(wire)),
    ]
    if device.type == "cuda":
        from kvcanary.ops.triton.copy import launch_copy_slots, launch_export_records, launch_import_records

        dev_records = records.clone()
        rows += [
            ("export (Triton kernels only)", lambda: launch_export_records(canary_bufs=tables, slots=src, out=staging)),
            ("import from device memory (Triton kernels only)",
             lambda: launch_import_records(canary_bufs=tables, slots=dst, records=dev_records)),
            ("copy_slots (Triton kernels only)", lambda: launch_copy_slots(canary_bufs=tables, src_slots=src, dst_slots=dst)),
            ("export, CUDA graph replay", _graph(export)),
            ("copy_slots, CUDA graph replay", _graph(copy_slots)),
        ]
    else:
        rows += [
            ("export (torch twin)", lambda: export_canary_records_torch_reference(canary_bufs=tables, slots=src, out=staging)),
            ("import (torch twin)", lambda: import_canary_records_torch_reference(canary_bufs=tables, slots=dst, records=host_records)),
            ("copy_slots (torch twin)", lambda: canary_copy_slots_torch_reference(canary_bufs=tables, src_slots=src, dst_slots=dst)),
        ]

    kv_src = torch.empty(kv_blocks * KV_BYTES_PER_BLOCK, dtype=torch.uint8, device=device).fill_(7)
    kv_dst = torch.empty_like(kv_src)

    now = datetime.datetime.now().strftime("%Y-%m-%d")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"# bench/copy_records.py on {device.type}: {_machine(device)}; {now}; median of {args.repeats} runs after a warm-up")
    print(f"# load average before the run: {load}")
    print(f"# {blocks} blocks x {PAGE} slots = {n} slots, {TABLES} tables x {RECORD_BYTES} B = {record_bytes / 1e6:.2f} MB of "
          f"records; pool of {num_slots} slots, pages in random order")
    print(f"# time: median wall clock (best in brackets); cpu: median CPU time of the process, all threads "
          f"(robust to other load on a shared machine; CPU runs only); rates: record bytes / time")
    print(f"{'measurement':<46} {'time':>20} {'rate':>10} {'cpu':>9} {'rate':>10} {'per block':>10}")
    results = {}
    for name, fn in rows:
        t = _measure(fn, device, args.repeats)
        results[name] = t
        print(f"{name:<46} {_row(t, record_bytes, blocks)}")

    t_kv = _measure(lambda: kv_dst.copy_(kv_src), device, max(3, args.repeats // 3))
    print(f"{'plain KV copy, ' + str(kv_blocks) + ' blocks x 512 KiB':<46} "
          f"{_row(t_kv, kv_blocks * KV_BYTES_PER_BLOCK, kv_blocks)}  (KV bytes)")

    exp, imp = results["export (launcher, into a reused out)"], results["import from host memory (launcher)"]
    kv_block = t_kv.wall / kv_blocks
    print()
    for label, both, kv in (
        ("wall clock", exp.wall + imp.wall, kv_block),
        ("CPU time", None if exp.cpu is None else exp.cpu + imp.cpu, None if t_kv.cpu is None else t_kv.cpu / kv_blocks),
    ):
        if both is None:
            continue
        rate = record_bytes / both / 1e9
        print(f"export + import of {n} slots' records ({label}): {both * 1e3:.2f} ms, {rate:.2f} GB/s "
              f"(target >= 1 GB/s on the CPU: {'met' if rate >= 1.0 else 'NOT met'}); per block {both / blocks * 1e9:.0f} ns "
              f"vs {kv * 1e9:.0f} ns for a plain copy of its KV bytes = {100 * both / blocks / kv:.2f} %")
    print(f"({TABLES * RECORD_BYTES * PAGE} B of records ride with each {KV_BYTES_PER_BLOCK // 1024} KiB block of KV: "
          f"{100 * TABLES * RECORD_BYTES * PAGE / KV_BYTES_PER_BLOCK:.2f} % of its bytes)")


def _graph(fn):
    """``fn`` captured in a CUDA graph (after a warm-up); returns the replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _row(t: Timing, nbytes: int, blocks: int) -> str:
    wall = f"{t.wall * 1e3:8.2f} ms [{t.best * 1e3:7.2f}]"
    cpu = f"{t.cpu * 1e3:6.2f} ms {nbytes / t.cpu / 1e9:6.2f} GB/s" if t.cpu else f"{'-':>9} {'-':>10}"
    return f"{wall} {nbytes / t.wall / 1e9:5.2f} GB/s {cpu} {t.wall / blocks * 1e9:7.0f} ns"


if __name__ == "__main__":
    main()
