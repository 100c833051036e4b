"""The command line's flags: one @dataclass of arg() fields per command becomes argparse flags (help,
source of the default, range); which flags a run changed, the run folder named after them, and the
paper's rows they reproduce (select_rows). The training flags are common.TrainArgs, a row common.PaperRow."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import hashlib
import math
import operator
import os
import re
import sys
from pathlib import Path
from typing import Any, Sequence, get_args, get_origin, get_type_hints

from plumbing.errors import UserError

RANGE_WORDS = {"ge": (">=", operator.ge), "gt": (">", operator.gt), "le": ("<=", operator.le),
               "lt": ("<", operator.lt)}


def arg(default: Any, help: str, source: str = "ours", choices: list | None = None, note: str = "",
        positional: bool = False, **bounds: float) -> Any:
    """A dataclass field: its help, where its default comes from (paper Tab. N, paper Sec. N,
    official code, ours), its range (bounds: ge >=, gt >, le <=, lt <; each element of a list) and
    a `note` for a range error (the values the paper used). `positional`: compare's bare words."""
    checks = [(*RANGE_WORDS[k], bound) for k, bound in bounds.items()]     # (">=", operator.ge, 0)
    meta = dict(help=help, source=source, choices=choices, note=note, positional=positional, range=checks)
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


# Flags that say where and how a run is written and shown, not what it trains: --resume may
# change them, the default run folder's name leaves them out, compare.py ignores them
NOT_TRAINING = ("output_dir", "resume", "log_every", "sts_dir", "cache_dir", "compile", "eval_untrained")
# Flags no paper row depends on: the budget and the data, so that a short run, or one on other
# sentences, still shows its rows (a row that needs a CSV names it: PaperRow.data)
ROW_FREE = ("data", "seed", "max_steps", "epochs", "eval_every")


def field_default(f: dataclasses.Field) -> Any:
    """The default of a field that arg() made (a list default comes from a factory)."""
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def check_ranges(args: Any) -> None:
    """Every text UTF-8, every number finite (argparse reads inf and nan as floats) and in the range
    its arg() declares, else a UserError: flag, value, rule, note, default."""
    for f in dataclasses.fields(args):
        value, default = getattr(args, f.name), flag_text(f.name, field_default(f))
        note = f" {f.metadata['note']}" if f.metadata.get("note") else ""
        for x in value if isinstance(value, list) else [value]:
            # a byte of argv that is not UTF-8 (in a file's name) comes as a surrogate: no UTF-8 file holds it
            if isinstance(x, str) and x.encode(errors="ignore").decode() != x:
                flag = "" if f.metadata.get("positional") else f"--{f.name} "
                raise UserError(f"{flag}{os.fsencode(x).decode(errors='backslashreplace')}: not valid UTF-8: "
                                f"rename the file or folder, and pass its new name.")
            if isinstance(x, float) and not math.isfinite(x):
                raise UserError(f"--{f.name} {x}: not a finite number. Pass a value such as the default "
                                f"{default}.")
            for word, ok, bound in f.metadata.get("range", []):
                if not ok(x, bound):
                    raise UserError(f"--{f.name} {x}: must be {word} {bound:g}.{note} Pass a value in "
                                    f"range, e.g. the default {default}.")


def flag_text(name: str, value: Any) -> str:
    """A flag as a user types it: --tau 0.05, --no_mlp, --no-modulate, --phi 0.01 0.02."""
    if isinstance(value, bool):
        return f"--{name}" if value else f"--no-{name}"
    if isinstance(value, list):
        return " ".join([f"--{name}", *(f"{v:g}" if isinstance(v, float) else str(v) for v in value)])
    return f"--{name} {value:g}" if isinstance(value, float) else f"--{name} {value}"


def defaults_of(args: Any) -> Any:
    """The defaults of `args`' command on its kind of --data: with its CSV_DEFAULTS for a CSV."""
    return type(args)(**(getattr(type(args), "CSV_DEFAULTS", {}) if _csv(args) else {}))


def _csv(args: Any) -> bool:
    """Whether --data is a CSV (SimCSE's supervised form), not a text file."""
    return str(getattr(args, "data", "")).lower().endswith(".csv")


