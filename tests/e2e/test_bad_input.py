"""The bad-input corpus: every case runs a real entry point (megarl-train, megarl-convert,
megarl-logprobs, megarl-server, megarl-launch, megarl-rollout-manager) or sends a real HTTP
request to one real megarl-server, and checks what docs/reliability.md promises:

- CLI: the exact exit status; stderr is ONE line ``<prog>: <message>`` naming the field, file or
  endpoint (no traceback); nothing half-written is left (run dir, --out, --output); no hang: a run
  past the generous subprocess timeout fails its case (an unreachable or hung rollout server
  must fail within rollout.health_timeout_s=3, not wait forever).
- HTTP: the exact status and a message naming the field; after every bad request the server is
  still up and a greedy request gives the same tokens as before the corpus started.

A CLI case refused before any work (arguments, `load_config`, `megarl.launch.preflight`, the
tools' input checks) calls the entry point's ``main(argv)`` in this process (inprocess_cli: the
same argv, cwd, environment and captured output; the process left as it was; a case that gets
past its refusal fails). The cases in REAL run as subprocesses, a few at a time: those that wait
on the network or start the server's engine, and one case of each entry point, so the console
path itself (a new interpreter, its imports, its exit status) stays covered.
"""
from __future__ import annotations

import os

import pytest
from badinput_support import (MODULES, REPO, CliCase, World, check_cli_result, docs_missing, run_cases, run_cli,
                              run_in_process)
from e2e_servers import API_KEY as KEY
from e2e_servers import ServerProc, free_port, http

SFT = ("{sft_yaml}", "model.hf_path={hf}", "data.train_path={sft}", "train.run_dir={root}/runs/{id}")
GRPO = ("{grpo_yaml}", "model.hf_path={model}", "data.train_path={rl}", "data.eval_path=",
        "train.run_dir={root}/runs/{id}", "rollout.health_timeout_s=3")
RUN = ("{root}/runs/{id}",)


def T(id, extra, *needles, base=SFT, rc=2, doc=""):  # noqa: N802 - a table row
    return CliCase(id, "megarl-train", base + tuple(extra), rc, needles, RUN, doc)


