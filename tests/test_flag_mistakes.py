"""A mistyped flag as a newcomer types one, on every command: a prefix is refused, not taken for
the flag it begins; an unknown flag, a value that is no choice or no number, a value no flag
takes, each answered in one line (exit status 2) with the closest flag or value, not argparse's
usage; a non-finite number refused up front; a CSV's own defaults said in one line when they
apply. --help is argparse's own, and shows each docstring's commands as written."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import common
import conisi
import focal_infonce
import ifcl
import rcl
import simcse
from common import UserError
from plumbing import translation
from tools import bench, compare, download, translate
from tools import eval as eval_tool

SCRIPTS = {"simcse": simcse, "focal_infonce": focal_infonce, "ifcl": ifcl, "conisi": conisi, "rcl": rcl}
TOOLS = {"eval": eval_tool, "compare": compare, "download": download, "translate": translate, "bench": bench}


def one_line(main, argv: list[str], capsys) -> str:
    """All a command prints on stderr when it refuses its flags: one line, exit status 2."""
    with pytest.raises(SystemExit) as e:
        common.run_main(main, argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "usage:" not in err, err
    return err.rstrip("\n")


# (command, flags, the line): each flag a prefix of a real one, or a look-alike
MISTAKES = [
    *[(s, ["--max_step", "5"], f"error: --max_step: no such flag; did you mean --max_steps? "
                               f"`python {s}.py --help` lists every flag.") for s in SCRIPTS],
    ("simcse", ["--max", "5"], "error: --max: no such flag; did you mean --max_steps or --max_len or "
                               "--max_grad_norm? `python simcse.py --help` lists every flag."),
    ("simcse", ["--lrr", "1e-5", "--tauu", "0.1"], "error: --lrr: no such flag; did you mean --lr? --tauu: "
                                                   "no such flag; did you mean --tau? `python simcse.py "
                                                   "--help` lists every flag."),
    ("simcse", ["--max-steps", "5"], "error: --max-steps: no such flag; did you mean --max_steps? `python "
                                     "simcse.py --help` lists every flag."),
    ("simcse", ["--phi", "0.1"], "error: --phi: no such flag. `python simcse.py --help` lists every flag."),
    ("simcse", ["--no_mlp", "5"], "error: 5: a value that no flag takes (a switch such as --resume takes "
                                  "none). `python simcse.py --help` lists every flag."),
    ("simcse", ["--pooler", "clss"], "error: --pooler clss: not one of cls, cls_before_pooler, "
                                     "avg_first_last; did you mean --pooler cls?"),
    ("simcse", ["--max_steps", "x"], "error: --max_steps x: not a whole number. Pass a whole number, e.g. "
                                     "--max_steps 0 (the default)."),
    ("rcl", ["--phi", "0.1", "x"], "error: --phi x: not a number. Pass a number, e.g. --phi 0.01 0.02 0.03 "
                                   "0.04 (the default)."),
    ("simcse", ["--lr"], "error: --lr: expected one argument, e.g. --lr 3e-05 (the default). `python "
                         "simcse.py --help` says what each flag takes."),
    ("simcse", ["--no_mlp=3"], "error: --no_mlp: ignored explicit argument '3'. `python simcse.py --help` "
                               "says what each flag takes."),      # no example: --no-no_mlp is none
    ("eval", ["--batch", "4"], "error: --batch: no such flag; did you mean --batch_size? `python "
                               "tools/eval.py --help` lists every flag."),
    ("eval", ["--pooler", "mean"], "error: --pooler mean: not one of cls, cls_before_pooler, avg, "
                                   "avg_first_last, avg_top2."),
    ("compare", ["runs", "--basline", "x"], "error: --basline: no such flag; did you mean --baseline? "
                                            "`python tools/compare.py --help` lists every flag."),
    ("download", ["--wha", "sts"], "error: --wha: no such flag; did you mean --what? `python "
                                   "tools/download.py --help` lists every flag."),
    ("translate", ["--chunk", "5"], "error: --chunk: no such flag; did you mean --chunk_size? `python "
                                    "tools/translate.py --help` lists every flag."),
    ("bench", ["--step", "3"], "error: --step: no such flag; did you mean --steps? `python tools/bench.py "
                               "--help` lists every flag."),
]


@pytest.mark.parametrize("command,argv,line", MISTAKES, ids=[f"{c}:{' '.join(a)}" for c, a, _ in MISTAKES])
def test_a_mistyped_flag_is_answered_in_one_line_with_the_closest(command, argv, line, tmp_path,
                                                                   monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)              # a command that ran anyway would write here, not in the checkout
    main = {**SCRIPTS, **TOOLS}[command].main
    assert one_line(main, argv, capsys) == line


def test_max_steps_is_the_official_codes_name_too():
    assert common.parse_args(simcse.Args, ["--max_steps", "5"]).max_steps == 5


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_number_that_is_not_finite_is_refused_up_front(script):
    args_of = SCRIPTS[script].Args
    with pytest.raises(UserError, match=r"^--lr inf: not a finite number\. Pass a value such as the default "
                                        r"--lr [\d.e-]+\.$"):
        common.parse_args(args_of, ["--lr", "inf"])
    with pytest.raises(UserError, match=r"^--tau nan: not a finite number\."):
        common.parse_args(args_of, ["--tau", "nan"])


def test_a_list_with_a_number_that_is_not_finite_is_refused_too():
    with pytest.raises(UserError, match=r"^--phi inf: not a finite number\. Pass a value such as the "
                                        r"default --phi 0\.01 0\.02 0\.03 0\.04\.$"):
        common.parse_args(rcl.Args, ["--phi", "0.01", "inf"])


def test_a_csvs_defaults_are_said_in_one_line_when_they_apply(capsys, monkeypatch):
    common.parse_args(simcse.Args, ["--data", "data/nli_for_simcse.csv"])
    assert capsys.readouterr().err == (
        "note: --data data/nli_for_simcse.csv is a CSV, so these flags take the CSV's defaults: "
        "--batch_size 512 --lr 5e-05 --epochs 3 --pooler cls (a flag given on the command line wins)\n")
    args = common.parse_args(simcse.Args, ["--data", "pairs.CSV", "--batch_size", "8", "--pooler",
                                           "avg_first_last"])
    assert capsys.readouterr().err == (
        "note: --data pairs.CSV is a CSV, so these flags take the CSV's defaults: --lr 5e-05 --epochs 3 "
        "(a flag given on the command line wins)\n")
    assert (args.batch_size, args.pooler, args.lr, args.epochs) == (8, "avg_first_last", 5e-5, 3)
    # nothing to say: every such flag given, a text file, a script without CSV defaults, a rank > 0
    common.parse_args(simcse.Args, ["--data", "x.csv", "--batch_size", "8", "--lr", "1e-5", "--epochs", "1",
                                    "--pooler", "avg_first_last"])
    common.parse_args(simcse.Args, ["--data", "x.txt"])
    common.parse_args(rcl.Args, [])
    monkeypatch.setenv("RANK", "1")
    common.parse_args(simcse.Args, ["--data", "x.csv"])
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("command", [*SCRIPTS, *TOOLS])
def test_help_is_argparses_own_and_shows_the_docstrings_commands_as_written(command, capsys):
    """A docstring that is not raw turns a `\\` at a line's end into nothing: the example that
    continues on the next line would be shown as one line. Its --help shows every line of it."""
    module = {**SCRIPTS, **TOOLS}[command]
    shown = translation if command == "translate" else module     # translate's flags are translation's
    source = Path(shown.__file__).read_text(encoding="utf-8")
    literal = ast.parse(source).body[0].value
    assert ast.get_source_segment(source, literal).count("\n") == literal.value.count("\n"), \
        f"{shown.__file__}: a line of its docstring ends in a backslash that joins it to the next one"
    with pytest.raises(SystemExit) as e:
        module.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage: ")
    commands = [line for line in shown.__doc__.splitlines() if "python " in line]
    assert commands and all(line in out.splitlines() for line in commands)