def changed_flags(args: Any, leave_out: tuple[str, ...] = NOT_TRAINING) -> dict[str, Any]:
    """The flags whose values differ from the defaults (defaults_of), in the order of Args."""
    defaults = defaults_of(args)
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(args)
            if f.name not in leave_out and getattr(args, f.name) != getattr(defaults, f.name)}


def script_name(args: Any) -> str:
    """The script whose Args `args` is: simcse, focal_infonce, ... (its module's file name)."""
    module = sys.modules.get(type(args).__module__)
    return Path(getattr(module, "__file__", None) or type(args).__module__).stem


def default_output_dir(args: Any) -> str:
    """runs/<script>/<each flag that differs from its default>: runs/focal_infonce/m0.2, runs/simcse/default;
    a path named by its last part, a name over 100 bytes cut (a hash of the whole keeps it apart)."""
    parts = [f"{name}-{Path(value).name or value}" if isinstance(value, str)
             else flag_text(name, value)[2:].replace(" ", "", 1).replace(" ", "-")
             for name, value in changed_flags(args).items()]
    name = "".join(c if c.isalnum() or c in "-_.+" else "-" for c in "_".join(parts)) or "default"
    if len(name.encode()) > 100:     # a file name holds 255 bytes at most: a long --data's would pass them
        name = f"{name.encode()[:90].decode(errors='ignore')}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"
    return str(Path("runs") / script_name(args) / name)


def closest(word: str, among: list[str]) -> list[str]:
    """What `word` most likely meant: the names it begins, else up to two look-alikes (difflib)."""
    return [o for o in among if o.startswith(word)][:3] or difflib.get_close_matches(word, among, 2, 0.75)


NUMBER = re.compile(r"-?(\d+\.?\d*|\.\d+)(e[-+]?\d+)?", re.I)     # -5 and -1e-3 are values, not flags
# The official SimCSE code's flags (run_unsup_example.sh: its own, HF Trainer's), each said as this
# project's flag and what differs; one applies where the command has that flag ("": a training command)
LOOP = "not needed: every run trains, evaluates STS-B dev every --eval_every steps, keeps the best in best/"
OFFICIAL = {
    "--temp": ("--tau", ""), "--learning_rate": ("--lr", ""), "--num_train_epochs": ("--epochs", ""),
    "--max_seq_length": ("--max_len", ""), "--model_name_or_path": ("--model", ""),
    "--train_file": ("--data", ""), "--eval_steps": ("--eval_every", ""),
    "--logging_steps": ("--log_every", ""),
    "--per_device_train_batch_size": ("--batch_size", ", global over all GPUs here, per GPU there"),
    # cl_forward adds w to the hard negative's logit: e^{sim/tau + w} = e^w e^{sim/tau}, Sec. 6.3's alpha
    "--hard_negative_weight": ("--alpha", ", a weight on e^{sim/tau}: that code adds its w to the hard "
                               "negative's logit sim/tau, so --alpha = e^w (w = ln alpha)"),
    "--pooler_type": ("--pooler", "; its cls with --mlp_only_train is --pooler cls_before_pooler here, "
                      "its cls_before_pooler trains no MLP either"),
    "--mlp_only_train": ("--pooler cls_before_pooler", ": raw [CLS] at evaluation, an MLP in training only"),
    "--do_mlm": ("", "no MLM objective here (the official code's auxiliary loss): drop it"),
    "--fp16": ("", "mixed precision is automatic here (bf16 autocast on CUDA): drop it"),
    "--overwrite_output_dir": ("", "a run folder is never written over: pass a new "
                               "--output_dir, or --resume to continue the run there"),
    **dict.fromkeys(["--do_train", "--do_eval", "--evaluation_strategy", "--metric_for_best_model",
                     "--load_best_model_at_end"], ("", LOOP)),
}


