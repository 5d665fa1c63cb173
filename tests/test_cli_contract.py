"""What every ``staging-store`` command promises a newcomer: one table of exit codes, printed lines
that run as printed, help examples that run, messages without Python internals, and the rough
edges of issue 24 each held by a test.

The demo store comes from ``tests/test_cli.py``'s session fixture (one demo per test process).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from test_cli import SCRIPT, assert_one_line_error, copy, demo, folder_state, run, script

from store.cli.app import COMMANDS, cli
from store.log.schema import SCHEMA_REVISION

__all__ = ["copy", "demo"]  # the fixtures, shared with tests/test_cli.py

BIN = SCRIPT.parent
REPO = Path(__file__).resolve().parents[1]
POSTGRES_URL = os.environ.get("STORE_TEST_POSTGRES_URL")


def _path_without_this_venv() -> str:
    return os.pathsep.join(part for part in os.environ.get("PATH", "").split(os.pathsep) if Path(part) != BIN)


def _copy_demo_store(demo_path: Path, folder: Path) -> None:
    (folder / "demo-store").mkdir()
    shutil.copyfile(demo_path, folder / "demo-store" / "demo.db")


# --- 1: the demo's "next:" lines run as printed, on PATH or not ------------------------------------


def test_the_demos_next_lines_run_as_printed_off_path(tmp_path: Path) -> None:
    """``make demo`` leaves ``staging-store`` in ``.venv/bin``, off PATH: the lines name the script."""
    env = {**os.environ, "PATH": _path_without_this_venv()}
    env.pop("STAGING_STORE", None)
    done = subprocess.run(
        [str(SCRIPT), "demo", "--rollouts", "1", "--workers", "1", "--tokens", "8"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "\nstore: demo-store/demo.db\n" in done.stdout and "\nexport: demo-store/demo.jsonl (" in done.stdout
    _, _, tail = done.stdout.partition("\nnext")
    heading, *lines = [line.strip() for line in tail.splitlines() if line.strip()]
    assert "is not on your PATH" in heading and f"{BIN / 'activate'}` puts it there" in heading, heading
    assert len(lines) == 5 and all(line.startswith(f"{shlex.quote(str(SCRIPT))} ") for line in lines), lines
    assert all(" demo-store/demo.db" in line for line in lines)  # relative to where it was run
    for line in lines:
        ran = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        assert ran.returncode == 0, (line, ran.stdout, ran.stderr)


def test_the_printed_command_is_the_bare_name_on_path_and_relative_inside_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from store.cli import invocation

    monkeypatch.setenv("PATH", os.pathsep.join([str(BIN), _path_without_this_venv()]))
    assert (invocation.command(), invocation.activation_hint()) == ("staging-store", None)
    monkeypatch.setenv("PATH", _path_without_this_venv())
    monkeypatch.chdir(BIN.parent.parent)  # the folder holding the venv, as after `make demo`
    assert invocation.command() == f"{BIN.parent.name}/bin/staging-store"
    assert (
        invocation.activation_hint()
        == f"staging-store is not on your PATH: `. {BIN.parent.name}/bin/activate` puts it there"
    )


# --- 2: every --help example runs on the store the demo makes ------------------------------------

NOT_RUN_HERE = {
    "demo": "the main job itself, at other sizes (docs/cli.md's demo line runs in tests/test_docs.py)",
    "serve": "runs until stopped (tests/test_cli_serve.py and tests/test_docs.py start and stop it)",
    "vllm-serve": "runs vLLM until stopped (tests/test_vllm_serve.py starts and stops it)",
}
EXAMPLE_INPUTS = {"done.txt": "run1-r1\nrun1-r1-a1\n", "token.txt": "change-me\n"}  # files the examples read


def _examples(command: str) -> list[str]:
    epilog = cli.get_command(None, command).epilog or ""  # type: ignore[arg-type, union-attr]
    found = []
    for line in epilog.splitlines():
        text = line.strip().removeprefix("Example: ")
        if text.startswith(("staging-store ", "STAGING_STORE=")):
            found.append(text)
    return found


def test_every_command_shows_an_example() -> None:
    assert [command for command in COMMANDS if not _examples(command)] == []


@pytest.mark.parametrize("command", [command for command in COMMANDS if command not in NOT_RUN_HERE])
def test_every_help_example_runs_on_the_demo_store(
    command: str, demo: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each example line, in order, in a folder holding the demo's store as ``demo-store/demo.db``.

    Run in this process through ``main`` (a subprocess each would cost a second of imports):
    ``VAR=value`` before the command is set in the environment, ``A && B`` runs both, and the
    part before ``| head`` must succeed on its own.
    """
    _copy_demo_store(demo[0], tmp_path)
    for name, text in EXAMPLE_INPUTS.items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("STAGING_STORE", raising=False)
    ran = 0
    for example in _examples(command):
        if "postgresql://" in example:
            continue  # names a server that is not here
        for part in example.split("|")[0].split("&&"):
            words = shlex.split(part)
            with monkeypatch.context() as scoped:
                while "=" in words[0]:
                    name, _, value = words.pop(0).partition("=")
                    scoped.setenv(name, value)
                assert words[0] == "staging-store", example
                code, out, err = run(capsys, *words[1:])
            assert code == 0, (example, out, err)
            ran += 1
    assert ran > 0


