"""One optimizer step of TRL's own GRPOTrainer and of minigdpo's update, on the same fixed completions.

    python tests/trl_oracle.py fixtures WORK   # the tiny models, prompts, completions and rewards
    python tests/trl_oracle.py trl WORK        # TRL 1.16: GRPOTrainer.train() for one step, per case
    python tests/trl_oracle.py mini WORK       # minigdpo: update on TRL's micro-batches, per case

A case is a loss aggregation (TRL's loss_type name) and a number of micro-batches (CASES).

tests/test_trl_oracle.py runs these and compares the advantages, the loss and every parameter's
gradient. Each part runs in its own process: accelerate's state and minigdpo's process group never
meet. TRL is a test-time oracle only (the `test` extra); the package never imports it.

The setting: 2 prompts x G=4 completions of 1-8 tokens, 3 rewards on unequal scales (0/1, ~10, ~0.01,
the first constant in one group) with weights 1, 0.5, 2, GDPO advantages (TRL's
multi_objective_aggregation="normalize_then_sum"), beta 0.04 against a reference that differs from
the policy (else the KL gradient is 0 at the first step), fp32 on the CPU, clipping off.
TRL 1.16 settings that differ from the paper's trl-0.18 and are set here to the paper's:
use_bias_correction_kl=False (trl-0.18 has no such term: the k3 KL is not multiplied by the ratio).
TRL cuts a random permutation of the generation batch into micro-batches (shuffle_sequence_dict);
for the micro-batch-dependent aggregation (bnpo) minigdpo is given TRL's own micro-batches.
"""

import json
import os
import sys

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

import torch  # noqa: E402
from microbatches import micro_batches  # noqa: E402
from minigdpo.update import fill_logprobs, step_metrics, update  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

B, G, MAX_LEN, BETA, WEIGHTS = 2, 4, 8, 0.04, [1.0, 0.5, 2.0]
CASES = [(loss_type, ga) for loss_type in ("bnpo", "dapo", "grpo", "dr_grpo") for ga in (1, 2)]
AGG = {"grpo": "seq_mean_token_mean", "bnpo": "micro_batch_token_mean", "dr_grpo": "seq_mean_token_sum_norm",
       "dapo": "token_mean"}


def fixtures(work):
    """A tiny random Llama (policy), a perturbed copy (reference), fixed prompts, completions and rewards."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from minigdpo.models import tiny_tokenizer

    tok = tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         bos_token_id=None)
    torch.manual_seed(0)
    lm = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the default init: log-probs far from uniform
        for name, p in lm.named_parameters():
            if "norm" not in name:
                p.mul_(4.0)
    for name in ("policy", "ref"):
        lm.save_pretrained(os.path.join(work, name))
        tok.save_pretrained(os.path.join(work, name))
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in lm.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 3)]
    completions = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (3, 6, 1, 8, 5, 2, 7, 3)]
    rewards = [[1.0, 12.0, 0.010], [0.0, 3.0, 0.030], [1.0, 7.0, 0.020], [0.0, 15.0, 0.000],  # (B*G, 3), p*G + j
               [0.0, 2.0, 0.015], [0.0, 9.0, 0.005], [0.0, 4.0, 0.025], [0.0, 11.0, 0.000]]
    with open(os.path.join(work, "fixtures.json"), "w") as f:
        json.dump({"prompts": prompts, "completions": completions, "rewards": rewards, "pad_id": tok.pad_token_id}, f)


def load(work):
    with open(os.path.join(work, "fixtures.json")) as f:
        return json.load(f)


def trl_step(work, loss_type, ga):
    """GRPOTrainer.train() for exactly one optimizer step, completions fed through rollout_func."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from minigdpo.models import tiny_tokenizer

    fx = load(work)
    texts = [f"prompt{p}" for p in range(B)]
    index_of = {tuple(c): i for i, c in enumerate(fx["completions"])}
    order = []  # each generated row's index p * G + j

    def rollout_func(prompts, trainer):  # TRL repeats each prompt G times
        seen, out = {}, {"prompt_ids": [], "completion_ids": [], "logprobs": None}
        for text in prompts:
            p = texts.index(text)
            j = seen[p] = seen.get(p, -1) + 1
            order.append(p * G + j)
            out["prompt_ids"].append(list(fx["prompts"][p]))
            out["completion_ids"].append(list(fx["completions"][p * G + j]))
        return out

    def reward(k):
        def fn(prompts, completions, completion_ids, **kwargs):
            return [fx["rewards"][index_of[tuple(c)]][k] for c in completion_ids]
        fn.__name__ = f"reward{k}"
        return fn

    class Recorder(TrainerCallback):
        grads, logs = None, {}

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.update(logs or {})  # the step's log, then train()'s summary

    micro = []

    class Trainer(GRPOTrainer):
        def _compute_loss(self, model, inputs):  # records which rows each micro-batch holds
            micro.append([index_of[tuple(ids[m.bool()].tolist())]
                          for ids, m in zip(inputs["completion_ids"], inputs["completion_mask"])])
            return super()._compute_loss(model, inputs)

    args = GRPOConfig(
        output_dir=os.path.join(work, "trl"), use_cpu=True, bf16=False, fp16=False, seed=42,
        per_device_train_batch_size=B * G // ga, gradient_accumulation_steps=ga, num_generations=G,
        max_completion_length=MAX_LEN, beta=BETA, epsilon=0.2, loss_type=loss_type, temperature=1.0,
        multi_objective_aggregation="normalize_then_sum", reward_weights=WEIGHTS,
        use_bias_correction_kl=False,  # trl-0.18, the paper's, has no such term
        gradient_checkpointing=False, learning_rate=1e-3, lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=0.0, max_steps=1, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, model_init_kwargs={"dtype": torch.float32})
    recorder = Recorder()
    trainer = Trainer(model=os.path.join(work, "policy"), reward_funcs=[reward(k) for k in range(3)], args=args,
                      train_dataset=Dataset.from_dict({"prompt": texts}), processing_class=tiny_tokenizer(),
                      rollout_func=rollout_func, callbacks=[recorder])
    trainer.remove_callback(PrinterCallback)
    ref = AutoModelForCausalLM.from_pretrained(os.path.join(work, "ref"), dtype=torch.float32)
    trainer.ref_model.load_state_dict(ref.state_dict())
    trainer.train()
    adv = torch.zeros(B * G)
    adv[torch.tensor(order)] = torch.tensor(list(trainer._logs["advantages"]))
    torch.save({"adv": adv, "loss": recorder.logs["loss"], "micro": micro, "grads": recorder.grads},
               os.path.join(work, f"trl_{loss_type}_{ga}.pt"))


