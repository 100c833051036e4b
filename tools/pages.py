"""`python tools/pages.py`: rebuild docs/pages/, one annotated page per script and an index.

A page reads the way labml's annotated implementations do: the script's docstrings and top-level
comment blocks as prose on the left, the code they precede on the right (highlighted, with a number
and an anchor per line, #L123), its banners as headings. A function's code stays in one piece: the
comments inside it are notes in their place in the code column, and every equation the script
names is typeset from its paper where the comment that states it stands, beside the line that
computes it (#eq-4), the script's own ASCII form of it one click away (folded in the box), so that
no formula shows twice. The code column is as wide as a 110-column line at 1280 px; narrower, a
line wraps under its own indent. docs/*.md are rendered too (doc-<name>.html, markdown-it-py), so
that a page's "Method page" opens as HTML. The script stays the primary artifact.

    npm ci --prefix tools/katex        # once: KaTeX 0.19.1, as tools/katex/package-lock.json pins it
    python tools/pages.py              # rebuild docs/pages/ (seconds)
    python tools/pages.py --check      # build in memory; exit 1 naming each file of docs/pages/ that differs

The typeset forms live in one file, docs/equations.tex, an entry per script and equation (and a
misprinted equation's corrected form, and the pieces of maths of the prose typeset in place). KaTeX
turns them into HTML here, at build time (node tools/katex/render.js), so a page runs no script and
fetches nothing: it opens from a clone, offline, under a Content-Security-Policy that allows only
its own stylesheets and fonts. Made here: docs/pages/*.html, assets/equations.css (KaTeX's inline
styles as classes, so that the policy can refuse inline styles) and assets/katex/ (KaTeX's
stylesheet and woff2 fonts, once for all pages). assets/pages.css is written by hand.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import html
import io
import json
import re
import shutil
import subprocess
import sys
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("simcse.py", "focal_infonce.py", "ifcl.py", "conisi.py", "rcl.py", "common.py")
# the name each paper goes by on its page (a script's Eq. (n) is its own paper's)
PAPERS = {"simcse.py": "SimCSE", "focal_infonce.py": "Focal-InfoNCE", "ifcl.py": "IFCL",
          "conisi.py": "ConIsI", "rcl.py": "RCL"}
EQUATIONS = "docs/equations.tex"
OUT = "docs/pages"
KATEX = ROOT / "tools" / "katex"
PINS = ROOT / "tools" / "pages-requirements.txt"     # the build's Python side: Pygments, markdown-it-py
KATEX_VERSION = "0.19.1"
HANDWRITTEN = ("assets/pages.css",)      # in docs/pages/ but not made here: the build leaves it alone
CSP = ("default-src 'none'; style-src 'self'; font-src 'self'; img-src 'self'; "
       "base-uri 'none'; form-action 'none'")
SETUP = "npm ci --prefix tools/katex"


class BuildError(Exception):
    """What stops the build, said so that the reader knows which file to fix."""


# --------------------------------------------------------------------------------------
# Which equations a script names: "Eq. (4)", "Eq. 4", "Eq. (3)-(4)", "Eq. 2, 3", "Eq. (2) / (6)",
# "Eqs. (8)-(9)", "Eq. (6) and (7)"; a range names every equation in it
# --------------------------------------------------------------------------------------

NUM = r"(?:\(\d+\)|\d+(?![\d.]))"
MENTION = re.compile(rf"\bEqs?\.\s?{NUM}(?:(?:\s?[-\u2013]\s?|,\s?|\s/\s|\sand\s){NUM})*")


def mention_numbers(mention: str) -> list[int]:
    """The equation numbers one mention names, ranges expanded: 'Eq. (3)-(5)' -> [3, 4, 5]."""
    parts = re.findall(r"\d+|[-\u2013]", mention)
    numbers: list[int] = []
    for k, part in enumerate(parts):
        if part.isdigit():
            if k >= 2 and parts[k - 1] in "-\u2013" and numbers:
                numbers += range(numbers[-1] + 1, int(part))
            numbers.append(int(part))
    return numbers


def named_equations(text: str) -> dict[int, list[int]]:
    """Equation number -> the lines (1-based) of `text` that name it, in order."""
    named: dict[int, list[int]] = {}
    for n, line in enumerate(text.splitlines(), 1):
        for m in MENTION.finditer(line):
            for number in mention_numbers(m.group()):
                if n not in named.setdefault(number, []):
                    named[number].append(n)
    return named


# --------------------------------------------------------------------------------------
# docs/equations.tex: `%% script.py Eq. (n)` headers, each followed by its LaTeX; also
# `%% script.py Eq. (n), corrected` (a misprinted equation's corrected form, typeset beside the
# paper's) and `%% script.py inline: <ASCII>` (a piece of maths of the script's prose, typeset
# wherever that ASCII stands in a comment or docstring)
# --------------------------------------------------------------------------------------

HEADER = re.compile(r"%%\s*(?P<script>[\w.-]+\.py)\s+(?:Eq\.\s*\((?P<n>\d+)\)(?P<fix>,\s*corrected)?"
                    r"|inline:\s(?P<ascii>.*\S))\s*$")


@dataclass
class Equation:
    script: str
    number: int
    line: int                      # its header's line in the equations file
    tex: str = ""
    note: str = ""
    html: str = ""                 # KaTeX's HTML
    note_html: str = ""
    ascii: str = ""                # a corrected form: the script's ASCII of it (`% ascii: ...`)
    corrected: Equation | None = None    # the paper's entry: its corrected form, if it has one


@dataclass
class Inline:
    """A piece of a script's prose typeset in place: where the script's comments or docstrings say
    `ascii`, the page shows `tex` typeset (the ASCII one hover away, as its title)."""
    script: str
    ascii: str
    line: int
    tex: str = ""
    html: str = ""


def read_entries(path: Path) -> tuple[dict[tuple[str, int], Equation], list[Inline]]:
    """Every entry of the equations file: the equations keyed by (script, number), each with its
    corrected form attached; the inline pieces."""
    equations: dict[tuple[str, int], Equation] = {}
    fixes: dict[tuple[str, int], Equation] = {}
    inlines: list[Inline] = []
    current: Equation | Inline | None = None
    lines: list[str] = []

    def name(e: Equation | Inline) -> str:
        if isinstance(e, Inline):
            return f"{e.script} inline {e.ascii!r}"
        return f"{e.script} Eq. ({e.number})" + (", corrected" if e in fixes.values() else "")

    def finish() -> None:
        if current is not None:
            current.tex = "\n".join(lines).strip()
            if not current.tex:
                raise BuildError(f"{path.name}:{current.line}: {name(current)} has a header but no LaTeX "
                                 f"under it")

    for k, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        header = HEADER.match(line)
        if header:
            finish()
            lines = []
            if header["ascii"]:
                current = Inline(header["script"], header["ascii"], k)
                if any(i.script == current.script and i.ascii == current.ascii for i in inlines):
                    raise BuildError(f"{path.name}:{k}: {name(current)} is typeset twice; keep one")
                inlines.append(current)
                continue
            key = (header["script"], int(header["n"]))
            table = fixes if header["fix"] else equations
            if key in table:
                raise BuildError(f"{path.name}:{k}: {key[0]} Eq. ({key[1]}){header['fix'] or ''} is typeset "
                                 f"twice (first on line {table[key].line}); keep one")
            current = Equation(key[0], key[1], k)
            table[key] = current
        elif line.startswith("%%"):
            raise BuildError(f"{path.name}:{k}: {line!r}: a header reads `%% script.py Eq. (n)`, "
                             f"`%% script.py Eq. (n), corrected` or `%% script.py inline: <ASCII>`")
        elif line.lstrip().startswith(("% note:", "% ascii:")):
            field_name = "note" if line.lstrip().startswith("% note:") else "ascii"
            if not isinstance(current, Equation):
                raise BuildError(f"{path.name}:{k}: a `% {field_name}:` line belongs under an equation's "
                                 f"header")
            if field_name == "ascii" and current not in fixes.values():
                raise BuildError(f"{path.name}:{k}: a `% ascii:` line belongs under a `, corrected` header")
            text = line.split(f"% {field_name}:", 1)[1].strip()
            setattr(current, field_name, (getattr(current, field_name) + " " + text).strip())
        elif line.lstrip().startswith("%") or not line.strip():
            continue
        elif current is None:
            raise BuildError(f"{path.name}:{k}: LaTeX before the first `%% script.py Eq. (n)` header")
        else:
            lines.append(line)
    finish()
    for key, fix in sorted(fixes.items()):
        if key not in equations:
            raise BuildError(f"{path.name}:{fix.line}: {key[0]} Eq. ({key[1]}), corrected, but there is no "
                             f"`%% {key[0]} Eq. ({key[1]})` entry, the paper's form, to set it beside")
        if not fix.ascii:
            raise BuildError(f"{path.name}:{fix.line}: {key[0]} Eq. ({key[1]}), corrected, needs a "
                             f"`% ascii:` line: the script's own ASCII of the corrected form")
        equations[key].corrected = fix
    return equations, inlines


def read_equations(path: Path) -> dict[tuple[str, int], Equation]:
    """Every equation of the equations file, keyed by (script, number)."""
    return read_entries(path)[0]


def flat(text: str) -> str:
    return " ".join(text.split())


def coverage(root: Path, scripts: tuple[str, ...], equations: dict[tuple[str, int], Equation]) -> list[str]:
    """What is wrong between the scripts and the equations file, both ways."""
    wrong = []
    named = {(s, n): lines for s in scripts
             for n, lines in named_equations((root / s).read_text(encoding="utf-8")).items()}
    for (script, n), lines in sorted(named.items()):
        if (script, n) not in equations:
            wrong.append(f"{script}:{lines[0]} names Eq. ({n}), which has no typeset form in {EQUATIONS} "
                         f"(add a `%% {script} Eq. ({n})` entry, written from the paper)")
    for (script, n), eq in sorted(equations.items()):
        if (script, n) not in named:
            wrong.append(f"{EQUATIONS}:{eq.line}: {script} Eq. ({n}) is typeset, but {script} names no "
                         f"Eq. ({n}) (remove the entry, or check the number)")
        fix = eq.corrected
        if fix and script in scripts and flat(fix.ascii) not in flat((root / script).read_text("utf-8")):
            wrong.append(f"{EQUATIONS}:{fix.line}: {script} Eq. ({n}), corrected: its `% ascii:` form is not "
                         f"in {script} (the script's erratum and the typeset correction must say the same)")
    return wrong


def inline_coverage(root: Path, scripts: tuple[str, ...], inlines: list[Inline]) -> list[str]:
    """An inline piece whose ASCII its script's prose no longer holds (it would typeset nothing)."""
    wrong = []
    for piece in inlines:
        if piece.script not in scripts:
            continue
        s = read_script(root / piece.script, piece.script)
        prose = flat(" ".join(t for t in s.prose.values() if t))
        if flat(piece.ascii) not in prose:
            wrong.append(f"{EQUATIONS}:{piece.line}: {piece.script} inline {piece.ascii!r}: no comment or "
                         f"docstring of {piece.script} says it (remove the entry, or write it as the "
                         f"script does)")
    return wrong