TRAIN = [
    T("no_config_argument", (), "usage", base=()),
    T("config_file_missing", (), "config", "file not found", base=("{root}/nope.yaml",)),
    T("config_invalid_yaml", (), "config", "not valid YAML", base=("{bad_yaml}",)),
    T("config_not_a_mapping", (), "config", "mapping", base=("{list_yaml}",)),
    T("typo_top_level_key", ["trian.steps=3"], "trian: unknown key"),
    T("typo_nested_key", ["train.stpes=3"], "train.stpes: unknown key"),
    T("override_without_value", ["train.steps"], "override", "a.b=value"),
    T("wrong_type_int", ["train.steps=abc"], "train.steps: expected an integer"),
    T("wrong_type_bool", ["checkpoint.resume=maybe"], "checkpoint.resume: expected true/false"),
    T("wrong_type_list", ["rollout.servers=localhost"], "rollout.servers: expected a list"),
    T("nan_float", ["optim.lr=.nan"], "optim.lr: expected a finite number"),
    T("bad_choice", ["train.algorithm=ppo2"], "train.algorithm: must be one of"),
    T("negative_steps", ["train.steps=-1"], "train.steps: must be >= 1"),
    T("tp_not_dividing_heads", ["parallel.tp=3"], "parallel.tp", "num_attention_heads=4"),
    T("pp_above_layers", ["parallel.pp=5"], "parallel.pp", "num_hidden_layers=4"),
    T("tp_zero", ["parallel.tp=0"], "parallel.tp: must be >= 1"),
    T("world_not_multiple_of_tp", ["parallel.tp=2", "parallel.world_size=3"], "parallel.world_size", "tp*pp*cp=2"),
    T("vpp_without_pipeline", ["parallel.vpp=2"], "parallel.vpp", "needs parallel.pp >= 2"),
    T("vpp_padded", ["parallel.pp=2", "parallel.vpp=2", "train.pack_sequences=false"], "parallel.vpp",
      "packed sequences, train.pack_sequences auto or true"),
    T("model_dir_missing", ["model.hf_path={root}/nope"], "model.hf_path", "no config.json"),
    T("config_json_corrupt", ["model.hf_path={bad_json}"], "model.hf_path", "config.json"),
    T("config_json_wrong_type", ["model.hf_path={heads_str}"], "num_attention_heads", "positive integer"),
    T("unsupported_architecture", ["model.hf_path={gpt2}"], "model.hf_path", "GPT2LMHeadModel", "not supported"),
    T("safetensors_missing", ["model.init=hf"], "model.hf_path", "no model.safetensors"),
    T("safetensors_truncated", ["model.hf_path={trunc}", "model.init=hf"], "model.hf_path",
      "model.safetensors", "cannot read"),
    T("vocab_mismatch_weights", ["model.hf_path={vocab_mismatch}", "model.init=hf"], "model.hf_path",
      "vocab size mismatch"),
    T("tokenizer_larger_than_vocab", ["model.hf_path={big_tok}"], "model.hf_path", "tokens but the model's "
      "vocab_size is 16"),
    T("tokenizer_corrupt", ["data.tokenizer_path={bad_tok}/tokenizer.model"], "data.tokenizer_path",
      "cannot load a tokenizer"),
    T("tokenizer_missing", ["data.tokenizer_path={root}/nope"], "data.tokenizer_path", "does not exist"),
    T("dataset_missing", ["data.train_path={root}/nope.jsonl"], "data.train_path: no such file"),
    T("dataset_empty", ["data.train_path={empty}"], "data.train_path", "no samples"),
    T("jsonl_malformed_line", ["data.train_path={bad_line}"], "data.train_path", "bad_line.jsonl:3",
      "invalid JSON"),
    T("jsonl_not_an_object", ["data.train_path={not_obj}"], "not_obj.jsonl:1", "JSON object"),
    T("jsonl_missing_key", ["data.train_path={no_key}"], "no_key.jsonl:2", "response"),
    T("jsonl_not_utf8", ["data.train_path={latin1}"], "data.train_path", "not UTF-8"),
    T("sft_prompt_longer_than_context", ["data.train_path={long}"], "long.jsonl:2", "train.max_seq_len=32"),
    T("rl_prompt_longer_than_context", ["data.train_path={rl_long}"], "rl_long.jsonl:1",
      "max_position_embeddings=64", base=GRPO),
    T("reward_module_missing", ["rollout.reward_fn=no_such_mod:fn"], "rollout.reward_fn", "no_such_mod",
      base=GRPO),
    T("reward_attribute_missing", ["rollout.reward_fn=megarl.rewards:nope"], "rollout.reward_fn",
      "nope", base=GRPO),
    T("workflow_class_missing", ["rollout.workflow=megarl.rollout.workflow:Nope"], "rollout.workflow",
      "Nope", base=GRPO),
    T("run_dir_not_writable", ["train.run_dir={a_file}/run"], "train.run_dir", "not a directory"),
    T("servers_listed_twice", ["rollout.servers=[{refused},{refused}/]"], "rollout.servers[1]: {refused}/ is "
      "listed twice (also rollout.servers[0]: {refused})", base=GRPO),
    T("server_refused", ["rollout.servers=[{refused}]"], "rollout.servers[0]", "/health",
      "health_timeout_s=3", base=GRPO),
    T("server_hangs", ["rollout.servers=[{hung}]"], "rollout.servers[0]", "/health", "health_timeout_s=3",
      base=GRPO),
    T("server_http_500", ["rollout.servers=[{http500}]"], "rollout.servers[0]", "/health answered HTTP 500",
      base=GRPO),
    T("server_malformed_json", ["rollout.servers=[{junk_json}]"], "rollout.servers[0]", "/model_info",
      "JSON object", base=GRPO),
    # config that silently meant something else: checks a misplaced return had cut off, declared
    # ranges of every section, duplicate keys, whole-section overrides, alternatives of one knob
    T("dead_check_temperature_zero", ["rollout.temperature=0"], "rollout.temperature: must be > 0, got 0.0",
      "nothing is learned", base=GRPO),
    T("dead_check_temperature_negative", ["rollout.temperature=-1"], "rollout.temperature: must be > 0, got -1.0",
      base=GRPO),
    T("dead_check_top_p", ["rollout.top_p=5"], "rollout.top_p: must be > 0 and <= 1, got 5.0", base=GRPO),
    T("dead_check_workflow_args", ["rollout.workflow_args=3"], "rollout.workflow_args: expected a mapping, got 3",
      base=GRPO),
    T("dead_check_health_timeout", ["rollout.health_timeout_s=-1"], "rollout.health_timeout_s: must be > 0",
      base=GRPO),
    T("health_timeout_huge", ["rollout.health_timeout_s=1e9"], "rollout.health_timeout_s: must be > 0 and "
      "<= 86400, got 1000000000.0", base=GRPO),
    T("range_adam_beta", ["optim.adam_beta1=1"], "optim.adam_beta1: must be >= 0 and < 1, got 1.0"),
    T("range_eval_interval", ["rollout.eval_interval=-1"], "rollout.eval_interval: must be >= 0, got -1"),
    T("range_algo_gamma", ["algo.gamma=2"], "algo.gamma: must be >= 0 and <= 1, got 2.0"),
    T("range_port", ["launch.server_port=70000"], "launch.server_port: must be >= 1 and <= 65535, got 70000"),
    T("range_seed_negative", ["rollout.seed=-1"], "rollout.seed: must be >= 0, got -1"),
    T("range_max_seq_len", ["train.max_seq_len=1"], "train.max_seq_len: must be >= 2, got 1"),
    T("wrong_type_float", ["rollout.temperature=hot"], "rollout.temperature: expected a number, got 'hot'"),
    T("wrong_type_optional_int", ["rollout.seed=1.5"], "rollout.seed: expected an integer, got 1.5"),
    T("config_duplicate_key", (), "config: ", "dup.yaml: duplicate key 'train' at line", "(first at line 7)",
      base=("{dup_yaml}",)),
    T("override_duplicate_key", ["train={{steps: 3, steps: 4}}"], "override", "duplicate key 'steps'"),
    T("section_override_merges", ["train={{steps: 3}}", "rollout.group_size=1"],
      "rollout.group_size: 1 with algo.advantage=grpo", base=GRPO),  # train.algorithm=rl kept
    T("section_override_not_a_mapping", ["train=3"], "train: expected a mapping, got 3"),
    T("section_override_scalar_then_field", ["train=5", "train.steps=3"], "train: expected a mapping, got 5"),
    T("staleness_both_set_disagree", ["rollout.staleness_threshold=0.5", "rollout.max_staleness=2"],
      "rollout.staleness_threshold: set either it", "(got 0.5 and 2)", base=GRPO),
    # settings that cannot learn
    T("cannot_learn_group_of_one", ["rollout.group_size=1"], "rollout.group_size: 1 with algo.advantage=grpo",
      "advantage 0", base=GRPO),
    T("cannot_learn_rloo_group_of_one", ["rollout.group_size=1", "algo.advantage=rloo"],
      "rollout.group_size: 1 with algo.advantage=rloo", base=GRPO),
    T("cannot_learn_dynamic_sampling", ["rollout.group_size=1", "algo.advantage=reinforce_pp",
                                        "algo.dynamic_sampling=true"], "algo.dynamic_sampling: drops groups",
      base=GRPO),
    # outputs that clobber another run
    T("export_into_another_run", ["checkpoint.hf_export_dir={other_run}/model"], "checkpoint.hf_export_dir: ",
      "inside the directory of another run", base=GRPO),
    T("save_dir_into_another_run", ["checkpoint.save_dir={other_run}/checkpoints"], "checkpoint.save_dir: ",
      "inside the directory of another run", base=GRPO),
    T("export_dir_contains_run_dir", ["checkpoint.hf_export_dir={root}/runs"], "checkpoint.hf_export_dir: ",
      "is or contains train.run_dir", base=GRPO),
    # checks that need the model or the servers: before any rank or server starts (no run dir)
    T("freeze_matches_nothing", ["optim.freeze=[nomatch.*]"], "optim.freeze: pattern 'nomatch.*' matches no "
      "tensor of LlamaForCausalLM"),
    T("freeze_half_a_fused_row", ["optim.freeze=[model.layers.0.self_attn.q_proj.weight]"], "optim.freeze: ",
      "is fused with", "freeze all of them or none"),
    T("wire_sglang_payload_into_megarl_server", ["weights.tensor_format=sglang", "weights.transport=tensor"],
      "weights.tensor_format: sglang over weights.transport=tensor", "megarl-server", base=GRPO),
]

