"""Checkpoints that survive a kill at any moment, and resuming from them.

    OUTPUT_DIR/checkpoints/step_000050/
        hf/           config, tokenizer and safetensors: from_pretrained() and vLLM load it as is
                      (with LoRA: the merged model, written only with --merge-on-save)
        adapter/      with LoRA: adapter_config.json, adapter_model.safetensors (peft's format) and tokenizer
        state/        model and optimizer shards (torch.distributed.checkpoint), exact fp32
                      (with LoRA: the adapters and their optimizer state; the frozen base is not copied)
        trainer.json  step, data cursor, scheduler, config
        rng/          each rank's RNG states
        pending/      with --async-steps: each rank's batches already sampled for the steps after this one
        COMPLETE      written last

Everything is written into `step_000050.partial/`, which is renamed to `step_000050/` only once COMPLETE is in it. A
kill mid-save leaves a .partial directory that resume ignores and deletes, and the previous checkpoint untouched.
"""

import contextlib
import errno
import json
import os
import random
import re
import shutil
import signal
import socket
import time

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from minigdpo import dist, lora
from minigdpo.config import ConfigError

_STEP_DIR = re.compile(r"^step_(\d{6,})$")
MAX_SHARD_BYTES = 4 * 1024**3


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the message names the rank and the path."""


class NotWhole(OSError):
    """Files that other ranks wrote are missing from rank 0's view of a checkpoint."""


def root(output_dir):
    return os.path.join(output_dir, "checkpoints")


def check_shared(output_dir):
    """Stop on every rank, before any weights load, unless every rank's output_dir is one directory, as checkpoints
    need: rank 0 writes a nonce file into its output_dir, and every rank looks for it in its own --output-dir (another
    mount point of the same share is fine; docs/gpus.md, "Several nodes")."""
    if dist.world_size() == 1:
        return
    name = dist.broadcast_object(f".minigdpo-shared-{os.getpid()}-{time.time_ns()}")
    error = ""
    if dist.is_main():
        try:
            os.makedirs(output_dir, exist_ok=True)
            with open(os.path.join(output_dir, name), "w") as f:
                f.write(name)
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
    error = dist.broadcast_object(error)
    seen = False
    for _ in range(10 if not error else 0):  # a network filesystem may show a new file a moment late
        try:
            with open(os.path.join(output_dir, name)) as f:
                seen = f.read() == name
            break
        except OSError:
            time.sleep(0.5)
    views = dist.all_gather_object((seen, socket.gethostname()))
    if dist.is_main():
        with contextlib.suppress(OSError):
            os.remove(os.path.join(output_dir, name))
    if error:
        raise ConfigError(f"--output-dir {output_dir}: rank 0 cannot write there ({error})")
    blind = [f"rank {r} on {host}" for r, (ok, host) in enumerate(views) if not ok]
    if blind:
        raise ConfigError(f"--output-dir {output_dir} is not the same directory on every node ({', '.join(blind)} "
                          "cannot see what rank 0 wrote there): put it on a filesystem every node shares")


def latest(output_dir):
    """Path of the newest complete checkpoint, or None."""
    base = root(output_dir)
    names = os.listdir(base) if os.path.isdir(base) else []
    complete = [(int(m.group(1)), os.path.join(base, name)) for name in names
                if (m := _STEP_DIR.match(name)) and os.path.exists(os.path.join(base, name, "COMPLETE"))]
    return max(complete)[1] if complete else None


