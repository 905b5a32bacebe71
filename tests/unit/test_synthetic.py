"""The synthetic tasks: generators are right, verifiers are exact, near misses are near, splits are clean."""

import random
import re

import pytest

from rlhf_core.data.synthetic import TASKS, SyntheticTask, build_splits, get_task, score


def _levenshtein(a: str, b: str) -> int:
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def _solve(prompt: str, name: str = "") -> str:
    """An independent solver for the prompt formats, to check the generators' answers."""
    if (m := re.fullmatch(r"add (\d+)\+(\d+)=", prompt)) and name == "addition_steps":
        a, b, lines, carry = int(m[1]), int(m[2]), [], 0
        for k in range(max(len(m[1]), len(m[2]))):  # column k: the 10^k digits
            x, y = a // 10**k % 10, b // 10**k % 10
            lines.append(f"{x}+{y}+{carry}={x + y + carry}")
            carry = (x + y + carry) // 10
        return "\n".join([*lines, f"={a + b}"])
    if m := re.fullmatch(r"add (\d+)\+(\d+)=", prompt):
        return str(int(m[1]) + int(m[2]))
    if m := re.fullmatch(r"reverse: ([A-Z]+)", prompt):
        return m[1][::-1]
    if m := re.fullmatch(r"sort: ([A-Z]+)", prompt):
        return "".join(sorted(m[1]))
    if m := re.fullmatch(r"mul (\d{3})\*(\d{2})=", prompt):
        return str(int(m[1]) * int(m[2]))
    raise AssertionError(f"unexpected prompt format {prompt!r}")


def test_registry_has_the_tasks_and_rejects_unknown_names():
    assert {"addition", "reverse", "sort"} <= set(TASKS)
    assert get_task("addition") is TASKS["addition"]
    with pytest.raises(ValueError, match="addition.*reverse.*sort"):
        get_task("multiplication")


@pytest.mark.parametrize("name", sorted(TASKS))
def test_generated_answers_are_correct(name):
    task, rng = get_task(name), random.Random(0)
    for _ in range(500):
        prompt, answer = task.make_example(rng)
        assert answer == _solve(prompt, name)
        assert 0 < len(answer) <= task.max_answer_len
        assert task.verify(answer, answer)


def test_score_is_exact_match_after_stripping():
    assert score("432", "432") == 1.0
    assert score("  432\n", "432") == 1.0
    assert score("4 32", "432") == 0.0
    assert score("4321", "432") == 0.0
    assert score("", "432") == 0.0
    task = get_task("reverse")
    assert task.verify(" MZQK ", "MZQK")
    assert not task.verify("mzqk", "MZQK")
    assert task.score("MZQK", "MZQK") == 1.0


@pytest.mark.parametrize("name", sorted(TASKS))
def test_near_miss_is_wrong_but_close(name):
    task, rng = get_task(name), random.Random(1)
    for _ in range(300):
        _, answer = task.make_example(rng)
        for _ in range(5):
            miss = task.near_miss(answer, rng)
            assert miss and miss != answer and not task.verify(miss, answer)
            close = _levenshtein(miss, answer) <= 2  # an adjacent swap costs 2
            if name in ("addition", "multiply"):
                assert miss.isdigit() and (miss == "0" or miss[0] != "0")
                close = close or abs(int(miss) - int(answer)) in (1, 10)
            elif name == "addition_steps":  # one carry flipped and followed through: the sum off by 10^k
                right, wrong = int(answer.rsplit("=", 1)[1]), int(miss.rsplit("=", 1)[1])
                close = abs(wrong - right) in (1, 10, 100) and len(miss.split("\n")) == len(answer.split("\n"))
            else:
                assert miss.isalpha() and miss.isupper()
            assert close, (answer, miss)


@pytest.mark.parametrize(("name", "answer"), [("addition", "0"), ("addition", "7"), ("reverse", "A"),
                                                    ("sort", "A")])
def test_near_miss_of_a_single_character(name, answer):
    task, rng = get_task(name), random.Random(2)
    assert all(task.near_miss(answer, rng) != answer for _ in range(50))


