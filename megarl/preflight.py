"""Checks of a loaded megarl-train config against the world, before any rank or Megatron starts.

`load_config` checks the config on its own (keys, types, ranges, TP/PP vs config.json);
`check_inputs` then opens what the config points at, cheaply, so that a bad path or file fails
in a second or two with one `ConfigError` naming the field, instead of minutes later inside a
torchrun job:

    model.hf_path        config.json parses, architecture supported, (init=hf) every safetensors
                         header readable with the right names and shapes
    data.tokenizer_path  the tokenizer loads and its vocabulary fits the model's embedding
    data.train_path      JSONL readable, not empty (errors name file:line); no prompt that leaves
    data.eval_path (RL)  no room for a response under the context (train.max_seq_len)
    rollout.reward_fn    RL: the plugins import and have the right shape
    rollout.workflow
    train.run_dir        writable (probed, then put back as it was)
    checkpoint.save_dir  the checkpoint a resume would load: the newest intact one
                         (`checkpoint.verify`: every file there and whole), tensors only (no
                         pickled objects, `checkpoint.safe.check_safe`), the shapes of this model
    rollout.servers      RL: each answers /health (200) and /model_info (a JSON object) within
                         rollout.health_timeout_s - an unreachable server is an error, not a hang

Nothing here imports Megatron or starts torch.distributed.
"""
from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
import uuid

from megarl.config import Config, ConfigError


def check_inputs(cfg: Config, *, cleanup_run_dir: bool = True) -> None:
    """All checks, cheapest first. ``cleanup_run_dir=False`` under a launcher, where several
    ranks probe the same directory at once (it is about to be used anyway)."""
    args = check_model(cfg)
    tok = check_tokenizer(cfg, args.vocab_size)
    rl = cfg.train.algorithm != "sft"
    check_dataset("data.train_path", cfg.data.train_path, cfg, tok, args.max_position_embeddings)
    if rl and cfg.data.eval_path:  # only RL evaluates
        check_dataset("data.eval_path", cfg.data.eval_path, cfg, tok, args.max_position_embeddings)
    if rl:
        check_plugins(cfg)
    check_writable("train.run_dir", cfg.train.run_dir, cleanup=cleanup_run_dir)
    check_resume(cfg, args)
    if rl and cfg.rollout.servers:
        check_servers(cfg.rollout.servers, cfg.rollout.api_key or None, cfg.rollout.health_timeout_s)


# ----------------------------------------------------------------------------- model and tokenizer

