"""configs/tiny_grpo_long.yaml, the long-response recipe (issue 41 item 3), as shipped: every
correct answer is 1,003-1,199 tokens, and the run learns the one decision its model leaves to
chance - the separator, chosen at the answer's fourth token and checked ~1,100 tokens later -
without breaking the count in between. Three runs measured (two alone, one in a CI run beside
other tests): answers written with '+' 0.44 / 0.64 / 0.63 of steps 1-2's, 0.98 of the last three
steps' in each; reward over the first three steps 0.34 / 0.44 / 0.55, over the last three 0.79 /
0.77 / 0.75; 22-28 of 32 answers right to the end in their own separator in each of the last three
held-out accuracy 0.4 -> 0.7 in each. The separator share is what RL moves: the reward's "before"
already moves by step 3, so the thresholds on it are looser."""
import harness


def separator_share(rows: list[dict], step: int) -> float:
    """The share of a step's answers written with '+' (the rewarded separator) - the count's
    fourth character, after the first 3-digit number."""
    answers = [r["completion"] for r in rows if r["step"] == step]
    return sum(a[3:4] == "+" for a in answers) / len(answers)


def test_the_long_recipe_learns_its_decision_across_1000_token_answers(tmp_path):
    long = harness.REPO / "examples" / "tiny_long"
    run = harness.train(tmp_path / "run", "logging.dump_generations=true", recipe="tiny_grpo_long.yaml",
                        model=long / "model", data=long / "data" / "rl_prompts.jsonl",
                        eval_data=str(long / "data" / "eval_prompts.jsonl"), check=True)
    rows = {r["step"]: r for r in run.rows}
    steps = sorted(s for s in rows if s >= 1)
    assert steps == list(range(1, 11))
    for s in steps:  # what was trained: ~1,000-token answers (a wrong one may stop early)
        assert rows[s]["response_len/p50"] >= 1000 and rows[s]["response_len/max"] <= 1204, rows[s]
        assert rows[s]["trained_samples"] == 32
    gens = run.generations
    before = (separator_share(gens, 1) + separator_share(gens, 2)) / 2
    after = sum(separator_share(gens, s) for s in steps[-3:]) / 3
    assert before <= 0.75 and after >= 0.9 and after - before >= 0.2, (before, after)
    first = sum(rows[s]["reward"] for s in steps[:3]) / 3
    last = sum(rows[s]["reward"] for s in steps[-3:]) / 3
    assert last >= 0.6 and last - first >= 0.1, (first, last)
    # the count itself survives: most answers are right in whichever separator they chose
    for s in steps[-3:]:
        right = [g for g in gens if g["step"] == s and g["completion"][3:4] in "+,"
                 and g["completion"] == g["completion"][3].join(str(x) for x in range(int(g["completion"][:3]), 1000))]
        assert len(right) >= 16, (s, len(right))
    evals = [r["eval_accuracy"] for r in run.rows if "eval_accuracy" in r]
    assert len(evals) == 3 and evals[-1] > evals[0], evals  # greedy, 10 held-out prompts: 0.4 -> 0.7
