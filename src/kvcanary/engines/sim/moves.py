"""KV moves of the simulated engine, checked through the runtime's move API (`Canary.copy_slots`,
`export_records`, `import_records`): fork, a host-offload tier, transfer out / in.

* `SimMoves.fork(rid, child)` — parallel sampling: the child shares the parent's cached prefix (radix
  path, locked) and gets a private copy of the rest (the copy a copy-on-write engine makes before the
  first divergent write); KV and canary records are copied slot to slot on the device.
* `offload(rid)` / `restore(rid)` — the request's own slots go to host memory (KV bytes + exported
  records, `HostEntry`) and their device slots are freed; the restore allocates fresh slots, writes the
  KV back and imports the records, verified at once against the request's positions and tokens — a
  host copy corrupted in between is reported against the restoring request.
* `transfer_out(rid)` -> `Transfer` (every computed slot's KV + records, the request's tokens) and the
  request leaves this engine; `transfer_in(transfer)` on another engine allocates, writes the KV and
  imports + verifies the records before the request runs (prefill -> decode disaggregation).

Full-attention engines only (``sliding_window == 0``); between `SimEngine.step` calls. A `SimEngine`
without a canary moves the KV alone (the unchecked baseline).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from kvcanary.errors import KvCanaryRuntimeError, KvCanaryValueError
from kvcanary.engines.sim.engine import SimEngine, SimRequest
from kvcanary.engines.sim.identity import SimImage
from kvcanary.runtime.identity import ProducerIdentity
from kvcanary.engines.sim.radix import RadixCache


@dataclass(frozen=True, kw_only=True)
class Transfer:
    """One request's KV in flight. kv: uint8 ``[layers * 2, n, kv_bytes]`` (layer-major, K then V) on the
    host; records: the canary export of the n slots (None without a canary); positions 0..n-1; context: the
    request's context key (travels with it), with the identity, images and weights version it was issued for."""

    rid: str
    tokens: tuple[int, ...]
    num_computed: int
    max_new: int
    generated: int
    kv: torch.Tensor
    records: Optional[torch.Tensor]
    context: int = 0
    identity: ProducerIdentity = ProducerIdentity()
    images: tuple[SimImage, ...] = ()
    weights_version: int = 0


@dataclass(kw_only=True)
class HostEntry:
    """An offloaded request's own slots in host memory (positions ``own_from .. own_from + n - 1``)."""

    request: SimRequest
    kv: torch.Tensor
    records: Optional[torch.Tensor]
    reports: list = field(default_factory=list)


