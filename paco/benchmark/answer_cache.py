"""The evaluator's answer cache: answers are cached by (evaluator, question, image bytes), and the
stage resumes like ``labels``: a rerun does not ask again.

One JSON line per answer in ``<directory>/answers-<part>.jsonl``; every ``*.jsonl`` file of the
directory is read on start, so processes of a sharded stage each append to their own part and all
of them see every part on the next start. A line is written with one ``os.write`` on a file
opened ``O_APPEND``, right after its answer arrived: a killed run loses only the answers in
flight, and a rerun finds the rest (the resume of ``labels`` / ``reasons``, per answer instead of
per chunk). An answer that failed is never written.

A line is ``{"key": sha256 hex, "request": {...}, "answer": {...}}``: ``request`` holds what the
answer depends on (:func:`request_key` hashes it; see
:meth:`paco.benchmark.evaluator.Evaluator` for its fields: the evaluator's name and model, the
request kind, the exact text, the SHA-256 of each image's bytes as sent, max_tokens,
top_logprobs, the layout and the attempt), ``answer`` what the server said (the raw reply text,
or the first token's top log-probs), from which every score is recomputed on a hit.

What cannot be used is dropped with a warning naming the file and line, and asked again, never
turned into an answer: a line that is not JSON, lacks a field, or whose key is not the hash of its
request, and a last line without its newline (a write cut by a kill; in this process's own part
file it is cut off the file before appending). Of two lines with one key (two processes asked at
once) the first read wins.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

from paco.core.io import ArtifactError, atomic_write_bytes

__all__ = ["AnswerCache", "AnswerCacheError", "compact_answers", "request_key"]

log = logging.getLogger("paco.benchmark.answer_cache")

_PART = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class AnswerCacheError(ArtifactError):
    """The answer cache's directory or file cannot be used (not a directory, not writable, a bad
    part name)."""


def request_key(request: dict[str, Any]) -> str:
    """The cache key of a request: SHA-256 (hex, 64 characters) of its canonical JSON (sorted
    keys, no spaces, UTF-8, non-ASCII kept).

    Raises:
        TypeError: a value JSON cannot encode.
        ValueError: a float that is not finite.
    """
    text = json.dumps(request, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class AnswerCache:
    """Answers by request key, loaded from ``directory`` and appended to it as they arrive.

    Args:
        directory: created if missing; every ``*.jsonl`` in it is read. ``None``: answers are
            kept in memory only (nothing persists).
        part: this writer's file is ``answers-<part>.jsonl`` (letters, digits, ``_.-``; give each
            process of a sharded stage its own, e.g. its rank). Several caches of one process may
            share a part: each line is one ``O_APPEND`` write.
        fsync: ``os.fsync`` after each line (a kill loses nothing written without it; a power
            cut may).

    Attributes:
        discarded: ``[{"where": "file:line", "reason": str}]`` of the lines dropped on loading.
        written: lines this instance appended.

    Raises:
        AnswerCacheError: ``directory`` exists and is not a directory, cannot be created or read,
            or ``part`` is not a plain name.
    """

    def __init__(self, directory: str | Path | None, *, part: str = "0", fsync: bool = False):
        if not isinstance(part, str) or not _PART.fullmatch(part):
            raise AnswerCacheError(f"answer cache part {part!r} must be 1-64 letters, digits, '_', '.' or '-'")
        self.fsync = bool(fsync)
        self.discarded: list[dict[str, str]] = []
        self.written = 0
        self._answers: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self.directory: Path | None = None
        self.path: Path | None = None
        if directory is None:
            return
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise AnswerCacheError(f"answer cache {self.directory} exists and is not a directory")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise AnswerCacheError(f"cannot create the answer cache directory {self.directory}: {exc}") from None
        self.path = self.directory / f"answers-{part}.jsonl"
        self._cut_torn_tail()
        for path in sorted(self.directory.glob("*.jsonl")):
            self._load(path)

    def __len__(self) -> int:
        return len(self._answers)

    def __contains__(self, key: object) -> bool:
        return key in self._answers

    def __repr__(self) -> str:
        where = "in memory" if self.directory is None else repr(str(self.directory))
        return f"AnswerCache({where}, {len(self)} answers)"

    def _drop(self, where: str, reason: str) -> None:
        log.warning("answer cache: dropping %s (%s); it will be asked again", where, reason)
        self.discarded.append({"where": where, "reason": reason})

    def _cut_torn_tail(self) -> None:
        """Cut this part's last line if a kill left it without its newline (so the next append
        starts a line of its own)."""
        if not self.path.is_file():
            return
        try:
            with open(self.path, "r+b") as fh:
                data = fh.read()
                if data and not data.endswith(b"\n"):
                    keep, line = data.rfind(b"\n") + 1, data.count(b"\n") + 1
                    self._drop(f"{self.path}:{line}",
                               f"a last line of {len(data) - keep} bytes without its newline (a cut write)")
                    fh.truncate(keep)
        except OSError as exc:
            raise AnswerCacheError(f"cannot repair the answer cache file {self.path}: {exc}") from None

    def _load(self, path: Path) -> None:
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise AnswerCacheError(f"cannot read the answer cache file {path}: {exc}") from None
        lines = data.split(b"\n")
        if lines[-1]:
            self._drop(f"{path}:{len(lines)}", "a last line without its newline (a cut write)")
        for n, raw in enumerate(lines[:-1], start=1):
            if not raw.strip():
                continue
            record, problem = _parse_line(raw)
            if problem is not None:
                self._drop(f"{path}:{n}", problem)
            elif record["key"] not in self._answers:
                self._answers[record["key"]] = record

    def get(self, key: str) -> dict[str, Any] | None:
        """The stored ``{"key", "request", "answer"}`` record of ``key``, or ``None``."""
        with self._lock:
            return self._answers.get(key)

    def put(self, request: dict[str, Any], answer: dict[str, Any]) -> str:
        """Store ``answer`` for ``request`` (both JSON-encodable) in memory and append its line;
        returns the key. A key already held is kept as it is (nothing is written).

        Raises:
            AnswerCacheError: the line cannot be written.
            TypeError, ValueError: see :func:`request_key` (also for ``answer``).
        """
        key = request_key(request)
        record = {"key": key, "request": request, "answer": answer}
        line = (json.dumps(record, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")
        with self._lock:
            if key in self._answers:
                return key
            if self.path is not None:
                self._append(line)
            self._answers[key] = record
            self.written += 1
        return key

    def _append(self, line: bytes) -> None:
        """One ``O_APPEND`` write of ``line`` to this part's file (the caller holds the lock)."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                written = os.write(fd, line)
                if written != len(line):
                    raise OSError(f"short write: {written} of {len(line)} bytes")
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise AnswerCacheError(f"cannot append to the answer cache file {self.path}: {exc}") from None


