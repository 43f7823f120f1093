"""Reward models as rewards (rewards/reward_model.py), with tiny random sequence-classification models built here.

Two reward models: a Llama with the policy's byte-level tokenizer and ChatML template, and a GPT-2 with a
tokenizer of its own (other special tokens, no pad token) and another chat template. Every score is checked
against a plain transformers forward of the same conversation, one at a time.

Run: pytest tests/test_reward_model.py
"""

import math
import os

import pytest
import torch
from safetensors.torch import load_file

from conftest import read_jsonl, refusal, run
from minigdpo import models
from minigdpo.scoring import RewardScorer
from rewards import reward_model

OTHER_TEMPLATE = "{% for m in messages %}{{ '### ' + m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}{{ '<end>' }}"
MESSAGES = [[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 + 3?"}],
            [{"role": "user", "content": "Name a colour."}]]
COMPLETIONS = ["<think>2 + 3 = 5</think>\n<answer>5</answer>", "5", "", "blue " * 30, "red", "a much longer answer " * 4]


def build_llama(path, num_labels=1, id2label=None, problem_type=None):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tok = models.tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, num_labels=num_labels, problem_type=problem_type,
                         **({"id2label": id2label, "label2id": {v: k for k, v in id2label.items()}} if id2label else {}))
    torch.manual_seed(1)
    LlamaForSequenceClassification(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def build_gpt2(path):
    """Another architecture and tokenizer: GPT-2 layers, a tokenizer with <end> as EOS, no pad token."""
    from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers
    from transformers import GPT2Config, GPT2ForSequenceClassification, PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(tok_models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<end>")
    fast.chat_template = OTHER_TEMPLATE
    config = GPT2Config(vocab_size=len(fast), n_embd=32, n_layer=2, n_head=2, n_positions=4096, num_labels=1,
                        eos_token_id=fast.eos_token_id)
    torch.manual_seed(2)
    GPT2ForSequenceClassification(config).save_pretrained(path)
    fast.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def rms(tmp_path_factory):
    root = tmp_path_factory.mktemp("rms")
    return {"llama": build_llama(root / "llama"), "gpt2": build_gpt2(root / "gpt2"),
            "guard": build_llama(root / "guard", 3, {0: "safe", 1: "unsafe", 2: "other"}),
            "multi": build_llama(root / "multi", 2, {0: "helpful", 1: "harmless"}, "multi_label_classification")}


def one_at_a_time(path, messages, completion):
    """The reference: the model's own template and a forward of that one conversation, no padding."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    if model.config.pad_token_id is None:  # transformers needs one to find the last token; it is never present here
        model.config.pad_token_id = tok.eos_token_id
    text = tok.apply_chat_template(messages + [{"role": "assistant", "content": completion}], tokenize=False)
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(input_ids=ids).logits[0]                                   # (labels,)


def fresh(spec):
    reward_model.forget(spec)
    return reward_model.get(spec)


def pairs():
    return [(c, MESSAGES[i % 2]) for i, c in enumerate(COMPLETIONS)]


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_scores_equal_a_plain_forward_one_at_a_time(rms, name, batch_size):
    rm = fresh(f"model:{rms[name]}")
    rm.place(batch_size=batch_size)
    completions, messages = zip(*pairs())
    examples = [{"messages": m} for m in messages]
    rm.prepare(list(completions), examples)
    for c, ex in zip(completions, examples):
        assert rm(c, ex) == pytest.approx(one_at_a_time(rms[name], ex["messages"], c)[0].item(), abs=1e-5)
    assert rm.stats["truncated"] == 0 and rm.stats["model_gib"] > 0


def test_a_label_of_a_classifier(rms):
    c, m = "fine", MESSAGES[1]
    logits = one_at_a_time(rms["guard"], m, c)
    for spec, want in [("@safe", logits.softmax(-1)[0]), ("@unsafe:logit", logits[1]), ("@2", logits.softmax(-1)[2])]:
        rm, ex = fresh(f"model:{rms['guard']}{spec}"), {"messages": m}
        rm.prepare([c], [ex])
        assert rm(c, ex) == pytest.approx(want.item(), abs=1e-6), spec
    rm, ex = fresh(f"model:{rms['multi']}@harmless"), {"messages": m}      # multi-label: sigmoid per label
    rm.prepare([c], [ex])
    assert rm(c, ex) == pytest.approx(one_at_a_time(rms["multi"], m, c).sigmoid()[1].item(), abs=1e-6)


def test_bad_specs_are_refused_in_one_line(rms, tmp_path):
    cases = [(f"model:{rms['guard']}", "has 3 labels (safe, unsafe, other): pick one with model:PATH@LABEL"),
             (f"model:{rms['guard']}@toxic", "has no label 'toxic'; its labels: safe, unsafe, other"),
             (f"model:{models.resolve_model('tiny-random')}", "not a sequence-classification model"),
             (f"model:{tmp_path}/missing", "cannot load"),
             (f"model:{rms['llama']}@x:prob", "expected model:PATH, model:PATH@LABEL or model:PATH@LABEL:logit")]
    for spec, message in cases:
        with pytest.raises(reward_model.RewardModelError, match=message.replace("(", r"\(").replace(")", r"\)")):
            fresh(spec)
    # through train.py: refused before any model loads, as one line
    assert "not a sequence-classification model" in refusal(
        ["--preset", "smoke", "--rewards", f"format,model:{models.resolve_model('tiny-random')}",
         "--output-dir", str(tmp_path / "run")])


def test_long_conversations_keep_their_end_and_are_counted(rms):
    rm = fresh(f"model:{rms['llama']}")
    rm.rm.max_len = 40
    ex, long, short = {"messages": MESSAGES[1]}, "blue " * 30, "red"
    rm.prepare([long, short], [ex, ex])
    assert rm.stats["truncated"] == 1
    ids, cut = rm.encode(ex["messages"], long)
    assert cut and len(ids) == 40
    with torch.no_grad():
        want = rm.model(input_ids=torch.tensor([ids])).logits[0, 0].item()
    assert rm(long, ex) == pytest.approx(want, abs=1e-5)


def test_a_non_finite_score_is_none_and_counted(rms):
    spec = f"model:{rms['llama']}"
    rm = fresh(spec)
    rm.place()
    with torch.no_grad():
        rm.model.score.weight.fill_(math.nan)
    out, stats = RewardScorer(["format", spec])(COMPLETIONS[:2], [{"messages": MESSAGES[0]}] * 2)
    assert torch.isnan(out[:, 1]).all() and stats[spec]["invalid"] == 2
    reward_model.forget(spec)


def test_out_of_memory_names_the_settings(rms, monkeypatch):
    """A CPU cannot run out of memory on cue: the forward raises torch.OutOfMemoryError as CUDA's allocator does
    (c10/cuda/CUDACachingAllocator.cpp raises it as torch.OutOfMemoryError, a RuntimeError)."""
    spec = f"model:{rms['llama']}"
    rm = fresh(spec)
    rm.place(batch_size=4)

    def oom(**kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(rm.rm, "model", oom)
    with pytest.raises(reward_model.RewardModelError, match="lower --reward-model-batch-size .now 4.|placement offload"):
        RewardScorer([spec])(COMPLETIONS[:2], [{"messages": MESSAGES[0]}] * 2)
    reward_model.forget(spec)


def test_offload_keeps_it_off_the_device_between_scorings(rms):
    rm = fresh(f"model:{rms['llama']}")
    rm.place(placement="offload")
    ex = {"messages": MESSAGES[0]}
    rm.prepare(["5"], [ex])
    assert rm.stats["model_gib"] == 0 and next(rm.model.parameters()).device.type == "cpu"
    assert rm("5", ex) == pytest.approx(one_at_a_time(rms["llama"], MESSAGES[0], "5")[0].item(), abs=1e-5)


SMOKE = ["train.py", "--preset", "smoke", "--max-steps", "2", "--save-every", "2"]


@pytest.mark.parametrize("nproc,backend", [(1, "hf"), (1, "lora"), (1, "vllm"), pytest.param(2, "hf", marks=pytest.mark.slow)])
def test_rule_rewards_and_two_reward_models_train(rms, tmp_path, nproc, backend):
    """correct, format and two reward models under GDPO: every reward logged, the models never checkpointed.
    With the HF sampler, LoRA, the vLLM sampler (the fake engine, tests/vllm_train.py); on 2 gloo ranks the
    reward models are sharded with FSDP2 (placement auto)."""
    out = str(tmp_path / "run")
    rewards = f"correct,format,model:{rms['gpt2']},model:{rms['guard']}@safe"  # GPT-2: its own tokenizer and template
    condition = ["--condition", f"model:{rms['gpt2']}:format>=0"]  # conditioned like any reward (always met here)
    flags = {"hf": condition, "lora": ["--lora-rank", "4"], "vllm": ["--sampler", "vllm"]}[backend]
    script = ["tests/vllm_train.py"] if backend == "vllm" else SMOKE[:1]
    run(script + SMOKE[1:] + ["--rewards", rewards, "--output-dir", out] + flags, nproc=nproc)
    rows = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2]
    for name in ("correct", "format", f"model:{rms['gpt2']}", f"model:{rms['guard']}@safe"):
        assert math.isfinite(rows[-1][f"reward/{name}/mean"]), name
    rm = f"reward/model:{rms['gpt2']}"
    assert rows[-1][f"{rm}/std"] > 0 and rows[-1][f"{rm}/truncated"] == 0 and rows[-1][f"{rm}/model_seconds"] > 0
    whole = sum(t.numel() * 4 for t in load_file(os.path.join(rms["gpt2"], "model.safetensors")).values()) / 2**30
    assert rows[-1][f"{rm}/model_gib"] == pytest.approx(whole / nproc, rel=0.02)  # 2 ranks: sharded, half each
    assert rows[-1]["grad_norm"] > 0
    step = os.path.join(out, "checkpoints", "step_000002")
    files = [os.path.join(d, f) for d, _, fs in os.walk(step) for f in fs]
    assert files and not any(b"score.weight" in open(f, "rb").read() for f in files)  # the reward models' head


def test_conditions_name_reward_models():
    """Eq. 8 on a reward model: its name holds colons, so the run's reward names tell TARGET from SOURCE."""
    from minigdpo.advantages import Condition

    names = ["correct", "model:/m/guard@safe", "model:/m/rm"]
    c = Condition.parse("model:/m/guard@safe:correct>=1", names)
    assert (c.target, c.source, c.op, c.threshold) == ("model:/m/guard@safe", "correct", ">=", 1.0)
    c = Condition.parse("model:/m/rm:model:/m/guard@safe>0.5", names)
    assert (c.target, c.source) == ("model:/m/rm", "model:/m/guard@safe")
    with pytest.raises(ValueError, match="with TARGET and SOURCE among the rewards"):
        Condition.parse("model:/m/other:correct>=1", names)


# What the second review found ------------------------------------------------------------------------

GEMMA_LIKE = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
              "{% for m in messages %}{{ '<turn>' + m['role'] + '\n' + m['content'] + '<end>\n' }}{% endfor %}")


def test_a_template_that_cannot_write_the_tasks_conversation_is_refused_before_training(tmp_path):
    """Every built-in task opens with a system turn, which Gemma-style templates refuse: the reward would be NaN at
    every step. It is refused in one line before any weights load, by train.py and by eval.py's scorer."""
    from transformers import AutoTokenizer

    path = build_llama(tmp_path / "gemma_like")
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = GEMMA_LIKE
    tok.save_pretrained(path)
    reward_model.forget(f"model:{path}")
    message = refusal(["--preset", "smoke", "--rewards", f"format,model:{path}", "--output-dir", str(tmp_path / "run")])
    assert "cannot write this task's conversation" in message and "System role not supported" in message
    with pytest.raises(reward_model.RewardModelError, match="cannot write"):
        RewardScorer([f"model:{path}"]).check_conversation(MESSAGES[0])
    RewardScorer([f"model:{path}"]).check_conversation(MESSAGES[1])  # no system turn: written


def test_a_score_does_not_depend_on_its_batch_when_the_config_has_its_own_pad_id(tmp_path):
    """transformers' classifiers read the score at the last token that is not config.pad_token_id; padding with
    another id (the tokenizer's) put a shorter conversation's score at a padding position."""
    from transformers import AutoConfig

    path = build_llama(tmp_path / "own_pad")
    config = AutoConfig.from_pretrained(path)
    config.pad_token_id = 3  # a byte the conversations here never hold, not the tokenizer's <|pad|>
    config.save_pretrained(path)
    spec = f"model:{path}"
    short, long = "red", "a much longer answer " * 4
    ex = {"messages": MESSAGES[1]}
    alone = fresh(spec)
    alone.prepare([short], [ex])
    want = alone(short, ex)
    together = fresh(spec)
    together.place(batch_size=2)
    together.prepare([short, long], [ex, ex])
    assert together(short, ex) == pytest.approx(want, abs=1e-6)


def test_scores_come_from_an_fp32_head_not_rounded_to_bf16(rms):
    """A bf16 score has steps of 1/16 between 8 and 16: ties that flatten GDPO's per-reward z-scores. The hidden
    states run in bf16, the projection to the label in fp32."""
    spec = f"model:{rms['llama']}"
    rm = fresh(spec)
    rm.place(dtype=torch.bfloat16, batch_size=8)
    with torch.no_grad():
        rm.model.score.weight.mul_(400)  # scores of about +-10
    completions, messages = zip(*pairs())
    examples = [{"messages": m} for m in messages]
    rm.prepare(list(completions), examples)
    scores = [rm(c, ex) for c, ex in zip(completions, examples)]
    assert max(abs(s) for s in scores) > 4
    assert any(float(torch.tensor(s).to(torch.bfloat16)) != s for s in scores)  # not on bf16's grid
    for c, ex, s in zip(completions, examples, scores):
        ids = torch.tensor([rm.encode(ex["messages"], c)[0]])
        with torch.no_grad():
            h = rm.model.model(input_ids=ids).last_hidden_state[0, -1]   # bf16
        assert s == pytest.approx(torch.nn.functional.linear(h.float(), rm.model.score.weight.float()).item(), abs=1e-4)
    reward_model.forget(spec)


def test_two_labels_of_one_model_share_its_weights_and_its_forward(rms, monkeypatch):
    safe, unsafe = f"model:{rms['guard']}@safe", f"model:{rms['guard']}@unsafe"
    reward_model.forget(safe)
    a, b = reward_model.get(safe), reward_model.get(unsafe)
    a.place()
    assert a.model is b.model
    forwards = []
    monkeypatch.setattr(a.rm, "logits", lambda convs, f=a.rm.logits: forwards.append(len(convs)) or f(convs))
    scorer, examples = RewardScorer([safe, unsafe]), [{"messages": MESSAGES[1]}] * 2
    out, _ = scorer(["fine", "no"], examples)
    assert forwards == [2] and (out[:, 0] != out[:, 1]).all()
    again, _ = scorer(["fine", "no"], examples)  # the same batch in a later call: a forward again (sharded, every
    assert forwards == [2, 2] and torch.equal(again, out)  # rank enters it at every call, whatever its completions
    reward_model.forget(safe)


def build_bert(path):
    """An encoder classifier without a chat template, its tokenizer making [CLS] A [SEP] B [SEP] pairs."""
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers, processors
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + [chr(c) for c in range(33, 127)]
    tok = Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", model_max_length=512)
    config = BertConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=512, num_labels=1, pad_token_id=0)
    torch.manual_seed(3)
    BertForSequenceClassification(config).save_pretrained(path)
    fast.save_pretrained(path)
    return str(path)


