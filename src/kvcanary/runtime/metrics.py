"""Prometheus metrics for the operator (optional: ``pip install 'kvcanary[metrics]'`` for ``prometheus_client``).

    from prometheus_client import CollectorRegistry, start_http_server
    from kvcanary.runtime.metrics import register_metrics

    registry = CollectorRegistry()
    register_metrics(handle, registry=registry)    # a `Canary`, or an adapter handle (e.g. kvcanary.attach's)
    start_http_server(9400, registry=registry)

A collector registered on the caller's registry: nothing runs per forward. Each scrape reads the source's
``counters()`` / ``stats()`` (and ``violations()`` for the reason-by-group split) — those flush the drain and
may wait for the device, so a scrape costs one drain, never the serving path. A scrape that fails is
logged, counted in ``kvcanary_scrape_errors_total`` and yields what it has.

Metrics (counters end in ``_total``; a source's counters only grow, so they are exported as counters):

* ``kvcanary_violations_total{group, reason}`` — kept violations (every one unless more than the ledger's
  keep bound) by group and reason label; ``kvcanary_violations_by_tag_total{group, tag}`` — exact, from the
  rings' write indices (``group`` there is the tag's kind: a tag sums the groups of that kind);
  ``kvcanary_ring_overflow_total`` — rows counted but not kept.
* ``kvcanary_forwards_total{state}`` — ``checked`` (HEAD checks ran on the device), ``engine`` (forwards
  the adapter saw, when it counts them), ``unchecked`` (ran while attached without the canary; by cause in
  ``kvcanary_unchecked_forwards_total{cause}``).
* ``kvcanary_slots_verified_total{phase}``, ``kvcanary_slots_written_total{phase}`` (head / tail / sweep),
  ``kvcanary_unchecked_slots_total{kind}`` (the runtime's coverage account, when it has one: every integer
  entry of ``counters()["coverage"]``), ``kvcanary_plans_disabled_total``, ``kvcanary_canary_errors_total``.
* ``kvcanary_suspended{reason}`` — 1 while the source's canary is suspended after its own failure (``reason``:
  the cause; checking stopped, the engine serves on, ``forwards_total{state="engine"}`` keeps growing past
  ``checked``), else 0 with an empty reason; ``kvcanary_device_path{path}`` — 1 for the path the launches take
  (``kernels``, ``twins`` on the CPU, ``eager_fallback`` on a CUDA machine without a working Triton), when the
  source says.
* gauges: ``kvcanary_memory_bytes`` (device bytes of the newest canary), ``kvcanary_sweep_passes_total``
  (counter), ``kvcanary_sweep_pass_slots{group, kind}`` (``live`` / ``verified`` slots of the last rotating
  pass).
"""
from __future__ import annotations

import logging
from typing import Iterable, Iterator, Optional

from kvcanary.errors import KvCanaryRuntimeError, KvCanaryTypeError

logger = logging.getLogger("kvcanary")

PREFIX = "kvcanary"


def _prometheus():
    try:
        import prometheus_client  # noqa: F401
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    except ImportError:
        raise KvCanaryRuntimeError(
            "kv-canary: metrics need prometheus_client (pip install 'kvcanary[metrics]')"
        ) from None
    return CounterMetricFamily, GaugeMetricFamily


def tag_group(tag: str) -> str:
    """Group kind of a launch tag name (``HEAD_K_FULL`` -> ``full``, ``SWEEP_V_SWA`` -> ``swa``): a tag's count sums
    the groups of its kind (``full``, ``full.1``, ...); ``kvcanary_violations_total`` names each group."""
    return tag.rsplit("_", 1)[-1].lower() if "_" in tag else "unknown"


