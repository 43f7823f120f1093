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
    install_requires=[
        "torch>=2.6",  # FSDP2's public fully_shard
        "transformers>=4.56",  # the dtype= loading argument
        "numpy",
        "safetensors",
        "tqdm",
    ],
    extras_require={
        "vllm": ["vllm==0.10.2"],  # the one version minigdpo/vllm_sampler.py is written against (it brings torch 2.8)
        "test": ["pytest", "hypothesis", "matplotlib"],
        "plot": ["matplotlib"],
        "demo": ["gguf", "accelerate"],  # loads the offline demo model from its GGUF file
        "wandb": ["wandb"],
        "parquet": ["pyarrow"],
    },
)
