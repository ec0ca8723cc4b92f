"""Which Triton variants interpreted launches would compile on a GPU.

Under ``TRITON_INTERPRET=1`` nothing is compiled, so nothing says how many variants a workload would
build on a card. `record_variants` binds every interpreted launch's arguments with the binder Triton
builds for a CUDA sm_90 target (the same specialisation rules: integers == 1 or divisible by 16,
pointer alignment, constexprs, minus the kernel's ``do_not_specialize`` lists) and records the keys;
``compile_specs`` (when given a dict) also gets, per variant, what `triton.compile` needs to build it for
sm_90 ahead of time (`COMPILE_SM90`, run in a process without the interpreter).
"""
from __future__ import annotations

import collections
import contextlib
from typing import Iterator, Optional

from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, create_function_from_signature

_JIT_OPTIONS = ("do_not_specialize", "do_not_specialize_on_alignment")

Key = tuple  # ((type, specialisation), ...) in parameter order


def is_constexpr(entry: tuple) -> bool:
    return entry[0] == "constexpr"


@contextlib.contextmanager
def record_variants(compile_specs: Optional[dict] = None) -> Iterator[dict[str, set[Key]]]:
    """Within the block, every interpreted launch adds its specialisation key to ``variants[kernel name]``
    (and, with ``compile_specs``, ``compile_specs[(module, kernel name, key)]`` = a JSON-able compile spec)."""
    backend = make_backend(GPUTarget("cuda", 90, 32))
    binders: dict[int, tuple] = {}
    variants: dict[str, set[Key]] = collections.defaultdict(set)
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        entry = binders.get(id(self))
        if entry is None:
            jf = JITFunction(self.fn, **{k: v for k, v in self.kwargs.items() if k in _JIT_OPTIONS})
            entry = binders[id(self)] = (jf, create_function_from_signature(jf.signature, jf.params, backend))
        jf, binder = entry
        bound, spec, options = binder(*args, **kwargs)
        key = tuple(tuple(e) for e in spec)
        variants[self.fn.__name__].add(key)
        if compile_specs is not None and (self.fn.__module__, self.fn.__name__, key) not in compile_specs:
            options, signature, constexprs, attrs = jf._pack_args(backend, kwargs, bound, spec, options)
            compile_specs[(self.fn.__module__, self.fn.__name__, key)] = dict(
                module=self.fn.__module__, kernel=self.fn.__name__, signature=signature,
                constexprs=[[list(path), _plain(v)] for path, v in constexprs.items()],
                attrs=[[list(path), v] for path, v in attrs.items()],
                options={k: getattr(options, k) for k in ("num_warps", "num_stages", "num_ctas")})
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


def _plain(value):
    """A constexpr value as JSON keeps it (Triton's constexpr wrapper and dtypes unwrapped to their value / name)."""
    value = getattr(value, "value", value)
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


COMPILE_SM90 = """
import json, sys, importlib
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
failed = []
specs = json.load(sys.stdin)
for s in specs:
    kernel = getattr(importlib.import_module(s["module"]), s["kernel"])
    src = ASTSource(kernel, s["signature"], {tuple(p): v for p, v in s["constexprs"]}, {tuple(p): v for p, v in s["attrs"]})
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=s["options"])
        assert compiled.asm.get("cubin"), "no cubin"
    except Exception as exc:
        failed.append(f"{s['module']}.{s['kernel']}: {type(exc).__name__}: {str(exc)[:600]}")
print(json.dumps({"compiled": len(specs) - len(failed), "failed": failed}))
"""
"""Run with ``python -c COMPILE_SM90`` (``TRITON_INTERPRET`` unset), the compile specs as a JSON list on stdin:
prints ``{"compiled": n, "failed": [...]}``."""