class GradCapture:
    """The optimizer update steps: step() keeps the whole gradients instead of moving the weights."""

    defaults = {"fused": True}  # the step skips itself as fused AdamW does (update.skip_if_not_finite): it is never run

    def __init__(self, model):
        self.model, self.grads = model, None

    def zero_grad(self, set_to_none=True):
        for p in self.model.parameters():
            p.grad = None

    def step(self):
        from minigdpo import dist

        self.grads = {n.removeprefix("lm."): dist.full_tensor(p.grad).clone()
                      for n, p in self.model.named_parameters() if p.grad is not None}


def mini_step(work, loss_type, ga, model, ref):
    """minigdpo's advantages (gdpo) and one update on TRL's micro-batches, each as one of ours."""
    from types import SimpleNamespace

    from minigdpo import dist
    from minigdpo.advantages import gdpo
    from minigdpo.config import Config
    from minigdpo.sampler import Completion

    fx = load(work)
    micro = torch.load(os.path.join(work, f"trl_{loss_type}_{ga}.pt"))["micro"]
    device = dist.device()
    rewards = torch.tensor(fx["rewards"], dtype=torch.float64).view(B, G, 3)
    adv = gdpo(rewards, torch.tensor(WEIGHTS, dtype=torch.float64)).reshape(-1).float()
    prompts = [fx["prompts"][i // G] for i in range(B * G)]
    comps = [Completion(c, [0.0] * len(c)) for c in fx["completions"]]
    batches = [micro_batches([prompts[i] for i in rows], [comps[i] for i in rows], adv[rows], len(rows),
                                   fx["pad_id"], device, 1)[0] for rows in micro]
    cfg = Config(num_iterations=1, temperature=1.0, logprob_chunk=1024, importance_sampling_cap=0.0, clip_low=0.2, clip_high=0.2,
                 beta=BETA, loss_agg=AGG[loss_type], max_new_tokens=MAX_LEN, max_grad_norm=0.0, grad_checkpointing="false")
    fill_logprobs(ref, batches, "ref_logp", cfg, reshard=True)
    opt = GradCapture(model)
    totals = update(model, opt, SimpleNamespace(step=lambda: None), batches, cfg)
    torch.save({"adv": adv, "loss": step_metrics(totals)["loss"], "grads": opt.grads},
               os.path.join(work, f"mini_{loss_type}_{ga}.pt"))


def trl(work):
    for case in CASES:
        trl_step(work, *case)


def mini(work):
    """Every case from the same weights (the update never steps the optimizer), in one process group."""
    from minigdpo import dist, policy

    device = dist.init()
    model = policy.build(os.path.join(work, "policy"), device, torch.float32)
    ref = policy.build(os.path.join(work, "ref"), device, torch.float32, frozen=True)
    for case in CASES:
        mini_step(work, *case, model, ref)


if __name__ == "__main__":
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(2)
    part, work = sys.argv[1:]
    {"fixtures": fixtures, "trl": trl, "mini": mini}[part](work)
    if part == "mini":
        from minigdpo import dist

        dist.cleanup()  # once mini's sharded models are gone: they hold the group
