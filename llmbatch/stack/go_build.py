"""Go programs of this repository (``deploy/tools/*``: a go.mod and go.sum pinning what they build),
built once with the machine's Go and cached under ``$LLMBATCH_CACHE/bin``."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from llmbatch.stack.process import StackError
from llmbatch.stack.state import CACHE_DIR


def binary_name(module: Path, package: str) -> str:
    """What ``go build -o DIR/`` names a package's binary: its last path element, a major-version
    suffix (``/v3``) skipped; ``.`` is the module's own folder."""
    if package == ".":
        return module.name
    parts = package.split("/")
    return parts[-2] if re.fullmatch(r"v\d+", parts[-1]) else parts[-1]


def source_digest(module: Path, flags: Sequence[str] = ()) -> str:
    """Key of a build: go.mod, go.sum and the module's own .go files (and the build ``flags``, when
    there are any: a module built with others is another build)."""
    digest = hashlib.sha256()
    for path in [module / "go.mod", module / "go.sum", *sorted(module.glob("*.go"))]:
        digest.update(path.read_bytes())
    if flags:
        digest.update("\0".join(flags).encode())
    return digest.hexdigest()[:12]


def go_binaries(
    module: Path, packages: Sequence[str], *, cgo: bool = False, tags: Sequence[str] = ()
) -> dict[str, Path]:
    """Build ``packages`` of the Go module in folder ``module`` once (``-mod=readonly``: its go.sum
    decides every version) and return package -> binary. Older builds of the module are removed.
    Static (``CGO_ENABLED=0``) unless ``cgo`` (a program that links a C library, as runc's seccomp
    does); ``tags``: Go build tags."""
    flags = [*(["cgo"] if cgo else []), *([f"tags={','.join(tags)}"] if tags else [])]
    target = CACHE_DIR / "bin" / f"{module.name}-{source_digest(module, flags)}"
    binaries = {p: target / binary_name(module, p) for p in packages}
    if all(b.exists() for b in binaries.values()):
        return binaries
    go = shutil.which("go")
    if go is None:
        raise StackError(f"`go` is not on PATH: building {module.name} needs it")
    print(f"[setup] building {module.name} with Go (first time only; minutes)", file=sys.stderr, flush=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    env = {
        **os.environ,
        "GOTOOLCHAIN": "local",
        "GOFLAGS": "-mod=readonly -buildvcs=false",
        "CGO_ENABLED": "1" if cgo else "0",
    }
    tag_args = ["-tags", ",".join(tags)] if tags else []
    proc = subprocess.run(
        [go, "build", "-trimpath", *tag_args, "-o", f"{tmp}/", *packages],
        cwd=module,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise StackError(f"building {module.name} failed", f"{proc.stdout}{proc.stderr}"[-4000:])
    _remove(target)  # a half-made build, or the single-file layout of an earlier version of this code
    tmp.rename(target)
    for old in target.parent.glob(f"{module.name}-*"):  # keep only the current build
        if old != target:
            _remove(old)
    return binaries


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