# --- 3: serve's Ctrl-C is 130, and its help says so -----------------------------------------------


def test_serve_says_and_does_exit_130_on_ctrl_c(demo: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    text = CliRunner().invoke(cli, ["serve", "--help"]).output
    assert "130" in text and "(exit 0)." not in text.replace("\n", " ").split("Ctrl-C")[-1][:40]
    pytest.importorskip("uvicorn")
    token = tmp_path / "token.txt"
    token.write_text("change-me-to-a-long-secret\n")  # serve refuses a short or world-readable token
    token.chmod(0o600)
    serve = ["serve", str(demo[0]), "--token-file", str(token), "--port", "0"]
    server = subprocess.Popen(
        [sys.executable, "-c", AS_IN_A_TERMINAL, str(SCRIPT), *serve],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        assert server.stdout.readline().startswith("serving ")  # the sign that it listens
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=60) == 130
    finally:
        if server.poll() is None:
            server.kill()
        server.communicate()


AS_IN_A_TERMINAL = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
)


# --- 4: another tool's alembic database is not a store (not a "newer" one) --------------------------


def test_another_tools_alembic_database_is_not_a_store(tmp_path: Path, capsys: Any) -> None:
    theirs = tmp_path / "theirs.db"
    with sqlite3.connect(theirs) as connection:
        connection.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) PRIMARY KEY)")
        connection.execute("INSERT INTO alembic_version VALUES ('3f2a9c1b7d4e')")
        connection.execute("CREATE TABLE users (id INTEGER)")
    connection.close()
    before = folder_state(tmp_path)
    for args in (["audit"], ["migrate"], ["migrate", "--create"], ["retire", "k"], ["keys"]):
        code, out, err = run(capsys, args[0], str(theirs), *args[1:])
        assert code == 3 and out == "", (args, err)
        assert_one_line_error(err)
        assert "is not a staging-store database" in err and "newer" not in err, err
        assert folder_state(tmp_path) == before, args

    from store import MigrationError, StorageError, open_store

    for read_only in (True, False):
        with pytest.raises(StorageError) as caught:
            open_store(theirs, read_only=read_only)
        assert not isinstance(caught.value, MigrationError) and "another tool's alembic schema" in str(caught.value)
    assert folder_state(tmp_path).keys() >= before.keys()


def test_a_newer_store_is_still_newer(copy: Path, capsys: Any) -> None:
    with sqlite3.connect(copy) as connection:
        connection.execute("UPDATE alembic_version SET version_num = '0099'")
    connection.close()
    code, _, err = run(capsys, "audit", str(copy))
    assert code == 3 and "newer" in err and "upgrade staging-store" in err


# --- 5: only --create ever creates a store ---------------------------------------------------------


def test_migrate_without_create_leaves_an_empty_file_empty(tmp_path: Path, capsys: Any) -> None:
    empty = tmp_path / "empty.db"
    empty.touch()
    code, out, err = run(capsys, "migrate", str(empty))
    assert code == 3 and out == "" and "--create" in err and "holds no store" in err
    assert_one_line_error(err)
    assert sorted(os.listdir(tmp_path)) == ["empty.db"] and empty.stat().st_size == 0
    code, out, _ = run(capsys, "migrate", str(empty), "--create", "--json")
    assert code == 0 and json.loads(out)["from_revision"] is None
    assert run(capsys, "audit", str(empty))[0] == 0


def test_migrate_without_create_makes_no_postgresql_schema(capsys: Any, request: pytest.FixtureRequest) -> None:
    if POSTGRES_URL is None:
        pytest.skip("STORE_TEST_POSTGRES_URL is not set")
    from conftest import reset_postgres

    database = request.getfixturevalue("postgres_run_url")
    reset_postgres(database)
    url = f"{database}?schema=fleet_new"
    code, out, err = run(capsys, "migrate", url)
    assert code == 3 and out == "" and "the schema fleet_new does not exist" in err and "--create" in err, err
    assert "?schema=fleet_new" in err
    assert_one_line_error(err)
    assert _schemas(database) == set()
    code, out, err = run(capsys, "migrate", database)  # the public schema, empty
    assert code == 3 and "holds no store (no tables)" in err, err
    code, out, err = run(capsys, "migrate", url, "--create", "--json")
    assert code == 0 and json.loads(out)["store"].endswith("?schema=fleet_new"), err
    assert _schemas(database) == {"fleet_new"}


