"""Reward models as rewards: `model:<hub name or directory>[@<label>[:logit]]`, beside the rule-based ones.

    --rewards correct,format,model:OpenAssistant/reward-model-deberta-v3-large-v2,model:/models/guard@safe

A reward model is a sequence-classification model (AutoModelForSequenceClassification) with its own
tokenizer. Each completion is scored as the conversation it ends: the prompt's messages, then the
completion as the assistant's turn, written with the reward model's own chat template, so a reward model
need not share the policy's tokenizer or template. A tokenizer without a chat template (encoder reward
models such as BERT's and DeBERTa's, which take a question and an answer) gets the text pair (the messages'
contents joined by blank lines, the completion) with its own special tokens. One score per completion:

| the model's labels      | spec                      | score                                                         |
|-------------------------|---------------------------|---------------------------------------------------------------|
| one (a scalar reward)   | model:PATH                | its logit                                                     |
| several (a classifier)  | model:PATH@LABEL          | LABEL's probability: softmax over the labels, or sigmoid when |
|                         |                           | the config's problem_type is multi_label_classification       |
|                         | model:PATH@LABEL:logit    | LABEL's logit                                                 |

LABEL is a name from the config's id2label, or an index. Refused before training starts, in one line: a path
that is not a sequence-classification model, a label it does not have, a tokenizer that does not load, and a
chat template that cannot write a conversation of the task's own shape (check_conversation: a template that
refuses a system turn, as Gemma's does, would otherwise fail at every step and leave the reward NaN).

Scoring (the scorer's `prepare` hook, once per batch): a rank's completions in batches of
--reward-model-batch-size, right-padded with the id the model itself takes for padding (its config's
pad_token_id: transformers' classifiers read the score at the last token that is not that id, so a
conversation scores the same alone and beside longer ones), on the trainer's device in its compute dtype,
except the final projection to the labels, which runs in fp32: a bf16 score has steps of 1/16 between 8 and
16, and ties flatten the per-reward z-scores GDPO relies on. One model per path: specs that name the same
path (two labels of one classifier) share its weights and one forward per batch. A conversation longer than
the reward model's limit (its tokenizer's model_max_length, else max_position_embeddings) keeps its last
tokens, where a decoder reads its score (an encoder's text pair loses the start of the prompt instead), and
is counted (reward/<name>/truncated). A non-finite score is None, counted as the scorer counts any invalid
value. A failure while preparing a batch stops the run with one line (a reward that silently went NaN would
train as if it did not exist); sharded, the ranks agree on it first, so none is left waiting in a collective.
An out-of-memory error stops the run with one line naming the flags that lower the memory.

Where the weights live (--reward-model-placement):
- resident: the whole model on each rank's device, all run long (fast; one full copy per rank);
- offload: in CPU memory between scorings, moved to the device for each batch of scoring and back, so it
  holds device memory only while it scores; each rank keeps a whole host copy (8 ranks of a node: 8 copies);
- shard: FSDP2 over the ranks, as the frozen reference is (minigdpo/policy.py): each rank keeps 1/world of
  the weights and gathers one layer at a time while scoring. Every rank then scores in lock-step, the
  same number of batches, which the trainer's equal per-rank shares guarantee. Decoders only;
- auto (default): shard when the run has more than one rank and the model is a decoder, else resident.
The reward model never enters a checkpoint: it is not part of the trained state.
"""

import time

import torch

from minigdpo import dist

_MODELS = {}  # path -> RewardModel: one copy of the weights per process, however many specs name it
_LOADED = {}  # spec -> ModelReward


class RewardModelError(ValueError):
    """A reward model that cannot be used (refused before training), failed to score, or ran out of memory."""


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
        path = parse(spec)[0]
        if path not in _MODELS:
            _MODELS[path] = RewardModel(path, spec)
        _LOADED[spec] = ModelReward(spec, _MODELS[path])
    return _LOADED[spec]


def new_batch():
    """A scorer call begins: a batch is scored once for every spec of its model within one call, never reused by a
    later call. Sharded, every rank must enter the forward's collectives at every call: a cache that outlived its
    call would let a rank whose completions repeat its last batch skip them while the others wait."""
    for model in _MODELS.values():
        model._batch = (None, None)


def forget(spec):
    """Drop a spec and its model from this process (tests, benchmarks): the next get() loads them again."""
    _LOADED.pop(spec, None)
    _MODELS.pop(parse(spec)[0], None)


