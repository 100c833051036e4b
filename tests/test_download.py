"""`python tools/download.py` and plumbing/downloads.py: each file proven whole by its content
before it is kept, nothing half-fetched left behind, what is there not fetched again, and errors
that say what failed and what to check (never to run the command that just failed), against a
local HTTP server."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest

import common
from common import UserError
from conftest import ROOT
from plumbing import downloads, inputs
from plumbing.sts_data import check_sts
from tools import download


class _Server:
    """A static HTTP server on 127.0.0.1 that counts requests per path."""

    def __init__(self, root: Path):
        counts: dict[str, int] = {}

        class H(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *a, **k):
                super().__init__(*a, directory=str(root), **k)

            def do_GET(self):
                counts[self.path] = counts.get(self.path, 0) + 1
                super().do_GET()

            def log_message(self, *a):
                pass

        self.counts = counts
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *a):
        self.httpd.shutdown()
        self.httpd.server_close()


def _senteval_tar(dest: Path, sts_dir: Path, drop: str | None = None) -> None:
    """SentEval's archive layout (downstream/STS, downstream/SICK), optionally with a file left out."""
    with tarfile.open(dest, "w") as tf:
        for sub in ("STS", "SICK"):
            for p in sorted((sts_dir / sub).rglob("*")):
                if p.is_file() and (drop is None or p.name != drop):
                    tf.add(p, arcname=f"downstream/{p.relative_to(sts_dir)}")


def test_download_checks_content_and_skips_present(tmp_path, full_sts, capsys):
    srv_root = tmp_path / "srv"
    srv_root.mkdir()
    (srv_root / downloads.WIKI1M).write_text("".join(f"sentence {i}\n" for i in range(50)))
    (srv_root / downloads.NLI).write_text("sent0,sent1,hard_neg\na,b,c\n\"d, e\",f,g\n")
    _senteval_tar(srv_root / downloads.SENTEVAL, full_sts)
    dest = tmp_path / "data"
    with _Server(srv_root) as srv:
        got = downloads.download(dest, check_sts, srv.url, wiki1m_lines=50)
        assert (dest / downloads.WIKI1M).read_text().count("\n") == 50
        assert (dest / downloads.NLI).exists()
        check_sts(got["sts"])
        assert sorted(p.name for p in dest.iterdir()) == sorted([downloads.WIKI1M, downloads.NLI, "sts"])
        before = dict(srv.counts)
        downloads.download(dest, check_sts, srv.url, wiki1m_lines=50)  # all present: no request
        assert srv.counts == before
        assert "present, not fetched again" in capsys.readouterr().err


def test_download_rejects_corrupt_files(tmp_path, full_sts):
    srv_root = tmp_path / "srv"
    srv_root.mkdir()
    (srv_root / downloads.WIKI1M).write_text("".join(f"s {i}\n" for i in range(49)))  # truncated
    (srv_root / downloads.NLI).write_text("premise,hypothesis\na,b\n")
    _senteval_tar(srv_root / downloads.SENTEVAL, full_sts, drop="STS.gs.FNWN.txt")
    dest = tmp_path / "data"
    with _Server(srv_root) as srv:
        with pytest.raises(UserError, match=r"wiki1m_for_simcse.txt: 49 lines where 50"):
            downloads.download(dest, check_sts, srv.url, what=["wiki1m"], wiki1m_lines=50)
        with pytest.raises(UserError, match="header"):
            downloads.download(dest, check_sts, srv.url, what=["nli"])
        with pytest.raises(UserError, match="STS13 cannot be read"):
            downloads.download(dest, check_sts, srv.url, what=["sts"])
        with pytest.raises(UserError, match="could not download"):
            downloads.download(dest, check_sts, srv.url + "/nothing-here", what=["nli"])
    # nothing that looks finished was left behind
    assert not (dest / downloads.WIKI1M).exists() and not (dest / downloads.NLI).exists()
    assert not (dest / "sts").exists() and not list(dest.glob("*.part"))


