"""The weight-update protocol runs once per push: a recording proxy in front of a real
megarl-server counts every admin call the GRPO loop makes (real trainer, real server; the proxy
only forwards and counts)."""
import asyncio
import collections
import json
import os
import subprocess
import sys
import threading

from aiohttp import ClientSession, web

from e2e_servers import ServerProc

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ADMIN = ("pause_generation", "continue_generation", "flush_cache", "begin_weight_update",
         "end_weight_update", "update_weight_version", "update_weights_from_tensor")


class RecordingProxy:
    """Forwards every request to ``target`` unchanged and counts requests per path."""

    def __init__(self, target: str):
        self.target, self.counts = target, collections.Counter()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()
        assert self.ready.wait(30)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def forward(request: web.Request) -> web.Response:
            self.counts[request.path.strip("/")] += 1
            async with self.session.request(request.method, self.target + request.path_qs,
                                            data=await request.read(), headers=request.headers) as r:
                return web.Response(body=await r.read(), status=r.status, content_type=r.content_type)

        async def start():
            self.session = ClientSession()
            app = web.Application(client_max_size=2**30)
            app.router.add_route("*", "/{tail:.*}", forward)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
            self.ready.set()

        self.loop.run_until_complete(start())
        self.loop.run_forever()


def test_one_pause_and_one_continue_per_push(tmp_path):
    server = ServerProc(f"{REPO}/examples/tiny/model").wait_ready()
    try:
        proxy = RecordingProxy(server.url)
        run = tmp_path / "run"
        cmd = [sys.executable, "-m", "megarl.train", os.path.join(REPO, "configs", "tiny_grpo.yaml"),
               f"model.hf_path={REPO}/examples/tiny/model",
               f"data.train_path={REPO}/examples/tiny/data/rl_prompts.jsonl", "data.eval_path=",
               f"train.run_dir={run}", "checkpoint.hf_export_dir=", "train.global_batch_size=64", "rollout.eval_at_start=false", "train.steps=3",
               f"rollout.servers=[{proxy.url}]", "weights.transport=tensor", "rollout.max_staleness=1"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=str(tmp_path),
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert proc.returncode == 0, proc.stderr[-4000:]
    finally:
        server.stop()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    pushes = 1 + 3  # the initial push (servers get the trainer's weights) + one per step
    counts = {name: proxy.counts[name] for name in ADMIN}
    assert counts["pause_generation"] == counts["continue_generation"] == pushes, counts
    assert counts["flush_cache"] == counts["update_weight_version"] == pushes, counts
    assert counts["begin_weight_update"] == counts["end_weight_update"] == pushes, counts
    assert counts["update_weights_from_tensor"] >= pushes, counts  # one per bucket
    assert proxy.counts["generate"] > 0
