"""The documentation holds together: a short README whose links (and every page's) land inside the
repository, generated pages that are what their generators write, no pointer to files the
repository does not have, and reference pages that cover what the code does (every error code,
a tenants file that parses)."""
from __future__ import annotations

import re
import subprocess
import unicodedata
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
MAX_README_LINES = 250


def test_the_readme_is_an_introduction_not_a_lab_notebook():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; figures belong in " \
        "results/ and docs/benchmarks.md, reference in docs/"


def test_the_readme_keeps_its_two_commands_working():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "bash scripts/start.sh" in readme and "bash scripts/test.sh" in readme
    assert "specgate serve" in (ROOT / "scripts" / "start.sh").read_text()
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def _anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    for title in re.findall(r"^#{1,6} +(.+?) *#*$", text, flags=re.M):
        slug = "".join(c for c in title.lower().replace(" ", "-")
                       if c in "-_" or unicodedata.category(c)[0] in "LN")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_lands_on_a_file_and_heading_in_the_repository(page):
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.is_relative_to(ROOT), f"{target}: outside the repository"
        assert dest.exists(), f"{page.name}: {target}: no such file"
        if anchor:
            assert anchor in _anchors(dest), f"{page.name}: {target}: no such heading"


def test_the_readme_leads_to_every_page_in_docs():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in _links(ROOT / "README.md")}
    orphans = [p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in linked]
    assert not orphans, f"docs pages the README does not link: {orphans}"


def _tracked() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True,
                             timeout=30).stdout.decode()
        return [ROOT / p for p in out.split("\0") if p]
    except (OSError, subprocess.SubprocessError):      # not a checkout: every file but the venv
        return [p for p in ROOT.rglob("*") if p.is_file()
                and not {".git", ".venv", "__pycache__"} & set(p.relative_to(ROOT).parts)]


def test_no_file_points_to_notes_outside_the_repository():
    # spelled in pieces, so this file does not name them
    outside = [n.encode() for n in ("DESIGN" + ".md", "STYLE" + ".md", "FINDINGS" + ".md",
                                    "../" + "shared")]
    found = [f"{p.relative_to(ROOT)}: {n.decode()}" for p in _tracked() if p.is_file()
             for n in outside if n in p.read_bytes()]
    assert not found, found


def test_docs_benchmarks_is_what_specgate_docs_writes():
    from tools import bench_docs
    committed = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert committed == bench_docs.render(ROOT), \
        "docs/benchmarks.md is generated from results/: run `specgate docs`, never edit it"


def test_docs_cli_is_what_specgate_docs_writes():
    from specgate import docs
    committed = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert committed == docs.render_cli(), \
        "docs/cli.md is generated from the commands' parsers: run `specgate docs`"
    assert str(ROOT) not in committed and "the machine's CPU count" in committed  # any checkout


def test_every_error_code_the_gateway_raises_is_in_the_api_page():
    api = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    codes = {c for p in (ROOT / "gateway").rglob("*.py")
             for c in re.findall(r'code="([a-z_]+)"', p.read_text(encoding="utf-8"))}
    # the codes spelled from a limit's kind or a key's owner (gateway/service.py,
    # gateway/http/routers/admin.py)
    codes |= {"rpm_exceeded", "tpm_exceeded", "concurrency_exceeded", "request_exceeds_tpm",
              "admin_key_conflict", "metrics_key_conflict"}
    assert len(codes) > 30
    missing = sorted(c for c in codes if f"`{c}`" not in api)
    assert not missing, f"error codes docs/api.md does not list: {missing}"


def test_the_tenants_file_in_the_deployment_page_parses():
    from gateway.tenancy.config import parse_tenants
    page = (ROOT / "docs" / "deployment.md").read_text(encoding="utf-8")
    (block,) = re.findall(r"```yaml\n(.*?)```", page, flags=re.S)
    tenants, admin = parse_tenants(yaml.safe_load(block))
    assert [t.name for t, _ in tenants] == ["acme"] and len(admin) == 1
