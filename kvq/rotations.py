"""Fixed orthonormal rotations applied along the last dimension (head_dim) of K/V.

Each rotation is exact-orthonormal in float32: norms and inner products are preserved to ~1e-6.
Signs are drawn from a seeded generator so a (seed, layer, role) triple always gives the same rotation.
"""

import math
from functools import lru_cache

import torch

from kvq.errors import KvqError
from kvq.registry import Registry

ROTATIONS: Registry[type["Rotation"]] = Registry("rotation")


def random_signs(d: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (d,), generator=generator).float().mul_(2).sub_(1)


class Rotation:
    """x -> R x along the last dim; `inverse` applies R^T. `kind`: the name a kernel knows it by
    (kvq.quant.layout.SIGNED_ROTATIONS), or "matrix" for one applied through its matrix."""

    kind = "matrix"

    def __init__(self, d: int, seed: int = 0):
        self.d = d
        self.seed = seed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def matrix(self) -> torch.Tensor:
        """The d x d matrix R with forward(x) == x @ R.T (for kernels and learned rotations)."""
        return self.forward(torch.eye(self.d)).T.contiguous()

    def _check(self, x: torch.Tensor) -> None:
        if x.shape[-1] != self.d:
            raise KvqError(f"{type(self).__name__} built for d={self.d} got last dim {x.shape[-1]}")


@ROTATIONS.register("identity")
class Identity(Rotation):
    kind = "identity"

    def forward(self, x):
        self._check(x)
        return x

    def inverse(self, y):
        self._check(y)
        return y