def test_download_cli_rejects_short_wiki1m(tmp_path):
    """The command line, with the real expected count: a short file is refused (exit 2), with
    what was wrong and what is true of the next try, and nothing is kept."""
    srv_root = tmp_path / "srv"
    srv_root.mkdir()
    (srv_root / downloads.WIKI1M).write_text("only\nthree\nlines\n")
    with _Server(srv_root) as srv:
        r = subprocess.run([sys.executable, str(ROOT / "tools" / "download.py"), "--dest",
                            str(tmp_path / "d"), "--base_url", srv.url, "--what", "wiki1m"],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "3 lines where 1000000 were expected" in r.stderr and "Traceback" not in r.stderr
    assert "It was not kept: the next try fetches it again from the start" in r.stderr
    assert not (tmp_path / "d" / downloads.WIKI1M).exists() and not list((tmp_path / "d").glob("*.part"))


def test_download_help_runs_and_a_bad_choice_is_exit_2():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "download.py"), "--help"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "usage: python tools/download.py" in r.stdout
    assert "--base_url" in r.stdout and "--what" in r.stdout
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "download.py"), "--what", "glove"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr == "error: --what glove: not one of wiki1m, nli, sts.\n"


class _CutServer(_Server):
    """Announces more bytes than it sends, then closes the connection: a download cut short."""

    def __init__(self):
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Length", "100000")
                self.end_headers()
                self.wfile.write(b"sent0,sent1,hard_neg\na,b,c\n")
                self.close_connection = True

            def log_message(self, *a):
                pass

        self.counts = {}
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)


def test_a_download_cut_short_is_refused_and_leaves_nothing(tmp_path):
    """urllib hands back the bytes of a closed connection as if they were all: the byte count is
    checked against Content-Length (here the bytes sent would pass the NLI file's own check)."""
    dest = tmp_path / "data"
    with _CutServer() as srv:
        with pytest.raises(UserError, match=r"could not download .*nli_for_simcse.csv: the connection "
                                            r"closed after 27 of its 100000 bytes\. Check the network"):
            downloads.download(dest, check_sts, srv.url, what=["nli"])
    assert not list(dest.iterdir())         # the temporary folder went with the file


