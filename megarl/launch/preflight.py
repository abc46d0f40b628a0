"""Checks of a loaded megarl-train config against the world, before any rank or Megatron starts.

`load_config` checks the config on its own (keys, types, ranges, rules across fields);
`check_inputs` then opens what the config points at, cheaply, so that a bad path or file fails
in a second or two with one `ConfigError` naming the field, instead of minutes later inside a
torchrun job:

    model.hf_path        config.json there and shaped right; TP/PP/EP against its heads, layers
                         and experts (`megarl.models.checks.check_against_model`)
                         config.json parses, architecture supported, (init=hf) every safetensors
                         header readable with the right names and shapes
    data.tokenizer_path  the tokenizer loads and its vocabulary fits the model's embedding
    data.train_path      every record, streamed: JSONL/Parquet readable, not empty; the prompt a
    data.eval_path (RL)  non-empty string (or chat), the SFT response, the RL answer (data.answer_key)
                         present; no prompt that leaves no room for a response under the context
                         (train.max_seq_len); errors name file:line (file:row N) and the key
    rollout.reward_fn    RL: the plugins import and have the right shape
    rollout.workflow     (and rollout.eval_reward_fn when set)
    reward.model.path    RL, job-started reward-model servers: an HF *ForSequenceClassification
                         dir with config.json and safetensors (`check_reward_model`)
    train.run_dir        writable (probed, then put back as it was)
    checkpoint.save_dir  the checkpoint a resume would load: the newest intact one
                         (`checkpoint.verify`: every file there and whole), tensors only (no
                         pickled objects, `checkpoint.safe.check_safe`), the shapes of this model
    rollout.servers      RL: each answers /health (200) and /model_info (a JSON object) within
                         rollout.health_timeout_s (at most an hour), a progress line while it
                         waits - an unreachable server is an error, not a hang
    rollout.manager_     RL, a manager started apart: listening, speaking the channel, and
      address            accepting rollout.manager_secret_file's secret (`check_manager`)
    rollout.engine       RL, sglang local servers: SGLang installed, an HF tokenizer in model.hf_path
    weights.*            RL: the weight wire resolved against what the servers advertise
                         (`check_wire`, `megarl.config.server_wire`): auto chosen, a setting a
                         server cannot take refused naming the field and the server

Nothing here imports Megatron or starts torch.distributed; torch only where a check reads tensors
(model.init=hf safetensors headers, an existing checkpoint), so most bad inputs exit in ~0.2 s.
"""
from __future__ import annotations

import dataclasses
import os
import uuid

from megarl.config import Config, packs_sequences
from megarl.common.errors import ConfigError, ToolError
from megarl.models.checks import check_against_model
from megarl.rollout.probe import check_servers, check_wire  # noqa: F401 - check_servers: re-exported


def check_inputs(cfg: Config, *, cleanup_run_dir: bool = True) -> None:
    """All checks, cheapest first. ``cleanup_run_dir=False`` under a launcher, where several
    ranks probe the same directory at once (it is about to be used anyway)."""
    check_against_model(cfg)
    args = check_model(cfg)
    tok = check_tokenizer(cfg, args.vocab_size)
    rl = cfg.train.algorithm != "sft"
    if cfg.data.sources:  # each source's file read with its own prompt fields
        for i, src in enumerate(cfg.data.sources):
            view = dataclasses.replace(cfg, data=cfg.data.of_source(src))
            check_dataset(f"data.sources[{i}].path", src.path, view, tok, args.max_position_embeddings)
    else:
        check_dataset("data.train_path", cfg.data.train_path, cfg, tok, args.max_position_embeddings)
        if not rl and cfg.data.messages_key:
            check_sft_chat_template(cfg, tok)
    if rl and cfg.data.eval_path:  # only RL evaluates
        check_dataset("data.eval_path", cfg.data.eval_path, cfg, tok, args.max_position_embeddings)
    if rl:
        check_eval_sets(cfg, tok, args.max_position_embeddings)
    if rl:
        check_plugins(cfg)
    check_writable("train.run_dir", cfg.train.run_dir, cleanup=cleanup_run_dir)
    check_resume(cfg, args)
    if rl and not cfg.rollout.servers and cfg.rollout.engine == "sglang":
        from megarl.rollout.sglang_local import check_model_dir, cuda_available, sglang_python
        if cfg.rollout.placement == "colocated" and not cuda_available():
            # SGLang sleeps through torch_memory_saver, a CUDA-only package: on CPU its scheduler
            # dies at the first /release_memory_occupation, after the ranks and servers started
            raise ConfigError("rollout.placement: colocated with rollout.engine=sglang needs CUDA (SGLang "
                              "sleeps through its CUDA memory saver); on CPU use rollout.engine=megarl")
        sglang_python()
        check_model_dir(cfg.model.hf_path)
        check_server_args(cfg)
    elif rl and not cfg.rollout.servers:
        check_server_args(cfg)
    if rl and cfg.rollout.manager_address:
        check_manager(cfg.rollout.manager_address, cfg.rollout.manager_secret_file)
    if rl:
        check_wire(cfg)


