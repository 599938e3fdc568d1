"""A real HTTP reward service on loopback for the tests (megarl.rewards.remote's protocol), with switchable
misbehaviour: slow answers, HTTP errors, malformed JSON, the wrong number of scores."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def reference_score(sample: dict) -> float:
    """What the service answers for a sample when it behaves: 1 if the ground truth is in the response."""
    return 1.0 if str(sample["ground_truth"]) in sample["response"] else 0.0


class RewardService:
    """``mode`` per request number (0-based) -> behaviour: "ok", "slow", "500", "400", "bad_json", "short".
    ``plan``: a list consumed request by request, then ``default`` for every later request. ``rendezvous=n``: a
    request is answered only once n are in flight together (or after ``rendezvous_timeout_s``), so a client that
    sends n at a time shows ``max_in_flight == n`` however slowly the machine runs, and one that sends them one by
    one shows 1."""

    def __init__(self, *, default: str = "ok", plan: list[str] | None = None, delay_s: float = 0.0,
                 slow_s: float = 1.0, rendezvous: int = 0, rendezvous_timeout_s: float = 5.0):
        self.default, self.plan, self.delay_s, self.slow_s = default, list(plan or []), delay_s, slow_s
        self.rendezvous, self.rendezvous_timeout_s = rendezvous, rendezvous_timeout_s
        self.lock = threading.Condition()
        self.requests: list[list[dict]] = []
        self.in_flight = self.max_in_flight = 0
        service = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                samples = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["samples"]
                with service.lock:
                    mode = service.plan.pop(0) if service.plan else service.default
                    service.requests.append(samples)
                    service.in_flight += 1
                    service.max_in_flight = max(service.max_in_flight, service.in_flight)
                    service.lock.notify_all()
                    service.lock.wait_for(lambda: service.in_flight >= service.rendezvous,
                                          timeout=service.rendezvous_timeout_s)
                try:
                    time.sleep(service.slow_s if mode == "slow" else service.delay_s)
                    scores = [reference_score(s) for s in samples]
                    if mode in ("500", "400"):
                        self._answer(int(mode), b"scorer exploded")
                    elif mode == "bad_json":
                        self._answer(200, b"{not json")
                    elif mode == "short":
                        self._answer(200, json.dumps({"scores": scores[:-1]}).encode())
                    else:
                        self._answer(200, json.dumps({"scores": scores}).encode())
                finally:
                    with service.lock:
                        service.in_flight -= 1

            def _answer(self, code: int, body: bytes):
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout)
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    def __enter__(self) -> "RewardService":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
