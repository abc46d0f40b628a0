"""Security defaults of megarl-server and the checkpoint loaders: a real server process; the
CLIs that load checkpoints called in-process (badinput_support.run_in_process: they refuse before
any work, and a payload that ran would run in this process just as well, creating the marker).

- The server binds loopback unless told otherwise.
- With an API key, every route of the server's route table except the health checks refuses a
  request without the key (or with a wrong one): the table is read from `setup_routes`, so a new
  admin route cannot be missed.
- No endpoint and no checkpoint loader unpickles untrusted bytes: a pickle whose load would create
  a marker file is sent everywhere a payload is accepted; the marker never appears and the
  payload is refused.
- ``/update_weights_from_disk`` reads only under the server's weights roots (the trainer's local
  servers are started with the run's weights dir as their root, by `megarl.rollout.local`).
"""
from __future__ import annotations

import base64
import json
import os
import pickle
import shutil
import types

import pytest
from badinput_support import REPO, TINY, run_in_process
from e2e_servers import API_KEY as KEY
from e2e_servers import http

ADMIN = {"/pause_generation", "/continue_generation", "/flush_cache", "/abort_request",
         "/update_weights_from_tensor", "/update_weights_from_disk", "/update_weights_from_distributed",
         "/init_weights_update_group", "/destroy_weights_update_group", "/update_weight_version",
         "/begin_weight_update", "/end_weight_update", "/get_weights_by_name", "/weights_checksum"}


