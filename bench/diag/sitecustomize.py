"""Diagnostic only (bench/diag_capture_gpu.py): log every CUDA graph capture's begin/end, thread and outcome."""
import os, sys, threading, time, traceback
if os.environ.get("DIAG_CAPTURE_LOG") == "1":
    try:
        import torch.cuda.graphs as _g
        _T0 = time.monotonic()

        def _where():
            fr = [f for f in traceback.extract_stack()[:-3] if "torch/" not in f.filename and "sitecustomize" not in f.filename]
            return " < ".join(f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in fr[-3:][::-1])

        _begin, _end = _g.CUDAGraph.capture_begin, _g.CUDAGraph.capture_end

        def capture_begin(self, *a, **k):
            sys.stderr.write(f"[cap {time.monotonic()-_T0:8.3f}] BEGIN {id(self):x} thr={threading.current_thread().name} mode={k.get('capture_error_mode')} at {_where()}\n")
            return _begin(self, *a, **k)

        def capture_end(self):
            try:
                r = _end(self)
            except BaseException as e:
                sys.stderr.write(f"[cap {time.monotonic()-_T0:8.3f}] END-FAILED {id(self):x} thr={threading.current_thread().name}: {str(e)[:160]}\n")
                raise
            sys.stderr.write(f"[cap {time.monotonic()-_T0:8.3f}] END-OK {id(self):x} thr={threading.current_thread().name}\n")
            return r

        _g.CUDAGraph.capture_begin, _g.CUDAGraph.capture_end = capture_begin, capture_end
    except Exception as e:  # noqa
        sys.stderr.write(f"diag sitecustomize failed: {e}\n")