# --------------------------------------------------------------------------------------
# KaTeX, run once per build by node; its inline styles become classes of assets/equations.css
# --------------------------------------------------------------------------------------

def katex_ready() -> str | None:
    """None when node and the pinned KaTeX are there; else what is missing and the command."""
    if shutil.which("node") is None:
        return f"node is not installed (Debian: apt-get install nodejs npm), then run `{SETUP}`"
    package = KATEX / "node_modules" / "katex" / "package.json"
    if not package.is_file():
        return f"KaTeX is not installed in tools/katex/node_modules: run `{SETUP}`"
    version = json.loads(package.read_text(encoding="utf-8"))["version"]
    if version != KATEX_VERSION:
        return f"tools/katex has KaTeX {version}, the pages are made with {KATEX_VERSION}: run `{SETUP}`"
    return None


def pygments_differs() -> str | None:
    """None when the installed Pygments and markdown-it-py are the ones tools/pages-requirements.txt
    pins (a lexer or a renderer of another release may make other bytes, and the committed pages
    would read as stale)."""
    from importlib import metadata

    for name, pin in re.findall(r"^([\w.-]+)==(\S+)", PINS.read_text(encoding="utf-8"), re.M):
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            version = None
        if version != pin:
            have = f"{name} {version} is installed" if version else f"{name} is not installed"
            return f"{have}, the pages are made with {pin}: pip install -r tools/pages-requirements.txt"
    return None


def run_katex(items: list[dict]) -> dict[str, dict]:
    missing = katex_ready()
    if missing:
        raise BuildError(missing)
    done = subprocess.run(["node", str(KATEX / "render.js")], input=json.dumps(items), capture_output=True,
                          text=True, encoding="utf-8")
    if done.returncode != 0:
        raise BuildError(f"node tools/katex/render.js failed: {done.stderr.strip()}")
    return {r["key"]: r for r in json.loads(done.stdout)["results"]}


def typeset(equations: dict[tuple[str, int], Equation], equations_name: str,
            inlines: list[Inline] = ()) -> None:
    """Fill each equation's html and note_html (and its corrected form's, and each inline piece's
    html), or fail naming every formula KaTeX refused."""
    items = []
    for (script, n), eq in sorted(equations.items()):
        items.append({"key": f"{script} {n}", "tex": eq.tex, "display": True})
        if eq.corrected:
            items.append({"key": f"{script} {n} corrected", "tex": eq.corrected.tex, "display": True})
        for k, piece in enumerate(eq.note.split("$")[1::2]):
            items.append({"key": f"{script} {n} note {k}", "tex": piece, "display": False})
    for k, piece in enumerate(inlines):
        items.append({"key": f"inline {k}", "tex": piece.tex, "display": False})
    if not items:
        return
    results = run_katex(items)
    errors = []
    for k, piece in enumerate(inlines):
        result = results[f"inline {k}"]
        if "error" in result:
            errors.append(f"{equations_name}:{piece.line}: {piece.script} inline {piece.ascii!r}: "
                          f"{result['error']}")
        else:
            piece.html = result["html"]
    for (script, n), eq in sorted(equations.items()):
        where = f"{equations_name}:{eq.line}: {script} Eq. ({n})"
        result = results[f"{script} {n}"]
        if "error" in result:
            errors.append(f"{where}: {result['error']}")
        else:
            eq.html = result["html"]
        if eq.corrected:
            result = results[f"{script} {n} corrected"]
            if "error" in result:
                errors.append(f"{equations_name}:{eq.corrected.line}: {script} Eq. ({n}), corrected: "
                              f"{result['error']}")
            else:
                eq.corrected.html = result["html"]
        pieces = eq.note.split("$")
        if len(pieces) % 2 == 0:
            errors.append(f"{where}, its note: an unclosed $")
            continue
        out = []
        for k, piece in enumerate(pieces):
            if k % 2 == 0:
                out.append(inline_text(piece))
                continue
            result = results[f"{script} {n} note {k // 2}"]
            if "error" in result:
                errors.append(f"{where}, its note: {result['error']}")
            else:
                out.append(result["html"])
        eq.note_html = "".join(out)
    if errors:
        raise BuildError("KaTeX could not typeset:\n" + "\n".join(errors))


STYLE = re.compile(r' style="([^"]*)"')


def styles_to_classes(markup: str, rules: dict[str, str]) -> str:
    """KaTeX's style="..." attributes as classes (the same declarations, !important so that they
    win as an inline style would), so that the pages need no 'unsafe-inline'."""
    def to_class(m: re.Match) -> str:
        style = html.unescape(m.group(1))
        name = "k" + hashlib.sha1(style.encode()).hexdigest()[:7]
        if rules.setdefault(name, style) != style:
            raise BuildError(f"two KaTeX styles share the class {name}: {style!r}, {rules[name]!r}")
        return f' class="{name}"'

    out = STYLE.sub(to_class, markup)
    # an element with a class of its own and a style: merge the two class attributes
    out = re.sub(r' class="([^"]*)"((?:\s+[\w-]+="[^"]*")*?) class="(k[0-9a-f]{7})"', r' class="\1 \3"\2',
                 out)
    if re.search(r"\sstyle=", out) or re.search(r'class="[^"]*"[^>]*class="', out):
        raise BuildError("KaTeX's HTML kept a style attribute the build could not turn into a class")
    return out


