"""Files of `specmoe batch`: the input rows, the resume journal, the final output.

Formats by extension: `.jsonl` (one JSON object per line) or `.parquet` (needs pyarrow). An input row is
an object with `prompt` (text, or a list of token ids) or `token_ids`, optional sampling fields
(predictor.SAMPLING_FIELDS) and an optional `id`, which the output keeps; other fields are ignored.
The row's position (blank JSONL lines do not count) is its `index`.

While a run goes, finished rows are appended to the journal `OUTPUT.partial` (JSONL, flushed and
fsynced per batch, first line a header naming the input's sha256 and the settings that decide the
output). At the end OUTPUT is written in input order (a temporary file renamed over it) and the
journal removed. A rerun takes finished rows from the journal and from an existing OUTPUT (a cut
last line is skipped), so a killed or interrupted run resumes without redoing them; error rows are
redone (they are cheap, and the cause may have been transient)."""
from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from specmoe.errors import InputError
from specmoe.integrations import require
from specmoe.integrations.predictor import OUTPUT_FIELDS, SAMPLING_FIELDS

FORMATS = {".jsonl": "jsonl", ".parquet": "parquet"}
REQUEST_FIELDS = ("prompt", "token_ids", *SAMPLING_FIELDS)
JOURNAL_VERSION = 1


def file_format(path: Path, what: str) -> str:
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise InputError(f"{what} {path}: the format is chosen by extension; use .jsonl or .parquet")
    return fmt


def _pq():
    return require("pyarrow.parquet", "ray", "reading and writing Parquet")


@dataclass
class Inputs:
    """One entry per input row: the request as JSON text (None if the row is unreadable), why it is
    unreadable, its `id` and its text prompt (kept in the output), and the input file's sha256."""
    requests: list[str | None]
    bad: list[str | None]
    ids: list
    prompts: list[str | None]
    sha256: str
    has_ids: bool

    def __len__(self) -> int:
        return len(self.requests)

    def work_row(self, i: int) -> dict:
        return {"index": i, "request": self.requests[i], "bad": self.bad[i]}

    def complete(self, row: dict) -> dict:
        """A predictor output row with the input row's id and prompt, fields in the output order."""
        i = row["index"]
        head = {"index": i, **({"id": self.ids[i]} if self.has_ids else {}), "prompt": self.prompts[i]}
        return {**head, **{k: row[k] for k in OUTPUT_FIELDS if k != "index"}}


