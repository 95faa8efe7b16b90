"""scripts/bench_user_burst.py: the user's burst run per batching policy, every token compared."""
import random

from tests.script_loader import load_script


def test_unique_prompts_of_the_asked_length():
    prompts = load_script("bench_user_burst").prompts(random.Random(0), 32, 300)
    assert len({p[:16] for p in prompts}) == 32 and {len(p) for p in prompts} == {300}


def test_policies_run_the_same_prompts_to_the_same_tokens(capsys):
    result = load_script("bench_user_burst").main(
        ["--preset", "tiny", "--prompts", "3", "--prompt-len", "20", "--max-tokens", "3",
         "--runs", "2"])
    assert set(result) == {"fcfs", "feather-bandit"}
    assert all(r["same_tokens"] and len(r["walls"]) == 2 for r in result.values())
    assert "x fcfs (best against best)" in capsys.readouterr().out
