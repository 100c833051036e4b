"""The annotated pages of docs/pages/ (tools/pages.py, house style rule 13).

Without a browser: every equation a script names has one typeset form in docs/equations.tex and
every typeset form is named by its script; a build is the same twice, byte for byte (whether the
committed pages are today's is `python tools/check_house.py`); a malformed formula stops the build
naming the script, the equation and KaTeX's message;
a script with no comment block still makes a page; the pages link what they say they link.

In a real browser (Debian's chromium, driven through chromedriver's WebDriver protocol by the small
client below), every page at 1280 and at 400 px wide: no console or CSP error, no request that is
not a file of the clone, every equation typeset with no error element, at 1280 px each equation's
box left of its code, at 400 px nothing wider than the screen; light and dark as the system says.
A screenshot of each page at both widths goes to tests/screenshots/ (PAGES_SCREENSHOTS moves it).

What these tests need beyond pytest skips with the command that installs it (node and the pinned
KaTeX: `npm ci --prefix tools/katex`; the pinned Pygments; chromium and chromium-driver), except
under CI (CI=true), where `.ci/run` installs all of it and a missing piece fails the test.
"""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT
from tools import pages

CI = os.environ.get("CI", "").lower() == "true"
OUT = ROOT / pages.OUT
DOC_FILES = [f"doc-{p.stem}.html" for p in sorted((ROOT / "docs").glob("*.md"))]   # docs/*.md, rendered
PAGE_FILES = [f"{Path(s).stem}.html" for s in pages.SCRIPTS] + DOC_FILES + ["index.html"]
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")


def need(missing: str | None) -> None:
    """Skip naming what to install, or fail under CI, where .ci/run installs it."""
    if missing:
        if CI:
            pytest.fail(f"{missing} (under CI, .ci/run installs it)")
        pytest.skip(missing)


# ------------------------------------------------------------------------------------
# The equations: one typeset form per equation named, both ways
# ------------------------------------------------------------------------------------

def test_each_equation_a_script_names_has_one_typeset_form_and_each_form_is_named():
    equations = pages.read_equations(ROOT / pages.EQUATIONS)
    assert pages.coverage(ROOT, pages.SCRIPTS, equations) == []
    for script in pages.PAPERS:       # every method script names equations of its paper
        assert any(s == script for s, _ in equations), script


def test_coverage_fails_both_ways(tmp_path):
    (tmp_path / "m.py").write_text('"""Eq. (1) and Eqs. (3)-(4)."""\n')
    (tmp_path / "eq.tex").write_text("%% m.py Eq. (1)\nx\n%% m.py Eq. (2)\ny\n")
    wrong = pages.coverage(tmp_path, ("m.py",), pages.read_equations(tmp_path / "eq.tex"))
    assert len(wrong) == 3, wrong
    assert "m.py:1 names Eq. (3), which has no typeset form" in wrong[0]
    assert "m.py:1 names Eq. (4)" in wrong[1]
    assert "m.py Eq. (2) is typeset, but m.py names no Eq. (2)" in wrong[2]


@pytest.mark.parametrize("text, numbers", [
    ("Eq. (4): l_i = ...", [4]), ("(Eq. 4)", [4]), ("Eq. (3)-(4): l_i", [3, 4]), ("Eq. 2-4", [2, 3, 4]),
    ("(Eq. 4, 6)", [4, 6]), ("Eq. (2) / (6): h", [2, 6]), ("Eqs. (8)-(9)", [8, 9]),
    ("Eq. (6) and (7)", [6, 7]), ("Eq. (10), lam 0", [10]), ("Eq. 2's term", [2]),
    ("Eq. (4), 0.8 of it", [4]), ("Eq. (1)-(3) have", [1, 2, 3]), ("Tab. 4, Sec. 3", []),
])
def test_the_equations_a_line_names(text, numbers):
    assert [n for m in pages.MENTION.finditer(text) for n in pages.mention_numbers(m.group())] == numbers


