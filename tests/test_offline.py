"""A model by name, offline or mistyped: every command that loads one asks inputs.where_from
first. A folder passes; a path that is no folder is named with the folders beside it; a hub name
that is not in the local Hugging Face cache, with the hub unreachable or HF_HUB_OFFLINE=1, is
refused in one line within seconds (why, and what to do), before anything is written; a cached
one loads from the cache with no network retries (one failed request switches the libraries'
offline mode on for the process). Offline, a run names every piece it cannot have at once: the
data its defaults name and every model. A model folder whose JSON nests too deeply to read is
named in one line too.

The hub is made unreachable without the network: HF_ENDPOINT (or, in this process,
huggingface_hub's constants) points at a port of 127.0.0.1 that nobody listens on, and the
cache is a temporary folder (HF_HOME), filled with a tiny model where a test needs one."""

from __future__ import annotations

import http.server
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from huggingface_hub import constants
from test_compare import SIMCSE_ARGS, make_run
from test_flags import base_flags

import common
import conisi
import focal_infonce
import ifcl
import rcl
import simcse
from common import UserError
from conftest import ENV, ROOT
from plumbing import downloads, inputs
from tools import bench, compare, translate
from tools import eval as eval_tool

SCRIPTS = {"simcse": simcse, "focal_infonce": focal_infonce, "ifcl": ifcl, "conisi": conisi, "rcl": rcl}
NOBODY = "nobody/nothing"     # a hub name no cache holds
SHA = "0123456789abcdef0123456789abcdef01234567"


