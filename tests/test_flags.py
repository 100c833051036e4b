"""Every flag is checked before anything is written: a table of bad values walked through
every script. Each must end with exit status 2, one `error: ...` line that names the flag and
the value and says what to pass instead, no traceback, and no --output_dir."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

import common
import conisi
import focal_infonce
import ifcl
import rcl
import simcse
from conftest import ROOT
from plumbing import flags as flags_module
from plumbing import inputs
from plumbing.flags import default_output_dir
from tools import bench, compare, download, translate
from tools import eval as eval_tool

SCRIPTS = {"simcse": simcse, "focal_infonce": focal_infonce, "ifcl": ifcl, "conisi": conisi, "rcl": rcl}

# (flags, regex the message must match); {x} are filled in per test
SHARED = [
    (["--max_len", "0"], r"--max_len 0: must be >= 1\. Pass a value in range, e\.g\. the default "
                         r"--max_len 32"),
    (["--max_len", "1000"], r"--max_len 1000: .*tiny_bert0 has.*256.*Pass --max_len (256|128) or less"),
    (["--lr", "-1"], r"--lr -1\.0: must be > 0\. .*the default --lr "),
    (["--lr", "0"], r"--lr 0\.0: must be > 0"),
    (["--epochs", "0", "--max_steps", "0"], r"--epochs 0: train at least one epoch, or give --max_steps N"),
    (["--max_steps", "-5"], r"--max_steps -5: must be >= 0"),
    (["--batch_size", "0"], r"--batch_size 0: must be >= [12]"),
    (["--batch_size", "100000"], r"--batch_size 100000 is larger than the data \(\d+ examples in --data "
                                 r".*\)\. "
                                 r"Lower --batch_size to at most \d+"),
    (["--seed", "-1"], r"--seed -1: must be >= 0"),
    (["--log_every", "0"], r"--log_every 0: must be >= 1"),
    (["--weight_decay", "-0.1"], r"--weight_decay -0\.1: must be >= 0"),
    (["--max_grad_norm", "-1"], r"--max_grad_norm -1\.0: must be >= 0"),
    (["--tau", "0"], r"--tau 0\.0: must be > 0"),
    (["--tau", "-0.05"], r"--tau -0\.05: must be > 0"),
    (["--sts_dir", "{tmp}/no-sts"], r"--sts_dir .*no-sts: expected STS/ and SICK/ inside.*python "
                                    r"tools/download\.py --what sts"),
    (["--data", "{tmp}/missing.txt"], r"--data .*missing\.txt: no such file"),
    (["--data", "{tmp}/empty.txt"], r"--data .*empty\.txt: the file has no sentences"),
    (["--data", "{tmp}/latin1.txt"], r"--data .*latin1\.txt: line 2 is not UTF-8.*iconv"),
    (["--data", "{tmp}"], r"--data .*: is a folder, not a file\. Pass a "),
    (["--output_dir", "{tmp}/afile"], r"--output_dir .*afile: is a file; it must be a folder"),
    (["--model", "{tmp}/no-model"], r"--model .*no-model: no such folder\. Pass the folder of a saved model"),
]
EVAL_EVERY = (["--eval_every", "0"], r"--eval_every 0: must be >= 1")
OWN = {
    "simcse": [EVAL_EVERY, (["--tau", "-1"], r"--tau -1\.0: must be > 0\. The paper's Tab\. D\.1 tries "
                                             r"0\.001 to 1"),
               (["--no_mlp", "--pooler", "cls"], r"--no_mlp with --pooler cls: .*--pooler "
                                                 r"cls_before_pooler")],
    "focal_infonce": [EVAL_EVERY, (["--data", "{tmp}/pairs.csv"], r"--data .*pairs\.csv: Focal-InfoNCE is "
                                                                  r"unsupervised"),
                      (["--m", "-2"], r"--m -2\.0: must be >= 0\. .*the paper uses 0\.1 to 0\.4 \(Tab\. "
                                      r"5\)\. "
                                      r"Pass a value in range, e\.g\. the default --m 0\.3"),
                      (["--m", "1"], r"--m 1\.0: must be < 1\."),
                      (["--tau", "0"], r"--tau 0\.0: must be > 0\. The paper's Tab\. 4 tries 0\.03 to 0\.1")],
    "ifcl": [EVAL_EVERY,
             (["--dropout", "1"], r"--dropout 1\.0: must be < 1\. A rate; the paper uses 0\.15"),
             (["--eps", "1.5"], r"--eps 1\.5: must be <= 1\. Eq\. \(3\) mixes the two embeddings; the "
                                r"paper uses 0\.9"),
             (["--lam", "-0.1"], r"--lam -0\.1: must be >= 0\. The paper uses 0\.002"),
             (["--queue_len", "-8"], r"--queue_len -8: must be >= 0\. The paper uses 416 and tries 320 to "
                                     r"512"),
             (["--tau", "0"], r"--tau 0\.0: must be > 0\. The paper uses 0\.05"),
             (["--omega_a", "1.5"], r"--omega_a 1\.5: must be <= 1\. A cosine similarity"),
             (["--omega_b", "-2"], r"--omega_b -2\.0: must be >= -1\. A cosine similarity"),
             (["--margin", "fixed", "--omega_a", "0.5"], r"--omega_a 0\.5 below --omega_b 0\.8: the "
                                                         r"identical twins"),
             (["--lam", "0.5"], r"--queue_len 20 with --lam 0\.5 and --batch_size 8: every forgetting "
                                r"coefficient 1 - lam\*ceil\(m/N\) must be positive"),
             (["--data", "{tmp}/pairs.csv"], r"--data .*pairs\.csv: IFCL is unsupervised")],
    "conisi": [EVAL_EVERY,
               (["--batch_size", "1"], r"--batch_size 1: must be >= 2"),
               (["--lam", "1.5"], r"--lam 1\.5: must be <= 1\. Eq\. \(10\) is a convex combination"),
               (["--replace_share", "-0.5"], r"--replace_share -0\.5: must be >= 0\. A share; the paper "
                                             r"gives none"),
               (["--random_share", "2"], r"--random_share 2\.0: must be <= 1\. A probability; the paper "
                                         r"uses 0\.8"),
               (["--dropout", "1"], r"--dropout 1\.0: must be < 1\. The paper uses 0\.1"),
               (["--tau", "0"], r"--tau 0\.0: must be > 0\. The paper uses 0\.05 \(Sec\. 4\.3\)"),
               (["--max_len", "200"], r"--max_len 200: the pairs Y and Z need up to 400 positions, more "
                                      r"than .* \(256\)\. Pass --max_len 128 or less"),
               (["--data", "{tmp}/pairs.csv"], r"--data .*pairs\.csv: ConIsI is self-supervised")],
    "rcl": [(["--eval_every", "-1"], r"--eval_every -1: must be >= 0"),
            (["--patience", "-1"], r"--patience -1: must be >= 0"),
            (["--final_hard_negatives"], r"--final_hard_negatives: --data .* has no hard_neg column"),
            (["--stop_every", "0"], r"--stop_every 0: must be >= 1\. Pass a value in range, e\.g\. the "
                                    r"default --stop_every 50"),
            (["--tau", "0"], r"--tau 0\.0: must be > 0\. The paper's equations have no temperature; ours "
                             r"is 0\.05")],
}
CASES = [(s, flags, msg) for s in SCRIPTS for flags, msg in SHARED + OWN[s]]


@pytest.fixture
def bad_files(tmp_path):
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "latin1.txt").write_bytes("fine\ncaf\xe9 au lait\n".encode("latin1"))
    (tmp_path / "pairs.csv").write_text("sent0,sent1\na,b\nc,d\n")
    (tmp_path / "afile").write_text("not a folder\n")
    return tmp_path


def base_flags(script: str, tmp_path, tiny_bert, small_sts, corpus, parallel, tiny_mbert) -> list[str]:
    """A command that passes every check: the bad flag comes after it, and wins."""
    flags = ["--model", str(tiny_bert), "--sts_dir", str(small_sts), "--output_dir", str(tmp_path / "run"),
             "--batch_size", "8", "--max_steps", "2", "--cache_dir", str(tmp_path / "cache")]
    if script == "ifcl":
        return flags + ["--data", str(parallel / "en.txt"), "--fraternal_data", str(parallel / "de.txt"),
                        "--fraternal_model", str(tiny_mbert), "--queue_len", "20"]
    return flags + ["--data", str(corpus)]


@pytest.mark.parametrize("script,flags,msg", CASES, ids=[f"{s}:{' '.join(f)}" for s, f, _ in CASES])
def test_bad_flag_exits_2_with_a_message_before_anything_is_written(
        script, flags, msg, bad_files, tiny_bert, small_sts, corpus, parallel, tiny_mbert, capsys):
    tmp = bad_files
    argv = base_flags(script, tmp, tiny_bert, small_sts, corpus, parallel, tiny_mbert)
    argv += [f.format(tmp=tmp) for f in flags]
    with pytest.raises(SystemExit) as e:
        common.run_main(SCRIPTS[script].main, argv)   # any other exception fails the test
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and re.search(msg, lines[0]), err
    assert "Traceback" not in err
    assert not (tmp / "run").exists()                 # nothing written to --output_dir


def test_the_valid_base_command_passes_every_check(tmp_path, tiny_bert, small_sts, corpus, parallel,
                                                   tiny_mbert, monkeypatch):
    """The table's base command is valid for every script (so each row fails for its own flag):
    the checks pass, and start() goes on to write the run folder."""
    for name, module in SCRIPTS.items():
        out = tmp_path / name
        argv = base_flags(name, out, tiny_bert, small_sts, corpus, parallel, tiny_mbert)
        args = common.parse_args(module.Args, argv)
        args.check()
        common.start(args)
        assert (out / "run" / "args.json").is_file()


def test_a_value_argparse_cannot_read_is_exit_2_too(tmp_path):
    """Through the real command line: a type or choice argparse refuses, and a range error."""
    for flags, msg in [(["--lr", "abc"], "error: --lr abc: not a number. Pass a number, e.g. --lr 3e-05 "
                                         "(the default)."),
                       (["--pooler", "mean"], "error: --pooler mean: not one of cls, cls_before_pooler, "
                                              "avg_first_last."),
                       (["--max_steps", "-5"], "error: --max_steps -5: must be >= 0")]:
        r = subprocess.run([sys.executable, str(ROOT / "simcse.py"), *flags, "--output_dir",
                            str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not (tmp_path / "run").exists()


def test_a_long_name_makes_a_default_run_folder_the_file_system_can_hold(tmp_path, monkeypatch):
    """The default run folder is named after the flags that differ, --data's file name among them:
    a name over 255 bytes could not be made (ENAMETOOLONG). A long one is cut, and a hash of the
    whole keeps two such names apart."""
    monkeypatch.chdir(tmp_path)
    outs = [default_output_dir(common.parse_args(simcse.Args, ["--data", f"data/{'x' * 296}{end}.txt"]))
            for end in "yz"]
    outs.append(default_output_dir(common.parse_args(simcse.Args, ["--data", f"{'d' * 200}.txt",
                                                                   "--model", "m" * 200])))
    assert len(set(outs)) == 3
    for out in outs:
        assert out.startswith("runs/simcse/") and max(len(p.encode()) for p in Path(out).parts) <= 100, out
        Path(out).mkdir(parents=True)
    short = common.parse_args(focal_infonce.Args, ["--m", "0.2"])
    assert default_output_dir(short) == "runs/focal_infonce/m0.2"            # a short name as it was


@pytest.mark.parametrize("script", SCRIPTS)
def test_an_args_constants_are_upper_case_not_read_as_fields(script):
    """SOURCES, CSV_DEFAULTS, OWN_ROW_FREE are class constants beside the flags: a lower-case name
    would read as one more field."""
    cls = SCRIPTS[script].Args
    fields = {f.name for f in dataclasses.fields(cls)}
    constants = [k for c in cls.__mro__[:-1] for k, v in vars(c).items()
                 if not k.startswith("_") and not callable(v) and k not in fields]
    assert constants and all(k.isupper() for k in constants), constants


RULES = [("simcse", ["--no_mlp", "--pooler", "cls"], "--no_mlp with --pooler cls"),
         ("simcse", ["--alpha", "2"], "--alpha 2 with --data x.txt"),
         ("focal_infonce", ["--data", "x.csv"], "--data x.csv: Focal-InfoNCE is unsupervised"),
         ("ifcl", ["--margin", "fixed", "--omega_a", "0.5"], "--omega_a 0.5 below --omega_b 0.8"),
         ("conisi", ["--data", "x.csv"], "--data x.csv: ConIsI is self-supervised")]


@pytest.mark.parametrize("script,argv,msg", RULES, ids=[f"{s}:{' '.join(a)}" for s, a, _ in RULES])
def test_the_rules_between_flags_are_checked_at_parse_time(script, argv, msg):
    with pytest.raises(common.UserError, match=re.escape(msg)):
        common.parse_args(SCRIPTS[script].Args, ["--data", "x.txt", *argv])


class Stop(Exception):
    pass


@pytest.mark.parametrize("script", SCRIPTS)
def test_ranges_and_rules_are_checked_once(script, tmp_path, tiny_bert, small_sts, corpus, parallel,
                                           tiny_mbert, monkeypatch):
    """parse_args checks both; start() goes on with what is left (here, up to reading --data)."""
    module, calls = SCRIPTS[script], []
    ranges, rules = flags_module.check_ranges, module.Args.rules
    monkeypatch.setattr(flags_module, "check_ranges", lambda args: calls.append("ranges") or ranges(args))
    monkeypatch.setattr(module.Args, "rules", lambda self: calls.append("rules") or rules(self))

    def stop(path):
        raise Stop

    monkeypatch.setattr(inputs, "read_columns", stop)
    with pytest.raises(Stop):
        module.main(base_flags(script, tmp_path, tiny_bert, small_sts, corpus, parallel, tiny_mbert))
    assert calls == ["ranges", "rules"]


def test_conisis_two_sentences_a_process_are_checked_once_torchrun_has_started(monkeypatch):
    """The one rule that needs the processes: settled in start(), after torchrun's group starts."""
    args = common.parse_args(conisi.Args, ["--batch_size", "3"])
    monkeypatch.setattr(common, "world", lambda: (0, 2))
    with pytest.raises(common.UserError, match=r"--batch_size 3: ConIsI needs at least 2 sentences per "
                                               r"process .* Use --batch_size 4 or more\."):
        args.settle(100)


@pytest.mark.parametrize("main,argv,msg", [
    (translate.main, ["--chunk_size", "0"], "--chunk_size 0: must be >= 1"),
    (translate.main, ["--num_beams", "0"], "--num_beams 0: must be >= 1"),
    (eval_tool.main, ["--batch_size", "0"], "--batch_size 0: must be >= 1"),
    (eval_tool.main, ["--split", "dev", "--tasks", "STS12"], "--tasks STS12 with --split dev: only"),
    (download.main, ["--what", "glove"], "--what glove: not one of wiki1m, nli, sts."),
    (compare.main, ["somewhere", "--batch_size", "-1"], "--batch_size -1: must be >= 1"),
    (bench.main, ["--steps", "0"], "--steps 0: must be >= 1"),
], ids=["translate-chunk", "translate-beams", "eval", "eval-dev-tasks", "download", "compare", "bench-steps"])
def test_the_other_commands_check_their_flags_too(main, argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        common.run_main(main, argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"error: {msg}" in err and "Traceback" not in err, err
