"""Loading KernelBench: a path or split that cannot be read is a TaskError naming it, and every
script, bench scripts included, turns it into one line and exit status 2."""

import subprocess
import sys
from pathlib import Path

import pytest

from drkernel.tasks import BUNDLED_DIR, TaskError, _read_local_split, load_kernelbench

ROOT = Path(__file__).resolve().parent.parent


def test_a_path_without_kernelbench_is_a_task_error(tmp_path):
    with pytest.raises(TaskError, match=f"cannot load KernelBench level_1 from '{tmp_path / 'none'}'"):
        load_kernelbench(str(tmp_path / "none"), 1)


def test_a_cut_line_of_a_local_split_is_named(tmp_path):
    """The reader used where `datasets` is missing (the GPU image)."""
    split = tmp_path / "data" / "level_1-00000.jsonl"
    split.parent.mkdir()
    split.write_text('{"code": "x", "level": 1, "problem_id": 1}\n{"code": "y", "lev\n')
    with pytest.raises(TaskError, match=r"level_1-00000.jsonl:2: not a JSON object"):
        _read_local_split(str(tmp_path), 1)


def test_a_cut_line_read_through_datasets_is_named(tmp_path):
    pytest.importorskip("datasets")
    split = tmp_path / "data" / "level_1-00000.jsonl"
    split.parent.mkdir()
    split.write_text('{"code": "x", "level": 1, "problem_id": 1}\n{"code": "y", "lev\n')
    with pytest.raises(TaskError, match=r"from '.*': .*level_1-00000.jsonl:2: not a JSON object"):
        load_kernelbench(str(tmp_path), 1)


def test_a_bench_script_with_a_bad_kernelbench_path_exits_2_with_one_line(tmp_path):
    out = subprocess.run([sys.executable, "bench/ref_self.py", "--kernelbench", str(tmp_path / "none"),
                          "--out", str(tmp_path / "r.json")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"ref_self.py: error: cannot load KernelBench level_1 from '{tmp_path / 'none'}': "), lines


def test_rows_with_a_non_integer_level_or_a_repeated_problem_are_refused():
    from drkernel.tasks import rows_to_tasks
    code = (Path(__file__).resolve().parent.parent / "drkernel" / "data" / "tasks" / "1_ReLU.py").read_text()
    good = {"code": code, "level": 1, "problem_id": 1, "name": "1_ReLU.py"}
    assert [t.problem_id for t in rows_to_tasks([good, {**good, "problem_id": "2"}])] == [1, 2]
    for rows, words in (([{**good, "level": "x"}], "level must be an integer"),
                        ([good, {**good, "name": "other.py"}], "appears twice"),
                        ([{**good, "code": 5}], "its code is a int, not text")):
        with pytest.raises(TaskError, match=words):
            rows_to_tasks(rows, "t")


@pytest.mark.parametrize("tasks", ["bundled", str(BUNDLED_DIR), str(BUNDLED_DIR / "1_ReLU.py")])
def test_levels_without_a_dataset_are_refused_not_ignored(tasks):
    """--levels selects a KernelBench dataset's splits; given with tasks that have none it is an
    error naming the option, not silently dropped."""
    from drkernel.config import ConfigError, TaskSelection

    assert TaskSelection(tasks=tasks).selected_tasks()
    with pytest.raises(ConfigError, match="--levels 2"):
        TaskSelection(tasks=tasks, levels="2").selected_tasks()


def test_a_task_file_that_is_not_utf8_is_a_task_error(tmp_path):
    from drkernel.tasks import load_task_file
    bad = tmp_path / "1_Bad.py"
    bad.write_bytes(b"\xff\xfeclass Model: pass\n")
    with pytest.raises(TaskError, match="not UTF-8 text"):
        load_task_file(bad)


def test_files_that_start_with_a_byte_order_mark_read_as_python_reads_them(tmp_path):
    """Editors on Windows write a BOM; Python runs such a file, so the task and the candidate load."""
    from drkernel.evaluator import _source
    from drkernel.tasks import load_task_file
    task = tmp_path / "1_ReLU.py"
    task.write_bytes(b"\xef\xbb\xbf" + (BUNDLED_DIR / "1_ReLU.py").read_bytes())
    assert load_task_file(task).code == (BUNDLED_DIR / "1_ReLU.py").read_text()
    assert _source(str(task))[0] == _source(task.read_bytes())[0] == (BUNDLED_DIR / "1_ReLU.py").read_text()


@pytest.mark.parametrize("text, words", [("x = 1\0\n", "(ValueError: )?source code string cannot contain null bytes"), ("x = " + "-" * 5000 + "1\n", "RecursionError"),
                                         ("x = " + "-" * 100000 + "1\n", "MemoryError")])
def test_task_code_python_cannot_parse_is_a_task_error(text, words):
    """A NUL byte, or nesting too deep for Python's parser, is the task's error, named."""
    from drkernel.tasks import validate_code
    with pytest.raises(TaskError, match=f"broken.py: not valid Python \\({words}"):
        validate_code(text, "broken.py")


def _folder_with_a_repeated_id(tmp_path) -> Path:
    """A task folder where 1_ReLU.py and 1_ReLUdup.py are both problem 1, beside problem 2."""
    folder = tmp_path / "tasks"
    folder.mkdir()
    for name, source in (("1_ReLU.py", "1_ReLU.py"), ("1_ReLUdup.py", "1_ReLU.py"), ("2_Other.py", "1_ReLU.py")):
        (folder / name).write_text((BUNDLED_DIR / source).read_text())
    return folder


def test_a_folder_with_two_files_of_one_problem_id_is_refused_naming_both(tmp_path):
    """Results are keyed by (level, problem id): one of the two files would silently vanish."""
    from drkernel.tasks import load_tasks

    folder = _folder_with_a_repeated_id(tmp_path)
    with pytest.raises(TaskError) as exc:
        load_tasks(str(folder))
    assert str(exc.value).startswith(f"{folder / '1_ReLU.py'} and {folder / '1_ReLUdup.py'} both are problem 1 of "
                                     f"level 0")
    assert [t.name for t in load_tasks(str(folder), problem_ids=[2])] == ["2_Other.py"]  # not selected: no clash


# train.py gets a model that cannot load: the tasks are checked first, and a run that missed the
# repeated id stops there instead of training for minutes
@pytest.mark.parametrize("script, options", [("evaluate.py", ["--output_dir"]), ("generate.py", ["--output"]),
                                             ("train.py", ["--model", "/nonexistent/model", "--output_dir"])])
def test_every_script_stops_on_a_repeated_problem_id_with_one_line_and_status_2(tmp_path, script, options):
    folder = _folder_with_a_repeated_id(tmp_path)
    out = subprocess.run([sys.executable, script, "--tasks", str(folder), *options, str(tmp_path / "out")],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if "error" in line]
    assert errors == [f"{script}: error: cannot load tasks '{folder}': {folder / '1_ReLU.py'} and "
                      f"{folder / '1_ReLUdup.py'} both are problem 1 of level 0 (a file's problem id is the number "
                      f"its name starts with, else 0); results are keyed by it: renumber or remove one"], out.stderr
