"""How kvq's lm-eval harness decodes a batch of generation requests.

lm-eval hands the harness left-padded batches. Padding is not neutral under every quantizer: KIVI's keys share a
scale per channel over a group of positions, and a scale computed over a whole tensor would span the batch, so a
pad token or a batch-mate could change a prompt's codes. So a batch decodes

- through `kvq.generate` over a static cache (the packed cache of `kvq.static_cache`, whose layers follow a per-site
  policy and keep its exact layers fp, or transformers' static
  cache with SDPA reading each K/V head once for fp), compiled on CUDA, the padded batch at once with the cache
  reset() between batches, where the quantizer has a packed layout and the protocol is one that cache holds
  (`fast_path_reason`: not KIVI, whose key stats span positions). The
  layouts it takes are token-local, so padding changes no prompt's codes; the packed kernels attend from the codes
  where no row is padded, a padded batch's steps read the cache dequantized under the mask;
- otherwise through the reference cache: the whole padded batch at once where the quantizer is token-local (a
  token's codes depend on that token alone), prompts of equal length together where it is row-local, else
  prompt by prompt (`reference_batching`).

Each prompt gets the continuation it gets alone (up to the order of floating-point sums in batched products),
so scores do not depend on the batch size.
"""

import torch

from kvq.apply import QuantizerBank
from kvq.protocol import Protocol

# a new static cache holds the batch's prompts and new tokens rounded up to this many tokens, plus this many, so
# later batches (lm-eval's tasks ask for different numbers of new tokens) fit in it and share its compiled step
CAPACITY_STEP = 1024


def fast_path_reason(bank: QuantizerBank | None, mode: str, protocol: Protocol, device: str) -> str | None:
    """None when generation can run through kvq.generate's static cache, else why it cannot."""
    if torch.device(device).type != "cuda":
        return "the compiled static-cache decode runs on CUDA"
    if mode != "cache":
        return "hook mode quantizes projections, not a cache"
    if not protocol.exact_prefill or protocol.window < 1:
        return ("the static cache holds the protocol with exact prefill and a window of at least one token "
                "(window 0 also quantizes a step's own token)")
    if bank is None:
        return None
    from kvq.static_cache import unheld_reason

    for layer in range(bank.geometry.n_layers):
        reason = unheld_reason(bank, layer)
        if reason is not None:
            return reason
        for role in ("k", "v"):
            quantizer = bank.get(layer, role)
            if quantizer.token_group > 1:
                return (f"layer {layer} {role.upper()}: {type(quantizer).__name__}'s stats span "
                        f"{quantizer.token_group} positions, so left padding would change a prompt's codes")
    return None


def _unchanged_by(bank: QuantizerBank, kept: tuple[slice, slice], edit: tuple[slice, slice],
                  tokens: int = 256) -> bool:
    """Whether every site's quantize-dequantize of the K/V rows and positions `kept` (batch, position slices)
    stays the same when the K/V at `edit` change, on random K/V of two rows of `tokens` positions."""
    from kvq.apply import quantized_pair

    bank = QuantizerBank(bank.spec, bank.geometry, bank.learned, bank.policy)  # its storage meters stay the run's
    generator = torch.Generator().manual_seed(0)
    shape = (2, bank.geometry.n_kv_heads, tokens, bank.geometry.head_dim)
    keys, values = (torch.randn(shape, generator=generator) * 4 for _ in range(2))
    edited = [t.clone() for t in (keys, values)]
    for t in edited:
        t[edit[0], :, edit[1]] *= 9
    for layer in range(bank.geometry.n_layers):
        before = quantized_pair(bank, layer, keys, values)
        after = quantized_pair(bank, layer, *edited)
        if not all(torch.equal(b[kept[0], :, kept[1]], a[kept[0], :, kept[1]])
                   for b, a in zip(before, after, strict=True)):
            return False
    return True


# how the reference cache takes a left-padded batch (reference_batching)
PADDED, EQUAL_LENGTH, ONE_BY_ONE = "padded", "equal length", "one by one"


def reference_batching(bank: QuantizerBank | None) -> str:
    """PADDED where a position's codes depend on that position alone (left padding changes none: per-token codes,
    TurboQuant, the engine formats), EQUAL_LENGTH where a row's codes depend on that row alone (KIVI's key groups
    span positions), else ONE_BY_ONE. Probed on random K/V (fp: PADDED)."""
    if bank is None:
        return PADDED
    if not _unchanged_by(bank, (slice(0, 1), slice(None)), (slice(1, 2), slice(None))):
        return ONE_BY_ONE
    if _unchanged_by(bank, (slice(0, 1), slice(8, None)), (slice(0, 1), slice(0, 8))):
        return PADDED
    return EQUAL_LENGTH


def equal_length_groups(attention_mask: torch.Tensor) -> list[tuple[int, list[int]]]:
    """(length, rows) for each prompt length of a left-padded batch's (B, L) mask, longest first."""
    lengths = attention_mask.sum(-1).tolist()
    return [(length, [row for row, n in enumerate(lengths) if n == length])
            for length in sorted(set(lengths), reverse=True)]


class StaticDecoder:
    """Greedy continuations of a batch of prompts through a static cache reset() between batches: the smallest
    one already built for the batch's rows that holds it, else a new one. The packed layouts are token-local, so
    left padding changes no prompt's codes."""

    def __init__(self, model, bank: QuantizerBank | None, protocol: Protocol, stop_tokens: list[int],
                 pad_token_id: int):
        self.model, self.bank, self.protocol = model, bank, protocol
        self.stop_tokens, self.pad_token_id = stop_tokens, pad_token_id
        self._caches: dict[tuple[int, int], object] = {}

    def _cache(self, tokens: int, rows: int):
        from transformers import StaticCache

        from kvq.static_cache import StaticQuantizedCache

        held = sorted(capacity for capacity, cache_rows in self._caches if cache_rows == rows and capacity >= tokens)
        capacity = held[0] if held else (-(-tokens // CAPACITY_STEP) + 1) * CAPACITY_STEP
        if (capacity, rows) not in self._caches:
            config = self.model.config
            self._caches[capacity, rows] = (
                StaticCache(config=config, max_cache_len=capacity) if self.bank is None else
                StaticQuantizedCache(self.bank, config, capacity, min(self.protocol.window, capacity)).allocate(
                    self.model, rows))
        cache = self._caches[capacity, rows]
        cache.reset()
        return cache

    def continuations(self, prompts: list[torch.Tensor], max_new_tokens: int) -> torch.Tensor:
        """B prompts of any lengths ((L_i,) token ids) -> (B, max_new_tokens) new tokens, each row through its
        stop token, then padding."""
        from kvq.generate import decode_routing, generate
        from kvq.gqa_attention import GQA_SDPA_ATTENTION

        cache = self._cache(max(p.numel() for p in prompts) + max_new_tokens, len(prompts))
        with torch.no_grad(), decode_routing(self.model, cache, GQA_SDPA_ATTENTION if self.bank is None else None):
            rows = generate(self.model, prompts, cache, max_new_tokens, stop_tokens=self.stop_tokens,
                            pad_token_id=self.pad_token_id)
        out = torch.full((len(prompts), max_new_tokens), self.pad_token_id, dtype=rows[0].dtype,
                         device=rows[0].device)
        for i, row in enumerate(rows):
            out[i, :row.numel()] = row
        return out
