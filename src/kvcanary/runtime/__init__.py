"""kvcanary.runtime — the engine-neutral canary runtime (docs/design.md §4).

An adapter builds a `BatchDescription` per forward and brackets the forward with a `Canary`
(see `kvcanary.runtime.canary` for the step-by-step contract). The runtime never imports an engine.
"""
from kvcanary.runtime.batch import (FORWARD_KINDS, BatchDescription, BlockTable, GroupBatch, GroupSpec, ReadCheck,
                                    RewriteCounter, classify_forward,
                                    group_kind)
from kvcanary.runtime.canary import Canary, create_canary
from kvcanary.runtime.config import CanaryConfig
from kvcanary.runtime.health import CanaryHealthError
from kvcanary.runtime.stats import CanaryStats
from kvcanary.runtime.sweep import SweepReport
from kvcanary.runtime.attribution import Violation
from kvcanary.runtime.report import CanaryViolationError

__all__ = [
    "FORWARD_KINDS", "BatchDescription", "BlockTable", "GroupBatch", "GroupSpec", "ReadCheck", "RewriteCounter",
    "classify_forward", "group_kind",
    "Canary", "create_canary", "CanaryConfig", "CanaryHealthError", "CanaryStats",
    "SweepReport", "CanaryViolationError", "Violation",
]
