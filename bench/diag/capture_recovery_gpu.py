"""Diagnostic only (issue: the canary fails safe): what a failed engine capture with the canary inside leaves behind.

Three child processes per case, each printing step by step (CUDA captures logged by ``sitecustomize.py`` with
``DIAG_CAPTURE_LOG=1``; the canary's logger at DEBUG; the capture repair wrapped to print what it did and whether
the CUDA generator still refuses a draw afterwards):

- ``raw_log`` / ``raw_raise``: torch only, the transformers pattern (a ``MemPool``, an eager run under
  ``use_mem_pool``, then a ``thread_local`` capture into the pool on a side stream, in a background thread) with a host
  read inside the capture, swallowed (``raw_log``: later launches fail) or propagated (``raw_raise``);
- ``engine_log`` / ``engine_raise``: tests/gpu/test_failed_capture_gpu.py's engine case, instrumented.

    PYTHONPATH=src:bench/diag DIAG_CAPTURE_LOG=1 python bench/diag/capture_recovery_gpu.py
"""
from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
import sys, threading, traceback, torch
def gen_state(tag):
    s = torch.cuda.Stream()
    try:
        with torch.cuda.stream(s):
            torch.empty(1, device="cuda").uniform_()
        torch.cuda.synchronize()
        r = "ok"
    except Exception as e:
        r = "REFUSED: " + str(e).splitlines()[0][:90]
    print(f"[probe] {tag}: generator {r}; current stream capturing={torch.cuda.is_current_stream_capturing()}", flush=True)
import kvcanary.runtime.capture as cap
_rec, _reset = cap.recover_failed_capture, cap.reset_generator_capture
def rec(stream, *, pool=None):
    print(f"[recover] called thr={threading.current_thread().name} pool={pool}", flush=True)
    gen_state("before recover")
    done = _rec(stream, pool=pool)
    print(f"[recover] done={done}", flush=True)
    if pool is not None:  # is the allocator still routing to the pool? (a second end says so)
        try:
            torch._C._cuda_endAllocateToPool(stream.device_index, tuple(pool))
            print("[recover] pool: a second end SUCCEEDED (the first did not end the routing)", flush=True)
        except Exception as e:
            print("[recover] pool: a second end refused:", str(e).splitlines()[0][:90], flush=True)
    gen_state("after recover")
    return done
def reset():
    try:
        ok = _reset()
    except Exception as e:
        print("[reset] raised", e, flush=True); raise
    print(f"[reset] -> {ok}", flush=True)
    return ok
cap.recover_failed_capture, cap.reset_generator_capture = rec, reset
def other_resets(tag):
    # if the generator still refuses a draw: which other repair frees it (each probed)
    gen_state(tag + ": before other resets")
    try:
        ok = _reset(); print(f"[reset2] kvcanary reset again from thr={threading.current_thread().name}: {ok}", flush=True)
    except Exception as e:
        print("[reset2] raised", e, flush=True)
    gen_state(tag + ": after a second kvcanary reset")
    try:
        s2 = torch.cuda.Stream(); g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s2):
            g.capture_begin(); torch.zeros(1, device="cuda").add_(1); g.capture_end()
        print("[reset3] explicit capture_begin/capture_end ok", flush=True)
    except Exception as e:
        print("[reset3] raised", str(e)[:120], flush=True)
    gen_state(tag + ": after an explicit capture")
    try:
        s3 = torch.cuda.Stream(); g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s3):
            torch.empty(1, device="cuda").uniform_()
        print("[reset4] capture with a random draw inside ok", flush=True)
    except Exception as e:
        print("[reset4] raised", str(e)[:120], flush=True)
    gen_state(tag + ": after a capture with a draw")
import kvcanary.engines.transformers_cb.attach as at
at.recover_failed_capture = rec
"""

RAW = PROBE + """
mode = sys.argv[1]
pool = torch.cuda.MemPool()
side = torch.cuda.Stream()
x = torch.ones(64, device="cuda")
def body(fail):
    y = x * 2
    if fail:
        try:
            y.sum().item()
        except Exception as e:
            print("[raw] host read inside the capture raised:", str(e).splitlines()[0][:90], flush=True)
            if mode == "raise":
                raise
    return (y + 1).sum()
