"""A model's weights version, noticed cheaply: `WeightsWatch` (docs/design.md §5.6).

RL loops update a serving model's weights in place (``load_state_dict``, an optimizer step on a shared model, an
engine's ``load_weights``). A prefix cache that survives the update serves KV computed by the old weights. An adapter
folds a weights version into every request's producer identity, taken when the request first appears; the version
goes up when the watch saw a change, so a later request hitting a block cached under the old weights fails at
position 0 (``verify_chain_hash``, named ``identity_weights_version``). Engine-agnostic: it sees only a
``torch.nn.Module``.

How a change is seen (nothing scans the weights, nor even every parameter, per step):

* ``load_state_dict`` on the model or any of its submodules (``assign=True`` included): a post-hook on every module
  marks the weights changed; free until a load runs;
* the model's own loading methods named in ``methods`` (e.g. vLLM's ``load_weights``): wrapped on the instance,
  a call marks the weights changed when it returns;
* an optimizer step (any ``torch.optim.Optimizer``) whose parameter groups hold one of the model's parameters: a
  global step post-hook marks them changed (one set lookup per optimizer parameter, per optimizer step);
* any other in-place write through a parameter (``p.copy_(...)``, ``p.add_(...)``) that reaches one of a few
  sentinel parameters spread over the model (`SENTINELS`: the first, the last, evenly between): their tensor
  version counters (``Tensor._version``) are compared in `current` — a handful of attribute reads.

The adapter calls `current` once per engine step that admits a request (never on pure decode steps), so a change is
seen before the next request is keyed. Writes none of these see — through ``param.data`` (``p.data.copy_(...)``)
outside a watched method, in-place writes to non-sentinel parameters only, parameters replaced by assignment, writes
from outside Python (another process writing the weights' memory) — need the manual fallback `bump`, called after the
update and before the next request. With ``auto=False`` only `bump` changes the version.
"""
from __future__ import annotations

import functools
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from kvcanary.errors import KvCanaryValueError

SENTINELS = 8


def _counter(p: torch.Tensor):
    """``p``'s version counter, or None where it has none (an inference-mode tensor)."""
    try:
        return p._version
    except RuntimeError:
        return None


class WeightsWatch:
    """The weights version of ``model`` (see the module docstring); starts at 0. `install` arms the hooks,
    `remove` disarms them (idempotent)."""

    def __init__(self, model: torch.nn.Module, *, auto: bool = True, sentinels: int = SENTINELS,
                 methods: tuple[str, ...] = ()) -> None:
        if sentinels < 1:
            raise KvCanaryValueError(f"kv-canary: WeightsWatch sentinels must be >= 1, got {sentinels}")
        self.model = model
        self.auto = auto
        self.sentinels = sentinels
        self.methods = tuple(m for m in methods if callable(getattr(model, m, None)))
        self._wrapped: list[tuple[str, object]] = []  # (method name, the instance attribute it replaced, or None)
        self.version = 0
        self.changes = 0  # changes the automatic watch saw (bumps by `bump` not counted)
        self._dirty = False
        self._hooks: list = []
        self._ids: frozenset[int] = frozenset()
        self._watched: list[torch.Tensor] = []
        self._seen: list = []

    def install(self) -> None:
        if not self.auto or self._hooks:
            return
        ref = weakref.ref(self)

        def loaded(module, incompatible_keys) -> None:
            watch = ref()
            if watch is not None:
                watch._dirty = True

        def stepped(optimizer, args, kwargs) -> None:
            watch = ref()
            if watch is not None and not watch._dirty:
                ids = watch._ids
                watch._dirty = any(id(p) in ids for g in optimizer.param_groups for p in g["params"])

        self._hooks = [m.register_load_state_dict_post_hook(loaded) for m in self.model.modules()]
        self._hooks.append(register_optimizer_step_post_hook(stepped))
        for name in self.methods:
            self._wrap(name, ref)
        self._take()

    def _wrap(self, name: str, ref) -> None:
        own = self.model.__dict__.get(name)  # an instance attribute already there (another wrapper): restored later
        inner = getattr(self.model, name)

        @functools.wraps(inner)
        def loading(*args, **kwargs):
            try:
                return inner(*args, **kwargs)
            finally:
                watch = ref()
                if watch is not None:
                    watch._dirty = True

        object.__setattr__(self.model, name, loading)
        self._wrapped.append((name, own))

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for name, own in reversed(self._wrapped):
            if own is None:
                self.model.__dict__.pop(name, None)
            else:
                object.__setattr__(self.model, name, own)
        self._wrapped = []

    def _take(self) -> None:
        """Take the parameter set and the sentinels' counters as they are now."""
        params = list(self.model.parameters())
        self._ids = frozenset(id(p) for p in params)
        tracked = [p for p in params if p.numel() and _counter(p) is not None]  # empty ones are never written
        n = min(self.sentinels, len(tracked))
        picks = sorted({round(i * (len(tracked) - 1) / max(n - 1, 1)) for i in range(n)}) if n else []
        self._watched = [tracked[i] for i in picks]
        self._seen = [p._version for p in self._watched]

    def current(self) -> int:
        """The version now: bumped once if the weights changed (see the module docstring) since the last call."""
        if not self._hooks:
            return self.version
        if self._dirty or [p._version for p in self._watched] != self._seen:
            self.version += 1
            self.changes += 1
            self._dirty = False
            self._take()
        return self.version

    def bump(self) -> int:
        """The manual fallback: the weights changed in a way the watch cannot see; returns the new version."""
        self.version += 1
        if self._hooks:
            self._dirty = False
            self._take()  # what the watch sees now belongs to the new version
        return self.version


__all__ = ["WeightsWatch", "SENTINELS"]
