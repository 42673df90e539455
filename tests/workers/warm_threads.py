"""Worker for the warm-start thread test: its thread settings and float64 results, as JSON.

The computations are large enough for torch to split them across its intra-op threads
(a different thread count changes their last bits), so a warm and a cold worker with the
same environment must print the same line.
"""

import hashlib
import json
import os

import torch


def _bits(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()[:16]


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(1 << 22, generator=gen, dtype=torch.float64)
    a = torch.randn(512, 512, generator=gen, dtype=torch.float64)
    x = torch.randn(4096, 10, generator=gen, dtype=torch.float64)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 50), torch.nn.Tanh(),
                                torch.nn.Linear(50, 1)).double()
    model(x).square().mean().backward()
    parallel = [line.strip() for line in torch.__config__.parallel_info().splitlines()
                if "max_threads" in line]  # omp_get_max_threads(), mkl_get_max_threads()
    print(json.dumps({
        "threads": torch.get_num_threads(), "interop": torch.get_num_interop_threads(),
        "parallel": parallel, "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")},
        "sum": v.sum().item().hex(), "matmul": _bits(a @ a),
        "grads": [_bits(p.grad) for p in model.parameters()],
    }))


if __name__ == "__main__":
    main()