OUT = ("{root}/outs/{id}",)
CONV = ("hf-to-mcore", "--out", "{root}/outs/{id}", "--hf")


def C(id, args, rc, *needles, base=CONV):  # noqa: N802
    return CliCase(id, "megarl-convert", base + tuple(args), rc, needles, OUT + ("{root}/outs/.tmp-{id}",))


def C2(id, args, *needles, present):  # noqa: N802 - an --out that would clobber the input
    return CliCase(id, "megarl-convert", ("hf-to-mcore",) + tuple(args), 1, needles,
                   ("{root}/.tmp-conv_in", "{conv_in}/sub", "{root}/.tmp-conv_parent"), present=present)


CONVERT = [
    C2("out_is_input", ["--hf", "{conv_in}", "--out", "{conv_in}", "--force"], "--out", "is the input (--hf",
       present=("{conv_in}/model.safetensors",)),
    C2("out_inside_input", ["--hf", "{conv_in}", "--out", "{conv_in}/sub"], "--out", "lies inside the input",
       present=("{conv_in}/model.safetensors",)),
    C2("out_contains_input", ["--hf", "{conv_parent}/model", "--out", "{conv_parent}", "--force"], "--out",
       "contains the input (--hf", present=("{conv_parent}/model/model.safetensors",)),
    C("hf_dir_missing", ["{root}/nope"], 1, "--hf", "no such directory"),
    C("hf_config_corrupt", ["{bad_json}"], 1, "config.json", "not valid JSON"),
    C("hf_unsupported_architecture", ["{gpt2}"], 1, "GPT2LMHeadModel", "not supported"),
    C("hf_safetensors_missing", ["{hf}"], 1, "no model.safetensors"),
    C("hf_safetensors_truncated", ["{trunc}"], 1, "model.safetensors", "cannot read"),
    C("hf_weights_nan", ["{nan_weights}"], 1, "{nan_weights}/model.safetensors: tensor lm_head.weight is all NaN"),
    C("hf_vocab_mismatch", ["{vocab_mismatch}"], 1, "vocab size mismatch", "vocab_size=20"),
    C("tp_not_dividing_heads", ["{model}", "--tp", "3"], 1, "--tp 3", "num_attention_heads=4"),
    C("out_not_empty", ["{model}"], 1, "--force", base=("hf-to-mcore", "--out", "{nonempty_out}", "--hf")),
    C("out_parent_missing", ["{model}"], 1, "parent directory",
      base=("hf-to-mcore", "--out", "{root}/nope/out", "--hf")),
    C("out_parent_not_writable", ["{model}"], 1, "--out /sys/megarl-out", "cannot write in /sys",
      base=("hf-to-mcore", "--out", "/sys/megarl-out", "--hf")),
    C("ckpt_not_a_checkpoint", ["{model}"], 1, "not a complete megarl checkpoint",
      base=("mcore-to-hf", "--out", "{root}/outs/{id}", "--ckpt")),
    C("missing_required_flag", [], 2, "hf-to-mcore", "--out", "required", base=("hf-to-mcore", "--hf", "{model}")),
    C("unknown_subcommand", [], 2, "invalid choice", base=("frobnicate",)),
]

LP = ("--ckpt", "{model}", "--output", "{root}/outs/{id}.jsonl", "--input")


def L(id, args, *needles, rc=1, base=LP):  # noqa: N802
    return CliCase(id, "megarl-logprobs", base + tuple(args), rc, needles,
                   ("{root}/outs/{id}.jsonl", "{root}/outs/{id}.jsonl.tmp"))


