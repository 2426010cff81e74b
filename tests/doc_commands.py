"""The commands the documentation cites, and whether they resolve (tests/test_docs.py).

`commands(text)` finds, in a Markdown file's code (fenced blocks and inline spans) or a Makefile's lines,
every `python -m MODULE ARGS` / `python path.py ARGS` (also `python3`, `.venv/bin/python`, `$(PY)`).
`problems(cmds)` says what does not resolve: a module of this repository (tlt_jax, experiments, gpu) that
`importlib.util.find_spec` cannot find, a script that is not there, another module not in `EXTERNAL`, a
machine's absolute folder in the arguments, and arguments its command line refuses. The arguments are parsed,
not run: run as a script (`python tests/doc_commands.py` with the commands as JSON on stdin), this module runs
each cited module once under `runpy` with argparse's `parse_args` and absl's `app.run` replaced by a parse of
every cited argument list, which stops the module before it does anything else. One process for all of them:
JAX and the package are imported once.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import re
import shlex
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
REPO_PACKAGES = ("tlt_jax", "experiments", "gpu")
EXTERNAL = {"pytest", "pip", "venv", "sglang", "jupyter", "nbconvert"}  # other projects' tools
PLACEHOLDERS = {"N": "1"}  # a placeholder the docs write where a number goes
MACHINE_PATHS = re.compile(r"(?<![\w.])/(?:work|tmp|root|home)/")
_FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)
_INLINE = re.compile(r"`([^`]+?)`", re.S)
_COMMAND = re.compile(
    r"(?:^|(?<=[\s(;&|=]))(?:[\w./-]*/)?(?:python3?|\$\(PY\))\s+"
    r"(?P<target>-m\s+[\w.<>]+|[\w./-]+\.py)(?P<args>[^;&|#>`\n]*)"
)


@dataclasses.dataclass(frozen=True)
class Command:
    """One cited command: a module (`-m`) or a script path, its arguments, and where it is cited."""

    module: str | None
    script: str | None
    args: tuple[str, ...]
    where: str

    @property
    def target(self) -> str:
        return self.module or self.script or ""


def spans(text: str, markdown: bool = True) -> list[str]:
    """The code of a Markdown text (fenced blocks line by line, continuations joined; inline spans within a
    paragraph, whitespace collapsed), or every line of a Makefile."""
    if not markdown:
        return text.replace("\\\n", " ").splitlines()
    out = []
    for m in _FENCE.finditer(text):
        out += m.group(1).replace("\\\n", " ").splitlines()
    for m in _INLINE.finditer(_FENCE.sub("", text)):
        if "\n\n" not in m.group(1):
            out.append(" ".join(m.group(1).split()))
    return out


def _args(raw: str) -> tuple[str, ...]:
    """Shell words of a cited argument string (up to an unbalanced quote: the end of a string the command
    sits in), `...` and optional-brackets dropped, placeholders filled."""
    try:
        words = shlex.split(raw)
    except ValueError:
        words = shlex.split(re.split(r"[\"']", raw)[0])
    words = [w if w in ("", "[]") else w.strip("[]") for w in words if w not in ("...", "…", ")", "]", "[")]
    if words and words[-1].endswith(")") and "(" not in words[-1]:
        words[-1] = words[-1].rstrip(")")
    return tuple(PLACEHOLDERS.get(w, w) for w in words)


def commands(text: str, where: str, markdown: bool = True) -> list[Command]:
    """Every python command in the text's code (a module name with `<...>`, a pattern, skipped)."""
    out = []
    for span in spans(text, markdown):
        for m in _COMMAND.finditer(span):
            target = m.group("target")
            module = target.split()[1] if target.startswith("-m") else None
            if module and "<" in module:
                continue
            out.append(Command(module, None if module else target, _args(m.group("args")), where))
    return out


def doc_commands() -> list[Command]:
    """The commands of README.md, docs/*.md, experiments/README.md and the Makefile."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "experiments" / "README.md"]
    out = []
    for f in files:
        if f.exists():
            out += commands(f.read_text(encoding="utf-8"), str(f.relative_to(ROOT)))
    return out + commands((ROOT / "Makefile").read_text(), "Makefile", markdown=False)


_PATH = re.compile(
    r"(?<![\w/.-])((?:tlt_jax|experiments|gpu|tests|configs|notebooks)/[\w/.-]*\.(?:py|ipynb|md|json))"
)


def missing_paths() -> list[str]:
    """Files of the repository the docs name (`experiments/paper/case_study.py`, ...) that are not there."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "experiments" / "README.md"]
    out = []
    for f in files:
        text = f.read_text(encoding="utf-8") if f.exists() else ""
        out += [f"{f.relative_to(ROOT)}: {p}" for p in _PATH.findall(text) if not (ROOT / p).exists()]
    return sorted(set(out))