def equations_css(rules: dict[str, str]) -> str:
    lines = ["/* Made by tools/pages.py: KaTeX's inline styles of docs/equations.tex, as classes. */"]
    for name, style in sorted(rules.items()):
        decls = [d.strip() for d in style.split(";") if d.strip()]
        lines.append(f".{name}{{" + ";".join(f"{d}!important" for d in decls) + "}")
    return "\n".join(lines) + "\n"


def katex_assets() -> dict[str, bytes]:
    """KaTeX's stylesheet with only the woff2 fonts it names (Chromium, Firefox and Safari read
    woff2; the woff and ttf copies would only add weight), the fonts, and KaTeX's licence."""
    dist = KATEX / "node_modules" / "katex" / "dist"
    css = (dist / "katex.min.css").read_text(encoding="utf-8")
    woff2 = r'src:url\(fonts/[\w-]+\.woff2\) format\("woff2"\)'
    css, count = re.subn(rf'({woff2})(?:,url\([^)]*\) format\("\w+"\))+', r"\1", css)
    fonts = sorted(set(re.findall(r"url\(fonts/([\w-]+\.woff2)\)", css)))
    if count != css.count("@font-face") or re.search(r"\.(?:woff|ttf)\)", css):
        raise BuildError("KaTeX's stylesheet names its fonts in a way this build does not know")
    head = (f"/* KaTeX {KATEX_VERSION} (MIT licence: LICENSE beside this file), copied by tools/pages.py "
            f"with its fonts reduced to the woff2 files */\n")
    files = {"assets/katex/katex.min.css": (head + css).encode(),
             "assets/katex/LICENSE": (KATEX / "node_modules" / "katex" / "LICENSE").read_bytes()}
    for font in fonts:
        files[f"assets/katex/fonts/{font}"] = (dist / "fonts" / font).read_bytes()
    return files


# --------------------------------------------------------------------------------------
# A script, read: which lines are code, comments, docstrings and banners
# --------------------------------------------------------------------------------------

BANNER = re.compile(r"#\s*={10,}\s*$")


@dataclass
class Script:
    name: str
    lines: list[str]
    kind: dict[int, str]                       # code, blank, comment, banner, doc
    prose: dict[int, str]                      # comment and docstring lines -> their text
    doc_start: set[int]                        # the first line of each docstring shown as prose
    module_doc: range
    breaks: set[int]                           # a new section starts at these lines
    names: dict[str, int]                      # top-level names -> the line that binds them
    docstring: str
    imports_common: set[int]                   # the lines of `from common import ...`


