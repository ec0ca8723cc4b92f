"""Deprecated: the fault-injecting connector moved to `kvcanary.faults.vllm` (fault tooling lives outside the
engine adapters). This module re-exports its names and warns (`DeprecationWarning`) on import; like it, it needs vLLM.
"""
from __future__ import annotations

import warnings

from kvcanary.faults.vllm import *  # noqa: F401,F403
from kvcanary.faults.vllm import __all__, _NoMetadata, _token_element  # noqa: F401

warnings.warn("kv-canary: kvcanary.engines.vllm.faults moved to kvcanary.faults.vllm (KvCanaryFaultConnector, "
              "faulted_kv_transfer_config); import it from there", DeprecationWarning, stacklevel=2)
