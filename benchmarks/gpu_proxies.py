"""What a GPU run would pay, counted exactly on CPU: one training step on 2 gloo ranks in bf16.

    torchrun --nproc_per_node 2 benchmarks/gpu_proxies.py            # ~2-3 minutes on 2 busy cores
    torchrun --nproc_per_node 2 benchmarks/gpu_proxies.py --vocab 4096 --hidden 64   # seconds

No GPU can be timed here, but these figures are counts, not timings, and a GPU pays for each of
them: collectives and the bytes they move, matmul FLOPs by dtype (an fp32 matmul runs at about
1/15 of bf16 speed on an H100), parameters held between phases, host syncs per generated token,
host memory at start-up and the exported checkpoint's size. Each is printed against its floor.

The model is a random Qwen2 with a large vocabulary (the head dominates, as in Qwen2.5-1.5B),
saved in bf16 as Qwen's checkpoints are, built once into the cache before the process group exists.

How each figure is counted:
- collectives: FSDP2's own `foreach_all_gather` / `foreach_reduce`, wrapped where
  torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py looks them up (torch 2.13);
- matmul FLOPs: a TorchDispatchMode over aten.mm, aten.addmm and aten.bmm, by input dtype;
- resident bytes: each FSDP2 parameter's shard, plus its whole tensor while it is unsharded;
- host syncs: aten._local_scalar_dense (bool(), .item()) inside the sampler, per decode step;
- start-up memory: the rise of the process's peak RSS (VmHWM, reset before the build).
"""

import argparse
import json
import os
import re
import sys
import tempfile

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from minigdpo import checkpoint, dist, logprobs, models, policy  # noqa: E402
from minigdpo.config import Config  # noqa: E402
from minigdpo.sampler import Completion, HFSampler, SamplingParams, sync_every  # noqa: E402
from tests.microbatches import micro_batches  # noqa: E402
from minigdpo.update import fill_logprobs, optimizer, scheduler, update  # noqa: E402

MB = 1024**2
SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def model_dir(layers, hidden, heads, kv_heads, intermediate, vocab):
    """A random Qwen2 checkpoint stored in bf16 (config dtype bfloat16), as Qwen2.5's are."""

    def build(path):
        from transformers import Qwen2Config, Qwen2ForCausalLM

        tok = models.tiny_tokenizer()
        config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                             num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                             max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id, bos_token_id=None)
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
        tok.save_pretrained(path)

    return models.build_once(f"proxy-qwen2-{layers}x{hidden}-i{intermediate}-v{vocab}-bf16", build)


def add_shape_args(parser, layers, hidden, heads, kv_heads, intermediate, vocab=151936):
    """The random Qwen2's shape as flags (--layers, --hidden, ...), with these defaults; model_dir takes them."""
    for flag, default in (("layers", layers), ("hidden", hidden), ("heads", heads), ("kv-heads", kv_heads),
                          ("intermediate", intermediate), ("vocab", vocab)):
        parser.add_argument(f"--{flag}", type=int, default=default)


def shape(args):
    """model_dir's arguments from add_shape_args's flags."""
    return args.layers, args.hidden, args.heads, args.kv_heads, args.intermediate, args.vocab


# Counters ---------------------------------------------------------------------------------------

class Collectives:
    """Counts FSDP2's all-gathers and reduce-scatters per parameter group, with the bytes gathered."""

    def __init__(self):
        # Where FSDP2 (torch 2.13, fsdp/_fully_shard/_fsdp_param_group.py) looks up its collectives.
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

        self.pg, self.gathers, self.reduces, self.gathered_bytes = pg, {}, {}, 0
        self.orig = pg.foreach_all_gather, pg.foreach_reduce

    @staticmethod
    def group(fsdp_params):
        m = re.search(r"layers\.(\d+)\.", fsdp_params[0]._param_fqn or "")
        return f"layer{m.group(1)}" if m else "root"

    def __enter__(self):
        gather, reduce = self.orig

        def counted_gather(fsdp_params, *args, **kwargs):
            result = gather(fsdp_params, *args, **kwargs)
            name = self.group(fsdp_params)
            self.gathers[name] = self.gathers.get(name, 0) + 1
            out = result.all_gather_output
            self.gathered_bytes += out.numel() * out.element_size()
            return result

        def counted_reduce(fsdp_params, *args, **kwargs):
            name = self.group(fsdp_params)
            self.reduces[name] = self.reduces.get(name, 0) + 1
            return reduce(fsdp_params, *args, **kwargs)

        self.pg.foreach_all_gather, self.pg.foreach_reduce = counted_gather, counted_reduce
        return self

    def __exit__(self, *exc):
        self.pg.foreach_all_gather, self.pg.foreach_reduce = self.orig

    def per_layer(self, counts):
        layers = [v for k, v in counts.items() if k.startswith("layer")]
        return sum(layers) / max(1, len(layers))