def read_script(path: Path, name: str) -> Script:
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    try:
        tree = ast.parse(text, filename=name)
    except SyntaxError as e:
        raise BuildError(f"{name}:{e.lineno}: not Python the build can read: {e.msg}") from None
    kind = {n: ("code" if line.strip() else "blank") for n, line in enumerate(lines, 1)}
    prose: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT and not tok.line[:tok.start[1]].strip():
            n = tok.start[0]
            kind[n] = "banner" if BANNER.match(tok.string) else "comment"
            prose[n] = tok.string[1:][1:] if tok.string[1:2] == " " else tok.string[1:]
    doc_start: set[int] = set()
    breaks: set[int] = set()
    module_doc = range(0)
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body
        if not (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            continue
        doc = body[0]
        first, last = doc.lineno, doc.end_lineno
        alone = (not lines[first - 1][:doc.col_offset].strip()
                 and not lines[last - 1][doc.end_col_offset:].strip()
                 and (isinstance(node, ast.Module) or first > node.lineno))
        if not alone:
            continue
        for n, line in docstring_lines(doc.value.value, lines, first, last).items():
            kind[n] = "doc"
            if line is not None:
                prose[n] = line
        doc_start.add(first)
        if isinstance(node, ast.Module):
            module_doc = range(first, last + 1)
        else:
            breaks.add(min([node.lineno] + [d.lineno for d in node.decorator_list]))
    names: dict[str, int] = {}
    imports_common: set[int] = set()
    for node in tree.body:
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            breaks.add(start)
            names.setdefault(node.name, start)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names.setdefault(leaf.id, node.lineno)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if isinstance(node, ast.ImportFrom) and node.module == "common":
                imports_common.update(range(node.lineno, node.end_lineno + 1))
            for alias in node.names:
                names.setdefault((alias.asname or alias.name).split(".")[0], node.lineno)
    return Script(name, lines, kind, prose, doc_start, module_doc, breaks, names,
                  ast.get_docstring(tree) or "", imports_common)


def docstring_lines(value: str, lines: list[str], first: int, last: int) -> dict[int, str | None]:
    """Line -> the docstring's text on it, dedented as inspect.cleandoc does; None for a line that
    holds only quotes. The value's lines when they map one to one onto the source's (no escaped
    newline), so that escapes read as Python reads them; else the source's, quotes stripped."""
    texts = value.split("\n")
    if len(texts) != last - first + 1:
        texts = [lines[n - 1] for n in range(first, last + 1)]
        texts[0] = re.sub(r'^\s*[rRbBuU]*("""|\'\'\'|"|\')', "", texts[0])
        texts[-1] = re.sub(r'("""|\'\'\'|"|\')\s*$', "", texts[-1])
    rest = [t for t in texts[1:] if t.strip()]
    indent = min((len(t) - len(t.lstrip()) for t in rest), default=0)
    out: dict[int, str | None] = {}
    for k, t in enumerate(texts):
        t = t if k == 0 else t[indent:]
        out[first + k] = t.rstrip() if t.strip() else None
    return out


# --------------------------------------------------------------------------------------
# Sections: a heading (a banner), or prose beside the code it precedes
# --------------------------------------------------------------------------------------

@dataclass
class Section:
    heading: str = ""
    heading_lines: list[int] = field(default_factory=list)
    prose: list[tuple[int, str | None]] = field(default_factory=list)   # None: a paragraph break
    code: list[int] = field(default_factory=list)
    quiet: list[int] = field(default_factory=list)    # lines shown nowhere (blank, quotes): anchors only

    def has_code(self) -> bool:
        return bool(self.code)      # a blank line joins the code only after a line of code


def inner_note(s: Script, n: int, breaks: set[int]) -> bool:
    """Whether the comment on line n is a note inside the code it stands in (an indented comment
    after code), shown in the code column so that a function's code stays in one piece; not when
    the comment block leads into a method or a nested function of its own (then it is its prose)."""
    if not s.lines[n - 1][:1].isspace():
        return False
    m = n
    while m <= len(s.lines) and s.kind[m] in ("comment", "blank"):
        m += 1
    return m not in breaks


def sections_of(s: Script, extra_breaks: set[int] = frozenset()) -> list[Section]:
    breaks = s.breaks | extra_breaks
    sections: list[Section] = []
    cur = Section()
    gap = False

    def close() -> None:
        nonlocal cur
        if cur.prose or cur.code or cur.quiet:
            sections.append(cur)
        cur = Section()

    n, total = 1, len(s.lines)
    while n <= total:
        kind = s.kind[n]
        if kind == "banner":
            close()
            heading = Section(heading_lines=[n])
            n += 1
            texts = []
            while n <= total and s.kind[n] in ("comment", "banner"):
                heading.heading_lines.append(n)
                if s.kind[n] == "banner":
                    n += 1
                    break
                texts.append(s.prose[n].strip())
                n += 1
            heading.heading = " ".join(t for t in texts if t)
            sections.append(heading)
            gap = False
            continue
        if kind == "comment":
            if cur.has_code() and inner_note(s, n, breaks):
                cur.code.append(n)
                n += 1
                continue
            if cur.has_code():
                close()
            elif gap and cur.prose:
                cur.prose.append((n, None))
            cur.prose.append((n, s.prose[n]))
            gap = False
        elif kind == "doc":
            if n in s.doc_start and cur.prose:
                cur.prose.append((n, None))
            if n in s.prose:
                cur.prose.append((n, s.prose[n]))
            else:
                cur.prose.append((n, None))
                cur.quiet.append(n)
        elif kind == "blank":
            if cur.has_code():
                cur.code.append(n)
            else:
                cur.quiet.append(n)
                gap = True
        else:
            if n in breaks and cur.has_code():
                close()
            cur.code.append(n)
            gap = False
        n += 1
    close()
    return sections


# --------------------------------------------------------------------------------------
# Where each equation is typeset: the first comment line that opens with it (`# Eq. (4): ...`);
# else its first mention in a function's or class's docstring, else in a comment, else in code,
# else in the module's docstring
# --------------------------------------------------------------------------------------

def anchors(s: Script, numbers: list[int]) -> dict[int, int]:
    """Equation number -> the line it is typeset beside."""
    named = named_equations("\n".join(s.lines))
    found = {}
    for number in numbers:
        lines = named.get(number, [])
        opening = [n for n in lines if s.kind[n] == "comment" and (m := MENTION.match(s.prose[n].strip()))
                   and number in mention_numbers(m.group())]
        docs = [n for n in lines if s.kind[n] == "doc" and n not in s.module_doc]
        comments = [n for n in lines if s.kind[n] == "comment"]
        code = [n for n in lines if s.kind[n] == "code"]
        pick = (opening or docs or comments or code or lines or [None])[0]
        if pick is not None:
            found[number] = pick
    return found


# --------------------------------------------------------------------------------------
# HTML: inline text, prose blocks, code lines
# --------------------------------------------------------------------------------------

@dataclass
class Page:
    """What a page's text may link to."""
    equations: set[int]                       # typeset on this page: #eq-n
    common: set[str]                          # common.py's top-level names: common.html#X
    common_href: str = "common.html"
    scripts: tuple[str, ...] = ()
    root: Path = ROOT
    inlines: list[Inline] = field(default_factory=list)      # this script's inline maths
    docs: set[str] = field(default_factory=set)               # docs/X.md rendered as doc-X.html
    paper: str = ""
    rules: dict[str, str] = field(default_factory=dict)      # KaTeX's styles as classes
    fixes: dict[str, int] = field(default_factory=dict)      # a corrected form's ASCII -> its number


INLINE = re.compile(
    r"(?P<code>`[^`\n]+`)"
    rf"|(?P<eq>{MENTION.pattern})"
    r"|(?P<script>\b[a-z_]+\.py\b)(?!/)"
    r"|(?P<common>\bcommon\.(?P<name>[A-Za-z_]\w*))"
    r"|(?P<path>\b(?:docs|tests|tools|plumbing)/[\w./-]*\w)"
)


def eq_links(mention: str, page: Page) -> str:
    """A mention with each number it names linked to its box on this page (a range's ends)."""
    out, last = [], 0
    for k, m in enumerate(re.finditer(NUM, mention)):
        number = int(m.group().strip("()"))
        start = 0 if k == 0 else m.start()
        piece = mention[start:m.end()]
        out.append(html.escape(mention[last:start]))
        if number in page.equations:
            out.append(f'<a class="eqref" href="#eq-{number}">{html.escape(piece)}</a>')
        else:
            out.append(html.escape(piece))
        last = m.end()
    out.append(html.escape(mention[last:]))
    return "".join(out)


def inline_text(text: str, page: Page | None = None) -> str:
    """Escaped text with its inline maths typeset (docs/equations.tex's `inline:` entries), and
    `code`, equation mentions, common.X, script names and repository paths turned into markup and
    links."""
    if page is None:
        return html.escape(text)
    if page.inlines:
        pattern = "|".join(r"\s+".join(map(re.escape, i.ascii.split()))
                           for i in sorted(page.inlines, key=lambda i: -len(i.ascii)))
        pieces = re.split(f"({pattern})", text)
        if len(pieces) > 1:
            by_ascii = {flat(i.ascii): i for i in page.inlines}
            return "".join(
                (f'<span class="im" title="{html.escape(flat(piece))}">{by_ascii[flat(piece)].html}</span>'
                 if k % 2 else links_text(piece, page)) for k, piece in enumerate(pieces))
    return links_text(text, page)


def links_text(text: str, page: Page) -> str:
    out, last = [], 0
    for m in INLINE.finditer(text):
        out.append(html.escape(text[last:m.start()]))
        last = m.end()
        whole = m.group()
        if m["code"]:
            out.append(f"<code>{html.escape(whole[1:-1])}</code>")
        elif m["eq"]:
            out.append(eq_links(whole, page))
        elif m["script"] and whole in page.scripts:
            out.append(f'<a href="{Path(whole).stem}.html">{html.escape(whole)}</a>')
        elif m["common"] and m["name"] in page.common:
            out.append(f'<a href="{page.common_href}#{m["name"]}">{html.escape(whole)}</a>')
        elif m["path"] and (page.root / whole).exists():
            href = "../" + whole[len("docs/"):] if whole.startswith("docs/") else "../../" + whole
            if whole.startswith("docs/") and whole.endswith(".md") and Path(whole).stem in page.docs:
                href = f"doc-{Path(whole).stem}.html"
            out.append(f'<a href="{html.escape(href)}">{html.escape(whole)}</a>')
        else:
            out.append(html.escape(whole))
    out.append(html.escape(text[last:]))
    return "".join(out)


FORMULA = re.compile(rf"(?:Sec\. [\d.]+ \()?{MENTION.pattern}[^:]{{0,24}}:")


def prose_blocks(items: list[tuple[int, str | None]],
                 comments: set[int]) -> list[tuple[str, list[tuple[int, str]]]]:
    """Comment or docstring lines as blocks: ('p' | 'formula' | 'li' | 'pre', [(line, text)]).
    A blank line ends a block; a line that opens with NOTE( starts one, and so does a comment that
    opens with an equation and a colon (`# Eq. (4): l_i = ...`), a formula, kept as written; '- '
    starts a list item, deeper lines continue it; other indented lines are kept as they are
    (commands, examples, a formula's second line)."""
    blocks: list[tuple[str, list[tuple[int, str]]]] = []
    cur: tuple[str, list[tuple[int, str]]] | None = None
    item_indent = 0
    for n, text in items:
        if text is None or not text.strip():
            cur = None
            continue
        indent = len(text) - len(text.lstrip())
        body = text.strip()
        if body.startswith("- ") and indent <= 4:
            cur = ("li", [(n, body[2:])])
            blocks.append(cur)
            item_indent = indent
        elif cur and cur[0] == "li" and indent > item_indent:
            cur[1].append((n, body))
        elif indent > 0:
            if cur and cur[0] in ("pre", "formula"):
                cur[1].append((n, text))
            else:
                cur = ("pre", [(n, text)])
                blocks.append(cur)
        elif (formula := n in comments and FORMULA.match(body)) or body.startswith("NOTE(") or not cur \
                or cur[0] in ("pre", "li"):
            cur = ("formula" if formula else "p", [(n, body)])
            blocks.append(cur)
        else:
            cur[1].append((n, body))
    return blocks


def anchor_spans(lines: list[int]) -> str:
    return "".join(f'<span id="L{n}"></span>' for n in lines)


def eq_box(eq: Equation, where: int | None, page: Page, ascii_html: str = "") -> str:
    """An equation's box: its label, the formula typeset from the paper (its corrected form beside
    it, where the script has an erratum), its note, and the script's ASCII form one click away."""
    named = (f' <span class="eq-where">named on <a href="#L{where}">line {where}</a></span>'
             if where is not None else "")
    note = f'<p class="eq-note">{eq.note_html}</p>' if eq.note_html else ""
    label = f"{page.paper}, Eq. ({eq.number})" if page.paper else f"Eq. ({eq.number})"
    math = f'<div class="eq-math">{eq.html}</div>'
    if eq.corrected:
        math = ('<div class="eq-pair"><div class="eq-side"><p class="eq-tag">as printed</p>'
                f'{math}</div><div class="eq-side fixed"><p class="eq-tag">corrected (the script\'s '
                f'erratum)</p><div class="eq-math">{eq.corrected.html}</div></div></div>')
    box = (f'<div class="eq" id="eq-{eq.number}"><p class="eq-label"><a href="#eq-{eq.number}">'
           f"{html.escape(label)}</a>{named}</p>{math}{note}{ascii_html}</div>")
    return styles_to_classes(box, page.rules)


def ascii_details(inner: str, lines: list[int]) -> str:
    span = f"line {lines[0]}" if len(lines) == 1 else f"lines {lines[0]}-{lines[-1]}"
    return (f'<details class="ascii"><summary>ASCII, as the script writes it ({span})</summary>'
            f"{inner}</details>")


def boxes_html(eqs: list[tuple[Equation, int | None]], page: Page, ascii_html: str = "") -> str:
    """The boxes of the equations typeset at one place; the ASCII they stand for inside the last."""
    return "".join(eq_box(eq, where, page, ascii_html if k == len(eqs) - 1 else "")
                   for k, (eq, where) in enumerate(eqs))


def render_prose(items: list[tuple[int, str | None]], boxes: dict[int, list], page: Page,
                 comments: set[int]) -> str:
    out = []
    list_open = False
    for kind, lines in prose_blocks(items, comments):
        ids = anchor_spans([n for n, _ in lines])
        at = [b for n, _ in lines for b in boxes.pop(n, [])]
        if kind == "li" and not list_open:
            out.append("<ul>")
            list_open = True
        elif kind != "li" and list_open:
            out.append("</ul>")
            list_open = False
        if kind == "li":
            out.append(f"<li>{ids}{inline_text(' '.join(t for _, t in lines), page)}</li>")
        elif kind == "pre":
            base = min(len(t) - len(t.lstrip()) for _, t in lines)
            body = "\n".join(inline_text(t[base:], page) for _, t in lines)
            text = flat(" ".join(t for _, t in lines)).rstrip(".")
            fix = page.fixes.get(text)
            if fix is not None:         # a corrected form typeset in its box: its ASCII a click away
                out.append(f'<details class="ascii">{ids}<summary>ASCII of the corrected '
                           f'<a class="eqref" href="#eq-{fix}">Eq. ({fix})</a>, typeset in its box</summary>'
                           f"<pre>{html.escape(chr(10).join(t[base:] for _, t in lines))}</pre></details>")
            else:
                out.append(f"<pre>{ids}{body}</pre>")
        elif kind == "formula":
            first, rest = lines[0][1], [t for _, t in lines[1:]]
            body = "\n".join([inline_text(first, page)] + [inline_text(t.rstrip(), page) for t in rest])
            if at:
                out.append(boxes_html(at, page, ascii_details(f'<p class="formula">{ids}{body}</p>',
                                                              [n for n, _ in lines])))
                at = []
            else:
                out.append(f'<p class="formula">{ids}{body}</p>')
        else:
            out.append(f"<p>{ids}{inline_text(' '.join(t for _, t in lines), page)}</p>")
        if at:
            out.append(boxes_html(at, page))
    if list_open:
        out.append("</ul>")
    return "\n".join(out)


# --------------------------------------------------------------------------------------
# Code: Pygments' tokens, a span per kind the stylesheet colours, links to common.py and to
# the equations
# --------------------------------------------------------------------------------------

def token_lines(text: str) -> list[list[tuple[str, str]]]:
    """Per source line, its (css class, text) pieces; '' for text the stylesheet leaves plain."""
    from pygments.lexers import PythonLexer
    from pygments.token import Comment, Keyword, Name, Number, Operator, String

    kinds = [(String.Doc, "s"), (String, "s"), (Comment, "c"), (Keyword, "k"), (Operator.Word, "k"),
             (Name.Builtin.Pseudo, "bp"), (Name.Builtin, "nb"), (Name.Function, "nf"), (Name.Class, "nf"),
             (Name.Decorator, "nd"), (Number, "m")]
    lines: list[list[tuple[str, str]]] = [[]]
    for tok, value in PythonLexer(stripnl=False, ensurenl=True).get_tokens(text):
        css = next((c for t, c in kinds if tok in t), "")
        for k, piece in enumerate(value.split("\n")):
            if k:
                lines.append([])
            if piece:
                lines[-1].append((css, piece))
    return lines


def render_code_line(pieces: list[tuple[str, str]], page: Page, imports_common: bool) -> str:
    """One line's HTML: `common.X` (and X in `from common import X`) links X to its section of
    the common.py page; an equation named in a comment or a string links to its box."""
    out = []
    for k, (css, text) in enumerate(pieces):
        body = html.escape(text)
        if css in ("c", "s"):
            body = "".join(eq_links(p, page) if MENTION.fullmatch(p) else html.escape(p)
                           for p in re.split(f"({MENTION.pattern})", text) if p)
        elif css == "" and text in page.common:
            prev = [t for _, t in pieces[:k] if t.strip()]
            if imports_common or (prev[-2:] in (["common", "."], ["@common", "."])):
                body = f'<a class="common" href="{page.common_href}#{text}">{body}</a>'
        out.append(f'<span class="{css}">{body}</span>' if css else body)
    return "".join(out)


def indent_class(line: str) -> str:
    """A line's indent, in steps of 4 columns (at most 8): its wrapped part, on a narrow screen,
    hangs 4 columns deeper than the line itself."""
    return f"i{min((len(line) - len(line.lstrip())) // 4, 8)}"


def render_code(lines: list[int], tokens: list[list[tuple[str, str]]], page: Page, s: Script) -> str:
    rows = []
    for n in lines:
        body = render_code_line(tokens[n - 1], page, n in s.imports_common)
        rows.append(f'<span class="line {indent_class(s.lines[n - 1])}" id="L{n}"><a class="ln" '
                    f'href="#L{n}">{n}</a>{body}</span>')
    return "<pre><code>" + "".join(rows) + "</code></pre>"


def note_groups(s: Script, block: list[int]) -> list[tuple[str, list[int]]]:
    """A comment block inside code as ('formula' | 'note', lines): a formula is a comment that opens
    with an equation and a colon (`# Eq. (4): l_i = ...`) and the lines that continue it indented;
    a note is the prose around, a NOTE( starting a new one."""
    groups: list[tuple[str, list[int]]] = []
    for n in block:
        text = s.prose[n]
        body = text.strip()
        if FORMULA.match(body):
            groups.append(("formula", [n]))
        elif groups and groups[-1][0] == "formula" and text[:1].isspace():
            groups[-1][1].append(n)
        elif not groups or groups[-1][0] == "formula" or body.startswith("NOTE(") or not body:
            groups.append(("note", [n]))
        else:
            groups[-1][1].append(n)
    return groups


def note_html(s: Script, lines: list[int], page: Page, text: str | None = None) -> str:
    """Comment lines shown as prose inside the code column, at their code's indent, numbered (a
    given `text`: the rest of a line whose anchor and number stand elsewhere)."""
    first = lines[0]
    indent = indent_class(s.lines[first - 1])
    number = (f' id="L{first}"><a class="ln" href="#L{first}">{first}</a>' if text is None
              else '><span class="ln"></span>')
    if text is None and any(s.prose[n][:1].isspace() for n in lines[1:]):   # laid out: keep it so
        body = "<br>".join(inline_text(s.prose[n], page) for n in lines)
        return f'<div class="note pre {indent}"{number}<p>{anchor_spans(lines[1:])}{body}</p></div>'
    text = " ".join(s.prose[n].strip() for n in lines) if text is None else text
    body = inline_text(text, page)
    return f'<div class="note {indent}"{number}<p>{anchor_spans(lines[1:])}{body}</p></div>'


def at_html(s: Script, line: int, boxes: str) -> str:
    return f'<div class="at {indent_class(s.lines[line - 1])}">{boxes}</div>'


def render_code_column(s: Script, code: list[int], tokens: list[list[tuple[str, str]]], page: Page,
                       boxes: dict[int, list], tries: dict[int, list[str]] | None = None) -> str:
    """A section's code in one piece: its lines, the comments among them as notes in their place,
    each equation's box in the place of the comment that states it (its ASCII a click away), and
    each experiment's "Try it" block just above the line it changes."""
    items: list[int | str] = []             # a line of code to print, or a piece of HTML
    tries = {} if tries is None else tries
    k = 0
    while k < len(code):
        n = code[k]
        if n in tries:                      # an experiment about this line: its block above it
            items.append(at_html(s, n, "".join(tries.pop(n))))
        if s.kind[n] != "comment":
            if n in boxes:                  # an equation named only in this line of code
                items.append(at_html(s, n, boxes_html(boxes.pop(n), page)))
            items.append(n)
            k += 1
            continue
        block = []
        while k < len(code) and s.kind[code[k]] == "comment":
            block.append(code[k])
            k += 1
        for kind, lines in note_groups(s, block):
            at = [b for m in lines for b in boxes.pop(m, [])]
            if kind == "note":
                items.append(note_html(s, lines, page))
                if at:
                    items.append(at_html(s, lines[0], boxes_html(at, page)))
                continue
            if not at:                      # an equation typeset elsewhere: a link to it, its ASCII folded
                m = MENTION.match(s.prose[lines[0]].strip())
                refs = ", ".join(f'<a class="eqref" href="#eq-{k}">Eq. ({k})</a>'
                                 for k in mention_numbers(m.group()) if k in page.equations)
                span = f"line {lines[0]}" if len(lines) == 1 else f"lines {lines[0]}-{lines[-1]}"
                summary = f"{refs}, typeset above; the script's ASCII of it here ({span})"
                items.append(at_html(s, lines[0], f'<details class="ascii again"><summary>{summary}</summary>'
                                                  f"{render_code(lines, tokens, page, s)}</details>"))
                continue
            tail = s.prose[lines[0]].split(" NOTE(", 1)
            ascii_code = ascii_details(render_code(lines, tokens, page, s), lines)
            items.append(at_html(s, lines[0], boxes_html(at, page, ascii_code)))
            if len(tail) == 2:              # a NOTE on the formula's line is shown, not folded away
                items.append(note_html(s, [lines[0]], page, "NOTE(" + tail[1]))
    out, run = [], []
    for item in items + [""]:
        if isinstance(item, int):
            run.append(item)
            continue
        if run:
            out.append(render_code(run, tokens, page, s))
            run = []
        out.append(item)
    return "".join(out)


# --------------------------------------------------------------------------------------
# Experiments to try: each one's "Try it" block beside the line it changes (docs/experiments/,
# run and measured by tools/experiment.py)
# --------------------------------------------------------------------------------------

def experiment_tool():
    """tools/experiment.py, loaded by its path (this file runs as a script and as tools.pages)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("experiment_tool", ROOT / "tools" / "experiment.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)       # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return sys.modules[spec.name]


def diff_html(patch: str) -> str:
    """A patch's hunks, each line coloured by what it does (the file's header left out)."""
    out = []
    for line in patch.splitlines():
        if line.startswith(("diff ", "--- ", "+++ ", "index ")):
            continue
        kind = {"+": "add", "-": "del", "@": "hunk"}.get(line[:1], "ctx")
        out.append(f'<span class="{kind}">{html.escape(line) or " "}</span>')
    return '<pre class="diff"><code>' + "\n".join(out) + "</code></pre>"


def try_html(tool, exp, root: Path, page: Page, measured: dict | None, script_sha: str) -> str:
    """One experiment's block, folded to one line beside the code (what it changes and, once measured,
    its 7-task average against the control's): open, its question, the change, the command, what
    it measured (the table; the curves a link away), or that it has not been measured yet."""
    from markdown_it import MarkdownIt

    name = html.escape(exp.name)
    outcome = "not measured yet"
    means = tool.arm_means(measured) if measured is not None else {}
    if "control" in means and "changed" in means:
        outcome = f"7-task avg {means['changed']:.2f} against {means['control']:.2f} unchanged"
    parts = [f'<summary><span class="tag">Try it</span> <strong>{html.escape(exp.title)}</strong> '
             f'<span class="outcome">· {html.escape(outcome)}</span></summary>',
             f"<p>{inline_text(exp.question, page)}</p>"]
    patch = tool.patch_path(exp, root)
    if patch.is_file():
        text = patch.read_text(encoding="utf-8")
        parts.append(f'<details class="change"><summary>The change: docs/experiments/{name}.patch '
                     f"({tool.patch_size(text)} lines)</summary>{diff_html(text)}</details>")
    if exp.flags:
        parts.append(f"<p>The changed run adds <code>{html.escape(' '.join(exp.flags))}</code>.</p>")
    parts.append(f'<pre class="cmd"><code>{html.escape(tool.command(exp))}</code></pre>')
    undo = (f"; <code>git apply -R docs/experiments/{name}.patch</code> undoes the change" if patch.is_file()
            else "")
    parts.append(f'<details class="change"><summary>By hand, the changed arm with seed 1</summary>'
                 f'<pre class="cmd"><code>{html.escape(tool.by_hand(exp, root=root))}</code></pre>'
                 f"<p>Both arms, both seeds, and the table: the command above{undo}.</p></details>")
    if measured is None:
        parts.append("<p>Not measured yet: the command above measures it.</p>")
    else:
        when = html.escape(measured.get("commit", ""))
        if measured.get("code", {}).get(exp.script) != script_sha:
            parts.append(f"<p>Measured on an earlier {html.escape(exp.script)} (commit {when}); its figures "
                         f"may no longer hold: the command above measures it again.</p>")
        md = MarkdownIt("commonmark", {"html": False}).enable("table")
        parts.append(f'<div class="measured">{md.render(tool.recorded_table(exp, measured, root))}</div>')
        if (root / "docs" / "experiments" / f"{exp.name}.png").is_file():
            parts.append(f'<p>The curves, both arms, both seeds: <a href="../experiments/{name}.png">'
                         f"docs/experiments/{name}.png</a></p>")
    return f'<details class="try" id="try-{name}">{"".join(parts)}</details>'


def try_blocks(s: Script, page: Page) -> dict[int, list[str]]:
    """Line of the script -> the "Try it" blocks of the experiments that change it."""
    path = page.root / "docs" / "experiments" / "experiments.toml"
    if not path.is_file() or s.name not in PAPERS:
        return {}
    tool = experiment_tool()
    text = "\n".join(s.lines) + "\n"
    sha = hashlib.sha256((page.root / s.name).read_bytes()).hexdigest()
    figures = tool.read_figures(page.root)
    blocks: dict[int, list[str]] = {}
    for exp in tool.load_experiments(page.root):
        if exp.script == s.name:
            html_ = try_html(tool, exp, page.root, page, figures.get(exp.name), sha)
            blocks.setdefault(tool.anchor_line(exp, text, page.root), []).append(html_)
    return blocks


# --------------------------------------------------------------------------------------
# A page
# --------------------------------------------------------------------------------------

def slug(text: str, taken: set[str]) -> str:
    base = "h-" + (re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:48].strip("-") or "section")
    name, k = base, 2
    while name in taken:
        name, k = f"{base}-{k}", k + 1
    taken.add(name)
    return name


def paper_link(docstring: str) -> tuple[str, str] | None:
    """(label, address) of the paper a script's docstring names: its arXiv id, else its ACL Anthology id."""
    arxiv = re.search(r"arXiv:(\d{4}\.\d{4,5})", docstring)
    if arxiv:
        return f"arXiv:{arxiv[1]}", f"https://arxiv.org/abs/{arxiv[1]}"
    acl = re.search(r"ACL Anthology ([\w.-]*\w)", docstring)
    if acl:
        return f"ACL Anthology {acl[1]}", f"https://aclanthology.org/{acl[1]}/"
    return None