def remove_partial(output_dir):
    """Delete what interrupted saves left behind; returns the removed paths. Rank 0 only."""
    removed = []
    base = root(output_dir)
    if os.path.isdir(base):
        for name in sorted(os.listdir(base)):
            path = os.path.join(base, name)
            unfinished = _STEP_DIR.match(name) and not os.path.exists(os.path.join(path, "COMPLETE"))
            if name.endswith(".partial") or unfinished:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def missing_files(path, world_size):
    """The files checkpoint `path` needs and lacks (or holds too short), relative to it: every file DCP's
    metadata lists under state/, and each saving rank's RNG state."""
    try:
        shards = dist.sharded_files(os.path.join(path, "state"))
        need = {os.path.join("state", name): size for name, size in shards.items()}
    except OSError:
        return [os.path.join("state", ".metadata")]
    need |= {os.path.join("rng", f"rank{r}.pt"): 1 for r in range(world_size)}
    if os.path.isdir(os.path.join(path, "pending")):  # --async-steps: every rank's batches sampled ahead
        need |= {os.path.join("pending", f"rank{r}.pt"): 1 for r in range(world_size)}
    lacking = []
    for name, size in need.items():
        try:
            if os.path.getsize(os.path.join(path, name)) < size:
                lacking.append(name)
        except OSError:
            lacking.append(name)
    return sorted(lacking)


def resume_point(output_dir):
    """(checkpoint to resume from or None, removed partial paths): decided once, on rank 0, and
    broadcast, so that every rank loads the same step. ConfigError on every rank when the latest
    complete checkpoint is not whole (a file some rank wrote is missing)."""
    decision = (None, [], [])
    if dist.is_main():
        removed = remove_partial(output_dir)
        last = latest(output_dir)
        lacking = missing_files(last, _saved_world_size(last)) if last else []
        decision = (last, removed, lacking)
    last, removed, lacking = dist.broadcast_object(decision)
    if lacking:
        more = " ..." if len(lacking) > 3 else ""
        raise ConfigError(f"--resume: {last} is not whole: {', '.join(lacking[:3])}{more} "
                          "missing (was --output-dir one directory every node shares?)")
    return last, removed


