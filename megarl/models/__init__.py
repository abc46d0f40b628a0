"""Model construction (HF config -> Megatron GPTModel) and everything HF <-> Megatron about weights.

The per-architecture name tables and the HF config reader are `megarl.protocol.hf_model`, the one
architecture table `megarl.protocol.architectures` (the server and the manager read the same
description). `transforms` (QKV / gate-up tensor ops), `layouts`
(shapes and row conversions, full and TP-sharded), `hf_io` (safetensors load/export), `builder`
(TransformerConfig + GPTModel), `random_hf` (tiny random checkpoints).
"""
