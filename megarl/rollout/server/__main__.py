"""`megarl-server` / `python -m megarl.rollout.server`: serve an HF checkpoint dir on CPU."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megarl-server", description=__doc__)
    p.add_argument("--model", "--model-path", dest="model", required=True, help="HF checkpoint dir")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--max-running-requests", type=int, default=128, help="decode batch size cap")
    p.add_argument("--context-length", type=int, default=None, help="default: max_position_embeddings")
    p.add_argument("--max-prefill-tokens", type=int, default=8192, help="padded tokens per prefill")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--weight-version", default="0", help="initial weight_version")
    p.add_argument("--seed", type=int, default=None, help="seed for requests without a seed")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log = logging.getLogger("megarl.server")
    t0 = time.perf_counter()
    import torch
    from aiohttp import web

    from megarl.net import http_url
    from megarl.rollout.server import build_state
    from megarl.rollout.server.app import build_app

    torch.set_num_threads(max(1, args.threads))
    try:
        state = build_state(
            args.model, args.dtype, args.api_key, args.max_running_requests, args.context_length,
            args.max_prefill_tokens, args.weight_version, args.seed,
        )
    except (OSError, ValueError, KeyError) as e:
        log.error("cannot load %s: %s", args.model, e)
        sys.exit(2)
    app = build_app(state)

    async def announce(_app):
        log.info("megarl-server ready on %s (model %s, %.1fs)", http_url(args.host, args.port),
                 args.model, time.perf_counter() - t0)

    app.on_startup.append(announce)
    # A server started with SIGTERM ignored (by a trainer or launcher that owns its lifetime, see
    # megarl.signals) keeps it ignored instead of letting aiohttp exit on it.
    keep_ignored = signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None, shutdown_timeout=2.0,
                handler_cancellation=True, handle_signals=not keep_ignored)


if __name__ == "__main__":
    main()
