"""A model's attention modules and the per-head view of their k_proj / v_proj outputs, which hook mode, key
centering and KVQuant's calibration read."""

import torch

from kvq.errors import KvqError


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    found = [m for m in model.modules() if hasattr(m, "k_proj") and hasattr(m, "v_proj") and hasattr(m, "layer_idx")]
    if not found:
        raise KvqError(f"{type(model).__name__} has no attention modules with k_proj/v_proj; hook mode needs them")
    return found


def attention_by_layer(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    return {module.layer_idx: module for module in attention_modules(model)}


def split_heads(output: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A projection's output (B, T, heads * head_dim) as (B, heads, T, head_dim)."""
    batch, tokens, width = output.shape
    return output.view(batch, tokens, width // head_dim, head_dim).transpose(1, 2)


def merge_heads(heads: torch.Tensor) -> torch.Tensor:
    """split_heads' inverse."""
    batch, n_heads, tokens, head_dim = heads.shape
    return heads.transpose(1, 2).reshape(batch, tokens, n_heads * head_dim)