def test_where_each_equation_is_typeset(tmp_path):
    """Beside the first comment that opens with it; else its first mention in a docstring of a
    function or class, else in a comment, else in code, else in the module's docstring."""
    (tmp_path / "m.py").write_text(
        '"""Eq. (1), Eq. (2), Eq. (3), Eq. (4), Eq. (6)."""\n'     # 1
        'x = dict(help="names Eq. (3) and Eq. (4)")\n'            # 2
        "# a comment naming Eq. (2) and Eq. (4)\n"                # 3
        "def f():\n"                                              # 4
        '    """Eq. (2) and Eq. (5) here."""\n'                   # 5
        "    # Eq. (1): y = x\n"                                  # 6
        "    return x\n"                                          # 7
        "# Eq. (5): the defining line, later\n")                  # 8
    script = pages.read_script(tmp_path / "m.py", "m.py")
    assert pages.anchors(script, [1, 2, 3, 4, 5, 6]) == {1: 6, 2: 5, 3: 2, 4: 3, 5: 8, 6: 1}


def test_equations_file_mistakes_are_named(tmp_path):
    eq = tmp_path / "eq.tex"
    eq.write_text("%% m.py Eq. (1)\nx\n%% m.py Eq. (1)\ny\n")
    with pytest.raises(pages.BuildError, match=r"eq.tex:3: m.py Eq. \(1\) is typeset twice"):
        pages.read_equations(eq)
    eq.write_text("%% m.py Eq. (1)\n% only a comment\n")
    with pytest.raises(pages.BuildError, match=r"eq.tex:1: m.py Eq. \(1\) has a header but no LaTeX"):
        pages.read_equations(eq)


# ------------------------------------------------------------------------------------
# The build: fresh pages, bad input
# ------------------------------------------------------------------------------------

def test_a_fresh_build_is_the_same_twice_and_makes_every_page():
    """Whether the committed pages are what it makes is `python tools/check_house.py`, not a test:
    an edited script need not fail pytest for a page nobody asked to rebuild."""
    need(pages.katex_ready())
    need(pages.pygments_differs())
    start = time.perf_counter()
    files = pages.generate()
    seconds = time.perf_counter() - start
    assert pages.generate() == files                     # deterministic: a second build, byte for byte
    assert sorted(f for f in files if f.endswith(".html")) == sorted(PAGE_FILES)
    assert seconds < 30, f"the build took {seconds:.1f} s"


def test_a_stale_page_is_found(tmp_path):
    files = {"a.html": b"<p>new</p>", "assets/equations.css": b""}
    (tmp_path / "assets").mkdir()
    (tmp_path / "a.html").write_bytes(b"<p>old</p>")
    (tmp_path / "b.html").write_bytes(b"")
    (tmp_path / "assets" / "pages.css").write_bytes(b"")
    assert pages.stale(files, tmp_path) == ["a.html: differs from a fresh build",
                                            "assets/equations.css: missing", "b.html: not made by the build"]


def test_a_malformed_formula_fails_the_build_naming_script_equation_and_katex(tmp_path):
    need(pages.katex_ready())
    (tmp_path / "docs").mkdir()
    (tmp_path / "m.py").write_text("def f(x):\n    # Eq. (3): y = x / 2\n    return x / 2\n")
    (tmp_path / "docs" / "equations.tex").write_text("% a comment\n%% m.py Eq. (3)\ny = \\frac{x}{2\n")
    with pytest.raises(pages.BuildError) as e:
        pages.generate(tmp_path, ("m.py",))
    message = str(e.value)
    assert "equations.tex:2: m.py Eq. (3): KaTeX parse error:" in message, message
    assert "expected '}'" in message, message


