"""The command line, generated from the config dataclass (minigdpo/config.py): one flag per field, its docstring as
--help's text, in the groups the class's comments name; a preset's values first, explicit flags on top; every value
checked (config.validate); a bad one is one line (ConfigError), never argparse's usage block.
"""

import argparse
import ast
import inspect
from dataclasses import MISSING, fields

from minigdpo.config import CHOICES, Config, ConfigError, validate
from minigdpo.presets import PRESETS


def field_docs(cls=Config):
    """The docstring under each field, read from the class source."""
    body = ast.parse(inspect.getsource(cls)).body[0].body  # the class's statements
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _list_of(kind):
    def parse(text):
        items = [x.strip() for x in text.split(",") if x.strip()]
        try:
            return [kind(x) for x in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__} values, got {text!r}") from None

    return parse


def _bool(text):
    if text.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return text.lower() in ("1", "true", "yes", "on")
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


class _OneLineErrors(argparse.ArgumentParser):
    def error(self, message):
        raise ConfigError(message)


def field_sections(cls=Config):
    """Each field's section: the comment above its group of fields in the class source."""
    sections, title = {}, ""
    for line in inspect.getsource(cls).splitlines():
        if line.startswith("    # "):
            title = line.strip("# ").strip()
        elif ":" in line and line.startswith("    ") and not line.startswith("     ") and line.strip()[0].isalpha():
            sections[line.split(":")[0].strip()] = title
    return sections


def build_parser(description=""):
    """The command line, one flag per field, in --help's groups: what a newcomer sets first, systems knobs last."""
    parser = _OneLineErrors(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    docs, sections, groups = field_docs(), field_sections(), {}
    for f in fields(Config):
        title = sections.get(f.name, "other")
        group = groups[title] = groups.get(title) or parser.add_argument_group(title)
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else f.default_factory()
        choices = f" One of: {', '.join(map(str, CHOICES[f.name]))}." if f.name in CHOICES else ""
        help_text = f"{docs.get(f.name, '')}{choices} (default: {default!r})"
        if f.type is bool:
            group.add_argument(flag, type=_bool, nargs="?", const=True, default=None, metavar="BOOL", help=help_text)
        elif f.type is list:
            kind = float if f.name in ("reward_weights", "saw_shift") else str
            action = "extend" if f.name == "condition" else "store"
            group.add_argument(flag, type=_list_of(kind), action=action, default=None, metavar="A,B", help=help_text)
        else:
            group.add_argument(flag, type=f.type, default=None, metavar=f.type.__name__.upper(), help=help_text)
    # The one alias: switching the cpu-demo's final evaluation off reads better as a flag than as a count of 0.
    groups["Output"].add_argument("--no-final-eval", dest="final_eval", action="store_const", const=0,
                                  help="the same as --final-eval 0")
    return parser


def parse_args(argv=None, description=""):
    """Preset values, then explicit flags on top; every value checked (validate)."""
    args = vars(build_parser(description).parse_args(argv))
    preset = args["preset"] or Config.preset
    if preset not in PRESETS:
        raise ConfigError(f"--preset {preset!r} is not one of {', '.join(PRESETS)}")
    values = {**PRESETS[preset], **{k: v for k, v in args.items() if v is not None}, "preset": preset}
    return validate(Config(**values))
