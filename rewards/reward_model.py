"""Reward models as rewards: `model:<hub name or directory>[@<label>[:logit]]`, beside the rule-based ones.

    --rewards correct,format,model:OpenAssistant/reward-model-deberta-v3-large-v2,model:/models/guard@safe

A reward model is a sequence-classification model (AutoModelForSequenceClassification) with its own
tokenizer. Each completion is scored as the conversation it ends: the prompt's messages, then the
completion as the assistant's turn, written with the reward model's own chat template, so a reward model
need not share the policy's tokenizer or template. One score per completion:

| the model's labels      | spec                      | score                                                         |
|-------------------------|---------------------------|---------------------------------------------------------------|
| one (a scalar reward)   | model:PATH                | its logit                                                     |
| several (a classifier)  | model:PATH@LABEL          | LABEL's probability: softmax over the labels, or sigmoid when |
|                         |                           | the config's problem_type is multi_label_classification       |
|                         | model:PATH@LABEL:logit    | LABEL's logit                                                 |

LABEL is a name from the config's id2label, or an index. A path that is not a sequence-classification
model, a label it does not have, or a tokenizer without a chat template is refused before training starts.

Scoring (the scorer's `prepare` hook, once per batch): a rank's completions in batches of
--reward-model-batch-size, right-padded, on the trainer's device in its compute dtype. A conversation
longer than the reward model's limit (its tokenizer's model_max_length, else max_position_embeddings)
keeps its last tokens, where the reward model reads its score, and is counted (reward/<name>/truncated).
A non-finite score is None, counted as the scorer counts any invalid value. An out-of-memory error stops
the run with one line naming the flags that lower the memory.

Where the weights live (--reward-model-placement):
- resident: the whole model on each rank's device, all run long (fast; one full copy per rank);
- offload: in CPU memory between scorings, moved to the device for each batch of scoring and back, so it
  holds device memory only while it scores (a host-device copy of its weights per step);
- shard: FSDP2 over the ranks, as the frozen reference is (minigdpo/policy.py): each rank keeps 1/world of
  the weights and gathers one layer at a time while scoring. Every rank then scores in lock-step, the
  same number of batches, which the trainer's equal per-rank shares guarantee;
- auto (default): shard when the run has more than one rank, else resident.
The reward model never enters a checkpoint: it is not part of the trained state.
"""

import time

import torch

_LOADED = {}  # spec -> ModelReward: one copy per process, however many scorers name it


class RewardModelError(ValueError):
    """A reward model that cannot be used (refused before training) or that ran out of memory."""


def parse(spec):
    """'model:PATH@LABEL:logit' -> (PATH, LABEL or None, 'logit' or 'prob')."""
    body = spec[len("model:"):]
    path, _, label = body.rpartition("@") if "@" in body else (body, "", "")
    label, _, kind = label.partition(":")
    if not path or kind not in ("", "logit"):
        raise RewardModelError(f"bad reward model {spec!r}: expected model:PATH, model:PATH@LABEL or model:PATH@LABEL:logit")
    return path, label or None, kind or "prob"


def get(spec):
    """The ModelReward for `spec`, one per process (its weights load on place() or first use)."""
    if spec not in _LOADED:
        _LOADED[spec] = ModelReward(spec)
    return _LOADED[spec]


