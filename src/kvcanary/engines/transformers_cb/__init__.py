"""Hugging Face transformers continuous batching (``generate_batch`` / the CB manager), pinned to
transformers==5.24.0.

Notes on the engine (read from transformers 5.24.0, ``transformers/generation/continuous_batching``):

* ``ContinuousBatchingManager`` runs a background thread; each step the ``ContinuousBatchProcessor``
  asks the scheduler for ``requests_in_batch`` (``FutureRequestState``: state + query length), then
  ``ContinuousBatchingIOs.prepare_batch_tensors`` flattens them in batch order and the
  ``ModelRunner`` calls ``model(**kwargs)`` once per step (``PagedAttentionArgs``: ``input_ids`` and
  ``position_ids`` ``[1, T]``, ``cu_seq_lens_q``, ``cu_seq_lens_k`` per layer type, per-group
  ``write_index`` / ``read_index`` (int64 physical rows) or, on the decode fast path, ``block_table``,
  and ``cache``). With CUDA graphs or compile the tensors are padded; padding tokens write to the
  write-trash row and read the read-trash row (row 0).
* ``PagedAttentionCache`` owns one flat byte tensor and one allocator per attention type
  (``full_attention``, ``sliding_attention``; allocator index = order of first appearance in
  ``config.layer_types``). A block is ``L`` pages (``L`` layers), a page holds ``page_size`` K rows
  then ``page_size`` V rows; physical row = ``block * 2 * page_size * L + offset``. The first two
  sectors are trash. ``cache.update`` (called by every attention layer) ``index_copy_``'s the new K/V
  at ``write_index`` and reads back ``read_index``; so after the forward the cache tensor holds what
  attention stored (the canary re-hashes it there; no hook on ``update`` is needed).
* Full attention: positions ``[0, P + E)`` are read, new tokens written after the request's last
  token. Prefix sharing (full-attention-only models): complete blocks get a chained content hash;
  a new prompt adopts matching blocks (``acquire_prefix_blocks``, ``P`` starts at the match) and a
  finished request's hashed blocks stay cached (``ledger.cached_blocks``) until evicted. After a
  forward, a block identical to an already-hashed one is de-duplicated (request adopts the old one).
* Sliding window (ring): position ``p`` lives in ring slot ``p % W`` of the request's blocks; reads
  take the ``W - 1`` newest cached positions plus sentinel rows for the new tokens; a chunk longer
  than ``W`` writes its first ``E - W`` tokens to the write trash. No block sharing for SWA models.
* Chunked prefill: a prompt may be split across steps (``P > 0``, ``E > 1``). Decode: ``E = 1``.

Module map: `layout` (physical row <-> canary slot, real-KV views), `forward_view` (kwargs ->
`BatchDescription`, live slots), `attach` (the hooks and the handle).
"""
from kvcanary.engines.transformers_cb.attach import (
    SUPPORTED_TRANSFORMERS,
    TransformersCbHandle,
    attach,
    check_transformers_version,
)

__all__ = ["SUPPORTED_TRANSFORMERS", "TransformersCbHandle", "attach", "check_transformers_version"]