LOGPROBS = [
    L("ckpt_missing", ["{lp_ok}"], "--ckpt", "no such directory",
      base=("--ckpt", "{root}/nope", "--output", "{root}/outs/{id}.jsonl", "--input")),
    L("ckpt_unsupported_architecture", ["{lp_ok}"], "GPT2LMHeadModel",
      base=("--ckpt", "{gpt2}", "--output", "{root}/outs/{id}.jsonl", "--input")),
    L("ckpt_safetensors_truncated", ["{lp_ok}"], "cannot read",
      base=("--ckpt", "{trunc}", "--output", "{root}/outs/{id}.jsonl", "--input")),
    L("ckpt_weights_nan", ["{lp_ok}"], "{nan_weights}/model.safetensors: tensor lm_head.weight is all NaN",
      base=("--ckpt", "{nan_weights}", "--output", "{root}/outs/{id}.jsonl", "--input")),
    L("tp_not_dividing_heads", ["{lp_ok}", "--tp", "3"], "--tp 3"),
    L("input_missing", ["{root}/nope.jsonl"], "--input", "no such file"),
    L("input_malformed_line", ["{lp_bad_line}"], "lp_bad_line.jsonl:2", "invalid JSON"),
    L("token_id_out_of_vocab", ["{lp_oov}"], "lp_oov.jsonl:2", "token id 99", "[0, 16)"),
    L("token_id_negative", ["{lp_neg}"], "lp_neg.jsonl:1", "token id -1"),
    L("input_ids_not_a_list", ["{lp_str}"], "lp_str.jsonl:1", "input_ids"),
    L("input_empty", ["{lp_empty}"], "no input lines"),
    L("sequence_longer_than_context", ["{lp_long}"], "lp_long.jsonl:1", "max_position_embeddings=64"),
    L("output_dir_missing", ["{lp_ok}"], "--output", "does not exist",
      base=("--ckpt", "{model}", "--output", "{root}/nope/x.jsonl", "--input")),
    L("output_not_writable", ["{lp_ok}"], "--output /sys/megarl-x.jsonl", "cannot write in /sys",
      base=("--ckpt", "{model}", "--output", "/sys/megarl-x.jsonl", "--input")),
    CliCase("output_is_a_directory", "megarl-logprobs", ("--ckpt", "{model}", "--input", "{lp_ok}", "--output",
                                                         "{nonempty_out}"), 1, ("--output", "is a directory"),
            ("{nonempty_out}.tmp",), present=("{nonempty_out}/keep.txt",)),
    L("batch_size_zero", ["{lp_ok}", "--batch-size", "0"], "--batch-size"),
    CliCase("output_is_input", "megarl-logprobs", ("--ckpt", "{model}", "--input", "{lp_ok}", "--output", "{lp_ok}"),
            1, ("--output", "is the --input file"), ("{lp_ok}.tmp",), present=("{lp_ok}",)),
]

SV = ("--log-level", "WARNING", "--model")


def S(id, args, *needles, rc=2):  # noqa: N802
    return CliCase(id, "megarl-server", SV + tuple(args), rc, needles)


SERVER = [
    S("model_dir_missing", ["{root}/nope"], "--model", "no such directory"),
    S("config_json_missing", ["{no_config}"], "config.json", "not found"),
    S("config_json_corrupt", ["{bad_json}"], "config.json"),
    S("unsupported_architecture", ["{gpt2}"], "GPT2LMHeadModel", "unsupported architecture"),
    S("safetensors_missing", ["{hf}"], "no *.safetensors"),
    S("safetensors_truncated", ["{trunc}"], "model.safetensors", "cannot read safetensors"),
    S("tokenizer_larger_than_vocab", ["{big_tok}"], "tokenizer has", "vocab_size=16"),
    S("tokenizer_corrupt", ["{bad_tok}"], "cannot load the tokenizer"),
    S("port_in_use", ["{model}", "--port", "{busy_port}"], "cannot listen", "address already in use"),
    S("weights_root_missing", ["{model}", "--weights-root", "{root}/nope"], "--weights-root", "no such directory"),
    S("dtype_invalid", ["{model}", "--dtype", "int8"], "--dtype", "invalid choice"),
    S("port_out_of_range", ["{model}", "--port", "70000"], "--port", "out of range"),
    S("context_length_beyond_model", ["{model}", "--context-length", "100000"], "--context-length 100000",
      "max_position_embeddings=64", "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1"),
]
SERVER.append(CliCase("model_flag_missing", "megarl-server", ("--log-level", "WARNING"), 2, ("--model", "required")))

LAUNCH_BASE = ("--dry-run", "{grpo_yaml}", "model.hf_path={model}")


def P(id, args, *needles):  # noqa: N802 - megarl-launch: hostlists and numbers, one line, exit 2
    return CliCase(id, "megarl-launch", LAUNCH_BASE + tuple(args), 2, needles)


