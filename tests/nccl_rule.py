"""NCCL's device rule on CPU: every collective wrapper in minigdpo/dist.py must put its tensors on
the training device itself.

    torchrun --nproc_per_node 2 tests/nccl_rule.py

`init_process_group("nccl")` registers a backend for CUDA tensors only, so a CPU tensor that reaches a
collective raises "No backend type associated with device type cpu". A CPU build has no CUDA, but it has
another device that is not the host: `meta`. A group built as "meta:gloo" serves meta tensors only, so with
the training device set to meta, a host tensor that reaches a collective fails exactly as under NCCL.
Meta tensors carry no values: this checks placement; the values are checked on CPU by the other tests.
Prints one line per wrapper; exits non-zero on the first violation.
"""

import ast
import os
import sys

import torch
import torch.distributed

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minigdpo import dist  # noqa: E402

# The tensor-taking wrappers, with a call each. Object collectives (all_gather_object, broadcast_object)
# are left to torch, which picks the group's own device for them.
CALLS = {
    "all_gather": lambda: dist.all_gather(torch.ones(3)),
    "all_reduce": lambda: [dist.all_reduce(torch.ones(2), op=op) for op in ("sum", "min", "max")][-1],
    "barrier": lambda: dist.barrier(),
    "full_tensor": lambda: _full_tensor(),
    "bridge": lambda: _bridge(),
}
OBJECT_COLLECTIVES = {"all_gather_object", "broadcast_object_list"}
# The split placement's channel (--sampler-ranks): send_object and recv_object use a gloo group of host tensors by
# design (tests/test_split.py runs them).
SPLIT_CHANNEL = {"send_object", "recv_object"}


def _full_tensor():
    """A parameter sharded over a mesh of the training device, gathered both ways."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    mesh = init_device_mesh("meta", (dist.world_size(),))
    t = DTensor.from_local(torch.ones(3, 4, device="meta"), mesh, [Shard(0)])
    whole = dist.full_tensor(t)
    assert whole.device.type == "meta" and whole.shape == (3 * dist.world_size(), 4), whole
    return dist.full_tensor(t, main_only=True)  # rank 0 gathers; the others get None


def _bridge():
    """The split placement's weight broadcast, here over the world group (rank 0 sends, as the first trainer does)."""
    dist._groups["bridge"] = torch.distributed.group.WORLD
    sent, work = dist.bridge(torch.ones(2))
    assert work is None
    return sent


def wrappers_calling_collectives():
    """Every function in dist.py whose body calls a torch.distributed collective on a tensor."""
    collectives = {"all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                   "broadcast", "barrier", "reduce", "gather", "scatter", "all_to_all", "send", "recv"}
    tree = ast.parse(open(dist.__file__).read())
    found = set()
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef):
            for node in ast.walk(fn):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in collectives and isinstance(node.func.value, ast.Name)
                        and node.func.value.id == "tdist"):
                    found.add(fn.name)
    return found


def main():
    torch.distributed.init_process_group("meta:gloo")
    dist.init()  # joins the group above
    dist._device = torch.device("meta")  # the training device: the only one the group serves
    try:
        torch.distributed.all_reduce(torch.ones(1))
        raise SystemExit("the simulated group accepted a host tensor")
    except RuntimeError as e:
        assert "No backend type associated with device type cpu" in str(e), e
    missing = wrappers_calling_collectives() - set(CALLS) - OBJECT_COLLECTIVES - SPLIT_CHANNEL
    assert not missing, f"collective wrappers this check does not call: {sorted(missing)}"
    for name, call in CALLS.items():
        out = call()
        assert out is None or out.device.type == "meta", (name, out.device)
        dist.print0(f"{name}: ok")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
