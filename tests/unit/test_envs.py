"""The environment protocol end to end in one process: megarl-env's aiohttp app on a loopback port
(real HTTP), `EnvClient`, and `EnvironmentWorkflow` driven by the `ScriptedClient` test double in
place of the rollout servers. Checks the bodies' one-line errors, one episode's failure ending that
episode only, keys, limits, the reaper, and the exact token trace an environment episode becomes."""
import asyncio
import contextlib
import json

import aiohttp
import pytest

import env_plugins
from chatml import ids, write_chat_tokenizer
from megarl.config import ConfigError, load_config
from megarl.data import PromptSample, load_chat_template, load_tokenizer
from megarl.envs import Action, EnvClient, EnvError, ProtocolError, Task, ToolCallMsg
from megarl.envs.client import fetch_info
from megarl.envs.server import EnvState, build_app
from megarl.envs.types import parse_reset_request, parse_step_request, parse_step_result
from megarl.protocol.types import SamplingParams
from megarl.rewards import RewardCaller, math_reward
from megarl.rollout.workflows import EnvironmentWorkflow, WorkflowContext, check_episode
from scripted_client import ScriptedClient
from test_sandbox_boundary import require_sandbox

IM_END, IM_START = 2, 3
NL = ids("\n")


@contextlib.asynccontextmanager
async def served(cls, args=None, **kw):
    """megarl-env's app for `cls` on a free loopback port: (url, state)."""
    state = EnvState(cls, args or {}, f"env_plugins:{cls.__name__}", **kw)
    runner = aiohttp.web.AppRunner(build_app(state), access_log=None)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        await runner.cleanup()


def run(coro):
    return asyncio.run(coro)


# ---- the bodies -----------------------------------------------------------------------------------

@pytest.mark.parametrize("body, field", [
    ({}, "step.episode_id: missing"),
    ({"episode_id": "e"}, "step.action: missing"),
    ({"episode_id": 3, "action": {}}, "step.episode_id: expected a string"),
    ({"episode_id": "e" * 200, "action": {}}, "step.episode_id: must be 1..128 characters"),
    ({"episode_id": "e", "action": {"content": 5}}, "step.action.content: expected a string"),
    ({"episode_id": "e", "action": {"tool_calls": {}}}, "step.action.tool_calls: expected a list"),
    ({"episode_id": "e", "action": {"tool_calls": [{"function": {"arguments": "{}"}}]}},
     "step.action.tool_calls[0].function.name: missing"),
    ({"episode_id": "e", "action": {"tool_calls": [{"function": {"name": "f", "arguments": 3}}]}},
     "step.action.tool_calls[0].function.arguments: expected JSON text"),
])
def test_malformed_steps_name_their_field(body, field):
    with pytest.raises(ProtocolError) as e:
        parse_step_request(body)
    assert str(e.value).startswith(field) and "\n" not in str(e.value)


