"""A CUDA graph capture that fails leaves a process that serves (skipped without CUDA).

Each case runs in a child process: what a failed capture leaves behind can abort the interpreter (the caching
allocator's ``captures_underway`` assert at the next ``empty_cache``), which would take the test worker with it.
- the canary's own capture (`capture_graph`) fails: afterwards ``empty_cache``, a random draw, a capture that
  succeeds and a transformers ``generate_batch`` with CUDA graphs all work;
- the engine's capture fails because a canary launch reads the host inside it (``log`` mode): the step is run again
  without the canary, the tokens equal a canary-off run, the session is suspended (``checked < engine``), and the
  next ``generate_batch`` serves; in ``raise`` mode the step fails but the process still serves afterwards.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]

PRELUDE = """
import logging, torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from kvcanary.cli.demo import PAGE_SIZE, tiny_model, workload
from kvcanary.engines.transformers_cb import attach
from kvcanary.runtime import launch
from kvcanary.runtime.capture import capture_graph
from kvcanary.runtime.cuda_host import capturing
logging.getLogger("kvcanary").setLevel(logging.CRITICAL)
logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
model = tiny_model("llama", torch.device("cuda"), seed=0)
prompts = workload(seed=1, num_requests=6)
def gen(graphs=True):
    g = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=PAGE_SIZE, num_blocks=40, max_batch_tokens=64, max_requests_per_batch=4,
                                  use_cuda_graph=graphs, use_async_batching=False)
    out = model.generate_batch(prompts, generation_config=g, continuous_batching_config=cb, progress_bar=False)
    return {rid: list(o.generated_tokens) for rid, o in out.items()}
"""

OWN = PRELUDE + """
ref = gen()
x = torch.ones(4, device="cuda")
try:
    capture_graph(lambda: (x * 2).sum().item())
    raise SystemExit("the capture did not fail")
except Exception:
    pass
torch.cuda.empty_cache()
torch.rand(8, device="cuda").sum().item()
g = capture_graph(lambda: x.mul_(2))
g.replay()
torch.cuda.synchronize()
assert x.tolist() == [2.0] * 4
assert gen() == ref
torch.cuda.empty_cache()
print("OK")
"""

RAW = """
import threading, torch
from kvcanary.runtime.capture import generator_draws, recover_failed_capture
pool, side, x = torch.cuda.MemPool(), torch.cuda.Stream(), torch.ones(64, device="cuda")
gen = torch.cuda.default_generators[0]
failed = []
def worker():  # transformers' pattern: a thread_local capture into a MemPool on a side stream, in its own thread
    entry = torch.cuda.current_stream()
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=side, pool=pool.id, capture_error_mode="thread_local"):
            (x * 2).sum().item()
    except Exception as exc:
        failed.append(exc)
        recover_failed_capture(entry, pool=pool.id)
t = threading.Thread(target=worker); t.start(); t.join()
assert failed, "the capture did not fail"
before = gen.get_offset()
assert generator_draws() and gen.get_offset() == before  # draws again; the probe leaves the offset alone
torch.cuda.empty_cache()
torch.rand(8, device="cuda").sum().item()
fresh = torch.cuda.MemPool()  # the failed capture's pool stays routed in the host allocator (runtime/capture.py)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, pool=fresh.id):
    y = torch.rand(4, device="cuda") + x[:4]
g.replay(); torch.cuda.synchronize()
torch.cuda.empty_cache()
print("OK")
"""

ENGINE = PRELUDE + """
import sys
mode = sys.argv[1]
ref = gen()
head = launch.ForwardLaunches.head
fired = []
def reads_the_host(self, *a, **k):
    if capturing() and not fired:
        fired.append(1)
        torch.zeros(1, device="cuda").item()  # forbidden inside a capture: the engine's capture is invalidated
    return head(self, *a, **k)
launch.ForwardLaunches.head = reads_the_host
handle = attach(model, mode=mode, sweep_interval=4)
try:
    with handle:
        out = gen()
    failed = None
except Exception as exc:
    out, failed = None, exc
launch.ForwardLaunches.head = head
c = handle.counters()
print("FIRED", bool(fired), "FAILED", type(failed).__name__ if failed else None)
print("COUNTS", c["engine_forwards"], c["checked_forwards"], c["unchecked_forwards"])
if mode == "log":
    assert fired and failed is None and out == ref, (fired, failed, out == ref)
    assert c["checked_forwards"] < c["engine_forwards"] and c["unchecked_forwards"] > 0
torch.rand(8, device="cuda").sum().item()
assert gen() == ref  # the process serves afterwards, canary off
with attach(model, mode="log", sweep_interval=4) as again:
    assert gen() == ref  # and with a fresh canary
assert again.counters()["checked_forwards"] == again.counters()["engine_forwards"] > 0
torch.cuda.empty_cache()
print("OK")
"""


def _child(code: str, *args: str) -> subprocess.CompletedProcess:
    inherited = os.environ.get("PYTHONPATH")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src")] + ([inherited] if inherited else [])))
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, env=env,
                          cwd=str(ROOT))


def test_a_failed_own_capture_leaves_a_process_that_serves():
    r = _child(OWN)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def test_a_failed_thread_local_capture_into_a_mempool_is_repaired():
    r = _child(RAW)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.parametrize("mode", ["log", "raise"])
def test_a_failed_engine_capture_with_the_canary_inside_leaves_a_process_that_serves(mode):
    r = _child(ENGINE, mode)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
    assert "FIRED True" in r.stdout