class CanaryCollector:
    """A ``prometheus_client`` collector over one or more canary sources (objects with ``counters()`` and
    ``stats()``: a `Canary`, a `TransformersCbHandle`, ...). Label ``canary`` names the source."""

    def __init__(self, sources: dict[str, object]) -> None:
        for name, src in sources.items():
            if not (callable(getattr(src, "counters", None)) and callable(getattr(src, "stats", None))):
                raise KvCanaryTypeError(
                    f"kv-canary: metrics source {name!r} needs counters() and stats(), got {type(src).__name__}"
                )
        self.sources = dict(sources)
        self.scrape_errors = 0
        self._families = _prometheus()

    def describe(self) -> list:
        return []  # dynamic label sets: no describe-time collect (the registry then skips a dry scrape)

    def collect(self) -> Iterator[object]:
        Counter, Gauge = self._families
        fam = {
            "violations": Counter(f"{PREFIX}_violations", "Kept violations by group and reason label",
                                  labels=["canary", "group", "reason"]),
            "by_tag": Counter(f"{PREFIX}_violations_by_tag", "Violations by launch tag (exact)",
                              labels=["canary", "group", "tag"]),
            "overflow": Counter(f"{PREFIX}_ring_overflow", "Violation rows counted but not kept (ring full)",
                                labels=["canary"]),
            "forwards": Counter(f"{PREFIX}_forwards", "Forwards: checked on the device, seen by the adapter, unchecked",
                                labels=["canary", "state"]),
            "unchecked": Counter(f"{PREFIX}_unchecked_forwards", "Forwards that ran while attached without the canary",
                                 labels=["canary", "cause"]),
            "verified": Counter(f"{PREFIX}_slots_verified", "Slots verified by phase", labels=["canary", "phase"]),
            "written": Counter(f"{PREFIX}_slots_written", "Slot records written by phase", labels=["canary", "phase"]),
            "skipped": Counter(f"{PREFIX}_unchecked_slots", "Slots or work not checked, by kind (coverage account)",
                               labels=["canary", "kind"]),
            "plans": Counter(f"{PREFIX}_plans_disabled", "Verify plans disabled by capacity overflow", labels=["canary"]),
            "errors": Counter(f"{PREFIX}_canary_errors", "Canary errors that degraded checking (log mode)",
                              labels=["canary"]),
            "memory": Gauge(f"{PREFIX}_memory_bytes", "Device bytes of the canary", labels=["canary"]),
            "suspended": Gauge(f"{PREFIX}_suspended", "1 while the canary is suspended after its own failure",
                               labels=["canary", "reason"]),
            "path": Gauge(f"{PREFIX}_device_path", "The path the canary's launches take", labels=["canary", "path"]),
            "passes": Counter(f"{PREFIX}_sweep_passes", "Rotating sweep passes completed", labels=["canary"]),
            "pass_slots": Gauge(f"{PREFIX}_sweep_pass_slots", "Live / verified slots of the last rotating pass",
                                labels=["canary", "group", "kind"]),
        }
        errors = Counter(f"{PREFIX}_scrape_errors", "Scrapes of a canary source that failed", labels=[])
        for name, src in self.sources.items():
            try:
                self._collect_one(name, src, fam)
            except Exception as exc:  # noqa: BLE001 — a scrape never takes the exporter down
                self.scrape_errors += 1
                logger.warning("kv-canary: metrics scrape of %r failed: %s", name, exc)
        errors.add_metric([], self.scrape_errors)
        yield from fam.values()
        yield errors

    @staticmethod
    def _collect_one(name: str, src, fam: dict) -> None:
        c = src.counters()
        stats = src.stats()
        stats = [s for s in (stats if isinstance(stats, (list, tuple)) else [stats]) if s is not None]
        by_group_reason: dict[tuple[str, str], int] = {}
        violations = getattr(src, "violations", None)
        if callable(violations):
            for v in violations():
                key = (str(v.group), str(v.reason_label))
                by_group_reason[key] = by_group_reason.get(key, 0) + 1
        for (group, reason), n in sorted(by_group_reason.items()):
            fam["violations"].add_metric([name, group, reason], n)
        for tag, n in sorted(dict(c.get("by_tag", {})).items()):
            fam["by_tag"].add_metric([name, tag_group(str(tag)), str(tag)], n)
        fam["overflow"].add_metric([name], c.get("ring_overflow", 0))
        fam["forwards"].add_metric([name, "checked"], c.get("checked_forwards", 0))
        if "engine_forwards" in c:
            fam["forwards"].add_metric([name, "engine"], c["engine_forwards"])
        coverage = c.get("coverage") if isinstance(c.get("coverage"), dict) else {}
        fam["forwards"].add_metric([name, "unchecked"], c.get("unchecked_forwards", coverage.get("unchecked_forwards", 0)))
        for cause, n in sorted(dict(c.get("unchecked_by_cause", {})).items()):
            fam["unchecked"].add_metric([name, cause], n)
        for kind, n in sorted(_integers(c.get("coverage", {}))):
            fam["skipped"].add_metric([name, kind], n)
        fam["errors"].add_metric([name], c.get("canary_errors", coverage.get("canary_errors", 0)))
        reason = c.get("suspended")
        fam["suspended"].add_metric([name, str(reason)[:200] if reason else ""], 1 if reason else 0)
        if c.get("device_path"):
            fam["path"].add_metric([name, str(c["device_path"])], 1)
        verified: dict[str, int] = {}
        written: dict[str, int] = {}
        for s in stats:
            for phase, n in s.slots_verified.items():
                verified[phase] = verified.get(phase, 0) + int(n)
            for phase, n in s.slots_written.items():
                written[phase] = written.get(phase, 0) + int(n)
        for phase, n in sorted(verified.items()):
            fam["verified"].add_metric([name, phase], n)
        for phase, n in sorted(written.items()):
            fam["written"].add_metric([name, phase], n)
        fam["plans"].add_metric([name], sum(s.plans_disabled for s in stats))
        fam["passes"].add_metric([name], sum(s.sweep_passes for s in stats))
        if stats:
            newest = stats[-1]
            fam["memory"].add_metric([name], newest.memory_bytes)
            for group, p in sorted(newest.last_pass.items()):
                for kind in ("live", "verified"):
                    if kind in p:
                        fam["pass_slots"].add_metric([name, group, kind], p[kind])


def _integers(d: object, prefix: str = "") -> Iterable[tuple[str, int]]:
    """Flatten a (nested) dict to ``(dotted key, int)`` pairs; other values are skipped."""
    if not isinstance(d, dict):
        return []
    out = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.extend(_integers(v, key + "."))
        elif isinstance(v, int) and not isinstance(v, bool):
            out.append((key, v))
    return out


def register_metrics(source=None, *, registry, sources: Optional[dict[str, object]] = None,
                     name: str = "default") -> CanaryCollector:
    """Register a `CanaryCollector` over ``source`` (labelled ``name``) and/or ``sources`` ({label: source})
    on ``registry`` (the caller's ``prometheus_client.CollectorRegistry``; required — kvcanary never touches
    the global default registry). Returns the collector (``registry.unregister(collector)`` removes it)."""
    if registry is None:
        raise KvCanaryTypeError("kv-canary: register_metrics needs registry= (a prometheus_client CollectorRegistry)")
    all_sources = dict(sources or {})
    if source is not None:
        all_sources[name] = source
    if not all_sources:
        raise KvCanaryTypeError("kv-canary: register_metrics needs a source (a Canary or an adapter handle)")
    collector = CanaryCollector(all_sources)
    registry.register(collector)
    return collector
