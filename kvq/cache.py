"""A transformers cache that physically stores K/V packed (SRFT paper Sec. 7.2, issue 6 item 1).

Full-attention layers keep K/V as the quantizer's packed tensors (int4/int8 codes plus scales), except
an unquantized residual window of the most recent tokens; when the window holds `residual` tokens it
is quantized as one chunk. Sliding-window layers (Gemma-3) stay DynamicCache layers. With
`keep_dequantized_prefix` the dequantized prefix is kept and only a flushed chunk is decoded, so an
update costs O(chunk) decode work rather than O(prefix); without it nothing but packed data and the
window is held and every step decodes the whole prefix.
"""

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvq.apply import QuantizerBank
from kvq.errors import KvqError
from kvq.quant.base import Packed


def tensor_bytes(packed: Packed) -> int:
    return packed.storage_bits() // 8


class QuantizedLayer(DynamicLayer):
    is_croppable = False

    def __init__(self, bank: QuantizerBank, layer: int, residual: int, keep_dequantized_prefix: bool):
        super().__init__()
        if residual < 1:
            raise KvqError(f"residual window must hold at least one token, got {residual}")
        self.quantizers = {role: bank.get(layer, role) for role in ("k", "v")}
        self.window = residual
        self.keep_prefix = keep_dequantized_prefix
        self.packed: dict[str, list[Packed]] = {"k": [], "v": []}
        self.prefix: dict[str, torch.Tensor | None] = {"k": None, "v": None}
        self.recent: dict[str, torch.Tensor | None] = {"k": None, "v": None}
        self.quantized_tokens = 0

    def _flush(self, role: str, count: int) -> None:
        chunk, self.recent[role] = self.recent[role][..., :count, :], self.recent[role][..., count:, :]
        packed = self.quantizers[role].metered_encode(chunk)
        self.packed[role].append(packed)
        if self.keep_prefix:
            decoded = self.quantizers[role].decode(packed).to(chunk.dtype)
            previous = self.prefix[role]
            self.prefix[role] = decoded if previous is None else torch.cat([previous, decoded], dim=-2)

    def _full(self, role: str) -> torch.Tensor:
        if self.keep_prefix:
            prefix = self.prefix[role]
        else:
            decoded = [self.quantizers[role].decode(p) for p in self.packed[role]]
            prefix = torch.cat(decoded, dim=-2).to(self.recent[role].dtype) if decoded else None
        return self.recent[role] if prefix is None else torch.cat([prefix, self.recent[role]], dim=-2)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        for role, states in (("k", key_states), ("v", value_states)):
            previous = self.recent[role]
            self.recent[role] = states if previous is None else torch.cat([previous, states], dim=-2)
        pending = self.recent["k"].shape[-2]
        flush = pending - pending % self.window
        if flush:
            for role in ("k", "v"):
                self._flush(role, flush)
            self.quantized_tokens += flush
        self.keys, self.values = self._full("k"), self._full("v")
        return self.keys, self.values

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        return self.quantized_tokens + self.recent["k"].shape[-2]

    def persistent_bytes(self) -> int:
        """Packed tensors plus the window: what the layer must keep between steps."""
        packed = sum(tensor_bytes(p) for role in ("k", "v") for p in self.packed[role])
        recent = sum(t.numel() * t.element_size() for t in self.recent.values() if t is not None)
        return packed + recent

    def crop(self, tokens_to_remove: int) -> None:
        raise KvqError("QuantizedKVCache cannot crop packed tokens (assisted decoding is not supported)")


class QuantizedKVCache(DynamicCache):
    def __init__(self, bank: QuantizerBank, config, residual: int = 16, keep_dequantized_prefix: bool = True):
        super().__init__(config=config)
        if not self.layers:
            raise KvqError("QuantizedKVCache needs a model config with its layer types")
        self.layers = [
            layer if layer.is_sliding else QuantizedLayer(bank, index, residual, keep_dequantized_prefix)
            for index, layer in enumerate(self.layers)
        ]

    def memory_bytes(self) -> int:
        """Bytes this cache must hold between steps (packed data, windows, sliding layers)."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, QuantizedLayer):
                total += layer.persistent_bytes()
            elif layer.is_initialized:
                total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
        return total


def dynamic_cache_bytes(cache: DynamicCache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers if layer.is_initialized
               for t in (layer.keys, layer.values))