def title_of(docstring: str) -> str:
    return " ".join(docstring.split("\n\n", 1)[0].split())


def head(title: str) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">\n'
            '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            '<meta name="color-scheme" content="light dark">\n'
            f"<title>{html.escape(title)}</title>\n"
            '<link rel="stylesheet" href="assets/katex/katex.min.css">\n'
            '<link rel="stylesheet" href="assets/equations.css">\n'
            '<link rel="stylesheet" href="assets/pages.css">\n'
            "</head>\n")


def script_page(s: Script, equations: dict[int, Equation], page: Page, root: Path) -> str:
    numbers = sorted(equations)
    where = anchors(s, numbers)
    code_anchors = {line for line in where.values() if s.kind.get(line) == "code"}
    sections = sections_of(s)
    tokens = token_lines("\n".join(s.lines) + "\n")
    paper = page.paper
    boxes: dict[int, list[tuple[Equation, int | None]]] = {}
    for number in numbers:
        line = where[number]
        boxes.setdefault(line, []).append((equations[number], line if line in code_anchors else None))
    tries = try_blocks(s, page)
    taken: set[str] = set()
    body, contents = [], []
    comments = {n for n, k in s.kind.items() if k == "comment"}
    for sec in sections:
        if sec.heading_lines:
            ident = slug(sec.heading or "section", taken)
            contents.append((ident, sec.heading))
            body.append(f'<section class="row banner"><div class="prose"><h2 id="{ident}">'
                        f"{anchor_spans(sec.heading_lines)}{inline_text(sec.heading, page)}</h2></div>"
                        f'<div class="code"></div></section>')
            continue
        code = list(sec.code)
        while code and s.kind[code[-1]] == "blank":
            sec.quiet.append(code.pop())
        while code and s.kind[code[0]] == "blank":
            sec.quiet.append(code.pop(0))
        module_doc = [(n, t) for n, t in sec.prose if n in s.module_doc]
        if module_doc:                 # the module's docstring: the width of the page, its commands whole
            quiet = anchor_spans(sorted(n for n in sec.quiet if n in s.module_doc))
            body.append(f'<section class="row wide"><div class="prose">'
                        f"{render_prose(module_doc, boxes, page, comments)}{quiet}</div></section>")
            sec.prose = [(n, t) for n, t in sec.prose if n not in s.module_doc]
            sec.quiet = [n for n in sec.quiet if n not in s.module_doc]
            if not (sec.prose or code or sec.quiet):
                continue
        starts = sorted(name for name, line in s.names.items() if [line] == code[:1])
        ids = "".join(f'<span id="{name}"></span>' for name in starts if s.name == "common.py")
        prose = render_prose(sec.prose, boxes, page, comments)
        quiet = anchor_spans(sorted(set(sec.quiet)))
        code_html = render_code_column(s, code, tokens, page, boxes, tries) if code else ""
        body.append(f'<section class="row"><div class="prose">{ids}{prose}{quiet}</div>'
                    f'<div class="code">{code_html}</div></section>')
    if tries:
        lost = ", ".join(str(n) for n in sorted(tries))
        raise BuildError(f"{s.name}: the experiments about lines {lost} found no place on the page (a line "
                         f"of code inside a function: see docs/experiments/experiments.toml's anchor)")
    if boxes:
        lost = ", ".join(str(n) for n in sorted(boxes))
        raise BuildError(f"{s.name}: the equations to be typeset on lines {lost} found no place on the page")
    body_html = "\n".join(body)
    if s.name == "common.py":
        body_html = common_anchors(body_html, s)
    label = paper_link(s.docstring)
    if s.name in PAPERS and label is None:
        raise BuildError(f"{s.name}: its docstring names no arXiv id (arXiv:NNNN.NNNNN) and no ACL Anthology "
                         f"id, so its page cannot link its paper")
    stem = Path(s.name).stem
    links = []
    if label:
        links.append(f'<li>Paper: <a href="{label[1]}">{html.escape(label[0])}</a></li>')
    if stem in page.docs:
        links.append(f'<li>Method page: <a href="doc-{stem}.html">docs/{stem}.md</a></li>')
    links.append(f'<li>Source: <a href="../../{s.name}">{s.name}</a></li>')
    toc = "".join(f'<li><a href="#{i}">{html.escape(t)}</a></li>' for i, t in contents)
    eq_list = " ".join(f'<a href="#eq-{n}">({n})</a>' for n in numbers)
    title = title_of(s.docstring)
    header = (f'<header class="row top"><div class="prose"><p class="crumbs"><a href="index.html">'
              f"Annotated scripts</a></p><h1>{html.escape(s.name)}</h1>"
              + (f'<p class="subtitle">{html.escape(title)}</p>' if title else "")
              + f'<ul class="links">{"".join(links)}</ul>'
              + (f'<p class="eqs">Equations of {html.escape(paper or "the paper")}, typeset from it: '
                 f"{eq_list}</p>" if numbers else "")
              + (f'<details class="toc"><summary>Contents</summary><ul>{toc}</ul></details>' if toc else "")
              + '</div><div class="code"></div></header>')
    footer = ('<footer class="row foot"><div class="prose"><p>Made by <code>python tools/pages.py</code> '
              f'from <a href="../../{s.name}">{s.name}</a>'
              + (' and <a href="../equations.tex">docs/equations.tex</a>' if numbers else "")
              + ': edit those, not this page.</p></div><div class="code"></div></footer>')
    title_line = f"{s.name}, annotated" + (f": {paper}" if paper else "")
    return (head(title_line) + "<body>\n" + header + "\n<main>\n" + body_html + "\n</main>\n" + footer
            + "\n</body>\n</html>\n")