def test_the_command_says_what_is_wrong_and_exits_1(tmp_path, monkeypatch, capsys):
    need(pages.katex_ready())
    (tmp_path / "docs" / "pages").mkdir(parents=True)
    (tmp_path / "m.py").write_text("# Eq. (1): p_m = 1 - lambda * ceil(m / N)\np = 1\n")
    (tmp_path / "docs" / "equations.tex").write_text("%% m.py Eq. (1)\np_m = 1 - \\lambda \\frac{m}{N\n")
    monkeypatch.setattr(pages, "ROOT", tmp_path)
    monkeypatch.setattr(pages, "SCRIPTS", ("m.py",))
    assert pages.main([]) == 1
    out, err = capsys.readouterr()
    assert "error: KaTeX could not typeset:" in err and "m.py Eq. (1): KaTeX parse error" in err, err
    assert not out and not any((tmp_path / "docs" / "pages").iterdir())


def test_an_equation_named_in_code_only_is_typeset_in_the_code_just_above_that_line(tmp_path):
    need(pages.katex_ready())
    (tmp_path / "docs").mkdir()
    (tmp_path / "m.py").write_text('import math\nx = dict(help="Eq. (2) weighs it")\ny = math.pi\n')
    (tmp_path / "docs" / "equations.tex").write_text("%% m.py Eq. (2)\nw = \\lambda x\n")
    page = pages.generate(tmp_path, ("m.py",))["m.html"].decode()
    rows = re.findall(r'<section class="row">.*?</section>', page)
    row = next((r for r in rows if 'id="eq-2"' in r), None)
    assert row and 'named on <a href="#L2">line 2</a>' in row, page
    code = row.split('<div class="code">', 1)[1]
    assert 'id="L1"' in code and 'id="L3"' in code, "the code is split around the box"
    assert re.search(r'id="eq-2".*</div></div><pre><code><span class="line i0" id="L2">', code), code


def test_a_formula_comment_becomes_its_box_with_the_ascii_a_click_away(tmp_path):
    """The comment `# Eq. (n): ...` inside a function is shown once: typeset, in its place in the
    code, the script's ASCII folded inside the box; the function's code stays in one block, and
    a comment among the code is a note in it, not a new row."""
    need(pages.katex_ready())
    (tmp_path / "docs").mkdir()
    (tmp_path / "m.py").write_text(
        "def f(x):\n"                                   # 1
        "    # scale it first\n"                        # 2
        "    y = x / 2\n"                               # 3
        "    # Eq. (3): z = y ^ 2\n"                    # 4
        "    #     (the square)\n"                      # 5
        "    return y ** 2\n")                          # 6
    (tmp_path / "docs" / "equations.tex").write_text("%% m.py Eq. (3)\nz = y^2\n")
    page = pages.generate(tmp_path, ("m.py",))["m.html"].decode()
    rows = re.findall(r'<section class="row">.*?</section>', page)
    assert len(rows) == 1, rows
    code = rows[0].split('<div class="code">', 1)[1]
    assert code.index('id="L1"') < code.index('class="note i1" id="L2"') < code.index('id="L3"')
    box = code[code.index('id="eq-3"'):code.index('id="L6"')]
    assert '<details class="ascii"><summary>ASCII, as the script writes it (lines 4-5)</summary>' in box, box
    assert 'id="L4"' in box and 'id="L5"' in box and "katex" in box
    assert page.count("z = y ^ 2") == 1                 # the ASCII once, folded


def test_a_corrected_equation_is_typeset_beside_the_printed_one_and_held_to_the_script(tmp_path):
    need(pages.katex_ready())
    (tmp_path / "docs").mkdir()
    script = tmp_path / "m.py"
    script.write_text('def f(x):\n    """Eq. (4) is misprinted;\n    it is\n        dy/dx = 2 x\n    """\n'
                      "    return x * x\n")
    eqs = tmp_path / "docs" / "equations.tex"
    eqs.write_text("%% m.py Eq. (4)\ny' = 3x\n%% m.py Eq. (4), corrected\n% ascii: dy/dx = 2 x\ny' = 2x\n")
    page = pages.generate(tmp_path, ("m.py",))["m.html"].decode()
    assert page.count('class="eq-side') == 2 and "corrected" in page
    assert '<summary>ASCII of the corrected <a class="eqref" href="#eq-4">Eq. (4)</a>' in page
    script.write_text(script.read_text().replace("2 x", "2 * x"))
    with pytest.raises(pages.BuildError, match=r"Eq. \(4\), corrected: its `% ascii:` form is not in m.py"):
        pages.generate(tmp_path, ("m.py",))