class MatmulFlops(TorchDispatchMode):
    """FLOPs of every mm / addmm / bmm, keyed by the dtype of its inputs; `big` notes the largest fp32 ones."""

    OPS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm}

    def __init__(self):
        super().__init__()
        self.flops, self.fp32_shapes = {}, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in self.OPS:
            a, b = (args[1], args[2]) if func.overloadpacket is torch.ops.aten.addmm else (args[0], args[1])
            flops = 2 * a.numel() * b.shape[-1]                            # 2 x (batch) x m x k x n
            self.flops[a.dtype] = self.flops.get(a.dtype, 0) + flops
            if a.dtype == torch.float32:
                key = (tuple(a.shape), tuple(b.shape))
                self.fp32_shapes[key] = self.fp32_shapes.get(key, 0) + flops
        return func(*args, **(kwargs or {}))

    def fp32_share(self):
        return self.flops.get(torch.float32, 0) / max(1, sum(self.flops.values()))


class HostSyncs(TorchDispatchMode):
    """Host syncs: reading a tensor's value on the host (bool(), int(), .item()) waits for the device."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def peak_rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def resident_bytes(model):
    """(bytes this rank holds for a sharded model's parameters, of which gathered whole tensors):
    every FSDP2 parameter's shard, plus its whole tensor while it is unsharded. Reads FSDP2's private
    state (torch 2.13, fsdp/_fully_shard/_fsdp_param.py): a probe for this benchmark and its test."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    total = whole = 0
    for m in model.modules():
        group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
        for p in group.fsdp_params if group else []:
            local = p.sharded_param._local_tensor
            total += local.numel() * local.element_size()
            if p.sharded_state == ShardedState.UNSHARDED:
                n = p._orig_size.numel() * (p.param_dtype or local.dtype).itemsize
                total, whole = total + n, whole + n
    return total, whole


# The step ----------------------------------------------------------------------------------------

def batch(args, device):
    """This rank's prompts (args.prompts, G completions each) in micro-batches of args.micro_batch."""
    g = torch.Generator().manual_seed(1000 + dist.rank())
    prompts = [torch.randint(0, 250, (args.prompt_len - int(torch.randint(0, 4, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(args.prompts)]
    prompts = [p for p in prompts for _ in range(args.group)]
    comps = []
    for _ in prompts:
        n = args.completion_len - int(torch.randint(0, 8, (1,), generator=g))
        comps.append(Completion(torch.randint(0, 250, (n,), generator=g).tolist(), [-1.0] * n))
    adv = torch.randn(len(comps), generator=g)
    return micro_batches(prompts, comps, adv, args.micro_batch, 257, device, args.group)


def step_cfg(args):
    return Config(num_iterations=1, temperature=1.0, logprob_chunk=args.chunk, importance_sampling_cap=0.0, clip_low=0.2,
                  clip_high=0.2, beta=0.04, loss_agg="token_mean", max_new_tokens=args.completion_len,
                  max_grad_norm=1.0, grad_checkpointing="false")


def prefix_gradients_match(path, device, mb, args):
    """Max |grad(shared prefix) - grad(full sequences)| / max |grad| over this rank's shards, in fp32."""
    model = policy.build(path, device, torch.float32)
    grads = []
    for share in (True, False):
        model.zero_grad(set_to_none=True)
        model.fast = share  # False: the model's own forward on one full sequence per completion (LogProbModel.forward)
        logp = model(mb, 1.0, args.chunk, False)                                       # (n, T)
        (logp * mb.adv[:, None]).sum().backward()
        grads.append([p.grad.to_local().clone() for p in model.parameters()])
    diff = max((a - b).abs().max().item() for a, b in zip(*grads))
    scale = max(b.abs().max().item() for b in grads[1])
    return dist.all_reduce(torch.tensor([diff / scale]), op="max").item()


def sampler_syncs_per_token(path, dtype, args):
    """Host syncs per decode step: the difference between two lengths cancels the per-row epilogue."""
    lm = models.load_model(path, dtype)
    unreachable = lm.config.vocab_size  # a stop id no row can draw: every row runs to max_new_tokens
    sampler = HFSampler(lm, [unreachable], 257, torch.device("cpu"))
    sampler.sync_every = sync_every(torch.device("cuda"))  # what it does on a GPU (on the CPU it checks every step)
    prompts = [[10, 11, 12], [20, 21]]
    counts = []
    for length in (16, 48):
        with HostSyncs() as syncs:
            sampler.generate(prompts, 2, SamplingParams(temperature=1.0, max_new_tokens=length, seed=1))
        counts.append(syncs.count)
    return (counts[1] - counts[0]) / 32


def export_figures(model, tokenizer, path, source, args):
    """Write the HF export as train.py does; its dtype, config dtype, shard files and full tensors held."""
    from safetensors import safe_open
    from transformers import AutoConfig

    save_dtype = models.source_dtype(source)  # as train.py does
    held = {"files": [], "full_bytes": 0}
    orig_save, orig_full = checkpoint.save_file, dist.full_tensor

    def save_file(tensors, filename, metadata=None):
        held["files"].append((sum(t.numel() * t.element_size() for t in tensors.values()), len(tensors)))
        return orig_save(tensors, filename, metadata=metadata)

    def full_tensor(t, *args, **kwargs):
        out = orig_full(t, *args, **kwargs)
        held["full_bytes"] += out.numel() * out.element_size() if out is not None else 0
        return out

    checkpoint.save_file, dist.full_tensor = save_file, full_tensor
    max_shard, checkpoint.MAX_SHARD_BYTES = checkpoint.MAX_SHARD_BYTES, args.export_shard_mb * MB
    try:
        error = checkpoint._write_hf(model, tokenizer, path, save_dtype)
    finally:
        checkpoint.save_file, dist.full_tensor, checkpoint.MAX_SHARD_BYTES = orig_save, orig_full, max_shard
    assert not error, error
    dist.barrier()
    dtypes, nbytes = set(), 0
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            nbytes += os.path.getsize(os.path.join(path, name))
            with safe_open(os.path.join(path, name), "pt") as f:
                dtypes |= {SAFETENSORS_DTYPES.get(f.get_slice(k).get_dtype(), "?") for k in f.keys()}
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config_dtype = config.get("dtype", config.get("torch_dtype"))
    return {"source": str(AutoConfig.from_pretrained(source).dtype).replace("torch.", ""), "weights": sorted(dtypes),
            "config": config_dtype, "bytes": nbytes, "files": held["files"], "full_bytes": held["full_bytes"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(p, layers=3, hidden=256, heads=4, kv_heads=2, intermediate=1024)
    p.add_argument("--prompts", type=int, default=2, help="prompts per rank")
    p.add_argument("--group", type=int, default=4, help="completions per prompt")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--completion-len", type=int, default=32)
    p.add_argument("--chunk", type=int, default=64, help="--logprob-chunk")
    p.add_argument("--export-shard-mb", type=int, default=32, help="safetensors file size limit for the export")
    args = p.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    path = model_dir(*shape(args))
    device = dist.init()
    world, dtype = dist.world_size(), torch.bfloat16
    tokenizer = models.load_tokenizer(path)
    rows = []

    def row(figure, value, floor, ok):
        rows.append((figure, value, floor, "yes" if ok else "NO"))

    # Start-up: the rise of peak host memory while each model is built and sharded. A model on the
    # meta device first imports its modelling code, whose memory is no part of the model's.
    models.empty_model(path, dtype)
    base = rss_mb()
    reset_peak()
    model = policy.build(path, device, dtype)
    peak_model = peak_rss_mb() - base
    base = rss_mb()
    reset_peak()
    ref = policy.build(path, device, dtype, frozen=True)
    peak_ref = peak_rss_mb() - base
    layer_params = sum(p.numel() for p in logprobs.decoder_layers(model.lm)[0].parameters())
    n_params = sum(p.numel() for p in model.parameters())
    fp32_mb, layer_mb = n_params * 4 / MB, layer_params * 4 / MB
    floor = 1.5 * fp32_mb / world + layer_mb
    peaks = dist.all_gather(torch.tensor([peak_model, peak_ref]))                # (world * 2,)
    row("start-up peak host memory per rank, policy (MB)", f"{peaks[0::2].max().item():.0f}", f"<= {floor:.0f}",
        peaks[0::2].max().item() <= floor)
    row("start-up peak host memory per rank, reference (MB)", f"{peaks[1::2].max().item():.0f}",
        f"<= {floor / 2:.0f} (bf16)", peaks[1::2].max().item() <= floor / 2)

    # The step: reference pass, then one update, with prefix sharing on (train.py's default).
    cfg, batches = step_cfg(args), batch(args, device)
    fill_logprobs(ref, batches, "ref_logp", cfg, reshard=True)
    bf16_bytes = n_params * 2
    for label, r in (("", ref), (" --ref-offload", None)):
        if r is None:
            r = policy.build(path, device, dtype, frozen=True, offload=True)
            fill_logprobs(r, batches, "ref_logp_offload", cfg, reshard=True)
        total, whole = resident_bytes(r)
        floor = bf16_bytes / world + layer_params * 2
        row(f"reference bytes resident per rank after its pass{label} (MB)", f"{total / MB:.1f} "
            f"({whole / MB:.1f} unsharded)", f"<= {floor / MB:.1f}", total <= floor)
    opt = optimizer(model, 1e-5, 0.0)
    sched = scheduler(opt, 10, 0.0, "constant")
    with Collectives() as coll, MatmulFlops() as flops:
        update(model, opt, sched, batches, cfg)
    n_mb = len(batches)
    per_layer = coll.per_layer(coll.gathers) / n_mb
    grad_diff = prefix_gradients_match(path, device, batches[0], args)
    row("all-gathers per decoder layer per micro-batch (prefix sharing)",
        f"{per_layer:g} (grad diff {grad_diff:.1e})", "2, grad diff <= 1e-5", per_layer <= 2 and grad_diff <= 1e-5)
    row("reduce-scatters per decoder layer per micro-batch", f"{coll.per_layer(coll.reduces) / n_mb:g}", "1",
        coll.per_layer(coll.reduces) / n_mb <= 1)
    floor = bf16_bytes * 2 * n_mb
    row("bytes all-gathered per rank per step (MB)", f"{coll.gathered_bytes / MB:.1f}", f"<= {floor / MB:.1f}",
        coll.gathered_bytes <= floor)
    top = max(flops.fp32_shapes.items(), key=lambda kv: kv[1], default=(None, 0))
    row("share of matmul FLOPs in fp32 (bf16 compute)", f"{100 * flops.fp32_share():.2f}%"
        + (f" (largest {top[0][0]} @ {top[0][1]})" if top[0] else ""), "<= 1%", flops.fp32_share() <= 0.01)

    # Sampling and export.
    syncs = sampler_syncs_per_token(path, dtype, args)
    row("HF sampler host syncs per generated token", f"{syncs:g}", "<= 1/16", syncs <= 1 / 16)
    out = dist.broadcast_object(tempfile.mkdtemp(prefix="proxy-export-"))
    ex = export_figures(model, tokenizer, out, path, args)
    ok = ex["weights"] == [ex["source"]] and ex["config"] == ex["source"]
    row("HF export dtype: weights / config.json (source)", f"{'/'.join(ex['weights'])} / {ex['config']} "
        f"({ex['source']}, {ex['bytes'] / MB:.0f} MB)", "the source's", ok)
    biggest, n = max(ex["files"]) if ex["files"] else (0, 0)
    row("HF export: most bytes rank 0 holds at once (MB)", f"{biggest / MB:.1f} in {len(ex['files'])} files",
        f"<= one file ({args.export_shard_mb} MB or 1 tensor)", biggest <= args.export_shard_mb * MB or n == 1)
    rank1 = dist.all_gather(torch.tensor([float(ex["full_bytes"])]))[-1].item()
    row("HF export: whole tensors gathered on the last rank (MB)", f"{rank1 / MB:.1f}", "0 (only rank 0 writes)",
        rank1 == 0)

    if dist.is_main():
        print(f"\nQwen2 {args.layers} layers x {args.hidden}, vocab {args.vocab}: {n_params / 1e6:.1f}M parameters, "
              f"{world} ranks, bf16, {n_mb} micro-batches of {args.micro_batch} per rank")
        w = max(len(r[0]) for r in rows)
        print(f"{'figure':<{w}}  {'measured':<40} {'floor':<28} met")
        for figure, value, floor, ok in rows:
            print(f"{figure:<{w}}  {value:<40} {floor:<28} {ok}")


if __name__ == "__main__":
    main()
    dist.cleanup()  # once main's sharded models are gone: they hold the group