def common_anchors(body: str, s: Script) -> str:
    """An id per top-level name of common.py, on the section that starts with it, else on its line."""
    for name, line in sorted(s.names.items(), key=lambda x: x[1]):
        if f'<span id="{name}"></span>' in body:
            continue
        body = re.sub(f'(<span class="line i\\d" id="L{line}">)', rf'\1<span id="{name}"></span>', body,
                      count=1)
    return body


def syllabus(root: Path) -> str:
    """Every experiment as one list, script by script: what it changes, where its block is, and how
    long it took on the laptop testbed (both arms, both seeds), or that it is not measured yet."""
    if not (root / "docs" / "experiments" / "experiments.toml").is_file():
        return ""
    tool = experiment_tool()
    figures = tool.read_figures(root)
    groups: dict[str, list[str]] = {}
    for exp in tool.load_experiments(root):
        seconds = tool.laptop_seconds(figures[exp.name]) if exp.name in figures else None
        took = f"{tool.minutes(seconds)} on a laptop" if seconds else "not measured yet"
        stem = Path(exp.script).stem
        groups.setdefault(exp.script, []).append(
            f'<li><a href="{stem}.html#try-{html.escape(exp.name)}">{html.escape(exp.title)}</a> '
            f'<span class="meta">{html.escape(exp.name)} · {took}</span></li>')
    lists = "".join(f"<li>{html.escape(script)}<ul>{''.join(items)}</ul></li>"
                    for script, items in groups.items())
    return ('<h2 id="experiments">Experiments to try</h2><p>Each changes one part of a script, as a '
            "patch in docs/experiments/ or a flag its paper names, and is measured against the unchanged "
            "script on a laptop: all-MiniLM-L6-v2, 40 steps, two seeds. Its block on the script's page "
            "stands beside the line it changes, with the command that runs both arms "
            "(<code>python tools/experiment.py NAME</code>), what moved, and the curves. The times are "
            "of both arms, both seeds, on two CPU cores; a control already run is reused.</p>"
            f'<ul class="syllabus">{lists}</ul>')


