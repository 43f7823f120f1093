"""minigdpo: GDPO and GRPO for language models in raw PyTorch. README.md, "Reading the code", walks one
training step through its files in order, starting at train.py at the repository root."""

__version__ = "0.1.0"

