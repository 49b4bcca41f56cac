"""`specmoe serve [MODEL]`: an OpenAI-compatible HTTP server (needs the `[serve]` extra)."""
from __future__ import annotations

import os
import sys

from specmoe.cli.common import add_model_args, add_option_args, make_llm
from specmoe.errors import InputError
from specmoe.options import size

SERVE_DEPS = ("fastapi", "uvicorn", "prometheus_client", "jinja2")


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    p.add_argument("model_dir", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint directory (default: the bundled demo model; same as --model)")
    add_model_args(p)
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (401 without it; /health and /metrics stay "
                        "open); default: the SPECMOE_API_KEY environment variable, if set")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients pass (default: the checkpoint directory's name)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests that may wait for a KV slot; beyond it: 429 with Retry-After (a request asking "
                        "for more completions than this, prompts x n, is a 400)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds from a request's arrival after which it is aborted (504)")
    p.add_argument("--max-body-size", type=size, default=4 * 2**20, metavar="BYTES",
                   help="largest request body, e.g. 4MiB (the default) or 16MB; a larger one is answered 413 "
                        "without being parsed")
    p.add_argument("--header-timeout", type=float, default=5.0, metavar="S",
                   help="seconds a connection has to send a request's headers, from its first byte or from "
                        "connecting (default 5); then 408 and the connection closes")
    p.add_argument("--body-timeout", type=float, default=10.0, metavar="S",
                   help="seconds a request's body has to arrive after its headers (default 10); then 408")
    p.add_argument("--keep-alive-timeout", type=float, default=5.0, metavar="S",
                   help="seconds an idle keep-alive connection stays open (default 5)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    add_option_args(p)
    p.set_defaults(func=run)


def missing_deps() -> list[str]:
    import importlib.util
    return [m for m in SERVE_DEPS if importlib.util.find_spec(m) is None]


def run(args) -> int:
    missing = missing_deps()
    if missing:
        raise InputError(f"specmoe serve needs the serve extra (missing: {', '.join(missing)}); install it with "
                         "pip install 'specmoe[serve]'")
    if args.model_dir is not None and args.model is not None and args.model_dir != args.model:
        raise InputError("give the model once: as MODEL or as --model")
    args.model = args.model or args.model_dir
    from specmoe.serve.config import ServeConfig
    api_key = args.api_key if args.api_key is not None else (os.environ.get("SPECMOE_API_KEY") or None)
    config = ServeConfig(host=args.host, port=args.port, model_name=args.served_model_name, api_key=api_key,
                         max_waiting=args.max_waiting, request_timeout_s=args.request_timeout,
                         max_body_bytes=args.max_body_size, header_timeout_s=args.header_timeout,
                         body_timeout_s=args.body_timeout, keep_alive_timeout_s=args.keep_alive_timeout)
    import uvicorn

    from specmoe.serve.app import build_app
    from specmoe.serve.http import uvicorn_config
    llm = make_llm(args, progress=True, max_model_len=args.max_model_len)
    app = build_app(llm, config)
    if args.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        sys.stderr.write(f"specmoe: warning: serving on {args.host} without --api-key: anyone who can reach "
                         "this address can use the model\n")
    server = uvicorn.Server(uvicorn_config(app, config, log_level=args.log_level))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn shut down gracefully, then re-raised the Ctrl-C it caught (as uvicorn.run)
        pass
    llm.close()
    return 0 if server.started else 3  # 3: uvicorn's startup-failure status