class Parser(argparse.ArgumentParser):
    """argparse with allow_abbrev=False (build_parser: `--max_step 5` is refused, not taken for
    --max_steps); a refusal is one line, a UserError (exit status 2 under run_main) that names the
    closest flag or value, not usage lines. --help is argparse's own."""
    command = ""                                 # as a user types it: python simcse.py
    defaults: dict[str, Any] = {}                # --flag: its default, for the examples

    def error(self, message: str):
        """argparse's refusal (its `message`), said in one line."""
        flags = {o: a for a in self._actions for o in a.option_strings if o != "-h"}
        if message.startswith("unrecognized arguments: "):
            raise UserError(self.unknown(message.split(": ", 1)[1].split(" "), flags))
        m = re.fullmatch(r"argument ([^:/]+)\S*: (.*)", message, re.S)
        flag, what = m.groups() if m else ("", message)
        choice = re.match(r"invalid choice: (['\"])(.*?)\1", what)
        if choice and flag in flags:
            choices = [str(c) for c in flags[flag].choices]
            near = closest(choice[2], choices)
            raise UserError(f"{flag} {choice[2]}: not one of {', '.join(choices)}"
                            + (f"; did you mean {flag} {' or '.join(near)}?" if near else "."))
        default = self.defaults.get(flag, "")
        shown = default not in ("", []) and default is not False       # a switch that is off: no example
        example = f", e.g. {flag_text(flag[2:], default)} (the default)" if shown else ""
        if kind := re.match(r"invalid (int|float) value: (['\"])(.*)\2", what):
            word = "a whole number" if kind[1] == "int" else "a number"
            raise UserError(f"{flag} {kind[3]}: not {word}. Pass {word}{example}.")
        raise UserError(f"{flag + ': ' if flag else ''}{what}{example}. `{self.command} --help` says what "
                        f"each flag takes.")

    def unknown(self, words: list[str], flags: dict[str, argparse.Action]) -> str:
        """What argparse could not place: values no flag takes, or flags it does not know, each with
        the closest ones or, the official code's (OFFICIAL), with this project's and what differs."""
        said: dict[str, list[str]] = {}              # what is said: the flags it is said of
        for i, word in enumerate(words):
            if not word.startswith("-") or NUMBER.fullmatch(word):
                continue
            flag, _, value = word.partition("=")
            after = words[i + 1] if i + 1 < len(words) else "-"
            value = value or (after if after[:1] != "-" or NUMBER.fullmatch(after) else "")
            ours, what = OFFICIAL.get(flag, ("-", ""))
            if (ours.split() or ["--max_steps"])[0] in flags:            # "": a training command's
                if ours == "--alpha" and NUMBER.fullmatch(value) and abs(float(value)) < 700:
                    what += f": pass --alpha {math.exp(float(value)):g}"
                what = f"this project's {ours} (the official code's {flag}){what}." if ours else f"{what}."
                flag = f"{flag} {value}".strip()
            else:
                near = closest(flag, list(flags))
                what = "no such flag" + (f"; did you mean {' or '.join(near)}?" if near else ".")
            said.setdefault(what, []).append(flag)
        if not said:
            return (f"{' '.join(words)}: a value that no flag takes (a switch such as --resume takes "
                    f"none). `{self.command} --help` lists every flag.")
        said_all = " ".join(f"{', '.join(given)}: {what}" for what, given in said.items())
        return f"{said_all} `{self.command} --help` lists every flag."


def build_parser(cls: type, description: str | None = None, prog: str | None = None) -> Parser:
    """argparse flags from a dataclass of arg() fields, each help line ending in [source] (default)."""
    parser = Parser(description=description, prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
                    allow_abbrev=False)
    script = getattr(sys.modules.get(cls.__module__), "__file__", None)
    parser.command = prog or (f"python {Path(script).name}" if script else parser.prog)
    parser.defaults = {f"--{f.name}": field_default(f) for f in dataclasses.fields(cls)}
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        default, hint, meta = field_default(f), hints[f.name], f.metadata
        source = getattr(cls, "SOURCES", {}).get(f.name, meta.get("source", "ours"))
        # the real default in --help; SUPPRESS tells parse_args which flags were given
        kw: dict[str, Any] = {"default": argparse.SUPPRESS, "help": f"{meta.get('help', '')} [{source}]"
                              + ("" if default == "" else f" (default: {default})")}
        kw.update({"choices": meta["choices"]} if meta.get("choices") else {})   # a switch takes none
        if meta.get("positional"):
            parser.add_argument(f.name, nargs="*", metavar=f.name.upper().rstrip("S"), **kw)
        elif hint is bool:
            action = argparse.BooleanOptionalAction if default else "store_true"
            parser.add_argument(f"--{f.name}", action=action, **kw)
        else:
            many = get_origin(hint) is list
            parser.add_argument(f"--{f.name}", type=get_args(hint)[0] if many else hint,
                                nargs="*" if many else None, **kw)
    return parser