def test_splits_have_three_views_of_the_same_prompts():
    task = get_task("addition")
    splits = build_splits(task, seed=0, n_train=300, n_test=50)
    for split, n in (("train", 300), ("test", 50)):
        sft, pref, prompts = (splits[k][split] for k in ("sft", "preference", "prompts"))
        assert len(sft) == len(pref) == len(prompts) == n
        assert set(sft[0]) == {"prompt", "response", "answer"}
        assert set(pref[0]) == {"prompt", "chosen", "rejected"}
        assert set(prompts[0]) == {"prompt", "answer"}
        for s, p, q in zip(sft, pref, prompts, strict=True):
            assert s["prompt"] == p["prompt"] == q["prompt"] and s["answer"] == q["answer"]
            assert s["response"] == p["chosen"] == q["answer"] == _solve(q["prompt"])
            assert p["rejected"] != p["chosen"]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_train_and_test_are_disjoint_and_deduplicated(name):
    splits = build_splits(get_task(name), seed=3, n_train=2000, n_test=200)
    train = [r["prompt"] for r in splits["prompts"]["train"]]
    test = [r["prompt"] for r in splits["prompts"]["test"]]
    assert len(set(train)) == len(train) and len(set(test)) == len(test)
    assert not set(train) & set(test)


def test_splits_are_deterministic_per_seed():
    task = get_task("reverse")
    a = build_splits(task, seed=5, n_train=200, n_test=20)
    assert a == build_splits(task, seed=5, n_train=200, n_test=20)
    assert a != build_splits(task, seed=6, n_train=200, n_test=20)
    # The test set is drawn first from its own stream: more training data does not move it.
    assert a["prompts"]["test"] == build_splits(task, seed=5, n_train=400, n_test=20)["prompts"]["test"]


def test_splits_do_not_touch_global_random_state():
    random.seed(123)
    expected = random.random()
    random.seed(123)
    build_splits(get_task("addition"), seed=0, n_train=50, n_test=10)
    assert random.random() == expected


def test_impossible_split_sizes_fail_instead_of_hanging():
    coin = SyntheticTask(
        name="coin",
        description="two possible prompts",
        max_answer_len=1,
        generate=lambda rng: (rng.choice(("flip: H", "flip: T")), "H"),
        mutate=lambda answer, rng: "T",
    )
    assert len(build_splits(coin, seed=0, n_train=1, n_test=1)["sft"]["train"]) == 1
    with pytest.raises(ValueError, match="distinct prompts"):
        build_splits(coin, seed=0, n_train=2, n_test=1)


def test_demo_error_rate_corrupts_only_training_demonstrations():
    """The RL setting: a fraction of SFT training responses are near misses, flagged; the test split,
    the preference pairs and the prompts' answers stay exactly what they are without it."""
    task = get_task("sort")
    clean = build_splits(task, seed=3, n_train=400, n_test=50)
    noisy = build_splits(task, seed=3, n_train=400, n_test=50, demo_error_rate=0.3)
    assert noisy["prompts"] == clean["prompts"] and noisy["preference"] == clean["preference"]
    assert noisy["sft"]["test"] == clean["sft"]["test"]
    wrong = [r for r in noisy["sft"]["train"] if not r["demo_correct"]]
    assert 0.2 < len(wrong) / 400 < 0.4
    answers = {r["prompt"]: r["answer"] for r in clean["prompts"]["train"]}
    assert all(r["response"] != answers[r["prompt"]] for r in wrong)
    assert all(r["response"] == answers[r["prompt"]] for r in noisy["sft"]["train"] if r["demo_correct"])
    with pytest.raises(ValueError, match="demo_error_rate"):
        build_splits(task, seed=3, n_train=10, n_test=5, demo_error_rate=1.0)


def test_the_multiply_tasks_demonstrations_call_the_tool_in_a_quarter_of_the_rows():
    from rlhf_core.data.synthetic import TOOL_CALL_PREFIX, build_splits, get_task

    rows = build_splits(get_task("multiply"), seed=0, n_train=2000, n_test=10)["sft"]["train"]
    calls = [r["messages"] for r in rows if len(r["messages"]) == 4]
    assert 0.2 < len(calls) / len(rows) < 0.3
    for talk in calls:
        a, b = talk[0]["content"].removeprefix("mul ").removesuffix("=").split("*")
        assert talk[1]["content"] == f"{TOOL_CALL_PREFIX}{a}*{b}" and talk[2]["content"] == talk[3]["content"]
        assert talk[3]["content"] == str(int(a) * int(b))
    assert all(r["messages"][-1]["content"] == r["response"] for r in rows)
    # wrong demonstrations answer wrong, but the calculator's result in them is always the true product
    rows = build_splits(get_task("multiply"), seed=0, n_train=2000, n_test=10, demo_error_rate=0.5)["sft"]["train"]
    wrong = [r for r in rows if not r["demo_correct"] and len(r["messages"]) == 4]
    assert wrong and all(r["messages"][-1]["content"] == r["response"] != r["messages"][2]["content"] for r in wrong)
    for r in wrong:
        a, b = r["messages"][1]["content"].removeprefix(TOOL_CALL_PREFIX).split("*")
        assert r["messages"][2]["content"] == str(int(a) * int(b))
