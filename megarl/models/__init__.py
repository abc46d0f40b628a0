"""Model construction (HF config -> Megatron GPTModel) and everything HF <-> Megatron about weights.

`registry` (per-architecture name tables), `transforms` (QKV / gate-up tensor ops), `layouts`
(shapes and row conversions, full and TP-sharded), `hf_io` (safetensors load/export), `builder`
(TransformerConfig + GPTModel), `random_hf` (tiny random checkpoints).
"""
