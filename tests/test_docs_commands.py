"""Every command the docs show still runs: README.md and docs/*.md, checked without running a workload.

Where commands are found: fenced code blocks (untagged, bash, sh, shell, console; a line ending in a
backslash joins the next, a leading `$ ` prompt is dropped, `# ...` is a comment) and inline `code`
spans (which may wrap a line). A line is cut into simple commands at `;`, `&&`, `||`, `&` and a
pipe ` | `; redirections (`> log 2>&1`) are dropped; a quoted argument holding a command (`ssh ...
--command "cd x && python -m ..."`) is searched too. A simple command's program is its first
`python`/`python3` word, or its first word after `VAR=value` prefixes (so `nohup nice -n 10 python
-m ...`, `srun ... python -m ...` are found).

What is checked, by program:
  * `python -m MODULE ...`, `python FILE.py ...` for a MODULE / FILE of this repository (preft_jax,
    pallas_kernels, serve, train, benchmarks, experiments, scripts), and the console scripts of
    pyproject's [project.scripts] (`preft-jax`, `preft-serve`, `preft-train`):
    (a) the module resolves (importlib.util.find_spec; the FILE exists);
    (b) the arguments parse with the module's own argparse parser, subcommands included: one worker
        process calls the module's `main(argv)` (a console script: its entry point, sys.argv set) and
        stops it inside its first `parse_args` once that has parsed, so nothing past the parse runs
        (a main() that reaches no parse within JOB_SECONDS is stopped and fails).
        Where the module that asked for the parse has a public `config_from_args` or `finish_args`
        (the flag validation train.sft/grpo and benchmarks.roofline/train_mfu do before any work),
        it is called on the parsed flags too. Unknown flags, bad choices or types fail, and so does an
        abbreviated flag (argparse would take `--step` for `--steps`; a doc spells flags out).
  * `python -m pytest ...`: the named test files exist and every marker in `-m EXPR` is registered
    in pyproject.toml (the fast loop `-m "not slow"` stays a real filter).
  * `bash FILE`, `sh FILE`, `./FILE`, `.ci/run`: the file exists.
  * anything else (pip, git, lint-imports, vllm, gcloud, ...) is not ours: skipped.

What may stand in for a value (the docs' placeholders):
  * `...` (unquoted; `"..."` is a literal value) elides arguments: those around it are still checked,
    and a missing required argument is no error. An inline span is a reference inside prose, so the
    same holds there (`python -m serve generate|server` names the subcommands without their flags).
  * `[...]` marks an optional group: it is checked as if given.
  * `a|b|c` inside one word, or `[A | B]` in a group, lists alternatives: each one is checked (the
    other lists at their first alternative).
  * A value holding an ALL-CAPS word (`N`, `PATH.gguf`, `GB/s`, `data=D,tensor=T`), a `<...>` or a
    `$VAR` is a placeholder: where it follows a flag, a valid value of that flag's choices / type
    stands in for it; elsewhere it stays as written.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import io
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OURS = ("preft_jax", "pallas_kernels", "serve", "train", "benchmarks", "experiments", "scripts")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CONSOLE = PYPROJECT["project"]["scripts"]              # name -> "module:function"
MARKERS = {m.split(":")[0].strip() for m in PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]}
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
PH = "\x00"                     # prefixes a placeholder word on its way to the worker
ELLIPSIS = ("...", "\u2026")
_PLACEHOLDER = re.compile(r"\$\{?[A-Za-z_]|<[^<>]+>|(?<![A-Za-z0-9])[A-Z][A-Z0-9_]*(?![a-z])")
_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_FENCE = re.compile(r"^\s*```\s*([\w+-]*)")


# ------------------------------------------------------------------------------------- extraction
def snippets(text: str) -> list[tuple[int, str, bool]]:
    """(line, shell text, inline) of the fenced shell lines and the inline code spans of markdown."""
    out, prose = [], []
    lang, buf, start = None, None, 0
    for n, line in enumerate(text.splitlines(), 1):
        if lang is None:
            m = _FENCE.match(line)
            if m:
                lang = m.group(1).lower()
                prose.append("")
            else:
                prose.append(line)
            continue
        prose.append("")
        if line.strip().startswith("```"):
            if buf is not None:
                out.append((start, buf, False))
            lang, buf = None, None
            continue
        if lang not in SHELL_LANGS:
            continue
        s = line.strip()
        if buf is None:
            start, buf = n, (s[2:] if s.startswith("$ ") else s)
        else:
            buf += " " + s
        if buf.endswith("\\"):
            buf = buf[:-1].rstrip()
        else:
            out.append((start, buf, False))
            buf = None
    joined = "\n".join(prose)
    for m in re.finditer(r"`((?:[^`\n]|\n(?![ \t]*\n))+)`", joined):
        out.append((joined.count("\n", 0, m.start()) + 1, re.sub(r"\s*\n\s*", " ", m.group(1)), True))
    return sorted(out)


def words(s: str) -> list[tuple[str, bool] | str]:
    """Shell words as (text, quoted), and operators as plain strings ('|' a pipe, ';' any other)."""
    out, cur, quoted, have, i = [], "", False, False, 0

    def flush():
        nonlocal cur, quoted, have
        if have:
            out.append((cur, quoted))
        cur, quoted, have = "", False, False

    while i < len(s):
        c = s[i]
        if c in "'\"":
            j = s.find(c, i + 1)
            j = len(s) if j < 0 else j
            cur, quoted, have, i = cur + s[i + 1:j], True, True, j + 1
        elif c == "\\" and i + 1 < len(s):
            cur, have, i = cur + s[i + 1], True, i + 2
        elif c.isspace():
            flush()
            i += 1
        elif c == "#" and not have:
            break
        elif c in "<>":                       # a redirection: `> f`, `2>&1`, `>/dev/null`
            if not cur.isdigit():
                flush()
            cur, quoted, have = "", False, False
            j = i
            while j < len(s) and not s[j].isspace():
                j += 1
            if s[i:j] in (">", ">>", "<", "&>"):      # the target is the next word
                while j < len(s) and s[j].isspace():
                    j += 1
                while j < len(s) and not s[j].isspace():
                    j += 1
            i = j
        elif c in ";&" or (c == "|" and not have and (i + 1 == len(s) or s[i + 1] in " \t|")):
            flush()
            out.append("|" if c == "|" and s[i + 1:i + 2] != "|" else ";")
            i += 2 if s[i + 1:i + 2] == c else 1
        else:
            cur, have, i = cur + c, True, i + 1
    flush()
    return out


@dataclasses.dataclass
class Command:
    doc: str
    line: int
    text: str                 # the command as the doc writes it (after joining lines)
    kind: str                 # module | console | file | pytest | exists
    target: str               # module name, console script name, file path
    variants: list            # argv lists (placeholders prefixed with PH)
    tolerant: bool            # elided or inline: a missing required argument is no error

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


def _is_placeholder(w: str) -> bool:
    return bool(_PLACEHOLDER.search(w))


def expand(args: list[tuple[str, bool] | str]) -> tuple[list[list[str]], bool]:
    """The argv variants of a documented argument list (see the module docstring) and whether it elides."""
    elided = False
    root: list = []
    stack = [[root]]                      # per open group: its alternatives (lists of items)

    def items():
        return stack[-1][-1]

    for w in args:
        if w == "|":                      # a separator between alternatives of a group
            if len(stack) > 1:
                stack[-1].append([])
            continue
        text, quoted = w
        if not quoted and text in ELLIPSIS:
            elided = True
            continue
        opens = closes = 0
        if not quoted:
            while text.startswith("["):
                opens, text = opens + 1, text[1:]
            while text.endswith("]") and not text.endswith("[]"):
                closes, text = closes + 1, text[:-1]
        for _ in range(opens):
            group = [[]]
            items().append(("alt", group))
            stack.append(group)
        if text in ELLIPSIS and not quoted:
            elided = True
        elif text:
            if not quoted and "|" in text:
                items().append(("alt", [[("word", p, False)] for p in text.split("|")]))
            else:
                items().append(("word", text, quoted))
        for _ in range(closes):
            if len(stack) > 1:
                stack.pop()
    points = []

    def find(seq):
        for it in seq:
            if it[0] == "alt":
                points.append(it)
                for alt in it[1]:
                    find(alt)
    find(root)

    def render(seq, choice):
        out = []
        for it in seq:
            if it[0] == "alt":
                out += render(it[1][choice.get(id(it), 0)], choice)
            else:
                _, text, quoted = it
                ph = not text.startswith("-") and _is_placeholder(text)
                out.append(PH + text if ph else text)
        return out

    variants = [render(root, {})]
    for p in points:
        for j in range(1, len(p[1])):
            v = render(root, {id(p): j})
            if v not in variants:
                variants.append(v)
    return variants, elided


def _plain(w) -> str | None:
    return w[0] if isinstance(w, tuple) else None


def commands_in(doc: str, line: int, text: str, inline: bool) -> list[Command]:
    out, ws = [], words(text)
    simple, cur, depth = [], [], 0
    for w in ws:
        if w == ";" or (w == "|" and depth == 0):      # a `|` inside `[A | B]` separates alternatives
            simple.append(cur)
            cur = []
            continue
        if isinstance(w, tuple) and not w[1]:
            depth += len(w[0]) - len(w[0].lstrip("[")) - (len(w[0]) - len(w[0].rstrip("]")))
        cur.append(w)
    simple.append(cur)
    for cmd in simple:
        for w in cmd:                     # a command inside a quoted argument (ssh --command "...")
            if isinstance(w, tuple) and w[1] and re.search(r"\bpython3? |\bpreft-(jax|serve|train)\b", w[0]):
                out += commands_in(doc, line, w[0], inline)
        plain = [_plain(w) for w in cmd]
        k = 0
        while k < len(plain) and plain[k] is not None and _ASSIGN.match(plain[k]):
            k += 1
        if k == len(plain):
            continue
        first = plain[k]
        py = next((i for i, p in enumerate(plain) if p in ("python", "python3")), None)
        shown = " ".join(p if p is not None else "|" for p in plain[k:])
        if py is not None and py + 1 < len(plain):
            nxt = plain[py + 1]
            if nxt == "-m" and py + 2 < len(plain):
                mod, rest = plain[py + 2], cmd[py + 3:]
                if mod == "pytest":
                    kind = "pytest"
                elif mod.split(".")[0] in OURS:
                    kind = "module"
                else:
                    continue
            elif nxt and nxt.endswith(".py") and nxt.split("/")[0] in OURS:
                kind, mod, rest = "file", nxt, cmd[py + 2:]
            else:
                continue
        elif first in CONSOLE:
            kind, mod, rest = "console", first, cmd[k + 1:]
        elif first in ("bash", "sh") and k + 1 < len(plain) and plain[k + 1]:
            out.append(Command(doc, line, shown, "exists", plain[k + 1], [], inline))
            continue
        elif first and (first == ".ci/run" or first.startswith("./")):
            out.append(Command(doc, line, shown, "exists", first, [], inline))
            continue
        else:
            continue
        variants, elided = expand(rest)
        out.append(Command(doc, line, shown, kind, mod, variants, elided or inline))
    return out


def documented_commands() -> list[Command]:
    out = []
    for path in DOCS:
        rel = str(path.relative_to(ROOT))
        for line, text, inline in snippets(path.read_text(encoding="utf-8")):
            out += commands_in(rel, line, text, inline)
    return out


COMMANDS = documented_commands()
CHECKED = [c for c in COMMANDS if c.kind in ("module", "console", "file")]


# ------------------------------------------------------------------------ the worker (subprocess)
class _Parsed(BaseException):
    """Raised inside the intercepted parse_args once the flags parsed: main() stops there."""


class _Runaway(BaseException):
    """A main() that has not reached a parse within JOB_SECONDS (it would be running its workload)."""


JOB_SECONDS = 60


def _runaway(*_):
    raise _Runaway


def _parsers(parser: argparse.ArgumentParser):
    """The parser and its subcommands' parsers."""
    yield parser
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for p in {id(p): p for p in a.choices.values()}.values():
                yield from _parsers(p)


