"""train.py with --sampler vllm on this CPU machine: tests/fake_vllm.py stands in for vLLM.

    python tests/vllm_train.py TRAIN_ARGS...                        # one process
    torchrun --nproc_per_node 2 tests/vllm_train.py TRAIN_ARGS...   # one engine per rank

The fake is installed as `vllm`, and --sampler vllm resolves to it although there is no GPU. At the end
each rank prints how many engines its process built.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import eval as evaluation  # noqa: E402
import fake_vllm  # noqa: E402
import train  # noqa: E402
from minigdpo import vllm_sampler  # noqa: E402

if __name__ == "__main__":
    patch = pytest.MonkeyPatch()
    fake_vllm.install(patch)
    for module in (train, evaluation, vllm_sampler):
        patch.setattr(module, "resolve_kind", lambda kind: "vllm", raising=False)
    train.main(sys.argv[1:])
    sys.stdout.write(f"engines built: {len(fake_vllm.LLM.instances)}\n")
