"""The token oracle as the sampler of transformers continuous batching.

`OracleSampler(vocab).install(model)`: every continuous-batching manager the model creates afterwards
(``generate_batch``, ``init_continuous_batching``) samples, for a request ``rid`` whose next token sits at
sequence position ``q``, exactly ``oracle_token(rid, q, vocab)`` — whatever the logits say. Pass
``token_oracle=sampler.token`` to `kvcanary.attach` and the adapter stages the oracle's tokens as the
batch's ``expected_input_ids``: the write-input assert then checks every token the engine writes against
a value fixed before the run (a token swapped, dropped or routed to the wrong request is a ``write_token``
violation charged to the request whose KV got it).

How: a per-request logits processor of the engine (``ContinuousBatchingLogitsProcessor``) is appended to
the manager's list. Its host half runs once per batch, where the engine prepares it: it sees each request
with a new token (id and ``position_offset``, already advanced past the batch) and writes the oracle's
token into the engine's static argument row. Its device half keeps only that token's logit (every other
logit -inf), so greedy decoding and sampling both emit it. The argument row is one of the engine's static
inputs, so CUDA-graph replays sample the oracle's tokens too.

The model is left as it was by `remove` (one instance attribute shadows ``init_continuous_batching``).
Limits: forked requests (``num_return_sequences > 1``) share their parent's tokens before the fork, which
the oracle does not model; a persistent manager created before `install` is refused.
"""
from __future__ import annotations

from typing import Optional

import torch

from kvcanary.engines.transformers_cb import compat
from kvcanary.errors import KvCanaryRuntimeError
from kvcanary.faults.oracle import oracle_token

INIT_METHOD = "init_continuous_batching"


def _processor_class():
    """The logits processor class, built on first use (transformers is imported only then)."""
    base = compat.cb_logits_processor_base()

    class OracleLogitsProcessor(base):
        """Keeps only the oracle's token (see the module docstring)."""

        supported_kwargs: dict = {}
        ignored_kwargs: tuple = ()

        def __init__(self, vocab: int) -> None:
            self.vocab = vocab

        def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
            int32_tensor.fill_(0)

        def prepare_tensor_args(self, requests_with_new_token) -> torch.Tensor:
            """int32 [n]: the oracle's token at each request's next position (host, once per batch)."""
            return torch.tensor([oracle_token(str(fs.state.request_id), int(fs.state.position_offset), self.vocab)
                                 for fs in requests_with_new_token], dtype=torch.int32)

        def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
            """scores float [num_logits, vocab] -> the same shape, -inf but at each row's oracle token (0)."""
            n, vocab = scores.shape
            tokens = tensor_arg[:n].to(torch.int64).clamp(0, vocab - 1)
            out = torch.full_like(scores, float("-inf"))
            return out.scatter_(1, tokens[:, None], 0.0)

    return OracleLogitsProcessor


class OracleSampler:
    """Makes a transformers model's continuous batching sample `oracle_token` (see the module docstring)."""

    def __init__(self, vocab: int) -> None:
        if vocab < 2:
            raise KvCanaryRuntimeError(f"kv-canary: oracle vocab must be >= 2, got {vocab}")
        self.vocab = vocab
        self.managers = 0  # managers whose sampling was replaced
        self._model: Optional[torch.nn.Module] = None
        self._wrapper = None

    def token(self, request_id: str, position: int) -> int:
        """The token this sampler emits for ``request_id`` at sequence ``position`` (the adapter's oracle)."""
        return oracle_token(str(request_id), position, self.vocab)

    def install(self, model: torch.nn.Module) -> "OracleSampler":
        if self._model is not None:
            raise KvCanaryRuntimeError("kv-canary: this OracleSampler is already installed")
        if any(getattr(fn, "_kvcanary_oracle", False) for fn in compat.stacked_methods(model, INIT_METHOD)):
            raise KvCanaryRuntimeError(f"kv-canary: another OracleSampler is installed on this "
                                       f"{type(model).__name__}")
        if compat.persistent_manager(model) is not None:
            raise KvCanaryRuntimeError("kv-canary: the model holds a persistent continuous-batching manager built "
                                       "without the oracle; destroy it first (destroy_cached_continuous_batching_manager)")
        cls = _processor_class()
        self._wrapper = compat.stack_method(model, INIT_METHOD, lambda original: self._wrap_init(original, cls))
        self._wrapper._kvcanary_oracle = True
        self._model = model
        return self

    def _wrap_init(self, original, cls):
        def init_continuous_batching(*args, **kwargs):
            manager = original(*args, **kwargs)
            if self._model is not None and not any(isinstance(p, cls) for p in manager.logit_processor.logits_processor):
                compat.append_cb_logits_processor(manager, cls(self.vocab))
                self.managers += 1
            return manager

        return init_continuous_batching

    def remove(self) -> None:
        """Remove the shadowing attribute (managers already created keep sampling the oracle)."""
        if self._model is not None:
            compat.unstack_method(self._model, INIT_METHOD, self._wrapper)  # else it passes through from now on
            self._model = None

    def __enter__(self) -> "OracleSampler":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
