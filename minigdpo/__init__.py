"""minigdpo: GDPO and GRPO for language models in raw PyTorch.

Read in this order: advantages.py (the estimators), loss.py (the policy loss),
rewards.py (the reward registry), then train.py at the repository root.
"""

__version__ = "0.1.0"