@lru_cache(maxsize=16)
def _normalized_hadamard(d: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Made once per device and dtype: a step captured in a CUDA graph may copy nothing from the host."""
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).to(device=device, dtype=dtype)


class _SignedRotation(Rotation):
    """R = T diag(s): random signs s, then a fixed orthonormal transform T."""

    def __init__(self, d: int, seed: int = 0):
        super().__init__(d, seed)
        self.signs = random_signs(d, seed)

    @classmethod
    def with_signs(cls, signs: torch.Tensor) -> "_SignedRotation":
        """The rotation with these signs rather than a seed's (what kvq::quantize is given), kept on their
        device: a step captured in a CUDA graph may copy nothing from the host."""
        rotation = cls(signs.shape[-1])
        rotation.signs = signs.float()
        return rotation

    def _signs_like(self, x: torch.Tensor) -> torch.Tensor:
        return self.signs.to(device=x.device, dtype=x.dtype)


@ROTATIONS.register("srht")
class SRHT(_SignedRotation):
    """Sign-randomized Hadamard: H diag(s) x / sqrt(d), d a power of two (Sylvester construction)."""

    kind = "srht"

    def __init__(self, d: int, seed: int = 0):
        if d < 1 or d & (d - 1):
            raise KvqError(f"srht needs head_dim a power of two, got {d}; use srft for other even sizes")
        super().__init__(d, seed)

    def _h(self, x):
        return _normalized_hadamard(self.d, x.device, x.dtype)

    def forward(self, x):
        self._check(x)
        # H is symmetric, so (x * s) @ H == (H diag(s) x^T)^T.
        return (x * self._signs_like(x)) @ self._h(x)

    def inverse(self, y):
        self._check(y)
        return (y @ self._h(y)) * self._signs_like(y)


@ROTATIONS.register("srft")
class SRFT(_SignedRotation):
    """Sign-randomized real FFT with the orthonormal real packing of the SRFT paper.

    SRFT(x) = pack(F diag(s) x) (Eq. 1) with F the unitary DFT and pack as Eq. 2:
    out[0] = Re Y_0, out[d/2] = Re Y_{d/2}, out[k] = sqrt(2) Re Y_k and out[d/2 + k] = sqrt(2) Im Y_k
    for 1 <= k < d/2. Any even d works (Y_0 and Y_{d/2} are real for real input).
    """

    kind = "srft"

    def __init__(self, d: int, seed: int = 0):
        if d < 2 or d % 2:
            raise KvqError(f"srft needs an even head_dim, got {d}")
        super().__init__(d, seed)

    def forward(self, x):
        self._check(x)
        half = self.d // 2
        spectrum = torch.fft.rfft((x * self._signs_like(x)).float(), dim=-1, norm="ortho")
        real, imag = spectrum.real, spectrum.imag
        packed = torch.cat(
            [
                real[..., :1],
                real[..., 1:half] * math.sqrt(2),
                real[..., half : half + 1],
                imag[..., 1:half] * math.sqrt(2),
            ],
            dim=-1,
        )
        return packed.to(x.dtype)

    def inverse(self, y):
        self._check(y)
        half = self.d // 2
        y32 = y.float()
        zero = torch.zeros_like(y32[..., :1])
        real = torch.cat([y32[..., :1], y32[..., 1:half] / math.sqrt(2), y32[..., half : half + 1]], -1)
        imag = torch.cat([zero, y32[..., half + 1 :] / math.sqrt(2), zero], -1)
        x = torch.fft.irfft(torch.complex(real, imag), n=self.d, dim=-1, norm="ortho")
        return (x * self.signs.to(x.device)).to(y.dtype)


def build_rotation(name: str, d: int, seed: int) -> Rotation:
    return ROTATIONS.get(name)(d, seed)


def signed_rotation(kind: str, signs: torch.Tensor) -> Rotation:
    """Rotation `kind` (identity, srht or srft) with the given signs."""
    if kind == "identity":
        return Identity(signs.shape[-1])
    return ROTATIONS.get(kind).with_signs(signs)


class BlockDiagonal(Rotation):
    """A symmetric orthonormal n x n block (llama.cpp's Walsh-Hadamard) applied along the last dim, block by block:
    each n-coordinate chunk of x times the block, in x's dtype; the block is its own inverse."""

    kind = "blocks"

    def __init__(self, block: torch.Tensor, d: int):
        if d % block.shape[0]:
            raise KvqError(f"a {block.shape[0]}-coordinate rotation block does not divide head_dim {d}")
        super().__init__(d)
        self.block = block.float()

    def forward(self, x):
        self._check(x)
        n = self.block.shape[0]
        chunks = x.reshape(*x.shape[:-1], x.shape[-1] // n, n)
        return (chunks @ self.block.to(device=x.device, dtype=x.dtype)).reshape(x.shape)

    def inverse(self, y):
        return self.forward(y)


class MatrixRotation(Rotation):
    """A given orthogonal matrix R (e.g. learned by calibration): forward(x) = x @ R^T."""

    def __init__(self, matrix: torch.Tensor):
        super().__init__(matrix.shape[0])
        self.r = matrix.float()

    def forward(self, x):
        self._check(x)
        return x @ self.r.to(device=x.device, dtype=x.dtype).T

    def inverse(self, y):
        self._check(y)
        return y @ self.r.to(device=y.device, dtype=y.dtype)


class Composed(Rotation):
    """first, then second; the inverse undoes them in reverse order."""

    def __init__(self, first: Rotation, second: Rotation):
        super().__init__(first.d, first.seed)
        self.first, self.second = first, second

    def forward(self, x):
        return self.second.forward(self.first.forward(x))

    def inverse(self, y):
        return self.first.inverse(self.second.inverse(y))


@lru_cache(maxsize=64)
def haar_matrix(d: int, seed: int) -> torch.Tensor:
    """A Haar-random (uniform) d x d orthogonal matrix: the QR factor of a seeded Gaussian matrix with
    R's diagonal signs folded into Q, which makes the distribution exactly uniform (Mezzadri 2007)."""
    gaussian = torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    return (q * torch.sign(torch.diagonal(r))).float()


@ROTATIONS.register("haar")
class Haar(MatrixRotation):
    """Uniformly random rotation, TurboQuant's Pi (Zandieh et al. 2025, Alg. 1): a dense d x d
    matrix, O(d^2) per vector where SRFT/SRHT take O(d log d)."""

    def __init__(self, d: int, seed: int = 0):
        super().__init__(haar_matrix(d, seed))
        self.seed = seed
