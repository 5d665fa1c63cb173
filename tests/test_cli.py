"""``staging-store`` through its real entry points: ``store.cli.app``, click's runner, the installed script.

One demo run (worker processes, a cut, SIGKILL, restore) builds the store the read commands
are tried on; commands that damage or repair work on copies of it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from store.cli import main
from store.cli.app import COMMANDS, cli
from store.log.schema import SCHEMA_REVISION

SCRIPT = Path(sys.executable).with_name("staging-store")
READ_COMMANDS = ["audit", "rollouts", "keys", "versions", "export", "replay", "lineage", "show", "workers"]


def folder_state(folder: Path) -> dict[str, str]:
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in sorted(os.listdir(folder))}


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def script(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env, check=False)


def assert_one_line_error(err: str) -> None:
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("staging-store: error: "), err


@pytest.fixture(scope="session")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The demo, run by the installed script: 3 rollouts, 2 workers, 24 tokens a call."""
    path = tmp_path_factory.mktemp("demo") / "demo.db"
    done = script("demo", "--path", str(path), "--rollouts", "3", "--workers", "2", "--tokens", "24", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    return path, json.loads(done.stdout)


@pytest.fixture
def copy(demo: tuple[Path, dict[str, Any]], tmp_path: Path) -> Path:
    target = tmp_path / "store" / "demo.db"
    target.parent.mkdir()
    shutil.copyfile(demo[0], target)
    return target


def command_args(command: str, store: str) -> list[str]:
    extra = {"lineage": ["run1-r0"], "show": ["run1-r0/c0"], "export": ["-o", os.devnull]}.get(command, [])
    return [command, store, *extra]


# --- the demo ------------------------------------------------------------------------------------


def test_the_demo_cuts_kills_restores_and_verifies(demo: tuple[Path, dict[str, Any]], capsys: Any) -> None:
    path, summary = demo
    assert summary["ok"] and summary["failures"] == [] and summary["run"] == "run1"
    assert (summary["rollouts"], summary["calls"], summary["rollouts_identical"]) == (3, 9, 3)
    assert summary["continuations_validated"] == 3  # every cut call continued from its staged prefix
    assert (summary["workers_lost"], summary["workers_rejoined"]) == (2, 2)
    assert summary["tokens_reused"] > 0 and summary["tokens_regenerated"] > 0
    assert summary["tokens_reused"] + summary["tokens_after_restore"] == 3 * 24
    assert summary["audit_ok"] and summary["exported_rows"] == 3
    assert summary["store"] == str(path) and Path(summary["export"]).is_file()
    code, out, _ = run(capsys, "audit", str(path), "--json")
    assert code == 0 and json.loads(out)["ok"]
    code, out, _ = run(capsys, "lineage", str(path), "run1-r0", "--json")
    calls = json.loads(out)["calls"]
    continued = [call for call in calls if call["resumes"] is not None]
    assert len(continued) == 1 and continued[0]["capture_key"] == "run1-r0-a1"
    assert continued[0]["resumes"]["checkpoint_id"] == "checkpoint-1"
    pids = {call["worker_pid"] for call in calls}
    assert len(pids) == 2 and None not in pids  # the dead worker and the fresh one
    # The dead attempt is retired: its cut call shows as retired, not still staging, and a
    # late write from it was tried and refused.
    assert (summary["attempts_retired"], summary["late_writes_refused"]) == (3, 1)
    cut = continued[0]["resumes"]["model_call_id"]
    dead = [call for call in calls if call["capture_key"] == "run1-r0"]
    assert {call["model_call_id"]: call["state"] for call in dead}[cut] == "retired"
    assert all(call["retired"] for call in dead) and not any(call["retired"] for call in continued)
    assert [call["state"] for call in dead if call["model_call_id"] != cut] == ["completed"] * (len(dead) - 1)
    code, out, _ = run(capsys, "lineage", str(path), "run1-r0")
    assert "retired: late writes refused" in out and " staging " not in out


def test_the_demo_runs_a_real_coordinator(demo: tuple[Path, dict[str, Any]], capsys: Any) -> None:
    """Workers register through WorkerClient; the coordinator logs them joining, lost (SIGKILL)
    and stopped, and its worker events in the store say which pid left which cut call in flight."""
    path, summary = demo
    log = summary["coordinator_log"]
    assert sum("joined as worker" in line for line in log) == 4
    assert sum("lost without notice" in line for line in log) == 2
    assert sum(line.startswith("Policy worker [") and " stopped " in line for line in log) == 2
    code, out, _ = run(capsys, "workers", str(path), "--json")
    shaped = json.loads(out)
    assert code == 0 and set(shaped) == {"store", "workers"} and shaped["store"] == str(path)
    found = shaped["workers"]
    assert set(found[0]) == {
        "pid", "index", "state", "expected", "join_seq", "left_seq", "blocked_checkpoint", "staged_calls",
        "in_flight_calls",
    }  # fmt: skip
    assert sorted(worker["state"] for worker in found) == ["lost", "lost", "stopped", "stopped"]
    for worker in found:
        assert f"Policy worker [{worker['pid']}]" in " ".join(log)
    cut_calls = set()
    for rollout in ("run1-r0", "run1-r1", "run1-r2"):
        code, out, _ = run(capsys, "lineage", str(path), rollout, "--json")
        for call in json.loads(out)["calls"]:
            if call["resumes"] is not None:
                cut_calls.add((call["resumes"]["capture_key"], call["resumes"]["model_call_id"]))
    lost = [worker for worker in found if worker["state"] == "lost"]
    lost_in_flight = {tuple(call) for worker in lost for call in worker["in_flight_calls"]}
    assert lost_in_flight == cut_calls and len(cut_calls) == 3  # the dead workers left exactly the cut calls
    assert all(worker["in_flight_calls"] == [] for worker in found if worker["state"] == "stopped")
    fresh_staged = {tuple(call) for worker in found if worker["state"] == "stopped" for call in worker["staged_calls"]}
    assert all(capture.endswith("-a1") for capture, _ in fresh_staged) and fresh_staged
    code, out, _ = run(capsys, "workers", str(path), "--lost", "--json")
    assert code == 0 and [worker["state"] for worker in json.loads(out)["workers"]] == ["lost", "lost"]
    code, out, _ = run(capsys, "workers", str(path))
    assert code == 0 and "4 policy worker(s)" in out and "lost" in out


def test_a_second_demo_run_adds_to_the_store(copy: Path, capsys: Any) -> None:
    small = ["--rollouts", "1", "--workers", "1", "--tokens", "8"]
    code, out, _ = run(capsys, "demo", "--path", str(copy), *small, "--json")
    assert code == 0, out
    assert json.loads(out)["ok"]
    summary = json.loads(out)
    code, out, _ = run(capsys, "rollouts", str(copy), "--json")
    ids = [rollout["rollout_id"] for rollout in json.loads(out)["rollouts"]]
    assert ids == ["run1-r0", "run1-r1", "run1-r2", "run2-r0"]
    # The export beside the store holds every rollout of it, not only this run's.
    exported = [json.loads(line)["rollout_id"] for line in Path(summary["export"]).read_text().splitlines()]
    assert exported == ids and (summary["exported_rollouts"], summary["exported_rows"]) == (4, 4)


def test_the_demo_exits_1_when_a_check_does_not_verify(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The coordinator's expectation of one rollout is off by a token: the demo must say so and fail."""
    from store.demo.engine import ToyEngine

    honest = ToyEngine.expected

    def off_by_one(self: ToyEngine, rollout: int) -> tuple[list[int], list[float], list[float]]:
        ids, mask, logprobs = honest(self, rollout)
        return ([ids[0] + 1, *ids[1:]] if rollout == 0 else ids), mask, logprobs

    monkeypatch.setattr(ToyEngine, "expected", off_by_one)  # this process only: the workers stay honest
    small = ["--rollouts", "2", "--workers", "1", "--tokens", "8"]
    code, out, _ = run(capsys, "demo", "--path", str(tmp_path / "d.db"), *small, "--json")
    summary = json.loads(out)
    assert code == 1 and not summary["ok"]
    assert summary["failures"] == ["run1-r0: exported tokens differ from an uninterrupted run"]
    assert summary["audit_ok"] and summary["rollouts_identical"] == 1


@pytest.mark.parametrize(
    "option", [["--rollouts", "0"], ["--workers", "9"], ["--tokens", "7"], ["--seed", "-1"], ["--rollouts", "x"]]
)
def test_demo_options_are_validated(option: list[str], tmp_path: Path, capsys: Any) -> None:
    code, _, err = run(capsys, "demo", "--path", str(tmp_path / "d.db"), *option)
    assert code == 2 and "Invalid value" in err and "Traceback" not in err
    assert os.listdir(tmp_path) == []


# --- JSON shapes and output -------------------------------------------------------------------------


def test_json_shapes(demo: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: Any) -> None:
    store = str(demo[0])

    def shape(*args: str) -> Any:
        code, out, _ = run(capsys, *args, "--json")
        assert code == 0, out
        return json.loads(out)

    audit = shape("audit", store)
    assert set(audit) == {"store", "ok", "counts", "problems_total", "problems"}
    assert audit["counts"]["continuations"] == 3
    replay = shape("replay", store)
    assert set(replay) == {"store", "ok", "events", "repaired", "differences_total", "differences", "undecodable"}
    rollouts = shape("rollouts", store)["rollouts"]
    assert set(rollouts[0]) == {"rollout_id", "attempts", "calls", "completed", "failed", "fenced"}
    assert rollouts[0]["attempts"] == ["run1-r0", "run1-r0-a1"]
    assert rollouts[0]["fenced"] == ["run1-r0"]  # the demo retired the dead attempt
    lineage = shape("lineage", store, "run1-r0")
    assert set(lineage) == {"rollout_id", "attempts", "calls"}
    assert set(lineage["calls"][0]) == {
        "capture_key", "attempt", "model_call_id", "parent_call_id", "state", "mode", "prev_len", "cum_len",
        "generated_tokens", "admitted_version", "oldest_version", "newest_version", "version_spans",
        "admitted_at", "worker_pid", "resumes", "resumed_by", "retired",
    }  # fmt: skip
    keys = shape("keys", store, "--rollout", "run1-r0")["keys"]
    assert set(keys[0]) == {"staging_key", "rollout_id", "model_call_id", "event_seq", "kind", "digest"}
    assert {key["kind"] for key in keys} >= {"call_completed", "prefix_staged"}  # the cut's prefix too
    shown = shape("show", store, "run1-r0/c0", "--tokens")
    assert set(shown) == {"key", "record", "call"}
    assert len(shown["record"]["token_ids"]) == shown["record"]["delta_len"]
    assert shown["call"]["state"] == "completed"
    versions = shape("versions", store, "--stale", "2", "--max-lag", "0")
    assert set(versions) == {"tokens_by_version", "rollouts", "stale"}
    assert set(versions["tokens_by_version"]) == {"1", "2"}
    assert versions["stale"]["stale_tokens"] == int(versions["tokens_by_version"]["1"])
    target = tmp_path / "rows.jsonl"
    export = shape("export", store, "-o", str(target))
    assert set(export) == {"store", "output", "ok", "rollouts", "rows", "failures"}
    rows = [json.loads(line) for line in target.read_text().splitlines()]
    assert len(rows) == export["rows"] == 3 and rows[0]["rollout_id"] == "run1-r0"


def test_human_output(demo: tuple[Path, dict[str, Any]], capsys: Any) -> None:
    store = str(demo[0])
    code, out, _ = run(capsys, "audit", store)
    assert code == 0 and "audit ok" in out
    code, out, _ = run(capsys, "lineage", store, "run1-r0")
    assert code == 0 and "continues run1-r0/c" in out and "attempt 1: run1-r0-a1" in out
    code, out, err = run(capsys, "export", store, "--rollout", "run1-r1")
    assert code == 0 and json.loads(out.splitlines()[0])["rollout_id"] == "run1-r1"
    assert "exported 1 row(s) of 1 rollout(s)" in err  # the lines own stdout; the summary goes to stderr


def test_the_store_may_come_from_the_environment(
    demo: tuple[Path, dict[str, Any]], capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STAGING_STORE", str(demo[0]))
    code, out, _ = run(capsys, "lineage", "run1-r1", "--json")
    assert code == 0 and json.loads(out)["rollout_id"] == "run1-r1"
    code, out, _ = run(capsys, "rollouts", "--json")
    assert code == 0 and len(json.loads(out)["rollouts"]) == 3


# --- exit codes ------------------------------------------------------------------------------------


def test_exit_codes(demo: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: Any, monkeypatch: Any) -> None:
    store = str(demo[0])
    monkeypatch.delenv("STAGING_STORE", raising=False)
    code, _, err = run(capsys, "show", store, "run1-r0/c9")
    assert code == 1
    assert_one_line_error(err)
    code, _, err = run(capsys, "lineage", store, "nope")
    assert code == 1
    assert_one_line_error(err)
    code, _, err = run(capsys, "audit")
    assert code == 2 and "STAGING_STORE" in err
    code, _, err = run(capsys, "audit", store, "--bogus")
    assert code == 2 and "No such option" in err
    code, _, err = run(capsys, "versions", store, "--stale", "-1")
    assert code == 2
    code, _, err = run(capsys, "nonsense")
    assert code == 2
    code, _, err = run(capsys, "audit", str(tmp_path / "typo.db"))
    assert code == 3 and "typo.db" in err
    assert_one_line_error(err)


def test_an_unreachable_postgresql_server_is_one_line_without_the_drivers_text(capsys: Any) -> None:
    """The store's error quotes the driver's two-line "connection refused" joined into one
    line; the CLI still drops that quote and says what happened in the store's words."""
    pytest.importorskip("psycopg", reason="the [postgres] extra is not installed")
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code, _, err = run(capsys, "audit", f"postgresql://postgres@127.0.0.1:{port}/test")
    assert code == 3
    assert_one_line_error(err)
    assert "could not be reached" in err
    # The driver's own words are not shown; the reason is, in the store's words (issue 34), and no type name.
    assert "accepting TCP/IP" not in err and "Is the server running" not in err and "Error)" not in err, err
    assert err.rstrip().endswith("connection refused: is the server running on that host and port?"), err


def test_damage_is_problems_found(copy: Path, capsys: Any) -> None:
    with sqlite3.connect(copy) as connection:
        seq, ids = connection.execute(
            "SELECT e.seq, e.token_ids FROM events e JOIN staged_keys k ON k.event_seq = e.seq "
            "WHERE k.staging_key = 'run1-r0/c0'"
        ).fetchone()
        damaged = bytes(ids[:-1]) + bytes([ids[-1] ^ 1])
        connection.execute("UPDATE events SET token_ids = ? WHERE seq = ?", (damaged, seq))
    connection.close()
    code, out, _ = run(capsys, "audit", str(copy), "--json")
    report = json.loads(out)
    assert code == 1 and not report["ok"] and report["problems"][0]["seq"] == seq
    assert report["problems"][0]["code"] == "checksum"
    code, out, _ = run(capsys, "replay", str(copy), "--json")
    assert code == 1 and json.loads(out)["undecodable"][0]["seq"] == seq
    code, _, err = run(capsys, "show", str(copy), "run1-r0/c0")
    assert code == 3
    assert_one_line_error(err)
    code, out, _ = run(capsys, "export", str(copy), "--json", "-o", os.devnull)
    assert code == 1 and json.loads(out)["failures"][0]["code"] == "corrupt_record"


def test_replay_repair_is_the_write_command(copy: Path, capsys: Any) -> None:
    with sqlite3.connect(copy) as connection:
        connection.execute("DELETE FROM calls WHERE rollout_id = 'run1-r1' AND model_call_id = 'c0'")
    connection.close()
    before = folder_state(copy.parent)
    code, out, _ = run(capsys, "replay", str(copy), "--json")
    assert code == 1 and json.loads(out)["differences_total"] == 1
    assert folder_state(copy.parent) == before  # without --repair nothing changes
    code, out, _ = run(capsys, "replay", str(copy), "--repair", "--json")
    assert code == 0 and json.loads(out)["repaired"]
    code, out, _ = run(capsys, "replay", str(copy))
    assert code == 0 and "every projection matches the log" in out


def test_migrate(copy: Path, tmp_path: Path, capsys: Any) -> None:
    code, out, _ = run(capsys, "migrate", str(copy), "--json")
    assert code == 0 and json.loads(out) == {
        "store": str(copy), "from_revision": SCHEMA_REVISION, "to_revision": SCHEMA_REVISION, "changed": False,
    }  # fmt: skip
    new = tmp_path / "new.db"
    code, _, err = run(capsys, "migrate", str(new))
    assert code == 3 and "--create" in err and not new.exists()
    code, out, _ = run(capsys, "migrate", str(new), "--create", "--json")
    assert code == 0 and json.loads(out)["from_revision"] is None
    code, _, _ = run(capsys, "audit", str(new))
    assert code == 0
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    with sqlite3.connect(theirs / "notes.db") as connection:
        connection.execute("CREATE TABLE notes (body TEXT)")
    connection.close()
    before = folder_state(theirs)
    code, _, err = run(capsys, "migrate", str(theirs / "notes.db"))
    assert code == 3 and "not a store" in err
    assert folder_state(theirs) == before
    with sqlite3.connect(copy) as connection:
        connection.execute("UPDATE alembic_version SET version_num = '9999'")
    connection.close()
    before = folder_state(copy.parent)
    for args in (["migrate", str(copy)], ["audit", str(copy)]):
        code, _, err = run(capsys, *args)
        assert code == 3 and "newer" in err
        assert_one_line_error(err)
    assert folder_state(copy.parent) == before


# --- read commands never change a byte ------------------------------------------------------------


def _target(kind: str, folder: Path, demo_path: Path) -> Path:
    path = folder / "target.db"
    if kind == "text":
        path.write_text("these are my notes\n" * 50)
    elif kind == "sqlite":
        with sqlite3.connect(path) as connection:
            connection.execute("CREATE TABLE notes (body TEXT)")
            connection.execute("INSERT INTO notes VALUES ('mine')")
        connection.close()
    elif kind in ("store", "corrupted"):
        shutil.copyfile(demo_path, path)
        if kind == "corrupted":  # random bytes in the middle of the file
            data = bytearray(path.read_bytes())
            for offset in range(len(data) // 3, len(data) // 3 + 4096, 97):
                data[offset] ^= 0x5A
            path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("kind", ["missing", "text", "sqlite", "corrupted", "store"])
def test_read_commands_leave_every_byte_unchanged(
    kind: str, demo: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: Any
) -> None:
    folder = tmp_path / "target"
    folder.mkdir()
    path = _target(kind, folder, demo[0])
    before = folder_state(folder)
    for command in READ_COMMANDS:
        code, out, err = run(capsys, *command_args(command, str(path)))
        assert "Traceback" not in out + err, (command, err)
        assert folder_state(folder) == before, command
        if kind in ("missing", "text", "sqlite"):
            assert code == 3, (command, code, err)
            assert_one_line_error(err)
        elif kind == "store":
            assert code == 0, (command, err)
        else:
            assert code in (0, 1, 3), (command, code, err)
            if code == 3:
                assert_one_line_error(err)
    if kind == "corrupted":
        code, _, _ = run(capsys, "audit", str(path))
        assert code != 0  # the damage is found, whatever form it takes


def test_read_commands_on_any_backend(store_url: str, capsys: Any) -> None:
    """The same commands on SQLite and PostgreSQL (a store made through the library)."""
    from factories import make_record

    from store import open_store

    with open_store(store_url) as made:
        assert made.stage(make_record(rollout_id="r0", model_call_id="c0")).ok
    code, out, _ = run(capsys, "audit", store_url, "--json")
    assert code == 0 and json.loads(out)["ok"]
    code, out, _ = run(capsys, "keys", store_url, "--json")
    assert code == 0 and [key["staging_key"] for key in json.loads(out)["keys"]] == ["r0/c0"]
    code, out, _ = run(capsys, "replay", store_url, "--repair", "--json")
    assert code == 0 and json.loads(out)["ok"]
    code, _, _ = run(capsys, "migrate", store_url)
    assert code == 0
    if store_url.startswith("postgresql"):
        missing = store_url.rsplit("/", 1)[0] + "/no_such_database_here"
        code, _, err = run(capsys, "audit", missing)
        assert code == 3 and "does not exist" in err and "FATAL" not in err
        assert_one_line_error(err)


def test_a_progress_bar_only_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    from store.cli import output

    with output.progress_bar("quiet") as progress:
        assert progress is None  # stderr is not a terminal under pytest
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with output.progress_bar("drawn") as progress:
        assert progress is not None
        progress(0, 2)
        progress(2, 2)


def test_the_demo_refuses_a_file_that_is_not_a_store(tmp_path: Path, capsys: Any) -> None:
    notes = tmp_path / "notes.db"
    notes.write_text("mine\n")
    before = folder_state(tmp_path)
    code, _, err = run(capsys, "demo", "--path", str(notes))
    assert code == 3 and "not a store" in err
    assert folder_state(tmp_path) == before


# --- help, version, speed ---------------------------------------------------------------------------


def test_every_command_has_help_with_a_description_defaults_and_an_example() -> None:
    runner = CliRunner()
    for command in COMMANDS:
        result = runner.invoke(cli, [command, "--help"])
        assert result.exit_code == 0, command
        text = result.output
        assert "Example" in text, command
        description = text.split("\n\n")[1].strip()
        assert len(description) > 20, command
    assert "default: 8" in runner.invoke(cli, ["demo", "--help"]).output
    top = runner.invoke(cli, ["--help"]).output
    for command in COMMANDS:
        assert command in top
    assert "Exit codes" in top


def test_version(capsys: Any) -> None:
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.startswith("staging-store 0.")


def test_help_imports_no_database_code() -> None:
    """--help answers without importing SQLAlchemy, numpy or the store's modules (checked, not timed)."""
    probe = (
        "import sys\n"
        "from store.cli import main\n"
        "for args in (['--help'], ['audit', '--help'], ['demo', '--help'], ['--version']):\n"
        "    assert main(args) == 0\n"
        "heavy = [m for m in ('sqlalchemy', 'numpy', 'store.store', 'msgspec') if m in sys.modules]\n"
        "print('HEAVY', heavy, file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "HEAVY []" in done.stderr


# --- the installed script: pipes and signals ----------------------------------------------------------


def test_the_installed_script_runs_a_read_command(demo: tuple[Path, dict[str, Any]]) -> None:
    done = script("versions", str(demo[0]), "--json")
    assert done.returncode == 0 and set(json.loads(done.stdout)) == {"tokens_by_version", "rollouts", "stale"}
    done = script("audit", str(demo[0].with_name("typo.db")))
    assert done.returncode == 3
    assert_one_line_error(done.stderr)


@pytest.fixture
def no_stray_workers(tmp_path: Path) -> Iterator[None]:
    yield
    # The demo's workers are children of the demo; none must outlive an interrupted demo.  Only
    # this test's workers count (their command line names its store), not other runs' demos.
    assert _workers_of(tmp_path) == []


def _workers_of(tmp_path: Path) -> list[str]:
    # -ww: whole command lines (without it ps cuts them to $COLUMNS, and with them the path)
    listed = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True, check=False).stdout
    return [line for line in listed.splitlines() if "store.demo.worker" in line and str(tmp_path) in line]


HARNESS = Path(__file__).with_name("interrupt_harness.py")
BIG_DEMO = ["--rollouts", "64", "--workers", "2", "--tokens", "4096"]  # seconds of serving, even on a fast machine
# The installed script, started with SIGINT at its default (Python's KeyboardInterrupt), as a
# terminal's foreground job has it: a test run in the background of a non-interactive shell
# inherits SIGINT ignored, and so would the script (Python keeps an inherited SIG_IGN).
AS_IN_A_TERMINAL = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
)


def test_ctrl_c_ends_the_demo_quietly(tmp_path: Path, no_stray_workers: None) -> None:
    """The installed script: Ctrl-C once its worker processes are serving (the sign: they exist)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", AS_IN_A_TERMINAL, str(SCRIPT), "demo", "--path", str(tmp_path / "d.db"), *BIG_DEMO],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not _workers_of(tmp_path) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the demo ended before its workers were seen"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err and out == ""


def _interrupted_in(phase: str, arguments: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``staging-store ARGUMENTS`` held in PHASE (tests/interrupt_harness.py), Ctrl-C it there."""
    sign_read, sign_write = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, str(HARNESS), phase, str(sign_write), *arguments],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        pass_fds=[sign_write],
    )
    os.close(sign_write)
    with os.fdopen(sign_read) as sign:
        reached = sign.readline().strip()  # blocks until the phase is reached (or the child ends)
    if reached != phase:
        proc.kill()
        out, err = proc.communicate(timeout=60)
        raise AssertionError(f"the command never reached {phase!r} (exit {proc.returncode}):\n{out}{err}")
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # the harness prints every thread's stack
        time.sleep(1)
        proc.kill()
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"still running 60 s after Ctrl-C in {phase!r}; its threads:\n{err}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("phase", ["start-up", "spawning", "serving", "respawning", "audit", "export"])
def test_ctrl_c_ends_the_demo_in_every_phase(phase: str, tmp_path: Path, no_stray_workers: None) -> None:
    """Exit 130, nothing on stdout, no traceback, no worker left, and no half-written export."""
    store = tmp_path / "d.db"
    workers = "2" if phase in ("spawning", "respawning") else "1"  # two: held between the first and the second
    demo = ["demo", "--path", str(store), "--rollouts", "2", "--workers", workers, "--tokens", "16"]
    done = _interrupted_in(phase, demo, tmp_path)
    assert done.returncode == 130, (done.stdout, done.stderr)
    assert done.stdout == "" and "Traceback" not in done.stderr, done.stderr
    assert sorted(path.name for path in tmp_path.iterdir() if "jsonl" in path.name) == []  # no partial file
    if phase == "start-up":
        assert not store.exists()  # interrupted before it opened anything


@pytest.mark.parametrize(("phase", "command"), [("audit", "audit"), ("export", "export")])
def test_ctrl_c_ends_a_long_read_command(
    phase: str, command: str, demo: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """An interrupted export leaves FILE as it was (here: its earlier content) and no temporary file."""
    target = tmp_path / "rows.jsonl"
    target.write_text("an earlier export\n")
    arguments = [command, str(demo[0]), *(["-o", str(target)] if command == "export" else [])]
    done = _interrupted_in(phase, arguments, tmp_path)
    assert done.returncode == 130 and done.stdout == "" and "Traceback" not in done.stderr, done.stderr
    assert target.read_text() == "an earlier export\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["rows.jsonl"]


def test_errors_keep_the_driver_text_out() -> None:
    from store.cli.exits import one_line
    from store.log.engine import storage_error

    try:
        try:
            raise sqlite3.DatabaseError("database disk image is malformed\nhttps://sqlalche.me/e/20/4xp6")
        except sqlite3.DatabaseError as driver:
            raise storage_error("reading calls", driver) from driver
    except Exception as exc:
        message = one_line(exc)
    assert message == "reading calls failed: DatabaseError (the database file is damaged)"


# --- the write commands: retire, forget, delete, compact -------------------------------------------

REMOVAL_SHAPE = {"command", "store", "requested", "batches", "removed", "absent"}


def _late_write(store: str, rollout_id: str) -> None:
    """A new record for ``rollout_id``: raises ``RolloutFencedError`` while it is retired."""
    from factories import make_record

    from store import open_store

    with open_store(store) as opened:
        assert opened.stage(make_record(rollout_id=rollout_id, model_call_id="late")).ok


def test_retire_forget_delete_compact(copy: Path, tmp_path: Path, capsys: Any) -> None:
    from store.errors import RolloutFencedError

    store = str(copy)

    def events() -> int:
        code, out, _ = run(capsys, "replay", store, "--json")
        assert code == 0
        return int(json.loads(out)["events"])

    fresh = "run1-r1-a1"  # the demo retired attempt 0 (run1-r1); the fresh attempt is live
    code, out, _ = run(capsys, "retire", store, fresh, "never-staged", "--json")
    retired = json.loads(out)
    assert code == 0 and set(retired) == REMOVAL_SHAPE
    assert (retired["removed"], retired["absent"], retired["requested"]) == ([fresh], ["never-staged"], 2)
    for key in (fresh, "never-staged"):  # a fence guards a key that held nothing too
        with pytest.raises(RolloutFencedError):
            _late_write(store, key)
    code, out, _ = run(capsys, "show", store, f"{fresh}/c2", "--json")
    assert code == 0 and json.loads(out)["record"] is not None  # retired records stay readable
    written = events()
    code, out, _ = run(capsys, "retire", store, fresh, "--json")
    assert code == 0 and json.loads(out)["removed"] == [fresh]
    assert events() == written  # retiring again writes nothing
    code, out, _ = run(capsys, "forget", store, fresh, "run1-r2-a1", "--json")
    forgotten = json.loads(out)
    assert code == 1 and set(forgotten) == REMOVAL_SHAPE  # run1-r2-a1 had no fence: exit 1, listed absent
    assert (forgotten["removed"], forgotten["absent"]) == ([fresh], ["run1-r2-a1"])
    _late_write(store, fresh)  # the fence is gone

    listing = tmp_path / "done.txt"
    listing.write_text("run1-r2\nrun1-r2-a1\n\n")
    code, out, err = run(capsys, "delete", store, "--from-file", str(listing), "--json")
    deleted = json.loads(out)
    assert code == 0 and set(deleted) == REMOVAL_SHAPE, err
    assert deleted["removed"] == ["run1-r2", "run1-r2-a1"] and deleted["absent"] == []
    code, out, err = run(capsys, "keys", store, "--rollout", "run1-r2", "--json")
    assert (code, out) == (1, "") and "no rollout 'run1-r2'" in err  # every key gone: the rollout is unknown
    code, _, err = run(capsys, "lineage", store, "run1-r2")
    assert code == 1
    code, out, _ = run(capsys, "delete", store, "run1-r2")
    assert code == 1 and "0 capture key(s) deleted, 1 absent" in out
    code, out, _ = run(capsys, "compact", store, "--json")
    compacted = json.loads(out)
    assert code == 0 and set(compacted) == {"store", "backend", "bytes_before", "bytes_after", "reclaimed", "converted"}
    assert compacted["backend"] == "sqlite" and compacted["bytes_after"] <= compacted["bytes_before"]
    assert compacted["reclaimed"] == compacted["bytes_before"] - compacted["bytes_after"]
    wal = Path(f"{copy}-wal")
    assert os.path.getsize(copy) + (os.path.getsize(wal) if wal.exists() else 0) == compacted["bytes_after"]
    code, out, _ = run(capsys, "audit", store, "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"], report["problems"]  # the tombstones explain the gap


def test_write_commands_human_output(copy: Path, capsys: Any) -> None:
    code, out, _ = run(capsys, "retire", str(copy), "run1-r0", "ghost")
    assert code == 0 and "retire: 1 capture key(s) retired, 1 absent" in out and "ghost" in out
    code, out, _ = run(capsys, "compact", str(copy))
    assert code == 0 and "reclaimed" in out and str(copy) in out


def test_keys_from_stdin_are_batched(copy: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """More keys than the store takes in one call (4,096) are sent in batches; stdin is '-'."""
    import io

    keys = [f"ghost-{number}" for number in range(5000)]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(keys) + "\n"))
    code, out, _ = run(capsys, "retire", str(copy), "--from-file", "-", "--json")
    shaped = json.loads(out)
    assert code == 0 and shaped["batches"] == 2 and shaped["requested"] == 5000
    assert shaped["absent"] == keys and shaped["removed"] == []
    code, out, _ = run(capsys, "delete", str(copy), "run1-r0", *keys[:300], "--json")
    shaped = json.loads(out)  # delete: batches of 256; fenced keys count as something to delete
    assert code == 0 and shaped["batches"] == 2 and len(shaped["removed"]) == 301


def test_the_store_of_a_write_command_may_come_from_the_environment(
    copy: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STAGING_STORE", str(copy))
    code, out, _ = run(capsys, "retire", "run1-r0", "run1-r1", "--json")
    shaped = json.loads(out)
    assert code == 0 and shaped["store"] == str(copy) and shaped["removed"] == ["run1-r0", "run1-r1"]
    code, out, _ = run(capsys, "forget", str(copy), "run1-r0", "--json")  # a path is still the store
    assert code == 0 and json.loads(out)["removed"] == ["run1-r0"]


def test_delete_draws_progress_on_a_terminal(copy: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from contextlib import contextmanager

    from store.cli import output

    calls: list[tuple[int, int]] = []

    @contextmanager
    def recording(label: str) -> Iterator[output.Progress]:
        assert label == "deleting"
        yield lambda done, total: calls.append((done, total))

    monkeypatch.setattr(output, "progress_bar", recording)
    code, _, _ = run(capsys, "delete", str(copy), "run1-r0", "run1-r1", "--json")
    assert code == 0 and calls == [(0, 2), (2, 2)]


@pytest.mark.parametrize(
    "case",
    ["no-keys", "duplicate", "empty-key", "padded-key", "blank-line", "unreadable-file", "duplicate-across-file"],
)
def test_bad_keys_are_refused_and_nothing_is_written(case: str, copy: Path, tmp_path: Path, capsys: Any) -> None:
    listing = tmp_path / "keys.txt"
    listing.write_text({"blank-line": "run1-r0\n   \nrun1-r1\n", "duplicate-across-file": "run1-r1\n"}.get(case, ""))
    args = {
        "no-keys": [],
        "duplicate": ["run1-r0", "run1-r0"],
        "empty-key": ["run1-r0", ""],
        "padded-key": [" run1-r0"],
        "blank-line": ["--from-file", str(listing)],
        "unreadable-file": ["--from-file", str(tmp_path / "no-such-list.txt")],
        "duplicate-across-file": ["run1-r1", "--from-file", str(listing)],
    }[case]
    before = folder_state(copy.parent)
    for command in ("retire", "forget", "delete"):
        code, out, err = run(capsys, command, str(copy), *args)
        assert code == 2 and out == "" and "Traceback" not in err, (command, err)
        assert folder_state(copy.parent) == before, command
    code, out, err = run(capsys, "retire", str(copy), *args, "--json")
    assert code == 2 and out == ""
    expected = {
        "no-keys": "no capture keys given",
        "duplicate": "more than once",
        "empty-key": "empty",
        "padded-key": "whitespace",
        "blank-line": "only whitespace",
        "unreadable-file": "cannot read capture keys",
        "duplicate-across-file": "more than once",
    }[case]
    assert expected in err, err


@pytest.mark.parametrize("kind", ["missing", "text", "sqlite"])
def test_write_commands_never_create_or_touch_what_is_not_a_store(
    kind: str, demo: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: Any
) -> None:
    folder = tmp_path / "target"
    folder.mkdir()
    path = _target(kind, folder, demo[0])
    before = folder_state(folder)
    for args in (["retire", "k"], ["forget", "k"], ["delete", "k"], ["compact"]):
        code, out, err = run(capsys, args[0], str(path), *args[1:])
        assert code == 3 and out == "", (args, err)
        assert_one_line_error(err)
        assert folder_state(folder) == before, args
    assert not path.exists() if kind == "missing" else path.exists()


def test_write_commands_on_any_backend(store_url: str, capsys: Any) -> None:
    from factories import make_record

    from store import open_store
    from store.errors import RolloutFencedError

    with open_store(store_url) as made:
        assert made.stage(make_record(rollout_id="r0", model_call_id="c0")).ok
    code, out, _ = run(capsys, "retire", store_url, "r0", "--json")
    assert code == 0 and json.loads(out)["removed"] == ["r0"]
    with pytest.raises(RolloutFencedError):
        _late_write(store_url, "r0")
    code, out, _ = run(capsys, "delete", store_url, "r0", "--json")
    assert code == 0 and json.loads(out)["removed"] == ["r0"]
    code, out, _ = run(capsys, "compact", store_url, "--json")
    assert code == 0 and json.loads(out)["backend"] == ("sqlite" if "://" not in store_url else "postgresql")
    code, out, _ = run(capsys, "audit", store_url, "--json")
    assert code == 0 and json.loads(out)["counts"]
    if store_url.startswith("postgresql"):
        missing = store_url.rsplit("/", 1)[0] + "/no_such_database_here"
        code, _, err = run(capsys, "retire", missing, "r0")
        assert code == 3 and "does not exist" in err
        assert_one_line_error(err)


# --- ship: a store's log into another store --------------------------------------------------------

SHIP_SHAPE = {
    "source", "target", "ok", "source_store_id", "target_store_id", "read", "appended", "present", "last_seq",
    "remaining", "stopped", "problems",
}  # fmt: skip


def _events(capsys: Any, store: str) -> int:
    code, out, _ = run(capsys, "replay", store, "--json")
    assert code == 0
    return int(json.loads(out)["events"])


def test_ship_copies_the_log_into_another_store(
    copy: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from contextlib import contextmanager

    from store.cli import output

    source_before = folder_state(copy.parent)
    target = tmp_path / "shared" / "target.db"
    target.parent.mkdir()
    code, _, err = run(capsys, "ship", str(copy), str(target))
    assert code == 3 and "never create" in err and not target.exists()  # a write command creates nothing
    assert_one_line_error(err)
    assert run(capsys, "migrate", str(target), "--create")[0] == 0
    calls: list[tuple[int, int]] = []

    @contextmanager
    def recording(label: str) -> Iterator[output.Progress]:
        assert label == "shipping"
        yield lambda done, total: calls.append((done, total))

    monkeypatch.setattr(output, "progress_bar", recording)
    code, out, err = run(capsys, "ship", str(copy), str(target), "--json")
    monkeypatch.undo()
    report = json.loads(out)
    assert code == 0 and set(report) == SHIP_SHAPE and report["ok"] and report["problems"] == [], err
    events = _events(capsys, str(copy))
    assert (report["read"], report["appended"], report["present"], report["last_seq"]) == (events, events, 0, events)
    assert report["source_store_id"] != report["target_store_id"]
    assert calls and calls[-1] == (events, events)
    assert folder_state(copy.parent) == source_before  # the source is only read
    code, out, _ = run(capsys, "ship", str(copy), str(target), "--json")
    again = json.loads(out)
    assert code == 0 and again["ok"] and again["appended"] == 0  # idempotent: nothing new to send
    # The target reads like the source (the shipping process, not the workers, wrote its
    # events there, so writer pids, and with them lineage's worker_pid, are the ship's own).
    for args in (["lineage", "{}", "run1-r0", "--json"], ["rollouts", "{}", "--json"]):
        shown = [json.loads(run(capsys, *[a.format(p) for a in args])[1]) for p in (copy, target)]
        for side in shown:
            for call in side.get("calls", []):
                call.pop("worker_pid")
        assert shown[0] == shown[1], args
    workers = [json.loads(run(capsys, "workers", str(p), "--json")[1])["workers"] for p in (copy, target)]
    assert [(w["pid"], w["state"]) for w in workers[0]] == [(w["pid"], w["state"]) for w in workers[1]]
    code, out, err = run(capsys, "audit", str(target), "--json")
    assert code == 0 and json.loads(out)["ok"], err
    code, out, _ = run(capsys, "ship", str(copy), str(target))
    assert code == 0 and "0 appended" in out


def test_ship_stops_at_a_conflict_and_exits_1(copy: Path, tmp_path: Path, capsys: Any) -> None:
    from factories import make_record

    from store import open_store

    target = tmp_path / "theirs.db"
    with open_store(target) as theirs:  # another record under a key the source uses
        assert theirs.stage(make_record(rollout_id="run1-r0", model_call_id="c0")).ok
    code, out, _ = run(capsys, "ship", str(copy), str(target), "--json")
    report = json.loads(out)
    assert code == 1 and not report["ok"] and report["problems"][0]["code"] == "conflict"
    assert report["problems"][0]["staging_key"] == "run1-r0/c0"
    code, out, _ = run(capsys, "ship", str(copy), str(target))
    assert code == 1 and "conflict" in out


def test_ship_into_any_backend(copy: Path, store_url: str, capsys: Any) -> None:
    from store import open_store

    open_store(store_url).close()  # an empty store on this backend
    code, out, err = run(capsys, "ship", str(copy), store_url, "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] and report["appended"] == _events(capsys, str(copy)), err
    code, out, _ = run(capsys, "audit", store_url, "--json")
    assert code == 0 and json.loads(out)["ok"]
    code, out, _ = run(capsys, "rollouts", store_url, "--json")
    assert [rollout["rollout_id"] for rollout in json.loads(out)["rollouts"]] == ["run1-r0", "run1-r1", "run1-r2"]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["audit", "--bogus", "x.db"], "staging-store audit --help"),
        (["nosuch"], "staging-store --help"),
        (["demo", "--rollouts", "0"], "staging-store demo --help"),
        (["lineage"], "staging-store lineage --help"),
    ],
)
def test_bad_usage_is_one_line_naming_the_help_and_exits_2(
    args: list[str], named: str, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STAGING_STORE", raising=False)
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, *args)
    assert code == 2 and out == ""
    assert_one_line_error(err)
    assert f"(see '{named}')" in err
    assert list(tmp_path.iterdir()) == []  # nothing was created


def test_commands_reach_a_postgresql_schema_named_in_the_url(copy: Path, capsys: Any, request: Any) -> None:
    """A schema is a URL option (``?schema=NAME``), so every command can use one."""
    if os.environ.get("STORE_TEST_POSTGRES_URL") is None:
        pytest.skip("STORE_TEST_POSTGRES_URL is not set")
    from conftest import reset_postgres

    database = request.getfixturevalue("postgres_run_url")
    reset_postgres(database)
    url = f"{database}?schema=fleet"
    code, out, err = run(capsys, "migrate", url, "--create", "--json")  # the schema does not exist yet
    migrated = json.loads(out)
    assert code == 0 and migrated["from_revision"] is None and migrated["store"].endswith("?schema=fleet"), err
    code, out, err = run(capsys, "ship", str(copy), url, "--json")
    assert code == 0 and json.loads(out)["appended"] == _events(capsys, str(copy)), err
    code, out, _ = run(capsys, "rollouts", url, "--json")
    assert [rollout["rollout_id"] for rollout in json.loads(out)["rollouts"]] == ["run1-r0", "run1-r1", "run1-r2"]
    code, _, err = run(capsys, "rollouts", database, "--json")
    assert code == 3 and "is not a store" in err, err  # the public schema holds no store


def test_the_entry_point_stays_a_function_whatever_was_imported_first() -> None:
    """The installed script runs ``store.cli:main``; importing every submodule of the command
    line first (a test, a plugin) must not replace it on the package."""
    import importlib
    import pkgutil

    import store.cli

    for module in pkgutil.iter_modules(store.cli.__path__):
        importlib.import_module(f"store.cli.{module.name}")
    from store.cli import main as entry

    assert callable(entry) and entry.__module__ == "store.cli"


def test_receipts_of_a_rollout_whose_id_looks_like_an_attempt_key(tmp_path: Path, capsys: Any) -> None:
    """Issue 33 item 13: ``--rollout job-a7`` of a rollout named "job-a7" (no "job" in the store)
    was cut to "job" and refused as "no rollout 'job'" (exit 1)."""
    from factories import make_record

    from store import open_store

    path = str(tmp_path / "store.db")
    with open_store(path) as opened:
        assert opened.stage(make_record(rollout_id="job-a7", model_call_id="c0")).ok
    code, out, err = run(capsys, "receipts", path, "--rollout", "job-a7")
    assert (code, err) == (0, ""), err
    assert out.startswith("0 receipt(s), 0 acknowledgement(s)")
    code, _, err = run(capsys, "receipts", path, "--rollout", "job-a8")  # neither a rollout nor an attempt of one
    assert code == 1 and "no rollout 'job-a8'" in err, err
