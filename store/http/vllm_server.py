"""vLLM's OpenAI server with token capture: vLLM's own app, engine and flags, built through
vLLM's public launcher functions, with the capture installed before it serves.

What is added to vLLM's app (``install``):

* the engine client's ``generate`` is wrapped (``CapturingGenerate``): captured requests are
  observed token by token;
* ``CaptureMiddleware`` goes innermost in the app's middleware (after vLLM's own, its
  ``--api-key`` check included): ``ng_capture`` in, staged, ``ng_commit_coords`` out;
* the control routes (``control_router``: the generation cut and the ledger routes, bearer
  auth) are mounted on the same app.

``serve(args, ...)`` is vLLM's ``run_server`` with those steps between building the app and
serving it; vLLM's shutdown (SIGTERM, SIGINT) is its own.
"""

from __future__ import annotations

import logging
import sys
from argparse import Namespace
from collections.abc import Callable
from typing import Any

from store.http.routes import control_router
from store.http.vllm_calls import CallService
from store.http.vllm_generate import CapturingGenerate
from store.http.vllm_middleware import CaptureMiddleware
from store.store import Store
from store.worker.capture import RolloutTokenCapture

log = logging.getLogger("store.vllm")


async def install(app: Any, engine: Any, service: CallService, token: str) -> None:
    """Capture on a built and initialised vLLM app (``build_app`` + ``init_app_state``)."""
    from starlette.middleware import Middleware
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    tokenizer = engine.renderer.tokenizer
    serving_chat: Any = getattr(app.state, "openai_serving_chat", None)

    async def history(request: dict[str, Any], messages: list[dict[str, Any]]) -> list[int]:
        """vLLM's own rendering of the conversation up to the parent's answer (no generation prompt)."""
        from store.errors import CaptureDataError

        body = {**request, "messages": messages, "add_generation_prompt": False, "continue_final_message": False}
        rendered = await serving_chat.render_chat_request(ChatCompletionRequest.model_validate(body))
        if not isinstance(rendered, tuple):
            raise CaptureDataError(f"vLLM could not render the conversation up to the parent's answer: {rendered}")
        _conversation, inputs = rendered
        return list(inputs[0]["prompt_token_ids"])

    ends = {tokenizer.eos_token_id} if tokenizer is not None and tokenizer.eos_token_id is not None else set()
    engine.generate = CapturingGenerate(
        engine.generate,
        service.capture,
        history=history if serving_chat is not None else None,
        end_token_ids=ends,
        decode=(lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if tokenizer is not None else _no_text,
    )
    # Innermost: vLLM's own middleware (auth, request ids) sees the request first.
    app.user_middleware.append(Middleware(CaptureMiddleware, service=service))
    app.middleware_stack = app.build_middleware_stack()  # vLLM's app has built its stack already
    worker = service.worker
    checkpoint_open = (lambda: worker.checkpoint is not None) if worker is not None else None
    # The cut runs in the loop iteration that reads it: vLLM's loop is busy while it decodes, and
    # a trip to the thread pool and back waits for it to come round each way (tools/bench_vllm_cut.py).
    app.include_router(
        control_router(service.capture, service.store, token, checkpoint_open=checkpoint_open, cut_on_loop=True)
    )


def _no_text(ids: list[int]) -> str:
    return ""


async def serve(
    args: Namespace,
    *,
    store: Store,
    token: str,
    policy_version: int,
    coordinator_socket: str | None = None,
    on_ready: Callable[[str, CallService, Any], object] | None = None,
) -> None:
    """Run vLLM's OpenAI server on ``args`` (vLLM's parsed flags) with capture into ``store``;
    ``on_ready(address, service, app)`` is called once the engine is up, before serving starts."""
    import vllm.envs as envs
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server
    from vllm.entrypoints.launchers.utils.server_utils import get_uvicorn_log_config

    capture = RolloutTokenCapture(store=store, weight_version_fn=lambda: policy_version)
    worker = None
    if coordinator_socket is not None:
        from store.coordinator.client import WorkerClient

        worker = WorkerClient.connect(coordinator_socket)  # registers this process by its pid
    service = CallService(capture, store, worker=worker)
    listen_address, sock = setup_server(args, reuse_port=False)
    try:
        async with build_async_engine_client(args) as engine:
            supported = await engine.get_supported_tasks()
            app = build_app(args, supported, engine.model_config)
            await init_app_state(engine, app.state, args, supported)
            await install(app, engine, service, token)
            if on_ready is not None:
                on_ready(listen_address, service, app)
            uvicorn_kwargs: dict[str, Any] = {}
            log_config = get_uvicorn_log_config(args)
            if log_config is not None:
                uvicorn_kwargs["log_config"] = log_config
            shutdown = await serve_http(
                app,
                sock=sock,
                enable_ssl_refresh=args.enable_ssl_refresh,
                host=args.host,
                port=args.port,
                log_level=args.uvicorn_log_level,
                access_log=not args.disable_uvicorn_access_log,
                timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
                ssl_keyfile=args.ssl_keyfile,
                ssl_certfile=args.ssl_certfile,
                ssl_ca_certs=args.ssl_ca_certs,
                ssl_cert_reqs=args.ssl_cert_reqs,
                ssl_ciphers=args.ssl_ciphers,
                h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
                h11_max_header_count=args.h11_max_header_count,
                **uvicorn_kwargs,
            )
        await shutdown
    finally:
        sock.close()
        capture.close()
        if worker is not None:
            worker.stop()
        sys.stdout.flush()