def index_page(scripts: list[Script], counts: dict[str, int], docs: list[str] = (), tries: str = "") -> str:
    rows = []
    for s in scripts:
        stem = Path(s.name).stem
        label = paper_link(s.docstring)
        paper = (f'<a href="{label[1]}">{html.escape(label[0])}</a>' if label else "")
        eqs = f"{counts.get(s.name, 0)} equations typeset" if counts.get(s.name) else "no equation"
        method = f' · <a href="doc-{stem}.html">method page</a>' if stem in docs else ""
        rows.append(f'<li><a class="page" href="{stem}.html">{html.escape(s.name)}</a> '
                    f'<span class="what">{html.escape(title_of(s.docstring))}</span> '
                    f'<span class="meta">{paper}{" · " if paper else ""}{eqs}{method}</span></li>')
    others = [d for d in docs if d not in {Path(s.name).stem for s in scripts}]
    others_links = [f'<a href="doc-{d}.html">{d}.md</a>' for d in others]
    body = (
        '<main class="solo"><h1>Annotated scripts</h1>'
        "<p>One page per script, to read beside its paper: the script's docstrings and comments as "
        "prose on the left, the code on the right in one piece, with a number and a link anchor per "
        "line (<code>simcse.html#L112</code>); the comments inside a function stand in the code, as "
        "notes. Each equation a script names is typeset from its paper in the place of the comment "
        "that states it, beside the line that computes it (<code>simcse.html#eq-4</code>); the "
        "script's own ASCII form is one click away, so the page and the file can be matched. The "
        "scripts are the source: these pages are made from them and from "
        "<a href=\"../equations.tex\">docs/equations.tex</a> by <code>python tools/pages.py</code>. "
        "They open from a clone, offline, and fetch nothing.</p>"
        f'<ul class="index">{"".join(rows)}</ul>' + tries
        + (f"<p>The other pages of docs/: {', '.join(others_links)}.</p>" if others else "")
        + '<p><a href="../../README.md">README.md</a></p></main>')
    return head("Annotated scripts") + "<body>\n" + body + "\n</body>\n</html>\n"