class SimMoves:
    """Fork, offload / restore and transfer for one `SimEngine` (see the module docstring)."""

    def __init__(self, engine: SimEngine) -> None:
        if engine.config.sliding_window:
            raise KvCanaryValueError("kv-canary: SimMoves supports full-attention sim engines only (sliding_window=0)")
        self.engine = engine
        self.host: dict[str, HostEntry] = {}
        self.reports: list = []  # MoveReports, oldest first

    # ---- fork -----------------------------------------------------------------------------------
    def fork(self, rid: str, child_rid: str) -> SimRequest:
        e = self.engine
        parent = e.request(rid)
        src = parent.full_slots[parent.own_from : parent.num_computed]
        dst = self._alloc(len(src))
        self._copy_kv(src, dst)
        child = SimRequest(rid=child_rid, tokens=list(parent.tokens), max_new=parent.max_new,
                           generated=parent.generated, num_computed=parent.num_computed, own_from=parent.own_from,
                           state="running", context=parent.context, identity=parent.identity, images=parent.images,
                           weights_version=parent.weights_version)
        child.row = e.table.alloc_row()
        child.path = list(parent.path)
        RadixCache.lock(child.path, +1)
        child.full_slots = parent.full_slots[: parent.own_from] + dst
        child.swa_slots = [0] * len(child.full_slots)
        child.swa_dropped_upto = parent.swa_dropped_upto
        self._install_row(child)
        if e.canary is not None:
            self.reports.append(e.canary.copy_slots("full", src, dst, request_ids=[child_rid], verify=True,
                                                    label=f"fork:{rid}->{child_rid}", context_keys=[child.context]))
        e.running.append(child)
        return child

    # ---- host offload tier ------------------------------------------------------------------------
    def offload(self, rid: str) -> HostEntry:
        e = self.engine
        req = e.request(rid)
        own = req.full_slots[req.own_from : req.num_computed]
        records = e.canary.export_records("full", own).cpu() if e.canary is not None else None
        entry = HostEntry(request=req, kv=self._read_kv(own).cpu(), records=records)
        e._free(own, [])
        del req.full_slots[req.own_from :]
        req.state = "offloaded"
        e.running.remove(req)
        self.host[rid] = entry
        return entry

    def restore(self, rid: str):
        """Bring an offloaded request back; returns the import's `MoveReport` (None without a canary)."""
        e = self.engine
        entry = self.host.pop(rid)
        req = entry.request
        n = entry.kv.shape[1]
        dst = self._alloc(n)
        self._write_kv(dst, entry.kv)
        req.full_slots += dst
        e.table.req_to_token[req.row, req.own_from : req.own_from + n] = torch.tensor(dst, dtype=torch.int32).to(e.device)
        report = None
        if e.canary is not None:
            seed = [req.full_slots[req.own_from - 1]] if req.own_from else None
            report = e.canary.import_records(
                "full", dst, entry.records, positions=range(req.own_from, req.own_from + n),
                tokens=req.tokens[req.own_from : req.own_from + n], request_ids=[rid], prev_slots=seed,
                label=f"restore:{rid}", context_keys=[req.context])
            self.reports.append(report)
        req.state = "running"
        e.running.append(req)
        return report

    # ---- transfer between engines ----------------------------------------------------------------------
    def transfer_out(self, rid: str) -> Transfer:
        e = self.engine
        req = e.request(rid)
        slots = req.full_slots[: req.num_computed]
        records = e.canary.export_records("full", slots).cpu() if e.canary is not None else None
        t = Transfer(rid=rid, tokens=tuple(req.tokens), num_computed=req.num_computed, max_new=req.max_new,
                     generated=req.generated, kv=self._read_kv(slots).cpu(), records=records, context=req.context,
                     identity=req.identity, images=req.images, weights_version=req.weights_version)
        e._release(req)
        req.state = "transferred"
        return t

    def transfer_in(self, t: Transfer, *, verify: bool = True):
        """Admit ``t`` as a running request here; returns (request, import `MoveReport` or None). Call
        after the KV bytes are final: the import verifies them at once."""
        e = self.engine
        req = SimRequest(rid=t.rid, tokens=list(t.tokens), max_new=t.max_new, generated=t.generated,
                         num_computed=t.num_computed, state="running", context=t.context, identity=t.identity,
                         images=t.images, weights_version=t.weights_version)
        e._contexts_used = e._contexts_used or t.context != 0
        req.row = e.table.alloc_row()
        dst = self._alloc(t.num_computed)
        self._write_kv(dst, t.kv)
        req.full_slots = dst
        req.swa_slots = [0] * len(dst)
        self._install_row(req)
        report = None
        if e.canary is not None and t.records is not None:
            report = e.canary.import_records("full", dst, t.records, verify, positions=range(t.num_computed),
                                             tokens=list(t.tokens[: t.num_computed]), request_ids=[t.rid],
                                             label=f"transfer:{t.rid}", context_keys=[t.context])
            self.reports.append(report)
        e.running.append(req)
        return req, report

    # ---- helpers -----------------------------------------------------------------------------------
    def _alloc(self, n: int) -> list[int]:
        got = self.engine._alloc(n)
        if got is None:
            raise KvCanaryRuntimeError(f"kv-canary: sim engine has no room for {n} slots")
        return got[0]

    def _install_row(self, req: SimRequest) -> None:
        e = self.engine
        e.table.tokens[req.row, : len(req.tokens)] = torch.tensor(req.tokens, dtype=torch.int32).to(e.device)
        if req.full_slots:
            e.table.req_to_token[req.row, : len(req.full_slots)] = torch.tensor(req.full_slots, dtype=torch.int32).to(e.device)

    def _layers(self):
        return [kv for (g, _), kv in sorted(self.engine.kv.items(), key=lambda x: x[0][1]) if g == "full"]

    def _read_kv(self, slots: list[int]) -> torch.Tensor:
        idx = torch.tensor(slots, dtype=torch.int64, device=self.engine.device)
        return torch.stack([t[idx] for pair in self._layers() for t in pair])

    def _write_kv(self, slots: list[int], kv: torch.Tensor) -> None:
        idx = torch.tensor(slots, dtype=torch.int64, device=self.engine.device)
        for i, t in enumerate(t for pair in self._layers() for t in pair):
            t[idx] = kv[i].to(t.device)

    def _copy_kv(self, src: list[int], dst: list[int]) -> None:
        self._write_kv(dst, self._read_kv(src))