def test_inline_maths_is_typeset_in_the_prose_and_held_to_the_script(tmp_path):
    need(pages.katex_ready())
    (tmp_path / "docs").mkdir()
    script = tmp_path / "m.py"
    script.write_text("# the weight alpha^{1_i^j} of the negative\nx = 1\n")
    (tmp_path / "docs" / "equations.tex").write_text("%% m.py inline: alpha^{1_i^j}\n\\alpha^{1_i^j}\n")
    page = pages.generate(tmp_path, ("m.py",))["m.html"].decode()
    assert '<span class="im" title="alpha^{1_i^j}"><span class="katex">' in page, page
    script.write_text("# the weight alpha of the negative\nx = 1\n")
    with pytest.raises(pages.BuildError, match=r"m.py inline 'alpha\^\{1_i\^j\}': no comment or docstring"):
        pages.generate(tmp_path, ("m.py",))


def test_a_script_without_comment_blocks_still_makes_a_page(tmp_path):
    (tmp_path / "bare.py").write_text("import math\n\nx = math.pi\n\n\ndef f(a):\n    return a * x  # (N,)\n")
    files = pages.generate(tmp_path, ("bare.py",))
    page = files["bare.html"].decode()
    for n in range(1, 8):
        assert page.count(f'id="L{n}"') == 1, n
    assert '<span class="k">def</span> <span class="nf">f</span>' in page
    assert '<span class="c"># (N,)</span>' in page                 # a shape comment stays in the code
    assert "bare.py" in files["index.html"].decode()


# ------------------------------------------------------------------------------------
# What the committed pages hold and link
# ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", PAGE_FILES)
def test_a_page_fetches_nothing_and_its_links_resolve(name):
    page = (OUT / name).read_text(encoding="utf-8")
    assert f'<meta http-equiv="Content-Security-Policy" content="{pages.CSP}">' in page
    assert "<script" not in page and not re.search(r"\sstyle=", page)
    assert "<img" not in page or name in DOC_FILES      # docs/*.md show their figures, files of the clone
    for ref in re.findall(r'<link rel="stylesheet" href="([^"]+)"', page):
        assert (OUT / ref).is_file(), ref
    ids = re.findall(r' id="([^"]+)"', page)
    assert len(ids) == len(set(ids)), "an id is used twice"
    for href in re.findall(r'(?:href|src)="([^"]+)"', page):
        if href.startswith("https://"):     # a script's page links its paper; docs/*.md link more
            assert name in DOC_FILES or re.match(r"https://(arxiv\.org/abs/|aclanthology\.org/)", href), href
            continue
        path, _, anchor = href.partition("#")
        target = (OUT / path).resolve() if path else OUT / name
        assert target.exists(), href
        if anchor:
            assert f'id="{anchor}"' in target.read_text(encoding="utf-8"), href


@pytest.fixture(scope="module")
def fresh() -> dict[str, bytes]:
    """The pages as today's scripts make them (not the committed ones, which a student's edit leaves
    behind until `python tools/pages.py`: check_house names those)."""
    need(pages.katex_ready())
    need(pages.pygments_differs())
    return pages.generate()


