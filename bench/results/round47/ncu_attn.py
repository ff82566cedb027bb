"""Round 47: one attention step (heads, B, q as arguments) launched eagerly a few times, for
Nsight Compute to profile (`r47a.sh`)."""

import sys

sys.path.insert(0, "bench")
sys.path.insert(0, ".")
import attention_kernel as ak  # noqa: E402
import torch  # noqa: E402

name, b, q = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ak.time_us = lambda fn, graph=True: (fn(), fn(), torch.cuda.synchronize(), 1.0)[-1]
ak.case(ak.HEADS[name], [(q, 1024)] * b, 0, sdpa=False)
print(name, b, q, "done")
