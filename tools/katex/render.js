// The one place tools/pages.py runs JavaScript: at build time, never in a page. It reads a JSON list
// of {key, tex, display} on stdin and writes {version, results: [{key, html} or {key, error}]} on
// stdout, each formula typeset by KaTeX (the version package-lock.json pins) into HTML, with MathML
// beside it for screen readers. A formula KaTeX cannot read gives its message, not a red formula.
"use strict";
const katex = require("katex");

let input = "";
process.stdin.setEncoding("utf8");
process.stdin.on("data", (chunk) => { input += chunk; });
process.stdin.on("end", () => {
  const results = JSON.parse(input).map(({ key, tex, display }) => {
    try {
      const html = katex.renderToString(tex, {
        displayMode: display, throwOnError: true, strict: "error", output: "htmlAndMathml", trust: false,
      });
      return { key, html };
    } catch (e) {
      return { key, error: e instanceof katex.ParseError ? e.message : String(e) };
    }
  });
  process.stdout.write(JSON.stringify({ version: katex.version, results }));
});
