"""Seconds per step, tokens/s and the update phase's model FLOPs utilisation on one accelerator.

    python benchmarks/gpu.py                                  # smoke preset, 0.5B-class Qwen2, bf16
    python benchmarks/gpu.py --batch-size 64 --group-size 8 --micro-batch-size 16 --max-new-tokens 256
    python benchmarks/gpu.py --nproc 8 ...                    # the same under torchrun, FSDP2 over 8 GPUs

The model is a random-init Qwen2 with Qwen2.5-0.5B's shape (24 layers, hidden 896, 14/2 heads,
MLP 4864, vocab 151,936, tied embeddings; 494M parameters), built once into the cache with the
offline byte-level tokenizer. train.py runs the `smoke` preset on it for --steps steps; any other
train.py flag passes through and overrides the preset. The script reads metrics.jsonl and prints
the medians over every step but the first (warm-up):

    MFU = 6 x parameters x tokens through the model in the update / update seconds / peak, per device
    (train.py's throughput/update_tflops_per_device; with LoRA, 4 x parameters + 2 x trainable ones)

Tokens count each prompt once per micro-batch (its G completions share its forward pass) plus
every completion token. --peak-tflops is the accelerator's dense bf16 peak: 989 for an H100 SXM
(the default), 312 for an A100.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from plot import read_run  # noqa: E402
from minigdpo import models  # noqa: E402
from gpu_proxies import add_shape_args, shape  # noqa: E402  (this folder is on the path when run as a script)


def model_dir(layers, hidden, heads, kv_heads, intermediate, vocab):

    def build(path):
        import torch
        from transformers import Qwen2Config, Qwen2ForCausalLM

        tok = models.tiny_tokenizer()
        config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                             num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                             max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id, bos_token_id=None, dtype="bfloat16")
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).save_pretrained(path)
        tok.save_pretrained(path)

    return models.build_once(f"bench-qwen2-{layers}x{hidden}-v{vocab}", build)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5, help="train.py steps; the first is warm-up")
    p.add_argument("--nproc", type=int, default=1, help="ranks; more than 1 runs train.py under torchrun")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per device")
    add_shape_args(p, layers=24, hidden=896, heads=14, kv_heads=2, intermediate=4864)  # Qwen2.5-0.5B's
    args, train_args = p.parse_known_args(argv)
    if args.steps < 2:
        p.error("--steps must be at least 2 (the first step is warm-up)")
    model = model_dir(*shape(args))
    out = tempfile.mkdtemp(prefix="bench-gpu-")
    launch = [sys.executable] if args.nproc == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                        "--nproc_per_node", str(args.nproc)]
    cmd = launch + [os.path.join(ROOT, "train.py"), "--preset", "smoke", "--model", model,
           "--max-steps", str(args.steps), "--save-every", "0", "--samples-every", "0", "--output-dir", out] + train_args
    if "--dtype" not in train_args:
        cmd += ["--dtype", "auto"]  # bf16 on an accelerator
    subprocess.run(cmd, check=True, cwd=ROOT)
    rows = read_run(out)[1:]
    shutil.rmtree(out, ignore_errors=True)  # the run's last checkpoint

    def med(key):
        return statistics.median(r[key] for r in rows)

    tflops = med("throughput/update_tflops_per_device")
    print(f"\nQwen2 {args.layers} layers x {args.hidden}, vocab {args.vocab}; train.py {' '.join(train_args) or '(smoke preset)'}")
    print(f"median of {len(rows)} steps after warm-up:")
    print(f"  seconds per step      {med('time/step'):.3f}  (generate {med('time/generate'):.3f}, "
          f"log-probs {med('time/logprob'):.3f}, update {med('time/update'):.3f}, weight sync {med('time/sync'):.3f})")
    print(f"  generated tokens/s    {med('throughput/gen_tokens_per_s'):.0f}")
    print(f"  update tokens/s       {med('throughput/update_tokens_per_s'):.0f}")
    print(f"  update TFLOP/s/device {tflops:.1f}  -> MFU {100 * tflops / args.peak_tflops:.1f}% of {args.peak_tflops:g}")


if __name__ == "__main__":
    main()
