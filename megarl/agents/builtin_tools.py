"""Built-in tools: a calculator and a Python code runner.

:class:`Calculator` evaluates arithmetic (numbers, ``+ - * / // % **``, parentheses, unary signs) by walking
the expression's syntax tree: no names, calls or attributes, so nothing but arithmetic can run; exponents and
results are bounded so ``9**9**9`` is an error, not a hung process.

:class:`PythonRunner` runs a code string in a fresh ``python -I`` subprocess, in a scratch directory removed
afterwards, with a wall-clock limit (the process group is killed), an address-space limit
(``config.memory_mb``), a CPU-time limit, its output written to a file capped by ``RLIMIT_FSIZE`` (a program
printing megabytes is stopped at ``config.max_output_bytes``), and no network: in a new network namespace
(``unshare --net``) where the system allows one, otherwise with ``socket`` disabled in the child before the
code runs (``config.network_isolation`` says which was used). The model reads stdout, then stderr, then how
the program ended.
"""

from __future__ import annotations

import ast
import operator
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from functools import lru_cache

from megarl.agents.tools import Tool

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 1000
_MAX_MAGNITUDE = 10 ** 100


class Calculator(Tool):
    def call(self, arguments: dict) -> str:
        expression = str(arguments.get("expression", ""))
        try:
            tree = ast.parse(expression, mode="eval")
        except SyntaxError:
            return f"Error: not an arithmetic expression: {expression!r}"
        try:
            value = self._eval(tree.body)
        except ZeroDivisionError:
            return "Error: division by zero"
        except ValueError as exc:
            return f"Error: {exc}"
        if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
            value = int(value)
        return str(value)

    def _eval(self, node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
                raise ValueError(f"exponent {right} is too large (at most {_MAX_EXPONENT})")
            value = _BINARY[type(node.op)](left, right)
            if isinstance(value, complex) or abs(value) > _MAX_MAGNITUDE:
                raise ValueError("result out of range")
            return value
        raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not {ast.unparse(node)!r}")


@lru_cache(maxsize=1)
def network_namespace_available() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "--net", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


# Runs in the child before the user's code when no network namespace can be had.
_NO_SOCKETS = ("import socket as _s\n"
               "def _refuse(*a, **k):\n    raise OSError('network access is disabled in this sandbox')\n"
               "_s.socket = _refuse; _s.create_connection = _refuse; _s.getaddrinfo = _refuse\n"
               "del _s, _refuse\n")


class PythonRunner(Tool):
    """config: timeout_s (10), memory_mb (512), cpu_s (timeout_s), max_output_bytes (65536)."""

    def __init__(self, schema, config=None):
        super().__init__(schema, config)
        self.timeout_s = float(self.config.get("timeout_s", 10))
        self.memory_bytes = int(self.config.get("memory_mb", 512)) * 2**20
        self.cpu_s = int(self.config.get("cpu_s", max(1, int(self.timeout_s))))
        self.max_output_bytes = int(self.config.get("max_output_bytes", 65536))
        self.network_isolation = "namespace" if network_namespace_available() else "socket_disabled"

    def _limits(self) -> None:  # in the child, before exec
        import resource

        os.setsid()  # its own process group: the timeout kills everything it started
        resource.setrlimit(resource.RLIMIT_AS, (self.memory_bytes, self.memory_bytes))
        resource.setrlimit(resource.RLIMIT_CPU, (self.cpu_s, self.cpu_s))
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.max_output_bytes, self.max_output_bytes))

    def call(self, arguments: dict) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            return "Error: 'code' must be a string of Python"
        scratch = tempfile.mkdtemp(prefix="megarl-code-")  # the program's working directory
        try:
            with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
                prelude = _NO_SOCKETS if self.network_isolation == "socket_disabled" else ""
                command = [sys.executable, "-I", "-c", prelude + code]
                if self.network_isolation == "namespace":
                    command = ["unshare", "--net"] + command
                process = subprocess.Popen(command, cwd=scratch, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                           env={"PATH": os.environ.get("PATH", ""), "HOME": scratch},
                                           preexec_fn=self._limits)
                try:
                    code_status = process.wait(timeout=self.timeout_s)
                    ending = "" if code_status == 0 else self._describe(code_status)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
                    ending = f"killed: the program ran past its {self.timeout_s:g} s limit"
                out.seek(0)
                err.seek(0)
                raw_out = out.read()
                stdout, stderr = raw_out.decode(errors="replace"), err.read().decode(errors="replace")
                if len(raw_out) >= self.max_output_bytes:  # Python ignores SIGXFSZ: the capped write raised
                    stderr = ""
                    ending = f"stopped: the program wrote more than {self.max_output_bytes} bytes of output"
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        parts = [stdout.rstrip()] if stdout.strip() else []
        if stderr.strip():
            parts.append("stderr:\n" + stderr.rstrip())
        if ending:
            parts.append(ending)
        return "\n".join(parts) if parts else "(no output)"

    def _describe(self, status: int) -> str:
        if status == -signal.SIGXCPU or status == -signal.SIGKILL:
            return f"killed: the program ran past its CPU limit ({self.cpu_s} s)"
        if status < 0:
            return f"killed by signal {signal.Signals(-status).name}"
        return f"exit status {status}"