def check_server_args(cfg: Config) -> None:
    """rollout.server_args parse as the local servers' own command line would (an unknown flag, a
    value of the wrong type), so a typo stops the run here instead of killing its servers at
    start-up: megarl-server's parser in this process, SGLang's in its venv (a few seconds)."""
    r = cfg.rollout
    if not r.server_args:
        return
    if r.engine == "sglang":
        from megarl.rollout.sglang_local import check_sglang_flags
        problem = check_sglang_flags(cfg.model.hf_path, r.server_args)
        problem = problem and f"sglang.launch_server: {problem}"
    else:
        import contextlib
        import io

        from megarl.server.__main__ import parse_args

        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                parse_args(["--model", cfg.model.hf_path, *map(str, r.server_args)])
            problem = ""
        except SystemExit:
            problem = (err.getvalue().strip().splitlines() or ["refused"])[-1].removesuffix(" (see --help)")
    if problem:
        raise ConfigError(f"rollout.server_args: {' '.join(map(str, r.server_args))}: {problem}")


MANAGER_CHECK_S = 3.0  # a manager started apart is listening already: no long retry here


def check_manager(address: str, secret_file: str, timeout_s: float = MANAGER_CHECK_S) -> None:
    """A manager started apart: something listens at ``address``, speaks the channel (its
    handshake's MAGIC) and accepts the secret of ``secret_file``. The probe proves the secret
    and closes without a `Hello`: the manager drops it, nothing of the run changes."""
    from megarl.protocol.channel import ChannelError, SecretRefused, connect
    from megarl.protocol.handshake import read_secret_file

    try:
        secret = read_secret_file(secret_file)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        connect(address, secret, timeout_s).close()
    except SecretRefused as e:
        raise ConfigError(f"rollout.manager_secret_file: {secret_file!r} is not the secret of the manager at "
                          f"rollout.manager_address={address} ({str(e).split(': ', 1)[-1]})") from None
    except (ChannelError, OSError, ValueError) as e:
        raise ConfigError(f"rollout.manager_address: {address}: {str(e).split(': ', 1)[-1]}") from None


# ----------------------------------------------------------------------------- model and tokenizer

def _model_args(field: str, path: str):
    from megarl.protocol.hf_model import read_model_args

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
    if cfg.teacher.path:  # it scores the policy's token ids: the same vocabulary, or every score is wrong
        teacher = _model_args("teacher.path", cfg.teacher.path)
        _check_weights("teacher.path", cfg.teacher.path, teacher)
        if teacher.vocab_size != args.vocab_size:
            raise ConfigError(f"teacher.path: a vocabulary of {teacher.vocab_size} tokens, the policy's has "
                              f"{args.vocab_size}: the teacher must share the policy's tokenizer")
    check_features(cfg, args)
    return args


def check_features(cfg: Config, args) -> None:
    """What the engine would refuse for this model once its ranks started, refused here instead
    (the same lines: megarl.trainer.engine, megarl.mcore.lora keep them for callers without a preflight)."""
    if cfg.train.pack_sequences and args.num_experts:
        raise ConfigError(f"train.pack_sequences: not supported for MoE models ({cfg.model.hf_path} has "
                          f"{args.num_experts} experts: the routers' padding mask and routing replay are "
                          "per padded row); set it to auto or false")
    if cfg.parallel.vpp is not None and not packs_sequences(cfg.train.pack_sequences, cfg.model, args.num_experts):
        raise ConfigError(f"parallel.vpp: the interleaved schedule needs packed sequences, which MoE models "
                          f"do not run ({cfg.model.hf_path} has {args.num_experts} experts); unset parallel.vpp")
    if cfg.parallel.cp > 1:  # the builder's own refusal, before any rank starts
        from megarl.models.builder import cp_refusal

        refusal = cp_refusal(args)
        if refusal:
            raise ConfigError(refusal)
    if cfg.lora.enabled:
        if args.num_experts and {"linear_fc1", "linear_fc2"} & set(cfg.lora.target_modules):
            raise ConfigError("lora.target_modules: MoE expert layers (linear_fc1/linear_fc2 of "
                              f"{args.architecture}) are not supported; target linear_qkv/linear_proj")
        if cfg.lora.rank > args.hidden_size:
            raise ConfigError(f"lora.rank: {cfg.lora.rank} is above the model's hidden size {args.hidden_size} "
                              f"({cfg.model.hf_path}): a low-rank adapter needs rank < hidden size")


