"""Flags: argparse from a script's @dataclass Args of arg() fields (parse_args), so that an ablation is a
flag; the flags a run changed, its default folder and its paper rows.

The rules, and the function that keeps each:
1. A flag is refused before anything loads, in one line that names it and what to pass (check_ranges,
   Parser.error): a range a paper's formula allows; a mistyped flag gets the closest name
   (Parser.unknown). NOTE(ours): the official SimCSE code's flag names are mapped to ours in
   docs/simcse.md, not here.
2. A run's default folder names the flags that differ (default_output_dir): the rows of a paper's
   table, run one after the other, overwrite nothing.
3. A paper's row is printed beside a run only when the run's flags reproduce it (select_rows).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import hashlib
import json
import math
import os
import re
import sys
from operator import ge, gt, le, lt
from pathlib import Path
from typing import Any, Sequence, get_args, get_origin, get_type_hints

from plumbing.errors import UserError

RANGE_WORDS = {"ge": (">=", ge), "gt": (">", gt), "le": ("<=", le), "lt": ("<", lt)}
# How a run is written, not what it trains: --resume may change them, run names and compare.py omit them
NOT_TRAINING = ("output_dir", "resume", "log_every", "sts_dir", "cache_dir", "compile", "eval_untrained")
# No row depends on them: a short run, or one on other sentences, shows its rows (a CSV's: PaperRow.data)
ROW_FREE = ("data", "seed", "max_steps", "epochs", "eval_every")


def arg(default: Any, help: str, source: str = "ours", choices: list | None = None, note: str = "",
        positional: bool = False, **bounds: float) -> Any:
    """A dataclass field: its help, its default's source (paper Tab. N, official code, ours), its range
    (ge=0: >= 0, each element of a list), a `note` for a range error; `positional`: compare's bare words."""
    checks = [(*RANGE_WORDS[k], bound) for k, bound in bounds.items()]     # (">=", ge, 0)
    meta = dict(help=help, source=source, choices=choices, note=note, positional=positional, range=checks)
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def check_ranges(args: Any) -> None:
    """Each value finite (argparse takes inf and nan as floats) and in its arg() range; else UserError."""
    defaults = type(args)()
    for f in dataclasses.fields(args):
        value, default = getattr(args, f.name), flag_text(f.name, getattr(defaults, f.name))
        note = f" {f.metadata['note']}" if f.metadata["note"] else ""
        for x in value if isinstance(value, list) else [value]:
            if isinstance(x, float) and not math.isfinite(x):
                raise UserError(f"--{f.name} {x}: not a finite number. Pass a value such as the default "
                                f"{default}.")
            for word, ok, bound in f.metadata["range"]:
                if not ok(x, bound):
                    raise UserError(f"--{f.name} {x}: must be {word} {bound:g}.{note} Pass a value in "
                                    f"range, e.g. the default {default}.")


def flag_text(name: str, value: Any) -> str:
    """A flag as a user types it: --tau 0.05, --no_mlp, --no-modulate, --phi 0.01 0.02."""
    if isinstance(value, bool):
        return f"--{name}" if value else f"--no-{name}"
    values = value if isinstance(value, list) else [value]
    return " ".join([f"--{name}", *(f"{v:g}" if isinstance(v, float) else str(v) for v in values)])


def defaults_of(args: Any) -> Any:
    return type(args)(**(getattr(type(args), "CSV_DEFAULTS", {}) if _csv(args) else {}))


def _csv(args: Any) -> bool:
    return str(getattr(args, "data", "")).lower().endswith(".csv")     # SimCSE's supervised form


def changed_flags(args: Any, leave_out: tuple[str, ...] = NOT_TRAINING) -> dict[str, Any]:
    defaults = defaults_of(args)
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(args)
            if f.name not in leave_out and getattr(args, f.name) != getattr(defaults, f.name)}


def flags_of(args: Any, leave_out: tuple[str, ...] = ()) -> dict:
    """The flags as args.json holds them (JSON's types: a path as its text), but those in `leave_out`."""
    flags = json.loads(json.dumps(dataclasses.asdict(args), default=str))
    return {k: v for k, v in flags.items() if k not in leave_out}


def script_name(args: Any) -> str:
    """The script that declares `args` (an Args, or its class): simcse, focal_infonce, ..."""
    file = getattr(sys.modules.get(args.__module__), "__file__", None)
    return Path(file).resolve().stem if file else args.__module__       # a link: the script it points to


def default_output_dir(args: Any) -> str:
    """runs/<script>/<the flags that differ (a path by its last part)>, e.g. runs/focal_infonce/m0.2."""
    parts = [f"{name}-{Path(value).name or value}" if isinstance(value, str)
             else flag_text(name, value)[2:].replace(" ", "", 1).replace(" ", "-")
             for name, value in changed_flags(args).items()]
    name = "".join(c if c.isalnum() or c in "-_.+" else "-" for c in "_".join(parts)) or "default"
    if len(name.encode()) > 100:     # a file name holds 255 bytes at most: a long --data's would pass them
        name = f"{name.encode()[:90].decode(errors='ignore')}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"
    return str(Path("runs") / script_name(args) / name)