def _schemas(url: str) -> set[str]:
    import sqlalchemy as sa
    from sqlalchemy.engine import make_url

    engine = sa.create_engine(make_url(url).set(drivername="postgresql+psycopg"))
    try:
        with engine.connect() as connection:
            names = connection.exec_driver_sql(
                "SELECT nspname FROM pg_namespace WHERE left(nspname, 3) <> 'pg_' "
                "AND nspname NOT IN ('information_schema', 'public')"
            ).scalars()
            return set(names)
    finally:
        engine.dispose()


# --- 6: a missing positional argument is blamed, not the store -------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["show", "tty.db"], "missing argument KEY (after the store tty.db)"),
        (["lineage", "tty.db"], "missing argument ROLLOUT (after the store tty.db)"),
        (["show"], "missing argument KEY"),
        (["show", "run1-r0/c0"], "no store given"),  # a key, and no $STAGING_STORE: the store is missing
        (["ship", "a.db"], "Missing argument 'DST'"),
    ],
)
def test_a_missing_argument_is_named(
    args: list[str], message: str, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STAGING_STORE", raising=False)
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, *args)
    assert code == 2 and out == "" and message in err, err
    assert_one_line_error(err)
    assert list(tmp_path.iterdir()) == []


# --- 7: no Python internals in messages -----------------------------------------------------------

INTERNALS = re.compile(r"PosixPath|sqlite\+pysqlite|postgresql\+psycopg|Traceback|\bself\b|<class ")