def _runnable(source: str) -> bool:
    """Whether a module has a command line this checker can stop after parsing (argparse or absl)."""
    return 'if __name__ == "__main__"' in source and ("parse_args(" in source or "app.run(" in source)


def _static_problem(cmd: Command) -> str | None:
    """What is wrong without running anything: a missing module or script, a machine's folder."""
    bad = [a for a in cmd.args if MACHINE_PATHS.search(a)]
    if bad:
        return f"names a machine's folder {bad}: cite a path inside the repository or a placeholder"
    if cmd.script:
        path = ROOT / cmd.script
        if not path.is_file():
            return f"no script {cmd.script}"
        return None if _runnable(path.read_text()) else f"{cmd.script} has no argparse/absl command line"
    top = cmd.module.split(".")[0]
    if top not in REPO_PACKAGES:
        return None if top in EXTERNAL else f"module {cmd.module} is neither this repository's nor known"
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        spec = importlib.util.find_spec(cmd.module)
    except ModuleNotFoundError:
        spec = None
    if spec is None or spec.origin is None:
        return f"no module {cmd.module}"
    if not _runnable(pathlib.Path(spec.origin).read_text()):
        return f"{cmd.module} has no argparse/absl command line"
    return None


def problems(cmds: list[Command], timeout: float = 240) -> list[str]:
    """One line per cited command that does not resolve (`where: python ... -> why`)."""
    out, to_parse = [], {}
    for c in cmds:
        why = _static_problem(c)
        if why:
            out.append(f"{c.where}: python {c.target} {' '.join(c.args)} -> {why}")
        elif c.module is None or c.module.split(".")[0] in REPO_PACKAGES:
            to_parse.setdefault(c.target, []).append(c)
    if to_parse:
        job = {t: [list(c.args) for c in cs] for t, cs in to_parse.items()}
        proc = subprocess.run(
            [sys.executable, str(pathlib.Path(__file__).resolve())],
            input=json.dumps(job),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0:
            return out + [f"the parse check failed: {proc.stderr[-3000:]}"]
        errors = json.loads(proc.stdout.strip().splitlines()[-1])
        for target, errs in errors.items():
            for i, err in enumerate(errs):
                if err:
                    c = to_parse[target][i]
                    out.append(f"{c.where}: python {target} {' '.join(c.args)} -> {err}")
    return out


# ---- the parse check (the subprocess) ---------------------------------------------------------------------


class _Parsed(Exception):
    """Raised by the patched parsers once the cited arguments are parsed: the module stops there."""


def _parse_one(target: str, argv: list[str]) -> str | None:
    """Run `target` (a module, or a script path) with `argv` until it parses its command line, and stop it
    there: None if the arguments parse, else the parser's error. absl's flags the module defined are removed
    afterwards (the next run defines them again; ml_collections' overrides are read from sys.argv)."""
    import argparse
    import contextlib
    import io
    import runpy

    from absl import app, flags

    outcome: dict[str, str | None] = {}
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                original(self, argv)
            outcome["error"] = None
        except SystemExit:
            lines = err.getvalue().strip().splitlines()
            outcome["error"] = lines[-1] if lines else "exit"
        raise _Parsed

    def run(main, argv=None, **kw):
        try:
            flags.FLAGS(sys.argv)
            for name in set(flags.FLAGS) - defined:  # a config file that failed to load raises when read
                value = getattr(flags.FLAGS, name)
                if type(value).__name__ == "_ErrorConfig":
                    raise object.__getattribute__(value, "_error")
            outcome["error"] = None
        except Exception as e:  # a flag's error, or the config file's own
            outcome["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
        raise _Parsed

    defined = set(flags.FLAGS)
    argparse.ArgumentParser.parse_args, run_before, app.run = parse_args, app.run, run
    sys.argv = [target, *argv]
    try:
        if target.endswith(".py"):
            runpy.run_path(target, run_name="__main__")
        else:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    except _Parsed:
        pass
    except BaseException as e:  # the module failed before it parsed (an import error, an exit)
        return f"{type(e).__name__}: {e}".splitlines()[0]
    finally:
        argparse.ArgumentParser.parse_args, app.run = original, run_before
        flags.FLAGS.unparse_flags()
        for name in set(flags.FLAGS) - defined:
            delattr(flags.FLAGS, name)
    return outcome.get("error", "ran to its end without parsing a command line")


def main() -> None:
    job = json.loads(sys.stdin.read())
    sys.path.insert(0, str(ROOT))
    result = {}
    with open(__import__("os").devnull, "w") as devnull:
        for target, argvs in job.items():
            stdout = sys.stdout
            sys.stdout = devnull  # what a module prints while it starts
            try:
                result[target] = [_parse_one(target, argv) for argv in argvs]
            finally:
                sys.stdout = stdout
    print(json.dumps(result))


if __name__ == "__main__":
    main()
