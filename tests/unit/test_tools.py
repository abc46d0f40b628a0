"""Tools: the calculator (whitelisted AST) and the sandboxed python tool - each documented limit
is exercised in a real child process - plus run_tool_call's error text and timeouts."""
import asyncio
import os

import pytest

from megarl.tools import CalculatorTool, PythonTool, build_tools, run_tool_call, tool_schema
from test_sandbox_boundary import require_sandbox


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("expr,out", [
    ("(3 + 4) * 2^3", "56"), ("10 / 4", "2.5"), ("10 / 5", "2"), ("7 // 2 + 7 % 2", "4"),
    ("sqrt(2) / 2", "0.707106781187"), ("2 ** 100", str(2 ** 100)), ("factorial(10)", "3628800"),
    ("-3 * pi", "-9.42477796077"), ("1 / 0", "error: division by zero"),
    ("9 ** 9 ** 9", "error: power too large (9**387420489)"),
    ("__import__('os').system('id')", "error: Call is not allowed"), ("x + 1", "error: unknown name 'x'"),
    ("(1).__class__", "error: Attribute is not allowed"), ("log(-1)", "error: ValueError: math domain error"),
])
def test_calculator(expr, out):
    assert run(CalculatorTool()(expression=expr)) == out


SANDBOX = [
    ("import math\nprint('hi')\nmath.comb(10, 3)", "hi\n120"),
    ("x = [i * i for i in range(5)]\nsum(x)", "30"),
    ("y = 1", ""),
    ("1 / 0", "error: ZeroDivisionError: division by zero"),
    ("open('out.txt', 'w').write('x')", "error: PermissionError: sandbox: writing files is not allowed"),
    ("import os\nos.open('f', os.O_WRONLY | os.O_CREAT)", "error: PermissionError: sandbox: writing files is not allowed"),
    ("open('/etc/hostname').read()",
     "error: PermissionError: sandbox: reading files outside the standard library is not allowed"),
    ("import socket", "error: PermissionError: sandbox: importing socket is not allowed"),
    ("import subprocess", "error: PermissionError: sandbox: importing subprocess is not allowed"),
    ("import os\nos.system('echo hi')", "error: PermissionError: sandbox: os.system is not allowed"),
    ("import os\nos.fork()", "error: PermissionError: sandbox: os.fork is not allowed"),
    ("import os\nos.listdir('/')", "error: PermissionError: sandbox: os.listdir is not allowed"),
    ("import os\nos.remove('x')", "error: PermissionError: sandbox: os.remove is not allowed"),
    ("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))",
     "error: PermissionError: sandbox: resource.setrlimit is not allowed"),
    ("try:\n    1 / 0\nexcept Exception as e:\n    e.__traceback__.tb_frame",
     "error: PermissionError: sandbox: object.__getattr__ is not allowed"),
    ("import gc\ngc.get_objects()", "error: PermissionError: sandbox: gc.get_objects is not allowed"),
    ("x = bytearray(1024 ** 3)", "error: MemoryError: "),
    ("import numpy", "error: ModuleNotFoundError: No module named 'numpy'"),  # no site-packages
    ("print('x' * 5000)", "x" * 100 + "\n... [4901 characters cut]"),
]


# the guard answers alike with or without the bubblewrap boundary around it
@pytest.mark.parametrize("isolation", ["bwrap", "guard"])
@pytest.mark.parametrize("code,out", SANDBOX)
def test_python_sandbox(code, out, isolation):
    if isolation == "bwrap":
        require_sandbox()
    assert run(PythonTool(max_output_chars=100, isolation=isolation)(code=code)) == out


@pytest.mark.parametrize("isolation", ["bwrap", "guard"])
def test_python_sandbox_cpu_and_wall_limits(isolation):
    if isolation == "bwrap":
        require_sandbox()
    assert run(PythonTool(cpu_s=1, timeout_s=30, isolation=isolation)(code="while True: pass")) == \
        "error: killed: CPU time limit (1 s) or memory limit exceeded"
    assert run(PythonTool(cpu_s=5, timeout_s=0.5, isolation=isolation)(code="import time\ntime.sleep(30)")) == \
        "error: timed out after 0.5 s (wall clock)"


def test_python_tool_runs_behind_the_boundary_by_default():
    """By default the snippet is another user in its own PID namespace (megarl.tools.sandbox;
    its hostile corpus: tests/unit/test_sandbox_boundary.py); the guard alone runs as the trainer."""
    require_sandbox()
    code = "import os\n(os.getuid(), os.getpid())"
    uid, pid = eval(run(PythonTool()(code=code)))
    assert uid == 65534 and pid <= 3
    assert eval(run(PythonTool(isolation="guard")(code=code)))[0] == os.getuid()
    with pytest.raises(ValueError, match="isolation must be 'bwrap'"):
        PythonTool(isolation="none")
    with pytest.raises(ValueError, match=r"^python tool: isolation 'bwrap': sandbox: the interpreter "
                                         r"'no-such-python' is not"):
        PythonTool(python="no-such-python")


def test_run_tool_call_maps_failures_to_text():
    require_sandbox()  # the python tool's default isolation
    tools = build_tools(["calculator", {"name": "python", "timeout_s": 5}])
    assert [tool_schema(t)["function"]["name"] for t in tools.values()] == ["calculator", "python"]

    class Slow:
        name, description, parameters = "slow", "sleeps", {"type": "object"}

        async def __call__(self):
            await asyncio.sleep(60)

    tools["slow"] = Slow()

    async def main():
        return [
            await run_tool_call(tools, "calculator", {"expression": "2+2"}, 5),
            await run_tool_call(tools, "calculator", {"expr": "2+2"}, 5),
            await run_tool_call(tools, "nope", {}, 5),
            await run_tool_call(tools, "slow", {}, 0.2),
            await run_tool_call(tools, "python", {"code": "'ab' * 3"}, 5, max_chars=4),
        ]

    ok, bad_args, unknown, slow, cut = run(main())
    assert ok == ("4", True)
    assert bad_args[1] is False and bad_args[0].startswith("error: bad arguments for calculator:")
    assert unknown == ("error: unknown tool 'nope'; available: calculator, python, slow", False)
    assert slow == ("error: slow timed out after 0.2 s", False)
    assert cut == ("'aba... [4 characters cut]", True)
    with pytest.raises(ValueError, match="two tools are named 'calculator'"):
        build_tools(["calculator", "calculator"])


def test_python_tool_from_a_background_thread_loop():
    """The controller's event loop runs in a background thread; subprocesses must work there."""
    require_sandbox()  # the python tool's default isolation
    import threading

    out = []
    t = threading.Thread(target=lambda: out.append(run(PythonTool()(code="import math\nmath.factorial(5)"))))
    t.start()
    t.join(120)
    assert out == ["120"]
