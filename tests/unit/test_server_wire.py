"""The weight wire is chosen by the servers (megarl/config/server_wire.py): every row of its table
against a megarl-server description (all of megarl's extensions), an SGLang one (none), and a mixed
set; explicit settings a server cannot take are refused naming the field and the server; and
every shipped recipe resolves, unchanged, to a wire each kind of server can run; asynchronous MoE
routing replay against SGLang (documented to fail the mismatch gate) is refused, naming the fields."""
import glob
import os

import pytest

from megarl.config import ConfigError, WeightSyncConfig, load_config
from megarl.config.server_wire import AUTO_VERIFY_EVERY, local_extensions, resolve_wire
from megarl.protocol.wire import MEGARL_EXTENSIONS, server_extensions

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MEGARL = {"http://m:1": frozenset(MEGARL_EXTENSIONS)}
SGLANG = {"http://s:1": frozenset()}
MIXED = {**MEGARL, **SGLANG}
# what each wire sends (megarl.weights.transports / tensor_wire): load formats and endpoints
MEGARL_ONLY = {("distributed", "megarl"): "direct_bucket", ("tensor", "megarl"): "safetensors_b64"}


def wire(servers, **fields):
    w = resolve_wire(WeightSyncConfig(**fields), servers)
    return w.tensor_format, w.verify_interval


def test_advertised_extensions_are_read_from_model_info():
    assert server_extensions({"model_path": "x"}) == frozenset()  # SGLang's /model_info
    assert server_extensions({"megarl_extensions": list(MEGARL_EXTENSIONS)}) == frozenset(MEGARL_EXTENSIONS)
    with pytest.raises(ValueError, match="megarl_extensions"):
        server_extensions({"megarl_extensions": "direct_bucket"})
    assert local_extensions("megarl") == frozenset(MEGARL_EXTENSIONS)
    assert local_extensions("sglang") == frozenset()


@pytest.mark.parametrize("transport", ["distributed", "tensor", "disk"])
def test_auto_resolves_per_server_kind(transport):
    assert wire(MEGARL, transport=transport) == ("megarl", AUTO_VERIFY_EVERY)
    assert wire(SGLANG, transport=transport) == ("sglang", 0)


def test_mixed_set_is_handled_or_refused():
    # megarl-server takes SGLang's flattened buckets and HF checkpoints: SGLang's wire for both
    assert wire(MIXED, transport="distributed") == ("sglang", 0)
    assert wire(MIXED, transport="disk") == ("sglang", 0)
    with pytest.raises(ConfigError, match=r"^weights.transport: tensor payloads differ across the servers: "
                                          r"http://m:1 takes megarl's, http://s:1 only SGLang's"):
        wire(MIXED, transport="tensor")


@pytest.mark.parametrize("fields, field, server", [
    ({"tensor_format": "megarl"}, "weights.tensor_format", "http://s:1"),
    ({"tensor_format": "megarl", "transport": "tensor"}, "weights.tensor_format", "http://s:1"),
    ({"verify_interval": 1}, "weights.verify_interval", "http://s:1"),
    ({"refit": "shard"}, "weights.refit", "http://s:1"),
    ({"transport": "disk", "disk_delta": "raw"}, "weights.disk_delta", "http://s:1"),
])
def test_megarl_only_setting_against_sglang_is_refused(fields, field, server):
    with pytest.raises(ConfigError) as e:
        wire(SGLANG, **fields)
    msg = str(e.value)
    assert msg.startswith(f"{field}: ") and f"server {server} does not advertise" in msg, msg
    assert "\n" not in msg
    with pytest.raises(ConfigError, match=f"^{field}: "):  # one megarl-server is not enough
        wire(MIXED, **fields)
    wire(MEGARL, **fields)  # a megarl-server takes every one of them


def test_sglang_payload_into_megarl_server_is_refused():
    with pytest.raises(ConfigError, match="^weights.tensor_format: sglang over weights.transport=tensor sends pickled "
                                          "tensor payloads, "
                                          "which megarl-server http://m:1 refuses"):
        wire(MEGARL, transport="tensor", tensor_format="sglang")
    # SGLang's flattened buckets into megarl-server, still checked by its /weights_checksum
    assert wire(MEGARL, transport="distributed", tensor_format="sglang") == ("sglang", AUTO_VERIFY_EVERY)


def test_explicit_settings_that_fit_are_kept():
    assert wire(MEGARL, verify_interval=0) == ("megarl", 0)
    assert wire(MEGARL, verify_interval=4) == ("megarl", 4)
    assert wire(SGLANG, tensor_format="sglang", verify_interval=0) == ("sglang", 0)
    assert wire({}, tensor_format="auto") == ("auto", None)  # no servers: nothing to choose from


RECIPES = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_every_recipe_runs_on_both_server_kinds(path):
    """Each shipped recipe, unchanged: it names no wire setting (GPU recipes serve with SGLang,
    the tiny ones with megarl-server; the servers choose), it resolves against an SGLang
    server to SGLang's wire alone and against a megarl-server to megarl's."""
    cfg = load_config(path, ["model.hf_path=unused"], validate=False)
    w = cfg.weights
    assert (w.tensor_format, w.verify_interval, w.pause_mode) == ("auto", None, "auto"), path
    if cfg.train.algorithm == "sft":
        return
    w = resolve_wire(cfg.weights, SGLANG)
    assert (w.tensor_format, w.verify_interval) == ("sglang", 0)
    assert (w.transport, w.tensor_format) not in MEGARL_ONLY and w.refit == "gather" and w.disk_delta == "off"
    w = resolve_wire(cfg.weights, MEGARL)
    assert (w.tensor_format, w.verify_interval) == ("megarl", AUTO_VERIFY_EVERY)


