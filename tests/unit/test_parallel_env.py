"""Rank discovery from launcher environments, SLURM hostlists, and the optional-deps decisions."""
import pytest

from megarl.common import compat
from megarl.models import builder
from megarl.models.random_hf import tiny_config, write_random_hf
from megarl.models.layouts import pad_vocab
from megarl.protocol.hf_model import read_model_args
from megarl.trainer.parallel import discover_ranks, expand_nodelist, under_launcher


def test_expand_nodelist():
    assert expand_nodelist("gpu[01-03,07],cpu1") == ["gpu01", "gpu02", "gpu03", "gpu07", "cpu1"]
    assert expand_nodelist("n[8-10]") == ["n8", "n9", "n10"]
    assert expand_nodelist("a,b[2]") == ["a", "b2"]
    assert expand_nodelist("node001") == ["node001"]


def test_torchrun_env():
    r = discover_ranks({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "h",
                        "MASTER_PORT": "1234"})
    assert (r.rank, r.world_size, r.local_rank, r.master_addr, r.master_port, r.source) == \
        (3, 8, 1, "h", 1234, "torchrun")


def test_slurm_env_master_from_nodelist():
    r = discover_ranks({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                        "SLURM_JOB_NODELIST": "gpu[12-13]"})
    assert (r.rank, r.world_size, r.local_rank, r.master_addr, r.source) == (5, 8, 1, "gpu12", "slurm")


def test_mpi_wins_over_slurm():
    # under mpirun inside a one-node sbatch job every rank sees SLURM_PROCID=0
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "OMPI_COMM_WORLD_RANK": "2",
           "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "2"}
    r = discover_ranks(env)
    assert (r.rank, r.world_size, r.local_rank, r.source) == (2, 4, 2, "ompi")
    r = discover_ranks({"PMIX_RANK": "1", "SLURM_NTASKS": "2", "SLURM_PROCID": "1"})
    assert (r.rank, r.world_size, r.source) == (1, 2, "pmix")
    r = discover_ranks({"PMI_RANK": "1", "PMI_SIZE": "3"})
    assert (r.rank, r.world_size, r.source) == (1, 3, "pmi")


def test_single_process_default():
    r = discover_ranks({})
    assert (r.rank, r.world_size, r.master_addr, r.source) == (0, 1, "127.0.0.1", "single")
    assert not under_launcher({}) and under_launcher({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"})


@pytest.mark.skipif(compat.HAVE_CUDA, reason="checks the CPU-only decisions")
def test_cpu_decisions(tmp_path):
    assert builder.resolve_spec("auto") is False and builder.resolve_spec("local") is False
    with pytest.raises(ValueError, match="^model.spec: 'te' needs transformer-engine and a CUDA"):
        builder.resolve_spec("te")
    args = read_model_args(write_random_hf(str(tmp_path), tiny_config(vocab_size=130)))
    with pytest.raises(ValueError, match="^model.dtype: bfloat16 needs a GPU"):
        builder.transformer_config(args, tp=1, pp=1, dtype="bfloat16")
    with pytest.raises(ValueError, match="^parallel.sequence_parallel: needs the Transformer Engine"):
        builder.transformer_config(args, tp=2, pp=1, sequence_parallel=True)
    with pytest.raises(ValueError, match="^model.make_vocab_size_divisible_by: the Megatron vocabulary "
                                         "130 is not divisible by parallel.tp=4"):
        builder.transformer_config(args, tp=4, pp=1)  # unpadded: the engine always pads first
    assert builder.transformer_config(pad_vocab(args, 128, 4), tp=4, pp=1).tensor_model_parallel_size == 4
    uneven = builder.transformer_config(args, tp=1, pp=3)  # 4 layers over 3 stages: [1, 2, 1]
    assert (uneven.num_layers_in_first_pipeline_stage, uneven.num_layers_in_last_pipeline_stage) == (1, 1)
    assert builder.transformer_config(args, tp=1, pp=2).num_layers_in_first_pipeline_stage is None
    cfg = builder.transformer_config(args, tp=2, pp=2)
    assert cfg.use_cpu_initialization and cfg.variable_seq_lengths and cfg.calculate_per_token_loss
    assert cfg.num_query_groups == 2 and cfg.kv_channels == 16 and cfg.normalization == "RMSNorm"


def test_master_from_the_step_nodelist():
    # a trainer step on a subset of the job's nodes (rollout nodes first): its own first node
    r = discover_ranks({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-3]",
                        "SLURM_STEP_NODELIST": "n[2-3]"})
    assert r.master_addr == "n2"