class ModelReward:
    """fn(completion, example) -> the score `prepare` computed for it in a batch."""

    def __init__(self, spec):
        """Reads the config and tokenizer only: a bad path or label is refused before any weights load."""
        from transformers import AutoConfig, AutoTokenizer

        self.spec, self.model, self.stats, self._scores = spec, None, {}, {}
        self.path, label, self.kind = parse(spec)
        try:
            self.config = AutoConfig.from_pretrained(self.path)
            self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        except (OSError, ValueError) as e:
            raise RewardModelError(f"reward model {spec!r}: cannot load {self.path!r} ({str(e).splitlines()[0]})") from None
        archs = self.config.architectures or []
        if not any(a.endswith("ForSequenceClassification") for a in archs):
            raise RewardModelError(f"reward model {spec!r}: {self.path} is a {', '.join(archs or ['model'])}, "
                                   "not a sequence-classification model (AutoModelForSequenceClassification)")
        if not self.tokenizer.chat_template:
            raise RewardModelError(f"reward model {spec!r}: its tokenizer has no chat template to write the conversation")
        self.column = self._label_column(self.config, label)
        self.multi_label = self.config.problem_type == "multi_label_classification"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.config.pad_token_id is None:
            self.config.pad_token_id = self.tokenizer.pad_token_id
        limit = self.tokenizer.model_max_length
        self.max_len = limit if limit and limit < 10**7 else getattr(self.config, "max_position_embeddings", 2048)

    def place(self, device=None, dtype=None, batch_size=8, placement="resident", shard_build=None):
        """Load the weights where --reward-model-placement says (the module docstring), once. Without a device
        (eval.py's scorer, on first use): this rank's accelerator if there is one, in bf16, else the CPU in fp32.
        shard_build(path, config, device, dtype) builds the sharded model (train.py passes policy.build_classifier)."""
        from minigdpo import dist

        if self.model is not None:
            return
        if device is None:
            device = dist.device() if dist.is_initialized() else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
        self.device, self.dtype, self.batch_size = torch.device(device), dtype, batch_size
        sharded = dist.is_initialized() and dist.world_size() > 1
        self.placement = ("shard" if sharded else "resident") if placement == "auto" else placement
        if self.placement == "shard" and (not dist.is_initialized() or shard_build is None):
            self.placement = "resident"  # one process with no process group (eval.py): nothing to shard over
        self.model = self._build(self.path, self.config, shard_build)
        # This rank's device memory for the weights, fixed once placed (0 between steps when offloaded).
        local = [p.to_local() if hasattr(p, "to_local") else p for p in self.model.parameters()]
        self.gib = 0.0 if self.placement == "offload" else sum(t.numel() * t.element_size() for t in local) / 2**30

    @staticmethod
    def _label_column(config, label):
        names = [config.id2label[i] for i in range(config.num_labels)] if config.id2label else []
        if label is None:
            if config.num_labels != 1:
                raise RewardModelError(f"reward model has {config.num_labels} labels ({', '.join(map(str, names))}): "
                                       "pick one with model:PATH@LABEL")
            return 0
        if label in names:
            return names.index(label)
        if label.isdigit() and int(label) < config.num_labels:
            return int(label)
        raise RewardModelError(f"reward model has no label {label!r}; its labels: {', '.join(map(str, names))}")

    def _build(self, path, config, shard_build):
        from transformers import AutoModelForSequenceClassification

        if self.placement != "shard":
            model = AutoModelForSequenceClassification.from_pretrained(path, config=config, dtype=self.dtype)
            return model.to("cpu" if self.placement == "offload" else self.device).eval().requires_grad_(False)
        try:
            return shard_build(path, config, self.device, self.dtype)
        except ValueError as e:
            raise RewardModelError(str(e)) from None

    def encode(self, messages, completion):
        """The conversation's token ids in the reward model's template, cut from the left to its limit."""
        text = self.tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": completion}], tokenize=False)
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        return ids[-self.max_len:], len(ids) > self.max_len

    def score(self, conversations):
        """Scores of token-id lists, (N,) float64, batch by batch."""
        out = []
        pad = self.tokenizer.pad_token_id
        for start in range(0, len(conversations), self.batch_size):
            batch = conversations[start:start + self.batch_size]
            width = max(len(ids) for ids in batch)
            ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids in batch], device=self.device)
            mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in batch], device=self.device)
            logits = self.model(input_ids=ids, attention_mask=mask).logits.float()         # (b, labels)
            if self.kind == "prob" and logits.shape[-1] > 1:
                logits = logits.sigmoid() if self.multi_label else logits.softmax(-1)
            out.append(logits[:, self.column].double().cpu())
        if self.placement == "shard":
            from minigdpo import dist

            dist.reshard(self.model)  # no backward follows: free the root's gathered weights now
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)

    def prepare(self, completions, examples):
        """The scorer's batch hook: score every (prompt, completion) of the batch at once."""
        self.place()  # a no-op once train.py placed it; eval.py's scorer loads it here
        t0 = time.perf_counter()
        encoded = [self.encode(ex["messages"], c) for c, ex in zip(completions, examples)]
        if self.placement == "offload":
            self.model.to(self.device)
        try:
            with torch.no_grad():
                scores = self.score([ids for ids, _ in encoded])
        except torch.OutOfMemoryError:
            raise RewardModelError(f"reward model {self.spec!r} ran out of memory scoring batches of {self.batch_size}: "
                                   "lower --reward-model-batch-size, or set --reward-model-placement offload or shard")
        finally:
            if self.placement == "offload":
                self.model.to("cpu")
        self._scores = {(c, id(ex)): s for c, ex, s in zip(completions, examples, scores.tolist())}
        self.stats = {"truncated": sum(cut for _, cut in encoded), "model_seconds": time.perf_counter() - t0,
                      "model_gib": self.gib}

    def __call__(self, completion, example):
        return self._scores[completion, id(example)]  # a non-finite score: the scorer counts it as invalid (None)