def test_a_failed_download_says_what_to_check_not_to_run_it_again(tmp_path, capsys):
    """No server at the address: exit 2 from the command, naming the address, the network, the
    disk and a mirror; it says what the next try does, and does not tell the user to run the
    download command that failed."""
    import socket
    with socket.socket() as s:                       # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(SystemExit) as e:
        common.run_main(download.main, ["--dest", str(tmp_path / "d"), "--base_url", url, "--what", "nli"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    assert f"could not download {url}/nli_for_simcse.csv" in err
    assert "Check the network" in err and "free disk space" in err and "--base_url URL" in err
    assert "the next try fetches it from the start" in err
    assert "download` again" not in err and "python common.py" not in err
    assert not list((tmp_path / "d").iterdir())


# -------------------------------------------------------------------------------------
# The defaults' data/ from any working folder; a run's first use fetches what they name
# -------------------------------------------------------------------------------------

DEFAULTS = """
import json, sys
sys.path.insert(0, sys.argv[1])
import common, conisi, focal_infonce, ifcl, rcl, simcse
from plumbing import downloads, translation
from tools import download
field = lambda cls, name: cls.__dataclass_fields__[name].default
print(json.dumps({"DATA_DIR": str(downloads.DATA_DIR), "sts_dir": field(common.TrainArgs, "sts_dir"),
                  **{m.__name__: field(m.Args, "data") for m in (simcse, focal_infonce, ifcl, conisi, rcl)},
                  "translate": field(translation.TranslateArgs, "data"),
                  "dest": field(download.DownloadArgs, "dest")}))
"""


@pytest.mark.parametrize("where", ["root", "inside", "elsewhere"])
def test_the_defaults_name_the_repository_data_from_any_working_folder(where, tmp_path):
    """From the repository's root they read as the docs write them (args.json, folder names and
    --help unchanged); from a folder inside it, relative to it; from anywhere else, the clone's
    data/ by its absolute path (not a second download into the working folder's data/)."""
    cwd = {"root": ROOT, "inside": ROOT / "tests", "elsewhere": tmp_path}[where]
    r = subprocess.run([sys.executable, "-c", DEFAULTS, str(ROOT)], cwd=cwd, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    data = {"root": "data", "inside": "../data", "elsewhere": str(ROOT / "data")}[where]
    assert got == {"DATA_DIR": data, "sts_dir": f"{data}/sts", "simcse": f"{data}/wiki1m_for_simcse.txt",
                   "focal_infonce": f"{data}/wiki1m_for_simcse.txt", "ifcl": f"{data}/wiki1m_for_simcse.txt",
                   "conisi": f"{data}/wiki1m_for_simcse.txt", "rcl": f"{data}/nli_for_simcse.csv",
                   "translate": f"{data}/wiki1m_for_simcse.txt", "dest": data}
    assert (cwd / got["simcse"]).resolve() == ROOT / "data" / downloads.WIKI1M


def test_a_run_fetches_what_its_defaults_name_on_first_use(tmp_path, full_sts, monkeypatch, capsys):
    """missing_pieces with the hub answering: the STS data and the NLI file the defaults name are
    fetched into data/ (once: the next run finds them); a model that can be had passes."""
    srv_root = tmp_path / "srv"
    srv_root.mkdir()
    (srv_root / downloads.NLI).write_text("sent0,sent1,hard_neg\na,b,c\n")
    _senteval_tar(srv_root / downloads.SENTEVAL, full_sts)
    data = tmp_path / "clone" / "data"
    monkeypatch.setattr(downloads, "DATA_DIR", data)
    monkeypatch.setattr(inputs, "hub_offline", lambda: None)
    with _Server(srv_root) as srv:
        monkeypatch.setattr(downloads, "UPSTREAM", srv.url)
        for _ in range(2):
            downloads.missing_pieces(data / downloads.NLI, data / "sts", check_sts, {})
        assert srv.counts == {f"/{downloads.SENTEVAL}": 1, f"/{downloads.NLI}": 1}
    check_sts(data / "sts")
    assert (data / downloads.NLI).read_text() == "sent0,sent1,hard_neg\na,b,c\n"
    assert sorted(p.name for p in data.iterdir()) == [downloads.NLI, "sts"]


def test_a_download_that_fails_is_named_with_the_rest(tmp_path, tiny_bert, monkeypatch):
    """The hub answers but the file cannot be had: named as a piece, with what the download said
    and where to place the file by hand, beside every other piece; nothing is left behind."""
    data = tmp_path / "clone" / "data"
    monkeypatch.setattr(downloads, "DATA_DIR", data)
    monkeypatch.setattr(inputs, "hub_offline", lambda: None)
    with _Server(tmp_path) as srv:                   # serves no such file
        monkeypatch.setattr(downloads, "UPSTREAM", srv.url)
        with pytest.raises(UserError) as e:
            downloads.missing_pieces(data / downloads.WIKI1M, data / "sts", check_sts,
                                     {"--model": (str(tmp_path / "typo"), "")})
    msg = str(e.value)
    assert msg.startswith(f"3 things this run needs cannot be had here: (1) --model {tmp_path / 'typo'}: "
                          f"no such folder"), msg
    assert f"(2) --sts_dir {data / 'sts'}: not there, and its download failed (could not download " \
        f"{srv.url}/{downloads.SENTEVAL}: HTTP Error 404" in msg
    assert f"(3) --data {data / downloads.WIKI1M}: not there, and its download failed (could not " \
        f"download {srv.url}/{downloads.WIKI1M}: HTTP Error 404" in msg
    assert msg.endswith("Run `python tools/download.py --what wiki1m` where the network reaches "
                        "huggingface.co, or put the file there.")
    assert not [p for p in (tmp_path / "clone").rglob("*") if not p.is_dir()]
    # a path of the user's that is not there is a typo, named alone by the checks that follow
    downloads.missing_pieces(tmp_path / "mine.txt", data / "sts", check_sts,
                             {"--model": (str(tmp_path / "typo"), "")})
