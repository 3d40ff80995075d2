"""One decode-attention launch per cache dtype for Nsight Compute (device only):

    ncu --kernel-name regex:_paged_attn --launch-skip 2 --launch-count 1 --section ... \\
        python3 tests/gpu/ncu_decode.py --fp8

Batch 384, contexts 1,000-2,000 tokens (the 1000/1000 run's decode), 32/8 heads, head dim 128.
"""

import argparse
import sys
import os

import torch

sys.path.insert(0, os.path.dirname(__file__))
from attn_sweep import make_problem, run  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--fp8", action="store_true")
ap.add_argument("--batch", type=int, default=384)
ns = ap.parse_args()
p, _ = make_problem(ns.batch, 1000, 2000, fp8=ns.fp8)
for _ in range(4):
    run(p)
torch.cuda.synchronize()
print("done", flush=True)