def worker():
    try:
        with torch.cuda.stream(side), torch.cuda.use_mem_pool(pool):
            body(False)
        g = torch.cuda.CUDAGraph()
        entry = torch.cuda.current_stream()
        try:
            with torch.cuda.graph(g, stream=side, pool=pool.id, capture_error_mode="thread_local"):
                body(True)
            print("[raw] capture did not fail", flush=True)
        except Exception as e:
            print("[raw] capture failed:", type(e).__name__, str(e).splitlines()[0][:120], flush=True)
            print("[raw] thread stream is entry:", torch.cuda.current_stream() == entry, flush=True)
            cap.recover_failed_capture(entry, pool=pool.id)
    except Exception:
        traceback.print_exc()
t = threading.Thread(target=worker, name="gen"); t.start(); t.join()
gen_state("main thread after the worker")
other_resets("raw")
torch.cuda.empty_cache(); print("[raw] empty_cache ok", flush=True)
g2 = torch.cuda.CUDAGraph()
with torch.cuda.graph(g2, pool=pool.id):
    z = x * 3
g2.replay(); torch.cuda.synchronize(); print("[raw] later capture ok", flush=True)
gen_state("end")
print("RAW-OK")
"""

ENGINE = PROBE + """
import logging
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from kvcanary.cli.demo import PAGE_SIZE, tiny_model, workload
from kvcanary.engines.transformers_cb import attach
from kvcanary.runtime import launch
from kvcanary.runtime.cuda_host import capturing
logging.basicConfig(level=logging.WARNING, format="[log %(name)s %(levelname)s] %(message)s")
logging.getLogger("kvcanary").setLevel(logging.DEBUG)
mode = sys.argv[1]
model = tiny_model("llama", torch.device("cuda"), seed=0)
prompts = workload(seed=1, num_requests=6)
def gen(graphs=True):
    g = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=PAGE_SIZE, num_blocks=40, max_batch_tokens=64, max_requests_per_batch=4,
                                  use_cuda_graph=graphs, use_async_batching=False)
    out = model.generate_batch(prompts, generation_config=g, continuous_batching_config=cb, progress_bar=False)
    return {rid: list(o.generated_tokens) for rid, o in out.items()}, {rid: getattr(o, "error", None) for rid, o in out.items()}
ref, _ = gen()
print("[engine] ref lengths", sorted(len(v) for v in ref.values()), flush=True)
gen_state("after ref")
head = launch.ForwardLaunches.head
fired = []
def reads_the_host(self, *a, **k):
    if capturing() and not fired:
        fired.append(1)
        print(f"[engine] host read inside the engine's capture (thr={threading.current_thread().name})", flush=True)
        torch.zeros(1, device="cuda").item()
    return head(self, *a, **k)
launch.ForwardLaunches.head = reads_the_host
handle = attach(model, mode=mode, sweep_interval=4)
try:
    with handle:
        out, errs = gen()
    print("[engine] generate returned; errors:", {k: str(v)[:80] for k, v in errs.items() if v}, flush=True)
except Exception as exc:
    out = None
    print("[engine] raised:", type(exc).__name__, str(exc)[:200], flush=True)
launch.ForwardLaunches.head = head
c = handle.counters()
print("[engine] counts engine/checked/unchecked", c["engine_forwards"], c["checked_forwards"], c["unchecked_forwards"], flush=True)
if out is not None:
    diff = {k: (ref[k], out.get(k)) for k in ref if out.get(k) != ref[k]}
    print("[engine] requests differing from ref:", len(diff), list(diff.items())[:3], flush=True)
gen_state("after the attached run")
other_resets("engine")
try:
    again, errs = gen()
    print("[engine] later canary-off run identical:", again == ref, {k: str(v)[:80] for k, v in errs.items() if v}, flush=True)
except Exception as exc:
    print("[engine] later run raised", type(exc).__name__, str(exc)[:200], flush=True)
print("ENGINE-DONE")
"""


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    env = dict(os.environ, DIAG_CAPTURE_LOG="1",
               PYTHONPATH=os.pathsep.join([os.path.join(root, "src"), here] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    for name, code, arg in [("raw_log", RAW, "log"), ("raw_raise", RAW, "raise"),
                            ("engine_log", ENGINE, "log"), ("engine_raise", ENGINE, "raise")]:
        print(f"===== {name}", flush=True)
        try:
            r = subprocess.run([sys.executable, "-c", code, arg], capture_output=True, text=True, timeout=240, env=env,
                               cwd=root)
            lines = [ln for ln in (r.stdout + r.stderr).splitlines()
                     if ln.startswith(("[", "RAW", "ENGINE", "Traceback", "  File", "RuntimeError", "torch."))
                     and "Creating graph" not in ln]
            print("\n".join(lines[-80:]))
            print(f"rc={r.returncode}", flush=True)
        except subprocess.TimeoutExpired:
            print("timeout", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
