"""Diagnostic (H200, issue 37): which capture leaves torch's CUDA generator unusable. Each case in a child, with
every capture begin/end logged (bench/diag/sitecustomize.py). Writes $OUT/diag_capture.json and one log per case."""
import json, os, subprocess, sys, time
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.environ.get("OUT", "/tmp/diag_out")
os.makedirs(OUT, exist_ok=True)
PRE = """
import torch, logging, sys, gc
sys.path.insert(0, 'bench')
from chaos_gpu import _generate as _g
from kvcanary.cli.demo import tiny_model, workload
from kvcanary.engines.transformers_cb import attach
from kvcanary.runtime.capture import capture_graph
logging.getLogger('kvcanary').setLevel(logging.CRITICAL)
logging.getLogger('ContinuousBatchingLogger').setLevel(logging.CRITICAL)
def tm(): return tiny_model('llama', torch.device('cuda'), seed=0)
P = workload(seed=1, num_requests=6)
def g(m, graphs): return _g(m, P, graphs=graphs)
def rng(tag):
    try:
        torch.rand(2, device='cuda').sum().item(); print('RNG-OK', tag, flush=True)
    except Exception as e:
        print('RNG-BROKEN', tag, str(e)[:100], flush=True)
def fail_capture():
    x = torch.ones(4, device='cuda')
    try:
        capture_graph(lambda: (x * 2).sum().item())
    except Exception as e:
        print('capture failed as meant:', type(e).__name__, str(e)[:80], flush=True)
"""
CASES = {
    "headers": ("sh", "grep -n 'capturing_\\|capture_states_\\|capture_prologue\\|capture_epilogue' "
                "$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/include/ATen/cuda/CUDAGeneratorImpl.h | head -20"),
    "fail_then_engine_graphs": ("py", "fail_capture(); rng('after-fail'); gc.collect(); rng('after-gc'); m=tm(); r=g(m,True); rng('after-gen'); print('OK gen', len(r))"),
    "fail_gc_then_engine_graphs_twice": ("py", "fail_capture(); gc.collect(); m=tm(); g(m,True); g(m,True); rng('end'); print('OK')"),
    "chaos_order": ("py", "m=tm(); a=g(m,True); b=g(m,False); rng('refs'); h=attach(m, mode='log', sweep_interval=4)\nwith h: c=g(m,True)\nrng('end'); print('OK same', a==c, h.counters()['engine_forwards'], h.counters()['checked_forwards'])"),
    "chaos_script": ("sh", "timeout 200 python3 bench/chaos_gpu.py --cases 3 --budget-s 150"),
    "pytest_pair": ("sh", "timeout 200 python3 -X faulthandler -m pytest -p no:xdist -p no:cacheprovider -s -q -x tests/gpu/test_device_probe_gpu.py 'tests/gpu/test_fuzz_clean_gpu.py::test_transformers_clean_config_cuda_graphs[0]' 'tests/gpu/test_fuzz_clean_gpu.py::test_transformers_clean_config_cuda_graphs[1]'"),
}
env = dict(os.environ, PYTHONPATH=f"{ROOT}/bench/diag:{ROOT}/src", DIAG_CAPTURE_LOG="1", PYTHONUNBUFFERED="1",
           TORCH_SHOW_CPP_STACKTRACES="0")
only = sys.argv[1:]
res = {}
for name, (kind, body) in CASES.items():
    if only and name not in only:
        continue
    t = time.monotonic()
    cmd = ["bash", "-c", body] if kind == "sh" else [sys.executable, "-X", "faulthandler", "-c", PRE + body]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=230, env=env, cwd=ROOT)
        rc, text = r.returncode, r.stdout + "\n--- stderr ---\n" + r.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = "timeout", str(e.stdout or "") + str(e.stderr or "")
    open(os.path.join(OUT, f"{name}.log"), "w").write(text)
    lines = [l for l in text.splitlines() if l.strip()]
    key = [l for l in lines if any(s in l for s in ("RNG-", "OK", "END-FAILED", "Offset", "Fatal", "terminate", "what()", "passed", "failed", "ok=", "registered", "capture failed"))]
    res[name] = {"rc": rc, "s": round(time.monotonic() - t, 1), "key": key[-25:], "tail": lines[-6:]}
    print(f"== {name}: rc={rc} {res[name]['s']} s", flush=True)
    for l in key[-12:]:
        print("   ", l[:220], flush=True)
    json.dump(res, open(os.path.join(OUT, "diag_capture.json"), "w"), indent=1)
