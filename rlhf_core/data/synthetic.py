"""Built-in synthetic tasks: deterministic generators with exact verifiers.

Every stage has to run, and be shown to learn, with no network and no GPU: a generator writes
(prompt, answer) pairs from a seeded ``random.Random`` and the verifier is exact match, so SFT
accuracy, RM accuracy, DPO win rate and RL reward need no judge model.

- Payloads are digits or UPPERCASE letters, one tiny-tokenizer token per character
  (``rlhf_core.models.tiny``), so a 4-layer model learns the algorithm, not a vocabulary.
- Sort is the pipeline's default: each of its near misses breaks order or counts, which a
  last-token reward model can check; on reverse it learns only the length-changing edits.
- ``near_miss`` (the rejected side of pairs) is one small edit of the right answer, plus ±1/±10
  carry errors for addition: hard negatives teach a reward model more than random text.
- Test is drawn first from its own stream and train skips its prompts: the test set does not move
  with ``n_train`` and is never trained on. No global random state; str seeds are hashed with
  SHA-512, so nothing depends on ``PYTHONHASHSEED``.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass

from rlhf_core.data import steps

Example = tuple[str, str]  # (prompt, answer)


def score(response: str, answer: str) -> float:
    """Exact-match reward: 1.0 when ``response`` equals ``answer`` after stripping whitespace."""
    return 1.0 if response.strip() == answer.strip() else 0.0


@dataclass(frozen=True)
class SyntheticTask:
    """A named generator of (prompt, answer) pairs with an exact verifier.

    ``generate(rng)`` draws one example; ``mutate(answer, rng)`` returns one small edit of an
    answer, or the answer itself when the edit it drew does not apply (``near_miss`` retries).
    ``max_answer_len`` bounds the answer's length in characters, which is also its length in
    tiny-tokenizer tokens: evaluation and rollouts size ``max_new_tokens`` from it (plus EOS).
    """

    name: str
    description: str
    max_answer_len: int
    generate: Callable[[random.Random], Example]
    mutate: Callable[[str, random.Random], str]
    # Tasks whose answers are steps: (prompt, response) -> a "+"/"-" label per step (process reward models)
    step_labels: Callable[[str, str], list[str]] | None = None
    # Tasks with a tool: (prompt, answer, rng) -> a demonstration conversation (SFT rows' "messages")
    conversation: Callable[[str, str, random.Random], list[dict]] | None = None

    @property
    def new_tokens(self) -> int:
        """What a generation of an answer needs: the longest answer and its EOS."""
        return self.max_answer_len + 1

    def make_example(self, rng: random.Random) -> Example:
        return self.generate(rng)

    def score(self, response: str, answer: str) -> float:
        return score(response, answer)

    def verify(self, response: str, answer: str) -> bool:
        return score(response, answer) == 1.0

    def near_miss(self, answer: str, rng: random.Random) -> str:
        """A plausible wrong answer: one small edit of ``answer``, never equal to it."""
        for _ in range(100):
            candidate = self.mutate(answer, rng)
            if candidate.strip() != answer.strip() and candidate:
                return candidate
        raise ValueError(f"{self.name}: could not make a near miss for {answer!r}")


# --- edits shared by both tasks ------------------------------------------------------------------


def _edit_string(text: str, rng: random.Random, alphabet: str) -> str:
    """One random character-level edit: substitute, swap neighbours, drop, or duplicate."""
    i = rng.randrange(len(text))
    kind = rng.choice(("substitute", "swap", "drop", "duplicate"))
    if kind == "substitute":
        return text[:i] + rng.choice(alphabet.replace(text[i], "")) + text[i + 1 :]
    if kind == "swap" and len(text) > 1:
        i = min(i, len(text) - 2)
        return text[:i] + text[i + 1] + text[i] + text[i + 2 :]
    if kind == "drop" and len(text) > 1:
        return text[:i] + text[i + 1 :]
    return text[: i + 1] + text[i:]  # duplicate (also the fallback for 1-char swap/drop)


# --- addition ------------------------------------------------------------------------------------

ADDITION_MAX_DIGITS = 3


def _addition_generate(rng: random.Random) -> Example:
    a = steps.random_number(rng, ADDITION_MAX_DIGITS)
    b = steps.random_number(rng, ADDITION_MAX_DIGITS)
    return f"add {a}+{b}=", str(a + b)


def _addition_mutate(answer: str, rng: random.Random) -> str:
    if rng.random() < 0.3:  # the carry mistakes a model actually makes
        candidate = str(int(answer) + rng.choice((-10, -1, 1, 10)))
    else:
        candidate = _edit_string(answer, rng, string.digits)
    # Reject things no adder writes (negatives, leading zeros); near_miss then draws again.
    if candidate.startswith("-") or (len(candidate) > 1 and candidate[0] == "0"):
        return answer
    return candidate


# --- reverse -------------------------------------------------------------------------------------

REVERSE_MIN_LEN, REVERSE_MAX_LEN = 8, 20


def _reverse_generate(rng: random.Random) -> Example:
    length = rng.randint(REVERSE_MIN_LEN, REVERSE_MAX_LEN)
    word = "".join(rng.choice(string.ascii_uppercase) for _ in range(length))
    return f"reverse: {word}", word[::-1]


def _edit_letters(answer: str, rng: random.Random) -> str:
    """The near-miss edit of the letter tasks (reverse, sort)."""
    return _edit_string(answer, rng, string.ascii_uppercase)


# --- sort ----------------------------------------------------------------------------------------

SORT_MIN_LEN, SORT_MAX_LEN = 5, 15


def _sort_generate(rng: random.Random) -> Example:
    # Repeats allowed: the model has to count, not only order.
    letters = [rng.choice(string.ascii_uppercase) for _ in range(rng.randint(SORT_MIN_LEN, SORT_MAX_LEN))]
    return f"sort: {''.join(letters)}", "".join(sorted(letters))


# --- multiply (with a calculator tool) ----------------------------------------------------------

# Three digits times two: beyond what a tiny model learns to do in its head from a few thousand
# examples, and one call of the calculator tool away (`rl/calculator_agent.py`). The tool's
# syntax is an assistant turn of its own, `calc: EXPRESSION`; its result comes back as a user turn.
TOOL_CALL_PREFIX = "calc: "
TOOL_DEMO_RATE = 0.25  # the demonstrations that call the tool; the rest answer in one turn


def _multiply_generate(rng: random.Random) -> Example:
    a, b = rng.randint(100, 999), rng.randint(10, 99)
    return f"mul {a}*{b}=", str(a * b)


def _multiply_conversation(prompt: str, answer: str, rng: random.Random) -> list[dict]:
    """A demonstration whose last turn is `answer` (the row's response: a near miss under
    `demo_error_rate`): with probability TOOL_DEMO_RATE the call and the tool's result (always the
    true product, as the calculator gives it) first; otherwise the answer at once."""
    if rng.random() >= TOOL_DEMO_RATE:
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    expression = prompt.removeprefix("mul ").removesuffix("=")
    a, b = expression.split("*")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": TOOL_CALL_PREFIX + expression},
            {"role": "user", "content": str(int(a) * int(b))}, {"role": "assistant", "content": answer}]


TASKS: dict[str, SyntheticTask] = {
    task.name: task
    for task in (
        SyntheticTask(
            name="addition",
            description=f"sum of two numbers of 1-{ADDITION_MAX_DIGITS} digits",
            max_answer_len=ADDITION_MAX_DIGITS + 1,
            generate=_addition_generate,
            mutate=_addition_mutate,
        ),
        SyntheticTask(
            name="reverse",
            description=f"reverse {REVERSE_MIN_LEN}-{REVERSE_MAX_LEN} uppercase letters",
            max_answer_len=REVERSE_MAX_LEN,
            generate=_reverse_generate,
            mutate=_edit_letters,
        ),
        SyntheticTask(
            name="addition_steps",
            description=f"sum of two numbers of 1-{steps.MAX_DIGITS} digits written column by column, a line per "
            "column and the sum (steps labelled for process reward models)",
            # a line per column ("9+9+1=19") and its newline, then the sum ("=1998")
            max_answer_len=steps.MAX_DIGITS * 9 + steps.MAX_DIGITS + 2,
            generate=steps.generate,
            mutate=steps.wrong_carry,
            step_labels=steps.step_labels,
        ),
        SyntheticTask(
            name="sort",
            description=f"sort {SORT_MIN_LEN}-{SORT_MAX_LEN} uppercase letters (repeats allowed)",
            max_answer_len=SORT_MAX_LEN,
            generate=_sort_generate,
            mutate=_edit_letters,
        ),
        SyntheticTask(
            name="multiply",
            description="a 3-digit number times a 2-digit one, with a calculator tool (SFT rows carry tool-use "
            f"conversations for --multiturn in a {TOOL_DEMO_RATE:.0%} share; RL: --agent_func_path calculator)",
            max_answer_len=5,
            generate=_multiply_generate,
            mutate=_addition_mutate,
            conversation=_multiply_conversation,
        ),
    )
}


def get_task(name: str) -> SyntheticTask:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(
            f"unknown synthetic task {name!r}; valid names: {', '.join(sorted(TASKS))}"
        ) from None


# --- splits --------------------------------------------------------------------------------------

# Duplicate draws in a row before giving up: the task spaces are far larger than any sensible
# split, so only a request close to the number of distinct prompts gets there.
MAX_DUPLICATE_DRAWS = 10_000


def _unique_examples(task: SyntheticTask, rng: random.Random, n: int, exclude: set[str]) -> list[Example]:
    examples: list[Example] = []
    seen = set(exclude)
    misses = 0
    while len(examples) < n:
        prompt, answer = task.make_example(rng)
        if prompt in seen:
            misses += 1
            if misses == MAX_DUPLICATE_DRAWS:
                raise ValueError(f"{task.name}: could not draw {n} distinct prompts (got {len(examples)})")
            continue
        misses = 0
        seen.add(prompt)
        examples.append((prompt, answer))
    return examples


def build_splits(
    task: SyntheticTask, seed: int, n_train: int, n_test: int, demo_error_rate: float = 0.0
) -> dict[str, dict[str, list[dict]]]:
    """Draw disjoint train/test examples and lay them out as the three kinds of data.

    Returns ``{"sft": {...}, "preference": {...}, "prompts": {...}}``, each ``{"train": rows,
    "test": rows}`` over the same prompts:
    sft rows ``{prompt, response, answer}`` (the answer: what a verifier checks the demonstration
    against, e.g. conditional SFT scoring the rows), preference rows ``{prompt, chosen, rejected}``
    (chosen is the right answer, rejected a near miss), prompt rows ``{prompt, answer}``. Prompts are
    raw task text; stages apply the chat template themselves.

    ``demo_error_rate`` makes that fraction of the *training* demonstrations near misses (own
    stream), so a sampled SFT policy errs about that often and RL has room; the verifier, the
    preference pairs and the test split stay correct. Each training row's ``"demo_correct"`` says
    whether its demonstration is right.
    """
    if not 0.0 <= demo_error_rate < 1.0:
        raise ValueError(f"demo_error_rate must be in [0, 1), got {demo_error_rate}")
    try:
        test = _unique_examples(task, random.Random(f"{seed}-test"), n_test, exclude=set())
        train = _unique_examples(task, random.Random(f"{seed}-train"), n_train, exclude={p for p, _ in test})
    except ValueError as e:  # more examples asked for than the task has: the sizes are the input at fault
        from rlhf_core.infra.settings import ConfigError

        raise ConfigError(f"--n_train {n_train} / --n_test {n_test}: {e}; ask for fewer") from None
    # Rejected answers come from their own stream, so the examples never depend on them.
    miss_rng = random.Random(f"{seed}-near-miss")

    error_rng = random.Random(f"{seed}-demo-errors")

    def demonstration(answer: str, split: str) -> dict:
        if split != "train" or not demo_error_rate:
            return {"response": answer}
        if error_rng.random() < demo_error_rate:
            return {"response": task.near_miss(answer, error_rng), "demo_correct": False}
        return {"response": answer, "demo_correct": True}

    talk_rng = random.Random(f"{seed}-conversations")

    def conversation(prompt: str, row: dict) -> dict:
        return {"messages": task.conversation(prompt, row["response"], talk_rng)} if task.conversation else {}

    splits: dict[str, dict[str, list[dict]]] = {"sft": {}, "preference": {}, "prompts": {}}
    for split, examples in (("train", train), ("test", test)):
        splits["sft"][split] = [{"prompt": p, **(d := demonstration(a, split)), "answer": a, **conversation(p, d)}
                                for p, a in examples]
        splits["preference"][split] = [
            {"prompt": p, "chosen": a, "rejected": task.near_miss(a, miss_rng)} for p, a in examples
        ]
        splits["prompts"][split] = [{"prompt": p, "answer": a} for p, a in examples]
    return splits
