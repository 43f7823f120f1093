"""Everything torch.distributed: process group, rank helpers, collectives, FSDP2 sharding
and sharded checkpoints. No other file imports torch.distributed.

A plain `python train.py` is world size 1 on the same code path: it initialises a
one-process group (gloo on CPU, NCCL on GPU) so that FSDP2 and the collectives work unchanged.
"""

import datetime
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


def init():
    """Join (or create) the process group; returns the device this rank computes on."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        kwargs = dict(timeout=datetime.timedelta(minutes=30), device_id=device if backend == "nccl" else None)
        if "RANK" not in os.environ:  # a plain `python train.py`: a group of one, in memory, no port
            kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
        dist.init_process_group(backend, **kwargs)
    return device


def cleanup():
    if dist.is_initialized():
        dist.destroy_process_group()


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main():
    return rank() == 0


def print0(*args, **kwargs):
    if is_main():
        print(*args, **kwargs, flush=True)


def barrier():
    if world_size() > 1:
        dist.barrier()


def all_gather(tensor):
    """Concatenate equally shaped tensors from every rank along dim 0, in rank order."""
    if world_size() == 1:
        return tensor
    device = tensor.device
    if dist.get_backend() == "nccl" and device.type != "cuda":
        tensor = tensor.cuda()
    parts = [torch.empty_like(tensor) for _ in range(world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts).to(device)


def all_gather_object(obj):
    """A list with every rank's picklable `obj`, in rank order."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce(tensor, op="sum"):
    """In-place sum/max/min over ranks; returns the tensor."""
    if world_size() > 1:
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        dist.all_reduce(tensor, op=ops[op])
    return tensor


def broadcast_object(obj, src=0):
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def shard(model, layers, device, param_dtype=None, offload=False, reshard_after_forward=True):
    """FSDP2: fully_shard each decoder layer, then the root, over all ranks.

    param_dtype (e.g. bf16) casts parameters for compute while master weights and gradient
    reduction stay fp32. offload keeps the shards in CPU memory (for the frozen reference).
    """
    mesh = init_device_mesh(device.type, (world_size(),))
    kwargs = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32))
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, **kwargs)  # the root keeps its parameters between forward and backward
    return model


def full_tensor(t):
    """The whole tensor behind a (possibly sharded) parameter. Every rank must call it, in the same order."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def save_sharded(model, optimizer, path):
    """Each rank writes its shards of model and optimizer state (torch.distributed.checkpoint)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    except dcp.api.CheckpointException as e:  # a BaseException: turn it into an ordinary, one-line error
        first = next(iter(e.failures.values()), e)
        cause = first[0] if isinstance(first, tuple) else first
        raise OSError(f"sharded save to {path} failed on rank(s) {sorted(e.failures)}: "
                      f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}") from None


def load_sharded(model, optimizer, path):
    """Inverse of save_sharded; works for a different world size too (DCP reshards)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=True))