@pytest.mark.parametrize("script", pages.SCRIPTS)
def test_every_line_of_a_script_has_its_anchor_and_every_equation_its_box(script, fresh):
    page = fresh[f"{Path(script).stem}.html"].decode("utf-8")
    lines = (ROOT / script).read_text(encoding="utf-8").splitlines()
    for n in range(1, len(lines) + 1):
        assert page.count(f'id="L{n}"') == 1, f"{script}:{n}"
    named = pages.named_equations("\n".join(lines))
    assert sorted(int(n) for n in re.findall(r'<div class="eq" id="eq-(\d+)"', page)) == sorted(named)
    if script != "common.py":
        for name in re.findall(r"\bcommon\.([A-Za-z_]\w*)\(", "\n".join(lines)):
            assert f'href="common.html#{name}"' in page, name


def test_a_script_page_links_its_method_page_as_html():
    for script in pages.PAPERS:
        stem = Path(script).stem
        page = (OUT / f"{stem}.html").read_text(encoding="utf-8")
        assert f'Method page: <a href="doc-{stem}.html">' in page, stem
        doc = (OUT / f"doc-{stem}.html").read_text(encoding="utf-8")
        assert "<h1" in doc and f'href="{stem}.html"' in doc and "<table>" in doc, stem


def test_readme_and_each_method_page_link_the_pages():
    assert "docs/pages/index.html" in (ROOT / "README.md").read_text(encoding="utf-8")
    for script in pages.PAPERS:
        stem = Path(script).stem
        assert f"(pages/{stem}.html)" in (ROOT / "docs" / f"{stem}.md").read_text(encoding="utf-8"), stem


# ------------------------------------------------------------------------------------
# In a real browser
# ------------------------------------------------------------------------------------

class WebDriver:
    """Just enough of the W3C WebDriver protocol (plain HTTP and JSON) to drive chromedriver."""

    def __init__(self, user_data: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.process = subprocess.Popen([str(CHROMEDRIVER), f"--port={self.port}"], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        for _ in range(1200):           # a cold start on a loaded machine took over 10 s once
            try:
                self.call("GET", "/status")
                break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.05)
        args = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--hide-scrollbars", f"--user-data-dir={user_data}"]
        caps = {"browserName": "chrome", "goog:chromeOptions": {"binary": str(CHROMIUM), "args": args},
                "goog:loggingPrefs": {"browser": "ALL", "performance": "ALL"}}
        self.session = self.call("POST", "/session", {"capabilities": {"alwaysMatch": caps}})["sessionId"]

    def call(self, method: str, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as answer:
            return json.load(answer)["value"]

    def do(self, method: str, path: str, body: dict | None = None):
        return self.call(method, f"/session/{self.session}{path}", body)

    def js(self, script: str, *args):
        return self.do("POST", "/execute/sync", {"script": script, "args": list(args)})

    def cdp(self, cmd: str, params: dict):
        return self.do("POST", "/goog/cdp/execute", {"cmd": cmd, "params": params})

    def logs(self, kind: str) -> list[dict]:
        return self.do("POST", "/se/log", {"type": kind})

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.do("GET", "/screenshot")))

    def quit(self) -> None:
        try:
            self.do("DELETE", "")
        finally:
            self.process.terminate()
            self.process.wait(timeout=30)


def browser_missing() -> str | None:
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        return ("no headless browser: install Debian's chromium and chromium-driver "
                "(apt-get install chromium chromium-driver)")
    return None


@pytest.fixture(scope="module")
def browser():
    need(browser_missing())
    with tempfile.TemporaryDirectory() as profile:
        driver = WebDriver(Path(profile))
        try:
            yield driver
        finally:
            driver.quit()


