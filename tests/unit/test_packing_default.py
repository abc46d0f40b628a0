"""train.pack_sequences auto (the default): packed wherever packing is exact - dense models whose
attention takes THD sequences (sdpa, or the TE spec) - padded for MoE models and megatron-core's
unfused attention; true and false kept. The engine resolves it once (`packs_sequences`); the
interleaved pipeline, which needs packing, passes with auto on a dense model and is refused in one
line where auto pads."""
import os

import pytest

from megarl.common.errors import ConfigError
from megarl.config import ModelConfig, load_config, packs_sequences

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(REPO, "configs", "tiny_grpo.yaml")


@pytest.mark.parametrize("value,want", [(None, None), ("auto", None), ("true", True), ("false", False)])
def test_auto_is_the_default_and_reads_from_the_command_line(value, want):
    overrides = [] if value is None else [f"train.pack_sequences={value}"]
    assert load_config(DEMO, overrides).train.pack_sequences is want


def test_a_bad_value_names_the_field():
    with pytest.raises(ConfigError, match="^train.pack_sequences: expected true/false, got 'packed'"):
        load_config(DEMO, ["train.pack_sequences=packed"])


# (pack_sequences, attention, spec, experts) -> packed
CASES = [(None, "sdpa", "local", 0, True), (None, "sdpa", "auto", 0, True), (None, "sdpa", "te", 0, True),
         (None, "unfused", "te", 0, True), (None, "unfused", "local", 0, False), (None, "unfused", "auto", 0, False),
         (None, "sdpa", "local", 8, False), (False, "sdpa", "local", 0, False), (True, "sdpa", "local", 0, True)]


@pytest.mark.parametrize("pack,attention,spec,experts,want", CASES)
def test_resolved_where_exact(pack, attention, spec, experts, want):
    assert packs_sequences(pack, ModelConfig(attention=attention, spec=spec), experts) is want


def test_the_interleaved_pipeline_takes_auto_on_a_dense_model():
    cfg = load_config(DEMO, ["parallel.pp=2", "parallel.vpp=2", "train.global_batch_size=16"])
    assert cfg.train.pack_sequences is None and cfg.parallel.vpp == 2
    for extra, why in ((["train.pack_sequences=false"], "parallel.vpp: the interleaved schedule needs"),
                       (["model.attention=unfused"], "parallel.vpp: the interleaved schedule needs"),
                       (["model.attention=unfused", "train.pack_sequences=true"], "train.pack_sequences: megatron")):
        with pytest.raises(ConfigError, match=f"^{why}"):
            load_config(DEMO, ["parallel.pp=2", "parallel.vpp=2", "train.global_batch_size=16", *extra])
