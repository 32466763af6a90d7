"""A stand-in OpenAI-compatible server on 127.0.0.1 for client tests (the teacher, the judge
client, the rewards): each reply is scripted, nothing is computed."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeOpenAIServer:
    """``POST /v1/chat/completions``; ``script(request_json, n) -> (status, body_dict_or_str,
    delay_s)`` decides each reply (``n`` counts requests from 0)."""

    def __init__(self, script):
        self.script = script
        self.requests: list[dict] = []
        self.headers: list[dict] = []
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
                    status, reply, delay = 404, {"error": "not found"}, 0
                else:
                    status, reply, delay = outer.script(body, n)
                time.sleep(delay)
                data = (reply if isinstance(reply, str) else json.dumps(reply)).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
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
