"""Everything torch.distributed but FSDP2's sharding: process group, rank helpers, collectives, the device mesh, whole
tensors from shards and sharded checkpoints. No other file issues a collective (minigdpo/fsdp.py shards with FSDP2's
API, whose collectives run inside torch).

A plain `python train.py` is world size 1 on the same code path: it initialises a
one-process group (gloo on CPU, NCCL on GPU) so that FSDP2 and the collectives work unchanged.

NCCL serves CUDA tensors only: a host tensor that reaches one of its collectives raises "No backend
type associated with device type cpu". So every wrapper here puts its tensors on the training device
itself and returns its result there, and a call site can hand it a tensor from anywhere.

With --async-steps the sampling thread's collectives (minigdpo/pipeline.py) go to a gloo group of their own
(`sampling_group`), on the host: a group's must come in the same order on every rank, which two threads cannot promise.

With --sampler-ranks N (minigdpo/split.py) rank(), world_size() and the collectives are those of this rank's role,
and the roles meet only on the split placement's own groups (send_object, recv_object, bridge, announce).
"""

import datetime
import gc
import os
import pickle
import threading
import traceback
from contextlib import contextmanager

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

_device = None   # the training device, set by init(): every collective's tensors go there
_mesh = None     # the FSDP2 device mesh, built once by init()
_thread = threading.local()  # .group: the calling thread's own process group (the sampling thread's, async)
_role = "both"   # with --sampler-ranks: "trainer" or "sampler" (init)
_groups = {}     # --sampler-ranks: "role" (this rank's role), "bridge" (trainer 0 and the samplers), "channel" (all)
_voice = True    # is_main() may speak: a sampling rank speaks only for the final evaluation (speak)
TIMEOUT = datetime.timedelta(minutes=30)  # for every process group: a collective waits this long for a late rank


