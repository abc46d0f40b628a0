"""The model, parallel-layout, optimizer and critic sections (`model.*`, `parallel.*`, `optim.*`,
`critic.*`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megarl.config.common import _check, _choice
from megarl.common.errors import ConfigError
from megarl.common.fields import bounded


@dataclass
class ModelConfig:
    hf_path: str = ""
    """HF model directory: config.json (architecture, sizes) and, for init=hf, safetensors."""
    init: str = "hf"
    """hf: load the HF safetensors in hf_path; random: fresh init from config.json only."""
    dtype: str = "float32"
    """Parameter/compute dtype: float32 or bfloat16 (bf16 needs a GPU)."""
    seed: int = bounded(1234, ge=0)
    """Seed for weight init and dropout."""
    spec: str = "auto"
    """Layer spec: auto (TE when TE and CUDA are present, else local), te, or local."""
    attention: str = "sdpa"
    """Core attention of the local spec: sdpa (torch's fused scaled_dot_product_attention) or
    unfused (megatron-core's DotProductAttention). The TE spec uses TE's kernels either way."""
    recompute: bool = False
    """Full activation recomputation (saves memory for large models)."""
    ref_hf_path: str = ""
    """Reference policy for the KL term (HF directory, loaded frozen with the same parallel
    layout when algo.kl_coef > 0); empty = the initial weights (model.hf_path)."""
    make_vocab_size_divisible_by: int = bounded(128, ge=1)
    """Megatron pads the embedding and output layer to a multiple of this times parallel.tp (as
    Megatron's trainer does); the padding is stripped from every export and masked in logprobs."""

    def validate(self) -> None:
        _check(self, "model")
        _choice("model.init", self.init, ("hf", "random"))
        _choice("model.dtype", self.dtype, ("float32", "bfloat16"))
        _choice("model.spec", self.spec, ("auto", "te", "local"))
        _choice("model.attention", self.attention, ("sdpa", "unfused"))
        if not self.hf_path:
            raise ConfigError("model.hf_path: required (an HF model directory with config.json)")


@dataclass
class ParallelConfig:
    tp: int = bounded(1, ge=1)
    """Tensor-parallel size; must divide attention heads and query groups."""
    pp: int = bounded(1, ge=1)
    """Pipeline-parallel size, up to the number of layers (uneven splits: docs/models.md)."""
    first_stage_layers: Optional[int] = bounded(None, ge=1)
    """Layers on the first pipeline stage (Megatron's num_layers_in_first_pipeline_stage; the
    middle stages split the rest evenly); null = automatic."""
    last_stage_layers: Optional[int] = bounded(None, ge=1)
    """Layers on the last pipeline stage (num_layers_in_last_pipeline_stage); null = automatic."""
    ep: int = bounded(1, ge=1)
    """Expert-parallel size for MoE models (experts split over this many ranks of the DP
    dimension; must divide the experts and the DP size). 1 for dense models."""
    cp: int = bounded(1, ge=1)
    """Context-parallel size: each sequence split over this many ranks (2 x cp chunks, rank r
    holding chunks r and 2cp-1-r), attention exchanging keys and values between them
    (docs/long_context.md). Data-parallel size = world / (tp * pp * cp)."""
    cp_comm_type: str = "p2p"
    """How Transformer Engine's attention exchanges K/V over the CP group (GPU, TE spec): p2p (ring),
    all_gather, a2a or a2a+p2p. megarl's CPU attention always all-gathers K/V."""
    vpp: Optional[int] = bounded(None, ge=2)
    """Virtual pipeline stages per rank (interleaved 1F1B): each rank holds vpp model chunks of
    layers/(pp*vpp) layers; needs parallel.pp >= 2 and train.pack_sequences (docs/models.md,
    "Interleaved pipeline"). null = plain 1F1B."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs the TE spec and TP > 1)."""
    distributed_optimizer: bool = False
    """Shard optimizer state over DP (Megatron distributed optimizer)."""
    backend: str = "auto"
    """torch.distributed backend: auto (nccl on GPU, gloo on CPU), nccl or gloo."""
    world_size: Optional[int] = bounded(None, ge=1)
    """Ranks to start when run directly (not under torchrun/srun/mpirun); default tp*pp*cp."""

    @property
    def model_parallel(self) -> int:
        """Ranks that hold one replica of the model: tp * pp * cp."""
        return self.tp * self.pp * self.cp

    def validate(self) -> None:
        _check(self, "parallel")
        _choice("parallel.backend", self.backend, ("auto", "nccl", "gloo"))
        _choice("parallel.cp_comm_type", self.cp_comm_type, ("p2p", "all_gather", "a2a", "a2a+p2p"))
        if self.world_size is not None:
            if self.world_size % self.model_parallel:
                raise ConfigError(f"parallel.world_size: {self.world_size} is not divisible by "
                                  f"tp*pp*cp={self.model_parallel}")


@dataclass
class OptimConfig:
    lr: float = bounded(1e-5, gt=0)
    """Peak learning rate."""
    min_lr: float = bounded(0.0, ge=0)
    """Learning rate at the end of decay."""
    weight_decay: float = bounded(0.0, ge=0)
    """Decoupled weight decay (AdamW)."""
    adam_beta1: float = bounded(0.9, ge=0, lt=1)
    """Adam beta1."""
    adam_beta2: float = bounded(0.999, ge=0, lt=1)
    """Adam beta2."""
    adam_eps: float = bounded(1e-8, gt=0)
    """Adam epsilon."""
    clip_grad: float = bounded(1.0, ge=0)
    """Global grad-norm clip; 0 disables clipping."""
    lr_warmup_steps: int = bounded(0, ge=0)
    """Linear warmup steps."""
    lr_decay_style: str = "constant"
    """constant, linear or cosine."""
    lr_decay_steps: Optional[int] = bounded(None, ge=1)
    """Steps over which to decay (default: train.steps)."""
    freeze: list[str] = field(default_factory=list)
    """Policy tensors that do not train: shell-style patterns (fnmatch: * also crosses dots) over
    the HF checkpoint's tensor names, e.g. ["model.embed_tokens.weight"] or ["model.layers.0.*",
    "model.layers.1.*"]. Frozen parameters have no gradient or Adam state, and with weights.delta
    the pushes after the first skip them. A pattern matching nothing, one that splits a fused
    Megatron parameter (q/k/v, gate/up) or freezing everything is a config error."""

    def validate(self) -> None:
        _check(self, "optim")
        if any(not isinstance(p, str) or not p for p in self.freeze):
            raise ConfigError(f"optim.freeze: must be a list of non-empty name patterns; got {self.freeze!r}")
        if self.min_lr > self.lr:
            raise ConfigError(f"optim.min_lr: must be in [0, optim.lr], got {self.min_lr}")
        _choice("optim.lr_decay_style", self.lr_decay_style, ("constant", "linear", "cosine"))


@dataclass
class CriticConfig:
    hf_path: str = ""
    """Critic backbone (HF directory) for algo.advantage=gae; empty = model.hf_path. Its LM head is
    replaced by a fresh scalar value head."""
    lr: Optional[float] = bounded(None, gt=0)
    """Critic peak learning rate; null = optim.lr. Other optimizer settings come from optim, with
    optim.min_lr capped at this lr (a floor above the peak would make the schedule rise) and
    optim.freeze not applied (it names the policy's tensors)."""
    value_clip: Optional[float] = bounded(0.2, gt=0)
    """Value clip c: the loss also scores V_old + clip(V - V_old, -c, c); null = off."""
    warmup_steps: int = bounded(0, ge=0)
    """RL steps that train only the critic before the actor starts updating."""

    def validate(self) -> None:
        _check(self, "critic")