def test_messages_carry_no_python_internals(
    demo: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = str(demo[0])
    code, _, err = run(capsys, "export", store, "-o", str(tmp_path / "no" / "such" / "rows.jsonl"))
    assert code == 2 and f"the folder {tmp_path / 'no' / 'such'} does not exist" in err, err
    assert not INTERNALS.search(err)
    code, _, err = run(capsys, "ship", store, store)
    assert code == 2 and f"same store ({store})" in err and not INTERNALS.search(err), err
    code, out, err = run(capsys, "export", store, "--rollout", "no-such-rollout", "-o", os.devnull)
    assert code == 1 and not INTERNALS.search(out + err)
    failure = out.splitlines()[-1]
    assert failure.startswith("  not exported: no-such-rollout: ") and failure.count("empty_manifest") == 1, failure

    from store import StoreError, open_store

    with open_store(store, read_only=True) as opened, pytest.raises(StoreError) as caught:
        opened.export_jsonl(tmp_path / "missing" / "rows.jsonl")  # the library names the path and the reason
    assert str(caught.value) == f"export_jsonl() cannot write {tmp_path / 'missing' / 'rows.jsonl'}: " + (
        f"the folder {tmp_path / 'missing'} does not exist"
    )


def test_the_missing_postgresql_driver_names_the_extra() -> None:
    probe = (
        "import sys\n"
        "sys.modules['psycopg'] = None  # as if the [postgres] extra were not installed\n"
        "from store.cli import main\n"
        "sys.exit(main(['audit', 'postgresql://someone@127.0.0.1:1/nothing']))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 3, done.stderr
    assert_one_line_error(done.stderr)
    assert not INTERNALS.search(done.stderr)
    # staging-store is not on PyPI: the line names the checkout this was installed from (issue 34)
    assert "staging-store[postgres]" not in done.stderr, done.stderr
    assert f"-m pip install -e '{REPO}[postgres]'" in done.stderr, done.stderr


def test_no_line_or_document_says_pip_install_staging_store() -> None:
    """The package is not published: nothing tells a reader to install it by name from PyPI."""
    texts = [path for path in [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "store").rglob("*.py")]]
    said = [str(path) for path in texts if re.search(r"pip install '?staging-store\b", path.read_text())]
    assert said == []


def test_an_extra_is_named_by_the_way_this_was_installed() -> None:
    from store.install import extra_hint, extra_requirements

    assert extra_hint("http").endswith(f"-m pip install -e '{REPO}[http]'")  # this checkout, editable
    requires = ['fastapi>=0.110; extra == "http"', 'uvicorn>=0.29; extra == "http"', "click>=8.2",
                'staging-store[http,postgres]; extra == "test"', 'pytest>=8; extra == "test"']  # fmt: skip
    assert extra_requirements(requires, "http") == ["fastapi>=0.110", "uvicorn>=0.29"]
    assert extra_requirements(requires, "test") == ["pytest>=8"]


def test_store_has_a_version() -> None:
    import importlib.metadata

    import store

    assert store.__version__ == importlib.metadata.version("staging-store") == "0.1.0"
    done = script("--version")
    assert done.stdout.strip() == f"staging-store {store.__version__}"


def test_a_postgresql_message_keeps_the_schema_it_names(capsys: Any, request: pytest.FixtureRequest) -> None:
    if POSTGRES_URL is None:
        pytest.skip("STORE_TEST_POSTGRES_URL is not set")
    from conftest import reset_postgres

    database = request.getfixturevalue("postgres_run_url")
    reset_postgres(database)
    code, _, err = run(capsys, "migrate", f"{database}?schema=elsewhere", "--create")
    assert code == 0, err
    code, _, err = run(capsys, "rollouts", f"{database}?schema=nowhere")
    assert code == 3 and "?schema=nowhere" in err and not INTERNALS.search(err), err


# --- 8: the demo creates one folder at most --------------------------------------------------------


def test_the_demo_creates_no_missing_folders(tmp_path: Path, capsys: Any) -> None:
    code, out, err = run(capsys, "demo", "--path", str(tmp_path / "no" / "such" / "d.db"))
    assert code == 2 and out == "" and f"the folder {tmp_path / 'no'} does not exist" in err, err
    assert_one_line_error(err)
    assert list(tmp_path.iterdir()) == []


# --- one table of exit codes, followed by every command -------------------------------------------

PRINTING = [
    ["audit"], ["replay"], ["rollouts"], ["lineage", "run1-r0"], ["keys"], ["keys", "--json"],
    ["show", "run1-r0/c0"], ["versions"], ["export"], ["workers"], ["receipts"],
]  # fmt: skip


@pytest.mark.parametrize("args", PRINTING, ids=[" ".join(args) for args in PRINTING])
def test_a_closed_pipe_is_141_for_every_command(args: list[str], demo: tuple[Path, dict[str, Any]]) -> None:
    """The reader is gone before the first line (``| head -0``): every command stops at once, quietly."""
    proc = subprocess.Popen(
        [str(SCRIPT), args[0], str(demo[0]), *args[1:]], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    code = proc.wait(timeout=60)
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert (code, err) == (141, "")


def test_a_closed_pipe_part_way_through_a_long_listing_is_141(copy: Path) -> None:
    """The reader takes the first lines of a listing longer than a pipe holds, then leaves (``| head``):
    the command is cut short and ends with 141, quietly.

    The reader here reads 2,000 bytes and closes, so the rest (far beyond the pipe's 64 KiB) can
    never all be buffered: a ``| head`` reads a larger first chunk, and on a loaded machine a
    short listing could be written whole before head exits (then 0 is right, and racy to test).
    """
    from factories import make_record

    from store import StageEntry, open_store

    with open_store(copy) as opened:
        for start in range(0, 4000, 500):
            batch = [make_record(rollout_id=f"many-{n}", model_call_id="c0") for n in range(start, start + 500)]
            opened.stage_all([StageEntry(record) for record in batch])
    for command in ("keys", "rollouts", "versions"):
        proc = subprocess.Popen([str(SCRIPT), command, str(copy)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.read(2000)
        proc.stdout.close()
        code = proc.wait(timeout=120)
        err = proc.stderr.read().decode()
        proc.stderr.close()
        assert first.count(b"\n") >= 3 and (code, err) == (141, ""), (command, first, code, err)


UNKNOWN = [
    ["lineage", "no-such-rollout"],
    ["keys", "--rollout", "no-such-rollout"],
    ["keys", "--rollout", "no-such-rollout", "--json"],
    ["versions", "--rollout", "no-such-rollout"],
    ["versions", "--rollout", "no-such-rollout", "--json"],
    ["export", "--rollout", "no-such-rollout", "-o", os.devnull],
    ["show", "no-such-rollout/c0"],
    ["receipts", "--rollout", "no-such-rollout"],
    ["receipts", "--checkpoint", "no-such-rollout"],
]


@pytest.mark.parametrize("args", UNKNOWN, ids=[" ".join(args[:3]) for args in UNKNOWN])
def test_a_rollout_or_key_the_store_does_not_hold_is_1_everywhere(
    args: list[str], demo: tuple[Path, dict[str, Any]], capsys: Any
) -> None:
    code, out, err = run(capsys, args[0], str(demo[0]), *args[1:])
    assert code == 1, (out, err)
    assert "no-such-rollout" in out + err and "Traceback" not in err


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_refuses_an_unknown_option_with_2(command: str, capsys: Any) -> None:
    code, out, err = run(capsys, command, "--no-such-option")
    assert code == 2 and out == "" and f"(see 'staging-store {command} --help')" in err
    assert_one_line_error(err)


@pytest.mark.parametrize("command", [c for c in COMMANDS if c not in ("demo", "ship", "serve", "vllm-serve")])
def test_every_command_refuses_a_missing_store_with_3(
    command: str, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    extra = {"lineage": ["r"], "show": ["k"], "retire": ["k"], "forget": ["k"], "delete": ["k"]}.get(command, [])
    code, out, err = run(capsys, command, str(tmp_path / "typo.db"), *extra)
    assert code == 3 and out == "" and "typo.db" in err, err
    assert_one_line_error(err)
    assert list(tmp_path.iterdir()) == []


def test_the_exit_code_table_is_the_one_the_help_states() -> None:
    table = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text(encoding="utf-8")
    documented = re.findall(r"^\| `(\d+)` \|", table, flags=re.M)
    assert documented == ["0", "1", "2", "3", "130", "141"]
    top = CliRunner().invoke(cli, ["--help"]).output.replace("\n", " ")
    assert all(f" {code} " in top for code in documented), top


# --- the smaller edges ---------------------------------------------------------------------------


def test_max_lag_without_stale_is_an_error(demo: tuple[Path, dict[str, Any]], capsys: Any) -> None:
    code, out, err = run(capsys, "versions", str(demo[0]), "--max-lag", "2")
    assert code == 2 and out == "" and "--max-lag only applies with --stale" in err


def test_bare_staging_store_prints_its_help(capsys: Any) -> None:
    done = script()
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.startswith("Usage: staging-store") and "error" not in done.stdout.split("Options:")[0]


def test_a_listing_shows_every_row_and_no_control_characters(copy: Path, capsys: Any) -> None:
    from factories import make_record

    from store import open_store

    with open_store(copy) as opened:
        opened.stage(make_record(rollout_id="evil\x1b[31m\nred", model_call_id="c0"))
    code, out, _ = run(capsys, "keys", str(copy))
    assert code == 0 and "\x1b" not in out and "evil\\x1b[31m\\x0ared/c0" in out
    code, out, _ = run(capsys, "keys", str(copy), "--json")
    shown = json.loads(out)["keys"]
    code, out, _ = run(capsys, "keys", str(copy))
    lines = out.splitlines()
    assert lines[0] == f"{len(shown)} key(s)" and len(lines) == 3 + len(shown)
    assert [line.split()[0] for line in lines[3:]] == [key["staging_key"].replace("\x1b", "\\x1b").replace(
        "\n", "\\x0a") for key in shown]  # fmt: skip


def test_read_commands_change_neither_the_database_nor_its_wal_while_a_writer_has_it_open(
    copy: Path, capsys: Any
) -> None:
    """docs/cli.md: a reader of a store another process has open may write the -shm index, nothing else."""
    from factories import make_record

    from store import open_store

    with open_store(copy) as writer:
        writer.stage(make_record(rollout_id="open", model_call_id="c0"))  # a -wal that holds a commit
        files = [copy, Path(f"{copy}-wal")]
        before = {path.name: path.read_bytes() for path in files}
        for command in ("audit", "keys", "rollouts", "versions", "workers", "replay"):
            code, _, err = run(capsys, command, str(copy), "--json")
            assert code == 0, (command, err)
        code, _, _ = run(capsys, "export", str(copy), "-o", os.devnull)
        assert code == 0
        assert {path.name: path.read_bytes() for path in files} == before


# --- issue 34: messages in the user's words ------------------------------------------------------

LEAKS = re.compile(r"\(\w*(?:Error|Exception)\)|\[Errno|\w+\(\) |fetch_chunks|export_jsonl|rollout_id must")


def test_errors_name_the_path_as_the_user_typed_it(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    for args, said, expected in [
        (["audit", "nope.db"], "no store at nope.db (", 3),
        (["audit", "no/such/x.db"], "the folder no/such does not exist", 3),
        (["retire", "nope.db", "k"], "no store at nope.db;", 3),
        (["demo", "--path", "folder"], "folder is a directory", 3),
        (["compact", os.devnull], f"{os.devnull} is not a store (not a regular file)", 3),
        (["demo", "--path", ""], "Invalid value for '--path': it is empty", 2),
        (["export", "nope.db", "-o", ""], "Invalid value for '-o' / '--output': it is empty", 2),
    ]:
        code, out, err = run(capsys, *args)
        assert code == expected and out == "" and said in err, (args, err)
        assert str(tmp_path) not in err and not LEAKS.search(err), err
        assert_one_line_error(err)


@pytest.mark.parametrize(
    "args",
    [["show", ""], ["lineage", ""], ["keys", "--rollout", ""], ["versions", "--rollout", ""],
     ["export", "--rollout", "", "-o", os.devnull], ["receipts", "--checkpoint", ""], ["show", "r/\udcff"]],
    ids=["show", "lineage", "keys", "versions", "export", "receipts", "not-utf8"],
)  # fmt: skip
def test_an_empty_or_undecodable_name_is_bad_usage_in_the_users_words(
    args: list[str], demo: tuple[Path, dict[str, Any]], capsys: Any
) -> None:
    code, out, err = run(capsys, args[0], str(demo[0]), *args[1:])
    assert code == 2 and out == "" and not LEAKS.search(err), err
    assert "empty" in err or "not UTF-8" in err, err
    assert_one_line_error(err)


def test_a_file_the_command_cannot_read_or_write_is_named_with_the_reason(
    demo: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: Any
) -> None:
    store = str(demo[0])
    code, _, err = run(capsys, "export", store, "-o", "/dev/full")
    assert code == 3 and "cannot write the export to /dev/full: no space left on device" in err, err
    code, _, err = run(capsys, "export", store, "-o", "/proc/no-such.jsonl")
    assert code == 2 and "cannot write the export to /proc/no-such.jsonl (-o): " in err, err
    code, _, err = run(capsys, "delete", store, "--from-file", str(tmp_path / "missing.txt"))
    assert code == 2 and f"from {tmp_path / 'missing.txt'}: no such file or directory" in err, err
    for text in (err,):
        assert not LEAKS.search(text), text


def test_an_unreachable_postgresql_server_gets_a_reason_and_no_type_name(capsys: Any) -> None:
    pytest.importorskip("psycopg")
    code, _, err = run(capsys, "audit", "postgresql://someone@127.0.0.1:1/nothing?schema=team_a")
    assert code == 3 and "connection refused" in err and not LEAKS.search(err), err
    assert "postgresql://someone@127.0.0.1:1/nothing" in err
    assert_one_line_error(err)


def test_a_postgresql_message_keeps_the_schema_and_the_reason(capsys: Any) -> None:
    if POSTGRES_URL is None:
        pytest.skip("STORE_TEST_POSTGRES_URL is not set")
    from sqlalchemy.engine import make_url

    server = make_url(POSTGRES_URL)
    missing = server.set(database="no_such_database_34").render_as_string(hide_password=False)
    code, _, err = run(capsys, "rollouts", f"{missing}?schema=team_a")
    assert code == 3 and "no_such_database_34?schema=team_a" in err, err
    assert "CREATE DATABASE no_such_database_34" in err and not LEAKS.search(err), err
    code, _, err = run(capsys, "audit", f"{POSTGRES_URL}?sslmode=disable&bogus=1")
    assert code == 3 and "option bogus" in err and not LEAKS.search(err), err


def test_the_transformers_demo_without_torch_creates_nothing(tmp_path: Path) -> None:
    probe = (
        "import sys\n"
        "sys.modules['torch'] = None  # as if torch were not installed\n"
        "from store.cli import main\n"
        "sys.exit(main(['demo', '--engine', 'transformers', '--path', 'demo-store/demo.db']))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stdout + done.stderr
    assert_one_line_error(done.stderr)
    assert "torch" in done.stderr and "nothing was created" in done.stderr and "DemoError" not in done.stderr
    assert list(tmp_path.iterdir()) == []


# --- issue 34: repeated options, several values or a clear refusal ---------------------------------


def test_a_repeatable_rollout_option_takes_every_value(demo: tuple[Path, dict[str, Any]], capsys: Any) -> None:
    store = str(demo[0])
    one = {
        key["staging_key"]
        for key in json.loads(run(capsys, "keys", store, "--rollout", "run1-r0", "--json")[1])["keys"]
    }
    two = {
        key["staging_key"]
        for key in json.loads(run(capsys, "keys", store, "--rollout", "run1-r1", "--json")[1])["keys"]
    }
    code, out, _ = run(capsys, "keys", store, "--rollout", "run1-r0", "--rollout", "run1-r1", "--json")
    both = [key["staging_key"] for key in json.loads(out)["keys"]]
    assert code == 0 and set(both) == one | two and both == sorted(both) and one and two
    code, out, _ = run(capsys, "versions", store, "--rollout", "run1-r1", "--rollout", "run1-r0", "--json")
    assert code == 0 and [r["rollout_id"] for r in json.loads(out)["rollouts"]] == ["run1-r0", "run1-r1"]


@pytest.mark.parametrize(
    "args",
    [["keys", "--limit", "1", "--limit", "2"], ["receipts", "--rollout", "run1-r0", "--rollout=run1-r1"],
     ["receipts", "--checkpoint", "a", "--checkpoint", "b"], ["export", "-o", "a.jsonl", "--output", "b.jsonl"],
     ["keys", "--json", "--csv"]],
    ids=["limit", "rollout", "checkpoint", "output", "formats"],
)  # fmt: skip
def test_an_option_of_one_value_given_twice_is_refused(
    args: list[str], demo: tuple[Path, dict[str, Any]], capsys: Any
) -> None:
    code, out, err = run(capsys, args[0], str(demo[0]), *args[1:])
    assert code == 2 and out == "" and ("given twice" in err or "give one" in err), err
    assert_one_line_error(err)


# --- issue 34: look before you delete ------------------------------------------------------------


def test_rollouts_show_fences_and_list_the_fenced_attempts_to_delete(copy: Path, capsys: Any) -> None:
    code, out, _ = run(capsys, "rollouts", str(copy))
    header = out.splitlines()[1].split()
    assert code == 0 and header[-1] == "fenced" and "run1-r0  " in out
    code, out, _ = run(capsys, "rollouts", str(copy), "--fenced", "--capture-keys")
    assert code == 0 and out.splitlines() == ["run1-r0", "run1-r1", "run1-r2"]  # the dead attempts the demo retired
    keys_file = copy.parent / "dead.txt"
    keys_file.write_text(out)
    before = folder_state(copy.parent)
    code, out, err = run(capsys, "delete", str(copy), "--from-file", str(keys_file), "--dry-run", "--json")
    shaped = json.loads(out)
    assert code == 0 and shaped["dry_run"] and shaped["removed"] == ["run1-r0", "run1-r1", "run1-r2"], err
    assert all(row["fenced"] and row["events"] > 0 and row["records"] > 0 for row in shaped["keys"])
    code, out, _ = run(capsys, "delete", str(copy), "--from-file", str(keys_file), "--dry-run")
    assert code == 0 and "3 capture key(s) would be deleted" in out and "nothing was written" in out
    code, out, _ = run(capsys, "retire", str(copy), "run1-r0-a1", "no-such", "--dry-run", "--json")
    assert code == 0 and json.loads(out)["absent"] == ["no-such"]
    code, _, _ = run(capsys, "forget", str(copy), "no-such", "--dry-run")
    assert code == 1  # as forget itself would exit
    assert folder_state(copy.parent) == before  # a dry run writes nothing
    code, out, _ = run(capsys, "delete", str(copy), "--from-file", str(keys_file), "--json")
    assert code == 0 and json.loads(out)["removed"] == shaped["removed"]
    code, out, _ = run(capsys, "rollouts", str(copy), "--fenced", "--capture-keys")
    assert (code, out) == (0, "")


# --- issue 34: listings as JSON Lines, CSV, TSV, limited, sorted ------------------------------------


@pytest.mark.parametrize("command", ["rollouts", "keys", "versions", "workers", "receipts"])
def test_every_listing_streams_as_json_lines_csv_and_tsv(
    command: str, demo: tuple[Path, dict[str, Any]], capsys: Any
) -> None:
    import csv
    import io

    store = str(demo[0])
    code, out, _ = run(capsys, command, store, "--jsonl")
    lines = [json.loads(line) for line in out.splitlines()]  # every line parses
    assert code == 0 and lines
    code, out, _ = run(capsys, command, store, "--jsonl", "--limit", "1")
    assert code == 0 and len(out.splitlines()) == 1 and json.loads(out) == lines[0]
    for flag, delimiter in (("--csv", ","), ("--tsv", "\t")):
        code, out, _ = run(capsys, command, store, flag)
        table = list(csv.reader(io.StringIO(out), delimiter=delimiter))
        assert code == 0 and len(table) >= 2 and all(len(row) == len(table[0]) for row in table), out
    if command != "receipts":  # receipts' CSV is one row per acknowledgement, its JSON one per receipt
        document = json.loads(run(capsys, command, store, "--json")[1])
        listed = next(value for value in document.values() if isinstance(value, list))
        assert listed == lines


def test_versions_lists_rollouts_sorted(copy: Path, capsys: Any) -> None:
    from factories import make_record

    from store import open_store

    with open_store(copy) as opened:
        for name in ("zz-last", "aa-first", "mm-middle"):
            opened.stage(make_record(rollout_id=name, model_call_id="c0"))
    code, out, _ = run(capsys, "versions", str(copy), "--json")
    names = [row["rollout_id"] for row in json.loads(out)["rollouts"]]
    assert code == 0 and names == sorted(names) and names[0] == "aa-first"


# --- issue 34: help and output you can copy --------------------------------------------------------


@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_examples_are_one_line_each_at_any_width(command: str) -> None:
    """A long example is printed whole on one line, never broken inside a token (``--from-`` / ``file``)."""
    for width in (60, 100):
        text = CliRunner().invoke(cli, [command, "--help"], terminal_width=width).output
        lines = [line.strip().removeprefix("Example: ") for line in text.splitlines()]
        for example in _examples(command):
            assert example in lines, (width, example, text)


def test_piped_output_is_never_wrapped(tmp_path: Path) -> None:
    deep = tmp_path / ("a-folder-with-a-rather-long-name-" * 6) / "store.db"
    deep.parent.mkdir()
    done = script("migrate", str(deep), "--create")
    assert done.returncode == 0, done.stderr
    done = script("compact", str(deep))  # one sentence naming the path, well over 160 columns
    [line] = done.stdout.splitlines()
    assert done.returncode == 0 and len(line) > 200 and line.startswith(f"{deep}: "), done.stdout


def test_the_top_level_help_claims_only_what_holds() -> None:
    """The top-level help names the commands without --json and those that do not read $STAGING_STORE
    (it said every command has --json and reads it; serve and ship do not).  A new command that
    differs must be named there too."""
    text = " ".join(CliRunner().invoke(cli, ["--help"]).output.split())
    no_json = re.search(r"Every command but (.+?) has --json", text)
    no_env = re.search(r"reads \$STAGING_STORE \(all but (.+?)\)\.", text)
    assert no_json is not None and no_env is not None, text
    said_no_json = set(re.findall(r"`([\w-]+)`", no_json[1]))
    said_no_env = set(re.findall(r"`([\w-]+)`", no_env[1]))
    without_json, without_env = set(), set()
    for command in COMMANDS:
        params = cli.get_command(None, command).params  # type: ignore[arg-type, union-attr]
        if not any("--json" in param.opts for param in params):
            without_json.add(command)
        if not {"store", "arguments"} & {param.name for param in params}:
            without_env.add(command)
    assert (said_no_json, said_no_env) == (without_json, without_env), text
    assert without_json >= {"serve"} and without_env >= {"demo", "ship"}


def test_quiet_and_verbose(demo: tuple[Path, dict[str, Any]], capsys: Any) -> None:
    code, out, err = run(capsys, "-q", "export", str(demo[0]))
    assert code == 0 and out and err == ""  # the report beside the lines on stdout is left out
    code, out, err = run(capsys, "export", str(demo[0]))
    assert code == 0 and err.startswith("exported ")
    pytest.importorskip("psycopg")
    code, _, err = run(capsys, "-v", "audit", "postgresql://someone@127.0.0.1:1/nothing")
    first, *causes = err.splitlines()
    assert code == 3 and first.startswith("staging-store: error: ") and causes, err
    assert all(line.startswith("  caused by ") for line in causes) and "Connection refused" in err
    code, _, err = run(capsys, "audit", "postgresql://someone@127.0.0.1:1/nothing")
    assert len(err.splitlines()) == 1  # without -v: one line


# --- issue 34: migrate looks before it writes ------------------------------------------------------


def test_migrate_check_only_looks(copy: Path, tmp_path: Path, capsys: Any) -> None:
    before = folder_state(copy.parent)
    code, out, _ = run(capsys, "migrate", str(copy), "--check", "--json")
    assert code == 0 and json.loads(out) == {
        "store": str(copy), "revision": SCHEMA_REVISION, "library_revision": SCHEMA_REVISION, "pending": []
    }  # fmt: skip
    empty = tmp_path / "empty.db"
    empty.touch()
    code, out, _ = run(capsys, "migrate", str(empty), "--check")
    assert code == 1 and "pending: 0001" in out and empty.stat().st_size == 0
    assert run(capsys, "migrate", str(copy), "--check", "--create")[0] == 2
    assert folder_state(copy.parent) == before


def test_migrate_of_an_up_to_date_store_never_opens_it_for_writing(
    copy: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only, up-to-date store said "permission denied": migrate opened it writable to do nothing."""
    import store.store

    opened = store.store.open_store

    def read_only_only(*args: Any, **kwargs: Any) -> Any:
        assert kwargs.get("read_only"), "migrate opened an up-to-date store for writing"
        return opened(*args, **kwargs)

    monkeypatch.setattr(store.store, "open_store", read_only_only)
    before = folder_state(copy.parent)
    code, out, err = run(capsys, "migrate", str(copy))
    assert code == 0 and "nothing to do" in out, err
    assert folder_state(copy.parent) == before


def test_shell_completion_works_as_documented() -> None:
    """docs/cli.md's completion lines: click's completion of commands and of a command's options."""
    text = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    assert 'eval "$(_STAGING_STORE_COMPLETE=bash_source staging-store)"' in text
    done = script(env={**os.environ, "_STAGING_STORE_COMPLETE": "bash_source"})
    assert done.returncode == 0 and "_staging_store_completion()" in done.stdout
    asked = {**os.environ, "_STAGING_STORE_COMPLETE": "bash_complete"}
    done = script(env={**asked, "COMP_WORDS": "staging-store del", "COMP_CWORD": "1"})
    assert done.stdout.split() == ["plain,delete"]
    done = script(env={**asked, "COMP_WORDS": "staging-store rollouts --fe", "COMP_CWORD": "2"})
    assert done.stdout.split() == ["plain,--fenced"]
    assert "NO_COLOR" in text
