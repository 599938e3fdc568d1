"""Tools from a tools file and their limits: the calculator, the sandboxed Python runner (a real subprocess with
time, memory, output and network limits), and run_tool turning every failure into text for the model."""

import socket
import threading
import time

import pytest

from megarl.agents.builtin_tools import network_namespace_available
from megarl.agents.tools import Tool, ToolError, load_tools, run_tool
from tests.paths import REPO


@pytest.fixture(scope="module")
def tools():
    return load_tools(REPO / "configs" / "tools" / "calculator_python.yaml")


def test_the_shipped_tools_file_loads_with_its_schemas(tools):
    assert sorted(tools) == ["calculator", "python"]
    assert tools["python"].schema["function"]["parameters"]["required"] == ["code"]
    assert tools["python"].timeout_s == 10 and tools["python"].memory_bytes == 512 * 2**20


@pytest.mark.parametrize("expression, answer", [("2+3*4", "14"), ("(1.5+2.5)*3", "12"), ("7 // 2", "3"),
                                                ("1/0", "Error: division by zero"),
                                                ("9**9**9", "Error: exponent 387420489 is too large"),
                                                ("__import__('os').system('true')", "Error: only numbers")])
def test_calculator(tools, expression, answer):
    assert run_tool(tools, "calculator", {"expression": expression}).text.startswith(answer)


def _python(tools, code, **limits):
    tool = tools["python"]
    saved = {name: getattr(tool, name) for name in limits}
    for name, value in limits.items():
        setattr(tool, name, value)
    try:
        return run_tool(tools, "python", {"code": code}, timeout_s=30)
    finally:
        for name, value in saved.items():
            setattr(tool, name, value)


def test_python_runs_code_in_a_scratch_directory_of_its_own(tools):
    result = _python(tools, "import os; open('notes.txt', 'w').write('x'); print(sorted(os.listdir('.')), 6*7)")
    assert result.text == "['notes.txt'] 42" and not result.error
    again = _python(tools, "import os; print(os.listdir('.'))")
    assert again.text == "[]"  # the previous call's directory is gone


def test_python_limits_end_the_program_and_say_why(tools):
    hang = _python(tools, "while True: pass", timeout_s=1.5)
    assert hang.text == "killed: the program ran past its 1.5 s limit" and hang.seconds < 10
    memory = _python(tools, "x = bytearray(2 * 1024**3)", memory_bytes=256 * 2**20)
    assert "MemoryError" in memory.text and memory.text.endswith("exit status 1")
    chatty = _python(tools, "while True: print('y' * 1000)", max_output_bytes=20_000)
    assert chatty.text.endswith("stopped: the program wrote more than 20000 bytes of output")
    assert len(chatty.text) < 4096 + 100  # run_tool's cap on what the model reads
    crash = _python(tools, "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert crash.text == "killed by signal SIGSEGV"


def test_python_has_no_network(tools):
    # a real server on loopback that the sandboxed program tries to reach
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    result = _python(tools, f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3); print('in')")
    time.sleep(0.2)
    server.close()
    assert "in" != result.text and not accepted
    assert ("network access is disabled" in result.text) or network_namespace_available()
    assert "Error" in result.text or "exit status 1" in result.text


class _Slow(Tool):
    def call(self, arguments):
        time.sleep(5)
        return "late"


class _Broken(Tool):
    def call(self, arguments):
        raise RuntimeError("backend down")


class _NotText(Tool):
    def call(self, arguments):
        return {"json": "object"}


def _schema(name, required=()):
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}, "required": list(required)}}}


def test_run_tool_turns_every_failure_into_text():
    tools = {"slow": _Slow(_schema("slow")), "broken": _Broken(_schema("broken")),
             "not_text": _NotText(_schema("not_text")), "needs_x": _Broken(_schema("needs_x", ["x"]))}
    slow = run_tool(tools, "slow", {}, timeout_s=0.3)
    assert slow.error and slow.text == "Error: slow did not answer within 0.3 s" and slow.seconds < 2
    assert run_tool(tools, "broken", {}).text == "Error: broken failed: RuntimeError: backend down"
    assert run_tool(tools, "not_text", {}).text == "Error: not_text returned dict, not text"
    assert run_tool(tools, "nope", {}).text == "Error: no tool named 'nope'; the tools are " + str(sorted(tools))
    assert "missing required argument(s) ['x']" in run_tool(tools, "needs_x", {}).text
    assert "unknown argument(s) ['y']" in run_tool(tools, "needs_x", {"x": "1", "y": "2"}).text


def test_tools_file_errors_name_the_file_and_entry(tmp_path):
    bad = tmp_path / "tools.yaml"
    bad.write_text("tools:\n  - class_name: megarl.agents.builtin_tools.Nope\n    tool_schema: {function: {name: x}}\n")
    with pytest.raises(ToolError, match=r"tools.yaml, tools\[0\]: cannot import 'megarl.agents.builtin_tools.Nope'"):
        load_tools(bad)
    bad.write_text("tools:\n  - class_name: megarl.agents.builtin_tools.Calculator\n    tool_schema: {name: x}\n")
    with pytest.raises(ToolError, match=r"tools\[0\]: tool_schema must be"):
        load_tools(bad)
    bad.write_text("tools:\n  - class_name: os.path\n    tool_schema: {function: {name: x}}\n")
    with pytest.raises(ToolError, match=r"cannot import 'os.path'|is not a megarl.agents.tools.Tool"):
        load_tools(bad)


HANGING_TOOL_PROGRAM = """
import threading, time
from megarl.agents.tools import Tool, run_tool

class Hangs(Tool):
    def call(self, arguments):
        threading.Event().wait()  # never answers

schema = {"type": "function", "function": {"name": "hangs", "parameters": {"type": "object", "properties": {}}}}
result = run_tool({"hangs": Hangs(schema)}, "hangs", {}, timeout_s=0.2)
print(result.text, flush=True)
"""


def test_a_process_whose_tool_call_hung_past_its_timeout_still_exits():
    """The abandoned call must not hold up the interpreter's exit (a finished run that never exits keeps its
    GPUs until the cluster's time limit)."""
    import subprocess
    import sys

    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", HANGING_TOOL_PROGRAM], capture_output=True, text=True, timeout=60,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "did not answer within 0.2 s" in done.stdout
    assert time.monotonic() - start < 30
