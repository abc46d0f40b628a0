"""megarl.common.signals: handlers set a flag, ranks agree through one all-reduce, owned children survive
tree-wide stop signals and die with their parent."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch.distributed as dist

from megarl.common.signals import STOP_MARKER, StopRequest, clear_stop_marker, owned_child_setup, write_stop_marker


def test_signal_sets_flag_and_close_restores_handlers():
    before = signal.getsignal(signal.SIGUSR1)
    with StopRequest() as stop:
        assert stop.received is None and not stop.should_stop() and not stop.stopped
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.received == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGTERM)  # a later signal does not overwrite the first
        assert stop.received == "SIGUSR1"
        assert stop.should_stop() and stop.stopped
    assert signal.getsignal(signal.SIGUSR1) is before


def test_second_sigint_interrupts():
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.received == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


def test_should_stop_is_one_collective(tmp_path):
    """A world of one over gloo: the flag goes through all_reduce(MAX); no signal -> False."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        stop = StopRequest()
        assert stop.should_stop() is False
        stop.request("SIGTERM")
        assert stop.should_stop() is True and stop.received == "SIGTERM"
    finally:
        dist.destroy_process_group()


def test_marker_roundtrip(tmp_path):
    path = write_stop_marker(str(tmp_path), "SIGUSR1")
    assert os.path.basename(path) == STOP_MARKER and open(path).read() == '{"signal": "SIGUSR1"}'
    clear_stop_marker(str(tmp_path))
    clear_stop_marker(str(tmp_path))  # idempotent
    assert not os.path.exists(path)


def test_owned_child_ignores_stop_signals_and_dies_with_its_parent(tmp_path):
    probe = "import signal; print(*(signal.getsignal(s) is signal.SIG_IGN for s in " \
            "(signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)))"
    out = subprocess.run([sys.executable, "-c", probe], preexec_fn=owned_child_setup,
                         capture_output=True, text=True).stdout
    assert out.split() == ["True", "True", "True"]
    # a parent that starts an owned child and dies hard (no cleanup runs) takes the child with it
    parent = textwrap.dedent(f"""
        import os, subprocess, sys
        from megarl.common.signals import owned_child_setup
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=owned_child_setup)
        open({str(tmp_path / 'pid')!r}, "w").write(str(p.pid))
        os._exit(0)
    """)
    subprocess.run([sys.executable, "-c", parent], check=True, timeout=60)
    pid = int((tmp_path / "pid").read_text())
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the owned child outlived its parent")
