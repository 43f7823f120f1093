"""FSDP2 over the mesh minigdpo/dist.py builds: sharding a model, filling its shards, whole tensors from them, and
sharded checkpoints (torch.distributed.checkpoint). With minigdpo/dist.py, the only file that imports
torch.distributed.
"""

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
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


def full_tensor(t, main_only=False):
    """The whole tensor behind a (possibly sharded) parameter. Every rank must call it, in the same order.

    main_only=True gathers it on rank 0 alone and returns None on the other ranks: for a writer that
    only rank 0 runs (the Hugging Face export), no other rank holds a whole tensor.
    """
    if not main_only or dist.world_size() == 1:
        return t.full_tensor() if isinstance(t, DTensor) else t
    if not isinstance(t, DTensor):
        return t if dist.is_main() else None
    # FSDP2 shards dim 0 along the mesh's last dimension, as torch.chunk does: equal blocks of
    # ceil(rows / ranks) rows, the last ones shorter or empty. Rank 0 gathers its node's blocks (with
    # HSDP, the other nodes hold replicas of them and take no part), padded to one size, then trims.
    group = t.device_mesh.get_group(t.device_mesh.ndim - 1)
    if 0 not in tdist.get_process_group_ranks(group):  # another node's replica of the same blocks
        return None
    local, rows = t.to_local(), t.shape[0]
    block = -(-rows // tdist.get_world_size(group))
    padded = local.new_zeros((block,) + tuple(local.shape[1:]))
    padded[:local.shape[0]] = local
    blocks = [torch.empty_like(padded) for _ in range(tdist.get_world_size(group))] if dist.is_main() else None
    tdist.gather(padded, blocks, group_dst=0, group=group)
    return torch.cat(blocks)[:rows] if dist.is_main() else None


class SaveError(OSError):
    """A sharded save failed; raised on every rank, with `ranks`, those where it failed."""


def save_sharded(model, optimizer, path):
    """Each rank writes its shards of model and optimizer state (torch.distributed.checkpoint).

    DCP gathers every rank's write result, so a write that fails on one rank raises on all of them.
    Frozen parameters (a LoRA model's base weights) are left out: they never change, and resume
    reads them from the model's own checkpoint again.
    """
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=dist._group())
    except dcp.api.CheckpointException as e:  # a BaseException: turn it into an ordinary, one-line error
        bad = sorted(e.failures)
        first = e.failures[bad[0]] if bad else e
        cause = first[0] if isinstance(first, tuple) else first
        error = SaveError(f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}")
        error.ranks = bad
        raise error from None


def sharded_files(path):
    """{file name: bytes it holds at least} for every file the DCP checkpoint at `path` needs: its .metadata
    and each shard file the metadata lists (OSError when the metadata cannot be read)."""
    need = {".metadata": 1}
    for info in dcp.FileSystemReader(path).read_metadata().storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    return need


def load_sharded(model, optimizer, path):
    """Inverse of save_sharded; works for a different world size too (DCP reshards).

    Every trainable parameter must be in the checkpoint (DCP raises on a missing key); frozen ones are
    not loaded, so the model's own state dict is checked strictly only when nothing is frozen."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path, process_group=dist._group())
    strict = all(p.requires_grad for p in model.parameters())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=strict, ignore_frozen_params=True))