def compact_answers(directory: str | Path) -> int:
    """Rewrite every ``*.jsonl`` part of ``directory`` with its usable lines sorted by key, each key
    once (the first read wins, as on load): the folder's bytes then depend only on which answers it
    holds, not on the order the threads received them (a stage's persisted output, compared bit for
    bit across runs). Each file is replaced atomically (:func:`paco.core.io.atomic_write_bytes`: a
    temporary ``.<name>.*.tmp`` sibling, removed on failure, then ``os.replace``);
    unusable lines are dropped with the warning :class:`AnswerCache` gives. Returns the number of
    lines kept.

    Raises:
        AnswerCacheError: a part cannot be read or rewritten.
    """
    seen: set[str] = set()
    kept = 0
    for path in sorted(Path(directory).glob("*.jsonl")):
        cache = AnswerCache(None)
        cache._load(path)
        records = {k: r for k, r in cache._answers.items() if k not in seen}
        seen.update(records)
        body = b"".join((json.dumps(records[k], sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n")
                        .encode("utf-8") for k in sorted(records))
        try:
            atomic_write_bytes(path, body)
        except OSError as exc:
            raise AnswerCacheError(f"cannot rewrite the answer cache file {path}: {exc}") from None
        kept += len(records)
    return kept


def _parse_line(raw: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """``(record, None)`` for a usable line, ``(None, why not)`` otherwise."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        return None, f"not a JSON line: {exc}"
    if not isinstance(record, dict) or not isinstance(record.get("request"), dict) \
            or not isinstance(record.get("answer"), dict) or not isinstance(record.get("key"), str):
        return None, "not an object with key (str), request (object) and answer (object)"
    try:
        expected = request_key(record["request"])
    except (TypeError, ValueError) as exc:
        return None, f"its request cannot be hashed: {exc}"
    if record["key"] != expected:
        return None, f"its key {record['key'][:12]}... is not the hash of its request ({expected[:12]}...)"
    return record, None