LAUNCH = [
    P("hostlist_backwards", ["--trainer-nodes", "gpu[05-01]"], "--trainer-nodes: 'gpu[05-01]': range 05-01 runs "
      "backwards"),
    P("hostlist_not_numeric", ["--trainer-nodes", "gpu[a-b]"], "--trainer-nodes", "[a-b] is not a list of numbers"),
    P("hostlist_unclosed", ["--trainer-nodes", "a", "--rollout-nodes", "gpu[01-04"], "--rollout-nodes",
      "unclosed '['"),
    P("hostlist_stray_bracket", ["--trainer-nodes", "gpu01]"], "--trainer-nodes", "']' without '['"),
    P("hostlist_empty_item", ["--trainer-nodes", "a,,b"], "--trainer-nodes: 'a,,b': empty host name"),
    P("hostlist_duplicate", ["--trainer-nodes", "n[1-2],n2"], "--trainer-nodes", "n2 is listed twice"),
    P("hostlist_huge_range", ["--trainer-nodes", "gpu[0-99999999999999]"], "--trainer-nodes",
      "more than 65536 hosts"),
    P("gpus_negative", ["--trainer-nodes", "a", "--gpus-per-node", "-8"], "--gpus-per-node: must be in [0, 1024], "
      "got -8"),
    P("tasks_per_node_huge", ["--trainer-nodes", "a", "--tasks-per-node", "1000000000"], "--tasks-per-node: must be "
      "in [0, 1024]"),
    P("master_port_out_of_range", ["--trainer-nodes", "a", "--master-port", "70000"], "--master-port: must be in "
      "[1, 65535], got 70000"),
    P("server_port_out_of_range", ["--trainer-nodes", "a", "launch.server_port=0"], "launch.server_port: must be "
      ">= 1 and <= 65535, got 0"),
    P("servers_past_last_port", ["--trainer-nodes", "a", "--rollout-nodes", "r", "launch.server_port=65535",
                                 "launch.servers_per_node=2"], "launch.server_port: 65535 + 2 servers per node"),
    P("servers_listed_twice", ["--trainer-nodes", "a", "rollout.servers=[h:30000,http://h:30000]"],
      "rollout.servers[1]: http://h:30000 is listed twice (also rollout.servers[0]: h:30000)"),
    P("section_override_scalar_then_field", ["--trainer-nodes", "a", "train=5", "train.steps=3"],
      "train: expected a mapping, got 5"),
    P("world_too_large", ["--trainer-nodes", "a", "parallel.world_size=1000000000"], "allocation: 1 trainer nodes x "
      "1000000000 ranks"),
]



def M(id, args, *needles, rc=2):  # noqa: N802
    return CliCase(id, "megarl-rollout-manager", tuple(args), rc, needles)


MANAGER = [  # megarl-rollout-manager started apart (rollout.manager_address): nothing listens on bad input
    M("config_file_missing", ["{root}/nope.yaml"], "config", "file not found"),
    M("config_duplicate_key", ["{dup_yaml}"], "duplicate key 'train'"),
    M("port_out_of_range", ["{mgr_yaml}", "--port", "70000"], "--port", "70000"),
    M("host_invalid", ["{mgr_yaml}", "--host", "no-such-host.invalid"], "--host no-such-host.invalid", "cannot listen"),
    M("host_not_local", ["{mgr_yaml}", "--host", "192.0.2.1"], "--host 192.0.2.1", "cannot listen"),
    M("port_in_use", ["{mgr_yaml}", "--port", "{busy_port}"], "cannot listen", "in use"),
    M("secret_file_not_set", ["{grpo_yaml}"], "rollout.manager_secret_file"),
    M("secret_file_readable_by_others", ["{mgr_open_yaml}"], "rollout.manager_secret_file", "readable by others"),
    M("no_config_argument", [], "config", "required"),
]

CLI_CASES = {f"{c.prog}:{c.id}": c for c in TRAIN + CONVERT + LOGPROBS + SERVER + LAUNCH + MANAGER}
NET = "waits on the network: the subprocess timeout is its no-hang bound"
CONSOLE = "the console entry as a process (its imports print nothing, its exit status)"
REAL = {  # run as subprocesses (run_cli), and why; every other CLI case in-process
    "megarl-train:server_refused": NET, "megarl-train:server_hangs": NET, "megarl-train:server_http_500": NET,
    "megarl-train:server_malformed_json": NET,
    "megarl-convert:hf_weights_nan": CONSOLE + ", after reading every weight",
    "megarl-logprobs:ckpt_weights_nan": CONSOLE + ", after reading every weight",
    "megarl-server:port_in_use": "starts the engine thread before the bind fails",
    "megarl-launch:world_too_large": CONSOLE,
    "megarl-rollout-manager:host_invalid": "a DNS lookup: " + NET,
}
DEBUG_CASES = {  # the same bad input with --debug: the traceback instead of one line
    "megarl-train": ["{sft_yaml}", "trian.steps=3", "--debug"],
    "megarl-convert": ["hf-to-mcore", "--hf", "{root}/nope", "--out", "{root}/outs/dbg", "--debug"],
    "megarl-logprobs": ["--ckpt", "{root}/nope", "--input", "{lp_ok}", "--output", "{root}/outs/dbg.jsonl",
                        "--debug"],
    "megarl-server": ["--model", "{root}/nope", "--debug"],
    "megarl-rollout-manager": ["{root}/nope.yaml", "--debug"],
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    w = World(str(tmp_path_factory.mktemp("badinput")))
    yield w
    w.close()


@pytest.fixture(scope="module")
def cli_results(world):
    """Every CLI case (and the --debug runs, in-process); {key: CliResult}."""
    results = run_cases(CLI_CASES, world.fill, world.root, workers=4, real=REAL)
    for prog, args in DEBUG_CASES.items():
        results[f"debug:{prog}"] = run_in_process(prog, [world.fill(a) for a in args], world.root)
    return results


@pytest.mark.parametrize("key", list(CLI_CASES))
def test_cli_case(key, cli_results, world):
    check_cli_result(CLI_CASES[key], cli_results[key], world.fill)


def test_corpus_size():
    by_tool = {}
    for c in CLI_CASES.values():
        by_tool[c.prog] = by_tool.get(c.prog, 0) + 1
    assert sum(by_tool.values()) + len(HTTP_CASES) >= 40, by_tool


def test_every_entry_point_runs_as_a_real_process():
    """In-process cases call main(argv); at least one case of each entry point runs the console
    path itself."""
    assert {CLI_CASES[k].prog for k in REAL} == set(MODULES)


@pytest.mark.parametrize("prog", list(DEBUG_CASES))
def test_debug_flag_shows_the_traceback(prog, cli_results):
    res = cli_results[f"debug:{prog}"]
    assert not res.leaks, res.leaks
    assert res.rc == 1 and "Traceback (most recent call last)" in res.stderr, res.stderr[-2000:]


def test_docs_list_every_case():
    missing = docs_missing(list(CLI_CASES) + [f"http:{c[0]}" for c in HTTP_CASES])
    assert not missing, missing


def test_server_port_zero_logs_the_port_it_bound():
    """--port 0: the kernel picks the port, and the ready line names that one (it said ``:0``)."""
    import re
    import subprocess
    import sys
    import time

    from badinput_support import TINY

    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "megarl.server", "--model", f"{TINY}/model", "--port", "0"],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline, line = time.monotonic() + 120, ""
        while "ready on" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stderr.readline()
        m = re.search(r"ready on http://127\.0\.0\.1:(\d+) ", line)
        assert m and int(m.group(1)) > 0, line
        assert http("GET", f"http://127.0.0.1:{m.group(1)}/health")[0] == 200
    finally:
        proc.kill()
        proc.wait(timeout=10)