def init(sharding="auto", sampler_ranks=0):
    """Join (or create) the process group and build the device mesh; returns this rank's device.

    sharding: fsdp shards every parameter over all ranks; hsdp shards within a node and replicates
    across nodes (a 2-D mesh); auto picks hsdp when the run spans more than one node. sampler_ranks: the last
    ones only sample (split), and the mesh is the other ranks', flat.
    """
    global _device, _mesh
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not tdist.is_initialized():
        kwargs = dict(timeout=TIMEOUT, device_id=device if backend == "nccl" else None)
        if "RANK" not in os.environ:  # a plain `python train.py`: a group of one, in memory, no port
            kwargs.update(store=tdist.HashStore(), rank=0, world_size=1)
        # A store barrier at the end of init_process_group (and of each new_group the mesh makes):
        # gloo's connectFullMesh can return on one rank while a peer still completes its side, and a
        # rank that then stops at once (a config error found once the world size is known) would
        # close its connections under that peer, which fails with "Connection closed by peer".
        os.environ.setdefault("TORCH_DIST_INIT_BARRIER", "1")
        tdist.init_process_group(backend, **kwargs)
    _device = device
    if sampler_ranks:
        return _split(device, sampler_ranks)
    shape = mesh_shape(sharding, world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", world_size())))
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    # A flat mesh reuses the world group. HSDP's groups are new ones, and a group created without a timeout
    # gets its backend's default (NCCL: 10 minutes, distributed_c10d._get_default_timeout), not the world's.
    _mesh = init_device_mesh(device.type, shape, mesh_dim_names=names,
                             backend_override={name: _options(device) for name in names} if len(shape) == 2 else None)
    return device


def _split(device, n):
    """--sampler-ranks n: the last n ranks sample, the others train (minigdpo/split.py). Every rank makes every
    group, in the same order; the sampling ranks' collectives and the channel run on gloo, with host tensors."""
    global _role, _mesh, _voice
    world = tdist.get_world_size()
    if not 0 < n < world:
        raise ValueError(f"--sampler-ranks {n} leaves no rank to train in a job of {world} ranks")
    trainers, samplers = list(range(world - n)), list(range(world - n, world))
    _groups.update(trainer=tdist.new_group(trainers, timeout=TIMEOUT),
                   sampler=tdist.new_group(samplers, backend="gloo", timeout=TIMEOUT),
                   bridge=tdist.new_group([0] + samplers, timeout=TIMEOUT),
                   channel=tdist.new_group(backend="gloo", timeout=TIMEOUT))
    _role = "trainer" if tdist.get_rank() in trainers else "sampler"
    _groups["role"], _voice = _groups[_role], _role == "trainer"
    if _role == "trainer":
        _mesh = DeviceMesh.from_group(_groups["trainer"], device.type, mesh_dim_names=("shard",))
    return device


def _options(device):
    """Process-group options for a new group on `device`'s backend (NCCL or gloo), with TIMEOUT."""
    options = type(tdist.group.WORLD._get_backend(device).options)()
    options._timeout = TIMEOUT
    return options


def mesh_shape(sharding, world, local_world):
    """(world,) for a flat mesh; (nodes, ranks per node) for HSDP, which all-gathers only within a node."""
    if local_world < 1 or world % local_world:
        raise ValueError(f"--sharding {sharding}: world size {world} is not a whole number of nodes of {local_world} "
                         "ranks")
    if sharding == "hsdp" or (sharding == "auto" and local_world < world):
        return (world // local_world, local_world)
    return (world,)


def mesh():
    return _mesh


def device():
    """The training device (the host before init)."""
    return _device if _device is not None else torch.device("cpu")


def cleanup(error=None):
    """Destroy the process group, its threads joined and connections closed, while the interpreter is still whole:
    destroy_process_group only unregisters a gloo group (docs/reliability.md, "A clean exit, every time"). The caller
    first lets go of the model and optimizer, which hold the groups (train.main); here the frames of `error`'s traceback
    and its causes are released, the mesh drops its groups, and a collection joins the rest (tests/test_cluster.py)."""
    global _mesh, _role, _voice
    todo, seen = [error], set()
    while todo:
        e = todo.pop()
        if e is not None and id(e) not in seen:
            seen.add(id(e))
            traceback.clear_frames(e.__traceback__)
            todo += [e.__cause__, e.__context__]
    mesh, _mesh, _role, _voice = _mesh, None, "both", True
    _groups.clear()
    if tdist.is_initialized():
        tdist.destroy_process_group()
    if mesh is not None:
        getattr(mesh, "_pg_registry", {}).clear()  # the root mesh's: every dimension's and submesh's groups
    del mesh
    gc.collect()


def is_initialized():
    return tdist.is_initialized()


def rank():
    """This rank in its role's group (the world's, without --sampler-ranks)."""
    return tdist.get_rank(_groups.get("role")) if tdist.is_initialized() else 0


def world_size():
    return tdist.get_world_size(_groups.get("role")) if tdist.is_initialized() else 1


def role():
    """"both"; with --sampler-ranks, "trainer" or "sampler"."""
    return _role


def other_ranks():
    """With --sampler-ranks, the other role's ranks, in the world's numbering (the trainers come first)."""
    world, mine = tdist.get_world_size(), world_size()
    return list(range(mine, world)) if _role == "trainer" else list(range(world - mine))


def is_main():
    return rank() == 0 and _voice


def speak():
    """The sampling ranks' first rank becomes their main: it prints and writes (the final evaluation)."""
    global _voice
    _voice = True


def print0(*args, **kwargs):
    if is_main():
        print(*args, **kwargs, flush=True)


def sampling_group():
    """A new gloo group of every rank, for the sampling thread's collectives (--async-steps); every rank makes it at
    the same point. None in a run of one rank, which has nothing to gather."""
    return tdist.new_group(backend="gloo", timeout=TIMEOUT) if world_size() > 1 else None


@contextmanager
def collectives_on(group):
    """The calling thread's collectives (the wrappers below) go to `group`, a gloo one, with host tensors."""
    _thread.group = group
    try:
        yield
    finally:
        _thread.group = None


def _group():
    return getattr(_thread, "group", None) or _groups.get("role")


def _here():
    """Where this thread's collectives keep their tensors: the host on a gloo group of its own or the sampling ranks',
    else the training device."""
    return torch.device("cpu") if getattr(_thread, "group", None) is not None or _role == "sampler" else device()


def barrier():
    """Wait for every rank: a one-element all-reduce on the training device (what a barrier is)."""
    if world_size() > 1:
        tdist.all_reduce(torch.zeros(1, device=_here()), group=_group())


def all_gather(tensor):
    """Concatenate equally shaped tensors from every rank along dim 0, in rank order, on the training device."""
    tensor = tensor.to(_here()).contiguous()
    if world_size() == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(world_size())]
    tdist.all_gather(parts, tensor, group=_group())
    return torch.cat(parts).to(device())


def all_reduce(tensor, op="sum"):
    """Sum, max or min over ranks, returned as a new tensor on the training device."""
    out = tensor.to(_here(), copy=True)
    if world_size() > 1:
        tdist.all_reduce(out, op={"sum": tdist.ReduceOp.SUM, "max": tdist.ReduceOp.MAX, "min": tdist.ReduceOp.MIN}[op],
                         group=_group())
    return out.to(device())


def all_gather_object(obj):
    """A list with every rank's picklable `obj`, in rank order (torch picks the group's device)."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    tdist.all_gather_object(out, obj, group=_group())
    return out


def exchange_objects(outgoing):
    """Send outgoing[r] (a picklable object) to rank r; returns what every rank sent this one, in rank order.
    Each object crosses the network once, where all_gather_object would deliver every object to every rank."""
    if world_size() == 1:
        return list(outgoing)
    data = [torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) for obj in outgoing]
    sizes = torch.tensor([len(d) for d in data], dtype=torch.int64, device=_here())    # (world,) bytes to each
    incoming = torch.empty_like(sizes)                                                   # (world,) bytes from each
    tdist.all_to_all_single(incoming, sizes, group=_group())
    received = torch.empty(int(incoming.sum()), dtype=torch.uint8, device=_here())
    tdist.all_to_all_single(received, torch.cat(data).to(_here()), incoming.tolist(), sizes.tolist(), group=_group())
    return [pickle.loads(part.cpu().numpy().tobytes()) for part in received.split(incoming.tolist())]


def broadcast_object(obj, src=0):
    if world_size() == 1:
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=src, group=_group())
    return box[0]


def send_object(obj, dst):
    """Send a picklable object to rank `dst` (of the world) over the split placement's channel, without waiting:
    returns a function that waits until it is sent."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    works = [tdist.isend(t, dst, group=_groups["channel"]) for t in (torch.tensor([len(data)]), data)]
    return lambda: [work.wait() for work in works] and data


def recv_object(src):
    """What rank `src` (of the world) sent this rank with send_object, the next in its order."""
    size = torch.empty(1, dtype=torch.int64)
    tdist.recv(size, src, group=_groups["channel"])
    data = torch.empty(int(size), dtype=torch.uint8)
    tdist.recv(data, src, group=_groups["channel"])
    return pickle.loads(data.numpy().tobytes())


def bridge(tensor, wait=True):
    """Broadcast `tensor` from rank 0 (the first trainer) to the sampling ranks, on the training device: returns
    (the tensor there, on a sampling rank what rank 0 sent; the pending work with wait=False, which the sender keeps
    with the tensor until it completes, else None)."""
    tensor = tensor.to(device())
    return tensor, tdist.broadcast(tensor, src=0, group=_groups["bridge"], async_op=not wait)


def announce(obj, src):
    """Rank `src`'s picklable `obj`, on every rank of both roles (a barrier of the whole job, too)."""
    box = [obj]
    tdist.broadcast_object_list(box, src=src, group=_groups["channel"])
    return box[0]


def full_tensor(t, main_only=False):
    """The whole tensor behind a (possibly sharded) parameter. Every rank must call it, in the same order.

    main_only=True gathers it on rank 0 alone and returns None on the other ranks: for a writer that
    only rank 0 runs (the Hugging Face export), no other rank holds a whole tensor.
    """
    if not main_only or world_size() == 1:
        return t.full_tensor() if isinstance(t, DTensor) else t
    if not isinstance(t, DTensor):
        return t if is_main() else None
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
    blocks = [torch.empty_like(padded) for _ in range(tdist.get_world_size(group))] if is_main() else None
    tdist.gather(padded, blocks, group_dst=0, group=group)
    return torch.cat(blocks)[:rows] if is_main() else None


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
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=_group())
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
    dcp.load(state, checkpoint_id=path, process_group=_group())
    strict = all(p.requires_grad for p in model.parameters())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=strict, ignore_frozen_params=True))
