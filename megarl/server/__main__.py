"""`megarl-server` / `python -m megarl.server`: serve an HF checkpoint dir on CPU (or ``--device cuda``).

Security defaults: binds 127.0.0.1 unless ``--host`` says otherwise (a non-loopback bind without
``--api-key`` is logged as a warning: every admin endpoint would be open to the network);
``/update_weights_from_disk`` reads only under the model dir and the ``--weights-root``
directories (default: the model dir's parent). Bad startup input (model dir, config.json,
safetensors, tokenizer, a port in use) is one line ``megarl-server: <message>`` and exit status
2; ``--debug`` shows the traceback instead.

``--tp N`` (dense models, CPU): this process is TP rank 0 and starts ranks 1..N-1 as children
(``--tp-rank``, hidden) that die with it; see `megarl.server.tp`.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import signal
import socket
import sys
import time

from megarl.common.cli import ArgumentParser, add_debug_flag, run_main

PROG = "megarl-server"
_LOOPBACKS = ("127.0.0.1", "localhost", "::1")


class StartupError(Exception):
    """The server cannot start; the message says why (one line)."""


def parse_args(argv=None):
    p = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--model", "--model-path", dest="model", required=True, help="HF checkpoint dir")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N: where the model runs")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (argv is readable by every user of the "
                        "host in /proc: prefer --api-key-file)")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="the API key, read from FILE (yours, mode 600)")
    p.add_argument("--api-key-fd", type=int, default=None, help=argparse.SUPPRESS)  # a pipe from the launcher
    p.add_argument("--weights-root", action="append", default=None, metavar="DIR",
                   help="directory /update_weights_from_disk may read under (repeatable; "
                        "default: the model dir's parent; the model dir itself is always allowed)")
    p.add_argument("--max-running-requests", type=int, default=128, help="decode batch size cap")
    p.add_argument("--context-length", type=int, default=None,
                   help="default: max_position_embeddings; a longer one needs "
                        "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 (as SGLang)")
    p.add_argument("--max-prefill-tokens", type=int, default=8192, help="padded tokens per prefill")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--weight-version", default="0", help="initial weight_version")
    p.add_argument("--seed", type=int, default=None, help="seed for requests without a seed")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="MoE models: requests may set return_routed_experts (SGLang's flag)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks (CPU, gloo; dense models): this process serves HTTP and "
                        "starts the other N-1, which hold the other shards (megarl.server.tp)")
    p.add_argument("--tp-rank", type=int, default=0, help=argparse.SUPPRESS)  # set for followers
    p.add_argument("--tp-store", default="", help=argparse.SUPPRESS)  # the TP group's store (a private file)
    p.add_argument("--log-level", default="INFO", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    add_debug_flag(p)
    args = p.parse_args(argv)
    given = [f for f, v in (("--api-key", args.api_key), ("--api-key-file", args.api_key_file),
                            ("--api-key-fd", args.api_key_fd)) if v is not None]
    if len(given) > 1:
        p.error(f"{' and '.join(given)}: give the key one way")
    for flag, v in (("--port", args.port), ("--max-running-requests", args.max_running_requests),
                    ("--max-prefill-tokens", args.max_prefill_tokens), ("--threads", args.threads),
                    ("--context-length", args.context_length or 1), ("--tp", args.tp)):
        if v < (0 if flag == "--port" else 1) or (flag == "--port" and v > 65535):
            p.error(f"{flag}: out of range: {v}")
    return args


def _spawn_followers(args, argv, store: str) -> list:
    """The leader starts TP ranks 1..N-1 as children that die with it (SIGKILL on its death)."""
    from megarl.common.signals import owned_child_setup

    return [subprocess.Popen([sys.executable, "-m", "megarl.server", *argv, "--tp-rank", str(r),
                              "--tp-store", store], preexec_fn=owned_child_setup)
            for r in range(1, args.tp)]


def _join(rank: int, size: int, store: str, procs=()):
    """The TP group meets at a file store in the leader's private directory: the ranks share one
    host, so no TCP store listens (torch's binds every interface, docs/reliability.md)."""
    import torch.distributed as dist

    from megarl.common.net import new_process_group
    from megarl.server.tp import GROUP_NAME, TPGroup

    try:
        pg = new_process_group("", 0, rank, size, GROUP_NAME, "gloo", 120.0, store=dist.FileStore(store, size))
    except Exception as e:  # noqa: BLE001 - a follower that failed to start says why in the log
        dead = [p.pid for p in procs if p.poll() is not None]
        raise StartupError(f"--tp {size}: TP rank {rank} cannot join its group at {store}: {e}"
                           + (f" (followers exited: {dead})" if dead else "")) from e
    return TPGroup(pg, rank, size)


def follow(args) -> int:
    """A TP follower (``--tp-rank`` r >= 1): its shard, its KV cache, the leader's commands."""
    import torch

    from megarl.server import build_model
    from megarl.server.model import KVCache
    from megarl.server.tp import follow as run
    from megarl.server.weights import parse_dtype

    torch.set_num_threads(max(1, args.threads))
    try:
        model, _, ctx = build_model(args.model, args.dtype, args.context_length, args.device, args.tp_rank,
                                    args.tp)
    except (OSError, ValueError, KeyError) as e:
        raise StartupError(f"TP rank {args.tp_rank}: cannot load {args.model}: {e}") from e
    model.tp = _join(args.tp_rank, args.tp, args.tp_store)
    run(model, KVCache(model.cfg, parse_dtype(args.dtype), args.max_running_requests, ctx), model.tp)
    return 0


def read_api_key(args) -> None:
    """Sets ``args.api_key`` from --api-key-file (owner-only, as ssh asks of a private key) or
    --api-key-fd (a pipe the launcher wrote it to: never argv, which /proc shows every user)."""
    from megarl.protocol import handshake

    try:
        if args.api_key_file is not None:
            args.api_key = handshake.read_secret_file(args.api_key_file, "--api-key-file").decode()
        elif args.api_key_fd is not None:
            args.api_key = handshake.read_secret_fd(args.api_key_fd, "--api-key-fd").decode()
    except (ValueError, UnicodeDecodeError) as e:
        raise StartupError(str(e)) from None


def serve(args, argv=None) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log = logging.getLogger("megarl.server")
    t0 = time.perf_counter()
    read_api_key(args)
    import torch
    from aiohttp import web

    from megarl.common.net import http_url
    from megarl.server import build_state
    from megarl.server.app import build_app

    torch.set_num_threads(max(1, args.threads))
    tp_join, procs = None, []
    if args.tp > 1:
        import atexit
        import shutil
        import tempfile

        from megarl.server import context_limit
        from megarl.server.model import DecoderConfig
        from megarl.server.tp import shard_config

        try:  # refuse a layout or a context before any follower starts (one error line, not N)
            cfg = DecoderConfig.from_dir(args.model)
            shard_config(cfg, args.tp)
            if cfg.num_labels:
                raise ValueError(f"--tp {args.tp}: a reward model ({cfg.architecture}) is served on one rank")
            context_limit(cfg, args.context_length)
        except (OSError, ValueError, KeyError) as e:
            raise StartupError(f"cannot load {args.model}: {e}") from e
        private = tempfile.mkdtemp(prefix="megarl-tp-")  # mode 0700: only this user joins the group
        atexit.register(shutil.rmtree, private, True)
        store = os.path.join(private, "store")
        procs = _spawn_followers(args, sys.argv[1:] if argv is None else list(argv), store)
        tp_join = lambda: _join(0, args.tp, store, procs)  # noqa: E731
    try:
        state = build_state(
            args.model, args.dtype, args.api_key, args.max_running_requests, args.context_length,
            args.max_prefill_tokens, args.weight_version, args.seed, args.weights_root,
            args.enable_return_routed_experts, args.device, args.tp, tp_join,
        )
    except (OSError, ValueError, KeyError) as e:
        raise StartupError(f"cannot load {args.model}: {e}") from e
    if args.host not in _LOOPBACKS and not args.api_key:
        log.warning("listening on %s without --api-key: anyone who can reach it may pause the server "
                    "and replace its weights", args.host)
    app = build_app(state)

    def announce(*_banner):  # run_app's print hook: called once the socket listens, not before
        log.info("megarl-server ready on %s (model %s%s, %.1fs)", http_url(args.host, port),
                 args.model, f", {args.tp} TP ranks" if args.tp > 1 else "", time.perf_counter() - t0)

    # A server started with SIGTERM ignored (by a trainer or launcher that owns its lifetime, see
    # megarl.common.signals) keeps it ignored instead of letting aiohttp exit on it.
    keep_ignored = signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    try:
        listen, port = _listen_on(args.host, args.port)  # port: the one announced (--port 0: the kernel's)
        web.run_app(app, **listen, print=announce, access_log=None, shutdown_timeout=2.0,
                    handler_cancellation=True, handle_signals=not keep_ignored)
    except OSError as e:  # bind failures: address in use, not an address of this machine
        state.engine.shutdown()
        raise StartupError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from e
    return 0


def _listen_on(host: str, port: int) -> tuple[dict, int]:
    """(web.run_app's listen arguments, the port). For --port 0 this process binds the socket, so
    the port the kernel picked is known and logged; aiohttp would bind it itself and report 0
    (and give each address of a name like localhost a port of its own)."""
    if port:
        return {"host": host, "port": port}, port
    family, kind, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return {"sock": sock}, sock.getsockname()[1]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.tp_rank:
        return run_main(PROG, lambda: follow(args), args.debug, expected=(StartupError,), code=2)
    return run_main(PROG, lambda: serve(args, argv), args.debug, expected=(StartupError,), code=2)


if __name__ == "__main__":
    sys.exit(main())
