"""drkernel.jsonl: the one reader of the row files, and the values it hands on."""

import json
import os

from drkernel.jsonl import JsonlWriter, finite, iter_jsonl, read_jsonl


def test_every_bad_line_is_skipped_and_named_and_the_next_one_read(tmp_path):
    path = tmp_path / "rows.jsonl"
    good = json.dumps({"sample": 1})
    bad = [b'{"sample": ' + b"9" * 5000 + b"}",  # past Python's int-string conversion limit
           b"[" * 100000 + b"]" * 100000, b"\xff{}", b"{cut", b"[1, 2]"]
    path.write_bytes(b"\n".join([*bad, good.encode()]) + b"\n")
    assert [(line.lineno, line.row, line.error) for line in iter_jsonl(path)] == [
        (1, None, "not a JSON object (an integer with too many digits)"),
        (2, None, "not a JSON object (nested too deeply)"),
        (3, None, "not UTF-8 text (byte 1)"),
        (4, None, "not a JSON object (Expecting property name enclosed in double quotes: column 2)"),
        (5, None, "not a JSON object"),
        (6, {"sample": 1}, "")]
    assert read_jsonl(path) == ([{"sample": 1}], 5)


def test_finite_is_none_for_what_no_float_holds():
    assert [finite(x) for x in (2, "1.5", 10 ** 400, float("inf"), float("nan"), "x", True, None, [1])] == [
        2.0, 1.5, None, None, None, None, None, None, None]


def test_a_writer_to_a_file_that_cannot_be_synced_writes_on(tmp_path):
    """/dev/null and pipes refuse fsync (EINVAL): `--output /dev/null` is no crash."""
    with JsonlWriter(os.devnull) as writer:
        writer.write({"sample": 1})
    read, write = os.pipe()
    with JsonlWriter(f"/proc/self/fd/{write}") as writer:
        writer.write({"sample": 2})
    os.close(write)
    with os.fdopen(read) as pipe:
        assert pipe.read() == '{"sample": 2}\n'
