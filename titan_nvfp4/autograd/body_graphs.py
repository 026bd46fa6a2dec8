"""CUDA graphs of an eager NVFP4 Linear's forward and backward bodies, for the host-bound small shapes (and of
the routed experts' grouped GEMMs: grouped_function.py, the offsets a copied input).

An eager NVFP4Linear forward+backward launches about 11 kernels through about 1 ms of Python (operand
bookkeeping, allocations, launch arguments): at the token counts of the debug models that is several
times its GPU work, so the step waits on the host (docs/performance.md). Here each body (the
quantization kernels and GEMMs between the autograd function's entry and its outputs) is captured once
per layer and shape and then replayed: one copy of the input into the graph's static buffer, one graph
launch, one copy of each output. The same kernels run with the same configurations on the same values,
so the bits are the eager path's (tests/test_body_graphs.py, tests/test_gpu.py).

A call replays a graph only where that is safe, and otherwise runs the body eagerly:
  - tensors the body reads in place (weight, bias, RHT signs, SR counter, saved operands) are at the
    addresses they had at capture (FSDP2 re-allocating an unsharded weight moves it);
  - a forward graph's outputs saved for a backward that has not run yet are not overwritten (pipeline
    microbatches, a layer called twice before backward, activation-checkpoint recomputation).
The first call of a key runs eagerly on the static inputs (so every kernel is compiled and autotuned
for exactly those tensors), the second captures. Captures run on a side stream without the
synchronize / gc / empty_cache of ``torch.cuda.graph`` (a collection per layer would cost seconds).
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

#: M·(K+N) of a Linear (elements) up to which ``eager_graphs = "small"`` (recipe.py) graphs its bodies. Each graph
#: keeps its own memory pool (the staged operands, its outputs, the weight gradient): about 10 bytes per element of
#: M·(K+N) for each layer, 2.3 GiB for the Llama3 debug model at 8192 tokens. 2^26 takes in the attention Linears
#: of the deepseek_v3 debug model (8192 × (512 + 4096) for wkv_b), whose GPU work is still below their eager host
#: time (~1 ms forward + backward).
SMALL_ELEMENTS = 1 << 26
#: M·K·N (multiply-adds of one of its three GEMMs) up to which it does, about 0.35 ms of an H100's emulated NVFP4
#: GEMMs for all three: above it the GPU work hides the host time, and graphing would only hold memory (a
#: Llama3-8B attention Linear at 8192 tokens, 2^38, is left out, as the 386M model's at 32768 tokens, 2^37).
SMALL_MACS = 1 << 35


def graphable(m: int, k: int, n: int, mode: str, weight_elements: int | None = None) -> bool:
    """Whether a GEMM of M tokens, K inputs and N outputs graphs its bodies under knob value ``mode``: small in its
    operands, its work and its weights (``weight_elements``, K·N for a Linear; all the experts' for grouped ones,
    whose weight gradient the backward graph's pool holds)."""
    weights = k * n if weight_elements is None else weight_elements
    return mode == "small" and m * (k + n) <= SMALL_ELEMENTS and m * k * n <= SMALL_MACS and weights <= SMALL_ELEMENTS


def graphs_for(owner, slot, x: torch.Tensor, k: int, n: int, mode: str,
               weight_elements: int | None = None) -> BodyGraphs | None:
    """The BodyGraphs of ``owner``'s (a layer's) GEMM ``slot``, kept on it, when knob value ``mode`` graphs this call
    of X ``x`` [..., K] into N outputs: eager training on a GPU (a no-grad call, validation, would need graphs and
    pools of its own) and ``graphable``; else None."""
    if mode == "off" or torch.compiler.is_compiling() or not x.is_cuda or not torch.is_grad_enabled():
        return None
    if not graphable(x.numel() // max(x.shape[-1], 1), k, n, mode, weight_elements):
        return None
    graphs = owner.__dict__.setdefault("_graphs_by_slot", {})
    if slot not in graphs:
        graphs[slot] = BodyGraphs()
    return graphs[slot]


def leaving(tensors, replayed: bool) -> tuple:
    """A body's outputs as they leave it: copies where a graph replayed them (its next replay rewrites them)."""
    return tuple(None if t is None else t.clone() for t in tensors) if replayed else tuple(tensors)


class _Entry:
    __slots__ = ("static_in", "ptrs", "graph", "static_out", "meta", "owner")

    def __init__(self, static_in, ptrs):
        self.static_in, self.ptrs = static_in, ptrs
        self.graph = self.static_out = self.meta = None
        self.owner = None  # weakref to the autograd context whose backward still reads static_out


def _ptrs(tensors) -> tuple[int, ...]:
    return tuple(0 if t is None else t.data_ptr() for t in tensors)


class CudaGraphCapture:
    """Captures a body on a side stream into a graph of its own memory pool (the real thing; tests may
    pass another ``capture`` with the same contract to BodyGraphs)."""

    def __init__(self):
        self._streams: dict[int, torch.cuda.Stream] = {}

    def __call__(self, body: Callable, inputs: list[torch.Tensor]):
        """(replay, outputs): ``replay()`` reruns the captured work, writing the same ``outputs`` tensors."""
        device = inputs[0].device
        stream = self._streams.get(device.index)
        if stream is None:
            stream = self._streams[device.index] = torch.cuda.Stream(device)
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                outputs = body(*inputs)
            finally:
                graph.capture_end()
        current.wait_stream(stream)
        return graph.replay, outputs


def _capturable(tensors) -> bool:
    """Eager CUDA work on plain tensors, with no capture already under way on this stream."""
    first = tensors[0]
    return (first.is_cuda and not torch.compiler.is_compiling() and not torch.cuda.is_current_stream_capturing()
            and all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors if t is not None))


class BodyGraphs:
    """The captured bodies of one layer, by key (module docstring). ``capture``: how a body becomes a
    replayable graph (CudaGraphCapture on a GPU)."""

    def __init__(self, capture: Callable | None = None, check_device: bool = True):
        self._entries: dict = {}
        self._capture = capture if capture is not None else CudaGraphCapture()
        self._check_device = check_device
        self.captures = self.replays = self.eager = 0  # counts, for tests and benchmarks

    def run(self, key, body: Callable, copied: list[torch.Tensor], bound: list[torch.Tensor | None],
            owner=None):
        """``body(*copied)`` -> (tuple of tensors, meta): its tensors come from a graph replay where it
        can (copied into static buffers first; ``bound``: the tensors it reads in place), else from an
        eager run. With ``owner`` (the autograd context that saves the outputs), the outputs stay
        reserved for it until ``release(owner)`` or until it is freed. Returns (outputs, meta, replayed)."""
        if self._check_device and not _capturable(copied + [t for t in bound if t is not None]):
            self.eager += 1
            out, meta = body(*copied)
            return out, meta, False
        entry = self._entries.get(key)
        ptrs = _ptrs(bound)
        if entry is None:  # first call: run eagerly on the static inputs, compiling and tuning for them
            entry = self._entries[key] = _Entry([t.clone() for t in copied], ptrs)
            self.eager += 1
            out, meta = body(*entry.static_in)
            return out, meta, False
        busy = entry.owner is not None and entry.owner() is not None
        if busy or (entry.ptrs != ptrs and entry.graph is not None):
            self.eager += 1
            out, meta = body(*copied)
            return out, meta, False
        for s, t in zip(entry.static_in, copied):
            s.copy_(t)
        if entry.ptrs != ptrs:  # not captured yet and the in-place tensors moved (a backward's saved
            entry.ptrs = ptrs   # operands, now the forward graph's): warm up again at the new addresses
            self.eager += 1
            out, meta = body(*entry.static_in)
            return out, meta, False
        if entry.graph is None:
            meta_box = []

            def tensors_only(*args):
                out, meta = body(*args)
                meta_box.append(meta)
                return out

            entry.graph, entry.static_out = self._capture(tensors_only, entry.static_in)
            entry.meta = meta_box[0]
            self.captures += 1
        entry.graph()
        self.replays += 1
        if owner is not None:
            entry.owner = _weak(owner)
        return entry.static_out, entry.meta, True

    def release(self, key) -> None:
        """The backward of the forward graph ``key`` has read its outputs: the next forward may overwrite them."""
        entry = self._entries.get(key)
        if entry is not None:
            entry.owner = None


def _weak(obj):
    try:
        return weakref.ref(obj)
    except TypeError:  # not weak-referenceable: hold it until release()
        return lambda: obj
