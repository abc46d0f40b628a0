"""Reward plugins used by the e2e tests (loaded by import path, as users' plugins are)."""


def starts_with_one(prompt: str, completion: str, meta: dict) -> float:
    """1 when the completion starts with the digit 1: easy to learn, so RL must raise it fast."""
    return 1.0 if completion.strip().startswith("1") else 0.0


def exact_match_plus_one(prompt: str, completion: str, meta: dict) -> float:
    """1 + the demo's exact-match reward: the offset gives a fresh value head a large error to
    learn away (a critic test), while the advantages stay the demo's."""
    from megarl.rewards import arith_exact_match

    return 1.0 + arith_exact_match(prompt, completion, meta)


async def length_reward(prompt: str, completion: str, meta: dict) -> float:
    """An async reward (awaited by RewardCaller): the completion's length in characters."""
    return float(len(completion))


def faulty_reward(prompt: str, completion: str, meta: dict) -> float:
    """Misbehaves by the prompt's first digit: raises, hangs past the timeout, or returns NaN;
    otherwise the demo's exact-match reward."""
    import time

    from megarl.rewards import arith_exact_match

    first = prompt.strip()[:1]
    if first in "12":
        raise RuntimeError("verifier crashed")
    if first == "3":
        time.sleep(2.0)  # reward.timeout_s is far below this
    if first == "4":
        return float("nan")
    return arith_exact_match(prompt, completion, meta)


def pid_reward(prompt: str, completion: str, meta: dict) -> float:
    """The demo's exact-match reward; appends the id of the process that scored it to the file
    named by $MEGARL_TEST_PID_FILE (which process runs the rewards)."""
    import os

    from megarl.rewards import arith_exact_match

    with open(os.environ["MEGARL_TEST_PID_FILE"], "a") as f:
        f.write(f"{os.getpid()}\n")
    return arith_exact_match(prompt, completion, meta)


def never_returns(prompt: str, completion: str, meta: dict) -> float:
    """A verifier that hangs for good (with reward.timeout_s=0 nothing ends the call)."""
    import threading

    threading.Event().wait()
    return 0.0


def even_length(prompt: str, completion: str, meta: dict) -> float:
    """1 when the completion has an even number of characters: a mix of right and wrong answers
    for any model, decided by the text alone (so the tests can recompute every score)."""
    return 1.0 if len(completion) % 2 == 0 else 0.0


def stop_server_at_first_reward(prompt: str, completion: str, meta: dict) -> float:
    """SIGSTOPs the process $MEGARL_TEST_STOP_PID at its first call (the other requests of the
    step are still on that server): a server that hangs in the middle of a step."""
    import os
    import signal

    pid = int(os.environ["MEGARL_TEST_STOP_PID"])
    os.kill(pid, signal.SIGSTOP)
    return 0.0


def half_credit(prompt: str, completion: str, meta: dict) -> float:
    """0.5 for the demo's exact match: a second source's reward whose values (0, 0.5) tell its
    samples from the exact-match source's (0, 1) in a mixture (data.sources)."""
    from megarl.rewards import arith_exact_match

    return 0.5 * arith_exact_match(prompt, completion, meta)