class RewardModel:
    """One reward model's tokenizer and weights; scores a batch once, for every spec that names it."""

    def __init__(self, path, spec):
        """Reads the config and tokenizer only: a bad path is refused before any weights load."""
        from transformers import AutoConfig, AutoTokenizer

        self.path, self.spec, self.model, self.gib, self._batch = path, spec, None, 0.0, (None, None)
        try:
            self.config = AutoConfig.from_pretrained(path)
            self.tokenizer = AutoTokenizer.from_pretrained(path)
        except Exception as e:  # OSError, ValueError, an ImportError for a package its tokenizer needs, ...
            raise RewardModelError(f"reward model {spec!r}: cannot load {path!r} ({type(e).__name__}: "
                                   f"{str(e).strip().splitlines()[0] if str(e).strip() else 'no message'})") from None
        archs = self.config.architectures or []
        if not any(a.endswith("ForSequenceClassification") for a in archs):
            raise RewardModelError(f"reward model {spec!r}: {path} is a {', '.join(archs or ['model'])}, "
                                   "not a sequence-classification model (AutoModelForSequenceClassification)")
        self.templated = bool(self.tokenizer.chat_template)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        if self.config.pad_token_id is None:
            self.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.truncation_side = "left"
        limit = self.tokenizer.model_max_length
        self.max_len = limit if limit and limit < 10**7 else getattr(self.config, "max_position_embeddings", 2048)

    def check_conversation(self, messages, tools=False):
        """Refuse, in one line, a template that cannot write a conversation of this shape (the task's prompt and an
        assistant turn; with tools, an assistant's tool call, the tool's message and the final answer, each of which
        must show in what it writes): it would fail, or score without the calls, at every step."""
        roles = [m["role"] for m in messages] if isinstance(messages, list) else ["prompt"]
        try:
            self.encode(messages, "42")
        except Exception as e:
            raise RewardModelError(f"reward model {self.spec!r}: its chat template cannot write this task's "
                                   f"conversation (roles {', '.join(roles)}, assistant): {type(e).__name__}: {e}") from None
        if not tools:
            return
        call = {"type": "function", "function": {"name": "tool_a8f3", "arguments": {"arg_b9d4": "val_d6e7"}}}
        talk = [{"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "tool_a8f3", "content": "content_c4f9"},
                {"role": "assistant", "content": "42"}]
        try:
            text = self.tokenizer.decode(self.encode(messages, "42", talk)[0]) if self.templated else ""
        except Exception:
            text = ""
        if not all(s in text for s in ("tool_a8f3", "arg_b9d4", "val_d6e7", "content_c4f9")):
            raise RewardModelError(f"reward model {self.spec!r}: its chat template cannot write a tool call and the "
                                   "tool's result, so it would score an agent's answers without the calls it made")

    def place(self, device=None, dtype=None, batch_size=8, placement="resident", shard_build=None):
        """Load the weights where --reward-model-placement says (the module docstring), once. Without a device
        (eval.py's scorer, on first use): this rank's accelerator if there is one, in bf16, else the CPU in fp32.
        shard_build(path, config, device, dtype) builds the sharded model (train.py passes policy.build_classifier)."""
        if self.model is not None:
            return
        if device is None:
            device = dist.device() if dist.is_initialized() else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
        self.device, self.dtype, self.batch_size = torch.device(device), dtype, batch_size
        can_shard = dist.is_initialized() and shard_build is not None  # eval.py: nothing to shard over
        self.placement = placement
        if placement == "auto":
            self.placement = "shard" if can_shard and dist.world_size() > 1 else "resident"
        elif placement == "shard" and not can_shard:
            self.placement = "resident"
        self.model = self._build(shard_build, placement)
        head = last_projection(self.model, self.config.num_labels)
        head.forward = lambda x, head=head: torch.nn.functional.linear(  # the scores in fp32 (module docstring)
            x.float(), head.weight.float(), None if head.bias is None else head.bias.float())
        # This rank's device memory for the weights, fixed once placed (0 between steps when offloaded).
        local = [p.to_local() if hasattr(p, "to_local") else p for p in self.model.parameters()]
        self.gib = 0.0 if self.placement == "offload" else sum(t.numel() * t.element_size() for t in local) / 2**30

    def _build(self, shard_build, asked):
        from transformers import AutoModelForSequenceClassification

        if self.placement == "shard":
            try:
                return shard_build(self.path, self.config, self.device, self.dtype)
            except ValueError as e:  # not a decoder (BERT, DeBERTa), or tensors that do not match the config
                if asked != "auto":
                    raise RewardModelError(f"reward model {self.spec!r}: {e}; use --reward-model-placement resident "
                                           "or offload") from None
                self.placement = "resident"  # auto: every rank fails alike, before any collective
        model = AutoModelForSequenceClassification.from_pretrained(self.path, config=self.config, dtype=self.dtype)
        return model.to("cpu" if self.placement == "offload" else self.device).eval().requires_grad_(False)

    def encode(self, messages, completion, conversation=None):
        """(token ids, whether they were cut): the conversation in the reward model's template, cut from the
        left to its limit; or, without a template, the text pair (prompt, completion) with special tokens. A
        standard prompt (a string, rewards/prompts.py) and its completion are one text, as TRL scores them
        (trl/trainer/grpo_trainer.py:1605-1620). An agent's `conversation` (its messages after the prompt: tool
        calls, tool results, the final answer) is written whole in place of the completion alone, as TRL's reward
        models see it."""
        if isinstance(messages, str):
            ids = self.tokenizer(messages + completion, add_special_tokens=False).input_ids
            return ids[-self.max_len:], len(ids) > self.max_len
        if not self.templated:
            prompt = "\n\n".join(m["content"] for m in messages)
            whole = self.tokenizer(prompt, completion).input_ids
            if len(whole) <= self.max_len:
                return whole, False
            return self.tokenizer(prompt, completion, truncation="longest_first", max_length=self.max_len).input_ids, True
        turns = conversation or [{"role": "assistant", "content": completion}]
        text = self.tokenizer.apply_chat_template(messages + turns, tokenize=False)
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        return ids[-self.max_len:], len(ids) > self.max_len

    def logits(self, conversations):
        """Every label's logit for each token-id list, (N, labels) float64, batch by batch."""
        out = []
        pad = self.config.pad_token_id  # the id the model skips when it looks for the last token
        for start in range(0, len(conversations), self.batch_size):
            batch = conversations[start:start + self.batch_size]
            width = max(len(ids) for ids in batch)
            ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids in batch], device=self.device)
            mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in batch], device=self.device)
            out.append(self.model(input_ids=ids, attention_mask=mask).logits.double().cpu())  # (b, labels)
        if self.placement == "shard":
            from minigdpo import fsdp

            fsdp.reshard(self.model)  # no backward follows: free the root's gathered weights now
        return torch.cat(out) if out else torch.zeros(0, self.config.num_labels, dtype=torch.float64)

    def score_batch(self, completions, examples, conversations=None):
        """(logits (N, labels), stats) of one batch, computed once however many specs ask for it."""
        key = (tuple(completions), tuple(id(ex) for ex in examples))
        if self._batch[0] == key:
            return self._batch[1], {**self._stats, "model_seconds": 0.0}
        self.place()  # a no-op once train.py placed it; eval.py's scorer loads it here
        t0, failure, encoded = time.perf_counter(), None, []
        try:
            conversations = conversations or [None] * len(completions)
            encoded = [self.encode(ex["messages"], c, talk)
                       for c, ex, talk in zip(completions, examples, conversations)]
        except Exception as e:
            failure = f"{type(e).__name__}: {e}"
        if self.placement == "shard":  # agreed before any rank enters FSDP's all-gathers, or the others would wait
            failure = next((f"rank {r}: {f}" for r, f in enumerate(dist.all_gather_object(failure)) if f), None)
        if failure:
            raise RewardModelError(f"reward model {self.spec!r} could not score a batch ({failure})")
        if self.placement == "offload":
            self.model.to(self.device)
        try:
            with torch.no_grad():
                logits = self.logits([ids for ids, _ in encoded])
        except torch.OutOfMemoryError:
            raise RewardModelError(f"reward model {self.spec!r} ran out of memory scoring batches of {self.batch_size}: "
                                   "lower --reward-model-batch-size, or set --reward-model-placement offload or shard")
        except Exception as e:  # sharded, a forward that fails on one rank alone still leaves the others waiting
            raise RewardModelError(f"reward model {self.spec!r} could not score a batch ({type(e).__name__}: {e})")
        finally:
            if self.placement == "offload":
                self.model.to("cpu")
        self._stats = {"truncated": sum(cut for _, cut in encoded), "model_seconds": time.perf_counter() - t0,
                       "model_gib": self.gib}
        self._batch = (key, logits)
        return logits, self._stats