@pytest.fixture(scope="module")
def shots() -> Path:
    folder = Path(os.environ.get("PAGES_SCREENSHOTS") or ROOT / "tests" / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    print(f"\nscreenshots of the pages: {folder}")
    return folder


def open_page(browser: WebDriver, name: str, width: int, dark: bool = False) -> dict:
    """Load a page at `width` px; what it logged and requested while loading."""
    browser.logs("browser"), browser.logs("performance")          # empty both logs
    browser.cdp("Emulation.setDeviceMetricsOverride", {"width": width, "height": 900, "deviceScaleFactor": 1,
                                                       "mobile": width < 600})
    browser.cdp("Emulation.setEmulatedMedia", {"features": [{"name": "prefers-color-scheme",
                                                             "value": "dark" if dark else "light"}]})
    url = (OUT / name).as_uri()
    browser.do("POST", "/url", {"url": url})
    browser.js("return document.fonts.ready.then(() => true)")
    requests = []          # what the page asked for (the browser's own tabs, started with it, aside)
    for entry in browser.logs("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent" and message["params"].get("documentURL") == url:
            requests.append(message["params"]["request"]["url"])
    return {"console": browser.logs("browser"), "requests": requests}


MEASURE = """
const eqs = [...document.querySelectorAll('.eq')].map(eq => {
  const box = eq.getBoundingClientRect();
  const code = eq.closest('.row').querySelector('.code').getBoundingClientRect();
  return {id: eq.id, left: box.left, right: box.right, top: box.top, bottom: box.bottom,
          codeLeft: code.left, codeWidth: code.width, codeTop: code.top, codeBottom: code.bottom,
          typeset: eq.querySelectorAll('.eq-math .katex-display .katex-html').length,
          corrected: eq.querySelectorAll('.eq-side.fixed .eq-math .katex-display').length,
          height: eq.querySelector('.eq-math').getBoundingClientRect().height};
});
return {eqs, errors: document.querySelectorAll('.katex-error').length,
        width: document.documentElement.clientWidth, innerWidth: innerWidth,
        scrollWidth: Math.max(document.documentElement.scrollWidth, document.body.scrollWidth),
        fonts: [...document.fonts].filter(f => f.status === 'loaded').map(f => f.family),
        background: getComputedStyle(document.body).backgroundColor};
"""


@pytest.mark.parametrize("width", [1280, 400])
@pytest.mark.parametrize("name", PAGE_FILES)
def test_a_page_in_a_real_browser(browser, shots, name, width):
    loaded = open_page(browser, name, width)
    assert loaded["console"] == [], f"{name} at {width} px logged: {loaded['console']}"
    assert loaded["requests"], "the browser's network log is empty: the check below would see nothing"
    mine = (OUT.parent if name in DOC_FILES else OUT).as_uri() + "/"     # docs/*.md show docs/'s figures
    outside = [u for u in loaded["requests"] if not u.startswith(mine)]
    assert outside == [], f"{name} asked for what is not a file of docs/pages/: {outside}"
    page = browser.js(MEASURE)
    assert page["innerWidth"] == width
    assert page["errors"] == 0
    expected = len(re.findall(r'<div class="eq" id=', (OUT / name).read_text(encoding="utf-8")))
    assert len(page["eqs"]) == expected
    for eq in page["eqs"]:
        assert eq["typeset"] == 1 + eq["corrected"] and eq["height"] > 20, eq
    if expected:
        assert {"KaTeX_Main", "KaTeX_Math"} <= set(page["fonts"]), page["fonts"]
    if width >= 1000:
        for eq in page["eqs"]:
            where = f"{name} {eq['id']} at 1280 px: {eq}"
            assert eq["codeWidth"] > 300 and eq["right"] <= width, f"cut off: {where}"
            assert eq["top"] < eq["codeBottom"] and eq["bottom"] > eq["codeTop"], f"not beside code: {where}"
    else:
        assert page["scrollWidth"] <= page["width"], f"{name} is {page['scrollWidth']} px wide at {width} px"
        for eq in page["eqs"]:
            assert 0 <= eq["left"] and eq["right"] <= width, eq
    stem = Path(name).stem
    browser.js("window.scrollTo(0, 0)")
    browser.screenshot(shots / f"{stem}-{width}.png")
    if page["eqs"]:
        browser.js("document.getElementById(arguments[0]).scrollIntoView()", page["eqs"][0]["id"])
        browser.screenshot(shots / f"{stem}-{width}-{page['eqs'][0]['id']}.png")


LINES = """
const lines = [...document.querySelectorAll('.code .line')]
  .filter(l => l.offsetParent !== null && !l.closest('details:not([open])'));
const cut = lines.filter(l => {
  const height = l.getBoundingClientRect().height, one = parseFloat(getComputedStyle(l).lineHeight);
  return l.scrollWidth > l.clientWidth + 0.5 || height > one * 1.5;
}).map(l => l.id);
const wide = [...document.querySelectorAll('.code')].filter(c => c.scrollWidth > c.clientWidth + 0.5).length;
const tops = {}, columns = [...document.querySelectorAll('.code')];
for (const l of lines) {
  const r = l.getBoundingClientRect();
  tops[l.id] = [r.top + scrollY, r.bottom + scrollY, columns.indexOf(l.closest('.code'))];
}
return {count: lines.length, cut, wide, tops};
"""


def functions(script: str) -> list[tuple[str, list[int]]]:
    """Each function of a script (methods and nested ones too) and the lines of code in its body."""
    import ast

    lines = (ROOT / script).read_text(encoding="utf-8").splitlines()
    s = pages.read_script(ROOT / script, script)
    out = []
    for node in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            span = range(node.lineno, node.end_lineno + 1)
            out.append((f"{script}:{node.lineno} {node.name}", [n for n in span if s.kind[n] == "code"]))
    return out


@pytest.mark.parametrize("width", [1280, 1440])
@pytest.mark.parametrize("script", pages.SCRIPTS)
def test_no_code_line_is_cut_or_wrapped_and_no_function_is_split(browser, script, width):
    """At a laptop's width every line of code fits its column on one line (the shape comments at
    its end included), and a function's code reads in one piece: between two consecutive lines of
    one function there is never more than a screen (900 px) of anything else (its notes and boxes),
    and never more than 100 px of empty column (two rows' code apart)."""
    name = f"{Path(script).stem}.html"
    open_page(browser, name, width)
    page = browser.js(LINES)
    code_lines = sum(1 for n, kind in pages.read_script(ROOT / script, script).kind.items() if kind == "code")
    assert page["count"] >= code_lines * 0.95, f"{name}: {page['count']} lines shown of {code_lines}"
    assert page["cut"] == [] and page["wide"] == 0, f"{name} at {width} px, cut or wrapped: {page['cut']}"
    worst, blank = (0.0, ""), (0.0, "")
    for function, lines in functions(script):
        shown = [page["tops"][f"L{n}"] for n in lines if f"L{n}" in page["tops"]]
        for (_, bottom, column), (top, _, next_column) in zip(shown, shown[1:]):
            worst = max(worst, (top - bottom, function))
            if column != next_column:
                blank = max(blank, (top - bottom, function))
    assert worst[0] < 900, f"{name} at {width} px: {worst[1]} has a gap of {worst[0]:.0f} px in its code"
    assert blank[0] < 100, f"{name} at {width} px: {blank[1]} is split by {blank[0]:.0f} px of empty column"


@pytest.mark.parametrize("name", ["simcse.html", "index.html"])
def test_light_and_dark_follow_the_system(browser, shots, name):
    light = open_page(browser, name, 1280)
    light_bg = browser.js(MEASURE)["background"]
    dark = open_page(browser, name, 1280, dark=True)
    page = browser.js(MEASURE)
    assert light["console"] == dark["console"] == []
    assert light_bg == "rgb(255, 255, 255)" and page["background"] == "rgb(13, 17, 23)", (light_bg, page)
    browser.screenshot(shots / f"{Path(name).stem}-1280-dark.png")
    browser.cdp("Emulation.setEmulatedMedia", {"features": []})