def _model_args(field: str, path: str):
    from megarl.models.registry import read_model_args

    try:
        return read_model_args(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{field}: {e}") from None


def check_model(cfg: Config):
    """ModelArgs of model.hf_path; with init=hf its safetensors headers must match config.json."""
    args = _model_args("model.hf_path", cfg.model.hf_path)
    if cfg.model.init == "hf":
        _check_weights("model.hf_path", cfg.model.hf_path, args)
    for field, path in (("model.ref_hf_path", cfg.model.ref_hf_path), ("critic.hf_path", cfg.critic.hf_path)):
        if path:
            _check_weights(field, path, _model_args(field, path))
    return args


def _check_weights(field: str, path: str, args) -> None:
    from megarl.tools_cli import ToolError
    from megarl.tools_cli.conversion import check_hf

    try:
        check_hf(path, args)  # headers only: names, shapes, dtypes
    except (ToolError, OSError, ValueError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        raise ConfigError(f"{field}: {msg}") from None


def check_tokenizer(cfg: Config, model_vocab: int):
    """The tokenizer, which must not produce ids the model has no embedding row for."""
    from megarl.data.tokenizer import load_tokenizer

    field = "data.tokenizer_path" if cfg.data.tokenizer_path else "model.hf_path"
    path = cfg.data.tokenizer_path or cfg.model.hf_path
    try:
        tok = load_tokenizer(path)
    except Exception as e:  # noqa: BLE001 - sentencepiece raises RuntimeError/OSError on junk
        raise ConfigError(f"{field}: cannot load a tokenizer from {path}: "
                          f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None
    if tok.vocab_size > model_vocab:
        raise ConfigError(f"{field}: the tokenizer in {path} has {tok.vocab_size} tokens but the model's "
                          f"vocab_size is {model_vocab} (config.json): ids >= {model_vocab} have no embedding")
    return tok


# ----------------------------------------------------------------------------- data

def check_dataset(field: str, path: str, cfg: Config, tok, max_positions: int) -> int:
    """Number of samples; errors name ``field`` and ``file:line`` (JSONL) or ``file:row N``."""
    from megarl.data.readers import get_field, read_records

    if not os.path.isfile(path):
        raise ConfigError(f"{field}: no such file: {path}")
    sft = not cfg.train.is_rl
    # RL needs the prompt; the answer field is the reward function's business (data.answer_key)
    keys = (cfg.data.prompt_key, cfg.data.response_key) if sft else (cfg.data.prompt_key,)
    try:
        rows = read_records(path, keys)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{field}: {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except (ValueError, KeyError, OSError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        raise ConfigError(f"{field}: {msg}") from None
    if not rows:
        raise ConfigError(f"{field}: {path} has no samples (empty file)")
    # A prompt must leave room for at least one response token: SFT would train on nothing
    # (samples are cut at max_seq_len), RL would be refused by the rollout server.
    limit = cfg.train.max_seq_len if sft else min(cfg.train.max_seq_len, max_positions)
    for where, row in rows:  # where = "file:line" or "file:row N"
        prompt = get_field(row, cfg.data.prompt_key)
        if not isinstance(prompt, str) or (not sft and cfg.data.max_prompt_length):
            continue  # chat messages: rendered by the template; or data.truncation decides
        n = len(tok.encode(prompt, add_bos=True))
        if n >= limit:
            raise ConfigError(f"{field}: {where}: the prompt is {n} tokens, no room for a "
                              f"response under train.max_seq_len={cfg.train.max_seq_len}"
                              + ("" if sft else f" / max_position_embeddings={max_positions}"))
    return len(rows)


# ----------------------------------------------------------------------------- plugins, run dir

def check_plugins(cfg: Config) -> None:
    from megarl.rewards import load_reward_fn
    from megarl.rollout.workflows.base import load_workflow_class

    for field, load, path in (("rollout.reward_fn", load_reward_fn, cfg.rollout.reward_fn),
                              ("rollout.workflow", load_workflow_class, cfg.rollout.workflow)):
        try:
            load(path)
        except (ImportError, ValueError, TypeError, AttributeError) as e:
            msg = str(e).removeprefix(f"{field}: ")
            raise ConfigError(f"{field}: {msg}") from None


def check_writable(field: str, path: str, cleanup: bool = True) -> None:
    """Creates ``path`` and a probe file in it; with ``cleanup`` removes both again (only what
    this call created), so a run that fails later leaves no trace of the probe."""
    path = os.path.abspath(path)
    created, parent = [], path
    while not os.path.exists(parent):
        created.append(parent)
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"{field}: cannot create {path}: {parent} is not a directory")
    probe = os.path.join(path, f".megarl-write-probe-{uuid.uuid4().hex}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"{field}: {path} is not writable ({e.strerror or e})") from None
    finally:
        if cleanup:
            for d in created:  # deepest first
                try:
                    os.rmdir(d)
                except OSError:
                    break


def check_resume(cfg: Config, args) -> None:
    """The checkpoint a resume would load (the newest intact one: ``checkpoint.find_resumable``;
    the ranks say which and why when they pass a damaged one over) is refused now, not after the
    model is built, when none is intact, when loading it could unpickle objects (an untrusted
    checkpoint must never run code), or when it holds another model (``_check_same_model``)."""
    from megarl.checkpoint import CheckpointError, check_safe, find_resumable

    if not cfg.checkpoint.resume:
        return
    field = "checkpoint.save_dir"
    try:
        path, _ = find_resumable(cfg.checkpoint.save_dir or os.path.join(cfg.train.run_dir, "checkpoints"))
        if path is not None:
            check_safe(path)
    except CheckpointError as e:
        raise ConfigError(f"{field}: {e}; checkpoint.resume=false starts over") from None
    if path is not None:
        _check_same_model(field, path, cfg, args)


def _check_same_model(field: str, ckpt: str, cfg: Config, args) -> None:
    """Every model tensor of the checkpoint has the global shape model.hf_path's config.json
    gives it (the vocabulary rows may differ: Megatron pads them per TP size)."""
    from megarl.models.layouts import mcore_key, mcore_shapes, pad_vocab
    from megarl.models.registry import VOCAB, param_table
    from megarl.tools_cli.conversion import tensor_metadata

    stored = tensor_metadata(ckpt)
    want = mcore_shapes(pad_vocab(args, cfg.model.make_vocab_size_divisible_by, cfg.parallel.tp))
    vocab = {mcore_key(p) for _, p in param_table(args) if p.kind == VOCAB}
    source = f"model.hf_path={cfg.model.hf_path}"
    for key, shape in want.items():
        if key not in stored:
            raise ConfigError(f"{field}: {ckpt} holds another model: it has no tensor {key}, "
                              f"which {source} needs")
        have = stored[key][0]
        if (have[1:] != shape[1:] or have[0] < args.vocab_size) if key in vocab else have != shape:
            raise ConfigError(f"{field}: {ckpt} holds another model: tensor {key} has shape {have} "
                              f"there, {shape} for {source}")


# ----------------------------------------------------------------------------- rollout servers

def check_servers(servers: list[str], api_key, timeout_s: float) -> None:
    """Every server answers ``/health`` with 200 and ``/model_info`` with a JSON object before
    one shared deadline. Servers that are still starting are retried until the deadline; a
    server that answers but wrongly (HTTP 5xx, not JSON) fails at once."""
    from megarl.rollout.http import normalize_address

    deadline = time.monotonic() + timeout_s
    for i, address in enumerate(servers):
        url = normalize_address(address)
        field = f"rollout.servers[{i}]"
        last = None
        while True:
            left = deadline - time.monotonic()
            try:
                status, body = _get(url + "/health", None, max(0.1, min(5.0, left)))
            except OSError as e:  # refused, unreachable, timed out: maybe not up yet
                last = f"{type(e).__name__}: {getattr(e, 'reason', None) or e}"
            else:
                if status != 200:
                    raise ConfigError(f"{field}: {url}/health answered HTTP {status}")
                break
            if time.monotonic() + 0.5 > deadline:
                raise ConfigError(f"{field}: {url} did not answer /health within "
                                  f"rollout.health_timeout_s={timeout_s:g} s ({last})")
            time.sleep(0.5)
        try:
            status, body = _get(url + "/model_info", api_key, max(1.0, deadline - time.monotonic()))
        except OSError as e:
            raise ConfigError(f"{field}: {url}/model_info failed: {e}") from None
        if status == 401:
            raise ConfigError(f"{field}: {url}/model_info answered HTTP 401: check rollout.api_key")
        if status != 200:
            raise ConfigError(f"{field}: {url}/model_info answered HTTP {status}")
        try:
            info = json.loads(body)
        except ValueError:
            info = None
        if not isinstance(info, dict):
            raise ConfigError(f"{field}: {url}/model_info did not answer a JSON object: {body[:60]!r}")


# No proxies from the environment: the rollout client (aiohttp) does not use them either.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _get(url: str, api_key, timeout: float) -> tuple[int, str]:
    req = urllib.request.Request(url, method="GET")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            return r.status, r.read(1 << 20).decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read(1 << 20).decode("utf-8", "replace")