def did_you_mean(word: str, among: list[str], before: str = "") -> str:
    """'; did you mean --max_steps or --max_len?': the names `word` begins, else up to two look-alikes."""
    near = [o for o in among if o.startswith(word)][:3] or difflib.get_close_matches(word, among, 2, 0.75)
    return f"; did you mean {before}{' or '.join(near)}?" if near else "."


NUMBER = re.compile(r"-?(\d+\.?\d*|\.\d+)(e[-+]?\d+)?", re.I)     # -5 and -1e-3 are values, not flags


class Parser(argparse.ArgumentParser):
    """argparse whose refusal is one line, a UserError (exit status 2) naming the closest flag or value."""

    def error(self, message: str):
        flags = {o: a for a in self._actions for o in a.option_strings if o != "-h"}
        if message.startswith("unrecognized arguments: "):
            raise UserError(self.unknown(message.split(": ", 1)[1].split(" "), flags))
        m = re.fullmatch(r"argument ([^:/]+)\S*: (.*)", message, re.S)
        flag, what = m.groups() if m else ("", message)
        choice = re.match(r"invalid choice: (['\"])(.*?)\1", what)
        if choice and flag in flags:
            choices = [str(c) for c in flags[flag].choices]
            raise UserError(f"{flag} {choice[2]}: not one of {', '.join(choices)}"
                            f"{did_you_mean(choice[2], choices, f'{flag} ')}")
        default = getattr(self.defaults, flag[2:], "")
        shown = default not in ("", []) and default is not False       # a switch that is off: no example
        example = f", e.g. {flag_text(flag[2:], default)} (the default)" if shown else ""
        if kind := re.match(r"invalid (int|float) value: (['\"])(.*)\2", what):
            word = "a whole number" if kind[1] == "int" else "a number"
            raise UserError(f"{flag} {kind[3]}: not {word}. Pass {word}{example}.")
        raise UserError(f"{flag + ': ' if flag else ''}{what}{example}. `{self.command} --help` says what "
                        f"each flag takes.")

    def unknown(self, words: list[str], flags: dict[str, argparse.Action]) -> str:
        """Unknown flags, each with the closest; else a stray value."""
        said = [f"{word.split('=')[0]}: no such flag{did_you_mean(word.split('=')[0], list(flags))}"
                for word in words if word.startswith("-") and not NUMBER.fullmatch(word)]
        lines = said or [f"{' '.join(words)}: a value that no flag takes (a switch such as --resume takes "
                         f"none)."]
        return f"{' '.join(lines)} `{self.command} --help` lists every flag."


def build_parser(cls: type, description: str | None = None, prog: str | None = None) -> Parser:
    """argparse flags from a dataclass of arg() fields, each help line ending in [source] (default)."""
    parser = Parser(description=description, prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
                    allow_abbrev=False)         # --max_step is refused, not taken for --max_steps
    parser.command, parser.defaults = prog or f"python {script_name(cls)}.py", cls()    # for its refusals
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        default, hint, meta = getattr(parser.defaults, f.name), hints[f.name], f.metadata
        source = getattr(cls, "SOURCES", {}).get(f.name, meta["source"])
        text = f"{meta['help']} [{source}]" + ("" if default == "" else f" (default: {default})")
        kw: dict[str, Any] = {"default": argparse.SUPPRESS, "help": text}   # SUPPRESS: only the flags given
        kw.update({"choices": meta["choices"]} if meta["choices"] else {})    # a switch takes none
        if meta["positional"]:
            parser.add_argument(f.name, nargs="*", metavar=f.name.upper().rstrip("S"), **kw)
        elif hint is bool:
            action = argparse.BooleanOptionalAction if default else "store_true"
            parser.add_argument(f"--{f.name}", action=action, **kw)
        elif get_origin(hint) is list:
            parser.add_argument(f"--{f.name}", type=get_args(hint)[0], nargs="*", **kw)
        else:
            parser.add_argument(f"--{f.name}", type=hint, **kw)
    return parser


def parse_args(cls: type, argv: list[str] | None = None, description: str | None = None,
               prog: str | None = None) -> Any:
    """Every command's flags, each checked, then rules() between them: any flag's mistake is refused here."""
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
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(_same, a, b))
    numbers = isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool)
    return math.isclose(a, b, rel_tol=1e-9) if numbers else a == b


def _model_name(model: str) -> str:
    return Path(model.rstrip("/")).name.lower()     # FacebookAI/roberta-base, .../roberta-base/: roberta-base


def select_rows(args: Any, rows: Sequence[Any]) -> tuple[list[tuple[str, Any]], str]:
    """The rows (common.PaperRow) of the run's model (else the default's), data and flags, and a note."""
    defaults = defaults_of(args)
    free = {*NOT_TRAINING, *ROW_FREE, *type(args).OWN_ROW_FREE, "model"}
    stand_in = _model_name(args.model) not in {_model_name(r.model or defaults.model) for r in rows}
    model = _model_name(defaults.model if stand_in else args.model)
    csv_name = Path(args.data).name if _csv(args) else ""
    trained = [f.name for f in dataclasses.fields(args) if f.name not in free]
    picked = [(r.label + (f" [paper: {r.model or defaults.model}]" if stand_in else ""), r) for r in rows
              if _model_name(r.model or defaults.model) == model and r.data == csv_name
              and all(_same(getattr(args, k), r.flags.get(k, getattr(defaults, k))) for k in trained)]
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
