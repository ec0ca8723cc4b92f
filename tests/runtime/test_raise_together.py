"""`Canary.raise_with`: the ranks of a process group raise in the same step when any of them finds a violation (two
CPU processes over gloo; rank 1's KV is corrupted, rank 0's is not)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import os, sys
import torch
import torch.distributed as dist
from kvcanary.runtime import CanaryViolationError
from tests.runtime.conftest import ManualEngine, make_canary
from kvcanary.runtime import GroupSpec

rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
m = ManualEngine(make_canary([GroupSpec(name="full", num_slots=64, layer_ids=(0, 1))], max_requests=4, max_context=64,
                             mode="raise"))
m.canary.raise_with(dist.group.WORLD)
tokens, slots = list(range(100, 112)), list(range(10, 22))
m.forward(m.batch(1, 0, tokens, slots))
m.forward(m.batch(1, 12, [7], [40]))  # clean on every rank
if rank == 1:
    m.kv[0][0][slots[3], 0] ^= 1  # only rank 1's shard is corrupted
try:
    m.forward(m.batch(1, 13, [8], [41]))
    print("NO RAISE", flush=True)
except CanaryViolationError as exc:
    print(f"RAISED step={exc.step} own={len(exc.violations)} elsewhere={exc.elsewhere}", flush=True)
    print(str(exc).splitlines()[0], flush=True)
sys.stdout.flush()
dist.barrier()
os._exit(0)  # skip gloo's teardown at interpreter exit (it can abort a process whose peer already left)
"""


def test_every_rank_raises_in_the_step_one_rank_found_a_violation():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    env.pop("TRITON_INTERPRET", None)
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(r), "2", port], cwd=str(ROOT), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    step0, step1 = (next(line for line in out.splitlines() if line.startswith("RAISED")) for out, _ in outs)
    assert "own=0 elsewhere=1" in step0 and "own=1 elsewhere=1" in step1
    assert step0.split()[1] == step1.split()[1] == "step=3"
    assert "the ranks of its group found 1 (raised together" in outs[0][0]


def test_raise_with_needs_raise_mode(manual):
    m = manual(mode="log")
    with pytest.raises(ValueError, match="^kv-canary: raise_with\\(\\) needs mode='raise'"):
        m.canary.raise_with(object())