def test_an_encoder_without_a_chat_template_scores_the_text_pair(tmp_path):
    """BERT- and DeBERTa-style reward models take (question, answer): the prompt's text and the completion."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = build_bert(tmp_path / "bert")
    spec = f"model:{path}"
    rm = fresh(spec)
    rm.place(batch_size=2)
    ex = {"messages": MESSAGES[0]}
    rm.prepare(["5", "it is 5"], [ex, ex])
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForSequenceClassification.from_pretrained(path).eval()
    enc = tok("Answer briefly.\n\nWhat is 2 + 3?", "it is 5", return_tensors="pt")
    assert enc.input_ids[0, 0].item() == 2  # [CLS]
    with torch.no_grad():
        assert rm("it is 5", ex) == pytest.approx(model(**enc).logits[0, 0].item(), abs=1e-5)
    reward_model.forget(spec)


def test_an_encoder_is_never_sharded_by_auto_and_refused_in_one_line_by_shard(tmp_path, process_group):
    from minigdpo import policy

    path = build_bert(tmp_path / "bert")
    spec = f"model:{path}"
    reward_model.forget(spec)
    with pytest.raises(reward_model.RewardModelError, match="cannot find the decoder layers.*--reward-model-placement "
                                                            "resident"):
        reward_model.get(spec).place(torch.device("cpu"), torch.float32, 2, "shard", policy.build_classifier)
    reward_model.forget(spec)
    rm = reward_model.get(spec)
    rm.rm.place(torch.device("cpu"), torch.float32, 2, "auto", policy.build_classifier)
    assert rm.rm.placement == "resident"
    reward_model.forget(spec)


def test_a_tokenizer_that_needs_a_missing_package_is_refused_in_one_line(rms, monkeypatch):
    import transformers

    def needs_package(*args, **kwargs):
        raise ImportError("This tokenizer needs the sentencepiece library\nsee its install page")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", needs_package)
    spec = f"model:{rms['llama']}"
    reward_model.forget(spec)
    with pytest.raises(reward_model.RewardModelError, match="cannot load .*ImportError: This tokenizer needs"):
        reward_model.get(spec)
    reward_model.forget(spec)


@pytest.mark.slow
def test_a_failure_on_one_rank_stops_every_rank_in_one_line(rms, tmp_path):
    """Sharded, a rank whose batch cannot be written skipped FSDP2's forward while the others waited in its
    all-gathers until the collective timeout. The ranks agree on the failure first and all stop."""
    from transformers import AutoTokenizer

    path = build_llama(tmp_path / "picky")
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = ("{% for m in messages %}{% if 'FAIL' in m['content'] %}{{ raise_exception('cannot write "
                         "FAIL') }}{% endif %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}")
    tok.save_pretrained(path)
    proc = run(["tests/reward_model_ranks.py", path], nproc=2, timeout=120)
    for rank in (0, 1):
        assert f"rank {rank} stopped: reward model" in proc.stdout and "rank 1: TemplateError" in proc.stdout, proc.stdout


def test_an_agents_reward_model_scores_the_whole_conversation(tmp_path):
    """Two rollouts end with the same answer, one through a tool call: the reward model scores each conversation as its
    own template writes it (the calls and results included), as TRL's reward models see them; a reward model whose
    template cannot write a tool call is refused in one line before any weights load."""
    from transformers import AutoTokenizer

    from minigdpo.sampler import Completion

    pytest.importorskip("trl")
    from trl.chat_template_utils import qwen2_5_chat_template

    path = build_llama(tmp_path / "tool_rm")
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = qwen2_5_chat_template  # a template that writes tool calls (TRL's copy of Qwen2.5's)
    tok.save_pretrained(path)
    reward_model.forget(f"model:{path}")
    call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "23*45"}}}
    talks = [[{"role": "assistant", "content": "", "tool_calls": [call]},
              {"role": "tool", "name": "calculate", "content": "1035"},
              {"role": "assistant", "content": "<answer>1035</answer>"}],
             [{"role": "assistant", "content": "<answer>1035</answer>"}]]
    prompt = [{"role": "user", "content": "What is 23*45?"}]
    done = [Completion([1], [0.0], "stop", "<answer>1035</answer>", tool_mask=[1], messages=t) for t in talks]
    scorer = RewardScorer([f"model:{path}"])
    scorer.check_conversation(prompt, tools=True)
    out, _ = scorer.score(done, [{"messages": prompt}] * 2)
    want = [one_at_a_time(path, prompt + t[:-1], t[-1]["content"])[0].item() for t in talks]
    assert out[:, 0].tolist() == pytest.approx(want, abs=1e-5) and out[0, 0] != out[1, 0]

    plain = build_llama(tmp_path / "plain_rm")  # ChatML that writes only contents: the calls would vanish
    reward_model.forget(f"model:{plain}")
    with pytest.raises(reward_model.RewardModelError, match="cannot write a tool call"):
        RewardScorer([f"model:{plain}"]).check_conversation(prompt, tools=True)
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import tiny_agent

    message = refusal(["--preset", "smoke", "--task", "calculator", "--tools", "rewards.calculator:calculate",
                       "--model", tiny_agent.cached(), "--rewards", f"solved,model:{plain}", "--output-dir",
                       str(tmp_path / "run")])
    assert "cannot write a tool call" in message and "\n" not in message