def _records(path: Path, fmt: str):
    """(record dict or None, why not) per input row."""
    if fmt == "parquet":
        try:
            table = _pq().read_table(path)
        except OSError as e:
            raise InputError(f"cannot read input file {path} as Parquet: {e}") from None
        return [(r, None) for r in table.to_pylist()]
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise InputError(f"cannot read input file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise InputError(f"input file {path} is not UTF-8 text (invalid byte at offset {e.start})") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            out.append((None, f"{path.name}:{n}: the line is not valid JSON"))
            continue
        out.append((rec, None) if isinstance(rec, dict) else
                   (None, f"{path.name}:{n}: expected a JSON object with a 'prompt', got {type(rec).__name__}"))
    return out


def read_input(path: Path) -> Inputs:
    if not path.is_file():
        raise InputError(f"input file not found: {path}")
    fmt = file_format(path, "input file")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    requests, bad, ids, prompts = [], [], [], []
    for rec, why in _records(path, fmt):
        rec = rec or {}
        req = None
        if why is None:
            try:
                req = json.dumps({k: rec[k] for k in REQUEST_FIELDS if k in rec}, allow_nan=False)
            except (TypeError, ValueError) as e:
                why = f"the row has a value JSON cannot hold: {e}"
        requests.append(req)
        bad.append(why)
        ids.append(rec.get("id"))
        prompts.append(rec["prompt"] if isinstance(rec.get("prompt"), str) else None)
    if not requests:
        raise InputError(f"input file {path} has no rows")
    return Inputs(requests, bad, ids, prompts, h.hexdigest(), has_ids=any(i is not None for i in ids))


# ---------------------------------------------------------------- resume
def journal_path(output: Path) -> Path:
    return output.with_name(output.name + ".partial")


def _jsonl_rows(path: Path):
    """Parsed JSON objects of a JSONL file; a line that does not parse (a cut last line) is skipped."""
    with open(path, "rb") as f:
        for raw in f:
            try:
                row = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                continue
            if isinstance(row, dict):
                yield row


def _finished(row: dict, inputs: Inputs, source: Path) -> int | None:
    """The row's index if it is a finished row of this input; InputError if it belongs to another input."""
    i = row.get("index")
    if type(i) is not int or not 0 <= i < len(inputs) or row.get("error") is not None \
            or not isinstance(row.get("token_ids"), list):
        return None
    if normalize(row.get("id")) != normalize(inputs.ids[i]) or row.get("prompt") != inputs.prompts[i]:
        raise InputError(f"{source}: its row {i} does not match input row {i} (id or prompt differ); it was "
                         "written for another input: delete it or choose another output path")
    return i


def normalize(v):
    """A value as it reads back from the JSONL journal (ids of any Parquet type compare equal)."""
    return json.loads(json.dumps(v, default=str))


def load_finished(inputs: Inputs, output: Path, settings: dict) -> dict[int, dict]:
    """Finished rows by index, from the journal (whose header must match) and an existing OUTPUT."""
    done: dict[int, dict] = {}
    jp = journal_path(output)
    if jp.is_file():
        rows = _jsonl_rows(jp)
        head = next(rows, {})
        want = {"input_sha256": inputs.sha256, "settings": settings}
        got = {k: head.get(k) for k in want}
        if head.get("specmoe_batch_journal") != JOURNAL_VERSION or got != json.loads(json.dumps(want)):
            diff = [k for k in want["settings"] if (got["settings"] or {}).get(k) != want["settings"][k]]
            what = "another input file" if got["input_sha256"] != inputs.sha256 else \
                f"other settings ({', '.join(diff) or 'format'})"
            raise InputError(f"{jp} holds a partial run over {what}; rerun with the same input and settings, "
                             "or delete it to start over")
        for row in rows:
            i = _finished(row, inputs, jp)
            if i is not None:
                done.setdefault(i, row)
    if output.is_file():
        if file_format(output, "output file") == "jsonl":
            rows = list(_jsonl_rows(output))
        else:
            try:
                rows = _pq().read_table(output).to_pylist()
            except OSError as e:  # e.g. a cut file: its rows are redone
                print(f"specmoe: {output} is not readable Parquet ({e}); its rows are redone", file=sys.stderr)
                rows = []
        if any(type(row.get("index")) is not int for row in rows):
            raise InputError(f"output file {output} exists and is not the output of `specmoe batch` (a row without "
                             "an 'index'); delete it or choose another path")
        for row in rows:
            i = _finished(row, inputs, output)
            if i is not None:
                done.setdefault(i, row)
    return done


class Journal:
    """Append-only JSONL of finished rows next to OUTPUT. Opening rewrites it with the rows kept so far
    (dropping a cut last line, so appends never glue onto a partial line)."""

    def __init__(self, output: Path, inputs: Inputs, settings: dict, rows):
        self.path = journal_path(output)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        head = {"specmoe_batch_journal": JOURNAL_VERSION, "input_sha256": inputs.sha256, "settings": settings}
        with open(tmp, "w", encoding="utf-8") as f:
            for row in [head, *rows]:
                f.write(_line(row))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self.f = open(self.path, "a", encoding="utf-8")

    def append(self, rows: list[dict]) -> None:
        self.f.write("".join(_line(r) for r in rows))
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self, remove: bool = False) -> None:
        self.f.close()
        if remove:
            self.path.unlink(missing_ok=True)


def _line(row: dict) -> str:
    return json.dumps(row, ensure_ascii=False, default=str) + "\n"


def write_output(path: Path, rows: list[dict]) -> None:
    """All rows, in the order given, written to a temporary file and renamed over `path`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if file_format(path, "output file") == "jsonl":
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(_line(r) for r in rows)
        else:
            import pyarrow as pa
            try:
                table = pa.Table.from_pylist(rows)
            except (pa.ArrowInvalid, pa.ArrowTypeError):  # ids of mixed types: keep them as text
                table = pa.Table.from_pylist([{**r, "id": None if r.get("id") is None else str(r["id"])}
                                              for r in rows])
            _pq().write_table(table, tmp)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise InputError(f"cannot write output file {path}: {e.strerror or e}") from None