# --------------------------------------------------------------------------------------
# docs/*.md as pages (markdown-it-py, pinned in tools/pages-requirements.txt): their links
# between themselves and to the annotated pages kept working from docs/pages/
# --------------------------------------------------------------------------------------

def github_slug(text: str, taken: dict[str, int]) -> str:
    """A heading's anchor as GitHub makes it (so that `rcl.md#under-ddp-torchrun` holds here too)."""
    base = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
    k = taken.get(base, 0)
    taken[base] = k + 1
    return base if k == 0 else f"{base}-{k}"


def doc_href(href: str, docs: set[str]) -> str:
    """A link of docs/X.md, as it resolves from docs/pages/."""
    if re.match(r"[a-z]+:|#", href):
        return href
    path, hash_, anchor = href.partition("#")
    if path.startswith("pages/"):
        return path[len("pages/"):] + hash_ + anchor
    if "/" not in path and path.endswith(".md") and path[:-3] in docs:
        return f"doc-{path[:-3]}.html" + hash_ + anchor
    return "../" + path + hash_ + anchor


def doc_page(root: Path, stem: str, docs: set[str]) -> str:
    """docs/<stem>.md rendered to HTML, offline, with GitHub's heading anchors and tables."""
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark", {"html": False}).enable("table")
    tokens = md.parse((root / "docs" / f"{stem}.md").read_text(encoding="utf-8"))
    taken: dict[str, int] = {}
    title = stem
    for k, tok in enumerate(tokens):
        if tok.type == "heading_open":
            text = tokens[k + 1].content
            tok.attrSet("id", github_slug(text, taken))
            if tok.tag == "h1" and title == stem:
                title = re.sub(r"[`*]", "", text)
        for child in [tok] + list(tok.children or []):
            for attr in ("href", "src"):
                if child.attrGet(attr):
                    child.attrSet(attr, doc_href(child.attrGet(attr), docs))
    body = md.renderer.render(tokens, md.options, {})
    annotated = (f'<a href="{stem}.html">the annotated {stem}.py</a> · ' if (root / f"{stem}.py").is_file()
                 else "")
    crumbs = (f'<p class="crumbs"><a href="index.html">Annotated scripts</a> · {annotated}'
              f'made from <a href="../{stem}.md">docs/{stem}.md</a></p>')
    return (head(f"docs/{stem}.md: {title}") + '<body>\n<main class="solo doc">' + crumbs + body
            + "</main>\n</body>\n</html>\n")


# --------------------------------------------------------------------------------------
# The build
# --------------------------------------------------------------------------------------

def generate(root: Path | None = None, scripts: tuple[str, ...] | None = None,
             equations_file: str = EQUATIONS) -> dict[str, bytes]:
    """Every file the build makes, relative to docs/pages/ -> its bytes (by default, of this
    repository's scripts)."""
    root = ROOT if root is None else root
    scripts = SCRIPTS if scripts is None else scripts
    has_file = (root / equations_file).is_file()
    equations, inlines = read_entries(root / equations_file) if has_file else ({}, [])
    wrong = coverage(root, scripts, equations) + inline_coverage(root, scripts, inlines)
    if wrong:
        raise BuildError("the scripts and the equations file disagree:\n" + "\n".join(wrong))
    typeset(equations, equations_file, inlines)
    read = [read_script(root / name, name) for name in scripts]
    common = next((s for s in read if s.name == "common.py"), None)
    docs = sorted(p.stem for p in (root / "docs").glob("*.md"))
    page = Page(equations=set(), common=set(common.names) if common else set(), scripts=tuple(scripts),
                root=root, docs=set(docs))
    rules = page.rules
    for piece in inlines:
        piece.html = styles_to_classes(piece.html, rules)
    files: dict[str, bytes] = {}
    counts = {}
    for s in read:
        own = {n: eq for (script, n), eq in equations.items() if script == s.name}
        counts[s.name] = len(own)
        page.equations = set(own)
        page.common_href = "" if s.name == "common.py" else "common.html"
        page.inlines = [i for i in inlines if i.script == s.name]
        page.paper = PAPERS.get(s.name, "")
        page.fixes = {flat(eq.corrected.ascii).rstrip("."): n for n, eq in own.items() if eq.corrected}
        files[f"{Path(s.name).stem}.html"] = script_page(s, own, page, root).encode()
    for stem in docs:
        files[f"doc-{stem}.html"] = doc_page(root, stem, set(docs)).encode()
    files["index.html"] = index_page(read, counts, docs, syllabus(root)).encode()
    files["assets/equations.css"] = equations_css(rules).encode()
    if equations:
        files.update(katex_assets())
    return files


def write(files: dict[str, bytes], out: Path) -> None:
    """Write the build into `out`, removing what an earlier build made that this one does not."""
    out.mkdir(parents=True, exist_ok=True)
    for old in sorted(out.rglob("*")):
        rel = old.relative_to(out).as_posix()
        if old.is_file() and rel not in files and rel not in HANDWRITTEN and (
                rel.endswith(".html") or rel.startswith("assets/katex/") or rel == "assets/equations.css"):
            old.unlink()
    for rel, data in sorted(files.items()):
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_file() or path.read_bytes() != data:
            path.write_bytes(data)


def stale(files: dict[str, bytes], out: Path) -> list[str]:
    """What differs between a fresh build and the pages in `out`."""
    wrong = []
    for rel, data in sorted(files.items()):
        path = out / rel
        if not path.is_file():
            wrong.append(f"{rel}: missing")
        elif path.read_bytes() != data:
            wrong.append(f"{rel}: differs from a fresh build")
    for path in sorted(out.rglob("*")):
        rel = path.relative_to(out).as_posix()
        if path.is_file() and rel not in files and rel not in HANDWRITTEN:
            wrong.append(f"{rel}: not made by the build")
    for rel in HANDWRITTEN:
        if not (out / rel).is_file():
            wrong.append(f"{rel}: missing (written by hand, not made by the build)")
    return wrong


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=f"Once, before the first build: {SETUP} (KaTeX, as pinned).")
    parser.add_argument("--check", action="store_true", help="build in memory and name every file of "
                        "docs/pages/ that differs from what the build makes; change nothing")
    args = parser.parse_args(argv)
    if pygments_differs():
        print(f"note: {pygments_differs()}", file=sys.stderr)
    try:
        files = generate()
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    out = ROOT / OUT
    if args.check:
        wrong = stale(files, out)
        if wrong:
            print("stale pages (rebuild: python tools/pages.py):\n" + "\n".join(wrong), file=sys.stderr)
            return 1
        print(f"{OUT}: {len(files)} files, as a fresh build makes them")
        return 0
    write(files, out)
    print(f"{OUT}: {len(files)} files ({sum(map(len, files.values())) // 1024} KB), "
          f"{sum(1 for f in files if f.endswith('.html'))} pages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
