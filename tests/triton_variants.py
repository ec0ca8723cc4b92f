"""Which Triton variants interpreted launches would compile on a GPU.

Under ``TRITON_INTERPRET=1`` nothing is compiled, so nothing says how many variants a workload would
build on a card. `record_variants` binds every interpreted launch's arguments with the binder Triton
builds for a CUDA sm_90 target (the same specialisation rules: integers == 1 or divisible by 16,
pointer alignment, constexprs, minus the kernel's ``do_not_specialize`` lists) and records the keys.
"""
from __future__ import annotations

import collections
import contextlib
from typing import Iterator

from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, create_function_from_signature

_JIT_OPTIONS = ("do_not_specialize", "do_not_specialize_on_alignment")

Key = tuple  # ((type, specialisation), ...) in parameter order


def is_constexpr(entry: tuple) -> bool:
    return entry[0] == "constexpr"


@contextlib.contextmanager
def record_variants() -> Iterator[dict[str, set[Key]]]:
    """Within the block, every interpreted launch adds its specialisation key to ``variants[kernel name]``."""
    backend = make_backend(GPUTarget("cuda", 90, 32))
    binders: dict[int, object] = {}
    variants: dict[str, set[Key]] = collections.defaultdict(set)
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        binder = binders.get(id(self))
        if binder is None:
            jf = JITFunction(self.fn, **{k: v for k, v in self.kwargs.items() if k in _JIT_OPTIONS})
            binder = binders[id(self)] = create_function_from_signature(jf.signature, jf.params, backend)
        _, spec, _ = binder(*args, **kwargs)
        variants[self.fn.__name__].add(tuple(tuple(e) for e in spec))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        yield variants
    finally:
        InterpretedFunction.run = original


def runtime_only_differences(keys: set[Key]) -> list[tuple[Key, Key]]:
    """Pairs of keys with the same constexprs: variants that only a runtime value or an alignment split."""
    by_constexprs: dict[tuple, list[Key]] = collections.defaultdict(list)
    for key in keys:
        by_constexprs[tuple(e for e in key if is_constexpr(e))].append(key)
    return [(group[0], other) for group in by_constexprs.values() for other in group[1:]]
