"""SFT/prompt datasets, the resumable sampler, micro-batch packing and rank balancing."""
import itertools
import json
import random

import pytest

from megarl.data import (
    PromptDataset,
    ResumableSampler,
    SFTDataset,
    balance_across_ranks,
    pack_microbatches,
    train_sentencepiece,
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_sentencepiece(["12+34=46"], str(tmp_path_factory.mktemp("tok")), required_chars="0123456789+=")


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" if isinstance(r, dict) else r for r in rows))
    return str(path)


def test_sft_masks_exact(tmp_path, tok):
    path = write(tmp_path / "sft.jsonl", [{"prompt": "12+34=", "response": "46"}, "\n",
                                          {"q": "9+9=", "a": "18"}])
    with pytest.raises(KeyError, match=r"sft.jsonl:3: missing key\(s\) \['prompt', 'response'\]"):
        SFTDataset(path, tok, max_seq_len=32)
    path = write(tmp_path / "sft.jsonl", [{"prompt": "12+34=", "response": "46"}, "\n",
                                          {"prompt": "9+9=", "response": "18"}])
    ds = SFTDataset(path, tok, max_seq_len=32)
    assert len(ds) == 2 and ds.lengths == [10, 8]
    # bos 1 2 + 3 4 = | 4 6 eos
    assert ds[0]["input_ids"] == [1, 4, 5, 13, 6, 7, 14, 7, 9, 2]
    assert ds[0]["loss_mask"] == [0, 0, 0, 0, 0, 0, 0, 1, 1, 1]
    assert ds[1]["loss_mask"] == [0, 0, 0, 0, 0, 1, 1, 1]
    cut = SFTDataset(path, tok, max_seq_len=8)
    assert cut[0]["input_ids"] == [1, 4, 5, 13, 6, 7, 14, 7]
    assert cut[0]["loss_mask"] == [0, 0, 0, 0, 0, 0, 0, 1]
    nobos = SFTDataset(path, tok, max_seq_len=32, add_bos=False)
    assert nobos[1]["input_ids"] == [12, 13, 12, 14, 4, 11, 2]


def test_sft_custom_keys_and_bad_json(tmp_path, tok):
    path = write(tmp_path / "a.jsonl", [{"q": "1+1=", "a": "2"}])
    ds = SFTDataset(path, tok, max_seq_len=16, prompt_key="q", response_key="a")
    assert ds[0]["input_ids"] == [1, 4, 13, 4, 14, 5, 2]
    bad = write(tmp_path / "b.jsonl", [{"q": "1", "a": "1"}, "{oops\n"])
    with pytest.raises(ValueError, match="b.jsonl:2: invalid JSON"):
        SFTDataset(bad, tok, max_seq_len=16, prompt_key="q", response_key="a")


def test_prompt_dataset_meta(tmp_path, tok):
    path = write(tmp_path / "p.jsonl", [{"prompt": "1+2=", "answer": "3", "level": 1},
                                        {"prompt": "5+5=", "answer": 10}])
    ds = PromptDataset(path, tok)
    assert ds[0].prompt == "1+2=" and ds[0].answer == "3" and ds[0].meta == {"answer": "3", "level": 1}
    assert ds[0].prompt_ids == [1, 4, 13, 5, 14] and ds[1].index == 1 and ds[1].answer == 10
    assert PromptDataset(path)[0].prompt_ids is None
    with pytest.raises(KeyError, match="p.jsonl:1: missing key"):
        PromptDataset(path, answer_key="solution")
    assert PromptDataset(path, answer_key=None)[1].meta == {"answer": 10}


def test_sampler_epochs_and_exact_resume():
    s = ResumableSampler(10, seed=3)
    first = s.next_batch(10)
    assert first == [9, 6, 0, 2, 1, 4, 7, 5, 3, 8]  # numpy default_rng([3, 0]).permutation(10)
    second = s.next_batch(10)
    assert sorted(second) == list(range(10)) and second != first
    assert ResumableSampler(4, shuffle=False).next_batch(6) == [0, 1, 2, 3, 0, 1]

    a = ResumableSampler(10, seed=7)
    a.next_batch(13)  # straddles the epoch boundary
    state = a.state_dict()
    assert state == {"seed": 7, "epoch": 1, "position": 3, "n": 10}
    expected = a.next_batch(25)
    b = ResumableSampler(10, seed=999)  # the seed comes from the state
    b.load_state_dict(json.loads(json.dumps(state)))
    assert b.next_batch(25) == expected
    with pytest.raises(ValueError, match="10 samples, not 11"):
        ResumableSampler(11).load_state_dict(state)


def test_pack_microbatches_exact():
    lengths = [5, 3, 8, 2, 9, 1]
    assert pack_microbatches(lengths, 16) == [[0, 2], [1, 3, 5], [4]]
    assert pack_microbatches(lengths, 16, padded=False) == [[0, 3, 4], [1, 2, 5]]
    assert pack_microbatches(lengths, 16, min_microbatches=5) == [[0], [1, 5], [2], [3], [4]]
    assert pack_microbatches(lengths, 16, min_microbatches=99) == [[i] for i in range(6)]
    assert pack_microbatches([20, 3, 3], 10) == [[0], [1, 2]]  # oversized sample: alone
    assert pack_microbatches([], 10) == []


@pytest.mark.parametrize("padded", [True, False])
def test_pack_microbatches_invariants(padded):
    rng = random.Random(0)
    for trial in range(50):
        lengths = [rng.randint(1, 64) for _ in range(rng.randint(1, 80))]
        budget = rng.randint(32, 512)
        mbs = pack_microbatches(lengths, budget, padded=padded, min_microbatches=trial % 4 + 1)
        assert sorted(itertools.chain(*mbs)) == list(range(len(lengths)))
        for mb in mbs:
            cost = max(lengths[i] for i in mb) * len(mb) if padded else sum(lengths[i] for i in mb)
            assert cost <= budget or len(mb) == 1
        assert len(mbs) >= min(trial % 4 + 1, len(lengths))
        assert pack_microbatches(lengths, budget, padded=padded, min_microbatches=trial % 4 + 1) == mbs


def test_balance_across_ranks():
    lengths = [5, 3, 8, 2, 9, 1]
    assert balance_across_ranks(lengths, 2) == [[1, 3, 4], [0, 2, 5]]  # 14 and 14 tokens
    assert balance_across_ranks(lengths, 4, equal_size=True) == [[4, 5], [2, 3], [0], [1]]
    assert balance_across_ranks([7], 3) == [[0], [], []]
    rng = random.Random(1)
    lengths = [rng.randint(1, 1000) for _ in range(256)]
    parts = balance_across_ranks(lengths, 8, equal_size=True)
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert sorted(itertools.chain(*parts)) == list(range(256))
    assert [len(p) for p in parts] == [32] * 8
    assert max(loads) - min(loads) <= max(lengths)
    assert balance_across_ranks(lengths, 8, equal_size=True) == parts
