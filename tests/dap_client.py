"""A minimal Debug Adapter Protocol client (what VS Code speaks to debugpy): enough to attach to a process that
waits in ``debugpy.listen``/``wait_for_client``, see where it stopped, read its locals and let it go on."""

from __future__ import annotations

import json
import re
import socket
from typing import Any


class DapClient:
    def __init__(self, host: str, port: int, timeout_s: float = 60.0):
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.buffer = b""
        self.seq = 0
        self.pending_events: list[dict] = []

    def _message(self) -> dict:
        while b"\r\n\r\n" not in self.buffer:
            self.buffer += self._recv()
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        length = int(re.search(rb"Content-Length: (\d+)", head).group(1))
        while len(self.buffer) < length:
            self.buffer += self._recv()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return json.loads(body)

    def _recv(self) -> bytes:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("the debug adapter closed the connection")
        return chunk

    def send(self, command: str, **arguments: Any) -> int:
        self.seq += 1
        payload = json.dumps({"seq": self.seq, "type": "request", "command": command,
                              "arguments": arguments}).encode()
        self.sock.sendall(b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
        return self.seq

    def request(self, command: str, **arguments: Any) -> dict:
        seq = self.send(command, **arguments)
        while True:
            message = self._message()
            if message["type"] == "response" and message["request_seq"] == seq:
                if not message["success"]:
                    raise RuntimeError(f"DAP {command} failed: {message.get('message')}")
                return message.get("body") or {}
            self.pending_events.append(message)

    def wait_event(self, name: str) -> dict:
        for index, message in enumerate(self.pending_events):
            if message.get("event") == name:
                return self.pending_events.pop(index)
        while True:
            message = self._message()
            if message.get("event") == name:
                return message
            self.pending_events.append(message)

    def attach(self) -> dict:
        """Attach and finish configuration; returns the ``stopped`` event's body."""
        self.request("initialize", adapterID="debugpy", clientID="megarl-tests", pathFormat="path",
                     linesStartAt1=True, columnsStartAt1=True)
        self.send("attach", justMyCode=False)
        self.wait_event("initialized")
        self.request("configurationDone")
        return self.wait_event("stopped")["body"]

    def frames(self, thread_id: int) -> list[dict]:
        return self.request("stackTrace", threadId=thread_id)["stackFrames"]

    def locals_of(self, frame_id: int) -> dict[str, str]:
        scope = self.request("scopes", frameId=frame_id)["scopes"][0]
        variables = self.request("variables", variablesReference=scope["variablesReference"])["variables"]
        return {v["name"]: v["value"] for v in variables}

    def close(self) -> None:
        try:
            self.request("disconnect")
        finally:
            self.sock.close()
