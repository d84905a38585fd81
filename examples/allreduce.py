"""A 4-process all_reduce: the smallest complete pycyxwiz program.

    ./launch_distributed.sh 4 python examples/allreduce.py
    python -m pycyxwiz.launch --nproc-per-node 4 examples/allreduce.py
    RANK=0 WORLD_SIZE=4 python examples/allreduce.py &   # ... and RANK=1, 2, 3 in other terminals
"""
import numpy as np

import pycyxwiz as cx

cx.distributed.init()
rank, world = cx.distributed.get_rank(), cx.distributed.get_world_size()

x = np.arange(4, dtype=np.float32) + rank          # rank r holds [r, r+1, r+2, r+3]
cx.distributed.all_reduce(x)                       # in place: the element-wise sum over ranks
expected = np.arange(4, dtype=np.float32) * world + world * (world - 1) / 2
assert np.array_equal(x, expected), (x, expected)
print(f"rank {rank}/{world}: all_reduce -> {x.tolist()}")

cx.distributed.finalize()
