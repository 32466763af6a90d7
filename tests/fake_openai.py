"""A stand-in OpenAI-compatible server on 127.0.0.1 for client tests (the teacher, the judge
client, the rewards): each reply is scripted, nothing is computed."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeOpenAIServer:
    """``POST /v1/chat/completions``; ``script(request_json, n) -> (status, body_dict_or_str,
    delay_s)`` or ``(status, body, delay_s, extra_headers)`` decides each reply (``n`` counts
    requests from 0). ``GET`` of any path (``/health``, ``/v1/models``) is answered by
    ``get_script(path, n)`` of the same form (default: 404), and its paths are kept in ``gets``."""

    def __init__(self, script, get_script=None):
        self.script = script
        self.get_script = get_script
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.gets: list[str] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    n = len(outer.requests)
                    outer.requests.append(body)
                    outer.headers.append({k.lower(): v for k, v in self.headers.items()})
                if self.path != "/v1/chat/completions":
                    self._reply(404, {"error": "not found"}, 0)
                else:
                    self._reply(*outer.script(body, n))

            def do_GET(self):
                with outer.lock:
                    n = len(outer.gets)
                    outer.gets.append(self.path)
                if outer.get_script is None:
                    self._reply(404, {"error": "not found"}, 0)
                else:
                    self._reply(*outer.get_script(self.path, n))

            def _reply(self, status, reply, delay, extra_headers=None):
                time.sleep(delay)
                data = (reply if isinstance(reply, str) else json.dumps(reply)).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for key, value in (extra_headers or {}).items():
                        self.send_header(key, value)
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


class DripServer:
    """A raw HTTP server on 127.0.0.1 that reads each request (headers and ``Content-Length``
    body), sends ``prefix`` at once, then ``drip`` one byte every ``interval_s``, and closes the
    connection after ``max_s`` (so a client that waits for the whole reply is held that long,
    and no longer). ``connections`` counts the requests read."""

    def __init__(self, prefix: bytes, drip: bytes, *, interval_s: float = 0.2, max_s: float = 12.0):
        import socket

        self.prefix, self.drip, self.interval_s, self.max_s = prefix, drip, interval_s, max_s
        self.connections = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.base_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"

    def _accept(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        start = time.monotonic()
        try:
            conn.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                key, _, value = line.partition(b":")
                if key.strip().lower() == b"content-length":
                    length = int(value)
            while len(body) < length:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                body += chunk
            with self.lock:
                self.connections += 1
            conn.sendall(self.prefix)
            for i in range(len(self.drip)):
                if self.stop.is_set() or time.monotonic() - start > self.max_s:
                    break
                conn.sendall(self.drip[i:i + 1])
                time.sleep(self.interval_s)
        except OSError:
            pass
        finally:
            conn.close()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(5)
        self.sock.close()
