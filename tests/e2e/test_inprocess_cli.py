"""The in-process runner of the bad-input cases (inprocess_cli) keeps its promises: a call looks
from outside like the child process it replaces (exit status, both streams at the descriptor,
warnings as a fresh interpreter shows them), it leaves this process as it found it, it reports
what it cannot put back, it ends a hung call at its timeout, and a real entry point that gets
past its refusal trips instead of working here."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import warnings

from badinput_support import REPO, TINY, cli_env, run_in_process
from inprocess_cli import call_main, diff, import_guarded, snapshot


def call(main, timeout=60.0, cwd=None):
    return call_main(main, ["a", "b"], "prog", cwd or os.getcwd(), cli_env(), timeout)


def test_a_call_looks_like_the_process_it_replaces():
    def main(argv):
        print("out", argv)
        os.write(2, b"from C\n")  # what a C library writes reaches stderr too
        warnings.warn("shown", UserWarning)  # pytest.ini ignores UserWarning; a fresh interpreter shows it
        print("last", file=sys.stderr)
        raise SystemExit(3)

    res = call(main)
    assert res.rc == 3 and res.stdout == "out ['a', 'b']\n", res
    assert "from C\n" in res.stderr and "UserWarning: shown" in res.stderr and "last\n" in res.stderr, res.stderr
    assert res.leaks == ()
    res = call(lambda argv: 1 / 0)  # an uncaught error: the traceback, status 1
    assert res.rc == 1 and "Traceback (most recent call last)" in res.stderr and "ZeroDivisionError" in res.stderr
    assert call(lambda argv: sys.exit("bye")).rc == 1


def test_the_process_is_put_back():
    import logging

    import faulthandler
    import torch

    def main(argv):
        assert os.environ["OMP_NUM_THREADS"] == "1" and "MASTER_PORT" not in os.environ
        assert sys.argv == ["prog", "a", "b"]
        os.chdir("/")
        os.environ["MEGARL_TEST_LEAK"] = "1"
        sys.path.append("/nowhere")
        signal.signal(signal.SIGUSR1, lambda *a: None)
        faulthandler.register(signal.SIGUSR2, all_threads=True)
        logging.basicConfig(level=logging.DEBUG)
        logging.getLogger("megarl.test.leak").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", category=FutureWarning)
        sys.setswitchinterval(0.001)
        torch.set_num_threads(3)
        torch.set_grad_enabled(False)
        os.umask(0o077)
        return 0

    import_guarded()
    before = snapshot()
    res = call(main)
    assert res.rc == 0 and res.leaks == (), res
    assert diff(before, snapshot()) == []


def test_what_cannot_be_put_back_is_a_leak():
    from torch.overrides import TorchFunctionMode

    class Passthrough(TorchFunctionMode):  # as megarl's CUDA->CPU shim, minus the rewriting
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    stop, mode, child = threading.Event(), Passthrough(), []

    def main(argv):
        threading.Thread(target=stop.wait, name="leaked-thread", daemon=True).start()
        child.append(subprocess.Popen(["sleep", "60"]))
        mode.__enter__()
        return 0

    try:
        res = call(main)
    finally:
        stop.set()
        mode.__exit__(None, None, None)
    text = "\n".join(res.leaks)
    assert "threads left running: ['leaked-thread']" in text, res.leaks
    assert "child processes new" in text and "torch function modes: 0 -> 1" in text, res.leaks
    assert child[0].wait(timeout=10) is not None  # killed by the runner, by its pid


def test_a_hung_call_ends_at_its_timeout():
    """The watchdog is the subprocess timeout's equal: a wait on a server that never answers
    ends as rc None and ``HUNG``, not as a hung pytest."""
    listener = socket.create_server(("127.0.0.1", 0))

    def main(argv):
        with socket.create_connection(listener.getsockname()) as s:
            s.recv(1)  # the listener never accepts nor answers
        return 0

    try:
        res = call(main, timeout=1.0)
    finally:
        listener.close()
    assert res.rc is None and "HUNG: no exit within 1 s" in res.stderr and res.wall_s < 10, res


def test_an_entry_point_past_its_refusal_trips(tmp_path):
    """A good config gets through preflight: megarl-train's training would start here."""
    res = run_in_process("megarl-train", [f"{REPO}/configs/tiny_sft.yaml", f"model.hf_path={TINY}/hf",
                                          f"train.run_dir={tmp_path}/run", "checkpoint.hf_export_dir="], REPO)
    assert res.leaks == ("went past its refusal: megarl.train:train",), res
