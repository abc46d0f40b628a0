"""Model construction (HF config -> Megatron GPTModel) and HF weight tables and I/O."""
