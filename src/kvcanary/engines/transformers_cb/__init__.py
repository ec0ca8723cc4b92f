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

CUDA graphs (read from 5.24.0 ``model_runner.py`` / ``input_outputs.py`` / ``utils.py``):

* ``ContinuousBatchProcessor.prepare_next_batch`` schedules, pads the sizes (``ModelRunner.maybe_pad_inputs``:
  varlen Q to a multiple of ``q_padding_interval_size``, KV reads to ``kv_padding_interval_size``; decode
  fast path Q to a power of two) and calls ``ContinuousBatchingIOs.prepare_batch_tensors``, which walks the
  requests in Python (``position_offset += query_length``) and fills the *static* device buffers on the
  caller's stream: ``_bulk_input_tensor`` rows (``input_ids``, ``position_ids``, ``cumulative_seqlens_q``,
  ``logits_indices``, ``cumulative_seqlens_k`` per layer type), ``write_index_storage`` /
  ``read_index_storage`` (reset to the trash rows first) or ``block_table``, and the attention masks.
  ``get_model_kwargs(use_padding=True)`` hands the forward fixed-shape slices of them: ``B =
  min(num_q_tokens, max_requests_per_batch)`` sequences whose ``cu_seq_lens`` plateau after the real ones.
* ``ModelRunner.compute_batch`` picks the path (``use_block_table`` -> decode, else varlen) and looks the
  graph up by key (decode: ``(num_q_tokens,)``; varlen: ``(num_q_tokens, max_kv_read, *max_length_k)``):
  a hit is ``graph.replay()`` on the compute stream (no Python: no hooks); a miss is ``_capture_graph``:
  one eager forward (hooks run, KV written), then ``torch.cuda.graph(..., capture_error_mode=
  "thread_local")`` on the compute stream around a second call (hooks run once, device work recorded, not
  executed). ``warmup`` captures the largest varlen key and every decode size up front with fake
  ``__warmup_*`` requests over never-written KV (freed right after).

So the adapter (`attach`): the hooks stay as in eager mode but do device work only inside graph mode —
`forward_view.ForwardTranslator.describe` reads the engine's static buffers through the kwargs and the
adapter's own static ``meta`` / tables with torch ops (captured), then ``stage`` + ``launch_head``;
the post-hook ``launch_tail``. The host half (``host_step`` + ``begin_step`` / ``end_step``) needs a place
that runs around a replay: no hook exists there, so the adapter shadows
``processor.model_runner.compute_batch`` on the instance (`compat.install_compute_wrapper`; ``detach``
deletes the attribute). Warmup forwards are canary steps whose rows are all the padding row (nothing to
check; the kernels compile and the runtime's static buffers learn the adapter's tables before the
capture freezes them). Graphs that predate the session are dropped (they replay without the canary) and so
are the canary's at ``detach``; the engine recaptures on demand. ``engine_forwards`` (counted by the
adapter: eager forwards and replays, warmup included) must equal the runtime's ``checked_forwards``
(counted on the device). Refused: ``torch.compile``'d forwards and async batching (two IO pairs; batch
N+1's inputs are carried over on the device from N's outputs).

Module map: `compat` (every read of transformers internals, with its source), `layout` (physical row <->
canary slot, real-KV views), `forward_view` (host half, device half, live slots), `attach` (the hooks,
the graph-mode driver and the handle).
"""
from kvcanary.engines.transformers_cb.attach import (
    SUPPORTED_TRANSFORMERS,
    TransformersCbHandle,
    attach,
    check_transformers_version,
)

__all__ = ["SUPPORTED_TRANSFORMERS", "TransformersCbHandle", "attach", "check_transformers_version"]
