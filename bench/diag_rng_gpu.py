"""Diagnostic (H200): which step leaves torch's CUDA generator marked as capturing. Each sequence in a child."""
import json, subprocess, sys, os

SEQ = {
    "probe_then_randint": "from kvcanary.runtime.device_probe import prove_device_path as p; p('cuda'); torch.randint(0,9,(1,),device='cuda'); print('OK')",
    "gen_probe_randint": "m=tm(); g(m,True); from kvcanary.runtime.device_probe import prove_device_path as p; p('cuda'); torch.randint(0,9,(1,),device='cuda'); print('OK')",
    "gen_attach_gen": "m=tm(); g(m,True); h=attach(m, mode='log', sweep_interval=4)\nwith h: g(m,True)\nprint('OK', h.counters()['engine_forwards'], h.counters()['checked_forwards'])",
    "attach_gen": "m=tm(); h=attach(m, mode='log', sweep_interval=4)\nwith h: g(m,True)\nprint('OK', h.counters()['engine_forwards'], h.counters()['checked_forwards'])",
    "gen_eager_gen_attach_gen": "m=tm(); g(m,True); g(m,False); h=attach(m, mode='log', sweep_interval=4)\nwith h: g(m,True)\nprint('OK')",
}
PRE = """
import torch, logging, sys
sys.path.insert(0, 'bench')
from chaos_gpu import _generate as _g
from kvcanary.cli.demo import tiny_model, workload
from kvcanary.engines.transformers_cb import attach
logging.getLogger('kvcanary').setLevel(logging.CRITICAL)
def tm(): return tiny_model('llama', torch.device('cuda'), seed=0)
P = workload(seed=1, num_requests=6)
def g(m, graphs): return _g(m, P, graphs=graphs)
"""
res = {}
for name, body in SEQ.items():
    r = subprocess.run([sys.executable, "-c", PRE + body], capture_output=True, text=True, timeout=150)
    tail = (r.stdout + r.stderr).strip().splitlines()
    res[name] = {"rc": r.returncode, "tail": tail[-3:]}
    print(name, r.returncode, tail[-2:] if tail else "", flush=True)
out = os.environ.get("OUT")
if out:
    json.dump(res, open(os.path.join(out, "diag_rng.json"), "w"), indent=1)
