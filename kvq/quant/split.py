"""Outlier-channel split: two quantizers over complementary channel sets.

Per group of `group` consecutive tokens, the `count` channels with the largest norm over the group are
the outliers: they go to one quantizer (typically with more bits), the other d - count channels to
another. This is how TurboQuant reaches its non-integer KV budgets (two independent TurboQuant
instances, more bits on the outlier channels; Zandieh et al. 2025, Sec. 4) and how the official QJL
code treats key outliers (top channels by norm per 32-token group). The chosen channel indices are
stored, one byte each per group, and count towards the bits per element; a last group shorter than
`group` picks its own outliers.
"""

from dataclasses import dataclass

import torch

from kvq.errors import KvqError
from kvq.quant.base import Packed, Quantizer


@dataclass
class SplitPart(Packed):
    indices: torch.Tensor  # (..., groups, count) uint8: each group's outlier channels, ascending
    outliers: Packed
    regular: Packed
    shape: tuple[int, ...]  # (..., groups, tokens per group, d)

    def storage_bits(self) -> int:
        return self.indices.numel() * 8 + self.outliers.storage_bits() + self.regular.storage_bits()


@dataclass
class SplitPacked(Packed):
    parts: list[SplitPart]  # the whole groups, then the shorter last group if any
    dtype: torch.dtype

    def storage_bits(self) -> int:
        return sum(part.storage_bits() for part in self.parts)


def group_outlier_channels(x: torch.Tensor, count: int, group: int) -> torch.Tensor:
    """(..., tokens, d) -> (..., ceil(tokens / group), count) uint8: per group of `group` consecutive tokens
    (the last one possibly shorter), the `count` channels of largest norm over the group, ascending."""
    tokens, d = x.shape[-2:]
    groups = -(-tokens // group)
    padded = torch.nn.functional.pad(x.float(), (0, 0, 0, groups * group - tokens))  # zeros add no norm
    norms = padded.reshape(*x.shape[:-2], groups, group, d).norm(dim=-2)
    return norms.topk(count, dim=-1).indices.sort(dim=-1).values.to(torch.uint8)


def channel_mask(indices: torch.Tensor, d: int) -> torch.Tensor:
    """(..., count) channel indices -> (..., d) bool, true on those channels."""
    mask = torch.zeros(*indices.shape[:-1], d, dtype=torch.bool, device=indices.device)
    return mask.scatter_(-1, indices.long(), True)


def _per_token(channels: torch.Tensor, tokens: int) -> torch.Tensor:
    """(..., groups, k) channel indices -> (..., groups, tokens, k), for gather/scatter on the last dim."""
    return channels.unsqueeze(-2).expand(*channels.shape[:-1], tokens, channels.shape[-1])


class ChannelSplit(Quantizer):
    def __init__(self, d: int, count: int, group: int, outliers: Quantizer, regular: Quantizer):
        if not 0 < count < d or d > 256:
            raise KvqError(f"outlier channels must number 1..{d - 1} (head_dim <= 256), got {count}")
        if group < 1:
            raise KvqError(f"outlier group must hold at least one token, got {group}")
        self.d, self.count, self.group = d, count, group
        self.outliers, self.regular = outliers, regular

    def _complement(self, indices: torch.Tensor) -> torch.Tensor:
        """(..., count) ascending channel indices -> (..., d - count) ascending, the other channels."""
        return (~channel_mask(indices, self.d)).nonzero()[:, -1].view(*indices.shape[:-1], self.d - self.count)

    def _encode_groups(self, x: torch.Tensor, indices: torch.Tensor) -> SplitPart:
        """x: (..., groups, tokens, d); indices: (..., groups, count) uint8, each group's outliers."""
        channels = indices.long()
        outliers, regular = (x.gather(-1, _per_token(chosen, x.shape[-2]))
                             for chosen in (channels, self._complement(channels)))
        return SplitPart(indices, self.outliers.encode(outliers), self.regular.encode(regular), tuple(x.shape))

    def encode(self, x: torch.Tensor) -> SplitPacked:
        tokens = x.shape[-2]
        whole = tokens // self.group
        indices = group_outlier_channels(x, self.count, self.group)
        parts = []
        if whole:
            grouped = x[..., :whole * self.group, :].reshape(*x.shape[:-2], whole, self.group, self.d)
            parts.append(self._encode_groups(grouped, indices[..., :whole, :]))
        if whole * self.group < tokens:
            parts.append(self._encode_groups(x[..., whole * self.group:, :].unsqueeze(-3), indices[..., whole:, :]))
        return SplitPacked(parts, x.dtype)

    def _decode_part(self, part: SplitPart) -> torch.Tensor:
        indices = part.indices.long()
        x = torch.zeros(part.shape, device=indices.device)
        for channels, packed, quantizer in ((indices, part.outliers, self.outliers),
                                            (self._complement(indices), part.regular, self.regular)):
            x.scatter_(-1, _per_token(channels, part.shape[-2]), quantizer.decode(packed).float())
        return x.flatten(-3, -2)

    def decode(self, packed: SplitPacked) -> torch.Tensor:
        return torch.cat([self._decode_part(p) for p in packed.parts], dim=-2).to(packed.dtype)

    def bits_per_element(self, d: int, n_tokens: int) -> float:
        groups = -(-n_tokens // self.group)
        index_bits = groups * self.count * 8
        outlier_bits = self.outliers.bits_per_element(self.count, n_tokens) * self.count * n_tokens
        regular_bits = self.regular.bits_per_element(d - self.count, n_tokens) * (d - self.count) * n_tokens
        return (index_bits + outlier_bits + regular_bits) / (d * n_tokens)