def last_projection(model, num_labels):
    """The linear layer that writes the labels' logits: the last nn.Linear with num_labels outputs."""
    heads = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.out_features == num_labels]
    if not heads:
        raise RewardModelError(f"reward model {type(model).__name__}: no linear layer writes its {num_labels} labels")
    return heads[-1]


class ModelReward:
    """fn(completion, example) -> the score `prepare` computed for it in a batch: one label of a RewardModel."""

    def __init__(self, spec, rm):
        self.spec, self.rm, self.stats, self._scores = spec, rm, {}, {}
        _, label, self.kind = parse(spec)
        self.column = self._label_column(rm.config, label)
        self.multi_label = rm.config.problem_type == "multi_label_classification"

    @property
    def model(self):
        return self.rm.model

    def place(self, *args, **kwargs):
        self.rm.place(*args, **kwargs)

    def encode(self, messages, completion):
        return self.rm.encode(messages, completion)

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

    def prepare(self, completions, examples, conversations=None):
        """The scorer's batch hook: score every (prompt, completion) of the batch at once (an agent's: the prompt and
        its whole conversation)."""
        logits, self.stats = self.rm.score_batch(completions, examples, conversations)    # (N, labels)
        if self.kind == "prob" and logits.shape[-1] > 1:
            logits = logits.sigmoid() if self.multi_label else logits.softmax(-1)
        scores = logits[:, self.column]                                    # (N,)
        self._scores = {(c, id(ex)): s for c, ex, s in zip(completions, examples, scores.tolist())}

    def __call__(self, completion, example):
        return self._scores[completion, id(example)]  # a non-finite score: the scorer counts it as invalid (None)
