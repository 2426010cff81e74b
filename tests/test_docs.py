"""The README's figures come from measurements: every number the README quotes about speed, time, reward or
size names its row of the headline table in docs/benchmarks.md (`[H3]`), and that row's value appears in the
README paragraph that cites it; every row gives a date, a machine, a command and the journal section with
details (docs/journal/).
Every command the docs cite resolves: its module or script exists and its arguments parse
(`tests/doc_commands.py`), and every repository file they name exists."""

from __future__ import annotations

import pathlib
import re

from tests import doc_commands as dc

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
ROW = re.compile(r"^\| (H\d+) \| (.+?) \| (.+?) \| (.+?) \| (.+?) \| (.+?) \|$")


def headline_rows() -> dict[str, dict[str, str]]:
    text = BENCHMARKS.read_text(encoding="utf-8")
    table = text.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        m = ROW.match(line.strip())
        if m:
            rid, figure, value, when, command, section = m.groups()
            assert rid not in rows, f"row {rid} twice"
            rows[rid] = dict(figure=figure, value=value, when=when, command=command, section=section)
    return rows


def paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def test_headline_rows_are_dated_sourced_and_point_to_a_section() -> None:
    rows = headline_rows()
    assert len(rows) >= 6
    for rid, row in rows.items():
        assert re.search(r"20\d\d-\d\d-\d\d", row["when"]), (rid, row["when"])
        assert "`" in row["command"], (rid, "the command that measured it, as code")
        m = re.fullmatch(r'(journal/[\w.-]+\.md) "(.+)"', row["section"])
        assert m, (rid, 'the section as journal/<file>.md "<heading>"', row["section"])
        lines = (BENCHMARKS.parent / m.group(1)).read_text(encoding="utf-8").splitlines()
        headings = {line.lstrip("#").strip() for line in lines if line.startswith("##")}
        assert m.group(2) in headings, (rid, m.group(1), m.group(2))


def test_readme_figures_cite_their_rows_and_quote_them() -> None:
    rows = headline_rows()
    cited = set()
    for para in paragraphs(README.read_text(encoding="utf-8")):
        for rid in re.findall(r"\[(H\d+)\]", para):
            assert rid in rows, f"README cites [{rid}], which docs/benchmarks.md's headline table lacks"
            value, flat = " ".join(rows[rid]["value"].replace("**", "").split()), " ".join(para.split())
            assert value in flat, f"README cites [{rid}] without quoting its value {value!r}: {flat[:200]}"
            cited.add(rid)
    assert cited, "the README cites no measurement"


def test_cited_commands_resolve() -> None:
    """Each `python -m X ...` / `python path.py ...` in README.md, docs/*.md, experiments/README.md and the
    Makefile: the module or script exists, names no machine's folder, and its command line parses the cited
    arguments (one subprocess for all, which stops each module at its parser)."""
    cmds = dc.doc_commands()
    assert len(cmds) >= 50 and {"tlt_jax.main", "gpu.suite"} <= {c.module for c in cmds}
    assert any(c.module and c.module.startswith("experiments.paper.") for c in cmds)
    bad = dc.problems(cmds)
    assert not bad, "cited commands that do not resolve:\n" + "\n".join(bad)


def test_cited_files_exist() -> None:
    missing = dc.missing_paths()
    assert not missing, "files the docs name that are not in the repository:\n" + "\n".join(missing)


FAKE_DOC = """
Good: `python -m experiments.paper.e2e_speedup --quick --arms none,ngram` and
`.venv/bin/python -m tlt_jax.main --config configs/tlt.py:drafter=none --config.rl.lr=1e-4 --workdir w`.

```bash
python -m experiments.no_such_script --quick                                  # no such module
python -m experiments.paper.e2e_speedup --quick --no-such-flag                # a flag it lacks
python3 -m experiments.paper.e2e_speedup --steps many                         # not an int
python -m tlt_jax.main --config configs/tlt.py --config.rl.no_such_key=1 --workdir w   # no such config key
python -m tlt_jax.main --config configs/no_such_config.py --workdir w         # no such config file
python experiments/gpu_suite.py --call 2                                      # a script that moved
python -m experiments.paper.e2e_speedup --quick --out /tmp/e2e                # a machine's folder
python -m tlt_jx.main --config configs/tlt.py                                 # neither ours nor known
```
"""


def test_the_command_check_fails_on_what_does_not_resolve() -> None:
    cmds = dc.commands(FAKE_DOC, "fake.md")
    assert len(cmds) == 10
    bad = dc.problems(cmds)
    assert len(bad) == 8, "\n".join(bad)  # one per bad command, none for the two good ones
    for cited, why in [
        ("experiments.no_such_script", "no module"),
        ("--no-such-flag", "unrecognized arguments"),
        ("--steps many", "invalid int value"),
        ("no_such_key", "no_such_key"),
        ("no_such_config.py", "Failed loading config file"),
        ("experiments/gpu_suite.py", "no script"),
        ("/tmp/e2e", "machine's folder"),
        ("tlt_jx.main", "neither this repository's nor known"),
    ]:
        assert any(cited in line and why in line.split("->", 1)[1] for line in bad), (cited, bad)


def test_readme_is_the_short_path() -> None:
    """README.md is the path a researcher takes (issue #54): under 300 lines, the first command within 40
    lines, DAPO on one node and on SLURM within 150, each headline figure cited once (the rest of the detail
    lives in docs/)."""
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) < 300, f"README.md has {len(lines)} lines: move detail to docs/usage.md"

    def first(pattern: str) -> int:
        return next(i for i, line in enumerate(lines, 1) if re.search(pattern, line))

    assert first(r"^make run\b") <= 40
    assert first(r"-m tlt_jax\.main --config configs/recipes/dapo_qwen2_5_7b\.py") <= 150
    assert first(r"sbatch .*configs/cluster/slurm_grpo\.sh") <= 150
    cites = re.findall(r"\[(H\d+)\]", "\n".join(lines))
    assert len(cites) == len(set(cites)), f"a figure cited twice: {sorted(cites)}"
