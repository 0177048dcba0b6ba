"""One digest per registered quantizer, width (2-4 bits) and site role: its roundtrip through kvq.ops (the path every
measurement takes) of fixed data on the CPU, or the error it raises. Run it in two checkouts and diff the
output to show that a change which moves every cell's code digest leaves each quantizer's arithmetic as it was.

    python scripts/quantizer_roundtrip_digests.py > digests.txt
"""

import argparse
import hashlib

import torch

from kvq import ops
from kvq.quant import QUANTIZERS, QuantSpec, Site, build_quantizer
from kvq.quant.spec import ROLES


def roundtrip_digests() -> dict[str, str]:
    generator = torch.Generator().manual_seed(0)
    # channels of unequal size, so per-channel and outlier-aware methods meet what they are built for
    x = torch.randn(3, 2, 96, 64, generator=generator) * torch.linspace(0.2, 3.0, 64)
    digests = {}
    for name in sorted(QUANTIZERS.names()):
        for bits in (2, 3, 4):
            for role in ROLES:
                try:
                    quantizer = build_quantizer(QuantSpec(name, bits), Site(1, role, x.shape[-1]))
                    y = ops.roundtrip(quantizer, x)
                    digest = hashlib.sha256(y.float().numpy().tobytes()).hexdigest()[:16]
                except (ValueError, RuntimeError, NotImplementedError) as error:
                    digest = f"raises {type(error).__name__}"
                digests[f"{name} {bits} {role}"] = digest
    return digests


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    for key, digest in roundtrip_digests().items():
        print(key, digest)


if __name__ == "__main__":
    main()