class Evil:
    """Unpickling this runs ``touch PATH``."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def route_table() -> list[tuple[str, str]]:
    """(method, path) of every route megarl-server registers."""
    from aiohttp import web

    from megarl.server.app import setup_routes

    app = web.Application()
    setup_routes(app)
    rows = set()
    for route in app.router.routes():
        path = route.resource.canonical
        rows.add(("POST" if route.method == "*" else route.method, path))
    return sorted(rows)


@pytest.fixture(scope="module")
def sec(tiny_model, tmp_path_factory):
    """A server started like the trainer's local servers (`local.start_server`) with an API key
    and one weights root; plus a marker path no test may ever create."""
    from megarl.rollout.local import start_server

    path, sd = tiny_model
    work = tmp_path_factory.mktemp("security")
    root = work / "weights"
    url, proc = start_server(path, str(work / "server.log"), extra=["--api-key", KEY],
                             weights_roots=[str(root)])
    ns = types.SimpleNamespace(url=url, proc=proc, root=root, work=work, model=path, sd=sd,
                               marker=str(work / "PWNED"))
    yield ns
    proc.kill()
    proc.wait(timeout=10)
    assert not os.path.exists(ns.marker)


def _payload(marker: str) -> bytes:
    return pickle.dumps(Evil(marker))


def test_the_payload_is_live(tmp_path):
    """The probe itself works: loading it does create its marker."""
    marker = tmp_path / "live"
    pickle.loads(_payload(str(marker)))
    assert marker.exists()


def test_binds_loopback_by_default(sec):
    import psutil

    from megarl.config import WeightSyncConfig
    from megarl.server.__main__ import parse_args

    assert parse_args(["--model", "x"]).host == "127.0.0.1"
    # the trainer's weight-update master: "auto" advertises loopback when the servers are local
    from megarl.common.net import advertised_address
    assert WeightSyncConfig().master_address == "auto"
    assert advertised_address("auto", "127.0.0.1") == "127.0.0.1"
    p = psutil.Process(sec.proc.pid)
    conns = p.net_connections(kind="inet") if hasattr(p, "net_connections") else p.connections(kind="inet")
    listening = {c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN}
    assert listening == {"127.0.0.1"}, listening


def test_route_table_covers_the_admin_endpoints():
    from megarl.server.app import OPEN_PATHS

    paths = {p for _, p in route_table()}
    assert ADMIN <= paths - OPEN_PATHS
    assert OPEN_PATHS == {"/health"}  # /health_generate runs the model: keyed too


@pytest.mark.parametrize("method,path", route_table())
def test_every_route_but_health_needs_the_key(sec, method, path):
    from megarl.server.app import OPEN_PATHS

    body = None if method in ("GET", "HEAD") else {"mode": "abort", "rid": "", "abort_all": True}
    no_key = http(method, sec.url + path, body, key=None)[0]
    wrong = http(method, sec.url + path, body, key="not-" + KEY)[0]
    if path in OPEN_PATHS:
        assert no_key == 200
        return
    assert no_key == 401 and wrong == 401, (no_key, wrong)
    code, info = http("GET", sec.url + "/model_info", key=KEY)  # the refused call did nothing
    assert code == 200 and info["paused"] is None and info["updating_weights"] is False


def test_non_ascii_key_header_is_refused_not_crashed(sec):
    import urllib.error
    import urllib.request

    req = urllib.request.Request(sec.url + "/model_info", headers={"Authorization": "Bearer caf\xe9"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 401


@pytest.mark.parametrize("load_format", [None, "safetensors_b64", "direct", "flattened_bucket", "pickle",
                                         "torch", "sglang"])
def test_tensor_update_never_unpickles(sec, load_format):
    entry = base64.b64encode(_payload(sec.marker)).decode()
    body = {"serialized_named_tensors": [entry]}
    if load_format is not None:
        body["load_format"] = load_format
    code, out = http("POST", sec.url + "/update_weights_from_tensor", body, key=KEY)
    assert code == 400, out
    assert not os.path.exists(sec.marker)


def test_no_route_unpickles_its_body(sec):
    """Raw pickle bytes to every route: refused (400) by each route that reads a body."""
    payload = _payload(sec.marker)
    for method, path in route_table():
        if method in ("GET", "HEAD"):
            continue
        reads_body = http(method, sec.url + path, b"{", key=KEY)[0] == 400
        code, out = http(method, sec.url + path, payload, key=KEY)
        assert not os.path.exists(sec.marker), path
        if reads_body:
            assert code == 400, (path, out)
    # undo the body-less admin calls (each route was called twice: the session may be closed already)
    code, out = http("POST", sec.url + "/end_weight_update", {}, key=KEY)
    assert code == 200 or "no weight-update session is open" in str(out), out
    assert http("POST", sec.url + "/continue_generation", {}, key=KEY)[0] == 200
    code, out = http("POST", sec.url + "/generate", {"input_ids": base64.b64encode(payload).decode()}, key=KEY)
    assert code == 400 and not os.path.exists(sec.marker)


def test_disk_update_reads_no_pickle(sec):
    payload = _payload(sec.marker)
    cases = {"bin_only": {"pytorch_model.bin": payload},
             "pickle_named_safetensors": {"model.safetensors": payload},
             "index_to_pickle": {"model.safetensors.index.json": json.dumps({"weight_map": {"a": "x.safetensors"}}),
                                 "x.safetensors": payload},
             "index_escapes": {"model.safetensors.index.json":
                               json.dumps({"weight_map": {"a": "../bin_only/pytorch_model.bin"}})}}
    for name, files in cases.items():
        d = sec.root / name
        d.mkdir(parents=True)
        for fname, data in files.items():
            (d / fname).write_bytes(data if isinstance(data, bytes) else data.encode())
        code, out = http("POST", sec.url + "/update_weights_from_disk", {"model_path": str(d)}, key=KEY)
        assert code == 400 and out["success"] is False, (name, out)
        assert not os.path.exists(sec.marker), name


def test_disk_update_only_under_the_weights_roots(sec):
    from safetensors.torch import save_file

    inside, outside = sec.root / "v1", sec.work / "outside"
    for d in (inside, outside):
        d.mkdir(parents=True)
        save_file(sec.sd, str(d / "model.safetensors"))
    (sec.root / "link").symlink_to(outside, target_is_directory=True)
    load = lambda p: http("POST", sec.url + "/update_weights_from_disk", {"model_path": str(p)}, key=KEY)  # noqa: E731
    assert load(inside)[0] == 200
    assert load(sec.model)[0] == 200  # the served model dir is always allowed
    for bad in (outside, sec.root / "link", sec.root / ".." / "outside", os.path.dirname(sec.model)):
        code, out = load(bad)
        assert code == 400 and "outside the allowed weight roots" in out["message"], (bad, out)


def test_weights_root_matching_is_by_path_component(tmp_path):
    from megarl.server.state import BadRequest, allowed_weights_path, default_weights_roots

    (tmp_path / "root").mkdir()
    (tmp_path / "rootless").mkdir()
    state = types.SimpleNamespace(weights_roots=(str(tmp_path / "root"),))
    assert allowed_weights_path(state, str(tmp_path / "root" / "a")) == str(tmp_path / "root" / "a")
    with pytest.raises(BadRequest):
        allowed_weights_path(state, str(tmp_path / "rootless"))  # a prefix, not a parent
    assert default_weights_roots(str(tmp_path / "root")) == [str(tmp_path)]


# ----------------------------------------------------------------------------- checkpoint loaders

def _evil_checkpoint(path, marker: str, hf_dir: str, where: str) -> str:
    """A 'complete' megarl checkpoint whose ``where`` (.metadata or common.pt) is the payload."""
    from torch.distributed.checkpoint.metadata import Metadata

    os.makedirs(path)
    meta = _payload(marker) if where == ".metadata" else pickle.dumps(Metadata(state_dict_metadata={}))
    open(os.path.join(path, ".metadata"), "wb").write(meta)
    if where == "common.pt":
        open(os.path.join(path, "common.pt"), "wb").write(_payload(marker))
    open(os.path.join(path, "metadata.json"), "w").write('{"sharded_backend": "torch_dist"}')
    json.dump({"complete": True, "kind": "training", "format": "megarl-checkpoint"},
              open(os.path.join(path, "megarl.json"), "w"))
    shutil.copy(os.path.join(hf_dir, "config.json"), path)
    return str(path)


@pytest.mark.parametrize("where", [".metadata", "common.pt"])
def test_checkpoint_loaders_refuse_pickles(tmp_path, where):
    from megarl.checkpoint import CheckpointError, check_safe

    marker = str(tmp_path / "PWNED")
    hf = os.path.join(TINY, "model")
    ckpt = _evil_checkpoint(tmp_path / "save" / "step_00000001", marker, hf, where)
    with pytest.raises(CheckpointError):
        check_safe(ckpt)
    assert not os.path.exists(marker)
    runs = {  # every CLI that loads checkpoints: refused with one line, marker never created
        "megarl-logprobs": (["--ckpt", ckpt, "--input", str(tmp_path / "in.jsonl"), "--output",
                             str(tmp_path / "out.jsonl")], 1),
        "megarl-convert": (["mcore-to-hf", "--ckpt", ckpt, "--out", str(tmp_path / "hf_out")], 1),
        "megarl-train": ([f"{REPO}/configs/tiny_sft.yaml", f"model.hf_path={hf}", "model.init=random",
                          f"data.train_path={TINY}/data/sft.jsonl", f"train.run_dir={tmp_path / 'run'}",
                          f"checkpoint.save_dir={tmp_path / 'save'}"], 2),
    }
    (tmp_path / "in.jsonl").write_text('{"input_ids": [1, 2]}\n')
    for prog, (argv, rc) in runs.items():  # refused before any work: in-process (a real run of each
        res = run_in_process(prog, argv, str(tmp_path))  # entry point: test_bad_input.REAL)
        assert not res.leaks, (prog, res.leaks)
        assert res.rc == rc and len(res.stderr.strip().splitlines()) == 1, (prog, res.stderr[-2000:])
        assert "not allowed" in res.stderr or "refused" in res.stderr, (prog, res.stderr)
        assert not os.path.exists(marker), prog
