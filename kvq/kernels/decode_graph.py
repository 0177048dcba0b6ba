"""decode_attention for one cache layer, replayed as a CUDA graph."""

import torch

from kvq.kernels import note_fallback
from kvq.kernels.decode_attention import decode_attention_gpu, step_description, unsupported_reason
from kvq.kernels.launch import LaunchConfig, launch_for
from kvq.kernels.step import DecodeStep, decode_attention_reference, device_lengths


class DecodeGraph:
    """A host-bound generate loop pays each eager call's host time per layer per token: three kernel
    launches with their argument handling cost more host time than an fp16 layer's cat + SDPA, and a
    replay of the same kernels less. The graph takes whole buffers and the token counts, which the kernels
    read from a device tensor that the graph itself steps by one token, so it is captured again only when a
    buffer, the maps, the scale or the query's shape change (a packed store grows every ~6% of its length).
    The returned tensor is the graph's output buffer: valid until the next call.
    """

    def __init__(self, launch: LaunchConfig | None = None):
        self.launch = launch
        self.signature: tuple | None = None
        self.graph = None
        self.fused = False
        self.captures = 0
        self.query = self.out = self.lengths = None
        self.written_lengths: int | None = None

    def __call__(self, query: torch.Tensor, step: DecodeStep, scale: float, counts: tuple[int, int],
                 writes: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])) -> torch.Tensor:
        """Decode attention over the first counts = (n_packed, n_window) rows of the step's packed and window
        buffers. `writes`: (targets, sources) the caller still owes those buffers (the newest token's window
        rows), copied first, in the same dispatch as the query."""
        keys, values = step.keys, step.values
        # buffers, not views: an empty view's data pointer differs from its buffer's
        signature = (query.shape, query.dtype, query.device, float(scale), *(t.data_ptr() for t in (
            step.query_map, step.output_map, keys.codes, keys.scales, values.codes, values.scales, *step.window)),
            keys.codes.shape, step.window[0].shape)
        packed_and_window = device_lengths(*counts)
        if signature != self.signature:
            self.signature = signature
            reason = unsupported_reason(query, step)
            self.fused = reason is None
            if reason is not None and query.is_cuda:
                note_fallback("fused decode attention", step_description(query, step), reason)
            if self.fused:
                self._capture(query, step, scale, packed_and_window)
        if not self.fused:
            if writes[0]:
                torch._foreach_copy_(*writes)
            n_packed, n_window = counts
            rows = DecodeStep(keys.rows(n_packed), values.rows(n_packed),
                              tuple(w[..., :n_window, :] for w in step.window), step.query_map, step.output_map)
            return decode_attention_reference(query, rows, scale)
        # Each replay first adds one to the device's counts (the window grows a token per step), so only a
        # flush or a jump costs a fill: one launch fewer per layer per token.
        if self.written_lengths != packed_and_window - 1:
            self.lengths.fill_(packed_and_window - 1)
        self.written_lengths = packed_and_window
        targets, sources = writes
        torch._foreach_copy_([self.query, *targets], [query, *sources])
        self.graph.replay()
        return self.out

    def _capture(self, query: torch.Tensor, step: DecodeStep, scale: float, packed_and_window: int) -> None:
        self.captures += 1
        self.graph = None  # frees the old graph before the new one is instantiated
        self.query = torch.empty_like(query)
        self.out = torch.empty_like(query)
        # The eager run below, which compiles the kernels and allocates the workspace outside the capture,
        # reads the true counts; a replay finds them less one token (see __call__), which after a flush that
        # left the window empty is no count at all (the window's borrows from the packed).
        self.lengths = torch.full((1,), packed_and_window, dtype=torch.int64, device=query.device)
        launch = self.launch or launch_for(query.device)

        def run():
            decode_attention_gpu(self.query, step, scale, launch, lengths=self.lengths, out=self.out)

        run()
        self.lengths.fill_(packed_and_window - 1)
        self.written_lengths = packed_and_window - 1
        # torch.cuda.graph() would also synchronize, collect garbage and empty the allocator's cache at
        # every capture; a side stream that waits on this one is all a capture needs.
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(query.device)
        current = torch.cuda.current_stream(query.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="thread_local")
            self.lengths.add_(1)
            run()
            graph.capture_end()
        current.wait_stream(stream)
        self.graph = graph
