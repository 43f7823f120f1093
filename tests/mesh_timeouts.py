"""The timeout of every process group in the device mesh, on 4 ranks as 2 nodes x 2 (HSDP).

    torchrun --nnodes 2 --nproc_per_node 2 ... tests/mesh_timeouts.py

A group created without a timeout gets its backend's default: NCCL's is 10 minutes, gloo's 30. This
sets the process-wide default to NCCL's 10 minutes (torch.distributed.distributed_c10d reads it when a
group asks for none), so that gloo groups on the CPU fall back as NCCL groups on GPUs would. Rank 0
prints the world group's timeout and each mesh dimension's, in minutes.
"""

import datetime
import os
import sys

import torch
import torch.distributed.distributed_c10d as c10d

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minigdpo import dist  # noqa: E402


def minutes(group):
    return group._get_backend(torch.device("cpu")).options._timeout / datetime.timedelta(minutes=1)


if __name__ == "__main__":
    c10d.default_pg_timeout = datetime.timedelta(minutes=10)  # as default_pg_nccl_timeout
    dist.init("hsdp")
    mesh = dist.mesh()
    line = " ".join([f"world={minutes(c10d._get_default_group()):g}"]
                    + [f"{name}={minutes(mesh.get_group(name)):g}" for name in mesh.mesh_dim_names])
    if dist.rank() == 0:
        print(line, flush=True)
    dist.barrier()
    dist.cleanup()