def test_bodies_round_trip_and_answers_are_checked():
    action = Action("hi", [ToolCallMsg("c1", "calc", '{"x": 1}')])
    eid, back = parse_step_request({"episode_id": "e1", "action": action.to_json()})
    assert eid == "e1" and back == action and back.tool_calls[0].parsed_arguments() == {"x": 1}
    # arguments given as an object are the JSON text they stand for
    _, obj = parse_step_request({"episode_id": "e", "action": {"tool_calls": [{"function": {"name": "f",
                                                                                             "arguments": {"a": 2}}}]}})
    assert obj.tool_calls[0].parsed_arguments() == {"a": 2} and obj.tool_calls[0].id == "call_0"
    assert parse_reset_request({"episode_id": "r", "task": {"prompt": "p", "meta": {"answer": 3}}, "seed": 7}) \
        == ("r", Task("p", {"answer": 3}), 7)
    for bad, msg in [({"reward": float("nan")}, "reward: expected a finite number"),
                     ({"reward": True}, "reward: expected a finite number"),
                     ({"done": 1}, "done: expected true or false"),
                     ({"observation": [{"role": "system", "content": "x"}]}, "observation[0].role: 'system'"),
                     ({"observation": [{"role": "user"}]}, "observation[0].content: missing"),
                     ({"observation": "text"}, "observation: expected a list")]:
        with pytest.raises(ProtocolError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            parse_step_result(bad)
    with pytest.raises(ProtocolError, match=r"arguments are not JSON"):
        ToolCallMsg("c", "f", "{oops").parsed_arguments()


# ---- the server ---------------------------------------------------------------------------------

def test_episodes_run_and_are_counted():
    async def main():
        async with served(env_plugins.Echo) as (url, state), EnvClient([url]) as env:
            info = await asyncio.to_thread(fetch_info, url, None)
            assert info["tools"] == env_plugins.Echo.tools and info["env"] == "env_plugins:Echo"
            ep = await env.reset(Task("p", {}), seed=11)
            r1 = await env.step(ep, Action("hello", [ToolCallMsg("c", "noop", "{}")]))
            assert r1.observation == [{"role": "user", "content": "echo: hello ['noop']"}]
            assert (r1.reward, r1.done, r1.info) == (0.25, False, {"turns": 1})
            r2 = await env.step(ep, Action("stop now"))
            assert (r2.reward, r2.done, r2.observation) == (1.0, True, [])
            await env.close(ep)  # after done: harmless
            with pytest.raises(EnvError, match="HTTP 404.*no open episode"):
                await env.step(ep, Action("again"))  # a finished episode is gone
            assert {k: state.stats[k] for k in ("episodes_started", "episodes_done", "episodes_failed", "steps")} \
                == {"episodes_started": 1, "episodes_done": 1, "episodes_failed": 0, "steps": 2}
            assert not state.episodes
    run(main())


def test_one_episode_failure_ends_that_episode_only():
    async def main():
        async with served(env_plugins.Echo, {"hang_s": 30}, step_timeout_s=0.5) as (url, state), \
                EnvClient([url], timeout_s=5) as env:
            kinds = ["raise", "hang", "bad_result", "bad_reward", None, None]
            eps = [await env.reset(Task("p", {"fail": k} if k else {})) for k in kinds]
            results = await asyncio.gather(*(env.step(ep, Action("go")) for ep in eps), return_exceptions=True)
            errors = [str(r) if isinstance(r, Exception) else None for r in results]
            assert "HTTP 500" in errors[0] and "step raised RuntimeError: environment bug; episode ended" in errors[0]
            assert "HTTP 504" in errors[1] and "took over 0.5 s" in errors[1]
            assert "HTTP 500" in errors[2] and "not StepResult" in errors[2]
            assert "HTTP 500" in errors[3] and "bad step result (step result.reward: expected a finite number, got " \
                "nan); episode ended" in errors[3]  # checked by the server before it answers
            assert errors[4] is None and errors[5] is None  # the healthy episodes went on
            assert [r.observation for r in results[4:]] == [[{"role": "user", "content": "echo: go []"}]] * 2
            assert state.stats["episodes_failed"] == 4 and set(state.episodes) == {eps[4].id, eps[5].id}
            assert (await env.step(eps[4], Action("stop"))).done  # still served
            with pytest.raises(EnvError, match="HTTP 500.*reset raised RuntimeError: reset refused"):
                await env.reset(Task("p", {"reset_fail": True}))
            assert state.stats["episodes_failed"] == 5
    run(main())


def test_keys_limits_and_the_reaper():
    async def main():
        async with served(env_plugins.Echo, api_key="k" * 20, max_episodes=1, episode_ttl_s=3.0) as (url, state):
            async with aiohttp.ClientSession() as s:
                async with s.get(url + "/health") as r:
                    assert r.status == 200  # liveness stays open
                for path in ("/info", "/stats"):
                    async with s.get(url + path) as r:
                        assert r.status == 401
                async with s.post(url + "/reset", json={"episode_id": "x"},
                                  headers={"Authorization": "Bearer wrong"}) as r:
                    assert r.status == 401 and "API key" in (await r.json())["message"]
            with pytest.raises(EnvError, match="HTTP 401"):
                async with EnvClient([url]) as keyless:
                    await keyless.reset(Task())
            async with EnvClient([url], "k" * 20, timeout_s=0.3) as env:
                ep = await env.reset(Task())
                with pytest.raises(EnvError, match="no server took the episode in 0.3 s .last: .*every episode slot"):
                    await env.reset(Task())  # max_episodes=1
                assert state.stats["rejected_full"] >= 1
                await asyncio.sleep(3.8)  # idle past episode_ttl_s: reaped
                assert state.stats["episodes_reaped"] == 1 and not state.episodes
                with pytest.raises(EnvError, match="HTTP 404"):
                    await env.step(ep, Action("x"))
                await env.reset(Task())  # the slot is free again
    run(main())


def test_a_second_step_of_a_stepping_episode_is_refused():
    async def main():
        async with served(env_plugins.SlowSync, {"delay_s": 0.5}) as (url, state), EnvClient([url]) as env:
            ep = await env.reset(Task())
            a, b = await asyncio.gather(env.step(ep, Action("x")), env.step(ep, Action("y")), return_exceptions=True)
            refused = [x for x in (a, b) if isinstance(x, EnvError)]
            assert len(refused) == 1 and refused[0].status == 409 and "already stepping" in str(refused[0])
            assert [x for x in (a, b) if not isinstance(x, EnvError)][0].done
    run(main())


def test_a_blocking_environment_holds_only_its_own_episode():
    async def main():
        async with served(env_plugins.SlowSync) as (url, state), EnvClient([url]) as env:
            slow_ep = await env.reset(Task("", {"delay_s": 1.0}))
            fast_ep = await env.reset(Task("", {"delay_s": 0.0}))
            order = []

            async def step(ep, name):
                await asyncio.sleep(0.1 if name == "fast" else 0.0)
                await env.step(ep, Action("x"))
                order.append(name)

            async def health():
                await asyncio.sleep(0.2)
                async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
                    assert r.status == 200
                order.append("health")

            await asyncio.gather(step(slow_ep, "slow"), step(fast_ep, "fast"), health())
            # the time.sleep ran in a worker thread: another episode and the server went on meanwhile
            assert order.index("slow") == 2, order
    run(main())


def test_a_plain_step_past_its_deadline_is_closed_after_it_returns_and_health_says_wedged():
    """A blocking step cannot be killed: the episode ends at its deadline (504), its instance is
    closed only after the step's thread returns (close never races step), and while such threads
    hold half the workers /health answers 503 so the job's watcher restarts the server."""
    env_plugins.EVENTS.clear()

    async def main():
        async with served(env_plugins.SlowSync, step_timeout_s=0.3, threads=2) as (url, state), \
                EnvClient([url], timeout_s=5) as env:
            stuck = await env.reset(Task("", {"delay_s": 3.0, "id": "stuck"}))
            with pytest.raises(EnvError, match="HTTP 504.*step took over 0.3 s; episode ended"):
                await env.step(stuck, Action("x"))
            assert state.stuck == 1 and state.stats["timeouts"] == 1 and not state.episodes
            async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
                assert r.status == 503 and "past their deadline" in (await r.json())["message"]
            ok = await env.reset(Task("", {"delay_s": 0.0, "id": "ok"}))  # the other worker serves on
            assert (await env.step(ok, Action("y"))).done
            await asyncio.sleep(3.0)  # the stuck thread returns
            async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
                assert r.status == 200 and state.stuck == 0
            return list(env_plugins.EVENTS)

    events = run(main())
    assert events.index("close stuck") > events.index("step-end stuck"), events
    assert events.index("step-end ok") < events.index("step-end stuck")


def test_a_code_executing_environment_runs_the_models_code_in_the_sandbox(tmp_path):
    """ToolEnv with the python tool, served over HTTP: the model's code runs in bubblewrap, so a
    program that reads the run's files or writes outside its temp dir gets nothing done, and the
    episode, the server and the host are unaffected."""
    require_sandbox()
    from megarl.envs.examples import ToolEnv

    secret = tmp_path / "secret.txt"
    secret.write_text("the run's key")
    code = {"ok": "print(6 * 7)",
            "read": f"print(open({str(secret)!r}).read())",
            "write": f"open({str(tmp_path / 'planted')!r}, 'w').write('x')"}

    async def main():
        async with served(ToolEnv, {"tools": ["python"], "reward_fn": "megarl.rewards:arith_exact_match"}) \
                as (url, state), EnvClient([url]) as env:
            ep = await env.reset(Task("6*7", {"answer": "42"}))
            calls = [ToolCallMsg(k, "python", json.dumps({"code": c})) for k, c in code.items()]
            r = await env.step(ep, Action("<tool_call>...</tool_call>", calls))
            final = await env.step(ep, Action("42"))
            return r, final, dict(state.stats)

    r, final, stats = run(main())
    out = {m["tool_call_id"]: m["content"] for m in r.observation}
    assert out["ok"] == "42" and not r.done
    # refused by the runner's guard, and the file is not in the sandbox's mount namespace at all
    # (tests/unit/test_sandbox_boundary.py: the boundary without the guard)
    assert out["read"].startswith("error: ") and "the run's key" not in out["read"]
    assert out["write"].startswith("error: ") and not (tmp_path / "planted").exists()
    assert final.done and final.reward == 1.0 and stats["episodes_done"] == 1 and stats["episodes_failed"] == 0


# ---- the workflow -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("chat_tok"))
    write_chat_tokenizer(path)
    return path


def ctx_for(model_dir, env, max_seq_len=None):
    tok = load_tokenizer(model_dir)
    return WorkflowContext(tok, RewardCaller(math_reward), SamplingParams(max_new_tokens=400, stop_token_ids=[2]),
                           1, load_chat_template("", model_dir), max_seq_len, env)


def gen(text, call):
    out = ids(text) + [IM_END]
    half = len(out) // 2
    return out, [-(j + 1) / 100 for j in range(len(out))], [2 * call] * half + [2 * call + 1] * (len(out) - half)


def test_environment_episode_is_token_exact(model_dir):
    call = '<tool_call>{"name": "noop", "arguments": {}}</tool_call>'

    async def main():
        async with served(env_plugins.Echo) as (url, state), EnvClient([url]) as env:
            ctx = ctx_for(model_dir, env)
            wf = await asyncio.to_thread(EnvironmentWorkflow, ctx, max_turns=4)  # reads /info: tools
            assert wf.tool_schemas == env_plugins.Echo.tools
            messages = [{"role": "user", "content": "go"}]
            text = ctx.chat_template.render(messages, tools=wf.tool_schemas)
            assert '"name": "noop"' in text  # the environment's tools reach the prompt
            sample = PromptSample(5, text, {"answer": "1"}, ctx.tokenizer.encode(text), messages, seed=3)
            client = ScriptedClient(ctx.tokenizer, [call, "stop"])
            (t,) = await wf.arun_episode(client, sample)
            return t, sample, client, dict(state.stats), len(state.episodes)

    t, sample, client, stats, still_open = run(main())
    p, (g0, lp0, v0), (g1, lp1, v1) = sample.prompt_ids, gen(call, 0), gen("stop", 1)
    obs = [IM_START] + ids(f"user\necho: {call} ['noop']") + [IM_END] + NL + [IM_START] + ids("assistant\n")
    between = NL + obs  # the rest of "<|im_end|>\n", then the environment's turn and the next header
    assert t.input_ids == p + g0 + between + g1
    assert t.loss_mask == [0] * len(p) + [1] * len(g0) + [0] * len(between) + [1] * len(g1)
    assert t.behave_logp == [0.0] * len(p) + lp0 + [0.0] * len(between) + lp1
    assert t.versions == [-1] * len(p) + v0 + [-1] * len(between) + v1  # versions kept through turns
    assert t.info["turn_rewards"] == [0.25, 1.0] and t.reward == 1.25 and t.info["env_retries"] == 0
    assert [x["tool_calls"] for x in t.info["turns"]] == [1, 0] and t.info["turns"][0]["env_info"] == {"turns": 1}
    assert client.calls[1][0].input_ids == p + g0 + between
    check_episode([t], sample)
    assert stats["episodes_done"] == 1 and still_open == 0


def test_a_failed_episode_is_run_again_then_reported(model_dir, tmp_path):
    async def main():
        async with served(env_plugins.FailOnce) as (url, state), EnvClient([url], episode_retries=1) as env:
            wf = await asyncio.to_thread(EnvironmentWorkflow, ctx_for(model_dir, env), max_turns=2)
            tok = wf.ctx.tokenizer
            sample = PromptSample(0, "q", {"marker_dir": str(tmp_path), "key": "a"}, tok.encode("q"))
            (t,) = await wf.arun_episode(ScriptedClient(tok, ["answer"]), sample)
            assert t.reward == 1.0 and t.info["env_retries"] == 1
            assert state.stats["episodes_failed"] == 1 and state.stats["episodes_done"] == 1
            assert {k: env.stats[k] for k in ("episodes", "episode_errors", "episode_retries", "episodes_failed")} \
                == {"episodes": 2, "episode_errors": 1, "episode_retries": 1, "episodes_failed": 0}
            # retries used up: the error reaches the controller (which retries the group), nothing left open
            env.episode_retries = 0
            again = PromptSample(1, "q", {"marker_dir": str(tmp_path), "key": "b"}, tok.encode("q"))
            with pytest.raises(EnvError, match="first try fails"):
                await wf.arun_episode(ScriptedClient(tok, ["answer"]), again)
            assert not state.episodes and env.stats["episodes_failed"] == 1
    run(main())


def test_environment_workflow_needs_servers(model_dir):
    with pytest.raises(ValueError, match="needs environment servers"):
        EnvironmentWorkflow(ctx_for(model_dir, None))
    with pytest.raises(ValueError, match=r"env: environment http://127.0.0.1:9: /info failed: .*Connection refused"):
        EnvironmentWorkflow(ctx_for(model_dir, EnvClient(["127.0.0.1:9"])))


# ---- the config ---------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, msg", [
    (["env.cls=a.b:C", "env.urls=[http://127.0.0.1:1]",
      "rollout.workflow=megarl.rollout.workflows:EnvironmentWorkflow"], "env.cls: the job serves a.b:C itself"),
    (["env.cls=a.b.C", "rollout.workflow=megarl.rollout.workflows:EnvironmentWorkflow"],
     "env.cls: expected package.module:Class"),
    (["env.cls=a.b:C"], "env.cls: environments are driven by rollout.workflow=megarl.rollout.workflows:Environment"),
    (["rollout.workflow=megarl.rollout.workflows:EnvironmentWorkflow"], "rollout.workflow: megarl.rollout.workflows:"
                                                                          "EnvironmentWorkflow needs an environment"),
    (["env.step_timeout_s=0"], "env.step_timeout_s"),
])
def test_env_config_is_checked(overrides, msg):
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, ["model.hf_path=m", "data.train_path=x.jsonl", "train.algorithm=rl", *overrides])


def test_a_subclass_of_the_environment_workflow_drives_an_environment():
    cfg = load_config(None, ["model.hf_path=m", "data.train_path=x.jsonl", "train.algorithm=rl", "env.cls=a.b:C",
                             "rollout.workflow=test_envs:MyEnvWorkflow"])
    assert cfg.rollout.workflow == "test_envs:MyEnvWorkflow"


class MyEnvWorkflow(EnvironmentWorkflow):
    """A user's subclass (test_a_subclass_of_the_environment_workflow_drives_an_environment)."""


def test_env_urls_reach_the_task():
    from megarl.rollout.setup import TaskSpec

    base = ["model.hf_path=m", "data.train_path=x.jsonl", "train.algorithm=rl"]
    cfg = load_config(None, [*base, "env.urls=[127.0.0.1:5000]", "env.api_key=sekrit", "env.step_timeout_s=7",
                             "rollout.workflow=megarl.rollout.workflows:EnvironmentWorkflow"])
    assert TaskSpec.from_config(cfg).env == {"urls": ["127.0.0.1:5000"], "api_key": "sekrit", "timeout_s": 7.0,
                                             "episode_retries": 1}
    assert TaskSpec.from_config(load_config(None, base)).env is None
