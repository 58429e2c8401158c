"""Splitting a JSONL byte stream into lines in bounded memory.

Input files come from upstream services and may be hostile or broken: 2 GB without a newline, one
line with a 300 MB prompt. :func:`split_lines` holds at most ``max_line_bytes + 1`` bytes of a line:
a longer line is yielded cut to that length (the caller sees it is too long by its length alone and
answers it with a ``line_too_large`` error, see :func:`llmbatch.schemas.input_lines.parse_input_line`) and
the rest
of it is skipped up to the next newline. Work is linear in the input (no ``tail + chunk`` copies).
:func:`count_lines` counts non-blank lines holding no line at all.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

DEFAULT_MAX_LINE_BYTES = 8 << 20
"""Longest input line (bytes) answered as a request; longer ones become ``line_too_large`` errors."""


def split_lines(chunks: Iterable[bytes], max_line_bytes: int | None = None) -> Iterator[bytes]:
    """The lines of a byte stream given in arbitrary chunks, without their ``\\n`` (the last line may
    lack one). A line over ``max_line_bytes`` is yielded cut to ``max_line_bytes + 1`` bytes."""
    limit = max_line_bytes if max_line_bytes is not None else -1
    pieces: list[bytes] = []  # the open line, at most limit + 1 bytes of it
    size = 0
    for chunk in chunks:
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            piece = chunk[start:] if end < 0 else chunk[start:end]
            if limit < 0 or size <= limit:
                if limit >= 0 and size + len(piece) > limit + 1:
                    piece = piece[: limit + 1 - size]
                pieces.append(piece)
                size += len(piece)
            if end < 0:
                break
            yield pieces[0] if len(pieces) == 1 else b"".join(pieces)
            pieces, size = [], 0
            start = end + 1
    if size:
        yield b"".join(pieces)


def count_lines(chunks: Iterable[bytes]) -> int:
    """Non-blank lines of a byte stream in arbitrary chunks (what :func:`split_lines` yields that is
    not blank), in constant memory."""
    count = 0
    open_line_has_text = False
    for chunk in chunks:
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            piece = chunk[start:] if end < 0 else chunk[start:end]
            if not open_line_has_text and piece and not piece.isspace():
                open_line_has_text = True
            if end < 0:
                break
            count += open_line_has_text
            open_line_has_text = False
            start = end + 1
    return count + open_line_has_text
