"""The judge server's command line (``paco-serve-judge`` / ``python -m paco.serving.server``,
:func:`main`) and its process lifetime.

Start-up, in order: the flags (a non-loopback ``--host`` needs an API key, or
``--allow-unauthenticated``), the listening socket (a taken port is reported before the model
is loaded), the model (its weights checked by :mod:`paco.models.loading`); each failure is one
log line naming the cause, exit code 2 (flags) or 1, no traceback.

Lifetime: ``--parent-pid PID`` makes the server shut down when that process is gone (checked
every half second, :func:`watch_parent`), so a trainer killed with SIGKILL leaves no judge server
behind (:class:`paco.serving.local.LocalServer` passes its own pid). SIGTERM, SIGINT and
SIGHUP shut down gracefully (the requests in flight are answered), with a log line, exit code 0;
while the model loads they stop the start-up the same way.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

import torch

from paco.core.numerics import fix_numerics_env, loaded_too_late
from paco.core.teardown import freeze_heap_at_exit
from paco.serving import server as package
from paco.serving.server.app import SHUTDOWN_SIGNALS, JudgeServer
from paco.serving.server.batching import BATCHING_MODES
from paco.serving.server.guard import API_KEY_ENV, ListenError, is_loopback_name, listen_socket
from paco.serving.server.limits import ServerLimits
from paco.serving.server.protocol import MAX_TOP_LOGPROBS

log = logging.getLogger("paco.serving.server")


def watch_parent(parent_pid: int, on_exit, interval_s: float = 0.5) -> threading.Thread:
    """Call ``on_exit()`` once the process ``parent_pid`` is no longer this process's parent
    (it died and this one was re-parented), checked every ``interval_s``."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        log.warning("parent process %d is gone: shutting down", parent_pid)
        on_exit()

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


def argument_parser() -> argparse.ArgumentParser:
    """The command line of ``paco-serve-judge`` (every flag with its default)."""
    p = argparse.ArgumentParser(prog="paco-serve-judge", description=package.__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="merged judge directory (reward_merge output) or any judge dir")
    p.add_argument("--served-model-name", required=True, help="the `model` name clients must send")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; a loopback one answers only requests addressed to a loopback name "
                        "(DNS rebinding guard); any other needs an API key (or --allow-unauthenticated)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer <key>' on the /v1 routes (/health stays open), as vLLM's "
                        f"--api-key; default: the environment variable {API_KEY_ENV} (preferred: a flag shows in "
                        "the process list)")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve a non-loopback --host without an API key (anyone who reaches the port may use it)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (see --port-file)")
    p.add_argument("--port-file", default=None, help="write the bound port here once listening")
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--max-wait-ms", type=float, default=10.0)
    p.add_argument("--batching", default="auto", choices=BATCHING_MODES,
                   help="single (= auto): one request per forward pass, log-probs independent of the others "
                        "on any device; same_shape: identical encodings share a pass (faster; invariant only "
                        "where the CPU's GEMM kernels allow); dynamic: padded mixed batches (fastest, not "
                        "batch-invariant)")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="context bound in tokens (prompt + 1 answer token); 0: the model's max_position_embeddings")
    p.add_argument("--max-logprobs", type=int, default=MAX_TOP_LOGPROBS, help="largest top_logprobs served")
    p.add_argument("--request-timeout-s", type=float, default=300.0,
                   help="a request not answered within this is dropped from the queue (HTTP 503)")
    p.add_argument("--max-body-mb", type=float, default=32.0, help="request body bound (MiB)")
    p.add_argument("--max-image-pixels", type=int, default=4096 * 4096, help="width x height bound per image")
    p.add_argument("--max-request-pixels", type=int, default=4096 * 4096,
                   help="bound on both images' pixels together, read from their headers before decoding")
    p.add_argument("--max-content-parts", type=int, default=8,
                   help="content parts a request may have (a judge request has 3), counted before parsing")
    p.add_argument("--max-json-values", type=int, default=256,
                   help="JSON objects, arrays and items a body may have, strings excluded, counted before parsing")
    p.add_argument("--max-in-flight", type=int, default=256, help="accepted, unanswered requests (503 above)")
    p.add_argument("--read-timeout-s", type=float, default=30.0, help="longest pause inside a request body (408)")
    p.add_argument("--stall-s", type=float, default=120.0,
                   help="/health reports 'stalled' (503) when a forward pass runs longer than this")
    p.add_argument("--feature-cache-mb", type=float, default=128.0,
                   help="bound on the per-image processor features cached by content (a grid's panels recur in "
                        "several pairs; 0 disables); a quarter of it again bounds the decoded images")
    p.add_argument("--prepare-threads", type=int, default=4,
                   help="threads decoding and encoding requests beside the model's worker thread")
    p.add_argument("--backlog", type=int, default=2048, help="listen backlog")
    p.add_argument("--max-connections", type=int, default=1024, help="concurrent connections (503 above)")
    p.add_argument("--parent-pid", type=int, default=0, help="shut down when this process is gone (0: never)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--device", default="auto", help="auto (cuda if available) | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--log-level", default="INFO")
    return p


class _StopStartup(Exception):
    """A shutdown signal arrived before the server was serving."""


def _stop_startup(sig: int, frame: object) -> None:
    raise _StopStartup(signal.Signals(sig).name)


