"""The README's figures come from measurements: every number the README quotes about speed, time, reward or
size names its row of the headline table in docs/benchmarks.md (`[H3]`), and that row's value appears in the
README paragraph that cites it; every row gives a date, a machine, a command and the section with details."""

from __future__ import annotations

import pathlib
import re

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
    lines = BENCHMARKS.read_text(encoding="utf-8").splitlines()
    headings = {line.lstrip("#").strip() for line in lines if line.startswith("##")}
    for rid, row in rows.items():
        assert re.search(r"20\d\d-\d\d-\d\d", row["when"]), (rid, row["when"])
        assert "`" in row["command"], (rid, "the command that measured it, as code")
        assert row["section"].strip('"') in headings, (rid, row["section"])


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
