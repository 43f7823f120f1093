"""A sampler in a process of its own, outside the torchrun job's process group: a split run's sampling rank holds its
vLLM engine so (--sampler-ranks; docs/async.md, "The split placement"). vLLM's external launcher would make its groups
over the whole torchrun world (distributed/parallel_state.py:1928-1990 in 0.32.0), which the trainers never join.

Each call goes over a pipe, tensors through torch.multiprocessing (shared memory on CPU, CUDA IPC handles on GPU); the
caller waits for each answer, so a tensor it sends stays alive while the engine reads it.
"""

import os

import torch

from minigdpo.split import SamplerLost

# torchrun's world, which the child leaves, its agent's store too (vllm_sampler takes a free port); LOCAL_RANK stays:
# the rank's GPU is the engine's
TORCHRUN_WORLD = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE")


class EngineProcess:
    """build(*args, **kwargs) in a child process, its methods called from here."""

    def __init__(self, build, *args, **kwargs):
        context = torch.multiprocessing.get_context("spawn")  # a fork would copy this rank's threads and groups
        self.pipe, theirs = context.Pipe()
        self.process = context.Process(target=_serve, args=(theirs, build, args, kwargs), daemon=True)
        self.process.start()
        self.adapters_only = self._call()  # the one attribute a caller reads (train.py)

    def __getattr__(self, name):  # generate, sleep, wake, adapters_off: run in the child
        return lambda *args, **kwargs: self._call(name, args, kwargs)

    def load_weights(self, named_tensors):
        """A stream of (name, tensor) pairs, received here, sent to the engine whole."""
        return self._call("load_weights", (list(named_tensors),), {})

    def close(self):
        if self.process.is_alive():
            self._call("close", (), {})
            self.pipe.send(None)
        self.process.join()

    def _call(self, *call):
        """Send a call, (name, args, kwargs), and return its answer or raise its error; with none, the build's."""
        if call:
            self.pipe.send(call)
        try:
            ok, value = self.pipe.recv()
        except EOFError:
            self.process.join(timeout=10)  # its status is known once it is reaped
            raise SamplerLost(f"the sampler's process exited (status {self.process.exitcode})") from None  # one line
        if not ok:
            raise value
        return value


def _serve(pipe, build, args, kwargs):
    """The child: build the sampler (its adapters_only is the first answer), then answer each call until None."""
    for name in TORCHRUN_WORLD:
        os.environ.pop(name, None)
    try:
        sampler = build(*args, **kwargs)
    except Exception as e:
        return pipe.send((False, e))
    pipe.send((True, sampler.adapters_only))
    for name, args, kwargs in iter(lambda: _next(pipe), None):
        try:
            pipe.send((True, getattr(sampler, name)(*args, **kwargs)))
        except Exception as e:
            pipe.send((False, e))


def _next(pipe):
    """The next call; None once the rank closes the engine, or is gone (its end of the pipe closed)."""
    try:
        return pipe.recv()
    except EOFError:
        return None
