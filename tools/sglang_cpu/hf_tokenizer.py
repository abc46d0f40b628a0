"""A copy of a megarl model directory that SGLang can serve: the weights and config plus an HF
`tokenizer.json` with the same ids as its sentencepiece `tokenizer.model` (SGLang loads tokenizers
with transformers and cannot read a bare sentencepiece model; megarl keeps reading tokenizer.model,
which it looks for first). For character-level vocabularies such as the demo's (one piece per
character), which is what examples/tiny and examples/tiny_moe ship.

    python tools/sglang_cpu/hf_tokenizer.py --model examples/tiny/model --out /tmp/tiny-sglang
"""
from __future__ import annotations

import argparse
import json
import os
import shutil


def hf_model_copy(src: str, dst: str) -> str:
    """``src``'s config, weights and tokenizer.model in ``dst``, plus tokenizer.json and
    tokenizer_config.json; returns ``dst``."""
    import sentencepiece as spm
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    os.makedirs(dst, exist_ok=True)
    for name in sorted(os.listdir(src)):
        if name == "config.json" or name == "tokenizer.model" or name.endswith(".safetensors") \
                or name == "model.safetensors.index.json":
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    sp = spm.SentencePieceProcessor(model_file=os.path.join(src, "tokenizer.model"))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    long = [p for p in pieces if len(p) > 1 and not (p.startswith("<") and p.endswith(">"))]
    if long:
        raise ValueError(f"{src}/tokenizer.model: not character-level (pieces such as {long[:3]})")
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per char
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(os.path.join(dst, "tokenizer.json"))
    with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "pad_token": "</s>", "unk_token": "<unk>", "model_max_length": 64}, f)
    return dst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    print(hf_model_copy(args.model, args.out))


if __name__ == "__main__":
    main()
