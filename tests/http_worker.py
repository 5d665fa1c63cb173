"""A child-process worker serving the control routes over loopback (not a test module).

    python tests/http_worker.py URL CALLS TOKENS

Opens the store at URL, starts CALLS live calls of TOKENS decoded tokens each
(``http_helpers.start_live_calls``), listens on 127.0.0.1 at a free port, prints
``PORT <n>`` and serves ``control_app`` with uvicorn until killed.
"""

from __future__ import annotations

import socket
import sys

import uvicorn
from http_helpers import TOKEN, start_live_calls

from store import control_app, open_store

MAX_BODY_BYTES = 64 * 1024


def main(url: str, calls: int, tokens: int) -> int:
    store = open_store(url)
    capture = start_live_calls(store, calls, tokens)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    app = control_app(capture, store, TOKEN, max_body_bytes=MAX_BODY_BYTES)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    sys.stdout.write(f"PORT {listener.getsockname()[1]}\n")
    sys.stdout.flush()
    server.run(sockets=[listener])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