def parse_args(cls: type, argv: list[str] | None = None, description: str | None = None,
               prog: str | None = None) -> Any:
    """The one way every command reads its flags: argparse from `cls`, each value checked, then a
    training script's rules() between flags: every flag's mistake is refused here (its files, by
    common.start). The flags not given take their kind of --data's defaults (a CSV's: a note)."""
    given = vars(build_parser(cls, description, prog).parse_args(argv))
    args = dataclasses.replace(defaults_of(cls(**given)), **given)
    check_ranges(args)
    if hasattr(args, "rules"):                   # the tools' flags have none
        args.rules()
    took = [flag_text(k, getattr(args, k)) for k in getattr(cls, "CSV_DEFAULTS", {}) if k not in given]
    if took and _csv(args) and int(os.environ.get("RANK", "0")) == 0:     # once under torchrun
        print(f"note: --data {args.data} is a CSV, so these flags take the CSV's defaults: {' '.join(took)} "
              f"(a flag given on the command line wins)", file=sys.stderr)
    return args


def _same(a: Any, b: Any) -> bool:
    """A flag's value equals a row's: lists element by element, numbers up to rounding."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(_same, a, b))
    numbers = isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool)
    return math.isclose(a, b, rel_tol=1e-9) if numbers else a == b


def _model_name(model: str) -> str:
    """An encoder as rows name it: FacebookAI/roberta-base, roberta-base, .../roberta-base/ are one."""
    return Path(model.rstrip("/")).name.lower()


def select_rows(args: Any, rows: Sequence[Any]) -> tuple[list[tuple[str, Any]], str]:
    """The rows (common.PaperRow) that `args` reproduces, each with its label, and a note ("" if none
    is needed). A row matches when its model and data are the run's and every flag that changes
    training (all but NOT_TRAINING, ROW_FREE and the script's OWN_ROW_FREE) has the row's value, or
    the default where the row names none. A model the paper did not train is compared as the
    script's default model, its rows so labelled. No match: the note names the flags no row covers."""
    defaults = defaults_of(args)
    free = {*NOT_TRAINING, *ROW_FREE, *type(args).OWN_ROW_FREE, "model"}
    stand_in = _model_name(args.model) not in {_model_name(r.model or defaults.model) for r in rows}
    model = _model_name(defaults.model if stand_in else args.model)
    csv_name = Path(args.data).name if _csv(args) else ""
    picked = []
    for r in rows:
        same_flags = all(_same(getattr(args, f.name), r.flags.get(f.name, getattr(defaults, f.name)))
                         for f in dataclasses.fields(args) if f.name not in free)
        if _model_name(r.model or defaults.model) == model and r.data == csv_name and same_flags:
            picked.append((r.label + (f" [paper: {r.model or defaults.model}]" if stand_in else ""), r))
    if picked:
        return picked, (f"{args.model} is not a model the paper trained: the rows below are the paper's "
                        f"{defaults.model}, a reference rather than a target" if stand_in else "")
    named = [flag_text(k, v) for k, v in changed_flags(args, tuple(free)).items()]
    if model != _model_name(defaults.model):
        named.insert(0, f"--model {args.model}")
    kinds = {r.data for r in rows}                   # "": text files; else the CSVs the rows need
    if csv_name not in kinds or (csv_name and "" in kinds):   # data no row has, or a script's other form
        named.insert(0, f"--data {Path(args.data).name}")
    return [], f"the paper reports no row for {' '.join(named) or 'these flags'}"