def _saved_world_size(path):
    try:
        with open(os.path.join(path, "trainer.json")) as f:
            return int(json.load(f)["derived"]["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return 1


def _write_hf(model, tokenizer, path, dtype):
    """A Hugging Face directory, streamed: rank 0 writes each safetensors file as soon as it is full.

    Every rank iterates model.whole_weights to its end, since each step is a collective (a gather to rank 0: no
    other rank holds a whole tensor). A write that fails on rank 0 stops its writing, not its
    iterating, so the ranks stay in step; returns the error or "". safetensors reports a failed write
    (a full disk among them) as a SafetensorError, not an OSError.
    """
    main, error, files, current, size = dist.is_main(), "", [], {}, 0

    def flush():
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(current, os.path.join(path, name), metadata={"format": "pt"})
        files.append((name, {k: t.numel() * t.element_size() for k, t in current.items()}))

    try:
        if main:
            os.makedirs(path, exist_ok=True)
    except OSError as e:
        error = _explain(e, path)
    for name, tensor in model.whole_weights(dtype, main_only=True):  # every rank iterates: each step is a collective
        if not main or error:
            continue
        try:
            t = tensor.detach().to("cpu").contiguous()
            if current and size + t.numel() * t.element_size() > MAX_SHARD_BYTES:
                flush()
                current, size = {}, 0
            current[name] = t
            size += t.numel() * t.element_size()
        except (OSError, SafetensorError) as e:
            error = _explain(e, path)
    if not main or error:
        return error
    try:
        flush()
        _finish_hf(model, tokenizer, path, dtype, files)
    except (OSError, SafetensorError) as e:
        error = _explain(e, path)
    return error


def _finish_hf(model, tokenizer, path, dtype, files):
    """Name the safetensors files as Hugging Face expects, then write config and tokenizer."""
    if len(files) == 1:
        os.replace(os.path.join(path, files[0][0]), os.path.join(path, "model.safetensors"))
    else:
        index = {"metadata": {"total_size": 0}, "weight_map": {}}
        for i, (name, sizes) in enumerate(files, start=1):
            final = f"model-{i:05d}-of-{len(files):05d}.safetensors"
            os.replace(os.path.join(path, name), os.path.join(path, final))
            for k, nbytes in sizes.items():
                index["weight_map"][k] = final
                index["metadata"]["total_size"] += nbytes
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


def rng_state():
    """This rank's RNG states. Its own GPU's only: a resume on a machine with fewer GPUs per node must
    find a state it can restore (get_rng_state_all would save one per GPU of the saving node)."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def set_rng_state(rng):
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])  # the current device's


def _explain(error, path):
    """One line for a failed write, saying so when the disk is full (some writers hide ENOSPC)."""
    kind = "" if isinstance(error, (dist.SaveError, NotWhole)) else f"{type(error).__name__}: "  # those say what failed
    text = f"{kind}{str(error).splitlines()[0] if str(error) else ''}"
    try:
        full = shutil.disk_usage(os.path.dirname(path)).free < 1024 * 1024
    except OSError:
        full = False
    if full and "No space left" not in text:
        text += " (No space left on device)"
    return text


def _attempt(fn, path):
    """Run one rank's part of a save phase; the error as one line, or "" (fn may return its own error)."""
    try:
        return fn() or ""
    except dist.SaveError as e:  # DCP's verdict, raised on every rank: the failed rank(s) report it
        return _explain(e, path) if dist.rank() in e.ranks else ""
    except Exception as e:  # OSError for a full disk or a failed write
        return _explain(e, path)


def _agree(error, tmp):
    """End of a save phase: every rank learns every rank's error, so all of them stop together.

    Each phase runs all of its collectives on every rank whatever fails locally, so this vote is
    the next collective on every rank, and no rank waits inside a collective another has skipped.
    """
    errors = dist.all_gather_object(error)
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        if dist.is_main():
            shutil.rmtree(tmp, ignore_errors=True)
        r, e = bad[0]
        raise CheckpointError(f"could not write checkpoint {tmp}: rank {r}: {e}")


def save(output_dir, step, model, optimizer, sched, tokenizer, trainer_state, save_dtype, keep, export_hf=True,
         pending=()):
    """Write checkpoint `step` atomically on all ranks; raise CheckpointError on every rank on failure,
    within one phase of the failure, leaving the previous checkpoint untouched.

    Phases, each ended by a vote of every rank: prepare (rank 0 makes the folder), adapter (with LoRA:
    peft's format), hf (the Hugging Face export; export_hf=False skips it, for LoRA without
    --merge-on-save), state (every rank's DCP shards and RNG state), finish (rank 0 checks that every
    rank's files are there, then writes trainer.json and COMPLETE) and rename. pending: this rank's batches sampled
    for the steps after this one (minigdpo/pipeline.py), which a resumed run trains on as they are.
    """
    final = os.path.join(root(output_dir), f"step_{step:06d}")
    tmp = final + ".partial"

    def prepare():  # rank 0 alone creates the temporary folder: on a shared filesystem it is one folder
        if dist.is_main():
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)

    def write_adapter():
        adapters = lora.adapter_state(model.lm)  # every rank gathers: each step is a collective
        if dist.is_main():
            lora.save_adapter(os.path.join(tmp, "adapter"), adapters, model.lm, tokenizer)

    def write_state():  # each rank creates every folder it writes to
        os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
        dist.save_sharded(model, optimizer, os.path.join(tmp, "state"))
        torch.save(rng_state(), os.path.join(tmp, "rng", f"rank{dist.rank()}.pt"))
        if pending:
            os.makedirs(os.path.join(tmp, "pending"), exist_ok=True)
            torch.save(list(pending), os.path.join(tmp, "pending", f"rank{dist.rank()}.pt"))

    def finish():
        if dist.is_main():
            lacking = missing_files(tmp, dist.world_size())  # every rank's files, seen from rank 0
            if lacking:
                raise NotWhole(f"{', '.join(lacking)} missing (do the ranks share one --output-dir?)")
            with open(os.path.join(tmp, "trainer.json"), "w") as f:
                json.dump({**trainer_state, "step": step, "scheduler": sched.state_dict()}, f, indent=2, default=str)
            with open(os.path.join(tmp, "COMPLETE"), "w") as f:
                f.write("ok\n")

    def rename():
        if dist.is_main():
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _prune(output_dir, keep)

    phases = [("prepare", prepare), ("adapter", write_adapter if model.has_adapters else None),
              ("hf", (lambda: _write_hf(model, tokenizer, os.path.join(tmp, "hf"), save_dtype)) if export_hf else None),
              ("state", write_state), ("finish", finish), ("rename", rename)]
    for name, run in phases:
        if run is not None:
            injected = _fault(name, step)
            error = _attempt(run, tmp)
            _agree(error or (_explain(injected, tmp) if injected else ""), tmp)
    return final


def _fault(phase, step):
    """The one fault hook, for the reliability tests: None unless MINIGDPO_FAULT names this phase.

    MINIGDPO_FAULT=PHASE@STEP SIGKILLs rank MINIGDPO_FAULT_RANK (default 0) as phase PHASE of checkpoint
    STEP begins. PHASE@STEP:enospc returns a full-disk error instead, which that rank reports at the end
    of the phase, its part run (collectives included) as a write that failed would have run it.
    """
    point, _, kind = os.environ.get("MINIGDPO_FAULT", "").partition(":")
    if point != f"{phase}@{step}" or os.environ.get("MINIGDPO_FAULT_RANK", "0") != str(dist.rank()):
        return None
    if kind != "enospc":
        os.kill(os.getpid(), signal.SIGKILL)
    return OSError(errno.ENOSPC, "No space left on device (injected)")


def _prune(output_dir, keep):
    steps = sorted((int(m.group(1)), n) for n in os.listdir(root(output_dir)) if (m := _STEP_DIR.match(n)))
    for _, name in steps[:-keep]:
        shutil.rmtree(os.path.join(root(output_dir), name), ignore_errors=True)


def _lora_flags(rank, targets):
    return f"--lora-rank {rank}" + (f" --lora-targets {','.join(sorted(targets))}" if rank else "")


def load_pending(path):
    """This rank's batches a checkpoint holds for the steps after it ([] for none; minigdpo/pipeline.py). Another
    number of ranks than the run that wrote them cannot split them again: ConfigError."""
    folder, saved = os.path.join(path, "pending"), _saved_world_size(path)
    if os.path.isdir(folder) and saved != dist.world_size():
        raise ConfigError(f"--resume: {path} holds batches {saved} ranks sampled ahead (--async-steps); resume it "
                          f"on {saved} ranks, not {dist.world_size()}")
    mine = os.path.join(folder, f"rank{dist.rank()}.pt")
    return torch.load(mine, weights_only=False) if os.path.isdir(folder) else []


def load(path, model, optimizer, sched):
    """Restore model, optimizer, scheduler and this rank's RNG; returns the trainer state.

    A checkpoint trained with other LoRA settings (or without LoRA) holds other parameters: ConfigError."""
    with open(os.path.join(path, "trainer.json")) as f:
        state = json.load(f)
    saved = state.get("config", {})
    peft = model.lm.peft_config[lora.ADAPTER] if lora.has_adapters(model.lm) else None
    ours = _lora_flags(peft.r, peft.target_modules) if peft else _lora_flags(0, [])
    theirs = _lora_flags(saved.get("lora_rank", 0), saved.get("lora_targets", []))
    if ours != theirs:
        raise ConfigError(f"--resume: {path} was trained with {theirs}, this run has {ours}")
    dist.load_sharded(model, optimizer, os.path.join(path, "state"))
    sched.load_state_dict(state["scheduler"])
    rng_file = os.path.join(path, "rng", f"rank{dist.rank()}.pt")
    if os.path.exists(rng_file):  # absent when resuming with more ranks than saved
        set_rng_state(torch.load(rng_file, weights_only=False))
    return state