OLD_LINE = "megarl-server: an earlier run's last words"


def test_a_dying_server_is_quoted_from_this_start_of_its_log(tmp_path):
    """The local server's log is appended to across runs in one run_dir; a server that dies at
    start is quoted from its own lines (it quoted the earlier run's last line)."""
    run = tmp_path / "run"
    (run / "servers").mkdir(parents=True)
    (run / "servers" / "server0.log").write_text(OLD_LINE + "\n")
    res = run_cli("megarl-train", [f"{REPO}/configs/tiny_grpo.yaml", f"model.hf_path={REPO}/examples/tiny/model",
                                   f"data.train_path={REPO}/examples/tiny/data/rl_prompts.jsonl", "data.eval_path=",
                                   f"train.run_dir={run}", "rollout.server_args=[--context-length,100000]"],
                  str(tmp_path), timeout=300)
    # (after the ranks started: Megatron's import warnings may precede the error line)
    lines = [x for x in res.stderr.splitlines() if x.startswith("megarl-train: ")]
    assert res.rc and len(lines) == 1, res.stderr[-3000:]
    assert "megarl-server exited early" in lines[0] and "--context-length 100000" in lines[0], lines[0]
    assert OLD_LINE not in res.stderr
    assert (run / "servers" / "server0.log").read_text().startswith(OLD_LINE)  # appended, not replaced


def test_a_manager_that_fails_to_start_is_quoted_from_this_start_of_its_log(tmp_path):
    from megarl.common.procs import log_size
    from megarl.trainer.manager_process import start_process, wait_listening

    log = tmp_path / "manager.log"
    log.write_text(f"{OLD_LINE}\n")
    since = log_size(str(log))
    proc = start_process(str(tmp_path / "nope.yaml"), "127.0.0.1", str(log), b"s" * 32)
    with pytest.raises(RuntimeError) as e:
        wait_listening(proc, str(log), since)
    assert "did not start" in str(e.value) and "nope.yaml" in str(e.value) and OLD_LINE not in str(e.value)


# ----------------------------------------------------------------------------- HTTP, one server

NAN = b'{"input_ids": [1, 2], "sampling_params": {"temperature": NaN}}'
INF = b'{"input_ids": [1, 2], "sampling_params": {"top_p": Infinity}}'
BIG = b'{"input_ids": [1, 2], "sampling_params": {"temperature": 1' + b"0" * 400 + b"}}"
DEEP = b"[" * 100_000 + b"]" * 100_000
G, TN = "/generate", "/update_weights_from_tensor"
DS, DI = "/update_weights_from_disk", "/update_weights_from_distributed"


def sp(**kw):
    return {"input_ids": [1, 2, 3], "sampling_params": kw}


