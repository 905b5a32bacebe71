"""Long addition written column by column: the built-in task whose answers are steps, each right or
wrong on its own, so a process reward model (PRM) has step labels to learn and be measured on.

A solution of `add 482+397=` is one line per column, right to left, then the sum::

    2+7+0=9        x + y + carry in = column sum (a digit 0 where a number has no more)
    8+9+0=17
    4+3+1=8
    =879

The error the task makes is a wrong carry: at one column the carry in is flipped (forgotten, or
one from nowhere), and every later line follows consistently from that column's wrong sum, so the
sum at the end is wrong too. (A column sum off by one was tried as a second error: a PRM trained
for `tests/learning/test_prm_learning.py`'s steps then reached 0.70 held-out step accuracy against
the majority label's 0.59, where carries alone give 0.98: checking sums needs far more training.) A step is right ("+") when it and every step before it are the ones
the true solution writes, wrong ("-") from the first wrong step on, as Math-Shepherd labels its
steps: a step after a wrong one cannot lead to the right answer.

For the PRM each step is followed by the placeholder token OpenRLHF's Math-Shepherd recipe uses
(`ки`, a special token of the task's tokenizer, so it is one token wherever it stands) and labelled
with `+` or `-`.
"""

from __future__ import annotations

import random
import re

PLACEHOLDER = "ки"  # OpenRLHF's `--placeholder_token` for Math-Shepherd data
POSITIVE, NEGATIVE = "+", "-"  # its `--reward_tokens`
MAX_DIGITS = 3
_PROMPT = re.compile(r"add (\d+)\+(\d+)=$")
_COLUMN = re.compile(r"(\d)\+(\d)\+([01])=(\d+)$")


def random_number(rng: random.Random, max_digits: int = MAX_DIGITS) -> int:
    digits = rng.randint(1, max_digits)  # the digit count first, so short numbers are as common as long ones
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def columns_of(a: int, b: int) -> list[tuple[int, int]]:
    """The digit pairs of a column addition, right to left."""
    xs, ys = str(a)[::-1], str(b)[::-1]
    width = max(len(xs), len(ys))
    return [(int(xs[i]) if i < len(xs) else 0, int(ys[i]) if i < len(ys) else 0) for i in range(width)]


def write_solution(columns: list[tuple[int, int]], flipped_at: int | None = None) -> str:
    """The lines of a column addition; with `flipped_at`, the carry into that column is flipped
    and everything after follows from it."""
    lines, carry, digits = [], 0, []
    for i, (x, y) in enumerate(columns):
        if i == flipped_at:
            carry = 1 - carry
        total = x + y + carry
        lines.append(f"{x}+{y}+{carry}={total}")
        digits.append(total % 10)
        carry = total // 10
    value = int((str(carry) if carry else "") + "".join(str(d) for d in reversed(digits)))
    return "\n".join([*lines, f"={value}"])


def generate(rng: random.Random) -> tuple[str, str]:
    a, b = random_number(rng), random_number(rng)
    return f"add {a}+{b}=", write_solution(columns_of(a, b))


def _columns_in(solution: str) -> list[tuple[int, int]] | None:
    """The digit pairs a solution's column lines name (None when a line is not one)."""
    matches = [_COLUMN.match(line) for line in solution.split("\n")[:-1]]
    return None if not matches or not all(matches) else [(int(m[1]), int(m[2])) for m in matches]


def wrong_carry(solution: str, rng: random.Random) -> str:
    """The same sum with the carry into one column (drawn) flipped: the task's near miss."""
    columns = _columns_in(solution)
    if columns is None:
        return solution  # not a solution of this task: near_miss draws again, then says so
    return write_solution(columns, flipped_at=rng.randrange(len(columns)))


def split_steps(response: str) -> list[str]:
    """A response's steps: its non-empty lines."""
    return [line.strip() for line in response.strip().split("\n") if line.strip()]


def step_labels(prompt: str, response: str) -> list[str]:
    """`+` for each step that, with every step before it, is the true solution's; `-` from the
    first that is not (a response's extra steps included)."""
    m = _PROMPT.search(prompt.strip())
    if m is None:
        raise ValueError(f"not a prompt of the column-addition task: {prompt!r}")
    truth = split_steps(write_solution(columns_of(int(m[1]), int(m[2]))))
    labels, right = [], True
    for i, step in enumerate(split_steps(response)):
        right = right and i < len(truth) and step == truth[i]
        labels.append(POSITIVE if right else NEGATIVE)
    return labels


def prm_text(prompt: str, response: str, placeholder: str = PLACEHOLDER) -> str:
    """A PRM's input: the prompt, then each step (a line of the response) followed by the
    placeholder, one per line."""
    return prompt + "".join(f"\n{step} {placeholder}" for step in split_steps(response))
