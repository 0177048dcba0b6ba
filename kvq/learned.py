"""Learnable pieces on top of a fixed base rotation (SRFT paper Sec. 5.1, Table 3).

y = lambda * (R (B x)): B the fixed base (srft, srht or identity), R a learned orthogonal matrix,
lambda > 0 a learned per-coordinate scale. Decode divides by lambda, then applies R^T and B^T.
Every module holds a leading `sites` dimension so all (layer, K|V) sites train in one batched step;
the sites share nothing, so this equals training each alone.
"""

import torch

from kvq.errors import KvqError

LEARN_KINDS = ("none", "lambda", "cayley", "householder", "closed_form")


class Cayley(torch.nn.Module):
    """R = exp(U - U^T): the matrix exponential of a skew-symmetric matrix is exactly orthogonal."""

    def __init__(self, sites: int, d: int):
        super().__init__()
        self.u = torch.nn.Parameter(torch.zeros(sites, d, d))  # R = I at init

    def forward(self) -> torch.Tensor:
        return torch.linalg.matrix_exp(self.u - self.u.transpose(-1, -2))


class Householder(torch.nn.Module):
    """R = H_1 ... H_k with H_i = I - 2 v_i v_i^T / |v_i|^2; k*d parameters per site.

    A single reflection is never near the identity, so reflectors start in equal pairs (H H = I)
    with a small perturbation: R starts close to I and gradients break the pairing.
    """

    def __init__(self, sites: int, d: int, k: int, seed: int = 0):
        super().__init__()
        if k < 1:
            raise KvqError(f"householder needs at least one reflector, got k={k}")
        generator = torch.Generator().manual_seed(seed)
        base = torch.randn(sites, (k + 1) // 2, d, generator=generator)
        pairs = base.repeat_interleave(2, dim=1)[:, :k]
        self.v = torch.nn.Parameter(pairs + 1e-3 * torch.randn(sites, k, d, generator=generator))

    def forward(self) -> torch.Tensor:
        sites, k, d = self.v.shape
        unit = self.v / self.v.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        r = torch.eye(d, dtype=self.v.dtype, device=self.v.device).expand(sites, d, d)
        for i in range(k):
            u = unit[:, i]
            r = r - 2 * (r @ u.unsqueeze(-1)) * u.unsqueeze(-2)  # r @ (I - 2 u u^T)
        return r


class LogScale(torch.nn.Module):
    """lambda = exp(rho): positive by construction, lambda = 1 at init."""

    def __init__(self, sites: int, d: int):
        super().__init__()
        self.rho = torch.nn.Parameter(torch.zeros(sites, d))

    def forward(self) -> torch.Tensor:
        return self.rho.exp()


def learnable_modules(kind: str, sites: int, d: int, reflectors: int | None, seed: int) -> torch.nn.ModuleDict:
    if kind not in LEARN_KINDS:
        raise KvqError(f"learn must be one of {', '.join(LEARN_KINDS)}, got {kind!r}")
    modules = torch.nn.ModuleDict()
    if kind in ("lambda", "cayley", "householder"):
        modules["lam"] = LogScale(sites, d)
    if kind == "cayley":
        modules["rotation"] = Cayley(sites, d)
    if kind == "householder":
        modules["rotation"] = Householder(sites, d, reflectors or d // 2, seed)
    return modules


def parameters_per_site(modules: torch.nn.ModuleDict) -> int:
    return sum(p[0].numel() for p in modules.parameters())
