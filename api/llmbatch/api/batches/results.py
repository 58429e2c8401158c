"""A batch's result files: ``output_file_id`` / ``error_file_id`` -> its shards, streamed as one file.

The Ray job writes a batch's results as shards (``output-a1-00000.jsonl``, ``error-a2-00003.jsonl``,
... under ``s3://<results bucket>/<tenant>/<batch_id>/<lifecycle>/``) plus ``manifest.json``. OpenAI
has one output file and one error file per batch: the API shows each as one logical file whose
content is its shards concatenated in the manifest's order (every shard ends with a newline; one that
did not would get one, so lines never merge), streamed chunk by chunk.

Where the shard list comes from: the dispatcher's record in Redis (the terminal outcome's
``output_uris`` / ``error_uris``, what the terminal event carried), else, once Redis forgot the
batch, its manifest (:func:`find_manifest`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Literal

from llmbatch.adapters.storage import split_uri
from llmbatch.api.store.storage import ObjectMissing, ObjectStore
from llmbatch.schemas import SchemaError, output_prefix, parse_manifest
from llmbatch.schemas.job import MANIFEST_NAME, Manifest

Kind = Literal["output", "error"]


@dataclass(frozen=True, slots=True)
class ResultFile:
    """One logical result file: its shards in order and their total size."""

    batch_id: str
    kind: Kind
    uris: tuple[str, ...]
    size: int
    created_at: float
    expires_at: float | None = None


async def find_manifest(
    objects: ObjectStore, results_bucket: str, tenant: str, batch_id: str
) -> Manifest | None:
    """The batch's manifest (its newest lifecycle's, by key order), or ``None`` when there is none."""
    folder = output_prefix(results_bucket, tenant, batch_id)
    _, prefix = split_uri(folder)
    keys = await objects.list_keys(results_bucket, prefix, limit=10_000)
    found = [k for k in keys if k.endswith("/" + MANIFEST_NAME) and k[len(prefix) :].count("/") <= 1]
    if not found:
        return None
    try:
        return parse_manifest(await objects.get(results_bucket, max(found)))
    except (ObjectMissing, SchemaError):
        return None


def lifecycles(uris: Sequence[str]) -> list[str]:
    """The lifecycles (``<tenant>/<batch_id>/<lifecycle>/<shard>``) the shards ``uris`` are in, ``''``
    for shards of a batch of before lifecycles; in order, each once."""
    found: list[str] = []
    for uri in uris:
        parts = split_uri(uri)[1].split("/")
        lifecycle = parts[2] if len(parts) == 4 else ""
        if lifecycle not in found:
            found.append(lifecycle)
    return found


def shard_uris(kind: Kind, *, job_uris: Sequence[str] | None, manifest: Manifest | None) -> tuple[str, ...]:
    """The shards of one result file: the dispatcher's list, else the manifest's."""
    if job_uris:
        return tuple(job_uris)
    if manifest is not None:
        return tuple(manifest.output_uris if kind == "output" else manifest.error_uris)
    return ()


async def describe(
    objects: ObjectStore, batch_id: str, kind: Kind, uris: Sequence[str], created_at: float
) -> ResultFile:
    """The :class:`ResultFile` of ``uris`` (their sizes summed). Raises :class:`ObjectMissing`."""
    size = 0
    for uri in uris:
        size += await objects.size(*split_uri(uri))
    return ResultFile(batch_id, kind, tuple(uris), size, created_at)


async def concatenate(objects: ObjectStore, uris: Sequence[str]) -> AsyncIterator[bytes]:
    """The shards' bytes one after another, a newline added after a shard that lacks its last one.
    Holds one chunk at a time."""
    for uri in uris:
        last = b"\n"
        async for chunk in objects.stream(*split_uri(uri)):
            if chunk:
                last = chunk[-1:]
                yield chunk
        if last != b"\n":
            yield b"\n"