def _stand_in(action, text: str) -> str:
    if action.choices:
        return str(next(iter(action.choices)))
    if action.type is None or action.type is str:
        return text
    for cand in ("1", "1.0", "a", text):
        try:
            action.type(cand)
            return cand
        except Exception:                 # noqa: BLE001 -- try the next stand-in
            pass
    return text


def _fill(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """argv with each placeholder replaced by a valid value of the flag before it."""
    out, p, pending = [], parser, None
    for a in args:
        if a.startswith(PH):
            out.append(_stand_in(pending, a[1:]) if pending is not None else a[1:])
            if pending is not None and pending.nargs in (None, "?", 1):
                pending = None
        elif a.startswith("-") and len(a) > 1 and not a[1:].replace(".", "").isdigit():
            act = p._option_string_actions.get(a.split("=")[0])
            pending = act if act is not None and act.nargs != 0 and "=" not in a else None
            out.append(a)
        else:
            if pending is None:
                sub = next((x for x in p._actions if isinstance(x, argparse._SubParsersAction)), None)
                if sub is not None and a in sub.choices:
                    p = sub.choices[a]
            elif pending.nargs in (None, "?", 1):
                pending = None
            out.append(a)
    return out


def _validate(ns, parser, frame):
    """Call the public flag validator of the module whose main() asked for the parse (if it has one)."""
    while frame is not None and not (frame.f_code.co_name == "main"
                                     and str(frame.f_globals.get("__name__", "")).split(".")[0] in OURS):
        frame = frame.f_back
    if frame is None:
        return
    g = frame.f_globals
    fn = g.get("config_from_args") or g.get("finish_args")
    if callable(fn) and getattr(fn, "__module__", None) == g["__name__"]:
        ns = argparse.Namespace(**vars(ns))
        for k, v in vars(ns).items():                  # train.cli.parse_noting's "unset" markers
            if type(v) is object:
                setattr(ns, k, parser.get_default(k))
        fn(ns)


def run_job(job: dict) -> str | None:
    """None if the job's argv parses with its module's parser, else what went wrong."""
    state = {"armed": True}
    orig_args, orig_known = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args

    def intercept(orig):
        def parse(self, args=None, namespace=None):
            if not state["armed"]:
                return orig(self, args, namespace)
            state["armed"] = False
            for p in _parsers(self):
                p.allow_abbrev = False             # a doc spells its flags out
                for a in p._actions if job["tolerant"] else ():
                    a.required = False
            args = _fill(self, list(sys.argv[1:] if args is None else args))
            ns = orig(self, args, namespace)
            _validate(ns[0] if isinstance(ns, tuple) else ns, self, sys._getframe(1))
            raise _Parsed
        return parse

    argv, err, out = [job["target"], *job["argv"]], io.StringIO(), io.StringIO()
    saved = sys.argv
    argparse.ArgumentParser.parse_args = intercept(orig_args)
    argparse.ArgumentParser.parse_known_args = intercept(orig_known)
    signal.signal(signal.SIGALRM, _runaway)
    signal.alarm(JOB_SECONDS)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            if job["kind"] == "console":
                mod, fn = CONSOLE[job["target"]].split(":")
                sys.argv = argv
                rc = getattr(importlib.import_module(mod), fn)()
            else:
                name = job["target"]
                if job["kind"] == "file":
                    name = name[:-3].replace("/", ".")
                spec = importlib.util.find_spec(name)
                if spec.submodule_search_locations is not None:
                    name += ".__main__"
                main = getattr(importlib.import_module(name), "main", None)
                if main is None:
                    return f"{name} has no main(argv) to check the arguments against"
                sys.argv = argv
                rc = main(job["argv"])
    except _Parsed:
        return None
    except _Runaway:
        return f"no argparse parse within {JOB_SECONDS} s: main() ran past the flags (a workload?)"
    except SystemExit as e:
        rc = e.code
        if isinstance(rc, str):
            err.write(rc)
            rc = 2
    except Exception as e:                # noqa: BLE001 -- reported as the job's failure
        return f"{type(e).__name__}: {e}"
    finally:
        signal.alarm(0)
        sys.argv = saved
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = orig_args, orig_known
    if rc in (0, None):                   # --help / --version, or a dispatcher's own usage text
        return None
    msg = err.getvalue().strip() or out.getvalue().strip()
    return f"exit {rc}: {msg.splitlines()[-1] if msg else ''}"


def _worker() -> None:
    jobs = json.load(sys.stdin)
    print(json.dumps({j["id"]: run_job(j) for j in jobs}))


# ---------------------------------------------------------------------------------------- tests
CANARIES = [       # jobs that must fail: the check can tell a broken command
    ({"kind": "module", "target": "serve", "argv": ["generate", "--prompt", "x", "--no-such-flag"],
      "tolerant": False}, "exit 2: python -m serve: error: unrecognized arguments: --no-such-flag"),
    ({"kind": "module", "target": "serve", "argv": ["server", "--quantize", "int3"], "tolerant": False},
     "exit 2: python -m serve server: error: argument --quantize: invalid choice: 'int3' (choose from 'int8', 'int4')"),
    ({"kind": "console", "target": "preft-train", "argv": ["sft", "--rank", PH + "N", "--steps", "x"],
      "tolerant": True}, "exit 2: preft-train sft: error: argument --steps: invalid int value: 'x'"),
    ({"kind": "module", "target": "train.sft", "argv": ["--mesh", "2,two,1"], "tolerant": False},
     "exit 2: error: mesh must be 'data,fsdp,tensor' (three integers), got '2,two,1' (ValueError; "
     "PREFT_TRACEBACK=1 shows where)"),                     # train.sft.config_from_args, after the parse
    ({"kind": "module", "target": "benchmarks.memory_plan", "argv": ["--model", "llama-9b"], "tolerant": False},
     "exit 2: unknown --model 'llama-9b'; known: smollm2-135m, qwen2.5-0.5b, llama-3.1-8b, llama-3.1-70b"),                     # memory_plan.finish_args
    ({"kind": "module", "target": "benchmarks.paged", "argv": ["--request", "8"], "tolerant": False},
     "exit 2: benchmarks.paged: error: unrecognized arguments: --request 8"),   # no abbreviations
    ({"kind": "module", "target": "serve", "argv": ["generate"], "tolerant": False},
     "exit 2: python -m serve generate: error: the following arguments are required: --prompt"),
]


def _jobs() -> list[dict]:
    jobs = []
    for c in CHECKED:
        for i, v in enumerate(c.variants):
            jobs.append({"id": f"{c.id} #{i}", "kind": c.kind, "target": c.target, "argv": v,
                         "tolerant": c.tolerant})
    for i, (job, _) in enumerate(CANARIES):
        jobs.append({"id": f"canary {i}", **job})
    return jobs


@pytest.fixture(scope="module")
def parsed() -> dict:
    """{job id: None | error} from one worker process (one jax import for every command)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    r = subprocess.run([sys.executable, __file__], input=json.dumps(_jobs()), capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_extraction_finds_the_documented_commands():
    kinds = {k: sum(c.kind == k for c in COMMANDS) for k in ("module", "console", "file", "pytest", "exists")}
    assert len(CHECKED) >= 100 and kinds["pytest"] >= 3 and kinds["exists"] >= 2, kinds
    assert {c.target for c in COMMANDS if c.kind == "console"} == set(CONSOLE)


def test_extraction_rules():
    md = "\n".join([
        "```bash",
        "JAX_PLATFORMS=cpu nohup python -m serve server --port 8000 \\",
        "    [--mode prefill|all] [--kv-cache-tokens N | --kv-cache-memory BYTES] ... > log 2>&1 &",
        "pip install -e .   # not ours",
        "for i in 1 2; do X=$i python -m train.sft --prompt \"...\" --out RUN & done; wait",
        "```",
        "A span `python -m preft_jax.cache",
        "[info|clear]` and `bash scripts/install.sh`; python blocks are skipped:",
        "```python",
        "os.system('python -m serve generate')",
        "```",
    ])
    got = [c for line, text, inline in snippets(md) for c in commands_in("x.md", line, text, inline)]
    assert [(c.line, c.kind, c.target, c.tolerant) for c in got] == [
        (2, "module", "serve", True), (5, "module", "train.sft", False),
        (7, "module", "preft_jax.cache", True), (8, "exists", "scripts/install.sh", True)]
    assert got[0].variants == [
        ["server", "--port", "8000", "--mode", "prefill", "--kv-cache-tokens", PH + "N"],
        ["server", "--port", "8000", "--mode", "all", "--kv-cache-tokens", PH + "N"],
        ["server", "--port", "8000", "--mode", "prefill", "--kv-cache-memory", PH + "BYTES"]]
    assert got[1].variants == [["--prompt", "...", "--out", PH + "RUN"]]
    assert got[2].variants == [["info"], ["clear"]]


def test_the_check_catches_broken_commands(parsed):
    assert [parsed[f"canary {i}"] for i in range(len(CANARIES))] == [want for _, want in CANARIES]


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c.kind != "pytest"], ids=lambda c: c.id)
def test_documented_command(cmd: Command, parsed):
    if cmd.kind == "exists":
        assert (ROOT / cmd.target).is_file(), f"{cmd.id}: no file {cmd.target}"
        return
    if cmd.kind == "file":
        assert (ROOT / cmd.target).is_file(), f"{cmd.id}: no file {cmd.target}"
    elif cmd.kind == "module":
        assert importlib.util.find_spec(cmd.target) is not None, f"{cmd.id}: no module {cmd.target}"
    errors = [f"{' '.join(v).replace(PH, '')}: {parsed[f'{cmd.id} #{i}']}"
              for i, v in enumerate(cmd.variants) if parsed[f"{cmd.id} #{i}"] is not None]
    assert not errors, f"{cmd.id}\n" + "\n".join(errors)


def test_ci_runs_the_readme_full_suite():
    """.ci/run runs README's "everything" command: no marker filter, the same options (cache plugin aside)."""
    readme = [c for c in COMMANDS if c.kind == "pytest" and c.doc == "README.md"]
    assert [c.variants[0] for c in readme][:3] == [["-q"], ["-q", "-m", "not slow"], ["-q"]]
    ci = [commands_in(".ci/run", n, line, False) for n, line in
          enumerate((ROOT / ".ci" / "run").read_text().splitlines(), 1) if "pytest" in line]
    assert [[c.variants for c in cs] for cs in ci] == [[[["-q", "-p", "no:cacheprovider"]]]]


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c.kind == "pytest"], ids=lambda c: c.id)
def test_documented_pytest_command(cmd: Command):
    argv = [a.replace(PH, "") for a in cmd.variants[0]]
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-m", "-k", "-p", "-n", "-W", "--dist", "--timeout", "--durations"):
            if a == "-m":
                names = set(re.findall(r"[A-Za-z_]\w*", argv[i + 1])) - {"and", "or", "not"}
                assert names <= MARKERS, f"{cmd.id}: unregistered markers {sorted(names - MARKERS)}"
            i += 2
            continue
        if not a.startswith("-"):
            assert (ROOT / a.split("::")[0]).exists(), f"{cmd.id}: no test path {a}"
        i += 1


if __name__ == "__main__":
    _worker()