# (id, method, path, body, status, substring of the message); the body may name {root} paths
HTTP_CASES = [
    ("body_not_json", "POST", G, b"{not json", 400, "JSON"),
    ("body_not_utf8", "POST", G, b'{"input_ids": "\xff\xfe"}', 400, "JSON"),
    ("body_nested_too_deep", "POST", G, DEEP, 400, "nested too deeply"),
    ("body_a_list", "POST", G, [1, 2, 3], 400, "JSON object"),
    ("no_prompt", "POST", G, {"sampling_params": {}}, 400, "input_ids or text"),
    ("prompt_both_ids_and_text", "POST", G, {"input_ids": [1], "text": "a"}, 400, "exactly one"),
    ("input_ids_a_string", "POST", G, {"input_ids": "1 2"}, 400, "input_ids"),
    ("input_ids_empty", "POST", G, {"input_ids": []}, 400, "input_ids"),
    ("input_ids_float", "POST", G, {"input_ids": [1, 2.5]}, 400, "input_ids"),
    ("input_ids_bool", "POST", G, {"input_ids": [1, True]}, 400, "input_ids"),
    ("input_ids_out_of_vocab", "POST", G, {"input_ids": [1, 128]}, 400, "vocab size 128"),
    ("input_ids_negative", "POST", G, {"input_ids": [1, -1]}, 400, "invalid token id -1"),
    ("input_ids_batch_with_empty", "POST", G, {"input_ids": [[1, 2], []]}, 400, "input_ids[1]"),
    ("text_wrong_type", "POST", G, {"text": 5}, 400, "text"),
    ("prompt_longer_than_context", "POST", G, {"input_ids": [1] * 64}, 400, "context length 64"),
    ("sampling_params_not_object", "POST", G, {"input_ids": [1], "sampling_params": "hot"}, 400, "sampling_params"),
    ("sampling_params_list_length", "POST", G, {"input_ids": [[1], [2]], "sampling_params": [{}]}, 400,
     "sampling_params"),
    ("unknown_sampling_field", "POST", G, sp(bogus=1), 400, "bogus"),
    ("max_new_tokens_negative", "POST", G, sp(max_new_tokens=-1), 400, "max_new_tokens"),
    ("max_new_tokens_string", "POST", G, sp(max_new_tokens="10"), 400, "max_new_tokens"),
    ("max_new_tokens_fraction", "POST", G, sp(max_new_tokens=1.5), 400, "max_new_tokens"),
    ("max_new_tokens_bool", "POST", G, sp(max_new_tokens=True), 400, "max_new_tokens"),
    ("max_new_tokens_huge", "POST", G, sp(max_new_tokens=10**12), 400,
     "prompt of 3 tokens + sampling_params.max_new_tokens=1000000000000 = 1000000000003 tokens exceeds the "
     "context length 64"),
    ("prompt_plus_max_new_tokens_over_context", "POST", G, sp(max_new_tokens=62), 400,
     "3 tokens + sampling_params.max_new_tokens=62 = 65 tokens exceeds the context length 64"),
    ("batch_entry_over_context", "POST", G, {"input_ids": [[1, 2], [1] * 40], "sampling_params": [
        {"max_new_tokens": 8}, {"max_new_tokens": 30}]}, 400, "input_ids[1]: prompt of 40 tokens"),
    ("max_new_tokens_default_capped", "POST", G, {"input_ids": [1, 2, 3], "sampling_params": {
        "temperature": 0, "ignore_eos": True}}, 200, None),
    ("unknown_top_level_field", "POST", G, {"input_ids": [1], "bogus": 1}, 400, "unknown field(s) ['bogus']"),
    ("top_level_typo", "POST", G, {"input_ids": [1], "sampling_param": {"temperature": 0}}, 400,
     "unknown field(s) ['sampling_param']"),
    ("sglang_field_unsupported_value", "POST", G, {"input_ids": [1], "top_logprobs_num": 5}, 400,
     "top_logprobs_num=5 is not supported by the CPU server"),
    ("sglang_field_noop_value", "POST", G, {"input_ids": [1], "logprob_start_len": -1,
                                            "return_text_in_logprobs": False, "sampling_params": {
                                                "max_new_tokens": 2}}, 200, None),
    ("temperature_nan", "POST", G, NAN, 400, "temperature"),
    ("top_p_infinity", "POST", G, INF, 400, "top_p"),
    ("temperature_beyond_float", "POST", G, BIG, 400, "temperature"),
    ("top_p_zero", "POST", G, sp(top_p=0), 400, "top_p"),
    ("top_k_above_vocab", "POST", G, sp(top_k=10**6), 400, "top_k"),
    ("n_zero", "POST", G, sp(n=0), 400, "n="),
    ("n_huge", "POST", G, sp(n=10**6), 400, "n="),
    ("stop_not_strings", "POST", G, sp(stop=[3]), 400, "stop"),
    ("stop_token_ids_strings", "POST", G, sp(stop_token_ids=["a"]), 400, "stop_token_ids"),
    ("seed_string", "POST", G, sp(seed="x"), 400, "seed"),
    ("return_logprob_string", "POST", G, {"input_ids": [1], "return_logprob": "yes"}, 400, "return_logprob"),
    ("rid_wrong_type", "POST", G, {"input_ids": [1], "rid": 5}, 400, "rid"),
    ("stream_unsupported", "POST", G, {"input_ids": [1], "stream": True}, 400, "stream"),
    ("unknown_endpoint", "POST", "/no_such_endpoint", {}, 404, None),
    ("wrong_method", "GET", G, None, 405, None),
    ("pause_mode_unknown", "POST", "/pause_generation", {"mode": "nap"}, 400, "mode"),
    ("pause_mode_wrong_type", "POST", "/pause_generation", {"mode": 5}, 400, "mode"),
    ("abort_without_rid", "POST", "/abort_request", {}, 400, "rid"),
    ("abort_rid_wrong_type", "POST", "/abort_request", {"rid": 5}, 400, "rid"),
    ("tensor_payload_not_list", "POST", TN, {"serialized_named_tensors": "abc"}, 400, "serialized_named_tensors"),
    ("tensor_entry_not_string", "POST", TN, {"serialized_named_tensors": [123]}, 400, "serialized_named_tensors[0]"),
    ("tensor_entry_not_base64", "POST", TN, {"serialized_named_tensors": ["!!"]}, 400, "base64"),
    ("tensor_entry_junk_bytes", "POST", TN, {"serialized_named_tensors": ["AAECAwQFBgc="]}, 400, "safetensors"),
    ("tensor_load_format_unknown", "POST", TN, {"serialized_named_tensors": [], "load_format": "direct"}, 400,
     "load_format"),
    ("tensor_unknown_name", "POST", TN, "{unknown_name}", 400, "unknown parameter"),
    ("tensor_wrong_shape", "POST", TN, "{wrong_shape}", 400, "shape"),
    ("tensor_half_good_half_bad", "POST", TN, "{half_bad}", 400, "shape"),
    ("dist_lengths_differ", "POST", DI, {"names": ["a"], "dtypes": [], "shapes": [[1]]}, 400, "equal length"),
    ("dist_dtype_unknown", "POST", DI, {"names": ["a"], "dtypes": ["int4"], "shapes": [[1]]}, 400, "dtypes"),
    ("dist_shape_negative", "POST", DI, {"names": ["a"], "dtypes": ["float32"], "shapes": [[-1]]}, 400, "shapes[0]"),
    ("dist_without_group", "POST", DI, {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]},
     400, "no weight update group"),
    ("disk_path_wrong_type", "POST", DS, {"model_path": 5}, 400, "model_path"),
    ("disk_path_outside_roots", "POST", DS, {"model_path": "/etc"}, 400, "outside the allowed weight roots"),
    ("disk_path_dotdot_escape", "POST", DS, {"model_path": "{root}/../.."}, 400, "outside the allowed"),
    ("disk_dir_missing", "POST", DS, {"model_path": "{root}/nope"}, 400, "no such directory"),
    ("disk_safetensors_truncated", "POST", DS, {"model_path": "{root}/w_trunc"}, 400, "cannot read safetensors"),
    ("disk_tensors_missing", "POST", DS, {"model_path": "{root}/w_missing"}, 400, "lacks 1 tensors"),
    ("group_master_unreachable", "POST", "/init_weights_update_group", "{unreachable}", 400,
     "init_weights_update_group failed"),
    ("group_port_wrong_type", "POST", "/init_weights_update_group",
     {"master_address": "127.0.0.1", "master_port": "x", "world_size": 2}, 400, "master_port"),
    ("group_rank_out_of_range", "POST", "/init_weights_update_group",
     {"master_address": "127.0.0.1", "master_port": 1234, "world_size": 2, "rank_offset": 0}, 400, "rank_offset"),
    ("group_timeout_wrong_type", "POST", "/init_weights_update_group",
     {"master_address": "127.0.0.1", "master_port": 1234, "world_size": 2, "timeout": "soon"}, 400, "timeout"),
    ("group_destroy_unknown", "POST", "/destroy_weights_update_group", {"group_name": "nope"}, 400, "nope"),
    ("weights_by_name_unknown", "POST", "/get_weights_by_name", {"name": "nope"}, 400, "nope"),
    ("weights_by_name_bad_size", "POST", "/get_weights_by_name", {"name": "model.norm.weight",
                                                                  "truncate_size": "x"}, 400, "truncate_size"),
    ("weight_version_wrong_type", "POST", "/update_weight_version", {"new_version": [1]}, 400, "new_version"),
    ("checksum_names_missing", "POST", "/weights_checksum", {}, 400, "names is required"),
    ("checksum_name_unknown", "POST", "/weights_checksum", {"names": ["nope"]}, 400, "nope"),
    ("checksum_dtypes_length", "POST", "/weights_checksum", {"names": ["model.norm.weight"],
                                                            "dtypes": []}, 400, "dtypes"),
    ("checksum_dtype_unknown", "POST", "/weights_checksum", {"names": ["model.norm.weight"],
                                                            "dtypes": ["int4"]}, 400, "dtypes"),
]
GOOD = {"input_ids": [1, 5, 9], "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}


@pytest.fixture(scope="module")
def corpus_server(tiny_model, tmp_path_factory):
    """One real megarl-server (context 64, API key) and the payloads/dirs the cases name."""
    import torch
    from safetensors.torch import save_file

    from megarl.protocol.tensor_wire import encode_megarl

    path, sd = tiny_model
    root = str(tmp_path_factory.mktemp("weights_root"))
    for name, drop in (("w_trunc", None), ("w_missing", "model.norm.weight")):
        os.makedirs(os.path.join(root, name))
        save_file({k: v for k, v in sd.items() if k != drop}, os.path.join(root, name, "model.safetensors"))
    st = os.path.join(root, "w_trunc", "model.safetensors")
    open(st, "wb").write(open(st, "rb").read()[:2000])
    srv = ServerProc(path, "--context-length", "64", "--weights-root", root, api_key=KEY).wait_ready()
    fills = {
        "unknown_name": {"serialized_named_tensors": [encode_megarl({"x.weight": torch.zeros(2)})]},
        "wrong_shape": {"serialized_named_tensors": [encode_megarl({"model.norm.weight": torch.zeros(3)})]},
        "half_bad": {"serialized_named_tensors": [encode_megarl({"model.norm.weight": torch.zeros(64),
                                                                 "lm_head.weight": torch.zeros(5, 64)})]},
        "unreachable": {"master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2,
                        "rank_offset": 1, "group_name": "corpus", "timeout": 3},
    }
    code, base = http("POST", srv.url + G, GOOD, key=KEY)
    assert code == 200, base
    yield srv, root, fills, base["output_ids"]
    srv.stop()


def _body(body, root, fills):
    if isinstance(body, str):
        return fills[body.strip("{}")]
    if isinstance(body, dict):
        return {k: v.replace("{root}", root) if isinstance(v, str) else v for k, v in body.items()}
    return body


@pytest.mark.parametrize("case", HTTP_CASES, ids=[c[0] for c in HTTP_CASES])
def test_http_case(case, corpus_server):
    srv, root, fills, baseline = corpus_server
    cid, method, path, body, status, needle = case
    code, out = http(method, srv.url + path, _body(body, root, fills), key=KEY, timeout=90)
    assert code == status, out
    if needle is not None:
        assert isinstance(out, dict) and needle in out["message"], out
    if cid == "max_new_tokens_default_capped":  # no max_new_tokens: the context bounds it, 64 - 3
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 61}
    # the server is up, not paused, and answers exactly as before
    assert http("GET", srv.url + "/health_generate", key=KEY)[0] == 200  # keyed: it runs the model
    code, good = http("POST", srv.url + G, GOOD, key=KEY)
    assert code == 200 and good["output_ids"] == baseline, good