def _api_key(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str | None:
    """The key of ``--api-key`` or the environment; exits (code 2) when a non-loopback host
    would be served without one, unless ``--allow-unauthenticated``."""
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        parser.error(f"the API key ({'--api-key' if args.api_key is not None else API_KEY_ENV}) is empty")
    if not key and not is_loopback_name(args.host):
        if not args.allow_unauthenticated:
            parser.error(f"--host {args.host} listens beyond this machine: give an API key (--api-key, or the "
                         f"environment variable {API_KEY_ENV}; clients send it as 'Authorization: Bearer <key>', "
                         "e.g. judge_endpoint.api_key_env), or pass --allow-unauthenticated to serve anyone who "
                         "reaches the port")
        log.warning("serving %s without an API key (--allow-unauthenticated): anyone who reaches port %d may use "
                    "this judge", args.host, args.port)
    return key or None


def main(argv: list[str] | None = None) -> int:
    """Serve the judge of ``--model`` until SIGTERM / SIGINT / SIGHUP (or ``--parent-pid``'s
    exit); 0, or 1 when it cannot listen or load the model (logged), 2 for bad flags."""
    # scores must not depend on the machine's load or CPU model (a server a stage starts gets
    # these from the stage). numpy, OpenBLAS and libgomp read theirs when loaded, and importing
    # this module loaded them: if any was missing, run again with the environment fixed.
    if loaded_too_late(fix_numerics_env()):
        argv = sys.argv[1:] if argv is None else list(argv)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, "-m", "paco.serving.server", *argv])
    parser = argument_parser()
    args = parser.parse_args(argv)
    freeze_heap_at_exit()  # the stage that started this server waits for its exit
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [%(name)s] %(message)s")
    api_key = _api_key(args, parser)
    # until uvicorn's own handlers are in place (and after), a shutdown signal ends the start-up
    previous = {sig: signal.signal(sig, _stop_startup) for sig in SHUTDOWN_SIGNALS}
    try:
        return _serve(args, api_key)
    except _StopStartup as exc:
        log.warning("received %s while starting: stopped before serving", exc)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _serve(args: argparse.Namespace, api_key: str | None) -> int:
    """Listen, load, serve until stopped; 0, or 1 (logged) when it cannot listen or load."""
    try:
        sock = listen_socket(args.host, args.port, args.backlog)
    except ListenError as exc:
        log.error("%s", exc)
        return 1
    try:
        server = _load_and_bind(args, sock, api_key)
    except BaseException as exc:
        sock.close()
        if isinstance(exc, _StartupError):
            log.error("%s", exc)
            return 1
        raise
    server.run()
    log.info("stopped%s: %d request(s) scored in %d forward pass(es)",
             f" ({server.server.stop_signal})" if server.server.stop_signal else "", server.batcher.requests,
             server.batcher.forward_passes)
    return 0


class _StartupError(Exception):
    """The model cannot be loaded (its message names the file or tensors and the reason)."""


def _load_and_bind(args: argparse.Namespace, sock, api_key: str | None) -> JudgeServer:
    """Load the judge and put it on ``sock``: the server, ready to :meth:`~JudgeServer.run`.

    Raises:
        _StartupError: the model directory or its weights are unusable.
    """
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    from paco.judge.model import Judge
    from paco.models.loading import ModelDirectoryError, WeightsMismatchError

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    try:
        judge = Judge.from_pretrained(args.model, dtype=getattr(torch, args.dtype), device=device,
                                      max_model_len=args.max_model_len or None)
    except (ModelDirectoryError, WeightsMismatchError) as exc:
        raise _StartupError(f"cannot serve {args.model}: {exc}") from None
    limits = ServerLimits(max_body_bytes=int(args.max_body_mb * (1 << 20)), max_image_pixels=args.max_image_pixels,
                          max_request_pixels=args.max_request_pixels, max_content_parts=args.max_content_parts,
                          max_json_values=args.max_json_values, max_in_flight=args.max_in_flight,
                          read_timeout_s=args.read_timeout_s, request_timeout_s=args.request_timeout_s,
                          stall_s=args.stall_s, prepare_threads=args.prepare_threads,
                          feature_cache_bytes=int(args.feature_cache_mb * (1 << 20)))
    server = JudgeServer(judge, args.served_model_name, args.host, args.port, max_batch_size=args.max_batch_size,
                         max_wait_ms=args.max_wait_ms, max_logprobs=args.max_logprobs, batching=args.batching,
                         limits=limits, backlog=args.backlog, max_connections=args.max_connections,
                         log_level="warning", api_key=api_key, sock=sock)
    log.info("serving %s as %r on %s (batching %s, batch <= %d, wait <= %g ms, max_model_len %d, torch threads "
             "%d, API key %s)", args.model, args.served_model_name, server.url, server.batcher.batching,
             args.max_batch_size, args.max_wait_ms, judge.max_model_len, torch.get_num_threads(),
             "required" if api_key else "not required")
    if args.port_file:
        from paco.core.io import atomic_write_bytes

        atomic_write_bytes(args.port_file, str(server.port).encode())
    if args.parent_pid:
        def _orphaned() -> None:
            server.server.should_exit = True
            time.sleep(15)  # graceful shutdown did not finish: leave anyway
            os._exit(0)

        watch_parent(args.parent_pid, _orphaned)
    return server
