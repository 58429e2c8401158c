"""llmbatch/stack/go_build.py: repository Go programs built once, keyed by their sources, cached."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from llmbatch.stack import go_build
from llmbatch.stack.process import StackError

pytestmark = pytest.mark.unit


def _module(folder: Path, main: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "go.mod").write_text("module example.com/hello\n\ngo 1.22\n")
    (folder / "go.sum").write_text("")
    (folder / "main.go").write_text(main)
    return folder


HELLO = 'package main\n\nimport "fmt"\n\nfunc main() { fmt.Println("hello") }\n'


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(go_build, "CACHE_DIR", tmp_path / "cache")
    return tmp_path / "cache"


def test_binary_names_are_gos() -> None:
    module = Path("/x/deploycheck")
    assert go_build.binary_name(module, "k8s.io/kubernetes/cmd/kube-apiserver") == "kube-apiserver"
    assert go_build.binary_name(module, "go.etcd.io/etcd/server/v3") == "server"
    assert go_build.binary_name(module, ".") == "deploycheck"


def test_the_key_follows_go_mod_go_sum_and_go_files_only(tmp_path: Path) -> None:
    module = _module(tmp_path / "hello", HELLO)
    first = go_build.source_digest(module)
    (module / "README.md").write_text("not a source")
    assert go_build.source_digest(module) == first
    (module / "main.go").write_text(HELLO.replace("hello", "hi"))
    assert go_build.source_digest(module) != first
    second = go_build.source_digest(module)
    (module / "go.sum").write_text("example.org/x v1.0.0 h1:abc=\n")
    assert go_build.source_digest(module) != second


def test_builds_once_then_serves_the_cache_and_drops_older_builds(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = _module(tmp_path / "hello", HELLO)
    older_dir, older_file = cache / "bin" / "hello-000000000000", cache / "bin" / "hello-111111111111"
    older_dir.mkdir(parents=True)
    older_file.write_text("an earlier single-file build")
    same_key = cache / "bin" / f"hello-{go_build.source_digest(module)}"
    same_key.write_text("the single-file layout of this very build")
    binary = go_build.go_binaries(module, ["."])["."]
    assert subprocess.run([binary], capture_output=True, text=True, check=True).stdout == "hello\n"
    assert sorted(p.name for p in (cache / "bin").iterdir()) == [binary.parent.name]
    monkeypatch.setenv("PATH", "")  # no Go now: only the cache can answer
    assert go_build.go_binaries(module, ["."])["."] == binary


def test_a_failed_build_names_the_module_and_keeps_nothing(tmp_path: Path, cache: Path) -> None:
    module = _module(tmp_path / "broken", "package main\n\nfunc main() { undefined() }\n")
    with pytest.raises(StackError, match="building broken failed") as failure:
        go_build.go_binaries(module, ["."])
    assert "undefined" in failure.value.log_tail
    assert not list((cache / "bin").iterdir())


TAGGED = '//go:build special\n\npackage main\n\nimport "fmt"\n\nfunc main() { fmt.Println("tagged") }\n'
UNTAGGED = '//go:build !special\n\npackage main\n\nimport "fmt"\n\nfunc main() { fmt.Println("plain") }\n'


def test_build_tags_and_cgo_are_part_of_the_build_and_of_its_key(tmp_path: Path, cache: Path) -> None:
    module = _module(tmp_path / "hello", TAGGED)
    (module / "plain.go").write_text(UNTAGGED)
    plain = go_build.go_binaries(module, ["."])["."]
    assert subprocess.run([plain], capture_output=True, text=True, check=True).stdout == "plain\n"
    tagged = go_build.go_binaries(module, ["."], tags=["special"])["."]
    assert subprocess.run([tagged], capture_output=True, text=True, check=True).stdout == "tagged\n"
    assert tagged.parent != plain.parent
    assert go_build.source_digest(module, ["cgo"]) != go_build.source_digest(module)
    assert go_build.source_digest(module, []) == go_build.source_digest(module)  # the old keys hold
