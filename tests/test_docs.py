"""The documents stay in step with the tree.

README is a user's page: at most 200 lines before its reference tables
(``## Layout``); its layout table names every package directory and top-level
module under ``sao_jax/``, and no cell of its tables runs past 300 characters.
Every file under ``docs/`` that a source or document cites exists, and a section
title quoted right after it (``docs/design/sandbox.md "Code tool"``) is one
of that file's headings; inside ``docs/design/`` the same holds for the
sibling files named bare (``math.md "Critic"``) or linked.
"""

import os
import pathlib
import re

import pytest

_CITING_DIRS = ("configs", "docs", "experiments", "sao_jax", "tests")
_MAX_CELL = 300
_MAX_README_LINES = 200  # before "## Layout": the user's page.
# `docs/<path>.md`, optionally followed by quoted section titles ("A" and "B").
_CITATION = re.compile(r"(?<![\w/])(docs/[\w./-]+?\.md)")
_TITLE = re.compile(r'^(?:,|\s|and)*"([^"\n]+)"')


def _repo_root() -> pathlib.Path:
  """The checkout, or under Bazel the runfiles tree of this test."""
  if "TEST_SRCDIR" in os.environ and "TEST_WORKSPACE" in os.environ:
    return (pathlib.Path(os.environ["TEST_SRCDIR"]) /
            os.environ["TEST_WORKSPACE"])
  return pathlib.Path(__file__).absolute().parents[1]


ROOT = _repo_root()


def _section(text: str, heading: str) -> str:
  """The text under the level-2 ``heading`` of a Markdown document."""
  match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text,
                    flags=re.S | re.M)
  assert match, f"no '## {heading}' section"
  return match.group(1)


def _table_cells(text: str) -> list[str]:
  return [cell.strip() for line in text.splitlines()
          if line.startswith("|") and not re.match(r"^\|[\s|:-]+\|$", line)
          for cell in line.strip().strip("|").split(" | ")]


def _package_parts() -> tuple[list[str], list[str]]:
  """Directories (``models/layers/``) and top-level modules under sao_jax/."""
  pkg = ROOT / "sao_jax"
  dirs = sorted(p.parent.relative_to(pkg).as_posix() + "/"
                for p in pkg.rglob("*.py") if p.parent != pkg)
  modules = sorted(p.name for p in pkg.glob("*.py") if p.name != "__init__.py")
  return sorted(set(dirs)), modules


def test_readme_layout_names_every_package_and_top_level_module():
  table = _section((ROOT / "README.md").read_text(), "Layout")
  dirs, modules = _package_parts()
  assert "models/" in dirs and "main.py" in modules
  missing = [d for d in dirs if f"`sao_jax/{d}`" not in table
             and f"`{d.split('/')[-2]}/`" not in table]
  missing += [m for m in modules if f"`{m}`" not in table]
  assert not missing, (
      f"README.md's layout table does not name {missing}: add a row (a "
      "package) or the module to the `sao_jax/` row")


def test_readme_is_a_short_page_before_its_reference_tables():
  lines = (ROOT / "README.md").read_text().splitlines()
  assert "## Layout" in lines
  before = lines.index("## Layout")
  assert before <= _MAX_README_LINES, (
      f"README.md has {before} lines before '## Layout' (at most "
      f"{_MAX_README_LINES}): move explanation into docs/design/<topic>.md "
      "and dated figures into BENCHMARKS.md or experiments/RESULTS.md")


def test_readme_table_cells_are_short():
  long = [c[:80] + "..." for c in _table_cells((ROOT / "README.md").read_text())
          if len(c) > _MAX_CELL]
  assert not long, f"README.md table cells over {_MAX_CELL} characters: {long}"


def _headings(doc: pathlib.Path) -> set[str]:
  return {m.group(1).strip() for m in
          re.finditer(r"^#+ (.+)$", doc.read_text(), flags=re.M)}


def _titles_after(text: str) -> list[str]:
  """The section titles quoted right after a citation (line breaks and
  comment or docstring continuation marks in between are spaces)."""
  text = re.sub(r"\s*\n\s*(#\s*)?", " ", text[:300])
  titles = []
  while match := _TITLE.match(text):
    titles.append(match.group(1))
    text = text[match.end():]
  return titles


def _citing_files() -> list[pathlib.Path]:
  files = [p for p in ROOT.glob("*.md")] + [ROOT / "BUILD"]
  for top in _CITING_DIRS:
    files += [p for p in (ROOT / top).rglob("*")
              if p.suffix in (".py", ".md") and p.is_file()]
  return sorted(files)


def _citations() -> list[tuple[str, str, list[str]]]:
  """(citing file, cited document, quoted titles) for every citation."""
  out = []
  for path in _citing_files():
    text = path.read_text()
    where = path.relative_to(ROOT).as_posix()
    for match in _CITATION.finditer(text):
      out.append((where, match.group(1), _titles_after(text[match.end():])))
    if where.startswith("docs/design/"):
      # Sibling files, named bare or linked: `math.md "Critic"`, (math.md).
      for match in re.finditer(r"(?<![\w/.-])([a-z_]+\.md)\b", text):
        if (ROOT / match.group(1)).exists():
          continue  # README.md, BENCHMARKS.md at the root.
        out.append((where, f"docs/design/{match.group(1)}",
                    _titles_after(text[match.end():].lstrip(")"))))
  return out


def test_cited_documents_and_sections_exist():
  citations = _citations()
  assert len(citations) > 100, len(citations)
  broken = []
  for where, doc, titles in citations:
    path = ROOT / doc
    if not path.is_file():
      broken.append(f"{where}: {doc} does not exist")
      continue
    for title in set(titles) - _headings(path):
      broken.append(f'{where}: {doc} has no heading "{title}"')
  assert not broken, "\n".join(sorted(set(broken)))


@pytest.mark.parametrize("old", ["DESIGN.md \u00a7", "DESIGN \u00a7"])
def test_no_citation_by_old_section_number(old):
  stale = [p.relative_to(ROOT).as_posix() for p in _citing_files()
           if old in p.read_text()]
  assert not stale, f"cite docs/design/<topic>.md \"Section\" instead: {stale}"