def _check_weights(field: str, path: str, args) -> None:
    from megarl.models.checks import check_hf

    try:
        check_hf(path, args)  # headers only: names, shapes, dtypes
    except (ToolError, OSError, ValueError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        raise ConfigError(f"{field}: {msg}") from None


def check_tokenizer(cfg: Config, model_vocab: int):
    """The tokenizer, which must not produce ids the model has no embedding row for."""
    from megarl.common.tokenizer import load_tokenizer

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
    """Every record of the file, streamed (about 0.1 s per 1000 short prompts): the fields the
    datasets read (``check_record``) and room for a response. Returns the number of samples;
    errors name ``field`` and ``file:line`` (JSONL) or ``file:row N`` (Parquet), and the key."""
    from megarl.data.readers import get_field, iter_records

    if not os.path.isfile(path):
        raise ConfigError(f"{field}: no such file: {path}")
    sft = not cfg.train.is_rl
    # A prompt must leave room for at least one response token: SFT would train on nothing
    # (samples are cut at max_seq_len), RL would be refused by the rollout server.
    limit = cfg.train.max_seq_len if sft else min(cfg.train.max_seq_len, max_positions)
    count_tokens = sft or not cfg.data.max_prompt_length  # else data.truncation decides
    n = 0
    try:
        for where, row in iter_records(path):  # where = "file:line" or "file:row N"
            n += 1
            check_record(where, row, cfg)
            if sft and cfg.data.messages_key:
                continue  # a conversation: its length is the rendered template's (cut at max_seq_len)
            prompt = get_field(row, cfg.data.prompt_key)
            if not isinstance(prompt, str) or not count_tokens:
                continue  # chat messages: rendered by the template
            length = len(tok.encode(prompt, add_bos=True))
            if length >= limit:
                raise ValueError(f"{where}: the prompt is {length} tokens, no room for a response under "
                                 f"train.max_seq_len={cfg.train.max_seq_len}"
                                 + ("" if sft else f" / max_position_embeddings={max_positions}"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{field}: {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except (ValueError, KeyError, OSError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        raise ConfigError(f"{field}: {msg}") from None
    except Exception as e:  # noqa: BLE001 - pyarrow's own errors on a file that is not Parquet
        raise ConfigError(f"{field}: {path}: cannot read ({type(e).__name__}: "
                          f"{(str(e).strip().splitlines() or [''])[0][:200]})") from None
    if not n:
        raise ConfigError(f"{field}: {path} has no samples (empty file)")
    return n


def check_sft_chat_template(cfg: Config, tok) -> None:
    """Chat SFT (data.messages_key) has a chat template to render its conversations with."""
    from megarl.data.chat import sft_chat_template

    try:
        sft_chat_template(cfg.data.chat_template, cfg.data.tokenizer_path or cfg.model.hf_path, tok)
    except (ValueError, OSError) as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith("data.") else f"data.chat_template: {msg}") from None


def check_eval_sets(cfg: Config, tok, max_positions: int) -> None:
    """Each held-out set's file (data.eval_sets), read with its own prompt fields."""
    for i, es in enumerate(cfg.data.eval_sets):
        view = dataclasses.replace(cfg, data=cfg.data.of_source(es))
        check_dataset(f"data.eval_sets[{i}].path", es.path, view, tok, max_positions)


def check_record(where: str, row: dict, cfg: Config) -> None:
    """What the datasets will read from one record, checked the way they check it: SFT a string
    prompt and a non-empty response (``datasets.check_sft_record``); RL a non-empty string or
    chat prompt and, when ``data.answer_key`` is set, the answer the reward receives."""
    from megarl.data.datasets import check_sft_record
    from megarl.data.readers import get_field, has_field, text_field_problem

    d = cfg.data
    if not cfg.train.is_rl and d.messages_key:  # chat SFT: the conversation alone
        from megarl.data.datasets import chat_messages

        chat_messages(where, row, d.messages_key)
        return
    for key in (d.prompt_key,) + ((d.response_key,) if not cfg.train.is_rl else ()):
        if not has_field(row, key):
            raise KeyError(f"{where}: missing key(s) [{key!r}]; has {sorted(row)}")
    if not cfg.train.is_rl:
        check_sft_record(where, row, d.prompt_key, d.response_key)
        return
    problem = text_field_problem(get_field(row, d.prompt_key), chat=True)
    if problem:
        raise ValueError(f"{where}: {d.prompt_key!r} {problem}")
    if d.answer_key and not has_field(row, d.answer_key):
        raise KeyError(f"{where}: missing key(s) [{d.answer_key!r}]; has {sorted(row)} (data.answer_key: "
                       "the answer the reward receives; data.answer_key= when the reward needs none)")


# ----------------------------------------------------------------------------- plugins, run dir

def check_plugins(cfg: Config) -> None:
    from megarl.rewards.loader import check_reward_path
    from megarl.rollout.workflows.base import load_workflow_class

    args = dict(cfg.reward.args)
    if cfg.reward.model.path:  # the job's reward-model servers: their URLs are known once they start
        args["urls"] = ["http://reward-model-servers:0"]
    checks = [("rollout.reward_fn", lambda p: check_reward_path(p, args), cfg.rollout.reward_fn),
              ("rollout.eval_reward_fn", check_reward_path, cfg.rollout.eval_reward_fn),
              ("rollout.workflow", load_workflow_class, cfg.rollout.workflow)]
    for field, entries in (("data.sources", cfg.data.sources), ("data.eval_sets", cfg.data.eval_sets)):
        for i, e in enumerate(entries):
            own = args if e.reward_args is None else dict(e.reward_args)
            checks += [(f"{field}[{i}].reward_fn", lambda p, a=own: check_reward_path(p, a), e.reward_fn),
                       (f"{field}[{i}].workflow", load_workflow_class, e.workflow)]
    for field, load, path in checks:
        if not path:
            continue
        try:
            load(path)
        except (ImportError, ValueError, TypeError, AttributeError) as e:
            msg = str(e).removeprefix(f"{field}: ")
            raise ConfigError(f"{field}: {msg}") from None
    if cfg.reward.model.path:
        from megarl.rollout.reward_servers import check_reward_model

        check_reward_model(cfg.reward.model.path)


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
    save_dir = cfg.checkpoint.save_dir or os.path.join(cfg.train.run_dir, "checkpoints")
    if not cfg.checkpoint.resume or not os.path.isdir(save_dir):
        return  # no directory, nothing to resume (and no torch import for megarl.checkpoint)
    from megarl.checkpoint import CheckpointError, find_resumable

    field = "checkpoint.save_dir"
    try:  # intact includes safe: verify_checkpoint runs check_safe first
        path, _ = find_resumable(save_dir)
    except CheckpointError as e:
        raise ConfigError(f"{field}: {e}; checkpoint.resume=false starts over") from None
    if path is not None:
        _check_same_model(field, path, cfg, args)
        _check_same_lora(path, cfg)


def _check_same_lora(ckpt: str, cfg: Config) -> None:
    """The checkpoint's adapters (its megarl.json "lora": rank and targets) are the config's:
    switched on or off, or reshaped, the optimizer state would not fit the trained parameters."""
    from megarl.checkpoint.layout import read_meta

    saved = (read_meta(ckpt) or {}).get("lora")
    lora = cfg.lora
    have = (f"LoRA rank {saved['rank']} on {', '.join(sorted(saved['target_modules']))}" if saved else "no LoRA")
    want = f"LoRA rank {lora.rank} on {', '.join(sorted(lora.target_modules))}" if lora.enabled else "no LoRA"
    if have != want:
        raise ConfigError(f"lora.rank: {ckpt} was trained with {have}, this config asks for {want}; "
                          f"resume with the checkpoint's lora settings, or checkpoint.resume=false to start over")


def _check_same_model(field: str, ckpt: str, cfg: Config, args) -> None:
    """Every model tensor of the checkpoint has the global shape model.hf_path's config.json
    gives it (the vocabulary rows may differ: Megatron pads them per TP size)."""
    from megarl.models.layouts import mcore_key, mcore_shapes, pad_vocab
    from megarl.protocol.hf_model import VOCAB, param_table
    from megarl.models.checks import tensor_metadata

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
