"""Deprecated: the live-engine experiments moved to `kvcanary.faults.vllm_experiments`. This module re-exports its
names and warns (`DeprecationWarning`) on import; ``python -m kvcanary.engines.vllm.experiments ...`` still runs it.
"""
from __future__ import annotations

import warnings

from kvcanary.faults.vllm_experiments import *  # noqa: F401,F403
from kvcanary.faults.vllm_experiments import __all__, _canary_of, main  # noqa: F401

warnings.warn("kv-canary: kvcanary.engines.vllm.experiments moved to kvcanary.faults.vllm_experiments; import (or "
              "run with python -m) it from there", DeprecationWarning,
              stacklevel=1 if __name__ == "__main__" else 2)  # run as a script: shown by default

if __name__ == "__main__":
    raise SystemExit(main())