def test_sglang_flattened_layout_keeps_every_tensor_aligned():
    """SGLang's receiver lays a flattened bucket out back to back and refuses a tensor whose byte
    offset is not a multiple of its dtype's size; megarl orders the bucket widest dtype first."""
    from megarl.protocol.wire import flat_layout, sglang_flat_order

    dtypes = ["bfloat16", "float32", "int8", "bfloat16", "float64", "float32"]
    shapes = [[3], [5], [7], [1], [2], [3]]
    with pytest.raises(ValueError, match="tensor 1 \\(float32\\) would start at byte 6"):
        flat_layout(dtypes, shapes, align=1)  # as announced: bf16 x3 then fp32 at byte 6
    order = sglang_flat_order(dtypes)
    assert [dtypes[i] for i in order] == ["float64", "float32", "float32", "bfloat16", "bfloat16", "int8"]
    layout, total = flat_layout([dtypes[i] for i in order], [shapes[i] for i in order], align=1)
    assert [off for off, _ in layout] == [0, 16, 36, 48, 54, 56] and total == 63  # no padding


def test_a_server_back_without_the_wire_is_not_readmitted(caplog):
    """RolloutCluster re-admits a dropped server only when its /model_info still advertises what
    the resolved wire needs. The two servers here are plain loopback HTTP servers that answer
    /health and /model_info as megarl-server and SGLang do (their other routes are not reached)."""
    import json
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from megarl.config.server_wire import required_extensions
    from megarl.rollout.cluster import RolloutCluster

    def serve(info):
        class H(BaseHTTPRequestHandler):
            def do_GET(self):
                body = json.dumps(info).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"

    weights = resolve_wire(WeightSyncConfig(), MEGARL)  # megarl wire: direct_bucket + checksum
    assert required_extensions(weights) == {"direct_bucket", "weights_checksum"}
    assert required_extensions(resolve_wire(WeightSyncConfig(), SGLANG)) == frozenset()
    m_srv, m_url = serve({"model_path": "x", "megarl_extensions": list(MEGARL_EXTENSIONS)})
    s_srv, s_url = serve({"model_path": "x"})
    cluster = RolloutCluster([m_url, s_url], driver=True, min_live_servers=0,
                             required=required_extensions(weights))
    cluster.poll_interval_s = 0.05
    try:
        cluster.remove_server(m_url)
        cluster.remove_server(s_url)
        seen, t0 = set(), time.monotonic()
        while time.monotonic() - t0 < 3.0:
            seen |= set(cluster.ready_to_rejoin())
            time.sleep(0.05)
        assert seen == {m_url}
        assert f"rollout server {s_url} is back without direct_bucket, weights_checksum" in caplog.text
    finally:
        cluster.close()
        m_srv.shutdown()
        s_srv.shutdown()


def test_in_place_pause_with_disk_loads_is_refused_for_sglang():
    with pytest.raises(ConfigError, match="^weights.pause_mode: in_place .* \\(server http://s:1\\)"):
        wire(MIXED, transport="disk", pause_mode="in_place")
    assert wire(SGLANG, transport="distributed", pause_mode="in_place") == ("sglang", 0)
    assert wire(MEGARL, transport="disk", pause_mode="in_place") == ("megarl", AUTO_VERIFY_EVERY)


def test_pause_mode_auto_is_retract_with_sglang_and_abort_otherwise():
    """SGLang's abort pause re-checks its requests every 1 s (a 1.03 s push on the demo against
    0.05 s with retract, tools/bench/bench_engines.py); megarl-server's abort costs ~5 ms."""
    def pause(servers, partial=True, **fields):
        return resolve_wire(WeightSyncConfig(**fields), servers, partial_rollout=partial).pause_mode

    assert pause(MEGARL) == "abort"
    assert pause(SGLANG) == "retract" and pause(MIXED) == "retract"
    assert pause(SGLANG, partial=False) == "abort"  # nothing may run across the push
    assert pause(SGLANG, pause_mode="in_place") == "in_place"  # explicit settings stand
    with pytest.raises(ValueError, match="weights.pause_mode: auto was not resolved"):
        from megarl.rollout.cluster import RolloutCluster
        RolloutCluster.from_sections(load_config(RECIPES[0], ["model.hf_path=x"], validate=False).rollout,
                                     WeightSyncConfig(), ["http://s:1"], driver=False)


def test_lora_on_sglang_pauses_by_abort_and_needs_one_kind_of_server():
    """With lora.rank > 0 SGLang loads each push's adapter as a PEFT directory and requests name
    it: a retracted request would resume on the previous adapter, so auto pauses by abort; a set
    of SGLang and megarl-servers (which merge pushed adapter tensors instead) is refused, and so
    is SGLang's wire to a megarl-server."""
    assert resolve_wire(WeightSyncConfig(), SGLANG, lora=True).pause_mode == "abort"
    assert resolve_wire(WeightSyncConfig(), SGLANG).pause_mode == "retract"
    assert resolve_wire(WeightSyncConfig(), MEGARL, lora=True).tensor_format == "megarl"
    with pytest.raises(ConfigError, match=r"^rollout.servers: lora.rank > 0 .*\(http://s:1\) .*\(http://m:1\)"):
        resolve_wire(WeightSyncConfig(), MIXED, lora=True)
    with pytest.raises(ConfigError, match="^weights.tensor_format: sglang with lora.rank > 0 .* http://m:1"):
        resolve_wire(WeightSyncConfig(tensor_format="sglang"), MEGARL, lora=True)
