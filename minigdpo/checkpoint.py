"""Checkpoints that survive a kill at any moment, and resuming from them.

    OUTPUT_DIR/checkpoints/step_000050/
        hf/           config, tokenizer and safetensors: from_pretrained() and vLLM load it as is
        state/        model and optimizer shards (torch.distributed.checkpoint), exact fp32
        trainer.json  step, data cursor, scheduler, config
        rng/          each rank's RNG states
        COMPLETE      written last

Everything is written into `step_000050.partial/`, which is renamed to `step_000050/` only
once COMPLETE is in it. A kill mid-save leaves a .partial directory that resume ignores and
deletes, and the previous checkpoint untouched.
"""

import errno
import json
import os
import random
import re
import shutil
import signal

import numpy as np
import torch
from safetensors.torch import save_file

from minigdpo import dist
from minigdpo.policy import hf_state

_STEP_DIR = re.compile(r"^step_(\d{6,})$")
MAX_SHARD_BYTES = 4 * 1024**3


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the message names the path."""


def inject_fault(point, step):
    """Fault-injection hook for the reliability tests; does nothing unless MINIGDPO_FAULT is set.

    MINIGDPO_FAULT=POINT@STEP SIGKILLs rank MINIGDPO_FAULT_RANK (default 0) when it reaches
    POINT at STEP; MINIGDPO_FAULT=enospc@STEP makes the checkpoint write at STEP fail as a full
    disk would.
    """
    spec = os.environ.get("MINIGDPO_FAULT")
    if not spec or spec != f"{point}@{step}" or os.environ.get("MINIGDPO_FAULT_RANK", "0") != str(dist.rank()):
        return
    if point == "enospc":
        raise OSError(errno.ENOSPC, "No space left on device (injected)")
    os.kill(os.getpid(), signal.SIGKILL)


def root(output_dir):
    return os.path.join(output_dir, "checkpoints")


def latest(output_dir):
    """Path of the newest complete checkpoint, or None."""
    best = None
    base = root(output_dir)
    if not os.path.isdir(base):
        return None
    for name in os.listdir(base):
        m = _STEP_DIR.match(name)
        if m and os.path.exists(os.path.join(base, name, "COMPLETE")):
            if best is None or int(m.group(1)) > best[0]:
                best = (int(m.group(1)), os.path.join(base, name))
    return best[1] if best else None


def remove_partial(output_dir):
    """Delete what interrupted saves left behind (rank 0); returns the removed paths."""
    removed = []
    base = root(output_dir)
    if dist.is_main() and os.path.isdir(base):
        for name in sorted(os.listdir(base)):
            path = os.path.join(base, name)
            if name.endswith(".partial") or (_STEP_DIR.match(name) and not os.path.exists(os.path.join(path, "COMPLETE"))):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    dist.barrier()
    return removed


def _write_hf(model, tokenizer, path, dtype, step):
    """A Hugging Face directory, streaming one full tensor at a time (rank 0 writes)."""
    shards, current, size = [], {}, 0
    for name, tensor in hf_state(model, dtype):  # every rank iterates: each step is a collective
        if dist.is_main():
            t = tensor.detach().to("cpu").contiguous()
            if current and size + t.numel() * t.element_size() > MAX_SHARD_BYTES:
                shards.append(current)
                current, size = {}, 0
            current[name] = t
            size += t.numel() * t.element_size()
    if not dist.is_main():
        return
    shards.append(current)
    os.makedirs(path, exist_ok=True)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    else:
        index = {"metadata": {"total_size": 0}, "weight_map": {}}
        for i, shard in enumerate(shards, start=1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
            inject_fault("between_shards", step)
            for k, t in shard.items():
                index["weight_map"][k] = fname
                index["metadata"]["total_size"] += t.numel() * t.element_size()
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    config = model.lm.config
    config.use_cache = True
    config.dtype = dtype
    config.save_pretrained(path)
    config.use_cache = False
    if getattr(model.lm, "generation_config", None) is not None:
        model.lm.generation_config.save_pretrained(path)
    tokenizer.save_pretrained(path)


def _rng_state():
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _explain(error, path):
    """One line for a failed write, saying so when the disk is full (some writers hide ENOSPC)."""
    text = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    try:
        full = shutil.disk_usage(os.path.dirname(path)).free < 1024 * 1024
    except OSError:
        full = False
    if full and "No space left" not in text:
        text += " (No space left on device)"
    return text


def save(output_dir, step, model, optimizer, sched, tokenizer, trainer_state, save_dtype, keep):
    """Write checkpoint `step` atomically on all ranks; raise CheckpointError (on every rank) on failure."""
    final = os.path.join(root(output_dir), f"step_{step:06d}")
    tmp = final + ".partial"
    ok = True
    error = ""
    try:
        if dist.is_main():
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
        dist.barrier()
        inject_fault("enospc", step)
        _write_hf(model, tokenizer, os.path.join(tmp, "hf"), save_dtype, step)
        inject_fault("after_hf", step)
        dist.save_sharded(model, optimizer, os.path.join(tmp, "state"))
        inject_fault("after_state", step)
        torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank{dist.rank()}.pt"))
    except Exception as e:  # OSError for a full disk or a failed write, anything else from DCP
        ok, error = False, _explain(e, tmp)
    ok = bool(dist.all_reduce(torch.tensor([int(ok)]), op="min").item())
    if ok and dist.is_main():
        try:
            with open(os.path.join(tmp, "trainer.json"), "w") as f:
                json.dump({**trainer_state, "step": step, "scheduler": sched.state_dict()}, f, indent=2, default=str)
            with open(os.path.join(tmp, "COMPLETE"), "w") as f:
                f.write("ok\n")
            inject_fault("before_rename", step)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        except OSError as e:
            ok, error = False, _explain(e, tmp)
    ok = bool(dist.broadcast_object(ok))
    errors = [e for e in dist.all_gather_object(error) if e]
    if not ok:
        if dist.is_main():
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not write checkpoint {tmp}: {errors[0] if errors else 'another rank failed'}")
    if dist.is_main():
        _prune(output_dir, keep)
    dist.barrier()
    return final


def _prune(output_dir, keep):
    steps = sorted((int(m.group(1)), n) for n in os.listdir(root(output_dir)) if (m := _STEP_DIR.match(n)))
    for _, name in steps[:-keep]:
        shutil.rmtree(os.path.join(root(output_dir), name), ignore_errors=True)


def load(path, model, optimizer, sched):
    """Restore model, optimizer, scheduler and this rank's RNG; returns the trainer state."""
    dist.load_sharded(model, optimizer, os.path.join(path, "state"))
    with open(os.path.join(path, "trainer.json")) as f:
        state = json.load(f)
    sched.load_state_dict(state["scheduler"])
    rng_file = os.path.join(path, "rng", f"rank{dist.rank()}.pt")
    if os.path.exists(rng_file):  # absent when resuming with more ranks than saved
        rng = torch.load(rng_file, weights_only=False)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    return state
