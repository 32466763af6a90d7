"""The judge server's command line (``paco-serve-judge`` / ``python -m paco.judge.serve``,
:func:`main`) and its process lifetime.

Lifetime: ``--parent-pid PID`` makes the server shut down when that process is gone (checked
every half second, :func:`watch_parent`), so a trainer killed with SIGKILL leaves no judge server
behind (:class:`paco.judge.client.LocalJudgeServer` passes its own pid). SIGTERM / SIGINT shut
down gracefully.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time

import torch

from paco.core.numerics import fix_numerics_env, loaded_too_late
from paco.judge import serve as package
from paco.judge.serve.app import JudgeServer
from paco.judge.serve.batching import BATCHING_MODES
from paco.judge.serve.limits import ServerLimits
from paco.judge.serve.protocol import MAX_TOP_LOGPROBS

log = logging.getLogger("paco.judge.serve")


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
    p.add_argument("--host", default="127.0.0.1")
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


def main(argv: list[str] | None = None) -> int:
    """Serve the judge of ``--model`` until SIGTERM / SIGINT (or ``--parent-pid``'s exit); 0."""
    # scores must not depend on the machine's load or CPU model (a server a stage starts gets
    # these from the stage). numpy, OpenBLAS and libgomp read theirs when loaded, and importing
    # this module loaded them: if any was missing, run again with the environment fixed.
    if loaded_too_late(fix_numerics_env()):
        argv = sys.argv[1:] if argv is None else list(argv)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, "-m", "paco.judge.serve", *argv])
    args = argument_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [%(name)s] %(message)s")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    from paco.judge.model import Judge

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    judge = Judge.from_pretrained(args.model, dtype=getattr(torch, args.dtype), device=device,
                                  max_model_len=args.max_model_len or None)
    limits = ServerLimits(max_body_bytes=int(args.max_body_mb * (1 << 20)), max_image_pixels=args.max_image_pixels,
                          max_in_flight=args.max_in_flight, read_timeout_s=args.read_timeout_s,
                          request_timeout_s=args.request_timeout_s, stall_s=args.stall_s,
                          prepare_threads=args.prepare_threads, feature_cache_bytes=int(args.feature_cache_mb * (1 << 20)))
    server = JudgeServer(judge, args.served_model_name, args.host, args.port, max_batch_size=args.max_batch_size,
                         max_wait_ms=args.max_wait_ms, max_logprobs=args.max_logprobs, batching=args.batching,
                         limits=limits, backlog=args.backlog, max_connections=args.max_connections,
                         log_level="warning")
    log.info("serving %s as %r on %s (batching %s, batch <= %d, wait <= %g ms, max_model_len %d, torch threads "
             "%d)", args.model, args.served_model_name, server.url, server.batcher.batching, args.max_batch_size,
             args.max_wait_ms, judge.max_model_len, torch.get_num_threads())
    if args.port_file:
        from paco.core.io import atomic_write_bytes

        atomic_write_bytes(args.port_file, str(server.port).encode())
    if args.parent_pid:
        def _orphaned() -> None:
            server.server.should_exit = True
            time.sleep(15)  # graceful shutdown did not finish: leave anyway
            os._exit(0)

        watch_parent(args.parent_pid, _orphaned)
    server.run()
    return 0
