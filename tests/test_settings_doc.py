"""Every setting is documented, and every documented setting exists.

The settings classes are the one source of ``EPD_*`` settings; docs/deploy.md's table is generated
from them (``python -m launcher.settings_doc --write``). The table must be what the classes render
now, and no document or deployment file may name an ``EPD_*`` variable that no class reads.
"""

from __future__ import annotations

import re
from pathlib import Path

from launcher.settings_doc import DOC, NOT_SETTINGS, render, rewrite, variables

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", DOC, ROOT / "cache" / "README.md", ROOT / "bench" / "README.md",
             ROOT / "docker-compose.yml", ROOT / "docker-compose.cpu.yml", ROOT / "Dockerfile",
             *sorted((ROOT / "deploy").rglob("*.yaml"))]


def test_the_committed_settings_table_is_what_the_classes_render():
    doc = DOC.read_text()
    assert render() in doc, "docs/deploy.md's settings table is stale: run python -m launcher.settings_doc --write"
    assert rewrite(doc) == doc


def test_every_variable_a_document_names_is_a_setting():
    known = set(variables()) | NOT_SETTINGS
    unknown = {}
    for path in DOCUMENTS:
        for name in set(re.findall(r"\bEPD_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())):
            if name not in known:
                unknown.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not unknown, f"documented but read by no settings class: {unknown}"


def test_a_new_setting_without_a_description_cannot_be_rendered():
    from pydantic import Field
    from pydantic_settings import BaseSettings, SettingsConfigDict

    import launcher.settings_doc as doc

    class Undocumented(BaseSettings):
        model_config = SettingsConfigDict(env_prefix="EPD_")
        shiny_new_knob: int = Field(default=1)

    saved = doc.SOURCES
    doc.SOURCES = [*saved, ("test", Undocumented)]
    try:
        try:
            doc.variables()
        except ValueError as exc:
            assert "shiny_new_knob" in str(exc)
        else:
            raise AssertionError("an undocumented setting was rendered")
    finally:
        doc.SOURCES = saved


def test_an_unknown_or_renamed_variable_is_named_at_start(tmp_path):
    """The settings classes ignore variables they do not define; a typo or an old name must not
    pass silently (an upgrade that renamed a limit would otherwise fall back to its default)."""
    import subprocess
    import sys

    from launcher.settings_doc import unknown_variables

    lines = unknown_variables({"EPD_MAX_IMAGES_PER_REQUEST": "3", "EPD_KV_MEMORY_MB": "64", "PATH": "/bin"})
    assert lines == ["EPD_MAX_IMAGES_PER_REQUEST is not a setting of any epd process and is ignored; "
                     "it is now EPD_LIMIT_IMAGES_PER_REQUEST"]
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "gateway", "--model", str(tmp_path / "none")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "EPD_KV_MEMROY_MB": "64"})
    assert "epd gateway: warning: EPD_KV_MEMROY_MB is not a setting of any epd process" in done.stderr
