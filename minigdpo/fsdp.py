"""FSDP2 over the mesh minigdpo/dist.py builds: sharding a model, filling its shards, freeing what it gathered, and
which backwards reduce. It calls no collective itself (FSDP2's run inside torch, in its hooks): the collectives, whole
tensors and the sharded checkpoints are minigdpo/dist.py's.
"""

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard, \
    register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from minigdpo import dist


def shard(model, layers, param_dtype=None, offload=False, reshard_after_forward=True, forward_methods=()):
    """FSDP2: fully_shard each decoder layer, then the root, over the mesh built by init().

    param_dtype (e.g. bf16) casts parameters for compute while master weights and gradient
    reduction stay fp32. offload keeps the shards in CPU memory (for the frozen reference); pinned
    memory needs an accelerator, so it is pinned only on one. forward_methods: names of layer methods
    that FSDP2 treats as forward calls too (gather before, free after), where a layer has them.
    """
    kwargs = dict(mesh=dist.mesh(), mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32))
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=dist.device().type != "cpu")
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
        for name in forward_methods:
            if hasattr(layer, name):
                register_fsdp_forward_method(layer, name)
    fully_shard(model, **kwargs)  # the root keeps its parameters between forward and backward
    return model


def reduce_gradients(model, reduce_scatter, all_reduce):
    """Whether the next backward reduces gradients over ranks: the reduce-scatter (over the shard dimension)
    and, with HSDP, the all-reduce across nodes. Gradients of backwards that skip a reduction accumulate
    (FSDP2's set_requires_gradient_sync / set_requires_all_reduce) until one reduces them all."""
    model.set_requires_gradient_sync(reduce_scatter)
    model.set_requires_all_reduce(reduce_scatter and all_reduce)


def materialize(model, device, read, block_bytes=8 * 1024**2):
    """Allocate a model that was built on the meta device and sharded by shard(), filling each of
    this rank's shards with read(name, start, stop): rows start:stop (dim 0) of parameter `name`.

    FSDP2 shards dim 0 as torch.chunk does, so a rank's shard is one block of whole rows. They are
    read about block_bytes at a time, so that memory beyond the shards stays small. Buffers are
    allocated too, uninitialised: the caller computes them.
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if isinstance(p, DTensor):
                local = p.to_local()
                shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            else:
                local, shape, offset = p, p.shape, (0,) * p.dim()
            step = max(1, block_bytes // max(1, local[:1].numel() * local.element_size()))  # rows per read
            for r in range(0, shape[0] if local.numel() else 0, step):
                n = min(step, shape[0] - r)
                local[r:r + n].copy_(read(name, offset[0] + r, offset[0] + r + n))


def reshard(model):
    """Free every gathered parameter of a sharded model, keeping only this rank's shards.

    FSDP2 keeps a root's parameters gathered after its forward, for the backward that follows;
    a model that runs no backward (the frozen reference) would hold them until its next pass.
    """
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