def free_port() -> int:
    """A port of 127.0.0.1 that nobody listens on (bound, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cache_model(hub: Path, name: str, folder: Path) -> None:
    """`folder`'s files as the Hugging Face cache keeps hub model `name` once downloaded."""
    repo = hub / f"models--{name.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / SHA)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """This process with the hub unreachable (its address a closed port), not in offline mode, and
    an empty cache: what huggingface_hub reads when where_from asks it. Returns the cache folder."""
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    inputs.hub_offline.cache_clear()
    yield cache
    inputs.hub_offline.cache_clear()


def unreachable_env(tmp_path: Path, port: int) -> dict[str, str]:
    """A command's environment with the hub unreachable and not in offline mode, its cache under tmp_path."""
    env = {k: v for k, v in ENV.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    return dict(env, HF_ENDPOINT=f"http://127.0.0.1:{port}", HF_HOME=str(tmp_path / "hf"))


# -------------------------------------------------------------------------------------
# where_from itself
# -------------------------------------------------------------------------------------

def test_a_hub_name_neither_cached_nor_reachable_is_refused_at_once_in_one_line(hub):
    t = time.perf_counter()
    with pytest.raises(UserError) as e:
        inputs.where_from(NOBODY)
    assert time.perf_counter() - t < inputs.HUB_WAIT_S
    assert str(e.value) == (
        f"--model {NOBODY}: neither a folder here nor in the local Hugging Face cache, and the hub cannot "
        f"be reached ({constants.ENDPOINT}: [Errno 111] Connection refused). Connect to download it, or pass "
        f"a local folder made where the hub is reachable: `hf download {NOBODY} --local-dir models/nothing`, "
        f"then --model models/nothing. With HF_HUB_OFFLINE=1 the hub is not asked.")
    # the process went offline: the libraries read their cache from now on, with no retries
    assert constants.HF_HUB_OFFLINE is True


def test_offline_mode_is_named_and_how_to_leave_it(hub, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError) as e:
        inputs.where_from(NOBODY, "--baseline")
    assert str(e.value) == (
        f"--baseline {NOBODY}: neither a folder here nor in the local Hugging Face cache, and "
        f"HF_HUB_OFFLINE=1 keeps the hub from being asked. Unset HF_HUB_OFFLINE to download it, or pass a "
        f"local folder made where the hub is reachable: `hf download {NOBODY} --local-dir models/nothing`, "
        f"then --baseline models/nothing.")


def test_a_cached_model_can_be_had_when_the_hub_cannot_be_asked(hub, tiny_bert, monkeypatch):
    cache_model(hub, "someone/tiny", tiny_bert)
    assert inputs.model_missing("someone/tiny") is None and constants.HF_HUB_OFFLINE is True
    inputs.hub_offline.cache_clear()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert inputs.model_missing("someone/tiny") is None
    assert inputs.model_missing("someone/tine").startswith("--model someone/tine: neither a folder here "
                                                           "nor in the local Hugging Face cache, and ")


def test_a_folder_passes_and_a_path_that_is_none_is_named_with_what_is_beside_it(hub, tmp_path, tiny_bert,
                                                                                  monkeypatch):
    inputs.where_from(str(tiny_bert))
    (tmp_path / "models" / "all-MiniLM-L6-v2").mkdir(parents=True)
    (tmp_path / "models" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    cases = {
        "./models/all-MiniLM-L6-v3": r"no such folder \(did you mean models/all-MiniLM-L6-v2\?\)\. Pass the "
                                     r"folder of a saved model \(config\.json, its weights and tokenizer\), "
                                     r"or a hub name\.$",
        "a/b/c": r"no such folder \(there is no folder a either\)\. Pass the folder",
        "models/config.json": r"is a file\. Pass the folder of a saved model",
        # a hub name by its form, but models/ is a folder here: the folders beside it are named too
        "models/all-MiniLM-L6-v3": r"neither a folder here \(did you mean models/all-MiniLM-L6-v2\?\) nor "
                                   r"in the local Hugging Face cache, and the hub cannot be reached ",
    }
    for name, msg in cases.items():
        with pytest.raises(UserError, match=rf"^--model {name}: {msg}"):
            inputs.where_from(name)


class _Hub(http.server.BaseHTTPRequestHandler):
    asked = 0

    def do_HEAD(self):
        type(self).asked += 1
        self.send_response(200)
        self.end_headers()

    def log_message(self, *a):
        pass


def test_a_hub_that_answers_is_left_to_transformers_and_asked_once_a_process(hub, monkeypatch):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        assert inputs.model_missing(NOBODY) is None and inputs.model_missing("bert-base-uncased") is None
        assert _Hub.asked == 1 and constants.HF_HUB_OFFLINE is False
    finally:
        server.shutdown()
        server.server_close()


def test_a_hub_that_does_not_answer_counts_as_unreachable_after_a_few_seconds(hub, monkeypatch):
    with socket.socket() as s:               # listening, never answering: the connection hangs
        s.bind(("127.0.0.1", 0))
        s.listen()
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{s.getsockname()[1]}")
        t = time.perf_counter()
        with pytest.raises(UserError, match=r"the hub cannot be reached \(http://127\.0\.0\.1:\d+: timed "
                                            r"out\)"):
            inputs.where_from(NOBODY)
        assert time.perf_counter() - t < inputs.HUB_WAIT_S + 3


# -------------------------------------------------------------------------------------
# Every command that loads a model by name, before anything is written (offline here:
# conftest sets HF_HUB_OFFLINE=1, and no cache holds NOBODY)
# -------------------------------------------------------------------------------------

def one_error_line(main, argv, capsys) -> str:
    """The one line a command ends with (exit status 2, no traceback)."""
    with pytest.raises(SystemExit) as e:
        common.run_main(main, [str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert e.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


OFFLINE = "neither a folder here nor in the local Hugging Face cache, and HF_HUB_OFFLINE=1 keeps the hub " \
    "from being asked."


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_names_a_model_it_cannot_have(script, tmp_path, tiny_bert, small_sts, corpus, parallel,
                                                   tiny_mbert, capsys):
    argv = base_flags(script, tmp_path, tiny_bert, small_sts, corpus, parallel, tiny_mbert)
    argv += ["--model", NOBODY]
    line = one_error_line(SCRIPTS[script].main, argv, capsys)
    assert line.startswith(f"error: --model {NOBODY}: {OFFLINE}"), line
    assert not (tmp_path / "run").exists()


def test_ifcl_names_its_fraternal_and_translation_models_before_anything_is_written(
        tmp_path, tiny_bert, small_sts, corpus, parallel, tiny_mbert, capsys):
    """--fraternal_model loads after the run folder and any translation: it is checked up front."""
    argv = base_flags("ifcl", tmp_path, tiny_bert, small_sts, corpus, parallel, tiny_mbert)
    line = one_error_line(ifcl.main, argv + ["--fraternal_model", NOBODY], capsys)
    assert line.startswith(f"error: --fraternal_model {NOBODY}: {OFFLINE}"), line
    no_german = [a for a in argv if a != str(parallel / "de.txt") and a != "--fraternal_data"]
    line = one_error_line(ifcl.main, no_german + ["--mt_model", NOBODY], capsys)
    assert line.startswith(f"error: --mt_model {NOBODY}: {OFFLINE}") and line.endswith(
        "the file can be made on another machine: `python tools/translate.py --data DATA --out FILE`, then "
        "--fraternal_data FILE."), line
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_the_tools_name_a_model_they_cannot_have(tmp_path, parallel, small_sts, capsys):
    line = one_error_line(translate.main, ["--data", parallel / "en.txt", "--mt_model", NOBODY,
                                           "--out", tmp_path / "de.txt"], capsys)
    assert line.startswith(f"error: --mt_model {NOBODY}: {OFFLINE}") and not list(tmp_path.iterdir())
    line = one_error_line(eval_tool.main, ["--model", NOBODY, "--sts_dir", small_sts], capsys)
    assert line.startswith(f"error: --model {NOBODY}: {OFFLINE}")
    run = make_run(tmp_path / "run", SIMCSE_ARGS, [70.0] * 7)
    line = one_error_line(compare.main, [run, "--baseline", NOBODY, "--sts_dir", small_sts], capsys)
    assert line.startswith(f"error: --baseline {NOBODY}: {OFFLINE}")
    # bench's --tokenizer, before minutes of timing
    line = one_error_line(bench.main, ["--config", "tiny", "--steps", "1", "--warmup", "0", "--no-baseline",
                                       "--sts_dir", small_sts, "--tokenizer", NOBODY], capsys)
    assert line.startswith(f"error: --tokenizer {NOBODY}: {OFFLINE}")


def test_files_are_checked_before_any_model(tmp_path, tiny_bert, small_sts, corpus, parallel, tiny_mbert,
                                            capsys):
    missing = tmp_path / "missing"
    for script in ("simcse", "focal_infonce", "ifcl", "rcl"):
        argv = base_flags(script, tmp_path, tiny_bert, small_sts, corpus, parallel, tiny_mbert)
        argv += ["--data", missing, "--model", NOBODY]
        assert one_error_line(SCRIPTS[script].main, argv, capsys).startswith(f"error: --data {missing}: ")
    line = one_error_line(eval_tool.main, ["--model", NOBODY, "--sts_dir", missing], capsys)
    assert line.startswith(f"error: --sts_dir {missing}: ")
    run = make_run(tmp_path / "run", SIMCSE_ARGS, [70.0] * 7)
    line = one_error_line(compare.main, [run, "--baseline", NOBODY, "--sts_dir", missing], capsys)
    assert line.startswith(f"error: --sts_dir {missing}: ")
    line = one_error_line(translate.main, ["--data", missing, "--mt_model", NOBODY], capsys)
    assert line.startswith(f"error: --data {missing}: ")


def test_conisi_checks_its_files_before_its_model(tmp_path, tiny_bert, small_sts, corpus, parallel,
                                                  tiny_mbert, capsys):
    argv = base_flags("conisi", tmp_path, tiny_bert, small_sts, corpus, parallel, tiny_mbert)
    line = one_error_line(conisi.main, argv + ["--data", tmp_path / "missing", "--model", NOBODY], capsys)
    assert line.startswith(f"error: --data {tmp_path / 'missing'}: ")


def test_offline_a_run_names_every_missing_piece_at_once(tmp_path, monkeypatch, capsys):
    """`python simcse.py` on a fresh clone with no network: the STS data, the training file and the
    model, each with what to place where, in one line; nothing is written, not even data/."""
    data = tmp_path / "clone" / "data"             # the clone's data/, as the flags' defaults name it
    monkeypatch.setattr(downloads, "DATA_DIR", data)
    argv = ["--data", data / downloads.WIKI1M, "--sts_dir", data / "sts", "--model", NOBODY,
            "--output_dir", tmp_path / "run"]
    line = one_error_line(simcse.main, argv, capsys)
    assert line.startswith(f"error: 3 things this run needs cannot be had here: (1) --model {NOBODY}: "
                           f"{OFFLINE} Unset HF_HUB_OFFLINE to download it, or pass a local folder made "
                           f"where the hub is reachable: `hf download {NOBODY} --local-dir models/nothing`, "
                           f"then --model models/nothing. "), line
    assert f"(2) --sts_dir {data / 'sts'}: not there, and HF_HUB_OFFLINE=1 keeps the hub from being asked. " \
        f"Run `python tools/download.py --what sts` where the network reaches huggingface.co, or put " \
        f"SentEval's STS/ and SICK/ folders there. (3) --data {data / downloads.WIKI1M}: not there, and " \
        f"HF_HUB_OFFLINE=1 keeps the hub from being asked. Run `python tools/download.py --what wiki1m` " \
        f"where the network reaches huggingface.co, or put the file there." in line, line
    assert not (tmp_path / "run").exists() and not (tmp_path / "clone").exists()


def test_ifcl_offline_names_its_three_models_at_once(tmp_path, small_sts, parallel, capsys):
    """IFCL's first run needs --model, --fraternal_model and the --mt_model that makes its German
    file: one line names the three, the MT model with how to make the file elsewhere."""
    argv = ["--model", NOBODY, "--fraternal_model", "nobody/fraternal", "--mt_model", "nobody/mt",
            "--data", parallel / "en.txt", "--sts_dir", small_sts, "--output_dir", tmp_path / "run",
            "--cache_dir", tmp_path / "c"]
    line = one_error_line(ifcl.main, argv, capsys)
    assert line.startswith(f"error: 3 things this run needs cannot be had here: (1) --model {NOBODY}: "
                           f"{OFFLINE} "), line
    assert f" (2) --fraternal_model nobody/fraternal: {OFFLINE} " in line and line.endswith(
        "then --mt_model models/mt. Translating --data needs it once (the German file is kept and reused); "
        "the file can be made on another machine: `python tools/translate.py --data DATA --out FILE`, then "
        "--fraternal_data FILE."), line
    assert " (3) --mt_model nobody/mt: " in line
    assert not (tmp_path / "run").exists() and not (tmp_path / "c").exists()


# -------------------------------------------------------------------------------------
# As a user meets it: a command of its own, the hub unreachable, no offline mode
# -------------------------------------------------------------------------------------

def test_a_command_offline_fails_in_seconds_with_no_retry_lines(tmp_path, small_sts):
    port = free_port()
    t = time.perf_counter()
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "eval.py"), "--model", NOBODY,
                        "--sts_dir", str(small_sts)], env=unreachable_env(tmp_path, port),
                       capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - t
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: --model {NOBODY}: neither a folder here nor in the local Hugging "
                               f"Face cache, and the hub cannot be reached (http://127.0.0.1:{port}: [Errno "
                               f"111] Connection refused). Connect to download it, or pass a local "
                               f"folder"), r.stderr
    assert seconds < 30, f"{seconds:.0f} s (the libraries' retries take about 25 s)"


def test_a_cached_model_loads_with_the_hub_unreachable_and_no_retries(tmp_path, tiny_bert, small_sts):
    cache_model(tmp_path / "hf" / "hub", "someone/tiny", tiny_bert)
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "eval.py"), "--model", "someone/tiny",
                        "--sts_dir", str(small_sts), "--tasks", "STS12"],
                       env=unreachable_env(tmp_path, free_port()), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "Retrying" not in r.stderr, r.stderr
    assert "tiny [cls_before_pooler]" in r.stdout
    seconds = float(r.stderr.rsplit("test split, ", 1)[1].split(" s)")[0])
    assert seconds < 30, f"{seconds:.0f} s to load and evaluate: the hub was asked"
