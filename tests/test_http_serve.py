"""Over a real socket on loopback with a real HTTP client: a worker process serving cuts of live
calls (also concurrently), refusals, the ledger client; then the worker is SIGKILLed and
``staging-store serve`` on the same store answers the same inventory with the identical receipt."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from http_helpers import TOKEN, inventory  # noqa: E402

from store import ControlClient, GenerationCutReceipt, RolloutRemoval, from_json, open_store, to_json  # noqa: E402

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
CUT = "/ng-control/v1/generation-cut"
CALLS, TOKENS = 4, 8


def _env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(REPO), str(TESTS), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(paths).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@contextmanager
def _process(args: list[str], ready_prefix: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """Start a server process and yield it with its first stdout line (its address)."""
    proc = subprocess.Popen(args, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()  # the server prints its address once it listens
        if not line.startswith(ready_prefix):
            proc.kill()
            _, err = proc.communicate(timeout=30)
            pytest.fail(f"server did not start ({line!r}):\n{err}")
        yield proc, line
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def test_cut_over_loopback_survives_a_worker_kill_and_serve_replays_it(store_url: str, tmp_path: Path) -> None:
    sent = inventory(CALLS)
    body = to_json(sent)
    worker = [sys.executable, str(TESTS / "http_worker.py"), store_url, str(CALLS), str(TOKENS)]
    with _process(worker, "PORT ") as (proc, line):
        base = f"http://127.0.0.1:{line.split()[1]}"
        with httpx.Client(base_url=base, timeout=60) as http:
            # Concurrent cut requests for the same inventory: one cut, one identical receipt for all.
            with ThreadPoolExecutor(4) as pool:
                answers = list(pool.map(lambda _: http.post(CUT, content=body, headers=AUTH), range(4)))
            assert [answer.status_code for answer in answers] == [200] * 4, answers[0].text
            assert len({answer.content for answer in answers}) == 1
            receipt_bytes = answers[0].content
            receipt = from_json(receipt_bytes, GenerationCutReceipt)
            receipt.validate_for(sent)
            assert [ack.prefix_token_count for ack in receipt.prefixes] == [TOKENS] * CALLS

            # Refusals over the wire: JSON 4xx, never a 500.
            assert http.post(CUT, content=body).status_code == 401
            assert http.post(CUT, content=body, headers={"Authorization": "Bearer nope"}).status_code == 401
            assert http.post(CUT, content=b"{", headers=AUTH).json()["code"] == "malformed_json"
            big = http.post(CUT, content=b" " * (64 * 1024 + 1), headers=AUTH)
            assert (big.status_code, big.json()["code"]) == (413, "body_too_large")
            too_many = {"rollout_ids": [f"x{i}" for i in range(4097)]}
            path = "/training-token-capture/control/rollouts/retire"
            refused = http.post(path, json=too_many, headers=AUTH)
            assert refused.status_code == 422 and "4097" in refused.json()["detail"]

        # The ledger client over the socket.
        with ControlClient(f"{base}/v1", TOKEN) as client:
            assert client.manifest("h0").records == []
            removal = client.retire([f"x{i}" for i in range(10)])
            assert removal == RolloutRemoval(absent=[f"x{i}" for i in range(10)])
            assert client.generation_cut(sent) == receipt

        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    serve = [sys.executable, "-c", "import sys; from store.cli import main; sys.exit(main())"]
    serve += ["serve", store_url, "--token-file", str(token_file), "--port", "0"]
    with _process(serve, "serving ") as (proc, line):
        base = line.rsplit(" ", 1)[1]
        with open_store(store_url) as store:
            before = store.replay().events
        with httpx.Client(base_url=base, timeout=60) as http:
            again = http.post(CUT, content=body, headers=AUTH)
            assert again.status_code == 200, again.text
            assert again.content == receipt_bytes  # the restarted worker's identical receipt
            assert http.post(CUT, content=body, headers={"Authorization": "Bearer x"}).status_code == 401
        with open_store(store_url) as store:
            assert store.replay().events == before  # the replay wrote nothing
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_serve_over_tls_and_a_silent_handshake_is_dropped_at_the_header_deadline(tmp_path: Path) -> None:
    """HTTPS with a self-signed certificate (made with the openssl command); a peer that
    connects and never starts its handshake is dropped at the header deadline."""
    import shutil
    import socket
    import ssl
    import time

    from hostile_helpers import closed_by_peer

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    make = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
    make += ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)]
    subprocess.run(make, check=True, capture_output=True)
    store = str(tmp_path / "s.db")
    open_store(store).close()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    serve = [sys.executable, "-c", "import sys; from store.cli import main; sys.exit(main())", "serve", store]
    serve += ["--token-file", str(token_file), "--port", "0", "--host", "127.0.0.1", "--header-timeout", "1"]
    serve += ["--tls-certfile", str(cert), "--tls-keyfile", str(key)]
    with _process(serve, "serving ") as (proc, line):
        base = line.rsplit(" ", 1)[1]
        assert base.startswith("https://127.0.0.1:")
        with httpx.Client(base_url=base, timeout=30, verify=ssl.create_default_context(cafile=cert)) as http:
            response = http.get("/training-token-capture/control/rollouts/r0/manifest", headers=AUTH)
            assert response.status_code == 200, response.text
        host, port = base.removeprefix("https://").rsplit(":", 1)
        with socket.create_connection((host, int(port))) as silent:
            start = time.monotonic()
            gone, _ = closed_by_peer(silent, 10)
            assert gone and time.monotonic() - start < 5
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_serve_with_a_replica_answers_cuts_durable_in_it(tmp_path: Path) -> None:
    """``serve --replica``: the standalone server's store is in the replicated domain, so a cut's
    acknowledgements (here of completed calls) are in the replica before they are answered, and
    the receipt says so; the replica alone holds every acknowledged record and the receipt."""
    import replica_helpers as rh

    worker, replica = tmp_path / "worker.db", tmp_path / "replica.db"
    calls = [1, 2, 3]
    with open_store(worker) as store:
        rh.uninterrupted(store, calls)
    open_store(replica).close()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    sent = rh.inventory("checkpoint-r", calls)
    serve = [sys.executable, "-c", "import sys; from store.cli import main; sys.exit(main())"]
    serve += ["serve", str(worker), "--token-file", str(token_file), "--port", "0"]
    serve += ["--replica", str(replica), "--replica-wait", "30"]
    with _process(serve, "serving ") as (proc, line):
        assert f"(answers durable in the replica {replica})" in line
        with httpx.Client(base_url=line.rsplit(" ", 1)[1], timeout=60) as http:
            answer = http.post(CUT, content=to_json(sent), headers=AUTH)
        assert answer.status_code == 200, answer.text
        receipt = from_json(answer.content, GenerationCutReceipt)
        assert [(ack.disposition, ack.cut_kind) for ack in receipt.prefixes] == [
            ("durable_prefix", "terminal_completion")
        ] * len(calls)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    with open_store(worker) as store:
        assert store.cut_domain(receipt.checkpoint_id, receipt.inventory_digest) == "replicated"
    with open_store(replica) as store:
        keys = [key for ack in receipt.prefixes for key in ack.staging_keys]
        assert [snapshot.staging_key for snapshot in store.fetch(keys)] == keys
        assert store.cut_receipts() == [receipt]
        assert store.cut_domain(receipt.checkpoint_id, receipt.inventory_digest) == "replicated"
