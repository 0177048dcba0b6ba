"""The evaluation protocol of cache mode, the same for every method.

- `window`: each query sees the keys and values of its `window` most recent positions (itself
  included) exact; older ones come from the quantizer. 0 quantizes every position, the current token's
  included.
- `exact_prefill`: the first forward call into a cache (the prompt) attends over exact keys and values;
  its tokens are quantized for later calls once they fall out of the window, as in the long-context
  evaluations of KIVI, QJL and TurboQuant, where the prompt is prefilled in full precision and the
  cache is quantized for generation. With one-call perplexity it makes every position exact, so it
  only changes generation (lm-eval, retrieval).

A real cache holds the window's tokens in fp16 until they leave it, so storage at the end of a
sequence of T tokens is min(window, T) tokens in fp16 and the rest at the quantizer's bits.
"""

from dataclasses import asdict, dataclass

from kvq.errors import KvqError

# Where quantizers sit: at k_proj / v_proj outputs (hook) or on what the KV cache stores (cache).
MODES = ("hook", "cache")

FP16_BITS = 16


@dataclass(frozen=True)
class Protocol:
    window: int = 0
    exact_prefill: bool = False

    def __post_init__(self):
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 0:
            raise KvqError(f"protocol window must be a whole number of tokens >= 0, got {self.window!r}")
        if not isinstance(self.exact_prefill, bool):
            raise KvqError(f"protocol exact_prefill must be true or false, got {self.exact_prefill!r}")

    @property
    def is_default(self) -> bool:
        return self == Protocol()

    def to_dict(self) -> dict:
        return asdict(self)

    def label(self) -> str:
        """'' for the default protocol, else e.g. 'w128+prefill'."""
        if self.is_default:
            return ""
        return f"w{self.window}" + ("+prefill" if self.exact_prefill else "")

    def stored_bits_per_element(self, quantized_bits: float, n_tokens: int) -> float:
        """Bits per element of a cache of n_tokens: the window's tokens in fp16, the rest quantized."""
        exact = min(self.window, n_tokens)
        return (exact * FP16_BITS + (n_tokens - exact) * quantized_bits) / n_tokens
